"""The serving engine: continuous batching over a paged KV pool with a radix prefix cache.

Each :meth:`Engine.step`:

1. the :class:`~jaxattn.engine.scheduler.Scheduler` plans the step on the host: decode
   slots for every running sequence (``decode_steps`` of them when no request needs the
   host in between), the next chunk of every prompt being prefilled, and new requests
   admitted longest-cached-prefix first while memory and the token budget allow;
2. the engine turns the plan into device work (decode rows to start, table entries that
   changed, extend chunks) and the :class:`~jaxattn.engine.runner.ModelRunner` enqueues
   it: copy-on-write copies, the extend chunks (``extend_attention`` / ``prefix_prefill``
   over the pool) and the decode steps (``paged_attention``, or ``cascade_attention``
   when decoding sequences share cached prefix pages; ``ExecutionConfig.cascade``),
   sampling on the device;
3. the scheduler commits the tokens of a step once they are read: prompts that ended
   fork into their ``n`` samples, finished sequences go into the cache and release their
   pages.

With ``overlap`` (the default) step 3 of step ``t`` runs after steps 1-2 of step ``t + 1``:
the host plans and enqueues the next step while the device runs the current one, and a
step's results are read one :meth:`step` later. The outputs are the same token for token;
only the step in which a finished sequence is reported moves.

Memory: :mod:`jaxattn.engine.kv_cache`. Settings: :mod:`jaxattn.engine.config`.
"""

from __future__ import annotations

import itertools
import numbers
import time
from collections.abc import Sequence as SequenceABC
from typing import NamedTuple

import numpy as np

from jaxattn.cascade_cost import cascade_may_pay_off, cascade_pays_off

from .cascade import CascadeLevels, cascade_levels
from .config import (
    CacheConfig,
    ExecutionConfig,
    SchedulerConfig,
    bucket,
    kv_cache_dtype,
    split_engine_kwargs,
    token_ids,
)
from .kv_cache import KVCacheManager
from .model import check_model
from .progress import ProgressBar
from .runner import DecodeRows, DecodeWork, ExtendItem, ModelRunner, PageUpload, StepWork
from .scheduler import Scheduler, Sequence, StepPlan
from .stats import StatsCollector

__all__ = ["Engine", "RequestError"]


class RequestError(RuntimeError):
    """Some requests of a :meth:`Engine.generate` call failed (their logits were not finite).

    ``failed``: output index -> reason; ``outputs``: every output, as :meth:`generate`
    would have returned them, the failed ones cut where they failed.
    """

    def __init__(self, failed: dict[int, str], outputs: list[list[int]], n: int = 1):
        self.failed, self.outputs = failed, outputs
        first, why = next(iter(failed.items()))
        where = f"prompts[{first // n}]" + (f" (sample {first % n})" if n > 1 else "")
        more = f" and {len(failed) - 1} more" if len(failed) > 1 else ""
        super().__init__(f"{where}{more} failed: {why}")


_FROM_CONFIG = object()

_COUNTERS = (
    "requests",
    "prompt_tokens",
    "generated_tokens",
    "steps",
    "extend_calls",
    "decode_calls",
    "decode_steps",
    "prefix_hit_tokens",
    "prefill_tokens",
    "decode_tokens",
    "preemptions",
    "evicted_tokens",
    "cow_copies",
    "forks",
    "deduplicated_pages",
    "admissions",
    "syncs",
    "cascade_steps",
    "cascade_saved_kv_bytes",
)
_TIMERS = ("time_s", "compile_steps_time_s", "schedule_s", "launch_s", "commit_s", "wait_s")


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


class _InFlight(NamedTuple):
    plan: StepPlan
    work: StepWork
    handle: object


class Engine:
    """Serve a causal LM from a paged KV pool.

    Args:
      cfg: the model: anything with the engine's model protocol
        (:class:`~jaxattn.engine.model.CausalLM`), e.g. a
        :class:`~jaxattn.models.llama.LlamaConfig`.
      params: its parameters.
      cache: the pool and the prefix cache (:class:`~jaxattn.engine.CacheConfig`); it takes
        ``num_pages * page_size * cfg.kv_bytes_per_token(kv dtype)`` bytes (an FP8
        ``kv_dtype`` counts one byte per element: half the bytes of a 16-bit pool).
      scheduler: admission, chunking, multi-step decode and overlap
        (:class:`~jaxattn.engine.SchedulerConfig`).
      execution: attention backends, shape buckets, tensor parallelism
        (:class:`~jaxattn.engine.ExecutionConfig`).
      eos_token_id: stop token(s); default ``cfg.eos_token_id``; None or () for none.
      debug: check every page reference, that no shared page is written and that the
        device's decode rows hold the host's tables, each step.
      track_waste: measure, every step, the KV slots allocated but not holding a token,
        paged against a contiguous preallocation (``kv_waste_*`` in :attr:`stats`).
      runner: run the steps on this object instead of a new
        :class:`~jaxattn.engine.runner.ModelRunner` (anything with its ``launch``,
        ``collect``, ``trace_counts``, ``backends`` and ``kv_bytes``; e.g. a stand-in that
        checks the memory traffic in tests). ``params`` and ``execution.mesh`` are then
        unused.
      **kwargs: the fields of the three records as keywords (``num_pages=``,
        ``page_size=``, ``max_batch_tokens=``, ``mesh=`` ...), for a record not passed.
    """

    def __init__(
        self,
        cfg,
        params,
        *,
        cache: CacheConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        execution: ExecutionConfig | None = None,
        eos_token_id=_FROM_CONFIG,
        debug: bool = False,
        track_waste: bool = False,
        runner=None,
        **kwargs,
    ):
        model = check_model(cfg)
        cache, scheduler, execution = split_engine_kwargs(cache, scheduler, execution, kwargs)
        if eos_token_id is _FROM_CONFIG:
            stop = model.eos_token_id
        elif eos_token_id is None:
            stop = ()
        elif isinstance(eos_token_id, numbers.Integral):
            stop = (eos_token_id,)
        else:
            stop = tuple(eos_token_id)
        if not all(isinstance(t, numbers.Integral) and 0 <= t < model.vocab_size for t in stop):
            raise ValueError(f"eos_token_id must be token ids below vocab_size, got {stop!r}")
        self.stop_ids = frozenset(int(t) for t in stop)
        self.cfg = model
        self.cache_config, self.scheduler_config, self.execution_config = (
            cache,
            scheduler,
            execution,
        )
        self.debug = debug
        self.track_waste = track_waste
        self.num_pages, self.page_size = cache.num_pages, cache.page_size
        # The pool's element type: the bytes a token's KV takes and a decode step reads.
        self.kv_dtype = kv_cache_dtype(cache.kv_dtype, model.jnp_dtype)
        self.kv_bytes_per_token = model.kv_bytes_per_token(
            None if cache.kv_dtype is None else self.kv_dtype
        )
        self.collector = StatsCollector(_COUNTERS, _TIMERS)
        self.kv = KVCacheManager(
            cache.num_pages, cache.page_size, radix_cache=cache.radix_cache, stats=self.collector
        )
        self.scheduler = Scheduler(self.kv, scheduler, self.collector)
        rows = bucket(scheduler.max_running)
        self.runner = runner or ModelRunner(
            model,
            params,
            num_pages=cache.num_pages,
            page_size=cache.page_size,
            layout=cache.layout,
            extend_attention=execution.extend_attention,
            implementation=execution.implementation,
            partition_size=execution.partition_size,
            buckets=execution.buckets,
            mesh=execution.mesh,
            max_rows=rows,
            stop_width=len(self.stop_ids),
            decode_steps=scheduler.decode_steps,
            unroll_layers=execution.unroll_layers,
            decode_linear=execution.decode_linear,
            decode_graph=execution.decode_graph,
            kv_write=execution.kv_write,
            fused_rope=execution.fused_rope,
            fused_norm=execution.fused_norm,
            split_k=execution.split_k,
            pallas_decode_lowering=execution.pallas_decode_lowering,
            kv_dtype=cache.kv_dtype,
            kv_scales=cache.kv_scales,
        )
        max_pos = model.max_position_embeddings
        self.device_paging = execution.device_paging
        self.scheduler.defer_reservations = self.device_paging
        self.rows = DecodeRows(
            rows,
            min(cache.num_pages, -(-max_pos // cache.page_size)),
            max(1, len(self.stop_ids)),
            tables=not self.device_paging,
        )
        self._pages_synced = None
        self._buckets = execution.buckets
        self.cascade = execution.cascade
        if getattr(self.runner, "cascade_backend", "") is None:
            if self.cascade == "on":
                raise ValueError(
                    "ExecutionConfig.cascade='on', but no cascade decode backend serves "
                    f"implementation={execution.implementation!r} on this pool"
                )
            self.cascade = "off"
        self._cascade_min_pages = -(-execution.cascade_min_tokens // cache.page_size)
        self._cascade_model = execution.cascade_model
        self._inflight: _InFlight | None = None
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.collector.add_source(self._gauges)
        self.reset_stats()

    # -- requests ---------------------------------------------------------------------------

    def _check_prompt(self, i, prompt, max_new_tokens):
        prompt = token_ids(f"prompts[{i}]", prompt, self.cfg.vocab_size)
        # As vLLM's max_model_len: the prompt and every token drawn must fit the positions the
        # model was built for (RoPE beyond them is extrapolation nobody asked for).
        limit = self.cfg.max_position_embeddings
        if len(prompt) + max_new_tokens > limit:
            raise ValueError(
                f"prompts[{i}] ({len(prompt)} tokens) with max_new_tokens={max_new_tokens} "
                f"needs {len(prompt) + max_new_tokens} positions, more than the model's "
                f"max_position_embeddings={limit}"
            )
        need = self.kv.pages_for(len(prompt) + max_new_tokens - 1)
        if need > self.num_pages:
            raise ValueError(
                f"prompts[{i}] ({len(prompt)} tokens) with max_new_tokens={max_new_tokens} "
                f"needs {need} pages, more than the pool's num_pages={self.num_pages}"
            )
        return prompt

    def add_request(
        self,
        prompt,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        n: int = 1,
        seed: int = 0,
        ignore_eos: bool = False,
        tag=None,
    ) -> Sequence:
        """Queue one prompt; return its first sequence.

        The caller polls :meth:`step`, which returns finished sequences (``seq.output``,
        ``seq.finish_reason``, ``seq.tag``). With ``n > 1`` the other samples are forked
        from the first when its prompt has been prefilled and are returned by
        :meth:`step` like it, with the same ``tag`` and their own ``sample_id``. Sample
        ``j`` draws its tokens with the keys ``(seed, j, position)``.
        """
        max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 1)
        self._check_sampling(n, seed, temperature, top_p)
        prompt = self._check_prompt(0, prompt, max_new_tokens)
        return self._queue(prompt, max_new_tokens, temperature, top_p, n, seed, ignore_eos, tag, 0)

    def _check_sampling(self, n, seed, temperature, top_p) -> None:
        _check_int("n", n, 1)
        if n > self.scheduler_config.max_running:
            raise ValueError(
                f"n={n} parallel samples exceed max_running="
                f"{self.scheduler_config.max_running}: they decode at once"
            )
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise ValueError(f"seed must be an int in [0, 2**31), got {seed!r}")
        if not 0 <= seed < 2**31:
            raise ValueError(f"seed must be an int in [0, 2**31), got {seed!r}")
        if not isinstance(temperature, numbers.Real) or not 0 <= temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")

    def _queue(
        self, prompt, max_new_tokens, temperature, top_p, n, seed, ignore_eos, tag, first_sample
    ) -> Sequence:
        ids = [next(self._seq_ids) for _ in range(n)]
        seq = Sequence(
            seq_id=ids[0],
            tokens=prompt,
            prompt_len=len(prompt),
            max_new_tokens=max_new_tokens,
            temperature=float(temperature),
            top_p=float(top_p),
            seed=int(seed),
            sample_id=first_sample,
            stop_ids=frozenset() if ignore_eos else self.stop_ids,
            arrival=next(self._arrivals),
            fork_ids=[(sid, first_sample + j) for j, sid in enumerate(ids[1:], 1)],
            tag=tag,
        )
        self.scheduler.add(seq)
        self.collector.count("requests")
        self.collector.count("prompt_tokens", len(prompt))
        return seq

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    # -- stepping ---------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Run one scheduler step; return the sequences whose results were read in it and
        that finished (with ``overlap``, those of the previous step's dispatch)."""
        t0 = time.perf_counter()
        trace_counts = getattr(self.runner, "trace_counts", {})
        compiled_before = sum(trace_counts.values())
        sched, stats = self.scheduler, self.collector
        done: list[Sequence] = []
        with stats.timer("schedule_s"):
            plan = sched.schedule(in_flight=self._inflight is not None)
        if plan is None:
            # Only a preemption makes room, and that needs the exact state: read the
            # dispatch in flight first.
            stats.count("syncs")
            done += self._commit(self._inflight)
            self._inflight = None
            with stats.timer("schedule_s"):
                plan = sched.schedule(in_flight=False)
        launched = None
        if plan:
            with stats.timer("launch_s"):
                work = self._work(plan)
                if self.debug:
                    self._check_writes(plan)
                launched = _InFlight(plan, work, self.runner.launch(work))
            if self.debug:
                self._check_rows()
            stats.count("steps")
            stats.count("extend_calls", bool(work.extend))
            stats.count("decode_calls", work.decode is not None)
            stats.count("decode_steps", plan.decode_steps if work.decode is not None else 0)
            levels = work.decode.levels if work.decode is not None else None
            if levels is not None:
                stats.count("cascade_steps", plan.decode_steps)
                saved = levels.saved_tokens * self.kv_bytes_per_token * plan.decode_steps
                stats.count("cascade_saved_kv_bytes", saved)
            self._track_memory()
        else:
            for seq in plan.preempted:
                self.rows.release(seq)
        if self._inflight is not None:
            done += self._commit(self._inflight)
        self._inflight = launched
        if self._inflight is not None and (
            not self.scheduler_config.overlap or not sched.has_work()
        ):
            # Without overlap every step is read at once; with it, a dispatch whose
            # sequences all finished meanwhile holds only void work: read it, so that an
            # engine with nothing to do is idle.
            done += self._commit(self._inflight)
            self._inflight = None
        if launched is None and not done:
            self._idle_steps += 1
            if self._idle_steps > 2 and self.has_work():
                raise RuntimeError(
                    f"no progress: {len(sched.waiting)} waiting and {len(sched.running)} "
                    "running sequences, none schedulable"
                )
        else:
            self._idle_steps = 0
        spent = time.perf_counter() - t0
        stats.add_time("time_s", spent)
        if sum(trace_counts.values()) != compiled_before:
            stats.add_time("compile_steps_time_s", spent)
        if self.debug:
            sched.check_invariants()
        return done

    def _work(self, plan: StepPlan) -> StepWork:
        """The device work of a plan: decode rows to start, table entries that changed,
        extend chunks, the decode dispatch."""
        kv, rows = self.kv, self.rows
        for seq in plan.preempted:
            rows.release(seq)
        extend = []
        for seq, start, end, draws in plan.extend:
            samples, targets = (), ()
            if draws:
                samples = tuple(self.scheduler.draws(seq))
                # A prompt that ends here and decodes on (no forks to make first) starts
                # from its row, where the extend writes the drawn token.
                if not seq.fork_ids and seq.budget > 0:
                    rows.assign(
                        seq, token=0, position=end, remaining=seq.budget, table=kv.table(seq.seq_id)
                    )
                    targets = (seq.row,)
            extend.append(
                ExtendItem(
                    np.asarray(seq.tokens[start:end], np.int32),
                    start,
                    end,
                    np.asarray(kv.table(seq.seq_id), np.int32),
                    samples,
                    targets,
                )
            )
        steps = plan.decode_steps
        for seq, position in plan.decode:
            if seq.row is None:
                # Its last token is known here (a fork, or a sequence that decoded before
                # its row was needed): the row starts from the host.
                assert seq.pending == steps, f"seq {seq.seq_id} has tokens in flight"
                rows.assign(
                    seq,
                    token=seq.tokens[-1],
                    position=position,
                    remaining=seq.budget + steps,
                    table=kv.table(seq.seq_id),
                )
        copies, pages, counts = plan.copies, None, None
        if self.device_paging and plan.decode:
            pages, counts = self._page_work(plan)
        elif plan.deferred:
            for seq, position in plan.decode:
                copies = copies + kv.reserve(seq.seq_id, position + steps)
            kv.promised = 0
        changed = kv.take_changed()
        if changed:
            for row in range(rows.capacity):
                seq = rows.seq(row)
                if seq is not None and seq.seq_id in changed:
                    rows.sync_table(seq, kv.table(seq.seq_id), changed[seq.seq_id])
        decode = None
        if plan.decode:
            row_ids = np.asarray([d.seq.row for d in plan.decode], np.int32)
            bk = self._buckets
            last = max(d.position + steps for d in plan.decode)
            width = min(bucket(kv.pages_for(last), bk.pages), rows.width)
            num_rows = min(bucket(int(row_ids.max()) + 1, bk.decode_batch), rows.capacity)
            greedy = all(d.seq.temperature == 0 for d in plan.decode)
            levels = self._cascade_levels(plan, row_ids, num_rows, width)
            decode = DecodeWork(row_ids, num_rows, width, steps, greedy, counts, levels)
        return StepWork(copies, rows.take_updates(), extend, decode, pages)

    def _cascade_levels(
        self, plan: StepPlan, row_ids: np.ndarray, num_rows: int, width: int
    ) -> CascadeLevels | None:
        """The cascade levels of a decode dispatch, or None for paged decode: rows whose
        tables start with the same full pages (none of which the dispatch writes) share
        them as a prefix, when ``cascade`` is on, or "auto" and the cost model predicts a
        gain."""
        if self.cascade == "off" or len(plan.decode) < 2:
            return None
        positions = [d.position for d in plan.decode]
        cfg, tp = self.cfg, getattr(self.runner, "tp_size", 1)
        heads = dict(
            num_q_heads=cfg.num_attention_heads // tp,
            num_kv_heads=cfg.num_key_value_heads // tp,
            head_dim=cfg.head_dim,
            itemsize=self.kv_dtype.itemsize,
            model=self._cascade_model,
        )
        if self.cascade == "auto" and not cascade_may_pay_off(np.asarray(positions) + 1, **heads):
            # No grouping could pay off for these lengths: skip looking for one (a few
            # hundred microseconds of host time a dispatch for a batch of tens of rows).
            return None
        levels = cascade_levels(
            [self.kv.table(d.seq.seq_id) for d in plan.decode],
            positions,
            row_ids.tolist(),
            page_size=self.page_size,
            min_pages=self._cascade_min_pages,
            num_rows=num_rows,
            width=width,
        )
        if levels is None or self.cascade == "on":
            return levels
        prefix_of = levels.prefix_of[row_ids]
        prefix = np.where(prefix_of >= 0, levels.prefix_lens[np.maximum(prefix_of, 0)], 0)
        pays = cascade_pays_off(
            levels.prefix_lens, prefix_of, np.asarray(positions) + 1 - prefix, **heads
        )
        return levels if pays else None

    def _page_work(self, plan: StepPlan):
        """Device paging: the host's pages to send (None when the device's page table is
        current) and the slots each decode row grows by. The host makes the same
        reservations on its block tables, in the same order, after the snapshot: the
        device's ``append_slots_batch`` then reproduces them op for op."""
        kv, rows = self.kv, self.rows
        current = (kv.allocator.version, rows.version) == self._pages_synced
        upload = None
        if not plan.deferred:
            # The scheduler reserved already (one sequence at a time, to preempt between
            # them): the snapshot includes the reservations, the device grows nothing.
            counts = np.zeros(len(plan.decode), np.int32)
            if not current:
                upload = self._page_snapshot()
        else:
            upload = None if current else self._page_snapshot()
            counts = np.zeros(len(plan.decode), np.int32)
            for i, (seq, position) in enumerate(plan.decode):
                have = kv.reserved(seq.seq_id)
                kv.reserve(seq.seq_id, position + plan.decode_steps)  # copies: the device's
                counts[i] = kv.reserved(seq.seq_id) - have
            kv.promised = 0
        self._pages_synced = (kv.allocator.version, rows.version)
        return upload, counts

    def _page_snapshot(self) -> PageUpload:
        kv, rows = self.kv, self.rows
        a = kv.allocator
        free = a.free_stack()
        stack = np.full(a.num_blocks, -1, np.int32)
        stack[: len(free)] = free
        tables = np.full((rows.capacity, rows.width), -1, np.int32)
        lens = np.zeros(rows.capacity, np.int32)
        active = np.zeros(rows.capacity, bool)
        for row in range(rows.capacity):
            seq = rows.seq(row)
            if seq is not None:
                table = kv.table(seq.seq_id)
                tables[row, : len(table)] = table
                lens[row] = kv.reserved(seq.seq_id)
                active[row] = True
        return PageUpload(a.ref_counts.copy(), stack, a.num_free, tables, lens, active)

    def _commit(self, inflight: _InFlight) -> list[Sequence]:
        stats = self.collector
        t0 = time.perf_counter()
        out = self.runner.collect(inflight.handle)
        stats.add_time("wait_s", time.perf_counter() - t0)
        with stats.timer("commit_s"):
            plan, work = inflight.plan, inflight.work
            decode_tokens = []
            if work.decode is not None:
                decode_tokens = out.decode_tokens[:, work.decode.rows].T
            done = self.scheduler.commit(plan, out.extend_tokens, decode_tokens)
            for seq in done:
                self.rows.release(seq)
        return done

    # -- statistics and checks --------------------------------------------------------------

    def reset_stats(self) -> None:
        """Zero the counters (the pool, the cache and compiled programs stay)."""
        self.collector.reset()
        timing = getattr(self.runner, "timing", None)
        if timing is not None:
            for key in timing:
                timing[key] = 0
        self._idle_steps = 0
        self._waste = np.zeros(4)  # paged waste, paged slots, contiguous waste, contiguous

    def _track_memory(self) -> None:
        stats, sched = self.collector, self.scheduler
        stats.peak("peak_pages_in_use", self.kv.allocator.num_used)
        running = sched.running
        contiguous = sum(q.prompt_len + q.max_new_tokens for q in running)
        stats.peak("peak_kv_slots_contiguous", contiguous)
        stats.peak("peak_live_tokens", sum(q.length for q in running))
        if not self.track_waste:
            return
        p = self.page_size
        fill: dict[int, int] = {}
        for q in running:
            n = q.length
            for i, page in enumerate(self.kv.table(q.seq_id)):
                fill[page] = max(fill.get(page, 0), min(p, max(n - i * p, 0)))
        # Distinct live tokens: a page shared by several sequences (a cached prefix, a
        # forked prompt) counts once; a contiguous layout would hold a copy per sequence.
        distinct = sum(fill.values())
        paged = len(fill) * p
        self._waste += (paged - distinct, paged, contiguous - distinct, contiguous)

    def _gauges(self) -> dict:
        runner, sched = self.runner, self.scheduler
        out = dict(
            peak_pages_in_use=0,
            peak_kv_slots_contiguous=0,
            peak_live_tokens=0,
        )
        out.update(self.collector.peaks)
        out.update(self.kv.usage())
        out.update(running=len(sched.running), waiting=len(sched.waiting))
        if self.track_waste:
            w = self._waste
            out["kv_waste_paged"] = float(w[0] / w[1]) if w[1] else 0.0
            out["kv_waste_contiguous"] = float(w[2] / w[3]) if w[3] else 0.0
        out.update(
            compiles=dict(getattr(runner, "trace_counts", {})),
            attention_backend=dict(getattr(runner, "backends", {})),
            attention_lowering=dict(getattr(runner, "lowerings", {})),
            decode_linear=getattr(runner, "decode_linear", None),
            kv_write=getattr(runner, "kv_write", None),
            fused_rope=bool(getattr(runner, "fused_rope", False)),
            fused_norm=bool(getattr(runner, "fused_norm", False)),
            split_k=getattr(runner, "split_k", False),
            kv_pool_bytes=getattr(runner, "kv_bytes", 0),
            kv_pool_bytes_per_device=getattr(
                runner, "kv_bytes_per_device", getattr(runner, "kv_bytes", 0)
            ),
            tp=getattr(runner, "tp_size", 1),
            kv_dtype=self.kv_dtype.name,
        )
        timing = getattr(runner, "timing", None)
        if timing is not None:
            out.update(h2d_bytes=int(timing["h2d_bytes"]), h2d_s=timing["h2d_s"])
            out.update(dispatch_s=timing["dispatch_s"])
        return out

    @property
    def stats(self) -> dict:
        """Counters since construction or :meth:`reset_stats`.

        prefix_hit_tokens: prompt tokens served from the radix cache at admission;
        prefill_tokens: tokens computed by extend steps; decode_tokens: by decode steps;
        generated_tokens: tokens drawn (read); steps: dispatches, decode_steps: decode steps
        they ran (several per dispatch with multi-step decode), syncs: steps that read a
        dispatch early to preempt; pages_in_use / peak_pages_in_use: pool pages referenced
        (cache included); cached_pages: pages the radix cache holds;
        peak_kv_slots_contiguous: the most KV slots a contiguous preallocation (prompt +
        max_new_tokens per running sequence) would have held at once; peak_live_tokens: the
        most tokens running sequences needed KV for at once (shared prefixes counted per
        sequence); compiles: programs traced per step kind; attention_backend: what the extend and
        decode steps run; attention_lowering: the Pallas lowering of each (``"triton"``,
        ``"mosaic_gpu"``; None for other backends); decode_linear: who runs the decode step's
        projections (``"xla"``, ``"pad"``: XLA with one row padded to two, ``"native"``; see
        ``ExecutionConfig.decode_linear``); kv_write: the backend that stores the new K/V
        (``ExecutionConfig.kv_write``); fused_rope: whether each layer rotates and stores its new
        K/V in one pass (``ExecutionConfig.fused_rope``); fused_norm: whether each residual add and
        its norm ran as one kernel (``ExecutionConfig.fused_norm``); split_k: the decode steps'
        ``ExecutionConfig.split_k`` (False: off); cascade_steps: decode steps
        that ran cascade decode (``ExecutionConfig.cascade``), cascade_saved_kv_bytes: the KV bytes
        they did not read thanks to it, ``(members - 1) * prefix tokens * kv_bytes_per_token`` per
        shared prefix and step (all layers, K and V, over all devices, in the pool's dtype); tp:
        devices the model is split over (1 without a mesh); kv_dtype: the pool's dtype (e.g.
        ``float8_e4m3fn``); kv_pool_bytes: the pool over all devices, kv_pool_bytes_per_device: what
        one device holds of it; time_s: wall time in :meth:`step`, compile_steps_time_s: the part
        spent in steps that compiled a program; schedule_s, launch_s (building and enqueueing device
        work), wait_s (blocked on results), commit_s: where that time went on the host; h2d_bytes /
        h2d_s: metadata sent to the device and the time spent sending it; dispatch_s: time in the
        jitted calls; kv_waste_paged / kv_waste_contiguous (with ``track_waste``): summed over
        steps, the fraction of the KV slots reserved for running sequences that hold no distinct
        live token - for pages, the empty tail of each sequence's last page; for a contiguous
        preallocation of prompt + max_new_tokens per sequence, the unused reservation plus every
        duplicate copy of a shared prefix.
        """
        return self.collector.snapshot()

    def _check_writes(self, plan: StepPlan) -> None:
        """Every slot this step writes lies on a page with a single reference, or on a page
        this step's prefill published to the cache (written by this step only)."""
        kv = self.kv
        cached = kv.cached_pages()
        published = set(plan.published)
        writes = [(c.seq, c.start, c.end) for c in plan.extend]
        writes += [(d.seq, d.position, d.position + plan.decode_steps) for d in plan.decode]
        refs = kv.allocator.ref_counts
        written: dict[int, int] = {}
        for seq, start, end in writes:
            slots = kv.slots(seq.seq_id, start, end)
            for page in set((slots // self.page_size).tolist()):
                assert written.setdefault(page, seq.seq_id) == seq.seq_id, (
                    f"seqs {written[page]} and {seq.seq_id} both write page {page}"
                )
                if page in published:
                    continue
                assert refs[page] == 1, f"seq {seq.seq_id} writes page {page} held {refs[page]}x"
                assert page not in cached, f"seq {seq.seq_id} writes page {page} of the cache"

    def _check_rows(self) -> None:
        """The decode rows just launched hold the host's block tables (reads the device).
        A table that changes when a step's results are committed (the cache's copy of a
        page adopted) is sent with the next launch. With device paging, the device's page
        table equals the host's pages op for op."""
        if self.device_paging:
            self._check_pages()
            return
        state = getattr(self.runner, "state", None)
        if state is None:
            return
        tables = np.asarray(state.tables)
        for seq in self.scheduler.running:
            if seq.row is None:
                continue
            table = self.kv.table(seq.seq_id)
            assert self.rows.table(seq.row) == table, f"seq {seq.seq_id}: stale row record"
            assert tables[seq.row, : len(table)].tolist() == table, (
                f"seq {seq.seq_id}: the device row holds another table"
            )

    def _check_pages(self) -> None:
        pages = getattr(self.runner, "pages", None)
        if pages is None or (self.kv.allocator.version, self.rows.version) != self._pages_synced:
            return  # not sent yet, or the host changed its pages since the last decode step
        want = self._page_snapshot()
        for name in ("ref_counts", "free_stack", "num_free", "lens", "active"):
            got = np.asarray(getattr(pages, name))
            assert np.array_equal(got, getattr(want, name)), f"device page table: {name}"
        tables = np.asarray(pages.tables)
        for row in np.flatnonzero(want.active):
            n = -(-int(want.lens[row]) // self.page_size)
            assert tables[row, :n].tolist() == want.tables[row, :n].tolist(), f"row {row}"

    def check_idle(self) -> None:
        """Raise AssertionError unless nothing runs and every page not held by the radix
        cache is free (the pool is whole)."""
        sched = self.scheduler
        assert not sched.running and not sched.waiting, "requests are still queued"
        assert self._inflight is None, "a dispatch is still in flight"
        assert len(self.rows) == 0, "decode rows are still assigned"
        sched.check_invariants()
        cached = self.kv.cached_pages()
        refs = self.kv.allocator.ref_counts
        for page in range(self.num_pages):
            want = 1 if page in cached else 0
            assert refs[page] == want, f"page {page} has {refs[page]} references, want {want}"

    # -- generate ---------------------------------------------------------------------------

    def generate(
        self,
        prompts,
        max_new_tokens,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        n: int = 1,
        seed: int = 0,
        ignore_eos: bool = False,
        progress: bool = False,
    ) -> list[list[int]]:
        """Generate for every prompt; return ``len(prompts) * n`` token lists.

        The outputs come prompt by prompt, the ``n`` samples of a prompt next to each other
        (output ``i * n + j`` is sample ``j`` of prompt ``i``), without the prompt, ending
        with the stop token when one was drawn. ``max_new_tokens`` is an int or one int per
        prompt. ``temperature=0`` is greedy; output ``k`` draws with keys ``(seed, k,
        position)``, so it does not depend on batching, chunking or preemption.

        A request whose logits are not finite ends without a token from them; once every
        request is done, :class:`RequestError` names the failed ones (its ``outputs`` hold
        every output, the failed ones cut where they failed).
        """
        if isinstance(prompts, np.ndarray):
            prompts = prompts.tolist()
        if not isinstance(prompts, SequenceABC) or isinstance(prompts, str):
            raise TypeError(
                f"prompts must be a list of token-id lists, got {type(prompts).__name__}"
            )
        if isinstance(max_new_tokens, numbers.Integral):
            max_new = [max_new_tokens] * len(prompts)
        else:
            max_new = list(max_new_tokens)
            if len(max_new) != len(prompts):
                raise ValueError(
                    f"max_new_tokens must be an int or one int per prompt, got {len(max_new)} "
                    f"values for {len(prompts)} prompts"
                )
        self._check_sampling(n, seed, temperature, top_p)
        checked = [
            self._check_prompt(i, p, _check_int("max_new_tokens", m, 1))
            for i, (p, m) in enumerate(zip(prompts, max_new, strict=True))
        ]
        heads = [
            self._queue(p, m, temperature, top_p, n, seed, ignore_eos, None, i * n)
            for i, (p, m) in enumerate(zip(checked, max_new, strict=True))
        ]
        order = [sid for h in heads for sid in [h.seq_id] + [f for f, _ in h.fork_ids]]
        wanted = set(order)
        finished: dict[int, Sequence] = {}
        bar = ProgressBar(len(order), label="generate", enabled=progress)
        while len(finished) < len(order):
            for seq in self.step():
                if seq.seq_id in wanted:
                    finished[seq.seq_id] = seq
            bar.update(len(finished), tokens=self.collector.counters["generated_tokens"])
        bar.close(len(finished), tokens=self.collector.counters["generated_tokens"])
        outputs = [finished[sid].output for sid in order]
        failed = {
            k: finished[sid].error
            for k, sid in enumerate(order)
            if finished[sid].finish_reason == "error"
        }
        if failed:
            raise RequestError(failed, outputs, n)
        return outputs
