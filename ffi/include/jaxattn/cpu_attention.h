// Plain C++ implementations of every op: the math of the GPU kernels (base-2 logits, split-KV
// partials merged by their (max, sum) pairs), float32 accumulation, one thread.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "jaxattn/dtypes.h"
#include "jaxattn/params.h"

namespace jaxattn {
namespace cpu {

struct Partial {
  float m = -std::numeric_limits<float>::infinity();
  float l = 0.f;
};

// Running softmax over keys, in base 2; `acc` holds the unnormalised output.
class OnlineSoftmax {
 public:
  explicit OnlineSoftmax(int head_dim) : acc_(head_dim, 0.f) {}

  template <typename T>
  void add(float logit, const T* v) {
    const float m_new = std::max(st_.m, logit);
    const float alpha = std::exp2(st_.m - m_new);  // exp2(-inf) == 0 on the first key
    const float p = std::exp2(logit - m_new);
    st_.l = st_.l * alpha + p;
    for (size_t d = 0; d < acc_.size(); ++d) acc_[d] = acc_[d] * alpha + p * to_float(v[d]);
    st_.m = m_new;
  }

  const Partial& state() const { return st_; }
  float normalised(size_t d) const { return st_.l > 0.f ? acc_[d] / st_.l : 0.f; }

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

template <typename T>
void paged_decode(const DecodeParams& p) {
  const KvGeometry& g = p.kv;
  const int D = g.head_dim;
  const int group = p.num_q_heads / g.num_kv_heads;
  const T* q = static_cast<const T*>(p.q);
  const T* kc = static_cast<const T*>(p.k);
  const T* vc = static_cast<const T*>(p.v);
  T* out = static_cast<T*>(p.out);
  std::vector<float> qs;
  std::vector<float> parts_out;
  std::vector<Partial> parts;
  for (int b = 0; b < p.batch; ++b) {
    const int L = std::max(p.seq_lens[b], 0);
    const int32_t* bt = p.block_tables + int64_t(b) * p.block_table_stride;
    const int ps = p.partition_size > 0 ? p.partition_size : std::max(L, 1);
    const int nparts = (L + ps - 1) / ps;
    for (int h = 0; h < p.num_q_heads; ++h) {
      const int kvh = h / group;
      scaled_query(q + (int64_t(b) * p.num_q_heads + h) * D, D, p.ls.q_scale, qs);
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
      float m_max = -std::numeric_limits<float>::infinity();
      for (const Partial& pt : parts) m_max = std::max(m_max, pt.m);
      float l_tot = 0.f;
      std::vector<float> w(nparts);
      for (int i = 0; i < nparts; ++i) {
        w[i] = parts[i].l * std::exp2(parts[i].m - m_max);
        l_tot += w[i];
      }
      T* o = out + (int64_t(b) * p.num_q_heads + h) * D;
      for (int d = 0; d < D; ++d) {
        float acc = 0.f;
        for (int i = 0; i < nparts; ++i) acc += w[i] * parts_out[size_t(i) * D + d];
        o[d] = from_float<T>(l_tot > 0.f ? acc / l_tot : 0.f);
      }
    }
  }
}

template <typename T>
void prefill(const PrefillParams& p) {
  const KvGeometry& g = p.kv;
  const int D = g.head_dim;
  const int group = p.num_q_heads / g.num_kv_heads;
  const T* q = static_cast<const T*>(p.q);
  const T* kc = static_cast<const T*>(p.k);
  const T* vc = static_cast<const T*>(p.v);
  T* out = static_cast<T*>(p.out);
  std::fill(out, out + int64_t(p.total_q) * p.num_q_heads * D, from_float<T>(0.f));
  std::vector<float> qs;
  for (int b = 0; b < p.batch; ++b) {
    const int q0 = p.cu_seqlens_q[b];
    const int lq = p.cu_seqlens_q[b + 1] - q0;
    const int32_t* table = p.page_table + (p.page_indptr ? int64_t(p.page_indptr[b])
                                                         : int64_t(b) * p.page_table_stride);
    const int lk = p.seq_lens ? p.seq_lens[b] : p.page_indptr[b + 1] - p.page_indptr[b];
    for (int i = 0; i < lq; ++i) {
      // Shifted causal mask: row i sees key j iff j <= i + (Lk - Lq).
      const int visible = std::min(lk, i + lk - lq + 1);
      for (int h = 0; h < p.num_q_heads; ++h) {
        const int kvh = h / group;
        const int64_t row = (int64_t(q0) + i) * p.num_q_heads + h;
        scaled_query(q + row * D, D, p.ls.q_scale, qs);
        OnlineSoftmax sm(D);
        for (int j = 0; j < visible; ++j) {
          const int64_t off = kv_offset(g, table[j / g.page_size], j, kvh);
          sm.add(logit(qs.data(), kc + off, D, p.ls), vc + off);
        }
        for (int d = 0; d < D; ++d) out[row * D + d] = from_float<T>(sm.normalised(d));
      }
    }
  }
}

}  // namespace cpu
}  // namespace jaxattn
