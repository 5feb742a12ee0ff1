"""Cascade decode on Pallas' Mosaic GPU lowering (sm_90): both levels run the paged-decode
kernel of :mod:`jaxattn.pallas.decode_mgpu` (TMA page copies into a ring, wgmma), and one
exact merge follows. ``CascadeConfig(lowering="mosaic_gpu")`` names it; 16-bit caches, and
FP8 caches with per-KV-head scales (each step widened to float16 in shared memory, q moved
to float16, as the decode kernel does; not timed: ``implementation="pallas"`` keeps the
Triton-lowered kernel of :mod:`jaxattn.pallas.cascade` for them where JAX has it).
``implementation="pallas"`` runs it by default on sm_90 for 16-bit caches at head_dim 128
(:func:`serves_by_default`).

* **Prefix level.** The requests that continue one prefix are cut into tiles of ``64 // G``
  requests (``G`` query heads a KV head; :func:`plan`, on the device). A tile's query heads
  of one KV head, request-major, are the 64 rows of the decode kernel's wgmma tile: to that
  kernel a tile is one sequence whose group is ``64 // G * G`` heads, whose block table is
  the prefix's and whose length is the prefix's. So each K/V tile of a prefix is read once
  per (tile, KV head, partition), not once per request, and S = q K^T and O += P V fill
  all 64 rows. The prefix's pages are cut into partitions so that the prefix tiles' blocks
  are about one a multiprocessor (:func:`prefix_partition_pages`).
* **Own level.** The same kernel over each request's own pages, as paged decode runs it,
  but every partition's state kept for the merge (none normalised in the kernel). Both
  levels are one launch: the prefix tiles' blocks first (the long ones), then the own
  blocks, which fill the multiprocessors as the prefix blocks leave them.
* **Merge.** One kernel weighs a request's own parts and its rows of its tile's prefix parts
  exactly, reading both levels' states in place (no gather, no workspace); a request with no
  prefix has no prefix part. At head_dim 128 it is the Mosaic GPU one
  (:func:`jaxattn.pallas.merge_mgpu.merge_levels`), so the op launches no Triton kernel;
  elsewhere, or with ``merge="triton"``, the Triton-lowered
  :func:`jaxattn.pallas.decode.combine_levels`; on a JAX without that lowering, or with
  ``merge="xla"``, the same merge in jnp (:func:`jaxattn.pallas.decode.combine_levels_jnp`).

The memory-safety contract of the other cascade kernels (:mod:`jaxattn.reference.validity`),
split where each check is cheapest: the checks that read no table (the prefix id, the
continued prefix's length, the own length) per request before the launch
(:func:`jaxattn.reference.validity.cascade_unpaged_valid`), the lengths and page ids a block
reads by the decode kernel itself, which poisons a sequence or a prefix tile that fails them
(NaN parts; a bad page id is read as page 0, so every copy stays in the pool). The merge
makes a request NaN when its checks fail or any of its parts is NaN. Steps' rows past a
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
from ..reference import validity as _validity
from . import _common as C
from . import _mgpu as M
from . import decode_mgpu, merge_mgpu
from ._mgpu import ROWS, available, is_sm90
from .decode import combine_levels, combine_levels_jnp

__all__ = ["available", "cascade_attention", "is_sm90", "serves_by_default", "unsupported"]


def unsupported(q, k_cache, v_cache, layout, *, scaled: bool = False) -> str | None:
    """Why :func:`cascade_attention` cannot serve these arguments (``scaled``: with k/v
    scales), or None."""
    geom = L.get(layout, pool=True).geometry(k_cache, v_cache)
    per_step = M.steps_of(None, geom.page_size)
    return M.unsupported(
        q, k_cache, v_cache, layout, pages_per_step=per_step, what="cascade decode",
        scaled=scaled,
    )  # fmt: skip


def serves_by_default(q, k_cache, v_cache, layout) -> bool:
    """Whether ``implementation="pallas"``'s cascade decode runs this kernel when no config
    names a lowering: compiled on an sm_90 GPU, a 16-bit cache in q's dtype and head_dim
    :data:`jaxattn.pallas.decode_mgpu.DEFAULT_HEAD_DIM` (the paged decode's rule; the
    cascade was measured there only). On an H200 (bf16, 32/8 heads, D=128, 64 requests;
    ``benchmarks/RESULTS.md``, rounds 37 and 38) it kept the GPU busy 45 / 50 / 275 us a call
    on the shared, mixed and private batches of ``bench_cascade.py``, the Triton-lowered
    kernel 79 / 88 / 390 us."""
    if not M.compiled_16bit(q, k_cache) or q.shape[-1] != decode_mgpu.DEFAULT_HEAD_DIM:
        return False
    return unsupported(q, k_cache, v_cache, layout) is None


def plan(prefix_of, active, num_prefixes: int, per_tile: int, num_tiles: int):
    """The prefix tiles of a batch, on the device, as comparisons and sums (no sort, search
    or scatter): three reductions, each a kernel on a GPU, with the checks and gathers
    around them fused in. Request ``b`` (``active[b]``: valid, with a non-empty prefix) is
    the ``rank``-th active request on its prefix in batch order; the prefixes' tiles follow
    each other, ``ceil(n_g / per_tile)`` each, so the tiles before request ``b``'s are those
    led (slot 0) by an active request of a lower prefix. Returns each tile's prefix (-1: no
    tile) ``[num_tiles]``, each request's tile and slot ``[B]`` (0 for a request in no
    tile), and each tile slot's request and whether it holds one ``[num_tiles,
    per_tile]``."""
    B = prefix_of.shape[0]
    key = jnp.where(active, prefix_of, num_prefixes)
    b = jnp.arange(B, dtype=jnp.int32)
    rank = jnp.sum((key[None, :] == key[:, None]) & (b[None, :] < b[:, None]), axis=1)
    leads = active & (rank % per_tile == 0)
    before = jnp.sum(leads[None, :] & (key[None, :] < key[:, None]), axis=1)
    tile_of = jnp.where(active, before + rank // per_tile, 0)
    slot_of = jnp.where(active, rank % per_tile, 0)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    s = jnp.arange(per_tile, dtype=jnp.int32)
    at = (
        active[None, None, :]
        & (tile_of[None, None, :] == t[:, None, None])
        & (slot_of[None, None, :] == s[None, :, None])
    )
    who = jnp.sum(jnp.where(at, b[None, None, :], 0), axis=2)
    filled = at.any(axis=2)
    # A tile's first slot holds its leading request, whose prefix is the tile's.
    tile_prefix = jnp.where(filled[:, 0], key[who[:, 0]], -1)
    return tile_prefix, tile_of, slot_of, who, filled


def tiles_bound(batch: int, num_prefixes: int, per_tile: int) -> int:
    """Prefix tiles a batch can need (the most, over every way its requests can continue its
    prefixes): a prefix's requests fill all its tiles but the last, which holds at least one,
    so ``k`` prefixes with requests hold at most ``k + (batch - k) // per_tile`` tiles, the
    most at ``k = min(num_prefixes, batch)``. No launch has a tile that no batch can fill."""
    k = min(num_prefixes, batch)
    return max(1, k + (batch - k) // per_tile) if k else 1


def prefix_partition_pages(tiles: int, num_kv_heads: int, table_width: int, pages_per_step: int):
    """The prefix level's default pages a partition: about one block a multiprocessor for
    the prefix tiles (``round(SMs / (tiles x KV heads))`` partitions, whole steps), the
    other block slot of each left to the own level's short blocks, which follow them in the
    launch. On an H200 (``bench_cascade.py``'s batches, round 38) the shared batch's GPU time
    a call was 51.0 / 48.6 / 45.0 / 48.3 / 58.0 us at prefix partitions of 32 (the paged
    decode's rule) / 44 / 64 / 88 / 128 pages, the mixed batch's 54.1 / 55.9 / 54.2 / 50.1
    / 60.5 us: this rule takes 64 and 88."""
    parts = max(1, round(C.num_sms() / (tiles * num_kv_heads)))
    size = -(-table_width // parts)
    whole = -(-table_width // pages_per_step) * pages_per_step
    return min(whole, -(-size // pages_per_step) * pages_per_step)


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
        "merge",
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
    k_scale,
    v_scale,
    *,
    scale,
    layout,
    soft_cap,
    prefix_pages,
    own_pages,
    pages_per_step,
    stages,
    interpret,
    merge,
):
    B, Hq, D = q.shape
    geom = L.get(layout, pool=True).geometry(k_cache, v_cache)
    Hkv = geom.num_kv_heads
    G = Hq // Hkv
    NP = prefix_tables.shape[0]
    per_tile = ROWS // G
    T = tiles_bound(B, NP, per_tile)

    # The memory-safety contract: the checks that read no table here, per request (its rows
    # NaN in the merge); the lengths and page ids a block reads are the kernel's (a bad one
    # poisons the sequence or the tile: NaN parts, page 0 read instead).
    P = geom.page_size
    ok = _validity.cascade_unpaged_valid(
        prefix_lens, prefix_of, seq_lens, prefix_tables.shape[1] * P, block_tables.shape[1] * P, P
    )
    has_prefix = ok & (prefix_of >= 0)
    if NP:
        has_prefix &= prefix_lens[jnp.clip(prefix_of, 0, NP - 1)] > 0
    q4 = q.reshape(B, Hkv, G, D)
    kw = dict(
        layout=layout, scale=scale, soft_cap=soft_cap, pages_per_step=pages_per_step,
        stages=stages, interpret=interpret,
    )  # fmt: skip
    # The levels that have pages to read (None: a table of no prefix or no column), in one
    # launch: the prefix tiles' blocks first (the long ones), then the own level's.
    levels = []
    if prefix_pages is not None:
        tile_prefix, tile_of, slot_of, who, _ = plan(prefix_of, has_prefix, NP, per_tile, T)
        tp = jnp.clip(tile_prefix, 0, NP - 1)
        # Tile t's rows: slot s (request who[t, s]; an empty slot's rows are request 0's,
        # computed and never read) x the group's heads, copied by the kernel's blocks.
        levels.append((
            q4, prefix_tables[tp], jnp.where(tile_prefix >= 0, prefix_lens[tp], 0),
            prefix_pages,
        ))  # fmt: skip
    if own_pages is not None:
        levels.append((q4, block_tables, seq_lens, own_pages))
    if not levels:
        return jnp.where(ok[:, None, None], jnp.zeros_like(q), jnp.nan).astype(q.dtype)
    (qa, ta, la, pa), *second = levels
    states = decode_mgpu.partial_states(
        qa, k_cache, v_cache, ta, la, partition_pages=pa,
        second=second[0] if second else None,
        rows=who if prefix_pages is not None else None, k_scale=k_scale, v_scale=v_scale, **kw,
    )  # fmt: skip
    # One merge kernel reads both levels' states in place: a request's own parts, then its
    # rows of its tile's prefix parts (none for a request without a prefix).
    merged = []
    if own_pages is not None:
        merged.append((False, *states[-2:]))
    if prefix_pages is not None:
        merged.append((True, *states[:2]))
    else:
        tile_of = slot_of = jnp.zeros((B,), jnp.int32)
    index = (tile_of, slot_of, has_prefix, ok)
    merge_fn = {
        "mosaic_gpu": merge_mgpu.merge_levels, "triton": combine_levels, "xla": combine_levels_jnp
    }[merge]  # fmt: skip
    return merge_fn(merged, index, q.dtype, group=G, interpret=interpret)


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
    merge: str | None = None,
):
    """Cascade decode (arguments as :func:`jaxattn.cascade_attention` takes them, validated
    there) on the Mosaic GPU lowering: see the module docstring. ``prefix_pages`` /
    ``own_pages``: pages per partition of a prefix / of a request's own pages, multiples of
    ``pages_per_step`` (default: :func:`prefix_partition_pages` for the prefix level,
    :func:`jaxattn.pallas.decode_mgpu.default_partition_pages` of its grid for the own
    level); ``pages_per_step``: pages a step copies, whole 64-row tiles
    (default: the fewest); ``stages``: steps in flight (>= 2). ``merge``: the merge kernel's
    lowering (:func:`jaxattn.pallas.decode_mgpu.merge_lowering`). ``interpret``: None runs
    interpret mode exactly on the CPU. ``k_scale`` / ``v_scale``: an FP8 cache's scales
    (None, a scalar or f32 ``[Hkv]``). Raises ``NotImplementedError`` for what
    :func:`unsupported` refuses and for scales with a 16-bit cache."""
    geom = L.get(layout, pool=True).geometry(k_cache, v_cache)
    pages_per_step = M.steps_of(pages_per_step, geom.page_size)
    scaled = k_scale is not None or v_scale is not None
    why = unsupported(q, k_cache, v_cache, layout, scaled=scaled)
    scale, interpret = M.finish_args(why, stages, scale, geom.head_dim, interpret)
    B, Hq, _ = q.shape
    Hkv = geom.num_kv_heads
    merge = decode_mgpu.merge_lowering(
        merge, geom.head_dim, num_q_heads=Hq, group=Hq // Hkv, tiled=min(prefix_tables.shape) > 0
    )
    T = tiles_bound(B, prefix_tables.shape[0], ROWS // (Hq // Hkv))
    widths = {"prefix_pages": prefix_tables.shape[1], "own_pages": block_tables.shape[1]}
    if not prefix_tables.shape[0]:
        widths["prefix_pages"] = 0
    sizes = {"prefix_pages": prefix_pages, "own_pages": own_pages}
    rows = {"prefix_pages": T, "own_pages": B}
    if prefix_pages is None and widths["prefix_pages"]:
        sizes["prefix_pages"] = prefix_partition_pages(
            T, Hkv, widths["prefix_pages"], pages_per_step
        )
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
        k_scale,
        v_scale,
        scale=scale,
        layout=layout,
        soft_cap=None if soft_cap is None else float(soft_cap),
        pages_per_step=pages_per_step,
        stages=int(stages),
        interpret=interpret,
        merge=merge,
        **sizes,
    )
