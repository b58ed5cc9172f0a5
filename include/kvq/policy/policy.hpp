#pragma once
/// \file
/// The policy interface: which format each new page gets. A policy returns formats and may
/// observe each step's queries; it never touches stored bytes (DESIGN.md section 6). Decisions
/// apply to pages created after them (forward-only tier changes).

#include <kvq/config.hpp>
#include <kvq/format/format.hpp>
#include <kvq/status.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

KVQ_NAMESPACE_BEGIN

/// Engine-chosen sequence identifier.
using seq_id = int64_t;

/// Shape of the cache a policy serves.
struct cache_shape {
  int layers = 0;
  int q_heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int page_tokens = 64;
  int window = 128;
  int recent = 64;
};

/// One page about to be created.
struct page_request {
  seq_id seq;
  int layer;
  int kv_head;
  role r;
  int64_t first_token;  ///< position of the page's first token in the sequence
};

/// What a policy sees of one attention step of one sequence, for policies that ask for it.
/// Host memory, valid only during the call.
struct query_observation {
  seq_id seq;
  int layer;
  int64_t context;        ///< tokens the step attends to (cached + new)
  int q_len;
  const float* q;         ///< [q_len][q_heads][head_dim]
  const uint16_t* window; ///< [kv_heads][2][window][head_dim] fp16 ring, slot = token % window
  int64_t window_first;   ///< oldest token the ring still holds
};

/// One canary evaluation of one layer: δ per (unit of the layer, tier). Produced by a policy's own
/// host measurement or by a backend running the policy's device canary (`policy::device_canary`).
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
/// query heads of its GQA group). Delivered through `policy::ingest`.
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

/// Decides the format of each new page. Implementations document their thread-safety; the cache
/// calls a policy from the thread that calls the cache.
class KVQ_EXPORT policy {
 public:
  virtual ~policy() = default;
  /// Short name with parameters, e.g. "static(kivi4/g32)".
  virtual std::string name() const = 0;
  /// Called once when a cache adopts the policy: reject shapes the policy cannot serve (a format
  /// that cannot take this head_dim or page size, a table made for another layer count).
  virtual status bind(const cache_shape& shape) = 0;
  /// Format for a new page. The default reads the role's half of `current` for the page's
  /// (layer, kv head), which is what every table-driven policy wants.
  virtual format_id choose(const page_request& req) {
    const format_pair p = current(req.layer, req.kv_head);
    return req.r == role::k ? p.k : p.v;
  }
  /// Current decision for (layer, kv_head) of a sequence not yet seen: the format map of the
  /// statistics.
  virtual format_pair current(int layer, int kv_head) const = 0;
  /// True if `observe` should be called on every attention step.
  virtual bool wants_queries() const { return false; }
  virtual void observe(const query_observation&) {}

  // Device canary: a backend that cannot hand `observe` host copies (CUDA) runs the canary
  // itself. Per attention step of one sequence and layer it calls `note_observation`, then, if
  // `canary_due`, either `note_skipped` (no whole group in the window) or computes the
  // measurement of `device_canary()` and delivers it to `ingest`, possibly some steps later but
  // in the order of the steps. A policy whose `observe` would do exactly that on the host gets
  // the same state from both backends.

  /// The canary a backend may run for this policy; nullptr if it has none (or is not bound).
  /// Fixed from `bind` on; the pointer stays valid while the policy lives.
  virtual const canary_spec* device_canary() const { return nullptr; }
  /// True if the step of `seq` at `context` is a canary now (false while the policy is frozen).
  virtual bool canary_due(seq_id /*seq*/, int64_t /*context*/) const { return false; }
  /// Counts one attention step of one sequence and layer, as `observe` would.
  virtual void note_observation() {}
  /// Counts a due canary that had no whole token group to measure.
  virtual void note_skipped() {}
  /// Feeds one measurement; errors name a malformed one.
  virtual status ingest(const canary_measurement&) {
    return {errc::unsupported, "policy " + name() + " takes no canary measurements"};
  }
};

KVQ_NAMESPACE_END
