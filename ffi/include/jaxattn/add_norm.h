// add_rms_norm's element steps, one source for the CPU handler and the GPU kernel
// (ffi/src/linear.cu): a residual add followed by RMSNorm, what jaxattn.models.llama computes
// between a projection and the next one, in one pass over each row.
//
// Row r of x and d ([rows, cols], dtype T; or d float32 [splits, rows, cols], a split-K
// projection's partial sums, summed in float32 and rounded to T first) and the weight w [cols]
// (T) give
//   sum[r]    = T(float(x) + float(d))                               (the residual stream)
//   normed[r] = T(float(T(s * rsqrt(mean(s * s) + eps))) * float(w))  with s = float(sum[r]),
// in float32, the normalised row rounded to T before the weight's product as the model (and
// Hugging Face's Llama) writes it. The mean and the reciprocal square root may differ from
// XLA's in their last float32 bits (the order of the sum, the rsqrt instruction), so a 16-bit
// result may be one step off XLA's; so may XLA's own where it keeps the normalised row's
// excess precision (xla_allow_excess_precision).
#pragma once

#include <cmath>
#include <cstdint>

#include "jaxattn/dtypes.h"
#include "jaxattn/params.h"

namespace jaxattn {

template <typename T>
JAXATTN_HD T add_rounded(T x, T d) {
  return from_float<T>(to_float(x) + to_float(d));
}

// The normalised, weighted element of s (already the rounded sum) given inv = rsqrt(mean + eps).
template <typename T>
JAXATTN_HD T norm_weighted(T s, float inv, T w) {
  const T y = from_float<T>(to_float(s) * inv);
  return from_float<T>(to_float(y) * to_float(w));
}

namespace cpu {

template <typename T>
void add_rms_norm(const AddNormParams& p) {
  const T* x = static_cast<const T*>(p.x);
  const T* d = static_cast<const T*>(p.d);
  const T* w = static_cast<const T*>(p.w);
  T* sum = static_cast<T*>(p.sum);
  T* normed = static_cast<T*>(p.normed);
  const float* parts = static_cast<const float*>(p.d);
  const int64_t stride = int64_t(p.rows) * p.cols;
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t base = r * p.cols;
    float squares = 0.f;
    for (int64_t c = 0; c < p.cols; ++c) {
      const T dv =
          p.splits > 0 ? summed_partials<T>(parts, p.splits, stride, base + c) : d[base + c];
      const T s = add_rounded(x[base + c], dv);
      sum[base + c] = s;
      const float f = to_float(s);
      squares += f * f;
    }
    const float inv = 1.f / std::sqrt(squares / float(p.cols) + p.eps);
    for (int64_t c = 0; c < p.cols; ++c) normed[base + c] = norm_weighted(sum[base + c], inv, w[c]);
  }
}

}  // namespace cpu
}  // namespace jaxattn
