"""native.add_rms_norm: a residual add and the RMSNorm after it in one kernel, against the
model's own XLA computation and a float64 one; the model's and the engine's fused path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tol

from jaxattn import native
from jaxattn.models import llama

pytestmark = pytest.mark.skipif(not native.is_available(), reason="no native library")

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
EPS = 1e-5
_fused = jax.jit(native.add_rms_norm, static_argnames=("eps",))


@jax.jit
def _xla(x, d, w):
    s = x + d
    return s, llama.rms_norm(s, w, EPS)


def _rows(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
# Row lengths for each GPU kernel: a chunk of 8 a thread (up to 2048), two (4096), and rows past
# what the registers hold.
@pytest.mark.parametrize(
    "rows, cols", [(1, 64), (5, 2048), (2, 3000), (3, 4104), (2, 8200), (2, 16)]
)
def test_add_rms_norm_matches_the_model(rows, cols, dtype, rng):
    x = _rows(rng, (rows, cols), dtype, 3.0)
    d = _rows(rng, (rows, cols), dtype, 0.5)
    w = _rows(rng, (cols,), dtype)
    s, h = _fused(x, d, w, eps=EPS)
    s_want, h_want = _xla(x, d, w)
    assert s.dtype == h.dtype == dtype and s.shape == h.shape == (rows, cols)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_want))  # one rounded add
    # The norm: within the dtype's tolerance of float64, and at most a step of the dtype
    # from XLA's (whose mean and rsqrt may round their last float32 bits differently, and
    # which may or may not round the normalised row before the weight's product).
    sf = np.asarray(s.astype(jnp.float32), np.float64)
    inv = 1.0 / np.sqrt((sf * sf).mean(-1, keepdims=True) + EPS)
    want64 = sf * inv * np.asarray(w.astype(jnp.float32), np.float64)
    got = np.asarray(h.astype(jnp.float32), np.float64)
    np.testing.assert_allclose(got, want64, **tol(dtype))
    xla = np.asarray(h_want.astype(jnp.float32), np.float64)
    # (float32: a few ulps, as the row's mean of squares is summed in another order.)
    step = max(2.0 ** -float(jnp.finfo(dtype).nmant), 2.0**-20)
    assert (np.abs(got - xla) <= 2 * step * np.abs(xla) + 1e-30).all()


def _sequential_sum(parts):
    """float32 partial sums [S, ...] summed in split order, in float32 (the kernel's order)."""
    acc = parts[0].copy()
    for p in parts[1:]:
        acc = (acc + p).astype(np.float32)
    return acc


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize(
    "splits, rows, cols", [(1, 3, 64), (4, 5, 2048), (3, 2, 3000), (16, 2, 4104), (3, 2, 8200)]
)
def test_add_rms_norm_sums_split_k_partials(splits, rows, cols, dtype, rng):
    """d as a split-K projection's float32 partial sums [S, rows, cols]: the result is the
    kernel's on their float32 sum (split order) rounded to x's dtype, bit for bit, and
    within the tolerance of XLA's reduction of them."""
    x = _rows(rng, (rows, cols), dtype, 3.0)
    w = _rows(rng, (cols,), dtype)
    parts = np.asarray(rng.standard_normal((splits, rows, cols)) * 0.5, np.float32)
    s, h = _fused(x, jnp.asarray(parts), w, eps=EPS)
    d = jnp.asarray(_sequential_sum(parts)).astype(dtype)
    s_want, h_want = _fused(x, d, w, eps=EPS)
    assert s.dtype == h.dtype == dtype and s.shape == h.shape == (rows, cols)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_want))
    np.testing.assert_array_equal(np.asarray(h), np.asarray(h_want))
    s_xla, h_xla = _xla(x, jnp.sum(jnp.asarray(parts), 0).astype(dtype), w)
    np.testing.assert_allclose(
        np.asarray(h.astype(jnp.float32)), np.asarray(h_xla.astype(jnp.float32)), **tol(dtype)
    )


def test_add_rms_norm_partials_keep_nan_in_their_element(rng):
    parts = np.asarray(rng.standard_normal((3, 4, 32)), np.float32)
    parts[1, 2, 7] = np.nan
    s, h = _fused(jnp.zeros((4, 32)), jnp.asarray(parts), jnp.ones((32,)), eps=EPS)
    assert np.isnan(np.asarray(s)[2, 7]) and np.isnan(np.asarray(s)).sum() == 1
    h = np.asarray(h)
    assert np.isnan(h[2]).all() and not np.isnan(np.delete(h, 2, 0)).any()


def test_add_rms_norm_keeps_nan_in_its_row(rng):
    x = np.asarray(rng.standard_normal((4, 32)), np.float32)
    x[2, 7] = np.nan
    s, h = _fused(jnp.asarray(x), jnp.zeros((4, 32)), jnp.ones((32,)), eps=EPS)
    h = np.asarray(h)
    assert np.isnan(h[2]).all() and not np.isnan(np.delete(h, 2, 0)).any()
    assert np.isnan(np.asarray(s)[2, 7]) and np.isnan(np.asarray(s)).sum() == 1


def test_add_rms_norm_refuses_what_it_cannot_serve():
    x = jnp.zeros((2, 16), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="one dtype"):
        native.add_rms_norm(x, x.astype(jnp.float32), jnp.ones(16, jnp.bfloat16), eps=EPS)
    with pytest.raises(NotImplementedError, match="cols"):
        native.add_rms_norm(x, x, jnp.ones(8, jnp.bfloat16), eps=EPS)
    with pytest.raises(NotImplementedError, match="float32/bfloat16/float16"):
        native.add_rms_norm(
            x.astype(jnp.int32), x.astype(jnp.int32), jnp.ones(16, jnp.int32), eps=EPS
        )
    parts = jnp.zeros((2, 2, 16), jnp.float32)
    with pytest.raises(NotImplementedError, match="partial sums"):
        native.add_rms_norm(x, parts.astype(jnp.bfloat16), jnp.ones(16, jnp.bfloat16), eps=EPS)
    with pytest.raises(NotImplementedError, match="splits, rows, cols"):
        native.add_rms_norm(x, parts[:, :1], jnp.ones(16, jnp.bfloat16), eps=EPS)
    with pytest.raises(NotImplementedError, match="splits, rows, cols"):
        native.add_rms_norm(x, parts[:0], jnp.ones(16, jnp.bfloat16), eps=EPS)
    assert native.add_rms_norm_unsupported(x[:, :12], x[:, :12], x[0, :12], "cuda") is not None
    assert native.add_rms_norm_unsupported(x[:, :12], x[:, :12], x[0, :12], "cpu") is None


def test_fused_norm_needs_straight_line_layers_on_one_device():
    cfg = llama.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    params = llama.init_params(cfg, jax.random.key(0))
    with pytest.raises(ValueError, match="straight-line layers"):
        llama._add_norm(params, cfg, None, True)
    with pytest.raises(ValueError, match="one device"):
        llama._add_norm(llama.serving_params(cfg, params), cfg, object(), True)
    assert llama._add_norm(params, cfg, None, False) is None
