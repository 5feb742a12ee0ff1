"""The radix tree in C++ behind the :class:`~jaxattn.radix.RadixCache` API.

The tree, its slot ownership mask and its eviction heap live in the ``_radix_tree``
extension module (``ffi/radix/radix_tree.cc``); this facade keeps the pool (it frees what
the tree evicts), the namespace names (the C++ side numbers them) and the node handles.

Finding the module: ``jaxattn.radix._radix_tree`` as installed by ``pip install``, else the
first ``_radix_tree*.so`` in a directory of ``$JAXATTN_NATIVE_LIB_DIR`` (``os.pathsep``
separated) or its ``radix`` subdirectory (a CMake build's ``build/<dir>/ffi``, which holds
the FFI libraries, has the module in ``ffi/radix``). :func:`is_available`
and :data:`LOAD_ERROR` say whether that worked; nothing falls back silently:
``RadixCache(impl=None)`` picks the spec when the module is missing and says so in
``cache.impl``.

Token ids must fit in int32 here (the spec takes any int64); ``insert`` raises otherwise.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import pathlib
import sys
from collections.abc import Hashable

import numpy as np

from jaxattn.paging.allocator import SlotAllocator
from jaxattn.radix.python_tree import TreeNode
from jaxattn.radix.radix_cache import MatchResult, RadixCache, as_tokens
from jaxattn.radix.token_pool import TokenPool, as_slots

__all__ = ["LOAD_ERROR", "NativeNode", "NativeRadixCache", "is_available", "require"]

_MODULE = "jaxattn.radix._radix_tree"


def _load():
    try:
        return importlib.import_module(_MODULE), None
    except ImportError as e:
        first_error = f"{_MODULE} is not installed ({e})"
    dirs = [d for d in os.environ.get("JAXATTN_NATIVE_LIB_DIR", "").split(os.pathsep) if d]
    # A CMake build tree keeps the module in radix/ beside the FFI libraries, so the one
    # directory that serves jaxattn.native serves it too.
    candidates = [pathlib.Path(d) / sub for d in dirs for sub in (".", "radix")]
    for d in candidates:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = d / f"_radix_tree{suffix}"
            if not path.is_file():
                continue
            spec = importlib.util.spec_from_file_location(_MODULE, path)
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except ImportError as e:
                return None, f"cannot load {path}: {e}"
            sys.modules[_MODULE] = module
            return module, None
    return None, (
        f"{first_error}; build it with `pip install -e .` (CMake >= 3.20, a C++17 compiler, "
        "nanobind), or point $JAXATTN_NATIVE_LIB_DIR at the directory that holds it"
    )


_ext, LOAD_ERROR = _load()


def is_available() -> bool:
    return _ext is not None


def require() -> None:
    if _ext is None:
        raise RuntimeError(f"the native radix tree is not available: {LOAD_ERROR}")


def _tokens(tokens: object) -> np.ndarray:
    return np.ascontiguousarray(as_tokens("tokens", tokens))


class NativeNode:
    """A handle on a node of a :class:`NativeRadixCache`: (cache, index, generation).

    Reads go to the C++ tree; a handle whose node was evicted or reset raises on reads
    (``alive`` is False). Two handles on the same node compare equal.
    """

    __slots__ = ("_cache", "_idx", "_gen", "_root")

    def __init__(self, cache: NativeRadixCache, idx: int, gen: int, root: bool):
        self._cache = cache
        self._idx = idx
        self._gen = gen
        self._root = root

    def _tree(self):
        tree = self._cache._tree
        if not tree.is_live(self._idx, self._gen):
            raise ValueError(f"{self!r} was evicted or reset")
        return tree

    @property
    def is_root(self) -> bool:
        return self._root

    @property
    def alive(self) -> bool:
        return self._cache._tree.is_live(self._idx, self._gen)

    @property
    def key(self) -> np.ndarray:
        """i64[n] token ids of the edge (a copy)."""
        return self._tree().node_key(self._idx, self._gen)

    @property
    def value(self) -> np.ndarray:
        """i32[n] pool slots of the edge (a copy)."""
        return self._tree().node_value(self._idx, self._gen)

    @property
    def parent(self) -> NativeNode | None:
        p = self._tree().node_parent(self._idx, self._gen)
        return None if p is None else NativeNode(self._cache, *p)

    @property
    def children(self) -> dict[object, NativeNode]:
        """Child key (first token, or first page's int64 bytes) -> child, as the spec."""
        out = {}
        for idx, gen in self._tree().node_children(self._idx, self._gen):
            child = NativeNode(self._cache, idx, gen, False)
            key = child.key[: self._cache.page_size]
            out[int(key[0]) if self._cache.page_size == 1 else key.tobytes()] = child
        return out

    def _field(self, i: int) -> int:
        return self._tree().node_fields(self._idx, self._gen)[i]

    lock_ref = property(lambda self: self._field(0), doc="requests using the path through it")
    last_access = property(lambda self: self._field(1))
    hit_count = property(lambda self: self._field(2))
    id = property(lambda self: self._field(3), doc="creation order within its cache")

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is NativeNode
            and other._cache is self._cache
            and other._idx == self._idx
            and other._gen == self._gen
        )

    def __hash__(self) -> int:
        return hash((id(self._cache), self._idx, self._gen))

    def __repr__(self) -> str:
        if not self.alive:
            return f"NativeNode(index={self._idx}, evicted)"
        lock, _, _, nid, n, kids = self._cache._tree.node_fields(self._idx, self._gen)
        return f"NativeNode(id={nid}, len={n}, lock_ref={lock}, children={kids})"


class NativeRadixCache(RadixCache):
    """:class:`~jaxattn.radix.RadixCache` with the tree in C++ (``impl="native"``)."""

    impl = "native"

    def __init__(
        self,
        pool: SlotAllocator,
        *,
        page_size: int = 1,
        eviction: str = "lru",
        impl: str | None = None,
    ):
        require()
        super().__init__(pool, page_size=page_size, eviction=eviction, impl=impl)
        self._tree = _ext.Tree(pool.num_slots, self.page_size, eviction == "lfu")
        # A plain TokenPool exposes its page bitmap, which the tree reads directly to check
        # that inserted slots are allocated; any other pool answers through is_allocated.
        self._bitmap_pool = type(pool).is_allocated is TokenPool.is_allocated
        self._init_namespaces()

    def _init_namespaces(self) -> None:
        self._ns_ids: dict[Hashable, int] = {None: 0}
        self._ns_names: dict[int, Hashable] = {0: None}

    def _is_allocated(self, slots: np.ndarray) -> bool:
        return bool(np.all(self.pool.is_allocated(slots)))

    # -- sizes -----------------------------------------------------------------------------

    @property
    def evictable_size(self) -> int:
        """Cached tokens that :meth:`evict` may free (no running request uses them)."""
        return self._tree.evictable_size

    @property
    def protected_size(self) -> int:
        """Cached tokens pinned by a lock."""
        return self._tree.protected_size

    @property
    def total_size(self) -> int:
        return self._tree.evictable_size + self._tree.protected_size

    @property
    def num_nodes(self) -> int:
        """Nodes below the roots."""
        return self._tree.num_nodes

    @property
    def _clock(self) -> int:
        return self._tree.clock

    @property
    def _roots(self) -> dict[Hashable, NativeNode]:
        return {self._ns_names[ns]: NativeNode(self, r, g, True) for ns, r, g in self._tree.roots()}

    def memory_bytes(self) -> int:
        """Bytes held by the C++ tree (edges, nodes, indexes, heap, slot mask)."""
        return self._tree.memory_bytes()

    # -- lookup and insertion --------------------------------------------------------------
    # The C++ side reads contiguous int64 buffers in place and converts int32 buffers and
    # lists of ints; anything else raises TypeError there, and the spec's own conversion
    # (with its error messages) runs before a second try.

    def prefix_len(self, tokens: object, *, namespace: Hashable = None) -> int:
        """Length of the cached prefix of ``tokens``; changes nothing (for scheduling)."""
        ns = self._ns_ids.get(namespace, -1)
        try:
            return self._tree.prefix_len(ns, tokens)
        except TypeError:
            return self._tree.prefix_len(ns, _tokens(tokens))

    def match_prefix(self, tokens: object, *, namespace: Hashable = None) -> MatchResult:
        """Slots of the longest cached prefix of ``tokens`` (see ``PythonRadixCache``)."""
        ns = self._ns_ids.get(namespace, -1)
        try:
            indices, idx, gen, length = self._tree.match_prefix(ns, tokens)
        except TypeError:
            indices, idx, gen, length = self._tree.match_prefix(ns, _tokens(tokens))
        # Edges are never empty, so the match ends at a root exactly when it is empty.
        return MatchResult(indices, NativeNode(self, idx, gen, length == 0), length)

    def insert(self, tokens: object, indices: object, *, namespace: Hashable = None) -> int:
        """Cache ``tokens`` whose KV sits in ``indices``; return the length cached before.

        See ``PythonRadixCache.insert``: the tree takes over
        ``indices[returned:aligned_len]``, the caller keeps every other slot.
        """
        ns = self._ns_ids.get(namespace)
        if ns is None:
            ns = max(self._ns_names) + 1
            self._ns_ids[namespace] = ns
            self._ns_names[ns] = namespace
        if self._bitmap_pool:
            used, pool_page, check = self.pool._used, self.pool.page_size, None
        else:
            used, pool_page, check = None, 1, self._is_allocated
        try:
            return self._tree.insert(ns, tokens, indices, used, pool_page, check)
        except TypeError:
            tokens = _tokens(tokens)
            indices = np.ascontiguousarray(as_slots("indices", indices))
            return self._tree.insert(ns, tokens, indices, used, pool_page, check)

    # -- locks -----------------------------------------------------------------------------

    def _check_node(self, node: object) -> NativeNode:
        if type(node) is not NativeNode:
            if isinstance(node, TreeNode):
                raise ValueError(f"node={node!r} belongs to a cache of another impl")
            raise TypeError(f"node must be a NativeNode, got {type(node).__name__}")
        if node._cache is not self:
            raise ValueError(f"node={node!r} belongs to another RadixCache")
        return node

    def inc_lock_ref(self, node: NativeNode) -> int:
        """Pin ``node`` and its ancestors; return the change of ``protected_size``."""
        node = self._check_node(node)
        try:
            return self._tree.inc_lock_ref(node._idx, node._gen)
        except ValueError:
            # Locking a root is a no-op, so a stale root is harmless (as in the spec).
            if node._root:
                return 0
            raise ValueError(f"node={node!r} was evicted or reset") from None

    def dec_lock_ref(self, node: NativeNode) -> int:
        """Undo one :meth:`inc_lock_ref`; return the change of ``protected_size``."""
        node = self._check_node(node)
        try:
            return self._tree.dec_lock_ref(node._idx, node._gen)
        except ValueError as e:
            if str(e) == "unlocked":
                raise ValueError(f"node={node!r} is not locked (unbalanced dec_lock_ref)") from None
            if node._root:
                return 0
            raise ValueError(f"node={node!r} was evicted or reset") from None

    # -- eviction --------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` cached tokens if possible; return how many were freed.

        Policy order, whole unlocked leaves, parents once they become leaves: see
        ``PythonRadixCache.evict``. The tree changes only after the pool took the slots.
        """
        self._check_evict_arg(num_tokens)
        slots = self._tree.plan_evict(num_tokens)
        if not len(slots):
            self._tree.abort_evict()
            return 0
        try:
            self.pool.free(slots)
        except BaseException:
            self._tree.abort_evict()
            raise
        freed, dropped = self._tree.commit_evict()
        for ns in dropped:
            del self._ns_ids[self._ns_names.pop(ns)]
        return freed

    def reset(self) -> None:
        """Drop every cached prefix and free its slots; refused while any node is locked."""
        self._check_reset()
        self.pool.free(self._tree.owned_slots())
        self._tree.reset()
        self._init_namespaces()

    # -- inspection ------------------------------------------------------------------------

    def cached_sequences(self) -> list[tuple[Hashable, np.ndarray, np.ndarray]]:
        """``(namespace, tokens, slots)`` of every root-to-leaf path (for tests and debugging)."""
        return [(self._ns_names[ns], t, s) for ns, t, s in self._tree.cached_sequences()]

    def check_invariants(self) -> None:
        """Raise AssertionError when the tree's bookkeeping is inconsistent."""
        self._tree.check_invariants()
        owned = self._tree.owned_slots()
        assert self.pool.is_allocated(owned).all(), "tree holds a free slot"
        roots = {ns for ns, _, _ in self._tree.roots()}
        assert roots <= set(self._ns_names), "a root without a namespace name"
        assert all(self._ns_ids[name] == ns for ns, name in self._ns_names.items())
