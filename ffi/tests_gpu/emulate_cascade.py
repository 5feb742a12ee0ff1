"""Lane-level CPU emulation of the tensor-core cascade kernel (jaxattn/cascade.cuh), no GPU needed.

Transcribed one to one from the kernel and run on the PTX semantics of ldmatrix(.trans) and
mma.m16n8k16 of emulate_mma_decode.py (next to this file):

* the device plan of a prefix block (``plan_prefix_block``: the per-thread bins of the histogram,
  the block-wide exclusive scans in thread order, the tile search, the member ranks) and the
  split rule of jaxattn/cascade.h (``cascade_splits``, ``cascade_chunk``);
* the block roles of the grid (prefix blocks first, KV head fastest; own blocks after);
* the prefix block (``cascade_prefix_mma``): the ring (offsets one tile ahead, 16-byte copies
  landing "early" or "late"), the Q fragments from global memory, the ldmatrix lane addresses on
  the ring's padded rows, S = Q K^T and O += P V, the masked tail, the quad sums and the
  stores of every row's state to its workspace slot;
* the own block, whose loop is the decode kernel's: emulate_mma_decode.run_block;
* the merge kernel (the parts of a request in workspace order, the scalar checks).

Each case is a random batch of requests over a few prefixes (pages permuted, every unread slot
NaN, tables padded with entries to NaN pages) checked against a float64 joined-table
attention; edited cases check the index contract: a page id outside the cache in a prefix (every
request continuing it NaN, the others exact), in an own table, a prefix_of out of range, a
prefix length that is not a multiple of the page size, garbage past every length (nothing
changes). Keep it in step with the kernel when either changes.

Every case runs with the ring schedules of the prefix block: the portable kernel's
(cascade_prefix_mma: each tile's table entries read into a register in the iteration that
stores their offsets) and the Hopper kernel's (cascade_prefix_wgmma, cascade_sm90.cuh, whose ring
and groups are this block's): the entries fetched into page slots by 4-byte copies NS - 1 tiles
ahead, in the commit groups of earlier copies, and read after the tile's products; the slots
start as garbage, so an entry read before its group landed ("late") poisons the block. The
Hopper schedule runs again with the ring's offsets as row numbers (JAXATTN_CASCADE_ROW_UNITS:
stored at a permuted slot, read four to a thread), whose slots also start as garbage, and so
does the portable one with every own block's ring in that form too (JAXATTN_DECODE_ROW_UNITS);
the row-number forms are the kernels' default build, the others what the switches' 0 builds.

    python3 emulate_cascade.py [--full]
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import emulate_mma_decode  # noqa: E402
from emulate_mma_decode import (  # noqa: E402
    RowUnits,
    bf16_round,
    ldmatrix_x4,
    mma,
    ring_copies,
    run_block,
)

NEG_INF = -np.inf
RESCALE_SLACK = 8  # cascade.cuh: kCascadeRescaleSlack
TILE, WARPS, NT, ROWS = 64, 4, 128, 64
BINS = 1024
STEP, MIN_CHUNK = 64, 256


# --- jaxattn/cascade.h ----------------------------------------------------------------------


def cascade_tiles(batch, num_prefixes, per_tile):
    if batch <= 0 or num_prefixes <= 0:
        return 0
    used = min(num_prefixes, batch)
    return min(batch, (batch + per_tile - 1) // per_tile + used - 1)


def cascade_blocks_per_head(tiles, target, kv_heads):
    want = (target + kv_heads - 1) // kv_heads + (tiles + 1) // 2
    return 0 if tiles == 0 else max(tiles, want)


def cascade_splits(tiles, target, kv_heads, per_head, max_splits):
    t = max(tiles, 1)
    s = (2 * target + kv_heads * t) // (2 * kv_heads * t)
    s = min(s, per_head // t, max_splits)
    return max(s, 1)


def cascade_chunk(length, splits):
    s = max(1, min(length // MIN_CHUNK, splits))
    chunk = (length + s - 1) // s
    return max(STEP, (chunk + STEP - 1) // STEP * STEP)


def cascade_prefix_parts(length, splits):
    if length <= 0:
        return 0
    chunk = cascade_chunk(length, splits)
    return (length + chunk - 1) // chunk


def prefix_bounds_ok(length, width, page_size, num_pages):
    return (
        length >= 0
        and length % page_size == 0
        and length <= width * page_size
        and (length == 0 or num_pages > 0)
    )


def decode_bounds_ok(length, width, page_size, num_pages):
    return 0 <= length <= width * page_size and (length == 0 or num_pages > 0)


# --- the plan of a prefix block -----------------------------------------------------------------


def plan_prefix_block(P, k, per_tile, per_head):
    """plan_prefix_block: None, or (g, count, members, split); and the batch's split count."""
    G, B = P["num_prefixes"], len(P["prefix_of"])
    chunks = (G + BINS - 1) // BINS
    kper = (BINS + NT - 1) // NT

    def count(g0, n):
        bins = [0] * n
        for b in range(B):
            g = P["prefix_of"][b] - g0
            if 0 <= g < n:
                bins[g] += 1
        return bins

    def own_tiles(bins, n, tid):
        lo = min(n, tid * kper)
        hi = min(n, lo + kper)
        return sum((bins[i] + per_tile - 1) // per_tile for i in range(lo, hi))

    num_tiles = 0
    for c in range(chunks):
        n = min(BINS, G - c * BINS)
        bins = count(c * BINS, n)
        num_tiles += sum(own_tiles(bins, n, tid) for tid in range(NT))
    splits = cascade_splits(num_tiles, P["prefix_target"], P["hkv"], per_head, P["prefix_parts"])
    if num_tiles == 0 or k >= num_tiles * splits:
        return None, splits
    t, split = k % num_tiles, k // num_tiles

    g = first = cnt = -1
    before = 0
    for c in range(chunks):
        n = min(BINS, G - c * BINS)
        bins = count(c * BINS, n)
        mine = [own_tiles(bins, n, tid) for tid in range(NT)]
        excl = np.concatenate([[0], np.cumsum(mine)[:-1]])
        for tid in range(NT):
            at = before + int(excl[tid])
            lo = min(n, tid * kper)
            hi = min(n, lo + kper)
            for i in range(lo, hi):
                tiles = (bins[i] + per_tile - 1) // per_tile
                if at <= t < at + tiles:
                    g, first = c * BINS + i, (t - at) * per_tile
                    cnt = min(per_tile, bins[i] - first)
                at += tiles
        before += sum(mine)
        if g >= 0:
            break
    assert g >= 0, "tile t < num_tiles must be found"

    members = [None] * ROWS
    seen, last = 0, first + cnt
    for b0 in range(0, B, NT):
        if seen >= last:
            break
        flags = [1 if b < B and P["prefix_of"][b] == g else 0 for b in range(b0, b0 + NT)]
        excl = np.concatenate([[0], np.cumsum(flags)[:-1]])
        for tid in range(NT):
            rank = seen + int(excl[tid])
            if flags[tid] and first <= rank < last:
                members[rank - first] = b0 + tid
        seen += sum(flags)
    return (g, cnt, members, split), splits


# --- the prefix block ---------------------------------------------------------------------------


class Ring:
    """KvRing: a ring of ns stages of TILE rows (K and V, rs elements apart, NaN padding) and
    each stage's row offsets; copies land at issue ("early") or at a wait ("late"). `units`:
    the rings' row-number form (emulate_mma_decode.RowUnits)."""

    def __init__(self, kc, vc, geo, table, start, end, d, ns, land, units=False):
        self.kc, self.vc, self.geo, self.table = kc, vc, geo, table
        self.start, self.end, self.d, self.ns, self.land = start, end, d, ns, land
        self.rs, self.ch = d + 8, d // 8
        self.units = RowUnits(ns, d, self.ch) if units else None
        self.off = np.full((ns, TILE), 12345678, np.int64)
        self.ks = np.full((ns, TILE, self.rs), np.nan, np.float32)
        self.vs = np.full((ns, TILE, self.rs), np.nan, np.float32)
        self.slots = np.full((ns, TILE), -(10**9), np.int64)  # page slots: garbage until fetched
        self.groups = [[]]

    def page_of(self, n, tid):
        t = self.start + n * TILE + tid
        return self.table[t // self.geo[0]] if (tid < TILE and t < self.end) else 0

    def store_offset(self, n, tid, page):
        page_size, page_stride, token_stride, num_pages = self.geo
        if tid >= TILE:
            return False
        t = self.start + n * TILE + tid
        live = t < self.end
        ok = live and 0 <= page < num_pages
        off = page * page_stride + (t % page_size) * token_stride if ok else -1
        if self.units:
            self.units.store(n % self.ns, tid, off)
        else:
            self.off[n % self.ns, tid] = off
        return live and not ok

    def _land(self, op):
        if op[0] == "page":
            _, s, tid, value = op
            self.slots[s, tid] = value
            return
        s, r, c, o = op
        for src, dst in ((self.kc, self.ks), (self.vc, self.vs)):
            dst[s, r, c * 8 : c * 8 + 8] = src[o + c * 8 : o + c * 8 + 8] if o >= 0 else 0

    def fetch_page(self, n):
        """KvRing::fetch_page: each row's table entry of tile n (0 past the end) into slot
        n % ns, a 4-byte copy in the open group."""
        for tid in range(TILE):
            op = ("page", n % self.ns, tid, self.page_of(n, tid))
            if self.land == "early":
                self._land(op)
            else:
                self.groups[-1].append(op)

    def fetched_page(self, n, tid):
        return int(self.slots[n % self.ns, tid]) if tid < TILE else 0

    def issue(self, n):
        for op in ring_copies(n % self.ns, self.ch, self.off, self.units):
            if self.land == "early":
                self._land(op)
            else:
                self.groups[-1].append(op)

    def commit(self):
        self.groups.append([])

    def wait(self, pending):
        while len(self.groups) - 1 > pending:
            for op in self.groups.pop(0):
                self._land(op)

    def prologue(self, ntiles, fetch):
        bad = False
        for n in range(self.ns):
            for tid in range(NT):
                bad |= self.store_offset(n, tid, self.page_of(n, tid))
        for n in range(self.ns - 1):
            if n < ntiles:
                self.issue(n)
            if fetch:
                self.fetch_page(n + self.ns)
            self.commit()
        return bad


def run_prefix_block(
    kc, vc, geo, table, start, end, qrows, d, ns, land, q_scale, cap, fetch, units=False
):
    """cascade_prefix_mma: qrows[r] is row r's query (None: no row). Returns {r: (out, m, l)}
    for the rows that exist, as the block stores them."""
    rs, kd = d + 8, d // 16
    ring = Ring(kc, vc, geo, table, start, end, d, ns, land, units)
    ntiles = (end - start + TILE - 1) // TILE
    bad = ring.prologue(ntiles, fetch)

    qa = np.zeros((WARPS, 32, kd, 4, 2), np.float32)
    for warp, lane in itertools.product(range(WARPS), range(32)):
        g, tq = lane // 4, lane % 4
        for i in range(2):
            row = qrows[warp * 16 + g + 8 * i]
            if row is None:
                continue
            for kk in range(kd):
                qa[warp, lane, kk, i] = row[kk * 16 + 2 * tq : kk * 16 + 2 * tq + 2]
                qa[warp, lane, kk, 2 + i] = row[kk * 16 + 8 + 2 * tq : kk * 16 + 8 + 2 * tq + 2]

    o = np.zeros((WARPS, d // 8, 32, 4))
    m = np.full((WARPS, 32, 2), NEG_INF)
    lsum = np.zeros((WARPS, 32, 2))
    lane_k = [((ln % 8 + (ln // 16) * 8) * rs + ((ln // 8) % 2) * 8) * 2 for ln in range(32)]
    lane_v = [((ln % 8 + ((ln // 8) % 2) * 8) * rs + (ln // 16) * 8) * 2 for ln in range(32)]
    for n in range(ntiles):
        ring.wait(ns - 2)
        if n + ns - 1 < ntiles:
            ring.issue(n + ns - 1)
        if fetch:
            ring.fetch_page(n + 2 * ns - 1)
        ring.commit()
        pages = None if fetch else [ring.page_of(n + ns, tid) for tid in range(NT)]
        s, n0 = n % ns, start + n * TILE
        tail = n0 + TILE > end
        for warp in range(WARPS):
            if all(qrows[warp * 16 + r] is None for r in range(16)):
                continue  # warp_live: rows are request-major, so a padding warp has no row
            sc = np.zeros((TILE // 8, 32, 4))
            for kk, npp in itertools.product(range(kd), range(TILE // 16)):
                bfr = ldmatrix_x4(
                    ring.ks[s], [x + (npp * 16 * rs + kk * 16) * 2 for x in lane_k], rs, False
                )
                sc[2 * npp] = mma(sc[2 * npp], qa[warp, :, kk], bfr[:, 0:2])
                sc[2 * npp + 1] = mma(sc[2 * npp + 1], qa[warp, :, kk], bfr[:, 2:4])
            mx = np.full((32, 2), NEG_INF)
            for j, lane, e in itertools.product(range(TILE // 8), range(32), range(4)):
                v = sc[j, lane, e] * q_scale
                if cap > 0:
                    v = cap * math.tanh(v)
                if tail and n0 + j * 8 + 2 * (lane % 4) + (e & 1) >= end:
                    v = NEG_INF
                sc[j, lane, e] = v
                mx[lane, e // 2] = np.fmax(mx[lane, e // 2], v)
            mx = np.array([mx[4 * (x // 4) : 4 * (x // 4) + 4].max(axis=0) for x in range(32)])
            for lane, i in itertools.product(range(32), range(2)):
                mn = np.fmax(m[warp, lane, i], mx[lane, i])
                # The lazy rescale (kCascadeRescaleSlack): the maximum moves only past the slack.
                mn = mn if mn > m[warp, lane, i] + RESCALE_SLACK else m[warp, lane, i]
                mu = 0.0 if mn == NEG_INF else mn
                a = 2.0 ** (m[warp, lane, i] - mu)
                m[warp, lane, i] = mn
                p = 2.0 ** (sc[:, lane, 2 * i : 2 * i + 2] - mu)
                sc[:, lane, 2 * i : 2 * i + 2] = p
                lsum[warp, lane, i] = lsum[warp, lane, i] * a + p.sum()
                o[warp, :, lane, 2 * i : 2 * i + 2] *= a
            for kk in range(TILE // 16):
                pf = np.zeros((32, 4, 2), np.float32)
                pf[:, 0] = sc[2 * kk, :, 0:2]
                pf[:, 1] = sc[2 * kk, :, 2:4]
                pf[:, 2] = sc[2 * kk + 1, :, 0:2]
                pf[:, 3] = sc[2 * kk + 1, :, 2:4]
                pf = bf16_round(pf)
                for dp in range(d // 16):
                    bfr = ldmatrix_x4(
                        ring.vs[s], [x + (kk * 16 * rs + dp * 16) * 2 for x in lane_v], rs, True
                    )
                    o[warp, 2 * dp] = mma(o[warp, 2 * dp], pf, bfr[:, 0:2])
                    o[warp, 2 * dp + 1] = mma(o[warp, 2 * dp + 1], pf, bfr[:, 2:4])
        if fetch:  # read after the products, as the kernel does
            pages = [ring.fetched_page(n + ns, tid) for tid in range(NT)]
        for tid in range(NT):
            bad |= ring.store_offset(n + ns, tid, pages[tid])
    ring.wait(0)

    res = {}
    for warp, lane, i in itertools.product(range(WARPS), range(32), range(2)):
        g, tq = lane // 4, lane % 4
        r = warp * 16 + g + 8 * i
        if qrows[r] is None:
            continue
        ls = lsum[warp, 4 * g : 4 * g + 4, i].sum()  # group_sum<4>
        mm = m[warp, lane, i]
        if bad:
            ls = mm = np.nan
        inv = 0.0 if ls == 0 else 1.0 / ls
        out = res.setdefault(r, [np.full(d, np.nan), mm, ls])[0]
        for j in range(d // 8):
            out[j * 8 + 2 * tq : j * 8 + 2 * tq + 2] = o[warp, j, lane, 2 * i : 2 * i + 2] * inv
    return {r: tuple(v) for r, v in res.items()}


# --- a launch ----------------------------------------------------------------------------------


def launch(P, d, ns, land, fetch, units=False):
    """Every block of cascade_mma_kernel, then cascade_merge_kernel: the output [B, Hq, d]."""
    B, hq, hkv = len(P["prefix_of"]), P["hq"], P["hkv"]
    group = hq // hkv
    parts = P["own_parts"] + P["prefix_parts"]
    ws = np.full((B, hq, parts, d), np.nan)
    ml = np.full((B, hq, parts, 2), np.nan)
    split_slot = [None]
    per_tile = ROWS // group
    tiles = cascade_tiles(B, P["num_prefixes"], per_tile)
    per_head = cascade_blocks_per_head(tiles, P["prefix_target"], hkv)
    geo = (P["page_size"], P["page_stride"], P["token_stride"], P["num_pages"])
    own_blocks = B * hkv * P["own_parts"]
    for x in range(per_head * hkv + own_blocks):
        if x < per_head * hkv:
            kvh = x % hkv
            plan, splits = plan_prefix_block(P, x // hkv, per_tile, per_head)
            if x == 0:
                split_slot[0] = splits
            if plan is None:
                continue
            g, cnt, members, split = plan
            lp = P["prefix_lens"][g]
            if not prefix_bounds_ok(lp, P["prefix_width"], P["page_size"], P["num_pages"]):
                continue
            chunk = cascade_chunk(lp, splits)
            start, end = split * chunk, min(lp, split * chunk + chunk)
            if start >= lp:
                continue
            qrows, slots = [], []
            for r in range(ROWS):
                member, h = r // group, kvh * group + r % group
                ok = member < cnt
                qrows.append(P["q"][members[member], h] if ok else None)
                slots.append((members[member], h) if ok else None)
            kf, vf = (c.reshape(-1)[kvh * P["head_stride"] :] for c in (P["kc"], P["vc"]))
            res = run_prefix_block(
                kf,
                vf,
                geo,
                P["prefix_tables"][g],
                start,
                end,
                qrows,
                d,
                ns,
                land,
                P["q_scale"],
                P["cap"],
                fetch,
                units,
            )
            for r, (out, mm, ls) in res.items():
                b, h = slots[r]
                ws[b, h, P["own_parts"] + split] = out
                ml[b, h, P["own_parts"] + split] = (mm, ls)
        else:
            y = x - per_head * hkv
            part, kvh, b = (
                y % P["own_parts"],
                (y // P["own_parts"]) % hkv,
                y // (P["own_parts"] * hkv),
            )
            L = P["seq_lens"][b]
            if not decode_bounds_ok(L, P["own_width"], P["page_size"], P["num_pages"]):
                continue
            span = P["partition_size"] or P["own_width"] * P["page_size"]
            start, end = part * span, min(L, part * span + span)
            if start >= L:
                continue
            kf, vf = (c.reshape(-1)[kvh * P["head_stride"] :] for c in (P["kc"], P["vc"]))
            qh = P["q"][b, kvh * group : (kvh + 1) * group]
            res = run_block(
                kf,
                vf,
                geo,
                P["block_tables"][b],
                start,
                end,
                qh,
                group,
                d,
                ns,
                land,
                P["q_scale"],
                P["cap"],
                page_lead=False,  # cascade_own_mma reads the entries in the storing iteration
            )
            for gh, (out, mm, ls) in res.items():
                ws[b, kvh * group + gh, part] = out
                ml[b, kvh * group + gh, part] = (mm, ls)

    out = np.zeros((B, hq, d))
    for b, h in itertools.product(range(B), range(hq)):
        g = P["prefix_of"][b]
        ok, lp = -1 <= g < P["num_prefixes"], 0
        if ok and g >= 0:
            lp = P["prefix_lens"][g]
            ok = prefix_bounds_ok(lp, P["prefix_width"], P["page_size"], P["num_pages"])
        ok = ok and decode_bounds_ok(
            P["seq_lens"][b], P["own_width"], P["page_size"], P["num_pages"]
        )
        if not ok:
            out[b, h] = np.nan
            continue
        span = P["partition_size"] or P["own_width"] * P["page_size"]
        n_own = 0 if P["seq_lens"][b] <= 0 else -(-P["seq_lens"][b] // span)
        n = n_own + (cascade_prefix_parts(lp, split_slot[0]) if lp > 0 else 0)
        idx = [i if i < n_own else i + P["own_parts"] - n_own for i in range(n)]
        mx = np.fmax.reduce([ml[b, h, q, 0] for q in idx], initial=NEG_INF)
        mu = 0.0 if mx == NEG_INF else mx
        w = [ml[b, h, q, 1] * 2.0 ** (ml[b, h, q, 0] - mu) for q in idx]
        acc = sum((wi * ws[b, h, q] for wi, q in zip(w, idx, strict=True)), np.zeros(d))
        ls = sum(w)
        out[b, h] = 0.0 if ls == 0 else acc / ls
    return out


def make_batch(
    rng,
    prefix_pages,
    prefix_of,
    own_lens,
    *,
    hq,
    hkv,
    d,
    page_size,
    layout,
    partition_size,
    target,
    edit,
):
    """A NaN-poisoned batch and its float64 reference (NaN rows where the contract says)."""
    own_pages = [-(-n // page_size) for n in own_lens]
    used = sum(prefix_pages) + sum(own_pages)
    num_pages = used + 3
    perm = list(rng.permutation(num_pages))
    nan_pages = perm[used:]
    shape = (num_pages, page_size, hkv, d) if layout == "bshd" else (num_pages, hkv, page_size, d)
    kc, vc = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)

    def put(cache, page, slot, x):
        if layout == "bshd":
            cache[page, slot] = x
        else:
            cache[page, :, slot] = x

    def fill(n):
        pages = [perm.pop(0) for _ in range(-(-n // page_size))]
        k = bf16_round(rng.standard_normal((n, hkv, d)))
        v = bf16_round(rng.standard_normal((n, hkv, d)))
        for t in range(n):
            put(kc, pages[t // page_size], t % page_size, k[t])
            put(vc, pages[t // page_size], t % page_size, v[t])
        return pages, k, v

    wp, w = max([*prefix_pages, 1]) + 1, max([*own_pages, 1]) + 1
    ptab = rng.choice(nan_pages, size=(len(prefix_pages), wp))
    tab = rng.choice(nan_pages, size=(len(own_lens), w))
    pre = []
    for g, n in enumerate(prefix_pages):
        pages, k, v = fill(n * page_size)
        ptab[g, :n] = pages
        pre.append((k, v))
    dense = []
    for b, n in enumerate(own_lens):
        pages, k, v = fill(n)
        tab[b, : len(pages)] = pages
        g = prefix_of[b]
        pk, pv = pre[g] if g >= 0 else (k[:0], v[:0])
        dense.append((np.concatenate([pk, k]), np.concatenate([pv, v])))
    q = bf16_round(rng.standard_normal((len(own_lens), hq, d)))
    prefix_lens = [n * page_size for n in prefix_pages]
    prefix_of = list(prefix_of)
    bad = set()
    if edit == "bad_prefix_page":  # the last page of prefix 0
        ptab[0, prefix_pages[0] - 1] = num_pages
        bad = {b for b, g in enumerate(prefix_of) if g == 0}
    elif edit == "bad_own_page":
        b = int(np.argmax(own_lens))
        tab[b, own_pages[b] - 1] = -1
        bad = {b}
    elif edit == "bad_prefix_of":
        prefix_of[1] = len(prefix_pages)
        bad = {1}
    elif edit == "bad_prefix_len":  # not a multiple of the page size, or past the table
        prefix_lens[0] = prefix_lens[0] + 1 if page_size > 1 else (wp + 1) * page_size
        bad = {b for b, g in enumerate(prefix_of) if g == 0}
    elif edit == "garbage":
        for g, n in enumerate(prefix_pages):
            ptab[g, n:] = 10**6
        for b, n in enumerate(own_pages):
            tab[b, n:] = -5
    scale, cap = 0.3, (4.0 if d == 128 else 0.0)
    q_scale, cap_l2 = (
        (scale / cap, cap * math.log2(math.e)) if cap else (scale * math.log2(math.e), 0.0)
    )
    token_stride, head_stride = (hkv * d, d) if layout == "bshd" else (d, page_size * d)
    own_cap = w * page_size
    P = dict(
        prefix_of=prefix_of,
        num_prefixes=len(prefix_pages),
        prefix_lens=prefix_lens,
        prefix_tables=ptab,
        prefix_width=wp,
        seq_lens=list(own_lens),
        block_tables=tab,
        own_width=w,
        hq=hq,
        hkv=hkv,
        page_size=page_size,
        page_stride=page_size * hkv * d,
        token_stride=token_stride,
        head_stride=head_stride,
        num_pages=num_pages,
        kc=kc,
        vc=vc,
        q=q,
        q_scale=q_scale,
        cap=cap_l2,
        partition_size=partition_size,
        own_parts=-(-own_cap // partition_size) if partition_size else 1,
        prefix_target=target,
    )
    tiles = cascade_tiles(len(own_lens), len(prefix_pages), ROWS // (hq // hkv))
    per_head = cascade_blocks_per_head(tiles, target, hkv)
    P["prefix_parts"] = max(1, min(-(-wp * page_size // MIN_CHUNK), max(per_head, 1)))

    ref = np.zeros((len(own_lens), hq, d))
    group = hq // hkv
    for b, (k, v) in enumerate(dense):
        if b in bad:
            ref[b] = np.nan
            continue
        for h in range(hq):
            if not len(k):
                continue
            s = k[:, h // group].astype(np.float64) @ q[b, h].astype(np.float64) * scale
            if cap:
                s = cap * np.tanh(s / cap)
            p = np.exp(s - s.max())
            ref[b, h] = p @ v[:, h // group].astype(np.float64) / p.sum()
    return P, ref


def check(
    rng, d, ns, land, layout, page_size, heads, batch, partition_size, target, edit, fetch, units
):
    hq, hkv = heads
    prefix_pages, prefix_of, own_lens = batch
    P, ref = make_batch(
        rng,
        prefix_pages,
        prefix_of,
        own_lens,
        hq=hq,
        hkv=hkv,
        d=d,
        page_size=page_size,
        layout=layout,
        partition_size=partition_size,
        target=target,
        edit=edit,
    )
    out = launch(P, d, ns, land, fetch, units)
    nan_ref, nan_out = np.isnan(ref), np.isnan(out)
    if not np.array_equal(nan_ref.all(-1), nan_out.all(-1)) or nan_out[~nan_ref.all(-1)].any():
        return math.inf
    keep = ~nan_ref.all(-1)
    return float(np.abs(out[keep] - ref[keep]).max()) if keep.any() else 0.0


def main(full):
    rng = np.random.default_rng(0)
    batches = [
        # (prefix pages per prefix, prefix_of per request, own tokens per request)
        ([8, 3], [0, 0, 1, -1, 0, 1, 0], [5, 0, 17, 9, 33, 1, 2]),
        ([20], [0] * 19, [3] * 19),  # 19 requests x group: several tiles of one prefix
        ([1, 0, 2], [2, 1, 0, 2], [0, 4, 16, 15]),  # an empty prefix
        ([72], [0, 0], [7, 0]),  # prefix blocks of many tiles: the ring laps its stages
    ]
    configs = [
        # (d, stages, layout, page size, (Hq, Hkv), partition, target)
        (64, 4, "bshd", 16, (8, 2), 0, 8),
        (64, 2, "bhsd", 8, (4, 1), 16, 64),
        (128, 3, "bshd", 16, (16, 2), 0, 2),
    ]
    if full:
        configs += [(64, 3, "bhsd", 1, (8, 8), 0, 32), (128, 3, "bhsd", 32, (4, 4), 32, 16)]
    edits = [None, "bad_prefix_page", "bad_own_page", "bad_prefix_of", "bad_prefix_len", "garbage"]
    fails = cases = 0
    # The portable prefix block's schedule, then Hopper's, then each with its rings' row numbers:
    # Hopper's prefix ring (JAXATTN_CASCADE_ROW_UNITS), the portable prefix ring and every own
    # block's (JAXATTN_DECODE_ROW_UNITS: the padded rings).
    schedules = [
        ("mma", False, False),
        ("wgmma", True, False),
        ("wgmma row units", True, True),
        ("mma row units", False, True),
    ]
    for kernel, fetch, units in schedules:
        emulate_mma_decode.UNITS = units and not fetch  # the own blocks' rings
        for (d, ns, layout, page, heads, part, target), batch in itertools.product(
            configs, batches
        ):
            for land, edit in itertools.product(("early", "late"), edits):
                if land == "late" and edit not in (None,) and not full:
                    continue
                err = check(
                    rng, d, ns, land, layout, page, heads, batch, part, target, edit, fetch, units
                )
                cases += 1
                status = "ok" if err < 2e-2 else "FAIL"
                fails += status == "FAIL"
                if status == "FAIL" or full:
                    print(
                        f"{status} {kernel} d={d} stages={ns} {layout} page={page} "
                        f"heads={heads} part={part} target={target} {land} edit={edit} "
                        f"batch={batch}: {err:.3g}"
                    )
    print(f"{cases} cases, {fails} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main("--full" in sys.argv[1:]))
