"""Paged KV memory management (vLLM PagedAttention).

Host side (numpy): :class:`BlockAllocator`, :class:`BlockManager`. Functional side (a pytree
of arrays with pure jit-able functions, the same semantics op for op): :class:`PageTable`.
The functional side needs jax and is imported on first use, so the host side imports with
numpy alone.
"""

import importlib

from jaxattn.paging.block_manager import BlockAllocator, BlockManager, NoFreeBlocksError

__all__ = ["BlockAllocator", "BlockManager", "NoFreeBlocksError", "PageTable", "Status"]

_LAZY = {"PageTable", "Status"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'jaxattn.paging' has no attribute {name!r}")
    value = getattr(importlib.import_module("jaxattn.paging.page_table"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *__all__})
