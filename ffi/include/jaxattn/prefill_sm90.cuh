// Hopper prefix prefill / extend attention: warpgroup MMA (wgmma.mma_async, sm_90a) for both
// GEMMs, FlashAttention-3 style. Same contract as the kernels of prefill.cuh (PrefillParams:
// paged K/V through a page-table row per request, the token pool as page size 1, bshd/bhsd
// through KvGeometry strides, row i of a request sees key j iff j <= i + (Lk - Lq), logits in
// base 2, f32 accumulation, output in q's dtype) and the same block -> (request, tile) map
// (find_prefill_tile: heaviest tiles of a request first, padding rows zeroed by the spare blocks).
//
// Only built for sm_90a (prefill_sm90.cu, -gencode arch=compute_90a,code=sm_90a); every other
// target sees the kernel with an empty body. Launched by launch_prefill_typed (prefill.cuh) for
// 16-bit dtypes with head_dim 64 or 128 on compute capability 9.0.
//
// Block: 256 threads = two warpgroups, 128 query rows of one request and one query head
// (warpgroup w owns rows 64w..64w+63), key tiles of 128. No warp specialisation: every thread
// copies and every warpgroup computes. GQA groups of 2..16 (prefill_sm90_packs) pack the
// group's query heads into the rows instead: row r is token r / G and head r % G of the
// block's KV head (G = PrefillParams::pack_heads, 128 / G tokens a tile), so a short extend of
// 24 new tokens x 4 heads fills 96 rows where one head filled 24, and each K/V tile is read
// once per KV head. The causal mask, the guards and the store take a row's token; nothing else
// changes.
//
// Shared memory (1024-byte aligned), each tile stored as D/64 column blocks of [rows][64]
// elements, 128 bytes a row, the 16-byte chunk c of row r at chunk c ^ (r % 8): the 128-byte
// swizzle of the wgmma descriptors (swizzle mode 1), so one layout serves
//   Q  [128 x D]  K-major A operand of S = Q K^T (descriptor per warpgroup: +64 rows),
//   K  [128 x D]  K-major B operand of S (rows are keys, D contiguous),
//   V  [128 x D]  MN-major B operand of O += P V (instruction transpose bit; LBO = distance
//                 between the 64-column blocks, SBO = 8 rows = 1024 bytes),
// a k step of 16 being +32 bytes inside the swizzled row (Q, K) or +16 rows (V). K and V tiles
// live in a ring of 3 stages (K then V per stage), filled with 16-byte cp.async copies of
// gathered rows (zero-filled past the request's keys, so unread slots and NaN-filled unused
// pages never enter a product), then two tiles' row offsets (uint32, 16-byte units;
// launch_prefill_typed falls back to the mma kernel when a cache is too large for them).
// D = 128: 32 KB Q + 3 x 64 KB K/V + 1 KB offsets + 1 KB alignment slack = 226 KB, plus the
// guards' first_bad as static shared memory (padded to 1 KB by the alignment of the dynamic
// array): 227 KB, the per-block limit, one block per SM.
//
// Iteration n >= 1 (one barrier): wait for tile n's copies (in a tile the mask crosses, scan the
// V chunks this thread copied: the guards, prefill.cuh), fence.proxy.async (cp.async and
// sanitising writes are generic-proxy, wgmma reads async-proxy), __syncthreads; issue S = Q
// K_n^T (D/16 x m64n128k16, both operands from shared memory) and O += P_{n-1} V_{n-1} (8 x
// m64nDk16, P from
// registers) as two wgmma groups; issue the copies of tile n + 1 into stage (n + 1) % 3
// (neither stage n nor stage n - 1 is touched) and advance the row cursors (RowCursor,
// incremental page addressing) for tile n + 2; wait for S only (wait_group 1); online softmax
// on the accumulator fragments (no cap: maxima on the raw dot products, one FFMA + ex2 per
// probability; with a cap: cap * tanh(s * q_scale) first; the mask only on tiles that cross
// the diagonal or the last key) while P_{n-1} V_{n-1} still runs; wait for it; rescale O; pack
// P_n to 16-bit A fragments (the m64nNk16 accumulator layout is the A-fragment layout). Tile 0
// is peeled (S only) and the last P V follows the loop, so every wgmma group in the loop is
// unconditional (with a conditional P V group ptxas either serialised the wgmma or turned the
// empty commit into a dummy group that made wait_group 1 wait for P V as well). Key tiles stop at
// the tile holding the last row's last visible key (key_range), exactly as the mma kernel.
//
// ptxas (nvcc 13.0): 247 registers (D = 64: 218), no spills, one block of 256 threads per SM.
#pragma once

#include <cstdint>
#include <type_traits>

#include "jaxattn/prefill.cuh"

#if defined(JAXATTN_CUDA)

namespace jaxattn {
namespace gpu {

template <int D>
struct Sm90Shape {
  static constexpr int kBM = 128;  // two consumer warpgroups x 64 rows
  static constexpr int kBN = 128;  // keys per tile
  static constexpr int kThreads = 256;
  static constexpr int kStages = 3;
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static constexpr int kRowsPerPass = kThreads / kChunks;
  static constexpr int kQBytes = kBM * D * 2;
  static constexpr int kTileBytes = kBN * D * 2;
  static constexpr int kStageBytes = 2 * kTileBytes;  // K tile, then V tile
  static constexpr int kOffBytes = 2 * kBN * 4;       // row offsets of two key tiles
  static constexpr int kSmemBytes = 1024 + kQBytes + kStages * kStageBytes + kOffBytes;
  static_assert(D == 64 || D == 128, "the sm90 kernel is built for head_dim 64 and 128");
  static_assert(kRowsPerPass % 8 == 0, "a thread's copy rows must share one swizzle phase");
  static_assert(kSmemBytes <= 232448, "more shared memory than an sm_90 block may have");
};

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

// D[64 x 128] (+)= A[64 x 16] B[16 x 128], A and B K-major in shared memory.
#define JAXATTN_SM90_SS_N128(TY)                                                     \
  asm volatile(                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                   \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {" JAXATTN_SM90_R64 \
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"                                             \
      : JAXATTN_SM90_ACC64                                                           \
      : "l"(da), "l"(db), "r"(scale_d)                                               \
      : "memory")
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
#undef JAXATTN_SM90_RS_N128
#undef JAXATTN_SM90_RS_N64
#undef JAXATTN_SM90_ACC64
#undef JAXATTN_SM90_ACC32
#undef JAXATTN_SM90_ACC8
#undef JAXATTN_SM90_R64
#undef JAXATTN_SM90_R32

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <typename T, int D, bool kPack>
__global__ void __launch_bounds__(Sm90Shape<D>::kThreads, 1)
    prefill_sm90_kernel(const PrefillParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = Sm90Shape<D>;
  constexpr int BM = S::kBM, BN = S::kBN, CH = S::kChunks, RP = S::kRowsPerPass;
  constexpr int NS = S::kStages;
  constexpr float kNegInf = -__builtin_huge_valf();
  extern __shared__ __align__(1024) unsigned char sm90_smem[];
  const uint32_t raw = smem_u32(sm90_smem);
  const uint32_t base = (raw + 1023u) & ~1023u;  // the swizzle patterns start on 1024 bytes
  const uint32_t q_s = base;
  const uint32_t kv_s = base + S::kQBytes;  // stage i: K at + i * kStageBytes, V kTileBytes on
  uint32_t* rowoff =
      reinterpret_cast<uint32_t*>(sm90_smem + (base - raw) + S::kQBytes + NS * S::kStageBytes);

  // The guards' first_bad (above kNoBadKey in prefill.cuh): static shared memory costs no
  // carveout (one block per SM at the per-block limit either way). find_prefill_tile's
  // barriers order the initialisation before any update.
  __shared__ int first_bad[D];
  init_first_bad<D>(first_bad, threadIdx.x, S::kThreads);
  // Packed tiles (G > 1): the block's G query heads share one KV head, tile row r is token
  // r / G and head `head` + r % G, so a tile holds BM / G tokens.
  const int G = kPack ? p.pack_heads : 1;
  const int head = blockIdx.y * G;
  PrefillTile t;
  // The tile search's scratch: stage 0 of the K/V ring, which the first copies fill after the
  // barrier that follows the row offsets below.
  if (!find_prefill_tile<T, S::kThreads>(p, BM / G, blockIdx.x, head,
                                         reinterpret_cast<int*>(sm90_smem + (kv_s - raw)), &t, G))
    return;
  const KvGeometry& kv = p.kv;
  const int kvh = head / (p.num_q_heads / kv.num_kv_heads);
  const int tid = threadIdx.x;
  const int wg = tid / 128, wl = (tid / 32) % 4, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  const int shift = t.lk - t.lq;
  const KeyRange range = key_range(t);
  const int ntiles = (range.end + BN - 1) / BN;

  int flags = 0;  // kGuardIndexBad, kGuardValueBad
  // Row offsets of key tiles 0 and 1; thread r < BN keeps the cursor of row r.
  RowCursor cur;
  if (tid < BN) {
    cur.init(kv, t.table, tid, range.end, flags);
    rowoff[tid] = sm90_pack_off(cur.off);
    cur.advance(kv, t.table, tid, BN, range.end, flags);
    rowoff[BN + tid] = sm90_pack_off(cur.off);
  }
  __syncthreads();

  const T* qg = static_cast<const T*>(p.q);
  const T* kg = static_cast<const T*>(p.k) + kvh * kv.head_stride;
  const T* vg = static_cast<const T*>(p.v) + kvh * kv.head_stride;
  const int c = tid % CH, r0 = tid / CH;  // this thread copies chunk c of rows r0 + i * RP
#pragma unroll
  for (int i = 0; i < BM / RP; ++i) {
    const int r = r0 + i * RP, tok = pack_token<kPack>(p, r);
    const bool ok = tok < t.rows;
    const T* src =
        ok ? qg + (int64_t(t.q0 + t.m0 + tok) * p.num_q_heads + head + r - tok * G) * D + c * 8
           : qg;
    cp_async16(q_s + sm90_tile_off<BM>(r, c), src, ok);
  }
  // K and V rows of one key tile into stage `stage`, from the offsets in slot `slot`.
  auto load_kv = [&](int stage, int slot) {
    const uint32_t kd = kv_s + uint32_t(stage * S::kStageBytes);
#pragma unroll
    for (int i = 0; i < BN / RP; ++i) {
      const int r = r0 + i * RP;
      const uint32_t u = rowoff[slot * BN + r];
      const bool ok = u != kSm90NoRow;
      const int64_t off = int64_t(u) << 3;
      const uint32_t dst = kd + sm90_tile_off<BN>(r, c);
      cp_async16(dst, ok ? kg + off + c * 8 : kg, ok);
      cp_async16(dst + S::kTileBytes, ok ? vg + off + c * 8 : vg, ok);
    }
  };
  if (ntiles > 0) load_kv(0, 0);
  async_copy_commit();
  check_entries<S::kThreads, 16>(t, kv, range.end, flags);  // while tile 0 is in flight

  // Descriptors. Q (A) and K (B of S): K-major, 8-row groups 1024 bytes apart (SBO), the
  // leading offset unused (1); k step kk is column block kk / 4 and 32 bytes per kk % 4.
  // V (B of P V): MN-major, LBO = the distance between 64-column blocks (BN rows of 128 bytes),
  // SBO = 8 key rows; k step j (16 keys) is 16 rows = 2048 bytes on.
  const uint64_t dq = sm90_desc(q_s + uint32_t(wg * 64 * 128), 16, 1024);
  const uint64_t dk = sm90_desc(kv_s, 16, 1024);
  const uint64_t dv = sm90_desc(kv_s + S::kTileBytes, BN * 128, 1024);
  auto kstep = [](int kk, int rows) {
    return uint64_t(((kk / 4) * rows * 128 + (kk % 4) * 32) >> 4);
  };

  float o[D / 2];       // O accumulator fragment: m64nDk16 layout
  float s[BN / 2];      // S accumulator fragment, then the probabilities
  uint32_t pf[BN / 4];  // P as 16-bit A fragments: pf[4 kk + i] feeds k step kk
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
#pragma unroll
  for (int i = 0; i < BN / 4; ++i) pf[i] = 0u;
  float m0 = kNegInf, m1 = kNegInf, l0 = 0.f, l1 = 0.f;
  // Accumulator element 4j + e of this thread: row g (e < 2) or g + 8 of the warp's 16 rows,
  // column 8j + 2 tq + (e & 1).
  const int lr0 = wg * 64 + wl * 16 + g;  // this thread's rows within the tile
  const int row0 = t.m0 + pack_token<kPack>(p, lr0);  // and their tokens within the request
  const int row1 = t.m0 + pack_token<kPack>(p, lr0 + 8);
  const float qs = p.ls.q_scale * p.scales.k_of(kvh), cap = p.ls.cap_log2e;

  // This thread's V chunks of tile n: chunk c of rows r0 + i * RP, which share their swizzle
  // phase (RP % 8 == 0), so they lie RP rows apart. A sanitised chunk is published to wgmma by
  // tile_ready's fence.proxy.async and barrier.
  unsigned char* v_own = sm90_smem + (kv_s - raw) + S::kTileBytes + sm90_tile_off<BN>(r0, c);
  // Waits for tile n's copies and publishes them to every warpgroup's wgmma (async proxy).
  auto tile_ready = [&](int n) {
    async_copy_wait<0>();  // tile n is the only copy group in flight
    if (n * BN + BN > range.full_end &&
        sanitize_own_v<T, BN / RP, RP * 128, RP>(v_own + (n % NS) * S::kStageBytes, n * BN + r0,
                                                 range.full_end, range.end, c * 8, first_bad))
      flags |= kGuardValueBad;
    sm90_fence_proxy_async();
    __syncthreads();  // tile n visible; every thread is done with iteration n - 1
  };
  // Tile n + 1 goes to the stage of tile n - 2 (its last reader, iteration n - 1, is past the
  // barrier); its offsets were written in iteration n - 1. The cursors then step to tile n + 2,
  // whose offsets replace tile n's (read when tile n was issued, before the barrier).
  auto next_loads = [&](int n) {
    if (n + 1 < ntiles) load_kv((n + 1) % NS, (n + 1) % 2);
    async_copy_commit();
    if (tid < BN) {
      cur.advance(kv, t.table, (n + 1) * BN + tid, BN, range.end, flags);
      rowoff[(n % 2) * BN + tid] = sm90_pack_off(cur.off);
    }
  };
  auto issue_s = [&](int n) {
    const uint64_t dks = dk + uint64_t(((n % NS) * S::kStageBytes) >> 4);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      sm90_mma_ss_n128<T>(s, dq + kstep(kk, BM), dks + kstep(kk, BN), kk);
    }
    sm90_wgmma_commit();
  };
  auto issue_pv = [&](int n) {  // O += P_n V_n
    const uint64_t dvs = dv + uint64_t(((n % NS) * S::kStageBytes) >> 4);
#pragma unroll
    for (int j = 0; j < BN / 16; ++j) sm90_mma_rs<T, D>(o, pf + 4 * j, dvs + uint64_t(j * 128));
    sm90_wgmma_commit();
  };

  // Online softmax of tile n on the S fragments (left as probabilities in s): new row maxima,
  // the factors a0 / a1 that rescale the old O and l, this thread's partial row sums.
  // kFold (no soft cap, q_scale > 0, the usual case): maxima on the raw dot products and
  // p = exp2(s * q_scale - max) as one FFMA; otherwise logits = [cap *] [tanh](s * q_scale)
  // first, exactly as the mma kernel.
  float a0 = 0.f, a1 = 0.f, sum0 = 0.f, sum1 = 0.f;
  auto softmax = [&](int n, auto mask_tag, auto fold_tag) {
    constexpr bool kMask = decltype(mask_tag)::value;
    constexpr bool kFold = decltype(fold_tag)::value;
    // Last visible key of each row, relative to this thread's first column of the tile.
    const int n0 = n * BN;
    const int lim0 = min(t.lk - 1, row0 + shift) - n0 - 2 * tq;
    const int lim1 = min(t.lk - 1, row1 + shift) - n0 - 2 * tq;
    float mx0 = kNegInf, mx1 = kNegInf;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = s[4 * j + e];
        if constexpr (!kFold) {
          v *= qs;
          if (cap > 0.f) v = cap * tanhf(v);
        }
        if constexpr (kMask) {
          if (j * 8 + (e & 1) > (e < 2 ? lim0 : lim1)) v = kNegInf;
        }
        s[4 * j + e] = v;
      }
      mx0 = fmaxf(mx0, fmaxf(s[4 * j], s[4 * j + 1]));
      mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
    mx0 = group_max<4>(mx0);
    mx1 = group_max<4>(mx1);
    if constexpr (kFold) {  // to logits (q_scale > 0 keeps the order; -inf stays -inf)
      mx0 *= qs;
      mx1 *= qs;
    }
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float mu0 = mn0 == kNegInf ? 0.f : mn0, mu1 = mn1 == kNegInf ? 0.f : mn1;
    a0 = fast_exp2(m0 - mu0);
    a1 = fast_exp2(m1 - mu1);
    m0 = mn0;
    m1 = mn1;
    sum0 = 0.f;
    sum1 = 0.f;
    const float sc = kFold ? qs : 1.f;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      s[4 * j] = fast_exp2(fmaf(s[4 * j], sc, -mu0));
      s[4 * j + 1] = fast_exp2(fmaf(s[4 * j + 1], sc, -mu0));
      s[4 * j + 2] = fast_exp2(fmaf(s[4 * j + 2], sc, -mu1));
      s[4 * j + 3] = fast_exp2(fmaf(s[4 * j + 3], sc, -mu1));
      sum0 += s[4 * j] + s[4 * j + 1];
      sum1 += s[4 * j + 2] + s[4 * j + 3];
    }
  };
  using True = std::true_type;
  using False = std::false_type;
  const bool fold = !(cap > 0.f) && qs > 0.f;
  // Tiles wholly below full_end need no mask (the prefix stage); the rest cross the diagonal
  // or the last key.
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
  // Once P_{n-1} V_{n-1} is done: rescale O and l, and pack P_n into A fragments. Accumulator
  // elements (2i, 2i + 1) are one A register: rows g / g + 8 and key pairs in the order a0..a7
  // of the m64nNk16 A layout (pf[4 kk .. 4 kk + 3] is k step kk).
  auto rescale_pack = [&]() {
    l0 = l0 * a0 + sum0;  // each lane keeps partial row sums; the quad adds them at the end
    l1 = l1 * a1 + sum1;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[4 * i] *= a0;
      o[4 * i + 1] *= a0;
      o[4 * i + 2] *= a1;
      o[4 * i + 3] *= a1;
    }
#pragma unroll
    for (int i = 0; i < BN / 4; ++i) pf[i] = pack2<T>(s[2 * i], s[2 * i + 1]);
  };

  if (ntiles > 0) {
    // Tile 0: S only (no P V yet).
    tile_ready(0);
    sm90_wgmma_fence();
    issue_s(0);
    next_loads(0);
    sm90_wgmma_wait<0>();
    sm90_pin(s);
    softmax_tile(0);
    rescale_pack();
  }
  for (int n = 1; n < ntiles; ++n) {
    tile_ready(n);
    sm90_wgmma_fence();
    issue_s(n);       // group 1: S = Q K_n^T
    issue_pv(n - 1);  // group 2: O += P_{n-1} V_{n-1}
    next_loads(n);
    sm90_wgmma_wait<1>();  // S done; P_{n-1} V_{n-1} may still run
    sm90_pin(s);
    softmax_tile(n);
    sm90_wgmma_wait<0>();  // P_{n-1} V_{n-1} done: O and the P fragments are free
    sm90_pin(o);
    sm90_pin(pf);
    rescale_pack();
  }

  if (ntiles > 0) {
    sm90_wgmma_fence();
    issue_pv(ntiles - 1);
    sm90_wgmma_wait<0>();
    sm90_pin(o);
    sm90_pin(pf);
  }
  async_copy_wait<0>();

  l0 = group_sum<4>(l0);
  l1 = group_sum<4>(l1);
  prefill_mma_store<T, D, kPack>(p, t, head, lr0, tq, l0, l1, p.scales.v_of(kvh), o,
                          flags, first_bad);
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

// FP8 caches on the Hopper kernel: the same tiles and warpgroup products in float16 (every FP8
// value is exact there; a bf16 q is moved to float16 per row by a power of two, undone in the
// row's logit factor, as in the mma kernel). Key tiles are copied as stored (half the bytes)
// into a staging area and widened into the float16 K and V rings in shared memory; each thread
// widens exactly the chunks it copied (visible to it after its own wait, no barrier), so one
// staging slot serves: tile n + 2 is copied into it as soon as this thread has widened tile
// n + 1. Iteration n: barrier (tile n widened everywhere), S = Q K_n^T and O += P_{n-1} V_{n-1}
// issued, then -- while the tensor cores run them -- this thread waits for its copies of tile
// n + 1, widens them into K stage (n + 1) % 2 and V stage (n + 1) % 3 (their last readers, S_{n-1}
// and P_{n-2} V_{n-2}, finished in iteration n - 1), scans the V chunks it widened where the
// mask hides their keys from some rows (the guards, prefill.cuh), and issues its copies of tile
// n + 2; then the softmax as in the 16-bit kernel. The next iteration's fence.proxy.async and
// barrier publish the widened (and sanitised) tile, so nothing follows the loop but the last
// P V. Shared memory at D = 128: 32 KB Q + 2 x 32 KB K + 3 x 32 KB V + 32 KB staging + 1 KB
// offsets + 1 KB alignment slack = 226 KB, plus the guards' first_bad as static shared memory
// (as in the 16-bit kernel): 227 KB, one block per SM; the rows' q factors live over V stage 2
// until the first barrier of the loop has read them.
template <int D>
struct Sm90Fp8Shape {
  static constexpr int kBM = 128;
  static constexpr int kBN = 128;
  static constexpr int kThreads = 256;
  static constexpr int kKStages = 2;
  static constexpr int kVStages = 3;
  static constexpr int kChunks = D / 8;     // 16-byte float16 chunks a row
  static constexpr int kF8Chunks = D / 16;  // 16-byte FP8 chunks a row
  static constexpr int kF8Rows = kThreads / kF8Chunks;
  static constexpr int kRowsPerPass = kThreads / kChunks;
  static constexpr int kQBytes = kBM * D * 2;
  static constexpr int kTileBytes = kBN * D * 2;  // a float16 K or V tile
  static constexpr int kStageBytes = kBN * D;     // an FP8 K or V tile
  static constexpr int kOffBytes = 2 * kBN * 4;
  static constexpr int kSmemBytes =
      1024 + kQBytes + (kKStages + kVStages) * kTileBytes + 2 * kStageBytes + kOffBytes;
  static_assert(D == 64 || D == 128, "the sm90 kernel is built for head_dim 64 and 128");
  static_assert(kRowsPerPass % 8 == 0, "a thread's copy rows must share one swizzle phase");
  static_assert(kSmemBytes <= 232448, "more shared memory than an sm_90 block may have");
  static_assert(kBM * 4 <= kTileBytes, "the rows' q factors fit in a V stage");
};

template <typename T, typename C, int D>
__global__ void __launch_bounds__(Sm90Fp8Shape<D>::kThreads, 1)
    prefill_sm90_fp8_kernel(const PrefillParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = Sm90Fp8Shape<D>;
  using M = f16_t;
  constexpr int BM = S::kBM, BN = S::kBN, CH = S::kChunks, RP = S::kRowsPerPass;
  constexpr int F8 = S::kF8Chunks, F8R = S::kF8Rows;
  constexpr int KS = S::kKStages, VS = S::kVStages;
  constexpr float kNegInf = -__builtin_huge_valf();
  extern __shared__ __align__(1024) unsigned char sm90_smem[];
  const uint32_t raw = smem_u32(sm90_smem);
  const uint32_t base = (raw + 1023u) & ~1023u;  // the swizzle patterns start on 1024 bytes
  const uint32_t q_s = base;
  const uint32_t k_s = q_s + S::kQBytes;                // K stage i at + i * kTileBytes
  const uint32_t v_s = k_s + KS * S::kTileBytes;        // V stage i at + i * kTileBytes
  unsigned char* const gen = sm90_smem + (base - raw);  // generic pointer to `base`
  unsigned char* const st_s = gen + S::kQBytes + (KS + VS) * S::kTileBytes;  // FP8 K, then V
  uint32_t* rowoff = reinterpret_cast<uint32_t*>(st_s + 2 * S::kStageBytes);
  float* qpost = reinterpret_cast<float*>(gen + S::kQBytes + (KS + 2) * S::kTileBytes);

  // The guards' first_bad, as in prefill_sm90_kernel.
  __shared__ int first_bad[D];
  init_first_bad<D>(first_bad, threadIdx.x, S::kThreads);
  const int head = blockIdx.y;
  PrefillTile t;
  // The tile search's scratch: the FP8 staging, which the first copies fill after the barrier
  // that follows the row offsets below.
  if (!find_prefill_tile<T, S::kThreads>(p, BM, blockIdx.x, head, reinterpret_cast<int*>(st_s), &t))
    return;
  const KvGeometry& kv = p.kv;
  const int kvh = head / (p.num_q_heads / kv.num_kv_heads);
  const int tid = threadIdx.x;
  const int wg = tid / 128, wl = (tid / 32) % 4, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  const int shift = t.lk - t.lq;
  const KeyRange range = key_range(t);
  const int ntiles = (range.end + BN - 1) / BN;

  int flags = 0;  // kGuardIndexBad, kGuardValueBad
  // Row offsets of key tiles 0 and 1; thread r < BN keeps the cursor of row r.
  RowCursor cur;
  if (tid < BN) {
    cur.init(kv, t.table, tid, range.end, flags);
    rowoff[tid] = sm90_pack_off(cur.off);
    cur.advance(kv, t.table, tid, BN, range.end, flags);
    rowoff[BN + tid] = sm90_pack_off(cur.off);
  }
  __syncthreads();

  const T* qg = static_cast<const T*>(p.q);
  const C* kg = static_cast<const C*>(p.k) + kvh * kv.head_stride;
  const C* vg = static_cast<const C*>(p.v) + kvh * kv.head_stride;
  {
    const int c = tid % CH, r0 = tid / CH;
#pragma unroll
    for (int i = 0; i < BM / RP; ++i) {
      const int r = r0 + i * RP;
      const bool ok = r < t.rows;
      const T* src = ok ? qg + (int64_t(t.q0 + t.m0 + r) * p.num_q_heads + head) * D + c * 8 : qg;
      cp_async16(q_s + sm90_tile_off<BM>(r, c), src, ok);
    }
  }
  // This thread's FP8 chunks: chunk c8 of rows r8 + i * F8R, plain rows in the staging; it
  // widens them into chunks 2 c8 and 2 c8 + 1 of the same rows, one column block, in rows that
  // share their swizzle phase (F8R % 8 == 0), so they lie F8R rows apart.
  static_assert(F8R % 8 == 0, "a thread's widened rows must share one swizzle phase");
  int r8, c8;
  fp8_widen_chunk<F8>(tid, r8, c8);
  auto load_fp8 = [&](int slot) {  // the tile whose offsets are in rowoff slot `slot`
#pragma unroll
    for (int i = 0; i < BN / F8R; ++i) {
      const int r = r8 + i * F8R;
      const uint32_t u = rowoff[slot * BN + r];
      const bool ok = u != kSm90NoRow;
      const int64_t off = int64_t(u) << 3;
      unsigned char* dst = st_s + r * D + c8 * 16;
      cp_async16(smem_u32(dst), ok ? kg + off + c8 * 16 : kg, ok);
      cp_async16(smem_u32(dst + S::kStageBytes), ok ? vg + off + c8 * 16 : vg, ok);
    }
    async_copy_commit();
  };
  // Widens this thread's staged chunks of tile n into K stage n % 2 and V stage n % 3; in a tile
  // the mask crosses, the guards' V pass then scans the V chunks just widened (this thread's
  // own stores; prefill_mma_kernel's pass, on the widened values). Generic-proxy stores: the
  // next tile_ready's fence.proxy.async and barrier publish them.
  auto widen = [&](int n) {
    async_copy_wait<0>();  // this thread's copies of tile n (the only group in flight)
    unsigned char* kt = gen + S::kQBytes + (n % KS) * S::kTileBytes;
    unsigned char* vt = gen + S::kQBytes + (KS + n % VS) * S::kTileBytes;
    // K, then V: each half's staging loads issue back to back before its first widened store
    // (ptxas keeps a shared load behind any earlier shared store it cannot prove disjoint, so
    // row by row every conversion waited on its load).
    constexpr int R = BN / F8R;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      unsigned char* dst = h == 0 ? kt : vt;
      uint4 raw[R];
#pragma unroll
      for (int i = 0; i < R; ++i)
        raw[i] = lds128(st_s + h * S::kStageBytes + (r8 + i * F8R) * D + c8 * 16);
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int r = r8 + i * F8R;
        uint4 lo, hi;
        fp8x16_to_f16<C>(raw[i], lo, hi);
        *reinterpret_cast<uint4*>(dst + sm90_tile_off<BN>(r, 2 * c8)) = lo;
        *reinterpret_cast<uint4*>(dst + sm90_tile_off<BN>(r, 2 * c8 + 1)) = hi;
      }
    }
    if (n * BN + BN > range.full_end) {
      const bool lo = sanitize_own_v<M, BN / F8R, F8R * 128, F8R>(
          vt + sm90_tile_off<BN>(r8, 2 * c8), n * BN + r8, range.full_end, range.end, c8 * 16,
          first_bad);
      const bool hi = sanitize_own_v<M, BN / F8R, F8R * 128, F8R>(
          vt + sm90_tile_off<BN>(r8, 2 * c8 + 1), n * BN + r8, range.full_end, range.end,
          c8 * 16 + 8, first_bad);
      if (lo || hi) flags |= kGuardValueBad;
    }
  };
  // Copies of tile n + 2 (offsets in slot n % 2), then the cursors step to tile n + 3, whose
  // offsets replace those of tile n + 1 (read when its copies were issued, before a barrier).
  auto next_copies = [&](int n) {
    if (n + 2 < ntiles) load_fp8(n % 2);
    if (tid < BN) {
      cur.advance(kv, t.table, (n + 2) * BN + tid, BN, range.end, flags);
      rowoff[((n + 1) % 2) * BN + tid] = sm90_pack_off(cur.off);
    }
  };

  if (ntiles > 0) load_fp8(0);
  if (ntiles == 0) async_copy_commit();
  check_entries<S::kThreads, 16>(t, kv, range.end, flags);  // while tile 0 is in flight
  async_copy_wait<0>();                                     // q and this thread's copies of tile 0
  __syncthreads();  // every thread's q (the bf16 rows are scaled across threads)
  if constexpr (std::is_same_v<T, bf16_t>) {
    q_bf16_to_f16_rows<D, S::kThreads>(gen, BM, qpost,
                                       [](int r, int c) { return sm90_tile_off<BM>(r, c); });
  }
  if (ntiles > 0) widen(0);
  if (ntiles > 1) load_fp8(1);
  if (tid < BN) {  // tile 2's offsets into slot 0 (read by every thread before the barrier)
    cur.advance(kv, t.table, BN + tid, BN, range.end, flags);
    rowoff[tid] = sm90_pack_off(cur.off);
  }

  // Descriptors as in prefill_sm90_kernel; K stages and V stages are separate rings here.
  const uint64_t dq = sm90_desc(q_s + uint32_t(wg * 64 * 128), 16, 1024);
  const uint64_t dk = sm90_desc(k_s, 16, 1024);
  const uint64_t dv = sm90_desc(v_s, BN * 128, 1024);
  auto kstep = [](int kk, int rows) {
    return uint64_t(((kk / 4) * rows * 128 + (kk % 4) * 32) >> 4);
  };

  float o[D / 2];
  float s[BN / 2];
  uint32_t pf[BN / 4];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
#pragma unroll
  for (int i = 0; i < BN / 4; ++i) pf[i] = 0u;
  float m0 = kNegInf, m1 = kNegInf, l0 = 0.f, l1 = 0.f;
  const int lr0 = wg * 64 + wl * 16 + g;  // this thread's rows within the tile
  const int row0 = t.m0 + lr0;            // and within the request
  const int row1 = row0 + 8;
  const float cap = p.ls.cap_log2e;
  float qs0 = p.ls.q_scale * p.scales.k_of(kvh), qs1 = qs0;  // times the rows' q factors

  auto tile_ready = [&]() {
    sm90_fence_proxy_async();  // this thread's widened stores (and q) to the async proxy
    __syncthreads();
  };
  auto issue_s = [&](int n) {
    const uint64_t dks = dk + uint64_t(((n % KS) * S::kTileBytes) >> 4);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      sm90_mma_ss_n128<M>(s, dq + kstep(kk, BM), dks + kstep(kk, BN), kk);
    }
    sm90_wgmma_commit();
  };
  auto issue_pv = [&](int n) {
    const uint64_t dvs = dv + uint64_t(((n % VS) * S::kTileBytes) >> 4);
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
    float mx0 = kNegInf, mx1 = kNegInf;
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
      mx0 = fmaxf(mx0, fmaxf(s[4 * j], s[4 * j + 1]));
      mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
    mx0 = group_max<4>(mx0);
    mx1 = group_max<4>(mx1);
    if constexpr (kFold) {
      mx0 *= qs0;
      mx1 *= qs1;
    }
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float mu0 = mn0 == kNegInf ? 0.f : mn0, mu1 = mn1 == kNegInf ? 0.f : mn1;
    a0 = fast_exp2(m0 - mu0);
    a1 = fast_exp2(m1 - mu1);
    m0 = mn0;
    m1 = mn1;
    sum0 = 0.f;
    sum1 = 0.f;
    const float sc0 = kFold ? qs0 : 1.f, sc1 = kFold ? qs1 : 1.f;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      s[4 * j] = fast_exp2(fmaf(s[4 * j], sc0, -mu0));
      s[4 * j + 1] = fast_exp2(fmaf(s[4 * j + 1], sc0, -mu0));
      s[4 * j + 2] = fast_exp2(fmaf(s[4 * j + 2], sc1, -mu1));
      s[4 * j + 3] = fast_exp2(fmaf(s[4 * j + 3], sc1, -mu1));
      sum0 += s[4 * j] + s[4 * j + 1];
      sum1 += s[4 * j + 2] + s[4 * j + 3];
    }
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
  auto rescale_pack = [&]() {
    l0 = l0 * a0 + sum0;
    l1 = l1 * a1 + sum1;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[4 * i] *= a0;
      o[4 * i + 1] *= a0;
      o[4 * i + 2] *= a1;
      o[4 * i + 3] *= a1;
    }
#pragma unroll
    for (int i = 0; i < BN / 4; ++i) pf[i] = pack2<M>(s[2 * i], s[2 * i + 1]);
  };

  if (ntiles > 0) {
    tile_ready();
    if constexpr (std::is_same_v<T, bf16_t>) {  // before V stage 2 (their home) is written
      qs0 *= qpost[lr0];
      qs1 *= qpost[lr0 + 8];
    }
    sm90_wgmma_fence();
    issue_s(0);
    if (ntiles > 1) widen(1);
    next_copies(0);
    sm90_wgmma_wait<0>();
    sm90_pin(s);
    softmax_tile(0);
    rescale_pack();
  }
  for (int n = 1; n < ntiles; ++n) {
    tile_ready();
    sm90_wgmma_fence();
    issue_s(n);       // group 1: S = Q K_n^T
    issue_pv(n - 1);  // group 2: O += P_{n-1} V_{n-1}
    if (n + 1 < ntiles) widen(n + 1);
    next_copies(n);
    sm90_wgmma_wait<1>();
    sm90_pin(s);
    softmax_tile(n);
    sm90_wgmma_wait<0>();
    sm90_pin(o);
    sm90_pin(pf);
    rescale_pack();
  }

  if (ntiles > 0) {  // the last tile's V was published by the loop's last tile_ready
    sm90_wgmma_fence();
    issue_pv(ntiles - 1);
    sm90_wgmma_wait<0>();
    sm90_pin(o);
    sm90_pin(pf);
  }
  async_copy_wait<0>();

  l0 = group_sum<4>(l0);
  l1 = group_sum<4>(l1);
  prefill_mma_store<T, D>(p, t, head, lr0, tq, l0, l1, p.scales.v_of(kvh), o, flags, first_bad);
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

template <typename T, typename C, int D>
const char* launch_prefill_sm90_fp8_d(const PrefillParams& p, gpuStream_t stream) {
  return launch_prefill_tiles<Sm90Fp8Shape<D>>(prefill_sm90_fp8_kernel<T, C, D>, p, stream);
}

template <typename T, int D>
const char* launch_prefill_sm90_d(const PrefillParams& p, gpuStream_t stream) {
  if (!prefill_sm90_packs(p))
    return launch_prefill_tiles<Sm90Shape<D>>(prefill_sm90_kernel<T, D, false>, p, stream);
  // GQA: the group's heads packed into each tile's rows (BM / group tokens a tile).
  PrefillParams q = p;
  q.pack_heads = p.num_q_heads / p.kv.num_kv_heads;
  q.pack_magic = uint32_t((uint64_t(1) << 32) / uint64_t(q.pack_heads) + 1);
  return launch_prefill_tiles<Sm90Shape<D>>(prefill_sm90_kernel<T, D, true>, q, stream);
}

// Declared in prefill.cuh; instantiated in prefill_sm90.cu for T = bf16_t and f16_t, each with
// C = T and the FP8 formats.
template <typename T, typename C>
const char* launch_prefill_sm90(const PrefillParams& p, gpuStream_t stream) {
  static_assert(sizeof(T) == 2, "the sm90 kernel takes a 16-bit q");
  if (!prefill_sm90_fits(p)) return "jaxattn: the sm90 prefill kernel does not take this shape";
  if constexpr (sizeof(C) == 1) {
    return p.kv.head_dim == 64 ? launch_prefill_sm90_fp8_d<T, C, 64>(p, stream)
                               : launch_prefill_sm90_fp8_d<T, C, 128>(p, stream);
  } else {
    return p.kv.head_dim == 64 ? launch_prefill_sm90_d<T, 64>(p, stream)
                               : launch_prefill_sm90_d<T, 128>(p, stream);
  }
}

}  // namespace gpu
}  // namespace jaxattn

#endif  // JAXATTN_CUDA
