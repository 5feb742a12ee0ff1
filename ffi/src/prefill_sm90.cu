// The Hopper prefill kernel (jaxattn/prefill_sm90.cuh), compiled for sm_90a alone
// (-gencode arch=compute_90a,code=sm_90a): launch_prefill_typed in prefill.cu calls it on
// compute capability 9.0 devices when the library defines JAXATTN_HAVE_SM90A. Under hipcc this
// translation unit is empty.
#include "jaxattn/prefill_sm90.cuh"

#if defined(JAXATTN_CUDA)
namespace jaxattn {
namespace gpu {

template const char* launch_prefill_sm90<bf16_t, bf16_t>(const PrefillParams&, gpuStream_t);
template const char* launch_prefill_sm90<f16_t, f16_t>(const PrefillParams&, gpuStream_t);
template const char* launch_prefill_sm90<bf16_t, e4m3_t>(const PrefillParams&, gpuStream_t);
template const char* launch_prefill_sm90<bf16_t, e5m2_t>(const PrefillParams&, gpuStream_t);
template const char* launch_prefill_sm90<f16_t, e4m3_t>(const PrefillParams&, gpuStream_t);
template const char* launch_prefill_sm90<f16_t, e5m2_t>(const PrefillParams&, gpuStream_t);

}  // namespace gpu
}  // namespace jaxattn
#endif

#if defined(JAXATTN_CUDA) && JAXATTN_SM90_WAIT_STATS
namespace jaxattn {
namespace gpu {
// The wait counters of this translation unit's kernels (JAXATTN_SM90_WAIT_STATS builds).
void sm90_read_wait_stats(unsigned long long* host, bool reset) {
  cudaMemcpyFromSymbol(host, sm90_wait_stats, sizeof(unsigned long long) * kWaitStats);
  if (reset) {
    const unsigned long long zero[kWaitStats] = {};
    cudaMemcpyToSymbol(sm90_wait_stats, zero, sizeof(zero));
  }
}
}  // namespace gpu
}  // namespace jaxattn
#endif
