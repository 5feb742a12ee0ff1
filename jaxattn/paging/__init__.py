"""Paged KV memory management (vLLM PagedAttention).

Host side (numpy): :class:`BlockAllocator`, :class:`BlockManager`. Functional side (a pytree
of arrays with pure jit-able functions, the same semantics op for op): :class:`PageTable`.
"""

from jaxattn.paging.block_manager import BlockAllocator, BlockManager, NoFreeBlocksError
from jaxattn.paging.page_table import PageTable, Status

__all__ = ["BlockAllocator", "BlockManager", "NoFreeBlocksError", "PageTable", "Status"]
