# Source of radix_cache.ipynb; build with `python examples/notebooks/build.py`.
# ruff: noqa: E402

# %% [markdown]
# # The radix prefix cache
#
# What SGLang-style prefix caching (`jaxattn.radix.RadixCache` over a `TokenPool`) saves,
# and how it gives memory back:
#
# 1. **Hit rate and prefill saved against pool size** on three request traces: multi-turn
#    chat (each turn resends the whole conversation), few-shot prompting (a handful of
#    long shared prefixes, plus one-off documents that share nothing) and tree search
#    (many branches grown from common reasoning paths).
# 2. **LRU against LFU** eviction on each of them.
# 3. **Eviction leaf by leaf** on a small tree printed before, during and after: only
#    unlocked leaves go, and a parent becomes a candidate only once its last child is gone.
#
# Every request runs the cache cycle a server runs, without a model: match the prompt,
# lock the matched path, allocate slots for the rest (evicting when the pool is short),
# then insert prompt + output and unlock. Tokens matched are prefill tokens not computed.

# %%
import pathlib
import sys
import time

import numpy as np

ROOT = next(
    p for p in (pathlib.Path.cwd(), *pathlib.Path.cwd().parents) if (p / "pyproject.toml").is_file()
)
try:
    from jaxattn.radix import RadixCache, TokenPool
except ImportError:  # a source checkout that was not pip-installed
    sys.path.insert(0, str(ROOT))
    from jaxattn.radix import RadixCache, TokenPool
import matplotlib.pyplot as plt
from IPython.display import Markdown, display

plt.rcParams.update({"figure.dpi": 80, "axes.grid": True, "grid.alpha": 0.3})
T0 = time.perf_counter()

# %% [markdown]
# ## Three traces
#
# Token ids are drawn from a counter, so unrelated text never matches by accident; only
# the structure of each workload creates shared prefixes.
#
# * **multi-turn chat**: 48 conversations of 2 to 8 turns behind one 300-token system
#   prompt; user messages ~60 tokens, answers ~150. Turns of different conversations
#   interleave at random, so a conversation comes back after many others.
# * **few-shot**: 8 tasks, each a 1000-token few-shot prefix, picked with Zipf popularity
#   and followed by a ~40-token question; a quarter of the requests are one-off
#   ~800-token documents that share nothing with anything.
# * **tree search**: 6 problems (400-token statement each) explored to depth 4 with
#   branching 3: every request extends one node of the tree by a ~60-token step,
#   picked at random from the frontier, the problems interleaved.


# %%
class Fresh:
    """Token ids never used before."""

    def __init__(self):
        self.next = 0

    def __call__(self, n):
        out = np.arange(self.next, self.next + n, dtype=np.int64)
        self.next += n
        return out


def length(rng, mean, sigma=0.5):
    return max(1, int(rng.lognormal(np.log(mean) - sigma**2 / 2, sigma)))


def chat_trace(rng, fresh, conversations=48, turns=(2, 8), system=300):
    system_prompt = fresh(system)
    history = [system_prompt] * conversations
    left = list(rng.integers(turns[0], turns[1] + 1, size=conversations))
    trace = []
    while any(left):
        c = rng.choice(np.flatnonzero(left))
        prompt = np.concatenate([history[c], fresh(length(rng, 60))])
        output = fresh(length(rng, 150))
        trace.append((prompt, output))
        history[c] = np.concatenate([prompt, output])
        left[c] -= 1
    return trace


def few_shot_trace(rng, fresh, requests=400, tasks=8, shots=1000, one_off=0.25):
    prefixes = [fresh(shots) for _ in range(tasks)]
    popularity = 1.0 / np.arange(1, tasks + 1) ** 1.1
    trace = []
    for _ in range(requests):
        if rng.random() < one_off:
            trace.append((fresh(length(rng, 800)), fresh(length(rng, 40))))
        else:
            t = rng.choice(tasks, p=popularity / popularity.sum())
            trace.append(
                (np.concatenate([prefixes[t], fresh(length(rng, 40))]), fresh(length(rng, 30)))
            )
    return trace


def tree_search_trace(rng, fresh, problems=6, statement=400, depth=4, branching=3, step=60):
    # frontier entries: [path tokens, depth, children generated so far]
    frontier = [[fresh(statement), 0, 0] for _ in range(problems)]
    trace = []
    while frontier:
        i = rng.integers(len(frontier))
        node = frontier[i]
        path, d, _ = node
        output = fresh(length(rng, step))
        trace.append((path, output))
        node[2] += 1
        if node[2] == branching:
            frontier.pop(i)
        if d + 1 < depth:
            frontier.append([np.concatenate([path, output]), d + 1, 0])
    return trace


rng = np.random.default_rng(0)
TRACES = {
    "multi-turn chat": chat_trace(rng, Fresh()),
    "few-shot": few_shot_trace(rng, Fresh()),
    "tree search": tree_search_trace(rng, Fresh()),
}


# %% [markdown]
# ## Serving a trace
#
# One request at a time, through the full cycle. `insert` returns how many leading tokens
# were cached before it; the request's own slots for those positions are duplicates and
# go back to the pool. The pool must hold at least the longest request.


# %%
def serve(trace, pool_size, eviction):
    pool = TokenPool(pool_size)
    cache = RadixCache(pool, eviction=eviction)
    matched = evicted = 0
    for prompt, output in trace:
        m = cache.match_prefix(prompt)
        cache.inc_lock_ref(m.node)
        need = len(prompt) + len(output) - m.length
        if pool.available < need:
            evicted += cache.evict(need - pool.available)
        new = pool.alloc(need)
        assert new is not None, "the pool is smaller than one request"
        slots = np.concatenate([m.indices, new])
        cached = cache.insert(np.concatenate([prompt, output]), slots)
        pool.free(slots[m.length : cached])  # positions someone else cached meanwhile
        cache.dec_lock_ref(m.node)
        matched += m.length
    cache.check_invariants()
    return dict(matched=matched, evicted=evicted, cached=cache.total_size)


lines = [
    "| trace | requests | prompt tokens | longest request | distinct tokens |",
    "| --- | --- | --- | --- | --- |",
]
INFO = {}
for name, trace in TRACES.items():
    INFO[name] = dict(
        requests=len(trace),
        prompt_tokens=sum(len(p) for p, _ in trace),
        longest=max(len(p) + len(o) for p, o in trace),
    )
    # What an unbounded cache ends up holding: the working set of the trace.
    unbounded = sum(len(p) + len(o) for p, o in trace)
    INFO[name]["distinct"] = serve(trace, unbounded, "lru")["cached"]
    i = INFO[name]
    lines.append(
        f"| {name} | {i['requests']} | {i['prompt_tokens']} | {i['longest']} | {i['distinct']} |"
    )
display(Markdown("\n".join(lines)))


POLICIES = ("lru", "lfu")
RUNS = {}
for name, trace in TRACES.items():
    info = INFO[name]
    pools = np.unique(np.geomspace(info["longest"] * 1.05, info["distinct"] * 1.05, 9).astype(int))
    for pool_size in pools:
        for policy in POLICIES:
            r = serve(trace, int(pool_size), policy)
            RUNS[name, int(pool_size), policy] = dict(
                r, hit_rate=r["matched"] / info["prompt_tokens"]
            )
print(f"{len(RUNS)} runs in {time.perf_counter() - T0:.1f} s")

# %%
fig, axes = plt.subplots(2, 3, figsize=(13, 6.4), sharex="col")
for col, name in enumerate(TRACES):
    info = INFO[name]
    pools = sorted({p for (n, p, _) in RUNS if n == name})
    x = np.array(pools) / info["distinct"]
    for policy, color in zip(POLICIES, ("C0", "C3"), strict=True):
        runs = [RUNS[name, p, policy] for p in pools]
        axes[0, col].plot(
            x, [r["hit_rate"] for r in runs], marker="o", color=color, label=policy.upper()
        )
        axes[1, col].plot(
            x,
            [r["matched"] / 1e3 for r in runs],
            marker="o",
            color=color,
            label=f"{policy.upper()}: prefill tokens saved",
        )
    ceiling = RUNS[name, pools[-1], "lru"]["hit_rate"]
    axes[0, col].axhline(ceiling, color="k", ls=":", lw=1, label="unbounded cache")
    axes[1, col].axhline(
        info["prompt_tokens"] / 1e3, color="k", ls="--", lw=1, label="prompt tokens (no cache)"
    )
    axes[0, col].set(title=name, ylim=(0, 1.02))
    axes[1, col].set(xscale="log", xlabel="pool size / distinct tokens of the trace")
    axes[1, col].set_ylim(bottom=0)
axes[0, 0].set_ylabel("prefix hit rate (tokens)")
axes[1, 0].set_ylabel("thousand tokens")
axes[0, 0].legend(fontsize=8)
axes[1, 0].legend(fontsize=7, loc="center right")
fig.tight_layout()

# %%
for name in TRACES:
    info = INFO[name]
    pools = sorted({p for (n, p, _) in RUNS if n == name})
    lines = [
        f"**{name}** ({info['prompt_tokens']} prompt tokens)\n",
        "| pool slots | pool / distinct | LRU hit rate | LFU hit rate | LRU saved | LFU saved "
        "| LRU evicted | LFU evicted |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in pools:
        a, b = RUNS[name, p, "lru"], RUNS[name, p, "lfu"]
        lines.append(
            f"| {p} | {p / info['distinct']:.2f} | {a['hit_rate']:.1%} | {b['hit_rate']:.1%} | "
            f"{a['matched']} | {b['matched']} | {a['evicted']} | {b['evicted']} |"
        )
    display(Markdown("\n".join(lines)))

# %% [markdown]
# ## Eviction, leaf by leaf
#
# A small tree over character tokens, so that edges print as text. Eight requests have
# been served, "The dog ran home" three times; the request for "A bird sang" is still
# running, so its path is locked. `evict(1)` frees the single best candidate (at least one
# token, always a whole node); calling it repeatedly shows the order. Each node prints its
# edge, then `lock` (running requests through it), `t` (last access) and `hits`; `*` marks
# the current candidates, the unlocked leaves.


# %%
def show(cache, title):
    root = cache.match_prefix([]).node  # the empty prefix ends at the root
    print(title)

    def walk(node, indent):
        for child in sorted(node.children.values(), key=lambda c: c.key[0]):
            text = "".join(map(chr, child.key))
            mark = "*" if not child.children and child.lock_ref == 0 else " "
            print(
                f"  {mark} {indent}{text!r:24} lock={child.lock_ref} t={child.last_access:<3d} "
                f"hits={child.hit_count}"
            )
            walk(child, indent + "    ")

    walk(root, "")
    print(
        f"    cached {cache.total_size} tokens: {cache.evictable_size} evictable, "
        f"{cache.protected_size} locked; pool free {cache.pool.available}\n"
    )


def request(cache, text, *, running=False):
    tokens = np.array([ord(c) for c in text])
    m = cache.match_prefix(tokens)
    cache.inc_lock_ref(m.node)
    new = cache.pool.alloc(len(tokens) - m.length)
    cache.insert(tokens, np.concatenate([m.indices, new]))
    if running:  # still decoding: keep the whole path pinned
        cache.inc_lock_ref(cache.match_prefix(tokens).node)
    cache.dec_lock_ref(m.node)


def small_tree(eviction):
    cache = RadixCache(TokenPool(200), eviction=eviction)
    for text in (
        "The cat sat on the mat",
        "The cat ate the fish",
        "The dog ran home",
        "The cat ate the fish again",
        "The dog ran home",
        "The dog ran home",
        "A bird sang",
        "The cat sat on the mat",
    ):
        request(cache, text, running=text == "A bird sang")
    return cache


def evict_one_by_one(cache, steps=100):
    for _ in range(steps):
        root = cache.match_prefix([]).node
        nodes, stack = [], list(root.children.values())
        while stack:
            n = stack.pop()
            nodes.append((n, "".join(map(chr, n.key))))
            stack.extend(n.children.values())
        freed = cache.evict(1)
        if not freed:
            print("  evict(1) -> 0: nothing evictable is left")
            break
        gone = [text for n, text in nodes if not n.alive]
        print(f"  evict(1) -> freed {freed:2d} tokens: {', '.join(map(repr, gone))}")


cache = small_tree("lru")
show(cache, "before eviction (LRU):")
evict_one_by_one(cache, 3)
print()
show(cache, "after three evict(1) calls:")
evict_one_by_one(cache)
print()
show(cache, "after evicting everything evictable:")

# %% [markdown]
# The same tree under LFU: the leaf hit least often goes first, recency only breaks ties,
# so the thrice-asked "dog ran home" now outlives the more recent "sat on the mat".
# Under both policies only leaves go, the locked path stays whatever its age, and an
# inner edge (`'ate the fish'`, `'cat '`, `'The '`) becomes a candidate only once its last
# child is gone.

# %%
cache = small_tree("lfu")
show(cache, "before eviction (LFU):")
evict_one_by_one(cache)

# %% [markdown]
# ## Conclusions


# %%
def at_fraction(name, policy, fraction):
    """Hit rate of the run whose pool is closest to ``fraction`` of the distinct tokens."""
    pools = sorted({p for (n, p, _) in RUNS if n == name})
    p = min(pools, key=lambda p: abs(np.log(p / (fraction * INFO[name]["distinct"]))))
    return RUNS[name, p, policy]["hit_rate"], p / INFO[name]["distinct"]


def lead(name):
    """Mean hit-rate lead of LFU over LRU, in points, over the pools that force evictions."""
    pools = sorted({p for (n, p, _) in RUNS if n == name})[:-1]
    return 100 * np.mean(
        [RUNS[name, p, "lfu"]["hit_rate"] - RUNS[name, p, "lru"]["hit_rate"] for p in pools]
    )


parts = []
for name in TRACES:
    full = at_fraction(name, "lru", 1.05)[0]
    (lru, frac), (lfu, _) = at_fraction(name, "lru", 0.2), at_fraction(name, "lfu", 0.2)
    parts.append(
        f"{name} {full:.0%} with room for everything, {lru:.0%} (LRU) / {lfu:.0%} (LFU) "
        f"with a pool of {frac:.2f}x its distinct tokens"
    )
leads = {name: lead(name) for name in TRACES}
policy_text = "; ".join(
    f"{'LFU' if x > 0 else 'LRU'} leads on {name} by {abs(x):.1f} points"
    for name, x in leads.items()
)
text = (
    "Prefix hit rate (the share of prompt tokens whose prefill is skipped): "
    + "; ".join(parts)
    + f". Averaged over the pools that force evictions, {policy_text}"
)
if leads["multi-turn chat"] < 0 < leads["few-shot"]:
    text += (
        ": recency suits conversations that come back, frequency shields popular shared "
        "prefixes from one-off documents"
    )
text += (
    ". Eviction only removes unlocked leaves, shrinking the tree from the outside in, so a "
    "running request never loses the KV it reads."
)
display(Markdown(text))
print(
    f"cells executed in {time.perf_counter() - T0:.0f} s ({time.process_time():.0f} s of CPU time)"
)
