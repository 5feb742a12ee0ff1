"""When cascade decode beats paged decode: a cost model of both, for a serving engine's switch.

Host side, numpy only: an engine decides per batch, from the shapes it is about to launch,
whether :func:`jaxattn.cascade_attention` (each shared prefix read once) or
:func:`jaxattn.paged_attention` over the joined tables (each request reads its whole context)
is faster. Both are modelled as linear in what they must do::

    paged   = paged_fixed_us + unique_bytes / paged_bytes_per_us
              + repeated_bytes / paged_repeat_bytes_per_us
    cascade = cascade_fixed_us + rows * cascade_row_us + unique_bytes / cascade_bytes_per_us
              + prefix_flops / cascade_flops_per_us

* ``joined_bytes``: the K/V bytes paged decode reads: every request's prefix and own tokens;
* ``unique_bytes``: what cascade decode must read: every prefix a request continues once,
  every own token once;
* ``repeated_bytes``: ``joined_bytes - unique_bytes``, the prefix bytes paged decode reads
  again for the second and later requests on a prefix. Those reads come at a rate of their
  own: the requests' blocks read the same pages at about the same time, and the later reads
  find many of them in the L2 (on an H200, round 42 of ``benchmarks/RESULTS.md``: 64
  requests on a 4096-token prefix with 256 own tokens each took 212 us of paged decode, which
  the single-rate model put at 271 us, above the read ceiling);
* ``rows``: query rows (requests x query heads), each of which writes and reads a partial
  state per part in the merge;
* ``prefix_flops``: Q K^T and P V of every query head over its prefix (the prefix level is
  a dense product of many query rows, and compute bound when the prefix is long and shared
  by many requests).

The default constants are estimates for an H200 (bf16, head_dim 128, Hq/Hkv 32/8);
``benchmarks/bench_cascade.py --fit`` measures both ops over a grid of batches and fits
them, writing ``cost_model`` into its JSON (:meth:`CascadeCostModel.from_json` reads it).
:func:`cascade_pays_off` asks for a predicted gain of at least ``margin`` so that a model
error of that size never makes a batch slower than paged decode.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "CascadeCostModel",
    "cascade_cost",
    "cascade_features",
    "cascade_may_pay_off",
    "cascade_pays_off",
]


@dataclasses.dataclass(frozen=True)
class CascadeCostModel:
    """The constants of the two time models (see the module docstring); ``margin``: the
    predicted relative gain below which paged decode is kept."""

    paged_fixed_us: float = 6.0
    paged_bytes_per_us: float = 4.3e6
    paged_repeat_bytes_per_us: float = 5.7e6
    cascade_fixed_us: float = 14.0
    cascade_row_us: float = 1.0e-3
    cascade_bytes_per_us: float = 4.0e6
    cascade_flops_per_us: float = 3.0e8
    margin: float = 0.1

    @classmethod
    def from_json(cls, source) -> CascadeCostModel:
        """From a dict, a JSON text (it starts with ``{``), or the path of a JSON file written
        by bench_cascade.py (its ``cost_model`` entry). ValueError when it holds no field of
        the model."""
        if isinstance(source, os.PathLike) or (
            isinstance(source, str) and not source.lstrip().startswith("{")
        ):
            source = Path(source).read_text()
        if isinstance(source, str):
            source = json.loads(source)
        if not isinstance(source, dict):
            raise ValueError(f"a cost model must be a JSON object, got {type(source).__name__}")
        source = source.get("cost_model", source)
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: float(v) for k, v in source.items() if k in names}
        if not known:
            raise ValueError(
                "no cost model in it (none of "
                f"{sorted(names)}; bench_cascade.py --fit --json FILE writes one)"
            )
        return cls(**known)

    def pays_off(self, features: dict) -> bool:
        """The switch's rule on a batch's :func:`cascade_features`: cascade predicted faster
        than paged decode by at least ``margin`` (and finite)."""
        cascade, paged = self.predict(features)
        return bool(cascade <= (1.0 - self.margin) * paged and math.isfinite(cascade))

    def predict(self, features: dict) -> tuple[float, float]:
        """(cascade microseconds, paged microseconds) for a batch's
        :func:`cascade_features`."""
        repeated = features["joined_bytes"] - features["unique_bytes"]
        paged = (
            self.paged_fixed_us
            + features["unique_bytes"] / self.paged_bytes_per_us
            + repeated / self.paged_repeat_bytes_per_us
        )
        cascade = (
            self.cascade_fixed_us
            + features["rows"] * self.cascade_row_us
            + features["unique_bytes"] / self.cascade_bytes_per_us
            + features["prefix_flops"] / self.cascade_flops_per_us
        )
        return cascade, paged


def cascade_features(
    prefix_lens: Sequence[int],
    prefix_of: Sequence[int],
    own_lens: Sequence[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    itemsize: int = 2,
) -> dict:
    """What each op must do for a batch: ``joined_bytes``, ``unique_bytes``,
    ``repeated_bytes``, ``rows``, ``prefix_flops`` (see the module docstring). prefix_lens:
    tokens of each prefix; prefix_of: the prefix each request continues (-1: none);
    own_lens: own tokens."""
    prefix_lens = np.asarray(prefix_lens, np.int64)
    prefix_of = np.asarray(prefix_of, np.int64)
    own = np.asarray(own_lens, np.int64)
    has = prefix_of >= 0
    idx = np.clip(prefix_of, 0, max(len(prefix_lens) - 1, 0))
    lens_of = prefix_lens[idx] if len(prefix_lens) else 0 * prefix_of
    per_request = np.where(has, lens_of, 0)
    token_bytes = 2 * num_kv_heads * head_dim * itemsize
    used = np.unique(prefix_of[has])
    joined = float((per_request + own).sum() * token_bytes)
    unique = float((prefix_lens[used].sum() + own.sum()) * token_bytes)
    return dict(
        joined_bytes=joined,
        unique_bytes=unique,
        repeated_bytes=joined - unique,
        rows=float(len(own) * num_q_heads),
        prefix_flops=float(4 * num_q_heads * head_dim * per_request.sum()),
    )


def cascade_cost(
    prefix_lens,
    prefix_of,
    own_lens,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    itemsize: int = 2,
    model: CascadeCostModel | None = None,
) -> tuple[float, float]:
    """(cascade microseconds, paged microseconds) the model predicts for a batch."""
    f = cascade_features(
        prefix_lens,
        prefix_of,
        own_lens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        itemsize=itemsize,
    )
    return (model or CascadeCostModel()).predict(f)


def cascade_pays_off(
    prefix_lens,
    prefix_of,
    own_lens,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    itemsize: int = 2,
    model: CascadeCostModel | None = None,
) -> bool:
    """Whether cascade decode is predicted faster than paged decode for this batch by at
    least the model's margin (the engine's switch; see the module docstring).

    prefix_lens: tokens of each prefix; prefix_of: the prefix each request continues (-1:
    none); own_lens: each request's tokens after its prefix. A batch where no prefix is
    shared never pays off: cascade then reads what paged decode reads, plus the merge."""
    prefix_of = np.asarray(prefix_of)
    shared = prefix_of[prefix_of >= 0]
    if len(shared) == len(np.unique(shared)):
        return False
    f = cascade_features(
        prefix_lens,
        prefix_of,
        own_lens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        itemsize=itemsize,
    )
    return (model or CascadeCostModel()).pays_off(f)


def cascade_may_pay_off(
    context_lens,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    itemsize: int = 2,
    model: CascadeCostModel | None = None,
) -> bool:
    """False when no choice of shared prefixes can make :func:`cascade_pays_off` true for
    requests of these context lengths (each one's prefix plus own tokens): cascade's fixed
    and per-row costs alone already exceed what the margin allows against paged decode at
    the most it can take for these lengths (every byte at the slower of its two rates). A
    test an engine can ask before it looks for shared prefixes at all. (True, undecided, for
    a model whose byte or FLOP rates are not positive: the bound needs those terms >= 0.)"""
    m = model or CascadeCostModel()
    rates = (m.cascade_bytes_per_us, m.cascade_flops_per_us, m.paged_bytes_per_us,
             m.paged_repeat_bytes_per_us)  # fmt: skip
    if min(rates) <= 0:
        return True
    ctx = np.asarray(context_lens, np.int64)
    f = cascade_features(
        [],
        np.full(len(ctx), -1),
        ctx,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        itemsize=itemsize,
    )
    # paged decode's bytes are the lengths' whatever the prefixes, its time at most all of
    # them at the slower rate; cascade's time without the byte and FLOP terms (>= 0 whatever
    # the prefixes) is its floor.
    slower = min(m.paged_bytes_per_us, m.paged_repeat_bytes_per_us)
    paged = m.paged_fixed_us + f["joined_bytes"] / slower
    floor, _ = m.predict({**f, "unique_bytes": 0.0, "prefix_flops": 0.0})
    return bool(floor <= (1.0 - m.margin) * paged)
