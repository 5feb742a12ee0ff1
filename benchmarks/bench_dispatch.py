"""The host's cost of one jitted dispatch, taken apart: per kernel and per buffer.

Why: the decode rows of ``bench_decode.py`` with small device times (batch 1-16 at 32/8
heads, ~15-40 us a call) are often host-bound: the host takes as long to enqueue a dispatch
of 8 calls as the device takes to run it. This separates the two costs that could explain
that:

* ``chain``: n kernels in a row on one small array (one input, one output): the cost of a
  kernel launch inside an executable, for XLA fusions (kept apart by an optimization
  barrier) and for Pallas kernels (the Triton lowering);
* ``wide``: n independent 4 MiB arrays, one kernel each (n inputs, n outputs), the shape of
  ``common.calls_over_copies``: the cost of a buffer.

Each row: the median time for the call to return (enqueue) and the time per dispatch of 20
dispatches enqueued back to back then awaited.

    python benchmarks/bench_dispatch.py
    python benchmarks/bench_dispatch.py --small      # CPU smoke run (interpret mode)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from common import environment, table, write_json  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as pltr  # noqa: E402

from jaxattn.pallas import _common as C  # noqa: E402

BLOCK = 1024


def _scale_kernel(x_ref, o_ref):
    i = pl.program_id(0) * BLOCK + jnp.arange(BLOCK)
    o_ref[i] = x_ref[i] * 2.0 + 1.0


def pallas_kernel(x, interpret: bool):
    """x * 2 + 1 as one Pallas (Triton lowering) kernel, a program per 1024 elements."""
    return pl.pallas_call(
        _scale_kernel,
        grid=(x.shape[0] // BLOCK,),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
    )(x)


def xla_kernel(x, interpret: bool):
    """x * 2 + 1, its own XLA fusion (the barrier keeps consecutive ones apart)."""
    del interpret
    return lax.optimization_barrier(x * 2.0 + 1.0)


KINDS = {"xla": xla_kernel, "pallas": pallas_kernel}


def measure(fn, args, samples: int) -> tuple[float, float]:
    """(median seconds for the call to return, seconds a dispatch back to back)."""
    jax.block_until_ready(fn(*args))
    enqueue = []
    for _ in range(samples):
        t0 = time.perf_counter()
        out = fn(*args)
        enqueue.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
    t0 = time.perf_counter()
    outs = [fn(*args) for _ in range(20)]
    jax.block_until_ready(outs)
    return statistics.median(enqueue), (time.perf_counter() - t0) / 20


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--counts", default="1,8,32", help="kernels (chain) or buffers (wide)")
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--small", action="store_true", help="tiny arrays (a CPU smoke run)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    interpret = C.resolve_interpret(None)
    counts = [int(c) for c in args.counts.split(",")]
    wide_elems = BLOCK if args.small else 1 << 20
    result = dict(environment=environment(), args=vars(args), rows=[])
    for kind, kernel in KINDS.items():
        for n in counts:

            def chain(x, kernel=kernel, n=n):
                for _ in range(n):
                    x = kernel(x, interpret)
                return x

            def wide(*xs, kernel=kernel):
                return [kernel(x, interpret) for x in xs]

            small = jnp.ones((BLOCK,), jnp.float32)
            many = [jnp.full((wide_elems,), float(i), jnp.float32) for i in range(n)]
            for form, fn, fn_args in (("chain", chain, (small,)), ("wide", wide, many)):
                enqueue, back = measure(jax.jit(fn), fn_args, args.samples)
                row = dict(form=form, kind=kind, n=n, enqueue_us=enqueue * 1e6)
                row.update(per_n_us=enqueue * 1e6 / n, dispatch_us=back * 1e6)
                result["rows"].append(row)
                print(
                    f"{form} {kind} n={n}: enqueue {row['enqueue_us']:.0f} us "
                    f"({row['per_n_us']:.1f} a {'kernel' if form == 'chain' else 'buffer pair'})"
                    f", back to back {row['dispatch_us']:.0f} us a dispatch",
                    flush=True,
                )
    print()
    print(
        table(
            result["rows"],
            [
                ("form", "form", ""),
                ("kind", "kernels", ""),
                ("n", "n", ""),
                ("enqueue_us", "enqueue (us)", ".0f"),
                ("per_n_us", "enqueue / n (us)", ".1f"),
                ("dispatch_us", "back to back (us/dispatch)", ".0f"),
            ],
        )
    )
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
