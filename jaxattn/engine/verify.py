"""Check engine outputs against the dense forward pass without any cache (the oracle).

Every generated token is checked against the logits of a plain causal forward over the
prompt plus the tokens before it (:func:`jaxattn.models.llama.forward_dense`, which shares
no code with the paged attention ops). Because the model is causal, one forward over the
whole final sequence gives, at each position, exactly the logits a step-by-step no-cache
recompute would have seen; by induction the outputs equal the recompute's greedy (or
redrawn) outputs token for token.

Up to rounding: the engine and the oracle add the same numbers in different orders (paged
kernels, chunked prefill, float32 against model-dtype attention), so where the two best
tokens are closer than that rounding, either may win. A token that differs from the oracle's
is therefore judged by its logit gap under the oracle's logits, ``logit[oracle's token] -
logit[engine's token]`` (for a sampled token, the same gap between the two tokens' perturbed
scores, ``logit + temperature * gumbel noise``, in logit units): it is a near-tie, and
accepted, when the gap is at most ``rtol * max(1, max |logit|)`` of that row, with ``rtol``
from :data:`GAP_RTOL` by the model's dtype; beyond that it is a failure. Outputs served
from an FP8 pool (``kv_dtype=``) are judged with the larger :data:`GAP_RTOL_KV` of the
format, since the cache itself then rounds K and V to 3 (e4m3) or 2 (e5m2) mantissa bits.
A wrong slot, page or mask moves logits by a sizeable fraction of their range, far beyond
these tolerances.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.models.llama import LlamaConfig, forward_dense

from .config import fp8_format, padded_batches
from .runner import bucket
from .sampling import nucleus, sample, sample_keys

__all__ = ["GAP_RTOL", "GAP_RTOL_KV", "VerifyReport", "check_outputs", "dense_logits"]

# Near-tie tolerance of a logit gap, relative to the row's largest logit magnitude (at least
# 1), by the dtype the model computes in. Measured on an H200 with a random 1B-like Llama (16
# layers, hidden 2048, 32/8 heads, vocab 32000; logits up to about 5), 1920 greedy tokens
# each, Pallas kernels: the largest relative gap of a correct run was 0.0165 in bfloat16 (71
# tokens not the oracle's argmax, absolute gaps 0.005-0.06), 0.001 in float16 (10 tokens)
# and 0.0002 in float32 (2 tokens). Each tolerance is about three to five times that, and a
# small fraction of the logits' spread, which a wrong slot, page or mask disturbs.
GAP_RTOL = {"float32": 1e-3, "float16": 5e-3, "bfloat16": 5e-2}

# The same tolerance for outputs served from an FP8 KV pool (``CacheConfig.kv_dtype``), by
# format: the pool rounds every K and V element to the format (relative steps of 2^-4 for
# e4m3, 2^-3 for e5m2, after the per-layer, per-head calibrated scale), which moves the
# logits far more than the model dtype's rounding does. Measured on the CPU with the demo's
# random models (scales calibrated on two prompts, greedy, 7 weight seeds of 4 layers /
# hidden 256 and 2 layers / hidden 64, 128 tokens each): the largest relative gap of a
# correct run was 0.0185 for e4m3 and 0.0267 for e5m2 (up to 8 tokens per run not the
# oracle's argmax). Each tolerance is about four times that, still a small fraction of the
# logits' spread. On a trained checkpoint (benchmarks/fp8_parity.py: a byte-level Llama trained
# on the Python standard library, 2048 greedy tokens a format) the largest relative gaps were
# 0.0455 (e4m3) and 0.0429 (e5m2), with 98% of the tokens the oracle's argmax.
GAP_RTOL_KV = {"fp8_e4m3": 0.075, "fp8_e5m2": 0.1}


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
    for group, tokens, lengths in padded_batches(sequences, rows, length, empty_length=1):
        logits = np.asarray(forward_dense(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths)))
        out.extend(logits[j, : len(s)] for j, s in enumerate(group))
    return out


@functools.partial(jax.jit, static_argnames="greedy")
def _redraw(logits, seeds, uids, positions, temperature, top_p, greedy=False):
    keys = sample_keys(seeds, uids, positions)
    return sample(logits, keys, temperature, top_p, greedy=greedy)


@jax.jit
def _draw_scores(logits, seed, uid, position, temperature, top_p):
    """f32[vocab] score of every token in :func:`~jaxattn.engine.sampling.sample`'s draw
    (the token drawn has the largest): its scaled logit plus its Gumbel noise, -inf outside
    the top-p nucleus. :func:`check_outputs` checks that the two agree before using it."""
    key = sample_keys(seed[None], uid[None], position[None])[0]
    scaled = logits / temperature
    noise = jax.random.gumbel(key, scaled.shape, jnp.float32)
    return jnp.where(nucleus(scaled, top_p), scaled + noise, -jnp.inf)


@dataclasses.dataclass
class VerifyReport:
    """``checked``: generated tokens compared; ``near_ties``: tokens accepted although not
    the oracle's choice, their logit gap being within the tolerance (rounding decides
    those); ``max_gap``: the largest logit gap of any token that differs from the oracle's
    choice, accepted or not (0 when none does), ``max_gap_tolerance``: the tolerance of its
    row, ``max_gap_at``: where it was; ``rtol``: the relative tolerance used;
    ``problems``: one line per failure."""

    checked: int = 0
    near_ties: int = 0
    max_gap: float = 0.0
    max_gap_tolerance: float = 0.0
    max_gap_at: str = ""
    rtol: float = 0.0
    problems: list = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def _judge(self, where: str, gap: float, scale: float, what: str) -> None:
        tolerance = self.rtol * max(1.0, scale)
        if gap > self.max_gap:
            self.max_gap, self.max_gap_tolerance, self.max_gap_at = gap, tolerance, where
        if gap <= tolerance:
            self.near_ties += 1
        else:
            self.problems.append(
                f"{where}: {what} (logit gap {gap:.3g} > tolerance {tolerance:.3g})"
            )

    def summary(self, outputs: int | None = None) -> str:
        """One line: the verdict, what was checked, the near-ties and the largest gap."""
        verdict = "OK" if self.ok else f"FAILED ({len(self.problems)} mismatches)"
        of = "" if outputs is None else f" of {outputs} outputs"
        line = f"{verdict}: {self.checked} tokens{of} checked"
        if self.max_gap > 0:
            line += (
                f"; {self.near_ties} near-ties accepted, largest logit gap {self.max_gap:.3g} "
                f"(tolerance there {self.max_gap_tolerance:.3g})"
            )
        return line


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
    rtol: float | None = None,
    kv_dtype=None,
) -> VerifyReport:
    """Check the outputs of ``Engine.generate(prompts, max_new_tokens, n=n, ...)``.

    Output ``k`` belongs to prompt ``k // n``. Greedy outputs must take the argmax at
    every step, sampled ones the token redrawn from the dense logits with the same key
    ``(seed, k, position)``, both up to a near-tie (see the module docstring; ``rtol``
    defaults to ``GAP_RTOL[cfg.dtype]``, or for outputs served from an FP8 pool,
    ``kv_dtype="fp8_e4m3"`` / ``"fp8_e5m2"`` (as ``CacheConfig.kv_dtype``), the larger of
    that and ``GAP_RTOL_KV[kv_dtype]``; None is a pool of the model's dtype). ``seed`` may
    also be one seed per output and ``sample_ids`` replaces ``k`` (requests queued one by one with
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
    if rtol is None:
        rtol = GAP_RTOL[cfg.dtype]
        if kv_dtype is not None:
            rtol = max(rtol, GAP_RTOL_KV[fp8_format(kv_dtype, "kv_dtype")])
    report = VerifyReport(rtol=float(rtol))
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
        scale = np.abs(rows).max(-1)
        if temperature == 0:
            best = rows.argmax(-1)
            for t, token in enumerate(out):
                if token != best[t]:
                    gap = float(rows[t, best[t]] - rows[t, token])
                    what = f"got {token}, dense argmax {best[t]}"
                    report._judge(f"output {k} token {t}", gap, float(scale[t]), what)
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
            where, what = f"output {k} token {t}", f"got {out[t]}, redrawn {drawn[t]}"
            scores = np.asarray(
                _draw_scores(
                    jnp.asarray(padded[t]),
                    jnp.int32(seeds[k]),
                    jnp.int32(sample_ids[k]),
                    jnp.int32(len(prompt) + t),
                    jnp.float32(temperature),
                    jnp.float32(top_p),
                )
            )
            if scores.argmax() != drawn[t]:  # the mirror of the draw no longer holds
                report.problems.append(f"{where}: {what}")
            elif not np.isfinite(scores[out[t]]):
                report.problems.append(f"{where}: {what}, outside the dense top-p nucleus")
            else:
                gap = temperature * float(scores[drawn[t]] - scores[out[t]])
                report._judge(where, gap, float(scale[t]), what)
    return report
