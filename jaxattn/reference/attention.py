"""The spec: attention over paged and pooled KV caches in plain ``jax.numpy``.

Short and obviously right rather than fast: every logit is computed in float32 at
HIGHEST precision, masking is a ``where`` (never a multiply, so NaN in an unread slot
cannot leak into the result), and the output is cast to ``q``'s dtype at the end.

NaN semantics (every backend keeps them): NaN in ``q``, or in any K/V element a row
attends to, gives NaN in that row; a row with nothing to attend to gives 0;
:func:`merge_states` propagates NaN and +inf. Index metadata follows the memory-safety
contract of :mod:`jaxattn.reference.validity`: under ``jax.jit`` a sequence with an
out-of-range page id, kv index, length or indptr gets NaN in all its rows (never a clamped
or wrapped read that looks plausible), every other sequence is exact.

Shapes: B sequences, Hq query heads, Hkv KV heads (Hq % Hkv == 0), D head dim,
P page size. Query head ``h`` attends with KV head ``h // (Hq // Hkv)``.

Scaled (FP8) caches (:mod:`jaxattn.quant`): a stored K element of KV head ``h`` stands for
``float32(element) * k_scale[h]`` (V likewise with ``v_scale``); the spec dequantises the
keys and values it gathers to float32 first and then computes as above. The prefill ops
also take an FP8 ``q`` with ``q_scale`` (its value is ``float32(q) * q_scale``); their
output is then ``out_dtype`` (bfloat16 unless stated), otherwise q's dtype.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np

from .. import layout as _layout
from .. import quant as _quant
from . import validity as _validity

_HI = jax.lax.Precision.HIGHEST

# Keywords the spec reads as Python values (``float(scale)``, ``soft_cap is None``, ...).
_PYTHON_KEYWORDS = ("scale", "soft_cap", "partition_size", "layout", "out_dtype")


_ARRAYS = (jax.Array, np.ndarray)


def _static(value) -> bool:
    """A keyword's value is static in :func:`_compiled` unless it is an array or a
    container (a list of per-head scales, say), which is traced."""
    return not isinstance(value, _ARRAYS) and isinstance(value, Hashable)


def _compiled(function):
    """``function`` (one of the four ops) under ``jax.jit``: the keywords that are not arrays
    static, so that an eager call compiles one program per shape and settings instead of
    one per ``jax.numpy`` operation (inside a caller's jit it is inlined). A call that passes
    an array where the spec reads a Python value runs the function as written."""
    programs = {}

    @functools.wraps(function)
    def call(*args, **kwargs):
        if any(isinstance(kwargs.get(name), _ARRAYS) for name in _PYTHON_KEYWORDS):
            return function(*args, **kwargs)
        static = tuple(sorted(k for k, v in kwargs.items() if _static(v)))
        program = programs.get(static)
        if program is None:
            program = programs[static] = jax.jit(function, static_argnames=static)
        return program(*args, **kwargs)

    return call


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _logits(q, k, scale, soft_cap):
    """q [T, Hq, D], k [S, Hkv, D] -> float32 logits [T, Hq, S] (GQA by head grouping)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.astype(jnp.float32).reshape(t, hkv, hq // hkv, d)
    s = jnp.einsum("tkgd,skd->tkgs", qg, k.astype(jnp.float32), precision=_HI)
    s = s.reshape(t, hq, k.shape[0]) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return s


def _weighted_values(p, v):
    """p [T, Hq, S] float32, v [S, Hkv, D] -> [T, Hq, D] float32."""
    t, hq, s = p.shape
    hkv = v.shape[1]
    pg = p.reshape(t, hkv, hq // hkv, s)
    o = jnp.einsum("tkgs,skd->tkgd", pg, v.astype(jnp.float32), precision=_HI)
    return o.reshape(t, hq, v.shape[-1])


def attention_states(q, k, v, mask, *, scale, soft_cap=None):
    """Masked attention returning the softmax state.

    q [T, Hq, D], k/v [S, Hkv, D], mask bool [T, S] (True = visible).
    Returns ``(out [T, Hq, D] f32, m [T, Hq], l [T, Hq])`` where ``m`` is the max
    visible logit (``-inf`` for a fully masked row), ``l = sum exp(logit - m)`` and
    ``out`` the normalized output (zeros for a fully masked row).
    """
    if k.shape[0] == 0:  # no keys at all: every row is fully masked
        t, hq, d = q.shape
        empty = jnp.zeros((t, hq), jnp.float32)
        return jnp.zeros((t, hq, v.shape[-1]), jnp.float32), empty - jnp.inf, empty
    s = _logits(q, k, scale, soft_cap)
    s = jnp.where(mask[:, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask[:, None, :], jnp.exp(s - m_safe[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    # One product serves every row, so a masked weight (0) meets every value: 0 * NaN would
    # put another row's (or another request's) NaN value into this one. Non-finite values
    # are zeroed in the product and poison exactly the rows that attend to them.
    bad_v = ~jnp.isfinite(v.astype(jnp.float32))
    hits = jnp.einsum("ts,skd->tkd", mask.astype(jnp.float32), bad_v.astype(jnp.float32)) > 0
    o = _weighted_values(p, jnp.where(bad_v, 0, v))
    t, hq, d = o.shape
    hits = jnp.repeat(hits, hq // hits.shape[1], axis=1)
    o = jnp.where(hits, jnp.nan, o)
    # l == 0 only when nothing is visible; a NaN l (NaN in q or in a visible key or value)
    # stays NaN through the division.
    o = jnp.where(l[..., None] == 0, 0.0, o / jnp.where(l == 0, 1.0, l)[..., None])
    return o, m, l


def masked_attention(q, k, v, mask, *, scale, soft_cap=None):
    """Masked softmax attention, float32 result [T, Hq, D]."""
    return attention_states(q, k, v, mask, scale=scale, soft_cap=soft_cap)[0]


def merge_states(outs, lses):
    """Exact combine of partial attention results along axis 0.

    outs ``[N, ..., D]`` are normalized partial outputs, lses ``[N, ...]`` the natural-log
    log-sum-exp of the scaled logits each part saw (``-inf`` for a part that saw none).
    Returns ``(out [..., D] in outs' dtype, lse [...] float32)``; a position where every
    part is empty gives ``out = 0`` and ``lse = -inf``. A NaN lse (or a NaN output of a
    part with weight) gives NaN; a ``+inf`` lse gives ``lse = +inf`` and a NaN output (the
    weights are undefined). Zero parts merge to ``out = 0``, ``lse = -inf``.
    """
    lses = lses.astype(jnp.float32)
    if outs.shape[0] == 0:
        return jnp.zeros(outs.shape[1:], outs.dtype), jnp.full(lses.shape[1:], -jnp.inf)
    big = jnp.max(lses, axis=0)
    big_safe = jnp.where(jnp.isfinite(big), big, 0.0)
    w = jnp.where(jnp.isfinite(lses), jnp.exp(lses - big_safe[None]), 0.0)
    total = jnp.sum(w, axis=0)
    parts = jnp.where(w[..., None] > 0, outs.astype(jnp.float32), 0.0)
    out = jnp.sum(w[..., None] * parts, axis=0)
    out = jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
    lse = jnp.where(total > 0, big_safe + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    # jnp.max propagates NaN; +inf is a part of unbounded mass whose weight is undefined.
    poisoned = jnp.isnan(big) | (big == jnp.inf)
    out = jnp.where(poisoned[..., None], jnp.nan, out)
    lse = jnp.where(poisoned, big, lse)
    return out.astype(outs.dtype), lse


def _resolve_scale(scale, head_dim):
    return default_scale(head_dim) if scale is None else float(scale)


def _head_scale(scale, num_heads):
    """None, or a scalar / [num_heads] scale as float32 [num_heads]."""
    if scale is None:
        return None
    return jnp.broadcast_to(jnp.asarray(scale).astype(jnp.float32), (num_heads,))


def _values(x, scale):
    """Gathered cache data [..., Hkv, D] as the values it stands for: float32 times the
    per-head scale when the cache is FP8 or scaled, else unchanged."""
    if scale is None and not _quant.is_fp8(x.dtype):
        return x
    return _quant.dequantize(x, scale, head_axis=x.ndim - 2)


def _query(q, q_scale):
    """q's values: float32(q) * q_scale for a scaled (FP8) q, else q itself."""
    if q_scale is None and not _quant.is_fp8(q.dtype):
        return q
    q = q.astype(jnp.float32)
    return q if q_scale is None else q * jnp.asarray(q_scale).astype(jnp.float32)


def output_dtype(q_dtype, out_dtype=None):
    """The prefill ops' output dtype: ``out_dtype`` if given, else bfloat16 for an FP8 q,
    else q's dtype."""
    if out_dtype is not None:
        return jnp.dtype(out_dtype)
    return jnp.dtype(jnp.bfloat16) if _quant.is_fp8(q_dtype) else jnp.dtype(q_dtype)


def _sequence_slots(block_tables, seq_lens, page_size, num_pages):
    """Token slots [B, S] (S = max_pages * P), which of them a sequence reads [B, S], and
    the sequences whose metadata is valid [B].

    Unread positions, and every position of an invalid sequence, get slot 0, so that no
    garbage or out-of-range entry is ever an address; their data is masked out, and an
    invalid sequence's rows are replaced by NaN.
    """
    max_pages = block_tables.shape[1]
    ok = _validity.paged_valid(block_tables, seq_lens, page_size, num_pages)
    pos = jnp.arange(max_pages * page_size, dtype=jnp.int32)
    valid = (pos[None, :] < seq_lens[:, None]) & ok[:, None]
    pages = block_tables[:, pos // page_size]
    slots = jnp.where(valid, pages * page_size + (pos % page_size)[None, :], 0)
    return slots, valid, pos, ok


def _poison(out, bad_rows):
    """NaN in every row of ``out`` [T, ...] where ``bad_rows`` [T]."""
    return jnp.where(bad_rows.reshape(bad_rows.shape + (1,) * (out.ndim - 1)), jnp.nan, out)


@_compiled
def paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    *,
    scale=None,
    layout="bshd",
    partition_size=None,
    soft_cap=None,
    k_scale=None,
    v_scale=None,
):
    """Decode attention of one query token per sequence over a paged KV cache.

    q: [B, Hq, D]; k_cache, v_cache: a cache in ``layout``; block_tables: i32[B, max_pages];
    seq_lens: i32[B]; k_scale, v_scale: None, a scalar or f32[Hkv] (a stored element means
    ``float32(element) * scale[kv_head]``). Returns [B, Hq, D] in q's dtype.

    ``partition_size=None`` is one pass over the whole context (vLLM v1). An int splits
    the context into partitions of that many tokens (vLLM v2): each partition keeps its
    max ``m_p``, exp-sum ``l_p`` and normalized output ``O_p``; the combine weighs
    ``O_p`` by ``l_p * exp(m_p - M) / L`` with ``M = max m_p``, ``L = sum l_p exp(m_p - M)``.
    """
    geom = _layout.cache_geometry(k_cache, v_cache, layout)
    scale = _resolve_scale(scale, q.shape[-1])
    slots, valid, pos, ok = _sequence_slots(block_tables, seq_lens, geom.page_size, geom.num_pages)
    k = _layout.gather_tokens(k_cache, slots, layout, "k")  # [B, S, Hkv, D]
    v = _layout.gather_tokens(v_cache, slots, layout, "v")
    k = _values(k, _head_scale(k_scale, geom.num_kv_heads))
    v = _values(v, _head_scale(v_scale, geom.num_kv_heads))

    if partition_size is None:

        def one(qb, kb, vb, validb):
            return masked_attention(qb[None], kb, vb, validb[None], scale=scale, soft_cap=soft_cap)[
                0
            ]

        out = jax.vmap(one)(q, k, v, valid)
        return _poison(out, ~ok).astype(q.dtype)

    partition_size = int(partition_size)
    num_parts = -(-pos.shape[0] // partition_size)
    part_of = pos // partition_size

    def one_split(qb, kb, vb, validb):
        def part(p):
            o, m, l = attention_states(
                qb[None], kb, vb, (validb & (part_of == p))[None], scale=scale, soft_cap=soft_cap
            )
            return o[0], m[0], l[0]

        o, m, l = jax.vmap(part)(jnp.arange(num_parts))  # [N, Hq, D], [N, Hq], [N, Hq]
        big = jnp.max(m, axis=0)
        big_safe = jnp.where(jnp.isfinite(big), big, 0.0)
        # l_p * exp(m_p - M); an empty partition weighs 0, a NaN one stays NaN.
        lw = jnp.where(l == 0, 0.0, l * jnp.exp(m - big_safe[None]))
        total = jnp.sum(lw, axis=0)
        num = jnp.sum(lw[..., None] * o, axis=0)
        # total == 0: nothing visible; NaN (from a NaN partition) stays NaN.
        return jnp.where(
            total[..., None] == 0, 0.0, num / jnp.where(total == 0, 1.0, total)[..., None]
        )

    return _poison(jax.vmap(one_split)(q, k, v, valid), ~ok).astype(q.dtype)


def _paged_states(
    q, k_cache, v_cache, block_tables, seq_lens, *, layout, scale, soft_cap, k_scale, v_scale
):
    """Attention of each sequence over its pages as a mergeable state: (out [B, Hq, D]
    float32, normalized; lse [B, Hq], the natural-log log-sum-exp of the visible scaled
    logits, -inf for an empty sequence), over the dequantised keys and values of a scaled
    cache. An invalid sequence attends to nothing here; the caller poisons it."""
    geom = _layout.cache_geometry(k_cache, v_cache, layout)
    slots, valid, _, _ = _sequence_slots(block_tables, seq_lens, geom.page_size, geom.num_pages)
    k = _layout.gather_tokens(k_cache, slots, layout, "k")  # [B, S, Hkv, D]
    v = _layout.gather_tokens(v_cache, slots, layout, "v")
    k = _values(k, _head_scale(k_scale, geom.num_kv_heads))
    v = _values(v, _head_scale(v_scale, geom.num_kv_heads))

    def one(qb, kb, vb, validb):
        o, m, l = attention_states(qb[None], kb, vb, validb[None], scale=scale, soft_cap=soft_cap)
        return o[0], m[0], l[0]

    o, m, l = jax.vmap(one)(q, k, v, valid)
    # l == 0: nothing visible; a NaN l (NaN in q or a key) stays NaN through the log.
    lse = jnp.where(l == 0, -jnp.inf, m + jnp.log(jnp.where(l == 0, 1.0, l)))
    return o, lse


@_compiled
def cascade_attention(
    q,
    k_cache,
    v_cache,
    prefix_tables,
    prefix_lens,
    prefix_of,
    block_tables,
    seq_lens,
    *,
    scale=None,
    layout="bshd",
    soft_cap=None,
    k_scale=None,
    v_scale=None,
):
    """Decode over a paged cache where requests continue shared prefixes.

    q: [B, Hq, D]; prefix_tables: i32[G, max_prefix_pages] and prefix_lens: i32[G]
    (multiples of the page size) describe G prefixes; prefix_of: i32[B] names the prefix
    request b continues (-1: none); block_tables: i32[B, max_pages] and seq_lens: i32[B]
    are each request's own pages and tokens after its prefix. Returns [B, Hq, D] in q's
    dtype, equal to :func:`paged_attention` over the joined table (the prefix's pages, then
    the request's own) of ``prefix_lens[prefix_of[b]] + seq_lens[b]`` tokens. k_scale,
    v_scale: per-KV-head scales of a scaled (FP8) cache, as in :func:`paged_attention`.

    The composition of two attentions merged by :func:`merge_states`: each request over
    its prefix, each over its own tokens. Validity (:func:`validity.cascade_valid`): an
    invalid prefix poisons the requests that continue it, an invalid ``prefix_of`` or own
    table the request itself.
    """
    geom = _layout.cache_geometry(k_cache, v_cache, layout)
    scale = _resolve_scale(scale, q.shape[-1])
    num_prefixes = prefix_tables.shape[0]
    ok = _validity.cascade_valid(
        prefix_tables,
        prefix_lens,
        prefix_of,
        block_tables,
        seq_lens,
        geom.page_size,
        geom.num_pages,
    )
    kw = dict(layout=layout, scale=scale, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale)
    own = _paged_states(q, k_cache, v_cache, block_tables, seq_lens, **kw)
    if num_prefixes == 0:
        outs, lses = own[0][None], own[1][None]
    else:
        has = (prefix_of >= 0) & (prefix_of < num_prefixes)
        g = jnp.clip(prefix_of, 0, num_prefixes - 1)
        # Each request's copy of its prefix's table; a request without one reads nothing.
        lens = jnp.where(has, prefix_lens[g], 0)
        pre = _paged_states(q, k_cache, v_cache, prefix_tables[g], lens, **kw)
        outs, lses = jnp.stack([pre[0], own[0]]), jnp.stack([pre[1], own[1]])
    out, _ = merge_states(outs, lses)
    return _poison(out, ~ok).astype(q.dtype)


def _ragged_rows(indptr, total_rows):
    """For rows 0..total_rows-1 of a packed batch: (request id, row index within request,
    row is real). Rows past indptr[-1] are padding."""
    rows = jnp.arange(total_rows, dtype=jnp.int32)
    req = jnp.searchsorted(indptr, rows, side="right").astype(jnp.int32) - 1
    req = jnp.clip(req, 0, indptr.shape[0] - 2)
    real = rows < indptr[-1]
    return req, rows - indptr[req], real


@_compiled
def extend_attention(
    q,
    k_cache,
    v_cache,
    qo_indptr,
    kv_indptr,
    kv_indices,
    *,
    scale=None,
    soft_cap=None,
    k_scale=None,
    v_scale=None,
    q_scale=None,
    out_dtype=None,
):
    """Prefix-cached prefill over a token pool (SGLang's extend attention).

    q: [Tq, Hq, D] packed by qo_indptr i32[B+1]; k_cache, v_cache: [num_slots, Hkv, D];
    kv_indices: i32[>= kv_indptr[-1]] lists per request the slots of its cached prefix
    followed by the slots of its new tokens. Row i of request b sees key j iff
    ``j <= i + (Lk_b - Lq_b)`` (and ``j < Lk_b``). k_scale / v_scale: per-KV-head scales
    of the cache; q_scale: q's scale (an FP8 q). Returns [Tq, Hq, D] in
    :func:`output_dtype`; rows past qo_indptr[-1] are zeros.
    """
    scale = _resolve_scale(scale, q.shape[-1])
    tq, nk = q.shape[0], kv_indices.shape[0]
    lq = qo_indptr[1:] - qo_indptr[:-1]
    lk = kv_indptr[1:] - kv_indptr[:-1]
    problems = _validity.ragged_problems(
        qo_indptr,
        tq,
        lk,
        q_name="qo_indptr",
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        num_slots=k_cache.shape[0],
    )
    structural, ok = _validity.ragged_valid(problems, lq.shape[0])
    q_req, q_row, q_real = _ragged_rows(qo_indptr, tq)
    k_req, k_pos, k_real = _ragged_rows(kv_indptr, nk)
    shift = (lk - lq)[q_req]
    k_real = k_real & ok[k_req]  # an invalid request's indices are never addresses
    mask = (
        q_real[:, None]
        & k_real[None, :]
        & (q_req[:, None] == k_req[None, :])
        & (k_pos[None, :] <= q_row[:, None] + shift[:, None])
    )
    slots = jnp.where(k_real, kv_indices, 0)
    hkv = k_cache.shape[1]
    k = _values(k_cache[slots], _head_scale(k_scale, hkv))
    v = _values(v_cache[slots], _head_scale(v_scale, hkv))
    out = masked_attention(_query(q, q_scale), k, v, mask, scale=scale, soft_cap=soft_cap)
    bad_rows = _validity.ragged_row_mask(qo_indptr, tq, structural, ok)
    return _poison(out, bad_rows).astype(output_dtype(q.dtype, out_dtype))


@_compiled
def prefix_prefill(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    block_tables,
    seq_lens,
    *,
    scale=None,
    layout="bshd",
    soft_cap=None,
    k_scale=None,
    v_scale=None,
    q_scale=None,
    out_dtype=None,
):
    """Prefix-cached prefill over a paged KV cache (the paged form of extend).

    q: [Tq, Hq, D] packed by cu_seqlens_q i32[B+1]; block_tables i32[B, max_pages];
    seq_lens i32[B] are total KV lengths (prefix + new), whose K/V are already in the
    cache. Row i of request b sees token j iff ``j <= i + (seq_lens[b] - Lq_b)``.
    k_scale / v_scale / q_scale / out_dtype as in :func:`extend_attention`. Returns
    [Tq, Hq, D] in :func:`output_dtype`; rows past cu_seqlens_q[-1] are zeros.
    """
    geom = _layout.cache_geometry(k_cache, v_cache, layout)
    scale = _resolve_scale(scale, q.shape[-1])
    b = block_tables.shape[0]
    slots, valid, pos, paged_ok = _sequence_slots(
        block_tables, seq_lens, geom.page_size, geom.num_pages
    )
    s = pos.shape[0]
    k = _layout.gather_tokens(k_cache, slots.reshape(-1), layout, "k")  # [B*S, Hkv, D]
    v = _layout.gather_tokens(v_cache, slots.reshape(-1), layout, "v")
    k = _values(k, _head_scale(k_scale, geom.num_kv_heads))
    v = _values(v, _head_scale(v_scale, geom.num_kv_heads))
    q_req, q_row, q_real = _ragged_rows(cu_seqlens_q, q.shape[0])
    lq = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    shift = (seq_lens - lq)[q_req]
    k_req = jnp.repeat(jnp.arange(b, dtype=jnp.int32), s)
    k_pos = jnp.tile(pos, b)
    problems = _validity.ragged_problems(cu_seqlens_q, q.shape[0], seq_lens, q_name="cu_seqlens_q")
    structural, ok = _validity.ragged_valid(problems, b)
    ok = ok & paged_ok
    mask = (
        q_real[:, None]
        & (valid & ok[:, None]).reshape(-1)[None, :]
        & (q_req[:, None] == k_req[None, :])
        & (k_pos[None, :] <= q_row[:, None] + shift[:, None])
    )
    out = masked_attention(_query(q, q_scale), k, v, mask, scale=scale, soft_cap=soft_cap)
    bad_rows = _validity.ragged_row_mask(cu_seqlens_q, q.shape[0], structural, ok)
    return _poison(out, bad_rows).astype(output_dtype(q.dtype, out_dtype))
