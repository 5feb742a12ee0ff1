// Shape checks and argument blocks for the XLA FFI handlers, shared by the CPU and GPU
// bindings. The Python wrapper validates first; these checks keep a bad call from reaching a
// kernel when the targets are used directly. Only shapes are checked here: the values of the
// index arrays are checked by the kernels next to the reads they protect (jaxattn/guards.h);
// a GPU handler holds only device pointers.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "jaxattn/params.h"
#include "xla/ffi/api/ffi.h"

namespace jaxattn {
namespace ffi_common {

namespace ffi = xla::ffi;

// The version of the operand lists below (and of cascade_ffi.h's). jaxattn/native.py refuses
// a library that reports another (a stale build), instead of letting XLA fail on an operand
// count. 2: the per-head scale operands and FP8 caches; 3: the cascade target, with them;
// 4: the linear target; 5: the write_kv target; 6: the rope_write_kv and add_rms_norm targets;
// 7: rope_write_kv's qkv and add_rms_norm's d may be a split-K projection's float32 partials;
// 8: the GPU library's decode-blocks query (jaxattn_decode_head_blocks), which the split rule
// asks; 9: the paged decode's `copies` attribute (how the GPU kernels copy K/V pages); 10: its
// value 2 (kDecodeCopiesTma).
constexpr int kFfiAbi = 10;

enum class DType { kF32, kBF16, kF16, kUnsupported };

inline DType dtype_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32:
      return DType::kF32;
    case ffi::DataType::BF16:
      return DType::kBF16;
    case ffi::DataType::F16:
      return DType::kF16;
    default:
      return DType::kUnsupported;
  }
}

// The cache's element type relative to q's: the same, or an FP8 format.
enum class KvType { kSame, kE4M3, kE5M2, kUnsupported };

inline CacheDType cache_dtype_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32:
      return CacheDType::kF32;
    case ffi::DataType::BF16:
      return CacheDType::kBF16;
    case ffi::DataType::F16:
      return CacheDType::kF16;
    case ffi::DataType::F8E4M3FN:
      return CacheDType::kE4M3;
    case ffi::DataType::F8E5M2:
      return CacheDType::kE5M2;
    default:
      return CacheDType::kUnsupported;
  }
}

inline std::string dims_str(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

inline ffi::Error invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jaxattn: " + what);
}

// q and the output share a float dtype; the caches share q's dtype or an FP8 format.
inline ffi::Error check_dtypes(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                               const ffi::AnyBuffer& v, ffi::DataType out, KvType* kv) {
  if (dtype_of(q.element_type()) == DType::kUnsupported)
    return invalid("q must be float32, bfloat16 or float16");
  if (out != q.element_type()) return invalid("the output must have q's dtype");
  if (k.element_type() != v.element_type())
    return invalid("k_cache and v_cache must share one dtype");
  if (k.element_type() == q.element_type()) {
    *kv = KvType::kSame;
  } else if (k.element_type() == ffi::DataType::F8E4M3FN) {
    *kv = KvType::kE4M3;
  } else if (k.element_type() == ffi::DataType::F8E5M2) {
    *kv = KvType::kE5M2;
  } else {
    return invalid("the KV cache must have q's dtype, float8_e4m3fn or float8_e5m2");
  }
  return ffi::Error::Success();
}

// k_scale / v_scale: float32 [num_kv_heads], or empty for 1.0.
inline ffi::Error head_scales(const ffi::Buffer<ffi::F32>& k_scale,
                              const ffi::Buffer<ffi::F32>& v_scale, const KvGeometry& g,
                              HeadScales* s) {
  const ffi::Buffer<ffi::F32>* bufs[2] = {&k_scale, &v_scale};
  const float** dst[2] = {&s->k, &s->v};
  for (int i = 0; i < 2; ++i) {
    const auto d = bufs[i]->dimensions();
    if (d.size() != 1 || (d[0] != 0 && d[0] != g.num_kv_heads))
      return invalid(std::string(i ? "v_scale" : "k_scale") +
                     " must be float32 [num_kv_heads] or empty, got " + dims_str(d));
    *dst[i] = d[0] == 0 ? nullptr : bufs[i]->typed_data();
  }
  return ffi::Error::Success();
}

inline ffi::Error check_query(const ffi::AnyBuffer& q, const KvGeometry& g) {
  const auto qd = q.dimensions();
  if (qd.size() != 3) return invalid("q must have rank 3, got " + dims_str(qd));
  if (qd[2] != g.head_dim)
    return invalid("q head_dim " + std::to_string(qd[2]) + " != cache head_dim " +
                   std::to_string(g.head_dim));
  if (g.num_kv_heads <= 0 || qd[1] % g.num_kv_heads != 0)
    return invalid("num_q_heads must be a multiple of num_kv_heads");
  if (g.page_size <= 0 || g.head_dim <= 0) return invalid("empty cache geometry");
  return ffi::Error::Success();
}

inline ffi::Error paged_geometry(const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, int32_t layout,
                                 KvGeometry* g) {
  const auto kd = k.dimensions();
  if (kd.size() != 4) return invalid("k_cache must have rank 4, got " + dims_str(kd));
  if (dims_str(kd) != dims_str(v.dimensions())) return invalid("k_cache and v_cache shapes differ");
  if (layout != 0 && layout != 1) return invalid("layout attribute must be 0 (bshd) or 1 (bhsd)");
  *g = make_geometry(static_cast<Layout>(layout), kd[0], kd[1], kd[2], kd[3]);
  return ffi::Error::Success();
}

inline ffi::Error make_decode_params(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                     const ffi::AnyBuffer& v, const ffi::Buffer<ffi::S32>& bt,
                                     const ffi::Buffer<ffi::S32>& seq_lens,
                                     const ffi::Buffer<ffi::F32>& k_scale,
                                     const ffi::Buffer<ffi::F32>& v_scale, ffi::AnyBuffer out,
                                     ffi::Buffer<ffi::F32> workspace, float scale, float soft_cap,
                                     int32_t layout, int32_t partition_size, int32_t copies,
                                     DecodeParams* p, KvType* kv) {
  if (auto e = check_dtypes(q, k, v, out.element_type(), kv); e.failure()) return e;
  if (auto e = paged_geometry(k, v, layout, &p->kv); e.failure()) return e;
  if (auto e = check_query(q, p->kv); e.failure()) return e;
  if (auto e = head_scales(k_scale, v_scale, p->kv, &p->scales); e.failure()) return e;
  const auto qd = q.dimensions();
  const auto bd = bt.dimensions();
  if (bd.size() != 2 || bd[0] != qd[0])
    return invalid("block_tables must be [batch, max_pages], got " + dims_str(bd));
  if (seq_lens.dimensions().size() != 1 || seq_lens.dimensions()[0] != qd[0])
    return invalid("seq_lens must be [batch]");
  if (partition_size < 0) return invalid("partition_size must be >= 0");
  if (copies != kDecodeCopiesAuto && copies != kDecodeCopiesGathers && copies != kDecodeCopiesTma)
    return invalid("copies must be 0 (auto), 1 (gathers) or 2 (tma)");
  p->copies = copies;
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->block_tables = bt.typed_data();
  p->seq_lens = seq_lens.typed_data();
  p->out = out.untyped_data();
  p->workspace = workspace.typed_data();
  p->batch = static_cast<int32_t>(qd[0]);
  p->num_q_heads = static_cast<int32_t>(qd[1]);
  p->block_table_stride = static_cast<int32_t>(bd[1]);
  p->partition_size = partition_size;
  const int64_t capacity = bd[1] * int64_t(p->kv.page_size);
  p->max_parts = partition_size > 0
                     ? static_cast<int32_t>((capacity + partition_size - 1) / partition_size)
                     : 1;
  if (p->max_parts < 1) p->max_parts = 1;
  if (partition_size > 0 &&
      int64_t(workspace.element_count()) <
          decode_workspace_floats(p->batch, p->num_q_heads, p->max_parts, p->kv.head_dim))
    return invalid("workspace too small for the requested partition_size");
  p->ls = make_logit_scale(scale, soft_cap);
  return ffi::Error::Success();
}

inline ffi::Error fill_prefill_query(const ffi::AnyBuffer& q, const ffi::Buffer<ffi::S32>& cu_q,
                                     ffi::AnyBuffer out, float scale, float soft_cap,
                                     int32_t kernel, PrefillParams* p) {
  if (auto e = check_query(q, p->kv); e.failure()) return e;
  if (kernel < 0 || kernel > 4)
    return invalid(
        "kernel attribute must be 0 (auto), 1 (sm90), 2 (mma), 3 (simt) or 4 (sm90_persistent)");
  p->kernel = kernel;
  const auto qd = q.dimensions();
  if (cu_q.dimensions().size() != 1 || cu_q.dimensions()[0] < 1)
    return invalid("cu_seqlens_q / qo_indptr must be [batch + 1]");
  p->q = q.untyped_data();
  p->out = out.untyped_data();
  p->cu_seqlens_q = cu_q.typed_data();
  p->batch = static_cast<int32_t>(cu_q.dimensions()[0] - 1);
  p->total_q = static_cast<int32_t>(qd[0]);
  p->num_q_heads = static_cast<int32_t>(qd[1]);
  p->ls = make_logit_scale(scale, soft_cap);
  return ffi::Error::Success();
}

inline ffi::Error make_prefix_prefill_params(
    const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
    const ffi::Buffer<ffi::S32>& cu_q, const ffi::Buffer<ffi::S32>& bt,
    const ffi::Buffer<ffi::S32>& seq_lens, const ffi::Buffer<ffi::F32>& k_scale,
    const ffi::Buffer<ffi::F32>& v_scale, ffi::AnyBuffer out, float scale, float soft_cap,
    int32_t layout, int32_t kernel, PrefillParams* p, KvType* kv) {
  if (auto e = check_dtypes(q, k, v, out.element_type(), kv); e.failure()) return e;
  if (auto e = paged_geometry(k, v, layout, &p->kv); e.failure()) return e;
  if (auto e = fill_prefill_query(q, cu_q, out, scale, soft_cap, kernel, p); e.failure()) return e;
  if (auto e = head_scales(k_scale, v_scale, p->kv, &p->scales); e.failure()) return e;
  const auto bd = bt.dimensions();
  if (bd.size() != 2 || bd[0] != p->batch)
    return invalid("block_tables must be [batch, max_pages], got " + dims_str(bd));
  if (seq_lens.dimensions().size() != 1 || seq_lens.dimensions()[0] != p->batch)
    return invalid("seq_lens must be [batch]");
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->page_table = bt.typed_data();
  p->page_table_len = static_cast<int64_t>(bt.element_count());
  p->page_table_stride = static_cast<int32_t>(bd[1]);
  p->page_indptr = nullptr;
  p->seq_lens = seq_lens.typed_data();
  return ffi::Error::Success();
}

inline ffi::Error make_extend_params(
    const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
    const ffi::Buffer<ffi::S32>& qo_indptr, const ffi::Buffer<ffi::S32>& kv_indptr,
    const ffi::Buffer<ffi::S32>& kv_indices, const ffi::Buffer<ffi::F32>& k_scale,
    const ffi::Buffer<ffi::F32>& v_scale, ffi::AnyBuffer out, float scale, float soft_cap,
    int32_t kernel, PrefillParams* p, KvType* kv) {
  if (auto e = check_dtypes(q, k, v, out.element_type(), kv); e.failure()) return e;
  const auto kd = k.dimensions();
  if (kd.size() != 3) return invalid("k_cache must be [num_slots, num_kv_heads, head_dim]");
  if (dims_str(kd) != dims_str(v.dimensions())) return invalid("k_cache and v_cache shapes differ");
  p->kv = pool_geometry(kd[0], kd[1], kd[2]);
  if (auto e = fill_prefill_query(q, qo_indptr, out, scale, soft_cap, kernel, p); e.failure())
    return e;
  if (auto e = head_scales(k_scale, v_scale, p->kv, &p->scales); e.failure()) return e;
  if (kv_indptr.dimensions().size() != 1 || kv_indptr.dimensions()[0] != p->batch + 1)
    return invalid("kv_indptr must be [batch + 1] like qo_indptr");
  if (kv_indices.dimensions().size() != 1) return invalid("kv_indices must be rank 1");
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->page_table = kv_indices.typed_data();
  // kv_indices need not be kv_indptr[batch] long: the kernels check every request's keys
  // against this length.
  p->page_table_len = static_cast<int64_t>(kv_indices.element_count());
  p->page_table_stride = 0;
  p->page_indptr = kv_indptr.typed_data();
  p->seq_lens = nullptr;
  return ffi::Error::Success();
}

// out = x w (jaxattn/native.py: linear): x [m, k] and w [k, n] in one float dtype, out [m, n]
// in that dtype or float32. rows_per_split: 0, or the rows of w each split of the GPU kernel
// takes (splits = ceil(k / rows_per_split)); with more than one split the float32 workspace
// holds splits * m * n partial sums, then linear_tiles(n) counters.
inline ffi::Error make_linear_params(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                                     ffi::AnyBuffer& out, ffi::Buffer<ffi::F32>& workspace,
                                     int32_t rows_per_split, LinearParams* p) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || od.size() != 2)
    return invalid("linear takes x [m, k], w [k, n] and out [m, n]");
  if (xd[1] != wd[0] || od[0] != xd[0] || od[1] != wd[1])
    return invalid("linear: x " + dims_str(xd) + ", w " + dims_str(wd) + ", out " + dims_str(od) +
                   " do not chain");
  if (dtype_of(x.element_type()) == DType::kUnsupported || w.element_type() != x.element_type())
    return invalid("linear takes x and w in one float32/bfloat16/float16 dtype");
  if (out.element_type() != x.element_type() && out.element_type() != ffi::DataType::F32)
    return invalid("linear writes x's dtype or float32");
  if (xd[0] > INT32_MAX || xd[1] > INT32_MAX || wd[1] > INT32_MAX || rows_per_split < 0)
    return invalid("linear: sizes out of range");
  p->x = x.untyped_data();
  p->w = w.untyped_data();
  p->out = out.untyped_data();
  p->m = static_cast<int32_t>(xd[0]);
  p->k = static_cast<int32_t>(xd[1]);
  p->n = static_cast<int32_t>(wd[1]);
  const bool split = rows_per_split > 0 && rows_per_split < p->k;
  p->rows_per_split = split ? rows_per_split : p->k;
  p->splits = split ? (p->k + rows_per_split - 1) / rows_per_split : 1;
  p->out_f32 = out.element_type() == ffi::DataType::F32 && x.element_type() != ffi::DataType::F32;
  if (p->splits > 1) {
    const int64_t parts = int64_t(p->splits) * p->m * p->n;
    if (workspace.element_count() < size_t(parts + linear_tiles(p->n)))
      return invalid("linear: the workspace is smaller than the split needs");
    p->partial = workspace.typed_data();
    p->counters = reinterpret_cast<int32_t*>(workspace.typed_data() + parts);
  }
  return ffi::Error::Success();
}

// The caches of a K/V writer (`what`: write_kv, rope_write_kv): k_cache, v_cache (paged,
// `layout`) in one float or FP8 dtype and the results they alias (the results' buffers are the
// caches' when XLA honours the aliasing; otherwise the handlers copy the caches into them
// first). Sets the geometry, the cache dtype and the destination pointers.
inline ffi::Error write_kv_caches(const char* what, const ffi::AnyBuffer& k_cache,
                                  const ffi::AnyBuffer& v_cache, ffi::AnyBuffer k_out,
                                  ffi::AnyBuffer v_out, int32_t layout, WriteKvParams* p,
                                  CacheDType* cache) {
  if (auto e = paged_geometry(k_cache, v_cache, layout, &p->kv); e.failure()) return e;
  *cache = cache_dtype_of(k_cache.element_type());
  if (*cache == CacheDType::kUnsupported || v_cache.element_type() != k_cache.element_type())
    return invalid(std::string(what) + ": k_cache and v_cache must share one float or FP8 dtype");
  if (k_out.element_type() != k_cache.element_type() ||
      v_out.element_type() != v_cache.element_type() ||
      dims_str(k_out.dimensions()) != dims_str(k_cache.dimensions()) ||
      dims_str(v_out.dimensions()) != dims_str(v_cache.dimensions()))
    return invalid(std::string(what) + "'s results must be the caches' shapes and dtypes");
  p->k_cache = k_out.untyped_data();
  p->v_cache = v_out.untyped_data();
  return ffi::Error::Success();
}

// The rest of a K/V writer's operands: slots i32[T] and the scales f32 [Hkv] or empty.
inline ffi::Error write_kv_slots(const char* what, const ffi::Buffer<ffi::S32>& slots, int64_t T,
                                 const ffi::Buffer<ffi::F32>& k_scale,
                                 const ffi::Buffer<ffi::F32>& v_scale, WriteKvParams* p) {
  if (slots.dimensions().size() != 1 || slots.dimensions()[0] != T)
    return invalid(std::string(what) + ": slots must be [T]");
  if (T > INT32_MAX) return invalid(std::string(what) + ": too many tokens");
  if (auto e = head_scales(k_scale, v_scale, p->kv, &p->scales); e.failure()) return e;
  p->slots = slots.typed_data();
  p->num_tokens = static_cast<int32_t>(T);
  return ffi::Error::Success();
}

// write_kv: the caches (write_kv_caches); k, v [T, Hkv, D] in one float32/bfloat16/float16
// dtype; slots and scales (write_kv_slots).
inline ffi::Error make_write_kv_params(const ffi::AnyBuffer& k_cache, const ffi::AnyBuffer& v_cache,
                                       const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                       const ffi::Buffer<ffi::S32>& slots,
                                       const ffi::Buffer<ffi::F32>& k_scale,
                                       const ffi::Buffer<ffi::F32>& v_scale, ffi::AnyBuffer k_out,
                                       ffi::AnyBuffer v_out, int32_t layout, WriteKvParams* p,
                                       DType* in, CacheDType* cache) {
  if (auto e = write_kv_caches("write_kv", k_cache, v_cache, k_out, v_out, layout, p, cache);
      e.failure())
    return e;
  *in = dtype_of(k.element_type());
  if (*in == DType::kUnsupported || v.element_type() != k.element_type())
    return invalid("write_kv takes k and v in one float32/bfloat16/float16 dtype");
  const auto kd = k.dimensions();
  if (kd.size() != 3 || kd[1] != p->kv.num_kv_heads || kd[2] != p->kv.head_dim ||
      dims_str(kd) != dims_str(v.dimensions()))
    return invalid("write_kv: k and v must be [T, num_kv_heads, head_dim] of the cache, got " +
                   dims_str(kd) + " and " + dims_str(v.dimensions()));
  if (auto e = write_kv_slots("write_kv", slots, kd[0], k_scale, v_scale, p); e.failure()) return e;
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  return ffi::Error::Success();
}

// A projection handed over as its rows (rank `rank`, dtype `rows`) or as the float32 partial
// sums of a split-K GEMM, one leading axis more ([splits, ...]): *splits is 0 for rows, else
// the split count (1 to 2^31 - 1).
inline ffi::Error rows_or_partials(const char* op, const char* name, const ffi::AnyBuffer& b,
                                   size_t rank, ffi::DataType rows, const char* shape,
                                   int32_t* splits) {
  const auto dims = b.dimensions();
  const bool partials = dims.size() == rank + 1;
  if (partials ? b.element_type() != ffi::DataType::F32 : b.element_type() != rows)
    return invalid(std::string(op) + " takes " + name + " as rows " + shape +
                   " in the results' dtype, or as their float32 partial sums [splits, " +
                   (shape + 1));
  if (partials && (dims[0] < 1 || dims[0] > INT32_MAX))
    return invalid(std::string(op) + ": " + name + "'s partial sums need 1 to 2^31 - 1 splits");
  *splits = partials ? static_cast<int32_t>(dims[0]) : 0;
  return ffi::Error::Success();
}

// rope_write_kv: the caches (write_kv_caches); qkv [T, num_q_heads + 2 Hkv, D] in one
// float32/bfloat16/float16 dtype; cos, sin f32 [T, D / 2]; slots and scales
// (write_kv_slots); the result q_out [T, num_q_heads, D] in qkv's dtype.
inline ffi::Error make_rope_write_kv_params(
    const ffi::AnyBuffer& k_cache, const ffi::AnyBuffer& v_cache, const ffi::AnyBuffer& qkv,
    const ffi::Buffer<ffi::F32>& cos, const ffi::Buffer<ffi::F32>& sin,
    const ffi::Buffer<ffi::S32>& slots, const ffi::Buffer<ffi::F32>& k_scale,
    const ffi::Buffer<ffi::F32>& v_scale, ffi::AnyBuffer k_out, ffi::AnyBuffer v_out,
    ffi::AnyBuffer q_out, int32_t layout, int32_t num_q_heads, RopeWriteKvParams* p, DType* in,
    CacheDType* cache) {
  WriteKvParams& w = p->w;
  if (auto e = write_kv_caches("rope_write_kv", k_cache, v_cache, k_out, v_out, layout, &w, cache);
      e.failure())
    return e;
  // qkv [T, H, D] in q_out's dtype, or float32 [splits, T, H, D] partial sums.
  const auto full = qkv.dimensions();
  *in = dtype_of(q_out.element_type());
  if (*in == DType::kUnsupported)
    return invalid("rope_write_kv takes q_out in a float32/bfloat16/float16 dtype");
  if (auto e = rows_or_partials("rope_write_kv", "qkv", qkv, 3, q_out.element_type(), "[T, H, D]",
                                &p->splits);
      e.failure())
    return e;
  const auto xd = p->splits > 0 ? full.last(3) : full;
  const int64_t D = w.kv.head_dim, Hkv = w.kv.num_kv_heads;
  if (num_q_heads < 1 || D % 2 != 0 || xd.size() != 3 || xd[1] != num_q_heads + 2 * Hkv ||
      xd[2] != D)
    return invalid(
        "rope_write_kv: qkv must be [T, num_q_heads + 2 num_kv_heads, head_dim] of "
        "the cache (head_dim even), or [splits, T, ...] partial sums, got " +
        dims_str(full));
  const int64_t T = xd[0];
  const auto qd = q_out.dimensions();
  if (qd.size() != 3 || qd[0] != T || qd[1] != num_q_heads || qd[2] != D)
    return invalid("rope_write_kv: q_out must be [T, num_q_heads, head_dim]");
  for (const auto* table : {&cos, &sin}) {
    const auto td = table->dimensions();
    if (td.size() != 2 || td[0] != T || td[1] != D / 2)
      return invalid("rope_write_kv: cos and sin must be f32 [T, head_dim / 2], got " +
                     dims_str(td));
  }
  if (auto e = write_kv_slots("rope_write_kv", slots, T, k_scale, v_scale, &w); e.failure())
    return e;
  p->qkv = qkv.untyped_data();
  p->cos = cos.typed_data();
  p->sin = sin.typed_data();
  p->q_out = q_out.untyped_data();
  p->num_q_heads = num_q_heads;
  return ffi::Error::Success();
}

// add_rms_norm: x, d [rows, cols] and w [cols] in one float32/bfloat16/float16 dtype; the
// results sum and normed [rows, cols] in that dtype.
inline ffi::Error make_add_norm_params(const ffi::AnyBuffer& x, const ffi::AnyBuffer& d,
                                       const ffi::AnyBuffer& w, ffi::AnyBuffer sum,
                                       ffi::AnyBuffer normed, float eps, AddNormParams* p,
                                       DType* dtype) {
  *dtype = dtype_of(x.element_type());
  if (*dtype == DType::kUnsupported)
    return invalid("add_rms_norm takes float32/bfloat16/float16 rows");
  const auto xd = x.dimensions();
  // d [rows, cols] in x's dtype, or float32 [splits, rows, cols] partial sums.
  const auto dd = d.dimensions();
  if (auto e =
          rows_or_partials("add_rms_norm", "d", d, 2, x.element_type(), "[rows, cols]", &p->splits);
      e.failure())
    return e;
  const bool partials = p->splits > 0;
  for (const ffi::AnyBuffer* b :
       {&w, static_cast<const ffi::AnyBuffer*>(&sum), static_cast<const ffi::AnyBuffer*>(&normed)})
    if (b->element_type() != x.element_type())
      return invalid("add_rms_norm: w and the results must be in x's dtype");
  if (xd.size() != 2 || dims_str(partials ? dd.last(2) : dd) != dims_str(xd) ||
      dims_str(sum.dimensions()) != dims_str(xd) || dims_str(normed.dimensions()) != dims_str(xd))
    return invalid("add_rms_norm: x, d and the results must be one [rows, cols] shape, got " +
                   dims_str(xd) + " and " + dims_str(dd));
  if (w.dimensions().size() != 1 || w.dimensions()[0] != xd[1])
    return invalid("add_rms_norm: w must be [cols], got " + dims_str(w.dimensions()));
  if (xd[0] > INT32_MAX || xd[1] > INT32_MAX) return invalid("add_rms_norm: too large");
  p->x = x.untyped_data();
  p->d = d.untyped_data();
  p->w = w.untyped_data();
  p->sum = sum.untyped_data();
  p->normed = normed.untyped_data();
  p->rows = static_cast<int32_t>(xd[0]);
  p->cols = static_cast<int32_t>(xd[1]);
  p->eps = eps;
  return ffi::Error::Success();
}

// The operands and attributes of each op, appended to a binding that already holds the
// platform's context (nothing on the CPU, the stream on a GPU), so the CPU and GPU handlers
// cannot drift apart. Order: q, k_cache, v_cache, index arrays..., k_scale, v_scale, out,
// [workspace], attributes.
template <typename B>
auto bind_paged_attention(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<float>("scale")
      .template Attr<float>("soft_cap")
      .template Attr<int32_t>("layout")
      .template Attr<int32_t>("partition_size")
      .template Attr<int32_t>("copies");
}

template <typename B>
auto bind_prefix_prefill(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::U32>>()  // work: the persistent GPU prefill's counter
      .template Attr<float>("scale")
      .template Attr<float>("soft_cap")
      .template Attr<int32_t>("layout")
      .template Attr<int32_t>("kernel");
}

template <typename B>
auto bind_extend_attention(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::U32>>()  // work: the persistent GPU prefill's counter
      .template Attr<float>("scale")
      .template Attr<float>("soft_cap")
      .template Attr<int32_t>("kernel");
}

template <typename B>
auto bind_linear(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<int32_t>("rows_per_split");
}

template <typename B>
auto bind_write_kv(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int32_t>("layout");
}

template <typename B>
auto bind_add_rms_norm(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<float>("eps");
}

template <typename B>
auto bind_rope_write_kv(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int32_t>("layout")
      .template Attr<int32_t>("num_q_heads");
}

}  // namespace ffi_common
}  // namespace jaxattn
