"""Cascade decode on Pallas' Mosaic GPU lowering (sm_90): both levels run the paged-decode
kernel of :mod:`jaxattn.pallas.decode_mgpu` (TMA page copies into a ring, wgmma), and one
exact merge follows. ``CascadeConfig(lowering="mosaic_gpu")`` names it; 16-bit caches (FP8
caches keep the Triton-lowered kernel of :mod:`jaxattn.pallas.cascade`).
``implementation="pallas"`` runs it by default on sm_90 for 16-bit caches at head_dim 128
(:func:`serves_by_default`).

* **Prefix level.** The requests that continue one prefix are cut into tiles of ``64 // G``
  requests (``G`` query heads a KV head; :func:`plan`, on the device). A tile's query heads
  of one KV head, request-major, are the 64 rows of the decode kernel's wgmma tile: to that
  kernel a tile is one sequence whose group is ``64 // G * G`` heads, whose block table is
  the prefix's and whose length is the prefix's. So each K/V tile of a prefix is read once
  per (tile, KV head, partition), not once per request, and S = q K^T and O += P V fill
  all 64 rows. The prefix's pages are cut into partitions so that the grid fills the GPU
  (:func:`jaxattn.pallas.decode_mgpu.default_partition_pages`).
* **Own level.** The same kernel over each request's own pages, as paged decode runs it,
  but every partition's state kept for the merge (none normalised in the kernel). Both
  levels are one launch: the prefix tiles' blocks first (the long ones), then the own
  blocks, which fill the multiprocessors as the prefix blocks leave them.
* **Merge.** A request's own parts and its tile's prefix parts (its rows of the tile) are
  weighed exactly (:func:`jaxattn.pallas.decode.combine_groups`: the gather of a request's
  rows fused into the sums, no concatenated workspace); a request with no prefix has no
  prefix part.

The memory-safety contract of the other cascade kernels (:mod:`jaxattn.reference.validity`):
a request or prefix the contract calls invalid reads nothing (its length taken as 0) and
the request's rows are NaN, so every page id a copy reads is in range. Steps' rows past a
length (page tails, pages past it) are masked and their V rows zeroed by the decode kernel.

Interpret mode (``interpret=True``, the CPU) runs the decode kernel interpreted (see
:mod:`jaxattn.pallas.decode_mgpu`); the compiled lowering is exported for CUDA on any
machine by ``tests/test_pallas_mgpu_cascade.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .. import layout as L
from .. import quant as Q
from ..reference import validity as _validity
from . import _common as C
from . import _mgpu as M
from . import decode_mgpu
from ._mgpu import ROWS, available, is_sm90
from .decode import combine_groups

__all__ = ["available", "cascade_attention", "is_sm90", "serves_by_default", "unsupported"]


def unsupported(q, k_cache, v_cache, layout) -> str | None:
    """Why :func:`cascade_attention` cannot serve these arguments, or None."""
    geom = L.get(layout, pool=True).geometry(k_cache, v_cache)
    per_step = M.steps_of(None, geom.page_size)
    why = decode_mgpu.unsupported(q, k_cache, v_cache, layout, pages_per_step=per_step)
    if why is None and Q.is_fp8(k_cache.dtype):
        why = "the Mosaic GPU cascade decode reads 16-bit caches (FP8: the Triton-lowered kernel)"
    return why


def serves_by_default(q, k_cache, v_cache, layout) -> bool:
    """Whether ``implementation="pallas"``'s cascade decode runs this kernel when no config
    names a lowering: compiled on an sm_90 GPU, a 16-bit cache in q's dtype and head_dim
    :data:`jaxattn.pallas.decode_mgpu.DEFAULT_HEAD_DIM` (the paged decode's rule; the
    cascade was measured there only). On an H200 (bf16, 32/8 heads, D=128, 64 requests;
    ``benchmarks/RESULTS.md``, round 37) it kept the GPU busy 54 / 59 / 294 us a call on the
    shared, mixed and private batches of ``bench_cascade.py``, the Triton-lowered kernel 79
    / 88 / 390 us."""
    if not M.compiled_16bit(q, k_cache) or q.shape[-1] != decode_mgpu.DEFAULT_HEAD_DIM:
        return False
    return unsupported(q, k_cache, v_cache, layout) is None


def plan(prefix_of, active, num_prefixes: int, per_tile: int, num_tiles: int):
    """The prefix tiles of a batch, on the device, as comparisons and sums (no sort, search
    or scatter: on a GPU a handful of small fusions). Request ``b`` (``active[b]``: valid,
    with a non-empty prefix) is the ``rank``-th active request on its prefix in batch order;
    the prefixes' tiles follow each other, ``ceil(n_g / per_tile)`` each. Returns each
    tile's prefix (-1: no tile) ``[num_tiles]``, each request's tile and slot ``[B]`` (0
    for a request in no tile), and each tile slot's request and whether it holds one
    ``[num_tiles, per_tile]``."""
    B = prefix_of.shape[0]
    key = jnp.where(active, prefix_of, num_prefixes)
    b = jnp.arange(B, dtype=jnp.int32)
    rank = jnp.sum((key[None, :] == key[:, None]) & (b[None, :] < b[:, None]), axis=1)
    g = jnp.arange(num_prefixes, dtype=jnp.int32)
    counts = jnp.sum(key[None, :] == g[:, None], axis=1)
    tiles = (counts + per_tile - 1) // per_tile
    start = jnp.sum(jnp.where(g[None, :] < g[:, None], tiles[None, :], 0), axis=1)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    hit = (start[None, :] <= t[:, None]) & (t[:, None] < (start + tiles)[None, :])
    tile_prefix = jnp.where(hit.any(axis=1), jnp.sum(jnp.where(hit, g[None, :], 0), axis=1), -1)
    kc = jnp.clip(key, 0, num_prefixes - 1)
    tile_of = jnp.where(active, start[kc] + rank // per_tile, 0)
    slot_of = jnp.where(active, rank % per_tile, 0)
    s = jnp.arange(per_tile, dtype=jnp.int32)
    at = (
        active[None, None, :]
        & (tile_of[None, None, :] == t[:, None, None])
        & (slot_of[None, None, :] == s[None, :, None])
    )
    who = jnp.sum(jnp.where(at, b[None, None, :], 0), axis=2)
    return tile_prefix, tile_of, slot_of, who, at.any(axis=2)


def tiles_bound(batch: int, num_prefixes: int, per_tile: int) -> int:
    """Prefix tiles a batch can need: every tile holds at least one request, and a prefix's
    requests fill all its tiles but the last."""
    return max(1, min(batch, -(-batch // per_tile) + num_prefixes))


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "layout",
        "soft_cap",
        "prefix_pages",
        "own_pages",
        "pages_per_step",
        "stages",
        "interpret",
    ),
)
def _cascade_attention(
    q,
    k_cache,
    v_cache,
    prefix_tables,
    prefix_lens,
    prefix_of,
    block_tables,
    seq_lens,
    *,
    scale,
    layout,
    soft_cap,
    prefix_pages,
    own_pages,
    pages_per_step,
    stages,
    interpret,
):
    B, Hq, D = q.shape
    geom = L.get(layout, pool=True).geometry(k_cache, v_cache)
    Hkv = geom.num_kv_heads
    G = Hq // Hkv
    NP = prefix_tables.shape[0]
    per_tile = ROWS // G
    T = tiles_bound(B, NP, per_tile)

    # The memory-safety contract, decided before the launches: what is invalid reads nothing.
    ok, prefix_len, own_len, req_prefix_len = _validity.cascade_read_lengths(
        prefix_tables, prefix_lens, prefix_of, block_tables, seq_lens, geom.page_size,
        geom.num_pages,
    )  # fmt: skip
    has_prefix = req_prefix_len > 0
    i32 = functools.partial(jnp.arange, dtype=jnp.int32)
    q4 = q.reshape(B, Hkv, G, D)
    kw = dict(
        layout=layout, scale=scale, soft_cap=soft_cap, pages_per_step=pages_per_step,
        stages=stages, interpret=interpret,
    )  # fmt: skip
    # The levels that have pages to read (None: a table of no prefix or no column), in one
    # launch: the prefix tiles' blocks first (the long ones), then the own level's.
    levels = []
    if prefix_pages is not None:
        tile_prefix, tile_of, slot_of, who, filled = plan(prefix_of, has_prefix, NP, per_tile, T)
        # Tile t's rows: slot s (request who[t, s]) x the group's heads, gathered straight
        # into the kernel's [T, Hkv, slots, G, D].
        q_prefix = q4[
            who[:, None, :, None], i32(Hkv)[None, :, None, None], i32(G)[None, None, None]
        ]
        q_prefix = jnp.where(filled[:, None, :, None, None], q_prefix, jnp.zeros((), q.dtype))
        tp = jnp.clip(tile_prefix, 0, NP - 1)
        levels.append((
            q_prefix.reshape(T, Hkv, per_tile * G, D), prefix_tables[tp],
            jnp.where(tile_prefix >= 0, prefix_len[tp], 0), prefix_pages,
        ))  # fmt: skip
    if own_pages is not None:
        levels.append((q4, block_tables, own_len, own_pages))
    states = []
    if levels:
        (qa, ta, la, pa), *second = levels
        states = decode_mgpu.partial_states(
            qa, k_cache, v_cache, ta, la, partition_pages=pa,
            second=second[0] if second else None, **kw,
        )  # fmt: skip
    groups = []
    if own_pages is not None:
        acc_o, ml_o = states[-2:]
        po = acc_o.shape[1]
        groups.append((
            acc_o.reshape(B, po, Hq, D),
            ml_o[:, :, :, 0, :G].reshape(B, po, Hq),
            ml_o[:, :, :, 1, :G].reshape(B, po, Hq),
        ))  # fmt: skip
    if prefix_pages is not None:
        # Each request's rows of its tile, gathered straight into the merge's [B, parts,
        # Hkv, G, ...]; a request without a prefix has no prefix part (its gathered rows are
        # another request's: tile 0, slot 0).
        acc_p, ml_p = states[:2]
        pp = acc_p.shape[1]
        ix = (
            tile_of[:, None, None, None],
            i32(pp)[None, :, None, None],
            i32(Hkv)[None, None, :, None],
        )
        rows = slot_of[:, None, None, None] * G + i32(G)[None, None, None, :]
        has = has_prefix[:, None, None]
        groups.append((
            jnp.where(has[..., None], acc_p[(*ix, rows)].reshape(B, pp, Hq, D), 0.0),
            jnp.where(has, ml_p[(*ix, 0, rows)].reshape(B, pp, Hq), C.M_INIT),
            jnp.where(has, ml_p[(*ix, 1, rows)].reshape(B, pp, Hq), 0.0),
        ))  # fmt: skip
    out = combine_groups(groups, q.dtype) if groups else jnp.zeros_like(q)
    return jnp.where(ok[:, None, None], out, jnp.nan).astype(q.dtype)


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
    prefix_pages: int | None = None,
    own_pages: int | None = None,
    pages_per_step: int | None = None,
    stages: int = 2,
    interpret: bool | None = None,
):
    """Cascade decode (arguments as :func:`jaxattn.cascade_attention` takes them, validated
    there) on the Mosaic GPU lowering: see the module docstring. ``prefix_pages`` /
    ``own_pages``: pages per partition of a prefix / of a request's own pages, multiples of
    ``pages_per_step`` (default: :func:`jaxattn.pallas.decode_mgpu.default_partition_pages`
    of each level's grid); ``pages_per_step``: pages a step copies, whole 64-row tiles
    (default: the fewest); ``stages``: steps in flight (>= 2). ``interpret``: None runs
    interpret mode exactly on the CPU. Raises ``NotImplementedError`` for what
    :func:`unsupported` refuses and for scales (16-bit caches only)."""
    geom = L.get(layout, pool=True).geometry(k_cache, v_cache)
    pages_per_step = M.steps_of(pages_per_step, geom.page_size)
    why = unsupported(q, k_cache, v_cache, layout)
    if k_scale is not None or v_scale is not None:
        why = why or "the Mosaic GPU cascade decode reads 16-bit caches and takes no k/v scales"
    scale, interpret = M.finish_args(why, stages, scale, geom.head_dim, interpret)
    B, Hq, _ = q.shape
    Hkv = geom.num_kv_heads
    T = tiles_bound(B, prefix_tables.shape[0], ROWS // (Hq // Hkv))
    widths = {"prefix_pages": prefix_tables.shape[1], "own_pages": block_tables.shape[1]}
    if not prefix_tables.shape[0]:
        widths["prefix_pages"] = 0
    sizes = {"prefix_pages": prefix_pages, "own_pages": own_pages}
    rows = {"prefix_pages": T, "own_pages": B}
    for name, value in sizes.items():
        if not widths[name]:  # a level of no pages: not launched
            sizes[name] = None
            continue
        sizes[name] = decode_mgpu.resolve_partition_pages(
            value,
            name=name,
            batch=rows[name],
            num_kv_heads=Hkv,
            table_width=widths[name],
            pages_per_step=pages_per_step,
        )
    return _cascade_attention(
        q,
        k_cache,
        v_cache,
        prefix_tables,
        prefix_lens,
        prefix_of,
        block_tables,
        seq_lens,
        scale=scale,
        layout=layout,
        soft_cap=None if soft_cap is None else float(soft_cap),
        pages_per_step=pages_per_step,
        stages=int(stages),
        interpret=interpret,
        **sizes,
    )
