"""Public attention ops: validate the arguments, then run one backend.

Each op is an :class:`~jaxattn.backend.Op` object (:data:`PAGED_ATTENTION`,
:data:`EXTEND_ATTENTION`, :data:`PREFIX_PREFILL`, :data:`CASCADE_ATTENTION`) and a function of
the public signature that calls it. ``implementation=`` takes ``None``, a backend name
(``"reference"``, ``"pallas"``, ``"native"``) or a sequence of names tried in order;
``config=`` a backend's frozen configuration (e.g. :class:`jaxattn.pallas.ExtendConfig`),
which also selects that backend when ``implementation`` is None. A backend that cannot serve
the platform or the arguments is skipped with its reason; a single explicitly named backend
raises ``NotImplementedError`` instead (it is never silently replaced). ``None`` tries the
fast backends for the current platform and always ends with the reference, which serves
everything. See :mod:`jaxattn.backend` for the contract.

FP8 KV caches (:mod:`jaxattn.quant`): ``k_cache`` / ``v_cache`` may be ``float8_e4m3fn`` or
``float8_e5m2`` in every layout, with ``k_scale=`` / ``v_scale=`` (None, a scalar or f32
``[num_kv_heads]``; traced arrays under jit): a stored element means
``float32(element) * scale[kv_head]``. q stays float32 / bfloat16 / float16, except in the
prefill ops, which also take an FP8 q with ``q_scale=`` (a scalar; q's value is
``float32(q) * q_scale``) and then return ``out_dtype=`` (bfloat16 unless stated). The
kernel backends see such a q widened exactly to the output dtype (every FP8 value is
representable there) and ``q_scale`` folded into the per-head key scale, which joins the
logit scale in f32: :attr:`_Args.kernel_q` and :attr:`_Args.kernel_k_scale`.

All validation here looks only at static properties (ranks, shapes, dtypes, attribute
values), so it runs at trace time under ``jax.jit`` before any kernel is built. When
the index arrays are concrete (eager calls) their values are checked too. Under ``jax.jit``
index values follow the memory-safety contract (:mod:`jaxattn.reference.validity`): a
sequence with an out-of-range index gets NaN rows, never an out-of-bounds access;
:func:`checked` (or ``debug_checks=True`` inside ``checkify``) turns those into errors.
Inputs with a zero-size dimension (no sequences, no rows, an empty table or index list)
get the spec's result on every backend: there is nothing for a kernel to do.

The reference implementations of the ops live here as well: the spec functions of
:mod:`jaxattn.reference` behind the backend contract.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from . import layout as _layout
from . import quant as _quant
from . import reference as _reference
from .backend import BACKENDS, Implementation, Op, checked, default_implementations
from .cascade_cost import CascadeCostModel, cascade_pays_off
from .reference import validity as _validity

__all__ = [
    "BACKENDS",
    "CASCADE_ATTENTION",
    "EXTEND_ATTENTION",
    "PAGED_ATTENTION",
    "PREFIX_PREFILL",
    "ExtendArgs",
    "PagedArgs",
    "PrefillArgs",
    "CascadeArgs",
    "CascadeCostModel",
    "available_backends",
    "cascade_attention",
    "cascade_pays_off",
    "checked",
    "default_implementations",
    "extend_attention",
    "merge_states",
    "paged_attention",
    "prefix_prefill",
]

_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


# --- validation helpers --------------------------------------------------------------


def _shape_str(x) -> str:
    return f"shape {tuple(x.shape)} and dtype {np.dtype(x.dtype)}"


def _check_array(name, x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")


def _check_float(name, x):
    _check_array(name, x)
    if np.dtype(x.dtype) not in [np.dtype(d) for d in _FLOAT_DTYPES]:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {np.dtype(x.dtype)}")


def _check_int32(name, x, rank, expected: str):
    _check_array(name, x)
    if np.dtype(x.dtype) != np.int32:
        raise TypeError(f"{name} must be int32 {expected}, got {_shape_str(x)}")
    if x.ndim != rank:
        raise ValueError(f"{name} must be int32 {expected}, got {_shape_str(x)}")


def _check_rank(name, x, rank, expected: str):
    if x.ndim != rank:
        raise ValueError(f"{name} must be {expected}, got {_shape_str(x)}")


def _check_caches(q, k_cache, v_cache, lay, k_scale, v_scale):
    """The caches' dtypes and geometry in ``lay`` against q's heads, then the per-KV-head
    scales: ``(geometry, k_scale, v_scale)`` (each error names its argument)."""
    _check_kv_dtypes(k_cache, v_cache)
    geom = lay.geometry(k_cache, v_cache)
    _check_heads(q, geom.num_kv_heads, geom.head_dim)
    k_scale = _quant.check_scale("k_scale", k_scale, geom.num_kv_heads)
    v_scale = _quant.check_scale("v_scale", v_scale, geom.num_kv_heads)
    return geom, k_scale, v_scale


def _check_heads(q, num_kv_heads, head_dim, qname="q"):
    hq, d = q.shape[-2], q.shape[-1]
    if d != head_dim:
        raise ValueError(f"{qname} head dim {d} does not match the KV cache head dim {head_dim}")
    if num_kv_heads == 0 or hq % num_kv_heads:
        raise ValueError(
            f"the number of query heads ({hq}) must be a multiple of the number of KV heads "
            f"({num_kv_heads})"
        )


def _check_cache_dtype(name, x):
    _check_array(name, x)
    dt = np.dtype(x.dtype)
    if dt not in [np.dtype(d) for d in _FLOAT_DTYPES] and not _quant.is_fp8(dt):
        raise TypeError(
            f"{name} must be float32, bfloat16, float16, float8_e4m3fn or float8_e5m2, got {dt}"
        )


def _check_kv_dtypes(k_cache, v_cache):
    _check_cache_dtype("k_cache", k_cache)
    _check_cache_dtype("v_cache", v_cache)
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(
            f"k_cache and v_cache must share a dtype, got {np.dtype(k_cache.dtype)} and "
            f"{np.dtype(v_cache.dtype)}"
        )


def _check_prefill_q(q, q_scale, out_dtype):
    """q of a prefill op: a float q, or an FP8 q (the mixed mode) with an optional scalar
    q_scale. Returns (q_scale as f32 scalar or None, output dtype)."""
    _check_array("q", q)
    fp8 = _quant.is_fp8(q.dtype)
    if not fp8:
        _check_float("q", q)
    if out_dtype is not None:
        try:
            out = np.dtype(out_dtype)
        except TypeError as e:
            raise TypeError(f"out_dtype must be a dtype, got {out_dtype!r}") from e
        if out not in [np.dtype(d) for d in _FLOAT_DTYPES]:
            raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out}")
        if not fp8 and out != np.dtype(q.dtype):
            raise ValueError(
                f"out_dtype={out} differs from q's dtype {np.dtype(q.dtype)}: the output "
                "dtype is q's unless q is FP8"
            )
    if q_scale is not None:
        if not fp8:
            raise ValueError(
                f"q_scale applies to an FP8 q (float8_e4m3fn / float8_e5m2), but q is "
                f"{np.dtype(q.dtype)}: scale q before the call"
            )
        if hasattr(q_scale, "shape") and tuple(q_scale.shape) != ():
            raise ValueError(f"q_scale must be a scalar, got shape {tuple(q_scale.shape)}")
        q_scale = _quant.check_scale("q_scale", q_scale, 1, what="1")[0]
    return q_scale, np.dtype(_reference.output_dtype(q.dtype, out_dtype))


def _check_tables(b, block_tables, seq_lens):
    """block_tables int32 [b, max_pages] and seq_lens int32 [b]."""
    _check_int32("block_tables", block_tables, 2, f"[batch={b}, max_pages]")
    if block_tables.shape[0] != b:
        raise ValueError(
            f"block_tables must be int32 [batch={b}, max_pages], got {_shape_str(block_tables)}"
        )
    _check_int32("seq_lens", seq_lens, 1, f"[batch={b}]")
    if seq_lens.shape[0] != b:
        raise ValueError(f"seq_lens must be int32 [batch={b}], got {_shape_str(seq_lens)}")


def _resolve_scale(scale, head_dim) -> float:
    if scale is None:
        return _reference.default_scale(head_dim)
    if isinstance(scale, (jax.Array, np.ndarray)) and scale.ndim == 0:
        if isinstance(scale, jax.core.Tracer):
            raise TypeError("scale must be a Python float (a static value), got a traced array")
        scale = float(scale)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    scale = float(scale)
    if not np.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite positive float, got {scale}")
    return scale


def _check_soft_cap(soft_cap):
    if soft_cap is None:
        return None
    if not isinstance(soft_cap, (int, float)) or isinstance(soft_cap, bool):
        raise TypeError(f"soft_cap must be a float or None, got {type(soft_cap).__name__}")
    soft_cap = float(soft_cap)
    if not np.isfinite(soft_cap) or soft_cap <= 0:
        raise ValueError(f"soft_cap must be a finite positive float or None, got {soft_cap}")
    return soft_cap


def _check_partition_size(partition_size):
    if partition_size is None:
        return None
    if not isinstance(partition_size, (int, np.integer)) or isinstance(partition_size, bool):
        raise TypeError(f"partition_size must be an int or None, got {partition_size!r}")
    if partition_size <= 0:
        raise ValueError(f"partition_size must be positive, got {partition_size}")
    return int(partition_size)


def _concrete(x):
    """numpy value of x, or None when x is traced or abstract (values unknown)."""
    if isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)):
        return None
    try:
        return np.asarray(x)
    except Exception:  # noqa: BLE001 - anything non-materialisable is treated as traced
        return None


def _check_indptr_values(name, ptr):
    p = _concrete(ptr)
    if p is None:
        return None
    if p.size and p[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {p[0]}")
    if np.any(np.diff(p) < 0):
        raise ValueError(f"{name} must be non-decreasing, got {p.tolist()}")
    return p


def _check_seq_lens_values(seq_lens, block_tables, page_size, num_pages):
    lens, tables = _concrete(seq_lens), _concrete(block_tables)
    if lens is None:
        return
    capacity = block_tables.shape[1] * page_size
    if np.any(lens < 0) or np.any(lens > capacity):
        raise ValueError(
            f"seq_lens must lie in [0, max_pages * page_size = {capacity}], got {lens.tolist()}"
        )
    if tables is None:
        return
    for b, n in enumerate(lens):
        used = tables[b, : -(-int(n) // page_size)]
        if np.any(used < 0) or np.any(used >= num_pages):
            raise ValueError(
                f"block_tables[{b}] holds a page outside [0, {num_pages}) within its first "
                f"ceil(seq_lens[{b}] / page_size) entries: {used.tolist()}"
            )


def _check_prefix_values(prefix_tables, prefix_lens, prefix_of, page_size, num_pages):
    """Eager checks of the prefix metadata: prefix_of in [-1, G); every prefix a request
    continues has a length that is a multiple of the page size within its table row, and
    pages inside the pool. Prefixes no request continues are never read, so not checked."""
    of = _concrete(prefix_of)
    if of is None:
        return
    num_prefixes = prefix_tables.shape[0]
    if np.any(of < -1) or np.any(of >= num_prefixes):
        raise ValueError(
            f"prefix_of must lie in [-1, {num_prefixes}) (-1: no prefix), got {of.tolist()}"
        )
    lens, tables = _concrete(prefix_lens), _concrete(prefix_tables)
    if lens is None:
        return
    capacity = prefix_tables.shape[1] * page_size
    for g in sorted(set(of[of >= 0].tolist())):
        n = int(lens[g])
        if n < 0 or n > capacity or n % page_size:
            raise ValueError(
                f"prefix_lens[{g}] must be a multiple of page_size = {page_size} in "
                f"[0, max_prefix_pages * page_size = {capacity}], got {n}"
            )
        used = None if tables is None else tables[g, : n // page_size]
        if used is not None and (np.any(used < 0) or np.any(used >= num_pages)):
            raise ValueError(
                f"prefix_tables[{g}] holds a page outside [0, {num_pages}) within its first "
                f"prefix_lens[{g}] / page_size entries: {used.tolist()}"
            )


# --- argument records -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _Args:
    """Validated arguments of an attention op: the arrays and the static facts about
    them that every backend asks for."""

    q: Any
    k_cache: Any
    v_cache: Any
    scale: float
    soft_cap: float | None
    layout: _layout.Layout
    geometry: _layout.CacheGeometry
    # Per-KV-head scales of a scaled (FP8) cache: float32 [num_kv_heads], None for 1.0.
    k_scale: Any = None
    v_scale: Any = None
    # The prefill ops' mixed mode: q's scalar scale (float32, None for 1.0) and the output
    # dtype (q's dtype unless q is FP8).
    q_scale: Any = None
    out_dtype: Any = None

    @property
    def num_q_heads(self) -> int:
        return self.q.shape[1]

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.q.shape[1] // self.geometry.num_kv_heads

    @property
    def kv_dtype(self) -> np.dtype:
        return np.dtype(self.k_cache.dtype)

    @property
    def fp8_cache(self) -> bool:
        return _quant.is_fp8(self.k_cache.dtype)

    @property
    def output_dtype(self) -> np.dtype:
        return np.dtype(self.q.dtype) if self.out_dtype is None else np.dtype(self.out_dtype)

    @property
    def kernel_q(self):
        """q as the kernels take it: in the output dtype. An FP8 q is widened exactly (every
        FP8 value is representable in float32 / bfloat16 / float16); its scale is in
        :attr:`kernel_k_scale`."""
        if np.dtype(self.q.dtype) == self.output_dtype:
            return self.q
        return self.q.astype(self.output_dtype)

    @property
    def kernel_k_scale(self):
        """The per-KV-head factor of the logits besides ``scale``: k_scale times q_scale
        (float32 [num_kv_heads]), None when both are 1."""
        if self.q_scale is None:
            return self.k_scale
        ones = jnp.ones((self.geometry.num_kv_heads,), jnp.float32)
        return (ones if self.k_scale is None else self.k_scale) * self.q_scale

    @property
    def scaled(self) -> bool:
        """Whether a kernel must apply per-head scales (k, v or q)."""
        return not (self.k_scale is None and self.v_scale is None and self.q_scale is None)

    # The op's public signature after q, k_cache, v_cache: its index arrays, then the
    # static keywords besides scale, soft_cap and the scales (see kernel_call); whether it
    # takes the mixed mode's q_scale and out_dtype (the prefill ops).
    _ARRAYS: ClassVar[tuple[str, ...]] = ()
    _KEYWORDS: ClassVar[tuple[str, ...]] = ("layout",)
    _MIXED_Q: ClassVar[bool] = False

    def spec_call(self) -> tuple[tuple, dict]:
        """(positional, keywords) of the op's public signature, as the spec takes it."""
        positional, keywords = self._call(self.q, self.k_scale)
        if self._MIXED_Q:
            keywords.update(q_scale=self.q_scale, out_dtype=self.output_dtype)
        return positional, keywords

    def kernel_call(self) -> tuple[tuple, dict]:
        """(positional, keywords) of the op's public signature in the form the kernel
        backends take it: q in the output dtype (:attr:`kernel_q`), q's scale folded into
        the key scales (:attr:`kernel_k_scale`)."""
        return self._call(self.kernel_q, self.kernel_k_scale)

    def _call(self, q, k_scale):
        arrays = tuple(getattr(self, name) for name in self._ARRAYS)
        keywords = {
            name: self.layout.name if name == "layout" else getattr(self, name)
            for name in self._KEYWORDS
        }
        return (q, self.k_cache, self.v_cache, *arrays), dict(
            scale=self.scale,
            soft_cap=self.soft_cap,
            k_scale=k_scale,
            v_scale=self.v_scale,
            **keywords,
        )


@dataclasses.dataclass(frozen=True, eq=False)
class PagedArgs(_Args):
    """:func:`paged_attention`: q [B, Hq, D], block_tables i32[B, W], seq_lens i32[B]."""

    block_tables: Any = None
    seq_lens: Any = None
    partition_size: int | None = None

    _ARRAYS = ("block_tables", "seq_lens")
    _KEYWORDS = ("layout", "partition_size")

    @property
    def capacity(self) -> int:
        """Tokens a block-table row can address."""
        return self.block_tables.shape[1] * self.geometry.page_size


@dataclasses.dataclass(frozen=True, eq=False)
class ExtendArgs(_Args):
    """:func:`extend_attention` over a token pool (``layout`` is the pool pseudo-layout)."""

    qo_indptr: Any = None
    kv_indptr: Any = None
    kv_indices: Any = None

    _ARRAYS = ("qo_indptr", "kv_indptr", "kv_indices")
    _KEYWORDS = ()
    _MIXED_Q = True

    @property
    def batch(self) -> int:
        return self.qo_indptr.shape[0] - 1


@dataclasses.dataclass(frozen=True, eq=False)
class PrefillArgs(_Args):
    """:func:`prefix_prefill`: q packed by cu_seqlens_q over a paged cache."""

    cu_seqlens_q: Any = None
    block_tables: Any = None
    seq_lens: Any = None

    _ARRAYS = ("cu_seqlens_q", "block_tables", "seq_lens")
    _MIXED_Q = True

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1


@dataclasses.dataclass(frozen=True, eq=False)
class CascadeArgs(_Args):
    """:func:`cascade_attention`: q [B, Hq, D]; prefix_tables i32[G, Wp], prefix_lens i32[G],
    prefix_of i32[B]; block_tables i32[B, W], seq_lens i32[B] (each request's own part)."""

    prefix_tables: Any = None
    prefix_lens: Any = None
    prefix_of: Any = None
    block_tables: Any = None
    seq_lens: Any = None

    _ARRAYS = ("prefix_tables", "prefix_lens", "prefix_of", "block_tables", "seq_lens")

    @property
    def num_prefixes(self) -> int:
        return self.prefix_tables.shape[0]

    @property
    def prefix_capacity(self) -> int:
        """Tokens a prefix-table row can address."""
        return self.prefix_tables.shape[1] * self.geometry.page_size

    @property
    def capacity(self) -> int:
        """Tokens an own block-table row can address."""
        return self.block_tables.shape[1] * self.geometry.page_size


# --- the ops ------------------------------------------------------------------------------


class PagedAttention(Op):
    name = "paged_attention"
    roles = ("q", "k", "v", None, None)

    def bind(
        self,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        *,
        scale=None,
        layout="bshd",
        partition_size=None,
        soft_cap=None,
        k_scale=None,
        v_scale=None,
    ) -> PagedArgs:
        lay = _layout.get(layout)
        _check_float("q", q)
        _check_rank("q", q, 3, "[batch, num_q_heads, head_dim]")
        geom, k_scale, v_scale = _check_caches(q, k_cache, v_cache, lay, k_scale, v_scale)
        b = q.shape[0]
        _check_tables(b, block_tables, seq_lens)
        _check_seq_lens_values(seq_lens, block_tables, geom.page_size, geom.num_pages)
        return PagedArgs(
            q,
            k_cache,
            v_cache,
            scale=_resolve_scale(scale, geom.head_dim),
            soft_cap=_check_soft_cap(soft_cap),
            layout=lay,
            geometry=geom,
            k_scale=k_scale,
            v_scale=v_scale,
            block_tables=block_tables,
            seq_lens=seq_lens,
            partition_size=_check_partition_size(partition_size),
        )

    def problems(self, a: PagedArgs):
        g = a.geometry
        return _validity.paged_problems(a.block_tables, a.seq_lens, g.page_size, g.num_pages)

    def trivial(self, a: PagedArgs):
        if a.q.shape[0] and a.block_tables.shape[1]:
            return None
        # No sequences, or tables that address no page: a sequence of length 0 attends to
        # nothing (zeros), any other length is out of range (NaN).
        empty = (a.seq_lens == 0)[:, None, None]
        return jnp.where(empty, jnp.zeros(a.q.shape, a.q.dtype), jnp.nan).astype(a.q.dtype)


class ExtendAttention(Op):
    name = "extend_attention"
    roles = ("q", "k", "v", None, None, None)

    def bind(
        self,
        q,
        k_cache,
        v_cache,
        qo_indptr,
        kv_indptr,
        kv_indices,
        *,
        scale=None,
        soft_cap=None,
        k_scale=None,
        v_scale=None,
        q_scale=None,
        out_dtype=None,
    ) -> ExtendArgs:
        q_scale, out = _check_prefill_q(q, q_scale, out_dtype)
        _check_rank("q", q, 3, "[num_tokens, num_q_heads, head_dim]")
        _check_kv_dtypes(k_cache, v_cache)
        _check_rank("k_cache", k_cache, 3, "[num_slots, num_kv_heads, head_dim]")
        if v_cache.shape != k_cache.shape:
            raise ValueError(
                f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}, "
                f"got {tuple(v_cache.shape)}"
            )
        pool = _layout.get(_layout.POOL, pool=True)
        geom, k_scale, v_scale = _check_caches(q, k_cache, v_cache, pool, k_scale, v_scale)
        _check_int32("qo_indptr", qo_indptr, 1, "[batch + 1]")
        _check_int32("kv_indptr", kv_indptr, 1, "[batch + 1]")
        if qo_indptr.shape[0] < 2:
            raise ValueError(
                f"qo_indptr must be int32 [batch + 1] with batch >= 1, got {_shape_str(qo_indptr)}"
            )
        if kv_indptr.shape != qo_indptr.shape:
            raise ValueError(
                f"kv_indptr must be int32 [batch + 1 = {qo_indptr.shape[0]}] like "
                f"qo_indptr, got {_shape_str(kv_indptr)}"
            )
        _check_int32("kv_indices", kv_indices, 1, "[kv_indptr[-1]]")
        qo = _check_indptr_values("qo_indptr", qo_indptr)
        kv = _check_indptr_values("kv_indptr", kv_indptr)
        if qo is not None and qo[-1] > q.shape[0]:
            raise ValueError(f"qo_indptr[-1] = {qo[-1]} exceeds the {q.shape[0]} rows of q")
        if kv is not None and kv[-1] > kv_indices.shape[0]:
            raise ValueError(
                f"kv_indptr[-1] = {kv[-1]} exceeds the length of kv_indices ({kv_indices.shape[0]})"
            )
        if qo is not None and kv is not None and np.any(np.diff(kv) < np.diff(qo)):
            raise ValueError(
                "every request needs Lk >= Lq (kv_indptr lengths >= qo_indptr lengths),"
                f" got qo lengths {np.diff(qo).tolist()} and kv lengths "
                f"{np.diff(kv).tolist()}"
            )
        idx = _concrete(kv_indices)
        if idx is not None and kv is not None:
            used = idx[: kv[-1]]
            if np.any(used < 0) or np.any(used >= k_cache.shape[0]):
                raise ValueError(f"kv_indices[:kv_indptr[-1]] must lie in [0, {k_cache.shape[0]})")
        return ExtendArgs(
            q,
            k_cache,
            v_cache,
            scale=_resolve_scale(scale, geom.head_dim),
            soft_cap=_check_soft_cap(soft_cap),
            layout=pool,
            geometry=geom,
            k_scale=k_scale,
            v_scale=v_scale,
            q_scale=q_scale,
            out_dtype=out,
            qo_indptr=qo_indptr,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
        )

    def problems(self, a: ExtendArgs):
        return _validity.ragged_problems(
            a.qo_indptr,
            a.q.shape[0],
            a.kv_indptr[1:] - a.kv_indptr[:-1],
            q_name="qo_indptr",
            kv_indptr=a.kv_indptr,
            kv_indices=a.kv_indices,
            num_slots=a.geometry.num_pages,
        )

    def trivial(self, a: ExtendArgs):
        if a.q.shape[0] and a.kv_indices.shape[0]:
            return None
        return _ReferenceExtend().run(a, None)


class PrefixPrefill(Op):
    name = "prefix_prefill"
    roles = ("q", "k", "v", None, None, None)

    def bind(
        self,
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        block_tables,
        seq_lens,
        *,
        scale=None,
        layout="bshd",
        soft_cap=None,
        k_scale=None,
        v_scale=None,
        q_scale=None,
        out_dtype=None,
    ) -> PrefillArgs:
        lay = _layout.get(layout)
        q_scale, out = _check_prefill_q(q, q_scale, out_dtype)
        _check_rank("q", q, 3, "[num_tokens, num_q_heads, head_dim]")
        geom, k_scale, v_scale = _check_caches(q, k_cache, v_cache, lay, k_scale, v_scale)
        _check_int32("cu_seqlens_q", cu_seqlens_q, 1, "[batch + 1]")
        b = cu_seqlens_q.shape[0] - 1
        if b < 1:
            raise ValueError(
                f"cu_seqlens_q must be int32 [batch + 1] with batch >= 1, got "
                f"{_shape_str(cu_seqlens_q)}"
            )
        _check_tables(b, block_tables, seq_lens)
        cu = _check_indptr_values("cu_seqlens_q", cu_seqlens_q)
        if cu is not None and cu[-1] > q.shape[0]:
            raise ValueError(f"cu_seqlens_q[-1] = {cu[-1]} exceeds the {q.shape[0]} rows of q")
        lens = _concrete(seq_lens)
        if cu is not None and lens is not None and np.any(lens < np.diff(cu)):
            raise ValueError(
                f"seq_lens must be >= the query lengths, got seq_lens {lens.tolist()} "
                f"and query lengths {np.diff(cu).tolist()}"
            )
        _check_seq_lens_values(seq_lens, block_tables, geom.page_size, geom.num_pages)
        return PrefillArgs(
            q,
            k_cache,
            v_cache,
            scale=_resolve_scale(scale, geom.head_dim),
            soft_cap=_check_soft_cap(soft_cap),
            layout=lay,
            geometry=geom,
            k_scale=k_scale,
            v_scale=v_scale,
            q_scale=q_scale,
            out_dtype=out,
            cu_seqlens_q=cu_seqlens_q,
            block_tables=block_tables,
            seq_lens=seq_lens,
        )

    def problems(self, a: PrefillArgs):
        g = a.geometry
        return _validity.ragged_problems(
            a.cu_seqlens_q, a.q.shape[0], a.seq_lens, q_name="cu_seqlens_q"
        ) + _validity.paged_problems(a.block_tables, a.seq_lens, g.page_size, g.num_pages)

    def trivial(self, a: PrefillArgs):
        if a.q.shape[0] and a.block_tables.shape[1]:
            return None
        return _ReferencePrefill().run(a, None)


class CascadeAttention(Op):
    name = "cascade_attention"
    roles = ("q", "k", "v", None, None, None, None, None)

    def bind(
        self,
        q,
        k_cache,
        v_cache,
        prefix_tables,
        prefix_lens,
        prefix_of,
        block_tables,
        seq_lens,
        *,
        scale=None,
        layout="bshd",
        soft_cap=None,
        k_scale=None,
        v_scale=None,
    ) -> CascadeArgs:
        lay = _layout.get(layout)
        _check_float("q", q)
        _check_rank("q", q, 3, "[batch, num_q_heads, head_dim]")
        geom, k_scale, v_scale = _check_caches(q, k_cache, v_cache, lay, k_scale, v_scale)
        b = q.shape[0]
        _check_int32("prefix_tables", prefix_tables, 2, "[num_prefixes, max_prefix_pages]")
        g = prefix_tables.shape[0]
        _check_int32("prefix_lens", prefix_lens, 1, f"[num_prefixes={g}]")
        if prefix_lens.shape[0] != g:
            raise ValueError(
                f"prefix_lens must be int32 [num_prefixes={g}] like prefix_tables, got "
                f"{_shape_str(prefix_lens)}"
            )
        _check_int32("prefix_of", prefix_of, 1, f"[batch={b}]")
        if prefix_of.shape[0] != b:
            raise ValueError(f"prefix_of must be int32 [batch={b}], got {_shape_str(prefix_of)}")
        _check_tables(b, block_tables, seq_lens)
        _check_prefix_values(prefix_tables, prefix_lens, prefix_of, geom.page_size, geom.num_pages)
        _check_seq_lens_values(seq_lens, block_tables, geom.page_size, geom.num_pages)
        return CascadeArgs(
            q,
            k_cache,
            v_cache,
            scale=_resolve_scale(scale, geom.head_dim),
            soft_cap=_check_soft_cap(soft_cap),
            layout=lay,
            geometry=geom,
            k_scale=k_scale,
            v_scale=v_scale,
            prefix_tables=prefix_tables,
            prefix_lens=prefix_lens,
            prefix_of=prefix_of,
            block_tables=block_tables,
            seq_lens=seq_lens,
        )

    def problems(self, a: CascadeArgs):
        g = a.geometry
        return _validity.cascade_problems(
            a.prefix_tables,
            a.prefix_lens,
            a.prefix_of,
            a.block_tables,
            a.seq_lens,
            g.page_size,
            g.num_pages,
        )

    def trivial(self, a: CascadeArgs):
        if a.q.shape[0] and all(a.prefix_tables.shape) and a.block_tables.shape[1]:
            return None
        # No requests, no prefixes, or tables that address no page: nothing for a kernel
        # to tile (and nothing a prefix could share).
        return _ReferenceCascade().run(a, None)


PAGED_ATTENTION = PagedAttention()
EXTEND_ATTENTION = ExtendAttention()
PREFIX_PREFILL = PrefixPrefill()
CASCADE_ATTENTION = CascadeAttention()
OPS = {op.name: op for op in (PAGED_ATTENTION, EXTEND_ATTENTION, PREFIX_PREFILL, CASCADE_ATTENTION)}


# --- the reference backend -------------------------------------------------------------


class _Reference(Implementation):
    """The spec (:mod:`jaxattn.reference`) as a backend: ``function`` takes the op's public
    signature (:meth:`_Args.spec_call`)."""

    backend = "reference"
    function: ClassVar[Any]

    def run(self, a: _Args, config):
        positional, keywords = a.spec_call()
        return self.function(*positional, **keywords)


class _ReferencePaged(_Reference):
    function = staticmethod(_reference.paged_attention)


class _ReferenceExtend(_Reference):
    function = staticmethod(_reference.extend_attention)


class _ReferencePrefill(_Reference):
    function = staticmethod(_reference.prefix_prefill)


class _ReferenceCascade(_Reference):
    function = staticmethod(_reference.cascade_attention)


IMPLEMENTATIONS = {
    "paged_attention": _ReferencePaged(),
    "extend_attention": _ReferenceExtend(),
    "prefix_prefill": _ReferencePrefill(),
    "cascade_attention": _ReferenceCascade(),
}


def available_backends(op: str = "paged_attention") -> tuple[str, ...]:
    """Names of the backends that can run ``op`` on this platform (not a promise that each
    one serves every argument combination)."""
    platform = jax.default_backend()
    return tuple(
        name for name, impl in OPS[op].implementations().items() if impl.available(platform) is None
    )


# --- public ops ----------------------------------------------------------------------


def paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    *,
    scale=None,
    layout="bshd",
    partition_size=None,
    soft_cap=None,
    k_scale=None,
    v_scale=None,
    implementation=None,
    config=None,
    debug_checks=None,
):
    """Decode attention: one query token per sequence over a paged KV cache.

    q: [B, Hq, D]; k_cache, v_cache: a paged cache in ``layout`` (see
    :mod:`jaxattn.layout`), float or FP8; block_tables: i32[B, max_pages]; seq_lens: i32[B].
    k_scale, v_scale: None (1.0), a scalar or f32[Hkv]: a stored element means
    ``float32(element) * scale[kv_head]`` (:mod:`jaxattn.quant`).
    ``partition_size``: None for one pass (or the kernel's own split), an int for
    split-KV with that many tokens per partition followed by an exact combine.
    ``config``: a backend's configuration (None: its heuristic). ``debug_checks``: emit
    the index checks as ``checkify`` checks (None: inside :func:`checked` only).
    Returns [B, Hq, D] in q's dtype.
    """
    return PAGED_ATTENTION(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale=scale,
        layout=layout,
        partition_size=partition_size,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        implementation=implementation,
        config=config,
        debug_checks=debug_checks,
    )


def extend_attention(
    q,
    k_cache,
    v_cache,
    qo_indptr,
    kv_indptr,
    kv_indices,
    *,
    scale=None,
    soft_cap=None,
    k_scale=None,
    v_scale=None,
    q_scale=None,
    out_dtype=None,
    implementation=None,
    config=None,
    debug_checks=None,
):
    """Prefix-cached prefill over a token pool (SGLang form).

    q: [Tq, Hq, D] packed by qo_indptr i32[B+1]; k_cache, v_cache: [num_slots, Hkv, D];
    kv_indptr: i32[B+1]; kv_indices: i32[>= kv_indptr[-1]] holds, per request, the slots
    of its cached prefix followed by those of its new tokens (already written). Row i of
    request b sees key j iff ``j <= i + (Lk_b - Lq_b)``. k_scale, v_scale: per-KV-head
    scales of a scaled (FP8) cache, as in :func:`paged_attention`. q may be FP8 with
    ``q_scale`` (a scalar; q's value is ``float32(q) * q_scale``). Returns [Tq, Hq, D] in
    q's dtype, or ``out_dtype`` (default bfloat16) for an FP8 q.
    """
    return EXTEND_ATTENTION(
        q,
        k_cache,
        v_cache,
        qo_indptr,
        kv_indptr,
        kv_indices,
        scale=scale,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        q_scale=q_scale,
        out_dtype=out_dtype,
        implementation=implementation,
        config=config,
        debug_checks=debug_checks,
    )


def prefix_prefill(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    block_tables,
    seq_lens,
    *,
    scale=None,
    layout="bshd",
    soft_cap=None,
    k_scale=None,
    v_scale=None,
    q_scale=None,
    out_dtype=None,
    implementation=None,
    config=None,
    debug_checks=None,
):
    """Prefix-cached prefill over a paged KV cache.

    q: [Tq, Hq, D] packed by cu_seqlens_q i32[B+1]; block_tables i32[B, max_pages];
    seq_lens i32[B] total KV lengths (prefix + new, already written). Row i of request b
    sees token j iff ``j <= i + (seq_lens[b] - Lq_b)``. k_scale, v_scale, q_scale, out_dtype
    as in :func:`extend_attention`. Returns [Tq, Hq, D] in q's dtype, or ``out_dtype``
    (default bfloat16) for an FP8 q.
    """
    return PREFIX_PREFILL(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        block_tables,
        seq_lens,
        scale=scale,
        layout=layout,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        q_scale=q_scale,
        out_dtype=out_dtype,
        implementation=implementation,
        config=config,
        debug_checks=debug_checks,
    )


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
    scale=None,
    layout="bshd",
    soft_cap=None,
    k_scale=None,
    v_scale=None,
    implementation=None,
    config=None,
    debug_checks=None,
):
    """Decode attention where requests continue shared prefixes (cascade decode).

    q: [B, Hq, D]; prefix_tables: i32[G, max_prefix_pages] and prefix_lens: i32[G]
    (multiples of the page size) describe G shared prefixes; prefix_of: i32[B] names the
    prefix request b continues (-1: none); block_tables: i32[B, max_pages] and
    seq_lens: i32[B] are each request's own pages and token count after its prefix.
    Returns [B, Hq, D] in q's dtype: :func:`paged_attention` over the joined table (the
    prefix's pages, then the request's own). The kernel backends read a prefix once per
    batch and KV head for all the requests that continue it, instead of once per request;
    :func:`cascade_pays_off` says when that beats :func:`paged_attention`.
    k_scale, v_scale: per-KV-head scales of a scaled (FP8) cache, as in
    :func:`paged_attention`; prefix and own pages share them (one cache).

    An invalid prefix (a length that is not a multiple of the page size or runs past its
    table row, a page outside the pool) poisons every request that continues it; a
    ``prefix_of`` outside ``[-1, G)`` or an invalid own table poisons the request.
    """
    return CASCADE_ATTENTION(
        q,
        k_cache,
        v_cache,
        prefix_tables,
        prefix_lens,
        prefix_of,
        block_tables,
        seq_lens,
        scale=scale,
        layout=layout,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        implementation=implementation,
        config=config,
        debug_checks=debug_checks,
    )


def merge_states(outs, lses):
    """Exact combine of partial attention results along axis 0.

    outs: [N, ..., D] normalized partial outputs; lses: [N, ...] float, the natural-log
    log-sum-exp of the scaled logits each part saw (-inf for an empty part).
    Returns (out [..., D] in outs' dtype, lse [...] float32).
    """
    _check_float("outs", outs)
    _check_array("lses", lses)
    if not jnp.issubdtype(lses.dtype, jnp.floating):
        raise TypeError(f"lses must be a float array, got {np.dtype(lses.dtype)}")
    if outs.ndim < 2:
        raise ValueError(f"outs must be [num_parts, ..., head_dim], got {_shape_str(outs)}")
    if tuple(lses.shape) != tuple(outs.shape[:-1]):
        raise ValueError(
            f"lses must have shape outs.shape[:-1] = {tuple(outs.shape[:-1])}, got "
            f"{tuple(lses.shape)}"
        )
    return _reference.merge_states(outs, lses)
