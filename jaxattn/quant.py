"""FP8 KV caches: the formats, their scales, and the (de)quantisation every layer shares.

A KV cache may be stored as ``float8_e4m3fn`` (max 448, no infinity) or ``float8_e5m2``
(max 57344, with infinities). A stored element stands for ``float32(element) * scale[h]``
with ``scale`` per KV head ``h`` (``k_scale`` for K, ``v_scale`` for V): None means 1.0, a
scalar applies to every head. Scales are data, not configuration: under ``jax.jit`` they
are traced arrays (they change per layer and with calibration), so no kernel is compiled
per scale value.

Writing quantises ``x / scale`` with saturation to the format's finite range: an overflow
(or an infinite input) becomes the largest finite value of its sign, never an infinity or
a NaN; a NaN input stays NaN. Rounding is to nearest even (XLA's conversion).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "FP8_DTYPES",
    "check_scale",
    "dequantize",
    "fp8_scales",
    "format_max",
    "is_fp8",
    "quantize",
]

FP8_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))


def is_fp8(dtype) -> bool:
    """Whether ``dtype`` is one of the FP8 cache formats (:data:`FP8_DTYPES`)."""
    try:
        return np.dtype(dtype) in FP8_DTYPES
    except TypeError:
        return False


def format_max(dtype) -> float:
    """The largest finite value of a float format (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def _concrete(x):
    if isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)):
        return None
    try:
        return np.asarray(x)
    except Exception:  # noqa: BLE001 - anything non-materialisable is treated as traced
        return None


def check_scale(name: str, scale, num_heads: int, *, what: str = "num_kv_heads"):
    """Validate a scale argument; returns None (no scale) or a float32 ``[num_heads]`` array.

    Accepted: None, a Python number, or a real (float or integer) array of shape ``()`` or
    ``[num_heads]``. Values must be finite and positive; they are checked when concrete
    (eager calls), and under ``jax.jit`` the array is taken as it comes (a NaN scale then
    gives NaN outputs). Raises ``TypeError`` / ``ValueError`` naming ``name``.
    """
    if scale is None:
        return None
    if isinstance(scale, bool):
        raise TypeError(f"{name} must be None, a float or a float32 array, got a bool")
    if isinstance(scale, (int, float, np.integer, np.floating)):
        value = float(scale)
        if not np.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be finite and positive, got {value}")
        return jnp.full((num_heads,), value, jnp.float32)
    if not hasattr(scale, "shape") or not hasattr(scale, "dtype"):
        raise TypeError(
            f"{name} must be None, a float or a float32 array [{what}={num_heads}], got "
            f"{type(scale).__name__}"
        )
    dt = np.dtype(scale.dtype)
    if not (np.issubdtype(dt, np.floating) or np.issubdtype(dt, np.integer)) or dt == np.bool_:
        raise TypeError(f"{name} must be convertible to float32, got dtype {dt}")
    if tuple(scale.shape) not in ((), (num_heads,)):
        raise ValueError(
            f"{name} must be a scalar or float32 [{what}={num_heads}], got shape "
            f"{tuple(scale.shape)}"
        )
    if isinstance(scale, jax.ShapeDtypeStruct):  # binding on shapes alone (no values)
        return jax.ShapeDtypeStruct((num_heads,), jnp.float32)
    value = _concrete(scale)
    if value is not None:
        v = value.astype(np.float64)
        if not np.all(np.isfinite(v)) or np.any(v <= 0):
            raise ValueError(f"{name} must be finite and positive, got {value.tolist()}")
    return jnp.broadcast_to(jnp.asarray(scale).astype(jnp.float32), (num_heads,))


def dequantize(x, scale, head_axis: int):
    """``float32(x) * scale`` with ``scale`` f32 ``[H]`` along ``head_axis`` of ``x`` (None:
    no scaling)."""
    x = x.astype(jnp.float32)
    if scale is None:
        return x
    shape = [1] * x.ndim
    shape[head_axis] = scale.shape[0]
    return x * scale.reshape(shape)


def quantize(x, dtype, scale, head_axis: int, *, saturate: bool):
    """``x / scale`` (per head along ``head_axis``; None: no division) cast to ``dtype``.

    ``saturate``: clip to the format's finite range first, so that an overflow (or an
    infinity) becomes the largest finite value of its sign; NaN stays NaN.
    """
    if scale is None and not saturate:
        return x.astype(dtype)
    y = x.astype(jnp.float32)
    if scale is not None:
        shape = [1] * y.ndim
        shape[head_axis] = scale.shape[0]
        y = y / scale.reshape(shape)
    if saturate:
        big = format_max(dtype)
        y = jnp.clip(y, -big, big)
    return y.astype(dtype)


def fp8_scales(k, v, dtype=jnp.float8_e4m3fn):
    """Per-KV-head scales for storing ``k`` and ``v`` in ``dtype``, from a calibration batch.

    k, v: ``[..., num_kv_heads, head_dim]`` (e.g. ``[T, Hkv, D]`` of a prompt, or
    ``[layers, T, Hkv, D]`` for every layer at once: then pass each layer's slice). Returns
    ``(k_scale, v_scale)``, float32 ``[num_kv_heads]`` each: ``amax / format max`` where
    ``amax`` is the largest finite ``|x|`` of the head over every other axis, so the
    calibration batch's largest element lands on the format's largest finite value. A head
    with no finite nonzero element gets 1.0 (any positive scale stores zeros exactly).
    NaN and infinities are ignored.
    """
    if not is_fp8(dtype):
        raise TypeError(f"dtype must be one of {[d.name for d in FP8_DTYPES]}, got {dtype}")
    big = format_max(dtype)

    def one(name, x):
        if not hasattr(x, "shape") or x.ndim < 2:
            got = tuple(x.shape) if hasattr(x, "shape") else type(x).__name__
            raise ValueError(f"{name} must be [..., num_kv_heads, head_dim], got {got}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a float array, got {np.dtype(x.dtype)}")
        a = jnp.abs(x.astype(jnp.float32))
        a = jnp.where(jnp.isfinite(a), a, 0.0)
        axes = tuple(i for i in range(x.ndim) if i != x.ndim - 2)
        amax = jnp.max(a, axis=axes)
        return jnp.where(amax > 0, amax / big, 1.0).astype(jnp.float32)

    k_scale = one("k", k)
    v_scale = one("v", v)
    if k_scale.shape != v_scale.shape:
        raise ValueError(
            f"k and v must have the same number of KV heads, got {k.shape[-2]} and {v.shape[-2]}"
        )
    return k_scale, v_scale
