// Hopper prefix prefill / extend attention: warpgroup MMA (wgmma.mma_async, sm_90a) for both
// GEMMs and warp specialisation, FlashAttention-3 style. Same contract as the kernels of
// prefill.cuh (PrefillParams: paged K/V through a page-table row per request, the token pool as
// page size 1, bshd/bhsd through KvGeometry strides, row i of a request sees key j iff
// j <= i + (Lk - Lq), logits in base 2, f32 accumulation, output in q's dtype) and the same
// block -> (request, tile) map (find_prefill_tile: heaviest tiles of a request first, padding
// rows zeroed by the spare blocks).
//
// Only built for sm_90a (prefill_sm90.cu, -gencode arch=compute_90a,code=sm_90a); every other
// target sees the kernels with an empty body. Launched by launch_prefill_typed (prefill.cuh) for
// 16-bit q with head_dim 64 or 128 on compute capability 9.0.
//
// Tiles: 128 query rows of one request and one query head, key tiles of 128. GQA groups of
// 2..16 (prefill_sm90_packs) pack the group's query heads into the rows instead: row r is token
// r / G and head r % G of the block's KV head (G = PrefillParams::pack_heads, 128 / G tokens a
// tile), so a short extend of 24 new tokens x 4 heads fills 96 rows where one head filled 24,
// and each K/V tile is read once per KV head. The causal mask, the guards and the store take a
// row's token.
//
// Shared memory (1024-byte aligned), each tile stored as D/64 column blocks of [rows][64]
// elements, 128 bytes a row, the 16-byte chunk c of row r at chunk c ^ (r % 8): the 128-byte
// swizzle of the wgmma descriptors (swizzle mode 1), so one layout serves
//   Q  [128 x D]  K-major A operand of S = Q K^T (descriptor per warpgroup: +64 rows),
//   K  [128 x D]  K-major B operand of S (rows are keys, D contiguous),
//   V  [128 x D]  MN-major B operand of O += P V (instruction transpose bit; LBO = distance
//                 between the 64-column blocks, SBO = 8 rows = 1024 bytes),
// a k step of 16 being +32 bytes inside the swizzled row (Q, K) or +16 rows (V). Tiles are
// filled with 16-byte cp.async copies of gathered rows (zero-filled past the request's keys, so
// unread slots and NaN-filled unused pages never enter a product) from row offsets (uint32,
// 16-byte units; launch_prefill_typed falls back to the mma kernel when a cache is too large
// for them).
//
// The consumer loop, iteration n >= 1: issue S = Q K_n^T (D/16 x m64n128k16, both operands
// from shared memory) and O += P_{n-1} V_{n-1} (8 x m64nDk16, P from registers) as two wgmma
// groups; wait for S only (wait_group 1); online softmax on the accumulator fragments (no cap:
// maxima on the raw dot products, one FFMA + ex2 per probability; with a cap: cap * tanh(s *
// q_scale) first; the mask only on tiles that cross the diagonal or the last key) while
// P_{n-1} V_{n-1} still runs; wait for it; rescale O; pack P_n to 16-bit A fragments (the
// m64nNk16 accumulator layout is the A-fragment layout). Tile 0 is peeled (S only) and the
// last P V follows the loop, so every wgmma group in the loop is unconditional (with a
// conditional P V group ptxas either serialised the wgmma or turned the empty commit into a
// dummy group that made wait_group 1 wait for P V as well). Key tiles stop at the tile holding
// the last row's last visible key (key_range), exactly as the mma kernel.
//
// One kernel, prefill_sm90_kernel, warp-specialised (below), for 16-bit and FP8 caches. Over
// an FP8 cache the producer copies the rows as stored (half the bytes) into the K ring. With a
// bf16 q at head_dim 128 (kSplitQ) K stays there as stored and S = Q K^T runs on FP8 wgmma, q
// split per row into two e4m3 terms (hi + lo: a bf16 value exactly, but for terms below 2^-10
// of the row's largest); P V runs in float16 over V widened into the float16 V ring. Otherwise
// (a float16 q, whose 11 bits two e4m3 terms do not hold, or head_dim 64) both products run in
// float16 (every FP8 value is exact there): K and V are widened, and a bf16 q is moved to
// float16 per row by a power of two, undone in the row's logit factor (as prefill.cuh's mma
// kernel does).
#pragma once

#include <cstdint>
#include <type_traits>

#include "jaxattn/prefill.cuh"
#include "jaxattn/prefill_sm90_stats.h"

#if defined(JAXATTN_CUDA)

namespace jaxattn {
namespace gpu {

// base + kUnit * off as one wide multiply-add (written in C++, the compiler kept the offset in
// elements and added the cache's base with two more instructions a copy).
template <int kUnit>
__device__ __forceinline__ const void* sm90_row_address(uint64_t base, uint32_t off) {
  uint64_t a;
  asm("mad.wide.u32 %0, %1, %2, %3;\n" : "=l"(a) : "r"(off), "n"(kUnit), "l"(base));
  return reinterpret_cast<const void*>(a);
}

// A row offset in 16-byte units (every row starts on a multiple of head_dim elements);
// kSm90NoRow marks keys past the request (zero-filled).
constexpr uint32_t kSm90NoRow = 0xffffffffu;

__device__ __forceinline__ uint32_t sm90_pack_off(int64_t off) {
  return off < 0 ? kSm90NoRow : uint32_t(off >> 3);
}

// Byte offset of 16-byte chunk c of row r in a tile of R rows: D/64 column blocks of R rows of
// 128 bytes, chunks XOR-swizzled with the row's phase in its 8-row (1024-byte) group.
template <int R>
__device__ __forceinline__ uint32_t sm90_tile_off(int r, int c) {
  return uint32_t((c >> 3) * (R * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// wgmma shared-memory matrix descriptor, 128-byte swizzle: start address, leading and stride
// byte offsets in 16-byte units in bits 0-13, 16-29, 32-45; base offset 0 (every swizzle
// pattern starts on a 1024-byte boundary); swizzle mode 1 in bits 62-63.
__host__ __device__ constexpr uint64_t sm90_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFFu) >> 4) | (uint64_t((lbo & 0x3FFFFu) >> 4) << 16) |
         (uint64_t((sbo & 0x3FFFFu) >> 4) << 32) | (uint64_t(1) << 62);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ void sm90_wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void sm90_wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void sm90_wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes this thread's generic-proxy shared-memory writes (cp.async) visible to the async proxy
// (wgmma operand reads); a barrier then orders them for the other threads.
__device__ __forceinline__ void sm90_fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Pins registers at this point of the program: accesses cannot move across it, so the
// accumulators and A fragments of an in-flight wgmma are touched only after its wait.
template <int N>
__device__ __forceinline__ void sm90_pin(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void sm90_pin(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

#define JAXATTN_SM90_R32                                                                       \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define JAXATTN_SM90_R64                                                                    \
  JAXATTN_SM90_R32                                                                          \
  ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, " \
  "%49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define JAXATTN_SM90_ACC8(i)                                                                  \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define JAXATTN_SM90_ACC32 \
  JAXATTN_SM90_ACC8(0), JAXATTN_SM90_ACC8(8), JAXATTN_SM90_ACC8(16), JAXATTN_SM90_ACC8(24)
#define JAXATTN_SM90_ACC64                                                                 \
  JAXATTN_SM90_ACC32, JAXATTN_SM90_ACC8(32), JAXATTN_SM90_ACC8(40), JAXATTN_SM90_ACC8(48), \
      JAXATTN_SM90_ACC8(56)

// D[64 x 128] (+)= A[64 x k] B[k x 128], A and B K-major in shared memory: SHAPE_TYPES the
// instruction's shape and types (m64n128k16 16-bit, m64n128k32 FP8), IMM its immediate scales
// (and, 16-bit only, transposes: FP8 wgmma takes none).
#define JAXATTN_SM90_SS_N128_ASM(SHAPE_TYPES, IMM)                                             \
  asm volatile(                                                                                \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                             \
      "wgmma.mma_async.sync.aligned." SHAPE_TYPES " {" JAXATTN_SM90_R64 "}, %64, %65, p, " IMM \
      ";\n}\n"                                                                                 \
      : JAXATTN_SM90_ACC64                                                                     \
      : "l"(da), "l"(db), "r"(scale_d)                                                         \
      : "memory")
// The 16-bit form: A and B of type TY.
#define JAXATTN_SM90_SS_N128(TY) JAXATTN_SM90_SS_N128_ASM("m64n128k16.f32." TY "." TY, "1, 1, 0, 0")
// D[64 x 128] += A[64 x 16] B[16 x 128], A in registers, B MN-major in shared memory.
#define JAXATTN_SM90_RS_N128(TY)                                                     \
  asm volatile(                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                   \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {" JAXATTN_SM90_R64 \
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                               \
      : JAXATTN_SM90_ACC64                                                           \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1)                  \
      : "memory")
// D[64 x 64] += A[64 x 16] B[16 x 64], A in registers, B MN-major in shared memory.
#define JAXATTN_SM90_RS_N64(TY)                                                     \
  asm volatile(                                                                     \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                  \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {" JAXATTN_SM90_R32 \
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                              \
      : JAXATTN_SM90_ACC32                                                          \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1)                 \
      : "memory")

// The FP8 form (k 32): A e4m3, B of type TB.
#define JAXATTN_SM90_SS_N128_F8(TB) JAXATTN_SM90_SS_N128_ASM("m64n128k32.f32.e4m3." TB, "1, 1")

template <typename C>
__device__ __forceinline__ void sm90_mma_ss_n128_f8(float (&d)[64], uint64_t da, uint64_t db,
                                                    int scale_d) {
  if constexpr (std::is_same_v<C, e4m3_t>) {
    JAXATTN_SM90_SS_N128_F8("e4m3");
  } else {
    JAXATTN_SM90_SS_N128_F8("e5m2");
  }
}

template <typename T>
__device__ __forceinline__ void sm90_mma_ss_n128(float (&d)[64], uint64_t da, uint64_t db,
                                                 int scale_d) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    JAXATTN_SM90_SS_N128("bf16");
  } else {
    JAXATTN_SM90_SS_N128("f16");
  }
}

template <typename T, int N>
__device__ __forceinline__ void sm90_mma_rs(float (&d)[N / 2], const uint32_t* a, uint64_t db) {
  if constexpr (N == 128) {
    if constexpr (std::is_same_v<T, bf16_t>) {
      JAXATTN_SM90_RS_N128("bf16");
    } else {
      JAXATTN_SM90_RS_N128("f16");
    }
  } else {
    static_assert(N == 64, "P V is built for head_dim 64 and 128");
    if constexpr (std::is_same_v<T, bf16_t>) {
      JAXATTN_SM90_RS_N64("bf16");
    } else {
      JAXATTN_SM90_RS_N64("f16");
    }
  }
}

#undef JAXATTN_SM90_SS_N128
#undef JAXATTN_SM90_SS_N128_F8
#undef JAXATTN_SM90_SS_N128_ASM
#undef JAXATTN_SM90_RS_N128
#undef JAXATTN_SM90_RS_N64
#undef JAXATTN_SM90_ACC64
#undef JAXATTN_SM90_ACC32
#undef JAXATTN_SM90_ACC8
#undef JAXATTN_SM90_R64
#undef JAXATTN_SM90_R32

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// ------------------------------------------------------------------------------------------
// The 16-bit kernel, warp-specialised. Block: 384 threads = three warpgroups.
//
// Warpgroup 0 is the producer (setmaxnreg down to kSm90ProducerRegs). It copies q, then every
// key tile's K and V rows with 16-byte cp.async gathers into separate K and V rings of kStages
// stages. Its 128 threads each keep the RowCursor of one key row; a tile's row offsets are
// published through a two-slot table and one producer-only named barrier a tile, and the
// page-table entry a cursor needs is loaded a tile ahead of its use (its latency used to stall
// the producer once a tile). A thread reads its rows' offsets 8 at a time before issuing their
// copies: a copy is a memory clobber, so a shared load after it waited for it, and row by row
// the producer fell behind the tensor cores (ncu: the consumers' top stall was the full wait).
//
// Warpgroups 1 and 2 are consumers (setmaxnreg up), 64 query rows each, running the loop above
// with no block barrier:
//   full[s]  (K and V each): 128 producer arrivals, by cp.async.mbarrier.arrive.noinc (the
//            arrival lands when this thread's copies have), or -- in a tile the mask crosses,
//            where the producer scans the V chunks it copied for the guards (sanitize_own_v)
//            -- a plain arrive after its wait, scan and fence.proxy.async;
//   empty[s] (K and V each): one arrival per consumer warp once its wgmma reading the stage
//            has completed (K after S_n's wait, V after P V's).
// A consumer executes fence.proxy.async after each full wait, before its wgmma reads the stage
// (the copies are generic-proxy writes). What the fences cost, measured on an H100 (prefill
// self-test, alternated, round 62): without them (not a correct program) the long rows ran
// 0.6-1.0% faster; with the producer fencing instead -- its copies of K_n and V_{n-1}
// waited for (cp.async.wait_group) once V_n's were issued, then fence and plain arrivals --
// they were level with this form (-0.7 to +0.2%), which stays. The guards' flags live in the
// producer (index entries) and first_bad (V values); the producer hands them over through
// shared memory and a named barrier before the consumers store. Named barriers: 1 the
// producer's own, 2 and 3 each consumer warpgroup's (its q rows moved to float16: a bf16 q
// over an FP8 cache), 4 the flags' hand-over.
//
// FlashAttention-3's ping-pong (named barriers ordering the two consumer warpgroups' wgmma
// issue, so one's softmax runs under the other's products) was 1-3% slower on the H200 (prefill
// self-test, 8 x (2048 + 512) 425 against 434 TFLOP/s, 1 x (0 + 8192) 500 against 510): the
// two warpgroups drift apart on their own. Not kept. FlashAttention-4's form of it (each
// warpgroup waits for its turn before issuing S_n and P_{n-1} V_{n-1}, arrives on the other's
// after), built into round 60's kernel, was 3-4% slower on an H100 (prefill self-test,
// alternated: 8 x (2048 + 512) 512 -> 496 TFLOP/s, 1 x (0 + 8192) 606 -> 582, 4 x (0 + 4096)
// 537 -> 517; ffi/NOTES.md, round 61).
//
// Shared memory, D = 128: 32 KB Q + 3 x (32 KB K + 32 KB V) + 1 KB row offsets + 1 KB alignment
// = 226 KB, barriers and first_bad static. ptxas (nvcc 13.0): no spills at 64 / 216 registers
// (producer / consumers).
//
// The persistent launch (kPersist; PrefillKernel::kSm90Persistent, not chosen by auto): one
// block an SM, each looping over work items -- the one-tile-a-block grid's (tile, head group)
// pairs, claimed from a counter (sm90_items) -- so that an item's first q and K copies overlap
// the previous item's last products and store instead of waiting for a new block to start.
// The producer claims and finds each item (find_prefill_tile over its own 128 threads: named
// barrier 1) and publishes a record (past the last item, an end record); the rings, their
// barriers and their phases run on across items (ring position it0 + n). Hand-over barriers,
// each with a phase per record / valid item: record full and empty, q empty (released by the
// consumer warps after the item's last S; the producer's next q copy waits for it), flags full
// (the guards' flags, in place of named barrier 4), item done (the consumers' store has read
// first_bad and block_flags and reset them; the producer waits for it before its next guard).
// Registers 104 / 200: with the item loop's state the producer spilled at 64 and at 80 / 208,
// with the claims at 96 in two FP8 kernels (88 / 208, spilling only in FP8 kernels, ran level
// with 96 / 200 on the 16-bit rows: round 63). With the static order it had until round 63
// it ran 2-6% behind the one-tile launch on the long rows (round 13); claiming its items,
// H100 prefill self-test, bf16, 32/8: 8 x (2048 + 512) 522 / 524 / 525 TFLOP/s against the
// one-tile launch's 512 / 514 / 515 in the same job, 1 x (0 + 8192) 602 / 605 / 601 against
// 607 / 608 / 605, 4 x (0 + 4096) 536 / 538 / 537 against 535 / 534 / 534; through the public
// ops, sustained, level on the long rows and 5% behind on 32 x (1000 + 24) (ffi/NOTES.md,
// round 63). Opt-in.
// ------------------------------------------------------------------------------------------
// kF8: an FP8 cache (the same rings: its tiles are staged in the K stage they widen into).
template <int D, bool kF8 = false>
struct Sm90Shape {
  static constexpr int kBM = 128;
  static constexpr int kBN = 128;
  static constexpr int kThreads = 384;
  static constexpr int kProducerThreads = 128;
  static constexpr int kStages = 3;
  static constexpr int kChunks = D / 8;
  static constexpr int kRowsPerPass = kProducerThreads / kChunks;
  static constexpr int kF8Chunks = D / 16;  // 16-byte FP8 chunks a row
  static constexpr int kF8Rows = kProducerThreads / kF8Chunks;
  static constexpr int kQBytes = kBM * D * 2;
  static constexpr int kTileBytes = kBN * D * 2;  // a 16-bit K or V tile
  static constexpr int kF8TileBytes = kBN * D;    // an FP8 K or V tile
  static constexpr int kOffBytes = 2 * kBN * 4;
  static constexpr int kSmemBytes = 1024 + kQBytes + 2 * kStages * kTileBytes + kOffBytes;
  static_assert(D == 64 || D == 128, "the sm90 kernel is built for head_dim 64 and 128");
  static_assert(kRowsPerPass % 8 == 0, "a thread's copy rows must share one swizzle phase");
  static_assert(kF8Rows % 8 == 0, "a thread's widened rows must share one swizzle phase");
  static_assert(2 * kF8TileBytes == kTileBytes, "an FP8 K and V tile fill one K stage");
  static_assert(kSmemBytes <= 232448 - 1024,  // 1 KB for the static first_bad and barriers
                "more shared memory than an sm_90 block may have");
};

// Experiment switches (compile-time, default off; prefill_selftest builds them with -D): a
// tree of JAXATTN_SM90_CHAINS partial maxima and sums per row in the softmax instead of one
// dependent chain; JAXATTN_SM90_FP8_ONE_BARRIER: one producer barrier per FP8 tile instead of
// two (the row offsets of the next tile published before the widening, so that the barrier
// before the in-place K stores serves both) -- both timed in round 13 (ffi/NOTES.md), no gain
// kept.
// JAXATTN_SM90_FP8_TIMING_NO_WIDEN (timing only: the FP8 rows' results are then wrong): 1
// skips the widening of K (and the producer barrier before its in-place stores), 2 that of V
// as well, so that the consumers compute on whatever the float16 stages hold. Measured in
// round 15 (ffi/NOTES.md): FP8 8 x (2048 + 512) 400 -> 433 -> 462 TFLOP/s against bf16's 458.
#ifndef JAXATTN_SM90_FP8_TIMING_NO_WIDEN
#define JAXATTN_SM90_FP8_TIMING_NO_WIDEN 0
#endif
// JAXATTN_SM90_TIMING_NO_COPY (timing only: results wrong): the 16-bit producer issues no K
// (1) or no K and V (2) row copies -- its page-table walk, offsets, barriers and arrivals stay
// -- so that the consumers compute on whatever the stages hold: what the gathers cost.
// Measured in round 16 (ffi/NOTES.md): 8 x (2048 + 512) 456 -> 470 -> 514 TFLOP/s.
#ifndef JAXATTN_SM90_TIMING_NO_COPY
#define JAXATTN_SM90_TIMING_NO_COPY 0
#endif
#ifndef JAXATTN_SM90_CHAINS
#define JAXATTN_SM90_CHAINS 1
#endif
// JAXATTN_SM90_WAIT_STATS (prefill_sm90_stats.h): the counters' storage.
#if JAXATTN_SM90_WAIT_STATS
static __device__ unsigned long long sm90_wait_stats[kWaitStats];
#endif
// JAXATTN_SM90_ALL_ROWS: the producer's copies of a key tile whose rows are all present (every
// page within the pool, every key below the request's length: the usual interior tile) skip
// the per-row test and select of a missing row: one barrier with an AND reduction per tile
// (named_sync_and, where a plain barrier was) says so. Prefill self-test, H200, +0.3-2% on the
// long rows (round 19, ffi/NOTES.md). 0 takes the general copy for every tile.
#ifndef JAXATTN_SM90_ALL_ROWS
#define JAXATTN_SM90_ALL_ROWS 1
#endif
// The 16-bit producer and the FP8 one of kSplitQ (which widens no K): with K's widening the
// same fast copy made ptxas spill 20-36 bytes in the e4m3 head_dim 128 kernels at the
// producer's 64 registers. kSplitQ, H200 self-test, e4m3: +0-1% (round 25).
#ifndef JAXATTN_SM90_FP8_ONE_BARRIER
#define JAXATTN_SM90_FP8_ONE_BARRIER 0
#endif
// The lazy rescale (online_max_step<SLACK>, FlashAttention-4's): a row's running maximum is
// raised only when a tile's exceeds it by more than SLACK (base 2), so probabilities stay below
// 2^SLACK (in range for bf16 and float16 P) and, once the maxima are near their final values,
// the warps skip the D / 2 multiplies of their O fragments in nearly every tile. Prefill
// self-test, H200, SLACK 8 against 0 (two runs each, alternating): +1-2% on the long extends
// (8 x (2048 + 512) bf16 454 / 456 -> 459 / 462 TFLOP/s, 1 x (0 + 8192) 529 / 534 -> 540 / 539),
// level on the short one. 0 restores the exact-maximum recurrence.
#ifndef JAXATTN_SM90_RESCALE_SLACK
#define JAXATTN_SM90_RESCALE_SLACK 8
#endif

constexpr int kSm90ProducerRegs = 64;
constexpr int kSm90ConsumerRegs = 216;
// The persistent kernel's split (104 + 2 x 200 = 504): its producer also claims and finds the
// next work item and keeps the item loop's state; at 64 registers (or 80 / 208) ptxas spilled,
// and with the claims at 96 in two FP8 kernels (round 63).
constexpr int kSm90PersistProducerRegs = 104;
constexpr int kSm90PersistConsumerRegs = 200;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// A bf16 pair times `pre` as two e4m3 terms, hi = e4m3(x) and lo = e4m3(x - hi) (x - hi is
// exact in float32), each pair in 16 bits (the first element in the low byte). With |x| below
// 2^8, hi + lo is x exactly unless lo falls below e4m3's normal range (|x| < 2^-2: terms 2^-10
// of the row's largest or less). An infinite x becomes NaN: e4m3 has no infinity, and a row of
// q holding one is NaN in the spec's softmax either way.
__device__ __forceinline__ void bf16x2_to_e4m3x2_split(uint32_t w, float pre, uint32_t& hi,
                                                       uint32_t& lo) {
  float x0 = __uint_as_float(w << 16) * pre, x1 = __uint_as_float(w & 0xffff0000u) * pre;
  const float nan = __uint_as_float(0x7fc00000u);
  if (fabsf(x0) == __builtin_huge_valf()) x0 = nan;
  if (fabsf(x1) == __builtin_huge_valf()) x1 = nan;
  uint16_t h, l;
  uint32_t hf;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(h) : "f"(x1), "f"(x0));
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(hf) : "h"(h));
  const float r0 = x0 - f16_to_float(uint16_t(hf & 0xffffu));
  const float r1 = x1 - f16_to_float(uint16_t(hf >> 16));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(l) : "f"(r1), "f"(r0));
  hi = h;
  lo = l;
}

// A bf16 q over an FP8 cache (the sm90 kernel's kSplitQ and kWidenQ): the quad's quarters of
// q rows r and r + 8 of a tile of R rows (lane tq: bf16 chunks 4 tq .. 4 tq + 3) and the two
// rows' largest magnitudes over the quad.
template <int R, int QC>
__device__ __forceinline__ void sm90_q_quarter_rows(const unsigned char* tile, int r, int tq,
                                                    uint4 (&v0)[QC], uint4 (&v1)[QC], float& mx0,
                                                    float& mx1) {
  mx0 = mx1 = 0.f;
#pragma unroll
  for (int i = 0; i < QC; ++i) {
    v0[i] = lds128(tile + sm90_tile_off<R>(r, tq * QC + i));
    v1[i] = lds128(tile + sm90_tile_off<R>(r + 8, tq * QC + i));
    mx0 = bf16x2_absmax(
        v0[i].w, bf16x2_absmax(v0[i].z, bf16x2_absmax(v0[i].y, bf16x2_absmax(v0[i].x, mx0))));
    mx1 = bf16x2_absmax(
        v1[i].w, bf16x2_absmax(v1[i].z, bf16x2_absmax(v1[i].y, bf16x2_absmax(v1[i].x, mx1))));
  }
  mx0 = group_max<4>(mx0);
  mx1 = group_max<4>(mx1);
}

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// The arrival lands when every cp.async this thread issued before it has completed.
__device__ __forceinline__ void mbar_arrive_copies(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// A warp's waiting time by category, added into sm90_wait_stats once at its end (lane 0).
struct Sm90WaitClock {
#if JAXATTN_SM90_WAIT_STATS
  unsigned long long acc[kWaitStats] = {};
  long long t0 = 0;
  __device__ __forceinline__ long long mark() const { return clock64(); }
  __device__ __forceinline__ void add_since(int k, long long t) {
    acc[k] += (unsigned long long)(clock64() - t);
  }
  __device__ __forceinline__ void start() { t0 = mark(); }
  __device__ __forceinline__ void stop(int k) { add_since(k, t0); }
  __device__ __forceinline__ void count(int k) { acc[k] += 1; }
  __device__ __forceinline__ void flush() {
    if (threadIdx.x % 32 == 0) {
      for (int k = 0; k < kWaitStats; ++k)
        if (acc[k]) atomicAdd(&sm90_wait_stats[k], acc[k]);
    }
  }
#else
  __device__ __forceinline__ long long mark() const { return 0; }
  __device__ __forceinline__ void add_since(int, long long) {}
  __device__ __forceinline__ void start() {}
  __device__ __forceinline__ void stop(int) {}
  __device__ __forceinline__ void count(int) {}
  __device__ __forceinline__ void flush() {}
#endif
};
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// bar.sync over `count` threads that also returns whether v held in every one of them.
__device__ __forceinline__ bool named_sync_and(int id, int count, bool v) {
  uint32_t out;
  asm volatile(
      "{\n.reg .pred pi, po;\nsetp.ne.u32 pi, %1, 0;\nbar.red.and.pred po, %2, %3, pi;\n"
      "selp.u32 %0, 1, 0, po;\n}\n"
      : "=r"(out)
      : "r"(uint32_t(v)), "r"(id), "r"(count)
      : "memory");
  return out != 0;
}
template <int R>
__device__ __forceinline__ void set_max_regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void set_max_regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// find_prefill_tile in the persistent kernel, called by the producer warpgroup alone: its named
// barrier 1, and barrier.red.or over the same 128 threads.
struct Sm90ProducerSync {
  static constexpr int kThreads = 128;
  static __device__ __forceinline__ void sync() { named_sync(1, 128); }
  static __device__ __forceinline__ bool sync_or(bool v) {
    uint32_t out;
    asm volatile(
        "{\n.reg .pred pi, po;\nsetp.ne.u32 pi, %1, 0;\nbar.red.or.pred po, 1, 128, pi;\n"
        "selp.u32 %0, 1, 0, po;\n}\n"
        : "=r"(out)
        : "r"(uint32_t(v))
        : "memory");
    return out != 0;
  }
};
#endif

// The persistent kernel's work items: item w is tile w / heads of head group w % heads (the
// grid of the one-tile-a-block launch, its x and y, heads varying fastest so that the tiles
// that see the most keys come first). Blocks claim items in that order from a counter
// (PrefillParams::work_counter, zeroed by the launcher), so that an SM that finishes early
// takes the next item, as the block scheduler hands the one-tile launch its next block: SMs
// run at unequal speeds and uneven tiles end unevenly. A static snake over the rounds (block b
// taking items r * grid + b and r * grid + grid - 1 - b in turn), its order until round 63,
// ran level on 1 x (0 + 8192) and 3-7% slower on the other rows (H100 prefill self-test;
// ffi/NOTES.md, round 63).
__host__ __device__ __forceinline__ int64_t sm90_items(const PrefillParams& p) {
  const int g = p.pack_heads > 1 ? p.pack_heads : 1;
  const int bm = 128 / g;
  return (int64_t(p.total_q + bm - 1) / bm + p.batch) * (p.num_q_heads / g);
}

// T: q's and the output's type; C: the cache's (T, or an FP8 format: the products are then
// float16, M below). kPersist: one block an SM loops over work items (sm90_items) instead of
// one tile a block (launch_prefill_sm90_d says which runs).
template <typename T, typename C, int D, bool kPack, bool kPersist = false>
__global__ void __launch_bounds__(Sm90Shape<D, sizeof(C) == 1>::kThreads, 1)
    prefill_sm90_kernel(const PrefillParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kF8 = sizeof(C) == 1;
  // The P V operand type. A bf16 q over an FP8 cache at head_dim 128 (kSplitQ) is split into
  // two e4m3 terms, hi and lo, and S = Q K^T runs on FP8 wgmma over the K rows as stored (no
  // widening of K); at head_dim 64 it is moved to float16 (kWidenQ) and K widened as V is.
  using M = std::conditional_t<kF8, f16_t, T>;
  constexpr bool kSplitQ = kF8 && std::is_same_v<T, bf16_t> && D == 128;
  constexpr bool kWidenQ = kF8 && std::is_same_v<T, bf16_t> && !kSplitQ;
  using S = Sm90Shape<D, kF8>;
  constexpr int BM = S::kBM, BN = S::kBN, CH = S::kChunks, RP = S::kRowsPerPass;
  constexpr int NS = S::kStages, NP = S::kProducerThreads;
  constexpr float kNegInf = -__builtin_huge_valf();
  extern __shared__ __align__(1024) unsigned char sm90_smem[];
  const uint32_t raw = smem_u32(sm90_smem);
  const uint32_t base = (raw + 1023u) & ~1023u;
  const uint32_t q_s = base;
  const uint32_t k_s = base + S::kQBytes;               // K stage i at + i * kTileBytes
  const uint32_t v_s = k_s + NS * S::kTileBytes;        // V stage i at + i * kTileBytes
  unsigned char* const gen = sm90_smem + (base - raw);  // generic pointer to `base`
  uint32_t* rowoff = reinterpret_cast<uint32_t*>(gen + S::kQBytes + 2 * NS * S::kTileBytes);

  __shared__ int first_bad[D];
  // K full, K empty, V full, V empty (kStages each), then q full.
  __shared__ __align__(8) uint64_t bars[4 * NS + 1];
  __shared__ int block_flags;  // the producer's guard flags, ORed
  // kPersist: an item's record (valid, head, and of the PrefillTile what the consumers use: m0,
  // rows, q0, lq, lk), the producer's scratch for find_prefill_tile, and the hand-over barriers:
  // record full (the producer's thread 0) and empty (every consumer thread), q empty (the
  // consumer warps, after their item's last S), flags full (every producer thread, after its
  // item's last guard; replaces named barrier 4), item done (every consumer thread, after its
  // store and the reset of first_bad and block_flags).
  __shared__ int rec[kPersist ? 7 : 1];
  __shared__ int pscratch[kPersist ? kPrefillTileScratch<128> : 1];
  [[maybe_unused]] __shared__ int claimed;  // kPersist: the producer's claim of this round
  __shared__ __align__(8) uint64_t pbars[kPersist ? 5 : 1];
  const uint32_t bar0 = smem_u32(bars);
  auto kfull = [&](int s) { return bar0 + 8u * uint32_t(s); };
  auto kempty = [&](int s) { return bar0 + 8u * uint32_t(NS + s); };
  auto vfull = [&](int s) { return bar0 + 8u * uint32_t(2 * NS + s); };
  auto vempty = [&](int s) { return bar0 + 8u * uint32_t(3 * NS + s); };
  const uint32_t qfull = bar0 + 8u * uint32_t(4 * NS);
  const uint32_t pbar0 = smem_u32(pbars);
  [[maybe_unused]] const uint32_t rec_full = pbar0, rec_empty = pbar0 + 8u, qempty = pbar0 + 16u;
  [[maybe_unused]] const uint32_t flags_full = pbar0 + 24u, item_done = pbar0 + 32u;
  const int tid = threadIdx.x;
  init_first_bad<D>(first_bad, tid, S::kThreads);
  if (tid == 0) {
    for (int s = 0; s < NS; ++s) {
      mbar_init(kfull(s), NP);
      mbar_init(vfull(s), NP);
      mbar_init(kempty(s), 8);  // the consumer warps
      mbar_init(vempty(s), 8);
    }
    mbar_init(qfull, NP);
    if constexpr (kPersist) {
      mbar_init(rec_full, 1);
      mbar_init(rec_empty, 256);
      mbar_init(qempty, 8);
      mbar_init(flags_full, NP);
      mbar_init(item_done, 256);
    }
    block_flags = 0;
  }
  const int G = kPack ? p.pack_heads : 1;
  int head = blockIdx.y * G;
  PrefillTile t;
  if constexpr (!kPersist) {
    // Scratch: V stage 0, which the producer fills after the barrier below.
    if (!find_prefill_tile<T, S::kThreads>(p, BM / G, blockIdx.x, head,
                                           reinterpret_cast<int*>(sm90_smem + (v_s - raw)), &t, G))
      return;
  }
  __syncthreads();  // every thread has read its tile out of the scratch; barriers initialised
  const KvGeometry& kv = p.kv;
  // The item's KV head, mask shift, key range and key tiles (once, or per item: set_item).
  int kvh = 0, shift = 0, ntiles = 0;
  KeyRange range{0, 0};
  auto set_item = [&]() {
    kvh = head / (p.num_q_heads / kv.num_kv_heads);
    shift = t.lk - t.lq;
    range = key_range(t);
    ntiles = (range.end + BN - 1) / BN;
  };
  if constexpr (!kPersist) set_item();
  // Ring position (key tiles of earlier items) and valid items so far (each loads q once);
  // round r of the item loop reads record r.
  [[maybe_unused]] int it0 = 0, nvalid = 0;
  const int wg = tid / 128, wl = (tid / 32) % 4, lane = tid % 32;
  const int g = lane / 4;
  int tq = lane % 4;
  int lr0 = (wg - 1) * 64 + wl * 16 + g;  // a consumer's rows within the tile

  if (wg == 0) {
    // ---------------------------------- producer ----------------------------------
    set_max_regs_dec<(kPersist ? kSm90PersistProducerRegs : kSm90ProducerRegs)>();
    const T* qg = static_cast<const T*>(p.q);
    const int c = tid % CH, r0 = tid / CH;                 // chunk c of rows r0 + i * RP
    for (int round = 0; kPersist || round < 1; ++round) {  // once without kPersist
      if constexpr (kPersist) {
        if (tid == 0) {
          const unsigned v = atomicAdd(p.work_counter, 1u);
          claimed = v < uint64_t(sm90_items(p)) ? int(v) : -1;
        }
        // The claim published; every producer thread is done with the last item's scratch
        // (thread 0 writes `claimed` again only past find_prefill_tile's barriers below).
        named_sync(1, NP);
        const int w = claimed, heads_y = p.num_q_heads / G;
        if (w < 0) {
          if (tid == 0) {  // the end record: no more items
            if (round > 0) mbar_wait(rec_empty, (round - 1) & 1);
            rec[0] = -1;
            mbar_arrive(rec_full);
          }
          break;
        }
        head = (w % heads_y) * G;
        const bool valid = find_prefill_tile<T, NP, Sm90ProducerSync>(p, BM / G, w / heads_y, head,
                                                                      pscratch, &t, G);
        if (tid == 0) {
          if (round > 0) mbar_wait(rec_empty, (round - 1) & 1);
          rec[0] = valid;
          rec[1] = head;
          rec[2] = t.m0;
          rec[3] = t.rows;
          rec[4] = t.q0;
          rec[5] = t.lq;
          rec[6] = t.lk;
          mbar_arrive(rec_full);
        }
        if (!valid) continue;  // find_prefill_tile wrote its rows
        set_item();
      }
      int flags = 0;  // kGuardIndexBad, kGuardValueBad
      // kPersist: whether the consumers are done with the last valid item (its store read
      // first_bad and block_flags, then reset them); waited for before this item's first guard.
      [[maybe_unused]] bool last_done = !kPersist || nvalid == 0;
      auto guards_free = [&]() {
        if constexpr (kPersist) {
          if (!last_done) mbar_wait(item_done, (nvalid - 1) & 1);
          last_done = true;
        }
      };
      // q, one item at a time: the persistent kernel waits for the consumers' last S of the
      // previous item (an item without keys still takes q, so that the two counts agree).
      {
        if constexpr (kPersist) {
          if (nvalid > 0) mbar_wait(qempty, (nvalid - 1) & 1);
        }
        auto copy_q_row = [&](int i) {
          const int r = r0 + i * RP, tok = pack_token<kPack>(p, r);
          const bool ok = tok < t.rows;
          const T* src =
              ok ? qg + (int64_t(t.q0 + t.m0 + tok) * p.num_q_heads + head + r - tok * G) * D +
                       c * 8
                 : qg;
          async_copy16_at(q_s + sm90_tile_off<BM>(r, c), src, ok);
        };
        if constexpr (kPersist) {
          // Rolled: unrolled, ptxas hoisted every row's addresses out of the item loop (into
          // local memory).
#pragma unroll 1
          for (int i = 0; i < BM / RP; ++i) copy_q_row(i);
        } else {
#pragma unroll
          for (int i = 0; i < BM / RP; ++i) copy_q_row(i);
        }
        mbar_arrive_copies(qfull);
      }
      RowCursor cur;  // row tid of each key tile
      cur.init(kv, t.table, tid, range.end, flags);
      // Where producer thread tid publishes its row's offset in a slot of the table. The 16-bit
      // producer's table is transposed -- row r at (r % RP) * (BN / RP) + r / RP -- so that the
      // BN / RP rows a thread copies (r0 + i * RP) have their offsets side by side and a batch
      // of them is read with 16-byte shared loads, one per four rows (the all-rows copy path of
      // a tile at head_dim 128: 8 shared loads a thread instead of 32; H100 self-test +0.5-1.6%
      // on the one-tile and persistent rows, none slower: ffi/NOTES.md, round 63). The FP8 loop
      // keeps the plain order.
      const int off_at = kF8 ? tid : (tid % RP) * (BN / RP) + tid / RP;
      rowoff[off_at] = sm90_pack_off(cur.off);
      // The entry of row tid of the next tile, loaded a tile ahead of its use.
      int ahead = RowCursor::entry_ahead(kv, t.table, BN + tid, range.end);
      // 16-bit and kSplitQ (kAllRows): whether every row of the tile the table holds is
      // present (a page within the pool, a key below the request's length): the copies then
      // need no per-row test (copy_rows).
      constexpr bool kAllRows =
          !kF8 || (kSplitQ && JAXATTN_SM90_ALL_ROWS && !JAXATTN_SM90_FP8_ONE_BARRIER);
      [[maybe_unused]] bool all_rows = false;
      if constexpr (kAllRows) {
        all_rows = named_sync_and(1, NP, cur.off >= 0);
      } else {
        named_sync(1, NP);
      }
      check_entries<NP, 16>(t, kv, range.end, flags);
      if constexpr (kF8) {
        // FP8: tile n's rows are copied as stored into K stage n % NS -- its K rows in the
        // first half, its V rows in the second, plain rows of D bytes -- as soon as S_{n-NS} has
        // released the stage (iteration n), and widened in iteration n + 1: V into V stage
        // n % NS, then K in place, each thread its own chunks (16-byte chunk c8 of rows r8 + i *
        // F8R: fp8_widen_chunk), visible to it after its own wait. In place, the float16 K rows
        // overwrite FP8 rows other threads copied: every producer thread loads its FP8 K chunks,
        // then a producer barrier, then the stores. So the float16 rings keep the 16-bit
        // kernel's three stages and shared memory (a separate staging ring left room for two
        // float16 stages: the same speed on an H200, while the 16-bit kernel with two stages
        // lost 8%: the FP8 kernel is bound elsewhere. ncu: issue slots 39% busy in both kernels,
        // the FP8 kernel's shared-memory wavefronts 1.5x the 16-bit kernel's; with the conversion
        // in integer instructions instead of cvt it ran 38% slower, so the producer's chain of
        // wait, load, convert, store and fence per tile is on the critical path). The stores
        // are generic-proxy writes: fence.proxy.async, then a plain arrival on the full barrier.
        // In a tile the mask crosses, the V pass of the guards scans the widened chunks (as
        // prefill.cuh's mma kernel does). kSplitQ: K is not widened; its rows are copied into
        // the stage's first half in the swizzled layout wgmma reads, and its full barrier takes
        // the copies' own arrivals (as the 16-bit kernel's): one producer barrier a tile. Prefill
        // self-test, H200, e4m3 with per-head scales, bf16 q: 8 x (2048 + 512) 433-435 -> 466-467
        // TFLOP/s, 1 x (0 + 8192) 513-515 -> 553-554 (ffi/NOTES.md, round 25).
        constexpr int F8 = S::kF8Chunks, F8R = S::kF8Rows, R8 = BN / F8R, F8T = S::kF8TileBytes;
        const C* kg = static_cast<const C*>(p.k) + kvh * kv.head_stride;
        const C* vg = static_cast<const C*>(p.v) + kvh * kv.head_stride;
        int r8, c8;
        fp8_widen_chunk<F8>(tid, r8, c8);
        // 32-bit shared addresses (with generic pointers the producer spilled at its 64
        // registers): this thread's rows lie F8R rows apart, F8R * D bytes in the FP8 rows and
        // F8R * 128 in the swizzled tile (one swizzle phase).
        // kSplitQ: the FP8 rows (K, the B operand of the FP8 S, and V's staging alike) are
        // [128 keys][128 bytes] with the 128-byte swizzle; F8R rows keep the swizzle phase, and
        // a quarter-warp's staging reads still meet 8 bank groups.
        const uint32_t src_own = kSplitQ ? sm90_tile_off<BN>(r8, c8) : uint32_t(r8 * D + c8 * 16);
        const uint32_t lo_own = sm90_tile_off<BN>(r8, 2 * c8);
        const uint32_t hi_own = sm90_tile_off<BN>(r8, 2 * c8 + 1);
        // A thread's rows first .. first + N - 1 (of its R8): their staged FP8 chunks loaded,
        // and widened into the swizzled float16 tile.
        auto load_own = [&](uint32_t src, auto& raw, int first) {
          constexpr int N = sizeof(raw) / sizeof(raw[0]);
#pragma unroll
          for (int i = 0; i < N; ++i) raw[i] = lds128_at(src + src_own + (first + i) * F8R * D);
        };
        auto store_own = [&](const auto& raw, uint32_t dst, int first) {
          constexpr int N = sizeof(raw) / sizeof(raw[0]);
#pragma unroll
          for (int i = 0; i < N; ++i) {
            uint4 lo, hi;
            fp8x16_to_f16<C>(raw[i], lo, hi);
            sts128_at(dst + lo_own + (first + i) * F8R * 128, lo);
            sts128_at(dst + hi_own + (first + i) * F8R * 128, hi);
          }
        };
        // kSplitQ: V widened half a thread's rows at a time: the whole set of FP8 chunks held
        // at once made ptxas spill in the producer once K's widening was gone.
        constexpr int R8H = R8 / 2;
        auto widen_half = [&](uint32_t src, uint32_t dst, int h, auto wait) {
          uint4 raw[R8H];
          load_own(src, raw, h * R8H);
          wait();
          store_own(raw, dst, h * R8H);
        };
        // Tile n's V is widened in iteration n + kLag, after the copies of the tiles after it
        // are issued. kSplitQ: two tiles of copies in flight before the producer waits for
        // one (K needs no widening there, so only V waits the extra tile).
        constexpr int kLag = kSplitQ ? 2 : 1;
        for (int n = 0; n < ntiles + kLag; ++n) {
          const int slot = n & 1;
          if (n < ntiles) {
            const int gn = it0 + n, s = gn % NS;  // ring position
            cur.advance_ahead(kv, ahead, n * BN + tid, BN, range.end, flags);
            ahead = RowCursor::entry_ahead(kv, t.table, (n + 2) * BN + tid, range.end);
            if (gn >= NS) mbar_wait(kempty(s), ((gn / NS) & 1) ^ 1);
            // K's rows, then V's, their offsets read before their copies; a copy's source is one
            // wide multiply-add of the row's offset (8-byte units for 1-byte elements) onto this
            // thread's chunk.
            auto copy_rows = [&](uint32_t dst, const C* src) {
              const uint64_t chunk = reinterpret_cast<uint64_t>(src) + uint64_t(c8) * 16u;
              uint32_t u[R8];
#pragma unroll
              for (int i = 0; i < R8; ++i) u[i] = rowoff[slot * BN + r8 + i * F8R];
              if (kAllRows && all_rows) {  // every row present: no test, no select
#pragma unroll
                for (int i = 0; i < R8; ++i)
                  async_copy16_at(dst + i * F8R * D, sm90_row_address<8>(chunk, u[i]), true);
              } else {
#pragma unroll
                for (int i = 0; i < R8; ++i) {
                  const bool ok = u[i] != kSm90NoRow;
                  async_copy16_at(dst + i * F8R * D, sm90_row_address<8>(chunk, ok ? u[i] : 0u),
                                  ok);
                }
              }
            };
            const uint32_t kst = k_s + uint32_t(s * S::kTileBytes);
            copy_rows(kst + src_own, kg);
            copy_rows(kst + F8T + src_own, vg);
            // kSplitQ: K is ready as copied; its arrival lands with this thread's copies.
            if constexpr (kSplitQ) mbar_arrive_copies(kfull(s));
            async_copy_commit();
          }
#if JAXATTN_SM90_FP8_ONE_BARRIER
          // The next tile's row offsets first, so that one producer barrier a tile serves them
          // and the in-place K stores below.
          if (n < ntiles) rowoff[(slot ^ 1) * BN + tid] = sm90_pack_off(cur.off);
          if (n == 0) named_sync(1, NP);
#endif
          if (n >= kLag) {
            const int m = n - kLag, gm = it0 + m, s = gm % NS;
            if (n < ntiles) {
              async_copy_wait<kLag>();
            } else {
              async_copy_wait<0>();
            }
            const uint32_t kst = k_s + uint32_t(s * S::kTileBytes);
            const uint32_t vt = v_s + uint32_t(s * S::kTileBytes);
            [[maybe_unused]] uint4 raw[R8];
            auto wait_v = [&]() {
              if (gm >= NS) mbar_wait(vempty(s), ((gm / NS) & 1) ^ 1);
            };
            if constexpr (kSplitQ) {
#if JAXATTN_SM90_FP8_TIMING_NO_WIDEN < 2
              widen_half(kst + F8T, vt, 0, wait_v);
              widen_half(kst + F8T, vt, 1, [] {});
#else
              wait_v();
#endif
            } else {
#if JAXATTN_SM90_FP8_TIMING_NO_WIDEN < 2
              load_own(kst + F8T, raw, 0);
#endif
              wait_v();
#if JAXATTN_SM90_FP8_TIMING_NO_WIDEN < 2
              store_own(raw, vt, 0);
#endif
            }
            if (m * BN + BN > range.full_end) {
              guards_free();
              unsigned char* const vt_gen = gen + (vt - base);
              const bool lo = sanitize_own_v<M, R8, F8R * 128, F8R>(
                  vt_gen + lo_own, m * BN + r8, range.full_end, range.end, c8 * 16, first_bad);
              const bool hi = sanitize_own_v<M, R8, F8R * 128, F8R>(
                  vt_gen + hi_own, m * BN + r8, range.full_end, range.end, c8 * 16 + 8, first_bad);
              if (lo || hi) flags |= kGuardValueBad;
            }
            sm90_fence_proxy_async();
            mbar_arrive(vfull(s));
            if constexpr (!kSplitQ) {
#if JAXATTN_SM90_FP8_TIMING_NO_WIDEN < 1
              load_own(kst, raw, 0);
              named_sync(1, NP);  // every producer thread holds its FP8 K (and V) chunks
              store_own(raw, kst, 0);
#endif
              sm90_fence_proxy_async();
              mbar_arrive(kfull(s));
            }
          }
#if !JAXATTN_SM90_FP8_ONE_BARRIER
          if (n < ntiles) {
            rowoff[(slot ^ 1) * BN + tid] = sm90_pack_off(cur.off);
            // slot ^ 1 written, as in the 16-bit loop
            if constexpr (kAllRows) {
              all_rows = named_sync_and(1, NP, cur.off >= 0);
            } else {
              named_sync(1, NP);
            }
          }
#endif
        }
      } else {
        const T* kg = static_cast<const T*>(p.k) + kvh * kv.head_stride;
        const T* vg = static_cast<const T*>(p.v) + kvh * kv.head_stride;
        const uint32_t v_own = sm90_tile_off<BN>(r0, c);
        Sm90WaitClock wclk;
        for (int n = 0; n < ntiles; ++n) {
          const int gn = it0 + n, s = gn % NS, slot = n & 1;  // ring position gn
          const uint32_t par = ((gn / NS) & 1) ^ 1;
          // Row tid of tile n + 1 from the entry loaded last iteration; then tile n + 2's entry.
          cur.advance_ahead(kv, ahead, n * BN + tid, BN, range.end, flags);
          ahead = RowCursor::entry_ahead(kv, t.table, (n + 2) * BN + tid, range.end);
          // This thread's rows of tile n, kBatch at a time: their offsets are read before the
          // batch's copies (a copy is a memory clobber, so a shared load after one would wait for
          // it: row by row, every copy waited for its offset).
          constexpr int kRows = BN / RP, kBatch = kRows < 8 ? kRows : 8;
          // A copy's source in bytes from this thread's chunk of the head: one wide multiply-add
          // of the row's 16-byte offset (a missing row reads nothing, from the chunk itself).
          // When every row of the tile is present (all_rows, uniform over the producer) a copy
          // is its offset's load, the multiply-add and the copy; otherwise a missing row also
          // needs its test and a select, and reads nothing.
          auto copy_rows = [&](uint32_t dst, const T* src) {
            const uint64_t chunk = reinterpret_cast<uint64_t>(src) + uint64_t(c) * 16u;
            auto batches = [&](auto all_tag) {
              constexpr bool kAll = decltype(all_tag)::value;
#pragma unroll
              for (int b = 0; b < kRows; b += kBatch) {
                uint32_t u[kBatch];
                static_assert(kBatch % 4 == 0, "16-byte loads of whole groups of four rows");
#pragma unroll
                for (int i = 0; i < kBatch; i += 4) {
                  const uint4 w =
                      *reinterpret_cast<const uint4*>(rowoff + slot * BN + r0 * (BN / RP) + b + i);
                  u[i] = w.x, u[i + 1] = w.y, u[i + 2] = w.z, u[i + 3] = w.w;
                }
#pragma unroll
                for (int i = 0; i < kBatch; ++i) {
                  const bool ok = kAll || u[i] != kSm90NoRow;
                  // sm90_tile_off<BN>(r0 + (b + i) * RP, c): RP rows keep the swizzle phase.
                  async_copy16_at(dst + v_own + uint32_t((b + i) * RP * 128),
                                  sm90_row_address<16>(chunk, ok ? u[i] : 0u), ok);
                }
              }
            };
            if (JAXATTN_SM90_ALL_ROWS && all_rows) {
              batches(std::true_type{});
            } else {
              batches(std::false_type{});
            }
          };
          wclk.start();
          if (gn >= NS) mbar_wait(kempty(s), par);
          wclk.stop(kWaitProducerK);
          wclk.start();
#if JAXATTN_SM90_TIMING_NO_COPY < 1
          copy_rows(k_s + uint32_t(s * S::kTileBytes), kg);
#endif
          mbar_arrive_copies(kfull(s));
          wclk.stop(kWaitProducerCopies);
          wclk.start();
          if (gn >= NS) mbar_wait(vempty(s), par);
          wclk.stop(kWaitProducerV);
          wclk.start();
          const uint32_t vd = v_s + uint32_t(s * S::kTileBytes);
#if JAXATTN_SM90_TIMING_NO_COPY < 2
          copy_rows(vd, vg);
#endif
          wclk.stop(kWaitProducerCopies);
          wclk.count(kWaitProducerTiles);
          if (n * BN + BN > range.full_end) {  // keys the mask hides from some rows: the guards
            async_copy_commit();
            async_copy_wait<0>();
            guards_free();
            if (sanitize_own_v<T, BN / RP, RP * 128, RP>(gen + (vd - base) + v_own, n * BN + r0,
                                                         range.full_end, range.end, c * 8,
                                                         first_bad))
              flags |= kGuardValueBad;
            sm90_fence_proxy_async();
            mbar_arrive(vfull(s));
          } else {
            mbar_arrive_copies(vfull(s));
          }
          rowoff[(slot ^ 1) * BN + off_at] = sm90_pack_off(cur.off);
          // slot ^ 1 written; every producer thread is done reading it
          wclk.start();
          all_rows = named_sync_and(1, NP, cur.off >= 0);
          wclk.stop(kWaitProducerSync);
        }
        if constexpr (!kPersist) wclk.flush();
      }
      if constexpr (kPersist) {
        // The guards' flags (and first_bad) to the consumers, through flags_full.
        guards_free();
        if (flags) atomicOr(&block_flags, flags);
        mbar_arrive(flags_full);
        it0 += ntiles;
        ++nvalid;
      } else {
        async_copy_commit();
        async_copy_wait<0>();
        // Hands the guards' flags (and, ordered by the barrier, first_bad) to the consumers.
        if (flags) atomicOr(&block_flags, flags);
        named_arrive(4, S::kThreads);
      }
    }  // items
    if constexpr (kPersist) {
      async_copy_commit();
      async_copy_wait<0>();
    }
  } else {
    // ---------------------------------- consumers ----------------------------------
    set_max_regs_inc<(kPersist ? kSm90PersistConsumerRegs : kSm90ConsumerRegs)>();
    if constexpr (kPersist) {
      // The thread's position, read again after the allocation (computed before it, ptxas
      // kept a value across setmaxnreg in local memory).
      uint32_t x;
      asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(x));
      tq = int(x % 4u);
      lr0 = int(x / 128u - 1u) * 64 + int((x / 32u) % 4u) * 16 + int((x % 32u) / 4u);
    }
    const int cw = wg - 1;
    const uint64_t dq = sm90_desc(q_s + uint32_t(cw * 64 * 128), 16, 1024);
    const uint64_t dk = sm90_desc(k_s, 16, 1024);
    const uint64_t dv = sm90_desc(v_s, BN * 128, 1024);
    auto kstep = [](int kk, int rows) {
      return uint64_t(((kk / 4) * rows * 128 + (kk % 4) * 32) >> 4);
    };
    for (int round = 0; kPersist || round < 1; ++round) {  // once without kPersist
      if constexpr (kPersist) {
        mbar_wait(rec_full, round & 1);
        if (rec[0] < 0) break;  // the end record
        const bool valid = rec[0] != 0;
        head = rec[1];  // the consumers need neither t.b nor t.table
        t.m0 = rec[2];
        t.rows = rec[3];
        t.q0 = rec[4];
        t.lq = rec[5];
        t.lk = rec[6];
        mbar_arrive(rec_empty);  // this thread has read the record
        if (!valid) continue;
        set_item();
      }
      // kSplitQ, before the accumulators are live (with them, ptxas spilled around the split).
      [[maybe_unused]] float qpost0 = 1.f, qpost1 = 1.f;
      if constexpr (kSplitQ) {
        if (ntiles > 0) {
          mbar_wait(qfull, nvalid & 1);
          // A bf16 q over an FP8 cache at head_dim 128: each quad splits its rows lr0 and lr0 + 8
          // (a quarter row a thread: bf16 chunks 4 tq .. 4 tq + 3, FP8 chunks 2 tq, 2 tq + 1) into
          // e4m3 hi and lo terms, scaled by the power of two that puts the row's largest |q| in
          // [2^7, 2^8); the inverse joins the row's logit factor. The hi tile takes the bytes of
          // the 16-bit q's first column block, the lo tile the second's, and a warpgroup's rows
          // stay in its own half of each, so a warpgroup barrier between the loads and the
          // stores is all the rewrite needs.
          constexpr int QC = CH / 4;
          uint4 v0[QC], v1[QC];
          float mx0, mx1;
          sm90_q_quarter_rows<BM>(gen, lr0, tq, v0, v1, mx0, mx1);
          float pre0, post0, pre1, post1;
          pow2_row_factors<7>(mx0, pre0, post0);
          pow2_row_factors<7>(mx1, pre1, post1);
          named_sync(2 + cw, 128);  // the warpgroup's rows are all loaded
          auto split_row = [&](const uint4(&v)[QC], float pre, int r) {
            uint32_t hw[2 * QC], lw[2 * QC];
#pragma unroll
            for (int i = 0; i < QC; ++i) {
              const uint32_t w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
              for (int j = 0; j < 2; ++j) {
                uint32_t h0, l0, h1, l1;
                bf16x2_to_e4m3x2_split(w[2 * j], pre, h0, l0);
                bf16x2_to_e4m3x2_split(w[2 * j + 1], pre, h1, l1);
                hw[2 * i + j] = h0 | (h1 << 16);
                lw[2 * i + j] = l0 | (l1 << 16);
              }
            }
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const uint32_t off = sm90_tile_off<BM>(r, 2 * tq + j);
              *reinterpret_cast<uint4*>(gen + off) =
                  make_uint4(hw[4 * j], hw[4 * j + 1], hw[4 * j + 2], hw[4 * j + 3]);
              *reinterpret_cast<uint4*>(gen + BM * 128 + off) =
                  make_uint4(lw[4 * j], lw[4 * j + 1], lw[4 * j + 2], lw[4 * j + 3]);
            }
          };
          split_row(v0, pre0, lr0);
          split_row(v1, pre1, lr0 + 8);
          qpost0 = post0;
          qpost1 = post1;
          sm90_fence_proxy_async();
          named_sync(2 + cw, 128);
        }
      }
      float o[D / 2];  // O accumulator fragment (m64nDk16 layout)
      float s[BN / 2];
      uint32_t pf[BN / 4];
      float l0 = 0.f, l1 = 0.f;
#pragma unroll
      for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
#pragma unroll
      for (int i = 0; i < BN / 4; ++i) pf[i] = 0u;
      float m0 = kNegInf, m1 = kNegInf;
      const int row0 = t.m0 + pack_token<kPack>(p, lr0);
      const int row1 = t.m0 + pack_token<kPack>(p, lr0 + 8);
      // The rows' logit factors (a bf16 q over an FP8 cache: times the rows' q factors, below).
      float qs0 = p.ls.q_scale * p.scales.k_of(kvh) * qpost0,
            qs1 = p.ls.q_scale * p.scales.k_of(kvh) * qpost1;
      const float cap = p.ls.cap_log2e;
      auto release = [&](uint32_t bar) {
        if (lane == 0) mbar_arrive(bar);
      };
      auto issue_s = [&](int n) {
        const uint64_t dks = dk + uint64_t(((n % NS) * S::kTileBytes) >> 4);
        if constexpr (kSplitQ) {
          // S = Q_lo K^T + Q_hi K^T, k steps of 32 FP8 elements (32 bytes, as 16 of 16 bits).
          // q's hi terms [128 rows][128 bytes] lie where the first column block of the 16-bit q
          // was, the lo terms where the second was (kQLo further, in 16-byte units).
          // The order matters: FP8 wgmma adds its products and the accumulator aligned to the
          // largest of them, keeping ~14 bits. The lo products first, into an accumulator of
          // their own size; then the hi products (exact: 4 x 4 significant bits), beside which
          // only the lo sum's bits below ~2^-10 of it are lost. Hi first, the lo products were
          // added to a sum ~2^4 times larger: up to 4.4x the kernel's error of the float16
          // path in the prefill self-test's FP8 cases, against at most 1.4x this way.
          constexpr uint64_t kQLo = (BM * 128) >> 4;
#pragma unroll
          for (int kk = 0; kk < D / 32; ++kk)
            sm90_mma_ss_n128_f8<C>(s, dq + kstep(kk, BM) + kQLo, dks + kstep(kk, BN), kk);
#pragma unroll
          for (int kk = 0; kk < D / 32; ++kk)
            sm90_mma_ss_n128_f8<C>(s, dq + kstep(kk, BM), dks + kstep(kk, BN), 1);
        } else {
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk)
            sm90_mma_ss_n128<M>(s, dq + kstep(kk, BM), dks + kstep(kk, BN), kk);
        }
        sm90_wgmma_commit();
      };
      auto issue_pv = [&](int n) {
        const uint64_t dvs = dv + uint64_t(((n % NS) * S::kTileBytes) >> 4);
#pragma unroll
        for (int j = 0; j < BN / 16; ++j) sm90_mma_rs<M, D>(o, pf + 4 * j, dvs + uint64_t(j * 128));
        sm90_wgmma_commit();
      };
      float a0 = 0.f, a1 = 0.f, sum0 = 0.f, sum1 = 0.f;
      auto softmax = [&](int n, auto mask_tag, auto fold_tag) {
        constexpr bool kMask = decltype(mask_tag)::value;
        constexpr bool kFold = decltype(fold_tag)::value;
        const int n0 = n * BN;
        const int lim0 = min(t.lk - 1, row0 + shift) - n0 - 2 * tq;
        const int lim1 = min(t.lk - 1, row1 + shift) - n0 - 2 * tq;
        constexpr int NC = JAXATTN_SM90_CHAINS;
        float mxp0[NC], mxp1[NC];
#pragma unroll
        for (int i = 0; i < NC; ++i) mxp0[i] = mxp1[i] = kNegInf;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float v = s[4 * j + e];
            if constexpr (!kFold) {
              v *= e < 2 ? qs0 : qs1;
              if (cap > 0.f) v = cap * tanhf(v);
            }
            if constexpr (kMask) {
              if (j * 8 + (e & 1) > (e < 2 ? lim0 : lim1)) v = kNegInf;
            }
            s[4 * j + e] = v;
          }
          mxp0[j % NC] = fmaxf(mxp0[j % NC], fmaxf(s[4 * j], s[4 * j + 1]));
          mxp1[j % NC] = fmaxf(mxp1[j % NC], fmaxf(s[4 * j + 2], s[4 * j + 3]));
        }
#pragma unroll
        for (int i = 1; i < NC; ++i) {
          mxp0[0] = fmaxf(mxp0[0], mxp0[i]);
          mxp1[0] = fmaxf(mxp1[0], mxp1[i]);
        }
        float mx0 = group_max<4>(mxp0[0]);
        float mx1 = group_max<4>(mxp1[0]);
        if constexpr (kFold) {
          mx0 *= qs0;
          mx1 *= qs1;
        }
        float mu0, mu1;
        online_max_step<JAXATTN_SM90_RESCALE_SLACK>(mx0, mx1, m0, m1, a0, a1, mu0, mu1);
        const float sc0 = kFold ? qs0 : 1.f, sc1 = kFold ? qs1 : 1.f;
        float smp0[NC], smp1[NC];
#pragma unroll
        for (int i = 0; i < NC; ++i) smp0[i] = smp1[i] = 0.f;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          s[4 * j] = fast_exp2(fmaf(s[4 * j], sc0, -mu0));
          s[4 * j + 1] = fast_exp2(fmaf(s[4 * j + 1], sc0, -mu0));
          s[4 * j + 2] = fast_exp2(fmaf(s[4 * j + 2], sc1, -mu1));
          s[4 * j + 3] = fast_exp2(fmaf(s[4 * j + 3], sc1, -mu1));
          smp0[j % NC] += s[4 * j] + s[4 * j + 1];
          smp1[j % NC] += s[4 * j + 2] + s[4 * j + 3];
        }
#pragma unroll
        for (int i = 1; i < NC; ++i) {
          smp0[0] += smp0[i];
          smp1[0] += smp1[i];
        }
        sum0 = smp0[0];
        sum1 = smp1[0];
      };
      using True = std::true_type;
      using False = std::false_type;
      const bool fold = !(cap > 0.f) && qs0 > 0.f && qs1 > 0.f;
      auto softmax_tile = [&](int n) {
        const bool masked = n * BN + BN > range.full_end;
        if (fold) {
          if (masked) {
            softmax(n, True{}, True{});
          } else {
            softmax(n, False{}, True{});
          }
        } else {
          if (masked) {
            softmax(n, True{}, False{});
          } else {
            softmax(n, False{}, False{});
          }
        }
      };
      // Once the running maxima settle (most tiles of a long row) every factor is exactly 1
      // (ex2 of 0): the warp then skips the D / 2 multiplies of its O fragment.
      auto rescale_pack = [&]() {
        l0 = l0 * a0 + sum0;
        l1 = l1 * a1 + sum1;
        if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {
#pragma unroll
          for (int i = 0; i < D / 8; ++i) {
            o[4 * i] *= a0;
            o[4 * i + 1] *= a0;
            o[4 * i + 2] *= a1;
            o[4 * i + 3] *= a1;
          }
        }
#pragma unroll
        for (int i = 0; i < BN / 4; ++i) pf[i] = pack2<M>(s[2 * i], s[2 * i + 1]);
      };

      Sm90WaitClock wclk;
      const long long span0 = wclk.mark();
      if constexpr (kPersist) {
        if (ntiles == 0) {  // q came all the same: take it and hand it back
          mbar_wait(qfull, nvalid & 1);
          release(qempty);
        }
      }
      if (ntiles > 0) {
        mbar_wait(qfull, nvalid & 1);
        if constexpr (kWidenQ) {
          // A bf16 q over an FP8 cache: each quad moves its rows lr0 and lr0 + 8 to float16 in
          // place (a quarter of each row a thread), scaled by the power of two that puts the
          // row's largest |q| in [2^14, 2^15); the inverse joins the row's logit factor. The
          // warpgroup's 64 rows are its wgmma A operand: fence, then a warpgroup barrier.
          constexpr int QC = CH / 4;
          uint4 v0[QC], v1[QC];
          float mx0, mx1;
          sm90_q_quarter_rows<BM>(gen, lr0, tq, v0, v1, mx0, mx1);
          float pre0, post0, pre1, post1;
          f16_row_factors(mx0, pre0, post0);
          f16_row_factors(mx1, pre1, post1);
#pragma unroll
          for (int i = 0; i < QC; ++i) {
            *reinterpret_cast<uint4*>(gen + sm90_tile_off<BM>(lr0, tq * QC + i)) =
                make_uint4(bf16x2_to_f16x2(v0[i].x, pre0), bf16x2_to_f16x2(v0[i].y, pre0),
                           bf16x2_to_f16x2(v0[i].z, pre0), bf16x2_to_f16x2(v0[i].w, pre0));
            *reinterpret_cast<uint4*>(gen + sm90_tile_off<BM>(lr0 + 8, tq * QC + i)) =
                make_uint4(bf16x2_to_f16x2(v1[i].x, pre1), bf16x2_to_f16x2(v1[i].y, pre1),
                           bf16x2_to_f16x2(v1[i].z, pre1), bf16x2_to_f16x2(v1[i].w, pre1));
          }
          qs0 *= post0;
          qs1 *= post1;
          sm90_fence_proxy_async();
          named_sync(2 + cw, 128);
        }
        wclk.start();
        mbar_wait(kfull(it0 % NS), (it0 / NS) & 1);
        wclk.stop(kWaitConsumerK);
        wclk.count(kWaitConsumerTiles);
        sm90_fence_proxy_async();
        sm90_wgmma_fence();
        issue_s(it0);
        sm90_wgmma_wait<0>();
        sm90_pin(s);
        release(kempty(it0 % NS));
        if constexpr (kPersist) {
          if (ntiles == 1) release(qempty);  // the item's last S has read q
        }
        softmax_tile(0);
        rescale_pack();
      }
      for (int n = 1; n < ntiles; ++n) {
        const int gn = it0 + n, sk = gn % NS, sv = (gn - 1) % NS;  // ring positions
        wclk.start();
        mbar_wait(kfull(sk), (gn / NS) & 1);
        wclk.stop(kWaitConsumerK);
        wclk.start();
        mbar_wait(vfull(sv), ((gn - 1) / NS) & 1);
        wclk.stop(kWaitConsumerV);
        wclk.count(kWaitConsumerTiles);
        sm90_fence_proxy_async();
        sm90_wgmma_fence();
        issue_s(gn);       // group 1: S = Q K_n^T
        issue_pv(gn - 1);  // group 2: O += P_{n-1} V_{n-1}
        sm90_wgmma_wait<1>();
        sm90_pin(s);
        release(kempty(sk));
        if constexpr (kPersist) {
          if (n == ntiles - 1) release(qempty);
        }
        softmax_tile(n);
        sm90_wgmma_wait<0>();
        sm90_pin(o);
        sm90_pin(pf);
        release(vempty(sv));
        rescale_pack();
      }
      if (ntiles > 0) {
        const int gl = it0 + ntiles - 1, sv = gl % NS;
        wclk.start();
        mbar_wait(vfull(sv), (gl / NS) & 1);
        wclk.stop(kWaitConsumerV);
        sm90_fence_proxy_async();
        sm90_wgmma_fence();
        issue_pv(gl);
        sm90_wgmma_wait<0>();
        sm90_pin(o);
        sm90_pin(pf);
        wclk.add_since(kWaitConsumerSpan, span0);
        // The item's last V stage back to the producer: its ring runs on into the next item
        // (the one-tile kernel ends here, and its producer waits for no later stage).
        if constexpr (kPersist) release(vempty(sv));
      }
      l0 = group_sum<4>(l0);
      l1 = group_sum<4>(l1);
      if constexpr (kPersist) {
        mbar_wait(flags_full, nvalid & 1);  // the producer's flags
      } else {
        named_sync(4, S::kThreads);  // the producer's flags
      }
      const int f = block_flags;
      const bool poisoned = (f & kGuardIndexBad) != 0;
      prefill_mma_store_rows<T, D, kPack>(p, t, head, lr0, tq, l0, l1, p.scales.v_of(kvh), o,
                                          f ? first_bad : nullptr, poisoned, f ? shift : 0);
      if constexpr (!kPersist) wclk.flush();
      if constexpr (kPersist) {
        if (f) {
          // Every consumer has read them: the guards' state back to clean for the next item.
          named_sync(5, 256);
          init_first_bad<D>(first_bad, tid - 128, 256);
          if (tid == 128) block_flags = 0;
        }
        mbar_arrive(item_done);
        it0 += ntiles;
        ++nvalid;
      }
    }  // items
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

// The persistent launch: one block an SM (the kernel's shared memory allows no more), each
// claiming work items (sm90_items) until none is left. Instantiated in prefill_sm90_persistent.cu,
// a translation unit of its own so that the two launches' kernels compile in parallel.
template <typename T, typename C, int D, bool kPack>
const char* launch_prefill_sm90_persistent(const PrefillParams& p, gpuStream_t stream)
#if defined(JAXATTN_SM90_PERSISTENT_TU)
{
  using S = Sm90Shape<D, sizeof(C) == 1>;
  auto kernel = prefill_sm90_kernel<T, C, D, kPack, true>;
  if (const char* e = allow_dynamic_smem(kernel, S::kSmemBytes)) return e;
  const int64_t items = sm90_items(p);
  if (items > 0x7fffffff) return "jaxattn: too many prefill tiles for the persistent kernel";
  if (p.work_counter == nullptr) return "jaxattn: the persistent prefill needs a work counter";
  int blocks = p.persistent_blocks;  // set by tests and experiments; 0: one a multiprocessor
  if (blocks <= 0) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&blocks, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        blocks < 1)
      return "jaxattn: cannot read the multiprocessor count";
  }
  const dim3 grid(unsigned(items < blocks ? items : blocks));
  if (gpuMemsetAsync(p.work_counter, 0, sizeof(uint32_t), stream) != gpuSuccess)
    return "jaxattn: cannot zero the persistent prefill's work counter";
  kernel<<<grid, S::kThreads, S::kSmemBytes, stream>>>(p);
  return check_launch();
}
#else
    ;
#endif

template <typename T, typename C, int D>
const char* launch_prefill_sm90_d(const PrefillParams& p, gpuStream_t stream) {
  using S = Sm90Shape<D, sizeof(C) == 1>;
  const bool persistent = p.kernel == int(PrefillKernel::kSm90Persistent);
  PrefillParams q = p;
  if (prefill_sm90_packs(p)) {
    // GQA: the group's heads packed into each tile's rows (BM / group tokens a tile).
    q.pack_heads = p.num_q_heads / p.kv.num_kv_heads;
    q.pack_magic = uint32_t((uint64_t(1) << 32) / uint64_t(q.pack_heads) + 1);
    if (persistent) return launch_prefill_sm90_persistent<T, C, D, true>(q, stream);
    return launch_prefill_tiles<S>(prefill_sm90_kernel<T, C, D, true>, q, stream);
  }
  if (persistent) return launch_prefill_sm90_persistent<T, C, D, false>(q, stream);
  return launch_prefill_tiles<S>(prefill_sm90_kernel<T, C, D, false>, q, stream);
}

// Declared in prefill.cuh; instantiated in prefill_sm90.cu for T = bf16_t and f16_t, each with
// C = T and the FP8 formats.
template <typename T, typename C>
const char* launch_prefill_sm90(const PrefillParams& p, gpuStream_t stream) {
  static_assert(sizeof(T) == 2, "the sm90 kernel takes a 16-bit q");
  if (!prefill_sm90_fits(p)) return "jaxattn: the sm90 prefill kernel does not take this shape";
  return p.kv.head_dim == 64 ? launch_prefill_sm90_d<T, C, 64>(p, stream)
                             : launch_prefill_sm90_d<T, C, 128>(p, stream);
}

}  // namespace gpu
}  // namespace jaxattn

#endif  // JAXATTN_CUDA
