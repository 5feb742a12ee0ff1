"""Models that run on the paged KV cache through the public attention ops."""

from . import llama
from .llama import LlamaConfig, forward_dense, init_params, load_checkpoint

__all__ = ["LlamaConfig", "forward_dense", "init_params", "llama", "load_checkpoint"]
