"""FlashAttention-4 (``flash_attn.cute``, its sm90 kernels on Hopper) as a benchmark peer.

FA4 is a PyTorch library; it runs here on the same device buffers as the jaxattn row it is
compared with (JAX arrays handed over through DLPack, no copy), in the same process, timed
with CUDA events over the same rotated input copies: a sample enqueues every copy several
times back to back and waits once. Where ``torch`` or ``flash_attn.cute`` cannot be imported
the peer reports itself skipped, so the benchmarks run unchanged without it.

Extend / prefix prefill: ``flash_attn_varlen_func`` with packed q (``cu_seqlens_q``), a paged
cache (``page_table`` [B, pages], ``seqused_k``; the token pool is a cache of 1-token pages)
and ``causal=True``, which FA4 anchors bottom-right: jaxattn's shifted mask
``j <= i + (Lk - Lq)``. Paged decode: the same function with q as ``[B, 1, Hq, D]`` over the
bshd pages (its sm90 path takes no split-KV, ``num_splits`` 1).
"""

from __future__ import annotations

import statistics
import time

import common
import jax
import numpy as np


def _load():
    try:
        import torch
        from flash_attn.cute.interface import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001 - any import failure means: no peer here
        return None, None, f"{type(e).__name__}: {e}"[:200]
    return torch, flash_attn_varlen_func, None


# FA4's pack_gqa settings timed: its own choice (None) and packing forced on (the query heads
# of a KV head in one tile, what jaxattn's sm90 kernel does); the peer is the faster.
PACK_GQA = (None, True)


def extend_call(copy, *, form: str, batch: int, prefix: int, new: int, scale: float, pack_gqa=None):
    """``() -> out`` running FA4 on one input copy of bench_extend's ``--form``, or a
    reason (str) it cannot."""
    torch, fa4, why = _load()
    if torch is None:
        return why
    if form == "prefill":
        q, k, v, cu, tables, seq_lens = copy[:6]
        if k.ndim != 4:
            return "FA4 takes bshd pages"
    else:
        q, k, v, cu, _, kv_indices = copy[:6]
        k = k.reshape(k.shape[0], 1, *k.shape[1:])
        v = v.reshape(v.shape[0], 1, *v.shape[1:])
        tables = kv_indices.reshape(batch, prefix + new)
        seq_lens = np.full((batch,), prefix + new, np.int32)
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    tcu = torch.from_dlpack(jax.numpy.asarray(cu))
    ttab = torch.from_dlpack(jax.numpy.asarray(tables))
    tlen = torch.from_dlpack(jax.numpy.asarray(seq_lens))

    def run():
        out = fa4(
            tq,
            tk,
            tv,
            cu_seqlens_q=tcu,
            max_seqlen_q=new,
            seqused_k=tlen,
            page_table=ttab,
            softmax_scale=scale,
            causal=True,
            pack_gqa=pack_gqa,
        )
        return out[0] if isinstance(out, tuple) else out

    return run


def decode_call(copy, *, layout: str, scale: float):
    """``() -> out [B, Hq, D]`` running FA4's paged decode on one input copy of
    bench_decode (q, k_cache, v_cache, block_tables, seq_lens), or a reason (str) it
    cannot."""
    torch, fa4, why = _load()
    if torch is None:
        return why
    if layout != "bshd":
        return "FA4 takes bshd pages"
    q, k, v, tables, lens = copy[:5]
    b, hq, d = q.shape
    tq = torch.from_dlpack(q).view(b, 1, hq, d)
    tk, tv, ttab, tlen = (torch.from_dlpack(x) for x in (k, v, tables, lens))

    def run():
        out = fa4(tq, tk, tv, seqused_k=tlen, page_table=ttab, softmax_scale=scale)
        return (out[0] if isinstance(out, tuple) else out).view(b, hq, d)

    return run


def measure(calls, *, samples: int, target_s: float, expected=None) -> dict:
    """Like common.measure for FA4 calls (one ``() -> out`` a copy): us, us_min, rel_err
    against ``expected`` on copy 0, or skipped / error."""
    if any(isinstance(c, str) for c in calls):
        return {"skipped": next(c for c in calls if isinstance(c, str))}
    torch, _, _ = _load()
    out: dict = {}
    try:
        first = calls[0]()
        torch.cuda.synchronize()
        if expected is not None:
            out["rel_err"] = common.rel_error(np.asarray(first.float().cpu()), expected)

        def sample(reps: int) -> float:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                for c in calls:
                    c()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop) * 1e-3 / (reps * len(calls))

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.25:  # warm-up (compiles on the first call)
            sample(1)
        per_call = min(sample(1) for _ in range(3))
        reps = max(1, int(target_s / max(per_call * len(calls), 1e-7)))
        times = [sample(reps) for _ in range(samples)]
    except Exception as e:  # noqa: BLE001 - a failing peer must not end a run
        return out | {"error": f"{type(e).__name__}: {e}"[:600]}
    return out | dict(us=statistics.median(times) * 1e6, us_min=min(times) * 1e6)
