// CUDA_OK(call): the self-tests' check of a CUDA runtime call; prints where and why and exits 2.
#pragma once
#include <cstdio>
#include <cstdlib>

#define CUDA_OK(x)                                                                               \
  do {                                                                                           \
    cudaError_t err_ = (x);                                                                      \
    if (err_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_)); \
      std::exit(2);                                                                              \
    }                                                                                            \
  } while (0)
