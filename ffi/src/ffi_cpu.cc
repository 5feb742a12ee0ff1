// XLA FFI handlers for the CPU platform: shape checks, dtype dispatch, then the plain C++
// implementation in jaxattn/cpu_attention.h.
#include <algorithm>
#include <cstring>
#include <vector>

#include "cascade_ffi.h"
#include "ffi_common.h"
#include "jaxattn/add_norm.h"
#include "jaxattn/cpu_attention.h"
#include "jaxattn/cpu_cascade.h"
#include "jaxattn/kv_write.h"

namespace ffi = xla::ffi;

namespace jaxattn {
namespace {

using ffi_common::DType;
using ffi_common::dtype_of;
using ffi_common::KvType;

// f(T{}, C{}) with T q's element type and C the cache's (T itself or an FP8 format).
template <typename F>
ffi::Error dispatch(ffi::DataType t, KvType kv, F&& f) {
  auto with_cache = [&](auto tag) {
    using T = decltype(tag);
    switch (kv) {
      case KvType::kSame:
        f(tag, T{});
        return ffi::Error::Success();
      case KvType::kE4M3:
        f(tag, e4m3_t{});
        return ffi::Error::Success();
      case KvType::kE5M2:
        f(tag, e5m2_t{});
        return ffi::Error::Success();
      default:
        return ffi_common::invalid("unsupported KV cache dtype");
    }
  };
  switch (dtype_of(t)) {
    case DType::kF32:
      return with_cache(float{});
    case DType::kBF16:
      return with_cache(bf16_t{});
    case DType::kF16:
      return with_cache(f16_t{});
    default:
      return ffi_common::invalid("unsupported dtype");
  }
}

ffi::Error PagedAttentionCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                             ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                             ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                             ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::Buffer<ffi::F32>> workspace, float scale,
                             float soft_cap, int32_t layout, int32_t partition_size,
                             int32_t copies) {
  DecodeParams p;
  KvType kv;
  if (auto e = ffi_common::make_decode_params(q, k, v, block_tables, seq_lens, k_scale, v_scale,
                                              *out, *workspace, scale, soft_cap, layout,
                                              partition_size, copies, &p, &kv);
      e.failure())
    return e;
  return dispatch(q.element_type(), kv,
                  [&](auto t, auto c) { cpu::paged_decode<decltype(t), decltype(c)>(p); });
}

ffi::Error PrefixPrefillCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::Buffer<ffi::S32> cu_seqlens_q, ffi::Buffer<ffi::S32> block_tables,
                            ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::F32> k_scale,
                            ffi::Buffer<ffi::F32> v_scale, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::Buffer<ffi::U32>> /*work: GPU only*/, float scale,
                            float soft_cap, int32_t layout, int32_t kernel) {
  PrefillParams p;
  KvType kv;
  if (auto e = ffi_common::make_prefix_prefill_params(q, k, v, cu_seqlens_q, block_tables, seq_lens,
                                                      k_scale, v_scale, *out, scale, soft_cap,
                                                      layout, kernel, &p, &kv);
      e.failure())
    return e;
  return dispatch(q.element_type(), kv,
                  [&](auto t, auto c) { cpu::prefill<decltype(t), decltype(c)>(p); });
}

ffi::Error ExtendAttentionCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::Buffer<ffi::S32> qo_indptr, ffi::Buffer<ffi::S32> kv_indptr,
                              ffi::Buffer<ffi::S32> kv_indices, ffi::Buffer<ffi::F32> k_scale,
                              ffi::Buffer<ffi::F32> v_scale, ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::Buffer<ffi::U32>> /*work: GPU only*/, float scale,
                              float soft_cap, int32_t kernel) {
  PrefillParams p;
  KvType kv;
  if (auto e = ffi_common::make_extend_params(q, k, v, qo_indptr, kv_indptr, kv_indices, k_scale,
                                              v_scale, *out, scale, soft_cap, kernel, &p, &kv);
      e.failure())
    return e;
  return dispatch(q.element_type(), kv,
                  [&](auto t, auto c) { cpu::prefill<decltype(t), decltype(c)>(p); });
}

ffi::Error CascadeAttentionCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                               ffi::Buffer<ffi::S32> prefix_tables,
                               ffi::Buffer<ffi::S32> prefix_lens, ffi::Buffer<ffi::S32> prefix_of,
                               ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                               ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                               ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::Buffer<ffi::F32>> workspace, float scale,
                               float soft_cap, int32_t layout, int32_t prefix_target,
                               int32_t prefix_splits, int32_t partition_size) {
  CascadeParams p;
  KvType kv;
  if (auto e = ffi_common::make_cascade_params(q, k, v, prefix_tables, prefix_lens, prefix_of,
                                               block_tables, seq_lens, k_scale, v_scale, *out,
                                               *workspace, scale, soft_cap, layout, prefix_target,
                                               prefix_splits, partition_size, &p, &kv);
      e.failure())
    return e;
  return dispatch(q.element_type(), kv,
                  [&](auto t, auto c) { cpu::cascade_decode<decltype(t), decltype(c)>(p); });
}

// out = x w, one row of x at a time, float32 sums in k order (no split on the CPU).
template <typename T, typename O>
void linear_rows(const LinearParams& p) {
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.w);
  O* out = static_cast<O*>(p.out);
  std::vector<float> acc(size_t(p.n));
  for (int32_t m = 0; m < p.m; ++m) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int32_t k = 0; k < p.k; ++k) {
      const float xv = to_float(x[int64_t(m) * p.k + k]);
      const T* wr = w + int64_t(k) * p.n;
      for (int32_t n = 0; n < p.n; ++n) acc[size_t(n)] += xv * to_float(wr[n]);
    }
    for (int32_t n = 0; n < p.n; ++n) out[int64_t(m) * p.n + n] = from_float<O>(acc[size_t(n)]);
  }
}

ffi::Error LinearCpu(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::Buffer<ffi::F32>> workspace, int32_t rows_per_split) {
  LinearParams p;
  // One pass on the CPU: rows_per_split (the GPU kernel's split) is checked, not used.
  if (auto e = ffi_common::make_linear_params(x, w, *out, *workspace, 0, &p); e.failure())
    return e;
  if (rows_per_split < 0) return ffi_common::invalid("linear: rows_per_split must be >= 0");
  const bool f32_out = out->element_type() == ffi::DataType::F32;
  switch (dtype_of(x.element_type())) {
    case DType::kF32:
      linear_rows<float, float>(p);
      break;
    case DType::kBF16:
      f32_out ? linear_rows<bf16_t, float>(p) : linear_rows<bf16_t, bf16_t>(p);
      break;
    case DType::kF16:
      f32_out ? linear_rows<f16_t, float>(p) : linear_rows<f16_t, f16_t>(p);
      break;
    default:
      return ffi_common::invalid("unsupported dtype");
  }
  return ffi::Error::Success();
}

// The cache writers' results start as copies of the caches where XLA did not alias them.
void copy_unaliased_caches(const ffi::AnyBuffer& k_cache, const ffi::AnyBuffer& v_cache,
                           const WriteKvParams& p) {
  if (p.k_cache != k_cache.untyped_data())
    std::memcpy(p.k_cache, k_cache.untyped_data(), k_cache.size_bytes());
  if (p.v_cache != v_cache.untyped_data())
    std::memcpy(p.v_cache, v_cache.untyped_data(), v_cache.size_bytes());
}

// Calls f(In{}, C{}) for the rows' dtype In and the cache's element type C.
template <typename F>
ffi::Error with_write_types(DType in, CacheDType cache, F&& f) {
  auto with_input = [&](auto c) -> ffi::Error {
    switch (in) {
      case DType::kF32:
        f(float{}, c);
        return ffi::Error::Success();
      case DType::kBF16:
        f(bf16_t{}, c);
        return ffi::Error::Success();
      case DType::kF16:
        f(f16_t{}, c);
        return ffi::Error::Success();
      default:
        return ffi_common::invalid("unsupported dtype");
    }
  };
  return with_cache_type(cache, with_input,
                         [] { return ffi_common::invalid("unsupported KV cache dtype"); });
}

ffi::Error WriteKvCpu(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer k,
                      ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::F32> k_scale,
                      ffi::Buffer<ffi::F32> v_scale, ffi::Result<ffi::AnyBuffer> k_out,
                      ffi::Result<ffi::AnyBuffer> v_out, int32_t layout) {
  WriteKvParams p;
  DType in;
  CacheDType cache;
  if (auto e = ffi_common::make_write_kv_params(k_cache, v_cache, k, v, slots, k_scale, v_scale,
                                                *k_out, *v_out, layout, &p, &in, &cache);
      e.failure())
    return e;
  copy_unaliased_caches(k_cache, v_cache, p);
  return with_write_types(in, cache,
                          [&](auto x, auto c) { cpu::write_kv<decltype(x), decltype(c)>(p); });
}

ffi::Error AddRmsNormCpu(ffi::AnyBuffer x, ffi::AnyBuffer d, ffi::AnyBuffer w,
                         ffi::Result<ffi::AnyBuffer> sum, ffi::Result<ffi::AnyBuffer> normed,
                         float eps) {
  AddNormParams p;
  DType in;
  if (auto e = ffi_common::make_add_norm_params(x, d, w, *sum, *normed, eps, &p, &in); e.failure())
    return e;
  switch (in) {
    case DType::kF32:
      cpu::add_rms_norm<float>(p);
      break;
    case DType::kBF16:
      cpu::add_rms_norm<bf16_t>(p);
      break;
    case DType::kF16:
      cpu::add_rms_norm<f16_t>(p);
      break;
    default:
      return ffi_common::invalid("unsupported dtype");
  }
  return ffi::Error::Success();
}

ffi::Error RopeWriteKvCpu(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer qkv,
                          ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                          ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::F32> k_scale,
                          ffi::Buffer<ffi::F32> v_scale, ffi::Result<ffi::AnyBuffer> k_out,
                          ffi::Result<ffi::AnyBuffer> v_out, ffi::Result<ffi::AnyBuffer> q_out,
                          int32_t layout, int32_t num_q_heads) {
  RopeWriteKvParams p;
  DType in;
  CacheDType cache;
  if (auto e = ffi_common::make_rope_write_kv_params(k_cache, v_cache, qkv, cos, sin, slots,
                                                     k_scale, v_scale, *k_out, *v_out, *q_out,
                                                     layout, num_q_heads, &p, &in, &cache);
      e.failure())
    return e;
  copy_unaliased_caches(k_cache, v_cache, p.w);
  return with_write_types(in, cache, [&](auto x, auto c) {
    cpu::rope_write_kv<decltype(x), decltype(c)>(p);
  });
}

}  // namespace
}  // namespace jaxattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnAddRmsNormCpu, jaxattn::AddRmsNormCpu,
                              jaxattn::ffi_common::bind_add_rms_norm(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnRopeWriteKvCpu, jaxattn::RopeWriteKvCpu,
                              jaxattn::ffi_common::bind_rope_write_kv(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnWriteKvCpu, jaxattn::WriteKvCpu,
                              jaxattn::ffi_common::bind_write_kv(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnLinearCpu, jaxattn::LinearCpu,
                              jaxattn::ffi_common::bind_linear(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnPagedAttentionCpu, jaxattn::PagedAttentionCpu,
                              jaxattn::ffi_common::bind_paged_attention(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnPrefixPrefillCpu, jaxattn::PrefixPrefillCpu,
                              jaxattn::ffi_common::bind_prefix_prefill(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnExtendAttentionCpu, jaxattn::ExtendAttentionCpu,
                              jaxattn::ffi_common::bind_extend_attention(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnCascadeAttentionCpu, jaxattn::CascadeAttentionCpu,
                              jaxattn::ffi_common::bind_cascade_attention(ffi::Ffi::Bind()));

// The operand-list version of these handlers (ffi_common::kFfiAbi), checked by jaxattn/native.py.
extern "C" int jaxattn_ffi_abi() { return jaxattn::ffi_common::kFfiAbi; }
