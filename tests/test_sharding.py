"""Tensor parallelism: the ops under shard_map and the sharded model against one device.

Runs on the 8 CPU devices that conftest.py fakes. Every sharded result is compared with
the same computation on one device. Heads are independent, so splitting them changes no
arithmetic: on the CPU the native kernel must agree bitwise and XLA-compiled code to a few
ulps (its fusion may change with the heads per device); elsewhere the dtype tolerance
applies (a GPU kernel may pick another split-KV partition for fewer heads per device).
The model test compares within a small float32 tolerance, since the all-reduces of the
row-parallel matmuls add partial sums in another order.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_close,
    make_cascade,
    make_extend,
    make_paged_decode,
    make_prefix_prefill,
    mesh_of,
)
from jax.sharding import PartitionSpec as P

import jaxattn
from jaxattn import layout as L
from jaxattn import native
from jaxattn import sharding as S
from jaxattn.models import llama

ON_CPU = jax.default_backend() == "cpu"
HEAD_DIM, PAGE = 32, 8

# One case per (op, backend): across the three backends each op meets mesh sizes 2, 4 and
# 8, and across the three ops each backend does (a Latin square keeps the CPU run short).
# Mesh size -> (query heads, KV heads): GQA 4, 2 and 1.
HEADS = {2: (8, 2), 4: (8, 4), 8: (8, 8)}
PLAN = {  # op -> backend -> (mesh size, layout); vllm is read by the reference only
    "paged": {"reference": (8, "vllm"), "pallas": (2, "bshd"), "native": (4, "bhsd")},
    "prefill": {"reference": (4, "vllm"), "pallas": (8, "bhsd"), "native": (2, "bshd")},
    "extend": {"reference": (2, "pool"), "pallas": (4, "pool"), "native": (8, "pool")},
    "cascade": {"reference": (4, "bhsd"), "pallas": (8, "bshd"), "native": (2, "bhsd")},
}


def _cases(op):
    for impl, (n, layout) in PLAN[op].items():
        hq, hkv = HEADS[n]
        marks = ()
        if impl == "native":
            marks = pytest.mark.skipif(
                not native.is_available(), reason="the native library is not built"
            )
        yield pytest.param(impl, n, hq, hkv, layout, id=f"{impl}-tp{n}-{layout}", marks=marks)


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


_mesh = mesh_of


def assert_same(sharded, single, impl):
    """Sharded equals single-device: no NaN; on the CPU bitwise for the native kernel
    (a C++ loop per head) and within a few float32 ulps for XLA-compiled code, whose
    fusion and vectorisation may change with the number of heads per device."""
    assert sharded.shape == single.shape and sharded.dtype == single.dtype
    a, e = np.asarray(sharded.astype(jnp.float32)), np.asarray(single.astype(jnp.float32))
    assert not np.isnan(a).any(), "sharded output contains NaN"
    assert not np.isnan(e).any(), "single-device output contains NaN"
    if ON_CPU and impl == "native":
        np.testing.assert_array_equal(a, e)
    elif ON_CPU:
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)
    else:
        assert_close(sharded, single)


def assert_head_split(out, n):
    """The output stays split over heads: each device computed only its own heads."""
    assert out.sharding.spec == P(None, S.AXIS, None) or out.sharding.spec == P(None, S.AXIS)
    shapes = {s.data.shape for s in out.addressable_shards}
    assert shapes == {(out.shape[0], out.shape[1] // n, out.shape[2])}


# --- mesh and specs ------------------------------------------------------------------


def test_make_mesh():
    n = min(4, jax.device_count())
    mesh = S.make_mesh(n)
    assert mesh.shape == {S.AXIS: n} and mesh.axis_names == (S.AXIS,)
    assert list(mesh.devices) == jax.devices()[:n]
    assert S.make_mesh().size == jax.device_count()
    with pytest.raises(ValueError, match="exceeds"):
        S.make_mesh(jax.device_count() + 1)
    with pytest.raises(ValueError, match="positive"):
        S.make_mesh(0)


@pytest.mark.parametrize("layout", [*L.LAYOUTS, S.TOKEN_POOL])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_kv_spec_names_the_head_axis(layout, kind):
    """Against the layout's own shapes: distinct sizes, so only the head axis has 7."""
    if layout == S.TOKEN_POOL:
        shape = (3 * 5, 7, 16)
    else:
        shape = L.cache_shape(layout, kind, 3, 5, 7, 16, jnp.float32)
    spec = S.kv_cache_spec(layout, kind)
    assert len(spec) == len(shape)
    assert [i for i, s in enumerate(spec) if s is not None] == [shape.index(7)]
    assert spec[shape.index(7)] == S.AXIS


def test_rejects_indivisible_heads(rng):
    mesh = _mesh(4)
    c = make_paged_decode(rng, [3], num_q_heads=8, num_kv_heads=2, head_dim=16, page_size=4)
    with pytest.raises(ValueError, match=r"KV heads \(2\) must be a multiple of .* \(4\)"):
        S.paged_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, mesh=mesh)
    with pytest.raises(ValueError, match=r"KV heads \(2\).*\(4\)"):
        S.shard_kv_cache(c.k_cache, c.v_cache, mesh)
    c = make_paged_decode(rng, [3], num_q_heads=6, num_kv_heads=6, head_dim=16, page_size=4)
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of .* \(4\)"):
        S.paged_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, mesh=mesh)
    e = make_extend(rng, [2], [3], num_q_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="multiple of the tensor-parallel mesh size"):
        S.extend_attention(
            e.q, e.k_pool, e.v_pool, e.qo_indptr, e.kv_indptr, e.kv_indices, mesh=mesh
        )


def test_validates_global_arguments(rng):
    """Errors name the global shapes, and eager index values are checked as by the op."""
    mesh = _mesh(2)
    c = make_paged_decode(rng, [5, 9], num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
    with pytest.raises(ValueError, match=r"seq_lens must be int32 \[batch=2\]"):
        S.paged_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens[:1], mesh=mesh)
    too_long = jnp.asarray([5, 4 * c.block_tables.shape[1] + 1], jnp.int32)
    with pytest.raises(ValueError, match="seq_lens must lie in"):
        S.paged_attention(c.q, c.k_cache, c.v_cache, c.block_tables, too_long, mesh=mesh)
    with pytest.raises(ValueError, match="axis_name='model'"):
        S.paged_attention(
            c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, mesh=mesh, axis_name="model"
        )


# --- the ops under shard_map ---------------------------------------------------------


def _jit(fn, **kw):
    return jax.jit(functools.partial(fn, **kw))


@pytest.mark.parametrize("impl,n,hq,hkv,layout", list(_cases("paged")))
def test_paged_attention(rng, impl, n, hq, hkv, layout):
    mesh = _mesh(n)
    c = make_paged_decode(
        rng,
        [1, 17, 6],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=HEAD_DIM,
        page_size=PAGE,
        layout=layout,
    )
    args = (c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens)
    # Two partitions of 8 tokens for the 17-token sequence: split-KV and its combine
    # run on every device's heads too.
    kw = dict(layout=layout, partition_size=8, implementation=impl)
    single = _jit(jaxattn.paged_attention, **kw)(*args)
    k, v = S.shard_kv_cache(c.k_cache, c.v_cache, mesh, layout=layout)
    sharded = _jit(S.paged_attention, mesh=mesh, **kw)(c.q, k, v, *args[3:])
    assert_same(sharded, single, impl)
    assert_head_split(sharded, n)


@pytest.mark.parametrize("impl,n,hq,hkv,layout", list(_cases("prefill")))
def test_prefix_prefill(rng, impl, n, hq, hkv, layout):
    mesh = _mesh(n)
    c = make_prefix_prefill(
        rng,
        [0, 11],
        [5, 3],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=HEAD_DIM,
        page_size=PAGE,
        layout=layout,
        pad_rows=2,
    )
    args = (c.q, c.k_cache, c.v_cache, c.cu_seqlens_q, c.block_tables, c.seq_lens)
    kw = dict(layout=layout, implementation=impl)
    single = _jit(jaxattn.prefix_prefill, **kw)(*args)
    sharded = _jit(S.prefix_prefill, mesh=mesh, **kw)(*args)
    assert_same(sharded[: c.cu_seqlens_q[-1]], single[: c.cu_seqlens_q[-1]], impl)
    assert_head_split(sharded, n)


@pytest.mark.parametrize("impl,n,hq,hkv,layout", list(_cases("extend")))
def test_extend_attention(rng, impl, n, hq, hkv, layout):
    mesh = _mesh(n)
    e = make_extend(
        rng, [0, 13], [4, 7], num_q_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM, pad_rows=1
    )
    args = (e.q, e.k_pool, e.v_pool, e.qo_indptr, e.kv_indptr, e.kv_indices)
    single = _jit(jaxattn.extend_attention, soft_cap=20.0, implementation=impl)(*args)
    k, v = S.shard_kv_cache(e.k_pool, e.v_pool, mesh, layout=S.TOKEN_POOL)
    sharded = _jit(S.extend_attention, mesh=mesh, soft_cap=20.0, implementation=impl)(
        e.q, k, v, *args[3:]
    )
    assert_same(sharded[:-1], single[:-1], impl)
    assert_head_split(sharded, n)


@pytest.mark.parametrize("impl,n,hq,hkv,layout", list(_cases("cascade")))
def test_cascade_attention(rng, impl, n, hq, hkv, layout):
    mesh = _mesh(n)
    c = make_cascade(
        rng,
        [3, 1],
        [0, 1, 0, -1, 0],
        [2, 9, 0, 5, 17],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=HEAD_DIM,
        page_size=PAGE,
        layout=layout,
    )
    args = (
        c.q,
        c.k_cache,
        c.v_cache,
        c.prefix_tables,
        c.prefix_lens,
        c.prefix_of,
        c.block_tables,
        c.seq_lens,
    )
    kw = dict(layout=layout, implementation=impl)
    single = _jit(jaxattn.cascade_attention, **kw)(*args)
    k, v = S.shard_kv_cache(c.k_cache, c.v_cache, mesh, layout=layout)
    tp = S.TensorParallel(mesh)
    sharded = jax.jit(functools.partial(tp.cascade_attention, **kw))(c.q, k, v, *args[3:])
    assert_same(sharded, single, impl)
    assert_head_split(sharded, n)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize(
    "impl",
    [
        "reference",
        "pallas",
        None,
        pytest.param(
            "native", marks=pytest.mark.skipif(not native.is_available(), reason="not built")
        ),
    ],
)
def test_ops_inside_a_users_shard_map(rng, impl, check_vma):
    """Every backend inside a user's own ``jax.shard_map`` (``check_vma`` on, as by
    default): outputs carry their inputs' varying axes. The Pallas interpreter (the CPU
    path) refuses with a reason under the check, and runs without it."""
    n = 4 if jax.device_count() >= 4 else jax.device_count()
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:n]), ("x",))
    c = make_paged_decode(rng, [5, 17], num_q_heads=8, num_kv_heads=4, head_dim=32, page_size=4)
    e = make_extend(rng, [3, 0], [2, 5], num_q_heads=8, num_kv_heads=4, head_dim=32)
    heads, rep = P(None, "x"), P()

    def decode(q, k, v, t, s):
        return jaxattn.paged_attention(q, k, v, t, s, partition_size=8, implementation=impl)

    def extend(q, k, v, qo, kv, idx):
        return jaxattn.extend_attention(q, k, v, qo, kv, idx, implementation=impl)

    f = jax.jit(
        jax.shard_map(
            decode,
            mesh=mesh,
            in_specs=(heads, P(None, None, "x"), P(None, None, "x"), rep, rep),
            out_specs=heads,
            check_vma=check_vma,
        )
    )
    g = jax.jit(
        jax.shard_map(
            extend,
            mesh=mesh,
            in_specs=(heads, heads, heads, rep, rep, rep),
            out_specs=heads,
            check_vma=check_vma,
        )
    )
    dargs = (c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens)
    eargs = (e.q, e.k_pool, e.v_pool, e.qo_indptr, e.kv_indptr, e.kv_indices)
    if impl == "pallas" and ON_CPU and check_vma:
        with pytest.raises(NotImplementedError, match="check_vma"):
            f(*dargs)
        return
    assert_close(f(*dargs), jaxattn.reference.paged_attention(*dargs, partition_size=8))
    assert_close(g(*eargs), jaxattn.reference.extend_attention(*eargs))


@pytest.mark.skipif(not native.is_available(), reason="the native library is not built")
def test_native_custom_call_runs_per_device(rng):
    """The FFI call sits inside the SPMD program, on each device's slice of heads."""
    mesh = _mesh(4)
    c = make_paged_decode(rng, [9], num_q_heads=8, num_kv_heads=4, head_dim=16, page_size=4)
    f = _jit(S.paged_attention, mesh=mesh, implementation="native")
    hlo = f.lower(c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens).compile().as_text()
    calls = [line for line in hlo.splitlines() if "jaxattn_paged_attention" in line]
    assert calls and all("f32[1,2,16]" in line for line in calls), calls


def test_write_and_copy_keep_heads_local(rng):
    mesh = _mesh(4)
    layout = "vllm"
    kc, vc, *_ = _dense_cache(rng, layout)
    k = jnp.asarray(rng.standard_normal((3, 4, 16), np.float32))
    v = jnp.asarray(rng.standard_normal((3, 4, 16), np.float32))
    slots = jnp.asarray([5, -1, 30], jnp.int32)
    src, dst = jnp.asarray([0, 2], jnp.int32), jnp.asarray([3, -1], jnp.int32)

    def step(write, copy, kc, vc):
        kc, vc = write(kc, vc, k, v, slots, layout=layout)
        return copy(kc, vc, src, dst, layout=layout)

    single = jax.jit(functools.partial(step, jaxattn.write_kv, jaxattn.copy_blocks))(kc, vc)
    tp = S.TensorParallel(mesh)
    sk, sv = tp.shard_kv_cache(kc, vc, layout=layout)
    sharded = jax.jit(functools.partial(step, tp.write_kv, tp.copy_blocks))(sk, sv)
    for got, want, kind in zip(sharded, single, "kv", strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.sharding.is_equivalent_to(S.kv_cache_sharding(mesh, layout, kind), got.ndim)


@pytest.mark.parametrize(
    "impl",
    [
        "reference",
        pytest.param(
            "native", marks=pytest.mark.skipif(not native.is_available(), reason="not built")
        ),
    ],
)
def test_fp8_scales_split_with_the_heads(rng, impl):
    """Per-KV-head scales travel with their heads: each device applies its own heads'
    scales (written and read), q's scalar scale is replicated."""
    mesh = _mesh(4)
    c = make_prefix_prefill(
        rng,
        [0, 11],
        [5, 3],
        num_q_heads=8,
        num_kv_heads=4,
        head_dim=HEAD_DIM,
        page_size=PAGE,
        dtype=jnp.bfloat16,
        kv_dtype=jnp.float8_e4m3fn,
    )
    args = (c.q, c.k_cache, c.v_cache, c.cu_seqlens_q, c.block_tables, c.seq_lens)
    kw = dict(implementation=impl, **c.scales)
    single = _jit(jaxattn.prefix_prefill, **kw)(*args)
    sharded = _jit(S.prefix_prefill, mesh=mesh, **kw)(*args)
    assert_same(sharded, single, impl)
    q8 = c.q.astype(jnp.float8_e5m2)
    single = _jit(jaxattn.prefix_prefill, q_scale=0.5, **kw)(q8, *args[1:])
    sharded = _jit(S.prefix_prefill, mesh=mesh, q_scale=0.5, **kw)(q8, *args[1:])
    assert_same(sharded, single, impl)
    d = make_paged_decode(
        rng,
        [1, 17],
        num_q_heads=8,
        num_kv_heads=4,
        head_dim=HEAD_DIM,
        page_size=PAGE,
        dtype=jnp.bfloat16,
        kv_dtype=jnp.float8_e5m2,
    )
    dargs = (d.q, d.k_cache, d.v_cache, d.block_tables, d.seq_lens)
    single = _jit(jaxattn.paged_attention, implementation=impl, **d.scales)(*dargs)
    sharded = _jit(S.paged_attention, mesh=mesh, implementation=impl, **d.scales)(*dargs)
    assert_same(sharded, single, impl)
    # Cascade decode: both levels read the device's heads with those heads' scales (the
    # native GPU kernels take no FP8 cache; the CPU handler does).
    e = make_cascade(
        rng,
        [2, 1],
        [0, 1, -1, 0],
        [3, 0, 9, 20],
        num_q_heads=8,
        num_kv_heads=4,
        head_dim=HEAD_DIM,
        page_size=PAGE,
        dtype=jnp.bfloat16,
        kv_dtype=jnp.float8_e4m3fn,
    )
    eargs = (e.q, e.k_cache, e.v_cache, e.prefix_tables, e.prefix_lens, e.prefix_of)
    eargs += (e.block_tables, e.seq_lens)
    if impl != "native" or jax.default_backend() == "cpu":
        single = _jit(jaxattn.cascade_attention, implementation=impl, **e.scales)(*eargs)
        sharded = _jit(S.cascade_attention, mesh=mesh, implementation=impl, **e.scales)(*eargs)
        assert_same(sharded, single, impl)
    # Writes: each device divides by its own heads' scales.
    k = jnp.asarray(rng.standard_normal((3, 4, HEAD_DIM), np.float32))
    slots = jnp.asarray([5, -1, 30], jnp.int32)
    ks = jnp.asarray([0.5, 1.0, 2.0, 4.0], jnp.float32)
    kc = jnp.zeros_like(d.k_cache)
    single = jaxattn.write_kv(kc, kc, k, k, slots, k_scale=ks, v_scale=2.0)
    sk, sv = S.shard_kv_cache(kc, kc, mesh)
    sharded = jax.jit(functools.partial(S.write_kv, mesh=mesh))(
        sk, sv, k, k, slots, k_scale=ks, v_scale=2.0
    )
    for got, want in zip(sharded, single, strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("scaled", [False, True])
def test_rope_write_kv_split_over_heads_matches_one_device(scaled, rng):
    """The fused projection's rows in shard-major order (each device's q, k, v heads side by
    side, as serving_params(shards=n) fuses them): each device rotates and stores its own
    heads; q comes back split as paged_attention takes it."""
    mesh = mesh_of(2)
    n, t, hq, hkv, d = 2, 5, 8, 4, 16
    x = jnp.asarray(rng.standard_normal((t, hq + 2 * hkv, d), np.float32))
    q, k, v = x[:, :hq], x[:, hq : hq + hkv], x[:, hq + hkv :]
    # Shard-major: device i's q heads, then its k heads, then its v heads.
    parts = [
        jnp.concatenate([a.reshape(t, n, -1, d)[:, i] for a in (q, k, v)], axis=1) for i in range(n)
    ]
    shard_major = jnp.concatenate(parts, axis=1)
    angles = rng.standard_normal((t, d // 2)).astype(np.float32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    kc = jnp.zeros(L.cache_shape("bshd", "k", 6, 8, hkv, d, jnp.float32))
    slots = jnp.asarray([5, -1, 30, 47, 2], jnp.int32)
    scales = dict(k_scale=jnp.asarray([0.5, 1.0, 2.0, 4.0], jnp.float32), v_scale=2.0)
    scales = scales if scaled else {}
    want = jaxattn.rope_write_kv(x, cos, sin, kc, kc, slots, **scales)
    sk, sv = S.shard_kv_cache(kc, kc, mesh)
    got = jax.jit(functools.partial(S.rope_write_kv, mesh=mesh))(
        shard_major, cos, sin, sk, sv, slots, **scales
    )
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(ValueError, match="heads"):
        S.rope_write_kv(x[:, 1:], cos, sin, sk, sv, slots, mesh=mesh)  # 7 q heads
    with pytest.raises(ValueError, match="no partial sums"):
        S.rope_write_kv(shard_major[None], cos, sin, sk, sv, slots, mesh=mesh)


def _dense_cache(rng, layout):
    """A small NaN-free cache (copy_blocks moves whole pages, NaN padding included)."""
    shape_k = L.cache_shape(layout, "k", 6, 8, 4, 16, jnp.float32)
    shape_v = L.cache_shape(layout, "v", 6, 8, 4, 16, jnp.float32)
    return (
        jnp.asarray(rng.standard_normal(shape_k, np.float32)),
        jnp.asarray(rng.standard_normal(shape_v, np.float32)),
    )


# --- parameters ----------------------------------------------------------------------

CFG = llama.LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
)


def test_param_specs_megatron():
    params = llama.init_params(CFG, jax.random.key(0))
    specs = S.param_specs(params, CFG, 4)
    lay = specs["layers"]
    col, row, rep = P(None, None, S.AXIS), P(None, S.AXIS, None), P(None, None)
    assert lay["wq"] == lay["wk"] == lay["wv"] == lay["w_gate"] == lay["w_up"] == col
    assert lay["wo"] == lay["w_down"] == row
    assert lay["attn_norm"] == lay["mlp_norm"] == rep
    assert specs["embed"] == P() and specs["norm"] == P()
    assert specs["lm_head"] == P(None, S.AXIS)
    odd_vocab = llama.LlamaConfig(**{**_fields(CFG), "vocab_size": 130})
    odd = S.param_specs(llama.init_params(odd_vocab, jax.random.key(0)), odd_vocab, 4)
    assert odd["lm_head"] == P(None, None)
    tied = llama.LlamaConfig(**{**_fields(CFG), "tie_word_embeddings": True})
    tied_specs = S.param_specs(llama.init_params(tied, jax.random.key(0)), tied, 4)
    assert "lm_head" not in tied_specs and tied_specs["embed"] == P()


def test_param_specs_reject():
    params = llama.init_params(CFG, jax.random.key(0))
    with pytest.raises(ValueError, match=r"KV heads \(4\) must be a multiple of .* \(8\)"):
        S.param_specs(params, CFG, 8)
    wide = llama.LlamaConfig(**{**_fields(CFG), "intermediate_size": 130})
    with pytest.raises(ValueError, match="intermediate_size"):
        S.param_specs(llama.init_params(wide, jax.random.key(0)), wide, 4)
    with pytest.raises(ValueError, match=r"layers/w_extra"):
        S.param_specs({**params, "layers": {**params["layers"], "w_extra": None}}, CFG, 2)


def test_shard_params_places_slices():
    mesh = _mesh(4)
    params = llama.init_params(CFG, jax.random.key(0))
    sharded = S.shard_params(params, mesh, CFG)
    wq = sharded["layers"]["wq"]
    assert {s.data.shape for s in wq.addressable_shards} == {(2, 64, 32)}  # 2 heads of 16
    for i, s in enumerate(sorted(wq.addressable_shards, key=lambda s: s.index[2].start)):
        np.testing.assert_array_equal(s.data, params["layers"]["wq"][:, :, 32 * i : 32 * (i + 1)])
    assert {s.data.shape for s in sharded["layers"]["w_down"].addressable_shards} == {(2, 32, 64)}
    assert {s.data.shape for s in sharded["embed"].addressable_shards} == {(128, 64)}
    assert {s.data.shape for s in sharded["lm_head"].addressable_shards} == {(64, 32)}


def _fields(cfg):
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


# --- the sharded model ---------------------------------------------------------------


def _extend_batch(prompt_lens, page_size, tables, vocab, rng):
    toks, pos, slots = [], [], []
    for b, n in enumerate(prompt_lens):
        toks.append(rng.integers(0, vocab, n))
        pos.append(np.arange(n))
        slots.append(tables[b, np.arange(n) // page_size] * page_size + np.arange(n) % page_size)
    ptr = np.concatenate([[0], np.cumsum(prompt_lens)]).astype(np.int32)
    i32 = lambda x: jnp.asarray(np.concatenate(x) if isinstance(x, list) else x, jnp.int32)
    return llama.ExtendBatch(
        tokens=i32(toks),
        positions=i32(pos),
        slot_mapping=i32(slots),
        qo_indptr=i32(ptr),
        kv_indptr=i32(ptr),
        kv_indices=i32(slots),
        block_tables=i32(tables),
        seq_lens=i32(np.asarray(prompt_lens)),
        logit_rows=i32(ptr[1:] - 1),
    )


def _decode_batch(tokens, prompt_lens, page_size, tables):
    pos = np.asarray(prompt_lens)
    slots = tables[np.arange(len(pos)), pos // page_size] * page_size + pos % page_size
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    return llama.DecodeBatch(i32(tokens), i32(pos), i32(slots), i32(tables), i32(pos + 1))


def _collectives(compiled_text: str) -> dict:
    found = {}
    for line in compiled_text.splitlines():
        m = re.search(
            r"= (\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
            r"(-start)?\(",
            line,
        )
        if m:
            found.setdefault(m.group(2), []).append(m.group(1))
    return found


@pytest.mark.parametrize(
    "n,layout,attention", [(2, "bshd", "extend"), (4, "vllm", "prefix_prefill")]
)
def test_sharded_model_matches_single_device(n, layout, attention):
    """Prefill then one decode step: params by param_shardings, the pool split by KV
    head, attention through the shard_map ops. Logits and caches match one device, and
    the compiled step communicates exactly two all-reduces of the hidden state per layer.
    """
    mesh = _mesh(n)
    rng = np.random.default_rng(n)
    params = llama.init_params(CFG, jax.random.key(n))
    page_size, pages = 4, 8
    lens = [5, 7]
    tables = np.asarray([[3, 0, 6], [1, 5, 2]], np.int32)
    ext = _extend_batch(lens, page_size, tables, CFG.vocab_size, rng)
    dec = _decode_batch(rng.integers(0, CFG.vocab_size, len(lens)), lens, page_size, tables)
    k0, v0 = llama.init_kv_cache(CFG, pages, page_size, layout=layout)

    def run(params, k, v, kernels=None):
        kw = dict(layout=layout, implementation="reference", kernels=kernels)
        prefill = jax.jit(
            lambda p, k, v: llama.forward_extend(p, CFG, k, v, ext, attention=attention, **kw)
        )
        logits, k, v = prefill(params, k, v)
        step = jax.jit(lambda p, k, v: llama.forward_decode(p, CFG, k, v, dec, **kw))
        compiled = step.lower(params, k, v).compile()
        return (logits, *compiled(params, k, v)), compiled.as_text()

    single, _ = run(params, k0, v0)

    tp = S.TensorParallel(mesh)
    sk, sv = tp.init_kv_cache(
        lambda: llama.init_kv_cache(CFG, pages, page_size, layout=layout), layout=layout
    )
    sharded, hlo = run(tp.shard_params(params, CFG), sk, sv, kernels=tp)

    names = ("prefill logits", "decode logits", "k cache", "v cache")
    for name, got, want in zip(names, sharded, single, strict=True):
        assert not np.isnan(np.asarray(got)).any(), name
        # The all-reduces sum the row-parallel partial products in another order.
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    # Still split by KV head: the next step's donated caches need no resharding.
    for got, kind in zip(sharded[2:], "kv", strict=True):
        assert got.sharding.is_equivalent_to(S.kv_cache_sharding(mesh, layout, kind), got.ndim)

    coll = _collectives(hlo)
    assert set(coll) == {"all-reduce"}, coll
    hidden = f"[{len(lens)},{CFG.hidden_size}]"
    assert all(hidden in shape for shape in coll["all-reduce"]), coll
    assert len(coll["all-reduce"]) in (2, 2 * CFG.num_hidden_layers), coll


# --- the memory figures of benchmarks/tp_memory.py -----------------------------------


def _tp_memory():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "tp_memory.py"
    spec = importlib.util.spec_from_file_location("tp_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tp_memory_figures_match_placed_arrays():
    """The computed per-device bytes equal what one device holds once placed."""
    tpm = _tp_memory()
    params = llama.init_params(CFG, jax.random.key(0))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), tpm.param_shapes(CFG)) == jax.tree.map(
        lambda x: (x.shape, x.dtype), params
    )
    for n in (1, 2, 4):
        mesh = _mesh(n)
        dev = mesh.devices.flat[0]
        on_dev = lambda tree, dev=dev: sum(
            s.data.nbytes
            for x in jax.tree.leaves(tree)
            for s in x.addressable_shards
            if s.device == dev
        )
        assert on_dev(S.shard_params(params, mesh, CFG)) == tpm.weight_bytes_per_device(CFG, n)
        pages, page_size = 3, 4
        caches = S.shard_kv_cache(*llama.init_kv_cache(CFG, pages, page_size), mesh)
        per_token = tpm.kv_bytes_per_token_per_device(CFG, n)
        assert on_dev(caches) == per_token * pages * page_size
    assert tpm.ring_all_reduce_bytes(1000, 4) == 1500
