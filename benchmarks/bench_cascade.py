"""Cascade decode against plain paged decode of the same batch, and against the read floor.

    python benchmarks/bench_cascade.py --json cascade.json            # the issue's batches
    python benchmarks/bench_cascade.py --fit --json cascade.json      # + the switch rule's fit
    python benchmarks/bench_cascade.py --layers 16 --timing graph      # a layer of a 16-layer step

Batches (B requests, Hq/Hkv, D, page size, dtype from the flags; default the issue's case:
B=64, a 4096-token prefix, 256 own tokens each, bf16, 32/8, D=128, page 16):

* ``shared``: every request continues one prefix;
* ``mixed``: three prefixes (the length, half, a quarter) shared by 7/8 of the requests in turn,
  the rest continue none, own lengths spread over [own / 4, 2 own];
* ``private``: each request has its own prefix (cascade cannot save a byte: its cost over
  paged decode is what cascade costs when it is not useful).

Two more take ``shared`` apart, one level each (``--batches shared,shared-prefix,shared-own``):
``shared-prefix`` is its prefix level alone (own lengths 0: the own level's blocks read
nothing), ``shared-own`` its own level alone (no request continues the prefix, which is one
page: the prefix tiles read nothing).

For each batch, each implementation of ``--impl`` runs ``jaxattn.cascade_attention`` and
``jaxattn.paged_attention`` over the joined tables (prefix pages, then own pages), in the same
run, on the same inputs (rotated over enough copies to pass the L2; ``benchmarks/common.py``).
The floor is the time to read each prefix once and every own token once at the read ceiling, a
jitted ``jnp.sum`` over 4 GiB measured in the same run (``common.read_bandwidth``). The table
shows each time, its ratio to the floor, and the speedup of cascade over paged decode of the
same implementation.

``--layers L`` times L layers a call, as the engine's decode step runs them: one pool
holding every layer's pages, layer l's tables the first layer's offset by l layers' pages,
the same lengths and prefix ids for every layer, each layer's output the next one's q; a
row's time is a layer's share. What depends only on the lengths and prefix ids (the Mosaic
GPU cascade's tile plan but its gather of each tile's table: a chain of small XLA kernels
before its kernel) is then one computation a call for all layers (XLA's common-subexpression
elimination), as in the engine's step, where a lone call pays it every time.

``--fit`` also times both ops (``--fit-impl``, default native) over a grid of batches (prefix
length, requests per prefix, own length, batch size), fits the constants of
:class:`jaxattn.cascade_cost.CascadeCostModel` to them, and reports how the fitted switch
(:func:`jaxattn.cascade_cost.cascade_pays_off`) would have decided every measured batch: the
JSON's ``cost_model`` is what an engine loads (``CascadeCostModel.from_json``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import jaxattn  # noqa: E402
from jaxattn import cascade_cost as cc  # noqa: E402
from jaxattn.engine import ExecutionConfig  # noqa: E402
from jaxattn.pallas import cascade_mgpu  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Batch:
    name: str
    prefix_lens: tuple[int, ...]  # tokens, whole pages
    prefix_of: tuple[int, ...]
    own: tuple[int, ...]


def batches(b: int, prefix: int, own: int, page: int) -> list[Batch]:
    whole = lambda n: max(page, n // page * page)  # noqa: E731
    mixed_of = tuple(-1 if i % 8 == 7 else i % 3 for i in range(b))
    mixed_own = tuple(max(1, own // 4 + (i * 53) % (2 * own - own // 4)) for i in range(b))
    return [
        Batch("shared", (whole(prefix),), (0,) * b, (own,) * b),
        Batch(
            "mixed", (whole(prefix), whole(prefix // 2), whole(prefix // 4)), mixed_of, mixed_own
        ),
        Batch("private", (whole(prefix),) * b, tuple(range(b)), (own,) * b),
        Batch("shared-prefix", (whole(prefix),), (0,) * b, (0,) * b),
        Batch("shared-own", (page,), (-1,) * b, (own,) * b),
    ]


def build_inputs(seed, batch: Batch, *, hq, hkv, d, page, layout, dtype):
    """Random inputs of one batch: the pages of every prefix and own part in a permuted pool.
    Returns (cascade args, paged args over the joined tables)."""
    rng = np.random.default_rng(seed)
    g_count, b_count = len(batch.prefix_lens), len(batch.own)
    prefix_pages = [n // page for n in batch.prefix_lens]
    own_pages = [-(-n // page) for n in batch.own]
    num_pages = sum(prefix_pages) + sum(own_pages) + 1
    perm = iter(rng.permutation(num_pages).tolist())
    # (A table of no column is answered without a kernel: own lengths of 0 keep one.)
    wp, w = max(prefix_pages), max(1, *own_pages)
    ptab = np.zeros((g_count, wp), np.int32)
    tab = np.zeros((b_count, w), np.int32)
    joined = np.zeros((b_count, wp + w), np.int32)
    for g, n in enumerate(prefix_pages):
        ptab[g, :n] = [next(perm) for _ in range(n)]
    for b, n in enumerate(own_pages):
        tab[b, :n] = [next(perm) for _ in range(n)]
        g = batch.prefix_of[b]
        pre = list(ptab[g, : prefix_pages[g]]) if g >= 0 else []
        joined[b, : len(pre) + n] = pre + list(tab[b, :n])
    geom = (num_pages, page, hkv, d)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    k = jax.random.normal(kk, jaxattn.layout.cache_shape(layout, "k", *geom, dtype=dtype), dtype)
    v = jax.random.normal(kv, jaxattn.layout.cache_shape(layout, "v", *geom, dtype=dtype), dtype)
    q = jax.random.normal(kq, (b_count, hq, d), dtype)
    lp = [batch.prefix_lens[g] if g >= 0 else 0 for g in batch.prefix_of]
    cascade_args = (
        q,
        k,
        v,
        jnp.asarray(ptab),
        jnp.asarray(batch.prefix_lens, jnp.int32),
        jnp.asarray(batch.prefix_of, jnp.int32),
        jnp.asarray(tab),
        jnp.asarray(batch.own, jnp.int32),
    )
    joined_lens = jnp.asarray([a + o for a, o in zip(lp, batch.own, strict=True)], jnp.int32)
    return cascade_args, (q, k, v, jnp.asarray(joined), joined_lens)


def build_layered(seed, batch: Batch, layers: int, **kw):
    """:func:`build_inputs` for ``layers`` layers of a model, laid out as the engine lays
    them out: one pool holding every layer's pages (layer l's at ``l * num_pages``), one set
    of tables and lengths for layer 0 (:func:`layered` offsets the tables of the others)."""
    casc, paged = build_inputs(seed, batch, **kw)
    if layers == 1:
        return casc, paged
    geom = jaxattn.layout.cache_geometry(casc[1], casc[2], kw["layout"])
    shape = geom._replace(num_pages=layers * geom.num_pages)
    keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), 1000))
    k, v = (
        jax.random.normal(
            key,
            jaxattn.layout.cache_shape(kw["layout"], kind, *shape, dtype=kw["dtype"]),
            kw["dtype"],
        )
        for key, kind in zip(keys, "kv", strict=True)
    )
    return (casc[0], k, v, *casc[3:]), (paged[0], k, v, *paged[3:])


# The arguments of each op that are block tables (offset by a layer's pages).
TABLE_ARGS = {"cascade": (3, 6), "paged": (3,)}


def layered(fn, layers: int, pages: int = 0, tables: tuple[int, ...] = ()):
    """``fn`` over ``layers`` layers in one call, as the engine's decode step runs it: layer
    l's q is the output of layer l - 1, its tables (the ``tables`` arguments) the first
    layer's plus ``l * pages`` (its pages in the one pool), its lengths and prefix ids the
    same arrays. What depends only on those (the Mosaic GPU cascade's tile plan but its
    gather of each tile's table) XLA then computes once a call, not once a layer
    (common-subexpression elimination), as in the engine's step."""
    if layers == 1:
        return fn

    def run(*args):
        x = args[0]
        for layer in range(layers):
            a = list(args)
            a[0] = x
            for i in tables:
                a[i] = args[i] + layer * pages
            x = fn(*a)
        return x

    return run


def features(batch: Batch, hq, hkv, d, itemsize) -> dict:
    return cc.cascade_features(
        batch.prefix_lens,
        batch.prefix_of,
        batch.own,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        itemsize=itemsize,
    )


def time_batch(batch: Batch, impls, args, *, check, record):
    """Times cascade and paged decode of every implementation on one batch."""
    layers = args.layers
    build = functools.partial(
        build_layered,
        batch=batch,
        layers=layers,
        hq=args.hq,
        hkv=args.hkv,
        d=args.head_dim,
        page=args.page_size,
        layout=args.layout,
        dtype=args.dtype,
    )
    f = features(batch, args.hq, args.hkv, args.head_dim, args.dtype.itemsize)
    # Each copy is its own pool of pages: a round over them moves 16x the L2 of them.
    copies = common.make_copies(build, common.num_copies(layers * int(f["unique_bytes"])))
    pool = jaxattn.layout.cache_geometry(*copies[0][0][1:3], args.layout)
    pages = pool.num_pages // layers  # a layer's pages
    casc = [c for c, _ in copies]
    paged = [p for _, p in copies]
    expected = None
    if check:
        ref = functools.partial(
            jaxattn.cascade_attention, layout=args.layout, implementation="reference"
        )
        expected = layered(ref, layers, pages, TABLE_ARGS["cascade"])(*casc[0])
    rows = []

    def time_row(impl, op, run, inputs, config):
        row = dict(batch=batch.name, impl=impl, op=op, copies=len(inputs), layers=layers, **f)
        if config is not None:
            row["config"] = config
        run = layered(run, layers, pages, TABLE_ARGS[op])
        row |= common.measure(run, inputs, expected=expected, **common.timing_kw(args))
        for key in ("us", "us_min", "us_dispatch"):  # a layer's share of a call
            if key in row:
                row[key] /= layers
        record(row)
        if args.profile and "us" in row:
            row["profile"] = common.profile_calls(run, inputs, args.profile_top, layers)
        rows.append(row)

    for impl in impls:
        for op, fn, obj, inputs in (
            ("cascade", jaxattn.cascade_attention, jaxattn.ops.CASCADE_ATTENTION, casc),
            ("paged", jaxattn.paged_attention, jaxattn.ops.PAGED_ATTENTION, paged),
        ):
            config = None
            with contextlib.suppress(NotImplementedError):  # measure() reports a refusal
                config = common.resolved_label(obj, inputs[0], impl, layout=args.layout)
            run = functools.partial(fn, layout=args.layout, implementation=impl)
            time_row(impl, op, run, inputs, config)
    if args.mgpu and "pallas" in impls:
        # The Pallas cascade on the Mosaic GPU lowering (jaxattn.pallas.cascade_mgpu), each
        # configuration against the same paged decode.
        for spec in args.mgpu.split(","):
            run = functools.partial(
                cascade_mgpu.cascade_attention, layout=args.layout, **mgpu_config(spec)
            )
            time_row("pallas-mgpu", "cascade", run, casc, f"prefix:own pages={spec}")
    del copies, casc, paged
    return rows


def mgpu_config(spec: str) -> dict:
    """``prefix_pages|auto:own_pages|auto[:flag...]`` -> keywords of
    :func:`jaxattn.pallas.cascade_mgpu.cascade_attention`; flags: ``triton``, ``mosaic_gpu``
    or ``xla`` (the merge), ``pN`` (pages a step copies), ``sN`` (steps in flight)."""
    prefix, own, *flags = spec.split(":")
    pages = [None if x == "auto" else int(x) for x in (prefix, own)]
    kw = dict(prefix_pages=pages[0], own_pages=pages[1])
    for flag in flags:
        if flag in ("triton", "mosaic_gpu", "xla"):
            kw["merge"] = flag
        elif flag[:1] in ("p", "s") and flag[1:].isdigit():
            kw["pages_per_step" if flag[0] == "p" else "stages"] = int(flag[1:])
        else:
            raise SystemExit(f"--mgpu: unknown flag {flag!r} in {spec!r}")
    return kw


def fit_model(points: list[dict], base: cc.CascadeCostModel) -> tuple[cc.CascadeCostModel, dict]:
    """Least squares of each op's time on its features (non-negative: a feature whose
    coefficient comes out negative is dropped and the rest refitted)."""

    def nnls(x, y, names):
        keep = list(range(x.shape[1]))
        while True:
            coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
            if (coef >= 0).all() or len(keep) == 1:
                out = dict.fromkeys(names, 0.0)
                out.update({names[i]: max(0.0, float(c)) for i, c in zip(keep, coef, strict=True)})
                return out
            keep.pop(int(np.argmin(coef)))

    pg = [p for p in points if "paged_us" in p]
    cs = [p for p in points if "cascade_us" in p]
    a = nnls(
        np.array([[1.0, p["unique_bytes"], p["repeated_bytes"]] for p in pg]),
        np.array([p["paged_us"] for p in pg]),
        ["fixed", "per_byte", "per_repeated_byte"],
    )
    b = nnls(
        np.array([[1.0, p["rows"], p["unique_bytes"], p["prefix_flops"]] for p in cs]),
        np.array([p["cascade_us"] for p in cs]),
        ["fixed", "per_row", "per_byte", "per_flop"],
    )
    inv = lambda c: 1.0 / c if c > 0 else math.inf  # noqa: E731
    model = dataclasses.replace(
        base,
        paged_fixed_us=a["fixed"],
        paged_bytes_per_us=inv(a["per_byte"]),
        paged_repeat_bytes_per_us=inv(a["per_repeated_byte"]),
        cascade_fixed_us=b["fixed"],
        cascade_row_us=b["per_row"],
        cascade_bytes_per_us=inv(b["per_byte"]),
        cascade_flops_per_us=inv(b["per_flop"]),
    )
    return model, dict(paged=a, cascade=b)


def switch_decisions(points: list[dict], model: cc.CascadeCostModel, min_tokens: int = 0):
    """How ``model``'s switch decides each measured point (``cascade_us`` / ``paged_us`` and
    the features), and how much slower than paged decode, and than the faster of the two,
    its choice is. As in the engine, a batch with no prefix read twice (no repeated bytes)
    never takes cascade, and a prefix shorter than ``min_tokens`` forms no level (the
    engine's ``cascade_min_tokens``): paged decode runs there whatever the model says."""
    out = []
    for pt in sorted(points, key=lambda x: x["batch"]):
        cas, pag = model.predict(pt)
        pays = (
            pt["repeated_bytes"] > 0
            and pt.get("prefix", min_tokens) >= min_tokens
            and model.pays_off(pt)
        )
        chosen = pt["cascade_us"] if pays else pt["paged_us"]
        out.append(
            pt
            | dict(
                predicted_cascade_us=cas,
                predicted_paged_us=pag,
                use_cascade=bool(pays),
                slowdown_vs_paged=chosen / pt["paged_us"] - 1,
                slowdown_vs_best=chosen / min(pt["cascade_us"], pt["paged_us"]) - 1,
            )
        )
    return out


def crossovers(points: list[dict]) -> list[dict]:
    """Where cascade starts to pay, measured: for each (batch, requests a prefix, own tokens)
    of the points, the prefix lengths timed and the shortest from which cascade decode was
    faster than paged decode at that length and every longer one (None: at none)."""
    groups: dict[tuple, list[dict]] = {}
    for pt in points:
        if "prefix" in pt:
            groups.setdefault((pt["b"], pt["per"], pt["own"]), []).append(pt)
    out = []
    for (b, per, own), pts in sorted(groups.items()):
        pts.sort(key=lambda x: x["prefix"])
        n = None
        for pt in reversed(pts):
            if pt["cascade_us"] >= pt["paged_us"]:
                break
            n = pt["prefix"]
        out.append(
            dict(
                b=b,
                per=per,
                own=own,
                prefixes=" ".join(str(p["prefix"]) for p in pts),
                speedups=" ".join(f"{p['paged_us'] / p['cascade_us']:.2f}" for p in pts),
                pays_from=n,
            )
        )
    return out


def fit_grid(args) -> list[Batch]:
    """The fit's batches: shared prefixes from 64 to 4096 tokens, 1 to 64 requests a prefix
    (one: nothing shared, cascade's overhead alone), short and long own parts; the short
    prefixes measure where cascade starts to pay (the engine's ``cascade_min_tokens``)."""
    out = []
    page = args.page_size
    for b, prefix, per, own in (
        [(64, p, n, o) for p in (512, 2048, 4096) for n in (1, 2, 8, 64) for o in (64, 512)]
        + [(64, p, n, o) for p in (64, 128, 256) for n in (2, 8, 64) for o in (64, 512)]
        + [
            (16, 4096, 1, 256),
            (16, 4096, 16, 256),
            (128, 1024, 8, 128),
        ]
    ):
        groups = b // per
        out.append(
            Batch(
                f"fit B={b} L={prefix} n={per} own={own}",
                (prefix // page * page,) * groups,
                tuple(i // per for i in range(b)),
                (own,) * b,
            )
        )
    return out


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.set_defaults(impl="pallas,native")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prefix", type=int, default=4096, help="prefix tokens")
    p.add_argument("--own", type=int, default=256, help="own tokens per request")
    p.add_argument("--heads", default="32/8", help="Hq/Hkv")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layout", default="bshd")
    p.add_argument("--batches", default="shared,mixed,private")
    p.add_argument("--fit", action="store_true", help="fit the switch rule's cost model")
    p.add_argument("--fit-impl", default="native")
    p.add_argument(
        "--layers",
        type=int,
        default=1,
        help="layers a call, as the engine's step runs them (one pool, each layer's tables "
        "offset into it, each layer's output the next one's q: the part of the cascade's "
        "plan that reads only lengths and prefix ids is computed once a call); times are a "
        "layer's share",
    )
    common.add_profile_args(p)
    p.add_argument(
        "--mgpu",
        nargs="?",
        const="auto:auto",
        default=None,
        help="also time the Pallas cascade on the Mosaic GPU lowering "
        "(jaxattn.pallas.cascade_mgpu; with --impl pallas) in these configurations: "
        "prefix_pages|auto:own_pages|auto[:triton|mosaic_gpu|xla][:pN][:sN],... (pages a "
        "partition of each level; the merge kernel's lowering; pages a step copies; steps in "
        "flight; bare --mgpu: the defaults)",
    )
    p.add_argument("--small", action="store_true", help="tiny shapes (a smoke run on CPU)")
    args = p.parse_args(argv)
    if args.layers < 1:
        p.error(f"--layers must be >= 1, got {args.layers}")
    if args.small:
        args.batch, args.prefix, args.own, args.heads, args.head_dim = 6, 64, 16, "8/2", 32
    args.hq, args.hkv = (int(x) for x in args.heads.split("/"))
    args.dtype = jnp.dtype(args.dtype)
    impls = common.parse_impls(args.impl)
    result = dict(
        env=common.environment(),
        params={k: str(v) for k, v in vars(args).items()},
        rows=[],
        ceilings=None,
    )

    def record(row):
        result["rows"].append(row)
        metric = f"{row['op']} {row['batch']}"
        print(common.status_line(f"{row['impl']:>9}", row, metric), flush=True)

    wanted = set(args.batches.split(","))
    for batch in batches(args.batch, args.prefix, args.own, args.page_size):
        if batch.name in wanted:
            print(
                f"batch {batch.name}: B={len(batch.own)} prefixes {batch.prefix_lens[:4]}",
                flush=True,
            )
            time_batch(batch, impls, args, check=args.check, record=record)

    fit_rows = []
    if args.fit:
        grid = fit_grid(args) if not args.small else batches(args.batch, args.prefix, args.own, 16)
        for batch in grid:
            print(batch.name, flush=True)
            fit_rows += time_batch(
                batch,
                [args.fit_impl],
                args,
                check=False,
                record=lambda r: print(common.status_line(f"{r['impl']:>9}", r, r["op"])),
            )

    # The ceilings after the cases (right after a large matmul the first timings on an H200
    # came out slow; see bench_decode.py).
    if not args.no_ceilings:
        nbytes = 2**24 if args.small else 4 * 2**30
        result["ceilings"] = dict(
            read=common.read_bandwidth(nbytes), copy=common.copy_bandwidth(nbytes // 2)
        )
        gbps = result["ceilings"]["read"]["gbps"]
        print(f"read ceiling {gbps:.0f} GB/s (jnp.sum over {nbytes / 2**30:.2f} GiB)", flush=True)
        for row in result["rows"]:
            row["floor_us"] = row["unique_bytes"] / (gbps * 1e3)
            if "us" in row:
                row["x_floor"] = row["us"] / row["floor_us"]
    by = {(r["batch"], r["impl"], r["op"]): r for r in result["rows"] if "us" in r}
    for (b, impl, op), row in by.items():
        paged = by.get((b, impl.split("-")[0], "paged"))  # pallas-mgpu: the pallas paged decode
        if op == "cascade" and paged:
            row["speedup_vs_paged"] = paged["us"] / row["us"]
        best = min(
            (r["us"] for (b2, _, o2), r in by.items() if b2 == b and o2 == "paged"), default=None
        )
        if op == "cascade" and best:
            row["speedup_vs_best_paged"] = best / row["us"]

    if fit_rows:
        shape = {b.name: b for b in grid}
        points = []
        for batch in {r["batch"] for r in fit_rows}:
            rs = {r["op"]: r for r in fit_rows if r["batch"] == batch and "us" in r}
            if len(rs) == 2:
                pt = {
                    k: rs["cascade"][k]
                    for k in (
                        "joined_bytes",
                        "unique_bytes",
                        "repeated_bytes",
                        "rows",
                        "prefix_flops",
                    )
                }
                b = shape[batch]
                groups = len({g for g in b.prefix_of if g >= 0})
                points.append(
                    pt
                    | dict(
                        batch=batch,
                        b=len(b.own),
                        prefix=max(b.prefix_lens),
                        per=len(b.own) // groups if groups else 0,
                        own=max(b.own),
                        cascade_us=rs["cascade"]["us"],
                        paged_us=rs["paged"]["us"],
                    )
                )
        model, coef = fit_model(points, cc.CascadeCostModel())
        shipped = cc.CascadeCostModel()
        decisions = switch_decisions(points, model)
        # What the engine decides today: the shipped defaults, with its default
        # cascade_min_tokens (ExecutionConfig) -- measured, not fitted to these points.
        min_tokens = ExecutionConfig().cascade_min_tokens
        as_shipped = switch_decisions(points, shipped, min_tokens)
        result["cost_model"] = dataclasses.asdict(model)
        result["fit"] = dict(
            coefficients=coef,
            decisions=decisions,
            shipped=dict(model=dataclasses.asdict(shipped), min_tokens=min_tokens),
            shipped_decisions=as_shipped,
            crossovers=crossovers(points),
        )
        print("\nswitch rule (fitted cost model):", result["cost_model"])
        print(
            common.table(
                [
                    d
                    | dict(
                        shipped_use_cascade=s["use_cascade"],
                        shipped_slowdown_vs_paged=s["slowdown_vs_paged"],
                    )
                    for d, s in zip(decisions, as_shipped, strict=True)
                ],
                [
                    ("batch", "batch", ""),
                    ("cascade_us", "cascade us", ".1f"),
                    ("paged_us", "paged us", ".1f"),
                    ("predicted_cascade_us", "model cascade", ".1f"),
                    ("predicted_paged_us", "model paged", ".1f"),
                    ("use_cascade", "switch (fit)", ""),
                    ("slowdown_vs_paged", "vs paged (fit)", "+.1%"),
                    ("shipped_use_cascade", "switch (shipped)", ""),
                    ("shipped_slowdown_vs_paged", "vs paged (shipped)", "+.1%"),
                ],
            )
        )
        for name, rows in (("fitted", decisions), ("shipped", as_shipped)):
            worst = max(d["slowdown_vs_paged"] for d in rows)
            missed = max(d["slowdown_vs_best"] for d in rows)
            print(
                f"the {name} switch: worst batch {worst:+.1%} against paged decode, "
                f"{missed:+.1%} against the faster op"
            )
        print("\nwhere cascade pays (measured; speedup = paged / cascade at each prefix):")
        print(
            common.table(
                result["fit"]["crossovers"],
                [
                    ("b", "batch", "d"),
                    ("per", "requests a prefix", "d"),
                    ("own", "own tokens", "d"),
                    ("prefixes", "prefix tokens", ""),
                    ("speedups", "speedup", ""),
                    ("pays_from", "faster from", ""),
                ],
            )
        )

    common.write_json(args.json, result)
    print()
    print(
        common.table(
            [r for r in result["rows"] if "us" in r],
            [
                ("batch", "batch", ""),
                ("impl", "impl", ""),
                ("op", "op", ""),
                ("config", "config", ""),
                ("us", "time (us)", ".1f"),
                ("floor_us", "floor (us)", ".1f"),
                ("x_floor", "x floor", ".2f"),
                ("speedup_vs_paged", "vs paged (same impl)", ".2f"),
                ("speedup_vs_best_paged", "vs best paged", ".2f"),
                ("rel_err", "rel err", ".1e"),
            ],
        )
    )
    return result


if __name__ == "__main__":
    main()
