"""The decode step's projections at a few rows: jaxattn.native.linear against XLA's dot.

A decode step at batch B multiplies B rows by every weight matrix of the model; below a
handful of rows that is a read of the weights and nothing else, so the figure of merit is
the weight bytes read per second against the read ceiling measured in the same run. Two
times per call: the wall time of calls enqueued back to back (launch gaps included, which a
program of short kernels pays) and the GPU's own (``jax.profiler``: kernels and memsets). The
shapes are those of the engine's presets (bench_engine.PRESETS: the fused QKV, the output,
the fused gate/up and the down projections, the LM head), each timed on copies of the
weights rotated past the L2.

    python benchmarks/bench_linear.py --preset 1b,8b --rows 1,4,8 --json linear.json
    python benchmarks/bench_linear.py --preset tiny --rows 1,8 --no-ceilings   # CPU smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_engine import PRESETS, preset_config  # noqa: E402
from common import (  # noqa: E402
    ceilings,
    ceilings_line,
    device_profile,
    environment,
    make_copies,
    num_copies,
    table,
    time_calls,
    write_json,
)

from jaxattn import native  # noqa: E402


def projections(cfg) -> dict[str, tuple[int, int]]:
    """(k, n) of each projection a decode step runs, as the engine fuses them."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {
        "qkv": (h, cfg.q_size + 2 * cfg.kv_size),
        "o": (cfg.q_size, h),
        "gate_up": (h, 2 * i),
        "down": (i, h),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (h, cfg.vocab_size)
    return shapes


def xla_dot(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="1b,8b", help=f"comma-separated, of {sorted(PRESETS)}")
    p.add_argument("--rows", default="1,4,8", help="rows of x (the decode batch)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--samples", type=int, default=7)
    p.add_argument("--no-ceilings", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    dtype = jnp.dtype(args.dtype)
    ceil = None if args.no_ceilings else ceilings(small=jax.default_backend() == "cpu")
    if ceil:
        print(ceilings_line(ceil), file=sys.stderr)
    rows = []
    for preset in [s.strip() for s in args.preset.split(",") if s.strip()]:
        cfg = preset_config(preset, dtype=args.dtype)
        for name, (k, n) in projections(cfg).items():
            nbytes = k * n * dtype.itemsize
            copies = num_copies(nbytes)
            ws = make_copies(
                lambda c, k=k, n=n: (
                    jax.random.normal(jax.random.key(c), (k, n), jnp.float32).astype(dtype),
                ),
                copies,
            )
            for m in [int(r) for r in args.rows.split(",") if r.strip()]:
                x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(dtype)
                row = dict(preset=preset, proj=name, m=m, k=k, n=n, mbytes=nbytes / 1e6)
                for impl, fn in (("native", native.linear), ("xla", xla_dot)):
                    if impl == "native" and native.linear_unsupported(x, ws[0][0]) is not None:
                        continue
                    t = time_calls(
                        lambda w, fn=fn, x=x: fn(x, w), ws, samples=args.samples, target_s=0.03
                    )["median_s"]
                    row[f"{impl}_us"] = t * 1e6
                    row[f"{impl}_gbps"] = nbytes / t / 1e9
                    # The GPU's own time per call (kernels and memsets, without the gaps
                    # between launches that a dispatch of short kernels leaves): the profile.
                    calls = jax.jit(lambda ws, fn=fn, x=x: [fn(x, w) for (w,) in ws])
                    jax.block_until_ready(calls(ws))
                    prof = device_profile(lambda c=calls, ws=ws: c(ws), steps=len(ws))
                    if prof is not None:
                        gpu_s = prof["busy_us"] * 1e-6
                        row[f"{impl}_kernel_us"] = prof["busy_us"]
                        if ceil:
                            row[f"{impl}_kernel_pct"] = (
                                100 * nbytes / gpu_s / (ceil["read"]["gbps"] * 1e9)
                            )
                    if ceil:
                        row[f"{impl}_pct"] = 100 * nbytes / t / (ceil["read"]["gbps"] * 1e9)
                if "native_us" in row:
                    got = np.asarray(native.linear(x, ws[0][0]), np.float32)
                    ref = np.asarray(xla_dot(x, ws[0][0]), np.float32)
                    row["max_abs_diff"] = float(np.max(np.abs(got - ref)))
                    row["speedup"] = row["xla_us"] / row["native_us"]
                rows.append(row)
                print(
                    f"  {preset} {name} m={m}: native {row.get('native_us', float('nan')):.1f} us,"
                    f" xla {row['xla_us']:.1f} us",
                    file=sys.stderr,
                )
    pct = (
        []
        if not ceil
        else [("native_pct", "native % read", ".0f"), ("xla_pct", "xla % read", ".0f")]
    )
    kernel = [("native_kernel_us", "native GPU us", ".1f"), ("xla_kernel_us", "xla GPU us", ".1f")]
    if ceil:
        kernel += [
            ("native_kernel_pct", "native GPU % read", ".0f"),
            ("xla_kernel_pct", "xla GPU % read", ".0f"),
        ]
    columns = [
        ("preset", "preset", ""),
        ("proj", "projection", ""),
        ("m", "rows", "d"),
        ("k", "k", "d"),
        ("n", "n", "d"),
        ("mbytes", "MB", ".1f"),
        ("native_us", "native us", ".1f"),
        ("xla_us", "xla us", ".1f"),
        ("native_gbps", "native GB/s", ".0f"),
        ("xla_gbps", "xla GB/s", ".0f"),
        *pct,
        *kernel,
        ("speedup", "xla / native", ".2f"),
        ("max_abs_diff", "max |diff|", ".2e"),
    ]
    print(table(rows, columns))
    if ceil:
        print(ceilings_line(ceil))
    write_json(args.json, dict(environment=environment(), ceilings=ceil, results=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
