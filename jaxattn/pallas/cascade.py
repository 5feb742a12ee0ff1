"""Cascade decode: requests that continue a shared prefix read it once per batch.

One ``pallas_call`` computes both levels, then an exact merge:

* **prefix programs**, grid items ``(split s, KV head, tile t)``. A tile holds up to
  ``block_m // group`` requests that continue one prefix; their query heads of one KV head
  (``block_m`` rows: request-major, then the heads of the GQA group) form the M side of one
  tensor-core dot against each K tile of the prefix's pages, and P V likewise. Each K/V
  tile of a prefix is so loaded once per (KV head, tile, split) instead of once per
  request: B requests on one prefix take ceil(B * group / block_m) tiles. Split ``s`` covers
  prefix tokens ``[s * chunk, (s + 1) * chunk)``, so a long prefix spreads over many
  programs; how many splits depends on how many tiles the batch really has, so it is
  decided on the device (:func:`jaxattn.backend.cascade_splits`), and the programs of
  the grid past tiles x splits do nothing.
* **own programs**, items ``(request, KV head, partition)``: the paged decode program of
  :mod:`jaxattn.pallas.decode` over the request's own pages (its GQA heads as the rows of
  one dot).

Each program writes its unnormalised accumulator and its (max, sum) in base 2, for every row
it owns, into one workspace ``[B + 1, own partitions + prefix splits, Hq, D]``; the merge
(:func:`jaxattn.pallas.decode.combine`) weighs the parts a request has. Row ``B`` of the
workspace takes the stores of a tile's padding rows (masked off on a GPU; the interpreter
evaluates masked stores too, and they must not land on a real row).

FP8 and scaled caches, as in :mod:`jaxattn.pallas.decode`: K and V tiles are loaded as stored
and widened to q's dtype (exact) before the dots; the per-KV-head scales are an operand
(f32 [2, Hkv]): k_scale multiplies a program's raw scores, v_scale its accumulator before the
store, so every part of a row carries the same factors and the merge stays exact.

The tiles are planned in the wrapper with ``jax.numpy`` (``prefix_of`` is traced): a stable
sort of the requests by prefix, the requests per prefix, their tiles. The memory-safety
contract (:mod:`jaxattn.reference.validity`) is split where each check is cheapest: the
checks that read no table (the prefix id, the continued prefix's length, the own length)
in the wrapper, where what fails reads nothing and is NaN in the merge; the page ids a
program reads by the program, which reads a bad one as page 0 and poisons its rows (NaN
max), so every page a program touches is in the pool. Nothing in the wrapper reads the
tables: in a model's step, whose layers offset them, XLA computes it once for all layers.
The merge (:func:`jaxattn.pallas.decode.combine_counted`) reads each request's written
parts only and makes NaN the requests whose checks failed: two kernels a layer.
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
from ..backend import CascadeGrid, cascade_chunk, cascade_grid, cascade_splits
from ..reference import validity as _validity
from . import _common as C
from ._triton import plgpu
from .decode import DecodeConfig, choose_partition_size, combine_counted


@dataclasses.dataclass(frozen=True)
class CascadeConfig:
    """Tiling of the cascade kernel.

    block_m: query rows of a prefix tile (requests x the group's heads); a power of two
      >= 16 (raised to the group when smaller). block_n: keys per inner step (None: 64,
      fewer for wide heads or float32 so that the stages fit in shared memory).
    prefix_blocks: prefix programs the split aims at (None: the rule of
      :func:`jaxattn.backend.cascade_grid`). partition_size: own tokens per partition (None:
      the decode kernel's rule).
    num_warps, num_stages: Triton launch and pipelining depth (one kernel serves both
      levels: four warps for the prefix level's 64-row dots).
    lowering: ``"triton"`` (this module's kernel, Pallas' Triton lowering) or
      ``"mosaic_gpu"`` (:mod:`jaxattn.pallas.cascade_mgpu`: both levels on the Mosaic GPU
      paged-decode kernel, sm_90 or Mosaic GPU's interpret mode, 16-bit caches; of the other
      fields it takes ``partition_size``, in whole pages).
    """

    block_m: int = 64
    block_n: int | None = None
    prefix_blocks: int | None = None
    partition_size: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    lowering: str = "triton"

    def __post_init__(self):
        if self.lowering not in ("triton", "mosaic_gpu"):
            raise ValueError(
                f"CascadeConfig.lowering must be 'triton' or 'mosaic_gpu', got {self.lowering!r}"
            )
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v is not None and (v < 16 or v & (v - 1)):
                raise ValueError(f"{name}={v} must be a power of two >= 16")
        for name in ("prefix_blocks", "partition_size"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name}={v} must be positive")


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static sizes of one call."""

    block_m: int
    block_n: int
    per_tile: int  # requests per prefix tile
    grid: CascadeGrid  # the prefix level's grid and workspace
    own_size: int  # own tokens per partition
    own_parts: int


def _plan(q, geom, prefix_tables, block_tables, config: CascadeConfig) -> _Plan:
    batch, num_q_heads, head_dim = q.shape
    group = num_q_heads // geom.num_kv_heads
    block_m = max(config.block_m, pl.next_power_of_2(group))
    block_n = config.block_n or C.kv_tile_rows(
        head_dim, q.dtype.itemsize, stage_bytes=32 * 1024, cap=64
    )
    own_capacity = block_tables.shape[1] * geom.page_size
    own_size = choose_partition_size(
        batch=batch,
        num_kv_heads=geom.num_kv_heads,
        group=group,
        max_context=own_capacity,
        partition_size=config.partition_size,
        config=DecodeConfig(min_programs=2 * C.num_sms()),
    )
    own_size = own_size or own_capacity
    own_parts = pl.cdiv(own_capacity, own_size)
    grid = cascade_grid(
        batch=batch,
        num_prefixes=prefix_tables.shape[0],
        per_tile=block_m // group,
        num_kv_heads=geom.num_kv_heads,
        prefix_capacity=prefix_tables.shape[1] * geom.page_size,
        own_blocks=batch * geom.num_kv_heads * own_parts,
        slots=2 * C.num_sms(),
        target=config.prefix_blocks,
    )
    return _Plan(block_m, block_n, block_m // group, grid, own_size, own_parts)


def plan_tiles(prefix_of, active, num_prefixes: int, per_tile: int, num_tiles: int):
    """The prefix tiles of a batch, on the device: tile t holds requests
    ``members[first[t] : first[t] + count[t]]`` that all continue prefix ``prefix[t]``
    (-1: no tile). ``active``: the requests that take part (valid, with a non-empty
    prefix). Tiles enumerate the prefixes in order, ceil(n_g / per_tile) each; requests
    within a prefix keep their batch order (a stable sort). Also returns the number of
    tiles."""
    key = jnp.where(active, prefix_of, num_prefixes)
    members = jnp.argsort(key, stable=True).astype(jnp.int32)
    counts = jnp.zeros((num_prefixes + 1,), jnp.int32).at[key].add(1)[:num_prefixes]
    first_of = jnp.cumsum(counts) - counts
    tiles_of = (counts + per_tile - 1) // per_tile
    ends = jnp.cumsum(tiles_of)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    # One fused comparison (the default method is a loop of small kernels on a GPU).
    g = jnp.searchsorted(ends, t, side="right", method="compare_all").astype(jnp.int32)
    live = g < num_prefixes
    gc = jnp.minimum(g, num_prefixes - 1)
    j = t - (ends[gc] - tiles_of[gc])
    first = jnp.where(live, first_of[gc] + j * per_tile, 0)
    count = jnp.where(live, jnp.minimum(per_tile, counts[gc] - j * per_tile), 0)
    return jnp.where(live, g, -1), first, count, members, ends[-1]


def _attend(
    q,
    table_ref,
    row,
    start,
    end,
    k_ref,
    v_ref,
    *,
    kv_head,
    k_scale,
    geom,
    layout,
    block_n,
    head_dim,
    scale,
    soft_cap,
    kv_dtype,
):
    """Online softmax of q [R, D] over tokens [start, end) of table row ``row``:
    (acc [R, D], m [R], l [R]) in base 2, unnormalised, the scores times the KV head's
    k_scale. A page id outside [0, num_pages) among those read is read as page 0 and makes
    m NaN (the memory-safety contract: the rows' merge is then NaN)."""

    def body(i, carry):
        state, bad = carry
        t = start + i * block_n + jnp.arange(block_n)
        valid = t < end
        page_size = geom.page_size
        page = plgpu.load(table_ref.at[row, lax.div(t, page_size)], mask=valid, other=0)
        out = valid & ((page < 0) | (page >= geom.num_pages))
        page = jnp.where(out, 0, page)
        rows = L.get(layout).row(page, lax.rem(t, page_size), kv_head, geom)
        k = C.widen(C.load_rows(k_ref, rows, valid, head_dim), q.dtype, kv_dtype)
        s = C.scores_base2(C.dot_nt(q, k) * k_scale, scale=scale, soft_cap=soft_cap)
        s = jnp.where(valid[None, :], s, -jnp.inf)
        v = C.widen(C.load_rows(v_ref, rows, valid, head_dim), q.dtype, kv_dtype)
        # (an int32 max: the Triton lowering has no reduce_or)
        return C.online_softmax_step(state, s, v), jnp.maximum(bad, jnp.max(out.astype(jnp.int32)))

    steps = pl.cdiv(jnp.maximum(end - start, 0), block_n)
    init = (C.init_state(q.shape[0], head_dim), jnp.zeros((), jnp.int32))
    (acc, m, l_sum), bad = lax.fori_loop(0, steps, body, init)
    return acc, jnp.where(bad > 0, jnp.nan, m), l_sum


def _cascade_kernel(
    splits_ref,
    tile_prefix_ref,
    tile_first_ref,
    tile_count_ref,
    members_ref,
    prefix_lens_ref,
    prefix_chunk_ref,
    prefix_tables_ref,
    seq_lens_ref,
    block_tables_ref,
    scales_ref,
    q_ref,
    k_ref,
    v_ref,
    acc_ref,
    m_ref,
    l_ref,
    *,
    batch: int,
    group: int,
    plan: _Plan,
    geom: L.CacheGeometry,
    layout: str,
    head_dim: int,
    scale: float,
    soft_cap: float | None,
    kv_dtype,
):
    hkv = geom.num_kv_heads
    item = pl.program_id(0)
    prefix_items = plan.grid.blocks_per_head * hkv
    d = jnp.arange(head_dim)
    attend = functools.partial(
        _attend,
        k_ref=k_ref,
        v_ref=v_ref,
        geom=geom,
        layout=layout,
        block_n=plan.block_n,
        head_dim=head_dim,
        scale=scale,
        soft_cap=soft_cap,
        kv_dtype=kv_dtype,
    )

    def attend_head(q, table_ref, row, start, end, kv_head):
        return attend(
            q, table_ref, row, start, end, kv_head=kv_head, k_scale=scales_ref[0, kv_head]
        )

    def store(req, part, heads, ok, state, kv_head):
        acc, m, l_sum = state
        acc = acc * scales_ref[1, kv_head]  # linear in the values: the merge keeps it
        plgpu.store(
            acc_ref.at[req[:, None], part, heads[:, None], d[None, :]], acc, mask=ok[:, None]
        )
        plgpu.store(m_ref.at[req, part, heads], m, mask=ok)
        plgpu.store(l_ref.at[req, part, heads], l_sum, mask=ok)

    @pl.when(item < prefix_items)
    def _prefix():
        # KV head fastest, so the programs that get a tile come first; program k of a KV
        # head takes tile k % tiles, split k // tiles (splits_ref: [tiles, splits]).
        kv_head = item % hkv
        k = item // hkv
        tiles = jnp.maximum(splits_ref[0], 1)
        t = jnp.minimum(k % tiles, plan.grid.tiles - 1)
        split = jnp.minimum(k // tiles, plan.grid.max_splits - 1)
        live = k < tiles * splits_ref[1]
        g = jnp.where(live, tile_prefix_ref[t], -1)
        count = jnp.where(g >= 0, tile_count_ref[t], 0)
        g_safe = jnp.maximum(g, 0)
        length = jnp.where(g >= 0, prefix_lens_ref[g_safe], 0)
        chunk = prefix_chunk_ref[g_safe]
        start = split * chunk
        end = jnp.minimum(length, start + chunk)
        r = jnp.arange(plan.block_m)
        slot = r // group
        heads = kv_head * group + r % group
        row_ok = slot < count
        idx = jnp.minimum(tile_first_ref[t] + slot, batch - 1)
        req = plgpu.load(members_ref.at[idx], mask=row_ok, other=0)
        q = plgpu.load(
            q_ref.at[req[:, None], heads[:, None], d[None, :]], mask=row_ok[:, None], other=0
        )
        state = attend_head(q, prefix_tables_ref, g_safe, start, end, kv_head)
        # Padding rows store to the spare row `batch`.
        ok = row_ok & (start < end)
        store(jnp.where(row_ok, req, batch), plan.own_parts + split, heads, ok, state, kv_head)

    @pl.when(item >= prefix_items)
    def _own():
        j = item - prefix_items
        part = j % plan.own_parts
        kv_head = (j // plan.own_parts) % hkv
        b = j // (plan.own_parts * hkv)
        length = seq_lens_ref[b]
        start = part * plan.own_size
        end = jnp.minimum(length, start + plan.own_size)
        rows = max(16, pl.next_power_of_2(group))
        gi = jnp.arange(rows)
        # Padding rows re-read the group's last head (in bounds) and are not stored.
        q = q_ref[b, (kv_head * group + jnp.minimum(gi, group - 1))[:, None], d[None, :]]
        state = attend_head(q, block_tables_ref, b, start, end, kv_head)
        ok = (gi < group) & (start < end)
        store(jnp.full(gi.shape, b), part, kv_head * group + gi, ok, state, kv_head)


@functools.partial(jax.jit, static_argnames=("scale", "layout", "soft_cap", "interpret", "config"))
def _cascade_attention(
    q,
    k_cache,
    v_cache,
    prefix_tables,
    prefix_lens,
    prefix_of,
    block_tables,
    seq_lens,
    scales,
    *,
    scale,
    layout,
    soft_cap,
    interpret,
    config,
):
    batch, num_q_heads, head_dim = q.shape
    geom = L.get(layout).geometry(k_cache, v_cache)
    hkv = geom.num_kv_heads
    group = num_q_heads // hkv
    num_prefixes = prefix_tables.shape[0]
    plan = _plan(q, geom, prefix_tables, block_tables, config)

    # The memory-safety contract, split where each check is cheapest (as the Mosaic GPU
    # cascade does): the checks that read no table before the launch (in an engine's step,
    # once for every layer: they read no layer's tables), what is invalid there reading
    # nothing; the page ids a program reads by the program, which poisons its rows.
    P = geom.page_size
    ok, prefix_len, own_len, req_prefix_len = _validity.cascade_unpaged_lengths(
        prefix_lens, prefix_of, seq_lens, prefix_tables.shape[1] * P, block_tables.shape[1] * P, P
    )
    scales = C.scales_operand(scales, geom.num_kv_heads)
    g = jnp.clip(prefix_of, 0, num_prefixes - 1)
    grid = plan.grid
    tile_prefix, tile_first, tile_count, members, num_tiles = plan_tiles(
        prefix_of, req_prefix_len > 0, num_prefixes, plan.per_tile, max(grid.tiles, 1)
    )
    splits = cascade_splits(
        num_tiles,
        target=grid.target,
        num_kv_heads=hkv,
        blocks_per_head=grid.blocks_per_head,
        max_splits=grid.max_splits,
    )
    prefix_chunk = cascade_chunk(prefix_len, splits)

    kernel = functools.partial(
        _cascade_kernel,
        batch=batch,
        group=group,
        plan=plan,
        geom=geom,
        layout=layout,
        head_dim=head_dim,
        scale=scale,
        soft_cap=soft_cap,
        kv_dtype=k_cache.dtype,
    )
    inputs = match_varying(
        jnp.stack([num_tiles, splits]).astype(jnp.int32),
        tile_prefix,
        tile_first,
        tile_count,
        members,
        prefix_len,
        prefix_chunk,
        prefix_tables,
        own_len,
        block_tables,
        scales,
        q,
        C.as_rows(k_cache),
        C.as_rows(v_cache),
    )
    parts = plan.own_parts + grid.max_splits
    out_shape = (
        out_struct((batch + 1, parts, num_q_heads, head_dim), jnp.float32, *inputs),
        out_struct((batch + 1, parts, num_q_heads), jnp.float32, *inputs),
        out_struct((batch + 1, parts, num_q_heads), jnp.float32, *inputs),
    )
    items = grid.blocks_per_head * hkv + batch * hkv * plan.own_parts
    acc, m, l_sum = pl.pallas_call(
        kernel,
        grid=(items,),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name="jaxattn_cascade_decode",
    )(*inputs)

    # The parts each request has (the others were never written): its own partitions that
    # start before its length, its prefix's splits that start before the prefix's length.
    own_n = (own_len + plan.own_size - 1) // plan.own_size
    req_chunk = jnp.maximum(prefix_chunk[g], 1)
    pre_n = jnp.where(req_prefix_len > 0, (req_prefix_len + req_chunk - 1) // req_chunk, 0)
    return combine_counted(
        acc, m, l_sum, own_n, pre_n, ok, q.dtype, own_parts=plan.own_parts, rows=batch,
        interpret=interpret,
    )  # fmt: skip


def heuristic_config(q, geom: L.CacheGeometry, prefix_tables, block_tables) -> CascadeConfig:
    """The default tiles with the prefix level's target and the own partition of these
    shapes filled in (see :func:`jaxattn.backend.cascade_grid`)."""
    plan = _plan(q, geom, prefix_tables, block_tables, CascadeConfig())
    return CascadeConfig(
        block_n=plan.block_n, prefix_blocks=plan.grid.target, partition_size=plan.own_size
    )


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
    scale,
    layout="bshd",
    soft_cap=None,
    k_scale=None,
    v_scale=None,
    interpret=None,
    config: CascadeConfig | None = None,
):
    """Cascade decode (arguments already validated by ``ops``; zero-size inputs answered
    there). q: [B, Hq, D]; k_cache, v_cache in q's dtype or FP8; prefix_tables i32[G, Wp],
    prefix_lens i32[G], prefix_of i32[B]; block_tables i32[B, W], seq_lens i32[B]; k_scale,
    v_scale: f32[Hkv] or None. Returns [B, Hq, D] in q's dtype."""
    interpret = C.resolve_interpret(interpret)
    if config is not None and config.lowering == "mosaic_gpu":
        return _mosaic_gpu(
            q, k_cache, v_cache, prefix_tables, prefix_lens, prefix_of, block_tables, seq_lens,
            scale=scale, layout=layout, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
            interpret=interpret, partition_size=config.partition_size,
        )  # fmt: skip
    geom = C.require(q, k_cache, v_cache, layout)
    return _cascade_attention(
        q,
        k_cache,
        v_cache,
        prefix_tables,
        prefix_lens,
        prefix_of,
        block_tables,
        seq_lens,
        C.head_scales(k_scale, v_scale, geom.num_kv_heads),
        scale=float(scale),
        layout=layout,
        soft_cap=None if soft_cap is None else float(soft_cap),
        interpret=interpret,
        config=config or CascadeConfig(),
    )


def _mosaic_gpu(*args, layout, partition_size, **kw):
    """``CascadeConfig(lowering="mosaic_gpu")``: :mod:`jaxattn.pallas.cascade_mgpu`."""
    from . import _mgpu, cascade_mgpu

    own_pages = _mgpu.partition_pages_of(
        partition_size, *args[1:3], layout, interpret=kw["interpret"], what="cascade decode"
    )
    return cascade_mgpu.cascade_attention(*args, layout=layout, own_pages=own_pages, **kw)
