"""Native (XLA FFI) kernels against the spec.

The same cases run on whatever platform JAX uses: the C++ handlers on the CPU, the CUDA or
HIP kernels on a GPU. Inputs are drawn fresh per case (seeded from the test id), every
unread page and slot holds NaN, block tables are permuted. When the library is not built
the module is skipped, unless JAXATTN_REQUIRE_NATIVE=1 (CI) turns that into a failure.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    DTYPES,
    assert_close,
    call_decode,
    call_extend,
    call_prefill,
    make_extend,
    make_paged_decode,
    make_prefix_prefill,
    prefill_as_extend,
    spec_decode,
    spec_extend,
    spec_paged_attention,
    spec_prefill,
    spec_prefix_prefill,
)

import jaxattn
from jaxattn import native

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")

if not native.is_available():
    if os.environ.get("JAXATTN_REQUIRE_NATIVE") == "1":
        raise RuntimeError("JAXATTN_REQUIRE_NATIVE=1 but the native library is not available")
    pytest.skip("the native library is not built", allow_module_level=True)


def _decode(case, **kw):
    return call_decode(jaxattn.paged_attention, case, implementation="native", **kw)


def _extend(c, **kw):
    return call_extend(jaxattn.extend_attention, c, implementation="native", **kw)


def _prefill(c, **kw):
    return call_prefill(jaxattn.prefix_prefill, c, implementation="native", **kw)


# --- decode ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout,page_size,heads,partition_size",
    [
        ("bshd", 16, (8, 2), None),
        ("bhsd", 16, (8, 2), 128),
        ("bshd", 1, (4, 4), 128),
        ("bhsd", 1, (4, 1), None),
        ("bshd", 32, (16, 1), 128),
        ("bhsd", 64, (8, 1), None),
        ("bshd", 128, (4, 4), None),
        ("bhsd", 128, (32, 2), 128),
        ("bshd", 16, (64, 1), 128),
        ("bhsd", 16, (24, 2), None),
    ],
)
def test_decode_layout_page_group(rng, layout, page_size, heads, partition_size):
    hq, hkv = heads
    case = make_paged_decode(
        rng,
        [1, 3, 17, 255, 513],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=32,
        page_size=page_size,
        layout=layout,
    )
    out = _decode(case, scale=0.3, partition_size=partition_size)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, spec_decode(case, scale=0.3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("soft_cap,head_dim", [(None, 128), (4.0, 64)])
def test_decode_dtype_soft_cap(rng, dtype, soft_cap, head_dim):
    case = make_paged_decode(
        rng,
        [3, 255, 40],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=head_dim,
        page_size=16,
        dtype=dtype,
    )
    # A large scale drives the logits into the cap's bend.
    out = _decode(case, scale=0.5, soft_cap=soft_cap)
    assert out.dtype == dtype
    assert_close(out, spec_decode(case, scale=0.5, soft_cap=soft_cap), dtype)


@pytest.mark.parametrize("partition_size", [None, 16, 100, 512, 8192])
def test_decode_partition_size(rng, partition_size):
    # 0 tokens must give zeros; 8192 covers the whole context (one partition).
    case = make_paged_decode(
        rng,
        [4097, 1, 0, 513],
        num_q_heads=8,
        num_kv_heads=1,
        head_dim=32,
        page_size=32,
        layout="bhsd",
    )
    out = _decode(case, scale=0.2, partition_size=partition_size)
    assert_close(out, spec_decode(case, scale=0.2))
    np.testing.assert_array_equal(np.asarray(out[2]), 0.0)


def test_decode_partition_from_environment(rng, monkeypatch):
    case = make_paged_decode(
        rng, [700, 33], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16, dtype=jnp.bfloat16
    )
    monkeypatch.setenv("JAXATTN_PARTITION_SIZE", "64")
    out = _decode(case, scale=0.2)
    assert_close(out, spec_decode(case, scale=0.2))
    monkeypatch.setenv("JAXATTN_PARTITION_SIZE", "-3")
    with pytest.raises(ValueError, match="JAXATTN_PARTITION_SIZE"):
        _decode(case, scale=0.2)


def test_partition_choice(monkeypatch):
    monkeypatch.setattr(native, "_num_multiprocessors", lambda: 132)
    common = dict(num_kv_heads=8, capacity=4096)
    assert native.choose_partition_size(96, platform="cuda", batch=64, group=4, **common) == 96
    # Few sequences leave a GPU short of blocks: split, from 512 (256 for large groups),
    # into the largest partitions whose grid fills 90% of one wave (2 x 132 blocks) ...
    assert native.choose_partition_size(None, platform="cuda", batch=4, group=4, **common) == 512
    assert native.choose_partition_size(None, platform="cuda", batch=8, group=4, **common) == 1024
    assert native.choose_partition_size(None, platform="cuda", batch=4, group=16, **common) == 512
    long_ctx = dict(num_kv_heads=8, capacity=32768)
    assert native.choose_partition_size(None, platform="cuda", batch=1, group=4, **long_ctx) == 1024
    # ... or smaller ones, down to 128 tokens, when even the base leaves it short.
    assert native.choose_partition_size(None, platform="cuda", batch=2, group=4, **common) == 256
    assert native.choose_partition_size(None, platform="cuda", batch=1, group=4, **common) == 128
    assert native.choose_partition_size(None, platform="cuda", batch=1, group=16, **common) == 128
    # One query head per KV head: its kernel holds 8 blocks per SM, so the wave is 4x larger.
    mha = dict(num_kv_heads=32, capacity=32768)
    assert native.choose_partition_size(None, platform="cuda", batch=1, group=1, **mha) == 1024
    # $JAXATTN_PARTITION_SIZE is taken as it is.
    monkeypatch.setenv("JAXATTN_PARTITION_SIZE", "1024")
    assert native.choose_partition_size(None, platform="cuda", batch=1, group=4, **common) == 1024
    monkeypatch.delenv("JAXATTN_PARTITION_SIZE")
    # Enough sequences, a context within one partition, or the CPU: one pass.
    assert native.choose_partition_size(None, platform="cuda", batch=4096, group=4, **common) == 0
    assert (
        native.choose_partition_size(
            None, platform="cuda", batch=1, group=4, num_kv_heads=8, capacity=512
        )
        == 0
    )
    assert native.choose_partition_size(None, platform="cpu", batch=1, group=4, **common) == 0


def test_decode_deterministic(rng):
    case = make_paged_decode(
        rng, [300, 77], num_q_heads=4, num_kv_heads=1, head_dim=32, page_size=16, dtype=jnp.bfloat16
    )
    a = _decode(case, scale=0.2, partition_size=64)
    b = _decode(case, scale=0.2, partition_size=64)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_decode_jit_shows_custom_call_and_traces_lengths(rng):
    case = make_paged_decode(
        rng, [17, 200], num_q_heads=8, num_kv_heads=2, head_dim=32, page_size=16
    )
    f = jax.jit(
        lambda q, k, v, t, n: jaxattn.paged_attention(
            q, k, v, t, n, scale=0.25, implementation="native"
        )
    )
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    hlo = f.lower(*args).as_text()
    assert "custom_call" in hlo and "jaxattn_paged_attention" in hlo
    assert_close(f(*args), spec_decode(case, scale=0.25))


def test_decode_vmap_over_queries(rng):
    case = make_paged_decode(
        rng, [5, 130], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16
    )
    qs = jnp.stack([case.q, 2.0 * case.q, -case.q])
    f = jax.vmap(
        lambda q: jaxattn.paged_attention(
            q,
            case.k_cache,
            case.v_cache,
            case.block_tables,
            case.seq_lens,
            scale=0.3,
            implementation="native",
        )
    )
    out = jax.jit(f)(qs)
    for i in range(qs.shape[0]):
        want = spec_paged_attention(
            qs[i], case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale=0.3
        )
        assert_close(out[i], want)


def test_decode_refuses_vllm_layout(rng):
    case = make_paged_decode(
        rng, [5], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16, layout="vllm"
    )
    with pytest.raises(NotImplementedError, match="vllm"):
        _decode(case, scale=0.2)


@pytest.mark.skipif(not ON_GPU, reason="the CPU handlers take any head_dim")
def test_gpu_refuses_unbuilt_head_dim(rng):
    case = make_paged_decode(rng, [5], num_q_heads=4, num_kv_heads=2, head_dim=48, page_size=16)
    with pytest.raises(NotImplementedError, match="head_dim"):
        _decode(case, scale=0.2)


@pytest.mark.skipif(ON_GPU, reason="the CPU handlers take any head_dim")
def test_cpu_takes_any_head_dim(rng):
    case = make_paged_decode(rng, [5, 40], num_q_heads=4, num_kv_heads=2, head_dim=48, page_size=16)
    assert_close(_decode(case, scale=0.2, partition_size=16), spec_decode(case, scale=0.2))


def test_handler_reports_bad_arguments(rng):
    """A shape the handler rejects comes back as an XLA error carrying its message."""
    case = make_paged_decode(rng, [5, 9], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16)
    call = jax.ffi.ffi_call(
        "jaxattn_paged_attention",
        (jax.ShapeDtypeStruct(case.q.shape, case.q.dtype), jax.ShapeDtypeStruct((1,), jnp.float32)),
        vmap_method="sequential",
    )
    with pytest.raises(Exception, match="seq_lens must be"):
        jax.block_until_ready(
            call(
                case.q,
                case.k_cache,
                case.v_cache,
                case.block_tables,
                case.seq_lens[:1],
                scale=np.float32(0.2),
                soft_cap=np.float32(0),
                layout=np.int32(0),
                partition_size=np.int32(0),
            )
        )


def test_missing_library_names_the_build(monkeypatch):
    monkeypatch.setattr(native, "_registered", {})
    monkeypatch.setattr(native, "library_path", lambda platform: None)
    assert not native.is_available()
    with pytest.raises(NotImplementedError, match="pip install"):
        native.paged_attention(None, None, None, None, None, scale=1.0, layout="bshd")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("heads", [(32, 8), (32, 32), (64, 4), (128, 8)])
def test_decode_serving_shapes(rng, dtype, heads):
    hq, hkv = heads
    case = make_paged_decode(
        rng,
        [4097, 1, 1000, 8191, 255],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=128,
        page_size=16,
        dtype=dtype,
    )
    # The kernel's own choice: one pass or split-KV, by batch size.
    out = _decode(case, scale=128**-0.5)
    assert_close(out, spec_decode(case, scale=128**-0.5), dtype)


# --- extend / prefix prefill ----------------------------------------------------------


EXTEND_SHAPES = [
    # (prefix lens, new-token lens, (Hq, Hkv))
    ([0, 5, 40, 255], [3, 17, 1, 2], (4, 1)),
    ([0], [513], (8, 2)),
    ([513, 17, 0], [1, 64, 3], (16, 1)),
    ([3, 100], [255, 31], (4, 4)),
    ([1, 0, 255], [17, 3, 40], (8, 2)),
    ([70, 2], [40, 9], (32, 8)),
]


@pytest.mark.parametrize("prefix,new,heads", EXTEND_SHAPES)
def test_extend_shapes(rng, prefix, new, heads):
    hq, hkv = heads
    c = make_extend(rng, prefix, new, num_q_heads=hq, num_kv_heads=hkv, head_dim=32, pad_rows=3)
    out = _extend(c, scale=0.3)
    assert out.shape == c.q.shape and out.dtype == c.q.dtype
    assert_close(out, spec_extend(c, scale=0.3))
    np.testing.assert_array_equal(np.asarray(out[-3:]), 0.0)  # padding rows


@pytest.mark.parametrize(
    "layout,page_size,heads",
    [
        ("bshd", 16, (8, 2)),
        ("bhsd", 16, (4, 4)),
        ("bshd", 1, (4, 1)),
        ("bhsd", 1, (8, 2)),
        ("bshd", 64, (16, 1)),
        ("bhsd", 128, (8, 1)),
    ],
)
def test_prefill_layout_page(rng, layout, page_size, heads):
    hq, hkv = heads
    c = make_prefix_prefill(
        rng,
        [0, 200, 33],
        [17, 1, 130],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=32,
        page_size=page_size,
        layout=layout,
        pad_rows=2,
    )
    out = _prefill(c, scale=0.3)
    assert_close(out, spec_prefill(c, scale=0.3))
    np.testing.assert_array_equal(np.asarray(out[-2:]), 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("soft_cap,head_dim", [(None, 64), (4.0, 128)])
def test_extend_dtype_soft_cap(rng, dtype, soft_cap, head_dim):
    c = make_extend(
        rng,
        [40, 0, 130],
        [20, 70, 65],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=head_dim,
        dtype=dtype,
    )
    out = _extend(c, scale=0.5, soft_cap=soft_cap)
    assert out.dtype == dtype
    assert_close(out, spec_extend(c, scale=0.5, soft_cap=soft_cap), dtype)


@pytest.mark.parametrize(
    "dtype,layout", [(jnp.float32, "bshd"), (jnp.bfloat16, "bhsd"), (jnp.float16, "bshd")]
)
def test_prefill_head_dim_128(rng, dtype, layout):
    c = make_prefix_prefill(
        rng,
        [64, 0, 255],
        [130, 64, 17],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=128,
        page_size=16,
        layout=layout,
        dtype=dtype,
        pad_rows=1,
    )
    out = _prefill(c, scale=128**-0.5)
    assert_close(out, spec_prefill(c, scale=128**-0.5), dtype)


def test_prefill_long_prefix(rng):
    c = make_prefix_prefill(
        rng,
        [4097, 0],
        [3, 255],
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=32,
        page_size=32,
        layout="bhsd",
    )
    assert_close(_prefill(c, scale=0.2), spec_prefill(c, scale=0.2))


def test_paged_and_pool_forms_agree(rng):
    c = make_prefix_prefill(
        rng,
        [37, 5],
        [29, 64],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=32,
        page_size=16,
        layout="bshd",
    )
    k, v, qo, kv, idx = prefill_as_extend(c)
    a = _prefill(c, scale=0.2)
    b = jaxattn.extend_attention(c.q, k, v, qo, kv, idx, scale=0.2, implementation="native")
    # One kernel, the same keys in the same order: the same arithmetic.
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_extend_deterministic_and_jitted(rng):
    c = make_extend(
        rng, [10, 90], [50, 7], num_q_heads=4, num_kv_heads=2, head_dim=32, dtype=jnp.bfloat16
    )
    f = jax.jit(lambda *a: jaxattn.extend_attention(*a, scale=0.2, implementation="native"))
    args = (c.q, c.k_pool, c.v_pool, c.qo_indptr, c.kv_indptr, c.kv_indices)
    assert "jaxattn_extend_attention" in f.lower(*args).as_text()
    a, b = f(*args), f(*args)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert_close(a, spec_extend(c, scale=0.2), jnp.bfloat16)


def test_prefill_vmap_and_hlo(rng):
    c = make_prefix_prefill(
        rng,
        [20, 0],
        [5, 33],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=32,
        page_size=16,
        layout="bhsd",
        dtype=jnp.float16,
    )

    def f(q):
        return jaxattn.prefix_prefill(
            q,
            c.k_cache,
            c.v_cache,
            c.cu_seqlens_q,
            c.block_tables,
            c.seq_lens,
            layout="bhsd",
            implementation="native",
        )

    assert "jaxattn_prefix_prefill" in jax.jit(f).lower(c.q).as_text()
    qs = jnp.stack([c.q, -c.q])
    out = jax.jit(jax.vmap(f))(qs)
    for i in range(2):
        want = spec_prefix_prefill(
            qs[i], c.k_cache, c.v_cache, c.cu_seqlens_q, c.block_tables, c.seq_lens, layout="bhsd"
        )
        assert_close(out[i], want, jnp.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,heads", [(jnp.bfloat16, (32, 8)), (jnp.float16, (64, 4))])
def test_extend_serving_shapes(rng, dtype, heads):
    hq, hkv = heads
    c = make_extend(
        rng,
        [2048, 0, 1000, 4097],
        [512, 1000, 24, 1],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=128,
        dtype=dtype,
        pad_rows=5,
    )
    out = _extend(c, scale=128**-0.5)
    assert_close(out, spec_extend(c, scale=128**-0.5), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_prefill_serving_shapes(rng, layout):
    c = make_prefix_prefill(
        rng,
        [2048, 1000, 0],
        [512, 24, 300],
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        layout=layout,
        dtype=jnp.bfloat16,
        pad_rows=4,
    )
    out = _prefill(c, scale=128**-0.5)
    assert_close(out, spec_prefill(c, scale=128**-0.5), jnp.bfloat16)
