#pragma once
/// \file
/// `static` policy: one format pair for every (layer, kv head), optionally overridden per layer
/// and per (layer, head), K and V separate. The table may be edited between steps; edits apply to
/// pages created afterwards (temporal striping).
///
/// Spec grammar (`parse`): `<pair>[;<layer>=<pair>][;<layer>.<head>=<pair>]...`, where `<pair>`
/// is a `parse_format_pair` spec. Example: `k=kivi4/g32,v=kivi2/g32;0=fp16;5.3=k=sym8,v=kivi4`.
///
/// Thread-safety: none; edit the table from the thread that drives the cache.

#include <kvq/policy/policy.hpp>

#include <map>
#include <string_view>
#include <utility>

KVQ_NAMESPACE_BEGIN

class KVQ_EXPORT static_policy final : public policy {
 public:
  explicit static_policy(format_pair all = {}) : all_(all) {}

  /// Parses the spec grammar above; errors name the bad clause.
  static result<static_policy> parse(std::string_view spec);

  void set_all(format_pair p) { all_ = p; }
  void set_layer(int layer, format_pair p) { layer_[layer] = p; }
  void set_head(int layer, int kv_head, format_pair p) { head_[{layer, kv_head}] = p; }

  std::string name() const override;
  status bind(const cache_shape& shape) override;
  format_pair current(int layer, int kv_head) const override {
    if (auto it = head_.find({layer, kv_head}); it != head_.end()) return it->second;
    if (auto it = layer_.find(layer); it != layer_.end()) return it->second;
    return all_;
  }

 private:
  format_pair all_;
  std::map<int, format_pair> layer_;
  std::map<std::pair<int, int>, format_pair> head_;
};

KVQ_NAMESPACE_END
