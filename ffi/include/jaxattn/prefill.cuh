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
// The `kernel` attribute of the call (PrefillParams::kernel: auto, sm90, mma, simt; default auto:
// the first of sm90, mma, simt that supports the call; jaxattn.native.PrefillConfig, whose
// default comes from $JAXATTN_PREFILL_KERNEL) forces one: a forced kernel is used wherever it
// supports the dtype and head_dim, the automatic choice elsewhere; sm90 forced on a device or
// build without it is an error.
#pragma once

#include <cstdint>
#include <type_traits>

#include "jaxattn/gpu_vendor.h"
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
  const int32_t* table = nullptr;
};

// Finds the tile of block x (heaviest tiles of a request first: they see the most keys).
// Returns false for blocks past the last tile, after zeroing their share of padding rows.
template <typename T>
__device__ bool find_prefill_tile(const PrefillParams& p, int bm, int x, int head, PrefillTile* t) {
  for (int b = 0; b < p.batch; ++b) {
    const int q0 = p.cu_seqlens_q[b];
    const int lq = p.cu_seqlens_q[b + 1] - q0;
    const int ntiles = lq > 0 ? (lq + bm - 1) / bm : 0;
    if (x < ntiles) {
      t->b = b;
      t->m0 = (ntiles - 1 - x) * bm;
      t->rows = min(bm, lq - t->m0);
      t->q0 = q0;
      t->lq = lq;
      if (p.page_indptr) {
        t->table = p.page_table + p.page_indptr[b];
        t->lk = p.page_indptr[b + 1] - p.page_indptr[b];
      } else {
        t->table = p.page_table + int64_t(b) * p.page_table_stride;
        t->lk = p.seq_lens[b];
      }
      t->lk = max(t->lk, 0);
      return true;
    }
    x -= ntiles;
  }
  const int D = p.kv.head_dim;
  const int r0 = p.cu_seqlens_q[p.batch] + x * bm;
  const int r1 = min(p.total_q, r0 + bm);
  T* out = static_cast<T*>(p.out);
  for (int i = threadIdx.x; i < (r1 - r0) * D; i += blockDim.x) {
    const int r = r0 + i / D;
    out[(int64_t(r) * p.num_q_heads + head) * D + i % D] = from_float<T>(0.f);
  }
  return false;
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

// Offset of one row of a key tile, advanced tile by tile from page-table differences.
struct RowCursor {
  int64_t off = -1;  // element offset in the cache; -1 past the last key
  int page = 0;

  __device__ __forceinline__ void init(const KvGeometry& kv, const int32_t* table, int t, int lk) {
    if (t < lk) {
      page = table[t / kv.page_size];
      off = int64_t(page) * kv.page_stride + int64_t(t % kv.page_size) * kv.token_stride;
    } else {
      off = -1;
    }
  }

  __device__ __forceinline__ void advance(const KvGeometry& kv, const int32_t* table, int t,
                                          int step, int lk) {
    const int tn = t + step;
    if (tn >= lk || off < 0) {
      off = -1;
      return;
    }
    const int next = table[tn / kv.page_size];
    off += int64_t(next - page) * kv.page_stride +
           int64_t(tn % kv.page_size - t % kv.page_size) * kv.token_stride;
    page = next;
  }
};

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

template <typename T, int D>
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

  const int head = blockIdx.y;
  PrefillTile t;
  if (!find_prefill_tile<T>(p, BM, blockIdx.x, head, &t)) return;
  const KvGeometry& kv = p.kv;
  const int kvh = head / (p.num_q_heads / kv.num_kv_heads);
  const int tid = threadIdx.x;
  const int r = tid / TPR, c = tid % TPR;
  const int shift = t.lk - t.lq;
  const KeyRange range = key_range(t);

  const T* qg = static_cast<const T*>(p.q);
  for (int i = tid; i < BM * D; i += S::kThreads) {
    const int rr = i / D, d = i % D;
    float v = 0.f;
    if (rr < t.rows) v = to_float(qg[(int64_t(t.q0 + t.m0 + rr) * p.num_q_heads + head) * D + d]);
    qs[rr * LD + d] = v * p.ls.q_scale;
  }
  RowCursor cur;
  if (tid < BN) cur.init(kv, t.table, tid, t.lk);

  float m = kNegInf, l = 0.f, acc[S::kDimsPerLane];
#pragma unroll
  for (int i = 0; i < S::kDimsPerLane; ++i) acc[i] = 0.f;
  const T* kg = static_cast<const T*>(p.k) + kvh * kv.head_stride;
  const T* vg = static_cast<const T*>(p.v) + kvh * kv.head_stride;
  const int qi = t.m0 + r;  // this lane's query row within the request

  for (int n0 = 0; n0 < range.end; n0 += BN) {
    if (tid < BN) rowoff[tid] = cur.off;
    __syncthreads();  // offsets published; the previous tile's K/V/P are no longer read
    for (int i = tid; i < BN * D; i += S::kThreads) {
      const int rr = i / D, d = i % D;
      const int64_t off = rowoff[rr];
      ks[rr * LD + d] = off >= 0 ? to_float(kg[off + d]) : 0.f;
      vs[rr * LD + d] = off >= 0 ? to_float(vg[off + d]) : 0.f;
    }
    if (tid < BN) cur.advance(kv, t.table, n0 + tid, BN, t.lk);
    __syncthreads();

    const bool masked = n0 + BN > range.full_end;
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

  if (r < t.rows) {
    T* out = static_cast<T*>(p.out) + (int64_t(t.q0 + qi) * p.num_q_heads + head) * D;
    const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int i = 0; i < S::kDimsPerLane; ++i) out[c + i * TPR] = from_float<T>(acc[i] * inv);
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

  const int head = blockIdx.y;
  PrefillTile t;
  if (!find_prefill_tile<T>(p, BM, blockIdx.x, head, &t)) return;
  const KvGeometry& kv = p.kv;
  const int kvh = head / (p.num_q_heads / kv.num_kv_heads);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  const int shift = t.lk - t.lq;
  const KeyRange range = key_range(t);
  const int ntiles = (range.end + BN - 1) / BN;

  RowCursor cur;
  if (tid < BN) {
    cur.init(kv, t.table, tid, t.lk);
    rowoff[tid] = cur.off;
    cur.advance(kv, t.table, tid, BN, t.lk);
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

  uint32_t qf[D / 16][4];
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m0 = kNegInf, m1 = kNegInf, l0 = 0.f, l1 = 0.f;
  const int row0 = t.m0 + warp * 16 + g;  // query rows of this lane, within the request
  const int row1 = row0 + 8;

  for (int n = 0; n < ntiles; ++n) {
    const int buf = n & 1;
    if (n + 1 < ntiles) load_kv(buf ^ 1);
    async_copy_commit();
    async_copy_wait<1>();
    __syncthreads();
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

    const int n0 = n * BN;
    const bool masked = n0 + BN > range.full_end;
    float mx0 = kNegInf, mx1 = kNegInf;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = s[j][e] * p.ls.q_scale;
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
      cur.advance(kv, t.table, (n + 1) * BN + tid, BN, t.lk);
      rowoff[buf * BN + tid] = cur.off;
    }
    __syncthreads();  // tile n's buffers are free for tile n + 2
  }
  async_copy_wait<0>();

  l0 = group_sum<4>(l0);
  l1 = group_sum<4>(l1);
  const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
  T* out = static_cast<T*>(p.out);
  const int lr0 = warp * 16 + g, lr1 = lr0 + 8;  // rows within the tile
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    const int d = i * 8 + 2 * tq;
    if (lr0 < t.rows) {
      *reinterpret_cast<uint32_t*>(out + (int64_t(t.q0 + row0) * p.num_q_heads + head) * D + d) =
          pack2<T>(o[i][0] * inv0, o[i][1] * inv0);
    }
    if (lr1 < t.rows) {
      *reinterpret_cast<uint32_t*>(out + (int64_t(t.q0 + row1) * p.num_q_heads + head) * D + d) =
          pack2<T>(o[i][2] * inv1, o[i][3] * inv1);
    }
  }
#endif
}

#endif  // JAXATTN_CUDA

template <typename T, int D>
const char* launch_prefill_simt(const PrefillParams& p, gpuStream_t stream) {
  using S = SimtShape<D>;
  const dim3 grid((p.total_q + S::kBM - 1) / S::kBM + p.batch, p.num_q_heads);
  prefill_simt_kernel<T, D><<<grid, S::kThreads, S::kSmemBytes, stream>>>(p);
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

template <typename T, int D>
const char* launch_prefill_mma(const PrefillParams& p, gpuStream_t stream) {
  return launch_prefill_tiles<MmaShape<D>>(prefill_mma_kernel<T, D>, p, stream);
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
// prefill_sm90.cu (compiled for sm_90a only), T = bf16_t or f16_t.
template <typename T>
const char* launch_prefill_sm90(const PrefillParams& p, gpuStream_t stream);
#endif

// The values of PrefillParams::kernel (the FFI attribute `kernel`).
enum class PrefillKernel { kAuto = 0, kSm90 = 1, kMma = 2, kSimt = 3 };

// Mean new tokens per request below which `auto` prefers the mma kernel's 64-row tiles.
constexpr int kSm90MinRowsPerRequest = 64;

template <typename T>
const char* launch_prefill_typed(const PrefillParams& p, gpuStream_t stream) {
  if (p.kernel < 0 || p.kernel > 3) return "jaxattn: prefill kernel must be 0..3";
  const PrefillKernel which = static_cast<PrefillKernel>(p.kernel);
  if (p.total_q == 0 || p.batch == 0) return nullptr;
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
        return launch_prefill_sm90<T>(p, stream);
#endif
      if (which == PrefillKernel::kSm90)
        return "jaxattn: the sm90 prefill kernel needs a compute capability 9.0 device, a "
               "library built with 90 in JAXATTN_CUDA_ARCHS and a cache under 64 GiB";
    }
    if (tc_dim && which != PrefillKernel::kSimt && device_has_mma()) {
      return p.kv.head_dim == 64 ? launch_prefill_mma<T, 64>(p, stream)
                                 : launch_prefill_mma<T, 128>(p, stream);
    }
  }
#endif
  switch (p.kv.head_dim) {
    case 32:
      return launch_prefill_simt<T, 32>(p, stream);
    case 64:
      return launch_prefill_simt<T, 64>(p, stream);
    case 128:
      return launch_prefill_simt<T, 128>(p, stream);
    case 256:
      return launch_prefill_simt<T, 256>(p, stream);
    default:
      return "jaxattn: GPU prefill is built for head_dim 32, 64, 128 and 256";
  }
}

}  // namespace gpu
}  // namespace jaxattn
