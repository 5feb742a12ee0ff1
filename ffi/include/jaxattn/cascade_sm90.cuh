// Cascade decode's prefix level on Hopper tensor cores (wgmma.mma_async, sm_90a): the block,
// the plan, the rows, the ring and the states of cascade.cuh's tensor-core kernel, with both
// products of a prefix block on warpgroup MMA instead of mma.sync. Own blocks, the merge and
// the contract are unchanged. Built for sm_90a alone (cascade_sm90.cu); launch_cascade_blocks
// (cascade.cuh) runs it on compute capability 9.0 when the library defines JAXATTN_HAVE_SM90A
// (CascadeParams::prefix_kernel: 0 auto, 1 mma.sync, 2 wgmma).
//
// Why: the prefix level is compute bound (the issue's batch: 64 rows a tile x 4096 keys x 32
// tiles, 4.3 GFLOP), and with mma.sync, one warp a scheduler and ldmatrix feeding every
// product it ran at ~80 TFLOP/s and bounded the whole batch (ffi/NOTES.md, round 8). A prefix
// block is one warpgroup (the kernel's 128 threads), so its 64 rows are one m64 wgmma tile:
//   S  = Q K^T : D/16 x m64n64k16, A = q from registers (the rows' A fragments, loaded once),
//                B = the K tile, K-major, from shared memory;
//   O += P V   : 4 x m64nDk16, A = P from registers (S's accumulator layout is the A-fragment
//                layout), B = the V tile, MN-major (transpose bit), from shared memory.
// Both accumulators have the m16n8 layout warp by warp, so the softmax, the mask, the rescale
// skip and the store are cascade.cuh's (cascade_prefix_softmax, cascade_prefix_store).
//
// The ring is KvRing's swizzled form (RS = 0): 64-key K and V tiles as 128-byte-swizzled column
// blocks, 1024-byte aligned, filled by the same 16-byte cp.async gathers, row offsets one tile
// ahead and page ids checked there. Each thread fences its landed copies into the async proxy
// (fence.proxy.async) before the block barrier that precedes the products; every wgmma group
// completes before the tile's end, so the next barrier frees its stage for the copies.
#pragma once

#include "jaxattn/cascade.cuh"
#include "jaxattn/prefill_sm90.cuh"

#if defined(JAXATTN_CUDA)

namespace jaxattn {
namespace gpu {

// Stages of the swizzled ring within the kernel's dynamic shared memory (after up to 1 KiB of
// alignment): 3 at head_dim 128 (98 KiB), 4 at 64.
template <typename T, int D>
struct CascadeWgmmaShape {
  using S = CascadeMmaShape<T, D>;
  static constexpr int kStageBytes = KvRing<T, D, S::kTile, 2, 0, S::kThreads>::kStageBytes;
  static constexpr int kStages = cmin(4, (S::kSmemBytes - 1024) / kStageBytes);
  static_assert(kStages >= 2, "the ring needs two stages");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// S[64 x 64] (+)= A[64 x 16] B[16 x 64]: A in registers (m16n8k16 A fragments, warp by warp),
// B K-major in shared memory (descriptor db); scale_d == 0 overwrites S.
template <typename T>
__device__ __forceinline__ void cascade_wgmma_qk(float (&d)[32], const uint32_t (&a)[4],
                                                 uint64_t db, int scale_d) {
#define JAXATTN_CASCADE_QK(TY)                                                                     \
  asm volatile(                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                 \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY                                      \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "    \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, "   \
      "%36, p, 1, 1, 0;\n}\n"                                                                      \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                         \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d)                          \
      : "memory")
  if constexpr (std::is_same_v<T, bf16_t>) {
    JAXATTN_CASCADE_QK("bf16");
  } else {
    JAXATTN_CASCADE_QK("f16");
  }
#undef JAXATTN_CASCADE_QK
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// The prefix block of cascade_prefix_mma on wgmma (see the top of the file).
template <typename T, int D, typename Plan>
__device__ __forceinline__ void cascade_prefix_wgmma(const CascadeParams& p, unsigned char* smem,
                                                     const Plan& plan, int kvh, int split,
                                                     int start, int end) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = CascadeMmaShape<T, D>;
  using W = CascadeWgmmaShape<T, D>;
  constexpr int TILE = S::kTile, NS = W::kStages, KD = D / 16;
  constexpr float kNegInf = -__builtin_huge_valf();
  // The swizzled ring wants a 1024-byte-aligned base (the kernel's shared memory has 1 KiB
  // to spare for it).
  unsigned char* base = smem + smem_pad1024(smem);
  using Ring = KvRing<T, D, TILE, NS, 0, S::kThreads>;
  static_assert(NS * Ring::kStageBytes + Ring::kPageSlotBytes <= S::kSmemBytes - 1024,
                "the page slots fit beside the ring");
  bool bad;  // this thread met a page id outside the cache
  const Ring ring = cascade_prefix_ring<Ring>(p, base, plan, kvh, start, end, &bad, /*fetch=*/true);
  JAXATTN_CASCADE_STAMP(2);
  CascadePrefixRows<D> rows;
  cascade_prefix_q<T, D>(p, plan, kvh, split, rows);

  float o[D / 8][4];
  float sc[TILE / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
#pragma unroll
  for (int j = 0; j < TILE / 8; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
  float (&of)[D / 2] = reinterpret_cast<float (&)[D / 2]>(o);
  float (&sf)[TILE / 2] = reinterpret_cast<float (&)[TILE / 2]>(sc);
  float m0 = kNegInf, m1 = kNegInf, l0 = 0.f, l1 = 0.f;  // rows g, g + 8: max, this lane's sum

  // Descriptors (128-byte swizzle, sm90_desc): K K-major (a 16-dim step is +32 bytes in the
  // row, +TILE rows of 128 bytes per 64-dim column block), V MN-major (a 16-key step is +16
  // rows; LBO: the distance between V's 64-dim column blocks).
  const uint64_t dk = sm90_desc(smem_u32(ring.k_rows(0)), 16, 1024);
  const uint64_t dv = sm90_desc(smem_u32(ring.v_rows(0)), TILE * 128, 1024);
  constexpr uint64_t kStageStep = uint64_t(Ring::kTileBytes >> 4);

  // Both products of a tile complete within it (S, then the softmax, then P V): every stage
  // the next barrier frees has been read. Measured against this, issuing S_n with
  // P_{n-1} V_{n-1} and running the softmax under P V (FlashAttention-3's overlap within a
  // warpgroup; V's copies then need a second barrier a tile) was 7% slower on the shared batch
  // (ffi/NOTES.md, round 14): with one warp a scheduler the block is bound by its instruction
  // latencies, not by the tensor cores.
  const int ntiles = ring.tiles();
  JAXATTN_CASCADE_NOTE(13, ntiles);
  for (int n = 0; n < ntiles; ++n) {
    async_copy_wait<NS - 2>();  // this thread's copies of tile n have landed
    sm90_fence_proxy_async();   // and are visible to the tensor cores' reads
    __syncthreads();            // everyone's are, and stage (n - 1) % NS is free
    if (n < 8) JAXATTN_CASCADE_STAMP(3 + n);
    if (n + NS - 1 < ntiles) ring.issue(n + NS - 1);
    // The block-table entries of the tile whose offsets an iteration stores are not read into
    // a register here: the wgmma fence waits for every outstanding register load, so each
    // tile's S = Q K^T would wait for that read (ffi/NOTES.md, round 47). Each thread's entry
    // is fetched by a 4-byte cp.async into a page slot instead: tile n + 2 NS - 1's entries
    // land with tile n + NS - 1's copies, by the wait at the top of iteration n + NS - 1,
    // whose store reads them; their slot's last reader was the store of iteration n - 1. (The
    // prologue's groups fetch tiles NS .. 2 NS - 2.) On an H100 (round 48) the shared batch
    // ran 3% faster, a batch of three prefixes 10%.
    ring.fetch_page(n + 2 * NS - 1);
    async_copy_commit();

    const int s = n % NS, n0 = start + n * TILE;
    const uint64_t dks = dk + uint64_t(s) * kStageStep;
    const uint64_t dvs = dv + uint64_t(s) * kStageStep;
    sm90_wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KD; ++kk)
      cascade_wgmma_qk<T>(sf, rows.qa[kk],
                          dks + uint64_t((((kk / 4) * TILE * 128) + (kk % 4) * 32) >> 4), kk);
    sm90_wgmma_commit();
    sm90_wgmma_wait<0>();
    sm90_pin(sf);

    float a0, a1;  // this lane's share of l0 / l1; the quad's are added once at the end
    cascade_prefix_softmax(p, sc, rows.q_scale, n0, end, m0, m1, l0, l1, a0, a1);
    if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) scale_c_rows(o, a0, a1);
    uint32_t pf[TILE / 16][4];
#pragma unroll
    for (int kk = 0; kk < TILE / 16; ++kk) p_fragment<T>(sc, kk, pf[kk]);
    sm90_wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < TILE / 16; ++kk) sm90_mma_rs<T, D>(of, pf[kk], dvs + uint64_t(kk * 128));
    sm90_wgmma_commit();
    sm90_wgmma_wait<0>();
    sm90_pin(of);
    const int page = ring.fetched_page(n + NS);
    bad |= ring.store_offset(n + NS, page);  // stage n % NS's offsets were used at issue(n)
  }
  async_copy_wait<0>();
  JAXATTN_CASCADE_STAMP(11);
  const bool poisoned = __syncthreads_or(bad);
  cascade_prefix_store<D>(p, o, rows.slot, m0, m1, l0, l1, poisoned);
  JAXATTN_CASCADE_STAMP(12);
#else
  (void)p, (void)smem, (void)plan, (void)kvh, (void)split, (void)start, (void)end;
#endif
}

template <typename T, int D>
const char* launch_cascade_sm90(const CascadeParams& p, gpuStream_t stream, int64_t blocks,
                                int per_tile, int per_head) {
  using S = CascadeMmaShape<T, D>;
  auto kernel = cascade_mma_kernel<T, D, true>;
  if (const char* e = allow_dynamic_smem(kernel, S::kSmemBytes)) return e;
  kernel<<<unsigned(blocks), S::kThreads, S::kSmemBytes, stream>>>(p, per_tile, per_head);
  return check_launch();
}

template <typename T, int D>
const char* cascade_sm90_occupancy(int* blocks) {
  using S = CascadeMmaShape<T, D>;
  return occupancy_of(cascade_mma_kernel<T, D, true>, S::kThreads, S::kSmemBytes, blocks);
}

}  // namespace gpu
}  // namespace jaxattn

#endif  // JAXATTN_CUDA
