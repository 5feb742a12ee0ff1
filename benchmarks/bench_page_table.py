"""Decode-step overhead: paging on the device (functional PageTable) vs on the host.

Both paths run the same decode step over ``--batch`` sequences (beams forked from shared
prompts, so the first steps copy on write):

* ``fused``: one ``jax.jit`` does ``append_slot_batch`` -> ``copy_blocks`` -> ``write_kv``
  -> ``paged_attention``; the page table stays on the device, nothing syncs with the host.
* ``host``: the ``BlockManager`` appends on the host, builds block tables, lengths, slot
  mappings and copy orders, ships them to the device, and a jitted
  ``copy_blocks`` -> ``write_kv`` -> ``paged_attention`` runs on them.

Also timed, to split the difference: ``host bookkeeping`` (the Python part of ``host``
alone), ``device bookkeeping`` (the jitted page-table part of ``fused`` alone), and
``attention only`` (the device step with fixed metadata already on the device).

Every path dispatches ``--steps`` steps back to back and waits once at the end; the figure
is the median over ``--reps`` such runs divided by the steps. Prints a table, then one JSON
object (also written to ``--json``)::

    python benchmarks/bench_page_table.py --batch 64 --prompt-len 500 --steps 50
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import layout as L
from jaxattn import ops
from jaxattn.kv import copy_blocks, write_kv
from jaxattn.paging import BlockManager
from jaxattn.paging.page_table import PageTable, Status


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="sequences decoded per step")
    p.add_argument("--beam", type=int, default=4, help="sequences forked from each prompt")
    p.add_argument("--prompt-len", type=int, default=500)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--layout", default="bshd", choices=list(L.LAYOUTS))
    p.add_argument("--implementation", default=None, help="paged_attention backend")
    p.add_argument("--steps", type=int, default=50, help="decode steps per timed run")
    p.add_argument("--reps", type=int, default=5, help="timed runs; the median is reported")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation)")
    p.add_argument("--spare-blocks", type=int, default=64, help="free blocks beyond need")
    p.add_argument("--json", default=None, help="also write the JSON result here")
    args = p.parse_args(argv)
    if args.batch % args.beam:
        p.error(f"--batch={args.batch} must be a multiple of --beam={args.beam}")
    return args


# --- the two steps ---------------------------------------------------------------------


def attention_step(k_cache, v_cache, q, k_new, v_new, src, dst, slots, tables, lens, *, cfg):
    """The device work both paths share: copy-on-write, KV write, decode attention."""
    k_cache, v_cache = copy_blocks(k_cache, v_cache, src, dst, layout=cfg["layout"])
    k_cache, v_cache = write_kv(k_cache, v_cache, k_new, v_new, slots, layout=cfg["layout"])
    out = ops.paged_attention(
        q,
        k_cache,
        v_cache,
        tables,
        lens,
        layout=cfg["layout"],
        implementation=cfg["implementation"],
    )
    return k_cache, v_cache, out


def device_bookkeeping(pt: PageTable, seqs):
    """One decode step's paging on the device: grow every sequence by one token."""
    pt, cow, status = pt.append_slot_batch(seqs)
    lens = pt.seq_lens(seqs)
    slots = jax.vmap(lambda s, n: pt.slot_mapping(s, n - 1, 1)[0])(seqs, lens)
    # A failed append must not overwrite the sequence's last token.
    slots = jnp.where(status == Status.OK, slots, -1)
    return pt, cow, slots, pt.block_tables(seqs), lens


def fused_step(pt, k_cache, v_cache, q, k_new, v_new, seqs, *, cfg):
    pt, cow, slots, tables, lens = device_bookkeeping(pt, seqs)
    k_cache, v_cache, out = attention_step(
        k_cache, v_cache, q, k_new, v_new, cow[:, 0], cow[:, 1], slots, tables, lens, cfg=cfg
    )
    return pt, k_cache, v_cache, out


def host_bookkeeping(bm: BlockManager, seqs, width: int):
    """What a host scheduler computes each step, as the arrays it ships to the device."""
    cows = [pair for s in seqs for pair in bm.append_slot(s)]
    src = np.full(len(seqs), -1, np.int32)
    dst = np.full(len(seqs), -1, np.int32)
    if cows:
        src[: len(cows)], dst[: len(cows)] = np.asarray(cows, np.int32).T
    lens = np.fromiter((bm.seq_len(s) for s in seqs), np.int32, len(seqs))
    slots = np.concatenate([bm.slot_mapping(s, n - 1, n) for s, n in zip(seqs, lens, strict=True)])
    return src, dst, slots, bm.block_tables(seqs, pad_to=width), lens


# --- set-up ----------------------------------------------------------------------------


def build(args):
    """Identical starting points for both paths: prompts allocated, written and forked."""
    b, p = args.batch, args.block_size
    # The main runs, then the bookkeeping-only runs, each grow every sequence again.
    steps_total = args.warmup + 2 * args.reps * args.steps + 2
    width = math.ceil((args.prompt_len + steps_total) / p) + 1
    prompts = b // args.beam
    # Every beam ends up with private blocks from the fork point on; prompts stay shared.
    need = prompts * math.ceil(args.prompt_len / p) + b * (width - args.prompt_len // p)
    num_blocks = need + args.spare_blocks
    dtype = jnp.dtype(args.dtype)
    cfg = dict(layout=args.layout, implementation=args.implementation)

    pt = PageTable.init(num_blocks, p, b, width)
    bm = BlockManager(num_blocks, p)
    for g in range(prompts):
        parent = g * args.beam
        pt = pt.allocate(parent, args.prompt_len)
        bm.allocate(parent, args.prompt_len)
        for child in range(parent + 1, parent + args.beam):
            pt = pt.fork(parent, child)
            bm.fork(parent, child)
    if int(pt.status) != Status.OK:
        raise RuntimeError(f"set-up failed: {Status(int(pt.status)).name}")

    rng = np.random.default_rng(0)
    hkv, d = args.num_kv_heads, args.head_dim
    shape_k = L.cache_shape(args.layout, "k", num_blocks, p, hkv, d, dtype)
    shape_v = L.cache_shape(args.layout, "v", num_blocks, p, hkv, d, dtype)
    k_cache = jnp.zeros(shape_k, dtype)
    v_cache = jnp.zeros(shape_v, dtype)
    write = jax.jit(functools.partial(write_kv, layout=args.layout), donate_argnums=(0, 1))
    for g in range(prompts):
        slots = jnp.asarray(bm.slot_mapping(g * args.beam, 0, args.prompt_len))
        kv = rng.standard_normal((2, args.prompt_len, hkv, d), np.float32)
        k_cache, v_cache = write(
            k_cache, v_cache, jnp.asarray(kv[0], dtype), jnp.asarray(kv[1], dtype), slots
        )

    def normal(shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)

    inputs = dict(
        q=normal((b, args.num_q_heads, d)), k_new=normal((b, hkv, d)), v_new=normal((b, hkv, d))
    )
    return pt, bm, k_cache, v_cache, inputs, width, num_blocks, cfg


def timed(run_steps, reps: int, steps: int) -> list[float]:
    """Seconds per step of each rep; run_steps(n) dispatches n steps and returns arrays to
    wait on."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run_steps(steps))
        out.append((time.perf_counter() - t0) / steps)
    return out


def main(argv=None):
    args = parse_args(argv)
    pt, bm, k_cache, v_cache, x, width, num_blocks, cfg = build(args)
    seqs_np = np.arange(args.batch, dtype=np.int32)
    seqs = jnp.asarray(seqs_np)

    fused = jax.jit(functools.partial(fused_step, cfg=cfg), donate_argnums=(1, 2))
    device = jax.jit(functools.partial(attention_step, cfg=cfg), donate_argnums=(0, 1))
    paging = jax.jit(device_bookkeeping)

    # Both paths own a copy of the caches and of the page tables.
    fk, fv = k_cache, v_cache
    hk, hv = jnp.copy(k_cache), jnp.copy(v_cache)
    state = {"pt": pt, "fk": fk, "fv": fv, "hk": hk, "hv": hv}

    def run_fused(n):
        for _ in range(n):
            state["pt"], state["fk"], state["fv"], out = fused(
                state["pt"], state["fk"], state["fv"], x["q"], x["k_new"], x["v_new"], seqs
            )
        return out, state["pt"]

    def run_host(n):
        for _ in range(n):
            meta = host_bookkeeping(bm, seqs_np, width)
            state["hk"], state["hv"], out = device(
                state["hk"], state["hv"], x["q"], x["k_new"], x["v_new"], *meta
            )
        return out

    run_fused(args.warmup)
    run_host(args.warmup)
    # Same state after the same steps: the two paths are doing the same work.
    np.testing.assert_array_equal(
        np.asarray(state["pt"].block_tables(seqs)), bm.block_tables(seqs_np, pad_to=width)
    )
    results = {
        "fused": timed(run_fused, args.reps, args.steps),
        "host": timed(run_host, args.reps, args.steps),
    }
    if int(state["pt"].status) != Status.OK:
        raise RuntimeError(f"a fused step failed: {Status(int(state['pt'].status)).name}")
    np.testing.assert_array_equal(
        np.asarray(state["pt"].block_tables(seqs)), bm.block_tables(seqs_np, pad_to=width)
    )

    # The parts alone, from the same point, on copies thrown away afterwards.
    bm_copy = copy.deepcopy(bm)
    results["host bookkeeping"] = timed(
        lambda n: [host_bookkeeping(bm_copy, seqs_np, width) for _ in range(n)][-1],
        args.reps,
        args.steps,
    )
    probe = {"pt": state["pt"]}

    def run_paging(n):
        for _ in range(n):
            probe["pt"], *meta = paging(probe["pt"], seqs)
        return meta

    run_paging(1)
    results["device bookkeeping"] = timed(run_paging, args.reps, args.steps)
    if int(probe["pt"].status) != Status.OK:
        raise RuntimeError(f"a bookkeeping step failed: {Status(int(probe['pt'].status)).name}")
    meta = [jnp.asarray(a) for a in host_bookkeeping(bm, seqs_np, width)]
    fixed = {"k": state["hk"], "v": state["hv"]}

    def run_attention(n):
        for _ in range(n):
            fixed["k"], fixed["v"], out = device(
                fixed["k"], fixed["v"], x["q"], x["k_new"], x["v_new"], *meta
            )
        return out

    run_attention(1)
    results["attention only"] = timed(run_attention, args.reps, args.steps)

    us = {k: statistics.median(v) * 1e6 for k, v in results.items()}
    report = {
        "bench": "page_table",
        "device": str(jax.devices()[0]),
        "platform": jax.default_backend(),
        "jax": jax.__version__,
        "config": {**vars(args), "num_blocks": num_blocks, "max_blocks_per_seq": width},
        "us_per_step": us,
        "us_per_step_all_reps": {k: [t * 1e6 for t in v] for k, v in results.items()},
        "overhead_saved_us": us["host"] - us["fused"],
        "speedup": us["host"] / us["fused"],
    }
    print(f"{'path':<20} {'us/step':>10} {'x fused':>8}")
    for name, t in us.items():
        print(f"{name:<20} {t:>10.1f} {t / us['fused']:>8.2f}")
    print(f"overhead saved per step: {report['overhead_saved_us']:.1f} us")
    text = json.dumps(report, indent=None, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return report


if __name__ == "__main__":
    main()
