// Paged decode attention, one source for CUDA and HIP.
//
// Grid (num_kv_heads, batch, partitions): a block owns one KV head of one sequence (or one
// partition of it) and computes every query head of that head's GQA group, so each K/V row
// is fetched from memory once per block however many query heads share it.
//
// Lanes: a row of head_dim elements is read by kLanesPerRow lanes, 16 bytes each, so a warp
// covers kRowsPerWarp token rows per step and every load is a full 16-byte vector. Each lane
// keeps its slice of q and of the output for the warp's heads in registers; a logit is the
// lanes' partial dot products summed by a shuffle tree of width kLanesPerRow. Softmax runs
// online per lane group in base 2 (q pre-scaled by scale * log2 e, exp2 on the SFU); lane
// groups and warps merge their (max, sum, output) states once, at the end.
//
// Group sizes up to 8 keep every head in each warp's registers and read K/V straight from
// global memory. Larger groups (16..64) split the heads over warps of 8; the block then
// stages each tile of K/V rows in shared memory once and all warps read it from there.
//
// Split-KV (partition_size > 0): each block writes its partition's normalised output and
// (max, sum) to the workspace and a combine kernel weighs the partitions by
// sum_p * 2^(max_p - max) -- the exact merge, since the maxima are in the same base 2.
#pragma once

#include <cstdint>
#include <cstdlib>

#include "jaxattn/gpu_vendor.h"
#include "jaxattn/params.h"

namespace jaxattn {
namespace gpu {

constexpr int cmin(int a, int b) { return a < b ? a : b; }
constexpr int cmax(int a, int b) { return a > b ? a : b; }

template <typename T, int D, int GT, bool PREFETCH = false>
struct DecodeShape {
  static_assert(D % (16 / sizeof(T)) == 0, "head_dim must be a whole number of 16-byte vectors");
  static constexpr int kVec = 16 / sizeof(T);
  static constexpr int kLanesPerRow = cmin(D / kVec, WARP_SIZE);
  static constexpr int kVecsPerLane = D / (kVec * kLanesPerRow);
  static constexpr int kElemsPerLane = kVecsPerLane * kVec;
  static constexpr int kRowsPerWarp = WARP_SIZE / kLanesPerRow;
  static constexpr int kHeadsPerWarp = cmin(GT, 8);
  static constexpr int kHeadChunks = GT / kHeadsPerWarp;
  static constexpr int kTokenSplit = kHeadChunks >= 4 ? 1 : 4 / kHeadChunks;
  static constexpr int kWarps = kHeadChunks * kTokenSplit;
  static constexpr int kThreads = kWarps * WARP_SIZE;
  static constexpr bool kStaged = kHeadChunks > 1;
  // Rows each lane group has in flight per step: enough independent 16-byte loads to cover
  // memory latency without spilling the K/V registers. The prefetching variant holds two
  // steps, so with eight query heads a warp it takes two rows a step.
  static constexpr int kUnroll = (PREFETCH && !kStaged && kHeadsPerWarp >= 8) ? 2 : 4;
  static constexpr int kStep = kTokenSplit * kRowsPerWarp * kUnroll;
  static constexpr int kTile =
      kStaged ? cmax(kStep, (32768 / int(2 * D * sizeof(T))) / kStep * kStep) : kStep;
  // Shared rows padded by one vector so that neighbouring rows start in different banks.
  static constexpr int kRowStride = D + kVec;
  static constexpr int kStageBytes = kStaged ? 2 * kTile * kRowStride * int(sizeof(T)) : 0;
  static constexpr int kMergeBytes = kTokenSplit > 1
                                         ? kWarps* kHeadsPerWarp*(D + 2) * int(sizeof(float))
                                         : 0;
  static constexpr int kSmemBytes = cmax(kStageBytes, kMergeBytes);
  static_assert(kSmemBytes <= 48 * 1024, "decode shared memory must fit the default limit");
};

__device__ __forceinline__ uint4 load16(const void* p) {
#if defined(JAXATTN_CUDA)
  return __ldg(static_cast<const uint4*>(p));
#else
  return *static_cast<const uint4*>(p);
#endif
}

// Writes one element of a finished (head, d): the output itself in one pass, or the
// partition's normalised output and its (max, sum) for the combine.
template <typename T>
__device__ __forceinline__ void decode_write(const DecodeParams& p, int b, int head, int d, float o,
                                             float m, float l) {
  const int D = p.kv.head_dim;
  const float v = l > 0.f ? o / l : 0.f;
  const int64_t bh = int64_t(b) * p.num_q_heads + head;
  if (p.partition_size == 0) {
    static_cast<T*>(p.out)[bh * D + d] = from_float<T>(v);
    return;
  }
  const int64_t slot = bh * p.max_parts + blockIdx.z;
  p.workspace[slot * D + d] = v;
  if (d == 0) {
    float* ml = p.workspace + int64_t(p.batch) * p.num_q_heads * p.max_parts * D;
    ml[2 * slot] = m;
    ml[2 * slot + 1] = l;
  }
}

template <typename T, int D, int GT, bool PREFETCH>
__global__ void __launch_bounds__((DecodeShape<T, D, GT, PREFETCH>::kThreads))
    paged_decode_kernel(const DecodeParams p) {
  using S = DecodeShape<T, D, GT, PREFETCH>;
  constexpr int VEC = S::kVec, TG = S::kLanesPerRow, NV = S::kVecsPerLane;
  constexpr int EPL = S::kElemsPerLane, TPW = S::kRowsPerWarp, GC = S::kHeadsPerWarp;
  constexpr int HC = S::kHeadChunks, WS = S::kTokenSplit, U = S::kUnroll;
  constexpr float kNegInf = -__builtin_huge_valf();
  extern __shared__ __align__(16) unsigned char smem[];

  const int kvh = blockIdx.x, b = blockIdx.y;
  const int L = max(p.seq_lens[b], 0);
  const int group = p.num_q_heads / p.kv.num_kv_heads;
  int start = 0, end = L;
  if (p.partition_size > 0) {
    start = int(blockIdx.z) * p.partition_size;
    if (start >= L) return;  // the combine reads only partitions that hold tokens
    end = min(L, start + p.partition_size);
  }
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int hc = warp % HC, ws = warp / HC;
  const int row = lane / TG, col = lane % TG;

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
      for (int e = 0; e < EPL; ++e) q[g][e] *= p.ls.q_scale;
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
  auto consume = [&](const uint4(&kr)[U][NV], const uint4(&vr)[U][NV], const bool(&ok)[U]) {
    float s[U][GC];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[EPL];
#pragma unroll
      for (int j = 0; j < NV; ++j) vec_to_float<T>(kr[u][j], &kf[j * VEC]);
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
        if (p.ls.cap_log2e > 0.f) v = p.ls.cap_log2e * tanhf(v);
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
      for (int j = 0; j < NV; ++j) vec_to_float<T>(vr[u][j], &vf[j * VEC]);
#pragma unroll
      for (int g = 0; g < GC; ++g) {
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[g][e] = fmaf(s[u][g], vf[e], acc[g][e]);
      }
    }
  };

  const KvGeometry& kv = p.kv;
  const int32_t* bt = p.block_tables + int64_t(b) * p.block_table_stride;
  const T* kbase = static_cast<const T*>(p.k) + kvh * kv.head_stride;
  const T* vbase = static_cast<const T*>(p.v) + kvh * kv.head_stride;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

  if constexpr (!S::kStaged && !PREFETCH) {
    for (int tb = start; tb < end; tb += S::kStep) {
      uint4 kr[U][NV], vr[U][NV];
      bool ok[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int t = tb + (u * WS + ws) * TPW + row;
        ok[u] = t < end;
        if (ok[u]) {
          const int64_t off = int64_t(bt[t / kv.page_size]) * kv.page_stride +
                              int64_t(t % kv.page_size) * kv.token_stride + col * VEC;
#pragma unroll
          for (int j = 0; j < NV; ++j) {
            kr[u][j] = load16(kbase + off + j * TG * VEC);
            vr[u][j] = load16(vbase + off + j * TG * VEC);
          }
        } else {
#pragma unroll
          for (int j = 0; j < NV; ++j) kr[u][j] = vr[u][j] = zero;
        }
      }
      consume(kr, vr, ok);
    }
  } else if constexpr (!S::kStaged) {
    auto load_rows = [&](int tb, uint4(&kr)[U][NV], uint4(&vr)[U][NV], bool(&ok)[U]) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int t = tb + (u * WS + ws) * TPW + row;
        ok[u] = t < end;
        if (ok[u]) {
          const int64_t off = int64_t(bt[t / kv.page_size]) * kv.page_stride +
                              int64_t(t % kv.page_size) * kv.token_stride + col * VEC;
#pragma unroll
          for (int j = 0; j < NV; ++j) {
            kr[u][j] = load16(kbase + off + j * TG * VEC);
            vr[u][j] = load16(vbase + off + j * TG * VEC);
          }
        } else {
#pragma unroll
          for (int j = 0; j < NV; ++j) kr[u][j] = vr[u][j] = zero;
        }
      }
    };

    // Two register sets, alternating: one step's rows are loaded while the other's are
    // consumed. A step past the end loads nothing and consumes only masked rows.
    uint4 ka[U][NV], va[U][NV], kb[U][NV], vb[U][NV];
    bool oka[U], okb[U];
    load_rows(start, ka, va, oka);
    for (int tb = start; tb < end; tb += 2 * S::kStep) {
      load_rows(tb + S::kStep, kb, vb, okb);
      consume(ka, va, oka);
      load_rows(tb + 2 * S::kStep, ka, va, oka);
      consume(kb, vb, okb);
    }
  } else {
    T* ks = reinterpret_cast<T*>(smem);
    T* vs = ks + S::kTile * S::kRowStride;
    constexpr int kChunks = D / VEC;
    for (int tile = start; tile < end; tile += S::kTile) {
      __syncthreads();  // every warp is done with the previous tile
      for (int i = threadIdx.x; i < S::kTile * kChunks; i += S::kThreads) {
        const int r = i / kChunks, c = i % kChunks, t = tile + r;
        uint4 kk = zero, vv = zero;
        if (t < end) {
          const int64_t off = int64_t(bt[t / kv.page_size]) * kv.page_stride +
                              int64_t(t % kv.page_size) * kv.token_stride + c * VEC;
          kk = load16(kbase + off);
          vv = load16(vbase + off);
        }
        *reinterpret_cast<uint4*>(ks + r * S::kRowStride + c * VEC) = kk;
        *reinterpret_cast<uint4*>(vs + r * S::kRowStride + c * VEC) = vv;
      }
      __syncthreads();
      const int tile_len = min(S::kTile, end - tile);
      for (int tb = 0; tb < tile_len; tb += S::kStep) {
        uint4 kr[U][NV], vr[U][NV];
        bool ok[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int r = tb + (u * WS + ws) * TPW + row;
          ok[u] = r < tile_len;
#pragma unroll
          for (int j = 0; j < NV; ++j) {
            const int e = r * S::kRowStride + (j * TG + col) * VEC;
            kr[u][j] = *reinterpret_cast<const uint4*>(ks + e);
            vr[u][j] = *reinterpret_cast<const uint4*>(vs + e);
          }
        }
        consume(kr, vr, ok);
      }
    }
  }

  // Merge the lane groups of each warp (they saw disjoint rows).
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

  if constexpr (WS == 1) {
    if (row == 0) {
#pragma unroll
      for (int g = 0; g < GC; ++g) {
        const int gh = hc * GC + g;
        if (gh >= group) continue;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
#pragma unroll
          for (int v = 0; v < VEC; ++v) {
            decode_write<T>(p, b, kvh * group + gh, (j * TG + col) * VEC + v, acc[g][j * VEC + v],
                            m[g], l[g]);
          }
        }
      }
    }
  } else {
    // Merge the warps that split the rows, through shared memory, in a fixed order.
    float* red = reinterpret_cast<float*>(smem);
    __syncthreads();  // staged K/V (if any) is no longer read
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
    for (int i = threadIdx.x; i < HC * GC * D; i += S::kThreads) {
      const int hci = i / (GC * D), g = (i / D) % GC, d = i % D;
      const int gh = hci * GC + g;
      if (gh >= group) continue;
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
      decode_write<T>(p, b, kvh * group + gh, d, o, mx, ls);
    }
  }
}

// Exact merge of the partitions of one (sequence, query head).
template <typename T, int D>
__global__ void __launch_bounds__(128) decode_combine_kernel(const DecodeParams p) {
  constexpr float kNegInf = -__builtin_huge_valf();
  const int h = blockIdx.x, b = blockIdx.y;
  const int L = max(p.seq_lens[b], 0);
  const int nparts = (L + p.partition_size - 1) / p.partition_size;
  const int64_t slot0 = (int64_t(b) * p.num_q_heads + h) * p.max_parts;
  const float* part_out = p.workspace + slot0 * D;
  const float* ml = p.workspace + int64_t(p.batch) * p.num_q_heads * p.max_parts * D + 2 * slot0;
  float mx = kNegInf;
  for (int i = 0; i < nparts; ++i) mx = fmaxf(mx, ml[2 * i]);
  const float m_use = mx == kNegInf ? 0.f : mx;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.f, ls = 0.f;
    for (int i = 0; i < nparts; ++i) {
      const float w = ml[2 * i + 1] * fast_exp2(ml[2 * i] - m_use);
      ls += w;
      o = fmaf(w, part_out[int64_t(i) * D + d], o);
    }
    static_cast<T*>(p.out)[(int64_t(b) * p.num_q_heads + h) * D + d] =
        from_float<T>(ls > 0.f ? o / ls : 0.f);
  }
}

template <typename T, int D, int GT, bool PREFETCH = false>
const char* launch_paged_decode_group(const DecodeParams& p, gpuStream_t stream) {
  using S = DecodeShape<T, D, GT, PREFETCH>;
  if (p.batch > 65535 || p.max_parts > 65535) return "jaxattn: batch or partition count over 65535";
  const dim3 grid(p.kv.num_kv_heads, p.batch, p.partition_size > 0 ? p.max_parts : 1);
  paged_decode_kernel<T, D, GT, PREFETCH><<<grid, S::kThreads, S::kSmemBytes, stream>>>(p);
  if (const char* e = check_launch()) return e;
  if (p.partition_size > 0) {
    decode_combine_kernel<T, D><<<dim3(p.num_q_heads, p.batch), 128, 0, stream>>>(p);
    if (const char* e = check_launch()) return e;
  }
  return nullptr;
}

// JAXATTN_DECODE_PREFETCH=1 selects the variant that loads the next step's K/V while the
// current one is computed, built for CUDA, 16-bit caches, head_dim 64/128 and groups up to
// 8. Read once per process. Not yet the default: it has not been measured on a GPU (and
// hipcc puts its register sets in scratch memory).
inline bool decode_prefetch() {
  static const bool on = [] {
    const char* env = std::getenv("JAXATTN_DECODE_PREFETCH");
    return env != nullptr && env[0] == '1';
  }();
  return on;
}

// The smallest group template that covers the runtime group; extra heads are masked.
template <typename T, int D>
const char* launch_paged_decode_dim(const DecodeParams& p, gpuStream_t stream) {
  const int group = p.num_q_heads / p.kv.num_kv_heads;
#if defined(JAXATTN_CUDA)
  if constexpr (sizeof(T) == 2 && (D == 64 || D == 128)) {
    if (decode_prefetch()) {
      if (group <= 1) return launch_paged_decode_group<T, D, 1, true>(p, stream);
      if (group <= 2) return launch_paged_decode_group<T, D, 2, true>(p, stream);
      if (group <= 4) return launch_paged_decode_group<T, D, 4, true>(p, stream);
      if (group <= 8) return launch_paged_decode_group<T, D, 8, true>(p, stream);
    }
  }
#endif
  if (group <= 1) return launch_paged_decode_group<T, D, 1>(p, stream);
  if (group <= 2) return launch_paged_decode_group<T, D, 2>(p, stream);
  if (group <= 4) return launch_paged_decode_group<T, D, 4>(p, stream);
  if (group <= 8) return launch_paged_decode_group<T, D, 8>(p, stream);
  if (group <= 16) return launch_paged_decode_group<T, D, 16>(p, stream);
  if (group <= 32) return launch_paged_decode_group<T, D, 32>(p, stream);
  if (group <= 64) return launch_paged_decode_group<T, D, 64>(p, stream);
  return "jaxattn: paged decode serves at most 64 query heads per KV head";
}

template <typename T>
const char* launch_paged_decode_typed(const DecodeParams& p, gpuStream_t stream) {
  switch (p.kv.head_dim) {
    case 32:
      return launch_paged_decode_dim<T, 32>(p, stream);
    case 64:
      return launch_paged_decode_dim<T, 64>(p, stream);
    case 128:
      return launch_paged_decode_dim<T, 128>(p, stream);
    case 256:
      return launch_paged_decode_dim<T, 256>(p, stream);
    default:
      return "jaxattn: GPU paged decode is built for head_dim 32, 64, 128 and 256";
  }
}

}  // namespace gpu
}  // namespace jaxattn
