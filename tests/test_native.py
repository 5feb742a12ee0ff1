"""What is particular to the native backend: its split-KV heuristic, its configuration and
overrides, the FFI handlers' own checks, and a missing library. The kernels themselves run
the shared suite of ``test_kernels.py``.

When the library is not built the module is skipped, unless JAXATTN_REQUIRE_NATIVE=1 (CI)
turns that into a failure.
"""

from __future__ import annotations

import ctypes
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_close,
    call_decode,
    call_prefill,
    make_paged_decode,
    make_prefix_prefill,
    spec_decode,
    spec_prefill,
)

import jaxattn
from jaxattn import native, ops

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")

if not native.is_available():
    if os.environ.get("JAXATTN_REQUIRE_NATIVE") == "1":
        raise RuntimeError("JAXATTN_REQUIRE_NATIVE=1 but the native library is not available")
    pytest.skip("the native library is not built", allow_module_level=True)


def test_partition_from_environment(rng, set_env):
    set_env(JAXATTN_PARTITION_SIZE="64")
    common = dict(num_kv_heads=2, group=2, capacity=4096, occupancy=(2, 132))
    assert native.choose_partition_size(None, platform="cuda", batch=1, **common) == 64
    # The override is taken as it is, but enough sequences still run in one pass.
    assert native.choose_partition_size(None, platform="cuda", batch=4096, **common) == 0
    case = make_paged_decode(
        rng, [700, 33], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16, dtype=jnp.bfloat16
    )
    out = call_decode(jaxattn.paged_attention, case, scale=0.2, implementation="native")
    assert_close(out, spec_decode(case, scale=0.2))


def test_partition_choice():
    common = dict(num_kv_heads=8, capacity=4096, occupancy=(2, 132))
    choose = native.choose_partition_size
    assert choose(96, platform="cuda", batch=64, group=4, **common) == 96
    # Few sequences leave a GPU short of blocks: split, from 512 (256 for large groups),
    # into the largest partitions whose grid fills 90% of one wave (2 x 132 blocks) ...
    assert choose(None, platform="cuda", batch=4, group=4, **common) == 512
    assert choose(None, platform="cuda", batch=8, group=4, **common) == 1024
    assert choose(None, platform="cuda", batch=4, group=16, **common) == 512
    long_ctx = dict(common, capacity=32768)
    assert choose(None, platform="cuda", batch=1, group=4, **long_ctx) == 1024
    # ... or smaller ones, down to 128 tokens, when even the base leaves it short.
    assert choose(None, platform="cuda", batch=2, group=4, **common) == 256
    assert choose(None, platform="cuda", batch=1, group=4, **common) == 128
    assert choose(None, platform="cuda", batch=1, group=16, **common) == 128
    # The FP8 kernel fits 4 blocks an SM at head_dim 128; its split grids aim at 2.
    fp8 = native._split_occupancy((4, 132), jnp.float8_e4m3fn)
    assert fp8 == (2, 132) and native._split_occupancy((4, 132), jnp.bfloat16) == (4, 132)
    assert choose(None, platform="cuda", batch=1, group=4, **dict(long_ctx, occupancy=fp8)) == 1024
    # A kernel with 8 resident blocks per SM (the one-head kernel) has a 4x larger wave.
    mha = dict(num_kv_heads=32, capacity=32768, occupancy=(8, 132))
    assert choose(None, platform="cuda", batch=1, group=1, **mha) == 1024
    # Groups past 8 on the tensor-core kernels take several blocks a KV head, and the rule
    # counts blocks: 64 x 4 KV heads x 2 blocks fill the grid in one pass, 8 x 4 x 2 split
    # into 1024-token partitions (counting (sequence, KV head) pairs gave 2048 and 512).
    g16 = dict(num_kv_heads=4, group=16, capacity=4096, occupancy=(2, 132))
    assert choose(None, platform="cuda", batch=64, head_blocks=2, **g16) == 0
    assert choose(None, platform="cuda", batch=64, **g16) == 2048
    assert choose(None, platform="cuda", batch=8, head_blocks=2, **g16) == 1024
    assert choose(None, platform="cuda", batch=8, **g16) == 512
    with pytest.raises(ValueError, match="occupancy"):
        choose(None, platform="cuda", batch=8, num_kv_heads=4, group=4, capacity=4096)
    # The FP8 split grids' cap of 2 blocks an SM holds for one block a KV head only.
    assert native._split_occupancy((4, 132), jnp.float8_e4m3fn, 2) == (4, 132)
    # A one-pass grid that fits one wave of its kernel and holds 90% of 2 blocks an SM
    # (237.6 on 132 SMs) runs in one pass below the 3-an-SM threshold (396); fewer blocks,
    # or a grid past one wave, still split. bf16 32/8 (2 an SM): 256 blocks, 192, 384.
    wave = dict(common, one_pass_occupancy=2)
    assert choose(None, platform="cuda", batch=32, group=4, **wave) == 0
    assert choose(None, platform="cuda", batch=32, group=4, **common) == 2048
    assert choose(None, platform="cuda", batch=24, group=4, **wave) == 2048
    assert choose(None, platform="cuda", batch=48, group=4, **wave) == 2048
    # e4m3 32/8: the kernel fits 4 an SM, its split grids 2; 256 and 384 blocks run in one
    # pass, 192 split. 128/8 e4m3 (2 blocks a KV head, no cap): 24 x 8 x 2 = 384 blocks.
    fp8_wave = dict(common, occupancy=fp8, one_pass_occupancy=4)
    assert choose(None, platform="cuda", batch=32, group=4, **fp8_wave) == 0
    assert choose(None, platform="cuda", batch=48, group=4, **fp8_wave) == 0
    assert choose(None, platform="cuda", batch=24, group=4, **fp8_wave) == 2048
    g16_fp8 = dict(g16, num_kv_heads=8, occupancy=(4, 132), head_blocks=2)
    assert choose(None, platform="cuda", batch=24, one_pass_occupancy=4, **g16_fp8) == 0
    assert choose(None, platform="cuda", batch=24, **g16_fp8) == 2048
    # Not for the one-head SIMT kernel (8 an SM): 8 x 32 KV heads = 256 blocks still split.
    mha8 = dict(num_kv_heads=32, group=1, capacity=4096, occupancy=(8, 132))
    assert choose(None, platform="cuda", batch=8, one_pass_occupancy=8, **mha8) == 1024
    # Enough sequences, a context within one partition, or the CPU: one pass.
    assert choose(None, platform="cuda", batch=4096, group=4, **common) == 0
    assert choose(None, platform="cuda", batch=1, group=4, **dict(common, capacity=512)) == 0
    assert choose(None, platform="cpu", batch=1, group=4, num_kv_heads=8, capacity=4096) == 0


def test_ring_rows_bound():
    # The GPU decode and cascade rings number a cache's rows in uint32 (0xffffffff masks a
    # row): a cache of 2**32 rows (an FP8 cache of head_dim 32 at 128 GiB) is refused with the
    # reason, one of 32 rows fewer is not, and the CPU handlers have no such bound.
    fp8 = jnp.float8_e4m3fn
    big = jax.ShapeDtypeStruct((2**27, 16, 2, 32), fp8)
    fits = jax.ShapeDtypeStruct((2**27 - 1, 16, 2, 32), fp8)
    why = native._ring_rows_unsupported("cuda", big, fits, 32)
    assert why is not None and "4294967296" in why and "cache rows" in why
    assert native._ring_rows_unsupported("cuda", fits, fits, 32) is None
    assert native._ring_rows_unsupported("cpu", big, big, 32) is None
    # The ops that run the rings (decode, cascade) refuse it before any kernel; prefill does not.
    q = jax.ShapeDtypeStruct((4, 8, 32), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="cache rows"):
        native._require("cuda", q, big, big, "bshd", ring=True)
    assert native._require("cuda", q, big, big, "bshd").head_dim == 32
    assert native._PagedAttention.ring and native._CascadeAttention.ring
    assert not native._PrefixPrefill.ring and not native._ExtendAttention.ring


def test_decode_queries_read_the_library(monkeypatch):
    # The ctypes plumbing of the library's decode queries, against C callables standing in
    # for the GPU library (the queries themselves need a GPU: the test below).
    c_int, ptr = ctypes.c_int, ctypes.POINTER(ctypes.c_int)
    seen = []

    def occupancy(dtype, kv, head_dim, group, blocks, sms):
        seen.append((dtype, kv, head_dim, group))
        blocks[0], sms[0] = 2, 132
        return 0

    def head_blocks(dtype, kv, head_dim, group, blocks):
        blocks[0] = -(-group // 8) if group > 1 else 1
        return 0 if head_dim != 96 else 3

    fake = types.SimpleNamespace(
        jaxattn_decode_occupancy=ctypes.CFUNCTYPE(c_int, c_int, c_int, c_int, c_int, ptr, ptr)(
            occupancy
        ),
        jaxattn_decode_head_blocks=ctypes.CFUNCTYPE(c_int, c_int, c_int, c_int, c_int, ptr)(
            head_blocks
        ),
    )
    monkeypatch.setitem(native._lib_handles, "fake", fake)
    native.decode_occupancy.cache_clear()
    native.decode_head_blocks.cache_clear()
    try:
        got = native.decode_occupancy("fake", jnp.bfloat16, 128, 16, jnp.float8_e5m2)
        assert got == (2, 132) and seen == [(1, 2, 128, 16)]
        assert native.decode_head_blocks("fake", jnp.float16, 128, 20) == 3
        with pytest.raises(RuntimeError, match="blocks per KV head.*head_dim 96.*error 3"):
            native.decode_head_blocks("fake", jnp.float16, 96, 20)
    finally:
        native.decode_occupancy.cache_clear()
        native.decode_head_blocks.cache_clear()


@pytest.mark.gpu
def test_occupancy_comes_from_the_library():
    blocks, sms = native.decode_occupancy(native._platform(), jnp.bfloat16, 128, 4)
    assert sms == jax.devices()[0].core_count and 1 <= blocks <= 32
    one_head, _ = native.decode_occupancy(native._platform(), jnp.bfloat16, 128, 1)
    assert one_head >= blocks  # the one-head kernel is the lighter one
    # Blocks a KV head: one up to 8 query heads; past 8, ceil(group / 8) where the
    # tensor-core kernels serve the group (a 16-bit q on NVIDIA sm_80+), else one (SIMT).
    platform = native._platform()
    cc = float(getattr(jax.devices()[0], "compute_capability", "0") or 0)
    mma = platform == "cuda" and cc >= 8.0
    heads = native.decode_head_blocks
    assert heads(platform, jnp.bfloat16, 128, 8) == 1
    assert heads(platform, jnp.float32, 128, 16) == 1
    assert heads(platform, jnp.bfloat16, 128, 16) == (2 if mma else 1)
    assert heads(platform, jnp.float16, 64, 20) == (3 if mma else 1)
    assert heads(platform, jnp.bfloat16, 128, 64, jnp.float8_e4m3fn) == (8 if mma else 1)


def test_config_reaches_the_kernel(rng):
    case = make_paged_decode(
        rng, [700, 33, 0], num_q_heads=8, num_kv_heads=2, head_dim=32, page_size=16
    )
    for ps in (0, 64, 256):
        out = call_decode(
            jaxattn.paged_attention,
            case,
            implementation="native",
            config=native.DecodeConfig(partition_size=ps),
        )
        assert_close(out, spec_decode(case))
    args = call_decode(ops.PAGED_ATTENTION.bind, case)
    resolved = ops.PAGED_ATTENTION.resolve(args, "native")
    assert isinstance(resolved.config, native.DecodeConfig)
    with pytest.raises(ValueError, match="partition_size"):
        native.DecodeConfig(partition_size=-1)
    with pytest.raises(ValueError, match="copies"):
        native.DecodeConfig(copies="bulk")
    with pytest.raises(ValueError, match="kernel"):
        native.PrefillConfig(kernel="fastest")
    c = make_prefix_prefill(
        rng, [20, 0], [5, 33], num_q_heads=8, num_kv_heads=2, head_dim=32, page_size=16
    )
    for kernel in ("auto", "sm90", "sm90_persistent", "mma", "simt"):  # the CPU has one kernel
        out = call_prefill(
            jaxattn.prefix_prefill,
            c,
            implementation="native",
            config=native.PrefillConfig(kernel=kernel),
        )
        assert_close(out, spec_prefill(c))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    [
        # layout, kv dtype, heads, prefix lens, new lens: many more tiles than multiprocessors
        # (each block loops over several), uneven requests, an empty prompt, padding rows.
        ("bshd", jnp.bfloat16, (32, 8), [2048, 0, 1000, 37], [512, 1000, 24, 300]),
        ("bhsd", jnp.float16, (16, 16), [300, 0], [700, 129]),
        ("bshd", jnp.float8_e4m3fn, (32, 8), [1000, 2000], [24, 600]),
        ("bshd", jnp.bfloat16, (8, 2), [5, 0, 64], [0, 3, 1]),
    ],
)
def test_sm90_persistent_matches_the_spec_and_the_one_tile_launch(rng, case):
    """The Hopper prefill launched one block per multiprocessor (each looping over tiles, the
    guards' state handed from tile to tile) against the spec, every unread slot NaN, and
    against the same kernel launched one tile a block (the same arithmetic per tile)."""
    if str(getattr(jax.devices()[0], "compute_capability", "")) != "9.0":
        pytest.skip("the sm90 kernels run on compute capability 9.0")
    layout, kv_dtype, (hq, hkv), prefix, new = case
    dtype = jnp.bfloat16 if kv_dtype == jnp.float8_e4m3fn else kv_dtype
    c = make_prefix_prefill(
        rng,
        prefix,
        new,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=128,
        page_size=16,
        layout=layout,
        dtype=dtype,
        kv_dtype=kv_dtype,
        pad_rows=7,
    )
    outs = {
        kernel: call_prefill(
            jaxattn.prefix_prefill,
            c,
            implementation="native",
            config=native.PrefillConfig(kernel=kernel),
        )
        for kernel in ("sm90_persistent", "sm90")
    }
    assert_close(outs["sm90_persistent"], spec_prefill(c), dtype)
    assert_close(outs["sm90_persistent"], outs["sm90"], dtype)


def test_decode_copies_are_in_the_program(rng, set_env):
    """The decode's copies (config, else the environment, else auto) become the call's
    `copies` attribute; both modes match the spec (on the CPU the kernel ignores them)."""
    case = make_paged_decode(
        rng,
        [700, 33, 0],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        dtype=jnp.bfloat16,
    )

    def lowered(config=None):
        f = jax.jit(lambda *a: jaxattn.paged_attention(*a, implementation="native", config=config))
        args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
        return f.lower(*args).as_text()

    assert "copies = 0" in lowered()
    assert "copies = 1" in lowered(native.DecodeConfig(copies="gathers"))
    assert "copies = 2" in lowered(native.DecodeConfig(copies="tma"))
    set_env(JAXATTN_DECODE_COPIES="gathers")
    assert "copies = 1" in lowered()
    assert "copies = 0" in lowered(native.DecodeConfig(copies="auto"))
    set_env(JAXATTN_DECODE_COPIES="tma")
    assert "copies = 2" in lowered()
    with pytest.raises(ValueError, match="JAXATTN_DECODE_COPIES"):
        set_env(JAXATTN_DECODE_COPIES="fastest")
    set_env(JAXATTN_DECODE_COPIES=None)
    for copies in ("auto", "gathers", "tma"):
        for ps in (0, 128):
            out = call_decode(
                jaxattn.paged_attention,
                case,
                implementation="native",
                config=native.DecodeConfig(partition_size=ps, copies=copies),
            )
            assert_close(out, spec_decode(case), jnp.bfloat16)


@pytest.mark.skipif(not ON_GPU, reason="the tensor-memory-accelerator copies run on a GPU")
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize(
    "head_dim,page_size,kv_dtype",
    [
        (128, 16, None),
        (64, 8, None),
        (128, 128, None),
        (64, 32, None),
        (32, 16, None),
        (256, 8, None),
        (256, 64, None),
        (128, 16, jnp.float8_e4m3fn),
        (128, 8, jnp.float8_e5m2),
        (128, 64, jnp.float8_e4m3fn),
        (64, 16, jnp.float8_e4m3fn),
        (64, 8, jnp.float8_e5m2),
        (256, 32, jnp.float8_e4m3fn),
        (32, 16, jnp.float8_e4m3fn),
    ],
)
def test_decode_copies_agree(rng, layout, head_dim, page_size, kv_dtype):
    """The TMA decode (on compute capability 9.0: 16-bit caches at head_dim 32 to 128, FP8 at
    64 to 256, the 64-byte rows of 16-bit head_dim 32 and FP8 64 in the 64-byte swizzle; copies
    tma forces it where auto keeps an FP8 cache's small grids on the gathers, and 16-bit 256
    and FP8 32 keep the gathers in every mode) and the row gathers against the spec, with NaN
    in every slot no sequence reads: page tails, unused pages, a bad page id's poisoned row,
    partitions that end mid-page."""
    case = make_paged_decode(
        rng,
        [1, 63, 64, 65, 700, 0, 1000],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=head_dim,
        page_size=page_size,
        dtype=jnp.bfloat16,
        layout=layout,
        kv_dtype=kv_dtype,
    )
    want = spec_decode(case)
    outs = {}
    for copies in ("auto", "gathers", "tma"):
        for ps in (0, 64, 320):
            outs[copies, ps] = call_decode(
                jaxattn.paged_attention,
                case,
                implementation="native",
                config=native.DecodeConfig(partition_size=ps, copies=copies),
            )
            assert_close(outs[copies, ps], want, jnp.bfloat16)
    # Under jit (no value checks): a page id past the cache poisons its sequence alone.
    bad = case.block_tables.at[4, 3].set(case.k_cache.shape[0] + 5)
    for copies in ("auto", "gathers", "tma"):
        f = jax.jit(
            lambda *a, c=copies: jaxattn.paged_attention(
                *a,
                layout=layout,
                implementation="native",
                config=native.DecodeConfig(copies=c),
                **case.scales,
            )
        )
        out = f(case.q, case.k_cache, case.v_cache, bad, case.seq_lens)
        assert bool(jnp.isnan(out[4]).all()) and not bool(jnp.isnan(out[:4]).any())
        assert_close(out[5:], want[5:], jnp.bfloat16)


def test_prefill_kernel_override_is_in_the_program(rng, set_env):
    """The environment override becomes the call's `kernel` attribute: visible in the
    lowered program, so a compilation cache can tell the variants apart."""
    c = make_prefix_prefill(
        rng, [20, 0], [5, 33], num_q_heads=8, num_kv_heads=2, head_dim=32, page_size=16
    )
    args = (c.q, c.k_cache, c.v_cache, c.cu_seqlens_q, c.block_tables, c.seq_lens)

    def lowered():
        f = jax.jit(lambda *a: jaxattn.prefix_prefill(*a, implementation="native"))
        return f.lower(*args).as_text()

    set_env(JAXATTN_PREFILL_KERNEL="simt")
    simt = lowered()
    set_env(JAXATTN_PREFILL_KERNEL="mma")
    assert lowered() != simt and "kernel = 3" in simt


def test_handler_reports_bad_arguments(rng):
    """A shape the handler rejects comes back as an XLA error carrying its message."""
    case = make_paged_decode(rng, [5, 9], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16)
    call = jax.ffi.ffi_call(
        "jaxattn_paged_attention",
        (jax.ShapeDtypeStruct(case.q.shape, case.q.dtype), jax.ShapeDtypeStruct((1,), jnp.float32)),
        vmap_method="sequential",
    )
    no_scale = jnp.zeros((0,), jnp.float32)

    def run(seq_lens, k_scale=no_scale, k_cache=case.k_cache, copies=0):
        return jax.block_until_ready(
            call(
                case.q,
                k_cache,
                case.v_cache,
                case.block_tables,
                seq_lens,
                k_scale,
                no_scale,
                scale=np.float32(0.2),
                soft_cap=np.float32(0),
                layout=np.int32(0),
                partition_size=np.int32(0),
                copies=np.int32(copies),
            )
        )

    with pytest.raises(Exception, match="seq_lens must be"):
        run(case.seq_lens[:1])
    with pytest.raises(Exception, match="k_scale must be float32"):
        run(case.seq_lens, jnp.ones((3,), jnp.float32))
    with pytest.raises(Exception, match="k_cache and v_cache must share"):
        run(case.seq_lens, k_cache=case.k_cache.astype(jnp.float8_e4m3fn))
    with pytest.raises(Exception, match="copies must be 0"):
        run(case.seq_lens, copies=3)


def test_stale_library_is_refused(monkeypatch, tmp_path):
    """A library built from older sources (another operand list) is refused by name instead
    of failing inside XLA."""

    class Old:
        def jaxattn_ffi_abi(self):
            return 1

    monkeypatch.setattr(native.ctypes, "CDLL", lambda path: Old())
    monkeypatch.setattr(native, "library_path", lambda platform: str(tmp_path / "lib.so"))
    why = native._register("cpu")
    assert "operand list version 1" in why and "rebuild" in why


def test_missing_library_names_the_build(monkeypatch):
    monkeypatch.setattr(native, "_registered", {})
    monkeypatch.setattr(native, "library_path", lambda platform: None)
    assert not native.is_available()
    impl = ops.PAGED_ATTENTION.implementation("native")
    assert "pip install" in impl.available(jax.default_backend())
    with pytest.raises(NotImplementedError, match="pip install"):
        native.paged_attention(None, None, None, None, None, scale=1.0, layout="bshd")
