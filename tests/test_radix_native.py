"""The C++ radix tree against the Python spec: random operation scripts over a tiny
vocabulary run through both in lockstep, and every result must be equal (matched slots,
cached lengths, lock deltas, evicted counts, errors, node fields, the pools' free lists,
which record the order of every freed slot).

When the module is not built this file is skipped, unless JAXATTN_REQUIRE_NATIVE=1 (CI)
turns that into a failure.
"""

from __future__ import annotations

import gc
import os
from array import array

import numpy as np
import pytest

from jaxattn.radix import NativeRadixCache, PythonRadixCache, TokenPool, native_tree

if not native_tree.is_available():
    if os.environ.get("JAXATTN_REQUIRE_NATIVE") == "1":
        raise RuntimeError(f"JAXATTN_REQUIRE_NATIVE=1 but {native_tree.LOAD_ERROR}")
    pytest.skip("the native radix tree is not built", allow_module_level=True)


class CheckedPool(TokenPool):
    """A pool that answers ``is_allocated`` itself: the tree's generic (callback) path."""

    def is_allocated(self, slots):
        return super().is_allocated(slots)


class Twin:
    """One spec cache and one native cache, each on its own pool, fed the same calls."""

    def __init__(self, num_slots, page, policy, pool_cls):
        self.pools = [pool_cls(num_slots, page_size=page) for _ in range(2)]
        self.caches = [
            PythonRadixCache(self.pools[0], page_size=page, eviction=policy),
            NativeRadixCache(self.pools[1], page_size=page, eviction=policy),
        ]
        self.page = page

    def call(self, name, *args, **kwargs):
        """Run a method on both; equal results or the same exception type."""
        out = []
        for cache in self.caches:
            try:
                out.append(("ok", getattr(cache, name)(*args, **kwargs)))
            except (ValueError, TypeError, RuntimeError) as e:
                out.append(("error", type(e)))
        assert out[0][0] == out[1][0], (name, out)
        return out

    def alloc(self, n):
        slots = [pool.alloc(n) for pool in self.pools]
        assert (slots[0] is None) == (slots[1] is None)
        if slots[0] is not None:
            assert np.array_equal(slots[0], slots[1])
        return slots[0]

    def free(self, slots):
        for pool in self.pools:
            pool.free(slots)

    def check(self):
        py, nat = self.caches
        nat.check_invariants()
        py.check_invariants()
        for attr in ("evictable_size", "protected_size", "num_nodes", "_clock"):
            assert getattr(py, attr) == getattr(nat, attr), attr
        a, b = self.pools
        assert a._num_free == b._num_free
        assert np.array_equal(a._stack[: a._num_free], b._stack[: b._num_free]), "free order"

        def seqs(cache):
            return sorted(
                (repr(ns), t.tolist(), s.tolist()) for ns, t, s in cache.cached_sequences()
            )

        assert seqs(py) == seqs(nat)


def same_node(a, b):
    assert a.is_root == b.is_root
    if a.is_root:
        return
    assert a.key.tolist() == b.key.tolist()
    assert a.value.tolist() == b.value.tolist()
    assert (a.lock_ref, a.last_access, a.hit_count) == (b.lock_ref, b.last_access, b.hit_count)
    assert len(a.children) == len(b.children)
    same_node(a.parent, b.parent)


def run_script(seed, page, policy, steps=150, pool_cls=TokenPool):
    rng = np.random.default_rng(seed)
    vocab = 3
    twin = Twin(48 * page, page, policy, pool_cls)
    locks = []  # (python node, native node)
    namespaces = [None, None, "a", 7]

    # Prefixes of a few base sequences, some with one token changed: shared pages, splits
    # at every depth and mismatches inside pages, whatever the page size.
    bases = rng.integers(0, vocab, (4, 6 * page))

    def tokens():
        t = bases[rng.integers(len(bases))][: int(rng.integers(0, 6 * page + 1))].copy()
        if len(t) and rng.random() < 0.5:
            t[rng.integers(len(t))] = rng.integers(0, vocab)
        if rng.random() < 0.15:
            t = t.astype(np.int32)
        return t.tolist() if rng.random() < 0.3 else t

    for _ in range(steps):
        op = rng.choice(
            ["insert", "extend", "match", "prefix", "lock", "unlock", "evict", "misuse", "reset"],
            p=[0.2, 0.2, 0.15, 0.05, 0.1, 0.1, 0.14, 0.04, 0.02],
        )
        ns = namespaces[rng.integers(len(namespaces))]
        t = tokens()
        if op == "insert":
            slots = twin.alloc(len(t))
            if slots is None:
                continue
            (_, n0), (_, n1) = twin.call("insert", t, slots, namespace=ns)
            assert n0 == n1
            aligned = len(t) - len(t) % page
            twin.free(slots[:n0])
            twin.free(slots[aligned:])
        elif op in ("extend", "match", "lock"):
            (_, m0), (_, m1) = twin.call("match_prefix", t, namespace=ns)
            assert m0.length == m1.length and m0.indices.tolist() == m1.indices.tolist()
            assert m0.indices.dtype == m1.indices.dtype == np.int32
            same_node(m0.node, m1.node)
            if op == "lock" or (op == "extend" and rng.random() < 0.5):
                assert twin.caches[0].inc_lock_ref(m0.node) == twin.caches[1].inc_lock_ref(m1.node)
                locks.append((m0.node, m1.node))
            if op == "extend":
                new = twin.alloc(len(t) - m0.length)
                if new is None:
                    continue
                full = np.concatenate([m0.indices, new])
                n0 = twin.caches[0].insert(t, full, namespace=ns)
                n1 = twin.caches[1].insert(t, full, namespace=ns)
                assert n0 == n1 == m0.length
                aligned = len(t) - len(t) % page
                twin.free(new[aligned - m0.length :])
        elif op == "prefix":
            (_, a), (_, b) = twin.call("prefix_len", t, namespace=ns)
            assert a == b
        elif op == "unlock" and locks:
            p, n = locks.pop(int(rng.integers(len(locks))))
            assert twin.caches[0].dec_lock_ref(p) == twin.caches[1].dec_lock_ref(n)
        elif op == "evict":
            (_, a), (_, b) = twin.call("evict", int(rng.integers(0, 12 * page)))
            assert a == b
        elif op == "misuse":
            py, nat = twin.caches
            seqs = py.cached_sequences()
            if seqs:
                _, toks, held = seqs[int(rng.integers(len(seqs)))]
                twin.call("insert", [9] * len(held), held, namespace="b")  # held slots
            twin.call("insert", [1, 2], [0], namespace=ns)  # ragged
            twin.call("insert", [[1]], [[0]])
            twin.call("match_prefix", [0.5])
            twin.call("evict", -1)
            free_pages = np.flatnonzero(~twin.pools[0]._used)
            if len(free_pages):
                free = free_pages[0] * page + np.arange(page)
                twin.call("insert", [1] * page, free, namespace=ns)  # slots free in the pool
            (_, m0), (_, m1) = twin.call("match_prefix", t, namespace=ns)
            if not py.protected_size and m0.length:
                with pytest.raises(ValueError, match="not locked"):
                    py.dec_lock_ref(m0.node)
                with pytest.raises(ValueError, match="not locked"):
                    nat.dec_lock_ref(m1.node)
        elif op == "reset":
            # Refused (the same way) while a request holds a lock; locks on a root pin
            # nothing, and those handles stay usable (as no-ops) after a reset.
            twin.call("reset")
        twin.check()
    # Unwind: every lock released, everything evicted, both pools whole again.
    for p, n in locks:
        if p.alive or p.is_root:
            assert twin.caches[0].dec_lock_ref(p) == twin.caches[1].dec_lock_ref(n)
    (_, a), (_, b) = twin.call("evict", 10**9)
    assert a == b
    twin.check()
    assert twin.caches[1].total_size == 0
    assert twin.pools[1].available == twin.pools[1].num_slots


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("page", [1, 16])
def test_native_matches_spec(page, policy):
    for seed in range(40):
        run_script(seed * 4 + (page == 16) * 2 + (policy == "lfu"), page, policy)


def test_native_matches_spec_with_a_callback_pool():
    for seed in range(10):
        run_script(1000 + seed, 1, "lru", pool_cls=CheckedPool)
        run_script(2000 + seed, 16, "lfu", pool_cls=CheckedPool)


def test_wide_nodes_and_deep_paths():
    """A root with thousands of children (hash index, collisions unlikely but handled by
    the scan) and a long chain; eviction empties it exactly in policy order."""
    for page in (1, 16):
        twin = Twin(1 << 16, page, "lru", TokenPool)
        rng = np.random.default_rng(page)
        for i in range(1500):
            t = np.concatenate([[i], rng.integers(0, 3, page * 2 - 1)])
            slots = twin.alloc(len(t))
            (_, a), (_, b) = twin.call("insert", t, slots)
            assert a == b == 0
        chain = rng.integers(0, 3, 64 * page)
        for end in range(page, len(chain) + 1, page * 4):
            (_, m0), (_, m1) = twin.call("match_prefix", chain[:end])
            new = twin.alloc(end - m0.length)
            full = np.concatenate([m0.indices, new])
            twin.caches[0].insert(chain[:end], full)
            twin.caches[1].insert(chain[:end], full)
        twin.check()
        for n in (1, 7 * page, 100 * page, 10**9):
            (_, a), (_, b) = twin.call("evict", n)
            assert a == b
            twin.check()


def test_stale_handles_and_wrong_caches():
    pool = TokenPool(32)
    cache = NativeRadixCache(pool)
    slots = pool.alloc(4)
    cache.insert([1, 2, 3, 4], slots)
    m = cache.match_prefix([1, 2])
    assert m.node == cache.match_prefix([1, 2]).node  # equal handles, one node
    cache.evict(100)
    assert not m.node.alive and "evicted" in repr(m.node)
    with pytest.raises(ValueError, match="evicted or reset"):
        cache.inc_lock_ref(m.node)
    with pytest.raises(ValueError, match="evicted or reset"):
        _ = m.node.key
    # The freed node's index is reused by the next insert; the old handle stays stale.
    cache.insert([5, 6], pool.alloc(2))
    with pytest.raises(ValueError, match="evicted or reset"):
        cache.dec_lock_ref(m.node)
    spec = PythonRadixCache(TokenPool(8))
    with pytest.raises(ValueError, match="another impl"):
        cache.inc_lock_ref(spec.match_prefix([1]).node)
    with pytest.raises(ValueError, match="another RadixCache"):
        cache.inc_lock_ref(NativeRadixCache(TokenPool(8)).match_prefix([1]).node)
    with pytest.raises(ValueError, match="int32"):
        cache.insert([1 << 40], pool.alloc(1))


def test_token_containers():
    """Every container the spec takes gives the spec's answer."""
    spec, nat = PythonRadixCache(TokenPool(64)), NativeRadixCache(TokenPool(64))
    base = np.arange(40, dtype=np.int64)
    for cache in (spec, nat):
        cache.insert(base[::2], cache.pool.alloc(20))  # strided: not a contiguous buffer
    for tokens in (
        base[::2],
        base[::2].astype(np.int32),
        base[::2].astype(np.uint16),
        base[::2].tolist(),
        tuple(base[::2].tolist()),
        array("q", base[::2].tolist()),
        [np.int64(0), 2, 4],
        np.zeros((0, 3), np.int64),
    ):
        a, b = spec.match_prefix(tokens), nat.match_prefix(tokens)
        assert a.length == b.length and a.indices.tolist() == b.indices.tolist(), tokens
    for bad, exc in (([True, False], TypeError), ([[1]], ValueError), ([1.5], TypeError)):
        for cache in (spec, nat):
            with pytest.raises(exc, match="tokens"):
                cache.prefix_len(bad)


def test_pool_refusal_leaves_the_tree_unchanged():
    class RefusingPool(TokenPool):
        refuse = False

        def free(self, slots):
            if self.refuse:
                raise RuntimeError("refused")
            super().free(slots)

    for cls in (PythonRadixCache, NativeRadixCache):
        pool = RefusingPool(32)
        cache = cls(pool)
        for t in ([1, 2, 3], [1, 2, 4], [5]):
            s = pool.alloc(len(t))
            n = cache.insert(t, s)
            pool.free(s[:n])
        before = sorted((t.tolist(), s.tolist()) for _, t, s in cache.cached_sequences())
        pool.refuse = True
        with pytest.raises(RuntimeError, match="refused"):
            cache.evict(100)
        pool.refuse = False
        cache.check_invariants()
        after = sorted((t.tolist(), s.tolist()) for _, t, s in cache.cached_sequences())
        assert before == after and cache.evictable_size == 5
        assert cache.evict(100) == 5


def test_memory_is_released():
    pool = TokenPool(1 << 16)
    cache = NativeRadixCache(pool)
    rng = np.random.default_rng(0)
    for _ in range(200):
        t = rng.integers(0, 1000, 200)
        cache.insert(t, pool.alloc(200))
    full = cache.memory_bytes()
    cache.evict(10**9)
    gc.collect()
    assert cache.total_size == 0 and cache.memory_bytes() < full / 4
