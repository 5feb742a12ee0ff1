"""Host-side paged KV memory: block tables over the ref-counted block allocator.

This is the vLLM PagedAttention memory manager. A sequence's KV lives in fixed-size
physical blocks listed by its block table; token ``t`` of a sequence sits in slot
``table[t // block_size] * block_size + t % block_size`` of the pool
(:func:`~jaxattn.paging.token_slots`). ``fork`` shares every block of the parent with the
child (ref counts +1, no copy); the first write into a shared, partially filled tail block
triggers copy-on-write, returned as ``(src, dst)`` orders for :func:`jaxattn.kv.copy_blocks`
to run before the token is written.

The blocks come from a :class:`~jaxattn.paging.BlockAllocator`, its own or one shared with
other holders: a radix prefix cache holding blocks through the allocator's slot view, for
instance. A table may then start with blocks another holder owns (``allocate(...,
prefix=)``, ``replace_blocks``); each holder drops only its own reference.

Every mutating method validates first and mutates after, so an error leaves every table and
every ref count exactly as it was.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import numpy as np

from jaxattn.paging.allocator import BlockAllocator, NoFreeBlocksError, _as_ids, check_int
from jaxattn.paging.slots import range_slots

__all__ = ["BlockAllocator", "BlockManager", "NoFreeBlocksError"]

_check_int = check_int


class BlockManager:
    """Block tables of sequences over one :class:`BlockAllocator`.

    Args:
      num_blocks: physical blocks in the KV pool (None with ``allocator``: its count).
      block_size: tokens per block (``P``; None with ``allocator``: its block size).
      watermark: fraction of ``num_blocks`` that :meth:`can_allocate` keeps in reserve when
        admitting a new prompt, so that running sequences can still grow by
        :meth:`append_slot` without being preempted at once. :meth:`allocate` itself only
        fails when the blocks physically do not exist.
      allocator: share this allocator with other holders instead of owning a new one.

    A sequence's length is the number of token slots its table provides; a serving engine
    may reserve slots ahead of the tokens it has computed (:meth:`append_slots`).
    """

    def __init__(
        self,
        num_blocks: int | None = None,
        block_size: int | None = None,
        *,
        watermark: float = 0.0,
        allocator: BlockAllocator | None = None,
    ):
        if allocator is None:
            if num_blocks is None or block_size is None:
                raise TypeError("BlockManager needs num_blocks and block_size, or allocator=")
            block_size = _check_int("block_size", block_size, minimum=1)
            allocator = BlockAllocator(num_blocks, block_size=block_size)
            self._shared = False
        else:
            if not isinstance(allocator, BlockAllocator):
                raise TypeError(f"allocator must be a BlockAllocator, got {type(allocator)}")
            for name, value, have in (
                ("num_blocks", num_blocks, allocator.num_blocks),
                ("block_size", block_size, allocator.block_size),
            ):
                if value is not None and _check_int(name, value, minimum=1) != have:
                    raise ValueError(f"{name}={value} differs from the allocator's {have}")
            self._shared = True
        self.allocator = allocator
        self.block_size = allocator.block_size
        if not 0.0 <= float(watermark) < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        self.watermark = float(watermark)
        self.watermark_blocks = int(self.watermark * self.allocator.num_blocks)
        self._tables: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}
        # A numpy mirror of the tables, one row per sequence, kept in step with every
        # mutation so that block_tables() is one gather instead of a Python loop per row.
        self._rows: dict[Hashable, int] = {}
        self._free_rows: list[int] = []
        self._mat = np.zeros((16, 16), dtype=np.int32)

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def seq_ids(self) -> list[Hashable]:
        return list(self._tables)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    def __len__(self) -> int:
        return len(self._tables)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        num_tokens = _check_int("num_tokens", num_tokens)
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new prompt of ``num_tokens`` fits while keeping the watermark free."""
        return self.num_free_blocks - self.blocks_needed(num_tokens) >= self.watermark_blocks

    def can_append_slot(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        """Whether :meth:`append_slots` of ``num_tokens`` would find enough free blocks."""
        return self.blocks_to_append(seq_id, num_tokens) <= self.num_free_blocks

    def blocks_to_append(self, seq_id: Hashable, num_tokens: int = 1) -> int:
        """Fresh blocks :meth:`append_slots` of ``num_tokens`` takes (growth plus the
        copy-on-write of a shared tail)."""
        return self._blocks_to_append(self._check_seq(seq_id), num_tokens)

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._tables[self._check_seq(seq_id)])

    def seq_len(self, seq_id: Hashable) -> int:
        return self._lens[self._check_seq(seq_id)]

    def ref_count(self, block: int) -> int:
        return self.allocator.ref_count(block)

    def block_tables(
        self, seq_ids: Iterable[Hashable], pad_to: int | None = None, *, pad_value: int = 0
    ) -> np.ndarray:
        """``i32[len(seq_ids), width]`` block tables, rows padded with ``pad_value``.

        ``width`` is ``pad_to`` when given (a fixed width avoids recompiling a jitted step
        whenever the longest sequence crosses a block boundary), else the longest table.
        Padding defaults to block 0, a valid index: kernels stop at ``seq_lens`` and never
        read it, and a gather of a valid index cannot fault.
        """
        seq_ids = list(seq_ids)
        try:
            rows = np.array([self._rows[s] for s in seq_ids], dtype=np.int64)
        except KeyError:
            for s in seq_ids:
                self._check_seq(s)
            raise
        tables = self._tables
        lens = np.array([len(tables[s]) for s in seq_ids], dtype=np.int64)
        longest = int(lens.max(initial=0))
        if pad_to is None:
            width = longest
        else:
            width = _check_int("pad_to", pad_to)
            if width < longest:
                raise ValueError(f"pad_to={width} is shorter than the longest table ({longest})")
        out = np.full((len(seq_ids), width), pad_value, dtype=np.int32)
        have = min(width, self._mat.shape[1])
        out[:, :have] = self._mat[rows, :have]
        out[np.arange(width) >= lens[:, None]] = pad_value
        return out

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> np.ndarray:
        """``i32[end - start]``: pool slots of the sequence's tokens ``[start, end)``."""
        self._check_seq(seq_id)
        start = _check_int("start", start)
        end = _check_int("end", end)
        length = self._lens[seq_id]
        if not start <= end <= length:
            raise ValueError(f"need 0 <= start <= end <= seq_len={length}, got [{start}, {end})")
        return range_slots(self._mat[self._rows[seq_id]], start, end, self.block_size)

    # -- mutations -------------------------------------------------------------------------

    def allocate(
        self, seq_id: Hashable, num_tokens: int, *, prefix: Iterable[int] = ()
    ) -> list[int]:
        """Give a new sequence a table for its ``num_tokens`` prompt tokens.

        ``prefix``: allocated blocks holding the first ``len(prefix) * block_size`` tokens
        already (a prefix-cache hit); the table shares them (+1 each, no copy) and takes
        fresh blocks for the rest.
        """
        if seq_id in self._tables:
            raise ValueError(f"seq_id={seq_id!r} is already allocated")
        num_tokens = _check_int("num_tokens", num_tokens)
        # One array check for the whole prefix (ints, 1-D); incref_blocks below checks that
        # every block lies in the pool and is allocated.
        prefix = _as_ids("prefix", prefix).tolist()
        if len(prefix) * self.block_size > num_tokens:
            raise ValueError(
                f"prefix of {len(prefix)} blocks holds more than num_tokens={num_tokens}"
            )
        if len(set(prefix)) != len(prefix):
            raise ValueError(f"prefix lists a block twice: {prefix}")
        needed = self.blocks_needed(num_tokens) - len(prefix)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"seq_id={seq_id!r} needs {needed} blocks for {num_tokens} tokens, "
                f"{self.num_free_blocks} free"
            )
        self.allocator.incref_blocks(prefix)  # validates: every prefix block is allocated
        table = prefix + self.allocator.allocate_many(needed).tolist()
        self._tables[seq_id] = table
        self._lens[seq_id] = num_tokens
        self._mirror_new(seq_id)
        return list(table)

    def append_slot(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Make room for one more token; return the copy-on-write orders to run first.

        A full (or missing) tail block gets a fresh block and needs no copy. A partially
        filled tail that other holders still share is copied to a fresh block, which
        replaces it in this table only (the shared one loses one reference): the order
        ``(src, dst)`` must be applied to the cache before the new token is written.
        """
        # Specialised form of append_slots(seq_id, 1): a serving loop may call this once per
        # sequence per decode step.
        table = self._tables.get(seq_id)
        if table is None:
            self._check_seq(seq_id)
        length = self._lens[seq_id]
        allocator = self.allocator
        if length % self.block_size == 0:
            if not allocator.num_free:
                raise NoFreeBlocksError(f"seq_id={seq_id!r} needs 1 block to grow, 0 free")
            table.append(allocator.allocate())
            self._mirror_entry(seq_id, len(table) - 1)
            orders = []
        elif allocator.ref_counts[table[-1]] > 1:
            if not allocator.num_free:
                raise NoFreeBlocksError(
                    f"seq_id={seq_id!r} needs 1 block for copy-on-write, 0 free"
                )
            src = table[-1]
            table[-1] = dst = allocator.allocate()
            allocator.free(src)  # still held: another holder reads it
            self._mirror_entry(seq_id, len(table) - 1)
            orders = [(src, dst)]
        else:
            orders = []
        self._lens[seq_id] = length + 1
        return orders

    def append_slots(self, seq_id: Hashable, num_tokens: int) -> list[tuple[int, int]]:
        """:meth:`append_slot` for ``num_tokens`` tokens at once (all or nothing)."""
        table = self._tables[self._check_seq(seq_id)]
        num_tokens = _check_int("num_tokens", num_tokens)
        needed = self._blocks_to_append(seq_id, num_tokens)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"seq_id={seq_id!r} needs {needed} blocks to grow by {num_tokens} tokens, "
                f"{self.num_free_blocks} free"
            )
        length = self._lens[seq_id]
        orders = []
        if num_tokens and self._tail_is_shared(table, length):
            src = table[-1]
            dst = self.allocator.allocate()
            self.allocator.free(src)
            table[-1] = dst
            orders.append((src, dst))
        new_len = length + num_tokens
        grow = self.blocks_needed(new_len) - len(table)
        if grow > 0:
            table.extend(self.allocator.allocate_many(grow).tolist())
        self._lens[seq_id] = new_len
        self._mirror_row(seq_id)
        return orders

    def replace_blocks(self, seq_id: Hashable, start: int, blocks: Iterable[int]) -> None:
        """Point table entries ``[start, start + len(blocks))`` at ``blocks``, allocated
        blocks with the same contents (another holder's copy of the same tokens, e.g. a
        prefix cache's): each gains this table's reference, each replaced block loses it."""
        table = self._tables[self._check_seq(seq_id)]
        start = _check_int("start", start)
        blocks = [_check_int("blocks", b) for b in blocks]
        if start + len(blocks) > len(table):
            raise ValueError(
                f"entries [{start}, {start + len(blocks)}) lie past the table's {len(table)}"
            )
        keep = set(table[:start] + table[start + len(blocks) :])
        if len(set(blocks)) != len(blocks) or keep & set(blocks):
            raise ValueError(f"blocks {blocks} would list a block twice in the table")
        old = table[start : start + len(blocks)]
        self.allocator.incref_blocks(blocks)  # validates: every new block is allocated
        self.allocator.free_blocks(old)
        table[start : start + len(blocks)] = blocks
        self._mirror_row(seq_id)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Give ``child_id`` the parent's table; every block is shared, nothing is copied."""
        table = self._tables[self._check_seq(parent_id, "parent_id")]
        if child_id in self._tables:
            raise ValueError(f"child_id={child_id!r} is already allocated")
        # Blocks of a table are allocated by construction: the batch incref cannot fail.
        self.allocator.incref_blocks(table)
        self._tables[child_id] = list(table)
        self._lens[child_id] = self._lens[parent_id]
        self._mirror_new(child_id)

    def free(self, seq_id: Hashable, *, handed_over: tuple[int, int] | None = None) -> None:
        """Drop the sequence; blocks no other holder has return to the free list.

        ``handed_over=(start, stop)``: the table's references on entries ``[start, stop)``
        pass to another holder (a prefix cache that took those blocks over) instead of
        being dropped: the same end state as that holder taking references of its own
        and this call dropping the table's, without the two passes over them.
        """
        self._check_seq(seq_id)
        table = self._tables[seq_id]
        start = stop = 0
        if handed_over is not None:
            start, stop = (_check_int("handed_over", v) for v in handed_over)
            if not start <= stop <= len(table):
                raise ValueError(
                    f"handed_over=({start}, {stop}) is not a range of the table's "
                    f"{len(table)} entries"
                )
        del self._tables[seq_id], self._lens[seq_id]
        self._free_rows.append(self._rows.pop(seq_id))
        # Tail first: the LIFO free list then hands these blocks out again in table order.
        self.allocator.free_blocks((table[:start] + table[stop:])[::-1])

    def check_invariants(self, other_holders: dict[int, int] | None = None) -> None:
        """Raise AssertionError unless ref counts equal table membership (plus
        ``other_holders``: block -> references held outside the tables) and no block leaks.
        With a shared allocator and no ``other_holders``, the counts must only cover the
        tables."""
        holders = np.zeros(self.num_blocks, np.int64)
        for seq_id, table in self._tables.items():
            assert len(set(table)) == len(table), f"seq {seq_id!r} lists a block twice"
            assert len(table) == self.blocks_needed(self._lens[seq_id]), f"seq {seq_id!r}"
            np.add.at(holders, table, 1)
        refs = self.allocator.ref_counts
        if other_holders is not None:
            for block, n in other_holders.items():
                holders[block] += n
            assert np.array_equal(holders, refs), "ref counts differ from the holders"
        elif self._shared:
            assert (refs >= holders).all(), "a block has fewer references than tables"
        else:
            assert np.array_equal(holders, refs), "ref counts differ from table membership"
        self.allocator.check_invariants()
        assert self._rows.keys() == self._tables.keys()
        assert len(set(self._rows.values())) == len(self._rows), "two sequences share a row"
        for seq_id, table in self._tables.items():
            row = self._mat[self._rows[seq_id], : len(table)]
            assert row.tolist() == table, f"numpy mirror of seq {seq_id!r} is stale"

    # -- numpy mirror ----------------------------------------------------------------------

    def _grow_mirror(self, rows: int, width: int) -> None:
        old_rows, old_width = self._mat.shape
        if rows <= old_rows and width <= old_width:
            return
        mat = np.zeros(
            (
                max(rows, 2 * old_rows if rows > old_rows else old_rows),
                max(width, 2 * old_width if width > old_width else old_width),
            ),
            dtype=np.int32,
        )
        mat[:old_rows, :old_width] = self._mat
        self._mat = mat

    def _mirror_new(self, seq_id: Hashable) -> None:
        row = self._free_rows.pop() if self._free_rows else len(self._rows)
        self._rows[seq_id] = row
        self._mirror_row(seq_id)

    def _mirror_row(self, seq_id: Hashable) -> None:
        table, row = self._tables[seq_id], self._rows[seq_id]
        self._grow_mirror(row + 1, len(table))
        self._mat[row, : len(table)] = table

    def _mirror_entry(self, seq_id: Hashable, index: int) -> None:
        row = self._rows[seq_id]
        if index >= self._mat.shape[1]:
            self._grow_mirror(row + 1, index + 1)
        self._mat[row, index] = self._tables[seq_id][index]

    # -- internals -------------------------------------------------------------------------

    def _check_seq(self, seq_id: Hashable, name: str = "seq_id") -> Hashable:
        if seq_id not in self._tables:
            raise ValueError(f"{name}={seq_id!r} is not allocated")
        return seq_id

    def _tail_is_shared(self, table: list[int], length: int) -> bool:
        # Only a partially filled tail is written into; a full shared block stays read-only.
        return length % self.block_size != 0 and self.allocator.ref_counts[table[-1]] > 1

    def _blocks_to_append(self, seq_id: Hashable, num_tokens: int) -> int:
        num_tokens = _check_int("num_tokens", num_tokens)
        table, length = self._tables[seq_id], self._lens[seq_id]
        grow = self.blocks_needed(length + num_tokens) - len(table)
        cow = 1 if num_tokens and self._tail_is_shared(table, length) else 0
        return grow + cow
