"""Pieces shared by the decode and extend kernels: platform checks, KV addressing,
the online-softmax step."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _compat
from .. import layout as L
from .. import quant as Q
from . import _triton
from ._triton import plgpu

# Scores are kept in base 2 inside the kernels (exp2 is one SFU instruction; exp is not),
# so the softmax scale is folded with log2(e) once, outside the inner loops.
LOG2E = math.log2(math.e)

_FLOAT_DTYPES = tuple(np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))
_GPU_BACKENDS = ("gpu", "cuda", "rocm")


def resolve_interpret(interpret: bool | None) -> bool:
    """None means: interpret exactly when running on the CPU.

    The kernels' hardware targets are NVIDIA and AMD GPUs; any other platform (a TPU,
    say) cannot run them compiled.
    """
    backend = jax.default_backend()
    if interpret is None:
        interpret = backend == "cpu"
    if not interpret and backend not in _GPU_BACKENDS:
        raise NotImplementedError(
            f"the Pallas kernels need an NVIDIA or AMD GPU; platform is {backend!r}"
        )
    return bool(interpret)


def dtype_reason(q, k_cache, v_cache) -> str | None:
    """q and the caches in one float dtype, or an FP8 cache (widened exactly to q's dtype
    in the kernel: the tensor-core dot takes one dtype, and casting q down would change the
    numbers, so no other mix is served)."""
    if np.dtype(q.dtype) not in _FLOAT_DTYPES:
        return f"q dtype {np.dtype(q.dtype)} is not served"
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        dt = np.dtype(x.dtype)
        if dt not in _FLOAT_DTYPES and not Q.is_fp8(dt):
            return f"{name} dtype {dt} is not served"
    if k_cache.dtype != v_cache.dtype:
        return f"k_cache and v_cache must share a dtype, got {k_cache.dtype}, {v_cache.dtype}"
    if not Q.is_fp8(k_cache.dtype) and q.dtype != k_cache.dtype:
        return (
            f"q, k_cache and v_cache must share a dtype (or the cache be FP8), got "
            f"{np.dtype(q.dtype)}, {np.dtype(k_cache.dtype)}"
        )
    return None


def head_dim_reason(head_dim: int) -> str | None:
    # Triton tiles need power-of-two extents, and its dot needs at least 16 along K.
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        return f"head_dim={head_dim} is not served: it must be a power of two in [16, 256]"
    return None


SERVED_LAYOUTS = ("bshd", "bhsd", L.POOL)


def layout_reason(layout) -> str | None:
    name = L.get(layout, pool=True).name
    if name not in SERVED_LAYOUTS:
        return f"layout {name!r} is not served by the Pallas kernels (bshd and bhsd are)"
    return None


def interpret_reason(*operands) -> str | None:
    # The interpreter evaluates the kernel body primitive by primitive, mixing a shard's
    # varying operands with invariant grid indices, which shard_map's varying-axes check
    # rejects (compiled kernels are one primitive and type their outputs, see
    # jaxattn._compat.out_struct).
    if (
        jax.default_backend() == "cpu"
        and _compat.varying_axes(*operands)
        and _compat.check_vma_active()
    ):
        return (
            "the Pallas interpreter (the CPU path) cannot run inside shard_map with "
            "check_vma=True; compiled on a GPU it can, and on the CPU the reference and "
            "native backends can (or pass check_vma=False)"
        )
    return None


def unsupported(q, k_cache, v_cache, layout) -> str | None:
    """Why the kernels cannot serve these operands, or None (see ``Implementation.supports``)."""
    return (
        layout_reason(layout)
        or dtype_reason(q, k_cache, v_cache)
        or head_dim_reason(q.shape[-1])
        or interpret_reason(q, k_cache, v_cache)
    )


def require(q, k_cache, v_cache, layout) -> L.CacheGeometry:
    """The cache geometry, or NotImplementedError when the Triton-lowered kernels cannot
    serve (this JAX without that lowering included: :func:`._triton.missing`)."""
    _triton.require()
    reason = unsupported(q, k_cache, v_cache, layout)
    if reason is not None:
        raise NotImplementedError(reason)
    return L.get(layout, pool=True).geometry(k_cache, v_cache)


def num_sms() -> int:
    """Streaming multiprocessors of the first device (132 on an H200 when unknown)."""
    dev = jax.devices()[0]
    count = getattr(dev, "core_count", None)
    if dev.platform == "gpu" and isinstance(count, int) and count > 0:
        return count
    return 132


def as_rows(cache):
    """A free reshape to [rows, D]: every kernel addresses K/V by one row index per
    (token, head), computed by :meth:`jaxattn.layout.Layout.row`. An FP8 cache goes in as
    its uint8 codes (a free bitcast): the Triton lowering cannot build a masked FP8 load
    (its fill value is cast from an integer), a masked uint8 load is plain, and
    :func:`widen` turns the codes back into FP8 values."""
    rows = cache.reshape(-1, cache.shape[-1])
    return lax.bitcast_convert_type(rows, jnp.uint8) if Q.is_fp8(rows.dtype) else rows


def load_rows(ref, rows, valid, head_dim: int):
    """Gather ``ref[rows, :]`` -> [n, D]; lanes with ``valid`` False are never read and
    come back as 0, so NaN in unreferenced pages cannot reach the result."""
    d = jnp.arange(head_dim)
    return plgpu.load(ref.at[rows[:, None], d[None, :]], mask=valid[:, None], other=0)


def widen(x, dtype, kv_dtype):
    """A cache tile in the compute dtype: an FP8 tile (its uint8 codes, see :func:`as_rows`,
    of format ``kv_dtype``) widened exactly (every FP8 value is a bfloat16, float16 and
    float32), anything else as it is."""
    if Q.is_fp8(kv_dtype):
        x = lax.bitcast_convert_type(x, kv_dtype)
    return x.astype(dtype) if x.dtype != dtype else x


def head_scales(k_scale, v_scale, num_kv_heads: int):
    """The kernels' scale operand: f32 [2, Hkv] (row 0 the key scales, row 1 the value
    scales; 1 where one is None), or None when both are (the kernels then skip the
    multiplies and take a constant in its place, built by no kernel launch)."""
    if k_scale is None and v_scale is None:
        return None
    ones = jnp.ones((num_kv_heads,), jnp.float32)
    k = ones if k_scale is None else jnp.asarray(k_scale).astype(jnp.float32)
    v = ones if v_scale is None else jnp.asarray(v_scale).astype(jnp.float32)
    return jnp.stack([k, v])


def scales_operand(scales, num_kv_heads: int):
    """Inside the jitted wrapper: the scale operand, or for None a constant of ones (a
    literal of the program, where an array built from ``jnp.ones`` would be one more kernel
    launch per call)."""
    return np.ones((2, num_kv_heads), np.float32) if scales is None else scales


# HIGHEST: with float32 operands the Triton lowering would otherwise pick TF32 (10-bit
# mantissa), far outside float32 tolerances; for 16-bit operands it changes nothing.
def dot_nt(a, b):
    """a @ b.T with float32 accumulation."""
    return lax.dot_general(
        a,
        b,
        (((1,), (1,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def dot_nn(a, b):
    return lax.dot_general(
        a,
        b,
        (((1,), (0,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def kv_tile_rows(head_dim: int, itemsize: int, *, stage_bytes: int, cap: int) -> int:
    """Rows of a K (and of a V) tile so that both fit in ``stage_bytes`` of shared memory
    per pipeline stage: wide heads and float32 get shorter tiles."""
    rows = stage_bytes // (2 * head_dim * itemsize)
    return max(16, min(cap, 1 << (rows.bit_length() - 1)))


def scores_base2(s, *, scale: float, soft_cap: float | None):
    """Raw q.k (float32) -> logits in base 2: log2(e) * (cap * tanh(scale * s / cap))."""
    if soft_cap is None:
        return s * (scale * LOG2E)
    return jnp.tanh(s * (scale / soft_cap)) * (soft_cap * LOG2E)


def online_softmax_step(carry, s, v):
    """One flash step: fold scores s [R, N] (base 2, masked lanes -inf) and values
    v [N, D] into (acc [R, D], m [R], l_sum [R]).

    m starts finite (a very negative number), so a row whose lanes are all masked in
    this step keeps alpha = 1 and p = 0 instead of producing inf - inf.
    """
    acc, m, l_sum = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l_sum = l_sum * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot_nn(p.astype(v.dtype), v)
    return acc, m_new, l_sum


# The running max starts here rather than at -inf (see online_softmax_step); it is far
# below any base-2 logit a finite float input can produce.
M_INIT = -1e30


def init_state(rows: int, head_dim: int):
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), M_INIT, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def finalize(acc, l_sum):
    """acc / l_sum, with 0 for a row that saw no key (l_sum == 0); a NaN l_sum (NaN in q or
    in a key or value the row attends to) stays NaN."""
    safe = jnp.where(l_sum == 0, 1.0, l_sum)
    return jnp.where((l_sum == 0)[:, None], 0.0, acc / safe[:, None])


def checked_pages(page, valid, num_pages: int, bad):
    """Page ids a tile reads, made safe: an id outside ``[0, num_pages)`` in a lane that is
    read is replaced by page 0 (so no load leaves the pool) and raises the ``bad`` flag
    (int32 0/1), which poisons the sequence (the memory-safety contract)."""
    in_pool = (page >= 0) & (page < num_pages)
    bad = jnp.maximum(bad, jnp.max(jnp.where(valid & ~in_pool, 1, 0)))
    return jnp.where(in_pool, page, 0), bad
