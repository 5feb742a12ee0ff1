"""Shared test utilities: the tolerance table and random input builders.

Every builder fills each page / slot that the op must not read with NaN, permutes the
page ids, and pads block tables and index arrays with entries that point at NaN pages,
so any read outside the valid range shows up as NaN in the output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from jaxattn import layout as L
from jaxattn import quant as Q
from jaxattn import reference as ref

# The Mosaic GPU decode's and cascade's merges below head_dim 128 are Triton kernels, custom
# calls jax.export has no compatibility guarantee for: exports that only check the lowering.
TRITON_MERGE = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


def export_cuda(fn, *args, triton: bool = True):
    """``jax.export`` of ``jax.jit(fn)`` for CUDA: the compiled lowering checked on any
    machine. ``triton``: Triton kernels allowed (TRITON_MERGE); False: the export fails on
    any Triton kernel in the program. Without a GPU the lowering's device is an abstract
    H200, since jax 0.11 lowers a Triton kernel against the device's compute capability (and
    finds none on a CPU)."""
    context = contextlib.nullcontext()
    if jax.default_backend() != "gpu":
        device = jax.sharding.AbstractDevice(
            device_kind="NVIDIA H200", num_cores=132, platform="gpu"
        )
        mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
        context = jax.sharding.use_abstract_mesh(mesh)
    with context:
        checks = TRITON_MERGE if triton else []
        return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)


# One table for every comparison against the spec or a float64 computation, keyed by the
# output dtype. An FP8 cache changes nothing here: kernels are compared with the spec on the
# same stored values and scales, so only the output's (and the kernels' P) rounding counts.
# The FP8 entries are the format's own precision (half an ulp at 1: 2^-4 for e4m3, 2^-3
# for e5m2), for comparing a quantised cache with the exact values it was written from.
TOLERANCES = {
    np.dtype(jnp.float32): dict(atol=1e-4, rtol=1e-4),
    np.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2),
    np.dtype(jnp.float16): dict(atol=5e-3, rtol=5e-3),
    np.dtype(jnp.float8_e4m3fn): dict(atol=2.0**-4, rtol=2.0**-4),
    np.dtype(jnp.float8_e5m2): dict(atol=2.0**-3, rtol=2.0**-3),
}

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)


def tol(dtype) -> dict:
    return dict(TOLERANCES[np.dtype(dtype)])


def assert_close(actual, expected, dtype=None):
    """Compare in float64 with the dtype's tolerance; NaN anywhere fails."""
    dtype = np.dtype(actual.dtype if dtype is None else dtype)
    a = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    e = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    assert not np.isnan(a).any(), "output contains NaN (an unread slot was read?)"
    assert not np.isnan(e).any(), "expected value contains NaN"
    np.testing.assert_allclose(a, e, **tol(dtype))


def random_normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)


# --- float64 numpy attention, independent of the spec --------------------------------


def naive_attention(q, k, v, *, scale=None, soft_cap=None, causal=True):
    """One request in float64 numpy. q [Lq, Hq, D], k/v [Lk, Hkv, D]; query i sees key j
    iff j <= i + (Lk - Lq) when causal, every key otherwise. Fully masked rows -> 0."""
    q, k, v = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (q, k, v))
    lq, hq, d = q.shape
    lk, hkv, _ = k.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros((lq, hq, d))
    for h in range(hq):
        kh, vh = k[:, h // (hq // hkv)], v[:, h // (hq // hkv)]
        for i in range(lq):
            n = min(lk, i + lk - lq + 1) if causal else lk
            if n <= 0:
                continue
            s = kh[:n] @ q[i, h] * scale
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            p = np.exp(s - s.max())
            out[i, h] = p @ vh[:n] / p.sum()
    return out


# --- paged decode inputs -------------------------------------------------------------


@dataclasses.dataclass
class PagedCase:
    q: jnp.ndarray  # [B, Hq, D]
    k_cache: jnp.ndarray
    v_cache: jnp.ndarray
    block_tables: jnp.ndarray  # int32 [B, max_pages]
    seq_lens: jnp.ndarray  # int32 [B]
    layout: str
    page_size: int
    dense_k: list  # per sequence [L, Hkv, D] (valid tokens only, the values stored)
    dense_v: list
    k_scale: jnp.ndarray | None = None  # f32 [Hkv] of an FP8 cache
    v_scale: jnp.ndarray | None = None

    @property
    def scales(self) -> dict:
        """The scale keyword arguments of the ops (none for an unscaled cache)."""
        return _scales(self)


def _scales(case) -> dict:
    if case.k_scale is None:
        return {}
    return dict(k_scale=case.k_scale, v_scale=case.v_scale)


def _stored(rng, x, kv_dtype, num_kv_heads, scaled: bool):
    """x (float32, NaN where nothing may be read, KV heads on axis -2) in ``kv_dtype``.

    An FP8 cache gets per-head scales from the data (``fp8_scales``); the heads are given
    magnitudes a few times apart first, so that a kernel applying one head's scale to
    another fails. Returns (stored array, values it stands for as float32, k_scale-like
    scale or None)."""
    if not Q.is_fp8(kv_dtype):
        stored = jnp.asarray(x, kv_dtype)
        return stored, stored, None
    mags = rng.uniform(0.25, 4.0, size=num_kv_heads).astype(np.float32)
    x = x * mags[:, None]
    scale = None
    if scaled:
        flat = jnp.asarray(x).reshape(-1, num_kv_heads, x.shape[-1])
        scale = Q.fp8_scales(flat, flat, kv_dtype)[0]
    stored = Q.quantize(jnp.asarray(x), kv_dtype, scale, head_axis=x.ndim - 2, saturate=True)
    return stored, Q.dequantize(stored, scale, head_axis=x.ndim - 2), scale


def make_paged_kv(
    rng,
    seq_lens,
    *,
    num_kv_heads,
    head_dim,
    page_size,
    layout="bshd",
    dtype=jnp.float32,
    kv_dtype=None,
    scaled=True,
    spare_pages=3,
    pad_pages=2,
    num_pages=None,
    max_pages=None,
):
    """A NaN-poisoned paged cache holding random K/V for sequences of ``seq_lens`` tokens.

    Returns (k_cache, v_cache, block_tables, dense_k, dense_v, k_scale, v_scale). Pages are
    a random permutation; ``spare_pages`` unused pages exist (NaN); each table has
    ``pad_pages`` extra entries pointing at NaN pages; slots past a sequence's end are NaN.
    ``num_pages`` / ``max_pages`` fix the shapes so that jitted code does not recompile.
    ``kv_dtype`` (default ``dtype``): an FP8 format stores the data quantised with per-head
    scales (``scaled``; else unscaled, 1.0); dense_k / dense_v are then the values stored.
    """
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    seq_lens = [int(n) for n in seq_lens]
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    used = sum(pages_per_seq)
    num_pages = used + spare_pages + 1 if num_pages is None else num_pages
    max_pages = max([*pages_per_seq, 1]) + pad_pages if max_pages is None else max_pages
    if num_pages <= used or max_pages < max([*pages_per_seq, 0]):
        raise ValueError("num_pages / max_pages are too small for these sequences")
    perm = rng.permutation(num_pages)
    data_pages, nan_pages = perm[:used], perm[used:]
    k = np.full((num_pages, page_size, num_kv_heads, head_dim), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    tables = rng.choice(nan_pages, size=(len(seq_lens), max_pages)).astype(np.int32)
    where, at = [], 0  # (sequence, page, rows) of every stored chunk
    for b, n in enumerate(seq_lens):
        kb = rng.standard_normal((n, num_kv_heads, head_dim), dtype=np.float32)
        vb = rng.standard_normal((n, num_kv_heads, head_dim), dtype=np.float32)
        for j in range(pages_per_seq[b]):
            page = data_pages[at]
            at += 1
            tables[b, j] = page
            chunk = slice(j * page_size, min(n, (j + 1) * page_size))
            m = chunk.stop - chunk.start
            k[page, :m], v[page, :m] = kb[chunk], vb[chunk]
            where.append((b, page, m))
    ks, kvals, k_scale = _stored(rng, k, kv_dtype, num_kv_heads, scaled)
    vs, vvals, v_scale = _stored(rng, v, kv_dtype, num_kv_heads, scaled)
    kvals, vvals = np.asarray(kvals, np.float32), np.asarray(vvals, np.float32)
    dense_k, dense_v = [[] for _ in seq_lens], [[] for _ in seq_lens]
    for b, page, m in where:
        dense_k[b].append(kvals[page, :m])
        dense_v[b].append(vvals[page, :m])
    empty = np.zeros((0, num_kv_heads, head_dim), np.float32)
    out_dtype = kv_dtype if not Q.is_fp8(kv_dtype) else jnp.float32
    dense_k = [jnp.asarray(np.concatenate([empty, *c]), out_dtype) for c in dense_k]
    dense_v = [jnp.asarray(np.concatenate([empty, *c]), out_dtype) for c in dense_v]
    kc, vc = L.convert(ks, vs, "bshd", layout)
    return kc, vc, jnp.asarray(tables), dense_k, dense_v, k_scale, v_scale


def make_paged_decode(
    rng,
    seq_lens,
    *,
    num_q_heads,
    num_kv_heads,
    head_dim,
    page_size,
    layout="bshd",
    dtype=jnp.float32,
    **kw,
) -> PagedCase:
    kc, vc, tables, dk, dv, ks, vs = make_paged_kv(
        rng,
        seq_lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        layout=layout,
        dtype=dtype,
        **kw,
    )
    q = random_normal(rng, (len(seq_lens), num_q_heads, head_dim), dtype)
    lens = jnp.asarray(seq_lens, jnp.int32)
    return PagedCase(q, kc, vc, tables, lens, layout, page_size, dk, dv, ks, vs)


# --- extend / prefix-prefill inputs ---------------------------------------------------


@dataclasses.dataclass
class ExtendCase:
    q: jnp.ndarray  # [Tq, Hq, D] (may have padding rows at the end)
    k_pool: jnp.ndarray  # [num_slots, Hkv, D]
    v_pool: jnp.ndarray
    qo_indptr: jnp.ndarray
    kv_indptr: jnp.ndarray
    kv_indices: jnp.ndarray  # may be longer than kv_indptr[-1] (padding)
    prefix_lens: list
    extend_lens: list
    dense_k: list  # per request [Lk, Hkv, D]
    dense_v: list
    k_scale: jnp.ndarray | None = None
    v_scale: jnp.ndarray | None = None

    @property
    def scales(self) -> dict:
        return _scales(self)


def make_extend(
    rng,
    prefix_lens,
    extend_lens,
    *,
    num_q_heads,
    num_kv_heads,
    head_dim,
    dtype=jnp.float32,
    kv_dtype=None,
    scaled=True,
    spare_slots=7,
    pad_rows=0,
    pad_indices=3,
    num_slots=None,
    num_rows=None,
    num_indices=None,
):
    """SGLang-form extend inputs over a NaN-poisoned token pool with shuffled slots.

    ``num_slots`` / ``num_rows`` / ``num_indices`` fix the pool size, the rows of q and the
    length of kv_indices (padding included) so that jitted code does not recompile.
    ``kv_dtype`` / ``scaled``: as in :func:`make_paged_kv`.
    """
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    lks = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    total = sum(lks)
    num_slots = total + spare_slots + 1 if num_slots is None else num_slots
    pad_indices = pad_indices if num_indices is None else num_indices - total
    pad_rows = pad_rows if num_rows is None else num_rows - sum(extend_lens)
    if num_slots <= total or pad_indices < 0 or pad_rows < 0:
        raise ValueError("num_slots / num_rows / num_indices are too small for these requests")
    perm = rng.permutation(num_slots).astype(np.int32)
    k = np.full((num_slots, num_kv_heads, head_dim), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    indices, at = [], 0
    for lk in lks:
        slots = perm[at : at + lk]
        at += lk
        kb = rng.standard_normal((lk, num_kv_heads, head_dim), dtype=np.float32)
        vb = rng.standard_normal((lk, num_kv_heads, head_dim), dtype=np.float32)
        k[slots], v[slots] = kb, vb
        indices.append(slots)
    ks, kvals, k_scale = _stored(rng, k, kv_dtype, num_kv_heads, scaled)
    vs, vvals, v_scale = _stored(rng, v, kv_dtype, num_kv_heads, scaled)
    dense = kv_dtype if not Q.is_fp8(kv_dtype) else jnp.float32
    dense_k = [jnp.asarray(kvals[sl], dense) for sl in indices]
    dense_v = [jnp.asarray(vvals[sl], dense) for sl in indices]
    nan_slots = perm[total:]
    indices.append(rng.choice(nan_slots, size=pad_indices).astype(np.int32))
    tq = sum(extend_lens)
    q = random_normal(rng, (tq + pad_rows, num_q_heads, head_dim), dtype)
    qo = np.concatenate([[0], np.cumsum(extend_lens)]).astype(np.int32)
    kv = np.concatenate([[0], np.cumsum(lks)]).astype(np.int32)
    return ExtendCase(
        q,
        ks,
        vs,
        jnp.asarray(qo),
        jnp.asarray(kv),
        jnp.asarray(np.concatenate(indices)),
        list(prefix_lens),
        list(extend_lens),
        dense_k,
        dense_v,
        k_scale,
        v_scale,
    )


@dataclasses.dataclass
class PrefillCase:
    q: jnp.ndarray
    k_cache: jnp.ndarray
    v_cache: jnp.ndarray
    cu_seqlens_q: jnp.ndarray
    block_tables: jnp.ndarray
    seq_lens: jnp.ndarray
    layout: str
    page_size: int
    prefix_lens: list
    extend_lens: list
    dense_k: list
    dense_v: list
    k_scale: jnp.ndarray | None = None
    v_scale: jnp.ndarray | None = None

    @property
    def scales(self) -> dict:
        return _scales(self)


def make_prefix_prefill(
    rng,
    prefix_lens,
    extend_lens,
    *,
    num_q_heads,
    num_kv_heads,
    head_dim,
    page_size,
    layout="bshd",
    dtype=jnp.float32,
    pad_rows=0,
    **kw,
) -> PrefillCase:
    lks = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    kc, vc, tables, dk, dv, ks, vs = make_paged_kv(
        rng,
        lks,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        layout=layout,
        dtype=dtype,
        **kw,
    )
    tq = sum(extend_lens)
    q = random_normal(rng, (tq + pad_rows, num_q_heads, head_dim), dtype)
    cu = np.concatenate([[0], np.cumsum(extend_lens)]).astype(np.int32)
    return PrefillCase(
        q,
        kc,
        vc,
        jnp.asarray(cu),
        tables,
        jnp.asarray(lks, jnp.int32),
        layout,
        page_size,
        list(prefix_lens),
        list(extend_lens),
        dk,
        dv,
        ks,
        vs,
    )


def prefill_as_extend(case: PrefillCase):
    """The same problem in SGLang form: (k_pool, v_pool, qo_indptr, kv_indptr, kv_indices)."""
    kb = L.to_bshd(case.k_cache, case.layout, "k")
    vb = L.to_bshd(case.v_cache, case.layout, "v")
    n, p, h, d = kb.shape
    tables = np.asarray(case.block_tables)
    lens = np.asarray(case.seq_lens)
    idx = [
        (tables[b, np.arange(lk) // p] * p + np.arange(lk) % p).astype(np.int32)
        for b, lk in enumerate(lens)
    ]
    kv = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return (
        kb.reshape(n * p, h, d),
        vb.reshape(n * p, h, d),
        case.cu_seqlens_q,
        jnp.asarray(kv),
        jnp.asarray(np.concatenate(idx)),
    )


def expected_decode(case: PagedCase, *, scale=None, soft_cap=None):
    """float64 [B, Hq, D] from the dense per-sequence K/V."""
    return np.stack(
        [
            naive_attention(
                case.q[b][None], case.dense_k[b], case.dense_v[b], scale=scale, soft_cap=soft_cap
            )[0]
            for b in range(case.q.shape[0])
        ]
    )


def expected_ragged(q, qo_indptr, dense_k, dense_v, *, scale=None, soft_cap=None, q_scale=None):
    """float64 [Tq, Hq, D] for packed queries; padding rows are zeros. ``q_scale``: q's
    values are float32(q) * q_scale (an FP8 q)."""
    qo = np.asarray(qo_indptr)
    if q_scale is not None:
        q = np.asarray(jnp.asarray(q, jnp.float32), np.float64) * float(q_scale)
    out = np.zeros(q.shape, np.float64)
    for b in range(len(qo) - 1):
        out[qo[b] : qo[b + 1]] = naive_attention(
            q[qo[b] : qo[b + 1]], dense_k[b], dense_v[b], scale=scale, soft_cap=soft_cap
        )
    return out


# --- calling an op on a case ------------------------------------------------------------


def call_decode(fn, case: PagedCase, **kw):
    """``fn(q, k_cache, v_cache, block_tables, seq_lens, layout=..., **kw)`` on a case."""
    return fn(
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        layout=case.layout,
        **{**case.scales, **kw},
    )


def call_extend(fn, case: ExtendCase, **kw):
    return fn(
        case.q,
        case.k_pool,
        case.v_pool,
        case.qo_indptr,
        case.kv_indptr,
        case.kv_indices,
        **{**case.scales, **kw},
    )


def call_prefill(fn, case: PrefillCase, **kw):
    return fn(
        case.q,
        case.k_cache,
        case.v_cache,
        case.cu_seqlens_q,
        case.block_tables,
        case.seq_lens,
        layout=case.layout,
        **{**case.scales, **kw},
    )


# The spec's ops compile themselves when called (one program per shape and settings:
# jaxattn.reference.attention._compiled).
spec_paged_attention = ref.paged_attention
spec_extend_attention = ref.extend_attention
spec_prefix_prefill = ref.prefix_prefill


def spec_decode(case: PagedCase, **kw):
    return call_decode(spec_paged_attention, case, **kw)


def spec_extend(case: ExtendCase, **kw):
    return call_extend(spec_extend_attention, case, **kw)


def spec_prefill(case: PrefillCase, **kw):
    return call_prefill(spec_prefix_prefill, case, **kw)


# --- cascade decode inputs ------------------------------------------------------------


@dataclasses.dataclass
class CascadeCase:
    q: jnp.ndarray  # [B, Hq, D]
    k_cache: jnp.ndarray
    v_cache: jnp.ndarray
    prefix_tables: jnp.ndarray  # int32 [G, max_prefix_pages]
    prefix_lens: jnp.ndarray  # int32 [G]
    prefix_of: jnp.ndarray  # int32 [B]
    block_tables: jnp.ndarray  # int32 [B, max_pages]: each request's own pages
    seq_lens: jnp.ndarray  # int32 [B]: own tokens
    layout: str
    page_size: int
    joined_tables: jnp.ndarray  # int32 [B, max_prefix_pages + max_pages]: prefix then own
    joined_lens: jnp.ndarray  # int32 [B]
    dense_k: list  # per request [prefix + own tokens, Hkv, D] (the values stored)
    dense_v: list
    k_scale: jnp.ndarray | None = None  # f32 [Hkv] of an FP8 cache
    v_scale: jnp.ndarray | None = None

    @property
    def scales(self) -> dict:
        return _scales(self)


# Cascade batches of the kernel tests: (prefix pages per prefix, prefix_of per request, own
# tokens per request).
CASCADE_BATCHES = {
    "mixed": ([5, 0, 3], [0, -1, 2, 0, 1, 0, -1, 2], [1, 17, 0, 33, 255, 3, 0, 64]),
    # 21 requests on one prefix: several tiles of it (4 requests a tile at block_m 16 and
    # GQA 4 in the Triton-lowered kernel; 16 and 8 at GQA 4 and 8 in the Mosaic GPU one)
    "shared": (
        [9],
        [0] * 21,
        [13, 0, 1, 7, 40, 2, 2, 9, 31, 5, 0, 16, 3, 8, 1, 1, 0, 29, 6, 4, 11],
    ),
    # no request shares a prefix, and one continues an empty prefix
    "private": ([2, 4, 0, 1], [3, 0, 2, 1], [5, 129, 0, 66]),
}


def make_cascade(
    rng,
    prefix_pages,
    prefix_of,
    own_lens,
    *,
    num_q_heads,
    num_kv_heads,
    head_dim,
    page_size,
    layout="bshd",
    dtype=jnp.float32,
    kv_dtype=None,
    scaled=True,
    spare_pages=3,
    pad_pages=2,
) -> CascadeCase:
    """A NaN-poisoned paged cache holding G prefixes of ``prefix_pages[g]`` full pages and,
    per request, ``own_lens[b]`` own tokens after the prefix ``prefix_of[b]`` (-1: none).

    Pages are a random permutation of the pool; every slot that no request reads (spare
    pages, slots past an own length) holds NaN, and both tables carry ``pad_pages`` extra
    entries pointing at NaN pages. The joined tables (prefix pages, then own pages) give
    the same problem to :func:`jaxattn.paged_attention`. ``kv_dtype`` / ``scaled``: as in
    :func:`make_paged_kv` (dense_k / dense_v are the values stored).
    """
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    prefix_pages = [int(n) for n in prefix_pages]
    own_lens = [int(n) for n in own_lens]
    prefix_of = [int(g) for g in prefix_of]
    if len(prefix_of) != len(own_lens):
        raise ValueError("prefix_of and own_lens must have one entry per request")
    own_pages = [-(-n // page_size) for n in own_lens]
    used = sum(prefix_pages) + sum(own_pages)
    num_pages = used + spare_pages + 1
    perm = rng.permutation(num_pages)
    data_pages, nan_pages = list(perm[:used]), perm[used:]
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k = np.full(shape, np.nan, np.float32)
    v = np.full_like(k, np.nan)

    def fill(n):
        """n tokens on fresh pages: their (page id, tokens on it) chunks."""
        pages = [data_pages.pop() for _ in range(-(-n // page_size))]
        kb = rng.standard_normal((n, num_kv_heads, head_dim), dtype=np.float32)
        vb = rng.standard_normal((n, num_kv_heads, head_dim), dtype=np.float32)
        chunks = []
        for j, page in enumerate(pages):
            chunk = slice(j * page_size, min(n, (j + 1) * page_size))
            k[page, : chunk.stop - chunk.start] = kb[chunk]
            v[page, : chunk.stop - chunk.start] = vb[chunk]
            chunks.append((page, chunk.stop - chunk.start))
        return chunks

    g_count, b_count = len(prefix_pages), len(own_lens)
    wp = max([*prefix_pages, 1]) + pad_pages
    w = max([*own_pages, 1]) + pad_pages
    prefix_tables = rng.choice(nan_pages, size=(g_count, wp)).astype(np.int32)
    tables = rng.choice(nan_pages, size=(b_count, w)).astype(np.int32)
    joined = rng.choice(nan_pages, size=(b_count, wp + w)).astype(np.int32)
    prefixes = []
    for g, n in enumerate(prefix_pages):
        chunks = fill(n * page_size)
        prefix_tables[g, :n] = [page for page, _ in chunks]
        prefixes.append(chunks)
    requests = []  # each request's joined (page, tokens) chunks
    for b, n in enumerate(own_lens):
        chunks = fill(n)
        tables[b, : len(chunks)] = [page for page, _ in chunks]
        chunks = (prefixes[prefix_of[b]] if prefix_of[b] >= 0 else []) + chunks
        joined[b, : len(chunks)] = [page for page, _ in chunks]
        requests.append(chunks)
    ks, kvals, k_scale = _stored(rng, k, kv_dtype, num_kv_heads, scaled)
    vs, vvals, v_scale = _stored(rng, v, kv_dtype, num_kv_heads, scaled)
    kvals, vvals = np.asarray(kvals, np.float32), np.asarray(vvals, np.float32)
    empty = np.zeros((0, num_kv_heads, head_dim), np.float32)
    dense = kv_dtype if not Q.is_fp8(kv_dtype) else jnp.float32
    dense_k = [
        jnp.asarray(np.concatenate([empty, *(kvals[p, :m] for p, m in c)]), dense) for c in requests
    ]
    dense_v = [
        jnp.asarray(np.concatenate([empty, *(vvals[p, :m] for p, m in c)]), dense) for c in requests
    ]
    kc, vc = L.convert(ks, vs, "bshd", layout)
    lp = [prefix_pages[g] * page_size if g >= 0 else 0 for g in prefix_of]
    return CascadeCase(
        q=random_normal(rng, (b_count, num_q_heads, head_dim), dtype),
        k_cache=kc,
        v_cache=vc,
        prefix_tables=jnp.asarray(prefix_tables),
        prefix_lens=jnp.asarray([n * page_size for n in prefix_pages], jnp.int32),
        prefix_of=jnp.asarray(prefix_of, jnp.int32),
        block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray(own_lens, jnp.int32),
        layout=layout,
        page_size=page_size,
        joined_tables=jnp.asarray(joined),
        joined_lens=jnp.asarray([a + b for a, b in zip(lp, own_lens, strict=True)], jnp.int32),
        dense_k=dense_k,
        dense_v=dense_v,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def call_cascade(fn, case: CascadeCase, **kw):
    """``fn(q, k_cache, v_cache, prefix_tables, prefix_lens, prefix_of, block_tables,
    seq_lens, layout=..., **kw)`` on a case."""
    return fn(
        case.q,
        case.k_cache,
        case.v_cache,
        case.prefix_tables,
        case.prefix_lens,
        case.prefix_of,
        case.block_tables,
        case.seq_lens,
        layout=case.layout,
        **{**case.scales, **kw},
    )


def expected_cascade(case: CascadeCase, *, scale=None, soft_cap=None):
    """float64 [B, Hq, D] from each request's joined dense K/V."""
    return np.stack(
        [
            naive_attention(
                case.q[b][None], case.dense_k[b], case.dense_v[b], scale=scale, soft_cap=soft_cap
            )[0]
            for b in range(case.q.shape[0])
        ]
    )


spec_cascade_attention = ref.cascade_attention


def spec_cascade(case: CascadeCase, **kw):
    return call_cascade(spec_cascade_attention, case, **kw)


def spec_joined(case: CascadeCase, **kw):
    """The spec's paged_attention over the joined tables."""
    return spec_paged_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.joined_tables,
        case.joined_lens,
        layout=case.layout,
        **{**case.scales, **kw},
    )


def mesh_of(n: int):
    """A mesh over the first ``n`` devices; the test is skipped where fewer are present (the
    CPU suite forces 8 host devices, a one-GPU machine has one)."""
    import pytest

    from jaxattn import sharding

    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, {jax.device_count()} present")
    return sharding.make_mesh(n)


def interpreter_device(interpret):
    """Where a Mosaic GPU case runs: interpreted, on the CPU device, on a GPU machine too.
    JAX's interpreter runs each warpgroup of a kernel (a copy warpgroup beside the compute
    one, the prefill's three) as a program of its own that waits for the others at the
    kernel's barriers; with those programs on the GPU they stalled (jax 0.11: the prefill's
    on an H200, two decode cases on an H100 past 200 s, where they take 2-6 s on a CPU)."""
    return jax.devices("cpu")[0] if interpret else jax.devices()[0]


def poisoned_pages(rng, lens, *, page, pages, width, hkv, d):
    """float32 bshd K/V pools ``[pages, page, hkv, d]`` and int32 block tables ``[len(lens),
    width]`` for sequences of ``lens`` tokens on permuted pages: NaN in every pool slot no
    sequence reads (pages no table names, the tails of last pages), and the table columns
    past each sequence naming a NaN page."""
    k = rng.standard_normal((pages, page, hkv, d)).astype(np.float32)
    v = rng.standard_normal((pages, page, hkv, d)).astype(np.float32)
    order = rng.permutation(pages)
    tables = np.zeros((len(lens), width), np.int32)
    used, at = set(), 0
    for b, n in enumerate(lens):
        need = -(-n // page)
        tables[b, :need] = order[at : at + need]
        at += need
        for j in range(need):
            used.add(int(tables[b, j]))
            tail = n - j * page
            if tail < page:
                k[tables[b, j], tail:] = np.nan
                v[tables[b, j], tail:] = np.nan
    spare = [p for p in range(pages) if p not in used]
    for b, n in enumerate(lens):
        tables[b, -(-n // page) :] = spare[b % len(spare)]
    for p in spare:
        k[p] = np.nan
        v[p] = np.nan
    return k, v, tables
