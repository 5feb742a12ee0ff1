"""One engine decode step, taken apart: where the time goes, against the hardware floor.

For each batch size, ``B`` requests of ``--context`` random tokens are prefilled, then the
engine decodes; after a warm-up (compilation), ``--steps`` decode steps are timed through
``Engine.step()`` with a timer around each phase:

* schedule: the scheduler's plan (page reservations, copy-on-write orders);
* metadata: building the step's index arrays on the host and copying them to the device;
* dispatch: the jitted step call until it returns (asynchronous: device work not included);
* wait: blocking on the drawn tokens (the device time not hidden behind host work);
* commit: appending the tokens, stop checks, releases.

``device`` is the jitted decode program alone, run back to back on its last inputs (already
on the device). ``floor`` is the time to read what a decode step must read, the weights
(all but the embedding table, whose B rows are negligible) plus the KV of every sequence,
at the read ceiling measured in the same run (a jitted ``jnp.sum`` over a large array).

    python benchmarks/bench_step.py --preset 1b --batch 1,16,64 --json step_1b.json
    python benchmarks/bench_step.py --preset tiny --context 128 --steps 20   # CPU smoke run
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_engine import PRESETS, build_model  # noqa: E402
from common import environment, table, time_calls, write_json  # noqa: E402

from jaxattn.engine import Engine  # noqa: E402

PHASES = ("schedule", "metadata", "dispatch", "wait", "commit")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--checkpoint", metavar="DIR", help="a Hugging Face Llama instead")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--layers", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", default="1,16,64", help="batch sizes, comma separated")
    p.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=8, help="untimed decode steps")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefill-tokens", type=int, default=2048, help="tokens per prefill step")
    p.add_argument("--implementation", choices=["reference", "pallas", "native"])
    p.add_argument(
        "--ceiling-gib",
        type=float,
        help="read-ceiling array size (default: 4 GiB on a GPU, 256 MiB on the CPU)",
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def read_ceiling(nbytes: int) -> dict:
    """Bytes per second a jitted ``jnp.sum`` reads from one large float32 array."""
    n = max(nbytes // 4, 1)
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    t = time_calls(lambda a: jnp.sum(a), [(x,)], samples=7)
    return dict(bytes=n * 4, seconds=t["median_s"], gbps=n * 4 / t["median_s"] / 1e9)


def weight_bytes(params, cfg) -> int:
    """Parameter bytes a decode step reads: all of them but the embedding table (B rows
    of it are gathered), unless it is tied to the LM head, which reads it whole."""
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    if not cfg.tie_word_embeddings:
        total -= params["embed"].size * params["embed"].dtype.itemsize
    return total


class PhaseTimer:
    """Wraps the engine's methods with timers; ``laps`` holds one dict per step."""

    def __init__(self, engine):
        self.engine, self.laps, self.current = engine, [], None
        self.last_decode = None
        sched, runner = engine.scheduler, engine.runner
        self._wrap(sched, "schedule", "schedule")
        self._wrap(runner, "_decode_args", "metadata")
        orig_run = runner._run

        def run(kind, program, batch, samples, greedy):
            if kind == "decode":
                self.last_decode = (program, batch, samples, greedy)
            t0 = time.perf_counter()
            out = orig_run(kind, program, batch, samples, greedy)
            self._add("dispatch", time.perf_counter() - t0)
            return out

        runner._run = run
        orig_commit = sched.commit

        def commit(plan, extend_tokens, decode_tokens):
            t0 = time.perf_counter()
            jax.block_until_ready((extend_tokens, decode_tokens))
            t1 = time.perf_counter()
            out = orig_commit(plan, extend_tokens, decode_tokens)
            self._add("wait", t1 - t0)
            self._add("commit", time.perf_counter() - t1)
            return out

        sched.commit = commit

    def _wrap(self, obj, name, phase):
        orig = getattr(obj, name)

        @functools.wraps(orig)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = orig(*args, **kwargs)
            self._add(phase, time.perf_counter() - t0)
            return out

        setattr(obj, name, timed)

    def _add(self, phase, seconds):
        if self.current is not None:
            self.current[phase] = self.current.get(phase, 0.0) + seconds

    def step(self):
        self.current = {}
        t0 = time.perf_counter()
        done = self.engine.step()
        self.current["step"] = time.perf_counter() - t0
        self.laps.append(self.current)
        self.current = None
        return done


def device_time(engine, captured, reps: int) -> float:
    """Seconds per call of the captured decode program, back to back on device inputs."""
    program, batch, samples, greedy = captured
    runner = engine.runner
    statics = runner._statics["decode"]
    k, v = runner.k_cache, runner.v_cache

    def run(n):
        nonlocal k, v
        out = None
        for _ in range(n):
            out, k, v = program(runner.params, k, v, batch, samples, greedy=greedy, **statics)
        return out

    jax.block_until_ready(run(2))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(run(reps))
        times.append((time.perf_counter() - t0) / reps)
    runner.k_cache, runner.v_cache = k, v
    return statistics.median(times)


def run_batch(cfg, params, args, batch: int, ceiling_bps: float) -> dict:
    p = args.page_size
    max_new = args.warmup + args.steps + 2
    pages = batch * -(-(args.context + max_new) // p) + 8
    engine = Engine(
        cfg,
        params,
        num_pages=pages,
        page_size=p,
        max_batch_tokens=max(args.prefill_tokens, batch),
        max_running=max(batch, 1),
        radix_cache=False,
        implementation=args.implementation,
        eos_token_id=None,
    )
    rng = np.random.default_rng(args.seed + batch)
    for _ in range(batch):
        engine.add_request(rng.integers(0, cfg.vocab_size, args.context).tolist(), max_new)
    timer = PhaseTimer(engine)
    sched = engine.scheduler
    while any(s.remaining > 1 for s in sched.running) or sched.waiting:
        timer.step()  # prefill
    for _ in range(args.warmup):
        timer.step()
    timer.laps.clear()
    compiles = sum(engine.runner.trace_counts.values())
    lens = []
    for _ in range(args.steps):
        lens.append(sum(s.num_computed + 1 for s in sched.running))
        timer.step()
    assert sum(engine.runner.trace_counts.values()) == compiles, "a timed step compiled"
    laps = timer.laps
    med = {k: statistics.median(lap.get(k, 0.0) for lap in laps) for k in (*PHASES, "step")}
    dev = device_time(engine, timer.last_decode, reps=max(4, min(args.steps, 32)))
    kv = statistics.median(lens) * cfg.kv_bytes_per_token()
    wb = weight_bytes(params, cfg)
    floor = (wb + kv) / ceiling_bps
    row = dict(batch=batch, context=args.context, tokens_per_step=batch)
    row.update({f"{k}_ms": v * 1e3 for k, v in med.items()})
    row.update(
        device_ms=dev * 1e3,
        floor_ms=floor * 1e3,
        weight_bytes=wb,
        kv_bytes=int(kv),
        step_over_floor=med["step"] / floor,
        device_over_floor=dev / floor,
        backend=engine.stats["attention_backend"]["decode"],
    )
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg, params, name = build_model(args)
    on_gpu = jax.default_backend() != "cpu"
    gib = args.ceiling_gib if args.ceiling_gib else (4.0 if on_gpu else 0.25)
    ceiling = read_ceiling(int(gib * 2**30))
    print(
        f"bench_step: {name} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.dtype}) on {jax.devices()[0].device_kind}; read ceiling "
        f"{ceiling['gbps']:.0f} GB/s",
        file=sys.stderr,
    )
    rows = []
    for b in [int(x) for x in args.batch.split(",") if x.strip()]:
        rows.append(run_batch(cfg, params, args, b, ceiling["gbps"] * 1e9))
        print(f"  batch {b}: {rows[-1]['step_ms']:.2f} ms a step", file=sys.stderr)
    columns = [
        ("batch", "B", "d"),
        ("step_ms", "step ms", ".3f"),
        *[(f"{k}_ms", k, ".3f") for k in PHASES],
        ("device_ms", "device ms", ".3f"),
        ("floor_ms", "floor ms", ".3f"),
        ("step_over_floor", "step/floor", ".2f"),
        ("device_over_floor", "device/floor", ".2f"),
    ]
    print(table(rows, columns))
    payload = dict(
        environment=environment(),
        model=dict(name=name, **{k: getattr(cfg, k) for k in cfg.__dataclass_fields__}),
        args={k: str(v) for k, v in vars(args).items()},
        read_ceiling=ceiling,
        results=rows,
    )
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
