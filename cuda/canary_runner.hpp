#pragma once
// The CUDA backend's scheduling of the device canary (a policy's online measurement, EchoKV's):
// which attend items are due, the staging of their queries, one launch per decode step, and the
// hand-over of finished measurements to the policy in step order.
#include <cuda_runtime.h>

#include <deque>
#include <kvq/cache/cache_config.hpp>
#include <kvq/cache/types.hpp>
#include <kvq/policy/policy.hpp>
#include <kvq/cuda/canary.hpp>
#include <kvq/cuda/paged_attention.hpp>
#include <kvq/store/store.hpp>
#include <span>
#include <vector>

#include "device_buffer.hpp"

KVQ_NAMESPACE_BEGIN
namespace detail {

/// An attend call with due canaries only stages the items' queries (its own launch copies them,
/// `decode_item::stage_row`); the canary of every layer of the step is launched together, once,
/// by `flush` at the next append to or attend of a layer with deferred items (before its rings
/// change), or at a sync. The launch writes [items][kv_heads][tiers] sums into a slot of mapped
/// pinned memory and records the slot's event; launches stay in step order, and `drain` ingests
/// them in that order once their events complete. One launch per canary step instead of one per
/// layer: the canary is latency-bound (a 128-key window), so 32 layers cost little more than one.
///
/// Not thread-safe; owned by one backend, on its stream.
class canary_runner {
 public:
  /// `cfg`, `pol` and `store` outlive the runner.
  canary_runner(const cache_config& cfg, policy& pol, const page_store& store) : cfg_(cfg), pol_(pol), store_(store) {}
  canary_runner(const canary_runner&) = delete;
  canary_runner& operator=(const canary_runner&) = delete;
  /// Waits for the launches in flight (they write the slots) and frees the slots.
  ~canary_runner();

  /// Takes the policy's device canary when it observes queries, and checks it against the cache
  /// shape; a policy that observes queries without one is refused.
  status init();

  /// Picks the items of an attend call whose step is due (the policy's host RNG, as on the CPU)
  /// and gives each a row of the query staging buffer: sets `launch_items[i].stage_row` of each.
  /// `arena`: the device arena (the canary reads the rings in it).
  status pick(std::span<const attend_item> items, int layer, const uint8_t* arena,
              std::span<cuda::decode_item> launch_items);
  /// Where the attend launch copies the picked items' queries; null when none is due.
  float* q_stage() const { return due_.empty() ? nullptr : q_stage_.ptr; }
  /// After the attend launch that staged their queries: the picked items wait for the step's flush.
  void defer(int layer);
  /// Launches every deferred canary if `layer` has deferred items (its rings are about to change).
  status flush_of(int layer);
  /// Launches the canary of every staged item (every layer of the step) in one launch.
  status flush();
  /// Ingests the finished launches in step order; with `wait`, all of them.
  status drain(bool wait);
  /// Whether the policy has a device canary (then it runs on the cache's stream).
  bool active() const { return proto_ != nullptr; }
  /// Device bytes of the query staging buffer.
  size_t staging_bytes() const { return q_stage_.count * sizeof(float); }
  /// Mapped pinned host bytes of the result slots.
  size_t pinned_bytes() const { return slots_.size() * slot_bytes(); }

 private:
  struct slot {
    double* host = nullptr;  // mapped pinned [max_sequences][kv_heads][tiers]
    double* dev = nullptr;   // its device alias
    cudaEvent_t done = nullptr;
  };
  struct entry {
    seq_id seq;
    int layer;
    int64_t context;
    int rows;  // query rows that see a key
  };
  struct launch {
    size_t slot;
    std::vector<entry> entries;
  };
  struct due_item {
    size_t index;  // in the attend call's items
    cuda::canary_item item;
    entry e;
  };

  cuda::canary_args args(std::span<const cuda::canary_item> items) const;
  size_t slot_bytes() const {
    return size_t(cfg_.shape.layers) * cfg_.max_sequences * cfg_.shape.kv_heads * spec_.tiers.size() * sizeof(double);
  }
  status take_slot(size_t& slot);

  const cache_config& cfg_;
  policy& pol_;
  canary_protocol* proto_ = nullptr;  ///< the policy's canary protocol (set by `init`)
  const page_store& store_;
  canary_spec spec_;
  std::vector<cuda::canary_item> deferred_items_;  // staged, not yet launched (this step's layers)
  std::vector<entry> deferred_entries_;
  std::vector<uint8_t> deferred_layer_;  // [layers] 1 while the layer has staged items
  std::vector<due_item> due_;            // this attend call's due items
  device_buffer<float> q_stage_;         // staged queries, [rows][q_heads * head_dim]
  int32_t staged_rows_ = 0;
  std::deque<slot> slots_;  // deque: slots never move (the destructor walks them)
  std::vector<size_t> free_slots_;
  std::deque<launch> pending_;
};

}  // namespace detail
KVQ_NAMESPACE_END
