// Element types as raw 16-bit (and 8-bit FP8) storage with conversions written on the bits, so
// the same code builds for the host, nvcc and hipcc (HIP 5.2 ships no usable bf16 or fp8
// header) without any vendor half-precision header.
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
// FP8 KV-cache elements, the OCP formats as XLA and ml_dtypes store them. float8_e4m3fn: bias
// 7, 3 mantissa bits, no infinity, NaN = S.1111.111, largest finite 448. float8_e5m2: bias 15,
// 2 mantissa bits, IEEE infinities and NaNs, largest finite 57344 -- the high byte of a float16.
struct e4m3_t {
  uint8_t bits;
};
struct e5m2_t {
  uint8_t bits;
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

// Exact: every FP8 value is a float. Integer operations only (no denormal float anywhere, so
// no flush-to-zero mode can change a result): normal e4m3 values rebias their exponent
// (7 -> 127); subnormals m * 2^-9 are 2^-6 (1 + m/8) - 2^-6, exact by Sterbenz.
JAXATTN_HD float e4m3_to_float(uint8_t b) {
  const uint32_t mag = b & 0x7fu;
  const uint32_t sign = uint32_t(b & 0x80u) << 24;
  if (mag == 0x7fu) return bits_float(sign | 0x7fc00000u);
  float f;
  if (mag >= 8u) {
    f = bits_float((mag << 20) + (120u << 23));
  } else {
    f = bits_float((mag << 20) | (121u << 23)) - bits_float(121u << 23);
  }
  return bits_float(float_bits(f) | sign);
}

JAXATTN_HD float e5m2_to_float(uint8_t b) { return f16_to_float(uint16_t(uint16_t(b) << 8)); }

// Round to nearest even, saturating: anything past the largest finite value (infinities too)
// becomes it, NaN stays NaN. What jaxattn.kv.write_kv stores (the self-tests use these to
// build caches).
JAXATTN_HD float round_half_even(float x) {
#if defined(JAXATTN_DEVICE_PASS)
  return rintf(x);
#else
  // x >= 0, well below 2^23: 2^23 + x rounds x to an integer, half to even.
  const float big = 8388608.f;
  return (x + big) - big;
#endif
}

JAXATTN_HD uint8_t float_to_e4m3(float f) {
  const uint32_t u = float_bits(f);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint8_t(sign | 0x7fu);
  if (abs >= 0x43e00000u) return uint8_t(sign | 0x7eu);  // >= 448
  if (abs < (121u << 23)) {  // below 2^-6: multiples of 2^-9 (m = 8 is 2^-6, the first normal)
    return uint8_t(sign | uint32_t(round_half_even(bits_float(abs) * 512.f)));
  }
  const uint32_t r = (abs + 0x7ffffu + ((abs >> 20) & 1u)) >> 20;
  const uint32_t mag = r - (120u << 3);
  return uint8_t(sign | (mag > 0x7eu ? 0x7eu : mag));
}

JAXATTN_HD uint8_t float_to_e5m2(float f) {
  const uint32_t u = float_bits(f);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint8_t(sign | 0x7fu);
  if (abs >= 0x47600000u) return uint8_t(sign | 0x7bu);  // >= 57344
  if (abs < (113u << 23)) {                              // below 2^-14: multiples of 2^-16
    return uint8_t(sign | uint32_t(round_half_even(bits_float(abs) * 65536.f)));
  }
  const uint32_t r = (abs + 0xfffffu + ((abs >> 21) & 1u)) >> 21;
  const uint32_t mag = r - (112u << 2);
  return uint8_t(sign | (mag > 0x7bu ? 0x7bu : mag));
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
template <>
struct Elem<e4m3_t> {
  JAXATTN_HD static float load(e4m3_t x) { return e4m3_to_float(x.bits); }
  JAXATTN_HD static e4m3_t store(float x) { return e4m3_t{float_to_e4m3(x)}; }
};
template <>
struct Elem<e5m2_t> {
  JAXATTN_HD static float load(e5m2_t x) { return e5m2_to_float(x.bits); }
  JAXATTN_HD static e5m2_t store(float x) { return e5m2_t{float_to_e5m2(x)}; }
};

template <typename T>
constexpr bool is_fp8_v = sizeof(T) == 1;

template <typename T>
JAXATTN_HD float to_float(T x) {
  return Elem<T>::load(x);
}
template <typename T>
JAXATTN_HD T from_float(float x) {
  return Elem<T>::store(x);
}

// Element i of a split-K projection's float32 partial sums parts [splits, ...] (stride elements
// a split): their float32 sum in split order, rounded to T (what XLA's split-K GEMM returns).
template <typename T>
JAXATTN_HD T summed_partials(const float* parts, int32_t splits, int64_t stride, int64_t i) {
  float acc = parts[i];
  for (int32_t s = 1; s < splits; ++s) acc += parts[s * stride + i];
  return from_float<T>(acc);
}

}  // namespace jaxattn
