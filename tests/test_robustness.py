"""The memory-safety and NaN contract (:mod:`jaxattn.reference.validity`), every backend.

Under ``jax.jit`` no index value may make a kernel read or write outside its buffers: a
sequence with an out-of-range page id, kv index, length or indptr gets NaN in all its rows,
every other sequence is exact, and table entries past a length never poison. NaN in q or in
an attended K/V element gives NaN in exactly the rows that read it. The native probes run in
subprocesses (eight to a batch; one that its batch did not finish, alone), so that a crash
fails its test instead of the test process. Also here:
the checked mode, empty inputs, merge_states' NaN rules, and the KV writers' drops.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, make_paged_decode, tol
from jax.experimental import checkify
from robustness_probes import NOT_SERVED, PROBES, run

import jaxattn
from jaxattn import native

HERE = os.path.dirname(os.path.abspath(__file__))
# The directory the jaxattn under test was imported from: the probe process puts it first, so
# that it runs this code and not another copy that an installed package (an editable install
# of another checkout, say) would resolve first from a script's directory.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(jaxattn.__file__)))
NATIVE = native.is_available()


def _probe_env():
    search = [HERE, PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(search))


def _in_subprocess(probe, backend, tmp_path):
    path = tmp_path / "out.npz"
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "robustness_probes.py"), probe, backend, str(path)],
        env=_probe_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode == NOT_SERVED:  # supports() refused the case: the backend's own reason
        pytest.skip(f"{backend}: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, (
        f"probe {probe} on {backend} died (rc {proc.returncode}):\n" + (proc.stderr[-3000:])
    )
    got = np.load(path)
    return got["out"], got["want_nan"], got["want"]


# Native probes run in batches: the sorted probes cut into groups of PROBE_BATCH, each group
# in one subprocess (one import of JAX for all of them) by the first test that needs one of
# its probes, into a directory the xdist workers share; a test of another worker waits for
# the group's `done` marker. A probe that its batch did not finish (a crash, a timeout) runs
# alone in a subprocess of its own, so a crash still fails just its test.
PROBE_BATCH = 8


def _batch_root(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's base lies in one directory per test run: share that one.
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _batched(probe, backend, tmp_path, tmp_path_factory):
    names = sorted(PROBES)
    group = names.index(probe) // PROBE_BATCH
    probes = names[group * PROBE_BATCH : (group + 1) * PROBE_BATCH]
    directory = _batch_root(tmp_path_factory) / f"probes-{backend}-{group}"
    done = directory / "done"
    try:
        directory.mkdir(parents=True)  # atomic: this test runs the group
    except FileExistsError:
        deadline = time.monotonic() + 60 * len(probes) + 30
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    else:
        # On a timeout, what finished is on disk; the rest run alone. The marker is set
        # whatever happens, so that no other worker waits out its deadline.
        try:
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run(
                    [sys.executable, os.path.join(HERE, "robustness_probes.py"), "--batch"]
                    + [backend, str(directory)]
                    + probes,
                    env=_probe_env(),
                    capture_output=True,
                    text=True,
                    timeout=60 * len(probes),
                )
        finally:
            done.touch()
    n = probes.index(probe)
    npz, skip, err = (directory / f"{n}.{ext}" for ext in ("npz", "skip", "err"))
    if npz.exists():
        got = np.load(npz)
        return got["out"], got["want_nan"], got["want"]
    if skip.exists():
        pytest.skip(f"{backend}: {skip.read_text().strip().splitlines()[-1]}")
    if err.exists():
        pytest.fail(f"probe {probe} on {backend} raised:\n{err.read_text()[-3000:]}")
    return _in_subprocess(probe, backend, tmp_path)  # the batch died before it: alone


BACKEND_PARAMS = [
    "reference",
    "pallas",
    pytest.param("native", marks=pytest.mark.skipif(not NATIVE, reason="native not built")),
]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("probe", sorted(PROBES))
def test_contract(probe, backend, tmp_path, tmp_path_factory):
    if backend == "native":
        out, want_nan, want = _batched(probe, backend, tmp_path, tmp_path_factory)
    else:
        out, want_nan, want = run(probe, backend)
    row_nan = np.isnan(out).all(axis=-1)
    any_nan = np.isnan(out).any(axis=-1)
    np.testing.assert_array_equal(any_nan, want_nan, err_msg="NaN where the contract says")
    if not probe.endswith("nan_in_v"):  # a NaN value element reaches only its own element
        np.testing.assert_array_equal(row_nan, want_nan, err_msg="a poisoned row is all NaN")
    keep = ~want_nan
    # The FP8 probes run a bfloat16 q (and output); the others float32.
    t = tol(jnp.bfloat16) if probe.startswith("fp8") else dict(rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out[keep], want[keep], **t)


# --- checked mode -------------------------------------------------------------------------


def test_checked_names_the_argument_and_sequence(rng):
    c = make_paged_decode(rng, [5, 17, 3], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4)
    f = jaxattn.checked(lambda q, k, v, t, s: jaxattn.paged_attention(q, k, v, t, s))
    args = [c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens]
    assert_close(f(*args), jaxattn.reference.paged_attention(*args))
    with pytest.raises(checkify.JaxRuntimeError, match=r"block_tables\[1\] holds a page"):
        f(*args[:3], c.block_tables.at[1, 3].set(-1), c.seq_lens)
    with pytest.raises(checkify.JaxRuntimeError, match=r"seq_lens\[2\] must lie in"):
        f(*args[:4], c.seq_lens.at[2].set(10**4))
    # Inside one's own checkify, per call.
    g = checkify.checkify(
        jax.jit(lambda *a: jaxattn.paged_attention(*a, debug_checks=True, implementation="pallas"))
    )
    err, _ = g(*args[:4], c.seq_lens.at[0].set(-1))
    with pytest.raises(checkify.JaxRuntimeError, match=r"seq_lens\[0\]"):
        err.throw()


def test_checked_extend_names_the_request(rng):
    from helpers import make_extend

    e = make_extend(rng, [3, 0], [2, 4], num_q_heads=4, num_kv_heads=2, head_dim=32)
    f = jaxattn.checked(lambda *a: jaxattn.extend_attention(*a))
    args = [e.q, e.k_pool, e.v_pool, e.qo_indptr, e.kv_indptr, e.kv_indices]
    f(*args)
    with pytest.raises(checkify.JaxRuntimeError, match=r"kv_indices of request 1"):
        f(*args[:5], e.kv_indices.at[6].set(-2))
    with pytest.raises(checkify.JaxRuntimeError, match="qo_indptr must start at 0"):
        f(*args[:3], e.qo_indptr.at[1].set(9), *args[4:])


def test_checked_cascade_names_the_prefix_and_request(rng):
    from helpers import call_cascade, make_cascade

    c = make_cascade(
        rng,
        [3, 2],
        [0, 1, 0, -1],
        [5, 0, 17, 9],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
    )
    f = jaxattn.checked(lambda *a: jaxattn.cascade_attention(*a))
    args = [
        c.q,
        c.k_cache,
        c.v_cache,
        c.prefix_tables,
        c.prefix_lens,
        c.prefix_of,
        c.block_tables,
        c.seq_lens,
    ]
    assert_close(f(*args), call_cascade(jaxattn.reference.cascade_attention, c))

    def swap(i, x):
        return f(*args[:i], x, *args[i + 1 :])

    with pytest.raises(checkify.JaxRuntimeError, match=r"prefix_tables\[1\] holds a page"):
        swap(3, c.prefix_tables.at[1, 1].set(-1))
    with pytest.raises(checkify.JaxRuntimeError, match=r"prefix_lens\[0\] must be a multiple"):
        swap(4, c.prefix_lens.at[0].set(5))
    with pytest.raises(checkify.JaxRuntimeError, match=r"prefix_of\[2\] must lie in \[-1, 2\)"):
        swap(5, c.prefix_of.at[2].set(2))
    with pytest.raises(checkify.JaxRuntimeError, match=r"block_tables\[2\] holds a page"):
        swap(6, c.block_tables.at[2, 4].set(10**5))
    # A prefix nobody continues is never read: its metadata may be anything.
    f(*args[:4], c.prefix_lens.at[1].set(-3), c.prefix_of.at[1].set(-1), *args[6:])
    # Eagerly, the same checks raise ValueError naming the prefix.
    with pytest.raises(ValueError, match=r"prefix_lens\[0\] must be a multiple"):
        jaxattn.cascade_attention(*args[:4], c.prefix_lens.at[0].set(5), *args[5:])
    with pytest.raises(ValueError, match="prefix_of must lie in"):
        jaxattn.cascade_attention(*args[:5], c.prefix_of.at[0].set(7), *args[6:])


# --- empty inputs ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_empty_inputs_agree(rng, backend):
    c = make_paged_decode(rng, [5, 0], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4)
    out = jaxattn.paged_attention(
        c.q[:0], c.k_cache, c.v_cache, c.block_tables[:0], c.seq_lens[:0], implementation=backend
    )
    assert out.shape == (0, 4, 32)
    # A table of width 0 addresses nothing: length 0 gives zeros, any other length is out of
    # range (NaN under jit; eagerly it is a ValueError).
    f = jax.jit(lambda *a: jaxattn.paged_attention(*a, implementation=backend))
    out = f(c.q, c.k_cache, c.v_cache, c.block_tables[:, :0], jnp.array([0, 3], jnp.int32))
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
    assert np.isnan(np.asarray(out[1])).all()
    with pytest.raises(ValueError, match="seq_lens"):
        jaxattn.paged_attention(
            c.q, c.k_cache, c.v_cache, c.block_tables[:, :0], jnp.array([0, 3], jnp.int32)
        )
    q = jnp.zeros((0, 4, 32), jnp.float32)
    pool = jnp.zeros((8, 2, 32), jnp.float32)
    out = jaxattn.extend_attention(
        q,
        pool,
        pool,
        jnp.zeros(2, jnp.int32),
        jnp.zeros(2, jnp.int32),
        jnp.zeros(0, jnp.int32),
        implementation=backend,
    )
    assert out.shape == (0, 4, 32)


def test_merge_states_propagates_nan_and_inf():
    outs = jnp.ones((3, 2, 4))
    lses = jnp.array([[0.0, 0.0], [1.0, jnp.nan], [-jnp.inf, 2.0]])
    out, lse = jaxattn.merge_states(outs, lses)
    assert np.isfinite(np.asarray(out[0])).all() and np.isnan(np.asarray(out[1])).all()
    assert np.isnan(float(lse[1]))
    out, lse = jaxattn.merge_states(outs, lses.at[0, 0].set(jnp.inf))
    assert np.isnan(np.asarray(out[0])).all() and float(lse[0]) == np.inf
    # NaN in a part that has weight poisons; in an empty part (lse -inf) it is ignored.
    out, _ = jaxattn.merge_states(outs.at[2, 0].set(jnp.nan), lses)
    assert np.isfinite(np.asarray(out[0])).all()
    out, _ = jaxattn.merge_states(outs.at[0, 0].set(jnp.nan), lses)
    assert np.isnan(np.asarray(out[0])).all()
    out, lse = jaxattn.merge_states(jnp.zeros((0, 2, 4)), jnp.zeros((0, 2)))
    assert out.shape == (2, 4) and (np.asarray(lse) == -np.inf).all()


# --- the KV writers drop what is out of range ---------------------------------------------------


@pytest.mark.parametrize(
    "implementation",
    [
        "reference",
        pytest.param(
            "native", marks=pytest.mark.skipif(not NATIVE, reason="native library not built")
        ),
    ],
)
def test_writers_drop_out_of_range(implementation):
    k = jnp.zeros((4, 2, 2, 8))  # bshd: 4 pages of 2 slots
    new = jnp.ones((3, 2, 8))
    write = jax.jit(jaxattn.write_kv, static_argnames="implementation")
    kc, vc = write(k, k, new, new, jnp.array([1, 8, -1], jnp.int32), implementation=implementation)
    assert float(kc.sum()) == 16.0  # only slot 1 written; 8 (past the pool) and -1 dropped
    assert float(kc[0, 1].sum()) == 16.0
    k = k.at[3].set(5.0)
    kc, _ = jax.jit(jaxattn.copy_blocks)(
        k, k, jnp.array([3, 9, -1], jnp.int32), jnp.array([0, 1, 2], jnp.int32)
    )
    # 3 -> 0 copied; a source outside the pool is dropped, never clamped to the last page.
    assert float(kc[0].sum()) == float(k[3].sum()) and float(kc[1].sum()) == 0.0
    assert float(kc[2].sum()) == 0.0
