"""The split-KV merges of the Mosaic GPU decode and cascade decode on the Mosaic GPU lowering
itself: with them the two ops launch no Triton kernel (:mod:`jaxattn.pallas.decode` keeps the
Triton-lowered merges for that lowering's kernels and for what this one does not take).

One block (one warpgroup) per (request, query head) folds that row's partition states in
place, exactly as :func:`jaxattn.pallas.decode.combine_levels` does::

    M = max_p m_p,   w_p = 2^(m_p - M),   out = sum_p w_p acc_p / sum_p w_p l_p

Each part's two statistics are scalar loads and its row of the accumulator one vector load
from global memory (a [D] row strided over the warpgroup's threads, ``D / 128`` floats a
thread), :data:`UNROLL` parts at a time so their loads are in flight together. At head_dim
64 a block merges two query heads side by side (a request's adjacent heads: one float a
thread, each row's weights put in place by a select on the row, so a NaN stays in its row;
:func:`rows_per_block`), which takes an even number of query heads and, in the cascade, an
even GQA group; the decode and the cascade use it when ``merge="mosaic_gpu"`` is named
there (correct on an H200 and no faster there than the Triton-lowered merge, which head_dim
64 keeps by default).
The states are
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
from jax.experimental import pallas as pl

from . import _mgpu as M
from ._mgpu import plgpu
from .decode import MERGE_FLOOR

__all__ = ["merge", "merge_levels", "unsupported"]

UNROLL = 8  # parts whose loads a block issues before folding them
THREADS = 128  # a warpgroup: a row of D is strided over its threads


def rows_per_block(head_dim: int) -> int:
    """Query heads a block merges: one where a row covers the warpgroup (head_dim a multiple
    of 128), else ``128 // head_dim`` rows side by side (head_dim 64: two), one float a
    thread."""
    return 1 if head_dim % THREADS == 0 else THREADS // head_dim


def unsupported(head_dim: int, *, num_q_heads: int | None = None, group: int | None = None,
                tiled: bool = False) -> str | None:  # fmt: skip
    """Why :func:`merge_levels` cannot merge rows of ``head_dim``, or None: a row is one
    strided vector of at most 16 bytes a thread (head_dim 128, 256, 384 or 512), or two rows
    of head_dim 64 side by side, one float a thread. That form takes ``num_q_heads`` even
    and, with a ``tiled`` level (the cascade's prefix tiles, where a request's rows of one
    KV head are apart from the next KV head's), an even GQA ``group``."""
    if (why := M.available()) is not None:
        return why
    if head_dim != 64 and (head_dim % THREADS or head_dim > 4 * THREADS):
        return (
            f"the Mosaic GPU merge takes head_dim 64 or a multiple of {THREADS} up to 512, "
            f"got {head_dim}"
        )
    rows = rows_per_block(head_dim)
    if rows > 1 and num_q_heads is not None and num_q_heads % rows:
        return (
            f"the Mosaic GPU merge at head_dim {head_dim} merges {rows} query heads a block: "
            f"{num_q_heads} query heads are not a multiple"
        )
    if rows > 1 and tiled and group is not None and group % rows:
        return (
            f"the Mosaic GPU cascade merge at head_dim {head_dim} merges {rows} query heads of "
            f"one KV head a block: a group of {group} is not a multiple"
        )
    return None


def _kernel(*refs, levels, group, head_dim, indexed, interpret):
    """Block (request b, query heads ``hq * RB ...``, RB = :func:`rows_per_block`): ``levels``
    per level (tiled, parts); its refs acc and ml; then (tile, slot, has, ok) int32[B] when
    ``indexed``; the output [B, Hq, D]. With RB > 1 an untiled level's acc is viewed as
    [X, P, Hkv * G, D] (a request's query heads one after the other)."""
    refs = list(refs)
    o_ref = refs.pop()
    tile_ref, slot_ref, has_ref, ok_ref = refs[-4:] if indexed else (None,) * 4
    level_refs = refs[: 2 * len(levels)]
    M.dependent_launch(interpret)  # the states are the kernel's just before this one
    b = lax.axis_index("b")
    RB = rows_per_block(head_dim)
    hq0 = lax.axis_index("hq") * RB
    D = head_dim
    shape = (RB, D) if RB > 1 else (D,)
    if interpret:
        row = lambda ref: ref[...]  # noqa: E731
        zeros = jnp.zeros(shape, jnp.float32)
        line = lax.broadcasted_iota(jnp.int32, shape, 0)
    else:
        strided = plgpu.Layout.WG_STRIDED(shape, vec_size=RB * D // THREADS)
        row = lambda ref: M.load(ref, layout=strided)  # noqa: E731
        zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), strided)
        line = None
        if RB > 1:
            line = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, shape, 0), strided)

    def pick(values):
        """The RB rows' scalars as one vector of the rows' shape (a select per row, so a
        NaN in one row's scalar stays in that row)."""
        if RB == 1:
            return values[0]
        out = zeros + values[0]
        for k in range(1, RB):
            out = jnp.where(line == k, values[k], out)
        return out

    floor = jnp.float32(MERGE_FLOOR)
    # Per row: (running max, denominator); the numerators as one vector.
    carry = ((floor,) * RB, (jnp.float32(0.0),) * RB, zeros)

    for (tiled, parts), acc_ref, ml_ref in zip(
        levels, level_refs[0::2], level_refs[1::2], strict=True
    ):
        X = acc_ref.shape[0]
        if tiled:  # the request's rows of its prefix tile (RB rows of one KV head)
            x = jnp.clip(tile_ref[b], 0, X - 1)
            kvh = lax.div(hq0, group)
            r0 = jnp.clip(slot_ref[b] * group + lax.rem(hq0, group), 0, acc_ref.shape[3] - RB)
            stats = [(kvh, r0 + k) for k in range(RB)]
            acc_at = lambda p, x=x, kvh=kvh, r0=r0, a=acc_ref: (  # noqa: E731
                a.at[x, p, kvh, pl.ds(r0, RB)] if RB > 1 else a.at[x, p, kvh, r0]
            )
        else:
            x = b
            heads = [hq0 + k for k in range(RB)]
            stats = [(lax.div(h, group), lax.rem(h, group)) for h in heads]
            if RB > 1:  # acc viewed as [X, P, Hkv * G, D]
                acc_at = lambda p, a=acc_ref: a.at[b, p, pl.ds(hq0, RB)]  # noqa: E731
            else:
                kvh, g = stats[0]
                acc_at = lambda p, a=acc_ref, kvh=kvh, g=g: a.at[b, p, kvh, g]  # noqa: E731
        n = min(parts, UNROLL)

        def fold(c, carry, x=x, stats=stats, acc_at=acc_at, parts=parts, n=n, ml_ref=ml_ref):
            tops, denoms, numer = carry
            loads = []
            for i in range(n):  # every load of the group before any folding
                p = c * n + i
                live = p < parts
                p = jnp.minimum(p, parts - 1)
                ms = [jnp.where(live, ml_ref[x, p, h, 0, r], floor) for h, r in stats]
                ls = [ml_ref[x, p, h, 1, r] for h, r in stats]
                loads.append((live, ms, ls, row(acc_at(p))))
            new_tops = [
                functools.reduce(jnp.maximum, [ms[k] for _, ms, _, _ in loads], tops[k])
                for k in range(RB)
            ]
            rescale = [jnp.exp2(tops[k] - new_tops[k]) for k in range(RB)]
            denoms = [denoms[k] * rescale[k] for k in range(RB)]
            numer = numer * pick(rescale)
            for live, ms, ls, acc in loads:
                ws = [
                    jnp.where(live, jnp.exp2(ms[k] - new_tops[k]), jnp.float32(0.0))
                    for k in range(RB)
                ]
                denoms = [denoms[k] + ws[k] * ls[k] for k in range(RB)]
                numer = numer + pick(ws) * acc
            return tuple(new_tops), tuple(denoms), numer

        chunks = -(-parts // n)
        if tiled:  # nothing for a request without a prefix part
            chunks = jnp.where(has_ref[b] != 0, chunks, 0)
            carry = lax.fori_loop(0, chunks, fold, carry)
        elif chunks == 1:
            carry = fold(0, carry)
        else:
            carry = lax.fori_loop(0, chunks, fold, carry)

    _, denoms, numer = carry
    # No key in any part: every sum is 0 and so is numer (a part of no key adds nothing).
    safe = [jnp.where(d == 0.0, jnp.float32(1.0), d) for d in denoms]
    out = numer / pick(safe)
    if indexed:
        out = out + jnp.where(ok_ref[b] != 0, jnp.float32(0.0), jnp.float32(jnp.nan))
    if RB > 1:
        o_ref[b, pl.ds(hq0, RB)] = out.astype(o_ref.dtype)
    else:
        o_ref[b, hq0] = out.astype(o_ref.dtype)


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
    _, _, num_kv_heads, _, head_dim = levels[0][1].shape
    tiled = tuple(bool(t) for t, _, _ in levels)
    why = unsupported(head_dim, num_q_heads=num_kv_heads * group, group=group, tiled=any(tiled))
    if why is not None:
        raise NotImplementedError(why)
    interpret = M.interpreted(interpret)
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
    if rows_per_block(head_dim) > 1:  # untiled levels' acc: a request's query heads in a row
        pairs = zip(tiled, arrays[0::2], arrays[1::2], strict=True)
        arrays = [
            x
            for t, acc, ml in pairs
            for x in (acc if t else acc.reshape(*acc.shape[:2], num_q_heads, head_dim), ml)
        ]
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((batch, num_q_heads, head_dim), dtype),
        grid=(batch, num_q_heads // rows_per_block(head_dim)),
        grid_names=("b", "hq"),
        **M.launch_params(interpret),
    )(*arrays, *(index or ()))
