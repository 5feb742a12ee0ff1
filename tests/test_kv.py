"""write_kv / copy_blocks: exact data movement in every layout, attention over caches written
through the host structures, copy-on-write branches, and in-place updates under donation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, naive_attention, tol

import jaxattn
from jaxattn import layout as L
from jaxattn import native, reference
from jaxattn.kv import WRITE_KV, copy_blocks, copy_blocks_donated, write_kv, write_kv_donated
from jaxattn.paging import BlockManager
from jaxattn.radix import RadixCache, TokenPool

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]
# write_kv's backends: XLA's scatters, and the native kernel (the C++ handler on the CPU,
# the CUDA/HIP kernel on a GPU), which must store the same bits.
WRITERS = [
    "reference",
    pytest.param(
        "native", marks=pytest.mark.skipif(not native.is_available(), reason="no native library")
    ),
]
_jit_write = jax.jit(write_kv, static_argnames=("layout", "implementation"))


def _writer_serves(implementation, layout):
    if implementation == "native" and layout not in ("bshd", "bhsd"):
        pytest.skip("the native write_kv stores the bshd and bhsd layouts")


def nan_cache(layout, num_pages, page_size, hkv, d, dtype):
    """A K/V pair in ``layout`` with every slot NaN: a read of an unwritten slot shows."""
    k = jnp.full(L.cache_shape(layout, "k", num_pages, page_size, hkv, d, dtype), jnp.nan, dtype)
    v = jnp.full(L.cache_shape(layout, "v", num_pages, page_size, hkv, d, dtype), jnp.nan, dtype)
    return k, v


def as_bshd_np(k_cache, v_cache, layout):
    k = L.to_bshd(k_cache, layout, "k")
    v = L.to_bshd(v_cache, layout, "v")
    return np.asarray(k.astype(jnp.float32)), np.asarray(v.astype(jnp.float32))


def rand(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)


# --- exact data movement -------------------------------------------------------------


@pytest.mark.parametrize("implementation", WRITERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("layout", L.LAYOUTS)
def test_write_kv_matches_numpy(layout, dtype, implementation):
    _writer_serves(implementation, layout)
    rng = np.random.default_rng(0)
    num_pages, page_size, hkv, d, t = 7, 5, 3, 16, 13
    k0 = rand(rng, (num_pages, page_size, hkv, d), dtype)
    v0 = rand(rng, (num_pages, page_size, hkv, d), dtype)
    kc, vc = L.convert(k0, v0, "bshd", layout)
    k, v = rand(rng, (t, hkv, d), dtype), rand(rng, (t, hkv, d), dtype)
    slots = rng.choice(num_pages * page_size, size=t, replace=False).astype(np.int32)
    slots[[2, 7, 12]] = [-1, -5, -1]  # padding writes nothing
    kc, vc = _jit_write(
        kc, vc, k, v, jnp.asarray(slots), layout=layout, implementation=implementation
    )
    want_k = np.array(k0.astype(jnp.float32)).reshape(num_pages * page_size, hkv, d)
    want_v = np.array(v0.astype(jnp.float32)).reshape(num_pages * page_size, hkv, d)
    keep = slots >= 0
    want_k[slots[keep]] = np.asarray(k.astype(jnp.float32))[keep]
    want_v[slots[keep]] = np.asarray(v.astype(jnp.float32))[keep]
    got_k, got_v = as_bshd_np(kc, vc, layout)
    assert kc.dtype == dtype
    np.testing.assert_array_equal(got_k.reshape(want_k.shape), want_k)
    np.testing.assert_array_equal(got_v.reshape(want_v.shape), want_v)


@pytest.mark.parametrize("implementation", WRITERS)
def test_write_kv_casts_to_the_cache_dtype(implementation):
    kc, vc = nan_cache("bshd", 2, 4, 1, 8, jnp.bfloat16)
    k = jnp.full((1, 1, 8), 1.5, jnp.float32)
    kc, vc = write_kv(kc, vc, k, k, jnp.asarray([5], jnp.int32), implementation=implementation)
    assert kc.dtype == jnp.bfloat16 and float(kc[1, 1, 0, 0]) == 1.5


@pytest.mark.parametrize("layout", L.LAYOUTS)
def test_copy_blocks_copies_whole_pages_and_skips_padding(layout):
    rng = np.random.default_rng(1)
    k0 = rand(rng, (6, 4, 2, 8), jnp.float32)
    v0 = rand(rng, (6, 4, 2, 8), jnp.float32)
    kc, vc = L.convert(k0, v0, "bshd", layout)
    src = jnp.asarray([1, 3, 0, 2], jnp.int32)
    dst = jnp.asarray([4, 1, -1, -1], jnp.int32)  # 1 is read and written: reads come first
    kc, vc = copy_blocks(kc, vc, src, dst, layout=layout)
    got_k, got_v = as_bshd_np(kc, vc, layout)
    want_k, want_v = np.array(k0), np.array(v0)
    want_k[[4, 1]], want_v[[4, 1]] = want_k[[1, 3]], want_v[[1, 3]]
    np.testing.assert_array_equal(got_k, want_k)  # the last page is untouched by -1
    np.testing.assert_array_equal(got_v, want_v)


# --- through the host structures ------------------------------------------------------


@pytest.mark.parametrize("layout", L.LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_writes_then_attention_equals_dense(layout, page_size):
    """Prefill prompts and decode tokens through BlockManager + write_kv, then the spec's
    paged attention over the written cache must equal attention over the dense K/V."""
    rng = np.random.default_rng(2)
    hq, hkv, d = 8, 2, 32
    prompts, steps = [1, 17, 33, 5], 20
    num_blocks = 64 if page_size == 16 else 256
    m = BlockManager(num_blocks, page_size)
    kc, vc = nan_cache(layout, num_blocks, page_size, hkv, d, jnp.float32)
    write = jax.jit(write_kv, static_argnames="layout", donate_argnums=(0, 1))
    dense_k = [rng.standard_normal((n + steps, hkv, d), dtype=np.float32) for n in prompts]
    dense_v = [rng.standard_normal((n + steps, hkv, d), dtype=np.float32) for n in prompts]
    # Occupy and release a few blocks first so that tables are not simply 0, 1, 2, ...
    m.allocate("warmup", 3 * page_size)
    for b, n in enumerate(prompts):
        m.allocate(b, n)
        kc, vc = write(
            kc,
            vc,
            dense_k[b][:n],
            dense_v[b][:n],
            jnp.asarray(m.slot_mapping(b, 0, n)),
            layout=layout,
        )
    m.free("warmup")
    batch = 8  # decode batches padded to a fixed size with slot -1
    for step in range(steps):
        slots = np.full(batch, -1, np.int32)
        k_new = np.zeros((batch, hkv, d), np.float32)
        v_new = np.zeros((batch, hkv, d), np.float32)
        for b, n in enumerate(prompts):
            assert m.append_slot(b) == []
            pos = n + step
            slots[b] = m.slot_mapping(b, pos, pos + 1)[0]
            k_new[b], v_new[b] = dense_k[b][pos], dense_v[b][pos]
        kc, vc = write(kc, vc, k_new, v_new, jnp.asarray(slots), layout=layout)
    ids = list(range(len(prompts)))
    tables = jnp.asarray(m.block_tables(ids, pad_to=num_blocks // 4))
    lens = jnp.asarray([m.seq_len(b) for b in ids], jnp.int32)
    q = rand(rng, (len(prompts), hq, d), jnp.float32)
    attend = jax.jit(reference.paged_attention, static_argnames="layout")
    out = attend(q, kc, vc, tables, lens, layout=layout)
    want = np.stack(
        [naive_attention(q[b][None], dense_k[b], dense_v[b])[0] for b in range(len(prompts))]
    )
    assert_close(out, want)


def test_radix_reuse_then_extend_attention_equals_dense():
    """Request 2 reuses request 1's cached prefix through the radix tree; extend attention
    over [prefix slots + new slots] must equal attention over the dense K/V."""
    rng = np.random.default_rng(3)
    hq, hkv, d, num_slots = 4, 2, 16, 128
    pool = TokenPool(num_slots)
    cache = RadixCache(pool)
    kc, vc = nan_cache("bshd", num_slots, 1, hkv, d, jnp.float32)
    system = rng.integers(0, 1000, 37).tolist()
    tokens1, tokens2 = system + [1, 2, 3], system + [4, 5, 6, 7, 8]
    # K/V here depend on the token only, which holds for a shared prefix in a real model.
    table = rng.standard_normal((1000, hkv, d), dtype=np.float32)
    kv_of = lambda toks: jnp.asarray(table[np.asarray(toks)])  # noqa: E731

    slots1 = pool.alloc(len(tokens1))
    kc, vc = write_kv(kc, vc, kv_of(tokens1), -kv_of(tokens1), jnp.asarray(slots1))
    assert cache.insert(tokens1, slots1) == 0

    hit = cache.match_prefix(tokens2)
    assert hit.length == len(system)
    cache.inc_lock_ref(hit.node)
    new = pool.alloc(len(tokens2) - hit.length)
    extend = tokens2[hit.length :]
    kc, vc = write_kv(kc, vc, kv_of(extend), -kv_of(extend), jnp.asarray(new))
    q = rand(rng, (len(extend), hq, d), jnp.float32)
    kv_indices = jnp.asarray(np.concatenate([hit.indices, new]))
    out = jax.jit(reference.extend_attention)(
        q,
        kc[:, 0],
        vc[:, 0],
        jnp.asarray([0, len(extend)], jnp.int32),
        jnp.asarray([0, len(tokens2)], jnp.int32),
        kv_indices,
    )
    want = naive_attention(q, kv_of(tokens2), -kv_of(tokens2))
    assert_close(out, want)
    assert cache.insert(tokens2, np.asarray(kv_indices)) == len(system)
    cache.dec_lock_ref(hit.node)
    assert cache.total_size == len(system) + 3 + 5
    cache.check_invariants()


@pytest.mark.parametrize("layout", L.LAYOUTS)
def test_copy_on_write_gives_each_branch_its_own_tail(layout):
    rng = np.random.default_rng(4)
    page_size, hkv, d = 4, 2, 8
    m = BlockManager(16, page_size)
    kc, vc = nan_cache(layout, 16, page_size, hkv, d, jnp.float32)
    prompt_k = rng.standard_normal((6, hkv, d), dtype=np.float32)
    prompt_v = rng.standard_normal((6, hkv, d), dtype=np.float32)
    m.allocate("a", 6)
    kc, vc = write_kv(
        kc, vc, prompt_k, prompt_v, jnp.asarray(m.slot_mapping("a", 0, 6)), layout=layout
    )
    m.fork("a", "b")
    m.fork("a", "c")
    dense = {s: (prompt_k, prompt_v) for s in "abc"}
    copies = 0
    for _ in range(3):  # every branch appends its own tokens; the first append diverges
        for s in "bca":
            orders = m.append_slot(s)
            copies += len(orders)
            pad = [(-1, -1)] * (2 - len(orders))  # a fixed batch of orders: one compile
            src = jnp.asarray([o[0] for o in orders + pad], jnp.int32)
            dst = jnp.asarray([o[1] for o in orders + pad], jnp.int32)
            kc, vc = copy_blocks_donated(kc, vc, src, dst, layout=layout)
            k1 = rng.standard_normal((1, hkv, d), dtype=np.float32)
            v1 = rng.standard_normal((1, hkv, d), dtype=np.float32)
            n = m.seq_len(s)
            kc, vc = write_kv_donated(
                kc, vc, k1, v1, jnp.asarray(m.slot_mapping(s, n - 1, n)), layout=layout
            )
            dk, dv = dense[s]
            dense[s] = (np.concatenate([dk, k1]), np.concatenate([dv, v1]))
    assert copies == 2  # b and c copy the shared tail; a then owns the original alone
    for s in "abc":
        slots = jnp.asarray(m.slot_mapping(s, 0, m.seq_len(s)))
        np.testing.assert_array_equal(L.gather_tokens(kc, slots, layout, "k"), dense[s][0])
        np.testing.assert_array_equal(L.gather_tokens(vc, slots, layout, "v"), dense[s][1])
    tails = {m.block_table(s)[-1] for s in "abc"}
    assert len(tails) == 3 and m.block_table("b")[0] == m.block_table("c")[0]


# --- donation ------------------------------------------------------------------------


def _args(op, layout, dtype):
    kc, vc = nan_cache(layout, 32, 16, 2, 64, dtype)
    if op == "write_kv":
        x = jnp.ones((5, 2, 64), dtype)
        return (kc, vc, x, x, jnp.arange(5, dtype=jnp.int32))
    return (kc, vc, jnp.asarray([1, 2], jnp.int32), jnp.asarray([7, -1], jnp.int32))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("layout", L.LAYOUTS)
@pytest.mark.parametrize("op", ["write_kv", "copy_blocks"])
def test_donated_caches_are_updated_in_place(op, layout, dtype):
    fn = {"write_kv": write_kv_donated, "copy_blocks": copy_blocks_donated}[op]
    args = _args(op, layout, dtype)
    compiled = fn.lower(*args, layout=layout).compile()
    header = compiled.as_text().split("\n", 1)[0]
    # Output i (the K / V cache) reuses parameter i's buffer.
    assert "input_output_alias={ {0}: (0, {}" in header and "{1}: (1, {}" in header
    cache_bytes = args[0].nbytes + args[1].nbytes
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes == cache_bytes
    if dtype != jnp.bfloat16:
        # No scratch copy of the pool. (XLA's CPU backend has no bf16 scatter and converts
        # through f32 temporaries; GPU backends scatter bf16 natively.)
        assert mem.temp_size_in_bytes < cache_bytes // 8
    out = fn(*args, layout=layout)
    assert args[0].is_deleted() and args[1].is_deleted()
    plain = jax.jit(write_kv if op == "write_kv" else copy_blocks, static_argnames="layout")
    ref = plain(*_args(op, layout, dtype), layout=layout)
    for got, want in zip(out, ref, strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# --- validation ----------------------------------------------------------------------


def test_bad_arguments_name_the_argument():
    kc, vc = nan_cache("bshd", 4, 4, 2, 8, jnp.float32)
    x = jnp.zeros((3, 2, 8))
    s = jnp.arange(3, dtype=jnp.int32)
    with pytest.raises(ValueError, match="k must be"):
        write_kv(kc, vc, jnp.zeros((3, 2, 4)), x, s)
    with pytest.raises(ValueError, match="v must be"):
        write_kv(kc, vc, x, jnp.zeros((3, 8)), s)
    with pytest.raises(ValueError, match="v must have the shape"):
        write_kv(kc, vc, x, jnp.zeros((2, 2, 8)), s)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        write_kv(kc, vc, x, x, jnp.arange(4, dtype=jnp.int32))
    with pytest.raises(TypeError, match="slot_mapping"):
        write_kv(kc, vc, x, x, jnp.zeros(3))
    with pytest.raises(ValueError, match="k_cache"):
        write_kv(kc[0], vc, x, x, s)
    with pytest.raises(ValueError, match="layout"):
        write_kv(kc, vc, x, x, s, layout="nhd")
    with pytest.raises(ValueError, match="dst must be"):
        copy_blocks(kc, vc, s, s[:2])
    with pytest.raises(ValueError, match="src must be"):
        copy_blocks(kc, vc, s[None], s)
    with pytest.raises(TypeError, match="src"):
        copy_blocks(kc, vc, [0], s)


# --- FP8 caches: quantising writes ------------------------------------------------------

_fp8_id = lambda d: np.dtype(d).name  # noqa: E731


def _stored_np(x, scale, dtype):
    """What an FP8 cache must hold for x [T, H, D] with per-head scale [H]: ml_dtypes'
    round-to-nearest-even of x / scale after clipping to the finite range."""
    big = float(jnp.finfo(dtype).max)
    y = np.asarray(x, np.float32) / np.asarray(scale, np.float32)[None, :, None]
    return np.clip(y, -big, big).astype(np.dtype(dtype))


@pytest.mark.parametrize("implementation", WRITERS)
@pytest.mark.parametrize("dtype", FP8, ids=_fp8_id)
@pytest.mark.parametrize("layout", L.LAYOUTS)
def test_write_kv_quantises_with_per_head_scales(layout, dtype, implementation):
    _writer_serves(implementation, layout)
    rng = np.random.default_rng(5)
    num_pages, page_size, hkv, d, t = 6, 4, 3, 32, 11
    kc, vc = nan_cache(layout, num_pages, page_size, hkv, d, dtype)
    mags = np.array([0.01, 1.0, 300.0], np.float32)[:, None]  # heads far apart
    k = rng.standard_normal((t, hkv, d), dtype=np.float32) * mags
    v = rng.standard_normal((t, hkv, d), dtype=np.float32) * mags[::-1]
    k_scale, v_scale = jaxattn.fp8_scales(jnp.asarray(k), jnp.asarray(v), dtype)
    slots = rng.choice(num_pages * page_size, size=t, replace=False).astype(np.int32)
    kc, vc = _jit_write(
        kc,
        vc,
        k,
        v,
        jnp.asarray(slots),
        layout=layout,
        k_scale=k_scale,
        v_scale=v_scale,
        implementation=implementation,
    )
    assert kc.dtype == dtype and vc.dtype == dtype
    got_k = L.gather_tokens(kc, jnp.asarray(slots), layout, "k")
    got_v = L.gather_tokens(vc, jnp.asarray(slots), layout, "v")
    # Exactly the format's rounding of x / scale ...
    np.testing.assert_array_equal(np.asarray(got_k), _stored_np(k, k_scale, dtype))
    np.testing.assert_array_equal(np.asarray(got_v), _stored_np(v, v_scale, dtype))
    # ... so that element * scale gives x back within half an ulp of the format (the scale
    # maps each head's amax to the format's max, so no head falls into the subnormals).
    for got, x, s in ((got_k, k, k_scale), (got_v, v, v_scale)):
        back = np.asarray(got, np.float32) * np.asarray(s)[None, :, None]
        t_ = tol(dtype)
        np.testing.assert_allclose(back, x, rtol=t_["rtol"], atol=t_["atol"] * np.asarray(s).max())


@pytest.mark.parametrize("implementation", WRITERS)
@pytest.mark.parametrize("dtype", FP8, ids=_fp8_id)
def test_write_kv_saturates_and_keeps_nan(dtype, implementation):
    kc, vc = nan_cache("bshd", 2, 4, 2, 8, dtype)
    big = float(jnp.finfo(dtype).max)
    x = np.zeros((5, 2, 8), np.float32)
    x[0, 0, :4] = [1e30, -1e30, np.inf, -np.inf]
    x[1, 1, :3] = [big * 1.06, -big * 1.2, np.nan]  # past the largest finite value
    x[2] = 3.0
    kc, vc = _jit_write(
        kc, vc, x, x, jnp.arange(5, dtype=jnp.int32), k_scale=0.5, implementation=implementation
    )
    got = np.asarray(kc[:2].reshape(8, 2, 8)[:5], np.float32)
    np.testing.assert_array_equal(got[0, 0, :4], [big, -big, big, -big])  # never inf / NaN
    np.testing.assert_array_equal(got[1, 1, :2], [big, -big])
    assert np.isnan(got[1, 1, 2])
    assert np.isfinite(np.delete(got.reshape(-1), 1 * 16 + 8 + 2)).all()
    np.testing.assert_array_equal(got[2], 6.0)  # 3 / 0.5
    # Without a scale an FP8 cache still saturates (the V cache here).
    gv = np.asarray(vc[:2].reshape(8, 2, 8)[:5], np.float32)
    np.testing.assert_array_equal(gv[0, 0, :4], [big, -big, big, -big])
    np.testing.assert_array_equal(gv[2], 3.0)


@pytest.mark.parametrize("dtype", FP8, ids=_fp8_id)
def test_write_kv_round_trip_through_attention(dtype):
    """Written with fp8_scales and read by the ops with the same scales, attention is within
    the format's error of attention over the exact values."""
    rng = np.random.default_rng(6)
    hq, hkv, d, n = 8, 2, 64, 150
    kc, vc = nan_cache("bshd", 12, 16, hkv, d, dtype)
    k = rng.standard_normal((n, hkv, d), dtype=np.float32) * np.float32([[0.2], [20.0]])
    v = rng.standard_normal((n, hkv, d), dtype=np.float32) * np.float32([[5.0], [0.05]])
    ks, vs = jaxattn.fp8_scales(jnp.asarray(k), jnp.asarray(v), dtype)
    kc, vc = write_kv(kc, vc, k, v, jnp.arange(n, dtype=jnp.int32), k_scale=ks, v_scale=vs)
    q = rand(rng, (1, hq, d), jnp.float32) * 0.3
    tables = jnp.arange(12, dtype=jnp.int32)[None]
    out = jaxattn.paged_attention(
        q, kc, vc, tables, jnp.asarray([n], jnp.int32), k_scale=ks, v_scale=vs
    )
    want = naive_attention(q, k, v)
    # Per head, relative to its values' magnitude: an output is a convex mix of values.
    err = np.abs(np.asarray(out[0]) - want[0]).max(axis=-1)
    mag = np.repeat(np.abs(v).max(axis=(0, 2)), hq // hkv)
    assert (err / mag < {jnp.float8_e4m3fn: 0.05, jnp.float8_e5m2: 0.1}[dtype]).all(), err / mag


def test_write_kv_scales_are_traced():
    traces = []

    def f(kc, vc, x, s, ks):
        traces.append(1)
        return write_kv(kc, vc, x, x, s, k_scale=ks, v_scale=ks)

    g = jax.jit(f)
    kc, vc = nan_cache("bshd", 2, 4, 2, 8, jnp.float8_e4m3fn)
    x = jnp.ones((3, 2, 8), jnp.float32)
    s = jnp.arange(3, dtype=jnp.int32)
    a, _ = g(kc, vc, x, s, jnp.array([1.0, 2.0]))
    b, _ = g(kc, vc, x, s, jnp.array([0.25, 0.5]))
    assert len(traces) == 1
    np.testing.assert_array_equal(np.asarray(a[0, :3], np.float32)[:, :, 0], [[1, 0.5]] * 3)
    np.testing.assert_array_equal(np.asarray(b[0, :3], np.float32)[:, :, 0], [[4, 2]] * 3)


def test_fp8_scales():
    k = np.zeros((4, 3, 8), np.float32)
    k[1, 0, 2] = -896.0  # head 0: amax 896 -> 2.0 for e4m3
    k[2, 1, 5] = 44.8  # head 1: 0.1
    k[3, 1, 0] = np.nan  # ignored
    k[0, 2, :] = np.inf  # head 2: nothing finite and nonzero -> 1.0
    v = np.full((4, 3, 8), 57344.0, np.float32)
    ks, vs = jaxattn.fp8_scales(jnp.asarray(k), jnp.asarray(v))
    np.testing.assert_allclose(np.asarray(ks), [2.0, 0.1, 1.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(vs), [128.0] * 3)
    _, vs = jaxattn.fp8_scales(jnp.asarray(k), jnp.asarray(v), jnp.float8_e5m2)
    np.testing.assert_allclose(np.asarray(vs), [1.0] * 3)
    # Any leading axes: [layers, T, Hkv, D] gives one scale per head over all of them.
    ks2, _ = jaxattn.fp8_scales(jnp.asarray(k)[None], jnp.asarray(v)[None])
    np.testing.assert_array_equal(np.asarray(ks2), np.asarray(ks))
    with pytest.raises(TypeError, match="dtype must be one of"):
        jaxattn.fp8_scales(jnp.asarray(k), jnp.asarray(v), jnp.bfloat16)
    with pytest.raises(ValueError, match="k must be"):
        jaxattn.fp8_scales(jnp.zeros(3), jnp.asarray(v))
    with pytest.raises(ValueError, match="same number of KV heads"):
        jaxattn.fp8_scales(jnp.asarray(k), jnp.asarray(v)[:, :2])


def test_write_kv_scale_validation():
    kc, vc = nan_cache("bshd", 2, 4, 2, 8, jnp.float8_e4m3fn)
    x = jnp.ones((3, 2, 8), jnp.float32)
    s = jnp.arange(3, dtype=jnp.int32)
    with pytest.raises(ValueError, match="k_scale must be a scalar or float32"):
        write_kv(kc, vc, x, x, s, k_scale=jnp.ones(3))
    with pytest.raises(ValueError, match="v_scale must be finite and positive"):
        write_kv(kc, vc, x, x, s, v_scale=jnp.array([1.0, -1.0]))
    with pytest.raises(TypeError, match="k and v must be float"):
        write_kv(kc, vc, x.astype(jnp.int32), x, s)


# --- the backends of write_kv store the same bits ----------------------------------------------


def _bits(x):
    """The stored bits, with every NaN alike (the backends may pick different NaN payloads)."""
    x = np.asarray(x)
    bits = x.view(f"u{x.dtype.itemsize}").astype(np.uint32)
    return np.where(np.isnan(x.astype(np.float32)), np.uint32(0xFFFFFFFF), bits)


def _special_rows(rng, t, hkv, d, dtype, mag):
    """Random rows over many magnitudes with infinities, NaN, huge values, values in the FP8
    subnormal range and ties of the FP8 roundings."""
    x = rng.standard_normal((t, hkv, d)).astype(np.float32) * mag
    x *= np.exp2(rng.integers(-12, 12, size=x.shape)).astype(np.float32)
    flat = x.reshape(-1)
    picks = rng.choice(flat.size, size=min(flat.size, 24), replace=False)
    specials = [
        np.nan,
        np.inf,
        -np.inf,
        1e30,
        -1e30,
        448.0,
        464.0,
        -480.0,
        57344.0,
        61440.0,
        2.0**-9,
        1.5 * 2.0**-9,
        2.0**-16,
        2.5 * 2.0**-16,
        0.0,
        -0.0,
        1.0625,
        65520.0,
        -65504.0,
        3e-8,
        1.0 + 2.0**-8,
        1.0 + 3 * 2.0**-9,
        2.0**-7 * 1.5,
        70000.0,
    ]
    flat[picks] = np.asarray(specials[: picks.size], np.float32)
    return jnp.asarray(x, dtype)


@pytest.mark.skipif(not native.is_available(), reason="no native library")
@pytest.mark.parametrize(
    "layout, scaled", [("bshd", False), ("bhsd", True)], ids=["bshd-plain", "bhsd-scaled"]
)
@pytest.mark.parametrize("cache", [*DTYPES, *FP8], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_write_kv_backends_store_the_same_bits(layout, dtype, cache, scaled, rng):
    num_pages, page_size, hkv, d, t = 7, 4, 3, 16, 19
    kc = jnp.asarray(
        rng.standard_normal(L.cache_shape(layout, "k", num_pages, page_size, hkv, d, jnp.float32)),
        cache,
    )
    vc = jnp.full(L.cache_shape(layout, "v", num_pages, page_size, hkv, d, cache), jnp.nan, cache)
    k = _special_rows(rng, t, hkv, d, dtype, 3.0)
    v = _special_rows(rng, t, hkv, d, dtype, 0.01)
    slots = rng.permutation(num_pages * page_size)[:t].astype(np.int32)
    slots[[1, 4, 9]] = [-1, num_pages * page_size, num_pages * page_size + 5]  # all dropped
    scales = {}
    if scaled:
        scales = dict(k_scale=jnp.asarray([0.37, 3.0, 1e-3], jnp.float32), v_scale=0.01)
    args = (kc, vc, k, v, jnp.asarray(slots))
    want = _jit_write(*args, layout=layout, implementation="reference", **scales)
    got = _jit_write(*args, layout=layout, implementation="native", **scales)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(_bits(g), _bits(w))


@pytest.mark.parametrize("implementation", WRITERS)
def test_write_kv_leaves_an_undonated_cache_alone(implementation):
    """A cache that is not donated keeps its contents (the native call's result aliases its
    cache operand, so XLA must copy it first); a donated one is consumed."""
    kc = jnp.zeros((3, 4, 2, 8), jnp.bfloat16)
    vc = jnp.ones((3, 4, 2, 8), jnp.bfloat16)
    new = jnp.full((2, 2, 8), 7.0, jnp.bfloat16)
    slots = jnp.asarray([2, 11], jnp.int32)
    k2, v2 = _jit_write(kc, vc, new, new, slots, implementation=implementation)
    assert float(kc.astype(jnp.float32).sum()) == 0.0 and float(vc[0, 2, 0, 0]) == 1.0
    assert float(k2[0, 2, 0, 0]) == 7.0 and float(v2[2, 3, 1, 7]) == 7.0
    # The same array as both caches: each result gets its own copy of it.
    k3, v3 = _jit_write(vc, vc, new, new * 2, slots, implementation=implementation)
    assert float(k3[0, 2, 0, 0]) == 7.0 and float(v3[0, 2, 0, 0]) == 14.0
    assert float(vc[0, 2, 0, 0]) == 1.0
    donated = jax.jit(write_kv, static_argnames=("layout", "implementation"), donate_argnums=(0, 1))
    kd, vd = jnp.array(kc), jnp.array(vc)
    k4, _ = donated(kd, vd, new, new, slots, implementation=implementation)
    assert float(k4[2, 3, 1, 7]) == 7.0
    if jax.default_backend() != "cpu":  # the CPU backend may ignore donation
        assert kd.is_deleted()


def test_write_kv_resolves_its_backend():
    kc = jax.ShapeDtypeStruct((4, 16, 2, 64), jnp.bfloat16)
    row = jax.ShapeDtypeStruct((3, 2, 64), jnp.bfloat16)
    args = WRITE_KV.bind(kc, kc, row, row, jax.ShapeDtypeStruct((3,), jnp.int32))
    assert WRITE_KV.resolve(args, "reference").backend == "reference"
    want = "native" if jax.default_backend() != "cpu" and native.is_available() else "reference"
    assert WRITE_KV.resolve(args).backend == want
    vllm = WRITE_KV.bind(
        jax.ShapeDtypeStruct((4, 2, 8, 16, 8), jnp.bfloat16),
        jax.ShapeDtypeStruct((4, 2, 64, 16), jnp.bfloat16),
        row,
        row,
        jax.ShapeDtypeStruct((3,), jnp.int32),
        layout="vllm",
    )
    if native.is_available():
        with pytest.raises(NotImplementedError, match="bshd"):
            WRITE_KV.resolve(vllm, "native")
    assert WRITE_KV.resolve(vllm, ("native", "reference")).backend == "reference"
    with pytest.raises(ValueError, match="implementation must name backends"):
        write_kv(
            jnp.zeros((1, 2, 1, 8)),
            jnp.zeros((1, 2, 1, 8)),
            jnp.zeros((1, 1, 8)),
            jnp.zeros((1, 1, 8)),
            jnp.zeros((1,), jnp.int32),
            implementation="fast",
        )


@pytest.mark.parametrize("implementation", WRITERS)
def test_write_kv_with_nothing_to_write(implementation):
    kc = jnp.ones((2, 4, 1, 8), jnp.float16)
    none = jnp.zeros((0, 1, 8), jnp.float16)
    k2, v2 = _jit_write(
        kc, kc, none, none, jnp.zeros((0,), jnp.int32), implementation=implementation
    )
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(kc))
    np.testing.assert_array_equal(np.asarray(v2), np.asarray(kc))
