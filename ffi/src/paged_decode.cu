#include "gpu_launch.h"

namespace jaxattn {
namespace gpu {

const char* launch_paged_decode(DType dtype, KvType kv, const DecodeParams& p, gpuStream_t stream) {
  if (kv != KvType::kSame) return "jaxattn: FP8 caches are not built into the GPU decode yet";
  switch (dtype) {
    case DType::kF32:
      return launch_paged_decode_typed<float>(p, stream);
    case DType::kBF16:
      return launch_paged_decode_typed<bf16_t>(p, stream);
    case DType::kF16:
      return launch_paged_decode_typed<f16_t>(p, stream);
  }
  return "jaxattn: unsupported dtype";
}

const char* decode_occupancy(DType dtype, KvType kv, int head_dim, int group, int* blocks) {
  if (kv != KvType::kSame) return "jaxattn: FP8 caches are not built into the GPU decode yet";
  switch (dtype) {
    case DType::kF32:
      return decode_occupancy_typed<float>(head_dim, group, blocks);
    case DType::kBF16:
      return decode_occupancy_typed<bf16_t>(head_dim, group, blocks);
    case DType::kF16:
      return decode_occupancy_typed<f16_t>(head_dim, group, blocks);
  }
  return "jaxattn: unsupported dtype";
}

}  // namespace gpu
}  // namespace jaxattn
