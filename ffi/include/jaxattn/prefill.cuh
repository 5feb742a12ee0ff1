// Prefix prefill / extend attention over paged K/V, one source for CUDA and HIP.
//
// A block owns a tile of kBM query rows of one request and one query head. Row i of a
// request (Lq new tokens, Lk keys in all) sees key j iff j <= i + (Lk - Lq). Key tiles come in
// two stages: first the tiles every row of the block sees in full (the cached prefix and the
// start of the new tokens) with no mask arithmetic at all, then the tiles that cross the
// diagonal, masked; the loop stops at the tile holding the last row's last visible key, so
// nothing above the diagonal is ever loaded.
//
// Paged rows are addressed incrementally (the k_delta / v_delta idea): the cursor of each row
// of the tile keeps its element offset and page-table entry and steps to the same row of the
// next tile by (next entry - current entry) * page_stride + (offset change) * token_stride,
// so the loop does no full address arithmetic and reads each page-table entry once. K and V
// share the cache geometry, so one offset serves both.
//
// The request and tile of a block come from cu_seqlens_q: grid.x is an upper bound on the
// number of tiles (ceil(Tq / kBM) + batch); blocks past the last tile zero the padding rows
// after cu_seqlens_q[batch], so every output row is written.
//
// Three kernels:
//   sm90  Hopper warpgroup MMA (wgmma, sm_90a only; prefill_sm90.cuh / prefill_sm90.cu):
//         128-row tiles, two warpgroups, 3-stage cp.async ring of 128-key tiles, bf16/f16,
//         head_dim 64 and 128. Used on compute capability 9.0 when the library was built with
//         90 among JAXATTN_CUDA_ARCHS (JAXATTN_HAVE_SM90A) and the requests bring at least
//         kSm90MinRowsPerRequest new tokens on average: shorter extends leave most rows of a
//         128-row tile empty, and the mma kernel's 64-row tiles served them faster on an H200
//         (32 x (1000 + 24), bf16, 32/8: 179 us against 227 us).
//   mma   tensor-core mma.sync m16n8k16 (bf16/f16 with f32 accumulation, cp.async double
//         buffering, swizzled shared memory) on NVIDIA sm_80+ for head_dim 64 and 128.
//   simt  portable SIMT kernel (f32 math in shared memory) for everything else and for HIP.
// FP8 caches (under a bf16 / f16 q): the simt kernel widens each element to float as it reads
// it; the mma and sm90 kernels have FP8 variants (prefill_mma_fp8_kernel here,
// prefill_sm90_fp8_kernel in prefill_sm90.cuh) that copy the tiles as stored, widen them to
// float16 in shared memory, and compute in float16. The per-head scales: k_scale joins the
// logit factor, v_scale the normalisation.
// The `kernel` attribute of the call (PrefillParams::kernel: auto, sm90, mma, simt; default auto:
// the first of sm90, mma, simt that supports the call; jaxattn.native.PrefillConfig, whose
// default comes from $JAXATTN_PREFILL_KERNEL) forces one: a forced kernel is used wherever it
// supports the dtype and head_dim, the automatic choice elsewhere; sm90 forced on a device or
// build without it is an error.
#pragma once

#include <cstdint>
#include <type_traits>

#include "jaxattn/gpu_vendor.h"
#include "jaxattn/guards.h"
#include "jaxattn/mma_sm80.cuh"
#include "jaxattn/params.h"

namespace jaxattn {
namespace gpu {

struct PrefillTile {
  int b = 0;
  int m0 = 0;  // first query row of the tile, within the request
  int rows = 0;
  int q0 = 0;  // the request's first row in q
  int lq = 0;
  int lk = 0;
  const int32_t* table = nullptr;  // the request's index entries (pages, or pool slots)
};

// Shared-memory state of a prefill block's guards. find_prefill_tile fills it (its scratch
// for the tile search, and the flags' initial values before its last barrier); the kernels
// then only raise the flags (atomically: any number of threads may, and a race checker stays
// quiet) and read them after their final barrier.
//   poison: an index entry of the request lies outside the cache (RowCursor, check_entries).
//   first_bad[d]: the smallest key of a masked key tile whose V element d was not finite;
//     those elements are zeroed in shared memory before P V (sanitize_v16), because a row
//     that does not see the key multiplies it by a probability of 0 inside the MMA, and
//     0 * NaN would poison it. Row i of the request gets NaN in element d iff it sees that
//     key (first_bad[d] <= i + Lk - Lq): the same NaN the multiply-add gives in the tiles
//     every row sees in full (a non-finite V element there is NaN in the attending rows, which
//     may differ from the infinity an exact sum of an infinite value would give).
template <int D, int NT>
struct PrefillGuards {
  int warp_tiles[NT / WARP_SIZE];
  int hit[6];  // request, tile within it, q0, q1, lk, pool k1 -- of the block's tile
  int poison;
  int first_bad[D];
};

constexpr int kNoBadKey = 0x7fffffff;

// Rows [r0, r1) of one head of the output, every element `value`.
template <typename T>
__device__ void fill_prefill_rows(const PrefillParams& p, int head, int r0, int r1, float value) {
  const int D = p.kv.head_dim;
  T* out = static_cast<T*>(p.out);
  const T v = from_float<T>(value);
  for (int i = threadIdx.x; i < (r1 - r0) * D; i += blockDim.x) {
    const int r = r0 + i / D;
    out[(int64_t(r) * p.num_q_heads + head) * D + i % D] = v;
  }
}

// Finds the tile of block x (heaviest tiles of a request first: they see the most keys) with
// one coalesced pass of the block over the indptr arrays and a block-wide scan of the
// requests' tile counts; the same pass checks the indptr structure (first entry 0, no
// decrease), so the check costs no extra load latency. A request owns the tiles of its rows
// that lie inside q, so the tiles always fit the grid (ceil(total_q / bm) + batch blocks).
// Returns true when the block has a tile of a valid request to compute. Otherwise the block
// has written the rows it owns: all NaN when the structure is broken (no row can be assigned
// to a request: block x then owns rows [x bm, x bm + bm), so the grid covers every row); NaN
// for a tile of an invalid request (prefill_bounds_ok); zeros for padding rows past
// qo[batch]. All threads of the block must call it.
template <typename T, int D, int NT>
__device__ bool find_prefill_tile(const PrefillParams& p, int bm, int x, int head,
                                  PrefillGuards<D, NT>& g, PrefillTile* t) {
  constexpr int kWarps = NT / WARP_SIZE;
  const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
  const int32_t* qo = p.cu_seqlens_q;
  const int32_t* kvp = p.page_indptr;
  if (tid == 0) {
    g.hit[0] = -1;
    g.poison = 0;
  }
  for (int d = tid; d < D; d += NT) g.first_bad[d] = kNoBadKey;
  bool bad = tid == 0 && (qo[0] != 0 || (kvp != nullptr && kvp[0] != 0));
  int before = 0;  // tiles of the requests of earlier chunks
  for (int c0 = 0; c0 < p.batch; c0 += NT) {
    const int b = c0 + tid;
    int tiles = 0, q0 = 0, q1 = 0, lk = 0, k1 = 0;
    if (b < p.batch) {
      q0 = qo[b];
      q1 = qo[b + 1];
      bool ordered = q0 <= q1;
      if (kvp != nullptr) {
        const int k0 = kvp[b];
        k1 = kvp[b + 1];
        ordered = ordered && k0 <= k1;
        lk = ordered ? k1 - k0 : 0;
      } else {
        lk = p.seq_lens[b];
      }
      bad = bad || !ordered;
      // With qo[0] == 0 and no decrease q0 >= 0; testing it keeps the sums below in range
      // whatever the indptr holds (they are only used when the structure is sound).
      if (ordered && q0 >= 0) tiles = (max(0, min(q1, p.total_q) - q0) + bm - 1) / bm;
    }
    int incl = tiles;  // inclusive scan over the block
#pragma unroll
    for (int o = 1; o < WARP_SIZE; o *= 2) {
      const int n = shfl_up(incl, o);
      if (lane >= o) incl += n;
    }
    if (lane == WARP_SIZE - 1) g.warp_tiles[warp] = incl;
    __syncthreads();
    int total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int s = g.warp_tiles[w];
      total += s;
      if (w < warp) incl += s;
    }
    const int first = before + incl - tiles;
    if (tiles > 0 && x >= first && x < first + tiles) {
      g.hit[0] = b;
      g.hit[1] = x - first;
      g.hit[2] = q0;
      g.hit[3] = q1;
      g.hit[4] = lk;
      g.hit[5] = k1;
    }
    before += total;
    __syncthreads();  // warp_tiles is rewritten by the next chunk
  }
  if (__syncthreads_or(bad)) {
    fill_prefill_rows<T>(p, head, min(x * bm, p.total_q), min(x * bm + bm, p.total_q), quiet_nan());
    return false;
  }
  const int b = g.hit[0];
  if (b < 0) {
    const int r0 = min(qo[p.batch], p.total_q) + (x - before) * bm;
    fill_prefill_rows<T>(p, head, r0, min(r0 + bm, p.total_q), 0.f);
    return false;
  }
  const int q0 = g.hit[2], q1 = g.hit[3];
  const int in_q = min(q1, p.total_q) - q0;  // the request's rows inside q
  t->b = b;
  t->m0 = ((in_q + bm - 1) / bm - 1 - g.hit[1]) * bm;
  t->rows = min(bm, in_q - t->m0);
  t->q0 = q0;
  t->lq = q1 - q0;
  t->lk = g.hit[4];
  t->table = p.page_table +
             (kvp != nullptr ? int64_t(g.hit[5]) - t->lk : int64_t(b) * p.page_table_stride);
  if (!prefill_bounds_ok(p, q0, q1, t->lk, g.hit[5])) {
    fill_prefill_rows<T>(p, head, q0 + t->m0, q0 + t->m0 + t->rows, quiet_nan());
    return false;
  }
  return true;
}

// Keys [0, end) are loaded for the tile; tiles wholly below full_end need no mask.
struct KeyRange {
  int end;
  int full_end;
};

__device__ __forceinline__ KeyRange key_range(const PrefillTile& t) {
  const int shift = t.lk - t.lq;
  KeyRange r;
  r.end = max(0, min(t.lk, t.m0 + t.rows - 1 + shift + 1));
  r.full_end = max(0, min(t.lk, t.m0 + shift + 1));
  return r;
}

// Offset of one row of a key tile, advanced tile by tile from page-table differences. Keys at
// or past `lim` (the tile's KeyRange::end: no row of the tile sees them) are zero-filled and
// never read, so their index entries are not used either. A page id outside the cache raises
// the block's poison flag and ends the cursor (zero-filled from there on: the rows are NaN
// anyway). This is where every index entry a tile reads is checked: once per row and key tile,
// next to the load of the entry.
struct RowCursor {
  int64_t off = -1;  // element offset in the cache; -1: zero-fill
  int page = 0;

  __device__ __forceinline__ void init(const KvGeometry& kv, const int32_t* table, int t, int lim,
                                       int* poison) {
    off = -1;
    if (t < lim) {
      page = table[t / kv.page_size];
      if (index_ok(page, kv.num_pages)) {
        off = int64_t(page) * kv.page_stride + int64_t(t % kv.page_size) * kv.token_stride;
      } else {
        atomicOr(poison, 1);
      }
    }
  }

  __device__ __forceinline__ void advance(const KvGeometry& kv, const int32_t* table, int t,
                                          int step, int lim, int* poison) {
    const int tn = t + step;
    if (tn >= lim || off < 0) {
      off = -1;
      return;
    }
    const int next = table[tn / kv.page_size];
    if (!index_ok(next, kv.num_pages)) {
      atomicOr(poison, 1);
      off = -1;
      return;
    }
    off += int64_t(next - page) * kv.page_stride +
           int64_t(tn % kv.page_size - t % kv.page_size) * kv.token_stride;
    page = next;
  }
};

// The index entries of the request that no cursor of this tile reads (those of keys at or past
// KeyRange::end): checked once, coalesced, so that every tile of a request poisons its rows for
// a bad entry anywhere in [0, Lk), even past its own causal range. Issued right after a
// kernel's first copies, whose wait hides its latency.
template <int NT>
__device__ __forceinline__ void check_entries(const PrefillTile& t, const KvGeometry& kv, int end,
                                              int* poison) {
  const int last = pages_for(t.lk, kv.page_size);
  for (int i = pages_for(end, kv.page_size) + int(threadIdx.x); i < last; i += NT)
    if (!index_ok(t.table[i], kv.num_pages)) atomicOr(poison, 1);
}

// Whether element d of query row `row` (within the request) is NaN by the guards: a poisoned
// request, or a sanitised non-finite V element of a key the row sees.
template <int D, int NT>
__device__ __forceinline__ bool guard_nan(const PrefillGuards<D, NT>& g, bool poisoned, int d,
                                          int row, int shift) {
  return poisoned || g.first_bad[d] <= row + shift;
}

// Sanitises one 16-byte chunk (8 elements, head-dim elements d0 .. d0 + 7) of V row `key` in
// shared memory: non-finite elements become 0 and lower first_bad. Nearly always a load and
// a few integer tests (16-bit exponent all ones: infinity or NaN).
template <typename T, int D, int NT>
__device__ __forceinline__ void sanitize_v16(uint4* chunk, int key, int d0,
                                             PrefillGuards<D, NT>& g) {
  constexpr uint32_t kExp = std::is_same_v<T, bf16_t> ? 0x7f80u : 0x7c00u;
  uint4 v = *chunk;
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
  bool any = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) any = any || (w[i] & kExp) == kExp || ((w[i] >> 16) & kExp) == kExp;
  if (!any) return;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (((w[i] >> (16 * h)) & kExp) == kExp) {
        atomicMin(&g.first_bad[d0 + 2 * i + h], key);
        w[i] &= h ? 0x0000ffffu : 0xffff0000u;
      }
    }
  }
  *chunk = make_uint4(w[0], w[1], w[2], w[3]);
}

// ------------------------------------------------------------------------------------------
// Portable SIMT kernel.
// ------------------------------------------------------------------------------------------

template <int D>
struct SimtShape {
  static constexpr int kThreads = 128;
  static constexpr int kBM = D <= 128 ? 32 : 16;
  static constexpr int kBN = D <= 64 ? 32 : (D <= 128 ? 16 : 8);
  static constexpr int kLanesPerRow = kThreads / kBM;  // lanes sharing a query row
  static constexpr int kKeysPerLane = kBN / kLanesPerRow;
  static constexpr int kDimsPerLane = D / kLanesPerRow;
  static constexpr int kLd = D + 1;  // odd row stride: rows fall in different banks
  static constexpr int kSmemBytes =
      8 * kBN + int(sizeof(float)) * ((kBM + 2 * kBN) * kLd + kBM * (kBN + 1));
  static_assert(kLanesPerRow <= WARP_SIZE && kBN % kLanesPerRow == 0, "bad SIMT tile");
  static_assert(kSmemBytes <= 48 * 1024, "SIMT prefill shared memory must fit the default limit");
};

// C: the cache's element type (T, or an FP8 format, widened exactly as it is read).
template <typename T, int D, typename C = T>
__global__ void __launch_bounds__(SimtShape<D>::kThreads)
    prefill_simt_kernel(const PrefillParams p) {
  using S = SimtShape<D>;
  constexpr int BM = S::kBM, BN = S::kBN, TPR = S::kLanesPerRow, LD = S::kLd;
  constexpr float kNegInf = -__builtin_huge_valf();
  extern __shared__ __align__(16) unsigned char smem[];
  int64_t* rowoff = reinterpret_cast<int64_t*>(smem);  // [BN]
  float* qs = reinterpret_cast<float*>(rowoff + BN);
  float* ks = qs + BM * LD;
  float* vs = ks + BN * LD;
  float* ps = vs + BN * LD;

  __shared__ PrefillGuards<D, S::kThreads> guards;
  const int head = blockIdx.y;
  PrefillTile t;
  if (!find_prefill_tile<T, D, S::kThreads>(p, BM, blockIdx.x, head, guards, &t)) return;
  const KvGeometry& kv = p.kv;
  const int kvh = head / (p.num_q_heads / kv.num_kv_heads);
  const int tid = threadIdx.x;
  const int r = tid / TPR, c = tid % TPR;
  const int shift = t.lk - t.lq;
  const KeyRange range = key_range(t);

  const T* qg = static_cast<const T*>(p.q);
  const float q_scale = p.ls.q_scale * p.scales.k_of(kvh);  // with the KV head's key scale
  for (int i = tid; i < BM * D; i += S::kThreads) {
    const int rr = i / D, d = i % D;
    float v = 0.f;
    if (rr < t.rows) v = to_float(qg[(int64_t(t.q0 + t.m0 + rr) * p.num_q_heads + head) * D + d]);
    qs[rr * LD + d] = v * q_scale;
  }
  RowCursor cur;
  if (tid < BN) cur.init(kv, t.table, tid, range.end, &guards.poison);
  check_entries<S::kThreads>(t, kv, range.end, &guards.poison);

  float m = kNegInf, l = 0.f, acc[S::kDimsPerLane];
#pragma unroll
  for (int i = 0; i < S::kDimsPerLane; ++i) acc[i] = 0.f;
  const C* kg = static_cast<const C*>(p.k) + kvh * kv.head_stride;
  const C* vg = static_cast<const C*>(p.v) + kvh * kv.head_stride;
  const int qi = t.m0 + r;  // this lane's query row within the request

  for (int n0 = 0; n0 < range.end; n0 += BN) {
    const bool masked = n0 + BN > range.full_end;
    if (tid < BN) rowoff[tid] = cur.off;
    __syncthreads();  // offsets published; the previous tile's K/V/P are no longer read
    for (int i = tid; i < BN * D; i += S::kThreads) {
      const int rr = i / D, d = i % D;
      const int64_t off = rowoff[rr];
      ks[rr * LD + d] = off >= 0 ? to_float(kg[off + d]) : 0.f;
      float v = off >= 0 ? to_float(vg[off + d]) : 0.f;
      if (masked && !isfinite(v)) {  // some rows do not see this key: see PrefillGuards
        atomicMin(&guards.first_bad[d], n0 + rr);
        v = 0.f;
      }
      vs[rr * LD + d] = v;
    }
    if (tid < BN) cur.advance(kv, t.table, n0 + tid, BN, range.end, &guards.poison);
    __syncthreads();

    float s[S::kKeysPerLane];
    float mx = kNegInf;
#pragma unroll
    for (int kk = 0; kk < S::kKeysPerLane; ++kk) {
      const int key = c + kk * TPR;
      float dot = 0.f;
#pragma unroll 8
      for (int d = 0; d < D; ++d) dot = fmaf(qs[r * LD + d], ks[key * LD + d], dot);
      if (p.ls.cap_log2e > 0.f) dot = p.ls.cap_log2e * tanhf(dot);
      if (masked && (n0 + key >= t.lk || n0 + key > qi + shift)) dot = kNegInf;
      s[kk] = dot;
      mx = fmaxf(mx, dot);
    }
    mx = group_max<TPR>(mx);
    const float m_new = fmaxf(m, mx);
    const float m_use = m_new == kNegInf ? 0.f : m_new;
    const float alpha = fast_exp2(m - m_use);
    float sum = 0.f;
#pragma unroll
    for (int kk = 0; kk < S::kKeysPerLane; ++kk) {
      const float pk = fast_exp2(s[kk] - m_use);
      sum += pk;
      ps[r * (BN + 1) + c + kk * TPR] = pk;
    }
    l = l * alpha + group_sum<TPR>(sum);
    m = m_new;
    __syncthreads();  // a row's probabilities come from all lanes of the row
#pragma unroll
    for (int i = 0; i < S::kDimsPerLane; ++i) acc[i] *= alpha;
    for (int k = 0; k < BN; ++k) {
      const float pk = ps[r * (BN + 1) + k];
#pragma unroll
      for (int i = 0; i < S::kDimsPerLane; ++i) acc[i] = fmaf(pk, vs[k * LD + c + i * TPR], acc[i]);
    }
  }

  // The guards' flags were last written before the last tile's second barrier.
  if (r < t.rows) {
    T* out = static_cast<T*>(p.out) + (int64_t(t.q0 + qi) * p.num_q_heads + head) * D;
    const bool poisoned = guards.poison != 0;
    // NaN in l stays NaN; the value scale joins the normalisation.
    const float inv = l == 0.f ? 0.f : p.scales.v_of(kvh) / l;
#pragma unroll
    for (int i = 0; i < S::kDimsPerLane; ++i) {
      const int d = c + i * TPR;
      out[d] =
          from_float<T>(guard_nan(guards, poisoned, d, qi, shift) ? quiet_nan() : acc[i] * inv);
    }
  }
}

// ------------------------------------------------------------------------------------------
// Tensor-core kernel (NVIDIA sm_80+, 16-bit inputs).
// ------------------------------------------------------------------------------------------

#if defined(JAXATTN_CUDA)

template <int D>
struct MmaShape {
  static constexpr int kBM = 64;  // 4 warps x 16 rows
  static constexpr int kBN = 64;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static constexpr int kRowsPerPass = kThreads / kChunks;
  static constexpr int kTileBytes = kBN * D * 2;
  // Q, then K and V double-buffered, then the row offsets of the next two key tiles.
  static constexpr int kSmemBytes = kBM * D * 2 + 4 * kTileBytes + 2 * kBN * 8;
  static_assert(D == 64 || D == 128, "the MMA kernel is built for head_dim 64 and 128");
};

// 16-byte chunk c of row r, XOR-swizzled over 8 chunks so that the 8 rows an ldmatrix
// phase reads hit 8 different bank groups.
template <int D>
__device__ __forceinline__ uint32_t swz(int r, int c) {
  return uint32_t((r * MmaShape<D>::kChunks + (c ^ (r & 7))) * 16);
}

// Writes a warp's 16 rows of a tensor-core tile, lr0 and lr0 + 8 (within the tile), from the
// accumulator fragments: o[4 i + e] is element i * 8 + 2 tq + (e & 1) of row lr0 (e < 2) or
// lr0 + 8 -- the m16n8 layout of the mma kernel and the m64nN layout of the sm90 kernel alike.
// Normalised by the quad-summed l0 / l1 (0 when a row saw nothing; NaN stays NaN) and scaled by
// the KV head's value scale vs, with the guards' NaN.
template <typename T, int D, int NT>
__device__ __forceinline__ void prefill_mma_store(const PrefillParams& p,
                                                  const PrefillGuards<D, NT>& guards,
                                                  const PrefillTile& t, int head, int lr0, int tq,
                                                  int shift, float l0, float l1, const float* o,
                                                  float vs) {
  const bool poisoned = guards.poison != 0;
  const float inv0 = l0 == 0.f ? 0.f : vs / l0, inv1 = l1 == 0.f ? 0.f : vs / l1;
  const float nan = quiet_nan();
  const int lr1 = lr0 + 8;
  const int row0 = t.m0 + lr0, row1 = t.m0 + lr1;  // within the request
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    const int d = i * 8 + 2 * tq;
    if (lr0 < t.rows) {
      const float a = guard_nan(guards, poisoned, d, row0, shift) ? nan : o[4 * i] * inv0;
      const float b = guard_nan(guards, poisoned, d + 1, row0, shift) ? nan : o[4 * i + 1] * inv0;
      *reinterpret_cast<uint32_t*>(out + (int64_t(t.q0 + row0) * p.num_q_heads + head) * D + d) =
          pack2<T>(a, b);
    }
    if (lr1 < t.rows) {
      const float a = guard_nan(guards, poisoned, d, row1, shift) ? nan : o[4 * i + 2] * inv1;
      const float b = guard_nan(guards, poisoned, d + 1, row1, shift) ? nan : o[4 * i + 3] * inv1;
      *reinterpret_cast<uint32_t*>(out + (int64_t(t.q0 + row1) * p.num_q_heads + head) * D + d) =
          pack2<T>(a, b);
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(MmaShape<D>::kThreads, 2)
    prefill_mma_kernel(const PrefillParams p) {
#if __CUDA_ARCH__ >= 800
  using S = MmaShape<D>;
  constexpr int BM = S::kBM, BN = S::kBN, CH = S::kChunks, RP = S::kRowsPerPass;
  constexpr float kNegInf = -__builtin_huge_valf();
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* q_s = smem;
  unsigned char* k_s = q_s + BM * D * 2;                                  // [2][BN][D]
  unsigned char* v_s = k_s + 2 * S::kTileBytes;                           // [2][BN][D]
  int64_t* rowoff = reinterpret_cast<int64_t*>(v_s + 2 * S::kTileBytes);  // [2][BN]

  __shared__ PrefillGuards<D, S::kThreads> guards;
  const int head = blockIdx.y;
  PrefillTile t;
  if (!find_prefill_tile<T, D, S::kThreads>(p, BM, blockIdx.x, head, guards, &t)) return;
  const KvGeometry& kv = p.kv;
  const int kvh = head / (p.num_q_heads / kv.num_kv_heads);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  const int shift = t.lk - t.lq;
  const KeyRange range = key_range(t);
  const int ntiles = (range.end + BN - 1) / BN;

  RowCursor cur;
  if (tid < BN) {
    cur.init(kv, t.table, tid, range.end, &guards.poison);
    rowoff[tid] = cur.off;
    cur.advance(kv, t.table, tid, BN, range.end, &guards.poison);
    rowoff[BN + tid] = cur.off;
  }
  __syncthreads();

  const T* qg = static_cast<const T*>(p.q);
  const T* kg = static_cast<const T*>(p.k) + kvh * kv.head_stride;
  const T* vg = static_cast<const T*>(p.v) + kvh * kv.head_stride;
  const int c = tid % CH;
#pragma unroll
  for (int i = 0; i < BM / RP; ++i) {
    const int r = tid / CH + i * RP;
    const bool ok = r < t.rows;
    const T* src = ok ? qg + (int64_t(t.q0 + t.m0 + r) * p.num_q_heads + head) * D + c * 8 : qg;
    cp_async16(smem_u32(q_s) + swz<D>(r, c), src, ok);
  }
  auto load_kv = [&](int buf) {
#pragma unroll
    for (int i = 0; i < BN / RP; ++i) {
      const int r = tid / CH + i * RP;
      const int64_t off = rowoff[buf * BN + r];
      const bool ok = off >= 0;
      const uint32_t dst = swz<D>(r, c) + uint32_t(buf * S::kTileBytes);
      cp_async16(smem_u32(k_s) + dst, ok ? kg + off + c * 8 : kg, ok);
      cp_async16(smem_u32(v_s) + dst, ok ? vg + off + c * 8 : vg, ok);
    }
  };
  if (ntiles > 0) load_kv(0);
  async_copy_commit();
  check_entries<S::kThreads>(t, kv, range.end, &guards.poison);  // while tile 0 is in flight

  uint32_t qf[D / 16][4];
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m0 = kNegInf, m1 = kNegInf, l0 = 0.f, l1 = 0.f;
  const int row0 = t.m0 + warp * 16 + g;  // query rows of this lane, within the request
  const int row1 = row0 + 8;
  const float q_scale = p.ls.q_scale * p.scales.k_of(kvh);

  for (int n = 0; n < ntiles; ++n) {
    const int buf = n & 1;
    if (n + 1 < ntiles) load_kv(buf ^ 1);
    async_copy_commit();
    async_copy_wait<1>();
    __syncthreads();
    const int n0 = n * BN;
    const bool masked = n0 + BN > range.full_end;
    if (masked) {  // rows that do not see a key must not multiply its V by 0: PrefillGuards
#pragma unroll 1
      for (int i = tid; i < BN * CH; i += S::kThreads) {
        const int r = i / CH, cc = i % CH;
        uint4* chunk = reinterpret_cast<uint4*>(v_s + buf * S::kTileBytes + swz<D>(r, cc));
        sanitize_v16<T>(chunk, n0 + r, cc * 8, guards);
      }
      __syncthreads();
    }
    if (n == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const int r = warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
        ldmatrix_x4(qf[kk], smem_u32(q_s) + swz<D>(r, 2 * kk + lane / 16));
      }
    }
    const uint32_t kb = smem_u32(k_s) + uint32_t(buf * S::kTileBytes);
    const uint32_t vb = smem_u32(v_s) + uint32_t(buf * S::kTileBytes);

    float s[BN / 8][4];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t bfr[4];
        const int key = np * 16 + (lane % 8) + (lane / 16) * 8;
        ldmatrix_x4(bfr, kb + swz<D>(key, 2 * kk + (lane / 8) % 2));
        mma16816<T>(s[2 * np], qf[kk], bfr[0], bfr[1]);
        mma16816<T>(s[2 * np + 1], qf[kk], bfr[2], bfr[3]);
      }
    }

    float mx0 = kNegInf, mx1 = kNegInf;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = s[j][e] * q_scale;
        if (p.ls.cap_log2e > 0.f) v = p.ls.cap_log2e * tanhf(v);
        if (masked) {
          const int key = n0 + j * 8 + 2 * tq + (e & 1);
          const int qi = e < 2 ? row0 : row1;
          if (key >= t.lk || key > qi + shift) v = kNegInf;
        }
        s[j][e] = v;
      }
      mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
      mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
    }
    mx0 = group_max<4>(mx0);
    mx1 = group_max<4>(mx1);
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float mu0 = mn0 == kNegInf ? 0.f : mn0, mu1 = mn1 == kNegInf ? 0.f : mn1;
    const float a0 = fast_exp2(m0 - mu0), a1 = fast_exp2(m1 - mu1);
    m0 = mn0;
    m1 = mn1;
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      s[j][0] = fast_exp2(s[j][0] - mu0);
      s[j][1] = fast_exp2(s[j][1] - mu0);
      s[j][2] = fast_exp2(s[j][2] - mu1);
      s[j][3] = fast_exp2(s[j][3] - mu1);
      sum0 += s[j][0] + s[j][1];
      sum1 += s[j][2] + s[j][3];
    }
    // Each lane keeps partial row sums; the quad's are added once at the end.
    l0 = l0 * a0 + sum0;
    l1 = l1 * a1 + sum1;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i][0] *= a0;
      o[i][1] *= a0;
      o[i][2] *= a1;
      o[i][3] *= a1;
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      // The accumulator layout of S is the A-operand layout of P: no shuffles needed.
      const uint32_t pf[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]),
                              pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                              pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bfr[4];
        const int key = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
        ldmatrix_x4_trans(bfr, vb + swz<D>(key, 2 * dp + lane / 16));
        mma16816<T>(o[2 * dp], pf, bfr[0], bfr[1]);
        mma16816<T>(o[2 * dp + 1], pf, bfr[2], bfr[3]);
      }
    }

    if (tid < BN) {
      // Row offsets of tile n + 2 go where tile n's were: those loads were issued already.
      cur.advance(kv, t.table, (n + 1) * BN + tid, BN, range.end, &guards.poison);
      rowoff[buf * BN + tid] = cur.off;
    }
    __syncthreads();  // tile n's buffers are free for tile n + 2
  }
  async_copy_wait<0>();

  // The guards' flags were last written before the last tile's final barrier.
  l0 = group_sum<4>(l0);
  l1 = group_sum<4>(l1);
  prefill_mma_store<T, D>(p, guards, t, head, warp * 16 + g, tq, shift, l0, l1, &o[0][0],
                          p.scales.v_of(kvh));
#endif
}

// FP8 caches on the tensor cores. A key tile is copied as stored (16-byte cp.async copies of
// FP8 rows, half the bytes) into a staging area and widened to float16 in shared memory, where
// the 16-bit kernel's fragment loads read it: every FP8 value is exact in float16. Each thread
// widens exactly the chunks it copied, so it needs no barrier to read them (its own copies are
// visible to it after its wait), and the widened tile needs only one buffer: it is written after
// the barrier that ends the previous tile. A bf16 q is moved to float16 in shared memory too,
// each row by the power of two that puts its largest |q| in [2^14, 2^15) (only elements below
// 2^-24 of the row's largest lose bits), undone in the row's f32 logit factor.

// 16 FP8 codes -> 16 float16 (two 16-byte chunks), exact.
template <typename C>
__device__ __forceinline__ void fp8x16_to_f16(const uint4& in, uint4& lo, uint4& hi) {
  fp8x4_to_f16x2<C>(in.x, lo.x, lo.y);
  fp8x4_to_f16x2<C>(in.y, lo.z, lo.w);
  fp8x4_to_f16x2<C>(in.z, hi.x, hi.y);
  fp8x4_to_f16x2<C>(in.w, hi.z, hi.w);
}

// Rows [0, rows) of a q tile in shared memory (bf16, 8-element chunks at chunk_off(r, c)) to
// float16 in place, each row scaled by a power of two; post[r] gets the inverse. Two threads a
// row (NT >= 2 * rows), each over half of it.
template <int D, int NT, typename Off>
__device__ __forceinline__ void q_bf16_to_f16_rows(unsigned char* tile, int rows, float* post,
                                                   Off chunk_off) {
  constexpr int kHalf = D / 16;  // chunks in half a row
  const int r = int(threadIdx.x) / 2, h = int(threadIdx.x) % 2;
  const bool live = r < rows;
  uint4 v[kHalf];
  float qmax = 0.f;
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    v[i] = live ? *reinterpret_cast<const uint4*>(tile + chunk_off(r, h * kHalf + i))
                : make_uint4(0u, 0u, 0u, 0u);
    const uint32_t w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
    for (int j = 0; j < 4; ++j)  // fmaxf skips NaN: a NaN q stays NaN below
      qmax = fmaxf(qmax, fmaxf(fabsf(__uint_as_float(w[j] << 16)),
                               fabsf(__uint_as_float(w[j] & 0xffff0000u))));
  }
  qmax = fmaxf(qmax, shfl_xor(qmax, 1));
  // 2^(141 - e) for qmax = 1.x * 2^(e - 127).
  const int e = int((__float_as_uint(qmax) >> 23) & 0xffu);
  const int biased = min(max(268 - e, 1), 253);
  const float pre = __uint_as_float(uint32_t(biased) << 23);
  if (live) {
    if (h == 0) post[r] = __uint_as_float(uint32_t(254 - biased) << 23);
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const uint32_t w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
      uint32_t o[4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        o[j] = pack2<f16_t>(__uint_as_float(w[j] << 16) * pre,
                            __uint_as_float(w[j] & 0xffff0000u) * pre);
      *reinterpret_cast<uint4*>(tile + chunk_off(r, h * kHalf + i)) =
          make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
}

template <typename C, int D>
struct MmaFp8Shape {
  static constexpr int kBM = 64;
  static constexpr int kBN = 64;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kTileBytes = kBN * D * 2;        // a widened (float16) K or V tile
  static constexpr int kStageBytes = kBN * D;           // an FP8 K or V tile
  static constexpr int kF8Chunks = D / 16;              // 16-byte FP8 chunks a row
  static constexpr int kF8Rows = kThreads / kF8Chunks;  // rows a pass of the block copies
  // Q, K and V (float16), the FP8 staging of two tiles (K, V), the row offsets of two tiles,
  // the rows' q factors.
  static constexpr int kSmemBytes =
      kBM * D * 2 + 2 * kTileBytes + 4 * kStageBytes + 2 * kBN * 8 + kBM * 4;
  static_assert(D == 64 || D == 128, "the MMA kernel is built for head_dim 64 and 128");
  static_assert(2 * kBM <= kThreads, "two threads a q row");
};

template <typename T, typename C, int D>
__global__ void __launch_bounds__(MmaFp8Shape<C, D>::kThreads, 2)
    prefill_mma_fp8_kernel(const PrefillParams p) {
#if __CUDA_ARCH__ >= 800
  using S = MmaFp8Shape<C, D>;
  using M = f16_t;
  constexpr int BM = S::kBM, BN = S::kBN, CH = D / 8, RP = S::kThreads / CH;
  constexpr int F8 = S::kF8Chunks, F8R = S::kF8Rows;
  constexpr float kNegInf = -__builtin_huge_valf();
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* q_s = smem;
  unsigned char* k_s = q_s + BM * D * 2;      // [BN][D] float16
  unsigned char* v_s = k_s + S::kTileBytes;   // [BN][D] float16
  unsigned char* st_s = v_s + S::kTileBytes;  // [2 slots][K, V][BN][D] FP8
  int64_t* rowoff = reinterpret_cast<int64_t*>(st_s + 4 * S::kStageBytes);  // [2][BN]
  float* qpost = reinterpret_cast<float*>(rowoff + 2 * BN);                 // [BM]

  __shared__ PrefillGuards<D, S::kThreads> guards;
  const int head = blockIdx.y;
  PrefillTile t;
  if (!find_prefill_tile<T, D, S::kThreads>(p, BM, blockIdx.x, head, guards, &t)) return;
  const KvGeometry& kv = p.kv;
  const int kvh = head / (p.num_q_heads / kv.num_kv_heads);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  const int shift = t.lk - t.lq;
  const KeyRange range = key_range(t);
  const int ntiles = (range.end + BN - 1) / BN;

  RowCursor cur;
  if (tid < BN) {
    cur.init(kv, t.table, tid, range.end, &guards.poison);
    rowoff[tid] = cur.off;
    cur.advance(kv, t.table, tid, BN, range.end, &guards.poison);
    rowoff[BN + tid] = cur.off;
  }
  __syncthreads();

  const T* qg = static_cast<const T*>(p.q);
  const C* kg = static_cast<const C*>(p.k) + kvh * kv.head_stride;
  const C* vg = static_cast<const C*>(p.v) + kvh * kv.head_stride;
  {
    const int c = tid % CH;
#pragma unroll
    for (int i = 0; i < BM / RP; ++i) {
      const int r = tid / CH + i * RP;
      const bool ok = r < t.rows;
      const T* src = ok ? qg + (int64_t(t.q0 + t.m0 + r) * p.num_q_heads + head) * D + c * 8 : qg;
      cp_async16(smem_u32(q_s) + swz<D>(r, c), src, ok);
    }
  }
  // This thread's FP8 chunks of a tile: chunk c8 of rows tid / F8 + i * F8R.
  const int c8 = tid % F8;
  auto stage_k = [&](int slot, int r) { return st_s + (2 * slot * BN + r) * D + c8 * 16; };
  auto stage_v = [&](int slot, int r) { return st_s + ((2 * slot + 1) * BN + r) * D + c8 * 16; };
  auto load_fp8 = [&](int slot) {  // the tile whose offsets are in rowoff slot `slot`
#pragma unroll
    for (int i = 0; i < BN / F8R; ++i) {
      const int r = tid / F8 + i * F8R;
      const int64_t off = rowoff[slot * BN + r];
      const bool ok = off >= 0;
      cp_async16(smem_u32(stage_k(slot, r)), ok ? kg + off + c8 * 16 : kg, ok);
      cp_async16(smem_u32(stage_v(slot, r)), ok ? vg + off + c8 * 16 : vg, ok);
    }
  };
  // Widens this thread's chunks of tile n (staged in slot n % 2) into the float16 K / V tiles;
  // in a tile that crosses the diagonal, non-finite V elements are zeroed (PrefillGuards).
  auto widen = [&](int n) {
    const int slot = n & 1;
    const bool masked = n * BN + BN > range.full_end;
#pragma unroll
    for (int i = 0; i < BN / F8R; ++i) {
      const int r = tid / F8 + i * F8R;
      uint4 lo, hi;
      fp8x16_to_f16<C>(*reinterpret_cast<const uint4*>(stage_k(slot, r)), lo, hi);
      *reinterpret_cast<uint4*>(k_s + swz<D>(r, 2 * c8)) = lo;
      *reinterpret_cast<uint4*>(k_s + swz<D>(r, 2 * c8 + 1)) = hi;
      fp8x16_to_f16<C>(*reinterpret_cast<const uint4*>(stage_v(slot, r)), lo, hi);
      uint4* v0 = reinterpret_cast<uint4*>(v_s + swz<D>(r, 2 * c8));
      uint4* v1 = reinterpret_cast<uint4*>(v_s + swz<D>(r, 2 * c8 + 1));
      *v0 = lo;
      *v1 = hi;
      if (masked) {
        sanitize_v16<M>(v0, n * BN + r, c8 * 16, guards);
        sanitize_v16<M>(v1, n * BN + r, c8 * 16 + 8, guards);
      }
    }
  };
  if (ntiles > 0) load_fp8(0);
  async_copy_commit();
  check_entries<S::kThreads>(t, kv, range.end, &guards.poison);  // while tile 0 is in flight

  uint32_t qf[D / 16][4];
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m0 = kNegInf, m1 = kNegInf, l0 = 0.f, l1 = 0.f;
  const int row0 = t.m0 + warp * 16 + g;  // query rows of this lane, within the request
  const int row1 = row0 + 8;
  float qs0 = p.ls.q_scale * p.scales.k_of(kvh), qs1 = qs0;  // times the rows' q factors

  for (int n = 0; n < ntiles; ++n) {
    const int buf = n & 1;
    if (n + 1 < ntiles) load_fp8(buf ^ 1);
    async_copy_commit();
    async_copy_wait<1>();  // this thread's copies of tile n (and, at n == 0, of q) landed
    if (n == 0 && std::is_same_v<T, bf16_t>) {
      __syncthreads();  // every thread's q copies
      q_bf16_to_f16_rows<D, S::kThreads>(q_s, BM, qpost, [](int r, int c) { return swz<D>(r, c); });
    }
    widen(n);
    __syncthreads();  // the widened tile (and q) visible to every warp
    if (n == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const int r = warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
        ldmatrix_x4(qf[kk], smem_u32(q_s) + swz<D>(r, 2 * kk + lane / 16));
      }
      if constexpr (std::is_same_v<T, bf16_t>) {
        qs0 *= qpost[warp * 16 + g];
        qs1 *= qpost[warp * 16 + g + 8];
      }
    }
    const bool masked = n * BN + BN > range.full_end;
    const int n0 = n * BN;
    const uint32_t kb = smem_u32(k_s), vb = smem_u32(v_s);

    float s[BN / 8][4];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t bfr[4];
        const int key = np * 16 + (lane % 8) + (lane / 16) * 8;
        ldmatrix_x4(bfr, kb + swz<D>(key, 2 * kk + (lane / 8) % 2));
        mma16816<M>(s[2 * np], qf[kk], bfr[0], bfr[1]);
        mma16816<M>(s[2 * np + 1], qf[kk], bfr[2], bfr[3]);
      }
    }

    float mx0 = kNegInf, mx1 = kNegInf;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = s[j][e] * (e < 2 ? qs0 : qs1);
        if (p.ls.cap_log2e > 0.f) v = p.ls.cap_log2e * tanhf(v);
        if (masked) {
          const int key = n0 + j * 8 + 2 * tq + (e & 1);
          const int qi = e < 2 ? row0 : row1;
          if (key >= t.lk || key > qi + shift) v = kNegInf;
        }
        s[j][e] = v;
      }
      mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
      mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
    }
    mx0 = group_max<4>(mx0);
    mx1 = group_max<4>(mx1);
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float mu0 = mn0 == kNegInf ? 0.f : mn0, mu1 = mn1 == kNegInf ? 0.f : mn1;
    const float a0 = fast_exp2(m0 - mu0), a1 = fast_exp2(m1 - mu1);
    m0 = mn0;
    m1 = mn1;
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      s[j][0] = fast_exp2(s[j][0] - mu0);
      s[j][1] = fast_exp2(s[j][1] - mu0);
      s[j][2] = fast_exp2(s[j][2] - mu1);
      s[j][3] = fast_exp2(s[j][3] - mu1);
      sum0 += s[j][0] + s[j][1];
      sum1 += s[j][2] + s[j][3];
    }
    l0 = l0 * a0 + sum0;
    l1 = l1 * a1 + sum1;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i][0] *= a0;
      o[i][1] *= a0;
      o[i][2] *= a1;
      o[i][3] *= a1;
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint32_t pf[4] = {pack2<M>(s[2 * kk][0], s[2 * kk][1]),
                              pack2<M>(s[2 * kk][2], s[2 * kk][3]),
                              pack2<M>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack2<M>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bfr[4];
        const int key = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
        ldmatrix_x4_trans(bfr, vb + swz<D>(key, 2 * dp + lane / 16));
        mma16816<M>(o[2 * dp], pf, bfr[0], bfr[1]);
        mma16816<M>(o[2 * dp + 1], pf, bfr[2], bfr[3]);
      }
    }

    if (tid < BN) {
      // Row offsets of tile n + 2 go where tile n's were: those copies were issued already.
      cur.advance(kv, t.table, (n + 1) * BN + tid, BN, range.end, &guards.poison);
      rowoff[buf * BN + tid] = cur.off;
    }
    __syncthreads();  // the widened tiles are free for tile n + 1
  }
  async_copy_wait<0>();

  l0 = group_sum<4>(l0);
  l1 = group_sum<4>(l1);
  prefill_mma_store<T, D>(p, guards, t, head, warp * 16 + g, tq, shift, l0, l1, &o[0][0],
                          p.scales.v_of(kvh));
#endif
}

#endif  // JAXATTN_CUDA

template <typename T, int D, typename C = T>
const char* launch_prefill_simt(const PrefillParams& p, gpuStream_t stream) {
  using S = SimtShape<D>;
  const dim3 grid((p.total_q + S::kBM - 1) / S::kBM + p.batch, p.num_q_heads);
  prefill_simt_kernel<T, D, C><<<grid, S::kThreads, S::kSmemBytes, stream>>>(p);
  return check_launch();
}

#if defined(JAXATTN_CUDA)
// Launches a tensor-core prefill kernel of shape S (kBM rows a block, kThreads, kSmemBytes of
// dynamic shared memory) over the tile grid: an upper bound on the tiles, times the heads.
template <typename S, typename Kernel>
const char* launch_prefill_tiles(Kernel kernel, const PrefillParams& p, gpuStream_t stream) {
  if (const char* e = allow_dynamic_smem(kernel, S::kSmemBytes)) return e;
  const dim3 grid((p.total_q + S::kBM - 1) / S::kBM + p.batch, p.num_q_heads);
  kernel<<<grid, S::kThreads, S::kSmemBytes, stream>>>(p);
  return check_launch();
}

template <typename T, int D, typename C = T>
const char* launch_prefill_mma(const PrefillParams& p, gpuStream_t stream) {
  if constexpr (sizeof(C) == 1) {
    return launch_prefill_tiles<MmaFp8Shape<C, D>>(prefill_mma_fp8_kernel<T, C, D>, p, stream);
  } else {
    return launch_prefill_tiles<MmaShape<D>>(prefill_mma_kernel<T, D>, p, stream);
  }
}

inline bool device_has_mma() { return current_device_caps().major >= 8; }

// sm_90a code runs on compute capability 9.0 only.
inline bool device_is_sm90() {
  const DeviceCaps c = current_device_caps();
  return c.major == 9 && c.minor == 0;
}
#endif

// Shapes the sm90 kernel takes: head_dim 64 or 128, and every cache row offset representable
// in 32 bits of 16-byte units (its shared-memory row table).
inline bool prefill_sm90_fits(const PrefillParams& p) {
  return (p.kv.head_dim == 64 || p.kv.head_dim == 128) &&
         int64_t(p.kv.num_pages) * p.kv.page_stride / 8 < int64_t(0xffffffffu);
}

#if defined(JAXATTN_CUDA) && defined(JAXATTN_HAVE_SM90A)
// prefill_sm90.cu (compiled for sm_90a only), T = bf16_t or f16_t, C = T or an FP8 format.
template <typename T, typename C>
const char* launch_prefill_sm90(const PrefillParams& p, gpuStream_t stream);
#endif

// The values of PrefillParams::kernel (the FFI attribute `kernel`).
enum class PrefillKernel { kAuto = 0, kSm90 = 1, kMma = 2, kSimt = 3 };

// Mean new tokens per request below which `auto` prefers the mma kernel's 64-row tiles.
constexpr int kSm90MinRowsPerRequest = 64;

// T: q's and the output's element type; C: the cache's (T, or an FP8 format under a 16-bit T:
// the tensor-core kernels then compute in float16, the SIMT kernel widens to float).
template <typename T, typename C = T>
const char* launch_prefill_typed(const PrefillParams& p, gpuStream_t stream) {
  if (p.kernel < 0 || p.kernel > 3) return "jaxattn: prefill kernel must be 0..3";
  // Read only by the tensor-core choices (CUDA): HIP has the SIMT kernel alone.
  [[maybe_unused]] const PrefillKernel which = static_cast<PrefillKernel>(p.kernel);
  // batch 0 still launches: its rows are padding (zeros), or NaN when qo[0] != 0.
  if (p.total_q == 0 || p.num_q_heads == 0) return nullptr;
  if (p.num_q_heads > 65535) return "jaxattn: more than 65535 query heads";
#if defined(JAXATTN_CUDA)
  if constexpr (sizeof(T) == 2) {
    const bool tc_dim = p.kv.head_dim == 64 || p.kv.head_dim == 128;
    if (tc_dim && (which == PrefillKernel::kAuto || which == PrefillKernel::kSm90)) {
#if defined(JAXATTN_HAVE_SM90A)
      const bool long_enough =
          which == PrefillKernel::kSm90 ||
          int64_t(p.total_q) >= int64_t(kSm90MinRowsPerRequest) * p.batch;
      if (long_enough && device_is_sm90() && prefill_sm90_fits(p))
        return launch_prefill_sm90<T, C>(p, stream);
#endif
      if (which == PrefillKernel::kSm90)
        return "jaxattn: the sm90 prefill kernel needs a compute capability 9.0 device, a "
               "library built with 90 in JAXATTN_CUDA_ARCHS and a cache under 64 GiB";
    }
    if (tc_dim && which != PrefillKernel::kSimt && device_has_mma()) {
      return p.kv.head_dim == 64 ? launch_prefill_mma<T, 64, C>(p, stream)
                                 : launch_prefill_mma<T, 128, C>(p, stream);
    }
  }
#endif
  switch (p.kv.head_dim) {
    case 32:
      return launch_prefill_simt<T, 32, C>(p, stream);
    case 64:
      return launch_prefill_simt<T, 64, C>(p, stream);
    case 128:
      return launch_prefill_simt<T, 128, C>(p, stream);
    case 256:
      return launch_prefill_simt<T, 256, C>(p, stream);
    default:
      return "jaxattn: GPU prefill is built for head_dim 32, 64, 128 and 256";
  }
}

}  // namespace gpu
}  // namespace jaxattn
