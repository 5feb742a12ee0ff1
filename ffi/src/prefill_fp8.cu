// The prefill kernels over FP8 caches (e4m3, e5m2) under a bf16 / f16 q (jaxattn/prefill.cuh);
// launch_prefill in prefill.cu dispatches to them.
#include "gpu_launch.h"
#include "jaxattn/prefill.cuh"

namespace jaxattn {
namespace gpu {

template const char* launch_prefill_typed<bf16_t, e4m3_t>(const PrefillParams&, gpuStream_t);
template const char* launch_prefill_typed<bf16_t, e5m2_t>(const PrefillParams&, gpuStream_t);
template const char* launch_prefill_typed<f16_t, e4m3_t>(const PrefillParams&, gpuStream_t);
template const char* launch_prefill_typed<f16_t, e5m2_t>(const PrefillParams&, gpuStream_t);

}  // namespace gpu
}  // namespace jaxattn
