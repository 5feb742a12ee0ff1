// Skinny matmul for decode steps: out[m, n] = x[m, k] w[k, n] for up to 8 rows of x, the
// shape of every projection of a decode step at small batch. One source for CUDA and HIP
// (SIMT: no tensor cores below 8 rows are worth their fragments).
//
// The problem is reading w once at the memory's speed: 16 bytes a load, enough loads in
// flight, and the few FMAs per byte (8 per row of x) spread over every SM. A block takes a
// tile of 256 columns (32 column lanes, one 16-byte vector of 8 columns each) and a range of
// `rows_per_split` rows of w; its 8 row lanes (a warp's worth of threads each on CUDA, whatever
// the wavefront width: the mapping uses thread indices, not lanes) step through the range 8
// rows apart, each thread with the loads of its next step in flight while it sums the current
// one (two register buffers of kLinearUnroll 16-byte loads). x's rows of the range sit in
// shared memory as f32. The row lanes' sums meet in shared memory, one row of x at a time;
// with one split they are the output, otherwise each block leaves f32 partial sums and the
// last block of the column tile (an atomic count) adds the splits in order and writes the
// output, so the result does not depend on which block finished first.
//
// Guards: columns past n and rows past k are neither read nor written; n must be a multiple of
// 8 and the buffers 16-byte aligned (jaxattn/native.py checks n; XLA aligns its buffers).
#pragma once

#include "jaxattn/gpu_vendor.h"
#include "jaxattn/params.h"

namespace jaxattn {
namespace gpu {

constexpr int kLinearThreads = 256;
constexpr int kLinearColLanes = 32;
constexpr int kLinearRowLanes = kLinearThreads / kLinearColLanes;  // 8
constexpr int kLinearCols = 8 * kLinearColLanes;                   // 256 columns a block
static_assert(kLinearCols == kLinearTileCols, "params.h's tiles are this kernel's");
constexpr int kLinearUnroll = 4;  // 16-byte loads a step a thread; two steps in flight
constexpr int kLinearStep = kLinearRowLanes * kLinearUnroll;       // rows per step: 32
constexpr int kLinearMaxRows = 8;
constexpr int kLinearMaxRowsPerSplit = 1024;

// Resident blocks an SM the kernel is built for: four at one row of x (64 registers: up to
// 128 KiB of loads in flight an SM), three at two, two at four or eight (their sums take the
// registers). jaxattn/native.py's split rule counts the same.
constexpr int linear_blocks_per_sm(int mr) { return mr == 1 ? 4 : mr == 2 ? 3 : 2; }

template <typename T, typename O, int MR>
__global__ void __launch_bounds__(kLinearThreads, linear_blocks_per_sm(MR))
    linear_rows_kernel(const LinearParams p) {
  extern __shared__ __align__(16) float lin_smem[];
  const int tile = blockIdx.x, split = blockIdx.y;
  const int lane = int(threadIdx.x) % kLinearColLanes, rl = int(threadIdx.x) / kLinearColLanes;
  const int k0 = split * p.rows_per_split;
  const int rows = min(p.k, k0 + p.rows_per_split) - k0;  // > 0: the grid has no empty split
  float* xs = lin_smem;                                   // [rows_per_split][MR]
  float* red = lin_smem + p.rows_per_split * MR;          // [row lanes][kLinearCols]
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.w);

  const int col = tile * kLinearCols + lane * 8;
  const bool col_ok = col < p.n;
  const T* wcol = w + int64_t(k0) * p.n + col;
  // Rows r0, r0 + 8, ... of this thread's step into v (zeros past the range or the columns).
  auto load = [&](uint4* v, int r0) {
#pragma unroll
    for (int u = 0; u < kLinearUnroll; ++u) {
      const int r = r0 + u * kLinearRowLanes;
      v[u] = (col_ok && r < rows) ? *reinterpret_cast<const uint4*>(wcol + int64_t(r) * p.n)
                                  : make_uint4(0u, 0u, 0u, 0u);
    }
  };
  float acc[MR][8];
#pragma unroll
  for (int m = 0; m < MR; ++m)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[m][j] = 0.f;
  auto accumulate = [&](const uint4* v, int r0) {
#pragma unroll
    for (int u = 0; u < kLinearUnroll; ++u) {
      const int r = r0 + u * kLinearRowLanes;
      if (r < rows) {
        float wf[8];
        vec_to_float<T>(v[u], wf);
        const float* xr = xs + r * MR;
#pragma unroll
        for (int m = 0; m < MR; ++m) {
          const float xv = xr[m];
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[m][j] = fmaf(xv, wf[j], acc[m][j]);
        }
      }
    }
  };

  // The first step's loads go out before x is staged (they do not need it); then two
  // register buffers alternate, the next step's loads in flight while this one is summed.
  uint4 va[kLinearUnroll], vb[kLinearUnroll];
  load(va, rl);
  for (int i = int(threadIdx.x); i < rows * MR; i += kLinearThreads) {
    const int r = i / MR, m = i % MR;
    xs[i] = m < p.m ? to_float(x[int64_t(m) * p.k + k0 + r]) : 0.f;
  }
  __syncthreads();
  for (int r0 = rl; r0 < rows; r0 += 2 * kLinearStep) {
    load(vb, r0 + kLinearStep);
    accumulate(va, r0);
    if (r0 + kLinearStep >= rows) break;
    load(va, r0 + 2 * kLinearStep);
    accumulate(vb, r0 + kLinearStep);
  }

  // Row lanes -> one sum per (row of x, column), one row of x at a time; thread t owns
  // column tile * 256 + t.
  const int out_col = tile * kLinearCols + int(threadIdx.x);
  const bool out_ok = out_col < p.n;
  for (int m = 0; m < MR && m < p.m; ++m) {
    float4* r4 = reinterpret_cast<float4*>(red + rl * kLinearCols + lane * 8);
    r4[0] = make_float4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
    r4[1] = make_float4(acc[m][4], acc[m][5], acc[m][6], acc[m][7]);
    __syncthreads();
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kLinearRowLanes; ++i) s += red[i * kLinearCols + int(threadIdx.x)];
    __syncthreads();
    if (out_ok) {
      if (p.splits == 1)
        static_cast<O*>(p.out)[int64_t(m) * p.n + out_col] = from_float<O>(s);
      else
        p.partial[(int64_t(split) * p.m + m) * p.n + out_col] = s;
    }
  }
  if (p.splits == 1) return;

  // The last block of this column tile adds the splits' partial sums in split order.
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(p.counters + tile, 1) == p.splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (!out_ok) return;
  const volatile float* part = p.partial;
  for (int m = 0; m < p.m; ++m) {
    float s = 0.f;
    for (int sp = 0; sp < p.splits; ++sp) s += part[(int64_t(sp) * p.m + m) * p.n + out_col];
    static_cast<O*>(p.out)[int64_t(m) * p.n + out_col] = from_float<O>(s);
  }
}

// Dynamic shared memory of a launch: x's rows of a split in f32, and the row lanes' sums.
inline int linear_smem_bytes(const LinearParams& p, int mr) {
  return (p.rows_per_split * mr + kLinearRowLanes * kLinearCols) * int(sizeof(float));
}

template <typename T, typename O, int MR>
const char* launch_linear_rows(const LinearParams& p, gpuStream_t stream) {
  const dim3 grid(linear_tiles(p.n), p.splits);
  if (p.splits > 1 &&
      gpuMemsetAsync(p.counters, 0, sizeof(int32_t) * linear_tiles(p.n), stream) != gpuSuccess)
    return check_launch();
  linear_rows_kernel<T, O, MR><<<grid, kLinearThreads, linear_smem_bytes(p, MR), stream>>>(p);
  return check_launch();
}

// T: x's and w's element type; O: the output's (T or float).
template <typename T, typename O>
const char* launch_linear_typed(const LinearParams& p, gpuStream_t stream) {
  if (p.m <= 0 || p.n <= 0) return nullptr;  // nothing to write
  if (p.m > kLinearMaxRows) return "jaxattn: the GPU linear kernel takes at most 8 rows";
  if (p.n % 8 != 0) return "jaxattn: the GPU linear kernel needs n a multiple of 8";
  if (p.k <= 0 || p.splits < 1 || p.rows_per_split <= 0 ||
      p.rows_per_split > kLinearMaxRowsPerSplit ||
      int64_t(p.splits - 1) * p.rows_per_split >= p.k ||
      int64_t(p.splits) * p.rows_per_split < p.k || linear_tiles(p.n) > 65535 || p.splits > 65535)
    return "jaxattn: bad split of the linear kernel's rows";
  if (p.m == 1) return launch_linear_rows<T, O, 1>(p, stream);
  if (p.m == 2) return launch_linear_rows<T, O, 2>(p, stream);
  if (p.m <= 4) return launch_linear_rows<T, O, 4>(p, stream);
  return launch_linear_rows<T, O, 8>(p, stream);
}

}  // namespace gpu
}  // namespace jaxattn
