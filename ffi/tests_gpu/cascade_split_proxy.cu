// Timing proxy for a cascade decode in two kernels that share the GPU: the prefix level as the
// Hopper prefill (warp-specialised, two consumer warpgroups) over key partitions of the shared
// prefix, the own level as plain paged decode, the two on separate streams so that the prefill's
// blocks hold some multiprocessors while the decode's fill the rest. Today's cascade kernel runs
// both levels in one grid, its prefix blocks a one-warpgroup wgmma loop beside one own block an
// SM (ffi/NOTES.md, rounds 30, 53, 68, 69). Nothing is checked here but that every launch is
// accepted; the results decide whether the two-kernel form is worth building.
//
// The issue's batch: 64 requests on one 4096-token prefix, 256 own tokens each, bf16, GQA 32/8,
// head_dim 128, pages of 16. The prefix level's proxy is S requests of 64 query tokens (the 64
// requests' rows of a KV head: 64 x 4 = 256, packed four heads a token as the prefill packs
// GQA) over 4096 / S keys each, causal only within the last 64 keys -- the work of the prefix
// level cut into S key partitions (round 53's proxy). Build and run from the repository root:
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DJAXATTN_HAVE_SM90A \
//     -Iffi/include -Iffi/src ffi/tests_gpu/cascade_split_proxy.cu ffi/src/prefill.cu \
//     ffi/src/prefill_fp8.cu ffi/src/prefill_sm90.cu ffi/src/prefill_sm90_persistent.cu \
//     ffi/src/paged_decode_bf16.cu -o cascade_split_proxy && ./cascade_split_proxy
//
// First the own level's decode alone with 0, 16, 32, 64 and 96 SMs held by blocks that take a
// whole SM each (what the decode can do on the SMs a prefill leaves it). Arguments:
// --splits S,... (default 1,2,4,8), --reps N (default 50). The prefill's grid is
// 16 S blocks of one multiprocessor each (8 KV heads x 2 tiles of 128 packed rows x S), so S = 4
// leaves about half of an H100's or H200's 132 multiprocessors to the decode. For every S it prints
// the median time of: the prefill alone, the decode alone, both in one stream (one after the
// other), both on two streams with the prefill launched first and with the decode first; each
// pair is joined before the next starts. Compare with `cascade_selftest --perf` (the one-grid
// cascade and its merge) run on the same card.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "cuda_ok.h"
#include "gpu_launch.h"
#include "jaxattn/prefill.cuh"
#include "selftest_rng.h"

namespace {

using jaxattn::bf16_t;
using jaxattn::DecodeParams;
using jaxattn::KvGeometry;
using jaxattn::Layout;
using jaxattn::PrefillParams;

constexpr int kHq = 32, kHkv = 8, kD = 128, kPage = 16;
constexpr int kRequests = 64, kPrefix = 4096, kOwn = 256, kNew = 64;

std::vector<uint16_t> random_bf16(size_t n, Rng& rng) {
  std::vector<uint16_t> h(n);
  for (auto& x : h) x = jaxattn::float_to_bf16(rng.normal());
  return h;
}

// A bshd cache of `pages` pages, every page used once, in a shuffled order: tables[i] lists
// pages i * per .. (i + 1) * per - 1 of that order.
struct Cache {
  uint16_t *k = nullptr, *v = nullptr;
  int32_t* tables = nullptr;
  KvGeometry geo;
  Cache(int rows, int per, Rng& rng) {
    const int pages = rows * per;
    const size_t elems = size_t(pages) * kPage * kHkv * kD;
    k = upload(random_bf16(elems, rng));
    v = upload(random_bf16(elems, rng));
    std::vector<int32_t> order(pages);
    for (int i = 0; i < pages; ++i) order[i] = i;
    for (int i = pages - 1; i > 0; --i) std::swap(order[i], order[rng() % (i + 1)]);
    tables = upload(order);
    geo = jaxattn::make_geometry(Layout::kBSHD, pages, kPage, kHkv, kD);
  }
  ~Cache() {
    cudaFree(k);
    cudaFree(v);
    cudaFree(tables);
  }
};

// The own level: plain paged decode of the 64 requests' own tokens, one pass.
struct OwnLevel {
  Cache cache;
  void *q = nullptr, *out = nullptr;
  int32_t* lens = nullptr;
  DecodeParams p;
  explicit OwnLevel(Rng& rng) : cache(kRequests, kOwn / kPage, rng) {
    q = upload(random_bf16(size_t(kRequests) * kHq * kD, rng));
    CUDA_OK(cudaMalloc(&out, size_t(kRequests) * kHq * kD * 2));
    lens = upload(std::vector<int32_t>(kRequests, kOwn));
    p.q = q;
    p.k = cache.k;
    p.v = cache.v;
    p.block_tables = cache.tables;
    p.seq_lens = lens;
    p.out = out;
    p.batch = kRequests;
    p.num_q_heads = kHq;
    p.block_table_stride = kOwn / kPage;
    p.partition_size = 0;
    p.max_parts = 1;
    p.kv = cache.geo;
    p.ls = jaxattn::make_logit_scale(1.f / std::sqrt(float(kD)), 0.f);
  }
  ~OwnLevel() {
    cudaFree(q);
    cudaFree(out);
    cudaFree(lens);
  }
  void launch(cudaStream_t s) const {
    const char* err = jaxattn::gpu::launch_paged_decode_typed<bf16_t, bf16_t>(p, s);
    if (err) {
      std::fprintf(stderr, "decode: %s\n", err);
      std::exit(2);
    }
  }
};

// The prefix level's proxy: `splits` requests of kNew query tokens over kPrefix / splits keys.
struct PrefixLevel {
  Cache cache;
  void *q = nullptr, *out = nullptr;
  int32_t *cu = nullptr, *lens = nullptr;
  uint32_t* work = nullptr;
  PrefillParams p;
  PrefixLevel(int splits, Rng& rng) : cache(splits, kPrefix / splits / kPage, rng) {
    const int total_q = splits * kNew;
    q = upload(random_bf16(size_t(total_q) * kHq * kD, rng));
    CUDA_OK(cudaMalloc(&out, size_t(total_q) * kHq * kD * 2));
    std::vector<int32_t> cu_h(splits + 1);
    for (int i = 0; i <= splits; ++i) cu_h[i] = i * kNew;
    cu = upload(cu_h);
    lens = upload(std::vector<int32_t>(splits, kPrefix / splits));
    CUDA_OK(cudaMalloc(&work, sizeof(uint32_t)));
    p.q = q;
    p.k = cache.k;
    p.v = cache.v;
    p.cu_seqlens_q = cu;
    p.page_table = cache.tables;
    p.seq_lens = lens;
    p.page_table_len = int64_t(splits) * (kPrefix / splits / kPage);
    p.out = out;
    p.batch = splits;
    p.total_q = total_q;
    p.num_q_heads = kHq;
    p.page_table_stride = kPrefix / splits / kPage;
    p.kernel = static_cast<int32_t>(jaxattn::gpu::PrefillKernel::kSm90);
    p.kv = cache.geo;
    p.ls = jaxattn::make_logit_scale(1.f / std::sqrt(float(kD)), 0.f);
    p.work_counter = work;
  }
  ~PrefixLevel() {
    cudaFree(q);
    cudaFree(out);
    cudaFree(cu);
    cudaFree(lens);
    cudaFree(work);
  }
  void launch(cudaStream_t s) const {
    const char* err = jaxattn::gpu::launch_prefill_typed<bf16_t>(p, s);
    if (err) {
      std::fprintf(stderr, "prefill: %s\n", err);
      std::exit(2);
    }
  }
};

// Holds its stream for `cycles` SM clocks, so that the launches enqueued behind it are all
// waiting when the timed work starts (no host launch latency inside a timing).
__global__ void hold(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) __nanosleep(1000);
}

// Takes a whole multiprocessor (all the shared memory a block may have) for `cycles` clocks:
// while N of these are resident, a kernel launched after them runs on the other SMs.
__global__ void occupy(long long cycles) {
  extern __shared__ unsigned char pad[];
  if (threadIdx.x == 0) pad[0] = 0;
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) __nanosleep(1000);
}

// The median over `reps` runs (after two warm-ups) of the time between events `a` and `b`, which
// `enqueue` records around the work it enqueues, behind a holding kernel on s0 and a `fork`
// event that s1 waits for.
struct Timing {
  cudaStream_t s0, s1;
  cudaEvent_t a, b, fork, join;
  Timing(cudaStream_t s0_, cudaStream_t s1_) : s0(s0_), s1(s1_) {
    CUDA_OK(cudaEventCreate(&a));
    CUDA_OK(cudaEventCreate(&b));
    CUDA_OK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    CUDA_OK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  }
  ~Timing() {
    for (cudaEvent_t e : {a, b, fork, join}) cudaEventDestroy(e);
  }
  float median_us(int reps, const std::function<void()>& enqueue) const {
    std::vector<float> t;
    for (int r = 0; r < reps + 2; ++r) {
      hold<<<1, 1, 0, s0>>>(200000);  // ~100-120 us
      CUDA_OK(cudaGetLastError());
      CUDA_OK(cudaEventRecord(fork, s0));
      CUDA_OK(cudaStreamWaitEvent(s1, fork, 0));
      enqueue();
      CUDA_OK(cudaDeviceSynchronize());
      float ms = 0.f;
      CUDA_OK(cudaEventElapsedTime(&ms, a, b));
      if (r >= 2) t.push_back(ms * 1000.f);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
  // From a on s0 to the end of everything `body` enqueues on s0 and s1 (s1 joined into s0).
  float pair_us(int reps, const std::function<void()>& body) const {
    return median_us(reps, [&] {
      CUDA_OK(cudaEventRecord(a, s0));
      body();
      CUDA_OK(cudaEventRecord(join, s1));
      CUDA_OK(cudaStreamWaitEvent(s0, join, 0));
      CUDA_OK(cudaEventRecord(b, s0));
    });
  }
  // The own level's decode on s1 while `held` SMs are taken by occupy blocks placed before it.
  float beside_held_us(int reps, const OwnLevel& own, int held, int smem) const {
    return median_us(reps, [&] {
      if (held > 0) occupy<<<held, 32, smem, s0>>>(1000000);  // ~0.5 ms, past the decode's end
      CUDA_OK(cudaGetLastError());
      hold<<<1, 1, 0, s1>>>(4000);  // ~2 us: the occupy blocks are placed first
      CUDA_OK(cudaEventRecord(a, s1));
      own.launch(s1);
      CUDA_OK(cudaEventRecord(b, s1));
    });
  }
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> splits = {1, 2, 4, 8};
  int reps = 50;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--splits") && i + 1 < argc) {
      splits.clear();
      for (const char* s = argv[++i]; *s;) {
        splits.push_back(std::atoi(s));
        while (*s && *s != ',') ++s;
        if (*s == ',') ++s;
      }
    } else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: %s [--splits S,...] [--reps N]\n", argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20);
  cudaStream_t s0, s1;
  CUDA_OK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  const Timing timing(s0, s1);
  Rng rng(2026);
  const OwnLevel own(rng);
  const double own_bytes = 2.0 * kRequests * kOwn * kHkv * kD * 2;
  const double prefix_bytes = 2.0 * kPrefix * kHkv * kD * 2;
  const double flops = 4.0 * kD * kHq * double(kRequests) * kPrefix;
  std::printf("own level %.1f MB, prefix %.1f MB, prefix level %.2f GFLOP\n", own_bytes / 1e6,
              prefix_bytes / 1e6, flops / 1e9);
  // The own level's decode on part of the GPU, the rest held: what it can do beside a prefill
  // that holds those SMs (0 held: the decode alone).
  const int smem = static_cast<int>(prop.sharedMemPerBlockOptin);
  CUDA_OK(cudaFuncSetAttribute(occupy, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::printf("| SMs held | decode us | GB/s |\n|---|---|---|\n");
  for (int held : {0, 16, 32, 64, 96}) {
    if (held >= prop.multiProcessorCount) continue;
    const float t = timing.beside_held_us(reps, own, held, smem);
    std::printf("| %d | %.1f | %.0f |\n", held, t, own_bytes / (t * 1e-6) / 1e9);
  }
  std::printf(
      "| S | prefill alone us | decode alone us | one stream us | two streams, prefill "
      "first us | two streams, decode first us | best / (prefill + decode) |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (int s : splits) {
    if (s <= 0 || kPrefix % (s * kPage) != 0 || kPrefix / s < kNew) {
      std::printf("| %d | (not a split of %d keys into whole pages of at least %d keys) |\n", s,
                  kPrefix, kNew);
      continue;
    }
    const PrefixLevel pre(s, rng);
    const float t_pre = timing.pair_us(reps, [&] { pre.launch(s0); });
    const float t_own = timing.pair_us(reps, [&] { own.launch(s0); });
    const float t_seq = timing.pair_us(reps, [&] {
      pre.launch(s0);
      own.launch(s0);
    });
    const float t_pf = timing.pair_us(reps, [&] {
      pre.launch(s0);
      own.launch(s1);
    });
    const float t_df = timing.pair_us(reps, [&] {
      own.launch(s1);
      pre.launch(s0);
    });
    std::printf("| %d | %.1f (%.0f TFLOP/s) | %.1f | %.1f | %.1f | %.1f | %.2f |\n", s, t_pre,
                flops / (t_pre * 1e-6) / 1e12, t_own, t_seq, t_pf, t_df,
                std::min(t_pf, t_df) / (t_pre + t_own));
  }
  CUDA_OK(cudaStreamDestroy(s0));
  CUDA_OK(cudaStreamDestroy(s1));
  return 0;
}
