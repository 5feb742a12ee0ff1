"""The spec against independent float64 computations and against itself."""

import math

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    DTYPES,
    assert_close,
    expected_decode,
    expected_ragged,
    make_extend,
    make_paged_decode,
    make_prefix_prefill,
    naive_attention,
    prefill_as_extend,
    random_normal,
    spec_extend_attention,
    spec_paged_attention,
)
from hypothesis import given, settings

from jaxattn import layout as L
from jaxattn import reference as ref

AWKWARD_LENS = [1, 3, 17, 255, 513]


# --- the three-request example of the design notes (part 3.3) -------------------------


def test_seed_three_request_example():
    rng = np.random.default_rng(0)
    hq, hkv, d = 4, 2, 8
    slots = [108, 109, 110, 111, 42, 43, 201, 202, 203, 80, 81, 82, 83, 84, 99]
    qo = jnp.array([0, 2, 5, 6], jnp.int32)
    kv = jnp.array([0, 6, 9, 15], jnp.int32)
    assert np.diff(qo).tolist() == [2, 3, 1] and np.diff(kv).tolist() == [6, 3, 6]
    k_pool = np.full((256, hkv, d), np.nan, np.float32)
    v_pool = np.full_like(k_pool, np.nan)
    k_pool[slots] = rng.standard_normal((15, hkv, d))
    v_pool[slots] = rng.standard_normal((15, hkv, d))
    q = random_normal(rng, (6, hq, d), jnp.float32)
    out = ref.extend_attention(
        q, jnp.asarray(k_pool), jnp.asarray(v_pool), qo, kv, jnp.asarray(slots, jnp.int32)
    )
    for b in range(3):
        idx = slots[int(kv[b]) : int(kv[b + 1])]
        want = naive_attention(q[int(qo[b]) : int(qo[b + 1])], k_pool[idx], v_pool[idx])
        assert_close(out[int(qo[b]) : int(qo[b + 1])], want)
    # Request 0, row 0 (prefix 4, Lq 2) sees keys 0..4 exactly: changing key 5 must not matter.
    k2 = k_pool.copy()
    k2[43] = 1e3
    out2 = ref.extend_attention(
        q, jnp.asarray(k2), jnp.asarray(v_pool), qo, kv, jnp.asarray(slots, jnp.int32)
    )
    np.testing.assert_array_equal(np.asarray(out2[0]), np.asarray(out[0]))
    assert not np.allclose(np.asarray(out2[1]), np.asarray(out[1]))


# --- paged decode ---------------------------------------------------------------------


@pytest.mark.parametrize("layout", L.LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_attention_v1_matches_naive(layout, dtype, group):
    rng = np.random.default_rng(hash((layout, str(dtype), group)) % 2**32)
    hkv = 2
    case = make_paged_decode(
        rng,
        [1, 3, 17, 0, 40],
        num_q_heads=hkv * group,
        num_kv_heads=hkv,
        head_dim=16,
        page_size=8,
        layout=layout,
        dtype=dtype,
    )
    out = ref.paged_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, layout=layout
    )
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    assert_close(out, expected_decode(case))
    np.testing.assert_array_equal(np.asarray(out[3], np.float32), 0.0)  # empty sequence


@pytest.mark.parametrize("partition_size", [16, 48, 256, 512, 7])
def test_paged_attention_v2_equals_v1(partition_size):
    rng = np.random.default_rng(partition_size)
    case = make_paged_decode(
        rng, AWKWARD_LENS + [0], num_q_heads=8, num_kv_heads=2, head_dim=16, page_size=16
    )
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    v1 = ref.paged_attention(*args)
    v2 = ref.paged_attention(*args, partition_size=partition_size)
    assert_close(v2, v1)
    assert_close(v2, expected_decode(case))


def test_paged_attention_scale_and_soft_cap():
    rng = np.random.default_rng(1)
    case = make_paged_decode(rng, [5, 33], num_q_heads=4, num_kv_heads=1, head_dim=8, page_size=4)
    args = (case.q * 4, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    out = ref.paged_attention(*args, scale=0.7, soft_cap=3.0, partition_size=8)
    case.q = case.q * 4
    assert_close(out, expected_decode(case, scale=0.7, soft_cap=3.0))
    # The cap really bites: without it the answer differs.
    assert not np.allclose(out, expected_decode(case, scale=0.7), atol=1e-3)


def test_gqa_equals_mha_over_repeated_heads():
    rng = np.random.default_rng(2)
    case = make_paged_decode(
        rng, [9, 20, 1], num_q_heads=8, num_kv_heads=2, head_dim=16, page_size=4
    )
    gqa = ref.paged_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    mha = ref.paged_attention(
        case.q,
        jnp.repeat(case.k_cache, 4, axis=2),
        jnp.repeat(case.v_cache, 4, axis=2),
        case.block_tables,
        case.seq_lens,
    )
    assert_close(gqa, mha)


def test_all_layouts_agree():
    rng = np.random.default_rng(3)
    case = make_paged_decode(
        rng,
        [13, 64, 7],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=8,
        dtype=jnp.bfloat16,
    )
    outs = []
    for lay in L.LAYOUTS:
        k, v = L.convert(case.k_cache, case.v_cache, "bshd", lay)
        outs.append(ref.paged_attention(case.q, k, v, case.block_tables, case.seq_lens, layout=lay))
    for o in outs[1:]:
        np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(outs[0], np.float32))


# --- merge_states ----------------------------------------------------------------------


def _split_states(rng, n_parts, hq=4, d=8, lk=40):
    """Partial (out, lse) of one query over a random split of lk keys, plus the truth."""
    q = rng.standard_normal((1, hq, d))
    k = rng.standard_normal((lk, hq, d))
    v = rng.standard_normal((lk, hq, d))
    cuts = np.sort(rng.choice(np.arange(1, lk), n_parts - 1, replace=False))
    bounds = np.concatenate([[0], cuts, [lk]])
    outs, lses = [], []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        s = np.einsum("hd,shd->hs", q[0], k[a:b]) / math.sqrt(d)
        m = s.max(-1, keepdims=True)
        p = np.exp(s - m)
        outs.append(np.einsum("hs,shd->hd", p, v[a:b]) / p.sum(-1, keepdims=True))
        lses.append(m[..., 0] + np.log(p.sum(-1)))
    s = np.einsum("hd,shd->hs", q[0], k) / math.sqrt(d)
    lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    truth = naive_attention(q, k, v, causal=False)[0]
    return (
        jnp.asarray(np.stack(outs), jnp.float32),
        jnp.asarray(np.stack(lses), jnp.float32),
        truth,
        lse,
    )


@pytest.mark.parametrize("n_parts", [1, 2, 5])
def test_merge_states_exact(n_parts):
    rng = np.random.default_rng(n_parts)
    outs, lses, truth, lse = _split_states(rng, n_parts)
    out, got_lse = ref.merge_states(outs, lses)
    assert_close(out, truth)
    np.testing.assert_allclose(np.asarray(got_lse), lse, rtol=1e-5, atol=1e-5)


def test_merge_states_order_independent_and_associative():
    rng = np.random.default_rng(7)
    outs, lses, truth, _ = _split_states(rng, 4)
    perm = rng.permutation(4)
    a, la = ref.merge_states(outs[perm], lses[perm])
    left = ref.merge_states(outs[:2], lses[:2])
    right = ref.merge_states(outs[2:], lses[2:])
    b, lb = ref.merge_states(jnp.stack([left[0], right[0]]), jnp.stack([left[1], right[1]]))
    assert_close(a, truth)
    assert_close(b, truth)
    np.testing.assert_allclose(np.asarray(la), np.asarray(lb), rtol=1e-5)


def test_merge_states_empty_parts():
    rng = np.random.default_rng(8)
    outs, lses, truth, _ = _split_states(rng, 2)
    nan_out = jnp.full_like(outs[:1], jnp.nan)
    ninf = jnp.full_like(lses[:1], -jnp.inf)
    out, lse = ref.merge_states(jnp.concatenate([outs, nan_out]), jnp.concatenate([lses, ninf]))
    assert_close(out, truth)
    out, lse = ref.merge_states(jnp.concatenate([nan_out, nan_out]), jnp.concatenate([ninf, ninf]))
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    assert np.all(np.isneginf(np.asarray(lse)))


# --- extend / prefix prefill -----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_extend_matches_naive(dtype, group):
    rng = np.random.default_rng(hash((str(dtype), group)) % 2**32)
    case = make_extend(
        rng,
        [4, 0, 17, 255, 0],
        [2, 3, 1, 30, 1],
        num_q_heads=2 * group,
        num_kv_heads=2,
        head_dim=16,
        dtype=dtype,
        pad_rows=3,
    )
    out = ref.extend_attention(
        case.q, case.k_pool, case.v_pool, case.qo_indptr, case.kv_indptr, case.kv_indices
    )
    assert out.dtype == case.q.dtype
    assert_close(out, expected_ragged(case.q, case.qo_indptr, case.dense_k, case.dense_v))


def test_extend_empty_prefix_is_causal_attention():
    rng = np.random.default_rng(11)
    case = make_extend(rng, [0], [37], num_q_heads=4, num_kv_heads=4, head_dim=8)
    out = ref.extend_attention(
        case.q, case.k_pool, case.v_pool, case.qo_indptr, case.kv_indptr, case.kv_indices
    )
    q, k, v = case.q, case.dense_k[0], case.dense_v[0]
    s = jnp.einsum("qhd,khd->hqk", q, k, precision="highest") / math.sqrt(8)
    s = jnp.where(jnp.tril(jnp.ones((37, 37), bool))[None], s, -jnp.inf)
    want = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, -1), v, precision="highest")
    assert_close(out, want)


def test_extend_equals_last_rows_of_full_causal_attention():
    rng = np.random.default_rng(12)
    lk, lq = 50, 9
    full = make_extend(rng, [0], [lk], num_q_heads=4, num_kv_heads=2, head_dim=8)
    full_out = ref.extend_attention(
        full.q, full.k_pool, full.v_pool, full.qo_indptr, full.kv_indptr, full.kv_indices
    )
    ext = ref.extend_attention(
        full.q[lk - lq :],
        full.k_pool,
        full.v_pool,
        jnp.array([0, lq], jnp.int32),
        full.kv_indptr,
        full.kv_indices,
    )
    assert_close(ext, full_out[lk - lq :])


@pytest.mark.parametrize("layout", L.LAYOUTS)
def test_prefix_prefill_equals_extend(layout):
    rng = np.random.default_rng(13)
    case = make_prefix_prefill(
        rng,
        [0, 17, 3, 40],
        [5, 1, 20, 2],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=16,
        page_size=8,
        layout=layout,
        pad_rows=2,
    )
    out = ref.prefix_prefill(
        case.q,
        case.k_cache,
        case.v_cache,
        case.cu_seqlens_q,
        case.block_tables,
        case.seq_lens,
        layout=layout,
    )
    kp, vp, qo, kv, idx = prefill_as_extend(case)
    ext = ref.extend_attention(case.q, kp, vp, qo, kv, idx)
    assert_close(out, ext)
    assert_close(out, expected_ragged(case.q, case.cu_seqlens_q, case.dense_k, case.dense_v))
    np.testing.assert_array_equal(np.asarray(out[-2:]), 0.0)  # padding rows


def test_extend_soft_cap_and_scale():
    rng = np.random.default_rng(14)
    case = make_extend(rng, [6, 2], [3, 4], num_q_heads=4, num_kv_heads=2, head_dim=8)
    q = case.q * 5
    out = ref.extend_attention(
        q,
        case.k_pool,
        case.v_pool,
        case.qo_indptr,
        case.kv_indptr,
        case.kv_indices,
        scale=0.5,
        soft_cap=2.0,
    )
    assert_close(
        out, expected_ragged(q, case.qo_indptr, case.dense_k, case.dense_v, scale=0.5, soft_cap=2.0)
    )


# --- random shapes (hypothesis), jit and vmap ------------------------------------------


# The jitted spec (tests/helpers.py) keeps shapes fixed across the random cases below so
# that hypothesis explores values and lengths without recompiling for every example.


@settings(max_examples=20, deadline=None)
@given(
    lens=st.lists(st.sampled_from([0, 1, 2, 3, 17, 31, 64, 100]), min_size=4, max_size=4),
    group=st.sampled_from([1, 4]),
    page_size=st.sampled_from([1, 16]),
    layout=st.sampled_from(L.LAYOUTS),
    partition=st.sampled_from([None, 48]),
    seed=st.integers(0, 2**31 - 1),
)
def test_paged_random_shapes(lens, group, page_size, layout, partition, seed):
    rng = np.random.default_rng(seed)
    max_pages = -(-100 // page_size) + 1
    case = make_paged_decode(
        rng,
        lens,
        num_q_heads=2 * group,
        num_kv_heads=2,
        head_dim=8,
        page_size=page_size,
        layout=layout,
        num_pages=4 * max_pages + 1,
        max_pages=max_pages,
    )
    out = spec_paged_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        layout=layout,
        partition_size=partition,
    )
    assert_close(out, expected_decode(case))


@settings(max_examples=20, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(st.sampled_from([0, 1, 3, 17, 40]), st.sampled_from([1, 2, 3, 17])),
        min_size=1,
        max_size=4,
    ),
    group=st.sampled_from([1, 4]),
    seed=st.integers(0, 2**31 - 1),
)
def test_extend_random_shapes(reqs, group, seed):
    rng = np.random.default_rng(seed)
    pre, ext = zip(*reqs, strict=True)
    qo_len = len(reqs) + 1
    # Pad to 4 requests with empty ones (Lq = Lk = 0) so indptr shapes stay fixed too.
    pre, ext = list(pre) + [0] * (4 - len(reqs)), list(ext) + [0] * (4 - len(reqs))
    case = make_extend(
        rng,
        pre,
        ext,
        num_q_heads=2 * group,
        num_kv_heads=2,
        head_dim=8,
        num_slots=256,
        num_rows=72,
        num_indices=240,
    )
    assert case.qo_indptr.shape == (5,) and qo_len <= 5
    out = spec_extend_attention(
        case.q, case.k_pool, case.v_pool, case.qo_indptr, case.kv_indptr, case.kv_indices
    )
    assert_close(out, expected_ragged(case.q, case.qo_indptr, case.dense_k, case.dense_v))


class TestTransforms(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_paged_attention_variants(self):
        rng = np.random.default_rng(21)
        case = make_paged_decode(
            rng, [3, 17], num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4
        )
        fn = self.variant(lambda *a: ref.paged_attention(*a, partition_size=8))
        out = fn(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
        assert_close(out, expected_decode(case))

    @chex.variants(with_jit=True, without_jit=True)
    def test_extend_variants(self):
        rng = np.random.default_rng(22)
        case = make_extend(rng, [5, 0], [3, 4], num_q_heads=4, num_kv_heads=2, head_dim=8)
        out = self.variant(ref.extend_attention)(
            case.q, case.k_pool, case.v_pool, case.qo_indptr, case.kv_indptr, case.kv_indices
        )
        assert_close(out, expected_ragged(case.q, case.qo_indptr, case.dense_k, case.dense_v))

    def test_vmap_over_independent_caches(self):
        rng = np.random.default_rng(23)
        cases = [
            make_paged_decode(
                rng,
                [5, 9],
                num_q_heads=4,
                num_kv_heads=2,
                head_dim=8,
                page_size=4,
                spare_pages=1,
                pad_pages=1,
            )
            for _ in range(3)
        ]
        shapes = {c.k_cache.shape for c in cases} | {c.block_tables.shape for c in cases}
        assert len(shapes) == 2
        stack = lambda f: jnp.stack([f(c) for c in cases])  # noqa: E731
        out = jax.vmap(ref.paged_attention)(
            stack(lambda c: c.q),
            stack(lambda c: c.k_cache),
            stack(lambda c: c.v_cache),
            stack(lambda c: c.block_tables),
            stack(lambda c: c.seq_lens),
        )
        for i, c in enumerate(cases):
            assert_close(out[i], expected_decode(c))


def test_deterministic():
    rng = np.random.default_rng(24)
    case = make_paged_decode(
        rng, [100, 7], num_q_heads=8, num_kv_heads=2, head_dim=16, page_size=16, dtype=jnp.bfloat16
    )
    f = jax.jit(lambda *a: ref.paged_attention(*a, partition_size=32))
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    chex.assert_trees_all_equal(f(*args), f(*args))
