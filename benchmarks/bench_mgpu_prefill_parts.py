"""The Mosaic GPU prefix prefill taken apart: the public entry point and the kernel alone
(jaxattn.pallas.prefill_mgpu), each timed on the same rotated inputs, and with ``--profile``
the device's own time a call (a ``jax.profiler`` trace), for rows where the host's enqueue
bounds the timing.

The warp-specialised form reads q and writes the output in their own layout; its entry point
adds the contract's checks and the tile records (XLA) to the kernel. The single form (FP8
caches) also packs q into 64-row tiles of one KV head (``_tiles``: XLA gathers) and gathers
the rows back; "q packing" times that alone. Useful TFLOP/s count only unmasked score
entries, as bench_extend.py does: 4 * D * Hq * sum(new * prefix + new * (new + 1) / 2).

    python benchmarks/bench_mgpu_prefill_parts.py                       # sm_90
    python benchmarks/bench_mgpu_prefill_parts.py --form single --cases 8:2048:512
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import (  # noqa: E402
    calls_over_copies,
    device_profile,
    profile_lines,
    time_calls,
)

from jaxattn import layout as L  # noqa: E402
from jaxattn.pallas import prefill_mgpu as PM  # noqa: E402


def inputs(batch, prefix, new, *, hq, hkv, d, page, copies, seed=0):
    """``copies`` sets of (q, k, v, cu_seqlens_q, tables, seq_lens): bf16, bshd, pages a
    random permutation of a pool that holds exactly the requests."""
    rng = np.random.default_rng(seed)
    lk = prefix + new
    width = -(-lk // page)
    pages = batch * width
    out = []
    for _ in range(copies):
        q = jnp.asarray(rng.standard_normal((batch * new, hq, d)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((pages, page, hkv, d)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((pages, page, hkv, d)), jnp.bfloat16)
        t = jnp.asarray(rng.permutation(pages).reshape(batch, width), jnp.int32)
        cu = jnp.asarray(np.arange(batch + 1) * new, jnp.int32)
        out.append((q, k, v, cu, t, jnp.full((batch,), lk, jnp.int32)))
    return out


def time_case(batch, prefix, new, args) -> list[tuple[str, dict]]:
    """(name, time_calls result) of the public op, the single form's q packing and the
    kernel alone."""
    hq, hkv = (int(x) for x in args.heads.split("/"))
    d, page, group = args.head_dim, args.page_size, hq // hkv
    ws = args.form == "warp_specialized"
    per_step = PM.default_pages_per_step(args.form, args.stages, page)
    kernel_call = PM._ws_kernel_call if ws else PM._kernel_call
    copies = inputs(batch, prefix, new, hq=hq, hkv=hkv, d=d, page=page, copies=args.copies)
    geom = L.get("bshd", pool=True).geometry(copies[0][1], copies[0][2])
    capacity = copies[0][4].shape[1] * page

    @jax.jit
    def prepare(q, cu, t, n):  # the kernel's inputs, as the entry point builds them
        if ws:
            return q, PM.ws_records(cu, t, n, num_rows=q.shape[0], group=group, geom=geom)
        return PM._tiles(q, cu, n, group=group, capacity=capacity)[:2]

    def public(q, k, v, cu, t, n):
        return PM.prefix_prefill(q, k, v, cu, t, n, form=args.form, stages=args.stages)

    def packing(q, k, v, cu, t, n):
        return prepare(q, cu, t, n)

    def kernel(qp, k, v, tab, info):
        return kernel_call(
            qp, k, v, tab, info, geom=geom, layout="bshd", group=group, scale=d**-0.5,
            soft_cap=None, pages_per_step=per_step, stages=args.stages, interpret=False,
        )  # fmt: skip

    prepared = []
    for q, k, v, cu, t, n in copies:
        qp, info = prepare(q, cu, t, n)
        prepared.append((qp, k, v, PM._table_rows(t), info))
    timing = dict(target_s=args.target_s, samples=args.samples)
    parts = [("public op", public, copies)]
    if not ws:
        parts.append(("q packing", packing, copies))
    parts.append(("kernel", kernel, prepared))
    out = []
    for name, fn, inputs_of in parts:
        r = time_calls(fn, inputs_of, **timing)
        if args.profile:
            calls = calls_over_copies(fn)  # compiled and run by time_calls: warm
            prof = device_profile(
                lambda c=calls, i=inputs_of: c(i), steps=len(inputs_of), top=max(args.kernels, 1)
            )
            r["device_span_s"] = None if prof is None else prof["span_us"] * 1e-6
            r["profile"] = prof
        out.append((name, r))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cases", default="8:2048:512,4:0:4096,1:0:8192,32:1000:24", help="B:prefix:new,..."
    )
    p.add_argument("--heads", default="32/8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--form", default="warp_specialized", choices=PM.FORMS)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--target-s", type=float, default=0.03)
    p.add_argument(
        "--profile", action="store_true", help="also the device's span a call from a trace"
    )
    p.add_argument(
        "--kernels",
        type=int,
        default=0,
        help="with --profile: list the public op's N longest kernels a call (the XLA ones "
        "beside the Mosaic GPU kernel)",
    )
    args = p.parse_args(argv)
    hq = int(args.heads.split("/")[0])
    for spec in args.cases.split(","):
        batch, prefix, new = (int(x) for x in spec.split(":"))
        flops = 4 * args.head_dim * hq * batch * (new * prefix + new * (new + 1) / 2)
        print(f"{batch} x ({prefix} + {new}), {args.heads}, {args.form}:")
        for name, r in time_case(batch, prefix, new, args):
            s = r["median_s"]
            bound = "  [host-bound: an upper bound]" if r.get("host_bound") else ""
            line = f"  {name}: {s * 1e6:.1f} us, {flops / s / 1e12:.0f} TFLOP/s{bound}"
            if r.get("device_span_s"):
                span = r["device_span_s"]
                line += f"; device span {span * 1e6:.1f} us, {flops / span / 1e12:.0f} TFLOP/s"
            print(line, flush=True)
            if args.kernels and name == "public op":
                print(profile_lines(r.get("profile"), unit="call"), flush=True)


if __name__ == "__main__":
    main()
