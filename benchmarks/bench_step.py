"""One engine decode step, taken apart: where the time goes, against the hardware floor.

For each batch size ``B`` and engine mode, ``B`` requests of ``--context`` random tokens
are prefilled, the engine decodes until every program is compiled, and then ``--steps``
engine steps are timed through ``Engine.step()``. Per decode step (a dispatch of ``k``
steps counts ``k``):

* ``wall``: the engine's wall time, what a caller sees;
* ``schedule``: the scheduler's plan (admission, page reservations, copy-on-write);
* ``launch``: turning the plan into device work and enqueueing it, of which ``h2d`` sends
  metadata to the device (``h2d B``: bytes sent) and ``dispatch`` is the time in the
  jitted calls (which return before the device is done);
* ``wait``: blocking on a step's tokens (device time not hidden behind host work);
* ``commit``: appending tokens, stop checks, releases;
* ``device``: the decode program alone, enqueued back to back on the rows as they are
  (``--device-steps`` steps a call), the device's own time per step;
* ``floor``: what a decode step must read - the weights (all but the embedding table, of
  which it gathers ``B`` rows, unless the LM head is tied to it) plus the KV of every
  sequence - at the read ceiling measured in the same run (a jitted ``jnp.sum`` over a
  large array).

Modes: ``sync`` (one step per dispatch, the host waits for every step: the engine's loop
before the overlap scheduler), ``overlap`` (one step per dispatch, step t + 1 planned while
step t runs), ``multistep`` (overlap, and up to ``--decode-steps`` steps per dispatch) and
``device-paging`` (multistep, the block tables grown by a page table on the device).

    python benchmarks/bench_step.py --preset 1b --batch 1,16,64 --json step_1b.json
    python benchmarks/bench_step.py --preset 8b --batch 1,16,64 --json step_8b.json
    python benchmarks/bench_step.py --preset tiny --context 128 --steps 16   # CPU smoke run

``--kv-dtype fp8_e4m3`` runs the same steps over an FP8 pool (its floor counts one byte per
K/V element).

A batch runs in the engine's own decode bucket (at least ``Buckets().decode_batch`` rows, 4,
as the engine runs it by default; the extra rows are empty), and so does the ``device`` time;
``--exact-rows`` runs exactly ``B`` rows instead (a one-row step then pads each projection to
two rows, ``llama._padded_linear``). The floor counts the real rows' bytes either way.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_engine import PRESETS, add_execution_args, execution_kwargs, preset_config  # noqa: E402
from common import (
    device_profile,
    environment,
    profile_lines,
    table,
    time_calls,
    write_json,
)  # noqa: E402

from jaxattn.engine import KV_DTYPES, Buckets, Engine  # noqa: E402
from jaxattn.engine.config import kv_cache_dtype  # noqa: E402
from jaxattn.models import llama  # noqa: E402

MODES = {
    "sync": dict(overlap=False, decode_steps=1),
    "overlap": dict(overlap=True, decode_steps=1),
    "multistep": dict(overlap=True),  # decode_steps from --decode-steps
    "device-paging": dict(overlap=True, device_paging=True),
}
PHASES = ("schedule", "launch", "h2d", "dispatch", "wait", "commit")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--checkpoint", metavar="DIR", help="a Hugging Face Llama instead")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", default="1,16,64", help="batch sizes, comma separated")
    p.add_argument("--modes", default="sync,overlap,multistep", help=f"of {sorted(MODES)}")
    p.add_argument("--decode-steps", type=int, default=8, help="steps per dispatch (multistep)")
    p.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=32, help="timed engine steps")
    p.add_argument("--device-steps", type=int, default=8, help="steps per timed device call")
    p.add_argument(
        "--exact-rows",
        action="store_true",
        help="decode exactly B rows, not the engine's default bucket (at least 4 rows)",
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefill-tokens", type=int, default=4096, help="tokens per prefill step")
    p.add_argument("--implementation", choices=["reference", "pallas", "native"])
    p.add_argument(
        "--kv-dtype",
        choices=list(KV_DTYPES),
        help="FP8 KV pool (scales 1.0: the values do not change the time); the floor counts "
        "its bytes",
    )
    add_execution_args(p)
    p.add_argument(
        "--ceiling-gib",
        type=float,
        help="read-ceiling array size (default: 4 GiB on a GPU, 256 MiB on the CPU)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also trace the decode program at one step a call (jax.profiler): GPU busy "
        "time per step, idle gaps, the top kernels",
    )
    p.add_argument(
        "--profile-top", type=int, default=12, help="kernels --profile lists (by time per step)"
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def model_config(args) -> tuple[llama.LlamaConfig, str]:
    if args.checkpoint:
        cfg, _ = llama.load_checkpoint(args.checkpoint, dtype=args.dtype)
        return cfg, f"checkpoint {args.checkpoint}"
    cfg = preset_config(
        args.preset,
        layers=args.layers,
        dtype=args.dtype,
        max_position_embeddings=max(4096, 2 * args.context),
    )
    return cfg, f"preset {args.preset}"


def device_params(cfg: llama.LlamaConfig, seed: int) -> dict:
    """Random weights drawn on the device, with :func:`llama.init_params`' shapes and
    scales: the values do not change a step's time, and an 8B model is drawn in seconds
    instead of minutes on the host."""
    n, h, i, v = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    linear = {  # name: (shape, fan_in)
        "wq": ((n, h, cfg.q_size), h),
        "wk": ((n, h, cfg.kv_size), h),
        "wv": ((n, h, cfg.kv_size), h),
        "wo": ((n, cfg.q_size, h), cfg.q_size),
        "w_gate": ((n, h, i), h),
        "w_up": ((n, h, i), h),
        "w_down": ((n, i, h), i),
    }
    dt = cfg.jnp_dtype

    def draw(key):
        keys = iter(jax.random.split(key, len(linear) + 2))
        normal = lambda shape, fan_in: (
            jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(fan_in)
        ).astype(dt)
        layers = {name: normal(shape, fan_in) for name, (shape, fan_in) in linear.items()}
        layers["attn_norm"] = layers["mlp_norm"] = jnp.ones((n, h), dt)
        params = {"embed": normal((v, h), 1), "layers": layers, "norm": jnp.ones((h,), dt)}
        if not cfg.tie_word_embeddings:
            params["lm_head"] = normal((h, v), h)
        return params

    return jax.jit(draw)(jax.random.key(seed))


def read_ceiling(nbytes: int) -> dict:
    """Bytes per second a jitted ``jnp.sum`` reads from one large float32 array."""
    n = max(nbytes // 4, 1)
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    t = time_calls(lambda a: jnp.sum(a), [(x,)], samples=7)
    return dict(bytes=n * 4, seconds=t["median_s"], gbps=n * 4 / t["median_s"] / 1e9)


def weight_bytes(params, cfg) -> int:
    """Parameter bytes a decode step reads: all of them but the embedding table (B rows
    of it are gathered), unless it is tied to the LM head, which reads it whole."""
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    if not cfg.tie_word_embeddings:
        total -= params["embed"].size * params["embed"].dtype.itemsize
    return total


def device_time(
    engine, batch: int, steps: int, reps: int = 5, profile: bool = False, top: int = 12
) -> tuple[float, dict | None, int]:
    """Seconds per decode step of the decode program alone: ``steps`` steps a call,
    calls enqueued back to back on the engine's rows (a copy whose budgets never run
    out; the rows keep their positions, so every call reads the same KV). With
    ``profile``, also :func:`common.device_profile` of a few calls; and the rows run."""
    from jaxattn.engine import runner as R

    runner = engine.runner
    rows = [s.row for s in engine.scheduler.running if s.row is not None]
    # As the engine runs it: the rows' bucket (Engine._work).
    num_rows = min(R.bucket(max(rows) + 1, runner.buckets.decode_batch), runner.max_rows)
    state = runner.state._replace(remaining=jnp.full_like(runner.state.remaining, 1 << 30))
    control = np.zeros(num_rows + 1, np.int32)
    control[0] = steps
    control[1 + np.asarray(rows)] = 1
    control = jnp.asarray(control)
    last = max(int(p) for p in np.asarray(state.positions)[rows]) + steps
    width = min(R.bucket(-(-last // runner.page_size), runner.buckets.pages), runner.table_width)
    statics = dict(
        model=runner.model,
        options=runner._options["decode"],
        num_rows=num_rows,
        width=width,
        max_steps=steps,
        page_size=runner.page_size,
        greedy=True,
        tp=runner.tp,
    )

    # With device paging the rows' tables are the page table's (grown by nothing here).
    pages, entries = runner.pages, None
    if pages is not None:
        entries = np.full((2, num_rows), runner.max_rows, np.int32)
        entries[1] = 0
        entries = jnp.asarray(entries)

    # The program takes the rows' state donated (as the engine runs it): each call gets a
    # copy of the same rows (one small device copy a call).
    fresh = jax.jit(lambda s: jax.tree.map(jnp.copy, s))
    no_updates = runner._folded_updates(None)  # the engine's program takes row updates

    def program(k: int):
        """``n -> out``: n calls of the decode program at k steps a call."""
        c = control.at[0].set(k)
        # Its arguments as the engine sends them: host arrays packed (R.pack_host).
        packed, layout = R.pack_host((c, pages, entries, None, runner.kv_scales, no_updates))
        kw = statics | dict(max_steps=k)

        def run(n):
            out = None
            for _ in range(n):
                out, runner.k_cache, runner.v_cache, _, _ = runner.decode_program(
                    runner.params,
                    runner.k_cache,
                    runner.v_cache,
                    fresh(state),
                    *packed,
                    layout=layout,
                    **kw,
                )
            return out

        return run

    run = program(steps)

    jax.block_until_ready(run(2))
    calls = 4
    t0 = time.perf_counter()
    jax.block_until_ready(run(calls))
    # Enough calls per sample for ~50 ms of device work.
    calls = max(4, min(200, int(0.05 / max((time.perf_counter() - t0) / calls, 1e-6))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run(calls))
        times.append((time.perf_counter() - t0) / (calls * steps))
    prof = None
    if profile:
        # Traced at one step a call: in a multistep call the trace holds the loop's first
        # step only (a command buffer's loop body is recorded once), which per-step figures
        # would then divide by all of its steps.
        one = program(1)
        jax.block_until_ready(one(2))
        prof = device_profile(lambda: one(8), steps=8, top=top)
    return statistics.median(times), prof, num_rows


def run_case(cfg, params, args, batch: int, mode: str, ceiling_bps: float) -> dict:
    p = args.page_size
    decode_steps = MODES[mode].get("decode_steps", args.decode_steps)
    # Enough tokens for the warm-up and the timed steps, each dispatch up to decode_steps.
    max_new = (args.steps + 4) * decode_steps + 2 * p + args.device_steps + 4
    pages = batch * -(-(args.context + max_new) // p) + 8
    engine = Engine(
        cfg,
        params,
        num_pages=pages,
        page_size=p,
        max_batch_tokens=max(args.prefill_tokens, batch),
        max_running=batch if args.exact_rows else max(batch, Buckets().decode_batch),
        radix_cache=False,
        implementation=args.implementation,
        kv_dtype=args.kv_dtype,
        eos_token_id=None,
        decode_steps=decode_steps,
        overlap=MODES[mode]["overlap"],
        device_paging=MODES[mode].get("device_paging", False),
        **execution_kwargs(args),
        # One row bucket and one table width for the whole run: no compile in the timed part.
        buckets=Buckets(
            decode_batch=batch if args.exact_rows else max(batch, Buckets().decode_batch),
            pages=-(-(args.context + max_new) // p),
        ),
    )
    rng = np.random.default_rng(args.seed + batch)
    for _ in range(batch):
        engine.add_request(rng.integers(0, cfg.vocab_size, args.context).tolist(), max_new)
    sched = engine.scheduler
    while sched.waiting or any(s.prefilling for s in sched.running):
        engine.step()
    # Compile every program the timed steps run: the decode variants, and the row updates
    # of steps where all rows cross a page boundary at once.
    engine.reset_stats()
    while engine.stats["decode_steps"] < 2 * p + 2 * decode_steps:
        engine.step()
    engine.reset_stats()
    compiled = sum(engine.runner.trace_counts.values())
    lens = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        lens.append(sum(s.num_scheduled for s in sched.running))
        engine.step()
    wall = time.perf_counter() - t0
    s = engine.stats
    if sum(engine.runner.trace_counts.values()) != compiled:
        print(f"  warning: {mode} B={batch} compiled during the timed steps", file=sys.stderr)
    n = max(s["decode_steps"], 1)
    kv_read = statistics.median(lens) * cfg.kv_bytes_per_token(
        kv_cache_dtype(args.kv_dtype, cfg.jnp_dtype)
    )
    wb = weight_bytes(engine.runner.params, cfg)
    floor = (wb + kv_read) / ceiling_bps
    device, prof, num_rows = device_time(
        engine, batch, args.device_steps, profile=args.profile, top=args.profile_top
    )
    row = dict(
        mode=mode,
        batch=batch,
        rows=num_rows,
        decode_steps_per_dispatch=s["decode_steps"] / max(s["decode_calls"], 1),
        wall_ms=wall / n * 1e3,
        schedule_ms=s["schedule_s"] / n * 1e3,
        launch_ms=s["launch_s"] / n * 1e3,
        h2d_ms=s["h2d_s"] / n * 1e3,
        h2d_bytes=s["h2d_bytes"] / n,
        dispatch_ms=s["dispatch_s"] / n * 1e3,
        wait_ms=s["wait_s"] / n * 1e3,
        commit_ms=s["commit_s"] / n * 1e3,
        device_ms=device * 1e3,
        floor_ms=floor * 1e3,
        weight_bytes=wb,
        kv_bytes=int(kv_read),
        wall_over_floor=wall / n / floor,
        device_over_floor=device / floor,
        backend=s["attention_backend"]["decode"],
        decode_linear=engine.runner.decode_linear,
        decode_graph=engine.runner.decode_graph,
        kv_write=engine.runner.kv_write,
        fused_rope=engine.runner.fused_rope,
        fused_norm=engine.runner.fused_norm,
        split_k=engine.runner.split_k,
    )
    if args.profile:
        row["profile"] = prof
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg, name = model_config(args)
    if args.checkpoint:
        _, params = llama.load_checkpoint(args.checkpoint, dtype=args.dtype)
    else:
        params = device_params(cfg, args.seed)
    on_gpu = jax.default_backend() != "cpu"
    gib = args.ceiling_gib if args.ceiling_gib else (4.0 if on_gpu else 0.25)
    ceiling = read_ceiling(int(gib * 2**30))
    print(
        f"bench_step: {name} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.dtype}) on {jax.devices()[0].device_kind}; read ceiling "
        f"{ceiling['gbps']:.0f} GB/s",
        file=sys.stderr,
    )
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes must list some of {sorted(MODES)}, got {args.modes!r}")
    rows = []
    for b in [int(x) for x in args.batch.split(",") if x.strip()]:
        for mode in modes:
            rows.append(run_case(cfg, params, args, b, mode, ceiling["gbps"] * 1e9))
            r = rows[-1]
            print(
                f"  B={b} {mode}: {r['wall_ms']:.3f} ms a step, device {r['device_ms']:.3f}, "
                f"floor {r['floor_ms']:.3f} (K/V writes: {r['kv_write']}"
                f"{', rope fused' if r['fused_rope'] else ''}"
                f"{', add+norm fused' if r['fused_norm'] else ''}"
                f"{', split-K partials ' + str(r['split_k']) if r['split_k'] else ''})",
                file=sys.stderr,
            )
            if args.profile:
                print(profile_lines(r["profile"]), file=sys.stderr)
    columns = [
        ("mode", "mode", ""),
        ("batch", "B", "d"),
        ("rows", "rows", "d"),
        ("decode_steps_per_dispatch", "steps/disp", ".1f"),
        ("wall_ms", "wall ms", ".3f"),
        *[(f"{k}_ms", k, ".3f") for k in PHASES],
        ("h2d_bytes", "h2d B", ".0f"),
        ("device_ms", "device ms", ".3f"),
        ("floor_ms", "floor ms", ".3f"),
        ("wall_over_floor", "wall/floor", ".2f"),
        ("device_over_floor", "device/floor", ".2f"),
    ]
    print(table(rows, columns))
    payload = dict(
        environment=environment(),
        model=dict(name=name, **{k: getattr(cfg, k) for k in cfg.__dataclass_fields__}),
        args={k: str(v) for k, v in vars(args).items()},
        read_ceiling=ceiling,
        results=rows,
    )
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
