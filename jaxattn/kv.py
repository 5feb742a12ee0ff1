"""Device-side KV cache writes: store new tokens' K/V (vLLM ``reshape_and_cache``) and apply
copy-on-write block copies (vLLM ``copy_blocks``).

Both are pure functions that return new caches. Under ``jax.jit`` with the caches donated,
XLA aliases each cache output to its input buffer and updates it in place, so a step
writes only the touched slots instead of copying the whole pool::

    write = jax.jit(
        write_kv, static_argnames=("layout", "implementation"), donate_argnums=(0, 1)
    )
    k_cache, v_cache = write(k_cache, v_cache, k, v, slot_mapping, layout="vllm")

After the call the donated input arrays are deleted; always rebind the names to the
outputs. :data:`write_kv_donated` and :data:`copy_blocks_donated` are exactly these jitted
functions. Inside a larger jitted step (a model forward that takes and returns the caches),
donate the caches of the outer function instead: the scatter then updates the donated
buffer in place there too.

FP8 caches (:mod:`jaxattn.quant`): ``write_kv(..., k_scale=, v_scale=)`` stores
``x / scale[kv_head]`` rounded to the cache's format with saturation (an overflow becomes
the largest finite value, never an infinity or a NaN; NaN stays NaN); the attention ops read
the element back as ``float32(element) * scale``. :func:`fp8_scales` computes per-head scales
from a calibration batch.

``write_kv`` is an op of the backend contract (:mod:`jaxattn.backend`): the reference
backend is XLA's scatter (one per cache), the native one a single kernel that stores both
caches' rows (``ffi/src/kv_write.cu``; the CPU library has the same handler), with the
cache aliased to its result. Both store the same bits; on a GPU the native kernel is the
default (a decode step then launches one small kernel a layer for its K/V instead of two
scatters).

On XLA's CPU backend a bfloat16 scatter goes through float32 temporaries (there is no
native bf16 scatter there); the output still aliases the donated input. float32 and
float16 caches, and every dtype on GPU, are updated with no scratch copy of the pool.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import layout as L
from jaxattn import quant as Q
from jaxattn.backend import Implementation, Op
from jaxattn.quant import fp8_scales

__all__ = [
    "ROPE_WRITE_KV",
    "WRITE_KV",
    "copy_blocks",
    "copy_blocks_donated",
    "fp8_scales",
    "rope_write_kv",
    "rotate_half",
    "write_kv",
    "write_kv_donated",
]


def _shape(x) -> str:
    return f"shape {tuple(x.shape)} and dtype {np.dtype(x.dtype)}"


def _check_index_vector(name: str, x, expected: str):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an integer array {expected}, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array {expected}, got {_shape(x)}")
    if x.ndim != 1:
        raise ValueError(f"{name} must be {expected}, got {_shape(x)}")


@dataclasses.dataclass(frozen=True, eq=False)
class WriteArgs:
    """Validated arguments of :func:`write_kv`: the caches, the new rows k, v ``[T, Hkv, D]``,
    ``slot_mapping`` (any integer dtype; :attr:`slots` as int32) and the scales as float32
    ``[Hkv]`` (None: no scale)."""

    k_cache: Any
    v_cache: Any
    k: Any
    v: Any
    slot_mapping: Any
    layout: L.Layout
    geometry: L.CacheGeometry
    k_scale: Any = None
    v_scale: Any = None

    @property
    def kv_dtype(self) -> np.dtype:
        return np.dtype(self.k_cache.dtype)

    @property
    def slots(self):
        """``slot_mapping`` as int32."""
        return self.slot_mapping.astype(jnp.int32)

    @property
    def in_dtype(self) -> np.dtype:
        return np.dtype(self.k.dtype)


def _checked_slots_and_scales(slot_mapping, t: int, num_kv_heads: int, k_scale, v_scale):
    """A K/V writer's ``slot_mapping`` (an integer vector of ``t`` entries) checked, and its
    scales as :func:`jaxattn.quant.check_scale` returns them."""
    _check_index_vector("slot_mapping", slot_mapping, f"i32[T={t}]")
    if slot_mapping.shape[0] != t:
        raise ValueError(f"slot_mapping must be i32[T={t}], got {_shape(slot_mapping)}")
    return (
        Q.check_scale("k_scale", k_scale, num_kv_heads),
        Q.check_scale("v_scale", v_scale, num_kv_heads),
    )


class WriteKV(Op):
    """:func:`write_kv` as an op of the backend contract: the reference backend scatters
    with XLA (one scatter a cache), the native one runs one kernel for both caches."""

    name = "write_kv"
    roles = ("k", "v", "q", "q", None)

    def bind(
        self, k_cache, v_cache, k, v, slot_mapping, *, layout="bshd", k_scale=None, v_scale=None
    ) -> WriteArgs:
        lay = L.get(layout)
        geom = L.cache_geometry(k_cache, v_cache, layout)
        want = f"[T, num_kv_heads={geom.num_kv_heads}, head_dim={geom.head_dim}]"
        for name, x in (("k", k), ("v", v)):
            if not hasattr(x, "shape") or x.ndim != 3 or tuple(x.shape[1:]) != geom[2:]:
                got = _shape(x) if hasattr(x, "shape") else type(x).__name__
                raise ValueError(f"{name} must be {want} to match the cache, got {got}")
        if v.shape != k.shape:
            raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {_shape(v)}")
        k_scale, v_scale = _checked_slots_and_scales(
            slot_mapping, k.shape[0], geom.num_kv_heads, k_scale, v_scale
        )
        for x, scale in ((k, k_scale), (v, v_scale)):
            if (scale is not None or Q.is_fp8(k_cache.dtype)) and not jnp.issubdtype(
                x.dtype, jnp.floating
            ):
                raise TypeError(f"k and v must be float arrays, got {np.dtype(x.dtype)}")
        return WriteArgs(
            k_cache,
            v_cache,
            k,
            v,
            slot_mapping,
            layout=lay,
            geometry=geom,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def implementation(self, backend: str) -> Implementation:
        if backend == "reference":  # the spec lives here, not in jaxattn.ops
            return _REFERENCE_WRITE
        return super().implementation(backend)

    def trivial(self, a: WriteArgs):
        if a.k.shape[0] and a.geometry.num_pages:
            return None
        return a.k_cache, a.v_cache  # no token, or no page to write to


class _ReferenceWrite(Implementation):
    backend = "reference"

    def run(self, a: WriteArgs, config):
        name, slots = a.layout.name, a.slots
        return (
            L.scatter_tokens(a.k_cache, slots, _stored(a.k, a.k_cache.dtype, a.k_scale), name, "k"),
            L.scatter_tokens(a.v_cache, slots, _stored(a.v, a.v_cache.dtype, a.v_scale), name, "v"),
        )


_REFERENCE_WRITE = _ReferenceWrite()
WRITE_KV = WriteKV()


def rotate_half(x, cos, sin):
    """Rotate-half RoPE of ``x [T, H, D]`` by per-token tables ``cos, sin f32 [T, D // 2]``:
    ``[x1 cos - x2 sin, x2 cos + x1 sin]`` in float32 (x1, x2 the halves of each row), cast
    back to x's dtype."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class RopeWriteArgs(WriteArgs):
    """Validated arguments of :func:`rope_write_kv`: :class:`WriteArgs` with ``k`` the fused
    rows ``qkv`` (``v`` too), the tables and the query head count."""

    cos: Any = None
    sin: Any = None
    num_q_heads: int = 0
    splits: int = 0
    dtype: Any = None

    @property
    def qkv(self):
        """The rows as given: ``[T, Hq + 2 Hkv, D]``, or float32 ``[splits, T, ...]``."""
        return self.k

    @property
    def in_dtype(self) -> np.dtype:
        """The rows' dtype (with partial sums, the one they are rounded to): q's."""
        return np.dtype(self.dtype)

    @property
    def num_tokens(self) -> int:
        return self.qkv.shape[1 if self.splits else 0]

    def summed(self):
        """The rows ``[T, Hq + 2 Hkv, D]`` in :attr:`in_dtype`: partial sums summed in float32."""
        if not self.splits:
            return self.qkv
        return jnp.sum(self.qkv, axis=0).astype(self.dtype)


class RopeWriteKV(Op):
    """:func:`rope_write_kv` as an op of the backend contract: the reference rotates and
    scatters with XLA (:func:`rotate_half`, then :func:`write_kv`'s reference), the native
    one runs one kernel for the rotation, the q rows and both caches' stores."""

    name = "rope_write_kv"
    roles = ("q", None, None, "k", "v", None)

    def bind(
        self, qkv, cos, sin, k_cache, v_cache, slot_mapping, *, layout="bshd", k_scale=None,
        v_scale=None, dtype=None,
    ) -> RopeWriteArgs:  # fmt: skip
        lay = L.get(layout)
        geom = L.cache_geometry(k_cache, v_cache, layout)
        hkv, d = geom.num_kv_heads, geom.head_dim
        if (
            not hasattr(qkv, "shape")
            or qkv.ndim not in (3, 4)
            or qkv.shape[-1] != d
            or qkv.shape[-2] <= 2 * hkv
            or (qkv.ndim == 4 and qkv.shape[0] < 1)
        ):
            got = _shape(qkv) if hasattr(qkv, "shape") else type(qkv).__name__
            raise ValueError(
                f"qkv must be [T, num_q_heads + 2 * num_kv_heads (={2 * hkv}), head_dim={d}] "
                f"with num_q_heads >= 1, or float32 [splits >= 1, T, ...] partial sums, got {got}"
            )
        if not jnp.issubdtype(qkv.dtype, jnp.floating):
            raise TypeError(f"qkv must be a float array, got {_shape(qkv)}")
        splits = qkv.shape[0] if qkv.ndim == 4 else 0
        if splits:
            if qkv.dtype != jnp.float32:
                raise TypeError(f"qkv's partial sums must be float32, got {_shape(qkv)}")
            if dtype is None:
                raise ValueError(
                    "qkv as partial sums [splits, T, H, D] needs dtype=, the projection's "
                    "dtype they are rounded to (q's)"
                )
        elif dtype is not None and np.dtype(dtype) != np.dtype(qkv.dtype):
            raise ValueError(
                f"dtype= rounds qkv's partial sums; with qkv [T, H, D] it must be None or "
                f"qkv's dtype {np.dtype(qkv.dtype)}, got {dtype!r}"
            )
        dtype = np.dtype(qkv.dtype if dtype is None else dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"dtype must be a float dtype, got {dtype}")
        if d % 2:
            raise ValueError(
                f"rope_write_kv rotates halves of each row: head_dim must be even, got {d}"
            )
        t = qkv.shape[-3]
        for name, x in (("cos", cos), ("sin", sin)):
            if not hasattr(x, "shape") or x.shape != (t, d // 2) or x.dtype != jnp.float32:
                got = _shape(x) if hasattr(x, "shape") else type(x).__name__
                raise ValueError(f"{name} must be f32[T={t}, head_dim // 2={d // 2}], got {got}")
        k_scale, v_scale = _checked_slots_and_scales(slot_mapping, t, hkv, k_scale, v_scale)
        return RopeWriteArgs(
            k_cache, v_cache, qkv, qkv, slot_mapping, layout=lay, geometry=geom,
            k_scale=k_scale, v_scale=v_scale, cos=cos, sin=sin,
            num_q_heads=qkv.shape[-2] - 2 * hkv, splits=splits, dtype=dtype,
        )  # fmt: skip

    def implementation(self, backend: str) -> Implementation:
        if backend == "reference":
            return _REFERENCE_ROPE_WRITE
        return super().implementation(backend)

    def trivial(self, a: RopeWriteArgs):
        if a.num_tokens:
            return None
        q = jnp.zeros((0, a.num_q_heads, a.geometry.head_dim), a.in_dtype)
        return q, a.k_cache, a.v_cache


class _ReferenceRopeWrite(Implementation):
    backend = "reference"

    def run(self, a: RopeWriteArgs, config):
        hq, hkv = a.num_q_heads, a.geometry.num_kv_heads
        q, k, v = jnp.split(a.summed(), [hq, hq + hkv], axis=1)
        # The arguments are bound already: write_kv's reference runs on them directly.
        rows = dataclasses.replace(a, k=rotate_half(k, a.cos, a.sin), v=v)
        k_cache, v_cache = _REFERENCE_WRITE.run(rows, None)
        return rotate_half(q, a.cos, a.sin), k_cache, v_cache


_REFERENCE_ROPE_WRITE = _ReferenceRopeWrite()
ROPE_WRITE_KV = RopeWriteKV()


def rope_write_kv(
    qkv,
    cos,
    sin,
    k_cache,
    v_cache,
    slot_mapping,
    *,
    layout: str = "bshd",
    k_scale=None,
    v_scale=None,
    dtype=None,
    implementation=None,
):
    """A fused q|k|v projection's rows, rotated and stored: RoPE on q and k, k and v into
    the cache (vLLM's ``rotary_embedding`` followed by ``reshape_and_cache``, in one pass).

    Args:
      qkv: ``[T, Hq + 2 * Hkv, D]``: each token's Hq query heads, then its Hkv key heads, then
        its Hkv value heads (a fused projection's output reshaped; Hkv and D are the cache's).
        Or float32 ``[S, T, Hq + 2 * Hkv, D]``: the projection split along its contraction
        into S partial sums (a split-K GEMM before its reduction), which are summed in
        float32 and rounded to ``dtype`` first; the native kernel sums them as it loads a
        row, so no reduction runs between the GEMM and it.
      dtype: the dtype the partial sums are rounded to (the projection's, q's); required
        with partial sums, None or qkv's dtype otherwise.
      cos, sin: f32 ``[T, D // 2]``, each token's rotary tables (angle ``position *
        inv_freq[j]``).
      k_cache, v_cache, slot_mapping, layout, k_scale, v_scale: as for :func:`write_kv`.
      implementation: None (the native kernel on a GPU; XLA elsewhere), a backend name
        (``"reference"``, ``"native"``) or a sequence of names tried in order.

    Returns:
      ``(q, k_cache, v_cache)``: the rotated queries ``[T, Hq, D]`` in qkv's dtype (``dtype``
      with partial sums), and the caches with :func:`rotate_half` of the key heads and the
      value heads written as :func:`write_kv` stores them. The rotation is computed in
      float32 and rounded to that dtype (as the model's rotation), then stored.
    """
    return ROPE_WRITE_KV(
        qkv,
        cos,
        sin,
        k_cache,
        v_cache,
        slot_mapping,
        layout=layout,
        k_scale=k_scale,
        v_scale=v_scale,
        dtype=dtype,
        implementation=implementation,
    )


def write_kv(
    k_cache,
    v_cache,
    k,
    v,
    slot_mapping,
    *,
    layout: str = "bshd",
    k_scale=None,
    v_scale=None,
    implementation=None,
):
    """Store the K/V of ``T`` tokens at their pool slots.

    Args:
      k_cache, v_cache: the paged cache in ``layout`` (see :mod:`jaxattn.layout`).
      k, v: ``[T, Hkv, D]``; cast to the cache dtype. Into an FP8 cache (or with a scale)
        ``x / scale`` is stored, saturated to the format's finite range.
      slot_mapping: ``i32[T]``, slot ``page * P + offset`` of each token. Negative entries
        are padding and write nothing, so a batch can be padded to a fixed ``T``; entries at
        or past ``num_pages * P`` are dropped too (never wrapped or clamped). Valid entries
        must be distinct.
      k_scale, v_scale: None (1.0), a scalar or f32 ``[num_kv_heads]`` (traced under jit):
        the scales the attention ops are given for this cache.
      implementation: None (the fastest backend that serves the arguments: the native
        kernel on a GPU, one launch for both caches; XLA's scatters elsewhere), a backend
        name (``"reference"``: XLA's scatters, ``"native"``), or a sequence of names tried
        in order. Every backend stores the same bits.

    Returns:
      ``(k_cache, v_cache)`` with the tokens written; everything else is unchanged.
    """
    return WRITE_KV(
        k_cache,
        v_cache,
        k,
        v,
        slot_mapping,
        layout=layout,
        k_scale=k_scale,
        v_scale=v_scale,
        implementation=implementation,
    )


def _stored(x, dtype, scale):
    """x [T, Hkv, D] as the cache stores it: divided by the per-head scale and saturated
    for an FP8 (or scaled) cache, a plain cast otherwise."""
    if scale is None and not Q.is_fp8(dtype):
        return x
    return Q.quantize(x, dtype, scale, head_axis=1, saturate=True)


def copy_blocks(k_cache, v_cache, src, dst, *, layout: str = "bshd"):
    """Copy whole pages ``src[i] -> dst[i]`` in both caches (copy-on-write orders).

    Args:
      src, dst: ``i32[N]`` page ids, e.g. the ``(src, dst)`` pairs returned by
        :meth:`jaxattn.paging.BlockManager.append_slot`. A negative ``dst`` is padding and
        copies nothing, and so does a ``src`` or ``dst`` outside ``[0, num_pages)`` (dropped,
        never wrapped or clamped). Every read sees the cache as it was before the call;
        the ``dst`` entries must be distinct.

    The page axis is axis 0 in every layout, so this is one gather and one scatter of
    whole pages per cache.
    """
    L.cache_geometry(k_cache, v_cache, layout)
    _check_index_vector("src", src, "i32[N]")
    _check_index_vector("dst", dst, f"i32[N={src.shape[0]}] like src")
    if dst.shape != src.shape:
        raise ValueError(f"dst must be i32[N={src.shape[0]}] like src, got {_shape(dst)}")
    num_pages = k_cache.shape[0]
    src = src.astype(jnp.int32)
    dst = dst.astype(jnp.int32)
    # Send padding, and any copy whose source is outside the pool, to an out-of-range page
    # so that mode="drop" discards it (a plain -1 would wrap around to the last page; a
    # clamped source would copy a wrong page that looks plausible); the dropped copy's
    # source is clamped to a harmless read.
    keep = (dst >= 0) & (src >= 0) & (src < num_pages)
    dst = jnp.where(keep, dst, num_pages)
    src = jnp.clip(src, 0, num_pages - 1)
    return (
        k_cache.at[dst].set(k_cache[src], mode="drop"),
        v_cache.at[dst].set(v_cache[src], mode="drop"),
    )


# The in-place forms: the caches passed in are consumed, rebind to the returned ones.
write_kv_donated = jax.jit(
    write_kv, static_argnames=("layout", "implementation"), donate_argnums=(0, 1)
)
copy_blocks_donated = jax.jit(copy_blocks, static_argnames="layout", donate_argnums=(0, 1))
