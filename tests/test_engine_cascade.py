"""Cascade decode in the engine.

* the level builder against a naive model: on random block tables that share runs of
  pages like radix-cache hits and forks do, the prefix and own levels join back into
  every request's table and length, prefixes hold only pages full before the dispatch,
  and the grouping saves as many reads as the best of all partitions;
"""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxattn.engine.cascade import cascade_levels, shared_prefixes

# --- the level builder ----------------------------------------------------------------


def _random_batch(rng, n, page_size):
    """Tables of ``n`` requests whose leading pages are shared as a radix tree shares
    them (a request branches off another's pages at a random page), and positions that
    end anywhere in or after the shared pages."""
    next_page = itertools.count(1)
    tables, positions = [], []
    for _ in range(n):
        if tables and rng.random() < 0.8:
            base = tables[rng.integers(len(tables))]
            keep = int(rng.integers(0, len(base) + 1))
            table = base[:keep]
        else:
            table = []
        table = table + [next(next_page) for _ in range(int(rng.integers(1, 4)))]
        # The last token lies in the last page (an exact-fit table) or one page earlier.
        last = len(table) - 1 - int(rng.integers(0, 2) if len(table) > 1 else 0)
        positions.append(last * page_size + int(rng.integers(0, page_size)))
        tables.append(table)
    return tables, positions


def _best_saving(tables, positions, page_size, min_pages):
    """The most ``sum((members - 1) * pages)`` over every partition of the requests."""
    full = [t[: p // page_size] for t, p in zip(tables, positions, strict=True)]

    def common(members):
        n = min(len(full[m]) for m in members)
        for i in range(n):
            if len({full[m][i] for m in members}) > 1:
                return i
        return n

    def partitions(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for part in partitions(rest):
            yield [[first], *part]
            for i in range(len(part)):
                yield [*part[:i], [first, *part[i]], *part[i + 1 :]]

    best = 0
    for part in partitions(list(range(len(tables)))):
        saving = 0
        for block in part:
            pages = common(block) if len(block) > 1 else 0
            if pages >= min_pages:
                saving += (len(block) - 1) * pages
        best = max(best, saving)
    return best


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 6),
    page_size=st.sampled_from([1, 2, 4]),
    min_pages=st.integers(1, 3),
)
def test_levels_join_back_into_every_table(seed, n, page_size, min_pages):
    rng = np.random.default_rng(seed)
    tables, positions = _random_batch(rng, n, page_size)
    num_rows = n + int(rng.integers(0, 3))
    rows = rng.permutation(num_rows)[:n].tolist()
    width = max(len(t) for t in tables) + int(rng.integers(0, 2))
    levels = cascade_levels(
        tables,
        positions,
        rows,
        page_size=page_size,
        min_pages=min_pages,
        num_rows=num_rows,
        width=width,
    )
    best = _best_saving(tables, positions, page_size, min_pages)
    if levels is None:
        assert best == 0
        return
    assert levels.prefix_tables.shape == (num_rows, width)
    assert levels.prefix_lens.shape == levels.prefix_of.shape == (num_rows,)
    assert levels.prefix_lens.dtype == levels.prefix_of.dtype == np.int32
    assert np.all(levels.prefix_lens % page_size == 0)
    # Rows that decode nothing continue no prefix; every used prefix has >= 2 members.
    idle = np.setdiff1d(np.arange(num_rows), rows)
    assert np.all(levels.prefix_of[idle] == -1)
    members = np.bincount(levels.prefix_of[levels.prefix_of >= 0], minlength=num_rows)
    used = members > 0
    assert np.all(members[used] >= 2)
    assert np.all(levels.prefix_lens[~used] == 0)
    assert np.all(levels.prefix_lens[used] >= min_pages * page_size)
    saved = 0
    for i, (table, pos) in enumerate(zip(tables, positions, strict=True)):
        g = int(levels.prefix_of[rows[i]])
        if g < 0:
            continue
        pages = int(levels.prefix_lens[g]) // page_size
        # Only pages full before the first decode step (none it writes) are shared ...
        assert pages <= pos // page_size
        # ... and the prefix then the own pages are the request's table, the prefix
        # tokens and the own tokens its length.
        own = table[pages:]
        assert levels.prefix_tables[g, :pages].tolist() + own == table
        assert pos + 1 - pages * page_size >= 1
        saved += pages * page_size
    saved -= int(levels.prefix_lens[used].sum())
    assert levels.saved_tokens == saved
    # The grouping is the best partition for the reads it saves.
    assert levels.saved_tokens == best * page_size


def test_nested_shared_runs_pick_the_larger_saving():
    # Two forked pairs (11 common pages each) under a 2-page system prompt shared by all
    # five requests: the pairs save 11 + 11 pages, one group of all five only 4 * 2.
    base = [1, 2]
    tables = [
        base + [3] * 8 + [10, 11],
        base + [3] * 8 + [10, 12],
        base + [4] * 8 + [13, 14],
        base + [4] * 8 + [13, 15],
        base + [9, 16],
    ]
    positions = [11 * 4 + 1] * 4 + [2 * 4 + 1]
    assert shared_prefixes(tables, positions, page_size=4) == [([0, 1], 11), ([2, 3], 11)]
    # A long prompt shared by seven, two of them forks sharing one page more: one group.
    tables = [[1] * 100 + [2, 50 + i] for i in range(2)] + [[1] * 100 + [60 + i] for i in range(5)]
    positions = [101 * 4 + 2] * 2 + [100 * 4 + 1] * 5
    assert shared_prefixes(tables, positions, page_size=4) == [(list(range(7)), 100)]
    # The page a request writes is never shared, however many hold it.
    assert shared_prefixes([[7, 8], [7, 8]], [4, 5], page_size=4) == [([0, 1], 1)]
    assert shared_prefixes([[7, 8], [7, 8]], [3, 5], page_size=4) == []
    assert shared_prefixes([[7, 8], [7, 8]], [4, 5], page_size=4, min_pages=2) == []
