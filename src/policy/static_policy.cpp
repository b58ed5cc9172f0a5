// The static policy: spec parsing and shape binding.
#include <kvq/policy/static_policy.hpp>

#include <fmt/format.h>

#include <charconv>

KVQ_NAMESPACE_BEGIN

result<static_policy> static_policy::parse(std::string_view spec) {
  static_policy out;
  bool first = true;
  std::string_view rest = spec;
  while (true) {
    const size_t semi = rest.find(';');
    std::string_view clause = rest.substr(0, semi);
    if (first) {
      auto p = parse_format_pair(clause);
      if (!p) return p.error();
      out.all_ = *p;
      first = false;
    } else {
      const size_t eq = clause.find('=');
      if (eq == std::string_view::npos)
        return status{errc::invalid_argument, fmt::format("static policy clause '{}' needs <layer>[.<head>]=<formats>", clause)};
      std::string_view where = clause.substr(0, eq);
      int layer = -1, head = -1;
      const size_t dot = where.find('.');
      auto num = [](std::string_view s, int& v) {
        auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        return ec == std::errc() && p == s.data() + s.size() && v >= 0;
      };
      if (!num(where.substr(0, dot), layer) || (dot != std::string_view::npos && !num(where.substr(dot + 1), head)))
        return status{errc::invalid_argument,
                      fmt::format("static policy clause '{}': '{}' is not <layer> or <layer>.<head>", clause, where)};
      auto p = parse_format_pair(clause.substr(eq + 1));
      if (!p) return status{errc::invalid_argument, fmt::format("static policy clause '{}': {}", clause, p.error().message())};
      // a second clause for the same place would silently replace the first
      if (head < 0 ? out.layer_.count(layer) != 0 : out.head_.count({layer, head}) != 0)
        return status{errc::invalid_argument,
                      fmt::format("static policy '{}': {} is named twice (clause '{}')", spec,
                                  head < 0 ? fmt::format("layer {}", layer) : fmt::format("layer {} head {}", layer, head),
                                  clause)};
      if (head < 0)
        out.set_layer(layer, *p);
      else
        out.set_head(layer, head, *p);
    }
    if (semi == std::string_view::npos) break;
    rest = rest.substr(semi + 1);
  }
  return out;
}

std::string static_policy::name() const {
  std::string s = fmt::format("static({}", format_pair_name(all_));
  for (const auto& [l, p] : layer_) s += fmt::format(";{}={}", l, format_pair_name(p));
  for (const auto& [lh, p] : head_) s += fmt::format(";{}.{}={}", lh.first, lh.second, format_pair_name(p));
  return s + ")";
}

status static_policy::bind(const cache_shape& shape) {
  auto check_pair = [&](format_pair p, std::string_view where) -> status {
    for (role r : {role::k, role::v}) {
      status s = check_shape(r == role::k ? p.k : p.v, r, shape.page_tokens, shape.head_dim);
      if (!s.ok()) return {s.code(), fmt::format("static policy, {}: {}", where, s.message())};
    }
    return {};
  };
  KVQ_TRY(check_pair(all_, "default"));
  for (const auto& [l, p] : layer_) {
    if (l >= shape.layers)
      return {errc::invalid_argument, fmt::format("static policy names layer {}, the cache has {} layers", l, shape.layers)};
    KVQ_TRY(check_pair(p, fmt::format("layer {}", l)));
  }
  for (const auto& [lh, p] : head_) {
    if (lh.first >= shape.layers || lh.second >= shape.kv_heads)
      return {errc::invalid_argument, fmt::format("static policy names layer {} head {}, the cache has {} layers and {} kv heads",
                                                  lh.first, lh.second, shape.layers, shape.kv_heads)};
    KVQ_TRY(check_pair(p, fmt::format("layer {} head {}", lh.first, lh.second)));
  }
  return {};
}

KVQ_NAMESPACE_END
