// The cascade kernel with the Hopper prefix level (jaxattn/cascade_sm90.cuh), compiled for
// sm_90a alone (-gencode arch=compute_90a,code=sm_90a): launch_cascade_blocks in cascade.cu
// calls it on compute capability 9.0 devices when the library defines JAXATTN_HAVE_SM90A.
// Under hipcc this translation unit is empty.
#include "jaxattn/cascade_sm90.cuh"

#if defined(JAXATTN_CUDA)
namespace jaxattn {
namespace gpu {

#define JAXATTN_CASCADE_SM90(T, D)                                                                \
  template const char* launch_cascade_sm90<T, D>(const CascadeParams&, gpuStream_t, int64_t, int, \
                                                 int);                                            \
  template const char* cascade_sm90_occupancy<T, D>(int*);
JAXATTN_CASCADE_SM90(bf16_t, 64)
JAXATTN_CASCADE_SM90(bf16_t, 128)
JAXATTN_CASCADE_SM90(f16_t, 64)
JAXATTN_CASCADE_SM90(f16_t, 128)
#undef JAXATTN_CASCADE_SM90

}  // namespace gpu
}  // namespace jaxattn
#endif
