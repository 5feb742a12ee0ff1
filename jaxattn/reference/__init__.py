"""The spec: pure ``jax.numpy`` attention, float32 accumulation, same signatures as the
public ops in :mod:`jaxattn.ops` (without ``implementation=``)."""

from .attention import (
    attention_states,
    cascade_attention,
    default_scale,
    extend_attention,
    masked_attention,
    merge_states,
    output_dtype,
    paged_attention,
    prefix_prefill,
)

__all__ = [
    "attention_states",
    "cascade_attention",
    "default_scale",
    "extend_attention",
    "masked_attention",
    "merge_states",
    "output_dtype",
    "paged_attention",
    "prefix_prefill",
]
