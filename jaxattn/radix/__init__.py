"""Cross-request prefix cache (SGLang RadixAttention), host side."""

from jaxattn.radix.radix_cache import MatchResult, RadixCache, TreeNode
from jaxattn.radix.token_pool import TokenPool

__all__ = ["MatchResult", "RadixCache", "TokenPool", "TreeNode"]
