// Format names, shape checks and the spec parser (grammar documented in format.hpp).
#include <kvq/format/format.hpp>

#include <fmt/format.h>

#include <charconv>
#include <string>

KVQ_NAMESPACE_BEGIN

std::string format_name(format_id id) {
  if (id >= format_count) return fmt::format("<invalid format id {}>", int(id));
  const auto& t = format_table[id];
  switch (t.fam) {
    case family::fp16:
    case family::bf16:
    case family::fp8_e4m3: return family_name(t.fam);
    case family::sym:
      return t.group == 0 ? fmt::format("sym{}", t.bits) : fmt::format("sym{}/g{}", t.bits, t.group);
    case family::kivi:
    case family::rolealign: return fmt::format("{}{}/g{}", family_name(t.fam), t.bits, t.group);
  }
  return "?";
}

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
  if (t.is_integer()) {
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
  return {};
}

namespace {
constexpr const char* valid_formats =
    "fp16, bf16, fp8, sym{8,4,2}[/g{32,64,128}], kivi{8,4,2}[/g{32,64,128}], ra{8,4,2}[/g{32,64,128}], int8, int4, int2";

bool eat(std::string_view& s, std::string_view prefix) {
  if (s.substr(0, prefix.size()) != prefix) return false;
  s.remove_prefix(prefix.size());
  return true;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}
}  // namespace

result<format_id> parse_format(std::string_view spec) {
  const std::string_view orig = spec = trim(spec);
  auto bad = [&](std::string_view why) -> status {
    return {errc::invalid_argument, fmt::format("bad format '{}': {}; valid formats: {}", orig, why, valid_formats)};
  };
  if (spec == "fp16" || spec == "f16") return format_id(find_format(family::fp16, 16, 1));
  if (spec == "bf16") return format_id(find_format(family::bf16, 16, 1));
  if (spec == "fp8" || spec == "fp8_e4m3") return format_id(find_format(family::fp8_e4m3, 8, 1));
  if (spec == "int8") return format_id(find_format(family::sym, 8, 0));
  if (spec == "int4") return format_id(find_format(family::sym, 4, 32));
  if (spec == "int2") return format_id(find_format(family::sym, 2, 32));
  family fam;
  if (eat(spec, "sym"))
    fam = family::sym;
  else if (eat(spec, "kivi"))
    fam = family::kivi;
  else if (eat(spec, "rolealign") || eat(spec, "ra"))
    fam = family::rolealign;
  else
    return bad("unknown family");
  int bits = 0;
  auto [p, ec] = std::from_chars(spec.data(), spec.data() + spec.size(), bits);
  if (ec != std::errc() || (bits != 8 && bits != 4 && bits != 2)) return bad("bits must be 8, 4 or 2");
  spec.remove_prefix(size_t(p - spec.data()));
  int group = fam == family::sym ? 0 : 32;
  if (!spec.empty()) {
    if (!eat(spec, "/g")) return bad(fmt::format("unexpected '{}' after the bit width (expected /g<N>)", spec));
    auto [q, ec2] = std::from_chars(spec.data(), spec.data() + spec.size(), group);
    if (ec2 != std::errc() || q != spec.data() + spec.size()) return bad(fmt::format("group '{}' is not a number", spec));
  }
  const int id = find_format(fam, bits, group);
  if (id < 0) return bad(fmt::format("group size {} is not supported (32, 64, 128)", group));
  return format_id(id);
}

result<format_pair> parse_format_pair(std::string_view spec) {
  const std::string_view orig = trim(spec);
  if (orig.empty()) return status{errc::invalid_argument, "empty format spec"};
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

KVQ_NAMESPACE_END
