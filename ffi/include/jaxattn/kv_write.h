// write_kv's element and row steps, one source for the CPU handler and the GPU kernel
// (ffi/src/kv_write.cu): what jaxattn.kv.write_kv stores, bit for bit.
//
// A row (token t, KV head h) of k or v, in the input dtype In, goes to the cache row of slot
// slots[t] in the cache's dtype C:
//   * In == C and no scale: the bits as they are (NaN payloads included);
//   * no scale into a 16-bit / float32 cache: the cast (round to nearest even);
//   * a scale, or an FP8 cache: float32(x) * (1 / scale[h]) (both rounded to nearest: how
//     XLA evaluates quantize's x / scale, a division by a broadcast), clipped to C's finite
//     range (NaN stays NaN), then the cast.
// A negative slot, or one at or past num_pages * page_size, writes nothing.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "jaxattn/dtypes.h"
#include "jaxattn/params.h"

namespace jaxattn {

// The largest finite value of a cache element type (what jaxattn.quant.format_max gives).
template <typename C>
struct FiniteMax;
template <>
struct FiniteMax<float> {
  static constexpr float value = 3.40282346638528859812e+38f;
};
template <>
struct FiniteMax<bf16_t> {
  static constexpr float value = 3.38953138925153547590e+38f;  // 0x7f7f
};
template <>
struct FiniteMax<f16_t> {
  static constexpr float value = 65504.f;
};
template <>
struct FiniteMax<e4m3_t> {
  static constexpr float value = 448.f;
};
template <>
struct FiniteMax<e5m2_t> {
  static constexpr float value = 57344.f;
};

// x * (1 / s), each step rounded to nearest (also where the device code is built with fast
// division).
JAXATTN_HD float mul_rcp_rn(float x, float s) {
#if defined(JAXATTN_DEVICE_PASS)
  return __fmul_rn(x, __frcp_rn(s));
#else
  return x * (1.f / s);
#endif
}

// One element as the cache stores it; `scale` is the row's head scale, or nullptr.
template <typename In, typename C>
JAXATTN_HD C stored_element(In x, const float* scale) {
  if constexpr (std::is_same_v<In, C>) {
    if (scale == nullptr) return x;
  }
  float y = to_float(x);
  if (scale == nullptr && !is_fp8_v<C>) return from_float<C>(y);
  if (scale != nullptr) y = mul_rcp_rn(y, *scale);
  constexpr float big = FiniteMax<C>::value;
  y = y > big ? big : (y < -big ? -big : y);  // comparisons with NaN are false: NaN stays
  return from_float<C>(y);
}

// Element offset of the cache row (slot, head h), or -1 when the slot writes nothing.
JAXATTN_HD int64_t write_kv_row(const KvGeometry& g, int32_t slot, int h) {
  if (slot < 0) return -1;
  const int32_t page = g.page_of(slot);
  if (page >= g.num_pages) return -1;
  return page * g.page_stride + g.slot_of(slot) * g.token_stride + h * g.head_stride;
}

// One rotate-half RoPE pair of rope_write_kv: x1 (element j < head_dim / 2) and x2 (element j +
// head_dim / 2) become x1 cos - x2 sin and x2 cos + x1 sin, in float32 (each product and the sum
// rounded, no fused multiply-add), then rounded to In: what jaxattn.models.llama's rotation
// computes before the cache stores the row.
template <typename In>
JAXATTN_HD void rope_pair(In* x1, In* x2, float c, float s) {
  const float a = to_float(*x1), b = to_float(*x2);
#if defined(JAXATTN_DEVICE_PASS)
  const float r1 = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  const float r2 = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
#else
  volatile float ac = a * c, bs = b * s, bc = b * c, as = a * s;
  const float r1 = ac - bs, r2 = bc + as;
#endif
  *x1 = from_float<In>(r1);
  *x2 = from_float<In>(r2);
}

// Calls f(C{}) with C the element type of `cache` and returns its result; unsupported() for
// kUnsupported (called only then). The CPU handler and the GPU launcher both pick their
// instantiation here.
template <typename F, typename U>
auto with_cache_type(CacheDType cache, F&& f, U&& unsupported) -> decltype(unsupported()) {
  switch (cache) {
    case CacheDType::kF32:
      return f(float{});
    case CacheDType::kBF16:
      return f(bf16_t{});
    case CacheDType::kF16:
      return f(f16_t{});
    case CacheDType::kE4M3:
      return f(e4m3_t{});
    case CacheDType::kE5M2:
      return f(e5m2_t{});
    case CacheDType::kUnsupported:
      break;
  }
  return unsupported();
}

namespace cpu {

template <typename In, typename C>
void write_kv(const WriteKvParams& p) {
  const KvGeometry& g = p.kv;
  const int D = g.head_dim, H = g.num_kv_heads;
  for (int which = 0; which < 2; ++which) {
    const In* src = static_cast<const In*>(which ? p.v : p.k);
    C* cache = static_cast<C*>(which ? p.v_cache : p.k_cache);
    const float* scales = which ? p.scales.v : p.scales.k;
    for (int32_t t = 0; t < p.num_tokens; ++t) {
      for (int h = 0; h < H; ++h) {
        const int64_t row = write_kv_row(g, p.slots[t], h);
        if (row < 0) continue;
        const In* x = src + (int64_t(t) * H + h) * D;
        const float* s = scales ? scales + h : nullptr;
        for (int d = 0; d < D; ++d) cache[row + d] = stored_element<In, C>(x[d], s);
      }
    }
  }
}

template <typename In, typename C>
void rope_write_kv(const RopeWriteKvParams& p) {
  const KvGeometry& g = p.w.kv;
  const int D = g.head_dim, half = D / 2, Hq = p.num_q_heads, Hkv = g.num_kv_heads;
  const int H = Hq + 2 * Hkv;
  const In* qkv = static_cast<const In*>(p.qkv);
  const float* parts = static_cast<const float*>(p.qkv);
  const int64_t stride = int64_t(p.w.num_tokens) * H * D;
  In* q_out = static_cast<In*>(p.q_out);
  std::vector<In> row(D);
  for (int32_t t = 0; t < p.w.num_tokens; ++t) {
    const float* cs = p.cos + int64_t(t) * half;
    const float* sn = p.sin + int64_t(t) * half;
    for (int h = 0; h < H; ++h) {
      const int64_t at = (int64_t(t) * H + h) * D;
      for (int d = 0; d < D; ++d)
        row[d] = p.splits > 0 ? summed_partials<In>(parts, p.splits, stride, at + d) : qkv[at + d];
      if (h < Hq + Hkv)
        for (int j = 0; j < half; ++j) rope_pair(&row[j], &row[j + half], cs[j], sn[j]);
      if (h < Hq) {
        for (int d = 0; d < D; ++d) q_out[(int64_t(t) * Hq + h) * D + d] = row[d];
        continue;
      }
      const bool is_v = h >= Hq + Hkv;
      const int kh = h - Hq - (is_v ? Hkv : 0);
      const int64_t dst = write_kv_row(g, p.w.slots[t], kh);
      if (dst < 0) continue;
      C* cache = static_cast<C*>(is_v ? p.w.v_cache : p.w.k_cache);
      const float* scales = is_v ? p.w.scales.v : p.w.scales.k;
      const float* s = scales ? scales + kh : nullptr;
      for (int d = 0; d < D; ++d) cache[dst + d] = stored_element<In, C>(row[d], s);
    }
  }
}

}  // namespace cpu
}  // namespace jaxattn
