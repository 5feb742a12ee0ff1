#include "gpu_launch.h"

namespace jaxattn {
namespace gpu {

const char* launch_paged_decode(DType dtype, const DecodeParams& p, gpuStream_t stream) {
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

}  // namespace gpu
}  // namespace jaxattn
