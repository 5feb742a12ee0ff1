// The XLA FFI side of cascade decode, shared by the CPU and GPU handlers: shape checks, the
// argument block, and the operand / attribute list of the binding. Index values are checked by
// the kernels (jaxattn/cascade.h).
#pragma once

#include <cstdint>
#include <utility>

#include "ffi_common.h"
#include "jaxattn/cascade.h"

namespace jaxattn {
namespace ffi_common {

inline ffi::Error make_cascade_params(
    const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
    const ffi::Buffer<ffi::S32>& prefix_tables, const ffi::Buffer<ffi::S32>& prefix_lens,
    const ffi::Buffer<ffi::S32>& prefix_of, const ffi::Buffer<ffi::S32>& bt,
    const ffi::Buffer<ffi::S32>& seq_lens, const ffi::Buffer<ffi::F32>& k_scale,
    const ffi::Buffer<ffi::F32>& v_scale, ffi::AnyBuffer out, ffi::Buffer<ffi::F32> workspace,
    float scale, float soft_cap, int32_t layout, int32_t prefix_target, int32_t prefix_splits,
    int32_t partition_size, CascadeParams* p, KvType* kv) {
  if (auto e = check_dtypes(q, k, v, out.element_type(), kv); e.failure()) return e;
  if (auto e = paged_geometry(k, v, layout, &p->kv); e.failure()) return e;
  if (auto e = check_query(q, p->kv); e.failure()) return e;
  if (auto e = head_scales(k_scale, v_scale, p->kv, &p->scales); e.failure()) return e;
  const auto qd = q.dimensions();
  const auto pd = prefix_tables.dimensions();
  const auto bd = bt.dimensions();
  if (pd.size() != 2) return invalid("prefix_tables must be [num_prefixes, max_prefix_pages]");
  if (prefix_lens.dimensions().size() != 1 || prefix_lens.dimensions()[0] != pd[0])
    return invalid("prefix_lens must be [num_prefixes]");
  if (prefix_of.dimensions().size() != 1 || prefix_of.dimensions()[0] != qd[0])
    return invalid("prefix_of must be [batch]");
  if (bd.size() != 2 || bd[0] != qd[0])
    return invalid("block_tables must be [batch, max_pages], got " + dims_str(bd));
  if (seq_lens.dimensions().size() != 1 || seq_lens.dimensions()[0] != qd[0])
    return invalid("seq_lens must be [batch]");
  if (prefix_target <= 0 || prefix_splits <= 0)
    return invalid("prefix_target and prefix_splits must be positive");
  if (partition_size < 0) return invalid("partition_size must be >= 0");
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->prefix_tables = prefix_tables.typed_data();
  p->prefix_lens = prefix_lens.typed_data();
  p->prefix_of = prefix_of.typed_data();
  p->block_tables = bt.typed_data();
  p->seq_lens = seq_lens.typed_data();
  p->out = out.untyped_data();
  p->workspace = workspace.typed_data();
  p->batch = static_cast<int32_t>(qd[0]);
  p->num_q_heads = static_cast<int32_t>(qd[1]);
  p->num_prefixes = static_cast<int32_t>(pd[0]);
  p->prefix_table_stride = static_cast<int32_t>(pd[1]);
  p->block_table_stride = static_cast<int32_t>(bd[1]);
  p->prefix_target = prefix_target;
  p->partition_size = partition_size;
  const int64_t own_capacity = bd[1] * int64_t(p->kv.page_size);
  p->own_parts = partition_size > 0
                     ? static_cast<int32_t>((own_capacity + partition_size - 1) / partition_size)
                     : 1;
  p->own_parts = p->own_parts < 1 ? 1 : p->own_parts;
  p->prefix_parts = prefix_splits;
  if (int64_t(workspace.element_count()) <
      cascade_workspace_floats(p->batch, p->num_q_heads, p->parts(), p->kv.head_dim))
    return invalid("workspace too small for prefix_splits and partition_size");
  p->ls = make_logit_scale(scale, soft_cap);
  return ffi::Error::Success();
}

// Order: q, k_cache, v_cache, prefix_tables, prefix_lens, prefix_of, block_tables, seq_lens,
// k_scale, v_scale, out, workspace, attributes (the scales after the index arrays, as in
// ffi_common.h's bindings).
template <typename B>
auto bind_cascade_attention(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<float>("scale")
      .template Attr<float>("soft_cap")
      .template Attr<int32_t>("layout")
      .template Attr<int32_t>("prefix_target")
      .template Attr<int32_t>("prefix_splits")
      .template Attr<int32_t>("partition_size");
}

}  // namespace ffi_common
}  // namespace jaxattn
