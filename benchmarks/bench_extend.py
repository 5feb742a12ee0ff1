"""Extend (prefix-cached prefill) attention: useful TFLOP/s against cuDNN.

    python benchmarks/bench_extend.py --impl pallas,native --json extend.json

Useful FLOPs count only the score entries the mask keeps:
``4 * D * Hq * sum_b(Lq_b * Lp_b + Lq_b * (Lq_b + 1) / 2)``. Every implementation
reachable through ``jaxattn.extend_attention`` (``--form extend``, a token pool with
permuted slots) or ``jaxattn.prefix_prefill`` (``--form prefill``, a paged cache) is
timed; one that raises NotImplementedError is reported as skipped. The peers:
FlashAttention-4 (``fa4_peer.py``: ``flash_attn.cute`` on the same device buffers, both
forms, where torch and flash_attn.cute are installed; its own pack_gqa choice and packing
forced on; ``x FA4`` is the faster one's time over the row's)
and cuDNN flash attention (``jax.nn.dot_product_attention(..., implementation="cudnn")``) on
the equivalent dense problem: cuDNN's causal mask is anchored top-left, so the
prefix-shifted mask is expressed as one non-causal call over the prefix plus one
causal call over the new tokens, merged by their log-sum-exp (for an empty prefix,
the causal call alone).

``--sweep`` also times the Pallas kernel over a grid of tile configurations;
``--native-kernels sm90,sm90_persistent`` the native op with each GPU prefill kernel forced.

``--kv-dtype bfloat16,float8_e4m3fn,float8_e5m2`` times each case over each cache dtype (q
stays ``--dtype``; an FP8 cache holds the same random data quantised with per-head scales,
passed to the op); ``x first`` is the time of the first cache dtype's row of the same
implementation over this row's. The peers run on 16-bit caches only.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

LOG2E = math.log2(math.e)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import fa4_peer  # noqa: E402

import jaxattn  # noqa: E402
from jaxattn import native  # noqa: E402
from jaxattn import pallas as jpallas  # noqa: E402
from jaxattn.pallas import prefill_mgpu  # noqa: E402

# (batch, prefix, new tokens)
CASES = [(8, 2048, 512), (1, 0, 8192), (32, 1000, 24), (4, 0, 4096)]
SMALL_CASES = [(2, 40, 24), (1, 0, 64)]


def useful_flops(batch, prefix, new, num_q_heads, head_dim):
    return 4 * head_dim * num_q_heads * batch * (new * prefix + new * (new + 1) // 2)


def build_extend(seed, *, batch, prefix, new, num_q_heads, num_kv_heads, head_dim, dtype, kv_dtype):
    """Token-pool inputs: every request's prefix + new slots, permuted over the pool. An
    FP8 pool is the same data quantised with per-head scales, which end the tuple."""
    lk = prefix + new
    num_slots = batch * lk + 1
    kq, kk, kv, kp = jax.random.split(jax.random.key(seed), 4)
    k_pool, v_pool, scales = common.random_cache(
        kk, kv, "bshd", (num_slots, 1, num_kv_heads, head_dim), dtype=dtype, kv_dtype=kv_dtype
    )
    k_pool = k_pool.reshape(num_slots, num_kv_heads, head_dim)
    v_pool = v_pool.reshape(num_slots, num_kv_heads, head_dim)
    kv_indices = jax.random.permutation(kp, num_slots)[: batch * lk].astype(jnp.int32)
    qo_indptr = jnp.arange(batch + 1, dtype=jnp.int32) * new
    kv_indptr = jnp.arange(batch + 1, dtype=jnp.int32) * lk
    q = jax.random.normal(kq, (batch * new, num_q_heads, head_dim), dtype)
    return (q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, *scales)


def build_prefill(
    seed,
    *,
    batch,
    prefix,
    new,
    num_q_heads,
    num_kv_heads,
    head_dim,
    dtype,
    kv_dtype,
    page_size,
    layout,
):
    lk = prefix + new
    pages = -(-lk // page_size)
    num_pages = batch * pages + 1
    kq, kk, kv, kp = jax.random.split(jax.random.key(seed), 4)
    geom = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache, v_cache, scales = common.random_cache(
        kk, kv, layout, geom, dtype=dtype, kv_dtype=kv_dtype
    )
    tables = jax.random.permutation(kp, num_pages)[: batch * pages].reshape(batch, pages)
    cu = jnp.arange(batch + 1, dtype=jnp.int32) * new
    seq_lens = jnp.full((batch,), lk, jnp.int32)
    q = jax.random.normal(kq, (batch * new, num_q_heads, head_dim), dtype)
    return (q, k_cache, v_cache, cu, tables.astype(jnp.int32), seq_lens, *scales)


def to_dense(copy, *, batch, prefix, new):
    """The same problem as dense [B, L, H, D] arrays (what cuDNN takes)."""
    q, k_pool, v_pool, _, _, kv_indices = copy[:6]
    lk = prefix + new
    k = k_pool[kv_indices].reshape(batch, lk, *k_pool.shape[1:])
    v = v_pool[kv_indices].reshape(batch, lk, *v_pool.shape[1:])
    return q.reshape(batch, new, *q.shape[1:]), k, v


def _merge_base2(parts, *, batch, new):
    """Merge (out [B, T, H, D], lse [B, T, H] in base 2) of the prefix and the new-token
    calls: the exact combine, as the kernels do it."""
    if len(parts) == 1:
        out = parts[0][0]
    else:
        (o_pre, lse_pre), (o_new, lse_new) = parts
        m = jnp.maximum(lse_pre, lse_new)
        w_pre = jnp.exp2(lse_pre - m)[..., None]
        w_new = jnp.exp2(lse_new - m)[..., None]
        out = (w_pre * o_pre.astype(jnp.float32) + w_new * o_new.astype(jnp.float32)) / (
            w_pre + w_new
        )
    return out.astype(parts[0][0].dtype).reshape(batch * new, *out.shape[2:])


def split_peer(part, *, batch, prefix, new):
    """A dense attention ``part(q, k, v, causal) -> (out, lse base 2 [B, T, H])`` run as
    the extend problem: prefix keys without a mask, new keys causal, merged."""

    def run(q, k, v):
        parts = []
        if prefix:
            parts.append(part(q, k[:, :prefix], v[:, :prefix], False))
        parts.append(part(q, k[:, prefix:], v[:, prefix:], True))
        return _merge_base2(parts, batch=batch, new=new)

    return run


def cudnn_part(scale):
    def part(q, k, v, causal):
        o, lse = jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, implementation="cudnn", return_residual=True
        )
        return o, lse * LOG2E  # cuDNN's log-sum-exp is natural

    return part


def pallas_triton_part(scale):
    """JAX's own Pallas (Triton) flash attention; it takes no GQA, so K/V come with
    their heads repeated (see ``repeat_kv``)."""
    from jax.experimental.pallas.ops.gpu import attention as jax_attention

    def part(q, k, v, causal):
        o, lse = jax_attention.mha(
            q, k, v, None, sm_scale=scale, causal=causal, return_residuals=True
        )
        return o, jnp.swapaxes(lse, 1, 2)

    return part


def pallas_mosaic_part(scale):
    """JAX's own Pallas Mosaic GPU flash attention (wgmma + TMA, warp-specialised). It
    applies no softmax scale (q is pre-scaled here) and, in jax 0.11.2, serves float16
    only, so this peer runs on float16 copies of the inputs."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    def part(q, k, v, causal):
        cfg = attention_mgpu.TuningConfig(
            block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal
        )
        o, (lse,) = attention_mgpu.attention(
            (q * scale).astype(q.dtype), k, v, cfg, save_residuals=True
        )
        return o, jnp.swapaxes(lse, 1, 2)

    return part


def repeat_kv(dense, group):
    q, k, v = dense
    return q, jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)


def as_float16(dense):
    return tuple(x.astype(jnp.float16) for x in dense)


def sweep_configs():
    # (block_q, block_n, warps, stages, heads per tile)
    for bq, bn, warps, stages, gh in [
        (128, 64, 4, 3, 4),
        (128, 64, 4, 4, 4),
        (128, 128, 8, 3, 4),
        (256, 64, 8, 3, 4),
        (128, 64, 4, 3, 2),
        (256, 64, 8, 2, 2),
        (256, 64, 8, 3, 2),
        (256, 64, 8, 4, 2),
        (256, 128, 8, 3, 2),
        (256, 32, 8, 4, 2),
        (128, 128, 8, 3, 1),
        (256, 64, 8, 3, 1),
        (64, 64, 4, 3, 4),
    ]:
        yield jpallas.ExtendConfig(
            block_q=bq, block_n=bn, num_warps=warps, num_stages=stages, heads_per_tile=gh
        )


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--form", choices=("extend", "prefill"), default="extend")
    p.add_argument("--layout", default="bshd", help="paged layout for --form prefill")
    p.add_argument("--page-size", type=int, default=16, help="page size for --form prefill")
    p.add_argument("--heads", default="32/8")
    common.add_dtype_args(p)
    p.add_argument("--cases", default=None, help="B:prefix:new,... (default: the issue's set)")
    p.add_argument("--sweep", action="store_true", help="time Pallas tile configurations too")
    p.add_argument(
        "--sweep-cases",
        default="8:2048:512",
        help="B:prefix:new,... the sweep runs on (default: the target case)",
    )
    p.add_argument("--small", action="store_true", help="tiny shapes (a smoke run on CPU)")
    p.add_argument(
        "--mgpu",
        default=None,
        help="also time the Pallas prefix prefill on the Mosaic GPU lowering "
        "(jaxattn.pallas.prefill_mgpu; --form prefill, 16-bit or FP8 caches) in these "
        "configurations: stages:pages_per_step|auto[:ws|single],... (e.g. 2:auto,3:8:single; "
        "the form defaults to the kernel's: warp-specialised for 16-bit caches)",
    )
    p.add_argument(
        "--triton",
        action="store_true",
        help="--form prefill: also time the Pallas op on its Triton-lowered kernel (the "
        "default on sm_90 is the Mosaic GPU kernel for 16-bit caches)",
    )
    p.add_argument(
        "--native-kernels",
        default=None,
        help="also time the native op with each of these GPU prefill kernels forced "
        "(jaxattn.native.PrefillConfig: sm90, sm90_persistent, mma, simt), in the same process",
    )
    common.add_profile_args(p)
    p.set_defaults(impl="pallas,native")
    args = p.parse_args(argv)

    dtype, kv_dtypes = common.dtypes_of(args)
    hq, hkv = (int(x) for x in args.heads.split("/"))
    d = args.head_dim
    scale = 1.0 / math.sqrt(d)
    cases = SMALL_CASES if args.small else CASES
    if args.cases:
        cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
    impls = common.parse_impls(args.impl)

    result = dict(
        env=common.environment(),
        params=vars(args) | {"json": str(args.json)},
        ceilings=None,
        rows=[],
    )
    # Ceilings run last: a large matmul right before the cases slowed the first timings.

    for (batch, prefix, new), kv_dtype in itertools.product(cases, kv_dtypes):
        fp8 = jaxattn.quant.is_fp8(kv_dtype)
        shape = dict(
            batch=batch,
            prefix=prefix,
            new=new,
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=d,
            dtype=dtype,
            kv_dtype=kv_dtype,
        )
        flops = useful_flops(batch, prefix, new, hq, d)
        if args.form == "extend":
            build = functools.partial(build_extend, **shape)
            op = jaxattn.extend_attention
            kernel = jpallas.extend_attention
            kw = {}
        else:
            build = functools.partial(
                build_prefill, **shape, page_size=args.page_size, layout=args.layout
            )
            op = jaxattn.prefix_prefill
            kernel = jpallas.prefix_prefill
            kw = {"layout": args.layout}
        copy_bytes = common.tree_bytes(build(0))
        copies = common.make_copies(build, common.num_copies(copy_bytes))
        print(
            f"{batch} x ({prefix} + {new}) Hq/Hkv={hq}/{hkv} {kv_dtype.name} cache: "
            f"{flops / 1e9:.1f} GFLOP useful, {len(copies)} copies",
            flush=True,
        )
        expected = None
        if args.check:
            try:
                expected = jax.jit(common.with_scales(op, implementation="reference", **kw))(
                    *copies[0]
                )
            except Exception as e:  # noqa: BLE001 - the dense spec may not fit; time anyway
                print(f"  (no check: the spec failed with {type(e).__name__})", flush=True)
        base = dict(
            batch=batch,
            prefix=prefix,
            new=new,
            heads=f"{hq}/{hkv}",
            form=args.form,
            kv_dtype=kv_dtype.name,
        )

        def record(
            name, fn, copies_, extra=None, *, base=base, flops=flops, expected=expected, timed=None
        ):
            row = base | {"impl": name} | (extra or {})
            row |= timed or common.measure(fn, copies_, expected=expected, **common.timing_kw(args))
            metric = ""
            if "us" in row:
                row["tflops"] = flops / row["us"] / 1e6
                metric = f"{row['tflops']:.0f} TFLOP/s"
            result["rows"].append(row)
            print(common.status_line(name, row, metric), flush=True)
            if args.profile and fn is not None and "us" in row:
                row["profile"] = common.profile_calls(fn, copies_, args.profile_top)
            return row

        for impl in impls:
            ops_op = jaxattn.ops.OPS[op.__name__]
            label = common.resolved_label(ops_op, copies[0], impl, **kw)
            record(
                impl, common.with_scales(op, implementation=impl, **kw), copies, dict(config=label)
            )
        if args.triton and "pallas" in impls and args.form == "prefill":
            # The Triton-lowered kernel with its own heuristic tiles, beside the default (the
            # Mosaic GPU kernel on sm_90 for 16-bit caches).
            q0, cu0 = copies[0][0], copies[0][3]
            cfg = jpallas.extend.heuristic_config(q0, hq // hkv, cu0)
            fn = common.with_scales(op, implementation="pallas", config=cfg, **kw)
            record("pallas-triton", fn, copies, dict(config=common.config_label(cfg)))
        if args.native_kernels and "native" in impls:
            for name in args.native_kernels.split(","):
                fn = common.with_scales(
                    op, implementation="native", config=native.PrefillConfig(kernel=name), **kw
                )
                record("native", fn, copies, dict(config=f"kernel={name}"))
        if args.mgpu and args.form == "prefill":
            for spec in args.mgpu.split(","):
                stages, per_step, *form = spec.split(":")
                fn = common.with_scales(
                    prefill_mgpu.prefix_prefill,
                    scale=scale,
                    stages=int(stages),
                    pages_per_step=None if per_step == "auto" else int(per_step),
                    form={"ws": "warp_specialized", "single": "single"}[form[0]] if form else None,
                    **kw,
                )
                record("pallas-mgpu", fn, copies, dict(config=spec))
        if args.sweep and (args.small or f"{batch}:{prefix}:{new}" in args.sweep_cases):
            for cfg in sweep_configs():
                fn = common.with_scales(kernel, scale=scale, config=cfg, **kw)
                record("pallas-sweep", fn, copies, dict(config=common.config_label(cfg)))
        peer = fa4 = None
        if not args.no_peers and not fp8:
            for pack in fa4_peer.PACK_GQA:
                calls = [
                    fa4_peer.extend_call(
                        c,
                        form=args.form,
                        batch=batch,
                        prefix=prefix,
                        new=new,
                        scale=scale,
                        pack_gqa=pack,
                    )
                    for c in copies
                ]
                timed = fa4_peer.measure(
                    calls, samples=args.samples, target_s=args.target_s, expected=expected
                )
                label = f"pack_gqa={'auto' if pack is None else pack}"
                row = record("fa4", None, None, dict(config=label), timed=timed)
                if "us" in row and (fa4 is None or row["us"] < fa4["us"]):
                    fa4 = row  # x FA4: against the faster setting
                del calls
        if not args.no_peers and args.form == "extend" and not fp8:
            dense = [to_dense(c, batch=batch, prefix=prefix, new=new) for c in copies]
            split = functools.partial(split_peer, batch=batch, prefix=prefix, new=new)
            peer = record("cudnn", split(cudnn_part(scale)), dense)
            # JAX's own Pallas attention kernels on the same dense problem.
            record(
                "jax-pallas-triton",
                split(pallas_triton_part(scale)),
                [repeat_kv(x, hq // hkv) for x in dense],
            )
            record(
                "jax-pallas-mosaic (f16)",
                split(pallas_mosaic_part(scale)),
                [as_float16(x) for x in dense],
            )
            del dense
        for ref, key in ((peer, "vs_cudnn"), (fa4, "vs_fa4")):
            if ref is None or "us" not in ref:
                continue
            for row in result["rows"]:
                if (
                    row is not ref
                    and row.get("batch") == batch
                    and row.get("prefix") == prefix
                    and row.get("new") == new
                    and row.get("kv_dtype") == kv_dtype.name
                    and "us" in row
                ):
                    row[key] = ref["us"] / row["us"]
        del copies
    common.relative_to_first(
        result["rows"],
        "kv_dtype",
        kv_dtypes[0].name,
        ("batch", "prefix", "new", "heads", "impl", "config"),
    )

    if not args.no_ceilings:
        result["ceilings"] = common.ceilings(small=args.small)
        print(common.ceilings_line(result["ceilings"]), flush=True)
        matmul = result["ceilings"]["matmul"]["tflops"]
        for row in result["rows"]:
            if "tflops" in row:
                row["pct_matmul"] = 100 * row["tflops"] / matmul
    common.write_json(args.json, result)
    rows = [r for r in result["rows"] if "us" in r]
    for r in rows:
        r["case"] = f"{r['batch']}x({r['prefix']}+{r['new']})"
    print()
    print(
        common.table(
            rows,
            [
                ("case", "B x (prefix + new)", ""),
                ("heads", "Hq/Hkv", ""),
                ("kv_dtype", "cache", ""),
                ("impl", "impl", ""),
                ("config", "config", ""),
                ("us", "time (us)", ".1f"),
                ("tflops", "TFLOP/s", ".0f"),
                ("vs_fa4", "x FA4", ".2f"),
                ("vs_cudnn", "x cuDNN", ".2f"),
                ("pct_matmul", "% of matmul", ".0f"),
                ("x_first", "x first", ".2f"),
                ("rel_err", "rel err", ".1e"),
            ],
        )
    )
    return result


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
