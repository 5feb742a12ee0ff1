#include "cascade_launch.h"
#include "jaxattn/cascade.cuh"

namespace jaxattn {
namespace gpu {

const char* launch_cascade(DType dtype, const CascadeParams& p, gpuStream_t stream) {
  switch (dtype) {
    case DType::kF32:
      return launch_cascade_typed<float>(p, stream);
    case DType::kBF16:
      return launch_cascade_typed<bf16_t>(p, stream);
    case DType::kF16:
      return launch_cascade_typed<f16_t>(p, stream);
  }
  return "jaxattn: unsupported dtype";
}

const char* cascade_tile(DType dtype, int head_dim, int* rows, int* blocks) {
  switch (dtype) {
    case DType::kF32:
      return cascade_tile_typed<float>(head_dim, rows, blocks);
    case DType::kBF16:
      return cascade_tile_typed<bf16_t>(head_dim, rows, blocks);
    case DType::kF16:
      return cascade_tile_typed<f16_t>(head_dim, rows, blocks);
  }
  return "jaxattn: unsupported dtype";
}

}  // namespace gpu
}  // namespace jaxattn
