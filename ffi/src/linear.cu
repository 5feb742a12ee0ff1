// The decode step's model kernels: the GPU linear kernel (jaxattn/linear.cuh) for each (input,
// output) dtype pair, and add_rms_norm (jaxattn/add_norm.h).
#include "gpu_launch.h"
#include "jaxattn/add_norm.h"
#include "jaxattn/linear.cuh"
#include "jaxattn/partials.cuh"

namespace jaxattn {
namespace gpu {

namespace {

constexpr int kNormThreads = 256;

template <typename E>
struct alignas(sizeof(E) * 8 >= 16 ? 16 : sizeof(E) * 8) Elems8 {
  E e[8];
};

// 8 consecutive elements of d at element offset `at`: d's own (T), or the float32 sum of the
// split-K partials (summed_partials' order and rounding, 8 at a time).
template <typename T>
__device__ __forceinline__ Elems8<T> load_d8(const AddNormParams& p, int64_t at) {
  if (p.splits == 0) return *reinterpret_cast<const Elems8<T>*>(static_cast<const T*>(p.d) + at);
  Elems8<T> out;
  load_partials8(static_cast<const float*>(p.d) + at, p.splits, int64_t(p.rows) * p.cols, out.e);
  return out;
}

// x + d of 8 elements (rounded to T, as the spec adds), their squares added to `squares`.
template <typename T>
__device__ __forceinline__ Elems8<T> add_squared(const Elems8<T>& x, const Elems8<T>& d,
                                                 float& squares) {
  Elems8<T> s;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    s.e[e] = add_rounded(x.e[e], d.e[e]);
    const float f = to_float(s.e[e]);
    squares += f * f;
  }
  return s;
}

// The sums s of 8 elements normalised by the row's inv and weighted by w.
template <typename T>
__device__ __forceinline__ Elems8<T> normed8(const Elems8<T>& s, float inv, const Elems8<T>& w) {
  Elems8<T> y;
#pragma unroll
  for (int e = 0; e < 8; ++e) y.e[e] = norm_weighted(s.e[e], inv, w.e[e]);
  return y;
}

// The sum of every thread's `v` in a block of kNormThreads threads, returned to all of them.
__device__ float block_sum(float v) {
  constexpr int kWarps = kNormThreads / WARP_SIZE;
  __shared__ float warp_sums[kWarps];
  for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v += shfl_xor(v, o);
  if (threadIdx.x % WARP_SIZE == 0) warp_sums[threadIdx.x / WARP_SIZE] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) total += warp_sums[i];
  return total;
}

// One block a row. A row of up to kNormThreads * kMaxHeld chunks of 8 elements (4096) stays in
// registers: each thread issues every load of its chunks (x, d or d's partials, w) before it
// stores anything, so that they are in flight together, stores the sums, and after a
// block-wide sum of squares normalises the sums it holds, with no second pass over memory (at
// 64 rows the grid is one block on half the SMs, and a load's latency is its time). Four
// chunks a thread spilled in the 16-bit kernels.
constexpr int kMaxHeld = 2;

template <typename T, int HELD>
__global__ void __launch_bounds__(kNormThreads) add_rms_norm_kernel(const AddNormParams p) {
  const int64_t base = int64_t(blockIdx.x) * p.cols;
  const int chunks = p.cols / 8;
  Elems8<T> s[HELD], w[HELD];
  float squares = 0.f;
#pragma unroll
  for (int i = 0; i < HELD; ++i) {  // loads and sums, no stores
    const int c = threadIdx.x + i * kNormThreads;
    if (c < chunks) {
      const auto a = *reinterpret_cast<const Elems8<T>*>(static_cast<const T*>(p.x) + base + c * 8);
      const auto b = load_d8<T>(p, base + c * 8);
      w[i] = *reinterpret_cast<const Elems8<T>*>(static_cast<const T*>(p.w) + c * 8);
      s[i] = add_squared(a, b, squares);
    }
  }
#pragma unroll
  for (int i = 0; i < HELD; ++i) {
    const int c = threadIdx.x + i * kNormThreads;
    if (c < chunks) *reinterpret_cast<Elems8<T>*>(static_cast<T*>(p.sum) + base + c * 8) = s[i];
  }
  const float inv = rsqrtf(block_sum(squares) / float(p.cols) + p.eps);
#pragma unroll
  for (int i = 0; i < HELD; ++i) {
    const int c = threadIdx.x + i * kNormThreads;
    if (c < chunks)
      *reinterpret_cast<Elems8<T>*>(static_cast<T*>(p.normed) + base + c * 8) =
          normed8(s[i], inv, w[i]);
  }
}

// Longer rows: the sums are stored as they are made and re-read (the thread's own writes).
template <typename T>
__global__ void __launch_bounds__(kNormThreads) add_rms_norm_long_kernel(const AddNormParams p) {
  const int64_t base = int64_t(blockIdx.x) * p.cols;
  const int chunks = p.cols / 8;
  float squares = 0.f;
  for (int c = threadIdx.x; c < chunks; c += kNormThreads) {
    const auto a = *reinterpret_cast<const Elems8<T>*>(static_cast<const T*>(p.x) + base + c * 8);
    const auto b = load_d8<T>(p, base + c * 8);
    const Elems8<T> s = add_squared(a, b, squares);
    *reinterpret_cast<Elems8<T>*>(static_cast<T*>(p.sum) + base + c * 8) = s;
  }
  const float inv = rsqrtf(block_sum(squares) / float(p.cols) + p.eps);
  for (int c = threadIdx.x; c < chunks; c += kNormThreads) {
    const auto s = *reinterpret_cast<const Elems8<T>*>(static_cast<const T*>(p.sum) + base + c * 8);
    const auto w = *reinterpret_cast<const Elems8<T>*>(static_cast<const T*>(p.w) + c * 8);
    *reinterpret_cast<Elems8<T>*>(static_cast<T*>(p.normed) + base + c * 8) = normed8(s, inv, w);
  }
}

template <typename T>
const char* launch_add_norm_typed(const AddNormParams& p, gpuStream_t stream) {
  if (p.rows == 0) return nullptr;
  const dim3 grid(unsigned(p.rows));
  const int held = (p.cols / 8 + kNormThreads - 1) / kNormThreads;
  if (held <= 1) {
    add_rms_norm_kernel<T, 1><<<grid, kNormThreads, 0, stream>>>(p);
  } else if (held <= kMaxHeld) {
    add_rms_norm_kernel<T, kMaxHeld><<<grid, kNormThreads, 0, stream>>>(p);
  } else {
    add_rms_norm_long_kernel<T><<<grid, kNormThreads, 0, stream>>>(p);
  }
  return check_launch();
}

}  // namespace

const char* launch_add_rms_norm(DType dtype, const AddNormParams& p, gpuStream_t stream) {
  if (p.cols % 8 != 0) return "jaxattn: the GPU add_rms_norm needs a row length multiple of 8";
  switch (dtype) {
    case DType::kF32:
      return launch_add_norm_typed<float>(p, stream);
    case DType::kBF16:
      return launch_add_norm_typed<bf16_t>(p, stream);
    case DType::kF16:
      return launch_add_norm_typed<f16_t>(p, stream);
  }
  return "jaxattn: unsupported dtype";
}

const char* launch_linear(DType dtype, bool out_f32, const LinearParams& p, gpuStream_t stream) {
  switch (dtype) {
    case DType::kBF16:
      return out_f32 ? launch_linear_typed<bf16_t, float>(p, stream)
                     : launch_linear_typed<bf16_t, bf16_t>(p, stream);
    case DType::kF16:
      return out_f32 ? launch_linear_typed<f16_t, float>(p, stream)
                     : launch_linear_typed<f16_t, f16_t>(p, stream);
    default:
      return "jaxattn: the GPU linear kernel takes bfloat16 or float16 operands";
  }
}

}  // namespace gpu
}  // namespace jaxattn
