// Standalone GPU self-test and timing of the paged decode kernels (jaxattn/paged_decode.cuh),
// no Python or XLA needed:
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Iffi/include -Iffi/src ffi/tests_gpu/decode_selftest.cu -o /tmp/decode_selftest
//   /tmp/decode_selftest            # correctness and robustness cases, then timing
//   /tmp/decode_selftest --check    # correctness and robustness only   (--perf: timing only)
//   /tmp/decode_selftest --robust   # robustness only: small, for compute-sanitizer
//   /tmp/decode_selftest --perf-fp8 # the FP8 timing table only (and the bf16 time of each shape)
//   /tmp/decode_selftest --one e4m3 64 4096 0   # one shape (bf16|e4m3 B ctx partition), for ncu
//   (built with -DJAXATTN_BENCH_HEAD_DIM=64) the timing shapes at head_dim 64 instead of 128
//   (built with -DJAXATTN_DECODE_TRACE) --trace e4m3 1 32768 512: a tensor-core kernel's block
//   timelines (bf16 or e4m3 cache); with DECODE_TRACE_CSV=file also every block's stamps and SM
//   (python3 ffi/tests_gpu/decode_trace.py file reads them)
//   DECODE_COPIES=gathers|tma (environment): every launch with DecodeParams::copies gathers (the
//   tensor-core kernels never take their TMA form) or tma (they take it wherever it can serve,
//   the small grids of the correctness and robustness cases included); the default: auto
//
// Correctness: random paged caches (pages a random permutation, every unused page and every
// slot past a sequence's end NaN, block tables padded with entries that point at NaN pages),
// against a float64 CPU reference, for f32/bf16/f16, groups 1..64, head_dim 32..256, page
// sizes 1..128, both layouts, one pass and split partitions, with and without a soft cap.
// Outputs and the split workspace start as NaN, so anything unwritten shows. A case passes
// when |out - ref| <= atol + rtol |ref| everywhere (the tolerances of tests/helpers.py).
//
// Robustness (the index contract of jaxattn/guards.h and the NaN rules): page ids num_pages,
// 10^6, -1 and INT_MIN inside a sequence's pages, garbage past its length, lengths past the
// table and negative, NaN in q, in an attended K or V element, in unattended slots (every
// unused slot is NaN anyway), on every kernel variant, one pass and split. The reference
// applies the same contract: NaN rows for an invalid sequence, NaN where exact arithmetic
// puts it, exact values elsewhere, exact zeros for an empty sequence. Buffers are allocated
// at their exact sizes, so that a run under compute-sanitizer --tool memcheck reports any
// access outside them (ffi/gpu_check.sh: SANITIZE=1).
//
// FP8 caches (e4m3fn, e5m2) under a bf16 / f16 q: the same grid over every kernel variant (direct,
// tensor-core, SIMT), with per-head scales (the heads' data a few times apart in magnitude) and
// without; the robustness edits on each FP8 kernel; and every code of each format through one
// key whose softmax weight is 1 (the output is V itself, exactly: every widening checked).
//
// Timing: bf16, head_dim 128, page 16, bshd, Hq/Hkv 32/8 and 32/32; the K/V pool holds enough
// copies of each case's cache (separate pages, separate block tables, used in rotation) to
// exceed 240 MB, 4x the H200's L2. Median of 20 samples of 10 back-to-back calls (main kernel
// plus the combine when split), at the partition size jaxattn/native.py picks (marked *) and,
// for B <= 8, at 128..2048 as well. GB/s counts the K and V bytes the call must read (one byte
// an element for an FP8 cache: the e4m3 rows, against bf16 at the same shape). For
// comparison at 32/8: "simt" (the pipelined SIMT kernel, what f32 uses) and "old" (the direct
// register-load kernel, the previous default for 2..8 heads, with the current combine).
// Tuning knobs of the tensor-core kernel are compile-time: rebuild with
// -DJAXATTN_DECODE_MMA_STAGES=2|3|4 (or -DJAXATTN_DECODE_MMA_SMEM_KB=...) to compare; the FP8
// kernel alone with -DJAXATTN_DECODE_FP8_STAGES=2..5.
// Without a GPU, emulate_mma_decode.py (next to this file) checks the tensor-core kernel's
// fragment and pipeline indexing on the CPU.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "jaxattn/paged_decode.cuh"

using namespace jaxattn;

#include "cuda_ok.h"
#include "selftest_rng.h"

// DecodeParams::copies of every launch: DECODE_COPIES=gathers|tma in the environment, else auto.
int32_t selftest_copies() {
  static const int32_t copies = [] {
    const char* v = std::getenv("DECODE_COPIES");
    if (v != nullptr && std::strcmp(v, "gathers") == 0) return kDecodeCopiesGathers;
    if (v != nullptr && std::strcmp(v, "tma") == 0) return kDecodeCopiesTma;
    return kDecodeCopiesAuto;
  }();
  return copies;
}

namespace {

// Element types: q / output (f32, bf16, f16) and cache (those, or FP8).
enum class DT { kF32, kBF16, kF16, kE4M3, kE5M2 };
const char* dt_name(DT t) {
  switch (t) {
    case DT::kF32:
      return "f32";
    case DT::kBF16:
      return "bf16";
    case DT::kF16:
      return "f16";
    case DT::kE4M3:
      return "e4m3";
    case DT::kE5M2:
      return "e5m2";
  }
  return "?";
}
size_t dt_size(DT t) { return t == DT::kF32 ? 4 : (t == DT::kE4M3 || t == DT::kE5M2 ? 1 : 2); }
bool is_fp8(DT t) { return t == DT::kE4M3 || t == DT::kE5M2; }

// Rounds x to the dtype (host), returning the rounded value and writing its storage.
double store_elem(DT t, void* base, size_t i, float x) {
  switch (t) {
    case DT::kF32:
      static_cast<float*>(base)[i] = x;
      return x;
    case DT::kBF16: {
      const uint16_t b = float_to_bf16(x);
      static_cast<uint16_t*>(base)[i] = b;
      return bf16_to_float(b);
    }
    case DT::kF16: {
      const uint16_t h = float_to_f16(x);
      static_cast<uint16_t*>(base)[i] = h;
      return f16_to_float(h);
    }
    case DT::kE4M3: {
      const uint8_t b = float_to_e4m3(x);
      static_cast<uint8_t*>(base)[i] = b;
      return e4m3_to_float(b);
    }
    case DT::kE5M2: {
      const uint8_t b = float_to_e5m2(x);
      static_cast<uint8_t*>(base)[i] = b;
      return e5m2_to_float(b);
    }
  }
  return 0;
}

void store_nan(DT t, void* base, size_t i) {
  switch (t) {
    case DT::kF32:
      static_cast<float*>(base)[i] = std::nanf("");
      break;
    case DT::kBF16:
      static_cast<uint16_t*>(base)[i] = 0x7fc0u;
      break;
    case DT::kF16:
      static_cast<uint16_t*>(base)[i] = 0x7e00u;
      break;
    case DT::kE4M3:
      static_cast<uint8_t*>(base)[i] = 0x7fu;
      break;
    case DT::kE5M2:
      static_cast<uint8_t*>(base)[i] = 0x7eu;
      break;
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
    case DT::kE4M3:
      return e4m3_to_float(static_cast<const uint8_t*>(base)[i]);
    case DT::kE5M2:
      return e5m2_to_float(static_cast<const uint8_t*>(base)[i]);
  }
  return 0;
}

// The dispatcher for q dtype t and cache dtype kv (kv == t: a plain cache).
const char* launch(DT t, DT kv, const DecodeParams& p, cudaStream_t s) {
  if (kv == t) {
    switch (t) {
      case DT::kF32:
        return gpu::launch_paged_decode_typed<float>(p, s);
      case DT::kBF16:
        return gpu::launch_paged_decode_typed<bf16_t>(p, s);
      case DT::kF16:
        return gpu::launch_paged_decode_typed<f16_t>(p, s);
      default:
        return "bad dtype";
    }
  }
  if (t == DT::kBF16 && kv == DT::kE4M3)
    return gpu::launch_paged_decode_typed<bf16_t, e4m3_t>(p, s);
  if (t == DT::kBF16 && kv == DT::kE5M2)
    return gpu::launch_paged_decode_typed<bf16_t, e5m2_t>(p, s);
  if (t == DT::kF16 && kv == DT::kE4M3) return gpu::launch_paged_decode_typed<f16_t, e4m3_t>(p, s);
  if (t == DT::kF16 && kv == DT::kE5M2) return gpu::launch_paged_decode_typed<f16_t, e5m2_t>(p, s);
  return "bad dtype pair";
}

struct Case {
  DT dt = DT::kBF16;
  DT kv = DT::kBF16;    // the cache's: dt, or FP8
  bool scaled = false;  // per-head K / V scales (FP8 cases)
  std::vector<int> lens;
  int hq = 8, hkv = 2, d = 128, page = 16;
  Layout layout = Layout::kBSHD;
  int part = 0;
  float scale = 0.1f, cap = 0.f;
};

std::string describe(const Case& c) {
  char buf[320];
  std::string lens;
  for (size_t i = 0; i < c.lens.size(); ++i) lens += (i ? "," : "") + std::to_string(c.lens[i]);
  char cache[32] = "";
  if (c.kv != c.dt)
    std::snprintf(cache, sizeof(cache), "/%s%s", dt_name(c.kv), c.scaled ? "s" : "");
  std::snprintf(buf, sizeof(buf),
                "%-4s%-6s Hq/Hkv=%2d/%-2d D=%3d page=%3d %s part=%4d cap=%g lens=[%s]",
                dt_name(c.dt), cache, c.hq, c.hkv, c.d, c.page,
                c.layout == Layout::kBSHD ? "bshd" : "bhsd", c.part, c.cap, lens.c_str());
  return buf;
}

// One decode problem on the host: the cache storage, block tables, lengths and q, as the
// kernel sees them. The robustness cases edit these arrays before the run.
struct Problem {
  Case c;
  int B = 0, width = 0, num_pages = 0;
  KvGeometry g;
  std::vector<unsigned char> kc, vc, qh;
  std::vector<int32_t> table, lens;
  std::vector<float> kscale, vscale;  // per KV head; empty: 1

  size_t q_elems() const { return size_t(B) * c.hq * c.d; }
  // Element index of (sequence b, token t, KV head h, element e) through the table.
  size_t kv_index(int b, int t, int h, int e) const {
    const int page = table[size_t(b) * width + t / c.page];
    return size_t(page) * g.page_stride + size_t(t % c.page) * g.token_stride +
           size_t(h) * g.head_stride + e;
  }
};

Problem make_problem(const Case& c_in, Rng& rng) {
  Problem P;
  P.c = c_in;
  if (!is_fp8(P.c.kv)) P.c.kv = P.c.dt;  // a plain cache: q's dtype
  const Case& c = P.c;
  P.B = int(c.lens.size());
  const int B = P.B, D = c.d, page = c.page, hkv = c.hkv;
  const size_t es = dt_size(c.kv);

  // Pages: a random permutation; the used ones first, then spares (NaN).
  std::vector<int> pages_per(B);
  int used = 0, max_pages = 1;
  for (int b = 0; b < B; ++b) {
    pages_per[b] = (c.lens[b] + page - 1) / page;
    used += pages_per[b];
    max_pages = std::max(max_pages, pages_per[b]);
  }
  P.num_pages = used + 4;
  P.width = max_pages + 2;  // padded block tables
  std::vector<int> perm(P.num_pages);
  for (int i = 0; i < P.num_pages; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  const int nan_pages = P.num_pages - used;

  const size_t cache_elems = size_t(P.num_pages) * page * hkv * D;
  P.kc.resize(cache_elems * es);
  P.vc.resize(cache_elems * es);
  for (size_t i = 0; i < cache_elems; ++i) {
    store_nan(c.kv, P.kc.data(), i);
    store_nan(c.kv, P.vc.data(), i);
  }
  // An FP8 cache: each head's data a few times apart in magnitude, stored as data / scale with
  // the scale mapping the head's range onto the format's (a wrong head's scale fails).
  std::vector<float> kmag(hkv, 1.f), vmag(hkv, 1.f);
  if (is_fp8(c.kv)) {
    for (int h = 0; h < hkv; ++h) {
      kmag[h] = 0.25f + 3.75f * float(rng.uniform());
      vmag[h] = 0.25f + 3.75f * float(rng.uniform());
    }
    if (c.scaled) {
      const float fmax = c.kv == DT::kE4M3 ? 448.f : 57344.f;
      for (int h = 0; h < hkv; ++h) {
        P.kscale.push_back(5.f * kmag[h] / fmax);  // +-5 sigma of a normal: the format's max
        P.vscale.push_back(5.f * vmag[h] / fmax);
      }
    }
  }
  P.g = c.layout == Layout::kBSHD ? make_geometry(c.layout, P.num_pages, page, hkv, D)
                                  : make_geometry(c.layout, P.num_pages, hkv, page, D);
  P.table.resize(size_t(B) * P.width);
  P.lens = c.lens;
  int at = 0;
  for (int b = 0; b < B; ++b) {
    for (int j = 0; j < P.width; ++j)
      P.table[size_t(b) * P.width + j] = perm[used + int(rng() % uint64_t(nan_pages))];
    for (int j = 0; j < pages_per[b]; ++j) P.table[size_t(b) * P.width + j] = perm[at++];
    for (int t = 0; t < c.lens[b]; ++t)
      for (int h = 0; h < hkv; ++h) {
        const float ks = P.kscale.empty() ? 1.f : P.kscale[h];
        const float vs = P.vscale.empty() ? 1.f : P.vscale[h];
        for (int e = 0; e < D; ++e) {
          store_elem(c.kv, P.kc.data(), P.kv_index(b, t, h, e), rng.normal() * kmag[h] / ks);
          store_elem(c.kv, P.vc.data(), P.kv_index(b, t, h, e), rng.normal() * vmag[h] / vs);
        }
      }
  }
  P.qh.resize(P.q_elems() * dt_size(c.dt));  // q in its own dtype, whatever the cache holds
  for (size_t i = 0; i < P.q_elems(); ++i) store_elem(c.dt, P.qh.data(), i, rng.normal());
  return P;
}

// float64 reference with the kernels' contract (jaxattn/guards.h): NaN rows for a sequence
// whose length does not fit its table row or that uses a page id outside the cache; otherwise
// exact softmax attention over the stored (rounded) values, read through the table, in which
// a NaN propagates as it does in exact arithmetic (a NaN logit: the whole row; a NaN value:
// that element).
std::vector<double> reference(const Problem& P) {
  const Case& c = P.c;
  const int D = c.d, hq = c.hq, hkv = c.hkv, group = hq / hkv;
  std::vector<double> ref(P.q_elems(), 0.0);
  for (int b = 0; b < P.B; ++b) {
    const int L = P.lens[b];
    bool valid = L >= 0 && int64_t(L) <= int64_t(P.width) * c.page;
    for (int t = 0; valid && t < L; t += c.page) {
      const int page = P.table[size_t(b) * P.width + t / c.page];
      valid = page >= 0 && page < P.num_pages;
    }
    if (!valid) {
      std::fill(ref.begin() + size_t(b) * hq * D, ref.begin() + size_t(b + 1) * hq * D, NAN);
      continue;
    }
    std::vector<double> s(L), kd(size_t(L) * D), vd(size_t(L) * D), qv(D);
    for (int kh = 0; kh < hkv; ++kh) {
      const double ks = P.kscale.empty() ? 1.0 : P.kscale[kh];
      const double vs = P.vscale.empty() ? 1.0 : P.vscale[kh];
      for (int t = 0; t < L; ++t)  // this head's keys and values, decoded once
        for (int e = 0; e < D; ++e) {
          kd[size_t(t) * D + e] = load_elem(c.kv, P.kc.data(), P.kv_index(b, t, kh, e)) * ks;
          vd[size_t(t) * D + e] = load_elem(c.kv, P.vc.data(), P.kv_index(b, t, kh, e)) * vs;
        }
      for (int h = kh * group; h < (kh + 1) * group; ++h) {
        const size_t qrow = (size_t(b) * hq + h) * D;
        for (int e = 0; e < D; ++e) qv[e] = load_elem(c.dt, P.qh.data(), qrow + e);
        double mx = -INFINITY;
        for (int t = 0; t < L; ++t) {
          double dot = 0;
          for (int e = 0; e < D; ++e) dot += qv[e] * kd[size_t(t) * D + e];
          dot *= c.scale;
          if (c.cap > 0) dot = c.cap * std::tanh(dot / c.cap);
          s[t] = dot;
          mx = std::fmax(mx, dot);  // NaN logits stay in s and make the sum NaN below
        }
        double sum = 0;
        for (int t = 0; t < L; ++t) sum += (s[t] = std::exp(s[t] - mx));
        double* o = &ref[qrow];
        for (int t = 0; t < L; ++t)
          for (int e = 0; e < D; ++e) o[e] += s[t] / sum * vd[size_t(t) * D + e];
      }
    }
  }
  return ref;
}

// Runs the dispatcher on P and compares with the reference: a NaN expected must be NaN, an
// infinity non-finite, a zero (an empty sequence) exactly zero, anything else within
// atol + rtol |ref|. Returns false on a mismatch or a launch error.
bool run_problem(const Problem& P, const std::string& label) {
  const Case& c = P.c;
  const int B = P.B, D = c.d, hq = c.hq;
  const size_t es = dt_size(c.dt), q_elems = P.q_elems();
  const std::vector<double> ref = reference(P);

  DecodeParams p;
  p.copies = selftest_copies();
  p.batch = B;
  p.num_q_heads = hq;
  p.block_table_stride = P.width;
  p.partition_size = c.part;
  const int64_t capacity = int64_t(P.width) * c.page;
  p.max_parts = c.part > 0 ? int32_t((capacity + c.part - 1) / c.part) : 1;
  p.kv = P.g;
  p.ls = make_logit_scale(c.scale, c.cap);
  const size_t ws_floats = size_t(decode_workspace_floats(B, hq, p.max_parts, D));
  void *dq, *dkc, *dvc, *dout;
  int32_t *dtab, *dlens;
  float *dws, *dks = nullptr, *dvs = nullptr;
  if (!P.kscale.empty()) {
    CUDA_OK(cudaMalloc(&dks, P.kscale.size() * 4));
    CUDA_OK(cudaMalloc(&dvs, P.vscale.size() * 4));
    CUDA_OK(cudaMemcpy(dks, P.kscale.data(), P.kscale.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dvs, P.vscale.data(), P.vscale.size() * 4, cudaMemcpyHostToDevice));
  }
  p.scales.k = dks;
  p.scales.v = dvs;
  // Exact-size buffers (at least one element) so that compute-sanitizer sees any overrun.
  CUDA_OK(cudaMalloc(&dq, std::max<size_t>(P.qh.size(), 1)));
  CUDA_OK(cudaMalloc(&dkc, std::max<size_t>(P.kc.size(), 1)));
  CUDA_OK(cudaMalloc(&dvc, std::max<size_t>(P.vc.size(), 1)));
  CUDA_OK(cudaMalloc(&dout, std::max<size_t>(q_elems * es, 1)));
  CUDA_OK(cudaMalloc(&dtab, std::max<size_t>(P.table.size(), 1) * 4));
  CUDA_OK(cudaMalloc(&dlens, std::max(B, 1) * 4));
  CUDA_OK(cudaMalloc(&dws, std::max<size_t>(ws_floats, 1) * 4));
  CUDA_OK(cudaMemcpy(dq, P.qh.data(), P.qh.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dkc, P.kc.data(), P.kc.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dvc, P.vc.data(), P.vc.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dtab, P.table.data(), P.table.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dlens, P.lens.data(), B * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(dout, 0xff, q_elems * es));  // NaN in every dtype
  CUDA_OK(cudaMemset(dws, 0xff, ws_floats * 4));
  p.q = dq;
  p.k = dkc;
  p.v = dvc;
  p.block_tables = dtab;
  p.seq_lens = dlens;
  p.out = dout;
  p.workspace = dws;
  const char* err = launch(c.dt, c.kv, p, 0);
  cudaError_t sync = cudaDeviceSynchronize();
  std::vector<unsigned char> oh(q_elems * es);
  if (sync == cudaSuccess) CUDA_OK(cudaMemcpy(oh.data(), dout, oh.size(), cudaMemcpyDeviceToHost));
  for (void* ptr : {dq, dkc, dvc, dout, static_cast<void*>(dtab), static_cast<void*>(dlens),
                    static_cast<void*>(dws), static_cast<void*>(dks), static_cast<void*>(dvs)})
    cudaFree(ptr);
  if (err || sync != cudaSuccess) {
    std::printf("FAIL  %s%s: launch: %s / %s\n", label.c_str(), describe(c).c_str(),
                err ? err : "ok", cudaGetErrorString(sync));
    if (sync != cudaSuccess) std::exit(3);  // the context is gone
    return false;
  }

  const double atol = c.dt == DT::kF32 ? 1e-4 : (c.dt == DT::kBF16 ? 2e-2 : 5e-3);
  const double rtol = atol;
  double max_abs = 0, max_rel = 0, worst = 0;
  size_t nans = 0, mismatched = 0;
  for (size_t i = 0; i < q_elems; ++i) {
    const double o = load_elem(c.dt, oh.data(), i), r = ref[i];
    if (std::isnan(o)) ++nans;
    if (std::isnan(r)) {
      mismatched += !std::isnan(o);
      continue;
    }
    if (std::isinf(r)) {
      mismatched += std::isfinite(o);
      continue;
    }
    if (r == 0.0) {
      mismatched += o != 0.0;
      continue;
    }
    if (!std::isfinite(o)) {
      ++mismatched;
      continue;
    }
    const double e = std::fabs(o - r);
    max_abs = std::max(max_abs, e);
    max_rel = std::max(max_rel, e / std::max(std::fabs(r), 1e-3));
    worst = std::max(worst, e / (atol + rtol * std::fabs(r)));
  }
  const bool ok = mismatched == 0 && worst <= 1.0;
  std::printf("%s  %s%s  max_abs=%.2e max_rel=%.2e tol_ratio=%.3f NaN=%zu mismatched=%zu\n",
              ok ? "PASS" : "FAIL", label.c_str(), describe(c).c_str(), max_abs, max_rel, worst,
              nans, mismatched);
  return ok;
}

bool run_case(const Case& c, Rng& rng) { return run_problem(make_problem(c, rng), ""); }

// Index and NaN robustness: each edit of a valid problem, run on every kernel variant the
// dispatcher has (one pass and split): the direct kernel (1 query head per KV head), the
// tensor-core kernel (bf16/f16, 2..8), the pipelined SIMT kernel (f32; bf16 with 16 heads,
// whose warps split the heads; 32 heads, whose warps write without the shared merge). The
// reference applies the same contract, so a case passes only with NaN exactly where the
// contract puts it and exact values everywhere else.
int run_robustness(Rng& rng) {
  // Sequence lengths: 1 spans pages 0..8 (9 x 16 = 144 >= 130), 3 spans pages 0..12; 2 is
  // empty (its whole table row is padding).
  const std::vector<int> lens = {37, 130, 0, 200};
  struct Edit {
    const char* name;
    void (*apply)(Problem&);
  };
  const Edit edits[] = {
      {"valid", [](Problem&) {}},
      {"page id = num_pages (seq 1, page 3)",
       [](Problem& P) { P.table[1 * size_t(P.width) + 3] = P.num_pages; }},
      {"page id = 10^6 (seq 3, last page)",
       [](Problem& P) { P.table[3 * size_t(P.width) + 12] = 1000000; }},
      {"page id = -1 (seq 0, first page)", [](Problem& P) { P.table[0] = -1; }},
      {"page id = INT_MIN (seq 3, page 9: one partition of 64)",
       [](Problem& P) { P.table[3 * size_t(P.width) + 9] = INT32_MIN; }},
      {"garbage past each length (never read)",
       [](Problem& P) {
         for (int b = 0; b < P.B; ++b)
           for (int j = (P.lens[b] + P.c.page - 1) / P.c.page; j < P.width; ++j)
             P.table[size_t(b) * P.width + j] = (j % 2) ? -1 : 1000000 + j;
       }},
      {"seq_len = width * page + 1 (seq 1)",
       [](Problem& P) { P.lens[1] = P.width * P.c.page + 1; }},
      {"seq_len = INT_MAX (seq 3)", [](Problem& P) { P.lens[3] = INT32_MAX; }},
      {"seq_len = -1 (seq 1)", [](Problem& P) { P.lens[1] = -1; }},
      {"seq_len = INT_MIN (seq 0)", [](Problem& P) { P.lens[0] = INT32_MIN; }},
      {"NaN in q (seq 1, head 1, element 5)",
       [](Problem& P) { store_nan(P.c.dt, P.qh.data(), (size_t(1) * P.c.hq + 1) * P.c.d + 5); }},
      {"NaN in an attended K element (seq 3, token 77, KV head 1)",
       [](Problem& P) { store_nan(P.c.kv, P.kc.data(), P.kv_index(3, 77, 1, 9)); }},
      {"NaN in an attended V element (seq 3, token 199, KV head 0)",
       [](Problem& P) { store_nan(P.c.kv, P.vc.data(), P.kv_index(3, 199, 0, 6)); }},
      {"empty cache (num_pages = 0: every sequence with a token is invalid)",
       [](Problem& P) {
         P.num_pages = P.g.num_pages = 0;
         P.kc.clear();
         P.vc.clear();
       }},
      {"NaN in K and V of seq 0's first token (every head of KV head 0)",
       [](Problem& P) {
         for (int e = 0; e < P.c.d; ++e) {
           store_nan(P.c.kv, P.kc.data(), P.kv_index(0, 0, 0, e));
           store_nan(P.c.kv, P.vc.data(), P.kv_index(0, 0, 0, e));
         }
       }},
  };
  struct Variant {
    DT dt;
    int hq, hkv;
    const char* kernel;
    DT kv = DT::kF32;  // an FP8 format, or (anything else) q's dtype
    int d = 128;
  };
  const Variant variants[] = {
      {DT::kBF16, 2, 2, "direct"},
      {DT::kF16, 4, 4, "direct"},
      {DT::kBF16, 8, 2, "mma"},
      {DT::kF16, 16, 2, "mma"},
      {DT::kF32, 8, 2, "simt"},
      {DT::kBF16, 32, 2, "mma, two blocks a KV head"},
      {DT::kBF16, 64, 2, "mma, four blocks a KV head"},
      {DT::kF32, 2, 2, "direct32"},
      {DT::kBF16, 2, 2, "mma e4m3, one head a KV head", DT::kE4M3},
      {DT::kF16, 8, 2, "mma e4m3", DT::kE4M3},
      {DT::kBF16, 16, 2, "mma e5m2", DT::kE5M2},
      {DT::kBF16, 32, 2, "mma e4m3, two blocks a KV head", DT::kE4M3},
      {DT::kF16, 64, 2, "mma e5m2, four blocks a KV head", DT::kE5M2},
      // The other head dims (on sm_90, with DECODE_COPIES=tma for the FP8 ones, the TMA ring's
      // 64-byte rows and, for e5m2 at 256, two column blocks).
      {DT::kBF16, 8, 2, "mma, head_dim 32", DT::kF32, 32},
      {DT::kF16, 8, 2, "mma, head_dim 256", DT::kF32, 256},
      {DT::kBF16, 8, 2, "mma e4m3, head_dim 64", DT::kE4M3, 64},
      {DT::kBF16, 8, 2, "mma e5m2, head_dim 256", DT::kE5M2, 256},
  };
  int failed = 0, total = 0;
  for (const Variant& v : variants)
    for (int part : {0, 64})
      for (const Edit& e : edits) {
        Case c;
        c.dt = v.dt;
        c.kv = v.kv;
        c.scaled = is_fp8(v.kv);
        c.lens = lens;
        c.hq = v.hq;
        c.hkv = v.hkv;
        c.d = v.d;
        c.part = part;
        Problem P = make_problem(c, rng);
        e.apply(P);
        ++total;
        failed += run_problem(P, std::string("[") + v.kernel + "] " + e.name + ": ") ? 0 : 1;
      }
  // No sequences at all: nothing to launch, nothing to write, no error.
  const Case empty;  // no lengths
  ++total;
  failed += run_problem(make_problem(empty, rng), "[empty batch] ") ? 0 : 1;
  std::printf("robustness: %d cases, %d failed\n", total, failed);
  return failed;
}

// Every code of each FP8 format through one key: a sequence of one token attends to it with
// weight exactly 1, so each output element is its V element times v_scale (1 here): exact, NaN
// codes NaN in their element only. V's 256 elements (2 KV heads x 128) hold all 256 codes; K
// random. Every kernel variant and q dtype.
int run_every_code(Rng& rng) {
  int failed = 0, total = 0;
  for (DT dt : {DT::kBF16, DT::kF16})
    for (DT kv : {DT::kE4M3, DT::kE5M2})
      for (int group : {1, 4, 16}) {
        Case c;
        c.dt = dt;
        c.kv = kv;
        c.lens.assign(1, 1);
        c.hq = 2 * group;
        c.hkv = 2;
        Problem P = make_problem(c, rng);
        std::vector<int> codes(256);
        for (int i = 0; i < 256; ++i) codes[i] = i;
        std::shuffle(codes.begin(), codes.end(), rng);
        for (int h = 0; h < 2; ++h)
          for (int e = 0; e < 128; ++e) {
            uint8_t code = uint8_t(codes[h * 128 + e]);
            // e5m2 infinities: the spec makes a non-finite value NaN, a weight of 1 keeps inf.
            if (kv == DT::kE5M2 && (code & 0x7fu) == 0x7cu) code = uint8_t(code ^ 0x01u);
            P.vc[P.kv_index(0, 0, h, e)] = code;
          }
        ++total;
        failed += run_problem(P, std::string("[every ") + dt_name(kv) + " code] ") ? 0 : 1;
      }
  std::printf("every code: %d cases, %d failed\n", total, failed);
  return failed;
}

int run_checks() {
  Rng rng(1234);
  std::vector<Case> cases;
  const std::vector<int> lens = {1, 3, 17, 255, 513, 4097, 0, 64};
  // The main grid: dtype x group x page size x layout x partition.
  for (DT dt : {DT::kBF16, DT::kF16, DT::kF32})
    for (int group : {1, 4, 8, 16})
      for (int page : {1, 16, 128})
        for (Layout lay : {Layout::kBSHD, Layout::kBHSD})
          for (int part : {0, 256, 512}) {
            Case c;
            c.dt = dt;
            c.lens = lens;
            c.hkv = 2;
            c.hq = 2 * group;
            c.page = page;
            c.layout = lay;
            c.part = part;
            cases.push_back(c);
          }
  // Head dims, odd groups and page sizes, small partitions, soft cap, large scale.
  for (DT dt : {DT::kBF16, DT::kF16, DT::kF32})
    for (int d : {32, 64, 256})
      for (int group : {1, 2, 4, 8, 16})
        for (int part : {0, 100}) {
          Case c;
          c.dt = dt;
          c.lens = {1, 3, 17, 255, 513, 130};
          c.d = d;
          c.hkv = 2;
          c.hq = 2 * group;
          c.page = d == 256 ? 8 : 32;
          c.layout = d == 64 ? Layout::kBHSD : Layout::kBSHD;
          c.part = part;
          cases.push_back(c);
        }
  auto extra = [&](DT dt, std::vector<int> l, int hq, int hkv, int d, int page, Layout lay,
                   int part, float scale, float cap) {
    Case c;
    c.dt = dt;
    c.lens = std::move(l);
    c.hq = hq;
    c.hkv = hkv;
    c.d = d;
    c.page = page;
    c.layout = lay;
    c.part = part;
    c.scale = scale;
    c.cap = cap;
    cases.push_back(c);
  };
  for (DT dt : {DT::kBF16, DT::kF16, DT::kF32}) {
    extra(dt, {3, 255, 40}, 8, 2, 128, 16, Layout::kBSHD, 0, 0.5f, 4.0f);       // soft cap
    extra(dt, {3, 255, 40}, 8, 2, 64, 16, Layout::kBHSD, 64, 0.5f, 4.0f);       // soft cap, split
    extra(dt, {700, 33, 1, 64, 65}, 12, 4, 128, 3, Layout::kBSHD, 0, 0.1f, 0);  // group 3, page 3
    extra(dt, {700, 33, 2000}, 10, 5, 128, 7, Layout::kBHSD, 64, 0.1f, 0);      // group 2, page 7
    extra(dt, {700, 33, 2000}, 40, 5, 128, 16, Layout::kBSHD, 16, 0.1f, 0);  // group 8, tiny parts
    extra(dt, {300, 77}, 24, 2, 128, 16, Layout::kBHSD, 0, 0.1f, 0);         // group 12
    extra(dt, {300, 77}, 64, 1, 128, 16, Layout::kBSHD, 128, 0.1f, 0);       // group 64
    extra(dt, {32768}, 32, 8, 128, 16, Layout::kBSHD, 512, 0.0884f, 0);      // B=1 long
    extra(dt, {4096, 4095, 4033, 63, 4161}, 32, 8, 128, 16, Layout::kBSHD, 0, 0.0884f, 0);
    extra(dt, {1024, 1000}, 16, 2, 128, 128, Layout::kBHSD, 8192, 0.0884f, 0);  // one partition
    // head_dim 32 and 256 split into whole 64-key tiles (on sm_90, at 32, the TMA ring's split
    // grids).
    extra(dt, {700, 33, 65, 0, 128}, 8, 2, 32, 16, Layout::kBHSD, 128, 0.1f, 0);
    extra(dt, {700, 33, 65, 0, 128}, 8, 2, 256, 64, Layout::kBHSD, 128, 0.1f, 0);
  }
  // FP8 caches under bf16 / f16 q: every kernel variant (groups 1, 4, 8: direct and tensor-core;
  // 16: SIMT), page sizes, layouts, one pass and split, scaled and unscaled, head dims.
  for (DT dt : {DT::kBF16, DT::kF16})
    for (DT kv : {DT::kE4M3, DT::kE5M2})
      for (int group : {1, 4, 8, 16})
        for (int page : {1, 16})
          for (int part : {0, 256}) {
            Case c;
            c.dt = dt;
            c.kv = kv;
            c.scaled = (group + page + part / 256) % 2 == 0 || group == 4;
            c.lens.assign(lens.begin(), lens.end());
            c.hkv = 2;
            c.hq = 2 * group;
            c.page = page;
            c.layout = (group + part) % 3 ? Layout::kBSHD : Layout::kBHSD;
            c.part = part;
            cases.push_back(c);
          }
  for (DT kv : {DT::kE4M3, DT::kE5M2})
    for (int d : {32, 64, 256})
      for (int group : {1, 2, 8, 16}) {
        Case c;
        c.dt = d == 64 ? DT::kF16 : DT::kBF16;
        c.kv = kv;
        c.scaled = true;
        const int l6[] = {1, 3, 17, 255, 513, 130};
        c.lens.assign(l6, l6 + 6);
        c.d = d;
        c.hkv = 2;
        c.hq = 2 * group;
        c.page = d == 256 ? 8 : 32;
        c.part = group == 2 ? 100 : 0;
        cases.push_back(c);
      }
  for (DT kv : {DT::kE4M3, DT::kE5M2}) {
    auto fp8 = [&](std::vector<int> l, int hq, int hkv, int part, float scale, float cap) {
      Case c;
      c.dt = DT::kBF16;
      c.kv = kv;
      c.scaled = true;
      c.lens = std::move(l);
      c.hq = hq;
      c.hkv = hkv;
      c.part = part;
      c.scale = scale;
      c.cap = cap;
      cases.push_back(c);
    };
    fp8({3, 255, 40}, 8, 2, 0, 0.5f, 4.f);                      // soft cap
    fp8({32768}, 32, 8, 512, 0.0884f, 0.f);                     // B=1 long, 32/8
    fp8({4096, 4095, 4033, 63, 4161}, 32, 8, 0, 0.0884f, 0.f);  // one pass, 32/8
    // head_dim 64 and 256, bhsd, split into whole 64-key tiles.
    for (int d : {64, 256}) {
      fp8({700, 33, 65, 0, 128}, 8, 2, 128, 0.1f, 0.f);
      cases.back().d = d;
      cases.back().page = d == 64 ? 16 : 64;
      cases.back().layout = Layout::kBHSD;
    }
  }
  int failed = 0;
  for (const Case& c : cases) failed += run_case(c, rng) ? 0 : 1;
  std::printf("correctness: %zu cases, %d failed\n", cases.size(), failed);
  return failed + run_every_code(rng) + run_robustness(rng);
}

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
    const float u = float(z >> 40) * (1.f / 16777216.f) * 2.f - 1.f;  // [-1, 1)
    x[i] = float_to_bf16(u);
  }
}

// Random e4m3 codes of values in [-4, 4).
__global__ void fill_random_e4m3(uint8_t* x, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint64_t z = (i + seed) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    x[i] = float_to_e4m3((float(z >> 40) * (1.f / 16777216.f) * 2.f - 1.f) * 4.f);
  }
}

int num_sms() {
  int dev = 0, n = 0;
  CUDA_OK(cudaGetDevice(&dev));
  CUDA_OK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

// Resident blocks per SM of the decode kernel for a bf16 q over a bf16 (fp8 false) or e4m3
// cache, as the library reports it to jaxattn/native.py.
int resident_blocks(bool fp8, int group) {
  int blocks = 0;
  const char* e = fp8 ? gpu::decode_occupancy_typed<bf16_t, e4m3_t>(128, group, &blocks)
                      : gpu::decode_occupancy_typed<bf16_t>(128, group, &blocks);
  if (e) {
    std::fprintf(stderr, "occupancy query failed: %s\n", e);
    std::exit(2);
  }
  return blocks;
}

// jaxattn/native.py's choice (choose_partition_size with no override).
int auto_partition(int batch, int hkv, int group, int64_t capacity, bool fp8 = false) {
  int split = group > 15 ? 256 : 512;
  if (capacity <= split) return 0;
  if (int64_t(batch) * hkv >= 3LL * num_sms()) return 0;
  const double want = 0.9 * resident_blocks(fp8, group) * num_sms();
  auto blocks = [&](int64_t size) { return double(batch) * hkv * ((capacity + size - 1) / size); };
  while (2LL * split < capacity && blocks(2LL * split) >= want) split *= 2;
  while (split > 128 && blocks(split) < want) split /= 2;
  // Past one wave: twice as long partitions when they still fill half of it.
  const double wave = double(resident_blocks(fp8, group)) * num_sms();
  if (blocks(split) > wave && 2LL * split < capacity && blocks(2LL * split) >= wave / 2) split *= 2;
  return split;
}

double copy_ceiling_gbs() {
  const size_t bytes = size_t(1) << 30;  // 1 GiB in, 1 GiB out
  void *a, *b;
  CUDA_OK(cudaMalloc(&a, bytes));
  CUDA_OK(cudaMalloc(&b, bytes));
  CUDA_OK(cudaMemset(a, 1, bytes));
  cudaEvent_t e0, e1;
  CUDA_OK(cudaEventCreate(&e0));
  CUDA_OK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) CUDA_OK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
  std::vector<float> ms;
  for (int i = 0; i < 10; ++i) {
    CUDA_OK(cudaEventRecord(e0));
    CUDA_OK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    CUDA_OK(cudaEventRecord(e1));
    CUDA_OK(cudaEventSynchronize(e1));
    float t;
    CUDA_OK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  cudaFree(a);
  cudaFree(b);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return 2.0 * bytes / (ms[ms.size() / 2] * 1e-3) / 1e9;
}

// One timing case: its pool, tables and buffers; time() runs a variant.
#ifndef JAXATTN_BENCH_HEAD_DIM
#define JAXATTN_BENCH_HEAD_DIM 128  // the head_dim of the timing shapes (--perf, --one, --trace)
#endif

struct Bench {
  Bench(int b, int c, int q_heads, int kv_heads, bool fp8_cache = false)
      : B(b), ctx(c), hq(q_heads), hkv(kv_heads), fp8(fp8_cache) {}
  int B, ctx, hq, hkv;
  bool fp8;  // an e4m3 cache with per-head scales (bf16 q either way)
  static constexpr int D = JAXATTN_BENCH_HEAD_DIM, P = 16;
  int copies = 1, pages_per_copy = 0, width = 0;
  void *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr;
  float* ws = nullptr;
  float* scales = nullptr;  // k then v, [hkv] each
  int32_t* lens = nullptr;
  std::vector<int32_t*> tables;
  size_t ws_floats = 0;

  int elem_bytes() const { return fp8 ? 1 : 2; }
  double kv_bytes() const { return 2.0 * B * double(ctx) * hkv * D * elem_bytes(); }

  void setup(Rng& rng) {
    width = (ctx + P - 1) / P;
    pages_per_copy = B * width;
    const double min_bytes = 240e6;
    copies = std::max(1, int(std::ceil(min_bytes / kv_bytes())));
    const size_t pages = size_t(copies) * pages_per_copy;
    const size_t elems = pages * P * hkv * D;
    CUDA_OK(cudaMalloc(&k, elems * elem_bytes()));
    CUDA_OK(cudaMalloc(&v, elems * elem_bytes()));
    if (fp8) {
      fill_random_e4m3<<<1024, 256>>>(static_cast<uint8_t*>(k), elems, 1);
      fill_random_e4m3<<<1024, 256>>>(static_cast<uint8_t*>(v), elems, 1ull << 40);
      std::vector<float> sc(2 * hkv, 0.25f);
      CUDA_OK(cudaMalloc(&scales, sc.size() * 4));
      CUDA_OK(cudaMemcpy(scales, sc.data(), sc.size() * 4, cudaMemcpyHostToDevice));
    } else {
      fill_random_bf16<<<1024, 256>>>(static_cast<uint16_t*>(k), elems, 1);
      fill_random_bf16<<<1024, 256>>>(static_cast<uint16_t*>(v), elems, 1ull << 40);
    }
    CUDA_OK(cudaGetLastError());
    const size_t qe = size_t(B) * hq * D;
    CUDA_OK(cudaMalloc(&q, qe * 2));
    CUDA_OK(cudaMalloc(&out, qe * 2));
    fill_random_bf16<<<64, 256>>>(static_cast<uint16_t*>(q), qe, 7);
    std::vector<int32_t> l(B, ctx);
    CUDA_OK(cudaMalloc(&lens, B * 4));
    CUDA_OK(cudaMemcpy(lens, l.data(), B * 4, cudaMemcpyHostToDevice));
    ws_floats = size_t(decode_workspace_floats(B, hq, (int64_t(width) * P + 127) / 128, D));
    CUDA_OK(cudaMalloc(&ws, ws_floats * 4));
    for (int c = 0; c < copies; ++c) {
      std::vector<int32_t> t(pages_per_copy);
      for (int i = 0; i < pages_per_copy; ++i) t[i] = c * pages_per_copy + i;
      std::shuffle(t.begin(), t.end(), rng);
      int32_t* dt;
      CUDA_OK(cudaMalloc(&dt, t.size() * 4));
      CUDA_OK(cudaMemcpy(dt, t.data(), t.size() * 4, cudaMemcpyHostToDevice));
      tables.push_back(dt);
    }
    CUDA_OK(cudaDeviceSynchronize());
  }

  void teardown() {
    for (void* ptr : {q, k, v, out, static_cast<void*>(ws), static_cast<void*>(lens),
                      static_cast<void*>(scales)})
      cudaFree(ptr);
    for (int32_t* t : tables) cudaFree(t);
    tables.clear();
  }

  DecodeParams params(int part, int copy) const {
    DecodeParams p;
    p.copies = selftest_copies();
    p.q = q;
    p.k = k;
    p.v = v;
    p.block_tables = tables[copy];
    p.seq_lens = lens;
    p.out = out;
    p.workspace = ws;
    p.batch = B;
    p.num_q_heads = hq;
    p.block_table_stride = width;
    p.partition_size = part;
    p.max_parts = part > 0 ? int32_t((int64_t(width) * P + part - 1) / part) : 1;
    p.kv = make_geometry(Layout::kBSHD, int64_t(copies) * pages_per_copy, P, hkv, D);
    p.ls = make_logit_scale(0.0883883f, 0.f);
    if (fp8) {
      p.scales.k = scales;
      p.scales.v = scales + hkv;
    }
    return p;
  }

  // Median microseconds per call; variant 0: the dispatcher, 1: pipelined SIMT (4 heads),
  // 2: direct (4 heads); over an e4m3 cache 3: the tensor-core kernel without the combine,
  // 4: the combine alone.
  double time(int part, int variant) const {
    auto call = [&](int copy) {
      const DecodeParams p = params(part, copy);
      const char* e = nullptr;
      if (variant == 0 && fp8) e = gpu::launch_paged_decode_typed<bf16_t, e4m3_t>(p, 0);
      if (variant == 0 && !fp8) e = gpu::launch_paged_decode_typed<bf16_t>(p, 0);
      if (variant == 1) e = gpu::launch_paged_decode_group<bf16_t, D, 4, false>(p, 0);
      if (variant == 2) e = gpu::launch_paged_decode_group<bf16_t, D, 4, true>(p, 0);
      // A tensor-core kernel alone (3) / the combine alone (4): FP8 or 16-bit, as the cache.
      auto alone = [&](auto kernel, int threads, int smem) {
        dim3 grid;
        e = gpu::decode_grid(p, &grid, gpu::mma_head_chunks(hq / hkv));
        if (!e) e = gpu::allow_dynamic_smem(kernel, smem);
        if (!e && variant == 3) kernel<<<grid, threads, smem>>>(p);
        if (!e && variant == 4) e = gpu::launch_decode_combine<bf16_t, D>(p, 0);
      };
      using F8 = gpu::MmaFp8DecodeShape<e4m3_t, D>;
      using M16 = gpu::MmaDecodeShape<bf16_t, D>;
      if ((variant == 3 || variant == 4) && fp8)
        alone(gpu::paged_decode_mma_fp8_kernel<bf16_t, e4m3_t, D>, F8::kThreads, F8::kSmemBytes);
      if ((variant == 3 || variant == 4) && !fp8)
        alone(gpu::paged_decode_mma_kernel<bf16_t, D>, M16::kThreads, M16::kSmemBytes);
      if (e) {
        std::fprintf(stderr, "launch failed: %s\n", e);
        std::exit(2);
      }
    };
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    int copy = 0;
    for (int i = 0; i < 3; ++i) call(copy++ % copies);
    std::vector<float> us;
    for (int s = 0; s < 20; ++s) {
      CUDA_OK(cudaEventRecord(e0));
      for (int i = 0; i < 10; ++i) call(copy++ % copies);
      CUDA_OK(cudaEventRecord(e1));
      CUDA_OK(cudaEventSynchronize(e1));
      float ms;
      CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
      us.push_back(ms * 100.f);  // per call: ms * 1000 / 10
    }
    CUDA_OK(cudaGetLastError());
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
  }
};

void print_kernel_info() {
  cudaFuncAttributes a;
  int blocks = 0;
  using S = gpu::MmaDecodeShape<bf16_t, 128>;
  CUDA_OK(cudaFuncSetAttribute(gpu::paged_decode_mma_kernel<bf16_t, 128>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes));
  CUDA_OK(cudaFuncGetAttributes(&a, gpu::paged_decode_mma_kernel<bf16_t, 128>));
  CUDA_OK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &blocks, gpu::paged_decode_mma_kernel<bf16_t, 128>, S::kThreads, S::kSmemBytes));
  std::printf(
      "mma kernel bf16 D=128: %d registers, %d threads, %d stages x %d tokens, %d B smem, "
      "%d blocks/SM\n",
      a.numRegs, S::kThreads, S::kStages, S::kTile, S::kSmemBytes, blocks);
  using F = gpu::MmaFp8DecodeShape<e4m3_t, 128>;
  auto fp8_kernel = gpu::paged_decode_mma_fp8_kernel<bf16_t, e4m3_t, 128>;
  CUDA_OK(
      cudaFuncSetAttribute(fp8_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, F::kSmemBytes));
  CUDA_OK(cudaFuncGetAttributes(&a, fp8_kernel));
  CUDA_OK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fp8_kernel, F::kThreads,
                                                        F::kSmemBytes));
  std::printf(
      "mma kernel bf16 q, e4m3 cache, D=128: %d registers, %d stages x %d tokens, %d B "
      "smem, %d blocks/SM\n",
      a.numRegs, F::kStages, F::kTile, F::kSmemBytes, blocks);
  using G1 = gpu::DecodeShape<bf16_t, 128, 1>;
  CUDA_OK(cudaFuncGetAttributes(&a, gpu::paged_decode_kernel<bf16_t, 128, 1, true>));
  CUDA_OK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &blocks, gpu::paged_decode_kernel<bf16_t, 128, 1, true>, G1::kThreads, G1::kSmemBytes));
  std::printf("direct kernel bf16 D=128 (1 head): %d registers, %d blocks/SM\n", a.numRegs, blocks);
}

void run_perf(bool fp8_only) {
  cudaDeviceProp prop;
  int dev = 0;
  CUDA_OK(cudaGetDevice(&dev));
  CUDA_OK(cudaGetDeviceProperties(&prop, dev));
  std::printf("\ndevice: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20);
  print_kernel_info();
  const double ceiling = copy_ceiling_gbs();
  std::printf("device-to-device copy ceiling (read + write): %.0f GB/s\n\n", ceiling);
  struct Shape {
    int B, ctx;
  };
  const Shape shapes[] = {{1, 32768}, {8, 4096}, {64, 4096}, {256, 1024}, {64, 512}};
  Rng rng(99);
  if (!fp8_only) {
    std::printf("bf16, D=128, page 16, bshd. GB/s = K+V bytes / time; %% of the copy ceiling.\n");
    std::printf("%-5s %-6s %-7s %-7s %-6s %10s %9s %6s\n", "B", "ctx", "Hq/Hkv", "kernel", "part",
                "us", "GB/s", "%");
    for (int hkv : {8, 32})
      for (const Shape& sh : shapes) {
        Bench bench(sh.B, sh.ctx, 32, hkv);
        bench.setup(rng);
        const int group = 32 / hkv;
        const int auto_part = auto_partition(sh.B, hkv, group, int64_t(bench.width) * Bench::P);
        std::vector<int> parts = {auto_part};
        if (sh.B <= 8) {
          for (int x : {128, 256, 512, 1024, 2048})
            if (x != auto_part) parts.push_back(x);
        } else {
          parts.push_back(auto_part == 0 ? 512 : 0);
        }
        auto row = [&](const char* name, int part, int variant) {
          const double us = bench.time(part, variant);
          const double gbs = bench.kv_bytes() / (us * 1e-6) / 1e9;
          char hh[16];
          std::snprintf(hh, sizeof(hh), "32/%d", hkv);
          std::printf("%-5d %-6d %-7s %-7s %-6s %10.1f %9.0f %5.0f%%\n", sh.B, sh.ctx, hh, name,
                      (std::to_string(part) + (part == auto_part ? "*" : "")).c_str(), us, gbs,
                      100.0 * gbs / ceiling);
        };
        for (int part : parts) row("new", part, 0);
        if (group == 4) {
          row("simt", auto_part, 1);
          row("old", auto_part, 2);
        }
        bench.teardown();
      }
    std::printf("(* = the partition jaxattn/native.py picks; 0 = one pass)\n");
  }

  // The same shapes over an e4m3 cache (bf16 q, per-head scales): GB/s counts one byte an
  // element; "x bf16" is the bf16 cache's time at its own pick over this one.
  std::printf("\ne4m3 cache, bf16 q, D=128, page 16, bshd. GB/s = K+V bytes (1 B each) / time.\n");
  std::printf("%-5s %-6s %-7s %-6s %10s %9s %6s %7s\n", "B", "ctx", "Hq/Hkv", "part", "us", "GB/s",
              "%", "x bf16");
  for (int hkv : {8, 32})
    for (const Shape& sh : shapes) {
      const int group = 32 / hkv;
      double bf16_us;
      {
        Bench base(sh.B, sh.ctx, 32, hkv);
        base.setup(rng);
        bf16_us = base.time(auto_partition(sh.B, hkv, group, int64_t(base.width) * Bench::P), 0);
        base.teardown();
      }
      Bench bench(sh.B, sh.ctx, 32, hkv, true);
      bench.setup(rng);
      const int auto_part = auto_partition(sh.B, hkv, group, int64_t(bench.width) * Bench::P, true);
      std::vector<int> parts = {auto_part};
      for (int x : sh.B <= 8 ? std::vector<int>{256, 512, 1024, 2048}
                             : std::vector<int>{0, 512, 1024, 2048})
        if (x != auto_part && x < sh.ctx) parts.push_back(x);
      for (int part : parts) {
        const double us = bench.time(part, 0);
        const double gbs = bench.kv_bytes() / (us * 1e-6) / 1e9;
        char hh[16];
        std::snprintf(hh, sizeof(hh), "32/%d", hkv);
        std::printf("%-5d %-6d %-7s %-6s %10.1f %9.0f %5.0f%% %6.2fx\n", sh.B, sh.ctx, hh,
                    (std::to_string(part) + (part == auto_part ? "*" : "")).c_str(), us, gbs,
                    100.0 * gbs / ceiling, bf16_us / us);
        if (part > 0 && group == 4)
          std::printf("      of which the kernel alone %.1f us, the combine alone %.1f us\n",
                      bench.time(part, 3), bench.time(part, 4));
      }
      bench.teardown();
    }
}

}  // namespace

int main(int argc, char** argv) {
  bool check = true, perf = true, robust_only = false, fp8_only = false;
#ifdef JAXATTN_DECODE_TRACE
  if (argc == 6 && !std::strcmp(argv[1], "--trace")) {
    // --trace bf16|e4m3 B ctx part: block timelines of the tensor-core kernel (32/8).
    Rng rng(99);
    Bench bench(std::atoi(argv[3]), std::atoi(argv[4]), 32, 8, !std::strcmp(argv[2], "e4m3"));
    bench.setup(rng);
    const int part = std::atoi(argv[5]);
    std::printf("untraced: %.1f us (kernel alone %.1f)\n", bench.time(part, 0),
                bench.time(part, 3));
    dim3 grid;
    const DecodeParams p0 = bench.params(part, 0);
    if (const char* e = gpu::decode_grid(p0, &grid, gpu::mma_head_chunks(bench.hq / bench.hkv))) {
      std::fprintf(stderr, "%s\n", e);
      return 2;
    }
    const int nb = int(grid.x * grid.y * grid.z);
    unsigned long long* tr;
    CUDA_OK(cudaMalloc(&tr, size_t(nb) * 16 * 8));
    CUDA_OK(cudaMemset(tr, 0, size_t(nb) * 16 * 8));
    CUDA_OK(cudaMemcpyToSymbol(gpu::g_decode_trace, &tr, sizeof(tr)));
    for (int rep = 0; rep < 3; ++rep) bench.time(part, 3);  // the last launch's stamps remain
    std::vector<unsigned long long> h(size_t(nb) * 16);
    CUDA_OK(cudaMemcpy(h.data(), tr, h.size() * 8, cudaMemcpyDeviceToHost));
    unsigned long long t0 = ~0ull, t1 = 0;
    for (int b = 0; b < nb; ++b) {
      t0 = std::min(t0, h[b * 16]);
      t1 = std::max(t1, h[b * 16 + 13]);
    }
    std::printf("blocks %d, span %.2f us\n", nb, (t1 - t0) * 1e-3);
    // $DECODE_TRACE_CSV: every block's stamps (ns from the first block's start; -1 where the
    // block took none) and its SM, one row a block in grid order, for reading offline.
    if (const char* path = std::getenv("DECODE_TRACE_CSV")) {
      if (FILE* f = std::fopen(path, "w")) {
        std::fprintf(f, "block,sm");
        for (int i = 0; i < 14; ++i) std::fprintf(f, ",s%d", i);
        std::fprintf(f, "\n");
        for (int b = 0; b < nb; ++b) {
          std::fprintf(f, "%d,%llu", b, h[b * 16 + 15]);
          for (int i = 0; i < 14; ++i)
            std::fprintf(f, ",%lld", h[b * 16 + i] ? (long long)(h[b * 16 + i] - t0) : -1ll);
          std::fprintf(f, "\n");
        }
        std::fclose(f);
      }
    }
    const char* names[14] = {"start", "range", "prologue", "q", "tile0", "tile1", "tile2",
                             "tile3", "tile4", "tile5", "tile6", "tile7", "loop end", "written"};
    for (int i = 0; i < 14; ++i) {
      std::vector<double> v;
      for (int b = 0; b < nb; ++b)
        if (h[b * 16 + i]) v.push_back((h[b * 16 + i] - t0) * 1e-3);
      if (v.empty()) continue;
      std::sort(v.begin(), v.end());
      std::printf("%-9s n=%4zu  min %6.2f  p10 %6.2f  p50 %6.2f  p90 %6.2f  max %6.2f us\n",
                  names[i], v.size(), v.front(), v[v.size() / 10], v[v.size() / 2],
                  v[v.size() * 9 / 10], v.back());
    }
    // Per-block phase durations (medians).
    for (int i = 1; i < 14; ++i) {
      std::vector<double> v;
      for (int b = 0; b < nb; ++b) {
        int j = i - 1;
        while (j >= 0 && !h[b * 16 + j]) --j;
        if (h[b * 16 + i] && j >= 0) v.push_back((h[b * 16 + i] - h[b * 16 + j]) * 1e-3);
      }
      if (v.empty()) continue;
      std::sort(v.begin(), v.end());
      std::printf("  d(%-9s) p10 %6.2f  p50 %6.2f  p90 %6.2f us\n", names[i], v[v.size() / 10],
                  v[v.size() / 2], v[v.size() * 9 / 10]);
    }
    bench.teardown();
    return 0;
  }
#endif
  if ((argc == 6 || argc == 7) && !std::strcmp(argv[1], "--one")) {
    // --one bf16|e4m3 B ctx part [HQ/HKV]: one shape (32/8 unless given), timed as in the
    // tables (a handle for ncu).
    const bool fp8 = !std::strcmp(argv[2], "e4m3");
    int hq = 32, hkv = 8;
    if (argc == 7 &&
        (std::sscanf(argv[6], "%d/%d", &hq, &hkv) != 2 || hq <= 0 || hkv <= 0 || hq % hkv != 0)) {
      std::fprintf(stderr, "heads: HQ/HKV with HQ a multiple of HKV, got %s\n", argv[6]);
      return 2;
    }
    Rng rng(99);
    Bench bench(std::atoi(argv[3]), std::atoi(argv[4]), hq, hkv, fp8);
    bench.setup(rng);
    const int part = std::atoi(argv[5]);
    const double us = bench.time(part, 0);
    std::printf("%s B=%d ctx=%d %d/%d part=%d: %.1f us, %.0f GB/s\n", argv[2], bench.B, bench.ctx,
                hq, hkv, part, us, bench.kv_bytes() / (us * 1e-6) / 1e9);
    if (part > 0)
      std::printf("  kernel alone %.1f us, combine alone %.1f us\n", bench.time(part, 3),
                  bench.time(part, 4));
    bench.teardown();
    return 0;
  }
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--check")) {
      perf = false;
    } else if (!std::strcmp(argv[i], "--perf")) {
      check = false;
    } else if (!std::strcmp(argv[i], "--perf-fp8")) {
      check = false;
      fp8_only = true;
    } else if (!std::strcmp(argv[i], "--robust")) {
      perf = false;
      robust_only = true;
    } else {
      std::fprintf(stderr, "usage: %s [--check | --robust | --perf | --perf-fp8]\n", argv[0]);
      return 2;
    }
  }
  int failed = 0;
  if (check) {
    Rng rng(4321);
    failed = robust_only ? run_robustness(rng) : run_checks();
  }
  if (perf) run_perf(fp8_only);
  if (check) std::printf("%s\n", failed ? "SELFTEST FAILED" : "SELFTEST PASSED");
  return failed ? 1 : 0;
}
