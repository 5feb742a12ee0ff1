"""What the Mosaic GPU kernels (:mod:`.decode_mgpu`, :mod:`.prefill_mgpu`) share: the argument
checks, the register-layout helpers, a page's slab of one KV head, and one step of the page
ring (S = q K^T, the online softmax, the V rows past the last key zeroed, O += P V).

Interpret mode (the CPU) runs the two products as ``jnp.dot``: its wgmma takes neither a
transposed shared-memory operand nor a register one, and it has no register layouts.
"""

from __future__ import annotations

import functools
import inspect
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from .. import layout as L
from .. import quant as Q
from ..env import switched_off
from . import _common as C

try:  # the Mosaic GPU lowering and its interpret mode (jax >= 0.10)
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - older jax
    plgpu = None
    InterpretGPUParams = None

ROWS = 64  # wgmma's M
# jax 0.10's plgpu.load has a required index argument (0.11 deprecates it).
_LOAD_TAKES_INDEX = (
    plgpu is not None
    and inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty
)
DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
LAYOUTS = ("bshd", "bhsd")


def load(ref, *, layout, optimized: bool = True):
    """``plgpu.load`` of a whole reference into ``layout``: jax 0.10 takes the (empty) index
    as an argument, 0.11 deprecates it (the reference is indexed with ``.at`` instead)."""
    if _LOAD_TAKES_INDEX:
        return plgpu.load(ref, (), layout=layout, optimized=optimized)
    return plgpu.load(ref, layout=layout, optimized=optimized)


def available() -> str | None:
    """None when this JAX has the Mosaic GPU lowering and its interpret mode, else why not."""
    if plgpu is None or InterpretGPUParams is None:
        return f"jax {jax.__version__} has no Pallas Mosaic GPU lowering with an interpret mode"
    return None


def is_sm90() -> bool:
    """True where the default device is a Hopper (sm_90) GPU, the kernels' compile target."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def compiled_16bit(q, k_cache) -> bool:
    """What both kernels' default rules (``serves_by_default``) start from: this JAX has the
    lowering, the default backend is an sm_90 GPU (compiled, not the interpreter), and the
    cache is 16-bit in q's dtype (FP8 caches keep the Triton-lowered kernels)."""
    if available() is not None or Q.is_fp8(k_cache.dtype) or k_cache.dtype != q.dtype:
        return False
    return jax.default_backend() == "gpu" and is_sm90()


def unsupported(
    q, k_cache, v_cache, layout, *, pages_per_step: int, what: str, scaled: bool = False
) -> str | None:
    """Why the Mosaic GPU ``what`` (decode, prefill, cascade decode) cannot serve these
    arguments, or None. ``scaled``: k/v scales are given (FP8 caches take them)."""
    if (why := available()) is not None:
        return why
    name = L.get(layout, pool=True).name
    if name not in LAYOUTS:
        return f"the Mosaic GPU {what} reads layouts {LAYOUTS}, not {name!r}"
    dt = np.dtype(q.dtype)
    kv = np.dtype(k_cache.dtype)
    if dt not in DTYPES or v_cache.dtype != kv or (kv != dt and not Q.is_fp8(kv)):
        return (
            f"the Mosaic GPU {what} takes q in one of bfloat16/float16 and the caches in q's "
            f"dtype or one FP8 format, got {dt}, {kv}, {np.dtype(v_cache.dtype)}"
        )
    geom = L.get(layout, pool=True).geometry(k_cache, v_cache)
    if geom.head_dim % 64:
        return f"the Mosaic GPU {what} needs head_dim a multiple of 64, got {geom.head_dim}"
    group = q.shape[1] // geom.num_kv_heads
    if group > ROWS:
        return f"the Mosaic GPU {what} serves up to {ROWS} query heads a KV head, got {group}"
    tokens = pages_per_step * geom.page_size
    if geom.page_size % 8 or tokens > 256:
        return (
            f"the Mosaic GPU {what} needs page_size a multiple of 8 and at most 256 tokens a "
            f"step, got page_size {geom.page_size} x {pages_per_step} pages"
        )
    if scaled and not Q.is_fp8(k_cache.dtype):
        return f"the Mosaic GPU {what} takes k/v scales with FP8 caches only"
    return None


def steps_of(pages_per_step, page_size: int) -> int:
    """Pages a ring step copies: whole 64-row tiles (default: the fewest pages that make
    them)."""
    if pages_per_step is None:
        pages_per_step = 64 // math.gcd(64, page_size)
    if pages_per_step < 1 or pages_per_step * page_size % 64:
        raise ValueError(
            f"pages_per_step * page_size must be a multiple of 64 (the kernel's tile rows), "
            f"got {pages_per_step} * {page_size}"
        )
    return int(pages_per_step)


def finish_args(why, stages: int, scale, head_dim: int, interpret):
    """The last checks and defaults of an entry point: ``stages`` >= 2, ``why`` (from
    :func:`unsupported`) raised as NotImplementedError; (scale: 1 / sqrt(head_dim) by
    default, interpret: exactly on the CPU by default)."""
    if stages < 2:
        raise ValueError(f"stages must be >= 2, got {stages}")
    if why is not None:
        raise NotImplementedError(why)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    return scale, interpreted(interpret)


def platform_reason(*, interpret: bool, what: str = "kernels") -> str | None:
    """Why the Mosaic GPU ``what`` cannot run here, or None: they compile for sm_90 GPUs and
    run interpreted anywhere (``interpret``: the call's mode; None: the default's, compiled on
    a GPU and interpreted on the CPU)."""
    if (why := available()) is not None:
        return why
    if interpreted(interpret) or is_sm90():
        return None
    verb = "are" if what.endswith("s") else "is"
    return f"the Mosaic GPU {what} {verb} compiled for sm_90 GPUs only"


def partition_pages_of(partition_size, k_cache, v_cache, layout, *, interpret, what: str):
    """A public op's ``partition_size`` (tokens, or None) as whole pages for a Mosaic GPU
    kernel (``what`` names it in the errors), after refusing a compiled run off sm_90."""
    if (why := platform_reason(interpret=interpret, what=what)) is not None:
        raise NotImplementedError(why)
    if partition_size is None:
        return None
    page = L.get(layout, pool=True).geometry(k_cache, v_cache).page_size
    if partition_size % page:
        raise NotImplementedError(
            f"the Mosaic GPU {what} partitions whole pages: partition_size={partition_size} "
            f"is not a multiple of the page size {page}"
        )
    return partition_size // page


def interpreted(interpret) -> bool:
    """An entry point's ``interpret``: None means exactly on the CPU."""
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def to_float16(q, num_kv_heads: int, k_scale):
    """FP8 caches: q ``[..., Hq, D]`` as float16 and each KV head's score factor. Each KV
    head's queries are multiplied by a power of two that puts their largest finite |q| in
    [2^14, 2^15) (float16 keeps 29 binades below it; NaN and inf stay what they are), so
    ``factor[h] = k_scale[h] / that power`` turns the float16 scores back into the scores
    of q and the dequantised keys exactly."""
    *lead, hq, d = q.shape
    x = q.astype(jnp.float32).reshape(*lead, num_kv_heads, hq // num_kv_heads, d)
    a = jnp.abs(x)
    axes = tuple(i for i in range(x.ndim) if i != len(lead))
    qmax = jnp.max(jnp.where(jnp.isfinite(a), a, 0.0), axis=axes)
    _, ex = jnp.frexp(qmax)
    pre = jnp.ldexp(jnp.ones_like(qmax), jnp.clip(15 - ex, -100, 100))
    shape = (1,) * len(lead) + (num_kv_heads, 1, 1)
    q16 = (x * pre.reshape(shape)).astype(jnp.float16).reshape(q.shape)
    return q16, head_vector(k_scale, num_kv_heads) / pre


def head_vector(x, num_kv_heads: int):
    """A per-KV-head scale (None: 1) as f32 ``[num_kv_heads]``."""
    if x is None:
        return jnp.ones((num_kv_heads,), jnp.float32)
    return jnp.broadcast_to(jnp.asarray(x, jnp.float32), (num_kv_heads,))


def ring_smem(stages: int, keys: int, head_dim: int, dtype):
    """A ring of ``stages`` steps of ``keys`` rows: the wgmma operand tiles (8 rows x 128
    bytes, 128-byte swizzle) for 16-bit caches; FP8 rows tiled by the same 128 bytes (a
    register load of them then has the tiled layout the widened float16 tiles store)."""
    if Q.is_fp8(dtype):
        width = min(128, head_dim)
        t = (plgpu.TilingTransform((8, width)), plgpu.SwizzleTransform(width))
        return plgpu.SMEM((stages, keys, head_dim), dtype, transforms=t)
    return plgpu.SMEM((stages, keys, head_dim), dtype, transforms=tiled())


def union(*members, interpret: bool):
    """Shared memory that ``members`` (refs or trees of them, of disjoint lifetimes) share when
    compiled; interpret mode has no ref unions, so each has its own there."""
    return members if interpret else plgpu.RefUnion(*members)


def ring_buffers(stages, keys, head_dim, q_dtype, kv_dtype, interpret: bool, output=True):
    """The kernels' shared memory for q and the ring: (q tile, K ring with the f32 output
    tile over it -- aliased when compiled (:func:`union`), written after the last K step is
    read -- V ring). ``output=False``: the K ring alone, the caller placing the output tile."""
    k_ring = ring_smem(stages, keys, head_dim, kv_dtype)
    if output:
        k_ring = union(k_ring, plgpu.SMEM((ROWS, head_dim), jnp.float32), interpret=interpret)
    return (
        plgpu.SMEM((ROWS, head_dim), q_dtype, transforms=tiled()),
        k_ring,
        ring_smem(stages, keys, head_dim, kv_dtype),
    )


def fp8_buffers(factors, keys: int, head_dim: int, dtype):
    """FP8 caches: shared memory for the score factors, then one step's K and V widened to
    ``dtype`` (float16)."""
    return (
        plgpu.SMEM((factors.shape[0],), jnp.float32),
        plgpu.SMEM((keys, head_dim), dtype, transforms=tiled()),
        plgpu.SMEM((keys, head_dim), dtype, transforms=tiled()),
    )


def widen_step(i, slot, *, ring, bars, wide, wide_bars, keys, n_keys, interpret: bool):
    """An FP8 ring's step ``i`` (slot ``slot`` of ``ring`` = (K ring, V ring), its copies
    arriving on ``bars``) widened into the float16 tiles ``wide`` = (K, V), each behind its
    barriers ``wide_bars`` = (K's, V's) ``[2]``: 0 widened (arrived here), 1 free (waited
    here; the reader's release). K first, then V, V's rows at or past ``n_keys`` zeroed
    (every FP8 value is exact in float16); each tile's codes are loaded before its wait for
    the tile to be free, so those loads overlap the reader's products."""
    for tile, codes, bar, tile_bars, limit in zip(
        wide, ring, bars, wide_bars, (None, n_keys - i * keys), strict=True
    ):
        plgpu.barrier_wait(bar.at[slot])
        x = widened(codes, slot, tile.dtype, interpret, n_keys=limit)
        plgpu.barrier_wait(tile_bars.at[1])
        tile[...] = x
        plgpu.commit_smem()
        plgpu.barrier_arrive(tile_bars.at[0])


def widened(ring, slot, dtype, interpret: bool, n_keys=None):
    """Slot ``slot`` of an FP8 ring in registers as ``dtype`` (float16: exact), rows at or past
    ``n_keys`` zeroed when given; compiled, in :func:`widen_layout`."""
    keys, head_dim = ring.shape[1:]
    if interpret:
        codes = ring[slot]
        rows = lax.broadcasted_iota(jnp.int32, (keys, head_dim), 0)
    else:
        layout = widen_layout(keys, head_dim)
        codes = load(ring.at[slot], layout=layout)
        rows = plgpu.broadcasted_iota(jnp.int32, (keys, head_dim), 0, layout=layout)
    x = codes.astype(dtype)
    if n_keys is None:
        return x
    return jnp.where(rows < n_keys, x, jnp.zeros_like(x))


def widen_layout(keys: int, head_dim: int):
    """The register layout of a widened ``[keys, head_dim]`` FP8 tile: each warp a quarter of
    the rows, a lane 8 consecutive elements of a row (an 8-byte load of the 128-byte-swizzled
    FP8 rows, a 16-byte store into the float16 tiles, neither with bank conflicts), a warp's
    32 lanes over ``256 // head_dim`` whole rows."""
    tiling = plgpu.Tiling(
        ((keys, head_dim), (keys // 4, head_dim), (256 // head_dim, head_dim), (8,))
    )
    return plgpu.Layout.TILED(tiling, warp_dims=(-7,), lane_dims=(-3, -2), vector_dim=-1)


def split_refs(refs, n_inputs: int, fp8: bool):
    """A kernel's refs with the factors' ref (None without FP8) after its ``n_inputs``
    other inputs."""
    refs = list(refs)
    if not fp8:
        refs.insert(n_inputs, None)
    return refs


def layout_ops(interpret: bool):
    """(cast, iota): a register-layout cast and an int32 iota in the WGMMA layout (plain jnp
    in interpret mode, which has no register layouts)."""
    if interpret:
        cast = lambda x, _layout: x  # noqa: E731
        iota = lambda shape, dim: lax.broadcasted_iota(jnp.int32, shape, dim)  # noqa: E731
        return cast, iota

    def iota(shape, dim):
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)

    return plgpu.layout_cast, iota


def pad_to(x, axis: int, multiple: int):
    """``x`` zero-padded along ``axis`` to a multiple of ``multiple`` (a copy moves a multiple
    of 128 bytes: int32 / f32 vectors go in multiples of 32)."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


COPY_ELEMS = 256  # an async copy moves at most 256 elements along each dimension


def vector_copies(n: int) -> int:
    """How many copies :func:`copy_vector` issues for ``n`` elements."""
    return -(-n // COPY_ELEMS)


def copy_vector(src, start, dst, barrier):
    """``dst[:] = src[start : start + len(dst)]`` (a 1-D int32 / f32 window of a multiple of
    32 elements) in copies of at most 256 elements, each arriving on ``barrier``, which takes
    :func:`vector_copies` arrivals."""
    n = dst.shape[0]
    for i in range(0, n, COPY_ELEMS):
        size = min(COPY_ELEMS, n - i)
        plgpu.copy_gmem_to_smem(src.at[pl.ds(start + i, size)], dst.at[pl.ds(i, size)], barrier)


def slab(ref, page, head, bshd: bool):
    """Page ``page``'s ``[page_size, head_dim]`` slab of KV head ``head``: a strided box of the
    bshd pool, a contiguous one of bhsd."""
    return ref.at[page, :, head, :] if bshd else ref.at[page, head]


EXPERIMENTS_ENV = "JAXATTN_MGPU_EXPERIMENTS"
EXPERIMENTS = ("copy_warp", "unmasked_steps")


def experiment(name: str, interpret: bool) -> bool:
    """Whether the Mosaic GPU decode kernels (paged decode, the cascade's levels) run the
    experiment ``name``, one of :data:`EXPERIMENTS` listed in ``JAXATTN_MGPU_EXPERIMENTS``
    (comma-separated; read when a kernel is traced). Off by default: on an H200 neither changed
    the decode's time at batch 8 x 4096, 64 x 4096 or 64 x 256 by more than the noise (1%);
    the cascade's prefix tiles, one block a multiprocessor, are yet to be timed with them.

    * ``copy_warp``: the page rings' copies issued from one warp. Mosaic GPU puts a
      warpgroup barrier before every copy a warpgroup issues (eight a 64-key step of
      16-token pages, on the compute warpgroup's path in the one-warpgroup kernel); from one
      warp a refill takes one barrier before and one after. Compiled kernels only.
    * ``unmasked_steps``: the steps whose keys all lie below the partition's length run
      without the logits' mask (a loop of their own), the last, partial one with it."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown Mosaic GPU experiment {name!r}: one of {EXPERIMENTS}")
    listed = {x.strip().lower() for x in os.environ.get(EXPERIMENTS_ENV, "").split(",")}
    return name in listed and not (interpret and name == "copy_warp")


def issue_step(
    ref, ring, bars, i, *, page_of, head, bshd, pages_per_step, page_size, stages, warp=False
):
    """Copies step ``i``'s pages (``page_of(c)``: the ``c``-th page, already clamped into the
    pool) of KV head ``head`` in ``ref`` into slot ``i % stages`` of ``ring``, each copy
    arriving on that slot's barrier. ``warp``: issued from the warpgroup's first warp
    (:func:`experiment` ``copy_warp``; the page ids are read before, in warpgroup
    semantics)."""
    slot = lax.rem(i, stages)
    pages = [page_of(i * pages_per_step + j) for j in range(pages_per_step)]

    def copies():
        for j, page in enumerate(pages):
            rows = pl.ds(j * page_size, page_size)
            plgpu.copy_gmem_to_smem(slab(ref, page, head, bshd), ring.at[slot, rows], bars.at[slot])

    if warp:
        plgpu.warp_map(lambda w: pl.when(w == 0)(copies))
    else:
        copies()


class PageRing:
    """The K and V page rings' copies of one kernel: ``k`` and ``v`` are (cache ref, ring,
    barriers) triples; the rest is :func:`issue_step`'s. ``prologue`` issues the first
    ``stages`` steps (those below ``n_steps``), ``refill(ring, i)`` step ``i + stages`` into
    the slot step ``i`` has just read, ``issue(i)`` step ``i`` of both rings."""

    def __init__(
        self, k, v, n_steps, *, page_of, head, bshd, pages_per_step, page_size, stages,
        warp=False,
    ):  # fmt: skip
        self.k, self.v, self.n_steps, self.stages = k, v, n_steps, stages
        self.kw = dict(
            page_of=page_of, head=head, bshd=bshd, pages_per_step=pages_per_step,
            page_size=page_size, stages=stages, warp=warp,
        )  # fmt: skip

    def issue(self, i):
        issue_step(*self.k, i, **self.kw)
        issue_step(*self.v, i, **self.kw)

    def prologue(self):
        for i in range(self.stages):
            pl.when(self.n_steps > i)(functools.partial(self.issue, i))

    def refill(self, ring, i):
        @pl.when(i + self.stages < self.n_steps)
        def _():
            issue_step(*ring, i + self.stages, **self.kw)


def tiled():
    """The shared-memory transforms of the wgmma operands: 8 x 64 tiles, 128-byte swizzle."""
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def initial_state(cast, head_dim: int):
    """(acc, running max, sum) of 64 rows. The max starts finite (M_INIT), as in the Triton
    kernels: a row with no key keeps alpha = 1 and p = 0, and a merge sees a finite max."""
    m_i = cast(jnp.full((ROWS,), C.M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = cast(jnp.full((ROWS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc = cast(jnp.full((ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    return acc, m_i, l_i


def ring_step(
    i,
    slot,
    state,
    *,
    q_smem,
    k_smem,
    v_smem,
    k_bars,
    v_bars,
    keys: int,
    scale,
    soft_cap,
    iota,
    visible,
    n_keys,
    k_read,
    v_read,
    interpret: bool,
    wide=None,
    factor=None,
    prewidened: bool = False,
):
    """One step of the ring (``keys`` keys in ring slot ``slot``) folded into ``state`` =
    (acc, max, sum): waits for the step's K, S = q K^T, ``k_read()`` (K's slot may be
    refilled), logits in base 2 kept where ``visible(key [64, keys])`` (None: all), the
    online softmax, waits for V, zeroes V's rows at or past ``n_keys`` in a step that crosses
    it (copied whole: a page's tail, pages past the keys), O += P V, ``v_read()``.

    FP8 rings (``wide`` = float16 (K, V) tiles of one step): each step's codes are widened
    into them (every FP8 value is exact in float16; V's rows past ``n_keys`` become zeros
    there) and the ring's slot is released right after; q is float16 then, and the raw
    scores are multiplied by ``factor`` (the KV head's key scale over q's power-of-two
    factor) before the logits are formed. ``prewidened``: ``k_smem`` / ``v_smem`` are the
    float16 tiles another warpgroup widened (:func:`widen_step`; V masked), ``k_bars`` /
    ``v_bars`` the barriers they are widened behind, ``k_read()`` / ``v_read()`` their
    releases (after S and after P V); ``factor`` as for ``wide``."""
    acc, m_i, l_i = state
    dtype = q_smem.dtype
    head_dim = v_smem.shape[-1]
    if prewidened:  # float16 tiles another warpgroup widened (V masked)
        k_tile, v_tile = k_smem, v_smem
        plgpu.barrier_wait(k_bars)
    elif wide is None:
        plgpu.barrier_wait(k_bars.at[slot])
        k_tile = k_smem.at[slot]
    else:
        plgpu.barrier_wait(k_bars.at[slot])
        k_tile, v_tile = wide
        k_tile[...] = widened(k_smem, slot, dtype, interpret)
        plgpu.commit_smem()
        k_read()

    def qk(ref):
        plgpu.wgmma(ref, q_smem, k_tile.transpose((1, 0)))
        return ref[...]

    if interpret:
        s = jnp.dot(q_smem[...], k_tile[...].T, preferred_element_type=jnp.float32)
    else:
        s = pl.run_scoped(qk, plgpu.ACC((ROWS, keys), jnp.float32))
    if wide is None:
        k_read()
    if factor is not None:
        s = s * factor
    s = C.scores_base2(s, scale=scale, soft_cap=soft_cap)
    if visible is not None:  # None: every key of the step is visible to every row
        s = jnp.where(visible(iota((ROWS, keys), 1) + i * keys), s, -jnp.inf)
    m_new = jnp.maximum(m_i, s.max(axis=1))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    if prewidened:
        plgpu.barrier_wait(v_bars)
    elif wide is None:
        plgpu.barrier_wait(v_bars.at[slot])
        v_tile = v_smem.at[slot]

        @pl.when((i + 1) * keys > n_keys)
        def _():
            rows = iota((keys, head_dim), 0)
            keep = rows < n_keys - i * keys
            v_smem[slot] = jnp.where(keep, v_smem[slot], jnp.zeros((keys, head_dim), dtype))
            plgpu.commit_smem()

    elif wide is not None:
        plgpu.barrier_wait(v_bars.at[slot])
        v_tile[...] = widened(v_smem, slot, dtype, interpret, n_keys=n_keys - i * keys)
        plgpu.commit_smem()
        v_read()

    p16 = p.astype(dtype)

    def pv(ref):
        plgpu.wgmma(ref, p16, v_tile)

    if interpret:
        acc = acc + jnp.dot(p16, v_tile[...], preferred_element_type=jnp.float32)
    else:  # accumulated in place: no second accumulator's registers
        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
    if wide is None:
        v_read()
    return acc, m_new, l_i


PDL_ENV = "JAXATTN_MGPU_PDL"


def dependent_launch(interpret: bool) -> None:
    """Programmatic dependent launch, at a kernel's start (every thread, before it reads any
    global memory): let the next kernel on the stream launch its blocks now, so that they
    are resident and waiting when this one ends (the launch and the blocks' start no longer
    sit between the two kernels), then wait until the kernel before this one has ended and
    its writes are visible. The next kernel's blocks launch only once every block of this
    one has started, so they never take a multiprocessor this one still needs. Both
    instructions are no-ops where the kernel was not launched dependent (jax 0.10's Mosaic
    GPU runtime sets the launch attribute for no kernel; jax 0.11's for every kernel that
    uses them). The Mosaic GPU decode (its split partitions, the cascade's two levels) and
    its merges call it, so a merge's launch overlaps the partitions' tail. That takes the two
    kernels launched on one stream: XLA traces each custom call it puts in a command buffer
    into a graph of its own, where the launch has nothing to depend on. On an H200 (decode at
    batch 64, 8 and 1, the cascade's batches) the timings with it and without it differed by
    no more than their noise (2% at batch 64, the one row not host-bound).
    Not in interpret mode, which has no such instructions; ``JAXATTN_MGPU_PDL=0`` (read when
    a kernel is traced) leaves it out."""
    if interpret or switched_off(PDL_ENV):
        return
    plgpu.griddepcontrol_launch_dependents()
    plgpu.griddepcontrol_wait()


def launch_params(interpret: bool) -> dict:
    """plgpu.kernel's keywords: interpret mode, or the compiled kernel's parameters."""
    if interpret:
        return dict(interpret=InterpretGPUParams())
    return dict(compiler_params=plgpu.CompilerParams(approx_math=True))
