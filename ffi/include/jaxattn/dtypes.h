// Element types as raw 16-bit storage with conversions written on the bits, so the same code
// builds for the host, nvcc and hipcc (HIP 5.2 ships no usable bf16 header) without any
// vendor half-precision header.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__HIPCC__)
#include <hip/hip_runtime.h>
#endif

#if defined(__CUDACC__) || defined(__HIPCC__)
#define JAXATTN_HD __host__ __device__ __forceinline__
#define JAXATTN_DEVICE_COMPILER 1
#else
#define JAXATTN_HD inline
#endif

// True only while compiling device code (not the host pass of a GPU translation unit).
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
#define JAXATTN_DEVICE_PASS 1
#endif

namespace jaxattn {

struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

JAXATTN_HD uint32_t float_bits(float f) {
#if defined(JAXATTN_DEVICE_PASS)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

JAXATTN_HD float bits_float(uint32_t u) {
#if defined(JAXATTN_DEVICE_PASS)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

JAXATTN_HD float bf16_to_float(uint16_t b) { return bits_float(uint32_t(b) << 16); }

// Round to nearest even; NaN stays a (quiet) NaN instead of rounding up into infinity.
JAXATTN_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

JAXATTN_HD float f16_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#elif defined(__HIP_DEVICE_COMPILE__)
  return static_cast<float>(__builtin_bit_cast(_Float16, h));
#else
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    // Subnormal half: renormalise into the wider float exponent range.
    exp = 127 - 15 + 1;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    man &= 0x3ffu;
    return bits_float(sign | (exp << 23) | (man << 13));
  }
  return bits_float(sign | ((exp + 127 - 15) << 23) | (man << 13));
#endif
}

JAXATTN_HD uint16_t float_to_f16(float f) {
#if defined(__CUDA_ARCH__)
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#elif defined(__HIP_DEVICE_COMPILE__)
  return __builtin_bit_cast(uint16_t, static_cast<_Float16>(f));
#else
  const uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: infinity
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero): align the implicit bit, then round half to even.
    if (abs < 0x33000000u) return sign;
    const uint32_t e = abs >> 23;
    const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // in [14, 24]
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return uint16_t(sign | r);
  }
  uint32_t r = abs + 0xfffu + ((abs >> 13) & 1u);
  r -= uint32_t(112) << 23;
  return uint16_t(sign | (r >> 13));
#endif
}

template <typename T>
struct Elem;

template <>
struct Elem<float> {
  JAXATTN_HD static float load(float x) { return x; }
  JAXATTN_HD static float store(float x) { return x; }
};
template <>
struct Elem<bf16_t> {
  JAXATTN_HD static float load(bf16_t x) { return bf16_to_float(x.bits); }
  JAXATTN_HD static bf16_t store(float x) { return bf16_t{float_to_bf16(x)}; }
};
template <>
struct Elem<f16_t> {
  JAXATTN_HD static float load(f16_t x) { return f16_to_float(x.bits); }
  JAXATTN_HD static f16_t store(float x) { return f16_t{float_to_f16(x)}; }
};

template <typename T>
JAXATTN_HD float to_float(T x) {
  return Elem<T>::load(x);
}
template <typename T>
JAXATTN_HD T from_float(float x) {
  return Elem<T>::store(x);
}

}  // namespace jaxattn
