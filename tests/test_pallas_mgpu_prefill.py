"""The Mosaic GPU prefix prefill (jaxattn.pallas.prefill_mgpu) against the reference: layouts,
dtypes, GQA groups packed into the tile rows (1, 4, 7, 8, 16), page sizes and steps, empty
requests and padding rows, NaN in every slot it must not read, the memory-safety contract,
refusals.

Every case runs in Mosaic GPU's interpret mode (the CPU, and the GPU too), which runs the two
products as jnp.dot: the kernel's barriers, TMA page copies, tile records, masks and online
softmax are what it checks. On an sm_90 GPU the same cases also run compiled. On any machine
the kernel is lowered for CUDA (jax.export with platforms=["cuda"]: the whole Mosaic GPU
lowering to its MLIR module); what only the compile to machine code can reject is left to the
GPU run. Skipped where this JAX has no Mosaic GPU lowering with an interpret mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, interpreter_device, poisoned_pages
from jax import export

import jaxattn
from jaxattn import layout as L
from jaxattn.pallas import prefill_mgpu

if prefill_mgpu.available() is not None:
    pytest.skip(prefill_mgpu.available(), allow_module_level=True)

MODES = [True] + ([False] if prefill_mgpu.is_sm90() else [])
# (interpret, form): interpret mode runs the one-warpgroup form (the warp-specialised one's
# three warpgroups interpret ~3x slower, ~10x before conftest.py compiled their program
# once: test_warp_specialized_interpreted covers it); compiled, both forms.
RUNS = [(True, "single")] + (
    [(False, "warp_specialized"), (False, "single")] if prefill_mgpu.is_sm90() else []
)


def poisoned_case(seed, *, hq, hkv, d, page, width, lq, prefix, layout, dtype, pad_rows=3):
    """q (with ``pad_rows`` rows past the last request), caches, cu_seqlens_q, tables,
    seq_lens: NaN in every pool slot no request reads (pages no table names, the tails of
    last pages) and table columns past each request naming a NaN page."""
    rng = np.random.default_rng(seed)
    lk = [a + b for a, b in zip(lq, prefix, strict=True)]
    pages = sum(-(-n // page) for n in lk) + 3
    q = jnp.asarray(rng.standard_normal((sum(lq) + pad_rows, hq, d)), dtype)
    k, v, tables = poisoned_pages(rng, lk, page=page, pages=pages, width=width, hkv=hkv, d=d)
    k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    if layout == "bhsd":
        k, v = L.convert(k, v, "bshd", "bhsd")
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lq)]), jnp.int32)
    return q, k, v, cu, jnp.asarray(tables), jnp.asarray(lk, jnp.int32)


def reference(q, k, v, cu, tables, lens, **kw):
    return jaxattn.prefix_prefill(q, k, v, cu, tables, lens, implementation="reference", **kw)


CASES = [
    # layout, dtype, hq/hkv, d, page, lq, prefix, other keywords
    ("bshd", jnp.bfloat16, (8, 2), 64, 16, [3, 17, 40], [5, 64, 0], {}),
    ("bhsd", jnp.float16, (8, 8), 64, 8, [1, 70, 0], [33, 0, 9], {}),
    ("bshd", jnp.bfloat16, (28, 4), 128, 16, [5, 30, 1], [200, 17, 129], {}),
    ("bshd", jnp.bfloat16, (16, 2), 128, 32, [129, 2], [0, 300], dict(stages=3)),
    ("bhsd", jnp.bfloat16, (32, 2), 64, 16, [8, 9], [130, 0], dict(pages_per_step=8)),
]


@pytest.mark.parametrize("interpret, form", RUNS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference_with_unread_slots_poisoned(case, interpret, form):
    layout, dtype, (hq, hkv), d, page, lq, prefix, kw = CASES[case]
    q, k, v, cu, tables, lens = poisoned_case(
        case, hq=hq, hkv=hkv, d=d, page=page, width=24, lq=lq, prefix=prefix, layout=layout,
        dtype=dtype,
    )  # fmt: skip
    out = prefill_mgpu.prefix_prefill(
        q, k, v, cu, tables, lens, layout=layout, interpret=interpret, form=form, **kw
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = reference(q, k, v, cu, tables, lens, layout=layout)
    assert_close(out, ref)
    np.testing.assert_array_equal(np.asarray(out[-3:], np.float32), 0.0)  # padding rows


@pytest.mark.parametrize("interpret, form", RUNS)
def test_soft_cap_and_scale(interpret, form):
    q, k, v, cu, tables, lens = poisoned_case(
        7, hq=4, hkv=1, d=64, page=16, width=8, lq=[20, 3], prefix=[70, 14], layout="bshd",
        dtype=jnp.bfloat16,
    )  # fmt: skip
    # Without a cap the warp-specialised form folds the scale into the exponent.
    configs = [dict(scale=0.3, soft_cap=5.0)] + ([dict(scale=0.3)] if not interpret else [])
    for kw in configs:
        out = prefill_mgpu.prefix_prefill(
            q, k, v, cu, tables, lens, interpret=interpret, form=form, **kw
        )
        assert_close(out, reference(q, k, v, cu, tables, lens, **kw))


WS_INTERPRETED = [
    # GQA 4 (16 tokens a warpgroup), bshd, bf16; request 2 gets fewer keys than queries
    dict(
        case=dict(hq=4, hkv=1, d=64, page=16, width=8, lq=[12, 34, 6], prefix=[40, 40, 0],
                  layout="bshd", dtype=jnp.bfloat16),
        poison=2, pages_per_step=4, stages=3,
    ),
    # GQA 7 (9 tokens a warpgroup, 63 of its 64 rows), bhsd, float16, page 8
    dict(
        case=dict(hq=14, hkv=2, d=64, page=8, width=12, lq=[20, 3], prefix=[60, 9],
                  layout="bhsd", dtype=jnp.float16),
        poison=None, pages_per_step=8, stages=2,
    ),
]  # fmt: skip


@pytest.mark.parametrize("run", range(len(WS_INTERPRETED)))
def test_warp_specialized_interpreted(run):
    """The warp-specialised kernel in interpret mode (its three warpgroups as threads, the
    ring's release barriers, the consumers' turns, q read and the output written in their
    own layout by power-of-two pieces): GQA heads in head-major rows (7 heads: 9 tokens and
    an idle row a warpgroup), a tile whose first warpgroup stops a step before the second
    (the flush: the first run's request 1), tiles whose second warpgroup holds no token,
    page tails and unused pages poisoned, a request with fewer keys than queries (NaN rows by
    the contract, no step of its tile below 0) and rows past the last request (zeros).

    Interpreted on the CPU device (on a GPU machine too), with the tile records built first,
    outside the kernel's program (``ws_records``): JAX's GPU interpreter runs each warpgroup
    as a program of its own that waits for the others, and it stalled on an H200 machine
    with the programs on the GPU (jax 0.11) and on the CPU when the records were computed
    in the same program (jax 0.10). Compiled on sm_90 the entry point runs whole (RUNS)."""
    spec = WS_INTERPRETED[run]
    case = spec["case"]
    layout, group = case["layout"], case["hq"] // case["hkv"]
    cpu = interpreter_device(True)
    q, k, v, cu, tables, lens = jax.device_put(poisoned_case(12, **case), cpu)
    rows = sum(case["lq"])
    with jax.default_device(cpu):
        ref = np.asarray(reference(q, k, v, cu, tables, lens, layout=layout), np.float32)
        bad = spec["poison"]
        if bad is not None:
            lens = lens.at[bad].set(2)
        geom = L.get(layout, pool=True).geometry(k, v)
        info = prefill_mgpu.ws_records(
            cu, tables, lens, num_rows=q.shape[0], group=group, geom=geom
        )
        out = prefill_mgpu._ws_kernel_call(
            q, k, v, prefill_mgpu._table_rows(tables), info, geom=geom, layout=layout,
            group=group, scale=case["d"] ** -0.5, soft_cap=None,
            pages_per_step=spec["pages_per_step"], stages=spec["stages"], interpret=True,
        )  # fmt: skip
        out = np.asarray(out, np.float32)
    cu = np.asarray(cu)
    good = np.ones(rows, bool)
    if bad is not None:
        good[cu[bad] : cu[bad + 1]] = False
        assert np.isnan(out[cu[bad] : cu[bad + 1]]).all()
    assert_close(out[:rows][good], ref[:rows][good], dtype=case["dtype"])
    np.testing.assert_array_equal(out[rows:], 0.0)


@pytest.mark.parametrize("seed", range(6))
def test_ws_records_cover_every_row_once(seed):
    """The warp-specialised form's tile records against a naive model: every row of q is in
    exactly one tile, which writes attention for a valid request's rows (with its table row
    and key count), NaN for a poisoned request's and zeros past the last request (NaN
    everywhere when cu_seqlens_q is broken); the tiles follow the segments, each segment's
    from its last."""
    rng = np.random.default_rng(seed)
    B, group = int(rng.integers(1, 7)), int(rng.choice([1, 2, 4, 7, 16]))
    lq = rng.integers(0, 70, B)
    lq[rng.random(B) < 0.2] = 0
    T = int(lq.sum()) + int(rng.integers(0, 40))
    cu = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    if seed == 5:
        cu[-1] = T + 5  # the last request runs past q: its rows inside q are poisoned
    lens = (lq + rng.integers(0, 300, B)).astype(np.int32)
    ok = rng.random(B) < 0.7
    structural = seed != 4
    info = prefill_mgpu._ws_records(
        jnp.asarray(cu), jnp.asarray(lens), jnp.asarray(ok), structural, T=T, group=group,
        capacity=512,
    )  # fmt: skip
    info = np.asarray(info)
    tpt = 2 * prefill_mgpu.tokens_per_half(group)
    assert info.shape[0] == -(-T // tpt) + B + 1
    owner = np.full(T, -1)
    for t, (_, tok0, n, _, computes, start, mode) in enumerate(info[:, :7]):
        for r in range(start + tok0, start + min(tok0 + tpt, n)):
            assert owner[r] == -1, f"row {r} in two tiles"
            owner[r] = t
        assert computes == (mode == 0 and n > tok0)
    assert (owner >= 0).all()
    for r in range(T):
        b, _, _, lk, _, _, mode = info[owner[r], :7]
        req = np.searchsorted(cu[1:], r, side="right")
        if not structural:
            assert mode == 2
        elif req >= B or r >= min(cu[-1], T):
            assert mode == 1
        elif not ok[req]:
            assert mode == 2
        else:
            assert (mode, b, lk) == (0, req, min(lens[req], 512))
    # Segment order, each segment's tiles from its last: rows of q by (segment first row,
    # -tile); records that write nothing (n == 0) at the end.
    writes = info[:, 2] > 0
    assert not writes[writes.argmin() :].any() or writes.all()
    order = [(start, -tok0) for _, tok0, n, _, _, start, _ in info[writes, :7]]
    assert order == sorted(order)


@pytest.mark.parametrize("interpret, form", RUNS)
def test_memory_safety_contract(interpret, form):
    """A bad page id among the pages a request reads, a length past the table, fewer keys
    than queries: that request's rows alone are NaN; a bad id past its keys is never read; a
    broken cu_seqlens_q makes every row NaN."""
    q, k, v, cu, tables, lens = poisoned_case(
        3, hq=4, hkv=2, d=64, page=16, width=5, lq=[9, 9, 5, 7, 4], prefix=[31, 40, 20, 30, 8],
        layout="bshd", dtype=jnp.bfloat16,
    )  # fmt: skip
    k = jnp.nan_to_num(k)  # finite everywhere: only the contract may make NaN here
    v = jnp.nan_to_num(v)
    ref = np.asarray(reference(q, k, v, cu, tables, lens), np.float32)  # before the damage
    tables = tables.at[0, 2].set(10_000)  # read by request 0 (40 keys: pages 0..2)
    tables = tables.at[2, 4].set(-5)  # past request 2's 25 keys: never read
    lens = lens.at[1].set(5 * 16 + 1)  # over capacity
    lens = lens.at[3].set(3)  # fewer keys than its 7 queries
    run = lambda *a: prefill_mgpu.prefix_prefill(*a, interpret=interpret, form=form)  # noqa: E731
    out = np.asarray(run(q, k, v, cu, tables, lens), np.float32)
    cu_ = np.asarray(cu)
    for b, bad in enumerate([True, True, False, True, False]):
        rows = out[cu_[b] : cu_[b + 1]]
        if bad:
            assert np.isnan(rows).all(), b
        else:
            assert not np.isnan(rows).any(), b
            assert_close(rows, ref[cu_[b] : cu_[b + 1]], dtype=jnp.bfloat16)
    broken = cu.at[2].set(cu[1] - 1)
    out = run(q, k, v, broken, tables, lens)
    assert np.isnan(np.asarray(out, np.float32)).all()


def test_refusals():
    q = jnp.zeros((4, 4, 64), jnp.bfloat16)
    k = jnp.zeros((4, 16, 2, 64), jnp.bfloat16)
    cu, t, n = jnp.asarray([0, 4], jnp.int32), jnp.zeros((1, 2), jnp.int32), jnp.full((1,), 4)
    f = prefill_mgpu.prefix_prefill
    with pytest.raises(NotImplementedError, match="bfloat16/float16"):
        f(q.astype(jnp.float32), k.astype(jnp.float32), k.astype(jnp.float32), cu, t, n)
    with pytest.raises(NotImplementedError, match="head_dim a multiple of 64"):
        f(q[..., :32], k[..., :32], k[..., :32], cu, t, n)
    with pytest.raises(NotImplementedError, match="page_size a multiple of 8"):
        f(q, k[:, :4], k[:, :4], cu, t, n)
    with pytest.raises(NotImplementedError, match="layouts"):
        f(q, *L.convert(k, k, "bshd", "vllm"), cu, t, n, layout="vllm")
    with pytest.raises(ValueError, match="stages"):
        f(q, k, k, cu, t, n, stages=1)
    with pytest.raises(ValueError, match="multiple of 64"):
        f(q, k, k, cu, t, n, pages_per_step=2)
    with pytest.raises(NotImplementedError, match="8192 pages"):
        f(q, k, k, cu, jnp.zeros((1, 8193), jnp.int32), n)
    with pytest.raises(ValueError, match="shared memory"):
        f(q, k, k, cu, t, n, form="warp_specialized", stages=8, pages_per_step=8)
    with pytest.raises(ValueError, match="form"):
        f(q, k, k, cu, t, n, form="pingpong")
    # Through the public op: a token pool (extend_attention) has no pages to copy.
    cfg = jaxattn.pallas.ExtendConfig(lowering="mosaic_gpu")
    pool = jnp.zeros((8, 2, 64), jnp.bfloat16)
    idx = jnp.arange(4, dtype=jnp.int32)
    with pytest.raises(NotImplementedError, match="paged caches"):
        jaxattn.extend_attention(q, pool, pool, cu, cu, idx, implementation="pallas", config=cfg)
    with pytest.raises(ValueError, match="lowering"):
        jaxattn.pallas.ExtendConfig(lowering="mosaic")


_H200 = dict(layout="bshd", dtype=jnp.bfloat16, heads=(32, 8), d=128, page=16)


@pytest.mark.parametrize(
    "kw",
    [
        _H200,
        _H200 | dict(stages=3, pages_per_step=8, form="single"),
        _H200 | dict(stages=4, pages_per_step=4),
        _H200 | dict(form="single"),
        _H200 | dict(width=512),  # a table row of more than 256 pages: copied as [16, 32]
        _H200 | dict(width=512, form="single"),
        dict(layout="bhsd", dtype=jnp.float16, heads=(8, 8), d=64, page=8),
        dict(layout="bshd", dtype=jnp.bfloat16, heads=(28, 4), d=128, page=32, cap=5.0),
    ],
)
def test_lowers_for_cuda(kw):
    """The compiled kernel's whole Mosaic GPU lowering (every primitive, register layout and
    copy size), on any machine: jax.export for CUDA with interpret=False."""
    kw = dict(kw)
    layout, dtype, (hq, hkv), d, page = (
        kw.pop(n) for n in ("layout", "dtype", "heads", "d", "page")
    )
    cap = kw.pop("cap", None)
    batch, total, width = 4, 600, kw.pop("width", 64)
    pool = (256, page, hkv, d) if layout == "bshd" else (256, hkv, page, d)
    args = (
        jax.ShapeDtypeStruct((total, hq, d), dtype),
        jax.ShapeDtypeStruct(pool, dtype),
        jax.ShapeDtypeStruct(pool, dtype),
        jax.ShapeDtypeStruct((batch + 1,), jnp.int32),
        jax.ShapeDtypeStruct((batch, width), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )

    def f(q, k, v, cu, t, n):
        return prefill_mgpu.prefix_prefill(
            q, k, v, cu, t, n, layout=layout, soft_cap=cap, interpret=False, **kw
        )

    exported = export.export(jax.jit(f), platforms=["cuda"])(*args)
    assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.parametrize("interpret", MODES)
def test_public_op_with_mosaic_gpu_lowering(interpret):
    """jaxattn.prefix_prefill(implementation="pallas", config=ExtendConfig(lowering=
    "mosaic_gpu")) runs this kernel (compiled on sm_90, interpreted elsewhere), FP8 caches with
    their scales included."""
    if interpret and jax.default_backend() != "cpu":
        pytest.skip("the public op compiles on a GPU; interpret mode is tested above")
    q, k, v, cu, tables, lens = poisoned_case(
        11, hq=8, hkv=2, d=64, page=16, width=12, lq=[24, 1, 50], prefix=[100, 0, 13],
        layout="bshd", dtype=jnp.bfloat16,
    )  # fmt: skip
    cfg = jaxattn.pallas.ExtendConfig(lowering="mosaic_gpu")
    out = jaxattn.prefix_prefill(q, k, v, cu, tables, lens, implementation="pallas", config=cfg)
    assert_close(out, reference(q, k, v, cu, tables, lens))
    ks, vs = jnp.asarray([0.5, 2.0], jnp.float32), jnp.asarray([1.5, 0.25], jnp.float32)
    k8, v8 = fp8_cache(k, v, ks, vs, jnp.float8_e4m3fn)
    kw = dict(k_scale=ks, v_scale=vs)
    out = jaxattn.prefix_prefill(
        q, k8, v8, cu, tables, lens, implementation="pallas", config=cfg, **kw
    )
    assert_close(out, reference(q, k8, v8, cu, tables, lens, **kw))


def fp8_cache(k, v, k_scale, v_scale, fmt):
    """The caches quantised per KV head (bshd: the head is axis 2)."""
    k8 = (k.astype(jnp.float32) / k_scale[None, None, :, None]).astype(fmt)
    v8 = (v.astype(jnp.float32) / v_scale[None, None, :, None]).astype(fmt)
    return k8, v8


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("fmt", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_caches(fmt, interpret):
    """FP8 caches with per-KV-head scales: each step widened to float16 in shared memory, q
    moved to float16 by a power of two per KV head; NaN codes in unread slots stay out."""
    q, k, v, cu, tables, lens = poisoned_case(
        5, hq=8, hkv=2, d=64, page=16, width=8, lq=[3, 17, 40], prefix=[5, 64, 0],
        layout="bshd", dtype=jnp.bfloat16,
    )  # fmt: skip
    ks, vs = jnp.asarray([0.5, 2.0], jnp.float32), jnp.asarray([1.5, 0.25], jnp.float32)
    k8, v8 = fp8_cache(k, v, ks, vs, fmt)
    kw = dict(k_scale=ks, v_scale=vs)
    out = prefill_mgpu.prefix_prefill(q, k8, v8, cu, tables, lens, interpret=interpret, **kw)
    assert_close(out, reference(q, k8, v8, cu, tables, lens, **kw))
    np.testing.assert_array_equal(np.asarray(out[-3:], np.float32), 0.0)
    with pytest.raises(NotImplementedError, match="FP8 caches only"):
        prefill_mgpu.prefix_prefill(q, k, v, cu, tables, lens, interpret=interpret, **kw)


@pytest.mark.parametrize("fmt, d", [(jnp.float8_e4m3fn, 128), (jnp.float8_e5m2, 64)])
def test_fp8_lowers_for_cuda(fmt, d):
    """The FP8 path's lowering (the widening of the ring's codes to float16 tiles)."""
    pool = (256, 16, 8, d)
    args = (
        jax.ShapeDtypeStruct((600, 32, d), jnp.bfloat16),
        jax.ShapeDtypeStruct(pool, fmt),
        jax.ShapeDtypeStruct(pool, fmt),
        jax.ShapeDtypeStruct((5,), jnp.int32),
        jax.ShapeDtypeStruct((4, 64), jnp.int32),
        jax.ShapeDtypeStruct((4,), jnp.int32),
        jax.ShapeDtypeStruct((8,), jnp.float32),
        jax.ShapeDtypeStruct((8,), jnp.float32),
    )

    def f(q, k, v, cu, t, n, ks, vs):
        return prefill_mgpu.prefix_prefill(
            q, k, v, cu, t, n, interpret=False, k_scale=ks, v_scale=vs
        )

    exported = export.export(jax.jit(f), platforms=["cuda"])(*args)
    assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_default_lowering(kv_dtype):
    """implementation="pallas" with no config: the Mosaic GPU kernel for a 16-bit cache when
    compiled on sm_90, the Triton-lowered one for FP8 caches, scaled calls, other GPUs and
    the CPU interpreter."""
    from jaxattn import ops
    from jaxattn.pallas import IMPLEMENTATIONS

    q = jnp.zeros((10, 8, 64), jnp.bfloat16)
    k = jnp.zeros((4, 16, 2, 64), kv_dtype)
    cu, tables, lens = jnp.array([0, 10]), jnp.zeros((1, 4), jnp.int32), jnp.array([10])
    impl = IMPLEMENTATIONS["prefix_prefill"]
    fp8 = kv_dtype != jnp.bfloat16
    scales = dict(k_scale=0.5, v_scale=0.5) if fp8 else {}
    config = impl.heuristic_config(ops.PREFIX_PREFILL.bind(q, k, k, cu, tables, lens, **scales))
    mosaic = prefill_mgpu.is_sm90() and jax.default_backend() == "gpu" and not fp8
    assert config.lowering == ("mosaic_gpu" if mosaic else "triton")
    # A bf16 cache with q's scale (the mixed mode): the Triton kernel applies it.
    q8 = q.astype(jnp.float8_e4m3fn)
    args = ops.PREFIX_PREFILL.bind(
        q8, k, k, cu, tables, lens, q_scale=2.0, out_dtype=jnp.bfloat16, **scales
    )
    assert impl.heuristic_config(args).lowering == "triton"
