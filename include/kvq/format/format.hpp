#pragma once
/// \file
/// Formats: what a page of one (layer, kv head, role) stores and how many bytes it takes.
///
/// A format is a family, a bit width and a group size. Its traits (code bits, scale and zero
/// types, grouping axis per role) live in one constexpr function, `traits_of`; the runtime
/// descriptor table `format_table` is generated from it, and every byte count, spec string and
/// dispatch in kvq comes from that table (no second hand-kept table: STYLE.md).
///
/// Grouping (DESIGN.md section 3): keys have outlier channels, so `kivi`/`rolealign` K groups run
/// along tokens (one scale and zero per channel per G tokens); V groups, and all groups of `sym`,
/// run along channels of one token. `fp8_e4m3` has one fp32 scale per token-head.
///
/// Page byte layout (P = page_tokens, d = head_dim, b = bits, all sections 16-byte aligned
/// because d is a multiple of 32):
///
/// | family        | role | offset            | bytes            | contents                         |
/// |---------------|------|-------------------|------------------|----------------------------------|
/// | fp16 / bf16   | K, V | 0                 | P*d*2            | [P][d] values                    |
/// | fp8_e4m3      | K, V | 0                 | P*d              | [P][d] e4m3 codes                |
/// |               |      | P*d               | P*4              | [P] fp32 scales (absmax/448)     |
/// | sym b, g      | K, V | 0                 | P*d*b/8          | [P][d] codes, offset binary      |
/// |               |      | P*d*b/8           | P*(d/g)*2        | [P][d/g] fp16 scales             |
/// | kivi/ra b, G  | K    | 0                 | P*d*b/8          | [P][d] codes, unsigned           |
/// |               |      | P*d*b/8           | (P/G)*d*2        | [P/G][d] fp16 scales             |
/// |               |      | + (P/G)*d*2       | (P/G)*d*2        | [P/G][d] fp16 zeros (group min)  |
/// | kivi/ra b, g  | V    | 0                 | P*d*b/8          | [P][d] codes, unsigned           |
/// |               |      | P*d*b/8           | P*(d/g)*2        | [P][d/g] fp16 scales             |
/// |               |      | + P*(d/g)*2       | P*(d/g)*2        | [P][d/g] fp16 zeros              |
///
/// Codes of one token row are packed along channels, low bits first: for 4 bits, channel 2i is
/// the low nibble of byte i; for 2 bits, channel 4i is bits 0-1 of byte i.

#include <kvq/config.hpp>
#include <kvq/core.hpp>
#include <kvq/status.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

KVQ_NAMESPACE_BEGIN

/// Format families of DESIGN.md section 3.
enum class family : uint8_t { fp16, bf16, fp8_e4m3, sym, kivi, rolealign };

constexpr const char* family_name(family f) {
  switch (f) {
    case family::fp16: return "fp16";
    case family::bf16: return "bf16";
    case family::fp8_e4m3: return "fp8";
    case family::sym: return "sym";
    case family::kivi: return "kivi";
    case family::rolealign: return "ra";
  }
  return "?";
}

/// Compile-time traits of one format. `group` is G (tokens) for the K of kivi/rolealign and g
/// (channels) otherwise; 0 means "the whole head" (g = head_dim) for `sym`.
struct format_traits {
  family fam;
  uint8_t bits;   ///< code bits per element
  uint16_t group; ///< group size, see above; 0 = head_dim (sym only), 1 for fp16/bf16/fp8
  /// True when the family stores a zero point (asymmetric).
  constexpr bool has_zero() const { return fam == family::kivi || fam == family::rolealign; }
  /// True for the families whose K groups run along tokens.
  constexpr bool k_along_tokens() const { return has_zero(); }
  constexpr bool is_integer() const { return fam == family::sym || has_zero(); }
};

/// Index into `format_table`. Stored in every page; small enough for a byte.
using format_id = uint8_t;

namespace detail {
constexpr std::array<uint8_t, 3> int_bits = {8, 4, 2};
constexpr std::array<uint16_t, 4> sym_groups = {32, 64, 128, 0};
constexpr std::array<uint16_t, 3> kivi_groups = {32, 64, 128};

/// Generates the table of all supported formats from the supported values of each axis.
constexpr auto make_format_table() {
  std::array<format_traits, 3 + 3 * 4 + 2 * 3 * 3> t{};
  size_t n = 0;
  t[n++] = {family::fp16, 16, 1};
  t[n++] = {family::bf16, 16, 1};
  t[n++] = {family::fp8_e4m3, 8, 1};
  for (auto b : int_bits)
    for (auto g : sym_groups) t[n++] = {family::sym, b, g};
  for (auto f : {family::kivi, family::rolealign})
    for (auto b : int_bits)
      for (auto g : kivi_groups) t[n++] = {f, b, g};
  return t;
}
}  // namespace detail

/// Every format kvq supports, generated from the axes above. `format_id` indexes it.
inline constexpr auto format_table = detail::make_format_table();
inline constexpr size_t format_count = format_table.size();
static_assert(format_count < 256, "format_id is one byte");

/// Traits of a format id (caller guarantees id < format_count). Computed from the id rather
/// than read from `format_table` so that device code can call it; the static_assert below pins
/// it to the generated table.
KVQ_HOST_DEVICE constexpr format_traits traits_of(format_id id) {
  if (id == 0) return {family::fp16, 16, 1};
  if (id == 1) return {family::bf16, 16, 1};
  if (id == 2) return {family::fp8_e4m3, 8, 1};
  const auto bits_at = [](int i) { return uint8_t(i == 0 ? 8 : i == 1 ? 4 : 2); };
  if (id < 15) {
    const int k = id - 3;
    return {family::sym, bits_at(k / 4), uint16_t(k % 4 == 3 ? 0 : 32 << (k % 4))};
  }
  const int k = (id - 15) % 9;
  return {id < 24 ? family::kivi : family::rolealign, bits_at(k / 3), uint16_t(32 << (k % 3))};
}

namespace detail {
constexpr bool traits_match_table() {
  for (size_t i = 0; i < format_count; ++i) {
    const format_traits a = traits_of(format_id(i)), b = format_table[i];
    if (a.fam != b.fam || a.bits != b.bits || a.group != b.group) return false;
  }
  return true;
}
static_assert(traits_match_table(), "traits_of must agree with the generated format table");
}  // namespace detail

/// Id of the format with these traits, or -1 if kvq does not support it.
constexpr int find_format(family f, int bits, int group) {
  for (size_t i = 0; i < format_count; ++i) {
    const auto& t = format_table[i];
    if (t.fam == f && t.bits == bits && t.group == group) return int(i);
  }
  return -1;
}

inline constexpr format_id fp16_format = format_id(find_format(family::fp16, 16, 1));
static_assert(fp16_format == 0);

/// Effective group size in channels or tokens (resolves g = 0 to head_dim).
KVQ_HOST_DEVICE constexpr int group_of(const format_traits& t, int head_dim) { return t.group == 0 ? head_dim : t.group; }

/// Byte sizes of the sections of one page (layout table above).
struct page_layout {
  uint32_t code_bytes = 0;   ///< offset of the scales
  uint32_t scale_bytes = 0;  ///< size of the scale section
  uint32_t zero_bytes = 0;   ///< size of the zero section (follows the scales)
  constexpr uint32_t total() const { return code_bytes + scale_bytes + zero_bytes; }
};

/// Layout of a page of `page_tokens` tokens of `head_dim` channels in format `t` for role `r`.
/// Callers validate the shape first with `check_shape`.
KVQ_HOST_DEVICE constexpr page_layout layout_of(const format_traits& t, role r, int page_tokens, int head_dim) {
  page_layout l;
  const uint32_t P = uint32_t(page_tokens), d = uint32_t(head_dim);
  l.code_bytes = P * d * t.bits / 8;
  switch (t.fam) {
    case family::fp16:
    case family::bf16: break;
    case family::fp8_e4m3: l.scale_bytes = P * 4; break;
    case family::sym: l.scale_bytes = P * (d / uint32_t(group_of(t, head_dim))) * 2; break;
    case family::kivi:
    case family::rolealign:
      if (r == role::k)
        l.scale_bytes = (P / t.group) * d * 2;
      else
        l.scale_bytes = P * (d / t.group) * 2;
      l.zero_bytes = l.scale_bytes;
      break;
  }
  return l;
}

/// Bits per element of a format, scales and zeros included.
constexpr double bits_per_element(const format_traits& t, role r, int page_tokens, int head_dim) {
  return 8.0 * layout_of(t, r, page_tokens, head_dim).total() / (double(page_tokens) * head_dim);
}

/// Short name of a format: "fp16", "fp8", "sym4/g32", "sym8" (whole-head group), "kivi4/g32".
KVQ_EXPORT std::string format_name(format_id id);

/// Checks that a format can store pages of this shape for this role: head_dim a multiple of 32
/// and of the channel group, page_tokens a multiple of the token group. The message names the
/// format, the role and the offending number.
KVQ_EXPORT status check_shape(format_id id, role r, int page_tokens, int head_dim);

/// Formats of the two roles of one (layer, kv head).
struct format_pair {
  format_id k = fp16_format;
  format_id v = fp16_format;
  friend constexpr bool operator==(format_pair, format_pair) = default;
};

/// Parses one role's format: `fp16`, `bf16`, `fp8` (or `fp8_e4m3`), `sym8`, `sym4/g32`,
/// `kivi4/g32`, `ra2/g64` (or `rolealign2/g64`), and the aliases `int8` = `sym8`,
/// `int4` = `sym4/g32`, `int2` = `sym2/g32`. Without `/g`, kivi and rolealign take g32 and sym
/// takes the whole head.
KVQ_EXPORT result<format_id> parse_format(std::string_view spec);

/// Parses a spec for both roles: either one role format for both (`kivi4/g32`) or
/// `k=<format>,v=<format>` in either order. Errors name the bad part and list what is valid.
KVQ_EXPORT result<format_pair> parse_format_pair(std::string_view spec);

/// `k=kivi4/g32,v=kivi4/g32`, or the single name when both roles agree.
KVQ_EXPORT std::string format_pair_name(format_pair p);

KVQ_NAMESPACE_END
