"""Continuous-batching scheduler: which sequences run in each step (host side, policy only).

The memory it schedules is the :class:`~jaxattn.engine.kv_cache.KVCacheManager`'s (block
tables and the radix cache over one ref-counted pool); this module decides, that one
carries out. A request's life:

1. admission: ``match(tokens[:-1])`` locks the longest cached prefix; a table for the
   whole prompt is allocated after it (evicting LRU leaves if needed); longest cached
   prefix first (``policy="lpm"``), while memory and the token budget allow;
2. extend: the missing tokens, in chunks of at most ``max_batch_tokens`` per step (decode
   tokens of the same step included); after every chunk the computed whole pages go into
   the cache and the lock moves down to them, so other requests can hit a long prompt
   while it is still being prefilled;
3. the chunk that ends the prompt draws the first token (``n`` tokens for ``n`` parallel
   samples, after which the sequence is forked ``n - 1`` times, sharing every page);
4. decode: ``k`` steps per dispatch (:attr:`StepPlan.decode_steps`), their slots reserved
   up front, a shared tail copied on write. ``k > 1`` only when no request needs the host
   in between (no prompt to prefill, nobody waiting for a free place) and no sequence
   reaches its length limit inside the ``k`` steps. When even eviction cannot free a page,
   the newest running sequence is preempted: its computed pages go into the cache
   (unlocked, so they are evicted only as far as needed) and it waits to be readmitted,
   usually with a long prefix hit;
5. finish (stop token, ``max_new_tokens`` or non-finite logits): insert, unlock, free.

Planning may run ahead of the device (the overlap scheduler): ``num_scheduled`` counts
the tokens whose KV is computed or in a dispatch whose results were not read yet,
``pending`` the tokens drawn in such dispatches, and :meth:`Scheduler.commit` applies a
dispatch's results when they are read. Everything decided ahead is valid whatever those
results are: a sequence that stops on a stop token in step ``t`` may be planned for step
``t + 1``, where the device skips it (its row is finished) and the host drops its planned
tokens. Only a preemption needs the exact state; :meth:`Scheduler.schedule` then asks for
the results first.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import NamedTuple

import numpy as np

from .config import SchedulerConfig
from .kv_cache import KVCacheManager
from .stats import StatsCollector

__all__ = ["Chunk", "Decode", "Scheduler", "Sequence", "StepPlan"]

# What the decode program reports for a step a row did not run (see runner.NO_TOKEN).
NO_TOKEN = -2


@dataclasses.dataclass(eq=False)
class Sequence:
    """One output sequence (one of the ``n`` samples of a request) and its progress."""

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
    num_computed: int = 0  # tokens whose KV is computed (results read)
    num_scheduled: int = 0  # ... or in a dispatch whose results are not read yet
    pending: int = 0  # tokens drawn in dispatches whose results are not read yet
    prefilling: bool = True  # an extend chunk must still end the prompt and draw
    admitted: int = -1
    finish_reason: str | None = None  # "stop", "length" or "error"
    error: str | None = None  # why, when finish_reason is "error"
    tag: object = None  # the caller's handle (e.g. the output index)
    row: int | None = None  # the device decode row serving this sequence
    # tokens as an int64 array (token_array), rebuilt when tokens has grown
    _array: np.ndarray | None = dataclasses.field(default=None, init=False, repr=False)

    def token_array(self) -> np.ndarray:
        """``tokens`` as an int64 array, the form the radix trees take, cached: the
        scheduler compares and matches a waiting prompt's tokens every step, and a list of
        hundreds of ints costs tens of microseconds to convert each time. ``tokens`` only
        grows (appended at commit), so an array of its current length is current, and
        one that is shorter only lacks the tokens appended since."""
        arr, n = self._array, len(self.tokens)
        if arr is None or len(arr) > n:
            arr = self._array = np.asarray(self.tokens, np.int64)
        elif len(arr) < n:
            tail = np.asarray(self.tokens[len(arr) :], np.int64)
            arr = self._array = np.concatenate([arr, tail])
        return arr

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def length(self) -> int:
        """Tokens including those drawn in dispatches not read yet."""
        return len(self.tokens) + self.pending

    @property
    def budget(self) -> int:
        """Tokens the sequence may still draw beyond the planned ones."""
        return self.max_new_tokens - self.num_generated - self.pending

    @property
    def decode_ready(self) -> bool:
        return (
            not self.prefilling
            and not self.fork_ids
            and self.finish_reason is None
            and self.budget > 0
        )


class Chunk(NamedTuple):
    """Extend tokens ``[start, end)`` of ``seq``; ``draws``: the chunk ends the prompt, so
    ``1 + len(seq.fork_ids)`` tokens are drawn from its last row."""

    seq: Sequence
    start: int
    end: int
    draws: bool


class Decode(NamedTuple):
    """``steps`` decode steps of ``seq`` from ``position`` (the position of its last
    token, whose KV the first step writes)."""

    seq: Sequence
    position: int


@dataclasses.dataclass
class StepPlan:
    """What one step runs: extend chunks, decode sequences for ``decode_steps`` steps,
    copy-on-write page copies to apply before any write, and the sequences preempted
    while planning."""

    extend: list[Chunk] = dataclasses.field(default_factory=list)
    decode: list[Decode] = dataclasses.field(default_factory=list)
    decode_steps: int = 1
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    preempted: list[Sequence] = dataclasses.field(default_factory=list)
    # The decode slots are promised, not reserved yet: whoever runs the plan reserves them
    # (``kv.reserve(seq, position + decode_steps)`` in plan order).
    deferred: bool = False
    # Pages whose prefill this plan computes and that entered the prefix cache when it was
    # planned (SchedulerConfig.cache_on_plan): written once, by this plan, though shared.
    published: list[int] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.extend or self.decode)

    @property
    def num_draws(self) -> int:
        """Tokens the plan draws, forks included."""
        drawn = sum(1 + len(c.seq.fork_ids) for c in self.extend if c.draws)
        return drawn + len(self.decode) * self.decode_steps


class Scheduler:
    """Admission, chunking, multi-step and preemption decisions over a KV cache manager.

    Args:
      kv: the memory (block tables, radix cache).
      config: the policy knobs (:class:`~jaxattn.engine.SchedulerConfig`).
      stats: where events are counted.
    """

    def __init__(self, kv: KVCacheManager, config: SchedulerConfig, stats: StatsCollector):
        self.kv = kv
        self.config = config
        self.page_size = kv.page_size
        dedup = config.dedup_tokens
        self.dedup_tokens = max(kv.page_size, 32) if dedup is None else dedup
        self.stats = stats
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # in admission order: the newest is last
        self._admissions = itertools.count()
        self._uncommitted: list[StepPlan] = []  # planned, results not committed yet
        # Leave the decode reservations to the caller (device paging: it snapshots the
        # pages before them and the device makes the same reservations).
        self.defer_reservations = False

    # -- queries ---------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pages_for(self, num_tokens: int) -> int:
        return self.kv.pages_for(num_tokens)

    @staticmethod
    def draws(seq: Sequence) -> list[tuple]:
        """``(seed, sample_id, temperature, top_p)`` of every token drawn when the prompt of
        ``seq`` ends: its own, then one per sequence it forks into."""
        ids = [seq.sample_id] + [sample_id for _, sample_id in seq.fork_ids]
        return [(seq.seed, i, seq.temperature, seq.top_p) for i in ids]

    # -- planning ---------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self, *, in_flight: bool = False) -> StepPlan | None:
        """The next step's plan (empty when nothing can run), or None when it needs a
        preemption while a dispatch is ``in_flight``: commit that one, then ask again."""
        cfg = self.config
        plan = StepPlan()
        budget = cfg.max_batch_tokens
        self.kv.promised = 0
        ready = [s for s in self.running if s.decode_ready]
        host_needed = any(s.prefilling for s in self.running) or (
            self.waiting and sum(1 + len(s.fork_ids) for s in self.running) < cfg.max_running
        )
        steps = 1
        if ready and not host_needed and cfg.decode_steps > 1:
            steps = min(cfg.decode_steps, min(s.budget for s in ready))
        # Decode first: running sequences are never starved by new arrivals.
        if ready:
            ready = self._reserve_decode(ready, steps, plan, in_flight)
            if ready is None:
                return None
        budget -= len(plan.decode)
        # Chunks of prompts already being prefilled, oldest first.
        for seq in self.running:
            if budget <= 0:
                break
            if seq.prefilling:
                budget -= self._plan_chunk(seq, plan, budget)
        if self.waiting and not plan.preempted:
            self._admit(plan, budget)
        if plan:
            self._uncommitted.append(plan)
        return plan

    def _plan_chunk(self, seq: Sequence, plan: StepPlan, budget: int) -> int:
        start = seq.num_scheduled
        end = start + min(seq.length - start, budget)
        draws = end == seq.length
        plan.extend.append(Chunk(seq, start, end, draws))
        seq.num_scheduled = end
        if self.config.cache_on_plan:
            plan.published += self.kv.publish(seq.seq_id, seq.token_array(), end)
        if draws:
            seq.prefilling = False
            seq.pending += 1  # forks draw theirs into sequences made at commit
        return end - start

    def _reserve_decode(self, ready, steps, plan, in_flight):
        """Reserve the slots of ``steps`` steps for every ready sequence (fewer steps when
        the pool is short); return the sequences planned, or None when only a preemption
        would make room while a dispatch is in flight."""
        kv = self.kv
        while True:
            need = sum(kv.pages_to_reserve(s.seq_id, s.num_scheduled + steps) for s in ready)
            if kv.evict_for(need):
                break
            if steps == 1:
                if in_flight:
                    return None
                return self._reserve_one_by_one(ready, plan)
            steps = 1
        plan.decode_steps = steps
        if self.defer_reservations:
            kv.promised = need
            plan.deferred = True
            for seq in ready:
                plan.decode.append(Decode(seq, seq.num_scheduled))
                seq.num_scheduled += steps
                seq.pending += steps
            return ready
        for seq in ready:
            self._plan_decode(seq, steps, plan)
        return ready

    def _reserve_one_by_one(self, ready, plan):
        """One step each, oldest first, preempting the newest running sequence whenever
        even an empty cache cannot supply the next page."""
        kv = self.kv
        planned = []
        for seq in ready:
            if seq not in self.running:
                continue  # preempted for an older sequence
            need = kv.pages_to_reserve(seq.seq_id, seq.num_scheduled + 1)
            if not self._make_room(need, seq, plan):
                continue
            self._plan_decode(seq, 1, plan)
            planned.append(seq)
        return planned

    def _plan_decode(self, seq: Sequence, steps: int, plan: StepPlan) -> None:
        plan.copies += self.kv.reserve(seq.seq_id, seq.num_scheduled + steps)
        plan.decode.append(Decode(seq, seq.num_scheduled))
        seq.num_scheduled += steps
        seq.pending += steps

    def _future_pages(self, seq: Sequence) -> int:
        left = max(seq.max_new_tokens - max(seq.num_generated + seq.pending, 0), 0)
        width = 1 + len(seq.fork_ids)
        return width * self.pages_for(int(np.ceil(left * self.config.new_token_ratio)))

    def _candidates(self) -> list[Sequence]:
        if self.config.policy == "fcfs" or self.kv.cache is None or len(self.waiting) > 256:
            return sorted(self.waiting, key=lambda s: s.arrival)
        hit = {id(s): self.kv.prefix_len(s.token_array()[:-1]) for s in self.waiting}
        return sorted(self.waiting, key=lambda s: (-hit[id(s)], s.arrival))

    def _shares_inflight(self, seq: Sequence, cached: int, plan: StepPlan) -> bool:
        """Whether ``seq`` shares ``dedup_tokens`` uncached tokens with a prompt being
        prefilled in this plan or in one whose results are not committed yet (it then
        waits until those pages are in the cache)."""
        if not self.dedup_tokens:
            return False
        mine = seq.token_array()[:-1]
        upto = cached + self.dedup_tokens  # shared through here: wait
        if len(mine) < upto:
            return False
        chunks = [c for p in self._uncommitted for c in p.extend] + plan.extend
        for chunk in chunks:
            theirs = chunk.seq.token_array()
            # The window past the cached tokens first: it tells most prompts apart.
            if (
                len(theirs) >= upto
                and np.array_equal(mine[cached:upto], theirs[cached:upto])
                and np.array_equal(mine[:cached], theirs[:cached])
            ):
                return True
        return False

    def _admit(self, plan: StepPlan, budget: int) -> None:
        kv = self.kv
        reserve = sum(self._future_pages(s) for s in self.running)
        # Sequences to come from forks count already: they decode in rows of their own.
        running = sum(1 + len(s.fork_ids) for s in self.running)
        for seq in self._candidates():
            width = 1 + len(seq.fork_ids)
            if budget <= 0 or (running and running + width > self.config.max_running):
                break
            prompt = seq.token_array()[:-1]
            if self._shares_inflight(seq, kv.prefix_len(prompt), plan):
                continue
            match = kv.match(prompt)
            need = self.pages_for(len(seq.tokens)) - len(match.pages)
            future = self._future_pages(seq)
            avail = kv.available_pages()
            if need > avail or (self.running and need + future + reserve > avail):
                kv.unlock(match)
                break
            made = kv.evict_for(need)
            assert made, "admission never preempts"
            kv.allocate(seq.seq_id, len(seq.tokens), match)
            seq.num_computed = seq.num_scheduled = match.length
            seq.prefilling = True
            seq.admitted = next(self._admissions)
            self.waiting.remove(seq)
            self.running.append(seq)
            self.stats.count("admissions")
            self.stats.count("prefix_hit_tokens", match.length)
            reserve += future
            running += width
            budget -= self._plan_chunk(seq, plan, budget)

    # -- memory -----------------------------------------------------------------------------

    def _make_room(self, pages: int, needer: Sequence, plan: StepPlan) -> bool:
        """Free pages until ``pages`` are free: evict unlocked cache leaves (LRU), then
        preempt the newest running sequence. False when ``needer`` itself was preempted."""
        while not self.kv.evict_for(pages):
            if not self.running:
                raise RuntimeError(
                    f"the KV pool cannot supply {pages} pages with nothing running "
                    f"({self.kv.free_pages} free): a leak, or a request larger than the pool"
                )
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is needer:
                return False
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Only with nothing in flight: the sequence's state is exact."""
        assert seq.num_scheduled == seq.num_computed and not seq.pending, "preempted in flight"
        self.kv.release(seq.seq_id, seq.token_array(), seq.num_computed, keep=True)
        seq.num_computed = seq.num_scheduled = 0
        seq.prefilling = True
        seq.admitted = -1
        self.running.remove(seq)
        self.waiting.append(seq)
        plan.preempted.append(seq)
        self.stats.count("preemptions")

    # -- results ----------------------------------------------------------------------------

    def _fork(self, parent: Sequence, seq_id: int, sample_id: int) -> Sequence:
        child = dataclasses.replace(
            parent,
            seq_id=seq_id,
            sample_id=sample_id,
            tokens=list(parent.tokens),
            fork_ids=[],
            admitted=next(self._admissions),
            row=None,
        )
        self.kv.fork(parent.seq_id, seq_id)
        self.running.append(child)
        self.stats.count("forks")
        return child

    def _take(self, seq: Sequence, token: int) -> bool:
        """Append a drawn token; True when the sequence is done. A row whose logits were
        not finite (a negative token) ends the sequence with an error instead."""
        if token < 0:
            seq.finish_reason = "error"
            seq.error = (
                f"the model's logits for position {len(seq.tokens)} are not finite (NaN or "
                "inf in the weights, the inputs or the KV cache); no token was drawn"
            )
            return True
        seq.tokens.append(int(token))
        self.stats.count("generated_tokens")
        if token in seq.stop_ids:
            seq.finish_reason = "stop"
        elif seq.num_generated >= seq.max_new_tokens:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _take_many(self, seq: Sequence, tokens: np.ndarray) -> int:
        """:meth:`_take` for the tokens of consecutive decode steps, up to the first that
        ends the sequence; return the steps consumed (each wrote one token's KV)."""
        room = seq.max_new_tokens - seq.num_generated
        tokens = tokens[:room]
        ends = tokens < 0
        if seq.stop_ids:
            ends |= np.isin(tokens, list(seq.stop_ids))
        if ends.any():
            last = int(np.argmax(ends))
            tokens = tokens[: last + 1]
        elif len(tokens) < room:
            self._append(seq, tokens)
            return len(tokens)
        assert tokens.size and tokens[-1] != NO_TOKEN, f"seq {seq.seq_id}: a step did not run"
        self._append(seq, tokens[:-1])
        self._take(seq, int(tokens[-1]))
        return len(tokens)

    def _append(self, seq: Sequence, tokens: np.ndarray) -> None:
        seq.tokens.extend(tokens.tolist())
        self.stats.count("generated_tokens", len(tokens))

    def commit(self, plan: StepPlan, extend_tokens, decode_tokens) -> list[Sequence]:
        """Apply a step's drawn tokens; return the sequences that finished (released).

        ``extend_tokens`` lists the draws of every chunk that ends a prompt, in plan
        order, one per sampler (the sequence first, then each sequence to fork);
        ``decode_tokens[i]`` the ``plan.decode_steps`` tokens of ``plan.decode[i]``.
        Tokens planned for a sequence that finished in an earlier commit are dropped.
        """
        self._uncommitted = [p for p in self._uncommitted if p is not plan]
        done: list[Sequence] = []
        drawn = iter(np.asarray(extend_tokens).tolist())
        for seq, start, end, draws in plan.extend:
            seq.num_computed = end
            self.stats.count("prefill_tokens", end - start)
            self.kv.cache_progress(seq.seq_id, seq.token_array(), end)
            if not draws:
                continue
            seq.pending -= 1
            group = [(seq, next(drawn))]
            for seq_id, sample_id in seq.fork_ids:
                group.append((self._fork(seq, seq_id, sample_id), next(drawn)))
            seq.fork_ids = []
            for s, token in group:
                if self._take(s, token):
                    done.append(s)
        steps = plan.decode_steps
        if plan.decode:
            decode_tokens = np.asarray(decode_tokens)[:, :steps]
            computed = 0
            for (seq, _), tokens in zip(plan.decode, decode_tokens, strict=True):
                if seq.finish_reason is not None:
                    continue
                seq.pending -= steps
                n = self._take_many(seq, tokens)
                seq.num_computed += n
                computed += n
                if seq.finish_reason is not None:
                    done.append(seq)
            self.stats.count("decode_tokens", computed)
        for seq in done:
            self.kv.release(
                seq.seq_id, seq.token_array(), seq.num_computed, keep=seq.finish_reason != "error"
            )
            self.running.remove(seq)
        return done

    # -- checks -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError unless every page reference is accounted for and every
        running sequence's table covers what it computed and planned."""
        kv = self.kv
        for seq in self.running:
            n = len(kv.table(seq.seq_id))
            reserved = kv.reserved(seq.seq_id)
            assert seq.num_computed <= seq.num_scheduled <= reserved, (
                f"seq {seq.seq_id}: {seq.num_computed} computed, {seq.num_scheduled} "
                f"scheduled, {reserved} slots"
            )
            assert n == self.pages_for(reserved), f"seq {seq.seq_id}: {n} pages"
            upto = self.pages_for(max(seq.length, seq.num_scheduled)) * self.page_size
            assert reserved <= upto, f"seq {seq.seq_id}: {reserved} slots for {seq.length}"
        for seq in self.waiting:
            assert seq.seq_id not in kv.blocks, f"waiting seq {seq.seq_id} holds a table"
        kv.check_invariants([s.seq_id for s in self.running])
