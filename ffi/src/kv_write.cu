// The GPU write_kv kernel: one thread stores 8 consecutive elements of one (token, KV head)
// row of K and the same 8 of V (jaxattn/kv_write.h has the element step and the slot rule).
// The rows arrive as [num_tokens, num_kv_heads, head_dim] with head_dim a multiple of 8, so a
// thread's 8 inputs and 8 outputs are each one or two vector accesses. One launch writes both
// caches: a decode step's K and V of one layer take one small kernel instead of two scatters.
#include "gpu_launch.h"
#include "jaxattn/kv_write.h"

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

}  // namespace gpu
}  // namespace jaxattn
