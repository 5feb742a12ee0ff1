// The GPU write_kv kernel: one thread stores 8 consecutive elements of one (token, KV head)
// row of K and the same 8 of V (jaxattn/kv_write.h has the element step and the slot rule).
// The rows arrive as [num_tokens, num_kv_heads, head_dim] with head_dim a multiple of 8, so a
// thread's 8 inputs and 8 outputs are each one or two vector accesses. One launch writes both
// caches: a decode step's K and V of one layer take one small kernel instead of two scatters.
// rope_write_kv does the same from a fused projection's q|k|v rows, with the rotary embedding
// of q and k in the same pass: one kernel for what was three elementwise passes and the write.
// It also takes the projection as float32 split-K partial sums and sums them as it loads a
// row, so no kernel runs between a split-K GEMM and this one.
#include "gpu_launch.h"
#include "jaxattn/kv_write.h"
#include "jaxattn/partials.cuh"

namespace jaxattn {
namespace gpu {

namespace {

// 8 elements, aligned for vector loads and stores (8, 16 or 32 bytes).
template <typename E>
struct alignas(sizeof(E) * 8 >= 16 ? 16 : sizeof(E) * 8) Chunk8 {
  E e[8];
};

constexpr int kWriteThreads = 128;

template <typename In, typename C>
__global__ void __launch_bounds__(kWriteThreads) write_kv_kernel(const WriteKvParams p) {
  const KvGeometry& g = p.kv;
  const int chunks = g.head_dim / 8;
  const int64_t i = int64_t(blockIdx.x) * kWriteThreads + threadIdx.x;
  const int64_t per_token = int64_t(g.num_kv_heads) * chunks;
  if (i >= per_token * p.num_tokens) return;
  const int32_t t = int32_t(i / per_token);
  const int rest = int(i - int64_t(t) * per_token);
  const int h = rest / chunks, c = rest - h * chunks;
  const int64_t row = write_kv_row(g, p.slots[t], h);
  if (row < 0) return;
  const int64_t src = (int64_t(t) * g.num_kv_heads + h) * g.head_dim + c * 8;
  const int64_t dst = row + c * 8;
#pragma unroll
  for (int which = 0; which < 2; ++which) {
    const In* x = static_cast<const In*>(which ? p.v : p.k) + src;
    C* y = static_cast<C*>(which ? p.v_cache : p.k_cache) + dst;
    const float* s = which ? p.scales.v : p.scales.k;
    if (s != nullptr) s += h;
    const Chunk8<In> a = *reinterpret_cast<const Chunk8<In>*>(x);
    Chunk8<C> b;
#pragma unroll
    for (int e = 0; e < 8; ++e) b.e[e] = stored_element<In, C>(a.e[e], s);
    *reinterpret_cast<Chunk8<C>*>(y) = b;
  }
}

// 8 consecutive elements of qkv at element offset `at`: qkv's own (In), or the float32 sum of
// the split-K partials (summed_partials' order and rounding, 8 at a time).
template <typename In>
__device__ __forceinline__ Chunk8<In> load_qkv8(const RopeWriteKvParams& p, int64_t at,
                                                int64_t stride) {
  if (p.splits == 0)
    return *reinterpret_cast<const Chunk8<In>*>(static_cast<const In*>(p.qkv) + at);
  Chunk8<In> out;
  load_partials8(static_cast<const float*>(p.qkv) + at, p.splits, stride, out.e);
  return out;
}

// rope_write_kv: one thread takes 8 elements of the first half of one (token, head) row of qkv
// and their 8 RoPE partners in the second half (head_dim a multiple of 16), rotates them for q
// and k heads, and stores them: q heads into q_out, k and v heads at the token's cache slot.
template <typename In, typename C>
__global__ void __launch_bounds__(kWriteThreads) rope_write_kv_kernel(const RopeWriteKvParams p) {
  const KvGeometry& g = p.w.kv;
  const int half = g.head_dim / 2, chunks = half / 8;
  const int Hq = p.num_q_heads, Hkv = g.num_kv_heads, H = Hq + 2 * Hkv;
  const int64_t i = int64_t(blockIdx.x) * kWriteThreads + threadIdx.x;
  const int64_t per_token = int64_t(H) * chunks;
  if (i >= per_token * p.w.num_tokens) return;
  const int32_t t = int32_t(i / per_token);
  const int rest = int(i - int64_t(t) * per_token);
  const int h = rest / chunks, c = rest - h * chunks;
  const bool is_v = h >= Hq + Hkv;
  int64_t dst = -1;
  if (h >= Hq) {
    dst = write_kv_row(g, p.w.slots[t], h - Hq - (is_v ? Hkv : 0));
    if (dst < 0) return;
  }
  const int64_t at = (int64_t(t) * H + h) * g.head_dim + c * 8;
  const int64_t stride = int64_t(p.w.num_tokens) * H * g.head_dim;
  Chunk8<In> a = load_qkv8<In>(p, at, stride);
  Chunk8<In> b = load_qkv8<In>(p, at + half, stride);
  if (!is_v) {
    const int64_t tab = int64_t(t) * half + c * 8;
    const float4 c0 = *reinterpret_cast<const float4*>(p.cos + tab);
    const float4 c1 = *reinterpret_cast<const float4*>(p.cos + tab + 4);
    const float4 s0 = *reinterpret_cast<const float4*>(p.sin + tab);
    const float4 s1 = *reinterpret_cast<const float4*>(p.sin + tab + 4);
    const float cs[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
    const float sn[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) rope_pair(&a.e[e], &b.e[e], cs[e], sn[e]);
  }
  if (h < Hq) {
    In* y = static_cast<In*>(p.q_out) + (int64_t(t) * Hq + h) * g.head_dim + c * 8;
    *reinterpret_cast<Chunk8<In>*>(y) = a;
    *reinterpret_cast<Chunk8<In>*>(y + half) = b;
    return;
  }
  C* y = static_cast<C*>(is_v ? p.w.v_cache : p.w.k_cache) + dst + c * 8;
  const float* s = is_v ? p.w.scales.v : p.w.scales.k;
  if (s != nullptr) s += h - Hq - (is_v ? Hkv : 0);
  Chunk8<C> lo, hi;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    lo.e[e] = stored_element<In, C>(a.e[e], s);
    hi.e[e] = stored_element<In, C>(b.e[e], s);
  }
  *reinterpret_cast<Chunk8<C>*>(y) = lo;
  *reinterpret_cast<Chunk8<C>*>(y + half) = hi;
}

template <typename In, typename C>
const char* launch_rope_typed(const RopeWriteKvParams& p, gpuStream_t stream) {
  const int H = p.num_q_heads + 2 * p.w.kv.num_kv_heads;
  const int64_t threads = int64_t(p.w.num_tokens) * H * (p.w.kv.head_dim / 16);
  if (threads == 0) return nullptr;
  const int64_t blocks = (threads + kWriteThreads - 1) / kWriteThreads;
  if (blocks > 0x7fffffff) return "jaxattn: rope_write_kv has too many rows for one launch";
  rope_write_kv_kernel<In, C><<<dim3(unsigned(blocks)), kWriteThreads, 0, stream>>>(p);
  return check_launch();
}

template <typename In, typename C>
const char* launch_typed(const WriteKvParams& p, gpuStream_t stream) {
  const int64_t threads = int64_t(p.num_tokens) * p.kv.num_kv_heads * (p.kv.head_dim / 8);
  if (threads == 0) return nullptr;
  const int64_t blocks = (threads + kWriteThreads - 1) / kWriteThreads;
  if (blocks > 0x7fffffff) return "jaxattn: write_kv has too many rows for one launch";
  write_kv_kernel<In, C><<<dim3(unsigned(blocks)), kWriteThreads, 0, stream>>>(p);
  return check_launch();
}

template <typename In>
const char* launch_cache(CacheDType cache, const WriteKvParams& p, gpuStream_t stream) {
  return with_cache_type(
      cache, [&](auto c) { return launch_typed<In, decltype(c)>(p, stream); },
      []() -> const char* { return "jaxattn: unsupported KV cache dtype"; });
}

template <typename In>
const char* launch_rope_cache(CacheDType cache, const RopeWriteKvParams& p, gpuStream_t stream) {
  return with_cache_type(
      cache, [&](auto c) { return launch_rope_typed<In, decltype(c)>(p, stream); },
      []() -> const char* { return "jaxattn: unsupported KV cache dtype"; });
}

}  // namespace

const char* launch_write_kv(DType in, CacheDType cache, const WriteKvParams& p,
                            gpuStream_t stream) {
  if (p.kv.head_dim % 8 != 0) return "jaxattn: the GPU write_kv needs head_dim a multiple of 8";
  switch (in) {
    case DType::kF32:
      return launch_cache<float>(cache, p, stream);
    case DType::kBF16:
      return launch_cache<bf16_t>(cache, p, stream);
    case DType::kF16:
      return launch_cache<f16_t>(cache, p, stream);
  }
  return "jaxattn: unsupported dtype";
}

const char* launch_rope_write_kv(DType in, CacheDType cache, const RopeWriteKvParams& p,
                                 gpuStream_t stream) {
  if (p.w.kv.head_dim % 16 != 0)
    return "jaxattn: the GPU rope_write_kv needs head_dim a multiple of 16";
  switch (in) {
    case DType::kF32:
      return launch_rope_cache<float>(cache, p, stream);
    case DType::kBF16:
      return launch_rope_cache<bf16_t>(cache, p, stream);
    case DType::kF16:
      return launch_rope_cache<f16_t>(cache, p, stream);
  }
  return "jaxattn: unsupported dtype";
}

}  // namespace gpu
}  // namespace jaxattn
