// The Hopper prefill kernel's persistent launch (jaxattn/prefill_sm90.cuh,
// launch_prefill_sm90_persistent), compiled for sm_90a alone like prefill_sm90.cu, in a
// translation unit of its own so that the two compile in parallel. Under hipcc it is empty.
#define JAXATTN_SM90_PERSISTENT_TU
#include "jaxattn/prefill_sm90.cuh"

#if defined(JAXATTN_CUDA)
namespace jaxattn {
namespace gpu {

#define JAXATTN_SM90_PERSISTENT(T, C)                                                         \
  template const char* launch_prefill_sm90_persistent<T, C, 64, false>(const PrefillParams&,  \
                                                                       gpuStream_t);          \
  template const char* launch_prefill_sm90_persistent<T, C, 64, true>(const PrefillParams&,   \
                                                                      gpuStream_t);           \
  template const char* launch_prefill_sm90_persistent<T, C, 128, false>(const PrefillParams&, \
                                                                        gpuStream_t);         \
  template const char* launch_prefill_sm90_persistent<T, C, 128, true>(const PrefillParams&,  \
                                                                       gpuStream_t);

JAXATTN_SM90_PERSISTENT(bf16_t, bf16_t)
JAXATTN_SM90_PERSISTENT(f16_t, f16_t)
JAXATTN_SM90_PERSISTENT(bf16_t, e4m3_t)
JAXATTN_SM90_PERSISTENT(bf16_t, e5m2_t)
JAXATTN_SM90_PERSISTENT(f16_t, e4m3_t)
JAXATTN_SM90_PERSISTENT(f16_t, e5m2_t)
#undef JAXATTN_SM90_PERSISTENT

}  // namespace gpu
}  // namespace jaxattn
#endif
