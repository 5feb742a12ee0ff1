"""The split-KV merge after the Pallas decode kernels at the partition counts their split
grids produce: the merge kernel (``jaxattn.pallas.decode.combine``, one launch) against the
same exact merge in jnp (``combine_jnp``, what XLA makes of reductions over the partition
axis).

Why: traced on an H200 (``benchmarks/RESULTS.md``, round 34), the jnp merge after a
32-partition grid (batch 1, 32768 tokens, 32/8 heads) ran as three reduction kernels and a
convert, ~5 us beside a 35 us decode kernel; at 4 partitions (batch 8) as one loop kernel.
The kernel is checked against ``combine_jnp`` on every case (NaN and empty partitions
included) before it is timed.

    python benchmarks/bench_merge.py --cases 1:32,8:4,4:8,64:1 --profile
    python benchmarks/bench_merge.py --small --samples 3     # CPU smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import (  # noqa: E402
    calls_over_copies,
    device_profile,
    environment,
    make_copies,
    num_copies,
    rel_error,
    table,
    time_calls,
    tree_bytes,
    write_json,
)

from jaxattn.pallas import _common as C  # noqa: E402
from jaxattn.pallas.decode import combine, combine_jnp  # noqa: E402

IMPLS = {
    "xla": combine_jnp,
    "kernel": combine,
}


def partials(seed: int, batch: int, parts: int, heads: int, head_dim: int):
    """Partial states as a split grid leaves them: maxima of base-2 logits, positive sums,
    a partition of every fourth row empty (max M_INIT, sum 0, acc 0), one NaN partition."""
    rng = np.random.default_rng(seed)
    acc = rng.standard_normal((batch, parts, heads, head_dim)).astype(np.float32)
    m = (4 * rng.standard_normal((batch, parts, heads))).astype(np.float32)
    l_sum = (rng.random((batch, parts, heads)) + 0.5).astype(np.float32)
    empty = (np.arange(heads) % 4 == 0)[None, None, :] & (np.arange(parts) == parts - 1)[
        None, :, None
    ]
    empty = np.broadcast_to(empty, m.shape)
    m[empty], l_sum[empty] = C.M_INIT, 0.0
    acc[empty] = 0.0
    m[0, 0, 1] = np.nan
    return jnp.asarray(acc), jnp.asarray(m), jnp.asarray(l_sum)


def check(args) -> float:
    """The kernel against ``combine_jnp`` on one input: NaN where the jnp merge has NaN, the
    rest within f32 rounding (the largest relative error of the finite entries)."""
    want = np.asarray(combine_jnp(*args, jnp.float32))
    ok = ~np.isnan(want)
    worst = 0.0
    for name, fn in IMPLS.items():
        got = np.asarray(fn(*args, jnp.float32))
        if not np.array_equal(np.isnan(want), np.isnan(got)):
            raise SystemExit(f"{name}: NaN where combine_jnp has none, or the reverse")
        worst = max(worst, rel_error(got[ok], want[ok]))
    return worst


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="1:32,8:4,4:8,64:1", help="B:partitions,...")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", help="the output's dtype")
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--target-s", type=float, default=0.03)
    p.add_argument("--profile", action="store_true", help="trace each row's kernels")
    p.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke run)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.small:
        args.cases, args.heads, args.head_dim = "2:3,1:5", 4, 8
    dtype = jnp.dtype(args.dtype)
    result = dict(environment=environment(), args=vars(args), rows=[])
    for case in args.cases.split(","):
        batch, parts = (int(x) for x in case.split(":"))
        one = partials(0, batch, parts, args.heads, args.head_dim)
        err = check(one)
        copies = make_copies(
            lambda i, b=batch, n=parts: partials(i, b, n, args.heads, args.head_dim),
            1 if args.small else num_copies(tree_bytes(one)),
        )
        print(f"B={batch} partitions={parts} ({len(copies)} copies), kernel err {err:.1e}")
        for name, fn in IMPLS.items():
            call = lambda acc, m, l_sum, f=fn: f(acc, m, l_sum, dtype)  # noqa: E731
            t = time_calls(call, copies, samples=args.samples, target_s=args.target_s)
            row = dict(batch=batch, parts=parts, impl=name, us=t["median_s"] * 1e6, rel_err=err)
            row["host_bound"] = t["host_bound"]
            if args.profile:
                prof = device_profile(
                    lambda c=call, cs=copies: calls_over_copies(c)(cs), steps=len(copies), top=4
                )
                if prof is not None:
                    row["kernels"] = prof["kernels_per_step"]
                    row["busy_us"] = prof["busy_us"]
            result["rows"].append(row)
            print(f"  {name}: {row['us']:.2f} us" + (" (host-bound)" if t["host_bound"] else ""))
    print()
    print(
        table(
            result["rows"],
            [
                ("batch", "B", ""),
                ("parts", "partitions", ""),
                ("impl", "merge", ""),
                ("us", "time (us)", ".2f"),
                ("busy_us", "GPU busy (us)", ".2f"),
                ("kernels", "kernels", ".0f"),
                ("host_bound", "host-bound", ""),
                ("rel_err", "kernel err", ".1e"),
            ],
        )
    )
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
