#pragma once
/// \file
/// EchoKV across tensor-parallel ranks (docs/architecture.md, "Tensor parallel"). Each rank's
/// `KVCache` holds its slice of the KV heads and runs its own `echokv_policy` (per-layer units)
/// on its own heads. The policy is put in agreement mode: its canary decisions become a
/// proposal, and new pages take only tiers all ranks agreed on. After each decode step the ranks
/// whose step held a canary (the canary draw is a function of (seed, sequence, context), so every
/// rank knows it without talking) gather every rank's proposal and apply
/// `echokv_policy::majority_vote`: per layer the tier most ranks propose, a tie to the highest of
/// the tied tiers. Every rank computes the vote from the same bytes in rank order, so all apply
/// the same tiers and no layer stores a page in one format on one rank and another elsewhere.
///
/// A failed exchange (a rank fails, times out or aborts: `communicator`) is a status on every
/// rank, and every rank keeps the tiers agreed before it (its proposal returns to them).

#include <cstdint>
#include <kvq/cache/cache.hpp>
#include <kvq/dist/communicator.hpp>
#include <kvq/policy/echokv.hpp>
#include <span>
#include <vector>

KVQ_NAMESPACE_BEGIN

namespace dist {

/// What one rank's vote did so far.
struct tp_vote_counters {
  uint64_t votes = 0;      ///< exchanges completed
  uint64_t moves = 0;      ///< (vote, layer) pairs whose agreed tier changed
  uint64_t overruled = 0;  ///< (vote, layer) pairs where this rank's proposal lost
  uint64_t failures = 0;   ///< exchanges that returned an error
};

/// One rank's side of the tier vote. Holds references to the rank's cache and communicator,
/// which must outlive it and not move (a moved-from `KVCache` is empty). Used from the thread
/// that drives the rank's cache.
class KVQ_EXPORT tp_echokv {
 public:
  /// Checks that the cache's policy is an `echokv_policy` in per-layer mode and, with one
  /// collective, that every rank has the same layers, tiers, canary rate and seed (so that all
  /// ranks draw the same canary steps); then turns the policy's agreement mode on. Every rank
  /// calls it. Errors: a policy that is not EchoKV or decides per kv head (`invalid_argument`:
  /// per-head units are each rank's own heads and need no vote), a rank whose configuration
  /// differs (`invalid_argument`, on every rank, naming the rank and the field), a failed
  /// exchange (`comm_error`).
  static result<tp_echokv> create(KVCache& cache, communicator& comm);

  /// To call after every decode step, once all layers of `seqs` are appended and attended (every
  /// rank with the same sequences). If the step of any sequence was a canary (`is_canary` at its
  /// length after the step), runs `vote`; returns whether it did. On the CUDA backend it first
  /// calls `KVCache::sync_policy`, so every rank's proposal includes the step's measurements.
  /// Errors: an unknown sequence (`not_found`, before any exchange: the group breaks so the other
  /// ranks fail too), those of `vote`.
  result<bool> end_step(std::span<const seq_id> seqs);

  /// Exchanges the proposals now and applies the majority (every rank calls it). On failure the
  /// policy keeps its agreed tiers and its proposal returns to them; the status says why (on
  /// every rank: the communicator breaks its group).
  status vote();

  /// The policy voted for.
  echokv_policy& policy() const { return *pol_; }
  /// Counters since `create`.
  const tp_vote_counters& counters() const { return counters_; }

 private:
  tp_echokv(KVCache& cache, echokv_policy& pol, communicator& comm) : cache_(&cache), pol_(&pol), comm_(&comm) {}

  KVCache* cache_;
  echokv_policy* pol_;
  communicator* comm_;
  std::vector<uint8_t> gathered_;  // [ranks][units] proposals of the last exchange
  tp_vote_counters counters_;
};

}  // namespace dist

KVQ_NAMESPACE_END
