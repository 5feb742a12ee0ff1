"""The one formula from a block table to pool slots, for numpy and jax arrays alike."""

from __future__ import annotations

import numpy as np

__all__ = ["range_slots", "token_slots"]


def token_slots(table, positions, block_size: int):
    """Pool slot of each token position: ``table[pos // P] * P + pos % P``.

    ``table`` is one block table ``[W]`` with ``positions`` of any shape, or a batch
    ``[B, W]`` with ``positions`` ``[B]`` (one position per row) or ``[B, T]``. numpy in,
    numpy out (int32); jax in (either argument), jax out. Positions must lie inside the
    table: callers mask the others (``jnp.where(valid, slots, -1)``) since a gather cannot
    fail under jit.
    """
    if isinstance(table, np.ndarray) and isinstance(positions, np.ndarray | int | np.integer):
        xp = np
        pos = np.asarray(positions, np.int64)
        table = table.astype(np.int64, copy=False)
    else:
        import jax.numpy as jnp

        xp = jnp
        pos = jnp.asarray(positions, jnp.int32)
        table = jnp.asarray(table, jnp.int32)
    col = pos // block_size
    if table.ndim == 1:
        pages = table[col]
    elif pos.ndim == 1:
        pages = xp.take_along_axis(table, col[:, None], axis=1)[:, 0]
    else:
        pages = xp.take_along_axis(table, col, axis=1)
    slots = pages * block_size + pos % block_size
    return slots.astype(np.int32) if xp is np else slots


def range_slots(table: np.ndarray, start: int, end: int, block_size: int) -> np.ndarray:
    """``i32[end - start]``: :func:`token_slots` of positions ``[start, end)`` of one numpy
    table, a page at a time (each page of the range expanded to its ``P`` slots, then
    trimmed to the range): no division per token, for the host's per-request slot lists."""
    p = block_size
    first, last = start // p, -(-end // p)
    pages = np.asarray(table[first:last], np.int64)
    slots = (pages[:, None] * p + np.arange(p)).reshape(-1)
    return slots[start - first * p : end - first * p].astype(np.int32)
