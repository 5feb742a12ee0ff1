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

import zlib  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


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
