#pragma once
/// \file
/// `kl_budget` policy: a per-(layer, kv head) allocation by a greedy over the damage per byte.
///
/// Every (layer, kv head, role) has a *ladder*: the candidate formats of the profile that can
/// store the cache's pages, ordered by page bytes for that role (scales and zeros included, from
/// `layout_of`), most bytes first; of candidates with equal bytes only the least damaging is kept.
/// Everyone starts on the top rung. A *transition* moves one (layer, kv head, role) one rung
/// down; its price is the damage it adds per byte it saves. The greedy applies the cheapest
/// transition available, again and again:
///
/// - `objective::kl_budget`: while the summed damage stays within the budget. A transition that
///   would exceed it is dropped together with the rest of its ladder, and the greedy continues
///   with the other ladders, so the budget is filled as far as single steps allow.
/// - `objective::bits_target`: the least damage for a byte target: transitions are applied until
///   the average bits per element (K and V pages, scales included) is at most the target.
///
/// Ties in price go to the lower (layer, head, role). The summed damage is the sum over
/// (layer, head) of K damage + `v_weight` * V damage at the chosen formats. When each ladder's
/// price per step increases going down (convex damage-vs-bytes), the greedy is optimal for the
/// bytes it ends at; with non-convex ladders it is a heuristic (it never jumps two rungs).
///
/// Thread-safety: after `bind`, `choose` and `current` are const lookups.

#include <kvq/policy/policy.hpp>
#include <kvq/policy/sensitivity.hpp>

#include <cstdint>
#include <vector>

KVQ_NAMESPACE_BEGIN

/// What the kl_budget greedy optimizes.
enum class kl_objective : uint8_t {
  kl_budget,    ///< fewest bytes with summed damage <= value
  bits_target,  ///< least damage with average bits per element <= value
};

/// Parameters of the kl_budget allocation.
struct kl_budget_options {
  kl_objective objective = kl_objective::kl_budget;  ///< which constraint `value` sets
  double value = 0.0;                                ///< damage budget, or average-bits target
  double v_weight = 1.0;                             ///< weight of V damage in the sum (units differ)
};

/// One applied transition of the greedy, in the order applied.
struct kl_transition {
  int layer = 0;             ///< layer of the moved unit
  int kv_head = 0;           ///< kv head of the moved unit
  role r = role::k;          ///< role of the moved unit
  format_id from = 0;        ///< format before
  format_id to = 0;          ///< format after (one rung down)
  double added = 0.0;        ///< damage added (weighted for V)
  uint64_t bytes_saved = 0;  ///< page bytes saved per page
};

/// Result of the greedy: the map and what it costs.
struct kl_allocation {
  format_map map;                    ///< [layers][kv_heads] chosen pairs
  double total_damage = 0.0;         ///< summed damage at the chosen formats (K + v_weight * V)
  double average_bits = 0.0;         ///< bits per K/V page element, scales and zeros included
  uint64_t page_bytes = 0;           ///< bytes of one page index over all (layer, head, role)
  std::vector<kl_transition> steps;  ///< transitions in the order applied
};

/// Runs the greedy for pages of `page_tokens` x `head_dim`. Errors: an invalid profile, a
/// (layer, head, role) without a usable candidate, a budget below the damage of the top rungs,
/// a bits target below what the bottom rungs reach (the message gives the reachable bound).
KVQ_EXPORT result<kl_allocation> allocate_kl_budget(const sensitivity_profile& profile, const kl_budget_options& opt,
                                                    int page_tokens, int head_dim);

/// The kl_budget allocation as a policy: the greedy runs in `bind`, for the cache's page shape.
class KVQ_EXPORT kl_budget_policy final : public policy {
 public:
  /// Keeps the profile and options; nothing is decided before `bind`.
  kl_budget_policy(sensitivity_profile profile, kl_budget_options opt) : profile_(std::move(profile)), opt_(opt) {}

  /// The allocation of the last successful `bind` (empty before).
  const kl_allocation& allocation() const { return alloc_; }

  /// "kl_budget(kl<=0.05)" or "kl_budget(bits<=4)", with the reached bits and damage once bound.
  std::string name() const override;
  /// Checks the profile against the cache shape (layers, kv heads) and runs the greedy.
  status bind(const cache_shape& shape) override;
  /// The allocated pair of (layer, kv head); fp16 outside the bound shape.
  format_pair current(int layer, int kv_head) const override {
    if (layer < 0 || layer >= alloc_.map.layers || kv_head < 0 || kv_head >= alloc_.map.kv_heads) return {};
    return alloc_.map.at(layer, kv_head);
  }

 private:
  sensitivity_profile profile_;
  kl_budget_options opt_;
  kl_allocation alloc_;
};

KVQ_NAMESPACE_END
