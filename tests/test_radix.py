"""TokenPool / RadixCache: unit cases and a stateful property test against a token-level
model (a dict from every cached prefix to the slot of its last token), run on both
implementations (the Python spec and the C++ tree)."""

from __future__ import annotations

import os
import subprocess
import sys

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxattn.radix import RadixCache, TokenPool, default_impl, native_tree

NATIVE = native_tree.is_available()
if not NATIVE and os.environ.get("JAXATTN_REQUIRE_NATIVE") == "1":
    raise RuntimeError(f"JAXATTN_REQUIRE_NATIVE=1 but {native_tree.LOAD_ERROR}")
needs_native = pytest.mark.skipif(not NATIVE, reason="the native radix tree is not built")
IMPLS = ["python", pytest.param("native", marks=needs_native)]


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param


def test_host_structures_import_without_jax():
    code = (
        "import sys; import jaxattn.radix; from jaxattn.paging import BlockManager; "
        "import jaxattn; jaxattn.radix.RadixCache(jaxattn.radix.TokenPool(8)); "
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_lazy_public_names_still_resolve():
    import jaxattn

    for name in jaxattn.__all__:
        assert getattr(jaxattn, name) is not None, name
    assert jaxattn.paging.PageTable is not None and jaxattn.ops is not None


def test_default_impl_is_visible():
    cache = RadixCache(TokenPool(8))
    assert cache.impl == default_impl() == ("native" if NATIVE else "python")
    assert RadixCache(TokenPool(8), impl="python").impl == "python"
    with pytest.raises(ValueError, match="impl"):
        RadixCache(TokenPool(8), impl="rust")


# --- TokenPool -----------------------------------------------------------------------


def test_token_pool_alloc_free():
    pool = TokenPool(8)
    a = pool.alloc(3)
    assert a.dtype == np.int32 and a.tolist() == [0, 1, 2] and pool.available == 5
    assert pool.alloc(6) is None and pool.available == 5  # nothing taken on failure
    b = pool.alloc(5)
    assert sorted(np.concatenate([a, b]).tolist()) == list(range(8))
    assert pool.alloc(0).shape == (0,) and pool.alloc(1) is None
    pool.free(a)
    assert pool.available == 3
    pool.check_invariants()


def test_token_pool_misuse_raises_and_changes_nothing():
    pool = TokenPool(8)
    a = pool.alloc(4)
    pool.free(a[:2])
    state = (pool._stack.copy(), pool._num_free, pool._used.copy())
    for bad, exc, msg in [
        (a[:3], ValueError, "already free"),  # one slot is free: nothing is freed
        ([a[2], a[2]], ValueError, "twice"),
        ([8], ValueError, r"\[0, 8\)"),
        ([-1], ValueError, r"\[0, 8\)"),
        ([[2, 3]], ValueError, "1-D"),
        ([2.0], TypeError, "integers"),
    ]:
        with pytest.raises(exc, match=msg):
            pool.free(bad)
        assert pool._num_free == state[1] and (pool._used == state[2]).all()
    with pytest.raises(ValueError, match="n must"):
        pool.alloc(-1)
    with pytest.raises(ValueError, match="multiple"):
        TokenPool(10, page_size=4)
    pool.check_invariants()


def test_token_pool_pages():
    pool = TokenPool(16, page_size=4)
    a = pool.alloc(6)
    assert a.tolist() == [0, 1, 2, 3, 4, 5] and pool.available == 8  # two whole pages
    b = pool.alloc(1)
    assert b.tolist() == [8]
    pool.free(a[4:])  # frees the page of slots 4..7
    assert pool.available == 8
    assert pool.alloc(4).tolist() == [4, 5, 6, 7]
    pool.check_invariants()


# --- RadixCache unit cases -----------------------------------------------------------


def cache_with(tokens_list, *, num_slots=64, page_size=1, impl="python", **kw):
    pool = TokenPool(num_slots, page_size=page_size)
    cache = RadixCache(pool, page_size=page_size, impl=impl, **kw)
    for tokens in tokens_list:
        slots = pool.alloc(len(tokens))
        n = cache.insert(tokens, slots)
        pool.free(slots[:n])
        pool.free(slots[len(tokens) - len(tokens) % page_size :])
    return pool, cache


def test_split_inside_an_edge(impl):
    """Design notes part 2.2: "ABCDEF" cached, "ABCXYZ" arrives."""
    A, B, C, D, E, F, X, Y, Z = range(1, 10)
    pool, cache = cache_with([[A, B, C, D, E, F]], impl=impl)
    assert cache.num_nodes == 1
    full = cache.match_prefix([A, B, C, D, E, F]).indices
    m = cache.match_prefix([A, B, C, X, Y, Z])
    assert m.length == 3 and m.indices.tolist() == full[:3].tolist()
    assert cache.num_nodes == 2 and m.node.key.tolist() == [A, B, C]
    new = pool.alloc(3)
    assert cache.insert([A, B, C, X, Y, Z], np.concatenate([m.indices, new])) == 3
    assert cache.num_nodes == 3 and len(m.node.children) == 2
    assert cache.match_prefix([A, B, C, X, Y, Z]).indices.tolist() == [*full[:3], *new]
    assert cache.match_prefix([A, B, C, D, E, F]).indices.tolist() == full.tolist()
    assert cache.total_size == 9 and pool.available == 64 - 9
    cache.check_invariants()


def test_insert_returns_already_cached_length_and_caller_frees_duplicates(impl):
    pool, cache = cache_with([[1, 2, 3, 4]], impl=impl)
    mine = pool.alloc(6)
    n = cache.insert([1, 2, 3, 4, 5, 6], mine)
    assert n == 4
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).indices[4:].tolist() == mine[4:].tolist()
    pool.free(mine[:n])  # the tree kept its own slots for the first four tokens
    assert pool.available + cache.total_size == 64
    again = pool.alloc(2)
    assert cache.insert([1, 2], again) == 2 and cache.total_size == 6
    pool.free(again)
    cache.check_invariants()


def test_match_refreshes_recency_for_lru(impl):
    pool, cache = cache_with([[1, 1, 1], [2, 2, 2]], impl=impl)
    cache.match_prefix([1, 1, 1])  # [2,2,2] is now the least recently used
    assert cache.evict(1) == 3
    assert cache.prefix_len([2, 2, 2]) == 0 and cache.prefix_len([1, 1, 1]) == 3


def test_lfu_evicts_fewest_hits_first(impl):
    for policy, survivor in [("lru", [1, 1]), ("lfu", [2, 2])]:
        pool, cache = cache_with([[1, 1], [2, 2]], eviction=policy, impl=impl)
        for _ in range(3):
            cache.match_prefix([2, 2])
        cache.match_prefix([1, 1])  # most recent, but fewer hits
        assert cache.evict(1) == 2
        assert cache.prefix_len(survivor) == 2, policy
        cache.check_invariants()


def test_evicts_leaves_before_parents_and_parents_once_they_become_leaves(impl):
    pool, cache = cache_with([[1, 2, 3], [1, 2, 4], [1, 5]], impl=impl)
    # Tree: [1] -> {[2] -> {[3], [4]}, [5]}; touch the shared branch so [5] is oldest.
    cache.match_prefix([1, 2, 3])
    cache.match_prefix([1, 2, 4])
    assert cache.evict(1) == 1 and cache.prefix_len([1, 5]) == 1
    assert cache.evict(2) == 2  # the two leaves [3] and [4], not their parent [2]
    assert cache.prefix_len([1, 2]) == 2
    assert cache.evict(2) == 2  # now [2], then [1] once it has become a leaf
    assert cache.total_size == 0 and pool.available == 64
    assert cache.evict(5) == 0
    cache.check_invariants()


def test_eviction_heap_stays_bounded_and_copies_on_split():
    """Every touch of a leaf leaves a stale heap entry behind; they are dropped in bulk, so
    the heap stays within twice the candidates (plus a constant). Split halves own their
    arrays, so an evicted half frees its memory."""
    pool, cache = cache_with([[1, 2, 3, 4], [5, 6]], num_slots=64)
    for _ in range(1000):
        cache.match_prefix([1, 2, 3, 4])
        cache.match_prefix([5, 6])
    assert len(cache._heap) <= 2 * len(cache._evictable_leaves) + 64
    m = cache.match_prefix([1, 2, 9])
    lower = m.node.children[3]
    assert m.node.key.base is None and lower.key.base is None
    assert m.node.value.base is None and lower.value.base is None
    cache.check_invariants()


def test_locked_nodes_are_never_evicted(impl):
    pool, cache = cache_with([[1, 2, 3, 4], [1, 2, 7, 8], [9]], impl=impl)
    m = cache.match_prefix([1, 2, 3])
    assert cache.inc_lock_ref(m.node) == 3
    assert cache.protected_size == 3 and cache.evictable_size == 1 + 2 + 1
    assert cache.evict(100) == 4  # [4], [7, 8], [9]; [1, 2] and [3] stay
    assert cache.prefix_len([1, 2, 3, 4]) == 3
    assert cache.dec_lock_ref(m.node) == -3
    assert cache.evictable_size == 3 and cache.evict(100) == 3
    with pytest.raises(ValueError, match="evicted"):
        cache.inc_lock_ref(m.node)
    cache.check_invariants()


def test_namespaces_never_share_kv(impl):
    pool, cache = cache_with([[1, 2, 3]], impl=impl)
    slots = pool.alloc(3)
    assert cache.insert([1, 2, 3], slots, namespace="lora-7") == 0
    assert cache.match_prefix([1, 2, 3], namespace="lora-7").indices.tolist() == slots.tolist()
    assert cache.match_prefix([1, 2, 3]).indices.tolist() != slots.tolist()
    assert cache.match_prefix([1, 2, 3], namespace="other").length == 0
    assert cache.total_size == 6
    m = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(m.node)
    assert cache.evict(100) == 3
    assert "lora-7" not in cache._roots  # an emptied namespace leaves nothing behind
    cache.check_invariants()


def test_page_aligned_matching_and_insertion(impl):
    pool, cache = cache_with([[1, 2, 3, 4, 5]], page_size=2, impl=impl)
    assert cache.total_size == 4  # the partial last page stays with the caller
    assert pool.available == 64 - 4
    assert cache.match_prefix([1, 2, 3, 4, 5]).length == 4
    m = cache.match_prefix([1, 2, 3, 9])  # mismatch inside the second page
    assert m.length == 2 and m.node.key.tolist() == [1, 2]
    assert cache.prefix_len([1, 9]) == 0 and cache.prefix_len([1]) == 0
    slots = m.indices
    assert slots[1] == slots[0] + 1 and slots[0] % 2 == 0  # a whole page
    new = pool.alloc(4)
    assert cache.insert([1, 2, 3, 9, 5, 6, 7], np.concatenate([m.indices, new, [0]])[:7]) == 2
    pool.free(new[4:])
    assert cache.total_size == 8
    cache.check_invariants()
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(TokenPool(8, page_size=4), page_size=2, impl=impl)


def test_long_edges(impl):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32000, 32768)
    pool, cache = cache_with([tokens], num_slots=65536, impl=impl)
    other = tokens.copy()
    other[-1] += 1
    assert cache.match_prefix(other).length == 32767
    other[12345] += 1
    assert cache.prefix_len(other) == 12345


def test_prefix_len_changes_nothing(impl):
    pool, cache = cache_with([[1, 2, 3, 4]], impl=impl)
    nodes, clock = cache.num_nodes, cache._clock
    assert cache.prefix_len([1, 2, 9]) == 2
    assert (cache.num_nodes, cache._clock) == (nodes, clock)


def test_reset(impl):
    pool, cache = cache_with([[1, 2, 3], [4, 5]], impl=impl)
    m = cache.match_prefix([1, 2])
    cache.inc_lock_ref(m.node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    assert cache.total_size == 5
    cache.dec_lock_ref(m.node)
    cache.reset()
    assert cache.total_size == 0 and pool.available == 64 and cache.num_nodes == 0
    with pytest.raises(ValueError, match="evicted or reset"):
        cache.inc_lock_ref(m.node)
    cache.check_invariants()


def test_misuse_raises_and_changes_nothing(impl):
    pool, cache = cache_with([[1, 2, 3]], impl=impl)
    held = cache.match_prefix([1, 2, 3]).indices
    spare = pool.alloc(2)
    free_slot = int(np.flatnonzero(~pool._used)[0])
    before = (sorted(map(repr, cache.cached_sequences())), pool.available, cache.num_nodes)
    cases = [
        (lambda: cache.insert([1, 2, 3, 4], [0, 1]), ValueError, "2 slots for 4 tokens"),
        (lambda: cache.insert([5, 6], held[:2]), ValueError, "already held"),
        (lambda: cache.insert([5, 6], [spare[0], spare[0]]), ValueError, "twice"),
        (lambda: cache.insert([5], [free_slot]), ValueError, "free in the pool"),
        (lambda: cache.insert([5], [64]), ValueError, r"\[0, 64\)"),
        (lambda: cache.insert([[5]], [[1]]), ValueError, "tokens must be 1-D"),
        (lambda: cache.insert([5.0], [1]), TypeError, "tokens"),
        (lambda: cache.match_prefix([0.5]), TypeError, "tokens"),
        (lambda: cache.dec_lock_ref(cache.match_prefix([1]).node), ValueError, "not locked"),
        (lambda: cache.inc_lock_ref("node"), TypeError, "node"),
        (lambda: cache.evict(-1), ValueError, "num_tokens"),
    ]
    other_pool, other = cache_with([[1]], impl=impl)
    cases.append((lambda: cache.inc_lock_ref(other.match_prefix([1]).node), ValueError, "another"))
    for fn, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fn()
        after = (sorted(map(repr, cache.cached_sequences())), pool.available, cache.num_nodes)
        # match_prefix([1]) above may split the edge; the cached content stays the same.
        assert after[:2] == before[:2], msg
        cache.check_invariants()
    with pytest.raises(ValueError, match="eviction"):
        RadixCache(pool, eviction="fifo", impl=impl)


# --- stateful property test ----------------------------------------------------------

TOKENS = st.lists(st.integers(0, 2), max_size=10)
NAMESPACES = st.sampled_from([None, "a"])


class RadixMachine(RuleBasedStateMachine):
    """The model keeps, per namespace, every cached page-aligned prefix (as a tuple) with the
    slots of its last page, its lock count, its recency and its hit count. Every tree path
    is such a prefix set, so matches, sizes, locks and eviction order are all checked page
    by page (token by token when PAGE == 1)."""

    NUM_SLOTS = 40
    PAGE = 1
    POLICY = "lru"
    IMPL = "python"

    def __init__(self):
        super().__init__()
        self.pool = TokenPool(self.NUM_SLOTS, page_size=self.PAGE)
        self.cache = RadixCache(
            self.pool, page_size=self.PAGE, eviction=self.POLICY, impl=self.IMPL
        )
        self.slots: dict[tuple, tuple] = {}  # (namespace, *tokens[:k * PAGE]) -> last page
        self.lock: dict[tuple, int] = {}
        self.time: dict[tuple, int] = {}
        self.hits: dict[tuple, int] = {}
        self.clock = 0
        self.locks: list[tuple] = []  # (node, namespace, locked prefix)

    # model helpers
    def keys(self, ns, tokens, n):
        """Model keys of the first ``n`` (page-aligned) tokens."""
        return [(ns, *tokens[:end]) for end in range(self.PAGE, n + 1, self.PAGE)]

    def aligned(self, tokens):
        return len(tokens) - len(tokens) % self.PAGE

    def model_match(self, ns, tokens):
        n = 0
        while n + self.PAGE <= len(tokens) and (ns, *tokens[: n + self.PAGE]) in self.slots:
            n += self.PAGE
        return n

    def touch(self, ns, tokens, n):
        self.clock += 1
        for key in self.keys(ns, tokens, n):
            self.time[key] = self.clock
            self.hits[key] = self.hits.get(key, 0) + 1

    def priority(self, key):
        return (self.hits[key], self.time[key]) if self.POLICY == "lfu" else self.time[key]

    def do_insert(self, ns, tokens, slots, expect):
        n = self.cache.insert(tokens, slots, namespace=ns)
        assert n == expect
        aligned = self.aligned(tokens)
        for key in self.keys(ns, tokens, aligned)[n // self.PAGE :]:
            end = len(key) - 1
            self.slots[key] = tuple(int(x) for x in slots[end - self.PAGE : end])
            self.lock[key] = 0
        self.touch(ns, tokens, aligned)
        return n, aligned

    def check_match(self, ns, tokens):
        m = self.cache.match_prefix(tokens, namespace=ns)
        n = self.model_match(ns, tokens)
        assert m.length == n
        want = [x for key in self.keys(ns, tokens, n) for x in self.slots[key]]
        assert m.indices.tolist() == want
        self.touch(ns, tokens, n)
        return m

    def lock_node(self, ns, tokens, m):
        self.cache.inc_lock_ref(m.node)
        for key in self.keys(ns, tokens, m.length):
            self.lock[key] += 1
        self.locks.append((m.node, ns, tuple(tokens[: m.length])))

    # rules
    @rule(tokens=TOKENS, ns=NAMESPACES)
    def insert_fresh(self, tokens, ns):
        slots = self.pool.alloc(len(tokens))
        if slots is None:
            return
        n, aligned = self.do_insert(ns, tokens, slots, self.model_match(ns, tokens))
        self.pool.free(slots[:n])
        self.pool.free(slots[aligned:])

    @rule(tokens=TOKENS, ns=NAMESPACES, lock=st.booleans())
    def extend_matched(self, tokens, ns, lock):
        m = self.check_match(ns, tokens)
        if lock:
            self.lock_node(ns, tokens, m)
        new = self.pool.alloc(len(tokens) - m.length)
        if new is None:
            return
        _, aligned = self.do_insert(ns, tokens, np.concatenate([m.indices, new]), m.length)
        self.pool.free(new[aligned - m.length :])

    @rule(tokens=TOKENS, ns=NAMESPACES)
    def match(self, tokens, ns):
        self.check_match(ns, tokens)

    @rule(tokens=TOKENS, ns=NAMESPACES)
    def lock_prefix(self, tokens, ns):
        self.lock_node(ns, tokens, self.check_match(ns, tokens))

    @precondition(lambda self: self.locks)
    @rule(idx=st.integers(0, 100))
    def unlock(self, idx):
        node, ns, tokens = self.locks.pop(idx % len(self.locks))
        self.cache.dec_lock_ref(node)
        for key in self.keys(ns, tokens, len(tokens)):
            self.lock[key] -= 1

    @rule(num=st.integers(0, 15))
    def evict(self, num):
        evictable = self.cache.evictable_size
        available = self.pool.available
        got = self.cache.evict(num)
        remaining = set()
        for ns, toks, _ in self.cache.cached_sequences():
            remaining.update(self.keys(ns, toks.tolist(), len(toks)))
        evicted = set(self.slots) - remaining
        assert remaining <= set(self.slots)
        assert got == len(evicted) * self.PAGE and self.pool.available == available + got
        assert got >= min(num, evictable) and (got == 0) == (num == 0 or evictable == 0)
        if got < num:
            assert self.cache.evictable_size == 0
        for key in evicted:
            assert self.lock[key] == 0, "a locked prefix was evicted"
            # Only whole subtrees go: nothing that extends an evicted prefix survives.
            assert not any(r[: len(key)] == key for r in remaining if len(r) > len(key))
        freed = [x for key in evicted for x in self.slots[key]]
        assert not self.pool.is_allocated(freed).any()
        # Eviction order: the naive policy, freeing one page at a time (the unlocked page
        # with no cached extension and the lowest priority first), frees exactly the same
        # pages when it frees as many. Pages of one node share their priority, and distinct
        # leaves never do (one access touches one root-to-node path), so no tie is broken
        # differently.
        live = set(self.slots)
        expect = set()
        for _ in range(got // self.PAGE):
            leaves = [
                k
                for k in live
                if self.lock[k] == 0
                and not any(len(r) == len(k) + self.PAGE and r[: len(k)] == k for r in live)
            ]
            pick = min(leaves, key=lambda k: (self.priority(k), -len(k)))
            live.discard(pick)
            expect.add(pick)
        assert evicted == expect, "eviction order differs from the naive policy's"
        for key in evicted:
            del self.slots[key], self.lock[key], self.time[key], self.hits[key]

    @rule()
    def reset(self):
        if any(prefix for _, _, prefix in self.locks):  # a lock on a root pins nothing
            with pytest.raises(RuntimeError):
                self.cache.reset()
            return
        self.cache.reset()
        self.slots.clear(), self.lock.clear(), self.time.clear(), self.hits.clear()

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def misuse(self, data):
        key = data.draw(st.sampled_from(sorted(self.slots, key=repr)))
        size = self.cache.total_size
        with pytest.raises(ValueError, match="already held"):
            self.cache.insert([7] * self.PAGE, self.slots[key], namespace="b")
        if not any(prefix for _, _, prefix in self.locks):
            tokens = list(key[1:])
            m = self.cache.match_prefix(tokens, namespace=key[0])
            self.touch(key[0], tokens, m.length)
            with pytest.raises(ValueError, match="not locked"):
                self.cache.dec_lock_ref(m.node)
        assert self.cache.total_size == size

    @invariant()
    def matches_model(self):
        self.cache.check_invariants()
        self.pool.check_invariants()
        assert self.cache.total_size == len(self.slots) * self.PAGE
        assert self.cache.protected_size == self.PAGE * sum(1 for c in self.lock.values() if c)
        assert self.cache.evictable_size == self.PAGE * sum(1 for c in self.lock.values() if not c)
        assert self.pool.available + self.cache.total_size == self.NUM_SLOTS
        seen = {}
        for ns, toks, slots in self.cache.cached_sequences():
            for end in range(self.PAGE, len(toks) + 1, self.PAGE):
                seen[(ns, *toks[:end].tolist())] = tuple(slots[end - self.PAGE : end].tolist())
        assert seen == self.slots


class RadixLFU(RadixMachine):
    POLICY = "lfu"


class RadixPagedLRU(RadixMachine):
    PAGE = 2


class RadixPagedLFU(RadixMachine):
    PAGE = 2
    POLICY = "lfu"


class NativeRadixLRU(RadixMachine):
    IMPL = "native"


class NativeRadixPagedLFU(RadixPagedLFU):
    IMPL = "native"


TestRadixLRU = RadixMachine.TestCase
TestRadixLFU = RadixLFU.TestCase
TestRadixPagedLRU = RadixPagedLRU.TestCase
TestRadixPagedLFU = RadixPagedLFU.TestCase
TestNativeRadixLRU = needs_native(NativeRadixLRU.TestCase)
TestNativeRadixPagedLFU = needs_native(NativeRadixPagedLFU.TestCase)
for _case in (
    TestRadixLRU,
    TestRadixLFU,
    TestRadixPagedLRU,
    TestRadixPagedLFU,
    TestNativeRadixLRU,
    TestNativeRadixPagedLFU,
):
    _case.settings = settings(max_examples=40, stateful_step_count=50, deadline=None)
