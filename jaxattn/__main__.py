"""Command line: ``python -m jaxattn demo [options]`` and ``python -m jaxattn info``
(``--help`` lists every option).

A mistake in what was asked for (a flag's value, a checkpoint file) ends the command with
one line on stderr that names the flag or the file, and exit status 2, as argparse does for
the flags it parses itself; Ctrl-C ends it with one line and status 130 (128 + SIGINT, what
a shell reports for it). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import pathlib
import signal
import sys
import threading
import time

PROG = "python -m jaxattn"

DEMO_DESCRIPTION = """\
Serve a shared-prefix workload with the jaxattn engine and summarise what the paged KV
pool and the radix cache did.

Workload: multi-turn chats and few-shot prompts that all start with one long system
prompt (few-shot prompts also share a block of examples); each chat turn is queued the
moment the previous one finishes and carries the whole conversation so far. Tokens are
random ids, so no tokenizer is needed.

Model: a random-weight Llama (sizes below) or a Hugging Face Llama directory
(--checkpoint DIR: config.json + *.safetensors).

Tensor parallelism: --devices N splits the query and KV heads, the MLP and the KV pool's
KV heads over N devices (N must divide --heads, --kv-heads and the MLP width). On a CPU
host, N fake CPU devices are created for it; on a GPU host, the first N GPUs are used.
"""


# Prompts of the workload (in submission order) the FP8 pool's scales are calibrated on.
CALIBRATION_PROMPTS = 4


class UsageError(Exception):
    """A mistake in the command line or in the files it names: one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    # argparse prints its usage block and then the error; one line that names the flag is
    # what the rest of this command line prints too.
    def error(self, message):
        raise UsageError(f"{self.prog}: error: {message}")


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _temperature(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 is greedy), got {text!r}")
    return value


def _top_p(text: str) -> float:
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def _add_demo_args(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument("--checkpoint", metavar="DIR", help="Hugging Face Llama directory to load")
    m.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="parameter / KV dtype (default: float32 for the random model, the "
        "checkpoint's own dtype otherwise)",
    )
    m.add_argument("--layers", type=_count(1), default=4, help="random model: layers (default 4)")
    m.add_argument("--hidden", type=_count(1), default=256, help="random model: hidden size (256)")
    m.add_argument("--heads", type=_count(1), default=8, help="random model: query heads (8)")
    m.add_argument(
        "--kv-heads",
        type=_count(1),
        help="random model: KV heads (default 2, or --devices when that is larger, so that "
        "every device holds whole KV heads)",
    )
    m.add_argument("--vocab", type=_count(1), default=512, help="random model: vocabulary (512)")

    w = p.add_argument_group("workload")
    w.add_argument(
        "--system-tokens", type=_count(0), default=192, help="shared system prompt (192)"
    )
    w.add_argument("--chats", type=_count(0), default=4, help="multi-turn chats (4)")
    w.add_argument("--turns", type=_count(1), default=3, help="turns per chat (3)")
    w.add_argument("--few-shot", type=_count(0), default=8, help="few-shot requests (8)")
    w.add_argument(
        "--example-tokens", type=_count(0), default=96, help="shared few-shot examples block (96)"
    )
    w.add_argument("--max-new-tokens", type=_count(1), default=16, help="tokens per answer (16)")
    w.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy (default)")
    w.add_argument("--top-p", type=_top_p, default=1.0, help="nucleus sampling mass (1.0)")
    w.add_argument("--seed", type=_count(0), default=0, help="workload, weights and sampling seed")

    e = p.add_argument_group("engine")
    e.add_argument("--page-size", type=_count(1), default=16, help="tokens per KV page (16)")
    e.add_argument("--num-pages", type=_count(1), default=256, help="KV pages per layer (256)")
    e.add_argument(
        "--max-batch-tokens", type=_count(1), default=128, help="tokens computed per step (128)"
    )
    e.add_argument("--max-running", type=_count(1), default=32, help="sequences at once (32)")
    e.add_argument(
        "--no-radix", action="store_true", help="disable the radix prefix cache (for contrast)"
    )
    e.add_argument(
        "--kv-dtype",
        choices=["fp8_e4m3", "fp8_e5m2"],
        help="KV pool dtype (default: the model's): an FP8 pool takes one byte per element, "
        f"with scales per layer and KV head calibrated on the workload's first "
        f"{CALIBRATION_PROMPTS} prompts",
    )
    e.add_argument(
        "--devices",
        type=_count(1),
        default=1,
        metavar="N",
        help="tensor-parallel over N devices (default 1); on the CPU, N fake devices",
    )
    e.add_argument(
        "--implementation",
        choices=["reference", "pallas", "native"],
        help="attention backend (default: the fastest for the platform)",
    )

    o = p.add_argument_group("output")
    o.add_argument(
        "--verify",
        action="store_true",
        help="check every generated token against a dense forward pass without any cache; "
        "a token that is not the dense pass's choice fails only when their logit gap exceeds "
        "the tolerance of the dtype (float32 1e-3, float16 5e-3, bfloat16 5e-2, relative to "
        "the largest logit; with --kv-dtype, the larger of that and the FP8 format's: "
        "fp8_e4m3 7.5e-2, fp8_e5m2 1e-1)",
    )
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    o.add_argument("--json", action="store_true", help="also print the engine stats as JSON")


def _use_devices(n: int):
    """A mesh over ``n`` devices (None for one), asking for ``n`` CPU devices first.

    The CPU device count can only be set before JAX starts its backends; when they are
    already up (JAX was used before in this process), the devices that exist are used.
    """
    if n == 1:
        return None
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except AttributeError:  # pragma: no cover - a jax without the option reads the flag
        import os

        flag = f"--xla_force_host_platform_device_count={n}"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    except RuntimeError:
        pass  # backends already started
    from jaxattn import sharding

    available = jax.devices()
    if len(available) < n:
        raise UsageError(
            f"--devices {n}: only {len(available)} {jax.default_backend()} device(s) available"
        )
    return sharding.make_mesh(n, devices=available)


def _check_split(devices: int, *sizes) -> None:
    """Tensor parallelism gives every device whole heads and an equal MLP slice."""
    for name, size in sizes:
        if size % devices:
            raise UsageError(
                f"--devices {devices} must divide {name} ({size}): every device holds whole "
                "heads and an equal share of the MLP"
            )


_JSON_TYPES = {list: "an array", str: "a string", bool: "true/false", type(None): "null"}


def _checkpoint_config(directory: str, dtype):
    """The checkpoint's config, after checking every file the weights will be read from,
    so that a mistake in any of them is named before minutes go into loading."""
    import safetensors

    from jaxattn.models import llama

    path = pathlib.Path(directory)
    if not path.is_dir():
        raise UsageError(f"--checkpoint {directory}: no such directory")
    config = path / "config.json"
    try:
        hf = json.loads(config.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(
            f"--checkpoint: {config} not found (a Hugging Face Llama directory holds "
            "config.json and *.safetensors)"
        ) from None
    except json.JSONDecodeError as e:
        raise UsageError(
            f"--checkpoint: {config} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--checkpoint: cannot read {config}: {e}") from None
    if not isinstance(hf, dict):
        kind = _JSON_TYPES.get(type(hf), "a number")
        raise UsageError(f"--checkpoint: {config} must hold a JSON object, not {kind}")
    try:
        cfg = llama.config_from_hf(hf, dtype=dtype)
    except (ValueError, TypeError) as e:
        raise UsageError(f"--checkpoint: {config}: {e}") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UsageError(f"--checkpoint: {path} has no *.safetensors files")
    # Each file's header on its own (a cheap read), so that a broken file is named.
    broken = (getattr(safetensors, "SafetensorError", ValueError), OSError)
    for file in files:
        try:
            with safetensors.safe_open(str(file), framework="np") as f:
                f.keys()
        except broken as e:
            raise UsageError(
                f"--checkpoint: {file} is not a readable safetensors file: {e}"
            ) from None
    return cfg


def _model_config(args):
    """(config, one-line description) of the model asked for; nothing is loaded yet."""
    from jaxattn.models import llama

    if args.checkpoint:
        cfg = _checkpoint_config(args.checkpoint, args.dtype)
        name = f"checkpoint {args.checkpoint}"
        _check_split(
            args.devices,
            ("query heads", cfg.num_attention_heads),
            ("KV heads", cfg.num_key_value_heads),
            ("intermediate_size", cfg.intermediate_size),
        )
    else:
        if args.hidden % args.heads:
            raise UsageError(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
        if args.hidden // args.heads % 2:
            raise UsageError(
                f"--hidden {args.hidden} / --heads {args.heads} must be even: it is the head "
                "dim, which rotary embeddings split in halves"
            )
        if args.kv_heads and args.heads % args.kv_heads:
            raise UsageError(
                f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}"
            )
        kv_heads = args.kv_heads or max(2, args.devices)
        _check_split(
            args.devices,
            ("--heads", args.heads),
            ("--kv-heads", kv_heads),
            ("the MLP width (2 x --hidden)", 2 * args.hidden),
        )
        try:
            cfg = llama.LlamaConfig(
                vocab_size=args.vocab,
                hidden_size=args.hidden,
                intermediate_size=2 * args.hidden,
                num_hidden_layers=args.layers,
                num_attention_heads=args.heads,
                num_key_value_heads=kv_heads,
                dtype=args.dtype or "float32",
            )
        except ValueError as e:
            raise UsageError(f"model options: {e}") from None
        name = "random-weight Llama"
    desc = (
        f"{name}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} q/kv heads of {cfg.head_dim}, "
        f"vocab {cfg.vocab_size}, {cfg.dtype}"
    )
    return cfg, desc


def _model_params(args, cfg):
    import jax

    from jaxattn.models import llama

    if not args.checkpoint:
        return llama.init_params(cfg, jax.random.key(args.seed))
    try:
        _, params = llama.load_checkpoint(args.checkpoint, dtype=args.dtype)
    except (ValueError, TypeError, OSError) as e:
        raise UsageError(f"--checkpoint {args.checkpoint}: {e}") from None
    return params


def _table(rows) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def _with_lowering(stats: dict, kind: str) -> str:
    """A step kind's attention backend, with its Pallas lowering where it has one."""
    lowering = stats.get("attention_lowering", {}).get(kind)
    backend = stats["attention_backend"][kind]
    return backend if lowering is None else f"{backend} ({lowering} lowering)"


def demo(args) -> int:
    import jax

    import jaxattn
    from jaxattn.engine import Buckets, Engine, calibrate_kv_scales, check_outputs
    from jaxattn.engine.workload import make_workload, run_workload

    mesh = _use_devices(args.devices)
    if args.implementation and args.implementation not in jaxattn.available_backends():
        raise UsageError(
            f"--implementation {args.implementation}: not available on the "
            f"{jax.default_backend()} backend here (python -m jaxattn info shows what was built)"
        )
    cfg, model_desc = _model_config(args)
    workload = make_workload(
        cfg.vocab_size,
        seed=args.seed,
        system_tokens=args.system_tokens,
        chats=args.chats,
        turns=args.turns,
        few_shot=args.few_shot,
        example_tokens=args.example_tokens,
    )
    if not workload.num_requests:
        raise UsageError("--chats 0 and --few-shot 0: the workload has no request")
    longest = workload.longest_request(args.max_new_tokens)
    if longest > cfg.max_position_embeddings:
        raise UsageError(
            f"the longest request of this workload reaches {longest} tokens with its answer, "
            f"more than the model's max_position_embeddings={cfg.max_position_embeddings}; "
            "lower --system-tokens, --example-tokens, --turns or --max-new-tokens"
        )
    # As the engine counts: the last token drawn is never written to the pool.
    pages = -(-(longest - 1) // args.page_size)
    if pages > args.num_pages:
        raise UsageError(
            f"--num-pages {args.num_pages}: the longest request of this workload needs "
            f"{pages} pages of --page-size {args.page_size} ({longest - 1} tokens of KV); "
            f"raise --num-pages to at least {pages}"
        )
    params = _model_params(args, cfg)
    kv_scales = None
    if args.kv_dtype:
        # The workload's first prompts, in the order run_workload submits them.
        calibration = [p for _, _, p in workload.initial_requests()[:CALIBRATION_PROMPTS]]
        kv_scales = calibrate_kv_scales(cfg, params, calibration, args.kv_dtype)
    engine_kwargs = dict(
        num_pages=args.num_pages,
        page_size=args.page_size,
        max_batch_tokens=args.max_batch_tokens,
        max_running=args.max_running,
        radix_cache=not args.no_radix,
        implementation=args.implementation,
        # Coarse shape buckets: a short CPU run is dominated by compiling programs, and
        # padding an extend step to the full token budget costs less than a new program.
        buckets=Buckets(
            tokens=args.max_batch_tokens,
            kv=8 * args.max_batch_tokens,
            extend_batch=8,
            decode_batch=16,
            pages=32,
        ),
        track_waste=True,
        mesh=mesh,
        kv_dtype=args.kv_dtype,
        kv_scales=kv_scales,
    )
    try:
        engine = Engine(cfg, params, **engine_kwargs)
    except ValueError as e:
        raise UsageError(f"engine options: {e}") from None
    on = f"{args.devices} {jax.default_backend()} devices" if mesh else jax.default_backend()
    print(f"jaxattn demo on {on}: {model_desc}", file=sys.stderr)
    start = time.perf_counter()
    try:
        records = run_workload(
            engine,
            workload,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            progress=not args.quiet,
        )
    except NotImplementedError as e:
        # A backend named explicitly never falls back, and says why it cannot serve.
        if args.implementation is None:
            raise
        raise UsageError(f"--implementation {args.implementation}: {e}") from None
    wall = time.perf_counter() - start
    failed = [r for r in records if r.finish_reason == "error"]
    if failed:
        # Non-finite logits (a NaN in the checkpoint, say): no summary of plausible-looking
        # tokens, one line saying which request failed and why.
        more = f" (and {len(failed) - 1} more requests)" if len(failed) > 1 else ""
        print(f"{PROG} demo: error: {failed[0].kind}{more}: {failed[0].error}", file=sys.stderr)
        return 1
    s = engine.stats

    prompt_tokens = s["prompt_tokens"]
    hit = s["prefix_hit_tokens"]
    pct = lambda a, b: f"{100.0 * a / b:.1f}%" if b else "-"
    run_time = s["time_s"] - s["compile_steps_time_s"]
    steady = s["generated_tokens"] / run_time if run_time > 0 else 0.0
    kv_mib = s["kv_pool_bytes"] / 2**20
    page_bytes = s["kv_pool_bytes"] / s["num_pages"]
    contiguous_mib = s["peak_kv_slots_contiguous"] / s["page_size"] * page_bytes / 2**20
    paged_slots = s["peak_pages_in_use"] * s["page_size"]
    paged_mib = s["peak_pages_in_use"] * page_bytes / 2**20
    rows = [
        ("model", model_desc),
        (
            "requests",
            f"{s['requests']} ({args.chats} chats x {args.turns} turns + {args.few_shot} few-shot)",
        ),
        ("generated tokens", f"{s['generated_tokens']}"),
        ("prompt tokens", f"{prompt_tokens}"),
        ("  served from radix cache", f"{hit} ({pct(hit, prompt_tokens)})"),
        (
            "  computed (prefill)",
            f"{s['prefill_tokens']} ({pct(s['prefill_tokens'], prompt_tokens)})",
        ),
        (
            "peak pages in use",
            f"{s['peak_pages_in_use']} / {s['num_pages']} pages of {s['page_size']} tokens "
            f"(pool {kv_mib:.1f} MiB; {s['cached_pages']} pages cached at the end)",
        ),
        (
            "KV cache dtype",
            f"{s['kv_dtype']} ({args.kv_dtype}: scales per layer and KV head calibrated on "
            f"{len(calibration)} prompts)"
            if args.kv_dtype
            else f"{s['kv_dtype']} (the model's; --kv-dtype fp8_e4m3 stores one byte per element)",
        ),
        (
            "tensor parallel",
            f"{s['tp']} devices: heads, MLP and KV pool split, "
            f"{s['kv_pool_bytes_per_device'] / 2**20:.1f} MiB of the pool on each"
            if s["tp"] > 1
            else "off (one device; --devices N splits the model over N)",
        ),
        (
            "KV slots at peak",
            f"paged {paged_slots} ({paged_mib:.1f} MiB) vs contiguous preallocation "
            f"{s['peak_kv_slots_contiguous']} ({contiguous_mib:.1f} MiB), "
            f"{s['peak_kv_slots_contiguous'] / max(paged_slots, 1):.1f}x more "
            "(prompt + max_new per running request, no sharing)",
        ),
        (
            "KV memory waste",
            f"paged {100 * s['kv_waste_paged']:.1f}% vs contiguous "
            f"{100 * s['kv_waste_contiguous']:.1f}% of reserved slots hold no distinct "
            "live token",
        ),
        ("preemptions / evicted tokens", f"{s['preemptions']} / {s['evicted_tokens']}"),
        (
            "steps",
            f"{s['steps']} dispatches ({s['extend_calls']} extend, {s['decode_calls']} decode "
            f"running {s['decode_steps']} decode steps)",
        ),
        (
            "time",
            f"{wall:.1f} s wall, {s['compile_steps_time_s']:.1f} s of it in steps that "
            f"compiled ({sum(s['compiles'].values())} programs)",
        ),
        (
            "tokens/s (generated)",
            f"{s['generated_tokens'] / wall:.1f} overall, {steady:.1f} excluding compile steps",
        ),
        (
            "attention backend",
            f"extend: {_with_lowering(s, 'extend')} ({engine.runner.extend_attention}), "
            f"decode: {_with_lowering(s, 'decode')}",
        ),
    ]
    if args.verify:
        report = check_outputs(
            params,
            cfg,
            [r.prompt for r in records],
            [r.output for r in records],
            max_new_tokens=args.max_new_tokens,
            stop_ids=engine.stop_ids,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=[r.seed for r in records],
            sample_ids=[0] * len(records),
            kv_dtype=args.kv_dtype,
        )
        rows.append(("verify (no-cache recompute)", report.summary(len(records))))
    print("\n" + _table(rows))
    if args.json:
        print(json.dumps(s, indent=1, sort_keys=True))
    if args.verify and not report.ok:
        for line in report.problems[:10]:
            print("  " + line, file=sys.stderr)
        return 1
    return 0


def _sm(arch: str) -> tuple[int, int] | None:
    """(major, minor) of "sm_90" / "sm_90a" / "sm_80-real"; None for anything else."""
    digits = arch.removeprefix("sm_").split("-")[0].rstrip("af")
    return (int(digits[:-1]), int(digits[-1])) if digits.isdigit() and len(digits) >= 2 else None


def _cuda_fit(capability: str, archs: list[str]) -> str:
    """How a CUDA library built for ``archs`` runs on a device of ``capability`` ("9.0")."""
    try:
        device = tuple(int(x) for x in capability.split("."))
    except ValueError:
        return ""
    built = [a for a in map(_sm, archs) if a]
    # Machine code runs on later minors of its major; PTX is compiled by the driver for
    # any later device (slowly, on first load).
    if any(a[0] == device[0] and a[1] <= device[1] for a in built):
        return ""
    if any(a < device for a in built):
        return " (no machine code for it: the driver compiles the library's PTX on first load)"
    arch = capability.replace(".", "")
    return f" (the CUDA library holds no code for it: rebuild with JAXATTN_CUDA_ARCHS={arch})"


def environment_info() -> dict:
    """What ``python -m jaxattn info`` prints, as a dict (also its ``--json``)."""
    import jax
    import jaxlib
    import numpy as np

    import jaxattn
    from jaxattn import native

    backend = jax.default_backend()
    devices = []
    for d in jax.devices():
        item = {"id": d.id, "platform": d.platform, "kind": d.device_kind}
        capability = getattr(d, "compute_capability", None)
        if capability:
            item["compute_capability"] = str(capability)
        devices.append(item)
    libraries = native.library_info()
    try:
        from jaxattn.pallas import _mgpu, _triton

        why = _triton.missing()
        triton = "available" if why is None else f"unavailable ({why})"
        mosaic = "available" if _mgpu.available() is None else "unavailable"
        if why is not None:
            triton += (
                "; the Mosaic GPU kernels alone serve (paged decode, prefix prefill, cascade "
                "decode; no token-pool extend)"
            )
    except Exception as e:  # any import failure means the backend cannot be used
        triton = mosaic = f"unavailable ({type(e).__name__}: {e})"
    if backend == "cpu":
        pallas = (
            "interpret mode on the CPU (implementation=None does not try it there); "
            f"Triton lowering for GPUs {triton}; Mosaic GPU lowering (sm_90) {mosaic}"
        )
    elif backend in ("gpu", "cuda", "rocm"):
        pallas = f"Triton lowering {triton}; Mosaic GPU lowering (sm_90) {mosaic}"
    else:
        pallas = f"not for the {backend} platform"
    return {
        "jaxattn": jaxattn.__version__,
        "package": str(pathlib.Path(jaxattn.__file__).parent),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": np.__version__,
        "backend": backend,
        "devices": devices,
        "default_implementations": list(jaxattn.default_implementations()),
        "available_backends": list(jaxattn.available_backends()),
        "pallas": pallas,
        "native": libraries,
    }


def info(args) -> int:
    env = environment_info()
    if args.json:
        print(json.dumps(env, indent=1))
        return 0
    lines = [
        f"jaxattn {env['jaxattn']} ({env['package']})",
        f"python {env['python']}, jax {env['jax']}, jaxlib {env['jaxlib']}, numpy {env['numpy']}",
    ]
    devices = env["devices"]
    kinds = sorted({d["kind"] for d in devices})
    lines.append(f"default backend: {env['backend']}, {len(devices)} device(s): {', '.join(kinds)}")
    cuda_archs = (env["native"]["cuda"]["build"] or {}).get("architectures")
    for d in devices:
        if "compute_capability" in d:
            cc = d["compute_capability"]
            fit = _cuda_fit(cc, cuda_archs) if cuda_archs else ""
            lines.append(f"  device {d['id']}: {d['kind']}, compute capability {cc}{fit}")
    lines.append(
        "attention backends: implementation=None tries "
        f"{' -> '.join(env['default_implementations'])}; importable here: "
        f"{', '.join(env['available_backends'])}"
    )
    lines.append(f"pallas: {env['pallas']}")
    lines.append("native libraries:")
    for platform, lib in env["native"].items():
        if lib["path"] is None:
            why = (
                f"not built: {lib['not_built']}"
                if lib["not_built"]
                else "not found (why: unknown, no build record)"
            )
            lines.append(f"  {platform:<5} {why}")
            continue
        loads = "loads" if lib["loads"] is True else f"does not load: {lib['loads']}"
        build = lib["build"]
        if build:
            archs = " ".join(build.get("architectures", [])) or "unknown architectures"
            made = f"{build.get('compiler', 'compiler unknown')}, for {archs}"
            if build.get("hopper_prefill"):
                made += f" (+ {build['hopper_prefill']} prefill)"
        else:
            made = "compiler and architectures unknown (no _build_info.json next to it)"
        lines.append(f"  {platform:<5} {lib['path']}")
        lines.append(f"        {loads}; {made}")
    print("\n".join(lines))
    return 0


def _end_progress_line() -> None:
    progress = sys.modules.get("jaxattn.engine.progress")
    if progress is not None:
        progress.end_line()


def _inside_finalizer(frame) -> bool:
    """Whether ``frame`` runs inside a garbage-collector callback or a ``__del__``, where
    Python prints an exception raised and drops it."""
    callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    while frame is not None:
        if frame.f_code in callbacks or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def _interrupts_remembered(resend_after: float = 0.02):
    """Raise KeyboardInterrupt on SIGINT while the command runs, as Python does, and note it.

    A SIGINT that arrives inside a garbage-collector callback (JAX has one) or a ``__del__``
    is not raised there, where Python would print the exception and drop it: the signal is
    sent again ``resend_after`` seconds later. Yields a list that is non-empty once a SIGINT
    arrived, so that the caller can still end as interrupted should an interrupt be lost on
    its way up. Where SIGINT is not Python's default handler (ignored by a background
    launcher, or set by the embedding program), it is left alone and the list stays empty.
    """
    seen: list = []
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield seen
        return
    lock = threading.Lock()
    pending: list = []  # the timers of signals to send again; cleared on the way out

    def resend():
        with lock:
            if pending:
                pending.clear()
                os.kill(os.getpid(), signal.SIGINT)

    def on_sigint(signum, frame):
        seen.append(signum)
        if _inside_finalizer(frame):
            with lock:
                timer = threading.Timer(resend_after, resend)
                timer.daemon = True
                pending.append(timer)
            timer.start()
            return
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield seen
    finally:
        with lock:
            for timer in pending:
                timer.cancel()
            pending.clear()
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _run(args) -> int:
    return info(args) if args.command == "info" else demo(args)


def main(argv=None) -> int:
    """Run the command line; return its exit status (2: a usage error, 130: interrupted)."""
    parser = _Parser(prog=PROG, description="jaxattn: paged / radix KV-cache serving in JAX.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "demo",
        help="serve a shared-prefix chat workload and summarise the memory savings",
        description=DEMO_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_demo_args(p)
    i = sub.add_parser(
        "info",
        help="versions, devices, attention backends and the native libraries built",
        description="Print what jaxattn finds here: versions, devices, the attention backends "
        "tried by default, and each native library (path, whether it loads, compiler and "
        "architectures from the build record).",
    )
    i.add_argument("--json", action="store_true", help="print it as JSON")
    args = None
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        with _interrupts_remembered() as interrupted:
            status = _run(args)
        if interrupted:
            # A SIGINT arrived and its KeyboardInterrupt never reached here (the command
            # finished before the signal sent again arrived, or something caught it): Ctrl-C
            # still means interrupted.
            raise KeyboardInterrupt
        return status
    except UsageError as e:
        _end_progress_line()
        message = str(e)
        if not message.startswith(PROG):
            message = f"{PROG} {getattr(args, 'command', '')}: error: {message}"
        print(message, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _end_progress_line()
        command = f" {args.command}" if getattr(args, "command", None) else ""
        print(f"{PROG}{command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`... | head`): nothing left to say, and nobody to say it to.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    status = main()
    if status == 130:
        # Leave without tearing the interpreter down: an interrupt that landed while XLA was
        # compiling can leave its threads mid-work, and finalising under them has crashed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
