"""A slot allocator over a token-granular KV pool (SGLang's ``TokenToKVPoolAllocator``): one
owner per page, no reference counts; it implements :class:`jaxattn.paging.SlotAllocator`."""

from __future__ import annotations

import numbers

import numpy as np

__all__ = ["TokenPool", "as_slots", "last_occurrences"]


def last_occurrences(values: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """``bool[n]``: True where ``values[i]`` does not occur again after ``i``.

    O(n) with a caller-owned ``scratch`` array indexable by every value (np.unique sorts or
    hashes, several times slower on the 32k-token arrays of long prompts). ``scratch``
    needs no initialisation: every entry read here was written first.
    """
    positions = np.arange(values.size, dtype=scratch.dtype)
    scratch[values] = positions  # later writes win
    return scratch[values] == positions


def as_slots(name: str, slots: object) -> np.ndarray:
    """Coerce ``slots`` to a 1-D int64 array or raise naming the argument."""
    arr = np.asarray(slots)
    if arr.size == 0:
        return np.zeros((0,), np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


class TokenPool:
    """Free slots of a KV pool of ``num_slots`` token slots.

    With ``page_size > 1`` the pool hands out whole pages (``page_size`` consecutive slots
    starting at a multiple of ``page_size``): ``alloc(n)`` takes ``ceil(n / page_size)``
    pages and returns the slots of their first ``n`` tokens, in order, so that slot ``i``
    of a request lies at offset ``i % page_size`` of its page. The next token of a request
    whose last slot ``s`` is not the end of a page goes to ``s + 1`` without a new ``alloc``.
    ``free(slots)`` frees every page touched by ``slots``.
    """

    def __init__(self, num_slots: int, *, page_size: int = 1):
        for name, value in (("num_slots", num_slots), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_slots % page_size:
            raise ValueError(f"num_slots={num_slots} must be a multiple of {page_size=}")
        self.num_slots = int(num_slots)
        self.page_size = int(page_size)
        self.num_pages = self.num_slots // self.page_size
        # `_stack[:_num_free]` is a stack of free pages whose top is page 0 at the start, so
        # allocation order is deterministic and freed pages are reused first.
        self._stack = np.arange(self.num_pages - 1, -1, -1, dtype=np.int64)
        self._num_free = self.num_pages
        self._used = np.zeros(self.num_pages, dtype=bool)
        self._scratch = np.empty(self.num_pages, dtype=np.int64)

    @property
    def available(self) -> int:
        """Free token slots."""
        return self._num_free * self.page_size

    @property
    def num_free_pages(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> np.ndarray | None:
        """``i32[n]`` fresh slots, or None (and nothing taken) when fewer are free."""
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        pages_needed = -(-int(n) // self.page_size)
        if pages_needed > self._num_free:
            return None
        top = self._num_free
        pages = self._stack[top - pages_needed : top][::-1].copy()
        self._num_free -= pages_needed
        self._used[pages] = True
        if self.page_size == 1:
            return pages.astype(np.int32)
        offsets = np.arange(self.page_size, dtype=np.int64)
        slots = (pages[:, None] * self.page_size + offsets).reshape(-1)[:n]
        return slots.astype(np.int32)

    def free(self, slots: object) -> None:
        """Return the pages of ``slots``; raise (freeing nothing) on a free or bad slot."""
        slots = as_slots("slots", slots)
        if slots.size == 0:
            return
        if slots.min() < 0 or slots.max() >= self.num_slots:
            raise ValueError(f"slots must lie in [0, {self.num_slots})")
        pages = slots // self.page_size if self.page_size > 1 else slots
        last = last_occurrences(pages, self._scratch)
        if self.page_size > 1:
            pages = pages[last]  # every page once, however many of its slots are listed
        elif not last.all():
            raise ValueError("slots lists a slot twice (double free)")
        if not self._used[pages].all():
            bad = pages[~self._used[pages]][:8] * self.page_size
            raise ValueError(f"slots {bad.tolist()} are already free (double free)")
        self._used[pages] = False
        self._stack[self._num_free : self._num_free + pages.size] = pages[::-1]
        self._num_free += pages.size

    def is_allocated(self, slots: object) -> np.ndarray:
        """``bool[len(slots)]``: whether each (in-range) slot is currently handed out."""
        slots = as_slots("slots", slots)
        return self._used[slots // self.page_size]

    def clear(self) -> None:
        """Free every slot (only when no holder is left)."""
        self.__init__(self.num_slots, page_size=self.page_size)

    def check_invariants(self) -> None:
        free = self._stack[: self._num_free]
        assert np.unique(free).size == free.size, "a page is on the free list twice"
        assert not self._used[free].any(), "a used page is on the free list"
        assert self._used.sum() + self._num_free == self.num_pages, "a page leaked"
