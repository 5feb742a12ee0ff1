"""Token sampling: greedy, temperature and top-p (nucleus), with explicit PRNG keys.

The key of a sample depends only on ``(seed, uid, position)``: the request's seed, the
sample's id within the request (its index among the ``n`` parallel samples) and the index
of the token being drawn. A sequence therefore draws the same tokens whatever else shares
its batch, however its prompt was chunked, and after a preemption and recompute; an oracle
can redraw every token from the dense logits with the same keys.

A draw is the Gumbel-max trick: the token with the largest ``logit / temperature +
noise``, the noise drawn per token id. Logits that differ only by rounding (another kernel,
a bfloat16 model against a float32 oracle) then draw the same token unless two tokens'
perturbed scores are within that rounding, as in greedy decoding. (Noise drawn per rank of
the sorted logits, as ``jax.random.categorical`` over them would, hands two nearly equal
tokens each other's noise when rounding swaps their order, and changes the draw by far
more than the rounding.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["nucleus", "sample", "sample_keys"]


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
    keep = nucleus(scaled, top_p[:, None])
    noise = jax.vmap(lambda k: jax.random.gumbel(k, scaled.shape[-1:], jnp.float32))(keys)
    drawn = jnp.argmax(jnp.where(keep, scaled + noise, -jnp.inf), axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, best)


def nucleus(scaled, top_p):
    """bool, the shape of ``scaled`` (logits over the last axis): the smallest set of most
    likely tokens whose probability reaches ``top_p`` (broadcast against ``scaled``)."""
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    probs = jax.nn.softmax(jnp.take_along_axis(scaled, order, axis=-1), axis=-1)
    keep_sorted = jnp.cumsum(probs, axis=-1) - probs < top_p
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(keep_sorted, inverse, axis=-1)
