"""Lane-level CPU emulation of paged_decode_mma_kernel (jaxattn/paged_decode.cuh), no GPU needed.

The kernel's index formulas (ring offsets and copies, ldmatrix lane addresses, fragment
registers, shuffle sources, the shared-memory merge) are transcribed here one to one and run
on the PTX semantics of ldmatrix(.trans) and mma.m16n8k16 (fragment layouts as the PTX ISA
documents them), against a float64 reference, for head_dim 32/64, page sizes 1..128, both
layouts, 2..4 stages, groups 2..8, one pass and split partitions. cp.async copies land either
at issue ("early": catches a copy overwriting a stage still being read) or only when a
wait_group forces them ("late": catches reading a stage before it landed). The index guard is
emulated too: a page id outside the cache among a sequence's pages must make every head of it
NaN (one pass and through the combine), garbage past its length must change nothing.

``--fp8`` emulates paged_decode_mma_fp8_kernel instead: the ring holds FP8 codes (one byte an
element), ldmatrix reads them as b16 pairs, the K and V fragments are built by the kernel's
byte permutes and widened to float16, q is scaled into float16 by its power of two per head and
P is packed to float16, the merge writes each accumulator at its permuted dim; against the same
float64 reference (of the FP8 values).

The 16-bit kernel reads each tile's block-table entries an iteration before it stores their
row offsets at head_dim 64 (MmaDecodeShape::kPageLead), in the iteration that stores them at
32: both schedules run (``run_block``'s ``page_lead``; the cascade's own block, which reads
them in that iteration at every head_dim, passes False).

``--units`` runs the rings in their row-number form, the kernels' default build
(JAXATTN_DECODE_ROW_UNITS=1, KvRing's kRowUnits; without it, the int64 offsets that
JAXATTN_DECODE_ROW_UNITS=0 builds): each row's offset stored as a row number (offset / d,
NO_ROW for none) at the slot that puts a thread's rows side by side, and the copies issued in
the kernel's per-thread order from those slots, which start as garbage.

Keep it in step with the kernels when they change. Run:
python3 emulate_mma_decode.py [--full] [--fp8] [--units]
"""

from __future__ import annotations

import itertools
import math
import sys

import numpy as np

NEG_INF = -np.inf
TILE, WARPS, NT = 64, 4, 128
NO_ROW = 0xFFFFFFFF  # KvRing::kNoRow
UNITS = False  # --units


class RowUnits:
    """KvRing's row-number form for a ring of ns stages of rows of `ch` 16-byte chunks: store
    and issue as KvRing::store_offset / issue do with kRowUnits."""

    def __init__(self, ns, d, ch):
        self.d, self.ch = d, ch
        self.step = NT // ch  # kCopyStep
        self.rows_each = TILE // self.step  # kRowsEach
        assert NT % ch == 0 and TILE % self.step == 0
        assert self.rows_each <= 2 or self.rows_each % 4 == 0
        self.units = np.full((ns, TILE), 0xDEADBEEF, np.int64)  # garbage until stored

    def store(self, s, tid, off):
        assert off < 0 or off % self.d == 0  # every stride is a multiple of head_dim
        slot = (tid % self.step) * self.rows_each + tid // self.step  # unit_slot
        self.units[s, slot] = off // self.d if off >= 0 else NO_ROW

    def copies(self, s):
        """(stage, row, chunk, element offset or -1) of every copy, in issue order."""
        for tid in range(NT):
            c, r0 = tid % self.ch, tid // self.ch
            for i in range(self.rows_each):
                w = int(self.units[s, r0 * self.rows_each + i])
                assert 0 <= w <= NO_ROW, "a row number read before it was stored"
                yield s, r0 + i * self.step, c, (w * self.d if w != NO_ROW else -1)


def bf16_round(x):
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def ldmatrix_x4(rows, lane_addrs, rs, trans):
    """rows [n][rs] elements, lane_addrs[32] byte offsets -> registers [32 lanes][4][2]."""
    mats = []
    for i in range(4):
        m = []
        for r in range(8):
            addr = lane_addrs[8 * i + r]
            assert addr % 16 == 0
            row, col = divmod(addr // 2, rs)
            assert col + 8 <= rs
            m.append(rows[row, col : col + 8])
        mats.append(np.stack(m))
    out = np.zeros((32, 4, 2), np.float32)
    for t in range(32):
        for i in range(4):
            if trans:
                out[t, i] = [mats[i][2 * (t % 4), t // 4], mats[i][2 * (t % 4) + 1, t // 4]]
            else:
                out[t, i] = mats[i][t // 4, 2 * (t % 4) : 2 * (t % 4) + 2]
    return out


def mma(c, a, b):
    """c[32][4] + A @ B with A from a[32][4][2], B from b[32][2][2] (m16n8k16 layouts)."""
    am, bm = np.zeros((16, 16)), np.zeros((16, 8))
    for t in range(32):
        g, tq = t // 4, t % 4
        for e in range(2):
            am[g, 2 * tq + e] = a[t, 0, e]
            am[g + 8, 2 * tq + e] = a[t, 1, e]
            am[g, 2 * tq + 8 + e] = a[t, 2, e]
            am[g + 8, 2 * tq + 8 + e] = a[t, 3, e]
            bm[2 * tq + e, g] = b[t, 0, e]
            bm[2 * tq + 8 + e, g] = b[t, 1, e]
    cm = am @ bm
    out = c.copy()
    for t in range(32):
        g, tq = t // 4, t % 4
        out[t] += [cm[g, 2 * tq], cm[g, 2 * tq + 1], cm[g + 8, 2 * tq], cm[g + 8, 2 * tq + 1]]
    return out


def ring_copies(s, ch, off, units):
    """KvRing::issue's copies of stage s, (stage, row, chunk, element offset or -1) each, from
    the int64 offsets `off` or, in the row-number form, from `units` (a RowUnits)."""
    if units:
        return units.copies(s)
    copies = TILE * ch
    return (
        (s, *divmod(idx, ch), int(off[s, idx // ch]))
        for tid in range(NT)
        for i in range((copies + NT - 1) // NT)
        for idx in [tid + i * NT]
        if copies % NT == 0 or idx < copies
    )


def run_block(kc, vc, geo, table, start, end, q, group, d, ns, land, q_scale, cap, page_lead=None):
    """One block: kc/vc flat caches offset to the KV head. Returns {head: (out, m, l)}.
    page_lead: read tile n + ns's pages an iteration ahead of their store (None: as
    paged_decode_mma_kernel does at this head_dim, MmaDecodeShape::kPageLead)."""
    if page_lead is None:
        page_lead = d == 64
    page_size, page_stride, token_stride, num_pages = geo
    rs, ch, kd = d + 8, d // 8, d // 16
    off = np.full((ns, TILE), 12345678, np.int64)
    units = RowUnits(ns, d, ch) if UNITS else None
    ks = np.full((ns, TILE, rs), np.nan, np.float32)  # padding columns stay NaN
    vs = np.full((ns, TILE, rs), np.nan, np.float32)
    groups = [[]]  # committed groups of copies, then the open one

    def page_of(n, tid):
        t = start + n * TILE + tid
        return table[t // page_size] if (tid < TILE and t < end) else 0

    def store_offset(n, tid, page):  # True: a page id outside the cache
        t = start + n * TILE + tid
        if tid >= TILE:
            return False
        live = t < end
        ok = live and 0 <= page < num_pages
        off[n % ns, tid] = page * page_stride + (t % page_size) * token_stride if ok else -1
        if units:
            units.store(n % ns, tid, int(off[n % ns, tid]))
        return live and not ok

    def land_copy(op):
        s, r, c, o = op
        ks[s, r, c * 8 : c * 8 + 8] = kc[o + c * 8 : o + c * 8 + 8] if o >= 0 else 0
        vs[s, r, c * 8 : c * 8 + 8] = vc[o + c * 8 : o + c * 8 + 8] if o >= 0 else 0

    def issue(n):
        for op in ring_copies(n % ns, ch, off, units):
            if land == "early":
                land_copy(op)
            else:
                groups[-1].append(op)

    def commit():
        groups.append([])

    def wait(n_pending):
        while len(groups) - 1 > n_pending:
            for op in groups.pop(0):
                land_copy(op)

    ntiles = (end - start + TILE - 1) // TILE
    bad = False  # the block-wide OR of every thread's flag (__syncthreads_or)
    for n in range(ns):
        for tid in range(NT):
            bad |= store_offset(n, tid, page_of(n, tid))
    for n in range(ns - 1):
        if n < ntiles:
            issue(n)
        commit()

    qa = np.zeros((32, kd, 2, 2), np.float32)
    for lane in range(32):
        g, tq = lane // 4, lane % 4
        if g < group:
            for kk in range(kd):
                qa[lane, kk, 0] = q[g, kk * 16 + 2 * tq : kk * 16 + 2 * tq + 2]
                qa[lane, kk, 1] = q[g, kk * 16 + 8 + 2 * tq : kk * 16 + 8 + 2 * tq + 2]

    o = np.zeros((WARPS, 32, kd, 4))
    m = np.full((WARPS, 32), NEG_INF)
    lsum = np.zeros((WARPS, 32))
    # The pages of tile n + ns, stored after tile n: read in that iteration, or (page_lead)
    # an iteration earlier, after tile n - 1's store.
    pages = [page_of(ns, tid) for tid in range(NT)] if page_lead else None
    for n in range(ntiles):
        wait(ns - 2)
        if n + ns - 1 < ntiles:
            issue(n + ns - 1)
        commit()
        if not page_lead:
            pages = [page_of(n + ns, tid) for tid in range(NT)]
        s = n % ns
        for warp in range(WARPS):
            rb = warp * 16
            t0 = start + n * TILE + rb
            if t0 >= end:
                continue
            lane_off = [
                ((rb + lane % 8 + (lane // 16) * 8) * rs + ((lane // 8) % 2) * 8) * 2
                for lane in range(32)
            ]
            sc = [np.zeros((32, 4)), np.zeros((32, 4))]
            for kk in range(kd):
                kf = ldmatrix_x4(ks[s], [x + kk * 32 for x in lane_off], rs, False)
                a = np.zeros((32, 4, 2), np.float32)
                a[:, 0], a[:, 2] = qa[:, kk, 0], qa[:, kk, 1]
                sc[0] = mma(sc[0], a, kf[:, 0:2])
                sc[1] = mma(sc[1], a, kf[:, 2:4])
            pr = np.zeros((32, 2, 2))
            mx = np.full(32, NEG_INF)
            for lane, h, e in itertools.product(range(32), range(2), range(2)):
                v = sc[h][lane, e] * q_scale
                if cap > 0:
                    v = cap * math.tanh(v)
                pr[lane, h, e] = v if t0 + 8 * h + 2 * (lane % 4) + e < end else NEG_INF
                mx[lane] = max(mx[lane], pr[lane, h, e])
            mx = np.array([mx[4 * (x // 4) : 4 * (x // 4) + 4].max() for x in range(32)])
            alpha = np.zeros(32)
            for lane in range(32):
                m_new = max(m[warp, lane], mx[lane])
                m_use = 0.0 if m_new == NEG_INF else m_new
                alpha[lane] = 2.0 ** (m[warp, lane] - m_use)
                pr[lane] = 2.0 ** (pr[lane] - m_use)
                lsum[warp, lane] = lsum[warp, lane] * alpha[lane] + pr[lane].sum()
                m[warp, lane] = m_new
            b = bf16_round(pr.reshape(32, 4)).reshape(32, 2, 2)
            for j in range(kd):
                for lane in range(32):
                    tq = lane % 4
                    a_lo, a_hi = alpha[8 * tq], alpha[8 * tq + 4]
                    o[warp, lane, j] *= [a_lo, a_hi, a_lo, a_hi]
                vf = ldmatrix_x4(vs[s], [x + j * 32 for x in lane_off], rs, True)
                o[warp, :, j] = mma(o[warp, :, j], vf, b)
        for tid in range(NT):
            bad |= store_offset(n + ns, tid, pages[tid])
        if page_lead:
            pages = [page_of(n + ns + 1, tid) for tid in range(NT)]
    wait(0)

    red = np.full((WARPS, 8, d + 2), np.nan)
    for warp, lane in itertools.product(range(WARPS), range(32)):
        g, tq = lane // 4, lane % 4
        for j in range(kd):
            red[warp, 2 * tq, j * 16 + g] = o[warp, lane, j, 0]
            red[warp, 2 * tq + 1, j * 16 + g] = o[warp, lane, j, 1]
            red[warp, 2 * tq, j * 16 + g + 8] = o[warp, lane, j, 2]
            red[warp, 2 * tq + 1, j * 16 + g + 8] = o[warp, lane, j, 3]
        if tq == 0:
            red[warp, g, d] = m[warp, lane]
            red[warp, g, d + 1] = lsum[warp, 4 * g : 4 * g + 4].sum()
    res = {}
    for g in range(group):
        mx = red[:, g, d].max()
        m_use = 0.0 if mx == NEG_INF else mx
        wt = 2.0 ** (red[:, g, d] - m_use)
        ls = (wt * red[:, g, d + 1]).sum()
        out = (wt[:, None] * red[:, g, :d]).sum(0)
        if bad:
            out, mx, ls = np.full(d, np.nan), np.nan, np.nan
        res[g] = (np.zeros(d) if ls == 0 else out / ls, mx, ls)
    return res


def f16_round(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def fp8_round(x):
    """Values of an e4m3 cache (ml_dtypes rounding, saturated)."""
    import ml_dtypes

    x = np.clip(np.asarray(x, np.float32), -448, 448)
    return x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def ldmatrix_x4_bytes(rows, lane_addrs, rs):
    """ldmatrix (b16, no transpose) over a byte array rows [n][rs]: lane (g, t) gets, of each
    of the 4 matrices, bytes 4t .. 4t+3 of row g. Returns [32 lanes][4][4 bytes]."""
    out = np.zeros((32, 4, 4), np.float32)
    mats = []
    for i in range(4):
        m = []
        for r in range(8):
            addr = lane_addrs[8 * i + r]
            assert addr % 16 == 0
            row, col = divmod(addr, rs)
            assert col + 16 <= rs
            m.append(rows[row, col : col + 16])
        mats.append(np.stack(m))
    for t in range(32):
        for i in range(4):
            out[t, i] = mats[i][t // 4, 4 * (t % 4) : 4 * (t % 4) + 4]
    return out


def byte_perm(a, b, sel):
    """PTX prmt on 4-element "words" (each element one byte): nibble i of sel picks byte i."""
    src = list(a) + list(b)
    return [src[(sel >> (4 * i)) & 7] for i in range(4)]


def run_block_fp8(kc, vc, geo, table, start, end, q, group, d, ns, land, q_scale, cap):
    """paged_decode_mma_fp8_kernel: as run_block, with the FP8 ring and fragments."""
    page_size, page_stride, token_stride, num_pages = geo
    rs, ch, kd = d + 16, d // 16, d // 16
    off = np.full((ns, TILE), 12345678, np.int64)
    units = RowUnits(ns, d, ch) if UNITS else None
    ks = np.full((ns, TILE, rs), np.nan, np.float32)
    vs = np.full((ns, TILE, rs), np.nan, np.float32)
    groups = [[]]

    def page_of(n, tid):
        t = start + n * TILE + tid
        return table[t // page_size] if (tid < TILE and t < end) else 0

    def store_offset(n, tid, page):
        t = start + n * TILE + tid
        if tid >= TILE:
            return False
        live = t < end
        ok = live and 0 <= page < num_pages
        off[n % ns, tid] = page * page_stride + (t % page_size) * token_stride if ok else -1
        if units:
            units.store(n % ns, tid, int(off[n % ns, tid]))
        return live and not ok

    def land_copy(op):  # 16-byte copies: 16 elements
        s, r, c, o = op
        ks[s, r, c * 16 : c * 16 + 16] = kc[o + c * 16 : o + c * 16 + 16] if o >= 0 else 0
        vs[s, r, c * 16 : c * 16 + 16] = vc[o + c * 16 : o + c * 16 + 16] if o >= 0 else 0

    def issue(n):
        for op in ring_copies(n % ns, ch, off, units):
            if land == "early":
                land_copy(op)
            else:
                groups[-1].append(op)

    def commit():
        groups.append([])

    def wait(n_pending):
        while len(groups) - 1 > n_pending:
            for op in groups.pop(0):
                land_copy(op)

    ntiles = (end - start + TILE - 1) // TILE
    bad = False
    for n in range(ns):
        for tid in range(NT):
            bad |= store_offset(n, tid, page_of(n, tid))
    for n in range(ns - 1):
        if n < ntiles:
            issue(n)
        commit()

    # q: per head, the power of two that brings its largest |q| into [2^14, 2^15).
    qa = np.zeros((32, kd, 2, 2), np.float32)
    post = np.ones(32)
    for lane in range(32):
        g, tq = lane // 4, lane % 4
        if g < group:
            qmax = np.abs(q[g]).max()
            e = int(np.frexp(np.float32(qmax))[1]) - 1 + 127 if qmax > 0 else 0
            biased = min(max(268 - e, 1), 253)
            pre = 2.0 ** (biased - 127)
            post[lane] = 2.0 ** (127 - biased)
            for kk in range(kd):
                x = q[g, kk * 16 + 4 * tq : kk * 16 + 4 * tq + 4] * pre
                qa[lane, kk, 0], qa[lane, kk, 1] = f16_round(x[:2]), f16_round(x[2:])

    o = np.zeros((WARPS, 32, kd, 4))
    m = np.full((WARPS, 32), NEG_INF)
    lsum = np.zeros((WARPS, 32))
    for n in range(ntiles):
        wait(ns - 2)
        if n + ns - 1 < ntiles:
            issue(n + ns - 1)
        commit()
        pages = [page_of(n + ns, tid) for tid in range(NT)]
        s = n % ns
        for warp in range(WARPS):
            rb = warp * 16
            t0 = start + n * TILE + rb
            if t0 >= end:
                continue
            k_off = [
                (rb + lane % 8 + (lane // 16) * 8) * rs + ((lane // 8) % 2) * 16
                for lane in range(32)
            ]
            sc = [np.zeros((32, 4)), np.zeros((32, 4))]
            for k2 in range(d // 32):
                kf = ldmatrix_x4_bytes(ks[s], [x + k2 * 32 for x in k_off], rs)
                # fp8x4_to_f16x2: (byte 0, 1) -> b0, (2, 3) -> b1, exact.
                kb = kf.reshape(32, 4, 2, 2)
                for step, (lo, hi) in ((2 * k2, (0, 2)), (2 * k2 + 1, (1, 3))):
                    a = np.zeros((32, 4, 2), np.float32)
                    a[:, 0], a[:, 2] = qa[:, step, 0], qa[:, step, 1]
                    sc[0] = mma(sc[0], a, kb[:, lo])
                    sc[1] = mma(sc[1], a, kb[:, hi])
            pr = np.zeros((32, 2, 2))
            mx = np.full(32, NEG_INF)
            for lane, h, e in itertools.product(range(32), range(2), range(2)):
                v = sc[h][lane, e] * q_scale * post[lane]
                if cap > 0:
                    v = cap * math.tanh(v)
                pr[lane, h, e] = v if t0 + 8 * h + 2 * (lane % 4) + e < end else NEG_INF
                mx[lane] = max(mx[lane], pr[lane, h, e])
            mx = np.array([mx[4 * (x // 4) : 4 * (x // 4) + 4].max() for x in range(32)])
            alpha = np.zeros(32)
            for lane in range(32):
                m_new = max(m[warp, lane], mx[lane])
                m_use = 0.0 if m_new == NEG_INF else m_new
                alpha[lane] = 2.0 ** (m[warp, lane] - m_use)
                pr[lane] = 2.0 ** (pr[lane] - m_use)
                lsum[warp, lane] = lsum[warp, lane] * alpha[lane] + pr[lane].sum()
                m[warp, lane] = m_new
            b = f16_round(pr.reshape(32, 4)).reshape(32, 2, 2)
            for jj in range(d // 32):
                a = np.zeros((2, 32, 4, 2), np.float32)
                for lane in range(32):
                    g, tq = lane // 4, lane % 4
                    base = (rb + 2 * tq) * rs + 4 * g + jj * 32
                    flat = vs[s].reshape(-1)
                    r0, r1, r2, r3 = (
                        flat[base + dr * rs : base + dr * rs + 4] for dr in (0, 1, 8, 9)
                    )
                    w = [
                        byte_perm(r0, r1, 0x5140),
                        byte_perm(r2, r3, 0x5140),
                        byte_perm(r0, r1, 0x7362),
                        byte_perm(r2, r3, 0x7362),
                    ]
                    for s2 in range(2):
                        lo01, hi01 = w[2 * s2][:2], w[2 * s2][2:]
                        lo23, hi23 = w[2 * s2 + 1][:2], w[2 * s2 + 1][2:]
                        a[s2, lane] = [lo01, hi01, lo23, hi23]
                for s2 in range(2):
                    j = 2 * jj + s2
                    for lane in range(32):
                        tq = lane % 4
                        a_lo, a_hi = alpha[8 * tq], alpha[8 * tq + 4]
                        o[warp, lane, j] *= [a_lo, a_hi, a_lo, a_hi]
                    o[warp, :, j] = mma(o[warp, :, j], a[s2], b)
        for tid in range(NT):
            bad |= store_offset(n + ns, tid, pages[tid])
    wait(0)

    def out_dim(j, r):
        return 32 * (j // 2) + 4 * (r % 8) + 2 * (j % 2) + r // 8

    red = np.full((WARPS, 8, d + 2), np.nan)
    for warp, lane in itertools.product(range(WARPS), range(32)):
        g, tq = lane // 4, lane % 4
        for j in range(kd):
            red[warp, 2 * tq, out_dim(j, g)] = o[warp, lane, j, 0]
            red[warp, 2 * tq + 1, out_dim(j, g)] = o[warp, lane, j, 1]
            red[warp, 2 * tq, out_dim(j, g) + 1] = o[warp, lane, j, 2]
            red[warp, 2 * tq + 1, out_dim(j, g) + 1] = o[warp, lane, j, 3]
        if tq == 0:
            red[warp, g, d] = m[warp, lane]
            red[warp, g, d + 1] = lsum[warp, 4 * g : 4 * g + 4].sum()
    res = {}
    for g in range(group):
        mx = red[:, g, d].max()
        m_use = 0.0 if mx == NEG_INF else mx
        wt = 2.0 ** (red[:, g, d] - m_use)
        ls = (wt * red[:, g, d + 1]).sum()
        out = (wt[:, None] * red[:, g, :d]).sum(0)
        if bad:
            out, mx, ls = np.full(d, np.nan), np.nan, np.nan
        res[g] = (np.zeros(d) if ls == 0 else out / ls, mx, ls)
    return res


FP8 = False  # main(--fp8): emulate the FP8 kernel


def check(rng, d, page_size, layout, ns, land, group, length, part, hkv=2, edit=None):
    """Largest error against float64; edit "bad": a page id outside the cache at the last
    token's page (every output must be NaN: returns 0 if so, inf if not); "garbage": entries
    past the length outside the cache (the result must not change)."""
    npages = max(1, -(-length // page_size)) + 3
    table = rng.permutation(npages)  # entries past the sequence point at NaN pages
    shape = (npages, page_size, hkv, d) if layout == "bshd" else (npages, hkv, page_size, d)
    kc, vc = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    rnd = fp8_round if FP8 else bf16_round
    dk = rnd(rng.standard_normal((length, hkv, d)))
    dv = rnd(rng.standard_normal((length, hkv, d)))
    for t in range(length):
        pg, slot = table[t // page_size], t % page_size
        if layout == "bshd":
            kc[pg, slot], vc[pg, slot] = dk[t], dv[t]
        else:
            kc[pg, :, slot], vc[pg, :, slot] = dk[t], dv[t]
    if edit == "bad":
        table[(length - 1) // page_size] = npages
    elif edit == "garbage":
        used = -(-length // page_size)
        table[used:] = [-1 if i % 2 else 10**6 for i in range(npages - used)]
    token_stride, head_stride = (hkv * d, d) if layout == "bshd" else (d, page_size * d)
    geo = (page_size, page_size * hkv * d, token_stride, npages)
    q = bf16_round(rng.standard_normal((hkv * group, d)))
    scale, cap = 0.3, (4.0 if d == 64 else 0.0)
    if cap:
        q_scale, cap_log2e = scale / cap, cap * math.log2(math.e)
    else:
        q_scale, cap_log2e = scale * math.log2(math.e), 0.0
    parts = (
        [(0, length)] if part == 0 else [(s, min(length, s + part)) for s in range(0, length, part)]
    )
    worst = 0.0
    for kvh in range(hkv):
        kflat, vflat = kc.reshape(-1)[kvh * head_stride :], vc.reshape(-1)[kvh * head_stride :]
        qh = q[kvh * group : (kvh + 1) * group]
        block = run_block_fp8 if FP8 else run_block
        res = [
            block(kflat, vflat, geo, table, s, e, qh, group, d, ns, land, q_scale, cap_log2e)
            for s, e in parts
        ]
        for g in range(group):
            if part == 0:
                out = res[0][g][0]
            else:  # decode_combine_kernel
                mx = np.fmax.reduce([r[g][1] for r in res], initial=NEG_INF)  # fmaxf
                m_use = 0.0 if mx == NEG_INF else mx
                w = np.array([r[g][2] * 2.0 ** (r[g][1] - m_use) for r in res])
                out = sum(wi * r[g][0] for wi, r in zip(w, res, strict=True))
                out = np.zeros(d) if w.sum() == 0 else out / w.sum()
            if edit == "bad":
                if not np.isnan(out).all():
                    return math.inf
                continue
            ref = np.zeros(d)
            if length:
                s = dk[:, kvh].astype(np.float64) @ qh[g].astype(np.float64) * scale
                if cap:
                    s = cap * np.tanh(s / cap)
                p = np.exp(s - s.max())
                ref = p @ dv[:, kvh].astype(np.float64) / p.sum()
            if np.isnan(out).any():
                return math.inf
            worst = max(worst, float(np.abs(out - ref).max()))
    return worst


def main(full):
    global FP8, UNITS
    FP8 = "--fp8" in sys.argv[1:]
    UNITS = "--units" in sys.argv[1:]
    rng = np.random.default_rng(0)
    lengths = [
        (1, 0),
        (3, 0),
        (17, 0),
        (255, 0),
        (513, 256),
        (130, 100),
        (0, 0),
        (64, 0),
        (200, 64),
    ]
    configs = [(1, 3), (3, 2), (3, 3), (16, 3), (16, 4), (128, 4)]  # (page size, stages)
    dims = (32, 64)  # the two schedules of the table read (kPageLead)
    groups = (2, 4, 8) if full else (4, 8)
    fails = cases = 0
    for d, (page, ns), layout, land, group in itertools.product(
        dims, configs, ("bshd", "bhsd"), ("early", "late"), groups
    ):
        for (length, part), edit in itertools.product(lengths, (None, "bad", "garbage")):
            if (d == 64 and length > 300) or (edit and (length == 0 or land == "late")):
                continue
            err = check(rng, d, page, layout, ns, land, group, length, part, edit=edit)
            cases += 1
            if not err < 2e-2:
                fails += 1
                print(
                    f"FAIL d={d} page={page} {layout} stages={ns} {land} group={group} "
                    f"len={length} part={part} edit={edit}: max error {err}"
                )
    print(f"{cases} cases, {fails} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main("--full" in sys.argv[1:]))
