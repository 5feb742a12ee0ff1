"""What is particular to the Pallas backend: its tile and split heuristics and its
configuration checks. The kernels themselves run the shared suite of ``test_kernels.py``
(interpret mode on the CPU, compiled on a GPU)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import call_extend, make_extend, tol

from jaxattn import pallas as P
from jaxattn.pallas import _common as C
from jaxattn.pallas import merge_mgpu


def test_extend_tile_heuristic():
    cfg = P.extend._default_config
    long = cfg(128, 2, 4, tokens_per_request=512.0)
    assert (long.block_q, long.block_n, long.heads_per_tile, long.num_warps) == (256, 64, 2, 8)
    short = cfg(128, 2, 4, tokens_per_request=24.0)
    assert (short.block_q, short.heads_per_tile) == (128, None)
    assert P.extend._pick_heads_per_tile(short, 4) == 4  # 32 tokens x 4 heads
    assert cfg(128, 2, 1, tokens_per_request=512.0).block_n == 128  # MHA: unpacked
    assert cfg(128, 4, 4, tokens_per_request=512.0).num_stages == 2  # float32


def test_decode_partition_heuristic():
    cfg = P.DecodeConfig(min_programs=264)
    common = dict(num_kv_heads=8, max_context=4096, partition_size=None, config=cfg)
    assert P.choose_partition_size(batch=64, group=4, **common) == 512
    assert P.choose_partition_size(batch=64, group=16, **common) == 256
    assert P.choose_partition_size(batch=64, group=4, **{**common, "partition_size": 96}) == 96
    # One sequence of 32768: 8 KV heads x 64 partitions of 512 = 512 programs, enough.
    long_ctx = {**common, "max_context": 32768}
    assert P.choose_partition_size(batch=1, group=4, **long_ctx) == 512
    # One sequence of 4096: 64 programs of 512 are too few for 264; split down to the
    # smallest partition (128 tokens, 256 programs).
    assert P.choose_partition_size(batch=1, group=4, **common) == 128
    assert P.choose_partition_size(batch=4, group=4, **common) == 256


def test_extend_rejects_bad_heads_per_tile(rng):
    c = make_extend(rng, [4], [4], num_q_heads=8, num_kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match="heads_per_tile"):
        call_extend(
            P.extend_attention,
            c,
            scale=0.2,
            interpret=True,
            config=P.ExtendConfig(heads_per_tile=3),
        )


def test_config_checks():
    with pytest.raises(ValueError, match="block_n"):
        P.DecodeConfig(block_n=24)
    with pytest.raises(ValueError, match="block_q"):
        P.ExtendConfig(block_q=48)


def _merge_f64(acc, m, l_sum):
    """The split-KV merge in float64 numpy: NaN where a partition is NaN, 0 for a row whose
    partitions are all empty (denominator 0)."""
    acc, m, l_sum = (np.asarray(x, np.float64) for x in (acc, m, l_sum))
    w = np.exp2(m - m.max(axis=1, keepdims=True))
    denom = (w * l_sum).sum(axis=1)
    numer = (w[..., None] * acc).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = numer / denom[..., None]
    return np.where((denom == 0)[..., None], 0.0, out)


def _decode_merge(kernel, acc, m, l_sum, dtype, group=2):
    """Split-KV states acc f32[B, P, Hq, D], m, l_sum f32[B, P, Hq] merged by ``kernel``:
    the Triton-lowered merge reads them so; the Mosaic GPU one reads the Mosaic GPU decode
    kernel's layout (acc [B, P, Hkv, G, D], max and sum packed [B, P, Hkv, 2, 64])."""
    if kernel == "triton":
        return P.decode.combine(jnp.asarray(acc), jnp.asarray(m), jnp.asarray(l_sum), dtype)
    batch, parts, heads, head_dim = acc.shape
    ml = np.zeros((batch, parts, heads // group, 2, 64), np.float32)
    ml[:, :, :, 0, :group] = m.reshape(batch, parts, heads // group, group)
    ml[:, :, :, 1, :group] = l_sum.reshape(batch, parts, heads // group, group)
    acc5 = acc.reshape(batch, parts, heads // group, group, head_dim)
    if kernel == "xla":
        levels = [(False, jnp.asarray(acc5), jnp.asarray(ml))]
        return P.decode.combine_levels_jnp(levels, None, dtype, group=group)
    return merge_mgpu.merge(jnp.asarray(acc5), jnp.asarray(ml), dtype)


def _merge_params(shapes):
    """The split-KV merges: the Triton-lowered ones, XLA's (the Mosaic GPU ops' merge without
    those kernels) and the Mosaic GPU decode's own (where this JAX has the Mosaic GPU
    lowering): (kernel, *shape) for each merge and each of ``shapes(kernel)``, the Mosaic GPU one
    skipped where this JAX has no Mosaic GPU lowering."""
    no_mosaic = pytest.mark.skipif(bool(merge_mgpu.M.available()), reason="no Mosaic GPU lowering")
    return [
        pytest.param(kernel, *shape, marks=[no_mosaic] if kernel == "mosaic_gpu" else [])
        for kernel in ("triton", "xla", "mosaic_gpu")
        for shape in shapes(kernel)
    ]


# The Mosaic GPU merge's row forms: one row a block (head_dim 128), two rows side by side
# (64); the other merges take any head size (32 here).
MERGE_HEAD_DIMS = _merge_params(lambda k: [(128,), (64,)] if k == "mosaic_gpu" else [(32,)])


@pytest.mark.parametrize("kernel, head_dim", MERGE_HEAD_DIMS)
@pytest.mark.parametrize("parts", [1, 3, 32, 70])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_merge_kernel(rng, parts, dtype, kernel, head_dim):
    """Each merge after the split grids against float64: empty partitions (max
    M_INIT, sum 0) weigh nothing, a row of only empty partitions is 0, a NaN max or sum
    poisons its row, a NaN accumulator lane its lane, and nothing else (not the other row a
    Mosaic GPU merge block holds at head_dim 64); one chunk (group of loads) of
    partitions and several, the last one partial."""
    batch, heads = 3, 8
    acc = rng.standard_normal((batch, parts, heads, head_dim)).astype(np.float32)
    m = (6 * rng.standard_normal((batch, parts, heads))).astype(np.float32)
    l_sum = (rng.random((batch, parts, heads)) + 0.5).astype(np.float32)
    empty = rng.random((batch, parts, heads)) < 0.3
    empty[2, :, 5] = True  # a row with nothing to attend to
    # The poisoned partitions below are written ones (an empty partition's sum is 0).
    empty[0, parts - 1, 1] = empty[1, 0, 2] = empty[1, parts // 2, 3] = False
    m[empty], l_sum[empty], acc[empty] = C.M_INIT, 0.0, 0.0
    m[0, parts - 1, 1] = np.nan
    l_sum[1, 0, 2] = np.nan
    acc[1, parts // 2, 3, 7] = np.nan
    want = _merge_f64(acc, m, l_sum)
    got = _decode_merge(kernel, acc, m, l_sum, dtype)
    assert got.shape == (batch, heads, head_dim) and got.dtype == dtype
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    poisoned = np.zeros((batch, heads), bool)
    poisoned[0, 1] = poisoned[1, 2] = poisoned[1, 3] = True
    assert np.isnan(got).any(axis=-1).tolist() == poisoned.tolist()
    assert np.isnan(got[0, 1]).all() and np.isnan(got[1, 2]).all()  # a max, a sum
    assert np.isnan(got[1, 3]).tolist() == [d == 7 for d in range(head_dim)]  # one lane
    assert (got[2, 5] == 0).all()
    np.testing.assert_allclose(got[~poisoned], want[~poisoned], **tol(dtype))


@pytest.mark.skipif(bool(P.decode._triton.missing()), reason="no Triton lowering")
def test_counted_merge_reads_only_the_written_parts(rng):
    """combine_counted (the Triton cascade's merge): request b merges parts [0, own_n[b])
    and [own_parts, own_parts + pre_n[b]) of the first ``rows`` requests of the workspace,
    never the others (NaN garbage there changes nothing), NaN where ok[b] is 0; a request
    with no part is 0."""
    batch, own_parts, pre_parts, heads, d = 5, 3, 4, 4, 32
    parts = own_parts + pre_parts
    acc = rng.standard_normal((batch + 1, parts, heads, d)).astype(np.float32)
    m = (4 * rng.standard_normal((batch + 1, parts, heads))).astype(np.float32)
    l_sum = (rng.random((batch + 1, parts, heads)) + 0.5).astype(np.float32)
    own_n = np.array([3, 1, 0, 2, 0], np.int32)
    pre_n = np.array([0, 4, 2, 1, 0], np.int32)
    ok = np.array([1, 1, 1, 0, 1], np.int32)
    written = np.zeros((batch + 1, parts), bool)
    for b in range(batch):
        written[b, : own_n[b]] = written[b, own_parts : own_parts + pre_n[b]] = True
    acc[~written], m[~written], l_sum[~written] = np.nan, np.nan, np.nan
    got = P.decode.combine_counted(
        *map(jnp.asarray, (acc, m, l_sum, own_n, pre_n, ok)), jnp.float32, own_parts=own_parts,
        rows=batch, interpret=True,
    )  # fmt: skip
    assert got.shape == (batch, heads, d)
    got = np.asarray(got, np.float64)
    for b in range(batch):
        if not ok[b]:
            assert np.isnan(got[b]).all()
        elif not written[b].any():
            assert (got[b] == 0).all()
        else:
            sel = written[b]
            want = _merge_f64(acc[b : b + 1, sel], m[b : b + 1, sel], l_sum[b : b + 1, sel])[0]
            np.testing.assert_allclose(got[b], want, **tol(jnp.float32))


# The cascade merges' head sizes and groups: 3 heads (padded to 4 rows in the Triton kernel);
# the Mosaic GPU merge's pairs of one KV head's heads at head_dim 64.
CASCADE_MERGE_SHAPES = _merge_params(
    lambda k: [(128, 3), (64, 2), (64, 4)] if k == "mosaic_gpu" else [(32, 3)]
)


@pytest.mark.parametrize("kernel, d, group", CASCADE_MERGE_SHAPES)
@pytest.mark.parametrize("own_parts, prefix_parts", [(1, 3), (2, 70)])
def test_cascade_merge_kernel(rng, own_parts, prefix_parts, kernel, d, group):
    """Each cascade merge (decode.combine_levels, merge_mgpu.merge_levels, XLA's) against
    float64: each request's own parts and, when it has a prefix, its group's rows of its
    tile's prefix parts, read in place from the decode kernel's packed states; tiles of 2
    slots, one chunk of parts and several; a request that is not ok is NaN, a NaN part
    poisons its head (only), a request with nothing to attend to is 0."""
    B, hkv, slots, tiles, R_PAD = 5, 2, 2, 3, 64
    rows = slots * group

    def states(x, parts, r):
        acc = rng.standard_normal((x, parts, hkv, r, d)).astype(np.float32)
        ml = np.zeros((x, parts, hkv, 2, R_PAD), np.float32)
        ml[:, :, :, 0, :r] = 6 * rng.standard_normal((x, parts, hkv, r))
        ml[:, :, :, 1, :r] = rng.random((x, parts, hkv, r)) + 0.5
        return acc, ml

    acc_o, ml_o = states(B, own_parts, group)
    acc_p, ml_p = states(tiles, prefix_parts, rows)
    tile_of = np.array([0, 0, 1, 0, 2])
    slot_of = np.array([0, 1, 0, 0, 1])
    has = np.array([1, 1, 1, 0, 1])
    ok = np.array([1, 1, 1, 1, 0])
    # Request 3 has no prefix; its own parts are empty: nothing to attend to.
    ml_o[3, :, :, 0], ml_o[3, :, :, 1], acc_o[3] = C.M_INIT, 0.0, 0.0
    bad = 1 * group + group - 1  # request 2's head (KV head 1, last of its group)
    ml_p[1, prefix_parts - 1, 1, 1, 0 * group + group - 1] = np.nan
    want = np.zeros((B, hkv * group, d))
    for b in range(B):
        for h in range(hkv):
            for g in range(group):
                # (stats, accumulators, row) of each level the request has
                sources = [(ml_o[b, :, h], acc_o[b, :, h], g)]
                if has[b]:
                    t = tile_of[b]
                    sources.append((ml_p[t, :, h], acc_p[t, :, h], slot_of[b] * group + g))
                m = np.concatenate([ml[:, 0, r] for ml, _, r in sources])
                l_sum = np.concatenate([ml[:, 1, r] for ml, _, r in sources])
                acc = np.concatenate([a[:, r] for _, a, r in sources])
                merged = _merge_f64(acc[None, :, None], m[None, :, None], l_sum[None, :, None])
                want[b, h * group + g] = merged[0, 0]
    want[~ok.astype(bool)] = np.nan
    levels = [(False, jnp.asarray(acc_o), jnp.asarray(ml_o)),
              (True, jnp.asarray(acc_p), jnp.asarray(ml_p))]  # fmt: skip
    index = tuple(jnp.asarray(x, jnp.int32) for x in (tile_of, slot_of, has, ok))
    merge = {
        "triton": P.decode.combine_levels,
        "xla": P.decode.combine_levels_jnp,
        "mosaic_gpu": merge_mgpu.merge_levels,
    }[kernel]
    got = merge(levels, index, jnp.float32, group=group)
    assert got.shape == (B, hkv * group, d) and got.dtype == jnp.float32
    got = np.asarray(got, np.float64)
    np.testing.assert_array_equal(np.isnan(got).all(axis=-1), np.isnan(want).all(axis=-1))
    assert np.isnan(got[2, bad]).all() and np.isnan(got[4]).all()  # a NaN part, not ok
    assert not np.isnan(got[2, :bad]).any()  # the head beside it in a merge block too
    assert (got[3] == 0).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
