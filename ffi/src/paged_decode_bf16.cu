#include "gpu_launch.h"
#include "jaxattn/paged_decode.cuh"

template const char* jaxattn::gpu::launch_paged_decode_typed<jaxattn::bf16_t, jaxattn::bf16_t>(
    const jaxattn::DecodeParams& p, gpuStream_t stream);
template const char* jaxattn::gpu::decode_occupancy_typed<jaxattn::bf16_t, jaxattn::bf16_t>(
    int head_dim, int group, int* blocks);
template const char* jaxattn::gpu::decode_head_blocks_typed<jaxattn::bf16_t, jaxattn::bf16_t>(
    int head_dim, int group, int* blocks);
