"""Reads the block timelines that ``decode_selftest --trace`` writes to ``$DECODE_TRACE_CSV``
(a self-test built with ``-DJAXATTN_DECODE_TRACE``): one row a block, its SM and the global
timer at its start (s0), after its first copies (s2), at the top of key tiles 0..7 (s4..s11),
after its loop (s12) and after its writes (s13), in ns from the first block's start.

    python3 ffi/tests_gpu/decode_trace.py trace.csv [other.csv]

Prints, for each file: the span; when each SM ran its last block out; blocks an SM; block
phases; each SM's mean key-tile time; the resident blocks over the span; and the balanced
estimate -- the span had every SM's slots run until the same moment at that SM's own measured
rate (block starts included), i.e. the work spread in proportion to each SM's speed. With two
files, how the SMs' speeds in one agree with the other's (their correlation, and where the
first file's fastest SMs rank in the second): a property of the SM's place in the chip when
they agree across kernels.
"""

from __future__ import annotations

import csv
import statistics
import sys


def load(path: str) -> list[dict]:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise SystemExit(f"{path}: no blocks")
    return rows


def stamp(row: dict, i: int) -> float | None:
    v = int(row[f"s{i}"])
    return None if v < 0 else v / 1000.0


def quantiles(values: list[float]) -> str:
    v = sorted(values)
    return "  ".join(
        f"{name} {v[min(len(v) - 1, int(q * len(v)))]:.2f}"
        for name, q in (("min", 0), ("p10", 0.1), ("p50", 0.5), ("p90", 0.9), ("max", 1))
    )


def tile_time(row: dict) -> float | None:
    """Mean key-tile time of tiles 0..7, or None for a block of fewer tiles."""
    a, b = stamp(row, 4), stamp(row, 11)
    return None if a is None or b is None else (b - a) / 7


def by_sm(rows: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in rows:
        out.setdefault(int(r["sm"]), []).append(r)
    return out


def sm_tile_times(rows: list[dict]) -> dict[int, float]:
    out = {}
    for sm, rs in by_sm(rows).items():
        t = [x for x in map(tile_time, rs) if x is not None]
        if t:
            out[sm] = statistics.mean(t)
    return out


def report(path: str) -> None:
    rows = load(path)
    sms = by_sm(rows)
    span = max(stamp(r, 13) or 0.0 for r in rows)
    print(f"{path}: {len(rows)} blocks on {len(sms)} SMs, span {span:.1f} us")
    last = [max(stamp(r, 13) for r in rs) for rs in sms.values()]
    print("  each SM's last end:", quantiles(last))
    counts: dict[int, int] = {}
    for rs in sms.values():
        counts[len(rs)] = counts.get(len(rs), 0) + 1
    print("  blocks an SM (blocks: SMs):", dict(sorted(counts.items())))
    durations = [stamp(r, 13) - stamp(r, 0) for r in rows]
    print("  block duration:", quantiles(durations))
    first = [stamp(r, 4) - stamp(r, 0) for r in rows if stamp(r, 4) is not None]
    if first:
        print("  start to tile 0:", quantiles(first))
    tiles = [x for x in map(tile_time, rows) if x is not None]
    if tiles:
        print("  key tile (0..7):", quantiles(tiles))
        print("  each SM's mean key tile:", quantiles(list(sm_tile_times(rows).values())))
    points = [span * i / 20 for i in range(21)]
    resident = [sum(1 for r in rows if stamp(r, 0) <= t < stamp(r, 13)) for t in points]
    print("  resident blocks at every 5% of the span:", " ".join(map(str, resident)))
    # Balanced: slots an SM (the most resident blocks over the SMs, rounded up), each SM's
    # slot rate (blocks a slot-second, from its own blocks), the work spread by rate.
    slots = max(1, -(-max(resident) // len(sms)))
    work = len(rows)  # in blocks of equal work (the self-test's shapes)
    rate = sum(len(rs) / sum(stamp(r, 13) - stamp(r, 0) for r in rs) for rs in sms.values())
    balanced = work / (slots * rate)
    print(
        f"  balanced estimate ({slots} slots an SM, each SM at its own rate): {balanced:.1f} us, "
        f"the span {100 * (span / balanced - 1):.1f}% over it"
    )


def compare(a_path: str, b_path: str) -> None:
    a, b = sm_tile_times(load(a_path)), sm_tile_times(load(b_path))
    keys = sorted(set(a) & set(b))
    if len(keys) < 3:
        return
    xa, xb = [a[k] for k in keys], [b[k] for k in keys]
    corr = statistics.correlation(xa, xb)
    fast = sorted(keys, key=a.__getitem__)[: max(1, len(keys) // 6)]
    rank_b = sorted(keys, key=b.__getitem__)
    print(f"SM speeds, {a_path} against {b_path}: correlation {corr:.2f}")
    print(f"  fastest {len(fast)} SMs of the first: {sorted(fast)}")
    print(f"  their ranks in the second: {sorted(rank_b.index(k) for k in fast)}")


def main(argv: list[str]) -> None:
    if not 1 <= len(argv) <= 2:
        raise SystemExit(__doc__)
    for path in argv:
        report(path)
    if len(argv) == 2:
        compare(*argv)


if __name__ == "__main__":
    main(sys.argv[1:])
