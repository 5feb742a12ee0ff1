"""Greedy parity of FP8 KV pools on a trained checkpoint.

A random model's logits are flat, so near-ties decide many of its greedy tokens; a trained
model's are not. This script trains a small byte-level Llama (GQA) on the Python standard
library's source files (the running interpreter's own, so the data is the same wherever the
script runs; the held-out files give the prompts), writes it as a Hugging Face checkpoint
(``llama.save_checkpoint``), loads that back (``llama.load_checkpoint``), and serves the
prompts greedily from a pool of the model's dtype and from FP8 pools with scales calibrated
on a few prompts (``calibrate_kv_scales``). For each pool: every output checked against the
dense no-cache model (``check_outputs``, with the pool format's tolerance), the generated
tokens equal to the model-dtype pool's outputs and the outputs equal to them, the tokens that
are the dense argmax, the first position where an output leaves the model-dtype pool's, and
the largest logit gap.

    python benchmarks/fp8_parity.py                      # train, then serve (CPU: minutes)
    python benchmarks/fp8_parity.py --checkpoint DIR     # serve an existing HF checkpoint
    python benchmarks/fp8_parity.py --save DIR --json parity.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import sysconfig
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from jaxattn.engine import (  # noqa: E402
    KV_DTYPES,
    CacheConfig,
    Engine,
    calibrate_kv_scales,
    check_outputs,
    dense_logits,
)
from jaxattn.models import llama  # noqa: E402
from jaxattn.models.llama import LlamaConfig  # noqa: E402

POOLS = (None, *KV_DTYPES)


def corpus(held_out: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Bytes of the standard library's top-level ``*.py`` files, sorted by name: the first
    90% of the files train, the rest give the prompts."""
    files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if len(files) < 20:
        raise SystemExit("the standard library's sources are not installed here")
    cut = int(len(files) * (1 - held_out))
    join = lambda fs: np.frombuffer(b"\n".join(f.read_bytes() for f in fs), np.uint8)
    return join(files[:cut]), join(files[cut:])


def train(cfg: LlamaConfig, data: np.ndarray, *, steps, batch, length, lr, seed, log):
    """AdamW on next-byte cross-entropy, linear warm-up then cosine decay."""
    params = llama.init_params(cfg, jax.random.key(seed))
    # A trained model starts from small weights: the unit-scale init suits random tests.
    params = jax.tree.map(lambda x: x * 0.5 if x.ndim > 1 else x, params)
    lengths = jnp.full((batch,), length, jnp.int32)

    def loss_fn(p, tokens):
        logits = llama.forward_dense(p, cfg, tokens[:, :-1], lengths)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None].astype(jnp.int32), -1).mean()

    @jax.jit
    def step(p, m, v, tokens, t):
        loss, g = jax.value_and_grad(loss_fn)(p, tokens)
        norm = jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g)))
        g = jax.tree.map(lambda x: x * jnp.minimum(1.0, 1.0 / (norm + 1e-6)), g)
        warm = jnp.minimum(1.0, (t + 1) / 50)
        rate = lr * warm * 0.5 * (1 + jnp.cos(jnp.pi * t / steps))
        m = jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, m, g)
        v = jax.tree.map(lambda a, b: 0.99 * a + 0.01 * b * b, v, g)
        c1, c2 = 1 - 0.9 ** (t + 1), 1 - 0.99 ** (t + 1)
        p = jax.tree.map(
            lambda x, a, b: (
                x - rate * (a / c1 / (jnp.sqrt(b / c2) + 1e-8) + 0.01 * x * (x.ndim > 1))
            ),
            p,
            m,
            v,
        )
        return p, m, v, loss

    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)
    rng = np.random.default_rng(seed)
    t0, losses = time.perf_counter(), []
    for t in range(steps):
        starts = rng.integers(0, len(data) - length - 1, batch)
        tokens = jnp.asarray(np.stack([data[s : s + length + 1] for s in starts]).astype(np.int32))
        params, m, v, loss = step(params, m, v, tokens, jnp.float32(t))
        losses.append(float(loss))
        if log and (t % 100 == 0 or t == steps - 1):
            print(
                f"  step {t:5d}  loss {np.mean(losses[-50:]):.3f} nats/byte  "
                f"[{time.perf_counter() - t0:.0f}s]",
                flush=True,
            )
    return params, float(np.mean(losses[-50:]))


def prompts_from(data: np.ndarray, num: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(data) - length, num)
    return [data[s : s + length].astype(int).tolist() for s in starts]


def serve(cfg, params, prompts, new_tokens, kv_dtype, calib):
    scales = None if kv_dtype is None else calibrate_kv_scales(cfg, params, calib, kv_dtype)
    pages = (len(prompts) * (len(prompts[0]) + new_tokens)) // 16 + 64
    cache = CacheConfig(num_pages=pages, kv_dtype=kv_dtype, kv_scales=scales)
    engine = Engine(cfg, params, cache=cache)
    return engine.generate(prompts, max_new_tokens=new_tokens)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=pathlib.Path, help="serve this HF checkpoint instead")
    ap.add_argument("--save", type=pathlib.Path, help="keep the trained checkpoint here")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args(argv)

    train_data, held_out = corpus()
    result: dict = {"backend": jax.default_backend()}
    if args.checkpoint is None:
        cfg = LlamaConfig(
            vocab_size=256,
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rope_theta=10000.0,
            max_position_embeddings=1024,
        )
        print(
            f"training on {len(train_data) / 1e6:.1f} MB of standard-library source, "
            f"{args.steps} steps of {args.batch} x {args.length} bytes",
            flush=True,
        )
        params, loss = train(
            cfg,
            train_data,
            steps=args.steps,
            batch=args.batch,
            length=args.length,
            lr=args.lr,
            seed=args.seed,
            log=True,
        )
        result["train_loss_nats_per_byte"] = loss
        directory = args.save or pathlib.Path(tempfile.mkdtemp(prefix="jaxattn-parity-"))
        llama.save_checkpoint(directory, cfg, params)
        checkpoint = directory
    else:
        checkpoint = args.checkpoint
    cfg, params = llama.load_checkpoint(checkpoint)  # the served model is the file's
    if cfg.vocab_size < 256:
        raise SystemExit("the prompts are bytes: the checkpoint needs a vocabulary of 256 or more")
    prompts = prompts_from(held_out, args.prompts, args.prompt_len, args.seed + 1)
    calib = prompts_from(held_out, 4, args.prompt_len, args.seed + 2)

    # Held-out loss of the served model (dense, no cache): how peaked its logits are.
    logits = dense_logits(params, cfg, prompts)
    nll = [
        -float(jax.nn.log_softmax(jnp.asarray(lg[:-1]), -1)[np.arange(len(p) - 1), p[1:]].mean())
        for lg, p in zip(logits, prompts, strict=True)
    ]
    result["held_out_loss_nats_per_byte"] = float(np.mean(nll))
    top2 = [np.sort(lg, -1)[:, -2:] for lg in logits]
    result["median_top2_logit_gap"] = float(
        np.median(np.concatenate([t[:, 1] - t[:, 0] for t in top2]))
    )

    rows, outputs = [], {}
    for kv in POOLS:
        t0 = time.perf_counter()
        out = serve(cfg, params, prompts, args.new_tokens, kv, calib)
        seconds = time.perf_counter() - t0
        report = check_outputs(
            params, cfg, prompts, out, max_new_tokens=args.new_tokens, kv_dtype=kv
        )
        outputs[kv] = out
        base = outputs[None]
        pairs = [zip(o, r, strict=True) for o, r in zip(out, base, strict=True)]
        same_tokens = sum(a == b for pair in pairs for a, b in pair)
        first = [
            next((i for i, (a, b) in enumerate(zip(o, r, strict=True)) if a != b), None)
            for o, r in zip(out, base, strict=True)
        ]
        diverged = [f for f in first if f is not None]
        total = sum(len(o) for o in out)
        rows.append(
            {
                "pool": kv or cfg.dtype,
                "tokens": total,
                "same_as_model_dtype_pool": same_tokens,
                "outputs_identical": sum(f is None for f in first),
                "first_divergence_median": float(np.median(diverged)) if diverged else None,
                "dense_argmax": total - report.near_ties - len(report.problems),
                "near_ties": report.near_ties,
                "max_logit_gap": report.max_gap,
                # relative to its row's largest |logit| (at least 1), as the tolerance is
                "max_logit_gap_relative": (
                    report.max_gap * report.rtol / report.max_gap_tolerance
                    if report.max_gap_tolerance
                    else 0.0
                ),
                "rtol": report.rtol,
                "verify": report.summary(len(out)),
                "seconds": seconds,
            }
        )
    result["rows"] = rows
    n = args.prompts
    print(
        f"\nheld-out loss {result['held_out_loss_nats_per_byte']:.3f} nats/byte, median top-2 "
        f"logit gap {result['median_top2_logit_gap']:.3f}; {n} prompts of {args.prompt_len} "
        f"bytes, {args.new_tokens} new tokens each, greedy\n"
    )
    print(
        "| pool | tokens equal to the model-dtype pool's | outputs identical | median first "
        "divergence | dense argmax | near-ties | largest logit gap (relative; tolerance) | verify |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        fd = "-" if r["first_divergence_median"] is None else f"{r['first_divergence_median']:.0f}"
        print(
            f"| {r['pool']} | {r['same_as_model_dtype_pool']} of {r['tokens']} | "
            f"{r['outputs_identical']} of {n} | {fd} | {r['dense_argmax']} of {r['tokens']} | "
            f"{r['near_ties']} | {r['max_logit_gap']:.3g} ({r['max_logit_gap_relative']:.3g}; "
            f"{r['rtol']:.3g}) | {r['verify'].split(':')[0]} |"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if all(r["verify"].startswith("OK") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
