"""Scales of an FP8 KV pool (``CacheConfig.kv_scales``) from calibration prompts.

The dense model (:func:`jaxattn.models.llama.dense_kv`, no cache) runs the prompts and
returns the K (after RoPE) and V each layer writes; the scale of layer ``l`` and KV head
``h`` is then :func:`jaxattn.quant.fp8_scales` of that layer's K / V: the largest finite
``|x|`` of the head over every calibration token, divided by the format's largest finite
value, so that the calibration batch's largest element lands on it. Tokens beyond the
calibration range saturate (:func:`jaxattn.write_kv`), they never become inf or NaN.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.models.llama import LlamaConfig, dense_kv
from jaxattn.quant import fp8_scales

from .config import KV_DTYPES, bucket, fp8_format, padded_batches, token_ids

__all__ = ["calibrate_kv_scales"]


def calibrate_kv_scales(cfg: LlamaConfig, params: dict, prompts, kv_dtype, *, rows: int = 8):
    """``(k_scales, v_scales)``, numpy float32 ``[num_layers, num_kv_heads]`` each, for a
    pool of ``kv_dtype`` (``"fp8_e4m3"`` / ``"fp8_e5m2"`` or the dtypes) holding the KV of
    ``cfg`` with ``params``: per layer and KV head, the amax of K and V over ``prompts``
    (lists of token ids) divided by the format's max (a head whose calibration values are
    all zero gets 1.0). Pass the pair as ``CacheConfig(kv_scales=...)``.

    The prompts run ``rows`` at a time, padded to one power-of-two length (padding does not
    count); use a few prompts of the workload to be served.
    """
    if not isinstance(cfg, LlamaConfig):
        raise TypeError(f"cfg must be a LlamaConfig, got {type(cfg).__name__}")
    name = fp8_format(kv_dtype, "kv_dtype")
    if isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or rows < 1:
        raise ValueError(f"rows must be an int >= 1, got {rows!r}")
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    prompts = list(prompts) if prompts is not None else []
    if not prompts:
        raise ValueError("prompts must hold at least one prompt (a list of token ids)")
    checked = [token_ids(f"prompts[{i}]", p, cfg.vocab_size) for i, p in enumerate(prompts)]
    longest = max(len(p) for p in checked)
    if longest > cfg.max_position_embeddings:
        raise ValueError(
            f"prompts reach {longest} tokens, more than the model's "
            f"max_position_embeddings={cfg.max_position_embeddings}"
        )
    # The padded length is a shape, not a position any token takes: it may pass the limit.
    length = bucket(longest, 16)
    ks, vs = [], []
    # Padding rows have length 0: their K and V are zero and move no amax.
    for _, tokens, lengths in padded_batches(checked, rows, length, empty_length=0):
        k, v = dense_kv(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths))
        ks.append(k)
        vs.append(v)
    # [layers, tokens, kv heads, head dim]: fp8_scales per layer (padding is zero).
    k_all = jnp.concatenate(ks, axis=1)
    v_all = jnp.concatenate(vs, axis=1)
    dtype = jnp.dtype(KV_DTYPES[name])
    k_scales, v_scales = jax.vmap(lambda k, v: fp8_scales(k, v, dtype))(k_all, v_all)
    return np.asarray(k_scales, np.float32), np.asarray(v_scales, np.float32)
