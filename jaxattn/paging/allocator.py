"""The KV pool's allocator: one ref-counted free list of pages, seen as pages or as slots.

Two protocols describe what the pool's holders need:

* :class:`PageAllocator` (vLLM's ``BlockPool``): whole pages with reference counts, so that
  block tables, forks and a prefix cache can share a page and the last holder frees it;
* :class:`SlotAllocator` (SGLang's ``BaseTokenToKVPoolAllocator``): token slots, for
  holders that speak slots (the radix cache, an SGLang-style token pool). Slot ``s`` lies
  on page ``s // page_size``; with ``page_size > 1`` ``alloc`` hands out whole pages and
  ``free`` drops the caller's reference on every page its slots touch.

:class:`BlockAllocator` is the one ref-counted implementation of both: its block methods
are the page protocol, and :attr:`BlockAllocator.slots` is the same free list through the
slot protocol. A page returns to the free list when its last reference goes, whoever held
it, so a page can be shared between sequences and the radix cache without any of them
knowing about the others. (:class:`jaxattn.radix.TokenPool` is the other slot allocator:
one owner per slot, no reference counts, the radix cache's own spec pool.)

Every method validates first and mutates after: an error leaves the allocator unchanged.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = [
    "BlockAllocator",
    "NoFreeBlocksError",
    "PageAllocator",
    "SlotAllocator",
    "SlotView",
    "check_int",
]


class NoFreeBlocksError(RuntimeError):
    """The pool holds fewer free blocks than an operation needs."""


def check_int(name: str, value: object, *, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum``, or a TypeError / ValueError naming ``name``."""
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


def _as_ids(name: str, values: object) -> np.ndarray:
    """A 1-D int64 array of ids, or a TypeError / ValueError naming ``name``."""
    if isinstance(values, np.ndarray):
        arr = values
    elif isinstance(values, list | tuple):
        arr = np.asarray(values)
    else:
        arr = np.asarray(list(values))
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    # dtype kinds "i" / "u": the integer dtypes (bool is "b"); a cheaper test than
    # np.issubdtype on this path, which runs a few times per request.
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold ints, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _distinct(ids: np.ndarray) -> bool:
    """Whether no id repeats. A table's blocks are distinct by construction, so this is
    the common answer; a set answers it for a table's few dozen ids several times faster
    than ``np.unique``."""
    if ids.size <= 1024:
        return len(set(ids.tolist())) == ids.size
    return np.unique(ids).size == ids.size


@runtime_checkable
class PageAllocator(Protocol):
    """Ref-counted pages (vLLM ``BlockPool``): what block tables and forks need."""

    num_blocks: int
    block_size: int

    @property
    def num_free(self) -> int: ...

    def allocate(self) -> int: ...

    def allocate_many(self, count: int) -> np.ndarray: ...

    def free(self, block: int) -> None: ...

    def free_blocks(self, blocks: Iterable[int]) -> None: ...

    def incref(self, block: int) -> None: ...

    def incref_blocks(self, blocks: Iterable[int]) -> None: ...

    def ref_count(self, block: int) -> int: ...


@runtime_checkable
class SlotAllocator(Protocol):
    """Token slots of a KV pool (SGLang ``BaseTokenToKVPoolAllocator``): what the radix
    cache needs. ``free`` releases the caller's hold on the pages its slots touch."""

    num_slots: int
    page_size: int

    @property
    def available(self) -> int: ...

    def alloc(self, n: int) -> np.ndarray | None: ...

    def free(self, slots: object) -> None: ...

    def is_allocated(self, slots: object) -> np.ndarray: ...


def _read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a`` that follows its changes."""
    view = a.view()
    view.flags.writeable = False
    return view


class BlockAllocator:
    """Free list plus per-block ref counts over ``num_blocks`` blocks of ``block_size``
    token slots.

    A block is free iff its ref count is 0. Freed blocks are reused last-in first-out, so a
    block that was just released (and may still be warm in cache) is handed out next; the
    free list is a stack whose exact order :class:`~jaxattn.paging.PageTable` reproduces on
    the device. Batch methods (``allocate_many``, ``free_blocks``, ``incref_blocks``) act
    as the loop of their single-block forms, all or nothing.
    """

    def __init__(self, num_blocks: int, *, block_size: int = 1):
        self.num_blocks = check_int("num_blocks", num_blocks, minimum=1)
        self.block_size = check_int("block_size", block_size, minimum=1)
        if self.num_blocks * self.block_size >= 2**31:
            raise ValueError(f"{num_blocks=} * {block_size=} slots overflow int32 slot ids")
        # _stack[:_top] is the free list; its top (the next block handed out) is block 0 at
        # the start.
        self._stack = np.arange(self.num_blocks - 1, -1, -1, dtype=np.int32)
        self._top = self.num_blocks
        self._ref = np.zeros(self.num_blocks, np.int32)
        self._ref_view = _read_only(self._ref)
        self._slots: SlotView | None = None
        # Counts the changes: a copy of the state elsewhere (a device page table) is
        # current while the version it was taken at is.
        self.version = 0

    def __setstate__(self, state: dict) -> None:
        # A copy (copy.deepcopy, pickle) copies a numpy view as an array of its own, which
        # would no longer follow the copy's ref counts: rebuild it over them.
        self.__dict__.update(state)
        self._ref_view = _read_only(self._ref)

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._top

    @property
    def ref_counts(self) -> np.ndarray:
        """``i32[num_blocks]``, a read-only view that follows every change."""
        return self._ref_view

    def free_stack(self) -> np.ndarray:
        """A copy of the free list, bottom first: the last entry is handed out next."""
        return self._stack[: self._top].copy()

    def ref_count(self, block: int) -> int:
        return int(self._ref[self._check_block(block)])

    @property
    def slots(self) -> SlotView:
        """This allocator through the :class:`SlotAllocator` protocol (one shared view)."""
        if self._slots is None:
            self._slots = SlotView(self)
        return self._slots

    def _check_block(self, block: object) -> int:
        block = check_int("block", block)
        if block >= self.num_blocks:
            raise ValueError(f"block={block} out of range [0, {self.num_blocks})")
        return block

    def _check_blocks(self, name: str, blocks: object) -> np.ndarray:
        ids = _as_ids(name, blocks)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            bad = ids[(ids < 0) | (ids >= self.num_blocks)][:8].tolist()
            raise ValueError(f"{name} holds blocks {bad} outside [0, {self.num_blocks})")
        return ids

    # -- single blocks ---------------------------------------------------------------------

    def allocate(self) -> int:
        """Take a free block; its ref count becomes 1."""
        if not self._top:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        self._top -= 1
        block = int(self._stack[self._top])
        self._ref[block] = 1
        self.version += 1
        return block

    def free(self, block: int) -> None:
        """Drop one reference; the block returns to the free list when none is left."""
        block = self._check_block(block)
        if self._ref[block] == 0:
            raise ValueError(f"block={block} is already free (double free)")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._stack[self._top] = block
            self._top += 1
        self.version += 1

    def incref(self, block: int) -> None:
        """Add a reference to an allocated block (sharing it with one more holder)."""
        block = self._check_block(block)
        if self._ref[block] == 0:
            raise ValueError(f"block={block} is free; only an allocated block can be shared")
        self._ref[block] += 1
        self.version += 1

    # -- batches ---------------------------------------------------------------------------

    def allocate_many(self, count: int) -> np.ndarray:
        """``i32[count]`` fresh blocks, in the order ``count`` calls of :meth:`allocate`
        would give them; NoFreeBlocksError (nothing taken) when fewer are free."""
        count = check_int("count", count)
        if count > self._top:
            raise NoFreeBlocksError(f"{count} blocks wanted, {self._top} of {self.num_blocks} free")
        top = self._top
        blocks = self._stack[top - count : top][::-1].copy()
        self._top = top - count
        self._ref[blocks] = 1
        self.version += 1
        return blocks

    def free_blocks(self, blocks: Iterable[int]) -> None:
        """Drop one reference per listed block (a block listed twice loses two), in order:
        blocks whose count reaches 0 join the free list in the order they reach it."""
        ids = self._check_blocks("blocks", blocks)
        if not ids.size:
            return
        if _distinct(ids):
            short = self._ref[ids] < 1
            if short.any():
                b = int(ids[short][0])
                raise ValueError(f"block {b} is freed but holds no reference (double free)")
            self._ref[ids] -= 1
            released = ids[self._ref[ids] == 0]
        else:  # a repeated block is released at its last listed occurrence
            uniq, counts = np.unique(ids, return_counts=True)
            short = self._ref[uniq] < counts
            if short.any():
                b = int(uniq[short][0])
                raise ValueError(
                    f"block {b} is freed {int(counts[short][0])} times but holds "
                    f"{int(self._ref[b])} references (double free)"
                )
            out = []
            for b in ids.tolist():
                self._ref[b] -= 1
                if self._ref[b] == 0:
                    out.append(b)
            released = np.asarray(out, np.int64)
        n = released.size
        self._stack[self._top : self._top + n] = released
        self._top += n
        self.version += 1

    def incref_blocks(self, blocks: Iterable[int]) -> None:
        """Add one reference per listed block; every block must be allocated."""
        ids = self._check_blocks("blocks", blocks)
        if not ids.size:
            return
        free = self._ref[ids] == 0
        if free.any():
            b = int(ids[free][0])
            raise ValueError(f"block={b} is free; only an allocated block can be shared")
        if _distinct(ids):
            self._ref[ids] += 1
        else:
            np.add.at(self._ref, ids, 1)
        self.version += 1

    # -- checks ----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError unless the free list holds exactly the blocks with no
        reference, each once."""
        free = self._stack[: self._top]
        assert np.unique(free).size == free.size, "a block is on the free list twice"
        assert (self._ref >= 0).all(), "a negative ref count"
        assert sorted(free.tolist()) == np.flatnonzero(self._ref == 0).tolist(), (
            "the free list differs from the blocks with no reference"
        )

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"num_free={self.num_free})"
        )


class SlotView:
    """A :class:`BlockAllocator` through the :class:`SlotAllocator` protocol.

    ``alloc(n)`` takes ``ceil(n / page_size)`` fresh pages and returns the slots of their
    first ``n`` tokens; ``free(slots)`` drops one reference from every page the slots touch
    (however many of its slots are listed). The state is the allocator's: a page freed here
    stays allocated while a block table still holds it.
    """

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self.page_size = allocator.block_size
        self.num_pages = allocator.num_blocks
        self.num_slots = allocator.num_blocks * allocator.block_size

    @property
    def available(self) -> int:
        """Free token slots (on free pages)."""
        return self.allocator.num_free * self.page_size

    def _check_slots(self, name: str, slots: object) -> np.ndarray:
        ids = _as_ids(name, slots)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_slots):
            raise ValueError(f"{name} must lie in [0, {self.num_slots})")
        return ids

    def alloc(self, n: int) -> np.ndarray | None:
        """``i32[n]`` slots on fresh pages, or None (nothing taken) when too few are free."""
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        p = self.page_size
        pages = -(-int(n) // p)
        if pages > self.allocator.num_free:
            return None
        blocks = self.allocator.allocate_many(pages).astype(np.int64)
        return (blocks[:, None] * p + np.arange(p)).reshape(-1)[:n].astype(np.int32)

    def free(self, slots: object) -> None:
        """Drop one reference from every page ``slots`` touch; raise (freeing nothing) on
        a slot out of range or on a free page."""
        ids = self._check_slots("slots", slots)
        if not ids.size:
            return
        pages = ids // self.page_size
        # Every page once, in order of first appearance, then freed last page first (as a
        # table is freed tail first), so that the head page is handed out again first.
        _, first = np.unique(pages, return_index=True)
        pages = pages[np.sort(first)]
        held = self.allocator.ref_counts[pages]
        if (held == 0).any():
            bad = pages[held == 0][:8] * self.page_size
            raise ValueError(f"slots {bad.tolist()} are already free (double free)")
        self.allocator.free_blocks(pages[::-1])

    def is_allocated(self, slots: object) -> np.ndarray:
        """``bool[len(slots)]``: whether each (in-range) slot lies on an allocated page."""
        ids = _as_ids("slots", slots)
        return self.allocator.ref_counts[ids // self.page_size] > 0

    def check_invariants(self) -> None:
        self.allocator.check_invariants()

    def __repr__(self) -> str:
        return f"SlotView({self.allocator!r})"
