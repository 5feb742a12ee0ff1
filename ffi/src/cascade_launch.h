// Entry points of the GPU cascade kernels (jaxattn/cascade.cuh) for the FFI handlers: plain
// argument blocks in, nullptr or an error message out.
#pragma once

#include "gpu_launch.h"
#include "jaxattn/cascade.h"

namespace jaxattn {
namespace gpu {

const char* launch_cascade(DType dtype, const CascadeParams& p, gpuStream_t stream);

// Query rows of a prefix tile and resident blocks per multiprocessor of the cascade kernel the
// launcher runs for (dtype, head_dim) on the current device.
const char* cascade_tile(DType dtype, int head_dim, int* rows, int* blocks);

}  // namespace gpu
}  // namespace jaxattn
