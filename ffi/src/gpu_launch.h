// Entry points of the GPU kernels for the FFI handlers: plain argument blocks in, nullptr or
// an error message out. No XLA types, so the kernel translation units need no XLA headers.
#pragma once

#include "jaxattn/gpu_vendor.h"
#include "jaxattn/params.h"

namespace jaxattn {
namespace gpu {

enum class DType { kF32, kBF16, kF16 };
// The cache's element type: q's own, or an FP8 format (under a bf16 / f16 q).
enum class KvType { kSame, kE4M3, kE5M2 };

const char* launch_paged_decode(DType dtype, KvType kv, const DecodeParams& p, gpuStream_t stream);
const char* launch_prefill(DType dtype, KvType kv, const PrefillParams& p, gpuStream_t stream);
// out = x w for a 16-bit x and w (jaxattn/linear.cuh); out in their dtype, or f32.
const char* launch_linear(DType dtype, bool out_f32, const LinearParams& p, gpuStream_t stream);
// sum = x + d, normed = RMSNorm(sum) * w, row by row (jaxattn/add_norm.h, ffi/src/linear.cu).
const char* launch_add_rms_norm(DType dtype, const AddNormParams& p, gpuStream_t stream);

// Defined in jaxattn/paged_decode.cuh (where C defaults to T); instantiated once per (q, cache)
// dtype pair in its own translation unit (paged_decode_<dtype>[_<fp8>].cu) so that the many
// group/head_dim kernels build in parallel.
template <typename T, typename C>
const char* launch_paged_decode_typed(const DecodeParams& p, gpuStream_t stream);
template <typename T, typename C>
const char* decode_occupancy_typed(int head_dim, int group, int* blocks);
template <typename T, typename C>
const char* decode_head_blocks_typed(int head_dim, int group, int* blocks);

// write_kv's rows in dtype `in` into a cache of `cache`'s type (ffi/src/kv_write.cu).
const char* launch_write_kv(DType in, CacheDType cache, const WriteKvParams& p, gpuStream_t stream);
// rope_write_kv: the same store from a fused projection's rows, q and k rotated (kv_write.cu).
const char* launch_rope_write_kv(DType in, CacheDType cache, const RopeWriteKvParams& p,
                                 gpuStream_t stream);

// Resident blocks per multiprocessor of the decode kernel for (dtype, kv, head_dim, group).
const char* decode_occupancy(DType dtype, KvType kv, int head_dim, int group, int* blocks);
// Blocks a KV head takes in that kernel's grid (groups past 8 on the tensor-core kernels: several).
const char* decode_head_blocks(DType dtype, KvType kv, int head_dim, int group, int* blocks);

}  // namespace gpu
}  // namespace jaxattn
