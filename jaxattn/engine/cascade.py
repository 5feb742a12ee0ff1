"""Cascade decode levels of a decode dispatch, built on the host from the block tables.

Requests that matched the same cached prefix in the radix tree (or were forked from one
prompt) hold the same page ids at the start of their block tables. A dispatch whose rows
share such a run can call :func:`jaxattn.cascade_attention`: the shared pages form a
*prefix level* read once per batch, each row's remaining pages its *own level*.

What may go into a prefix: whole pages only, and none that a member writes during the
dispatch. A decode row from ``position`` (the position of its last token, whose KV the
first step writes) writes positions ``position, position + 1, ...``, so only its first
``position // page_size`` pages are full and stay unwritten for every step of a
multi-step dispatch; the page holding ``position`` is always in the row's own level.

Each row continues at most one prefix. Where shared runs nest (a system prompt shared by
all rows, whole prompts shared by the forks of one request), :func:`shared_prefixes`
picks the groups that save the most reads: it walks the tree of common runs bottom up
and, at every node, keeps the best saving for each number of rows left ungrouped below
it (a small knapsack), so the choice is exact for the saving ``sum((members - 1) *
prefix_pages)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = ["CascadeLevels", "cascade_levels", "shared_prefixes"]


class CascadeLevels(NamedTuple):
    """The prefix level of a decode dispatch over ``R`` rows, tables ``W`` pages wide.

    prefix_tables ``i32[R, W]``: one row per prefix (unused rows: zeros, length 0);
    prefix_lens ``i32[R]``: tokens of each prefix (a multiple of the page size);
    prefix_of ``i32[R]``: per decode row, the prefix it continues (-1: none);
    prefix_rows ``i32[R]``: per prefix, a decode row whose table starts with it (0 for
    unused rows), so that the device can gather the prefix tables from the rows' tables
    instead of receiving them.
    saved_tokens: per decode step, the prefix tokens not read thanks to the sharing,
    ``sum((members - 1) * prefix tokens)`` over the prefixes.
    """

    prefix_tables: np.ndarray
    prefix_lens: np.ndarray
    prefix_of: np.ndarray
    prefix_rows: np.ndarray
    saved_tokens: int


def _common(a: tuple, b: tuple) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shared_prefixes(
    tables: Sequence[Sequence[int]],
    positions: Sequence[int],
    *,
    page_size: int,
    min_pages: int = 1,
) -> list[tuple[list[int], int]]:
    """The prefix groups of a batch: ``[(members, pages), ...]``.

    tables: each request's block table (at least ``positions[i] // page_size + 1`` pages);
    positions: the position each request's first decode step writes. A group is two or
    more requests whose first ``pages >= min_pages`` table entries are equal and full
    before the step (``pages <= positions[i] // page_size`` for every member); each request
    is in at most one group, and the groups maximise ``sum((members - 1) * pages)``.
    """
    n = len(tables)
    if len(positions) != n:
        raise ValueError(f"{n} tables but {len(positions)} positions")
    min_pages = max(int(min_pages), 1)
    # Only requests with min_pages full pages whose first page another one holds too can
    # share anything (the common case of no sharing costs one pass over the first pages).
    firsts: dict[int, list[int]] = {}
    for i, (t, pos) in enumerate(zip(tables, positions, strict=True)):
        if max(int(pos), 0) // page_size >= min_pages:
            firsts.setdefault(int(t[0]), []).append(i)
    candidates = [i for same in firsts.values() if len(same) > 1 for i in same]
    full = {
        i: tuple(int(p) for p in tables[i][: int(positions[i]) // page_size]) for i in candidates
    }
    n = len(candidates)
    order = sorted(candidates, key=lambda i: full[i])
    lcp = [_common(full[order[k]], full[order[k + 1]]) for k in range(n - 1)]

    def solve(lo: int, hi: int) -> dict[int, tuple[int, list]]:
        """Sorted requests ``order[lo..hi]`` -> {rows left ungrouped: (saving, groups)}."""
        if lo == hi:
            return {1: (0, [])}
        depth = min(lcp[lo:hi])
        # The children: maximal runs of the range whose common run is longer than depth.
        options: dict[int, tuple[int, list]] = {0: (0, [])}
        start = lo
        for k in [*(k for k in range(lo, hi) if lcp[k] == depth), hi]:
            merged: dict[int, tuple[int, list]] = {}
            for j1, (s1, g1) in options.items():
                for j2, (s2, g2) in solve(start, k).items():
                    if j1 + j2 not in merged or s1 + s2 > merged[j1 + j2][0]:
                        merged[j1 + j2] = (s1 + s2, g1 + g2)
            options, start = merged, k + 1
        if depth >= min_pages:
            # The rows still ungrouped below may all form a group here (taking only some
            # never beats it: each one more adds ``depth`` here, less anywhere above), or
            # pass on up, where a larger group may save more.
            for j, (s, g) in list(options.items()):
                if j >= 2 and s + (j - 1) * depth > options.get(0, (-1, []))[0]:
                    taken = {m for members, _ in g for m in members}
                    rest = [order[k] for k in range(lo, hi + 1) if order[k] not in taken]
                    options[0] = (s + (j - 1) * depth, [*g, (rest, depth)])
        return options

    if n < 2:
        return []
    best = max(solve(0, n - 1).values(), key=lambda sg: sg[0])
    return [(sorted(members), pages) for members, pages in best[1]]


def cascade_levels(
    tables: Sequence[Sequence[int]],
    positions: Sequence[int],
    rows: Sequence[int],
    *,
    page_size: int,
    min_pages: int,
    num_rows: int,
    width: int,
) -> CascadeLevels | None:
    """The levels of a decode dispatch (None when no two rows share ``min_pages`` full
    pages): request ``i`` (table ``tables[i]``, first decode step writing
    ``positions[i]``) runs in decode row ``rows[i] < num_rows``; the prefix tables are
    ``width`` pages wide (the dispatch's table width), one per row so that the shapes
    depend on ``num_rows`` and ``width`` only."""
    groups = shared_prefixes(tables, positions, page_size=page_size, min_pages=min_pages)
    if not groups:
        return None
    prefix_tables = np.zeros((num_rows, width), np.int32)
    prefix_lens = np.zeros(num_rows, np.int32)
    prefix_of = np.full(num_rows, -1, np.int32)
    prefix_rows = np.zeros(num_rows, np.int32)
    saved = 0
    for g, (members, pages) in enumerate(groups):
        prefix_tables[g, :pages] = np.asarray(tables[members[0]][:pages], np.int32)
        prefix_lens[g] = pages * page_size
        prefix_of[np.asarray([rows[m] for m in members], np.int64)] = g
        prefix_rows[g] = rows[members[0]]
        saved += (len(members) - 1) * pages * page_size
    return CascadeLevels(prefix_tables, prefix_lens, prefix_of, prefix_rows, saved)
