// NVIDIA tensor-core building blocks shared by the decode and prefill kernels (sm_80+):
// shared-memory addresses, ldmatrix, mma.sync m16n8k16 with f32 accumulation, and packing of
// two floats into one 16-bit pair; on the host, the device checks that pick those kernels and
// the opt-in to large dynamic shared memory. CUDA only: the HIP builds never include the
// kernels that use them. On targets below sm_80 the device bodies are empty (the launchers
// never pick those kernels there). Their 16-byte copies are gpu_vendor.h's async_copy16_at.
#pragma once

#include <cstdint>
#include <type_traits>

#include "jaxattn/gpu_vendor.h"

#if defined(JAXATTN_CUDA)

namespace jaxattn {
namespace gpu {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Bytes from p to the first 1024-byte-aligned byte of shared memory at or after it (128-byte
// swizzled tiles need that alignment; the kernels reserve 1 KiB of slack for it).
__device__ __forceinline__ uint32_t smem_pad1024(const void* p) {
  return (1024u - (smem_u32(p) & 1023u)) & 1023u;
}

// One 16-byte shared-memory load (ld.shared.v4). A uint4 read through a byte pointer may come
// out of nvcc as four 4-byte loads, and where a quarter-warp's 16-byte loads take one
// wavefront, its 4-byte loads of rows 128 bytes apart meet 4-way bank conflicts (the FP8
// prefill kernels' staging reads did).
// lds128_at takes the shared-memory address itself, and sts128_at stores (st.shared.v4):
// address arithmetic in 32 bits, where generic pointers would hold 64.
__device__ __forceinline__ uint4 lds128_at(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(a));
  return v;
}
__device__ __forceinline__ uint4 lds128(const void* p) { return lds128_at(smem_u32(p)); }
__device__ __forceinline__ void sts128_at(uint32_t a, const uint4& v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
#if __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
#if __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#endif
}

// c += A B, m16n8k16, f32 accumulation, T = bf16_t or f16_t; A in a0..a3, B in b0, b1 (the PTX
// fragment layouts).
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
#if __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, bf16_t>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
#endif
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  mma16816<T>(c, a[0], a[1], a[2], a[3], b0, b1);
}

// The online softmax's maxima step for a lane's two rows: the running maxima m0 / m1 raised to
// the tile's row maxima mx0 / mx1 (the quad's); a0 / a1 the factors that rescale what the rows
// summed so far; mu0 / mu1 the maxima to subtract from the tile's logits (0 for a row that has
// seen only -inf, so that its probabilities stay 0). Shared by the mma.sync and wgmma tiles.
//
// SLACK > 0 (base 2) raises a running maximum only when the tile's exceeds it by more than
// SLACK (FlashAttention-4's lazy rescale): the probabilities then stay below 2^SLACK, the
// factors are exactly 1 in most tiles (so the accumulators' rescale is skipped), and the sum
// uses the same maximum as the products, so the normalised result is unchanged.
template <int SLACK = 0>
__device__ __forceinline__ void online_max_step(float mx0, float mx1, float& m0, float& m1,
                                                float& a0, float& a1, float& mu0, float& mu1) {
  constexpr float kNegInf = -__builtin_huge_valf();
  float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
  if constexpr (SLACK > 0) {
    mn0 = mn0 > m0 + float(SLACK) ? mn0 : m0;  // m0 = -inf: raised unless the tile is all -inf
    mn1 = mn1 > m1 + float(SLACK) ? mn1 : m1;
  }
  mu0 = mn0 == kNegInf ? 0.f : mn0;
  mu1 = mn1 == kNegInf ? 0.f : mn1;
  a0 = fast_exp2(m0 - mu0);
  a1 = fast_exp2(m1 - mu1);
  m0 = mn0;
  m1 = mn1;
}

// The online softmax's rescale of output accumulators held as m16n8 C fragments. Callers
// may skip it when __any_sync(factor != 1) is false for the warp: once the running maxima
// settle, every factor is exp2(0), exactly 1, and a NaN factor is not 1, so NaN still
// propagates.
//
// The online softmax step of an m16n8 accumulator tile of logits in base 2, s[J][4] (this
// lane's columns of row g in elements 0, 1, of row g + 8 in 2, 3) whose lane-local row maxima
// are mx0 / mx1: the quad's maxima, the running maxima m0 / m1 updated, s replaced by exp2(s -
// max) (a row that has seen only -inf subtracts 0, so its probabilities stay 0), this lane's
// partial row sums l0 / l1 rescaled and increased (the quad's are added once at the end). a0 /
// a1 get the factors that rescale the rows' O (scale_c_rows).
template <int J, int SLACK = 0>
__device__ __forceinline__ void mma_online_softmax(float (&s)[J][4], float mx0, float mx1,
                                                   float& m0, float& m1, float& l0, float& l1,
                                                   float& a0, float& a1) {
  mx0 = group_max<4>(mx0);
  mx1 = group_max<4>(mx1);
  float mu0, mu1;
  online_max_step<SLACK>(mx0, mx1, m0, m1, a0, a1, mu0, mu1);
  float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    s[j][0] = fast_exp2(s[j][0] - mu0);
    s[j][1] = fast_exp2(s[j][1] - mu0);
    s[j][2] = fast_exp2(s[j][2] - mu1);
    s[j][3] = fast_exp2(s[j][3] - mu1);
    sum0 += s[j][0] + s[j][1];
    sum1 += s[j][2] + s[j][3];
  }
  l0 = l0 * a0 + sum0;
  l1 = l1 * a1 + sum1;
}

// Row by row: a0 on row g (elements 0, 1), a1 on row g + 8 (2, 3).
template <int N>
__device__ __forceinline__ void scale_c_rows(float (&o)[N][4], float a0, float a1) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    o[i][0] *= a0;
    o[i][1] *= a0;
    o[i][2] *= a1;
    o[i][3] *= a1;
  }
}

// Column by column (the decode kernels' O^T, whose columns are heads): a_lo on column 2 tq
// (elements 0, 2), a_hi on column 2 tq + 1 (1, 3).
__device__ __forceinline__ void scale_c_cols(float (&c)[4], float a_lo, float a_hi) {
  c[0] *= a_lo;
  c[1] *= a_hi;
  c[2] *= a_lo;
  c[3] *= a_hi;
}

// Two floats as one register of 16-bit elements, `lo` in the low half (the lower k index).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r = 0;
#if __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, bf16_t>) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  }
#endif
  return r;
}

// The A fragment of P's 16-key step kk, packed to T from probabilities in the m16n8 accumulator
// layout (s[j][0..1]: row g, keys 8 j + 2 tq, + 1; s[j][2..3]: row g + 8): the accumulator
// layout of S is the A-operand layout of P, for mma.sync and for wgmma with A in registers.
template <typename T, int J>
__device__ __forceinline__ void p_fragment(const float (&s)[J][4], int kk, uint32_t (&pf)[4]) {
  pf[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
  pf[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
  pf[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  pf[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// FP8 -> float16 for the tensor cores: four codes of a 32-bit word (lowest byte first) as two
// float16 pairs, lo = (byte 0, byte 1), hi = (byte 2, byte 3), exact (every FP8 value is a
// float16; NaN stays NaN, e5m2's infinities stay infinite). e5m2 is the high byte of a
// float16: one byte permute per pair. e4m3: the cvt instruction on sm_89 and later; before,
// the float16 with e4m3's bits in place (the value times 2^-8, exact) times 256, and the rare
// NaN code patched.
__device__ __forceinline__ uint32_t hmul2_f16(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// kUpperBySelector (e4m3 on sm_89+): the word's two code pairs split in PTX (not as `w >> 16`
// in C++), so that ptxas reads the upper pair through the conversion's .H1 operand selector
// instead of shifting it down first (4 instructions fewer per 16 codes; the decode kernels).
// The prefill producers pass false: there the selector gained nothing and made ptxas spill in
// the persistent Hopper kernel at the producer's 64 registers (ffi/NOTES.md, round 28).
// JAXATTN_FP8_SOFTWARE_CVT (compile-time, e.g. on ffi/tests_gpu/decode_selftest.cu) selects
// the bit trick on sm_89+ as well, to time the cvt instruction's pipe against the integer and
// half-precision pipes.
template <typename C, bool kUpperBySelector = true>
__device__ __forceinline__ void fp8x4_to_f16x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  static_assert(std::is_same_v<C, e5m2_t> || std::is_same_v<C, e4m3_t>, "an FP8 code type");
  if constexpr (std::is_same_v<C, e5m2_t>) {
    lo = fp8_hi_bytes_lo(w);
    hi = fp8_hi_bytes_hi(w);
  } else {
#if __CUDA_ARCH__ >= 890 && !defined(JAXATTN_FP8_SOFTWARE_CVT)
    if constexpr (kUpperBySelector) {
      asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\n"
          "cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
          : "=r"(lo), "=r"(hi)
          : "r"(w));
    } else {
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(lo) : "h"(uint16_t(w & 0xffffu)));
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(hi) : "h"(uint16_t(w >> 16)));
    }
#else
    constexpr uint32_t k256 = 0x5c005c00u;  // 256.0 in both halves
    lo = hmul2_f16(e4m3x2_as_f16x2_scaled(fp8_hi_bytes_lo(w)), k256);
    hi = hmul2_f16(e4m3x2_as_f16x2_scaled(fp8_hi_bytes_hi(w)), k256);
    if (__builtin_expect(e4m3x4_has_nan(w), 0)) {
      if ((w & 0x7fu) == 0x7fu) lo |= 0x7fffu;
      if (((w >> 8) & 0x7fu) == 0x7fu) lo |= 0x7fff0000u;
      if (((w >> 16) & 0x7fu) == 0x7fu) hi |= 0x7fffu;
      if (((w >> 24) & 0x7fu) == 0x7fu) hi |= 0x7fff0000u;
    }
#endif
  }
}

// What the launchers ask of the current device. All zero when a query fails, so no
// tensor-core kernel is chosen.
struct DeviceCaps {
  int major = 0;
  int minor = 0;
  int smem_optin = 0;  // most dynamic shared memory one block may opt in to, bytes
  int sms = 0;         // multiprocessors
};

inline DeviceCaps current_device_caps() {
  DeviceCaps c;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&c.major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&c.minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&c.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&c.sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return DeviceCaps{};
  return c;
}

// sm_90a code runs on compute capability 9.0 only.
inline bool device_is_sm90() {
  const DeviceCaps c = current_device_caps();
  return c.major == 9 && c.minor == 0;
}

// Lets `kernel` launch with `bytes` of dynamic shared memory (past the default 48 KiB a
// block needs the opt-in); nullptr or the error, which is cleared.
template <typename Kernel>
inline const char* allow_dynamic_smem(Kernel kernel, int bytes) {
  if (bytes <= 48 * 1024) return nullptr;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) return nullptr;
  (void)cudaGetLastError();
  return cudaGetErrorString(err);
}

}  // namespace gpu
}  // namespace jaxattn

#endif  // JAXATTN_CUDA
