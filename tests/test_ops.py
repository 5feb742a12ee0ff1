"""Public ops: input validation (errors name the argument) and backend dispatch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, expected_decode, make_extend, make_paged_decode

import jaxattn
from jaxattn import ops
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
