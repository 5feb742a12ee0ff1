"""Functional paged KV memory: :class:`~jaxattn.paging.BlockManager` as a pytree of arrays.

:class:`PageTable` holds the whole block manager in fixed-shape arrays, so a jitted serving
step can allocate, grow, fork and copy-on-write without a round trip to the host. It is a
frozen dataclass registered as a pytree, and the class is also the namespace of its pure
functions: each takes a state and returns a new one, never mutating its input::

    pt = PageTable.init(num_blocks=64, block_size=16, max_seqs=8, max_blocks_per_seq=16)
    pt = PageTable.allocate(pt, 0, 37)           # or pt.allocate(0, 37)
    pt = PageTable.fork(pt, 0, 1)
    pt, cow = PageTable.append_slot(pt, 1)       # cow = (src, dst) or (-1, -1)
    slots = PageTable.slot_mapping(pt, 1, 0, length=64)
    assert int(pt.status) == Status.OK

Every operation matches the host ``BlockManager`` op for op: the same blocks are handed
out in the same order (the host free list is kept verbatim as an array stack), the same
copy-on-write orders are returned, and the same requests fail. Sequences are small integer
ids in ``[0, max_seqs)``.

Failure never raises (values are unknown under ``jit``) and never corrupts: the op sets
``status`` to one of the :class:`Status` codes and leaves every other field exactly as it
was. ``status`` always describes the last operation, so check it after each op, or fold it
(``jnp.maximum`` over steps) when a loop runs many ops before looking.

The host raises where this sets a status; the functional table also has fixed capacities
the host lacks, hence ``UNKNOWN_SEQ`` (id out of range) and ``TABLE_FULL``.

A decode step over a batch uses :meth:`PageTable.append_slot_batch` (the sequential loop
of ``append_slot`` in one vectorised pass) and the kernel-ready views, all in one jit::

    pt, cow, status = pt.append_slot_batch(seqs)
    k, v = copy_blocks(k, v, cow[:, 0], cow[:, 1])
    lens = pt.seq_lens(seqs)
    slots = jax.vmap(lambda s, n: pt.slot_mapping(s, n - 1, 1)[0])(seqs, lens)
    slots = jnp.where(status == Status.OK, slots, -1)  # a failed append writes nothing
    k, v = write_kv(k, v, k_new, v_new, slots)
    out = paged_attention(q, k, v, pt.block_tables(seqs), lens)

Under ``jax.jit`` the static shapes are the array shapes plus the two static fields
``block_size`` and ``watermark_blocks``; ``slot_mapping``'s ``length`` must be static. Under
``jax.vmap`` a stack of states (same shapes and static fields) is a batch of independent
page tables.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.paging.slots import token_slots

__all__ = ["PageTable", "Status", "check_invariants"]


class Status(enum.IntEnum):
    """Result of the last :class:`PageTable` operation, stored in ``PageTable.status``.

    When several apply, the lowest-listed check below wins, in this order: ``UNKNOWN_SEQ``,
    then the sequence's state (``INACTIVE_SEQ`` / ``ACTIVE_SEQ``), ``INVALID_ARGUMENT``,
    ``TABLE_FULL``, ``NO_FREE_BLOCKS`` -- the static problems before the one that freeing
    memory could cure.
    """

    OK = 0
    #: The pool has fewer free blocks than the op needs (host: ``NoFreeBlocksError``).
    NO_FREE_BLOCKS = 1
    #: A sequence id outside ``[0, max_seqs)`` (the host accepts any id).
    UNKNOWN_SEQ = 2
    #: The sequence (or fork parent) is not allocated (host: ``ValueError``).
    INACTIVE_SEQ = 3
    #: ``allocate`` or a fork child onto a sequence that is already allocated.
    ACTIVE_SEQ = 4
    #: The sequence would need more than ``max_blocks_per_seq`` blocks (host: unbounded).
    TABLE_FULL = 5
    #: A negative token count, or a sequence listed twice in one ``append_slot_batch``.
    INVALID_ARGUMENT = 6


def _i32(x) -> jax.Array:
    return jnp.asarray(x, jnp.int32)


def _blocks_for(num_tokens, block_size: int) -> jax.Array:
    # ceil without the ``n + P - 1`` that overflows int32 near its top.
    return num_tokens // block_size + (num_tokens % block_size != 0).astype(jnp.int32)


def _first_failure(*checks) -> jax.Array:
    """The code of the first failed ``(failed, code)`` check, OK when none failed."""
    status = jnp.int32(Status.OK)
    for failed, code in reversed(checks):
        status = jnp.where(failed, jnp.int32(code), status)
    return status


def _masked(mask, index, size: int) -> jax.Array:
    # Masked-off entries go out of range so that a mode="drop" scatter skips them (a -1
    # would wrap around to the last element).
    return jnp.where(mask, index, size)


def _check_size(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class PageTable:
    """The block manager's state; its methods are the pure operations.

    Fields (``N`` blocks, ``S = max_seqs``, ``M = max_blocks_per_seq``):
      ref_counts: ``i32[N]``, holders of each block; 0 means free.
      free_stack: ``i32[N]``, the host allocator's free list: ``free_stack[:num_free]`` with
        the next block to hand out on top (at ``num_free - 1``); -1 above the top.
      num_free: ``i32[]``.
      tables: ``i32[S, M]``, each sequence's blocks, -1 past its last block and in rows of
        inactive sequences. :meth:`block_tables` gives kernel-ready rows.
      lens: ``i32[S]``, tokens per sequence (0 when inactive).
      active: ``bool[S]``, whether the sequence is allocated.
      status: ``i32[]``, the :class:`Status` of the last operation.
      block_size: static, tokens per block.
      watermark_blocks: static, blocks :meth:`can_allocate` keeps in reserve.
    """

    ref_counts: jax.Array
    free_stack: jax.Array
    num_free: jax.Array
    tables: jax.Array
    lens: jax.Array
    active: jax.Array
    status: jax.Array
    block_size: int
    watermark_blocks: int = 0

    # -- construction and sizes ------------------------------------------------------------

    @staticmethod
    def init(
        num_blocks: int,
        block_size: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        *,
        watermark: float = 0.0,
    ) -> PageTable:
        """An empty page table; ``watermark`` as in ``BlockManager(..., watermark=)``."""
        num_blocks = _check_size("num_blocks", num_blocks)
        block_size = _check_size("block_size", block_size)
        max_seqs = _check_size("max_seqs", max_seqs)
        max_blocks_per_seq = _check_size("max_blocks_per_seq", max_blocks_per_seq)
        if not 0.0 <= float(watermark) < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        if num_blocks * block_size >= 2**31:
            raise ValueError(f"{num_blocks=} * {block_size=} slots overflow int32 slot ids")
        return PageTable(
            ref_counts=jnp.zeros(num_blocks, jnp.int32),
            # The host list pops from its end, so block 0 sits on top.
            free_stack=jnp.arange(num_blocks - 1, -1, -1, dtype=jnp.int32),
            num_free=jnp.int32(num_blocks),
            tables=jnp.full((max_seqs, max_blocks_per_seq), -1, jnp.int32),
            lens=jnp.zeros(max_seqs, jnp.int32),
            active=jnp.zeros(max_seqs, jnp.bool_),
            status=jnp.int32(Status.OK),
            block_size=block_size,
            watermark_blocks=int(float(watermark) * num_blocks),
        )

    # Trailing axes, so that these also read right on a vmapped (stacked) state.
    @property
    def num_blocks(self) -> int:
        return self.ref_counts.shape[-1]

    @property
    def max_seqs(self) -> int:
        return self.tables.shape[-2]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.tables.shape[-1]

    # -- internals -------------------------------------------------------------------------

    def _seq(self, seq):
        """(row index safe to gather with, unknown flag, active flag)."""
        seq = _i32(seq)
        unknown = (seq < 0) | (seq >= self.max_seqs)
        row = jnp.clip(seq, 0, self.max_seqs - 1)
        return row, unknown, self.active[row] & ~unknown

    def _commit(self, new: PageTable, status) -> PageTable:
        """``new`` if status is OK, else ``self`` unchanged; either way with ``status``."""
        ok = status == Status.OK
        merged = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, self)
        return dataclasses.replace(merged, status=status)

    # -- queries ---------------------------------------------------------------------------

    def can_allocate(self, num_tokens) -> jax.Array:
        """``bool[]``: a new prompt of ``num_tokens`` fits and leaves the watermark free."""
        n = _i32(num_tokens)
        needed = _blocks_for(jnp.maximum(n, 0), self.block_size)
        return (n >= 0) & (self.num_free - needed >= self.watermark_blocks)

    def can_append_slot(self, seq) -> jax.Array:
        """``bool[]``: :meth:`append_slot` on ``seq`` would succeed now."""
        return self.append_slot(seq)[0].status == Status.OK

    def block_tables(self, seqs, pad_value: int = 0) -> jax.Array:
        """``i32[len(seqs), max_blocks_per_seq]``, rows padded with ``pad_value``.

        The default pads with block 0, a valid index like ``BlockManager.block_tables``:
        kernels stop at the sequence length, and a gather of a valid page cannot fault.
        Unknown or inactive sequences get an all-padding row.
        """
        seqs = _i32(seqs)
        rows = self.tables[jnp.clip(seqs, 0, self.max_seqs - 1)]
        known = (seqs >= 0) & (seqs < self.max_seqs)
        return jnp.where(known[..., None] & (rows >= 0), rows, jnp.int32(pad_value))

    def seq_lens(self, seqs) -> jax.Array:
        """``i32[len(seqs)]``, 0 for unknown or inactive sequences."""
        seqs = _i32(seqs)
        known = (seqs >= 0) & (seqs < self.max_seqs)
        return jnp.where(known, self.lens[jnp.clip(seqs, 0, self.max_seqs - 1)], 0)

    def slot_mapping(self, seq, start, length: int) -> jax.Array:
        """``i32[length]``: pool slots of tokens ``[start, start + length)`` of ``seq``.

        Positions outside ``[0, seq_len)`` -- and every position of an unknown or inactive
        sequence -- map to -1, which ``write_kv`` skips. ``length`` must be static.
        """
        length = _check_size("length", length, minimum=0)
        row, _, active = self._seq(seq)
        pos = _i32(start) + jnp.arange(length, dtype=jnp.int32)
        valid = active & (pos >= 0) & (pos < self.lens[row])
        inside = jnp.clip(pos, 0, self.max_blocks_per_seq * self.block_size - 1)
        return jnp.where(valid, token_slots(self.tables[row], inside, self.block_size), -1)

    # -- operations ------------------------------------------------------------------------

    def allocate(self, seq, num_tokens) -> PageTable:
        """Give the unallocated ``seq`` fresh blocks for a prompt of ``num_tokens``."""
        row, unknown, active = self._seq(seq)
        n = _i32(num_tokens)
        needed = _blocks_for(jnp.maximum(n, 0), self.block_size)
        status = _first_failure(
            (unknown, Status.UNKNOWN_SEQ),
            (active, Status.ACTIVE_SEQ),
            (n < 0, Status.INVALID_ARGUMENT),
            (needed > self.max_blocks_per_seq, Status.TABLE_FULL),
            (needed > self.num_free, Status.NO_FREE_BLOCKS),
        )
        nb, m = self.num_blocks, self.max_blocks_per_seq
        col = jnp.arange(m, dtype=jnp.int32)
        # The j-th block popped sits j below the top of the stack, as in the host's loop.
        top = self.num_free - 1 - col
        take = (col < needed) & (top >= 0)
        blocks = jnp.where(take, self.free_stack[jnp.clip(top, 0, nb - 1)], -1)
        new = dataclasses.replace(
            self,
            ref_counts=self.ref_counts.at[_masked(take, blocks, nb)].set(1, mode="drop"),
            free_stack=self.free_stack.at[_masked(take, top, nb)].set(-1, mode="drop"),
            num_free=self.num_free - needed,
            tables=self.tables.at[row].set(blocks),
            lens=self.lens.at[row].set(n),
            active=self.active.at[row].set(True),
        )
        return self._commit(new, status)

    def append_slot(self, seq) -> tuple[PageTable, jax.Array]:
        """Make room for one more token of ``seq``.

        Returns the new state and the copy-on-write order ``i32[2]`` ``(src, dst)`` -- the
        shared, partially filled tail block and its fresh private copy, to pass to
        ``copy_blocks`` before the token is written -- or ``(-1, -1)`` when nothing must be
        copied (also on failure).
        """
        row, unknown, active = self._seq(seq)
        nb, m, p = self.num_blocks, self.max_blocks_per_seq, self.block_size
        length = self.lens[row]
        held = _blocks_for(length, p)
        table = self.tables[row]
        tail = table[jnp.clip(held - 1, 0, m - 1)]
        partial = length % p != 0
        # Only a partially filled tail is written into; a full shared block stays read-only.
        shared = partial & (self.ref_counts[jnp.clip(tail, 0, nb - 1)] > 1)
        grow = ~partial
        needs = shared | grow
        status = _first_failure(
            (unknown, Status.UNKNOWN_SEQ),
            (~active, Status.INACTIVE_SEQ),
            (grow & (held >= m), Status.TABLE_FULL),
            (needs & (self.num_free < 1), Status.NO_FREE_BLOCKS),
        )
        top = self.num_free - 1
        fresh = self.free_stack[jnp.clip(top, 0, nb - 1)]
        ref = self.ref_counts.at[_masked(needs, fresh, nb)].set(1, mode="drop")
        ref = ref.at[_masked(shared, tail, nb)].add(-1, mode="drop")
        col = jnp.where(shared, held - 1, held)
        table = table.at[_masked(needs, col, m)].set(fresh, mode="drop")
        new = dataclasses.replace(
            self,
            ref_counts=ref,
            free_stack=self.free_stack.at[_masked(needs, top, nb)].set(-1, mode="drop"),
            num_free=self.num_free - needs.astype(jnp.int32),
            tables=self.tables.at[row].set(table),
            lens=self.lens.at[row].add(1),
        )
        cow = jnp.where(shared & (status == Status.OK), jnp.stack([tail, fresh]), -1)
        return self._commit(new, status), cow

    def append_slot_batch(self, seqs) -> tuple[PageTable, jax.Array, jax.Array]:
        """:meth:`append_slot` on each of ``seqs`` in order, vectorised: one decode step.

        Exactly the result of calling :meth:`append_slot` on ``seqs[0]``, ``seqs[1]``, ...
        in turn, except that a sequence listed again after its first occurrence fails with
        ``INVALID_ARGUMENT`` (one token per sequence per step). A failed entry changes
        nothing; the others proceed.

        Returns ``(state, cow, status)``: ``cow`` is ``i32[B, 2]`` with ``(-1, -1)`` rows
        where nothing is copied (ready for ``copy_blocks(..., cow[:, 0], cow[:, 1])``),
        ``status`` is ``i32[B]`` per entry, and ``state.status`` is the first failure in
        batch order (OK if none).

        The sequential loop is replaced by prefix sums. Only copy-on-write makes entries
        depend on one another: holders of one shared tail ``X`` (ref count ``r``) copy in
        batch order while ``X`` still has another holder, so among them only the first
        ``r - 1`` copy -- unless the pool runs dry first, after which every entry that
        needs a block fails and a failed copy leaves ``r`` as it was.
        """
        seqs = _i32(seqs)
        if seqs.ndim != 1:
            raise ValueError(f"seqs must be i32[B], got shape {tuple(seqs.shape)}")
        (b,) = seqs.shape
        nb, s, m, p = self.num_blocks, self.max_seqs, self.max_blocks_per_seq, self.block_size
        unknown = (seqs < 0) | (seqs >= s)
        row = jnp.clip(seqs, 0, s - 1)
        idx = jnp.arange(b, dtype=jnp.int32)
        before = idx[None, :] < idx[:, None]  # [i, j]: entry j comes before entry i
        repeated = jnp.any(before & (seqs[None, :] == seqs[:, None]), axis=1)
        length = self.lens[row]
        held = _blocks_for(length, p)
        tail = jnp.take_along_axis(self.tables[row], jnp.clip(held - 1, 0, m - 1)[:, None], 1)
        tail = tail[:, 0]
        partial = length % p != 0
        grow = ~partial
        pre = _first_failure(
            (unknown, Status.UNKNOWN_SEQ),
            (~(self.active[row] & ~unknown), Status.INACTIVE_SEQ),
            (repeated, Status.INVALID_ARGUMENT),
            (grow & (held >= m), Status.TABLE_FULL),
        )
        live = pre == Status.OK
        refs = self.ref_counts[jnp.clip(tail, 0, nb - 1)]
        candidate = live & partial & (refs > 1)
        same_tail = before & candidate[None, :] & (tail[None, :] == tail[:, None])
        # Pass 1, as if the pool were endless: the k-th holder of X in batch order copies
        # iff k < r - 1. It tells where the pool runs dry: first entry past num_free.
        wants = live & (grow | (candidate & (jnp.sum(same_tail, axis=1) < refs - 1)))
        dry = jnp.min(jnp.where(wants & (jnp.cumsum(wants) > self.num_free), idx, b))
        # Pass 2: only holders processed before the pool ran dry can have copied.
        copied_before = jnp.sum(same_tail & (idx < dry)[None, :], axis=1)
        needs = live & (grow | (candidate & (copied_before < refs - 1)))
        used = jnp.cumsum(needs.astype(jnp.int32))
        got = needs & (used <= self.num_free)
        cow = got & candidate
        status = jnp.where(needs & ~got, jnp.int32(Status.NO_FREE_BLOCKS), pre)
        ok = status == Status.OK
        # The k-th block taken in the step (k = used - 1) is k below the top.
        pos = self.num_free - used
        fresh = self.free_stack[jnp.clip(pos, 0, nb - 1)]
        ref = self.ref_counts.at[_masked(got, fresh, nb)].set(1, mode="drop")
        ref = ref.at[_masked(cow, tail, nb)].add(-1, mode="drop")
        col = jnp.where(cow, held - 1, held)
        taken = jnp.sum(got.astype(jnp.int32))
        new = dataclasses.replace(
            self,
            ref_counts=ref,
            free_stack=self.free_stack.at[_masked(got, pos, nb)].set(-1, mode="drop"),
            num_free=self.num_free - taken,
            tables=self.tables.at[_masked(got, row, s), col].set(fresh, mode="drop"),
            lens=self.lens.at[_masked(ok, row, s)].add(1, mode="drop"),
        )
        failed = ~ok
        first = jnp.where(jnp.any(failed), status[jnp.argmax(failed)], jnp.int32(Status.OK))
        pairs = jnp.where(cow[:, None], jnp.stack([tail, fresh], axis=1), -1)
        return dataclasses.replace(new, status=first), pairs, status

    def append_slots_batch(self, seqs, counts) -> tuple[PageTable, jax.Array, jax.Array]:
        """Grow ``seqs[i]`` by ``counts[i]`` slots, in order: the host's
        ``BlockManager.append_slots(seqs[i], counts[i])`` for each entry in turn, when the
        pool can supply every entry; otherwise no entry changes.

        A sequence listed twice after its first occurrence, a negative count, an unknown or
        inactive sequence, or a table that would exceed ``max_blocks_per_seq`` fails that
        entry alone (``INVALID_ARGUMENT``, ``UNKNOWN_SEQ``, ``INACTIVE_SEQ``,
        ``TABLE_FULL``). The others take their blocks in batch order - a copy-on-write block
        first (a shared partial tail, the first ``r - 1`` of its ``r`` holders in batch
        order, as in :meth:`append_slot_batch`), then the new blocks - all of them or, when
        fewer are free than they need together, none (``NO_FREE_BLOCKS`` on each).

        Returns ``(state, cow, status)`` as :meth:`append_slot_batch`: ``cow`` ``i32[B, 2]``
        ``(src, dst)`` per entry, ``(-1, -1)`` where nothing is copied.
        """
        seqs, counts = _i32(seqs), _i32(counts)
        if seqs.ndim != 1 or counts.shape != seqs.shape:
            raise ValueError(
                f"seqs and counts must be i32[B] of one length, got {tuple(seqs.shape)} and "
                f"{tuple(counts.shape)}"
            )
        (b,) = seqs.shape
        nb, s, m, p = self.num_blocks, self.max_seqs, self.max_blocks_per_seq, self.block_size
        unknown = (seqs < 0) | (seqs >= s)
        row = jnp.clip(seqs, 0, s - 1)
        idx = jnp.arange(b, dtype=jnp.int32)
        before = idx[None, :] < idx[:, None]  # [i, j]: entry j comes before entry i
        repeated = jnp.any(before & (seqs[None, :] == seqs[:, None]), axis=1)
        length = self.lens[row]
        held = _blocks_for(length, p)
        total = _blocks_for(length + jnp.maximum(counts, 0), p)
        status = _first_failure(
            (unknown, Status.UNKNOWN_SEQ),
            (~(self.active[row] & ~unknown), Status.INACTIVE_SEQ),
            (repeated | (counts < 0), Status.INVALID_ARGUMENT),
            (total > m, Status.TABLE_FULL),
        )
        live = (status == Status.OK) & (counts > 0)
        tail = jnp.take_along_axis(self.tables[row], jnp.clip(held - 1, 0, m - 1)[:, None], 1)
        tail = tail[:, 0]
        refs = self.ref_counts[jnp.clip(tail, 0, nb - 1)]
        candidate = live & (length % p != 0) & (refs > 1)
        same_tail = before & candidate[None, :] & (tail[None, :] == tail[:, None])
        cow = candidate & (jnp.sum(same_tail, axis=1) < refs - 1)
        grow = jnp.where(live, total - held, 0)
        need = cow.astype(jnp.int32) + grow
        short = jnp.sum(need) > self.num_free
        status = jnp.where(live & short, jnp.int32(Status.NO_FREE_BLOCKS), status)
        take = live & ~short
        cow, grow = cow & take, jnp.where(take, grow, 0)
        need = cow.astype(jnp.int32) + grow
        first = jnp.cumsum(need) - need  # blocks taken before this entry
        # The k-th block taken in the batch sits k below the top of the stack.
        cow_pos = self.num_free - 1 - first
        cow_block = self.free_stack[jnp.clip(cow_pos, 0, nb - 1)]
        j = jnp.arange(m, dtype=jnp.int32)[None, :]
        new = j < grow[:, None]  # [B, M]: the j-th new block of each entry
        new_pos = self.num_free - 1 - (first + cow.astype(jnp.int32))[:, None] - j
        new_block = self.free_stack[jnp.clip(new_pos, 0, nb - 1)]
        ref = self.ref_counts.at[_masked(cow, cow_block, nb)].set(1, mode="drop")
        ref = ref.at[_masked(new, new_block, nb)].set(1, mode="drop")
        ref = ref.at[_masked(cow, tail, nb)].add(-1, mode="drop")
        used = jnp.sum(need)
        stack_pos = jnp.arange(nb, dtype=jnp.int32)
        gone = (stack_pos >= self.num_free - used) & (stack_pos < self.num_free)
        tables = self.tables.at[_masked(cow, row, s), held - 1].set(cow_block, mode="drop")
        tables = tables.at[_masked(new, row[:, None], s), held[:, None] + j].set(
            new_block, mode="drop"
        )
        state = dataclasses.replace(
            self,
            ref_counts=ref,
            free_stack=jnp.where(gone, -1, self.free_stack),
            num_free=self.num_free - used,
            tables=tables,
            lens=self.lens.at[_masked(take, row, s)].add(counts, mode="drop"),
        )
        failed = status != Status.OK
        first_fail = jnp.where(jnp.any(failed), status[jnp.argmax(failed)], jnp.int32(Status.OK))
        pairs = jnp.where(cow[:, None], jnp.stack([tail, cow_block], axis=1), -1)
        return dataclasses.replace(state, status=first_fail), pairs, status

    def fork(self, parent, child) -> PageTable:
        """Give the unallocated ``child`` the parent's blocks; ref counts +1, no copy."""
        prow, punknown, pactive = self._seq(parent)
        crow, cunknown, cactive = self._seq(child)
        status = _first_failure(
            (punknown | cunknown, Status.UNKNOWN_SEQ),
            (~pactive, Status.INACTIVE_SEQ),
            (cactive, Status.ACTIVE_SEQ),
        )
        table = self.tables[prow]
        new = dataclasses.replace(
            self,
            ref_counts=self.ref_counts.at[_masked(table >= 0, table, self.num_blocks)].add(
                1, mode="drop"
            ),
            tables=self.tables.at[crow].set(table),
            lens=self.lens.at[crow].set(self.lens[prow]),
            active=self.active.at[crow].set(True),
        )
        return self._commit(new, status)

    def free(self, seq) -> PageTable:
        """Drop ``seq``; blocks no other sequence holds return to the free stack."""
        row, unknown, active = self._seq(seq)
        status = _first_failure((unknown, Status.UNKNOWN_SEQ), (~active, Status.INACTIVE_SEQ))
        nb = self.num_blocks
        table = self.tables[row]
        held = table >= 0
        ref = self.ref_counts.at[_masked(held, table, nb)].add(-1, mode="drop")
        released = held & (ref[jnp.clip(table, 0, nb - 1)] == 0)
        # The host releases the tail first, so the prompt's head is handed out last.
        rev_table, rev_released = table[::-1], released[::-1]
        pos = self.num_free + jnp.cumsum(rev_released.astype(jnp.int32)) - 1
        stack = self.free_stack.at[_masked(rev_released, pos, nb)].set(rev_table, mode="drop")
        new = dataclasses.replace(
            self,
            ref_counts=ref,
            free_stack=stack,
            num_free=self.num_free + jnp.sum(released.astype(jnp.int32)),
            tables=self.tables.at[row].set(-1),
            lens=self.lens.at[row].set(0),
            active=self.active.at[row].set(False),
        )
        return self._commit(new, status)


jax.tree_util.register_dataclass(
    PageTable,
    data_fields=["ref_counts", "free_stack", "num_free", "tables", "lens", "active", "status"],
    meta_fields=["block_size", "watermark_blocks"],
)


def check_invariants(state: PageTable) -> None:
    """Raise AssertionError unless an (unbatched) state is consistent.

    Ref counts equal table membership, each active table holds exactly
    ``ceil(len / block_size)`` distinct blocks then -1s, inactive rows are empty, and the
    free stack holds exactly the blocks with ref count 0, once each, with -1 above its top.
    """
    ref = np.asarray(state.ref_counts)
    stack = np.asarray(state.free_stack)
    tables, lens, active = (np.asarray(x) for x in (state.tables, state.lens, state.active))
    num_free = int(state.num_free)

    def check(cond, msg):
        if not cond:
            raise AssertionError(msg)

    check(int(state.status) in set(Status), f"unknown status {int(state.status)}")
    holders = np.zeros_like(ref)
    for seq, (table, n, on) in enumerate(zip(tables, lens, active, strict=True)):
        held = -(-int(n) // state.block_size) if on else 0
        check(on or n == 0, f"inactive seq {seq} has length {n}")
        check(np.all(table[held:] == -1), f"seq {seq} lists blocks past its length: {table}")
        blocks = table[:held]
        check(np.all((blocks >= 0) & (blocks < ref.size)), f"seq {seq} table {table}")
        check(len(set(blocks.tolist())) == held, f"seq {seq} lists a block twice: {table}")
        np.add.at(holders, blocks, 1)
    check(np.array_equal(holders, ref), f"ref counts {ref} differ from membership {holders}")
    check(0 <= num_free <= ref.size, f"num_free={num_free}")
    free = stack[:num_free]
    check(np.all(stack[num_free:] == -1), f"free stack above its top: {stack}")
    check(sorted(free.tolist()) == np.flatnonzero(ref == 0).tolist(), f"free stack {stack}")
