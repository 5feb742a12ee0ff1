"""jaxattn: paged / radix KV-cache memory management and paged attention kernels for JAX."""

from . import layout, reference
from .ops import (
    BACKENDS,
    available_backends,
    extend_attention,
    merge_states,
    paged_attention,
    prefix_prefill,
)

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "available_backends",
    "extend_attention",
    "layout",
    "merge_states",
    "paged_attention",
    "prefix_prefill",
    "reference",
]
