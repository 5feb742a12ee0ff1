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
__device__ Elems8<T> load_d8(const AddNormParams& p, int64_t at) {
  if (p.splits == 0) return *reinterpret_cast<const Elems8<T>*>(static_cast<const T*>(p.d) + at);
  Elems8<T> out;
  load_partials8(static_cast<const float*>(p.d) + at, p.splits, int64_t(p.rows) * p.cols, out.e);
  return out;
}

// One block a row: each thread adds 8 consecutive elements at a time (cols a multiple of 8),
// stores the sums and keeps their squares; a block-wide sum gives the row's scale, and the
// thread then normalises the sums it stored (re-read from its own writes).
template <typename T>
__global__ void __launch_bounds__(kNormThreads) add_rms_norm_kernel(const AddNormParams p) {
  const int64_t base = int64_t(blockIdx.x) * p.cols;
  const int chunks = p.cols / 8;
  float squares = 0.f;
  for (int c = threadIdx.x; c < chunks; c += kNormThreads) {
    const auto a = *reinterpret_cast<const Elems8<T>*>(static_cast<const T*>(p.x) + base + c * 8);
    const auto b = load_d8<T>(p, base + c * 8);
    Elems8<T> s;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      s.e[e] = add_rounded(a.e[e], b.e[e]);
      const float f = to_float(s.e[e]);
      squares += f * f;
    }
    *reinterpret_cast<Elems8<T>*>(static_cast<T*>(p.sum) + base + c * 8) = s;
  }
  constexpr int kWarps = kNormThreads / WARP_SIZE;
  __shared__ float warp_sums[kWarps];
  for (int o = WARP_SIZE / 2; o > 0; o >>= 1) squares += shfl_xor(squares, o);
  if (threadIdx.x % WARP_SIZE == 0) warp_sums[threadIdx.x / WARP_SIZE] = squares;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) total += warp_sums[i];
  const float inv = rsqrtf(total / float(p.cols) + p.eps);
  for (int c = threadIdx.x; c < chunks; c += kNormThreads) {
    const auto s = *reinterpret_cast<const Elems8<T>*>(static_cast<const T*>(p.sum) + base + c * 8);
    const auto w = *reinterpret_cast<const Elems8<T>*>(static_cast<const T*>(p.w) + c * 8);
    Elems8<T> y;
#pragma unroll
    for (int e = 0; e < 8; ++e) y.e[e] = norm_weighted(s.e[e], inv, w.e[e]);
    *reinterpret_cast<Elems8<T>*>(static_cast<T*>(p.normed) + base + c * 8) = y;
  }
}

template <typename T>
const char* launch_add_norm_typed(const AddNormParams& p, gpuStream_t stream) {
  if (p.rows == 0) return nullptr;
  add_rms_norm_kernel<T><<<dim3(unsigned(p.rows)), kNormThreads, 0, stream>>>(p);
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
