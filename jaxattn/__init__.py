"""jaxattn: paged / radix KV-cache memory management and paged attention kernels for JAX."""

from . import backend, env, kv, layout, ops, paging, radix, reference
from .backend import checked
from .kv import copy_blocks, write_kv
from .ops import (
    BACKENDS,
    available_backends,
    default_implementations,
    extend_attention,
    merge_states,
    paged_attention,
    prefix_prefill,
)

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "available_backends",
    "backend",
    "checked",
    "copy_blocks",
    "default_implementations",
    "env",
    "extend_attention",
    "kv",
    "layout",
    "merge_states",
    "ops",
    "paged_attention",
    "paging",
    "prefix_prefill",
    "radix",
    "reference",
    "write_kv",
]
