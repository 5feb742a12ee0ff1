// Standalone GPU self-test and timing of the cascade decode kernels (jaxattn/cascade.cuh), no
// Python or XLA needed:
//
// clang-format off
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DJAXATTN_HAVE_SM90A -Iffi/include -Iffi/src ffi/tests_gpu/cascade_selftest.cu -o /tmp/cascade_selftest
//   (another GPU: -arch=sm_XY without -DJAXATTN_HAVE_SM90A; the wgmma prefix level then reports SKIP)
//   /tmp/cascade_selftest            # correctness and robustness cases, then timing
//   /tmp/cascade_selftest --check    # correctness and robustness only   (--perf: timing only)
//   /tmp/cascade_selftest --robust   # robustness only: small, for compute-sanitizer
//   (built with -DJAXATTN_CASCADE_TRACE) --trace 2 issue|prefix|own: block timelines of a launch
// clang-format on
//
// Correctness: random batches of requests over G prefixes (pages a random permutation, every
// slot no request reads NaN, both kinds of table padded with entries that point at NaN pages),
// against a float64 CPU attention over each request's joined keys (prefix, then own), for
// f32/bf16/f16, head_dim 32..256, groups 1..8, page sizes 1..128, both layouts, one pass and
// split own partitions, prefix-split targets from 1 to many blocks, and batches that share one
// prefix across several tiles, mix prefixes, share nothing, or pad the prefix table with
// prefixes nobody uses. Outputs and the workspace start as NaN, so anything unwritten shows. A
// case passes when |out - ref| <= atol + rtol |ref| everywhere (tests/helpers.py tolerances).
//
// Robustness (jaxattn/cascade.h's contract): prefix page ids num_pages, 10^6, -1, INT_MIN;
// prefix lengths that are not whole pages, past the table, negative; prefix_of = G, -2,
// INT_MAX; own page ids and lengths out of range; garbage past every length; an unused prefix
// with garbage metadata; NaN in q, in a prefix key, in a prefix value, in an own value; an
// empty cache -- on both kernels (tensor-core and SIMT), each against a reference that applies
// the same contract. Buffers are allocated at their exact sizes, so a run under
// compute-sanitizer --tool memcheck reports any access outside them (ffi/gpu_check.sh SANITIZE=1).
//
// Built with -DCASCADE_SELFTEST_ON_CPU (as C++: g++ -x c++), the same cases run against the C++ CPU
// implementation (jaxattn/cpu_cascade.h) instead of the kernels: a check, without a GPU, that the
// cases and their reference agree with an independent implementation of the contract.
//
// Timing (bf16, head_dim 128, page 16, bshd, Hq/Hkv 32/8; median of cudaEvent samples, inputs
// rotated over >= 240 MB): the issue's batch (64 requests on one 4096-token prefix, 256 own
// tokens each), a mixed batch and one where no request shares a prefix; cascade at the prefix
// target jaxattn/native.py picks (*) and at others, against plain paged decode of the joined
// tables, and against the floor: the prefix once and every own token once at the read
// ceiling (a read-only kernel over 1 GiB).
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(CASCADE_SELFTEST_ON_CPU)
#include "jaxattn/cpu_cascade.h"
#elif defined(JAXATTN_HAVE_SM90A)
#include "jaxattn/cascade_sm90.cuh"
#else
#include "jaxattn/cascade.cuh"
#endif

using namespace jaxattn;

#if !defined(CASCADE_SELFTEST_ON_CPU)
#include "cuda_ok.h"
#endif
#include "selftest_rng.h"

namespace {

enum class DT { kF32, kBF16, kF16 };
const char* dt_name(DT t) { return t == DT::kF32 ? "f32" : (t == DT::kBF16 ? "bf16" : "f16"); }
size_t dt_size(DT t) { return t == DT::kF32 ? 4 : 2; }

void store_elem(DT t, void* base, size_t i, float x) {
  if (t == DT::kF32) {
    static_cast<float*>(base)[i] = x;
  } else {
    static_cast<uint16_t*>(base)[i] = t == DT::kBF16 ? float_to_bf16(x) : float_to_f16(x);
  }
}

void store_nan(DT t, void* base, size_t i) {
  if (t == DT::kF32) {
    static_cast<float*>(base)[i] = std::nanf("");
  } else {
    static_cast<uint16_t*>(base)[i] = t == DT::kBF16 ? 0x7fc0u : 0x7e00u;
  }
}

double load_elem(DT t, const void* base, size_t i) {
  switch (t) {
    case DT::kF32:
      return static_cast<const float*>(base)[i];
    case DT::kBF16:
      return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DT::kF16:
      return f16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
  return 0;
}

template <typename F>
auto by_dtype(DT t, F&& f) {
  switch (t) {
    case DT::kF32:
      return f(float{});
    case DT::kBF16:
      return f(bf16_t{});
    default:
      return f(f16_t{});
  }
}

// What a run needs of the device, or of the host standing in for it.
#if defined(CASCADE_SELFTEST_ON_CPU)
void* dev_alloc(size_t bytes) { return std::malloc(std::max<size_t>(bytes, 1)); }
void dev_free(void* p) { std::free(p); }
void to_dev(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(dst, src, bytes);
}
void from_dev(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(dst, src, bytes);
}
void dev_fill_ones(void* dst, size_t bytes) { std::memset(dst, 0xff, bytes); }
const char* launch(DT t, const CascadeParams& p) {
  by_dtype(t, [&](auto tag) {
    cpu::cascade_decode<decltype(tag)>(p);
    return 0;
  });
  return nullptr;
}
const char* sync_error() { return nullptr; }
int num_sms() { return 132; }
bool wgmma_available() { return false; }
void tile_of(DT, int, int* rows, int* blocks) {
  *rows = 64;
  *blocks = 2;
}
#else
void* dev_alloc(size_t bytes) {
  void* p;
  CUDA_OK(cudaMalloc(&p, std::max<size_t>(bytes, 1)));  // exact sizes, for compute-sanitizer
  return p;
}
void dev_free(void* p) { cudaFree(p); }
void to_dev(void* dst, const void* src, size_t bytes) {
  if (bytes) CUDA_OK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
void from_dev(void* dst, const void* src, size_t bytes) {
  if (bytes) CUDA_OK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
void dev_fill_ones(void* dst, size_t bytes) { CUDA_OK(cudaMemset(dst, 0xff, bytes)); }
const char* launch(DT t, const CascadeParams& p) {
  return by_dtype(t, [&](auto tag) { return gpu::launch_cascade_typed<decltype(tag)>(p, 0); });
}
// nullptr, or the error that ended the run (the context is then gone).
const char* sync_error() {
  const cudaError_t e = cudaDeviceSynchronize();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}
// Whether this build and device run the wgmma prefix level (CascadeParams::prefix_kernel 2).
bool wgmma_available() { return gpu::cascade_wgmma_available<bf16_t, 128>(); }
int num_sms() {
  int dev = 0, n = 0;
  CUDA_OK(cudaGetDevice(&dev));
  CUDA_OK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}
// Query rows of a prefix tile and resident blocks an SM of the kernel the launcher picks.
void tile_of(DT t, int d, int* rows, int* blocks) {
  const char* e = by_dtype(
      t, [&](auto tag) { return gpu::cascade_tile_typed<decltype(tag)>(d, rows, blocks); });
  if (e) {
    std::fprintf(stderr, "cascade_tile: %s\n", e);
    std::exit(2);
  }
}
#endif

struct Case {
  DT dt = DT::kBF16;
  int hq = 8, hkv = 2, d = 128, page = 16;
  Layout layout = Layout::kBSHD;
  int part = 0;    // own partition size, 0: one pass
  int target = 0;  // prefix blocks the split aims at, 0: jaxattn/native.py's rule
  float scale = 0.1f, cap = 0.f;
  bool scaled = false;    // per-KV-head k_scale / v_scale (CascadeParams::scales), else 1
  int prefix_kernel = 0;  // CascadeParams::prefix_kernel: 0 auto, 1 mma.sync, 2 wgmma
  std::vector<int> prefix_pages, prefix_of, own;
};

std::string describe(const Case& c) {
  auto list = [](const std::vector<int>& v) {
    std::string s;
    for (size_t i = 0; i < v.size() && i < 12; ++i) s += (i ? "," : "") + std::to_string(v[i]);
    return v.size() > 12 ? s + ",..(" + std::to_string(v.size()) + ")" : s;
  };
  char buf[512];
  std::snprintf(
      buf, sizeof(buf),
      "%-4s Hq/Hkv=%2d/%-2d D=%3d page=%3d %s part=%3d target=%3d cap=%g%s%s prefixes=[%s] "
      "of=[%s] own=[%s]",
      dt_name(c.dt), c.hq, c.hkv, c.d, c.page, c.layout == Layout::kBSHD ? "bshd" : "bhsd", c.part,
      c.target, c.cap, c.scaled ? " scaled" : "",
      c.prefix_kernel == 1   ? " mma"
      : c.prefix_kernel == 2 ? " wgmma"
                             : "",
      list(c.prefix_pages).c_str(), list(c.prefix_of).c_str(), list(c.own).c_str());
  return buf;
}

// One batch on the host, as the kernels see it; the robustness cases edit these arrays.
struct Problem {
  Case c;
  int B = 0, G = 0, wp = 0, w = 0, num_pages = 0;
  KvGeometry g;
  std::vector<unsigned char> kc, vc, qh;
  std::vector<int32_t> ptab, plens, pof, tab, lens;
  std::vector<float> kscale, vscale;  // per KV head (empty: 1)

  size_t q_elems() const { return size_t(B) * c.hq * c.d; }
  size_t at(int page, int t, int h, int e) const {
    return size_t(page) * g.page_stride + size_t(t % c.page) * g.token_stride +
           size_t(h) * g.head_stride + e;
  }
  // Element index of key t (joined numbering) of request b, KV head h.
  size_t key(int b, int t, int h, int e) const {
    const int lp = pof[b] >= 0 ? plens[pof[b]] : 0;
    if (t < lp) return at(ptab[size_t(pof[b]) * wp + t / c.page], t, h, e);
    return at(tab[size_t(b) * w + (t - lp) / c.page], t - lp, h, e);
  }
};

Problem make_problem(const Case& c, Rng& rng) {
  Problem P;
  P.c = c;
  P.B = int(c.own.size());
  P.G = int(c.prefix_pages.size());
  const int D = c.d, page = c.page, hkv = c.hkv;
  const size_t es = dt_size(c.dt);
  int used = 0, max_own = 1, max_prefix = 1;
  for (int n : c.prefix_pages) {
    used += n;
    max_prefix = std::max(max_prefix, n);
  }
  for (int n : c.own) {
    used += (n + page - 1) / page;
    max_own = std::max(max_own, (n + page - 1) / page);
  }
  P.num_pages = used + 4;
  P.wp = max_prefix + 2;
  P.w = max_own + 2;
  std::vector<int> perm(P.num_pages);
  for (int i = 0; i < P.num_pages; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  auto nan_page = [&] { return perm[used + int(rng() % uint64_t(P.num_pages - used))]; };
  const size_t cache_elems = size_t(P.num_pages) * page * hkv * D;
  P.kc.resize(cache_elems * es);
  P.vc.resize(cache_elems * es);
  for (size_t i = 0; i < cache_elems; ++i) {
    store_nan(c.dt, P.kc.data(), i);
    store_nan(c.dt, P.vc.data(), i);
  }
  P.g = c.layout == Layout::kBSHD ? make_geometry(c.layout, P.num_pages, page, hkv, D)
                                  : make_geometry(c.layout, P.num_pages, hkv, page, D);
  int next = 0;
  auto fill = [&](int32_t* table, int tokens) {
    for (int j = 0; j < (tokens + page - 1) / page; ++j) table[j] = perm[next++];
    for (int t = 0; t < tokens; ++t)
      for (int h = 0; h < hkv; ++h)
        for (int e = 0; e < D; ++e) {
          store_elem(c.dt, P.kc.data(), P.at(table[t / page], t, h, e), rng.normal());
          store_elem(c.dt, P.vc.data(), P.at(table[t / page], t, h, e), rng.normal());
        }
  };
  P.ptab.resize(size_t(P.G) * P.wp);
  P.tab.resize(size_t(P.B) * P.w);
  for (auto& x : P.ptab) x = nan_page();
  for (auto& x : P.tab) x = nan_page();
  for (int g = 0; g < P.G; ++g) {
    P.plens.push_back(c.prefix_pages[g] * page);
    fill(&P.ptab[size_t(g) * P.wp], P.plens[g]);
  }
  P.pof = c.prefix_of;
  P.lens = c.own;
  for (int b = 0; b < P.B; ++b) fill(&P.tab[size_t(b) * P.w], P.lens[b]);
  P.qh.resize(P.q_elems() * es);
  for (size_t i = 0; i < P.q_elems(); ++i) store_elem(c.dt, P.qh.data(), i, rng.normal());
  if (c.scaled) {
    // A few times apart per head (powers of two and not), so that a kernel applying another
    // head's scale, or one scale to both levels differently, fails.
    for (int h = 0; h < hkv; ++h) {
      P.kscale.push_back(0.25f + 0.75f * float(h % 4));
      P.vscale.push_back(3.0f / float(1 + h % 3));
    }
  }
  return P;
}

// float64 reference with the contract: NaN rows for an invalid request, otherwise exact
// attention over the joined keys as stored (NaN propagating as in exact arithmetic).
std::vector<double> reference(const Problem& P) {
  const Case& c = P.c;
  const int D = c.d, hq = c.hq, hkv = c.hkv, group = hq / hkv, page = c.page;
  std::vector<double> ref(P.q_elems(), 0.0);
  auto pages_ok = [&](const int32_t* t, int n) {
    for (int i = 0; i < n; ++i)
      if (t[i] < 0 || t[i] >= P.num_pages) return false;
    return true;
  };
  for (int b = 0; b < P.B; ++b) {
    const int g = P.pof[b], L = P.lens[b];
    bool ok = g >= -1 && g < P.G;
    int lp = 0;
    if (ok && g >= 0) {
      lp = P.plens[g];
      ok = lp >= 0 && lp % page == 0 && int64_t(lp) <= int64_t(P.wp) * page &&
           (lp == 0 || P.num_pages > 0) && pages_ok(&P.ptab[size_t(g) * P.wp], lp / page);
    }
    ok = ok && L >= 0 && int64_t(L) <= int64_t(P.w) * page && (L == 0 || P.num_pages > 0) &&
         pages_ok(&P.tab[size_t(b) * P.w], (L + page - 1) / page);
    if (!ok) {
      std::fill(ref.begin() + size_t(b) * hq * D, ref.begin() + size_t(b + 1) * hq * D, NAN);
      continue;
    }
    const int n = lp + L;
    std::vector<double> s(n), kd(size_t(n) * D), vd(size_t(n) * D), qv(D);
    for (int kh = 0; kh < hkv; ++kh) {
      const double ks = P.kscale.empty() ? 1.0 : P.kscale[kh];
      const double vs = P.vscale.empty() ? 1.0 : P.vscale[kh];
      for (int t = 0; t < n; ++t)
        for (int e = 0; e < D; ++e) {
          kd[size_t(t) * D + e] = ks * load_elem(c.dt, P.kc.data(), P.key(b, t, kh, e));
          vd[size_t(t) * D + e] = vs * load_elem(c.dt, P.vc.data(), P.key(b, t, kh, e));
        }
      for (int h = kh * group; h < (kh + 1) * group; ++h) {
        const size_t row = (size_t(b) * hq + h) * D;
        for (int e = 0; e < D; ++e) qv[e] = load_elem(c.dt, P.qh.data(), row + e);
        double mx = -INFINITY;
        for (int t = 0; t < n; ++t) {
          double dot = 0;
          for (int e = 0; e < D; ++e) dot += qv[e] * kd[size_t(t) * D + e];
          dot *= c.scale;
          if (c.cap > 0) dot = c.cap * std::tanh(dot / c.cap);
          s[t] = dot;
          mx = std::fmax(mx, dot);
        }
        double sum = 0;
        for (int t = 0; t < n; ++t) sum += (s[t] = std::exp(s[t] - mx));
        for (int t = 0; t < n; ++t)
          for (int e = 0; e < D; ++e) ref[row + e] += s[t] / sum * vd[size_t(t) * D + e];
      }
    }
  }
  return ref;
}

// The params of a problem as jaxattn/native.py builds them: the prefix target of
// jaxattn.backend.cascade_grid unless the case fixes one, and its max splits.
CascadeParams params_of(const Case& c, int B, int G, int wp, int w, int page, int rows,
                        int blocks_per_sm, int sms) {
  CascadeParams p;
  p.batch = B;
  p.num_q_heads = c.hq;
  p.num_prefixes = G;
  p.prefix_table_stride = wp;
  p.block_table_stride = w;
  p.partition_size = c.part;
  p.own_parts = c.part > 0 ? std::max(1, (w * page + c.part - 1) / c.part) : 1;
  const int slots = blocks_per_sm * sms, own_blocks = B * c.hkv * p.own_parts;
  p.prefix_target = c.target > 0 ? c.target : std::max({1, slots / 2, slots - own_blocks});
  const int tiles = cascade_tiles(B, G, std::max(1, rows / (c.hq / c.hkv)));
  const int per_head = cascade_blocks_per_head(tiles, p.prefix_target, c.hkv);
  p.prefix_parts = std::max(
      1, std::min((wp * page + kCascadeMinChunk - 1) / kCascadeMinChunk, std::max(per_head, 1)));
  p.ls = make_logit_scale(c.scale, c.cap);
  p.prefix_kernel = c.prefix_kernel;
  return p;
}

bool run_problem(const Problem& P, const std::string& label) {
  const Case& c = P.c;
  const size_t es = dt_size(c.dt), q_elems = P.q_elems();
  const std::vector<double> ref = reference(P);
  int rows = 0, blocks = 0;
  tile_of(c.dt, c.d, &rows, &blocks);
  CascadeParams p = params_of(c, P.B, P.G, P.wp, P.w, c.page, rows, blocks, num_sms());
  p.kv = P.g;
  const size_t ws_floats = size_t(cascade_workspace_floats(P.B, c.hq, p.parts(), c.d));
  void* dq = dev_alloc(P.qh.size());
  void* dkc = dev_alloc(P.kc.size());
  void* dvc = dev_alloc(P.vc.size());
  void* dout = dev_alloc(q_elems * es);
  auto ints = [](const std::vector<int32_t>& h) {
    void* d = dev_alloc(h.size() * 4);
    to_dev(d, h.data(), h.size() * 4);
    return static_cast<int32_t*>(d);
  };
  int32_t *dptab = ints(P.ptab), *dplens = ints(P.plens), *dpof = ints(P.pof);
  int32_t *dtab = ints(P.tab), *dlens = ints(P.lens);
  float* dws = static_cast<float*>(dev_alloc(ws_floats * 4));
  float* dks = nullptr;
  float* dvs = nullptr;
  if (!P.kscale.empty()) {
    dks = static_cast<float*>(dev_alloc(P.kscale.size() * 4));
    dvs = static_cast<float*>(dev_alloc(P.vscale.size() * 4));
    to_dev(dks, P.kscale.data(), P.kscale.size() * 4);
    to_dev(dvs, P.vscale.data(), P.vscale.size() * 4);
  }
  p.scales.k = dks;
  p.scales.v = dvs;
  to_dev(dq, P.qh.data(), P.qh.size());
  to_dev(dkc, P.kc.data(), P.kc.size());
  to_dev(dvc, P.vc.data(), P.vc.size());
  dev_fill_ones(dout, q_elems * es);  // NaN in every dtype
  dev_fill_ones(dws, ws_floats * 4);
  p.q = dq;
  p.k = dkc;
  p.v = dvc;
  p.prefix_tables = dptab;
  p.prefix_lens = dplens;
  p.prefix_of = dpof;
  p.block_tables = dtab;
  p.seq_lens = dlens;
  p.out = dout;
  p.workspace = dws;
  const char* err = launch(c.dt, p);
  const char* sync = sync_error();
  std::vector<unsigned char> oh(q_elems * es);
  if (sync == nullptr) from_dev(oh.data(), dout, oh.size());
  for (void* ptr : {dq, dkc, dvc, dout, static_cast<void*>(dptab), static_cast<void*>(dplens),
                    static_cast<void*>(dpof), static_cast<void*>(dtab), static_cast<void*>(dlens),
                    static_cast<void*>(dws)})
    dev_free(ptr);
  if (dks != nullptr) {
    dev_free(dks);
    dev_free(dvs);
  }
  if (err || sync) {
    std::printf("FAIL  %s%s: launch: %s / %s\n", label.c_str(), describe(c).c_str(),
                err ? err : "ok", sync ? sync : "ok");
    if (sync) std::exit(3);  // the context is gone
    return false;
  }
  const double atol = c.dt == DT::kF32 ? 1e-4 : (c.dt == DT::kBF16 ? 2e-2 : 5e-3);
  double max_abs = 0, worst = 0;
  size_t nans = 0, mismatched = 0;
  for (size_t i = 0; i < q_elems; ++i) {
    const double o = load_elem(c.dt, oh.data(), i), r = ref[i];
    nans += std::isnan(o);
    if (std::isnan(r)) {
      mismatched += !std::isnan(o);
    } else if (std::isinf(r)) {
      mismatched += std::isfinite(o);
    } else if (r == 0.0) {
      mismatched += o != 0.0;
    } else if (!std::isfinite(o)) {
      ++mismatched;
    } else {
      max_abs = std::max(max_abs, std::fabs(o - r));
      worst = std::max(worst, std::fabs(o - r) / (atol + atol * std::fabs(r)));
    }
  }
  const bool ok = mismatched == 0 && worst <= 1.0;
  std::printf("%s  %s%s  max_abs=%.2e tol_ratio=%.3f NaN=%zu mismatched=%zu\n",
              ok ? "PASS" : "FAIL", label.c_str(), describe(c).c_str(), max_abs, worst, nans,
              mismatched);
  return ok;
}

bool run_case(const Case& c, Rng& rng) { return run_problem(make_problem(c, rng), ""); }

// Batches: (prefix pages, prefix_of, own tokens).
struct Batch {
  std::vector<int> prefix_pages, prefix_of, own;
};

std::vector<Batch> batches(int page) {
  auto pages = [&](int tokens) { return std::max(1, tokens / page); };
  std::vector<Batch> out;
  // Mixed: shared prefixes, an empty one, requests without a prefix, empty own parts.
  out.push_back({{pages(80), 0, pages(48)},
                 {0, -1, 2, 0, 1, 0, -1, 2, 0},
                 {1, 17, 0, 33, 255, 3, 0, 64, 513}});
  // 70 requests on one prefix: several tiles of 64 rows at every group.
  Batch shared{{pages(300)}, {}, {}};
  for (int b = 0; b < 70; ++b) {
    shared.prefix_of.push_back(0);
    shared.own.push_back((b * 37) % 97);
  }
  out.push_back(shared);
  // No sharing, and a prefix table padded with prefixes nobody continues.
  out.push_back({{pages(64), pages(32), pages(128), pages(16), pages(96)}, {2, 0, 4}, {3, 130, 0}});
  return out;
}

int run_robustness(Rng& rng) {
  struct Edit {
    const char* name;
    void (*apply)(Problem&);
  };
  // The mixed batch below: prefixes 0 (5 pages), 1 (empty), 2 (3 pages); request r continues
  // prefix_of[r].
  const Edit edits[] = {
      {"valid", [](Problem&) {}},
      {"prefix 0 page = num_pages", [](Problem& P) { P.ptab[4] = P.num_pages; }},
      {"prefix 2 page = 10^6", [](Problem& P) { P.ptab[2 * size_t(P.wp)] = 1000000; }},
      {"prefix 0 page = -1", [](Problem& P) { P.ptab[0] = -1; }},
      {"prefix 2 page = INT_MIN", [](Problem& P) { P.ptab[2 * size_t(P.wp) + 2] = INT32_MIN; }},
      {"prefix 0 length not whole pages", [](Problem& P) { P.plens[0] -= 1; }},
      {"prefix 2 length past its table", [](Problem& P) { P.plens[2] = (P.wp + 1) * P.c.page; }},
      {"prefix 0 length negative", [](Problem& P) { P.plens[0] = -P.c.page; }},
      {"prefix_of[4] = G", [](Problem& P) { P.pof[4] = P.G; }},
      {"prefix_of[0] = -2", [](Problem& P) { P.pof[0] = -2; }},
      {"prefix_of[3] = INT_MAX", [](Problem& P) { P.pof[3] = INT32_MAX; }},
      {"own page = -1 (request 4)", [](Problem& P) { P.tab[4 * size_t(P.w)] = -1; }},
      {"own page = num_pages (request 8)",
       [](Problem& P) { P.tab[8 * size_t(P.w) + 1] = P.num_pages; }},
      {"own length past its table (request 1)", [](Problem& P) { P.lens[1] = P.w * P.c.page + 1; }},
      {"own length negative (request 5)", [](Problem& P) { P.lens[5] = -1; }},
      {"garbage past every length (never read)",
       [](Problem& P) {
         for (int g = 0; g < P.G; ++g)
           for (int j = P.plens[g] / P.c.page; j < P.wp; ++j) P.ptab[size_t(g) * P.wp + j] = -7;
         for (int b = 0; b < P.B; ++b)
           for (int j = (P.lens[b] + P.c.page - 1) / P.c.page; j < P.w; ++j)
             P.tab[size_t(b) * P.w + j] = 1000000 + j;
       }},
      {"unused prefix 1 with garbage metadata",
       [](Problem& P) {
         for (auto& g : P.pof)
           if (g == 1) g = -1;
         P.plens[1] = -5;
         for (int j = 0; j < P.wp; ++j) P.ptab[size_t(P.wp) + j] = INT32_MIN;
       }},
      {"NaN in q (request 3, head 1)",
       [](Problem& P) { store_nan(P.c.dt, P.qh.data(), (size_t(3) * P.c.hq + 1) * P.c.d + 5); }},
      {"NaN in a prefix key (prefix 0, token 70, KV head 1)",
       [](Problem& P) { store_nan(P.c.dt, P.kc.data(), P.key(0, 70, 1, 3)); }},
      {"NaN in a prefix value (prefix 2, token 5, KV head 0)",
       [](Problem& P) { store_nan(P.c.dt, P.vc.data(), P.key(2, 5, 0, 6)); }},
      {"NaN in an own value (request 4, whose prefix is empty: own token 200)",
       [](Problem& P) { store_nan(P.c.dt, P.vc.data(), P.key(4, 200, 1, 9)); }},
      {"empty cache (num_pages = 0)",
       [](Problem& P) {
         P.num_pages = P.g.num_pages = 0;
         P.kc.clear();
         P.vc.clear();
       }},
  };
  struct Variant {
    DT dt;
    int hq, hkv;
    const char* kernel;
    int prefix_kernel;
  };
  const Variant variants[] = {
      {DT::kBF16, 8, 2, "mma", 1},   {DT::kF16, 8, 8, "mma", 1},   {DT::kBF16, 16, 2, "mma", 1},
      {DT::kBF16, 8, 2, "wgmma", 2}, {DT::kF16, 8, 8, "wgmma", 2}, {DT::kBF16, 16, 2, "wgmma", 2},
      {DT::kF32, 8, 2, "simt", 0},   {DT::kF32, 4, 4, "simt", 0},
  };
  int failed = 0, total = 0;
  for (const Variant& v : variants) {
    if (v.prefix_kernel == 2 && !wgmma_available()) {
      std::printf(
          "SKIP  [wgmma] robustness: no sm_90a build or not a compute capability 9.0 device\n");
      continue;
    }
    for (int part : {0, 64})
      for (const Edit& e : edits) {
        Case c;
        c.dt = v.dt;
        c.prefix_kernel = v.prefix_kernel;
        c.hq = v.hq;
        c.hkv = v.hkv;
        c.d = 64;
        c.page = 16;
        c.part = part;
        c.target = 40;
        c.prefix_pages = {5, 0, 3};
        c.prefix_of = {0, -1, 2, 0, 1, 0, -1, 2, 0};
        c.own = {1, 17, 0, 33, 255, 3, 0, 64, 40};
        Problem P = make_problem(c, rng);
        e.apply(P);
        ++total;
        failed += run_problem(P, std::string("[") + v.kernel + "] " + e.name + ": ") ? 0 : 1;
      }
  }
  Case empty;  // no requests at all: nothing to launch, nothing to write
  empty.prefix_pages = {2};
  ++total;
  failed += run_problem(make_problem(empty, rng), "[empty batch] ") ? 0 : 1;
  std::printf("robustness: %d cases, %d failed\n", total, failed);
  return failed;
}

int run_checks() {
  Rng rng(1234);
  std::vector<Case> cases;
  for (DT dt : {DT::kBF16, DT::kF16, DT::kF32})
    for (int d : {64, 128})
      for (int group : {1, 4, 8})
        for (int page : {1, 16, 128})
          for (const Batch& bt : batches(page)) {
            Case c;
            c.dt = dt;
            c.d = d;
            c.hkv = 2;
            c.hq = 2 * group;
            c.page = page;
            c.layout = page == 16 ? Layout::kBHSD : Layout::kBSHD;
            c.part = page == 1 ? 64 : 0;
            c.target = group == 4 ? 200 : 0;
            c.prefix_pages = bt.prefix_pages;
            c.prefix_of = bt.prefix_of;
            c.own = bt.own;
            cases.push_back(c);
          }
  // Other head dims (SIMT everywhere), odd groups, soft cap, one block per prefix.
  for (DT dt : {DT::kBF16, DT::kF32})
    for (int d : {32, 256})
      for (const Batch& bt : batches(16)) {
        Case c;
        c.dt = dt;
        c.d = d;
        c.hq = 12;
        c.hkv = 4;  // group 3
        c.page = 16;
        c.part = 128;
        c.cap = 4.f;
        c.scale = 0.5f;
        c.target = 1;
        c.prefix_pages = bt.prefix_pages;
        c.prefix_of = bt.prefix_of;
        c.own = bt.own;
        cases.push_back(c);
      }
  // Per-KV-head scales (a scaled 16-bit / f32 cache): both kernels, both levels, split or not.
  for (DT dt : {DT::kBF16, DT::kF16, DT::kF32})
    for (int d : {64, 128})
      for (int part : {0, 64}) {
        const Batch bt = batches(16)[0];
        Case c;
        c.dt = dt;
        c.d = d;
        c.hq = 16;
        c.hkv = 4;
        c.part = part;
        c.scaled = true;
        c.prefix_pages = bt.prefix_pages;
        c.prefix_of = bt.prefix_of;
        c.own = bt.own;
        cases.push_back(c);
      }
  // The issue's shape, scaled: 64 requests on a 4096-token prefix, 256 own tokens each.
  for (DT dt : {DT::kBF16, DT::kF16}) {
    Case c;
    c.dt = dt;
    c.hq = 32;
    c.hkv = 8;
    c.scale = 0.0884f;
    c.prefix_pages = {256};
    c.prefix_of.assign(64, 0);
    c.own.assign(64, 256);
    cases.push_back(c);
  }
  // The tensor-core cases once on each prefix level where both run (auto picks wgmma there).
  if (wgmma_available()) {
    const size_t n = cases.size();
    for (size_t i = 0; i < n; ++i)
      if (cases[i].dt != DT::kF32 && (cases[i].d == 64 || cases[i].d == 128)) {
        cases[i].prefix_kernel = 2;
        Case c = cases[i];
        c.prefix_kernel = 1;
        cases.push_back(c);
      }
  }
  int failed = 0;
  for (const Case& c : cases) failed += run_case(c, rng) ? 0 : 1;
  std::printf("correctness: %zu cases, %d failed\n", cases.size(), failed);
  return failed + run_robustness(rng);
}

#if !defined(CASCADE_SELFTEST_ON_CPU)
// ------------------------------------------------------------------------------------------
// Timing.
// ------------------------------------------------------------------------------------------

__global__ void fill_random_bf16(uint16_t* x, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint64_t z = (i + seed) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    x[i] = float_to_bf16(float(z >> 40) * (1.f / 16777216.f) * 2.f - 1.f);
  }
}

// A read-only pass (16-byte loads XORed into one word a thread): the read ceiling.
__global__ void read_all(const uint4* x, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldg(x + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) *sink = acc;  // keeps the loads
}

template <typename F>
double median_us(F&& call, int reps = 10, int samples = 20) {
  cudaEvent_t e0, e1;
  CUDA_OK(cudaEventCreate(&e0));
  CUDA_OK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) call();
  std::vector<float> us;
  for (int s = 0; s < samples; ++s) {
    CUDA_OK(cudaEventRecord(e0));
    for (int i = 0; i < reps; ++i) call();
    CUDA_OK(cudaEventRecord(e1));
    CUDA_OK(cudaEventSynchronize(e1));
    float ms;
    CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
    us.push_back(ms * 1000.f / reps);
  }
  CUDA_OK(cudaGetLastError());
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

double read_ceiling_gbs() {
  const size_t bytes = size_t(1) << 30;
  uint4* x;
  uint32_t* sink;
  CUDA_OK(cudaMalloc(&x, bytes));
  CUDA_OK(cudaMalloc(&sink, 4));
  CUDA_OK(cudaMemset(x, 1, bytes));
  const double us =
      median_us([&] { read_all<<<num_sms() * 8, 512>>>(x, bytes / 16, sink); }, 5, 10);
  cudaFree(x);
  cudaFree(sink);
  return bytes / (us * 1e-6) / 1e9;
}

// jaxattn/native.py's split for plain decode (choose_partition_size without an override), with
// the resident blocks of the decode kernel it would run.
int decode_partition(int batch, int hkv, int group, int64_t capacity) {
  int blocks = 0;
  if (const char* e = gpu::decode_occupancy_typed<bf16_t>(128, group, &blocks)) {
    std::fprintf(stderr, "decode occupancy: %s\n", e);
    std::exit(2);
  }
  const int sms = num_sms();
  int split = group > 15 ? 256 : 512;
  if (capacity <= split || int64_t(batch) * hkv >= 3LL * sms) return 0;
  const double want = 0.9 * blocks * sms;
  auto count = [&](int64_t s) { return double(batch) * hkv * ((capacity + s - 1) / s); };
  while (2LL * split < capacity && count(2LL * split) >= want) split *= 2;
  while (split > 128 && count(split) < want) split /= 2;
  return split;
}

// One timing batch (bf16, D=128, page 16, bshd, 32/8): `copies` independent pools and tables,
// used in rotation.
struct Bench {
  static constexpr int D = 128, P = 16, HQ = 32, HKV = 8;
  std::vector<int> prefix_tokens, prefix_of, own;
  int B = 0, G = 0, wp = 0, w = 0, wj = 0, copies = 1, pages_per_copy = 0;
  void *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr;
  float* ws = nullptr;
  size_t ws_floats = 0;
  int32_t *plens = nullptr, *pof = nullptr, *lens = nullptr, *jlens = nullptr;
  std::vector<int32_t*> ptabs, tabs, jtabs;

  double row_bytes() const { return 2.0 * HKV * D * 2; }  // K and V of one token
  double unique_bytes() const {  // each used prefix once, every own token once
    double t = 0;
    std::vector<bool> used(G, false);
    for (int b = 0; b < B; ++b) {
      t += own[b];
      if (prefix_of[b] >= 0 && !used[prefix_of[b]]) {
        used[prefix_of[b]] = true;
        t += prefix_tokens[prefix_of[b]];
      }
    }
    return t * row_bytes();
  }
  double joined_bytes() const {
    double t = 0;
    for (int b = 0; b < B; ++b) t += own[b] + (prefix_of[b] >= 0 ? prefix_tokens[prefix_of[b]] : 0);
    return t * row_bytes();
  }

  void setup(Rng& rng) {
    B = int(own.size());
    G = int(prefix_tokens.size());
    int pref_pages = 0;
    for (int n : prefix_tokens) {
      pref_pages += n / P;
      wp = std::max(wp, n / P);
    }
    int own_pages = 0;
    for (int n : own) {
      own_pages += (n + P - 1) / P;
      w = std::max(w, (n + P - 1) / P);
    }
    wp = std::max(wp, 1);
    w = std::max(w, 1);
    wj = wp + w;
    pages_per_copy = pref_pages + own_pages;
    copies = std::max(1, int(std::ceil(240e6 / (pages_per_copy * P * row_bytes()))));
    const size_t elems = size_t(copies) * pages_per_copy * P * HKV * D;
    CUDA_OK(cudaMalloc(&k, elems * 2));
    CUDA_OK(cudaMalloc(&v, elems * 2));
    fill_random_bf16<<<1024, 256>>>(static_cast<uint16_t*>(k), elems, 1);
    fill_random_bf16<<<1024, 256>>>(static_cast<uint16_t*>(v), elems, 1ull << 40);
    const size_t qe = size_t(B) * HQ * D;
    CUDA_OK(cudaMalloc(&q, qe * 2));
    CUDA_OK(cudaMalloc(&out, qe * 2));
    fill_random_bf16<<<64, 256>>>(static_cast<uint16_t*>(q), qe, 7);
    std::vector<int32_t> pl, jl(B);
    for (int n : prefix_tokens) pl.push_back(n);
    for (int b = 0; b < B; ++b)
      jl[b] = own[b] + (prefix_of[b] >= 0 ? prefix_tokens[prefix_of[b]] : 0);
    auto upload = [](const std::vector<int32_t>& h) {
      int32_t* d;
      CUDA_OK(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * 4));
      if (!h.empty()) CUDA_OK(cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
      return d;
    };
    plens = upload(pl);
    pof = upload(prefix_of);
    lens = upload(own);
    jlens = upload(jl);
    for (int c = 0; c < copies; ++c) {
      std::vector<int32_t> perm(pages_per_copy);
      for (int i = 0; i < pages_per_copy; ++i) perm[i] = c * pages_per_copy + i;
      std::shuffle(perm.begin(), perm.end(), rng);
      std::vector<int32_t> pt(size_t(G) * wp, 0), t(size_t(B) * w, 0), jt(size_t(B) * wj, 0);
      int at = 0;
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < prefix_tokens[g] / P; ++j) pt[size_t(g) * wp + j] = perm[at++];
      for (int b = 0; b < B; ++b) {
        int j = 0;
        if (prefix_of[b] >= 0)
          for (; j < prefix_tokens[prefix_of[b]] / P; ++j)
            jt[size_t(b) * wj + j] = pt[size_t(prefix_of[b]) * wp + j];
        for (int i = 0; i < (own[b] + P - 1) / P; ++i, ++j) {
          t[size_t(b) * w + i] = perm[at++];
          jt[size_t(b) * wj + j] = t[size_t(b) * w + i];
        }
      }
      ptabs.push_back(upload(pt));
      tabs.push_back(upload(t));
      jtabs.push_back(upload(jt));
    }
    ws_floats = size_t(decode_workspace_floats(B, HQ, (int64_t(wj) * P + 127) / 128, D));
    ws_floats = std::max(ws_floats, size_t(cascade_workspace_floats(B, HQ, 64 + 64, D)));
    CUDA_OK(cudaMalloc(&ws, ws_floats * 4));
    CUDA_OK(cudaDeviceSynchronize());
  }

  void teardown() {
    for (void* p : {q, k, v, out, static_cast<void*>(ws), static_cast<void*>(plens),
                    static_cast<void*>(pof), static_cast<void*>(lens), static_cast<void*>(jlens)})
      cudaFree(p);
    for (auto* vec : {&ptabs, &tabs, &jtabs})
      for (int32_t* t : *vec) cudaFree(t);
  }

  KvGeometry geometry() const {
    return make_geometry(Layout::kBSHD, int64_t(copies) * pages_per_copy, P, HKV, D);
  }

  // The launch's arguments at a prefix target (0: jaxattn/native.py's), over copy 0's tables;
  // false when the workspace is too small for its partitions.
  bool cascade_params(int target, int part, int prefix_kernel, CascadeParams* out_p) const {
    int rows = 0, blocks = 0;
    tile_of(DT::kBF16, D, &rows, &blocks);
    Case c;
    c.hq = HQ;
    c.hkv = HKV;
    c.part = part;
    c.target = target;
    c.scale = 0.0883883f;
    c.prefix_kernel = prefix_kernel;
    CascadeParams p = params_of(c, B, G, wp, w, P, rows, blocks, num_sms());
    p.kv = geometry();
    p.q = q;
    p.k = k;
    p.v = v;
    p.prefix_lens = plens;
    p.prefix_of = pof;
    p.seq_lens = lens;
    p.out = out;
    p.workspace = ws;
    p.prefix_tables = ptabs[0];
    p.block_tables = tabs[0];
    *out_p = p;
    return cascade_workspace_floats(B, HQ, p.parts(), D) <= int64_t(ws_floats);
  }

  // One launch over copy `copy % copies`'s tables.
  void launch_cascade(CascadeParams p, int copy) const {
    p.prefix_tables = ptabs[copy % copies];
    p.block_tables = tabs[copy % copies];
    if (const char* e = gpu::launch_cascade_typed<bf16_t>(p, 0)) {
      std::fprintf(stderr, "cascade launch: %s\n", e);
      std::exit(2);
    }
  }

  double time_cascade(int target, int part, int prefix_kernel, int* used_target) const {
    CascadeParams p;
    const bool fits = cascade_params(target, part, prefix_kernel, &p);
    *used_target = p.prefix_target;
    if (!fits) return NAN;
    int copy = 0;
    return median_us([&] { launch_cascade(p, copy++); });
  }

  double time_decode() const {
    DecodeParams p;
    p.q = q;
    p.k = k;
    p.v = v;
    p.seq_lens = jlens;
    p.out = out;
    p.workspace = ws;
    p.batch = B;
    p.num_q_heads = HQ;
    p.block_table_stride = wj;
    p.partition_size = decode_partition(B, HKV, HQ / HKV, int64_t(wj) * P);
    p.max_parts =
        p.partition_size ? int((int64_t(wj) * P + p.partition_size - 1) / p.partition_size) : 1;
    p.kv = geometry();
    p.ls = make_logit_scale(0.0883883f, 0.f);
    int copy = 0;
    return median_us([&] {
      p.block_tables = jtabs[copy++ % copies];
      if (const char* e = gpu::launch_paged_decode_typed<bf16_t>(p, 0)) {
        std::fprintf(stderr, "decode launch: %s\n", e);
        std::exit(2);
      }
    });
  }
};

void print_kernel_info() {
  cudaFuncAttributes a;
  int blocks = 0;
  using S = gpu::CascadeMmaShape<bf16_t, 128>;
  CUDA_OK(cudaFuncSetAttribute(gpu::cascade_mma_kernel<bf16_t, 128>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes));
  CUDA_OK(cudaFuncGetAttributes(&a, gpu::cascade_mma_kernel<bf16_t, 128>));
  CUDA_OK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &blocks, gpu::cascade_mma_kernel<bf16_t, 128>, S::kThreads, S::kSmemBytes));
  std::printf(
      "cascade mma kernel bf16 D=128: %d registers, %d stages x %d keys, %d B smem, %d "
      "blocks/SM\n",
      a.numRegs, S::kStages, S::kTile, S::kSmemBytes, blocks);
#if defined(JAXATTN_HAVE_SM90A)
  if (wgmma_available()) {
    auto wk = gpu::cascade_mma_kernel<bf16_t, 128, true>;
    CUDA_OK(cudaFuncSetAttribute(wk, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes));
    CUDA_OK(cudaFuncGetAttributes(&a, wk));
    CUDA_OK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, wk, S::kThreads, S::kSmemBytes));
    std::printf(
        "cascade kernel, wgmma prefix level: %d registers, %d prefix stages, %d blocks/SM\n",
        a.numRegs, gpu::CascadeWgmmaShape<bf16_t, 128>::kStages, blocks);
  }
#endif
}

void run_perf() {
  cudaDeviceProp prop;
  int dev = 0;
  CUDA_OK(cudaGetDevice(&dev));
  CUDA_OK(cudaGetDeviceProperties(&prop, dev));
  std::printf("\ndevice: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20);
  print_kernel_info();
  const double ceiling = read_ceiling_gbs();
  std::printf("read ceiling: %.0f GB/s\n\n", ceiling);
  std::printf(
      "bf16, D=128, page 16, bshd, 32/8. floor = prefix once + own tokens once at the read "
      "ceiling.\n");
  std::printf("%-9s %-7s %-6s %8s %10s %10s %8s %8s\n", "batch", "target", "prefix", "floor",
              "cascade", "decode", "speedup", "x floor");
  Rng rng(99);
  struct Named {
    const char* name;
    std::vector<int> prefix_tokens, prefix_of, own;
  };
  std::vector<Named> shapes;
  shapes.push_back({"issue", {4096}, std::vector<int>(64, 0), std::vector<int>(64, 256)});
  {
    Named m{"mixed", {4096, 2048, 1024}, {}, {}};
    for (int b = 0; b < 64; ++b) {
      m.prefix_of.push_back(b % 8 == 7 ? -1 : b % 3);
      m.own.push_back(64 + (b * 53) % 448);
    }
    shapes.push_back(m);
  }
  {
    Named s{"no-share", {}, {}, {}};
    for (int b = 0; b < 64; ++b) {
      s.prefix_tokens.push_back(4096);
      s.prefix_of.push_back(b);
      s.own.push_back(256);
    }
    shapes.push_back(s);
  }
  // The issue's batch with one level left (the other a token a request, or no prefix): where
  // the whole batch's time goes.
  shapes.push_back({"prefix", {4096}, std::vector<int>(64, 0), std::vector<int>(64, 1)});
  shapes.push_back({"own", {4096}, std::vector<int>(64, -1), std::vector<int>(64, 256)});
  for (const Named& sh : shapes) {
    const bool one_level = sh.name == std::string("prefix") || sh.name == std::string("own");
    Bench bench;
    bench.prefix_tokens = sh.prefix_tokens;
    bench.prefix_of = sh.prefix_of;
    bench.own = sh.own;
    bench.setup(rng);
    const double floor_us = bench.unique_bytes() / (ceiling * 1e9) * 1e6;
    const double dec = bench.time_decode();
    std::printf(
        "%s: %.1f MB of K/V to read once, %.1f MB through the joined tables (decode "
        "%.0f GB/s)\n",
        sh.name, bench.unique_bytes() / 1e6, bench.joined_bytes() / 1e6,
        bench.joined_bytes() / (dec * 1e-6) / 1e9);
    for (int target : {0, 64, 132, 264, 528})
      for (int kernel : {1, 2}) {
        if (one_level && target != 0) continue;
        if (kernel == 2 && !wgmma_available()) continue;
        int used = 0;
        const double us = bench.time_cascade(target, 0, kernel, &used);
        std::printf("%-9s %-7s %-6s %8.1f %10.1f %10.1f %7.2fx %7.2fx\n", sh.name,
                    (std::to_string(used) + (target == 0 ? "*" : "")).c_str(),
                    kernel == 1 ? "mma" : "wgmma", floor_us, us, dec, dec / us, us / floor_us);
      }
    bench.teardown();
  }
  std::printf(
      "(* = the prefix target jaxattn/native.py picks; decode: plain paged decode of the "
      "joined tables at its own split)\n");
}

// The issue's batch, or its prefix ("prefix": an own token a request) or own level ("own": no
// prefix) alone, set up.
void setup_issue_batch(const std::string& which, Bench& bench) {
  Rng rng(99);
  bench.prefix_tokens = {4096};
  bench.prefix_of.assign(64, which == "own" ? -1 : 0);
  bench.own.assign(64, which == "prefix" ? 1 : 256);
  bench.setup(rng);
}

// The timing of the issue's batch ("issue"), or of its prefix or own level alone, with one prefix
// kernel, for a profiler: its first launches are warm-ups (ncu --launch-skip 2 --launch-count 1
// profiles one after them).
void run_profile(int kernel, const std::string& which) {
  Bench bench;
  setup_issue_batch(which, bench);
  int used = 0;
  std::printf("%s, prefix kernel %d: %.1f us\n", which.c_str(), kernel,
              bench.time_cascade(0, 0, kernel, &used));
  bench.teardown();
}

#if defined(JAXATTN_CASCADE_TRACE)
// Block timelines of one launch (the kernel built with -DJAXATTN_CASCADE_TRACE: see the stamps
// in jaxattn/cascade.cuh) of the issue's batch or one of its levels, as run_profile times it:
// per kind of step-1 block, the stamps' spread (us from the launch's first block start) and each
// phase's length, then the merge's blocks against step 1's last write.
void run_trace(int kernel, const std::string& which) {
  Bench bench;
  setup_issue_batch(which, bench);
  CascadeParams p;
  if (!bench.cascade_params(0, 0, kernel, &p)) {
    std::fprintf(stderr, "workspace too small\n");
    std::exit(2);
  }
  int used = 0;
  std::printf("%s, prefix kernel %d, target %d: untraced %.1f us\n", which.c_str(), kernel,
              p.prefix_target, bench.time_cascade(0, 0, kernel, &used));
  constexpr int kMaxBlocks = 1 << 16;
  unsigned long long *tr, *mt;
  CUDA_OK(cudaMalloc(&tr, size_t(kMaxBlocks) * 16 * 8));
  CUDA_OK(cudaMalloc(&mt, size_t(kMaxBlocks) * 4 * 8));
  CUDA_OK(cudaMemcpyToSymbol(gpu::g_cascade_trace, &tr, sizeof(tr)));
  CUDA_OK(cudaMemcpyToSymbol(gpu::g_cascade_merge_trace, &mt, sizeof(mt)));
  for (int rep = 0; rep < 3; ++rep) bench.launch_cascade(p, rep);
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaMemset(tr, 0, size_t(kMaxBlocks) * 16 * 8));
  CUDA_OK(cudaMemset(mt, 0, size_t(kMaxBlocks) * 4 * 8));
  bench.launch_cascade(p, 3);
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<unsigned long long> h(size_t(kMaxBlocks) * 16), hm(size_t(kMaxBlocks) * 4);
  CUDA_OK(cudaMemcpy(h.data(), tr, h.size() * 8, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(hm.data(), mt, hm.size() * 8, cudaMemcpyDeviceToHost));
  unsigned long long nullp = 0;
  CUDA_OK(cudaMemcpyToSymbol(gpu::g_cascade_trace, &nullp, sizeof(nullp)));
  CUDA_OK(cudaMemcpyToSymbol(gpu::g_cascade_merge_trace, &nullp, sizeof(nullp)));
  cudaFree(tr);
  cudaFree(mt);
  bench.teardown();

  unsigned long long t0 = ~0ull, t1 = 0;
  for (int b = 0; b < kMaxBlocks; ++b)
    if (h[b * 16]) {
      t0 = std::min(t0, h[b * 16]);
      t1 = std::max(t1, h[b * 16 + 12]);
    }
  if (t0 == ~0ull) {
    std::fprintf(stderr, "no stamps: was the kernel built with -DJAXATTN_CASCADE_TRACE?\n");
    std::exit(2);
  }
  auto us = [&](unsigned long long t) { return (double(t) - double(t0)) * 1e-3; };
  auto spread = [](const char* name, std::vector<double> v) {
    if (v.empty()) return;
    std::sort(v.begin(), v.end());
    std::printf("  %-12s n=%4zu  min %6.2f  p10 %6.2f  p50 %6.2f  p90 %6.2f  max %6.2f us\n", name,
                v.size(), v.front(), v[v.size() / 10], v[v.size() / 2], v[v.size() * 9 / 10],
                v.back());
  };
  std::printf("step 1: span %.2f us (first block start to last states written)\n", us(t1));
  const char* names[13] = {"start", "range", "prologue", "tile0", "tile1",    "tile2",  "tile3",
                           "tile4", "tile5", "tile6",    "tile7", "loop end", "written"};
  for (int kind = 1; kind <= 2; ++kind) {
    std::vector<int> work, idle;
    for (int b = 0; b < kMaxBlocks; ++b)
      if (h[b * 16] && int(h[b * 16 + 14]) == kind) (h[b * 16 + 1] ? work : idle).push_back(b);
    if (work.empty() && idle.empty()) continue;
    std::printf("%s blocks: %zu with work, %zu without\n", kind == 1 ? "prefix" : "own",
                work.size(), idle.size());
    if (!idle.empty()) {
      std::vector<double> st, ex;
      for (int b : idle) {
        st.push_back(us(h[b * 16]));
        if (h[b * 16 + 12]) ex.push_back((double(h[b * 16 + 12]) - double(h[b * 16])) * 1e-3);
      }
      spread("idle start", st);
      spread("idle length", ex);
    }
    if (work.empty()) continue;
    std::vector<double> tiles;
    for (int b : work) tiles.push_back(double(h[b * 16 + 13]));
    spread("key tiles", tiles);
    for (int i = 0; i < 13; ++i) {
      std::vector<double> v;
      for (int b : work)
        if (h[b * 16 + i]) v.push_back(us(h[b * 16 + i]));
      spread(names[i], v);
    }
    // Per-block phase lengths: each stamp from the one before it that the block wrote, and a
    // tile's length over every tile of the first eight a block stamped.
    for (int i = 1; i < 13; ++i) {
      std::vector<double> v;
      for (int b : work) {
        int j = i - 1;
        while (j >= 0 && !h[b * 16 + j]) --j;
        if (h[b * 16 + i] && j >= 0)
          v.push_back((double(h[b * 16 + i]) - double(h[b * 16 + j])) * 1e-3);
      }
      spread((std::string("d ") + names[i]).c_str(), v);
    }
    std::vector<double> per_tile;
    for (int b : work)
      for (int i = 3; i < 10; ++i)
        if (h[b * 16 + i] && h[b * 16 + i + 1])
          per_tile.push_back((double(h[b * 16 + i + 1]) - double(h[b * 16 + i])) * 1e-3);
    spread("a tile", per_tile);
    // Blocks of this kind resident at a time: sampled every microsecond of the span.
    std::printf("  resident (all SMs) at t = 0, 2, 4, ... us:");
    for (double t = 0; t <= us(t1); t += 2) {
      int n = 0;
      for (int b : work)
        if (us(h[b * 16]) <= t && (h[b * 16 + 12] ? us(h[b * 16 + 12]) : us(t1)) > t) ++n;
      std::printf(" %d", n);
    }
    std::printf("\n");
  }
  std::vector<double> ms, mw, me;
  int mb = 0;
  for (int b = 0; b < kMaxBlocks; ++b)
    if (hm[b * 4]) {
      ++mb;
      ms.push_back(us(hm[b * 4]));
      if (hm[b * 4 + 1]) mw.push_back(us(hm[b * 4 + 1]));
      if (hm[b * 4 + 2]) me.push_back(us(hm[b * 4 + 2]));
    }
  std::printf("merge: %d blocks (us from step 1's first block start)\n", mb);
  spread("start", ms);
  spread("step 1 seen", mw);
  spread("written", me);
  if (!me.empty())
    std::printf("  call span %.2f us; the merge ends %.2f us after step 1's last write\n",
                *std::max_element(me.begin(), me.end()),
                *std::max_element(me.begin(), me.end()) - us(t1));
}
#endif  // JAXATTN_CASCADE_TRACE

#endif  // !CASCADE_SELFTEST_ON_CPU

}  // namespace

int main(int argc, char** argv) {
  bool check = true, perf = true, robust_only = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--check")) {
      perf = false;
    } else if (!std::strcmp(argv[i], "--perf")) {
      check = false;
    } else if (!std::strcmp(argv[i], "--robust")) {
      perf = false;
      robust_only = true;
#if !defined(CASCADE_SELFTEST_ON_CPU)
    } else if (!std::strcmp(argv[i], "--profile") && i + 2 < argc) {
      run_profile(std::atoi(argv[i + 1]), argv[i + 2]);
      return 0;
#endif
#if defined(JAXATTN_CASCADE_TRACE) && !defined(CASCADE_SELFTEST_ON_CPU)
    } else if (!std::strcmp(argv[i], "--trace") && i + 2 < argc) {
      run_trace(std::atoi(argv[i + 1]), argv[i + 2]);
      return 0;
#endif
    } else {
      std::fprintf(stderr,
                   "usage: %s [--check | --robust | --perf | --profile KERNEL "
                   "issue|prefix|own | --trace KERNEL issue|prefix|own]\n",
                   argv[0]);
      return 2;
    }
  }
  int failed = 0;
  if (check) {
    Rng rng(4321);
    failed = robust_only ? run_robustness(rng) : run_checks();
  }
#if defined(CASCADE_SELFTEST_ON_CPU)
  (void)perf;  // the timings need the GPU
#else
  if (perf) run_perf();
#endif
  if (check) std::printf("%s\n", failed ? "SELFTEST FAILED" : "SELFTEST PASSED");
  return failed ? 1 : 0;
}
