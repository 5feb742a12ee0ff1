// GPU self-test of the prefill kernels (sm90 wgmma -- one tile a block, and "sm90p", the
// persistent launch --, mma.sync, SIMT) against a CPU float64 reference, then timings. Build and
// run on the GPU machine from the repository root:
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DJAXATTN_HAVE_SM90A \
//     -Iffi/include -Iffi/src ffi/tests_gpu/prefill_selftest.cu ffi/src/prefill.cu \
//     ffi/src/prefill_fp8.cu ffi/src/prefill_sm90.cu ffi/src/prefill_sm90_persistent.cu \
//     -o /tmp/prefill_selftest && /tmp/prefill_selftest
//
// (On a device other than compute capability 9.0 build for its arch without the sm90 files;
// the sm90 path then reports SKIP.) Arguments: --no-bench skips the timings, --bench-only
// skips the checks, --robust runs the robustness cases alone, --fp8 the FP8 checks alone (both
// small: for compute-sanitizer); --flush-l2 evicts the L2 before every timed launch; --pages
// 16,64 (the two long rows over pages of those sizes) and --shapes B:PREFIX:NEW,... (rows of
// those shapes, page 16) time their rows instead of the usual timings.
//
// Every case: random inputs rounded to bf16/f16; permuted page tables (or token-pool slots);
// the whole cache NaN before the requests' keys are written, so unused pages and the slots
// past each request's last key are NaN; the output NaN-filled before the launch; extra q rows
// past the last request, which must come back as zeros. A case passes when every valid
// output element is within 2 eps (1 + |ref|) of the reference (eps = 2^-8 bf16, 2^-11 f16:
// the rounding of P and of the output) and every padding row is zero.
//
// Robustness (run_robustness): the index contract of jaxattn/guards.h and the NaN rules, on
// every kernel, paged and pool forms: broken indptr (decreasing, first entry not 0), requests
// past q, index entries num_pages / 10^6 / -1 / INT_MIN (one at a request's last key, which
// the first tiles of that request never load), garbage past the keys, lengths past the table
// or below lq, kv_indptr past kv_indices, NaN in q, NaN / inf in K or V at keys some rows of
// a tile see and others do not, no requests at all. The reference applies the same contract
// to the edited arrays. Every buffer has its exact size, so compute-sanitizer --tool memcheck
// sees any access outside one (ffi/gpu_check.sh: SANITIZE=1).
//
// FP8 caches (e4m3fn, e5m2; q bf16 or f16): cases on every kernel, with per-head scales (the
// heads' data a few times apart in magnitude) and without, and robustness edits with the
// formats' NaN (and e5m2's infinity); timings of the same problems over an e4m3 cache.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "jaxattn/prefill.cuh"

using jaxattn::KvGeometry;
using jaxattn::Layout;
using jaxattn::PrefillParams;
using jaxattn::gpu::PrefillKernel;

#include "jaxattn/prefill_sm90_stats.h"  // a -DJAXATTN_SM90_WAIT_STATS=1 build's counters

#include "cuda_ok.h"

namespace {

uint16_t enc(float f, bool f16) { return f16 ? jaxattn::float_to_f16(f) : jaxattn::float_to_bf16(f); }
float dec(uint16_t h, bool f16) { return f16 ? jaxattn::f16_to_float(h) : jaxattn::bf16_to_float(h); }

// FP8 caches: kv8 = 1 e4m3, 2 e5m2 (0: the cache is q's 16-bit type).
uint8_t enc8(float f, int kv8) {
  return kv8 == 1 ? jaxattn::float_to_e4m3(f) : jaxattn::float_to_e5m2(f);
}
float dec8(uint8_t b, int kv8) {
  return kv8 == 1 ? jaxattn::e4m3_to_float(b) : jaxattn::e5m2_to_float(b);
}
uint8_t nan8(int kv8) { return kv8 == 1 ? 0x7f : 0x7e; }
constexpr uint16_t kNaN16 = 0xffff;  // a NaN in both bf16 and f16
constexpr uint16_t kInfBf16 = 0x7f80, kInfF16 = 0x7c00;

struct Case {
  std::string name;
  std::vector<int> lq, prefix;  // per request
  int hq, hkv, d, page_size;    // page_size 1 with pool = true: the token-pool (extend) form
  Layout layout;
  bool pool;
  float cap;
  bool f16;
  int pad_rows;
  int kv8 = 0;          // 1: an e4m3 cache, 2: e5m2 (0: q's type)
  bool scaled = false;  // FP8: per-head K / V scales
};

struct Problem {
  Case c;
  int batch = 0, nq = 0, total_q = 0, table_stride = 0;
  std::vector<int> cu_q, lk;
  std::vector<int32_t> table, indptr, seq_lens;
  std::vector<uint16_t> q, k, v;
  std::vector<uint8_t> k8, v8;                // an FP8 cache (c.kv8), instead of k and v
  std::vector<float> kscale, vscale;          // per KV head (empty: 1)
  std::vector<std::vector<int64_t>> key_off;  // element offset of key j of request b
  KvGeometry geo;
  float scale = 0.f;
};

Problem make_problem(const Case& c, std::mt19937& rng, bool fill_values = true) {
  Problem P;
  P.c = c;
  P.batch = int(c.lq.size());
  P.cu_q.assign(P.batch + 1, 0);
  P.lk.resize(P.batch);
  for (int b = 0; b < P.batch; ++b) {
    P.cu_q[b + 1] = P.cu_q[b] + c.lq[b];
    P.lk[b] = c.prefix[b] + c.lq[b];
  }
  P.nq = P.cu_q[P.batch];
  P.total_q = P.nq + c.pad_rows;
  const int ps = c.pool ? 1 : c.page_size;
  std::vector<int> need(P.batch);
  int used = 0, max_need = 0;
  for (int b = 0; b < P.batch; ++b) {
    need[b] = (P.lk[b] + ps - 1) / ps;
    used += need[b];
    max_need = std::max(max_need, need[b]);
  }
  const int num_pages = used + 3;  // three pages nobody uses (NaN)
  std::vector<int> perm(num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  if (c.pool) {
    P.geo = jaxattn::pool_geometry(num_pages, c.hkv, c.d);
  } else if (c.layout == Layout::kBSHD) {
    P.geo = jaxattn::make_geometry(Layout::kBSHD, num_pages, ps, c.hkv, c.d);
  } else {
    P.geo = jaxattn::make_geometry(Layout::kBHSD, num_pages, c.hkv, ps, c.d);
  }
  const int64_t cache = int64_t(num_pages) * P.geo.page_stride;
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  std::vector<float> kmag(c.hkv, 1.f), vmag(c.hkv, 1.f);
  if (c.kv8) {
    P.k8.assign(cache, nan8(c.kv8));
    P.v8.assign(cache, nan8(c.kv8));
    for (int h = 0; h < c.hkv; ++h) {
      kmag[h] = 0.25f + 3.75f * (0.5f + 0.5f * uni(rng));
      vmag[h] = 0.25f + 3.75f * (0.5f + 0.5f * uni(rng));
      if (c.scaled) {
        const float fmax = c.kv8 == 1 ? 448.f : 57344.f;
        P.kscale.push_back(kmag[h] / fmax);  // the head's range onto the format's
        P.vscale.push_back(vmag[h] / fmax);
      }
    }
  } else {
    P.k.assign(cache, kNaN16);
    P.v.assign(cache, kNaN16);
  }
  P.key_off.resize(P.batch);
  int next = 0;
  if (c.pool) {
    P.indptr.assign(P.batch + 1, 0);
  } else {
    P.table_stride = max_need + 2;
    P.table.assign(int64_t(P.batch) * P.table_stride, perm[num_pages - 1]);  // a NaN page
    P.seq_lens = P.lk;
  }
  for (int b = 0; b < P.batch; ++b) {
    std::vector<int> pages(perm.begin() + next, perm.begin() + next + need[b]);
    next += need[b];
    if (c.pool) {
      P.table.insert(P.table.end(), pages.begin(), pages.end());
      P.indptr[b + 1] = P.indptr[b] + need[b];
    } else {
      std::copy(pages.begin(), pages.end(), P.table.begin() + int64_t(b) * P.table_stride);
    }
    P.key_off[b].resize(P.lk[b]);
    for (int j = 0; j < P.lk[b]; ++j) {
      const int64_t off = int64_t(pages[j / ps]) * P.geo.page_stride +
                          int64_t(j % ps) * P.geo.token_stride;
      P.key_off[b][j] = off;
      for (int h = 0; h < c.hkv; ++h) {
        for (int dd = 0; dd < c.d; ++dd) {
          const int64_t e = off + h * P.geo.head_stride + dd;
          if (c.kv8) {
            const float ks = P.kscale.empty() ? 1.f : P.kscale[h];
            const float vs = P.vscale.empty() ? 1.f : P.vscale[h];
            P.k8[e] = enc8(fill_values ? uni(rng) * kmag[h] / ks : 0.f, c.kv8);
            P.v8[e] = enc8(fill_values ? uni(rng) * vmag[h] / vs : 0.f, c.kv8);
          } else {
            P.k[e] = fill_values ? enc(uni(rng), c.f16) : 0;
            P.v[e] = fill_values ? enc(uni(rng), c.f16) : 0;
          }
        }
      }
    }
  }
  P.q.resize(int64_t(P.total_q) * c.hq * c.d);
  for (auto& x : P.q) x = fill_values ? enc(1.7f * uni(rng), c.f16) : 0;
  P.scale = 1.f / std::sqrt(float(c.d));
  return P;
}

// out[total_q][hq][d] in float64, with the kernels' contract (jaxattn/guards.h) applied to the
// index arrays as they are (the robustness cases edit them after make_problem): every row NaN
// when the indptr structure is broken; NaN rows (inside q) for an invalid request; zeros past
// qo[batch]; otherwise exact attention over the stored values, read through the request's
// index entries, in which a NaN propagates as it does in exact arithmetic.
std::vector<double> reference(const Problem& P) {
  const Case& c = P.c;
  const int group = c.hq / c.hkv, ps = c.pool ? 1 : c.page_size;
  const int64_t row_elems = int64_t(c.hq) * c.d;
  std::vector<double> out(int64_t(P.total_q) * row_elems, 0.0);
  auto sound = [&](const std::vector<int32_t>& ptr) {
    if (ptr.empty() || ptr[0] != 0) return false;
    for (size_t i = 1; i < ptr.size(); ++i)
      if (ptr[i] < ptr[i - 1]) return false;
    return true;
  };
  if (!sound(P.cu_q) || (c.pool && !sound(P.indptr))) {
    std::fill(out.begin(), out.end(), NAN);
    return out;
  }
  std::vector<double> qrow(c.d), logit, acc(c.d);
  std::vector<double> kf, vf;
  std::vector<int64_t> key_off;
  for (int b = 0; b < P.batch; ++b) {
    const int q0 = P.cu_q[b], q1 = P.cu_q[b + 1], lq = q1 - q0;
    const int lk = c.pool ? P.indptr[b + 1] - P.indptr[b] : P.seq_lens[b];
    const int32_t* entries =
        c.pool ? P.table.data() + P.indptr[b] : P.table.data() + int64_t(b) * P.table_stride;
    bool valid = q1 <= P.total_q && lk >= lq;
    valid = valid && (c.pool ? int64_t(P.indptr[b + 1]) <= int64_t(P.table.size())
                             : int64_t(lk) <= int64_t(P.table_stride) * ps);
    for (int j = 0; valid && j < lk; j += ps)
      valid = entries[j / ps] >= 0 && entries[j / ps] < P.geo.num_pages;
    if (!valid) {
      std::fill(out.begin() + std::min(q0, P.total_q) * row_elems,
                out.begin() + std::min(q1, P.total_q) * row_elems, NAN);
      continue;
    }
    key_off.resize(lk);
    for (int j = 0; j < lk; ++j)
      key_off[j] =
          int64_t(entries[j / ps]) * P.geo.page_stride + int64_t(j % ps) * P.geo.token_stride;
    for (int kvh = 0; kvh < c.hkv; ++kvh) {
      // This request's keys of this head, decoded once.
      kf.assign(int64_t(lk) * c.d, 0.0);
      vf.assign(int64_t(lk) * c.d, 0.0);
      const double ks = P.kscale.empty() ? 1.0 : P.kscale[kvh];
      const double vs = P.vscale.empty() ? 1.0 : P.vscale[kvh];
      for (int j = 0; j < lk; ++j) {
        for (int dd = 0; dd < c.d; ++dd) {
          const int64_t e = key_off[j] + kvh * P.geo.head_stride + dd;
          kf[int64_t(j) * c.d + dd] = c.kv8 ? dec8(P.k8[e], c.kv8) * ks : dec(P.k[e], c.f16);
          vf[int64_t(j) * c.d + dd] = c.kv8 ? dec8(P.v8[e], c.kv8) * vs : dec(P.v[e], c.f16);
        }
      }
      for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
        for (int i = 0; i < lq; ++i) {
          const int row = q0 + i;
          for (int dd = 0; dd < c.d; ++dd)
            qrow[dd] = dec(P.q[(int64_t(row) * c.hq + h) * c.d + dd], c.f16);
          const int last = std::min(lk - 1, i + lk - lq);
          double mx = -INFINITY;
          logit.assign(std::max(last + 1, 0), 0.0);
          for (int j = 0; j <= last; ++j) {
            double sdot = 0.0;
            const double* kr = &kf[int64_t(j) * c.d];
            for (int dd = 0; dd < c.d; ++dd) sdot += qrow[dd] * kr[dd];
            sdot *= P.scale;
            if (c.cap > 0.f) sdot = c.cap * std::tanh(sdot / c.cap);
            logit[j] = sdot;
            mx = std::fmax(mx, sdot);  // NaN logits stay and make l NaN below
          }
          std::fill(acc.begin(), acc.end(), 0.0);
          double l = 0.0;
          for (int j = 0; j <= last; ++j) {
            const double pj = std::exp(logit[j] - mx);
            l += pj;
            const double* vr = &vf[int64_t(j) * c.d];
            for (int dd = 0; dd < c.d; ++dd) acc[dd] += pj * vr[dd];
          }
          for (int dd = 0; dd < c.d; ++dd)
            out[(int64_t(row) * c.hq + h) * c.d + dd] = l == 0.0 ? 0.0 : acc[dd] / l;
        }
      }
    }
  }
  return out;
}

// The persistent launch's block count in the checks: a few blocks, so that every block loops
// over many items (the rings, their phases and the guards' state handed on from item to item);
// the timings launch one block a multiprocessor (0).
int g_persistent_blocks = 0;

struct Device {
  void *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr;
  int32_t *cu = nullptr, *table = nullptr, *indptr = nullptr, *seq = nullptr;
  float *ks = nullptr, *vs = nullptr;
  uint32_t* work = nullptr;  // the persistent launch's work counter
  size_t out_bytes = 0;
  int kv8 = 0;
  PrefillParams p;

  explicit Device(const Problem& P) {
    q = upload(P.q);
    kv8 = P.c.kv8;
    k = kv8 ? static_cast<void*>(upload(P.k8)) : upload(P.k);
    v = kv8 ? static_cast<void*>(upload(P.v8)) : upload(P.v);
    ks = upload(P.kscale);
    vs = upload(P.vscale);
    cu = upload(P.cu_q);
    table = upload(P.table);
    indptr = upload(P.indptr);
    seq = upload(P.seq_lens);
    out_bytes = P.q.size() * 2;
    CUDA_OK(cudaMalloc(&out, out_bytes));
    CUDA_OK(cudaMalloc(&work, sizeof(uint32_t)));
    p.work_counter = work;
    p.q = q;
    p.k = k;
    p.v = v;
    p.cu_seqlens_q = cu;
    p.page_table = table;
    p.page_indptr = P.c.pool ? indptr : nullptr;
    p.seq_lens = P.c.pool ? nullptr : seq;
    p.out = out;
    p.batch = P.batch;
    p.total_q = P.total_q;
    p.num_q_heads = P.c.hq;
    p.page_table_stride = P.table_stride;
    p.page_table_len = int64_t(P.table.size());
    p.kv = P.geo;
    p.ls = jaxattn::make_logit_scale(P.scale, P.c.cap);
    p.scales.k = ks;
    p.scales.v = vs;
  }
  ~Device() {
    for (void* x : {q, k, v, out, static_cast<void*>(cu), static_cast<void*>(table),
                    static_cast<void*>(indptr), static_cast<void*>(seq), static_cast<void*>(ks),
                    static_cast<void*>(vs), static_cast<void*>(work)})
      if (x) cudaFree(x);
  }
  const char* launch(bool f16, PrefillKernel which) const {
    using jaxattn::bf16_t;
    using jaxattn::e4m3_t;
    using jaxattn::e5m2_t;
    using jaxattn::f16_t;
    using jaxattn::gpu::launch_prefill_typed;
    jaxattn::PrefillParams q = p;
    q.kernel = static_cast<int32_t>(which);
    q.persistent_blocks = g_persistent_blocks;
    if (kv8 == 1)
      return f16 ? launch_prefill_typed<f16_t, e4m3_t>(q, 0)
                 : launch_prefill_typed<bf16_t, e4m3_t>(q, 0);
    if (kv8 == 2)
      return f16 ? launch_prefill_typed<f16_t, e5m2_t>(q, 0)
                 : launch_prefill_typed<bf16_t, e5m2_t>(q, 0);
    return f16 ? launch_prefill_typed<f16_t>(q, 0) : launch_prefill_typed<bf16_t>(q, 0);
  }
};

const char* kernel_name(PrefillKernel k) {
  switch (k) {
    case PrefillKernel::kSm90:
      return "sm90";
    case PrefillKernel::kSm90Persistent:
      return "sm90p";
    case PrefillKernel::kMma:
      return "mma";
    case PrefillKernel::kSimt:
      return "simt";
    default:
      return "auto";
  }
}

bool g_sm90_expected = false;  // compute capability 9.0: the sm90 path must run

bool is_sm90(PrefillKernel k) {
  return k == PrefillKernel::kSm90 || k == PrefillKernel::kSm90Persistent;
}

// Runs every kernel on P and compares all total_q rows with the reference: a NaN expected
// must be NaN, an infinity non-finite, a zero (a padding row) exactly zero, anything else
// within 2 eps (1 + |ref|) (eps = 2^-8 bf16, 2^-11 f16: the rounding of P and of the output).
// 0 pass, 1 fail.
int check_problem(const Problem& P, const std::string& name) {
  const Case& c = P.c;
  const std::vector<double> ref = reference(P);
  Device dev(P);
  const double eps = c.f16 ? 1.0 / 2048 : 1.0 / 256;
  int worst = 0;
  for (PrefillKernel which : {PrefillKernel::kSm90, PrefillKernel::kSm90Persistent,
                              PrefillKernel::kMma, PrefillKernel::kSimt}) {
    CUDA_OK(cudaMemset(dev.out, 0xff, dev.out_bytes));  // NaN everywhere
    const char* err = dev.launch(c.f16, which);
    if (err != nullptr) {
      const bool fail = !is_sm90(which) || g_sm90_expected;
      std::printf("  %-60s %-5s %s: %s\n", name.c_str(), kernel_name(which), fail ? "FAIL" : "SKIP",
                  err);
      cudaGetLastError();
      worst = std::max(worst, fail ? 1 : 0);
      continue;
    }
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint16_t> out(P.q.size());
    if (dev.out_bytes)
      CUDA_OK(cudaMemcpy(out.data(), dev.out, dev.out_bytes, cudaMemcpyDeviceToHost));
    double max_abs = 0.0, max_ref = 0.0, worst_ratio = 0.0;
    int64_t bad = 0, nans = 0;
    for (int64_t i = 0; i < int64_t(out.size()); ++i) {
      const double o = dec(out[i], c.f16), r = ref[i];
      nans += std::isnan(o);
      if (std::isnan(r)) {
        bad += !std::isnan(o);
      } else if (std::isinf(r)) {
        bad += std::isfinite(o);
      } else if (r == 0.0) {
        bad += (out[i] & 0x7fff) != 0;
      } else {
        const double e = std::fabs(o - r);  // NaN compares false below: counted as bad
        const double tol = 2 * eps * (1.0 + std::fabs(r));
        if (!(e <= tol)) ++bad;
        if (!(e <= max_abs)) max_abs = e;
        max_ref = std::max(max_ref, std::fabs(r));
        worst_ratio = std::max(worst_ratio, e / tol);
      }
    }
    const bool ok = bad == 0;
    std::printf(
        "  %-60s %-5s max_abs_err %.3e  max_rel_err %.3e  err/tol %.2f  NaN %lld  "
        "bad %lld  %s\n",
        name.c_str(), kernel_name(which), max_abs, max_abs / std::max(max_ref, 1e-30), worst_ratio,
        (long long)nans, (long long)bad, ok ? "PASS" : "FAIL");
    if (!ok) worst = 1;
  }
  return worst;
}

int check_case(const Case& c, std::mt19937& rng) {
  return check_problem(make_problem(c, rng), c.name);
}

// Element index of (request b, key j, KV head h, element e) as generated.
int64_t kv_elem(const Problem& P, int b, int j, int h, int e) {
  return P.key_off[b][j] + h * P.geo.head_stride + e;
}

// The index entry of request b's key j (a page id, or a pool slot).
int32_t& entry_of(Problem& P, int b, int j) {
  if (P.c.pool) return P.table[P.indptr[b] + j];
  return P.table[int64_t(b) * P.table_stride + j / P.c.page_size];
}

// Index and NaN robustness on every kernel: edits of a valid problem (paged bf16 D=128 and
// pool f16 D=64), against the reference with the same contract. Requests: lq 3/17/255/1/130
// with prefixes 5/64/0/1000/200 (lk 8/81/255/1001/330), then 5 padding rows. The edits that
// matter most for tiles: a bad entry at request 2's last key (its first tiles' causal range
// stops long before it, yet all its rows must be NaN), and NaN / inf in K or V at keys that
// some rows of a tile see and others do not (those rows must stay exact).
int run_robustness(std::mt19937& rng) {
  using Edit = void (*)(Problem&);
  struct Named {
    const char* name;
    bool paged, pool;
    Edit edit;
  };
  const Named edits[] = {
      {"valid", true, true, [](Problem&) {}},
      {"qo decreasing", true, true, [](Problem& P) { P.cu_q[2] = P.cu_q[1] - 1; }},
      {"qo[0] = 1", true, true, [](Problem& P) { P.cu_q[0] = 1; }},
      {"qo[B] = total_q + 7 (last request overlong)", true, true,
       [](Problem& P) { P.cu_q[P.batch] = P.total_q + 7; }},
      {"qo[3..5] = total_q + 100 (request 2 overlong, 3 and 4 past q)", true, true,
       [](Problem& P) {
         for (int b = 3; b <= P.batch; ++b) P.cu_q[b] = P.total_q + 100;
       }},
      {"entry = num_pages at request 3's first key", true, true,
       [](Problem& P) { entry_of(P, 3, 0) = P.geo.num_pages; }},
      {"entry = 10^6 at request 2's last key", true, true,
       [](Problem& P) { entry_of(P, 2, 254) = 1000000; }},
      {"entry = -1 at request 4's key 100", true, true,
       [](Problem& P) { entry_of(P, 4, 100) = -1; }},
      {"entry = INT_MIN at request 1's last key", true, true,
       [](Problem& P) { entry_of(P, 1, 80) = INT32_MIN; }},
      {"garbage past every request's keys (never read)", true, true,
       [](Problem& P) {
         if (P.c.pool) {
           for (int i = 0; i < 9; ++i) P.table.push_back(i % 2 ? -1 : 1000000 + i);
           return;
         }
         for (int b = 0; b < P.batch; ++b)
           for (int j = (P.lk[b] + P.c.page_size - 1) / P.c.page_size; j < P.table_stride; ++j)
             P.table[int64_t(b) * P.table_stride + j] = j % 2 ? -1 : 1000000 + j;
       }},
      {"seq_len past the table (request 1)", true, false,
       [](Problem& P) { P.seq_lens[1] = P.table_stride * P.c.page_size + 1; }},
      {"seq_len < lq (request 4)", true, false, [](Problem& P) { P.seq_lens[4] = 129; }},
      {"seq_len = -1 (request 0)", true, false, [](Problem& P) { P.seq_lens[0] = -1; }},
      {"kv_indptr[B] past kv_indices (request 4)", false, true,
       [](Problem& P) { P.indptr[P.batch] = int32_t(P.table.size()) + 1; }},
      {"kv_indptr: request 1 lk < lq", false, true,
       [](Problem& P) { P.indptr[2] = P.indptr[1] + 10; }},
      {"kv_indptr decreasing", false, true, [](Problem& P) { P.indptr[3] = P.indptr[2] - 1; }},
      {"kv_indptr[0] = 1", false, true, [](Problem& P) { P.indptr[0] = 1; }},
      {"empty cache (num_pages = 0: every request is invalid)", true, true,
       [](Problem& P) {
         P.geo.num_pages = 0;
         P.k.clear();
         P.v.clear();
       }},
      {"NaN in q (row qo[1] + 5, head 3)", true, true,
       [](Problem& P) { P.q[(int64_t(P.cu_q[1] + 5) * P.c.hq + 3) * P.c.d] = kNaN16; }},
      {"NaN in K of a prefix key (request 1, key 10, KV head 0)", true, true,
       [](Problem& P) { P.k[kv_elem(P, 1, 10, 0, 3)] = kNaN16; }},
      {"NaN in K at a diagonal key (request 2, key 100, KV head 1)", true, true,
       [](Problem& P) { P.k[kv_elem(P, 2, 100, 1, 7)] = kNaN16; }},
      {"NaN in V at a diagonal key (request 2, key 100, KV head 1)", true, true,
       [](Problem& P) { P.v[kv_elem(P, 2, 100, 1, 7)] = kNaN16; }},
      {"NaN in V at request 2's last key", true, true,
       [](Problem& P) { P.v[kv_elem(P, 2, 254, 0, 1)] = kNaN16; }},
      {"NaN in V at request 4's first new key", true, true,
       [](Problem& P) { P.v[kv_elem(P, 4, 200, 1, 60)] = kNaN16; }},
      {"inf in V at a diagonal key (request 4, key 260, KV head 0)", true, true,
       [](Problem& P) { P.v[kv_elem(P, 4, 260, 0, 2)] = P.c.f16 ? kInfF16 : kInfBf16; }},
      // Key 7 of request 0 (lq 3, lk 8) is hidden from rows 0 and 1 in the first key tile.
      {"NaN in V at request 0's last key (the first key tile)", true, true,
       [](Problem& P) { P.v[kv_elem(P, 0, 7, 1, 9)] = kNaN16; }},
      // Key 195 of request 4 (lq 130, lk 330): every row of its tiles sees it, also in the
      // first tile (rows 0.., keys from 201 hidden), where it shares a key tile with keys
      // the mask hides; not sanitised, the product gives the row's non-finite value.
      {"inf in V at request 4's key 195 (seen by every row, in a masked key tile)", true, true,
       [](Problem& P) { P.v[kv_elem(P, 4, 195, 1, 4)] = P.c.f16 ? kInfF16 : kInfBf16; }},
      // Keys 210 and 260 of request 4: hidden from the first rows of its first tile, in two
      // key tiles of one block; element 5 sees both (the smaller decides), element 6 one.
      {"NaN in V at request 4's keys 210 and 260 (two masked key tiles of a block)", true, true,
       [](Problem& P) {
         P.v[kv_elem(P, 4, 210, 1, 5)] = kNaN16;
         P.v[kv_elem(P, 4, 260, 1, 5)] = kNaN16;
         P.v[kv_elem(P, 4, 260, 1, 6)] = kNaN16;
       }},
  };
  const Layout bshd = Layout::kBSHD;
  // name, lq, prefix, hq, hkv, d, page_size, layout, pool, cap, f16, pad_rows
  const Case paged = {
      "paged", {3, 17, 255, 1, 130}, {5, 64, 0, 1000, 200}, 8, 2, 128, 16, bshd, false, 0.f, false,
      5};
  const Case pool = {
      "pool", {3, 17, 255, 1, 130}, {5, 64, 0, 1000, 200}, 8, 2, 64, 1, bshd, true, 0.f, true, 5};
  // paged and pool are GQA 8/2: the sm90 kernel packs their heads (prefill_sm90_packs);
  // paged_mha (2/2) runs it with one head a tile.
  Case paged_mha = paged;
  paged_mha.name = "paged MHA 2/2";
  paged_mha.hq = 2;
  int failed = 0, total = 0;
  const Case* const bases[] = {&paged, &paged_mha, &pool};
  for (const Case* base : bases) {
    for (const Named& e : edits) {
      if (!(base->pool ? e.pool : e.paged)) continue;
      Problem P = make_problem(*base, rng);
      e.edit(P);
      ++total;
      failed += check_problem(P, base->name + ": " + e.name);
    }
  }
  // No requests: every row is padding (zeros), or NaN when qo[0] != 0.
  for (int first : {0, 2}) {
    for (const Case* base : {&paged, &pool}) {
      Case c = *base;
      c.lq.clear();
      c.prefix.clear();
      c.pad_rows = 9;
      Problem P = make_problem(c, rng);
      P.cu_q[0] = first;
      ++total;
      failed +=
          check_problem(P, base->name + ": no requests, qo = {" + std::to_string(first) + "}");
    }
  }
  // FP8 caches: the format's NaN (e5m2: and infinity) at the same places, and a bad entry.
  const Named fp8_edits[] = {
      {"valid", true, true, [](Problem&) {}},
      {"entry = 10^6 at request 2's last key", true, true,
       [](Problem& P) { entry_of(P, 2, 254) = 1000000; }},
      {"NaN in q (row qo[1] + 5, head 3)", true, true,
       [](Problem& P) { P.q[(int64_t(P.cu_q[1] + 5) * P.c.hq + 3) * P.c.d] = kNaN16; }},
      {"NaN in K of a prefix key (request 1, key 10, KV head 0)", true, true,
       [](Problem& P) { P.k8[kv_elem(P, 1, 10, 0, 3)] = nan8(P.c.kv8); }},
      {"NaN in V at a diagonal key (request 2, key 100, KV head 1)", true, true,
       [](Problem& P) { P.v8[kv_elem(P, 2, 100, 1, 7)] = nan8(P.c.kv8); }},
      {"NaN in V at request 2's last key", true, true,
       [](Problem& P) { P.v8[kv_elem(P, 2, 254, 0, 1)] = nan8(P.c.kv8); }},
      {"NaN (e4m3) / inf (e5m2) in V at a diagonal key (request 4, key 260)", true, true,
       [](Problem& P) { P.v8[kv_elem(P, 4, 260, 0, 2)] = P.c.kv8 == 1 ? 0xffu : 0x7cu; }},
  };
  Case paged8 = paged, pool8 = pool;
  paged8.name = "paged e4m3 scaled";
  paged8.kv8 = 1;
  paged8.scaled = true;
  pool8.name = "pool e5m2";
  pool8.kv8 = 2;
  Case mha8 = paged_mha;  // the sm90 FP8 kernel unpacked
  mha8.name = "paged MHA 2/2 e4m3";
  mha8.kv8 = 1;
  for (const Case* base : {&paged8, &mha8, &pool8}) {
    for (const Named& e : fp8_edits) {
      Problem P = make_problem(*base, rng);
      e.edit(P);
      ++total;
      failed += check_problem(P, base->name + ": " + e.name);
    }
  }
  std::printf("robustness: %d of %d cases failed\n", failed, total);
  return failed;
}

double useful_flops(const std::vector<int>& lq, const std::vector<int>& prefix, int hq, int d) {
  double s = 0.0;
  for (size_t b = 0; b < lq.size(); ++b)
    s += double(lq[b]) * prefix[b] + double(lq[b]) * (lq[b] + 1) / 2.0;
  return 4.0 * d * hq * s;
}

// Times each path on one problem; 1 when the sm90 and mma outputs disagree.
// --flush-l2: before every timed launch, a 256 MB memset evicts the problem from the 60 MB L2
// (outside the timed events), as the Python benchmarks' rotated input copies do. Without it a
// problem whose K and V fit in L2 (1 x (0 + 8192): 34 MB) is timed with them resident.
bool g_flush_l2 = false;

int bench_case(const char* name, const Case& c, std::mt19937& rng) {
  const Problem P = make_problem(c, rng);
  Device dev(P);
  constexpr size_t kFlushBytes = size_t(256) << 20;
  void* flush = nullptr;
  if (g_flush_l2) CUDA_OK(cudaMalloc(&flush, kFlushBytes));
  const double flops = useful_flops(c.lq, c.prefix, c.hq, c.d);
  std::vector<std::vector<uint16_t>> outs;
  int rc = 0;
  for (PrefillKernel which :
       {PrefillKernel::kSm90, PrefillKernel::kSm90Persistent, PrefillKernel::kMma}) {
    CUDA_OK(cudaMemset(dev.out, 0xff, dev.out_bytes));
    const char* err = dev.launch(c.f16, which);
    if (err != nullptr) {
      std::printf("  %-28s %-5s %s: %s\n", name, kernel_name(which),
                  is_sm90(which) && !g_sm90_expected ? "SKIP" : "FAIL", err);
      cudaGetLastError();
      if (!is_sm90(which) || g_sm90_expected) rc = 1;
      continue;
    }
    for (int i = 0; i < 2; ++i) dev.launch(c.f16, which);
    CUDA_OK(cudaDeviceSynchronize());
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    std::vector<float> ms;
#if JAXATTN_SM90_WAIT_STATS
    unsigned long long ws[jaxattn::gpu::kWaitStats];
    jaxattn::gpu::sm90_read_wait_stats(ws, true);
#endif
    for (int i = 0; i < 10; ++i) {
      if (flush != nullptr) CUDA_OK(cudaMemsetAsync(flush, i, kFlushBytes));
      CUDA_OK(cudaEventRecord(e0));
      dev.launch(c.f16, which);
      CUDA_OK(cudaEventRecord(e1));
      CUDA_OK(cudaEventSynchronize(e1));
      float t = 0.f;
      CUDA_OK(cudaEventElapsedTime(&t, e0, e1));
      ms.push_back(t);
    }
    CUDA_OK(cudaEventDestroy(e0));
    CUDA_OK(cudaEventDestroy(e1));
    std::sort(ms.begin(), ms.end());
    const double med = 0.5 * (ms[4] + ms[5]);
    std::printf("  %-28s %-5s %9.1f us  %6.1f TFLOP/s (useful)  [min %.1f us]\n", name,
                kernel_name(which), med * 1e3, flops / (med * 1e-3) / 1e12, ms[0] * 1e3);
#if JAXATTN_SM90_WAIT_STATS
    if (which == PrefillKernel::kSm90) {
      // Cycles a warp a key tile (the ten timed launches; consumer warps 8 a block, producer
      // warps 4), and the consumers' share of their span spent waiting.
      using namespace jaxattn::gpu;
      sm90_read_wait_stats(ws, true);
      const double ct = std::max(1.0, double(ws[kWaitConsumerTiles]));
      const double pt = std::max(1.0, double(ws[kWaitProducerTiles]));
      const double waited = double(ws[kWaitConsumerK]) + double(ws[kWaitConsumerV]);
      std::printf(
          "  %-28s waits, cycles a warp a tile: consumer K full %.0f, V full %.0f, "
          "span %.0f (waiting %.1f%%); producer K empty %.0f, V empty %.0f, copies "
          "%.0f, barrier %.0f\n",
          name, ws[kWaitConsumerK] / ct, ws[kWaitConsumerV] / ct, ws[kWaitConsumerSpan] / ct,
          100.0 * waited / std::max(1.0, double(ws[kWaitConsumerSpan])), ws[kWaitProducerK] / pt,
          ws[kWaitProducerV] / pt, ws[kWaitProducerCopies] / pt, ws[kWaitProducerSync] / pt);
    }
#endif
    outs.emplace_back(P.q.size());
    CUDA_OK(cudaMemcpy(outs.back().data(), dev.out, dev.out_bytes, cudaMemcpyDeviceToHost));
  }
  for (size_t k = 1; k < outs.size(); ++k) {  // every path against the first
    double md = 0.0;
    int64_t nan = 0;
    const int64_t valid = int64_t(P.nq) * c.hq * c.d;
    for (int64_t i = 0; i < valid; ++i) {
      const double a = dec(outs[0][i], c.f16), b = dec(outs[k][i], c.f16);
      if (!std::isfinite(a) || !std::isfinite(b)) ++nan;
      md = std::max(md, std::fabs(a - b));
    }
    const bool ok = nan == 0 && md <= 4.0 / 256;
    std::printf("  %-28s path %zu vs path 0: max abs diff %.3e, non-finite %lld  %s\n", name, k,
                md, (long long)nan, ok ? "PASS" : "FAIL");
    if (!ok) rc = 1;
  }
  if (flush != nullptr) CUDA_OK(cudaFree(flush));
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  bool checks = true, bench = true, robust = true, only_fp8 = false;
  int bench_blocks = 0;
  std::vector<std::array<int, 3>> bench_shapes;  // --shapes: B, prefix, new
  std::vector<int> bench_pages;  // --pages
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--no-bench") == 0) {
      bench = false;
    } else if (std::strcmp(argv[i], "--bench-only") == 0) {
      checks = robust = false;
    } else if (std::strcmp(argv[i], "--robust") == 0) {
      checks = bench = false;
    } else if (std::strcmp(argv[i], "--fp8") == 0) {  // the FP8 checks alone (for racecheck)
      only_fp8 = true;
      bench = robust = false;
    } else if (std::strcmp(argv[i], "--flush-l2") == 0) {
      g_flush_l2 = true;
    } else if (std::strcmp(argv[i], "--pages") == 0 && i + 1 < argc) {
      for (const char* t = argv[++i]; *t; ++t)  // comma-separated page sizes
        if (t == argv[i] || t[-1] == ',') bench_pages.push_back(std::atoi(t));
    } else if (std::strcmp(argv[i], "--shapes") == 0 && i + 1 < argc) {
      // B:prefix:new,... (every request of a row the same)
      for (const char* t = argv[++i]; *t; ++t) {
        if (t != argv[i] && t[-1] != ',') continue;
        int b = 0, pre = 0, lq = 0;
        if (std::sscanf(t, "%d:%d:%d", &b, &pre, &lq) == 3 && b > 0 && pre >= 0 && lq > 0)
          bench_shapes.push_back({b, pre, lq});
      }
    } else if (std::strcmp(argv[i], "--persistent-blocks") == 0 && i + 1 < argc) {
      bench_blocks = std::atoi(argv[++i]);  // the persistent launch's grid in the timings
    } else {
      std::fprintf(stderr,
                   "usage: %s [--no-bench | --bench-only | --robust | --fp8] [--flush-l2] "
                   "[--persistent-blocks N] [--pages P,...] [--shapes B:PREFIX:NEW,...]\n",
                   argv[0]);
      return 2;
    }
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line out at once (a hang shows where)
  int dev = 0, major = 0, minor = 0;
  CUDA_OK(cudaGetDevice(&dev));
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, dev));
  CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CUDA_OK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
#if defined(JAXATTN_HAVE_SM90A)
  g_sm90_expected = major == 9 && minor == 0;
#endif
  std::printf("device: %s (cc %d.%d, %d SMs); sm90 path %s\n", prop.name, major, minor,
              prop.multiProcessorCount, g_sm90_expected ? "expected" : "not expected");

  std::mt19937 rng(1234);
  g_persistent_blocks = 3;  // the checks and the robustness cases: several items a block
  int failed = 0, total = 0;
  const Layout bshd = Layout::kBSHD, bhsd = Layout::kBHSD;
  if (checks) {
    // name, lq, prefix, hq, hkv, d, page_size, layout, pool, cap, f16, pad_rows
    const std::vector<Case> cases = {
        {"lq1 x4 prefixes 0/5/64/1000, 32/8 p16", {1, 1, 1, 1}, {0, 5, 64, 1000}, 32, 8, 128, 16,
         bshd, false, 0.f, false, 3},
        {"lq 3/17/255/1 mixed prefixes, 32/8 p16", {3, 17, 255, 1}, {5, 64, 0, 1000}, 32, 8, 128,
         16, bshd, false, 0.f, false, 5},
        {"same, bhsd p64 softcap 2", {3, 17, 255, 1}, {5, 64, 0, 1000}, 32, 8, 128, 64, bhsd,
         false, 2.f, false, 2},
        {"lq 255/17/0 prefix 1000/5/64, 8/8 p1", {255, 17, 0}, {1000, 5, 64}, 8, 8, 128, 1, bshd,
         false, 0.f, false, 0},
        {"pool (extend) 17/255/3, 4/1", {17, 255, 3}, {1000, 64, 0}, 4, 1, 128, 1, bshd, true,
         0.f, false, 7},
        {"pool softcap 5, 8/8", {255, 1}, {5, 64}, 8, 8, 128, 1, bshd, true, 5.f, false, 1},
        {"lq 300 prefix 1000 (11 key tiles), 8/8 p16", {300}, {1000}, 8, 8, 128, 16, bshd, false,
         0.f, false, 0},
        {"lq 129/128/127 prefix 127/128/129, 4/1 bhsd", {129, 128, 127}, {127, 128, 129}, 4, 1,
         128, 16, bhsd, false, 0.f, false, 4},
        {"lq 255 prefix 0, 4/1 bhsd p64 softcap 2", {255}, {0}, 4, 1, 128, 64, bhsd, false, 2.f,
         false, 0},
        {"f16 lq 17/255 prefix 64/1000, 32/8 p16", {17, 255}, {64, 1000}, 32, 8, 128, 16, bshd,
         false, 0.f, true, 2},
        {"D64 bf16 lq 255/3 prefix 64/5, 32/8 p16", {255, 3}, {64, 5}, 32, 8, 64, 16, bshd,
         false, 0.f, false, 3},
        {"D64 f16 pool softcap 2, 8/8", {17, 255}, {1000, 0}, 8, 8, 64, 1, bshd, true, 2.f, true,
         0},
        {"D64 bhsd p64 lq 1/255 prefix 1000/64, 4/1", {1, 255}, {1000, 64}, 4, 1, 64, 64, bhsd,
         false, 0.f, false, 1},
        // GQA: the sm90 kernel packs the group's heads into its tile rows (above too: every
        // case but the 8/8 ones); groups 2, 7 and 16 here.
        {"packed D64 f16 softcap 2: lq 17/3/40 prefix 64/1000/5, 32/8", {17, 3, 40},
         {64, 1000, 5}, 32, 8, 64, 16, bshd, false, 2.f, true, 3},
        {"packed group 2 bhsd: lq 9/50/200 prefix 300/0/7, 16/8", {9, 50, 200}, {300, 0, 7}, 16, 8,
         128, 16, bhsd, false, 0.f, false, 2},
        {"packed group 7 pool: lq 5/30/1 prefix 200/17/129, 28/4", {5, 30, 1}, {200, 17, 129}, 28,
         4, 128, 1, bshd, true, 0.f, false, 4},
        {"packed group 16: lq 8/9 prefix 130/0, 32/2", {8, 9}, {130, 0}, 32, 2, 128, 16, bshd,
         false, 0.f, false, 1},
    };
    // FP8 caches: kv8 1 = e4m3, 2 = e5m2; scaled: per-head scales.
    auto fp8 = [](Case c, const char* name, int kv8, bool scaled) {
      c.name = name;
      c.kv8 = kv8;
      c.scaled = scaled;
      return c;
    };
    const std::vector<Case> fp8_cases = {
        fp8(cases[0], "e4m3 scaled: lq1 x4 prefixes 0/5/64/1000, 32/8 p16", 1, true),
        fp8(cases[1], "e4m3 scaled: lq 3/17/255/1 mixed prefixes, 32/8", 1, true),
        fp8(cases[2], "e5m2: bhsd p64 softcap 2", 2, false),
        fp8(cases[4], "e5m2 scaled: pool (extend) 17/255/3, 4/1", 2, true),
        fp8(cases[6], "e4m3: lq 300 prefix 1000 (11 key tiles), 8/8", 1, false),
        fp8(cases[7], "e5m2 scaled: lq 129/128/127, 4/1 bhsd", 2, true),
        fp8(cases[9], "e4m3 scaled f16: lq 17/255 prefix 64/1000, 32/8", 1, true),
        fp8(cases[10], "e4m3 scaled D64: lq 255/3 prefix 64/5, 32/8", 1, true),
        fp8(cases[11], "e5m2 D64 f16 pool softcap 2, 8/8", 2, false),
    };
    std::printf("checks (vs CPU float64 reference):\n");
    for (const std::vector<Case>* list : {&cases, &fp8_cases}) {
      if (only_fp8 && list == &cases) continue;
      for (const Case& c : *list) {
        const int r = check_case(c, rng);
        ++total;
        if (r == 1) ++failed;
      }
    }
    std::printf("checks: %d of %d cases failed\n", failed, total);
  }
  if (robust) {
    std::printf("robustness (index contract and NaN rules, vs the same reference):\n");
    failed += run_robustness(rng);
  }
  if (bench) {
    g_persistent_blocks = bench_blocks;
    // --pages (the two long rows over pages of those sizes) and --shapes (rows of any shape):
    // these rows instead of the default timings.
    std::vector<std::pair<std::string, Case>> rows;
    char name[64];
    for (const int ps : bench_pages) {
      Case big = {"", {}, {}, 32, 8, 128, ps, bshd, false, 0.f, false, 0};
      big.lq.assign(8, 512);
      big.prefix.assign(8, 2048);
      std::snprintf(name, sizeof(name), "8 x (2048 + 512) page %d", ps);
      rows.emplace_back(name, big);
      std::snprintf(name, sizeof(name), "1 x (0 + 8192) page %d", ps);
      rows.emplace_back(name, Case{"", {8192}, {0}, 32, 8, 128, ps, bshd, false, 0.f, false, 0});
    }
    for (const auto& sh : bench_shapes) {
      Case c = {"", {}, {}, 32, 8, 128, 16, bshd, false, 0.f, false, 0};
      c.lq.assign(sh[0], sh[2]);
      c.prefix.assign(sh[0], sh[1]);
      std::snprintf(name, sizeof(name), "%d x (%d + %d)", sh[0], sh[1], sh[2]);
      rows.emplace_back(name, c);
    }
    if (!rows.empty()) {
      std::printf("timings (bf16, D=128, 32/8, bshd; median of 10 after warm-up):\n");
      for (const auto& [row_name, c] : rows)
        if (bench_case(row_name.c_str(), c, rng)) ++failed;
      std::printf("%s\n", failed ? "SELFTEST FAILED" : "SELFTEST PASSED");
      return failed ? 1 : 0;
    }
    std::printf("timings (bf16, D=128, 32/8, bshd, page 16 / pool; median of 10 after warm-up):\n");
    const Case big = {"", std::vector<int>(8, 512), std::vector<int>(8, 2048), 32, 8, 128, 16,
                      bshd, false, 0.f, false, 0};
    if (bench_case("8 x (2048 + 512)", big, rng)) ++failed;
    const Case longq = {"", {8192}, {0}, 32, 8, 128, 16, bshd, false, 0.f, false, 0};
    if (bench_case("1 x (0 + 8192)", longq, rng)) ++failed;
    const Case four = {"", std::vector<int>(4, 4096), std::vector<int>(4, 0), 32, 8, 128, 16,
                       bshd, false, 0.f, false, 0};
    if (bench_case("4 x (0 + 4096)", four, rng)) ++failed;
    // A short extend over a token pool: the sm90 kernel packs the 4 heads of a KV head into
    // its tile rows (prefill_sm90_packs); unpacked, the mma kernel served it faster.
    const Case extend = {"", std::vector<int>(32, 24), std::vector<int>(32, 1000), 32, 8, 128, 1,
                         bshd, true, 0.f, false, 0};
    if (bench_case("32 x (1000 + 24), pool", extend, rng)) ++failed;
    std::printf("timings over an e4m3 cache with per-head scales (bf16 q, the rest as above):\n");
    Case big8 = big, longq8 = longq, extend8 = extend;
    big8.kv8 = longq8.kv8 = extend8.kv8 = 1;
    big8.scaled = longq8.scaled = extend8.scaled = true;
    if (bench_case("8 x (2048 + 512) e4m3", big8, rng)) ++failed;
    if (bench_case("1 x (0 + 8192) e4m3", longq8, rng)) ++failed;
    if (bench_case("32 x (1000 + 24), pool, e4m3", extend8, rng)) ++failed;
  }
  std::printf("%s\n", failed ? "SELFTEST FAILED" : "SELFTEST PASSED");
  return failed ? 1 : 0;
}
