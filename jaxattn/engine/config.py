"""The engine's settings as three frozen records (vLLM's ``CacheConfig`` / ``SchedulerConfig``
model), and the keyword arguments of earlier releases mapped onto them.

* :class:`CacheConfig` - the KV pool and the prefix cache: what memory holds;
* :class:`SchedulerConfig` - admission, chunking, and how many decode steps a dispatch
  runs and whether the host plans ahead: what runs when;
* :class:`ExecutionConfig` - how the model runs: attention backends, shape buckets, the
  device mesh.

Every field is checked when the record is built, so a wrong value is a ``ValueError``
naming the field before any pool or program exists.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Sequence as SequenceABC
from typing import Any

import numpy as np

from jaxattn.cascade_cost import CascadeCostModel

__all__ = [
    "KV_DTYPES",
    "Buckets",
    "CacheConfig",
    "ExecutionConfig",
    "SchedulerConfig",
    "bucket",
    "kv_cache_dtype",
    "split_engine_kwargs",
]

_LAYOUTS = ("bshd", "bhsd", "vllm")
# CacheConfig.kv_dtype: the names of the FP8 pool formats and the numpy dtype of each.
KV_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_CASCADE = ("auto", "on", "off")
_DECODE_LINEAR = ("auto", "native", "hybrid", "xla")
# ExecutionConfig.kv_write: "auto" or a backend of jaxattn.write_kv.
KV_WRITE_CHOICES = ("auto", "native", "reference")
PALLAS_DECODE_LOWERINGS = ("triton", "mosaic_gpu")


def _int(owner: str, name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def fp8_format(value, argument: str, *, none_ok: bool = False) -> str | None:
    """The :data:`KV_DTYPES` name of an FP8 pool format given by name or as a dtype (None
    stays None where ``none_ok``: the model's dtype); anything else is a ValueError naming
    ``argument``."""
    if value is None and none_ok:
        return None
    if isinstance(value, str) and value in KV_DTYPES:
        return value
    try:
        dt = np.dtype(value) if value is not None else None
    except TypeError:
        dt = None
    for name, numpy_name in KV_DTYPES.items():
        if dt is not None and dt.name == numpy_name:
            return name
    names = " or ".join(map(repr, KV_DTYPES))
    if none_ok:
        names = "None (the model's dtype), " + names
    raise ValueError(
        f"{argument} must be {names} (or the dtypes {' / '.join(KV_DTYPES.values())}), "
        f"got {value!r}"
    )


def _kv_dtype_name(value) -> str | None:
    """The :data:`KV_DTYPES` name of a ``CacheConfig.kv_dtype`` value (None: the model's)."""
    return fp8_format(value, "CacheConfig.kv_dtype", none_ok=True)


def kv_cache_dtype(kv_dtype: str | None, model_dtype) -> np.dtype:
    """The dtype of the pool's arrays: ``model_dtype`` for ``kv_dtype=None``, else the FP8
    format named (a :data:`KV_DTYPES` key)."""
    if kv_dtype is None:
        return np.dtype(model_dtype)
    return np.dtype(KV_DTYPES[_kv_dtype_name(kv_dtype)])


def check_kv_scales(value):
    """``CacheConfig.kv_scales`` as a pair of nested tuples of floats (hashable, compared by
    value), after checking that both are finite, positive, 2-D and of one shape."""
    if value is None:
        return None
    name = "CacheConfig.kv_scales"
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise ValueError(
            f"{name} must be None or a pair (k_scales, v_scales) of float32 "
            f"[num_layers, num_kv_heads], got {type(value).__name__}"
        )
    out = []
    for what, x in zip(("k_scales", "v_scales"), value, strict=True):
        try:
            a = np.asarray(x)
        except Exception as e:  # noqa: BLE001 - anything not an array is the same mistake
            raise ValueError(f"{name}: {what} is not an array ({e})") from None
        if a.dtype == np.bool_ or not (
            np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)
        ):
            raise ValueError(f"{name}: {what} must be real numbers, got dtype {a.dtype}")
        if a.ndim != 2 or 0 in a.shape:
            raise ValueError(
                f"{name}: {what} must be float32 [num_layers, num_kv_heads], got shape {a.shape}"
            )
        a = a.astype(np.float32)
        if not np.all(np.isfinite(a)) or np.any(a <= 0):
            raise ValueError(f"{name}: {what} must be finite and positive, got {a.tolist()}")
        out.append(tuple(tuple(float(e) for e in row) for row in a))
    if np.shape(out[0]) != np.shape(out[1]):
        raise ValueError(
            f"{name}: k_scales and v_scales must have one shape, got {np.shape(out[0])} and "
            f"{np.shape(out[1])}"
        )
    return tuple(out)


def token_ids(where: str, prompt, vocab_size: int) -> list[int]:
    """``prompt`` (a sequence of token ids, or a 1-D numpy array) as a list of ints, after
    checking that it is not empty and that every id lies in ``[0, vocab_size)``; each error
    names ``where`` (e.g. ``"prompts[3]"``)."""
    bad = f"{where} must hold token ids in [0, {vocab_size}), got {{}}"
    if isinstance(prompt, np.ndarray):
        if prompt.ndim == 1 and prompt.size and prompt.dtype.kind in "iu":
            # An integer vector: its range checked in numpy (a prompt is thousands of ids).
            if prompt.min() < 0 or prompt.max() >= vocab_size:
                raise ValueError(bad.format(prompt[:16].tolist()))
            return prompt.tolist()
        prompt = prompt.tolist()
    if not isinstance(prompt, SequenceABC) or isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where} must be a non-empty list of token ids")
    if set(map(type, prompt)) <= {int}:
        # Plain Python ints (no bool, whose type is its own): the range by min and max.
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(bad.format(list(prompt)[:16]))
        return list(prompt)
    ok = all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t < vocab_size
        for t in prompt
    )
    if not ok:
        raise ValueError(bad.format(list(prompt)[:16]))
    return [int(t) for t in prompt]


def padded_batches(sequences, rows: int, length: int, *, empty_length: int):
    """Token lists in batches of ``rows``, each padded to ``length``: yields ``(group,
    tokens i32[rows, length], lengths i32[rows])``, rows past the group of length
    ``empty_length`` (what the dense passes take for padding rows)."""
    for start in range(0, len(sequences), rows):
        group = sequences[start : start + rows]
        tokens = np.zeros((rows, length), np.int32)
        lengths = np.full(rows, empty_length, np.int32)
        for j, seq in enumerate(group):
            tokens[j, : len(seq)] = seq
            lengths[j] = len(seq)
        yield group, tokens, lengths


def bucket(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor)."""
    n = max(int(n), int(floor), 1)
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Floors of the power-of-two shape buckets. Higher floors mean fewer programs to
    compile, at the cost of padding work in small steps."""

    tokens: int = 16  # new tokens in an extend step
    kv: int = 64  # prefix + new tokens over all requests of an extend step
    extend_batch: int = 2  # requests (or sample rows) of an extend step
    decode_batch: int = 4  # decode rows of a decode step
    pages: int = 4  # block-table width (pages per sequence)
    copies: int = 8  # copy-on-write page copies
    updates: int = 8  # decode rows (re)initialised, and table entries sent, in one step
    # Table entries that ride with a step's extend or decode program (at least two a decode
    # row); a step that sends more (many long prompts admitted at once) dispatches them
    # alone first. 2048 covers eight full tables of 256 pages: a turn of a chat workload.
    folded_cells: int = 2048

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _int("Buckets", f.name, getattr(self, f.name), 1))


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool and the radix prefix cache.

    num_pages: pages per layer; the pool takes ``num_pages * page_size *
      model.kv_bytes_per_token(kv dtype)`` bytes. The count is explicit, so an FP8 pool of
      the same ``num_pages`` takes half the bytes of a 16-bit one (a quarter of float32);
      to fill the same bytes, give twice (four times) the pages.
    page_size: tokens per page (the block size of the block tables and of the cache).
    layout: the pool layout, ``"bshd"``, ``"bhsd"`` or ``"vllm"``.
    radix_cache: share KV across requests through the radix prefix cache (False: every
      request computes its whole prompt and frees its pages at the end).
    kv_dtype: the pool's dtype: None (the model's), ``"fp8_e4m3"`` or ``"fp8_e5m2"`` (also
      given as the dtypes ``float8_e4m3fn`` / ``float8_e5m2``; stored as the name). An FP8
      pool stores ``x / scale`` per layer and KV head with saturation and the attention
      ops read ``float32(element) * scale`` (:mod:`jaxattn.quant`).
    kv_scales: None (1.0 everywhere) or ``(k_scales, v_scales)``, float32 ``[num_layers,
      num_kv_heads]`` each, finite and positive, e.g. from
      :func:`jaxattn.engine.calibrate_kv_scales`. Stored as nested tuples of floats (so the
      record stays hashable); the engine checks the shape against the model.
    """

    num_pages: int
    page_size: int = 16
    layout: str = "bshd"
    radix_cache: bool = True
    kv_dtype: str | None = None
    kv_scales: tuple | None = None

    def __post_init__(self):
        object.__setattr__(self, "num_pages", _int("CacheConfig", "num_pages", self.num_pages, 1))
        object.__setattr__(self, "page_size", _int("CacheConfig", "page_size", self.page_size, 1))
        if self.layout not in _LAYOUTS:
            raise ValueError(f"CacheConfig.layout must be one of {_LAYOUTS}, got {self.layout!r}")
        object.__setattr__(self, "radix_cache", bool(self.radix_cache))
        object.__setattr__(self, "kv_dtype", _kv_dtype_name(self.kv_dtype))
        object.__setattr__(self, "kv_scales", check_kv_scales(self.kv_scales))


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """What runs in each step.

    max_batch_tokens: tokens computed per step (decode tokens + extend chunks); longer
      prompts are prefilled in chunks over several steps.
    max_running: sequences running at once (also the device's decode rows).
    policy: admission order, ``"lpm"`` (longest cached prefix first, then arrival) or
      ``"fcfs"``.
    new_token_ratio: admission keeps ``ratio * (tokens still to generate)`` worth of pages
      free for every running sequence, so that admissions do not immediately force
      preemptions (0: admit while the prompt fits).
    dedup_tokens: a waiting request that shares at least this many uncached tokens with a
      prompt being prefilled in the step waits one step and then hits the cache instead of
      computing them again (None: ``max(page_size, 32)``; 0: off).
    cache_on_plan: a prompt's whole pages enter the prefix cache when their prefill is
      planned (the dispatch that writes them runs before any that reads them, and within a
      dispatch every chunk writes before any attends), so requests admitted in the same
      step or the next share them; False: when the step's results are read, a step later
      with ``overlap``.
    decode_steps: decode steps one dispatch runs on the device (sampling and stop checks
      included) when no request needs the host in between: no prompt to prefill and no
      request waiting for a free row. The dispatch stops at the first length limit, so a
      finishing request hands its row over without delay; a stop token ends only its own
      row. 1: one step per dispatch.
    overlap: plan and dispatch step t+1 while the device runs step t, and read step t's
      tokens only then (SGLang's overlap scheduler). Finished requests are reported one
      :meth:`~jaxattn.engine.Engine.step` later; the tokens are the same.
    """

    max_batch_tokens: int = 512
    max_running: int = 64
    policy: str = "lpm"
    new_token_ratio: float = 0.3
    dedup_tokens: int | None = None
    cache_on_plan: bool = True
    decode_steps: int = 8
    overlap: bool = True

    def __post_init__(self):
        name = "SchedulerConfig"
        for f in ("max_batch_tokens", "max_running", "decode_steps"):
            object.__setattr__(self, f, _int(name, f, getattr(self, f), 1))
        if self.policy not in ("lpm", "fcfs"):
            raise ValueError(f"{name}.policy must be 'lpm' or 'fcfs', got {self.policy!r}")
        ratio = self.new_token_ratio
        if not isinstance(ratio, numbers.Real) or not 0.0 <= ratio <= 1.0:
            raise ValueError(f"{name}.new_token_ratio must be in [0, 1], got {ratio!r}")
        object.__setattr__(self, "new_token_ratio", float(ratio))
        if self.dedup_tokens is not None:
            object.__setattr__(
                self, "dedup_tokens", _int(name, "dedup_tokens", self.dedup_tokens, 0)
            )
        object.__setattr__(self, "overlap", bool(self.overlap))
        object.__setattr__(self, "cache_on_plan", bool(self.cache_on_plan))


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    """How the model runs.

    extend_attention: ``"extend"`` (SGLang token-pool form, bshd only) or
      ``"prefix_prefill"`` (paged form); None picks ``"extend"`` for bshd.
    implementation: attention backend (None: the fastest that serves the platform).
    partition_size: split-KV partition size for decode (None: the backend's choice).
    buckets: shape bucket floors (:class:`Buckets`).
    mesh: serve tensor-parallel over this 1-D mesh (:func:`jaxattn.sharding.make_mesh`):
      heads, MLP and the pool's KV heads split over its devices, while pages, block tables
      and the radix cache stay global, so scheduling and outputs are those of one device.
      None: one device.
    device_paging: grow the decode rows' block tables on the device: the decode program
      runs :meth:`~jaxattn.paging.PageTable.append_slots_batch` (copy-on-write included)
      on a :class:`~jaxattn.paging.PageTable` that lives there, while the host applies the
      same ops to its :class:`~jaxattn.paging.BlockManager`; the two agree op for op, so
      nothing is sent as long as only decode steps change the pages, and the whole table
      is sent when anything else did (an admission, a finish, an eviction). False: the
      host sends the table entries that changed.
    unroll_layers: run the layers as straight-line code over per-layer weights (the GPU's
      fast form: no weight slice copied per layer, at a compile time that grows with the
      depth) or as one ``lax.scan`` over stacked weights (one compiled layer body). None:
      unrolled on GPUs, a scan on the CPU.
    cascade: cascade decode (:func:`jaxattn.cascade_attention`) for decode rows that
      share a cached prefix (the same leading pages, from the radix cache or a fork):
      ``"auto"`` runs it when :func:`jaxattn.cascade_cost.cascade_pays_off` predicts a
      gain for the dispatch, ``"on"`` whenever two rows share a prefix, ``"off"`` never.
      Outputs are the same either way, up to floating-point rounding.
    cascade_min_tokens: the shortest shared prefix (in tokens; whole pages of it count)
      that forms a cascade level. The default, 128, follows a measurement on an H100
      (``bench_cascade.py --fit``, ``benchmarks/RESULTS.md`` round 65): at 64-token prefixes
      cascade decode was slower than paged decode in every shape timed, and with 64
      requests on a prefix it was faster from 128-256 tokens (8 requests: from 512).
    cascade_model: the cost model ``"auto"`` decides with: a
      :class:`~jaxattn.cascade_cost.CascadeCostModel`, its fields as a dict, or the JSON
      ``benchmarks/bench_cascade.py --fit --json FILE`` writes (a path or its text), whose
      constants were measured on the GPU that serves. None: the model's defaults.
    decode_linear: the decode step's projections (QKV, output, MLP, LM head): ``"auto"``
      XLA's dot, with a one-row step padded to two rows on GPUs (XLA lowers one row to a
      GEMV at about half the read ceiling: the 1B decode step took 1.611 ms of device time
      at one row, 1.079 at two, on an H200); ``"xla"`` XLA's dot as it is; ``"native"``
      :func:`jaxattn.native.linear` at 1-2 rows (:data:`jaxattn.native.LINEAR_DECODE_ROWS`),
      XLA's dot above (one device, 16-bit weights on a GPU; an error elsewhere);
      ``"hybrid"`` the native kernel for weights up to ``llama.HYBRID_NATIVE_MAX_BYTES`` (QKV,
      output) and the padded XLA dot for the rest (the same requirements as ``"native"``;
      slower than ``"auto"`` in the 1B step on an H200: 1.090 against 1.053 ms of device time
      at one row, 1.121 against 0.996 at two). Only decode rows are concerned: the default buckets
      run at least 4 (``Buckets.decode_batch``).
    decode_graph: compile the multistep decode program with its ``lax.while_loop`` as an
      XLA command buffer (CUDA graph conditional nodes: the kinds in
      ``runner.DECODE_GRAPH_COMMANDS``). Without it XLA's GPU runtime reads the loop's
      predicate on the host every iteration, so the dispatch returns only when the loop
      ends and the host cannot plan the next step meanwhile. On an H200 it took the 1B
      decode step's wall time from 1.241 to 0.990 ms at batch 1 and from 1.854 to 1.463
      at 64 (``bench_step.py``). None (the default): on with CUDA GPUs, off elsewhere
      (the CPU has no command buffers; ROCm's are not measured).
    kv_write: who stores each step's new K/V in the pool (:func:`jaxattn.write_kv`'s
      backend): ``"auto"`` the fastest that serves it (on one GPU the native kernel, one
      launch a layer for K and V: the 1B decode step at batch 1 took 0.929-0.935 ms against
      0.951-0.954 with XLA's scatters on an H200, the same at 64; XLA's scatters on the CPU
      and under tensor parallelism, where the kernel is not measured), ``"native"`` or
      ``"reference"`` (XLA's scatters, one a cache and layer). The same bits either way.
    fused_rope: rotate each layer's new q and k and store its K/V in one pass
      (:func:`jaxattn.rope_write_kv` with the ``kv_write`` backend) instead of the rotation in
      XLA (three small fusions a layer on a GPU) followed by the write. None (the default):
      on where the write is the native kernel on one device; True: on (under a mesh too,
      each device its heads); False: off. The same values either way, up to the rounding of the
      rotation's products.
    fused_norm: each residual add and the RMSNorm after it in one native kernel
      (:func:`jaxattn.native.add_rms_norm`) instead of XLA's fusions. Off unless True (one
      device, straight-line layers, the native library; its CPU handler on the CPU): on an
      H200 the 1B decode step took 0.964 / 1.490 ms of device time with it at batch 1 / 64
      against 0.947 / 1.474 without (``bench_step.py --fused-norm``). The same values up to
      the last float32 bits of the norm's mean.
    split_k: the decode step's projections that feed a native kernel (QKV into
      ``fused_rope``'s, output and down into ``fused_norm``'s) split along their contraction
      by the model, their float32 partial sums handed to that kernel, which sums them as it
      loads them (``jaxattn.models.llama.split_k_count``): no XLA kernel between the GEMM and
      the native one (the 1B step compiles to 9 kernels a layer instead of 11). None / False
      (the default): off, XLA splits the GEMMs as it chooses and reduces the partials itself;
      True: the split XLA chooses for each projection (``llama.xla_split_k``; on the CPU,
      where XLA does not split, nothing changes); an int n: up to n splits. Needs one device
      and ``fused_rope`` or ``fused_norm``; not yet timed on a GPU.
    pallas_decode_lowering: the lowering of the Pallas decode kernel in every decode step
      when ``implementation`` resolves to ``"pallas"``: ``"triton"`` (the engine's 1b
      workload ran 9383 generated tok/s with it against 8804 with the Mosaic GPU kernel on
      an H200, where the op alone measured the Mosaic kernel slower at head_dim 64 too) or
      ``"mosaic_gpu"`` (:mod:`jaxattn.pallas.decode_mgpu`, sm_90; interpreted on the CPU),
      whatever a step's batch. None (the default): ``"triton"`` where this JAX has that
      lowering, else ``"mosaic_gpu"`` (:func:`jaxattn.pallas._triton.missing`).
    """

    extend_attention: str | None = None
    implementation: str | None = None
    partition_size: int | None = None
    buckets: Buckets = dataclasses.field(default_factory=Buckets)
    mesh: Any = None
    device_paging: bool = False
    unroll_layers: bool | None = None
    cascade: str = "auto"
    cascade_min_tokens: int = 128
    cascade_model: Any = None
    decode_linear: str = "auto"
    decode_graph: bool | None = None
    kv_write: str = "auto"
    fused_rope: bool | None = None
    fused_norm: bool | None = None
    split_k: bool | int | None = None
    pallas_decode_lowering: str | None = None

    def __post_init__(self):
        if self.extend_attention not in (None, "extend", "prefix_prefill"):
            raise ValueError(
                "ExecutionConfig.extend_attention must be None, 'extend' or 'prefix_prefill', "
                f"got {self.extend_attention!r}"
            )
        if self.partition_size is not None:
            object.__setattr__(
                self,
                "partition_size",
                _int("ExecutionConfig", "partition_size", self.partition_size, 1),
            )
        object.__setattr__(self, "device_paging", bool(self.device_paging))
        if self.decode_graph is not None:
            object.__setattr__(self, "decode_graph", bool(self.decode_graph))
        if self.unroll_layers is not None:
            object.__setattr__(self, "unroll_layers", bool(self.unroll_layers))
        for name in ("fused_rope", "fused_norm"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, bool(getattr(self, name)))
        if self.split_k is not None and not isinstance(self.split_k, bool):
            object.__setattr__(self, "split_k", _int("ExecutionConfig", "split_k", self.split_k, 1))
        if not isinstance(self.decode_linear, str) or self.decode_linear not in _DECODE_LINEAR:
            raise ValueError(
                f"ExecutionConfig.decode_linear must be one of {_DECODE_LINEAR}, "
                f"got {self.decode_linear!r}"
            )
        if not isinstance(self.kv_write, str) or self.kv_write not in KV_WRITE_CHOICES:
            raise ValueError(
                f"ExecutionConfig.kv_write must be one of {KV_WRITE_CHOICES}, got {self.kv_write!r}"
            )
        lowering = self.pallas_decode_lowering
        if lowering is not None and (
            not isinstance(lowering, str) or lowering not in PALLAS_DECODE_LOWERINGS
        ):
            raise ValueError(
                f"ExecutionConfig.pallas_decode_lowering must be None or one of "
                f"{PALLAS_DECODE_LOWERINGS}, got {lowering!r}"
            )
        if not isinstance(self.cascade, str) or self.cascade not in _CASCADE:
            raise ValueError(
                f"ExecutionConfig.cascade must be one of {_CASCADE}, got {self.cascade!r}"
            )
        object.__setattr__(
            self,
            "cascade_min_tokens",
            _int("ExecutionConfig", "cascade_min_tokens", self.cascade_min_tokens, 1),
        )
        object.__setattr__(self, "cascade_model", _cascade_model(self.cascade_model))
        if self.buckets is None:
            object.__setattr__(self, "buckets", Buckets())
        elif not isinstance(self.buckets, Buckets):
            raise ValueError(f"ExecutionConfig.buckets must be a Buckets, got {self.buckets!r}")


def _cascade_model(value):
    """ExecutionConfig.cascade_model as a CascadeCostModel (None: the defaults)."""
    if value is None:
        return CascadeCostModel()
    if isinstance(value, CascadeCostModel):
        return value
    if not isinstance(value, (dict, str, os.PathLike)):
        raise ValueError(
            "ExecutionConfig.cascade_model must be None, a CascadeCostModel, a dict of its "
            f"fields or the path or text of bench_cascade.py --fit's JSON, got {value!r}"
        )
    try:
        return CascadeCostModel.from_json(value)
    except (OSError, TypeError, ValueError) as e:
        raise ValueError(f"ExecutionConfig.cascade_model: {e}") from None


_FIELDS = {
    "cache": (CacheConfig, {f.name for f in dataclasses.fields(CacheConfig)}),
    "scheduler": (SchedulerConfig, {f.name for f in dataclasses.fields(SchedulerConfig)}),
    "execution": (ExecutionConfig, {f.name for f in dataclasses.fields(ExecutionConfig)}),
}


def split_engine_kwargs(
    cache: CacheConfig | None,
    scheduler: SchedulerConfig | None,
    execution: ExecutionConfig | None,
    kwargs: dict,
) -> tuple[CacheConfig, SchedulerConfig, ExecutionConfig]:
    """The three records from explicit ones plus flat keywords (``num_pages=``,
    ``max_batch_tokens=``, ``mesh=`` ...), the form of earlier releases. A keyword that
    belongs to a record also passed explicitly is an error, as is an unknown keyword."""
    given = {"cache": cache, "scheduler": scheduler, "execution": execution}
    flat: dict[str, dict] = {k: {} for k in given}
    for key, value in kwargs.items():
        owner = next((o for o, (_, names) in _FIELDS.items() if key in names), None)
        if owner is None:
            raise TypeError(f"Engine() got an unexpected keyword argument {key!r}")
        if given[owner] is not None:
            raise TypeError(f"pass {key}= inside {owner}= ({_FIELDS[owner][0].__name__}), not both")
        flat[owner][key] = value
    out = []
    for owner, (cls, _) in _FIELDS.items():
        record = given[owner]
        if record is None:
            if owner == "cache" and "num_pages" not in flat[owner]:
                raise TypeError("Engine() needs cache=CacheConfig(num_pages=...) or num_pages=")
            record = cls(**flat[owner])
        elif not isinstance(record, cls):
            raise TypeError(f"{owner} must be a {cls.__name__}, got {type(record).__name__}")
        out.append(record)
    return tuple(out)
