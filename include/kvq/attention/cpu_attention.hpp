#pragma once
/// \file
/// The CPU backend's attention over quantized pages (src/attention/cpu_attention.cpp,
/// src/attention/cpu_page_decode.cpp): a page at a time is decoded into a float tile, shared by every query
/// of the kv head's GQA group, and folded into an online (flash-style) softmax in fp32. Work is
/// split into tasks of one (sequence, kv head) or one (kv head, query tile), run on a
/// `worker_pool`. `kvq::ref::attend` over `detail::gather` is the plain reference these are
/// tested against (tests/test_cpu_attention.cpp).
///
/// Internal to the library; exported so that tests and benchmarks can reach the pieces.

#include <kvq/attention/variant.hpp>
#include <kvq/config.hpp>
#include <kvq/format/unit_codec.hpp>
#include <kvq/core.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/store/store.hpp>
#include <kvq/tensor.hpp>

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

KVQ_NAMESPACE_BEGIN
namespace cpu {

/// Element `idx` of a host tensor of type `t`, as float.
inline float load(const void* base, dtype t, int64_t idx) {
  switch (t) {
    case dtype::f32: return static_cast<const float*>(base)[idx];
    case dtype::f16: return half_to_float(static_cast<const uint16_t*>(base)[idx]);
    case dtype::bf16: return bf16_to_float(static_cast<const uint16_t*>(base)[idx]);
  }
  return 0.f;
}

/// Stores `x` as element `idx` of a host tensor of type `t`.
inline void store(void* base, dtype t, int64_t idx, float x) {
  switch (t) {
    case dtype::f32: static_cast<float*>(base)[idx] = x; break;
    case dtype::f16: static_cast<uint16_t*>(base)[idx] = float_to_half(x); break;
    case dtype::bf16: static_cast<uint16_t*>(base)[idx] = float_to_bf16(x); break;
  }
}

/// The first element of rows [row0, row0 + rows) of `t` that is not finite or lies beyond the fp16
/// range (what no page or ring can store), in row order; `row` -1: none.
struct bad_value {
  int64_t row = -1;  ///< counted from row0
  int elem = 0;      ///< within the row: head * head_dim + channel
  float x = 0.f;
};
inline bad_value first_bad_value(const tensor_view& t, int64_t row0, int64_t rows) {
  const int w = t.heads * t.head_dim;
  for (int64_t i = 0; i < rows; ++i)
    for (int e = 0; e < w; ++e) {
      const float x = load(t.data, t.type, (row0 + i) * t.stride() + e);
      if (!std::isfinite(x) || std::fabs(x) > fp16_max) return {i, e, x};
    }
  return {};
}

/// Decodes tokens [0, rows) of a page into floats, one call per page: the same values as
/// `codec::decode_element` bit for bit (tests/test_cpu_attention.cpp checks every format), by
/// loops the compiler vectorizes. Pages hold finite values (the backends reject the rest).
/// \param out [rows][head_dim] float
KVQ_EXPORT void decode_page_rows(const codec::page_geom& g, const uint8_t* page, int rows, float* out);

/// A small persistent pool of worker threads; the calling thread works too. `run` returns when
/// every task is done. Not reentrant: one `run` at a time.
class KVQ_EXPORT worker_pool {
 public:
  /// `threads` in all, the caller included (1: everything runs on the caller, no thread made).
  explicit worker_pool(int threads);
  worker_pool(const worker_pool&) = delete;
  worker_pool& operator=(const worker_pool&) = delete;
  ~worker_pool();
  int threads() const { return int(workers_.size()) + 1; }
  /// Runs fn(0) .. fn(tasks - 1), spread over the pool.
  void run(int tasks, const std::function<void(int)>& fn);

 private:
  void work();
  void drain();
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int)>* fn_ = nullptr;
  int tasks_ = 0;
  std::atomic<int> next_{0};
  int busy_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

/// Where the stored K/V of one (sequence, layer) are, in host memory.
struct stored_layer {
  const cache_shape* shape;
  const layer_state* ls;
  const uint8_t* arena;       ///< the bytes page offsets point into
  const uint16_t* window;     ///< the layer's rings: [kv_heads][2 roles][window][head_dim] fp16
};

/// One sequence of a decode / extend batch: its stored K/V and its queries' first row.
struct attend_task_item {
  stored_layer kv;
  int q_len;
  int64_t row;  ///< first row of the item in q and o
};

/// `KVCache::attend` on the CPU: for every item, causal GQA attention of its q_len queries over
/// its n stored tokens (pages for encoded tokens older than the step, the ring for the rest;
/// docs/architecture.md, "attend"). `var` is the layer's attention rule: a query reads only the
/// pages its window reaches. Tasks: (item, kv head).
KVQ_EXPORT void attend(worker_pool& pool, std::span<const attend_task_item> items, const tensor_view& q,
                       const tensor_mut& o, float scale, const attention_variant& var = {});

/// `KVCache::attend_prefix` on the CPU: every query attends to the first `prefix` stored tokens,
/// read as stored now (pages for tokens < e, the ring for the rest), unmasked but for `var`: query
/// i stands at position prefix + i (the chunk follows the prefix) for its window, and its head's
/// sink logit joins this part (so that merging it with the chunk's own part counts it once).
/// \param lse [q.tokens][q_heads] natural-log log-sum-exp of the scaled scores (-inf if the
///        query sees no stored token and has no sink logit)
KVQ_EXPORT void attend_prefix(worker_pool& pool, const stored_layer& kv, int64_t prefix, const tensor_view& q,
                              const tensor_mut& o, float* lse, float scale, const attention_variant& var = {});

/// The attention half of `KVCache::prefill` on the CPU, after the chunk was appended: query i
/// of the chunk attends to the first `prefix` stored tokens (as `attend_prefix`) and, causally,
/// to chunk tokens 0..i of `k`/`v` rounded to fp16; the two parts merge by log-sum-exp. Tasks:
/// (kv head, tile of 64 queries).
KVQ_EXPORT void prefill(worker_pool& pool, const stored_layer& kv, int64_t prefix, const tensor_view& k,
                        const tensor_view& v, const tensor_view& q, const tensor_mut& o, float scale,
                        const attention_variant& var = {});

/// Runs fn(0) .. fn(tasks - 1), in any order and on any threads, and returns when every call
/// has returned: `worker_pool::run`, or a caller's own pool.
using task_runner = std::function<void(int tasks, const std::function<void(int)>& fn)>;

/// Causal GQA attention of a chunk of T queries at positions pos0 .. pos0 + T - 1 over contiguous
/// float keys and values of positions 0 .. pos0 + T - 1 (query i sees keys 0..pos0 + i; query
/// head h reads kv head h / (q_heads / kv_heads)), in fp32: the model runner's attention of a
/// prompt (tools/llama, `prefill_shared`). The same tile kernel as the chunk part of `prefill`:
/// K packed once per call in transposed blocks of 64 keys, query rows in pairs sharing each K
/// and V load, the online softmax of `attend`. Tasks: (kv head, tile of 32 queries), on `run`.
/// \param q [T][q_heads][head_dim]
/// \param k [pos0 + T][kv_heads][head_dim]
/// \param v same shape as k
/// \param o [T][q_heads][head_dim] output
/// \param var the layer's attention rule (window, soft-capping, sink logits); with a window, the
///        key blocks before the first query's window are skipped (every key must still be finite)
KVQ_EXPORT void causal_attention(const task_runner& run, const float* q, const float* k, const float* v, float* o,
                                 int64_t T, int64_t pos0, int q_heads, int kv_heads, int head_dim, float scale,
                                 const attention_variant& var = {});

}  // namespace cpu
KVQ_NAMESPACE_END
