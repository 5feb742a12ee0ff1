"""The benchmarks' graph timing (benchmarks/common.py, ``--timing graph``): every call, with
all of its XLA work, stays inside the device loop (XLA's loop-invariant code motion is off
for that program), and a function whose output is not shaped as its first argument is
refused."""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import common  # noqa: E402


def _op(q, w):
    # w @ w does not depend on q: a loop-invariant computation that XLA would hoist
    return jnp.tanh(q @ w) + (w @ w)[: q.shape[0]]


def _entry(text: str) -> str:
    return text[text.index("ENTRY") :]


def test_chained_loop_keeps_every_call_in_the_loop():
    copies = [(jnp.ones((8, 8)), jnp.full((8, 8), 0.01 * (i + 1))) for i in range(2)]
    text = common.chained_loop(_op).lower(copies, jnp.int32(2)).compile().as_text()
    assert "while" in _entry(text)
    assert "while/body" not in _entry(text)  # nothing of the body hoisted out
    # the same loop with XLA's default passes hoists the invariant products (what the
    # option prevents): the check above can fail
    hoisting = jax.jit(common.chained_loop(_op).__wrapped__)
    assert "while/body" in _entry(hoisting.lower(copies, jnp.int32(2)).compile().as_text())


def test_time_graph_runs_the_chain():
    copies = [(jnp.ones((8, 8)), jnp.full((8, 8), 0.01 * (i + 1))) for i in range(3)]
    t = common.time_graph(_op, copies, target_s=0.002, samples=3, warmup_s=0.0)
    assert t["mode"] == "graph" and t["copies"] == 3 and t["median_s"] > 0
    # an iteration makes whole rounds over the copies, at least GRAPH_CALLS calls
    assert t["calls_per_iteration"] % 3 == 0
    assert common.GRAPH_CALLS <= t["calls_per_iteration"] < common.GRAPH_CALLS + 3
    # the loop's result is the chain's: each call given the one before's output
    x = copies[0][0]
    for _ in range(2 * 2):
        for c in copies:
            x = _op(x, c[1])
    loop = common.chained_loop(_op, 2)(copies, jnp.int32(2))
    assert jnp.allclose(loop, x, rtol=1e-5, atol=1e-5)
    row = common.measure(_op, copies, samples=3, target_s=0.002, timing="both")
    assert row["timing"]["mode"] == "graph" and row["us_dispatch"] > 0


def test_time_graph_refuses_an_output_of_another_shape():
    copies = [(jnp.ones((8, 8)), jnp.ones((8, 4)))]
    with pytest.raises(ValueError, match="first argument"):
        common.time_graph(lambda q, w: q @ w, copies, samples=1)
    with pytest.raises(ValueError, match="timing must be"):
        common.measure(_op, copies, samples=1, timing="host")
    # measure(): graph alone reports the refusal as the row's error; both keeps the
    # dispatch figure
    row = common.measure(lambda q, w: q @ w, copies, samples=1, target_s=1e-3, timing="graph")
    assert "first argument" in row["error"]
    row = common.measure(lambda q, w: q @ w, copies, samples=1, target_s=1e-3, timing="both")
    assert "first argument" in row["graph_skipped"] and row["us"] > 0


def test_layered_calls_chain_the_layers_and_share_the_plan():
    """bench_cascade.py --layers: a call runs the layers as the engine's step does (layer l's
    q the output of layer l - 1, its tables offset by l layers' pages in one pool, the
    lengths the same arrays), and what depends only on the lengths is compiled once, not
    once a layer."""
    import bench_cascade

    def op(q, pool, table, lens):
        rows = pool[table].sum() * q
        return jnp.tanh(rows) + jnp.sort(lens).astype(q.dtype)[0]

    q = jax.random.normal(jax.random.key(0), (4,))
    pool = jax.random.normal(jax.random.key(1), (3 * 5,))  # 3 layers of 5 pages
    table, lens = jnp.array([4, 0, 2], jnp.int32), jnp.array([3, 1, 2], jnp.int32)
    run = bench_cascade.layered(op, 3, 5, (2,))
    expected = q
    for layer in range(3):
        expected = op(expected, pool, table + 5 * layer, lens)
    assert jnp.allclose(run(q, pool, table, lens), expected)
    assert bench_cascade.layered(op, 1) is op
    text = jax.jit(run).lower(q, pool, table, lens).compile().as_text()
    assert text.count(" sort(") == 1  # the lengths' sort once for three layers

    batch = bench_cascade.batches(4, 32, 16, 16)[0]
    kw = dict(hq=4, hkv=2, d=16, page=16, layout="bshd", dtype=jnp.float32)
    one, _ = bench_cascade.build_inputs(0, batch, **kw)
    casc, paged = bench_cascade.build_layered(0, batch, 2, **kw)
    assert casc[1].shape[0] == 2 * one[1].shape[0]  # two layers' pages in one pool
    assert casc[1] is paged[1] and casc[2] is paged[2]  # the same pool for both ops
    assert all(jnp.array_equal(a, b) for a, b in zip(casc[3:], one[3:], strict=True))


def test_kernel_summary_unions_and_idle_before_each_kernel():
    """The profile's figures: the span, the time some kernel ran (overlaps counted once), and
    per kernel name the GPU's idle time just before its launches, per step."""
    events = {
        (0, 10, "a"),
        (12, 5, "b"),  # 2 ns idle before it
        (15, 4, "c"),  # overlaps b: no idle
        (25, 5, "a"),  # idle from 19 (c's end) to 25
        (27, 10, "d"),  # overlaps a
        (40, 2, "b"),  # idle from 37
    }
    s = common.kernel_summary(events, steps=2, top=3)
    assert s["span_us"] == pytest.approx(42e-3 / 2)
    assert s["busy_us"] == pytest.approx((10 + 7 + 12 + 2) * 1e-3 / 2)
    assert s["kernels_per_step"] == 3
    top = {k["name"]: k for k in s["top"]}
    assert set(top) == {"a", "d", "b"}  # by time: a 15, d 10, b 7, c 4
    assert top["a"]["idle_before_us_per_step"] == pytest.approx(6e-3 / 2)
    assert top["b"]["idle_before_us_per_step"] == pytest.approx((2 + 3) * 1e-3 / 2)
    assert top["d"]["idle_before_us_per_step"] == 0
    assert top["a"]["calls_per_step"] == 1
    assert common.kernel_summary(set()) is None
    assert "idle before" in common.profile_lines(s)


_HLO = """HloModule jit_step, entry_computation_layout={()}

%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

ENTRY %main.9 (a: f32[4], b: s32[2]) -> (f32[4], f32[4]) {
  %a = f32[4]{0} parameter(0)
  %b = s32[2]{0} parameter(1)
  %fusion.1 = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation
  %ffi_call.2 = (f32[4]{0}, f32[1]{0}) custom-call(%fusion.1), custom_call_target="attn", x=1
  %get-tuple-element.3 = f32[4]{0} get-tuple-element(%ffi_call.2), index=0
  %gemm_fusion_dot.4 = f32[2,4]{1,0} fusion(%get-tuple-element.3), kind=kCustom, calls=%f
  %ffi_call.5 = (f32[4]{0}, f32[1]{0}) custom-call(%fusion.1, %b), custom_call_target="attn"
  %copy.6 = f32[4]{0} copy(%a)
  ROOT %tuple.7 = (f32[4]{0}, f32[4]{0}) tuple(%copy.6, %fusion.1)
}
"""


def test_xla_kernels_lists_the_entry_launches():
    """benchmarks/xla_kernels.py reads an optimised module's entry launches (not its
    parameters, tuples and views) and counts them from one attention call to the next."""
    import xla_kernels

    launches = xla_kernels.entry_launches(_HLO)
    assert [(x.name, x.kind) for x in launches] == [
        ("fusion.1", "fusion:kLoop"),
        ("ffi_call.2", "custom-call:attn"),
        ("gemm_fusion_dot.4", "fusion:kCustom"),
        ("ffi_call.5", "custom-call:attn"),
        ("copy.6", "copy"),
    ]
    assert launches[2].shape == "f32[2,4]{1,0}"
    assert xla_kernels.per_layer(launches, "custom-call:attn") == [2, 2]
    # A module compiled here: every launch of its entry is a kernel kind the parser names.
    text = jax.jit(lambda x, w: jnp.tanh(x @ w) + 1).lower(jnp.ones((4, 4)), jnp.ones((4, 4)))
    kinds = {x.kind.split(":")[0] for x in xla_kernels.entry_launches(text.compile().as_text())}
    assert kinds and not kinds & xla_kernels._NOT_LAUNCHES


def test_xla_kernels_finds_the_loop_body():
    """xla_kernels.py --engine-loop lists the launches of the program's while body."""
    import xla_kernels

    def f(x):
        return jax.lax.fori_loop(0, jnp.int32(x[0, 0]), lambda i, y: jnp.tanh(y @ y), x)

    text = jax.jit(f).lower(jnp.ones((8, 8))).compile().as_text()
    body = xla_kernels.while_body(text)
    assert f"%{body} " in text
    launches = xla_kernels.entry_launches(text, body)
    assert launches and all(x.kind.split(":")[0] not in xla_kernels._NOT_LAUNCHES for x in launches)
    with pytest.raises(ValueError, match="no while loop"):
        xla_kernels.while_body(_HLO)
