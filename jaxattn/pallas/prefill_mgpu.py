"""Prefix prefill over a paged cache on Pallas' Mosaic GPU lowering (sm_90): the extend-side
kernel of the port off the Triton lowering, beside :mod:`jaxattn.pallas.decode_mgpu`, whose
page ring it shares. ``implementation="pallas"`` runs its warp-specialised form by default
for 16-bit caches on sm_90 (:func:`serves_by_default`); ``config=ExtendConfig(lowering=
"mosaic_gpu")`` names it, ``lowering="triton"`` the Triton-lowered kernel (see
:class:`jaxattn.pallas.ExtendConfig`).

Rows. The heads that share a KV head share every K/V tile: a tile's rows are every query
head of one KV head's group (``G`` heads) for a run of one request's tokens, so a short
extend (24 new tokens x 4 heads) fills 96 rows of one tile instead of 24 rows of four.

- Warp-specialised form: q is read and the output written in their own layout. Each of the
  two consumer warpgroups holds ``64 // G`` tokens in head-major rows (head ``g``'s tokens
  are rows ``g * (64 // G)`` on; rows past ``G * (64 // G)`` are idle), read from q as one
  strided box a head and piece (the token count split into powers of two: a copy's box is
  static, the count is not) into a plain buffer, moved through registers into the wgmma
  operand's tiled layout, and written back the same way, so no copy touches another
  request's rows. The ragged batch becomes a static list of tile records (``_ws_records``:
  ``ceil(total_q / tokens) + batch + 1``), one for every run of rows of q: a request's
  (attention), those past the last request (zeros) and a request the contract poisons (NaN;
  every row when ``cu_seqlens_q`` is broken), so every row is written once, by the kernel.
- Single form: row ``r`` of a 64-row tile is token ``(m0 + r) // G`` and head ``(m0 + r) %
  G``; the wrapper lays q out as ``[Hkv, R, D]`` with every request's rows starting on a tile
  boundary (a gather, each packed row naming its token and head) and gathers the output
  back.

Keys. A block copies the request's block-table row into shared memory (as ``[width / 32,
32]``: one copy, at most 8192 pages), then each page's ``[page_size, head_dim]`` slab of its
KV head (a strided box of the bshd pool, a contiguous one of bhsd) by TMA into a ring of
``stages`` steps of ``pages_per_step`` pages. The loop stops at the tile's last visible key:
row ``i`` of a request (``Lq`` new tokens, ``Lk`` keys) sees key ``j`` iff
``j <= i + Lk - Lq``; S = q K^T and O += P V are wgmma, the softmax is online in base 2.

Two forms of the kernel (``form=``):

- ``"warp_specialized"`` (16-bit caches; the default when compiled): FlashAttention-3's
  schedule. A block is a 128-row tile and three warpgroups: a producer (its registers
  lowered to 40) issues the page copies of step ``i + stages`` once both consumers have
  released step ``i``'s slot (K and V on barriers of their own), and two consumers (232
  registers) take 64 rows each and alternate on a barrier, so one's softmax runs beside the
  other's wgmma. Each consumer runs its unmasked steps (every key visible to all its rows)
  without the mask, then the masked ones, then releases the steps only the other consumer
  reads. Tiles are launched request by request, each request's from its last (the one
  whose rows see the most keys), so the grid ends on short ones. 128-key steps in two
  stages by default (64-key steps with more).
- ``"single"`` (FP8 caches; the default in interpret mode, where the three warpgroups run
  ~10x slower as threads): a 64-row tile on one warpgroup, which issues step
  ``i + stages`` once step ``i`` has read its slot, as the decode kernel's split grid.

On an H200 (bf16, D=128, GQA 32/8, page 16; ``benchmarks/RESULTS.md``, round 33) the
warp-specialised form runs through the public op at 482 / 537 / 501 / 213 TFLOP/s on 8 x
(2048 + 512), 1 x (0 + 8192), 4 x (0 + 4096) and 32 x (1000 + 24) (round 32: 1.39-1.58x
the Triton-lowered kernel on the long rows; the short row's kernel alone 52-58 us).

The memory-safety contract (:mod:`jaxattn.reference.validity`): page ids are clamped into
the pool before any copy, lengths into the table, request and tile indices into their
arrays, so no index value makes a copy leave a buffer; the requests the contract calls
invalid (a structurally broken ``cu_seqlens_q``, rows past q, ``Lk < Lq``, a bad length, a
page id outside the pool among the pages a request uses) get NaN rows: the wrapper computes
the contract once in ``jax.numpy`` and the warp-specialised kernel writes them (the single
form's wrapper sets them after its gather). Rows past the last request are zeros. A
step's keys past the tile's last visible key (a page's tail, pages past the request) are
copied but masked out of S, and their V rows zeroed in shared memory before P V (in the
warp-specialised form the rows at or past Lk, which its two consumers share), so NaN there
never reaches the output. NaN in q or in a key or value a row attends to propagates.

Interpret mode (``interpret=True``, the CPU) runs the products as ``jnp.dot``, as the decode
kernel's does (and sets no register limits); ``tests/test_pallas_mgpu_prefill.py`` also
lowers the compiled kernel for CUDA on any machine.
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
from . import _common as C
from . import _mgpu as M
from ._mgpu import ROWS, available, is_sm90, plgpu
from ._mgpu import unsupported as _unsupported

__all__ = ["available", "is_sm90", "prefix_prefill", "unsupported"]

INFO = 32  # int32 fields of a tile's record (128 bytes, one TMA box)
PAIR = 2 * ROWS  # the warp-specialised form's tile: 64 rows for each consumer warpgroup
FORMS = ("warp_specialized", "single")
SMEM_BYTES = 227 * 1024  # an sm_90 block's shared memory
MAX_PAGES = 256 * 32  # a table row is one copy of [width / 32, 32] (<= 256 along an axis)
SMEM_SLACK = 8 * 1024  # the records, barriers and 1 KiB alignments beside the ring and q


def unsupported(
    q, k_cache, v_cache, layout, *, pages_per_step: int, scaled: bool = False
) -> str | None:
    """Why :func:`prefix_prefill` cannot serve these arguments (``scaled``: with k/v
    scales), or None."""
    return _unsupported(
        q, k_cache, v_cache, layout, pages_per_step=pages_per_step, what="prefill", scaled=scaled
    )


def serves_by_default(q, k_cache, v_cache, layout, block_tables) -> bool:
    """Whether ``implementation="pallas"``'s prefix prefill runs this kernel when no config
    names a lowering: compiled on an sm_90 GPU, a 16-bit cache in q's dtype (FP8 caches keep
    the Triton-lowered kernel), and arguments the warp-specialised form takes with its
    defaults (layout, head size, group, table width, shared memory)."""
    if not M.compiled_16bit(q, k_cache):
        return False
    geom = L.get(layout, pool=True).geometry(k_cache, v_cache)
    per_step = default_pages_per_step("warp_specialized", 2, geom.page_size)
    if per_step * geom.page_size % 64:
        return False
    why = unsupported(q, k_cache, v_cache, layout, pages_per_step=per_step)
    width = block_tables.shape[1]
    return (
        why is None and width <= MAX_PAGES and _ws_smem(2, per_step, geom, q, width) <= SMEM_BYTES
    )


def _ws_smem(stages: int, pages_per_step: int, geom, q, width: int) -> int:
    """Shared memory of the warp-specialised form: the K and V ring, q's tiles and the
    consumers' row buffers, the table row, the records and barriers."""
    itemsize = q.dtype.itemsize
    ring = 2 * stages * pages_per_step * geom.page_size * geom.head_dim * itemsize
    return ring + 2 * PAIR * geom.head_dim * itemsize + 4 * width + SMEM_SLACK


def _keys_seen(last, lq, lk):
    """Keys a request's token ``last`` (clipped to its last token) sees, plus the prefix
    shift ``lk - lq``: the keys up to its last visible one (not clipped into ``lk``)."""
    return jnp.minimum(lq - 1, last) + lk - lq + 1


def tokens_per_half(group: int) -> int:
    """Tokens a consumer warpgroup's 64 rows hold in the warp-specialised form: every query
    head of the group for ``64 // group`` tokens (head-major rows)."""
    return ROWS // group


def _rows_in_q(cu, num_rows: int):
    """Each request's first row and row count inside q (``cu``: int32 ``cu_seqlens_q``),
    clipped to q's ``num_rows`` rows."""
    start = jnp.clip(cu[:-1], 0, num_rows)
    return start, jnp.clip(jnp.minimum(cu[1:], num_rows) - start, 0, num_rows)


def _ws_records(cu_seqlens_q, seq_lens, ok, structural, *, T: int, group: int, capacity: int):
    """The warp-specialised form's tile records ``int32 [NT, INFO]``. q's rows are segments:
    each request's (its rows inside q), then the rows past the last request; a tile is
    ``2 * tokens_per_half(group)`` tokens of one segment. Fields: table row, first token in
    the segment, tokens in the segment (Lq), keys (Lk), whether it computes, the segment's
    first row in q, and what it writes: 0 attention, 1 zeros (rows past the last request), 2
    NaN (a request the contract poisons; every row when ``cu_seqlens_q`` is broken). Every
    row of q is in exactly one tile. The records follow the segments, each segment's tiles
    from its last (the one whose rows see the most keys), so the grid ends on short ones.

    Built as two reductions and their elementwise work (a GPU runs each as one kernel): the
    segments' tile ends by a triangular sum, then each record's segment fields by a one-hot
    sum over the segments. A prefix sum (a reduce-window kernel), a search and a sort by
    length each cost a kernel of their own, and a short extend's whole call ~70 us."""
    B = seq_lens.shape[0]
    tpt = 2 * tokens_per_half(group)
    NT = -(-T // tpt) + B + 1
    cu = cu_seqlens_q.astype(jnp.int32)
    start, lq = _rows_in_q(cu, T)
    end = jnp.clip(cu[-1], 0, T)
    zero = jnp.zeros((1,), jnp.int32)
    seg_start = jnp.concatenate([start, end[None]])
    seg_len = jnp.concatenate([lq, (T - end)[None]])
    seg_mode = jnp.concatenate([jnp.where(ok, 0, 2), jnp.ones((1,), jnp.int32)])
    # cu_seqlens_q broken: one segment of every row, NaN.
    j = jnp.arange(B + 1, dtype=jnp.int32)
    seg_start = jnp.where(structural, seg_start, 0)
    seg_len = jnp.where(structural, seg_len, jnp.where(j == 0, T, 0))
    seg_mode = jnp.where(structural, seg_mode, 2)
    seg_b = jnp.concatenate([jnp.arange(B, dtype=jnp.int32), zero])
    seg_lk = jnp.concatenate([jnp.clip(seq_lens, 0, capacity), zero])
    tiles = (seg_len + tpt - 1) // tpt
    ends = jnp.sum(jnp.where(j[None, :] <= j[:, None], tiles[None, :], 0), axis=1)
    # Record k lies in the segment whose tiles [ends - tiles, ends) hold it (none past the
    # last): its fields by a one-hot sum, counted from the segment's last tile.
    k = jnp.arange(NT, dtype=jnp.int32)
    hit = (ends[None, :] - tiles[None, :] <= k[:, None]) & (k[:, None] < ends[None, :])
    seg = jnp.stack(
        [seg_b, ends - 1, seg_len, seg_lk, seg_mode, seg_start, jnp.ones_like(j)], axis=1
    )
    b, last, lq, lk, mode, start, real = (
        jnp.sum(jnp.where(hit[:, :, None], seg[None], 0), axis=1)[:, i] for i in range(7)
    )
    real = real > 0
    computes = real & (mode == 0)
    fields = [
        jnp.where(computes, b, 0),
        jnp.where(real, (last - k) * tpt, 0),
        lq,  # 0 past the last segment: the tile writes nothing
        jnp.where(computes, lk, 0),
        computes.astype(jnp.int32),
        start,
        mode,
    ]
    return jnp.pad(jnp.stack(fields, axis=1), ((0, 0), (0, INFO - len(fields))))


def _copy_rows(n, most: int, copy):
    """Copies ``n`` rows (traced, ``0 <= n <= most``) as power-of-two pieces, largest first:
    ``copy(offset, piece, bit)`` for each set bit of ``n`` (an async copy's box is static)."""
    offset = 0
    for bit in reversed(range(most.bit_length())):
        piece = 1 << bit

        @pl.when((n & piece) != 0)
        def _(offset=offset, piece=piece, bit=bit):
            copy(offset, piece, bit)

        offset = offset + (n & piece)


def _tiles(q, cu_seqlens_q, seq_lens, *, group: int, capacity: int):
    """The single form's packed q ``[Hkv, R, D]``, the tile records ``int32 [NT, INFO]``
    (request, first row within it, Lq, Lk, live) of 64-row tiles, and each q element's packed
    row ``int32 [T, G]`` (R: not placed)."""
    T, Hq, D = q.shape
    G = group
    Hkv = Hq // G
    B = seq_lens.shape[0]
    NT = -(-T * G // ROWS) + B
    R = NT * ROWS
    cu = cu_seqlens_q.astype(jnp.int32)
    start, lq = _rows_in_q(cu, T)
    tiles = (lq * G + ROWS - 1) // ROWS
    first_tile = jnp.cumsum(tiles) - tiles
    total = jnp.sum(tiles)
    # Token t belongs to the first request whose end lies past it (empty requests skipped);
    # t past the last request: none.
    t = jnp.arange(T, dtype=jnp.int32)
    b_of = jnp.searchsorted(jnp.minimum(cu[1:], T), t, side="right", method="compare_all").astype(
        jnp.int32
    )
    placed = (b_of < B) & (t >= cu[0])
    bc = jnp.clip(b_of, 0, B - 1)
    row = first_tile[bc] * ROWS + (t - start[bc]) * G
    dest = jnp.where(placed[:, None], row[:, None] + jnp.arange(G, dtype=jnp.int32)[None, :], R)
    k = jnp.arange(NT, dtype=jnp.int32)
    b_k = jnp.clip(
        jnp.searchsorted(jnp.cumsum(tiles), k, side="right", method="compare_all").astype(
            jnp.int32
        ),
        0,
        B - 1,
    )
    # q_packed by a gather: row r of tile k is token (r - first row of its request) // G of
    # the request, head (that) % G; rows past a request's tokens are zeros.
    r = jnp.arange(R, dtype=jnp.int32)
    b_r = b_k[r // ROWS]
    local = r - first_tile[b_r] * ROWS
    tok = local // G
    filled = (r // ROWS < total) & (tok < lq[b_r])
    src_t = jnp.where(filled, start[b_r] + tok, 0)
    picked = q.reshape(T, Hkv, G, D)[src_t, :, local % G, :]  # [R, Hkv, D]
    q_packed = jnp.where(filled[:, None, None], picked, jnp.zeros((), q.dtype)).transpose(1, 0, 2)
    live = k < total
    info = jnp.zeros((NT, INFO), jnp.int32)
    info = info.at[:, 0].set(jnp.where(live, b_k, 0))
    info = info.at[:, 1].set(jnp.where(live, (k - first_tile[b_k]) * ROWS, 0))
    info = info.at[:, 2].set(jnp.where(live, lq[b_k], 0))
    info = info.at[:, 3].set(jnp.where(live, jnp.clip(seq_lens[b_k], 0, capacity), 0))
    info = info.at[:, 4].set(live.astype(jnp.int32))
    return q_packed, info, dest


def _page_of(tab_smem, c, *, num_pages: int):
    """The request's ``c``-th page from its table row in shared memory (``[width / 32, 32]``;
    ``c`` past the row reads its last entry), clamped into the pool (the wrapper poisons a
    request whose pages are not)."""
    rows, cols = tab_smem.shape
    c = jnp.minimum(c, rows * cols - 1)
    page = tab_smem[lax.div(c, cols), lax.rem(c, cols)]
    return jnp.where((page >= 0) & (page < num_pages), page, 0)


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
    and ``factors`` f32[H32] (Hkv rounded up to a multiple of 32) each KV head's score
    factor (:func:`._mgpu.to_float16`)."""
    Hkv, R, D = q_packed.shape
    NT, G, NS, dtype = R // ROWS, group, stages, q_packed.dtype
    P, S = geom.num_pages, geom.page_size
    T = pages_per_step * S
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
        # Keys up to the tile's last row's last visible one are loaded.
        end = jnp.where(live > 0, jnp.clip(_keys_seen(lax.div(m0 + ROWS - 1, G), lq, lk), 0, lk), 0)
        n_steps = (end + T - 1) // T
        plgpu.barrier_wait(meta_bar.at[1])

        page_at = functools.partial(_page_of, tab_smem, num_pages=P)

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
            plgpu.SMEM(tables.shape[1:], jnp.int32),
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


def _ws_kernel_call(
    q, k_cache, v_cache, tables, info, *, geom, layout, group, scale, soft_cap, pages_per_step,
    stages, interpret,
):  # fmt: skip
    """The warp-specialised form, 16-bit caches: ``[T, Hq, D]`` in q's dtype, every row
    written (see :func:`_ws_records` and the module docstring)."""
    T, Hq, D = q.shape
    G, NS, dtype = group, stages, q.dtype
    Hkv = Hq // G
    NT = info.shape[0]
    NTOK = tokens_per_half(G)
    BITS = NTOK.bit_length()  # the power-of-two pieces of a consumer's rows
    P, S, T_step = geom.num_pages, geom.page_size, pages_per_step * geom.page_size
    cast, iota = M.layout_ops(interpret)
    bshd = layout == "bshd"
    # raw score -> base-2 logit, folded into the exponent (a positive scale, no cap)
    c2 = scale * C.LOG2E if soft_cap is None and scale > 0 else None

    def bounds(info_smem, w):
        """Warpgroup ``w``'s tokens: (first token in the segment, Lk - Lq, keys to read,
        steps). A warpgroup without tokens (a segment's last tile of at most 64 rows), and
        every warpgroup of a tile that does not compute, reads nothing."""
        tok = info_smem[1] + w * NTOK
        lq, lk, live = info_smem[2], info_smem[3], info_smem[4]
        reads = (live > 0) & (tok < lq)
        end = jnp.where(reads, jnp.clip(_keys_seen(tok + NTOK - 1, lq, lk), 0, lk), 0)
        return tok, lk - lq, end, (end + T_step - 1) // T_step

    def steps(info_smem):
        """The steps the tile's two warpgroups read between them."""
        return jnp.maximum(bounds(info_smem, 0)[-1], bounds(info_smem, 1)[-1])

    def kernel(q_ref, k_ref, v_ref, tab_ref, info_ref, out_ref, scoped):
        (q2, rows2, k_smem, v_smem, tab_smem, info_smem), bars = scoped
        meta, q_bars, k_bars, v_bars, k_free, v_free, sched = bars
        wg = lax.axis_index("wg")
        h = lax.axis_index("kvh")
        t = lax.axis_index("t")

        def take_turn():  # the consumers' ping-pong: one's softmax beside the other's wgmma
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        @pl.when(wg == 2)
        def _producer():
            if not interpret:
                plgpu.set_max_registers(40, action="decrease")
            plgpu.copy_gmem_to_smem(info_ref.at[t], info_smem, meta.at[0])
            plgpu.barrier_wait(meta.at[0])
            plgpu.copy_gmem_to_smem(tab_ref.at[info_smem[0]], tab_smem, meta.at[1])
            n = steps(info_smem)
            plgpu.barrier_wait(meta.at[1])

            page_at = functools.partial(_page_of, tab_smem, num_pages=P)
            kw = dict(
                page_of=page_at, head=h, bshd=bshd, pages_per_step=pages_per_step,
                page_size=S, stages=NS,
            )  # fmt: skip
            for i in range(NS):

                @pl.when(n > i)
                def _(i=i):
                    M.issue_step(k_ref, k_smem, k_bars, i, **kw)
                    M.issue_step(v_ref, v_smem, v_bars, i, **kw)

            @pl.loop(0, jnp.maximum(n - NS, 0))
            def _(i):
                slot = lax.rem(i, NS)
                plgpu.barrier_wait(k_free.at[slot])
                M.issue_step(k_ref, k_smem, k_bars, i + NS, **kw)
                plgpu.barrier_wait(v_free.at[slot])
                M.issue_step(v_ref, v_smem, v_bars, i + NS, **kw)

        @pl.when(wg < 2)
        def _consumer():
            if not interpret:
                plgpu.set_max_registers(232, action="increase")
            q_smem, rows_smem = q2.at[wg], rows2.at[wg]
            plgpu.barrier_wait(meta.at[0])
            tok, shift, end, n = bounds(info_smem, wg)
            n_all = steps(info_smem)
            lq, lk, mode = info_smem[2], info_smem[3], info_smem[6]
            held = jnp.clip(lq - tok, 0, NTOK)  # the tokens whose rows this warpgroup writes
            first = info_smem[5] + tok  # the first one's row of q

            # q's rows straight from q, head-major (head g's tokens are rows g * NTOK ...):
            # each head's rows are one strided box of q a piece. Rows of no token keep what
            # shared memory held; their results are never stored.
            def load(offset, piece, bit):
                for g in range(G):
                    plgpu.copy_gmem_to_smem(
                        q_ref.at[pl.ds(first + offset, piece), h, g],
                        rows_smem.at[pl.ds(g * NTOK + offset, piece)],
                        q_bars.at[wg * BITS + bit],
                    )

            loaded = jnp.where(n > 0, held, 0)
            _copy_rows(loaded, NTOK, load)
            # Steps whose every key each of these rows sees (and below Lk): no mask.
            # (None where Lk < Lq, a request the contract poisons: never a negative step.)
            full = jnp.maximum(jnp.minimum(tok + shift + 1, end), 0) // T_step
            for bit in range(BITS):

                @pl.when((loaded & (1 << bit)) != 0)
                def _(bit=bit):
                    plgpu.barrier_wait(q_bars.at[wg * BITS + bit])

            # Into the wgmma operand's tiled layout through registers (an async copy into
            # it needs a row offset the lowering can prove a multiple of 8).
            @pl.when(n > 0)
            def _():
                if interpret:
                    q_smem[...] = rows_smem[...]
                else:
                    q_smem[...] = M.load(rows_smem, layout=plgpu.Layout.WGMMA, optimized=False)
                plgpu.commit_smem()

            state = M.initial_state(cast, D)

            @pl.when(n > 0)
            def _():
                plgpu.barrier_wait(k_bars.at[0])

            pl.when(wg == 1)(take_turn)

            def step(i, carry, masked):
                acc, m_i, l_i = carry
                slot = lax.rem(i, NS)
                k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
                if interpret:
                    s = jnp.dot(q_smem[...], k_tile[...].T, preferred_element_type=jnp.float32)
                    take_turn()
                else:

                    def qk(ref):
                        plgpu.wgmma(ref, q_smem, k_tile.transpose((1, 0)))
                        take_turn()
                        return ref[...]

                    s = pl.run_scoped(qk, plgpu.ACC((ROWS, T_step), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if c2 is None:
                    s = C.scores_base2(s, scale=scale, soft_cap=soft_cap)
                if masked:
                    key = iota((ROWS, T_step), 1) + i * T_step
                    limit = tok + lax.rem(iota((ROWS, T_step), 0), NTOK) + shift
                    s = jnp.where((key <= limit) & (key < end), s, -jnp.inf)
                if c2 is None:
                    m_new = jnp.maximum(m_i, s.max(axis=1))
                    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                else:  # the scale folded into the exponent's multiply-add
                    m_new = jnp.maximum(m_i, s.max(axis=1) * c2)
                    p = jnp.exp2(s * c2 - lax.broadcast_in_dim(m_new, s.shape, [0]))
                alpha = jnp.exp2(m_i - m_new)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i = l_i * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                if not interpret:
                    acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_bars.at[slot])
                plgpu.barrier_wait(sched)
                if masked:
                    # The step that crosses Lk: its rows there (a page's tail, pages past
                    # the request) are not the request's; zeros, so 0 * NaN never happens.
                    @pl.when((i + 1) * T_step > lk)
                    def _():
                        keep = iota((T_step, D), 0) < lk - i * T_step
                        v_tile[...] = jnp.where(keep, v_tile[...], jnp.zeros((T_step, D), dtype))
                        plgpu.commit_smem()

                def wait_next_k():
                    @pl.when(i + 1 < n)
                    def _():
                        plgpu.barrier_wait(k_bars.at[lax.rem(i + 1, NS)])

                if interpret:
                    acc = acc + jnp.dot(p16, v_tile[...], preferred_element_type=jnp.float32)
                    wait_next_k()
                else:

                    def pv(ref):
                        plgpu.wgmma(ref, p16, v_tile)
                        wait_next_k()  # while the product runs

                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))

                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            def flush(i, _):
                # Steps only the other warpgroup reads: release them, keep the turns even.
                slot = lax.rem(i, NS)
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                take_turn()
                take_turn()

            state = lax.fori_loop(0, full, functools.partial(step, masked=False), state)
            acc, m_i, l_i = lax.fori_loop(full, n, functools.partial(step, masked=True), state)
            lax.fori_loop(n, n_all, flush, None)
            pl.when(wg == 0)(take_turn)
            # What the tile writes: attention (every row saw a key), zeros (rows past the
            # last request: acc is 0, so 0 / 1) or NaN (0 / 0 plus NaN).
            zeros = (mode == 1).astype(jnp.float32)
            poison = jnp.where(mode == 2, jnp.float32(jnp.nan), jnp.float32(0.0))
            out = acc / lax.broadcast_in_dim(l_i + zeros, acc.shape, [0]) + poison
            rows_smem[...] = out.astype(dtype)
            plgpu.commit_smem()

            def store(offset, piece, bit):
                for g in range(G):
                    plgpu.copy_smem_to_gmem(
                        rows_smem.at[pl.ds(g * NTOK + offset, piece)],
                        out_ref.at[pl.ds(first + offset, piece), h, g],
                    )

            _copy_rows(held, NTOK, store)
            plgpu.wait_smem_to_gmem(0)

    def entry(q_ref, k_ref, v_ref, tab_ref, info_ref, out_ref):
        smem = (
            plgpu.SMEM((2, ROWS, D), dtype, transforms=M.tiled()),
            plgpu.SMEM((2, ROWS, D), dtype),  # each consumer's rows as q and out hold them
            M.ring_smem(NS, T_step, D, dtype),
            M.ring_smem(NS, T_step, D, dtype),
            plgpu.SMEM(tables.shape[1:], jnp.int32),
            plgpu.SMEM((INFO,), jnp.int32),
        )
        bars = (
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_arrivals=G, num_barriers=2 * BITS),
            plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=NS),
            plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=NS),
            plgpu.Barrier(num_arrivals=2, num_barriers=NS),
            plgpu.Barrier(num_arrivals=2, num_barriers=NS),
            plgpu.Barrier(num_arrivals=2),
        )
        pl.run_scoped(
            lambda *a: kernel(q_ref, k_ref, v_ref, tab_ref, info_ref, out_ref, a),
            smem,
            bars,
            collective_axes="wg",
        )

    out = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((T, Hkv, G, D), dtype),
        grid=(Hkv, NT),
        grid_names=("kvh", "t"),
        num_threads=3,
        thread_name="wg",
        **M.launch_params(interpret),
    )(q.reshape(T, Hkv, G, D), k_cache, v_cache, tables, info)
    return out.reshape(T, Hq, D)


def _table_rows(block_tables):
    """The kernels' block tables: a copy moves a multiple of 128 bytes and at most 256
    elements along a dimension, so each row is padded to 32 entries (the padding is never
    read as a page of a request: the loop stops at its last key) and laid out as
    ``[width / 32, 32]``."""
    tables = M.pad_to(block_tables.astype(jnp.int32), 1, 32)
    return tables.reshape(tables.shape[0], -1, 32)


def default_pages_per_step(form: str, stages: int, page_size: int) -> int:
    """Pages a step copies when not given: in the warp-specialised form 128 keys with two
    stages, else 64; in the single form the fewest pages that make whole 64-row tiles."""
    if form == "warp_specialized":
        return max(1, (128 if stages <= 2 else 64) // page_size)
    return M.steps_of(None, page_size)


def _problems(cu_seqlens_q, num_rows: int, block_tables, seq_lens, geom):
    """The memory-safety contract's checks of a call (:mod:`jaxattn.reference.validity`)."""
    problems = _validity.ragged_problems(cu_seqlens_q, num_rows, seq_lens, q_name="cu_seqlens_q")
    return problems + _validity.paged_problems(
        block_tables, seq_lens, geom.page_size, geom.num_pages
    )


def ws_records(cu_seqlens_q, block_tables, seq_lens, *, num_rows: int, group: int, geom):
    """The warp-specialised kernel's tile records for a call (the contract checked), as the
    entry point builds them: what a caller that runs the kernel alone passes it."""
    problems = _problems(cu_seqlens_q, num_rows, block_tables, seq_lens, geom)
    structural, ok = _validity.ragged_valid(problems, seq_lens.shape[0])
    capacity = block_tables.shape[1] * geom.page_size
    return _ws_records(
        cu_seqlens_q, seq_lens, ok, structural, T=num_rows, group=group, capacity=capacity
    )


def _run(q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, k_scale, v_scale, *,
         geom, layout, capacity, problems, **kw):  # fmt: skip
    """``[T, Hq, D]`` in q's dtype: the attention of every request's rows, NaN in the rows the
    contract poisons (``problems``), zeros past the last request."""
    T, Hq, D = q.shape
    Hkv = geom.num_kv_heads
    G = Hq // Hkv
    structural, ok = _validity.ragged_valid(problems, seq_lens.shape[0])
    tables = _table_rows(block_tables)
    layout = L.get(layout, pool=True).name
    if kw.pop("form") == "warp_specialized":
        info = _ws_records(cu_seqlens_q, seq_lens, ok, structural, T=T, group=G, capacity=capacity)
        return _ws_kernel_call(
            q, k_cache, v_cache, tables, info, geom=geom, layout=layout, group=G, **kw
        )
    fp8 = Q.is_fp8(k_cache.dtype)
    if fp8:
        q16, factor = M.to_float16(q, Hkv, k_scale)
        kw["factors"] = M.pad_to(factor, 0, 32)
    q_packed, info, dest = _tiles(
        q16 if fp8 else q, cu_seqlens_q, seq_lens, group=G, capacity=capacity
    )
    out = _kernel_call(
        q_packed, k_cache, v_cache, tables, info, geom=geom, layout=layout, group=G, **kw
    )
    R = out.shape[1]
    rows = out[:, jnp.minimum(dest, R - 1)]  # [Hkv, T, G, D]
    rows = rows.transpose(1, 0, 2, 3).reshape(T, Hq, D)
    placed = jnp.broadcast_to((dest < R)[:, None, :], (T, Hkv, G))
    rows = jnp.where(placed.reshape(T, Hq, 1), rows, 0.0)
    if fp8:  # the output is linear in the values
        rows = rows * jnp.repeat(M.head_vector(v_scale, Hkv), G)[None, :, None]
    # The contract's NaN rows (jaxattn.reference.validity), computed once here.
    bad_rows = _validity.ragged_row_mask(cu_seqlens_q, T, structural, ok)
    return jnp.where(bad_rows[:, None, None], jnp.nan, rows).astype(q.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "layout",
        "soft_cap",
        "pages_per_step",
        "stages",
        "form",
        "interpret",
    ),
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
    form,
    interpret,
):
    geom = L.get(layout, pool=True).geometry(k_cache, v_cache)
    T, Hq, D = q.shape
    B = seq_lens.shape[0]
    capacity = block_tables.shape[1] * geom.page_size
    seq_lens = seq_lens.astype(jnp.int32)
    if T == 0:
        return jnp.zeros_like(q)
    problems = _problems(cu_seqlens_q, T, block_tables, seq_lens, geom)
    if B == 0:  # every row is padding (NaN where cu_seqlens_q is broken)
        structural, _ = _validity.ragged_valid(problems, B)
        return jnp.where(structural, jnp.zeros_like(q), jnp.nan)
    return _run(
        q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, k_scale, v_scale, geom=geom,
        layout=layout, capacity=capacity, problems=problems, scale=scale, soft_cap=soft_cap,
        pages_per_step=pages_per_step, stages=stages, form=form, interpret=interpret,
    )  # fmt: skip


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
    stages: int | None = None,
    form: str | None = None,
    interpret: bool | None = None,
    k_scale=None,
    v_scale=None,
):
    """Prefix prefill over a paged cache, ``q [total_q, Hq, D] -> [total_q, Hq, D]``, on the
    Mosaic GPU lowering (see the module docstring): request ``b``'s new tokens are q rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``, its ``seq_lens[b]`` keys (cached prefix, then
    the new tokens) in the pages of ``block_tables[b]``. ``form``: ``"warp_specialized"``
    or ``"single"`` (None: the former for 16-bit caches when compiled, the latter for FP8
    caches and in interpret mode). ``pages_per_step``: pages a step copies, a multiple of 64
    keys (default: 128 keys in the warp-specialised form with two stages, else the fewest);
    ``stages``: steps in flight (>= 2, default 2; a ValueError where the warp-specialised
    ring would not fit in shared memory). ``interpret``: None runs interpret mode exactly on
    the CPU. An FP8 cache (``k_scale`` / ``v_scale``: None, a scalar or f32 ``[Hkv]``) is
    widened to float16 a step at a time, as in the decode kernel; scales with a 16-bit cache
    are refused. Raises ``NotImplementedError`` for what :func:`unsupported` refuses (and
    for block tables wider than 8192 pages)."""
    geom = L.get(layout, pool=True).geometry(k_cache, v_cache)
    fp8 = Q.is_fp8(k_cache.dtype)
    if form is None:  # interpret mode: the one-warpgroup form (the other interprets ~10x slower)
        form = "single" if fp8 or M.interpreted(interpret) else "warp_specialized"
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    ws = form == "warp_specialized"
    if stages is None:
        stages = 2
    if pages_per_step is None:
        pages_per_step = default_pages_per_step(form, stages, geom.page_size)
    pages_per_step = M.steps_of(pages_per_step, geom.page_size)
    scaled = k_scale is not None or v_scale is not None
    why = unsupported(q, k_cache, v_cache, layout, pages_per_step=pages_per_step, scaled=scaled)
    if block_tables.ndim == 2 and block_tables.shape[1] > MAX_PAGES:
        why = why or (
            f"the Mosaic GPU prefill copies block-table rows of up to {MAX_PAGES} pages, got "
            f"{block_tables.shape[1]}"
        )
    if ws and fp8:
        why = why or "the warp-specialised Mosaic GPU prefill reads 16-bit caches (FP8: 'single')"
    scale, interpret = M.finish_args(why, stages, scale, geom.head_dim, interpret)
    if ws:
        smem = _ws_smem(stages, pages_per_step, geom, q, block_tables.shape[1])
        if smem > SMEM_BYTES:
            raise ValueError(
                f"the warp-specialised Mosaic GPU prefill's ring ({stages} stages of "
                f"{pages_per_step} pages of {geom.page_size} tokens) and q / output tiles take "
                f"{smem} bytes of shared memory, more than {SMEM_BYTES}: fewer stages or "
                "pages_per_step"
            )
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
        form=form,
        interpret=interpret,
    )
