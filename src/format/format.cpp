// Format names, shape checks and the spec parser (grammar documented in format.hpp), bound to
// kvq's format list.
#include <kvq/format/format.hpp>
#include <kvq/format/spec.hpp>
#include <kvq/rotation/rotation.hpp>

#include <fmt/format.h>

#include <string>
#include <string_view>
#include <utility>

KVQ_NAMESPACE_BEGIN

std::string format_name(format_id id) { return format_name_in<format_list>(id); }

std::string format_pair_name(format_pair p) {
  if (p.k == p.v) return format_name(p.k);
  return fmt::format("k={},v={}", format_name(p.k), format_name(p.v));
}

status check_shape(format_id id, role r, int page_tokens, int head_dim) {
  if (id >= format_count) return {errc::invalid_argument, fmt::format("format id {} is not in the format table", int(id))};
  const auto& t = format_table[id];
  const std::string name = format_name(id);
  if (head_dim <= 0 || page_tokens <= 0)
    return {errc::invalid_argument, fmt::format("head_dim {} and page_tokens {} must be positive", head_dim, page_tokens)};
  if (t.fam != family::fp16 && t.fam != family::bf16 && head_dim % 32 != 0)
    return {errc::invalid_argument,
            fmt::format("format {} needs head_dim a multiple of 32 (16-byte code rows); got head_dim {}", name, head_dim)};
  if (t.is_integer() || t.channel_groups()) {
    const bool tokens_axis = r == role::k && t.k_along_tokens();
    const int g = group_of(t, head_dim);
    if (tokens_axis && page_tokens % g != 0)
      return {errc::invalid_argument,
              fmt::format("format {} for {} groups {} tokens, which does not divide page_tokens {}", name, role_name(r), g,
                          page_tokens)};
    if (!tokens_axis && head_dim % g != 0)
      return {errc::invalid_argument,
              fmt::format("format {} for {} groups {} channels, which does not divide head_dim {}", name, role_name(r), g,
                          head_dim)};
  }
  // 3-bit planes, codebook levels and the nvfp4 tensor scale are read with 16-byte loads: every
  // section of their pages starts 16-byte aligned.
  if (t.bits == 3 || t.fam == family::codebook || t.fam == family::nvfp4) {
    const page_layout l = layout_of(t, r, page_tokens, head_dim);
    const uint32_t plane = t.bits == 3 ? uint32_t(page_tokens) * uint32_t(head_dim) / 4 : 0;
    for (uint32_t bytes : {plane, l.code_bytes, l.scale_bytes, l.zero_bytes})
      if (bytes % 16 != 0)
        return {
            errc::invalid_argument,
            fmt::format("format {} for {} needs page sections of whole 16-byte lines, but page_tokens {} x head_dim {} "
                        "gives a section of {} bytes",
                        name, role_name(r), page_tokens, head_dim, bytes)};
  }
  return {};
}

namespace {
// Names that stand for one format of the list.
constexpr std::pair<std::string_view, std::string_view> aliases[] = {{"int8", "sym8"}, {"int4", "sym4/g32"}, {"int2", "sym2/g32"}};

bool eat(std::string_view& s, std::string_view prefix) { return detail::eat_prefix(s, prefix); }

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}
}  // namespace

result<format_id> parse_format(std::string_view spec) {
  static const std::string valid = [] {
    std::string v = valid_format_names<format_list>();
    for (const auto& a : aliases) v += ", " + std::string(a.first);
    return v;
  }();
  spec = trim(spec);
  for (const auto& a : aliases)
    if (spec == a.first) return parse_format_in<format_list>(a.second, valid);
  return parse_format_in<format_list>(spec, valid);
}

result<format_pair> parse_format_pair(std::string_view spec) {
  const std::string_view orig = trim(spec);
  if (orig.empty()) return status{errc::invalid_argument, "empty format spec"};
  if (std::string_view rest = orig; detail::eat_rotation_suffix(rest))
    return status{errc::invalid_argument,
                  fmt::format("format spec '{}': '+rot' asks for a rotated head, which is a property of the cache "
                              "(cache_config::rotation), not of a page format; parse_format_spec reads it",
                              orig)};
  if (orig.find('=') == std::string_view::npos) {
    auto f = parse_format(orig);
    if (!f) return f.error();
    return format_pair{*f, *f};
  }
  format_pair out;
  bool have_k = false, have_v = false;
  std::string_view rest = orig;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    std::string_view part = trim(rest.substr(0, comma));
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    const bool is_k = eat(part, "k="), is_v = !is_k && eat(part, "v=");
    if (!is_k && !is_v)
      return status{errc::invalid_argument,
                    fmt::format("bad format spec '{}': part '{}' must start with k= or v=", orig, part)};
    bool& have = is_k ? have_k : have_v;
    if (have)
      return status{errc::invalid_argument, fmt::format("bad format spec '{}': {} given twice", orig, is_k ? "k" : "v")};
    auto f = parse_format(part);
    if (!f) return status{errc::invalid_argument, fmt::format("in spec '{}', {} part: {}", orig, is_k ? "k" : "v", f.error().message())};
    (is_k ? out.k : out.v) = *f;
    have = true;
  }
  if (!have_k || !have_v)
    return status{errc::invalid_argument, fmt::format("bad format spec '{}': needs both k= and v=", orig)};
  return out;
}

result<format_spec> parse_format_spec(std::string_view spec) {
  std::string_view rest = trim(spec);
  const bool rotated = detail::eat_rotation_suffix(rest);
  if (rotated && trim(rest).empty())
    return status{errc::invalid_argument, fmt::format("bad format spec '{}': '+rot' needs a format before it", trim(spec))};
  if (rest.find('+') != std::string_view::npos)
    return status{errc::invalid_argument,
                  fmt::format("bad format spec '{}': the only suffix is '+rot', at the end (e.g. kivi2/g32+rot)", trim(spec))};
  auto p = parse_format_pair(rest);
  if (!p) return p.error();
  return format_spec{*p, rotated};
}

std::string format_spec_name(const format_spec& s) {
  return format_pair_name(s.pair) + (s.rotated ? std::string(detail::rotation_suffix) : std::string());
}

KVQ_NAMESPACE_END
