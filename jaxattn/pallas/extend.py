"""Extend (prefix-cached prefill) attention over a token pool or a paged cache.

Queries exist only for the new tokens of each request; keys are the request's cached
prefix followed by its new tokens, and new token i sees key j iff
``j <= i + (Lk - Lq)`` (the causal mask shifted by the prefix length ``Lp = Lk - Lq``).

Work is cut into *tiles*: ``block_q`` query rows of one request, each row a
(new token, query head) pair. With ``heads_per_tile = GH > 1`` a tile holds
``block_q // GH`` tokens times GH heads of one GQA group, so every K/V tile loaded
serves GH heads; that pays when requests bring few new tokens (a tile of 128 rows
would otherwise be mostly padding). The ragged batch is flattened on the device into
a list of (request, tile) pairs, heaviest tile of each request first, so the grid
holds no per-request padding beyond one partial tile.

Per tile with new tokens ``[t0, t1)`` the key loop runs in two stages (seed 3.4):

* stage 1, keys ``[0, Lp + t0)`` in whole ``block_n`` blocks: visible to every row of
  the tile (the cached prefix and the new tokens before the tile), so no mask at all;
* stage 2, from there up to ``Lp + t1``: the causal triangle, masked per element. The
  loop stops at the tile's last row, so blocks above the diagonal are never loaded.

FP8 caches: the key tiles are widened to q's dtype (exact) as they are loaded; the per-KV-head
scales are an operand (f32 [2, Hkv]): k_scale multiplies the raw scores, v_scale the output.
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
from ..reference import validity as _validity
from . import _common as C
from ._triton import plgpu


@dataclasses.dataclass(frozen=True)
class ExtendConfig:
    """Tiling of the extend kernel.

    block_q: query rows per tile (tokens x packed heads); block_n: keys per step.
    heads_per_tile: query heads of one GQA group packed into a tile; None packs the
      group (up to 8 heads, keeping at least 16 tokens per tile) when its size is a
      power of two, else 1. On an H200 packing 4 heads was faster than not packing
      both for long extends (8 x (2048 + 512): +2 to +5% at equal tiles) and, by
      construction, for short ones, where unpacked tiles are mostly padding.
    lowering: ``"triton"`` (the kernel above, Pallas' Triton lowering) or ``"mosaic_gpu"``
      (:mod:`jaxattn.pallas.prefill_mgpu`, sm_90 or Mosaic GPU's interpret mode; prefix
      prefill over a paged cache, 16-bit or FP8, bshd/bhsd; the other fields do not apply to
      it). With no config, ``prefix_prefill`` takes the Mosaic GPU kernel on sm_90 for 16-bit
      caches it serves (:func:`jaxattn.pallas.prefill_mgpu.serves_by_default`) and this
      kernel otherwise (the token-pool ``extend_attention``, FP8 caches, other GPUs, the CPU
      interpreter). On an H200 the Mosaic GPU kernel ran 8 x (2048 + 512), 1 x (0 + 8192),
      4 x (0 + 4096) and 32 x (1000 + 24) at 470 / 531 / 481 / 188 TFLOP/s against this
      kernel's 298 / 382 / 346 / 85 in the same run (``benchmarks/RESULTS.md``, round 32).
    """

    block_q: int = 128
    block_n: int = 64
    heads_per_tile: int | None = None
    num_warps: int = 8
    num_stages: int = 2
    lowering: str = "triton"

    def __post_init__(self):
        if self.lowering not in ("triton", "mosaic_gpu"):
            raise ValueError(
                f"ExtendConfig.lowering must be 'triton' or 'mosaic_gpu', got {self.lowering!r}"
            )
        for name in ("block_q", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two >= 16")


def _pick_heads_per_tile(config: ExtendConfig, group: int) -> int:
    if config.heads_per_tile is not None:
        gh = config.heads_per_tile
        if gh < 1 or group % gh or gh & (gh - 1) or config.block_q % gh:
            raise ValueError(
                f"heads_per_tile={gh} must be a power of two dividing the group size {group} "
                f"and block_q={config.block_q}"
            )
        return gh
    if group > 1 and not group & (group - 1):
        return max(1, min(group, 8, config.block_q // 16))
    return 1


def _tile_map(q_bounds, num_tiles: int, tokens_per_tile: int):
    """(request, tile index within the request) for each grid tile.

    q_bounds: i32[R + 1] row boundaries of R query segments. Tiles past the last one
    get request R (the kernel skips them). Within a request the tiles run last first:
    the last tile sees the most keys, and starting the long ones early evens out the
    tail of the grid.
    """
    lens = q_bounds[1:] - q_bounds[:-1]
    counts = (lens + tokens_per_tile - 1) // tokens_per_tile
    ends = jnp.cumsum(counts)
    i = jnp.arange(num_tiles, dtype=jnp.int32)
    req = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)
    req_c = jnp.minimum(req, lens.shape[0] - 1)
    local = counts[req_c] - 1 - (i - (ends[req_c] - counts[req_c]))
    return req, local.astype(jnp.int32)


def _extend_kernel(
    tile_req_ref,
    tile_local_ref,
    q_bounds_ref,
    kv_meta_ref,
    kv_index_ref,
    scales_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    *,
    mode: str,
    batch: int,
    group: int,
    heads_per_tile: int,
    block_q: int,
    block_n: int,
    head_dim: int,
    geom: L.CacheGeometry,
    layout: str,
    scale: float,
    soft_cap: float | None,
    scaled: bool,
    kv_dtype,
):
    lay = L.get(layout, pool=True)
    page_size = geom.page_size
    head_block, tile = pl.program_id(0), pl.program_id(1)
    req = tile_req_ref[tile]

    # Request `batch` is the run of padding rows after the last request: it has no
    # keys, so its tiles only write zeros.
    @pl.when(req <= batch)
    def _():
        local = tile_local_ref[tile]
        q_start = q_bounds_ref[req]
        lq = q_bounds_ref[req + 1] - q_start
        real = req < batch
        req_c = jnp.minimum(req, batch - 1)
        # The memory-safety contract (jaxattn.reference.validity) is checked before the
        # launch, in one pass over the indptrs, lengths and index entries, and reaches the
        # kernel as the key count: an invalid request has none, so its loops run no step
        # (it reads nothing) and its rows come out 0 / 0 = NaN; a valid request's entries
        # all lie in the pool, so the unmasked loads of stage 1 stay inside every buffer.
        # Nothing else in the kernel knows about the checks (a flag tested in the kernel
        # cost 3-5% on an H200: benchmarks/RESULTS.md).
        kv_start = kv_meta_ref[0, req_c]
        lk = jnp.where(real, kv_meta_ref[1, req_c], 0)
        lp = lk - lq

        tokens = block_q // heads_per_tile
        t0 = local * tokens
        t1 = jnp.minimum(lq, t0 + tokens)
        r = jnp.arange(block_q)
        t_rel = t0 + r // heads_per_tile
        row_ok = t_rel < lq
        q_rows = q_start + t_rel
        heads = head_block * heads_per_tile + r % heads_per_tile
        kv_head = (head_block * heads_per_tile) // group
        # Unscaled caches (both scales None) skip the multiplies: a static choice.
        if scaled:
            k_scale, v_scale = scales_ref[0, kv_head], scales_ref[1, kv_head]
        d = jnp.arange(head_dim)
        q = plgpu.load(
            q_ref.at[q_rows[:, None], heads[:, None], d[None, :]], mask=row_ok[:, None], other=0
        )

        def entries(j, valid):
            """Index entries of keys j (their slots, or the pages holding them); lanes not
            `valid` read nothing (None: every lane is inside the request's entries)."""
            if mode == "pool":
                at = kv_index_ref.at[kv_start + j]
            else:
                at = kv_index_ref.at[req_c, lax.div(j, page_size)]
            return at[...] if valid is None else plgpu.load(at, mask=valid, other=0)

        def key_rows(j, valid):
            off = 0 if mode == "pool" else lax.rem(j, page_size)
            return lay.row(entries(j, valid), off, kv_head, geom)

        def stage1(i, carry):
            j = i * block_n + jnp.arange(block_n)
            rows = key_rows(j, None)
            d_ = d[None, :]
            k = C.widen(k_ref[rows[:, None], d_], q.dtype, kv_dtype)
            s = C.dot_nt(q, k)
            s = C.scores_base2(s * k_scale if scaled else s, scale=scale, soft_cap=soft_cap)
            v = C.widen(v_ref[rows[:, None], d_], q.dtype, kv_dtype)
            return C.online_softmax_step(carry, s, v)

        # Keys [0, Lp + t0) are visible to every row of the tile.
        shared = jnp.clip(lp + t0, 0, lk)
        n1 = shared // block_n
        carry = lax.fori_loop(0, n1, stage1, C.init_state(block_q, head_dim))

        k_end = jnp.clip(lp + t1, 0, lk)
        limit = lp + t_rel  # last key each row may see

        def stage2(i, carry):
            j = n1 * block_n + i * block_n + jnp.arange(block_n)
            valid = j < k_end
            rows = key_rows(j, valid)
            k = C.widen(C.load_rows(k_ref, rows, valid, head_dim), q.dtype, kv_dtype)
            s = C.dot_nt(q, k)
            s = C.scores_base2(s * k_scale if scaled else s, scale=scale, soft_cap=soft_cap)
            s = jnp.where(valid[None, :] & (j[None, :] <= limit[:, None]), s, -jnp.inf)
            v = C.widen(C.load_rows(v_ref, rows, valid, head_dim), q.dtype, kv_dtype)
            return C.online_softmax_step(carry, s, v)

        n2 = pl.cdiv(jnp.maximum(k_end - n1 * block_n, 0), block_n)
        acc, _, l_sum = lax.fori_loop(0, n2, stage2, carry)

        # Every row of a request sees at least its own key, so l_sum > 0 unless the request
        # was skipped as invalid (NaN) or the tile is padding (zeros: the denominator 1).
        acc = acc * v_scale if scaled else acc
        out = (acc / jnp.where(real, l_sum, 1.0)[:, None]).astype(o_ref.dtype)
        plgpu.store(
            o_ref.at[q_rows[:, None], heads[:, None], d[None, :]], out, mask=row_ok[:, None]
        )


def _run(
    q,
    k_rows,
    v_rows,
    q_bounds_in,
    kv_meta,
    kv_index,
    scales,
    problems,
    structural,
    *,
    mode,
    geom,
    layout,
    scale,
    soft_cap,
    interpret,
    config,
    scaled,
    kv_dtype,
):
    num_tokens, num_q_heads, head_dim = q.shape
    batch = q_bounds_in.shape[0] - 1
    group = num_q_heads // geom.num_kv_heads
    gh = _pick_heads_per_tile(config, group)
    tokens = config.block_q // gh
    # The memory-safety contract: with a broken indptr every row belongs to one invalid
    # request (all NaN); otherwise each request's rows are clipped to q and an invalid
    # request is skipped by the kernel. Segment `batch` holds the rows of q after the last
    # request (padding, zeros).
    structural, ok = _validity.ragged_valid(problems, batch, structural)
    everything = jnp.concatenate(
        [jnp.zeros((1,), jnp.int32), jnp.full((batch,), num_tokens, jnp.int32)]
    )
    q_bounds_in = jnp.where(structural, jnp.clip(q_bounds_in, 0, num_tokens), everything)
    q_bounds = jnp.concatenate([q_bounds_in, jnp.full((1,), num_tokens, jnp.int32)])
    # (first key entry, key count) per request; an invalid request gets no keys.
    kv_starts, kv_lens = kv_meta
    kv_meta = jnp.stack([kv_starts, jnp.where(ok, kv_lens, 0)]).astype(jnp.int32)
    scales = C.scales_operand(scales, geom.num_kv_heads)
    num_tiles = pl.cdiv(num_tokens, tokens) + batch + 1
    tile_req, tile_local = _tile_map(q_bounds, num_tiles, tokens)
    kernel = functools.partial(
        _extend_kernel,
        mode=mode,
        batch=batch,
        group=group,
        heads_per_tile=gh,
        block_q=config.block_q,
        block_n=config.block_n,
        head_dim=head_dim,
        geom=geom,
        layout=layout,
        scale=scale,
        soft_cap=soft_cap,
        scaled=scaled,
        kv_dtype=kv_dtype,
    )
    inputs = match_varying(
        tile_req, tile_local, q_bounds, kv_meta, kv_index, scales, q, k_rows, v_rows
    )
    call = pl.pallas_call(
        kernel,
        grid=(num_q_heads // gh, num_tiles),
        out_shape=out_struct(q.shape, q.dtype, *inputs),
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name=f"jaxattn_extend_{mode}",
    )
    return call(*inputs)


_STATIC = ("scale", "soft_cap", "interpret", "config", "scaled")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _extend_pool(
    q,
    k_cache,
    v_cache,
    qo_indptr,
    kv_indptr,
    kv_indices,
    scales,
    *,
    scale,
    soft_cap,
    interpret,
    config,
    scaled,
):
    # The whole contract before the launch: B-sized checks and one fused [B, N] reduction
    # over the slots (jaxattn.reference.validity).
    problems = _validity.ragged_problems(
        qo_indptr,
        q.shape[0],
        kv_indptr[1:] - kv_indptr[:-1],
        q_name="qo_indptr",
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        num_slots=k_cache.shape[0],
    )
    return _run(
        q,
        C.as_rows(k_cache),
        C.as_rows(v_cache),
        qo_indptr,
        (kv_indptr[:-1], kv_indptr[1:] - kv_indptr[:-1]),
        kv_indices,
        scales,
        problems,
        _validity.indptrs_ok(qo_indptr, kv_indptr),
        mode="pool",
        geom=L.get(L.POOL, pool=True).geometry(k_cache, v_cache),
        layout=L.POOL,
        scale=scale,
        soft_cap=soft_cap,
        interpret=interpret,
        config=config,
        scaled=scaled,
        kv_dtype=k_cache.dtype,
    )


@functools.partial(jax.jit, static_argnames=(*_STATIC, "layout"))
def _prefill_paged(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    block_tables,
    seq_lens,
    scales,
    *,
    scale,
    layout,
    soft_cap,
    interpret,
    config,
    scaled,
):
    geom = L.get(layout).geometry(k_cache, v_cache)
    problems = _validity.ragged_problems(
        cu_seqlens_q, q.shape[0], seq_lens, q_name="cu_seqlens_q"
    ) + _validity.paged_problems(
        block_tables,
        seq_lens,
        geom.page_size,
        geom.num_pages,
    )
    return _run(
        q,
        C.as_rows(k_cache),
        C.as_rows(v_cache),
        cu_seqlens_q,
        (jnp.zeros_like(seq_lens), seq_lens),
        block_tables,
        scales,
        problems,
        _validity.indptrs_ok(cu_seqlens_q),
        mode="paged",
        geom=geom,
        layout=layout,
        scale=scale,
        soft_cap=soft_cap,
        interpret=interpret,
        config=config,
        scaled=scaled,
        kv_dtype=k_cache.dtype,
    )


def _prepare(q, k_cache, v_cache, layout, interpret):
    interpret = C.resolve_interpret(interpret)
    C.require(q, k_cache, v_cache, layout)
    return interpret


def _default_config(
    head_dim: int, itemsize: int, group: int, tokens_per_request: float
) -> ExtendConfig:
    """Tiles per head size, dtype, GQA group and the mean new tokens per request.

    16-bit, D <= 128, from sweeps on an H200 (bf16, D=128, Hq/Hkv=32/8,
    ``benchmarks/bench_extend.py --sweep``): long extends (>= 128 new tokens a request
    on average, e.g. 8 x (2048 + 512)) take 256-row tiles of 128 tokens x 2 heads,
    64 keys a step, 8 warps, 3 stages; short ones (32 x (1000 + 24)) take 128-row tiles
    of 32 tokens x 4 heads, so that few rows are padding; unpacked groups take 128 x 128
    tiles with 8 warps. Otherwise (float32 or wider heads) a stage of K and V is kept
    within 64 KiB and two stages deep, so the tiles fit in shared memory.
    """
    packed = group > 1 and not group & (group - 1)
    if itemsize <= 2 and head_dim <= 128:
        if packed and tokens_per_request >= 128:
            return ExtendConfig(
                block_q=256, block_n=64, heads_per_tile=2, num_warps=8, num_stages=3
            )
        if packed:
            return ExtendConfig(block_q=128, block_n=64, num_warps=4, num_stages=3)
        return ExtendConfig(block_q=128, block_n=128, num_warps=8, num_stages=3)
    return ExtendConfig(
        block_q=128 if head_dim <= 128 else 64,
        block_n=C.kv_tile_rows(head_dim, itemsize, stage_bytes=64 * 1024, cap=64),
        num_warps=4 if head_dim <= 64 else 8,
        num_stages=2,
    )


def heuristic_config(q, group: int, q_bounds) -> ExtendConfig:
    """The configuration for these queries: :func:`_default_config` of the head size,
    dtype, GQA group and the mean new tokens per request (the static row count of q over
    the batch)."""
    tokens_per_request = q.shape[0] / max(q_bounds.shape[0] - 1, 1)
    return _default_config(q.shape[-1], q.dtype.itemsize, group, tokens_per_request)


def _config_for(config, q, group, q_bounds):
    return heuristic_config(q, group, q_bounds) if config is None else config


def extend_attention(
    q,
    k_cache,
    v_cache,
    qo_indptr,
    kv_indptr,
    kv_indices,
    *,
    scale,
    soft_cap=None,
    k_scale=None,
    v_scale=None,
    interpret=None,
    config: ExtendConfig | None = None,
):
    """SGLang-form extend (arguments already validated by ``ops``).

    q: [Tq, Hq, D] packed by qo_indptr i32[B+1] (rows past qo_indptr[-1] come back as 0);
    k_cache, v_cache: [num_slots, Hkv, D]; kv_indptr: i32[B+1]; kv_indices: the slots of
    each request's prefix then new tokens. Returns [Tq, Hq, D] in q's dtype.
    """
    if config is not None and config.lowering == "mosaic_gpu":
        raise NotImplementedError(
            "the Mosaic GPU prefill reads paged caches (TMA copies pages of >= 8 tokens): use "
            "prefix_prefill, or the Triton lowering for a token pool"
        )
    interpret = _prepare(q, k_cache, v_cache, L.POOL, interpret)
    return _extend_pool(
        q,
        k_cache,
        v_cache,
        qo_indptr,
        kv_indptr,
        kv_indices,
        C.head_scales(k_scale, v_scale, k_cache.shape[1]),
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        interpret=interpret,
        config=_config_for(config, q, q.shape[1] // k_cache.shape[1], qo_indptr),
        scaled=k_scale is not None or v_scale is not None,
    )


def prefix_prefill(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    block_tables,
    seq_lens,
    *,
    scale,
    layout="bshd",
    soft_cap=None,
    k_scale=None,
    v_scale=None,
    interpret=None,
    config: ExtendConfig | None = None,
):
    """Paged-form extend (arguments already validated by ``ops``).

    q: [Tq, Hq, D] packed by cu_seqlens_q i32[B+1]; k_cache, v_cache in ``bshd`` or
    ``bhsd``; block_tables: i32[B, max_pages]; seq_lens: i32[B] total KV lengths.
    Raises NotImplementedError for the ``vllm`` layout.
    """
    if config is not None and config.lowering == "mosaic_gpu":
        return _mosaic_gpu(
            q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, scale=scale,
            layout=layout, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
            interpret=C.resolve_interpret(interpret),
        )  # fmt: skip
    interpret = _prepare(q, k_cache, v_cache, layout, interpret)
    num_kv_heads = L.get(layout).geometry(k_cache, v_cache).num_kv_heads
    return _prefill_paged(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        block_tables,
        seq_lens,
        C.head_scales(k_scale, v_scale, num_kv_heads),
        scale=float(scale),
        layout=layout,
        soft_cap=None if soft_cap is None else float(soft_cap),
        interpret=interpret,
        config=_config_for(config, q, q.shape[1] // num_kv_heads, cu_seqlens_q),
        scaled=k_scale is not None or v_scale is not None,
    )


def _mosaic_gpu(
    q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, *, scale, layout, soft_cap,
    k_scale, v_scale, interpret,
):  # fmt: skip
    """``ExtendConfig(lowering="mosaic_gpu")``: :mod:`jaxattn.pallas.prefill_mgpu`'s kernel."""
    from . import prefill_mgpu
    from ._mgpu import platform_reason

    if (why := platform_reason(interpret=interpret, what="prefill")) is not None:
        raise NotImplementedError(why)
    return prefill_mgpu.prefix_prefill(
        q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, scale=scale, layout=layout,
        soft_cap=soft_cap, interpret=interpret, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
