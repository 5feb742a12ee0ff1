"""The kernels of the engine's decode step as XLA compiles them for an H200, on a machine
with no GPU.

XLA can compile for a CUDA GPU it does not have (a compile-only device from a target
description): the optimised HLO then says how many kernels a step launches, which XLA
fusions sit between the library's kernels, and how XLA split each GEMM. This runs
``jaxattn.models.llama.forward_decode`` with the options the engine resolves on one GPU (the
native decode or the Pallas kernels, the native K/V store with the rotation fused) and
lists the launches of its entry computation::

    pip install "jax-cuda13-plugin==$(python -c 'import jax; print(jax.__version__)')" \\
        "jax-cuda13-pjrt==$(python -c 'import jax; print(jax.__version__)')"
    python benchmarks/xla_kernels.py --preset 1b --layers 3 --batch 64 --context 512
    python benchmarks/xla_kernels.py --preset 1b --layers 3 --fused-norm --split-k auto

It needs that plugin (its PJRT library compiles; no CUDA driver, cuDNN or GPU is used) and a
CUDA toolkit's ``ptxas`` on the PATH. What the compile-only device cannot know is filled in
with the H200's figures (:data:`H200_TARGET`; the decode kernel's resident blocks per SM as
the library measured them there). GEMM tile configurations are XLA's defaults, not the
autotuned ones of a real run; the fusions and the split-K choices match a run on the H200
(round 43's profile of the 1B step). Not a timing: the list of launches only. Nor are the
command buffers (CUDA graphs) of the compiled program a GPU run's: with no driver to ask,
XLA leaves custom calls and while loops out of them (its thunk sequence, ``--xla_dump_to``,
shows the library's calls between graphs), where on the H200 the engine's decode loop is one
graph with the calls traced into it.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import re
import sys

# The CUDA plugin checks for cuDNN and a driver when it loads; a compile needs neither.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# An H200 as XLA describes a GPU target (stream_executor's GpuTargetConfigProto, text form).
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H200"
"""

# Launches that are not kernels (views, tuples, parameters, constants).
_NOT_LAUNCHES = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One instruction of an entry computation that runs on the device: its name, what it is
    (``fusion:<kind>``, ``custom-call:<target>``, or the op) and its result shape."""

    name: str
    kind: str
    shape: str


def entry_launches(hlo_text: str, computation: str | None = None) -> list[Launch]:
    """The launches of the ENTRY computation of an optimised HLO module's text (or of the
    named ``computation``), in order."""
    head = "\nENTRY" if computation is None else f"\n%{computation} "
    start = hlo_text.index(head)
    entry = hlo_text[start : hlo_text.index("\n}\n", start)]
    out = []
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][\w-]*)\(", line)
        if not m or m.group(3) in _NOT_LAUNCHES:
            continue
        name, shape, op = m.groups()
        target = re.search(r'custom_call_target="([^"]+)"', line)
        fusion = re.search(r"\bkind=(\w+)", line)
        kind = op
        if target:
            kind += ":" + target.group(1)
        elif fusion:
            kind += ":" + fusion.group(1)
        out.append(Launch(name, kind, shape))
    return out


def while_body(hlo_text: str) -> str:
    """The name of the body computation of the ENTRY computation's first while loop."""
    entry = hlo_text[hlo_text.index("\nENTRY") :]
    found = re.search(r"= .*? while\(.*?body=%([\w.\-]+)", entry)
    if found is None:
        raise ValueError("the entry computation has no while loop")
    return found.group(1)


def per_layer(launches: list[Launch], marker: str) -> list[int]:
    """Launches from one ``marker`` launch (a kind: the attention's custom call) up to the
    next: the kernels of each layer after the first's attention (the last entry runs to the
    end of the step)."""
    at = [i for i, launch in enumerate(launches) if launch.kind == marker]
    return [b - a for a, b in zip(at, [*at[1:], len(launches)], strict=True)]


def compile_only_device():
    """A compile-only H200 (XLA's CUDA PJRT plugin; no GPU)."""
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(
            platform="cuda", topology="1x1x1", target_config=H200_TARGET
        )
    except (NotImplementedError, RuntimeError) as e:
        raise SystemExit(
            f"no CUDA PJRT plugin to compile with ({e}); install jax-cuda13-plugin and "
            "jax-cuda13-pjrt of this jax's version"
        ) from e
    return topo.devices[0]


def pretend_h200(head_dim: int) -> None:
    """Answer, as on an H200, the questions the library asks the device it runs on: the
    platform (CUDA), the decode and cascade kernels' occupancy (asked of the native library,
    which needs a GPU: 4 resident decode blocks an SM at head_dim 64, 2 above, as measured
    there), Pallas's lowering (compiled, sm_90) and Triton's target."""
    from jax._src.pallas.triton import gpu_info

    from jaxattn import native
    from jaxattn.pallas import _common, _mgpu

    jax.default_backend = lambda: "gpu"
    native._platform = lambda: "cuda"
    native._ensure_registered()
    blocks = 4 if head_dim <= 64 else 2
    native.decode_occupancy = lambda *a, **k: (blocks, 132)
    native.cascade_tile = lambda *a, **k: (64, 2, 132)
    _common.resolve_interpret = lambda i: False if i is None else bool(i)
    _mgpu.interpreted = lambda i: False if i is None else bool(i)
    _mgpu.is_sm90 = lambda: True
    gpu_info.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)


def parse_args(argv=None):
    from bench_engine import PRESETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    p.add_argument("--layers", type=int, default=3, help="layers compiled (the preset's: 0)")
    p.add_argument("--batch", type=int, default=64, help="decode rows")
    p.add_argument("--context", type=int, default=512, help="tokens a row's table covers")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--implementation", default="native", help="the attention backend")
    p.add_argument("--no-fused-rope", action="store_true", help="rotation and store apart")
    p.add_argument("--fused-norm", action="store_true", help="ExecutionConfig.fused_norm")
    p.add_argument("--split-k", default="off", help="off, auto or N (ExecutionConfig.split_k)")
    p.add_argument("--cascade", type=int, default=0, help="a prefix of this many tokens shared")
    p.add_argument(
        "--engine-loop",
        action="store_true",
        help="the engine's multistep decode program (greedy): list its loop body, one step",
    )
    p.add_argument("--kv-dtype", help="an FP8 pool (float8_e4m3fn, float8_e5m2), with scales")
    p.add_argument(
        "--stacked-scales",
        action="store_true",
        help="the scales as one [layers, kv heads] array (default: one array a layer, as the "
        "engine passes them)",
    )
    p.add_argument("--dump", help="write the optimised HLO here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from bench_engine import preset_config, split_k_option

    split_k = split_k_option(args.split_k)

    device = compile_only_device()
    cfg = preset_config(args.preset, layers=args.layers or None)
    pretend_h200(cfg.head_dim)
    from jaxattn.models import llama

    sharding = jax.sharding.SingleDeviceSharding(device)
    params = llama.serving_params(cfg, llama.init_params(cfg, jax.random.key(0)), unroll=True)
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), params
    )
    b, page = args.batch, args.page_size
    width = -(-args.context // page)
    pages = cfg.num_hidden_layers * (b * width + 8)
    pool_dtype = jnp.dtype(args.kv_dtype) if args.kv_dtype else cfg.jnp_dtype
    pool = jax.ShapeDtypeStruct(
        (pages, page, cfg.num_key_value_heads, cfg.head_dim), pool_dtype, sharding=sharding
    )

    def i32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)

    batch = llama.DecodeBatch(i32(b), i32(b), i32(b), i32(b, width), i32(b))
    scales = None
    if args.kv_dtype:
        hkv, n = cfg.num_key_value_heads, cfg.num_hidden_layers
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)  # noqa: E731
        one = f32(n, hkv) if args.stacked_scales else tuple(f32(hkv) for _ in range(n))
        scales = (one, one)
        batch = batch._replace(k_scale=one, v_scale=one)
    if args.cascade:
        batch = batch._replace(
            prefix_tables=i32(1, args.cascade // page), prefix_lens=i32(1), prefix_of=i32(b)
        )

    # split_k=True asks XLA for its split of each projection: ask the compile-only H200.
    llama.xla_split_k = functools.partial(llama.xla_split_k, device=device)

    def step(params, k, v, batch):
        return llama.forward_decode(
            params, cfg, k, v, batch, implementation=args.implementation, kv_write="native",
            fused_rope=not args.no_fused_rope, fused_norm=args.fused_norm,
            split_k=split_k,
        )  # fmt: skip

    if args.engine_loop:
        if args.cascade:
            raise SystemExit("--engine-loop compiles paged decode steps; leave out --cascade")
        from jaxattn.engine import runner

        # The decode options ModelRunner builds on one GPU (linear "pad": XLA's dot).
        options = runner.step_options(
            layout="bshd", extend_attention="extend", partition_size=None,
            backends=dict.fromkeys(("extend", "decode", "cascade"), args.implementation),
            kv_write="native", decode_linear="pad", fused_rope=not args.no_fused_rope,
            fused_norm=args.fused_norm, split_k=split_k,
        )["decode"]  # fmt: skip
        program = functools.partial(
            runner._decode_fn, model=cfg, options=options, num_rows=b,
            width=width, max_steps=8, page_size=page, greedy=True, tp=None,
        )  # fmt: skip
        state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            runner.init_decode_state(b, width, 1),
        )
        lowered = jax.jit(program, donate_argnums=(1, 2, 3)).lower(
            params, pool, pool, state, i32(b + 1), None, None, None, scales
        )
    else:
        lowered = jax.jit(step, donate_argnums=(1, 2)).lower(params, pool, pool, batch)
    text = lowered.compile().as_text()
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(text)
    launches = entry_launches(text, while_body(text) if args.engine_loop else None)
    for launch in launches:
        print(f"  {launch.name:36s} {launch.kind:40s} {launch.shape[:64]}")
    kinds = collections.Counter(launch.kind for launch in launches)
    attention = next((k for k in kinds if re.search(r"attention|mosaic_gpu|triton", k)), None)
    layers = per_layer(launches, attention) if attention else []
    what = "a step of the engine's decode loop" if args.engine_loop else "the step"
    print(
        f"{args.preset} ({cfg.num_hidden_layers} layers), batch {b}, context {args.context}: "
        f"{len(launches)} launches in {what}; from one layer's attention to the next: "
        f"{layers[:-1]}; after the last: {layers[-1:]}"
    )
    for kind, n in kinds.most_common():
        print(f"  {n:4d}  {kind}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
