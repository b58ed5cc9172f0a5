#pragma once
/// \file
/// `autok` policy: protect the fewest layers that hold a share φ of the measured sensitivity.
///
/// Layers are sorted by sensitivity, largest first (ties: lower layer first), and taken until
/// their cumulative sensitivity reaches φ of the total; those layers get the `high` format pair,
/// the others the `low` one. φ = 0 protects nothing, φ = 1 protects every layer with a non-zero
/// sensitivity. The comparison "reaches" allows a relative slack of 1e-12 so that a decimal φ
/// such as 0.8 is not missed by the rounding of a sum.
///
/// The per-layer sensitivity is usually `sensitivity_profile::per_layer(reference)`: the damage
/// of a low reference format summed over kv heads and roles.
///
/// Thread-safety: `choose` and `current` are const lookups and may run concurrently after `bind`.

#include <kvq/policy/policy.hpp>
#include <kvq/policy/sensitivity.hpp>

#include <vector>

KVQ_NAMESPACE_BEGIN

/// Parameters of `autok_policy`.
struct autok_options {
  double phi = 0.5;    ///< share of the total sensitivity the protected layers must hold, in [0, 1]
  format_pair high{};  ///< formats of protected layers
  format_pair low{};   ///< formats of the other layers
};

/// The AutoK allocation as a policy. Construct with `create`, which validates the inputs.
class KVQ_EXPORT autok_policy final : public policy {
 public:
  /// Validates φ and the sensitivities (finite, >= 0, at least one layer) and selects the
  /// protected layers. Errors name the bad parameter or layer.
  static result<autok_policy> create(std::vector<double> layer_sensitivity, autok_options opt);
  /// Same, from a profile: the per-layer sum over heads and roles at `reference`.
  static result<autok_policy> create(const sensitivity_profile& profile, format_id reference, autok_options opt);

  /// The layers selected for protection, in the order they were taken (most sensitive first).
  const std::vector<int>& protected_layers() const { return order_; }
  /// True if `layer` is protected.
  bool is_protected(int layer) const {
    return layer >= 0 && size_t(layer) < protect_.size() && protect_[size_t(layer)];
  }
  /// Share of the total sensitivity the protected layers hold (1 when the total is 0).
  double protected_share() const { return share_; }
  /// The parameters the policy was created with.
  const autok_options& options() const { return opt_; }

  /// "autok(phi=0.5,high=kivi8/g32,low=kivi2/g32,protect=3,0)".
  std::string name() const override;
  /// Rejects a cache whose layer count differs from the sensitivity vector's, or formats that
  /// cannot store the cache's pages.
  status bind(const cache_shape& shape) override;
  /// `high` for a protected layer, else `low` (every head alike).
  format_pair current(int layer, int /*kv_head*/) const override { return is_protected(layer) ? opt_.high : opt_.low; }

 private:
  autok_policy() = default;
  autok_options opt_;
  std::vector<double> sens_;
  std::vector<bool> protect_;
  std::vector<int> order_;
  double share_ = 1.0;
};

KVQ_NAMESPACE_END
