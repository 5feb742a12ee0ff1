"""rope_write_kv: a fused q|k|v projection's rows rotated (RoPE on q and k) and stored (k and
v at their slots), against a float64 numpy rotation; its backends against each other; the
model's and the engine's fused path against the separate rotation and write."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, tol
from test_kv import FP8, _bits, _special_rows, as_bshd_np, nan_cache

import jaxattn
from jaxattn import layout as L
from jaxattn import native
from jaxattn.kv import ROPE_WRITE_KV, rope_write_kv, rotate_half

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
NATIVE = pytest.mark.skipif(not native.is_available(), reason="no native library")
BACKENDS = ["reference", pytest.param("native", marks=NATIVE)]
_jit = jax.jit(rope_write_kv, static_argnames=("layout", "implementation"))


def _tables(rng, t, d):
    positions = rng.integers(0, 5000, size=t)
    inv = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    angles = positions[:, None] * inv[None, :]
    return np.cos(angles), np.sin(angles)


def _rotate_np(x, cos, sin):
    """float64 rotate-half of x [T, H, D] by cos, sin [T, D // 2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _serves(implementation, layout):
    if implementation == "native" and layout not in ("bshd", "bhsd"):
        pytest.skip("the native write stores the bshd and bhsd layouts")


@pytest.mark.parametrize("implementation", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("layout", L.LAYOUTS)
def test_rope_write_kv_matches_numpy(layout, dtype, implementation, rng):
    _serves(implementation, layout)
    num_pages, page_size, hq, hkv, d, t = 6, 4, 6, 2, 32, 11
    qkv64 = rng.standard_normal((t, hq + 2 * hkv, d))
    cos, sin = _tables(rng, t, d)
    slots = rng.permutation(num_pages * page_size)[:t].astype(np.int32)
    slots[[2, 7]] = [-1, num_pages * page_size + 3]  # padding and out of the pool: dropped
    kc, vc = nan_cache(layout, num_pages, page_size, hkv, d, dtype)
    qkv = jnp.asarray(qkv64, dtype)
    x = np.asarray(qkv.astype(jnp.float32), np.float64)  # the rows as given, rounded
    q, kc, vc = _jit(
        qkv,
        jnp.asarray(cos, jnp.float32),
        jnp.asarray(sin, jnp.float32),
        kc,
        vc,
        jnp.asarray(slots),
        layout=layout,
        implementation=implementation,
    )
    assert q.shape == (t, hq, d) and q.dtype == dtype
    assert_close(q, _rotate_np(x[:, :hq], cos, sin), dtype)
    k_np, v_np = as_bshd_np(kc, vc, layout)
    k_np, v_np = k_np.reshape(-1, hkv, d), v_np.reshape(-1, hkv, d)
    k_want = _rotate_np(x[:, hq : hq + hkv], cos, sin)
    written = np.zeros(num_pages * page_size, bool)
    for i, s in enumerate(slots):
        if 0 <= s < num_pages * page_size:
            written[s] = True
            np.testing.assert_allclose(k_np[s], k_want[i], **tol(dtype))
            np.testing.assert_array_equal(v_np[s], x[i, hq + hkv :])
    assert np.isnan(k_np[~written]).all() and np.isnan(v_np[~written]).all()


@NATIVE
@pytest.mark.parametrize(
    "layout, scaled", [("bshd", False), ("bhsd", True)], ids=["bshd-plain", "bhsd-scaled"]
)
@pytest.mark.parametrize("cache", [*DTYPES, *FP8], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_rope_write_kv_backends_agree(layout, dtype, cache, scaled, rng):
    """The native kernel stores what the reference stores: the same bits where the cache is
    the rows' dtype and the rotation rounds alike, else within one step of the cache's
    format (the rotation's products may round differently by an ulp of float32)."""
    num_pages, page_size, hq, hkv, d, t = 7, 4, 4, 2, 16, 19
    kc = jnp.asarray(
        rng.standard_normal(L.cache_shape(layout, "k", num_pages, page_size, hkv, d, jnp.float32)),
        cache,
    )
    vc = jnp.full(L.cache_shape(layout, "v", num_pages, page_size, hkv, d, cache), jnp.nan, cache)
    qkv = _special_rows(rng, t, hq + 2 * hkv, d, dtype, 3.0)
    cos, sin = (jnp.asarray(a, jnp.float32) for a in _tables(rng, t, d))
    slots = rng.permutation(num_pages * page_size)[:t].astype(np.int32)
    slots[[1, 4, 9]] = [-1, num_pages * page_size, num_pages * page_size + 5]
    scales = {}
    if scaled:
        scales = dict(k_scale=jnp.asarray([0.37, 3.0], jnp.float32), v_scale=0.01)
    args = (qkv, cos, sin, kc, vc, jnp.asarray(slots))
    want = _jit(*args, layout=layout, implementation="reference", **scales)
    got = _jit(*args, layout=layout, implementation="native", **scales)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        gb, wb = _bits(g), _bits(w)
        differ = gb != wb
        # Where they differ, both are finite neighbours in the stored format.
        assert differ.mean() < 0.02, differ.mean()
        gf = np.asarray(g.astype(jnp.float32))[differ]
        wf = np.asarray(w.astype(jnp.float32))[differ]
        assert np.isfinite(gf).all() and np.isfinite(wf).all()
        info = jnp.finfo(g.dtype)
        step = np.abs(wf) * 2.0 ** -float(info.nmant) + float(info.smallest_subnormal)
        assert (np.abs(gf - wf) <= 2 * step).all()


@pytest.mark.parametrize("implementation", BACKENDS)
def test_rope_write_kv_propagates_nan_to_its_own_rows(implementation, rng):
    """NaN in one token's q row reaches only that token's q; NaN in a key row only that
    token's cache slot; nothing else moves."""
    num_pages, page_size, hq, hkv, d, t = 2, 4, 2, 1, 16, 3
    qkv = np.asarray(rng.standard_normal((t, hq + 2 * hkv, d)), np.float32)
    qkv[0, 1, 3] = np.nan  # token 0, query head 1
    qkv[2, hq, 5] = np.nan  # token 2, the key head
    cos, sin = (jnp.asarray(a, jnp.float32) for a in _tables(rng, t, d))
    kc = jnp.zeros((num_pages, page_size, hkv, d), jnp.float32)
    q, kc, vc = _jit(
        jnp.asarray(qkv), cos, sin, kc, kc, jnp.asarray([5, 0, 2], jnp.int32),
        layout="bshd", implementation=implementation,
    )  # fmt: skip
    q = np.asarray(q)
    assert np.isnan(q[0, 1]).any() and not np.isnan(np.delete(q.reshape(-1, d), 1, 0)).any()
    k = np.asarray(kc).reshape(-1, hkv, d)
    assert np.isnan(k[2]).any() and not np.isnan(np.delete(k, 2, 0)).any()
    assert not np.isnan(np.asarray(vc)).any()


def _sequential_sum(parts):
    acc = parts[0].copy()
    for p in parts[1:]:
        acc = (acc + p).astype(np.float32)
    return acc


@pytest.mark.parametrize("implementation", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("layout, splits", [("bshd", 1), ("bhsd", 3), ("bshd", 8)])
def test_rope_write_kv_sums_split_k_partials(layout, splits, dtype, implementation, rng):
    """qkv as a split-K projection's float32 partial sums [S, T, H, D] with dtype=: what
    the op stores and returns for their float32 sum rounded to dtype (the native kernel: bit
    for bit, summed in split order; the reference: within the dtype's tolerance, XLA's
    reduction), NaN-poisoned slots untouched."""
    num_pages, page_size, hq, hkv, d, t = 5, 4, 4, 2, 16, 7
    parts = np.asarray(rng.standard_normal((splits, t, hq + 2 * hkv, d)), np.float32)
    cos, sin = (jnp.asarray(a, jnp.float32) for a in _tables(rng, t, d))
    slots = rng.permutation(num_pages * page_size)[:t].astype(np.int32)
    slots[3] = -1
    kc, vc = nan_cache(layout, num_pages, page_size, hkv, d, dtype)
    rows = jnp.asarray(_sequential_sum(parts)).astype(dtype)
    common = dict(layout=layout, implementation=implementation)
    got = jax.jit(rope_write_kv, static_argnames=("layout", "implementation", "dtype"))(
        jnp.asarray(parts), cos, sin, kc, vc, jnp.asarray(slots), dtype=dtype, **common
    )
    want = _jit(rows, cos, sin, kc, vc, jnp.asarray(slots), **common)
    assert got[0].shape == (t, hq, d) and got[0].dtype == dtype
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        if implementation == "native":
            np.testing.assert_array_equal(_bits(g), _bits(w))
        else:
            gf, wf = (np.asarray(a.astype(jnp.float32)) for a in (g, w))
            np.testing.assert_array_equal(np.isnan(gf), np.isnan(wf))
            np.testing.assert_allclose(gf[~np.isnan(gf)], wf[~np.isnan(wf)], **tol(dtype))


@pytest.mark.parametrize("implementation", BACKENDS)
def test_rope_write_kv_partials_keep_nan_in_their_row(implementation, rng):
    num_pages, page_size, hq, hkv, d, t = 2, 4, 2, 1, 16, 3
    parts = np.asarray(rng.standard_normal((4, t, hq + 2 * hkv, d)), np.float32)
    parts[2, 1, 0, 3] = np.nan  # token 1, query head 0, in one partial sum
    cos, sin = (jnp.asarray(a, jnp.float32) for a in _tables(rng, t, d))
    kc = jnp.zeros((num_pages, page_size, hkv, d), jnp.float32)
    q, kc, vc = jaxattn.rope_write_kv(
        jnp.asarray(parts), cos, sin, kc, kc, jnp.asarray([5, 0, 2], jnp.int32),
        dtype=jnp.float32, implementation=implementation,
    )  # fmt: skip
    q = np.asarray(q).reshape(-1, d)
    assert np.isnan(q[1 * hq + 0]).any() and not np.isnan(np.delete(q, 1 * hq + 0, 0)).any()
    assert not np.isnan(np.asarray(kc)).any() and not np.isnan(np.asarray(vc)).any()


def test_rope_write_kv_bad_arguments_name_the_argument():
    kc = jnp.zeros((2, 4, 2, 16), jnp.bfloat16)
    qkv = jnp.zeros((3, 6, 16), jnp.bfloat16)
    table = jnp.zeros((3, 8), jnp.float32)
    slots = jnp.zeros((3,), jnp.int32)
    with pytest.raises(ValueError, match="qkv"):
        rope_write_kv(qkv[:, :4], table, table, kc, kc, slots)  # no query head left
    with pytest.raises(ValueError, match="qkv"):
        rope_write_kv(qkv[..., :8], table, table, kc, kc, slots)
    with pytest.raises(ValueError, match="cos"):
        rope_write_kv(qkv, table[:2], table, kc, kc, slots)
    with pytest.raises(ValueError, match="sin"):
        rope_write_kv(qkv, table, table.astype(jnp.bfloat16), kc, kc, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_write_kv(qkv, table, table, kc, kc, slots[:2])
    with pytest.raises(TypeError, match="slot_mapping"):
        rope_write_kv(qkv, table, table, kc, kc, slots.astype(jnp.float32))
    with pytest.raises(ValueError, match="k_scale"):
        rope_write_kv(qkv, table, table, kc, kc, slots, k_scale=jnp.ones(3, jnp.float32))
    with pytest.raises(TypeError, match="qkv"):
        rope_write_kv(qkv.astype(jnp.int32), table, table, kc, kc, slots)
    parts = jnp.zeros((2, 3, 6, 16), jnp.float32)
    with pytest.raises(ValueError, match="dtype"):
        rope_write_kv(parts, table, table, kc, kc, slots)  # partial sums round to dtype=
    with pytest.raises(TypeError, match="partial sums must be float32"):
        rope_write_kv(parts.astype(jnp.bfloat16), table, table, kc, kc, slots, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="qkv"):
        rope_write_kv(parts[:0], table, table, kc, kc, slots, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        rope_write_kv(qkv, table, table, kc, kc, slots, dtype=jnp.float32)  # not qkv's


def test_rope_write_kv_resolves_and_handles_no_tokens():
    kc = jnp.zeros((2, 4, 2, 16), jnp.float32)
    table = jnp.zeros((0, 8), jnp.float32)
    qkv = jnp.zeros((0, 6, 16), jnp.float32)
    args = ROPE_WRITE_KV.bind(qkv, table, table, kc, kc, jnp.zeros((0,), jnp.int32))
    default = "reference" if jax.default_backend() == "cpu" else "native"
    assert ROPE_WRITE_KV.resolve(args).backend == default
    q, k2, v2 = jaxattn.rope_write_kv(qkv, table, table, kc, kc, jnp.zeros((0,), jnp.int32))
    assert q.shape == (0, 2, 16) and k2 is kc and v2 is kc
    parts = jnp.zeros((3, 0, 6, 16), jnp.float32)
    q, k2, v2 = jaxattn.rope_write_kv(
        parts, table, table, kc, kc, jnp.zeros((0,), jnp.int32), dtype=jnp.bfloat16
    )
    assert q.shape == (0, 2, 16) and q.dtype == jnp.bfloat16 and k2 is kc
    with pytest.raises(NotImplementedError, match="pallas"):
        ROPE_WRITE_KV.resolve(args, "pallas")  # no Pallas kernel: a named backend never falls back


def test_rotate_half_is_the_model_s_rotation(rng):
    from jaxattn.models.llama import apply_rope

    x = jnp.asarray(rng.standard_normal((5, 3, 8)), jnp.bfloat16)
    positions = jnp.asarray([0, 1, 7, 300, 4095])
    inv = jnp.asarray(1.0 / (10000.0 ** (np.arange(0, 8, 2) / 8)), jnp.float32)
    angles = positions.astype(jnp.float32)[:, None] * inv[None, :]
    want = rotate_half(x, jnp.cos(angles), jnp.sin(angles))
    np.testing.assert_array_equal(np.asarray(apply_rope(x, positions, inv)), np.asarray(want))
