"""Probes of the memory-safety and NaN contract, runnable in a subprocess.

Each probe builds a small valid problem, breaks one index (or plants one NaN), runs the
op under ``jax.jit`` with one backend and returns what the contract says to compare:

* ``out``: the op's output on the broken inputs;
* ``want_nan``: bool per output row (and head): where the contract requires NaN;
* ``want``: the spec (the reference backend) on the same inputs, to which every other row
  must be equal. The NaN rows are written out by hand per probe, so the reference itself is
  checked by them too.

``python robustness_probes.py PROBE BACKEND OUT.npz`` runs one probe and saves those three
arrays, so that a crash in a native kernel fails one test instead of the test process.
``python robustness_probes.py --batch BACKEND DIR PROBE...`` runs several in one process (one
import of JAX for all), each into ``DIR/<n>.npz`` (``<n>``: its position in the list), or
``<n>.skip`` / ``<n>.err`` with the backend's refusal / the traceback; a probe that crashes
the process leaves no file, for the caller to run alone.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from helpers import make_cascade, make_extend, make_paged_decode, make_prefix_prefill

import jaxattn

HEADS = dict(num_q_heads=4, num_kv_heads=2)
# The FP8 probes: an e4m3 cache with per-head scales under a bfloat16 q (what the GPU kernels
# serve); the plain probes keep float32 throughout.
FP8 = dict(dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn)


def _decode(backend, case, tables=None, lens=None, q=None, k=None, v=None, partition_size=None):
    f = jax.jit(
        lambda *a: jaxattn.paged_attention(
            *a,
            layout=case.layout,
            partition_size=partition_size,
            implementation=backend,
            **case.scales,
        )
    )
    return f(
        case.q if q is None else q,
        case.k_cache if k is None else k,
        case.v_cache if v is None else v,
        case.block_tables if tables is None else tables,
        case.seq_lens if lens is None else lens,
    )


def _rows_of(indptr, num_rows, requests):
    mask = np.zeros(num_rows, bool)
    for b in requests:
        mask[indptr[b] : min(indptr[b + 1], num_rows)] = True
    return mask


def decode_probe(name, backend, rng, **kv):
    split = name.endswith("_split")
    name = name.removesuffix("_split")
    ps = 16 if split else None
    case = make_paged_decode(
        rng, [37, 20, 1, 50], **HEADS, head_dim=32, page_size=8, layout="bhsd", spare_pages=2, **kv
    )
    n = case.k_cache.shape[0]
    tables, lens = np.asarray(case.block_tables).copy(), np.asarray(case.seq_lens).copy()
    bad = {1}
    if name == "page_at_num_pages":
        tables[1, 1] = n
    elif name == "page_huge":
        tables[1, 2] = 10**6
    elif name == "page_negative":
        tables[1, 0] = -1
    elif name == "len_over_table":
        lens[1] = tables.shape[1] * 8 + 5
    elif name == "len_negative":
        lens[1] = -3
    elif name == "garbage_past_length":
        tables[2, 1:] = 10**6  # entries past the length are never read: nothing poisoned
        bad = set()
    else:
        raise ValueError(name)
    run = lambda b: _decode(b, case, jnp.asarray(tables), jnp.asarray(lens), partition_size=ps)
    out = run(backend)
    want_nan = np.zeros(out.shape[:2], bool)
    want_nan[sorted(bad)] = True
    return out, want_nan, run("reference")


def nan_probe(name, backend, rng, **kv):
    """NaN in q or in an attended K/V element poisons exactly the rows that read it (in an
    FP8 cache: the format's NaN encoding)."""
    case = make_paged_decode(rng, [37, 20, 9], **HEADS, head_dim=32, page_size=8, **kv)
    q, k, v = np.asarray(case.q), np.asarray(case.k_cache), np.asarray(case.v_cache)
    want_nan = np.zeros(q.shape[:2], bool)
    tables = np.asarray(case.block_tables)
    if name == "nan_in_q":
        q = q.copy()
        q[1, 3, 5] = np.nan
        want_nan[1, 3] = True
    elif name in ("nan_in_k", "nan_in_v"):
        arr = (k if name == "nan_in_k" else v).copy()
        page, off = tables[0, 2], 3  # token 19 of sequence 0, KV head 1
        arr[page, off, 1, 7] = np.nan
        want_nan[0, 2:4] = True  # query heads 2 and 3 read KV head 1
        k, v = (arr, v) if name == "nan_in_k" else (k, arr)
    else:
        raise ValueError(name)
    run = lambda b: _decode(b, case, q=jnp.asarray(q), k=jnp.asarray(k), v=jnp.asarray(v))
    return run(backend), want_nan, run("reference")


def extend_probe(name, backend, rng):
    e = make_extend(rng, [5, 0, 9], [3, 4, 2], **HEADS, head_dim=32, pad_rows=2)
    qo, kv, idx = (np.asarray(x).copy() for x in (e.qo_indptr, e.kv_indptr, e.kv_indices))
    tq = e.q.shape[0]
    good_qo = qo.copy()
    if name == "slot_out_of_pool":
        idx[kv[1] + 2] = e.k_pool.shape[0]
        nan_rows = _rows_of(good_qo, tq, [1])
    elif name == "slot_negative":
        idx[kv[2]] = -7
        nan_rows = _rows_of(good_qo, tq, [2])
    elif name == "qo_decreasing":
        qo[1] = qo[2] + 1
        nan_rows = np.ones(tq, bool)
    elif name == "qo_past_q":
        qo[3] = tq + 40
        nan_rows = _rows_of(qo, tq, [2])
    elif name == "kv_past_indices":
        kv[3] = idx.shape[0] + 100
        nan_rows = _rows_of(good_qo, tq, [2])
    elif name == "fewer_keys_than_queries":
        kv[2] = kv[1] + 3  # request 1: 3 keys for 4 queries (request 2 gains a key)
        nan_rows = _rows_of(good_qo, tq, [1])
    else:
        raise ValueError(name)
    args = (e.q, e.k_pool, e.v_pool, jnp.asarray(qo), jnp.asarray(kv), jnp.asarray(idx))
    run = lambda b: jax.jit(lambda *a: jaxattn.extend_attention(*a, implementation=b))(*args)
    out = run(backend)
    return out, np.broadcast_to(nan_rows[:, None], out.shape[:2]), run("reference")


def prefill_probe(name, backend, rng, **kv):
    c = make_prefix_prefill(
        rng,
        [5, 0, 9],
        [3, 4, 2],
        **HEADS,
        head_dim=32,
        page_size=4,
        layout="bshd",
        pad_rows=2,
        **kv,
    )
    cu, tables, lens = (np.asarray(x).copy() for x in (c.cu_seqlens_q, c.block_tables, c.seq_lens))
    tq = c.q.shape[0]
    if name == "page_out_of_pool":
        tables[0, 1] = 10**6  # keys 4..7 of request 0: every row must still be NaN
        nan_rows = _rows_of(cu, tq, [0])
    elif name == "len_over_table":
        lens[2] = tables.shape[1] * 4 + 1
        nan_rows = _rows_of(cu, tq, [2])
    elif name == "cu_decreasing":
        cu[2] = cu[1] - 1
        nan_rows = np.ones(tq, bool)
    elif name == "nan_in_v":
        # V element 3 of KV head 0 at key 2 of request 2 (prefix 9): every row of the request
        # sees it, in query heads 0 and 1.
        v = np.asarray(c.v_cache).copy()
        v[tables[2, 0], 2, 0, 3] = np.nan
        c.v_cache = jnp.asarray(v)
        nan_rows = np.zeros((tq, 4), bool)
        nan_rows[cu[2] : cu[3], :2] = True
    else:
        raise ValueError(name)
    args = (c.q, c.k_cache, c.v_cache, jnp.asarray(cu), jnp.asarray(tables), jnp.asarray(lens))
    f = lambda b: jax.jit(lambda *a: jaxattn.prefix_prefill(*a, implementation=b, **c.scales))
    run = lambda b: f(b)(*args)
    out = run(backend)
    if nan_rows.ndim == 1:
        nan_rows = np.broadcast_to(nan_rows[:, None], out.shape[:2])
    return out, nan_rows, run("reference")


def cascade_probe(name, backend, rng, **kv):
    """A bad prefix poisons every request that continues it (and no other); a bad prefix_of
    or own page the request alone; entries past every length are never read. ``kv``: the
    FP8 probes' dtypes (the case's per-head scales go to every call)."""
    case = make_cascade(
        rng,
        [3, 2, 4],
        [0, 1, 0, -1, 2, 0, 1],
        [5, 0, 17, 9, 3, 30, 1],
        **HEADS,
        head_dim=32,
        page_size=8,
        layout="bshd",
        **kv,
    )
    n = case.k_cache.shape[0]
    ptab, plens, pof, tabs, lens = (
        np.asarray(x).copy()
        for x in (
            case.prefix_tables,
            case.prefix_lens,
            case.prefix_of,
            case.block_tables,
            case.seq_lens,
        )
    )
    users = lambda g: {b for b, x in enumerate(pof) if x == g}
    if name == "prefix_page_out_of_pool":
        ptab[0, 2] = n  # the last page of prefix 0
        bad = users(0)
    elif name == "prefix_page_negative":
        ptab[2, 0] = -1
        bad = users(2)
    elif name == "prefix_len_not_whole_pages":
        plens[1] -= 3
        bad = users(1)
    elif name == "prefix_len_over_table":
        plens[2] = ptab.shape[1] * 8 + 8
        bad = users(2)
    elif name == "prefix_of_out_of_range":
        pof[4] = 3
        bad = {4}
    elif name == "prefix_of_below_minus_one":
        pof[1] = -2
        bad = {1}
    elif name == "own_page_out_of_pool":
        tabs[5, 3] = 10**6  # the last own page of request 5 (30 tokens)
        bad = {5}
    elif name == "own_len_over_table":
        lens[6] = tabs.shape[1] * 8 + 1
        bad = {6}
    elif name == "garbage_past_lengths":
        for g, length in enumerate(plens):
            ptab[g, length // 8 :] = 10**6
        for b, length in enumerate(lens):
            tabs[b, -(-length // 8) :] = -5
        bad = set()
    elif name == "unused_prefix_garbage":
        pof[pof == 1] = -1  # nobody continues prefix 1, whose metadata is then garbage
        plens[1] = -9
        ptab[1] = 10**6
        bad = set()
    elif name in ("nan_in_q", "nan_in_prefix_k"):
        bad = set()
    else:
        raise ValueError(name)
    q, k = np.asarray(case.q).copy(), np.asarray(case.k_cache).copy()
    want_nan = np.zeros(q.shape[:2], bool)
    want_nan[sorted(bad)] = True
    if name == "nan_in_q":
        q[2, 1, 5] = np.nan
        want_nan[2, 1] = True
    elif name == "nan_in_prefix_k":  # token 10 of prefix 0, KV head 1: heads 2 and 3 of its users
        k[ptab[0, 1], 2, 1, 7] = np.nan
        want_nan[sorted(users(0)), 2:4] = True
    arrays = (q, k, case.v_cache, ptab, plens, pof, tabs, lens)
    args = tuple(map(jnp.asarray, arrays))
    run = lambda b: jax.jit(
        lambda *a: jaxattn.cascade_attention(*a, **case.scales, implementation=b)
    )(*args)
    return run(backend), want_nan, run("reference")


_DECODE_PROBES = (
    "page_at_num_pages",
    "page_huge",
    "page_negative",
    "len_over_table",
    "len_negative",
    "garbage_past_length",
)

PROBES = {
    **{f"decode/{n}{s}": decode_probe for n in _DECODE_PROBES for s in ("", "_split")},
    **{f"nan/{n}": nan_probe for n in ("nan_in_q", "nan_in_k", "nan_in_v")},
    **{
        f"extend/{n}": extend_probe
        for n in (
            "slot_out_of_pool",
            "slot_negative",
            "qo_decreasing",
            "qo_past_q",
            "kv_past_indices",
            "fewer_keys_than_queries",
        )
    },
    **{
        f"prefill/{n}": prefill_probe
        for n in ("page_out_of_pool", "len_over_table", "cu_decreasing", "nan_in_v")
    },
    **{
        f"fp8_decode/{n}{s}": functools.partial(decode_probe, **FP8)
        for n in ("page_huge", "page_negative", "len_over_table", "garbage_past_length")
        for s in ("", "_split")
    },
    **{
        f"fp8_nan/{n}": functools.partial(nan_probe, **FP8)
        for n in ("nan_in_q", "nan_in_k", "nan_in_v")
    },
    **{
        f"fp8_prefill/{n}": functools.partial(prefill_probe, **FP8)
        for n in ("page_out_of_pool", "len_over_table", "cu_decreasing", "nan_in_v")
    },
    **{
        f"fp8_cascade/{n}": functools.partial(cascade_probe, **FP8)
        for n in (
            "prefix_page_out_of_pool",
            "prefix_len_over_table",
            "own_page_out_of_pool",
            "garbage_past_lengths",
            "nan_in_prefix_k",
        )
    },
    **{
        f"cascade/{n}": cascade_probe
        for n in (
            "prefix_page_out_of_pool",
            "prefix_page_negative",
            "prefix_len_not_whole_pages",
            "prefix_len_over_table",
            "prefix_of_out_of_range",
            "prefix_of_below_minus_one",
            "own_page_out_of_pool",
            "own_len_over_table",
            "garbage_past_lengths",
            "unused_prefix_garbage",
            "nan_in_q",
            "nan_in_prefix_k",
        )
    },
}


def run(probe: str, backend: str, seed: int = 0):
    fn = PROBES[probe]
    out, want_nan, want = fn(probe.split("/", 1)[1], backend, np.random.default_rng(seed))
    to_np = lambda x: np.asarray(jnp.asarray(x, jnp.float32))
    return to_np(out), np.asarray(want_nan), to_np(want)


# Exit status of a probe whose case the backend's supports() refuses on this platform (its
# capability contract; the refusals themselves are tested in test_kernels.py).
NOT_SERVED = 3


def _refused(e: NotImplementedError, backend: str) -> bool:
    """Whether e is the backend contract's refusal of the case (and not another error)."""
    return f"{backend} cannot serve" in str(e)


def _batch(backend: str, directory: str, probes: list[str]) -> None:
    import traceback

    for n, probe in enumerate(probes):
        base = os.path.join(directory, str(n))
        try:
            out, want_nan, want = run(probe, backend)
        except Exception as e:  # noqa: BLE001 - reported by the probe's own test
            if isinstance(e, NotImplementedError) and _refused(e, backend):
                _write(base + ".skip", str(e))
            else:
                _write(base + ".err", traceback.format_exc())
            continue
        np.savez(base + ".tmp.npz", out=out, want_nan=want_nan, want=want)
        os.replace(base + ".tmp.npz", base + ".npz")  # whole or absent


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    if sys.argv[1] == "--batch":
        _batch(sys.argv[2], sys.argv[3], sys.argv[4:])
        sys.exit(0)
    probe, backend, path = sys.argv[1:4]
    try:
        out, want_nan, want = run(probe, backend)
    except NotImplementedError as e:
        if not _refused(e, backend):
            raise
        print(e, file=sys.stderr)
        sys.exit(NOT_SERVED)
    np.savez(path, out=out, want_nan=want_nan, want=want)
