"""Paged KV memory management (vLLM PagedAttention), host side."""

from jaxattn.paging.block_manager import BlockAllocator, BlockManager, NoFreeBlocksError

__all__ = ["BlockAllocator", "BlockManager", "NoFreeBlocksError"]
