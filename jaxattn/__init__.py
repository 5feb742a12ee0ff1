"""jaxattn: paged / radix KV-cache memory management and paged attention kernels for JAX.

Names are resolved on first use (PEP 562), so the host structures (``jaxattn.radix``,
``jaxattn.paging.BlockManager``) import with numpy alone: a scheduler process that only
manages memory never pays for importing jax.
"""

import importlib

__version__ = "0.1.0"

# Public name -> (module, attribute or None for the module itself).
_LAZY = {
    "backend": ("jaxattn.backend", None),
    "env": ("jaxattn.env", None),
    "kv": ("jaxattn.kv", None),
    "ops": ("jaxattn.ops", None),
    "layout": ("jaxattn.layout", None),
    "paging": ("jaxattn.paging", None),
    "radix": ("jaxattn.radix", None),
    "reference": ("jaxattn.reference", None),
    "copy_blocks": ("jaxattn.kv", "copy_blocks"),
    "write_kv": ("jaxattn.kv", "write_kv"),
    "rope_write_kv": ("jaxattn.kv", "rope_write_kv"),
    "fp8_scales": ("jaxattn.kv", "fp8_scales"),
    "quant": ("jaxattn.quant", None),
    "checked": ("jaxattn.backend", "checked"),
    "BACKENDS": ("jaxattn.ops", "BACKENDS"),
    "available_backends": ("jaxattn.ops", "available_backends"),
    "cascade_attention": ("jaxattn.ops", "cascade_attention"),
    "cascade_pays_off": ("jaxattn.cascade_cost", "cascade_pays_off"),
    "default_implementations": ("jaxattn.ops", "default_implementations"),
    "extend_attention": ("jaxattn.ops", "extend_attention"),
    "merge_states": ("jaxattn.ops", "merge_states"),
    "paged_attention": ("jaxattn.ops", "paged_attention"),
    "prefix_prefill": ("jaxattn.ops", "prefix_prefill"),
}

__all__ = [
    "BACKENDS",
    "available_backends",
    "backend",
    "cascade_attention",
    "cascade_pays_off",
    "checked",
    "copy_blocks",
    "default_implementations",
    "env",
    "extend_attention",
    "fp8_scales",
    "kv",
    "layout",
    "merge_states",
    "ops",
    "paged_attention",
    "paging",
    "prefix_prefill",
    "quant",
    "radix",
    "reference",
    "rope_write_kv",
    "write_kv",
]


def __getattr__(name: str):
    # Any submodule resolves too (``jaxattn.ops``, ``jaxattn.native``...), as it did when
    # this package imported them eagerly.
    module, attr = _LAZY.get(name, (f"jaxattn.{name}", None))
    try:
        value = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise AttributeError(f"module 'jaxattn' has no attribute {name!r}") from None
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted({*globals(), *__all__})
