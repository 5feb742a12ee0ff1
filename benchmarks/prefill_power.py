"""Prefill under sustained load: throughput per window, SM clock and power, against FA4.

An H200 running a long prefill back to back reaches its power limit within a fraction of a
second and lowers its SM clock; a short burst after an idle pause runs at the full clock.
This script shows both for jaxattn's native ``prefix_prefill`` and, where it is installed,
FlashAttention-4 on the same device buffers (``fa4_peer``): ``--seconds`` of back-to-back
calls after a one-second pause in ~0.1 s windows: the first window's TFLOP/s, the median of
the windows after the first sixth of the run, and, from ``nvidia-smi`` sampled meanwhile, the
median SM clock, power and whether the software power cap was active. ``--ncu`` instead runs
one call of each between ``cudaProfilerStart`` / ``cudaProfilerStop`` (for ``ncu
--profile-from-start off``).

    python3 benchmarks/prefill_power.py --cases 1:0:8192,8:2048:512 --seconds 3
    ncu --profile-from-start off --section SpeedOfLight --section InstructionStats \\
        python3 benchmarks/prefill_power.py --cases 1:0:8192 --ncu
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import bench_extend as be
import common
import fa4_peer
import jax
import jax.numpy as jnp

import jaxattn

SMI_FIELDS = "timestamp,clocks.sm,power.draw.instant,clocks_event_reasons.sw_power_cap"
# The problem: bf16, GQA 32/8, head_dim 128, bshd pages of 16 (bench_extend.py's).
HQ, HKV, D, PAGE = 32, 8, 128, 16


def _smi_start(path: str):
    if shutil.which("nvidia-smi") is None:
        return None
    with open(path, "w") as out:
        return subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader", "-lms", "100"],
            stdout=out,
            stderr=subprocess.DEVNULL,
        )


def _smi_window(path: str, t0: float, t1: float) -> str:
    """Median SM clock and power, and the share of samples with the power cap active, of the
    samples taken between wall times t0 and t1 (nvidia-smi's local timestamps)."""
    import datetime

    clocks, power, capped = [], [], []
    with open(path) as f:
        lines = f.readlines()
    for line in lines:
        parts = [x.strip() for x in line.split(",")]
        if len(parts) < 4 or "MHz" not in parts[1]:
            continue
        try:
            ts = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            if not t0 <= ts <= t1:
                continue
            clocks.append(float(parts[1].split()[0]))
            power.append(float(parts[2].split()[0]))
            capped.append(parts[3] == "Active")
        except ValueError:
            continue
    if not clocks:
        return "(no nvidia-smi samples)"
    return (
        f"SM clock {statistics.median(clocks):.0f} MHz, power {statistics.median(power):.0f} W, "
        f"power cap active in {sum(capped)}/{len(capped)} samples"
    )


def _profiler(name: str) -> None:
    """cudaProfilerStart / cudaProfilerStop from the CUDA runtime the process can load."""
    for lib in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            getattr(ctypes.CDLL(lib), name)()
            return
        except OSError:
            continue
    raise RuntimeError("--ncu needs the CUDA runtime library (libcudart.so)")


def _run_jax(calls, copies, n: int) -> None:
    jax.block_until_ready([calls(copies) for _ in range(n)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="1:0:8192,8:2048:512", help="B:prefix:new,...")
    p.add_argument("--seconds", type=float, default=3.0, help="back-to-back time per run")
    p.add_argument("--repeats", type=int, default=2, help="runs of each implementation")
    p.add_argument("--no-peers", action="store_true", help="jaxattn alone")
    p.add_argument("--ncu", action="store_true", help="one profiled call of each, no timing")
    common.add_peer_site_arg(p)
    args = p.parse_args(argv)
    with tempfile.NamedTemporaryFile(suffix=".csv", delete=False) as f:
        log = f.name
    smi = None if args.ncu else _smi_start(log)
    try:
        for case in args.cases.split(","):
            b, pre, new = (int(x) for x in case.split(":"))
            shape = dict(
                batch=b,
                prefix=pre,
                new=new,
                num_q_heads=HQ,
                num_kv_heads=HKV,
                head_dim=D,
                dtype=jnp.bfloat16,
                kv_dtype=jnp.bfloat16,
            )
            build = functools.partial(be.build_prefill, **shape, page_size=PAGE, layout="bshd")
            copies = common.make_copies(build, 1 if args.ncu else 4)
            flops = be.useful_flops(b, pre, new, HQ, D)
            op = functools.partial(jaxattn.prefix_prefill, implementation="native", layout="bshd")
            calls = common.calls_over_copies(op)
            jax.block_until_ready(calls(copies))
            runs = {"jaxattn": functools.partial(_run_jax, calls, copies)}
            if not args.no_peers:
                fa4 = [
                    fa4_peer.extend_call(
                        c,
                        form="prefill",
                        batch=b,
                        prefix=pre,
                        new=new,
                        scale=D**-0.5,
                        pack_gqa=True,
                    )
                    for c in copies
                ]
                if all(callable(f) for f in fa4):
                    import torch  # importable: fa4_peer built its calls with it

                    for f in fa4:
                        f()
                    torch.cuda.synchronize()

                    def run_fa4(n, fa4=fa4, torch=torch):
                        for _ in range(n):
                            for f in fa4:
                                f()
                        torch.cuda.synchronize()

                    runs["fa4"] = run_fa4
                else:
                    print(f"  (no FA4: {next(f for f in fa4 if isinstance(f, str))})")
            if args.ncu:
                _profiler("cudaProfilerStart")
                for run in runs.values():
                    run(1)
                _profiler("cudaProfilerStop")
                continue
            # Calls a window: ~0.1 s at 500 TFLOP/s.
            per = max(1, int(0.1 / (flops / 500e12) / len(copies)))
            for _ in range(args.repeats):
                for name, run in runs.items():
                    time.sleep(1.0)
                    rates, t_start, w0 = [], time.perf_counter(), time.time()
                    while time.perf_counter() - t_start < args.seconds:
                        t0 = time.perf_counter()
                        run(per)
                        rates.append(flops * per * len(copies) / (time.perf_counter() - t0) / 1e12)
                    half = [r for i, r in enumerate(rates) if i >= len(rates) // 6]
                    print(
                        f"{b} x ({pre} + {new}) {name}: first window {rates[0]:.0f}, median after "
                        f"the first sixth {statistics.median(half):.0f} TFLOP/s ({len(rates)} "
                        f"windows); {_smi_window(log, w0 + 0.5, time.time())}",
                        flush=True,
                    )
    finally:
        if smi is not None:
            smi.terminate()
            smi.wait()
        os.unlink(log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
