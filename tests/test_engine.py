"""The serving engine.

Two kinds of tests:

* with the real model: greedy outputs equal the dense no-cache forward token for token
  (prefix hits, chunked prefill, preemption, n > 1, batch order, layouts), sampled
  outputs equal a redraw from the dense logits with the same keys, one step per dispatch
  or several, planned ahead or not, the number of compiled programs stays bounded, and
  the pool is whole afterwards;
* with a stand-in model over a simulated pool (no JAX): random workloads from
  hypothesis (tiny pools, odd page sizes, chunk budgets, forks, stop tokens, steps per
  dispatch, overlap) where the stand-in keeps the decode rows as the device does, checks
  every position it reads and derives the next token from what it read, so a lost,
  misplaced or overwritten slot, or a row the engine forgot to update, changes the
  outputs.

Every engine here runs with ``debug=True``: each step checks every page reference, that no
written page is shared, and that the device's decode rows hold the host's block tables.
"""

from __future__ import annotations

import collections
import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec

from jaxattn import sharding
from jaxattn.engine import (
    Buckets,
    CacheConfig,
    Engine,
    ExecutionConfig,
    RequestError,
    SchedulerConfig,
    StepOutput,
    bucket,
    check_outputs,
)
from jaxattn.models import llama
from jaxattn.models.llama import LlamaConfig
from jaxattn.paging import PageTable

CFG = LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
PARAMS = llama.init_params(CFG, jax.random.key(0))
# One pool shape and bucket floors for most tests, so that their engines share programs.
POOL = dict(num_pages=48, page_size=4)
# folded_cells=1: the step programs take two table entries a decode row (the alone
# dispatch of larger row updates is then exercised by small prompts).
BUCKETS = Buckets(tokens=32, kv=256, extend_batch=8, decode_batch=8, pages=16, folded_cells=1)


def make_engine(cfg=CFG, params=PARAMS, **kw):
    # dedup_tokens=4: a request sharing a page or more with a prompt still being prefilled
    # waits for its pages (with overlap, that prompt's pages reach the cache a step later).
    args = dict(POOL, max_batch_tokens=32, buckets=BUCKETS, debug=True, dedup_tokens=4)
    args.update(kw)
    return Engine(cfg, params, **args)


def workload(seed, num=6, system=18, suffix=(1, 14)):
    """Prompts sharing a system prompt (some twice), plus a one-token prompt."""
    rng = np.random.default_rng(seed)
    sys_prompt = rng.integers(0, CFG.vocab_size, system).tolist()
    prompts = [
        sys_prompt + rng.integers(0, CFG.vocab_size, rng.integers(*suffix)).tolist()
        for _ in range(num - 2)
    ]
    return prompts + [prompts[0], [int(rng.integers(0, CFG.vocab_size))]]


def assert_verified(prompts, outputs, max_new, **kw):
    report = check_outputs(PARAMS, CFG, prompts, outputs, max_new_tokens=max_new, **kw)
    assert report.ok, report.problems[:5]
    assert report.checked == sum(len(o) for o in outputs)
    return report


def assert_whole(engine):
    engine.check_idle()
    stats = engine.stats
    assert stats["pages_in_use"] == stats["cached_pages"]


# --- the real model ------------------------------------------------------------------


def test_greedy_matches_dense_with_prefix_hits_chunks_and_any_order():
    prompts = workload(0)
    engine = make_engine()
    out = engine.generate(prompts, 10)
    assert_verified(prompts, out, 10)
    assert_whole(engine)
    stats = engine.stats
    # The shared system prompt was computed once: later requests hit it.
    assert stats["prefix_hit_tokens"] >= 16 * 3
    assert stats["prefill_tokens"] + stats["prefix_hit_tokens"] == stats["prompt_tokens"]
    # Long prompts were chunked (32 tokens per step): more extend steps than requests.
    assert stats["extend_calls"] > 1
    assert stats["generated_tokens"] == sum(len(o) for o in out) == 10 * len(prompts)
    # The auto policy's pick: the reference on the CPU, a kernel backend on a GPU.
    auto = "reference" if jax.default_backend() == "cpu" else ("pallas", "native")
    assert set(stats["attention_backend"]) == {"extend", "decode"}
    for backend in stats["attention_backend"].values():
        assert backend == auto if isinstance(auto, str) else backend in auto
    if auto == "reference":  # a backend without lowerings
        assert stats["attention_lowering"] == {"extend": None, "decode": None}

    # Again on the warm cache, in another order: whole prompts (and the previous
    # outputs' pages) are hits now, and the outputs are the same.
    order = [3, 5, 0, 2, 4, 1]
    before = dict(stats)
    again = engine.generate([prompts[i] for i in order], 10)
    assert again == [out[i] for i in order]
    stats = engine.stats
    computed = stats["prefill_tokens"] - before["prefill_tokens"]
    assert computed <= len(prompts) * 4  # at most the partial last page of each prompt
    assert_whole(engine)


def test_chunked_prefill_and_no_radix_give_the_same_outputs():
    prompts = workload(1, num=4, system=40, suffix=(20, 30))
    ref = make_engine(max_batch_tokens=256).generate(prompts, 6)
    for kw in (dict(max_batch_tokens=7), dict(radix_cache=False, max_batch_tokens=20)):
        engine = make_engine(**kw)
        assert engine.generate(prompts, 6) == ref
        assert_whole(engine)
        if not kw.get("radix_cache", True):
            assert engine.stats["prefix_hit_tokens"] == 0
            assert engine.stats["prefill_tokens"] == sum(len(p) for p in prompts)
    assert_verified(prompts, ref, 6)


def test_preemption_under_a_tiny_pool_loses_nothing():
    prompts = workload(2, num=8, system=10, suffix=(4, 12))
    engine = make_engine(new_token_ratio=0.0, max_running=8)
    out = engine.generate(prompts, 24)  # 8 * ~40 tokens in a 192-slot pool
    stats = engine.stats
    assert stats["preemptions"] > 0 and stats["evicted_tokens"] > 0
    # A preemption needs the exact state: the dispatch in flight is read first.
    assert stats["syncs"] > 0
    assert stats["peak_pages_in_use"] == POOL["num_pages"]
    assert_verified(prompts, out, 24)
    assert_whole(engine)
    # Without the cache a preempted sequence recomputes everything; same outputs.
    engine = make_engine(new_token_ratio=0.0, max_running=8, radix_cache=False)
    assert engine.generate(prompts, 24) == out
    assert engine.stats["preemptions"] > 0
    assert_whole(engine)


def test_parallel_sampling_forks_and_copies_on_write():
    prompts = workload(3, num=4, system=9, suffix=(2, 6))  # lengths not multiples of 4
    engine = make_engine()
    greedy = engine.generate(prompts, 8, n=2)
    for i in range(len(prompts)):
        assert greedy[2 * i] == greedy[2 * i + 1]
    assert_verified(prompts, greedy, 8, n=2)
    stats = engine.stats
    assert stats["forks"] == len(prompts) and stats["cow_copies"] > 0
    assert_whole(engine)

    kw = dict(n=2, temperature=0.8, top_p=0.9, seed=7)
    sampled = engine.generate(prompts, 8, **kw)
    assert_verified(prompts, sampled, 8, **kw)
    assert any(sampled[2 * i] != sampled[2 * i + 1] for i in range(len(prompts)))
    # Draws depend on (seed, output, position) only: another schedule, same tokens.
    other = make_engine(max_batch_tokens=5, radix_cache=False)
    assert other.generate(prompts, 8, **kw) == sampled
    assert_whole(engine)
    assert_whole(other)


MODES = {
    "sync": dict(overlap=False, decode_steps=1),
    "overlap": dict(overlap=True, decode_steps=1),
    "multistep": dict(overlap=True, decode_steps=4),
    "multistep-sync": dict(overlap=False, decode_steps=8),
    "device-paging": dict(overlap=True, decode_steps=4, device_paging=True),
    # The GPU's form of the layers (straight-line, per-layer weights); the CPU's is a scan.
    "unrolled": dict(overlap=True, decode_steps=4, unroll_layers=True),
}


@pytest.mark.parametrize("mode", MODES)
def test_step_modes_give_the_same_tokens(mode):
    """Greedy and sampled outputs (forks, stop tokens included) do not depend on how many
    steps a dispatch runs or on planning a step while the previous one runs."""
    prompts = workload(8, num=5, system=10, suffix=(1, 9))
    stop = 17
    base = make_engine(**MODES["sync"], eos_token_id=stop, max_batch_tokens=24)
    engine = make_engine(**MODES[mode], eos_token_id=stop, max_batch_tokens=24)
    for kw in (dict(n=1), dict(n=2, temperature=0.9, top_p=0.8, seed=3)):
        want = base.generate(prompts, 14, **kw)
        assert engine.generate(prompts, 14, **kw) == want
        assert_verified(prompts, want, 14, stop_ids=[stop], **kw)
        assert_whole(engine)
    stats = engine.stats
    steps = MODES[mode]["decode_steps"]
    if steps > 1:  # several steps per dispatch where nothing needed the host
        assert stats["decode_steps"] > stats["decode_calls"]
    else:
        assert stats["decode_steps"] == stats["decode_calls"]
    assert stats["decode_tokens"] == base.stats["decode_tokens"]


def test_config_records_and_keywords_are_the_same_engine():
    prompts = workload(9, num=4)
    flat = make_engine(max_running=4, decode_steps=2, overlap=False)
    records = Engine(
        CFG,
        PARAMS,
        cache=CacheConfig(num_pages=POOL["num_pages"], page_size=POOL["page_size"]),
        scheduler=SchedulerConfig(
            max_batch_tokens=32, max_running=4, dedup_tokens=4, decode_steps=2, overlap=False
        ),
        execution=ExecutionConfig(buckets=BUCKETS),
        debug=True,
    )
    assert records.cache_config == flat.cache_config
    assert records.scheduler_config == flat.scheduler_config
    assert records.execution_config == flat.execution_config
    assert records.generate(prompts, 6) == flat.generate(prompts, 6)
    assert records.stats["steps"] == flat.stats["steps"]


def test_one_memory_model():
    """Block tables and the radix cache hold pages of one ref-counted allocator: the cache
    frees through the allocator's slot view, and a page returns to the free list only when
    its last holder (table or cache) lets go."""
    engine = make_engine()
    kv = engine.kv
    assert kv.cache.pool is kv.allocator.slots and kv.blocks.allocator is kv.allocator
    prompts = workload(10, num=4, system=16, suffix=(1, 6))
    engine.add_request(prompts[0], 40, tag="long")
    for _ in range(3):
        engine.step()  # its prompt is in the cache and its table holds the same pages
    (seq,) = engine.scheduler.running
    shared = kv.table(seq.seq_id)[:4]
    assert set(shared) <= kv.cached_pages()
    assert all(kv.allocator.ref_count(p) == 2 for p in shared)
    freed = kv.cache.evict(10**6)  # the locked path stays
    assert freed == 0 and all(kv.allocator.ref_count(p) == 2 for p in shared)
    while engine.has_work():
        engine.step()
    assert all(kv.allocator.ref_count(p) == 1 for p in shared)  # the cache's alone
    assert kv.cache.evict(10**6) > 0
    assert all(kv.allocator.ref_count(p) == 0 for p in shared)
    assert kv.allocator.num_free == POOL["num_pages"]
    assert_whole(engine)


def test_prefixes_are_shared_in_the_step_that_computes_them():
    """With cache_on_plan (the default), a prompt's pages enter the cache when its prefill is
    planned: requests submitted together behind one system prompt are all admitted in the
    first step, the later ones hitting pages that step computes (every chunk writes its K/V
    before any attends), instead of waiting a step for them."""
    prompts = workload(11, num=6, system=16, suffix=(2, 6))
    kw = dict(max_batch_tokens=256)
    now = make_engine(**kw)
    out = now.generate(prompts, 6)
    assert_verified(prompts, out, 6)
    assert_whole(now)
    later = make_engine(cache_on_plan=False, **kw)
    assert later.generate(prompts, 6) == out
    assert_whole(later)
    a, b = now.stats, later.stats
    # One extend call admits everything; the system prompt (4 pages) is computed once.
    assert a["extend_calls"] == 1 < b["extend_calls"]
    assert a["steps"] < b["steps"]
    assert a["prefix_hit_tokens"] >= 16 * (len(prompts) - 2)
    assert a["prefill_tokens"] + a["prefix_hit_tokens"] == a["prompt_tokens"]
    assert a["prefill_tokens"] <= b["prefill_tokens"]


def test_publish_refuses_pages_the_cache_holds_elsewhere():
    """KVCacheManager.publish inserts a planned prefill's whole pages and moves the lock to
    them, unless the cache already holds some of those tokens in other pages (adopting them
    would redirect this step's writes): then nothing changes."""
    engine = make_engine()
    kv = engine.kv
    tokens = np.arange(100, 112)
    kv.allocate("a", 12, kv.match(tokens[:-1]))
    assert kv.publish("a", tokens, 6) == kv.table("a")[:1]  # one whole page of 4
    assert kv.cached_len("a") == 4 and kv.prefix_len(tokens) == 4
    assert kv.publish("a", tokens, 7) == []  # still one whole page
    assert kv.publish("a", tokens, 12) == kv.table("a")[1:3]
    kv.check_invariants(["a"])
    # "b" computes the same tokens in pages of its own (admitted before "a" published).
    kv.allocate("b", 12, kv.match(tokens[:0]))
    pages_b, free = kv.table("b"), kv.allocator.num_free
    assert kv.publish("b", tokens, 12) == []
    assert kv.table("b") == pages_b and kv.cached_len("b") == 0
    assert kv.allocator.num_free == free
    kv.check_invariants(["a", "b"])
    for seq_id in ("a", "b"):
        kv.release(seq_id, tokens, 12, keep=True)
    kv.check_invariants([])


def test_stop_tokens():
    prompts = workload(4, num=4)
    full = make_engine(eos_token_id=None).generate(prompts, 8)
    eos = full[0][2]
    engine = make_engine(eos_token_id=eos)
    out = engine.generate(prompts, 8)
    for o, f in zip(out, full, strict=True):
        cut = f.index(eos) + 1 if eos in f else len(f)
        assert o == f[:cut]
    assert len(out[0]) <= 3
    assert_verified(prompts, out, 8, stop_ids=[eos])
    assert engine.generate(prompts, 8, ignore_eos=True) == full
    assert_whole(engine)


def test_non_finite_logits_end_the_request_with_an_error():
    """One NaN in an embedding row: the requests whose tokens use it end with an error that
    names them (never plausible tokens); the others are served; the pool stays whole."""
    bad_token = 7
    params = dict(PARAMS, embed=PARAMS["embed"].at[bad_token, 3].set(float("nan")))
    engine = Engine(CFG, params, **POOL, max_batch_tokens=32, buckets=BUCKETS, debug=True)
    prompts = [[1, 2, 3, 4, 5], [9, bad_token, 10], [11, 12]]
    with pytest.raises(RequestError, match=r"prompts\[1\] failed: .*not finite") as info:
        engine.generate(prompts, 6, ignore_eos=True)
    err = info.value
    assert set(err.failed) == {1} and err.outputs[1] == []
    clean = make_engine().generate([prompts[0], prompts[2]], 6, ignore_eos=True)
    assert [err.outputs[0], err.outputs[2]] == clean
    assert_whole(engine)
    # Through step(): the status is on the finished sequence.
    seq = engine.add_request([bad_token], 4)
    done = []
    while engine.has_work():
        done += engine.step()
    assert done == [seq] and seq.finish_reason == "error" and "not finite" in seq.error
    assert_whole(engine)


def test_compiled_programs_stay_bounded():
    """A 110-token generation compiles one decode program per power-of-two table width,
    whatever the number of steps each dispatch runs (a dynamic trip count), and at most a
    few small row-update programs (none here: every step's updates ride with its first
    program); running it again compiles nothing."""
    engine = make_engine(
        num_pages=8, page_size=16, buckets=Buckets(tokens=16, kv=16, pages=1, decode_batch=1)
    )
    prompt = workload(5)[0][:9]
    out = engine.generate([prompt], 110, ignore_eos=True)
    assert len(out[0]) == 110
    # 118 tokens -> 8 pages: widths 1, 2, 4, 8 at most (a dispatch of 8 steps from
    # position 9 already needs two pages).
    before = collections.Counter(engine.runner.trace_counts)
    counts = dict(before)
    assert counts.pop("update", 0) <= 2 and counts.pop("decode") <= 4
    assert counts == dict(extend=1)
    stats = engine.stats
    assert stats["decode_steps"] == 109 and stats["decode_calls"] <= -(-109 // 8) + 1
    assert engine.generate([prompt], 110, ignore_eos=True) == out
    assert engine.runner.trace_counts == before
    assert_verified([prompt], out, 110)
    assert_whole(engine)


def test_row_updates_folded_or_alone():
    """A step's row updates ride with its first program when they fit its folded shapes
    (every row once, two table entries a row) and are dispatched alone before it otherwise
    (here: four prompts of three pages admitted at once into four rows, 12 entries > 8);
    the outputs are the no-cache recompute's either way."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, CFG.vocab_size, 40).tolist() for _ in range(4)]
    engine = make_engine(max_running=4, max_batch_tokens=256)
    out = engine.generate(prompts, 20)
    counts = engine.runner.update_counts
    assert counts["alone"] >= 1 and counts["folded"] >= 1, counts
    assert engine.runner.trace_counts["update"] >= 1
    assert_verified(prompts, out, 20)
    assert_whole(engine)


@pytest.mark.parametrize("layout", ["vllm", "bhsd"])
def test_other_layouts_through_prefix_prefill(layout):
    prompts = workload(6, num=3, system=6, suffix=(1, 5))
    engine = make_engine(layout=layout)
    assert engine.runner.extend_attention == "prefix_prefill"
    out = engine.generate(prompts, 5, n=2)
    assert_verified(prompts, out, 5, n=2)
    assert_whole(engine)


def test_verify_reports_a_wrong_token():
    prompts = workload(0)[:2]
    out = make_engine().generate(prompts, 6)
    bad = [list(o) for o in out]
    bad[1][3] = (bad[1][3] + 1) % CFG.vocab_size
    report = check_outputs(PARAMS, CFG, prompts, bad, max_new_tokens=6)
    assert not report.ok and "output 1 token 3" in report.problems[0]
    report = check_outputs(PARAMS, CFG, prompts, [o[:4] for o in out], max_new_tokens=6)
    assert not report.ok and "stops at 4" in report.problems[0]


def test_token_ids_every_form():
    """The prompt check's fast paths (integer arrays, plain int lists) and its general one
    accept and refuse the same prompts."""
    from jaxattn.engine.config import token_ids

    ok = [
        [0, 5, 9],
        np.array([0, 5, 9], np.int32),
        np.array([0, 5, 9], np.uint8),
        (0, 5, 9),
        [np.int64(0), 5, np.int32(9)],
    ]
    for prompt in ok:
        got = token_ids("p", prompt, 10)
        assert got == [0, 5, 9] and all(type(t) is int for t in got), prompt
    bad = [
        [],
        [0, 10],
        [-1, 2],
        np.array([0, 10]),
        np.array([-1, 2]),
        np.array([], np.int32),
        [0, True],
        [True],
        np.array([True, False]),
        [0, 1.0],
        np.array([0.0, 1.0]),
        np.array([[0, 1]]),
        "01",
        [0, np.int64(10)],
    ]
    for prompt in bad:
        with pytest.raises(ValueError, match="^p must"):
            token_ids("p", prompt, 10)


def test_bad_arguments():
    engine = make_engine()
    cases = [
        (lambda: engine.generate([[]], 4), ValueError, r"prompts\[0\]"),
        (lambda: engine.generate([[1], [1000]], 4), ValueError, r"prompts\[1\]"),
        (lambda: engine.generate([[1] * 190], 8), ValueError, "num_pages"),
        (lambda: engine.generate([[1]], 0), ValueError, "max_new_tokens"),
        (lambda: engine.generate([[1], [2]], [3]), ValueError, "max_new_tokens"),
        (lambda: engine.generate([[1]], 4, n=0), ValueError, "n must"),
        (lambda: engine.generate([[1]], 4, temperature=-1.0), ValueError, "temperature"),
        (lambda: engine.generate([[1]], 4, top_p=0.0), ValueError, "top_p"),
        (lambda: engine.generate([[1]], 4, seed=-1), ValueError, "seed"),
        (lambda: engine.generate("abc", 4), TypeError, "prompts"),
        (lambda: make_engine(num_pages=0), ValueError, "num_pages"),
        (lambda: make_engine(eos_token_id=500), ValueError, "eos_token_id"),
        (lambda: make_engine(policy="random"), ValueError, "policy"),
        (lambda: make_engine(layout="bhsd", extend_attention="extend"), ValueError, "bshd"),
        (lambda: Engine({"vocab_size": 3}, PARAMS, num_pages=4), TypeError, "cfg"),
        (lambda: engine.generate([[1]], 4, n=65), ValueError, "max_running=64"),
        (lambda: make_engine(decode_steps=0), ValueError, "decode_steps"),
        (lambda: make_engine(cache=CacheConfig(num_pages=8)), TypeError, "num_pages= inside"),
        (lambda: make_engine(num_page=8), TypeError, "unexpected keyword argument 'num_page'"),
        (lambda: Engine(CFG, PARAMS), TypeError, "num_pages"),
        (lambda: make_engine(scheduler=dict(max_running=4)), TypeError, "SchedulerConfig"),
        (lambda: CacheConfig(num_pages=4, layout="thd"), ValueError, "layout"),
        (lambda: ExecutionConfig(extend_attention="flash"), ValueError, "extend_attention"),
        (lambda: ExecutionConfig(decode_linear="cublas"), ValueError, "decode_linear"),
        (lambda: ExecutionConfig(kv_write="pallas"), ValueError, "kv_write"),
        (
            lambda: ExecutionConfig(pallas_decode_lowering="cuda"),
            ValueError,
            "pallas_decode_lowering",
        ),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
    assert not engine.has_work()  # a refused request is never queued
    assert_whole(engine)


def test_pallas_decode_lowering_is_the_engines_choice():
    """ExecutionConfig.pallas_decode_lowering: the Pallas decode's lowering in every decode
    step, Triton by default, reported in the stats; other backends have none to choose."""
    assert make_engine(implementation="pallas").stats["attention_lowering"]["decode"] == "triton"
    engine = make_engine(implementation="pallas", pallas_decode_lowering="mosaic_gpu")
    assert engine.stats["attention_lowering"]["decode"] == "mosaic_gpu"
    engine = make_engine(implementation="reference", pallas_decode_lowering="mosaic_gpu")
    assert engine.stats["attention_lowering"]["decode"] is None


def test_native_decode_projections_match_xla():
    """decode_linear='native': the decode step's projections (QKV, output, MLP, LM head) go
    through jaxattn.native.linear at 1-2 decode rows (the CPU handler here; on a GPU the
    kernel, which takes 16-bit weights: the model runs in bfloat16 there). Two running
    requests and a one-row bucket floor make every decode step 1 or 2 rows. Both choices
    verify against the dense model; on the CPU (float32) their greedy outputs are the same."""
    from jaxattn import native

    if not native.is_available():
        pytest.skip("the native library is not built")
    cfg, params = CFG, PARAMS
    if jax.default_backend() != "cpu":
        cfg = dataclasses.replace(CFG, dtype="bfloat16")
        params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), PARAMS)
    prompts = workload(3)
    buckets = dataclasses.replace(BUCKETS, decode_batch=1)
    args = dict(POOL, max_batch_tokens=32, buckets=buckets, max_running=2, debug=True)
    outs = {}
    for choice in ("xla", "native", "hybrid"):
        engine = Engine(cfg, params, decode_linear=choice, **args)
        assert engine.runner.decode_linear == choice
        outs[choice] = engine.generate(prompts, 6)
        assert_whole(engine)
        report = check_outputs(params, cfg, prompts, outs[choice], max_new_tokens=6)
        assert report.ok, report.problems[:5]
    if jax.default_backend() == "cpu":
        assert outs["native"] == outs["hybrid"] == outs["xla"]
    # auto: XLA's dot, one-row steps padded to two rows on GPUs (llama._padded_linear).
    auto = "xla" if jax.default_backend() == "cpu" else "pad"
    engine = Engine(cfg, params, **args)
    assert engine.runner.decode_linear == engine.stats["decode_linear"] == auto
    if jax.device_count() >= 2:
        with pytest.raises(ValueError, match="tensor parallelism"):
            Engine(cfg, params, decode_linear="native", mesh=mesh_of(2), **args)


def test_native_kv_writes_match_xla():
    """kv_write='native': every step's K/V stores go through the native write kernel (the
    CPU handler here): the same greedy outputs as XLA's scatters, verified against the dense
    model. "auto" is the native kernel on GPUs and XLA's scatters on the CPU."""
    from jaxattn import native

    if not native.is_available():
        pytest.skip("the native library is not built")
    prompts = workload(5)
    outs = {}
    for choice in ("native", "reference"):
        engine = make_engine(kv_write=choice, decode_steps=4)
        assert engine.runner.kv_write == engine.stats["kv_write"] == choice
        outs[choice] = engine.generate(prompts, 6)
        assert_whole(engine)
    assert_verified(prompts, outs["native"], 6)
    if jax.default_backend() == "cpu":
        assert outs["native"] == outs["reference"]
    auto = "reference" if jax.default_backend() == "cpu" else "native"
    assert make_engine(decode_steps=4).runner.kv_write == auto


def test_fused_rope_matches_the_separate_rotation():
    """fused_rope: each layer's q/k rotation and K/V stores in one pass (the native kernel's
    CPU handler here), in extend, decode and cascade steps: the same greedy outputs as the
    rotation in XLA followed by the write, verified against the dense model. None turns it
    on exactly where the write is the native kernel on one device."""
    from jaxattn import native

    if not native.is_available():
        pytest.skip("the native library is not built")
    prompts = workload(11, num=6, system=24, suffix=(1, 9))
    outs = {}
    for fused in (True, False):
        engine = make_engine(
            kv_write="native", fused_rope=fused, decode_steps=4, cascade="on", cascade_min_tokens=8
        )
        assert engine.runner.fused_rope == engine.stats["fused_rope"] == fused
        outs[fused] = engine.generate(prompts, 6)
        assert_whole(engine)
        assert engine.stats["cascade_steps"] > 0
    assert_verified(prompts, outs[True], 6)
    if jax.default_backend() == "cpu":
        assert outs[True] == outs[False]
    assert make_engine(kv_write="native").runner.fused_rope
    assert not make_engine(kv_write="reference").runner.fused_rope
    assert make_engine(kv_write="reference", fused_rope=True).runner.fused_rope
    auto = jax.default_backend() != "cpu"  # the native write is auto's choice on GPUs only
    assert make_engine().runner.fused_rope == auto


def test_fused_norm_matches_the_separate_add_and_norm():
    """fused_norm: each residual add and its RMSNorm in one native kernel (the CPU handler
    here) with straight-line layers: the outputs verified against the dense model, the same
    greedy tokens as XLA's add and norm. None (the default) is off."""
    from jaxattn import native

    if not native.is_available():
        pytest.skip("the native library is not built")
    prompts = workload(7)
    outs = {}
    for fused in (True, False):
        engine = make_engine(fused_norm=fused, unroll_layers=True, decode_steps=4)
        assert engine.runner.fused_norm == engine.stats["fused_norm"] == fused
        outs[fused] = engine.generate(prompts, 6)
        assert_whole(engine)
    assert_verified(prompts, outs[True], 6)
    if jax.default_backend() == "cpu":
        assert outs[True] == outs[False]
    assert not make_engine(unroll_layers=True).runner.fused_norm
    with pytest.raises(ValueError, match="straight-line layers"):
        make_engine(fused_norm=True, unroll_layers=False)


def test_split_k_partials_match_the_fused_kernels_alone():
    """split_k: the decode projections before the fused rope and norm kernels hand them
    split-K partial sums (the CPU handlers sum them): outputs verified against the dense
    model, with cascade decode steps too; the same greedy tokens as without. It needs one of
    those kernels."""
    from jaxattn import native

    if not native.is_available():
        pytest.skip("the native library is not built")
    prompts = workload(8)
    outs = {}
    common = dict(unroll_layers=True, decode_steps=4, kv_write="native", cascade="on")
    for split in (2, None):
        engine = make_engine(
            fused_norm=True, fused_rope=True, split_k=split, cascade_min_tokens=8, **common
        )
        assert engine.runner.split_k == engine.stats["split_k"] == (split or False)
        outs[split] = engine.generate(prompts, 6)
        assert_whole(engine)
        assert engine.stats["cascade_steps"] > 0
    assert_verified(prompts, outs[2], 6)
    if jax.default_backend() == "cpu":
        assert outs[2] == outs[None]
    with pytest.raises(ValueError, match="fused_rope or fused_norm"):
        make_engine(split_k=True, fused_rope=False, fused_norm=False)
    with pytest.raises(ValueError, match="split_k"):
        make_engine(split_k=0)


def test_decode_graph_matches():
    """ExecutionConfig(decode_graph=True): the decode program compiled with its loop as a
    command buffer (a GPU setting; the CPU compiles the same program): the same greedy
    outputs, verified against the dense model."""
    prompts = workload(4)
    engine = make_engine(decode_graph=True, decode_steps=4)
    assert engine.runner.decode_graph and engine.runner.decode_program is not None
    out = engine.generate(prompts, 7)
    assert_verified(prompts, out, 7)
    assert_whole(engine)
    plain = make_engine(decode_steps=4, decode_graph=False)
    assert not plain.runner.decode_graph
    assert out == plain.generate(prompts, 7)
    # None (the default): on with CUDA GPUs only.
    from jaxattn import native

    cuda = jax.default_backend() == "gpu" and native._platform() == "cuda"
    assert make_engine(decode_steps=4).runner.decode_graph == cuda


@pytest.mark.parametrize("layout", ["bshd", "vllm"])
def test_tensor_parallel_engine_matches_one_device(layout):
    """Heads split over 2 devices; pages, block tables and the radix cache stay global,
    so the schedule and the greedy outputs are those of one device."""
    prompts = workload(7, num=5, system=14, suffix=(1, 9))
    one = make_engine(layout=layout)
    single = one.generate(prompts, 6, n=2)
    assert one.stats["tp"] == 1
    engine = make_engine(layout=layout, mesh=mesh_of(2), unroll_layers=True)
    out = engine.generate(prompts, 6, n=2)
    assert out == single
    assert not engine.runner.fused_rope  # None: off under a mesh
    if layout == "bshd":  # each device rotates and stores its own heads in one pass
        fused = make_engine(layout=layout, mesh=mesh_of(2), unroll_layers=True, fused_rope=True)
        assert fused.runner.fused_rope and fused.generate(prompts, 6, n=2) == single
    assert_verified(prompts, out, 6, n=2)
    stats = engine.stats
    assert stats["tp"] == 2
    assert stats["prefix_hit_tokens"] > 0 and stats["forks"] == 5 and stats["cow_copies"] > 0
    for key in ("prefix_hit_tokens", "prefill_tokens", "cow_copies", "peak_pages_in_use"):
        assert stats[key] == one.stats[key], key
    assert 2 * stats["kv_pool_bytes_per_device"] == stats["kv_pool_bytes"]
    runner = engine.runner
    mesh = runner.tp.mesh
    for cache, kind in ((runner.k_cache, "k"), (runner.v_cache, "v")):
        assert cache.sharding.is_equivalent_to(
            sharding.kv_cache_sharding(mesh, layout, kind), cache.ndim
        )
    # The weights are split per layer (straight-line layers), the fused projections into
    # one block per device (its q, k, v heads; its gate and up columns), the row-parallel
    # ones by their input features.
    layers = runner.params["layers"]
    assert len(layers) == CFG.num_hidden_layers
    by_block = NamedSharding(mesh, PartitionSpec(None, sharding.AXIS, None))
    by_row = NamedSharding(mesh, PartitionSpec(sharding.AXIS, None))
    for lp in layers:
        assert lp["wqkv"].shape[1] == 2 and lp["wqkv"].sharding.is_equivalent_to(by_block, 3)
        assert lp["w_gate_up"].sharding.is_equivalent_to(by_block, 3)
        assert lp["wo"].sharding.is_equivalent_to(by_row, 2)
        assert lp["w_down"].sharding.is_equivalent_to(by_row, 2)
    assert_whole(engine)
    with pytest.raises(ValueError, match=r"KV heads \(2\) must be a multiple"):
        make_engine(mesh=mesh_of(4))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "implementation, device_paging, extend, rows, decode_lowering",
    [
        ("native", False, "extend", 64, "triton"),
        ("native", True, "extend", 64, "triton"),
        ("pallas", False, "extend", 64, "triton"),
        ("pallas", True, "extend", 64, "triton"),
        ("native", False, "prefix_prefill", 64, "triton"),
        ("pallas", False, "prefix_prefill", 64, "triton"),  # the Mosaic GPU prefill on sm_90
        # 256 rows x 2 KV heads fill a one-pass decode grid.
        ("pallas", True, "prefix_prefill", 256, "triton"),
        # The Mosaic GPU decode in every decode step (sm_90), split grids and one-pass.
        ("pallas", True, "prefix_prefill", 64, "mosaic_gpu"),
        ("pallas", False, "extend", 256, "mosaic_gpu"),
    ],
)
def test_engine_on_the_gpu(implementation, device_paging, extend, rows, decode_lowering):
    """The GPU's engine: bf16, straight-line layers, multi-step decode planned ahead, the
    compiled kernels, the token-pool or paged extend; outputs within the verifier's bf16
    tolerance of the dense oracle. ``rows``: decode rows; ``decode_lowering``: the Pallas
    decode's (``ExecutionConfig.pallas_decode_lowering``)."""
    import jaxattn

    if implementation not in jaxattn.available_backends():
        pytest.skip(f"{implementation} is not built here")
    if decode_lowering == "mosaic_gpu":
        from jaxattn.pallas import decode_mgpu

        if not decode_mgpu.is_sm90():
            pytest.skip("the Mosaic GPU decode is compiled for sm_90 GPUs only")
    cfg = LlamaConfig(**{**CFG.__dict__, "dtype": "bfloat16", "head_dim": 64})
    params = llama.init_params(cfg, jax.random.key(1))
    prompts = workload(11, num=8, system=40, suffix=(3, 30))
    engine = Engine(
        cfg,
        params,
        num_pages=256,
        page_size=16,
        max_batch_tokens=128,
        implementation=implementation,
        device_paging=device_paging,
        extend_attention=extend,
        max_running=rows,
        pallas_decode_lowering=decode_lowering,
        debug=True,
    )
    assert engine.runner.unroll_layers
    for kw in (dict(n=2), dict(n=2, temperature=0.7, seed=5)):
        out = engine.generate(prompts, 24, **kw)
        report = check_outputs(params, cfg, prompts, out, max_new_tokens=24, **kw)
        assert report.ok, report.problems[:5]
        assert_whole(engine)
    stats = engine.stats
    assert stats["attention_backend"] == {"extend": implementation, "decode": implementation}
    # The Pallas lowering of each step kind (the paged extend: Mosaic GPU on sm_90; decode:
    # the one asked for); none for native.
    lowering = stats["attention_lowering"]
    if implementation == "pallas":
        from jaxattn.pallas import prefill_mgpu

        mosaic = extend == "prefix_prefill" and prefill_mgpu.is_sm90()
        extend_lowering = "mosaic_gpu" if mosaic else "triton"
        assert lowering == {"extend": extend_lowering, "decode": decode_lowering}
    else:
        assert lowering == {"extend": None, "decode": None}
    assert stats["decode_steps"] > stats["decode_calls"] and stats["prefix_hit_tokens"] > 0


# --- a stand-in model over a simulated pool ------------------------------------------


def next_token(context, vocab, seed, uid, temperature) -> int:
    key = np.asarray(context, np.int64).tobytes()
    if temperature > 0:
        key += np.asarray([seed, uid, len(context)], np.int64).tobytes()
    return zlib.crc32(key) % vocab


class PoolModel:
    """A stand-in runner: the pool records the (token, position) each slot holds, every
    read checks the positions of the whole context, and the next token is a hash of the
    tokens read. Decode rows live here as they do on the device - the tokens, positions,
    budgets and block tables the engine sent, advanced by the steps - so a row the engine
    forgot to update, a table entry it did not send, or a lost, misplaced or overwritten
    slot changes the outputs."""

    def __init__(self, num_pages, page_size, vocab, *, rows=64, stop_width=1, decode_steps=8):
        self.pages = None  # device paging: the page table the engine sends and grows
        self.tok = np.full((num_pages, page_size), -1, np.int64)
        self.pos = np.full((num_pages, page_size), -1, np.int64)
        self.p, self.vocab, self.k = page_size, vocab, decode_steps
        self.trace_counts = collections.Counter()
        self.backends = {"extend": "stand-in", "decode": "stand-in"}
        self.kv_bytes = 0
        r = bucket(rows)
        self.row = dict(
            tokens=np.zeros(r, np.int64),
            positions=np.zeros(r, np.int64),
            remaining=np.zeros(r, np.int64),
            seeds=np.zeros(r, np.int64),
            uids=np.zeros(r, np.int64),
            temperature=np.zeros(r),
            stop=np.full((r, stop_width), -1, np.int64),
            tables=np.zeros((r, num_pages), np.int64),
        )

    def _where(self, table, positions):
        return np.asarray(table)[positions // self.p], positions % self.p

    def _write(self, table, start, tokens):
        positions = np.arange(start, start + len(tokens))
        page, off = self._where(table, positions)
        self.tok[page, off] = tokens
        self.pos[page, off] = positions

    def _read(self, table, end):
        positions = np.arange(end)
        page, off = self._where(table, positions)
        assert (self.pos[page, off] == positions).all(), "read a slot of another position"
        return self.tok[page, off].tolist()

    def _stops(self, r, token):
        return token < 0 or token in self.row["stop"][r]

    def launch(self, work):
        row = self.row
        if work.copies:
            src, dst = np.asarray(work.copies).T
            self.tok[dst], self.pos[dst] = self.tok[src].copy(), self.pos[src].copy()
        if work.updates is not None:
            u = work.updates
            for r, ints, floats in zip(u.rows, u.ints, u.floats, strict=True):
                row["tokens"][r], row["positions"][r], row["remaining"][r] = ints[:3]
                row["seeds"][r], row["uids"][r] = ints[3:5]
                row["stop"][r] = ints[5:]
                row["temperature"][r] = floats[0]
            for r, col, page in u.cells:
                row["tables"][r, col] = page
        drawn = []
        for it in work.extend:
            self._write(it.table, it.start, it.tokens)
        for it in work.extend:
            context = self._read(it.table, it.end)
            for j, (s, u, t, _) in enumerate(it.samples):
                token = next_token(context, self.vocab, s, u, t)
                drawn.append(token)
                r = it.rows[j] if j < len(it.rows) else -1
                if r >= 0:
                    row["tokens"][r] = token
                    if self._stops(r, token):
                        row["remaining"][r] = 0
        if work.pages is not None:
            self.pages = PageTable(
                *(jnp.asarray(x) for x in work.pages),
                status=jnp.int32(0),
                block_size=self.p,
            )
        out = None
        if work.decode is not None:
            d = work.decode
            if d.counts is not None:
                # Device paging: the tables grow as on the device, copies included.
                rows = np.full(len(row["tokens"]), len(row["tokens"]), np.int32)
                counts = np.zeros_like(rows)
                rows[: len(d.rows)], counts[: len(d.rows)] = d.rows, d.counts
                self.pages, cow, status = GROW(self.pages, rows, counts)
                assert (np.asarray(status)[: len(d.rows)] == 0).all(), "a row did not grow"
                for src, dst in np.asarray(cow):
                    if dst >= 0:
                        self.tok[dst], self.pos[dst] = self.tok[src].copy(), self.pos[src].copy()
                row["tables"][:, : self.pages.max_blocks_per_seq] = np.asarray(
                    self.pages.block_tables(np.arange(len(rows)))
                )
            out = np.full((self.k, d.num_rows), -2, np.int64)
            active = set(np.asarray(d.rows).tolist())
            for i in range(d.steps):
                live = [r for r in sorted(active) if row["remaining"][r] > 0]
                if not live:
                    break
                for r in live:  # every row writes before any row reads, as on the device
                    self._write(row["tables"][r], row["positions"][r], [row["tokens"][r]])
                for r in live:
                    pos = row["positions"][r]
                    context = self._read(row["tables"][r], pos + 1)
                    token = next_token(
                        context,
                        self.vocab,
                        row["seeds"][r],
                        row["uids"][r],
                        row["temperature"][r],
                    )
                    out[i, r] = token
                    row["tokens"][r], row["positions"][r] = token, pos + 1
                    stop = self._stops(r, token) or row["remaining"][r] <= 1
                    row["remaining"][r] = 0 if stop else row["remaining"][r] - 1
        return np.asarray(drawn, np.int64), out

    def collect(self, handle):
        return StepOutput(*handle)


GROW = jax.jit(PageTable.append_slots_batch)


def expected(prompts, max_new, n, temperature, seed, stop, vocab):
    out = []
    for i, p in enumerate(prompts):
        for j in range(n):
            seq = list(p)
            while True:
                t = next_token(seq, vocab, seed, i * n + j, temperature)
                seq.append(t)
                if t in stop or len(seq) - len(p) == max_new:
                    break
            out.append(seq[len(p) :])
    return out


@st.composite
def workloads(draw):
    vocab = 12
    page = draw(st.sampled_from([1, 2, 3, 4, 8]))
    prefixes = draw(
        st.lists(st.lists(st.integers(0, vocab - 1), max_size=20), min_size=1, max_size=3)
    )
    rounds = []
    for _ in range(draw(st.integers(1, 2))):
        prompts = [
            draw(st.sampled_from(prefixes))
            + draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12))
            for _ in range(draw(st.integers(1, 8)))
        ]
        rounds.append(
            dict(
                prompts=prompts,
                max_new=draw(st.integers(1, 12)),
                n=draw(st.integers(1, 3)),
                temperature=draw(st.sampled_from([0.0, 1.0])),
                seed=draw(st.integers(0, 3)),
            )
        )
    longest = max(len(p) + r["max_new"] for r in rounds for p in r["prompts"])
    need = -(-longest // page)
    return dict(
        vocab=vocab,
        rounds=rounds,
        engine=dict(
            page_size=page,
            num_pages=need + draw(st.integers(0, 12)),
            max_batch_tokens=draw(st.integers(1, 40)),
            max_running=draw(st.integers(max(r["n"] for r in rounds), 8)),
            radix_cache=draw(st.booleans()),
            policy=draw(st.sampled_from(["lpm", "fcfs"])),
            new_token_ratio=draw(st.sampled_from([0.0, 0.3])),
            dedup_tokens=draw(st.sampled_from([0, 1, None])),
            cache_on_plan=draw(st.booleans()),
            eos_token_id=draw(st.sampled_from([None, 0, 5])),
            decode_steps=draw(st.sampled_from([1, 3, 8])),
            overlap=draw(st.booleans()),
            device_paging=draw(st.booleans()),
        ),
    )


def stand_in(cfg, engine_kw):
    model = PoolModel(
        engine_kw["num_pages"],
        engine_kw["page_size"],
        cfg.vocab_size,
        rows=engine_kw.get("max_running", 64),
        decode_steps=engine_kw.get("decode_steps", 8),
    )
    return Engine(cfg, None, runner=model, debug=True, **engine_kw)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_on_a_simulated_pool(w):
    cfg = LlamaConfig(
        vocab_size=w["vocab"],
        hidden_size=8,
        num_attention_heads=1,
        num_key_value_heads=1,
        intermediate_size=8,
        num_hidden_layers=1,
    )
    e = w["engine"]
    engine = stand_in(cfg, e)
    stop = set() if e["eos_token_id"] is None else {e["eos_token_id"]}
    for r in w["rounds"]:
        kw = dict(n=r["n"], temperature=r["temperature"], seed=r["seed"])
        out = engine.generate(r["prompts"], r["max_new"], **kw)
        assert out == expected(r["prompts"], r["max_new"], stop=stop, vocab=w["vocab"], **kw)
        assert_whole(engine)
    stats = engine.stats
    assert (
        stats["prefill_tokens"] + stats["decode_tokens"]
        >= stats["generated_tokens"] - stats["forks"]
    )
    assert stats["decode_steps"] >= stats["decode_calls"]


def test_lpm_admits_the_longest_cached_prefix_first():
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=8,
        num_attention_heads=1,
        num_key_value_heads=1,
        intermediate_size=8,
        num_hidden_layers=1,
    )
    kw = dict(num_pages=32, page_size=2, max_batch_tokens=64, max_running=1, overlap=False)
    engine = stand_in(cfg, kw)
    cached = list(range(1, 21))
    engine.generate([cached], 1)
    a = engine.add_request([40, 41, 42], 1, tag="cold")
    b = engine.add_request(cached[:16] + [45], 1, tag="warm")
    first = engine.step()
    assert [s.tag for s in first] == ["warm"] and b.finish_reason == "length"
    assert engine.step()[0] is a
    assert engine.stats["prefix_hit_tokens"] == 16
    assert_whole(engine)


def test_demo_runs_and_verifies(capsys):
    from jaxattn.__main__ import main

    args = "--layers 2 --hidden 64 --heads 4 --kv-heads 2 --vocab 128 --system-tokens 40"
    args += " --chats 2 --turns 2 --few-shot 3 --example-tokens 16 --max-new-tokens 5"
    args += " --num-pages 48 --page-size 4 --max-batch-tokens 64 --quiet --verify --json"
    assert main(["demo", *args.split()]) == 0
    out = capsys.readouterr().out
    assert "verify (no-cache recompute)   OK: 35 tokens of 7 outputs checked" in out
    assert "served from radix cache" in out and "attention backend" in out
    assert "tensor parallel               off" in out
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "--checkpoint DIR" in capsys.readouterr().out


def test_demo_on_two_devices(capsys):
    from jaxattn.__main__ import main

    if jax.device_count() < 2:  # the CPU suite forces 8 host devices; a one-GPU machine has one
        pytest.skip(f"needs 2 devices, {jax.device_count()} present")

    # The heads and sizes of test_demo_runs_and_verifies; the default KV heads (2) split.
    args = "--layers 2 --hidden 64 --heads 4 --vocab 128 --system-tokens 40 --devices 2"
    args += " --chats 2 --turns 2 --few-shot 3 --example-tokens 16 --max-new-tokens 5"
    args += " --num-pages 48 --page-size 4 --max-batch-tokens 64 --quiet --verify"
    assert main(["demo", *args.split()]) == 0
    out = capsys.readouterr().out
    assert "verify (no-cache recompute)   OK: 35 tokens of 7 outputs checked" in out
    assert "tensor parallel               2 devices" in out
    assert main(["demo", *args.split(), "--devices", "3"]) == 2
    assert "--devices 3 must divide --heads (4)" in capsys.readouterr().err
    assert main(["demo", *args.split(), "--kv-heads", "1"]) == 2
    assert "--devices 2 must divide --kv-heads (1)" in capsys.readouterr().err


def test_packed_host_arrays_round_trip():
    """pack_host / unpack_host (the step programs' one int32 and one float32 transfer): every
    numpy leaf comes back with its shape, dtype and values inside jit, device arrays and
    other leaves pass through, None stays None, and the layout is static (equal layouts for
    equal shapes, so a step of the same buckets reuses its program)."""
    from jaxattn.engine.runner import pack_host, unpack_host

    rng = np.random.default_rng(0)
    tree = (
        rng.integers(-5, 5, (3, 4)).astype(np.int32),
        dict(flags=rng.random(6) < 0.5, ids=rng.integers(0, 9, 5).astype(np.uint8)),
        None,
        rng.random((2, 3)).astype(np.float32),
        jnp.arange(4, dtype=jnp.float32),  # a device array: passed as it is
        np.arange(3, dtype=np.int64),  # wider than int32: passed as it is
        (np.zeros((0, 3), np.int32), np.float32(2.5) * np.ones(1, np.float32)),
    )
    (ints, floats, others), layout = pack_host(tree)
    assert ints.dtype == np.int32 and ints.size == 12 + 6 + 5
    assert floats.dtype == np.float32 and floats.size == 6 + 1
    assert len(others) == 2
    back = jax.jit(unpack_host, static_argnums=3)(ints, floats, others, layout)
    want, got = jax.tree.leaves(tree), jax.tree.leaves(back)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for w, g in zip(want, got, strict=True):
        # (jit's own canonical dtype for the int64 leaf passed through, as without packing)
        dtype = jax.dtypes.canonicalize_dtype(w.dtype)
        assert g.shape == w.shape and np.dtype(g.dtype) == dtype, (w, g)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    _, again = pack_host(jax.tree.map(lambda x: x, tree))
    assert again == layout and hash(again) == hash(layout)
