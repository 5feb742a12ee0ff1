"""Which sequences of a batch have valid index metadata: the memory-safety contract.

Under ``jax.jit`` the values of block tables, lengths and indptr arrays cannot be checked
before a kernel runs. Every backend therefore keeps one contract (written here once, in
``jax.numpy``, and used by the spec, the Pallas wrappers and the checked mode):

* no index value makes a kernel read or write outside a buffer;
* every output row of a sequence with an invalid index is NaN, a poison the caller sees;
  every other sequence's rows are exact;
* block-table entries past a sequence's length are never read and never poison it.

Paged sequence ``b`` (decode, prefix prefill) is invalid when ``seq_lens[b] < 0``,
``seq_lens[b] > max_pages * page_size``, or a page id it uses
(``block_tables[b, :ceil(seq_lens[b] / page_size)]``) lies outside ``[0, num_pages)``.

A ragged batch (extend, prefix prefill) is *structurally* invalid when its query indptr
(and, for extend, its kv indptr) does not start at 0 or decreases somewhere: the rows of
the requests are then undefined, and every row of the output is NaN. Otherwise request
``b`` is invalid when its rows run past ``q`` (``qo_indptr[b + 1] > num_rows``), it has
fewer keys than queries (``Lk < Lq``), its keys run past ``kv_indices``
(``kv_indptr[b + 1] > len(kv_indices)``), or a key index it uses lies outside the pool;
its rows ``[qo_indptr[b], min(qo_indptr[b + 1], num_rows))`` are NaN.
Cascade decode (``cascade_attention``): request ``b`` is invalid when ``prefix_of[b]`` lies
outside ``[-1, G)``, its own pages and ``seq_lens[b]`` break the paged rule above, or the prefix
it continues is invalid. Prefix ``g`` is invalid when ``prefix_lens[g]`` is not a multiple of
the page size in ``[0, max_prefix_pages * page_size]``, or a page id among its first
``prefix_lens[g] / page_size`` table entries lies outside ``[0, num_pages)``; it poisons every
request that continues it, and none other (a prefix no request uses is never read).
"""

from __future__ import annotations

import functools
import operator
from typing import NamedTuple

import jax.numpy as jnp


class Problem(NamedTuple):
    """One check: ``ok`` bool[N] per sequence (or a scalar), and a message naming the
    argument, formatted with ``index`` = the first failing sequence (checkify style)."""

    ok: jnp.ndarray
    message: str


def paged_problems(block_tables, seq_lens, page_size: int, num_pages: int) -> list[Problem]:
    """The checks of paged sequences (see the module docstring)."""
    width = block_tables.shape[1]
    capacity = width * page_size
    lens_ok = (seq_lens >= 0) & (seq_lens <= capacity)
    used = (
        jnp.arange(width, dtype=jnp.int32)[None, :]
        < ((jnp.clip(seq_lens, 0, capacity) + page_size - 1) // page_size)[:, None]
    )
    in_range = (block_tables >= 0) & (block_tables < num_pages)
    pages_ok = jnp.all(in_range | ~used, axis=1)
    return [
        Problem(
            lens_ok,
            f"seq_lens[{{index}}] must lie in [0, max_pages * page_size = {capacity}]",
        ),
        Problem(
            pages_ok,
            f"block_tables[{{index}}] holds a page outside [0, {num_pages}) within its first "
            "ceil(seq_lens / page_size) entries",
        ),
    ]


def paged_valid(block_tables, seq_lens, page_size: int, num_pages: int):
    """bool[B]: the paged sequences whose metadata is valid."""
    return _all(paged_problems(block_tables, seq_lens, page_size, num_pages), seq_lens.shape[0])


def indptr_ok(indptr):
    """Scalar bool: starts at 0 and never decreases."""
    return (indptr[0] == 0) & jnp.all(indptr[1:] >= indptr[:-1])


def indptrs_ok(*indptrs):
    """Scalar bool: every indptr starts at 0 and never decreases (:func:`indptr_ok` of each,
    as a single reduction over all of them)."""
    starts = functools.reduce(operator.and_, [p[0] == 0 for p in indptrs])
    steps = jnp.concatenate([p[1:] - p[:-1] for p in indptrs])
    return starts & (jnp.min(steps, initial=0) >= 0)


def ragged_problems(
    q_indptr,
    num_rows: int,
    lk,
    *,
    q_name: str,
    kv_indptr=None,
    kv_indices=None,
    num_slots=None,
) -> list[Problem]:
    """The checks of a ragged batch: q rows by ``q_indptr`` (named ``q_name``), ``lk`` keys
    per request; for extend also ``kv_indptr`` over ``kv_indices`` into ``num_slots``."""
    lq = q_indptr[1:] - q_indptr[:-1]
    problems = [
        Problem(indptr_ok(q_indptr), f"{q_name} must start at 0 and be non-decreasing"),
        Problem(
            q_indptr[1:] <= num_rows, f"{q_name}[{{index}} + 1] exceeds the {num_rows} rows of q"
        ),
        Problem(lk >= lq, "request {index} has fewer keys than queries (Lk < Lq)"),
    ]
    if kv_indptr is not None:
        n = kv_indices.shape[0]
        problems += [
            Problem(indptr_ok(kv_indptr), "kv_indptr must start at 0 and be non-decreasing"),
            Problem(
                kv_indptr[1:] <= n,
                f"kv_indptr[{{index}} + 1] exceeds the length of kv_indices ({n})",
            ),
        ]
    if kv_indptr is not None:
        # Request b's keys are kv_indices[kv_indptr[b]:kv_indptr[b + 1]]: one masked
        # reduction over [B, N] (a single fused kernel on a GPU, where a prefix sum is a
        # chain of them).
        out_of_pool = (kv_indices < 0) | (kv_indices >= num_slots)
        pos = jnp.arange(n, dtype=jnp.int32)[None, :]
        owned = (pos >= kv_indptr[:-1, None]) & (pos < kv_indptr[1:, None])
        slots_ok = ~jnp.any(owned & out_of_pool[None, :], axis=1)
        problems.append(
            Problem(
                slots_ok,
                f"kv_indices of request {{index}} hold a slot outside [0, {num_slots})",
            )
        )
    return problems


def ragged_valid(problems: list[Problem], batch: int, structural=None):
    """(structurally fine: scalar bool, per request: bool[B]). ``structural``: that scalar
    when the caller has it (:func:`indptrs_ok`); the scalar problems are then not used."""
    if structural is None:
        structural = jnp.all(jnp.stack([p.ok for p in problems if p.ok.ndim == 0]))
    per_request = [p for p in problems if p.ok.ndim]
    return structural, _all(per_request, batch) & structural


def ragged_row_mask(q_indptr, num_rows: int, structural, request_ok):
    """bool[num_rows]: the rows that must be NaN."""
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    start, end = q_indptr[:-1], jnp.minimum(q_indptr[1:], num_rows)
    bad_rows = jnp.any(
        (~request_ok)[None, :] & (rows[:, None] >= start[None, :]) & (rows[:, None] < end[None, :]),
        axis=1,
    )
    return bad_rows | ~structural


def _all(problems: list[Problem], batch: int):
    ok = jnp.ones((batch,), bool)
    for p in problems:
        ok = ok & (p.ok if p.ok.ndim else jnp.broadcast_to(p.ok, (batch,)))
    return ok


def _prefix_lens_ok(prefix_lens, capacity: int, page_size: int):
    """bool, the shape of ``prefix_lens``: a whole number of pages within ``capacity``."""
    return (prefix_lens >= 0) & (prefix_lens <= capacity) & (prefix_lens % page_size == 0)


def _prefix_checks(prefix_tables, prefix_lens, page_size: int, num_pages: int):
    """(length ok, pages ok), bool[G] each, whether a request uses the prefix or not."""
    width = prefix_tables.shape[1]
    capacity = width * page_size
    lens_ok = _prefix_lens_ok(prefix_lens, capacity, page_size)
    pages_used = (
        jnp.arange(width, dtype=jnp.int32)[None, :]
        < (jnp.clip(prefix_lens, 0, capacity) // page_size)[:, None]
    )
    in_range = (prefix_tables >= 0) & (prefix_tables < num_pages)
    return lens_ok, jnp.all(in_range | ~pages_used, axis=1)


def cascade_problems(
    prefix_tables, prefix_lens, prefix_of, block_tables, seq_lens, page_size: int, num_pages: int
) -> list[Problem]:
    """The checks of a cascade batch (see the module docstring). The prefix checks are
    per prefix (``ok`` bool[G]) and fail only for a prefix some request continues; the
    others are per request (bool[B])."""
    num_prefixes = prefix_tables.shape[0]
    capacity = prefix_tables.shape[1] * page_size
    # A request with prefix_of outside [0, G) continues no prefix (and is invalid itself).
    used = (
        jnp.zeros((num_prefixes,), bool)
        .at[jnp.where(prefix_of >= 0, prefix_of, num_prefixes)]
        .set(True, mode="drop")
    )
    lens_ok, pages_ok = _prefix_checks(prefix_tables, prefix_lens, page_size, num_pages)
    return [
        Problem(
            (prefix_of >= -1) & (prefix_of < num_prefixes),
            f"prefix_of[{{index}}] must lie in [-1, {num_prefixes}) (-1: no prefix)",
        ),
        Problem(
            lens_ok | ~used,
            f"prefix_lens[{{index}}] must be a multiple of page_size = {page_size} in "
            f"[0, max_prefix_pages * page_size = {capacity}]",
        ),
        Problem(
            pages_ok | ~used,
            f"prefix_tables[{{index}}] holds a page outside [0, {num_pages}) within its first "
            "prefix_lens / page_size entries",
        ),
        *paged_problems(block_tables, seq_lens, page_size, num_pages),
    ]


def prefix_valid(prefix_tables, prefix_lens, page_size: int, num_pages: int):
    """bool[G]: the prefixes whose length and pages are valid."""
    lens_ok, pages_ok = _prefix_checks(prefix_tables, prefix_lens, page_size, num_pages)
    return lens_ok & pages_ok


def cascade_valid(
    prefix_tables, prefix_lens, prefix_of, block_tables, seq_lens, page_size: int, num_pages: int
):
    """bool[B]: the requests of a cascade batch whose prefix id, prefix and own pages are
    all valid."""
    num_prefixes = prefix_tables.shape[0]
    ok = (prefix_of >= -1) & (prefix_of < num_prefixes)
    ok = ok & paged_valid(block_tables, seq_lens, page_size, num_pages)
    if num_prefixes == 0:
        return ok
    good = prefix_valid(prefix_tables, prefix_lens, page_size, num_pages)
    return ok & ((prefix_of < 0) | good[jnp.clip(prefix_of, 0, num_prefixes - 1)])


def cascade_unpaged_valid(
    prefix_lens, prefix_of, seq_lens, prefix_capacity: int, capacity: int, page_size: int
):
    """bool[B]: the checks of :func:`cascade_valid` that read no table -- the prefix id in
    [-1, G), the continued prefix's length a multiple of ``page_size`` in [0,
    ``prefix_capacity``], the own length in [0, ``capacity``] -- for kernels that check the
    lengths and page ids they read themselves and poison what fails (the Mosaic GPU cascade;
    these checks also cover a level it does not launch)."""
    num_prefixes = prefix_lens.shape[0]
    ok = (prefix_of >= -1) & (prefix_of < num_prefixes) & (seq_lens >= 0) & (seq_lens <= capacity)
    if num_prefixes == 0:
        return ok
    lens = prefix_lens[jnp.clip(prefix_of, 0, num_prefixes - 1)]
    return ok & ((prefix_of < 0) | _prefix_lens_ok(lens, prefix_capacity, page_size))


def cascade_unpaged_lengths(
    prefix_lens, prefix_of, seq_lens, prefix_capacity: int, capacity: int, page_size: int
):
    """What a cascade kernel that checks the page ids it reads itself (reading a bad one as
    page 0 and poisoning its rows) may read, from the checks that read no table
    (:func:`cascade_unpaged_valid`), so that it is the same for every layer of a model whose
    layers offset the tables; what fails reads nothing. ok bool[B]; each prefix's length
    int32[G] (0 for a length that is not whole pages within the table); each request's own
    length int32[B] (0 where ok fails); the length of the prefix each request continues
    int32[B] (0 for none or where ok fails)."""
    num_prefixes = prefix_lens.shape[0]
    ok = cascade_unpaged_valid(
        prefix_lens, prefix_of, seq_lens, prefix_capacity, capacity, page_size
    )
    lens_ok = _prefix_lens_ok(prefix_lens, prefix_capacity, page_size)
    prefix_len = jnp.where(lens_ok, prefix_lens, 0).astype(jnp.int32)
    own_len = jnp.where(ok, seq_lens, 0).astype(jnp.int32)
    if num_prefixes == 0:
        return ok, prefix_len, own_len, jnp.zeros(prefix_of.shape, jnp.int32)
    g = jnp.clip(prefix_of, 0, num_prefixes - 1)
    req_prefix_len = jnp.where(ok & (prefix_of >= 0), prefix_len[g], 0)
    return ok, prefix_len, own_len, req_prefix_len
