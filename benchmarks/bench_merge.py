"""The split-KV merge after the Pallas decode kernels (``jaxattn.pallas.decode.combine``) at
the partition counts their split grids produce, against a candidate: the same exact merge as
one variadic reduction over the partitions, the online softmax's merge as its combiner.

Why: traced on an H200 (``benchmarks/RESULTS.md``, round 34), the merge after a 32-partition
grid (batch 1, 32768 tokens, 32/8 heads) ran as three reduction kernels, 4.5 us beside a
36 us decode kernel, where #16's batch-1 target leaves ~3.5 us for everything after the
kernel; at 4 partitions (batch 8) it is one or two loop kernels. The candidate is checked
against ``combine`` on every case (NaN and empty partitions included) before it is timed.

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
from jax import lax  # noqa: E402

from jaxattn.pallas import _common as C  # noqa: E402
from jaxattn.pallas.decode import combine  # noqa: E402

# The candidate's identity max: below every partition's (finite, >= C.M_INIT, or NaN).
FLOOR = -3.0e38
assert FLOOR < C.M_INIT


def _merge_pair(x, y):
    """Two partial states (max, sum, acc) folded into one, exactly; a NaN max propagates."""
    (m1, l1, a1), (m2, l2, a2) = x, y
    top = jnp.maximum(m1, m2)
    w1, w2 = jnp.exp2(m1 - top), jnp.exp2(m2 - top)
    return top, l1 * w1 + l2 * w2, a1 * w1 + a2 * w2


def variadic_combine(acc, m, l_sum, dtype):
    """``combine``'s result (acc f32[B, P, Hq, D], m, l_sum f32[B, P, Hq], m in base 2) as one
    variadic reduction over P: NaN where any partition's max is NaN, 0 where every partition
    is empty (denominator 0)."""
    full = acc.shape
    operands = (
        jnp.broadcast_to(m[..., None], full),
        jnp.broadcast_to(l_sum[..., None], full),
        acc,
    )
    init = (jnp.float32(FLOOR), jnp.float32(0.0), jnp.float32(0.0))
    top, denom, numer = lax.reduce(operands, init, _merge_pair, (1,))
    safe = jnp.where(denom == 0, 1.0, denom)
    out = jnp.where(denom == 0, 0.0, numer / safe)
    return jnp.where(jnp.isnan(top), jnp.nan, out).astype(dtype)


IMPLS = {"combine": combine, "variadic": variadic_combine}


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
    """The candidate against ``combine`` on one input: NaN where combine has NaN, the rest
    within f32 rounding (relative error of the finite entries)."""
    want = np.asarray(combine(*args, jnp.float32))
    got = np.asarray(variadic_combine(*args, jnp.float32))
    if not np.array_equal(np.isnan(want), np.isnan(got)):
        raise SystemExit("variadic_combine: NaN where combine has none, or the reverse")
    ok = ~np.isnan(want)
    return rel_error(got[ok], want[ok])


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
        print(f"B={batch} partitions={parts} ({len(copies)} copies), candidate err {err:.1e}")
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
                ("rel_err", "candidate err", ".1e"),
            ],
        )
    )
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
