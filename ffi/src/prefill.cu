#include "gpu_launch.h"
#include "jaxattn/prefill.cuh"

namespace jaxattn {
namespace gpu {

const char* launch_prefill(DType dtype, KvType kv, const PrefillParams& p, gpuStream_t stream) {
  if (kv != KvType::kSame) return "jaxattn: FP8 caches are not built into the GPU prefill yet";
  switch (dtype) {
    case DType::kF32:
      return launch_prefill_typed<float>(p, stream);
    case DType::kBF16:
      return launch_prefill_typed<bf16_t>(p, stream);
    case DType::kF16:
      return launch_prefill_typed<f16_t>(p, stream);
  }
  return "jaxattn: unsupported dtype";
}

}  // namespace gpu
}  // namespace jaxattn
