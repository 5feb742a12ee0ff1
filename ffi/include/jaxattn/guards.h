// The index contract every kernel keeps, CPU and GPU alike. Index arrays are data: no value in
// them may make a kernel read or write outside a buffer. A decode sequence or a prefill request
// whose indices do not describe valid keys gets a quiet NaN in every output row it owns (a
// poison the caller can see), every other sequence or request is computed exactly.
//
// Decode, sequence b with L = seq_lens[b], W = block_table_stride, P = page_size, N = num_pages:
// invalid when L < 0, L > W * P, or a page id table[b][t / P] for some t < L lies outside
// [0, N). Table entries past ceil(L / P) are never read.
//
// Prefill (paged: cu_seqlens_q + block tables + seq_lens; pool: qo_indptr + kv_indptr +
// kv_indices): the q indptr (and kv_indptr) must start at 0 and never decrease, otherwise every
// row of the output is NaN (no row can be assigned to a request). Request b, with
// lq = qo[b + 1] - qo[b] and lk its number of keys, is invalid when qo[b + 1] > total_q, its
// keys run past the table (paged: lk > W * P; pool: kv_indptr[b + 1] > len(kv_indices)),
// lk < lq, or one of its lk keys maps to a page / slot outside [0, N); its rows inside
// [0, total_q) are NaN. Rows past qo[batch] are zeros.
//
// The checks that need only a few scalars live here, shared by host and device code. The
// page-id checks sit where each kernel turns a page id into a row offset (see the kernels).
#pragma once

#include <cstdint>

#include "jaxattn/dtypes.h"
#include "jaxattn/params.h"

namespace jaxattn {

// i in [0, n) for n >= 0: one unsigned compare.
JAXATTN_HD bool index_ok(int32_t i, int32_t n) { return uint32_t(i) < uint32_t(n); }

JAXATTN_HD float quiet_nan() { return bits_float(0x7fc00000u); }

// A decode sequence of L tokens fits its block-table row (and, with any token, needs a page:
// over an empty cache every page id is out of range).
JAXATTN_HD bool decode_bounds_ok(int32_t L, int32_t table_width, int32_t page_size,
                                 int32_t num_pages) {
  return L >= 0 && int64_t(L) <= int64_t(table_width) * page_size && (L == 0 || num_pages > 0);
}

// Index entries (pages, or slots of a pool) that lk keys use.
JAXATTN_HD int32_t pages_for(int32_t lk, int32_t page_size) {
  return lk <= 0 ? 0 : int32_t((int64_t(lk) + page_size - 1) / page_size);
}

// The scalar part of a prefill request's contract, for a request whose indptr entries passed
// the structural check (0 <= q0 <= q1, and for a pool 0 <= kv_indptr[b] <= k1): its rows lie
// in q, it has at least as many keys as rows, and its keys stay inside its index array.
// k1 = kv_indptr[b + 1] for a pool, unused for block tables.
JAXATTN_HD bool prefill_bounds_ok(const PrefillParams& p, int32_t q0, int32_t q1, int32_t lk,
                                  int32_t k1) {
  if (q1 > p.total_q || lk < q1 - q0) return false;
  if (p.page_indptr != nullptr) return int64_t(k1) <= p.page_table_len;
  return int64_t(lk) <= int64_t(p.page_table_stride) * p.kv.page_size;
}

}  // namespace jaxattn
