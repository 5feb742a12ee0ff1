// Plain C++ implementations of every op: the math of the GPU kernels (base-2 logits, split-KV
// partials merged by their (max, sum) pairs), float32 accumulation, one thread. The index
// contract of jaxattn/guards.h is checked per sequence / request before any key is read.
// T is q's and the output's element type, C the cache's: T itself, or an FP8 format whose
// elements are widened exactly to float, with the per-head scales of HeadScales (k_scale in
// the logit factor, v_scale on the normalised output).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "jaxattn/dtypes.h"
#include "jaxattn/guards.h"
#include "jaxattn/params.h"

namespace jaxattn {
namespace cpu {

struct Partial {
  float m = -std::numeric_limits<float>::infinity();
  float l = 0.f;
};

// The maximum used to shift exponents: -inf (nothing seen yet) shifts by 0, so that
// exp2(-inf - shift) is 0 rather than NaN.
inline float shift_of(float m) { return m == -std::numeric_limits<float>::infinity() ? 0.f : m; }

// Normalised output: 0 when the row saw nothing (l == 0); NaN in acc or l stays NaN.
inline float normalise(float acc, float l) { return l == 0.f ? 0.f : acc / l; }

// Running softmax over keys, in base 2; `acc` holds the unnormalised output. A NaN logit or
// value makes l or acc NaN and nothing later turns it back into a number (std::fmax ignores
// NaN, so the maximum stays a number and every product below keeps the NaN).
class OnlineSoftmax {
 public:
  explicit OnlineSoftmax(int head_dim) : acc_(head_dim, 0.f) {}

  template <typename T>
  void add(float logit, const T* v) {
    const float m_new = std::fmax(st_.m, logit);
    const float shift = shift_of(m_new);
    const float alpha = std::exp2(st_.m - shift);  // 0 on the first key
    const float p = std::exp2(logit - shift);
    st_.l = st_.l * alpha + p;
    for (size_t d = 0; d < acc_.size(); ++d) acc_[d] = acc_[d] * alpha + p * to_float(v[d]);
    st_.m = m_new;
  }

  const Partial& state() const { return st_; }
  float normalised(size_t d) const { return normalise(acc_[d], st_.l); }

 private:
  Partial st_;
  std::vector<float> acc_;
};

template <typename T>
float logit(const float* q_scaled, const T* k, int head_dim, const LogitScale& ls) {
  float s = 0.f;
  for (int d = 0; d < head_dim; ++d) s += q_scaled[d] * to_float(k[d]);
  return ls.cap_log2e > 0.f ? ls.cap_log2e * std::tanh(s) : s;
}

template <typename T>
void scaled_query(const T* q, int head_dim, float q_scale, std::vector<float>& out) {
  out.resize(head_dim);
  for (int d = 0; d < head_dim; ++d) out[d] = to_float(q[d]) * q_scale;
}

inline int64_t kv_offset(const KvGeometry& g, int32_t page, int32_t t, int32_t h) {
  return int64_t(page) * g.page_stride + int64_t(t % g.page_size) * g.token_stride +
         int64_t(h) * g.head_stride;
}

// Every page id of the first `count` entries of a table row lies in [0, num_pages).
inline bool pages_ok(const int32_t* table, int32_t count, int32_t num_pages) {
  for (int32_t i = 0; i < count; ++i)
    if (!index_ok(table[i], num_pages)) return false;
  return true;
}

template <typename T>
void fill_rows(T* out, int64_t first, int64_t last, int64_t row_elems, float value) {
  if (last > first)
    std::fill(out + first * row_elems, out + last * row_elems, from_float<T>(value));
}

template <typename T, typename C = T>
void paged_decode(const DecodeParams& p) {
  const KvGeometry& g = p.kv;
  const int D = g.head_dim;
  const int group = p.num_q_heads / g.num_kv_heads;
  const T* q = static_cast<const T*>(p.q);
  const C* kc = static_cast<const C*>(p.k);
  const C* vc = static_cast<const C*>(p.v);
  T* out = static_cast<T*>(p.out);
  std::vector<float> qs;
  std::vector<float> parts_out;
  std::vector<Partial> parts;
  for (int b = 0; b < p.batch; ++b) {
    const int L = p.seq_lens[b];
    const int32_t* bt = p.block_tables + int64_t(b) * p.block_table_stride;
    if (!decode_bounds_ok(L, p.block_table_stride, g.page_size, g.num_pages) ||
        !pages_ok(bt, pages_for(L, g.page_size), g.num_pages)) {
      fill_rows(out, b, b + 1, int64_t(p.num_q_heads) * D, quiet_nan());
      continue;
    }
    const int ps = p.partition_size > 0 ? p.partition_size : std::max(L, 1);
    const int nparts = (L + ps - 1) / ps;
    for (int h = 0; h < p.num_q_heads; ++h) {
      const int kvh = h / group;
      const float k_scale = p.scales.k_of(kvh), v_scale = p.scales.v_of(kvh);
      scaled_query(q + (int64_t(b) * p.num_q_heads + h) * D, D, p.ls.q_scale * k_scale, qs);
      parts.assign(nparts, Partial{});
      parts_out.assign(size_t(nparts) * D, 0.f);
      for (int part = 0; part < nparts; ++part) {
        OnlineSoftmax sm(D);
        for (int t = part * ps; t < std::min(L, (part + 1) * ps); ++t) {
          const int64_t off = kv_offset(g, bt[t / g.page_size], t, kvh);
          sm.add(logit(qs.data(), kc + off, D, p.ls), vc + off);
        }
        parts[part] = sm.state();
        for (int d = 0; d < D; ++d) parts_out[size_t(part) * D + d] = sm.normalised(d);
      }
      // The split-KV combine: rescale each partition's normalised output by l_p * 2^(m_p - M).
      // A NaN l_p makes its weight NaN, and so the row.
      float m_max = -std::numeric_limits<float>::infinity();
      for (const Partial& pt : parts) m_max = std::fmax(m_max, pt.m);
      const float shift = shift_of(m_max);
      float l_tot = 0.f;
      std::vector<float> w(nparts);
      for (int i = 0; i < nparts; ++i) {
        w[i] = parts[i].l * std::exp2(parts[i].m - shift);
        l_tot += w[i];
      }
      T* o = out + (int64_t(b) * p.num_q_heads + h) * D;
      for (int d = 0; d < D; ++d) {
        float acc = 0.f;
        for (int i = 0; i < nparts; ++i) acc += w[i] * parts_out[size_t(i) * D + d];
        o[d] = from_float<T>(normalise(acc, l_tot) * v_scale);
      }
    }
  }
}

// qo_indptr (and kv_indptr) start at 0 and never decrease.
inline bool prefill_structure_ok(const PrefillParams& p) {
  for (const int32_t* ptr : {p.cu_seqlens_q, p.page_indptr}) {
    if (ptr == nullptr) continue;
    if (ptr[0] != 0) return false;
    for (int b = 0; b < p.batch; ++b)
      if (ptr[b + 1] < ptr[b]) return false;
  }
  return true;
}

template <typename T, typename C = T>
void prefill(const PrefillParams& p) {
  const KvGeometry& g = p.kv;
  const int D = g.head_dim;
  const int group = p.num_q_heads / g.num_kv_heads;
  const int64_t row_elems = int64_t(p.num_q_heads) * D;
  const T* q = static_cast<const T*>(p.q);
  const C* kc = static_cast<const C*>(p.k);
  const C* vc = static_cast<const C*>(p.v);
  T* out = static_cast<T*>(p.out);
  if (!prefill_structure_ok(p)) {
    fill_rows(out, 0, p.total_q, row_elems, quiet_nan());
    return;
  }
  fill_rows(out, 0, p.total_q, row_elems, 0.f);
  std::vector<float> qs;
  for (int b = 0; b < p.batch; ++b) {
    const int q0 = p.cu_seqlens_q[b];
    const int q1 = p.cu_seqlens_q[b + 1];
    const int lq = q1 - q0;
    const int32_t* table = p.page_table + (p.page_indptr ? int64_t(p.page_indptr[b])
                                                         : int64_t(b) * p.page_table_stride);
    const int lk = p.seq_lens ? p.seq_lens[b] : p.page_indptr[b + 1] - p.page_indptr[b];
    const int k1 = p.page_indptr ? p.page_indptr[b + 1] : 0;
    if (!prefill_bounds_ok(p, q0, q1, lk, k1) ||
        !pages_ok(table, pages_for(lk, g.page_size), g.num_pages)) {
      fill_rows(out, std::min(q0, p.total_q), std::min(q1, p.total_q), row_elems, quiet_nan());
      continue;
    }
    for (int i = 0; i < lq; ++i) {
      // Shifted causal mask: row i sees key j iff j <= i + (Lk - Lq).
      const int visible = std::min(lk, i + lk - lq + 1);
      for (int h = 0; h < p.num_q_heads; ++h) {
        const int kvh = h / group;
        const float v_scale = p.scales.v_of(kvh);
        const int64_t row = (int64_t(q0) + i) * p.num_q_heads + h;
        scaled_query(q + row * D, D, p.ls.q_scale * p.scales.k_of(kvh), qs);
        OnlineSoftmax sm(D);
        for (int j = 0; j < visible; ++j) {
          const int64_t off = kv_offset(g, table[j / g.page_size], j, kvh);
          sm.add(logit(qs.data(), kc + off, D, p.ls), vc + off);
        }
        for (int d = 0; d < D; ++d) out[row * D + d] = from_float<T>(sm.normalised(d) * v_scale);
      }
    }
  }
}

}  // namespace cpu
}  // namespace jaxattn
