"""FP8 KV caches: how far the outputs move, split into the kernels' part and the format's.

    python benchmarks/fp8_accuracy.py --impl native,pallas --json fp8_accuracy.json

For each cache format (bfloat16 as the baseline, float8_e4m3fn, float8_e5m2), the same
K/V data is written the way a serving step writes it (``write_kv`` with per-head scales from
``fp8_scales`` of the data; none for bfloat16) and attention is run with bfloat16 q through
each implementation, for decode (``paged_attention``) and prefix prefill (``prefix_prefill``):

* kernel error: the output against the float32 spec over the *same stored cache* (q and the
  dequantised K/V in float32, HIGHEST precision): what the kernel adds (the bf16 output, P
  rounded for the tensor cores);
* quantisation error: the output against the float32 spec over the *bfloat16* cache of the
  same data: what storing the cache in the format costs, kernel included;
* the same two numbers for the bfloat16 cache, for scale.

Errors are ||out - want|| / ||want|| over the valid rows, and the largest |out - want| over
max |want|. Two data sets (``make_data``): ``normal`` (normal K/V, each head's logit spread
0.5..2.5, V heads 0.25..4 in magnitude) and ``outliers`` (the same with a few K channels 10x
the others at the same logit spread, as in LLM key caches: a per-head scale then leaves the
other channels fewer of the format's steps).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import jaxattn  # noqa: E402

FORMATS = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def make_data(rng, num_tokens, hkv, d, kind):
    """float32 K, V [T, Hkv, D] as a model would produce them, for a unit-normal q: each
    head's logits ``q.k / sqrt(D)`` have a standard deviation between 0.5 and 2.5 (as in
    trained models: softmax neither flat nor one-hot), V heads 0.25..4 in magnitude.
    ``outliers``: a few K channels 10x the others, at the same logit spread."""
    k_mag = rng.uniform(0.5, 2.5, size=(1, hkv, 1)).astype(np.float32)
    v_mag = rng.uniform(0.25, 4.0, size=(1, hkv, 1)).astype(np.float32)
    k = rng.standard_normal((num_tokens, hkv, d), dtype=np.float32)
    v = rng.standard_normal((num_tokens, hkv, d), dtype=np.float32) * v_mag
    if kind == "outliers":
        chans = rng.choice(d, size=max(1, d // 32), replace=False)
        k[:, :, chans] *= 10.0
        k /= np.sqrt((d - chans.size + 100.0 * chans.size) / d)  # the same logit spread
    return k * k_mag, v


def written_cache(k, v, fmt, num_pages, page_size, layout):
    """The cache ``write_kv`` leaves for tokens 0..T-1 in slots 0..T-1, and its scales."""
    t, hkv, d = k.shape
    dtype = jnp.dtype(fmt)
    kc = jnp.zeros(
        jaxattn.layout.cache_shape(layout, "k", num_pages, page_size, hkv, d, dtype), dtype
    )
    vc = jnp.zeros(
        jaxattn.layout.cache_shape(layout, "v", num_pages, page_size, hkv, d, dtype), dtype
    )
    scales = {}
    if jaxattn.quant.is_fp8(dtype):
        ks, vs = jaxattn.fp8_scales(jnp.asarray(k), jnp.asarray(v), dtype)
        scales = dict(k_scale=ks, v_scale=vs)
    kc, vc = jaxattn.write_kv(
        kc,
        vc,
        jnp.asarray(k),
        jnp.asarray(v),
        jnp.arange(t, dtype=jnp.int32),
        layout=layout,
        **scales,
    )
    return kc, vc, scales


def rel_errors(out, want):
    a = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    e = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    rel = float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30))
    mx = float(np.abs(a - e).max() / max(np.abs(e).max(), 1e-30))
    return rel, mx


def spec(op, args, kw):
    """The float32 spec: q cast to float32 (the cache is dequantised by the spec itself)."""
    q = args[0].astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        return op(q, *args[1:], implementation="reference", **kw)


def problem(name, kc, vc, q, tables, args):
    """(op, positional arguments) of the decode or prefill problem over caches kc, vc."""
    if name == "decode":
        b = args.decode_batch
        lens = jnp.full((b,), args.decode_ctx, jnp.int32)
        return jaxattn.paged_attention, (q, kc, vc, tables[:b], lens)
    pb, new = args.prefill_batch, args.prefill_new
    cu = jnp.arange(pb + 1, dtype=jnp.int32) * new
    lens = jnp.full((pb,), args.prefill_prefix + new, jnp.int32)
    return jaxattn.prefix_prefill, (q, kc, vc, cu, tables[:pb], lens)


def run_impl(op, impl, operands, kw):
    return jax.jit(lambda *x: op(*x, implementation=impl, **kw))(*operands)


def run(args):
    rng = np.random.default_rng(args.seed)
    hq, hkv = (int(x) for x in args.heads.split("/"))
    d, page = args.head_dim, args.page_size
    impls = common.parse_impls(args.impl)
    rows = []
    per_seq = max(args.decode_ctx, args.prefill_prefix + args.prefill_new)
    pages_per_seq = -(-per_seq // page)
    num_pages = max(args.decode_batch, args.prefill_batch) * pages_per_seq
    tables = jnp.arange(num_pages, dtype=jnp.int32).reshape(-1, pages_per_seq)
    queries = {
        "decode": (args.decode_batch, hq, d),
        "prefill": (args.prefill_batch * args.prefill_new, hq, d),
    }
    for kind in ("normal", "outliers"):
        k, v = make_data(rng, num_pages * page, hkv, d, kind)
        caches = {fmt: written_cache(k, v, fmt, num_pages, page, args.layout) for fmt in FORMATS}
        for name, q_shape in queries.items():
            q = jnp.asarray(rng.standard_normal(q_shape, np.float32), jnp.bfloat16)
            kw = dict(layout=args.layout)
            op, bf16_args = problem(name, *caches["bfloat16"][:2], q, tables, args)
            want_bf16 = spec(op, bf16_args, kw)
            for fmt in FORMATS:
                kc, vc, scales = caches[fmt]
                op, operands = problem(name, kc, vc, q, tables, args)
                want_same = spec(op, operands, {**kw, **scales})
                for impl in impls:
                    row = dict(data=kind, op=name, cache=fmt, impl=impl)
                    label = f"{kind:8s} {name:7s} {fmt:14s} {impl:9s}"
                    try:
                        out = run_impl(op, impl, operands, {**kw, **scales})
                    except NotImplementedError as e:
                        row["skipped"] = str(e)[:200]
                        rows.append(row)
                        print(f"{label} skipped: {e}", flush=True)
                        continue
                    row["kernel_rel"], row["kernel_max"] = rel_errors(out, want_same)
                    row["quant_rel"], row["quant_max"] = rel_errors(out, want_bf16)
                    rows.append(row)
                    print(
                        f"{label} kernel {row['kernel_rel']:.2e} (max {row['kernel_max']:.2e})  "
                        f"vs bf16 cache {row['quant_rel']:.2e} (max {row['quant_max']:.2e})",
                        flush=True,
                    )
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", default="reference,pallas,native")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--heads", default="32/8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--layout", default="bshd")
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--decode-ctx", type=int, default=2048)
    p.add_argument("--prefill-batch", type=int, default=2)
    p.add_argument("--prefill-prefix", type=int, default=1024)
    p.add_argument("--prefill-new", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke run)")
    args = p.parse_args(argv)
    if args.small:
        args.heads, args.head_dim = "8/2", 64
        args.decode_batch, args.decode_ctx = 2, 100
        args.prefill_batch, args.prefill_prefix, args.prefill_new = 1, 40, 24
    rows = run(args)
    done = [r for r in rows if "kernel_rel" in r]
    print()
    print(
        common.table(
            done,
            [
                ("data", "data", ""),
                ("op", "op", ""),
                ("cache", "cache", ""),
                ("impl", "impl", ""),
                ("kernel_rel", "kernel err (rel L2)", ".2e"),
                ("kernel_max", "kernel err (max)", ".2e"),
                ("quant_rel", "vs bf16 cache (rel L2)", ".2e"),
                ("quant_max", "vs bf16 cache (max)", ".2e"),
            ],
        )
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                dict(
                    env=common.environment(),
                    params=vars(args) | {"json": str(args.json)},
                    rows=rows,
                ),
                indent=1,
            )
        )
    return rows


if __name__ == "__main__":
    main()
