#pragma once
/// \file
/// The policy interface: which format each new page gets. A policy returns formats and may
/// observe each step's queries; it never touches stored bytes. Decisions
/// apply to pages created after them (forward-only tier changes).

#include <kvq/config.hpp>
#include <kvq/core.hpp>
#include <kvq/format/format.hpp>
#include <kvq/policy/canary.hpp>
#include <kvq/status.hpp>

#include <cstdint>
#include <string>
#include <vector>

KVQ_NAMESPACE_BEGIN

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

  /// The canary protocol of a policy that measures damage on live queries and lets a backend
  /// run that measurement itself (EchoKV); nullptr for every other policy.
  virtual canary_protocol* canary() { return nullptr; }
};

KVQ_NAMESPACE_END
