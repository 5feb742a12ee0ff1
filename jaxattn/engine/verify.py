"""Check engine outputs against the dense forward pass without any cache (the oracle).

Every generated token is checked against the logits of a plain causal forward over the
prompt plus the tokens before it (:func:`jaxattn.models.llama.forward_dense`, which shares
no code with the paged attention ops). Because the model is causal, one forward over the
whole final sequence gives, at each position, exactly the logits a step-by-step no-cache
recompute would have seen; by induction the outputs equal the recompute's greedy (or
redrawn) outputs token for token.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.models.llama import LlamaConfig, forward_dense

from .runner import bucket
from .sampling import sample, sample_keys

__all__ = ["VerifyReport", "check_outputs", "dense_logits"]


def dense_logits(params: dict, cfg: LlamaConfig, sequences, *, rows: int = 8) -> list:
    """float32 logits ``[len(s), vocab]`` of each token list ``s``, with no cache.

    Sequences are padded to one power-of-two length and run ``rows`` at a time, so a
    whole workload compiles one or two programs.
    """
    sequences = [list(s) for s in sequences]
    if not sequences:
        return []
    length = bucket(max(len(s) for s in sequences), 16)
    out = []
    for i in range(0, len(sequences), rows):
        group = sequences[i : i + rows]
        tokens = np.zeros((rows, length), np.int32)
        lengths = np.ones(rows, np.int32)
        for j, s in enumerate(group):
            tokens[j, : len(s)] = s
            lengths[j] = len(s)
        logits = np.asarray(forward_dense(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths)))
        out.extend(logits[j, : len(s)] for j, s in enumerate(group))
    return out


@functools.partial(jax.jit, static_argnames="greedy")
def _redraw(logits, seeds, uids, positions, temperature, top_p, greedy=False):
    keys = sample_keys(seeds, uids, positions)
    return sample(logits, keys, temperature, top_p, greedy=greedy)


@dataclasses.dataclass
class VerifyReport:
    """``checked``: generated tokens compared; ``near_ties``: greedy tokens accepted
    although not the oracle's argmax, because the two logits differ by at most the tie
    tolerance (float rounding decides those); ``problems``: one line per mismatch."""

    checked: int = 0
    near_ties: int = 0
    problems: list = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_outputs(
    params: dict,
    cfg: LlamaConfig,
    prompts,
    outputs,
    *,
    max_new_tokens,
    n: int = 1,
    stop_ids=(),
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed=0,
    sample_ids=None,
    tie_tolerance: float = 1e-4,
) -> VerifyReport:
    """Check the outputs of ``Engine.generate(prompts, max_new_tokens, n=n, ...)``.

    Output ``k`` belongs to prompt ``k // n``. Greedy outputs must take the argmax at
    every step (up to ``tie_tolerance``); sampled ones must equal the token redrawn from
    the dense logits with the same key ``(seed, k, position)``. ``seed`` may also be one
    seed per output and ``sample_ids`` replaces ``k`` (requests queued one by one with
    :meth:`Engine.add_request`). Lengths must follow ``max_new_tokens`` and the stop
    tokens.
    """
    prompts = [list(p) for p in prompts]
    outputs = [list(o) for o in outputs]
    if len(outputs) != len(prompts) * n:
        raise ValueError(f"outputs must hold len(prompts) * n = {len(prompts) * n} lists")
    if isinstance(max_new_tokens, int):
        max_new_tokens = [max_new_tokens] * len(prompts)
    stop_ids = set(stop_ids)
    seeds = [int(seed)] * len(outputs) if isinstance(seed, int) else [int(s) for s in seed]
    sample_ids = list(range(len(outputs))) if sample_ids is None else list(sample_ids)
    report = VerifyReport()
    logits = dense_logits(params, cfg, [prompts[k // n] + out for k, out in enumerate(outputs)])
    for k, out in enumerate(outputs):
        prompt, limit = prompts[k // n], max_new_tokens[k // n]
        if not out or len(out) > limit:
            report.problems.append(f"output {k}: {len(out)} tokens for max_new_tokens={limit}")
            continue
        early = [t for t in out[:-1] if t in stop_ids]
        if early or (len(out) < limit and out[-1] not in stop_ids):
            report.problems.append(f"output {k}: stops at {len(out)} tokens, stop ids {early}")
        rows = logits[k][len(prompt) - 1 : len(prompt) - 1 + len(out)]
        report.checked += len(out)
        if temperature == 0:
            best = rows.argmax(-1)
            for t, token in enumerate(out):
                if token == best[t]:
                    continue
                gap = float(rows[t, best[t]] - rows[t, token])
                if gap <= tie_tolerance:
                    report.near_ties += 1
                else:
                    report.problems.append(
                        f"output {k} token {t}: got {token}, dense argmax {best[t]} "
                        f"(logit gap {gap:.3g})"
                    )
            continue
        m = bucket(len(out), 16)
        padded = np.zeros((m, rows.shape[1]), np.float32)
        padded[: len(out)] = rows
        drawn = np.asarray(
            _redraw(
                jnp.asarray(padded),
                jnp.full((m,), seeds[k], jnp.int32),
                jnp.full((m,), sample_ids[k], jnp.int32),
                jnp.asarray(len(prompt) + np.arange(m), jnp.int32),
                jnp.full((m,), temperature, jnp.float32),
                jnp.full((m,), top_p, jnp.float32),
            )
        )[: len(out)]
        for t in np.flatnonzero(drawn != np.asarray(out)):
            report.problems.append(f"output {k} token {t}: got {out[t]}, redrawn {drawn[t]}")
    return report
