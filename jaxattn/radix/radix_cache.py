"""A radix tree over KV slots for cross-request prefix reuse (SGLang RadixAttention).

Each edge holds a run of token ids (``key``) and the pool slots holding their KV
(``value``); the concatenated values along a root-to-node path are the KV slots of that
token prefix. A request matches its prompt against the tree, locks the matched node
(``inc_lock_ref`` pins the whole path), computes only the rest, and inserts its tokens when
done, handing its new slots over to the tree. When the pool runs dry, ``evict`` frees
unlocked leaves, least recently used first, shrinking the tree from the leaves inwards: an
internal node is never evicted under its children.

Two implementations keep one behaviour, result for result and eviction for eviction:

* ``"python"`` (:class:`~jaxattn.radix.python_tree.PythonRadixCache`): the spec, numpy
  only, short enough to read in one sitting;
* ``"native"`` (:class:`~jaxattn.radix.native_tree.NativeRadixCache`): the same tree in C++
  (the ``_radix_tree`` extension module), several times faster per call; a differential
  fuzz test runs random operation scripts through both and compares every result.

``RadixCache(pool, ...)`` builds ``impl=`` (``None``: :func:`default_impl`, the native tree
when its module is built, else the spec); ``cache.impl`` says which one it got.

Recency is exact per token. Every node on a matched or inserted path counts as accessed
(recency for LRU, a hit for LFU), and nothing else does: when a match ends inside an edge,
the edge is split and only its matched upper part is refreshed, while the split-off lower
part keeps its old access time and hit count, because no request used those tokens.
(SGLang's tree also stamps the lower part, since it updates a child's time before it splits
it; here the tail of a long answer that nobody re-reads ages out first.)

Invariants (checked by ``check_invariants``):

* every slot is held by at most one node, and every held slot is allocated in the pool;
* a node's ``lock_ref`` is at least the sum of its children's (locks pin whole paths);
* ``evictable_size`` / ``protected_size`` count the slots of unlocked / locked nodes;
* with ``page_size > 1`` every edge length is a multiple of ``page_size``;
* every unlocked leaf, and nothing else, is an eviction candidate, at its current priority.

Different ``namespace`` keys (a LoRA adapter id, a per-tenant cache salt) get separate
trees, so equal tokens under different namespaces never share KV.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import numpy as np

from jaxattn.paging.allocator import SlotAllocator

__all__ = ["IMPLEMENTATIONS", "MatchResult", "RadixCache", "default_impl"]

IMPLEMENTATIONS = ("python", "native")
_EVICTION_POLICIES = ("lru", "lfu")


class MatchResult(NamedTuple):
    """``indices``: i32[length] slots of the matched prefix; ``node``: where it ends."""

    indices: np.ndarray
    node: Any  # TreeNode (python) or NativeNode (native)
    length: int


def as_tokens(name: str, tokens: object) -> np.ndarray:
    """Coerce ``tokens`` to a 1-D int64 array or raise naming the argument."""
    arr = np.asarray(tokens)
    if arr.size == 0:
        return np.zeros((0,), np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def default_impl() -> str:
    """``"native"`` when the C++ tree's module loads, else ``"python"``."""
    from jaxattn.radix import native_tree

    return "native" if native_tree.is_available() else "python"


def _implementation(impl: str | None) -> type[RadixCache]:
    if impl is None:
        impl = default_impl()
    if impl == "python":
        from jaxattn.radix.python_tree import PythonRadixCache

        return PythonRadixCache
    if impl == "native":
        from jaxattn.radix import native_tree

        native_tree.require()
        return native_tree.NativeRadixCache
    raise ValueError(f"impl must be None or one of {IMPLEMENTATIONS}, got {impl!r}")


class RadixCache:
    """Prefix cache over the slots of ``pool``.

    Args:
      pool: the slot allocator whose slots the tree holds, any object with the
        :class:`~jaxattn.paging.SlotAllocator` protocol (``num_slots``, ``page_size``,
        ``available``, ``alloc``, ``free``, ``is_allocated``): a
        :class:`~jaxattn.radix.TokenPool`, or the slot view of a ref-counted
        :class:`~jaxattn.paging.BlockAllocator` shared with block tables. Evicted slots go
        back to it through ``free``.
      page_size: match and insert whole pages only. Keys are cut to a multiple of
        ``page_size`` (the partial last page of a request is never cached: it stays with
        the caller) and edges split only at page boundaries, so a node's slots are whole
        pages and can be freed without touching another node's KV. The pool's own
        ``page_size`` must be 1 or equal to this one.
      eviction: ``"lru"`` (least recently matched first) or ``"lfu"`` (fewest hits first,
        ties broken by recency).
      impl: ``"python"`` (the spec), ``"native"`` (C++) or None (:func:`default_impl`).

    Typical request life::

        m = cache.match_prefix(prompt)            # m.indices: KV already computed
        cache.inc_lock_ref(m.node)                # pin it while the request runs
        new = pool.alloc(len(prompt) - m.length)  # (evict first if this returns None)
        ... prefill prompt[m.length:] into `new`, decode ...
        n = cache.insert(tokens, np.concatenate([m.indices, new_and_decoded]))
        pool.free(own_slots[m.length:n])          # cached meanwhile by another request
        cache.dec_lock_ref(m.node)

    Methods (each implementation's docstrings give the details):
      ``match_prefix(tokens, *, namespace=None) -> MatchResult``,
      ``prefix_len(tokens, *, namespace=None) -> int`` (changes nothing),
      ``insert(tokens, indices, *, namespace=None) -> int`` (tokens cached before the call),
      ``inc_lock_ref(node)`` / ``dec_lock_ref(node)`` (the change of ``protected_size``),
      ``evict(num_tokens) -> int``, ``reset()``, ``cached_sequences()``,
      ``check_invariants()``, and the sizes below.
    """

    impl: str = ""

    def __new__(cls, *args, **kwargs):
        if cls is RadixCache:
            cls = _implementation(kwargs.get("impl"))
        return super().__new__(cls)

    def __init__(
        self,
        pool: SlotAllocator,
        *,
        page_size: int = 1,
        eviction: str = "lru",
        impl: str | None = None,
    ):
        if impl is not None and impl != self.impl:
            raise ValueError(f"{type(self).__name__} is impl={self.impl!r}, not {impl!r}")
        if not isinstance(pool, SlotAllocator):
            raise TypeError(
                "pool must be a slot allocator (jaxattn.paging.SlotAllocator: num_slots, "
                f"page_size, available, alloc, free, is_allocated), got {type(pool).__name__}"
            )
        if isinstance(page_size, bool) or not isinstance(page_size, numbers.Integral):
            raise TypeError(f"page_size must be an int, got {page_size!r}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if pool.page_size not in (1, page_size):
            raise ValueError(
                f"pool.page_size={pool.page_size} must be 1 or equal to {page_size=}: "
                "freeing a node must free whole pages that no other node uses"
            )
        if eviction not in _EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {_EVICTION_POLICIES}, got {eviction!r}")
        self.pool = pool
        self.page_size = int(page_size)
        self.eviction = eviction

    @property
    def evictable_size(self) -> int:
        """Cached tokens that ``evict`` may free (no running request uses them)."""
        raise NotImplementedError

    @property
    def protected_size(self) -> int:
        """Cached tokens pinned by a lock."""
        raise NotImplementedError

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    @staticmethod
    def _check_evict_arg(num_tokens: object) -> None:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Integral):
            raise TypeError(f"num_tokens must be an int, got {num_tokens!r}")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")

    def _check_reset(self) -> None:
        if self.protected_size:
            raise RuntimeError(
                f"cannot reset: {self.protected_size} cached tokens are locked by requests"
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(impl={self.impl!r}, page_size={self.page_size}, "
            f"eviction={self.eviction!r}, total_size={self.total_size}, "
            f"protected_size={self.protected_size})"
        )
