"""The verifier's near-tie rule: a token that is not the dense oracle's choice passes only
when its logit gap is within the dtype's tolerance, for greedy and for sampled tokens; the
report keeps the largest gap and the count of near-ties it accepted."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine import CFG, PARAMS  # the engine tests' model

from jaxattn.engine import Buckets, Engine, check_outputs, dense_logits
from jaxattn.engine.verify import GAP_RTOL, _draw_scores
from jaxattn.models import llama
from jaxattn.models.llama import LlamaConfig

PROMPTS = [[5, 9, 17, 3, 88, 41, 7], [100, 2, 64, 64, 13]]
MAX_NEW = 6


def generate(cfg=CFG, params=PARAMS, **kw):
    engine = Engine(
        cfg,
        params,
        num_pages=32,
        page_size=4,
        max_batch_tokens=32,
        buckets=Buckets(
            tokens=32, kv=256, extend_batch=8, decode_batch=8, pages=16, folded_cells=1
        ),
    )
    return engine.generate(PROMPTS, MAX_NEW, **kw)


def second_choice_gap(outputs, k):
    """Replace the last token of output ``k`` by the dense pass's runner-up there; return
    the outputs, the gap between the two and the tolerance scale of that row."""
    rows = dense_logits(PARAMS, CFG, [PROMPTS[k] + outputs[k]])[0]
    row = rows[len(PROMPTS[k]) + MAX_NEW - 2]
    first, second = np.argsort(-row)[:2]
    changed = [list(o) for o in outputs]
    changed[k][-1] = int(second)
    return changed, float(row[first] - row[second]), max(1.0, float(np.abs(row).max()))


def test_greedy_mismatch_is_judged_by_its_gap():
    out = generate()
    report = check_outputs(PARAMS, CFG, PROMPTS, out, max_new_tokens=MAX_NEW)
    assert report.ok and report.near_ties == 0 and report.max_gap == 0.0
    assert report.rtol == GAP_RTOL["float32"]
    assert "near-ties" not in report.summary()

    changed, gap, scale = second_choice_gap(out, 1)
    loose = check_outputs(PARAMS, CFG, PROMPTS, changed, max_new_tokens=MAX_NEW, rtol=2 * gap)
    assert loose.ok and loose.near_ties == 1
    assert loose.max_gap == pytest.approx(gap, rel=1e-5)
    assert loose.max_gap_tolerance == pytest.approx(2 * gap * scale)
    assert loose.max_gap_at == f"output 1 token {MAX_NEW - 1}"
    assert "1 near-ties accepted, largest logit gap" in loose.summary(2)

    half = 0.5 * gap / scale
    strict = check_outputs(PARAMS, CFG, PROMPTS, changed, max_new_tokens=MAX_NEW, rtol=half)
    assert not strict.ok and strict.near_ties == 0
    assert strict.problems[0].startswith(f"output 1 token {MAX_NEW - 1}: got")
    assert "logit gap" in strict.problems[0] and "> tolerance" in strict.problems[0]
    assert strict.summary(2).startswith("FAILED (1 mismatches): 12 tokens of 2 outputs checked")


def test_sampled_mismatch_is_judged_by_its_perturbed_gap():
    kw = dict(temperature=0.9, top_p=0.95, seed=11)
    out = generate(**kw)
    assert check_outputs(PARAMS, CFG, PROMPTS, out, max_new_tokens=MAX_NEW, **kw).ok

    # The token the draw would have taken second: the largest perturbed score after the
    # drawn one; its gap is the temperature times the difference of the two scores.
    k, t = 0, MAX_NEW - 1
    rows = dense_logits(PARAMS, CFG, [PROMPTS[k] + out[k]])[0]
    row = rows[len(PROMPTS[k]) + t - 1]
    scores = np.asarray(
        _draw_scores(
            jnp.asarray(row),
            jnp.int32(kw["seed"]),
            jnp.int32(k),
            jnp.int32(len(PROMPTS[k]) + t),
            jnp.float32(kw["temperature"]),
            jnp.float32(kw["top_p"]),
        )
    )
    assert scores.argmax() == out[k][t]
    runner_up = int(np.argsort(-scores)[1])
    assert np.isfinite(scores[runner_up]), "the nucleus holds a single token here"
    gap = kw["temperature"] * float(scores[out[k][t]] - scores[runner_up])
    scale = max(1.0, float(np.abs(row).max()))
    changed = [list(o) for o in out]
    changed[k][t] = runner_up

    loose = check_outputs(
        PARAMS, CFG, PROMPTS, changed, max_new_tokens=MAX_NEW, rtol=2 * gap / scale, **kw
    )
    assert loose.ok and loose.near_ties == 1
    assert loose.max_gap == pytest.approx(gap, rel=1e-4)
    strict = check_outputs(
        PARAMS, CFG, PROMPTS, changed, max_new_tokens=MAX_NEW, rtol=0.5 * gap / scale, **kw
    )
    assert not strict.ok and "redrawn" in strict.problems[0] and "logit gap" in strict.problems[0]

    # A token outside the dense top-p nucleus is never a near-tie.
    outside = int(np.flatnonzero(~np.isfinite(scores))[0])
    changed[k][t] = outside
    report = check_outputs(PARAMS, CFG, PROMPTS, changed, max_new_tokens=MAX_NEW, rtol=1e9, **kw)
    assert not report.ok and "outside the dense top-p nucleus" in report.problems[0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_verify_with_their_tolerance(dtype):
    cfg = LlamaConfig(**{**CFG.__dict__, "dtype": dtype})
    params = llama.init_params(cfg, jax.random.key(0))
    out = generate(cfg, params)
    report = check_outputs(params, cfg, PROMPTS, out, max_new_tokens=MAX_NEW)
    assert report.rtol == GAP_RTOL[dtype]
    assert report.ok, report.problems
    assert report.max_gap <= report.max_gap_tolerance


def test_tolerances_grow_as_precision_falls():
    assert GAP_RTOL["float32"] < GAP_RTOL["float16"] < GAP_RTOL["bfloat16"] < 0.1
