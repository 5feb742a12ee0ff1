"""The Mosaic GPU paged decode (jaxattn.pallas.decode_mgpu) against the reference: layouts,
dtypes, GQA groups, partitions, empty sequences, NaN in every slot it must not read, the
memory-safety contract, refusals.

Every case runs in Mosaic GPU's interpret mode (the CPU, and the GPU too), which runs the two
products as jnp.dot (see the module): the kernel's barriers, TMA page copies, masks, online
softmax and merge are what it checks. On an sm_90 GPU the same cases also run compiled. On
any machine, the kernel is lowered for CUDA (jax.export with platforms=["cuda"], which runs
the whole Mosaic GPU lowering to its MLIR module without a GPU): what only the compile to
machine code can reject is left to the GPU run. Skipped where this JAX has no Mosaic GPU
lowering with an interpret mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, export_cuda, interpreter_device, poisoned_pages

import jaxattn
from jaxattn import layout as L
from jaxattn.pallas import _mgpu as M
from jaxattn.pallas import cascade_mgpu, decode_mgpu

if decode_mgpu.available() is not None:
    pytest.skip(decode_mgpu.available(), allow_module_level=True)


# interpret=True everywhere; interpret=False (compiled) on an sm_90 GPU.
MODES = [True] + ([False] if decode_mgpu.is_sm90() else [])


def poisoned_case(seed, *, batch, hq, hkv, d, page, pages, width, lens, layout, dtype):
    """q, caches, tables: NaN in every pool slot no sequence reads (pages no table names,
    the tails of last pages) and table columns past each sequence naming a NaN page."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, hq, d)), dtype)
    k, v, tables = poisoned_pages(rng, lens, page=page, pages=pages, width=width, hkv=hkv, d=d)
    k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    if layout == "bhsd":
        k, v = L.convert(k, v, "bshd", "bhsd")
    return q, k, v, jnp.asarray(tables), jnp.asarray(lens, jnp.int32)


def reference(q, k, v, tables, lens, **kw):
    return jaxattn.paged_attention(q, k, v, tables, lens, implementation="reference", **kw)


CASES = [
    # layout, dtype, hq/hkv, d, page, lens, partition_pages, other keywords (width and
    # pages: the table's columns and the pool's pages, 12 and 40 unless given)
    ("bshd", jnp.bfloat16, (8, 2), 64, 16, [70, 0, 160], 4, {}),
    ("bhsd", jnp.float16, (8, 8), 64, 8, [1, 33, 64], 8, {}),
    ("bshd", jnp.bfloat16, (16, 2), 128, 16, [129, 5], 8, {}),
    # the copy warpgroup with three stages; one warpgroup issuing its own copies
    ("bshd", jnp.bfloat16, (8, 2), 64, 16, [40, 190, 100], 12, dict(specialized=True, stages=3)),
    ("bshd", jnp.bfloat16, (16, 2), 128, 16, [129, 5, 190], 8, dict(specialized=False)),
    ("bhsd", jnp.bfloat16, (8, 2), 64, 16, [40, 190, 0], 12, dict(specialized=False, stages=3)),
    # (the default 12 columns: narrower than a 32-entry window, read from the flattened
    # table, the next rows' entries in the window.) Tables wider than one window: the last
    # partitions' windows end at the table's end and the kernel shifts its index (44
    # columns), or rows that are not a multiple of 16 bytes are padded (45); the first
    # sequence fills the whole table
    ("bshd", jnp.bfloat16, (8, 2), 64, 8, [352, 200, 17], 8, dict(width=44, pages=80)),
    ("bshd", jnp.bfloat16, (8, 2), 64, 8, [360, 200, 17], 8, dict(width=45, pages=80)),
]


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference_with_unread_slots_poisoned(case, interpret):
    layout, dtype, (hq, hkv), d, page, lens, part, kw = CASES[case]
    kw = dict(kw)
    width, pages = kw.pop("width", 12), kw.pop("pages", 40)
    device = interpreter_device(interpret)
    q, k, v, tables, lens = jax.device_put(
        poisoned_case(
            case,
            batch=len(lens),
            hq=hq,
            hkv=hkv,
            d=d,
            page=page,
            pages=pages,
            width=width,
            lens=lens,
            layout=layout,
            dtype=dtype,
        ),
        device,
    )
    with jax.default_device(device):
        out = decode_mgpu.paged_attention(
            q, k, v, tables, lens, layout=layout, partition_pages=part, interpret=interpret, **kw
        )
        assert out.shape == q.shape and out.dtype == q.dtype
        assert_close(out, reference(q, k, v, tables, lens, layout=layout))


@pytest.mark.parametrize("interpret", MODES)
def test_soft_cap_and_scale(interpret):
    q, k, v, tables, lens = poisoned_case(
        7,
        batch=2,
        hq=4,
        hkv=1,
        d=64,
        page=16,
        pages=16,
        width=6,
        lens=[90, 17],
        layout="bshd",
        dtype=jnp.bfloat16,
    )
    kw = dict(scale=0.3, soft_cap=5.0)
    out = decode_mgpu.paged_attention(q, k, v, tables, lens, interpret=interpret, **kw)
    assert_close(out, reference(q, k, v, tables, lens, **kw))


@pytest.mark.parametrize("interpret", MODES)
def test_memory_safety_contract(interpret):
    """A bad page id among the pages a sequence reads, or a length outside [0, capacity],
    poisons that sequence alone; a bad id past the sequence's end is never read."""
    q, k, v, tables, lens = poisoned_case(
        3,
        batch=4,
        hq=4,
        hkv=2,
        d=64,
        page=16,
        pages=24,
        width=4,
        lens=[40, 40, 20, 30],
        layout="bshd",
        dtype=jnp.bfloat16,
    )
    k = jnp.nan_to_num(k)  # finite everywhere: only the contract may make NaN here
    v = jnp.nan_to_num(v)
    ref = np.asarray(reference(q, k, v, tables, lens), np.float32)  # before the damage
    tables = tables.at[0, 1].set(10_000)  # read by sequence 0 (40 tokens: pages 0..2)
    tables = tables.at[2, 3].set(-5)  # past sequence 2's end: never read
    lens = lens.at[1].set(4 * 16 + 1)  # over capacity
    lens = lens.at[3].set(-1)
    out = decode_mgpu.paged_attention(q, k, v, tables, lens, interpret=interpret)
    out = np.asarray(out, np.float32)
    nan_rows = np.isnan(out).any(axis=(1, 2))
    np.testing.assert_array_equal(nan_rows, [True, True, False, True])
    assert np.isnan(out[[0, 1, 3]]).all()
    assert_close(out[2], ref[2], dtype=jnp.bfloat16)


def test_refusals():
    q = jnp.zeros((1, 4, 64), jnp.bfloat16)
    k = jnp.zeros((4, 16, 2, 64), jnp.bfloat16)
    t, n = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    f = decode_mgpu.paged_attention
    with pytest.raises(NotImplementedError, match="bfloat16/float16"):
        f(q.astype(jnp.float32), k.astype(jnp.float32), k.astype(jnp.float32), t, n)
    with pytest.raises(NotImplementedError, match="head_dim a multiple of 64"):
        f(q[..., :32], k[..., :32], k[..., :32], t, n)
    with pytest.raises(NotImplementedError, match="page_size a multiple of 8"):
        f(q, k[:, :4], k[:, :4], t, n)
    with pytest.raises(NotImplementedError, match="layouts"):
        f(q, *L.convert(k, k, "bshd", "vllm"), t, n, layout="vllm")
    with pytest.raises(ValueError, match="partition_pages"):
        f(q, k, k, t, n, partition_pages=3)
    with pytest.raises(ValueError, match="multiple of 64"):
        f(q, k, k, t, n, pages_per_step=2)
    with pytest.raises(ValueError, match="merge must be one of"):
        f(q, k, k, t, n, merge="jnp")
    # head_dim 64: two query heads a merge block, so the query heads come in pairs
    with pytest.raises(NotImplementedError, match="2 query heads a block"):
        f(q[:, :3], k[:, :, :1], k[:, :, :1], t, n, merge="mosaic_gpu")
    with pytest.raises(NotImplementedError, match="Mosaic GPU merge takes head_dim"):
        decode_mgpu.merge_lowering("mosaic_gpu", 192)
    # by default the Mosaic GPU merge at head_dim 128 only (the form timed on a GPU)
    assert decode_mgpu.merge_lowering(None, 64) == "triton"
    assert decode_mgpu.merge_lowering("mosaic_gpu", 64, num_q_heads=8) == "mosaic_gpu"
    assert decode_mgpu.merge_lowering("mosaic_gpu", 64, group=4, tiled=True) == "mosaic_gpu"
    with pytest.raises(NotImplementedError, match="a group of 3"):
        decode_mgpu.merge_lowering("mosaic_gpu", 64, group=3, tiled=True)
    assert decode_mgpu.merge_lowering(None, 128) == "mosaic_gpu"
    assert decode_mgpu.merge_lowering(None, 192) == "triton"


# The shapes the H200 benchmarks run, with each kernel form, and small odd ones.
_H200 = dict(layout="bshd", dtype=jnp.bfloat16, heads=(32, 8), d=128, page=16, width=256)


@pytest.mark.parametrize(
    "kw",
    [
        _H200,
        _H200 | dict(width=2048, batch=1, stages=3, registers=(168, 40)),
        _H200 | dict(width=2048, batch=1, merge="triton"),
        _H200 | dict(stages=3, specialized=True),
        _H200 | dict(stages=3, specialized=False),
        # One pass over 512 pages, and 300 lengths: copies of more than 256 elements split.
        _H200 | dict(width=512, batch=64),
        _H200 | dict(width=512, batch=64, specialized=True),
        _H200 | dict(width=20, batch=300),
        dict(layout="bhsd", dtype=jnp.float16, heads=(8, 8), d=64, page=8, width=40),
        dict(layout="bshd", dtype=jnp.bfloat16, heads=(4, 1), d=64, page=16, width=6, cap=5.0),
    ],
)
def test_lowers_for_cuda(kw):
    """The compiled kernel's whole Mosaic GPU lowering (every primitive, register layout and
    copy size), on any machine: jax.export for CUDA with interpret=False. At head_dim 128 a
    split grid's merge is the Mosaic GPU kernel too: no Triton kernel (the export refuses
    one)."""
    kw = dict(kw)
    layout, dtype, (hq, hkv), d, page, width = (
        kw.pop(n) for n in ("layout", "dtype", "heads", "d", "page", "width")
    )
    batch, cap = kw.pop("batch", 4), kw.pop("cap", None)
    pool = (64, page, hkv, d) if layout == "bshd" else (64, hkv, page, d)
    args = (
        jax.ShapeDtypeStruct((batch, hq, d), dtype),
        jax.ShapeDtypeStruct(pool, dtype),
        jax.ShapeDtypeStruct(pool, dtype),
        jax.ShapeDtypeStruct((batch, width), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )

    def f(q, k, v, t, n):
        return decode_mgpu.paged_attention(
            q, k, v, t, n, layout=layout, soft_cap=cap, interpret=False, **kw
        )

    triton = decode_mgpu.merge_lowering(kw.get("merge"), d) == "triton"
    assert "mosaic_gpu" in export_cuda(f, *args, triton=triton).mlir_module()


def _split_decode_exported(**kw) -> str:
    """The exported module (jax.export for CUDA, no Triton kernel) of a split decode, 2
    sequences of 32 pages, 8/2 heads of 128, and its merge."""
    sds = jax.ShapeDtypeStruct
    pool = sds((64, 16, 2, 128), jnp.bfloat16)
    args = (sds((2, 8, 128), jnp.bfloat16), pool, pool, sds((2, 32), jnp.int32))

    def f(q, k, v, t, n):
        return decode_mgpu.paged_attention(q, k, v, t, n, interpret=False, partition_pages=8, **kw)

    return export_cuda(f, *args, sds((2,), jnp.int32), triton=False).mlir_module()


@pytest.mark.parametrize("pdl", ["1", "0"])
def test_dependent_launch(monkeypatch, pdl):
    """A split grid's partitions and its merge are lowered as programmatic dependent launches
    (each kernel lets the next one launch at its start and waits for the one before it:
    griddepcontrol in both modules; jax 0.11 marks the modules for a dependent launch),
    and JAXATTN_MGPU_PDL=0 lowers neither instruction."""
    monkeypatch.setenv("JAXATTN_MGPU_PDL", pdl)
    jax.clear_caches()  # the variable is read when a kernel is traced
    text = _split_decode_exported()
    assert text.count("mosaic_gpu_v2") == 2  # the partitions, the merge
    assert ("griddepcontrol" in text) == (pdl == "1")
    if jax.__version_info__ >= (0, 11):
        assert ("mosaic_gpu.uses_pdl" in text) == (pdl == "1")


@pytest.mark.parametrize("specialized", [False, True])
def test_experiments_lower(monkeypatch, specialized):
    """JAXATTN_MGPU_EXPERIMENTS=copy_warp,unmasked_steps (the page copies from one warp, the
    page ids read before in warpgroup semantics; the full steps without the logits' mask) lower
    for CUDA in both kernel forms and the cascade; interpreted (the mask-free steps there;
    the copies from one warp are compiled only), the decode still matches the spec with NaN
    in every slot it must not read, on sequences ending inside a step, on a step boundary and
    shorter than one step; an unknown name is refused."""
    monkeypatch.setenv("JAXATTN_MGPU_EXPERIMENTS", "copy_warp, unmasked_steps")
    jax.clear_caches()  # the variable is read when a kernel is traced
    assert M.experiment("copy_warp", False) and M.experiment("unmasked_steps", True)
    assert not M.experiment("copy_warp", True)  # compiled kernels only
    with pytest.raises(ValueError, match="unknown Mosaic GPU experiment"):
        M.experiment("copy", False)
    assert "mosaic_gpu" in _split_decode_exported(specialized=specialized)
    sds = jax.ShapeDtypeStruct
    i32, pool = sds((2,), jnp.int32), sds((64, 16, 2, 128), jnp.bfloat16)
    cascade = (
        sds((2, 8, 128), jnp.bfloat16),
        pool,
        pool,
        sds((1, 16), jnp.int32),
        sds((1,), jnp.int32),
        i32,
    )
    text = export_cuda(
        lambda *a: cascade_mgpu.cascade_attention(*a, interpret=False),
        *cascade, sds((2, 16), jnp.int32), i32, triton=False,
    ).mlir_module()  # fmt: skip
    assert "mosaic_gpu" in text
    cpu = interpreter_device(True)
    case = jax.device_put(poisoned_case(
        5, batch=4, hq=8, hkv=2, d=64, page=16, pages=40, width=12, lens=[70, 128, 30, 0],
        layout="bshd", dtype=jnp.bfloat16,
    ), cpu)  # fmt: skip
    # One pass and split; the two-warpgroup form (5 s a run interpreted, 36 s before
    # conftest.py compiled its warpgroups' program once) split only: the experiments change
    # the steps' loop, which both grids run alike.
    for partition_pages in (4,) if specialized else (None, 4):
        with jax.default_device(cpu):
            out = decode_mgpu.paged_attention(
                *case, interpret=True, specialized=specialized, partition_pages=partition_pages
            )
            assert_close(out, reference(*case), jnp.bfloat16)


@pytest.mark.parametrize("interpret", MODES)
def test_public_op_with_mosaic_gpu_lowering(interpret):
    """jaxattn.paged_attention(implementation="pallas", config=DecodeConfig(lowering=
    "mosaic_gpu")) runs this kernel (compiled on sm_90, interpreted elsewhere); a split given
    as partition_size in tokens; FP8 scales and partial pages refused."""
    q, k, v, tables, lens = poisoned_case(
        11,
        batch=3,
        hq=8,
        hkv=2,
        d=64,
        page=16,
        pages=40,
        width=12,
        lens=[70, 1, 150],
        layout="bshd",
        dtype=jnp.bfloat16,
    )
    cfg = jaxattn.pallas.DecodeConfig(lowering="mosaic_gpu")
    kw = dict(implementation="pallas", config=cfg, partition_size=128)
    if interpret and jax.default_backend() != "cpu":
        pytest.skip("the public op compiles on a GPU; interpret mode is tested above")
    out = jaxattn.paged_attention(q, k, v, tables, lens, **kw)
    assert_close(out, reference(q, k, v, tables, lens))
    with pytest.raises(NotImplementedError, match="whole pages"):
        jaxattn.paged_attention(q, k, v, tables, lens, **(kw | dict(partition_size=72)))
    with pytest.raises(ValueError, match="lowering"):
        jaxattn.pallas.DecodeConfig(lowering="mosaic")


def fp8_cache(k, v, k_scale, v_scale, fmt, layout="bshd"):
    """The caches quantised per KV head (the head axis of ``layout``)."""
    axis = 2 if layout == "bshd" else 1
    shape = [1, 1, 1, 1]
    shape[axis] = -1
    k8 = (k.astype(jnp.float32) / k_scale.reshape(shape)).astype(fmt)
    v8 = (v.astype(jnp.float32) / v_scale.reshape(shape)).astype(fmt)
    return k8, v8


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize(
    "fmt, layout, specialized, part, hkv",
    [
        (jnp.float8_e4m3fn, "bshd", True, None, 2),
        (jnp.float8_e5m2, "bhsd", False, None, 2),
        # the copy warpgroup widening a split grid's steps, partitions ending mid-sequence
        (jnp.float8_e5m2, "bshd", True, 4, 2),
        # more than 32 KV heads: the value scales follow the score factors padded to 64
        (jnp.float8_e4m3fn, "bshd", False, None, 33),
    ],
)
def test_fp8_caches(fmt, layout, specialized, part, hkv, interpret):
    """FP8 caches with per-KV-head scales: each step widened to float16 in shared memory (by
    the copy warpgroup when there is one), q moved to float16 by a power of two per KV head;
    each KV head its own scales (33 heads too); NaN codes in unread slots stay out;
    through the public op as well. Interpreted on the
    CPU device on a GPU machine too (JAX's GPU interpreter runs each warpgroup as a program
    of its own and has stalled with them on an H200, see test_pallas_mgpu_prefill)."""
    device = interpreter_device(interpret)
    # part None: default_partition_pages splits these small grids into partitions of 4
    # pages (one step), so 12 columns are 3 partitions. 33 heads: 8 columns, 2 partitions;
    # both sequences end in the first and the second is empty (a third, as empty, would
    # add 66 blocks to the interpreted grid).
    case = poisoned_case(
        13, batch=3 if hkv < 8 else 2, hq=4 * hkv if hkv < 8 else hkv, hkv=hkv, d=64, page=16,
        pages=40, width=12 if hkv < 8 else 8, lens=[70, 1, 150] if hkv < 8 else [40, 1],
        layout=layout, dtype=jnp.bfloat16,
    )  # fmt: skip
    q, k, v, tables, lens = jax.device_put(case, device)
    with jax.default_device(device):
        ks = jnp.linspace(0.5, 2.0, hkv, dtype=jnp.float32)
        vs = jnp.linspace(1.5, 0.25, hkv, dtype=jnp.float32)
        k8, v8 = fp8_cache(k, v, ks, vs, fmt, layout)
        kw = dict(k_scale=ks, v_scale=vs, layout=layout)
        out = decode_mgpu.paged_attention(
            q, k8, v8, tables, lens, interpret=interpret, specialized=specialized,
            partition_pages=part, **kw,
        )  # fmt: skip
        want = reference(q, k8, v8, tables, lens, **kw)
        assert_close(out, want)
        with pytest.raises(NotImplementedError, match="FP8 caches only"):
            decode_mgpu.paged_attention(q, k, v, tables, lens, interpret=interpret, **kw)
    if (interpret and jax.default_backend() != "cpu") or hkv > 8:
        return  # the public op compiles on a GPU: the compiled mode covers it
    cfg = jaxattn.pallas.DecodeConfig(lowering="mosaic_gpu")
    out = jaxattn.paged_attention(
        q, k8, v8, tables, lens, implementation="pallas", config=cfg, **kw
    )
    assert_close(out, want)


@pytest.mark.parametrize("fmt, d", [(jnp.float8_e4m3fn, 128), (jnp.float8_e5m2, 64)])
def test_fp8_lowers_for_cuda(fmt, d):
    """The FP8 path's lowering (the widening of the ring's codes to float16 tiles), with the
    copy warpgroup and without."""
    pool = (64, 16, 8, d)
    args = (
        jax.ShapeDtypeStruct((4, 32, d), jnp.bfloat16),
        jax.ShapeDtypeStruct(pool, fmt),
        jax.ShapeDtypeStruct(pool, fmt),
        jax.ShapeDtypeStruct((4, 256), jnp.int32),
        jax.ShapeDtypeStruct((4,), jnp.int32),
        jax.ShapeDtypeStruct((8,), jnp.float32),
        jax.ShapeDtypeStruct((8,), jnp.float32),
    )
    for specialized in (True, False):

        def f(q, k, v, t, n, ks, vs, specialized=specialized):
            return decode_mgpu.paged_attention(
                q, k, v, t, n, interpret=False, k_scale=ks, v_scale=vs, specialized=specialized
            )

        assert "mosaic_gpu" in export_cuda(f, *args).mlir_module()


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_default_lowering(kv_dtype):
    """implementation="pallas" with no config: the Mosaic GPU kernel when compiled on sm_90
    for a 16-bit cache, head_dim 128 and tables of at least 1024 tokens, one-pass and split
    grids (batch 1); the Triton-lowered kernel for an explicit partition size, head_dim 64,
    512-token tables, FP8 caches, other GPUs and the CPU interpreter."""
    from jaxattn import ops
    from jaxattn.pallas import IMPLEMENTATIONS

    impl = IMPLEMENTATIONS["paged_attention"]
    fp8 = kv_dtype != jnp.bfloat16
    scales = dict(k_scale=0.5, v_scale=0.5) if fp8 else {}
    compiled = decode_mgpu.is_sm90() and jax.default_backend() == "gpu" and not fp8
    wide = 4 * jaxattn.pallas._common.num_sms()  # 2 KV heads: twice the grid's target
    for batch, d, width, kw, mosaic in (
        (wide, 128, 64, {}, compiled),  # tables of 64 pages: 1024 tokens
        (1, 128, 64, {}, compiled),
        (wide, 128, 64, {"partition_size": 32}, False),
        (wide, 64, 64, {}, False),
        (wide, 128, 32, {}, False),
    ):
        k = jnp.zeros((64, 16, 2, d), kv_dtype)
        q = jnp.zeros((batch, 8, d), jnp.bfloat16)
        tables, lens = jnp.zeros((batch, width), jnp.int32), jnp.full((batch,), 40, jnp.int32)
        args = ops.PAGED_ATTENTION.bind(q, k, k, tables, lens, **kw, **scales)
        assert impl.heuristic_config(args).lowering == ("mosaic_gpu" if mosaic else "triton")
