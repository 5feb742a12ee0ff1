"""Environment-variable overrides of the backends' default configurations, read in one place.

* ``JAXATTN_PARTITION_SIZE``: tokens per split-KV partition of the native decode kernel when
  the call gives no ``partition_size`` and no ``config`` (a positive integer);
* ``JAXATTN_PREFILL_KERNEL``: the native GPU prefill kernel, ``auto`` (default), ``sm90``
  (Hopper wgmma), ``mma`` (mma.sync), ``simt`` or ``sm90_persistent`` (the Hopper kernel, one
  block per multiprocessor looping over the tiles);
* ``JAXATTN_DECODE_COPIES``: how the native GPU decode copies K/V pages, ``auto`` (default:
  the tensor memory accelerator where it serves and pays, else row gathers), ``gathers`` or
  ``tma`` (the tensor memory accelerator wherever it serves) (``native.DecodeConfig.copies``).

The variables only change which configuration a backend's heuristic returns; the chosen
values travel as the kernels' static attributes (``partition_size``, ``kernel``, ``copies`` of
the FFI calls), so they are part of the lowered program and of any compilation cache key. They are
read once per process (:func:`overrides`); :func:`refresh` reads them again (tests).
An explicit ``config=`` or ``partition_size=`` always wins over them.
"""

from __future__ import annotations

import dataclasses
import functools
import os

PARTITION_SIZE = "JAXATTN_PARTITION_SIZE"
PREFILL_KERNEL = "JAXATTN_PREFILL_KERNEL"
PREFILL_KERNELS = ("auto", "sm90", "mma", "simt", "sm90_persistent")
DECODE_COPIES = "JAXATTN_DECODE_COPIES"
DECODE_COPY_MODES = ("auto", "gathers", "tma")


@dataclasses.dataclass(frozen=True)
class Overrides:
    partition_size: int | None = None
    prefill_kernel: str | None = None
    decode_copies: str | None = None


@functools.cache
def overrides() -> Overrides:
    """The overrides set in the environment (``ValueError`` naming a malformed one)."""
    size = os.environ.get(PARTITION_SIZE, "").strip()
    partition_size = None
    if size:
        try:
            partition_size = int(size)
        except ValueError:
            partition_size = 0
        if partition_size <= 0:
            raise ValueError(f"{PARTITION_SIZE} must be a positive integer, got {size!r}")
    kernel = os.environ.get(PREFILL_KERNEL, "").strip().lower() or None
    if kernel is not None and kernel not in PREFILL_KERNELS:
        raise ValueError(f"{PREFILL_KERNEL} must be one of {PREFILL_KERNELS}, got {kernel!r}")
    copies = os.environ.get(DECODE_COPIES, "").strip().lower() or None
    if copies is not None and copies not in DECODE_COPY_MODES:
        raise ValueError(f"{DECODE_COPIES} must be one of {DECODE_COPY_MODES}, got {copies!r}")
    return Overrides(partition_size, kernel, copies)


OFF = ("0", "false", "no", "off")


def switched_off(name: str) -> bool:
    """Whether the environment variable ``name`` switches something off (``0``, ``false``,
    ``no`` or ``off``, any case); read at each call, so a switch read when a kernel is traced
    follows the environment of that trace (``JAXATTN_PALLAS_TRITON``, ``JAXATTN_MGPU_PDL``)."""
    return os.environ.get(name, "").strip().lower() in OFF


def refresh() -> Overrides:
    """Read the environment again (after a change) and return the new overrides."""
    overrides.cache_clear()
    return overrides()
