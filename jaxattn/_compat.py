"""The few JAX APIs that moved between the releases jaxattn supports (0.10 and 0.11)."""

from __future__ import annotations

import inspect

import jax

_SDS_PARAMS = frozenset(inspect.signature(jax.ShapeDtypeStruct).parameters)


def _varying_axes(x) -> frozenset:
    """Mesh axes ``x`` varies over inside ``shard_map`` (empty outside one)."""
    try:
        aval = jax.typeof(x)
    except TypeError:
        return frozenset()
    mat = getattr(aval, "mat", None)  # jax 0.10+: a ManualAxisType
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()) or ())  # earlier releases: a set of axes


def out_struct(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
    """The ``ShapeDtypeStruct`` of a kernel output computed from ``inputs``.

    Inside a user's ``shard_map`` with ``check_vma=True`` (its default), a ``pallas_call``
    output must say over which mesh axes it varies: the union of its inputs' axes, since
    each output element depends on inputs that vary so. Outside ``shard_map`` the set is
    empty and the struct is a plain one.
    """
    varying = frozenset().union(*(_varying_axes(x) for x in inputs))
    if not varying:
        return jax.ShapeDtypeStruct(shape, dtype)
    if "manual_axis_type" in _SDS_PARAMS:
        return jax.ShapeDtypeStruct(
            shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=varying)
        )
    return jax.ShapeDtypeStruct(shape, dtype, vma=varying)


def _cast_varying(x, axes: tuple):
    if hasattr(jax.lax, "pcast"):  # jax 0.10+
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)


def match_varying(*xs) -> tuple:
    """``xs`` cast to vary over the union of their mesh axes (a no-op outside
    ``shard_map``): a kernel that combines them (a gather of a split cache by replicated
    page ids, say) needs operands of one varying type under ``check_vma=True``."""
    sets = [_varying_axes(x) for x in xs]
    union = frozenset().union(*sets)
    if not union:
        return xs
    return tuple(
        x if s == union else _cast_varying(x, tuple(sorted(union - s)))
        for x, s in zip(xs, sets, strict=True)
    )


def check_vma_active() -> bool:
    """Whether the current trace checks varying manual axes (inside a ``shard_map`` with
    ``check_vma=True``)."""
    from jax._src import config as _config  # the switch shard_map sets for its body

    flag = getattr(_config, "_check_vma", None)
    return bool(flag.value) if flag is not None else False


def varying_axes(*xs) -> frozenset:
    """The union of the mesh axes ``xs`` vary over (empty outside ``shard_map``)."""
    return frozenset().union(*(_varying_axes(x) for x in xs))
