"""Prefix prefill over a paged cache on Pallas' Mosaic GPU lowering (sm_90): the extend-side
kernel of the port off the Triton lowering, beside :mod:`jaxattn.pallas.decode_mgpu`, whose
page ring it shares. Reached through the public op with ``implementation="pallas",
config=ExtendConfig(lowering="mosaic_gpu")``; the Triton-lowered kernel stays the default.

Rows. A tile is 64 rows (wgmma's M) of one request and one KV head; row ``r`` is token
``(m0 + r) // G`` and query head ``(m0 + r) % G`` of the KV head's group (``G`` = the GQA
group), so the heads that share a KV head share every K/V tile, and a short extend (24 new
tokens x 4 heads) fills 96 rows of two tiles instead of 24 rows of four. The wrapper lays q
out as ``[Hkv, R, D]`` with every request's rows starting on a tile boundary (one TMA box a
tile) and gathers the output back; the ragged batch becomes a static list of tiles (an upper
bound, ``ceil(total_q * G / 64) + batch``), each with its request, first row and lengths.

Keys. A block copies the request's block-table row into shared memory, then each page's
``[page_size, head_dim]`` slab of its KV head (a strided box of the bshd pool, a contiguous
one of bhsd) by TMA into a ring of ``stages`` steps of ``pages_per_step`` pages, and issues
step ``i + stages`` once step ``i`` has read its slot (one warpgroup, as the decode kernel's
split grid). The loop stops at the tile's last visible key: row ``i`` of a request (``Lq``
new tokens, ``Lk`` keys) sees key ``j`` iff ``j <= i + Lk - Lq``; S = q K^T and O += P V are
wgmma, the softmax is online in base 2.

The memory-safety contract (:mod:`jaxattn.reference.validity`): page ids are clamped into
the pool before any copy, lengths into the table, request and tile indices into their
arrays, so no index value makes a copy leave a buffer; the requests the contract calls
invalid (a structurally broken ``cu_seqlens_q``, rows past q, ``Lk < Lq``, a bad length, a
page id outside the pool among the pages a request uses) get NaN rows from the wrapper,
which computes the contract once in ``jax.numpy``. Rows past the last request are zeros. A
step's keys past the tile's last visible key (a page's tail, pages past the request) are
copied but masked out of S, and their V rows zeroed in shared memory before P V, so NaN there
never reaches the output. NaN in q or in a key or value a row attends to propagates.

Interpret mode (``interpret=True``, the CPU) runs the products as ``jnp.dot``, as the decode
kernel's does; ``tests/test_pallas_mgpu_prefill.py`` also lowers the compiled kernel for CUDA
on any machine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .. import layout as L
from .. import quant as Q
from ..reference import validity as _validity
from . import _mgpu as M
from ._mgpu import ROWS, available, is_sm90, plgpu
from ._mgpu import unsupported as _unsupported

__all__ = ["available", "is_sm90", "prefix_prefill", "unsupported"]

INFO = 32  # int32 fields of a tile's record (128 bytes, one TMA box)


def unsupported(q, k_cache, v_cache, layout, *, pages_per_step: int) -> str | None:
    """Why :func:`prefix_prefill` cannot serve these arguments, or None."""
    return _unsupported(q, k_cache, v_cache, layout, pages_per_step=pages_per_step, what="prefill")


def _tiles(q, cu_seqlens_q, seq_lens, *, group: int, capacity: int):
    """The packed q ``[Hkv, R, D]``, the tile records ``int32 [NT, INFO]`` (request, first
    row, Lq, Lk, live) and each q element's packed row ``int32 [T, G]`` (R: not placed)."""
    T, Hq, D = q.shape
    G = group
    Hkv = Hq // G
    B = seq_lens.shape[0]
    NT = -(-T * G // ROWS) + B
    R = NT * ROWS
    cu = cu_seqlens_q.astype(jnp.int32)
    start = jnp.clip(cu[:-1], 0, T)
    lq = jnp.clip(jnp.minimum(cu[1:], T) - start, 0, T)  # each request's rows inside q
    tiles = (lq * G + ROWS - 1) // ROWS
    first_tile = jnp.cumsum(tiles) - tiles
    total = jnp.sum(tiles)
    # Token t belongs to the first request whose end lies past it (empty requests skipped);
    # t past the last request: none.
    t = jnp.arange(T, dtype=jnp.int32)
    b_of = jnp.searchsorted(jnp.minimum(cu[1:], T), t, side="right").astype(jnp.int32)
    placed = (b_of < B) & (t >= cu[0])
    bc = jnp.clip(b_of, 0, B - 1)
    row = first_tile[bc] * ROWS + (t - start[bc]) * G
    dest = jnp.where(placed[:, None], row[:, None] + jnp.arange(G, dtype=jnp.int32)[None, :], R)
    qg = q.reshape(T, Hkv, G, D).transpose(1, 0, 2, 3)  # [Hkv, T, G, D]
    q_packed = (
        jnp.zeros((Hkv, R, D), q.dtype)
        .at[:, dest.reshape(-1)]
        .set(qg.reshape(Hkv, T * G, D), mode="drop")
    )
    k = jnp.arange(NT, dtype=jnp.int32)
    b_k = jnp.clip(jnp.searchsorted(jnp.cumsum(tiles), k, side="right").astype(jnp.int32), 0, B - 1)
    live = k < total
    info = jnp.zeros((NT, INFO), jnp.int32)
    info = info.at[:, 0].set(jnp.where(live, b_k, 0))
    info = info.at[:, 1].set(jnp.where(live, (k - first_tile[b_k]) * ROWS, 0))
    info = info.at[:, 2].set(jnp.where(live, lq[b_k], 0))
    info = info.at[:, 3].set(jnp.where(live, jnp.clip(seq_lens[b_k], 0, capacity), 0))
    info = info.at[:, 4].set(live.astype(jnp.int32))
    return q_packed, info, dest


def _kernel_call(
    q_packed,
    k_cache,
    v_cache,
    tables,
    info,
    *,
    geom,
    layout,
    group,
    scale,
    soft_cap,
    pages_per_step,
    stages,
    interpret,
    factors=None,
):
    """f32 ``[Hkv, R, D]``: each tile's normalised rows. FP8 caches: q_packed is float16
    and ``factors`` f32[32] each KV head's score factor (:func:`._mgpu.to_float16`)."""
    Hkv, R, D = q_packed.shape
    NT = R // ROWS
    G = group
    P, S = geom.num_pages, geom.page_size
    W = tables.shape[1]
    T = pages_per_step * S
    NS = stages
    dtype = q_packed.dtype
    bshd = layout == "bshd"
    cast, iota = M.layout_ops(interpret)

    fp8 = factors is not None

    def kernel(q_ref, k_ref, v_ref, tab_ref, info_ref, fac_ref, out_ref, scoped):
        (q_smem, k_and_o, v_smem, tab_smem, info_smem, *fp8_smem), bars = scoped
        k_smem, o_smem = k_and_o  # the output tile reuses the K ring after the last step
        q_bar, meta_bar, k_bars, v_bars = bars
        h = lax.axis_index("kvh")
        t = lax.axis_index("t")
        plgpu.copy_gmem_to_smem(info_ref.at[t], info_smem, meta_bar.at[0])
        plgpu.barrier_wait(meta_bar.at[0])
        b = info_smem[0]
        m0 = info_smem[1]
        lq = info_smem[2]
        lk = info_smem[3]
        live = info_smem[4]
        plgpu.copy_gmem_to_smem(tab_ref.at[b], tab_smem, meta_bar.at[1])
        if fp8:
            plgpu.copy_gmem_to_smem(fac_ref, fp8_smem[0], meta_bar.at[2])
        plgpu.copy_gmem_to_smem(q_ref.at[h, pl.ds(t * ROWS, ROWS)], q_smem, q_bar.at[0])
        shift = lk - lq
        # The tile's last row's token; keys up to its last visible one are loaded.
        last = jnp.minimum(lq - 1, lax.div(m0 + ROWS - 1, G))
        end = jnp.where(live > 0, jnp.clip(last + shift + 1, 0, lk), 0)
        n_steps = (end + T - 1) // T
        plgpu.barrier_wait(meta_bar.at[1])

        def page_at(c):
            """The request's ``c``-th page, clamped into the pool (the wrapper poisons a
            request whose pages are not)."""
            page = tab_smem[jnp.minimum(c, W - 1)]
            return jnp.where((page >= 0) & (page < P), page, 0)

        k, v = (k_ref, k_smem, k_bars), (v_ref, v_smem, v_bars)
        ring = M.PageRing(
            k, v, n_steps, page_of=page_at, head=h, bshd=bshd, pages_per_step=pages_per_step,
            page_size=S, stages=NS,
        )  # fmt: skip
        ring.prologue()

        plgpu.barrier_wait(q_bar.at[0])
        state = M.initial_state(cast, D)
        fp8_kw = {}
        if fp8:
            plgpu.barrier_wait(meta_bar.at[2])
            fp8_kw = dict(wide=tuple(fp8_smem[1:]), factor=fp8_smem[0][h])
        # Last key each row sees: its token plus the prefix shift.
        limit = lax.div(m0 + iota((ROWS, T), 0), G) + shift

        def step(i, state):
            return M.ring_step(
                i, lax.rem(i, NS), state, q_smem=q_smem, k_smem=k_smem, v_smem=v_smem,
                k_bars=k_bars, v_bars=v_bars, keys=T, scale=scale, soft_cap=soft_cap, iota=iota,
                visible=lambda key: (key <= limit) & (key < end), n_keys=end,
                k_read=lambda: ring.refill(k, i), v_read=lambda: ring.refill(v, i),
                interpret=interpret,
                **fp8_kw,
            )  # fmt: skip

        acc, m_i, l_i = lax.fori_loop(0, n_steps, step, state)
        # Rows that saw no key (padding rows, empty tiles) divide 0 by 0: never gathered.
        o_smem[...] = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[h, pl.ds(t * ROWS, ROWS)])
        plgpu.wait_smem_to_gmem(0)

    def entry(*refs):
        q_ref, k_ref, v_ref, tab_ref, info_ref, fac_ref, out_ref = M.split_refs(refs, 5, fp8)
        smem = M.ring_buffers(NS, T, D, dtype, k_cache.dtype, interpret) + (
            plgpu.SMEM((W,), jnp.int32),
            plgpu.SMEM((INFO,), jnp.int32),
        )
        if fp8:
            smem += M.fp8_buffers(factors, T, D, dtype)
        bars = (
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_barriers=3 if fp8 else 2),
            plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=NS),
            plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=NS),
        )
        pl.run_scoped(
            lambda *a: kernel(q_ref, k_ref, v_ref, tab_ref, info_ref, fac_ref, out_ref, a),
            smem,
            bars,
        )

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((Hkv, R, D), jnp.float32),
        grid=(Hkv, NT),
        grid_names=("kvh", "t"),
        **M.launch_params(interpret),
    )(q_packed, k_cache, v_cache, tables, info, *(() if factors is None else (factors,)))


def _run(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    block_tables,
    seq_lens,
    k_scale,
    v_scale,
    *,
    geom,
    layout,
    capacity,
    **kw,
):
    """f32 ``[T, Hq, D]``: the kernel's rows back in q's order, zeros past the last request."""
    T, Hq, D = q.shape
    Hkv = geom.num_kv_heads
    G = Hq // Hkv
    fp8 = Q.is_fp8(k_cache.dtype)
    if fp8:
        q, factor = M.to_float16(q, Hkv, k_scale)
        kw["factors"] = M.pad_to(factor, 0, 32)
    q_packed, info, dest = _tiles(q, cu_seqlens_q, seq_lens, group=G, capacity=capacity)
    # A copy moves a multiple of 128 bytes: the table row padded to 32 entries (the padding
    # is never read as a page of a request: the loop stops at its last key).
    tables = M.pad_to(block_tables.astype(jnp.int32), 1, 32)
    out = _kernel_call(
        q_packed,
        k_cache,
        v_cache,
        tables,
        info,
        geom=geom,
        layout=L.get(layout, pool=True).name,
        group=G,
        **kw,
    )
    R = out.shape[1]
    rows = out[:, jnp.minimum(dest, R - 1)]  # [Hkv, T, G, D]
    rows = rows.transpose(1, 0, 2, 3).reshape(T, Hq, D)
    placed = jnp.broadcast_to((dest < R)[:, None, :], (T, geom.num_kv_heads, G))
    rows = jnp.where(placed.reshape(T, Hq, 1), rows, 0.0)
    if fp8:  # the output is linear in the values
        rows = rows * jnp.repeat(M.head_vector(v_scale, Hkv), G)[None, :, None]
    return rows


@functools.partial(
    jax.jit,
    static_argnames=("scale", "layout", "soft_cap", "pages_per_step", "stages", "interpret"),
)
def _prefix_prefill(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    block_tables,
    seq_lens,
    k_scale,
    v_scale,
    *,
    scale,
    layout,
    soft_cap,
    pages_per_step,
    stages,
    interpret,
):
    geom = L.get(layout, pool=True).geometry(k_cache, v_cache)
    T, Hq, D = q.shape
    B = seq_lens.shape[0]
    capacity = block_tables.shape[1] * geom.page_size
    seq_lens = seq_lens.astype(jnp.int32)
    if T == 0:
        return jnp.zeros_like(q)
    if B == 0:  # every row is padding
        rows = jnp.zeros((T, Hq, D), jnp.float32)
    else:
        rows = _run(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q,
            block_tables,
            seq_lens,
            k_scale,
            v_scale,
            geom=geom,
            layout=layout,
            capacity=capacity,
            scale=scale,
            soft_cap=soft_cap,
            pages_per_step=pages_per_step,
            stages=stages,
            interpret=interpret,
        )
    # The contract's NaN rows (jaxattn.reference.validity), computed once here.
    problems = _validity.ragged_problems(cu_seqlens_q, T, seq_lens, q_name="cu_seqlens_q")
    problems += _validity.paged_problems(block_tables, seq_lens, geom.page_size, geom.num_pages)
    structural, ok = _validity.ragged_valid(problems, B)
    bad_rows = _validity.ragged_row_mask(cu_seqlens_q, T, structural, ok)
    rows = jnp.where(bad_rows[:, None, None], jnp.nan, rows)
    return rows.astype(q.dtype)


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
    pages_per_step: int | None = None,
    stages: int = 2,
    interpret: bool | None = None,
    k_scale=None,
    v_scale=None,
):
    """Prefix prefill over a paged cache, ``q [total_q, Hq, D] -> [total_q, Hq, D]``, on the
    Mosaic GPU lowering (see the module docstring): request ``b``'s new tokens are q rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``, its ``seq_lens[b]`` keys (cached prefix, then
    the new tokens) in the pages of ``block_tables[b]``. ``pages_per_step``: pages a step
    copies, whole 64-row tiles (default: the fewest); ``stages``: steps in flight (>= 2).
    ``interpret``: None runs interpret mode exactly on the CPU. An FP8 cache (``k_scale`` /
    ``v_scale``: None, a scalar or f32 ``[Hkv]``) is widened to float16 a step at a time, as
    in the decode kernel; scales with a 16-bit cache are refused. Raises
    ``NotImplementedError`` for what :func:`unsupported` refuses."""
    geom = L.get(layout, pool=True).geometry(k_cache, v_cache)
    pages_per_step = M.steps_of(pages_per_step, geom.page_size)
    why = unsupported(q, k_cache, v_cache, layout, pages_per_step=pages_per_step)
    if (k_scale is not None or v_scale is not None) and not Q.is_fp8(k_cache.dtype):
        why = why or "the Mosaic GPU prefill takes k/v scales with FP8 caches only"
    scale, interpret = M.finish_args(why, stages, scale, geom.head_dim, interpret)
    return _prefix_prefill(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
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
    )
