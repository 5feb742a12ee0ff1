"""Pallas' Triton lowering (``jax.experimental.pallas.triton``), where this JAX has it.

JAX 0.11 deprecates that lowering and announces its removal. The Triton-lowered kernels
(:mod:`.decode`, :mod:`.extend`, :mod:`.cascade`) import it from here, so this package still
imports without it. Their entry points then raise ``NotImplementedError`` (:func:`require`),
which the public ops take as "this backend cannot serve", and ``implementation="pallas"``
routes every op that has a Mosaic GPU kernel to that kernel instead (:func:`missing`).

``JAXATTN_PALLAS_TRITON=0`` makes the lowering count as missing on a JAX that has it: the
Pallas backend then uses the Mosaic GPU kernels alone (no deprecated lowering, none of its
warnings), which is also how the tests check that world on the CPU.
"""

from __future__ import annotations

import jax

from ..env import switched_off

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError as e:  # a JAX without the lowering
    plgpu = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"
else:
    _IMPORT_ERROR = None

ENV = "JAXATTN_PALLAS_TRITON"


def missing() -> str | None:
    """Why the Triton-lowered kernels cannot run here, or None where they can."""
    if _IMPORT_ERROR is not None:
        return (
            f"jax {jax.__version__} has no Pallas Triton lowering "
            f"(jax.experimental.pallas.triton: {_IMPORT_ERROR})"
        )
    if switched_off(ENV):
        return f"the Pallas Triton lowering is switched off (${ENV}=0)"
    return None


def require() -> None:
    """``NotImplementedError`` (:func:`missing`'s reason) where the lowering is missing."""
    if (why := missing()) is not None:
        raise NotImplementedError(
            f"{why}: this Pallas kernel is Triton-lowered; the Mosaic GPU kernels serve "
            "paged decode, prefix prefill and cascade decode without it"
        )
