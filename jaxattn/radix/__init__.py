"""Cross-request prefix cache (SGLang RadixAttention), host side; numpy only, no jax.

``RadixCache(pool, ...)`` builds the C++ tree (``impl="native"``) when its extension module
is built, else the Python spec (``impl="python"``); ``cache.impl`` and :func:`default_impl`
say which.
"""

from jaxattn.radix.native_tree import NativeNode, NativeRadixCache
from jaxattn.radix.python_tree import PythonRadixCache, TreeNode
from jaxattn.radix.radix_cache import IMPLEMENTATIONS, MatchResult, RadixCache, default_impl
from jaxattn.radix.token_pool import TokenPool

__all__ = [
    "IMPLEMENTATIONS",
    "MatchResult",
    "NativeNode",
    "NativeRadixCache",
    "PythonRadixCache",
    "RadixCache",
    "TokenPool",
    "TreeNode",
    "default_impl",
]
