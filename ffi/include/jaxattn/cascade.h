// Cascade decode: the argument block, the workspace layout and the index contract shared by the
// CPU and GPU implementations. Plain data, nothing from any framework.
//
// Request b continues prefix g = prefix_of[b] (-1: none): its keys are the first
// prefix_lens[g] tokens of prefix_tables[g] (whole pages), then its own seq_lens[b] tokens of
// block_tables[b]; the result equals paged decode over the joined table. Both levels produce
// partial states -- a normalised output and the (max, sum) pair in base 2 -- that an exact
// merge combines: own partitions at parts [0, own_parts), prefix partitions at parts
// [own_parts, own_parts + prefix_parts) of the request's workspace rows.
//
// The prefix level is cut into tiles (up to per_tile requests of one prefix: their query heads
// of one KV head are the rows of the kernel's products) and each tile's prefix into partitions.
// How many partitions depends on the batch's real number of tiles, known only on the device, so
// the kernel decides it (cascade_splits, the rule of jaxattn.backend.cascade_splits) and leaves
// it in the workspace's last element for the merge.
//
// Index contract (jaxattn/guards.h, jaxattn/reference/validity.py): request b is invalid when
// prefix_of[b] lies outside [-1, num_prefixes), when its own length or pages break the decode
// rule, or when its prefix is invalid: a length that is not a multiple of the page size within
// [0, prefix_table_stride * page_size], or a page id among its first prefix_lens[g] / page_size
// entries outside [0, num_pages). An invalid request's rows are NaN; every other request is
// exact, and a prefix no request continues is never read.
#pragma once

#include <cstdint>

#include "jaxattn/guards.h"
#include "jaxattn/params.h"

namespace jaxattn {

struct CascadeParams {
  const void* q = nullptr;  // [batch, num_q_heads, head_dim]
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* prefix_tables = nullptr;  // [num_prefixes, prefix_table_stride]
  const int32_t* prefix_lens = nullptr;    // [num_prefixes]
  const int32_t* prefix_of = nullptr;      // [batch]
  const int32_t* block_tables = nullptr;   // [batch, block_table_stride]: own pages
  const int32_t* seq_lens = nullptr;       // [batch]: own tokens
  void* out = nullptr;                     // [batch, num_q_heads, head_dim]
  // Partial outputs [batch, num_q_heads, parts, head_dim], then the (max, sum) pairs
  // [batch, num_q_heads, parts, 2], float32 (parts = own_parts + prefix_parts).
  float* workspace = nullptr;
  int32_t batch = 0;
  int32_t num_q_heads = 0;
  int32_t num_prefixes = 0;
  int32_t prefix_table_stride = 0;
  int32_t block_table_stride = 0;
  int32_t prefix_target = 1;   // prefix blocks the split aims at (jaxattn.backend.cascade_grid)
  int32_t partition_size = 0;  // own tokens per partition, 0: one pass
  int32_t own_parts = 1;       // partitions an own table row can need
  int32_t prefix_parts = 1;    // partitions a prefix can be cut into (the split's upper bound)
  KvGeometry kv;
  LogitScale ls{};
  // Per-KV-head scales of a scaled cache (params.h): k_scale joins each level's logit factor
  // and v_scale the merged output, so the parts' (max, sum) pairs stay comparable.
  HeadScales scales;
  // GPU tensor-core kernel's prefix level: 0 auto (wgmma on compute capability 9.0 when the
  // library has its sm_90a build, else mma.sync), 1 mma.sync, 2 wgmma (an error where it is
  // not available). The self-test times both; the CPU ignores it.
  int32_t prefix_kernel = 0;

  JAXATTN_HD int32_t parts() const { return own_parts + prefix_parts; }
  // Own tokens per partition (a one-pass partition covers the whole table row).
  JAXATTN_HD int32_t own_span() const {
    return partition_size > 0 ? partition_size : block_table_stride * kv.page_size;
  }
};

// The partial states, then one element for the split the kernel chose.
inline int64_t cascade_workspace_floats(int64_t batch, int64_t num_q_heads, int64_t parts,
                                        int64_t head_dim) {
  return batch * num_q_heads * parts * (head_dim + 2) + 1;
}

// The prefix split rule, in integers (jaxattn/backend.py: cascade_prefix_tiles, cascade_splits,
// cascade_chunk).
constexpr int32_t kCascadeStep = 64;       // partitions are whole key tiles
constexpr int32_t kCascadeMinChunk = 256;  // and, unless the prefix is shorter, this long

// Upper bound on the tiles of B requests over G prefixes.
JAXATTN_HD int32_t cascade_tiles(int32_t batch, int32_t num_prefixes, int32_t per_tile) {
  if (batch <= 0 || num_prefixes <= 0) return 0;
  const int32_t used = num_prefixes < batch ? num_prefixes : batch;
  const int32_t bound = (batch + per_tile - 1) / per_tile + used - 1;
  return bound < batch ? bound : batch;
}

// Prefix blocks per KV head in the grid (`tiles`: the batch's upper bound on tiles): every
// tile unsplit, and room for the split the rule picks for any real tile count T <= tiles. That
// split rounds target / (kv_heads T) half up, so T x splits can pass ceil(target / kv_heads)
// by up to T / 2: the grid holds that much more, or the split would be cut to fit (a batch of
// 6 tiles at target 132 and 8 KV heads: 2 partitions a tile instead of 3, and its longest
// prefix's blocks half as long again).
JAXATTN_HD int32_t cascade_blocks_per_head(int32_t tiles, int32_t target, int32_t kv_heads) {
  const int32_t want = (target + kv_heads - 1) / kv_heads + (tiles + 1) / 2;
  return tiles == 0 ? 0 : (tiles > want ? tiles : want);
}

// Partitions per prefix for `tiles` real tiles: target / (kv_heads * tiles) rounded half up,
// within [1, max_splits] and within the grid.
JAXATTN_HD int32_t cascade_splits(int32_t tiles, int32_t target, int32_t kv_heads, int32_t per_head,
                                  int32_t max_splits) {
  const int64_t t = tiles > 1 ? tiles : 1;
  int64_t s = (2 * int64_t(target) + kv_heads * t) / (2 * kv_heads * t);
  if (s > per_head / t) s = per_head / t;
  if (s > max_splits) s = max_splits;
  return s < 1 ? 1 : int32_t(s);
}

// Tokens per partition of a prefix of len tokens cut into up to `splits`.
JAXATTN_HD int32_t cascade_chunk(int32_t len, int32_t splits) {
  int32_t s = len / kCascadeMinChunk;
  s = s < splits ? s : splits;
  s = s < 1 ? 1 : s;
  const int32_t chunk = (len + s - 1) / s;
  const int32_t rounded = (chunk + kCascadeStep - 1) / kCascadeStep * kCascadeStep;
  return rounded > kCascadeStep ? rounded : kCascadeStep;
}

// A prefix of len tokens fits its table row in whole pages (and, with any token, needs a page).
JAXATTN_HD bool prefix_bounds_ok(int32_t len, int32_t width, int32_t page_size, int32_t num_pages) {
  return len >= 0 && len % page_size == 0 && int64_t(len) <= int64_t(width) * page_size &&
         (len == 0 || num_pages > 0);
}

// The scalar part of request b's contract: prefix_of in range, its prefix's length, its own
// length. *prefix_len: the prefix tokens it continues (0 without one). Page ids are checked
// where they are read.
JAXATTN_HD bool cascade_request_ok(const CascadeParams& p, int32_t b, int32_t* prefix_len) {
  *prefix_len = 0;
  const int32_t g = p.prefix_of[b];
  if (g < -1 || g >= p.num_prefixes) return false;
  if (g >= 0) {
    *prefix_len = p.prefix_lens[g];
    if (!prefix_bounds_ok(*prefix_len, p.prefix_table_stride, p.kv.page_size, p.kv.num_pages))
      return false;
  }
  return decode_bounds_ok(p.seq_lens[b], p.block_table_stride, p.kv.page_size, p.kv.num_pages);
}

// Parts request b has states in: its own partitions that hold tokens, and the partitions of its
// prefix (cut into up to `splits`).
JAXATTN_HD int32_t cascade_own_parts(const CascadeParams& p, int32_t own_len) {
  const int64_t span = p.own_span() > 0 ? p.own_span() : 1;
  return own_len <= 0 ? 0 : int32_t((int64_t(own_len) + span - 1) / span);
}

JAXATTN_HD int32_t cascade_prefix_parts(int32_t prefix_len, int32_t splits) {
  if (prefix_len <= 0) return 0;
  const int32_t chunk = cascade_chunk(prefix_len, splits);
  return (prefix_len + chunk - 1) / chunk;
}

// Workspace slot of (request b, query head h, part).
JAXATTN_HD int64_t cascade_slot(const CascadeParams& p, int32_t b, int32_t h, int32_t part) {
  return (int64_t(b) * p.num_q_heads + h) * p.parts() + part;
}

// The (max, sum) pairs follow the partial outputs.
JAXATTN_HD float* cascade_ml(const CascadeParams& p) {
  return p.workspace + int64_t(p.batch) * p.num_q_heads * p.parts() * p.kv.head_dim;
}

// The split the kernel chose, as an int32 in the workspace's last element.
JAXATTN_HD int32_t* cascade_split_slot(const CascadeParams& p) {
  return reinterpret_cast<int32_t*>(p.workspace + int64_t(p.batch) * p.num_q_heads * p.parts() *
                                                      (p.kv.head_dim + 2));
}

}  // namespace jaxattn
