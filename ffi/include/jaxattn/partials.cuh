// Split-K partial sums as the GPU kernels load them: 8 consecutive elements at a time, summed
// in float32 in split order and rounded like jaxattn/dtypes.h's summed_partials (the CPU
// handlers' step), so the two builds agree bit for bit. Used where a native kernel takes a
// projection's partials straight from XLA's batched GEMM (rope_write_kv's qkv, add_rms_norm's
// d) instead of a reduction kernel between the two.
#pragma once

#include <cstdint>

#include "jaxattn/dtypes.h"
#include "jaxattn/gpu_vendor.h"

namespace jaxattn {

// out[e] = T(parts[e] + parts[stride + e] + ... ) for e < 8, over `splits` partials `stride`
// elements apart; parts 16-byte aligned (an element offset that is a multiple of 8).
template <typename T>
__device__ __forceinline__ void load_partials8(const float* parts, int32_t splits, int64_t stride,
                                               T* out) {
  float4 lo = *reinterpret_cast<const float4*>(parts);
  float4 hi = *reinterpret_cast<const float4*>(parts + 4);
  // Unrolled so that several splits' loads are in flight at once (in both kernels they are
  // each thread's only memory traffic at that point).
#pragma unroll 4
  for (int32_t s = 1; s < splits; ++s) {
    const float4 a = *reinterpret_cast<const float4*>(parts + s * stride);
    const float4 b = *reinterpret_cast<const float4*>(parts + s * stride + 4);
    lo.x += a.x, lo.y += a.y, lo.z += a.z, lo.w += a.w;
    hi.x += b.x, hi.y += b.y, hi.z += b.z, hi.w += b.w;
  }
  const float f[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = from_float<T>(f[e]);
}

}  // namespace jaxattn
