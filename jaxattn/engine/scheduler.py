"""Continuous-batching scheduler over the page pool and the radix cache (host side).

Memory model. The KV pool is ``num_pages`` pages of ``page_size`` slots
(:class:`~jaxattn.engine.pool.PagePool`), each with a reference count. Holders:

* the radix cache (page granular: ``RadixCache(page_size=P)``) holds one reference per
  page of its nodes;
* every running sequence holds one reference per page of its block table. The first
  ``cached_len`` tokens of a table are pages of the cache on the path the sequence has
  locked (``inc_lock_ref``), the rest are its own, except after a fork, where siblings
  share the prompt's partial tail page until one of them writes into it (copy-on-write).

So a page that only the cache holds is exactly a page of an unlocked node: eviction
frees precisely ``evictable_size`` tokens, and no page is freed while anyone reads it.
A slot is written only when its page has one reference (the writer's): new pages are
fresh, matched prefix pages are never written (writes start at ``num_computed >=
cached_len``), and a shared tail page is copied first.

A request's life (seed part 4):

1. admission: ``match_prefix(tokens[:-1])`` and lock; allocate pages for the rest of the
   prompt (evicting LRU leaves if needed); longest cached prefix first;
2. extend: the missing tokens, in chunks of at most ``max_batch_tokens`` per step
   (decode tokens of the same step included); after every chunk the computed whole pages
   are inserted into the cache and the lock moves down to them, so other requests can
   hit a long prompt while it is still being prefilled;
3. the chunk that ends the prompt draws the first token (``n`` tokens for ``n`` parallel
   samples, after which the sequence is forked ``n - 1`` times, sharing every page);
4. decode: one token per step; a new page when the tail page is full, a copy when it is
   shared. When even eviction cannot free a page, the newest running sequence is
   preempted: its computed pages go into the cache (unlocked, so they are evicted only
   as far as needed) and it waits to be readmitted, usually with a long prefix hit;
5. finish (stop token or ``max_new_tokens``): insert, unlock, drop the table.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

import numpy as np

from jaxattn.radix import RadixCache

from .pool import PagePool

__all__ = ["Scheduler", "Sequence", "StepPlan"]


@dataclasses.dataclass(eq=False)
class Sequence:
    """One output sequence (one of the ``n`` samples of a request) and its KV state."""

    seq_id: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    sample_id: int = 0  # key stream of the sampler: index among the n samples
    stop_ids: frozenset = frozenset()
    arrival: int = 0
    fork_ids: list = dataclasses.field(default_factory=list)  # (seq_id, sample_id) to fork
    table: list = dataclasses.field(default_factory=list)
    num_computed: int = 0
    cached_len: int = 0
    lock_node: object = None
    admitted: int = -1
    finish_reason: str | None = None  # "stop", "length" or "error"
    error: str | None = None  # why, when finish_reason is "error"
    tag: object = None  # the caller's handle (e.g. the output index)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def remaining(self) -> int:
        """Tokens whose KV is still to compute (the last token is always among them)."""
        return len(self.tokens) - self.num_computed


@dataclasses.dataclass
class StepPlan:
    """What one step runs: extend chunks ``(seq, start, end, draws)`` (``draws``: the
    chunk ends the prompt, so ``1 + len(seq.fork_ids)`` tokens are drawn from its last
    row), decode sequences, and copy-on-write page copies to apply before any write."""

    extend: list = dataclasses.field(default_factory=list)
    decode: list = dataclasses.field(default_factory=list)
    copies: list = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.extend or self.decode)


class Scheduler:
    """Admission, chunking, memory and preemption decisions; no device work.

    Args:
      num_pages, page_size: the pool.
      max_batch_tokens: tokens computed per step (decode tokens + extend chunks).
      max_running: sequences running at once.
      radix_cache: share prefixes across requests (False: every request computes its
        whole prompt and frees its pages at the end).
      policy: ``"lpm"`` (longest cached prefix first, then arrival) or ``"fcfs"``.
      new_token_ratio: admission keeps ``ratio * (tokens still to generate)`` worth of
        pages free for every running sequence, so that admissions do not immediately
        force preemptions (0: admit while the prompt fits).
      dedup_tokens: a waiting request that shares at least this many uncached tokens
        with a prompt being prefilled in the step waits one step and then hits the cache
        instead of computing them again (None: ``max(page_size, 32)``; 0: off).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        max_batch_tokens: int,
        max_running: int,
        radix_cache: bool = True,
        policy: str = "lpm",
        new_token_ratio: float = 0.3,
        dedup_tokens: int | None = None,
    ):
        if policy not in ("lpm", "fcfs"):
            raise ValueError(f"policy must be 'lpm' or 'fcfs', got {policy!r}")
        if not 0.0 <= new_token_ratio <= 1.0:
            raise ValueError(f"new_token_ratio must be in [0, 1], got {new_token_ratio!r}")
        self.pool = PagePool(num_pages, page_size)
        self.page_size = page_size
        self.cache = RadixCache(self.pool, page_size=page_size) if radix_cache else None
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.policy = policy
        self.new_token_ratio = float(new_token_ratio)
        self.dedup_tokens = max(page_size, 32) if dedup_tokens is None else int(dedup_tokens)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # in admission order: the newest is last
        self.stats: collections.Counter = collections.Counter()
        self._admissions = itertools.count()
        self._preempted_in_step = False

    # -- queries ----------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def cached_pages(self) -> set[int]:
        """Pages held by the radix cache."""
        if self.cache is None:
            return set()
        pages: set[int] = set()
        for _, _, slots in self.cache.cached_sequences():
            pages.update((np.asarray(slots) // self.page_size).tolist())
        return pages

    @staticmethod
    def draws(seq: Sequence) -> list[tuple]:
        """``(seed, sample_id, temperature, top_p)`` of every token drawn when the prompt of
        ``seq`` ends: its own, then one per sequence it forks into."""
        ids = [seq.sample_id] + [sample_id for _, sample_id in seq.fork_ids]
        return [(seq.seed, i, seq.temperature, seq.top_p) for i in ids]

    def slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end)
        table = np.asarray(seq.table, np.int64)
        return (table[pos // self.page_size] * self.page_size + pos % self.page_size).astype(
            np.int32
        )

    # -- planning ---------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._preempted_in_step = False
        budget = self.max_batch_tokens
        # Decode first: running sequences are never starved by new arrivals.
        for seq in list(self.running):
            if seq.remaining != 1 or seq.fork_ids or seq not in self.running:
                continue
            if self._reserve_decode(seq, plan):
                plan.decode.append(seq)
        budget -= len(plan.decode)
        # Chunks of prompts already being prefilled, oldest first.
        for seq in self.running:
            if budget <= 0:
                break
            if seq.remaining > 1 or seq.fork_ids:
                budget -= self._plan_chunk(seq, plan, budget)
        if not self._preempted_in_step:
            self._admit(plan, budget)
        return plan

    def _plan_chunk(self, seq: Sequence, plan: StepPlan, budget: int) -> int:
        start = seq.num_computed
        end = start + min(seq.remaining, budget)
        plan.extend.append((seq, start, end, end == len(seq.tokens)))
        return end - start

    def _reserve_decode(self, seq: Sequence, plan: StepPlan) -> bool:
        """Make the page of position ``num_computed`` writable; False if ``seq`` was
        preempted to find memory."""
        idx = seq.num_computed // self.page_size
        if (idx == len(seq.table) or self.pool.ref_count(seq.table[idx]) > 1) and not (
            self._make_room(1, seq)
        ):
            return False
        if idx == len(seq.table):
            seq.table.append(self.pool.alloc_pages(1)[0])
        elif self.pool.ref_count(seq.table[idx]) > 1:
            # Copy-on-write: the sibling keeps the shared page, this one writes a copy.
            new = self.pool.alloc_pages(1)[0]
            plan.copies.append((seq.table[idx], new))
            self.pool.free_pages([seq.table[idx]])
            seq.table[idx] = new
            self.stats["cow_copies"] += 1
        return True

    def _future_pages(self, seq: Sequence) -> int:
        left = max(seq.max_new_tokens - max(seq.num_generated, 0), 0)
        width = 1 + len(seq.fork_ids)
        return width * self.pages_for(int(np.ceil(left * self.new_token_ratio)))

    def _available_pages(self) -> int:
        evictable = self.cache.evictable_size // self.page_size if self.cache else 0
        return self.pool.num_free_pages + evictable

    def _candidates(self) -> list[Sequence]:
        if self.policy == "fcfs" or self.cache is None or len(self.waiting) > 256:
            return sorted(self.waiting, key=lambda s: s.arrival)
        hit = {id(s): self.cache.prefix_len(s.tokens[:-1]) for s in self.waiting}
        return sorted(self.waiting, key=lambda s: (-hit[id(s)], s.arrival))

    def _shares_inflight(self, seq: Sequence, cached: int, plan: StepPlan) -> bool:
        if not self.dedup_tokens:
            return False
        mine = np.asarray(seq.tokens[:-1])
        for other, *_ in plan.extend:
            theirs = np.asarray(other.tokens[: len(mine)])
            n = min(len(mine), len(theirs))
            diff = np.flatnonzero(mine[:n] != theirs[:n])
            common = int(diff[0]) if diff.size else n
            if common - cached >= self.dedup_tokens:
                return True
        return False

    def _admit(self, plan: StepPlan, budget: int) -> None:
        reserve = sum(self._future_pages(s) for s in self.running)
        for seq in self._candidates():
            width = 1 + len(seq.fork_ids)
            if budget <= 0 or (self.running and len(self.running) + width > self.max_running):
                break
            cached = self.cache.prefix_len(seq.tokens[:-1]) if self.cache else 0
            if self._shares_inflight(seq, cached, plan):
                continue
            if self.cache is not None:
                match = self.cache.match_prefix(seq.tokens[:-1])
                self.cache.inc_lock_ref(match.node)
                cached_pages = (match.indices[:: self.page_size] // self.page_size).tolist()
                cached = match.length
            else:
                match, cached_pages, cached = None, [], 0
            need = self.pages_for(len(seq.tokens)) - len(cached_pages)
            future = self._future_pages(seq)
            avail = self._available_pages()
            if need > avail or (self.running and need + future + reserve > avail):
                if match is not None:
                    self.cache.dec_lock_ref(match.node)
                break
            made = self._make_room(need, None)
            assert made, "admission never preempts"
            self.pool.incref_pages(cached_pages)
            seq.table = cached_pages + self.pool.alloc_pages(need)
            seq.num_computed = seq.cached_len = cached
            seq.lock_node = match.node if match is not None else None
            seq.admitted = next(self._admissions)
            self.waiting.remove(seq)
            self.running.append(seq)
            self.stats["admissions"] += 1
            self.stats["prefix_hit_tokens"] += cached
            reserve += future
            budget -= self._plan_chunk(seq, plan, budget)

    # -- memory -----------------------------------------------------------------------------

    def _make_room(self, pages: int, needer: Sequence | None) -> bool:
        """Free pages until ``pages`` are free: evict unlocked cache leaves (LRU), then
        preempt the newest running sequence. False when ``needer`` itself was preempted."""
        while self.pool.num_free_pages < pages:
            short = pages - self.pool.num_free_pages
            if self.cache is not None and self.cache.evictable_size:
                self.stats["evicted_tokens"] += self.cache.evict(short * self.page_size)
                continue
            if not self.running:
                raise RuntimeError(
                    f"the KV pool cannot supply {pages} pages with nothing running "
                    f"({self.pool.num_free_pages} free): a leak, or a request larger "
                    "than the pool"
                )
            victim = self.running[-1]
            self._preempt(victim)
            if victim is needer:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.table, seq.num_computed, seq.cached_len, seq.lock_node = [], 0, 0, None
        seq.admitted = -1
        self.running.remove(seq)
        self.waiting.append(seq)
        self.stats["preemptions"] += 1
        self._preempted_in_step = True

    def _release(self, seq: Sequence) -> None:
        """Hand the computed whole pages to the cache, unlock, drop every own reference.
        A sequence that failed hands over nothing more."""
        if self.cache is not None:
            n = seq.num_computed
            aligned = n - n % self.page_size
            if aligned > seq.cached_len and seq.finish_reason != "error":
                had = self.cache.insert(seq.tokens[:aligned], self.slots(seq, 0, aligned))
                # The cache took over this sequence's references on the pages it did not
                # have yet; give the sequence its own back, dropped with the rest below.
                self.pool.incref_pages(seq.table[had // self.page_size : aligned // self.page_size])
            if seq.lock_node is not None:
                self.cache.dec_lock_ref(seq.lock_node)
        self.pool.free_pages(seq.table)

    def _cache_progress(self, seq: Sequence) -> None:
        """Insert the computed whole pages, adopt the cache's copy of any page another
        request inserted first (freeing the duplicate) and move the lock down."""
        p = self.page_size
        aligned = seq.num_computed - seq.num_computed % p
        if self.cache is None or aligned <= seq.cached_len:
            return
        tokens = seq.tokens[:aligned]
        had = self.cache.insert(tokens, self.slots(seq, 0, aligned))
        self.pool.incref_pages(seq.table[had // p : aligned // p])
        match = self.cache.match_prefix(tokens)
        assert match.length == aligned
        tree_pages = (match.indices[::p] // p).tolist()
        for i in range(seq.cached_len // p, aligned // p):
            if seq.table[i] != tree_pages[i]:
                self.pool.incref_pages([tree_pages[i]])
                self.pool.free_pages([seq.table[i]])
                seq.table[i] = tree_pages[i]
                self.stats["deduplicated_pages"] += 1
        self.cache.inc_lock_ref(match.node)
        if seq.lock_node is not None:
            self.cache.dec_lock_ref(seq.lock_node)
        seq.lock_node, seq.cached_len = match.node, aligned

    # -- results ----------------------------------------------------------------------------

    def _fork(self, parent: Sequence, seq_id: int, sample_id: int) -> Sequence:
        child = dataclasses.replace(
            parent,
            seq_id=seq_id,
            sample_id=sample_id,
            tokens=list(parent.tokens),
            table=list(parent.table),
            fork_ids=[],
            admitted=next(self._admissions),
        )
        self.pool.incref_pages(child.table)
        if self.cache is not None and child.lock_node is not None:
            self.cache.inc_lock_ref(child.lock_node)
        self.running.append(child)
        self.stats["forks"] += 1
        return child

    def _take(self, seq: Sequence, token: int) -> bool:
        """Append a drawn token; True when the sequence is done. A row whose logits were
        not finite (token NON_FINITE) ends the sequence with an error instead."""
        if token < 0:
            seq.finish_reason = "error"
            seq.error = (
                f"the model's logits for position {len(seq.tokens)} are not finite (NaN or "
                "inf in the weights, the inputs or the KV cache); no token was drawn"
            )
            return True
        seq.tokens.append(int(token))
        return self._is_done(seq)

    def _is_done(self, seq: Sequence) -> bool:
        if seq.tokens[-1] in seq.stop_ids:
            seq.finish_reason = "stop"
        elif seq.num_generated >= seq.max_new_tokens:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def commit(self, plan: StepPlan, extend_tokens, decode_tokens) -> list[Sequence]:
        """Apply a step's drawn tokens; return the sequences that finished (released).

        ``extend_tokens`` lists the draws of every chunk that ends a prompt, in plan
        order, one per sampler (the sequence first, then each sequence to fork).
        """
        done: list[Sequence] = []
        drawn = iter(np.asarray(extend_tokens).tolist())
        for seq, start, end, draws in plan.extend:
            seq.num_computed = end
            self.stats["prefill_tokens"] += end - start
            self._cache_progress(seq)
            if not draws:
                continue
            first = next(drawn)
            group = [(seq, first)]
            for seq_id, sample_id in seq.fork_ids:
                group.append((self._fork(seq, seq_id, sample_id), next(drawn)))
            seq.fork_ids = []
            for s, token in group:
                if self._take(s, token):
                    done.append(s)
        for seq, token in zip(plan.decode, np.asarray(decode_tokens).tolist(), strict=False):
            seq.num_computed += 1
            self.stats["decode_tokens"] += 1
            if self._take(seq, token):
                done.append(seq)
        for seq in done:
            self._release(seq)
            seq.table, seq.lock_node = [], None
            self.running.remove(seq)
        return done

    # -- checks -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError unless every page reference is accounted for."""
        holders = collections.Counter()
        cached = self.cached_pages()
        holders.update(cached)
        for seq in self.running:
            n = len(seq.table)
            assert self.pages_for(seq.num_computed) <= n <= self.pages_for(len(seq.tokens)), (
                f"seq {seq.seq_id}: {n} pages for {seq.num_computed} computed tokens"
            )
            assert len(set(seq.table)) == n, f"seq {seq.seq_id} lists a page twice"
            holders.update(seq.table)
            if self.cache is not None and seq.cached_len:
                # Walk up from the locked node (read only: a match would touch the LRU).
                values, node = [], seq.lock_node
                while node is not None and node.parent is not None:
                    assert node.lock_ref > 0, f"seq {seq.seq_id}: its path is not locked"
                    values.append(node.value)
                    node = node.parent
                slots = np.concatenate(values[::-1])
                assert len(slots) == seq.cached_len, f"seq {seq.seq_id}: cached_len is off"
                pages = (slots[:: self.page_size] // self.page_size).tolist()
                assert pages == seq.table[: len(pages)], f"seq {seq.seq_id} left its path"
        for seq in self.waiting:
            assert not seq.table and seq.lock_node is None
        refs = self.pool.ref_counts()
        for page in range(self.pool.num_pages):
            assert refs[page] == holders.get(page, 0), (
                f"page {page}: {refs[page]} references, {holders.get(page, 0)} holders"
            )
        self.pool.check_invariants()
        if self.cache is not None:
            self.cache.check_invariants()
            assert self.cache.total_size == len(cached) * self.page_size
