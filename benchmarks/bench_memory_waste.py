"""KV-cache memory waste: contiguous pre-allocation versus paging, on a simulated serving trace.

A continuous-batching server (FCFS admission, one decode step per iteration, at most
``--max-running`` sequences) serves a saturated queue of requests whose prompt and output
lengths follow a synthetic trace. The same KV pool of ``--pool-tokens`` slots is managed by

* ``contiguous-max``    one contiguous region of ``max_seq_len`` slots per request
                        (FasterTransformer / Orca (Max));
* ``contiguous-pow2``   region = total length rounded up to a power of two, i.e. the
                        output over-reserved by up to 2x (Orca (Pow2));
* ``contiguous-oracle`` region = exactly prompt + output (Orca (Oracle); needs the output
                        length in advance, which no real server has);
* ``paged-P``           :class:`jaxattn.paging.BlockManager` with block size ``P``: blocks
                        allocated on demand, preemption by recompute when the pool runs dry.

Contiguous regions come from a first-fit allocator over the pool's address range, so
external fragmentation happens as it would. Every iteration is classified slot by slot:
``live`` (holds a token's K/V), ``reserved`` (allocated to a request but holding no token:
reservation waste and internal fragmentation), ``stranded`` (free, while the request at the
head of the queue waits because no hole or not enough blocks fit it: external
fragmentation) and idle (free with no demand; not counted). Waste = 1 - live / (live +
reserved + stranded), averaged over iterations.

    python benchmarks/bench_memory_waste.py --json benchmarks/results/memory_waste.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, table, write_json  # noqa: E402

from jaxattn.paging import BlockManager  # noqa: E402

# Means of the two datasets of the vLLM paper's evaluation (its Fig. 11): ShareGPT
# (long conversations) and Alpaca (short instructions). The shapes (log-normal, sigma)
# are our assumption; real traces are heavier-tailed still.
TRACES = {
    "sharegpt": dict(prompt_mean=161.3, prompt_sigma=1.0, output_mean=338.0, output_sigma=0.9),
    "alpaca": dict(prompt_mean=19.3, prompt_sigma=0.6, output_mean=58.5, output_sigma=0.8),
}


@dataclasses.dataclass
class Request:
    rid: int
    prompt: int
    output: int
    generated: int = 0
    active: bool = False
    start: int = -1  # contiguous schemes: start of the region
    size: int = 0  # contiguous schemes: region size

    @property
    def length(self) -> int:
        return self.prompt + self.generated


def make_trace(name: str, n: int, max_seq_len: int, seed: int) -> list[tuple[int, int]]:
    cfg = TRACES[name]
    rng = np.random.default_rng(seed)

    def lognormal(mean, sigma):
        return rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n)

    prompts = np.clip(np.rint(lognormal(cfg["prompt_mean"], cfg["prompt_sigma"])), 1, 1024)
    outputs = np.clip(np.rint(lognormal(cfg["output_mean"], cfg["output_sigma"])), 1, None)
    outputs = np.minimum(outputs, max_seq_len - prompts)
    return [(int(p), int(o)) for p, o in zip(prompts, outputs, strict=True)]


# --- allocation schemes --------------------------------------------------------------


class Contiguous:
    """First-fit over [0, pool) with coalescing of free holes."""

    def __init__(self, pool: int, max_seq_len: int, policy: str):
        self.pool, self.max_seq_len, self.policy = pool, max_seq_len, policy
        self.holes: list[list[int]] = [[0, pool]]  # sorted [start, size]
        self.allocated = 0
        self.preemptions = 0

    def region(self, req: Request) -> int:
        total = req.prompt + req.output
        if self.policy == "max":
            return self.max_seq_len
        if self.policy == "pow2":
            return min(self.max_seq_len, 1 << (total - 1).bit_length())
        return total

    def can_admit(self, req: Request) -> bool:
        size = self.region(req)
        return any(h[1] >= size for h in self.holes)

    def admit(self, req: Request) -> None:
        size = self.region(req)
        for i, hole in enumerate(self.holes):
            if hole[1] >= size:
                req.start, req.size = hole[0], size
                hole[0] += size
                hole[1] -= size
                if not hole[1]:
                    del self.holes[i]
                self.allocated += size
                return
        raise AssertionError("admit without can_admit")

    def grow(self, req: Request, running: list[Request]) -> list[Request]:
        return []  # the region already covers the whole output

    def release(self, req: Request) -> None:
        self.allocated -= req.size
        self.holes.append([req.start, req.size])
        self.holes.sort()
        merged = [self.holes[0]]
        for start, size in self.holes[1:]:
            if merged[-1][0] + merged[-1][1] == start:
                merged[-1][1] += size
            else:
                merged.append([start, size])
        self.holes = merged

    def allocated_slots(self) -> int:
        return self.allocated


class Paged:
    """vLLM-style: blocks on demand, recompute preemption of the newest request."""

    def __init__(self, pool: int, block_size: int, watermark: float = 0.01):
        self.block_size = block_size
        self.m = BlockManager(pool // block_size, block_size, watermark=watermark)
        self.preemptions = 0

    def can_admit(self, req: Request) -> bool:
        # A preempted request is recomputed: its prompt is now prompt + generated.
        return self.m.can_allocate(req.length)

    def admit(self, req: Request) -> None:
        self.m.allocate(req.rid, req.length)

    def grow(self, req: Request, running: list[Request]) -> list[Request]:
        """Room for req's next token; returns the requests preempted to make it."""
        victims = []
        while not self.m.can_append_slot(req.rid):
            while not running[-1].active:
                running.pop()
            victim = running.pop()  # the newest running request
            victim.active = False
            self.release(victim)
            victims.append(victim)
            self.preemptions += 1
            if victim is req:
                return victims
        self.m.append_slot(req.rid)
        return victims

    def release(self, req: Request) -> None:
        self.m.free(req.rid)

    def allocated_slots(self) -> int:
        return (self.m.num_blocks - self.m.num_free_blocks) * self.block_size


# --- the serving loop ----------------------------------------------------------------


def simulate(scheme, trace, *, pool: int, max_running: int) -> dict:
    queue = collections.deque(Request(i, p, o) for i, (p, o) in enumerate(trace))
    running: list[Request] = []
    live_sum = reserved_sum = stranded_sum = 0.0
    waste_sum = batch_sum = 0.0
    steps = 0
    while queue or running:
        while queue and len(running) < max_running and scheme.can_admit(queue[0]):
            req = queue.popleft()
            scheme.admit(req)
            req.active = True
            running.append(req)
        if not running:
            raise RuntimeError(f"request {queue[0]} does not fit in an empty pool")
        live = sum(r.length for r in running)
        allocated = scheme.allocated_slots()
        blocked = bool(queue) and len(running) < max_running
        stranded = pool - allocated if blocked else 0
        busy = allocated + stranded
        live_sum += live / busy
        reserved_sum += (allocated - live) / busy
        stranded_sum += stranded / busy
        waste_sum += 1 - live / busy
        batch_sum += len(running)
        steps += 1
        # One decode step: every running request gets one more token.
        for req in list(running):
            if not req.active:  # preempted earlier in this step
                continue
            preempted = scheme.grow(req, running)
            queue.extendleft(preempted)  # newest preempted ends up last of them
            if not req.active:
                continue
            req.generated += 1
            if req.generated >= req.output:
                req.active = False
                scheme.release(req)
        running = [r for r in running if r.active]
    return dict(
        waste=waste_sum / steps,
        live=live_sum / steps,
        reserved=reserved_sum / steps,
        stranded=stranded_sum / steps,
        mean_batch=batch_sum / steps,
        steps=steps,
        preemptions=scheme.preemptions,
    )


def host_cost(reps: int = 20000) -> list[dict]:
    """Microseconds per BlockManager call at serving sizes (256 sequences, block 16)."""
    m = BlockManager(65536, 16)
    seqs = list(range(256))
    for s in seqs:
        m.allocate(s, 1000)
    rows = []

    def measure(name, fn, n):
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        rows.append(dict(call=name, us=(time.perf_counter() - t0) / n * 1e6))

    measure("append_slot (no copy)", lambda i: m.append_slot(seqs[i % 256]), reps)
    measure("can_append_slot", lambda i: m.can_append_slot(seqs[i % 256]), reps)
    forks = iter(range(10**6, 2 * 10**6))

    def fork_and_diverge(i):
        child = next(forks)
        m.fork(seqs[i % 256], child)
        m.append_slot(child)  # copy-on-write unless the tail happens to be full
        m.free(child)

    measure("fork + append_slot + free", fork_and_diverge, reps // 10)
    measure("block_tables(256 seqs, pad_to=128)", lambda i: m.block_tables(seqs, 128), 200)
    measure("slot_mapping(seq, 0, 1000)", lambda i: m.slot_mapping(seqs[i % 256], 0, 1000), 2000)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", default="sharegpt,alpaca")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--pool-tokens", type=int, default=32768, help="KV pool size in tokens")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--block-sizes", default="16,32,64,128")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args()

    rows = []
    for trace_name in args.traces.split(","):
        trace = make_trace(trace_name, args.num_requests, args.max_seq_len, args.seed)
        lens = np.asarray([p + o for p, o in trace])
        schemes = [
            (
                f"contiguous-{pol}",
                lambda pol=pol: Contiguous(args.pool_tokens, args.max_seq_len, pol),
            )
            for pol in ("max", "pow2", "oracle")
        ] + [
            (f"paged-{bs}", lambda bs=bs: Paged(args.pool_tokens, bs))
            for bs in map(int, args.block_sizes.split(","))
        ]
        for name, make in schemes:
            t0 = time.perf_counter()
            res = simulate(make(), trace, pool=args.pool_tokens, max_running=args.max_running)
            rows.append(
                dict(
                    trace=trace_name,
                    scheme=name,
                    mean_prompt=float(np.mean([p for p, _ in trace])),
                    mean_output=float(np.mean([o for _, o in trace])),
                    mean_total=float(lens.mean()),
                    sim_s=time.perf_counter() - t0,
                    **res,
                )
            )
            print(f"  {trace_name:9s} {name:18s} done in {rows[-1]['sim_s']:.1f} s", flush=True)

    print()
    print(
        f"pool {args.pool_tokens} tokens, max_seq_len {args.max_seq_len}, "
        f"{args.num_requests} requests per trace, saturated queue"
    )
    print(
        table(
            rows,
            [
                ("trace", "trace", ""),
                ("scheme", "scheme", ""),
                ("waste", "waste", ".1%"),
                ("live", "live", ".1%"),
                ("reserved", "reserved", ".1%"),
                ("stranded", "stranded", ".1%"),
                ("mean_batch", "mean batch", ".1f"),
                ("steps", "iterations", "d"),
                ("preemptions", "preempted", "d"),
            ],
        )
    )
    host = host_cost()
    print()
    print(table(host, [("call", "BlockManager call", ""), ("us", "µs per call", ".2f")]))
    write_json(args.json, dict(env=environment(), args=vars(args), rows=rows, host_cost=host))


if __name__ == "__main__":
    main()
