"""Native (XLA FFI) kernels: decode bandwidth and prefix-prefill TFLOP/s, with variants.

    python benchmarks/bench_native.py --json native.json

The same inputs, timing method and ceilings as ``bench_decode.py`` / ``bench_extend.py``
(``common.time_calls``: inputs rotated over several copies that overflow the L2, many
calls per sample, median), restricted to ``implementation="native"`` so that kernel
variants can be compared in one run: decode with the kernel's own split choice and with
explicit partition sizes; prefill in both the paged form (``prefix_prefill``) and the
token-pool form (``extend_attention``).

Decode bandwidth counts the K and V bytes a step must read (B * ctx * Hkv * D * 2 *
itemsize); prefill counts useful FLOPs only (``4 * D * Hq * sum_b(Lq * Lp + Lq (Lq + 1)
/ 2)``).
"""

from __future__ import annotations

import functools
import itertools
import sys
from pathlib import Path

import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode  # noqa: E402
import bench_extend  # noqa: E402
import common  # noqa: E402

import jaxattn  # noqa: E402

DECODE_CASES = [(1, 32768), (8, 4096), (64, 4096), (256, 1024)]
DECODE_HEADS = [(32, 8), (32, 32)]
PREFILL_CASES = [(8, 2048, 512)]  # (batch, prefix, new tokens)


def _partitions(text):
    return [None if s == "auto" else int(s) for s in text.split(",")]


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--layout", default="bshd")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--partitions", default="auto,256,512", help="auto (None) and/or ints")
    p.add_argument("--decode-cases", default=None, help="B:ctx,... (default: the issue's set)")
    p.add_argument("--prefill-cases", default=None, help="B:prefix:new,...")
    p.add_argument("--decode-heads", default=None, help="Hq/Hkv,... (default: 32/8,32/32)")
    p.add_argument("--prefill-heads", default="32/8")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--small", action="store_true", help="tiny shapes (a smoke run on CPU)")
    args = p.parse_args(argv)

    dtype = jnp.dtype(args.dtype)
    d = args.head_dim
    decode_cases, heads, prefill_cases = DECODE_CASES, DECODE_HEADS, PREFILL_CASES
    if args.small:
        decode_cases, heads, prefill_cases = [(2, 256)], [(8, 2)], [(2, 40, 24)]
    if args.decode_cases:
        decode_cases = [tuple(int(x) for x in c.split(":")) for c in args.decode_cases.split(",")]
    if args.decode_heads:
        heads = [tuple(int(x) for x in h.split("/")) for h in args.decode_heads.split(",")]
    if args.prefill_cases:
        prefill_cases = [tuple(int(x) for x in c.split(":")) for c in args.prefill_cases.split(",")]
    result = dict(
        env=common.environment(),
        params=vars(args) | {"json": str(args.json)},
        ceilings=None,
        rows=[],
    )
    copy_gbps = matmul = None
    if not args.no_ceilings:
        result["ceilings"] = common.ceilings(small=args.small)
        copy_gbps = result["ceilings"]["copy"]["gbps"]
        matmul = result["ceilings"]["matmul"]["tflops"]
        print(
            f"ceilings: copy {copy_gbps:.0f} GB/s (read+write), bf16 matmul {matmul:.0f} TFLOP/s",
            flush=True,
        )

    def record(base, fn, copies, expected):
        row = base | common.measure(fn, copies, expected=expected, **common.timing_kw(args))
        metric = ""
        if "us" in row and "kv_bytes" in row:
            row["gbps"] = row["kv_bytes"] / row["us"] / 1e3
            metric = f"{row['gbps']:.0f} GB/s"
            if copy_gbps:
                row["pct_copy"] = 100 * row["gbps"] / copy_gbps
                metric += f" ({row['pct_copy']:.0f}% of copy)"
        if "us" in row and "flops" in row:
            row["tflops"] = row["flops"] / row["us"] / 1e6
            metric = f"{row['tflops']:.0f} TFLOP/s"
            if matmul:
                row["pct_matmul"] = 100 * row["tflops"] / matmul
                metric += f" ({row['pct_matmul']:.0f}% of matmul)"
        result["rows"].append(row)
        print(common.status_line(base["variant"], row, metric), flush=True)

    if not args.skip_decode:
        for (batch, ctx), (hq, hkv) in itertools.product(decode_cases, heads):
            kv_bytes, copies = bench_decode.case_copies(
                batch, ctx, hq, hkv, d, args.page_size, args.layout, dtype
            )
            expected = None
            if args.check:
                expected = jaxattn.paged_attention(
                    *copies[0], layout=args.layout, implementation="reference"
                )
            print(
                f"decode B={batch} ctx={ctx} Hq/Hkv={hq}/{hkv} ({kv_bytes / 1e6:.0f} MB of KV)",
                flush=True,
            )
            for ps in _partitions(args.partitions):
                fn = functools.partial(
                    jaxattn.paged_attention,
                    layout=args.layout,
                    partition_size=ps,
                    implementation="native",
                )
                base = dict(
                    op="decode",
                    batch=batch,
                    ctx=ctx,
                    heads=f"{hq}/{hkv}",
                    variant=f"partition={ps or 'auto'}",
                    kv_bytes=kv_bytes,
                )
                record(base, fn, copies, expected)
            del copies

    if not args.skip_prefill:
        hq, hkv = (int(x) for x in args.prefill_heads.split("/"))
        for batch, prefix, new in prefill_cases:
            flops = bench_extend.useful_flops(batch, prefix, new, hq, d)
            geom = dict(
                batch=batch,
                prefix=prefix,
                new=new,
                num_q_heads=hq,
                num_kv_heads=hkv,
                head_dim=d,
                dtype=dtype,
            )
            print(
                f"prefill {batch} x ({prefix} + {new}) Hq/Hkv={hq}/{hkv}: "
                f"{flops / 1e9:.1f} GFLOP useful",
                flush=True,
            )
            base = dict(
                op="prefill", batch=batch, prefix=prefix, new=new, heads=f"{hq}/{hkv}", flops=flops
            )
            n_copies = common.num_copies(batch * (prefix + new) * hkv * d * 2 * dtype.itemsize)
            copies = common.make_copies(
                functools.partial(
                    bench_extend.build_prefill, page_size=args.page_size, layout=args.layout, **geom
                ),
                n_copies,
            )
            expected = None
            if args.check:
                expected = jaxattn.prefix_prefill(
                    *copies[0], layout=args.layout, implementation="reference"
                )
            fn = functools.partial(
                jaxattn.prefix_prefill, layout=args.layout, implementation="native"
            )
            record(
                base | dict(variant=f"prefix_prefill {args.layout} P={args.page_size}"),
                fn,
                copies,
                expected,
            )
            del copies
            copies = common.make_copies(
                functools.partial(bench_extend.build_extend, **geom), n_copies
            )
            fn = functools.partial(jaxattn.extend_attention, implementation="native")
            record(base | dict(variant="extend (token pool)"), fn, copies, None)
            del copies

    common.write_json(args.json, result)
    rows = [r for r in result["rows"] if "us" in r]
    print()
    print(
        common.table(
            rows,
            [
                ("op", "op", ""),
                ("batch", "B", ""),
                ("ctx", "ctx", ""),
                ("prefix", "prefix", ""),
                ("new", "new", ""),
                ("heads", "Hq/Hkv", ""),
                ("variant", "variant", ""),
                ("us", "time (us)", ".1f"),
                ("gbps", "KV GB/s", ".0f"),
                ("pct_copy", "% of copy", ".0f"),
                ("tflops", "TFLOP/s", ".0f"),
                ("pct_matmul", "% of matmul", ".0f"),
                ("rel_err", "rel err", ".1e"),
            ],
        )
    )
    return result


if __name__ == "__main__":
    main()
