"""Cascade decode in the engine (``ExecutionConfig.cascade``).

* the level builder against a naive model: on random block tables that share runs of
  pages like radix-cache hits and forks do, the prefix and own levels join back into
  every request's table and length, prefixes hold only pages full before the dispatch,
  and the grouping saves as many reads as the best of all partitions;
* with the real model (float32, the engine tests' model): greedy outputs with cascade
  "on" equal those with "off" token for token (requests joining and finishing at
  different steps, forks, preemption, multi-step and device-paged dispatches), the
  counters add up, "auto" follows the cost model, and the values of the levels compile
  nothing new.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import jax
import numpy as np
import pytest
from helpers import mesh_of
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import CFG, POOL, assert_verified, assert_whole, make_engine, workload

import jaxattn.engine.engine as engine_module
from jaxattn.engine import ExecutionConfig
from jaxattn.engine.cascade import cascade_levels, shared_prefixes
from jaxattn.models import llama
from jaxattn.models.llama import LlamaConfig

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
    assert levels.prefix_rows.shape == (num_rows,) and levels.prefix_rows.dtype == np.int32
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
        # The device gathers the prefix from a member row's table.
        leader = rows.index(int(levels.prefix_rows[g]))
        assert levels.prefix_of[rows[leader]] == g
        assert tables[leader][:pages] == table[:pages]
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


# --- the engine -----------------------------------------------------------------------

SHARED = dict(cascade_min_tokens=8)


def _outputs(engine, prompts, max_new, n=1):
    results = {}
    pending, step = list(range(len(prompts))), 0
    while pending or engine.has_work():
        if pending and step % 2 == 0:
            i = pending.pop(0)
            engine.add_request(prompts[i], max_new[i], n=n, tag=i)
        for seq in engine.step():
            results[(seq.tag, seq.sample_id)] = list(seq.output)
        step += 1
    return [results[(i, j)] for i in range(len(prompts)) for j in range(n)]


@pytest.mark.parametrize(
    "mode",
    [
        dict(overlap=False, decode_steps=1),
        dict(overlap=True, decode_steps=4),
        dict(overlap=True, decode_steps=4, device_paging=True),
    ],
    ids=["sync", "multistep", "device-paging"],
)
def test_cascade_on_gives_the_tokens_of_paged_decode(mode):
    # A 24-token system prompt (6 pages) shared by every request but the last; requests
    # join every other step and stop after 5..12 tokens.
    prompts = workload(11, num=6, system=24, suffix=(1, 9))
    max_new = [12, 5, 9, 7, 11, 6]
    off = make_engine(cascade="off", **SHARED, **mode)
    on = make_engine(cascade="on", **SHARED, **mode)
    want = _outputs(off, prompts, max_new, n=2)
    got = _outputs(on, prompts, max_new, n=2)
    assert got == want
    for i, p in enumerate(prompts):
        assert_verified([p], want[2 * i : 2 * i + 2], max_new[i], n=2)
    stats = on.stats
    assert stats["cascade_steps"] > 0 and stats["cascade_saved_kv_bytes"] > 0
    assert stats["cascade_steps"] <= stats["decode_steps"]
    assert off.stats["cascade_steps"] == off.stats["cascade_saved_kv_bytes"] == 0
    assert stats["decode_tokens"] == off.stats["decode_tokens"]
    assert_whole(on)


def test_cascade_under_preemption():
    prompts = workload(2, num=8, system=10, suffix=(4, 12))
    kw = dict(new_token_ratio=0.0, max_running=8, **SHARED)
    want = make_engine(cascade="off", **kw).generate(prompts, 24)
    engine = make_engine(cascade="on", **kw)
    assert engine.generate(prompts, 24) == want
    stats = engine.stats
    assert stats["preemptions"] > 0 and stats["cascade_steps"] > 0
    assert_whole(engine)


def test_cascade_over_a_split_pool_in_another_layout():
    """Heads split over 2 devices (each runs cascade decode on its own KV heads), in the
    vLLM layout: the tokens of one device with paged decode."""
    prompts = workload(7, num=5, system=14, suffix=(1, 9))
    want = make_engine(layout="vllm", cascade="off").generate(prompts, 6, n=2)
    engine = make_engine(layout="vllm", cascade="on", mesh=mesh_of(2), **SHARED)
    assert engine.generate(prompts, 6, n=2) == want
    assert engine.stats["tp"] == 2 and engine.stats["cascade_steps"] > 0
    assert_whole(engine)


def test_counters_of_forked_samples():
    """Three samples of a 16-token prompt (4 full pages): every decode step of the
    dispatch shares the 4 pages between the three rows, saving 2 * 16 tokens' KV."""
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 128, 16).tolist()
    engine = make_engine(cascade="on", overlap=False, decode_steps=1, **SHARED)
    out = engine.generate([prompt], 6, n=3, ignore_eos=True)
    assert_verified([prompt], out, 6, n=3)
    stats = engine.stats
    assert stats["decode_steps"] == 5
    assert stats["cascade_steps"] == 5
    per_token = engine.cfg.kv_bytes_per_token()
    assert per_token == 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, 16 dims, f32
    assert stats["cascade_saved_kv_bytes"] == 5 * 2 * 16 * per_token
    engine.reset_stats()
    assert engine.stats["cascade_steps"] == engine.stats["cascade_saved_kv_bytes"] == 0


def test_auto_follows_the_cost_model(monkeypatch):
    asked = []

    def pays_off(prefix_lens, prefix_of, own_lens, **kw):
        asked.append((np.asarray(prefix_lens), np.asarray(prefix_of), np.asarray(own_lens)))
        return verdict

    monkeypatch.setattr(engine_module, "cascade_pays_off", pays_off)
    # The bound asked first (cascade_may_pay_off) would spare this tiny model the search.
    monkeypatch.setattr(engine_module, "cascade_may_pay_off", lambda *a, **k: True)
    # No shared prefix: the levels are empty, the cost model is never asked, no cascade.
    rng = np.random.default_rng(9)
    distinct = [rng.integers(0, 128, int(k)).tolist() for k in (13, 21, 17, 30)]
    verdict = True
    engine = make_engine(**SHARED)
    assert ExecutionConfig().cascade == "auto"
    out = engine.generate(distinct, 8)
    assert engine.stats["cascade_steps"] == 0 and not asked
    assert_verified(distinct, out, 8)
    # Shared prefixes: cascade exactly when the model says it pays off.
    prompts = workload(4, num=5, system=24, suffix=(1, 6))
    for verdict in (False, True):
        asked.clear()
        engine = make_engine(**SHARED)
        out = engine.generate(prompts, 8)
        assert asked
        for lens, of, own in asked:
            assert np.all(own >= 1) and np.any(of >= 0) and np.all(lens % POOL["page_size"] == 0)
        steps = engine.stats["cascade_steps"]
        assert steps > 0 if verdict else steps == 0
        assert_verified(prompts, out, 8)


def test_auto_with_the_default_model_keeps_paged_decode_for_a_tiny_model():
    # For this model's few bytes per token the fixed cost of the second level dominates.
    prompts = workload(4, num=5, system=24, suffix=(1, 6))
    engine = make_engine(**SHARED)
    engine.generate(prompts, 6)
    assert engine.stats["cascade_steps"] == 0


def test_auto_decides_with_the_configured_model(tmp_path):
    """ExecutionConfig.cascade_model: a model measured on the serving GPU (here one whose
    cascade costs nothing but its bytes, as a JSON file the benchmark's fit writes) turns
    on what the defaults keep on paged decode for this tiny model; every form of the
    setting reads to the same model."""
    from jaxattn.cascade_cost import CascadeCostModel

    cheap = CascadeCostModel(
        cascade_fixed_us=0.0, cascade_row_us=0.0, cascade_flops_per_us=1e30, margin=0.0
    )
    path = tmp_path / "cascade.json"
    path.write_text(json.dumps({"rows": [], "cost_model": dataclasses.asdict(cheap)}))
    for form in (cheap, dataclasses.asdict(cheap), str(path), path, path.read_text()):
        assert ExecutionConfig(cascade_model=form).cascade_model == cheap
    prompts = workload(4, num=5, system=24, suffix=(1, 6))
    engine = make_engine(cascade_model=path, **SHARED)
    out = engine.generate(prompts, 6)
    assert engine.stats["cascade_steps"] > 0
    assert_verified(prompts, out, 6)


def test_level_values_compile_nothing_new():
    """Other page ids and prefix lengths in the same shapes reuse the compiled program:
    one decode program with cascade, one without."""
    mode = dict(overlap=False, decode_steps=1, **SHARED)
    a = workload(21, num=4, system=24, suffix=(1, 3))
    engine = make_engine(cascade="on", **mode)
    engine.generate(a, 4)
    assert engine.stats["cascade_steps"] > 0
    before = dict(engine.runner.trace_counts)
    b = workload(22, num=4, system=20, suffix=(2, 4))
    engine.generate(b, 4)
    assert engine.stats["cascade_steps"] > 0
    assert engine.runner.trace_counts["decode"] == before.get("decode", 0)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        (dict(cascade="yes"), "cascade"),
        (dict(cascade=True), "cascade"),
        (dict(cascade_min_tokens=0), "cascade_min_tokens"),
        (dict(cascade_min_tokens=2.5), "cascade_min_tokens"),
        (dict(cascade_model=3), "cascade_model"),
        (dict(cascade_model={"rows": []}), "cascade_model:"),
        (dict(cascade_model="no/such/cascade.json"), "cascade_model:"),
    ],
)
def test_bad_cascade_settings(kw, field):
    with pytest.raises(ValueError, match=f"ExecutionConfig.{field}[ :]"):
        ExecutionConfig(**kw)


def test_the_spec_is_no_cascade_beside_a_kernel_decode(monkeypatch):
    """Where cascade decode would resolve to the spec while the decode steps run a kernel
    backend, cascade stays off ("on" is refused): XLA's attention is not traded for the
    backend's paged decode. Beside the spec's own decode it serves."""
    from jaxattn.engine.runner import ModelRunner

    resolve = ModelRunner._resolve

    def spec_cascade(self, kind, implementation):
        return resolve(self, kind, "reference" if kind == "cascade" else implementation)

    monkeypatch.setattr(ModelRunner, "_resolve", spec_cascade)
    model = {}
    if jax.default_backend() != "cpu":  # a head_dim the native GPU kernels are built for
        cfg = LlamaConfig(**{**CFG.__dict__, "dtype": "bfloat16", "head_dim": 64})
        model = dict(cfg=cfg, params=llama.init_params(cfg, jax.random.key(1)))
    engine = make_engine(implementation="native", **model)
    assert engine.runner.backends["decode"] == "native"
    assert engine.runner.cascade_backend is None and engine.cascade == "off"
    with pytest.raises(ValueError, match="no cascade decode backend"):
        make_engine(implementation="native", cascade="on", **model)
    assert make_engine(implementation="reference", **model).runner.cascade_backend == "reference"
