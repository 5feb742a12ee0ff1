"""jaxattn.native.linear (the decode step's skinny matmul) against a float64 product: every
row count of the GPU kernel, splits of k, column tails, NaN rows and columns, refusals.

The same cases run on the CPU (the library's plain loop) and on a GPU (the kernel of
ffi/include/jaxattn/linear.cuh, whose split of k they cross). Skipped without the native
library, unless JAXATTN_REQUIRE_NATIVE=1.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close

from jaxattn import native

if not native.is_available():
    if os.environ.get("JAXATTN_REQUIRE_NATIVE") == "1":
        raise RuntimeError("JAXATTN_REQUIRE_NATIVE=1 but the native library is not available")
    pytest.skip("the native library is not built", allow_module_level=True)

ON_GPU = jax.default_backend() != "cpu"
DTYPES = [jnp.bfloat16, jnp.float16] + ([] if ON_GPU else [jnp.float32])
# (k, n): one tile and one split; a column tail (264 = 256 + 8) and k not a multiple of the
# 32-row step; a split k over few tiles (the decode step's down projection's shape, smaller).
SHAPES = [(64, 8), (1000, 264), (3000, 520), (4096, 1024)]


def operands(rng, m, k, n, dtype):
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32) / np.sqrt(k)
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype)


def product(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_linear_matches_float64(m, k, n, dtype):
    rng = np.random.default_rng(m * 7919 + k * 31 + n)
    x, w = operands(rng, m, k, n, dtype)
    out = jax.jit(native.linear)(x, w)
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert_close(out, product(x, w))
    out32 = jax.jit(lambda a, b: native.linear(a, b, out_dtype=jnp.float32))(x, w)
    assert out32.dtype == jnp.float32
    # float32 sums of the same 16-bit operands: close to float64 well past 16-bit rounding.
    np.testing.assert_allclose(np.asarray(out32, np.float64), product(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k,n", [(1000, 264), (4096, 1024)])
def test_nan_reaches_its_row_and_column_only(k, n):
    rng = np.random.default_rng(k + n)
    x, w = operands(rng, 4, k, n, jnp.bfloat16)
    x = x.at[1, k // 2].set(jnp.nan)  # row 1 of the output
    w = w.at[k - 1, n - 3].set(jnp.nan)  # column n - 3
    out = np.asarray(native.linear(x, w), np.float32)
    nan = np.isnan(out)
    expect = np.zeros_like(nan)
    expect[1, :] = True
    expect[:, n - 3] = True
    np.testing.assert_array_equal(nan, expect)


def test_repeated_calls_agree():
    # The split's counters are zeroed before every launch and the splits added in order: a
    # second call (and a jitted one) gives the same bits.
    rng = np.random.default_rng(5)
    x, w = operands(rng, 8, 4096, 1024, jnp.bfloat16)
    f = jax.jit(native.linear)
    a, b, c = f(x, w), f(x, w), native.linear(x, w)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))


def test_empty_sums_are_zero():
    out = native.linear(jnp.zeros((2, 0), jnp.bfloat16), jnp.zeros((0, 16), jnp.bfloat16))
    assert out.shape == (2, 16)
    assert not np.asarray(out, np.float32).any()


def test_split_rule():
    # One wave on 132 SMs (two blocks an SM at 4 rows of x: 64 tiles x 4 splits; four at one
    # row: x 8), rows in 32-row steps.
    assert native.linear_rows_per_split(2048, 16384, 132, 4) == 512
    assert native.linear_rows_per_split(8192, 2048, 132, 4) == 256
    assert native.linear_rows_per_split(2048, 16384, 132, 1) == 256
    assert native.linear_rows_per_split(8192, 2048, 132, 1) == 128
    # Never more than 1024 rows a block (its shared memory), never a split of a short k.
    assert native.linear_rows_per_split(4096, 128000, 132) == 1024
    assert native.linear_rows_per_split(512, 128000, 132) == 0
    for k, n in [(100, 8), (2048, 3072), (8191, 520)]:
        rows = native.linear_rows_per_split(k, n, 132)
        assert rows == 0 or (rows % 32 == 0 and rows < k <= -(-k // rows) * rows)


def test_refusals():
    x = jnp.ones((2, 16), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=r"x \[m, k\] and w \[k, n\]"):
        native.linear(x, jnp.ones((8, 8), jnp.bfloat16))
    with pytest.raises(NotImplementedError, match="one float32/bfloat16/float16 dtype"):
        native.linear(x, jnp.ones((16, 8), jnp.float16))
    with pytest.raises(ValueError, match="out_dtype"):
        native.linear(x, jnp.ones((16, 8), jnp.bfloat16), out_dtype=jnp.float16)
    gpu = native.linear_unsupported
    bf = functools.partial(jnp.ones, dtype=jnp.bfloat16)
    assert "up to 8 rows" in gpu(bf((9, 16)), bf((16, 8)), "cuda")
    assert "multiple of 8" in gpu(bf((2, 16)), bf((16, 12)), "cuda")
    assert "bfloat16 or float16" in gpu(jnp.ones((2, 16)), jnp.ones((16, 8)), "cuda")
    assert gpu(jnp.ones((9, 16)), jnp.ones((16, 12)), "cpu") is None
