// XLA FFI handlers for GPUs; the same file builds for CUDA (nvcc) and ROCm (hipcc), the
// stream type coming from jaxattn/gpu_vendor.h.
#include <string>

#include "cascade_ffi.h"
#include "cascade_launch.h"
#include "ffi_common.h"
#include "gpu_launch.h"

namespace ffi = xla::ffi;

namespace jaxattn {
namespace {

using ffi_common::dtype_of;

ffi::Error gpu_dtype(ffi_common::DType t, gpu::DType* out) {
  switch (t) {
    case ffi_common::DType::kF32:
      *out = gpu::DType::kF32;
      return ffi::Error::Success();
    case ffi_common::DType::kBF16:
      *out = gpu::DType::kBF16;
      return ffi::Error::Success();
    case ffi_common::DType::kF16:
      *out = gpu::DType::kF16;
      return ffi::Error::Success();
    default:
      return ffi_common::invalid("unsupported dtype");
  }
}

ffi::Error gpu_dtype(ffi::DataType t, gpu::DType* out) { return gpu_dtype(dtype_of(t), out); }

ffi::Error launched(const char* what, const char* err) {
  if (err == nullptr) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jaxattn: ") + what + " launch failed: " + err);
}

ffi::Error gpu_kv_type(ffi_common::KvType kv, gpu::KvType* out) {
  switch (kv) {
    case ffi_common::KvType::kSame:
      *out = gpu::KvType::kSame;
      return ffi::Error::Success();
    case ffi_common::KvType::kE4M3:
      *out = gpu::KvType::kE4M3;
      return ffi::Error::Success();
    case ffi_common::KvType::kE5M2:
      *out = gpu::KvType::kE5M2;
      return ffi::Error::Success();
    default:
      return ffi_common::invalid("unsupported KV cache dtype");
  }
}

ffi::Error PagedAttentionGpu(gpuStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                             ffi::AnyBuffer v, ffi::Buffer<ffi::S32> block_tables,
                             ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::F32> k_scale,
                             ffi::Buffer<ffi::F32> v_scale, ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::Buffer<ffi::F32>> workspace, float scale,
                             float soft_cap, int32_t layout, int32_t partition_size,
                             int32_t copies) {
  DecodeParams p;
  ffi_common::KvType kv;
  if (auto e = ffi_common::make_decode_params(q, k, v, block_tables, seq_lens, k_scale, v_scale,
                                              *out, *workspace, scale, soft_cap, layout,
                                              partition_size, copies, &p, &kv);
      e.failure())
    return e;
  gpu::DType dt;
  gpu::KvType kt;
  if (auto e = gpu_dtype(q.element_type(), &dt); e.failure()) return e;
  if (auto e = gpu_kv_type(kv, &kt); e.failure()) return e;
  return launched("paged decode", gpu::launch_paged_decode(dt, kt, p, stream));
}

// The prefix prefill and extend handlers' common end: q's and the cache's types, the persistent
// Hopper kernel's work counter (the calls' `work` result), the launch.
ffi::Error launch_prefill_call(gpuStream_t stream, const char* what, ffi::DataType q_type,
                               ffi_common::KvType kv, ffi::Result<ffi::Buffer<ffi::U32>>& work,
                               PrefillParams& p) {
  gpu::DType dt;
  gpu::KvType kt;
  if (auto e = gpu_dtype(q_type, &dt); e.failure()) return e;
  if (auto e = gpu_kv_type(kv, &kt); e.failure()) return e;
  if (work->element_count() < 1) return ffi_common::invalid("the prefill's work result is empty");
  p.work_counter = work->typed_data();
  return launched(what, gpu::launch_prefill(dt, kt, p, stream));
}

ffi::Error PrefixPrefillGpu(gpuStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::Buffer<ffi::S32> cu_seqlens_q,
                            ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                            ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                            ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::Buffer<ffi::U32>> work, float scale, float soft_cap,
                            int32_t layout, int32_t kernel) {
  PrefillParams p;
  ffi_common::KvType kv;
  if (auto e = ffi_common::make_prefix_prefill_params(q, k, v, cu_seqlens_q, block_tables, seq_lens,
                                                      k_scale, v_scale, *out, scale, soft_cap,
                                                      layout, kernel, &p, &kv);
      e.failure())
    return e;
  return launch_prefill_call(stream, "prefix prefill", q.element_type(), kv, work, p);
}

ffi::Error ExtendAttentionGpu(gpuStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                              ffi::AnyBuffer v, ffi::Buffer<ffi::S32> qo_indptr,
                              ffi::Buffer<ffi::S32> kv_indptr, ffi::Buffer<ffi::S32> kv_indices,
                              ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::Buffer<ffi::U32>> work, float scale, float soft_cap,
                              int32_t kernel) {
  PrefillParams p;
  ffi_common::KvType kv;
  if (auto e = ffi_common::make_extend_params(q, k, v, qo_indptr, kv_indptr, kv_indices, k_scale,
                                              v_scale, *out, scale, soft_cap, kernel, &p, &kv);
      e.failure())
    return e;
  return launch_prefill_call(stream, "extend attention", q.element_type(), kv, work, p);
}

ffi::Error CascadeAttentionGpu(gpuStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                               ffi::AnyBuffer v, ffi::Buffer<ffi::S32> prefix_tables,
                               ffi::Buffer<ffi::S32> prefix_lens, ffi::Buffer<ffi::S32> prefix_of,
                               ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                               ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                               ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::Buffer<ffi::F32>> workspace, float scale,
                               float soft_cap, int32_t layout, int32_t prefix_target,
                               int32_t prefix_splits, int32_t partition_size) {
  CascadeParams p;
  ffi_common::KvType kv;
  if (auto e = ffi_common::make_cascade_params(q, k, v, prefix_tables, prefix_lens, prefix_of,
                                               block_tables, seq_lens, k_scale, v_scale, *out,
                                               *workspace, scale, soft_cap, layout, prefix_target,
                                               prefix_splits, partition_size, &p, &kv);
      e.failure())
    return e;
  // The GPU cascade kernels read 16-bit (or f32) K/V through ldmatrix / mma.sync and the SIMT
  // kernel's 16-byte vectors: an FP8 cache is refused here, as jaxattn/native.py's supports()
  // refuses it before any call.
  if (kv != ffi_common::KvType::kSame)
    return ffi_common::invalid("the GPU cascade kernels read a KV cache in q's dtype, not FP8");
  gpu::DType dt;
  if (auto e = gpu_dtype(q.element_type(), &dt); e.failure()) return e;
  return launched("cascade decode", gpu::launch_cascade(dt, p, stream));
}

ffi::Error LinearGpu(gpuStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                     ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> workspace,
                     int32_t rows_per_split) {
  LinearParams p;
  if (auto e = ffi_common::make_linear_params(x, w, *out, *workspace, rows_per_split, &p);
      e.failure())
    return e;
  gpu::DType dt;
  if (auto e = gpu_dtype(x.element_type(), &dt); e.failure()) return e;
  return launched("linear", gpu::launch_linear(dt, p.out_f32, p, stream));
}

// The cache writers' results start as copies of the caches where XLA did not alias them.
ffi::Error copy_unaliased_caches(gpuStream_t stream, const ffi::AnyBuffer& k_cache,
                                 const ffi::AnyBuffer& v_cache, const WriteKvParams& p) {
  const void* src[2] = {k_cache.untyped_data(), v_cache.untyped_data()};
  void* dst[2] = {p.k_cache, p.v_cache};
  const size_t bytes[2] = {k_cache.size_bytes(), v_cache.size_bytes()};
  for (int i = 0; i < 2; ++i) {
    if (dst[i] != src[i] && bytes[i] != 0 &&
        gpuMemcpyAsync(dst[i], src[i], bytes[i], gpuMemcpyDeviceToDevice, stream) != gpuSuccess)
      return launched("KV cache copy", gpu::check_launch());
  }
  return ffi::Error::Success();
}

ffi::Error WriteKvGpu(gpuStream_t stream, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                      ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slots,
                      ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                      ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                      int32_t layout) {
  WriteKvParams p;
  ffi_common::DType in;
  CacheDType cache;
  if (auto e = ffi_common::make_write_kv_params(k_cache, v_cache, k, v, slots, k_scale, v_scale,
                                                *k_out, *v_out, layout, &p, &in, &cache);
      e.failure())
    return e;
  gpu::DType dt;
  if (auto e = gpu_dtype(in, &dt); e.failure()) return e;
  if (auto e = copy_unaliased_caches(stream, k_cache, v_cache, p); e.failure()) return e;
  return launched("write_kv", gpu::launch_write_kv(dt, cache, p, stream));
}

ffi::Error AddRmsNormGpu(gpuStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer d, ffi::AnyBuffer w,
                         ffi::Result<ffi::AnyBuffer> sum, ffi::Result<ffi::AnyBuffer> normed,
                         float eps) {
  AddNormParams p;
  ffi_common::DType in;
  if (auto e = ffi_common::make_add_norm_params(x, d, w, *sum, *normed, eps, &p, &in); e.failure())
    return e;
  gpu::DType dt;
  if (auto e = gpu_dtype(in, &dt); e.failure()) return e;
  return launched("add_rms_norm", gpu::launch_add_rms_norm(dt, p, stream));
}

ffi::Error RopeWriteKvGpu(gpuStream_t stream, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                          ffi::AnyBuffer qkv, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                          ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::F32> k_scale,
                          ffi::Buffer<ffi::F32> v_scale, ffi::Result<ffi::AnyBuffer> k_out,
                          ffi::Result<ffi::AnyBuffer> v_out, ffi::Result<ffi::AnyBuffer> q_out,
                          int32_t layout, int32_t num_q_heads) {
  RopeWriteKvParams p;
  ffi_common::DType in;
  CacheDType cache;
  if (auto e = ffi_common::make_rope_write_kv_params(k_cache, v_cache, qkv, cos, sin, slots,
                                                     k_scale, v_scale, *k_out, *v_out, *q_out,
                                                     layout, num_q_heads, &p, &in, &cache);
      e.failure())
    return e;
  gpu::DType dt;
  if (auto e = gpu_dtype(in, &dt); e.failure()) return e;
  if (auto e = copy_unaliased_caches(stream, k_cache, v_cache, p.w); e.failure()) return e;
  return launched("rope_write_kv", gpu::launch_rope_write_kv(dt, cache, p, stream));
}

}  // namespace
}  // namespace jaxattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnAddRmsNormGpu, jaxattn::AddRmsNormGpu,
                              jaxattn::ffi_common::bind_add_rms_norm(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<gpuStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnRopeWriteKvGpu, jaxattn::RopeWriteKvGpu,
                              jaxattn::ffi_common::bind_rope_write_kv(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<gpuStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnWriteKvGpu, jaxattn::WriteKvGpu,
                              jaxattn::ffi_common::bind_write_kv(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<gpuStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnLinearGpu, jaxattn::LinearGpu,
                              jaxattn::ffi_common::bind_linear(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<gpuStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnPagedAttentionGpu, jaxattn::PagedAttentionGpu,
                              jaxattn::ffi_common::bind_paged_attention(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<gpuStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnPrefixPrefillGpu, jaxattn::PrefixPrefillGpu,
                              jaxattn::ffi_common::bind_prefix_prefill(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<gpuStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnExtendAttentionGpu, jaxattn::ExtendAttentionGpu,
                              jaxattn::ffi_common::bind_extend_attention(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<gpuStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnCascadeAttentionGpu, jaxattn::CascadeAttentionGpu,
                              jaxattn::ffi_common::bind_cascade_attention(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<gpuStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

// The operand-list version of these handlers (ffi_common::kFfiAbi), checked by jaxattn/native.py.
extern "C" int jaxattn_ffi_abi() { return jaxattn::ffi_common::kFfiAbi; }

// Host query for the split-KV heuristic of jaxattn/native.py (called through ctypes, outside
// any computation): the resident blocks per multiprocessor of the decode kernel the launcher
// picks for dtype (q's: 0 float32, 1 bfloat16, 2 float16), kv (the cache's: 0 q's own, 1
// float8_e4m3fn, 2 float8_e5m2), head_dim and group on the current device, and that device's
// multiprocessor count. Returns 0 on success.
extern "C" int jaxattn_decode_occupancy(int dtype, int kv, int head_dim, int group,
                                        int* blocks_per_sm, int* num_sms) {
  using jaxattn::gpu::DType;
  using jaxattn::gpu::KvType;
  if (dtype < 0 || dtype > 2 || kv < 0 || kv > 2 || blocks_per_sm == nullptr || num_sms == nullptr)
    return 1;
  const DType dt = dtype == 0 ? DType::kF32 : dtype == 1 ? DType::kBF16 : DType::kF16;
  const KvType kt = kv == 0 ? KvType::kSame : kv == 1 ? KvType::kE4M3 : KvType::kE5M2;
  int dev = 0;
  if (gpuGetDevice(&dev) != gpuSuccess ||
      gpuDeviceGetAttribute(num_sms, gpuDevAttrMultiProcessorCount, dev) != gpuSuccess) {
    (void)gpuGetLastError();
    return 2;
  }
  return jaxattn::gpu::decode_occupancy(dt, kt, head_dim, group, blocks_per_sm) == nullptr ? 0 : 3;
}

// Host query for jaxattn/native.py's split rule: the blocks a KV head of one sequence takes in
// the grid of the decode kernel the launcher picks for (dtype, kv, head_dim, group) on the
// current device (several for groups past 8 on the tensor-core kernels). Returns 0 on success.
extern "C" int jaxattn_decode_head_blocks(int dtype, int kv, int head_dim, int group, int* blocks) {
  using jaxattn::gpu::DType;
  using jaxattn::gpu::KvType;
  if (dtype < 0 || dtype > 2 || kv < 0 || kv > 2 || blocks == nullptr) return 1;
  const DType dt = dtype == 0 ? DType::kF32 : dtype == 1 ? DType::kBF16 : DType::kF16;
  const KvType kt = kv == 0 ? KvType::kSame : kv == 1 ? KvType::kE4M3 : KvType::kE5M2;
  return jaxattn::gpu::decode_head_blocks(dt, kt, head_dim, group, blocks) == nullptr ? 0 : 3;
}

// Host query for jaxattn/native.py's cascade grid: the query rows of a prefix tile and the
// resident blocks per multiprocessor of the cascade kernel the launcher runs for dtype (0
// float32, 1 bfloat16, 2 float16) and head_dim on the current device, and that device's
// multiprocessor count. group is checked against what the kernels serve. Returns 0 on success.
extern "C" int jaxattn_cascade_tile(int dtype, int head_dim, int group, int* rows,
                                    int* blocks_per_sm, int* num_sms) {
  using jaxattn::gpu::DType;
  if (dtype < 0 || dtype > 2 || group < 1 || group > 8 || rows == nullptr ||
      blocks_per_sm == nullptr || num_sms == nullptr)
    return 1;
  const DType dt = dtype == 0 ? DType::kF32 : dtype == 1 ? DType::kBF16 : DType::kF16;
  int dev = 0;
  if (gpuGetDevice(&dev) != gpuSuccess ||
      gpuDeviceGetAttribute(num_sms, gpuDevAttrMultiProcessorCount, dev) != gpuSuccess) {
    (void)gpuGetLastError();
    return 2;
  }
  return jaxattn::gpu::cascade_tile(dt, head_dim, rows, blocks_per_sm) == nullptr ? 0 : 3;
}
