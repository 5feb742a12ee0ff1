"""Paged decode attention: one query token per sequence over a paged KV cache.

Grid ``(num_kv_heads, batch, num_partitions)``. One program owns one KV head of one
sequence over one partition of its context and computes *every* query head of that
KV head's GQA group against it, so each K/V page is read from memory once per group
rather than once per query head (the REUSE_KV idea). The group's query rows form the
M side of a tensor-core dot, padded to 16 rows (the smallest Triton dot); MHA is the
group-of-1 case.

Split-KV: with more than one partition each program writes its unnormalised
accumulator and its (m, l) in base 2, and :func:`combine` merges them exactly::

    M = max_p m_p,   w_p = 2^(m_p - M),   out = sum_p w_p acc_p / sum_p w_p l_p

With a single partition the program normalises and writes the output itself (v1).

FP8 caches: the tiles are loaded as stored and widened to q's dtype (exact) before the dots;
the per-KV-head scales are an operand (f32 [2, Hkv]): k_scale multiplies the raw scores,
v_scale the output (or each partition's accumulator).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .. import layout as L
from .._compat import match_varying, out_struct
from ..backend import split_kv_partition
from . import _common as C
from . import _triton
from ._triton import plgpu


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tiling of the decode kernel.

    block_n: tokens per inner step (K/V tile rows); None: 64, fewer for wide heads or
      float32 so that three pipeline stages fit in shared memory.
    num_warps, num_stages: Triton launch and software-pipelining depth. The defaults
      were the fastest of a sweep on an H200 (bf16, D=128, page 16) at both
      B=64 x 4096 and B=1 x 32768.
    min_programs: when ``partition_size`` is None, partitions are halved (down to
      ``min_partition``) until the grid has at least this many programs; None means two
      per streaming multiprocessor.
    lowering: ``"triton"`` (the kernel above, Pallas' Triton lowering) or ``"mosaic_gpu"``
      (:mod:`jaxattn.pallas.decode_mgpu`, sm_90 or Mosaic GPU's interpret mode; 16-bit or
      FP8 caches, bshd/bhsd; the other fields do not apply to it; ``partition_size`` a whole
      number of its steps). With no config, ``implementation="pallas"`` runs the Mosaic GPU
      kernel compiled on sm_90 for a 16-bit cache with head_dim 128 and tables of at least
      1024 tokens (:func:`jaxattn.pallas.decode_mgpu.serves_by_default`), else this one.
    """

    block_n: int | None = None
    num_warps: int = 2
    num_stages: int = 3
    min_programs: int | None = None
    min_partition: int = 128
    lowering: str = "triton"

    def __post_init__(self):
        if self.lowering not in ("triton", "mosaic_gpu"):
            raise ValueError(
                f"DecodeConfig.lowering must be 'triton' or 'mosaic_gpu', got {self.lowering!r}"
            )
        n = self.block_n
        if n is not None and (n < 16 or n & (n - 1)):
            raise ValueError(f"{self.block_n=} must be a power of two >= 16")


def choose_partition_size(
    *,
    batch: int,
    num_kv_heads: int,
    group: int,
    max_context: int,
    partition_size: int | None,
    config: DecodeConfig,
) -> int:
    """Tokens per partition.

    An explicit ``partition_size`` wins. Otherwise the shared split rule
    (:func:`jaxattn.backend.split_kv_partition`) without growing: 512 tokens, or 256 when
    the group is larger than 15, halved while the grid would have fewer than
    ``config.min_programs`` programs (two per multiprocessor by default). A partition
    that covers the whole context is one pass.
    """
    if partition_size is not None:
        return int(partition_size)
    return split_kv_partition(
        batch=batch,
        num_kv_heads=num_kv_heads,
        group=group,
        capacity=max_context,
        target_blocks=config.min_programs or 2 * C.num_sms(),
        grow=False,
        min_partition=config.min_partition,
    )


def heuristic_config(q, geom: L.CacheGeometry) -> DecodeConfig:
    """The tuned defaults with the device-dependent fields filled in: K/V tiles of 64
    rows (fewer for wide heads or float32, so that three stages fit in shared memory) and
    two programs per multiprocessor."""
    return DecodeConfig(
        block_n=C.kv_tile_rows(geom.head_dim, q.dtype.itemsize, stage_bytes=32 * 1024, cap=64),
        min_programs=2 * C.num_sms(),
    )


def _decode_kernel(
    seq_lens_ref,
    block_tables_ref,
    scales_ref,
    q_ref,
    k_ref,
    v_ref,
    *out_refs,
    group: int,
    group_pad: int,
    geom: L.CacheGeometry,
    layout: str,
    partition_size: int,
    block_n: int,
    head_dim: int,
    scale: float,
    soft_cap: float | None,
    split: bool,
    scaled: bool,
    kv_dtype,
):
    kv_head, b, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq_len = seq_lens_ref[b]
    # The memory-safety contract (jaxattn.reference.validity): a length outside
    # [0, capacity] or a page id outside the pool poisons the sequence; reads stay inside
    # the block table (lengths clipped to it) and inside the pool (bad page ids read page 0).
    capacity = block_tables_ref.shape[1] * geom.page_size
    bad_len = (seq_len < 0) | (seq_len > capacity)
    seq_len = jnp.clip(seq_len, 0, capacity)
    start = part * partition_size
    end = jnp.minimum(seq_len, start + partition_size)

    g = jnp.arange(group_pad)
    d = jnp.arange(head_dim)
    # Padding rows re-read the group's last head (never out of bounds) and are dropped.
    q_heads = kv_head * group + jnp.minimum(g, group - 1)
    q = q_ref[b, q_heads[:, None], d[None, :]]
    # Unscaled caches (both scales None) skip the multiplies: a static choice.
    k_scale, v_scale = (scales_ref[0, kv_head], scales_ref[1, kv_head]) if scaled else (1, 1)

    def body(i, carry):
        *state, bad = carry
        t = start + i * block_n + jnp.arange(block_n)
        valid = t < end
        page_size = geom.page_size
        page = plgpu.load(block_tables_ref.at[b, lax.div(t, page_size)], mask=valid, other=0)
        page, bad = C.checked_pages(page, valid, geom.num_pages, bad)
        rows = L.get(layout).row(page, lax.rem(t, page_size), kv_head, geom)
        k = C.widen(C.load_rows(k_ref, rows, valid, head_dim), q.dtype, kv_dtype)
        s = C.dot_nt(q, k)
        s = C.scores_base2(s * k_scale if scaled else s, scale=scale, soft_cap=soft_cap)
        s = jnp.where(valid[None, :], s, -jnp.inf)
        v = C.widen(C.load_rows(v_ref, rows, valid, head_dim), q.dtype, kv_dtype)
        return (*C.online_softmax_step(tuple(state), s, v), bad)

    num_steps = pl.cdiv(jnp.maximum(end - start, 0), block_n)
    init = (*C.init_state(group_pad, head_dim), bad_len.astype(jnp.int32))
    acc, m, l_sum, bad = lax.fori_loop(0, num_steps, body, init)
    poisoned = bad > 0

    # Unpadded head ids for the stores: padding lanes are masked off (and, being
    # distinct from the real ones, cannot collide with them in interpret mode).
    out_heads = kv_head * group + g
    row_ok = g < group
    if scaled:
        acc = acc * v_scale  # linear in the values: each partition carries it into the combine
    if not split:
        (o_ref,) = out_refs
        out = jnp.where(poisoned, jnp.nan, C.finalize(acc, l_sum)).astype(o_ref.dtype)
        plgpu.store(o_ref.at[b, out_heads[:, None], d[None, :]], out, mask=row_ok[:, None])
    else:
        # A poisoned partition poisons the combine (NaN propagates through it).
        acc = jnp.where(poisoned, jnp.nan, acc)
        m = jnp.where(poisoned, jnp.nan, m)
        l_sum = jnp.where(poisoned, jnp.nan, l_sum)
        acc_ref, m_ref, l_ref = out_refs
        plgpu.store(acc_ref.at[b, part, out_heads[:, None], d[None, :]], acc, mask=row_ok[:, None])
        plgpu.store(m_ref.at[b, part, out_heads], m, mask=row_ok)
        plgpu.store(l_ref.at[b, part, out_heads], l_sum, mask=row_ok)


def combine_jnp(acc, m, l_sum, dtype):
    """Exact merge of partitions along axis 1 in jnp: acc f32[B, P, Hq, D], m, l_sum
    f32[B, P, Hq] (m in base 2) -> [B, Hq, D]. A NaN partition (NaN input, or a poisoned
    sequence) gives NaN: ``jnp.max`` and the sums propagate it; only an all-empty row
    (denominator 0) is 0. :func:`combine` computes the same in one kernel.
    """
    return combine_groups([(acc, m, l_sum)], dtype)


def combine_groups(groups, dtype):
    """:func:`combine_jnp` over partitions given as several ``(acc, m, l_sum)`` groups along
    axis 1 (each ``[B, P_i, Hq, D]``, ``[B, P_i, Hq]``), never concatenated: XLA fuses what
    produces each group (a gather, say) into its weighted sums."""
    m_max = functools.reduce(jnp.maximum, [jnp.max(m, axis=1) for _, m, _ in groups])
    denom = numer = 0.0
    for acc, m, l_sum in groups:
        w = jnp.exp2(m - m_max[:, None])
        denom = denom + jnp.sum(w * l_sum, axis=1)
        numer = numer + jnp.sum(w[..., None] * acc, axis=1)
    safe = jnp.where(denom == 0, 1.0, denom)
    return jnp.where((denom == 0)[..., None], 0.0, numer / safe[..., None]).astype(dtype)


def combine_levels_jnp(levels, index, dtype, *, group: int, interpret: bool | None = None):
    """:func:`combine_levels`' merge in jnp (XLA's gathers and reductions, no Pallas kernel):
    what the Mosaic GPU decode and cascade decode merge with where neither merge kernel
    serves (a head_dim the Mosaic GPU merge does not take, on a JAX without the Triton
    lowering). The same arguments, plus ``index`` None for a single untiled level of
    requests that are all ok (the split-KV decode's states); ``interpret`` is ignored."""
    del interpret
    if index is not None:
        index = tuple(jnp.asarray(i, jnp.int32) for i in index)
    groups = []
    for tiled, acc, ml in levels:
        X, P, Hkv, R, D = acc.shape
        if tiled:
            tile, slot, has, _ = index
            x = jnp.clip(tile, 0, X - 1)[:, None]
            r = jnp.clip(slot[:, None] * group + jnp.arange(group)[None, :], 0, R - 1)
            # [B, group, P, Hkv, ...]: the request's rows of its tile, moved to [B, P, Hkv, group].
            acc = jnp.moveaxis(acc[x, :, :, r], 1, 3)
            m = jnp.moveaxis(ml[x, :, :, 0, r], 1, 3)
            l_sum = jnp.moveaxis(ml[x, :, :, 1, r], 1, 3)
            live = (has != 0)[:, None, None, None]
            acc = jnp.where(live[..., None], acc, 0.0)
            m = jnp.where(live, m, MERGE_FLOOR)
            l_sum = jnp.where(live, l_sum, 0.0)
        else:
            acc, m, l_sum = acc[:, :, :, :group], ml[:, :, :, 0, :group], ml[:, :, :, 1, :group]
        B = acc.shape[0]
        groups.append((
            acc.reshape(B, P, Hkv * group, D), m.reshape(B, P, Hkv * group),
            l_sum.reshape(B, P, Hkv * group),
        ))  # fmt: skip
    out = combine_groups(groups, jnp.float32)
    if index is not None:
        out = jnp.where((index[3] != 0)[:, None, None], out, jnp.nan)
    return out.astype(dtype)


# A merge program folds its partitions MERGE_ELEMENTS float32 accumulator values at a time
# (chunk of partitions x its slice of D): 16 KiB, 32 registers a thread at four warps.
MERGE_ELEMENTS = 4096
# Below every partition's max (finite maxima are >= C.M_INIT): lanes past the last
# partition weigh exp2(MERGE_FLOOR - top) = 0.
MERGE_FLOOR = -3.0e38


def _fold(carry, m, l_sum, acc):
    """One chunk of partitions folded into the running (top, denom, numer) of one row (``m``,
    ``l_sum`` [chunk], ``acc`` [chunk, width]) or of several (``m``, ``l_sum`` [chunk,
    rows], ``acc`` [chunk, rows, width]); masked lanes at ``m = MERGE_FLOOR``, zero sums."""
    top, denom, numer = carry
    # A NaN max makes its own weight NaN (exp2(NaN - x)), so the row's sums are NaN
    # whether or not the reduction's max propagates it.
    new_top = jnp.maximum(top, jnp.max(m, axis=0))
    rescale = jnp.exp2(top - new_top)
    w = jnp.exp2(m - (new_top if new_top.ndim == 0 else new_top[None, :]))
    denom = denom * rescale + jnp.sum(w * l_sum, axis=0)
    numer = numer * _per_row(rescale) + jnp.sum(w[..., None] * acc, axis=0)
    return new_top, denom, numer


def _per_row(x):
    """A row's scalar (or rows' vector) broadcast over its slice of D."""
    return x if x.ndim == 0 else x[:, None]


def _fold_init(width, rows=None):
    shape = () if rows is None else (rows,)
    return (
        jnp.full(shape, MERGE_FLOOR, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, width), jnp.float32),
    )


def _finish(carry):
    """The merged row(s) of a fold: numer / denom, 0 where nothing was attended (denom 0)."""
    _, denom, numer = carry
    empty = _per_row(denom == 0)
    return jnp.where(empty, 0.0, numer / _per_row(jnp.where(denom == 0, 1.0, denom)))


def _merge_width(programs: int, head_dim: int, rows: int = 1) -> int:
    """The slice of D a merge program takes: halved (down to 32 lanes) until the grid of
    ``programs`` rows-of-programs x slices has two programs a multiprocessor and a part's
    ``rows`` x slice fits the chunk budget."""
    width = head_dim
    while width > 32 and (
        programs * (head_dim // width) < 2 * C.num_sms() or rows * width > MERGE_ELEMENTS
    ):
        width //= 2
    return width


def _merge_chunk(parts: int, width: int, rows: int = 1) -> int:
    """Partitions a merge program folds at a time: ``MERGE_ELEMENTS`` accumulator values."""
    return min(pl.next_power_of_2(parts), max(1, MERGE_ELEMENTS // (rows * width)))


def _combine_kernel(*refs, parts, chunk, width, group, own_parts):
    """A program per (request, query head, slice of D). ``own_parts`` None: every part of
    the row. Otherwise (the Triton cascade's merge) the refs also hold int32 [B] own_n,
    pre_n and ok: request b has parts [0, own_n[b]) and [own_parts, own_parts + pre_n[b])
    (the others were never written) and is NaN where ok[b] is 0."""
    if own_parts is None:
        acc_ref, m_ref, l_ref, o_ref = refs
    else:
        acc_ref, m_ref, l_ref, own_n_ref, pre_n_ref, ok_ref, o_ref = refs
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    d = j * width + jnp.arange(width)

    def stat(ref, p, which, ok, other):
        if group is None:  # m, l_sum f32[B, P, Hq]
            return plgpu.load(ref.at[b, p, h], mask=ok, other=other)
        # Packed by the Mosaic GPU kernel: f32[B, P, Hkv, 2, G_pad], max then sum.
        return plgpu.load(ref.at[b, p, h // group, which, h % group], mask=ok, other=other)

    def step(c, carry):
        p = c * chunk + jnp.arange(chunk)
        ok = p < parts
        if own_parts is not None:
            own_n, pre_n = own_n_ref[b], pre_n_ref[b]
            ok &= (p < own_n) | ((p >= own_parts) & (p < own_parts + pre_n))
        p = jnp.minimum(p, parts - 1)  # in bounds, masked lanes included
        m = stat(m_ref, p, 0, ok, MERGE_FLOOR)
        l_sum = stat(l_ref, p, 1, ok, 0.0)
        acc = plgpu.load(acc_ref.at[b, p[:, None], h, d[None, :]], mask=ok[:, None], other=0.0)
        return _fold(carry, m, l_sum, acc)

    carry = lax.fori_loop(0, pl.cdiv(parts, chunk), step, _fold_init(width))
    out = _finish(carry)
    if own_parts is not None:
        out = jnp.where(ok_ref[b] != 0, out, jnp.nan)
    o_ref[b, h, d] = out.astype(o_ref.dtype)


def combine(acc, m, l_sum, dtype, *, interpret: bool | None = None, group: int | None = None):
    """:func:`combine_jnp`'s merge as one Pallas kernel: a program per request, query head
    and slice of D (enough programs for two per multiprocessor, slices of >= 32 lanes), the
    partitions folded a chunk at a time; one launch where XLA's reductions over the partition
    axis took up to four, the output written in its dtype. ``group``: m and l_sum are both
    the Mosaic GPU kernel's packed statistics f32[B, P, Hkv, 2, G_pad] (G = ``group`` query
    heads a KV head), read in place. ``interpret``: None interprets on the CPU only.
    """
    _triton.require()
    if interpret is None:
        interpret = C.resolve_interpret(None)
    return _combine(acc, m, l_sum, jnp.dtype(dtype), bool(interpret), group)


def combine_counted(acc, m, l_sum, own_n, pre_n, ok, dtype, *, own_parts: int, rows: int,
                    interpret: bool | None = None):  # fmt: skip
    """:func:`combine` of the first ``rows`` requests of a workspace whose request ``b`` holds
    parts ``[0, own_n[b])`` and ``[own_parts, own_parts + pre_n[b])`` only (int32 [rows]; the
    rest never written, and not read), NaN where ``ok[b]`` is 0: the Triton cascade's merge,
    with its masks in the kernel instead of XLA kernels of their own in every layer."""
    _triton.require()
    if interpret is None:
        interpret = C.resolve_interpret(None)
    counts = tuple(jnp.asarray(x, jnp.int32) for x in (own_n, pre_n, ok))
    return _combine(acc, m, l_sum, jnp.dtype(dtype), bool(interpret), None, counts, own_parts, rows)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 7, 8))
def _combine(acc, m, l_sum, dtype, interpret, group, counts=None, own_parts=None, rows=None):
    batch, parts, num_q_heads, head_dim = acc.shape
    batch = batch if rows is None else rows
    width = _merge_width(batch * num_q_heads, head_dim)
    chunk = _merge_chunk(parts, width)
    kernel = functools.partial(
        _combine_kernel, parts=parts, chunk=chunk, width=width, group=group, own_parts=own_parts
    )
    inputs = match_varying(acc, m, l_sum, *(counts or ()))
    return pl.pallas_call(
        kernel,
        grid=(batch, num_q_heads, head_dim // width),
        out_shape=out_struct((batch, num_q_heads, head_dim), dtype, *inputs),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jaxattn_decode_merge",
    )(*inputs)


def _levels_kernel(*refs, levels, group, rows, width):
    """A program per (request, KV head, slice of D): the parts of each level a request has,
    folded for the ``group`` query heads of the KV head at once (``rows``: the group padded
    to a power of two), then NaN where the request is not ok. ``levels``: per level,
    (whether its rows are a prefix tile's, parts, chunk); its refs acc f32[X, P, Hkv, R, D]
    and the packed statistics f32[X, P, Hkv, 2, R_pad] (max then sum), X the requests (own)
    or the tiles (prefix), R the rows a problem's KV head has. A level of one chunk is
    loaded before any folding, so its loads and the other levels' are in flight together."""
    *level_refs, tile_ref, slot_ref, has_ref, ok_ref, o_ref = refs
    b, kvh, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g_out = jnp.arange(rows)
    g_ok = g_out < group
    g = jnp.minimum(g_out, group - 1)  # loads in bounds, masked rows included
    d = j * width + jnp.arange(width)

    def load(c, x, first_row, present, parts, chunk, acc_ref, ml_ref):
        p = c * chunk + jnp.arange(chunk)
        ok = p < parts if present is None else (p < parts) & present
        p = jnp.minimum(p, parts - 1)[:, None]
        ok = ok[:, None] & g_ok[None, :]
        r = first_row + g[None, :]
        m = plgpu.load(ml_ref.at[x, p, kvh, 0, r], mask=ok, other=MERGE_FLOOR)
        l_sum = plgpu.load(ml_ref.at[x, p, kvh, 1, r], mask=ok, other=0.0)
        at = acc_ref.at[x, p[..., None], kvh, r[..., None], d[None, None, :]]
        acc = plgpu.load(at, mask=ok[..., None], other=0.0)
        return m, l_sum, acc

    sources = []
    for (tiled, parts, chunk), acc_ref, ml_ref in zip(
        levels, level_refs[0::2], level_refs[1::2], strict=True
    ):
        if tiled:  # the request's rows of its prefix tile, when it has one
            x, first_row, present = tile_ref[b], slot_ref[b] * group, has_ref[b] != 0
        else:
            x, first_row, present = b, 0, None
        src = functools.partial(load, x=x, first_row=first_row, present=present, parts=parts,
                                chunk=chunk, acc_ref=acc_ref, ml_ref=ml_ref)  # fmt: skip
        sources.append((pl.cdiv(parts, chunk), src, src(0) if parts <= chunk else None))
    carry = _fold_init(width, rows)
    for chunks, src, first in sources:
        if first is not None:
            carry = _fold(carry, *first)
        else:
            carry = lax.fori_loop(0, chunks, lambda c, cr, src=src: _fold(cr, *src(c)), carry)
    out = jnp.where(ok_ref[b] != 0, _finish(carry), jnp.nan)
    # Unclamped head ids for the store: the masked padding rows never collide with real
    # ones (in interpret mode a masked lane on a real row's address can overwrite it).
    heads = (kvh * group + g_out)[:, None]
    plgpu.store(o_ref.at[b, heads, d[None, :]], out.astype(o_ref.dtype), mask=g_ok[:, None])


def combine_levels(levels, index, dtype, *, group: int, interpret: bool | None = None):
    """Cascade decode's exact merge as one Pallas kernel: each request's own parts and its
    prefix tile's parts (its ``group`` rows of the tile), with the partition states the
    Mosaic GPU decode kernel leaves (:func:`jaxattn.pallas.decode_mgpu.partial_states`) read
    in place -- no gather, no workspace, one launch where XLA's merge took three.

    ``levels``: ``(tiled, acc, ml)`` per level, acc f32[X, P, Hkv, R, D] and ml f32[X, P,
    Hkv, 2, R_pad], X the requests (``tiled`` False: a request's row ``g`` of KV head ``h``
    is its query head ``h * group + g``) or the prefix tiles (``tiled`` True: request ``b``'s
    rows are ``slot * group + g`` of tile ``tile``). ``index``: four int32[B], per request its
    tile, its slot, whether it has a prefix part (0 / 1) and whether it is ok (0: its rows
    are NaN). A request with no part (nothing attended) is 0. ``interpret``: None
    interprets on the CPU only."""
    _triton.require()
    if interpret is None:
        interpret = C.resolve_interpret(None)
    tiled = tuple(bool(t) for t, _, _ in levels)
    arrays = [a for _, acc, ml in levels for a in (acc, ml)]
    index = tuple(jnp.asarray(i, jnp.int32) for i in index)
    return _combine_levels(tiled, index, *arrays, dtype=jnp.dtype(dtype), group=int(group),
                           interpret=bool(interpret))  # fmt: skip


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("dtype", "group", "interpret"))
def _combine_levels(tiled, index, *arrays, dtype, group, interpret):
    batch = index[0].shape[0]
    _, _, num_kv_heads, _, head_dim = arrays[0].shape
    rows = pl.next_power_of_2(group)
    width = _merge_width(batch * num_kv_heads, head_dim, rows)
    levels = tuple(
        (t, acc.shape[1], _merge_chunk(acc.shape[1], width, rows))
        for t, acc in zip(tiled, arrays[0::2], strict=True)
    )
    kernel = functools.partial(_levels_kernel, levels=levels, group=group, rows=rows, width=width)
    inputs = match_varying(*arrays, *index)
    return pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, head_dim // width),
        out_shape=out_struct((batch, num_kv_heads * group, head_dim), dtype, *inputs),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jaxattn_cascade_merge",
    )(*inputs)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "layout",
        "partition_size",
        "soft_cap",
        "interpret",
        "config",
        "scaled",
    ),
)
def _paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    scales,
    *,
    scale,
    layout,
    partition_size,
    soft_cap,
    interpret,
    config,
    scaled,
):
    batch, num_q_heads, head_dim = q.shape
    geom = L.get(layout).geometry(k_cache, v_cache)
    num_kv_heads = geom.num_kv_heads
    group = num_q_heads // num_kv_heads
    max_context = block_tables.shape[1] * geom.page_size
    psize = choose_partition_size(
        batch=batch,
        num_kv_heads=num_kv_heads,
        group=group,
        max_context=max_context,
        partition_size=partition_size,
        config=config,
    )
    num_parts = pl.cdiv(max_context, psize)
    split = num_parts > 1
    scales = C.scales_operand(scales, geom.num_kv_heads)
    block_n = config.block_n or C.kv_tile_rows(
        head_dim, q.dtype.itemsize, stage_bytes=32 * 1024, cap=64
    )
    # A tile longer than the partition would only load masked lanes.
    block_n = max(16, min(block_n, pl.next_power_of_2(psize)))

    kernel = functools.partial(
        _decode_kernel,
        group=group,
        group_pad=max(16, pl.next_power_of_2(group)),
        geom=geom,
        layout=layout,
        partition_size=psize,
        block_n=block_n,
        head_dim=head_dim,
        scale=scale,
        soft_cap=soft_cap,
        split=split,
        scaled=scaled,
        kv_dtype=k_cache.dtype,
    )
    inputs = match_varying(
        seq_lens, block_tables, scales, q, C.as_rows(k_cache), C.as_rows(v_cache)
    )
    if split:
        out_shape = (
            out_struct((batch, num_parts, num_q_heads, head_dim), jnp.float32, *inputs),
            out_struct((batch, num_parts, num_q_heads), jnp.float32, *inputs),
            out_struct((batch, num_parts, num_q_heads), jnp.float32, *inputs),
        )
    else:
        out_shape = (out_struct(q.shape, q.dtype, *inputs),)
    call = pl.pallas_call(
        kernel,
        grid=(num_kv_heads, batch, num_parts),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name="jaxattn_paged_decode",
    )
    outs = call(*inputs)
    if not split:
        return outs[0]
    return combine(*outs, q.dtype, interpret=interpret)


def paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    *,
    scale,
    layout="bshd",
    partition_size=None,
    soft_cap=None,
    k_scale=None,
    v_scale=None,
    interpret=None,
    config: DecodeConfig | None = None,
):
    """Decode attention over a paged cache (arguments already validated by ``ops``).

    q: [B, Hq, D]; k_cache, v_cache: ``bshd`` [num_pages, P, Hkv, D] or ``bhsd``
    [num_pages, Hkv, P, D], q's dtype or FP8; block_tables: i32[B, max_pages]; seq_lens:
    i32[B]; k_scale, v_scale: f32[Hkv] or None.
    Returns [B, Hq, D] in q's dtype. Raises NotImplementedError for the ``vllm`` layout,
    head dims that are not powers of two in [16, 256], mixed dtypes, or a platform
    that is neither a GPU nor interpret mode.
    """
    interpret = C.resolve_interpret(interpret)
    if config is not None and config.lowering == "mosaic_gpu":
        return _mosaic_gpu(
            q, k_cache, v_cache, block_tables, seq_lens, scale=scale, layout=layout,
            partition_size=partition_size, soft_cap=soft_cap, k_scale=k_scale,
            v_scale=v_scale, interpret=interpret,
        )  # fmt: skip
    geom = C.require(q, k_cache, v_cache, layout)
    return _paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        C.head_scales(k_scale, v_scale, geom.num_kv_heads),
        scale=float(scale),
        layout=layout,
        partition_size=partition_size,
        soft_cap=None if soft_cap is None else float(soft_cap),
        interpret=interpret,
        config=config or DecodeConfig(),
        scaled=k_scale is not None or v_scale is not None,
    )


def _mosaic_gpu(
    q, k_cache, v_cache, block_tables, seq_lens, *, scale, layout, partition_size, soft_cap,
    k_scale, v_scale, interpret,
):  # fmt: skip
    """``DecodeConfig(lowering="mosaic_gpu")``: :mod:`jaxattn.pallas.decode_mgpu`'s kernel."""
    from . import _mgpu, decode_mgpu

    partition_pages = _mgpu.partition_pages_of(
        partition_size, k_cache, v_cache, layout, interpret=interpret, what="decode"
    )
    return decode_mgpu.paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale=scale, layout=layout,
        soft_cap=soft_cap, partition_pages=partition_pages, interpret=interpret,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
