"""Command line: ``python -m jaxattn demo [options]`` (``--help`` lists every option)."""

from __future__ import annotations

import argparse
import json
import sys
import time

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


def _count(minimum: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


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
    w.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    w.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0)")
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
        help="check every generated token against a dense forward pass without any cache",
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
        raise SystemExit(
            f"--devices {n}: only {len(available)} {jax.default_backend()} device(s) available"
        )
    return sharding.make_mesh(n, devices=available)


def _check_split(devices: int, *sizes) -> None:
    """Tensor parallelism gives every device whole heads and an equal MLP slice."""
    for name, size in sizes:
        if size % devices:
            raise SystemExit(
                f"--devices {devices} must divide {name} ({size}): every device holds whole "
                "heads and an equal share of the MLP"
            )


def _model(args):
    import jax

    from jaxattn.models import llama

    if args.checkpoint:
        try:
            cfg, params = llama.load_checkpoint(args.checkpoint, dtype=args.dtype)
        except ValueError as e:
            raise SystemExit(f"--checkpoint: {e}") from e
        name = f"checkpoint {args.checkpoint}"
        _check_split(
            args.devices,
            ("query heads", cfg.num_attention_heads),
            ("KV heads", cfg.num_key_value_heads),
            ("intermediate_size", cfg.intermediate_size),
        )
    else:
        if args.hidden % args.heads:
            raise SystemExit(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
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
            raise SystemExit(f"model options: {e}") from e
        params = llama.init_params(cfg, jax.random.key(args.seed))
        name = "random-weight Llama"
    desc = (
        f"{name}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} q/kv heads of {cfg.head_dim}, "
        f"vocab {cfg.vocab_size}, {cfg.dtype}"
    )
    return cfg, params, desc


def _table(rows) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def demo(args) -> int:
    import jax

    from jaxattn.engine import Buckets, Engine, check_outputs
    from jaxattn.engine.workload import make_workload, run_workload

    mesh = _use_devices(args.devices)
    cfg, params, model_desc = _model(args)
    workload = make_workload(
        cfg.vocab_size,
        seed=args.seed,
        system_tokens=args.system_tokens,
        chats=args.chats,
        turns=args.turns,
        few_shot=args.few_shot,
        example_tokens=args.example_tokens,
    )
    longest = (
        args.system_tokens
        + max(args.example_tokens + 32, args.turns * (32 + args.max_new_tokens))
        + args.max_new_tokens
    )
    if -(-longest // args.page_size) > args.num_pages:
        raise SystemExit(
            f"--num-pages {args.num_pages} x --page-size {args.page_size} cannot hold a "
            f"{longest}-token conversation; raise --num-pages"
        )
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
    )
    try:
        engine = Engine(cfg, params, **engine_kwargs)
    except ValueError as e:
        raise SystemExit(f"engine options: {e}") from e
    on = f"{args.devices} {jax.default_backend()} devices" if mesh else jax.default_backend()
    print(f"jaxattn demo on {on}: {model_desc}", file=sys.stderr)
    start = time.perf_counter()
    records = run_workload(
        engine,
        workload,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        progress=not args.quiet,
    )
    wall = time.perf_counter() - start
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
        ("steps", f"{s['steps']} ({s['extend_calls']} extend, {s['decode_calls']} decode calls)"),
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
            f"extend: {s['attention_backend']['extend']} ({engine.runner.extend_attention}), "
            f"decode: {s['attention_backend']['decode']}",
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
        )
        verdict = "OK" if report.ok else f"FAILED ({len(report.problems)} mismatches)"
        ties = f", {report.near_ties} near-ties" if report.near_ties else ""
        rows.append(
            (
                "verify (no-cache recompute)",
                f"{verdict}: {report.checked} tokens of {len(records)} outputs checked{ties}",
            )
        )
    print("\n" + _table(rows))
    if args.json:
        print(json.dumps(s, indent=1, sort_keys=True))
    if args.verify and not report.ok:
        for line in report.problems[:10]:
            print("  " + line, file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxattn",
        description="jaxattn: paged / radix KV-cache serving in JAX.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "demo",
        help="serve a shared-prefix chat workload and summarise the memory savings",
        description=DEMO_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_demo_args(p)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
