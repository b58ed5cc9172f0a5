#pragma once
/// \file
/// `random` policy: the control every allocation claim needs. It takes any
/// allocation (a `format_map`, e.g. `format_map::of(autok, layers, heads)`) and places the same
/// multiset of (K, V) format pairs on the (layer, kv head) grid in a random order, so the page
/// bytes are exactly those of the original.
///
/// The order is a Fisher-Yates shuffle driven by `std::mt19937_64` seeded with `seed`, with
/// indices drawn by rejection sampling (not `std::uniform_int_distribution`, whose algorithm the
/// standard leaves open): the same seed gives the same placement with every standard library.
/// Pairs move as units, so a K8V4 head stays K8V4.
///
/// Thread-safety: `choose` and `current` are const lookups.

#include <kvq/policy/policy.hpp>
#include <kvq/policy/sensitivity.hpp>

#include <cstdint>

KVQ_NAMESPACE_BEGIN

/// The shuffled allocation as a policy.
class KVQ_EXPORT random_policy final : public policy {
 public:
  /// Shuffles `source` with `seed`. Errors: a map whose entry count does not match its shape, or
  /// an id outside the format table.
  static result<random_policy> create(const format_map& source, uint64_t seed);

  /// Permutes `[0, n)` with the documented shuffle (exposed for tests and for reports).
  static std::vector<size_t> permutation(size_t n, uint64_t seed);

  /// The shuffled map.
  const format_map& map() const { return map_; }
  /// The map before shuffling.
  const format_map& source() const { return source_; }
  /// The seed of the shuffle.
  uint64_t seed() const { return seed_; }

  /// "random(seed=7)".
  std::string name() const override;
  /// Rejects a cache of another layer or head count, or formats that cannot store its pages.
  status bind(const cache_shape& shape) override;
  /// The allocated pair of (layer, kv head); fp16 outside the bound shape.
  format_pair current(int layer, int kv_head) const override {
    if (layer < 0 || layer >= map_.layers || kv_head < 0 || kv_head >= map_.kv_heads) return {};
    return map_.at(layer, kv_head);
  }

 private:
  random_policy() = default;
  format_map source_, map_;
  uint64_t seed_ = 0;
};

KVQ_NAMESPACE_END
