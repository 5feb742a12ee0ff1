// Paged decode attention, one source for CUDA and HIP.
//
// Grid (num_kv_heads, batch, partitions): a block owns one KV head of one sequence (or one
// partition of it) and computes every query head of that head's GQA group, so each K/V row
// is fetched from memory once per block however many query heads share it. (The tensor-core
// kernels serve 8 query heads a block: a larger group takes ceil(group / 8) blocks a KV head,
// grid.x = num_kv_heads x that, mma_block_heads.)
//
// Decode moves every K/V byte once and does little arithmetic per byte, so the kernels are
// built around keeping enough loads in flight. Three kernels:
//
// 1. Direct (one query head per KV head). A row of head_dim elements is read by kLanesPerRow
//    lanes, 16 bytes each, straight from global memory into registers, four rows per lane
//    group a step; each lane keeps its slice of q and of the output in registers and a logit
//    is the lanes' partial dot products summed by a shuffle tree. With one head the compute
//    per row is short and 8 blocks fit an SM, which keeps memory saturated (90-106% of the
//    H200 copy bandwidth).
//
// 2. Pipelined tensor-core kernel (NVIDIA sm_80+, bf16/f16, 2..64 query heads per KV head, 8 a
//    block; with an FP8 cache 1..64).
//    With more heads the direct kernel's load -> wait -> compute step left too few bytes in
//    flight (51-70% of copy bandwidth at 4 heads). Here K and V tiles of kTile = 64 token rows
//    go through a ring of kStages shared-memory stages filled by 16-byte cp.async copies: while
//    tile n is computed, tiles n+1 .. n+kStages-1 are in flight. Row addresses come from the
//    block table (page * page_stride + offset * token_stride); each tile's row offsets are
//    computed once, by one thread a row, into its stage's header: the block-table entry is
//    loaded before the compute of the tile that stage holds, stored after it, and the copies
//    are issued in the next iteration, after its barrier (no load latency on the issue
//    path). Rows past the partition's end are zero-filled and never read from global memory:
//    NaN in unused slots and pages cannot reach a product.
//    Compute, per warp and 16-token slice of the tile (mma.sync m16n8k16, f32 accumulation):
//      S = Q K^T with the group's query heads as the A operand (rows 0..7, rows 8..15 zero),
//        K as the B operand (ldmatrix from the K stage): lane (g, t) gets S[head g][tokens
//        2t, 2t+1] of each 8-token half;
//      softmax per head in base 2 (max over the 4 lanes of a head: two shuffles);
//      O^T += V^T P^T with V^T as the A operand (ldmatrix.trans from the V stage) and P^T as
//        the B operand, which is exactly the S fragment packed to 16 bits -- no transpose, no
//        padding in the accumulator (head_dim x 8 heads: D/4 floats per lane).
//    P is rounded to the input's 16-bit type for the second product (as in FlashAttention);
//    everything else stays f32. The tensor cores make the arithmetic negligible, so the kernel
//    runs at the rate its loads are issued: at head_dim 128, 3 stages of 34 KiB, two blocks
//    per H200 SM, 128 KiB in flight per SM. The four warps' (max, sum, output) states merge
//    once, through shared memory.
//
// 3. Pipelined SIMT kernel (everything else: f32, HIP and pre-sm_80 GPUs). The same
//    ring of stages (on HIP and pre-sm_80 targets the copies are synchronous: gpu_vendor.h),
//    computed with the lane-group scheme of kernel 1 from shared memory. Groups up to 8 keep
//    every head in each warp's registers and split the tile's rows over four warps; larger
//    groups split the heads over warps of 8 that all read every row of the tile.
//
// FP8 caches (float8_e4m3fn / float8_e5m2 under a bf16 or f16 q): every kernel reads the codes
// as stored -- half the bytes -- and widens them in registers. The SIMT kernels load 8 bytes a
// lane (the 16-bit caches' element count) and widen through float16 bits (gpu_vendor.h); the
// tensor-core kernel has an FP8 variant (paged_decode_mma_fp8_kernel, below) with a three-stage
// ring of FP8 rows (four blocks an SM) and float16 MMAs, which serves every group on NVIDIA,
// one query head a KV head included (pick_decode_kernel). The per-KV-head scales cost nothing
// per element: k_scale joins the f32 logit factor, v_scale multiplies the normalised output
// (DecodeParams::scales).
//
// Softmax runs online in base 2 (logits scaled by scale * log2 e, exp2 on the SFU; with a soft
// cap, cap * log2 e * tanh(logit / cap)); warps and lane groups merge their (max, sum, output)
// states once, at the end.
//
// Split-KV (partition_size > 0): each block writes its partition's normalised output and
// (max, sum) to the workspace and a combine kernel weighs the partitions by
// sum_p * 2^(max_p - max) -- the exact merge, since the maxima are in the same base 2.
//
// Index guards (the contract of jaxattn/guards.h). A block checks seq_lens[b] against the
// block-table width before anything else (uniform: one scalar). Page ids are checked where
// they become row offsets, so the per-token compute is untouched: the pipelined kernels when a
// tile's row offsets are stored one tile ahead (KvRing::store_offset), the direct kernel when
// it computes a row's address. A row with a bad page id is never read. In the pipelined
// kernels it is zero-filled and the thread that saw it sets a flag that the block ORs into its
// existing final barrier (__syncthreads_or); a poisoned block writes NaN for every head it owns
// -- or, split, NaN output, max and sum for its partition. In the direct kernel the thread sets
// its running sums to NaN instead, which poisons every head of the block through the merges
// with no flag carried through the loop. The combine turns a NaN partition into a NaN row.
// Only the first ceil(L / P) entries of a table row are read, so entries past them may hold
// anything.
//
// NaN: a NaN logit (NaN in q or in an attended key) makes p and so the sum l NaN; a NaN value
// makes that element of the accumulator NaN. fmaxf ignores NaN, so the running maxima stay
// numbers and every rescale (x * 2^(m - m_new), 0 for an empty state) keeps the NaN of l and
// of the accumulator; the finalisers divide unless l == 0 (nothing attended: 0), so a NaN
// never comes back as 0. Rows past the end are zero-filled copies and get probability 0:
// nothing outside [0, L) reaches a product.
#pragma once

#include <cstdint>
#include <type_traits>

#include "jaxattn/gpu_vendor.h"
#include "jaxattn/guards.h"
#if defined(JAXATTN_CUDA)
#include <cuda.h>  // CUtensorMap and its enums (types only: the library does not link libcuda)
#endif
#include "jaxattn/mma_sm80.cuh"
#include "jaxattn/params.h"

// Tuning knobs of the tensor-core kernel, compile-time (ffi/tests_gpu/decode_selftest.cu can
// be rebuilt with -D to time other values): the shared-memory budget of its ring in KiB
// where four blocks an SM do not fit three stages (stages are as many as fit, 2..4; 3 at
// head_dim 128, two blocks per H200 SM) or a fixed stage count.
#ifndef JAXATTN_DECODE_MMA_SMEM_KB
#define JAXATTN_DECODE_MMA_SMEM_KB 110
#endif
// The FP8 tensor-core kernel's stages: 3 at head_dim 128 is 55.5 KiB a block, four blocks an
// SM (528 on an H200, so a batch of 64 x 8 KV heads runs in one wave; at 4 stages three
// blocks fit and the same grid took 1.3 waves: 183 against 144 us, decode self-test).
#ifndef JAXATTN_DECODE_FP8_STAGES
#define JAXATTN_DECODE_FP8_STAGES 3
#endif
#ifndef JAXATTN_DECODE_MMA_STAGES
#define JAXATTN_DECODE_MMA_STAGES 0
#endif
// Rings keep their row offsets as uint32 row numbers, a thread's rows side by side
// (KvRing::kRowUnits): the swizzled ring of the wgmma cascade prefix (JAXATTN_CASCADE_ROW_UNITS)
// and the padded rings of the decode kernels and of cascade's other blocks
// (JAXATTN_DECODE_ROW_UNITS). On by default (measured faster or equal on every decode and
// cascade shape timed, up to 13% on the head_dim-64 one-pass decode); 0 builds the int64
// offsets to compare.
#ifndef JAXATTN_CASCADE_ROW_UNITS
#define JAXATTN_CASCADE_ROW_UNITS 1
#endif
#ifndef JAXATTN_DECODE_ROW_UNITS
#define JAXATTN_DECODE_ROW_UNITS 1
#endif

namespace jaxattn {
namespace gpu {

constexpr int cmin(int a, int b) { return a < b ? a : b; }
constexpr int cmax(int a, int b) { return a > b ? a : b; }

// Programmatic dependent launch (sm_90): the split-KV kernels let the combine launch as soon
// as each of their blocks has started, and the combine waits for them to finish (and their
// writes to land) before it reads anything, so its launch and block start-up overlap the
// tail of the main kernel instead of following it. Both are no-ops on other targets and
// when the combine was launched the ordinary way.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(JAXATTN_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(JAXATTN_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Shape of the SIMT kernels (1 and 3). DIRECT selects kernel 1 (the default for one head per
// KV head; decode_selftest.cu also instantiates it for larger groups to time it against the
// pipelined kernels).
// C is the cache's element type: T itself, or an FP8 format (T then bf16 or f16). A lane reads
// kVec elements of a row at a time: 16 bytes of a 16- or 32-bit cache, 8 bytes of an FP8 one,
// so that a lane widens as many elements (and keeps as many q and output registers) as with
// a 16-bit cache.
template <typename T, int D, int GT, bool DIRECT = (GT == 1), typename C = T>
struct DecodeShape {
  static_assert(D % (16 / sizeof(C)) == 0, "head_dim must be a whole number of 16-byte vectors");
  static constexpr int kVec = sizeof(C) == 1 ? 8 : 16 / int(sizeof(C));
  static_assert(kVec * sizeof(T) == 16, "a lane's slice of q is one 16-byte load");
  using KvVec = std::conditional_t<sizeof(C) == 1, uint2, uint4>;  // kVec elements of C
  static constexpr int kChunks = D / kVec;                         // lane-loads a row
  static constexpr int kLanesPerRow = cmin(kChunks, WARP_SIZE);
  static constexpr int kVecsPerLane = D / (kVec * kLanesPerRow);
  static constexpr int kElemsPerLane = kVecsPerLane * kVec;
  static constexpr int kRowsPerWarp = WARP_SIZE / kLanesPerRow;
  static constexpr int kHeadsPerWarp = cmin(GT, 8);
  static constexpr int kHeadChunks = GT / kHeadsPerWarp;
  static constexpr int kTokenSplit = kHeadChunks >= 4 ? 1 : 4 / kHeadChunks;
  static constexpr int kWarps = kHeadChunks * kTokenSplit;
  static constexpr int kThreads = kWarps * WARP_SIZE;
  static constexpr bool kStaged = !DIRECT;
  static_assert(kStaged || kHeadChunks == 1, "the direct kernel keeps every head in each warp");
  // Rows each lane group has in flight per step: from global memory (direct) enough
  // independent loads to cover memory latency (with 8-byte FP8 loads, 6 rows: 3/4 of the
  // 16-bit kernel's bytes, the most that fits its 64 registers without spilling on sm_80 and
  // sm_90); from shared memory fewer registers.
  static constexpr int kUnroll = kStaged ? 2 : (sizeof(KvVec) == 8 ? 6 : 4);
  static constexpr int kStep = kTokenSplit * kRowsPerWarp * kUnroll;

  // Pipelined: a ring of kStages stages of kTile rows (K then V, each row padded by 16 bytes
  // so that neighbouring rows start in different banks and every row stays 16-byte aligned)
  // plus each stage's row offsets, within 44 KiB (the default dynamic shared-memory limit is
  // 48).
  static constexpr int kRowStride = D + 16 / int(sizeof(C));
  static constexpr int kRowBytes = 2 * kRowStride * int(sizeof(C)) + 8;
  static constexpr int kRingBudget = 44 * 1024;
  static constexpr int kFit3 = kRingBudget / (3 * kRowBytes) / kStep * kStep;
  static constexpr int kFit2 = kRingBudget / (2 * kRowBytes) / kStep * kStep;
  static constexpr int kStages = kStaged ? (kFit3 >= kStep ? 3 : 2) : 0;
  static constexpr int kTile =
      kStaged ? cmin(cmax(64 / kStep, 1) * kStep, kStages == 3 ? kFit3 : kFit2) : kStep;
  static_assert(!kStaged || (kTile >= kStep && kTile % kStep == 0 && kTile <= kThreads),
                "a stage holds whole steps and at most one row per thread");
  // The (unused) ring type of DIRECT: any shape it accepts.
  static constexpr int kRingStages = kStaged ? kStages : 2;
  static constexpr int kRingTile = kStaged ? kTile : 16;
  static constexpr int kRingBytes = kStaged ? kStages * kTile * kRowBytes : 0;
  static constexpr int kMergeBytes =
      kTokenSplit > 1 ? kWarps * kHeadsPerWarp * (D + 2) * int(sizeof(float)) : 0;
  static constexpr int kSmemBytes = cmax(kRingBytes, kMergeBytes);
  static_assert(kSmemBytes <= 48 * 1024, "SIMT decode shared memory must fit the default limit");
  // __launch_bounds__ minimum blocks per SM. The direct kernel runs at 64 registers with
  // 16-bit data (8 blocks an SM, which keeps memory saturated); ptxas's own target (0: none)
  // drifted to 72 for f16 with the page-id guard, so nvcc is held to 8 blocks there (no
  // spills). f32 keeps ptxas's target (56 registers: 9 blocks; forcing that spilled). hipcc
  // reads the second bound as waves per execution unit, not blocks, so HIP keeps 0. For the
  // pipelined kernel ptxas's target spilled a few bytes at 2 heads, and shared memory bounds
  // its occupancy anyway. (FP8 caches: the 16-bit q's rule.)
#if defined(JAXATTN_CUDA)
  static constexpr int kMinBlocks = kStaged ? 1 : (sizeof(T) == 2 && kVecsPerLane == 1 ? 8 : 0);
#else
  static constexpr int kMinBlocks = kStaged ? 1 : 0;
#endif
};

__device__ __forceinline__ uint4 load16(const void* p) {
#if defined(JAXATTN_CUDA)
  return __ldg(static_cast<const uint4*>(p));
#else
  return *static_cast<const uint4*>(p);
#endif
}

// One lane-load (16 or 8 bytes) of cache data from global memory.
template <typename V>
__device__ __forceinline__ V load_kv(const void* p) {
#if defined(JAXATTN_CUDA)
  return __ldg(static_cast<const V*>(p));
#else
  return *static_cast<const V*>(p);
#endif
}

// The block's share of its sequence: tokens [start, end).
struct DecodeRange {
  int start;
  int end;
};

// The block's tokens [start, end). False when the block has nothing to compute: a split
// partition past the sequence's end (the combine reads only partitions that hold tokens, so
// such a block writes nothing), or a sequence whose length does not fit its block-table row,
// whose rows are NaN (written here in one pass, by the combine when split).
// The first token of the block's partition (0 in one pass), known before the sequence length.
__device__ __forceinline__ int decode_block_start(const DecodeParams& p) {
  return p.partition_size > 0 ? int(blockIdx.z) * p.partition_size : 0;
}

// Tensor-core decode blocks serve at most kMmaDecodeHeads query heads (the n = 8 side of their
// products), so a KV head with a larger group is served by mma_head_chunks(group) blocks, next
// to each other in grid.x, each reading the KV head's tiles for its slice of the group (the
// blocks of one KV head run side by side, so the later reads are mostly L2 hits).
constexpr int kMmaDecodeHeads = 8;
JAXATTN_HD int mma_head_chunks(int group) {
  return (group + kMmaDecodeHeads - 1) / kMmaDecodeHeads;
}
struct MmaHeads {
  int kvh;  // the block's KV head
  int h0;   // its first query head
  int hn;   // its query heads: 1..kMmaDecodeHeads
};
__device__ __forceinline__ MmaHeads mma_block_heads(const DecodeParams& p) {
  const int group = p.num_q_heads / p.kv.num_kv_heads;
  if (group <= kMmaDecodeHeads) return {int(blockIdx.x), int(blockIdx.x) * group, group};
  const int chunks = mma_head_chunks(group);
  const int kvh = int(blockIdx.x) / chunks, c = int(blockIdx.x) - kvh * chunks;
  return {kvh, kvh * group + c * kMmaDecodeHeads,
          min(kMmaDecodeHeads, group - c * kMmaDecodeHeads)};
}

// The block serves query heads [h0, h0 + hn) of its sequence.
template <typename T>
__device__ __forceinline__ bool decode_range(const DecodeParams& p, int h0, int hn,
                                             DecodeRange* r) {
  const int L = p.seq_lens[blockIdx.y];
  if (!decode_bounds_ok(L, p.block_table_stride, p.kv.page_size, p.kv.num_pages)) {
    if (p.partition_size == 0) {
      const int D = p.kv.head_dim;
      T* out = static_cast<T*>(p.out) + (int64_t(blockIdx.y) * p.num_q_heads + h0) * D;
      for (int i = threadIdx.x; i < hn * D; i += blockDim.x) out[i] = from_float<T>(quiet_nan());
    }
    return false;
  }
  r->start = decode_block_start(p);
  r->end = L;
  if (p.partition_size > 0) {
    if (r->start >= L) return false;
    r->end = min(L, r->start + p.partition_size);
  }
  return true;
}

// Logits of a tensor-core decode lane's fragment, tokens t0 + 8 h + 2 tq + e (h, e in 0..1):
// times q_scale, soft-capped, -inf past `end`; returns their maximum. The cap is one
// block-uniform branch around branch-free code (a branch an element makes each a fetch stall
// for a kernel with few warps a scheduler).
__device__ __forceinline__ float mma_decode_logits(const float (&sc)[2][4], float q_scale,
                                                   float cap_log2e, int t0, int tq, int end,
                                                   float (&pr)[2][2]) {
  constexpr float kNegInf = -__builtin_huge_valf();
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int e = 0; e < 2; ++e) pr[h][e] = sc[h][e] * q_scale;
  if (cap_log2e > 0.f) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) pr[h][e] = cap_log2e * tanhf(pr[h][e]);
  }
  float mx = kNegInf;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      pr[h][e] = t0 + 8 * h + 2 * tq + e < end ? pr[h][e] : kNegInf;
      mx = fmaxf(mx, pr[h][e]);
    }
  return mx;
}

// Stores of a partition's state (its normalised output, its max and sum), which a merge kernel
// reads after the grid: with L2 evict-last priority, so the K/V streamed through L2 after them
// do not push them out to memory before the merge reads them.
template <typename V>
__device__ __forceinline__ void state_store(V* ptr, V v) {
#if defined(JAXATTN_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint64_t pol;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(pol));
  if constexpr (sizeof(V) == 8) {
    const float2 f = reinterpret_cast<const float2&>(v);
    asm volatile("st.global.L2::cache_hint.v2.f32 [%0], {%1, %2}, %3;\n" ::"l"(ptr), "f"(f.x),
                 "f"(f.y), "l"(pol)
                 : "memory");
  } else {
    asm volatile("st.global.L2::cache_hint.f32 [%0], %1, %2;\n" ::"l"(ptr), "f"(v), "l"(pol)
                 : "memory");
  }
#else
  *ptr = v;
#endif
}

// Writes one element of a finished (head, d): the output itself in one pass, or the
// partition's normalised output and its (max, sum) for the combine. l == 0: nothing attended.
// vs: the KV head's value scale (a weighted mean of values is linear in it, so each
// partition's output carries it into the combine).
template <typename T>
__device__ __forceinline__ void decode_write(const DecodeParams& p, int b, int head, int d, float o,
                                             float m, float l, float vs) {
  const int D = p.kv.head_dim;
  const float v = l == 0.f ? 0.f : o / l * vs;
  const int64_t bh = int64_t(b) * p.num_q_heads + head;
  if (p.partition_size == 0) {
    static_cast<T*>(p.out)[bh * D + d] = from_float<T>(v);
    return;
  }
  const int64_t slot = bh * p.max_parts + blockIdx.z;
  state_store(p.workspace + slot * D + d, v);
  if (d == 0) {
    float* ml = p.workspace + int64_t(p.batch) * p.num_q_heads * p.max_parts * D;
    state_store(ml + 2 * slot, m);
    state_store(ml + 2 * slot + 1, l);
  }
}

// Merges the (max, sum, output) states that WS warps left in shared memory for each of the
// block's HC x GC heads and writes the results, in a fixed order; NaN for all of them when
// the block is poisoned. red holds, for warp w = ws * HC + hc and its head g, D output floats
// then the max and the sum, at red + (w * GC + g) * (D + 2). The block's heads are query heads
// [h0, h0 + hn) of sequence b.
template <typename T, int D, int HC, int GC, int WS, int NT>
__device__ __forceinline__ void merge_warps_and_write(const DecodeParams& p, const float* red,
                                                      int b, int h0, int hn, bool poisoned,
                                                      float vs) {
  constexpr float kNegInf = -__builtin_huge_valf();
  // The block's heads only: the tensor-core kernels' 8 columns hold 4 padding heads at GQA 4.
  const int items = min(hn, HC * GC) * D;
  for (int i = threadIdx.x; i < items; i += NT) {
    const int gh = i / D, d = i % D;
    const int hci = gh / GC, g = gh % GC;
    float mx = kNegInf;
#pragma unroll
    for (int w = 0; w < WS; ++w) mx = fmaxf(mx, red[((w * HC + hci) * GC + g) * (D + 2) + D]);
    const float m_use = mx == kNegInf ? 0.f : mx;
    float o = 0.f, ls = 0.f;
#pragma unroll
    for (int w = 0; w < WS; ++w) {
      const float* r = red + ((w * HC + hci) * GC + g) * (D + 2);
      const float wt = fast_exp2(r[D] - m_use);
      ls += wt * r[D + 1];
      o += wt * r[d];
    }
    if (poisoned) o = mx = ls = quiet_nan();
    decode_write<T>(p, b, h0 + gh, d, o, mx, ls, vs);
  }
}

// base + bytes x row as a wide multiply-add (mad.wide.u32 on NVIDIA). ptxas computes the
// product of a row once for its K and V copies and adds each base (five instructions for the
// pair, against about fourteen for a 64-bit element offset with a sign test).
__device__ __forceinline__ const void* row_address(uint64_t base, uint32_t row, uint32_t bytes) {
#if defined(JAXATTN_CUDA) && defined(__CUDA_ARCH__)
  uint64_t a;
  asm("mad.wide.u32 %0, %1, %2, %3;\n" : "=l"(a) : "r"(row), "r"(bytes), "l"(base));
  return reinterpret_cast<const void*>(a);
#else
  return reinterpret_cast<const void*>(base + uint64_t(row) * bytes);
#endif
}

// Whether uint32 row numbers (KvRing's row units) address every row of head_dim elements of
// this cache with kNoRow to spare: any cache a GPU holds at head_dim >= 64, or 16-bit.
inline bool ring_rows_fit(const KvGeometry& kv) {
  return kv.head_dim > 0 &&
         int64_t(kv.num_pages) * kv.page_stride / kv.head_dim < int64_t(0xffffffffu);
}

// The shared-memory ring of the pipelined kernels: kStages stages, each the element offsets
// of its TILE rows (int64, -1 for a row past the end) followed by TILE rows of K and TILE rows
// of V (RS elements apart). Tile n lives in stage n % STAGES.
//
// RS = 0 selects the Hopper tensor-core layout instead (cascade_sm90.cuh: operands of wgmma
// through 128-byte-swizzle descriptors): each K and V tile is D * sizeof(T) / 128 column blocks
// of [TILE rows][128 bytes], the 16-byte chunk c of a row at chunk c ^ (row % 8) of its block;
// all the K tiles, then all the V tiles, then the offsets. `base` must then be 1024-byte
// aligned.
template <typename T, int D, int TILE, int STAGES, int RS, int NT>
struct KvRing {
  using Elem = T;
  static constexpr int kTile = TILE;
  static constexpr int kStages = STAGES;
  static constexpr int kVec = 16 / int(sizeof(T));
  static constexpr int kChunks = D / kVec;
  static constexpr bool kSwizzled = RS == 0;
  static constexpr int kTileBytes = TILE * D * int(sizeof(T));  // one K or V tile, swizzled
  static constexpr int kStageBytes =
      kSwizzled ? 2 * kTileBytes + TILE * 8 : TILE * 8 + 2 * TILE * RS * int(sizeof(T));
  static_assert(kStageBytes % 16 == 0, "stages must stay 16-byte aligned");
  static_assert(!kSwizzled || (D * int(sizeof(T))) % 128 == 0, "swizzled rows: 128-byte blocks");
  static_assert(!kSwizzled || TILE % 8 == 0, "swizzled tiles: whole 8-row groups");
  static_assert(TILE <= NT, "one thread computes each row offset");
  // Rows between one thread's copies in issue()'s chunk-column order, and its rows a tile.
  static constexpr int kCopyStep = NT / kChunks;
  static constexpr int kRowsEach = kCopyStep > 0 ? TILE / kCopyStep : 0;
  // Row units (JAXATTN_CASCADE_ROW_UNITS for the swizzled ring, JAXATTN_DECODE_ROW_UNITS for
  // the padded ones; rings whose copies are not whole chunk columns keep int64 offsets): a
  // stage's offsets are uint32 row numbers (element offset / D: every page, token and head
  // stride is a multiple of head_dim; the launchers keep a cache's rows below kNoRow, see
  // ring_rows_fit) with kNoRow for a row past the end or with a bad page, the row r at
  // unit_slot(r) = (r % kCopyStep) * kRowsEach + r / kCopyStep, so that the kRowsEach rows a
  // thread copies (r0, r0 + kCopyStep, ...) are side by side: issue() reads them up to four at
  // a time (one 16-byte load) and makes each row's source a wide multiply-add (row x row bytes
  // + the chunk's base) instead of a 64-bit sign test, select, shift and add for K and again
  // for V.
  static constexpr bool kRowUnitsFit =
      NT % kChunks == 0 && kCopyStep > 0 && TILE % kCopyStep == 0 &&
      (kRowsEach <= 2 || kRowsEach % 4 == 0) && (!kSwizzled || kCopyStep % 8 == 0);
  static constexpr bool kRowUnits =
      kRowUnitsFit && (kSwizzled ? JAXATTN_CASCADE_ROW_UNITS != 0 : JAXATTN_DECODE_ROW_UNITS != 0);
  static constexpr uint32_t kNoRow = 0xffffffffu;
  static_assert(!kSwizzled || !JAXATTN_CASCADE_ROW_UNITS || kRowUnitsFit,
                "row units: the swizzled ring copies whole chunk columns");

  unsigned char* base;
  const T* kbase;  // this KV head's K and V
  const T* vbase;
  const int32_t* table;  // this sequence's block-table row
  KvGeometry kv;
  int start, end;

  // Tiles of [start, end).
  __device__ __forceinline__ int tiles() const { return (end - start + TILE - 1) / TILE; }
  __device__ __forceinline__ int64_t* offsets(int stage) const {
    if constexpr (kSwizzled)
      return reinterpret_cast<int64_t*>(base + 2 * STAGES * kTileBytes + stage * TILE * 8);
    return reinterpret_cast<int64_t*>(base + stage * kStageBytes);
  }
  __device__ __forceinline__ uint32_t* row_units(int stage) const {
    return reinterpret_cast<uint32_t*>(offsets(stage));
  }
  __device__ __forceinline__ static int unit_slot(int r) {
    return (r % kCopyStep) * kRowsEach + r / kCopyStep;
  }
  __device__ __forceinline__ T* k_rows(int stage) const {
    if constexpr (kSwizzled) return reinterpret_cast<T*>(base + stage * kTileBytes);
    return reinterpret_cast<T*>(base + stage * kStageBytes + TILE * 8);
  }
  __device__ __forceinline__ T* v_rows(int stage) const {
    if constexpr (kSwizzled) return reinterpret_cast<T*>(base + (STAGES + stage) * kTileBytes);
    return k_rows(stage) + TILE * RS;
  }
  // Byte offset of 16-byte chunk c of row r in a tile.
  __device__ __forceinline__ static int chunk_at(int r, int c) {
    if constexpr (kSwizzled) return (c >> 3) * (TILE * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
    return (r * RS + c * kVec) * int(sizeof(T));
  }

  // Page of this thread's row of tile n (0 when the row is past the end; only threads below
  // TILE have a row). Split from store_offset so that the block-table read can be issued a
  // whole tile's compute before its value is needed.
  __device__ __forceinline__ int page_of(int n) const {
    const int t = start + n * TILE + int(threadIdx.x);
    return (int(threadIdx.x) < TILE && t < end) ? table[page_index(t)] : 0;
  }
  // t / page_size and t % page_size (t >= 0), a shift and a mask for the usual power-of-two
  // page sizes (the block's choice is uniform; an integer division costs ~20 instructions).
  __device__ __forceinline__ static int page_index_of(int t, int ps) {
    return (ps & (ps - 1)) == 0 ? t >> (__ffs(ps) - 1) : t / ps;
  }
  __device__ __forceinline__ int page_index(int t) const { return page_index_of(t, kv.page_size); }
  __device__ __forceinline__ int page_offset(int t) const {
    const int ps = kv.page_size;
    return (ps & (ps - 1)) == 0 ? t & (ps - 1) : t % ps;
  }
  // Block-table entries fetched into shared memory (the wgmma cascade prefix): STAGES slots
  // of TILE int32 after the offsets, tile n's in slot n % STAGES. fetch_page(n) starts this
  // thread's row's entry of tile n (0 past the end) as a 4-byte copy in the open commit group;
  // fetched_page(n) reads it once that group has been waited for -- by this thread, which alone
  // reads the entry, so no barrier is needed. The read then never sits in a register while
  // the warp waits for its other loads (a wgmma fence waits for every one of them).
  static constexpr int kPageSlotBytes = STAGES * TILE * 4;
  __device__ __forceinline__ int32_t* page_slots(int stage) const {
    return reinterpret_cast<int32_t*>(base + STAGES * kStageBytes) + stage * TILE;
  }
  __device__ __forceinline__ void fetch_page(int n) const {
    const int r = int(threadIdx.x);  // the row this thread fetches
    if (r >= TILE) return;
    const int t = start + n * TILE + r;
    const bool live = t < end;
    async_copy4(page_slots(n % STAGES) + r, live ? table + page_index(t) : table, live);
  }
  __device__ __forceinline__ int fetched_page(int n) const {
    return int(threadIdx.x) < TILE ? page_slots(n % STAGES)[threadIdx.x] : 0;
  }

  // True when the row's page id lies outside the cache: the row is then zero-filled like a
  // row past the end, and the caller poisons the block.
  __device__ __forceinline__ bool store_offset(int n, int page) const {
    if (int(threadIdx.x) >= TILE) return false;
    const int t = start + n * TILE + int(threadIdx.x);
    const bool live = t < end;
    const bool ok = live && index_ok(page, kv.num_pages);
    if constexpr (kRowUnits) {
      // In 32 bits: the launcher keeps the cache's rows below kNoRow.
      const uint32_t row = uint32_t(page) * uint32_t(kv.page_stride / D) +
                           uint32_t(page_offset(t)) * uint32_t(kv.token_stride / D);
      row_units(n % STAGES)[unit_slot(int(threadIdx.x))] = ok ? row : kNoRow;
    } else {
      offsets(n % STAGES)[threadIdx.x] =
          ok ? int64_t(page) * kv.page_stride + int64_t(page_offset(t)) * kv.token_stride
             : int64_t(-1);
    }
    return live && !ok;
  }

  // Starts the copies of tile n (its offsets must be visible: stored before a barrier).
  __device__ __forceinline__ void issue(int n) const {
    const int s = n % STAGES;
    const int64_t* off = offsets(s);
    unsigned char* ks = reinterpret_cast<unsigned char*>(k_rows(s));
    unsigned char* vs = reinterpret_cast<unsigned char*>(v_rows(s));
    constexpr int kStep = kCopyStep;  // rows between one thread's copies
    if constexpr (kRowUnits) {
      // The same rows and chunks as below, the row numbers read up to four at a time.
      constexpr int kRowBytes = kSwizzled ? 128 : RS * int(sizeof(T));  // shared memory
      constexpr int kLoad = kRowsEach < 4 ? kRowsEach : 4;
      const int c = int(threadIdx.x) % kChunks, r0 = int(threadIdx.x) / kChunks;
      const int at0 = chunk_at(r0, c);
      const uint32_t* units = row_units(s) + r0 * kRowsEach;
      const uint64_t kc = reinterpret_cast<uint64_t>(kbase + c * kVec);
      const uint64_t vc = reinterpret_cast<uint64_t>(vbase + c * kVec);
      const uint32_t row_bytes = uint32_t(kv.head_dim) * uint32_t(sizeof(T));  // D's, at run time
#pragma unroll
      for (int i0 = 0; i0 < kRowsEach; i0 += kLoad) {
        uint32_t rows[kLoad];
        if constexpr (kLoad == 4) {
          const uint4 w = *reinterpret_cast<const uint4*>(units + i0);
          rows[0] = w.x;
          rows[1] = w.y;
          rows[2] = w.z;
          rows[3] = w.w;
        } else if constexpr (kLoad == 2) {
          const uint2 w = *reinterpret_cast<const uint2*>(units + i0);
          rows[0] = w.x;
          rows[1] = w.y;
        } else {
          rows[0] = units[i0];
        }
#pragma unroll
        for (int j = 0; j < kLoad; ++j) {
          const bool ok = rows[j] != kNoRow;
          const uint32_t row = ok ? rows[j] : 0u;
          const int at = at0 + (i0 + j) * kStep * kRowBytes;
          async_copy16(ks + at, row_address(kc, row, row_bytes), ok);
          async_copy16(vs + at, row_address(vc, row, row_bytes), ok);
        }
      }
    } else if constexpr (NT % kChunks == 0 && (!kSwizzled || kStep % 8 == 0)) {
      // Each thread copies chunk c of rows r0, r0 + kStep, ...: one chunk column, so its
      // shared address moves by a constant a row (the swizzle phase r % 8 stays) and its
      // source by the row's offset alone -- about a third of the instructions of a copy whose
      // row and chunk come from a division.
      constexpr int kRowBytes = kSwizzled ? 128 : RS * int(sizeof(T));
      const int c = int(threadIdx.x) % kChunks, r0 = int(threadIdx.x) / kChunks;
      const int at0 = chunk_at(r0, c);
      const T* kc = kbase + c * kVec;
      const T* vc = vbase + c * kVec;
#pragma unroll
      for (int i = 0; i < (TILE + kStep - 1) / kStep; ++i) {
        const int r = r0 + i * kStep;
        if (TILE % kStep == 0 || r < TILE) {
          const int64_t o = off[r];
          const bool ok = o >= 0;
          const int64_t src = ok ? o : 0;
          const int at = at0 + i * kStep * kRowBytes;
          async_copy16(ks + at, kc + src, ok);
          async_copy16(vs + at, vc + src, ok);
        }
      }
    } else {
      constexpr int kCopies = TILE * kChunks;
#pragma unroll
      for (int i = 0; i < (kCopies + NT - 1) / NT; ++i) {
        const int idx = int(threadIdx.x) + i * NT;
        if (kCopies % NT == 0 || idx < kCopies) {
          const int r = idx / kChunks, c = idx % kChunks;
          const int64_t o = off[r];
          const bool ok = o >= 0;
          const int64_t src = ok ? o + c * kVec : 0;
          const int at = chunk_at(r, c);
          async_copy16(ks + at, kbase + src, ok);
          async_copy16(vs + at, vbase + src, ok);
        }
      }
    }
  }

  // The pages of this thread's rows of tiles 0 .. STAGES-1 of the block's rows starting at
  // `start` (threads below TILE), loaded before the sequence's length is known, beside its load
  // instead of after it: entries past the table row's width read its last entry, and prologue
  // uses an entry only for a row below the length (as page_of does). The tensor-core decode
  // kernels load q the same way (H200, decode self-test, with the combine's early length read:
  // bf16 batch 1 x 32768 and 8 x 4096 44.5 -> 43.1 us, 64 x 4096 -1%; ffi/NOTES.md, round 15).
  __device__ __forceinline__ static void early_pages(const int32_t* table, int width, int page_size,
                                                     int start, int (&pages)[STAGES]) {
#pragma unroll
    for (int n = 0; n < STAGES; ++n) {
      const int t = start + n * TILE + int(threadIdx.x);
      const int i = page_size <= 0 ? 0 : page_index_of(t, page_size);
      pages[n] =
          (int(threadIdx.x) < TILE && width > 0) ? table[min(unsigned(i), unsigned(width - 1))] : 0;
    }
  }

  // Prologue: offsets of tiles 0 .. STAGES-1, then the copies of tiles 0 .. STAGES-2, one
  // commit group each (empty groups past the last tile keep the group count uniform). Returns
  // whether this thread saw a bad page id. `pages`: early_pages of this ring's table and start.
  // `fetch` (fetch_page): group n also fetches tile n + STAGES's entries.
  __device__ __forceinline__ bool prologue(int ntiles, const int (&pages)[STAGES],
                                           bool fetch = false) const {
    bool bad = false;
#pragma unroll
    for (int n = 0; n < STAGES; ++n) bad |= store_offset(n, pages[n]);
    __syncthreads();
#pragma unroll
    for (int n = 0; n < STAGES - 1; ++n) {
      if (n < ntiles) issue(n);
      if (fetch) fetch_page(n + STAGES);
      async_copy_commit();
    }
    return bad;
  }
  // The same, the pages read now (page_of).
  __device__ __forceinline__ bool prologue(int ntiles, bool fetch = false) const {
    int pages[STAGES];
#pragma unroll
    for (int n = 0; n < STAGES; ++n) pages[n] = page_of(n);
    return prologue(ntiles, pages, fetch);
  }
};

// The tensor-core decode kernels' start once their early loads are issued (q, and `pages` from
// Ring::early_pages at decode_block_start): the block's range (decode_range over its query
// heads [h0, h0 + hn); false: nothing to compute), its ring over KV head kvh and the prologue's
// copies. `bad`: this thread met a page id outside the cache.
template <typename T, typename Ring>
__device__ __forceinline__ bool decode_ring_start(const DecodeParams& p, int kvh, int h0, int hn,
                                                  const int32_t* table, unsigned char* smem,
                                                  const int (&pages)[Ring::kStages], Ring& ring,
                                                  bool& bad) {
  DecodeRange range;
  pdl_launch_dependents();
  if (!decode_range<T>(p, h0, hn, &range)) return false;
  using E = typename Ring::Elem;
  const int64_t head = kvh * p.kv.head_stride;
  const E* k = static_cast<const E*>(p.k) + head;
  const E* v = static_cast<const E*>(p.v) + head;
  ring = Ring{smem, k, v, table, p.kv, range.start, range.end};
  bad = ring.prologue(ring.tiles(), pages);
  return true;
}

// ------------------------------------------------------------------------------------------
// SIMT kernels (1 and 3).
// ------------------------------------------------------------------------------------------

// Folds U rows of K and V into the running softmax state of the GC query heads a lane holds
// (the SIMT decode kernels: paged decode and cascade's own level): each lane holds NV vectors
// of VEC elements of C of every row (TG lanes a row); the dot products with q are summed over
// the row's lanes, soft-capped, masked where !ok[u], then the online max and sum, and acc +=
// p v.
template <typename C, int U, int NV, int GC, int EPL, int VEC, int TG, typename Vec>
__device__ __forceinline__ void decode_fold_rows(const Vec (&kr)[U][NV], const Vec (&vr)[U][NV],
                                                 const bool (&ok)[U], const float (&q)[GC][EPL],
                                                 float cap_log2e, float (&m)[GC], float (&l)[GC],
                                                 float (&acc)[GC][EPL]) {
  constexpr float kNegInf = -__builtin_huge_valf();
  float s[U][GC];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    float kf[EPL];
#pragma unroll
    for (int j = 0; j < NV; ++j) vec_to_float<C>(kr[u][j], &kf[j * VEC]);
#pragma unroll
    for (int g = 0; g < GC; ++g) {
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < EPL; ++e) dot = fmaf(q[g][e], kf[e], dot);
      s[u][g] = dot;
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int g = 0; g < GC; ++g) {
      float v = group_sum<TG>(s[u][g]);
      if (cap_log2e > 0.f) v = cap_log2e * tanhf(v);
      s[u][g] = ok[u] ? v : kNegInf;
    }
  }
#pragma unroll
  for (int g = 0; g < GC; ++g) {
    float mx = s[0][g];
#pragma unroll
    for (int u = 1; u < U; ++u) mx = fmaxf(mx, s[u][g]);
    const float m_new = fmaxf(m[g], mx);
    const float m_use = m_new == kNegInf ? 0.f : m_new;
    const float alpha = fast_exp2(m[g] - m_use);
    l[g] *= alpha;
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[g][e] *= alpha;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      s[u][g] = fast_exp2(s[u][g] - m_use);
      l[g] += s[u][g];
    }
    m[g] = m_new;
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    float vf[EPL];
#pragma unroll
    for (int j = 0; j < NV; ++j) vec_to_float<C>(vr[u][j], &vf[j * VEC]);
#pragma unroll
    for (int g = 0; g < GC; ++g) {
#pragma unroll
      for (int e = 0; e < EPL; ++e) acc[g][e] = fmaf(s[u][g], vf[e], acc[g][e]);
    }
  }
}

// Merges the states (m, l, acc) of the lane groups of each warp, which saw disjoint rows.
template <int GC, int EPL, int TG>
__device__ __forceinline__ void decode_merge_lane_groups(float (&m)[GC], float (&l)[GC],
                                                         float (&acc)[GC][EPL]) {
  constexpr float kNegInf = -__builtin_huge_valf();
#pragma unroll
  for (int off = TG; off < WARP_SIZE; off *= 2) {
#pragma unroll
    for (int g = 0; g < GC; ++g) {
      const float mo = shfl_xor(m[g], off);
      const float lo = shfl_xor(l[g], off);
      const float m_new = fmaxf(m[g], mo);
      const float m_use = m_new == kNegInf ? 0.f : m_new;
      const float a = fast_exp2(m[g] - m_use), ao = fast_exp2(mo - m_use);
      l[g] = l[g] * a + lo * ao;
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        const float other = shfl_xor(acc[g][e], off);
        acc[g][e] = acc[g][e] * a + other * ao;
      }
      m[g] = m_new;
    }
  }
}

template <typename T, int D, int GT, bool DIRECT, typename C = T>
__global__ void __launch_bounds__((DecodeShape<T, D, GT, DIRECT, C>::kThreads),
                                  (DecodeShape<T, D, GT, DIRECT, C>::kMinBlocks))
    paged_decode_kernel(const DecodeParams p) {
  using S = DecodeShape<T, D, GT, DIRECT, C>;
  using KvVec = typename S::KvVec;
  constexpr int VEC = S::kVec, TG = S::kLanesPerRow, NV = S::kVecsPerLane;
  constexpr int EPL = S::kElemsPerLane, TPW = S::kRowsPerWarp, GC = S::kHeadsPerWarp;
  constexpr int HC = S::kHeadChunks, WS = S::kTokenSplit, U = S::kUnroll;
  constexpr float kNegInf = -__builtin_huge_valf();
  extern __shared__ __align__(16) unsigned char smem[];

  const int kvh = blockIdx.x, b = blockIdx.y;
  const int group = p.num_q_heads / p.kv.num_kv_heads;
  DecodeRange range;
  pdl_launch_dependents();
  if (!decode_range<T>(p, kvh * group, group, &range)) return;
  const int start = range.start, end = range.end;
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int hc = warp % HC, ws = warp / HC;
  const int row = lane / TG, col = lane % TG;

  const KvGeometry& kv = p.kv;
  const int32_t* bt = p.block_tables + int64_t(b) * p.block_table_stride;
  const C* kbase = static_cast<const C*>(p.k) + kvh * kv.head_stride;
  const C* vbase = static_cast<const C*>(p.v) + kvh * kv.head_stride;

  using Ring = KvRing<C, D, S::kRingTile, S::kRingStages, S::kRowStride, S::kThreads>;
  [[maybe_unused]] const Ring ring{smem, kbase, vbase, bt, kv, start, end};
  [[maybe_unused]] const int ntiles = (end - start + S::kTile - 1) / S::kTile;
  bool bad = false;  // this thread met a page id outside the cache (pipelined kernel)
  if constexpr (S::kStaged) bad = ring.prologue(ntiles);  // the copies overlap the q loads below

  // The logit factor: the softmax scale in base 2, the KV head's key scale, and the widening
  // factor of an FP8 cache's loads.
  const float q_scale = p.ls.q_scale * p.scales.k_of(kvh) * Widen<C>::kScale;
  float q[GC][EPL];
#pragma unroll
  for (int g = 0; g < GC; ++g) {
    const int gh = hc * GC + g;
    if (gh < group) {
      const T* qp =
          static_cast<const T*>(p.q) + (int64_t(b) * p.num_q_heads + kvh * group + gh) * D;
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
  auto consume = [&](const KvVec(&kr)[U][NV], const KvVec(&vr)[U][NV], const bool (&ok)[U]) {
    decode_fold_rows<C, U, NV, GC, EPL, VEC, TG>(kr, vr, ok, q, p.ls.cap_log2e, m, l, acc);
  };

  const KvVec zero{};

  if constexpr (!S::kStaged) {
    for (int tb = start; tb < end; tb += S::kStep) {
      KvVec kr[U][NV], vr[U][NV];
      bool ok[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int t = tb + (u * WS + ws) * TPW + row;
        ok[u] = t < end;
        if (ok[u]) {
          int page = bt[t / kv.page_size];
          if (!index_ok(page, kv.num_pages)) {
            // A page id outside the cache: the row reads page 0 instead (num_pages > 0 here:
            // decode_range) and a NaN sum poisons every head of the block through the merges
            // (every head lives in every warp here), with no flag live through the loop.
            page = 0;
#pragma unroll
            for (int g = 0; g < GC; ++g) l[g] = quiet_nan();
          }
          const int64_t off = int64_t(page) * kv.page_stride +
                              int64_t(t % kv.page_size) * kv.token_stride + col * VEC;
#pragma unroll
          for (int j = 0; j < NV; ++j) {
            kr[u][j] = load_kv<KvVec>(kbase + off + j * TG * VEC);
            vr[u][j] = load_kv<KvVec>(vbase + off + j * TG * VEC);
          }
        } else {
#pragma unroll
          for (int j = 0; j < NV; ++j) kr[u][j] = vr[u][j] = zero;
        }
      }
      consume(kr, vr, ok);
    }
  } else {
    constexpr int NS = S::kStages;
    for (int n = 0; n < ntiles; ++n) {
      async_copy_wait<NS - 2>();  // this thread's copies of tile n have landed
      __syncthreads();            // everyone's have, and stage (n - 1) % NS is free
      if (n + NS - 1 < ntiles) ring.issue(n + NS - 1);
      async_copy_commit();
      const int page = ring.page_of(n + NS);  // consumed after this tile's compute

      const int s = n % NS, tile0 = start + n * S::kTile;
      const C* ks = ring.k_rows(s);
      const C* vs = ring.v_rows(s);
      for (int tb = 0; tb < S::kTile && tile0 + tb < end; tb += S::kStep) {
        KvVec kr[U][NV], vr[U][NV];
        bool ok[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int r = tb + (u * WS + ws) * TPW + row;
          ok[u] = tile0 + r < end;  // rows past the end hold zeros
#pragma unroll
          for (int j = 0; j < NV; ++j) {
            const int e = r * S::kRowStride + (j * TG + col) * VEC;
            kr[u][j] = *reinterpret_cast<const KvVec*>(ks + e);
            vr[u][j] = *reinterpret_cast<const KvVec*>(vs + e);
          }
        }
        consume(kr, vr, ok);
      }
      bad |= ring.store_offset(n + NS, page);  // stage n % NS's offsets were used at issue(n)
    }
    async_copy_wait<0>();
  }

  decode_merge_lane_groups<GC, EPL, TG>(m, l, acc);  // they saw disjoint rows

  // The value scale (with the widening factor), read once the loop no longer needs registers.
  const float v_scale = p.scales.v_of(kvh) * Widen<C>::kScale;
  if constexpr (WS == 1) {
    const bool poisoned = __syncthreads_or(bad);
    if (row == 0) {
#pragma unroll
      for (int g = 0; g < GC; ++g) {
        const int gh = hc * GC + g;
        if (gh >= group) continue;
        // A NaN sum makes every element NaN (and, split, the partition's weight).
        const float mg = poisoned ? quiet_nan() : m[g], lg = poisoned ? quiet_nan() : l[g];
#pragma unroll
        for (int j = 0; j < NV; ++j) {
#pragma unroll
          for (int v = 0; v < VEC; ++v) {
            decode_write<T>(p, b, kvh * group + gh, (j * TG + col) * VEC + v, acc[g][j * VEC + v],
                            mg, lg, v_scale);
          }
        }
      }
    }
  } else {
    // Merge the warps that split the rows, through shared memory, in a fixed order.
    float* red = reinterpret_cast<float*>(smem);
    const bool poisoned = __syncthreads_or(bad);  // and the ring (if any) is no longer read
    if (row == 0) {
#pragma unroll
      for (int g = 0; g < GC; ++g) {
        float* r = red + (warp * GC + g) * (D + 2);
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
    merge_warps_and_write<T, D, HC, GC, WS, S::kThreads>(p, red, b, kvh * group, group, poisoned,
                                                         v_scale);
  }
}

// ------------------------------------------------------------------------------------------
// Tensor-core kernel (2).
// ------------------------------------------------------------------------------------------

#if defined(JAXATTN_CUDA)

// Blocks of `bytes` of dynamic shared memory an SM holds (228 KiB an SM, 1 KiB reserved a block),
// and the 2 to 4 of them a tensor-core decode kernel's __launch_bounds__ asks for.
constexpr int decode_blocks_by_smem(int bytes) { return (228 * 1024) / (bytes + 1024); }
constexpr int decode_min_blocks(int bytes) {
  return cmin(4, cmax(2, decode_blocks_by_smem(bytes)));
}

template <typename T, int D>
struct MmaDecodeShape {
  static_assert(sizeof(T) == 2 && D % 16 == 0, "16-bit elements, head_dim a multiple of 16");
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kHeads = kMmaDecodeHeads;  // query heads a block serves (n of the MMAs)
  static constexpr int kTile = 16 * kWarps;  // a 16-token slice per warp
  static constexpr int kRowStride = D + 8;   // elements: one 16-byte vector of padding
  static constexpr int kStageBytes = kTile * 8 + 2 * kTile * kRowStride * 2;
  // Stages that still let four blocks share an SM (228 KiB, 1 KiB reserved a block): at
  // head_dim 64 three (a batch of 64 x 8 KV heads then runs in one wave of 528 blocks on an
  // H200 instead of two of 264 at four stages), at 32 four; at 128 a stage is 35 KiB and the
  // ring takes the JAXATTN_DECODE_MMA_SMEM_KB budget instead (3 stages, two blocks an SM).
  static constexpr int kFourBlockStages = cmin(4, (228 * 1024 / 4 - 1024) / kStageBytes);
  static constexpr int kStages =
      JAXATTN_DECODE_MMA_STAGES > 0 ? JAXATTN_DECODE_MMA_STAGES
      : kFourBlockStages >= 3       ? kFourBlockStages
                                    : cmin(4, cmax(2, JAXATTN_DECODE_MMA_SMEM_KB * 1024 / kStageBytes));
  static_assert(kStages >= 2, "the ring needs two stages");
  static constexpr int kMergeBytes = kWarps * kHeads * (D + 2) * int(sizeof(float));
  static constexpr int kSmemBytes = cmax(kStages * kStageBytes, kMergeBytes);
  // Blocks an SM that shared memory allows, 2 to 4 (two at head_dim 128: saying so keeps
  // ptxas from capping registers at 128, which spilled on sm_80).
  static constexpr int kMinBlocks = decode_min_blocks(kSmemBytes);
  // Where the loop reads the block-table entries of tile n + stages, whose row offsets it stores
  // after tile n's compute: in that iteration (false), or a whole iteration earlier (true), so
  // the read is in flight across tile n's copy wait and barrier. At head_dim 64 ptxas reuses
  // the read's scoreboard inside the products (sm_90, nvcc 13.0), so a read in the same
  // iteration made every tile's compute wait for it (ffi/NOTES.md, round 47): early, on an
  // H100, 64 x 512 ran 1-4% faster through the library, one pass over 8 x 4096 28% faster.
  // At 32, 128 and 256 that read is waited for after the products already, and reading it
  // early at 128 cost 0.8% (round 48).
  static constexpr bool kPageLead = D == 64;
};

// Block timelines of the tensor-core kernels, for the decode self-test's --trace (compile
// with -DJAXATTN_DECODE_TRACE; never in the library): thread 0 of each block stamps the global
// timer at its start (0), after the prologue's copies (2; stamp 1, the length read, went with
// the kernels' shared start, decode_ring_start), after q (3, the FP8 kernel), at the top of
// tiles 0..7 (4..11), after the loop (12) and after its writes (13); slot 15 keeps its SM.
// The TMA kernels stamp the same slots (2: thread 0's first boxes issued; tile n: its stage
// landed). ffi/NOTES.md, rounds 15, 21 and 59, reads them (ffi/tests_gpu/decode_trace.py).
#ifdef JAXATTN_DECODE_TRACE
__device__ unsigned long long* g_decode_trace;
__device__ __forceinline__ void decode_trace(int i) {
  if (threadIdx.x == 0 && g_decode_trace) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    const int blk = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    g_decode_trace[blk * 16 + i] = t;
    if (i == 0) {
      unsigned sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      g_decode_trace[blk * 16 + 15] = sm;
    }
  }
}
#define JAXATTN_TRACE(i) decode_trace(i)
#else
#define JAXATTN_TRACE(i)
#endif

// A tensor-core decode warp's states for the shared merge (paged decode, its FP8 kernel,
// cascade's own blocks): accumulator j's elements 0 and 1 (heads 2 tq and 2 tq + 1) at dim
// dim_of(j, g), elements 2 and 3 at that dim + STEP, then head g's max and sum (l, summed over
// the quad), at red + (warp * H + head) * (D + 2).
template <int D, int H, int STEP, int N, typename DimOf>
__device__ __forceinline__ void mma_warp_states(float* red, const float (&o)[N][4], float m,
                                                float l, DimOf dim_of) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    float* r0 = red + (warp * H + 2 * tq) * (D + 2) + dim_of(j, g);
    float* r1 = r0 + (D + 2);
    r0[0] = o[j][0];
    r1[0] = o[j][1];
    r0[STEP] = o[j][2];
    r1[STEP] = o[j][3];
  }
  if (tq == 0) {
    red[(warp * H + g) * (D + 2) + D] = m;
    red[(warp * H + g) * (D + 2) + D + 1] = l;
  }
}
// The 16-bit kernels' dims: accumulator j holds dims 16 j + g and 16 j + g + 8.
struct MmaDims16 {
  __device__ __forceinline__ int operator()(int j, int g) const { return j * 16 + g; }
};

// The state a warp of a tensor-core decode kernel (shape S: the 16-bit or the FP8 one) leaves
// for KV head kvh's merge (its o fragments at dim_of / STEP as mma_warp_states, head g's
// running max and this lane's share of the sum), merged across the warps through `red` and
// written. `red` may lie over ring rows the warps have just read: the barrier that ORs `bad`
// comes before any write to it.
template <typename T, typename S, int D, int STEP, int N, typename DimOf>
__device__ __forceinline__ void mma_decode_finish(const DecodeParams& p, float* red,
                                                  const float (&o)[N][4], float m, float l,
                                                  bool bad, int b, int kvh, int h0, int hn,
                                                  DimOf dim_of) {
  constexpr int H = S::kHeads;
  l = group_sum<4>(l);
  const bool poisoned = __syncthreads_or(bad);
  mma_warp_states<D, H, STEP>(red, o, m, l, dim_of);
  __syncthreads();
  merge_warps_and_write<T, D, 1, H, S::kWarps, S::kThreads>(p, red, b, h0, hn, poisoned,
                                                            p.scales.v_of(kvh));
}

// The online softmax step of a tensor-core decode tile's logits S (sc, the m16n8 accumulators
// of tokens t0 .. t0 + 15, row g = head g; rows 8..15 are padding; keys at or past `end`
// masked): head g's running max m and this lane's share of the sum l updated, pr = its
// probabilities (tokens t0 + 8 h + 2 tq + e), a_lo / a_hi the rescale factors of this lane's
// output columns (heads 2 tq and 2 tq + 1, whose factors live on lanes 4 (2 tq) and
// 4 (2 tq + 1)). Returns whether any factor of the warp is not 1 (see scale_c_rows).
__device__ __forceinline__ bool mma_decode_softmax(const float (&sc)[2][4], float q_scale,
                                                   float cap_log2e, int t0, int end, float& m,
                                                   float& l, float (&pr)[2][2], float& a_lo,
                                                   float& a_hi) {
  constexpr float kNegInf = -__builtin_huge_valf();
  const int tq = threadIdx.x % 4;
  float mx = mma_decode_logits(sc, q_scale, cap_log2e, t0, tq, end, pr);
  mx = group_max<4>(mx);
  const float m_new = fmaxf(m, mx);
  const float m_use = m_new == kNegInf ? 0.f : m_new;
  const float alpha = fast_exp2(m - m_use);
  float sum = 0.f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      pr[h][e] = fast_exp2(pr[h][e] - m_use);
      sum += pr[h][e];
    }
  }
  l = l * alpha + sum;
  m = m_new;
  a_lo = shfl(alpha, 8 * tq);
  a_hi = shfl(alpha, 8 * tq + 4);
  return __any_sync(0xffffffffu, alpha != 1.f);
}

// The A operand of the 16-bit tensor-core decode's QK^T (lane = 4 g + tq): row g = query head
// h0 + g at batch row b (rows g >= hn and rows 8..15 zero), unscaled (16-bit, exact); the scale
// is applied to S in f32. Shared by paged_decode_mma_kernel and cascade's own blocks (h0 is
// 64-bit so that their q address is the 64-bit sum it was before the head slices).
template <typename T, int D>
__device__ __forceinline__ void mma_decode_q(const void* q, int num_q_heads, int b, int64_t h0,
                                             int hn, int g, int tq, uint32_t (&qa)[D / 16][2]) {
  const bool head_ok = g < hn;
  const T* qp = static_cast<const T*>(q) + (int64_t(b) * num_q_heads + h0 + (head_ok ? g : 0)) * D;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    qa[kk][0] = head_ok ? *reinterpret_cast<const uint32_t*>(qp + kk * 16 + 2 * tq) : 0u;
    qa[kk][1] = head_ok ? *reinterpret_cast<const uint32_t*>(qp + kk * 16 + 8 + 2 * tq) : 0u;
  }
}

// One warp's 16 keys of a 16-bit tensor-core decode tile (t0: its first token; keys at or past
// `end` masked): S = Q K^T from the K rows, the online softmax of head g's row (running max m,
// this lane's share of the sum l) and O^T += V^T P^T from the V rows. kaddr(kk) / vaddr(kk):
// this lane's ldmatrix address of 16-element column block kk of the warp's 16 K / V rows (see
// the fragment layouts below), whatever the ring's row layout.
template <typename T, int D, typename KAddr, typename VAddr>
__device__ __forceinline__ void mma_decode_tile_at(const uint32_t (&qa)[D / 16][2], KAddr kaddr,
                                                   VAddr vaddr, float q_scale, float cap_log2e,
                                                   int t0, int end, float (&o)[D / 16][4], float& m,
                                                   float& l) {
  constexpr int KD = D / 16;
  float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int kk = 0; kk < KD; ++kk) {
    uint32_t kf[4];
    ldmatrix_x4(kf, kaddr(kk));
    mma16816<T>(sc[0], qa[kk][0], 0u, qa[kk][1], 0u, kf[0], kf[1]);  // tokens 0..7
    mma16816<T>(sc[1], qa[kk][0], 0u, qa[kk][1], 0u, kf[2], kf[3]);  // tokens 8..15
  }
  float pr[2][2], a_lo, a_hi;
  const bool rescale = mma_decode_softmax(sc, q_scale, cap_log2e, t0, end, m, l, pr, a_lo, a_hi);
  const uint32_t pb0 = pack2<T>(pr[0][0], pr[0][1]);
  const uint32_t pb1 = pack2<T>(pr[1][0], pr[1][1]);
#pragma unroll
  for (int j = 0; j < KD; ++j) {
    if (rescale) scale_c_cols(o[j], a_lo, a_hi);
    uint32_t vf[4];
    ldmatrix_x4_trans(vf, vaddr(j));
    mma16816<T>(o[j], vf[0], vf[1], vf[2], vf[3], pb0, pb1);
  }
}

// mma_decode_tile_at on padded rows: K and V rows at shared addresses kaddr / vaddr (this
// lane's ldmatrix address of column block 0), column block kk 32 bytes further. Shared by
// paged_decode_mma_kernel and cascade's own blocks.
template <typename T, int D>
__device__ __forceinline__ void mma_decode_tile(const uint32_t (&qa)[D / 16][2], uint32_t kaddr,
                                                uint32_t vaddr, float q_scale, float cap_log2e,
                                                int t0, int end, float (&o)[D / 16][4], float& m,
                                                float& l) {
  mma_decode_tile_at<T, D>(
      qa, [kaddr](int kk) { return kaddr + uint32_t(kk * 32); },
      [vaddr](int kk) { return vaddr + uint32_t(kk * 32); }, q_scale, cap_log2e, t0, end, o, m, l);
}

// Fragment layouts (PTX, m16n8k16; lane = 4 g + t): A registers hold (row g, cols 2t, 2t+1),
// (row g+8, same cols), (row g, cols 2t+8, 2t+9), (row g+8, those); B registers hold (rows 2t,
// 2t+1, col g) and (rows 2t+8, 2t+9, col g); C holds (row g, cols 2t, 2t+1) then (row g+8,
// cols 2t, 2t+1).
//   S[16 x 8 tokens] = Q[16 x D] K^T: A = q (row g = query head g; rows 8..15 zero), B = K rows
//     (ldmatrix of 8 token rows x 8 dims: lane gets K[token g][dims 2t, 2t+1] = B(k, n=g)).
//   O^T[16 dims x 8 heads] += V^T[16 dims x 16 tokens] P^T[16 tokens x 8 heads]: A = V^T
//     (ldmatrix.trans of 8 token rows x 8 dims: lane gets V[tokens 2t, 2t+1][dim g]), B = P^T:
//     (rows = tokens 2t, 2t+1, col = head g) is what S's C fragment holds, (head g, tokens 2t,
//     2t+1), packed to 16 bits.
template <typename T, int D>
__global__ void __launch_bounds__(MmaDecodeShape<T, D>::kThreads, MmaDecodeShape<T, D>::kMinBlocks)
    paged_decode_mma_kernel(const DecodeParams p) {
#if __CUDA_ARCH__ >= 800
  using S = MmaDecodeShape<T, D>;
  constexpr int TILE = S::kTile, NS = S::kStages, RS = S::kRowStride, KD = D / 16;
  constexpr float kNegInf = -__builtin_huge_valf();
  extern __shared__ __align__(16) unsigned char smem[];
  JAXATTN_TRACE(0);
  pdl_wait();  // launched dependent on the kernel before it: nothing is read before it ends

  const MmaHeads hs = mma_block_heads(p);
  const int kvh = hs.kvh, b = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;
  using Ring = KvRing<T, D, TILE, NS, RS, S::kThreads>;
  const int32_t* table = p.block_tables + int64_t(b) * p.block_table_stride;

  // What needs no sequence length is loaded beside it, not after: q and the pages of the first
  // tiles (at batch 1 the q loads used to queue behind the first tiles' copies, ~3 us).
  // Q as the A operand, unscaled (16-bit, exact); the scale (with the KV head's key scale) is
  // applied to S in f32.
  const float q_scale = p.ls.q_scale * p.scales.k_of(kvh);
  uint32_t qa[KD][2];
  mma_decode_q<T, D>(p.q, p.num_q_heads, b, hs.h0, hs.hn, g, tq, qa);
  int pages[NS];
  Ring::early_pages(table, p.block_table_stride, p.kv.page_size, decode_block_start(p), pages);
  Ring ring;
  bool bad;  // this thread met a page id outside the cache
  if (!decode_ring_start<T>(p, kvh, hs.h0, hs.hn, table, smem, pages, ring, bad)) return;
  const int start = ring.start, end = ring.end, ntiles = ring.tiles();
  JAXATTN_TRACE(2);

  float o[KD][4];
#pragma unroll
  for (int j = 0; j < KD; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m = kNegInf, l = 0.f;  // head g: running max, this lane's share of the sum

  // ldmatrix lane address within a 16-row slice: rows (lane % 8) + 8 (lane / 16), 16-byte
  // vector (lane / 8) % 2 of each 32-byte (16-element) column block.
  const int rb = warp * 16;
  const uint32_t lane_off =
      uint32_t(((rb + lane % 8 + (lane / 16) * 8) * RS + ((lane / 8) % 2) * 8) * 2);

  // The page of tile n + NS, stored after tile n's compute: read in the same iteration, or
  // (S::kPageLead) a whole iteration earlier, after tile n - 1's store.
  int page = S::kPageLead ? ring.page_of(NS) : 0;
  for (int n = 0; n < ntiles; ++n) {
    async_copy_wait<NS - 2>();  // this thread's copies of tile n have landed
    __syncthreads();            // everyone's have, and stage (n - 1) % NS is free
    if (n < 8) JAXATTN_TRACE(4 + n);
    if (n + NS - 1 < ntiles) ring.issue(n + NS - 1);
    async_copy_commit();
    if constexpr (!S::kPageLead) page = ring.page_of(n + NS);  // used after the compute

    const int s = n % NS;
    const int t0 = start + n * TILE + rb;  // this warp's first token
    if (t0 < end) {                        // warp-uniform
      mma_decode_tile<T, D>(qa, smem_u32(ring.k_rows(s)) + lane_off,
                            smem_u32(ring.v_rows(s)) + lane_off, q_scale, p.ls.cap_log2e, t0, end,
                            o, m, l);
    }
    bad |= ring.store_offset(n + NS, page);  // stage n % NS's offsets were used at issue(n)
    if constexpr (S::kPageLead) page = ring.page_of(n + NS + 1);
  }
  async_copy_wait<0>();
  JAXATTN_TRACE(12);
  // Per-warp states to shared memory (over the ring), then the fixed-order merge.
  mma_decode_finish<T, S, D, 8>(p, reinterpret_cast<float*>(smem), o, m, l, bad, b, kvh, hs.h0,
                                hs.hn, MmaDims16{});
  JAXATTN_TRACE(13);
#endif
}

// The tensor-core kernel over an FP8 cache (q bf16 or f16). The ring holds the FP8 rows as
// stored (half the bytes of a 16-bit tile: at three stages four blocks fit an SM), and the
// fragments are widened to float16 in registers: every FP8 value is exact there, and float16
// costs one byte permute per pair from e5m2 (a cvt from e4m3) where bfloat16 would need a
// rebias and a NaN patch per pair. A bf16 q is moved into float16's range by a power of two per
// head (the largest |q| of the head lands in [2^14, 2^15); only elements below 2^-24 of it
// lose bits), undone in the f32 logit factor; P is packed to float16 (10 mantissa bits against
// bfloat16's 7).
//
// Fragments. An FP8 pair is no b16 element, so the 16-bit kernel's ldmatrix layouts cannot
// be used as they are; both products instead permute their contraction axis, which a sum does
// not see:
//   S = Q K^T: ldmatrix (b16) of 8 token rows x 16 bytes gives lane (g, t) the 4 codes of
//     token g at dims 4t .. 4t + 3 of a 16-dim block, widened to B registers b0 = dims
//     (4t, 4t+1), b1 = (4t+2, 4t+3): k slots (2t, 2t+1, 2t+8, 2t+9) hold those dims, so
//     the A operand takes q[head g][4t .. 4t+3] of the block the same way.
//   O^T += V^T P^T: the contraction is over tokens, and P^T's k slots are tokens 2t, 2t+1,
//     2t+8, 2t+9 of the slice (S's C fragment). Lane (g, t) loads 4 codes (dims 4g .. 4g+3 of
//     a 32-dim group J) from each of those four token rows and byte-permutes pairs of tokens
//     together: per dim a (token 2t, token 2t+1) pair is one A register. The four dims become
//     the rows g and g+8 of two m16 blocks, 2J and 2J+1: row g of block 2J + s is dim
//     32J + 4g + 2s, row g+8 the next dim; the merge writes each accumulator to its dim.
template <typename C, int D>
struct MmaFp8DecodeShape {
  static_assert(sizeof(C) == 1 && D % 32 == 0, "FP8 elements, head_dim a multiple of 32");
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kHeads = kMmaDecodeHeads;
  static constexpr int kTile = 16 * kWarps;
  static constexpr int kRowStride = D + 16;  // bytes: 16 of padding, rows stay 16-byte aligned
  static constexpr int kStageBytes = kTile * 8 + 2 * kTile * kRowStride;
  static constexpr int kStages = JAXATTN_DECODE_FP8_STAGES;
  static_assert(kStages >= 2, "the ring needs two stages");
  static constexpr int kMergeBytes = kWarps * kHeads * (D + 2) * int(sizeof(float));
  static constexpr int kSmemBytes = cmax(kStages * kStageBytes, kMergeBytes);
  // Blocks an SM that shared memory allows (228 KiB an SM, 1 KiB reserved a block), 2 to 4;
  // __launch_bounds__ then keeps the registers within that many blocks.
  static constexpr int kMinBlocks = decode_min_blocks(kSmemBytes);
};

// Head dim of row r (0..15) of m16 block j of the FP8 kernel's O^T (see above).
__device__ __forceinline__ int fp8_out_dim(int j, int r) {
  return 32 * (j / 2) + 4 * (r % 8) + 2 * (j % 2) + r / 8;
}

// q of the FP8 tensor-core decode (lane = 4 g + tq): this lane's 16-bit words of query head
// h0 + g's dims 16 kk + 4 tq .. + 3 (zero for heads past the block's), loaded beside the length.
template <typename T, int D>
__device__ __forceinline__ void fp8_decode_q_load(const DecodeParams& p, int b, const MmaHeads& hs,
                                                  int g, int tq, uint2 (&qw)[D / 16]) {
  const bool head_ok = g < hs.hn;
  const T* qp =
      static_cast<const T*>(p.q) + (int64_t(b) * p.num_q_heads + hs.h0 + (head_ok ? g : 0)) * D;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    qw[kk] = head_ok ? *reinterpret_cast<const uint2*>(qp + kk * 16 + 4 * tq) : make_uint2(0u, 0u);
}

// Q as float16 A fragments: qa[kk] = q[head g][16 kk + 4t .. 16 kk + 4t + 3] (rows 8..15 are
// zero), times pre (a bf16 q: the head's largest |q| into [2^14, 2^15)); returns post = 1 / pre,
// which the logit factor takes.
template <typename T, int D>
__device__ __forceinline__ float fp8_decode_q(const uint2 (&qw)[D / 16],
                                              uint32_t (&qa)[D / 16][2]) {
  constexpr int KD = D / 16;
  float post = 1.f;
  float qf[KD][4];
  float qmax = 0.f;
#pragma unroll
  for (int kk = 0; kk < KD; ++kk) {
    const uint32_t w[2] = {qw[kk].x, qw[kk].y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint16_t h = uint16_t(w[i / 2] >> (16 * (i % 2)));
      qf[kk][i] = std::is_same_v<T, bf16_t> ? bf16_to_float(h) : f16_to_float(h);
      qmax = fmaxf(qmax, fabsf(qf[kk][i]));  // fmaxf skips NaN: a NaN q stays NaN below
    }
  }
  float pre = 1.f;
  if constexpr (std::is_same_v<T, bf16_t>) {
    qmax = group_max<4>(qmax);
    // 2^(141 - e) for qmax = 1.x * 2^(e - 127): the head's largest |q| into [2^14, 2^15).
    const int e = int((__float_as_uint(qmax) >> 23) & 0xffu);
    const int biased = min(max(268 - e, 1), 253);
    pre = __uint_as_float(uint32_t(biased) << 23);
    post = __uint_as_float(uint32_t(254 - biased) << 23);
  }
#pragma unroll
  for (int kk = 0; kk < KD; ++kk) {
    qa[kk][0] = pack2<f16_t>(qf[kk][0] * pre, qf[kk][1] * pre);
    qa[kk][1] = pack2<f16_t>(qf[kk][2] * pre, qf[kk][3] * pre);
  }
  return post;
}

// One warp's 16 keys of an FP8 tensor-core decode tile (t0: its first token; keys at or past
// `end` masked), the fragments of the comment above: S = Q K^T from K by ldmatrix at kaddr(k2)
// (this lane's address of 32-dim block k2), the online softmax, O^T += V^T P^T from V's
// 4-byte words vword(i, jj): bytes 4g .. 4g + 3 of 32-dim group jj of the warp's token rows
// 2t, 2t + 1, 2t + 8, 2t + 9 for i = 0..3, whatever the ring's row layout.
template <typename C, int D, typename KAddr, typename VWord>
__device__ __forceinline__ void mma_fp8_decode_tile_at(const uint32_t (&qa)[D / 16][2], KAddr kaddr,
                                                       VWord vword, float q_scale, float cap_log2e,
                                                       int t0, int end, float (&o)[D / 16][4],
                                                       float& m, float& l) {
  float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int k2 = 0; k2 < D / 32; ++k2) {
    uint32_t kf[4];
    ldmatrix_x4(kf, kaddr(k2));  // (tokens 0-7 | 8-15) x (dims 32 k2 + 0-15 | 16-31)
    uint32_t kb[4][2];
#pragma unroll
    for (int i = 0; i < 4; ++i) fp8x4_to_f16x2<C>(kf[i], kb[i][0], kb[i][1]);
    const uint32_t* q0 = qa[2 * k2];
    const uint32_t* q1 = qa[2 * k2 + 1];
    mma16816<f16_t>(sc[0], q0[0], 0u, q0[1], 0u, kb[0][0], kb[0][1]);  // tokens 0..7
    mma16816<f16_t>(sc[0], q1[0], 0u, q1[1], 0u, kb[1][0], kb[1][1]);
    mma16816<f16_t>(sc[1], q0[0], 0u, q0[1], 0u, kb[2][0], kb[2][1]);  // tokens 8..15
    mma16816<f16_t>(sc[1], q1[0], 0u, q1[1], 0u, kb[3][0], kb[3][1]);
  }
  float pr[2][2], a_lo, a_hi;
  const bool rescale = mma_decode_softmax(sc, q_scale, cap_log2e, t0, end, m, l, pr, a_lo, a_hi);
  const uint32_t pb0 = pack2<f16_t>(pr[0][0], pr[0][1]);
  const uint32_t pb1 = pack2<f16_t>(pr[1][0], pr[1][1]);
#pragma unroll
  for (int jj = 0; jj < D / 32; ++jj) {
    const uint32_t r0 = vword(0, jj);  // token 2t
    const uint32_t r1 = vword(1, jj);  // 2t + 1
    const uint32_t r2 = vword(2, jj);  // 2t + 8
    const uint32_t r3 = vword(3, jj);  // 2t + 9
    // Per dim, the token pair: (dims 0, 1 of the four) and (dims 2, 3).
    uint32_t a[2][4];
    fp8x4_to_f16x2<C>(byte_perm(r0, r1, 0x5140u), a[0][0], a[0][1]);
    fp8x4_to_f16x2<C>(byte_perm(r2, r3, 0x5140u), a[0][2], a[0][3]);
    fp8x4_to_f16x2<C>(byte_perm(r0, r1, 0x7362u), a[1][0], a[1][1]);
    fp8x4_to_f16x2<C>(byte_perm(r2, r3, 0x7362u), a[1][2], a[1][3]);
#pragma unroll
    for (int s2 = 0; s2 < 2; ++s2) {
      float (&oj)[4] = o[2 * jj + s2];
      if (rescale) scale_c_cols(oj, a_lo, a_hi);
      mma16816<f16_t>(oj, a[s2][0], a[s2][1], a[s2][2], a[s2][3], pb0, pb1);
    }
  }
}

template <typename T, typename C, int D>
__global__ void __launch_bounds__(MmaFp8DecodeShape<C, D>::kThreads,
                                  MmaFp8DecodeShape<C, D>::kMinBlocks)
    paged_decode_mma_fp8_kernel(const DecodeParams p) {
#if __CUDA_ARCH__ >= 800
  using S = MmaFp8DecodeShape<C, D>;
  constexpr int TILE = S::kTile, NS = S::kStages, RS = S::kRowStride, KD = D / 16;
  constexpr float kNegInf = -__builtin_huge_valf();
  extern __shared__ __align__(16) unsigned char smem[];

  const MmaHeads hs = mma_block_heads(p);
  const int kvh = hs.kvh, b = blockIdx.y;
  JAXATTN_TRACE(0);
  pdl_wait();  // launched dependent on the kernel before it: nothing is read before it ends
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;
  using Ring = KvRing<C, D, TILE, NS, RS, S::kThreads>;
  const int32_t* table = p.block_tables + int64_t(b) * p.block_table_stride;

  // What needs no sequence length is loaded beside it, not after: q (its 16-bit words) and the
  // pages of the first tiles (at batch 1 the q loads used to queue behind the first tiles'
  // copies, ~3 us of the block's start).
  uint2 qw[KD];
  fp8_decode_q_load<T, D>(p, b, hs, g, tq, qw);
  int pages[NS];
  Ring::early_pages(table, p.block_table_stride, p.kv.page_size, decode_block_start(p), pages);
  Ring ring;
  bool bad;  // this thread met a page id outside the cache
  if (!decode_ring_start<T>(p, kvh, hs.h0, hs.hn, table, smem, pages, ring, bad)) return;
  JAXATTN_TRACE(2);
  const int start = ring.start, end = ring.end, ntiles = ring.tiles();

  uint32_t qa[KD][2];
  const float q_scale = p.ls.q_scale * p.scales.k_of(kvh) * fp8_decode_q<T, D>(qw, qa);
  JAXATTN_TRACE(3);

  float o[KD][4];
#pragma unroll
  for (int j = 0; j < KD; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m = kNegInf, l = 0.f;  // head g: running max, this lane's share of the sum

  // K: ldmatrix rows (lane % 8) + 8 (lane / 16) of the warp's 16-token slice, 16-byte half
  // (lane / 8) % 2 of each 32-byte (32-dim) block. V: this lane's rows 2t, 2t+1, 2t+8, 2t+9 of
  // the slice, bytes 4g .. 4g+3 of each 32-dim group.
  const int rb = warp * 16;
  const uint32_t k_off = uint32_t((rb + lane % 8 + (lane / 16) * 8) * RS + ((lane / 8) % 2) * 16);
  const int v_off = (rb + 2 * tq) * RS + 4 * g;

  for (int n = 0; n < ntiles; ++n) {
    async_copy_wait<NS - 2>();  // this thread's copies of tile n have landed
    __syncthreads();            // everyone's have, and stage (n - 1) % NS is free
    if (n < 8) JAXATTN_TRACE(4 + n);
    if (n + NS - 1 < ntiles) ring.issue(n + NS - 1);
    async_copy_commit();
    const int page = ring.page_of(n + NS);  // consumed after this tile's compute

    const int s = n % NS;
    const int t0 = start + n * TILE + rb;  // this warp's first token
    if (t0 < end) {                        // warp-uniform
      const uint32_t kaddr = smem_u32(ring.k_rows(s)) + k_off;
      mma_fp8_decode_tile_at<C, D>(
          qa, [kaddr](int k2) { return kaddr + uint32_t(k2 * 32); },
          [&](int i, int jj) {
            const unsigned char* vp =
                reinterpret_cast<const unsigned char*>(ring.v_rows(s)) + v_off + jj * 32;
            return *reinterpret_cast<const uint32_t*>(vp + (i == 0   ? 0
                                                            : i == 1 ? RS
                                                            : i == 2 ? 8 * RS
                                                                     : 9 * RS));
          },
          q_scale, p.ls.cap_log2e, t0, end, o, m, l);
    }
    bad |= ring.store_offset(n + NS, page);  // stage n % NS's offsets were used at issue(n)
  }
  async_copy_wait<0>();
  JAXATTN_TRACE(12);
  // Per-warp states to shared memory (over the ring), each accumulator at its dim (row g + 8
  // of accumulator j: the dim after row g's), then the fixed-order merge.
  mma_decode_finish<T, S, D, 1>(p, reinterpret_cast<float*>(smem), o, m, l, bad, b, kvh, hs.h0,
                                hs.hn, [](int j, int gg) { return fp8_out_dim(j, gg); });
  JAXATTN_TRACE(13);
#endif
}

#endif  // JAXATTN_CUDA

// ------------------------------------------------------------------------------------------
// Split-KV combine and launchers.
// ------------------------------------------------------------------------------------------

// Exact merge of the partitions of one (sequence, query head), in one pass over the
// workspace: warp w takes partitions w, w + 8, ... in batches of kBatch, issues every load of
// a batch before it uses one (the (max, sum) pairs and kPerLane output elements a lane each:
// one memory latency a batch, where a maximum pass before the sums cost two dependent rounds
// more), and folds the batch into its running state by the batch maximum; then the warps'
// states merge in a fixed order. A poisoned partition (NaN max and sum) has a NaN weight, so
// the row is NaN (fmaxf skips the NaN max, the weight l * 2^(m - M) keeps it); an empty one
// (-inf, 0) weighs 0. A length that does not fit the block table gives a NaN row without
// reading the workspace (its partitions wrote nothing).
template <typename T, int D>
__global__ void __launch_bounds__(256) decode_combine_kernel(const DecodeParams p) {
  constexpr int kThreads = 256, kWarps = kThreads / WARP_SIZE;
  constexpr int kPerLane = (D + WARP_SIZE - 1) / WARP_SIZE;
  constexpr int kBatch = kPerLane > 4 ? 4 : 8;  // partitions a warp has in flight
  constexpr float kNegInf = -__builtin_huge_valf();
  __shared__ float red_o[kWarps][D];
  __shared__ float red_x[2][kWarps];
  const int h = blockIdx.x, b = blockIdx.y;
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  T* out = static_cast<T*>(p.out) + (int64_t(b) * p.num_q_heads + h) * D;
  // The length is an input of the op, complete before the partitions' kernel started (which
  // launched this one), so its load goes before the wait: one memory latency less after it.
  const int L = p.seq_lens[b];
  pdl_wait();  // the partitions are written (a no-op after an ordinary launch)
  if (!decode_bounds_ok(L, p.block_table_stride, p.kv.page_size, p.kv.num_pages)) {
    for (int d = threadIdx.x; d < D; d += kThreads) out[d] = from_float<T>(quiet_nan());
    return;
  }
  const int nparts = (L + p.partition_size - 1) / p.partition_size;
  const int64_t slot0 = (int64_t(b) * p.num_q_heads + h) * p.max_parts;
  const float* part_out = p.workspace + slot0 * D;
  const float2* ml = reinterpret_cast<const float2*>(
      p.workspace + int64_t(p.batch) * p.num_q_heads * p.max_parts * D + 2 * slot0);

  float m = kNegInf, l = 0.f, o[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) o[k] = 0.f;
  for (int i0 = warp; i0 < nparts; i0 += kWarps * kBatch) {
    float2 x[kBatch];
    float v[kBatch][kPerLane];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = i0 + j * kWarps;
      const bool live = i < nparts;
      x[j] = live ? ml[i] : make_float2(kNegInf, 0.f);
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int d = lane + k * WARP_SIZE;
        v[j][k] = live && (D % WARP_SIZE == 0 || d < D) ? part_out[int64_t(i) * D + d] : 0.f;
      }
    }
    float mb = m;
#pragma unroll
    for (int j = 0; j < kBatch; ++j) mb = fmaxf(mb, x[j].x);
    const float m_use = mb == kNegInf ? 0.f : mb;
    const float a = fast_exp2(m - m_use);  // 0 for the empty start; NaN stays in l and o
    l *= a;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) o[k] *= a;
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const float w = x[j].y * fast_exp2(x[j].x - m_use);
      l += w;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) o[k] = fmaf(w, v[j][k], o[k]);
    }
    m = mb;
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int d = lane + k * WARP_SIZE;
    if (D % WARP_SIZE == 0 || d < D) red_o[warp][d] = o[k];
  }
  if (lane == 0) {
    red_x[0][warp] = m;
    red_x[1][warp] = l;
  }
  __syncthreads();
  float mx = red_x[0][0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) mx = fmaxf(mx, red_x[0][w]);
  const float m_use = mx == kNegInf ? 0.f : mx;
  float sc[kWarps];
#pragma unroll
  for (int w = 0; w < kWarps; ++w) sc[w] = fast_exp2(red_x[0][w] - m_use);
  for (int d = threadIdx.x; d < D; d += kThreads) {
    float od = 0.f, ls = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      od = fmaf(sc[w], red_o[w][d], od);
      ls = fmaf(sc[w], red_x[1][w], ls);
    }
    out[d] = from_float<T>(ls == 0.f ? 0.f : od / ls);
  }
}

// head_chunks: blocks a KV head (mma_head_chunks for the tensor-core kernels, else 1).
inline const char* decode_grid(const DecodeParams& p, dim3* grid, int head_chunks = 1) {
  if (p.batch > 65535 || p.max_parts > 65535) return "jaxattn: batch or partition count over 65535";
  *grid = dim3(p.kv.num_kv_heads * head_chunks, p.batch, p.partition_size > 0 ? p.max_parts : 1);
  return nullptr;
}

// Launches kernel<<<grid, threads, smem, stream>>>(args) dependent on the kernel before it in
// the stream (programmatic dependent launch; the kernel calls pdl_wait before it reads that
// one's results), also while XLA captures the stream into a command buffer (CUDA 12.3+ records
// it as a programmatic edge of the graph). False where it was not launched -- before compute
// capability 9.0, under HIP, with -DJAXATTN_NO_PDL (to time without), or when the runtime
// refused it -- and the caller launches it the ordinary way.
template <typename... Params, typename... Args>
bool launch_dependent(void (*kernel)(Params...), dim3 grid, int threads, int smem,
                      gpuStream_t stream, const Args&... args) {
#if defined(JAXATTN_CUDA) && !defined(JAXATTN_NO_PDL)
  if (current_device_caps().major < 9) return false;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = size_t(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  if (cudaLaunchKernelEx(&cfg, kernel, args...) == cudaSuccess) return true;
  (void)cudaGetLastError();
#else
  (void)kernel, (void)grid, (void)threads, (void)smem, (void)stream, ((void)args, ...);
#endif
  return false;
}

template <typename T, int D>
const char* launch_decode_combine(const DecodeParams& p, gpuStream_t stream) {
  if (p.partition_size == 0) return nullptr;
  const dim3 grid(p.num_q_heads, p.batch);
  if (launch_dependent(decode_combine_kernel<T, D>, grid, 256, 0, stream, p)) return nullptr;
  decode_combine_kernel<T, D><<<grid, 256, 0, stream>>>(p);
  return check_launch();
}

template <typename T, int D, int GT, bool DIRECT = (GT == 1), typename C = T>
const char* launch_paged_decode_group(const DecodeParams& p, gpuStream_t stream) {
  using S = DecodeShape<T, D, GT, DIRECT, C>;
  dim3 grid;
  if (const char* e = decode_grid(p, &grid)) return e;
  paged_decode_kernel<T, D, GT, DIRECT, C><<<grid, S::kThreads, S::kSmemBytes, stream>>>(p);
  if (const char* e = check_launch()) return e;
  return launch_decode_combine<T, D>(p, stream);
}

#if defined(JAXATTN_CUDA)
// Whether `stream` is being captured into a graph (XLA traces a command-buffer custom call
// that way: the call's kernels become a graph of their own, whose first kernel has no kernel
// before it to depend on).
inline bool stream_capturing(gpuStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

// The tensor-core decode kernels: launched dependent on the kernel before them in the stream
// (they pdl_wait before their first load), so that their blocks are resident, and their launch
// paid, while that kernel finishes (the previous call's combine when decode calls follow each
// other: 0.8-1.7 us a call at batch 1-16 on an H200). Not while the stream is captured, where
// the kernel is its graph's first and the attribute costs host time at each trace for nothing.
// `extra`: the kernel's arguments after p (the TMA kernels' tensor maps).
template <typename Kernel, typename... Extra>
const char* launch_decode_main(Kernel kernel, const DecodeParams& p, int threads, int smem,
                               gpuStream_t stream, const Extra&... extra) {
  dim3 grid;
  if (const char* e = decode_grid(p, &grid, mma_head_chunks(p.num_q_heads / p.kv.num_kv_heads)))
    return e;
  if (const char* e = allow_dynamic_smem(kernel, smem)) return e;
  if (!stream_capturing(stream) &&
      launch_dependent(kernel, grid, threads, smem, stream, p, extra...))
    return nullptr;
  kernel<<<grid, threads, smem, stream>>>(p, extra...);
  return check_launch();
}

// ------------------------------------------------------------------------------------------
// The tensor-core decodes with their pages copied by the tensor memory accelerator (sm_90):
// twins of paged_decode_mma_kernel (16-bit caches, head_dim 32 to 128; 256 keeps the gathers)
// and of paged_decode_mma_fp8_kernel (FP8 caches, head_dim 64 to 256: rows of 64 bytes or more;
// 32 keeps the gathers), run where decode_tma_usable holds
// (copies auto, pages of a power of two >= 8 tokens, partitions of whole 64-key tiles). On an
// H100 (ffi/NOTES.md, round 57) the 16-bit one is 3% faster one pass at head_dim 128 (64 x
// 4096, 32 x 4096), level on its split grids and at 256-token contexts, 4-7% faster at head_dim
// 64; the FP8 one 1.6% at 64 x 4096 and 4% at 32 x 4096 and on split grids. The same blocks,
// heads, products, softmax and merges; what differs is the ring: each stage holds a 64-key K
// and V tile as 128-byte-swizzled column blocks (the layout of KvRing's RS = 0 form), filled by
// cp.async.bulk.tensor boxes of one KV head's rows of a page (min(page, 64) rows x 128 bytes)
// that thread 0 issues a stage ahead, each stage completing on its mbarrier by the bytes it
// expects; the block-table entries of a tile reach shared memory by 4-byte cp.async a tile
// before thread 0 reads them.
//   Contract: a page id outside the cache poisons the block (NaN rows) and copies page 0;
// rows past the block's end are copied whole with their page (or not at all) and masked out
// of S, and their V rows are zeroed in shared memory before P V, so NaN there never reaches
// the output.
// ------------------------------------------------------------------------------------------

// The TMA decode kernels' block: 4 warps of 16 keys a 64-key tile, NS stages of a K and a V
// tile of ROW bytes a row, one mbarrier a stage, the page ids of NS tiles; MERGE bytes of the
// closing merge over the ring. A tile is ROW / CB column blocks of [64 rows][CB bytes] with
// the CB-byte swizzle (tma_chunk): CB = 128 for rows of 128 bytes or more, 64 for 64-byte rows
// (head_dim 32 of a 16-bit cache, 64 of an FP8 one). The stages are those of the gathers'
// kernel (GATHERS: its shared-memory bytes), and so is the shared memory's share of the
// occupancy: the occupancy query and the split rule describe the gathers' kernel
// (decode_occupancy_dim), so where this ring's smaller stages would fit more blocks an SM, the
// kernel asks for the gathers' bytes instead. (Registers may still differ: at head_dim 64 the
// FP8 kernel takes 79 to the gathers' 88, six blocks an SM to five.)
constexpr int kTmaDecodeTile = 64;  // keys a tile: 16 a warp
constexpr int decode_smem_as_gathers(int own, int gathers) {
  return decode_blocks_by_smem(own) > decode_blocks_by_smem(gathers) ? gathers : own;
}
template <int ROW, int NS, int MERGE, int GATHERS>
struct TmaDecodeShape {
  static_assert(ROW == 64 || ROW % 128 == 0, "TMA decode: 64-byte rows or 128-byte column blocks");
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kTile = kTmaDecodeTile;
  static_assert(kTile == 16 * kWarps, "16 keys a warp");
  static constexpr int kStages = NS;
  static constexpr int kColBytes = ROW < 128 ? ROW : 128;  // a column block's row, the swizzle
  static constexpr int kBlocks = ROW / kColBytes;
  static constexpr int kBlockBytes = kTile * kColBytes;
  static constexpr int kTileBytes = kTile * ROW;
  static constexpr int kMaxBoxes = kTile / 8;  // pages a tile at the smallest page (8 rows)
  static constexpr int kBarOffset = 2 * kStages * kTileBytes;
  static constexpr int kSlotOffset = kBarOffset + 8 * kStages;
  static constexpr int kUsedBytes = kSlotOffset + 4 * kStages * kMaxBoxes;
  // 1 KiB of slack for the 1024-byte alignment the swizzle needs.
  static constexpr int kOwnBytes = 1024 + cmax(kUsedBytes, MERGE);
  static constexpr int kSmemBytes = decode_smem_as_gathers(kOwnBytes, GATHERS);
  static_assert(decode_blocks_by_smem(kSmemBytes) == decode_blocks_by_smem(GATHERS),
                "the TMA decode fits an SM as often as the gathers' kernel");
  static constexpr int kMinBlocks = decode_min_blocks(kSmemBytes);
};
// The 16-bit kernel's (head_dim 32 to 128) and the FP8 kernel's (64 to 256).
template <typename T, int D>
using Tma16Shape =
    TmaDecodeShape<D * 2, MmaDecodeShape<T, D>::kStages, MmaDecodeShape<T, D>::kMergeBytes,
                   MmaDecodeShape<T, D>::kSmemBytes>;
template <typename C, int D>
using Tma8Shape =
    TmaDecodeShape<D, MmaFp8DecodeShape<C, D>::kStages, MmaFp8DecodeShape<C, D>::kMergeBytes,
                   MmaFp8DecodeShape<C, D>::kSmemBytes>;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void tma_bar_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void tma_bar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void tma_bar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// One box of `map` at coordinates (c0, c1, c2, c3) into shared address dst, completing on bar.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            int c2, int c3, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// The TMA decode block's ring and loop over its tiles (S: a TmaDecodeShape with the output type
// Out; E: the cache's element bytes), for the block's KV head hs.kvh. `prepare()` runs once the
// first copies are in flight (the FP8 kernel's q conversion); `tile(k, v, t0, end)` computes the
// warp's 16 keys from the swizzled K and V tiles at shared addresses k and v (t0: the warp's
// first token, below the block's end). False when the block has nothing to compute
// (decode_range); else true, every tile consumed (the merge may reuse the ring's memory), `bad`
// set where thread 0 met a page id outside the cache.
template <typename S, int E, typename Prepare, typename Tile>
__device__ __forceinline__ bool tma_decode_tiles(const DecodeParams& p, const CUtensorMap& tk,
                                                 const CUtensorMap& tv, const MmaHeads& hs,
                                                 unsigned char* smem, bool& bad, Prepare prepare,
                                                 Tile tile) {
  constexpr int TILE = S::kTile, NS = S::kStages, NB = S::kMaxBoxes, CB = S::kColBytes;
  constexpr int kBoxElems = CB / E;      // elements a column block
  const uint32_t ring = smem_u32(smem);  // stage s: K at ring + s tile, V NS tiles further
  const uint32_t bars = ring + S::kBarOffset;
  int32_t* slots = reinterpret_cast<int32_t*>(smem + S::kSlotOffset);  // [NS][NB] page ids
  const int kvh = hs.kvh, warp = threadIdx.x / 32;
  const int32_t* table = p.block_tables + int64_t(blockIdx.y) * p.block_table_stride;
  const int P = p.kv.page_size, R = P < TILE ? P : TILE;   // rows a box (a power of two >= 8)
  const int page_shift = __ffs(P) - 1, bpt = TILE / R;     // boxes a tile
  const bool bshd = p.kv.head_stride < p.kv.token_stride;  // the maps' dimension order

  // The page ids of tiles 0 .. NS - 1, loaded beside the length (entries past the table's
  // width read its last one; only rows below the length use them).
  const int start0 = decode_block_start(p);
  int early = 0;
  if (int(threadIdx.x) < NS * bpt) {
    const int t = start0 + (int(threadIdx.x) / bpt) * TILE + (int(threadIdx.x) % bpt) * R;
    const int w = p.block_table_stride;
    early = w > 0 ? table[min(unsigned(t >> page_shift), unsigned(w - 1))] : 0;
  }
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < NS; ++s) tma_bar_init(bars + 8 * s);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  DecodeRange range;
  pdl_launch_dependents();
  if (!decode_range<typename S::Out>(p, hs.h0, hs.hn, &range)) return false;
  const int start = range.start, end = range.end;
  const int ntiles = (end - start + TILE - 1) / TILE;
  if (int(threadIdx.x) < NS * bpt)
    slots[(int(threadIdx.x) / bpt) * NB + int(threadIdx.x) % bpt] = early;
  __syncthreads();  // the barriers and the first tiles' page ids

  bad = false;
  // Tile n into stage n % NS (thread 0): the boxes of its rows below `end`, each a page's rows,
  // K and V, every column block; the stage's barrier expects their bytes.
  auto issue = [&](int n) {
    const int s = n % NS, t0 = start + n * TILE;
    const int live = min(bpt, (end - t0 + R - 1) / R);
    const uint32_t bar = bars + 8 * s;
    tma_bar_expect(bar, uint32_t(live * 2 * S::kBlocks * R * CB));
    for (int j = 0; j < live; ++j) {
      const int page = slots[s * NB + j];
      const bool ok = index_ok(page, p.kv.num_pages);
      bad |= !ok;
      const int pg = ok ? page : 0, row = (t0 + j * R) & (P - 1);
      const int c1 = bshd ? kvh : row, c2 = bshd ? row : kvh;
      const uint32_t kd = ring + uint32_t(s * S::kTileBytes + j * R * CB);
      const uint32_t vd = kd + uint32_t(NS * S::kTileBytes);
#pragma unroll
      for (int cb = 0; cb < S::kBlocks; ++cb) {
        tma_load_4d(kd + uint32_t(cb * S::kBlockBytes), &tk, cb * kBoxElems, c1, c2, pg, bar);
        tma_load_4d(vd + uint32_t(cb * S::kBlockBytes), &tv, cb * kBoxElems, c1, c2, pg, bar);
      }
    }
  };
  if (threadIdx.x == 0) {
    for (int n = 0; n < NS - 1 && n < ntiles; ++n) issue(n);
  }
  JAXATTN_TRACE(2);
  prepare();

  for (int n = 0; n < ntiles; ++n) {
    const int s = n % NS, t0 = start + n * TILE;
    tma_bar_wait(bars + 8 * s, uint32_t((n / NS) & 1));  // tile n has landed
    if (n < 8) JAXATTN_TRACE(4 + n);
    if (t0 + TILE > end) {
      // The tile's rows past the end: V zeroed (P is 0 there, and 0 x NaN is not; whole rows,
      // which the swizzle permutes within).
      constexpr int CS = CB == 128 ? 3 : 2;  // log2 of a column block's 16-byte chunks
      const int first = end - t0;
      const uint32_t vs = ring + uint32_t((NS + s) * S::kTileBytes);
      for (int i = int(threadIdx.x); i < (TILE - first) * (S::kBlocks << CS); i += S::kThreads) {
        const int r = first + i / (S::kBlocks << CS), c = i % (S::kBlocks << CS);
        const uint32_t a =
            vs + uint32_t((c >> CS) * S::kBlockBytes + r * CB + (c & ((1 << CS) - 1)) * 16);
        asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(a), "r"(0) : "memory");
      }
      // Generic writes ordered before the tensor copies that refill this stage later.
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }
    async_copy_wait<0>();  // this thread's page-id copies of tile n + NS - 1
    __syncthreads();       // everyone's have landed, the zeros too; stage (n - 1) % NS is free
    if (threadIdx.x == 0 && n + NS - 1 < ntiles) issue(n + NS - 1);
    if (int(threadIdx.x) < bpt && n + NS < ntiles) {
      // Tile n + NS's page ids into the slot tile n's left (thread 0 read them at its issue).
      const int t = start + (n + NS) * TILE + int(threadIdx.x) * R;
      const bool live = t < end;
      async_copy4(slots + s * NB + threadIdx.x, live ? table + (t >> page_shift) : table, live);
      async_copy_commit();
    }
    if (t0 + warp * 16 < end) {  // warp-uniform
      const uint32_t kb = ring + uint32_t(s * S::kTileBytes);
      tile(kb, kb + uint32_t(NS * S::kTileBytes), t0 + warp * 16, end);
    }
  }
  return true;
}

// Where 16-byte chunk c of row r of a CB-byte column block lies in the CB-byte swizzle (the
// tensor maps' CU_TENSOR_MAP_SWIZZLE_128B / _64B): chunk c ^ (r % 8) of 8, c ^ (r / 2 % 4) of 4.
template <int CB>
__device__ __forceinline__ int tma_chunk(int r, int c) {
  static_assert(CB == 128 || CB == 64, "the 128- and 64-byte swizzles");
  return CB == 128 ? (c ^ r) & 7 : (c ^ (r >> 1)) & 3;
}

// This lane's ldmatrix offsets in a swizzled tile of CB-byte column blocks (row r = 16 warp +
// lane % 8 + 8 (lane / 16), 16-byte chunk c = 2 k + (lane / 8) % 2 of a column block, stored at
// tma_chunk<CB>(r, c)): at[k % (CB / 32)] + (k / (CB / 32)) x the tile's column-block bytes for
// 32-byte column k. (r % 8 is lane % 8, so the swizzle's bits come from the lane alone.)
template <int CB = 128>
__device__ __forceinline__ void tma_ldmatrix_offsets(uint32_t (&at)[CB / 32]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int x = lane & 7, h = (lane >> 3) & 1;
  const int r = warp * 16 + x + (lane >> 4) * 8;
  if constexpr (CB == 128) {
    const uint32_t rowoff = uint32_t(r * 128 + (((h ^ x) & 1) << 4));
#pragma unroll
    for (int k4 = 0; k4 < 4; ++k4) at[k4] = rowoff + uint32_t(((k4 ^ (x >> 1)) & 3) << 5);
  } else {
    // chunk (2 k + h) ^ (x / 2 % 4): its low bit h ^ (x / 2), its high bit k ^ (x / 4).
    const uint32_t rowoff = uint32_t(r * 64 + (((h ^ (x >> 1)) & 1) << 4));
#pragma unroll
    for (int k = 0; k < 2; ++k) at[k] = rowoff + uint32_t(((k ^ (x >> 2)) & 1) << 5);
  }
}

// This lane's ldmatrix address of 32-byte column k in a TMA tile of shape S at shared address
// `tile` (the K and V tiles of both TMA kernels): the offsets once, then the column's block.
template <typename S>
struct TmaLdmatrix {
  static constexpr int kCols = S::kColBytes / 32;  // 32-byte columns a column block
  uint32_t at[kCols];
  __device__ __forceinline__ TmaLdmatrix() { tma_ldmatrix_offsets<S::kColBytes>(at); }
  __device__ __forceinline__ uint32_t operator()(uint32_t tile, int k) const {
    return tile + at[k % kCols] + uint32_t((k / kCols) * S::kBlockBytes);
  }
};
#endif

// The block of paged_decode_mma_kernel on the TMA ring (see above). tk / tv: the K and V
// caches as 4-D tensors, dimension 0 head_dim, then the head and in-page token dimensions in
// the order of their strides, then pages (make_decode_tensor_map).
template <typename T, int D>
__global__ void __launch_bounds__(Tma16Shape<T, D>::kThreads, Tma16Shape<T, D>::kMinBlocks)
    paged_decode_tma_kernel(const DecodeParams p, const __grid_constant__ CUtensorMap tk,
                            const __grid_constant__ CUtensorMap tv) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  struct S : Tma16Shape<T, D> {
    using Out = T;
  };
  constexpr int KD = D / 16;
  constexpr float kNegInf = -__builtin_huge_valf();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + smem_pad1024(smem_raw);
  JAXATTN_TRACE(0);
  pdl_wait();  // launched dependent on the kernel before it: nothing is read before it ends

  const MmaHeads hs = mma_block_heads(p);
  const int lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
  // q, loaded beside the length, unscaled (16-bit, exact); the scale goes onto S in f32.
  const float q_scale = p.ls.q_scale * p.scales.k_of(hs.kvh);
  uint32_t qa[KD][2];
  mma_decode_q<T, D>(p.q, p.num_q_heads, blockIdx.y, hs.h0, hs.hn, g, tq, qa);

  float o[KD][4];
#pragma unroll
  for (int j = 0; j < KD; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m = kNegInf, l = 0.f;  // head g: running max, this lane's share of the sum
  const TmaLdmatrix<S> ld;
  bool bad;
  const bool ran = tma_decode_tiles<S, 2>(
      p, tk, tv, hs, smem, bad, [] {},
      [&](uint32_t kb, uint32_t vb, int t0, int end) {
        mma_decode_tile_at<T, D>(
            qa, [&](int kk) { return ld(kb, kk); }, [&](int kk) { return ld(vb, kk); }, q_scale,
            p.ls.cap_log2e, t0, end, o, m, l);
      });
  if (!ran) return;
  JAXATTN_TRACE(12);
  // Per-warp states to shared memory (over the ring, every tile consumed), then the merge.
  mma_decode_finish<T, MmaDecodeShape<T, D>, D, 8>(p, reinterpret_cast<float*>(smem), o, m, l, bad,
                                                   blockIdx.y, hs.kvh, hs.h0, hs.hn, MmaDims16{});
  JAXATTN_TRACE(13);
#else
  (void)p, (void)tk, (void)tv;
#endif
}

// The block of paged_decode_mma_fp8_kernel on the TMA ring (head_dim 64, 128 and 256: a row of
// codes is one 64-byte, one 128-byte or two 128-byte column blocks). K through ldmatrix as the
// 16-bit kernel reads it; V's words (lane = 4 g + tq: rows 2 tq, 2 tq + 1, 2 tq + 8, 2 tq + 9 of
// the warp's slice, bytes 4 g .. 4 g + 3 of 32-byte group jj, i.e. chunk 2 jj + g / 4 of the
// row) at their chunk's swizzled place in its column block (tma_chunk).
template <typename T, typename C, int D>
__global__ void __launch_bounds__(Tma8Shape<C, D>::kThreads, Tma8Shape<C, D>::kMinBlocks)
    paged_decode_tma_fp8_kernel(const DecodeParams p, const __grid_constant__ CUtensorMap tk,
                                const __grid_constant__ CUtensorMap tv) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  struct S : Tma8Shape<C, D> {
    using Out = T;
  };
  constexpr int KD = D / 16;
  constexpr float kNegInf = -__builtin_huge_valf();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + smem_pad1024(smem_raw);
  JAXATTN_TRACE(0);
  pdl_wait();  // launched dependent on the kernel before it: nothing is read before it ends

  const MmaHeads hs = mma_block_heads(p);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
  uint2 qw[KD];
  fp8_decode_q_load<T, D>(p, blockIdx.y, hs, g, tq, qw);  // beside the length
  uint32_t qa[KD][2];
  float q_scale = 0.f;

  float o[KD][4];
#pragma unroll
  for (int j = 0; j < KD; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m = kNegInf, l = 0.f;  // head g: running max, this lane's share of the sum
  constexpr int CB = S::kColBytes, KC = CB / 32;  // 32-byte columns a column block
  const TmaLdmatrix<S> ld;
  // V: the byte offsets of this lane's rows 2 tq (+ 8) and 2 tq + 1 (+ 9), their chunk bits
  // apart (row % 8 is 2 tq and 2 tq + 1 for both of a pair). (With 64-byte rows one load's
  // four rows share half the banks: two-way conflicts. Lanes of odd tq reading their pair the
  // other way round, with swapped byte selectors, removed them and ran 3% slower on an H200,
  // ffi/NOTES.md round 58.)
  const uint32_t v0 = uint32_t((warp * 16 + 2 * tq) * CB + 4 * (g & 3));
  const int gc = g >> 2, x0 = 2 * tq;
  bool bad;
  const bool ran = tma_decode_tiles<S, 1>(
      p, tk, tv, hs, smem, bad,
      [&] { q_scale = p.ls.q_scale * p.scales.k_of(hs.kvh) * fp8_decode_q<T, D>(qw, qa); },
      [&](uint32_t kb, uint32_t vb, int t0, int end) {
        mma_fp8_decode_tile_at<C, D>(
            qa, [&](int k2) { return ld(kb, k2); },
            [&](int i, int jj) {
              const int x = x0 + (i & 1), row = (i & 1) + (i >> 1) * 8;
              // Chunk 2 jj + gc of the row: 2 (jj % KC) + gc of column block jj / KC.
              const uint32_t a = vb + v0 +
                                 uint32_t((jj / KC) * S::kBlockBytes + row * CB +
                                          (tma_chunk<CB>(x, 2 * (jj % KC) + gc) << 4));
              return *reinterpret_cast<const uint32_t*>(smem + (a - smem_u32(smem)));
            },
            q_scale, p.ls.cap_log2e, t0, end, o, m, l);
      });
  if (!ran) return;
  JAXATTN_TRACE(12);
  // Per-warp states to shared memory (over the ring), each accumulator at its dim, then the
  // fixed-order merge.
  mma_decode_finish<T, MmaFp8DecodeShape<C, D>, D, 1>(
      p, reinterpret_cast<float*>(smem), o, m, l, bad, blockIdx.y, hs.kvh, hs.h0, hs.hn,
      [](int j, int gg) { return fp8_out_dim(j, gg); });
  JAXATTN_TRACE(13);
#else
  (void)p, (void)tk, (void)tv;
#endif
}

// Whether the TMA decode serves these parameters: copies kDecodeCopiesAuto, compute capability
// 9.0+, pages of a power of two >= 8 tokens, partitions of whole 64-key tiles, and 16-byte
// strides (the tensor maps' rule); the head_dim and cache type are the caller's.
inline bool decode_tma_usable(const DecodeParams& p, int head_dim, int elem_bytes) {
  const KvGeometry& kv = p.kv;
  const int P = kv.page_size;
  auto aligned = [elem_bytes](int64_t stride) { return stride * elem_bytes % 16 == 0; };
  return p.copies != kDecodeCopiesGathers && current_device_caps().major >= 9 && P >= 8 &&
         (P & (P - 1)) == 0 && p.partition_size % kTmaDecodeTile == 0 && kv.num_pages > 0 &&
         kv.num_kv_heads > 0 && aligned(kv.token_stride) && aligned(kv.head_stride) &&
         aligned(kv.page_stride) && kv.head_dim == head_dim;
}

// cuTensorMapEncodeTiled from the driver the runtime loaded (nullptr when it has none).
using TensorMapEncoder = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                      const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                      const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                      CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline TensorMapEncoder tensor_map_encoder() {
  static const TensorMapEncoder fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                           cudaEnableDefault, &q);
#else
    const cudaError_t e =
        cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault, &q);
#endif
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return TensorMapEncoder(nullptr);
    }
    return reinterpret_cast<TensorMapEncoder>(f);
  }();
  return fn;
}

// A cache `base` (K or V, elements of elem_bytes) as the TMA decode's 4-D tensor: (head_dim,
// then heads and in-page tokens in the order of their strides, pages), boxes of one column
// block (col_bytes: 128, or 64 for 64-byte rows) x 1 head x min(page, tile) tokens, swizzled
// by the column block's width. False where the driver refuses it.
inline bool make_decode_tensor_map(CUtensorMap* map, const void* base, const KvGeometry& kv,
                                   int tile, int elem_bytes, int col_bytes) {
  const TensorMapEncoder encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const bool bshd = kv.head_stride < kv.token_stride;
  const cuuint32_t rows = cuuint32_t(kv.page_size < tile ? kv.page_size : tile);
  const cuuint64_t e = cuuint64_t(elem_bytes);
  const cuuint64_t dims[4] = {
      cuuint64_t(kv.head_dim), cuuint64_t(bshd ? kv.num_kv_heads : kv.page_size),
      cuuint64_t(bshd ? kv.page_size : kv.num_kv_heads), cuuint64_t(kv.num_pages)};
  const cuuint64_t strides[3] = {cuuint64_t(bshd ? kv.head_stride : kv.token_stride) * e,
                                 cuuint64_t(bshd ? kv.token_stride : kv.head_stride) * e,
                                 cuuint64_t(kv.page_stride) * e};
  const cuuint32_t box[4] = {cuuint32_t(col_bytes / elem_bytes), bshd ? 1u : rows, bshd ? rows : 1u,
                             1u};
  const cuuint32_t unit[4] = {1u, 1u, 1u, 1u};
  return encode(
             map, elem_bytes == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_UINT16,
             4, const_cast<void*>(base), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
             col_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A TMA decode kernel's launch (S: its TmaDecodeShape; head_dim D, cache elements of
// elem_bytes), without the combine; nullptr with *launched false where it does not run --
// decode_tma_usable false, no sm_90 machine code in the library (a build for older targets
// alone, run through its PTX, compiles the kernel's body out) or tensor maps the driver
// refuses -- and the caller runs the gathers' kernel instead.
template <int D, typename S, typename Kernel>
const char* launch_decode_tma(Kernel kernel, int elem_bytes, const DecodeParams& p,
                              gpuStream_t stream, bool* launched) {
  *launched = false;
  if (!decode_tma_usable(p, D, elem_bytes)) return nullptr;
  static const bool sm90_code = [&] {
    cudaFuncAttributes a{};
    if (cudaFuncGetAttributes(&a, kernel) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return a.ptxVersion >= 90;
  }();
  if (!sm90_code) return nullptr;
  CUtensorMap tk, tv;
  if (!make_decode_tensor_map(&tk, p.k, p.kv, S::kTile, elem_bytes, S::kColBytes) ||
      !make_decode_tensor_map(&tv, p.v, p.kv, S::kTile, elem_bytes, S::kColBytes))
    return nullptr;
  *launched = true;
  return launch_decode_main(kernel, p, S::kThreads, S::kSmemBytes, stream, tk, tv);
}

template <typename T, int D>
const char* launch_paged_decode_mma(const DecodeParams& p, gpuStream_t stream) {
  using S = MmaDecodeShape<T, D>;
  bool launched = false;
  const char* e = nullptr;
  // head_dim 256 keeps the gathers: one block an SM and two stages of four column blocks, it
  // ran 2-13% slower on TMA (ffi/NOTES.md, round 58).
  if constexpr (D <= 128)
    e = launch_decode_tma<D, Tma16Shape<T, D>>(paged_decode_tma_kernel<T, D>, 2, p, stream,
                                               &launched);
  if (!launched)
    e = launch_decode_main(paged_decode_mma_kernel<T, D>, p, S::kThreads, S::kSmemBytes, stream);
  if (e) return e;
  return launch_decode_combine<T, D>(p, stream);
}

// Where an FP8 cache takes the TMA ring: one-pass grids of at least three blocks an SM over
// tables of 1024 tokens or more. Elsewhere the gathers ran faster on an H200 (ffi/NOTES.md,
// round 58): split grids by 3-30% (1 x 32768 and 8 x 4096 at 32/8, 32/32 at head_dim 128, and
// at 64), smaller one-pass grids by 7-54% (8 x 4096 at 32/32, 16 x 4096 at head_dim 64), 64 x
// 512 at head_dim 64 by 4-10%; the large one-pass grids gained 3-8% there through the library
// and 5-27% on an H100.
inline bool fp8_decode_tma_pays(const DecodeParams& p) {
  dim3 grid;  // the one-pass grid launch_decode_main launches
  if (p.partition_size != 0 ||
      decode_grid(p, &grid, mma_head_chunks(p.num_q_heads / p.kv.num_kv_heads)) != nullptr)
    return false;
  return int64_t(grid.x) * grid.y >= 3 * int64_t(current_device_caps().sms) &&
         int64_t(p.block_table_stride) * p.kv.page_size >= 1024;
}

template <typename T, typename C, int D>
const char* launch_paged_decode_mma_fp8(const DecodeParams& p, gpuStream_t stream) {
  using S = MmaFp8DecodeShape<C, D>;
  bool launched = false;
  const char* e = nullptr;
  if constexpr (D >= 64) {  // rows of 64 bytes or more (32-byte rows keep the gathers)
    if (p.copies == kDecodeCopiesTma || fp8_decode_tma_pays(p))
      e = launch_decode_tma<D, Tma8Shape<C, D>>(paged_decode_tma_fp8_kernel<T, C, D>, 1, p, stream,
                                                &launched);
  }
  if (!launched)
    e = launch_decode_main(paged_decode_mma_fp8_kernel<T, C, D>, p, S::kThreads, S::kSmemBytes,
                           stream);
  if (e) return e;
  return launch_decode_combine<T, D>(p, stream);
}

// Whether the current device runs the tensor-core kernel: mma.sync m16n8k16 bf16/f16 and
// cp.async need compute capability 8.0, and its ring must fit the opt-in shared-memory limit
// (head_dim 128 takes 104 KiB: A100 and H100/H200 yes, 8.6/8.9 parts with 99 KiB no).
inline bool decode_mma_supported(int smem_bytes) {
  const DeviceCaps c = current_device_caps();
  return c.major >= 8 && c.smem_optin >= smem_bytes;
}

template <typename T, typename C, int D>
constexpr int mma_decode_smem_bytes() {
  if constexpr (sizeof(C) == 1) {
    return MmaFp8DecodeShape<C, D>::kSmemBytes;
  } else {
    return MmaDecodeShape<T, D>::kSmemBytes;
  }
}
#endif

// Kernel choice: one query head per KV head -> direct; 2..64 with 16-bit q on NVIDIA sm_80+
// -> tensor cores (the FP8 kernel for an FP8 cache; groups past 8 as several blocks a KV head,
// mma_head_chunks); otherwise (f32 q, HIP, older GPUs) the pipelined SIMT kernel of the
// smallest group template that covers the runtime group (extra heads are masked). An FP8 cache
// under a 16-bit q takes the FP8 tensor-core kernel for one query head per KV head too. On an
// H100 (64 x 4096) the SIMT kernels read at 68% of the read ceiling with an FP8 cache at
// 32/32 heads and at 9-20% at 16 query heads a KV head, either cache. One function, so that
// the launcher and the occupancy query (decode_occupancy_typed) always describe the same
// kernel.
enum class DecodeKernel { kDirect, kMma, kG2, kG4, kG8, kG16, kG32, kG64, kNone };

template <typename T, typename C, int D>
DecodeKernel pick_decode_kernel(int group) {
#if defined(JAXATTN_CUDA)
  if constexpr (sizeof(T) == 2) {
    if ((group > 1 || (group == 1 && sizeof(C) == 1)) && group <= 64 &&
        decode_mma_supported(mma_decode_smem_bytes<T, C, D>()))
      return DecodeKernel::kMma;
  }
#endif
  if (group <= 1) return DecodeKernel::kDirect;
  if (group <= 2) return DecodeKernel::kG2;
  if (group <= 4) return DecodeKernel::kG4;
  if (group <= 8) return DecodeKernel::kG8;
  if (group <= 16) return DecodeKernel::kG16;
  if (group <= 32) return DecodeKernel::kG32;
  if (group <= 64) return DecodeKernel::kG64;
  return DecodeKernel::kNone;
}

// The decode launcher's and its queries' errors.
inline constexpr const char* kDecodeHeadDims =
    "jaxattn: GPU paged decode is built for head_dim 32, 64, 128 and 256";
inline constexpr const char* kDecodeGroupTooLarge =
    "jaxattn: paged decode serves at most 64 query heads per KV head";

template <typename T, typename C, int D>
const char* launch_paged_decode_dim(const DecodeParams& p, gpuStream_t stream) {
  switch (pick_decode_kernel<T, C, D>(p.num_q_heads / p.kv.num_kv_heads)) {
    case DecodeKernel::kDirect:
      return launch_paged_decode_group<T, D, 1, true, C>(p, stream);
#if defined(JAXATTN_CUDA)
    case DecodeKernel::kMma:
      if constexpr (sizeof(C) == 1) {
        return launch_paged_decode_mma_fp8<T, C, D>(p, stream);
      } else if constexpr (sizeof(T) == 2) {
        return launch_paged_decode_mma<T, D>(p, stream);
      }
      break;
#endif
    case DecodeKernel::kG2:
      return launch_paged_decode_group<T, D, 2, false, C>(p, stream);
    case DecodeKernel::kG4:
      return launch_paged_decode_group<T, D, 4, false, C>(p, stream);
    case DecodeKernel::kG8:
      return launch_paged_decode_group<T, D, 8, false, C>(p, stream);
    case DecodeKernel::kG16:
      return launch_paged_decode_group<T, D, 16, false, C>(p, stream);
    case DecodeKernel::kG32:
      return launch_paged_decode_group<T, D, 32, false, C>(p, stream);
    case DecodeKernel::kG64:
      return launch_paged_decode_group<T, D, 64, false, C>(p, stream);
    default:
      break;
  }
  return kDecodeGroupTooLarge;
}

// Resident blocks per multiprocessor of `kernel` launched with `threads` and `smem` bytes of
// dynamic shared memory, on the current device.
template <typename Kernel>
const char* occupancy_of(Kernel kernel, int threads, int smem, int* blocks) {
  if (smem > 48 * 1024) {
    if (gpuFuncSetAttribute(kernel, gpuFuncAttributeMaxDynamicSharedMemorySize, smem) !=
        gpuSuccess) {
      (void)gpuGetLastError();
      return "jaxattn: cannot raise the decode kernel's shared-memory limit";
    }
  }
  if (gpuOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel, threads, smem) != gpuSuccess) {
    (void)gpuGetLastError();
    return "jaxattn: the occupancy query failed";
  }
  return nullptr;
}

template <typename T, typename C, int D, int GT>
const char* group_occupancy(int* blocks) {
  using S = DecodeShape<T, D, GT, GT == 1, C>;
  return occupancy_of(paged_decode_kernel<T, D, GT, GT == 1, C>, S::kThreads, S::kSmemBytes,
                      blocks);
}

template <typename T, typename C, int D>
const char* decode_occupancy_dim(int group, int* blocks) {
  switch (pick_decode_kernel<T, C, D>(group)) {
    case DecodeKernel::kDirect:
      return group_occupancy<T, C, D, 1>(blocks);
#if defined(JAXATTN_CUDA)
    case DecodeKernel::kMma:
      if constexpr (sizeof(C) == 1) {
        using S = MmaFp8DecodeShape<C, D>;
        return occupancy_of(paged_decode_mma_fp8_kernel<T, C, D>, S::kThreads, S::kSmemBytes,
                            blocks);
      } else if constexpr (sizeof(T) == 2) {
        using S = MmaDecodeShape<T, D>;
        return occupancy_of(paged_decode_mma_kernel<T, D>, S::kThreads, S::kSmemBytes, blocks);
      }
      break;
#endif
    case DecodeKernel::kG2:
      return group_occupancy<T, C, D, 2>(blocks);
    case DecodeKernel::kG4:
      return group_occupancy<T, C, D, 4>(blocks);
    case DecodeKernel::kG8:
      return group_occupancy<T, C, D, 8>(blocks);
    case DecodeKernel::kG16:
      return group_occupancy<T, C, D, 16>(blocks);
    case DecodeKernel::kG32:
      return group_occupancy<T, C, D, 32>(blocks);
    case DecodeKernel::kG64:
      return group_occupancy<T, C, D, 64>(blocks);
    default:
      break;
  }
  return kDecodeGroupTooLarge;
}

// The split-KV heuristic (jaxattn/native.py) asks this instead of assuming a kernel's
// resources: blocks of the decode kernel that launch_paged_decode_typed would run for
// (head_dim, group) that fit one multiprocessor of the current device.
template <typename T, typename C = T>
const char* decode_occupancy_typed(int head_dim, int group, int* blocks) {
  return with_head_dim(head_dim, kDecodeHeadDims, [&](auto d) {
    return decode_occupancy_dim<T, C, decltype(d)::value>(group, blocks);
  });
}

// Blocks a KV head of one sequence takes in the grid of the kernel the launcher picks for
// (head_dim, group): mma_head_chunks(group) for the tensor-core kernels, 1 for the others. The
// split-KV heuristic (jaxattn/native.py) counts a grid's blocks with it.
template <typename T, typename C = T>
const char* decode_head_blocks_typed(int head_dim, int group, int* blocks) {
  return with_head_dim(head_dim, kDecodeHeadDims, [&](auto d) -> const char* {
    const DecodeKernel k = pick_decode_kernel<T, C, decltype(d)::value>(group);
    if (k == DecodeKernel::kNone) return kDecodeGroupTooLarge;
    *blocks = k == DecodeKernel::kMma ? mma_head_chunks(group) : 1;
    return nullptr;
  });
}

// T: q's and the output's element type; C: the cache's (T, or an FP8 format under a 16-bit T).
template <typename T, typename C = T>
const char* launch_paged_decode_typed(const DecodeParams& p, gpuStream_t stream) {
  const int D = p.kv.head_dim;
  if (!head_dim_supported(D)) return kDecodeHeadDims;      // before the empty batch's return
  if (p.batch == 0 || p.num_q_heads == 0) return nullptr;  // nothing to write (and no grid)
  if (JAXATTN_DECODE_ROW_UNITS && !ring_rows_fit(p.kv))
    return "jaxattn: GPU paged decode addresses at most 2^32 - 2 cache rows of head_dim elements";
  return with_head_dim(D, kDecodeHeadDims, [&](auto d) {
    return launch_paged_decode_dim<T, C, decltype(d)::value>(p, stream);
  });
}

}  // namespace gpu
}  // namespace jaxattn
