"""The engine's KV memory: block tables and the radix prefix cache over one allocator.

One :class:`~jaxattn.paging.BlockAllocator` (``num_pages`` pages of ``page_size`` slots,
one reference count each) serves every holder:

* the :class:`~jaxattn.paging.BlockManager` holds the block table of every running
  sequence, one reference per page: it is the only code that grows a table, copies a
  shared tail on write, forks a table, and maps a position to a pool slot;
* the :class:`~jaxattn.radix.RadixCache` (``page_size`` granular) holds one reference per
  page of its nodes, through the allocator's slot view; evicting a node drops it.

A page is free when its last holder lets go, so nobody frees a page another still reads.
The first ``cached_len`` tokens of a table are pages of the cache on the path the sequence
has locked (``inc_lock_ref``); the rest are its own, except after a fork, where siblings
share the prompt's pages until one of them writes into a shared partial tail (copy on
write). A page only the cache holds is exactly a page of an unlocked node, so eviction
frees precisely ``evictable_size`` tokens. A slot is written only when its page has one
reference (the writer's): new pages are fresh, matched prefix pages are never written
(writes start at ``cached_len`` or later), and a shared tail is copied first.

:class:`KVCacheManager` carries out these operations for the scheduler and decides
nothing: which request to admit, when to evict or preempt is the scheduler's policy.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from typing import Any, NamedTuple

import numpy as np

from jaxattn.paging import BlockAllocator, BlockManager
from jaxattn.radix import RadixCache

from .stats import StatsCollector

__all__ = ["KVCacheManager", "PrefixMatch"]


class PrefixMatch(NamedTuple):
    """A locked cache hit: ``pages`` hold the first ``length`` tokens (whole pages)."""

    pages: list[int]
    length: int
    node: Any  # the locked radix node; None without a cache


class KVCacheManager:
    """Block tables, the prefix cache and their locks, per sequence id.

    Args:
      num_pages, page_size: the pool (pages per layer; slot ids are layer-0 slots).
      radix_cache: keep a radix prefix cache over the pool.
      stats: where events are counted (``evicted_tokens``, ``cow_copies``,
        ``deduplicated_pages``).
    """

    def __init__(self, num_pages: int, page_size: int, *, radix_cache: bool, stats: StatsCollector):
        self.page_size = page_size
        self.num_pages = num_pages
        self.allocator = BlockAllocator(num_pages, block_size=page_size)
        self.blocks = BlockManager(allocator=self.allocator)
        self.cache = RadixCache(self.allocator.slots, page_size=page_size) if radix_cache else None
        self.stats = stats
        self._locks: dict[Hashable, Any] = {}
        self._cached: dict[Hashable, int] = {}
        # Sequences whose table changed since take_changed(), with the first entry that
        # changed: a device copy of the table (the decode rows) must follow.
        self._changed: dict[Hashable, int] = {}
        # Pages set aside for reservations the caller makes later (reserve); nothing else
        # may take them meanwhile.
        self.promised = 0

    # -- queries ---------------------------------------------------------------------------

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def evictable_pages(self) -> int:
        return self.cache.evictable_size // self.page_size if self.cache else 0

    def available_pages(self) -> int:
        """Free pages plus the pages eviction could free now, less those promised."""
        return self.free_pages + self.evictable_pages - self.promised

    def prefix_len(self, tokens) -> int:
        """Tokens of ``tokens`` the cache holds (changes nothing; 0 without a cache)."""
        return self.cache.prefix_len(tokens) if self.cache is not None else 0

    def table(self, seq_id: Hashable) -> list[int]:
        return self.blocks.block_table(seq_id)

    def reserved(self, seq_id: Hashable) -> int:
        """Token slots the sequence's table provides."""
        return self.blocks.seq_len(seq_id)

    def slots(self, seq_id: Hashable, start: int, end: int) -> np.ndarray:
        return self.blocks.slot_mapping(seq_id, start, end)

    def cached_len(self, seq_id: Hashable) -> int:
        return self._cached.get(seq_id, 0)

    def take_changed(self) -> dict[Hashable, int]:
        """Sequence id -> first table entry that changed, since the last call."""
        changed, self._changed = self._changed, {}
        return changed

    def _touch(self, seq_id: Hashable, index: int) -> None:
        self._changed[seq_id] = min(index, self._changed.get(seq_id, index))

    # -- admission -------------------------------------------------------------------------

    def match(self, tokens) -> PrefixMatch:
        """Lock and return the longest cached prefix of ``tokens`` (empty without a cache).
        Give it to :meth:`allocate` or :meth:`unlock`."""
        if self.cache is None:
            return PrefixMatch([], 0, None)
        m = self.cache.match_prefix(tokens)
        self.cache.inc_lock_ref(m.node)
        p = self.page_size
        return PrefixMatch((m.indices[::p] // p).tolist(), m.length, m.node)

    def unlock(self, match: PrefixMatch) -> None:
        if match.node is not None:
            self.cache.dec_lock_ref(match.node)

    def allocate(self, seq_id: Hashable, num_tokens: int, match: PrefixMatch) -> None:
        """A table for ``num_tokens`` tokens: the matched pages, then fresh ones (the caller
        made room); the match's lock passes to the sequence."""
        self.blocks.allocate(seq_id, num_tokens, prefix=match.pages)
        self._cached[seq_id] = match.length
        if match.node is not None:
            self._locks[seq_id] = match.node
        self._touch(seq_id, 0)

    # -- memory ----------------------------------------------------------------------------

    def evict_for(self, pages: int) -> bool:
        """Evict unlocked cache leaves (LRU) until ``pages`` pages (beyond those promised)
        are free; False when even an empty cache leaves too few."""
        pages += self.promised
        while self.allocator.num_free < pages:
            if self.cache is None or not self.cache.evictable_size:
                return False
            short = pages - self.allocator.num_free
            self.stats.count("evicted_tokens", self.cache.evict(short * self.page_size))
        return True

    def pages_to_reserve(self, seq_id: Hashable, num_tokens: int) -> int:
        """Fresh pages :meth:`reserve` takes to give the table ``num_tokens`` slots."""
        have = self.blocks.seq_len(seq_id)
        if num_tokens <= have:
            return 0
        return self.blocks.blocks_to_append(seq_id, self._whole(num_tokens) - have)

    def _whole(self, num_tokens: int) -> int:
        # Slots are reserved up to the end of the last page: the page is taken anyway, and
        # the next steps then find their slots without a call here.
        return -(-num_tokens // self.page_size) * self.page_size

    def reserve(self, seq_id: Hashable, num_tokens: int) -> list[tuple[int, int]]:
        """Grow the table to at least ``num_tokens`` slots (to the end of their last page);
        return the copy-on-write orders ``(src, dst)`` to run before anything is written
        (the caller made room)."""
        have = self.blocks.seq_len(seq_id)
        if num_tokens <= have:
            return []
        copies = self.blocks.append_slots(seq_id, self._whole(num_tokens) - have)
        self.stats.count("cow_copies", len(copies))
        # The tail entry changes on a copy; new entries follow it.
        self._touch(seq_id, max(self.pages_for(have) - 1, 0))
        return copies

    # -- progress --------------------------------------------------------------------------

    def _tree_insert(self, seq_id: Hashable, tokens, aligned: int) -> int:
        """Insert the first ``aligned`` tokens (whole pages) into the cache, which takes
        over the table's references on the pages it did not have; return the tokens the
        cache had before."""
        return self.cache.insert(tokens[:aligned], self.blocks.slot_mapping(seq_id, 0, aligned))

    def _insert(self, seq_id: Hashable, tokens, aligned: int) -> int:
        """:meth:`_tree_insert`, the sequence keeping its own reference on the pages the
        cache took over. Return the tokens the cache had before."""
        had = self._tree_insert(seq_id, tokens, aligned)
        p = self.page_size
        # The tree took over the references on the pages it did not have: give the
        # sequence its own back (dropped with the rest of the table later).
        self.allocator.incref_blocks(self.blocks.block_table(seq_id)[had // p : aligned // p])
        return had

    def cache_progress(self, seq_id: Hashable, tokens, num_computed: int) -> None:
        """Insert the computed whole pages, adopt the cache's copy of any page another
        request inserted first (freeing the duplicate), and move the lock down to them, so
        that other requests can hit a prompt while it is still being prefilled."""
        p = self.page_size
        aligned = num_computed - num_computed % p
        cached = self._cached.get(seq_id, 0)
        if self.cache is None or aligned <= cached:
            return
        tokens = tokens[:aligned]
        self._insert(seq_id, tokens, aligned)
        m = self.cache.match_prefix(tokens)
        assert m.length == aligned, "the cache lost a page it was just given"
        tree = (m.indices[::p] // p).tolist()
        table = self.blocks.block_table(seq_id)
        for i in range(cached // p, aligned // p):
            if table[i] != tree[i]:
                self.blocks.replace_blocks(seq_id, i, [tree[i]])
                self.stats.count("deduplicated_pages")
                self._touch(seq_id, i)
        self.cache.inc_lock_ref(m.node)
        if seq_id in self._locks:
            self.cache.dec_lock_ref(self._locks[seq_id])
        self._locks[seq_id] = m.node
        self._cached[seq_id] = aligned

    def publish(self, seq_id: Hashable, tokens, num_scheduled: int) -> list[int]:
        """Insert the whole pages of ``tokens[:num_scheduled]`` before they are computed, and
        move the sequence's lock down to them; return the pages that entered the cache.

        For a prompt whose prefill was just planned: the dispatch that writes those pages is
        enqueued before any that can read them, and within one dispatch every chunk writes
        its K/V before any chunk attends, so requests admitted in the same step or the next
        share the pages instead of computing them again. Nothing is published (and the
        pages enter at :meth:`cache_progress`, as before) where the cache already holds some
        of these tokens in other pages: adopting those would redirect writes this step
        makes."""
        p = self.page_size
        aligned = num_scheduled - num_scheduled % p
        cached = self._cached.get(seq_id, 0)
        if self.cache is None or aligned <= cached:
            return []
        table = self.blocks.block_table(seq_id)
        held = self.cache.match_prefix(tokens[:aligned])
        if (held.indices[::p] // p).tolist() != table[: held.length // p]:
            return []
        self.cache_progress(seq_id, tokens, aligned)
        return table[cached // p : aligned // p]

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child shares every page of the parent and locks the same cache path."""
        self.blocks.fork(parent_id, child_id)
        self._cached[child_id] = self._cached.get(parent_id, 0)
        node = self._locks.get(parent_id)
        if node is not None:
            self.cache.inc_lock_ref(node)
            self._locks[child_id] = node
        self._touch(child_id, 0)

    def release(self, seq_id: Hashable, tokens, num_computed: int, *, keep: bool) -> None:
        """Drop the sequence: with ``keep``, its computed whole pages go into the cache
        first (unlocked, so evicted only when needed); then unlock and free the table."""
        cached = self._cached.pop(seq_id, 0)
        handed = None
        if self.cache is not None and keep:
            p = self.page_size
            aligned = num_computed - num_computed % p
            if aligned > cached:
                # The table then drops only the references the tree did not take over.
                had = self._tree_insert(seq_id, tokens, aligned)
                handed = (had // p, aligned // p)
        node = self._locks.pop(seq_id, None)
        if node is not None:
            self.cache.dec_lock_ref(node)
        self.blocks.free(seq_id, handed_over=handed)
        self._changed.pop(seq_id, None)

    # -- inspection and checks -------------------------------------------------------------

    def cached_pages(self) -> set[int]:
        """Pages the radix cache holds."""
        if self.cache is None:
            return set()
        pages: set[int] = set()
        for _, _, slots in self.cache.cached_sequences():
            pages.update((np.asarray(slots) // self.page_size).tolist())
        return pages

    def usage(self) -> dict:
        """Gauges: pool size, pages referenced (cache included), pages the cache holds."""
        return dict(
            num_pages=self.num_pages,
            page_size=self.page_size,
            pages_in_use=self.allocator.num_used,
            cached_pages=(self.cache.total_size // self.page_size) if self.cache else 0,
        )

    def check_invariants(self, seq_ids) -> None:
        """Raise AssertionError unless every page reference belongs to a table of
        ``seq_ids`` or to the cache, and every sequence's cached prefix is its locked path."""
        seq_ids = list(seq_ids)
        assert set(seq_ids) == set(self.blocks.seq_ids), "tables of unknown sequences"
        cached = self.cached_pages()
        self.blocks.check_invariants(other_holders=collections.Counter(cached))
        for seq_id in seq_ids:
            n = self._cached.get(seq_id, 0)
            node = self._locks.get(seq_id)
            if not n:
                continue
            # Walk up from the locked node (read only: a match would touch the LRU).
            values = []
            while node is not None and node.parent is not None:
                assert node.lock_ref > 0, f"seq {seq_id}: its path is not locked"
                values.append(node.value)
                node = node.parent
            slots = np.concatenate(values[::-1])
            assert len(slots) == n, f"seq {seq_id}: cached_len is off"
            pages = (slots[:: self.page_size] // self.page_size).tolist()
            assert pages == self.blocks.block_table(seq_id)[: len(pages)], (
                f"seq {seq_id} left its path"
            )
        if self.cache is not None:
            self.cache.check_invariants()
            assert self.cache.total_size == len(cached) * self.page_size
