"""The serving engine: continuous batching over a paged KV pool with a radix prefix cache.

Each :meth:`Engine.step`:

1. the :class:`~jaxattn.engine.scheduler.Scheduler` plans the step on the host: decode
   slots for every running sequence (evicting cache leaves or preempting the newest
   sequence when the pool runs dry), the next chunk of every prompt being prefilled, and
   new requests admitted longest-cached-prefix first while memory and the token budget
   allow;
2. the :class:`~jaxattn.engine.runner.ModelRunner` applies copy-on-write page copies,
   runs the extend chunks (``extend_attention`` / ``prefix_prefill`` over the pool) and
   the decode batch (``paged_attention``), each drawing its tokens on the device;
3. the scheduler commits the tokens: prompts that ended fork into their ``n`` samples,
   finished sequences go into the cache and release their pages.

See :mod:`jaxattn.engine.scheduler` for the memory model.
"""

from __future__ import annotations

import itertools
import numbers
import time
from collections.abc import Sequence as SequenceABC

import numpy as np

from jaxattn.models.llama import LlamaConfig

from .progress import ProgressBar
from .runner import Buckets, DecodeItem, ExtendItem, ModelRunner
from .scheduler import Scheduler, Sequence

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


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


class Engine:
    """Serve a Llama model from a paged KV pool of ``num_pages`` pages of ``page_size``
    tokens (per layer).

    Args:
      cfg, params: the model (:mod:`jaxattn.models.llama`).
      num_pages, page_size: the KV pool; it takes ``num_pages * page_size *
        cfg.kv_bytes_per_token()`` bytes.
      max_batch_tokens: tokens computed per step, decode tokens included; longer prompts
        are prefilled in chunks over several steps.
      max_running: sequences decoding at once.
      radix_cache: reuse KV across requests through the radix prefix cache.
      policy: admission order, ``"lpm"`` (longest cached prefix first) or ``"fcfs"``.
      new_token_ratio, dedup_tokens: admission tuning (see
        :class:`~jaxattn.engine.scheduler.Scheduler`).
      layout: KV pool layout (``"bshd"``, ``"bhsd"``, ``"vllm"``).
      extend_attention: ``"extend"`` or ``"prefix_prefill"`` (None: ``"extend"`` for bshd).
      implementation: attention backend (None: the fastest that serves the platform).
      partition_size: split-KV partition size for decode.
      buckets: shape bucket floors (:class:`~jaxattn.engine.runner.Buckets`).
      mesh: serve tensor-parallel over this 1-D mesh (:func:`jaxattn.sharding.make_mesh`):
        heads, MLP and the pool's KV heads split over its devices, while pages, block
        tables and the radix cache stay global, so scheduling and outputs are those of one
        device. None: one device.
      eos_token_id: stop token(s); default ``cfg.eos_token_id``; None or () for none.
      debug: check every page reference and that no shared page is written, each step.
      track_waste: measure, every step, the KV slots allocated but not holding a token,
        paged against a contiguous preallocation (``kv_waste_*`` in :attr:`stats`).
      runner: run the steps on this object instead of a new
        :class:`~jaxattn.engine.runner.ModelRunner` (anything with its ``extend``,
        ``decode``, ``copy_pages``, ``trace_counts``, ``backends`` and ``kv_bytes``; e.g. a
        stand-in that checks the memory traffic in tests). ``params`` and ``mesh`` are
        then unused.
    """

    def __init__(
        self,
        cfg: LlamaConfig,
        params: dict,
        *,
        num_pages: int,
        page_size: int = 16,
        max_batch_tokens: int = 512,
        max_running: int = 64,
        radix_cache: bool = True,
        policy: str = "lpm",
        new_token_ratio: float = 0.3,
        dedup_tokens: int | None = None,
        layout: str = "bshd",
        extend_attention: str | None = None,
        implementation: str | None = None,
        partition_size: int | None = None,
        buckets: Buckets | None = None,
        mesh=None,
        eos_token_id=_FROM_CONFIG,
        debug: bool = False,
        track_waste: bool = False,
        runner=None,
    ):
        if not isinstance(cfg, LlamaConfig):
            raise TypeError(f"cfg must be a LlamaConfig, got {type(cfg).__name__}")
        num_pages = _check_int("num_pages", num_pages, 1)
        page_size = _check_int("page_size", page_size, 1)
        max_batch_tokens = _check_int("max_batch_tokens", max_batch_tokens, 1)
        max_running = _check_int("max_running", max_running, 1)
        if eos_token_id is _FROM_CONFIG:
            stop = cfg.eos_token_id
        elif eos_token_id is None:
            stop = ()
        elif isinstance(eos_token_id, numbers.Integral):
            stop = (eos_token_id,)
        else:
            stop = tuple(eos_token_id)
        if not all(isinstance(t, numbers.Integral) and 0 <= t < cfg.vocab_size for t in stop):
            raise ValueError(f"eos_token_id must be token ids below vocab_size, got {stop!r}")
        self.stop_ids = frozenset(int(t) for t in stop)
        self.cfg = cfg
        self.debug = debug
        self.track_waste = track_waste
        self.runner = runner or ModelRunner(
            cfg,
            params,
            num_pages=num_pages,
            page_size=page_size,
            layout=layout,
            extend_attention=extend_attention,
            implementation=implementation,
            partition_size=partition_size,
            buckets=buckets,
            mesh=mesh,
        )
        self.scheduler = Scheduler(
            num_pages,
            page_size,
            max_batch_tokens=max_batch_tokens,
            max_running=max_running,
            radix_cache=radix_cache,
            policy=policy,
            new_token_ratio=new_token_ratio,
            dedup_tokens=dedup_tokens,
        )
        self.num_pages, self.page_size = num_pages, page_size
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.reset_stats()

    # -- requests ---------------------------------------------------------------------------

    def _check_prompt(self, i, prompt, max_new_tokens):
        if isinstance(prompt, np.ndarray):
            prompt = prompt.tolist()
        if not isinstance(prompt, SequenceABC) or isinstance(prompt, str) or not prompt:
            raise ValueError(f"prompts[{i}] must be a non-empty list of token ids")
        ok = all(
            isinstance(t, numbers.Integral)
            and not isinstance(t, bool)
            and 0 <= t < self.cfg.vocab_size
            for t in prompt
        )
        if not ok:
            raise ValueError(
                f"prompts[{i}] must hold token ids in [0, {self.cfg.vocab_size}), got "
                f"{list(prompt)[:16]}"
            )
        # As vLLM's max_model_len: the prompt and every token drawn must fit the positions the
        # model was built for (RoPE beyond them is extrapolation nobody asked for).
        limit = self.cfg.max_position_embeddings
        if len(prompt) + max_new_tokens > limit:
            raise ValueError(
                f"prompts[{i}] ({len(prompt)} tokens) with max_new_tokens={max_new_tokens} "
                f"needs {len(prompt) + max_new_tokens} positions, more than the model's "
                f"max_position_embeddings={limit}"
            )
        need = self.scheduler.pages_for(len(prompt) + max_new_tokens - 1)
        if need > self.num_pages:
            raise ValueError(
                f"prompts[{i}] ({len(prompt)} tokens) with max_new_tokens={max_new_tokens} "
                f"needs {need} pages, more than the pool's num_pages={self.num_pages}"
            )
        return [int(t) for t in prompt]

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

    @staticmethod
    def _check_sampling(n, seed, temperature, top_p) -> None:
        _check_int("n", n, 1)
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
        self._stats["requests"] += 1
        self._stats["prompt_tokens"] += len(prompt)
        return seq

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- stepping ---------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Run one scheduler step; return the sequences that finished in it."""
        t0 = time.perf_counter()
        compiled_before = sum(self.runner.trace_counts.values())
        sched = self.scheduler
        plan = sched.schedule()
        if not plan:
            self._idle_steps += 1
            if self._idle_steps > 2 and sched.has_work():
                raise RuntimeError(
                    f"no progress: {len(sched.waiting)} waiting and {len(sched.running)} "
                    "running sequences, none schedulable"
                )
            return []
        self._idle_steps = 0
        if self.debug:
            self._check_writes(plan)
        if plan.copies:
            self.runner.copy_pages(plan.copies)
        extend_tokens = decode_tokens = ()
        if plan.extend:
            items = [
                ExtendItem(
                    np.asarray(seq.tokens[start:end], np.int32),
                    start,
                    end,
                    np.asarray(seq.table, np.int32),
                    tuple(sched.draws(seq)) if draws else (),
                )
                for seq, start, end, draws in plan.extend
            ]
            extend_tokens = self.runner.extend(items)
            self._stats["extend_calls"] += 1
        if plan.decode:
            items = [
                DecodeItem(
                    seq.tokens[-1],
                    seq.num_computed,
                    np.asarray(seq.table, np.int32),
                    seq.seed,
                    seq.sample_id,
                    seq.temperature,
                    seq.top_p,
                )
                for seq in plan.decode
            ]
            decode_tokens = self.runner.decode(items)
            self._stats["decode_calls"] += 1
        self._track_memory()
        drawn = len(plan.decode) + sum(1 + len(q.fork_ids) for q, _, _, d in plan.extend if d)
        done = sched.commit(plan, extend_tokens, decode_tokens)
        self._stats["steps"] += 1
        self._stats["generated_tokens"] += drawn
        spent = time.perf_counter() - t0
        self._stats["time_s"] += spent
        if sum(self.runner.trace_counts.values()) != compiled_before:
            self._stats["compile_steps_time_s"] += spent
        if self.debug:
            sched.check_invariants()
        return done

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
            bar.update(len(finished), tokens=self._stats["generated_tokens"])
        bar.close(len(finished), tokens=self._stats["generated_tokens"])
        outputs = [finished[sid].output for sid in order]
        failed = {
            k: finished[sid].error
            for k, sid in enumerate(order)
            if finished[sid].finish_reason == "error"
        }
        if failed:
            raise RequestError(failed, outputs, n)
        return outputs

    # -- statistics and checks --------------------------------------------------------------

    def reset_stats(self) -> None:
        """Zero the counters (the pool, the cache and compiled programs stay)."""
        self._stats = {
            "requests": 0,
            "prompt_tokens": 0,
            "generated_tokens": 0,
            "steps": 0,
            "extend_calls": 0,
            "decode_calls": 0,
            "time_s": 0.0,
            "compile_steps_time_s": 0.0,
            "peak_pages_in_use": 0,
            "peak_kv_slots_contiguous": 0,
            "peak_live_tokens": 0,
        }
        self.scheduler.stats.clear()
        self._idle_steps = 0
        self._waste = np.zeros(4)  # paged waste, paged slots, contiguous waste, contiguous

    def _track_memory(self) -> None:
        s, sched = self._stats, self.scheduler
        s["peak_pages_in_use"] = max(s["peak_pages_in_use"], sched.pool.num_used_pages)
        running = sched.running
        contiguous = sum(q.prompt_len + q.max_new_tokens for q in running)
        s["peak_kv_slots_contiguous"] = max(s["peak_kv_slots_contiguous"], contiguous)
        s["peak_live_tokens"] = max(s["peak_live_tokens"], sum(len(q.tokens) for q in running))
        if not self.track_waste:
            return
        p = self.page_size
        fill: dict[int, int] = {}
        for q in running:
            n = len(q.tokens)
            for i, page in enumerate(q.table):
                fill[page] = max(fill.get(page, 0), min(p, max(n - i * p, 0)))
        # Distinct live tokens: a page shared by several sequences (a cached prefix, a
        # forked prompt) counts once; a contiguous layout would hold a copy per sequence.
        distinct = sum(fill.values())
        paged = len(fill) * p
        self._waste += (paged - distinct, paged, contiguous - distinct, contiguous)

    @property
    def stats(self) -> dict:
        """Counters since construction or :meth:`reset_stats`.

        prefix_hit_tokens: prompt tokens served from the radix cache at admission;
        prefill_tokens: tokens computed by extend steps; decode_tokens: by decode steps;
        pages_in_use / peak_pages_in_use: pool pages referenced (cache included);
        cached_pages: pages the radix cache holds; peak_kv_slots_contiguous: the most KV
        slots a contiguous preallocation (prompt + max_new_tokens per running sequence)
        would have held at once; peak_live_tokens: the most tokens running sequences
        needed KV for at once (shared prefixes counted per sequence); compiles: programs
        traced per step kind; attention_backend: what the extend and decode steps run;
        tp: devices the model is split over (1 without a mesh); kv_pool_bytes: the pool
        over all devices, kv_pool_bytes_per_device: what one device holds of it;
        time_s: wall time in :meth:`step`, compile_steps_time_s: the part spent in steps
        that compiled a program; kv_waste_paged / kv_waste_contiguous (with
        ``track_waste``): summed over steps, the fraction of the KV slots reserved for
        running sequences that hold no distinct live token - for pages, the empty tail of
        each sequence's last page; for a contiguous preallocation of prompt +
        max_new_tokens per sequence, the unused reservation plus every duplicate copy of
        a shared prefix.
        """
        sched = self.scheduler
        out = dict(self._stats)
        for key in (
            "prefix_hit_tokens",
            "prefill_tokens",
            "decode_tokens",
            "preemptions",
            "evicted_tokens",
            "cow_copies",
            "forks",
            "deduplicated_pages",
            "admissions",
        ):
            out[key] = int(sched.stats.get(key, 0))
        if self.track_waste:
            w = self._waste
            out["kv_waste_paged"] = float(w[0] / w[1]) if w[1] else 0.0
            out["kv_waste_contiguous"] = float(w[2] / w[3]) if w[3] else 0.0
        out.update(
            num_pages=self.num_pages,
            page_size=self.page_size,
            pages_in_use=sched.pool.num_used_pages,
            cached_pages=(sched.cache.total_size // self.page_size) if sched.cache else 0,
            running=len(sched.running),
            waiting=len(sched.waiting),
            compiles=dict(self.runner.trace_counts),
            attention_backend=dict(self.runner.backends),
            kv_pool_bytes=self.runner.kv_bytes,
            kv_pool_bytes_per_device=getattr(
                self.runner, "kv_bytes_per_device", self.runner.kv_bytes
            ),
            tp=getattr(self.runner, "tp_size", 1),
        )
        return out

    def _check_writes(self, plan) -> None:
        """Every slot written this step lies on a page with a single reference."""
        sched = self.scheduler
        cached = sched.cached_pages()
        writes = [(seq, start, end) for seq, start, end, _ in plan.extend]
        writes += [(seq, seq.num_computed, seq.num_computed + 1) for seq in plan.decode]
        for seq, start, end in writes:
            for page in set((sched.slots(seq, start, end) // self.page_size).tolist()):
                refs = sched.pool.ref_count(page)
                assert refs == 1, f"seq {seq.seq_id} writes page {page} held {refs} times"
                assert page not in cached, f"seq {seq.seq_id} writes page {page} of the cache"

    def check_idle(self) -> None:
        """Raise AssertionError unless nothing runs and every page not held by the radix
        cache is free (the pool is whole)."""
        sched = self.scheduler
        assert not sched.running and not sched.waiting, "requests are still queued"
        sched.check_invariants()
        cached = sched.cached_pages()
        refs = sched.pool.ref_counts()
        for page in range(self.num_pages):
            want = 1 if page in cached else 0
            assert refs[page] == want, f"page {page} has {refs[page]} references, want {want}"
