"""Native kernels (C++ on the CPU, one CUDA/HIP source on GPUs) bound through the XLA FFI.

The shared libraries are built by ``pip install`` (CMake, see ``ffi/CMakeLists.txt``):
``libjaxattn_cpu.so`` always, ``libjaxattn_cuda.so`` when ``nvcc`` is found and an NVIDIA GPU
is visible (or ``JAXATTN_CUDA=ON``), ``libjaxattn_rocm.so`` likewise with ``hipcc`` and an AMD
GPU (``JAXATTN_HIP``). Each one is registered, on first use, for
the platform that runs the computation; the ops here are thin ``jax.ffi.ffi_call``
wrappers, so they work under ``jax.jit`` (the HLO shows a ``custom_call`` to
``jaxattn_*``) and under ``jax.vmap`` (one kernel call per mapped element).

Backend contract (:mod:`jaxattn.backend`): :data:`IMPLEMENTATIONS` holds this backend's
implementation of each op, with its configuration (:class:`DecodeConfig`,
:class:`PrefillConfig`) and the heuristic that picks one. The functions
:func:`paged_attention`, :func:`prefix_prefill` and :func:`extend_attention` take arguments
already validated by :mod:`jaxattn.ops` and raise ``NotImplementedError`` for anything this
backend cannot serve; :func:`write_kv` likewise after :mod:`jaxattn.kv` (its results alias the
caches, so a donated pool is written in place).

Split-KV decode (:func:`choose_partition_size`): ``partition_size`` given -> that many tokens
per partition, then the combine kernel. Otherwise one pass, unless the batch leaves the GPU
short of blocks (fewer than 3 an SM, unless they fit one wave of a kernel of at most 4 an
SM with about 2 an SM); then the split from ``$JAXATTN_PARTITION_SIZE`` when set, else the shared
rule :func:`jaxattn.backend.split_kv_partition` aimed at 90% of one wave of resident blocks,
where the resident blocks per multiprocessor, the multiprocessor count and the blocks a KV
head takes (:func:`decode_head_blocks`) come from the library itself
(``cudaOccupancyMaxActiveBlocksPerMultiprocessor`` on the kernel the launcher would pick, or
its HIP twin), never from numbers written here.
Inside the kernels logits are in base 2 (scale folded with log2(e)); nothing in base 2
leaves them.

FP8 KV caches (``float8_e4m3fn`` / ``float8_e5m2``, :mod:`jaxattn.quant`) are read as stored
and widened in registers; the per-KV-head scales are operands (float32 ``[Hkv]``, or empty
for 1.0), so new scale values reuse the compiled call. The CPU handlers take an FP8 cache
under any q dtype; the GPU kernels under a bfloat16 or float16 q. An FP8 q (the prefill ops'
mixed mode) reaches them widened exactly to the output dtype, its scale folded into
``k_scale`` (:attr:`jaxattn.ops._Args.kernel_q`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
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

from . import env as _env
from . import layout as L
from . import quant as _quant
from .backend import CascadeGrid, KernelImplementation, cascade_grid, split_kv_partition

__all__ = [
    "IMPLEMENTATIONS",
    "CascadeConfig",
    "DecodeConfig",
    "PrefillConfig",
    "cascade_attention",
    "cascade_tile",
    "choose_partition_size",
    "decode_head_blocks",
    "decode_occupancy",
    "extend_attention",
    "is_available",
    "library_info",
    "library_path",
    "linear",
    "linear_rows_per_split",
    "linear_unsupported",
    "paged_attention",
    "prefix_prefill",
    "write_kv",
    "write_unsupported",
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
    "jaxattn_cascade_attention": "JaxattnCascadeAttention",
    "jaxattn_linear": "JaxattnLinear",
    "jaxattn_write_kv": "JaxattnWriteKv",
    "jaxattn_rope_write_kv": "JaxattnRopeWriteKv",
    "jaxattn_add_rms_norm": "JaxattnAddRmsNorm",
}
_LAYOUT_IDS = {"bshd": 0, "bhsd": 1}
_GPU_HEAD_DIMS = (32, 64, 128, 256)
_MAX_GROUP = 64
_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_DTYPE_IDS = {np.dtype(jnp.float32): 0, np.dtype(jnp.bfloat16): 1, np.dtype(jnp.float16): 2}
# The cache's element type for the occupancy query: 0 q's own, 1 e4m3, 2 e5m2.
_KV_IDS = {np.dtype(jnp.float8_e4m3fn): 1, np.dtype(jnp.float8_e5m2): 2}
_GPU_FP8_Q = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
# The operand lists this module passes (ffi/src/ffi_common.h: kFfiAbi); a library that
# reports another version was built from other sources.
_FFI_ABI = 10

# One-pass decode keeps one block per (sequence, KV head); with at least this many blocks per
# multiprocessor the grid is full without splitting. On an H200 (132 SMs), bf16, D=128,
# Hq/Hkv=32/8: B=64 ctx=4096 (512 blocks) ran 5% faster in one pass than split by 512;
# B=8 (64 blocks) ran 3.6x faster split.
_ONE_PASS_BLOCKS_PER_SM = 3

# A split grid aims at this fraction of one wave of resident blocks. H200, bf16, D=128, 32/8:
# B=1 ctx=32768 ran at 70% of the copy bandwidth with 1024-token partitions (256 blocks, 2
# resident per SM) and 62% with 512 (512 blocks); B=8 ctx=4096 70% vs 65%; 2048 (128 blocks)
# fell to 59% in both.
# A grid past one wave doubles its partitions when they still fill half a wave: the e4m3
# kernel (3 resident per SM, 396 a wave) at B=1 ctx=32768 took 40.9 us with 512 tokens (512
# blocks) and 33.4 us with 1024 (256 blocks).
_WAVE_FILL = 0.9
_MIN_PARTITION = 128
# Below _ONE_PASS_BLOCKS_PER_SM, a one-pass grid that fits one wave of its kernel's resident
# blocks and holds _WAVE_FILL of this many blocks an SM also runs in one pass: its blocks all
# start together and stream to the end, where a split grid twice its size pays a second
# wave (or its FP8 cap) and the combine. H100, 132 SMs, D=128, graph timing, one run, one
# pass against the split of 2048 the 3-an-SM threshold chose: 32/8 32 x 4096 (256 blocks)
# bf16 201.2 / 202.1 us, e4m3 106.6 / 112.9; 128/8 16 x 4096 (256) bf16 123.2 / 134.9, e4m3
# 72.8 / 72.9; 128/8 24 x 4096 e4m3 (384 blocks, 4 an SM a wave) 96.5 / 122.3. Fewer blocks
# still split: 32/8 24 x 4096 (192) bf16 163.9 / 159.3, e4m3 88.7 / 84.5; 16 x 4096 (128)
# e4m3 69.6 / 58.1; and so does a one-pass grid past one wave below 3 an SM (128/8 24 x 4096
# bf16, 384 blocks at 2 an SM: 206.9 / 194.2). D=64, 32/8, one pass against the better of
# 1024 and 2048: 48 x 4096 (384 blocks) bf16 153.1 / 155.6, e4m3 102.3 / 114.8; 32 x 4096 bf16
# 101.3 / 107.4, e4m3 67.4 / 71.9; 24 x 4096 (192, split) bf16 81.2 / 81.5, e4m3 57.7 / 55.2.
_ONE_WAVE_BLOCKS_PER_SM = 2
# ... for kernels of at most this many resident blocks an SM (measured on the tensor-core
# kernels, 2-4 an SM, whose blocks each keep a ring of 64-key tiles in flight). The one-head
# SIMT kernel (bf16 32/32, 8 an SM, smaller blocks) does not stream at the ceiling with 2
# blocks an SM: H100, 8 x 4096 32/32 bf16 in one pass (256 blocks) 249.9 us, 68% of the read
# ceiling, where 1 x 32768 (the same bytes) split into 1024-token partitions took 190.0 us, 89%.
_ONE_WAVE_MAX_OCCUPANCY = 4
# The FP8 tensor-core kernel fits four blocks an SM at head_dim 128, but its split grids ran
# faster at two: H200, e4m3, 32/8, 1024-token partitions (256 blocks) against 512 (512 blocks),
# batch 1 x 32768 27.3 / 27.4 against 27.9 / 27.7 us, 4 x 8192 27.3 / 27.2 against 28.2 / 28.1,
# 8 x 4096 27.3 / 27.3 against 28.3 / 28.4, 16 x 2048 27.6 / 27.6 against 27.8 / 27.7; fewer,
# longer blocks pay fewer pipeline starts and a combine over half the partitions.
# Groups past 8 take ceil(group / 8) tensor-core blocks a KV head (decode_head_blocks), and the
# rule counts those blocks, with the FP8 kernel's own occupancy (no cap). H100, 132 SMs, D=128,
# graph timing, one run: 64/4 heads 64 x 4096 one pass against the pairs' count's split of 2048
# 242.1 / 259.9 us bf16, 126.7 / 145.5 e4m3; bf16 at 1024 against 512 tokens 38.6 / 43.1 (8 x
# 4096) and 38.5 / 42.7 (1 x 32768); bf16 at 2048 against 1024 69.3 / 72.3 (128/8, 8 x 4096),
# 67.8 / 71.3 (128/8, 1 x 32768), 70.3 / 73.6 (64/4, 16 x 4096). The other e4m3 rows keep their
# partitions (with the cap, counting blocks chose 2048 at 128/8 8 x 4096: 43.8 against 41.8 us).
_FP8_SPLIT_BLOCKS_PER_SM = 2

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
    abi = lib.jaxattn_ffi_abi() if hasattr(lib, "jaxattn_ffi_abi") else 1
    if abi != _FFI_ABI:
        return (
            f"{path} was built from other sources (operand list version {abi}, this module "
            f"passes {_FFI_ABI}); rebuild it ({_BUILD_HINT})"
        )
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


# --- what this backend serves ----------------------------------------------------------------


def _unsupported(platform, q, k_cache, v_cache, num_kv_heads, head_dim) -> str | None:
    dt = np.dtype(q.dtype)
    kv = np.dtype(k_cache.dtype)
    if dt not in _DTYPES:
        return f"native kernels take a float32/bfloat16/float16 q, got {dt}"
    if np.dtype(v_cache.dtype) != kv:
        return f"native kernels need k_cache and v_cache in one dtype, got {kv} and {v_cache.dtype}"
    if kv != dt and not _quant.is_fp8(kv):
        return f"native kernels need the KV cache in q's dtype or an FP8 format, got {dt} and {kv}"
    if _quant.is_fp8(kv) and platform != "cpu" and dt not in _GPU_FP8_Q:
        return (
            f"native GPU kernels read an FP8 ({kv}) cache under a bfloat16 or float16 q, got {dt}"
        )
    if platform != "cpu":
        if head_dim not in _GPU_HEAD_DIMS:
            return f"native GPU kernels are built for head_dim in {_GPU_HEAD_DIMS}, got {head_dim}"
        group = q.shape[1] // num_kv_heads
        if group > _MAX_GROUP:
            return (
                f"native GPU kernels serve up to {_MAX_GROUP} query heads per KV head, got {group}"
            )
    return None


# The GPU decode and cascade rings keep a row's offset as a uint32 row number (a row: head_dim
# elements of one token and KV head; 0xffffffff marks a masked row), so they address at most
# 2**32 - 2 rows of a cache: more than any 16-bit cache or head_dim >= 64 a GPU holds, but an
# FP8 cache of head_dim 32 on a 141 GB card could pass it.
_MAX_RING_ROWS = 2**32 - 2


def _ring_rows_unsupported(platform, k_cache, v_cache, head_dim) -> str | None:
    if platform == "cpu" or head_dim <= 0:
        return None
    rows = max(math.prod(k_cache.shape), math.prod(v_cache.shape)) // head_dim
    if rows > _MAX_RING_ROWS:
        return (
            f"native GPU decode addresses at most {_MAX_RING_ROWS} cache rows of head_dim "
            f"elements (uint32 row numbers), got a k_cache / v_cache of {rows}"
        )
    return None


def _cache_unsupported(platform, q, k_cache, v_cache, geom, ring) -> str | None:
    """Why the native kernels cannot serve this cache (None: they can); ring: the op runs the
    GPU decode rings, whose row bound applies too."""
    reason = _unsupported(platform, q, k_cache, v_cache, geom.num_kv_heads, geom.head_dim)
    if reason is None and ring:
        reason = _ring_rows_unsupported(platform, k_cache, v_cache, geom.head_dim)
    return reason


def _layout_id(layout) -> int:
    name = L.get(layout, pool=True).name
    if name not in _LAYOUT_IDS:
        raise NotImplementedError(
            f"native kernels read layouts {tuple(_LAYOUT_IDS)}, not layout={name!r}"
        )
    return _LAYOUT_IDS[name]


def _require(platform, q, k_cache, v_cache, layout, ring=False) -> L.CacheGeometry:
    """The geometry of a cache the native kernels serve; ring: the op runs the decode rings."""
    if L.get(layout, pool=True).name != L.POOL:
        _layout_id(layout)
    geom = L.get(layout, pool=True).geometry(k_cache, v_cache)
    reason = _cache_unsupported(platform, q, k_cache, v_cache, geom, ring)
    if reason is not None:
        raise NotImplementedError(reason)
    return geom


def _attrs(scale, soft_cap):
    return dict(scale=np.float32(scale), soft_cap=np.float32(0.0 if soft_cap is None else soft_cap))


def _scale_operand(scale):
    """A per-KV-head scale as the kernels take it: float32 [Hkv], or empty for 1.0."""
    if scale is None:
        return jnp.zeros((0,), jnp.float32)
    return jnp.asarray(scale).astype(jnp.float32)


# --- occupancy: asked of the library, not written here ---------------------------------------


def _decode_query(platform, symbol, what, dtype, head_dim, group, kv_dtype, outputs: int):
    """``outputs`` ints from the library's decode query ``symbol`` (q dtype, cache dtype,
    head_dim, group -> int pointers); ``RuntimeError`` naming ``what`` when it fails or
    reports a value below 1."""
    lib = _lib_handles[platform]
    values = [ctypes.c_int(0) for _ in range(outputs)]
    kv_id = 0 if kv_dtype is None else _KV_IDS.get(np.dtype(kv_dtype), 0)
    err = getattr(lib, symbol)(
        ctypes.c_int(_DTYPE_IDS[np.dtype(dtype)]),
        ctypes.c_int(kv_id),
        ctypes.c_int(head_dim),
        ctypes.c_int(group),
        *(ctypes.byref(v) for v in values),
    )
    if err != 0 or any(v.value <= 0 for v in values):
        raise RuntimeError(
            f"the native library could not report {what} (dtype {np.dtype(dtype)}, cache "
            f"{kv_dtype}, head_dim {head_dim}, group {group}): error {err}"
        )
    return tuple(v.value for v in values)


@functools.cache
def decode_occupancy(
    platform: str, dtype, head_dim: int, group: int, kv_dtype=None
) -> tuple[int, int]:
    """(resident blocks per multiprocessor, multiprocessors) of the decode kernel the GPU
    launcher picks for this q dtype, cache dtype (None: q's), head_dim and GQA group, on the
    current device: the library runs ``cudaOccupancyMaxActiveBlocksPerMultiprocessor`` (or
    the HIP twin) on the kernel with its block size and shared memory."""
    return _decode_query(
        platform,
        "jaxattn_decode_occupancy",
        "the decode kernel's occupancy",
        dtype,
        head_dim,
        group,
        kv_dtype,
        outputs=2,
    )


@functools.cache
def decode_head_blocks(platform: str, dtype, head_dim: int, group: int, kv_dtype=None) -> int:
    """Blocks a KV head of one sequence takes in the grid of the decode kernel the GPU
    launcher picks (as :func:`decode_occupancy`): ``ceil(group / 8)`` on the tensor-core
    kernels, whose blocks serve 8 query heads each, else 1."""
    (blocks,) = _decode_query(
        platform,
        "jaxattn_decode_head_blocks",
        "the decode grid's blocks per KV head",
        dtype,
        head_dim,
        group,
        kv_dtype,
        outputs=1,
    )
    return blocks


def choose_partition_size(
    partition_size,
    *,
    platform,
    batch,
    num_kv_heads,
    group,
    capacity,
    occupancy=None,
    head_blocks=1,
    one_pass_occupancy=None,
) -> int:
    """Tokens per partition for decode, 0 for one pass (see the module docstring).

    ``occupancy``: ``(resident blocks per SM, SMs)`` a split grid is sized for (the kernel's,
    :func:`decode_occupancy`, with the FP8 cap); needed off the CPU (``ValueError`` without
    it).
    ``head_blocks``: the blocks a KV head takes (:func:`decode_head_blocks`); the rule
    counts the grid's blocks, each serving ``ceil(group / head_blocks)`` query heads.
    ``one_pass_occupancy``: the one-pass kernel's resident blocks per SM (no cap); with it,
    and at most ``_ONE_WAVE_MAX_OCCUPANCY``, a one-pass grid that fits one wave of them and
    holds ``_WAVE_FILL`` x ``_ONE_WAVE_BLOCKS_PER_SM`` blocks an SM runs in one pass.
    """
    if partition_size is not None:
        return int(partition_size)
    if platform == "cpu":
        return 0
    if occupancy is None:
        raise ValueError(
            f"choose_partition_size on {platform!r} needs occupancy=(blocks per SM, SMs), "
            "as decode_occupancy reports it"
        )
    env = _env.overrides().partition_size
    blocks_per_sm, sms = occupancy
    blocks = batch * num_kv_heads * head_blocks
    if env is not None:
        return 0 if capacity <= env or blocks >= _ONE_PASS_BLOCKS_PER_SM * sms else env
    if (
        one_pass_occupancy is not None
        and one_pass_occupancy <= _ONE_WAVE_MAX_OCCUPANCY
        and _WAVE_FILL * _ONE_WAVE_BLOCKS_PER_SM * sms <= blocks <= one_pass_occupancy * sms
    ):
        return 0
    return split_kv_partition(
        batch=batch,
        num_kv_heads=num_kv_heads * head_blocks,
        group=-(-group // head_blocks),
        capacity=capacity,
        target_blocks=_WAVE_FILL * blocks_per_sm * sms,
        wave=blocks_per_sm * sms,
        grow=True,
        one_pass_blocks=_ONE_PASS_BLOCKS_PER_SM * sms,
        min_partition=_MIN_PARTITION,
    )


# --- configurations ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Native decode. ``partition_size``: tokens per split-KV partition (then the combine
    kernel), 0 for one pass. An op's explicit ``partition_size=`` wins over it.
    ``copies``: how the GPU kernels bring K/V pages into shared memory: ``auto`` (the tensor
    memory accelerator on compute capability 9.0 for a 16-bit cache at head_dim 32 to 128, pages
    of a power of two >= 8 tokens and partitions of whole 64-token tiles, and for an FP8 cache
    at head_dim 64 to 256 on one-pass grids of at least three blocks a multiprocessor over
    tables of 1024 tokens or more; 16-byte row gathers elsewhere), ``gathers`` (the row gathers
    always) or ``tma`` (the tensor memory accelerator wherever it can serve, whatever the grid:
    for tests and timing). The CPU kernel ignores it."""

    partition_size: int = 0
    copies: str = "auto"

    def __post_init__(self):
        if isinstance(self.partition_size, bool) or not isinstance(self.partition_size, int):
            raise TypeError(f"partition_size must be an int, got {self.partition_size!r}")
        if self.partition_size < 0:
            raise ValueError(f"partition_size must be >= 0, got {self.partition_size}")
        if self.copies not in _env.DECODE_COPY_MODES:
            raise ValueError(f"copies must be one of {_env.DECODE_COPY_MODES}, got {self.copies!r}")


# The FFI attribute `copies` (kDecodeCopiesAuto / Gathers / Tma in params.h).
_COPY_IDS = {name: i for i, name in enumerate(_env.DECODE_COPY_MODES)}


# The FFI attribute `kernel`: a name's position in the names the environment variable takes
# (PrefillKernel in ffi/include/jaxattn/prefill.cuh: auto, sm90, mma, simt, sm90_persistent).
_KERNEL_IDS = {name: i for i, name in enumerate(_env.PREFILL_KERNELS)}


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Native prefill (``prefix_prefill``, ``extend_attention``). ``kernel`` picks the GPU
    kernel: ``auto`` (the Hopper wgmma kernel on compute capability 9.0 for extends of 64
    or more new tokens a request on average, else the mma.sync one, else SIMT), ``sm90``,
    ``mma`` or ``simt``; a forced kernel is used wherever it supports the dtype and head
    dim. ``sm90_persistent``: the Hopper kernel launched one block per multiprocessor, each
    claiming tiles from a counter until none is left (overlapping one tile's last products
    with the next one's first loads); ``auto`` does not pick it: on an H100, through the public
    ops, it ran level with the one-tile-a-block launch on long extends and up to 5% behind on
    short ones. The CPU has one kernel."""

    kernel: str = "auto"

    def __post_init__(self):
        if self.kernel not in _KERNEL_IDS:
            raise ValueError(f"kernel must be one of {tuple(_KERNEL_IDS)}, got {self.kernel!r}")


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
    k_scale=None,
    v_scale=None,
    config: DecodeConfig | None = None,
):
    """Decode attention over a paged cache: q [B, Hq, D] -> [B, Hq, D] in q's dtype.

    k_scale, v_scale: float32 [Hkv] (or None) of a scaled / FP8 cache. ``partition_size``
    (explicit) wins over ``config``; with neither, the heuristic of
    :func:`choose_partition_size` picks. The copies are ``config``'s, else
    ``$JAXATTN_DECODE_COPIES``'s, else ``auto``."""
    platform = _ensure_registered()
    geom = _require(platform, q, k_cache, v_cache, layout, ring=True)
    batch, num_q_heads, head_dim = q.shape
    if partition_size is not None:
        ps = int(partition_size)
    elif config is not None:
        ps = config.partition_size
    else:
        ps = _heuristic_partition(platform, q, geom, block_tables.shape[1], k_cache.dtype)
    copies = config.copies if config is not None else _decode_copies()
    capacity = block_tables.shape[1] * geom.page_size
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
        _scale_operand(k_scale),
        _scale_operand(v_scale),
        **_attrs(scale, soft_cap),
        layout=np.int32(_layout_id(layout)),
        partition_size=np.int32(ps),
        copies=np.int32(_COPY_IDS[copies]),
    )
    return out


def _decode_copies() -> str:
    """The decode copies when no config names them: ``$JAXATTN_DECODE_COPIES``, else auto."""
    return _env.overrides().decode_copies or "auto"


def _heuristic_partition(platform, q, geom, max_pages, kv_dtype=None) -> int:
    group = q.shape[1] // geom.num_kv_heads
    occupancy, head_blocks, one_pass = None, 1, None
    if platform != "cpu":
        kv = None if kv_dtype is None or not _quant.is_fp8(kv_dtype) else np.dtype(kv_dtype)
        head_blocks = decode_head_blocks(platform, q.dtype, geom.head_dim, group, kv)
        kernel = decode_occupancy(platform, q.dtype, geom.head_dim, group, kv)
        occupancy, one_pass = _split_occupancy(kernel, kv, head_blocks), kernel[0]
    return choose_partition_size(
        None,
        platform=platform,
        batch=q.shape[0],
        num_kv_heads=geom.num_kv_heads,
        group=group,
        capacity=max_pages * geom.page_size,
        occupancy=occupancy,
        head_blocks=head_blocks,
        one_pass_occupancy=one_pass,
    )


def _split_occupancy(occupancy: tuple[int, int], kv_dtype, head_blocks: int = 1) -> tuple[int, int]:
    """The (blocks per SM, SMs) a split grid is sized for: the kernel's occupancy, at most
    ``_FP8_SPLIT_BLOCKS_PER_SM`` for an FP8 cache whose KV heads take one block each (see
    ``_FP8_SPLIT_BLOCKS_PER_SM``)."""
    if kv_dtype is not None and _quant.is_fp8(kv_dtype) and head_blocks == 1:
        return min(occupancy[0], _FP8_SPLIT_BLOCKS_PER_SM), occupancy[1]
    return occupancy


def _prefill_config(config):
    if config is not None:
        return config
    return PrefillConfig(_env.overrides().prefill_kernel or "auto")


def _prefill_results(q):
    """The prefill calls' results: the output, and one uint32 the persistent GPU kernel claims
    its work items from (zeroed by its launcher; unused by the other kernels and the CPU)."""
    return (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((1,), jnp.uint32))


def prefix_prefill(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    block_tables,
    seq_lens,
    *,
    scale,
    layout,
    soft_cap=None,
    k_scale=None,
    v_scale=None,
    config: PrefillConfig | None = None,
):
    """Prefix-cached prefill over a paged cache: q [Tq, Hq, D] -> [Tq, Hq, D]."""
    platform = _ensure_registered()
    _require(platform, q, k_cache, v_cache, layout)
    call = jax.ffi.ffi_call("jaxattn_prefix_prefill", _prefill_results(q), vmap_method="sequential")
    out, _ = call(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        block_tables,
        seq_lens,
        _scale_operand(k_scale),
        _scale_operand(v_scale),
        **_attrs(scale, soft_cap),
        layout=np.int32(_layout_id(layout)),
        kernel=np.int32(_KERNEL_IDS[_prefill_config(config).kernel]),
    )
    return out


def extend_attention(
    q,
    k_cache,
    v_cache,
    qo_indptr,
    kv_indptr,
    kv_indices,
    *,
    scale,
    soft_cap=None,
    k_scale=None,
    v_scale=None,
    config: PrefillConfig | None = None,
):
    """SGLang-form extend over a token pool [num_slots, Hkv, D]: q [Tq, Hq, D] -> [Tq, Hq, D]."""
    platform = _ensure_registered()
    _require(platform, q, k_cache, v_cache, L.POOL)
    call = jax.ffi.ffi_call(
        "jaxattn_extend_attention", _prefill_results(q), vmap_method="sequential"
    )
    out, _ = call(
        q,
        k_cache,
        v_cache,
        qo_indptr,
        kv_indptr,
        kv_indices,
        _scale_operand(k_scale),
        _scale_operand(v_scale),
        **_attrs(scale, soft_cap),
        kernel=np.int32(_KERNEL_IDS[_prefill_config(config).kernel]),
    )
    return out


# --- KV writes ---------------------------------------------------------------------------------

# The cache dtypes the write kernel stores into (any of them from a _DTYPES input).
_WRITE_CACHE_DTYPES = (*_DTYPES, *(np.dtype(d) for d in _quant.FP8_DTYPES))


def write_kv(k_cache, v_cache, k, v, slot_mapping, *, layout, k_scale=None, v_scale=None):
    """:func:`jaxattn.write_kv` in one kernel launch for both caches, each result aliased
    to its cache (in place when the caller donates them, as the engine does)."""
    _ensure_registered()
    call = jax.ffi.ffi_call(
        "jaxattn_write_kv",
        (
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ),
        input_output_aliases={0: 0, 1: 1},
        vmap_method="sequential",
    )
    return call(
        k_cache,
        v_cache,
        k,
        v,
        slot_mapping,
        _scale_operand(k_scale),
        _scale_operand(v_scale),
        layout=np.int32(_layout_id(layout)),
    )


def write_unsupported(a, platform: str, op: str = "write_kv") -> str | None:
    """Why the native write kernel cannot serve these :class:`jaxattn.kv.WriteArgs`, or None
    (``op``: the op the reason names; rope_write_kv's records pass the same checks)."""
    if a.layout.name not in _LAYOUT_IDS:
        return f"native {op} stores layouts {tuple(_LAYOUT_IDS)}, not {a.layout.name!r}"
    if a.in_dtype not in _DTYPES or np.dtype(a.v.dtype) != np.dtype(a.k.dtype):
        return f"native {op} takes k and v in one of {[d.name for d in _DTYPES]}"
    if a.kv_dtype not in _WRITE_CACHE_DTYPES or np.dtype(a.v_cache.dtype) != a.kv_dtype:
        return f"native {op} stores into a float or FP8 cache, got {a.kv_dtype}"
    if platform != "cpu" and a.geometry.head_dim % 8:
        return f"the GPU {op} needs head_dim a multiple of 8, got {a.geometry.head_dim}"
    return None


def rope_write_kv(
    qkv, cos, sin, k_cache, v_cache, slot_mapping, *, layout, k_scale=None, v_scale=None,
    dtype=None,
):  # fmt: skip
    """:func:`jaxattn.rope_write_kv` in one kernel launch: the rotated q rows and both
    caches' stores, each cache result aliased to its cache. ``qkv`` may be float32 ``[S, T,
    H, D]`` partial sums, summed by the kernel and rounded to ``dtype``."""
    _ensure_registered()
    hq = qkv.shape[-2] - 2 * L.cache_geometry(k_cache, v_cache, layout).num_kv_heads
    q_dtype = qkv.dtype if dtype is None else dtype
    call = jax.ffi.ffi_call(
        "jaxattn_rope_write_kv",
        (
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
            jax.ShapeDtypeStruct((qkv.shape[-3], hq, qkv.shape[-1]), q_dtype),
        ),
        input_output_aliases={0: 0, 1: 1},
        vmap_method="sequential",
    )
    k_cache, v_cache, q = call(
        k_cache,
        v_cache,
        qkv,
        cos,
        sin,
        slot_mapping,
        _scale_operand(k_scale),
        _scale_operand(v_scale),
        layout=np.int32(_layout_id(layout)),
        num_q_heads=np.int32(hq),
    )
    return q, k_cache, v_cache


def rope_write_unsupported(a, platform: str) -> str | None:
    """Why the native rope_write_kv kernel cannot serve these
    :class:`jaxattn.kv.RopeWriteArgs`, or None."""
    # (qkv is both k and v of the record; in_dtype is the rows' dtype, partial sums' too)
    why = write_unsupported(a, platform, "rope_write_kv")
    if why is not None:
        return why
    if platform != "cpu" and a.geometry.head_dim % 16:
        return f"the GPU rope_write_kv needs head_dim a multiple of 16, got {a.geometry.head_dim}"
    return None


# --- a residual add followed by RMSNorm: the decode step's glue between projections ----------


def add_rms_norm_unsupported(x, d, w, platform: str | None = None) -> str | None:
    """Why :func:`add_rms_norm` cannot serve these arguments, or None."""
    platform = _platform() if platform is None else platform
    dt = np.dtype(x.dtype)
    if dt not in _DTYPES:
        return f"add_rms_norm takes float32/bfloat16/float16 rows, got {dt}"
    partials = d.ndim == 3
    if np.dtype(w.dtype) != dt or np.dtype(d.dtype) != (np.dtype(np.float32) if partials else dt):
        return (
            f"add_rms_norm takes x, d and w in one dtype (or d as float32 partial sums), got "
            f"{dt}, {d.dtype} and {w.dtype}"
        )
    if (
        x.ndim != 2
        or d.shape[partials:] != x.shape
        or (partials and d.shape[0] < 1)
        or w.shape != x.shape[1:]
    ):
        return (
            f"add_rms_norm takes x and d [rows, cols] (or d [splits, rows, cols] partial sums) "
            f"and w [cols], got {tuple(x.shape)}, {tuple(d.shape)} and {tuple(w.shape)}"
        )
    if platform != "cpu" and x.shape[1] % 8:
        return f"the GPU add_rms_norm needs cols a multiple of 8, got {x.shape[1]}"
    return None


def add_rms_norm(x, d, w, *, eps: float):
    """``s = x + d`` and ``RMSNorm(s) * w`` in one kernel launch, as the model computes them
    (``jaxattn.models.llama.rms_norm``: the sum rounded to x's dtype, the mean of its squares
    and the scaling in float32, the normalised row rounded to x's dtype, then the weight's
    product): ``(s, normed)``, each ``[rows, cols]`` in x's dtype. ``d`` may be float32
    ``[splits, rows, cols]``: a projection's split-K partial sums, which the kernel sums in
    float32 and rounds to x's dtype before the add (no reduction between the GEMM and it).
    The mean and the reciprocal square root may differ from XLA's in their last float32
    bits, so a 16-bit result may be one step off XLA's. Raises ``NotImplementedError`` for what
    :func:`add_rms_norm_unsupported` refuses."""
    platform = _ensure_registered()
    why = add_rms_norm_unsupported(x, d, w, platform)
    if why is not None:
        raise NotImplementedError(why)
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    call = jax.ffi.ffi_call("jaxattn_add_rms_norm", (out, out), vmap_method="sequential")
    return call(x, d, w, eps=np.float32(eps))


# --- skinny matmul: the projections of a decode step at small batch ---------------------------

# The GPU kernel (ffi/include/jaxattn/linear.cuh): up to this many rows of x, n a multiple of
# 8, 16-bit operands; a block takes 256 columns and at most 1024 rows of w.
LINEAR_MAX_ROWS = 8
# Rows the engine's decode_linear="native" sends to the kernel. On an H200 (1B preset, device
# time of a decode step) it beat XLA's one-row path (1.390 against 1.611 ms) but not XLA at two
# rows (1.507 against 1.079), which is why decode_linear="auto" pads one row to two instead;
# at 8 rows its FMAs, 64 per 16-byte load, bind it.
LINEAR_DECODE_ROWS = 2
_LINEAR_TILE_COLS = 256
_LINEAR_MAX_ROWS_PER_SPLIT = 1024
_LINEAR_STEP = 32  # rows a block's threads load in one step


def _linear_blocks_per_sm(m: int) -> int:
    """The kernel's resident blocks an SM (linear.cuh: linear_blocks_per_sm)."""
    return 4 if m == 1 else 3 if m == 2 else 2


# Operand dtypes of the GPU kernel (the CPU handler takes float32 too).
LINEAR_GPU_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def linear_unsupported(x, w, platform: str | None = None) -> str | None:
    """Why :func:`linear` cannot take ``x [m, k] @ w [k, n]`` here, or None. ``platform``:
    the native platform (default: the current one)."""
    if platform is None:
        platform = _platform()
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        return f"linear takes x [m, k] and w [k, n], got {x.shape} and {w.shape}"
    dt = np.dtype(x.dtype)
    if np.dtype(w.dtype) != dt or dt not in _DTYPES:
        return f"linear takes x and w in one float32/bfloat16/float16 dtype, got {dt}, {w.dtype}"
    if platform != "cpu":
        if dt not in LINEAR_GPU_DTYPES:
            return f"the GPU linear kernel takes bfloat16 or float16, got {dt}"
        if x.shape[0] > LINEAR_MAX_ROWS:
            return f"the GPU linear kernel takes up to {LINEAR_MAX_ROWS} rows, got {x.shape[0]}"
        if w.shape[1] % 8:
            return f"the GPU linear kernel needs n a multiple of 8, got {w.shape[1]}"
    return None


def linear_rows_per_split(k: int, n: int, sms: int, m: int = 1) -> int:
    """Rows of w per block of the GPU kernel for ``m`` rows of x (0: one block per column
    tile takes all k): enough splits that the column tiles times the splits fill the
    resident blocks of one wave, in steps of the block's 32-row load, at most 1024 rows (its
    shared memory)."""
    tiles = -(-n // _LINEAR_TILE_COLS)
    splits = max(1, (_linear_blocks_per_sm(m) * sms) // tiles)
    rows = -(-k // splits)
    rows = min(_LINEAR_MAX_ROWS_PER_SPLIT, -(-rows // _LINEAR_STEP) * _LINEAR_STEP)
    return 0 if rows >= k else rows


def linear(x, w, *, out_dtype=None):
    """``x [m, k] @ w [k, n]`` with float32 sums, in ``out_dtype`` (x's dtype, or float32).

    The GPU kernel reads w once at the memory's speed for the few rows of a decode step
    (:data:`LINEAR_MAX_ROWS`); the CPU handler is a plain loop. Raises
    ``NotImplementedError`` for what :func:`linear_unsupported` refuses."""
    platform = _ensure_registered()
    reason = linear_unsupported(x, w, platform)
    if reason is not None:
        raise NotImplementedError(reason)
    out_dtype = np.dtype(x.dtype if out_dtype is None else out_dtype)
    if out_dtype not in (np.dtype(x.dtype), np.dtype(jnp.float32)):
        raise ValueError(f"out_dtype must be x's dtype or float32, got {out_dtype}")
    m, k = x.shape
    n = w.shape[1]
    if m == 0 or n == 0 or k == 0:
        return jnp.zeros((m, n), out_dtype)
    rows = 0
    if platform != "cpu":
        _, sms = decode_occupancy(platform, jnp.bfloat16, 128, 4)
        rows = linear_rows_per_split(k, n, sms, m)
    splits = -(-k // rows) if rows else 1
    ws = splits * m * n + -(-n // _LINEAR_TILE_COLS) if splits > 1 else 1
    call = jax.ffi.ffi_call(
        "jaxattn_linear",
        (jax.ShapeDtypeStruct((m, n), out_dtype), jax.ShapeDtypeStruct((ws,), jnp.float32)),
        vmap_method="sequential",
    )
    out, _ = call(x, w, rows_per_split=np.int32(rows))
    return out


# --- cascade decode ---------------------------------------------------------------------------

# GPU cascade kernels serve GQA groups up to this (the own level keeps a group's heads as the
# n = 8 side of its tensor-core products, the SIMT kernel 8 rows a block).
_CASCADE_MAX_GROUP = 8


@functools.cache
def cascade_tile(platform: str, dtype, head_dim: int, group: int) -> tuple[int, int, int]:
    """(query rows of a prefix tile, resident blocks per multiprocessor, multiprocessors) of
    the cascade kernel the GPU launcher picks for this dtype, head_dim and group, on the
    current device (asked of the library, like :func:`decode_occupancy`)."""
    lib = _lib_handles[platform]
    rows, blocks, sms = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
    err = lib.jaxattn_cascade_tile(
        ctypes.c_int(_DTYPE_IDS[np.dtype(dtype)]),
        ctypes.c_int(head_dim),
        ctypes.c_int(group),
        ctypes.byref(rows),
        ctypes.byref(blocks),
        ctypes.byref(sms),
    )
    if err != 0 or min(rows.value, blocks.value, sms.value) <= 0:
        raise RuntimeError(
            f"the native library could not describe its cascade kernel (dtype "
            f"{np.dtype(dtype)}, head_dim {head_dim}, group {group}): error {err}"
        )
    return rows.value, blocks.value, sms.value


@dataclasses.dataclass(frozen=True)
class CascadeConfig:
    """Native cascade decode. ``prefix_blocks``: the prefix blocks the device's split aims
    at (:func:`jaxattn.backend.cascade_grid`); ``partition_size``: own tokens per split-KV
    partition, 0 for one pass. None: the rule's choice for the call's shapes."""

    prefix_blocks: int | None = None
    partition_size: int | None = None

    def __post_init__(self):
        for name, least in (("prefix_blocks", 1), ("partition_size", 0)):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int or None, got {v!r}")
            if v < least:
                raise ValueError(f"{name} must be >= {least}, got {v}")


def _cascade_plan(
    platform, q, geom, prefix_tables, block_tables, config=None
) -> tuple[CascadeConfig, CascadeGrid]:
    """The configuration with every field set (given fields kept, the others from the shared
    rules: :func:`jaxattn.backend.split_kv_partition` for the own level,
    :func:`jaxattn.backend.cascade_grid` for the prefix level, with the kernel's tile and
    occupancy asked of the library), and the prefix grid it implies. The CPU handler runs
    one pass over each level."""
    config = config or CascadeConfig()
    batch = q.shape[0]
    group = q.shape[1] // geom.num_kv_heads
    own_capacity = block_tables.shape[1] * geom.page_size
    if platform == "cpu":
        rows, blocks_per_sm, sms = 1, 1, 1
        ps = config.partition_size or 0
    else:
        rows, blocks_per_sm, sms = cascade_tile(platform, q.dtype, geom.head_dim, group)
        ps = config.partition_size
        if ps is None:
            ps = choose_partition_size(
                None,
                platform=platform,
                batch=batch,
                num_kv_heads=geom.num_kv_heads,
                group=group,
                capacity=own_capacity,
                occupancy=(blocks_per_sm, sms),
            )
    own_parts = max(1, math.ceil(own_capacity / ps)) if ps else 1
    grid = cascade_grid(
        batch=batch,
        num_prefixes=prefix_tables.shape[0],
        per_tile=max(1, rows // group),
        num_kv_heads=geom.num_kv_heads,
        prefix_capacity=prefix_tables.shape[1] * geom.page_size,
        own_blocks=batch * geom.num_kv_heads * own_parts,
        slots=blocks_per_sm * sms,
        target=config.prefix_blocks,
    )
    return CascadeConfig(grid.target, ps), grid


def cascade_attention(
    q,
    k_cache,
    v_cache,
    prefix_tables,
    prefix_lens,
    prefix_of,
    block_tables,
    seq_lens,
    *,
    scale,
    layout,
    soft_cap=None,
    k_scale=None,
    v_scale=None,
    config: CascadeConfig | None = None,
):
    """Cascade decode (arguments validated by ``ops``, zero-size inputs answered there):
    q [B, Hq, D] -> [B, Hq, D] in q's dtype. One kernel computes the prefix tiles and the own
    partitions into a workspace of partial states, a second merges them. k_scale, v_scale:
    float32 [Hkv] (or None) of a scaled cache: k_scale joins both levels' logit factor,
    v_scale the merged output. The CPU handler also reads an FP8 cache; the GPU kernels read
    16-bit or float32 caches only."""
    platform = _ensure_registered()
    geom = _require(platform, q, k_cache, v_cache, layout, ring=True)
    cfg, grid = _cascade_plan(platform, q, geom, prefix_tables, block_tables, config)
    batch, num_q_heads, head_dim = q.shape
    own_capacity = block_tables.shape[1] * geom.page_size
    ps = cfg.partition_size
    own_parts = max(1, math.ceil(own_capacity / ps)) if ps else 1
    # Partial states of every (request, head, part), then the split the kernel chose.
    ws = batch * num_q_heads * (own_parts + grid.max_splits) * (head_dim + 2) + 1
    call = jax.ffi.ffi_call(
        "jaxattn_cascade_attention",
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((ws,), jnp.float32)),
        vmap_method="sequential",
    )
    out, _ = call(
        q,
        k_cache,
        v_cache,
        prefix_tables,
        prefix_lens,
        prefix_of,
        block_tables,
        seq_lens,
        _scale_operand(k_scale),
        _scale_operand(v_scale),
        **_attrs(scale, soft_cap),
        layout=np.int32(_layout_id(layout)),
        prefix_target=np.int32(grid.target),
        prefix_splits=np.int32(grid.max_splits),
        partition_size=np.int32(ps),
    )
    return out


# --- the backend contract (jaxattn.backend) ---------------------------------------------------


class _Native(KernelImplementation):
    backend = "native"
    ring = False  # the op runs the GPU decode rings (their row bound applies)

    def available(self, platform):
        try:
            _ensure_registered()
        except NotImplementedError as e:
            return str(e)
        return None

    def supports(self, a):
        if a.layout.name not in (*_LAYOUT_IDS, L.POOL):
            return f"native kernels read layouts {tuple(_LAYOUT_IDS)}, not layout={a.layout.name!r}"
        return _cache_unsupported(
            _platform(), a.kernel_q, a.k_cache, a.v_cache, a.geometry, self.ring
        )


class _PagedAttention(_Native):
    config_cls = DecodeConfig
    ring = True

    def heuristic_config(self, a):
        platform = _ensure_registered()
        return DecodeConfig(
            _heuristic_partition(
                platform, a.q, a.geometry, a.block_tables.shape[1], a.k_cache.dtype
            ),
            copies=_decode_copies(),
        )

    function = staticmethod(paged_attention)


class _Prefill(_Native):
    config_cls = PrefillConfig

    def heuristic_config(self, a):
        return _prefill_config(None)


class _PrefixPrefill(_Prefill):
    function = staticmethod(prefix_prefill)


class _ExtendAttention(_Prefill):
    function = staticmethod(extend_attention)


class _CascadeAttention(_Native):
    config_cls = CascadeConfig
    ring = True

    def supports(self, a):
        reason = super().supports(a)
        if reason is None and _platform() != "cpu" and a.fp8_cache:
            # Per-head scales on a 16-bit / float32 cache are served exactly (folded into
            # the logit factor and the merged output); FP8 elements would need widening in
            # every ring the cascade kernels share with the 16-bit decode loop.
            reason = (
                f"native GPU cascade decode reads 16-bit or float32 K/V (tensor-core "
                f"fragments, the SIMT kernel's vectors), not a {a.kv_dtype} cache"
            )
        if reason is None and _platform() != "cpu" and a.group > _CASCADE_MAX_GROUP:
            reason = (
                f"native GPU cascade decode serves up to {_CASCADE_MAX_GROUP} query heads per "
                f"KV head, got {a.group}"
            )
        return reason

    def heuristic_config(self, a):
        platform = _ensure_registered()
        return _cascade_plan(platform, a.q, a.geometry, a.prefix_tables, a.block_tables)[0]

    function = staticmethod(cascade_attention)


class _WriteKV(_Native):
    def supports(self, a):
        return write_unsupported(a, _platform())

    def run(self, a, config):
        return write_kv(
            a.k_cache,
            a.v_cache,
            a.k,
            a.v,
            a.slots,
            layout=a.layout.name,
            k_scale=a.k_scale,
            v_scale=a.v_scale,
        )


class _RopeWriteKV(_Native):
    def supports(self, a):
        return rope_write_unsupported(a, _platform())

    def run(self, a, config):
        return rope_write_kv(
            a.qkv,
            a.cos,
            a.sin,
            a.k_cache,
            a.v_cache,
            a.slots,
            layout=a.layout.name,
            k_scale=a.k_scale,
            v_scale=a.v_scale,
            dtype=a.in_dtype,
        )


IMPLEMENTATIONS = {
    "write_kv": _WriteKV(),
    "rope_write_kv": _RopeWriteKV(),
    "paged_attention": _PagedAttention(),
    "prefix_prefill": _PrefixPrefill(),
    "extend_attention": _ExtendAttention(),
    "cascade_attention": _CascadeAttention(),
}
