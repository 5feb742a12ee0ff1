"""The Mosaic GPU cascade decode (jaxattn.pallas.cascade_mgpu) against the spec: batches that
share prefixes over several tiles, requests without a prefix, empty prefixes and own
levels, several partitions of each level, layouts, page sizes, GQA groups that do and do not
divide the 64 rows of a tile, NaN in every slot it must not read, the memory-safety
contract, refusals.

Every case runs in Mosaic GPU's interpret mode (the CPU, and the GPU too; the decode
kernel's barriers, TMA page copies, masks and online softmax, with the products as
jnp.dot). On an sm_90 GPU the same cases also run compiled. On any machine the kernels are
lowered for CUDA (jax.export with platforms=["cuda"]). Skipped where this JAX has no Mosaic
GPU lowering with an interpret mode.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    CASCADE_BATCHES,
    assert_close,
    call_cascade,
    export_cuda,
    make_cascade,
    spec_cascade,
)

import jaxattn
from jaxattn.pallas import cascade_mgpu, decode_mgpu

if cascade_mgpu.available() is not None:
    pytest.skip(cascade_mgpu.available(), allow_module_level=True)

MODES = [True] + ([False] if cascade_mgpu.is_sm90() else [])


CASES = [
    # batch, layout, dtype, hq/hkv, d, page, prefix_pages / own_pages per partition (None:
    # the default rule)
    ("mixed", "bshd", jnp.bfloat16, (8, 2), 64, 16, (4, 4)),
    ("shared", "bhsd", jnp.float16, (16, 2), 64, 16, (4, None)),
    ("shared", "bshd", jnp.bfloat16, (8, 1), 128, 16, (None, 4)),
    ("private", "bhsd", jnp.bfloat16, (4, 4), 64, 8, (8, 16)),
    # GQA 7: 9 requests a tile, 63 of its 64 rows
    ("shared", "bshd", jnp.bfloat16, (14, 2), 64, 16, (8, 4)),
]


def case_of(seed, batch, layout, dtype, heads, d, page):
    prefixes, prefix_of, own = CASCADE_BATCHES[batch]
    hq, hkv = heads
    return make_cascade(
        np.random.default_rng(seed),
        [-(-n * 16 // page) for n in prefixes],
        prefix_of,
        own,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=page,
        layout=layout,
        dtype=dtype,
    )


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_spec_with_unread_slots_poisoned(case, interpret):
    """Unread pool slots and table columns hold NaN (make_cascade); requests with nothing to
    attend to give exact zeros."""
    batch, layout, dtype, heads, d, page, (pp, op) = CASES[case]
    c = case_of(case, batch, layout, dtype, heads, d, page)
    out = call_cascade(
        cascade_mgpu.cascade_attention, c, scale=0.3, prefix_pages=pp, own_pages=op,
        interpret=interpret,
    )  # fmt: skip
    assert out.shape == c.q.shape and out.dtype == c.q.dtype
    assert_close(out, spec_cascade(c, scale=0.3), dtype)
    for b in np.flatnonzero(np.asarray(c.joined_lens) == 0):
        np.testing.assert_array_equal(np.asarray(out[b]), 0.0)


def test_tiles_bound_is_the_most_a_batch_needs():
    """tiles_bound against every way up to 9 requests can continue up to 3 prefixes: never
    fewer tiles than a batch needs (the plan would drop requests), never more."""

    def most(batch, prefixes, per_tile):
        counts = itertools.product(range(batch + 1), repeat=prefixes)
        sums = (sum(-(-n // per_tile) for n in c) for c in counts if sum(c) <= batch)
        return max(1, max(sums, default=0))

    for batch, prefixes, per_tile in itertools.product(range(1, 10), range(4), (1, 2, 3, 4, 7)):
        want = most(batch, prefixes, per_tile)
        assert cascade_mgpu.tiles_bound(batch, prefixes, per_tile) == want


@pytest.mark.parametrize("seed", range(12))
def test_plan_matches_a_naive_model(seed):
    """The tile plan against a loop: the active requests of each prefix in batch order, cut
    into tiles of per_tile, the prefixes' tiles one after another; every slot past the
    tiles' requests empty, every tile past the last one without a prefix. Batches of 1-70,
    1-7 prefixes, tiles of 1-16 requests, from none to every request active."""
    rng = np.random.default_rng(seed)
    B, NP = int(rng.integers(1, 71)), int(rng.integers(1, 8))
    per_tile = int(rng.choice([1, 2, 4, 8, 16]))
    prefix_of = rng.integers(-1, NP, B)
    active = (prefix_of >= 0) & (rng.random(B) < rng.choice([0.0, 0.5, 0.8, 1.0]))
    T = cascade_mgpu.tiles_bound(B, NP, per_tile)
    got = cascade_mgpu.plan(jnp.asarray(prefix_of), jnp.asarray(active), NP, per_tile, T)
    tile_prefix, tile_of, slot_of, who, filled = (np.asarray(x) for x in got)
    want_who = np.zeros((T, per_tile), int)
    want_prefix = np.full(T, -1)
    want_filled = np.zeros((T, per_tile), bool)
    t = 0
    for g in range(NP):
        members = [b for b in range(B) if active[b] and prefix_of[b] == g]
        for i in range(0, len(members), per_tile):
            want_prefix[t] = g
            for s, b in enumerate(members[i : i + per_tile]):
                assert (tile_of[b], slot_of[b], who[t, s]) == (t, s, b)
                want_filled[t, s] = True
                want_who[t, s] = b
            t += 1
    assert t <= T
    np.testing.assert_array_equal(tile_prefix, want_prefix)
    np.testing.assert_array_equal(filled, want_filled)
    np.testing.assert_array_equal(who, want_who)  # an empty slot names request 0
    np.testing.assert_array_equal(tile_of[~active], 0)
    np.testing.assert_array_equal(slot_of[~active], 0)


@pytest.mark.parametrize("prefixes, own_width", [(0, 4), (2, 0), (0, 0)])
def test_levels_without_pages(prefixes, own_width):
    """A batch with no prefix runs the own level alone, own tables of no column the prefix
    level alone, neither: zeros (what the spec gives); an own length over tables of no
    column is still checked (NaN), though no own block is launched."""
    rng = np.random.default_rng(3)
    B, hq, hkv, d, page = 3, 8, 2, 64, 16
    q = jnp.asarray(rng.standard_normal((B, hq, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((12, page, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((12, page, hkv, d)), jnp.bfloat16)
    ptab = jnp.asarray(rng.integers(0, 12, (prefixes, 4 if prefixes else 0)), jnp.int32)
    plen = jnp.full((prefixes,), 32, jnp.int32)
    prefix_of = jnp.asarray([-1, 1, 0] if prefixes else [-1, -1, -1], jnp.int32)
    tab = jnp.asarray(rng.integers(0, 12, (B, own_width)), jnp.int32)
    lens = jnp.asarray([5, 0, 17] if own_width else [0, 3, 0], jnp.int32)
    args = (q, k, v, ptab, plen, prefix_of, tab, lens)
    out = np.asarray(cascade_mgpu.cascade_attention(*args, interpret=True), np.float32)
    bad = np.array([False, not own_width, False])  # request 1: 3 own tokens, no column
    valid = (*args[:-1], jnp.where(jnp.asarray(bad), 0, lens))  # the public op refuses it
    want = np.asarray(jaxattn.cascade_attention(*valid, implementation="reference"), np.float32)
    assert_close(out[~bad], want[~bad], jnp.bfloat16)
    np.testing.assert_array_equal(np.isnan(out).any(axis=(1, 2)), bad)
    assert np.isnan(out[bad]).all()


@pytest.mark.parametrize("interpret", MODES)
def test_soft_cap(interpret):
    c = case_of(5, "mixed", "bshd", jnp.bfloat16, (8, 2), 64, 16)
    out = call_cascade(
        cascade_mgpu.cascade_attention, c, soft_cap=3.0, prefix_pages=4, interpret=interpret
    )
    assert_close(out, spec_cascade(c, soft_cap=3.0), jnp.bfloat16)


def _damage_pages(c):
    """A bad page id among a prefix's pages poisons the requests on that prefix; a bad own
    page or length poisons that request (the kernel's checks)."""
    c.prefix_tables = c.prefix_tables.at[2, 1].set(10_000)  # prefix 2: requests 2 and 7
    c.block_tables = c.block_tables.at[4, 0].set(-3)  # read by request 4 (255 own tokens)
    c.seq_lens = c.seq_lens.at[5].set(10_000)  # over request 5's capacity
    return [2, 7, 4, 5]


def _damage_unpaged(c):
    """A prefix id out of range poisons its request; a continued prefix whose length is no
    multiple of the page size poisons the requests on it (the checks made before the
    launch, validity.cascade_unpaged_valid: the kernel reads the length it is given)."""
    c.prefix_of = c.prefix_of.at[6].set(3)  # 3 prefixes
    c.prefix_lens = c.prefix_lens.at[0].set(72)  # prefix 0: requests 0, 3 and 5
    return [0, 3, 5, 6]


@pytest.mark.parametrize("damage", [_damage_pages, _damage_unpaged])
@pytest.mark.parametrize("interpret", MODES)
def test_memory_safety_contract(interpret, damage):
    """What the contract calls invalid poisons exactly the requests it names (see each
    damage); the others are unchanged."""
    c = case_of(7, "mixed", "bshd", jnp.bfloat16, (8, 2), 64, 16)
    c.k_cache, c.v_cache = jnp.nan_to_num(c.k_cache), jnp.nan_to_num(c.v_cache)
    want = np.asarray(spec_cascade(c), np.float32)  # before the damage
    bad = np.zeros(8, bool)
    bad[damage(c)] = True
    out = np.asarray(
        call_cascade(cascade_mgpu.cascade_attention, c, prefix_pages=4, interpret=interpret),
        np.float32,
    )
    np.testing.assert_array_equal(np.isnan(out).any(axis=(1, 2)), bad)
    assert np.isnan(out[bad]).all()
    assert_close(out[~bad], want[~bad], jnp.bfloat16)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize(
    "fmt, batch, layout, heads, d", [
        (jnp.float8_e4m3fn, "mixed", "bshd", (8, 2), 64),
        (jnp.float8_e5m2, "shared", "bhsd", (8, 1), 128),
    ],
)  # fmt: skip
def test_fp8_caches(fmt, batch, layout, heads, d, interpret):
    """FP8 caches with per-KV-head scales: both levels widen each step to float16 in shared
    memory, q (the prefix tiles' gathered rows too) moved to float16 by a power of two per KV
    head, the values' scale applied to each part; against the spec on the stored values,
    NaN codes in unread slots."""
    prefixes, prefix_of, own = CASCADE_BATCHES[batch]
    c = make_cascade(
        np.random.default_rng(21), prefixes, prefix_of, own, num_q_heads=heads[0],
        num_kv_heads=heads[1], head_dim=d, page_size=16, layout=layout, dtype=jnp.bfloat16,
        kv_dtype=fmt,
    )  # fmt: skip
    assert c.k_scale is not None
    out = call_cascade(cascade_mgpu.cascade_attention, c, interpret=interpret)
    assert_close(out, spec_cascade(c), jnp.bfloat16)


def test_fp8_lowers_for_cuda():
    """The FP8 path of both levels in one launch, compiled for CUDA: no Triton kernel at
    head_dim 128."""
    pool = (512, 16, 8, 128)
    f8, i32 = jnp.float8_e4m3fn, jnp.int32
    args = (
        jax.ShapeDtypeStruct((64, 32, 128), jnp.bfloat16), jax.ShapeDtypeStruct(pool, f8),
        jax.ShapeDtypeStruct(pool, f8), jax.ShapeDtypeStruct((1, 256), i32),
        jax.ShapeDtypeStruct((1,), i32), jax.ShapeDtypeStruct((64,), i32),
        jax.ShapeDtypeStruct((64, 16), i32), jax.ShapeDtypeStruct((64,), i32),
        jax.ShapeDtypeStruct((8,), jnp.float32), jax.ShapeDtypeStruct((8,), jnp.float32),
    )  # fmt: skip

    def f(*a):
        *a, ks, vs = a
        return cascade_mgpu.cascade_attention(*a, k_scale=ks, v_scale=vs, interpret=False)

    assert "mosaic_gpu" in export_cuda(f, *args, triton=False).mlir_module()


def test_refusals():
    c = case_of(1, "mixed", "bshd", jnp.bfloat16, (8, 2), 64, 16)
    with pytest.raises(NotImplementedError, match="FP8 caches only"):
        call_cascade(
            cascade_mgpu.cascade_attention, c, k_scale=jnp.ones(2), v_scale=jnp.ones(2),
            interpret=True,
        )  # fmt: skip
    with pytest.raises(ValueError, match="prefix_pages"):
        call_cascade(cascade_mgpu.cascade_attention, c, prefix_pages=3, interpret=True)
    with pytest.raises(ValueError, match="lowering"):
        jaxattn.pallas.CascadeConfig(lowering="mosaic")


@pytest.mark.parametrize(
    "heads, d, batch, prefixes, merge",
    [
        ((32, 8), 128, 64, 1, None),
        ((32, 8), 128, 64, 3, None),
        ((8, 8), 64, 16, 2, None),
        ((14, 2), 64, 9, 2, None),
        ((8, 2), 64, 9, 2, "mosaic_gpu"),
    ],
)
def test_lowers_for_cuda(heads, d, batch, prefixes, merge):
    """Both levels' and the merge's compiled lowering on any machine (jax.export for CUDA);
    the first shape is the cascade benchmark's shared batch. At head_dim 128 the merge is the
    Mosaic GPU kernel and the program has no Triton kernel (the export refuses one); below,
    by default, the Triton-lowered merge, or (named) the Mosaic GPU merge's form of two query
    heads a block."""
    hq, hkv = heads
    pool = (512, 16, hkv, d)
    args = (
        jax.ShapeDtypeStruct((batch, hq, d), jnp.bfloat16),
        jax.ShapeDtypeStruct(pool, jnp.bfloat16),
        jax.ShapeDtypeStruct(pool, jnp.bfloat16),
        jax.ShapeDtypeStruct((prefixes, 256), jnp.int32),
        jax.ShapeDtypeStruct((prefixes,), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((batch, 16), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )

    def f(*a):
        return cascade_mgpu.cascade_attention(*a, interpret=False, merge=merge)

    triton = decode_mgpu.merge_lowering(merge, d, group=hq // hkv, tiled=True) == "triton"
    assert triton == (d % 128 != 0 and merge is None)
    text = export_cuda(f, *args, triton=triton).mlir_module()
    assert "mosaic_gpu" in text and ("jaxattn_cascade_merge" in text) == triton


@pytest.mark.parametrize("interpret", MODES)
def test_public_op_with_mosaic_gpu_lowering(interpret):
    """jaxattn.cascade_attention(implementation="pallas", config=CascadeConfig(lowering=
    "mosaic_gpu")) runs this kernel; an own partition given in tokens; partial pages
    refused."""
    if interpret and jax.default_backend() != "cpu":
        pytest.skip("the public op compiles on a GPU; interpret mode is tested above")
    c = case_of(9, "mixed", "bshd", jnp.bfloat16, (8, 2), 64, 16)
    cfg = jaxattn.pallas.CascadeConfig(lowering="mosaic_gpu", partition_size=128)
    out = call_cascade(jaxattn.cascade_attention, c, implementation="pallas", config=cfg)
    assert_close(out, spec_cascade(c), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="whole pages"):
        bad = jaxattn.pallas.CascadeConfig(lowering="mosaic_gpu", partition_size=72)
        call_cascade(jaxattn.cascade_attention, c, implementation="pallas", config=bad)


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_default_lowering(kv_dtype):
    """implementation="pallas" with no config: this kernel when compiled on sm_90 for a 16-bit
    cache at head_dim 128; the Triton-lowered kernel for head_dim 64, FP8 caches, other GPUs
    and the CPU interpreter."""
    from jaxattn import ops
    from jaxattn.pallas import IMPLEMENTATIONS

    impl = IMPLEMENTATIONS["cascade_attention"]
    fp8 = kv_dtype != jnp.bfloat16
    scales = dict(k_scale=0.5, v_scale=0.5) if fp8 else {}
    compiled = cascade_mgpu.is_sm90() and jax.default_backend() == "gpu" and not fp8
    for d, mosaic in ((128, compiled), (64, False)):
        k = jnp.zeros((64, 16, 2, d), kv_dtype)
        q = jnp.zeros((4, 8, d), jnp.bfloat16)
        args = ops.CASCADE_ATTENTION.bind(
            q, k, k, jnp.zeros((1, 8), jnp.int32), jnp.full((1,), 64, jnp.int32),
            jnp.zeros((4,), jnp.int32), jnp.zeros((4, 4), jnp.int32), jnp.full((4,), 9, jnp.int32),
            **scales,
        )  # fmt: skip
        assert impl.heuristic_config(args).lowering == ("mosaic_gpu" if mosaic else "triton")
