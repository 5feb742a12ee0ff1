"""The engine's page pool: the :class:`~jaxattn.radix.TokenPool` interface over a
ref-counted :class:`~jaxattn.paging.BlockAllocator`.

The radix cache frees and checks slots through the ``TokenPool`` interface; the engine
needs pages that several holders share. Here every holder owns one reference per page:

* the radix cache, for the pages of its nodes (``free(slots)`` from an eviction drops
  that reference);
* every running sequence, for each page of its block table (prefix pages matched in the
  cache included), so a forked sibling simply adds its references.

A page returns to the free list when its last reference goes, so no holder can free a
page another still reads. Pages are whole: slot ``s`` lies on page ``s // page_size``.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import numpy as np

from jaxattn.paging import BlockAllocator
from jaxattn.radix import TokenPool
from jaxattn.radix.token_pool import as_slots

__all__ = ["PagePool"]


class PagePool(TokenPool):
    """``num_pages`` pages of ``page_size`` slots with per-page reference counts."""

    def __init__(self, num_pages: int, page_size: int):
        # TokenPool keeps its own free stack; this pool keeps its state in the allocator
        # instead, so the base initialiser is deliberately not run.
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.allocator = BlockAllocator(int(num_pages))
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.num_slots = self.num_pages * self.page_size

    # -- TokenPool interface (slots) --------------------------------------------------------

    @property
    def available(self) -> int:
        return self.allocator.num_free * self.page_size

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.allocator.num_free

    def alloc(self, n: int) -> np.ndarray | None:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        pages = self.alloc_pages(-(-int(n) // self.page_size))
        if pages is None:
            return None
        p = self.page_size
        slots = (np.asarray(pages, np.int64)[:, None] * p + np.arange(p)).reshape(-1)[:n]
        return slots.astype(np.int32)

    def free(self, slots: object) -> None:
        """Drop one reference from every page that ``slots`` touches."""
        slots = as_slots("slots", slots)
        if slots.size == 0:
            return
        if slots.min() < 0 or slots.max() >= self.num_slots:
            raise ValueError(f"slots must lie in [0, {self.num_slots})")
        self.free_pages(np.unique(slots // self.page_size).tolist())

    def is_allocated(self, slots: object) -> np.ndarray:
        slots = as_slots("slots", slots)
        ref = self.allocator.ref_count
        return np.array([ref(int(p)) > 0 for p in slots // self.page_size], dtype=bool)

    def clear(self) -> None:
        raise RuntimeError("a PagePool is never cleared: its holders free their own pages")

    # -- pages ------------------------------------------------------------------------------

    def alloc_pages(self, k: int) -> list[int] | None:
        """``k`` fresh pages (one reference each), or None with nothing taken."""
        if k > self.allocator.num_free:
            return None
        return [self.allocator.allocate() for _ in range(k)]

    def _check_pages(self, name: str, pages: Iterable[int]) -> list[int]:
        pages = [int(p) for p in pages]
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"{name} holds page {p} outside [0, {self.num_pages})")
        return pages

    def free_pages(self, pages: Iterable[int]) -> None:
        """Drop one reference per listed page (a page listed twice loses two)."""
        pages = self._check_pages("pages", pages)
        need: dict[int, int] = {}
        for p in pages:
            need[p] = need.get(p, 0) + 1
        for p, n in need.items():
            if self.allocator.ref_count(p) < n:
                raise ValueError(f"page {p} is freed {n} times but holds fewer references")
        # Reversed, so that the allocator's LIFO hands out the tail pages first next time.
        for p in reversed(pages):
            self.allocator.free(p)

    def incref_pages(self, pages: Iterable[int]) -> None:
        pages = self._check_pages("pages", pages)
        for p in pages:
            if self.allocator.ref_count(p) == 0:
                raise ValueError(f"page {p} is free; only an allocated page can be shared")
        for p in pages:
            self.allocator.incref(p)

    def ref_count(self, page: int) -> int:
        return self.allocator.ref_count(page)

    def ref_counts(self) -> np.ndarray:
        return np.array([self.allocator.ref_count(p) for p in range(self.num_pages)], np.int64)

    def check_invariants(self) -> None:
        refs = self.ref_counts()
        assert (refs >= 0).all()
        assert int((refs == 0).sum()) == self.allocator.num_free, "free list out of date"
