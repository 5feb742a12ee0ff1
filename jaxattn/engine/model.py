"""What the engine needs of a model: :class:`CausalLM`.

The engine never imports a model by name. It takes any object with these attributes and
methods - :class:`jaxattn.models.llama.LlamaConfig` is one - and hands it to the jitted
programs as a static argument, so the object must be hashable (a frozen dataclass).

The forward passes take the paged pool of all layers as one K and one V array (layer
``l`` owns pages ``[l * num_pages, (l + 1) * num_pages)``), write the new tokens' K/V into
it and return ``(logits f32[rows, vocab], k_cache, v_cache)``; ``batch`` is the model's
:class:`~jaxattn.models.llama.ExtendBatch` / :class:`~jaxattn.models.llama.DecodeBatch`
record (layer-0 page ids and slots), and ``**options`` are static attention choices
(``layout``, ``attention``, ``implementation``, ``partition_size``, ``kernels``).

A quantised pool (``CacheConfig.kv_dtype``): ``init_kv_cache(..., dtype=)`` allocates it in
that dtype, ``kv_bytes_per_token(kv_dtype)`` counts its itemsize, and the batch records
carry the per-layer, per-KV-head scales (``k_scale`` / ``v_scale``, f32 ``[num_layers,
num_kv_heads]``) that the model hands to ``write_kv`` and to every attention op.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["CausalLM", "check_model"]


@runtime_checkable
class CausalLM(Protocol):
    vocab_size: int
    max_position_embeddings: int
    eos_token_id: tuple[int, ...]
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int

    @property
    def jnp_dtype(self) -> Any: ...

    def kv_bytes_per_token(self, kv_dtype=None) -> int: ...

    def init_kv_cache(
        self, num_pages: int, page_size: int, *, layout: str = "bshd", dtype=None
    ): ...

    def serving_params(self, params: Any, *, shards: int = 1, unroll: bool = True) -> Any: ...

    def forward_extend(self, params, k_cache, v_cache, batch, **options): ...

    def forward_decode(self, params, k_cache, v_cache, batch, **options): ...


def check_model(model: object) -> CausalLM:
    """``model`` if it has the protocol (and is hashable), else a TypeError saying what
    is missing."""
    if not isinstance(model, CausalLM):
        missing = [
            name for name in (*CausalLM.__annotations__, *_METHODS) if not hasattr(model, name)
        ]
        raise TypeError(
            "cfg must be a model with the engine's CausalLM protocol (e.g. a "
            f"jaxattn.models.llama.LlamaConfig), got {type(model).__name__} lacking {missing}"
        )
    try:
        hash(model)
    except TypeError:
        raise TypeError(
            f"cfg must be hashable (the jitted steps take it as a static argument), "
            f"got {type(model).__name__}"
        ) from None
    return model


_METHODS = (
    "jnp_dtype",
    "kv_bytes_per_token",
    "init_kv_cache",
    "serving_params",
    "forward_extend",
    "forward_decode",
)
