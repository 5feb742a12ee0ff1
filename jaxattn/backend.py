"""The backend contract: every attention op is an :class:`Op` with implementations.

An :class:`Op` (``jaxattn.ops.PAGED_ATTENTION``, ...) owns the public signature of one
operation. :meth:`Op.bind` validates the arguments into a typed record (static facts only:
ranks, shapes, dtypes, layouts, attribute values; index *values* too when they are
concrete), so it runs at trace time under ``jax.jit`` before any kernel is built. One
:class:`Implementation` per backend then runs it:

* ``supports(args) -> reason | None`` says whether this backend serves these arguments
  (``None``) or why not;
* ``config_cls`` is the backend's frozen configuration dataclass (tiles, split sizes,
  kernel choice), ``heuristic_config(args)`` the configuration it picks from the shapes and
  the device when the caller gives none;
* ``run(args, config)`` computes.

:meth:`Op.resolve` picks the implementation (``implementation=`` None, a backend name, or a
sequence of names tried in order) and its configuration; the op call, the engine's step
builder and the sharded ops all ask it, so a backend is chosen one way everywhere. A backend
named alone never falls back: it raises ``NotImplementedError`` with its reason. ``None``
tries the fast backends of the platform (:func:`default_implementations`) and always ends
with the reference, which serves everything.

Backends live in ``jaxattn.<name>`` modules (``reference`` in :mod:`jaxattn.ops`) and
expose ``IMPLEMENTATIONS: dict[op name, Implementation]``; they are imported on first use,
so a backend whose dependencies are missing only becomes unavailable.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import checkify

BACKENDS = ("reference", "pallas", "native")

# Fastest first; the reference closes every list. On the CPU the Pallas kernels would run
# in the (slow) interpreter and the native C++ handlers are single-threaded, so the
# reference (XLA) goes alone.
_DEFAULT_ORDER = {
    "gpu": ("native", "pallas", "reference"),
    "cuda": ("native", "pallas", "reference"),
    "rocm": ("native", "pallas", "reference"),
    "cpu": ("reference",),
}


def default_implementations(platform: str | None = None) -> tuple[str, ...]:
    """The backends ``implementation=None`` tries, in order, on ``platform`` (default: the
    current default backend). The reference is always last."""
    platform = jax.default_backend() if platform is None else platform
    return _DEFAULT_ORDER.get(platform, ("reference",))


class Implementation:
    """One backend's implementation of one op (see the module docstring)."""

    backend: ClassVar[str]
    config_cls: ClassVar[type | None] = None

    def available(self, platform: str) -> str | None:
        """Why this implementation cannot run on ``platform`` at all, or None."""
        return None

    def supports(self, args) -> str | None:
        """Why these (validated) arguments are not served, or None."""
        return None

    def heuristic_config(self, args):
        """The configuration used when the caller gives none."""
        return None if self.config_cls is None else self.config_cls()

    def run(self, args, config):
        raise NotImplementedError

    def check_config(self, config) -> None:
        if self.config_cls is None:
            if config is not None:
                raise TypeError(f"the {self.backend} backend takes no config, got {config!r}")
        elif not isinstance(config, self.config_cls):
            raise TypeError(
                f"config for the {self.backend} backend must be a "
                f"{self.config_cls.__module__}.{self.config_cls.__qualname__}, got {config!r}"
            )


class KernelImplementation(Implementation):
    """A kernel backend's implementation: ``function`` takes the op's public signature in
    the kernels' form (:meth:`jaxattn.ops.PagedArgs.kernel_call` and its siblings) plus
    ``config=``."""

    function: ClassVar[Callable[..., Any]]

    def run(self, args, config):
        positional, keywords = args.kernel_call()
        return self.function(*positional, **keywords, config=config)


class Resolved(NamedTuple):
    """The outcome of :meth:`Op.resolve`: which backend runs, and with what config."""

    backend: str
    implementation: Implementation
    config: Any


def _backend_module(name: str):
    module = "jaxattn.ops" if name == "reference" else f"jaxattn.{name}"
    try:
        return importlib.import_module(module)
    except ImportError as e:  # a backend whose dependencies are missing cannot serve
        raise NotImplementedError(f"backend {name!r} cannot be imported: {e}") from e


def candidates(implementation) -> tuple[tuple[str, ...], bool]:
    """(backend names to try, whether the caller named exactly one)."""
    if implementation is None:
        return default_implementations(), False
    if isinstance(implementation, str):
        names, explicit = (implementation,), True
    elif isinstance(implementation, Sequence) and implementation:
        names, explicit = tuple(implementation), False
    else:
        raise TypeError(
            f"implementation must be None, a backend name or a non-empty sequence of "
            f"names from {BACKENDS}, got {implementation!r}"
        )
    for name in names:
        if name not in BACKENDS:
            raise ValueError(f"implementation must name backends from {BACKENDS}, got {name!r}")
    return names, explicit


class Op:
    """One public attention op: validation (:meth:`bind`), resolution, dispatch.

    Subclasses set ``name`` and implement :meth:`bind` (returning the op's argument
    record) and ``roles`` (how tensor parallelism splits each positional argument: ``"q"``
    split on its head axis, ``"k"`` / ``"v"`` a KV cache split on its KV-head axis,
    ``None`` replicated).
    """

    name: ClassVar[str]
    roles: ClassVar[tuple[str | None, ...]]

    def bind(self, *args, **kwargs):
        raise NotImplementedError

    def implementation(self, backend: str) -> Implementation:
        """The ``backend``'s implementation of this op (``NotImplementedError`` if none)."""
        impls = getattr(_backend_module(backend), "IMPLEMENTATIONS", {})
        if self.name not in impls:
            raise NotImplementedError(f"backend {backend!r} has no {self.name}")
        return impls[self.name]

    def implementations(self) -> dict[str, Implementation]:
        """Every importable backend's implementation of this op."""
        out = {}
        for name in BACKENDS:
            try:
                out[name] = self.implementation(name)
            except NotImplementedError:
                continue
        return out

    def resolve(self, args, implementation=None, config=None, *, platform=None) -> Resolved:
        """Pick the implementation and configuration for validated ``args``.

        ``config`` given with ``implementation=None`` selects the backend whose
        ``config_cls`` it is an instance of. Raises ``NotImplementedError`` (with every
        backend's reason) when nothing tried can serve.
        """
        if config is not None and implementation is None:
            names = [
                n
                for n, impl in self.implementations().items()
                if impl.config_cls is not None and isinstance(config, impl.config_cls)
            ]
            if not names:
                raise TypeError(
                    f"config {config!r} is no backend's config for {self.name}; pass "
                    f"implementation= as well or a config of one of {BACKENDS}"
                )
            implementation = names[0]
        names, explicit = candidates(implementation)
        platform = jax.default_backend() if platform is None else platform
        reasons = []
        for name in names:
            try:
                impl = self.implementation(name)
                reason = impl.available(platform) or impl.supports(args)
            except NotImplementedError as e:
                reason = str(e)
            if reason is None:
                if config is None:
                    cfg = impl.heuristic_config(args)
                else:
                    impl.check_config(config)
                    cfg = config
                return Resolved(name, impl, cfg)
            if explicit:
                raise NotImplementedError(f"{name} cannot serve {self.name}: {reason}")
            reasons.append(f"{name}: {reason}")
        raise NotImplementedError(
            f"no backend in {names} can serve {self.name}: " + "; ".join(reasons)
        )

    def problems(self, args) -> list:
        """The index checks of the memory-safety contract, as
        :class:`jaxattn.reference.validity.Problem` s (ok arrays and messages)."""
        return []

    def trivial(self, args):
        """The result when an input has a zero-size dimension (no sequences, no rows, an
        empty table): there is nothing for a kernel to do, and every backend answers the
        spec's result. None otherwise."""
        return None

    def run(self, args, implementation=None, config=None, *, debug_checks=None):
        resolved = self.resolve(args, implementation, config)
        if checks_enabled() if debug_checks is None else debug_checks:
            for p in self.problems(args):
                ok = jnp.atleast_1d(p.ok)
                index = jnp.argmin(ok)  # the first failing sequence
                checkify.check(jnp.all(ok), p.message, index=index)
        out = self.trivial(args)
        if out is not None:
            return out
        return resolved.implementation.run(args, resolved.config)

    def __call__(self, *args, implementation=None, config=None, debug_checks=None, **kwargs):
        return self.run(
            self.bind(*args, **kwargs), implementation, config, debug_checks=debug_checks
        )


# --- the checked mode ---------------------------------------------------------------------

_CHECKS = contextvars.ContextVar("jaxattn_debug_checks", default=False)


def checks_enabled() -> bool:
    """Whether ops traced now emit their index checks (inside :func:`checked`)."""
    return _CHECKS.get()


@contextlib.contextmanager
def _checking():
    token = _CHECKS.set(True)
    try:
        yield
    finally:
        _CHECKS.reset(token)


def checked(fn, *, jit: bool = True):
    """``fn`` with the index checks of every jaxattn op inside it turned into errors.

    Under ``jax.jit`` an out-of-range page id, length or indptr cannot be seen before a
    kernel runs, so by contract it only poisons the rows of its sequence with NaN. The
    checked function instead raises ``checkify.JaxRuntimeError`` naming the argument and
    the sequence (e.g. ``block_tables[1] holds a page outside [0, 32) ...``), the way the
    eager checks do. It is built on :mod:`jax.experimental.checkify`: the ops emit
    ``checkify.check`` calls while ``fn`` is traced (each op also takes
    ``debug_checks=True`` for use inside one's own ``checkify``), and the result is
    compiled with ``jax.jit`` unless ``jit=False``.

    Pass the plain Python function: a function already jitted and traced elsewhere
    would reuse its unchecked trace.
    """

    def traced_with_checks(*args, **kwargs):
        with _checking():
            return fn(*args, **kwargs)

    run = checkify.checkify(traced_with_checks)
    if jit:
        run = jax.jit(run)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        err, out = run(*args, **kwargs)
        err.throw()
        return out

    return wrapper


def split_kv_partition(
    *,
    batch: int,
    num_kv_heads: int,
    group: int,
    capacity: int,
    target_blocks: float,
    grow: bool,
    one_pass_blocks: int | None = None,
    min_partition: int = 128,
    wave: float | None = None,
) -> int:
    """Tokens per split-KV partition of a decode grid of (sequence, KV head, partition)
    blocks; 0 means one pass.

    From a base of 512 tokens (256 when a KV head serves more than 15 query heads: more
    query rows hold more registers, so a block should cover fewer tokens), the partition
    grows (``grow``) while the grid of twice as long partitions still has
    ``target_blocks``, then halves (down to ``min_partition``) while it has fewer. Fewer,
    longer partitions pay fewer pipeline fills and a smaller combine, as long as every
    multiprocessor has work. ``one_pass_blocks``: with at least this many (sequence,
    KV head) pairs, or a context within the base, the grid is full without splitting.
    Each backend passes its kernels' occupancy as ``target_blocks``; ``wave`` (the resident
    blocks of one wave, with ``grow``): a grid that would spill past one wave is cut into
    twice as long partitions when those still fill half a wave (the blocks of a second,
    mostly empty wave would take as long as the first).
    """
    size = 256 if group > 15 else 512
    pairs = batch * num_kv_heads
    if one_pass_blocks is not None and (capacity <= size or pairs >= one_pass_blocks):
        return 0

    def blocks(s):
        return pairs * -(-capacity // s)

    if grow:
        while 2 * size < capacity and blocks(2 * size) >= target_blocks:
            size *= 2
    while size > min_partition and blocks(size) < target_blocks:
        size //= 2
    if (
        grow
        and wave
        and blocks(size) > wave
        and 2 * size < capacity
        and blocks(2 * size) >= wave / 2
    ):
        size *= 2
    return size


# --- cascade decode: how the prefix level is cut into blocks ---------------------------------
#
# A prefix *tile* holds up to ``per_tile`` requests that continue one prefix (their query heads
# of one KV head are the rows of the kernel's dots); prefix g with n_g requests takes
# ceil(n_g / per_tile) tiles. Each tile's prefix is further split into partitions of about
# equal length, one block each. The split depends on how many tiles the batch really has, a
# value only the device knows (``prefix_of`` is traced), so it is decided there, by the same
# integer rule in both kernel backends (:func:`cascade_splits`, :func:`cascade_chunk`; the
# native kernels repeat it in ``ffi/include/jaxattn/cascade.h``); the host fixes only the grid
# and the workspace (:func:`cascade_grid`). Partitions are multiples of CASCADE_STEP tokens
# (the kernels' key tile) and, unless the prefix is shorter, at least CASCADE_MIN_CHUNK: each
# one adds a state per query row to the merge.

CASCADE_STEP = 64
CASCADE_MIN_CHUNK = 256


def cascade_prefix_tiles(*, batch: int, num_prefixes: int, per_tile: int) -> int:
    """Upper bound on the prefix tiles of a batch: B requests over at most min(G, B) prefixes
    take at most ceil(B / per_tile) + min(G, B) - 1 tiles, and never more than B."""
    if batch == 0 or num_prefixes == 0:
        return 0
    return min(batch, -(-batch // per_tile) + min(num_prefixes, batch) - 1)


@dataclasses.dataclass(frozen=True)
class CascadeGrid:
    """The static side of a cascade call's prefix level.

    tiles: upper bound on the prefix tiles (:func:`cascade_prefix_tiles`);
    target: prefix blocks wanted in all (the split aims at it);
    blocks_per_head: prefix blocks per KV head in the grid, enough for every tile unsplit
      and for the tiles x splits :func:`cascade_splits` picks for any real tile count;
      blocks past those exit at once;
    max_splits: workspace parts reserved per query row for prefix partitions.
    """

    tiles: int
    target: int
    blocks_per_head: int
    max_splits: int


def cascade_grid(
    *,
    batch: int,
    num_prefixes: int,
    per_tile: int,
    num_kv_heads: int,
    prefix_capacity: int,
    own_blocks: int,
    slots: int,
    target: int | None = None,
) -> CascadeGrid:
    """The prefix level's grid for a kernel whose tiles take ``per_tile`` requests.

    The own level's ``own_blocks`` are memory bound; a prefix block is a dot of many query
    rows, compute bound. Unless ``target`` is given, the prefix level aims at one block per
    multiprocessor beside the own level (``slots``: resident blocks of the kernel, two per
    multiprocessor), and at all the slots the own level leaves empty.
    """
    tiles = cascade_prefix_tiles(batch=batch, num_prefixes=num_prefixes, per_tile=per_tile)
    if target is None:
        target = max(1, slots // 2, slots - own_blocks)
    # Room for the split of any real tile count up to ``tiles`` (cascade_splits rounds half
    # up, so tiles x splits can pass target / num_kv_heads by half the tiles).
    per_head = max(tiles, -(-target // num_kv_heads) + (tiles + 1) // 2) if tiles else 0
    max_splits = max(1, min(-(-prefix_capacity // CASCADE_MIN_CHUNK), max(per_head, 1)))
    return CascadeGrid(tiles, target, per_head, max_splits)


def cascade_splits(tiles, *, target: int, num_kv_heads: int, blocks_per_head: int, max_splits: int):
    """Partitions per prefix for a batch of ``tiles`` real tiles (an int, or a traced int32
    array): ``target / (num_kv_heads * tiles)`` rounded half up, within [1, max_splits] and
    within the grid's ``blocks_per_head // tiles``."""
    if isinstance(tiles, jax.Array):
        t = jnp.maximum(tiles, 1)
        s = (2 * target + num_kv_heads * t) // (2 * num_kv_heads * t)
        return jnp.clip(jnp.minimum(s, blocks_per_head // t), 1, max_splits).astype(jnp.int32)
    t = max(tiles, 1)
    s = (2 * target + num_kv_heads * t) // (2 * num_kv_heads * t)
    return max(1, min(s, blocks_per_head // t, max_splits))


def cascade_chunk(prefix_len, splits):
    """Tokens per partition of a prefix of ``prefix_len`` tokens cut into up to ``splits``
    (ints or int32 arrays): equal parts rounded up to CASCADE_STEP, none shorter than
    CASCADE_MIN_CHUNK unless the prefix is. The prefix then has ceil(len / chunk) partitions
    (0 for an empty one)."""
    if isinstance(prefix_len, jax.Array) or isinstance(splits, jax.Array):
        s = jnp.clip(jnp.minimum(splits, prefix_len // CASCADE_MIN_CHUNK), 1, None)
        chunk = (prefix_len + s - 1) // s
        return jnp.maximum(CASCADE_STEP, (chunk + CASCADE_STEP - 1) // CASCADE_STEP * CASCADE_STEP)
    s = max(1, min(splits, prefix_len // CASCADE_MIN_CHUNK))
    chunk = -(-prefix_len // s)
    return max(CASCADE_STEP, -(-chunk // CASCADE_STEP) * CASCADE_STEP)


def replace(args, **changes):
    """A copy of an argument record with some fields replaced (e.g. a shard's arrays)."""
    return dataclasses.replace(args, **changes)
