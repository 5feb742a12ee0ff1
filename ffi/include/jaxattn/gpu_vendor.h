// The few names that differ between CUDA and HIP, so that one kernel source builds with nvcc
// and with hipcc (the vendor-header pattern jaxlib uses for its own GPU code).
#pragma once

#include "jaxattn/dtypes.h"

#if defined(__HIPCC__)
#include <hip/hip_runtime.h>
#define JAXATTN_HIP 1
using gpuStream_t = hipStream_t;
using gpuError_t = hipError_t;
#define gpuSuccess hipSuccess
#define gpuGetLastError hipGetLastError
#define gpuGetErrorString hipGetErrorString
#define gpuGetDevice hipGetDevice
#define gpuDeviceGetAttribute hipDeviceGetAttribute
#define gpuDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define gpuDevAttrComputeCapabilityMajor hipDeviceAttributeComputeCapabilityMajor
#define gpuMemsetAsync hipMemsetAsync
#define gpuMemcpyAsync hipMemcpyAsync
#define gpuMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define gpuFuncSetAttribute(f, a, v) hipFuncSetAttribute(reinterpret_cast<const void*>(f), a, v)
#define gpuFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor(n, f, threads, smem) \
  hipOccupancyMaxActiveBlocksPerMultiprocessor(n, reinterpret_cast<const void*>(f), threads, smem)
#else
#include <cuda_runtime.h>
#define JAXATTN_CUDA 1
using gpuStream_t = cudaStream_t;
using gpuError_t = cudaError_t;
#define gpuSuccess cudaSuccess
#define gpuGetLastError cudaGetLastError
#define gpuGetErrorString cudaGetErrorString
#define gpuGetDevice cudaGetDevice
#define gpuDeviceGetAttribute cudaDeviceGetAttribute
#define gpuDevAttrMultiProcessorCount cudaDevAttrMultiProcessorCount
#define gpuDevAttrComputeCapabilityMajor cudaDevAttrComputeCapabilityMajor
#define gpuMemsetAsync cudaMemsetAsync
#define gpuMemcpyAsync cudaMemcpyAsync
#define gpuMemcpyDeviceToDevice cudaMemcpyDeviceToDevice
#define gpuFuncSetAttribute(f, a, v) cudaFuncSetAttribute(f, a, v)
#define gpuFuncAttributeMaxDynamicSharedMemorySize cudaFuncAttributeMaxDynamicSharedMemorySize
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor cudaOccupancyMaxActiveBlocksPerMultiprocessor
#endif

// Wavefront width is part of the kernels' shape (lanes per token row, reduction trees), so it
// is a compile-time constant on both sides of the launch. The AMD targets are the wave64
// GCN/CDNA parts and Hygon DCUs; an RDNA build must pass -mwavefrontsize64.
#if defined(JAXATTN_HIP)
#define WARP_SIZE 64
#if defined(__AMDGCN_WAVEFRONT_SIZE) && __AMDGCN_WAVEFRONT_SIZE != 64
#error "jaxattn kernels assume 64-wide wavefronts on AMD; build with -mwavefrontsize64"
#endif
#else
#define WARP_SIZE 32
#endif

namespace jaxattn {
namespace gpu {

__device__ __forceinline__ float shfl_xor(float v, int lane_mask, int width = WARP_SIZE) {
#if defined(JAXATTN_HIP)
  return __shfl_xor(v, lane_mask, width);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask, width);
#endif
}

__device__ __forceinline__ float shfl(float v, int src_lane, int width = WARP_SIZE) {
#if defined(JAXATTN_HIP)
  return __shfl(v, src_lane, width);
#else
  return __shfl_sync(0xffffffffu, v, src_lane, width);
#endif
}

__device__ __forceinline__ int shfl_up(int v, int delta) {
#if defined(JAXATTN_HIP)
  return __shfl_up(v, static_cast<unsigned>(delta));
#else
  return __shfl_up_sync(0xffffffffu, v, static_cast<unsigned>(delta));
#endif
}

// 2^x on the special-function unit; the kernels fold log2(e) into their scale so that this is
// the only exponential they need.
__device__ __forceinline__ float fast_exp2(float x) {
#if defined(JAXATTN_HIP)
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

template <int WIDTH>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int m = WIDTH / 2; m >= 1; m /= 2) v += shfl_xor(v, m, WIDTH);
  return v;
}

template <int WIDTH>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int m = WIDTH / 2; m >= 1; m /= 2) v = fmaxf(v, shfl_xor(v, m, WIDTH));
  return v;
}

// Sixteen bytes of storage (the unit of every global load) widened to float.
template <typename T>
__device__ __forceinline__ void vec_to_float(const uint4& r, float* out);

template <>
__device__ __forceinline__ void vec_to_float<float>(const uint4& r, float* out) {
  out[0] = __uint_as_float(r.x);
  out[1] = __uint_as_float(r.y);
  out[2] = __uint_as_float(r.z);
  out[3] = __uint_as_float(r.w);
}

template <>
__device__ __forceinline__ void vec_to_float<bf16_t>(const uint4& r, float* out) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

template <>
__device__ __forceinline__ void vec_to_float<f16_t>(const uint4& r, float* out) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = f16_to_float(uint16_t(w[i] & 0xffffu));
    out[2 * i + 1] = f16_to_float(uint16_t(w[i] >> 16));
  }
}

// FP8 cache elements widened in registers. Every FP8 value is exact in float16 (e5m2 is the
// high byte of a float16; e4m3's 4-bit exponent and 3-bit mantissa fit float16's 5 and 10), so
// the conversions go through float16 bits: one byte permute per pair (e5m2), or a permute and a
// shift-and-mask (e4m3), instead of a decode per byte.

// Bytes of (a, b) picked by the nibbles of sel (0-3: a's bytes, 4-7: b's).
__device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
  return __byte_perm(a, b, sel);
}

// Bytes 0 and 1 (lo) and 2 and 3 (hi) of w as the high bytes of two float16 pairs.
__device__ __forceinline__ uint32_t fp8_hi_bytes_lo(uint32_t w) {
  return byte_perm(w, 0u, 0x1404u);
}
__device__ __forceinline__ uint32_t fp8_hi_bytes_hi(uint32_t w) {
  return byte_perm(w, 0u, 0x3424u);
}

// Two e4m3 codes placed as the high bytes of a float16 pair (t: b << 8 per half) -> the pair
// of float16 with the same sign, exponent and mantissa bits, whose values are the e4m3 values
// times 2^-8 exactly (subnormals too: e4m3's map onto float16's). NaN (S.1111.111) is not
// mapped: see fp8x4_has_nan.
__device__ __forceinline__ uint32_t e4m3x2_as_f16x2_scaled(uint32_t t) {
  return (t & 0x80008000u) | ((t >> 1) & 0x3f803f80u);
}

// Whether one of the four e4m3 codes of w is NaN (its low 7 bits all ones): adding 1 to the
// low 7 bits of each byte carries into bit 7 exactly there.
__device__ __forceinline__ bool e4m3x4_has_nan(uint32_t w) {
  return (((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u) != 0u;
}

// The widening factor of the SIMT kernels' FP8 loads: what fp8x4_to_float leaves out (the
// kernels fold it into their per-head scales, where it is exact: a power of two).
template <typename C>
struct Widen {
  static constexpr float kScale = 1.f;
};
#if defined(JAXATTN_CUDA)
template <>
struct Widen<e4m3_t> {
  static constexpr float kScale = 256.f;
};
#endif

// Four FP8 codes (a 32-bit word, lowest byte first) -> four floats, times 1 / Widen<C>::kScale.
// HIP widens e4m3 with the exact integer decode of dtypes.h (no float16 subnormal reaches a
// conversion whose denormal mode a target may flush).
template <typename C>
__device__ __forceinline__ void fp8x4_to_float(uint32_t w, float* out);

template <>
__device__ __forceinline__ void fp8x4_to_float<e5m2_t>(uint32_t w, float* out) {
  const uint32_t lo = fp8_hi_bytes_lo(w), hi = fp8_hi_bytes_hi(w);
  out[0] = f16_to_float(uint16_t(lo & 0xffffu));
  out[1] = f16_to_float(uint16_t(lo >> 16));
  out[2] = f16_to_float(uint16_t(hi & 0xffffu));
  out[3] = f16_to_float(uint16_t(hi >> 16));
}

template <>
__device__ __forceinline__ void fp8x4_to_float<e4m3_t>(uint32_t w, float* out) {
#if defined(JAXATTN_CUDA)
  const uint32_t lo = e4m3x2_as_f16x2_scaled(fp8_hi_bytes_lo(w));
  const uint32_t hi = e4m3x2_as_f16x2_scaled(fp8_hi_bytes_hi(w));
  out[0] = f16_to_float(uint16_t(lo & 0xffffu));
  out[1] = f16_to_float(uint16_t(lo >> 16));
  out[2] = f16_to_float(uint16_t(hi & 0xffffu));
  out[3] = f16_to_float(uint16_t(hi >> 16));
  if (__builtin_expect(e4m3x4_has_nan(w), 0)) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (((w >> (8 * i)) & 0x7fu) == 0x7fu) out[i] = __uint_as_float(0x7fc00000u);
  }
#else
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = e4m3_to_float(uint8_t(w >> (8 * i)));
#endif
}

// Eight bytes of an FP8 cache row (one lane's load) widened to float.
template <typename C>
__device__ __forceinline__ void vec_to_float(const uint2& r, float* out) {
  fp8x4_to_float<C>(r.x, out);
  fp8x4_to_float<C>(r.y, out + 4);
}

// Asynchronous 16-byte copies from global to shared memory, for multi-stage pipelines:
// async_copy16 starts one copy (valid == false writes 16 zero bytes and reads nothing),
// async_copy_commit closes the group of copies this thread started since the last commit, and
// async_copy_wait<N> blocks until at most N of this thread's groups are still in flight. The
// copies become visible to other threads only through a barrier after the wait.
// NVIDIA sm_80+: cp.async.cg (bypasses L1; zero fill through src-size 0). HIP and older
// NVIDIA targets: a plain synchronous load and shared store, commit and wait do nothing, so
// one pipeline source runs (unpipelined) everywhere. Both pointers must be 16-byte aligned.
// async_copy16_at (NVIDIA only) takes the 32-bit shared-memory address instead, for the
// tensor-core kernels that keep their shared addresses in 32 bits (mma_sm80.cuh); its body is
// empty below sm_80, where the launchers never pick those kernels.
//
// JAXATTN_CP_ASYNC_L2_HINT (experiment switch, compile time, default 0): 128 or 256 adds the L2
// prefetch-size qualifier (.L2::128B / .L2::256B) to every 16-byte copy, asking L2 to fetch that
// much of the surrounding memory on a miss (the TMA decode's tensor maps promote to 256 bytes).
// At 256 on an H100 (self-tests, three alternations; ffi/NOTES.md, round 66): the decode's
// gathers 1-2.5% faster on FP8 split grids and short one-pass grids and on 16-bit grids at GQA
// 32/8, 1-3% slower on FP8 one-pass grids over 4096-token tables (which the library reads by
// TMA); the prefill and the cascade level or slower by up to 1%. In the decode's rings alone,
// through the library (round 68): within the run's spread, so not kept as a switch of its own.
#ifndef JAXATTN_CP_ASYNC_L2_HINT
#define JAXATTN_CP_ASYNC_L2_HINT 0
#endif
static_assert(JAXATTN_CP_ASYNC_L2_HINT == 0 || JAXATTN_CP_ASYNC_L2_HINT == 128 ||
                  JAXATTN_CP_ASYNC_L2_HINT == 256,
              "JAXATTN_CP_ASYNC_L2_HINT is 0, 128 or 256 bytes");
#if defined(JAXATTN_CUDA)
__device__ __forceinline__ void async_copy16_at(uint32_t smem_dst, const void* gmem_src,
                                                bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (JAXATTN_CP_ASYNC_L2_HINT == 256) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(smem_dst),
                 "l"(gmem_src), "r"(valid ? 16 : 0)
                 : "memory");
  } else if constexpr (JAXATTN_CP_ASYNC_L2_HINT == 128) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_dst),
                 "l"(gmem_src), "r"(valid ? 16 : 0)
                 : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src),
                 "r"(valid ? 16 : 0)
                 : "memory");
  }
#endif
}
#endif

__device__ __forceinline__ void async_copy16(void* smem_dst, const void* gmem_src, bool valid) {
#if defined(JAXATTN_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  async_copy16_at(static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst)), gmem_src, valid);
#else
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (valid) v = *static_cast<const uint4*>(gmem_src);
  *static_cast<uint4*>(smem_dst) = v;
#endif
}

// 4 bytes from global to shared memory beside the 16-byte copies, in the same commit groups
// (cp.async.ca: the 4-byte form; zero fill through src-size 0). Synchronous where
// async_copy16 is.
__device__ __forceinline__ void async_copy4(void* smem_dst, const void* gmem_src, bool valid) {
#if defined(JAXATTN_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(valid ? 4 : 0)
               : "memory");
#else
  *static_cast<uint32_t*>(smem_dst) = valid ? *static_cast<const uint32_t*>(gmem_src) : 0u;
#endif
}

__device__ __forceinline__ void async_copy_commit() {
#if defined(JAXATTN_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void async_copy_wait() {
#if defined(JAXATTN_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

inline const char* check_launch() {
  const gpuError_t err = gpuGetLastError();
  return err == gpuSuccess ? nullptr : gpuGetErrorString(err);
}

}  // namespace gpu
}  // namespace jaxattn
