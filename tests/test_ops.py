"""Public ops: input validation (errors name the argument) and backend dispatch."""

import dataclasses
import itertools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, expected_decode, make_extend, make_paged_decode

import jaxattn
from jaxattn import native, ops
from jaxattn import pallas as P
from jaxattn.backend import Implementation


@pytest.fixture(scope="module")
def paged():
    rng = np.random.default_rng(0)
    return make_paged_decode(rng, [5, 17], num_q_heads=8, num_kv_heads=2, head_dim=16, page_size=4)


@pytest.fixture(scope="module")
def ext():
    rng = np.random.default_rng(1)
    return make_extend(rng, [3, 0], [2, 4], num_q_heads=4, num_kv_heads=2, head_dim=8)


def _paged_args(c):
    return (c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens)


def test_public_paged_attention_reference(paged):
    out = jaxattn.paged_attention(*_paged_args(paged), implementation="reference")
    assert_close(out, expected_decode(paged))
    out2 = jax.jit(lambda *a: jaxattn.paged_attention(*a, partition_size=8))(*_paged_args(paged))
    assert_close(out2, expected_decode(paged))


def test_default_implementation_serves(paged, ext):
    assert_close(jaxattn.paged_attention(*_paged_args(paged)), expected_decode(paged))
    e = ext
    out = jaxattn.extend_attention(e.q, e.k_pool, e.v_pool, e.qo_indptr, e.kv_indptr, e.kv_indices)
    want = jaxattn.reference.extend_attention(
        e.q, e.k_pool, e.v_pool, e.qo_indptr, e.kv_indptr, e.kv_indices
    )
    assert_close(out, want)


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda a: {**a, "q": a["q"][0]}, ValueError, "q must be"),
        (lambda a: {**a, "q": a["q"].astype(jnp.int32)}, TypeError, "q must be float"),
        (lambda a: {**a, "q": a["q"][:, :3]}, ValueError, "multiple of the number of KV heads"),
        (lambda a: {**a, "q": a["q"][..., :8]}, ValueError, "head dim"),
        (lambda a: {**a, "k_cache": a["k_cache"][..., :8]}, ValueError, "v_cache"),
        (lambda a: {**a, "v_cache": a["v_cache"].astype(jnp.bfloat16)}, TypeError, "share"),
        (
            lambda a: {
                **a,
                "block_tables": a["block_tables"].astype(jnp.int64)
                if jax.config.jax_enable_x64
                else a["block_tables"].astype(jnp.float32),
            },
            TypeError,
            "block_tables must be int32",
        ),
        (lambda a: {**a, "block_tables": a["block_tables"][:1]}, ValueError, "block_tables"),
        (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, ValueError, "seq_lens"),
        (lambda a: {**a, "seq_lens": a["seq_lens"].astype(jnp.uint32)}, TypeError, "seq_lens"),
        (lambda a: {**a, "seq_lens": a["seq_lens"] * 100}, ValueError, "seq_lens must lie"),
        (
            lambda a: {**a, "block_tables": a["block_tables"].at[0, 0].set(10_000)},
            ValueError,
            "block_tables\\[0\\]",
        ),
        (lambda a: {**a, "layout": "nhd"}, ValueError, "layout"),
        (lambda a: {**a, "scale": -1.0}, ValueError, "scale"),
        (lambda a: {**a, "scale": "big"}, TypeError, "scale"),
        (lambda a: {**a, "soft_cap": 0.0}, ValueError, "soft_cap"),
        (lambda a: {**a, "partition_size": 0}, ValueError, "partition_size"),
        (lambda a: {**a, "partition_size": 1.5}, TypeError, "partition_size"),
        (lambda a: {**a, "implementation": "cuda"}, ValueError, "implementation"),
        (lambda a: {**a, "implementation": 3}, TypeError, "implementation"),
    ],
)
def test_paged_attention_bad_inputs(paged, mutate, exc, match):
    args = dict(
        q=paged.q,
        k_cache=paged.k_cache,
        v_cache=paged.v_cache,
        block_tables=paged.block_tables,
        seq_lens=paged.seq_lens,
    )
    args = mutate(args)
    with pytest.raises(exc, match=match):
        jaxattn.paged_attention(**args)


def test_validation_runs_at_trace_time(paged):
    # Under jit the values are unknown, but a wrong shape still fails before any kernel.
    f = jax.jit(lambda q, *a: jaxattn.paged_attention(q[:, :3], *a))
    with pytest.raises(ValueError, match="multiple of the number of KV heads"):
        f(*_paged_args(paged))


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda a: {**a, "qo_indptr": a["qo_indptr"][:-1]}, ValueError, "kv_indptr"),
        (lambda a: {**a, "kv_indptr": a["kv_indptr"][None]}, ValueError, "kv_indptr"),
        (
            lambda a: {**a, "kv_indices": a["kv_indices"].astype(jnp.float32)},
            TypeError,
            "kv_indices must be int32",
        ),
        (lambda a: {**a, "k_cache": a["k_cache"][None]}, ValueError, "k_cache"),
        (lambda a: {**a, "v_cache": a["v_cache"][:-1]}, ValueError, "v_cache"),
        (lambda a: {**a, "qo_indptr": a["qo_indptr"].at[0].set(1)}, ValueError, "qo_indptr\\[0\\]"),
        (lambda a: {**a, "qo_indptr": a["qo_indptr"].at[-1].set(100)}, ValueError, "rows of q"),
        (lambda a: {**a, "kv_indptr": a["kv_indptr"].at[1].set(1)}, ValueError, "Lk >= Lq"),
        (lambda a: {**a, "kv_indices": a["kv_indices"].at[0].set(-5)}, ValueError, "kv_indices"),
        (lambda a: {**a, "q": a["q"][:, :3]}, ValueError, "multiple of the number of KV heads"),
    ],
)
def test_extend_attention_bad_inputs(ext, mutate, exc, match):
    args = dict(
        q=ext.q,
        k_cache=ext.k_pool,
        v_cache=ext.v_pool,
        qo_indptr=ext.qo_indptr,
        kv_indptr=ext.kv_indptr,
        kv_indices=ext.kv_indices,
    )
    with pytest.raises(exc, match=match):
        jaxattn.extend_attention(**mutate(args))


def test_prefix_prefill_bad_inputs(paged):
    q = jnp.zeros((6, 8, 16), jnp.float32)
    cu = jnp.array([0, 2, 6], jnp.int32)
    good = dict(
        q=q,
        k_cache=paged.k_cache,
        v_cache=paged.v_cache,
        cu_seqlens_q=cu,
        block_tables=paged.block_tables,
        seq_lens=paged.seq_lens,
    )
    jaxattn.prefix_prefill(**good)
    with pytest.raises(ValueError, match="seq_lens must be >= the query lengths"):
        jaxattn.prefix_prefill(**{**good, "cu_seqlens_q": jnp.array([0, 6, 6], jnp.int32)})
    with pytest.raises(ValueError, match="block_tables"):
        jaxattn.prefix_prefill(**{**good, "cu_seqlens_q": jnp.array([0, 1, 2, 6], jnp.int32)})
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        jaxattn.prefix_prefill(**{**good, "cu_seqlens_q": cu.astype(jnp.float32)})


def test_merge_states_bad_inputs():
    outs = jnp.zeros((3, 2, 4, 8))
    with pytest.raises(ValueError, match="lses must have shape"):
        jaxattn.merge_states(outs, jnp.zeros((3, 2)))
    with pytest.raises(TypeError, match="lses must be a float"):
        jaxattn.merge_states(outs, jnp.zeros((3, 2, 4), jnp.int32))


class _Refuses(Implementation):
    """A backend that cannot serve anything."""

    backend = "native"

    def supports(self, args):
        return "never"


def test_dispatch_falls_back_only_when_not_explicit(monkeypatch, paged):
    op = ops.PAGED_ATTENTION
    real = type(op).implementation
    monkeypatch.setattr(
        type(op),
        "implementation",
        lambda self, name: _Refuses() if name == "native" else real(self, name),
    )
    # A sequence tries each in turn and ends at the reference.
    out = jaxattn.paged_attention(*_paged_args(paged), implementation=("native", "reference"))
    assert_close(out, expected_decode(paged))
    # A single named backend that cannot serve raises instead of silently falling back.
    with pytest.raises(NotImplementedError, match="never"):
        jaxattn.paged_attention(*_paged_args(paged), implementation="native")
    with pytest.raises(NotImplementedError, match="no backend"):
        jaxattn.paged_attention(*_paged_args(paged), implementation=("native",))


def test_available_backends_lists_reference():
    assert "reference" in jaxattn.available_backends()
    for op in ("paged_attention", "extend_attention", "prefix_prefill"):
        assert "reference" in jaxattn.available_backends(op)


def test_resolve_reports_backend_and_config(paged):
    args = ops.PAGED_ATTENTION.bind(*_paged_args(paged), partition_size=8)
    r = ops.PAGED_ATTENTION.resolve(args, "reference")
    assert (r.backend, r.config) == ("reference", None)
    # A Pallas config picks the Pallas backend when no implementation is named.
    cfg = P.DecodeConfig(block_n=16)
    r = ops.PAGED_ATTENTION.resolve(args, None, cfg)
    assert r.backend == "pallas" and r.config is cfg
    # The heuristic fills in the device-dependent fields.
    r = ops.PAGED_ATTENTION.resolve(args, "pallas")
    assert isinstance(r.config, P.DecodeConfig) and r.config.block_n and r.config.min_programs
    r = ops.EXTEND_ATTENTION.resolve(
        ops.EXTEND_ATTENTION.bind(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _ext_args()]),
        "pallas",
    )
    assert isinstance(r.config, P.ExtendConfig)


def _ext_args():
    rng = np.random.default_rng(2)
    e = make_extend(rng, [3, 0], [2, 4], num_q_heads=4, num_kv_heads=2, head_dim=16)
    return (e.q, e.k_pool, e.v_pool, e.qo_indptr, e.kv_indptr, e.kv_indices)


def test_config_reaches_the_backend(paged):
    out = jaxattn.paged_attention(
        *_paged_args(paged), implementation="pallas", config=P.DecodeConfig(block_n=16)
    )
    assert_close(out, expected_decode(paged))
    # The wrong backend's config, or a config for a backend that takes none, is an error.
    with pytest.raises(TypeError, match="config for the pallas backend"):
        jaxattn.paged_attention(
            *_paged_args(paged), implementation="pallas", config=P.ExtendConfig()
        )
    with pytest.raises(TypeError, match="takes no config"):
        jaxattn.paged_attention(
            *_paged_args(paged), implementation="reference", config=P.DecodeConfig()
        )
    with pytest.raises(TypeError, match="no backend's config"):
        jaxattn.paged_attention(*_paged_args(paged), config=object())


def test_bind_takes_abstract_arrays(paged):
    """Validation reads only static facts, so the engine can resolve on shapes alone."""
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _paged_args(paged)]
    args = ops.PAGED_ATTENTION.bind(*structs)
    assert args.group == 4 and args.capacity == paged.block_tables.shape[1] * 4
    with pytest.raises(ValueError, match="multiple of the number of KV heads"):
        ops.PAGED_ATTENTION.bind(jax.ShapeDtypeStruct((2, 3, 16), jnp.float32), *structs[1:])


def test_environment_overrides_are_validated(set_env):
    with pytest.raises(ValueError, match="JAXATTN_PARTITION_SIZE"):
        set_env(JAXATTN_PARTITION_SIZE="-3")
    with pytest.raises(ValueError, match="JAXATTN_PREFILL_KERNEL"):
        set_env(JAXATTN_PARTITION_SIZE="256", JAXATTN_PREFILL_KERNEL="fastest")
    assert set_env(JAXATTN_PREFILL_KERNEL="MMA") == jaxattn.env.Overrides(256, "mma")
    assert set_env(JAXATTN_PARTITION_SIZE=None, JAXATTN_PREFILL_KERNEL=None) == (
        jaxattn.env.Overrides()
    )


def test_split_rule_shared_by_backends():
    """Both kernel backends size split-KV partitions with one rule."""
    rule = jaxattn.backend.split_kv_partition
    kw = dict(num_kv_heads=8, group=4, capacity=4096)
    # No growth: halve from 512 until the grid has the target number of blocks.
    assert rule(batch=1, target_blocks=264, grow=False, **kw) == 128
    assert rule(batch=64, target_blocks=264, grow=False, **kw) == 512
    # Growth: the longest partition that still fills the target.
    assert rule(batch=8, target_blocks=237.6, grow=True, **kw) == 1024
    # A grid past one wave (396 resident: 512 tokens give 512 blocks) doubles its
    # partitions when they still fill half of it; without the wave it stays.
    long = dict(kw, capacity=32768)
    assert rule(batch=1, target_blocks=356.4, grow=True, **long) == 512
    assert rule(batch=1, target_blocks=356.4, grow=True, wave=396, **long) == 1024
    assert rule(batch=1, target_blocks=237.6, grow=True, wave=264, **long) == 1024
    assert rule(batch=1, target_blocks=900, grow=True, wave=1000, **long) == 512
    # Enough (sequence, KV head) pairs: one pass.
    assert rule(batch=64, target_blocks=237.6, grow=True, one_pass_blocks=396, **kw) == 0


# --- FP8 caches and scales ----------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8():
    rng = np.random.default_rng(3)
    return make_paged_decode(
        rng,
        [5, 17],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        dtype=jnp.bfloat16,
        kv_dtype=jnp.float8_e4m3fn,
    )


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (dict(k_scale=jnp.ones((3,), jnp.float32)), ValueError, r"k_scale must be a scalar or"),
        (dict(v_scale=jnp.ones((2, 1), jnp.float32)), ValueError, r"v_scale must be a scalar or"),
        (dict(k_scale=0.0), ValueError, "k_scale must be finite and positive"),
        (dict(v_scale=-2.0), ValueError, "v_scale must be finite and positive"),
        (dict(k_scale=jnp.array([1.0, jnp.nan])), ValueError, "k_scale must be finite"),
        (dict(v_scale=jnp.array([1.0, jnp.inf])), ValueError, "v_scale must be finite"),
        (dict(k_scale=jnp.array([1.0, 0.0])), ValueError, "k_scale must be finite and positive"),
        (dict(k_scale="big"), TypeError, "k_scale must be None, a float"),
        (dict(v_scale=True), TypeError, "v_scale must be None"),
        (dict(k_scale=jnp.ones(2, jnp.complex64)), TypeError, "k_scale must be convertible"),
        (dict(v_scale=jnp.ones(2, bool)), TypeError, "v_scale must be convertible"),
    ],
)
def test_scale_validation(fp8, change, exc, match):
    with pytest.raises(exc, match=match):
        jaxattn.paged_attention(*_paged_args(fp8), **{**fp8.scales, **change})


def test_scales_forms_agree(fp8):
    """A scalar, a Python float and an f32 [Hkv] array (or an integer one) of equal values
    are the same scale; None is 1.0."""
    args = _paged_args(fp8)
    ref = jaxattn.paged_attention(*args, k_scale=jnp.full((2,), 0.5), v_scale=jnp.ones(2))
    for ks, vs in [(0.5, None), (jnp.float32(0.5), 1), (jnp.array(0.5), jnp.ones(2, jnp.int32))]:
        out = jaxattn.paged_attention(*args, k_scale=ks, v_scale=vs)
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


def test_scales_are_traced_not_static(fp8):
    """Scales change per layer and with calibration: new values must not recompile, and
    under jit they are not checked (they are data)."""
    traces = []

    def f(q, k, v, t, n, ks, vs):
        traces.append(1)
        return jaxattn.paged_attention(q, k, v, t, n, k_scale=ks, v_scale=vs)

    g = jax.jit(f)
    args = _paged_args(fp8)
    a = g(*args, fp8.k_scale, fp8.v_scale)
    b = g(*args, 2 * fp8.k_scale, fp8.v_scale)
    assert len(traces) == 1
    assert not np.allclose(np.asarray(a, np.float32), np.asarray(b, np.float32))
    want = jaxattn.paged_attention(*args, k_scale=2 * fp8.k_scale, v_scale=fp8.v_scale)
    np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(want, np.float32), rtol=1e-6)


def test_fp8_dtype_errors(fp8):
    names = ("q", "k_cache", "v_cache", "block_tables", "seq_lens")
    args = dict(zip(names, _paged_args(fp8), strict=True))
    with pytest.raises(TypeError, match="k_cache and v_cache must share a dtype"):
        jaxattn.paged_attention(**{**args, "v_cache": args["v_cache"].astype(jnp.float8_e5m2)})
    with pytest.raises(TypeError, match="k_cache must be float32, bfloat16, float16, float8"):
        jaxattn.paged_attention(**{**args, "k_cache": args["k_cache"].astype(jnp.int8)})
    # Decode takes no FP8 q (the mixed mode is the prefill ops').
    with pytest.raises(TypeError, match="q must be float32, bfloat16 or float16"):
        jaxattn.paged_attention(**{**args, "q": args["q"].astype(jnp.float8_e4m3fn)})


def test_prefill_q_scale_and_out_dtype_errors(fp8):
    cu = jnp.array([0, 2, 6], jnp.int32)
    q = jnp.ones((6, 8, 16), jnp.bfloat16)
    good = dict(
        q=q,
        k_cache=fp8.k_cache,
        v_cache=fp8.v_cache,
        cu_seqlens_q=cu,
        block_tables=fp8.block_tables,
        seq_lens=fp8.seq_lens,
        **fp8.scales,
    )
    assert jaxattn.prefix_prefill(**good).dtype == jnp.bfloat16
    q8 = q.astype(jnp.float8_e4m3fn)
    assert jaxattn.prefix_prefill(**{**good, "q": q8}).dtype == jnp.bfloat16
    out = jaxattn.prefix_prefill(**{**good, "q": q8, "q_scale": 0.5, "out_dtype": jnp.float16})
    assert out.dtype == jnp.float16
    cases = [
        (dict(q_scale=0.5), ValueError, "q_scale applies to an FP8 q"),
        (dict(q=q8, q_scale=jnp.ones(2)), ValueError, "q_scale must be a scalar"),
        (dict(q=q8, q_scale=-1.0), ValueError, "q_scale must be finite and positive"),
        (dict(q=q8, q_scale="x"), TypeError, "q_scale must be None"),
        (dict(out_dtype=jnp.float32), ValueError, "out_dtype=float32 differs from q's dtype"),
        (dict(q=q8, out_dtype=jnp.int32), TypeError, "out_dtype must be float32"),
        (dict(q=q.astype(jnp.int8)), TypeError, "q must be float32"),
    ]
    for change, exc, match in cases:
        with pytest.raises(exc, match=match):
            jaxattn.prefix_prefill(**{**good, **change})
    e = make_extend(
        np.random.default_rng(4), [3, 0], [2, 4], num_q_heads=4, num_kv_heads=2, head_dim=8
    )
    with pytest.raises(ValueError, match="q_scale applies to an FP8 q"):
        jaxattn.extend_attention(
            e.q, e.k_pool, e.v_pool, e.qo_indptr, e.kv_indptr, e.kv_indices, q_scale=2.0
        )


def test_bind_takes_abstract_scales(fp8):
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _paged_args(fp8)]
    ks = jax.ShapeDtypeStruct((2,), jnp.float32)
    args = ops.PAGED_ATTENTION.bind(*structs, k_scale=ks, v_scale=ks)
    assert args.fp8_cache and args.k_scale.shape == (2,)
    with pytest.raises(ValueError, match="k_scale"):
        ops.PAGED_ATTENTION.bind(*structs, k_scale=jax.ShapeDtypeStruct((3,), jnp.float32))


# --- cascade decode ---------------------------------------------------------------------------


def _cascade_case(head_dim=16):
    from helpers import make_cascade

    rng = np.random.default_rng(2)
    return make_cascade(
        rng,
        [3, 2],
        [0, 1, -1, 0],
        [5, 0, 9, 17],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=head_dim,
        page_size=4,
    )


@pytest.fixture(scope="module")
def casc():
    return _cascade_case()


def _cascade_args(c):
    return dict(
        q=c.q,
        k_cache=c.k_cache,
        v_cache=c.v_cache,
        prefix_tables=c.prefix_tables,
        prefix_lens=c.prefix_lens,
        prefix_of=c.prefix_of,
        block_tables=c.block_tables,
        seq_lens=c.seq_lens,
    )


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda a: {**a, "q": a["q"][0]}, ValueError, "q must be"),
        (lambda a: {**a, "prefix_tables": a["prefix_tables"][0]}, ValueError, "prefix_tables"),
        (
            lambda a: {**a, "prefix_tables": a["prefix_tables"].astype(jnp.float32)},
            TypeError,
            "prefix_tables must be int32",
        ),
        (lambda a: {**a, "prefix_lens": a["prefix_lens"][:1]}, ValueError, "prefix_lens must"),
        (lambda a: {**a, "prefix_of": a["prefix_of"][:3]}, ValueError, "prefix_of must"),
        (lambda a: {**a, "block_tables": a["block_tables"][:2]}, ValueError, "block_tables"),
        (lambda a: {**a, "seq_lens": a["seq_lens"][:2]}, ValueError, "seq_lens"),
        (lambda a: {**a, "prefix_of": a["prefix_of"].at[2].set(2)}, ValueError, r"\[-1, 2\)"),
        (lambda a: {**a, "prefix_of": a["prefix_of"].at[2].set(-3)}, ValueError, "prefix_of"),
        (
            lambda a: {**a, "prefix_lens": a["prefix_lens"].at[1].set(6)},
            ValueError,
            r"prefix_lens\[1\] must be a multiple of page_size = 4",
        ),
        (
            lambda a: {**a, "prefix_lens": a["prefix_lens"].at[0].set(400)},
            ValueError,
            r"prefix_lens\[0\]",
        ),
        (
            lambda a: {**a, "prefix_tables": a["prefix_tables"].at[0, 2].set(-1)},
            ValueError,
            r"prefix_tables\[0\] holds a page",
        ),
        (
            lambda a: {**a, "block_tables": a["block_tables"].at[3, 0].set(10**6)},
            ValueError,
            r"block_tables\[3\]",
        ),
        (lambda a: {**a, "layout": "nhd"}, ValueError, "layout"),
    ],
)
def test_cascade_attention_bad_inputs(casc, mutate, exc, match):
    with pytest.raises(exc, match=match):
        jaxattn.cascade_attention(**mutate(_cascade_args(casc)))


def test_cascade_unused_prefix_is_not_checked(casc):
    """A prefix no request continues is never read, eagerly or under jit."""
    a = _cascade_args(casc)
    a["prefix_of"] = a["prefix_of"].at[1].set(-1)
    a["prefix_lens"] = a["prefix_lens"].at[1].set(7)
    a["prefix_tables"] = a["prefix_tables"].at[1].set(-1)
    out = jaxattn.cascade_attention(**a)
    assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("backend", ["reference", "pallas", "native"])
def test_cascade_empty_dimensions(backend):
    """No requests, no prefixes, empty tables: answered without a kernel, as the spec.
    head_dim 32: the smallest the GPU kernels are built for (the casc fixture's 16 is
    not)."""
    if backend == "native" and not native.is_available():
        pytest.skip("native library not built")
    a = _cascade_args(_cascade_case(head_dim=32))
    run = lambda **kw: jaxattn.cascade_attention(**{**a, **kw}, implementation=backend)
    out = run(
        q=a["q"][:0],
        prefix_of=a["prefix_of"][:0],
        block_tables=a["block_tables"][:0],
        seq_lens=a["seq_lens"][:0],
    )
    assert out.shape == (0, 8, 32)
    # No prefixes: every request must have prefix_of -1, and then it is paged decode.
    no_prefix = dict(
        prefix_tables=a["prefix_tables"][:0],
        prefix_lens=a["prefix_lens"][:0],
        prefix_of=jnp.full((4,), -1, jnp.int32),
    )
    want = jaxattn.reference.paged_attention(
        a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"]
    )
    assert_close(run(**no_prefix), want)
    # Prefix tables of width 0 address no page: only empty prefixes.
    out = run(prefix_tables=a["prefix_tables"][:, :0], prefix_lens=jnp.zeros(2, jnp.int32))
    assert_close(out, want)


def test_cascade_split_rule_matches_the_kernels():
    """backend.cascade_* (Pallas, the native wrapper) and the integer rule of
    ffi/include/jaxattn/cascade.h (as the kernel emulator transcribes it) agree, on ints and
    on traced int32 arrays."""
    import importlib.util
    import pathlib

    from jaxattn import backend as B

    path = pathlib.Path(__file__).parents[1] / "ffi" / "tests_gpu" / "emulate_cascade.py"
    spec = importlib.util.spec_from_file_location("emulate_cascade", path)
    emu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emu)
    for batch, g, per_tile in [(64, 1, 16), (64, 64, 16), (7, 3, 2), (1, 9, 64), (300, 5, 8)]:
        assert B.cascade_prefix_tiles(batch=batch, num_prefixes=g, per_tile=per_tile) == (
            emu.cascade_tiles(batch, g, per_tile)
        )
    grid = B.cascade_grid(
        batch=64,
        num_prefixes=64,
        per_tile=16,
        num_kv_heads=8,
        prefix_capacity=4096,
        own_blocks=512,
        slots=264,
    )
    assert grid.blocks_per_head == emu.cascade_blocks_per_head(grid.tiles, grid.target, 8)
    kw = dict(
        target=grid.target,
        num_kv_heads=8,
        blocks_per_head=grid.blocks_per_head,
        max_splits=grid.max_splits,
    )
    for tiles in (0, 1, 2, 3, 4, 9, 33, 64):
        want = emu.cascade_splits(tiles, grid.target, 8, grid.blocks_per_head, grid.max_splits)
        assert B.cascade_splits(tiles, **kw) == want
        assert int(jax.jit(lambda t: B.cascade_splits(t, **kw))(jnp.int32(tiles))) == want
    for length, splits in itertools.product((0, 16, 64, 255, 256, 1000, 4096, 8192), (1, 3, 16)):
        want = emu.cascade_chunk(length, splits)
        assert B.cascade_chunk(length, splits) == want
        assert int(B.cascade_chunk(jnp.int32(length), jnp.int32(splits))) == want


def test_cascade_grid_holds_the_rounded_split():
    """The grid has room for the split the rule picks for every real tile count up to the
    bound: the split is never cut to fit it (only by max_splits), and tiles x splits fits."""
    from jaxattn import backend as B

    rng = np.random.default_rng(7)
    for _ in range(2000):
        batch = int(rng.integers(1, 300))
        g = int(rng.integers(1, 80))
        per_tile = int(rng.integers(1, 65))
        hkv = int(rng.choice([1, 2, 4, 8, 16]))
        grid = B.cascade_grid(
            batch=batch,
            num_prefixes=g,
            per_tile=per_tile,
            num_kv_heads=hkv,
            prefix_capacity=int(rng.integers(1, 40)) * 256,
            own_blocks=int(rng.integers(0, 2000)),
            slots=int(rng.choice([132, 264, 528])),
            target=None if rng.random() < 0.5 else int(rng.integers(1, 600)),
        )
        for tiles in range(1, grid.tiles + 1):
            rounded = (2 * grid.target + hkv * tiles) // (2 * hkv * tiles)
            s = B.cascade_splits(
                tiles,
                target=grid.target,
                num_kv_heads=hkv,
                blocks_per_head=grid.blocks_per_head,
                max_splits=grid.max_splits,
            )
            assert s == max(1, min(rounded, grid.max_splits))
            assert tiles * s <= grid.blocks_per_head


def test_cascade_bound_never_hides_a_gain():
    """cascade_may_pay_off (the engine's test before it looks for shared prefixes) is False
    only where cascade_pays_off is False for every grouping of the same context lengths."""
    rng = np.random.default_rng(4)
    from jaxattn.cascade_cost import CascadeCostModel, cascade_may_pay_off

    models = [
        None,
        CascadeCostModel(cascade_fixed_us=2.0, paged_fixed_us=1.0, margin=0.0),
        # repeated prefix bytes slower than the rest: the bound takes the slower rate
        CascadeCostModel(cascade_fixed_us=2.0, paged_repeat_bytes_per_us=1e6, margin=0.0),
    ]
    seen = {True: 0, False: 0}
    for _ in range(400):
        b = int(rng.integers(2, 40))
        kw = dict(
            num_q_heads=int(rng.choice([4, 8, 32])),
            num_kv_heads=int(rng.choice([1, 2, 8])),
            head_dim=int(rng.choice([16, 64, 128])),
            itemsize=int(rng.choice([1, 2, 4])),
            model=models[int(rng.integers(0, len(models)))],
        )
        context = rng.integers(1, int(rng.choice([64, 1024, 8192])), b)
        groups = int(rng.integers(1, b + 1))
        prefix_lens = rng.integers(0, 4096, groups) // 16 * 16
        prefix_of = rng.integers(-1, groups, b)
        prefix = np.where(prefix_of >= 0, prefix_lens[np.maximum(prefix_of, 0)], 0)
        prefix = np.minimum(prefix, context - 1) // 16 * 16  # a prefix leaves own tokens
        prefix_lens = prefix_lens.copy()
        for g in range(groups):  # each group's length as its members see it
            members = prefix_of == g
            if members.any():
                prefix_lens[g] = prefix[members].min()
        prefix = np.where(prefix_of >= 0, prefix_lens[np.maximum(prefix_of, 0)], 0)
        may = cascade_may_pay_off(context, **kw)
        seen[may] += 1
        if not may:
            assert not jaxattn.cascade_pays_off(prefix_lens, prefix_of, context - prefix, **kw)
    assert seen[True] and seen[False], seen


def test_cascade_switch_rule():
    """The engine's switch: shared long prefixes pay off, a batch with nothing shared never
    does, and a model written by the benchmark reads back."""
    kw = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
    assert jaxattn.cascade_pays_off([4096], [0] * 64, [256] * 64, **kw)
    assert not jaxattn.cascade_pays_off([4096] * 64, list(range(64)), [256] * 64, **kw)
    assert not jaxattn.cascade_pays_off([], [-1] * 8, [100] * 8, **kw)
    # Two requests on a short prefix with long own parts: nothing worth the second launch.
    assert not jaxattn.cascade_pays_off([64], [0, 0], [4000, 4000], **kw)
    cascade, paged = jaxattn.cascade_cost.cascade_cost([4096], [0] * 64, [256] * 64, **kw)
    assert cascade < paged / 4  # an H200 measured 44.3 against 212.1 us (round 42)
    model = ops.CascadeCostModel(paged_fixed_us=1.0, cascade_fixed_us=2.0, margin=0.2)
    assert ops.CascadeCostModel.from_json({"cost_model": dataclasses.asdict(model)}) == model


def test_cascade_cost_paged_reads_repeated_prefix_bytes_at_their_own_rate():
    """Paged decode's prediction: the bytes cascade also reads at one rate, the prefix bytes
    read again by the second and later requests on a prefix at another."""
    from jaxattn.cascade_cost import CascadeCostModel, cascade_features

    kw = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
    f = cascade_features([4096, 64], [0] * 6 + [1, 1, -1], [256] * 9, **kw)
    token = 2 * 8 * 128 * 2
    assert f["joined_bytes"] == (6 * 4096 + 2 * 64 + 9 * 256) * token
    assert f["unique_bytes"] == (4096 + 64 + 9 * 256) * token
    assert f["repeated_bytes"] == (5 * 4096 + 64) * token
    m = CascadeCostModel(paged_fixed_us=3.0, paged_bytes_per_us=2e6, paged_repeat_bytes_per_us=8e6)
    _, paged = m.predict(f)
    assert paged == pytest.approx(3.0 + f["unique_bytes"] / 2e6 + f["repeated_bytes"] / 8e6)
    # nothing shared: one rate for every byte (a dict without repeated_bytes reads the same)
    f = cascade_features([4096] * 3, [0, 1, 2], [10] * 3, **kw)
    assert f["repeated_bytes"] == 0
    del f["repeated_bytes"]
    assert m.predict(f)[1] == pytest.approx(3.0 + f["joined_bytes"] / 2e6)


def test_cascade_fit_recovers_the_model():
    """bench_cascade.py --fit's least squares gives back the constants of times generated by
    a model (both ops, every rate; the margin is the base's)."""
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_cascade

    from jaxattn.cascade_cost import CascadeCostModel, cascade_features

    truth = CascadeCostModel(
        paged_fixed_us=5.0, paged_bytes_per_us=4.0e6, paged_repeat_bytes_per_us=6.0e6,
        cascade_fixed_us=12.0, cascade_row_us=2e-3, cascade_bytes_per_us=3.5e6,
        cascade_flops_per_us=4e8, margin=0.15,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    points = []
    for _ in range(24):
        b, groups = int(rng.integers(4, 96)), int(rng.integers(1, 5))
        prefix_lens = rng.integers(1, 256, groups) * 16
        prefix_of = rng.integers(-1, groups, b)
        f = cascade_features(prefix_lens, prefix_of, rng.integers(1, 2048, b), num_q_heads=32,
                             num_kv_heads=8, head_dim=128)  # fmt: skip
        cascade, paged = truth.predict(f)
        points.append(f | dict(cascade_us=cascade, paged_us=paged))
    model, _ = bench_cascade.fit_model(points, CascadeCostModel(margin=0.15))
    for name, want in dataclasses.asdict(truth).items():
        assert getattr(model, name) == pytest.approx(want, rel=1e-6), name


def test_cascade_fit_reports_the_switch_and_the_crossover():
    """bench_cascade.py --fit's report: each switch's choice and its cost against paged
    decode (a prefix under the engine's cascade_min_tokens forms no level), and per shape
    the shortest prefix from which cascade was faster at every longer one measured."""
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_cascade

    from jaxattn.cascade_cost import CascadeCostModel, cascade_features

    def point(prefix, cascade_us, paged_us, per=8, own=64):
        f = cascade_features([prefix] * (64 // per), [i // per for i in range(64)], [own] * 64,
                             num_q_heads=32, num_kv_heads=8, head_dim=128)  # fmt: skip
        return f | dict(batch=f"L={prefix} n={per}", b=64, prefix=prefix, per=per, own=own,
                        cascade_us=cascade_us, paged_us=paged_us)  # fmt: skip

    # faster at 128, slower at 256 (noise), faster from 512 on: it pays from 512
    pts = [point(64, 30.0, 20.0), point(128, 19.0, 20.0), point(256, 25.0, 24.0),
           point(512, 26.0, 40.0), point(2048, 30.0, 120.0)]  # fmt: skip
    (row,) = bench_cascade.crossovers(pts)
    assert (row["b"], row["per"], row["own"], row["pays_from"]) == (64, 8, 64, 512)
    assert row["prefixes"] == "64 128 256 512 2048"
    (never,) = bench_cascade.crossovers([point(64, 30.0, 20.0, per=2)])
    assert never["pays_from"] is None
    always = CascadeCostModel(cascade_fixed_us=-1e9, margin=0.0)  # predicts cascade every time
    by = {d["prefix"]: d for d in bench_cascade.switch_decisions(pts, always, min_tokens=128)}
    assert not by[64]["use_cascade"] and by[64]["slowdown_vs_paged"] == 0.0  # under the minimum
    assert by[128]["use_cascade"] and by[128]["slowdown_vs_paged"] == pytest.approx(-0.05)
    assert by[256]["slowdown_vs_paged"] == pytest.approx(25 / 24 - 1)
    assert by[256]["slowdown_vs_best"] == pytest.approx(25 / 24 - 1)
    never_model = CascadeCostModel(cascade_fixed_us=1e9)
    assert not any(d["use_cascade"] for d in bench_cascade.switch_decisions(pts, never_model))
