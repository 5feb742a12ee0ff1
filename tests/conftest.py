"""Strict JAX for every test, and 8 fake CPU devices for sharding tests."""

import os

# Must happen before jax initialises its backends.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


def pytest_collection_modifyitems(config, items):
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    skip_gpu = pytest.mark.skip(reason="needs a GPU backend")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip_gpu)
