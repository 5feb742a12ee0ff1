#include "gpu_launch.h"

namespace jaxattn {
namespace gpu {

namespace {

// f(T{}, C{}) for q's element type T and the cache's C; FP8 caches are built under 16-bit q.
template <typename F>
const char* dispatch(DType dtype, KvType kv, F&& f) {
  switch (dtype) {
    case DType::kF32:
      if (kv == KvType::kSame) return f(float{}, float{});
      return "jaxattn: the GPU decode reads FP8 caches under a bfloat16 or float16 q";
    case DType::kBF16:
      if (kv == KvType::kE4M3) return f(bf16_t{}, e4m3_t{});
      if (kv == KvType::kE5M2) return f(bf16_t{}, e5m2_t{});
      return f(bf16_t{}, bf16_t{});
    case DType::kF16:
      if (kv == KvType::kE4M3) return f(f16_t{}, e4m3_t{});
      if (kv == KvType::kE5M2) return f(f16_t{}, e5m2_t{});
      return f(f16_t{}, f16_t{});
  }
  return "jaxattn: unsupported dtype";
}

}  // namespace

const char* launch_paged_decode(DType dtype, KvType kv, const DecodeParams& p, gpuStream_t stream) {
  return dispatch(dtype, kv, [&](auto t, auto c) {
    return launch_paged_decode_typed<decltype(t), decltype(c)>(p, stream);
  });
}

const char* decode_occupancy(DType dtype, KvType kv, int head_dim, int group, int* blocks) {
  return dispatch(dtype, kv, [&](auto t, auto c) {
    return decode_occupancy_typed<decltype(t), decltype(c)>(head_dim, group, blocks);
  });
}

const char* decode_head_blocks(DType dtype, KvType kv, int head_dim, int group, int* blocks) {
  return dispatch(dtype, kv, [&](auto t, auto c) {
    return decode_head_blocks_typed<decltype(t), decltype(c)>(head_dim, group, blocks);
  });
}

}  // namespace gpu
}  // namespace jaxattn
