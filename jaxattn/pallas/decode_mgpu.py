"""Paged decode on Pallas' Mosaic GPU lowering (sm_90): the first kernel of the port off the
Triton lowering. Compiled and checked on an H200 (jax 0.11); what ``implementation="pallas"``
runs by default on sm_90 for a 16-bit cache with head_dim 128 and tables of at least 1024
tokens, one-pass and split grids (:func:`serves_by_default`; FP8 caches keep the
Triton-lowered kernel), and
``config=DecodeConfig(lowering="mosaic_gpu")`` names it.

One block per (KV head, sequence, partition of ``partition_pages`` pages):

* each page's ``[page_size, head_dim]`` slab of the block's KV head (a strided box of the
  bshd pool, a contiguous one of bhsd) is copied by TMA into a ring of ``stages`` steps of
  ``pages_per_step`` pages, the page ids read from the partition's window of the block
  table in shared memory. ``specialized``: a copy warpgroup refills a stage when the
  compute warpgroup releases it; otherwise the compute warpgroup issues step ``i + stages``
  itself once step ``i`` has read its slot (half the threads, so more blocks an SM);
* the compute warpgroup holds the query heads of the KV head as the M = 64 rows of wgmma
  (padded: a GQA group is 1-64 heads), runs S = q K^T and O += P V per step with the online
  softmax in base 2, and leaves (O unnormalised for the group's rows, max, sum) per
  partition, the output tile sharing the K ring's memory; the partitions merge exactly
  outside, on the Mosaic GPU lowering at head_dim 128 (:mod:`jaxattn.pallas.merge_mgpu`),
  else on the Triton one (:func:`jaxattn.pallas.decode.combine`), or in XLA on a JAX
  without that lowering; :func:`merge_lowering`.

The memory-safety contract of the other kernels (:mod:`jaxattn.reference`'s validity): a
length outside ``[0, capacity]`` or a page id outside the pool, among the pages the sequence
reads, poisons the sequence (NaN rows); copies read page 0 instead, so no TMA leaves the pool.
A step's rows past the sequence's end (a page's tail, whole pages past it) are copied but
masked out of S, and their V rows are zeroed in shared memory before P V, so NaN there never
reaches the output. NaN in q or in a key or value the sequence attends to propagates.

Interpret mode (``interpret=True``, the CPU): barriers, TMA copies and shared memory are
simulated; the two products run as ``jnp.dot`` there (interpret mode's wgmma takes neither a
transposed shared-memory operand nor a register one), register layouts are not cast and
the output tile has its own buffer (no ref unions there). The compiled kernel's lowering is
checked on any machine by exporting it for CUDA (``tests/test_pallas_mgpu.py``); jax 0.11
lowers with warpgroup semantics, which take no select on a scalar predicate over a vector
(the poisoning below adds a scalar NaN-or-zero instead).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .. import layout as L
from .. import quant as Q
from . import _common as C
from . import _mgpu as M
from . import _triton, merge_mgpu
from ._mgpu import ROWS, available, is_sm90, plgpu
from ._mgpu import unsupported as _unsupported
from .decode import combine, combine_levels_jnp

__all__ = ["available", "default_partition_pages", "is_sm90", "paged_attention", "unsupported"]


def unsupported(
    q, k_cache, v_cache, layout, *, pages_per_step: int, scaled: bool = False
) -> str | None:
    """Why :func:`paged_attention` cannot serve these arguments (``scaled``: with k/v
    scales), or None."""
    return _unsupported(
        q, k_cache, v_cache, layout, pages_per_step=pages_per_step, what="decode", scaled=scaled
    )


# Where the default rule takes this kernel (H200, ``benchmarks/RESULTS.md`` rounds 34-35): head_dim
# 128 (at 64 the Triton kernel was faster on every one-pass row measured, 2-25%), and tables of
# at least 1024 tokens (at 512 it was 7% faster at batch 256, and ahead at batch 64 in figures
# the host bounded). Split grids too since the merge is one kernel reading the packed
# statistics in place: 0.7-3.6% less device time than the Triton kernel on every split row
# measured (batch 1-16, 1024-32768 tokens, round 35).
DEFAULT_HEAD_DIM = 128
MIN_DEFAULT_CAPACITY = 1024


def serves_by_default(q, k_cache, v_cache, layout, block_tables, partition_size) -> bool:
    """Whether ``implementation="pallas"``'s paged decode runs this kernel when no config names
    a lowering: compiled on an sm_90 GPU, a 16-bit cache in q's dtype (FP8 caches keep the
    Triton-lowered kernel, which widens them faster), head_dim :data:`DEFAULT_HEAD_DIM`,
    tables of at least :data:`MIN_DEFAULT_CAPACITY` tokens and no ``partition_size``; one-pass
    and split grids alike (:func:`default_partition_pages` chooses). Elsewhere the Triton
    kernel measured as fast or faster: head_dim 64 and 512-token tables (round 34)."""
    if partition_size is not None or not M.compiled_16bit(q, k_cache):
        return False
    geom = L.get(layout, pool=True).geometry(k_cache, v_cache)
    capacity = block_tables.shape[1] * geom.page_size
    if geom.head_dim != DEFAULT_HEAD_DIM or capacity < MIN_DEFAULT_CAPACITY:
        return False
    per_step = M.steps_of(None, geom.page_size)
    return unsupported(q, k_cache, v_cache, layout, pages_per_step=per_step) is None


@dataclasses.dataclass(frozen=True)
class _Problem:
    """The static shape of one problem of a launch: sequences, query rows a KV head, table
    width, pages a partition, partitions, the table window a block copies, capacity,
    whether one partition is normalised in the kernel, and ``slots``: 0, or the number of
    q's sequences whose rows a block gathers (its q rows are then ``slots`` x q's group)."""

    B: int
    G: int
    W: int
    partition_pages: int
    parts: int
    window: int
    capacity: int
    one_pass: bool
    slots: int = 0

    @classmethod
    def of(cls, q, tables, partition_pages, capacity, page_size, partials, slots=0):
        parts = -(-(capacity // page_size) // partition_pages)
        window = _window(partition_pages)
        W = tables.shape[1]
        assert window <= tables.size, "the wrapper pads the table"
        return cls(
            tables.shape[0], q.shape[2] * max(slots, 1), W, partition_pages, parts, window,
            capacity, parts == 1 and not partials, slots,
        )  # fmt: skip

    def blocks(self, num_kv_heads: int) -> int:
        return num_kv_heads * self.B * self.parts

    def coords(self, i, num_kv_heads: int):
        """(KV head, sequence, partition) of block ``i`` of a flat grid: KV head fastest,
        then sequence, as in the 3-D grid of one problem."""
        return i % num_kv_heads, (i // num_kv_heads) % self.B, i // (num_kv_heads * self.B)


def _kernel_call(
    q,
    k_cache,
    v_cache,
    tables,
    lens,
    *,
    geom,
    layout,
    scale,
    soft_cap,
    partition_pages,
    pages_per_step,
    stages,
    capacity,
    registers,
    specialized,
    interpret,
    out_dtype,
    factors=None,
    partials=False,
    second=None,
    rows=None,
):
    """One partition (``parts == 1``, unless ``partials``): the attention ``[B, Hkv, group,
    D]`` in ``out_dtype``, normalised in the kernel. Several (or ``partials``): (acc
    f32[B, parts, Hkv, group, D] unnormalised, ml f32[B, parts, Hkv, 2, 64]: base-2 max and
    sum) of every partition, laid out for the merge. q is ``[B, Hkv, group, D]`` (its ``[B,
    Hq, D]`` viewed so); FP8 caches: q is float16 and ``factors`` f32[2 * H32] each KV head's
    score factor (:func:`._mgpu.to_float16`) in its first half and value scale in its second
    (H32: Hkv rounded up to a multiple of 32, :func:`fp8_factors`).

    ``second``: (q, tables, lens, partition_pages, capacity) of a second problem over the
    same caches, run by the same launch (a flat grid: the first problem's blocks, then the
    second's), both with ``partials`` (one warpgroup; an FP8 cache's ``factors`` serve both,
    so both q are the same); its (acc, ml) follow the first's.

    ``rows``: int32[tables' sequences, slots] or None. Given, the first problem's block of
    sequence ``b`` holds the rows of q's sequences ``rows[b, 0..slots)`` (each q's group of
    one KV head, copied one after the other into its 64 rows), not q's sequence ``b``: the
    Mosaic GPU cascade's prefix tiles, gathered by the block's copies."""
    D = q.shape[3]
    P, S = geom.num_pages, geom.page_size
    T = pages_per_step * S
    NS = stages
    slots = 0 if rows is None else rows.shape[1]
    specs = [_Problem.of(q, tables, partition_pages, capacity, S, partials, slots)]
    if second is not None:
        assert partials and not specialized, "a second problem: partials, one warpgroup"
        q2, tables2, lens2, partition_pages2, capacity2 = second
        specs.append(_Problem.of(q2, tables2, partition_pages2, capacity2, S, True))
    Hkv = q.shape[1]
    dtype = q.dtype
    bshd = layout == "bshd"
    fp8 = factors is not None
    # FP8 with the copy warpgroup: that warpgroup also widens each step into float16 K and
    # V tiles, so the widening runs beside the compute warpgroup's products.
    converter = fp8 and specialized
    cast, iota = M.layout_ops(interpret)

    def kernel(problems, k_ref, v_ref, fac_ref, outs, scoped):
        wide = fac_smem = None
        if converter:
            # The widened tiles share their memory with the output tile and the staging
            # buffers of q (read before the first tile is widened) and of the output.
            (q_smem, k_smem, v_smem, tab_full, ml_smem, shared, fac_smem), bars = scoped
            wide, o_smem, (stage, ostage) = shared
        else:
            (q_smem, k_and_o, v_smem, tab_full, ml_smem, stage, *fp8_smem), bars = scoped
            ostage = stage  # the output's rows in q's dtype: q's buffer, read by then
            if out_dtype != dtype:  # FP8 caches: q is float16
                ostage, *fp8_smem = fp8_smem
            if fp8:
                fac_smem, *wide = fp8_smem
            # The output tile reuses the K ring: it is written after the last K step is read.
            k_smem, o_smem = k_and_o
        # k_free, v_free: the copy warpgroup's release barriers of the ring's slots; with the
        # converter, the K and V tiles' barriers (0 widened, 1 free).
        q_bars, (tab_bars, fac_bar), k_bars, v_bars, k_free, v_free = bars

        def body(pi, h, b, part):
            """Block (KV head h, sequence b, partition part) of problem ``pi``."""
            sp = specs[pi]
            q_ref, tab_ref, len_ref, rows_ref = problems[pi]
            q_bar = q_bars[pi]
            outs_p = outs[2 * pi : 2 * pi + 2]
            G, W, tab_window, partition_pages = sp.G, sp.W, sp.window, sp.partition_pages
            capacity, one_pass = sp.capacity, sp.one_pass
            tab_bar = tab_bars[pi]
            tab_smem = tab_full.at[pl.ds(0, tab_window)]
            # The partition's window of the flattened table, moved back to end at the table's
            # end where it would run past it (page_at shifts its index by as much); entries
            # past the row are the next rows' (never a page of this sequence, see page_at).
            first_entry = b * W + part * partition_pages
            window_start = jnp.minimum(first_entry, sp.B * W - tab_window)
            window_shift = first_entry - window_start
            wg = lax.axis_index("wg") if specialized else 0
            memory_wg, compute_wg = (1, 0) if specialized else (0, 0)

            @pl.when(wg == memory_wg)
            def _():
                M.copy_vector(tab_ref, window_start, tab_smem, tab_bar)
                if fp8:
                    plgpu.copy_gmem_to_smem(fac_ref, fac_smem, fac_bar)

            @pl.when(wg == compute_wg)
            def _():
                # The group's rows of q, straight from q, into the staging buffer: issued with
                # the table's copy, so the two latencies overlap.
                if not sp.slots:
                    plgpu.copy_gmem_to_smem(q_ref.at[b, h], stage.at[pl.ds(0, G)], q_bar)
                group = G // max(sp.slots, 1)
                for slot in range(sp.slots):  # a gathered block: a copy per q sequence
                    src = jnp.clip(rows_ref[b * sp.slots + slot], 0, q_ref.shape[0] - 1)
                    rows_at = stage.at[pl.ds(slot * group, group)]
                    plgpu.copy_gmem_to_smem(q_ref.at[src, h], rows_at, q_bar)

            length = len_ref[b]  # a scalar load from global memory, in flight with the copies
            plgpu.barrier_wait(tab_bar)
            bad_len = (length < 0) | (length > capacity)
            length = jnp.clip(length, 0, capacity)
            first_page = part * partition_pages
            n_tok = jnp.clip(length - first_page * S, 0, partition_pages * S)
            n_steps = (n_tok + T - 1) // T
            n_pages = (n_tok + S - 1) // S  # the partition's pages the sequence reads

            def page_at(c):
                """The partition's ``c``-th page (``c < partition_pages`` by the loops), checked."""
                # Entries past the row's end (never a page the sequence reads: its length is
                # clipped to the capacity) are the next rows' or clamped into the window.
                entry = jnp.minimum(
                    jnp.minimum(c, partition_pages - 1) + window_shift, tab_window - 1
                )
                page = tab_smem[entry]
                ok = (page >= 0) & (page < P)
                return jnp.where(ok, page, 0), ok

            k, v = (k_ref, k_smem, k_bars), (v_ref, v_smem, v_bars)
            ring = M.PageRing(
                k, v, n_steps, page_of=lambda c: page_at(c)[0], head=h, bshd=bshd,
                pages_per_step=pages_per_step, page_size=S, stages=NS,
                warp=M.experiment("copy_warp", interpret),
            )  # fmt: skip
            if not specialized:
                # One warpgroup: the first NS steps' copies go out before q is awaited; after step
                # i has read its slot it copies step i + NS into it (ring.refill).
                ring.prologue()

            @pl.when(wg == compute_wg)
            def _compute():
                if registers is not None and specialized and not interpret:
                    plgpu.set_max_registers(registers[0], action="increase")
                # q's rows as the first rows of the 64-row operand (the rest zeros), moved
                # through registers into its tiled layout.
                plgpu.barrier_wait(q_bar)
                rows = iota((ROWS, D), 0) < G
                if interpret:
                    q_smem[...] = jnp.where(rows, stage[...], jnp.zeros((ROWS, D), dtype))
                else:
                    q_tile = M.load(stage, layout=plgpu.Layout.WGMMA, optimized=False)
                    q_smem[...] = jnp.where(rows, q_tile, jnp.zeros((ROWS, D), dtype))
                plgpu.commit_smem()
                if converter:  # q is out of its staging buffer: the tiles may be widened
                    plgpu.barrier_arrive(k_free.at[1])
                    plgpu.barrier_arrive(v_free.at[1])
                acc, m_i, l_i = M.initial_state(cast, D)
                fp8_kw = {}
                if fp8:
                    plgpu.barrier_wait(fac_bar)
                    fp8_kw = dict(factor=fac_smem[h])
                    if not converter:
                        fp8_kw["wide"] = tuple(wide)

                def step(i, carry, masked=True):
                    acc, m_i, l_i, bad = carry
                    slot = lax.rem(i, NS)
                    for j in range(pages_per_step):
                        c = i * pages_per_step + j
                        _, ok = page_at(c)
                        bad = bad | ((c < n_pages) & ~ok)

                    def released(free, triple):
                        # The copy warpgroup refills the slot, or this one does it now.
                        if specialized:
                            return lambda: plgpu.barrier_arrive(free.at[slot])
                        return lambda: ring.refill(triple, i)

                    rings = dict(k_smem=k_smem, v_smem=v_smem, k_bars=k_bars, v_bars=v_bars)
                    reads = dict(k_read=released(k_free, k), v_read=released(v_free, v))
                    if converter:  # the widened tiles, each released once its product is done
                        rings = dict(k_smem=wide[0], v_smem=wide[1], k_bars=k_free.at[0],
                                     v_bars=v_free.at[0])  # fmt: skip
                        reads = dict(k_read=lambda: plgpu.barrier_arrive(k_free.at[1]),
                                     v_read=lambda: plgpu.barrier_arrive(v_free.at[1]))  # fmt: skip
                    acc, m_i, l_i = M.ring_step(
                        i, slot, (acc, m_i, l_i), q_smem=q_smem, keys=T, scale=scale,
                        soft_cap=soft_cap, iota=iota,
                        visible=(lambda key: key < n_tok) if masked else None,
                        n_keys=n_tok, interpret=interpret, prewidened=converter, **rings, **reads,
                        **fp8_kw,
                    )  # fmt: skip
                    return acc, m_i, l_i, bad

                carry = (acc, m_i, l_i, bad_len)
                first_masked = 0
                if M.experiment("unmasked_steps", interpret):
                    first_masked = n_tok // T  # the steps before hold T visible keys each
                    unmasked = functools.partial(step, masked=False)
                    carry = lax.fori_loop(0, first_masked, unmasked, carry)
                acc, m_i, l_i, bad = lax.fori_loop(first_masked, n_steps, step, carry)
                # A poisoned sequence: NaN partitions, which the merge turns into NaN rows.
                # (Added as a scalar: a select on a scalar predicate is no vector op there.)
                poison = jnp.where(bad, jnp.nan, 0.0).astype(jnp.float32)
                if fp8:  # the output is linear in the values
                    acc = acc * fac_smem[fac_smem.shape[0] // 2 + h]
                # Only the group's rows leave: the padding rows of the tile are never read.
                if one_pass:
                    # Normalised here (a row with no key, l = 0, is 0, as the merge makes it).
                    safe = jnp.where(l_i == 0.0, 1.0, l_i)
                    out = acc / lax.broadcast_in_dim(safe, acc.shape, [0]) + poison
                    ostage[...] = out.astype(out_dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(ostage.at[pl.ds(0, G)], outs_p[0].at[b, h])
                else:
                    acc_ref, ml_ref = outs_p
                    o_smem[...] = acc + poison
                    ml_smem[0] = m_i + poison
                    ml_smem[1] = l_i + poison
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, G)], acc_ref.at[b, part, h])
                    plgpu.copy_smem_to_gmem(ml_smem, ml_ref.at[b, part, h])
                plgpu.wait_smem_to_gmem(0)

            if not specialized:
                return

            def _convert():
                # FP8: the copy warpgroup issues the ring's copies, widens each step into the
                # float16 K and V tiles as the compute warpgroup frees them, and refills the FP8
                # slot it has read.
                ring.prologue()

                def body(i, carry):
                    slot = lax.rem(i, NS)
                    M.widen_step(
                        i, slot, ring=(k_smem, v_smem), bars=(k_bars, v_bars), wide=wide,
                        wide_bars=(k_free, v_free), keys=T, n_keys=n_tok, interpret=interpret,
                    )  # fmt: skip
                    ring.refill(k, i)
                    ring.refill(v, i)
                    return carry

                lax.fori_loop(0, n_steps, body, 0)
                # The last releases (the first ones when there was no step): every phase seen.
                plgpu.barrier_wait(k_free.at[1])
                plgpu.barrier_wait(v_free.at[1])

            @pl.when(wg == memory_wg)
            def _memory():
                if registers is not None and not interpret:
                    plgpu.set_max_registers(registers[1], action="decrease")
                if converter:
                    _convert()
                    return

                def body(i, carry):
                    slot = lax.rem(i, NS)

                    @pl.when(i >= NS)
                    def _():
                        plgpu.barrier_wait(k_free.at[slot])
                        plgpu.barrier_wait(v_free.at[slot])

                    ring.issue(i)
                    return carry

                lax.fori_loop(0, n_steps, body, 0)

                # Observe the releases of the last steps too: a waiter tracks every phase.
                def drain(i, carry):
                    slot = lax.rem(i, NS)
                    plgpu.barrier_wait(k_free.at[slot])
                    plgpu.barrier_wait(v_free.at[slot])
                    return carry

                lax.fori_loop(jnp.maximum(n_steps - NS, 0), n_steps, drain, 0)

        if len(specs) == 1:
            body(0, lax.axis_index("kvh"), lax.axis_index("b"), lax.axis_index("part"))
            return
        item = lax.axis_index("item")
        first = specs[0].blocks(Hkv)
        for pi, start in ((0, 0), (1, first)):

            @pl.when((item >= start) & (item < start + specs[pi].blocks(Hkv)))
            def _(pi=pi, start=start):
                body(pi, *specs[pi].coords(item - start, Hkv))

    def entry(*refs):
        M.dependent_launch(interpret)
        q_ref, k_ref, v_ref, tab_ref, len_ref, fac_ref, *rest = M.split_refs(refs, 5, fp8)
        problems = [(q_ref, tab_ref, len_ref, None)]
        if second is not None:
            problems.append((*rest[:3], None))
            rest = rest[3:]
        if rows is not None:
            problems[0] = (q_ref, tab_ref, len_ref, rest[0])
            rest = rest[1:]
        stage = plgpu.SMEM((ROWS, D), dtype)  # q's rows in, the output's rows out
        window = max(sp.window for sp in specs)
        small = (plgpu.SMEM((window,), jnp.int32), plgpu.SMEM((2, ROWS), jnp.float32))
        if converter:
            fac, *wide = M.fp8_buffers(factors, T, D, dtype)
            shared = M.union(
                tuple(wide),
                plgpu.SMEM((ROWS, D), jnp.float32),
                (stage, plgpu.SMEM((ROWS, D), out_dtype)),
                interpret=interpret,
            )
            ring = M.ring_buffers(NS, T, D, dtype, k_cache.dtype, interpret, output=False)
            smem = ring + (*small, shared, fac)
        else:
            smem = M.ring_buffers(NS, T, D, dtype, k_cache.dtype, interpret) + (*small, stage)
            if out_dtype != dtype:
                smem += (plgpu.SMEM((ROWS, D), out_dtype),)
            if fp8:
                smem += M.fp8_buffers(factors, T, D, dtype)
        free = 2 if converter else NS
        bars = (
            tuple(plgpu.Barrier(num_arrivals=max(sp.slots, 1)) for sp in specs),
            (
                tuple(plgpu.Barrier(num_arrivals=M.vector_copies(sp.window)) for sp in specs),
                plgpu.Barrier() if fp8 else None,
            ),
            plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=NS),
            plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=NS),
            *(
                (plgpu.Barrier(num_barriers=free), plgpu.Barrier(num_barriers=free))
                if specialized
                else (None, None)
            ),
        )
        pl.run_scoped(
            lambda *a: kernel(problems, k_ref, v_ref, fac_ref, rest, a),
            smem,
            bars,
            **(dict(collective_axes="wg") if specialized else {}),
        )

    out_type = ()
    for sp in specs:
        if sp.one_pass:
            out_type += (jax.ShapeDtypeStruct((sp.B, Hkv, sp.G, D), out_dtype),)
        else:
            out_type += (
                jax.ShapeDtypeStruct((sp.B, sp.parts, Hkv, sp.G, D), jnp.float32),
                jax.ShapeDtypeStruct((sp.B, sp.parts, Hkv, 2, ROWS), jnp.float32),
            )
    kw = M.launch_params(interpret)
    if specialized:
        kw |= dict(num_threads=2, thread_name="wg")
    extra = () if factors is None else (factors,)
    if second is None:
        grid = dict(grid=(Hkv, specs[0].B, specs[0].parts), grid_names=("kvh", "b", "part"))
    else:
        grid = dict(grid=(sum(sp.blocks(Hkv) for sp in specs),), grid_names=("item",))
        extra += (q2, tables2.reshape(-1), lens2)
    if rows is not None:
        extra += (rows.reshape(-1).astype(jnp.int32),)
    return plgpu.kernel(entry, out_type=out_type, **grid, **kw)(
        q, k_cache, v_cache, tables.reshape(-1), lens, *extra
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "layout",
        "soft_cap",
        "partition_pages",
        "pages_per_step",
        "stages",
        "registers",
        "specialized",
        "interpret",
        "merge",
    ),
)
def _paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    k_scale,
    v_scale,
    *,
    scale,
    layout,
    soft_cap,
    partition_pages,
    pages_per_step,
    stages,
    registers,
    specialized,
    interpret,
    merge,
):
    geom = L.get(layout, pool=True).geometry(k_cache, v_cache)
    B, Hq, D = q.shape
    Hkv = geom.num_kv_heads
    G = Hq // Hkv
    capacity = block_tables.shape[1] * geom.page_size
    fp8 = Q.is_fp8(k_cache.dtype)
    factors = None
    qk = q
    if fp8:
        qk, factors = fp8_factors(q, Hkv, k_scale, v_scale)
    outs = _kernel_call(
        qk.reshape(B, Hkv, G, D),
        k_cache,
        v_cache,
        _table_windows(block_tables, partition_pages),
        seq_lens.astype(jnp.int32),
        geom=geom,
        layout=L.get(layout, pool=True).name,
        scale=scale,
        soft_cap=soft_cap,
        partition_pages=partition_pages,
        pages_per_step=pages_per_step,
        stages=stages,
        capacity=capacity,
        registers=registers,
        specialized=specialized,
        interpret=interpret,
        out_dtype=q.dtype,
        factors=factors,
    )
    if len(outs) == 1:  # one partition: normalised in the kernel
        return outs[0].reshape(B, Hq, D)
    acc, ml = outs
    if merge == "mosaic_gpu":  # the states read in place, a block per (sequence, head)
        return merge_mgpu.merge(acc, ml, q.dtype, interpret=interpret)
    if merge == "xla":
        return combine_levels_jnp([(False, acc, ml)], None, q.dtype, group=G)
    # [B, parts, Hkv, G, D] is the Triton merge's [B, parts, Hq, D]; the statistics are read
    # in their packed form.
    acc = acc.reshape(B, acc.shape[1], Hq, D)
    return combine(acc, ml, ml, q.dtype, interpret=interpret, group=G)


MERGES = ("mosaic_gpu", "triton", "xla")


def merge_lowering(
    merge: str | None,
    head_dim: int,
    *,
    num_q_heads: int | None = None,
    group: int | None = None,
    tiled: bool = False,
) -> str:
    """The lowering of a split grid's merge: ``merge`` checked, or by default the Mosaic GPU
    merge kernel (:mod:`jaxattn.pallas.merge_mgpu`) at head_dim a multiple of 128 (its form
    compiled and timed on an H200), else the Triton-lowered one
    (:func:`jaxattn.pallas.decode.combine`), else, on a JAX without that lowering
    (:func:`jaxattn.pallas._triton.missing`), XLA's reductions
    (:func:`jaxattn.pallas.decode.combine_levels_jnp`). ``merge="mosaic_gpu"`` also takes
    head_dim 64 (:func:`jaxattn.pallas.merge_mgpu.unsupported`; ``tiled``: with the
    cascade's prefix tiles, ``group`` its GQA group): correct on an H200 and no faster there
    than the Triton-lowered merge (the decode 2% and 10% slower at batch 8 and 1, even at
    64 x 512)."""
    why = merge_mgpu.unsupported(head_dim, num_q_heads=num_q_heads, group=group, tiled=tiled)
    if merge is None:
        if why is None and merge_mgpu.rows_per_block(head_dim) == 1:
            return "mosaic_gpu"
        return "xla" if _triton.missing() else "triton"
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES} or None, got {merge!r}")
    if merge == "mosaic_gpu" and why is not None:
        raise NotImplementedError(why)
    if merge == "triton":
        _triton.require()
    return merge


def _window(partition_pages: int) -> int:
    """Table entries a block copies: its partition's pages, rounded up to 32 (a warpgroup's
    copy moves a multiple of 128 bytes)."""
    return -(-partition_pages // 32) * 32


def _table_windows(block_tables, partition_pages: int):
    """The kernel's block tables: the kernel copies each block's window from the flattened
    table, so a table narrower than a window needs no padding where its rows start on 16
    bytes (a copy's source does); a table of rows not a multiple of 16 bytes, or of fewer
    entries in all than a window, is padded (an XLA kernel; the padding is never read as a
    page of a sequence: capacity is the unpadded one). The lengths are read in place, a
    scalar a block."""
    tables = block_tables.astype(jnp.int32)
    B, W = tables.shape
    width = -(-W // 4) * 4
    if B * width < _window(partition_pages):
        width = _window(partition_pages)
    if width != W:
        tables = jnp.pad(tables, ((0, 0), (0, width - W)))
    return tables


def fp8_factors(q, num_kv_heads: int, k_scale, v_scale):
    """An FP8 cache's kernel inputs: q as float16 and the factors f32[2 * H32] (each KV
    head's score factor, :func:`._mgpu.to_float16`, then its value scale; each half padded
    to H32, ``num_kv_heads`` rounded up to a multiple of 32, the copies' granule)."""
    q16, factor = M.to_float16(q, num_kv_heads, k_scale)
    factors = jnp.concatenate(
        [M.pad_to(factor, 0, 32), M.pad_to(M.head_vector(v_scale, num_kv_heads), 0, 32)]
    )
    return q16, factors


def partial_states(
    q4, k_cache, v_cache, block_tables, seq_lens, *, layout, scale, soft_cap, partition_pages,
    pages_per_step, stages, interpret, second=None, rows=None, k_scale=None, v_scale=None,
):  # fmt: skip
    """Every partition's unnormalised state, never normalised in the kernel (the levels of
    :mod:`jaxattn.pallas.cascade_mgpu`): q4 ``[B, Hkv, G, D]`` (``G <= 64`` rows of one KV
    head a sequence) -> acc f32 ``[B, parts, Hkv, G, D]`` and (max, sum) in base 2, f32
    ``[B, parts, Hkv, 2, 64]`` (entries past ``G`` unused). Lengths and page ids as
    :func:`paged_attention` takes them (a sequence they poison: NaN parts). An FP8 cache
    (``k_scale`` / ``v_scale`` as :func:`paged_attention` takes them) is widened a step at a
    time, q moved to float16 (:func:`fp8_factors`); the values come out dequantised.
    ``second``: (q4, block_tables, seq_lens, partition_pages) of another problem over the
    same caches, run by the same launch (its blocks after the first's; with an FP8 cache its
    q4 is the first's); its (acc, ml) follow the first's. ``rows``: int32[tables' sequences,
    slots], the q sequences whose rows each sequence of the first problem gathers (see
    :func:`_kernel_call`)."""
    geom = L.get(layout, pool=True).geometry(k_cache, v_cache)
    out_dtype, factors = q4.dtype, None
    if Q.is_fp8(k_cache.dtype):
        assert second is None or second[0] is q4, "an FP8 launch: one q for both problems"
        B, Hkv, G, D = q4.shape
        q16, factors = fp8_factors(q4.reshape(B, Hkv * G, D), Hkv, k_scale, v_scale)
        q4 = q16.reshape(B, Hkv, G, D)
        if second is not None:
            second = (q4, *second[1:])

    def prepared(q4, tables, lens, pages):
        """(q, the kernel's tables, lengths, pages a partition, capacity) of a problem."""
        capacity = tables.shape[1] * geom.page_size
        return q4, _table_windows(tables, pages), lens.astype(jnp.int32), pages, capacity

    q4, tables, lens, _, capacity = prepared(q4, block_tables, seq_lens, partition_pages)
    return _kernel_call(
        q4, k_cache, v_cache, tables, lens, geom=geom, layout=L.get(layout, pool=True).name,
        scale=scale, soft_cap=soft_cap, partition_pages=partition_pages,
        pages_per_step=pages_per_step, stages=stages, capacity=capacity, registers=None,
        specialized=False, interpret=interpret, out_dtype=out_dtype, partials=True,
        second=None if second is None else prepared(*second), rows=rows, factors=factors,
    )  # fmt: skip


def default_partition_pages(
    batch: int, num_kv_heads: int, table_width: int, pages_per_step: int, *, target_blocks=None
) -> int:
    """Pages per split-KV partition: the whole table (one pass) when the (sequence, KV head)
    pairs fill most of ``target_blocks`` (default two blocks a multiprocessor), else the
    table cut into as many partitions as keep the grid within it, in whole steps."""
    target = target_blocks or 2 * C.num_sms()
    pairs = batch * num_kv_heads
    whole = -(-table_width // pages_per_step) * pages_per_step
    if 5 * pairs >= 4 * target:
        return whole
    parts = max(1, target // pairs)
    size = -(-table_width // parts)
    return min(whole, -(-size // pages_per_step) * pages_per_step)


def resolve_partition_pages(
    value, *, name: str, batch: int, num_kv_heads: int, table_width: int, pages_per_step: int
) -> int:
    """A partition size in pages: ``value``, or :func:`default_partition_pages` of the grid
    when None; a ValueError naming ``name`` unless it is a positive multiple of
    ``pages_per_step``."""
    if value is None:
        value = default_partition_pages(batch, num_kv_heads, table_width, pages_per_step)
    if value < 1 or value % pages_per_step:
        raise ValueError(
            f"{name} must be a positive multiple of pages_per_step={pages_per_step}, got {value}"
        )
    return int(value)


def paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    *,
    scale=None,
    layout="bshd",
    soft_cap=None,
    partition_pages: int | None = None,
    pages_per_step: int | None = None,
    stages: int | None = None,
    registers: tuple[int, int] | None = None,
    specialized: bool = False,
    interpret: bool | None = None,
    k_scale=None,
    v_scale=None,
    merge: str | None = None,
):
    """Decode attention over a paged cache, ``q [B, Hq, D] -> [B, Hq, D]``, on the Mosaic GPU
    lowering (see the module docstring). An FP8 cache (e4m3 / e5m2, ``k_scale`` /
    ``v_scale``: None, a scalar or f32 ``[Hkv]``) is widened to float16 a step at a time in
    shared memory, with q moved to float16 by a power of two per KV head
    (:func:`._mgpu.to_float16`); scales with a 16-bit cache are refused.
    ``partition_pages``: pages per split-KV partition (a multiple of ``pages_per_step``;
    default :func:`default_partition_pages`);
    ``pages_per_step``: pages a step copies, whole 64-row tiles (default: the fewest);
    ``specialized``: a copy warpgroup beside the compute warpgroup, or (False) one
    warpgroup that issues its own copies ``stages`` steps ahead in half the threads; with an
    FP8 cache the copy warpgroup also widens each step into float16 K and V tiles while the
    compute warpgroup runs the previous step's products (H200, e4m3, 64 x 4096: 308-365 us
    against 416-418 us for one warpgroup; the Triton-lowered kernel, FP8's default, 261 us);
    ``stages``: steps in flight. The defaults are the fastest of an H200 sweep (bf16,
    head_dim 128, page 16): one warpgroup and 2 stages, for one-pass and split grids alike
    (the copy warpgroup takes 3 stages when asked for without a count).
    ``registers``: (compute, copy) warpgroup register counts set at entry (``specialized``
    only), or None to leave the compiler's. ``merge``: the split grid's merge,
    ``"mosaic_gpu"`` (:mod:`jaxattn.pallas.merge_mgpu`), ``"triton"``
    (:func:`jaxattn.pallas.decode.combine`) or ``"xla"`` (jnp reductions,
    :func:`jaxattn.pallas.decode.combine_levels_jnp`); None: :func:`merge_lowering`'s choice.
    ``interpret``: None runs interpret mode exactly on the CPU. Raises
    ``NotImplementedError`` for what :func:`unsupported` refuses."""
    geom = L.get(layout, pool=True).geometry(k_cache, v_cache)
    pages_per_step = M.steps_of(pages_per_step, geom.page_size)
    partition_pages = resolve_partition_pages(
        partition_pages, name="partition_pages", batch=q.shape[0],
        num_kv_heads=geom.num_kv_heads, table_width=block_tables.shape[1],
        pages_per_step=pages_per_step,
    )  # fmt: skip
    if stages is None:
        stages = 3 if specialized else 2
    if registers is not None:
        registers = tuple(int(r) for r in registers)
        if len(registers) != 2 or any(r % 8 or not 24 <= r <= 256 for r in registers):
            raise ValueError(f"registers must be two multiples of 8 in [24, 256], got {registers}")
    scaled = k_scale is not None or v_scale is not None
    why = unsupported(q, k_cache, v_cache, layout, pages_per_step=pages_per_step, scaled=scaled)
    scale, interpret = M.finish_args(why, stages, scale, geom.head_dim, interpret)
    merge = merge_lowering(merge, geom.head_dim, num_q_heads=q.shape[1])
    return _paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        k_scale,
        v_scale,
        scale=scale,
        layout=layout,
        soft_cap=None if soft_cap is None else float(soft_cap),
        partition_pages=partition_pages,
        pages_per_step=pages_per_step,
        stages=int(stages),
        registers=registers,
        specialized=bool(specialized),
        interpret=interpret,
        merge=merge,
    )
