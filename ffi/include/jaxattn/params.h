// Argument blocks shared by the CPU and GPU implementations. Plain data: raw pointers,
// element strides and sizes, nothing from any framework.
#pragma once

#include <cstdint>
#include <type_traits>

#include "jaxattn/dtypes.h"

namespace jaxattn {

enum class Layout : int32_t {
  kBSHD = 0,  // [num_pages, page_size, num_kv_heads, head_dim]
  kBHSD = 1,  // [num_pages, num_kv_heads, page_size, head_dim]
};

// Where token `off` of page `page`, head `h`, element `d` lives:
// page * page_stride + off * token_stride + h * head_stride + d (head_dim is contiguous).
struct KvGeometry {
  int32_t num_pages = 0;
  int32_t page_size = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int64_t page_stride = 0;
  int64_t token_stride = 0;
  int64_t head_stride = 0;
  // log2(page_size) when it is a power of two, else -1 (set by make_geometry / pool_geometry):
  // the page and the offset of a key without an integer division.
  int32_t page_shift = -1;

  // Page-table index and offset in its page of key t >= 0.
  JAXATTN_HD int page_of(int t) const { return page_shift >= 0 ? t >> page_shift : t / page_size; }
  JAXATTN_HD int slot_of(int t) const {
    return page_shift >= 0 ? t & (page_size - 1) : t % page_size;
  }
};

// The head dims the GPU kernels are built for: with_head_dim dispatches exactly these.
JAXATTN_HD constexpr bool head_dim_supported(int head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}

// f(std::integral_constant<int, D>{}) for the head dims the GPU kernels are built for (32, 64,
// 128 and 256); `unsupported`, the caller's error text, for any other.
template <typename F>
const char* with_head_dim(int head_dim, const char* unsupported, F&& f) {
  switch (head_dim) {
    case 32:
      return f(std::integral_constant<int, 32>{});
    case 64:
      return f(std::integral_constant<int, 64>{});
    case 128:
      return f(std::integral_constant<int, 128>{});
    case 256:
      return f(std::integral_constant<int, 256>{});
    default:
      return unsupported;
  }
}

inline int32_t page_shift_of(int64_t page_size) {
  if (page_size <= 0 || (page_size & (page_size - 1)) != 0) return -1;
  int32_t s = 0;
  while ((int64_t(1) << s) < page_size) ++s;
  return s;
}

inline KvGeometry make_geometry(Layout layout, int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
  KvGeometry g;
  g.num_pages = static_cast<int32_t>(d0);
  g.head_dim = static_cast<int32_t>(d3);
  if (layout == Layout::kBSHD) {
    g.page_size = static_cast<int32_t>(d1);
    g.num_kv_heads = static_cast<int32_t>(d2);
    g.token_stride = d2 * d3;
    g.head_stride = d3;
  } else {
    g.num_kv_heads = static_cast<int32_t>(d1);
    g.page_size = static_cast<int32_t>(d2);
    g.token_stride = d3;
    g.head_stride = d2 * d3;
  }
  g.page_stride = d1 * d2 * d3;
  g.page_shift = page_shift_of(g.page_size);
  return g;
}

// A token pool [num_slots, num_kv_heads, head_dim] is a paged cache with one token per page.
inline KvGeometry pool_geometry(int64_t num_slots, int64_t num_kv_heads, int64_t head_dim) {
  KvGeometry g;
  g.num_pages = static_cast<int32_t>(num_slots);
  g.page_size = 1;
  g.num_kv_heads = static_cast<int32_t>(num_kv_heads);
  g.head_dim = static_cast<int32_t>(head_dim);
  g.page_stride = num_kv_heads * head_dim;
  g.token_stride = 0;
  g.head_stride = head_dim;
  g.page_shift = 0;
  return g;
}

constexpr float kLog2e = 1.4426950408889634f;

// Logits are produced directly in base 2: with no cap, q is pre-multiplied by scale * log2(e);
// with a cap, q is pre-multiplied by scale / cap and the kernel applies cap * log2(e) * tanh.
struct LogitScale {
  float q_scale;
  float cap_log2e;  // 0 when there is no soft cap
};

inline LogitScale make_logit_scale(float scale, float soft_cap) {
  if (soft_cap > 0.f) return {scale / soft_cap, soft_cap * kLog2e};
  return {scale * kLog2e, 0.f};
}

// Scaled (FP8) caches: a stored element of KV head h stands for element * k_scale[h] (K) or
// element * v_scale[h] (V); nullptr means 1. The kernels fold them, per head, where exact
// enough to be free: k_scale into the logit factor (LogitScale::q_scale, f32), v_scale into the
// normalised output (a weighted mean of values is linear in them).
struct HeadScales {
  const float* k = nullptr;  // [num_kv_heads] float32, or nullptr
  const float* v = nullptr;

  JAXATTN_HD float k_of(int h) const { return k ? k[h] : 1.f; }
  JAXATTN_HD float v_of(int h) const { return v ? v[h] : 1.f; }
};

struct DecodeParams {
  const void* q = nullptr;  // [batch, num_q_heads, head_dim]
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* block_tables = nullptr;  // [batch, block_table_stride]
  const int32_t* seq_lens = nullptr;      // [batch]
  void* out = nullptr;                    // [batch, num_q_heads, head_dim]
  // Split-KV scratch: partial outputs [batch, num_q_heads, max_parts, head_dim], then the
  // (max, sum) pairs [batch, num_q_heads, max_parts, 2], both float32.
  float* workspace = nullptr;
  int32_t batch = 0;
  int32_t num_q_heads = 0;
  int32_t block_table_stride = 0;
  int32_t partition_size = 0;  // 0: one pass over the whole sequence per block
  int32_t max_parts = 1;
  KvGeometry kv;
  LogitScale ls{};
  HeadScales scales;
  // How the GPU decode copies K/V pages into shared memory: kDecodeCopiesAuto (the tensor
  // memory accelerator where paged_decode.cuh's decode_tma_usable holds and, for an FP8 cache,
  // the grid is one where it pays -- fp8_decode_tma_pays --, else 16-byte row gathers),
  // kDecodeCopiesGathers (the gathers always) or kDecodeCopiesTma (the tensor memory
  // accelerator wherever decode_tma_usable holds, whatever the grid: tests and timing). The CPU
  // kernel has no copies.
  int32_t copies = 0;
};
constexpr int32_t kDecodeCopiesAuto = 0;
constexpr int32_t kDecodeCopiesGathers = 1;
constexpr int32_t kDecodeCopiesTma = 2;

inline int64_t decode_workspace_floats(int64_t batch, int64_t num_q_heads, int64_t max_parts,
                                       int64_t head_dim) {
  return batch * num_q_heads * max_parts * (head_dim + 2);
}

// Prefix prefill (paged, block tables) and SGLang extend (token pool, kv_indptr/kv_indices)
// share one argument block: request b reads its page table row at
// page_table + (page_indptr ? page_indptr[b] : b * page_table_stride) and has
// seq_lens ? seq_lens[b] : page_indptr[b + 1] - page_indptr[b] keys. The index values are
// checked by the kernels (jaxattn/guards.h); the sizes here are the buffers' own.
struct PrefillParams {
  const void* q = nullptr;  // [total_q, num_q_heads, head_dim]
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* cu_seqlens_q = nullptr;  // [batch + 1]
  const int32_t* page_table = nullptr;
  const int32_t* page_indptr = nullptr;
  const int32_t* seq_lens = nullptr;
  int64_t page_table_len = 0;  // elements of page_table (kv_indices of a pool)
  void* out = nullptr;         // [total_q, num_q_heads, head_dim]
  int32_t batch = 0;
  int32_t total_q = 0;
  int32_t num_q_heads = 0;
  int32_t page_table_stride = 0;
  // GPU prefill kernel: a PrefillKernel value (0 auto, 1 sm90, 2 mma, 3 simt, 4 the sm90 kernel
  // persistent); the CPU has one.
  int32_t kernel = 0;
  // GPU sm90 kernel: query heads of one KV head packed into the rows of one tile (row r is
  // token r / pack_heads, head r % pack_heads of the block's heads); 1: one head a tile.
  // pack_magic = floor(2^32 / pack_heads) + 1 makes r / pack_heads one multiply-high for the
  // tile rows (exact for r < 2^28 at pack_heads <= 16). Set by the launcher, not by callers.
  int32_t pack_heads = 1;
  uint32_t pack_magic = 0;
  KvGeometry kv;
  LogitScale ls{};
  HeadScales scales;
  // GPU sm90 persistent launch: this many blocks, at most one an item (0: one a
  // multiprocessor). The self-test's checks launch few, so that every block loops over
  // several items; its timings may launch one an item (the persistent code, no item loop).
  int32_t persistent_blocks = 0;
  // GPU sm90 persistent launch: the counter its blocks claim work items from (one uint32 of
  // device memory, zeroed by the launcher before the kernel; the FFI's `work` result). Unused
  // by the other kernels and on the CPU.
  uint32_t* work_counter = nullptr;
};

// out[m, n] = sum_k x[m, k] w[k, n], f32 accumulation (jaxattn/native.py: linear). x [m, k]
// and w [k, n] row-major in one 16-bit dtype, out [m, n] in that dtype or f32. The GPU kernel
// (linear.cuh) cuts k into `splits` ranges of `rows_per_split` rows; with more than one, each
// range's partial sums go to `partial` (f32 [splits, m, n]) and the last block of a column
// tile to finish (counted in `counters`, int32 [column tiles], zeroed before the launch) adds
// them in split order.
// Columns of one block of the GPU kernel: its grid has linear_tiles(n) column tiles.
constexpr int kLinearTileCols = 256;
inline int linear_tiles(int64_t n) { return int((n + kLinearTileCols - 1) / kLinearTileCols); }

struct LinearParams {
  const void* x = nullptr;
  const void* w = nullptr;
  void* out = nullptr;
  float* partial = nullptr;
  int32_t* counters = nullptr;
  int32_t m = 0;
  int32_t k = 0;
  int32_t n = 0;
  int32_t splits = 1;
  int32_t rows_per_split = 0;
  bool out_f32 = false;
};

// add_rms_norm (jaxattn/add_norm.h): sum = x + d and normed = RMSNorm(sum) * w, rows of
// x, d, sum, normed [rows, cols] and w [cols], all in one float dtype.
//
// splits > 0: d is instead float32 [splits, rows, cols], the partial sums of a projection split
// along its contraction (split-K); its value is their float32 sum (in split order) rounded to
// T, as XLA's split-K GEMM computes the projection before the add.
struct AddNormParams {
  const void* x = nullptr;
  const void* d = nullptr;
  int32_t splits = 0;
  const void* w = nullptr;
  void* sum = nullptr;
  void* normed = nullptr;
  int32_t rows = 0;
  int32_t cols = 0;
  float eps = 0.f;
};

// A KV cache's element type: write_kv stores any float input into any of these.
enum class CacheDType : int32_t { kF32, kBF16, kF16, kE4M3, kE5M2, kUnsupported };

// write_kv (jaxattn/kv_write.h): the K and V rows [num_tokens, num_kv_heads, head_dim] of new
// tokens stored at their slots of a paged cache (page * page_size + offset), in place; the
// per-KV-head scales divide what is stored (nullptr: none).
struct WriteKvParams {
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* slots = nullptr;  // [num_tokens]
  int32_t num_tokens = 0;
  KvGeometry kv;
  HeadScales scales;
};

// rope_write_kv (jaxattn/kv_write.h): a fused projection's rows qkv [num_tokens, num_q_heads +
// 2 num_kv_heads, head_dim] (q heads, then k, then v) with rotate-half RoPE applied to q and k
// by the per-token tables cos, sin f32 [num_tokens, head_dim / 2]; the rotated q goes to q_out
// [num_tokens, num_q_heads, head_dim], the rotated k and the v rows into the caches as write_kv
// stores them (w.k and w.v unused).
//
// splits > 0: qkv is instead float32 [splits, num_tokens, H, head_dim], the partial sums of a
// projection split along its contraction; a row's value is their float32 sum (in split order)
// rounded to q_out's dtype, then rotated and stored as above.
struct RopeWriteKvParams {
  WriteKvParams w;
  const void* qkv = nullptr;
  int32_t splits = 0;
  const float* cos = nullptr;
  const float* sin = nullptr;
  void* q_out = nullptr;
  int32_t num_q_heads = 0;
};

}  // namespace jaxattn
