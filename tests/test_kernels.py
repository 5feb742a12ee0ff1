"""Every backend of every attention op against the spec: one suite of cases.

Each case runs on each backend this platform offers, through the public ops
(``implementation=`` the backend):

* ``reference``: the spec itself, checked against an independent float64 computation;
* ``pallas``: the kernels in Pallas interpret mode on the CPU, compiled on a GPU;
* ``native``: the C++ handlers on the CPU, the CUDA/HIP kernels on a GPU.

The kernel backends are checked against the spec. A backend whose
``supports(args)`` refuses a case (its capability flag in the backend contract,
:mod:`jaxattn.backend`) is skipped with that reason; the refusals themselves are tested in
``test_refusals``. Inputs are drawn fresh per case (seeded from the test id), every unread
page and slot holds NaN, block tables are permuted. Cases that are slow in the Pallas
interpreter carry the ``slow`` mark for that backend on the CPU only.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    CASCADE_BATCHES,
    DTYPES,
    assert_close,
    call_cascade,
    call_decode,
    call_extend,
    call_prefill,
    expected_cascade,
    expected_decode,
    expected_ragged,
    make_cascade,
    make_extend,
    make_paged_decode,
    make_prefix_prefill,
    prefill_as_extend,
    random_normal,
    spec_cascade,
    spec_decode,
    spec_extend,
    spec_joined,
    spec_prefill,
)

import jaxattn
from jaxattn import native, ops
from jaxattn import pallas as P

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")
NATIVE = native.is_available()
if not NATIVE and os.environ.get("JAXATTN_REQUIRE_NATIVE") == "1":
    raise RuntimeError("JAXATTN_REQUIRE_NATIVE=1 but the native library is not available")

BACKENDS = ("reference", "pallas", "native")
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def grid(names: str, cases, *, heavy=(), backends=BACKENDS):
    """Parametrize over ``backend`` x ``cases``. ``heavy``: indices of cases marked slow for
    the Pallas interpreter (CPU only)."""
    names = [n.strip() for n in names.split(",")]
    params = []
    for b in backends:
        for i, case in enumerate(cases):
            case = case if isinstance(case, tuple) else (case,)
            marks = []
            if b == "native":
                marks.append(pytest.mark.skipif(not NATIVE, reason="native library not built"))
            if b == "pallas" and not ON_GPU and i in heavy:
                marks.append(pytest.mark.slow)
            ident = "-".join([b, *(str(v) for v in case)])
            params.append(pytest.param(b, *case, marks=marks, id=ident))
    return pytest.mark.parametrize(["backend", *names], params)


def _skip_unless_served(op, call, backend, case, **kw):
    args = call(op.bind, case, **kw)
    impl = op.implementation(backend)
    reason = impl.available(jax.default_backend()) or impl.supports(args)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")


def _run(op, call, fn, backend, case, config=None, **kw):
    """The public op on ``case`` with ``implementation=backend``; skipped with the
    backend's reason when it does not serve the case."""
    _skip_unless_served(op, call, backend, case, **kw)
    if backend != "pallas":
        config = None
    return call(fn, case, implementation=backend, config=config, **kw)


def decode(backend, case, config=None, **kw):
    return _run(
        ops.PAGED_ATTENTION, call_decode, jaxattn.paged_attention, backend, case, config, **kw
    )


def extend(backend, case, config=None, **kw):
    return _run(
        ops.EXTEND_ATTENTION, call_extend, jaxattn.extend_attention, backend, case, config, **kw
    )


def prefill(backend, case, config=None, **kw):
    return _run(
        ops.PREFIX_PREFILL, call_prefill, jaxattn.prefix_prefill, backend, case, config, **kw
    )


def want_decode(backend, case, **kw):
    """float64 for the reference (independent), the spec for a kernel backend."""
    if backend == "reference":
        return expected_decode(case, **kw)
    return spec_decode(case, **kw)


def want_extend(backend, c, **kw):
    if backend == "reference":
        return expected_ragged(c.q, c.qo_indptr, c.dense_k, c.dense_v, **kw)
    return spec_extend(c, **kw)


def want_prefill(backend, c, **kw):
    if backend == "reference":
        return expected_ragged(c.q, c.cu_seqlens_q, c.dense_k, c.dense_v, **kw)
    return spec_prefill(c, **kw)


# --- decode -------------------------------------------------------------------------------


@grid(
    "layout, page_size, heads, partition_size",
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
        ("vllm", 16, (8, 2), None),
    ],
    heavy=(4, 8, 9),
)
def test_decode_layout_page_group(rng, backend, layout, page_size, heads, partition_size):
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
    out = decode(backend, case, scale=0.3, partition_size=partition_size)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, want_decode(backend, case, scale=0.3))


@grid(
    "dtype, soft_cap, head_dim, page_size",
    [
        (jnp.float32, None, 128, 32),
        (jnp.bfloat16, 4.0, 64, 64),
        (jnp.float16, None, 64, 32),
        (jnp.float32, 4.0, 64, 16),
        (jnp.bfloat16, None, 128, 16),
        (jnp.float16, 4.0, 128, 64),
    ],
    heavy=(3, 4, 5),
)
def test_decode_dtype_soft_cap(rng, backend, dtype, soft_cap, head_dim, page_size):
    case = make_paged_decode(
        rng,
        [3, 255, 40],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
    )
    # A large scale drives the logits into the cap's bend.
    out = decode(backend, case, scale=0.5, soft_cap=soft_cap)
    assert out.dtype == dtype
    assert_close(out, want_decode(backend, case, scale=0.5, soft_cap=soft_cap), dtype)


@grid("partition_size", [None, 16, 100, 512, 8192], heavy=(3,))
def test_decode_partition_size(rng, backend, partition_size):
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
    out = decode(backend, case, scale=0.2, partition_size=partition_size)
    assert_close(out, want_decode(backend, case, scale=0.2))
    np.testing.assert_array_equal(np.asarray(out[2]), 0.0)


@grid("dummy", [0])
def test_decode_deterministic_and_jitted(rng, backend, dummy):
    case = make_paged_decode(
        rng, [300, 77], num_q_heads=4, num_kv_heads=1, head_dim=32, page_size=16, dtype=jnp.bfloat16
    )
    f = jax.jit(
        lambda q, k, v, t, n: jaxattn.paged_attention(
            q, k, v, t, n, scale=0.2, partition_size=64, implementation=backend
        )
    )
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    if backend == "native":
        assert "jaxattn_paged_attention" in f.lower(*args).as_text()
    a, b = f(*args), f(*args)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert_close(a, want_decode(backend, case, scale=0.2), jnp.bfloat16)


@grid("dummy", [0])
def test_decode_vmap_over_queries(rng, backend, dummy):
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
            implementation=backend,
        )
    )
    out = jax.jit(f)(qs)
    for i in range(qs.shape[0]):
        case.q = qs[i]
        assert_close(out[i], want_decode(backend, case, scale=0.3))


@pytest.mark.gpu
@grid(
    "kv_dtype, dtype, heads",
    [
        (kv, dt, h)
        for kv in (None, E4M3, E5M2)
        for dt in (jnp.bfloat16, jnp.float16)
        for h in ((32, 8), (32, 32), (64, 4), (128, 8))
    ],
    backends=("pallas", "native"),
)
def test_decode_serving_shapes(rng, backend, kv_dtype, dtype, heads):
    hq, hkv = heads
    case = make_paged_decode(
        rng,
        [4097, 1, 1000, 8191, 255],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=128,
        page_size=16,
        dtype=dtype,
        kv_dtype=kv_dtype,
    )
    # The backend's own choice: one pass or split-KV, by batch size (and, with an FP8
    # cache, gathers or tensor copies).
    out = decode(backend, case, scale=128**-0.5)
    assert_close(out, want_decode(backend, case, scale=128**-0.5), dtype)


@pytest.mark.gpu
@grid(
    "kv_dtype, dtype, head_dim",
    [
        (None, jnp.float32, 128),
        (None, jnp.bfloat16, 256),
        (None, jnp.float32, 256),
        (E4M3, jnp.bfloat16, 64),
        (E5M2, jnp.float16, 256),
        (E4M3, jnp.bfloat16, 256),
    ],
    backends=("pallas", "native"),
)
def test_decode_default_tiles_fit_head_dims(rng, backend, kv_dtype, dtype, head_dim):
    case = make_paged_decode(
        rng,
        [700, 33, 4100],
        num_q_heads=16,
        num_kv_heads=2,
        head_dim=head_dim,
        page_size=16,
        dtype=dtype,
        kv_dtype=kv_dtype,
    )
    out = decode(backend, case, scale=0.1)
    assert_close(out, want_decode(backend, case, scale=0.1), dtype)


# --- extend / prefix prefill ----------------------------------------------------------------

EXTEND_SHAPES = [
    # (prefix lens, new-token lens, (Hq, Hkv), Pallas config)
    ([0, 5, 40, 255], [3, 17, 1, 2], (4, 1), None),
    ([0], [513], (8, 2), P.ExtendConfig(block_q=32, block_n=16)),
    ([513, 17, 0], [1, 64, 3], (16, 1), P.ExtendConfig(block_q=64, block_n=32)),
    ([3, 100], [255, 31], (4, 4), None),
    ([1, 0, 255], [17, 3, 40], (8, 2), P.ExtendConfig(block_q=32, block_n=16, heads_per_tile=1)),
    ([70, 2], [40, 9], (32, 8), P.ExtendConfig(block_q=64, block_n=16, heads_per_tile=4)),
]


@grid("prefix, new, heads, config", EXTEND_SHAPES, heavy=(3, 4))
def test_extend_shapes(rng, backend, prefix, new, heads, config):
    hq, hkv = heads
    c = make_extend(rng, prefix, new, num_q_heads=hq, num_kv_heads=hkv, head_dim=32, pad_rows=3)
    out = extend(backend, c, config, scale=0.3)
    assert out.shape == c.q.shape and out.dtype == c.q.dtype
    assert_close(out, want_extend(backend, c, scale=0.3))
    np.testing.assert_array_equal(np.asarray(out[-3:]), 0.0)  # padding rows


@grid(
    "layout, page_size, heads",
    [
        ("bshd", 16, (8, 2)),
        ("bhsd", 16, (4, 4)),
        ("bshd", 1, (4, 1)),
        ("bhsd", 1, (8, 2)),
        ("bshd", 64, (16, 1)),
        ("bhsd", 128, (8, 1)),
        ("vllm", 16, (8, 2)),
    ],
    heavy=(3, 4),
)
def test_prefill_layout_page(rng, backend, layout, page_size, heads):
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
    out = prefill(backend, c, P.ExtendConfig(block_q=32, block_n=32), scale=0.3)
    assert_close(out, want_prefill(backend, c, scale=0.3))
    np.testing.assert_array_equal(np.asarray(out[-2:]), 0.0)


@grid(
    "dtype, soft_cap, head_dim",
    [
        (jnp.float32, None, 64),
        (jnp.bfloat16, 4.0, 64),
        (jnp.float16, None, 64),
        (jnp.float32, 4.0, 128),
        (jnp.bfloat16, None, 128),
        (jnp.float16, 4.0, 128),
    ],
    heavy=(3, 4, 5),
)
def test_extend_dtype_soft_cap(rng, backend, dtype, soft_cap, head_dim):
    c = make_extend(
        rng,
        [40, 0, 130],
        [20, 70, 65],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=head_dim,
        dtype=dtype,
    )
    cfg = P.ExtendConfig(block_q=32, block_n=32, num_warps=4)
    out = extend(backend, c, cfg, scale=0.5, soft_cap=soft_cap)
    assert out.dtype == dtype
    assert_close(out, want_extend(backend, c, scale=0.5, soft_cap=soft_cap), dtype)


@grid(
    "dtype, layout",
    [(jnp.float32, "bshd"), (jnp.bfloat16, "bhsd"), (jnp.float16, "bshd")],
    heavy=(0, 1, 2),
)
def test_prefill_head_dim_128(rng, backend, dtype, layout):
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
    out = prefill(backend, c, scale=128**-0.5)
    assert_close(out, want_prefill(backend, c, scale=128**-0.5), dtype)


@grid("dummy", [0])
def test_prefill_long_prefix(rng, backend, dummy):
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
    assert_close(prefill(backend, c, scale=0.2), want_prefill(backend, c, scale=0.2))


@grid("dummy", [0])
def test_extend_default_tiles_of_a_long_extend(rng, backend, dummy):
    # >= 128 new tokens a request on average, 16-bit, D=128: the 256-row tiles of 128 tokens
    # x 2 heads that the Pallas default picks for long extends.
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
    out = extend(backend, c, scale=0.1)
    assert_close(out, want_extend(backend, c, scale=0.1))
    np.testing.assert_array_equal(np.asarray(out[-5:], np.float32), 0.0)


@grid("dummy", [0], backends=("pallas", "native"))
def test_paged_and_pool_forms_agree(rng, backend, dummy):
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
    cfg = P.ExtendConfig(block_q=32, block_n=16) if backend == "pallas" else None
    a = prefill(backend, c, cfg, scale=0.2)
    b = jaxattn.extend_attention(
        c.q, k, v, qo, kv, idx, scale=0.2, implementation=backend, config=cfg
    )
    # One kernel, the same keys in the same order, the same tiles: the same arithmetic.
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@grid("dummy", [0])
def test_extend_deterministic_and_jitted(rng, backend, dummy):
    c = make_extend(
        rng, [10, 90], [50, 7], num_q_heads=4, num_kv_heads=2, head_dim=32, dtype=jnp.bfloat16
    )
    f = jax.jit(lambda *a: jaxattn.extend_attention(*a, scale=0.2, implementation=backend))
    args = (c.q, c.k_pool, c.v_pool, c.qo_indptr, c.kv_indptr, c.kv_indices)
    if backend == "native":
        assert "jaxattn_extend_attention" in f.lower(*args).as_text()
    a, b = f(*args), f(*args)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert_close(a, want_extend(backend, c, scale=0.2), jnp.bfloat16)


@grid("dummy", [0])
def test_prefill_vmap_and_jit(rng, backend, dummy):
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
            implementation=backend,
        )

    if backend == "native":
        assert "jaxattn_prefix_prefill" in jax.jit(f).lower(c.q).as_text()
    qs = jnp.stack([c.q, -c.q])
    out = jax.jit(jax.vmap(f))(qs)
    for i in range(2):
        c.q = qs[i]
        assert_close(out[i], want_prefill(backend, c), jnp.float16)


@pytest.mark.gpu
@grid(
    "kv_dtype, dtype, heads",
    [(None, dt, h) for dt in (jnp.bfloat16, jnp.float16) for h in ((32, 8), (32, 32), (64, 4))]
    + [(E4M3, jnp.bfloat16, (32, 8)), (E5M2, jnp.float16, (64, 4)), (E4M3, jnp.bfloat16, (32, 32))],
    backends=("pallas", "native"),
)
def test_extend_serving_shapes(rng, backend, kv_dtype, dtype, heads):
    hq, hkv = heads
    c = make_extend(
        rng,
        [2048, 0, 1000, 4097],
        [512, 1000, 24, 1],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=128,
        dtype=dtype,
        kv_dtype=kv_dtype,
        pad_rows=5,
    )
    out = extend(backend, c, scale=128**-0.5)
    assert_close(out, want_extend(backend, c, scale=128**-0.5), dtype)


@pytest.mark.gpu
@grid(
    "kv_dtype, dtype, layout",
    [
        (None, jnp.bfloat16, "bshd"),
        (None, jnp.bfloat16, "bhsd"),
        (E4M3, jnp.bfloat16, "bshd"),
        (E5M2, jnp.bfloat16, "bhsd"),
        (E4M3, jnp.float16, "bhsd"),
        (E5M2, jnp.float16, "bshd"),
    ],
    backends=("pallas", "native"),
)
def test_prefill_serving_shapes(rng, backend, kv_dtype, dtype, layout):
    c = make_prefix_prefill(
        rng,
        [2048, 1000, 0],
        [512, 24, 300],
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        layout=layout,
        dtype=dtype,
        kv_dtype=kv_dtype,
        pad_rows=4,
    )
    out = prefill(backend, c, scale=128**-0.5)
    assert_close(out, want_prefill(backend, c, scale=128**-0.5), dtype)


@pytest.mark.gpu
@grid(
    "dtype, head_dim",
    [(jnp.float32, 128), (jnp.bfloat16, 256), (jnp.float32, 256)],
    backends=("pallas", "native"),
)
def test_extend_default_tiles_fit_wide_heads(rng, backend, dtype, head_dim):
    c = make_extend(
        rng, [300, 0], [200, 77], num_q_heads=16, num_kv_heads=2, head_dim=head_dim, dtype=dtype
    )
    out = extend(backend, c, scale=0.1)
    assert_close(out, want_extend(backend, c, scale=0.1), dtype)


# --- FP8 KV caches ---------------------------------------------------------------------------
#
# The kernels are compared with the spec on the same stored FP8 values and per-head scales
# (the heads' magnitudes are drawn a few times apart, so a kernel applying the wrong head's
# scale fails); the reference is compared with float64 attention over the dequantised values.


@grid(
    "kv_dtype, dtype, layout, heads, partition_size, soft_cap",
    [
        (E4M3, jnp.bfloat16, "bshd", (8, 2), None, None),
        (E5M2, jnp.bfloat16, "bhsd", (8, 2), 128, None),
        (E4M3, jnp.float16, "bhsd", (4, 4), None, 4.0),
        (E5M2, jnp.float16, "bshd", (16, 1), 128, None),
        (E4M3, jnp.float32, "bshd", (4, 2), 128, None),
        (E4M3, jnp.bfloat16, "bshd", (32, 2), None, None),
        (E5M2, jnp.bfloat16, "vllm", (8, 2), None, None),
    ],
    heavy=(3, 5),
)
def test_decode_fp8(rng, backend, kv_dtype, dtype, layout, heads, partition_size, soft_cap):
    hq, hkv = heads
    case = make_paged_decode(
        rng,
        [1, 3, 17, 255, 513],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=32,
        page_size=16,
        layout=layout,
        dtype=dtype,
        kv_dtype=kv_dtype,
    )
    out = decode(backend, case, scale=0.3, partition_size=partition_size, soft_cap=soft_cap)
    assert out.shape == case.q.shape and out.dtype == dtype
    assert_close(out, want_decode(backend, case, scale=0.3, soft_cap=soft_cap), dtype)


@grid("kv_dtype", [E4M3, E5M2])
def test_decode_fp8_unscaled_and_head_dim_64(rng, backend, kv_dtype):
    # No scales: a stored element is its own value (1.0).
    case = make_paged_decode(
        rng,
        [40, 300],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=32,
        dtype=jnp.bfloat16,
        kv_dtype=kv_dtype,
        scaled=False,
    )
    assert case.k_scale is None
    out = decode(backend, case, scale=0.125)
    assert_close(out, want_decode(backend, case, scale=0.125), jnp.bfloat16)


@grid(
    "kv_dtype, dtype, heads, q_fp8",
    [
        (E4M3, jnp.bfloat16, (8, 2), False),
        (E5M2, jnp.float16, (4, 4), False),
        (E4M3, jnp.float32, (8, 1), False),
        (E4M3, jnp.bfloat16, (8, 2), True),
        (E5M2, jnp.float16, (4, 1), True),
    ],
    heavy=(1, 2, 4),
)
def test_extend_fp8(rng, backend, kv_dtype, dtype, heads, q_fp8):
    hq, hkv = heads
    c = make_extend(
        rng,
        [40, 0, 130],
        [20, 70, 3],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=64,
        dtype=dtype,
        kv_dtype=kv_dtype,
        pad_rows=3,
    )
    kw = dict(scale=0.3)
    if q_fp8:
        # The mixed mode: an FP8 q with its scale; the output dtype is stated.
        q_scale = float(jnp.max(jnp.abs(c.q.astype(jnp.float32)))) / 448.0
        c.q = (c.q.astype(jnp.float32) / q_scale).astype(E4M3)
        kw.update(q_scale=q_scale, out_dtype=dtype)
    cfg = P.ExtendConfig(block_q=32, block_n=32)
    out = extend(backend, c, cfg, **kw)
    assert out.dtype == dtype
    if backend == "reference":
        want = expected_ragged(
            c.q, c.qo_indptr, c.dense_k, c.dense_v, scale=0.3, q_scale=kw.get("q_scale")
        )
    else:
        want = spec_extend(c, **kw)
    assert_close(out, want, dtype)
    np.testing.assert_array_equal(np.asarray(out[-3:], np.float32), 0.0)


@grid(
    "kv_dtype, dtype, layout, page_size, q_fp8",
    [
        (E4M3, jnp.bfloat16, "bshd", 16, False),
        (E5M2, jnp.bfloat16, "bhsd", 1, False),
        (E4M3, jnp.float16, "bhsd", 64, True),
        (E5M2, jnp.float32, "bshd", 16, False),
        (E4M3, jnp.bfloat16, "vllm", 16, False),
    ],
    heavy=(1, 2, 3),
)
def test_prefill_fp8(rng, backend, kv_dtype, dtype, layout, page_size, q_fp8):
    c = make_prefix_prefill(
        rng,
        [0, 200, 33],
        [17, 1, 130],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=32,
        page_size=page_size,
        layout=layout,
        dtype=dtype,
        kv_dtype=kv_dtype,
        pad_rows=2,
    )
    kw = dict(scale=0.3)
    if q_fp8:
        kw.update(q_scale=0.02)
        c.q = (c.q.astype(jnp.float32) / 0.02).astype(E5M2)  # out_dtype: bfloat16 by default
        dtype = jnp.bfloat16
    out = prefill(backend, c, P.ExtendConfig(block_q=32, block_n=32), **kw)
    assert out.dtype == dtype
    if backend == "reference":
        want = expected_ragged(
            c.q, c.cu_seqlens_q, c.dense_k, c.dense_v, scale=0.3, q_scale=kw.get("q_scale")
        )
    else:
        want = spec_prefill(c, **kw)
    assert_close(out, want, dtype)
    np.testing.assert_array_equal(np.asarray(out[-2:], np.float32), 0.0)


@grid("dummy", [0])
def test_fp8_decode_jitted_with_traced_scales(rng, backend, dummy):
    case = make_paged_decode(
        rng,
        [300, 77],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=32,
        page_size=16,
        dtype=jnp.bfloat16,
        kv_dtype=E4M3,
    )
    _skip_unless_served(ops.PAGED_ATTENTION, call_decode, backend, case)
    f = jax.jit(
        lambda q, k, v, t, n, ks, vs: jaxattn.paged_attention(
            q, k, v, t, n, k_scale=ks, v_scale=vs, partition_size=64, implementation=backend
        )
    )
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    if backend == "native":
        assert "jaxattn_paged_attention" in f.lower(*args, case.k_scale, case.v_scale).as_text()
    a = f(*args, case.k_scale, case.v_scale)
    assert_close(a, want_decode(backend, case, scale=32**-0.5), jnp.bfloat16)
    # New scale values: the same executable, the new values' result.
    b = f(*args, 4 * case.k_scale, 0.5 * case.v_scale)
    want = spec_decode(case, k_scale=4 * case.k_scale, v_scale=0.5 * case.v_scale)
    assert_close(b, want, jnp.bfloat16)


def _every_code(kv_dtype, finite_only: bool):
    """Every code of the format (finite ones only, or with NaN) as an array of kv_dtype."""
    codes = np.arange(256, dtype=np.uint8).view(np.dtype(kv_dtype))
    if finite_only:
        codes = codes[np.isfinite(codes.astype(np.float32))]
    return codes


@grid("kv_dtype, dtype", [(E4M3, jnp.bfloat16), (E5M2, jnp.float16), (E4M3, jnp.float32)])
def test_fp8_every_code_is_widened_exactly(rng, backend, kv_dtype, dtype):
    """One key whose V row holds all 256 codes: its softmax weight is exactly 1, so the
    output is V itself -- every code widened exactly (NaN codes give NaN in their element
    only), in decode, prefix prefill and extend. Infinities (e5m2) are left out: the spec
    turns a non-finite value into NaN, which a multiply by 1 does not."""
    codes = _every_code(kv_dtype, finite_only=False)
    codes = codes[~np.isinf(codes.astype(np.float32))]
    v_row = np.zeros(256, codes.dtype)
    v_row[: codes.size] = codes
    hkv, d = 2, 128
    v = np.asarray(rng.permutation(v_row)).reshape(1, 1, hkv, d)  # bshd, page size 1
    k = np.asarray(rng.permutation(_every_code(kv_dtype, True)))[: hkv * d // 2]
    k = np.concatenate([k, k]).reshape(1, 1, hkv, d)
    k_cache, v_cache = jnp.asarray(k), jnp.asarray(v)
    want = np.repeat(v.astype(np.float32).reshape(1, hkv, d), 4, axis=1)  # 8 / 2 query heads
    q = random_normal(rng, (1, 8, d), dtype) * 0.01
    one = jnp.zeros((1, 1), jnp.int32)  # block table: page 0
    k_scale = 1.0 / float(jnp.finfo(kv_dtype).max)  # logits stay small; V's scale stays 1

    outs = {}
    args = (q, k_cache, v_cache, one, jnp.ones((1,), jnp.int32))
    bound = ops.PAGED_ATTENTION.bind(*args, k_scale=k_scale)
    impl = ops.PAGED_ATTENTION.implementation(backend)
    if not (impl.available(jax.default_backend()) or impl.supports(bound)):
        outs["decode"] = jaxattn.paged_attention(*args, k_scale=k_scale, implementation=backend)
    cu = jnp.asarray([0, 1], jnp.int32)
    args = (q, k_cache, v_cache, cu, one, jnp.ones((1,), jnp.int32))
    bound = ops.PREFIX_PREFILL.bind(*args, k_scale=k_scale)
    impl = ops.PREFIX_PREFILL.implementation(backend)
    if not (impl.available(jax.default_backend()) or impl.supports(bound)):
        outs["prefill"] = jaxattn.prefix_prefill(*args, k_scale=k_scale, implementation=backend)
    pool = (k_cache.reshape(1, hkv, d), v_cache.reshape(1, hkv, d))
    args = (q, *pool, cu, cu, jnp.zeros((1,), jnp.int32))
    bound = ops.EXTEND_ATTENTION.bind(*args, k_scale=k_scale)
    impl = ops.EXTEND_ATTENTION.implementation(backend)
    if not (impl.available(jax.default_backend()) or impl.supports(bound)):
        outs["extend"] = jaxattn.extend_attention(*args, k_scale=k_scale, implementation=backend)
    if not outs:
        pytest.skip(f"{backend} serves none of the ops with {np.dtype(kv_dtype)}")
    for name, out in outs.items():
        got = np.asarray(out, np.float32)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=name)
        np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)], err_msg=name)


@grid("kv_dtype", [E4M3, E5M2], heavy=(0, 1))
def test_fp8_every_finite_code_in_k_and_v(rng, backend, kv_dtype):
    """Every finite code in K and in V of a real decode (and prefill), against the spec."""
    codes = _every_code(kv_dtype, finite_only=True)
    case = make_paged_decode(
        rng,
        [300, 70],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        dtype=jnp.float32,
        kv_dtype=kv_dtype,
    )
    big = float(jnp.finfo(kv_dtype).max)

    def fill(cache):
        c = np.asarray(cache).copy()
        live = ~np.isnan(c.astype(np.float32))
        c[live] = np.resize(rng.permutation(codes), int(live.sum()))
        return jnp.asarray(c)

    case.k_cache, case.v_cache = fill(case.k_cache), fill(case.v_cache)
    # Scales that bring the format's range to about 1, different per head.
    case.k_scale = jnp.asarray([1.0 / big, 3.0 / big], jnp.float32)
    case.v_scale = jnp.asarray([2.0 / big, 0.5 / big], jnp.float32)
    out = decode(backend, case, scale=0.5, partition_size=128)
    assert_close(out, spec_decode(case, scale=0.5), jnp.float32)


# --- cascade decode -------------------------------------------------------------------------

# Small tiles and splits for the kernels, so that small cases still have several prefix
# tiles, several partitions of a prefix and several own partitions (the defaults take the
# heuristic's, usually one of each here).
SMALL_CASCADE = {
    "pallas": P.CascadeConfig(block_m=16, block_n=16, prefix_blocks=64, partition_size=32),
    "native": native.CascadeConfig(prefix_blocks=64, partition_size=32),
}


def cascade(backend, case, config=None, **kw):
    """The public op on a cascade case; ``config`` "small" takes SMALL_CASCADE."""
    args = call_cascade(ops.CASCADE_ATTENTION.bind, case, **kw)
    impl = ops.CASCADE_ATTENTION.implementation(backend)
    reason = impl.available(jax.default_backend()) or impl.supports(args)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    if config == "small":
        config = SMALL_CASCADE.get(backend)
    return call_cascade(
        jaxattn.cascade_attention, case, implementation=backend, config=config, **kw
    )


def want_cascade(backend, case, **kw):
    """float64 for the reference, which must also equal paged_attention over the joined
    tables; the spec for a kernel backend."""
    if backend == "reference":
        assert_close(spec_cascade(case, **kw), spec_joined(case, **kw), case.q.dtype)
        return expected_cascade(case, **kw)
    return spec_cascade(case, **kw)


@grid(
    "layout, page_size, heads, batch, config",
    [
        ("bshd", 16, (8, 2), "mixed", "small"),
        ("bhsd", 16, (8, 2), "shared", "small"),
        ("bshd", 8, (8, 8), "mixed", None),
        ("bhsd", 1, (16, 2), "private", "small"),
        ("bshd", 32, (4, 1), "shared", None),
        ("bhsd", 16, (8, 1), "mixed", "small"),
        ("vllm", 16, (8, 2), "mixed", None),
    ],
    heavy=(2, 3, 4, 5),
)
def test_cascade_layout_page_group(rng, backend, layout, page_size, heads, batch, config):
    hq, hkv = heads
    prefixes, prefix_of, own = CASCADE_BATCHES[batch]
    # A prefix is whole pages: keep the token counts of one page size for every page size.
    prefixes = [-(-n * 16 // page_size) for n in prefixes]
    case = make_cascade(
        rng,
        prefixes,
        prefix_of,
        own,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=32,
        page_size=page_size,
        layout=layout,
    )
    out = cascade(backend, case, config, scale=0.3)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, want_cascade(backend, case, scale=0.3))
    # Requests with nothing to attend to (no prefix, no own token) give exact zeros.
    for b in np.flatnonzero(np.asarray(case.joined_lens) == 0):
        np.testing.assert_array_equal(np.asarray(out[b]), 0.0)


@grid(
    "dtype, soft_cap, head_dim",
    [
        (jnp.float32, None, 64),
        (jnp.bfloat16, 4.0, 64),
        (jnp.float16, None, 128),
        (jnp.bfloat16, None, 128),
        (jnp.float32, 4.0, 128),
    ],
    heavy=(2, 3, 4),
)
def test_cascade_dtype_soft_cap(rng, backend, dtype, soft_cap, head_dim):
    case = make_cascade(
        rng,
        [6, 2],
        [0, 1, 0, 0, -1, 1],
        [3, 40, 0, 17, 9, 1],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=head_dim,
        page_size=16,
        dtype=dtype,
    )
    out = cascade(backend, case, "small", scale=0.5, soft_cap=soft_cap)
    assert out.dtype == dtype
    assert_close(out, want_cascade(backend, case, scale=0.5, soft_cap=soft_cap), dtype)


@grid("dummy", [0])
def test_cascade_padded_prefix_table(rng, backend, dummy):
    """Prefixes no request continues (with NaN pages, garbage lengths and pages outside the
    pool) are never read and poison nothing: an engine pads G for static shapes."""
    case = make_cascade(
        rng,
        [4, 3, 2],
        [2, 0, 0, -1, 2],
        [5, 0, 20, 3, 1],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        page_size=8,
    )
    case.prefix_lens = case.prefix_lens.at[1].set(13)  # not whole pages, but unused
    case.prefix_tables = case.prefix_tables.at[1].set(-7)
    out = cascade(backend, case, "small", scale=0.2)
    assert_close(out, want_cascade(backend, case, scale=0.2))


@grid("dummy", [0])
def test_cascade_matches_paged_attention_of_the_same_backend(rng, backend, dummy):
    case = make_cascade(
        rng,
        [7, 1],
        [0, 0, 1, 0, -1],
        [30, 1, 0, 12, 50],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=32,
        page_size=16,
        dtype=jnp.bfloat16,
    )
    out = cascade(backend, case, "small", scale=0.25)
    joined = jaxattn.paged_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.joined_tables,
        case.joined_lens,
        scale=0.25,
        implementation=backend,
    )
    assert_close(out, joined, jnp.bfloat16)


@grid("dummy", [0])
def test_cascade_deterministic_and_jitted(rng, backend, dummy):
    case = make_cascade(
        rng,
        [5, 2],
        [0, 1, 0, -1, 0],
        [3, 0, 77, 12, 20],
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=32,
        page_size=16,
        dtype=jnp.bfloat16,
    )
    f = jax.jit(
        lambda *a: jaxattn.cascade_attention(
            *a, layout=case.layout, scale=0.2, implementation=backend
        )
    )
    args = (
        case.q,
        case.k_cache,
        case.v_cache,
        case.prefix_tables,
        case.prefix_lens,
        case.prefix_of,
        case.block_tables,
        case.seq_lens,
    )
    if backend == "native":
        assert "jaxattn_cascade_attention" in f.lower(*args).as_text()
    a, b = f(*args), f(*args)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert_close(a, want_cascade(backend, case, scale=0.2), jnp.bfloat16)


# FP8 and scaled caches in cascade decode: both levels read one cache, so the per-KV-head
# scales apply to the prefix and the own pages alike (the heads' magnitudes are drawn a few
# times apart, so a wrong head's scale fails). The native GPU kernels read 16-bit / f32 K/V
# only: their supports() refuses an FP8 cache (test_cascade_native_gpu_refuses_fp8).


@grid(
    "kv_dtype, dtype, layout, heads, soft_cap",
    [
        (E4M3, jnp.bfloat16, "bshd", (8, 2), None),
        (E5M2, jnp.float16, "bhsd", (4, 1), None),
        (E4M3, jnp.float32, "bshd", (8, 4), 4.0),
        (E5M2, jnp.bfloat16, "vllm", (4, 2), None),
    ],
    heavy=(2,),
)
def test_cascade_fp8(rng, backend, kv_dtype, dtype, layout, heads, soft_cap):
    hq, hkv = heads
    case = make_cascade(
        rng,
        [5, 2],
        [0, 1, 0, -1, 0, 1],
        [3, 40, 0, 17, 9, 1],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=32,
        page_size=8,
        layout=layout,
        dtype=dtype,
        kv_dtype=kv_dtype,
    )
    assert case.k_scale is not None
    out = cascade(backend, case, "small", scale=0.3, soft_cap=soft_cap)
    assert out.shape == case.q.shape and out.dtype == dtype
    assert_close(out, want_cascade(backend, case, scale=0.3, soft_cap=soft_cap), dtype)


@grid("kv_dtype", [E4M3, E5M2])
def test_cascade_fp8_unscaled(rng, backend, kv_dtype):
    """No scales: a stored element is its own value."""
    case = make_cascade(
        rng,
        [3],
        [0, 0, -1],
        [20, 1, 6],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        dtype=jnp.bfloat16,
        kv_dtype=kv_dtype,
        scaled=False,
    )
    assert case.k_scale is None
    out = cascade(backend, case, "small", scale=0.125)
    assert_close(out, want_cascade(backend, case, scale=0.125), jnp.bfloat16)


@grid("dtype", [jnp.bfloat16, jnp.float32])
def test_cascade_scaled_16bit_cache(rng, backend, dtype):
    """A bfloat16 / float32 cache with per-head scales != 1 (every backend, the native GPU
    kernels included, applies k_scale to both levels' logits and v_scale to the merged
    output): the values are the stored elements times the scales."""
    case = make_cascade(
        rng,
        [4, 1],
        [1, 0, -1, 0, 0],
        [7, 0, 33, 2, 18],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=32,
        page_size=16,
        dtype=dtype,
    )
    ks = jnp.asarray([0.5, 3.0], jnp.float32)
    vs = jnp.asarray([2.0, 0.25], jnp.float32)
    out = cascade(backend, case, "small", scale=0.3, k_scale=ks, v_scale=vs)
    if backend == "reference":
        # float64 over the dequantised values (each KV head's elements times its scale).
        scaled = dataclasses.replace(
            case,
            dense_k=[d.astype(jnp.float32) * ks[None, :, None] for d in case.dense_k],
            dense_v=[d.astype(jnp.float32) * vs[None, :, None] for d in case.dense_v],
        )
        want = expected_cascade(scaled, scale=0.3)
        assert_close(spec_joined(case, scale=0.3, k_scale=ks, v_scale=vs), want, dtype)
    else:
        want = spec_cascade(case, scale=0.3, k_scale=ks, v_scale=vs)
    assert_close(out, want, dtype)
    # The scales change the result: a backend that dropped them would match the unscaled op.
    plain = spec_cascade(case, scale=0.3)
    assert not np.allclose(np.asarray(out, np.float32), np.asarray(plain, np.float32))


@grid("kv_dtype", [E4M3, jnp.bfloat16])
def test_cascade_jitted_with_traced_scales(rng, backend, kv_dtype):
    """Scales are operands: new values reuse the compiled call and give the new result."""
    case = make_cascade(
        rng,
        [4],
        [0, 0, -1, 0],
        [5, 30, 12, 0],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=32,
        page_size=16,
        dtype=jnp.bfloat16,
        kv_dtype=kv_dtype,
    )
    ks = case.k_scale if case.k_scale is not None else jnp.asarray([0.5, 2.0], jnp.float32)
    vs = case.v_scale if case.v_scale is not None else jnp.asarray([1.5, 0.75], jnp.float32)
    args = (
        case.q,
        case.k_cache,
        case.v_cache,
        case.prefix_tables,
        case.prefix_lens,
        case.prefix_of,
        case.block_tables,
        case.seq_lens,
    )
    _skip_unless_served(ops.CASCADE_ATTENTION, call_cascade, backend, case, k_scale=ks)
    traces = []

    def run(*a):
        traces.append(1)
        *a, k_scale, v_scale = a
        return jaxattn.cascade_attention(
            *a, scale=0.2, k_scale=k_scale, v_scale=v_scale, implementation=backend
        )

    f = jax.jit(run)
    if backend == "native":
        assert "jaxattn_cascade_attention" in f.lower(*args, ks, vs).as_text()
    for k_scale, v_scale in ((ks, vs), (4 * ks, 0.5 * vs)):
        out = f(*args, k_scale, v_scale)
        want = spec_cascade(
            dataclasses.replace(case, k_scale=None, v_scale=None),
            scale=0.2,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        assert_close(out, want, jnp.bfloat16)
    assert len(traces) == 1


@pytest.mark.gpu
@grid(
    "dtype, heads, batch",
    [
        (jnp.bfloat16, (32, 8), "one"),
        (jnp.float16, (32, 8), "mixed"),
        (jnp.bfloat16, (32, 32), "mixed"),
        (jnp.bfloat16, (64, 8), "one"),
        (jnp.bfloat16, (32, 4), "private"),
        (jnp.float32, (32, 8), "mixed"),
    ],
    backends=("pallas", "native"),
)
def test_cascade_serving_shapes(rng, backend, dtype, heads, batch):
    """Serving shapes with the backend's own choices: the issue's batch (requests on one
    long prefix, a few hundred own tokens each), a mix, and no sharing at all."""
    hq, hkv = heads
    b = 64 if hkv <= 8 else 16
    if batch == "one":
        prefixes, prefix_of = [128], [0] * b
    elif batch == "mixed":
        prefixes, prefix_of = [128, 31, 64], [i % 4 - 1 for i in range(b)]
    else:
        prefixes, prefix_of = [20 + i for i in range(b)], list(range(b))
    own = [256 - (7 * i) % 61 for i in range(b)]
    case = make_cascade(
        rng,
        prefixes,
        prefix_of,
        own,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=128,
        page_size=16,
        dtype=dtype,
    )
    out = cascade(backend, case, scale=128**-0.5)
    assert_close(out, spec_cascade(case, scale=128**-0.5), dtype)


# --- what each backend refuses ----------------------------------------------------------------


@pytest.mark.parametrize(
    "backend",
    ["pallas", pytest.param("native", marks=pytest.mark.skipif(not NATIVE, reason="not built"))],
)
def test_refusals(rng, backend):
    """A backend named alone refuses what it cannot serve, naming the reason; never a
    silent fallback."""
    case = make_paged_decode(
        rng, [5], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16, layout="vllm"
    )
    with pytest.raises(NotImplementedError, match="vllm"):
        call_decode(jaxattn.paged_attention, case, implementation=backend)
    # None falls through to a backend that serves it.
    assert_close(call_decode(jaxattn.paged_attention, case), spec_decode(case))
    if backend == "pallas" or ON_GPU:
        case = make_paged_decode(rng, [5], num_q_heads=4, num_kv_heads=2, head_dim=48, page_size=16)
        with pytest.raises(NotImplementedError, match="head_dim"):
            call_decode(jaxattn.paged_attention, case, implementation=backend)
    if backend == "native" and ON_GPU:
        # An fp8 cache under a float32 q: the CPU handlers serve it, the GPU kernels do not.
        case = make_paged_decode(
            rng, [5], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16, kv_dtype=E4M3
        )
        with pytest.raises(NotImplementedError, match="float8_e4m3fn"):
            call_decode(jaxattn.paged_attention, case, implementation=backend)
        assert_close(call_decode(jaxattn.paged_attention, case), spec_decode(case))
    q = jnp.zeros((1, 4, 32), jnp.bfloat16)
    case = make_paged_decode(rng, [5], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16)
    with pytest.raises(NotImplementedError, match="dtype"):
        jaxattn.paged_attention(
            q,
            case.k_cache,
            case.v_cache,
            case.block_tables,
            case.seq_lens,
            implementation=backend,
        )


def test_cascade_native_gpu_refuses_fp8(rng, monkeypatch):
    """The native GPU cascade kernels read 16-bit / f32 K/V: their supports() names an FP8
    cache (asked as on a GPU, so that a CPU run checks the rule too), accepts per-head scales
    on a 16-bit cache, and implementation=None serves the FP8 case elsewhere, exactly."""
    case = make_cascade(
        rng,
        [2],
        [0, -1, 0],
        [4, 9, 0],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        dtype=jnp.bfloat16,
        kv_dtype=E4M3,
    )
    impl = ops.CASCADE_ATTENTION.implementation("native")
    bound = call_cascade(ops.CASCADE_ATTENTION.bind, case)
    with monkeypatch.context() as m:
        m.setattr(native, "_platform", lambda: "cuda")
        reason = impl.supports(bound)
        assert reason is not None and "float8_e4m3fn" in reason and "cascade" in reason
        plain = dataclasses.replace(
            case,
            k_cache=case.k_cache.astype(jnp.bfloat16),
            v_cache=case.v_cache.astype(jnp.bfloat16),
        )
        assert impl.supports(call_cascade(ops.CASCADE_ATTENTION.bind, plain)) is None
    if ON_GPU and NATIVE:
        with pytest.raises(NotImplementedError, match="float8_e4m3fn"):
            call_cascade(jaxattn.cascade_attention, case, implementation="native")
    # None: the first backend that serves it (never the refusing kernel reported as run).
    resolved = ops.CASCADE_ATTENTION.resolve(bound, None)
    if ON_GPU:
        assert resolved.backend != "native"
    assert_close(call_cascade(jaxattn.cascade_attention, case), spec_cascade(case), jnp.bfloat16)


@pytest.mark.skipif(ON_GPU or not NATIVE, reason="the CPU handlers take any head_dim")
def test_native_cpu_takes_any_head_dim(rng):
    case = make_paged_decode(rng, [5, 40], num_q_heads=4, num_kv_heads=2, head_dim=48, page_size=16)
    assert_close(decode("native", case, scale=0.2, partition_size=16), spec_decode(case, scale=0.2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_backend_agrees_on_one_case(rng, dtype):
    """One small case through every available backend: all within the dtype's tolerance of
    each other (a smoke test that the registry serves the same op everywhere)."""
    case = make_paged_decode(
        rng, [9, 33], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=8, dtype=dtype
    )
    outs = {
        b: call_decode(jaxattn.paged_attention, case, implementation=b)
        for b in jaxattn.available_backends()
    }
    assert set(outs) >= {"reference"}
    for out in outs.values():
        assert_close(out, spec_decode(case), dtype)


# --- random configurations ------------------------------------------------------------------
# The grids above fix one combination of layout, page size, GQA group, head size, q and cache
# dtypes, soft cap, lengths and split size at a time. These cases mix them at random, each
# drawn once from a fixed seed (so a failure names a reproducible case), with the data drawn
# per case as everywhere else: NaN in every unread page and slot. On the CPU the Pallas
# interpreter is left to the grids above (seconds a case); on a GPU its kernels run these too.

RANDOM_CASES_PER_OP = 8


def _random_configs(op: str, seed: int) -> list[dict]:
    r = np.random.default_rng(seed)

    def pick(xs):
        return xs[int(r.integers(len(xs)))]

    configs = []
    for _ in range(RANDOM_CASES_PER_OP):
        hkv = pick((1, 2, 4))
        dtype = pick((jnp.float32, jnp.bfloat16, jnp.float16))
        kv = pick((None, None, E4M3, E5M2)) if dtype != jnp.float32 else pick((None, None, E4M3))
        c = dict(
            heads=(hkv * pick((1, 2, 3, 4, 8)), hkv),
            head_dim=pick((16, 32, 64, 128)),
            page_size=pick((1, 2, 8, 16, 32)),
            layout=pick(("bshd", "bhsd")),
            dtype=dtype,
            kv_dtype=kv,
            soft_cap=pick((None, None, 30.0)),
        )
        b = int(r.integers(1, 6))
        if op == "decode":
            c["lens"] = [int(r.integers(0, 300)) for _ in range(b)]
            c["partition_size"] = pick((None, 16, 64, 128))
        elif op in ("prefill", "extend"):
            c["prefix"] = [int(r.integers(0, 200)) for _ in range(b)]
            c["new"] = [int(r.integers(1, 70)) for _ in range(b)]
        else:
            g = int(r.integers(1, 3))
            c["prefix_pages"] = [int(r.integers(0, 6)) for _ in range(g)]
            c["prefix_of"] = [int(r.integers(-1, g)) for _ in range(b)]
            c["own"] = [int(r.integers(0, 100)) for _ in range(b)]
        configs.append(c)
    return configs


RANDOM_CONFIGS = {
    op: _random_configs(op, seed)
    for op, seed in (("decode", 101), ("prefill", 102), ("extend", 103), ("cascade", 104))
}


def _random_id(op: str, c: dict) -> str:
    paged = "" if op == "extend" else f"{c['layout']}-p{c['page_size']}-"  # a token pool
    kv = "" if c["kv_dtype"] is None else "-" + jnp.dtype(c["kv_dtype"]).name
    cap = "-cap" if c["soft_cap"] else ""
    hq, hkv = c["heads"]
    return f"{paged}{hq}x{hkv}-d{c['head_dim']}-{jnp.dtype(c['dtype']).name}{kv}{cap}"


@grid(
    "op, index, desc",
    [(op, i, _random_id(op, c)) for op, cs in RANDOM_CONFIGS.items() for i, c in enumerate(cs)],
    backends=("reference", "native", "pallas") if ON_GPU else ("reference", "native"),
)
def test_random_configurations(rng, backend, op, index, desc):
    c = RANDOM_CONFIGS[op][index]
    hq, hkv = c["heads"]
    kw = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=c["head_dim"], dtype=c["dtype"])
    if c["kv_dtype"] is not None:
        kw["kv_dtype"] = c["kv_dtype"]
    paged = dict(page_size=c["page_size"], layout=c["layout"])
    cap = dict(soft_cap=c["soft_cap"])
    if op == "decode":
        case = make_paged_decode(rng, c["lens"], **kw, **paged)
        split = {} if c["partition_size"] is None else dict(partition_size=c["partition_size"])
        out, want = decode(backend, case, **cap, **split), want_decode(backend, case, **cap)
    elif op == "prefill":
        case = make_prefix_prefill(rng, c["prefix"], c["new"], **kw, **paged)
        out, want = prefill(backend, case, **cap), want_prefill(backend, case, **cap)
    elif op == "extend":
        case = make_extend(rng, c["prefix"], c["new"], **kw)
        out, want = extend(backend, case, **cap), want_extend(backend, case, **cap)
    else:
        case = make_cascade(rng, c["prefix_pages"], c["prefix_of"], c["own"], **kw, **paged)
        out, want = cascade(backend, case, **cap), want_cascade(backend, case, **cap)
    assert_close(out, want, c["dtype"])
