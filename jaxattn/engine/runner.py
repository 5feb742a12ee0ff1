"""The model runner: owns the KV pool and the jitted step functions.

One scheduler step runs at most three programs, each over bucketed shapes:

* ``copy_pages`` - copy-on-write page copies (only after a fork), every layer at once;
* ``extend``     - prefill chunks of any number of requests, each after its cached prefix;
* ``decode``     - one token for each decoding sequence.

Extend and decode are separate programs rather than one mixed batch: their shapes vary
independently (new tokens, KV length and requests for one; batch and block-table width for
the other), so two programs compile ``|extend shapes| + |decode shapes|`` variants where a
fused one would compile their product. Every shape is rounded up to a power of two (with
a floor), so a long generation compiles O(log) programs; :attr:`ModelRunner.trace_counts`
counts them. Sampling runs inside the step, so only the drawn token ids leave the device.
The caches are donated to every program and updated in place. The jitted programs are
module level, keyed on the model config and the attention choices, so every engine of one
model reuses the programs another engine compiled.

Tensor parallelism (``mesh=``): the parameters are placed Megatron-style and the pool is
created split by KV head (:mod:`jaxattn.sharding`); the programs take the
:class:`~jaxattn.sharding.TensorParallel` as one more static argument and hand it to the
model as its ``kernels``, so attention and KV writes run per device on its own heads. The
metadata (block tables, slots, indptrs) is the same on 1 or N devices.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import layout as _layout
from jaxattn import ops
from jaxattn import sharding as _sharding
from jaxattn.kv import copy_blocks
from jaxattn.models import llama
from jaxattn.models.llama import DecodeBatch, ExtendBatch, LlamaConfig

from .sampling import sample, sample_keys

__all__ = ["NON_FINITE", "Buckets", "DecodeItem", "ExtendItem", "ModelRunner", "bucket"]


def bucket(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor)."""
    n = max(int(n), int(floor), 1)
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Floors of the power-of-two shape buckets. Higher floors mean fewer programs to
    compile, at the cost of padding work in small steps."""

    tokens: int = 16  # new tokens in an extend step
    kv: int = 64  # prefix + new tokens over all requests of an extend step
    extend_batch: int = 2  # requests (or sample rows) of an extend step
    decode_batch: int = 4  # sequences of a decode step
    pages: int = 4  # block-table width (pages per sequence)
    copies: int = 8  # copy-on-write page copies


class ExtendItem(NamedTuple):
    """A chunk ``[start, end)`` of a sequence whose first ``start`` tokens are cached.

    ``samples``: ``(seed, uid, temperature, top_p)`` per token to draw from the logits of
    the chunk's last row (empty for a chunk that does not finish the prompt); the key of a
    draw is ``(seed, uid, end)`` (see :mod:`jaxattn.engine.sampling`).
    """

    tokens: np.ndarray  # i32[end - start]
    start: int
    end: int
    table: np.ndarray  # i32 pages holding positions [0, end)
    samples: tuple


class DecodeItem(NamedTuple):
    token: int
    position: int  # == tokens cached before this one
    table: np.ndarray  # pages holding positions [0, position]
    seed: int
    uid: int
    temperature: float
    top_p: float


# The token id a step returns for a row whose logits are not finite.
NON_FINITE = -1


class SampleBatch(NamedTuple):
    seeds: jax.Array
    uids: jax.Array
    positions: jax.Array
    temperature: jax.Array
    top_p: jax.Array


def _pad(values, n: int, fill, dtype=np.int32) -> np.ndarray:
    out = np.full(n, fill, dtype)
    values = np.asarray(values, dtype)
    out[: len(values)] = values
    return out


# Traces per program kind, over every runner: the jitted programs are module level, so
# engines of one model share their compiled programs (the static arguments are the model
# config and the attention choices; the shapes come from the buckets).
_TRACES: collections.Counter = collections.Counter()


def _extend_fn(
    params, k, v, batch, samples, *, cfg, layout, attention, implementation, greedy, tp=None
):
    logits, k, v = llama.forward_extend(
        params,
        cfg,
        k,
        v,
        batch,
        layout=layout,
        attention=attention,
        implementation=implementation,
        kernels=tp,
    )
    return _draw(logits, samples, greedy), *_keep_split(tp, layout, k, v)


def _decode_fn(
    params, k, v, batch, samples, *, cfg, layout, partition_size, implementation, greedy, tp=None
):
    logits, k, v = llama.forward_decode(
        params,
        cfg,
        k,
        v,
        batch,
        layout=layout,
        partition_size=partition_size,
        implementation=implementation,
        kernels=tp,
    )
    return _draw(logits, samples, greedy), *_keep_split(tp, layout, k, v)


def _copy_fn(k, v, src, dst, *, layout, tp=None):
    if tp is None:
        return copy_blocks(k, v, src, dst, layout=layout)
    return _keep_split(tp, layout, *tp.copy_blocks(k, v, src, dst, layout=layout))


def _keep_split(tp, layout, k, v):
    """Pin the returned caches to the split they came in with: the donated input buffers
    can then be reused in place, and the next step needs no resharding."""
    if tp is None:
        return k, v
    ks, vs = tp.kv_cache_shardings(layout)
    return jax.lax.with_sharding_constraint(k, ks), jax.lax.with_sharding_constraint(v, vs)


def _draw(logits, samples: SampleBatch, greedy: bool):
    """The drawn token of every row, or :data:`NON_FINITE` where the row's logits are not all
    finite (NaN or inf in the weights, the inputs or the cache): such a row yields no token,
    never a plausible one."""
    keys = sample_keys(samples.seeds, samples.uids, samples.positions)
    tokens = sample(logits, keys, samples.temperature, samples.top_p, greedy=greedy)
    return jnp.where(jnp.all(jnp.isfinite(logits), axis=-1), tokens, NON_FINITE)


def _counted(kind: str, fn):
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        _TRACES[kind] += 1  # the body runs once per trace, i.e. per compiled variant
        return fn(*args, **kwargs)

    return traced


_EXTEND = jax.jit(
    _counted("extend", _extend_fn),
    donate_argnums=(1, 2),
    static_argnames=("cfg", "layout", "attention", "implementation", "greedy", "tp"),
)
_DECODE = jax.jit(
    _counted("decode", _decode_fn),
    donate_argnums=(1, 2),
    static_argnames=("cfg", "layout", "partition_size", "implementation", "greedy", "tp"),
)
_COPY = jax.jit(_counted("copy", _copy_fn), donate_argnums=(0, 1), static_argnames=("layout", "tp"))


class ModelRunner:
    """Runs extend / decode steps of one model over one paged KV pool.

    Args:
      cfg, params: the model.
      num_pages, page_size: pages per layer and tokens per page.
      layout: pool layout (``"bshd"``, ``"bhsd"`` or ``"vllm"``).
      extend_attention: ``"extend"`` (SGLang token-pool form, bshd only) or
        ``"prefix_prefill"`` (paged form); None picks ``"extend"`` for bshd.
      implementation: attention backend name, or None for the fastest one that serves
        the platform; resolved once per step kind by tracing, and reported in
        :attr:`backends`.
      partition_size: split-KV partition for decode (None: the backend's choice).
      buckets: shape bucket floors.
      mesh: a 1-D :class:`jax.sharding.Mesh` (axis ``"tp"``, see
        :func:`jaxattn.sharding.make_mesh`) to run tensor-parallel over; None for one
        device. Its size must divide the query and KV head counts and the MLP width.

    :attr:`trace_counts` counts the programs this runner's calls compiled (a program
    another runner of the same model compiled already is reused, not counted).
    """

    def __init__(
        self,
        cfg: LlamaConfig,
        params: dict,
        *,
        num_pages: int,
        page_size: int,
        layout: str = "bshd",
        extend_attention: str | None = None,
        implementation: str | None = None,
        partition_size: int | None = None,
        buckets: Buckets | None = None,
        mesh=None,
    ):
        if extend_attention is None:
            extend_attention = "extend" if layout == "bshd" else "prefix_prefill"
        if extend_attention not in ("extend", "prefix_prefill"):
            raise ValueError(
                f"extend_attention must be 'extend' or 'prefix_prefill', got {extend_attention!r}"
            )
        if extend_attention == "extend" and layout != "bshd":
            raise ValueError(
                f"extend_attention='extend' needs layout='bshd' (a token pool), got {layout!r}"
            )
        self.tp = None if mesh is None else _sharding.TensorParallel(mesh)
        self.cfg = cfg
        self.num_pages = num_pages
        self.page_size = page_size
        self.layout = layout
        self.extend_attention = extend_attention
        self.partition_size = partition_size
        self.buckets = buckets or Buckets()
        init = functools.partial(llama.init_kv_cache, cfg, num_pages, page_size, layout=layout)
        if self.tp is None:
            self.params = params
            self.k_cache, self.v_cache = init()
        else:
            self.params = self.tp.shard_params(params, cfg)
            # Built split, so that no device ever holds the whole pool.
            self.k_cache, self.v_cache = self.tp.init_kv_cache(init, layout=layout)
        self.trace_counts: collections.Counter = collections.Counter()
        self._last_greedy = True
        self.backends = {
            "extend": self._resolve("extend", implementation),
            "decode": self._resolve("decode", implementation),
        }
        self._statics = {
            "extend": dict(
                cfg=cfg,
                layout=layout,
                attention=extend_attention,
                implementation=self.backends["extend"],
                tp=self.tp,
            ),
            "decode": dict(
                cfg=cfg,
                layout=layout,
                partition_size=partition_size,
                implementation=self.backends["decode"],
                tp=self.tp,
            ),
        }

    @property
    def tp_size(self) -> int:
        """Devices the model is split over (1 without a mesh)."""
        return 1 if self.tp is None else self.tp.size

    @property
    def kv_bytes(self) -> int:
        """Bytes of the whole pool, over all devices."""
        return self.k_cache.nbytes + self.v_cache.nbytes

    @property
    def kv_bytes_per_device(self) -> int:
        """Bytes of the pool the most loaded device holds (``kv_bytes / tp_size`` when the
        split is even)."""
        held: collections.Counter = collections.Counter()
        for cache in (self.k_cache, self.v_cache):
            for shard in cache.addressable_shards:
                held[shard.device] += shard.data.nbytes
        return max(held.values())

    def _resolve(self, kind: str, implementation) -> str:
        """The backend the attention op of this step kind resolves to (the op's own
        resolver, :meth:`jaxattn.backend.Op.resolve`, on the shapes one device sees)."""
        cfg, tp = self.cfg, self.tp_size
        hq, hkv, d = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp, cfg.head_dim
        dt = cfg.jnp_dtype
        sds, i32 = jax.ShapeDtypeStruct, jnp.int32
        lay = _layout.get(self.layout)
        geom = _layout.CacheGeometry(self.num_pages * cfg.num_hidden_layers, self.page_size, hkv, d)
        k, v = sds(lay.shape("k", geom, dt), dt), sds(lay.shape("v", geom, dt), dt)
        q = sds((1, hq, d), dt)
        if kind == "decode":
            op = ops.PAGED_ATTENTION
            args = op.bind(
                q,
                k,
                v,
                sds((1, 1), i32),
                sds((1,), i32),
                layout=self.layout,
                partition_size=self.partition_size,
            )
        elif self.extend_attention == "extend":
            op = ops.EXTEND_ATTENTION
            pool = sds((geom.num_pages * geom.page_size, hkv, d), dt)
            args = op.bind(q, pool, pool, sds((2,), i32), sds((2,), i32), sds((1,), i32))
        else:
            op = ops.PREFIX_PREFILL
            args = op.bind(
                q, k, v, sds((2,), i32), sds((1, 1), i32), sds((1,), i32), layout=self.layout
            )
        platform = None if self.tp is None else self.tp.mesh.devices.flat[0].platform
        return op.resolve(args, implementation, platform=platform).backend

    # -- metadata -----------------------------------------------------------------------

    def _slots(self, table: np.ndarray, start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end)
        return (table[pos // self.page_size] * self.page_size + pos % self.page_size).astype(
            np.int32
        )

    def _sample_batch(self, rows: list, n: int) -> SampleBatch:
        """rows: (seed, uid, position, temperature, top_p) -> a batch padded to ``n``."""
        col = lambda i, fill, dt=np.int32: jnp.asarray(_pad([r[i] for r in rows], n, fill, dt))
        return SampleBatch(
            seeds=col(0, 0),
            uids=col(1, 0),
            positions=col(2, 0),
            temperature=col(3, 0.0, np.float32),
            top_p=col(4, 1.0, np.float32),
        )

    def _extend_args(self, items: list[ExtendItem]):
        bk = self.buckets
        num_new = sum(it.end - it.start for it in items)
        num_kv = sum(it.end for it in items)
        num_rows = sum(len(it.samples) for it in items)
        t = bucket(num_new, bk.tokens)
        b = bucket(max(len(items), num_rows), bk.extend_batch)
        k = bucket(num_kv, max(bk.kv, t))
        tokens = np.concatenate([it.tokens for it in items])
        positions = np.concatenate([np.arange(it.start, it.end) for it in items])
        slots = np.concatenate([self._slots(it.table, it.start, it.end) for it in items])
        indices = np.concatenate([self._slots(it.table, 0, it.end) for it in items])
        qo = np.cumsum([0] + [it.end - it.start for it in items])
        kv = np.cumsum([0] + [it.end for it in items])
        rows, sample_rows = [], []
        for it, last in zip(items, qo[1:] - 1, strict=True):
            for seed, uid, temperature, top_p in it.samples:
                rows.append(last)
                sample_rows.append((seed, uid, it.end, temperature, top_p))
        tables = seq_lens = None
        if self.extend_attention == "prefix_prefill":
            w = bucket(max(len(it.table) for it in items), bk.pages)
            tables = np.zeros((b, w), np.int32)
            for i, it in enumerate(items):
                tables[i, : len(it.table)] = it.table
            tables = jnp.asarray(tables)
            seq_lens = jnp.asarray(_pad([it.end for it in items], b, 0))
        batch = ExtendBatch(
            tokens=jnp.asarray(_pad(tokens, t, 0)),
            positions=jnp.asarray(_pad(positions, t, 0)),
            slot_mapping=jnp.asarray(_pad(slots, t, -1)),
            qo_indptr=jnp.asarray(_pad(qo, b + 1, qo[-1])),
            kv_indptr=jnp.asarray(_pad(kv, b + 1, kv[-1])),
            kv_indices=jnp.asarray(_pad(indices, k, 0)),
            block_tables=tables,
            seq_lens=seq_lens,
            logit_rows=jnp.asarray(_pad(rows, b, 0)),
        )
        return batch, self._sample_batch(sample_rows, b)

    def _decode_args(self, items: list[DecodeItem]):
        b = bucket(len(items), self.buckets.decode_batch)
        w = bucket(max(len(it.table) for it in items), self.buckets.pages)
        tables = np.zeros((b, w), np.int32)
        for i, it in enumerate(items):
            tables[i, : len(it.table)] = it.table
        slots = [self._slots(it.table, it.position, it.position + 1)[0] for it in items]
        batch = DecodeBatch(
            tokens=jnp.asarray(_pad([it.token for it in items], b, 0)),
            positions=jnp.asarray(_pad([it.position for it in items], b, 0)),
            slot_mapping=jnp.asarray(_pad(slots, b, -1)),
            block_tables=jnp.asarray(tables),
            # Padding rows attend to nothing (length 0 gives zeros): a length of 1 would
            # read whatever slot 0 of page 0 holds, NaN included.
            seq_lens=jnp.asarray(_pad([it.position + 1 for it in items], b, 0)),
        )
        rows = [(it.seed, it.uid, it.position + 1, it.temperature, it.top_p) for it in items]
        return batch, self._sample_batch(rows, b)

    # -- running ------------------------------------------------------------------------

    def extend(self, items: list[ExtendItem]) -> jax.Array:
        """Run the chunks; return the drawn tokens ``i32[>= sum(len(samples))]`` (device)."""
        batch, samples = self._extend_args(items)
        temperatures = [s[2] for it in items for s in it.samples]
        # A step that draws nothing reuses the last variant rather than compiling another.
        greedy = all(t == 0 for t in temperatures) if temperatures else self._last_greedy
        return self._run("extend", _EXTEND, batch, samples, greedy)

    def decode(self, items: list[DecodeItem]) -> jax.Array:
        """Decode one token per item; return the drawn tokens ``i32[>= len(items)]``."""
        batch, samples = self._decode_args(items)
        greedy = all(it.temperature == 0 for it in items)
        return self._run("decode", _DECODE, batch, samples, greedy)

    def _run(self, kind, program, batch, samples, greedy):
        self._last_greedy = greedy
        before = _TRACES[kind]
        tokens, self.k_cache, self.v_cache = program(
            self.params,
            self.k_cache,
            self.v_cache,
            batch,
            samples,
            greedy=greedy,
            **self._statics[kind],
        )
        self.trace_counts[kind] += _TRACES[kind] - before
        return tokens

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy page ``src -> dst`` (layer-0 ids) in every layer, before any write."""
        n = len(pairs)
        m = bucket(n * self.cfg.num_hidden_layers, self.buckets.copies)
        offsets = np.arange(self.cfg.num_hidden_layers)[:, None] * self.num_pages
        src = (np.asarray([p[0] for p in pairs])[None, :] + offsets).reshape(-1)
        dst = (np.asarray([p[1] for p in pairs])[None, :] + offsets).reshape(-1)
        before = _TRACES["copy"]
        self.k_cache, self.v_cache = _COPY(
            self.k_cache,
            self.v_cache,
            jnp.asarray(_pad(src, m, 0)),
            jnp.asarray(_pad(dst, m, -1)),
            layout=self.layout,
            tp=self.tp,
        )
        self.trace_counts["copy"] += _TRACES["copy"] - before
