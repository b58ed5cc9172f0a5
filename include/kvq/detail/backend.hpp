#pragma once
/// \file
/// Internal: the backend interface behind `KVCache`. The base validates every request and keeps
/// the bookkeeping (`page_store`); a backend owns the bytes and runs the data plane. Not part of
/// the public API.

#include <kvq/cache/cache.hpp>
#include <kvq/store/store.hpp>

#include <functional>
#include <memory>
#include <vector>

KVQ_NAMESPACE_BEGIN
namespace detail {

class cache_backend {
 public:
  cache_backend(const cache_config& cfg, std::shared_ptr<policy> pol)
      : cfg_(cfg),
        pol_(std::move(pol)),
        store_(cfg.shape, cfg.budget_bytes, cfg.max_sequences),
        clip_(size_t(cfg.shape.layers) * cfg.shape.kv_heads * 2, 1.0f) {}
  virtual ~cache_backend() = default;

  /// Converts, validates (finite, within fp16 range) and stores m tokens; encodes the planned
  /// pages. Must leave the ring untouched when the values are rejected.
  virtual status write(sequence_state& s, int layer, const tensor_view& k, const tensor_view& v,
                       const append_plan& plan) = 0;
  /// One sequence of a validated batched append: its rows of k and v and its planned pages.
  struct batch_entry {
    sequence_state* s;
    const append_plan* plan;
    int64_t row;     ///< first row of the sequence in k and v
    int64_t tokens;  ///< rows of the sequence
  };
  /// `write` for several sequences of one layer, all or nothing: every value of every sequence
  /// is validated before anything is stored.
  virtual status write_batch(std::span<const batch_entry> entries, int layer, const tensor_view& k,
                             const tensor_view& v) = 0;
  /// Attention for a validated batch.
  virtual status attend(std::span<const attend_item> items, int layer, const tensor_view& q, const tensor_mut& o) = 0;
  /// Dequantized view of one (sequence, layer, role) into host memory.
  virtual status read(const sequence_state& s, int layer, role r, std::span<float> out) const = 0;
  /// Called after a sequence is created or released (device tables).
  virtual void on_sequence_change(const sequence_state&, bool /*created*/) {}
  /// Start of a validated append or attend: hand the policy the canary measurements that are
  /// complete, without waiting (the CUDA backend's device canary).
  virtual void poll_policy() {}
  /// Waits for every canary in flight and hands its measurement to the policy; returns the first
  /// failure since the last call (a launch, an event or a malformed measurement).
  virtual status sync_policy() { return {}; }
  /// Launches the deferred canaries without waiting (`KVCache::flush_policy`).
  virtual status flush_policy() { return {}; }

  cache_config cfg_;
  std::shared_ptr<policy> pol_;
  page_store store_;
  std::vector<float> clip_;  ///< [layers][kv_heads][2]

  float softmax_scale() const;
  float clip_of(int layer, int kv_head, role r) const {
    return clip_[(size_t(layer) * cfg_.shape.kv_heads + kv_head) * 2 + (r == role::k ? 0 : 1)];
  }
};

/// Rows [row, row + n) of a [tokens][heads][head_dim] view.
inline tensor_view rows_of(const tensor_view& t, int64_t row, int64_t n) {
  tensor_view r = t;
  r.data = static_cast<const uint8_t*>(t.data) + row * t.stride() * int64_t(dtype_size(t.type));
  r.tokens = n;
  r.token_stride = t.stride();
  return r;
}

/// Fills `out` [n][kv_heads][d] floats with what a step of `q_len` new tokens of (sequence, layer)
/// reads for role `r`: pages (through the codec) for encoded tokens older than the step, the FP16
/// ring for the rest. `page_at(entry)` and `ring_at(kv_head)` give host copies of the bytes.
void gather(const cache_shape& sh, const layer_state& ls, role r, int q_len,
            const std::function<const uint8_t*(const page_entry&)>& page_at,
            const std::function<const uint16_t*(int kv_head)>& ring_at, float* out);

/// The CPU reference backend, or an `out_of_budget` status when the host cannot hold the budget.
result<std::unique_ptr<cache_backend>> make_cpu_backend(const cache_config& cfg, std::shared_ptr<policy> pol);
/// The CUDA backend, or an `unsupported` status when kvq was built without CUDA.
result<std::unique_ptr<cache_backend>> make_cuda_backend(const cache_config& cfg, std::shared_ptr<policy> pol);

}  // namespace detail
KVQ_NAMESPACE_END
