"""KV cache layouts and their address arithmetic.

A paged KV cache is a pool of ``num_pages`` pages of ``P`` token slots each; token slot
``s = page * P + offset``. Three physical layouts are supported (``layout=``):

``"bshd"``  K and V ``[num_pages, P, Hkv, D]``            token-major (SGLang pool; Hygon layout 1)
``"bhsd"``  K and V ``[num_pages, Hkv, P, D]``            head-major (Hygon layout 0)
``"vllm"``  K ``[num_pages, Hkv, D // x, P, x]``, V ``[num_pages, Hkv, D, P]`` with
            ``x = 16 // itemsize`` so that one 16-byte vector holds ``x`` consecutive
            head-dim elements of one token (vLLM's layout).

The element offsets (in elements, not bytes) follow the stride formulas of the design
notes (part 1.3)::

    bshd:    page*(P*H*D) + offset*(H*D) + head*D + d
    bhsd:    page*(H*P*D) + head*(P*D) + offset*D + d
    vllm K:  page*(H*D*P) + head*(D*P) + (d // x)*(P*x) + offset*x + d % x
    vllm V:  page*(H*D*P) + head*(D*P) + d*P + offset

Everything here is pure ``jax.numpy`` and jit-able; conversions are exact (pure data
movement).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax.numpy as jnp
import numpy as np

LAYOUTS = ("bshd", "bhsd", "vllm")
POOL = "pool"
Kind = Literal["k", "v"]


class CacheGeometry(NamedTuple):
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int


def _check_kind(kind: str) -> None:
    if kind not in ("k", "v"):
        raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")


def vllm_x(dtype) -> int:
    """Elements per 16-byte vector in vLLM's K layout (8 for bf16/f16, 4 for f32)."""
    itemsize = np.dtype(dtype).itemsize
    if 16 % itemsize:
        raise ValueError(f"dtype {np.dtype(dtype)} does not divide a 16-byte vector")
    return 16 // itemsize


@dataclasses.dataclass(frozen=True)
class Layout:
    """One physical KV layout: the axes of its K and V arrays, outermost first.

    Axis names: ``page`` (``slot`` in a token pool), ``offset`` (token within the page),
    ``head`` (KV head), ``dim`` (head dim), and for vLLM's K ``dim_hi`` / ``dim_lo``
    (``d // x`` and ``d % x``). Everything that depends on a layout (shapes, the KV-head
    axis a tensor-parallel split cuts, the row address a kernel computes, the stride block
    of the native kernels) is derived here, so the spec, both kernel backends and the
    sharding rules read one description.
    """

    name: str
    k_axes: tuple[str, ...]
    v_axes: tuple[str, ...]

    def axes(self, kind: str = "k") -> tuple[str, ...]:
        _check_kind(kind)
        return self.k_axes if kind == "k" else self.v_axes

    def rank(self, kind: str = "k") -> int:
        return len(self.axes(kind))

    def kv_head_axis(self, kind: str = "k") -> int:
        """Index of the KV-head axis (the one tensor parallelism splits)."""
        return self.axes(kind).index("head")

    @property
    def is_pool(self) -> bool:
        return self.name == POOL

    @property
    def rows_contiguous(self) -> bool:
        """Whether a token's head_dim elements are contiguous for every (page, offset,
        head), so that a cache is a free reshape to ``[rows, D]`` (see :meth:`row`)."""
        return self.k_axes == self.v_axes and self.k_axes[-1] == "dim"

    def describe(self, kind: str = "k") -> str:
        names = {
            "page": "num_pages",
            "slot": "num_slots",
            "offset": "page_size",
            "head": "num_kv_heads",
            "dim": "head_dim",
            "dim_hi": "head_dim // x",
            "dim_lo": "x",
        }
        return "[" + ", ".join(names[a] for a in self.axes(kind)) + "]"

    def shape(self, kind: str, geom: CacheGeometry, dtype=jnp.bfloat16) -> tuple[int, ...]:
        sizes = {
            "page": geom.num_pages,
            "slot": geom.num_pages,
            "offset": geom.page_size,
            "head": geom.num_kv_heads,
            "dim": geom.head_dim,
        }
        if "dim_lo" in self.axes(kind):
            x = vllm_x(dtype)
            if geom.head_dim % x:
                raise ValueError(
                    f"head_dim={geom.head_dim} must be a multiple of x={x} for the vllm layout"
                )
            sizes.update(dim_hi=geom.head_dim // x, dim_lo=x)
        return tuple(sizes[a] for a in self.axes(kind))

    def geometry(self, k_cache, v_cache) -> CacheGeometry:
        """(num_pages, page_size, num_kv_heads, head_dim) of a K/V cache pair.

        Raises ``ValueError`` naming the argument when the ranks or shapes do not fit the
        layout, or K and V disagree. A token pool has one token per page.
        """
        ks, vs = tuple(k_cache.shape), tuple(v_cache.shape)
        for name, shape, kind in (("k_cache", ks, "k"), ("v_cache", vs, "v")):
            if len(shape) != self.rank(kind):
                raise ValueError(
                    f"{name} must have rank {self.rank(kind)} for layout={self.name!r} "
                    f"({self.describe(kind)}), got shape {shape}"
                )
        size = dict(zip(self.k_axes, ks, strict=True))
        if "dim_lo" in size:
            want_x = vllm_x(k_cache.dtype)
            if size["dim_lo"] != want_x:
                raise ValueError(
                    f"k_cache last axis must be x=16//itemsize={want_x} for layout="
                    f"{self.name!r} and dtype {np.dtype(k_cache.dtype)}, got shape {ks}"
                )
            size["dim"] = size["dim_hi"] * size["dim_lo"]
        geom = CacheGeometry(
            size.get("page", size.get("slot")), size.get("offset", 1), size["head"], size["dim"]
        )
        want_v = self.shape("v", geom, v_cache.dtype)
        if vs != want_v:
            raise ValueError(f"v_cache must have shape {want_v} to match k_cache {ks}, got {vs}")
        return geom

    def row(self, page, offset, head, geom: CacheGeometry):
        """Row of (page, offset, head) in the cache viewed as ``[rows, head_dim]`` (only
        for layouts whose rows are contiguous: bshd, bhsd, the token pool)."""
        order = {"page": page, "slot": page, "offset": offset, "head": head}
        extent = {
            "page": geom.num_pages,
            "slot": geom.num_pages,
            "offset": geom.page_size,
            "head": geom.num_kv_heads,
        }
        r = 0
        for a in self.k_axes[:-1]:
            r = r * extent[a] + order[a]
        return r

    def strides(self, geom: CacheGeometry) -> tuple[int, int, int]:
        """Element strides (page, token, head) of a rows-contiguous layout: the ``KvGeometry``
        block of the native kernels (``ffi/include/jaxattn/params.h``) mirrors these."""
        sizes = {
            "page": geom.num_pages,
            "slot": geom.num_pages,
            "offset": geom.page_size,
            "head": geom.num_kv_heads,
            "dim": geom.head_dim,
        }
        stride, acc = {}, 1
        for a in reversed(self.k_axes):
            stride[a] = acc
            acc *= sizes[a]
        page = stride.get("page", stride.get("slot"))
        return page, stride.get("offset", 0), stride["head"]


_REGISTRY = {
    "bshd": Layout("bshd", ("page", "offset", "head", "dim"), ("page", "offset", "head", "dim")),
    "bhsd": Layout("bhsd", ("page", "head", "offset", "dim"), ("page", "head", "offset", "dim")),
    "vllm": Layout(
        "vllm", ("page", "head", "dim_hi", "offset", "dim_lo"), ("page", "head", "dim", "offset")
    ),
    # An SGLang token pool [num_slots, Hkv, D] (extend_attention's K/V): page size 1.
    POOL: Layout(POOL, ("slot", "head", "dim"), ("slot", "head", "dim")),
}


def get(layout: str | Layout, *, pool: bool = False) -> Layout:
    """The :class:`Layout` named ``layout`` (one of :data:`LAYOUTS`; ``"pool"`` too when
    ``pool``). Raises ``ValueError`` naming the argument otherwise."""
    if isinstance(layout, Layout):
        return layout
    allowed = (*LAYOUTS, POOL) if pool else LAYOUTS
    if layout not in allowed:
        raise ValueError(f"layout must be one of {allowed}, got {layout!r}")
    return _REGISTRY[layout]


def check_layout(layout: str) -> None:
    get(layout)


def cache_shape(
    layout: str,
    kind: str,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype=jnp.bfloat16,
) -> tuple[int, ...]:
    """The shape of the K (``kind="k"``) or V cache for a layout."""
    _check_kind(kind)
    return get(layout).shape(
        kind, CacheGeometry(num_pages, page_size, num_kv_heads, head_dim), dtype
    )


def cache_geometry(k_cache, v_cache, layout: str) -> CacheGeometry:
    """(num_pages, page_size, num_kv_heads, head_dim) of a K/V cache pair (see
    :meth:`Layout.geometry`)."""
    return get(layout).geometry(k_cache, v_cache)


# --- conversions ---------------------------------------------------------------------


def to_bshd(cache, layout: str, kind: str):
    """Any layout -> ``[num_pages, P, Hkv, D]``."""
    check_layout(layout)
    _check_kind(kind)
    if layout == "bshd":
        return cache
    if layout == "bhsd":
        return jnp.swapaxes(cache, 1, 2)
    if kind == "v":  # [n, h, d, p] -> [n, p, h, d]
        return jnp.transpose(cache, (0, 3, 1, 2))
    n, h, dx, p, x = cache.shape  # [n, h, d/x, p, x] -> [n, p, h, d/x, x]
    return jnp.transpose(cache, (0, 3, 1, 2, 4)).reshape(n, p, h, dx * x)


def from_bshd(cache, layout: str, kind: str):
    """``[num_pages, P, Hkv, D]`` -> any layout."""
    check_layout(layout)
    _check_kind(kind)
    if layout == "bshd":
        return cache
    if layout == "bhsd":
        return jnp.swapaxes(cache, 1, 2)
    if kind == "v":
        return jnp.transpose(cache, (0, 2, 3, 1))
    n, p, h, d = cache.shape
    x = vllm_x(cache.dtype)
    return jnp.transpose(cache.reshape(n, p, h, d // x, x), (0, 2, 3, 1, 4))


def convert(k_cache, v_cache, src: str, dst: str):
    """Convert a K/V cache pair from layout ``src`` to layout ``dst`` (exact)."""
    return (
        from_bshd(to_bshd(k_cache, src, "k"), dst, "k"),
        from_bshd(to_bshd(v_cache, src, "v"), dst, "v"),
    )


# --- token addressing ----------------------------------------------------------------


def _token_index(layout: str, kind: str, page, offset):
    """Index tuple selecting the ``[..., Hkv, D]``-shaped data of token (page, offset)
    (for the vllm K layout the selection is ``[..., Hkv, D//x, x]``)."""
    if layout == "bshd":
        return (page, offset)
    if layout == "bhsd":
        return (page, slice(None), offset)
    if kind == "v":
        return (page, slice(None), slice(None), offset)
    return (page, slice(None), slice(None), offset)


def _page_size(cache, layout: str, kind: str) -> int:
    if layout == "bshd":
        return cache.shape[1]
    if layout == "bhsd":
        return cache.shape[2]
    return cache.shape[3]


def gather_tokens(cache, slots, layout: str, kind: str):
    """Gather the K or V vectors of token ``slots`` (any integer shape ``S``).

    Returns ``[*S, Hkv, D]``. Slots must be valid (``0 <= slot < num_pages * P``).
    """
    check_layout(layout)
    _check_kind(kind)
    p = _page_size(cache, layout, kind)
    slots = jnp.asarray(slots, jnp.int32)
    page, offset = slots // p, slots % p
    idx = _token_index(layout, kind, page, offset)
    out = cache[idx]
    # Advanced indices separated by a slice move the broadcast index dims to the front,
    # so every layout yields [*S, Hkv, ...] here.
    if layout == "vllm" and kind == "k":
        out = out.reshape(*out.shape[:-2], out.shape[-2] * out.shape[-1])
    return out


def scatter_tokens(cache, slots, values, layout: str, kind: str):
    """Write ``values [*S, Hkv, D]`` into token ``slots [*S]``; negative slots are dropped."""
    check_layout(layout)
    _check_kind(kind)
    p = _page_size(cache, layout, kind)
    slots = jnp.asarray(slots, jnp.int32)
    num_pages = cache.shape[0]
    # A negative slot is sent to page num_pages (out of range) and dropped by the scatter.
    page = jnp.where(slots >= 0, slots // p, num_pages)
    offset = jnp.where(slots >= 0, slots % p, 0)
    values = values.astype(cache.dtype)
    if layout == "vllm" and kind == "k":
        x = cache.shape[-1]
        values = values.reshape(*values.shape[:-1], values.shape[-1] // x, x)
    idx = _token_index(layout, kind, page, offset)
    return cache.at[idx].set(values, mode="drop")


def element_offset(layout: str, shape, page, offset, head, d, *, kind: str = "k"):
    """Linear element offset of (page, offset-in-page, kv head, head-dim index) in a
    C-contiguous cache of ``shape`` (the K cache shape unless ``kind="v"``).

    Works on Python ints and on numpy/jax integer arrays (broadcasting).
    """
    check_layout(layout)
    _check_kind(kind)
    shape = tuple(int(s) for s in shape)
    if layout == "bshd":
        _, p, h, dd = shape
        return page * (p * h * dd) + offset * (h * dd) + head * dd + d
    if layout == "bhsd":
        _, h, p, dd = shape
        return page * (h * p * dd) + head * (p * dd) + offset * dd + d
    if kind == "v":
        _, h, dd, p = shape
        return page * (h * dd * p) + head * (dd * p) + d * p + offset
    _, h, dx, p, x = shape
    dd = dx * x
    return page * (h * dd * p) + head * (dd * p) + (d // x) * (p * x) + offset * x + d % x
