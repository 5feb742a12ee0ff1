"""Token sampling: greedy, temperature and top-p (nucleus), with explicit PRNG keys.

The key of a sample depends only on ``(seed, uid, position)``: the request's seed, the
sample's id within the request (its index among the ``n`` parallel samples) and the index
of the token being drawn. A sequence therefore draws the same tokens whatever else shares
its batch, however its prompt was chunked, and after a preemption and recompute; an oracle
can redraw every token from the dense logits with the same keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["sample", "sample_keys"]


def sample_keys(seeds, uids, positions):
    """Keys ``[S]`` for ``(seeds[i], uids[i], positions[i])``; int32 arrays (traceable)."""

    def one(seed, uid, position):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), uid), position)

    return jax.vmap(one)(seeds, uids, positions)


def sample(logits, keys, temperature, top_p, *, greedy: bool):
    """Draw one token per row: ``i32[S]``.

    logits ``f32[S, V]``; keys ``[S]``; temperature, top_p ``f32[S]``. A row with
    ``temperature == 0`` takes the argmax (ties: lowest id). Otherwise the logits are
    divided by the temperature and restricted to the smallest set of most likely tokens
    whose probability reaches ``top_p`` (the most likely token always stays).
    ``greedy=True`` (static) skips the sort when every row is greedy.
    """
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy:
        return best
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = logits / t
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < top_p[:, None]
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    pick = jax.vmap(jax.random.categorical)(keys, sorted_logits)
    drawn = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, best)
