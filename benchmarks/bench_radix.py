"""Host cost of the radix prefix cache: microseconds per ``match_prefix`` / ``insert``.

Two parts:

* **grid**: prompt length (128 ... 32k tokens) x tree size (10 ... 100k nodes). The bulk of
  the tree is chat-like: sequences under 16 shared system prompts, half of them continuing
  an earlier sequence by 32 tokens. A probe document of 32768 tokens is added with a
  16-token branch every 1024 tokens (64 more nodes), so a match of ``L`` probe tokens walks
  ``L / 1024 + 1`` nodes whatever the tree size; timing it shows the cost of the length
  (vectorized comparison along edges) and of the tree size (child lookups) separately.
  ``match_hit``: the cached prefix ``doc[:L]``; ``match_miss``: ``L`` fresh tokens;
  ``insert_ext``: ``doc[:L]`` + 16 new tokens (one new leaf at depth ``L / 1024 + 1``);
  ``insert_new``: ``L`` fresh tokens (one new leaf of ``L`` tokens under the root).
* **traces**: a shared-system-prompt workload and a multi-turn chat workload run through
  the full request cycle (match, lock, allocate with eviction, insert, unlock), timing every
  call.

Every figure is the median over single calls timed with ``perf_counter_ns``.

    python benchmarks/bench_radix.py --json benchmarks/results/radix.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, table, write_json  # noqa: E402

from jaxattn.radix import RadixCache, TokenPool  # noqa: E402

VOCAB = 32000
DOC_LEN = 32768
BRANCH_EVERY = 1024


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter_ns()
    out = fn(*args, **kwargs)
    return out, (time.perf_counter_ns() - t0) / 1e3


def median(xs) -> float | None:
    return float(statistics.median(xs)) if xs else None  # None: valid JSON, "-" in tables


def cache_tokens(cache: RadixCache, pool: TokenPool, tokens: np.ndarray) -> tuple[int, float]:
    """One request's cache cycle without a model: match, allocate the rest, insert."""
    m = cache.match_prefix(tokens)
    need = len(tokens) - m.length
    if pool.available < need:
        cache.evict(need - pool.available)
    new = pool.alloc(need)
    n, t = timed(cache.insert, tokens, np.concatenate([m.indices, new]))
    pool.free(new[: n - m.length])
    return n, t


# --- grid ----------------------------------------------------------------------------


def build_tree(num_nodes: int, spare: int, rng) -> tuple[RadixCache, TokenPool, list]:
    # Room for the tree and `spare` more slots, so that timing never has to evict.
    pool = TokenPool(2 * DOC_LEN + 64 * num_nodes + spare)
    cache = RadixCache(pool)
    systems = [rng.integers(0, VOCAB, 256) for _ in range(16)]
    recent: list[np.ndarray] = []
    k = 0
    while cache.num_nodes < num_nodes:
        if recent and rng.random() < 0.5:
            base = recent[rng.integers(len(recent))]
        else:
            base = systems[k % 16]
        tokens = np.concatenate([base, rng.integers(0, VOCAB, 32)])
        cache_tokens(cache, pool, tokens)
        if len(tokens) < 2048:  # keep chains, and this list, bounded
            if len(recent) < 4096:
                recent.append(tokens)
            else:
                recent[rng.integers(len(recent))] = tokens
        k += 1
    docs = [rng.integers(0, VOCAB, DOC_LEN)]
    for doc in docs:
        cache_tokens(cache, pool, doc)
        for at in range(BRANCH_EVERY // 2, DOC_LEN, BRANCH_EVERY):
            cache_tokens(cache, pool, np.concatenate([doc[:at], rng.integers(0, VOCAB, 16)]))
    return cache, pool, docs


def grid(tree_sizes, lengths, reps, rng) -> list[dict]:
    rows = []
    for num_nodes in tree_sizes:
        t0 = time.perf_counter()
        cache, pool, docs = build_tree(num_nodes, reps * (sum(lengths) + 16 * len(lengths)), rng)
        built = time.perf_counter() - t0
        actual = cache.num_nodes
        print(f"  tree of {actual} nodes built in {built:.1f} s", flush=True)
        for length in lengths:
            res = dict(match_hit=[], match_miss=[], insert_ext=[], insert_new=[])
            for i in range(reps):
                doc = docs[i % len(docs)]
                m, t = timed(cache.match_prefix, doc[:length])
                assert m.length == length
                res["match_hit"].append(t)
                # Ids above the vocabulary with a unique first token: never cached before.
                fresh = rng.integers(VOCAB, 2 * VOCAB, length)
                fresh[0] = 2 * VOCAB + len(rows) * reps + i
                m0, t = timed(cache.match_prefix, fresh)
                assert m0.length == 0
                res["match_miss"].append(t)
                tail = rng.integers(VOCAB, 2 * VOCAB, 16)
                tail[0] = fresh[0]
                new = pool.alloc(16)
                n, t = timed(
                    cache.insert,
                    np.concatenate([doc[:length], tail]),
                    np.concatenate([m.indices, new]),
                )
                assert n == length
                res["insert_ext"].append(t)
                slots = pool.alloc(length)
                n, t = timed(cache.insert, fresh, slots)
                assert n == 0
                res["insert_new"].append(t)
            rows.append(
                dict(
                    tree_nodes=actual,
                    prompt_len=length,
                    path_nodes=length // BRANCH_EVERY + 1,
                    **{f"{k}_us": median(v) for k, v in res.items()},
                )
            )
        cache.check_invariants()
    return rows


# --- traces --------------------------------------------------------------------------


def run_requests(name, requests, pool_slots) -> dict:
    """Serve ``requests`` (prompt, output) token arrays through the cache cycle."""
    pool = TokenPool(pool_slots)
    cache = RadixCache(pool)
    t_match, t_insert, t_evict = [], [], []
    hit = total = 0
    for prompt, output in requests:
        m, t = timed(cache.match_prefix, prompt)
        t_match.append(t)
        hit += m.length
        total += len(prompt)
        cache.inc_lock_ref(m.node)
        full = np.concatenate([prompt, output])
        need = len(full) - m.length
        if pool.available < need:
            _, t = timed(cache.evict, need - pool.available)
            t_evict.append(t)
        new = pool.alloc(need)
        if new is None:
            raise RuntimeError(f"{name}: pool of {pool_slots} slots too small for a request")
        n, t = timed(cache.insert, full, np.concatenate([m.indices, new]))
        t_insert.append(t)
        pool.free(new[: n - m.length])  # slots of tokens cached meanwhile (none here)
        cache.dec_lock_ref(m.node)
    cache.check_invariants()
    return dict(
        trace=name,
        requests=len(requests),
        mean_prompt=float(np.mean([len(p) for p, _ in requests])),
        hit_rate=hit / total,
        final_nodes=cache.num_nodes,
        match_us=median(t_match),
        match_p90_us=float(np.percentile(t_match, 90)),
        insert_us=median(t_insert),
        insert_p90_us=float(np.percentile(t_insert, 90)),
        evictions=len(t_evict),
        evict_us=median(t_evict),
    )


def system_prompt_trace(rng, num_requests, num_systems=4, system_len=2048):
    systems = [rng.integers(0, VOCAB, system_len) for _ in range(num_systems)]
    out = []
    for _ in range(num_requests):
        question = rng.integers(0, VOCAB, int(rng.lognormal(np.log(128), 0.6)) + 1)
        answer = rng.integers(0, VOCAB, int(rng.lognormal(np.log(200), 0.6)) + 1)
        out.append((np.concatenate([systems[rng.integers(num_systems)], question]), answer))
    return out


def chat_trace(rng, num_conversations, turns):
    """Interleaved conversations; turn t's prompt is the whole history plus a new message."""
    system = rng.integers(0, VOCAB, 512)
    histories = [system.copy() for _ in range(num_conversations)]
    schedule = np.repeat(np.arange(num_conversations), turns)
    rng.shuffle(schedule)
    out = []
    for c in schedule:
        user = rng.integers(0, VOCAB, int(rng.lognormal(np.log(100), 0.6)) + 1)
        reply = rng.integers(0, VOCAB, int(rng.lognormal(np.log(250), 0.6)) + 1)
        prompt = np.concatenate([histories[c], user])
        out.append((prompt, reply))
        histories[c] = np.concatenate([prompt, reply])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree-sizes", default="10,100,1000,10000,100000")
    p.add_argument("--lengths", default="128,512,2048,8192,32768")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)

    grid_rows = grid(
        [int(x) for x in args.tree_sizes.split(",")],
        [int(x) for x in args.lengths.split(",")],
        args.reps,
        rng,
    )
    sys_trace = system_prompt_trace(rng, args.requests)
    chat = chat_trace(rng, args.conversations, args.turns)
    trace_rows = [
        # A pool that holds ~1/4 of the distinct tokens, so eviction runs too.
        run_requests("system-prompt", sys_trace, 4 * 2048 + 150_000),
        run_requests("multi-turn-chat", chat, 1_000_000),
        run_requests("multi-turn-chat-small-pool", chat, 150_000),
    ]

    print()
    print(
        table(
            grid_rows,
            [
                ("tree_nodes", "tree nodes", "d"),
                ("prompt_len", "prompt len", "d"),
                ("path_nodes", "path nodes", "d"),
                ("match_hit_us", "match hit µs", ".1f"),
                ("match_miss_us", "match miss µs", ".1f"),
                ("insert_ext_us", "insert +16 µs", ".1f"),
                ("insert_new_us", "insert new µs", ".1f"),
            ],
        )
    )
    print()
    print(
        table(
            trace_rows,
            [
                ("trace", "trace", ""),
                ("requests", "requests", "d"),
                ("mean_prompt", "mean prompt", ".0f"),
                ("hit_rate", "prefix hit", ".1%"),
                ("final_nodes", "nodes", "d"),
                ("match_us", "match µs", ".1f"),
                ("match_p90_us", "match p90", ".1f"),
                ("insert_us", "insert µs", ".1f"),
                ("insert_p90_us", "insert p90", ".1f"),
                ("evictions", "evictions", "d"),
                ("evict_us", "evict µs", ".1f"),
            ],
        )
    )
    write_json(
        args.json, dict(env=environment(), args=vars(args), grid=grid_rows, traces=trace_rows)
    )


if __name__ == "__main__":
    main()
