"""Pallas GPU kernels: paged decode, extend and prefix-prefill attention.

Lowering: the kernels are written for the Pallas *Triton* lowering
(``jax.experimental.pallas.triton``), not Mosaic GPU. Reasons:

* the paged KV reads are gathers (a block-table or slot lookup per token). The Triton
  lowering expresses them as pointer tensors with masked loads, which Triton pipelines
  with asynchronous copies; Mosaic GPU moves data with TMA, whose tiles are rectangles
  of one tensor, so a page-granular gather would need one TMA per page;
* the same kernel source runs in Pallas interpret mode on the CPU, which is how CI
  tests it, and compiles for AMD GPUs as well as NVIDIA;
* on Hopper, Triton turns the tile dots into wgmma by itself, which is what the extend
  kernel (compute bound) needs; decode is memory bound and needs wide loads in flight,
  not a particular matrix instruction.

Measured on an H200 (bf16, D=128): decode reads the paged KV at 75-105% of the
device-to-device copy bandwidth (read + write), twice JAX's own Pallas paged decode;
extend reaches about 250-280 TFLOP/s, half of cuDNN's flash attention, which keeps
K/V tiles flowing through TMA with warp-specialised pipelines. That gap, and jax 0.11
deprecating the Triton lowering (it warns at each lowering), make a Mosaic GPU
version of the extend kernel the next step; decode has no such gap to close.

Every entry point takes ``interpret=None`` (interpret exactly when the default backend
is the CPU) and raises ``NotImplementedError`` for arguments or platforms it cannot
serve, so ``jaxattn.ops`` can fall back to another backend.

Inside the kernels the logits are in base 2 (``scale * log2(e)`` folded once, ``exp2``
in the loops); what the kernels return never exposes that.
"""

import jax

from .decode import DecodeConfig, choose_partition_size, paged_attention
from .extend import ExtendConfig, extend_attention, prefix_prefill


def is_available() -> bool:
    """True where the kernels can run: compiled on a GPU, interpreted on the CPU."""
    return jax.default_backend() in ("cpu", "gpu", "cuda", "rocm")


__all__ = [
    "DecodeConfig",
    "ExtendConfig",
    "choose_partition_size",
    "extend_attention",
    "is_available",
    "paged_attention",
    "prefix_prefill",
]
