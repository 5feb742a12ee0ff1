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
//         128-row tiles, 128-key tiles in rings filled by cp.async gathers, bf16/f16 q,
//         head_dim 64 and 128, warp-specialised (a copying warpgroup, two computing ones).
//         Used on compute capability 9.0 when the library was built with 90 among
//         JAXATTN_CUDA_ARCHS (JAXATTN_HAVE_SM90A) and either the requests bring at least
//         kSm90MinRowsPerRequest new tokens on average or the kernel can pack the query heads
//         of a KV head into a tile's rows (GQA groups of 2..16: prefill_sm90_packs). Without
//         packing (MHA), short extends leave most rows of a 128-row tile empty, and the mma
//         kernel's 64-row tiles served them faster on an H200 (32 x (1000 + 24), bf16, 32/8:
//         179 us against 227 us).
//   mma   tensor-core mma.sync m16n8k16 (bf16/f16 with f32 accumulation, cp.async double
//         buffering, swizzled shared memory) on NVIDIA sm_80+ for head_dim 64 and 128.
//   simt  portable SIMT kernel (f32 math in shared memory) for everything else and for HIP.
// FP8 caches (under a bf16 / f16 q): the simt kernel widens each element to float as it reads
// it; the mma kernel's FP8 variant (prefill_mma_fp8_kernel) and the sm90 kernel copy the tiles
// as stored, widen them to float16 in shared memory, and compute in float16. The per-head
// scales: k_scale joins the logit factor, v_scale the normalisation.
// The `kernel` attribute of the call (PrefillParams::kernel: auto, sm90, mma, simt, and
// sm90_persistent -- the sm90 kernel launched one block an SM, never chosen by auto; default auto:
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

// The guards' NaN. A request with an index entry outside the cache (`poisoned`) gets NaN in
// every row. A V element that is not finite needs care where the causal mask hides its key
// from some rows of the tile (KeyRange [full_end, end)): those rows multiply it by a
// probability of 0 inside the MMA, and 0 * NaN would poison them. So the kernels zero such
// elements in shared memory before P V and keep first_bad[d], the smallest such key of
// element d: row i of the request gets NaN in element d iff it sees that key (first_bad[d] <=
// i + Lk - Lq). Keys below full_end are seen by every row of the tile, so the MMA gives them
// the NaN of exact arithmetic unaided (an infinite V element there may come out NaN rather
// than infinity, when a probability multiplying it underflows to 0).
//
// Cost. The tensor-core kernels' per-tile loops keep the shape and the barriers they had
// without guards:
//  - a failed index check sets kGuardIndexBad in the thread's `flags` register (RowCursor,
//    check_entries), nothing else;
//  - each thread scans the V chunks it copied itself as soon as its copies have landed, before
//    the barrier that publishes the tile (sanitize_own_v: the keys the mask hides from some
//    rows, in the tiles that have them); a hit zeroes the elements, lowers first_bad and sets
//    kGuardValueBad right there;
//  - one __syncthreads_or after the loop folds the flags, and only when some thread raised one
//    does the store read first_bad and fold the index flags (one more barrier, rare).
// No branch in those loops holds a barrier: ptxas then keeps the loop's uniform datapath (a
// barrier under a branch it cannot prove uniform moved the wgmma kernel's loop counter and
// descriptor arithmetic to vector registers). first_bad lives in shared memory initialised
// before the loop: static in the sm90 kernel; in the mma kernel the q tile, free once q is in
// registers, since one static byte more costs that kernel its L1 carveout. The SIMT kernel
// sanitises V as it converts it into shared memory and raises a shared poison word.
constexpr int kNoBadKey = 0x7fffffff;
constexpr int kGuardIndexBad = 1;  // this thread saw an index entry outside the cache
constexpr int kGuardValueBad = 2;  // this thread sanitised a V element

// first_bad[d] = kNoBadKey for d = i, i + step, ... below D.
template <int D>
__device__ __forceinline__ void init_first_bad(int* first_bad, int i, int step) {
  for (int d = i; d < D; d += step) first_bad[d] = kNoBadKey;
}

// Rows [r0, r1) of heads [head, head + heads) of the output, every element `value`; written
// by threads 0 .. kThreads - 1 of the block (0: all of them).
template <typename T, int kThreads = 0>
__device__ void fill_prefill_rows(const PrefillParams& p, int head, int r0, int r1, float value,
                                  int heads = 1) {
  const int D = p.kv.head_dim;
  T* out = static_cast<T*>(p.out);
  const T v = from_float<T>(value);
  for (int i = threadIdx.x; i < (r1 - r0) * heads * D; i += kThreads > 0 ? kThreads : blockDim.x) {
    const int r = r0 + i / (heads * D), h = head + (i / D) % heads;
    out[(int64_t(r) * p.num_q_heads + h) * D + i % D] = v;
  }
}

template <int NT>
constexpr int kPrefillTileScratch = NT / WARP_SIZE + 6;

// The barriers of find_prefill_tile when the whole block calls it (kThreads 0: all of them).
struct PrefillBlockSync {
  static constexpr int kThreads = 0;
  static __device__ __forceinline__ void sync() { __syncthreads(); }
  static __device__ __forceinline__ bool sync_or(bool v) { return __syncthreads_or(v); }
};

// Finds the tile of block x (heaviest tiles of a request first: they see the most keys) with
// one coalesced pass of the block over the indptr arrays and a block-wide scan of the
// requests' tile counts; the same pass checks the indptr structure (first entry 0, no
// decrease), so the check costs no extra load latency. A request owns the tiles of its rows
// that lie inside q, so the tiles always fit the grid (ceil(total_q / bm) + batch blocks).
// Returns true when the block has a tile of a valid request to compute. Otherwise the block
// has written the rows it owns: all NaN when the structure is broken (no row can be assigned
// to a request: block x then owns rows [x bm, x bm + bm), so the grid covers every row); NaN
// for a tile of an invalid request (prefill_bounds_ok); zeros for padding rows past
// qo[batch]. All threads of the block must call it -- or, with another Sync (the barriers, and
// the number of threads calling: threads 0 .. NT - 1), those threads. `scratch`:
// kPrefillTileScratch<NT> ints of shared memory, which the caller may reuse after its next
// barrier (every thread reads the result out of it after the last barrier here); the kernels
// lend it memory that their first copies fill later. bm counts tokens; the block owns heads
// [head, head + heads) of them.
template <typename T, int NT, typename Sync = PrefillBlockSync>
__device__ bool find_prefill_tile(const PrefillParams& p, int bm, int x, int head, int* scratch,
                                  PrefillTile* t, int heads = 1) {
  constexpr int kWarps = NT / WARP_SIZE;
  int* warp_tiles = scratch;
  int* hit = scratch + kWarps;  // request, tile within it, q0, q1, lk, pool k1 -- of block x
  const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
  const int32_t* qo = p.cu_seqlens_q;
  const int32_t* kvp = p.page_indptr;
  if (tid == 0) hit[0] = -1;
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
    if (lane == WARP_SIZE - 1) warp_tiles[warp] = incl;
    Sync::sync();
    int total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int s = warp_tiles[w];
      total += s;
      if (w < warp) incl += s;
    }
    const int first = before + incl - tiles;
    if (tiles > 0 && x >= first && x < first + tiles) {
      hit[0] = b;
      hit[1] = x - first;
      hit[2] = q0;
      hit[3] = q1;
      hit[4] = lk;
      hit[5] = k1;
    }
    before += total;
    if (c0 + NT < p.batch) Sync::sync();  // warp_tiles is rewritten by the next chunk
  }
  if (Sync::sync_or(bad)) {
    fill_prefill_rows<T, Sync::kThreads>(p, head, min(x * bm, p.total_q),
                                         min(x * bm + bm, p.total_q), quiet_nan(), heads);
    return false;
  }
  const int b = hit[0];
  if (b < 0) {
    const int r0 = min(qo[p.batch], p.total_q) + (x - before) * bm;
    fill_prefill_rows<T, Sync::kThreads>(p, head, r0, min(r0 + bm, p.total_q), 0.f, heads);
    return false;
  }
  const int q0 = hit[2], q1 = hit[3];
  const int in_q = min(q1, p.total_q) - q0;  // the request's rows inside q
  t->b = b;
  t->m0 = ((in_q + bm - 1) / bm - 1 - hit[1]) * bm;
  t->rows = min(bm, in_q - t->m0);
  t->q0 = q0;
  t->lq = q1 - q0;
  t->lk = hit[4];
  const int k1 = hit[5];
  t->table =
      p.page_table + (kvp != nullptr ? int64_t(k1) - t->lk : int64_t(b) * p.page_table_stride);
  if (!prefill_bounds_ok(p, q0, q1, t->lk, k1)) {
    fill_prefill_rows<T, Sync::kThreads>(p, head, q0 + t->m0, q0 + t->m0 + t->rows, quiet_nan(),
                                         heads);
    return false;
  }
  return true;
}

// The mma kernels' tile x (find_prefill_tile's) and query head y, taken tile-major from the
// block's linear index -- the order in which blocks start, x fastest: every head's heaviest
// tiles in the first waves, the lightest tiles of all heads at the end. In the grid's own
// (x, y) order each head's tiles ran heaviest to lightest in turn, and the last heads' heavy
// tiles started less than a wave before the end and ran on alone: on an H100 the mma kernel
// took 3.5-5.4% longer on 8 x (2048 + 512), 1 x (0 + 8192) and 4 x (0 + 4096), bf16 and e4m3
// (prefill self-test, alternated twice; ffi/NOTES.md, round 61). The sm90 kernel keeps its
// grid's order: its GQA-packed grid (a KV head's 4 query heads in one tile, 8 heads in y) lost
// 2-2.5% on the two causal rows this way, the K and V of all KV heads in flight at once
// instead of one's. The SIMT kernel (HIP, and head dims the tensor-core kernels do not take)
// is not timed in this order and keeps the grid's.
struct PrefillBlock {
  int x, y;
};
__device__ __forceinline__ PrefillBlock prefill_block() {
  const unsigned l = blockIdx.y * gridDim.x + blockIdx.x;
  return {int(l / gridDim.y), int(l % gridDim.y)};
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
// never read, so their index entries are not used either. A page id outside the cache sets
// kGuardIndexBad in the thread's `flags` and ends the cursor (zero-filled from there on: the
// rows are NaN anyway). This is where every index entry a tile reads is checked: once per row
// and key tile, next to the load of the entry, and always before the copies of the tile that
// uses it, so before that tile's barrier.
struct RowCursor {
  int64_t off = -1;  // element offset in the cache; -1: zero-fill
  int page = 0;

  __device__ __forceinline__ void init(const KvGeometry& kv, const int32_t* table, int t, int lim,
                                       int& flags) {
    off = -1;
    if (t < lim) {
      page = table[kv.page_of(t)];
      if (index_ok(page, kv.num_pages)) {
        off = int64_t(page) * kv.page_stride + int64_t(kv.slot_of(t)) * kv.token_stride;
      } else {
        flags |= kGuardIndexBad;
      }
    }
  }

  __device__ __forceinline__ void advance(const KvGeometry& kv, const int32_t* table, int t,
                                          int step, int lim, int& flags) {
    const int tn = t + step;
    if (tn >= lim || off < 0) {
      off = -1;
      return;
    }
    advance_to(kv, table[kv.page_of(tn)], t, step, flags);
  }

  // The entry of key t + step loaded ahead by the caller (entry_ahead): advance's second half,
  // so that the load's latency hides behind a tile of work.
  __device__ __forceinline__ void advance_ahead(const KvGeometry& kv, int next, int t, int step,
                                                int lim, int& flags) {
    if (t + step >= lim || off < 0) {
      off = -1;
      return;
    }
    advance_to(kv, next, t, step, flags);
  }

  // The index entry of key t (0 at or past lim, where the cursor ends and reads nothing).
  static __device__ __forceinline__ int entry_ahead(const KvGeometry& kv, const int32_t* table,
                                                    int t, int lim) {
    return t < lim ? table[kv.page_of(t)] : 0;
  }

  __device__ __forceinline__ void advance_to(const KvGeometry& kv, int next, int t, int step,
                                             int& flags) {
    const int tn = t + step;
    if (!index_ok(next, kv.num_pages)) {
      flags |= kGuardIndexBad;
      off = -1;
      return;
    }
    off += int64_t(next - page) * kv.page_stride +
           int64_t(kv.slot_of(tn) - kv.slot_of(t)) * kv.token_stride;
    page = next;
  }
};

// The index entries of the request that no cursor of this tile reads (those of keys at or past
// KeyRange::end): checked once, coalesced, so that every tile of a request poisons its rows for
// a bad entry anywhere in [0, Lk), even past its own causal range. Issued right after a
// kernel's first copies, whose wait hides the first round of loads. The loads of one thread
// are independent (no early exit, nothing written), so kInFlight of them can be in flight at a
// time: a tile near the start of a long request checks most of its entries (an 8192-key
// request: up to 32 per thread of the sm90 kernel, which has no other block on its SM to hide
// the rounds); the tensor-core kernels take 16. The SIMT kernel, HIP's only one, takes 1:
// unrolled, hipcc kept registers for the loads into its loop (gfx90a, head_dim 128: 92 -> 112
// VGPRs, one wave less).
template <int NT, int kInFlight>
__device__ __forceinline__ void check_entries(const PrefillTile& t, const KvGeometry& kv, int end,
                                              int& flags) {
  const int last = pages_for(t.lk, kv.page_size);
  bool ok = true;
#pragma unroll kInFlight
  for (int i = pages_for(end, kv.page_size) + int(threadIdx.x); i < last; i += NT)
    ok &= index_ok(t.table[i], kv.num_pages);
  if (!ok) flags |= kGuardIndexBad;
}

// Whether element d of query row `row` (within the request) is NaN by the guards: a poisoned
// request, or a sanitised non-finite V element of a key the row sees (the guards' NaN, above
// kNoBadKey).
__device__ __forceinline__ bool guard_nan(const int* first_bad, bool poisoned, int d, int row,
                                          int shift) {
  return poisoned || first_bad[d] <= row + shift;
}

// Non-zero iff a 16-byte chunk of 16-bit V elements holds a non-finite one (exponent all
// ones: infinity or NaN); callers OR the results of their chunks and test once. Per 32-bit
// word, both halves at once: |h| + (the exponent's lowest bit) carries into the half's sign
// bit iff |h| >= the smallest non-finite (0x7f80 bf16, 0x7c00 f16), and no carry crosses into
// the upper half (0x7fff + 0x400 < 0x10000).
template <typename T>
__device__ __forceinline__ uint32_t v16_nonfinite(const uint4& v) {
  constexpr uint32_t kAdd = std::is_same_v<T, bf16_t> ? 0x00800080u : 0x04000400u;
  constexpr uint32_t kAbs = 0x7fff7fffu;
  return (((v.x & kAbs) + kAdd) | ((v.y & kAbs) + kAdd) | ((v.z & kAbs) + kAdd) |
          ((v.w & kAbs) + kAdd)) &
         0x80008000u;
}

// Zeroes the non-finite elements of one 16-byte chunk of V row `key` in shared memory (8
// head-dim elements) and lowers fb[e], the smallest such key of element e so far.
template <typename T>
__device__ __forceinline__ void sanitize_v16(uint4* chunk, int key, int (&fb)[8]) {
  constexpr uint32_t kExp = std::is_same_v<T, bf16_t> ? 0x7f80u : 0x7c00u;
  const uint4 v = *chunk;
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (((w[i] >> (16 * h)) & kExp) == kExp) {
        fb[2 * i + h] = min(fb[2 * i + h], key);
        w[i] &= h ? 0x0000ffffu : 0xffff0000u;
      }
    }
  }
  *chunk = make_uint4(w[0], w[1], w[2], w[3]);
}

// The tensor-core kernels' V pass over the kN chunks of one key tile that this thread copied
// itself (chunk i at chunk0 + i * kStride bytes, of key key0 + i * kKeyStride, head-dim
// elements d0 .. d0 + 7), run once its copies of the tile have landed and before the barrier
// that publishes the tile. The chunks of the keys that the mask hides from some rows of the
// tile, [full_end, end), are scanned; in the rare case of a non-finite element they are
// sanitised (zeroed, first_bad lowered). Returns whether it found one. The scan loads every
// chunk and masks the result, so the loads issue back to back; the rare part is a compact loop
// whose atomics come after it (ptxas gives a loop that holds atomics a yield point, and with it
// the enclosing loop lost its uniform datapath).
template <typename T, int kN, int kStride, int kKeyStride>
__device__ __forceinline__ bool sanitize_own_v(unsigned char* chunk0, int key0, int full_end,
                                               int end, int d0, int* first_bad) {
  auto hidden = [&](int i) {
    return unsigned(key0 + i * kKeyStride - full_end) < unsigned(end - full_end);
  };
  auto chunk = [&](int i) { return reinterpret_cast<uint4*>(chunk0 + i * kStride); };
  uint32_t bits = 0;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const uint32_t nf = v16_nonfinite<T>(*chunk(i));
    bits |= hidden(i) ? nf : 0u;
  }
  if (bits == 0) return false;
  int fb[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) fb[e] = kNoBadKey;
#pragma unroll 1
  for (int i = 0; i < kN; ++i)
    if (hidden(i)) sanitize_v16<T>(chunk(i), key0 + i * kKeyStride, fb);
#pragma unroll
  for (int e = 0; e < 8; ++e) atomicMin(&first_bad[d0 + e], fb[e]);
  return true;
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

  // The guards' state (above kNoBadKey), raised where found: first_bad as V is converted into
  // shared memory, poison after each index check (a flag register through this loop, or a
  // __syncthreads_or to fold one, cost hipcc up to 23 VGPRs and a wave). find_prefill_tile's
  // barriers order the initialisation before any update.
  __shared__ int first_bad[D];
  __shared__ int poison;
  init_first_bad<D>(first_bad, threadIdx.x, S::kThreads);
  if (threadIdx.x == 0) poison = 0;
  const int head = blockIdx.y;
  PrefillTile t;
  // The tile search's scratch: the K tile, first written after the loop's first barrier.
  if (!find_prefill_tile<T, S::kThreads>(p, BM, blockIdx.x, head, reinterpret_cast<int*>(ks), &t))
    return;
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
  {
    int flags = 0;
    if (tid < BN) cur.init(kv, t.table, tid, range.end, flags);
    check_entries<S::kThreads, 1>(t, kv, range.end, flags);
    if (flags) atomicOr(&poison, 1);
  }

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
      // Keys [full_end, end) are not seen by every row (the guards' NaN, above kNoBadKey).
      if (masked && n0 + rr >= range.full_end && !isfinite(v)) {
        atomicMin(&first_bad[d], n0 + rr);
        v = 0.f;
      }
      vs[rr * LD + d] = v;
    }
    if (tid < BN) {
      int flags = 0;
      cur.advance(kv, t.table, n0 + tid, BN, range.end, flags);
      if (flags) atomicOr(&poison, 1);
    }
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

  // The guards' state was last written before the last tile's second barrier.
  const bool poisoned = poison != 0;
  if (r < t.rows) {
    T* out = static_cast<T*>(p.out) + (int64_t(t.q0 + qi) * p.num_q_heads + head) * D;
    // NaN in l stays NaN; the value scale joins the normalisation.
    const float inv = l == 0.f ? 0.f : p.scales.v_of(kvh) / l;
#pragma unroll
    for (int i = 0; i < S::kDimsPerLane; ++i) {
      const int d = c + i * TPR;
      out[d] =
          from_float<T>(guard_nan(first_bad, poisoned, d, qi, shift) ? quiet_nan() : acc[i] * inv);
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

// Token of row r of a tile: r itself, or with packed heads (kPack: the sm90 kernel's packed
// instantiation) r / p.pack_heads by the launcher's multiplier (a runtime division costs ~20
// instructions and registers the sm90 kernels lack; the unpacked instantiations keep their
// exact old code).
template <bool kPack>
__device__ __forceinline__ int pack_token(const PrefillParams& p, int r) {
  return kPack ? int((uint64_t(uint32_t(r)) * p.pack_magic) >> 32) : r;
}

// Writes a warp's 16 rows of a tensor-core tile, lr0 and lr0 + 8 (within the tile), from the
// accumulator fragments: o[4 i + e] is element i * 8 + 2 tq + (e & 1) of row lr0 (e < 2) or
// lr0 + 8 -- the m16n8 layout of the mma kernel and the m64nN layout of the sm90 kernel alike.
// Normalised by the quad-summed l0 / l1 (0 when a row saw nothing; NaN stays NaN) and scaled by
// the KV head's value scale vs. Tile row r is token r / G, head `head` + r % G (G =
// p.pack_heads with kPack, else 1).
template <typename T, int D, bool kPack>
__device__ __forceinline__ void prefill_mma_store_rows(const PrefillParams& p, const PrefillTile& t,
                                                       int head, int lr0, int tq, float l0,
                                                       float l1, float vs, const float* o,
                                                       const int* first_bad, bool poisoned,
                                                       int shift) {
  const bool guarded = first_bad != nullptr;
  const float inv0 = l0 == 0.f ? 0.f : vs / l0, inv1 = l1 == 0.f ? 0.f : vs / l1;
  const int G = kPack ? p.pack_heads : 1;
  const int lr1 = pack_token<kPack>(p, lr0 + 8), h1 = head + lr0 + 8 - lr1 * G;  // token, head
  const int tk0 = pack_token<kPack>(p, lr0), h0 = head + lr0 - tk0 * G;
  lr0 = tk0;
  const int row0 = t.m0 + lr0, row1 = t.m0 + lr1;  // within the request
  const bool ok0 = lr0 < t.rows, ok1 = lr1 < t.rows;
  // This thread's first pair of each row (a row past the tile's points at the tile's first),
  // computed once: each pair is then its conversion and a store at an immediate offset (with
  // the address inside every conditional store, ptxas rebuilt it there: ~18 instructions a
  // pair in the sm90 kernel).
  T* const out = static_cast<T*>(p.out);
  T* const out0 =
      out + (int64_t(t.q0 + (ok0 ? row0 : t.m0)) * p.num_q_heads + h0) * D + 2 * tq;
  T* const out1 =
      out + (int64_t(t.q0 + (ok1 ? row1 : t.m0)) * p.num_q_heads + h1) * D + 2 * tq;
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    const int d = i * 8 + 2 * tq;
    float a0 = o[4 * i] * inv0, b0 = o[4 * i + 1] * inv0;
    float a1 = o[4 * i + 2] * inv1, b1 = o[4 * i + 3] * inv1;
    if (guarded) {
      const float nan = quiet_nan();
      if (guard_nan(first_bad, poisoned, d, row0, shift)) a0 = nan;
      if (guard_nan(first_bad, poisoned, d + 1, row0, shift)) b0 = nan;
      if (guard_nan(first_bad, poisoned, d, row1, shift)) a1 = nan;
      if (guard_nan(first_bad, poisoned, d + 1, row1, shift)) b1 = nan;
    }
    if (ok0) *reinterpret_cast<uint32_t*>(out0 + i * 8) = pack2<T>(a0, b0);
    if (ok1) *reinterpret_cast<uint32_t*>(out1 + i * 8) = pack2<T>(a1, b1);
  }
}

// The end of a tensor-core kernel: its rows, with the guards' NaN when some thread raised a
// flag (then one more barrier folds the index flags). All threads of the block call it.
template <typename T, int D, bool kPack = false>
__device__ __forceinline__ void prefill_mma_store(const PrefillParams& p, const PrefillTile& t,
                                                  int head, int lr0, int tq, float l0, float l1,
                                                  float vs, const float* o, int flags,
                                                  const int* first_bad) {
  if (__syncthreads_or(flags)) {  // also orders every update of first_bad before the reads
    const bool poisoned = __syncthreads_or(flags & kGuardIndexBad);
    prefill_mma_store_rows<T, D, kPack>(p, t, head, lr0, tq, l0, l1, vs, o, first_bad,
                                        poisoned, t.lk - t.lq);
  } else {
    prefill_mma_store_rows<T, D, kPack>(p, t, head, lr0, tq, l0, l1, vs, o, nullptr, false, 0);
  }
}

// One key tile of the mma kernels, 16-bit and FP8 caches alike (M: the operand type, T or
// float16): S = Q K^T from this warp's q fragments and the K tile at kb, the logits (times the
// rows' factors qs0 / qs1; the soft cap and the mask as compile-time variants, so the common
// tile -- no cap, no mask -- runs straight through: left to the compiler, they came out as a
// test around every tanhf and mask selects on every tile once the loop grew), the online
// softmax on this lane's rows row0 / row1 (m0, m1, and partial row sums l0, l1 that the quad
// adds once at the end), O rescaled, and O += P V from the V tile at vb (the accumulator layout
// of S is the A-operand layout of P: no shuffles).
template <typename M, int D, int BN>
__device__ __forceinline__ void prefill_mma_tile(const PrefillParams& p, const PrefillTile& t,
                                                 const uint32_t (&qf)[D / 16][4], uint32_t kb,
                                                 uint32_t vb, int n0, bool masked, int row0,
                                                 int row1, int shift, float qs0, float qs1,
                                                 float (&o)[D / 8][4], float& m0, float& m1,
                                                 float& l0, float& l1) {
  constexpr float kNegInf = -__builtin_huge_valf();
  const int lane = int(threadIdx.x) % 32, tq = lane % 4;
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
  // Logits and row maxima.
  auto logits = [&](auto cap_tag, auto mask_tag) {
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = s[j][e] * (e < 2 ? qs0 : qs1);
        if constexpr (decltype(cap_tag)::value) v = p.ls.cap_log2e * tanhf(v);
        if constexpr (decltype(mask_tag)::value) {
          const int key = n0 + j * 8 + 2 * tq + (e & 1);
          const int qi = e < 2 ? row0 : row1;
          if (key >= t.lk || key > qi + shift) v = kNegInf;
        }
        s[j][e] = v;
      }
      mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
      mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
    }
  };
  using True = std::true_type;
  using False = std::false_type;
  if (p.ls.cap_log2e > 0.f) {
    if (masked) {
      logits(True{}, True{});
    } else {
      logits(True{}, False{});
    }
  } else {
    if (masked) {
      logits(False{}, True{});
    } else {
      logits(False{}, False{});
    }
  }
  float a0, a1;
  mma_online_softmax(s, mx0, mx1, m0, m1, l0, l1, a0, a1);
  scale_c_rows(o, a0, a1);
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    uint32_t pf[4];
    p_fragment<M>(s, kk, pf);
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t bfr[4];
      const int key = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
      ldmatrix_x4_trans(bfr, vb + swz<D>(key, 2 * dp + lane / 16));
      mma16816<M>(o[2 * dp], pf, bfr[0], bfr[1]);
      mma16816<M>(o[2 * dp + 1], pf, bfr[2], bfr[3]);
    }
  }
}

// The mma kernels' first two key tiles: their row offsets into rowoff[0, 2 BN) (threads below
// BN, a row each; cur left on tile 1's row), then a barrier.
template <int BN>
__device__ __forceinline__ void prefill_first_offsets(const KvGeometry& kv, const PrefillTile& t,
                                                      int end, int64_t* rowoff, RowCursor& cur,
                                                      int& flags) {
  const int tid = threadIdx.x;
  if (tid < BN) {
    cur.init(kv, t.table, tid, end, flags);
    rowoff[tid] = cur.off;
    cur.advance(kv, t.table, tid, BN, end, flags);
    rowoff[BN + tid] = cur.off;
  }
  __syncthreads();
}

// The tile's q rows of query head `head` into q_s (BM rows of D 16-bit elements, swizzled):
// chunk tid % CH of rows tid / CH + i * RP, zeros past the tile's rows. Uncommitted.
template <typename T, int D, int BM, int CH, int RP>
__device__ __forceinline__ void prefill_copy_q(const PrefillParams& p, const PrefillTile& t,
                                               int head, unsigned char* q_s) {
  const T* qg = static_cast<const T*>(p.q);
  const int tid = threadIdx.x, c = tid % CH;
#pragma unroll
  for (int i = 0; i < BM / RP; ++i) {
    const int r = tid / CH + i * RP;
    const bool ok = r < t.rows;
    const T* src = ok ? qg + (int64_t(t.q0 + t.m0 + r) * p.num_q_heads + head) * D + c * 8 : qg;
    async_copy16_at(smem_u32(q_s) + swz<D>(r, c), src, ok);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(MmaShape<D>::kThreads, 2)
    prefill_mma_kernel(const PrefillParams p) {
#if __CUDA_ARCH__ >= 800
  using S = MmaShape<D>;
  constexpr int BM = S::kBM, BN = S::kBN, CH = S::kChunks, RP = S::kRowsPerPass;
  constexpr float kNegInf = -__builtin_huge_valf();
  // Dynamic shared memory only: two blocks of kSmemBytes (plus the 1 KB the system reserves
  // per block) fill the 164 KB carveout of D = 128 exactly, and one static byte more makes the
  // driver take the next carveout, whose L1 is 32 KB smaller (the query heads of one KV head
  // run as separate blocks and hit each other's K/V in L1).
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* q_s = smem;
  unsigned char* k_s = q_s + BM * D * 2;                                  // [2][BN][D]
  unsigned char* v_s = k_s + 2 * S::kTileBytes;                           // [2][BN][D]
  int64_t* rowoff = reinterpret_cast<int64_t*>(v_s + 2 * S::kTileBytes);  // [2][BN]
  // The guards' first_bad takes the place of the q tile's first rows, which only warp 0 reads,
  // once q is in registers (before the loop).
  int* first_bad = reinterpret_cast<int*>(q_s);
  static_assert(D * 4 <= 16 * D * 2, "first_bad must fit warp 0's q rows");
  static_assert(kPrefillTileScratch<S::kThreads> * 4 <= S::kTileBytes, "scratch must fit a tile");
  static_assert(RP % 8 == 0, "a thread's copy rows must share one swizzle phase");

  const PrefillBlock blk = prefill_block();
  const int head = blk.y;
  PrefillTile t;
  // The tile search's scratch: the K ring, which the first copies fill after the barrier
  // that follows the row offsets below.
  if (!find_prefill_tile<T, S::kThreads>(p, BM, blk.x, head, reinterpret_cast<int*>(k_s), &t))
    return;
  const KvGeometry& kv = p.kv;
  const int kvh = head / (p.num_q_heads / kv.num_kv_heads);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  const int shift = t.lk - t.lq;
  const KeyRange range = key_range(t);
  const int ntiles = (range.end + BN - 1) / BN;

  int flags = 0;  // kGuardIndexBad, kGuardValueBad
  RowCursor cur;
  prefill_first_offsets<BN>(kv, t, range.end, rowoff, cur, flags);

  const T* kg = static_cast<const T*>(p.k) + kvh * kv.head_stride;
  const T* vg = static_cast<const T*>(p.v) + kvh * kv.head_stride;
  prefill_copy_q<T, D, BM, CH, RP>(p, t, head, q_s);
  async_copy_commit();
  const int c = tid % CH;
  // This thread copies chunk c of rows tid / CH + i * RP of every key tile.
  auto load_kv = [&](int buf) {
#pragma unroll
    for (int i = 0; i < BN / RP; ++i) {
      const int r = tid / CH + i * RP;
      const int64_t off = rowoff[buf * BN + r];
      const bool ok = off >= 0;
      const uint32_t dst = swz<D>(r, c) + uint32_t(buf * S::kTileBytes);
      async_copy16_at(smem_u32(k_s) + dst, ok ? kg + off + c * 8 : kg, ok);
      async_copy16_at(smem_u32(v_s) + dst, ok ? vg + off + c * 8 : vg, ok);
    }
  };
  // Copy groups: q, tile 0, tile 1, then one per tile from the loop (tile n + 1 in iteration n
  // >= 1), so iteration n waits for all but the newest.
  if (ntiles > 0) load_kv(0);
  async_copy_commit();
  if (ntiles > 1) load_kv(1);
  async_copy_commit();
  check_entries<S::kThreads, 16>(t, kv, range.end, flags);  // while the tiles are in flight

  // q into registers before the loop, so that its tile can hold first_bad.
  uint32_t qf[D / 16][4];
  async_copy_wait<2>();
  __syncthreads();  // q visible
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int r = warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
    ldmatrix_x4(qf[kk], smem_u32(q_s) + swz<D>(r, 2 * kk + lane / 16));
  }
  if (warp == 0) {
    __syncwarp();  // the warp's q fragments are read
    init_first_bad<D>(first_bad, lane, 32);
  }
  __syncthreads();  // first_bad initialised before any tile can lower it

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m0 = kNegInf, m1 = kNegInf, l0 = 0.f, l1 = 0.f;
  const int row0 = t.m0 + warp * 16 + g;  // query rows of this lane, within the request
  const int row1 = row0 + 8;
  const float q_scale = p.ls.q_scale * p.scales.k_of(kvh);  // with the KV head's key scale

  for (int n = 0; n < ntiles; ++n) {
    const int buf = n & 1;
    if (n > 0) {
      if (n + 1 < ntiles) load_kv(buf ^ 1);
      async_copy_commit();
    }
    async_copy_wait<1>();
    const int n0 = n * BN;
    const bool masked = n0 + BN > range.full_end;
    // This thread's V chunks of the tile: chunk c of rows tid / CH + i * RP, which share their
    // swizzle phase (RP % 8 == 0), so they lie RP rows apart.
    if (masked && sanitize_own_v<T, BN / RP, RP * D * 2, RP>(
                      v_s + buf * S::kTileBytes + swz<D>(tid / CH, c), n0 + tid / CH,
                      range.full_end, range.end, c * 8, first_bad))
      flags |= kGuardValueBad;
    __syncthreads();  // tile n visible
    const uint32_t kb = smem_u32(k_s) + uint32_t(buf * S::kTileBytes);
    const uint32_t vb = smem_u32(v_s) + uint32_t(buf * S::kTileBytes);

    prefill_mma_tile<T, D, BN>(p, t, qf, kb, vb, n0, masked, row0, row1, shift, q_scale,
                               q_scale, o, m0, m1, l0, l1);

    if (tid < BN) {
      // Row offsets of tile n + 2 go where tile n's were: those loads were issued already.
      cur.advance(kv, t.table, (n + 1) * BN + tid, BN, range.end, flags);
      rowoff[buf * BN + tid] = cur.off;
    }
    __syncthreads();  // tile n's buffers are free for tile n + 2
  }
  async_copy_wait<0>();

  l0 = group_sum<4>(l0);
  l1 = group_sum<4>(l1);
  prefill_mma_store<T, D>(p, t, head, warp * 16 + g, tq, l0, l1, p.scales.v_of(kvh), &o[0][0],
                          flags, first_bad);
#endif
}

// FP8 caches on the tensor cores. A key tile is copied as stored (16-byte cp.async copies of
// FP8 rows, half the bytes) into a staging area and widened to float16 in shared memory, where
// the 16-bit kernel's fragment loads read it: every FP8 value is exact in float16. Each thread
// widens exactly the chunks it copied, so it needs no barrier to read them (its own copies are
// visible to it after its wait), and the widened tile needs only one buffer: it is written after
// the barrier that ends the previous tile. A bf16 q is moved to float16, each row by the power
// of two that puts its largest |q| in [2^14, 2^15) (only elements below 2^-24 of the row's
// largest lose bits), undone in the row's f32 logit factor.

// The FP8 chunk a thread copies and widens in a key tile: 16-byte chunk c8 of row r8 (F8
// chunks a row, NT / F8 rows a pass); its float16 chunks 2 c8 and 2 c8 + 1 go to the same row of
// a tile swizzled by 16-byte chunk ^ (row & 7). A quarter-warp's 16-byte accesses take one
// wavefront when its 8 threads meet 8 different bank groups. With 8 chunks a row (head_dim 128)
// the plain order (row tid / 8, chunk tid % 8) gives a quarter-warp one row, whose chunks c8
// and c8 + 4 widen into chunks c and c + 8: the same bank group, two wavefronts for every
// widened store. Instead each quarter-warp takes one half of a row and the other half of the
// next row: the staging reads stay on 8 bank groups (a row is 128 bytes there) and the stores
// land on both parities of the row phase. Each warp still covers 4 whole rows.
template <int F8>
__device__ __forceinline__ void fp8_widen_chunk(int tid, int& r8, int& c8) {
  if constexpr (F8 == 8) {
    const int j = tid % 8, quarter = (tid / 8) % 4, next = j / 4;
    r8 = (tid / 32) * 4 + 2 * (quarter / 2) + next;
    c8 = 4 * (next ^ (quarter % 2)) + j % 4;
  } else {
    r8 = tid / F8;
    c8 = tid % F8;
  }
}

// 16 FP8 codes -> 16 float16 (two 16-byte chunks), exact.
template <typename C>
__device__ __forceinline__ void fp8x16_to_f16(const uint4& in, uint4& lo, uint4& hi) {
  fp8x4_to_f16x2<C, false>(in.x, lo.x, lo.y);
  fp8x4_to_f16x2<C, false>(in.y, lo.z, lo.w);
  fp8x4_to_f16x2<C, false>(in.z, hi.x, hi.y);
  fp8x4_to_f16x2<C, false>(in.w, hi.z, hi.w);
}

// The larger of m and the magnitudes of a bf16 pair (fmaxf skips NaN: a NaN q stays NaN when
// it is scaled).
__device__ __forceinline__ float bf16x2_absmax(uint32_t w, float m) {
  return fmaxf(m, fmaxf(fabsf(__uint_as_float(w << 16)), fabsf(__uint_as_float(w & 0xffff0000u))));
}

// A bf16 pair times `pre`, as a float16 pair.
__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t w, float pre) {
  return pack2<f16_t>(__uint_as_float(w << 16) * pre, __uint_as_float(w & 0xffff0000u) * pre);
}

// The power of two `pre` that puts qmax = 1.x * 2^(e - 127) in [2^E, 2^(E + 1)) (2^(E + 127 -
// e), clamped to normal floats), and its inverse `post`: a row of q scaled into a narrower
// format's range (float16: E = 14; e4m3, whose largest finite value is 448: E = 7).
template <int E>
__device__ __forceinline__ void pow2_row_factors(float qmax, float& pre, float& post) {
  const int e = int((__float_as_uint(qmax) >> 23) & 0xffu);
  const int biased = min(max(254 + E - e, 1), 253);
  pre = __uint_as_float(uint32_t(biased) << 23);
  post = __uint_as_float(uint32_t(254 - biased) << 23);
}
__device__ __forceinline__ void f16_row_factors(float qmax, float& pre, float& post) {
  pow2_row_factors<14>(qmax, pre, post);
}

// A warp's q fragments (ldmatrix of 16 bf16 rows: registers 0 and 2 of every k step hold row g,
// 1 and 3 row g + 8, and the quad's four lanes the whole row) to float16 in registers, each row
// scaled by f16_row_factors; post0 / post1 get the inverses of rows g and g + 8. The mma
// kernel's q never goes back to shared memory, whose q tile then holds first_bad.
template <int D>
__device__ __forceinline__ void q_frags_bf16_to_f16(uint32_t (&qf)[D / 16][4], float& post0,
                                                    float& post1) {
  float mx0 = 0.f, mx1 = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    mx0 = bf16x2_absmax(qf[kk][2], bf16x2_absmax(qf[kk][0], mx0));
    mx1 = bf16x2_absmax(qf[kk][3], bf16x2_absmax(qf[kk][1], mx1));
  }
  mx0 = group_max<4>(mx0);
  mx1 = group_max<4>(mx1);
  float pre0, pre1;
  f16_row_factors(mx0, pre0, post0);
  f16_row_factors(mx1, pre1, post1);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    qf[kk][0] = bf16x2_to_f16x2(qf[kk][0], pre0);
    qf[kk][1] = bf16x2_to_f16x2(qf[kk][1], pre1);
    qf[kk][2] = bf16x2_to_f16x2(qf[kk][2], pre0);
    qf[kk][3] = bf16x2_to_f16x2(qf[kk][3], pre1);
  }
}

template <int D>
struct MmaFp8Shape {
  static constexpr int kBM = 64;
  static constexpr int kBN = 64;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kChunks = D / 8;  // 16-byte chunks of a 16-bit row (q, widened K / V)
  static constexpr int kRowsPerPass = kThreads / kChunks;
  static constexpr int kTileBytes = kBN * D * 2;        // a widened (float16) K or V tile
  static constexpr int kStageBytes = kBN * D;           // an FP8 K or V tile
  static constexpr int kF8Chunks = D / 16;              // 16-byte FP8 chunks a row
  static constexpr int kF8Rows = kThreads / kF8Chunks;  // rows a pass of the block copies
  // Q; the widened K and V (one buffer each); the FP8 staging of two tiles (K and V each); the
  // row offsets of two tiles. The 16-bit kernel's size exactly, so two blocks still fill the
  // 164 KB carveout of D = 128 with no static shared memory (prefill_mma_kernel).
  static constexpr int kSmemBytes = kBM * D * 2 + 2 * kTileBytes + 4 * kStageBytes + 2 * kBN * 8;
  static_assert(D == 64 || D == 128, "the MMA kernel is built for head_dim 64 and 128");
  static_assert(kSmemBytes == MmaShape<D>::kSmemBytes, "the FP8 kernel keeps the carveout");
};

template <typename T, typename C, int D>
__global__ void __launch_bounds__(MmaFp8Shape<D>::kThreads, 2)
    prefill_mma_fp8_kernel(const PrefillParams p) {
#if __CUDA_ARCH__ >= 800
  using S = MmaFp8Shape<D>;
  using M = f16_t;
  constexpr int BM = S::kBM, BN = S::kBN, CH = S::kChunks, RP = S::kRowsPerPass;
  constexpr int F8 = S::kF8Chunks, F8R = S::kF8Rows;
  constexpr float kNegInf = -__builtin_huge_valf();
  // Dynamic shared memory only, as in prefill_mma_kernel (one static byte costs the carveout).
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* q_s = smem;
  unsigned char* k_s = q_s + BM * D * 2;      // [BN][D] float16
  unsigned char* v_s = k_s + S::kTileBytes;   // [BN][D] float16
  unsigned char* st_s = v_s + S::kTileBytes;  // [2 slots][K, V][BN][D] FP8
  int64_t* rowoff = reinterpret_cast<int64_t*>(st_s + 4 * S::kStageBytes);  // [2][BN]
  // The guards' first_bad over warp 0's q rows once q is in registers, as in prefill_mma_kernel.
  int* first_bad = reinterpret_cast<int*>(q_s);
  static_assert(D * 4 <= 16 * D * 2, "first_bad must fit warp 0's q rows");
  static_assert(kPrefillTileScratch<S::kThreads> * 4 <= S::kTileBytes, "scratch must fit a tile");
  static_assert(F8R % 8 == 0, "a thread's widened rows must share one swizzle phase");

  const PrefillBlock blk = prefill_block();
  const int head = blk.y;
  PrefillTile t;
  // The tile search's scratch: the widened K tile, first written in the loop.
  if (!find_prefill_tile<T, S::kThreads>(p, BM, blk.x, head, reinterpret_cast<int*>(k_s), &t))
    return;
  const KvGeometry& kv = p.kv;
  const int kvh = head / (p.num_q_heads / kv.num_kv_heads);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  const int shift = t.lk - t.lq;
  const KeyRange range = key_range(t);
  const int ntiles = (range.end + BN - 1) / BN;

  int flags = 0;  // kGuardIndexBad, kGuardValueBad
  RowCursor cur;
  prefill_first_offsets<BN>(kv, t, range.end, rowoff, cur, flags);

  const C* kg = static_cast<const C*>(p.k) + kvh * kv.head_stride;
  const C* vg = static_cast<const C*>(p.v) + kvh * kv.head_stride;
  prefill_copy_q<T, D, BM, CH, RP>(p, t, head, q_s);
  async_copy_commit();
  // This thread's FP8 chunks of every key tile: chunk c8 of rows r8 + i * F8R; it widens them
  // into chunks 2 c8 and 2 c8 + 1 of the same rows, which share their swizzle phase
  // (F8R % 8 == 0), so they lie F8R rows apart.
  int r8, c8;
  fp8_widen_chunk<F8>(tid, r8, c8);
  auto stage_k = [&](int slot, int r) { return st_s + (2 * slot * BN + r) * D + c8 * 16; };
  auto stage_v = [&](int slot, int r) { return st_s + ((2 * slot + 1) * BN + r) * D + c8 * 16; };
  auto load_fp8 = [&](int slot) {  // the tile whose offsets are in rowoff slot `slot`
#pragma unroll
    for (int i = 0; i < BN / F8R; ++i) {
      const int r = r8 + i * F8R;
      const int64_t off = rowoff[slot * BN + r];
      const bool ok = off >= 0;
      async_copy16_at(smem_u32(stage_k(slot, r)), ok ? kg + off + c8 * 16 : kg, ok);
      async_copy16_at(smem_u32(stage_v(slot, r)), ok ? vg + off + c8 * 16 : vg, ok);
    }
  };
  auto widen = [&](int slot) {
    // K, then V, each half's loads back to back before its stores (as in the sm90 kernel).
    constexpr int R = BN / F8R;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      unsigned char* dst = h == 0 ? k_s : v_s;
      uint4 raw[R];
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int r = r8 + i * F8R;
        raw[i] = lds128(h == 0 ? stage_k(slot, r) : stage_v(slot, r));
      }
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int r = r8 + i * F8R;
        uint4 lo, hi;
        fp8x16_to_f16<C>(raw[i], lo, hi);
        *reinterpret_cast<uint4*>(dst + swz<D>(r, 2 * c8)) = lo;
        *reinterpret_cast<uint4*>(dst + swz<D>(r, 2 * c8 + 1)) = hi;
      }
    }
  };
  // Copy groups: q, tile 0, tile 1, then one per tile from the loop (tile n + 1 in iteration
  // n >= 1, into the staging slot of tile n - 1, which only this thread reads and has widened),
  // so iteration n waits for all but the newest.
  if (ntiles > 0) load_fp8(0);
  async_copy_commit();
  if (ntiles > 1) load_fp8(1);
  async_copy_commit();
  check_entries<S::kThreads, 16>(t, kv, range.end, flags);  // while the tiles are in flight

  // q into registers (as float16) before the loop, so that its tile can hold first_bad.
  uint32_t qf[D / 16][4];
  async_copy_wait<2>();
  __syncthreads();  // q visible
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int r = warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
    ldmatrix_x4(qf[kk], smem_u32(q_s) + swz<D>(r, 2 * kk + lane / 16));
  }
  // The logit factors of this lane's rows: q_scale with the KV head's key scale, and a bf16
  // row's inverse power of two.
  float qs0 = p.ls.q_scale * p.scales.k_of(kvh), qs1 = qs0;
  if constexpr (std::is_same_v<T, bf16_t>) {
    float post0, post1;
    q_frags_bf16_to_f16<D>(qf, post0, post1);
    qs0 *= post0;
    qs1 *= post1;
  }
  if (warp == 0) {
    __syncwarp();  // the warp's q fragments are read
    init_first_bad<D>(first_bad, lane, 32);
  }
  __syncthreads();  // first_bad initialised before any tile can lower it

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m0 = kNegInf, m1 = kNegInf, l0 = 0.f, l1 = 0.f;
  const int row0 = t.m0 + warp * 16 + g;  // query rows of this lane, within the request
  const int row1 = row0 + 8;
  const uint32_t kb = smem_u32(k_s), vb = smem_u32(v_s);

  for (int n = 0; n < ntiles; ++n) {
    const int slot = n & 1;
    if (n > 0) {
      if (n + 1 < ntiles) load_fp8(slot ^ 1);
      async_copy_commit();
    }
    async_copy_wait<1>();  // this thread's copies of tile n landed
    const int n0 = n * BN;
    const bool masked = n0 + BN > range.full_end;
    widen(slot);
    // The guards' V pass over the chunks this thread just widened (its own stores, visible to
    // it), before the barrier that publishes them, as in prefill_mma_kernel.
    if (masked) {
      const bool lo = sanitize_own_v<M, BN / F8R, F8R * D * 2, F8R>(
          v_s + swz<D>(r8, 2 * c8), n0 + r8, range.full_end, range.end, c8 * 16, first_bad);
      const bool hi = sanitize_own_v<M, BN / F8R, F8R * D * 2, F8R>(
          v_s + swz<D>(r8, 2 * c8 + 1), n0 + r8, range.full_end, range.end, c8 * 16 + 8, first_bad);
      if (lo || hi) flags |= kGuardValueBad;
    }
    __syncthreads();  // the widened tile visible to every warp

    prefill_mma_tile<M, D, BN>(p, t, qf, kb, vb, n0, masked, row0, row1, shift, qs0, qs1, o, m0,
                               m1, l0, l1);

    if (tid < BN) {
      // Row offsets of tile n + 2 go where tile n's were: those copies were issued already.
      cur.advance(kv, t.table, (n + 1) * BN + tid, BN, range.end, flags);
      rowoff[slot * BN + tid] = cur.off;
    }
    __syncthreads();  // the widened tiles are free for tile n + 1
  }
  async_copy_wait<0>();

  l0 = group_sum<4>(l0);
  l1 = group_sum<4>(l1);
  prefill_mma_store<T, D>(p, t, head, warp * 16 + g, tq, l0, l1, p.scales.v_of(kvh), &o[0][0],
                          flags, first_bad);
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
// dynamic shared memory) over the tile grid: an upper bound on the tiles, times the heads. With
// p.pack_heads = G > 1 (the sm90 kernel's packed tiles) a tile holds kBM / G tokens of G heads.
template <typename S, typename Kernel>
const char* launch_prefill_tiles(Kernel kernel, const PrefillParams& p, gpuStream_t stream) {
  if (const char* e = allow_dynamic_smem(kernel, S::kSmemBytes)) return e;
  const int bm = S::kBM / p.pack_heads;
  const dim3 grid((p.total_q + bm - 1) / bm + p.batch, p.num_q_heads / p.pack_heads);
  kernel<<<grid, S::kThreads, S::kSmemBytes, stream>>>(p);
  return check_launch();
}

template <typename T, int D, typename C = T>
const char* launch_prefill_mma(const PrefillParams& p, gpuStream_t stream) {
  if constexpr (sizeof(C) == 1) {
    return launch_prefill_tiles<MmaFp8Shape<D>>(prefill_mma_fp8_kernel<T, C, D>, p, stream);
  } else {
    return launch_prefill_tiles<MmaShape<D>>(prefill_mma_kernel<T, D>, p, stream);
  }
}

inline bool device_has_mma() { return current_device_caps().major >= 8; }
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
// kSm90Persistent: the sm90 kernel with one block an SM claiming tiles from a counter (not
// chosen by kAuto: through the public ops on an H100 level with the one-tile-a-block launch on
// long extends, up to 5% behind on short ones; ffi/NOTES.md, rounds 13 and 63).
enum class PrefillKernel { kAuto = 0, kSm90 = 1, kMma = 2, kSimt = 3, kSm90Persistent = 4 };

// Mean new tokens per request below which `auto` prefers the mma kernel's 64-row tiles (when
// the sm90 kernel cannot pack heads).
constexpr int kSm90MinRowsPerRequest = 64;
// Whether the sm90 kernel packs the query heads of a KV head into each tile's rows
// (PrefillParams::pack_heads; GQA groups of 2 to 16). A short extend then fills its 128-row
// tiles (24 new tokens x 4 heads = 96 rows instead of 24) and every shape reads each K/V tile
// once per KV head instead of once per query head. H200, bf16, 32/8 (prefill self-test): 32 x
// (1000 + 24) 171 TFLOP/s against the mma kernel's 74 (the sm90 kernel unpacked: 57); 1 x
// (0 + 8192) 381 against 366 unpacked; 8 x (2048 + 512) 337 against 339. FP8 caches pack too.
inline bool prefill_sm90_packs(const PrefillParams& p) {
  const int group = p.kv.num_kv_heads > 0 ? p.num_q_heads / p.kv.num_kv_heads : 1;
  return group >= 2 && group <= 16;
}

// T: q's and the output's element type; C: the cache's (T, or an FP8 format under a 16-bit T:
// the tensor-core kernels then compute in float16, the SIMT kernel widens to float).
template <typename T, typename C = T>
const char* launch_prefill_typed(const PrefillParams& p, gpuStream_t stream) {
  if (p.kernel < 0 || p.kernel > 4) return "jaxattn: prefill kernel must be 0..4";
  // Unused in HIP builds, which have the SIMT kernel only.
  [[maybe_unused]] const PrefillKernel which = static_cast<PrefillKernel>(p.kernel);
  // batch 0 still launches: its rows are padding (zeros), or NaN when qo[0] != 0.
  if (p.total_q == 0 || p.num_q_heads == 0) return nullptr;
  if (p.num_q_heads > 65535) return "jaxattn: more than 65535 query heads";
#if defined(JAXATTN_CUDA)
  if constexpr (sizeof(T) == 2) {
    const bool tc_dim = p.kv.head_dim == 64 || p.kv.head_dim == 128;
    const bool forced = which == PrefillKernel::kSm90 || which == PrefillKernel::kSm90Persistent;
    if (tc_dim && (which == PrefillKernel::kAuto || forced)) {
#if defined(JAXATTN_HAVE_SM90A)
      const bool long_enough = forced ||
                               int64_t(p.total_q) >= int64_t(kSm90MinRowsPerRequest) * p.batch ||
                               prefill_sm90_packs(p);
      if (long_enough && device_is_sm90() && prefill_sm90_fits(p))
        return launch_prefill_sm90<T, C>(p, stream);
#endif
      if (forced)
        return "jaxattn: the sm90 prefill kernel needs a compute capability 9.0 device, a "
               "library built with 90 in JAXATTN_CUDA_ARCHS and a cache under 64 GiB";
    }
    if (tc_dim && which != PrefillKernel::kSimt && device_has_mma()) {
      return p.kv.head_dim == 64 ? launch_prefill_mma<T, 64, C>(p, stream)
                                 : launch_prefill_mma<T, 128, C>(p, stream);
    }
  }
#else
  if (which == PrefillKernel::kSm90 || which == PrefillKernel::kSm90Persistent)
    return "jaxattn: the sm90 prefill kernel is built for CUDA (compute capability 9.0) only";
#endif
  return with_head_dim(
      p.kv.head_dim, "jaxattn: GPU prefill is built for head_dim 32, 64, 128 and 256",
      [&](auto d) { return launch_prefill_simt<T, decltype(d)::value, C>(p, stream); });
}

}  // namespace gpu
}  // namespace jaxattn
