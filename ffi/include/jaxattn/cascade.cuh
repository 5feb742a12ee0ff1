// Cascade decode on GPUs, one source for CUDA and HIP (the problem, the contract and the
// workspace: jaxattn/cascade.h).
//
// Two launches for the whole batch:
//
// 1. One kernel, two kinds of blocks, each writing partial states -- normalised output and
//    (max, sum) in base 2 -- for the query rows it owns:
//    - prefix blocks (KV head, tile, partition), first in the grid: a tile is up to per_tile
//      requests that continue one prefix; their query heads of the block's KV head (request
//      major, then the group's heads) are the rows of one tile loop over a partition of the
//      prefix's pages, so each prefix page is read once per KV head and tile instead of once
//      per request. Tensor-core kernel: 64 rows, 16 per warp, each warp computing S = Q K^T
//      and O += P V with mma.sync m16n8k16 for every 64-key tile of a shared ring (the
//      prefill kernel's fragment scheme). SIMT kernel: 8 rows.
//    - own blocks (request, KV head, partition): paged decode over the request's own pages,
//      the decode kernels' scheme (paged_decode.cuh): tensor cores with the group's heads as
//      the n = 8 side of the products, or the pipelined SIMT loop.
//    Both kinds stream K/V through the decode kernels' shared-memory ring (KvRing: cp.async
//    stages, row offsets one tile ahead, page ids checked where they become offsets). The
//    prefix blocks are compute bound (64 rows x every key), the own blocks memory bound; one
//    grid lets them share the multiprocessors, a prefix block beside an own block.
// 2. A merge kernel, one warp per (request, query head): the exact merge of the request's own
//    partitions and prefix partitions (weights l_i * 2^(m_i - max)).
//
// Which requests share a prefix is data (prefix_of is a device array): each prefix block plans
// its tile on the device. One pass over prefix_of counts the requests of every prefix in shared
// memory (chunks of kPlanBins prefixes), a block-wide scan of the tiles per prefix gives the
// batch's tile count T and places tile t; the block's partition count then follows from T
// (cascade_splits) and a second pass ranks the tile's members in batch order. The cost is two
// reads of prefix_of (B int32, from L2) per prefix block. Block k of a KV head takes tile
// k % T, partition k / T; blocks past T x splits exit. Block 0 leaves the split in the
// workspace for the merge.
//
// Scaled caches (CascadeParams::scales): both levels fold the KV head's k_scale into their
// logit factor, so every part's (max, sum) is in the same units and the merge stays exact; the
// merge multiplies the merged row by v_scale (the output is linear in the values). FP8 caches
// are not read here (the rings and fragments are 16-bit or f32): jaxattn/native.py refuses them.
//
// Index guards (jaxattn/guards.h): the scalars of a request (prefix_of range, prefix length,
// own length) are checked by the merge, which writes NaN rows for an invalid request without
// reading its parts; blocks skip what those scalars make invalid. Page ids are checked where
// they become row offsets (KvRing::store_offset): a block that meets a bad one writes NaN
// states, and the merge turns a NaN part into a NaN row. A prefix is only read by the tiles of
// requests that continue it.
#pragma once

#include <cstdint>

#include "jaxattn/cascade.h"
#include "jaxattn/gpu_vendor.h"
#include "jaxattn/guards.h"
#include "jaxattn/mma_sm80.cuh"
#include "jaxattn/paged_decode.cuh"

namespace jaxattn {
namespace gpu {

// Block timelines of step 1 and of the merge, for the cascade self-test's --trace (compile with
// -DJAXATTN_CASCADE_TRACE on CUDA; never in the library). Thread 0 of each step-1 block stamps
// the global timer into 16 slots of g_cascade_trace: its start (0), its range known (1: a
// prefix block's plan made, an own block's length read), the prologue's copies issued (2), the
// top of key tiles 0..7 (3..10), the loop's end (11) and its states written (12); slot 13 keeps
// its key tiles, 14 its kind (1 prefix, 2 own), 15 its SM. The merge's blocks stamp 4 slots of
// g_cascade_merge_trace: start (0), step 1's writes visible (1), written (2), SM (3).
#if defined(JAXATTN_CASCADE_TRACE) && defined(JAXATTN_CUDA)
__device__ unsigned long long* g_cascade_trace;
__device__ unsigned long long* g_cascade_merge_trace;
__device__ __forceinline__ void cascade_trace_note(unsigned long long* buf, int slots, int i,
                                                   unsigned long long v) {
  if (threadIdx.x == 0 && buf) buf[int64_t(blockIdx.x) * slots + i] = v;
}
__device__ __forceinline__ unsigned long long cascade_trace_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned long long cascade_trace_sm() {
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  return sm;
}
#define JAXATTN_CASCADE_STAMP(i) cascade_trace_note(g_cascade_trace, 16, (i), cascade_trace_now())
#define JAXATTN_CASCADE_NOTE(i, v) cascade_trace_note(g_cascade_trace, 16, (i), (v))
#define JAXATTN_CASCADE_MERGE_STAMP(i) \
  cascade_trace_note(g_cascade_merge_trace, 4, (i), cascade_trace_now())
#define JAXATTN_CASCADE_MERGE_NOTE(i, v) cascade_trace_note(g_cascade_merge_trace, 4, (i), (v))
#else
#define JAXATTN_CASCADE_STAMP(i)
#define JAXATTN_CASCADE_NOTE(i, v)
#define JAXATTN_CASCADE_MERGE_STAMP(i)
#define JAXATTN_CASCADE_MERGE_NOTE(i, v)
#endif

// Prefixes counted per pass of the plan (int32 bins in the dynamic shared memory, which the ring
// takes over once the plan is made).
constexpr int kCascadePlanBins = 1024;

// Exclusive prefix sum of one int per thread over the block; *total gets the sum. All threads
// must call it; warp_sums: NT / WARP_SIZE ints of shared memory, free again on return.
template <int NT>
__device__ __forceinline__ int block_exclusive_sum(int v, int* warp_sums, int* total) {
  constexpr int kWarps = NT / WARP_SIZE;
  const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
  int incl = v;
#pragma unroll
  for (int o = 1; o < WARP_SIZE; o *= 2) {
    const int n = shfl_up(incl, o);
    if (lane >= o) incl += n;
  }
  if (lane == WARP_SIZE - 1) warp_sums[warp] = incl;
  __syncthreads();
  int before = 0, sum = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const int s = warp_sums[w];
    before += w < warp ? s : 0;
    sum += s;
  }
  __syncthreads();
  *total = sum;
  return before + incl - v;
}

// A prefix block's plan, in shared memory.
template <int NT, int MAXR>
struct CascadePlan {
  int warp_sums[NT / WARP_SIZE];
  int g;      // the tile's prefix
  int first;  // rank of the tile's first request among the prefix's requests
  int count;  // requests in the tile
  int members[MAXR];
};

// Counts the requests of prefixes [g0, g0 + n) into bins[0, n).
template <int NT>
__device__ __forceinline__ void count_prefix_requests(const CascadeParams& p, int g0, int n,
                                                      int* bins) {
  for (int i = threadIdx.x; i < n; i += NT) bins[i] = 0;
  __syncthreads();
  for (int b = threadIdx.x; b < p.batch; b += NT) {
    const int g = p.prefix_of[b] - g0;
    if (g >= 0 && g < n) atomicAdd(&bins[g], 1);
  }
  __syncthreads();
}

// Plans prefix block k of its KV head (see the top of the file): false when the block has no
// tile or partition. The leader (the grid's first prefix block) leaves the split for the merge.
// Otherwise plan.g, plan.count and plan.members describe its tile and *split its partition; *splits
// is the batch's partition count. bins: kCascadePlanBins ints of shared memory. All threads of the
// block must call it.
template <int NT, int MAXR>
__device__ bool plan_prefix_block(const CascadeParams& p, int k, bool leader, int per_tile,
                                  int per_head, int* bins, CascadePlan<NT, MAXR>& plan, int* split,
                                  int* splits) {
  const int tid = threadIdx.x;
  const int G = p.num_prefixes;
  const int chunks = (G + kCascadePlanBins - 1) / kCascadePlanBins;
  // Thread tid owns bins [lo, hi) of a chunk of n bins.
  constexpr int kPer = (kCascadePlanBins + NT - 1) / NT;
  auto own_tiles = [&](int n) {
    const int lo = min(n, tid * kPer), hi = min(n, lo + kPer);
    int tiles = 0;
    for (int i = lo; i < hi; ++i) tiles += (bins[i] + per_tile - 1) / per_tile;
    return tiles;
  };
  int num_tiles = 0;
  for (int c = 0; c < chunks; ++c) {
    const int n = min(kCascadePlanBins, G - c * kCascadePlanBins);
    count_prefix_requests<NT>(p, c * kCascadePlanBins, n, bins);
    int total;
    block_exclusive_sum<NT>(own_tiles(n), plan.warp_sums, &total);
    num_tiles += total;
  }
  *splits = cascade_splits(num_tiles, p.prefix_target, p.kv.num_kv_heads, per_head, p.prefix_parts);
  if (leader && tid == 0) *cascade_split_slot(p) = *splits;
  if (num_tiles == 0 || k >= num_tiles * *splits) return false;
  const int t = k % num_tiles;
  *split = k / num_tiles;

  // Tile t: the prefix whose tiles cover it (one chunk of bins at a time).
  if (tid == 0) plan.g = -1;
  int before = 0;
  for (int c = 0; c < chunks; ++c) {
    const int n = min(kCascadePlanBins, G - c * kCascadePlanBins);
    if (chunks > 1) count_prefix_requests<NT>(p, c * kCascadePlanBins, n, bins);
    int total;
    int at = before + block_exclusive_sum<NT>(own_tiles(n), plan.warp_sums, &total);
    const int lo = min(n, tid * kPer), hi = min(n, lo + kPer);
    for (int i = lo; i < hi; ++i) {
      const int tiles = (bins[i] + per_tile - 1) / per_tile;
      if (t >= at && t < at + tiles) {
        plan.g = c * kCascadePlanBins + i;
        plan.first = (t - at) * per_tile;
        plan.count = min(per_tile, bins[i] - plan.first);
      }
      at += tiles;
    }
    before += total;
    __syncthreads();
    if (plan.g >= 0) break;
  }

  // Its members: the prefix's requests of ranks [first, first + count) in batch order.
  const int g = plan.g, first = plan.first, last = plan.first + plan.count;
  if (g < 0) return false;  // unreachable: both passes count the same bins
  int seen = 0;
  for (int b0 = 0; b0 < p.batch && seen < last; b0 += NT) {
    const int b = b0 + tid;
    const int is = b < p.batch && p.prefix_of[b] == g ? 1 : 0;
    int total;
    const int rank = seen + block_exclusive_sum<NT>(is, plan.warp_sums, &total);
    if (is && rank >= first && rank < last) plan.members[rank - first] = b;
    seen += total;
  }
  __syncthreads();
  return true;
}

// Tokens [start, end) of a prefix partition; false when the prefix is invalid (the merge writes
// its requests' rows NaN) or the partition holds no token.
__device__ __forceinline__ bool prefix_range(const CascadeParams& p, int g, int split, int splits,
                                             int* start, int* end) {
  const int lp = p.prefix_lens[g];
  if (!prefix_bounds_ok(lp, p.prefix_table_stride, p.kv.page_size, p.kv.num_pages)) return false;
  const int chunk = cascade_chunk(lp, splits);
  *start = split * chunk;
  *end = min(lp, *start + chunk);
  return *start < lp;
}

// Tokens [start, end) of own partition `part` of request b; false when its length breaks the
// contract (the merge writes its rows NaN) or the partition holds no token.
__device__ __forceinline__ bool own_range(const CascadeParams& p, int b, int part, int* start,
                                          int* end) {
  const int L = p.seq_lens[b];
  if (!decode_bounds_ok(L, p.block_table_stride, p.kv.page_size, p.kv.num_pages)) return false;
  const int span = p.own_span();
  *start = part * span;
  *end = min(L, *start + span);
  return *start < L;
}

// One element of a finished row's partial state: the normalised output, and with d == 0 the
// (max, sum) pair. l == 0: nothing attended.
__device__ __forceinline__ void cascade_write(const CascadeParams& p, int64_t slot, int d, float o,
                                              float m, float l) {
  state_store(p.workspace + slot * p.kv.head_dim + d, l == 0.f ? 0.f : o / l);
  if (d == 0) {
    float* ml = cascade_ml(p);
    state_store(ml + 2 * slot, m);
    state_store(ml + 2 * slot + 1, l);
  }
}

// Merges the (max, sum, output) states that WS warps left in shared memory for each of the
// block's GC rows and writes them to their workspace slots (slot_of(row), -1: no row), in a
// fixed order; NaN for all of them when the block is poisoned. red holds, for warp w and row g,
// D output floats then the max and the sum, at red + (w * GC + g) * (D + 2).
template <int D, int GC, int WS, int NT, typename SlotOf>
__device__ __forceinline__ void cascade_merge_warps(const CascadeParams& p, const float* red,
                                                    SlotOf slot_of, bool poisoned) {
  constexpr float kNegInf = -__builtin_huge_valf();
  for (int i = threadIdx.x; i < GC * D; i += NT) {
    const int g = i / D, d = i % D;
    const int64_t slot = slot_of(g);
    if (slot < 0) continue;
    float mx = kNegInf;
#pragma unroll
    for (int w = 0; w < WS; ++w) mx = fmaxf(mx, red[(w * GC + g) * (D + 2) + D]);
    const float m_use = mx == kNegInf ? 0.f : mx;
    float o = 0.f, ls = 0.f;
#pragma unroll
    for (int w = 0; w < WS; ++w) {
      const float* r = red + (w * GC + g) * (D + 2);
      const float wt = fast_exp2(r[D] - m_use);
      ls += wt * r[D + 1];
      o += wt * r[d];
    }
    if (poisoned) o = mx = ls = quiet_nan();
    cascade_write(p, slot, d, o, mx, ls);
  }
}

// ------------------------------------------------------------------------------------------
// SIMT kernel: 8 rows a block (the pipelined SIMT decode loop of paged_decode.cuh, whose 8
// "heads" are here any 8 query rows of one KV head).
// ------------------------------------------------------------------------------------------

constexpr int kCascadeSimtRows = 8;

template <typename T, int D>
struct CascadeSimtShape {
  using S = DecodeShape<T, D, kCascadeSimtRows, false>;
  static_assert(S::kHeadChunks == 1 && S::kTokenSplit > 1, "every warp holds the 8 rows");
  static constexpr int kThreads = S::kThreads;
  static constexpr int kSmemBytes = cmax(S::kSmemBytes, kCascadePlanBins * 4);
};

// The block's rows over tokens [start, end) of `table`: row_q[g] is the element offset of row g's
// query (-1: no row), row_slot[g] its workspace slot.
template <typename T, int D>
__device__ __forceinline__ void cascade_simt_rows(const CascadeParams& p, unsigned char* smem,
                                                  const int32_t* table, int start, int end, int kvh,
                                                  const int64_t* row_q, const int64_t* row_slot) {
  using S = DecodeShape<T, D, kCascadeSimtRows, false>;
  constexpr int VEC = S::kVec, TG = S::kLanesPerRow, NV = S::kVecsPerLane;
  constexpr int EPL = S::kElemsPerLane, TPW = S::kRowsPerWarp, GC = S::kHeadsPerWarp;
  constexpr int WS = S::kTokenSplit, U = S::kUnroll, NS = S::kStages;
  constexpr float kNegInf = -__builtin_huge_valf();
  const int ws = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int row = lane / TG, col = lane % TG;
  const KvGeometry& kv = p.kv;
  const T* kbase = static_cast<const T*>(p.k) + kvh * kv.head_stride;
  const T* vbase = static_cast<const T*>(p.v) + kvh * kv.head_stride;

  using Ring = KvRing<T, D, S::kTile, S::kRingStages, S::kRowStride, S::kThreads>;
  const Ring ring{smem, kbase, vbase, table, kv, start, end};
  const int ntiles = (end - start + S::kTile - 1) / S::kTile;
  bool bad = ring.prologue(ntiles);  // this thread met a page id outside the cache

  const float q_scale = p.ls.q_scale * p.scales.k_of(kvh);  // with the KV head's key scale
  float q[GC][EPL];
#pragma unroll
  for (int g = 0; g < GC; ++g) {
    const int64_t at = row_q[g];
    if (at >= 0) {
      const T* qp = static_cast<const T*>(p.q) + at;
#pragma unroll
      for (int j = 0; j < NV; ++j)
        vec_to_float<T>(load16(qp + (j * TG + col) * VEC), &q[g][j * VEC]);
#pragma unroll
      for (int e = 0; e < EPL; ++e) q[g][e] *= q_scale;
    } else {
#pragma unroll
      for (int e = 0; e < EPL; ++e) q[g][e] = 0.f;
    }
  }

  float m[GC], l[GC], acc[GC][EPL];
#pragma unroll
  for (int g = 0; g < GC; ++g) {
    m[g] = kNegInf;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[g][e] = 0.f;
  }

  // Folds U rows (K and V vectors of this lane's slice) into the running state.
  auto consume = [&](const uint4(&kr)[U][NV], const uint4(&vr)[U][NV], const bool (&ok)[U]) {
    decode_fold_rows<T, U, NV, GC, EPL, VEC, TG>(kr, vr, ok, q, p.ls.cap_log2e, m, l, acc);
  };

  for (int n = 0; n < ntiles; ++n) {
    async_copy_wait<NS - 2>();  // this thread's copies of tile n have landed
    __syncthreads();            // everyone's have, and stage (n - 1) % NS is free
    if (n + NS - 1 < ntiles) ring.issue(n + NS - 1);
    async_copy_commit();
    const int page = ring.page_of(n + NS);  // consumed after this tile's compute

    const int s = n % NS, tile0 = start + n * S::kTile;
    const T* ks = ring.k_rows(s);
    const T* vs = ring.v_rows(s);
    for (int tb = 0; tb < S::kTile && tile0 + tb < end; tb += S::kStep) {
      uint4 kr[U][NV], vr[U][NV];
      bool ok[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int r = tb + (u * WS + ws) * TPW + row;
        ok[u] = tile0 + r < end;  // rows past the end hold zeros
#pragma unroll
        for (int j = 0; j < NV; ++j) {
          const int e = r * S::kRowStride + (j * TG + col) * VEC;
          kr[u][j] = *reinterpret_cast<const uint4*>(ks + e);
          vr[u][j] = *reinterpret_cast<const uint4*>(vs + e);
        }
      }
      consume(kr, vr, ok);
    }
    bad |= ring.store_offset(n + NS, page);  // stage n % NS's offsets were used at issue(n)
  }
  async_copy_wait<0>();

  decode_merge_lane_groups<GC, EPL, TG>(m, l, acc);  // they saw disjoint rows

  // Then the warps, which split the tile's rows, through shared memory in a fixed order.
  float* red = reinterpret_cast<float*>(smem);
  const bool poisoned = __syncthreads_or(bad);  // and the ring is no longer read
  if (row == 0) {
#pragma unroll
    for (int g = 0; g < GC; ++g) {
      float* r = red + (ws * GC + g) * (D + 2);
#pragma unroll
      for (int j = 0; j < NV; ++j) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) r[(j * TG + col) * VEC + v] = acc[g][j * VEC + v];
      }
      if (col == 0) {
        r[D] = m[g];
        r[D + 1] = l[g];
      }
    }
  }
  __syncthreads();
  cascade_merge_warps<D, GC, WS, S::kThreads>(p, red, [&](int g) { return row_slot[g]; }, poisoned);
}

// The grid's block order: per_head prefix blocks a KV head (KV head fastest), then the own
// blocks (request, KV head, partition). Block x is prefix block `index` or own block `index`.
// The prefix blocks go first because they are the long ones: on the issue's batch (H200,
// wgmma prefix level) the own blocks first took 66.5 us and the two kinds interleaved evenly
// 65.4 us, against 49.5 us (ffi/NOTES.md, round 14).
struct CascadeBlock {
  bool prefix;
  int index;
};
__device__ __forceinline__ CascadeBlock cascade_block(const CascadeParams& p, int per_head) {
  const int x = int(blockIdx.x), pre = per_head * p.kv.num_kv_heads;
  return x < pre ? CascadeBlock{true, x} : CascadeBlock{false, x - pre};
}

template <typename T, int D>
__global__ void __launch_bounds__((CascadeSimtShape<T, D>::kThreads))
    cascade_simt_kernel(const CascadeParams p, const int per_tile, const int per_head) {
  constexpr int NT = CascadeSimtShape<T, D>::kThreads, R = kCascadeSimtRows;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ CascadePlan<NT, R> plan;
  __shared__ int64_t row_q[R], row_slot[R];
  pdl_launch_dependents();  // the merge may launch now and waits for this grid (see there)
  const int hkv = p.kv.num_kv_heads, group = p.num_q_heads / hkv;
  const int gi = threadIdx.x;
  const CascadeBlock blk = cascade_block(p, per_head);
  const int x = blk.index;
  const int32_t* table;
  int start, end, kvh;
  if (blk.prefix) {
    kvh = x % hkv;
    int split, splits;
    if (!plan_prefix_block<NT, R>(p, x / hkv, x == 0, per_tile, per_head,
                                  reinterpret_cast<int*>(smem), plan, &split, &splits))
      return;
    if (!prefix_range(p, plan.g, split, splits, &start, &end)) return;
    table = p.prefix_tables + int64_t(plan.g) * p.prefix_table_stride;
    if (gi < R) {
      const int slot = gi / group, h = kvh * group + gi % group;
      const bool ok = slot < plan.count;
      const int b = plan.members[ok ? slot : 0];
      row_q[gi] = ok ? (int64_t(b) * p.num_q_heads + h) * D : -1;
      row_slot[gi] = ok ? cascade_slot(p, b, h, p.own_parts + split) : -1;
    }
  } else {
    const int part = x % p.own_parts, b = x / (p.own_parts * hkv);
    kvh = (x / p.own_parts) % hkv;
    if (!own_range(p, b, part, &start, &end)) return;
    table = p.block_tables + int64_t(b) * p.block_table_stride;
    if (gi < R) {
      const bool ok = gi < group;
      const int h = kvh * group + gi;
      row_q[gi] = ok ? (int64_t(b) * p.num_q_heads + h) * D : -1;
      row_slot[gi] = ok ? cascade_slot(p, b, h, part) : -1;
    }
  }
  __syncthreads();
  cascade_simt_rows<T, D>(p, smem, table, start, end, kvh, row_q, row_slot);
}

// ------------------------------------------------------------------------------------------
// Tensor-core kernel (NVIDIA sm_80+, bf16/f16, head_dim 64 and 128).
// ------------------------------------------------------------------------------------------

#if defined(JAXATTN_CUDA)

template <typename T, int D>
struct CascadeMmaShape {
  static_assert(sizeof(T) == 2 && (D == 64 || D == 128), "16-bit elements, head_dim 64 or 128");
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRows = 16 * kWarps;  // query rows of a prefix tile, 16 a warp
  static constexpr int kHeads = 8;           // own level: the group's heads, the n of its products
  static constexpr int kTile = 64;           // keys a ring stage
  static constexpr int kRowStride = D + 8;   // elements: one 16-byte vector of padding
  static constexpr int kStageBytes = kTile * 8 + 2 * kTile * kRowStride * 2;
  // As many stages as fit the decode kernel's budget (3 at head_dim 128: two blocks an SM).
  static constexpr int kStages = cmin(4, cmax(2, JAXATTN_DECODE_MMA_SMEM_KB * 1024 / kStageBytes));
  static constexpr int kMergeBytes = kWarps * kHeads * (D + 2) * int(sizeof(float));
  static constexpr int kSmemBytes =
      cmax(cmax(kStages * kStageBytes, kMergeBytes), kCascadePlanBins * 4);
};

// The query rows a lane of a prefix block holds: rows 16 warp + g + 8 i (i = 0, 1) are request
// slot row / group (plan.members) and head kvh * group + row % group. slot[i]: the row's
// workspace slot (-1: padding); qa: its q as m16n8k16 A fragments, per 16-dim step kk (row g,
// dims 16 kk + 2 tq, + 1), (row g + 8, the same), (row g, + 8), (row g + 8, + 8) -- the
// A-fragment layout of mma.sync and of wgmma with A in registers alike; q_scale: the logit
// factor with the KV head's key scale.
template <int D>
struct CascadePrefixRows {
  int64_t slot[2];
  uint32_t qa[D / 16][4];
  float q_scale;
};

template <typename T, int D, typename Plan>
__device__ __forceinline__ void cascade_prefix_q(const CascadeParams& p, const Plan& plan, int kvh,
                                                 int split, CascadePrefixRows<D>& rows) {
  int64_t (&slot)[2] = rows.slot;
  uint32_t (&qa)[D / 16][4] = rows.qa;
  rows.q_scale = p.ls.q_scale * p.scales.k_of(kvh);
  const int group = p.num_q_heads / p.kv.num_kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = warp * 16 + g + 8 * i, member = r / group, h = kvh * group + r % group;
    const bool ok = member < plan.count;
    const int b = plan.members[ok ? member : 0];
    slot[i] = ok ? cascade_slot(p, b, h, p.own_parts + split) : -1;
    const T* qp = static_cast<const T*>(p.q) + (int64_t(b) * p.num_q_heads + h) * D;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      qa[kk][i] = ok ? *reinterpret_cast<const uint32_t*>(qp + kk * 16 + 2 * tq) : 0u;
      qa[kk][2 + i] = ok ? *reinterpret_cast<const uint32_t*>(qp + kk * 16 + 8 + 2 * tq) : 0u;
    }
  }
}

// The prefix level's lazy rescale (online_max_step): a row's running maximum moves only when
// a tile's exceeds it by more than 8 (base 2), so its probabilities stay below 256 and most
// tiles skip the 64-register rescale of O (the mma.sync and wgmma prefix blocks alike).
constexpr int kCascadeRescaleSlack = 8;

// A prefix block's ring over tokens [start, end) of its prefix's pages (KV head kvh), built at
// `base`, with the prologue's copies issued; *bad: whether the prologue met a page id outside
// the cache. Then the block's rows (cascade_prefix_q).
template <typename Ring, typename Plan>
__device__ __forceinline__ Ring cascade_prefix_ring(const CascadeParams& p, unsigned char* base,
                                                    const Plan& plan, int kvh, int start, int end,
                                                    bool* bad, bool fetch = false) {
  using E = typename Ring::Elem;
  const E* k = static_cast<const E*>(p.k) + kvh * p.kv.head_stride;
  const E* v = static_cast<const E*>(p.v) + kvh * p.kv.head_stride;
  const Ring ring{base, k,     v,  p.prefix_tables + int64_t(plan.g) * p.prefix_table_stride,
                  p.kv, start, end};
  *bad = ring.prologue(ring.tiles(), fetch);
  return ring;
}

// One key tile of a prefix block's softmax, on S in the m16n8 accumulator layout (lane (g, tq):
// S[row g][keys 8 j + 2 tq, + 1] in sc[j][0..1], row g + 8 in sc[j][2..3]; the same for wgmma's
// m64nN accumulators, warp by warp): logits in base 2, keys at or past `end` masked (zero-filled
// rows), the online (lazily raised) max and sum of rows g and g + 8 (m0, m1, l0, l1: this lane's
// share of the sums), sc turned into the probabilities. Returns the rows' rescale factors in a0,
// a1. The soft cap and the mask are block-uniform choices made once a tile around branch-free loops
// (a branch per element cost more than the products: with one warp a scheduler, every taken branch
// waited for its instruction fetch).
template <int J>
__device__ __forceinline__ void cascade_prefix_softmax(const CascadeParams& p, float (&sc)[J][4],
                                                       float q_scale, int n0, int end, float& m0,
                                                       float& m1, float& l0, float& l1, float& a0,
                                                       float& a1) {
  constexpr float kNegInf = -__builtin_huge_valf();
  const int tq = threadIdx.x % 4;
  if (p.ls.cap_log2e > 0.f) {
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[j][e] = p.ls.cap_log2e * tanhf(sc[j][e] * q_scale);
  } else {
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[j][e] *= q_scale;
  }
  if (n0 + 8 * J > end) {
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        sc[j][e] = n0 + j * 8 + 2 * tq + (e & 1) >= end ? kNegInf : sc[j][e];
  }
  float mx0 = kNegInf, mx1 = kNegInf;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    mx0 = fmaxf(mx0, fmaxf(sc[j][0], sc[j][1]));
    mx1 = fmaxf(mx1, fmaxf(sc[j][2], sc[j][3]));
  }
  mma_online_softmax<J, kCascadeRescaleSlack>(sc, mx0, mx1, m0, m1, l0, l1, a0, a1);
}

// A prefix block's rows, finished: o in the m16n8 accumulator layout (o[i][0..1]: row g, dims
// 8 i + 2 tq, + 1; o[i][2..3]: row g + 8), normalised into the rows' workspace slots with their
// (max, sum); NaN states when the block is poisoned. l0, l1: this lane's shares of the sums.
template <int D>
__device__ __forceinline__ void cascade_prefix_store(const CascadeParams& p,
                                                     const float (&o)[D / 8][4],
                                                     const int64_t (&slot)[2], float m0, float m1,
                                                     float l0, float l1, bool poisoned) {
  const int tq = threadIdx.x % 4;
  l0 = group_sum<4>(l0);
  l1 = group_sum<4>(l1);
  const float nan = quiet_nan();
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (slot[i] < 0) continue;
    const float l = poisoned ? nan : (i ? l1 : l0), m = poisoned ? nan : (i ? m1 : m0);
    const float inv = l == 0.f ? 0.f : 1.f / l;  // NaN stays NaN
    float* out = p.workspace + slot[i] * D;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
      state_store(reinterpret_cast<float2*>(out + j * 8 + 2 * tq),
                  make_float2(o[j][2 * i] * inv, o[j][2 * i + 1] * inv));
    if (tq == 0) {
      float* ml = cascade_ml(p);
      state_store(ml + 2 * slot[i], m);
      state_store(ml + 2 * slot[i] + 1, l);
    }
  }
}

// Prefix block: the tile's 64 rows over tokens [start, end) of the prefix's pages. Warp w owns
// rows 16 w .. 16 w + 15 (lane (g, tq) holds rows 16 w + g and 16 w + g + 8) and computes, for
// every 64-key tile of the ring, S = Q K^T (A = Q from registers, B = K by ldmatrix) and
// O += P V (A = P packed from S's accumulators, B = V by ldmatrix.trans): the fragment scheme of
// prefill_mma_kernel, on the ring's padded rows (RS elements apart, so the 8 rows an ldmatrix
// phase reads start in 8 different 16-byte bank groups). On compute capability 9.0 the
// launcher runs cascade_prefix_wgmma (cascade_sm90.cuh) instead.
template <typename T, int D, typename Plan>
__device__ __forceinline__ void cascade_prefix_mma(const CascadeParams& p, unsigned char* smem,
                                                   const Plan& plan, int kvh, int split, int start,
                                                   int end) {
  using S = CascadeMmaShape<T, D>;
  constexpr int TILE = S::kTile, NS = S::kStages, RS = S::kRowStride, KD = D / 16;
  constexpr float kNegInf = -__builtin_huge_valf();
  const int group = p.num_q_heads / p.kv.num_kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  bool bad;  // this thread met a page id outside the cache
  const auto ring = cascade_prefix_ring<KvRing<T, D, TILE, NS, RS, S::kThreads>>(p, smem, plan, kvh,
                                                                                 start, end, &bad);
  JAXATTN_CASCADE_STAMP(2);
  CascadePrefixRows<D> rows;
  cascade_prefix_q<T, D>(p, plan, kvh, split, rows);

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m0 = kNegInf, m1 = kNegInf, l0 = 0.f, l1 = 0.f;  // rows g, g + 8: max, this lane's sum

  // ldmatrix lane addresses (bytes within a stage's K or V rows). K, for keys 16 np .. 16 np + 15
  // and dims 16 kk ..: matrix (lane / 8) is keys + (lane / 16) * 8, dims + ((lane / 8) % 2) * 8.
  // V (.trans), for keys 16 kk .. and dims 16 dp ..: keys + ((lane / 8) % 2) * 8, dims +
  // (lane / 16) * 8.
  const uint32_t lane_k = uint32_t(((lane % 8 + (lane / 16) * 8) * RS + ((lane / 8) % 2) * 8) * 2);
  const uint32_t lane_v = uint32_t(((lane % 8 + ((lane / 8) % 2) * 8) * RS + (lane / 16) * 8) * 2);

  // A warp whose 16 rows are all padding (a tile of few requests) only helps with the copies.
  const bool warp_live = warp * 16 < plan.count * group;

  const int ntiles = ring.tiles();
  JAXATTN_CASCADE_NOTE(13, ntiles);
  for (int n = 0; n < ntiles; ++n) {
    async_copy_wait<NS - 2>();  // this thread's copies of tile n have landed
    __syncthreads();            // everyone's have, and stage (n - 1) % NS is free
    if (n < 8) JAXATTN_CASCADE_STAMP(3 + n);
    if (n + NS - 1 < ntiles) ring.issue(n + NS - 1);
    async_copy_commit();
    const int page = ring.page_of(n + NS);  // consumed after this tile's compute
    if (!warp_live) {
      bad |= ring.store_offset(n + NS, page);
      continue;
    }

    const int s = n % NS, n0 = start + n * TILE;
    const uint32_t kb = smem_u32(ring.k_rows(s)) + lane_k;
    const uint32_t vb = smem_u32(ring.v_rows(s)) + lane_v;
    float sc[TILE / 8][4];
#pragma unroll
    for (int j = 0; j < TILE / 8; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
#pragma unroll
      for (int np = 0; np < TILE / 16; ++np) {
        uint32_t bfr[4];
        ldmatrix_x4(bfr, kb + uint32_t((np * 16 * RS + kk * 16) * 2));
        mma16816<T>(sc[2 * np], rows.qa[kk], bfr[0], bfr[1]);      // keys 16 np .. + 7
        mma16816<T>(sc[2 * np + 1], rows.qa[kk], bfr[2], bfr[3]);  // keys 16 np + 8 .. + 15
      }
    }

    float a0, a1;  // this lane's share of l0 / l1; the quad's are added once at the end
    cascade_prefix_softmax(p, sc, rows.q_scale, n0, end, m0, m1, l0, l1, a0, a1);
    if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) scale_c_rows(o, a0, a1);
#pragma unroll
    for (int kk = 0; kk < TILE / 16; ++kk) {
      uint32_t pf[4];  // S's accumulator layout is P's A-operand layout: no shuffles
      p_fragment<T>(sc, kk, pf);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bfr[4];
        ldmatrix_x4_trans(bfr, vb + uint32_t((kk * 16 * RS + dp * 16) * 2));
        mma16816<T>(o[2 * dp], pf, bfr[0], bfr[1]);      // dims 16 dp .. + 7
        mma16816<T>(o[2 * dp + 1], pf, bfr[2], bfr[3]);  // dims 16 dp + 8 .. + 15
      }
    }
    bad |= ring.store_offset(n + NS, page);  // stage n % NS's offsets were used at issue(n)
  }
  async_copy_wait<0>();
  JAXATTN_CASCADE_STAMP(11);
  const bool poisoned = __syncthreads_or(bad);
  cascade_prefix_store<D>(p, o, rows.slot, m0, m1, l0, l1, poisoned);
  JAXATTN_CASCADE_STAMP(12);
}

// Own block: paged decode of own partition `part` of request b, the group's heads as the n = 8
// side of the products -- paged_decode_mma_kernel's loop (see its comments for the fragments).
// As there, q and the pages of the first tiles are loaded beside the request's length, not
// after it.
template <typename T, int D>
__device__ __forceinline__ void cascade_own_mma(const CascadeParams& p, unsigned char* smem, int b,
                                                int kvh, int part) {
  using S = CascadeMmaShape<T, D>;
  constexpr int TILE = S::kTile, NS = S::kStages, RS = S::kRowStride, KD = D / 16;
  constexpr int H = S::kHeads;
  constexpr float kNegInf = -__builtin_huge_valf();
  const int group = p.num_q_heads / p.kv.num_kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;
  const KvGeometry& kv = p.kv;
  const T* kbase = static_cast<const T*>(p.k) + kvh * kv.head_stride;
  const T* vbase = static_cast<const T*>(p.v) + kvh * kv.head_stride;
  using Ring = KvRing<T, D, TILE, NS, RS, S::kThreads>;
  const int32_t* table = p.block_tables + int64_t(b) * p.block_table_stride;
  uint32_t qa[KD][2];
  mma_decode_q<T, D>(p.q, p.num_q_heads, b, int64_t(kvh) * group, group, g, tq, qa);
  int pages[NS];
  Ring::early_pages(table, p.block_table_stride, kv.page_size, part * p.own_span(), pages);
  int start, end;
  if (!own_range(p, b, part, &start, &end)) {
    JAXATTN_CASCADE_STAMP(12);  // no work: its exit
    return;
  }
  JAXATTN_CASCADE_STAMP(1);
  const Ring ring{smem, kbase, vbase, table, kv, start, end};
  const int ntiles = (end - start + TILE - 1) / TILE;
  bool bad = ring.prologue(ntiles, pages);
  JAXATTN_CASCADE_STAMP(2);
  JAXATTN_CASCADE_NOTE(13, ntiles);
  const float q_scale = p.ls.q_scale * p.scales.k_of(kvh);  // with the KV head's key scale

  float o[KD][4];
#pragma unroll
  for (int j = 0; j < KD; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m = kNegInf, l = 0.f;  // head g: running max, this lane's share of the sum

  const int rb = warp * 16;
  const uint32_t lane_off =
      uint32_t(((rb + lane % 8 + (lane / 16) * 8) * RS + ((lane / 8) % 2) * 8) * 2);

  for (int n = 0; n < ntiles; ++n) {
    async_copy_wait<NS - 2>();
    __syncthreads();
    if (n < 8) JAXATTN_CASCADE_STAMP(3 + n);
    if (n + NS - 1 < ntiles) ring.issue(n + NS - 1);
    async_copy_commit();
    const int page = ring.page_of(n + NS);

    const int s = n % NS;
    const int t0 = start + n * TILE + rb;  // this warp's first token
    if (t0 < end) {                        // warp-uniform
      mma_decode_tile<T, D>(qa, smem_u32(ring.k_rows(s)) + lane_off,
                            smem_u32(ring.v_rows(s)) + lane_off, q_scale, p.ls.cap_log2e, t0, end,
                            o, m, l);
    }
    bad |= ring.store_offset(n + NS, page);
  }
  async_copy_wait<0>();
  JAXATTN_CASCADE_STAMP(11);
  l = group_sum<4>(l);

  float* red = reinterpret_cast<float*>(smem);
  const bool poisoned = __syncthreads_or(bad);
  mma_warp_states<D, H, 8>(red, o, m, l, MmaDims16{});
  __syncthreads();
  cascade_merge_warps<D, H, S::kWarps, S::kThreads>(
      p, red,
      [&](int h) { return h < group ? cascade_slot(p, b, kvh * group + h, part) : int64_t(-1); },
      poisoned);
  JAXATTN_CASCADE_STAMP(12);
}

// The Hopper prefix level (cascade_sm90.cuh, built for sm_90a only): the same block, rows,
// ring and states, with wgmma for both products.
template <typename T, int D, typename Plan>
__device__ __forceinline__ void cascade_prefix_wgmma(const CascadeParams& p, unsigned char* smem,
                                                     const Plan& plan, int kvh, int split,
                                                     int start, int end);

// WG: the prefix blocks run cascade_prefix_wgmma (an sm_90a build), else cascade_prefix_mma.
template <typename T, int D, bool WG = false>
__global__ void __launch_bounds__(CascadeMmaShape<T, D>::kThreads, 2)
    cascade_mma_kernel(const CascadeParams p, const int per_tile, const int per_head) {
#if __CUDA_ARCH__ >= 800
  using S = CascadeMmaShape<T, D>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ CascadePlan<S::kThreads, S::kRows> plan;
  pdl_launch_dependents();  // the merge may launch now and waits for this grid (see there)
  JAXATTN_CASCADE_STAMP(0);
  const int hkv = p.kv.num_kv_heads;
  const CascadeBlock blk = cascade_block(p, per_head);
  const int x = blk.index;
  JAXATTN_CASCADE_NOTE(14, blk.prefix ? 1 : 2);
  JAXATTN_CASCADE_NOTE(15, cascade_trace_sm());
  int start, end;
  if (blk.prefix) {
    int split, splits;
    if (!plan_prefix_block<S::kThreads, S::kRows>(p, x / hkv, x == 0, per_tile, per_head,
                                                  reinterpret_cast<int*>(smem), plan, &split,
                                                  &splits) ||
        !prefix_range(p, plan.g, split, splits, &start, &end)) {
      JAXATTN_CASCADE_STAMP(12);  // no work: its exit
      return;
    }
    JAXATTN_CASCADE_STAMP(1);
    if constexpr (WG) {
      cascade_prefix_wgmma<T, D>(p, smem, plan, x % hkv, split, start, end);
    } else {
      cascade_prefix_mma<T, D>(p, smem, plan, x % hkv, split, start, end);
    }
  } else {
    const int part = x % p.own_parts, b = x / (p.own_parts * hkv);
    cascade_own_mma<T, D>(p, smem, b, (x / p.own_parts) % hkv, part);
  }
#endif
}

#endif  // JAXATTN_CUDA

// ------------------------------------------------------------------------------------------
// Merge and launchers.
// ------------------------------------------------------------------------------------------

// One warp per (request, query head): the exact merge of the request's parts -- own partitions
// [0, n_own), prefix partitions [own_parts, own_parts + n_prefix) -- the maximum of their maxima
// first, then the weighted sums in a fixed order. A part with a NaN sum (a poisoned block, NaN
// in q or a key) makes the row NaN; an invalid request is NaN without reading its parts.
//
// Launched dependent on step 1's grid (programmatic dependent launch, as the split decode's
// combine): the request's scalars -- inputs of the op, complete before step 1 started -- are
// read before the wait for step 1's writes, and the parts' (max, sum) pairs a lane each (up to
// 32 parts a pass), then their outputs kBatch parts at a time with every load of a batch issued
// before its first use: a memory latency or two a row instead of one a part.
template <typename T, int D>
__global__ void __launch_bounds__(256) cascade_merge_kernel(const CascadeParams p) {
  constexpr int kWarps = 256 / WARP_SIZE;
  constexpr int kPerLane = (D + WARP_SIZE - 1) / WARP_SIZE;
  constexpr int kBatch = kPerLane > 4 ? 4 : 8;  // parts whose outputs a warp has in flight
  constexpr float kNegInf = -__builtin_huge_valf();
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int64_t row = int64_t(blockIdx.x) * kWarps + warp;
  const bool live = row < int64_t(p.batch) * p.num_q_heads;
  JAXATTN_CASCADE_MERGE_STAMP(0);
  JAXATTN_CASCADE_MERGE_NOTE(3, cascade_trace_sm());
  const int b = live ? int(row / p.num_q_heads) : 0, h = live ? int(row % p.num_q_heads) : 0;
  int32_t lp = 0;
  const bool ok = live && cascade_request_ok(p, b, &lp);
  const int n_own = ok ? cascade_own_parts(p, p.seq_lens[b]) : 0;
  // The KV head's value scale, on the merged row (exact: the parts' weights do not involve it).
  const float vs = p.scales.v_of(h / (p.num_q_heads / p.kv.num_kv_heads));
  pdl_wait();  // step 1's parts are written (a no-op after an ordinary launch)
  JAXATTN_CASCADE_MERGE_STAMP(1);
  if (!live) return;
  T* out = static_cast<T*>(p.out) + row * D;
  if (!ok) {
    for (int d = lane; d < D; d += WARP_SIZE) out[d] = from_float<T>(quiet_nan());
    return;
  }
  const int n = n_own + (lp > 0 ? cascade_prefix_parts(lp, *cascade_split_slot(p)) : 0);
  const int64_t slot0 = cascade_slot(p, b, h, 0);
  const float2* ml = reinterpret_cast<const float2*>(cascade_ml(p) + 2 * slot0);
  const float* parts = p.workspace + slot0 * D;
  const int skip = p.own_parts - n_own;  // part i >= n_own lives at i + skip
  auto at = [&](int i) { return i < n_own ? i : i + skip; };

  float mx = kNegInf;
  for (int i = lane; i < n; i += WARP_SIZE) mx = fmaxf(mx, ml[at(i)].x);
  mx = group_max<WARP_SIZE>(mx);
  const float m_use = mx == kNegInf ? 0.f : mx;

  float o[kPerLane], ls = 0.f;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) o[k] = 0.f;
  for (int i0 = 0; i0 < n; i0 += WARP_SIZE) {
    // Lane j's weight is part i0 + j's (its max read again: a cached line of this row).
    float w_lane = 0.f;
    if (i0 + lane < n) {
      const float2 x = ml[at(i0 + lane)];
      w_lane = x.y * fast_exp2(x.x - m_use);
    }
    const int cnt = min(WARP_SIZE, n - i0);
    for (int j0 = 0; j0 < cnt; j0 += kBatch) {
      float v[kBatch][kPerLane];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int q = j0 + j < cnt ? at(i0 + j0 + j) : 0;
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
          const int d = lane + k * WARP_SIZE;
          v[j][k] = j0 + j < cnt && (D % WARP_SIZE == 0 || d < D) ? parts[int64_t(q) * D + d] : 0.f;
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const float w = shfl(w_lane, (j0 + j) % WARP_SIZE);
        if (j0 + j < cnt) {  // warp-uniform; parts added in order, as their sum
          ls += w;
#pragma unroll
          for (int k = 0; k < kPerLane; ++k) o[k] = fmaf(w, v[j][k], o[k]);
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int d = lane + k * WARP_SIZE;
    if (D % WARP_SIZE == 0 || d < D) out[d] = from_float<T>(ls == 0.f ? 0.f : o[k] / ls * vs);
  }
  JAXATTN_CASCADE_MERGE_STAMP(2);
}

// The kernel the launcher runs for (T, D) on the current device: tensor cores for 16-bit data
// and head_dim 64 / 128 on NVIDIA sm_80+ with room for the ring, the SIMT kernel otherwise.
template <typename T, int D>
bool cascade_uses_mma() {
#if defined(JAXATTN_CUDA)
  if constexpr (sizeof(T) == 2 && (D == 64 || D == 128))
    return decode_mma_supported(CascadeMmaShape<T, D>::kSmemBytes);
#endif
  return false;
}

#if defined(JAXATTN_CUDA) && defined(JAXATTN_HAVE_SM90A)
// cascade_sm90.cu (sm_90a): the tensor-core kernel with the wgmma prefix level, T = bf16_t or
// f16_t, D = 64 or 128 -- its launch over `blocks` blocks, and its resident blocks an SM.
template <typename T, int D>
const char* launch_cascade_sm90(const CascadeParams& p, gpuStream_t stream, int64_t blocks,
                                int per_tile, int per_head);
template <typename T, int D>
const char* cascade_sm90_occupancy(int* blocks);
#endif

constexpr const char* kCascadeNoWgmma =
    "jaxattn: the wgmma cascade prefix level needs 16-bit data, head_dim 64 or 128, a compute "
    "capability 9.0 device and a library built with 90 in JAXATTN_CUDA_ARCHS";

// Query rows a prefix tile holds on average when the batch's requests spread evenly over its
// prefixes, below which auto keeps the mma.sync prefix level: its warps skip the products of
// their rows when those are padding, where wgmma computes all 64. H200, bf16, 32/8 (cascade
// self-test): 64 requests on one prefix (256 rows) 55.4 -> 49.9 us, on three (85) 74.3 -> 71.3
// us, each on its own (4 rows) 294 -> 317 us (ffi/NOTES.md, round 14).
constexpr int kCascadeWgmmaMinRows = 32;

// Whether this library and device can run the wgmma prefix level for (T, D): 16-bit data,
// head_dim 64 or 128, the sm_90a build, a compute capability 9.0 device.
template <typename T, int D>
bool cascade_wgmma_available() {
#if defined(JAXATTN_CUDA) && defined(JAXATTN_HAVE_SM90A)
  if constexpr (sizeof(T) == 2 && (D == 64 || D == 128)) return device_is_sm90();
#endif
  return false;
}

// Whether the tensor-core kernel's prefix level runs on wgmma (CascadeParams::prefix_kernel;
// auto: where it is available and the tiles fill, kCascadeWgmmaMinRows). Sets *error when the
// wgmma level was asked for and is not available.
template <typename T, int D>
bool cascade_uses_wgmma(const CascadeParams& p, const char** error) {
  *error = nullptr;
  if (p.prefix_kernel == 1) return false;
  if (p.prefix_kernel == 0 &&
      int64_t(p.batch) * p.num_q_heads < int64_t(kCascadeWgmmaMinRows) * p.kv.num_kv_heads *
                                             (p.num_prefixes > 0 ? p.num_prefixes : 1))
    return false;
  bool ok = cascade_wgmma_available<T, D>();
  // Row numbers of its ring (JAXATTN_CASCADE_ROW_UNITS) are uint32 (ring_rows_fit).
  if (JAXATTN_CASCADE_ROW_UNITS && !ring_rows_fit(p.kv)) ok = false;
  if (!ok && p.prefix_kernel == 2) *error = kCascadeNoWgmma;
  return ok;
}

template <typename T, int D>
int cascade_rows() {
  return cascade_uses_mma<T, D>() ? 16 * 4 : kCascadeSimtRows;
}

// Launches the kernel of step 1 over `blocks` blocks (prefix blocks first).
template <typename T, int D>
const char* launch_cascade_blocks(const CascadeParams& p, gpuStream_t stream, int64_t blocks,
                                  int per_tile, int per_head) {
#if defined(JAXATTN_CUDA)
  if constexpr (sizeof(T) == 2 && (D == 64 || D == 128)) {
    if (cascade_uses_mma<T, D>()) {
      const char* error = nullptr;
      const bool wg = cascade_uses_wgmma<T, D>(p, &error);
      if (error) return error;
#if defined(JAXATTN_HAVE_SM90A)
      if (wg) return launch_cascade_sm90<T, D>(p, stream, blocks, per_tile, per_head);
#else
      (void)wg;
#endif
      using S = CascadeMmaShape<T, D>;
      auto kernel = cascade_mma_kernel<T, D>;
      if (const char* e = allow_dynamic_smem(kernel, S::kSmemBytes)) return e;
      kernel<<<unsigned(blocks), S::kThreads, S::kSmemBytes, stream>>>(p, per_tile, per_head);
      return check_launch();
    }
  }
#endif
  if (p.prefix_kernel == 2) return kCascadeNoWgmma;
  using S = CascadeSimtShape<T, D>;
  cascade_simt_kernel<T, D>
      <<<unsigned(blocks), S::kThreads, S::kSmemBytes, stream>>>(p, per_tile, per_head);
  return check_launch();
}

template <typename T, int D>
const char* launch_cascade_dim(const CascadeParams& p, gpuStream_t stream) {
  const int hkv = p.kv.num_kv_heads, group = p.num_q_heads / hkv;
  if (group < 1 || group > kCascadeSimtRows)
    return "jaxattn: GPU cascade decode serves 1 to 8 query heads per KV head";
  const int per_tile = cascade_rows<T, D>() / group;
  const int tiles = cascade_tiles(p.batch, p.num_prefixes, per_tile);
  const int per_head = cascade_blocks_per_head(tiles, p.prefix_target, hkv);
  const int64_t blocks = int64_t(per_head) * hkv + int64_t(p.batch) * hkv * p.own_parts;
  if (blocks > 0x7fffffff) return "jaxattn: cascade grid over 2^31 - 1 blocks";
  if (blocks > 0) {
    if (const char* e = launch_cascade_blocks<T, D>(p, stream, blocks, per_tile, per_head))
      return e;
  }
  constexpr int kRowsPerBlock = 256 / WARP_SIZE;
  const int64_t rows = int64_t(p.batch) * p.num_q_heads;
  const dim3 grid(unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock));
  // Dependent on step 1's grid (see the merge kernel), only after a step-1 launch, whose
  // blocks trigger it.
  if (blocks > 0 && launch_dependent(cascade_merge_kernel<T, D>, grid, 256, 0, stream, p))
    return nullptr;
  cascade_merge_kernel<T, D><<<grid, 256, 0, stream>>>(p);
  return check_launch();
}

inline constexpr const char* kCascadeHeadDims =
    "jaxattn: GPU cascade decode is built for head_dim 32, 64, 128 and 256";

template <typename T>
const char* launch_cascade_typed(const CascadeParams& p, gpuStream_t stream) {
  if (p.prefix_kernel < 0 || p.prefix_kernel > 2)
    return "jaxattn: cascade prefix_kernel must be 0 (auto), 1 (mma) or 2 (wgmma)";
  if (p.batch == 0 || p.num_q_heads == 0) return nullptr;  // nothing to write (and no grid)
  if (JAXATTN_DECODE_ROW_UNITS && !ring_rows_fit(p.kv))
    return "jaxattn: GPU cascade decode addresses at most 2^32 - 2 cache rows of head_dim elements";
  return with_head_dim(p.kv.head_dim, kCascadeHeadDims, [&](auto d) {
    return launch_cascade_dim<T, decltype(d)::value>(p, stream);
  });
}

// (query rows of a prefix tile, resident blocks per multiprocessor) of the kernel the launcher
// runs for (T, head_dim) on the current device.
template <typename T, int D>
const char* cascade_tile_dim(int* rows, int* blocks) {
  *rows = cascade_rows<T, D>();
#if defined(JAXATTN_CUDA)
  if constexpr (sizeof(T) == 2 && (D == 64 || D == 128)) {
    if (cascade_uses_mma<T, D>()) {
      using S = CascadeMmaShape<T, D>;
#if defined(JAXATTN_HAVE_SM90A)
      if (cascade_wgmma_available<T, D>()) return cascade_sm90_occupancy<T, D>(blocks);
#endif
      return occupancy_of(cascade_mma_kernel<T, D>, S::kThreads, S::kSmemBytes, blocks);
    }
  }
#endif
  using S = CascadeSimtShape<T, D>;
  return occupancy_of(cascade_simt_kernel<T, D>, S::kThreads, S::kSmemBytes, blocks);
}

template <typename T>
const char* cascade_tile_typed(int head_dim, int* rows, int* blocks) {
  return with_head_dim(head_dim, kCascadeHeadDims, [&](auto d) {
    return cascade_tile_dim<T, decltype(d)::value>(rows, blocks);
  });
}

}  // namespace gpu
}  // namespace jaxattn
