// Configuration strings' cache suffixes (include/kvq/cache/config_string.hpp).
#include <kvq/cache/config_string.hpp>
#include <kvq/format/spec.hpp>

#include <fmt/format.h>

#include <charconv>
#include <string>

KVQ_NAMESPACE_BEGIN

result<cache_suffixes> parse_cache_suffixes(std::string_view config) {
  cache_suffixes c{config};
  const auto twice = [&](const char* what) {
    return status{errc::invalid_argument, fmt::format("configuration '{}': '+{}' given twice", config, what)};
  };
  for (;;) {
    // `+rot`: the format spec's own rotation suffix (detail::eat_rotation_suffix); with nothing
    // before it, left to the spec's parser, which rejects it
    if (std::string_view rest = c.spec; rest.size() > detail::rotation_suffix.size() && detail::eat_rotation_suffix(rest)) {
      if (c.rotated) return twice("rot");
      c.rotated = true;
      c.spec = rest;
      continue;
    }
    const size_t plus = c.spec.rfind('+');
    if (plus == std::string_view::npos || plus == 0) return c;
    const std::string_view tail = c.spec.substr(plus + 1);
    if (!tail.starts_with("sink")) return c;  // (a '+' of the spec itself)
    if (c.sink_pages > 0) return twice("sink");
    const std::string_view n = tail.substr(4);
    int pages = 1;
    if (!n.empty()) {
      const auto [end, ec] = std::from_chars(n.data(), n.data() + n.size(), pages);
      if (ec != std::errc() || end != n.data() + n.size() || pages < 1 || pages > 1024)
        return status{errc::invalid_argument,
                      fmt::format("configuration '{}': '+{}' is not a sink suffix (+sink, or +sink<N> for N pages, "
                                  "N in [1, 1024])",
                                  config, tail)};
    }
    c.sink_pages = pages;
    c.spec = c.spec.substr(0, plus);
  }
}

void cache_suffixes::apply(cache_config& cfg) const {
  cfg.rotation = rotated ? rotation_config::all(cfg.shape) : rotation_config{};
  cfg.sink_pages = sink_pages;
}

KVQ_NAMESPACE_END
