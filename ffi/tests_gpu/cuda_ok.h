// CUDA_OK(call): the self-tests' check of a CUDA runtime call; prints where and why and exits 2.
// upload(h): a device copy of a host vector.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#define CUDA_OK(x)                                                                               \
  do {                                                                                           \
    cudaError_t err_ = (x);                                                                      \
    if (err_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_)); \
      std::exit(2);                                                                              \
    }                                                                                            \
  } while (0)

// A device copy of h (nullptr for an empty h), for the caller to cudaFree.
template <typename V>
V* upload(const std::vector<V>& h) {
  if (h.empty()) return nullptr;
  V* d = nullptr;
  CUDA_OK(cudaMalloc(&d, h.size() * sizeof(V)));
  CUDA_OK(cudaMemcpy(d, h.data(), h.size() * sizeof(V), cudaMemcpyHostToDevice));
  return d;
}
