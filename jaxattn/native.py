"""Native kernels (C++ on the CPU, one CUDA/HIP source on GPUs) bound through the XLA FFI.

The shared libraries are built by ``pip install`` (CMake, see ``ffi/CMakeLists.txt``):
``libjaxattn_cpu.so`` always, ``libjaxattn_cuda.so`` when ``nvcc`` is found and an NVIDIA GPU
is visible (or ``JAXATTN_CUDA=ON``), ``libjaxattn_rocm.so`` likewise with ``hipcc`` and an AMD
GPU (``JAXATTN_HIP``). Each one is registered, on first use, for
the platform that runs the computation; the ops here are thin ``jax.ffi.ffi_call``
wrappers, so they work under ``jax.jit`` (the HLO shows a ``custom_call`` to
``jaxattn_*``) and under ``jax.vmap`` (one kernel call per mapped element).

Backend interface of :mod:`jaxattn.ops`: the arguments arrive validated, ``scale`` a
Python float; anything this backend cannot serve raises ``NotImplementedError``.

Split-KV decode: ``partition_size`` given -> that many tokens per partition, then the
combine kernel. ``None`` -> one pass, unless the batch leaves the GPU short of blocks;
then the kernel splits with ``$JAXATTN_PARTITION_SIZE`` tokens per partition when set (read
at trace time), else from a base of 512 tokens (256 when a KV head serves more than 15
query heads) it takes the largest power-of-two multiple or fraction of the base (down to
128 tokens) whose grid still fills 90% of one wave of resident blocks (two per
multiprocessor, eight for one query head per KV head): fewer, longer partitions pay fewer
pipeline fills and a smaller combine, as long as every multiprocessor has work.
Inside the kernels logits are in base 2 (scale folded with log2(e)); nothing in base 2
leaves them.
"""

from __future__ import annotations

import ctypes
import importlib.resources
import json
import math
import os
import pathlib
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "extend_attention",
    "is_available",
    "library_info",
    "library_path",
    "paged_attention",
    "prefix_prefill",
]

_LIBRARIES = {
    "cpu": "libjaxattn_cpu.so",
    "cuda": "libjaxattn_cuda.so",
    "rocm": "libjaxattn_rocm.so",
}
_FFI_PLATFORMS = {"cpu": "cpu", "cuda": "CUDA", "rocm": "ROCM"}
_HANDLER_SUFFIX = {"cpu": "Cpu", "cuda": "Gpu", "rocm": "Gpu"}
_TARGETS = {
    "jaxattn_paged_attention": "JaxattnPagedAttention",
    "jaxattn_prefix_prefill": "JaxattnPrefixPrefill",
    "jaxattn_extend_attention": "JaxattnExtendAttention",
}
_LAYOUT_IDS = {"bshd": 0, "bhsd": 1}
_GPU_HEAD_DIMS = (32, 64, 128, 256)
_MAX_GROUP = 64
_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))

# One-pass decode keeps one block per (sequence, KV head); below this many blocks per
# multiprocessor the kernel splits the context instead. On an H200 (132 SMs), bf16, D=128,
# Hq/Hkv=32/8: B=64 ctx=4096 (512 blocks) ran 5% faster in one pass than split by 512;
# B=8 (64 blocks) ran 3.6x faster split.
_MIN_BLOCKS_PER_SM = 3


# A split grid aims at one wave of resident blocks and takes the largest partition whose
# grid fills _WAVE_FILL of it. Resident blocks per H200 SM: 8 for the one-KV-head-per-query
# kernel (group 1, 64 registers), 2 for the others (the tensor-core kernel for 2..8 query
# heads per KV head holds 104 KiB of shared memory). H200, bf16, D=128, 32/8: B=1
# ctx=32768 ran at 70% of the copy bandwidth with 1024-token partitions (256 blocks) and
# 62% with 512 (512 blocks); B=8 ctx=4096 70% vs 65%; 2048 (128 blocks) fell to 59% in
# both. At 32/32, 4096-token partitions (256 blocks, a third of a wave) ran at 59%.
def _resident_blocks_per_sm(group: int) -> int:
    return 8 if group == 1 else 2


_WAVE_FILL = 0.9
_MIN_PARTITION = 128

_BUILD_HINT = (
    "build it from the repository root with `pip install -e .` (CMake >= 3.20 and a C++17 "
    "compiler; nvcc with a visible GPU, or JAXATTN_CUDA=ON, adds the CUDA library, hipcc "
    "likewise the ROCm one), or point "
    "$JAXATTN_NATIVE_LIB_DIR at a directory that holds it"
)

_lock = threading.Lock()
_registered: dict[str, str | None] = {}  # platform -> None when registered, else why not
_lib_handles: dict[str, ctypes.CDLL] = {}


# --- finding and registering the libraries -------------------------------------------


def _candidate_dirs():
    env = os.environ.get("JAXATTN_NATIVE_LIB_DIR")
    if env:
        yield from (pathlib.Path(p) for p in env.split(os.pathsep) if p)
    here = pathlib.Path(__file__).resolve().parent
    yield here
    # Editable installs that redirect imports keep the built files in the install tree,
    # which the package's resources (and sometimes __path__) also cover.
    pkg = sys.modules.get(__package__ or "jaxattn")
    for p in getattr(pkg, "__path__", []):
        yield pathlib.Path(p)
    for entry in sys.path:
        if entry:
            yield pathlib.Path(entry) / "jaxattn"


def library_path(platform: str) -> str | None:
    """Path of the native library for ``platform`` ("cpu", "cuda", "rocm"), or None."""
    name = _LIBRARIES[platform]
    for d in _candidate_dirs():
        f = d / name
        if f.is_file():
            return str(f)
    try:
        res = importlib.resources.files("jaxattn").joinpath(name)
        if res.is_file():
            return str(res)
    except (ModuleNotFoundError, TypeError, NotADirectoryError, AttributeError):
        pass
    return None


BUILD_INFO = "_build_info.json"


def _build_record(directory: pathlib.Path) -> dict | None:
    try:
        record = json.loads((directory / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def library_info() -> dict[str, dict]:
    """Per platform ("cpu", "cuda", "rocm"): ``path`` of its library (None: not found),
    ``loads`` (True, or why not; None when not found), ``build``: its entry in the
    ``_build_info.json`` that the build writes next to the libraries (compiler,
    architectures; None without a record), and ``not_built``: for a missing library, the
    reason the build that made the others gave for leaving it out (None if unknown).
    Nothing is registered with XLA."""
    out = {}
    for platform, name in _LIBRARIES.items():
        path = library_path(platform)
        entry = {"path": path, "loads": None, "build": None, "not_built": None}
        if path is not None:
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                entry["loads"] = str(e)
            else:
                suffix = _HANDLER_SUFFIX[platform]
                missing = [s + suffix for s in _TARGETS.values() if not hasattr(lib, s + suffix)]
                entry["loads"] = f"{name} lacks {missing}" if missing else True
            record = _build_record(pathlib.Path(path).parent)
            if record is not None:
                entry["build"] = record.get("libraries", {}).get(platform)
        out[platform] = entry
    for platform, entry in out.items():
        if entry["path"] is not None:
            continue
        for other in out.values():
            record = other["path"] and _build_record(pathlib.Path(other["path"]).parent)
            if record:
                entry["not_built"] = record.get("not_built", {}).get(platform)
                break
    return out


def _register(platform: str) -> str | None:
    path = library_path(platform)
    if path is None:
        return f"the jaxattn native library {_LIBRARIES[platform]} was not found; {_BUILD_HINT}"
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        return f"cannot load {path}: {e}; rebuild it ({_BUILD_HINT})"
    for target, symbol in _TARGETS.items():
        fn = getattr(lib, symbol + _HANDLER_SUFFIX[platform])
        jax.ffi.register_ffi_target(
            target, jax.ffi.pycapsule(fn), platform=_FFI_PLATFORMS[platform]
        )
    _lib_handles[platform] = lib
    return None


def _platform() -> str:
    backend = jax.default_backend()
    if backend == "cpu":
        return "cpu"
    if backend in ("cuda", "rocm"):
        return backend
    if backend == "gpu":
        version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
        return "rocm" if ("rocm" in version or "hip" in version) else "cuda"
    raise NotImplementedError(f"the native kernels do not run on the {backend!r} platform")


def _ensure_registered() -> str:
    platform = _platform()
    with _lock:
        if platform not in _registered:
            _registered[platform] = _register(platform)
    why = _registered[platform]
    if why is not None:
        raise NotImplementedError(why)
    return platform


def is_available() -> bool:
    """Whether the native library for the default platform is built and loadable."""
    try:
        _ensure_registered()
    except NotImplementedError:
        return False
    return True


# --- argument checks this backend adds --------------------------------------------------


def _check_serveable(platform, q, k_cache, v_cache, num_kv_heads, head_dim):
    dt = np.dtype(q.dtype)
    if dt not in _DTYPES:
        raise NotImplementedError(f"native kernels take float32/bfloat16/float16, got {dt}")
    if np.dtype(k_cache.dtype) != dt or np.dtype(v_cache.dtype) != dt:
        raise NotImplementedError(
            f"native kernels need q and the KV cache in one dtype, got {dt} and "
            f"{np.dtype(k_cache.dtype)}"
        )
    if platform != "cpu":
        if head_dim not in _GPU_HEAD_DIMS:
            raise NotImplementedError(
                f"native GPU kernels are built for head_dim in {_GPU_HEAD_DIMS}, got {head_dim}"
            )
        group = q.shape[1] // num_kv_heads
        if group > _MAX_GROUP:
            raise NotImplementedError(
                f"native GPU kernels serve up to {_MAX_GROUP} query heads per KV head, got {group}"
            )


def _paged_geometry(k_cache, layout):
    if layout not in _LAYOUT_IDS:
        raise NotImplementedError(
            f"native kernels read layouts {tuple(_LAYOUT_IDS)}, not layout={layout!r}"
        )
    if layout == "bshd":
        n, p, h, d = k_cache.shape
    else:
        n, h, p, d = k_cache.shape
    return n, p, h, d


def _attrs(scale, soft_cap):
    return dict(scale=np.float32(scale), soft_cap=np.float32(0.0 if soft_cap is None else soft_cap))


def _env_partition_size() -> int | None:
    env = os.environ.get("JAXATTN_PARTITION_SIZE", "").strip()
    if not env:
        return None
    try:
        value = int(env)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"JAXATTN_PARTITION_SIZE must be a positive integer, got {env!r}")
    return value


def _num_multiprocessors() -> int:
    count = getattr(jax.devices()[0], "core_count", None)
    return int(count) if count else 108


def choose_partition_size(partition_size, *, platform, batch, num_kv_heads, group, capacity) -> int:
    """Tokens per partition for decode, 0 for one pass (see the module docstring)."""
    if partition_size is not None:
        return int(partition_size)
    env = _env_partition_size()
    split = env or (256 if group > 15 else 512)
    if platform == "cpu" or capacity <= split:
        return 0
    sms = _num_multiprocessors()
    if batch * num_kv_heads >= _MIN_BLOCKS_PER_SM * sms:
        return 0
    if env is None:
        blocks = lambda size: batch * num_kv_heads * math.ceil(capacity / size)
        want = _WAVE_FILL * _resident_blocks_per_sm(group) * sms
        while 2 * split < capacity and blocks(2 * split) >= want:
            split *= 2
        while split > _MIN_PARTITION and blocks(split) < want:
            split //= 2
    return split


# --- ops ---------------------------------------------------------------------------------


def paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    *,
    scale,
    layout,
    partition_size=None,
    soft_cap=None,
):
    """Decode attention over a paged cache: q [B, Hq, D] -> [B, Hq, D] in q's dtype."""
    platform = _ensure_registered()
    _, page_size, num_kv_heads, head_dim = _paged_geometry(k_cache, layout)
    _check_serveable(platform, q, k_cache, v_cache, num_kv_heads, head_dim)
    batch, num_q_heads, _ = q.shape
    capacity = block_tables.shape[1] * page_size
    ps = choose_partition_size(
        partition_size,
        platform=platform,
        batch=batch,
        num_kv_heads=num_kv_heads,
        group=num_q_heads // num_kv_heads,
        capacity=capacity,
    )
    # Partial outputs and (max, sum) pairs of every partition, float32; a stub when one pass.
    max_parts = max(1, math.ceil(capacity / ps)) if ps else 0
    ws = batch * num_q_heads * max_parts * (head_dim + 2) if ps else 1
    call = jax.ffi.ffi_call(
        "jaxattn_paged_attention",
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((ws,), jnp.float32)),
        vmap_method="sequential",
    )
    out, _ = call(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        **_attrs(scale, soft_cap),
        layout=np.int32(_LAYOUT_IDS[layout]),
        partition_size=np.int32(ps),
    )
    return out


def prefix_prefill(
    q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, *, scale, layout, soft_cap=None
):
    """Prefix-cached prefill over a paged cache: q [Tq, Hq, D] -> [Tq, Hq, D]."""
    platform = _ensure_registered()
    _, _, num_kv_heads, head_dim = _paged_geometry(k_cache, layout)
    _check_serveable(platform, q, k_cache, v_cache, num_kv_heads, head_dim)
    call = jax.ffi.ffi_call(
        "jaxattn_prefix_prefill", jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential"
    )
    return call(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        block_tables,
        seq_lens,
        **_attrs(scale, soft_cap),
        layout=np.int32(_LAYOUT_IDS[layout]),
    )


def extend_attention(
    q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, *, scale, soft_cap=None
):
    """SGLang-form extend over a token pool [num_slots, Hkv, D]: q [Tq, Hq, D] -> [Tq, Hq, D]."""
    platform = _ensure_registered()
    _check_serveable(platform, q, k_cache, v_cache, k_cache.shape[1], k_cache.shape[2])
    call = jax.ffi.ffi_call(
        "jaxattn_extend_attention", jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential"
    )
    return call(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, **_attrs(scale, soft_cap))
