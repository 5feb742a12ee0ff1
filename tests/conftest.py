"""Strict JAX for every test, and 8 fake CPU devices for sharding tests."""

import os

# Must happen before jax initialises its backends.
_flags = ["--xla_force_host_platform_device_count=8"]
# Without a GPU the suite is dominated by compiling small CPU programs (the Pallas
# interpreter above all); skipping LLVM's optimisations halves that and changes no result.
if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd")):
    _flags.append("--xla_backend_optimization_level=0")
for _flag in _flags:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import gc  # noqa: E402
import inspect  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import zlib  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

# One XLA compilation cache for the run, shared by the xdist workers: a program one worker
# compiled, the other loads instead of compiling it again, and a test that builds a new jit
# of a program compiled before loads it too. Compiling small CPU programs is most of the
# suite's time; the cache cut a 2-worker run of test_ops + test_robustness from 186 s to
# 116 s. The first process to load this file (xdist's controller) makes the directory and
# hands it to the workers through the environment, and removes it at the end;
# $JAXATTN_TEST_XLA_CACHE_DIR set beforehand names a directory to keep and reuse, and
# JAXATTN_TEST_XLA_CACHE=0 turns the cache off.
_CACHE_DIR, _CACHE_OWNED = None, False
if os.environ.get("JAXATTN_TEST_XLA_CACHE", "1") != "0":
    _CACHE_DIR = os.environ.get("JAXATTN_TEST_XLA_CACHE_DIR")
    if not _CACHE_DIR:
        _CACHE_DIR = tempfile.mkdtemp(prefix="jaxattn-test-xla-cache-")
        os.environ["JAXATTN_TEST_XLA_CACHE_DIR"] = _CACHE_DIR
        _CACHE_OWNED = True
    jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_sessionfinish(session):
    if _CACHE_OWNED:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)


# Pallas' interpret mode runs a kernel of several threads (a Mosaic GPU kernel's warpgroups:
# the decode's copy warpgroup, the warp-specialised prefill's three) as one program per
# thread, started by a callback at every block of the grid. jax 0.10's
# thread_map._run_jaxpr builds that program with a new jax.jit of a new closure each time,
# so every block traces, lowers and compiles (or loads from the cache above) the same
# program again, though its comment expects "JAX's caches" to compile it once: ~1.5 s a
# block and thread on this CPU, against 0.1-0.2 s to run it (test_fp8_caches' copy
# warpgroup case: 19 s a call, 3 s compiled once). Compiled once here instead, per traced
# program: the same program, run with the same arguments, so every result is the same.
# Compiled explicitly, not by calling one shared jax.jit from the threads: that hung here
# (the threads' first calls of it wait for one another, it seems, while the kernel's
# barriers wait for every thread). Left alone where thread_map has another shape;
# JAXATTN_TEST_INTERPRET_COMPILE_ONCE=0 turns it off.
_THREAD_PROGRAMS: dict = {}


def _compile_thread_programs_once():
    try:
        from jax._src import core as jax_core
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:  # pragma: no cover - another jax
        return
    original = getattr(thread_map, "_run_jaxpr", None)
    if original is None or list(inspect.signature(original).parameters) != [
        "jaxpr",
        "consts",
        "args",
    ]:
        return
    lock = threading.Lock()

    def run(jaxpr, consts, *args):
        jax_core.eval_jaxpr(jaxpr, consts, *args)

    def run_jaxpr(jaxpr, consts, *args):
        with lock:  # the threads of a block ask at once; one compiles
            compiled = _THREAD_PROGRAMS.get(jaxpr)
            if compiled is None:
                traced = jax.jit(run, static_argnums=(0,)).trace(jaxpr, consts, *args)
                compiled = _THREAD_PROGRAMS[jaxpr] = traced.lower().compile()
        compiled(consts, *args)

    thread_map._run_jaxpr = run_jaxpr


if os.environ.get("JAXATTN_TEST_INTERPRET_COMPILE_ONCE", "1") != "0":
    _compile_thread_programs_once()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program when a test module ends (jax.clear_caches; the
    persistent cache above keeps them for a later compile). Each CPU executable holds
    memory mappings of its own: an xdist worker that kept all of the suite's passed
    Linux's limit of 65530 mappings a process (vm.max_map_count) late in the run, and XLA's
    compiler then crashed with a segmentation fault (6014 mappings after one minute of
    tests/test_pallas_mgpu_cascade.py alone)."""
    yield
    _THREAD_PROGRAMS.clear()
    jax.clear_caches()
    gc.collect()


def pytest_collection_modifyitems(config, items):
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    skip_gpu = pytest.mark.skip(reason="needs a GPU backend")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip_gpu)


@pytest.fixture
def rng(request):
    """A generator seeded from the test's id: fresh data per case, reproducible per case."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def set_env(monkeypatch):
    """``set_env(NAME=value, ...)`` sets environment variables and re-reads jaxattn's
    overrides (:mod:`jaxattn.env`); both are restored after the test."""
    import jaxattn.env

    def set_(**values):
        for name, value in values.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        return jaxattn.env.refresh()

    yield set_
    monkeypatch.undo()
    jaxattn.env.refresh()
