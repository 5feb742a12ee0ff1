"""Paged KV memory management (vLLM PagedAttention).

Host side (numpy): :class:`BlockAllocator` (the pool's one ref-counted free list, seen as
pages through :class:`PageAllocator` or as token slots through :class:`SlotAllocator`),
:class:`BlockManager` (block tables, copy-on-write, fork, slot mapping). Functional side (a
pytree of arrays with pure jit-able functions, the same semantics op for op):
:class:`PageTable`. The functional side needs jax and is imported on first use, so the
host side imports with numpy alone. :func:`token_slots` is the table-to-slot formula both
sides use.
"""

import importlib

from jaxattn.paging.allocator import (
    BlockAllocator,
    NoFreeBlocksError,
    PageAllocator,
    SlotAllocator,
    SlotView,
)
from jaxattn.paging.block_manager import BlockManager
from jaxattn.paging.slots import token_slots

__all__ = [
    "BlockAllocator",
    "BlockManager",
    "NoFreeBlocksError",
    "PageAllocator",
    "PageTable",
    "SlotAllocator",
    "SlotView",
    "Status",
    "token_slots",
]

_LAZY = {"PageTable", "Status"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'jaxattn.paging' has no attribute {name!r}")
    value = getattr(importlib.import_module("jaxattn.paging.page_table"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *__all__})
