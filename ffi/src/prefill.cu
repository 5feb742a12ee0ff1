#include "gpu_launch.h"
#include "jaxattn/prefill.cuh"

namespace jaxattn {
namespace gpu {

// The FP8-cache kernels build in their own translation unit (prefill_fp8.cu), in parallel.
extern template const char* launch_prefill_typed<bf16_t, e4m3_t>(const PrefillParams&, gpuStream_t);
extern template const char* launch_prefill_typed<bf16_t, e5m2_t>(const PrefillParams&, gpuStream_t);
extern template const char* launch_prefill_typed<f16_t, e4m3_t>(const PrefillParams&, gpuStream_t);
extern template const char* launch_prefill_typed<f16_t, e5m2_t>(const PrefillParams&, gpuStream_t);

const char* launch_prefill(DType dtype, KvType kv, const PrefillParams& p, gpuStream_t stream) {
  switch (dtype) {
    case DType::kF32:
      if (kv == KvType::kSame) return launch_prefill_typed<float>(p, stream);
      return "jaxattn: the GPU prefill reads FP8 caches under a bfloat16 or float16 q";
    case DType::kBF16:
      if (kv == KvType::kE4M3) return launch_prefill_typed<bf16_t, e4m3_t>(p, stream);
      if (kv == KvType::kE5M2) return launch_prefill_typed<bf16_t, e5m2_t>(p, stream);
      return launch_prefill_typed<bf16_t>(p, stream);
    case DType::kF16:
      if (kv == KvType::kE4M3) return launch_prefill_typed<f16_t, e4m3_t>(p, stream);
      if (kv == KvType::kE5M2) return launch_prefill_typed<f16_t, e5m2_t>(p, stream);
      return launch_prefill_typed<f16_t>(p, stream);
  }
  return "jaxattn: unsupported dtype";
}

}  // namespace gpu
}  // namespace jaxattn
