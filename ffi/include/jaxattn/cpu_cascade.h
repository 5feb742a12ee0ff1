// Cascade decode in plain C++ (the CPU handler): the math of the GPU kernels -- the prefix and
// each own partition an online softmax in base 2 over its tokens, the parts merged by their
// (max, sum) pairs -- with float32 accumulation, one thread, so the prefix in one part. The
// index contract of jaxattn/cascade.h is checked per request before any key is read. C is the
// cache's element type (T, or an FP8 format widened exactly), with the per-head scales as in
// cpu_attention.h: k_scale in both levels' logit factor, v_scale on the merged output.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "jaxattn/cascade.h"
#include "jaxattn/cpu_attention.h"

namespace jaxattn {
namespace cpu {

template <typename T, typename C = T>
void cascade_decode(const CascadeParams& p) {
  const KvGeometry& g = p.kv;
  const int D = g.head_dim;
  const int group = p.num_q_heads / g.num_kv_heads;
  const T* q = static_cast<const T*>(p.q);
  const C* kc = static_cast<const C*>(p.k);
  const C* vc = static_cast<const C*>(p.v);
  T* out = static_cast<T*>(p.out);
  std::vector<float> qs, parts_out;
  std::vector<Partial> parts;
  struct Range {
    const int32_t* table;
    int32_t start, end;
  };
  std::vector<Range> ranges;
  for (int b = 0; b < p.batch; ++b) {
    int32_t lp = 0;
    const int32_t L = p.seq_lens[b];
    const int32_t* own = p.block_tables + int64_t(b) * p.block_table_stride;
    bool ok = cascade_request_ok(p, b, &lp);
    const int32_t* pre = nullptr;
    if (ok && lp > 0) {
      pre = p.prefix_tables + int64_t(p.prefix_of[b]) * p.prefix_table_stride;
      ok = pages_ok(pre, lp / g.page_size, g.num_pages);
    }
    if (!ok || !pages_ok(own, pages_for(L, g.page_size), g.num_pages)) {
      fill_rows(out, b, b + 1, int64_t(p.num_q_heads) * D, quiet_nan());
      continue;
    }
    // The parts in workspace order: own partitions, then prefix splits.
    ranges.clear();
    const int32_t span = p.own_span();
    for (int32_t i = 0; i < cascade_own_parts(p, L); ++i)
      ranges.push_back({own, i * span, std::min(L, i * span + span)});
    if (lp > 0) ranges.push_back({pre, 0, lp});
    const int n = int(ranges.size());
    for (int h = 0; h < p.num_q_heads; ++h) {
      const int kvh = h / group;
      const float v_scale = p.scales.v_of(kvh);
      scaled_query(q + (int64_t(b) * p.num_q_heads + h) * D, D, p.ls.q_scale * p.scales.k_of(kvh),
                   qs);
      parts.assign(n, Partial{});
      parts_out.assign(size_t(n) * D, 0.f);
      for (int i = 0; i < n; ++i) {
        OnlineSoftmax sm(D);
        for (int32_t t = ranges[i].start; t < ranges[i].end; ++t) {
          const int64_t off = kv_offset(g, ranges[i].table[t / g.page_size], t, kvh);
          sm.add(logit(qs.data(), kc + off, D, p.ls), vc + off);
        }
        parts[i] = sm.state();
        for (int d = 0; d < D; ++d) parts_out[size_t(i) * D + d] = sm.normalised(d);
      }
      // The exact merge: each part's normalised output weighs l_i * 2^(m_i - M); a NaN l_i
      // makes the row NaN, and no part at all (l == 0) gives 0.
      float m_max = -std::numeric_limits<float>::infinity();
      for (const Partial& pt : parts) m_max = std::fmax(m_max, pt.m);
      const float shift = shift_of(m_max);
      float l_tot = 0.f;
      std::vector<float> w(n);
      for (int i = 0; i < n; ++i) {
        w[i] = parts[i].l * std::exp2(parts[i].m - shift);
        l_tot += w[i];
      }
      T* o = out + (int64_t(b) * p.num_q_heads + h) * D;
      for (int d = 0; d < D; ++d) {
        float acc = 0.f;
        for (int i = 0; i < n; ++i) acc += w[i] * parts_out[size_t(i) * D + d];
        o[d] = from_float<T>(normalise(acc, l_tot) * v_scale);
      }
    }
  }
}

}  // namespace cpu
}  // namespace jaxattn
