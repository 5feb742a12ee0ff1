"""Host cost of the radix prefix cache: the Python spec, the C++ tree and SGLang's tree.

Three parts, each run for page sizes 1 and 16:

* **ops**: per-call medians and p90s of ``match_prefix``, ``insert``, ``inc_lock_ref`` and
  ``dec_lock_ref`` on two traces, with every implementation fed the same calls in turn
  (request i goes to each in a rotating order, so machine noise falls on all alike) and
  the matched and cached lengths asserted equal across them:

  - ``chat``: interleaved multi-turn conversations behind one long shared system prompt,
    each request a full cycle (match, lock, allocate, insert prompt + reply, unlock);
  - ``random``: a random tree grown to ``--random-nodes`` nodes by inserting a random
    prefix of an earlier sequence plus a random tail (the inserts are timed as it grows),
    then matched with random prefixes of its sequences.

* **evict**: ``evict`` on trees of 10k, 100k and 1M nodes grown from shared prefixes:
  the cost of calls that free one leaf, and per leaf of one call that frees 1% of the
  tokens. With candidates kept incrementally the cost per freed leaf stays flat as the
  tree grows; a tree that rebuilds a heap over every leaf per call grows linearly.

* **memory**: bytes per node, the resident-set growth of a fresh process while it builds
  the random tree, divided by its node count (one process per implementation).

SGLang's ``RadixCache`` comes from its published wheel, unpacked outside this repository;
``--sglang-dir`` names the folder that holds ``sglang/srt/mem_cache/`` with
``radix_cache.py``, ``base_prefix_cache.py``, ``evict_policy.py``, ``cache_init_params.py``
and ``unified_cache/component_type.py`` (the modules those import are replaced by small
stand-ins below). Its tensors are numpy arrays behind a ``torch`` stand-in, which makes
each of its slicing and copying calls cheaper than torch's, so its times here are a lower
bound. Its ``match_prefix`` does not gather the slots of the match (``path_device_indices``
does, untimed here); jaxattn's does. Without ``--sglang-dir`` its columns stay empty.

    python benchmarks/bench_radix.py --sglang-dir DIR --json benchmarks/results/radix.json
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
import types
from array import array
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from jaxattn.radix import RadixCache, TokenPool, native_tree  # noqa: E402

VOCAB = 32000

# --- SGLang's tree behind stand-ins for its imports ------------------------------------


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


class _Tensor(np.ndarray):
    """What SGLang's tree calls on its value tensors."""

    def clone(self):
        return self.copy()

    def to(self, dtype=None, copy=False):
        return self.astype(dtype or self.dtype, copy=copy)


def load_sglang(folder: Path):
    """Import SGLang's ``radix_cache`` from ``folder`` with stand-ins for what it imports."""
    src = folder / "sglang" / "srt" / "mem_cache"
    if not (src / "radix_cache.py").is_file():
        raise SystemExit(f"--sglang-dir: {src / 'radix_cache.py'} not found")

    def as_tensor(x, dtype=np.int64, device=None):
        return np.asarray(x, dtype=dtype).view(_Tensor)

    torch = _module(
        "torch",
        Tensor=_Tensor,
        int64=np.int64,
        int32=np.int32,
        iinfo=np.iinfo,
        device=lambda d="cpu": str(d),
        tensor=as_tensor,
        empty=lambda shape, dtype=np.int64, device=None: np.empty(shape, dtype).view(_Tensor),
        cat=lambda xs: np.concatenate(xs).view(_Tensor),
    )
    torch.distributed = _module("torch.distributed", ProcessGroup=object)
    for pkg in ("sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.utils"):
        _module(pkg, __path__=[])
    sys.modules["sglang.srt.mem_cache"].__path__ = [str(src)]
    _module("sglang.srt.mem_cache.unified_cache", __path__=[str(src / "unified_cache")])

    class EventRecorder:  # KV events are off in SGLang by default: every record is a no-op
        def __init__(self, **kwargs):
            pass

        def __getattr__(self, name):
            return lambda *a, **k: None

    _module(
        "sglang.srt.mem_cache.events",
        KVCacheEventRecorder=EventRecorder,
        KvEventLoraNames=dict,
        LoRANameTable=dict,
    )
    _module("sglang.srt.mem_cache.allocator", BaseTokenToKVPoolAllocator=object)
    _module("sglang.srt.mem_cache.memory_pool", ReqToTokenPool=object)
    _module(
        "sglang.srt.observability.metrics_collector",
        STAT_LOGGER_ROLE_RADIX_CACHE="radix",
        RadixCacheMetricsCollector=object,
        radix_cache_metric_labels=lambda *a, **k: {},
        resolve_collector_class=lambda *a, **k: object,
    )
    _module("sglang.srt.observability", __path__=[])
    _module("sglang.srt.runtime_context", get_observability=None, get_parallel=None)
    _module("sglang.srt.utils.common", ceil_align=lambda x, y: -(-x // y) * y)
    policy = importlib.import_module("sglang.srt.mem_cache.evict_policy")
    strategies = {"lru": policy.LRUStrategy, "lfu": policy.LFUStrategy}

    def split_hashes(hashes, split_len, page_size):
        if hashes is None:
            return None, None
        k = split_len // page_size
        return hashes[:k], hashes[k:]

    _module(
        "sglang.srt.mem_cache.utils",
        get_eviction_strategy=lambda name, config=None: strategies[name](),
        split_node_hash_value=split_hashes,
    )
    return importlib.import_module("sglang.srt.mem_cache.radix_cache")


# --- one interface over the three trees -----------------------------------------------


class Jaxattn:
    def __init__(self, impl: str, num_slots: int, page: int, eviction: str = "lru"):
        self.name = impl
        self.pool = TokenPool(num_slots, page_size=page)
        self.cache = RadixCache(self.pool, page_size=page, eviction=eviction, impl=impl)

    def key(self, tokens: np.ndarray):
        return tokens

    def match(self, key):
        m = self.cache.match_prefix(key)
        return m.length, m.node, m.indices

    def insert(self, key, slots):
        return self.cache.insert(key, slots)

    def lock(self, node):
        self.cache.inc_lock_ref(node)

    def unlock(self, node):
        self.cache.dec_lock_ref(node)

    def evict(self, n):
        return self.cache.evict(n)

    def evict_nodes(self, n):
        """``evict(n)``; returns the number of nodes it freed (untimed bookkeeping aside)."""
        before = self.cache.num_nodes
        self.cache.evict(n)
        return before - self.cache.num_nodes

    def num_nodes(self):
        return self.cache.num_nodes

    def cached_tokens(self):
        return self.cache.total_size


class SGLang:
    name = "sglang"

    def __init__(self, mod, num_slots: int, page: int):
        self.mod = mod
        self.pool = TokenPool(num_slots, page_size=page)
        self.freed_nodes = 0
        pool, outer = self.pool, self

        class Allocator:  # SGLang's tree frees each evicted node's slots through this
            device = "cpu"

            def free_segment(self, value, start_pos=0):
                outer.freed_nodes += 1
                pool.free(value)

        self.cache = mod.RadixCache.create_simulated(mock_allocator=Allocator(), page_size=page)
        base = sys.modules["sglang.srt.mem_cache.base_prefix_cache"]
        self.MatchPrefixParams = base.MatchPrefixParams
        self.InsertParams = base.InsertParams
        self.EvictParams = base.EvictParams

    def key(self, tokens: np.ndarray):
        return array("q", tokens.tolist())

    def match(self, key):
        r = self.cache.match_prefix(self.MatchPrefixParams(key=self.mod.RadixKey(key)))
        return r.device_prefix_len, r.last_device_node, None

    def gather(self, node, length):
        """The slots of a match (SGLang's match_prefix leaves this to a second call)."""
        if length == 0:
            return np.zeros((0,), np.int32)
        return np.asarray(self.cache.path_device_indices(node), np.int32)

    def insert(self, key, slots):
        value = slots.astype(np.int64).view(_Tensor)
        return self.cache.insert(
            self.InsertParams(key=self.mod.RadixKey(key), value=value)
        ).prefix_len

    def lock(self, node):
        self.cache.inc_lock_ref(node)

    def unlock(self, node):
        self.cache.dec_lock_ref(node)

    def evict(self, n):
        return self.cache.evict(self.EvictParams(num_tokens=n)).num_tokens_evicted

    def evict_nodes(self, n):
        before = self.freed_nodes
        self.evict(n)
        return self.freed_nodes - before

    def cached_tokens(self):
        return self.cache.total_size()

    def num_nodes(self):
        """O(nodes): SGLang's tree keeps no count."""
        count, stack = 0, [self.cache.root_node]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count - 1


def make_trees(impls, sglang_mod, num_slots, page):
    trees = [Jaxattn(i, num_slots, page) for i in impls]
    if sglang_mod is not None:
        trees.append(SGLang(sglang_mod, num_slots, page))
    return trees


def timed(fn, *args):
    t0 = time.perf_counter_ns()
    out = fn(*args)
    return out, (time.perf_counter_ns() - t0) / 1e3


def stats(xs) -> dict:
    if not xs:
        return dict(median=None, p90=None, n=0)
    return dict(median=float(statistics.median(xs)), p90=float(np.percentile(xs, 90)), n=len(xs))


# --- traces ---------------------------------------------------------------------------


def chat_trace(rng, conversations, turns, system_len):
    """Interleaved conversations; turn t's prompt is the whole history plus a message."""
    system = rng.integers(0, VOCAB, system_len)
    histories = [system.copy() for _ in range(conversations)]
    schedule = np.repeat(np.arange(conversations), turns)
    rng.shuffle(schedule)
    out = []
    for c in schedule:
        user = rng.integers(0, VOCAB, int(rng.lognormal(np.log(100), 0.6)) + 1)
        reply = rng.integers(0, VOCAB, int(rng.lognormal(np.log(250), 0.6)) + 1)
        prompt = np.concatenate([histories[c], user])
        out.append((prompt, np.concatenate([prompt, reply])))
        histories[c] = out[-1][1]
    return out


def next_sequence(rng, seqs, *, tail=(16, 96), max_len=4096):
    """A random prefix of an earlier sequence (or nothing) plus a random tail."""
    base = np.zeros((0,), np.int64)
    if seqs and rng.random() < 0.95:
        base = seqs[rng.integers(len(seqs))]
        base = base[: rng.integers(0, len(base) + 1)][:max_len]
    return np.concatenate([base, rng.integers(0, VOCAB, rng.integers(*tail))])


def serve(tree, prompt, full, times):
    """One request's cache cycle; returns (matched, cached before the insert)."""
    page = tree.pool.page_size
    prompt_key, full_key = tree.key(prompt), tree.key(full)
    (length, node, indices), t = timed(tree.match, prompt_key)
    times["match_prefix"].append(t)
    if indices is None:
        indices, t_gather = timed(tree.gather, node, length)
        t += t_gather
    times["match_prefix+slots"].append(t)
    _, t = timed(tree.lock, node)
    times["inc_lock_ref"].append(t)
    need = len(full) - length
    if tree.pool.available < need:
        _, t = timed(tree.evict, need - tree.pool.available)
        times["evict"].append(t)
    new = tree.pool.alloc(need)
    if new is None:
        raise RuntimeError(f"{tree.name}: pool too small for one request")
    n, t = timed(tree.insert, full_key, np.concatenate([indices, new]))
    times["insert"].append(t)
    aligned = len(full) - len(full) % page
    tree.pool.free(new[: n - length])  # cached meanwhile by another request
    tree.pool.free(new[aligned - length :])  # the partial last page stays with its owner
    _, t = timed(tree.unlock, node)
    times["dec_lock_ref"].append(t)
    return length, n


def run_chat(trees, requests):
    times = {t.name: {k: [] for k in OPS} for t in trees}
    hits = total = 0
    for i, (prompt, full) in enumerate(requests):
        results = set()
        order = trees[i % len(trees) :] + trees[: i % len(trees)]
        for tree in order:
            results.add(serve(tree, prompt, full, times[tree.name]))
        assert len(results) == 1, f"request {i}: trees disagree {results}"
        hits += next(iter(results))[0]
        total += len(prompt)
    return times, hits / total, trees[0].num_nodes()


def run_random(trees, rng, target_nodes, queries):
    times = {t.name: {"insert": [], "match_prefix": [], "match_prefix+slots": []} for t in trees}
    seqs = []
    i = 0
    while trees[0].num_nodes() < target_nodes:
        seq = next_sequence(rng, seqs)
        seqs.append(seq)
        results = set()
        order = trees[i % len(trees) :] + trees[: i % len(trees)]
        for tree in order:
            key = tree.key(seq)
            slots = tree.pool.alloc(len(seq))
            n, t = timed(tree.insert, key, slots)
            times[tree.name]["insert"].append(t)
            aligned = len(seq) - len(seq) % tree.pool.page_size
            tree.pool.free(slots[:n])
            tree.pool.free(slots[aligned:])
            results.add(n)
        assert len(results) == 1, f"insert {i}: trees disagree {results}"
        i += 1
    nodes = trees[0].num_nodes()
    for q in range(queries):
        seq = seqs[rng.integers(len(seqs))]
        probe = np.concatenate([seq[: rng.integers(1, len(seq) + 1)], [VOCAB + q]])
        results = set()
        order = trees[q % len(trees) :] + trees[: q % len(trees)]
        for tree in order:
            (length, node, indices), t = timed(tree.match, tree.key(probe))
            times[tree.name]["match_prefix"].append(t)
            if indices is None:
                _, t_gather = timed(tree.gather, node, length)
                t += t_gather
            times[tree.name]["match_prefix+slots"].append(t)
            results.add(length)
        assert len(results) == 1, f"query {q}: trees disagree {results}"
    return times, nodes


# match_prefix+slots: the match and the slots of the matched prefix, which jaxattn's
# match_prefix returns and SGLang's needs a second call for (path_device_indices).
OPS = ("match_prefix", "match_prefix+slots", "insert", "inc_lock_ref", "dec_lock_ref", "evict")


def ops_rows(trace, page, times, extra):
    rows = []
    names = list(times)
    for op in OPS:
        row = dict(trace=trace, page=page, op=op, **extra)
        for name in names:
            s = stats(times[name].get(op, []))
            row[f"{name}_us"], row[f"{name}_p90_us"] = s["median"], s["p90"]
        if all(row[f"{name}_us"] is None for name in names):
            continue  # an op this trace does not run
        if row.get("native_us") and row.get("sglang_us"):
            row["sglang_over_native"] = row["sglang_us"] / row["native_us"]
        if row.get("native_us") and row.get("python_us"):
            row["python_over_native"] = row["python_us"] / row["native_us"]
        rows.append(row)
    return rows


# --- eviction scaling -----------------------------------------------------------------


def grown_sequences(seed):
    """Endless sequences that grow a tree from shared prefixes: 64 system prompts, then
    short branches off earlier sequences, so that leaves are many (the shape behind slow
    evictions in a scheduler). Each inserts at most 16 new tokens. The same seed gives the
    same sequences; only a bounded sample of earlier ones is kept, so a 1M-node tree needs
    no list of its sequences."""
    rng = np.random.default_rng(seed)
    bases = [rng.integers(0, VOCAB, 256) for _ in range(64)]
    yield from bases
    while True:
        base = bases[rng.integers(len(bases))]
        tail = rng.integers(0, VOCAB, rng.integers(4, 17))
        seq = np.concatenate([base[: rng.integers(1, len(base) + 1)], tail])
        if len(bases) < 8192:
            bases.append(seq)
        else:
            bases[rng.integers(len(bases))] = seq
        yield seq


def build(tree, sequences, count=None, target_nodes=None):
    """Insert sequences until ``count`` of them or ``target_nodes`` nodes; return count."""
    n = 0
    for seq in sequences:
        if n == count or (target_nodes is not None and tree.num_nodes() >= target_nodes):
            break
        slots = tree.pool.alloc(len(seq))
        tree.pool.free(slots[: tree.insert(tree.key(seq), slots)])
        n += 1
    return n


def evict_scaling(impls, sglang_mod, sizes, slow_limit, calls, seed):
    rows = []
    for size in sizes:
        num_slots = 64 * 256 + 16 * size
        count = None
        names = sorted(impls, key=lambda i: i != "native") + (["sglang"] if sglang_mod else [])
        for name in names:
            if name != "native" and size > slow_limit:
                continue
            if name == "sglang":
                tree = SGLang(sglang_mod, num_slots, 1)
            else:
                tree = Jaxattn(name, num_slots, 1)
            t0 = time.perf_counter()
            if count is None:  # the first tree finds how many sequences reach `size` nodes
                count = build(tree, grown_sequences(seed), target_nodes=size)
            else:
                build(tree, grown_sequences(seed), count=count)
            built = time.perf_counter() - t0
            nodes, tokens = tree.num_nodes(), tree.cached_tokens()
            gc.collect()
            per_call, per_leaf = [], []
            for _ in range(calls):
                t0 = time.perf_counter_ns()
                freed = tree.evict_nodes(1)
                t = (time.perf_counter_ns() - t0) / 1e3
                per_call.append(t)
                per_leaf.append(t / max(1, freed))
            t0 = time.perf_counter_ns()
            leaves_big = tree.evict_nodes(tokens // 100)
            t_big = (time.perf_counter_ns() - t0) / 1e3
            rows.append(
                dict(
                    impl=name,
                    nodes=nodes,
                    build_s=built,
                    evict_one_us=stats(per_call)["median"],
                    evict_one_p90_us=stats(per_call)["p90"],
                    per_leaf_us=stats(per_leaf)["median"],
                    evict_1pct_leaves=leaves_big,
                    evict_1pct_ms=t_big / 1e3,
                    evict_1pct_per_leaf_us=t_big / max(1, leaves_big),
                )
            )
            print(
                f"  evict {name:7s} {nodes:8d} nodes (built in {built:5.1f} s): "
                f"{rows[-1]['evict_one_us']:8.1f} µs / call of one leaf, "
                f"{rows[-1]['evict_1pct_per_leaf_us']:6.2f} µs / leaf freeing 1%",
                flush=True,
            )
            del tree
            gc.collect()
    return rows


# --- memory ---------------------------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_child(impl, page, num_seqs, seed, sglang_dir):
    """Runs in its own process: the growth of its resident set while a tree is built."""
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(num_seqs):
        seqs.append(next_sequence(rng, seqs))
    num_slots = sum(len(s) for s in seqs) + page
    num_slots -= num_slots % page
    mod = load_sglang(Path(sglang_dir)) if impl == "sglang" else None
    tree = SGLang(mod, num_slots, page) if mod else Jaxattn(impl, num_slots, page)
    keys = [tree.key(s) for s in seqs]
    # Arrays sized by the pool (its free list, the trees' slot masks) are filled lazily by
    # the kernel; one sequence over every slot, evicted again, faults them all in first, so
    # the growth below is the nodes' alone.
    warm = np.arange(VOCAB, VOCAB + num_slots)
    tree.insert(tree.key(warm), tree.pool.alloc(num_slots))
    tree.evict(num_slots)
    assert tree.cached_tokens() == 0 and tree.pool.available == num_slots
    gc.collect()
    before = rss_bytes()
    for seq, key in zip(seqs, keys, strict=True):
        slots = tree.pool.alloc(len(seq))
        n = tree.insert(key, slots)
        tree.pool.free(slots[:n])
        tree.pool.free(slots[len(seq) - len(seq) % page :])
    gc.collect()
    grown = rss_bytes() - before
    info = dict(impl=impl, page=page, nodes=tree.num_nodes(), tokens=tree.cached_tokens())
    if impl == "native":  # the C++ tree's own count of its structures, for comparison
        info["self_reported_bytes"] = tree.cache.memory_bytes()
    print(json.dumps(dict(**info, bytes=grown)))


def memory(impls, sglang_dir, pages, num_seqs, seed):
    rows = []
    for page in pages:
        for impl in [*impls, *(["sglang"] if sglang_dir else [])]:
            cmd = [sys.executable, __file__, "--memory-child", impl, str(page), str(num_seqs)]
            cmd += ["--seed", str(seed)] + (["--sglang-dir", str(sglang_dir)] if sglang_dir else [])
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            r["bytes_per_node"] = r["bytes"] / r["nodes"]
            r["bytes_per_token"] = r["bytes"] / r["tokens"]
            if "self_reported_bytes" in r:
                r["self_reported_per_node"] = r["self_reported_bytes"] / r["nodes"]
            rows.append(r)
            print(
                f"  memory {impl:7s} page {page:2d}: {r['bytes_per_node']:.0f} B/node", flush=True
            )
    return rows


# --- main -----------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sglang-dir", type=Path, default=None, help="unpacked SGLang wheel")
    p.add_argument("--pages", default="1,16")
    p.add_argument("--conversations", type=int, default=100)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-len", type=int, default=4096)
    p.add_argument("--random-nodes", type=int, default=100_000)
    p.add_argument("--queries", type=int, default=2000)
    p.add_argument("--evict-sizes", default="10000,100000,1000000")
    p.add_argument("--evict-calls", type=int, default=200)
    p.add_argument(
        "--slow-limit", type=int, default=100_000, help="largest tree for the Python trees"
    )
    p.add_argument(
        "--memory-seqs", type=int, default=60_000, help="sequences inserted (~100k nodes)"
    )
    p.add_argument("--parts", default="ops,evict,memory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--memory-child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.memory_child:
        impl, page, num_seqs = args.memory_child
        memory_child(impl, int(page), int(num_seqs), args.seed, args.sglang_dir)
        return

    from common import environment, table, write_json

    impls = ["python", *(["native"] if native_tree.is_available() else [])]
    if "native" not in impls:
        print(f"native tree not available: {native_tree.LOAD_ERROR}")
    sglang_mod = load_sglang(args.sglang_dir) if args.sglang_dir else None
    pages = [int(x) for x in args.pages.split(",")]
    parts = set(args.parts.split(","))
    out = dict(env=environment(), args=vars(args), ops=[], evict=[], memory=[])

    if "ops" in parts:
        for page in pages:
            rng = np.random.default_rng(args.seed)
            requests = chat_trace(rng, args.conversations, args.turns, args.system_len)
            slots = 2 * sum(len(f) for _, f in requests) + 64 * page
            trees = make_trees(impls, sglang_mod, slots - slots % page, page)
            times, hit, nodes = run_chat(trees, requests)
            print(f"  chat page {page}: {len(requests)} requests, hit {hit:.1%}, {nodes} nodes")
            extra = dict(requests=len(requests), hit_rate=hit, nodes=nodes)
            out["ops"] += ops_rows("chat", page, times, extra)
            trees = make_trees(impls, sglang_mod, 40_000_000 - 40_000_000 % page, page)
            times, nodes = run_random(trees, rng, args.random_nodes, args.queries)
            print(f"  random page {page}: {nodes} nodes")
            out["ops"] += ops_rows("random", page, times, dict(nodes=nodes))
            del trees
            gc.collect()
    if "evict" in parts:
        sizes = [int(x) for x in args.evict_sizes.split(",")]
        out["evict"] = evict_scaling(
            impls, sglang_mod, sizes, args.slow_limit, args.evict_calls, args.seed
        )
    if "memory" in parts:
        out["memory"] = memory(impls, args.sglang_dir, pages, args.memory_seqs, args.seed)

    cols = [("trace", "trace", ""), ("page", "page", "d"), ("op", "op", "")]
    for name in [*impls, *(["sglang"] if sglang_mod else [])]:
        cols += [(f"{name}_us", f"{name} µs", ".2f"), (f"{name}_p90_us", "p90", ".2f")]
    if "native" in impls:
        cols += [("python_over_native", "python / native", ".1f")]
    if sglang_mod and "native" in impls:
        cols += [("sglang_over_native", "sglang / native", ".1f")]
    print()
    print(table(out["ops"], cols))
    print()
    print(
        table(
            out["evict"],
            [
                ("impl", "impl", ""),
                ("nodes", "nodes", "d"),
                ("evict_one_us", "evict 1 leaf µs", ".1f"),
                ("evict_one_p90_us", "p90", ".1f"),
                ("evict_1pct_leaves", "1% of tokens: leaves", "d"),
                ("evict_1pct_ms", "ms", ".2f"),
                ("evict_1pct_per_leaf_us", "µs / leaf", ".2f"),
            ],
        )
    )
    print()
    print(
        table(
            out["memory"],
            [
                ("impl", "impl", ""),
                ("page", "page", "d"),
                ("nodes", "nodes", "d"),
                ("bytes_per_node", "B / node", ".0f"),
                ("bytes_per_token", "B / cached token", ".1f"),
                ("self_reported_per_node", "C++ self-count B / node", ".0f"),
            ],
        )
    )
    write_json(args.json, out)


if __name__ == "__main__":
    main()
