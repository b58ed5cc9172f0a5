#pragma once
/// \file
/// The canary protocol: how a policy that measures the damage a quantization would do on live
/// queries (EchoKV) lets a backend run that measurement itself, on the device, instead of being
/// handed host copies of the queries (`policy::observe`). Only such policies implement it;
/// `policy::canary()` returns it.

#include <kvq/config.hpp>
#include <kvq/core.hpp>
#include <kvq/format/format.hpp>
#include <kvq/status.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

KVQ_NAMESPACE_BEGIN

/// One canary evaluation of one layer: δ per (unit of the layer, tier). Produced by a policy's own
/// host measurement or by a backend running the policy's device canary (`canary_protocol::device_canary`).
struct canary_measurement {
  seq_id seq = 0;             ///< sequence of the step
  int layer = 0;              ///< layer measured
  int64_t context = 0;        ///< context length of the step
  std::vector<double> delta;  ///< [units of the layer: 1 or kv_heads][tiers] KL in nats, >= 0
};

/// What a backend computes when it runs a policy's canary itself, on the device, instead of
/// handing the policy host copies (`observe`). For one step of one sequence and one layer, with
/// K_ref the FP16 ring's keys in `canary_keys(align, window_first, context)` and f_t the codec of
/// `tiers[t]` (role K) applied to K_ref in groups of `align` tokens:
///
///     δ(u, t) = mean over the step's query rows and the query heads of unit u of
///               KL( softmax(s·q·K_ref) ‖ softmax(s·q·f_t(K_ref)) )
///
/// over the keys each query row may see (causal within a step of q_len > 1); rows that see no
/// key are left out. Units: one per layer (all query heads), or one per kv head (`per_head`: the
/// query heads of its GQA group). Delivered through `canary_protocol::ingest`.
struct canary_spec {
  std::vector<format_id> tiers;  ///< K format of each tier
  int align = 1;                 ///< token group the window is cut to (divides page_tokens)
  float softmax_scale = 0.f;     ///< s, resolved (never 0)
  bool per_head = false;         ///< units per kv head instead of per layer
};

/// Keys of the window a canary measures: whole groups of `align` tokens at multiples of `align`
/// inside [window_first, context). Empty (`end - first < align`) when no whole group fits.
struct canary_keys {
  int64_t first = 0;  ///< first key, a multiple of align
  int64_t end = 0;    ///< one past the last key, a multiple of align
  canary_keys(int64_t align, int64_t window_first, int64_t context)
      : first((window_first + align - 1) / align * align), end(context / align * align) {}
  int64_t count() const { return end - first; }
  /// Query rows of a step of `q_len` that see at least one of the keys (the last q_len tokens
  /// of the context are the step's; row i sees keys up to context - q_len + i).
  int rows_seeing(int q_len, int64_t context) const {
    return int(std::clamp<int64_t>(context - first, 0, q_len));
  }
};

/// The canary side of a policy. A backend that cannot hand `policy::observe` host copies (CUDA)
/// runs the canary itself: per attention step of one sequence and layer it calls
/// `note_observation`, then, if `canary_due`, either `note_skipped` (no whole group in the window)
/// or computes the measurement of `device_canary()` and delivers it to `ingest`, possibly some
/// steps later but in the order of the steps. A policy whose `observe` does exactly that on the
/// host gets the same state from both backends. Called from the thread that calls the cache.
class KVQ_EXPORT canary_protocol {
 public:
  virtual ~canary_protocol() = default;
  /// The canary a backend may run; nullptr while the policy is not bound. Fixed from `bind` on;
  /// the pointer stays valid while the policy lives.
  virtual const canary_spec* device_canary() const = 0;
  /// True if the step of `seq` at `context` is a canary now (false while the policy is frozen).
  virtual bool canary_due(seq_id seq, int64_t context) const = 0;
  /// Counts one attention step of one sequence and layer, as `observe` would.
  virtual void note_observation() = 0;
  /// Counts a due canary that had no whole token group to measure.
  virtual void note_skipped() = 0;
  /// Feeds one measurement; errors name a malformed one.
  virtual status ingest(const canary_measurement& m) = 0;
};

KVQ_NAMESPACE_END
