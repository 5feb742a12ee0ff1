"""The radix tree in Python: the spec of :class:`~jaxattn.radix.RadixCache`.

numpy only. The C++ tree (``native_tree.py``) must return what this one returns; the
module docstring of ``radix_cache.py`` states the semantics both keep.

Eviction keeps its candidates incrementally: every unlocked leaf has one live entry in a
binary heap (``_heap``), tagged with a stamp that the node also holds. Touching, locking,
unlocking or giving a child to a leaf re-stamps or clears the node, which makes its old
entry stale; stale entries are skipped when they reach the top and dropped in bulk once they
outnumber live ones. ``evict`` therefore pops only the k leaves it frees (O(k log n)) instead
of heapifying every leaf on each call.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable

import numpy as np

from jaxattn.paging.allocator import SlotAllocator
from jaxattn.radix.radix_cache import MatchResult, RadixCache, as_tokens
from jaxattn.radix.token_pool import as_slots, last_occurrences

__all__ = ["PythonRadixCache", "TreeNode"]

_cache_ids = itertools.count()


class TreeNode:
    """One edge of the tree and the node it leads to.

    ``key``: i64[n] token ids of the edge; ``value``: i32[n] their pool slots;
    ``lock_ref``: requests currently using the path through this node.
    """

    __slots__ = (
        "key",
        "value",
        "children",
        "parent",
        "lock_ref",
        "last_access",
        "hit_count",
        "id",
        "alive",
        "_stamp",
        "_cache_id",
        "_namespace",
    )

    _ids = itertools.count()

    def __init__(self, key: np.ndarray, value: np.ndarray, parent: TreeNode | None, cache_id):
        self.key = key
        self.value = value
        self.children: dict[object, TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.id = next(TreeNode._ids)
        self.alive = True
        self._stamp = 0  # its live heap entry while it is an evictable leaf, else 0
        self._cache_id = cache_id
        self._namespace: Hashable = None

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, "
            f"children={len(self.children)}, alive={self.alive})"
        )


class PythonRadixCache(RadixCache):
    """The spec: :class:`~jaxattn.radix.RadixCache` in Python (``impl="python"``)."""

    impl = "python"

    def __init__(
        self,
        pool: SlotAllocator,
        *,
        page_size: int = 1,
        eviction: str = "lru",
        impl: str | None = None,
    ):
        super().__init__(pool, page_size=page_size, eviction=eviction, impl=impl)
        self._id = next(_cache_ids)
        self._init_tree()

    def _init_tree(self) -> None:
        self._root = self._new_root(None)
        self._roots: dict[Hashable, TreeNode] = {None: self._root}
        # Which pool slots the tree holds: catches a caller handing one slot over twice.
        self._owned = np.zeros(self.pool.num_slots, dtype=bool)
        self._scratch = np.empty(self.pool.num_slots, dtype=np.int64)
        self._evictable_leaves: set[TreeNode] = set()
        self._heap: list[tuple[tuple, int, TreeNode]] = []  # (priority, stamp, node)
        self._stamps = itertools.count(1)
        self._evictable_size = 0
        self._protected_size = 0
        self._num_nodes = 0
        self._clock = 0

    def _new_root(self, namespace: Hashable) -> TreeNode:
        root = TreeNode(np.zeros((0,), np.int64), np.zeros((0,), np.int32), None, self._id)
        root._namespace = namespace
        return root

    # -- sizes -----------------------------------------------------------------------------

    @property
    def evictable_size(self) -> int:
        """Cached tokens that :meth:`evict` may free (no running request uses them)."""
        return self._evictable_size

    @property
    def protected_size(self) -> int:
        """Cached tokens pinned by a lock."""
        return self._protected_size

    @property
    def num_nodes(self) -> int:
        """Nodes below the roots."""
        return self._num_nodes

    # -- lookup ----------------------------------------------------------------------------

    def _child_key(self, key: np.ndarray, pos: int) -> object:
        if self.page_size == 1:
            return int(key[pos])
        return key[pos : pos + self.page_size].tobytes()

    def _common_len(self, edge: np.ndarray, key: np.ndarray, pos: int) -> int:
        n = min(len(edge), len(key) - pos)
        equal = edge[:n] == key[pos : pos + n]
        # argmin of a bool array is the first False (0 when all are True); one C pass,
        # cheaper per node than flatnonzero, which allocates the list of every mismatch.
        m = int(equal.argmin())
        if equal[m]:
            m = n
        return m - m % self.page_size

    def _descend(self, root: TreeNode, key: np.ndarray):
        """Walk without changing anything.

        Returns ``(path, pos, child, m)``: ``path`` the fully matched nodes from ``root``,
        ``pos`` the tokens they cover, and, when the match goes on ``m`` tokens into the
        edge of ``child`` but not to its end, that child (else None).
        """
        path, node, pos = [root], root, 0
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            # The child key already proved the first token (page) equal, so m >= page_size.
            m = self._common_len(child.key, key, pos)
            if m < len(child.key):
                return path, pos, child, m
            path.append(child)
            node, pos = child, pos + m
        return path, pos, None, 0

    def _aligned(self, key: np.ndarray) -> np.ndarray:
        return key[: len(key) - len(key) % self.page_size]

    def prefix_len(self, tokens: object, *, namespace: Hashable = None) -> int:
        """Length of the cached prefix of ``tokens``; changes nothing (for scheduling)."""
        key = self._aligned(as_tokens("tokens", tokens))
        root = self._roots.get(namespace)
        if root is None:
            return 0
        _, pos, child, m = self._descend(root, key)
        return pos + (m if child is not None else 0)

    def match_prefix(self, tokens: object, *, namespace: Hashable = None) -> MatchResult:
        """Slots of the longest cached prefix of ``tokens``.

        When the match ends inside an edge, that edge is split so that the returned node
        ends exactly at the match and can be locked on its own. Every node on the path
        counts as accessed (recency for LRU, a hit for LFU).
        """
        key = self._aligned(as_tokens("tokens", tokens))
        root = self._roots.get(namespace)
        if root is None:
            return MatchResult(np.zeros((0,), np.int32), self._root, 0)
        path, pos, child, m = self._descend(root, key)
        if child is not None:
            path.append(self._split(child, m))
            pos += m
        self._touch(path)
        values = [n.value for n in path[1:]]
        indices = np.concatenate(values) if values else np.zeros((0,), np.int32)
        return MatchResult(indices, path[-1], pos)

    # -- insertion -------------------------------------------------------------------------

    def insert(self, tokens: object, indices: object, *, namespace: Hashable = None) -> int:
        """Cache ``tokens`` whose KV sits in slots ``indices``; return the cached length.

        Returns how many leading tokens were already cached before the call. The tree
        keeps its own slots for those and takes over ``indices[returned:aligned_len]``
        (``aligned_len`` = ``len(tokens)`` cut to a multiple of ``page_size``). The caller
        still owns, and must eventually free, every other slot of ``indices`` that it
        allocated itself.
        """
        key = as_tokens("tokens", tokens)
        vals = as_slots("indices", indices)
        if len(vals) != len(key):
            raise ValueError(f"indices has {len(vals)} slots for {len(key)} tokens")
        key, vals = self._aligned(key), vals[: len(key) - len(key) % self.page_size]
        root = self._roots.get(namespace)
        if root is None:
            path, pos, child, m = [None], 0, None, 0
        else:
            path, pos, child, m = self._descend(root, key)
        cached = pos + (m if child is not None else 0)
        new_vals = vals[cached:]
        self._check_new_slots(new_vals)

        if root is None:
            if not len(new_vals):
                return cached
            root = self._roots[namespace] = self._new_root(namespace)
            path = [root]
        if child is not None:
            # Split even when nothing new follows, so that access times stay exact per
            # token: the matched upper part is fresh, the unmatched lower part is not.
            path.append(self._split(child, m))
        if len(new_vals):
            parent = path[-1]
            leaf = TreeNode(key[cached:].copy(), new_vals.astype(np.int32), parent, self._id)
            parent.children[self._child_key(leaf.key, 0)] = leaf
            self._num_nodes += 1
            self._owned[new_vals] = True
            self._evictable_size += len(new_vals)
            self._update_candidate(parent)  # no longer a leaf
            path.append(leaf)
        self._touch(path)
        return cached

    def _check_new_slots(self, slots: np.ndarray) -> None:
        if not slots.size:
            return
        if slots.min() < 0 or slots.max() >= self.pool.num_slots:
            raise ValueError(f"indices must lie in [0, {self.pool.num_slots})")
        if not last_occurrences(slots, self._scratch).all():
            raise ValueError("indices lists a slot twice")
        if self._owned[slots].any():
            bad = slots[self._owned[slots]][:8].tolist()
            raise ValueError(f"indices {bad} are already held by the cache")
        if not self.pool.is_allocated(slots).all():
            raise ValueError("indices contains slots that are free in the pool")

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut ``child``'s edge after ``m`` tokens; return the new upper node.

        Both halves get their own arrays: views would keep the whole original edge alive
        for as long as either half lives (16x the memory of a short half of a long edge).
        The lower part keeps its access time and hits: see the module's recency rule.
        """
        parent = child.parent
        upper = TreeNode(child.key[:m].copy(), child.value[:m].copy(), parent, self._id)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.hit_count = child.hit_count
        child.key, child.value = child.key[m:].copy(), child.value[m:].copy()
        child.parent = upper
        upper.children[self._child_key(child.key, 0)] = child
        parent.children[self._child_key(upper.key, 0)] = upper
        self._num_nodes += 1
        return upper

    def _touch(self, path: list[TreeNode]) -> None:
        self._clock += 1
        for node in path:
            node.last_access = self._clock
            node.hit_count += 1
        # Only the path's end can be a leaf; its priority changed, so its entry is renewed.
        if not path[-1].is_root:
            self._update_candidate(path[-1])

    def _update_candidate(self, node: TreeNode) -> None:
        """Bring ``node``'s heap entry in line with its state: a fresh one (its priority may
        have changed) when it is an unlocked leaf, none otherwise."""
        if node.lock_ref or node.children or node.is_root:
            if node._stamp:
                node._stamp = 0
                self._evictable_leaves.discard(node)
            return
        node._stamp = next(self._stamps)
        self._evictable_leaves.add(node)
        heapq.heappush(self._heap, (self._priority(node), node._stamp, node))
        # Stale entries are garbage; once they outnumber live ones, rebuild (amortized O(1)).
        if len(self._heap) > 2 * len(self._evictable_leaves) + 64:
            self._heap = [e for e in self._heap if e[2]._stamp == e[1]]
            heapq.heapify(self._heap)

    # -- locks -----------------------------------------------------------------------------

    def _check_node(self, node: object) -> TreeNode:
        if not isinstance(node, TreeNode):
            raise TypeError(f"node must be a TreeNode, got {type(node).__name__}")
        if node._cache_id != self._id:
            raise ValueError(f"node={node!r} belongs to another RadixCache")
        # A root is never evicted in earnest (an emptied namespace root is only dropped from
        # the index) and locking one is a no-op, so a stale root is harmless.
        if not node.alive and not node.is_root:
            raise ValueError(f"node={node!r} was evicted or reset")
        return node

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Pin ``node`` and its ancestors; return the change of ``protected_size``."""
        node = self._check_node(node)
        delta = 0
        while not node.is_root:
            if node.lock_ref == 0:
                n = len(node.value)
                self._evictable_size -= n
                self._protected_size += n
                delta += n
                node.lock_ref = 1
                self._update_candidate(node)
            else:
                node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one :meth:`inc_lock_ref`; return the change of ``protected_size``."""
        node = self._check_node(node)
        walk = node
        while not walk.is_root:
            if walk.lock_ref == 0:
                raise ValueError(f"node={node!r} is not locked (unbalanced dec_lock_ref)")
            walk = walk.parent
        delta = 0
        while not node.is_root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                n = len(node.value)
                self._evictable_size += n
                self._protected_size -= n
                delta -= n
                if not node.children:
                    self._update_candidate(node)
            node = node.parent
        return delta

    # -- eviction --------------------------------------------------------------------------

    def _priority(self, node: TreeNode) -> tuple:
        if self.eviction == "lfu":
            return (node.hit_count, node.last_access, node.id)
        return (node.last_access, node.id)

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` cached tokens if possible; return how many were freed.

        Only unlocked leaves are freed, in policy order; a parent joins the candidates once
        its last child is gone and it is unlocked. Whole nodes are freed, so the result may
        exceed ``num_tokens``; it is smaller only when nothing evictable is left.
        """
        self._check_evict_arg(num_tokens)
        heap = self._heap
        # Plan first, free after: a failure in the pool then leaves the tree untouched (the
        # popped entries go back). Parents exposed by the plan wait in their own heap.
        plan: list[TreeNode] = []
        popped: list[tuple] = []
        exposed: list[tuple] = []
        children_left: dict[TreeNode, int] = {}
        evicted = 0
        while evicted < num_tokens:
            while heap and heap[0][2]._stamp != heap[0][1]:
                heapq.heappop(heap)  # stale
            if heap and (not exposed or heap[0][0] < exposed[0][0]):
                entry = heapq.heappop(heap)
                popped.append(entry)
            elif exposed:
                entry = heapq.heappop(exposed)
            else:
                break
            node = entry[2]
            plan.append(node)
            evicted += len(node.value)
            parent = node.parent
            if parent.is_root:
                continue
            left = children_left.get(parent, len(parent.children)) - 1
            children_left[parent] = left
            if left == 0 and parent.lock_ref == 0:
                heapq.heappush(exposed, (self._priority(parent), 0, parent))
        if not plan:
            return 0
        slots = np.concatenate([n.value for n in plan])
        try:
            self.pool.free(slots)
        except BaseException:
            for entry in popped:
                heapq.heappush(heap, entry)
            raise
        self._owned[slots] = False
        self._evictable_size -= evicted
        self._num_nodes -= len(plan)
        for node in plan:
            parent = node.parent
            del parent.children[self._child_key(node.key, 0)]
            node._stamp = 0
            self._evictable_leaves.discard(node)
            node.alive = False
            if parent.is_root:
                if not parent.children and parent._namespace is not None:
                    del self._roots[parent._namespace]
                    parent.alive = False
            elif not parent.children and parent.lock_ref == 0:
                self._update_candidate(parent)
        return evicted

    def reset(self) -> None:
        """Drop every cached prefix and free its slots; refused while any node is locked."""
        self._check_reset()
        slots = np.flatnonzero(self._owned)
        self.pool.free(slots)
        for node in self._iter_nodes():
            node.alive = False
            node._stamp = 0
        self._init_tree()

    # -- inspection ------------------------------------------------------------------------

    def _iter_nodes(self, *, include_roots: bool = True):
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if include_roots or not node.is_root:
                yield node
            stack.extend(node.children.values())

    def cached_sequences(self) -> list[tuple[Hashable, np.ndarray, np.ndarray]]:
        """``(namespace, tokens, slots)`` of every root-to-leaf path (for tests and debugging)."""
        out = []
        for namespace, root in self._roots.items():
            stack = [(root, [], [])]
            while stack:
                node, keys, vals = stack.pop()
                keys, vals = [*keys, node.key], [*vals, node.value]
                if not node.children and not node.is_root:
                    out.append((namespace, np.concatenate(keys), np.concatenate(vals)))
                stack.extend((c, keys, vals) for c in node.children.values())
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError when the tree's bookkeeping is inconsistent."""
        evictable = protected = nodes = 0
        owned = np.zeros_like(self._owned)
        leaves = set()
        for node in self._iter_nodes():
            assert node.alive and node._cache_id == self._id
            for ck, child in node.children.items():
                assert child.parent is node, "broken parent link"
                assert ck == self._child_key(child.key, 0), "child stored under a wrong key"
                assert len(child.key) == len(child.value) > 0, "empty or ragged edge"
                assert len(child.key) % self.page_size == 0, "edge not page aligned"
            if node.is_root:
                assert node.lock_ref == 0
                assert node._namespace is None or node.children, "empty namespace root kept"
                continue
            nodes += 1
            for child in node.children.values():
                # Every access to a child passes through its parent, so eviction order
                # (by recency or by hits) always reaches a child before its parent.
                assert node.last_access >= child.last_access
                assert node.hit_count >= child.hit_count
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values())
            assert not owned[node.value].any(), "a slot is held by two nodes"
            owned[node.value] = True
            if node.lock_ref:
                protected += len(node.value)
            else:
                evictable += len(node.value)
                if not node.children:
                    leaves.add(node)
        assert (evictable, protected) == (self._evictable_size, self._protected_size)
        assert nodes == self._num_nodes
        assert np.array_equal(owned, self._owned), "slot ownership mask out of date"
        assert self.pool.is_allocated(np.flatnonzero(owned)).all(), "tree holds a free slot"
        assert leaves == self._evictable_leaves, "evictable leaf set out of date"
        live = {e[1]: e for e in self._heap if e[2]._stamp == e[1]}
        assert len(live) == len(leaves), "an evictable leaf has no live heap entry"
        for node in leaves:
            entry = live.get(node._stamp)
            assert entry is not None and entry[2] is node, "heap entry lost"
            assert entry[0] == self._priority(node), "heap entry priority stale"
