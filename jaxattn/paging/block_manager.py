"""Host-side paged KV memory: a ref-counted block allocator and per-sequence block tables.

This is the vLLM PagedAttention memory manager. A sequence's KV lives in fixed-size
physical blocks listed by its block table; token ``t`` of a sequence sits in slot
``table[t // block_size] * block_size + t % block_size`` of the pool. ``fork`` shares
every block of the parent with the child (ref counts +1, no copy); the first write into a
shared, partially filled tail block triggers copy-on-write, returned as ``(src, dst)``
orders for :func:`jaxattn.kv.copy_blocks` to run before the token is written.

Every mutating method validates first and mutates after, so an error leaves every table and
every ref count exactly as it was.
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Iterable

import numpy as np

__all__ = ["BlockAllocator", "BlockManager", "NoFreeBlocksError"]


class NoFreeBlocksError(RuntimeError):
    """The pool holds fewer free blocks than an operation needs."""


def _check_int(name: str, value: object, *, minimum: int = 0) -> int:
    # The exact-type test is the hot path (one call per generated token); numpy integers
    # take the slower ABC check. bool is an int subclass, but True as a length is a bug.
    if type(value) is int:
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class BlockAllocator:
    """Free list plus per-block ref counts over ``num_blocks`` physical blocks.

    A block is free iff its ref count is 0. Freed blocks are reused last-in first-out, so a
    block that was just released (and may still be warm in cache) is handed out next.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = _check_int("num_blocks", num_blocks, minimum=1)
        # Popping from the end hands out block 0 first.
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._ref = [0] * self.num_blocks

    def _check_block(self, block: object) -> int:
        block = _check_int("block", block)
        if block >= self.num_blocks:
            raise ValueError(f"block={block} out of range [0, {self.num_blocks})")
        return block

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take a free block; its ref count becomes 1."""
        if not self._free:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        block = self._free.pop()
        self._ref[block] = 1
        return block

    def free(self, block: int) -> None:
        """Drop one reference; the block returns to the free list when none is left."""
        block = self._check_block(block)
        if self._ref[block] == 0:
            raise ValueError(f"block={block} is already free (double free)")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._free.append(block)

    def incref(self, block: int) -> None:
        """Add a reference to an allocated block (sharing it with one more holder)."""
        block = self._check_block(block)
        if self._ref[block] == 0:
            raise ValueError(f"block={block} is free; only an allocated block can be shared")
        self._ref[block] += 1

    def ref_count(self, block: int) -> int:
        return self._ref[self._check_block(block)]


class BlockManager:
    """Block tables of running sequences over one shared :class:`BlockAllocator`.

    Args:
      num_blocks: physical blocks in the KV pool.
      block_size: tokens per block (``P``).
      watermark: fraction of ``num_blocks`` that :meth:`can_allocate` keeps in reserve when
        admitting a new prompt, so that running sequences can still grow by
        :meth:`append_slot` without being preempted at once. :meth:`allocate` itself only
        fails when the blocks physically do not exist.
    """

    def __init__(self, num_blocks: int, block_size: int, *, watermark: float = 0.0):
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = _check_int("block_size", block_size, minimum=1)
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

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        num_tokens = _check_int("num_tokens", num_tokens)
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new prompt of ``num_tokens`` fits while keeping the watermark free."""
        return self.num_free_blocks - self.blocks_needed(num_tokens) >= self.watermark_blocks

    def can_append_slot(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        """Whether :meth:`append_slots` of ``num_tokens`` would find enough free blocks."""
        if num_tokens == 1 and type(num_tokens) is int and seq_id in self._tables:
            length = self._lens[seq_id]
            if length % self.block_size and self.allocator._ref[self._tables[seq_id][-1]] == 1:
                return True
            return bool(self.allocator._free)
        return self._blocks_to_append(self._check_seq(seq_id), num_tokens) <= self.num_free_blocks

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
        table = self._tables[self._check_seq(seq_id)]
        start = _check_int("start", start)
        end = _check_int("end", end)
        length = self._lens[seq_id]
        if not start <= end <= length:
            raise ValueError(f"need 0 <= start <= end <= seq_len={length}, got [{start}, {end})")
        positions = np.arange(start, end, dtype=np.int64)
        blocks = np.asarray(table, dtype=np.int64)[positions // self.block_size]
        return (blocks * self.block_size + positions % self.block_size).astype(np.int32)

    # -- mutations -------------------------------------------------------------------------

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Give a new sequence fresh blocks for its ``num_tokens`` prompt tokens."""
        if seq_id in self._tables:
            raise ValueError(f"seq_id={seq_id!r} is already allocated")
        needed = self.blocks_needed(num_tokens)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"seq_id={seq_id!r} needs {needed} blocks for {num_tokens} tokens, "
                f"{self.num_free_blocks} free"
            )
        table = [self.allocator.allocate() for _ in range(needed)]
        self._tables[seq_id] = table
        self._lens[seq_id] = int(num_tokens)
        self._mirror_new(seq_id)
        return list(table)

    def append_slot(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Make room for one more token; return the copy-on-write orders to run first.

        A full (or missing) tail block gets a fresh block and needs no copy. A partially
        filled tail that other sequences still share is copied to a fresh block, which
        replaces it in this table only (the shared one loses one reference): the order
        ``(src, dst)`` must be applied to the cache before the new token is written.
        """
        # Specialised form of append_slots(seq_id, 1): a serving loop calls this once per
        # sequence per decode step, so it touches the allocator's lists directly.
        table = self._tables.get(seq_id)
        if table is None:
            self._check_seq(seq_id)
        length = self._lens[seq_id]
        allocator = self.allocator
        if length % self.block_size == 0:
            if not allocator._free:
                raise NoFreeBlocksError(f"seq_id={seq_id!r} needs 1 block to grow, 0 free")
            table.append(allocator.allocate())
            self._mirror_entry(seq_id, len(table) - 1)
            orders = []
        elif allocator._ref[table[-1]] > 1:
            if not allocator._free:
                raise NoFreeBlocksError(
                    f"seq_id={seq_id!r} needs 1 block for copy-on-write, 0 free"
                )
            src = table[-1]
            table[-1] = dst = allocator.allocate()
            allocator._ref[src] -= 1  # still > 0: another table holds it
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
        for _ in range(self.blocks_needed(new_len) - len(table)):
            table.append(self.allocator.allocate())
        self._lens[seq_id] = new_len
        self._mirror_row(seq_id)
        return orders

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Give ``child_id`` the parent's table; every block is shared, nothing is copied."""
        table = self._tables[self._check_seq(parent_id, "parent_id")]
        if child_id in self._tables:
            raise ValueError(f"child_id={child_id!r} is already allocated")
        # Blocks of a table are allocated by construction: no per-block checks needed.
        ref = self.allocator._ref
        for block in table:
            ref[block] += 1
        self._tables[child_id] = list(table)
        self._lens[child_id] = self._lens[parent_id]
        self._mirror_new(child_id)

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence; blocks no other table holds return to the free list."""
        table = self._tables.pop(self._check_seq(seq_id))
        del self._lens[seq_id]
        self._free_rows.append(self._rows.pop(seq_id))
        # Tail first: the LIFO free list then hands these blocks out again in table order.
        ref, free = self.allocator._ref, self.allocator._free
        for block in reversed(table):
            ref[block] -= 1
            if not ref[block]:
                free.append(block)

    def check_invariants(self) -> None:
        """Raise AssertionError unless ref counts equal table membership and no block leaks."""
        holders = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            assert len(set(table)) == len(table), f"seq {seq_id!r} lists a block twice"
            assert len(table) == self.blocks_needed(self._lens[seq_id]), f"seq {seq_id!r}"
            for block in table:
                holders[block] += 1
        assert holders == self.allocator._ref, "ref counts differ from table membership"
        free = self.allocator._free
        assert len(set(free)) == len(free), "a block is on the free list twice"
        assert sorted(free) == [b for b in range(self.num_blocks) if holders[b] == 0]
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
        return length % self.block_size != 0 and self.allocator.ref_count(table[-1]) > 1

    def _blocks_to_append(self, seq_id: Hashable, num_tokens: int) -> int:
        num_tokens = _check_int("num_tokens", num_tokens)
        table, length = self._tables[seq_id], self._lens[seq_id]
        grow = self.blocks_needed(length + num_tokens) - len(table)
        cow = 1 if num_tokens and self._tail_is_shared(table, length) else 0
        return grow + cow
