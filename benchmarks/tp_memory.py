"""Tensor parallelism on paper: per-device memory and communication for Llama-3 shapes.

Computed, not measured. For each model and tensor-parallel degree N, from the shardings
:mod:`jaxattn.sharding` applies (heads and MLP split Megatron-style, the KV pool split by
KV head, embedding and norms replicated, ``lm_head`` split by vocabulary):

* weights per device;
* KV cache per device per token and per 1024-token sequence; how many tokens of KV fit
  in ``--hbm-gib`` per device next to the weights (every device holds a slice of every
  token, so this is also the whole group's capacity);
* communication per device: each layer ends its attention and its MLP with a
  row-parallel matmul whose partial sums are all-reduced, 2 all-reduces of the hidden
  state ``[tokens, hidden]`` per layer; a ring all-reduce sends ``2 (N - 1) / N * size``
  bytes per device. Per token, so a decode step of batch B sends B times the per-token
  figure and a prefill chunk of T tokens T times. Given for bf16 partial sums (what
  Megatron and vLLM reduce) and as the current model compiles them (its matmuls return
  float32 before the cast, so XLA all-reduces float32: twice the bytes). The logits of a
  vocabulary-split ``lm_head``, when gathered for sampling, add ``(N - 1) / N * vocab * 4``
  bytes per sampled row (listed apart).

    python benchmarks/tp_memory.py [--decode-batch 64] [--json benchmarks/results/tp_memory.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import table, write_json  # noqa: E402

from jaxattn import layout as L  # noqa: E402
from jaxattn import sharding as S  # noqa: E402
from jaxattn.models.llama import LlamaConfig  # noqa: E402

MODELS = {
    "Llama-3-8B": dict(
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
    ),
    "Llama-3-70B": dict(
        num_hidden_layers=80,
        hidden_size=8192,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=128256,
    ),
}
SEQ_TOKENS = 1024
KIB, MIB, GIB = 2**10, 2**20, 2**30


def param_shapes(cfg: LlamaConfig) -> dict:
    """The parameter pytree of ``init_params(cfg, key)`` as ShapeDtypeStructs (no memory)."""
    dt = cfg.jnp_dtype
    n, h, i, v = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, dt)
    params = {
        "embed": sds(v, h),
        "layers": {
            "attn_norm": sds(n, h),
            "wq": sds(n, h, cfg.q_size),
            "wk": sds(n, h, cfg.kv_size),
            "wv": sds(n, h, cfg.kv_size),
            "wo": sds(n, cfg.q_size, h),
            "mlp_norm": sds(n, h),
            "w_gate": sds(n, h, i),
            "w_up": sds(n, h, i),
            "w_down": sds(n, i, h),
        },
        "norm": sds(h),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = sds(h, v)
    return params


def weight_bytes_per_device(cfg: LlamaConfig, tp: int) -> int:
    params = param_shapes(cfg)
    specs = S.param_specs(params, cfg, tp)
    leaves = jax.tree.leaves(params)
    spec_leaves = jax.tree.leaves(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
    return sum(
        S.bytes_per_device(x.shape, x.dtype, s, tp)
        for x, s in zip(leaves, spec_leaves, strict=True)
    )


def kv_bytes_per_token_per_device(cfg: LlamaConfig, tp: int, layout: str = "bshd") -> int:
    """K and V of one token over all layers, the part one device holds."""
    S.check_heads(tp, cfg.num_attention_heads, cfg.num_key_value_heads)
    total = 0
    for kind in ("k", "v"):
        shape = L.cache_shape(
            layout, kind, 1, 1, cfg.num_key_value_heads, cfg.head_dim, cfg.jnp_dtype
        )
        total += S.bytes_per_device(shape, cfg.jnp_dtype, S.kv_cache_spec(layout, kind), tp)
    return total * cfg.num_hidden_layers


def ring_all_reduce_bytes(size: int, tp: int) -> float:
    """Bytes each device sends in a ring all-reduce of ``size`` bytes."""
    return 2 * (tp - 1) / tp * size


def allreduce_bytes_per_token(cfg: LlamaConfig, tp: int, itemsize: int) -> float:
    per_layer = 2 * ring_all_reduce_bytes(cfg.hidden_size * itemsize, tp)
    return cfg.num_hidden_layers * per_layer


def row(name: str, cfg: LlamaConfig, tp: int, hbm_bytes: float, decode_batch: int) -> dict:
    weights = weight_bytes_per_device(cfg, tp)
    kv_token = kv_bytes_per_token_per_device(cfg, tp)
    itemsize = np.dtype(cfg.jnp_dtype).itemsize
    free = hbm_bytes - weights
    split_vocab = cfg.vocab_size % tp == 0
    return dict(
        model=name,
        tp=tp,
        weights_bytes=weights,
        weights_gib=weights / GIB,
        kv_bytes_per_token=kv_token,
        kv_kib_per_token=kv_token / KIB,
        kv_bytes_per_seq=kv_token * SEQ_TOKENS,
        kv_mib_per_seq=kv_token * SEQ_TOKENS / MIB,
        kv_tokens_fit=int(free // kv_token) if free > 0 else 0,
        allreduces_per_layer=2,
        allreduce_bytes_per_token_bf16=allreduce_bytes_per_token(cfg, tp, itemsize),
        allreduce_kib_per_token_bf16=allreduce_bytes_per_token(cfg, tp, itemsize) / KIB,
        decode_batch=decode_batch,
        allreduce_mib_per_decode_step_bf16=decode_batch
        * allreduce_bytes_per_token(cfg, tp, itemsize)
        / MIB,
        allreduce_bytes_per_token_f32=allreduce_bytes_per_token(cfg, tp, 4),
        allreduce_kib_per_token_f32=allreduce_bytes_per_token(cfg, tp, 4) / KIB,
        logits_gather_bytes_per_row=(tp - 1) / tp * cfg.vocab_size * 4 if split_vocab else 0.0,
        logits_gather_kib_per_row=((tp - 1) / tp * cfg.vocab_size * 4 if split_vocab else 0.0)
        / KIB,
    )


COLUMNS = [
    ("model", "model", ""),
    ("tp", "TP", "d"),
    ("weights_gib", "weights GiB/dev", ".2f"),
    ("kv_kib_per_token", "KV KiB/token/dev", ".0f"),
    ("kv_mib_per_seq", "KV MiB/1024-tok seq/dev", ".0f"),
    ("kv_tokens_fit", "KV tokens fit", ",d"),
    ("allreduce_kib_per_token_bf16", "all-reduce KiB/token/dev bf16", ".0f"),
    ("allreduce_kib_per_token_f32", "same, f32 as compiled", ".0f"),
    ("allreduce_mib_per_decode_step_bf16", "all-reduce MiB/decode step/dev bf16", ".1f"),
    ("logits_gather_kib_per_row", "logits gather KiB/row/dev", ".0f"),
]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--hbm-gib",
        type=float,
        default=140.0,
        help="memory per device for weights + KV (activations and workspace ignored)",
    )
    parser.add_argument("--decode-batch", type=int, default=64, help="sequences per decode step")
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    rows = []
    for name, shape in MODELS.items():
        cfg = LlamaConfig(**shape, dtype=args.dtype)
        rows += [row(name, cfg, tp, args.hbm_gib * GIB, args.decode_batch) for tp in args.tp]
    payload = dict(
        what="per-device memory and communication of tensor-parallel Llama-3 (computed)",
        dtype=args.dtype,
        hbm_gib=args.hbm_gib,
        decode_batch=args.decode_batch,
        seq_tokens=SEQ_TOKENS,
        sharding=(
            "q/k/v, gate/up column-parallel; o, down row-parallel; KV pool split by KV head; "
            "embed, norms replicated; lm_head split by vocab"
        ),
        ring_all_reduce="2 (N-1)/N * size bytes sent per device; 2 per layer of [tokens, hidden]",
        jax=jax.__version__,
        rows=rows,
    )
    print(table(rows, COLUMNS))
    print(
        f"\nKV tokens fit: {args.hbm_gib:g} GiB per device minus the weights. Decode step: "
        f"batch {args.decode_batch}, one token per sequence; a prefill chunk of T tokens "
        "sends T times the per-token figure.\n"
    )
    print(json.dumps(payload, indent=2))
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
