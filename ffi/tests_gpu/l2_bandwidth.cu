// L2 read ceiling of the device: a buffer that fits in L2 read over and over, the way the
// prefill kernels read K and V that several tiles share (16-byte loads, and 16-byte cp.async
// copies into shared memory as the Hopper prefill's producer issues them), and one far larger
// than L2 (the memory's read rate, for comparison). No Python or XLA needed:
//
//   nvcc -std=c++17 -O3 -arch=sm_90 ffi/tests_gpu/l2_bandwidth.cu -o /tmp/l2_bandwidth
//   /tmp/l2_bandwidth
//
// Each figure is the best of five launches right after a warm-up launch: a burst at the clock
// the device has then, not a sustained rate under a power cap. The prefill's K/V traffic
// (key tiles x 2 x 128 keys x head_dim x 2 bytes, per block) set against these says how close
// its copies run to what L2 can serve (benchmarks/RESULTS.md, round 63).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "cuda_ok.h"

// Every thread reads 16-byte elements in a grid-stride loop, `reps` times over the buffer.
__global__ void read_ldg(const uint4* __restrict__ p, size_t n, int reps, uint4* sink) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (int r = 0; r < reps; ++r)
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
      const uint4 v = __ldcg(p + i);
      acc.x ^= v.x, acc.y ^= v.y, acc.z ^= v.z, acc.w ^= v.w;
    }
  if (acc.x == 0x12345678u) sink[0] = acc;  // never true for the buffer's bytes (0x01)
}

// The same reads as 16-byte cp.async copies into shared memory, kInFlight a thread between
// waits (one block an SM, so that each block has the SM's shared memory).
constexpr int kInFlight = 32;
__global__ void read_cp_async(const uint4* __restrict__ p, size_t n, int reps, uint4* sink) {
  extern __shared__ uint4 stage[];
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (int r = 0; r < reps; ++r) {
    size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    while (i < n) {
      for (int k = 0; k < kInFlight && i < n; ++k, i += stride) {
        const unsigned dst =
            unsigned(__cvta_generic_to_shared(stage + (k * blockDim.x + threadIdx.x)));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(p + i));
      }
      asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
    }
  }
  if (stage[threadIdx.x].x == 0x12345678u) sink[0] = stage[threadIdx.x];
}

int main() {
  int dev = 0;
  CUDA_OK(cudaGetDevice(&dev));
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, dev));
  const int sms = prop.multiProcessorCount;
  std::printf("device: %s (%d SMs, %d MB L2)\n", prop.name, sms, prop.l2CacheSize >> 20);
  constexpr int kCopyThreads = 384;
  constexpr size_t kCopySmem = size_t(kInFlight) * kCopyThreads * sizeof(uint4);
  CUDA_OK(cudaFuncSetAttribute(read_cp_async, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(kCopySmem)));
  for (size_t mb : {8, 16, 32, 48, 2048}) {
    const size_t bytes = mb << 20, n = bytes / sizeof(uint4);
    uint4 *p = nullptr, *sink = nullptr;
    CUDA_OK(cudaMalloc(&p, bytes));
    CUDA_OK(cudaMalloc(&sink, sizeof(uint4)));
    CUDA_OK(cudaMemset(p, 1, bytes));
    const int reps = mb >= 1024 ? 2 : 40;
    cudaEvent_t a, b;
    CUDA_OK(cudaEventCreate(&a));
    CUDA_OK(cudaEventCreate(&b));
    for (int kind = 0; kind < 2; ++kind) {
      auto launch = [&]() {
        if (kind == 0) {
          read_ldg<<<sms * 8, 256>>>(p, n, reps, sink);
        } else {
          read_cp_async<<<sms, kCopyThreads, kCopySmem>>>(p, n, reps, sink);
        }
      };
      launch();
      CUDA_OK(cudaDeviceSynchronize());
      float best = 1e30f;
      for (int t = 0; t < 5; ++t) {
        CUDA_OK(cudaEventRecord(a));
        launch();
        CUDA_OK(cudaEventRecord(b));
        CUDA_OK(cudaEventSynchronize(b));
        float ms = 0.f;
        CUDA_OK(cudaEventElapsedTime(&ms, a, b));
        best = ms < best ? ms : best;
      }
      CUDA_OK(cudaGetLastError());
      std::printf("%6zu MB  %-9s %7.0f GB/s\n", mb, kind ? "cp.async" : "16-byte",
                  double(bytes) * reps / best / 1e6);
    }
    CUDA_OK(cudaEventDestroy(a));
    CUDA_OK(cudaEventDestroy(b));
    CUDA_OK(cudaFree(p));
    CUDA_OK(cudaFree(sink));
  }
  return 0;
}
