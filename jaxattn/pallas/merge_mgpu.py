"""The split-KV merges of the Mosaic GPU decode and cascade decode on the Mosaic GPU lowering
itself: with them the two ops launch no Triton kernel (:mod:`jaxattn.pallas.decode` keeps the
Triton-lowered merges for that lowering's kernels and for what this one does not take).

One block (one warpgroup) per (request, query head) folds that row's partition states in
place, exactly as :func:`jaxattn.pallas.decode.combine_levels` does::

    M = max_p m_p,   w_p = 2^(m_p - M),   out = sum_p w_p acc_p / sum_p w_p l_p

Each part's two statistics are scalar loads and its row of the accumulator one vector load
from global memory (a [D] row strided over the warpgroup's threads, ``D / 128`` floats a
thread), :data:`UNROLL` parts at a time so their loads are in flight together. The states are
the Mosaic GPU decode kernel's (:func:`jaxattn.pallas.decode_mgpu.partial_states`): acc f32
``[X, P, Hkv, R, D]``, max and sum f32 ``[X, P, Hkv, 2, R_pad]`` in base 2, X the requests or
the cascade's prefix tiles.

NaN: a NaN part makes its weight NaN (``exp2(NaN - M)``) whether or not the max propagates it,
so the row is NaN; a request whose checks fail gets NaN added (a scalar NaN-or-zero: a select
on a scalar predicate over a vector is no op of jax 0.11's warpgroup lowering); a row with no
key in any part (every sum 0) is 0. Parts past a level's count (the last group of
:data:`UNROLL`) re-read its last part at weight 0.

Interpret mode (``interpret=True``, the CPU) runs the same program on plain arrays.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import _mgpu as M
from ._mgpu import plgpu
from .decode import MERGE_FLOOR

__all__ = ["merge", "merge_levels", "unsupported"]

UNROLL = 8  # parts whose loads a block issues before folding them
THREADS = 128  # a warpgroup: a row of D is strided over its threads


def unsupported(head_dim: int) -> str | None:
    """Why :func:`merge_levels` cannot merge rows of ``head_dim``, or None: a row is one
    strided vector of at most 16 bytes a thread (head_dim 128, 256, 384 or 512)."""
    if (why := M.available()) is not None:
        return why
    if head_dim % THREADS or head_dim > 4 * THREADS:
        return (
            f"the Mosaic GPU merge takes head_dim a multiple of {THREADS} up to 512, got {head_dim}"
        )
    return None


def _kernel(*refs, levels, group, head_dim, indexed, interpret):
    """Block (request b, query head hq): ``levels`` per level (tiled, parts); its refs acc and
    ml; then (tile, slot, has, ok) int32[B] when ``indexed``; the output [B, Hq, D]."""
    refs = list(refs)
    o_ref = refs.pop()
    tile_ref, slot_ref, has_ref, ok_ref = refs[-4:] if indexed else (None,) * 4
    level_refs = refs[: 2 * len(levels)]
    M.dependent_launch(interpret)  # the states are the kernel's just before this one
    b = lax.axis_index("b")
    hq = lax.axis_index("hq")
    kvh = lax.div(hq, group)
    g = lax.rem(hq, group)
    D = head_dim
    if interpret:
        row = lambda ref: ref[...]  # noqa: E731
        zeros = jnp.zeros((D,), jnp.float32)
    else:
        strided = plgpu.Layout.WG_STRIDED((D,), vec_size=D // THREADS)
        row = lambda ref: M.load(ref, layout=strided)  # noqa: E731
        zeros = plgpu.layout_cast(jnp.zeros((D,), jnp.float32), strided)
    floor = jnp.float32(MERGE_FLOOR)
    carry = (floor, jnp.float32(0.0), zeros)

    for (tiled, parts), acc_ref, ml_ref in zip(
        levels, level_refs[0::2], level_refs[1::2], strict=True
    ):
        X, _, _, R, _ = acc_ref.shape
        if tiled:  # the request's rows of its prefix tile
            x = jnp.clip(tile_ref[b], 0, X - 1)
            r = jnp.clip(slot_ref[b] * group + g, 0, R - 1)
        else:
            x, r = b, g
        n = min(parts, UNROLL)

        def fold(c, carry, x=x, r=r, parts=parts, n=n, acc_ref=acc_ref, ml_ref=ml_ref):
            top, denom, numer = carry
            loads = []
            for i in range(n):  # every load of the group before any folding
                p = c * n + i
                live = p < parts
                p = jnp.minimum(p, parts - 1)
                m = jnp.where(live, ml_ref[x, p, kvh, 0, r], floor)
                loads.append((live, m, ml_ref[x, p, kvh, 1, r], row(acc_ref.at[x, p, kvh, r])))
            new_top = functools.reduce(jnp.maximum, [m for _, m, _, _ in loads], top)
            rescale = jnp.exp2(top - new_top)
            denom = denom * rescale
            numer = numer * rescale
            for live, m, l_sum, acc in loads:
                w = jnp.where(live, jnp.exp2(m - new_top), jnp.float32(0.0))
                denom = denom + w * l_sum
                numer = numer + w * acc
            return new_top, denom, numer

        chunks = -(-parts // n)
        if tiled:  # nothing for a request without a prefix part
            chunks = jnp.where(has_ref[b] != 0, chunks, 0)
            carry = lax.fori_loop(0, chunks, fold, carry)
        elif chunks == 1:
            carry = fold(0, carry)
        else:
            carry = lax.fori_loop(0, chunks, fold, carry)

    _, denom, numer = carry
    # No key in any part: every sum is 0 and so is numer (a part of no key adds nothing).
    out = numer / jnp.where(denom == 0.0, jnp.float32(1.0), denom)
    if indexed:
        out = out + jnp.where(ok_ref[b] != 0, jnp.float32(0.0), jnp.float32(jnp.nan))
    o_ref[b, hq] = out.astype(o_ref.dtype)


def merge_levels(levels, index, dtype, *, group: int, interpret: bool | None = None):
    """Cascade decode's exact merge (:func:`jaxattn.pallas.decode.combine_levels`'s contract)
    as one Mosaic GPU kernel. ``levels``: ``(tiled, acc, ml)`` per level, acc f32[X, P, Hkv,
    R, D] and ml f32[X, P, Hkv, 2, R_pad] (max then sum, base 2); ``tiled`` False: X are the
    requests and request b's row g of KV head h is its query head ``h * group + g``; True: X
    are prefix tiles and request b's rows are ``slot * group + g`` of tile ``tile``.
    ``index``: four int32[B] (per request its tile, its slot, whether it has a prefix part,
    whether it is ok: 0 makes its rows NaN), or None (no tiled level, every request ok).
    Returns ``[B, Hkv * group, D]`` in ``dtype``. ``interpret``: None interprets on the CPU
    only."""
    head_dim = levels[0][1].shape[-1]
    if (why := unsupported(head_dim)) is not None:
        raise NotImplementedError(why)
    interpret = M.interpreted(interpret)
    tiled = tuple(bool(t) for t, _, _ in levels)
    if index is None and any(tiled):
        raise ValueError("a tiled level needs the index (tile, slot, has, ok) of every request")
    arrays = [a for _, acc, ml in levels for a in (acc, ml)]
    if index is not None:
        index = tuple(jnp.asarray(i, jnp.int32) for i in index)
    return _merge_levels(
        tiled, index, *arrays, dtype=jnp.dtype(dtype), group=int(group), interpret=bool(interpret)
    )


def merge(acc, ml, dtype, *, interpret: bool | None = None):
    """The Mosaic GPU decode's split-KV merge: acc f32[B, P, Hkv, G, D] and ml f32[B, P, Hkv,
    2, G_pad] (:func:`jaxattn.pallas.decode_mgpu.partial_states`'s layout) -> ``[B, Hkv * G,
    D]`` in ``dtype``, as :func:`jaxattn.pallas.decode.combine` merges them."""
    return merge_levels([(False, acc, ml)], None, dtype, group=acc.shape[3], interpret=interpret)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("dtype", "group", "interpret"))
def _merge_levels(tiled, index, *arrays, dtype, group, interpret):
    _, _, num_kv_heads, _, head_dim = arrays[0].shape
    batch = arrays[0].shape[0] if index is None else index[0].shape[0]
    levels = tuple((t, acc.shape[1]) for t, acc in zip(tiled, arrays[0::2], strict=True))
    kernel = functools.partial(
        _kernel, levels=levels, group=group, head_dim=head_dim, indexed=index is not None,
        interpret=interpret,
    )  # fmt: skip
    num_q_heads = num_kv_heads * group
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((batch, num_q_heads, head_dim), dtype),
        grid=(batch, num_q_heads),
        grid_names=("b", "hq"),
        **M.launch_params(interpret),
    )(*arrays, *(index or ()))
