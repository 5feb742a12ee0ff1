"""Reads the block timelines that ``decode_selftest --trace`` writes to ``$DECODE_TRACE_CSV``
(a self-test built with ``-DJAXATTN_DECODE_TRACE``): one row a block, its SM and the global
timer at its start (s0), after its first copies (s2), at the top of key tiles 0..7 (s4..s11),
after its loop (s12) and after its writes (s13), in ns from the first block's start.

    python3 ffi/tests_gpu/decode_trace.py trace.csv [other.csv]
    python3 ffi/tests_gpu/decode_trace.py trace.csv --claim|--steal TILES K[,K...]
        [--combine US] [--restart US]
    python3 ffi/tests_gpu/decode_trace.py trace.csv --static TILES [calibration.csv]

Prints, for each file: the span; when each SM ran its last block out; blocks an SM; block
phases; each SM's mean key-tile time; the resident blocks over the span; and the balanced
estimate -- the span had every SM's slots run until the same moment at that SM's own measured
rate (block starts included), i.e. the work spread in proportion to each SM's speed. With two
files, how the SMs' speeds in one agree with the other's (their correlation, and where the
first file's fastest SMs rank in the second): a property of the SM's place in the chip when
they agree across kernels.

``--claim`` simulates, on that trace's SMs, a decode whose blocks claim their sequence's
key tiles K at a time from a counter and, once it is exhausted, help the sequence with the
most tiles left (ffi/NOTES.md, round 59), or (``--steal``) take the back half of the largest
range left: each SM's slots at its measured key-tile time, a ring start (to the first
tile) and a block's finish at the trace's medians, a probe of 128 counters at 1 us, TILES key
tiles a sequence, blocks started in grid order on the first free slot, and ``--combine`` us
(default 5) added for the merge of the chunks. It first simulates the trace's own grid (one
block a sequence, no claims), whose span checks the model against the measured one.
``--static`` models a persistent grid that cuts the work into shares weighted by the SMs'
speeds (equal; this trace's own, an oracle; another trace's, a calibration), plus 5 us of
merge.
"""

from __future__ import annotations

import csv
import heapq
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


def span_of(rows: list[dict]) -> float:
    """The trace's span: the last block's end, us."""
    return max(stamp(r, 13) or 0.0 for r in rows)


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


def slots_per_sm(rows: list[dict]) -> int:
    """Slots an SM: the most blocks resident at once (at any block's start) over the SMs,
    rounded up."""
    most = max(
        sum(1 for r in rows if stamp(r, 0) <= t < stamp(r, 13)) for t in (stamp(r, 0) for r in rows)
    )
    return max(1, -(-most // len(by_sm(rows))))


def start_finish(rows: list[dict]) -> tuple[float, float]:
    """The median block's start (to its first tile) and finish (loop end to written), us."""
    start = statistics.median(stamp(r, 4) - stamp(r, 0) for r in rows if stamp(r, 4) is not None)
    return start, statistics.median(stamp(r, 13) - stamp(r, 12) for r in rows)


def report(path: str) -> None:
    rows = load(path)
    sms = by_sm(rows)
    span = span_of(rows)
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
    # Balanced: each SM's slot rate (blocks a slot-second, from its own blocks), the work
    # spread by rate.
    slots = slots_per_sm(rows)
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


def loop_tile_times(rows: list[dict], tiles: int) -> dict[int, float]:
    """Each SM's key-tile time over its blocks' whole loops, blocks of ``tiles`` key tiles (tile
    0 to the loop's end; the first tiles alone run slower than the loop's average)."""
    return {
        sm: statistics.mean((stamp(r, 12) - stamp(r, 4)) / tiles for r in rs)
        for sm, rs in by_sm(rows).items()
    }


def static_split(path: str, tiles: int, calib: str | None, combine_us: float = 5.0) -> float:
    """The span of a persistent grid (the trace's slots) that cuts the trace's work into
    contiguous shares weighted by each SM's speed in ``calib`` (another trace of the same
    SMs; None: equal shares), its ring running on across sequences: one start, one finish, the
    SM's key-tile time in this trace, and ``combine_us`` for the merge of the cut sequences."""
    rows = load(path)
    speed = loop_tile_times(rows, tiles)
    weight_of = loop_tile_times(load(calib), tiles) if calib else dict.fromkeys(speed, 1.0)
    slots = slots_per_sm(rows)
    start_us, finish_us = start_finish(rows)
    weights = {sm: 1.0 / weight_of.get(sm, statistics.mean(weight_of.values())) for sm in speed}
    total = slots * sum(weights.values())
    work = len(rows) * tiles
    return combine_us + max(
        start_us + work * weights[sm] / total * speed[sm] + finish_us for sm in speed
    )


def simulate(
    path: str,
    tiles: int,
    mode: str = "own",
    chunk: int = 1,
    combine_us: float = 0.0,
    probe_us: float = 1.0,
    restart_us: float | None = None,
) -> float:
    """The span of a grid of one block a sequence on the trace's SMs (see the module
    docstring). mode "own": each block runs its sequence alone (the trace's own grid);
    "claim": blocks take their sequence's tiles ``chunk`` at a time from its counter and,
    once it is exhausted, join the sequence with the most tiles left; "steal": a block whose work
    is done takes the back half of the largest remaining range (at least 2 x ``chunk``
    tiles), whose worker keeps the front half. ``restart_us``: what a block's move to other
    work costs before its first tile (default: the trace's median start)."""
    rows = load(path)
    speed = loop_tile_times(rows, tiles)
    sms = sorted(speed)
    per_sm = slots_per_sm(rows)
    start_us, finish_us = start_finish(rows)
    n = len(rows)
    step = tiles if mode == "own" else chunk
    # Ranges of tiles [front, back) still to compute; one a sequence, more once stolen from.
    front, back = [0] * n, [tiles] * n
    slots = [sm for sm in sms for _ in range(per_sm)]
    events: list = []  # (time, order, its SM, the range it works on)
    state = {"next": 0, "order": 0, "end": 0.0}

    def push(t: float, sm: int, r: int) -> None:
        state["order"] += 1
        heapq.heappush(events, (t, state["order"], sm, r))

    def start_next(t: float, sm: int) -> None:
        if state["next"] < n:
            state["next"] += 1
            push(t + start_us, sm, state["next"] - 1)

    for sm in slots[:n]:
        start_next(0.0, sm)
    while events:
        t, _, sm, r = heapq.heappop(events)
        if front[r] < back[r]:  # the next step of the range: its tiles, then the next claim
            k = min(step, back[r] - front[r])
            front[r] += k
            push(t + k * speed[sm], sm, r)
            continue
        t += finish_us  # the range is done: the block writes its state
        found = None
        if mode == "claim":  # the sequence with the most tiles left
            t += probe_us * -(-n // 128)
            big = max(range(n), key=lambda x: back[x] - front[x])
            if front[big] < back[big]:
                found = big
        elif mode == "steal":  # the back half of the largest range left
            t += probe_us * -(-len(front) // 128)
            big = max(range(len(front)), key=lambda x: back[x] - front[x])
            if back[big] - front[big] >= 2 * chunk:
                mid = front[big] + (back[big] - front[big] + 1) // 2
                front.append(mid)
                back.append(back[big])
                back[big] = mid
                found = len(front) - 1
        if found is not None:  # its first step claimed now, before the ring restarts
            k = min(step, back[found] - front[found])
            front[found] += k
            push(t + (start_us if restart_us is None else restart_us) + k * speed[sm], sm, found)
            continue
        state["end"] = max(state["end"], t)
        start_next(t, sm)
    return state["end"] + combine_us


def main(argv: list[str]) -> None:
    if "--static" in argv:
        i = argv.index("--static")
        path, tiles = argv[0], int(argv[i + 1])
        calib = argv[i + 2] if len(argv) > i + 2 and not argv[i + 2].startswith("--") else None
        span = span_of(load(path))
        for name, c in (("equal shares", None), ("this trace's own speeds", path), (calib, calib)):
            if name is None:
                continue
            t = static_split(path, tiles, c)
            print(f"{path}: static split, {name}: {t:.1f} us against the measured {span:.1f}")
        return
    for mode in ("--claim", "--steal"):
        if mode in argv:
            i = argv.index(mode)
            path, tiles, chunks = argv[0], int(argv[i + 1]), argv[i + 2]
            combine_us = float(argv[argv.index("--combine") + 1]) if "--combine" in argv else 5.0
            restart = float(argv[argv.index("--restart") + 1]) if "--restart" in argv else None
            span = span_of(load(path))
            own = simulate(path, tiles)
            print(f"{path}: measured span {span:.1f} us; the model of its own grid {own:.1f} us")
            for k in map(int, chunks.split(",")):
                t = simulate(path, tiles, mode[2:], k, combine_us, restart_us=restart)
                print(
                    f"  {mode[2:]}, {k} tiles (+{combine_us:g} us of merge): {t:.1f} us, "
                    f"{100 * (1 - t / own):.1f}% below the model's own grid"
                )
            return
    if not 1 <= len(argv) <= 2:
        raise SystemExit(__doc__)
    for path in argv:
        report(path)
    if len(argv) == 2:
        compare(*argv)


if __name__ == "__main__":
    main(sys.argv[1:])
