"""The Llama model: checkpoint loading against an independent float64 numpy implementation of
the Hugging Face forward pass, and the cached forward passes (extend, chunked extend,
decode, every pool layout) against the dense no-cache forward."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_close
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxattn import native
from jaxattn.models import llama
from jaxattn.models.llama import DecodeBatch, ExtendBatch, LlamaConfig

TINY = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # != hidden / heads: the config value must win
    rms_norm_eps=1e-5,
    rope_theta=500.0,
)


# --- an independent Hugging Face Llama in float64 numpy -------------------------------


def hf_tensors(rng, hf: dict, *, tied: bool) -> dict[str, np.ndarray]:
    """Random float32 weights under HF names and HF shapes ([out, in] Linear weights)."""
    h, i, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    d = hf["head_dim"]
    q, kv = hf["num_attention_heads"] * d, hf["num_key_value_heads"] * d

    def w(*shape):
        return (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)

    t = {"model.embed_tokens.weight": rng.standard_normal((v, h)).astype(np.float32)}
    for n in range(hf["num_hidden_layers"]):
        p = f"model.layers.{n}."
        t[p + "self_attn.q_proj.weight"] = w(q, h)
        t[p + "self_attn.k_proj.weight"] = w(kv, h)
        t[p + "self_attn.v_proj.weight"] = w(kv, h)
        t[p + "self_attn.o_proj.weight"] = w(h, q)
        t[p + "mlp.gate_proj.weight"] = w(i, h)
        t[p + "mlp.up_proj.weight"] = w(i, h)
        t[p + "mlp.down_proj.weight"] = w(h, i)
        t[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        t[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(
            np.float32
        )
    t["model.norm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    if not tied:
        t["lm_head.weight"] = w(v, h)
    return t


def hf_inv_freq(hf: dict) -> np.ndarray:
    d = hf["head_dim"]
    inv = 1.0 / hf["rope_theta"] ** (np.arange(0, d, 2) / d)
    rs = hf.get("rope_scaling")
    if rs and rs["rope_type"] == "linear":
        inv = inv / rs["factor"]
    elif rs and rs["rope_type"] == "llama3":
        # transcribed from transformers' _compute_llama3_parameters
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        out = np.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        inv = np.where(medium, smoothed, out)
    return inv


def hf_forward(t: dict, hf: dict, tokens) -> np.ndarray:
    """float64 logits [S, V] of one sequence, written from the HF modeling code's math."""
    f = {k: np.asarray(v, np.float64) for k, v in t.items()}
    s = len(tokens)
    hq, hkv, d = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    eps = hf["rms_norm_eps"]

    def norm(x, w):
        return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))

    def rotate_half(x):
        return np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)

    freqs = np.outer(np.arange(s), hf_inv_freq(hf))
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
    x = f["model.embed_tokens.weight"][np.asarray(tokens)]
    causal = np.tril(np.ones((s, s), bool))
    for n in range(hf["num_hidden_layers"]):
        p = f"model.layers.{n}."
        h = norm(x, f[p + "input_layernorm.weight"])
        q = (h @ f[p + "self_attn.q_proj.weight"].T).reshape(s, hq, d)
        k = (h @ f[p + "self_attn.k_proj.weight"].T).reshape(s, hkv, d)
        v = (h @ f[p + "self_attn.v_proj.weight"].T).reshape(s, hkv, d)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
        a = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        a = np.where(causal, a, -np.inf)
        a = np.exp(a - a.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", a, v).reshape(s, hq * d)
        x = x + o @ f[p + "self_attn.o_proj.weight"].T
        h = norm(x, f[p + "post_attention_layernorm.weight"])
        g = h @ f[p + "mlp.gate_proj.weight"].T
        x = (
            x
            + ((g / (1 + np.exp(-g))) * (h @ f[p + "mlp.up_proj.weight"].T))
            @ f[p + "mlp.down_proj.weight"].T
        )
    x = norm(x, f["model.norm.weight"])
    head = f.get("lm_head.weight", f["model.embed_tokens.weight"])
    return x @ head.T


def write_checkpoint(path, hf: dict, tensors: dict, *, dtype, shards: int = 1):
    (path / "config.json").write_text(json.dumps(hf))
    names = sorted(tensors)
    for s in range(shards):
        part = {n: np.ascontiguousarray(tensors[n].astype(dtype)) for n in names[s::shards]}
        save_file(part, str(path / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"))


def hf_config(**overrides) -> dict:
    hf = dict(TINY, model_type="llama", hidden_act="silu", torch_dtype="float32")
    hf.update(overrides)
    return hf


# --- checkpoints ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, tied, shards, rope_scaling",
    [
        (np.float32, False, 1, None),
        (ml_dtypes.bfloat16, True, 2, None),
        (np.float16, False, 3, {"rope_type": "linear", "factor": 2.0}),
        (
            np.float32,
            True,
            1,
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ],
)
def test_checkpoint_matches_hf_math(tmp_path, dtype, tied, shards, rope_scaling):
    rng = np.random.default_rng(0)
    hf = hf_config(tie_word_embeddings=tied, rope_scaling=rope_scaling, eos_token_id=[3, 7])
    tensors = hf_tensors(rng, hf, tied=tied)
    write_checkpoint(tmp_path, hf, tensors, dtype=dtype, shards=shards)
    # Loaded as float32, the model must equal the HF math on the stored (rounded) weights.
    cfg, params = llama.load_checkpoint(tmp_path, dtype="float32")
    assert cfg.head_dim == 16 and cfg.tie_word_embeddings == tied
    assert cfg.eos_token_id == (3, 7)
    assert ("lm_head" in params) == (not tied)
    stored = {k: v.astype(dtype).astype(np.float64) for k, v in tensors.items()}
    tokens = rng.integers(0, hf["vocab_size"], 37)
    want = hf_forward(stored, hf, tokens)
    # float32 products in full precision: GPUs default to TF32 for them, which the float64
    # comparison below would measure instead of the model's math.
    with jax.default_matmul_precision("highest"):
        got = np.asarray(llama.forward_dense(params, cfg, jnp.asarray(tokens, jnp.int32)))
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)


def test_checkpoint_native_dtype_bf16(tmp_path):
    rng = np.random.default_rng(1)
    hf = hf_config(torch_dtype="bfloat16")
    tensors = hf_tensors(rng, hf, tied=False)
    write_checkpoint(tmp_path, hf, tensors, dtype=ml_dtypes.bfloat16)
    cfg, params = llama.load_checkpoint(tmp_path)
    assert cfg.dtype == "bfloat16"
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    stored = {k: v.astype(ml_dtypes.bfloat16).astype(np.float64) for k, v in tensors.items()}
    tokens = rng.integers(0, hf["vocab_size"], 20)
    want = hf_forward(stored, hf, tokens)
    got = np.asarray(llama.forward_dense(params, cfg, jnp.asarray(tokens, jnp.int32)))
    # bf16 activations: a loose bound, but far below the logits' own spread (~1).
    assert np.max(np.abs(got - want)) < 0.25
    assert np.mean(np.argmax(got, -1) == np.argmax(want, -1)) > 0.8


@pytest.mark.parametrize(
    "dtype, tied, rope_scaling, eos",
    [
        ("float32", False, None, (3,)),
        ("bfloat16", True, {"rope_type": "linear", "factor": 2.0}, (3, 7)),
        ("float16", False, None, ()),
    ],
)
def test_save_checkpoint_round_trip(tmp_path, dtype, tied, rope_scaling, eos):
    cfg = LlamaConfig(
        **TINY, tie_word_embeddings=tied, rope_scaling=rope_scaling, eos_token_id=eos, dtype=dtype
    )
    params = llama.init_params(cfg, jax.random.key(3))
    llama.save_checkpoint(tmp_path / "ckpt", cfg, params)
    hf = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert hf["torch_dtype"] == dtype and hf["head_dim"] == 16
    loaded_cfg, loaded = llama.load_checkpoint(tmp_path / "ckpt")
    assert loaded_cfg == cfg
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # The file is plain safetensors under the HF names: the format's own reader agrees.
    tensors = llama.params_to_hf(cfg, params)
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), framework="np") as f:
        assert sorted(f.keys()) == sorted(tensors)
        if dtype != "bfloat16":  # numpy has no bf16 for this reader; load_checkpoint read it
            for name in tensors:
                np.testing.assert_array_equal(f.get_tensor(name), tensors[name])
    with pytest.raises(TypeError, match="cfg"):
        llama.config_to_hf(hf)


def test_checkpoint_errors(tmp_path):
    rng = np.random.default_rng(2)
    hf = hf_config()
    tensors = hf_tensors(rng, hf, tied=False)
    with pytest.raises(ValueError, match="path"):
        llama.load_checkpoint(tmp_path / "nope")
    with pytest.raises(ValueError, match="config.json"):
        llama.load_checkpoint(tmp_path)

    def check(mutate, match, **cfg_overrides):
        d = tmp_path / f"case{check.n}"
        check.n += 1
        d.mkdir()
        t = dict(tensors)
        mutate(t)
        write_checkpoint(d, hf_config(**cfg_overrides), t, dtype=np.float32)
        with pytest.raises(ValueError, match=match):
            llama.load_checkpoint(d)

    check.n = 0
    check(lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "lacks tensor")
    check(
        lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": np.zeros((4, 4))}),
        "q_proj.weight.*shape",
    )
    check(
        lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}),
        "does not use",
    )
    check(lambda t: None, "model_type", model_type="gpt2")
    check(lambda t: None, "attention_bias", attention_bias=True)
    check(lambda t: None, "rope_scaling", rope_scaling={"rope_type": "yarn", "factor": 2.0})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_attention_heads=6, num_key_value_heads=4), "multiple of num_key_value_heads"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(head_dim=15), "even"),
        (dict(dtype="int8"), "dtype"),
        (dict(eos_token_id=1000), "eos_token_id"),
        (dict(rope_theta=-1.0), "rope_theta"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**kwargs)


def test_config_is_hashable_and_normalised():
    cfg = LlamaConfig(eos_token_id=5, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert cfg.eos_token_id == (5,) and hash(cfg) == hash(LlamaConfig(**dataclasses_asdict(cfg)))
    assert cfg.head_dim == 16 and cfg.q_size == 64 and cfg.kv_size == 32


def dataclasses_asdict(cfg):
    import dataclasses

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


# --- cached forward passes against the dense forward ---------------------------------

CFG = LlamaConfig(**TINY)


def _pad(xs, n, value):
    out = np.full(n, value, np.int32)
    out[: len(xs)] = xs
    return out


class PagedSeqs:
    """Sequences on randomly permuted pages of a pool (built here, not by the engine)."""

    def __init__(self, rng, num_pages, page_size):
        self.free = list(rng.permutation(num_pages))
        self.p = page_size
        self.tables: dict[int, list[int]] = {}

    def slots(self, seq, start, end):
        table = self.tables.setdefault(seq, [])
        while len(table) * self.p < end:
            table.append(int(self.free.pop()))
        pos = np.arange(start, end)
        return np.asarray(table)[pos // self.p] * self.p + pos % self.p

    def extend_batch(self, chunks, *, t_pad, b_pad, k_pad, w_pad):
        """chunks: (seq, tokens_so_far, start, end) -> ExtendBatch with padding."""
        toks, pos, slot, qo, kv, idx, tables, lens, rows = [], [], [], [0], [0], [], [], [], []
        for seq, tokens, start, end in chunks:
            toks += list(tokens[start:end])
            pos += list(range(start, end))
            slot += list(self.slots(seq, start, end))
            qo.append(qo[-1] + end - start)
            kv.append(kv[-1] + end)
            idx += list(self.slots(seq, 0, end))
            tables.append(_pad(self.tables[seq], w_pad, 0))
            lens.append(end)
            rows.append(qo[-1] - 1)
        n = len(chunks)
        tables += [np.zeros(w_pad, np.int32)] * (b_pad - n)
        return ExtendBatch(
            tokens=jnp.asarray(_pad(toks, t_pad, 0)),
            positions=jnp.asarray(_pad(pos, t_pad, 0)),
            slot_mapping=jnp.asarray(_pad(slot, t_pad, -1)),
            qo_indptr=jnp.asarray(_pad(qo, b_pad + 1, qo[-1])),
            kv_indptr=jnp.asarray(_pad(kv, b_pad + 1, kv[-1])),
            kv_indices=jnp.asarray(_pad(idx, k_pad, 0)),
            block_tables=jnp.asarray(np.stack(tables)),
            seq_lens=jnp.asarray(_pad(lens, b_pad, 0)),
            logit_rows=jnp.asarray(_pad(rows, b_pad, 0)),
        )

    def decode_batch(self, items, *, b_pad, w_pad):
        """items: (seq, tokens_so_far) decoding the last token."""
        toks, pos, slot, tables, lens = [], [], [], [], []
        for seq, tokens in items:
            n = len(tokens)
            toks.append(tokens[-1])
            pos.append(n - 1)
            slot += list(self.slots(seq, n - 1, n))
            tables.append(_pad(self.tables[seq], w_pad, 0))
            lens.append(n)
        tables += [np.zeros(w_pad, np.int32)] * (b_pad - len(items))
        return DecodeBatch(
            tokens=jnp.asarray(_pad(toks, b_pad, 0)),
            positions=jnp.asarray(_pad(pos, b_pad, 0)),
            slot_mapping=jnp.asarray(_pad(slot, b_pad, -1)),
            block_tables=jnp.asarray(np.stack(tables)),
            seq_lens=jnp.asarray(_pad(lens, b_pad, 0)),
        )


_NATIVE_WRITE = pytest.mark.skipif(not native.is_available(), reason="no native library")


@pytest.mark.parametrize(
    "layout, attention, form, kv_write, fused",
    [
        ("bshd", "extend", "stacked", None, False),
        ("vllm", "prefix_prefill", "stacked", None, False),
        ("bhsd", "prefix_prefill", "stacked", None, False),
        ("bshd", "extend", "serving", None, False),
        ("vllm", "prefix_prefill", "serving-2", None, False),
        ("bhsd", "prefix_prefill", "serving-scan", None, False),
        ("vllm", "prefix_prefill", "serving-scan", None, "rope"),
        pytest.param("bshd", "extend", "serving", "native", False, marks=_NATIVE_WRITE),
        pytest.param(
            "bhsd", "prefix_prefill", "serving-scan", "native", False, marks=_NATIVE_WRITE
        ),
        pytest.param("bshd", "extend", "serving", "native", "rope", marks=_NATIVE_WRITE),
        pytest.param(
            "bhsd", "prefix_prefill", "serving", "native", "rope+norm", marks=_NATIVE_WRITE
        ),
        pytest.param("vllm", "prefix_prefill", "serving", None, "norm", marks=_NATIVE_WRITE),
        pytest.param("bshd", "extend", "serving", "native", "rope+norm+split", marks=_NATIVE_WRITE),
        pytest.param("bhsd", "prefix_prefill", "serving", None, "rope+split", marks=_NATIVE_WRITE),
        pytest.param("bshd", "extend", "serving", None, "norm+split", marks=_NATIVE_WRITE),
    ],
)
def test_cached_paths_match_dense(layout, attention, form, kv_write, fused):
    """Stacked weights (a scan over layers) and the serving forms (fused projections, one
    block per shard; straight-line layers or a scan) give the dense oracle's logits, with
    the K/V stores of either backend, with the rotation and stores in one pass
    (``fused_rope``), with each residual add and its norm in one kernel (``fused_norm``) and
    with the projections before those kernels handing them split-K partial sums
    (``split_k``, decode steps).
    float32 products in full precision: on a GPU XLA's default for a
    float32 dot rounds its inputs (TF32), which the tolerance is not for."""
    with jax.default_matmul_precision("highest"):
        _cached_paths_match_dense(layout, attention, form, kv_write, fused)


def test_split_k_counts():
    """An int: powers of two up to it that divide K. True: XLA's own split of the dot,
    asked of the compiler (none on the CPU)."""
    cases = [
        (2048, 4, 4), (48, 4, 4), (80, 16, 16), (40, 16, 8), (3, 4, 1), (2048, None, 1),
        (2048, False, 1), (2048, 1, 1), (2048, 6, 4),
    ]  # fmt: skip
    for k, option, want in cases:
        assert llama.split_k_count(k, option) == want, (k, option)
    if jax.default_backend() == "cpu":
        assert llama.xla_split_k(64, 2048, 3072, "bfloat16") == 1
    params = llama.serving_params(CFG, llama.init_params(CFG, jax.random.key(1)))
    k_cache, v_cache = llama.init_kv_cache(CFG, 8, 4)
    b = PagedSeqs(np.random.default_rng(0), 8, 4).decode_batch([(0, [1, 2, 3])], b_pad=2, w_pad=2)
    with pytest.raises(ValueError, match="one device"):
        llama.forward_decode(params, CFG, k_cache, v_cache, b, kernels=object(), split_k=2)


def test_scales_as_one_array_a_layer_match_the_stacked_form():
    """A scaled pool's k_scale / v_scale as a tuple of per-layer arrays (the engine's form:
    no slice a layer) give the stacked [num_layers, num_kv_heads] form's logits and stores,
    with straight-line layers and under the scan; a wrong count is refused."""
    rng = np.random.default_rng(5)
    params = llama.init_params(CFG, jax.random.key(1))
    shape = (CFG.num_hidden_layers, CFG.num_key_value_heads)
    ks = jnp.asarray(rng.uniform(0.5, 2.0, shape), jnp.float32)
    vs = jnp.asarray(rng.uniform(0.5, 2.0, shape), jnp.float32)
    b = PagedSeqs(rng, 8, 4).decode_batch([(0, [1, 2, 3]), (1, [4, 5])], b_pad=2, w_pad=2)
    for form in (llama.serving_params(CFG, params), params):
        k_cache, v_cache = llama.init_kv_cache(CFG, 8, 4, dtype=jnp.float8_e4m3fn)
        want, got = (
            llama.forward_decode(form, CFG, k_cache, v_cache, b._replace(k_scale=k, v_scale=v))
            for k, v in ((ks, vs), (tuple(ks), tuple(vs)))
        )
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    with pytest.raises(ValueError, match="one array a layer"):
        llama.forward_decode(params, CFG, k_cache, v_cache, b._replace(k_scale=tuple(ks)[:1]))


def test_fused_rope_needs_the_fused_unsplit_projection():
    params = llama.init_params(CFG, jax.random.key(1))
    k_cache, v_cache = llama.init_kv_cache(CFG, 8, 4)
    b = PagedSeqs(np.random.default_rng(0), 8, 4).decode_batch([(0, [1, 2, 3])], b_pad=2, w_pad=2)
    for form in (params, llama.serving_params(CFG, params, shards=2)):
        with pytest.raises(ValueError, match="fused q\\|k\\|v projection split as"):
            llama.forward_decode(form, CFG, k_cache, v_cache, b, fused_rope=True)


def _cached_paths_match_dense(layout, attention, form, kv_write, fused=False):
    split = {"split_k": 4} if "split" in str(fused) else {}
    fused = dict(fused_rope="rope" in str(fused), fused_norm="norm" in str(fused))
    rng = np.random.default_rng(3)
    params = llama.init_params(CFG, jax.random.key(1))
    dense_params = params
    if form != "stacked":
        unroll = form != "serving-scan"
        shards = 2 if form == "serving-2" else 1
        params = llama.serving_params(CFG, params, shards=shards, unroll=unroll)
        assert isinstance(params["layers"], tuple) == unroll
        assert llama.serving_params(CFG, params) is params
    num_pages, page = 24, 4
    k_cache, v_cache = llama.init_kv_cache(CFG, num_pages, page, layout=layout)
    # NaN in every slot: a read of anything not written by this test shows up.
    k_cache, v_cache = jnp.full_like(k_cache, jnp.nan), jnp.full_like(v_cache, jnp.nan)
    seqs = PagedSeqs(rng, num_pages, page)
    full = {0: list(rng.integers(0, 96, 14)), 1: list(rng.integers(0, 96, 6)), 2: [5]}
    padded = np.stack([_pad(t, 16, 0) for t in full.values()])
    lens = jnp.asarray([len(t) for t in full.values()], jnp.int32)
    dense = np.asarray(llama.forward_dense(dense_params, CFG, jnp.asarray(padded), lens))

    extend = jax.jit(
        lambda p, k, v, b: llama.forward_extend(
            p, CFG, k, v, b, layout=layout, attention=attention, kv_write=kv_write, **fused
        ),
        donate_argnums=(1, 2),
    )  # fmt: skip
    decode = jax.jit(
        lambda p, k, v, b: llama.forward_decode(
            p, CFG, k, v, b, layout=layout, kv_write=kv_write, **fused, **split
        ),
        donate_argnums=(1, 2),
    )
    pad = dict(t_pad=16, b_pad=4, k_pad=32, w_pad=6)
    # Step 1: seq 0 first chunk, seq 1 whole prompt, seq 2 a one-token prompt.
    b = seqs.extend_batch([(0, full[0], 0, 5), (1, full[1], 0, 5), (2, full[2], 0, 1)], **pad)
    logits, k_cache, v_cache = extend(params, k_cache, v_cache, b)
    np.testing.assert_allclose(logits[:3], [dense[0][4], dense[1][4], dense[2][0]], atol=1e-4)
    # Step 2: seq 0 continues its prefill after a 5-token cached prefix.
    b = seqs.extend_batch([(0, full[0], 5, 12)], **pad)
    logits, k_cache, v_cache = extend(params, k_cache, v_cache, b)
    np.testing.assert_allclose(logits[0], dense[0][11], atol=1e-4)
    # Decode steps: seq 0 crosses a page boundary, seq 1 decodes its last prompt token.
    for n0 in (13, 14):
        b = seqs.decode_batch([(0, full[0][:n0]), (1, full[1])], b_pad=4, w_pad=6)
        logits, k_cache, v_cache = decode(params, k_cache, v_cache, b)
        np.testing.assert_allclose(logits[:2], [dense[0][n0 - 1], dense[1][5]], atol=1e-4)
        assert not np.isnan(np.asarray(logits)).any()


def test_serving_params_layout_and_errors():
    params = llama.init_params(CFG, jax.random.key(0))
    two = llama.serving_params(CFG, params, shards=2)
    lp = two["layers"][1]
    q, kv, i = CFG.q_size, CFG.kv_size, CFG.intermediate_size
    assert lp["wqkv"].shape == (CFG.hidden_size, 2, (q + 2 * kv) // 2)
    assert lp["w_gate_up"].shape == (CFG.hidden_size, 2, i)
    # Shard 1 holds the second half of the q heads, then of k, then of v.
    np.testing.assert_array_equal(
        lp["wqkv"][:, 1, : q // 2], params["layers"]["wq"][1][:, q // 2 :]
    )
    np.testing.assert_array_equal(
        lp["wqkv"][:, 1, q // 2 + kv // 2 :], params["layers"]["wv"][1][:, kv // 2 :]
    )
    with pytest.raises(ValueError, match="num_attention_heads=4 is not a multiple of shards=3"):
        llama.serving_params(CFG, params, shards=3)
    with pytest.raises(ValueError, match="params has 1 layers"):
        llama.serving_params(CFG, dict(params, layers=two["layers"][:1]))


def test_decode_updates_the_donated_pool_in_place():
    params = llama.init_params(CFG, jax.random.key(1))
    k_cache, v_cache = llama.init_kv_cache(CFG, 8, 4)
    decode = jax.jit(
        lambda p, k, v, b: llama.forward_decode(p, CFG, k, v, b), donate_argnums=(1, 2)
    )
    seqs = PagedSeqs(np.random.default_rng(0), 8, 4)
    b = seqs.decode_batch([(0, [1])], b_pad=2, w_pad=2)
    before = k_cache.unsafe_buffer_pointer()
    _, k2, v2 = decode(params, k_cache, v_cache, b)
    assert k_cache.is_deleted() and v_cache.is_deleted()
    assert k2.unsafe_buffer_pointer() == before
    # The token went to layer 1's copy of the page too (page offset num_pages * layer).
    page = seqs.tables[0][0]
    k2 = np.asarray(k2)
    assert np.abs(k2[page, 0]).sum() > 0 and np.abs(k2[8 + page, 0]).sum() > 0
    assert np.abs(np.delete(k2, [page, 8 + page], axis=0)).sum() == 0


def test_forward_errors():
    params = llama.init_params(CFG, jax.random.key(0))
    k, v = llama.init_kv_cache(CFG, 4, 4, layout="bhsd")
    b = PagedSeqs(np.random.default_rng(0), 4, 4).extend_batch(
        [(0, [1, 2], 0, 2)], t_pad=2, b_pad=1, k_pad=2, w_pad=1
    )
    with pytest.raises(ValueError, match="layout='bshd'"):
        llama.forward_extend(params, CFG, k, v, b, layout="bhsd", attention="extend")
    with pytest.raises(ValueError, match="attention"):
        llama.forward_extend(params, CFG, k, v, b, layout="bhsd", attention="flash")
    other = LlamaConfig(**dict(TINY, num_key_value_heads=4))
    with pytest.raises(ValueError, match="KV heads"):
        llama.forward_extend(params, other, k, v, b, layout="bhsd", attention="prefix_prefill")
    with pytest.raises(ValueError, match="tokens"):
        llama.forward_dense(params, CFG, jnp.zeros((2, 2, 2), jnp.int32))
    with pytest.raises(TypeError, match="cfg"):
        llama.init_params({"vocab_size": 3}, jax.random.key(0))


def test_kernels_hook_replaces_the_ops():
    """A ``kernels`` object (e.g. a tensor-parallel wrapper) receives every KV write and
    attention call instead of jaxattn.ops."""
    from jaxattn import ops
    from jaxattn.kv import write_kv

    calls = []

    class Recorder:
        def __getattr__(self, name):
            real = write_kv if name == "write_kv" else getattr(ops, name)

            def record(*args, **kwargs):
                calls.append(name)
                return real(*args, **kwargs)

            return record

    params = llama.init_params(CFG, jax.random.key(0))
    k, v = llama.init_kv_cache(CFG, 4, 4)
    seqs = PagedSeqs(np.random.default_rng(0), 4, 4)
    ext = seqs.extend_batch([(0, [1, 2, 3], 0, 3)], t_pad=4, b_pad=1, k_pad=4, w_pad=1)
    dec = seqs.decode_batch([(0, [1, 2, 3, 4])], b_pad=1, w_pad=1)
    jax.eval_shape(lambda: llama.forward_extend(params, CFG, k, v, ext, kernels=Recorder()))
    jax.eval_shape(lambda: llama.forward_decode(params, CFG, k, v, dec, kernels=Recorder()))
    # The layer scan traces its body once: one write and one attention call per pass.
    assert calls == ["write_kv", "extend_attention", "write_kv", "paged_attention"]


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_projection_paths_agree(rows):
    """The decode step's projection choices (the engine's decode_linear) compute one product:
    XLA's dot, the one-row padding, and native.linear where it serves (1-2 rows)."""
    from jaxattn import native

    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 48), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((48, 2, 16), dtype=np.float32))  # a fused [in, s, c]
    # Full float32 products (a GPU's default runs float32 dots in TF32, and XLA may pick
    # another kernel for one row than for two).
    with jax.default_matmul_precision("float32"):
        want = np.asarray(llama._linear(x, w))
        assert want.shape == (rows, 2, 16)
        choices = ["pad"] + (["native", "hybrid"] if native.is_available() else [])
        for choice in choices:
            got = llama._linear(x, w, llama._LINEAR[choice])
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
            logits = llama._linear(x, w, llama._LINEAR[choice], jnp.float32)
            assert logits.dtype == jnp.float32
    with pytest.raises(ValueError, match="linear must be one of"):
        llama.forward_decode(None, CFG, None, None, None, linear="cublas")


def test_hybrid_projection_splits_by_weight_size(monkeypatch):
    """decode_linear='hybrid': the native kernel for weights up to HYBRID_NATIVE_MAX_BYTES,
    the padded XLA dot above; both give the product."""
    from jaxattn import native

    if not native.is_available():
        pytest.skip("the native library is not built")
    # Weights the platform's native kernel takes (the GPU kernel: 16-bit only).
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 64), dtype=np.float32), dtype)
    w = jnp.asarray(rng.standard_normal((64, 32), dtype=np.float32), dtype)
    calls = []
    for name in ("_native_linear", "_padded_linear"):
        real = getattr(llama, name)

        def spy(*a, _real=real, _name=name):
            calls.append(_name)
            return _real(*a)

        monkeypatch.setattr(llama, name, spy)
    with jax.default_matmul_precision("float32"):
        want = np.asarray(llama._linear(x, w))
        for limit, path in ((1 << 20, "_native_linear"), (0, "_padded_linear")):
            monkeypatch.setattr(llama, "HYBRID_NATIVE_MAX_BYTES", limit)
            calls.clear()
            got = llama._hybrid_linear(x, w, x.dtype)
            assert calls == [path]
            assert_close(got, want)
