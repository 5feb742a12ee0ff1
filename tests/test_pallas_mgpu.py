"""The Mosaic GPU paged decode (jaxattn.pallas.decode_mgpu) in Mosaic GPU's interpret mode on
the CPU, against the reference: layouts, dtypes, GQA groups, partitions, empty sequences, NaN
in every slot it must not read, the memory-safety contract, refusals. Interpret mode runs its
two products as jnp.dot (see the module); the kernel's barriers, TMA page copies, masks,
online softmax and merge are what these cases check. Skipped where this JAX has no Mosaic GPU
interpret mode; on a GPU the same cases run in interpret mode too (interpret=True) until the
kernel is checked compiled there.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close

import jaxattn
from jaxattn import layout as L
from jaxattn.pallas import decode_mgpu

if decode_mgpu.available() is not None:
    pytest.skip(decode_mgpu.available(), allow_module_level=True)


def poisoned_case(seed, *, batch, hq, hkv, d, page, pages, width, lens, layout, dtype):
    """q, caches, tables: NaN in every pool slot no sequence reads (pages no table names,
    the tails of last pages) and table columns past each sequence naming a NaN page."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, hq, d)), dtype)
    k = rng.standard_normal((pages, page, hkv, d)).astype(np.float32)
    v = rng.standard_normal((pages, page, hkv, d)).astype(np.float32)
    order = rng.permutation(pages)
    tables = np.zeros((batch, width), np.int32)
    used, at = set(), 0
    for b, n in enumerate(lens):
        need = -(-n // page)
        tables[b, :need] = order[at : at + need]
        at += need
        for j in range(need):
            used.add(int(tables[b, j]))
            tail = n - j * page
            if tail < page:
                k[tables[b, j], tail:] = np.nan
                v[tables[b, j], tail:] = np.nan
    spare = [p for p in range(pages) if p not in used]
    for b, n in enumerate(lens):
        tables[b, -(-n // page) :] = spare[b % len(spare)]
    for p in spare:
        k[p] = np.nan
        v[p] = np.nan
    k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    if layout == "bhsd":
        k, v = L.convert(k, v, "bshd", "bhsd")
    return q, k, v, jnp.asarray(tables), jnp.asarray(lens, jnp.int32)


def reference(q, k, v, tables, lens, **kw):
    return jaxattn.paged_attention(q, k, v, tables, lens, implementation="reference", **kw)


CASES = [
    # layout, dtype, hq/hkv, d, page, lens, partition_pages
    ("bshd", jnp.bfloat16, (8, 2), 64, 16, [70, 0, 160], 4),
    ("bhsd", jnp.float16, (8, 8), 64, 8, [1, 33, 64], 8),
    ("bshd", jnp.bfloat16, (16, 2), 128, 16, [129, 5], 8),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference_with_unread_slots_poisoned(case):
    layout, dtype, (hq, hkv), d, page, lens, part = CASES[case]
    width = 12
    q, k, v, tables, lens = poisoned_case(
        case,
        batch=len(lens),
        hq=hq,
        hkv=hkv,
        d=d,
        page=page,
        pages=40,
        width=width,
        lens=lens,
        layout=layout,
        dtype=dtype,
    )
    out = decode_mgpu.paged_attention(
        q, k, v, tables, lens, layout=layout, partition_pages=part, interpret=True
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, reference(q, k, v, tables, lens, layout=layout))


def test_soft_cap_and_scale():
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
    out = decode_mgpu.paged_attention(q, k, v, tables, lens, interpret=True, **kw)
    assert_close(out, reference(q, k, v, tables, lens, **kw))


def test_memory_safety_contract():
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
    out = np.asarray(decode_mgpu.paged_attention(q, k, v, tables, lens, interpret=True), np.float32)
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
