// The AutoK policy: selection of the protected layers and shape binding.
#include <kvq/policy/autok.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

KVQ_NAMESPACE_BEGIN

result<autok_policy> autok_policy::create(std::vector<double> layer_sensitivity, autok_options opt) {
  if (!(opt.phi >= 0.0 && opt.phi <= 1.0))
    return status{errc::invalid_argument, fmt::format("autok: phi {} must be in [0, 1]", opt.phi)};
  if (layer_sensitivity.empty()) return status{errc::invalid_argument, "autok: the sensitivity vector has no layers"};
  for (auto f : {opt.high.k, opt.high.v, opt.low.k, opt.low.v})
    if (f >= format_count)
      return status{errc::invalid_argument, fmt::format("autok: format id {} is outside the format table", int(f))};
  double total = 0.0;
  for (size_t l = 0; l < layer_sensitivity.size(); ++l) {
    const double x = layer_sensitivity[l];
    if (!std::isfinite(x) || x < 0.0)
      return status{errc::invalid_argument,
                    fmt::format("autok: layer {} sensitivity {} must be finite and >= 0", l, x)};
    total += x;
  }
  autok_policy p;
  p.opt_ = opt;
  p.sens_ = std::move(layer_sensitivity);
  const size_t n = p.sens_.size();
  p.protect_.assign(n, false);
  std::vector<int> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return p.sens_[size_t(a)] > p.sens_[size_t(b)]; });
  const double goal = opt.phi * total * (1.0 - 1e-12);
  double cum = 0.0;
  for (int l : idx) {
    if (cum >= goal) break;
    p.protect_[size_t(l)] = true;
    p.order_.push_back(l);
    cum += p.sens_[size_t(l)];
  }
  p.share_ = total > 0.0 ? cum / total : 1.0;
  return p;
}

result<autok_policy> autok_policy::create(const sensitivity_profile& profile, format_id reference, autok_options opt) {
  if (status s = profile.validate(); !s.ok()) return status{s.code(), "autok: " + s.message()};
  auto per_layer = profile.per_layer(reference);
  if (!per_layer) return status{per_layer.error().code(), "autok: " + per_layer.error().message()};
  return create(std::move(per_layer).value(), opt);
}

std::string autok_policy::name() const {
  std::string prot;
  for (int l : order_) {
    if (!prot.empty()) prot += ',';
    prot += std::to_string(l);
  }
  return fmt::format("autok(phi={},high={},low={},protect={})", opt_.phi, format_pair_name(opt_.high),
                     format_pair_name(opt_.low), prot.empty() ? "none" : prot);
}

status autok_policy::bind(const cache_shape& shape) {
  if (size_t(shape.layers) != sens_.size())
    return {errc::invalid_argument,
            fmt::format("autok: sensitivities cover {} layers, the cache has {}", sens_.size(), shape.layers)};
  const auto check_pair = [&](format_pair p, const char* which) -> status {
    for (role r : {role::k, role::v})
      if (status s = check_shape(r == role::k ? p.k : p.v, r, shape.page_tokens, shape.head_dim); !s.ok())
        return {s.code(), fmt::format("autok, {} format: {}", which, s.message())};
    return {};
  };
  KVQ_TRY(check_pair(opt_.high, "high"));
  KVQ_TRY(check_pair(opt_.low, "low"));
  return {};
}

KVQ_NAMESPACE_END
