"""The engine over an FP8 KV pool (``CacheConfig.kv_dtype`` / ``kv_scales``): the pool's
dtype and bytes, scales per layer and KV head reaching every write and attention op
(one device and tensor parallel), the calibration helper against a direct computation,
and the checks on the new fields."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh_of
from test_engine import BUCKETS, CFG, PARAMS, POOL  # the engine tests' model and pool

from jaxattn.engine import (
    CacheConfig,
    Engine,
    calibrate_kv_scales,
    check_outputs,
)
from jaxattn.engine.verify import GAP_RTOL, GAP_RTOL_KV
from jaxattn.models import llama
from jaxattn.models.llama import ExtendBatch

FP8 = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}


def make_engine(**kw):
    args = dict(POOL, max_batch_tokens=32, buckets=BUCKETS, debug=True, dedup_tokens=4)
    args.update(kw)
    return Engine(CFG, PARAMS, **args)


def workload(seed, num=5, system=18):
    rng = np.random.default_rng(seed)
    sys_prompt = rng.integers(0, CFG.vocab_size, system).tolist()
    prompts = [
        sys_prompt + rng.integers(0, CFG.vocab_size, rng.integers(1, 12)).tolist()
        for _ in range(num - 1)
    ]
    return prompts + [prompts[0]]


def test_fused_rope_stores_with_the_pool_s_scales():
    """fused_rope over a scaled e4m3 pool (the native kernel's CPU handler): each layer's
    rotated keys and values stored with that layer's scales, the same greedy tokens as the
    rotation in XLA followed by the native write."""
    from jaxattn import native

    if not native.is_available():
        pytest.skip("the native library is not built")
    prompts = workload(5)
    scales = calibrate_kv_scales(CFG, PARAMS, prompts[:2], "fp8_e4m3")
    outs = {}
    for fused in (True, False):
        engine = make_engine(
            kv_dtype="fp8_e4m3", kv_scales=scales, kv_write="native", fused_rope=fused,
            decode_steps=4,
        )  # fmt: skip
        assert engine.runner.fused_rope == fused
        outs[fused] = engine.generate(prompts, 6)
    assert outs[True] == outs[False]
    report = check_outputs(PARAMS, CFG, prompts, outs[True], max_new_tokens=6, kv_dtype="fp8_e4m3")
    assert report.ok, report.problems[:5]


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_pool_serves_and_verifies_against_the_dense_model(kv_dtype):
    prompts = workload(3)
    scales = calibrate_kv_scales(CFG, PARAMS, prompts[:2], kv_dtype)
    engine = make_engine(kv_dtype=kv_dtype, kv_scales=scales, decode_steps=4)
    out = engine.generate(prompts, 8, n=2)
    report = check_outputs(PARAMS, CFG, prompts, out, max_new_tokens=8, n=2, kv_dtype=kv_dtype)
    assert report.ok, report.problems[:5]
    assert report.checked == 8 * 2 * len(prompts)
    assert report.rtol == GAP_RTOL_KV[kv_dtype] > GAP_RTOL["float32"]
    stats = engine.stats
    assert stats["prefix_hit_tokens"] > 0 and stats["forks"] == len(prompts)
    assert stats["decode_steps"] > stats["decode_calls"]  # several steps per dispatch
    assert stats["kv_dtype"] == np.dtype(FP8[kv_dtype]).name
    for cache in (engine.runner.k_cache, engine.runner.v_cache):
        assert cache.dtype == FP8[kv_dtype]
    engine.check_idle()


def test_fp8_pool_under_cascade_decode():
    """The rows that share the system prompt read it through cascade_attention, with the
    same scales."""
    prompts = workload(7, num=4, system=20)
    scales = calibrate_kv_scales(CFG, PARAMS, prompts[:2], "fp8_e4m3")
    kw = dict(kv_dtype="fp8_e4m3", kv_scales=scales, cascade="on", cascade_min_tokens=4)
    engine = make_engine(**kw)
    out = engine.generate(prompts, 8, n=2)
    assert engine.stats["cascade_steps"] > 0
    report = check_outputs(PARAMS, CFG, prompts, out, max_new_tokens=8, n=2, kv_dtype="fp8_e4m3")
    assert report.ok, report.problems[:5]
    bad = np.full_like(scales[0], 1e-4)
    out = make_engine(**dict(kw, kv_scales=(bad, bad))).generate(prompts, 8)
    assert not check_outputs(PARAMS, CFG, prompts, out, max_new_tokens=8, kv_dtype="fp8_e4m3").ok


def test_verification_tolerance_is_the_model_dtype_s_without_kv_dtype():
    prompts = workload(4, num=2)
    out = [[1, 2]] * 2
    report = check_outputs(PARAMS, CFG, prompts, out, max_new_tokens=2)
    assert report.rtol == GAP_RTOL["float32"]
    with pytest.raises(ValueError, match="kv_dtype"):
        check_outputs(PARAMS, CFG, prompts, out, max_new_tokens=2, kv_dtype="int8")


def test_scales_reach_the_pool_and_the_attention_ops():
    """Scales far too small saturate every K and V element: the outputs no longer pass the
    check that the calibrated ones pass; and a scale on every layer and head of 1.0 reads
    back what a pool without scales reads."""
    prompts = workload(5, num=3)
    bad = np.full((CFG.num_hidden_layers, CFG.num_key_value_heads), 1e-4, np.float32)
    out = make_engine(kv_dtype="fp8_e4m3", kv_scales=(bad, bad)).generate(prompts, 8)
    report = check_outputs(PARAMS, CFG, prompts, out, max_new_tokens=8, kv_dtype="fp8_e4m3")
    assert not report.ok
    ones = np.ones_like(bad)
    a = make_engine(kv_dtype="fp8_e4m3", kv_scales=(ones, ones)).generate(prompts, 8)
    b = make_engine(kv_dtype="fp8_e4m3").generate(prompts, 8)
    assert a == b


def test_fp8_tensor_parallel_matches_one_device():
    prompts = workload(6, num=3)
    scales = calibrate_kv_scales(CFG, PARAMS, prompts[:2], "fp8_e4m3")
    kw = dict(kv_dtype="fp8_e4m3", kv_scales=scales, unroll_layers=True)
    one = make_engine(**kw).generate(prompts, 6, n=2)
    engine = make_engine(mesh=mesh_of(2), **kw)
    assert engine.generate(prompts, 6, n=2) == one
    assert engine.runner.k_cache.dtype == jnp.float8_e4m3fn
    assert 2 * engine.stats["kv_pool_bytes_per_device"] == engine.stats["kv_pool_bytes"]


def test_pool_bytes_count_one_byte_per_element():
    num_pages, page_size = POOL["num_pages"], POOL["page_size"]
    elements = 2 * CFG.num_hidden_layers * num_pages * page_size * CFG.kv_size  # K and V
    fp8 = make_engine(kv_dtype="fp8_e4m3")
    assert fp8.stats["kv_pool_bytes"] == elements == 2 * 48 * 4 * 2 * 2 * 16
    f32 = make_engine()
    assert f32.stats["kv_pool_bytes"] == 4 * elements
    bf16 = dataclasses_replace_dtype(CFG, "bfloat16")
    assert bf16.kv_bytes_per_token() == 2 * CFG.kv_bytes_per_token(jnp.float8_e4m3fn)
    assert CFG.kv_bytes_per_token(jnp.float8_e5m2) * page_size * num_pages == elements
    assert fp8.kv_bytes_per_token == CFG.kv_bytes_per_token() // 4


def dataclasses_replace_dtype(cfg, dtype):
    import dataclasses

    return dataclasses.replace(cfg, dtype=dtype)


def test_calibrated_scales_are_amax_over_format_max_per_layer_and_head():
    """Against the K / V the paged extend pass actually writes into an f32 pool."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (5, 13, 9)]
    pages, page_size = 8, 4
    k_amax = np.zeros((CFG.num_hidden_layers, CFG.num_key_value_heads))
    v_amax = np.zeros_like(k_amax)
    for p in prompts:
        t = len(p)
        slots = jnp.arange(t, dtype=jnp.int32)
        batch = ExtendBatch(
            tokens=jnp.asarray(p, jnp.int32),
            positions=slots,
            slot_mapping=slots,
            qo_indptr=jnp.asarray([0, t], jnp.int32),
            kv_indptr=jnp.asarray([0, t], jnp.int32),
            kv_indices=slots,
            block_tables=None,
            seq_lens=None,
            logit_rows=jnp.asarray([t - 1], jnp.int32),
        )
        kc, vc = llama.init_kv_cache(CFG, pages, page_size)
        _, kc, vc = llama.forward_extend(PARAMS, CFG, kc, vc, batch)
        shape = (CFG.num_hidden_layers, pages * page_size, CFG.num_key_value_heads, -1)
        k = np.abs(np.asarray(kc).reshape(shape)[:, :t])
        v = np.abs(np.asarray(vc).reshape(shape)[:, :t])
        k_amax = np.maximum(k_amax, k.max(axis=(1, 3)))
        v_amax = np.maximum(v_amax, v.max(axis=(1, 3)))
    for name, big in (("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)):
        ks, vs = calibrate_kv_scales(CFG, PARAMS, prompts, name, rows=2)
        assert ks.shape == vs.shape == (CFG.num_hidden_layers, CFG.num_key_value_heads)
        assert ks.dtype == vs.dtype == np.float32
        np.testing.assert_allclose(ks, k_amax / big, rtol=1e-5)
        np.testing.assert_allclose(vs, v_amax / big, rtol=1e-5)
    # The dtype itself is accepted too, and gives the same scales.
    ks2, _ = calibrate_kv_scales(CFG, PARAMS, prompts, jnp.float8_e5m2)
    np.testing.assert_allclose(ks2, k_amax / 57344.0, rtol=1e-5)


def test_calibration_arguments():
    with pytest.raises(ValueError, match="kv_dtype"):
        calibrate_kv_scales(CFG, PARAMS, [[1, 2]], None)
    with pytest.raises(ValueError, match="kv_dtype"):
        calibrate_kv_scales(CFG, PARAMS, [[1, 2]], "float16")
    with pytest.raises(ValueError, match="prompts"):
        calibrate_kv_scales(CFG, PARAMS, [], "fp8_e4m3")
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        calibrate_kv_scales(CFG, PARAMS, [[1], [CFG.vocab_size]], "fp8_e4m3")
    with pytest.raises(TypeError, match="LlamaConfig"):
        calibrate_kv_scales(object(), PARAMS, [[1]], "fp8_e4m3")
    # The limit is on the prompts' positions, not on their padded length: 40 tokens pad to 64,
    # which a model of 48 positions still calibrates on; 49 tokens are refused.
    short = dataclasses.replace(CFG, max_position_embeddings=48)
    ks, _ = calibrate_kv_scales(short, PARAMS, [list(range(1, 41))], "fp8_e4m3")
    assert ks.shape == (CFG.num_hidden_layers, CFG.num_key_value_heads)
    with pytest.raises(ValueError, match="49 tokens, more than the model's"):
        calibrate_kv_scales(short, PARAMS, [[1] * 49], "fp8_e4m3")


GOOD = np.full((2, 2), 0.01, np.float32)
BAD_SCALES = {
    "not a pair": (GOOD, "a pair"),
    "one array": ((GOOD,), "a pair"),
    "1-D": ((GOOD[0], GOOD[0]), r"\[num_layers, num_kv_heads\]"),
    "zero": ((GOOD, np.zeros((2, 2))), "finite and positive"),
    "negative": ((-GOOD, GOOD), "finite and positive"),
    "nan": ((GOOD, np.full((2, 2), np.nan)), "finite and positive"),
    "inf": ((np.full((2, 2), np.inf), GOOD), "finite and positive"),
    "shapes differ": ((GOOD, np.full((2, 3), 0.01)), "one shape"),
    "strings": ((np.array([["a"]]), GOOD), "real numbers"),
}


@pytest.mark.parametrize("case", sorted(BAD_SCALES))
def test_kv_scales_are_checked(case):
    value, match = BAD_SCALES[case]
    with pytest.raises(ValueError, match="CacheConfig.kv_scales") as e:
        CacheConfig(num_pages=4, kv_scales=value)
    assert e.match(match)


def test_kv_scales_must_fit_the_model_and_kv_dtype_is_checked():
    wrong = np.full((3, 2), 0.01, np.float32)  # 3 layers, the model has 2
    with pytest.raises(ValueError, match=r"CacheConfig.kv_scales.*\[2, 2\]"):
        make_engine(kv_dtype="fp8_e4m3", kv_scales=(wrong, wrong))
    for bad in ("int8", "fp8", "float16", jnp.bfloat16, 8):
        with pytest.raises(ValueError, match="CacheConfig.kv_dtype"):
            CacheConfig(num_pages=4, kv_dtype=bad)
    assert CacheConfig(num_pages=4, kv_dtype=jnp.float8_e4m3fn).kv_dtype == "fp8_e4m3"
    assert CacheConfig(num_pages=4, kv_dtype="float8_e5m2").kv_dtype == "fp8_e5m2"
    assert CacheConfig(num_pages=4).kv_dtype is None
    # Stored by value: equal scales give equal (and hashable) records.
    a = CacheConfig(num_pages=4, kv_scales=(GOOD, GOOD))
    assert a == CacheConfig(num_pages=4, kv_scales=(GOOD.copy(), GOOD.tolist()))
    hash(a)
