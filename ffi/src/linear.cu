// The GPU linear kernel (jaxattn/linear.cuh) for each (input, output) dtype pair.
#include "gpu_launch.h"
#include "jaxattn/linear.cuh"

namespace jaxattn {
namespace gpu {

const char* launch_linear(DType dtype, bool out_f32, const LinearParams& p, gpuStream_t stream) {
  switch (dtype) {
    case DType::kBF16:
      return out_f32 ? launch_linear_typed<bf16_t, float>(p, stream)
                     : launch_linear_typed<bf16_t, bf16_t>(p, stream);
    case DType::kF16:
      return out_f32 ? launch_linear_typed<f16_t, float>(p, stream)
                     : launch_linear_typed<f16_t, f16_t>(p, stream);
    default:
      return "jaxattn: the GPU linear kernel takes bfloat16 or float16 operands";
  }
}

}  // namespace gpu
}  // namespace jaxattn
