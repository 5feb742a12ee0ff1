"""Tensor parallelism over a 1-D device mesh with JAX's own SPMD machinery.

Attention heads are split over the mesh axis (``"tp"``): every device owns a contiguous
block of ``Hq / N`` query heads and of ``Hkv / N`` KV heads, so each GQA group lives on one
device and attention needs no communication. The KV pool is split the same way along its
KV-head axis, while its page axis and every index array (block tables, seq_lens, indptrs,
slot lists) stay global and replicated: the host-side paging and radix structures hand out
the same page ids and slots on 1 or N devices.

* :func:`make_mesh` builds the mesh.
* :func:`paged_attention`, :func:`extend_attention`, :func:`prefix_prefill`,
  :func:`cascade_attention` (and the KV writers :func:`write_kv`, :func:`copy_blocks`) are
  the public ops with a ``mesh=``
  argument: they run the op of :mod:`jaxattn.ops` (any ``implementation=``, the native FFI
  call included) inside ``shard_map`` on each device's heads. The arguments are first
  validated on their global shapes, exactly as the single-device op validates them.
  :class:`TensorParallel` binds a mesh and exposes the same five names, so a model can call
  ``tp.paged_attention(...)`` where it would call ``ops.paged_attention(...)``.
* :func:`param_specs` / :func:`param_shardings` / :func:`shard_params` give the Llama
  parameters (see :mod:`jaxattn.models.llama`) Megatron-style shardings: q/k/v and MLP
  gate/up projections column-parallel (their output features, i.e. whole heads, split),
  o and down projections row-parallel (their input features split), so each layer needs
  exactly two all-reduces of the hidden state, which XLA inserts after the row-parallel
  matmuls. The norms and the input embedding are replicated: an embedding lookup reads
  only the rows of the batch's tokens, while splitting the table by vocabulary would add
  a masked lookup and one more all-reduce per step. The output projection ``lm_head`` is
  split by vocabulary (it is the largest single matmul of a decode step, and its output,
  the logits, is small); a tied ``lm_head`` is the embedding table and so stays replicated.
* :func:`kv_cache_spec` / :func:`kv_cache_sharding` / :func:`shard_kv_cache` place a KV pool;
  :func:`init_kv_cache` builds one already split.

A head count the mesh size does not divide is rejected with ``ValueError``; replicating
KV heads when ``Hkv < N`` is not supported.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import kv as _kv
from . import layout as _layout
from . import ops as _ops
from . import quant as _quant

__all__ = [
    "AXIS",
    "TOKEN_POOL",
    "TensorParallel",
    "bytes_per_device",
    "cascade_attention",
    "check_heads",
    "copy_blocks",
    "extend_attention",
    "init_kv_cache",
    "kv_cache_sharding",
    "kv_cache_shardings",
    "kv_cache_spec",
    "kv_head_axis",
    "make_mesh",
    "paged_attention",
    "param_shardings",
    "param_specs",
    "prefix_prefill",
    "rope_write_kv",
    "shard_kv_cache",
    "shard_params",
    "write_kv",
]

AXIS = "tp"

# Pseudo-layout for an SGLang token pool ``[num_slots, Hkv, D]`` (extend_attention's K/V).
TOKEN_POOL = _layout.POOL

# jax.shard_map is the public name from jax 0.6 on; older releases only have the
# experimental one, whose replication check is spelled check_rep.
if hasattr(jax, "shard_map"):

    def _shard_map(fn, mesh, in_specs, out_specs):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

else:  # pragma: no cover - depends on the installed jax
    from jax.experimental.shard_map import shard_map as _experimental_shard_map

    def _shard_map(fn, mesh, in_specs, out_specs):
        return _experimental_shard_map(fn, mesh, in_specs, out_specs, check_rep=False)


# The replication / varying-axes check is off in both spellings: the FFI and Pallas calls
# have no rule for it, and every output here is split over the mesh axis, never replicated,
# so there is nothing for it to verify.


# --- mesh and specs ------------------------------------------------------------------


def make_mesh(
    num_devices: int | None = None,
    *,
    devices: Sequence[jax.Device] | None = None,
    axis_name: str = AXIS,
) -> Mesh:
    """A 1-D mesh named ``axis_name`` over the first ``num_devices`` of ``devices``
    (default: all of ``jax.devices()``)."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices) if num_devices is None else num_devices
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"num_devices must be a positive int, got {num_devices!r}")
    if n > len(devices):
        raise ValueError(f"num_devices={n} exceeds the {len(devices)} devices available")
    return Mesh(np.asarray(devices[:n]), (axis_name,))


def _mesh_size(mesh: Mesh, axis_name: str) -> int:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.shape:
        raise ValueError(f"mesh has axes {tuple(mesh.shape)}, not axis_name={axis_name!r}")
    return mesh.shape[axis_name]


def check_heads(num_shards: int, num_q_heads: int, num_kv_heads: int | None = None) -> None:
    """Raise ``ValueError`` unless ``num_shards`` divides the query and KV head counts."""
    for name, heads in (("query", num_q_heads), ("KV", num_kv_heads)):
        if heads is not None and heads % num_shards:
            raise ValueError(
                f"the number of {name} heads ({heads}) must be a multiple of the "
                f"tensor-parallel mesh size ({num_shards})"
            )


def kv_head_axis(layout: str, kind: str = "k") -> int:
    """Index of the KV-head axis of a K (``kind="k"``) or V cache in ``layout``
    (``"bshd"``, ``"bhsd"``, ``"vllm"`` or :data:`TOKEN_POOL`)."""
    return _layout.get(layout, pool=True).kv_head_axis(kind)


def _split(rank: int, axis: int | None, axis_name: str) -> PartitionSpec:
    return PartitionSpec(*(axis_name if i == axis else None for i in range(rank)))


def kv_cache_spec(layout: str, kind: str = "k", *, axis_name: str = AXIS) -> PartitionSpec:
    """The PartitionSpec that splits a cache's KV-head axis over ``axis_name``."""
    lay = _layout.get(layout, pool=True)
    return _split(lay.rank(kind), lay.kv_head_axis(kind), axis_name)


def kv_cache_sharding(
    mesh: Mesh, layout: str, kind: str = "k", *, axis_name: str = AXIS
) -> NamedSharding:
    _mesh_size(mesh, axis_name)
    return NamedSharding(mesh, kv_cache_spec(layout, kind, axis_name=axis_name))


def kv_cache_shardings(
    mesh: Mesh, layout: str = "bshd", *, axis_name: str = AXIS
) -> tuple[NamedSharding, NamedSharding]:
    """``(k_sharding, v_sharding)``, e.g. the ``out_shardings`` of a jitted function that
    builds the pool, so that no device ever holds the whole of it."""
    return (
        kv_cache_sharding(mesh, layout, "k", axis_name=axis_name),
        kv_cache_sharding(mesh, layout, "v", axis_name=axis_name),
    )


def init_kv_cache(init, mesh: Mesh, *, layout: str = "bshd", axis_name: str = AXIS):
    """``init() -> (k_cache, v_cache)`` run jitted with the split as its output sharding:
    each device allocates only its own KV heads (``shard_kv_cache`` of an existing pool
    would first hold it whole on one device)."""
    n = _mesh_size(mesh, axis_name)
    k_abs, v_abs = jax.eval_shape(init)
    if layout == TOKEN_POOL:
        _check_pool(k_abs, v_abs)
        num_kv_heads = k_abs.shape[1]
    else:
        num_kv_heads = _layout.cache_geometry(k_abs, v_abs, layout).num_kv_heads
    check_heads(n, None, num_kv_heads)
    return jax.jit(init, out_shardings=kv_cache_shardings(mesh, layout, axis_name=axis_name))()


def shard_kv_cache(k_cache, v_cache, mesh: Mesh, *, layout: str = "bshd", axis_name: str = AXIS):
    """``(k_cache, v_cache)`` placed on ``mesh`` with their KV-head axis split.

    ``layout`` is a paged layout or :data:`TOKEN_POOL`. Each device then holds
    ``1 / N`` of the pool: every page, for its own KV heads.
    """
    n = _mesh_size(mesh, axis_name)
    if layout == TOKEN_POOL:
        _check_pool(k_cache, v_cache)
        num_kv_heads = k_cache.shape[1]
    else:
        num_kv_heads = _layout.cache_geometry(k_cache, v_cache, layout).num_kv_heads
    check_heads(n, None, num_kv_heads)
    ks, vs = kv_cache_shardings(mesh, layout, axis_name=axis_name)
    return jax.device_put(k_cache, ks), jax.device_put(v_cache, vs)


def _check_pool(k_cache, v_cache):
    if k_cache.ndim != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "a token pool is K and V of one shape [num_slots, num_kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )


# --- the ops under shard_map ---------------------------------------------------------


def _heads_spec(axis_name):
    return _split(3, 1, axis_name)


def _role_spec(role, lay, axis_name: str) -> PartitionSpec:
    """How an op's array of ``role`` splits: query heads (``"q"``), a KV cache's KV-head
    axis (``"k"`` / ``"v"``), or replicated (None)."""
    if role == "q":
        return _heads_spec(axis_name)
    if role in ("k", "v"):
        return _split(lay.rank(role), lay.kv_head_axis(role), axis_name)
    return PartitionSpec()


def _shard_op(op, args: tuple, kwargs: dict, mesh: Mesh, axis_name: str, out_roles="q"):
    """Run ``op`` under ``shard_map`` on each device's heads.

    The arguments are first validated on their global shapes by the op's own
    :meth:`~jaxattn.backend.Op.bind` (index values too, when they are concrete), exactly as
    the single-device op validates them; the op's ``roles`` say how each positional
    argument is split (query heads, a KV cache's KV-head axis, or replicated), and
    ``out_roles`` (one role, or a tuple for a tuple of results) how the results are.
    """
    n = _mesh_size(mesh, axis_name)
    call_kw = {k: kwargs[k] for k in ("implementation", "config") if k in kwargs}
    bound = op.bind(*args, **{k: v for k, v in kwargs.items() if k not in call_kw})
    check_heads(n, bound.num_q_heads, bound.geometry.num_kv_heads)
    lay = bound.layout
    specs = [_role_spec(role, lay, axis_name) for role in op.roles]
    # Scales are data (traced arrays): a per-KV-head scale is split with its cache's heads,
    # q's scalar scale is replicated. They travel as operands, validated above.
    scales = {}
    for name, spec in (
        ("k_scale", PartitionSpec(axis_name)),
        ("v_scale", PartitionSpec(axis_name)),
        ("q_scale", PartitionSpec()),
    ):
        if kwargs.get(name) is not None:
            scales[name] = (getattr(bound, name), spec)
    rest = {k: v for k, v in kwargs.items() if k not in scales}
    names = tuple(scales)

    def body(*operands):
        given = dict(zip(names, operands[len(args) :], strict=True))
        return op(*operands[: len(args)], **rest, **given)

    fn = _shard_map(
        body,
        mesh,
        in_specs=(*specs, *(spec for _, spec in scales.values())),
        out_specs=(
            tuple(_role_spec(r, lay, axis_name) for r in out_roles)
            if isinstance(out_roles, tuple)
            else _role_spec(out_roles, lay, axis_name)
        ),
    )
    return fn(*args, *(value for value, _ in scales.values()))


def paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    *,
    mesh: Mesh,
    axis_name: str = AXIS,
    layout: str = "bshd",
    **kwargs,
):
    """:func:`jaxattn.paged_attention` with heads split over ``mesh``.

    q: [B, Hq, D] split on axis 1; k_cache, v_cache split on their KV-head axis
    (:func:`kv_head_axis`); block_tables i32[B, max_pages], seq_lens i32[B] replicated.
    Other keyword arguments (``scale``, ``partition_size``, ``soft_cap``,
    ``implementation``, ``config``) go to the op. Returns [B, Hq, D] split on axis 1.
    """
    args = (q, k_cache, v_cache, block_tables, seq_lens)
    return _shard_op(_ops.PAGED_ATTENTION, args, dict(kwargs, layout=layout), mesh, axis_name)


def extend_attention(
    q,
    k_cache,
    v_cache,
    qo_indptr,
    kv_indptr,
    kv_indices,
    *,
    mesh: Mesh,
    axis_name: str = AXIS,
    **kwargs,
):
    """:func:`jaxattn.extend_attention` with heads split over ``mesh``.

    q: [Tq, Hq, D] and the token pool k_cache, v_cache [num_slots, Hkv, D] split on
    axis 1; qo_indptr, kv_indptr, kv_indices replicated. Returns [Tq, Hq, D] split on
    axis 1.
    """
    args = (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices)
    return _shard_op(_ops.EXTEND_ATTENTION, args, kwargs, mesh, axis_name)


def prefix_prefill(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    block_tables,
    seq_lens,
    *,
    mesh: Mesh,
    axis_name: str = AXIS,
    layout: str = "bshd",
    **kwargs,
):
    """:func:`jaxattn.prefix_prefill` with heads split over ``mesh``.

    q: [Tq, Hq, D] split on axis 1; k_cache, v_cache split on their KV-head axis;
    cu_seqlens_q, block_tables, seq_lens replicated. Returns [Tq, Hq, D] split on axis 1.
    """
    args = (q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens)
    return _shard_op(_ops.PREFIX_PREFILL, args, dict(kwargs, layout=layout), mesh, axis_name)


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
    mesh: Mesh,
    axis_name: str = AXIS,
    layout: str = "bshd",
    **kwargs,
):
    """:func:`jaxattn.cascade_attention` with heads split over ``mesh``.

    q: [B, Hq, D] split on axis 1; k_cache, v_cache split on their KV-head axis (and
    ``k_scale`` / ``v_scale`` with them); the prefix tables and lengths, prefix_of,
    block_tables and seq_lens replicated (page ids are global). Returns [B, Hq, D] split on
    axis 1.
    """
    args = (q, k_cache, v_cache, prefix_tables, prefix_lens, prefix_of, block_tables, seq_lens)
    return _shard_op(_ops.CASCADE_ATTENTION, args, dict(kwargs, layout=layout), mesh, axis_name)


def write_kv(
    k_cache,
    v_cache,
    k,
    v,
    slot_mapping,
    *,
    mesh: Mesh,
    axis_name: str = AXIS,
    layout: str = "bshd",
    k_scale=None,
    v_scale=None,
    implementation=None,
):
    """:func:`jaxattn.write_kv` on each device's KV heads: k, v [T, Hkv, D] split on
    axis 1, slot_mapping replicated, per-KV-head scales split with the heads; the caches
    come back split as they went in.

    A scatter into a split cache is what XLA's partitioner may otherwise decide to
    gather first; under ``shard_map`` every device writes its own heads in place.
    """
    n = _mesh_size(mesh, axis_name)
    geom = _layout.cache_geometry(k_cache, v_cache, layout)
    check_heads(n, None, geom.num_kv_heads)
    specs = (
        kv_cache_spec(layout, "k", axis_name=axis_name),
        kv_cache_spec(layout, "v", axis_name=axis_name),
    )
    heads = _heads_spec(axis_name)
    ks = _quant.check_scale("k_scale", k_scale, geom.num_kv_heads)
    vs = _quant.check_scale("v_scale", v_scale, geom.num_kv_heads)
    ones = jax.numpy.ones((geom.num_kv_heads,), jax.numpy.float32)

    def body(kc, vc, k_, v_, slots, ks_, vs_):
        return _kv.write_kv(
            kc,
            vc,
            k_,
            v_,
            slots,
            layout=layout,
            k_scale=None if ks is None else ks_,
            v_scale=None if vs is None else vs_,
            implementation=implementation,
        )

    split = PartitionSpec(axis_name)
    fn = _shard_map(
        body,
        mesh,
        in_specs=(*specs, heads, heads, PartitionSpec(), split, split),
        out_specs=specs,
    )
    return fn(
        k_cache, v_cache, k, v, slot_mapping, ones if ks is None else ks, ones if vs is None else vs
    )


def rope_write_kv(
    qkv,
    cos,
    sin,
    k_cache,
    v_cache,
    slot_mapping,
    *,
    mesh: Mesh,
    axis_name: str = AXIS,
    layout: str = "bshd",
    k_scale=None,
    v_scale=None,
    implementation=None,
):
    """:func:`jaxattn.rope_write_kv` on each device's heads: qkv [T, Hq + 2 Hkv, D] split on
    axis 1 with each device's q, k and v heads side by side (the fused projection of
    ``serving_params(..., shards=n)``), cos, sin and slot_mapping replicated, per-KV-head
    scales split with the heads. Returns q [T, Hq, D] split on axis 1 and the caches split
    as they went in."""
    if getattr(qkv, "ndim", 3) != 3:
        raise ValueError(
            "rope_write_kv over a mesh takes qkv [T, Hq + 2 Hkv, D] (no partial sums), got shape "
            f"{tuple(getattr(qkv, 'shape', ()))}"
        )
    args = (qkv, cos, sin, k_cache, v_cache, slot_mapping)
    kwargs = dict(layout=layout, k_scale=k_scale, v_scale=v_scale, implementation=implementation)
    return _shard_op(_kv.ROPE_WRITE_KV, args, kwargs, mesh, axis_name, out_roles=("q", "k", "v"))


def copy_blocks(
    k_cache, v_cache, src, dst, *, mesh: Mesh, axis_name: str = AXIS, layout: str = "bshd"
):
    """:func:`jaxattn.copy_blocks` on each device's KV heads (src, dst replicated)."""
    n = _mesh_size(mesh, axis_name)
    check_heads(n, None, _layout.cache_geometry(k_cache, v_cache, layout).num_kv_heads)
    specs = (
        kv_cache_spec(layout, "k", axis_name=axis_name),
        kv_cache_spec(layout, "v", axis_name=axis_name),
    )
    rep = PartitionSpec()
    fn = _shard_map(
        functools.partial(_kv.copy_blocks, layout=layout),
        mesh,
        in_specs=(*specs, rep, rep),
        out_specs=specs,
    )
    return fn(k_cache, v_cache, src, dst)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """A mesh axis bound once: the same op names as :mod:`jaxattn.ops` / :mod:`jaxattn.kv`,
    running head-split. Hashable, so it can be a static argument of ``jax.jit``."""

    mesh: Mesh
    axis_name: str = AXIS

    def __post_init__(self):
        _mesh_size(self.mesh, self.axis_name)

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis_name]

    def _bound(self, fn, *args, **kwargs):
        return fn(*args, mesh=self.mesh, axis_name=self.axis_name, **kwargs)

    def paged_attention(self, *args, **kwargs):
        return self._bound(paged_attention, *args, **kwargs)

    def extend_attention(self, *args, **kwargs):
        return self._bound(extend_attention, *args, **kwargs)

    def prefix_prefill(self, *args, **kwargs):
        return self._bound(prefix_prefill, *args, **kwargs)

    def cascade_attention(self, *args, **kwargs):
        return self._bound(cascade_attention, *args, **kwargs)

    def write_kv(self, *args, **kwargs):
        return self._bound(write_kv, *args, **kwargs)

    def rope_write_kv(self, *args, **kwargs):
        return self._bound(rope_write_kv, *args, **kwargs)

    def copy_blocks(self, *args, **kwargs):
        return self._bound(copy_blocks, *args, **kwargs)

    def shard_params(self, params: dict, cfg, **kwargs) -> dict:
        return shard_params(params, self.mesh, cfg, axis_name=self.axis_name, **kwargs)

    def shard_kv_cache(self, k_cache, v_cache, *, layout: str = "bshd"):
        return shard_kv_cache(k_cache, v_cache, self.mesh, layout=layout, axis_name=self.axis_name)

    def init_kv_cache(self, init, *, layout: str = "bshd"):
        return init_kv_cache(init, self.mesh, layout=layout, axis_name=self.axis_name)

    def kv_cache_shardings(self, layout: str = "bshd"):
        return kv_cache_shardings(self.mesh, layout, axis_name=self.axis_name)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())


# --- parameters ----------------------------------------------------------------------

# Per-layer weights (without the stacked layer axis): the axis split over the mesh, None
# for replicated. Linear weights are [in, out].
_LAYER_SPLIT = {
    "attn_norm": None,
    "wq": 1,  # column-parallel: whole query heads per device
    "wk": 1,
    "wv": 1,
    "wo": 0,  # row-parallel: the heads this device attended over
    "mlp_norm": None,
    "w_gate": 1,  # column-parallel
    "w_up": 1,
    "w_down": 0,  # row-parallel
}
_TOP_LEVEL = ("embed", "layers", "norm", "lm_head")


def param_specs(
    params: dict,
    cfg,
    num_shards: int,
    *,
    axis_name: str = AXIS,
    vocab_parallel: bool = True,
) -> dict:
    """PartitionSpecs for the Llama parameter pytree (same structure as ``params``).

    ``params`` may hold arrays or ``jax.ShapeDtypeStruct`` (e.g. from
    ``jax.eval_shape(init_params, cfg, key)``): only keys and ranks are read. ``cfg`` is
    the model's :class:`~jaxattn.models.llama.LlamaConfig`. ``lm_head`` is split by
    vocabulary when ``vocab_parallel`` and ``num_shards`` divides the vocabulary, else
    replicated. An unknown parameter name is an error rather than silently replicated.
    """
    check_heads(num_shards, cfg.num_attention_heads, cfg.num_key_value_heads)
    if cfg.intermediate_size % num_shards:
        raise ValueError(
            f"intermediate_size ({cfg.intermediate_size}) must be a multiple of the "
            f"tensor-parallel mesh size ({num_shards})"
        )
    unknown = sorted(set(params) - set(_TOP_LEVEL))
    unknown += sorted(f"layers/{k}" for k in set(params.get("layers", {})) - set(_LAYER_SPLIT))
    if unknown:
        raise ValueError(f"no sharding rule for parameters {unknown}")

    def stacked(name, x):
        split = _LAYER_SPLIT[name]
        if x.ndim != (2 if split is None else 3):
            raise ValueError(
                f"layers/{name} must be stacked on a leading layer axis, got {x.shape}"
            )
        return _split(x.ndim, None if split is None else split + 1, axis_name)

    specs = {
        "embed": PartitionSpec(),
        "layers": {name: stacked(name, x) for name, x in params["layers"].items()},
        "norm": PartitionSpec(),
    }
    if "lm_head" in params:
        split_vocab = vocab_parallel and cfg.vocab_size % num_shards == 0
        specs["lm_head"] = _split(2, 1 if split_vocab else None, axis_name)
    return specs


def param_shardings(
    params: dict, mesh: Mesh, cfg, *, axis_name: str = AXIS, vocab_parallel: bool = True
) -> dict:
    """NamedShardings for the Llama parameters on ``mesh`` (see :func:`param_specs`)."""
    n = _mesh_size(mesh, axis_name)
    specs = param_specs(params, cfg, n, axis_name=axis_name, vocab_parallel=vocab_parallel)
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def shard_params(
    params: dict, mesh: Mesh, cfg, *, axis_name: str = AXIS, vocab_parallel: bool = True
) -> dict:
    """``params`` placed on ``mesh`` with :func:`param_shardings`."""
    return jax.device_put(
        params,
        param_shardings(params, mesh, cfg, axis_name=axis_name, vocab_parallel=vocab_parallel),
    )


def bytes_per_device(shape: Sequence[int], dtype, spec: PartitionSpec, num_shards: int) -> int:
    """Bytes one device holds of an array of ``shape`` split by ``spec`` over a 1-D mesh
    of ``num_shards`` devices."""
    size = math.prod(shape)
    if any(s is not None for s in spec):
        size //= num_shards
    return size * np.dtype(dtype).itemsize
