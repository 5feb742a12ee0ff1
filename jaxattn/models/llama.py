"""A Llama-style decoder in plain JAX that attends through the public ops.

RMSNorm, RoPE (rotate-half, configurable theta, optional linear / llama3 scaling), GQA
attention, SwiGLU MLP, tied or untied embeddings. Three forward passes share one layer
body:

* :func:`forward_dense` - no cache, plain causal attention over ``[B, S]`` tokens: the
  correctness oracle that every cached path is compared against;
* :func:`forward_extend` - a packed batch of requests, each computing new tokens after a
  prefix whose KV is already cached (prefill, chunked prefill, prefix-cache hits): writes
  the new K/V into the paged pool, then ``extend_attention`` (or ``prefix_prefill``);
* :func:`forward_decode` - one new token per sequence: ``write_kv`` then
  ``paged_attention``.

Parameters are a dict pytree whose per-layer weights are stacked on a leading layer axis,
so the layers run as one ``lax.scan``: one compiled layer body whatever the depth. Linear
weights are stored ``[in, out]`` (Hugging Face stores ``[out, in]``).

KV cache: one K and one V array for all layers, each a paged cache in ``layout`` with
``num_layers * num_pages`` pages; layer ``l`` owns pages ``[l * num_pages, (l + 1) *
num_pages)``. Host code (block tables, slot mappings, radix indices) speaks layer-0 page
ids and slots; each layer adds its offset inside the scan. The whole pool is therefore one
pair of arrays carried through the scan and updated by scatters, which XLA performs in
place when the caller donates the caches; no per-layer slice of the pool is ever copied.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import pathlib
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import layout as _layout
from jaxattn import ops
from jaxattn.kv import rope_write_kv, rotate_half, write_kv

__all__ = [
    "DecodeBatch",
    "ExtendBatch",
    "LlamaConfig",
    "apply_rope",
    "config_from_hf",
    "config_to_hf",
    "dense_kv",
    "forward_decode",
    "forward_dense",
    "forward_extend",
    "init_kv_cache",
    "init_params",
    "lm_head",
    "load_checkpoint",
    "params_from_hf",
    "params_to_hf",
    "rms_norm",
    "rope_frequencies",
    "save_checkpoint",
    "serving_params",
    "split_k_count",
    "xla_split_k",
]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_HF_DTYPE_NAMES = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16"}
_ROPE_TYPES = ("default", "linear", "llama3")
_HI = jax.lax.Precision.HIGHEST


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Model shape and numerics (hashable: jitted functions take it as a static argument).

    ``head_dim=0`` means ``hidden_size // num_attention_heads``. ``rope_scaling`` is a
    Hugging Face ``rope_scaling`` dict (stored as sorted items). ``eos_token_id`` is an
    int, a sequence of ints or None (stored as a tuple). ``dtype`` names the parameter,
    activation and (unless the cache is given another, e.g. FP8) KV cache dtype.
    """

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple | dict | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    eos_token_id: tuple | int | None = ()
    bos_token_id: int | None = None
    dtype: str = "float32"

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            set_(name, _positive_int(name, getattr(self, name)))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim in (0, None):
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} must be a multiple of "
                    f"num_attention_heads={self.num_attention_heads} when head_dim is not given"
                )
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        set_("head_dim", _positive_int("head_dim", self.head_dim))
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
            set_(name, float(value))
        set_("dtype", _HF_DTYPE_NAMES.get(str(self.dtype), str(self.dtype)))
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {self.dtype!r}")
        eos = self.eos_token_id
        if eos is None:
            eos = ()
        elif isinstance(eos, numbers.Integral):
            eos = (eos,)
        eos = tuple(eos)
        if not all(isinstance(e, numbers.Integral) and 0 <= e < self.vocab_size for e in eos):
            raise ValueError(f"eos_token_id must be token ids below vocab_size, got {eos!r}")
        set_("eos_token_id", tuple(int(e) for e in eos))
        scaling = self.rope_scaling
        if isinstance(scaling, dict):
            scaling = tuple(sorted(scaling.items()))
        if scaling is not None:
            kind = dict(scaling).get("rope_type", dict(scaling).get("type", "default"))
            if kind not in _ROPE_TYPES:
                raise ValueError(f"rope_scaling type must be one of {_ROPE_TYPES}, got {kind!r}")
        set_("rope_scaling", scaling)
        set_("tie_word_embeddings", bool(self.tie_word_embeddings))

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_bytes_per_token(self, kv_dtype=None) -> int:
        """Bytes of K and V one token occupies in the pool, over all layers, in a pool of
        ``kv_dtype`` (None: the model's dtype; e.g. ``jnp.float8_e4m3fn`` for an FP8 pool)."""
        itemsize = np.dtype(self.jnp_dtype if kv_dtype is None else kv_dtype).itemsize
        return 2 * self.num_hidden_layers * self.kv_size * itemsize

    # The serving engine's model protocol (jaxattn.engine.CausalLM): the config names the
    # model, and these bind it to the module's functions.

    def init_kv_cache(self, num_pages: int, page_size: int, *, layout: str = "bshd", dtype=None):
        """:func:`init_kv_cache` of this model."""
        return init_kv_cache(self, num_pages, page_size, layout=layout, dtype=dtype)

    def serving_params(self, params: dict, *, shards: int = 1, unroll: bool = True) -> dict:
        """:func:`serving_params` of this model."""
        return serving_params(self, params, shards=shards, unroll=unroll)

    def forward_extend(self, params, k_cache, v_cache, batch, **options):
        """:func:`forward_extend` of this model."""
        return forward_extend(params, self, k_cache, v_cache, batch, **options)

    def forward_decode(self, params, k_cache, v_cache, batch, **options):
        """:func:`forward_decode` of this model."""
        return forward_decode(params, self, k_cache, v_cache, batch, **options)


# --- parameters ----------------------------------------------------------------------


def init_params(cfg: LlamaConfig, key) -> dict:
    """Random parameters with unit-scale activations and O(1) logits.

    Embeddings are N(0, 1) and every linear weight N(0, 1/fan_in), so that a random model
    has well separated logits (greedy decoding is not a coin toss between near-ties).
    The weights are a deterministic function of ``key`` (a JAX PRNG key), drawn on the
    host with numpy: drawing them with ``jax.random`` compiles one program per shape,
    which costs more than everything else in a small CPU run.
    """
    if not isinstance(cfg, LlamaConfig):
        raise TypeError(f"cfg must be a LlamaConfig, got {type(cfg).__name__}")
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    rng = np.random.default_rng(np.asarray(key, np.uint32).ravel().tolist())
    dt = cfg.jnp_dtype
    n, h, i, v = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size

    def normal(shape, fan_in):
        # Row by row, so that a large model needs no float32 copy of a whole tensor.
        out = np.empty(shape, np.dtype(dt))
        scale = np.float32(1 / math.sqrt(fan_in))
        for i in range(shape[0]):
            out[i] = rng.standard_normal(shape[1:], dtype=np.float32) * scale
        return jnp.asarray(out)

    params = {
        "embed": normal((v, h), 1),
        "layers": {
            "attn_norm": jnp.ones((n, h), dt),
            "wq": normal((n, h, cfg.q_size), h),
            "wk": normal((n, h, cfg.kv_size), h),
            "wv": normal((n, h, cfg.kv_size), h),
            "wo": normal((n, cfg.q_size, h), cfg.q_size),
            "mlp_norm": jnp.ones((n, h), dt),
            "w_gate": normal((n, h, i), h),
            "w_up": normal((n, h, i), h),
            "w_down": normal((n, i, h), i),
        },
        "norm": jnp.ones((h,), dt),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = normal((h, v), h)
    return params


def init_kv_cache(
    cfg: LlamaConfig, num_pages: int, page_size: int, *, layout: str = "bshd", dtype=None
):
    """Zeroed ``(k_cache, v_cache)`` holding ``num_pages`` pages per layer (see module doc),
    of ``dtype`` (None: the model's dtype; an FP8 dtype for a quantised pool, whose scales
    the batches carry: :class:`ExtendBatch` / :class:`DecodeBatch` ``k_scale``)."""
    num_pages = _positive_int("num_pages", num_pages)
    page_size = _positive_int("page_size", page_size)
    total = cfg.num_hidden_layers * num_pages
    dt = cfg.jnp_dtype if dtype is None else np.dtype(dtype)
    shape = lambda kind: _layout.cache_shape(
        layout, kind, total, page_size, cfg.num_key_value_heads, cfg.head_dim, dt
    )
    return jnp.zeros(shape("k"), dt), jnp.zeros(shape("v"), dt)


# --- building blocks -----------------------------------------------------------------


def rms_norm(x, weight, eps: float):
    """RMSNorm computed in float32; the weight multiplies after the cast back (as in HF)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype) * weight.reshape((1,) * (x.ndim - 1) + weight.shape)


def rope_frequencies(cfg: LlamaConfig) -> np.ndarray:
    """float32 ``[head_dim // 2]`` inverse frequencies, with HF's rope scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    scaling = dict(cfg.rope_scaling or ())
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def apply_rope(x, positions, inv_freq):
    """Rotate-half RoPE. x ``[T, H, D]``, positions ``i32[T]``, inv_freq ``f32[D // 2]``."""
    return _rotate(x, *_rope_table(positions, inv_freq))


def _native_linear(x, w, out_dtype):
    """:func:`jaxattn.native.linear` where it serves ``x [m, k] @ w [k, n]`` faster than
    XLA (up to :data:`jaxattn.native.LINEAR_DECODE_ROWS` rows), else None."""
    from jaxattn import native

    if x.shape[0] > native.LINEAR_DECODE_ROWS or native.linear_unsupported(x, w) is not None:
        return None
    return native.linear(x, w, out_dtype=out_dtype)


def _padded_linear(x, w, out_dtype):
    """XLA's dot with a one-row x padded to two rows, else None (XLA's dot as it is). On an
    H200 XLA lowers a one-row projection to a GEMV that reads the weights at about half the
    read ceiling, and two rows to a GEMM near it: the 1B model's decode step took 1.611 ms of
    device time at one row and 1.079 at two."""
    if x.shape[0] != 1:
        return None
    return _dot(jnp.concatenate([x, jnp.zeros_like(x)]), w, out_dtype)[:1]


def _dot(x, w, out_dtype):
    """XLA's ``x [T, in] @ w [in, ...] -> [T, ...]``, float32 sums, in ``out_dtype``."""
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32).astype(out_dtype)


# Weights up to this size take the native kernel under "hybrid" (the 1B model's QKV, 12.6
# MB, and output, 8.4 MB; not its MLP, 33.5 and 67 MB).
HYBRID_NATIVE_MAX_BYTES = 16 << 20


def _hybrid_linear(x, w, out_dtype):
    """:func:`_native_linear` for the small projections (weights up to
    :data:`HYBRID_NATIVE_MAX_BYTES`), :func:`_padded_linear` for the rest. On an H200 the native
    kernel ran the 1B model's one-row QKV and output projections in 7.9 / 7.8 us against 10.7
    / 9.0 for the padded XLA dot, and XLA was the faster on the MLP (round 7-8 profiles); the
    whole step with this choice has not been timed yet."""
    if w.size * w.dtype.itemsize <= HYBRID_NATIVE_MAX_BYTES:
        out = _native_linear(x, w, out_dtype)
        if out is not None:
            return out
    return _padded_linear(x, w, out_dtype)


def split_k_count(k: int, split_k) -> int:
    """Partial sums for a projection contracting over ``k`` under an int ``split_k`` n: the
    largest power of two up to n that divides ``k`` (1 for None / False)."""
    if split_k is None or split_k is False:
        return 1
    s = 1
    while s * 2 <= int(split_k) and k % (s * 2) == 0:
        s *= 2
    return s


@functools.cache
def xla_split_k(m: int, k: int, n: int, dtype: str, device=None) -> int:
    """How many partial sums XLA's compiler splits ``x [m, k] @ w [k, n]`` (float32 sums, in
    ``dtype``) into on ``device`` (default: the default backend's first device): the ``S``
    of the ``f32[S, m, n]`` GEMM in the optimised program, 1 where it does not split (the
    CPU, cuBLAS GEMMs) or the program says nothing. Compiled once per shape and device.
    ``split_k=True`` splits a projection as XLA would, so that only the reduction moves."""
    dev = jax.devices()[0] if device is None else device
    sharding = jax.sharding.SingleDeviceSharding(dev)
    x = jax.ShapeDtypeStruct((m, k), dtype, sharding=sharding)
    w = jax.ShapeDtypeStruct((k, n), dtype, sharding=sharding)
    try:
        text = jax.jit(_dot, static_argnums=2).lower(x, w, np.dtype(dtype)).compile().as_text()
    except Exception:  # noqa: BLE001 (a probe: no answer is "no split")
        return 1
    found = re.search(rf"= f32\[(\d+),{m},{n}\]", text)
    return int(found.group(1)) if found else 1


def _partial_linear(x, w, splits: int):
    """``x [T, K] @ w [K, ...]`` split along K into ``splits`` float32 partial sums
    ``[splits, T, ...]``: a split-K GEMM without its reduction (one batched dot), for a
    native kernel that sums them as it loads them (:func:`jaxattn.rope_write_kv`,
    :func:`jaxattn.native.add_rms_norm`)."""
    t, k = x.shape
    xs = x.reshape(t, splits, k // splits)
    ws = w.reshape(splits, k // splits, -1)
    dims = (((2,), (1,)), ((1,), (0,)))
    out = jax.lax.dot_general(xs, ws, dims, preferred_element_type=jnp.float32)
    return out.reshape(splits, t, *w.shape[1:])


# Who runs a projection (a model option, chosen by the engine): None -> XLA's dot.
_LINEAR = {
    None: None,
    "xla": None,
    "pad": _padded_linear,
    "native": _native_linear,
    "hybrid": _hybrid_linear,
}


def _linear(x, w, matmul=None, out_dtype=None):
    """``x [T, in] @ w [in, ...]`` with float32 sums, in ``out_dtype`` (x's by default);
    ``matmul(x2, w2, out_dtype)`` (:data:`_LINEAR`) takes it when it serves the 2-D form."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if matmul is not None:
        out = matmul(x, w.reshape(w.shape[0], -1), out_dtype)
        if out is not None:
            return out.reshape(x.shape[0], *w.shape[1:])
    return _dot(x, w, out_dtype)


def lm_head(params: dict, cfg: LlamaConfig, h, matmul=None):
    """float32 logits ``[..., vocab]`` of final-normed hidden states."""
    if cfg.tie_word_embeddings:
        return jnp.dot(h, params["embed"].T, preferred_element_type=jnp.float32)
    return _linear(h, params["lm_head"], matmul, jnp.float32)


def _rope_table(positions, inv_freq):
    """(cos, sin) ``f32[T, 1, D // 2]`` of every position, shared by all layers."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]


def _rotate(x, cos, sin):
    """:func:`jaxattn.kv.rotate_half` with the tables of :func:`_rope_table`."""
    return rotate_half(x, cos[:, 0], sin[:, 0])


def serving_params(cfg: LlamaConfig, params: dict, *, shards: int = 1, unroll: bool = True) -> dict:
    """The parameters as the serving engine runs them: with the projections that read the
    same input fused, and (``unroll``) one dict of weights per layer.

    * Straight-line layers (``unroll=True``, ``params["layers"]`` a tuple): over stacked
      ``[num_layers, ...]`` weights a ``lax.scan`` slices one layer per iteration, and on
      GPUs XLA materialises each slice that feeds a GEMM as a copy, so every step would
      move the weights three times (read, write, read) in a pass bound by reading them
      once. The price is compile time, which grows with the depth; ``unroll=False`` keeps
      the stacked form and the scan (one compiled layer body).
    * Fused projections (vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear``):
      ``wqkv`` ``[hidden, shards, (q + 2 kv) / shards]`` and ``w_gate_up`` ``[hidden,
      shards, 2 intermediate / shards]``, one GEMM each instead of three and two: fewer
      kernels per layer, and no GEMM as narrow as one K or V projection, in a decode step
      whose many small kernels otherwise cost as much as its weight reads.

    ``shards``: the tensor-parallel split of the output features: each of the ``shards``
    blocks holds that device's q, k and v heads (gate and up columns) side by side, so the
    fused weight splits over the mesh like the unfused ones (shard the unfused parameters
    first, then call this). Split parameters are returned as they are.
    """
    layers = params["layers"]
    if isinstance(layers, list | tuple):
        if len(layers) != cfg.num_hidden_layers:
            raise ValueError(f"params has {len(layers)} layers, the config {cfg.num_hidden_layers}")
        return params
    if "wqkv" in layers:
        return params
    n = cfg.num_hidden_layers
    for name, w in layers.items():
        if w.shape[0] != n:
            raise ValueError(f"params['layers'][{name!r}] has {w.shape[0]} layers, not {n}")
    for name, size in (
        ("num_attention_heads", cfg.num_attention_heads),
        ("num_key_value_heads", cfg.num_key_value_heads),
        ("intermediate_size", cfg.intermediate_size),
    ):
        if size % shards:
            raise ValueError(f"{name}={size} is not a multiple of shards={shards}")

    def fuse(*ws):
        # [L, in, out_i] -> [L, in, shards, sum(out_i) / shards], each shard its parts.
        return jnp.concatenate([w.reshape(*w.shape[:2], shards, -1) for w in ws], axis=-1)

    wqkv = fuse(layers["wq"], layers["wk"], layers["wv"])
    w_gate_up = fuse(layers["w_gate"], layers["w_up"])
    if not unroll:
        fused = {k: layers[k] for k in ("attn_norm", "wo", "mlp_norm", "w_down")}
        return dict(params, layers=dict(fused, wqkv=wqkv, w_gate_up=w_gate_up))
    split = tuple(
        {
            "attn_norm": layers["attn_norm"][i],
            "wqkv": wqkv[i],
            "wo": layers["wo"][i],
            "mlp_norm": layers["mlp_norm"][i],
            "w_gate_up": w_gate_up[i],
            "w_down": layers["w_down"][i],
        }
        for i in range(n)
    )
    return dict(params, layers=split)


def _decoder(
    params: dict,
    cfg: LlamaConfig,
    tokens,
    positions,
    attend,
    state,
    matmul=None,
    rope_write=None,
    add_norm=None,
    split_k=None,
):
    """Run every layer on the token-major batch; return (final-normed hidden, state).

    ``attend(q, k, v, layer, state) -> (out [T, Hq, D], state)`` is the only thing that
    differs between the dense and the cached forward passes. Stacked layer weights run as
    one ``lax.scan`` (one compiled layer body whatever the depth); split ones
    (:func:`serving_params`) as straight-line code with a Python int ``layer``.
    ``matmul``: who runs the projections (:func:`_linear`). ``rope_write(qkv [T, Hq + 2 Hkv,
    D], cos, sin f32 [T, D // 2], layer, state) -> (q, state)``, with the fused projection
    (:func:`serving_params`): rotates and stores the new K/V itself
    (:func:`jaxattn.kv.rope_write_kv`), and ``attend`` is then called with k and v None.
    ``add_norm(x, d, w) -> (x + d, rms_norm(x + d, w))`` (straight-line layers only): each
    residual add and the norm that follows it in one call (:func:`jaxattn.native.add_rms_norm`).
    ``split_k`` (True: :func:`xla_split_k`, XLA's own split; an int: :func:`split_k_count`;
    XLA's dot only): the projections that feed those two (QKV into ``rope_write``; output
    and down into ``add_norm``) hand them float32 split-K partial sums ``[S, T, ...]``,
    which they sum as they load them, instead of a GEMM whose partials XLA reduces in a
    kernel of its own before the native call.
    """
    t = tokens.shape[0]
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cos, sin = _rope_table(positions, jnp.asarray(rope_frequencies(cfg)))
    eps = cfg.rms_norm_eps
    x = params["embed"][tokens]

    def partials(w):
        """Split-K partial sums for a projection of weight w, or 0 for none (also for one
        row: a one-row step is not split, and with ``linear="pad"`` is padded as before)."""
        if split_k in (None, False) or matmul not in (None, _padded_linear) or t == 1:
            return 0
        k, n = w.shape[0], math.prod(w.shape[1:])
        if split_k is True:
            s = xla_split_k(t, k, n, np.dtype(w.dtype).name)
        else:
            s = split_k_count(k, split_k)
        return s if s > 1 else 0

    def attention_block(h, layer, state, lp, out_partials=0):
        """The attention half of a layer on normed rows h: its output projection (or its
        ``out_partials`` split-K partial sums), state."""
        if rope_write is not None:
            shards = getattr(rope_write, "shards", 1)
            if "wqkv" not in lp or lp["wqkv"].shape[1] != shards:
                raise ValueError(
                    "rotating and storing K/V in one pass needs the fused q|k|v projection "
                    f"split as the kernels are (serving_params with shards={shards})"
                )
            splits = partials(lp["wqkv"])
            if splits:
                qkv = _partial_linear(h, lp["wqkv"], splits).reshape(splits, t, hq + 2 * hkv, d)
            else:
                qkv = _linear(h, lp["wqkv"], matmul).reshape(t, hq + 2 * hkv, d)
            q, state = rope_write(qkv, cos[:, 0], sin[:, 0], layer, state, dtype=h.dtype)
            o, state = attend(q, None, None, layer, state)
        else:
            if "wqkv" in lp:  # fused (serving_params): each shard's q, k, v side by side
                shards = lp["wqkv"].shape[1]
                q, k, v = jnp.split(
                    _linear(h, lp["wqkv"], matmul),
                    [cfg.q_size // shards, (cfg.q_size + cfg.kv_size) // shards],
                    -1,
                )
                q, k, v = q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
            else:
                q = _linear(h, lp["wq"], matmul).reshape(t, hq, d)
                k = _linear(h, lp["wk"], matmul).reshape(t, hkv, d)
                v = _linear(h, lp["wv"], matmul).reshape(t, hkv, d)
            o, state = attend(_rotate(q, cos, sin), _rotate(k, cos, sin), v, layer, state)
        o = o.astype(h.dtype).reshape(t, hq * d)
        if out_partials:
            return _partial_linear(o, lp["wo"], out_partials), state
        return _linear(o, lp["wo"], matmul), state

    def mlp_block(h, lp, out_partials=0):
        if "w_gate_up" in lp:
            gate, up = jnp.split(_linear(h, lp["w_gate_up"], matmul), 2, -1)
            act = (jax.nn.silu(gate) * up).reshape(t, cfg.intermediate_size)
        else:
            act = jax.nn.silu(_linear(h, lp["w_gate"], matmul)) * _linear(h, lp["w_up"], matmul)
        if out_partials:
            return _partial_linear(act, lp["w_down"], out_partials)
        return _linear(act, lp["w_down"], matmul)

    def layer_body(x, layer, state, lp):
        a, state = attention_block(rms_norm(x, lp["attn_norm"], eps), layer, state, lp)
        x = x + a
        x = x + mlp_block(rms_norm(x, lp["mlp_norm"], eps), lp)
        return x, state

    layers = params["layers"]
    if isinstance(layers, list | tuple) and add_norm is not None:
        # Each residual add and the norm after it in one call; the next layer's (or the
        # final) norm follows the MLP's add.
        h = rms_norm(x, layers[0]["attn_norm"], eps)
        for layer, lp in enumerate(layers):
            a, state = attention_block(h, layer, state, lp, partials(lp["wo"]))
            x, h = add_norm(x, a, lp["mlp_norm"])
            following = layers[layer + 1]["attn_norm"] if layer + 1 < len(layers) else None
            down = mlp_block(h, lp, partials(lp["w_down"]))
            x, h = add_norm(x, down, params["norm"] if following is None else following)
        return h, state
    if isinstance(layers, list | tuple):
        for layer, lp in enumerate(layers):
            x, state = layer_body(x, layer, state, lp)
    else:

        def scan_body(carry, lp):
            x, layer, state = carry
            x, state = layer_body(x, layer, state, lp)
            return (x, layer + 1, state), None

        (x, _, state), _ = jax.lax.scan(scan_body, (x, jnp.int32(0), state), layers)
    return rms_norm(x, params["norm"], eps), state


# --- the dense oracle ----------------------------------------------------------------


def _dense_attention(cfg: LlamaConfig, lengths, s: int):
    """The dense passes' attention over rows of ``s`` tokens (row ``b``'s first
    ``lengths[b]`` valid): q [B * S, Hq, D], k / v [B * S, Hkv, D] -> [B * S, Hq, D], a plain
    causal masked softmax in float32 at HIGHEST precision, independent of the paged ops."""
    b = lengths.shape[0]
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    scale = 1.0 / math.sqrt(d)
    pos = jnp.arange(s, dtype=jnp.int32)
    visible = (pos[None, :, None] >= pos[None, None, :]) & (
        pos[None, None, :] < lengths[:, None, None]
    )
    mask = visible[:, None, None, :, :]

    def attend(q, k, v):
        qg = q.astype(jnp.float32).reshape(b, s, hkv, hq // hkv, d)
        kb = k.astype(jnp.float32).reshape(b, s, hkv, d)
        vb = v.astype(jnp.float32).reshape(b, s, hkv, d)
        logits = jnp.einsum("bqhgd,bkhd->bhgqk", qg, kb, precision=_HI) * scale
        logits = jnp.where(mask, logits, -jnp.inf)
        top = jnp.max(logits, axis=-1, keepdims=True)
        p = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
        p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
        o = jnp.einsum("bhgqk,bkhd->bqhgd", p, vb, precision=_HI)
        return o.reshape(b * s, hq, d)

    return attend


@functools.partial(jax.jit, static_argnums=1)
def forward_dense(params: dict, cfg: LlamaConfig, tokens, lengths=None):
    """float32 logits ``[B, S, vocab]`` of ``tokens i32[B, S]`` with no KV cache.

    Position ``i`` of row ``b`` attends to positions ``j <= i`` with ``j < lengths[b]``
    (default: all ``S``); positions are ``0..S-1``. Plain masked softmax in float32 at
    HIGHEST precision, independent of the paged ops. A 1-D ``tokens`` is one sequence
    and gives ``[S, vocab]``. Jitted (``cfg`` static): pad to a few lengths and pass
    ``lengths`` to avoid one compile per sequence length.
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim not in (1, 2) or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an integer array [B, S] or [S], got {tokens.shape}")
    squeeze = tokens.ndim == 1
    if squeeze:
        tokens = tokens[None]
    b, s = tokens.shape
    lengths = jnp.full((b,), s, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be i32[B={b}], got shape {lengths.shape}")
    pos = jnp.arange(s, dtype=jnp.int32)
    dense = _dense_attention(cfg, lengths, s)

    def attend(q, k, v, layer, state):
        return dense(q, k, v), state

    h, _ = _decoder(params, cfg, tokens.reshape(-1), jnp.tile(pos, b), attend, None)
    logits = lm_head(params, cfg, h).reshape(b, s, cfg.vocab_size)
    return logits[0] if squeeze else logits


@functools.partial(jax.jit, static_argnums=1)
def dense_kv(params: dict, cfg: LlamaConfig, tokens, lengths):
    """The K and V every layer writes to a cache for ``tokens i32[B, S]`` (row ``b``'s first
    ``lengths[b]`` tokens; positions ``0..S-1``): ``(k, v)``, each ``[num_layers, B * S,
    num_kv_heads, head_dim]`` in the model dtype, K after RoPE, exactly what the cached
    passes hand to ``write_kv``; padding positions are zero. Runs the dense forward
    (:func:`forward_dense`'s attention): the calibration input of an FP8 pool's scales."""
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an integer array [B, S], got {tokens.shape}")
    b, s = tokens.shape
    lengths = jnp.asarray(lengths, jnp.int32)
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be i32[B={b}], got shape {lengths.shape}")
    hkv, d = cfg.num_key_value_heads, cfg.head_dim
    pos = jnp.arange(s, dtype=jnp.int32)
    valid = (pos[None, :] < lengths[:, None]).reshape(b * s, 1, 1)
    dense = _dense_attention(cfg, lengths, s)

    def attend(q, k, v, layer, state):
        ks, vs = state
        ks = ks.at[layer].set(jnp.where(valid, k, 0))
        vs = vs.at[layer].set(jnp.where(valid, v, 0))
        return dense(q, k, v), (ks, vs)

    shape = (cfg.num_hidden_layers, b * s, hkv, d)
    empty = jnp.zeros(shape, cfg.jnp_dtype)
    _, kv = _decoder(params, cfg, tokens.reshape(-1), jnp.tile(pos, b), attend, (empty, empty))
    return kv


# --- cached forward passes -----------------------------------------------------------


class ExtendBatch(NamedTuple):
    """Metadata of a packed extend batch (every index in layer-0 page ids / slots).

    tokens, positions: ``i32[T]`` new tokens and their absolute positions (padding: 0).
    slot_mapping: ``i32[T]`` pool slot each new token's K/V is written to (padding: -1).
    qo_indptr, kv_indptr: ``i32[B + 1]`` new tokens / prefix + new tokens per request
      (padding requests are empty: the last value repeated).
    kv_indices: ``i32[K]`` per request the slots of its prefix then of its new tokens.
    block_tables, seq_lens: ``i32[B, W]``, ``i32[B]`` the same requests in paged form
      (used with ``attention="prefix_prefill"``; may be None otherwise).
    logit_rows: ``i32[R]`` rows of the packed batch whose logits are wanted (a row may be
      listed several times, e.g. once per parallel sample).
    k_scale, v_scale: a scaled (FP8) pool's scales, f32 ``[num_layers, num_kv_heads]``:
      layer ``l`` writes and reads its pages with row ``l`` (None: 1.0). Or a tuple of
      ``num_layers`` f32 ``[num_kv_heads]`` arrays, one buffer a layer: a kernel takes its
      layer's whole buffer, where a row of one array is a slice XLA copies (a small kernel
      a scale and layer on a GPU).
    """

    tokens: jax.Array
    positions: jax.Array
    slot_mapping: jax.Array
    qo_indptr: jax.Array
    kv_indptr: jax.Array
    kv_indices: jax.Array
    block_tables: jax.Array | None
    seq_lens: jax.Array | None
    logit_rows: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None


class DecodeBatch(NamedTuple):
    """Metadata of a decode batch: one new token per sequence (layer-0 ids).

    tokens, positions, slot_mapping: ``i32[B]`` (padding rows: slot -1, nothing written);
    block_tables ``i32[B, W]``; seq_lens ``i32[B]`` context lengths including the new token
    (padding rows: 0, attending to nothing).

    Cascade decode (:func:`jaxattn.cascade_attention`) when ``prefix_tables`` is set:
    prefix_tables ``i32[G, P]``, prefix_lens ``i32[G]`` (multiples of the page size) are
    the shared prefixes, prefix_of ``i32[B]`` the one each sequence continues (-1: none),
    and block_tables / seq_lens then hold each sequence's own pages and tokens after its
    prefix. The KV of the new token is still written at ``slot_mapping``.

    k_scale, v_scale: a scaled (FP8) pool's scales, as in :class:`ExtendBatch`.

    A new attention variant or quantised pool adds its fields here (with defaults), and the
    engine's runner fills them: the record is the whole interface of a decode step.
    """

    tokens: jax.Array
    positions: jax.Array
    slot_mapping: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    prefix_tables: jax.Array | None = None
    prefix_lens: jax.Array | None = None
    prefix_of: jax.Array | None = None
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None


def _pool_geometry(k_cache, v_cache, cfg: LlamaConfig, layout: str):
    geom = _layout.cache_geometry(k_cache, v_cache, layout)
    if geom.num_pages % cfg.num_hidden_layers:
        raise ValueError(
            f"the cache holds {geom.num_pages} pages, not a multiple of "
            f"num_hidden_layers={cfg.num_hidden_layers} (build it with init_kv_cache)"
        )
    if (geom.num_kv_heads, geom.head_dim) != (cfg.num_key_value_heads, cfg.head_dim):
        raise ValueError(
            f"the cache has {geom.num_kv_heads} KV heads of dim {geom.head_dim}, the model "
            f"{cfg.num_key_value_heads} of dim {cfg.head_dim}"
        )
    return geom.num_pages // cfg.num_hidden_layers, geom.page_size


def _layer_scales(batch, layer):
    """The batch's ``(k_scale, v_scale)`` of one layer: f32 ``[num_kv_heads]`` or None."""
    pick = lambda s: None if s is None else s[layer]  # noqa: E731
    return {"k_scale": pick(batch.k_scale), "v_scale": pick(batch.v_scale)}


def _batch_scales(batch, cfg: LlamaConfig, layers):
    """``batch`` with its KV scales checked; scales given one array a layer are stacked once
    here when the ``layers`` run as a scan (whose traced layer index cannot pick from a
    tuple), not in each iteration of its body."""
    _check_batch_scales(batch, cfg)
    if isinstance(layers, list | tuple):
        return batch
    stack = lambda s: jnp.stack(s) if isinstance(s, list | tuple) else s  # noqa: E731
    return batch._replace(k_scale=stack(batch.k_scale), v_scale=stack(batch.v_scale))


def _check_batch_scales(batch, cfg: LlamaConfig):
    want = (cfg.num_hidden_layers, cfg.num_key_value_heads)
    for name in ("k_scale", "v_scale"):
        s = getattr(batch, name)
        if isinstance(s, list | tuple):  # one array a layer
            shapes = [tuple(getattr(x, "shape", ())) for x in s]
            if len(s) != want[0] or any(shape != want[1:] for shape in shapes):
                raise ValueError(
                    f"batch.{name} as one array a layer must be {want[0]} arrays f32 "
                    f"[{want[1]}], got shapes {shapes}"
                )
        elif s is not None and tuple(s.shape) != want:
            raise ValueError(
                f"batch.{name} must be f32 {list(want)} (or a tuple of {want[0]} f32 "
                f"[{want[1]}]), got shape {tuple(s.shape)}"
            )


def _layer_slots(slot_mapping, slot_offset):
    """A layer's pool slots of the batch's tokens (padding stays -1)."""
    return jnp.where(slot_mapping >= 0, slot_mapping + slot_offset, -1)


def _write(kernels, k_cache, v_cache, k, v, slot_mapping, slot_offset, layout, scales, kv_write):
    if k is None:  # rope_write stored them already
        return k_cache, v_cache
    slots = _layer_slots(slot_mapping, slot_offset)
    writer = write_kv if kernels is None else kernels.write_kv
    return writer(k_cache, v_cache, k, v, slots, layout=layout, implementation=kv_write, **scales)


def _add_norm(params: dict, cfg: LlamaConfig, kernels, fused_norm: bool):
    """The ``add_norm`` of :func:`_decoder` when ``fused_norm`` (None otherwise)."""
    if not fused_norm:
        return None
    if kernels is not None:
        raise ValueError("fused_norm runs on one device; with a tensor-parallel mesh pass False")
    if not isinstance(params["layers"], list | tuple):
        raise ValueError("fused_norm needs straight-line layers (serving_params with unroll=True)")
    from jaxattn import native

    eps = cfg.rms_norm_eps

    def add_norm(x, d, w):
        if d.ndim == 2:  # else float32 split-K partial sums, which the kernel sums
            d = d.astype(x.dtype)
        return native.add_rms_norm(x, d, w.astype(x.dtype), eps=eps)

    return add_norm


def _rope_writer(kernels, batch, slots_per_layer, layout, kv_write, fused_rope):
    """The ``rope_write`` of :func:`_decoder` when ``fused_rope`` (None otherwise): each
    layer's new K/V rotated and stored by :func:`jaxattn.kv.rope_write_kv` (``kernels``'
    when given, e.g. split over a mesh) with the ``kv_write`` backend. Its ``shards`` is
    the split of the fused projection it takes (the mesh's size, or 1)."""
    if not fused_rope:
        return None
    writer = rope_write_kv if kernels is None else kernels.rope_write_kv

    def rope_write(qkv, cos, sin, layer, caches, dtype=None):
        slots = _layer_slots(batch.slot_mapping, layer * slots_per_layer)
        # dtype only with partial sums (one device): the mesh's writer takes no dtype.
        rounding = {"dtype": dtype} if qkv.ndim == 4 else {}
        q, k_cache, v_cache = writer(
            qkv, cos, sin, *caches, slots, layout=layout, implementation=kv_write,
            **_layer_scales(batch, layer), **rounding,
        )  # fmt: skip
        return q, (k_cache, v_cache)

    rope_write.shards = 1 if kernels is None else getattr(kernels, "size", 1)
    return rope_write


def forward_extend(
    params: dict,
    cfg: LlamaConfig,
    k_cache,
    v_cache,
    batch: ExtendBatch,
    *,
    layout: str = "bshd",
    attention: str = "extend",
    implementation=None,
    kernels=None,
    kv_write=None,
    fused_rope: bool = False,
    fused_norm: bool = False,
):
    """Prefill new tokens after cached prefixes; return ``(logits f32[R, V], k, v)``.

    Each layer writes the new tokens' K/V into the pool first, then attends over prefix
    plus new tokens with the shifted causal mask: ``extend_attention`` over the pool
    viewed as a token pool (``attention="extend"``, layout bshd) or ``prefix_prefill``
    over the paged form (``attention="prefix_prefill"``, any layout).

    ``kernels``: an object with ``write_kv``, ``extend_attention``, ``prefix_prefill`` and
    ``paged_attention`` of the public signatures to call instead of :mod:`jaxattn.ops`
    and :func:`jaxattn.kv.write_kv` (e.g. :class:`jaxattn.sharding.TensorParallel`).
    ``kv_write``: the ``implementation=`` of the K/V writes (:func:`jaxattn.write_kv`; None:
    the fastest backend that serves them). ``fused_rope``: rotate q and k and store the new
    K/V in one pass per layer (:func:`jaxattn.rope_write_kv`, same backend), instead of the
    rotation in XLA followed by the write; needs the fused projection (:func:`serving_params`,
    split as ``kernels`` split the heads). ``fused_norm``: each residual add and the RMSNorm
    after it in one native kernel (:func:`jaxattn.native.add_rms_norm`); needs straight-line
    layers (:func:`serving_params`), the native library and one device.
    """
    attn = ops if kernels is None else kernels
    if attention not in ("extend", "prefix_prefill"):
        raise ValueError(f"attention must be 'extend' or 'prefix_prefill', got {attention!r}")
    if attention == "extend" and layout != "bshd":
        raise ValueError(
            f"attention='extend' reads the pool as a token pool, which needs layout='bshd'; "
            f"use attention='prefix_prefill' with layout={layout!r}"
        )
    pages_per_layer, page_size = _pool_geometry(k_cache, v_cache, cfg, layout)
    batch = _batch_scales(batch, cfg, params["layers"])
    slots_per_layer = pages_per_layer * page_size
    hkv, d = cfg.num_key_value_heads, cfg.head_dim

    def attend(q, k, v, layer, caches):
        scales = _layer_scales(batch, layer)
        offset = layer * slots_per_layer
        kc, vc = _write(
            kernels, *caches, k, v, batch.slot_mapping, offset, layout, scales, kv_write
        )
        if attention == "extend":
            n = kc.shape[0] * page_size
            o = attn.extend_attention(
                q,
                kc.reshape(n, hkv, d),
                vc.reshape(n, hkv, d),
                batch.qo_indptr,
                batch.kv_indptr,
                batch.kv_indices + layer * slots_per_layer,
                implementation=implementation,
                **scales,
            )
        else:
            o = attn.prefix_prefill(
                q,
                kc,
                vc,
                batch.qo_indptr,
                batch.block_tables + layer * pages_per_layer,
                batch.seq_lens,
                layout=layout,
                implementation=implementation,
                **scales,
            )
        return o, (kc, vc)

    rope_write = _rope_writer(kernels, batch, slots_per_layer, layout, kv_write, fused_rope)
    h, (k_cache, v_cache) = _decoder(
        params, cfg, batch.tokens, batch.positions, attend, (k_cache, v_cache),
        rope_write=rope_write, add_norm=_add_norm(params, cfg, kernels, fused_norm),
    )  # fmt: skip
    return lm_head(params, cfg, h[batch.logit_rows]), k_cache, v_cache


def forward_decode(
    params: dict,
    cfg: LlamaConfig,
    k_cache,
    v_cache,
    batch: DecodeBatch,
    *,
    layout: str = "bshd",
    partition_size: int | None = None,
    implementation=None,
    config=None,
    kernels=None,
    linear=None,
    kv_write=None,
    fused_rope: bool = False,
    fused_norm: bool = False,
    split_k=None,
):
    """One token per sequence over the paged cache; return ``(logits f32[B, V], k, v)``.

    ``kernels``: as in :func:`forward_extend`. ``config``: the paged decode's backend
    configuration (None: the backend's choice for each batch). A batch with
    ``prefix_tables`` runs cascade decode (``implementation`` then names its backend;
    ``partition_size`` and ``config`` are unused).
    ``linear``: None / ``"xla"`` runs the projections through XLA's dot, ``"pad"`` too but
    with a one-row batch padded to two rows (:func:`_padded_linear`), ``"native"`` through
    :func:`jaxattn.native.linear` where it serves them (1-2 rows, 16-bit weights on a GPU).
    ``kv_write``, ``fused_rope``, ``fused_norm``: as in :func:`forward_extend`.
    ``split_k``: None / False, True (XLA's own split, :func:`xla_split_k`; none on the CPU)
    or an int (at most that many, :func:`split_k_count`): with ``fused_rope``
    the QKV projection, with ``fused_norm`` the output and down projections, hand their
    float32 split-K partial sums to the native kernel that follows them (which sums them)
    instead of a GEMM whose partials XLA reduces first; one device, XLA's dot
    (``linear=None``).
    """
    if linear not in _LINEAR:
        raise ValueError(f"linear must be one of {sorted(map(str, _LINEAR))}, got {linear!r}")
    matmul = _LINEAR[linear]
    attn = ops if kernels is None else kernels
    pages_per_layer, page_size = _pool_geometry(k_cache, v_cache, cfg, layout)
    batch = _batch_scales(batch, cfg, params["layers"])

    def attend(q, k, v, layer, caches):
        offset = layer * pages_per_layer
        scales = _layer_scales(batch, layer)
        kc, vc = _write(
            kernels,
            *caches,
            k,
            v,
            batch.slot_mapping,
            offset * page_size,
            layout,
            scales,
            kv_write,
        )
        if batch.prefix_tables is not None:
            o = attn.cascade_attention(
                q,
                kc,
                vc,
                batch.prefix_tables + offset,
                batch.prefix_lens,
                batch.prefix_of,
                batch.block_tables + offset,
                batch.seq_lens,
                layout=layout,
                implementation=implementation,
                **scales,
            )
            return o, (kc, vc)
        o = attn.paged_attention(
            q,
            kc,
            vc,
            batch.block_tables + offset,
            batch.seq_lens,
            layout=layout,
            partition_size=partition_size,
            implementation=implementation,
            config=config,
            **scales,
        )
        return o, (kc, vc)

    rope_write = _rope_writer(
        kernels, batch, pages_per_layer * page_size, layout, kv_write, fused_rope
    )
    if split_k not in (None, False) and kernels is not None:
        raise ValueError("split_k runs on one device; with a tensor-parallel mesh pass None")
    h, (k_cache, v_cache) = _decoder(
        params, cfg, batch.tokens, batch.positions, attend, (k_cache, v_cache), matmul,
        rope_write, _add_norm(params, cfg, kernels, fused_norm), split_k,
    )  # fmt: skip
    return lm_head(params, cfg, h, matmul), k_cache, v_cache


# --- Hugging Face checkpoints --------------------------------------------------------


def config_from_hf(hf: dict, *, dtype: str | None = None) -> LlamaConfig:
    """A :class:`LlamaConfig` from a Hugging Face Llama ``config.json`` dict."""
    if not isinstance(hf, dict):
        raise TypeError(f"hf must be a dict (a parsed config.json), got {type(hf).__name__}")
    model_type = hf.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"config.json model_type must be 'llama', got {model_type!r}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act must be 'silu' (SwiGLU), got {act!r}")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag, False):
            raise ValueError(f"config.json {flag}=true is not supported")
    missing = [
        k
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        if k not in hf
    ]
    if missing:
        raise ValueError(f"config.json lacks {missing}")
    return LlamaConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or 0,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=hf.get("rope_theta", 10000.0),
        rope_scaling=hf.get("rope_scaling"),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        eos_token_id=hf.get("eos_token_id"),
        bos_token_id=hf.get("bos_token_id"),
        dtype=dtype or hf.get("torch_dtype") or hf.get("dtype") or "float32",
    )


def _hf_layer_names(i: int) -> dict[str, tuple[str, bool]]:
    """Our stacked name -> (HF tensor name of layer i, whether it is a [out, in] Linear)."""
    p = f"model.layers.{i}."
    return {
        "attn_norm": (p + "input_layernorm.weight", False),
        "wq": (p + "self_attn.q_proj.weight", True),
        "wk": (p + "self_attn.k_proj.weight", True),
        "wv": (p + "self_attn.v_proj.weight", True),
        "wo": (p + "self_attn.o_proj.weight", True),
        "mlp_norm": (p + "post_attention_layernorm.weight", False),
        "w_gate": (p + "mlp.gate_proj.weight", True),
        "w_up": (p + "mlp.up_proj.weight", True),
        "w_down": (p + "mlp.down_proj.weight", True),
    }


def params_from_hf(cfg: LlamaConfig, tensors: dict[str, np.ndarray]) -> dict:
    """Stacked parameters from Hugging Face Llama tensors (numpy, any float dtype).

    Every expected tensor must be present with its HF shape; a tensor that would be
    silently ignored (a bias, an unknown weight) is an error, so a checkpoint of another
    architecture is never half loaded.
    """
    dt = np.dtype(cfg.jnp_dtype)
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hf_shape = {
        "attn_norm": (h,),
        "wq": (cfg.q_size, h),
        "wk": (cfg.kv_size, h),
        "wv": (cfg.kv_size, h),
        "wo": (h, cfg.q_size),
        "mlp_norm": (h,),
        "w_gate": (i, h),
        "w_up": (i, h),
        "w_down": (h, i),
    }
    used = set()

    def take(name, shape, transpose):
        if name not in tensors:
            raise ValueError(f"checkpoint lacks tensor {name!r}")
        t = np.asarray(tensors[name])
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"tensor {name!r} must have shape {tuple(shape)}, got {t.shape}")
        used.add(name)
        t = t.T if transpose else t
        return t.astype(dt)

    layers = {k: [] for k in hf_shape}
    for layer in range(cfg.num_hidden_layers):
        for ours, (name, transpose) in _hf_layer_names(layer).items():
            layers[ours].append(take(name, hf_shape[ours], transpose))
    params = {
        "embed": jnp.asarray(take("model.embed_tokens.weight", (v, h), False)),
        "layers": {k: jnp.asarray(np.stack(ts)) for k, ts in layers.items()},
        "norm": jnp.asarray(take("model.norm.weight", (h,), False)),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(take("lm_head.weight", (v, h), True))
    extra = [n for n in tensors if n not in used and not n.endswith("rotary_emb.inv_freq")]
    if cfg.tie_word_embeddings and "lm_head.weight" in extra:
        extra.remove("lm_head.weight")  # some exports store the tied copy too
    if extra:
        raise ValueError(f"checkpoint has tensors this model does not use: {sorted(extra)[:8]}")
    return params


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def _st_dtypes() -> dict:
    """The safetensors dtype names this module reads, with bfloat16 (from ml_dtypes)."""
    import ml_dtypes  # a dependency of jax

    return dict(_ST_DTYPES, BF16=ml_dtypes.bfloat16)


def _read_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="np") as f:
        names = list(f.keys())
        for name in names:
            try:
                out[name] = f.get_tensor(name)
            except (TypeError, KeyError, ValueError):
                out[name] = None  # a dtype this safetensors cannot give numpy (bf16)
    missing = [n for n, t in out.items() if t is None]
    if missing:
        out.update(_read_raw(path, missing))
    return out


def _read_raw(path: pathlib.Path, names: list[str]) -> dict[str, np.ndarray]:
    """Read tensors straight from the file (8-byte header size, JSON header, data), for the
    bf16 tensors that older safetensors releases cannot return as numpy arrays."""
    dtypes = _st_dtypes()
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        base = 8 + size
        out = {}
        for name in names:
            meta = header[name]
            if meta["dtype"] not in dtypes:
                raise ValueError(f"tensor {name!r} in {path.name} has dtype {meta['dtype']}")
            start, end = meta["data_offsets"]
            f.seek(base + start)
            raw = np.frombuffer(f.read(end - start), dtype=dtypes[meta["dtype"]])
            out[name] = raw.reshape(meta["shape"])
    return out


def load_checkpoint(path, *, dtype: str | None = None) -> tuple[LlamaConfig, dict]:
    """Read a Hugging Face Llama directory (``config.json`` + ``*.safetensors``).

    Tensors may be bf16, f16 or f32 and split over several files. ``dtype`` overrides the
    checkpoint's ``torch_dtype`` for the parameters (and therefore the KV cache).
    """
    path = pathlib.Path(path)
    if not path.is_dir():
        raise ValueError(f"path must be a Hugging Face model directory, got {str(path)!r}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"path {str(path)!r} has no config.json")
    cfg = config_from_hf(json.loads(config_file.read_text()), dtype=dtype)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"path {str(path)!r} has no *.safetensors files")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        for name, t in _read_safetensors(file).items():
            if name in tensors:
                raise ValueError(f"tensor {name!r} appears in more than one file")
            tensors[name] = t
    return cfg, params_from_hf(cfg, tensors)


def config_to_hf(cfg: LlamaConfig) -> dict:
    """The Hugging Face ``config.json`` dict of ``cfg`` (:func:`config_from_hf`'s inverse)."""
    if not isinstance(cfg, LlamaConfig):
        raise TypeError(f"cfg must be a LlamaConfig, got {type(cfg).__name__}")
    eos = list(cfg.eos_token_id)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None else dict(cfg.rope_scaling),
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "bos_token_id": cfg.bos_token_id,
        "torch_dtype": cfg.dtype,
    }


def params_to_hf(cfg: LlamaConfig, params: dict) -> dict[str, np.ndarray]:
    """Hugging Face Llama tensors (numpy, the parameters' dtype) of stacked parameters
    (:func:`params_from_hf`'s inverse: Linear weights back to ``[out, in]``)."""
    layers = params["layers"]
    out = {
        "model.embed_tokens.weight": np.asarray(params["embed"]),
        "model.norm.weight": np.asarray(params["norm"]),
    }
    for layer in range(cfg.num_hidden_layers):
        for ours, (name, transpose) in _hf_layer_names(layer).items():
            t = np.asarray(layers[ours][layer])
            out[name] = np.ascontiguousarray(t.T if transpose else t)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"]).T)
    return out


def save_checkpoint(path, cfg: LlamaConfig, params: dict) -> None:
    """Write ``cfg`` and ``params`` as a Hugging Face Llama directory (``config.json`` and one
    ``model.safetensors``) that :func:`load_checkpoint` (and other HF readers) load back
    exactly. Tensors keep the parameters' dtype (f32, f16 or bf16)."""
    names = {np.dtype(t): name for name, t in _st_dtypes().items() if name != "F64"}
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = params_to_hf(cfg, params)
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in names:
            raise ValueError(f"parameter {name!r} has dtype {t.dtype}, not f32, f16 or bf16")
        blob = np.ascontiguousarray(t).tobytes()
        header[name] = {
            "dtype": names[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        offset += len(blob)
        blobs.append(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    with open(path / "model.safetensors", "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for blob in blobs:
            f.write(blob)
    (path / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")
