"""The Pallas backend on a JAX without Pallas' Triton lowering (deprecated in JAX 0.11, to be
removed): the package still imports, ``implementation="pallas"`` runs the Mosaic GPU kernels
for every op that has one (paged decode, prefix prefill, cascade decode; their split-KV
merges in XLA where no Mosaic GPU merge takes the head size), refuses the rest with a reason
that names the missing lowering (so a list of backends falls through), and the engine picks
the paged prefill and the Mosaic GPU decode.

``JAXATTN_PALLAS_TRITON=0`` stands for the missing lowering in most tests (the kernels run in
Mosaic GPU's interpret mode on the CPU and compiled on an sm_90 GPU, against the spec with
NaN in every slot they must not read); one test removes the module itself in a fresh
interpreter. XLA's merge is tested with the merge kernels in ``test_pallas.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_close,
    call_cascade,
    call_decode,
    call_extend,
    call_prefill,
    export_cuda,
    make_cascade,
    make_extend,
    make_paged_decode,
    make_prefix_prefill,
    spec_cascade,
    spec_decode,
    spec_extend,
    spec_prefill,
)

import jaxattn
from jaxattn import ops
from jaxattn.pallas import _mgpu, _triton, cascade_mgpu, decode, decode_mgpu

if _mgpu.available() is not None:
    pytest.skip(_mgpu.available(), allow_module_level=True)
if jax.default_backend() != "cpu" and not _mgpu.is_sm90():
    pytest.skip("the Mosaic GPU kernels compile for sm_90 only", allow_module_level=True)


@pytest.fixture
def no_triton(monkeypatch):
    monkeypatch.setenv(_triton.ENV, "0")
    assert "switched off" in _triton.missing()


def _lowering(op, case_args, **kw):
    return op.resolve(op.bind(*case_args, **kw), "pallas").config.lowering


@pytest.mark.parametrize(
    "d, partition_size", [(64, None), (64, 64), (128, 64)], ids=["d64", "d64-split", "d128-split"]
)
def test_decode_runs_the_mosaic_gpu_kernel(no_triton, d, partition_size):
    """Paged decode: the Mosaic GPU kernel, one pass or split; at head_dim 64 the split's
    merge is XLA's by default (the Mosaic GPU merge's two-heads-a-block form has not run on
    a GPU yet; named, it serves there too)."""
    rng = np.random.default_rng(d)
    case = make_paged_decode(
        rng, [40, 1, 90, 0], num_q_heads=8, num_kv_heads=2, head_dim=d, page_size=16,
        dtype=jnp.bfloat16,
    )  # fmt: skip
    kw = {} if partition_size is None else dict(partition_size=partition_size)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    assert _lowering(ops.PAGED_ATTENTION, args, layout=case.layout, **kw) == "mosaic_gpu"
    out = call_decode(jaxattn.paged_attention, case, implementation="pallas", **kw)
    assert_close(out, spec_decode(case, **kw), jnp.bfloat16)
    assert decode_mgpu.merge_lowering(None, d) == ("mosaic_gpu" if d == 128 else "xla")
    if partition_size is not None:
        named = decode_mgpu.paged_attention(
            *args, partition_pages=partition_size // 16, merge="mosaic_gpu"
        )
        assert_close(named, spec_decode(case, **kw), jnp.bfloat16)


@pytest.mark.parametrize("d", [128, 64])
def test_cascade_runs_the_mosaic_gpu_kernel(no_triton, d):
    """Cascade decode: the Mosaic GPU kernel over both levels; the merge is the Mosaic GPU
    one at head_dim 128, XLA's at 64 (and, named, the Mosaic GPU one there too: pairs of
    one KV head's query heads). Requests without a prefix and an empty own level."""
    case = make_cascade(
        np.random.default_rng(d), [4, 2], [0, -1, 1, 0], [5, 17, 0, 33], num_q_heads=8,
        num_kv_heads=2, head_dim=d, page_size=16, dtype=jnp.bfloat16,
    )  # fmt: skip
    args = (
        case.q, case.k_cache, case.v_cache, case.prefix_tables, case.prefix_lens,
        case.prefix_of, case.block_tables, case.seq_lens,
    )  # fmt: skip
    assert _lowering(ops.CASCADE_ATTENTION, args, layout=case.layout) == "mosaic_gpu"
    out = call_cascade(jaxattn.cascade_attention, case, implementation="pallas")
    want = spec_cascade(case)
    assert_close(out, want, jnp.bfloat16)
    merge = decode_mgpu.merge_lowering(None, d, num_q_heads=8, group=4, tiled=True)
    assert merge == ("mosaic_gpu" if d == 128 else "xla")
    # Named at 128 it would run the op's program again, with the same arguments.
    if merge != "mosaic_gpu":
        named = call_cascade(cascade_mgpu.cascade_attention, case, merge="mosaic_gpu")
        assert_close(named, want, jnp.bfloat16)


def test_prefix_prefill_runs_the_mosaic_gpu_kernel(no_triton):
    case = make_prefix_prefill(
        np.random.default_rng(3), [20, 0, 33], [9, 30, 1], num_q_heads=8, num_kv_heads=2,
        head_dim=64, page_size=16, dtype=jnp.bfloat16,
    )  # fmt: skip
    args = (case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.block_tables, case.seq_lens)
    assert _lowering(ops.PREFIX_PREFILL, args, layout=case.layout) == "mosaic_gpu"
    out = call_prefill(jaxattn.prefix_prefill, case, implementation="pallas")
    assert_close(out, spec_prefill(case), jnp.bfloat16)


def test_triton_kernels_refuse(no_triton):
    """What only a Triton-lowered kernel serves is refused with the reason (no kernel runs),
    and a list of backends falls through to the next one."""
    rng = np.random.default_rng(5)
    case = make_extend(
        rng, [3, 20], [5, 7], num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16
    )
    with pytest.raises(NotImplementedError, match="Triton lowering .*token pool"):
        call_extend(jaxattn.extend_attention, case, implementation="pallas")
    out = call_extend(jaxattn.extend_attention, case, implementation=("pallas", "reference"))
    assert_close(out, spec_extend(case), jnp.bfloat16)
    paged = make_paged_decode(
        rng, [40, 9], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16
    )
    triton_config = jaxattn.pallas.DecodeConfig()  # names the Triton kernel
    with pytest.raises(NotImplementedError, match="Triton lowering"):
        call_decode(jaxattn.paged_attention, paged, implementation="pallas", config=triton_config)
    # The Mosaic GPU decode cannot serve page size 4 (TMA copies pages of >= 8 tokens).
    small = make_paged_decode(
        rng, [9], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4, dtype=jnp.bfloat16
    )
    with pytest.raises(NotImplementedError, match="Triton lowering.*page_size"):
        call_decode(jaxattn.paged_attention, small, implementation="pallas")
    # Scales with a 16-bit cache: no Mosaic GPU kernel takes them, so the list falls through.
    prefill = make_prefix_prefill(
        rng, [20], [5], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
        dtype=jnp.bfloat16,
    )  # fmt: skip
    scales = dict(k_scale=jnp.asarray([0.5, 2.0]), v_scale=jnp.asarray([1.5, 0.25]))
    with pytest.raises(NotImplementedError, match="Triton lowering.*FP8 caches only"):
        call_prefill(jaxattn.prefix_prefill, prefill, implementation="pallas", **scales)
    out = call_prefill(
        jaxattn.prefix_prefill, prefill, implementation=("pallas", "reference"), **scales
    )
    assert_close(out, spec_prefill(prefill, **scales), jnp.bfloat16)
    acc = jnp.zeros((1, 2, 4, 64), jnp.float32)
    stats = jnp.zeros((1, 2, 4), jnp.float32)
    with pytest.raises(NotImplementedError, match="Triton lowering"):
        decode.combine(acc, stats, stats, jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="Triton lowering"):
        decode_mgpu.merge_lowering("triton", 128)


def test_exports_without_triton_kernels(no_triton):
    """Compiled for CUDA (jax.export, an abstract H200), the head_dim 64 split decode and
    cascade hold no Triton kernel: their merge is XLA's (with an odd group too)."""
    bf16, i32 = jnp.bfloat16, jnp.int32
    sds = jax.ShapeDtypeStruct
    q, pool = sds((2, 8, 64), bf16), sds((64, 16, 2, 64), bf16)

    def dec(q, k, v, t, n):
        return decode_mgpu.paged_attention(q, k, v, t, n, partition_pages=4, interpret=False)

    exported = export_cuda(dec, q, pool, pool, sds((2, 16), i32), sds((2,), i32), triton=False)
    assert "mosaic_gpu" in exported.mlir_module()

    def casc(q, k, v, pt, pn, po, t, n):
        return cascade_mgpu.cascade_attention(q, k, v, pt, pn, po, t, n, interpret=False)

    args = (q, pool, pool, sds((1, 8), i32), sds((1,), i32), sds((2,), i32))
    exported = export_cuda(casc, *args, sds((2, 4), i32), sds((2,), i32), triton=False)
    assert "mosaic_gpu" in exported.mlir_module()
    odd = (sds((2, 6, 64), bf16), pool, pool, *args[3:])
    assert decode_mgpu.merge_lowering(None, 64, group=3, tiled=True) == "xla"
    exported = export_cuda(casc, *odd, sds((2, 4), i32), sds((2,), i32), triton=False)
    assert "mosaic_gpu" in exported.mlir_module()


def _bf16_engine(**kw):
    """An engine over a one-layer bf16 model with head_dim 64 (the Mosaic GPU kernels take
    16-bit q and head sizes that are multiples of 64), implementation="pallas"."""
    from jaxattn.engine import Engine
    from jaxattn.models import llama
    from jaxattn.models.llama import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, dtype="bfloat16",
    )  # fmt: skip
    params = llama.init_params(cfg, jax.random.key(0))
    kw = dict(implementation="pallas") | kw
    engine = Engine(
        cfg, params, num_pages=24, page_size=8, max_batch_tokens=32, debug=True, **kw
    )  # fmt: skip
    return engine, cfg, params


def test_engine_runs_on_the_mosaic_gpu_kernels(no_triton):
    """The engine with implementation="pallas": the paged prefill (no kernel reads the token
    pool) and the Mosaic GPU decode by default, reported in its stats; a bf16 model
    generates what the dense model verifies."""
    from jaxattn.engine import check_outputs

    engine, cfg, params = _bf16_engine()
    assert engine.runner.extend_attention == "prefix_prefill"
    assert engine.stats["attention_lowering"] == {"extend": "mosaic_gpu", "decode": "mosaic_gpu"}
    rng = np.random.default_rng(0)
    system = rng.integers(0, 128, 11).tolist()
    prompts = [system + rng.integers(0, 128, n).tolist() for n in (3, 9)] + [[7]]
    out = engine.generate(prompts, 5)
    report = check_outputs(params, cfg, prompts, out, max_new_tokens=5)
    assert report.ok and report.checked == 15, report.problems[:5]


def test_engine_fp8_pool_keeps_the_kernels(no_triton):
    """An FP8 pool with implementation=("pallas", "reference"): the Mosaic GPU prefill,
    decode and cascade decode serve it (the paged prefill: the list names Pallas first)."""
    engine, _, _ = _bf16_engine(implementation=("pallas", "reference"), kv_dtype="fp8_e4m3")
    assert engine.runner.extend_attention == "prefix_prefill"
    assert engine.stats["attention_lowering"] == {"extend": "mosaic_gpu", "decode": "mosaic_gpu"}
    assert engine.runner.backends == {"extend": "pallas", "decode": "pallas"}
    assert engine.runner.cascade_backend == "pallas"
    out = engine.generate([[5, 9, 11, 3, 2, 8, 1, 4, 6, 7, 12, 13], [5, 9, 11]], 3)
    assert [len(o) for o in out] == [3, 3]


def test_engine_refuses_interpreted_mosaic_gpu_kernels_over_several_cpu_devices(no_triton):
    """JAX's interpreter of Mosaic GPU kernels fails or hangs in the engine's programs over
    several CPU devices: the engine says so at construction instead."""
    if jax.default_backend() != "cpu" or jax.device_count() < 2:
        pytest.skip("two CPU devices")
    from helpers import mesh_of

    with pytest.raises(NotImplementedError, match="2 CPU devices"):
        _bf16_engine(mesh=mesh_of(2))


def test_imports_without_the_triton_module():
    """A fresh interpreter in which ``jax.experimental.pallas.triton`` cannot be imported (as
    on a JAX that dropped it): jaxattn and its Pallas backend import, say why the Triton
    kernels are missing, and the paged decode runs the Mosaic GPU kernel."""
    script = textwrap.dedent(
        """
        import importlib.abc, sys

        class NoTriton(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "jax.experimental.pallas.triton" or name.startswith(
                    "jax._src.pallas.triton"
                ):
                    raise ImportError(f"No module named {name!r}")
                return None

        sys.meta_path.insert(0, NoTriton())
        import jax, jax.numpy as jnp, numpy as np
        import jaxattn
        from jaxattn.pallas import _triton
        from jaxattn.__main__ import environment_info

        assert "has no Pallas Triton lowering" in _triton.missing(), _triton.missing()
        assert "Mosaic GPU kernels alone" in environment_info()["pallas"]
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((8, 16, 2, 64)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((8, 16, 2, 64)), jnp.bfloat16)
        tables = jnp.asarray([[3, 1], [6, 0]], jnp.int32)
        lens = jnp.asarray([20, 9], jnp.int32)
        got = jaxattn.paged_attention(q, k, v, tables, lens, implementation="pallas")
        want = jaxattn.paged_attention(q, k, v, tables, lens, implementation="reference")
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        assert err < 2e-2, err
        assert "jax.experimental.pallas.triton" not in sys.modules
        print("OK")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != _triton.ENV}
    env["JAX_PLATFORMS"] = "cpu"
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stderr[-3000:]
