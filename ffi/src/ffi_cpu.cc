// XLA FFI handlers for the CPU platform: shape checks, dtype dispatch, then the plain C++
// implementation in jaxattn/cpu_attention.h.
#include "cascade_ffi.h"
#include "ffi_common.h"
#include "jaxattn/cpu_attention.h"
#include "jaxattn/cpu_cascade.h"

namespace ffi = xla::ffi;

namespace jaxattn {
namespace {

using ffi_common::DType;
using ffi_common::dtype_of;

template <typename F>
ffi::Error dispatch(ffi::DataType t, F&& f) {
  switch (dtype_of(t)) {
    case DType::kF32:
      f(float{});
      return ffi::Error::Success();
    case DType::kBF16:
      f(bf16_t{});
      return ffi::Error::Success();
    case DType::kF16:
      f(f16_t{});
      return ffi::Error::Success();
    default:
      return ffi_common::invalid("unsupported dtype");
  }
}

ffi::Error PagedAttentionCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                             ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                             ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::Buffer<ffi::F32>> workspace, float scale,
                             float soft_cap, int32_t layout, int32_t partition_size) {
  DecodeParams p;
  if (auto e = ffi_common::make_decode_params(q, k, v, block_tables, seq_lens, *out, *workspace,
                                              scale, soft_cap, layout, partition_size, &p);
      e.failure())
    return e;
  return dispatch(q.element_type(), [&](auto tag) { cpu::paged_decode<decltype(tag)>(p); });
}

ffi::Error PrefixPrefillCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::Buffer<ffi::S32> cu_seqlens_q, ffi::Buffer<ffi::S32> block_tables,
                            ffi::Buffer<ffi::S32> seq_lens, ffi::Result<ffi::AnyBuffer> out,
                            float scale, float soft_cap, int32_t layout,
                            int32_t kernel) {
  PrefillParams p;
  if (auto e = ffi_common::make_prefix_prefill_params(q, k, v, cu_seqlens_q, block_tables, seq_lens,
                                                      *out, scale, soft_cap, layout, kernel, &p);
      e.failure())
    return e;
  return dispatch(q.element_type(), [&](auto tag) { cpu::prefill<decltype(tag)>(p); });
}

ffi::Error ExtendAttentionCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::Buffer<ffi::S32> qo_indptr, ffi::Buffer<ffi::S32> kv_indptr,
                              ffi::Buffer<ffi::S32> kv_indices, ffi::Result<ffi::AnyBuffer> out,
                              float scale, float soft_cap, int32_t kernel) {
  PrefillParams p;
  if (auto e = ffi_common::make_extend_params(q, k, v, qo_indptr, kv_indptr, kv_indices, *out,
                                              scale, soft_cap, kernel, &p);
      e.failure())
    return e;
  return dispatch(q.element_type(), [&](auto tag) { cpu::prefill<decltype(tag)>(p); });
}

ffi::Error CascadeAttentionCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                               ffi::Buffer<ffi::S32> prefix_tables,
                               ffi::Buffer<ffi::S32> prefix_lens, ffi::Buffer<ffi::S32> prefix_of,
                               ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                               ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::Buffer<ffi::F32>> workspace, float scale,
                               float soft_cap, int32_t layout, int32_t prefix_target,
                               int32_t prefix_splits, int32_t partition_size) {
  CascadeParams p;
  if (auto e = ffi_common::make_cascade_params(
          q, k, v, prefix_tables, prefix_lens, prefix_of, block_tables, seq_lens, *out, *workspace,
          scale, soft_cap, layout, prefix_target, prefix_splits, partition_size, &p);
      e.failure())
    return e;
  return dispatch(q.element_type(), [&](auto tag) { cpu::cascade_decode<decltype(tag)>(p); });
}

}  // namespace
}  // namespace jaxattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnPagedAttentionCpu, jaxattn::PagedAttentionCpu,
                              jaxattn::ffi_common::bind_paged_attention(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnPrefixPrefillCpu, jaxattn::PrefixPrefillCpu,
                              jaxattn::ffi_common::bind_prefix_prefill(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnExtendAttentionCpu, jaxattn::ExtendAttentionCpu,
                              jaxattn::ffi_common::bind_extend_attention(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnCascadeAttentionCpu, jaxattn::CascadeAttentionCpu,
                              jaxattn::ffi_common::bind_cascade_attention(ffi::Ffi::Bind()));
