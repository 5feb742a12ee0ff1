"""Pallas GPU kernels: paged decode, extend, prefix-prefill and cascade attention.

Two lowerings:

* Pallas' *Triton* lowering (:mod:`.decode`, :mod:`.extend`, :mod:`.cascade`), the first
  kernels: a paged KV read is a gather (a block-table or slot lookup per token, pointer
  tensors with masked loads that Triton pipelines with asynchronous copies); the same source
  runs in interpret mode on the CPU and compiles for NVIDIA and AMD GPUs. JAX 0.11
  deprecates this lowering and announces its removal.
* *Mosaic GPU* (:mod:`.decode_mgpu`, :mod:`.prefill_mgpu`, :mod:`.cascade_mgpu`,
  :mod:`.merge_mgpu`; sm_90, interpreted on the CPU): per-page TMA copies into rings,
  wgmma, warp specialisation, which the Triton lowering does not express.

The first Triton-lowered kernels measured on an H200 (bf16, D=128, Hq/Hkv 32/8;
``benchmarks/RESULTS.md``): decode at 77-105% of the device-to-device copy bandwidth (read +
write), about twice JAX's own Pallas paged decode; extend at 316 TFLOP/s on 8 x (2048 + 512)
and 382 on 1 x (0 + 8192), 0.78x and 0.71x cuDNN's flash attention.

On Mosaic GPU a page of one KV head is a strided ``[page_size, head_dim]`` box of the bshd pool
(``k_cache.at[page, :, head, :]``), one TMA copy after the page id is read from the block-table
row in shared memory. :mod:`jaxattn.pallas.decode_mgpu` is the first kernel written for it
(paged decode: TMA page copies into a ring, wgmma, split-KV partitions merged exactly), tested
in interpret mode and compiled on an H200 against the reference with the unread slots poisoned.
It reads q and writes a one-pass output in their own layout (no XLA kernel around it). On an
H200 it reads the KV at 91% of the read ceiling at B=64 x 4096 (the Triton kernel 88% in the
same run) and 94% (95%) with 32/32 heads, so ``paged_attention`` runs it by default on sm_90
for 16-bit caches with head_dim 128 and tables of at least 1024 tokens
(:func:`decode_mgpu.serves_by_default`), split grids included: their merge is one kernel that
reads the partitions' states in place, on the Mosaic GPU lowering too at head_dim 128
(:mod:`jaxattn.pallas.merge_mgpu`, round 39: 1.5-1.8 us where the Triton-lowered
:func:`decode.combine` took 1.7-1.8 us in the same job), so those calls launch no Triton
kernel; the split rows took 0.7-3.6% less device time than the Triton kernel's (B=8 x 4096:
76-77% of the read ceiling, B=1 x 32768: 76-78%, rounds 35-39). Head_dim 64 (the Triton kernel
2-25% faster at batch 64 and 256, round 34) and 512-token tables (7% at batch 256) keep the
Triton kernel, and so do the engine's decode steps (8804 against 9383 generated tok/s on its 1b
workload, head_dim 64; round 33); ``DecodeConfig(lowering=...)`` names either.
:mod:`jaxattn.pallas.prefill_mgpu` is the second (prefix prefill over a paged cache: the same
page ring, the query heads of a KV head packed into the tiles, the shifted causal mask),
tested in interpret mode and compiled on an H200 (FP8 caches included). Its warp-specialised
form (16-bit caches: a producer warpgroup and two consumer warpgroups in turns,
FlashAttention-3's schedule; q read and the output written in their own layout) is what
``prefix_prefill`` runs by default on sm_90 for 16-bit caches: 482 / 537 / 501 / 213 TFLOP/s
on 8 x (2048 + 512), 1 x (0 + 8192), 4 x (0 + 4096) and 32 x (1000 + 24) through the public
op (round 33; round 32 measured 1.39-1.58x the Triton kernel on the three long rows);
``ExtendConfig(lowering=...)`` names either. Both take FP8
caches (e4m3, e5m2, per-KV-head scales): the ring holds the codes, each step is widened to
float16 tiles in shared memory (Mosaic GPU converts FP8 to float16, not to bfloat16), and q
is moved to float16 by a power of two per KV head; each thread widens 8 codes a load. With
the copy warpgroup (``specialized=True``) the decode's widening runs in that warpgroup,
beside the compute warpgroup's products. Compiled on the H200 the decode kernel's FP8 path is
correct but slower than its bf16 one (e4m3, 64 x 4096: 308-365 us with the copy warpgroup,
416-418 us without, round 36; 32-38% and 28% of the read ceiling) and than the Triton
kernel's (261 us, 45%), so that kernel and the native kernels serve FP8 caches.
:mod:`jaxattn.pallas.cascade_mgpu` is the third (cascade decode): both levels run the
Mosaic GPU decode kernel, a prefix tile's requests times query heads as its 64 rows over the
prefix's pages (their q rows copied by the kernel itself), the own pages as paged decode,
both in one launch, then one merge kernel that reads both levels' states in place
(:func:`merge_mgpu.merge_levels` at head_dim 128, as fast as the Triton-lowered
:func:`decode.combine_levels` it replaced, round 39: no Triton kernel in the op).
``cascade_attention`` runs it by default on sm_90 for 16-bit caches at head_dim 128: on an
H200 it kept the GPU busy 45 / 50 / 275 us a call on ``bench_cascade.py``'s shared, mixed
and private batches (round 38), where the Triton-lowered kernel took 79 / 88 / 390 us
(round 37); ``CascadeConfig(lowering=...)`` names either.

Without the Triton lowering (a JAX that has dropped it, or ``JAXATTN_PALLAS_TRITON=0``;
:mod:`jaxattn.pallas._triton`) the package still imports and ``implementation="pallas"``
runs the Mosaic GPU kernels for every op that has one, whatever the shape's default above:
paged decode (its split merged by XLA's reductions where the Mosaic GPU merge is not the
default, head_dim 64: :func:`decode.combine_levels_jnp`), prefix prefill and cascade decode (16-bit
and FP8 caches). What only a Triton-lowered kernel serves (the token-pool
``extend_attention``, page sizes under 8, float32) is refused with the reason, so a list of
backends falls through to the next.

Every entry point takes ``interpret=None`` (interpret exactly when the default backend
is the CPU) and raises ``NotImplementedError`` for arguments or platforms it cannot
serve, so ``jaxattn.ops`` can fall back to another backend.

Inside the kernels the logits are in base 2 (``scale * log2(e)`` folded once, ``exp2``
in the loops); what the kernels return never exposes that.
"""

import jax

from ..backend import KernelImplementation
from . import _common as C
from . import _triton
from . import cascade as _cascade
from . import decode as _decode
from . import extend as _extend
from .cascade import CascadeConfig, cascade_attention
from .decode import DecodeConfig, choose_partition_size, paged_attention
from .extend import ExtendConfig, extend_attention, prefix_prefill

_PLATFORMS = ("cpu", "gpu", "cuda", "rocm")


def is_available() -> bool:
    """True where the kernels can run: compiled on a GPU, interpreted on the CPU."""
    return jax.default_backend() in _PLATFORMS


# --- the backend contract (jaxattn.backend) ---------------------------------------------


class _Pallas(KernelImplementation):
    backend = "pallas"

    def available(self, platform):
        if platform not in _PLATFORMS:
            return (
                "the Pallas kernels need an NVIDIA or AMD GPU (or the CPU interpreter); "
                f"platform is {platform!r}"
            )
        return None

    def supports(self, a):
        why = C.unsupported(a.kernel_q, a.k_cache, a.v_cache, a.layout)
        if why is None and (triton := _triton.missing()) is not None:
            # Without the Triton lowering only the Mosaic GPU kernels run (heuristic_config).
            mosaic = self.mosaic_gpu_reason(a)
            if mosaic is not None:
                why = f"{triton}, and {mosaic}"
        return why

    def mosaic_gpu_reason(self, a) -> str | None:
        """Why this op's Mosaic GPU kernel cannot serve ``a``, or None."""
        return "no Mosaic GPU kernel serves it"


def _steps(a) -> int:
    from . import _mgpu as M

    return M.steps_of(None, a.geometry.page_size)


class _PagedAttention(_Pallas):
    config_cls = DecodeConfig

    def mosaic_gpu_reason(self, a):
        from . import _mgpu as M
        from . import decode_mgpu

        why = M.platform_reason(interpret=None) or decode_mgpu.unsupported(
            a.q, a.k_cache, a.v_cache, a.layout.name, pages_per_step=_steps(a), scaled=a.scaled
        )
        step = a.geometry.page_size * _steps(a)
        if why is None and a.partition_size is not None and a.partition_size % step:
            why = (
                f"the Mosaic GPU decode partitions whole steps of {step} tokens, "
                f"got partition_size={a.partition_size}"
            )
        return why

    def heuristic_config(self, a):
        from . import decode_mgpu

        if _triton.missing() is not None:
            return DecodeConfig(lowering="mosaic_gpu")
        if not a.scaled and decode_mgpu.serves_by_default(
            a.q, a.k_cache, a.v_cache, a.layout.name, a.block_tables, a.partition_size
        ):
            return DecodeConfig(lowering="mosaic_gpu")
        return _decode.heuristic_config(a.q, a.geometry)

    function = staticmethod(paged_attention)


class _ExtendAttention(_Pallas):
    config_cls = ExtendConfig

    def mosaic_gpu_reason(self, a):
        return "no Mosaic GPU kernel reads a token pool (prefix_prefill reads paged caches)"

    def heuristic_config(self, a):
        return _extend.heuristic_config(a.kernel_q, a.group, a.qo_indptr)

    function = staticmethod(extend_attention)


class _PrefixPrefill(_Pallas):
    config_cls = ExtendConfig

    def mosaic_gpu_reason(self, a):
        from . import _mgpu as M
        from . import prefill_mgpu

        return M.platform_reason(interpret=None) or prefill_mgpu.unsupported(
            a.kernel_q, a.k_cache, a.v_cache, a.layout.name, pages_per_step=_steps(a),
            scaled=a.scaled,
        )  # fmt: skip

    def heuristic_config(self, a):
        from . import prefill_mgpu

        if _triton.missing() is not None:
            return ExtendConfig(lowering="mosaic_gpu")
        if not a.scaled and prefill_mgpu.serves_by_default(
            a.kernel_q, a.k_cache, a.v_cache, a.layout.name, a.block_tables
        ):
            return ExtendConfig(lowering="mosaic_gpu")
        return _extend.heuristic_config(a.kernel_q, a.group, a.cu_seqlens_q)

    function = staticmethod(prefix_prefill)


class _CascadeAttention(_Pallas):
    config_cls = CascadeConfig

    def mosaic_gpu_reason(self, a):
        from . import _mgpu as M
        from . import cascade_mgpu

        return M.platform_reason(interpret=None) or cascade_mgpu.unsupported(
            a.q, a.k_cache, a.v_cache, a.layout.name, scaled=a.scaled
        )

    def heuristic_config(self, a):
        from . import cascade_mgpu

        if _triton.missing() is not None:
            return CascadeConfig(lowering="mosaic_gpu")
        if not a.scaled and cascade_mgpu.serves_by_default(
            a.q, a.k_cache, a.v_cache, a.layout.name
        ):
            return CascadeConfig(lowering="mosaic_gpu")
        return _cascade.heuristic_config(a.q, a.geometry, a.prefix_tables, a.block_tables)

    function = staticmethod(cascade_attention)


IMPLEMENTATIONS = {
    "paged_attention": _PagedAttention(),
    "extend_attention": _ExtendAttention(),
    "prefix_prefill": _PrefixPrefill(),
    "cascade_attention": _CascadeAttention(),
}

__all__ = [
    "IMPLEMENTATIONS",
    "CascadeConfig",
    "DecodeConfig",
    "ExtendConfig",
    "cascade_attention",
    "choose_partition_size",
    "extend_attention",
    "is_available",
    "paged_attention",
    "prefix_prefill",
]
