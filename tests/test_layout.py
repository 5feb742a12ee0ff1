"""KV cache layouts: conversions, token gather/scatter, and the stride formulas."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import DTYPES, random_normal

from jaxattn import layout as L


def _cache(rng, dtype, n=5, p=4, h=3, d=16):
    return random_normal(rng, (n, p, h, d), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("src,dst", list(itertools.product(L.LAYOUTS, L.LAYOUTS)))
def test_conversions_round_trip_exactly(dtype, src, dst):
    rng = np.random.default_rng(0)
    k, v = _cache(rng, dtype), _cache(rng, dtype)
    ks, vs = L.convert(k, v, "bshd", src)
    kd, vd = L.convert(ks, vs, src, dst)
    assert kd.shape == L.cache_shape(dst, "k", 5, 4, 3, 16, dtype)
    assert vd.shape == L.cache_shape(dst, "v", 5, 4, 3, 16, dtype)
    kb, vb = L.convert(kd, vd, dst, "bshd")
    np.testing.assert_array_equal(np.asarray(kb, np.float32), np.asarray(k, np.float32))
    np.testing.assert_array_equal(np.asarray(vb, np.float32), np.asarray(v, np.float32))


def test_vllm_x_follows_itemsize():
    assert L.vllm_x(jnp.float32) == 4
    assert L.vllm_x(jnp.bfloat16) == 8
    assert L.vllm_x(jnp.float16) == 8
    assert L.cache_shape("vllm", "k", 7, 16, 2, 128, jnp.bfloat16) == (7, 2, 16, 16, 8)
    assert L.cache_shape("vllm", "v", 7, 16, 2, 128, jnp.bfloat16) == (7, 2, 128, 16)


@pytest.mark.parametrize("layout", L.LAYOUTS)
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_element_offset_matches_numpy_strides(layout, kind, dtype):
    n, p, h, d = 2, 4, 2, 16  # 256 elements: every code is exact in bfloat16 too
    shape = L.cache_shape(layout, kind, n, p, h, d, dtype)
    # Fill the canonical cache with each element's own (page, offset, head, d) code, convert
    # to the layout, then check that the flat buffer at element_offset holds that code.
    code = np.arange(n * p * h * d, dtype=np.int64).reshape(n, p, h, d)
    conv = L.from_bshd(jnp.asarray(code, dtype), layout, kind)
    assert conv.shape == shape
    flat = np.asarray(conv, np.float32).reshape(-1)
    pg, off, hd, dd = np.meshgrid(*map(np.arange, (n, p, h, d)), indexing="ij")
    offs = L.element_offset(layout, shape, pg, off, hd, dd, kind=kind)
    np.testing.assert_array_equal(flat[offs], code)
    # and against numpy's own strides for one element
    arr = np.empty(shape, np.float32)
    idx = {"bshd": (1, 3, 1, 13), "bhsd": (1, 1, 3, 13)}.get(layout)
    if idx is None:
        x = shape[-1] if kind == "k" else None
        idx = (1, 1, 13 // x, 3, 13 % x) if kind == "k" else (1, 1, 13, 3)
    want = sum(i * s for i, s in zip(idx, np.array(arr.strides) // arr.itemsize, strict=True))
    assert L.element_offset(layout, shape, 1, 3, 1, 13, kind=kind) == want


@pytest.mark.parametrize("layout", L.LAYOUTS)
def test_gather_and_scatter_tokens(layout):
    rng = np.random.default_rng(1)
    k = _cache(rng, jnp.bfloat16)
    v = _cache(rng, jnp.bfloat16)
    kl, vl = L.convert(k, v, "bshd", layout)
    slots = jnp.array([[19, 0], [7, 4]], jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(L.gather_tokens(kl, slots, layout, "k"), np.float32),
        np.asarray(k.reshape(20, 3, 16)[slots], np.float32),
    )
    np.testing.assert_array_equal(
        np.asarray(L.gather_tokens(vl, slots, layout, "v"), np.float32),
        np.asarray(v.reshape(20, 3, 16)[slots], np.float32),
    )
    new = random_normal(rng, (3, 3, 16), jnp.bfloat16)
    targets = jnp.array([5, -1, 18], jnp.int32)  # -1 is padding and must be dropped
    k2 = L.scatter_tokens(kl, targets, new, layout, "k")
    v2 = L.scatter_tokens(vl, targets, new, layout, "v")
    kb, vb = L.convert(k2, v2, layout, "bshd")
    want = np.asarray(k.reshape(20, 3, 16), np.float32).copy()
    want[[5, 18]] = np.asarray(new, np.float32)[[0, 2]]
    np.testing.assert_array_equal(np.asarray(kb.reshape(20, 3, 16), np.float32), want)
    want_v = np.asarray(v.reshape(20, 3, 16), np.float32).copy()
    want_v[[5, 18]] = np.asarray(new, np.float32)[[0, 2]]
    np.testing.assert_array_equal(np.asarray(vb.reshape(20, 3, 16), np.float32), want_v)


def test_cache_geometry_errors_name_the_argument():
    k = jnp.zeros((4, 8, 2, 16))
    assert L.cache_geometry(k, k, "bshd") == (4, 8, 2, 16)
    with pytest.raises(ValueError, match="layout"):
        L.cache_geometry(k, k, "nhd")
    with pytest.raises(ValueError, match="k_cache"):
        L.cache_geometry(k[0], k, "bshd")
    with pytest.raises(ValueError, match="v_cache"):
        L.cache_geometry(k, k[:, :4], "bshd")
    kv = jnp.zeros((4, 2, 4, 8, 4))  # f32 vllm: x = 4
    assert L.cache_geometry(kv, jnp.zeros((4, 2, 16, 8)), "vllm") == (4, 8, 2, 16)
    with pytest.raises(ValueError, match="x=16//itemsize"):
        L.cache_geometry(jnp.zeros((4, 2, 2, 8, 8)), jnp.zeros((4, 2, 16, 8)), "vllm")
