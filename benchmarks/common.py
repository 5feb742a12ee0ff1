"""Timing and ceilings shared by the benchmark scripts.

Timing: one jitted function calls the op once on each of several copies of the inputs
(enough copies that a round over them overflows the GPU's L2 several times, so no call
finds its data cached); a sample enqueues that function many times back to back and
waits once, so dispatch overlaps device work; after a warm-up, the figure is the
median over samples of sample time / calls. (A ``lax.fori_loop`` over fixed inputs
was tried first: XLA hoists the loop-invariant work out of the loop.)

``--timing graph`` (:func:`time_graph`) times the same calls with no host in the loop: one
jitted ``while`` loop whose body makes whole rounds of one call per copy (at least
``GRAPH_CALLS`` calls), each call's output fed to the next one as its first argument (q: the
ops' output has its shape), compiled as one CUDA graph (XLA's command buffers with WHILE and
CONDITIONAL, no minimum graph size) and without XLA's loop-invariant code motion, so every
call, with all of its XLA work, runs every iteration. A figure that the dispatch timing
calls host-bound is then the device's; and each call waits for the one before it, as a
model's layers do (the dispatch timing's calls are independent of each other).

Ceilings, measured in the same run: device-to-device copy bandwidth (an elementwise
``x + 1`` over a large buffer; bytes read plus bytes written) and a large bf16 matmul.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# On-chip cache the rotated inputs must overflow (H200: 60 MB of L2).
L2_BYTES = 60 * 2**20


def random_cache(key_k, key_v, layout, geom, *, dtype, kv_dtype):
    """Random normal K and V caches of ``geom`` (num_pages, P, Hkv, D) in ``layout``: in
    ``kv_dtype`` directly, or for an FP8 format the ``dtype`` data quantised with per-head
    scales (``jaxattn.fp8_scales``). Returns (k_cache, v_cache, scales) with scales ()
    or (k_scale, v_scale)."""
    import jaxattn

    kv_dtype = jnp.dtype(kv_dtype)
    fp8 = jaxattn.quant.is_fp8(kv_dtype)
    data = dtype if fp8 else kv_dtype
    k_shape = jaxattn.layout.cache_shape(layout, "k", *geom, dtype=data)
    v_shape = jaxattn.layout.cache_shape(layout, "v", *geom, dtype=data)
    k = jax.random.normal(key_k, k_shape, data)
    v = jax.random.normal(key_v, v_shape, data)
    if not fp8:
        return k, v, ()
    # Quantise in the bshd order write_kv uses: [pages * P, Hkv, D] rows.
    kb = jaxattn.layout.to_bshd(k, layout, "k").reshape(-1, geom[2], geom[3])
    vb = jaxattn.layout.to_bshd(v, layout, "v").reshape(-1, geom[2], geom[3])
    ks, vs = jaxattn.fp8_scales(kb, vb, kv_dtype)
    kq = jaxattn.quant.quantize(kb, kv_dtype, ks, 1, saturate=True).reshape(k_shape[:1] + (-1,))
    vq = jaxattn.quant.quantize(vb, kv_dtype, vs, 1, saturate=True).reshape(k_shape[:1] + (-1,))
    n, p, h, dd = geom
    kq = jaxattn.layout.from_bshd(kq.reshape(n, p, h, dd), layout, "k")
    vq = jaxattn.layout.from_bshd(vq.reshape(n, p, h, dd), layout, "v")
    return kq, vq, (ks, vs)


def _is_scale(a) -> bool:
    return np.dtype(getattr(a, "dtype", np.int32)) == np.float32 and np.ndim(a) <= 1


def split_scales(args: tuple) -> tuple[tuple, dict]:
    """An input tuple that may end with (k_scale, v_scale) (the benchmark builders append
    them for an FP8 cache) as (the op's positional inputs, those scales as keywords). Every
    op's positional inputs end with int32 index arrays, so two trailing float32 scalars or
    vectors are the scales (the count alone is ambiguous: cascade decode has 8 inputs)."""
    if len(args) >= 2 and all(_is_scale(a) for a in args[-2:]):
        return args[:-2], dict(k_scale=args[-2], v_scale=args[-1])
    return args, {}


def with_scales(op, **kw):
    """``op`` called on an input tuple that may end with (k_scale, v_scale): those become
    the keyword arguments."""

    def run(*args):
        inputs, scales = split_scales(args)
        return op(*inputs, **scales, **kw)

    return run


def relative_to_first(rows, key: str, first, match: tuple[str, ...]) -> None:
    """rows[i]["x_first"] = the time of the row with rows[i]'s ``match`` fields and
    ``key == first`` over rows[i]'s own (a speedup over the first variant)."""
    index = {tuple(r.get(m) for m in match): r for r in rows if r.get(key) == first and "us" in r}
    for r in rows:
        base = index.get(tuple(r.get(m) for m in match))
        if base is not None and "us" in r:
            r["x_first"] = base["us"] / r["us"]


def tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


# Calls a dispatch makes at the least where the device's memory allows them: between two
# dispatches the GPU idles for the next executable's launch (an H200 in round 39: ~7-12 us
# after a one-call dispatch of a 0.25-1 ms decode, 1-3% of the call), which a dispatch of
# one call would charge to that call. With four the gap is a quarter of a call's share.
MIN_CALLS = 4


def copy_budget() -> int:
    """Bytes the copies of one input may take together: a quarter of the default device's
    memory (4 GiB where JAX does not say), at most 16 GiB."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return min(16 * 2**30, limit // 4 if limit else 4 * 2**30)


def num_copies(bytes_per_copy: int, *, max_copies: int = 16) -> int:
    """Copies needed so that one round over them moves at least 16x the L2 (~1 GB), and
    that a round makes at least :data:`MIN_CALLS` calls where :func:`copy_budget` holds
    them.

    A round is one dispatch, so this also sets the device time a dispatch holds: with
    4x the L2 (two copies of a 45 us decode) the host's dispatch time could exceed the
    device time, and an H200 measured the same kernel at 45 or 70 us from one process
    to the next; with ~1 GB a round the device time dominates.
    """
    size = max(bytes_per_copy, 1)
    l2 = math.ceil(16 * L2_BYTES / size)
    return max(1, min(max_copies, max(l2, min(MIN_CALLS, copy_budget() // size))))


def make_copies(build: Callable[[int], tuple], n: int) -> list[tuple]:
    """n independent input sets; build(i) returns one (i seeds its randomness)."""
    return [build(i) for i in range(n)]


@functools.lru_cache(maxsize=64)
def calls_over_copies(fn: Callable) -> Callable:
    """One jitted function that calls fn once on every copy it is given (a list of argument
    tuples), unrolled: the program :func:`time_calls` times (one per fn, so a profile of the
    same fn runs the executable the timing compiled)."""
    return jax.jit(lambda all_copies: [fn(*args) for args in all_copies])


HOST_PROBE_DISPATCHES = 3  # dispatches whose enqueue time measures the host's cost of one
HOST_BOUND_FRACTION = 0.8  # host enqueue time per dispatch over measured time: host-bound
# A sample keeps the results of its last few dispatches only. Then the results' buffers cycle
# through a few addresses, and XLA finds the traced graph of each command-buffer custom call in
# its cache (keyed by the buffers' addresses) instead of tracing the call again at every
# dispatch, as it did while every result stayed alive to the end of the sample. H200, native
# decode at batch 1 (15 calls a dispatch), e4m3: 40.1 / 28.7 -> 27.2 / 27.1 us a call, the
# host's enqueue 53 / 38 -> 31 / 27 us a call; bf16 42.9 / 43.1 -> 42.5 / 42.5 us; batch 64
# within the run's noise (152-158 us either way).
KEEP_DISPATCHES = 4


def time_calls(
    fn: Callable,
    copies: Sequence[tuple],
    *,
    target_s: float = 0.05,
    samples: int = 15,
    min_calls: int = 4,
    warmup_s: float = 0.25,
) -> dict:
    """Seconds per ``fn(*copy)`` call: median over ``samples`` and the spread.

    One jitted function calls fn once on every copy (unrolled: distinct inputs, so XLA
    can neither merge nor hoist the calls); a sample enqueues that function several
    times back to back and waits once, so the device does not idle on the host -- unless
    the host takes longer to enqueue a dispatch than the device takes to run it, which the
    result reports (``host_s_per_dispatch``, ``host_bound``: then the figure is an upper
    bound of the device's time). On an H200 a dispatch of 8-15 native decode calls takes the
    host 240-470 us (``KEEP_DISPATCHES``), just under what the calls' kernels take at batch
    1. A
    ``fori_loop`` over the same inputs does not work here: XLA moves loop-invariant
    work out of the loop and times an empty body.
    """
    copies = [tuple(c) for c in copies]
    all_calls = calls_over_copies(fn)
    calls = len(copies)  # calls a dispatch makes
    host: list[float] = []  # seconds the host took to enqueue one dispatch, per sample

    def sample(dispatches: int) -> float:
        t0 = time.perf_counter()
        outs: collections.deque = collections.deque(maxlen=KEEP_DISPATCHES)
        for i in range(dispatches):
            outs.append(all_calls(copies))
            if i == min(HOST_PROBE_DISPATCHES, dispatches) - 1:
                # The first few dispatches' enqueue time, before a full device queue could
                # make an enqueue wait: the host's own cost of one dispatch.
                host.append((time.perf_counter() - t0) / (i + 1))
        jax.block_until_ready(list(outs))  # the stream runs in order: the last ones end last
        return (time.perf_counter() - t0) / (dispatches * calls)

    jax.block_until_ready(all_calls(copies))  # compile
    out = _sampled(
        sample, calls, target_s=target_s, samples=samples, warmup_s=warmup_s, most=1000,
        before_samples=host.clear,
    )  # fmt: skip
    host_s = statistics.median(host)
    return out | dict(
        copies=calls,
        host_s_per_dispatch=host_s,
        # The host's enqueue of a dispatch took most of what a dispatch measured: the device
        # may have waited for the host, and the figure is then an upper bound of the calls'
        # device time.
        host_bound=host_s >= HOST_BOUND_FRACTION * out["median_s"] * calls,
    )


def _sampled(sample, calls: int, *, target_s, samples, warmup_s, most, before_samples=None):
    """The timing loop both timings share: ``sample(n)`` times ``n`` rounds of ``calls``
    calls and returns seconds a call; rounds a sample are sized to ``target_s`` (at most
    ``most``); warm-up, then the median, minimum and 90th percentile over ``samples``."""
    per_call = min(sample(1) for _ in range(3))
    n = int(max(2, min(most, round(target_s / max(per_call * calls, 1e-7)))))
    # Warm up for a fixed wall time, not a fixed count: an idle GPU starts at a low clock
    # (an H200 read 345 MHz before a run), and with a count-based warm-up the first,
    # shortest case of a run (a 45 us decode) measured up to 1.5x slower than in the
    # previous run.
    t_end = time.perf_counter() + warmup_s
    sample(n)
    while time.perf_counter() < t_end:
        sample(n)
    if before_samples is not None:
        before_samples()
    times = sorted(sample(n) for _ in range(samples))
    return dict(
        median_s=statistics.median(times),
        min_s=times[0],
        p90_s=times[int(0.9 * (len(times) - 1))],
        calls_per_sample=n * calls,
        samples=samples,
    )


# The graph timing's program (:func:`chained_loop`): the engine's decode-loop command buffers
# (XLA's default kinds plus WHILE and CONDITIONAL: the loop one CUDA graph, its predicate
# evaluated on the device), no minimum size for a command buffer (XLA's default, 5 commands,
# leaves a top level of a parameter copy and the loop out of any graph: the loop's predicate
# went back to the host every iteration), and no loop-invariant code motion (else XLA moves
# every call's work that does not depend on the chained argument out of the loop: a call's
# table checks, its plan).
NO_HOISTING = "while-loop-invariant-code-motion,while-loop-expensive-invariant-code-motion"
TIMINGS = ("dispatch", "graph", "both")
# Calls an iteration of the graph loop makes at least (rounds over the copies): the loop
# costs some tens of microseconds an iteration besides its calls (H200: 40 us an iteration
# of eight cheap elementwise calls, the loop's predicate on the device or on the host), which
# a round of 8 decode calls at batch 8 (about 300 us) would count.
GRAPH_CALLS = 64


@functools.lru_cache(maxsize=64)
def chained_loop(fn: Callable, rounds: int = 1) -> Callable:
    """``(copies, reps) -> out``: a jitted loop of ``reps`` iterations, each calling fn
    ``rounds`` times on every copy in order, the first argument of each call the previous
    call's output (the first: copy 0's). See :func:`time_graph`."""

    def run(all_copies, reps):
        def body(_, x):
            for _ in range(rounds):
                for args in all_copies:
                    x = fn(x, *args[1:])
            return x

        return lax.fori_loop(0, reps, body, all_copies[0][0])

    from jaxattn.engine.runner import DECODE_GRAPH_COMMANDS

    options = dict(
        xla_gpu_enable_command_buffer=DECODE_GRAPH_COMMANDS,
        xla_gpu_graph_min_graph_size=1,
        xla_disable_hlo_passes=NO_HOISTING,
    )
    return jax.jit(run, compiler_options=options)


def time_graph(
    fn: Callable,
    copies: Sequence[tuple],
    *,
    target_s: float = 0.05,
    samples: int = 15,
    warmup_s: float = 0.25,
) -> dict:
    """Seconds per ``fn(*copy)`` call with no host between calls: :func:`chained_loop`
    (an iteration: at least ``GRAPH_CALLS`` calls, whole rounds over the copies) run for
    about ``target_s`` a sample (one dispatch, waited for), the median over ``samples`` of
    sample time / calls. fn's output must have the shape and dtype of its first argument
    (``ValueError`` otherwise), which it is then given back: the chain keeps XLA from
    merging or hoisting the calls, and costs nothing (no extra kernel). The dispatch and the
    wait, once a sample, are part of the figure (~0.1% of a 30 ms sample), and so is the
    loop's own cost an iteration (see ``GRAPH_CALLS``)."""
    copies = [tuple(c) for c in copies]
    out = jax.eval_shape(fn, *copies[0])
    first = copies[0][0]
    if not hasattr(out, "shape") or (out.shape, out.dtype) != (first.shape, first.dtype):
        raise ValueError(
            "graph timing feeds each call's output back as its first argument: "
            f"fn returns {out}, its first argument is {first.shape} {first.dtype}"
        )
    rounds = -(-GRAPH_CALLS // len(copies))
    loop = chained_loop(fn, rounds)
    calls = rounds * len(copies)  # calls an iteration makes

    def sample(reps: int) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(loop(copies, jnp.int32(reps)))
        return (time.perf_counter() - t0) / (reps * calls)

    sample(1)  # compile
    out = _sampled(
        sample, calls, target_s=target_s, samples=samples, warmup_s=warmup_s, most=100_000
    )
    return out | dict(mode="graph", copies=len(copies), calls_per_iteration=calls)


def device_profile(run: Callable[[], object], *, steps: int = 1, top: int = 12) -> dict | None:
    """What the first GPU did while ``run()`` ran (traced with ``jax.profiler``): per step
    (``run`` covers ``steps``), the span from the first kernel's start to the last one's end,
    the time some kernel was running (the rest: the GPU idle between kernels, waiting for the
    host), the kernel count, and the ``top`` kernel names by time, each with the GPU's idle
    time just before it (:func:`kernel_summary`). None without a GPU trace.

    A kernel launched dependent on the one before it (the native decode kernels outside a
    command buffer; XLA's own kernels too, whose dependent launch jax 0.11 turns on by
    default) appears from its launch, not from the end of its wait, so its listed time can
    exceed its share of the span; the span and the busy time are unions and stay right."""
    import glob
    import tempfile

    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            jax.block_until_ready(run())
        finally:
            jax.profiler.stop_trace()
        paths = sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True))
        if not paths:
            return None
        data = ProfileData.from_file(paths[-1])
    events = set()
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU:0"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for e in line.events:
                events.add((e.start_ns, e.duration_ns, e.name))
    return kernel_summary(events, steps=steps, top=top)


def kernel_summary(events, *, steps: int = 1, top: int = 12) -> dict | None:
    """:func:`device_profile`'s figures from ``(start_ns, duration_ns, name)`` events of
    kernels (None for none). Besides each top kernel's time, its ``idle_before``: the time
    the GPU ran no kernel just before it started (from the end of every kernel that started
    earlier to its start), which is where a launch the GPU waits for shows: a kernel outside
    the command buffer's chain of dependent launches (a custom call traced into a graph of
    its own) or after a host round trip."""
    if not events:
        return None
    events = sorted(events)
    busy, end = 0.0, -math.inf
    idle: dict[str, float] = {}
    for start, dur, name in events:  # the union of the kernels' intervals
        if end > -math.inf and start > end:
            idle[name] = idle.get(name, 0.0) + (start - end)
        stop = start + dur
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    span = end - events[0][0]
    by_name: dict[str, list[float]] = {}
    for _, dur, name in events:
        by_name.setdefault(name, []).append(dur)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    per = 1e-3 / steps  # ns per run -> us per step
    return dict(
        span_us=span * per,
        busy_us=busy * per,
        idle_fraction=1.0 - busy / span if span > 0 else 0.0,
        kernels_per_step=len(events) / steps,
        top=[
            dict(
                name=name[:120],
                us_per_step=sum(d) * per,
                calls_per_step=len(d) / steps,
                idle_before_us_per_step=idle.get(name, 0.0) * per,
            )
            for name, d in ranked
        ],
    )


def profile_lines(prof: dict | None, unit: str = "step") -> str:
    """A few lines that summarise :func:`device_profile`'s result (``unit``: what one of its
    ``steps`` is, for the heading)."""
    if prof is None:
        return "  (no GPU trace)"
    lines = [
        f"  GPU per {unit}: span {prof['span_us']:.1f} us, "
        f"kernels running {prof['busy_us']:.1f} us "
        f"({100 * (1 - prof['idle_fraction']):.0f}%), {prof['kernels_per_step']:.0f} kernels"
    ]
    for k in prof["top"]:
        idle = k.get("idle_before_us_per_step", 0.0)
        lines.append(
            f"    {k['us_per_step']:8.1f} us {k['calls_per_step']:6.1f}x "
            f"(idle before: {idle:6.1f} us)  {k['name']}"
        )
    return "\n".join(lines)


def add_profile_args(p) -> None:
    """``--profile`` and ``--profile-top``, as every kernel benchmark takes them (see
    :func:`profile_calls`)."""
    p.add_argument(
        "--profile",
        action="store_true",
        help="also trace each timed row of the library (jax.profiler): per call, the span from "
        "its first kernel to its last, the time kernels ran (the rest: the GPU waiting for the "
        "host), and the kernels by time",
    )
    p.add_argument("--profile-top", type=int, default=6, help="kernels --profile lists")


def profile_calls(fn, copies, top: int, calls: int = 1) -> dict | None:
    """:func:`device_profile` of ``fn`` over every copy, four times over (the timed
    program's shape: one call per copy in one jitted function), printed per call of the op
    (``calls``: the op's calls in one of fn, as ``bench_cascade.py --layers`` makes them)."""
    run = calls_over_copies(fn)
    copies = [tuple(c) for c in copies]
    jax.block_until_ready(run(copies))  # compile outside the trace
    steps = 4 * len(copies) * calls
    prof = device_profile(lambda: [run(copies) for _ in range(4)], steps=steps, top=top)
    print(profile_lines(prof, unit="call"), flush=True)
    return prof


def copy_bandwidth(nbytes: int = 2 * 2**30) -> dict:
    """Device-to-device copy ceiling: x + 1 over nbytes of uint32 (read + write)."""
    n = nbytes // 4
    x = jax.random.bits(jax.random.key(0), (n,), jnp.uint32)
    t = time_calls(lambda a: a + jnp.uint32(1), [(x,)], samples=10)
    moved = 2 * n * 4
    return dict(bytes_moved=moved, seconds=t["median_s"], gbps=moved / t["median_s"] / 1e9)


def read_bandwidth(nbytes: int = 4 * 2**30) -> dict:
    """Read ceiling: a jitted ``jnp.sum`` over nbytes of uint32 (bytes read; the result is
    one scalar). Decode reads its KV once and writes little, so this is its floor."""
    n = nbytes // 4
    x = jax.random.bits(jax.random.key(2), (n,), jnp.uint32)
    t = time_calls(lambda a: jnp.sum(a, dtype=jnp.uint32), [(x,)], samples=10)
    return dict(bytes_read=n * 4, seconds=t["median_s"], gbps=n * 4 / t["median_s"] / 1e9)


def matmul_rate(n: int = 8192, dtype=jnp.bfloat16) -> dict:
    """Dense matmul ceiling: n x n x n in dtype on random data, float32 accumulation."""
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    t = time_calls(
        lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(dtype),
        [(a, b)],
        samples=10,
    )
    flops = 2 * n**3
    return dict(
        n=n, dtype=str(np.dtype(dtype)), seconds=t["median_s"], tflops=flops / t["median_s"] / 1e12
    )


def ceilings(*, small: bool = False) -> dict:
    """small: sizes for a smoke run on the CPU (the figures then mean nothing)."""
    if small:
        return dict(copy=copy_bandwidth(2**24), read=read_bandwidth(2**24), matmul=matmul_rate(256))
    return dict(copy=copy_bandwidth(), read=read_bandwidth(), matmul=matmul_rate())


def ceilings_line(c: dict) -> str:
    read = f"read {c['read']['gbps']:.0f} GB/s, " if "read" in c else ""
    return (
        f"ceilings: {read}copy {c['copy']['gbps']:.0f} GB/s (read+write), "
        f"bf16 matmul {c['matmul']['tflops']:.0f} TFLOP/s"
    )


def environment() -> dict:
    dev = jax.devices()[0]
    return dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=dev.device_kind,
        platform=dev.platform,
        jax=jax.__version__,
        python=platform.python_version(),
        argv=sys.argv,
    )


def parse_impls(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


class _SiteDir(argparse.Action):
    """Adds the option's directory as a site directory (its ``.pth`` files included) as soon
    as it is parsed, before any peer is imported."""

    def __call__(self, parser, namespace, values, option_string=None):
        import site

        site.addsitedir(values)
        setattr(namespace, self.dest, values)


def add_peer_site_arg(p) -> None:
    """``--peer-site DIR``: where a peer's wheels were unpacked (FlashAttention-4's, whose
    packages are found through a ``.pth`` file, which ``PYTHONPATH`` does not read)."""
    p.add_argument(
        "--peer-site",
        metavar="DIR",
        action=_SiteDir,
        help="a site directory to add before the peers are imported (its .pth files included)",
    )


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--impl",
        default="reference,pallas,native",
        help="comma-separated jaxattn implementations to time",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--no-ceilings", action="store_true", help="skip the ceiling runs")
    p.add_argument("--no-peers", action="store_true", help="skip the peer implementations")
    add_peer_site_arg(p)
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--target-s", type=float, default=0.05, help="seconds per timing sample")
    p.add_argument(
        "--timing",
        choices=TIMINGS,
        default="dispatch",
        help="dispatch: jitted calls enqueued back to back (the host's enqueue can bound a "
        "small call: the row then says host-bound); graph: the calls chained in one device "
        "loop, one CUDA graph, no host between them; both: the graph's figure, the dispatch "
        "one beside it (us_dispatch)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="compare every implementation's output with the spec first",
    )
    return p


def add_dtype_args(p) -> None:
    """``--head-dim``, ``--dtype`` and ``--kv-dtype`` (comma-separated cache dtypes), as the
    attention benchmarks take them; :func:`dtypes_of` reads them back."""
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--kv-dtype",
        default=None,
        help="cache dtypes, comma-separated: bfloat16, float8_e4m3fn, float8_e5m2, ... "
        "(default: --dtype)",
    )


def dtypes_of(args) -> tuple[jnp.dtype, list[jnp.dtype]]:
    """(q's dtype, the cache dtypes) of :func:`add_dtype_args`' options."""
    kv = (args.kv_dtype or args.dtype).split(",")
    return jnp.dtype(args.dtype), [jnp.dtype(x) for x in kv]


def write_json(path: Path | None, payload: dict) -> None:
    text = json.dumps(payload, indent=2, default=str)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Markdown table; columns are (key, header, format)."""
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, rule]
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key)
            cells.append("-" if v is None else format(v, fmt) if fmt else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rel_error(out, expected) -> float:
    """||out - expected|| / ||expected|| in float64."""
    a = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    e = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30))


def timing_kw(args) -> dict:
    """:func:`measure`'s timing keywords from a :func:`base_parser` command line."""
    return dict(samples=args.samples, target_s=args.target_s, timing=args.timing)


def measure(
    fn: Callable,
    copies: Sequence[tuple],
    *,
    samples: int,
    target_s: float = 0.05,
    expected=None,
    timing: str = "dispatch",
) -> dict:
    """Time fn over copies; a dict with us / us_min / timing (and rel_err against
    ``expected`` on copy 0), or with ``skipped`` (NotImplementedError) or ``error``.
    ``timing``: ``dispatch`` (:func:`time_calls`), ``graph`` (:func:`time_graph`) or
    ``both`` (us from the graph, ``us_dispatch`` beside it)."""
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {TIMINGS}, got {timing!r}")
    out: dict = {}
    kw = dict(samples=samples, target_s=target_s)
    try:
        if expected is not None:
            out["rel_err"] = rel_error(jax.jit(fn)(*copies[0]), expected)
        if timing != "graph":
            t = time_calls(fn, copies, **kw)
        if timing == "both":
            out |= dict(us_dispatch=t["median_s"] * 1e6, timing_dispatch=t)
        if timing != "dispatch":
            try:
                t = time_graph(fn, copies, **kw)
            except ValueError as e:  # an output not shaped as q: a dispatch figure stands
                if timing == "graph":
                    raise
                out["graph_skipped"] = str(e)[:300]
    except NotImplementedError as e:
        return out | {"skipped": str(e)[:300]}
    except Exception as e:  # noqa: BLE001 - one failing implementation must not end a run
        return out | {"error": f"{type(e).__name__}: {e}"[:600]}
    return out | dict(us=t["median_s"] * 1e6, us_min=t["min_s"] * 1e6, timing=t)


def status_line(name: str, row: dict, metric: str) -> str:
    if "skipped" in row:
        return f"  {name}: skipped ({row['skipped']})"
    if "error" in row:
        return f"  {name}: ERROR {row['error']}"
    err = f", rel err {row['rel_err']:.1e}" if "rel_err" in row else ""
    timing = row.get("timing") or {}
    note = ""
    if timing.get("host_bound"):
        per = row["us"] * timing["copies"]
        note = (
            f"  [host-bound: {timing['host_s_per_dispatch'] * 1e6:.0f} us to enqueue a dispatch"
            f" of {per:.0f} us; an upper bound]"
        )
    if timing.get("mode") == "graph":
        note = "  [graph"
        if "us_dispatch" in row:
            bound = " host-bound" if row["timing_dispatch"].get("host_bound") else ""
            note += f"; dispatched: {row['us_dispatch']:.1f} us{bound}"
        note += "]"
    return f"  {name}: {row['us']:.1f} us, {metric}{err}{note}"


def resolved_label(op, args: tuple, impl: str, **kw) -> str:
    """The configuration the backend ``impl`` picks for these arguments (its heuristic):
    what a table row was timed with."""
    inputs, scales = split_scales(args)
    resolved = op.resolve(op.bind(*inputs, **scales, **kw), impl)
    return "" if resolved.config is None else config_label(resolved.config)


def config_label(cfg) -> str:
    """Compact 'field=value' text of a backend config dataclass (None fields left out); a
    Pallas config on the Mosaic GPU lowering is that lowering alone (its tile fields do not
    apply to it)."""
    lowering = getattr(cfg, "lowering", None)
    if lowering is not None and lowering != "triton":
        return f"lowering={lowering}"
    short = {
        "block_q": "bq",
        "block_n": "bn",
        "num_warps": "w",
        "num_stages": "s",
        "heads_per_tile": "gh",
        "min_programs": "progs",
        "partition_size": "split",
        "copies": "copies",
        "kernel": "kernel",
        "block_m": "bm",
        "prefix_blocks": "prefix",
    }
    parts = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if v is not None and f.name in short:
            parts.append(f"{short[f.name]}={v}")
    return " ".join(parts)
