"""End-to-end serving throughput on the shared-prefix workload, radix cache on vs off.

The workload (``jaxattn.engine.workload``): multi-turn chats and few-shot prompts behind
one long system prompt; each chat turn is queued when the previous one finishes and
carries the whole conversation. For each mode the workload runs ``--warm-runs`` times (2)
and then once more, timed, each time on a new engine (its own scheduler, radix cache and
statistics) over the same model runner (the KV pool, the decode rows and the compiled
programs): the first run compiles every program the schedule needs, the next ones let the
device allocator and XLA's command buffers reach their steady state, as in a server that
has served a while. ``--fresh-runner`` times a run on a new runner instead (new pool and
rows after one compiling run: the first workload a new engine serves). ``--timed-runs N``
times N runs the same way (each a new engine over the warm runner, or each on a new runner
with ``--fresh-runner``) and reports the run of median wall time, with every run's
generated tokens/s below the table: a run's figure varies by several percent. Reported
per mode: prompt tokens served from the radix cache, prefill tokens computed, generated
tokens, dispatches and the decode steps they ran, wall time, generated tokens/s, all
tokens (prompt + generated) served per second, and where the host's time went.

Step modes (``--step-modes``): ``multistep`` (the default engine: up to
``--decode-steps`` decode steps per dispatch, the next step planned while the device
runs the current one), ``overlap`` (one step per dispatch, planned ahead), ``sync`` (one
step per dispatch, the host waits for each: the engine loop before the overlap
scheduler), ``device-paging`` (multistep, the block tables grown by a page table on the
device). Greedy outputs are compared across all the runs of one radix mode: they must be
identical.

``--kv-dtype fp8_e4m3|fp8_e5m2`` serves from an FP8 pool (scales calibrated on the first four
prompts; outputs then differ from a 16-bit pool's by the quantisation). ``--cascade
auto|on|off`` sets the engine's cascade decode (rows that share cached prefix
pages read them once; ``ExecutionConfig.cascade``); the table reports the decode steps that
ran it and the KV bytes they did not read.

    python benchmarks/bench_engine.py                      # small random model (CPU)
    python benchmarks/bench_engine.py --preset 1b --num-pages 8192 --max-batch-tokens 2048
    python benchmarks/bench_engine.py --preset 1b --step-modes multistep,sync --modes on
    python benchmarks/bench_engine.py --preset tiny --modes on --profile-host 30   # host time

``--timeline`` prints every step of each timed run (its start, length, the dispatch it
launched, the runner's launch and waits), which shows where the device waits for the host.
``--profile-host N`` runs cProfile over each timed run and prints its N costliest functions
by own time; a jitted call's dispatch (the C++ side of ``jax.jit``) shows as the own time of
the runner's ``_call``. The profiler slows the Python side, so the table's times are then
not comparable with unprofiled runs.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
from common import environment, table, write_json  # noqa: E402

from jaxattn.engine import KV_DTYPES, Engine, calibrate_kv_scales  # noqa: E402
from jaxattn.engine.config import PALLAS_DECODE_LOWERINGS  # noqa: E402
from jaxattn.engine.workload import make_workload, run_workload  # noqa: E402
from jaxattn.models import llama  # noqa: E402

# Model shapes: (layers, hidden, intermediate, q heads, kv heads, head dim, vocab, dtype).
PRESETS = {
    "tiny": (2, 64, 128, 4, 2, 16, 128, "float32"),
    "small": (4, 256, 512, 8, 2, 32, 512, "float32"),
    "1b": (16, 2048, 8192, 32, 8, 64, 32000, "bfloat16"),  # Llama-3.2-1B-like
    "8b": (32, 4096, 14336, 32, 8, 128, 32000, "bfloat16"),  # Llama-3-8B-like
}


# ExecutionConfig switches that take None (the engine's choice), True or False, as auto/on/off
# options: (option, field, help).
_SWITCHES = (
    (
        "--decode-graph",
        "decode_graph",
        "the decode loop as a command buffer (ExecutionConfig.decode_graph; auto: on with CUDA "
        "GPUs)",
    ),
    (
        "--fused-rope",
        "fused_rope",
        "rotate q, k and store K/V in one pass a layer (ExecutionConfig.fused_rope; auto: where "
        "the K/V write is the native kernel on one device)",
    ),
    (
        "--fused-norm",
        "fused_norm",
        "each residual add and its RMSNorm in one native kernel (ExecutionConfig.fused_norm; "
        "auto: off)",
    ),
)
_TRISTATE = {"auto": None, "on": True, "off": False}


def add_execution_args(group) -> None:
    """How the engine runs the model (``ExecutionConfig``), the options bench_engine.py and
    bench_step.py share; :func:`execution_kwargs` turns them into Engine keywords."""
    group.add_argument(
        "--layer-form",
        choices=["auto", "unrolled", "scan"],
        default="auto",
        help="straight-line layers or a scan (auto: unrolled on GPUs)",
    )
    group.add_argument(
        "--decode-linear",
        choices=["auto", "native", "hybrid", "xla"],
        default="auto",
        help="the decode step's projections (ExecutionConfig.decode_linear)",
    )
    group.add_argument(
        "--kv-write",
        choices=["auto", "native", "reference"],
        default="auto",
        help="who stores each step's K/V (ExecutionConfig.kv_write; auto: the native kernel "
        "on GPUs, XLA's scatters on the CPU)",
    )
    group.add_argument(
        "--pallas-decode-lowering",
        choices=list(PALLAS_DECODE_LOWERINGS),
        default=None,
        help="the Pallas decode kernel's lowering in every decode step, with the pallas "
        "implementation (ExecutionConfig.pallas_decode_lowering; default: triton where this "
        "JAX has that lowering, else mosaic_gpu)",
    )
    for option, _, text in _SWITCHES:
        group.add_argument(option, choices=list(_TRISTATE), default="auto", help=text)
    group.add_argument(
        "--split-k",
        default="off",
        help="off, auto or N: the decode projections before the fused rope / norm kernels "
        "hand them split-K partial sums (ExecutionConfig.split_k: None, True, N)",
    )


def split_k_option(value: str):
    """``--split-k``'s value as ``ExecutionConfig.split_k``: off -> None, auto -> True, N."""
    if value in ("off", "auto"):
        return None if value == "off" else True
    if not value.isdigit() or int(value) < 1:
        raise SystemExit(f"--split-k takes off, auto or an int >= 1, got {value!r}")
    return int(value)


def execution_kwargs(args) -> dict:
    out = dict(
        unroll_layers={"auto": None, "unrolled": True, "scan": False}[args.layer_form],
        decode_linear=args.decode_linear,
        kv_write=args.kv_write,
        pallas_decode_lowering=args.pallas_decode_lowering,
        split_k=split_k_option(args.split_k),
    )
    for _, field, _ in _SWITCHES:
        out[field] = _TRISTATE[getattr(args, field)]
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--preset", choices=sorted(PRESETS), default="small", help="model shape")
    m.add_argument("--checkpoint", metavar="DIR", help="load a Hugging Face Llama instead")
    m.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="override dtype")
    m.add_argument("--layers", type=int, help="override the preset's layer count")
    w = p.add_argument_group("workload")
    w.add_argument("--system-tokens", type=int, default=512)
    w.add_argument("--chats", type=int, default=8)
    w.add_argument("--turns", type=int, default=3)
    w.add_argument("--few-shot", type=int, default=16)
    w.add_argument("--example-tokens", type=int, default=256)
    w.add_argument("--max-new-tokens", type=int, default=32)
    w.add_argument("--seed", type=int, default=0)
    e = p.add_argument_group("engine")
    e.add_argument("--page-size", type=int, default=16)
    e.add_argument("--num-pages", type=int, default=1024, help="KV pages per layer")
    e.add_argument("--max-batch-tokens", type=int, default=512)
    e.add_argument("--max-running", type=int, default=64)
    e.add_argument("--implementation", choices=["reference", "pallas", "native"])
    add_execution_args(e)
    e.add_argument(
        "--modes", default="on,off", help="radix cache modes to run, comma separated (on,off)"
    )
    e.add_argument(
        "--step-modes", default="multistep", help="of multistep,overlap,sync,device-paging"
    )
    e.add_argument("--decode-steps", type=int, default=8, help="steps per dispatch (multistep)")
    e.add_argument(
        "--cache-on-plan",
        choices=["on", "off"],
        default="on",
        help="a prompt's pages enter the prefix cache when its prefill is planned, not when "
        "its results are read (SchedulerConfig.cache_on_plan)",
    )
    e.add_argument(
        "--cascade",
        choices=["auto", "on", "off"],
        default="auto",
        help="cascade decode for rows that share cached prefix pages (ExecutionConfig.cascade)",
    )
    e.add_argument(
        "--cascade-min-tokens", type=int, default=128, help="shortest shared prefix it uses"
    )
    e.add_argument(
        "--cascade-model",
        default=None,
        help="the cost model --cascade auto decides with: the JSON bench_cascade.py --fit "
        "--json FILE wrote (ExecutionConfig.cascade_model; default: the model's defaults)",
    )
    e.add_argument(
        "--kv-dtype",
        choices=list(KV_DTYPES),
        help="FP8 KV pool (scales per layer and KV head calibrated on the first 4 prompts)",
    )
    e.add_argument(
        "--warm-runs",
        type=int,
        default=2,
        help="untimed runs of the workload on the runner that is then timed (the first compiles)",
    )
    e.add_argument(
        "--fresh-runner",
        action="store_true",
        help="time the workload on a new runner (new pool) after one untimed run on another",
    )
    e.add_argument(
        "--timed-runs",
        type=int,
        default=1,
        help="timed runs after the warm ones, each on a new engine over the warm runner: the "
        "table reports the run of median wall time and every run's generated tok/s",
    )
    p.add_argument(
        "--profile-host",
        type=int,
        default=0,
        metavar="N",
        help="cProfile each timed run; print its N costliest functions (by own time) to stderr",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="print each timed step to stderr: start, length, the dispatch it launched, the "
        "runner's launch and waits (where the device idles)",
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def preset_config(name: str, *, layers=None, dtype=None, **extra) -> llama.LlamaConfig:
    """The model of preset ``name`` (``PRESETS``), ``layers`` / ``dtype`` overriding its own
    when given, other LlamaConfig fields from ``extra``."""
    num_layers, hidden, inter, hq, hkv, d, vocab, preset_dtype = PRESETS[name]
    return llama.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers or num_layers,
        num_attention_heads=hq,
        num_key_value_heads=hkv,
        head_dim=d,
        dtype=dtype or preset_dtype,
        **extra,
    )


def build_model(args):
    if args.checkpoint:
        cfg, params = llama.load_checkpoint(args.checkpoint, dtype=args.dtype)
        return cfg, params, f"checkpoint {args.checkpoint}"
    cfg = preset_config(args.preset, layers=args.layers, dtype=args.dtype)
    return cfg, llama.init_params(cfg, jax.random.key(args.seed)), f"preset {args.preset}"


STEP_MODES = {
    "multistep": dict(overlap=True),
    "overlap": dict(overlap=True, decode_steps=1),
    "sync": dict(overlap=False, decode_steps=1),
    "device-paging": dict(overlap=True, device_paging=True),
}


def trace_steps(engine) -> list[str]:
    """Time every ``engine.step()`` and, inside it, the runner's ``launch`` (enqueueing a
    dispatch) and ``collect`` (blocking on one); return the list the lines go to, one a step:
    its start and length, what the dispatch it launched runs (extend tokens / chunks, decode
    rows x steps), when its launch started and how long it took, its waits, and how many
    requests it finished. The device idles where a wait ends and the next launch ends."""
    lines: list[str] = []
    t0 = [None]
    calls: dict = {}
    runner, step = engine.runner, engine.step

    def timed(name, fn):
        def call(*a):
            t = time.perf_counter()
            out = fn(*a)
            calls.setdefault(name, []).append((t - t0[0], time.perf_counter() - t))
            return out

        return call

    runner.launch = timed("launch", runner.launch)
    runner.collect = timed("wait", runner.collect)

    def traced():
        t = time.perf_counter()
        if t0[0] is None:
            t0[0] = t
        calls.clear()
        done = step()
        inflight = engine._inflight
        what = "-"
        if inflight is not None:
            plan = inflight.plan
            new = sum(c.end - c.start for c in plan.extend)
            what = f"extend {new}/{len(plan.extend)}" if plan.extend else ""
            if plan.decode:
                what += f" decode {len(plan.decode)}x{plan.decode_steps}"
        parts = [
            f"{name}@{a * 1e3:.1f}+{b * 1e3:.2f}" for name in ("launch", "wait")
            for a, b in calls.get(name, [])
        ]  # fmt: skip
        lines.append(
            f"{(t - t0[0]) * 1e3:8.1f} +{(time.perf_counter() - t) * 1e3:6.2f}  "
            f"{what.strip():28s} {' '.join(parts)}  finished {len(done)}"
        )
        return done

    engine.step = traced
    return lines


def run_mode(cfg, params, workload, args, radix: bool, step_mode: str, kv_scales) -> dict:
    settings = dict(decode_steps=args.decode_steps, cache_on_plan=args.cache_on_plan == "on")
    settings |= STEP_MODES[step_mode]

    def once(profile=False, runner=None, timeline=False):
        engine = Engine(
            cfg,
            params,
            num_pages=args.num_pages,
            page_size=args.page_size,
            max_batch_tokens=args.max_batch_tokens,
            max_running=args.max_running,
            radix_cache=radix,
            implementation=args.implementation,
            cascade=args.cascade,
            cascade_min_tokens=args.cascade_min_tokens,
            cascade_model=args.cascade_model,
            kv_dtype=args.kv_dtype,
            kv_scales=kv_scales,
            runner=runner,
            **settings,
            **execution_kwargs(args),
        )
        profiler = cProfile.Profile() if profile else None
        steps = trace_steps(engine) if timeline else None
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        records = run_workload(engine, workload, max_new_tokens=args.max_new_tokens, seed=args.seed)
        wall = time.perf_counter() - t0
        if profiler is not None:
            # The profiler slows Python down: this run's wall time is not the table's figure
            # unless --profile-host is off.
            profiler.disable()
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.profile_host)
            mode = f"{'radix on' if radix else 'radix off'}, {step_mode}"
            print(f"host profile, {mode}:\n{out.getvalue()}", file=sys.stderr)
        if steps is not None:
            mode = f"{'radix on' if radix else 'radix off'}, {step_mode}"
            print(f"step timeline, {mode} (ms from the first step):", file=sys.stderr)
            print("\n".join(steps), file=sys.stderr)
        return engine, records, wall

    warm, _, warm_s = once()  # compiles
    if args.fresh_runner:
        runner = None
    else:
        runner = warm.runner
        for _ in range(args.warm_runs - 1):
            once(runner=runner)
    compiled = sum(runner.trace_counts.values()) if runner is not None else 0
    runs = []
    for _ in range(args.timed_runs):
        runs.append(once(profile=args.profile_host > 0, runner=runner, timeline=args.timeline))
    # The run of median wall time stands for the mode (an even count: the slower middle one).
    median = sorted(range(len(runs)), key=lambda i: runs[i][2])[len(runs) // 2]
    engine, records, wall = runs[median]
    run_outputs = [{(r.kind, tuple(r.prompt)): r.output for r in rec} for _, rec, _ in runs]
    outputs = run_outputs[median]
    s = engine.stats
    served = s["prompt_tokens"] + s["generated_tokens"]
    return dict(
        mode=("radix on" if radix else "radix off") + f", {step_mode}",
        outputs=outputs if all(o == outputs for o in run_outputs) else None,
        run_gen_tok_s=[e.stats["generated_tokens"] / w for e, _, w in runs],
        requests=len(records),
        prompt_tokens=s["prompt_tokens"],
        cache_hit_tokens=s["prefix_hit_tokens"],
        cache_hit_pct=100.0 * s["prefix_hit_tokens"] / max(s["prompt_tokens"], 1),
        prefill_tokens=s["prefill_tokens"],
        generated_tokens=s["generated_tokens"],
        steps=s["steps"],
        decode_steps=s["decode_steps"],
        wall_s=wall,
        schedule_s=s["schedule_s"],
        launch_s=s["launch_s"],
        wait_s=s["wait_s"],
        commit_s=s["commit_s"],
        gen_tok_s=s["generated_tokens"] / wall,
        served_tok_s=served / wall,
        peak_pages=s["peak_pages_in_use"],
        preemptions=s["preemptions"],
        compiles_in_timed_run=sum(s["compiles"].values()) - compiled,
        runner="fresh" if args.fresh_runner else f"after {args.warm_runs} runs",
        warmup_s=warm_s,
        warmup_compiles=sum(warm.stats["compiles"].values()),
        attention_backend=s["attention_backend"],
        cascade_steps=s["cascade_steps"],
        cascade_saved_gb=s["cascade_saved_kv_bytes"] / 1e9,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg, params, name = build_model(args)
    workload = make_workload(
        cfg.vocab_size,
        seed=args.seed,
        system_tokens=args.system_tokens,
        chats=args.chats,
        turns=args.turns,
        few_shot=args.few_shot,
        example_tokens=args.example_tokens,
    )
    if args.warm_runs < 1:
        raise SystemExit(f"--warm-runs must be at least 1 (it compiles), got {args.warm_runs}")
    if args.timed_runs < 1:
        raise SystemExit(f"--timed-runs must be at least 1, got {args.timed_runs}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("on", "off") for m in modes):
        raise SystemExit(f"--modes must list 'on' and/or 'off', got {args.modes!r}")
    print(
        f"bench_engine: {name} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads x {cfg.head_dim}, "
        f"{cfg.dtype}) on {jax.devices()[0].device_kind}; {workload.num_requests} requests",
        file=sys.stderr,
    )
    step_modes = [m.strip() for m in args.step_modes.split(",") if m.strip()]
    if not step_modes or any(m not in STEP_MODES for m in step_modes):
        raise SystemExit(f"--step-modes must list some of {sorted(STEP_MODES)}")
    kv_scales = None
    if args.kv_dtype:
        prompts = [p for _, _, p in workload.initial_requests()[:4]]
        kv_scales = calibrate_kv_scales(cfg, params, prompts, args.kv_dtype)
    rows = []
    for m in modes:
        first = None
        for step_mode in step_modes:
            rows.append(run_mode(cfg, params, workload, args, m == "on", step_mode, kv_scales))
            print(f"  {rows[-1]['mode']}: {rows[-1]['wall_s']:.2f} s", file=sys.stderr)
            outputs = rows[-1].pop("outputs")
            if first is None:
                first = outputs
            # None: the timed runs of this mode disagreed among themselves.
            rows[-1]["same_outputs"] = outputs is not None and outputs == first
    columns = [
        ("mode", "mode", ""),
        ("requests", "requests", "d"),
        ("prompt_tokens", "prompt tok", "d"),
        ("cache_hit_pct", "cache hit %", ".1f"),
        ("prefill_tokens", "prefill computed", "d"),
        ("generated_tokens", "generated", "d"),
        ("steps", "dispatches", "d"),
        ("decode_steps", "decode steps", "d"),
        ("wall_s", "wall s", ".3f"),
        ("gen_tok_s", "gen tok/s", ".1f"),
        ("served_tok_s", "served tok/s", ".1f"),
        ("peak_pages", "peak pages", "d"),
        ("preemptions", "preempt", "d"),
        ("compiles_in_timed_run", "compiles (timed)", "d"),
        ("cascade_steps", "cascade steps", "d"),
        ("cascade_saved_gb", "KV GB not read", ".3f"),
        ("same_outputs", "same outputs", ""),
    ]
    print(table(rows, columns))
    if args.timed_runs > 1:
        print(
            f"\ngenerated tok/s of each of the {args.timed_runs} timed runs (the table: the run "
            "of median wall time)"
        )
        for r in rows:
            runs = ", ".join(f"{x:.0f}" for x in r["run_gen_tok_s"])
            print(f"  {r['mode']}: {runs}")
    host = [
        ("mode", "mode", ""),
        ("schedule_s", "schedule s", ".3f"),
        ("launch_s", "launch s", ".3f"),
        ("wait_s", "wait s", ".3f"),
        ("commit_s", "commit s", ".3f"),
    ]
    print("\nhost time (wait: blocked on the device)\n" + table(rows, host))
    by_mode = {r["mode"]: r for r in rows}
    for step_mode in step_modes:
        on, off = by_mode.get(f"radix on, {step_mode}"), by_mode.get(f"radix off, {step_mode}")
        if on and off:
            print(
                f"\nradix on vs off ({step_mode}): {on['gen_tok_s'] / off['gen_tok_s']:.2f}x "
                "generated tok/s, "
                f"{off['prefill_tokens'] / max(on['prefill_tokens'], 1):.2f}x fewer prefill tokens"
            )
    payload = dict(
        environment=environment(),
        model=dict(name=name, **{k: getattr(cfg, k) for k in cfg.__dataclass_fields__}),
        args={k: str(v) for k, v in vars(args).items()},
        results=rows,
    )
    write_json(args.json, payload)
    import json

    print(json.dumps(payload, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
