"""Paged decode attention: achieved KV-read bandwidth against the copy ceiling.

    python benchmarks/bench_decode.py --impl reference,pallas,native --json decode.json

Every implementation reachable through ``jaxattn.paged_attention`` is timed on the
same inputs (one that raises NotImplementedError is reported as skipped), next to the
peers: FlashAttention-4's paged decode (``fa4_peer.py``, where torch and flash_attn.cute
are installed; bshd) and JAX's own Pallas GPU ``paged_attention``. Bandwidth counts the K
and V bytes a decode step must read (B * ctx * Hkv * D * 2 * the cache's itemsize) over the
median time; the ratio is to the device-to-device copy bandwidth measured in the same run.

``--kv-dtype bfloat16,float8_e4m3fn,float8_e5m2`` times each case over each cache dtype
(q stays ``--dtype``; an FP8 cache holds the same random data quantised with per-head
scales from ``jaxattn.fp8_scales``, passed to the op); ``x first`` is the time of the first
cache dtype's row of the same implementation over this row's. The peers run on 16-bit
caches only.

``--sweep`` also times the Pallas kernel over a grid of tile configurations;
``--partitions 128,256`` each implementation split into partitions of those many tokens
beside its own choice (e.g. the 1B decode step's attention, ``--head-dim 64 --cases 64:512``,
which the native rule runs in one pass).
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import fa4_peer  # noqa: E402

import jaxattn  # noqa: E402
from jaxattn import pallas as jpallas  # noqa: E402
from jaxattn.pallas import decode_mgpu  # noqa: E402

CASES = [(1, 32768), (8, 4096), (64, 4096), (256, 1024)]
HEADS = [(32, 8), (32, 32)]
SMALL_CASES = [(2, 256), (4, 128)]  # --small: a CPU smoke run of the script itself
SMALL_HEADS = [(8, 2)]


def case_copies(batch, ctx, hq, hkv, head_dim, page_size, layout, dtype, kv_dtype=None):
    """(K+V bytes of one input set, enough input copies to rotate past the L2) for a case."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    kv_bytes = batch * ctx * hkv * head_dim * 2 * kv_dtype.itemsize
    build = functools.partial(
        build_inputs,
        batch=batch,
        ctx=ctx,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=head_dim,
        page_size=page_size,
        layout=layout,
        dtype=dtype,
        kv_dtype=kv_dtype,
    )
    return kv_bytes, common.make_copies(build, common.num_copies(kv_bytes))


def build_inputs(
    seed, *, batch, ctx, num_q_heads, num_kv_heads, head_dim, page_size, layout, dtype, kv_dtype
):
    """Random decode inputs: every sequence full to ctx, pages permuted over the pool. An
    FP8 cache is the same data quantised with per-head scales, which end the tuple."""
    pages_per_seq = ctx // page_size
    num_pages = batch * pages_per_seq + 1
    kq, kk, kv, kp = jax.random.split(jax.random.key(seed), 4)
    geom = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache, v_cache, scales = common.random_cache(
        kk, kv, layout, geom, dtype=dtype, kv_dtype=kv_dtype
    )
    perm = jax.random.permutation(kp, num_pages)[: batch * pages_per_seq]
    block_tables = perm.reshape(batch, pages_per_seq).astype(jnp.int32)
    seq_lens = jnp.full((batch,), ctx, jnp.int32)
    q = jax.random.normal(kq, (batch, num_q_heads, head_dim), dtype)
    return (q, k_cache, v_cache, block_tables, seq_lens, *scales)


def jax_pallas_peer(scale):
    """jax.experimental.pallas.ops.gpu.paged_attention, JAX's own Pallas GPU kernel.

    It wants K/V as [Hkv, num_pages, P, D] and does not scale the logits, so q is
    scaled first (inside the timed call, as a serving step would)."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jpa

    def run(q, k_pages, v_pages, block_tables, seq_lens):
        # Its defaults (16 splits of 8-page compute blocks) need the page count to divide.
        pages = block_tables.shape[1]
        k_splits = next(s for s in (16, 8, 4, 2, 1) if pages % s == 0)
        return jpa.paged_attention(
            (q * scale).astype(q.dtype),
            k_pages,
            v_pages,
            block_tables,
            seq_lens,
            k_splits=k_splits,
            pages_per_compute_block=min(8, pages // k_splits),
            interpret=jax.default_backend() == "cpu",
        )

    return run


def to_peer_layout(copy, layout):
    q, k, v, bt, sl = copy[:5]
    kb = jaxattn.layout.to_bshd(k, layout, "k")
    vb = jaxattn.layout.to_bshd(v, layout, "v")
    return q, jnp.transpose(kb, (2, 0, 1, 3)), jnp.transpose(vb, (2, 0, 1, 3)), bt, sl


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--layout", default="bshd")
    p.add_argument("--page-size", type=int, default=16)
    common.add_dtype_args(p)
    p.add_argument("--cases", default=None, help="B:ctx,B:ctx,... (default: the issue's set)")
    p.add_argument("--heads", default=None, help="Hq/Hkv,... (default: 32/8,32/32)")
    p.add_argument("--sweep", action="store_true", help="time Pallas tile configurations too")
    p.add_argument(
        "--sweep-cases",
        default="64:4096:32/8,1:32768:32/8",
        help="B:ctx:Hq/Hkv,... the sweep runs on (default: the two targets)",
    )
    p.add_argument(
        "--mgpu",
        default=None,
        help="time the Mosaic GPU decode (jaxattn.pallas.decode_mgpu) in these configurations: "
        "stages|auto:pages_per_step:partition_pages|auto[:w1|w2][:rC/M][:triton|mosaic_gpu|xla]"
        ",... (w1: one warpgroup; w2: a copy warpgroup too; rC/M: their registers; triton, "
        "mosaic_gpu, xla: the split grid's merge; e.g. auto:4:auto,2:4:auto:w1)",
    )
    p.add_argument(
        "--partitions",
        default=None,
        help="also time each implementation of --impl split into partitions of these many "
        "tokens (the op's partition_size=, then the exact combine), comma-separated; the "
        "default row is the backend's own choice (one pass where the grid is full)",
    )
    p.add_argument(
        "--triton",
        action="store_true",
        help="also time the Pallas op on its Triton-lowered kernel (the default on sm_90 is "
        "the Mosaic GPU kernel for 16-bit caches and batches that fill a one-pass grid)",
    )
    p.add_argument("--small", action="store_true", help="tiny shapes (a smoke run on CPU)")
    common.add_profile_args(p)
    args = p.parse_args(argv)

    dtype, kv_dtypes = common.dtypes_of(args)
    cases = SMALL_CASES if args.small else CASES
    heads = SMALL_HEADS if args.small else HEADS
    if args.cases:
        cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
    if args.heads:
        heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    impls = common.parse_impls(args.impl)
    partitions = [int(x) for x in args.partitions.split(",")] if args.partitions else []
    if any(size <= 0 for size in partitions):
        p.error(f"--partitions takes positive token counts, got {args.partitions}")
    d = args.head_dim
    scale = 1.0 / math.sqrt(d)

    result = dict(
        env=common.environment(),
        params=vars(args) | {"json": str(args.json)},
        ceilings=None,
        rows=[],
    )
    # The ceilings run after the cases: right after the large matmul, the first timings
    # on an H200 came out up to 2x slow (B=1 x 32768: 89 us, then 43 us for the same
    # kernel a few seconds later).
    copy_gbps = None

    for (batch, ctx), (hq, hkv), kv_dtype in itertools.product(cases, heads, kv_dtypes):
        kv_bytes, copies = case_copies(
            batch, ctx, hq, hkv, d, args.page_size, args.layout, dtype, kv_dtype
        )
        fp8 = jaxattn.quant.is_fp8(kv_dtype)
        spec_out = None
        if args.check:
            spec_out = common.with_scales(
                jaxattn.paged_attention, layout=args.layout, implementation="reference"
            )(*copies[0])

        def record(
            name, fn, copies_, extra=None, *, base, kv_bytes, expected, timed=None, profile=False
        ):
            """Times one row; ``profile``: also traces it under ``--profile``."""
            row = base | {"impl": name} | (extra or {})
            row |= timed or common.measure(fn, copies_, expected=expected, **common.timing_kw(args))
            metric = ""
            if "us" in row:
                row["gbps"] = kv_bytes / row["us"] / 1e3
                metric = f"{row['gbps']:.0f} GB/s"
            result["rows"].append(row)
            print(common.status_line(name, row, metric), flush=True)
            if profile and args.profile and "us" in row:
                row["profile"] = common.profile_calls(fn, copies_, args.profile_top)

        record = functools.partial(
            record,
            base=dict(batch=batch, ctx=ctx, heads=f"{hq}/{hkv}", kv_dtype=kv_dtype.name),
            kv_bytes=kv_bytes,
            expected=spec_out,
        )

        print(
            f"B={batch} ctx={ctx} Hq/Hkv={hq}/{hkv} {kv_dtype.name} cache "
            f"({kv_bytes / 1e6:.0f} MB of KV, {len(copies)} copies)",
            flush=True,
        )
        for impl in impls:
            label = common.resolved_label(
                jaxattn.ops.PAGED_ATTENTION, copies[0], impl, layout=args.layout
            )
            # The backend's own choice (partition_size=None), then each --partitions size.
            sizes = [(None, label)] + [(n, f"partition_size={n}") for n in partitions]
            for size, config in sizes:
                fn = common.with_scales(
                    jaxattn.paged_attention,
                    layout=args.layout,
                    implementation=impl,
                    partition_size=size,
                )
                record(impl, fn, copies, dict(config=config), profile=True)
        if args.triton and "pallas" in impls:
            # The Triton-lowered kernel with its own heuristic tiles, beside the default.
            geom = jaxattn.layout.get(args.layout, pool=True).geometry(*copies[0][1:3])
            cfg = jpallas.decode.heuristic_config(copies[0][0], geom)
            fn = common.with_scales(
                jaxattn.paged_attention, layout=args.layout, implementation="pallas", config=cfg
            )
            record("pallas-triton", fn, copies, dict(config=common.config_label(cfg)), profile=True)
        if args.sweep and (args.small or f"{batch}:{ctx}:{hq}/{hkv}" in args.sweep_cases):
            for cfg in sweep_configs():
                fn = common.with_scales(
                    jpallas.paged_attention, scale=scale, layout=args.layout, config=cfg
                )
                record("pallas-sweep", fn, copies, dict(config=common.config_label(cfg)))
        if args.mgpu:
            for spec in args.mgpu.split(","):
                kw = mgpu_config(spec)
                fn = common.with_scales(
                    decode_mgpu.paged_attention, scale=scale, layout=args.layout, **kw
                )
                record("pallas-mgpu", fn, copies, dict(config=spec), profile=True)
        if not args.no_peers and not fp8:
            calls = [fa4_peer.decode_call(c, layout=args.layout, scale=scale) for c in copies]
            timed = fa4_peer.measure(
                calls, samples=args.samples, target_s=args.target_s, expected=spec_out
            )
            record("fa4", None, None, timed=timed)
            del calls
            peer_copies = [to_peer_layout(c, args.layout) for c in copies]
            record("jax-pallas-gpu", jax_pallas_peer(scale), peer_copies)
            del peer_copies
        del copies
    common.relative_to_first(
        result["rows"], "kv_dtype", kv_dtypes[0].name, ("batch", "ctx", "heads", "impl", "config")
    )

    if not args.no_ceilings:
        result["ceilings"] = common.ceilings(small=args.small)
        copy_gbps = result["ceilings"]["copy"]["gbps"]
        read_gbps = result["ceilings"]["read"]["gbps"]
        print(common.ceilings_line(result["ceilings"]), flush=True)
        for row in result["rows"]:
            if "gbps" in row:
                row["pct_copy"] = 100 * row["gbps"] / copy_gbps
                row["pct_read"] = 100 * row["gbps"] / read_gbps
    common.write_json(args.json, result)
    rows = [r for r in result["rows"] if "us" in r]
    print()
    print(
        common.table(
            rows,
            [
                ("batch", "B", ""),
                ("ctx", "ctx", ""),
                ("heads", "Hq/Hkv", ""),
                ("kv_dtype", "cache", ""),
                ("impl", "impl", ""),
                ("config", "config", ""),
                ("us", "time (us)", ".1f"),
                ("gbps", "KV GB/s", ".0f"),
                ("pct_read", "% of read", ".0f"),
                ("pct_copy", "% of copy", ".0f"),
                ("x_first", "x first", ".2f"),
                ("rel_err", "rel err", ".1e"),
            ],
        )
    )
    return result


def mgpu_config(spec: str) -> dict:
    """``stages:pages_per_step:partition_pages|auto[:flag...]`` -> keywords of
    :func:`jaxattn.pallas.decode_mgpu.paged_attention` (``auto`` stages: the kernel's
    default); flags: ``w1`` (one warpgroup), ``w2`` (a copy warpgroup beside the compute
    one), ``rC/M`` (their registers), ``triton`` / ``mosaic_gpu`` / ``xla`` (the split grid's
    merge)."""
    stages, per_step, part, *flags = spec.split(":")
    kw = dict(pages_per_step=int(per_step))
    if stages != "auto":
        kw["stages"] = int(stages)
    if part != "auto":
        kw["partition_pages"] = int(part)
    for flag in flags:
        if flag == "w1":
            kw["specialized"] = False
        elif flag == "w2":
            kw["specialized"] = True
        elif flag.startswith("r"):
            kw["registers"] = tuple(int(r) for r in flag[1:].split("/"))
        elif flag in ("triton", "mosaic_gpu", "xla"):
            kw["merge"] = flag
        else:
            raise SystemExit(f"--mgpu: unknown flag {flag!r} in {spec!r}")
    return kw


def sweep_configs():
    for block_n, warps, stages in [
        (64, 2, 3),
        (64, 4, 3),
        (32, 2, 4),
        (64, 2, 4),
        (128, 2, 3),
        (64, 4, 2),
    ]:
        yield jpallas.DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages)


if __name__ == "__main__":
    main()
