"""The model runner: the KV pool, the decode rows and the jitted programs, on the device.

A step (:class:`StepWork`, built by the engine from the scheduler's plan) runs up to four
programs, enqueued back to back without waiting for any of them:

* ``copy``   - copy-on-write page copies (after a fork), every layer at once;
* ``update`` - decode rows (re)initialised and block-table entries sent (only what changed);
* ``extend`` - prefill chunks of any number of requests, each after its cached prefix; a
  chunk that ends a prompt writes its drawn token into the sequence's decode row;
* ``decode`` - up to ``decode_steps`` decode steps of every active row in one
  ``lax.while_loop``: KV write, paged attention, sampling and stop checks on the device;
  with cascade levels (:mod:`jaxattn.engine.cascade`), cascade attention instead, the rows
  that share a prefix reading it once (a program of its own).

Decode rows are metadata that lives on the device (:class:`DecodeState`): per row the
token to feed next, its position, the tokens it may still draw, its sampling parameters,
stop ids and block table. A decode step reads nothing from the host but the row mask and
the step count; the tokens come back only as the program's output, copied to the host
asynchronously, so the host can plan the next step while this one runs. A row stops on
the device when it draws a stop token, a non-finite row (:data:`NON_FINITE`) or its last
allowed token; it then writes nothing and attends to nothing.

Extend and decode are separate programs rather than one mixed batch: their shapes vary
independently (new tokens, KV length and requests for one; rows and table width for the
other), so two programs compile ``|extend shapes| + |decode shapes|`` variants where a
fused one would compile their product. Every shape is rounded up to a power of two (with a
floor), so a long generation compiles O(log) programs; :attr:`ModelRunner.trace_counts`
counts them. The caches and the decode rows' state are donated to every program that
takes them and updated in place: besides the memory, that keeps their buffers at the same
addresses from one call to the next, so that on GPUs XLA's command buffers (CUDA graphs)
replay as recorded instead of being updated for new addresses on every call, which cost
the host about half of a decode dispatch (``benchmarks/RESULTS.md``, round 22). The jitted
programs are module level, keyed on the model and the attention choices, so every engine
of one model reuses the programs another engine compiled.

Tensor parallelism (``mesh=``): the parameters are placed Megatron-style and the pool is
created split by KV head (:mod:`jaxattn.sharding`); the programs take the
:class:`~jaxattn.sharding.TensorParallel` as one more static argument and hand it to the
model as its ``kernels``, so attention and KV writes run per device on its own heads. The
metadata (block tables, slots, indptrs, decode rows) is replicated, the same on 1 or N
devices.

A quantised pool (``kv_dtype``, e.g. FP8): the pool is allocated in that dtype, and the
scales (``kv_scales``, f32 ``[num_layers, num_kv_heads]`` each for K and V) go to the
device once, one array a layer, replicated; every extend and decode batch carries them, and
the model passes layer ``l``'s to ``write_kv`` and to the attention op (under tensor
parallelism the ops' sharded wrappers split each with the KV heads). Scales are traced operands, so
other values reuse the compiled programs.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import math
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import backend as _backend
from jaxattn import kv as _kv
from jaxattn import layout as _layout
from jaxattn import ops
from jaxattn import sharding as _sharding
from jaxattn.kv import copy_blocks
from jaxattn.models.llama import DecodeBatch, ExtendBatch
from jaxattn.paging import token_slots
from jaxattn.paging.slots import range_slots

from . import scheduler
from .config import (
    KV_WRITE_CHOICES,
    PALLAS_DECODE_LOWERINGS,
    Buckets,
    bucket,
    check_kv_scales,
    kv_cache_dtype,
)
from .sampling import sample, sample_keys

__all__ = [
    "NON_FINITE",
    "NO_TOKEN",
    "DecodeRows",
    "PageUpload",
    "DecodeState",
    "DecodeWork",
    "ExtendItem",
    "ModelRunner",
    "RowUpdates",
    "StepOutput",
    "StepWork",
]

# The token id a step returns for a row whose logits are not finite.
NON_FINITE = -1
# What a decode step returns for a row that did not run (inactive or already stopped).
NO_TOKEN = scheduler.NO_TOKEN


# --- host-side records ---------------------------------------------------------------


class ExtendItem(NamedTuple):
    """A chunk ``[start, end)`` of a sequence whose first ``start`` tokens are cached.

    ``samples``: ``(seed, uid, temperature, top_p)`` per token to draw from the logits of
    the chunk's last row (empty for a chunk that does not finish the prompt); the key of a
    draw is ``(seed, uid, end)`` (see :mod:`jaxattn.engine.sampling`). ``rows``: per
    sample, the decode row the drawn token is written to (-1: none).
    """

    tokens: np.ndarray  # i32[end - start]
    start: int
    end: int
    table: np.ndarray  # i32 pages holding positions [0, end)
    samples: tuple = ()
    rows: tuple = ()


class RowUpdates(NamedTuple):
    """Decode rows to (re)initialise and block-table entries to set, before anything runs.

    ``rows i32[U]``; ``ints i32[U, 5 + S]``: token, position, tokens it may draw, seed,
    uid, then ``S`` stop ids (-1 padding); ``floats f32[U, 2]``: temperature, top_p;
    ``cells i32[C, 3]``: ``(row, column, page)`` table entries.
    """

    rows: np.ndarray
    ints: np.ndarray
    floats: np.ndarray
    cells: np.ndarray


class DecodeWork(NamedTuple):
    """A decode dispatch: ``steps`` steps (at most) of ``active`` rows among the first
    ``num_rows``, with block tables ``width`` pages wide; ``greedy`` when no active row
    samples. ``levels`` (a :class:`~jaxattn.engine.cascade.CascadeLevels` over the
    ``num_rows`` rows): run cascade decode, the rows continuing its prefixes."""

    rows: np.ndarray  # i32[n] the row of each decoding sequence, in plan order
    num_rows: int
    width: int
    steps: int
    greedy: bool
    counts: np.ndarray | None = None  # device paging: slots each row's table grows by
    levels: Any = None  # cascade decode: the rows' CascadeLevels (None: paged decode)


class PageUpload(NamedTuple):
    """The host's pages as a :class:`~jaxattn.paging.PageTable` over the decode rows
    (device paging): the allocator's ref counts and free stack, each row's table."""

    ref_counts: np.ndarray  # i32[N]
    free_stack: np.ndarray  # i32[N], -1 above the top
    num_free: int
    tables: np.ndarray  # i32[R, W], -1 past each table
    lens: np.ndarray  # i32[R] slots each row's table provides
    active: np.ndarray  # bool[R]


@dataclasses.dataclass
class StepWork:
    """Everything one step runs, in order: copies, row updates, extend, decode (with the
    page table sent first when ``pages`` is set)."""

    copies: list = dataclasses.field(default_factory=list)
    updates: RowUpdates | None = None
    extend: list = dataclasses.field(default_factory=list)
    decode: DecodeWork | None = None
    pages: PageUpload | None = None


class StepOutput(NamedTuple):
    """``extend_tokens i32[>= draws]`` in sample order; ``decode_tokens i32[K, rows]``
    (row ``r`` of the step in column ``r``; :data:`NO_TOKEN` where it did not run)."""

    extend_tokens: np.ndarray
    decode_tokens: np.ndarray | None


_NO_PAGES = np.zeros(0, np.int32)


class DecodeRows:
    """The host's record of the device's decode rows: which sequence each row serves,
    which table entries the device holds, and the updates the next step must send.

    Rows are handed out lowest first, so the rows in use stay packed at the front and a
    step runs over as few rows as its sequences need.
    """

    def __init__(self, capacity: int, width: int, stop_width: int, *, tables: bool = True):
        self.capacity, self.width, self.stop_width = capacity, width, stop_width
        self.tables = tables  # False: the device grows the tables itself (device paging)
        self._free = list(range(capacity))
        self._seq: list[Any] = [None] * capacity
        self._uploaded: dict[int, np.ndarray] = {}  # i32 entries the device holds, per row
        self._inits: dict[int, tuple] = {}
        self._cells: list[np.ndarray] = []  # i32[k, 3] (row, column, page) blocks
        self.version = 0  # counts assignments and releases

    def __len__(self) -> int:
        return self.capacity - len(self._free)

    def assign(self, seq, *, token: int, position: int, remaining: int, table) -> int:
        """Give ``seq`` a row starting at ``token`` (at ``position``), allowed
        ``remaining`` more tokens; its whole table is sent."""
        if seq.row is not None:
            raise RuntimeError(f"seq {seq.seq_id} already has row {seq.row}")
        if not self._free:
            raise RuntimeError(f"all {self.capacity} decode rows are in use")
        if len(table) > self.width:
            raise ValueError(f"a table of {len(table)} pages exceeds the rows' {self.width}")
        row = heapq.heappop(self._free)
        self._seq[row] = seq
        seq.row = row
        stop = sorted(seq.stop_ids)[: self.stop_width]
        stop += [-1] * (self.stop_width - len(stop))
        ints = (int(token), int(position), int(remaining), int(seq.seed), int(seq.sample_id))
        self._inits[row] = (ints + tuple(stop), (float(seq.temperature), float(seq.top_p)))
        self._uploaded[row] = _NO_PAGES
        self.sync_table(seq, table)
        self.version += 1
        return row

    def release(self, seq) -> None:
        row = seq.row
        if row is None:
            return
        assert self._seq[row] is seq, f"row {row} does not serve seq {seq.seq_id}"
        self._seq[row] = None
        self._inits.pop(row, None)
        self._uploaded.pop(row, None)
        seq.row = None
        heapq.heappush(self._free, row)
        self.version += 1

    def seq(self, row: int):
        return self._seq[row]

    def sync_table(self, seq, table, start: int = 0) -> None:
        """Queue the entries from ``start`` on of ``seq``'s row that differ from the
        device's (the entries before ``start`` are known to be unchanged)."""
        row = seq.row
        if row is None:
            return
        if len(table) > self.width:
            raise ValueError(f"a table of {len(table)} pages exceeds the rows' {self.width}")
        table = np.asarray(table, np.int32).reshape(-1)
        if not self.tables:
            self._uploaded[row] = table
            return
        # Numpy per row, not per entry: a new row sends its whole table (tens of pages),
        # a grown one the entries from ``start`` on that differ from the device's.
        have = self._uploaded[row]
        cols = np.arange(start, len(table), dtype=np.int32)
        if len(have) > start:
            n = min(len(have), len(table))
            same = np.zeros(len(cols), bool)
            same[: max(n - start, 0)] = have[start:n] == table[start:n]
            cols = cols[~same]
        if len(cols):
            cells = np.empty((len(cols), 3), np.int32)
            cells[:, 0], cells[:, 1], cells[:, 2] = row, cols, table[cols]
            self._cells.append(cells)
        self._uploaded[row] = table

    def table(self, row: int) -> list[int]:
        """The entries the device holds (after the queued updates)."""
        return self._uploaded[row].tolist()

    def take_updates(self) -> RowUpdates | None:
        if not self._inits and not self._cells:
            return None
        rows = np.fromiter(self._inits, np.int32, len(self._inits))
        ints = np.asarray([v[0] for v in self._inits.values()], np.int32)
        floats = np.asarray([v[1] for v in self._inits.values()], np.float32)
        cells = np.concatenate(self._cells) if self._cells else np.zeros((0, 3), np.int32)
        self._inits, self._cells = {}, []
        return RowUpdates(
            rows,
            ints.reshape(len(rows), 5 + self.stop_width),
            floats.reshape(len(rows), 2),
            cells,
        )


# --- device-side state and programs --------------------------------------------------


class DecodeState(NamedTuple):
    """The decode rows on the device (``R`` rows, tables ``W`` pages wide)."""

    tokens: jax.Array  # i32[R] the token each row feeds next
    positions: jax.Array  # i32[R] its position
    remaining: jax.Array  # i32[R] tokens the row may still draw (0: stopped)
    seeds: jax.Array  # i32[R]
    uids: jax.Array  # i32[R]
    temperature: jax.Array  # f32[R]
    top_p: jax.Array  # f32[R]
    stop: jax.Array  # i32[R, S] stop ids, -1 padding
    tables: jax.Array  # i32[R, W] block tables (layer-0 page ids)


def init_decode_state(rows: int, width: int, stop_width: int) -> DecodeState:
    zeros = lambda *shape, dt=jnp.int32: jnp.zeros(shape, dt)
    return DecodeState(
        tokens=zeros(rows),
        positions=zeros(rows),
        remaining=zeros(rows),
        seeds=zeros(rows),
        uids=zeros(rows),
        temperature=zeros(rows, dt=jnp.float32),
        top_p=jnp.ones((rows,), jnp.float32),
        stop=jnp.full((rows, stop_width), -1, jnp.int32),
        tables=zeros(rows, width),
    )


class SampleBatch(NamedTuple):
    seeds: jax.Array
    uids: jax.Array
    positions: jax.Array
    temperature: jax.Array
    top_p: jax.Array


def _pad(values, n: int, fill, dtype=np.int32) -> np.ndarray:
    out = np.full(n, fill, dtype)
    values = np.asarray(values, dtype)
    out[: len(values)] = values
    return out


def _draw(logits, samples: SampleBatch, greedy: bool):
    """The drawn token of every row, or :data:`NON_FINITE` where the row's logits are not all
    finite (NaN or inf in the weights, the inputs or the cache): such a row yields no token,
    never a plausible one."""
    keys = sample_keys(samples.seeds, samples.uids, samples.positions)
    tokens = sample(logits, keys, samples.temperature, samples.top_p, greedy=greedy)
    return jnp.where(jnp.all(jnp.isfinite(logits), axis=-1), tokens, NON_FINITE)


def _stops(tokens, stop_ids):
    """bool[R]: the row drew one of its stop ids or no token at all."""
    return jnp.any(tokens[:, None] == stop_ids, axis=1) | (tokens == NON_FINITE)


def _keep_split(tp, layout, k, v):
    """Pin the returned caches to the split they came in with: the donated input buffers
    can then be reused in place, and the next step needs no resharding."""
    if tp is None:
        return k, v
    ks, vs = tp.kv_cache_shardings(layout)
    return jax.lax.with_sharding_constraint(k, ks), jax.lax.with_sharding_constraint(v, vs)


def _extend_fn(
    params, k, v, state, batch, samples, sample_rows, updates=None, *, model, options, greedy, tp
):
    if updates is not None:  # the step's row updates (ModelRunner.launch), first
        state = _update_fn(state, *updates)
    logits, k, v = model.forward_extend(params, k, v, batch, kernels=tp, **options)
    tokens = _draw(logits, samples, greedy)
    # Prompts that end here start decoding from their row: the drawn token (and whether it
    # already stops the sequence) goes straight into the row, never through the host.
    num_rows = state.tokens.shape[0]
    rows = jnp.where(sample_rows >= 0, sample_rows, num_rows)
    safe = jnp.clip(rows, 0, num_rows - 1)
    stopped = _stops(tokens, state.stop[safe])
    state = state._replace(
        tokens=state.tokens.at[rows].set(tokens, mode="drop"),
        remaining=state.remaining.at[rows].set(
            jnp.where(stopped, 0, state.remaining[safe]), mode="drop"
        ),
    )
    return tokens, *_keep_split(tp, options["layout"], k, v), state


def _grow_tables(k, v, pages, entries, *, num_layers, num_pages, layout, tp):
    """Device paging: grow the listed rows' tables (``entries``: rows, then slot counts)
    and copy the shared tails they write to, in every layer."""
    pages, cow, _ = pages.append_slots_batch(entries[0], entries[1])
    offsets = (jnp.arange(num_layers, dtype=jnp.int32) * num_pages)[:, None]
    src = jnp.where(cow[None, :, 0] >= 0, cow[None, :, 0] + offsets, 0).reshape(-1)
    dst = jnp.where(cow[None, :, 1] >= 0, cow[None, :, 1] + offsets, -1).reshape(-1)
    copy = copy_blocks if tp is None else tp.copy_blocks
    k, v = copy(k, v, src, dst, layout=layout)
    return k, v, pages


def _decode_fn(
    params,
    k,
    v,
    state,
    control,
    pages,
    entries,
    levels=None,
    scales=None,
    updates=None,
    *,
    model,
    options,
    num_rows,
    width,
    max_steps,
    page_size,
    greedy,
    tp,
):
    """Up to ``control[0]`` decode steps of the rows ``control[1:] != 0`` among the first
    ``num_rows``; a row stops at a stop token, a non-finite row or its last allowed token,
    and the loop when every row stopped. Returns the tokens ``i32[max_steps, num_rows]``
    (:data:`NO_TOKEN` where a row did not run), the caches, the state and the page table.

    With device paging (``pages`` a :class:`~jaxattn.paging.PageTable` over the rows) the
    tables grow here first and are read from it; otherwise from the rows' own tables.

    ``levels`` (``prefix_rows i32[G]``, ``prefix_lens i32[G]``, ``prefix_of
    i32[num_rows]``, or None): cascade decode. Prefix ``g`` is the first ``prefix_lens[g]``
    tokens' pages of row ``prefix_rows[g]``'s table; the prefixes are constant over the
    steps (they hold only pages full before the first one); each row's own level is its
    table shifted past its prefix's pages, computed once before the loop.

    ``scales`` (``(k_scale, v_scale)`` f32 ``[num_layers, num_kv_heads]``, or None): the
    scales of a quantised pool, handed to the model in every step's batch.

    ``updates`` (:func:`_update_fn`'s ``rows, ints, floats, cells``, or None): row updates
    applied first (:meth:`ModelRunner.launch` folds a step's small updates into its first
    program instead of dispatching them alone).
    """
    if updates is not None:
        state = _update_fn(state, *updates)
    steps, active = control[0], control[1:] != 0
    rows = jax.tree.map(lambda x: x[:num_rows], state)
    if pages is None:
        tables = rows.tables[:, :width]
    else:
        k, v, pages = _grow_tables(
            k,
            v,
            pages,
            entries,
            num_layers=model.num_hidden_layers,
            num_pages=pages.num_blocks,
            layout=options["layout"],
            tp=tp,
        )
        tables = pages.block_tables(jnp.arange(num_rows, dtype=jnp.int32))[:, :width]
    capacity = width * page_size
    if levels is not None:
        prefix_rows, prefix_lens, prefix_of = levels
        prefix_tables = tables[jnp.clip(prefix_rows, 0, num_rows - 1)]
        g = jnp.clip(prefix_of, 0, prefix_tables.shape[0] - 1)
        row_prefix = jnp.where(prefix_of >= 0, prefix_lens[g], 0)
        cols = jnp.arange(width, dtype=jnp.int32)[None, :] + (row_prefix // page_size)[:, None]
        own_tables = jnp.take_along_axis(tables, jnp.clip(cols, 0, width - 1), axis=1)

    def cond(carry):
        i, _, _, live_rows, _ = carry
        return (i < steps) & jnp.any(active & (live_rows.remaining > 0))

    def body(carry):
        i, k, v, r, out = carry
        live = active & (r.remaining > 0)
        pos = r.positions
        inside = jnp.clip(pos, 0, capacity - 1)
        batch = DecodeBatch(
            tokens=r.tokens,
            positions=pos,
            slot_mapping=jnp.where(live, token_slots(tables, inside, page_size), -1),
            block_tables=tables,
            seq_lens=jnp.where(live, pos + 1, 0),
        )
        if scales is not None:
            batch = batch._replace(k_scale=scales[0], v_scale=scales[1])
        if levels is not None:
            # A row continues its prefix when it runs and the prefix lies before the
            # token it writes (the host built it so); otherwise it reads its whole table.
            cont = live & (prefix_of >= 0) & (pos >= row_prefix)
            batch = batch._replace(
                block_tables=jnp.where(cont[:, None], own_tables, tables),
                seq_lens=jnp.where(cont, batch.seq_lens - row_prefix, batch.seq_lens),
                prefix_tables=prefix_tables,
                prefix_lens=prefix_lens,
                prefix_of=jnp.where(cont, prefix_of, -1),
            )
        logits, k, v = model.forward_decode(params, k, v, batch, kernels=tp, **options)
        samples = SampleBatch(r.seeds, r.uids, pos + 1, r.temperature, r.top_p)
        tokens = _draw(logits, samples, greedy)
        stopped = _stops(tokens, r.stop) | (r.remaining <= 1)
        r = r._replace(
            tokens=jnp.where(live, tokens, r.tokens),
            positions=jnp.where(live, pos + 1, pos),
            remaining=jnp.where(live, jnp.where(stopped, 0, r.remaining - 1), r.remaining),
        )
        out = out.at[i].set(jnp.where(live, tokens, NO_TOKEN))
        return i + 1, k, v, r, out

    out = jnp.full((max_steps, num_rows), NO_TOKEN, jnp.int32)
    _, k, v, rows, out = jax.lax.while_loop(cond, body, (jnp.int32(0), k, v, rows, out))
    state = jax.tree.map(
        lambda whole, part: jax.lax.dynamic_update_slice_in_dim(whole, part, 0, axis=0),
        state,
        rows,
    )
    return out, *_keep_split(tp, options["layout"], k, v), state, pages


def _update_fn(state, rows, ints, floats, cells):
    put = lambda x, values: x.at[rows].set(values, mode="drop")
    return state._replace(
        tokens=put(state.tokens, ints[:, 0]),
        positions=put(state.positions, ints[:, 1]),
        remaining=put(state.remaining, ints[:, 2]),
        seeds=put(state.seeds, ints[:, 3]),
        uids=put(state.uids, ints[:, 4]),
        stop=put(state.stop, ints[:, 5:]),
        temperature=put(state.temperature, floats[:, 0]),
        top_p=put(state.top_p, floats[:, 1]),
        tables=state.tables.at[cells[:, 0], cells[:, 1]].set(cells[:, 2], mode="drop"),
    )


def _copy_fn(k, v, src, dst, *, layout, tp=None):
    if tp is None:
        return copy_blocks(k, v, src, dst, layout=layout)
    return _keep_split(tp, layout, *tp.copy_blocks(k, v, src, dst, layout=layout))


# Traces per program kind, over every runner: the jitted programs are module level, so
# engines of one model share their compiled programs (the static arguments are the model
# and the attention choices; the shapes come from the buckets).
_TRACES: collections.Counter = collections.Counter()


def _counted(kind: str, fn):
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        _TRACES[kind] += 1  # the body runs once per trace, i.e. per compiled variant
        return fn(*args, **kwargs)

    return traced


# --- host arrays packed into one transfer ----------------------------------------------
# A jitted call sends each numpy argument to the device by itself: on an H200's host that
# measured ~35 us an array inside the call (0.57 ms for the extend program with its 17
# arrays already on the device, 1.16 ms with them as numpy arguments). The step programs
# therefore take a step's host arrays packed into one int32 and one float32 buffer, cut
# apart again at the start of the program (static offsets: the shapes are the buckets').


def pack_host(tree) -> tuple[tuple, tuple]:
    """``tree``'s numpy leaves packed: ``((ints i32[n], floats f32[m], others), layout)``,
    ``others`` its other leaves (device arrays), ``layout`` (hashable, static) what
    :func:`unpack_host` needs to rebuild ``tree``. Integer and bool leaves travel as int32
    (ids, counts and flags here all fit), float32 ones as float32."""
    leaves, treedef = jax.tree.flatten(tree)
    ints, floats, others, spec = [], [], [], []
    n_int = n_float = 0
    for x in leaves:
        if isinstance(x, np.ndarray) and x.dtype.kind in "iub" and x.dtype.itemsize <= 4:
            spec.append(("i", x.shape, x.dtype.str, n_int))
            ints.append(x.reshape(-1))
            n_int += x.size
        elif isinstance(x, np.ndarray) and x.dtype == np.float32:
            spec.append(("f", x.shape, x.dtype.str, n_float))
            floats.append(x.reshape(-1))
            n_float += x.size
        else:
            spec.append(("d", None, None, len(others)))
            others.append(x)
    ints = np.concatenate(ints).astype(np.int32, copy=False) if ints else None
    floats = np.concatenate(floats) if floats else None
    return (ints, floats, tuple(others)), (treedef, tuple(spec))


def unpack_host(ints, floats, others, layout):
    """The tree :func:`pack_host` packed (inside the program: slices of the buffers)."""
    treedef, spec = layout
    leaves = []
    for kind, shape, dtype, at in spec:
        if kind == "d":
            leaves.append(others[at])
            continue
        buf = ints if kind == "i" else floats
        size = math.prod(shape)
        leaves.append(buf[at : at + size].reshape(shape).astype(np.dtype(dtype)))
    return jax.tree.unflatten(treedef, leaves)


def _packed(fn):
    """``fn(params, k, v, state, *args, **statics)`` taking ``args`` as :func:`pack_host`'s
    buffers and layout."""

    def run(params, k, v, state, ints, floats, others, *, layout, **statics):
        return fn(params, k, v, state, *unpack_host(ints, floats, others, layout), **statics)

    run.__name__ = run.__qualname__ = f"{fn.__name__}_packed"  # not wraps: jit reads the signature
    return run


# Donated: the caches and the rows' state (see the module docstring). The step programs
# take their host arrays packed (above).
_EXTEND = jax.jit(
    _counted("extend", _packed(_extend_fn)),
    donate_argnums=(1, 2, 3),
    static_argnames=("model", "options", "greedy", "tp", "layout"),
)
_DECODE_STATICS = (
    "model",
    "options",
    "num_rows",
    "width",
    "max_steps",
    "page_size",
    "greedy",
    "tp",
    "layout",
)
_DECODE = jax.jit(
    _counted("decode", _packed(_decode_fn)),
    donate_argnums=(1, 2, 3),
    static_argnames=_DECODE_STATICS,
)
# The decode program with its while loop as a command buffer (ExecutionConfig.decode_graph):
# XLA's default command-buffer kinds plus WHILE and CONDITIONAL, so that the multistep loop
# is one CUDA graph (conditional nodes) instead of a loop whose predicate the host reads every
# iteration, which keeps the dispatch from returning before the loop ends. Ignored off GPUs.
DECODE_GRAPH_COMMANDS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
_DECODE_GRAPH = jax.jit(
    _counted("decode", _packed(_decode_fn)),
    donate_argnums=(1, 2, 3),
    static_argnames=_DECODE_STATICS,
    compiler_options={"xla_gpu_enable_command_buffer": DECODE_GRAPH_COMMANDS},
)
_UPDATE = jax.jit(_counted("update", _update_fn), donate_argnums=(0,))
_COPY = jax.jit(_counted("copy", _copy_fn), donate_argnums=(0, 1), static_argnames=("layout", "tp"))


def _pallas_triton_missing(implementation) -> bool:
    """Whether ``implementation`` tries the Pallas backend first and that backend runs without
    its Triton lowering here (then only its Mosaic GPU kernels serve: no token-pool extend,
    the Mosaic GPU decode)."""
    names, _ = _backend.candidates(implementation)
    if names[0] != "pallas":
        return False
    from ..pallas import _triton

    return _triton.missing() is not None


def _decode_graph(choice: bool | None, platform: str) -> bool:
    """Whether the decode program's loop is a command buffer (see
    :class:`~jaxattn.engine.ExecutionConfig`): None is on with CUDA GPUs."""
    if choice is not None:
        return bool(choice)
    if platform not in ("gpu", "cuda"):
        return False
    from jaxattn import native

    return native._platform() == "cuda"


def _decode_linear(choice: str, platform: str, tp, model) -> str:
    """``"pad"``, ``"native"``, ``"hybrid"`` or ``"xla"``: who runs the decode step's
    projections (see :class:`~jaxattn.engine.ExecutionConfig`; ``"native"`` or ``"hybrid"``
    asked for where the native kernel cannot run is an error). ``"auto"`` is XLA's dot, a
    one-row step padded to two rows on GPUs."""
    if choice == "auto":
        return "xla" if platform == "cpu" else "pad"
    if choice == "xla":
        return "xla"
    from jaxattn import native

    dtype = np.dtype(model.jnp_dtype)
    why = None
    if tp is not None:
        why = "tensor parallelism runs the projections through XLA"
    elif not native.is_available():
        why = "the native library is not available"
    elif platform != "cpu" and dtype not in native.LINEAR_GPU_DTYPES:
        why = f"the GPU linear kernel takes bfloat16 or float16 weights, not {dtype}"
    if why is not None:
        raise ValueError(f"decode_linear={choice!r}: {why}")
    return choice


class _Options(dict):
    """Static attention options, hashable so that jit can key programs on them."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))


def step_options(
    *,
    layout: str,
    extend_attention: str,
    partition_size: int | None,
    backends: dict,
    decode_config=None,
    kv_write: str,
    decode_linear: str,
    fused_rope: bool,
    fused_norm: bool,
    split_k,
) -> dict[str, _Options]:
    """The static options of each step kind's forward (``"extend"``, ``"decode"``,
    ``"cascade"``), from resolved choices: ``backends`` maps each kind to its attention
    backend, ``decode_config`` is the Pallas decode's configuration (None: the op's own
    per batch). :class:`ModelRunner` builds its steps with them; so may a tool that
    compiles the engine's programs without a runner."""
    fused = {"fused_rope": True} if fused_rope else {}
    if fused_norm:
        fused["fused_norm"] = True
    # Decode steps only: a prefill's projections have rows enough to need no split.
    split = {"split_k": split_k} if split_k else {}
    linear = {} if decode_linear == "xla" else {"linear": decode_linear}
    config = {} if decode_config is None else {"config": decode_config}
    return {
        "extend": _Options(
            layout=layout,
            attention=extend_attention,
            implementation=backends["extend"],
            kv_write=kv_write,
            **fused,
        ),
        "decode": _Options(
            layout=layout,
            partition_size=partition_size,
            implementation=backends["decode"],
            **config,
            kv_write=kv_write,
            **linear,
            **fused,
            **split,
        ),
        "cascade": _Options(
            layout=layout,
            implementation=backends["cascade"],
            kv_write=kv_write,
            **linear,
            **fused,
            **split,
        ),
    }


class ModelRunner:
    """Runs the steps of one model over one paged KV pool and its decode rows.

    Args:
      model: the model (:class:`~jaxattn.engine.model.CausalLM`), e.g. a ``LlamaConfig``.
      params: its parameters (split per layer with ``model.serving_params``).
      num_pages, page_size: pages per layer and tokens per page.
      layout: pool layout (``"bshd"``, ``"bhsd"`` or ``"vllm"``).
      extend_attention: ``"extend"`` (SGLang token-pool form, bshd only) or
        ``"prefix_prefill"`` (paged form); None picks ``"extend"`` for bshd.
      implementation: attention backend name, or None for the fastest one that serves
        the platform; resolved once per step kind, and reported in :attr:`backends`.
      partition_size: split-KV partition for decode (None: the backend's choice).
      buckets: shape bucket floors.
      mesh: a 1-D :class:`jax.sharding.Mesh` (axis ``"tp"``, see
        :func:`jaxattn.sharding.make_mesh`) to run tensor-parallel over; None for one
        device. Its size must divide the query and KV head counts and the MLP width.
      max_rows: decode rows (sequences decoding at once).
      stop_width: stop ids a row can hold.
      decode_steps: the most decode steps one dispatch runs.
      unroll_layers: straight-line layers (None: on GPUs; see
        :class:`~jaxattn.engine.ExecutionConfig`).
      decode_graph: compile the decode program's loop as a command buffer (None: on with
        CUDA GPUs; :class:`~jaxattn.engine.ExecutionConfig`); the program is
        :attr:`decode_program`.
      decode_linear: ``"auto"``, ``"native"``, ``"hybrid"`` or ``"xla"``: the decode step's
        projections (:class:`~jaxattn.engine.ExecutionConfig`); the choice (``"pad"`` for auto
        on GPUs) is in :attr:`decode_linear`.
      kv_write: ``"auto"``, ``"native"`` or ``"reference"``: who stores each step's K/V
        (:func:`jaxattn.write_kv`'s backend; :class:`~jaxattn.engine.ExecutionConfig`; auto:
        the fastest that serves one device, XLA's scatters under a mesh); the backend it
        resolved to is in :attr:`kv_write`.
      fused_rope: rotate q, k and store K/V in one pass a layer (:func:`jaxattn.rope_write_kv`
        with the ``kv_write`` backend, split over the mesh with one; None: where that backend
        is the native kernel on one device; :class:`~jaxattn.engine.ExecutionConfig`); the
        choice is in :attr:`fused_rope`.
      fused_norm: each residual add and its RMSNorm in one native kernel
        (:func:`jaxattn.native.add_rms_norm`; only when True; see
        :class:`~jaxattn.engine.ExecutionConfig`); the choice is in :attr:`fused_norm`.
      split_k: None / False, True or an int: the decode step's projections before the
        ``fused_rope`` / ``fused_norm`` kernels hand them split-K partial sums (see
        :class:`~jaxattn.engine.ExecutionConfig`); the choice is in :attr:`split_k`.
      pallas_decode_lowering: ``"triton"`` or ``"mosaic_gpu"``: the Pallas decode kernel's
        lowering in every decode step when the decode backend is ``"pallas"``; None: Triton
        where this JAX has that lowering (:class:`~jaxattn.engine.ExecutionConfig`); the
        lowering is in :attr:`lowerings`.
      kv_dtype: the pool's dtype: None (the model's) or an FP8 format
        (``CacheConfig.kv_dtype``: ``"fp8_e4m3"`` / ``"fp8_e5m2"`` or the dtype).
      kv_scales: None or ``(k_scales, v_scales)``, f32 ``[num_layers, num_kv_heads]``:
        the pool's per-layer, per-KV-head scales (None: 1.0).

    :attr:`trace_counts` counts the programs this runner's calls compiled (a program
    another runner of the same model compiled already is reused, not counted).
    """

    def __init__(
        self,
        model,
        params,
        *,
        num_pages: int,
        page_size: int,
        layout: str = "bshd",
        extend_attention: str | None = None,
        implementation: str | None = None,
        partition_size: int | None = None,
        buckets: Buckets | None = None,
        mesh=None,
        max_rows: int = 64,
        stop_width: int = 1,
        decode_steps: int = 8,
        unroll_layers: bool | None = None,
        decode_linear: str = "auto",
        decode_graph: bool | None = None,
        kv_write: str = "auto",
        fused_rope: bool | None = None,
        fused_norm: bool | None = None,
        split_k: bool | int | None = None,
        pallas_decode_lowering: str | None = None,
        kv_dtype=None,
        kv_scales=None,
    ):
        no_triton = _pallas_triton_missing(implementation)
        if extend_attention is None:
            extend_attention = "extend" if layout == "bshd" else "prefix_prefill"
            if no_triton:  # no Pallas kernel reads a token pool without the Triton lowering
                extend_attention = "prefix_prefill"
        if pallas_decode_lowering is None:
            pallas_decode_lowering = "mosaic_gpu" if no_triton else "triton"
        if pallas_decode_lowering not in PALLAS_DECODE_LOWERINGS:
            raise ValueError(
                f"pallas_decode_lowering must be one of {PALLAS_DECODE_LOWERINGS}, "
                f"got {pallas_decode_lowering!r}"
            )
        if extend_attention not in ("extend", "prefix_prefill"):
            raise ValueError(
                f"extend_attention must be 'extend' or 'prefix_prefill', got {extend_attention!r}"
            )
        if extend_attention == "extend" and layout != "bshd":
            raise ValueError(
                f"extend_attention='extend' needs layout='bshd' (a token pool), got {layout!r}"
            )
        self.tp = None if mesh is None else _sharding.TensorParallel(mesh)
        self.model = model
        self.cfg = model
        self.num_pages = num_pages
        self.page_size = page_size
        self.layout = layout
        self.extend_attention = extend_attention
        self.partition_size = partition_size
        self.buckets = buckets or Buckets()
        self.max_rows = bucket(max_rows)
        self.stop_width = max(1, stop_width)
        self.decode_steps = decode_steps
        # A sequence never holds more pages than the pool or its positions need.
        max_pos = int(getattr(model, "max_position_embeddings", num_pages * page_size))
        self.table_width = min(num_pages, -(-max_pos // page_size))
        # The pool's dtype (the model's unless a quantised one is asked for) and scales.
        self.kv_dtype = kv_cache_dtype(kv_dtype, model.jnp_dtype)
        dtype = {} if self.kv_dtype == np.dtype(model.jnp_dtype) else {"dtype": self.kv_dtype}
        init = functools.partial(model.init_kv_cache, num_pages, page_size, layout=layout, **dtype)
        scales = None
        if kv_scales is not None:
            # CacheConfig's checks (finite, positive, one 2-D shape), then the model's shape.
            want = (model.num_hidden_layers, model.num_key_value_heads)
            scales = tuple(np.asarray(s, np.float32) for s in check_kv_scales(kv_scales))
            for name, s in zip(("k_scales", "v_scales"), scales, strict=True):
                if s.shape != want:
                    raise ValueError(
                        f"CacheConfig.kv_scales: {name} must be float32 [num_layers, "
                        f"num_kv_heads] = {list(want)} for this model, got {list(s.shape)}"
                    )
        state = init_decode_state(self.max_rows, self.table_width, self.stop_width)
        platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
        self.unroll_layers = platform != "cpu" if unroll_layers is None else unroll_layers
        if self.tp is None:
            self.params = model.serving_params(params, unroll=self.unroll_layers)
            self.k_cache, self.v_cache = init()
        else:
            self.params = model.serving_params(
                self.tp.shard_params(params, model), shards=self.tp.size, unroll=self.unroll_layers
            )
            # Built split, so that no device ever holds the whole pool.
            self.k_cache, self.v_cache = self.tp.init_kv_cache(init, layout=layout)
            state = jax.device_put(state, self.tp.replicated())
        self.state = state
        # Sent once; every step passes the same device arrays: one a layer (for K and for V),
        # so that each layer's kernels take a whole buffer, not a slice XLA would copy (two
        # small kernels a layer in a GPU step).
        sharding = None if self.tp is None else self.tp.replicated()
        self.kv_scales = None
        if scales is not None:
            self.kv_scales = jax.device_put(tuple(tuple(s) for s in scales), sharding)
        # Device paging: the pages as a PageTable over the decode rows (sent by the host
        # whenever something other than a decode step changed them).
        self.pages = None
        self._no_updates = None  # the all-padding row updates, built once (_folded_updates)
        # Steps whose row updates rode with their first program / were dispatched alone.
        self.update_counts: collections.Counter = collections.Counter(folded=0, alone=0)
        self.trace_counts: collections.Counter = collections.Counter()
        self._last_greedy = True
        resolved = {k: self._resolve(k, implementation) for k in ("extend", "decode")}
        decode = resolved["decode"]
        pallas_decode = decode.backend == "pallas"
        if pallas_decode and decode.config.lowering != pallas_decode_lowering:
            # The Pallas decode runs one lowering in every decode step, whatever the step's
            # batch (the op alone takes the Mosaic GPU kernel for head_dim 128 and tables of
            # at least 1024 tokens). Triton by default: with the Mosaic GPU kernel the engine's
            # decode programs measured slower (benchmarks/RESULTS.md, round 33: 8804 against
            # 9383 generated tok/s, 1b preset, head_dim 64, where the op alone measured it
            # slower too, round 34); head_dim 128 in the engine was not measured with it.
            config = dataclasses.replace(decode.config, lowering=pallas_decode_lowering)
            resolved["decode"] = decode._replace(config=config)
        self.backends = {k: r.backend for k, r in resolved.items()}
        # The Pallas kernels' lowering each step kind resolves to ("triton", "mosaic_gpu";
        # None for backends without one).
        self.lowerings = {k: getattr(r.config, "lowering", None) for k, r in resolved.items()}
        # JAX's interpreter of Mosaic GPU kernels (jax 0.10 and 0.11) fails or hangs in the
        # step programs over several CPU devices: an assertion on a barrier left allocated,
        # or a callback that never returns.
        interpreted_tp = self.tp is not None and self.tp.size > 1 and platform == "cpu"
        mosaic = [k for k, lowering in self.lowerings.items() if lowering == "mosaic_gpu"]
        if interpreted_tp and mosaic:
            raise NotImplementedError(
                f"the {' and '.join(mosaic)} steps would interpret Mosaic GPU kernels in a "
                f"program over {self.tp.size} CPU devices, where JAX's interpreter fails or "
                "hangs; "
                "use one device, implementation='reference', or the Triton lowering "
                "(pallas_decode_lowering='triton', where this JAX has it)"
            )
        # Cascade decode's backend (None: none serves this pool; decode stays paged). The
        # spec is no cascade kernel: it serves only where the decode steps run the spec too
        # (a kernel backend's paged decode is not traded for XLA's attention).
        try:
            cascade = self._resolve("cascade", implementation)
            self.cascade_backend = cascade.backend
            if interpreted_tp and getattr(cascade.config, "lowering", None) == "mosaic_gpu":
                self.cascade_backend = None
            if cascade.backend == "reference" and self.backends["decode"] != "reference":
                self.cascade_backend = None
        except (NotImplementedError, ValueError, TypeError):
            self.cascade_backend = None
        self.decode_linear = _decode_linear(decode_linear, platform, self.tp, model)
        self.kv_write = self._resolve_write(kv_write)
        self.fused_rope = self._resolve_fused_rope(fused_rope)
        self.fused_norm = self._resolve_fused_norm(fused_norm, platform)
        self.split_k = self._resolve_split_k(split_k)
        # The jitted decode program (the command-buffer variant with decode_graph).
        self.decode_graph = _decode_graph(decode_graph, platform)
        self.decode_program = _DECODE_GRAPH if self.decode_graph else _DECODE
        self._options = step_options(
            layout=layout,
            extend_attention=extend_attention,
            partition_size=partition_size,
            backends=dict(self.backends, cascade=self.cascade_backend),
            # Pallas: the configuration resolved above (stats say its lowering) in every
            # decode step, whatever the step's batch.
            decode_config=resolved["decode"].config if pallas_decode else None,
            kv_write=self.kv_write,
            decode_linear=self.decode_linear,
            fused_rope=self.fused_rope,
            fused_norm=self.fused_norm,
            split_k=self.split_k,
        )
        # Host-side costs of launching steps: bytes and time of the metadata sent, time in
        # the jitted calls (which return before the device is done).
        self.timing = collections.Counter(h2d_bytes=0, h2d_s=0.0, dispatch_s=0.0)

    @property
    def tp_size(self) -> int:
        """Devices the model is split over (1 without a mesh)."""
        return 1 if self.tp is None else self.tp.size

    @property
    def kv_bytes(self) -> int:
        """Bytes of the whole pool, over all devices."""
        return self.k_cache.nbytes + self.v_cache.nbytes

    @property
    def kv_bytes_per_device(self) -> int:
        """Bytes of the pool the most loaded device holds (``kv_bytes / tp_size`` when the
        split is even)."""
        held: collections.Counter = collections.Counter()
        for cache in (self.k_cache, self.v_cache):
            for shard in cache.addressable_shards:
                held[shard.device] += shard.data.nbytes
        return max(held.values())

    def _pool_structs(self):
        """The pool as one device sees it, as shape/dtype structs for the ops' resolvers:
        ``(geometry, k_cache, v_cache, scales)``, scales the ``k_scale`` / ``v_scale``
        keywords (f32 ``[Hkv]`` structs with a scaled pool, else None)."""
        cfg, tp = self.model, self.tp_size
        hkv, d = cfg.num_key_value_heads // tp, cfg.head_dim
        sds, kv_dt = jax.ShapeDtypeStruct, self.kv_dtype
        lay = _layout.get(self.layout)
        geom = _layout.CacheGeometry(self.num_pages * cfg.num_hidden_layers, self.page_size, hkv, d)
        k, v = sds(lay.shape("k", geom, kv_dt), kv_dt), sds(lay.shape("v", geom, kv_dt), kv_dt)
        scale = sds((hkv,), jnp.float32) if self.kv_scales is not None else None
        return geom, k, v, {"k_scale": scale, "v_scale": scale}

    @property
    def _mesh_platform(self) -> str | None:
        """The mesh's platform for the resolvers (None without a mesh: the default one)."""
        return None if self.tp is None else self.tp.mesh.devices.flat[0].platform

    def _resolve_write(self, choice: str) -> str:
        """The backend of :func:`jaxattn.write_kv` for this pool (``choice``: ``"auto"`` or
        a backend name, which must serve it)."""
        if choice not in KV_WRITE_CHOICES:
            raise ValueError(f"kv_write must be one of {KV_WRITE_CHOICES}, got {choice!r}")
        geom, k, v, scales = self._pool_structs()
        row = jax.ShapeDtypeStruct((1, geom.num_kv_heads, geom.head_dim), self.model.jnp_dtype)
        slots = jax.ShapeDtypeStruct((1,), jnp.int32)
        args = _kv.WRITE_KV.bind(k, v, row, row, slots, layout=self.layout, **scales)
        implementation = None if choice == "auto" else choice
        if choice == "auto" and self.tp is not None:
            implementation = "reference"  # the native write is not measured under a mesh
        return _kv.WRITE_KV.resolve(args, implementation, platform=self._mesh_platform).backend

    def _resolve_fused_rope(self, choice: bool | None) -> bool:
        """Whether each layer rotates and stores its K/V in one pass (``choice``: None for
        where the write backend is the native kernel on one device, or a bool)."""
        if choice is False:
            return False
        if choice is None and (self.kv_write != "native" or self.tp is not None):
            return False
        # What one device sees (under a mesh its share of the heads, as the write resolves).
        geom, k, v, scales = self._pool_structs()
        cfg = self.model
        hq = cfg.num_attention_heads // self.tp_size
        qkv = jax.ShapeDtypeStruct((1, hq + 2 * geom.num_kv_heads, geom.head_dim), cfg.jnp_dtype)
        table = jax.ShapeDtypeStruct((1, geom.head_dim // 2), jnp.float32)
        slots = jax.ShapeDtypeStruct((1,), jnp.int32)
        args = _kv.ROPE_WRITE_KV.bind(qkv, table, table, k, v, slots, layout=self.layout, **scales)
        try:
            _kv.ROPE_WRITE_KV.resolve(args, self.kv_write, platform=self._mesh_platform)
        except NotImplementedError:
            if choice:
                raise
            return False
        return True

    def _resolve_fused_norm(self, choice: bool | None, platform: str) -> bool:
        """Whether each residual add and its norm run as one native kernel: only when
        ``choice`` is True (None, the default, is off: not faster on an H200), which then
        needs one device, straight-line layers and the native library."""
        if not choice:
            return False
        if self.tp is not None:
            why = "it runs on one device, not under a mesh"
        elif not self.unroll_layers:
            why = "it needs straight-line layers (unroll_layers)"
        else:
            from jaxattn import native

            row = jax.ShapeDtypeStruct((1, self.model.hidden_size), self.model.jnp_dtype)
            weight = jax.ShapeDtypeStruct((self.model.hidden_size,), self.model.jnp_dtype)
            if not native.is_available():
                why = "the native library is not available"
            else:
                why = native.add_rms_norm_unsupported(row, row, weight, platform)
        if why is not None:
            raise ValueError(f"fused_norm=True: {why}")
        return True

    def _resolve_split_k(self, choice):
        """The ``split_k`` the decode steps run with (False: off), or a ValueError saying why
        the choice cannot run."""
        if choice is None or choice is False:
            return False
        why = None
        if self.tp is not None:
            why = "it runs on one device, not under a mesh"
        elif not (self.fused_rope or self.fused_norm):
            why = "it needs fused_rope or fused_norm (the kernels that sum the partials)"
        elif self.decode_linear not in ("xla", "pad"):
            why = f"it splits XLA's dot, not decode_linear={self.decode_linear!r}"
        if why is not None:
            raise ValueError(f"split_k={choice!r}: {why}")
        return choice

    def _resolve(self, kind: str, implementation):
        """The backend and configuration the attention op of this step kind resolves to (the
        op's own resolver, :meth:`jaxattn.backend.Op.resolve`, on the shapes one device
        sees)."""
        geom, k, v, scales = self._pool_structs()
        hkv, d, kv_dt = geom.num_kv_heads, geom.head_dim, self.kv_dtype
        sds, i32 = jax.ShapeDtypeStruct, jnp.int32
        q = sds((1, self.model.num_attention_heads // self.tp_size, d), self.model.jnp_dtype)
        if kind == "cascade":
            op = ops.CASCADE_ATTENTION
            args = op.bind(
                q,
                k,
                v,
                sds((1, 1), i32),
                sds((1,), i32),
                sds((1,), i32),
                sds((1, 1), i32),
                sds((1,), i32),
                layout=self.layout,
                **scales,
            )
        elif kind == "decode":
            op = ops.PAGED_ATTENTION
            args = op.bind(
                q,
                k,
                v,
                sds((1, 1), i32),
                sds((1,), i32),
                layout=self.layout,
                partition_size=self.partition_size,
                **scales,
            )
        elif self.extend_attention == "extend":
            op = ops.EXTEND_ATTENTION
            pool = sds((geom.num_pages * geom.page_size, hkv, d), kv_dt)
            args = op.bind(q, pool, pool, sds((2,), i32), sds((2,), i32), sds((1,), i32), **scales)
        else:
            op = ops.PREFIX_PREFILL
            args = op.bind(
                q,
                k,
                v,
                sds((2,), i32),
                sds((1, 1), i32),
                sds((1,), i32),
                layout=self.layout,
                **scales,
            )
        return op.resolve(args, implementation, platform=self._mesh_platform)

    # -- transfers and calls ---------------------------------------------------------------

    def _put(self, *arrays, keep: bool = False):
        """A call's host arrays, counted. Without a mesh they stay numpy arrays, and the jitted
        call that takes them sends them itself, in C++ as it dispatches: per array that is
        about a tenth of the host time of ``jax.device_put`` from Python, which measured
        ~0.4 ms for a step's 15 small arrays on a CPU. Over a mesh, and with ``keep`` (arrays
        that later calls reuse), they are sent here, replicated over the mesh; time counted
        in ``h2d_s``."""
        self.timing["h2d_bytes"] += sum(a.nbytes for a in arrays)
        if self.tp is None and not keep:
            return arrays
        t0 = time.perf_counter()
        sharding = None if self.tp is None else self.tp.replicated()
        out = jax.device_put(arrays, sharding)
        self.timing["h2d_s"] += time.perf_counter() - t0
        return out

    def _call(self, kind, program, *args, **statics):
        before = _TRACES[kind]
        t0 = time.perf_counter()
        out = program(*args, **statics)
        self.timing["dispatch_s"] += time.perf_counter() - t0
        self.trace_counts[kind] += _TRACES[kind] - before
        return out

    # -- metadata -----------------------------------------------------------------------

    def _sample_arrays(self, rows: list, n: int):
        """rows: (seed, uid, position, temperature, top_p) -> padded host arrays."""
        col = lambda i, fill, dt=np.int32: _pad([r[i] for r in rows], n, fill, dt)
        return (col(0, 0), col(1, 0), col(2, 0), col(3, 0.0, np.float32), col(4, 1.0, np.float32))

    def _extend_args(self, items: list[ExtendItem]):
        bk = self.buckets
        num_new = sum(it.end - it.start for it in items)
        num_kv = sum(it.end for it in items)
        num_rows = sum(len(it.samples) for it in items)
        t = bucket(num_new, bk.tokens)
        b = bucket(max(len(items), num_rows), bk.extend_batch)
        k = bucket(num_kv, max(bk.kv, t))
        p = self.page_size
        tokens = np.concatenate([it.tokens for it in items])
        positions = np.concatenate([np.arange(it.start, it.end) for it in items])
        # Each request's slots: all of them index its keys, the new tokens' ones are written.
        every = [range_slots(it.table, 0, it.end, p) for it in items]
        slots = np.concatenate([e[it.start :] for e, it in zip(every, items, strict=True)])
        indices = np.concatenate(every)
        qo = np.cumsum([0] + [it.end - it.start for it in items])
        kv = np.cumsum([0] + [it.end for it in items])
        rows, sample_rows, targets = [], [], []
        for it, last in zip(items, qo[1:] - 1, strict=True):
            for j, (seed, uid, temperature, top_p) in enumerate(it.samples):
                rows.append(last)
                sample_rows.append((seed, uid, it.end, temperature, top_p))
                targets.append(it.rows[j] if j < len(it.rows) else -1)
        arrays = [
            _pad(tokens, t, 0),
            _pad(positions, t, 0),
            _pad(slots, t, -1),
            _pad(qo, b + 1, qo[-1]),
            _pad(kv, b + 1, kv[-1]),
            _pad(indices, k, 0),
            _pad(rows, b, 0),
            *self._sample_arrays(sample_rows, b),
            _pad(targets, b, -1),
        ]
        if self.extend_attention == "prefix_prefill":
            w = bucket(max(len(it.table) for it in items), bk.pages)
            tables = np.zeros((b, w), np.int32)
            for i, it in enumerate(items):
                tables[i, : len(it.table)] = it.table
            arrays += [tables, _pad([it.end for it in items], b, 0)]
        dev = self._put(*arrays)
        tables = seq_lens = None
        if self.extend_attention == "prefix_prefill":
            tables, seq_lens = dev[13], dev[14]
        k_scale, v_scale = self.kv_scales or (None, None)
        batch = ExtendBatch(
            k_scale=k_scale,
            v_scale=v_scale,
            tokens=dev[0],
            positions=dev[1],
            slot_mapping=dev[2],
            qo_indptr=dev[3],
            kv_indptr=dev[4],
            kv_indices=dev[5],
            block_tables=tables,
            seq_lens=seq_lens,
            logit_rows=dev[6],
        )
        return batch, SampleBatch(*dev[7:12]), dev[12]

    # -- running ------------------------------------------------------------------------

    def launch(self, work: StepWork):
        """Enqueue a step's programs; return a handle for :meth:`collect`. Nothing here
        waits for the device."""
        if work.copies:
            self.copy_pages(work.copies)
        # Row updates that fit the folded shapes ride with the step's first program (one
        # dispatch less a step: ~0.5 ms of host time each on an H200's host); larger ones
        # (admitting many prompts at once) are dispatched alone first.
        folded = None
        if work.updates is not None:
            if work.extend or work.decode is not None:
                folded = self._folded_updates(work.updates)
            self.update_counts["alone" if folded is None else "folded"] += 1
            if folded is None:
                self.apply_updates(work.updates)
        ext = None
        if work.extend:
            ext, folded = self.extend(work.extend, updates=folded), None
        if work.pages is not None:
            self.upload_pages(work.pages)
        dec = self.decode(work.decode, updates=folded) if work.decode is not None else None
        for out in (ext, dec):
            if out is not None:
                out.copy_to_host_async()
        return ext, dec

    def collect(self, handle) -> StepOutput:
        """Wait for a launched step; its drawn tokens on the host."""
        ext, dec = handle
        return StepOutput(
            np.asarray(ext) if ext is not None else np.zeros(0, np.int32),
            np.asarray(dec) if dec is not None else None,
        )

    def _update_arrays(self, updates: RowUpdates, u: int, c: int) -> tuple:
        """``updates`` padded to ``u`` rows and ``c`` cells (padding: row ``max_rows``,
        which every scatter drops), as host arrays."""
        r = self.max_rows
        rows = _pad(updates.rows, u, r)
        ints = np.zeros((u, 5 + self.stop_width), np.int32)
        ints[: len(updates.rows)] = updates.ints
        floats = np.zeros((u, 2), np.float32)
        floats[: len(updates.rows)] = updates.floats
        cells = np.full((c, 3), r, np.int32)
        cells[: len(updates.cells)] = updates.cells
        return rows, ints, floats, cells

    def _folded_shape(self) -> tuple[int, int]:
        """(rows, cells) of the updates the step programs take: every row once, two
        table entries a row (a dispatch of ``decode_steps`` <= a page's tokens adds one
        page a row at most), or ``Buckets.folded_cells`` when more: the whole tables of
        the rows a step admits, so that admitting a turn's prompts costs no dispatch of
        its own (~0.5 ms of host time on an H200's host)."""
        return self.max_rows, max(2 * self.max_rows, self.buckets.folded_cells)

    def _folded_updates(self, updates: RowUpdates | None):
        """The arrays the step programs take for ``updates`` (None: no updates, all
        padding), or None when they do not fit :meth:`_folded_shape`."""
        u, c = self._folded_shape()
        if updates is None:
            if self._no_updates is None:
                empty = RowUpdates(
                    np.zeros(0, np.int32),
                    np.zeros((0, 5 + self.stop_width), np.int32),
                    np.zeros((0, 2), np.float32),
                    np.zeros((0, 3), np.int32),
                )
                arrays = self._update_arrays(empty, u, c)
                # Without a mesh, host arrays like every other step's (one program layout):
                # they travel in each step's packed buffers (pack_host), counted there; over
                # a mesh, sent once.
                self._no_updates = arrays if self.tp is None else self._put(*arrays, keep=True)
            if self.tp is None:
                self.timing["h2d_bytes"] += sum(a.nbytes for a in self._no_updates)
            return self._no_updates
        if len(updates.rows) > u or len(updates.cells) > c:
            return None
        return self._put(*self._update_arrays(updates, u, c))

    def apply_updates(self, updates: RowUpdates) -> None:
        """Dispatch ``updates`` alone (the step programs fold in the small ones)."""
        bk = self.buckets
        u = bucket(len(updates.rows), bk.updates)
        c = bucket(len(updates.cells), bk.updates)
        args = self._put(*self._update_arrays(updates, u, c))
        self.state = self._call("update", _UPDATE, self.state, *args)

    def extend(self, items: list[ExtendItem], *, updates=None) -> jax.Array:
        """Run the chunks (after ``updates``: :meth:`_folded_updates`' arrays, None for
        none); return the drawn tokens ``i32[>= sum(len(samples))]`` (device)."""
        if updates is None:
            updates = self._folded_updates(None)
        batch, samples, sample_rows = self._extend_args(items)
        temperatures = [s[2] for it in items for s in it.samples]
        # A step that draws nothing reuses the last variant rather than compiling another.
        greedy = all(t == 0 for t in temperatures) if temperatures else self._last_greedy
        self._last_greedy = greedy
        packed, layout = pack_host((batch, samples, sample_rows, updates))
        tokens, self.k_cache, self.v_cache, self.state = self._call(
            "extend",
            _EXTEND,
            self.params,
            self.k_cache,
            self.v_cache,
            self.state,
            *packed,
            layout=layout,
            model=self.model,
            options=self._options["extend"],
            greedy=greedy,
            tp=self.tp,
        )
        return tokens

    def upload_pages(self, pages: PageUpload) -> None:
        """Replace the device's page table by the host's."""
        from jaxattn.paging import PageTable, Status

        arrays = self._put(
            np.asarray(pages.ref_counts, np.int32),
            np.asarray(pages.free_stack, np.int32),
            np.asarray(pages.num_free, np.int32),
            np.asarray(pages.tables, np.int32),
            np.asarray(pages.lens, np.int32),
            np.asarray(pages.active, bool),
            np.asarray(int(Status.OK), np.int32),
            keep=True,
        )
        self.pages = PageTable(*arrays, block_size=self.page_size)

    def decode(self, work: DecodeWork, *, updates=None) -> jax.Array:
        """Run up to ``work.steps`` decode steps (after ``updates``: :meth:`_folded_updates`'
        arrays, None for none); return the tokens ``i32[decode_steps, work.num_rows]``
        (device)."""
        if work.steps > self.decode_steps:
            raise ValueError(f"{work.steps} steps exceed decode_steps={self.decode_steps}")
        control = np.zeros(work.num_rows + 1, np.int32)
        control[0] = work.steps
        control[1 + np.asarray(work.rows, np.int64)] = 1
        levels = None
        if work.levels is not None:
            if self.cascade_backend is None:
                raise ValueError("cascade decode: no attention backend serves this pool")
            lv = work.levels
            # The prefix tables are gathered from the rows' tables on the device.
            levels = self._put(
                np.asarray(lv.prefix_rows, np.int32),
                np.asarray(lv.prefix_lens, np.int32),
                np.asarray(lv.prefix_of, np.int32),
            )
        if work.counts is None:
            (control,) = self._put(control)
            return self.decode_call(
                control, work.num_rows, work.width, work.greedy, levels=levels, updates=updates
            )
        if self.pages is None:
            raise RuntimeError("device paging needs the host's pages sent first")
        # Entries in plan order (the host reserved in that order); padding rows are ids
        # past the rows, which the page table leaves alone.
        entries = np.full((2, work.num_rows), self.max_rows, np.int32)
        entries[0, : len(work.rows)] = work.rows
        entries[1] = 0
        entries[1, : len(work.rows)] = work.counts
        control, entries = self._put(control, entries)
        return self.decode_call(
            control, work.num_rows, work.width, work.greedy, entries, levels=levels, updates=updates
        )

    def decode_call(
        self,
        control,
        num_rows: int,
        width: int,
        greedy: bool,
        entries=None,
        *,
        levels=None,
        updates=None,
    ) -> jax.Array:
        """The decode program on the current rows (``control``: the step count, then one
        flag per row; ``entries``: device paging's rows and slot counts; ``levels``: the
        cascade levels on the device, or None for paged decode; ``updates``: row updates
        first, :meth:`_folded_updates`' arrays, None for none); for benchmarks that time
        it alone."""
        if updates is None:
            updates = self._folded_updates(None)
        pages = self.pages if entries is not None else None
        packed, layout = pack_host((control, pages, entries, levels, self.kv_scales, updates))
        out, self.k_cache, self.v_cache, self.state, pages = self._call(
            "decode",
            self.decode_program,
            self.params,
            self.k_cache,
            self.v_cache,
            self.state,
            *packed,
            layout=layout,
            model=self.model,
            options=self._options["decode" if levels is None else "cascade"],
            num_rows=num_rows,
            width=width,
            max_steps=self.decode_steps,
            page_size=self.page_size,
            greedy=greedy,
            tp=self.tp,
        )
        if entries is not None:
            self.pages = pages
        return out

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy page ``src -> dst`` (layer-0 ids) in every layer, before any write."""
        n = len(pairs)
        layers = self.model.num_hidden_layers
        m = bucket(n * layers, self.buckets.copies)
        offsets = np.arange(layers)[:, None] * self.num_pages
        src = (np.asarray([p[0] for p in pairs])[None, :] + offsets).reshape(-1)
        dst = (np.asarray([p[1] for p in pairs])[None, :] + offsets).reshape(-1)
        src, dst = self._put(_pad(src, m, 0), _pad(dst, m, -1))
        self.k_cache, self.v_cache = self._call(
            "copy", _COPY, self.k_cache, self.v_cache, src, dst, layout=self.layout, tp=self.tp
        )
