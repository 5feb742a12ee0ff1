"""Pallas kernels against the spec.

Each case class runs twice: ``*Interpret`` (the kernel body in Pallas interpret mode;
what CPU CI runs) and ``*Compiled`` (the same cases compiled through Triton; needs a
GPU). Inputs are drawn fresh per case (seeded from the test id so a failure
reproduces), every unread page and slot holds NaN, block tables are permuted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
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
    spec_prefill,
)

import jaxattn
from jaxattn import pallas as P

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")


def _decode(case, *, interpret, **kw):
    return call_decode(P.paged_attention, case, interpret=interpret, **kw)


def _extend(c, *, interpret, **kw):
    return call_extend(P.extend_attention, c, interpret=interpret, **kw)


def _prefill(c, *, interpret, **kw):
    return call_prefill(P.prefix_prefill, c, interpret=interpret, **kw)


# --- decode ----------------------------------------------------------------------------


class DecodeCases:
    INTERPRET: bool

    @pytest.mark.parametrize(
        "layout,page_size,heads",
        [
            ("bshd", 16, (8, 2)),
            ("bhsd", 16, (8, 2)),
            ("bshd", 1, (4, 4)),
            ("bhsd", 1, (4, 1)),
            pytest.param("bshd", 64, (16, 1), marks=pytest.mark.slow),
            ("bshd", 128, (4, 4)),
            ("bhsd", 128, (32, 2)),
        ],
    )
    def test_layout_page_group(self, rng, layout, page_size, heads):
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
        out = _decode(case, scale=0.3, interpret=self.INTERPRET)
        assert out.shape == case.q.shape and out.dtype == case.q.dtype
        assert_close(out, spec_decode(case, scale=0.3))

    @pytest.mark.parametrize(
        "dtype,soft_cap,page_size",
        [
            (jnp.float32, None, 32),
            (jnp.bfloat16, 4.0, 64),
            (jnp.float16, None, 32),
            pytest.param(jnp.float32, 4.0, 16, marks=pytest.mark.slow),
            pytest.param(jnp.bfloat16, None, 16, marks=pytest.mark.slow),
            pytest.param(jnp.float16, 4.0, 64, marks=pytest.mark.slow),
        ],
    )
    def test_dtype_soft_cap(self, rng, dtype, soft_cap, page_size):
        case = make_paged_decode(
            rng,
            [3, 255, 40],
            num_q_heads=8,
            num_kv_heads=2,
            head_dim=64,
            page_size=page_size,
            dtype=dtype,
        )
        # A large scale drives the logits into the cap's bend.
        out = _decode(case, scale=0.5, soft_cap=soft_cap, interpret=self.INTERPRET)
        assert out.dtype == dtype
        assert_close(out, spec_decode(case, scale=0.5, soft_cap=soft_cap), dtype)

    @pytest.mark.parametrize(
        "partition_size", [None, 16, 100, pytest.param(512, marks=pytest.mark.slow), 8192]
    )
    def test_partition_size(self, rng, partition_size):
        # 0 tokens must give zeros; 8192 covers the whole context (one pass, no combine).
        case = make_paged_decode(
            rng,
            [4097, 1, 0, 513],
            num_q_heads=8,
            num_kv_heads=1,
            head_dim=32,
            page_size=32,
            layout="bhsd",
        )
        out = _decode(case, scale=0.2, partition_size=partition_size, interpret=self.INTERPRET)
        assert_close(out, spec_decode(case, scale=0.2))
        np.testing.assert_array_equal(np.asarray(out[2]), 0.0)

    def test_deterministic(self, rng):
        case = make_paged_decode(
            rng,
            [300, 77],
            num_q_heads=4,
            num_kv_heads=1,
            head_dim=32,
            page_size=16,
            dtype=jnp.bfloat16,
        )
        a = _decode(case, scale=0.2, partition_size=64, interpret=self.INTERPRET)
        b = _decode(case, scale=0.2, partition_size=64, interpret=self.INTERPRET)
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    def test_under_jit_with_traced_lengths(self, rng):
        case = make_paged_decode(
            rng, [17, 200], num_q_heads=8, num_kv_heads=2, head_dim=32, page_size=16
        )
        f = jax.jit(
            lambda q, k, v, t, n: P.paged_attention(
                q, k, v, t, n, scale=0.25, interpret=self.INTERPRET
            )
        )
        out = f(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
        assert_close(out, spec_decode(case, scale=0.25))


@pytest.mark.skipif(ON_GPU, reason="the compiled twin covers these cases on a GPU")
class TestDecodeInterpret(DecodeCases):
    INTERPRET = True


@pytest.mark.gpu
class TestDecodeCompiled(DecodeCases):
    INTERPRET = False

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
    @pytest.mark.parametrize("heads", [(32, 8), (32, 32), (64, 4), (128, 8)])
    def test_serving_shapes(self, rng, dtype, heads):
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
        out = _decode(case, scale=128**-0.5, interpret=False)
        assert_close(out, spec_decode(case, scale=128**-0.5), dtype)

    @pytest.mark.parametrize(
        "dtype,head_dim", [(jnp.float32, 128), (jnp.bfloat16, 256), (jnp.float32, 256)]
    )
    def test_default_tiles_fit_wide_heads(self, rng, dtype, head_dim):
        case = make_paged_decode(
            rng,
            [700, 33],
            num_q_heads=16,
            num_kv_heads=2,
            head_dim=head_dim,
            page_size=16,
            dtype=dtype,
        )
        out = _decode(case, scale=0.1, interpret=False)
        assert_close(out, spec_decode(case, scale=0.1), dtype)


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


def test_decode_refuses_what_it_cannot_serve(rng):
    case = make_paged_decode(
        rng, [5], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16, layout="vllm"
    )
    with pytest.raises(NotImplementedError, match="vllm"):
        _decode(case, scale=0.2, interpret=True)
    case = make_paged_decode(rng, [5], num_q_heads=4, num_kv_heads=2, head_dim=48, page_size=16)
    with pytest.raises(NotImplementedError, match="head_dim"):
        _decode(case, scale=0.2, interpret=True)
    with pytest.raises(NotImplementedError, match="dtype"):
        P.paged_attention(
            case.q.astype(jnp.bfloat16),
            case.k_cache,
            case.v_cache,
            case.block_tables,
            case.seq_lens,
            scale=0.2,
            interpret=True,
        )


def test_decode_through_ops(rng):
    """The public op with implementation="pallas" (interpreted on the CPU), under jit."""
    case = make_paged_decode(
        rng, [9, 130], num_q_heads=8, num_kv_heads=2, head_dim=32, page_size=16, dtype=jnp.bfloat16
    )
    f = jax.jit(lambda *a: jaxattn.paged_attention(*a, soft_cap=3.0, implementation="pallas"))
    out = f(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    assert_close(out, spec_decode(case, soft_cap=3.0), jnp.bfloat16)
    with pytest.raises(NotImplementedError):
        jaxattn.paged_attention(
            case.q,
            *jaxattn.layout.convert(case.k_cache, case.v_cache, "bshd", "vllm"),
            case.block_tables,
            case.seq_lens,
            layout="vllm",
            implementation="pallas",
        )


# --- extend / prefix prefill ----------------------------------------------------------


EXTEND_SHAPES = [
    # (prefix lens, new-token lens, (Hq, Hkv), config)
    ([0, 5, 40, 255], [3, 17, 1, 2], (4, 1), None),
    ([0], [513], (8, 2), P.ExtendConfig(block_q=32, block_n=16)),
    ([513, 17, 0], [1, 64, 3], (16, 1), P.ExtendConfig(block_q=64, block_n=32)),
    pytest.param([3, 100], [255, 31], (4, 4), None, marks=pytest.mark.slow),
    pytest.param(
        [1, 0, 255],
        [17, 3, 40],
        (8, 2),
        P.ExtendConfig(block_q=32, block_n=16, heads_per_tile=1),
        marks=pytest.mark.slow,
    ),
    ([70, 2], [40, 9], (32, 8), P.ExtendConfig(block_q=64, block_n=16, heads_per_tile=4)),
]


class ExtendCases:
    INTERPRET: bool

    @pytest.mark.parametrize("prefix,new,heads,config", EXTEND_SHAPES)
    def test_extend_shapes(self, rng, prefix, new, heads, config):
        hq, hkv = heads
        c = make_extend(rng, prefix, new, num_q_heads=hq, num_kv_heads=hkv, head_dim=32, pad_rows=3)
        out = _extend(c, scale=0.3, config=config, interpret=self.INTERPRET)
        assert out.shape == c.q.shape and out.dtype == c.q.dtype
        assert_close(out, spec_extend(c, scale=0.3))
        np.testing.assert_array_equal(np.asarray(out[-3:]), 0.0)  # padding rows

    @pytest.mark.parametrize(
        "layout,page_size,heads",
        [
            ("bshd", 16, (8, 2)),
            ("bhsd", 16, (4, 4)),
            ("bshd", 1, (4, 1)),
            pytest.param("bhsd", 1, (8, 2), marks=pytest.mark.slow),
            pytest.param("bshd", 64, (16, 1), marks=pytest.mark.slow),
            ("bhsd", 128, (8, 1)),
        ],
    )
    def test_prefill_layout_page(self, rng, layout, page_size, heads):
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
        out = _prefill(
            c, scale=0.3, config=P.ExtendConfig(block_q=32, block_n=32), interpret=self.INTERPRET
        )
        assert_close(out, spec_prefill(c, scale=0.3))

    @pytest.mark.parametrize(
        "dtype,soft_cap",
        [
            (jnp.float32, None),
            (jnp.bfloat16, 4.0),
            (jnp.float16, None),
            pytest.param(jnp.float32, 4.0, marks=pytest.mark.slow),
            pytest.param(jnp.bfloat16, None, marks=pytest.mark.slow),
            pytest.param(jnp.float16, 4.0, marks=pytest.mark.slow),
        ],
    )
    def test_dtype_soft_cap(self, rng, dtype, soft_cap):
        c = make_extend(
            rng, [40, 0], [20, 70], num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype
        )
        out = _extend(
            c,
            scale=0.5,
            soft_cap=soft_cap,
            interpret=self.INTERPRET,
            config=P.ExtendConfig(block_q=32, block_n=32, num_warps=4),
        )
        assert out.dtype == dtype
        assert_close(out, spec_extend(c, scale=0.5, soft_cap=soft_cap), dtype)

    def test_long_prefix(self, rng):
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
        out = _prefill(c, scale=0.2, interpret=self.INTERPRET)
        assert_close(out, spec_prefill(c, scale=0.2))

    def test_default_tiles_of_a_long_extend(self, rng):
        # >= 128 new tokens a request on average, 16-bit, D=128: the 256-row tiles of
        # 128 tokens x 2 heads that the default picks for long extends.
        c = make_extend(
            rng,
            [100, 37],
            [300, 140],
            num_q_heads=8,
            num_kv_heads=2,
            head_dim=128,
            dtype=jnp.bfloat16,
            pad_rows=5,
        )
        out = _extend(c, scale=0.1, interpret=self.INTERPRET)
        assert_close(out, spec_extend(c, scale=0.1))
        np.testing.assert_array_equal(np.asarray(out[-5:], np.float32), 0.0)

    def test_paged_and_pool_forms_agree(self, rng):
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
        cfg = P.ExtendConfig(block_q=32, block_n=16)
        a = _prefill(c, scale=0.2, config=cfg, interpret=self.INTERPRET)
        b = P.extend_attention(
            c.q, k, v, qo, kv, idx, scale=0.2, config=cfg, interpret=self.INTERPRET
        )
        # Same keys in the same order, same tiles: the same arithmetic.
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def test_deterministic(self, rng):
        c = make_extend(
            rng, [10, 90], [50, 7], num_q_heads=4, num_kv_heads=2, head_dim=32, dtype=jnp.bfloat16
        )
        a = _extend(c, scale=0.2, interpret=self.INTERPRET)
        b = _extend(c, scale=0.2, interpret=self.INTERPRET)
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.skipif(ON_GPU, reason="the compiled twin covers these cases on a GPU")
class TestExtendInterpret(ExtendCases):
    INTERPRET = True


@pytest.mark.gpu
class TestExtendCompiled(ExtendCases):
    INTERPRET = False

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
    @pytest.mark.parametrize("heads", [(32, 8), (32, 32), (64, 4)])
    def test_serving_shapes(self, rng, dtype, heads):
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
        out = _extend(c, scale=128**-0.5, interpret=False)
        assert_close(out, spec_extend(c, scale=128**-0.5), dtype)

    @pytest.mark.parametrize(
        "dtype,head_dim", [(jnp.float32, 128), (jnp.bfloat16, 256), (jnp.float32, 256)]
    )
    def test_default_tiles_fit_wide_heads(self, rng, dtype, head_dim):
        c = make_extend(
            rng, [300, 0], [200, 77], num_q_heads=16, num_kv_heads=2, head_dim=head_dim, dtype=dtype
        )
        out = _extend(c, scale=0.1, interpret=False)
        assert_close(out, spec_extend(c, scale=0.1), dtype)


def test_extend_through_ops(rng):
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
    f = jax.jit(lambda *a: jaxattn.prefix_prefill(*a, layout="bhsd", implementation="pallas"))
    out = f(c.q, c.k_cache, c.v_cache, c.cu_seqlens_q, c.block_tables, c.seq_lens)
    assert_close(out, spec_prefill(c), jnp.float16)
    k, v, qo, kv, idx = prefill_as_extend(c)
    out2 = jaxattn.extend_attention(c.q, k, v, qo, kv, idx, implementation="pallas")
    assert_close(out2, spec_prefill(c), jnp.float16)


def test_extend_rejects_bad_heads_per_tile(rng):
    c = make_extend(rng, [4], [4], num_q_heads=8, num_kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match="heads_per_tile"):
        _extend(c, scale=0.2, interpret=True, config=P.ExtendConfig(heads_per_tile=3))
