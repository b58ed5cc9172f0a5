#pragma once
/// \file
/// Spec names of a list of format types, host only: the name of each format and the parser of
/// one role's spec, both generated from the types' `spec`, `spec_alias`, `named_by_bits` and
/// `default_group` (format/registry.hpp). kvq's grammar is documented at `parse_format`
/// (format/format.hpp); src/format/format.cpp binds these to kvq's list.

#include <kvq/format/registry.hpp>
#include <kvq/status.hpp>

#include <charconv>
#include <string>
#include <string_view>

KVQ_NAMESPACE_BEGIN

/// Spec name of format type F: "fp16", "fp8", "sym8" (whole-head group), "sym4/g32", "kivi4/g32".
template <class F>
std::string spec_name() {
  std::string s = F::spec;
  if (F::named_by_bits) s += std::to_string(F::bits);
  if (F::named_by_bits && F::group != 0) s += "/g" + std::to_string(F::group);
  return s;
}

/// Name of format `id` of a list, or "<invalid format id N>".
template <class List>
std::string format_name_in(format_id id) {
  std::string name = "<invalid format id " + std::to_string(int(id)) + ">";
  visit_at(List{}, id, [&]<class F>() { name = spec_name<F>(); });
  return name;
}

namespace detail {
// "8, 4 or 2" / "32, 64, 128": the distinct values of one field over a family's formats, in list order.
template <class List>
std::string family_values(family fam, bool bits, std::string_view sep, std::string_view last_sep) {
  std::string out;
  int seen[64], n = 0;
  for (const format_traits& t : format_registry<List>::table) {
    const int v = bits ? t.bits : t.group;
    bool dup = t.fam != fam || (!bits && v == 0);
    for (int i = 0; i < n && !dup; ++i) dup = seen[i] == v;
    if (dup || n == 64) continue;
    seen[n++] = v;
  }
  for (int i = 0; i < n; ++i) out += std::string(i == 0 ? "" : i + 1 == n ? last_sep : sep) + std::to_string(seen[i]);
  return out;
}
/// The suffix of a rotated format spec (`kivi2/g32+rot`; rotation/rotation.hpp).
inline constexpr std::string_view rotation_suffix = "+rot";
/// Removes a trailing `rotation_suffix` from `s`; true when there was one.
inline bool eat_rotation_suffix(std::string_view& s) {
  if (s.size() < rotation_suffix.size() || s.substr(s.size() - rotation_suffix.size()) != rotation_suffix) return false;
  s.remove_suffix(rotation_suffix.size());
  return true;
}
inline bool eat_prefix(std::string_view& s, std::string_view prefix) {
  if (s.substr(0, prefix.size()) != prefix) return false;
  s.remove_prefix(prefix.size());
  return true;
}
}  // namespace detail

/// The spec names a list accepts, for error messages:
/// "fp16, bf16, fp8, sym{8,4,2}[/g{32,64,128}], kivi{8,4,2}[/g{32,64,128}]".
template <class List>
std::string valid_format_names() {
  std::string out;
  for_each_type(typename format_registry<List>::heads{}, [&]<size_t I, class H>() {
    out += (I == 0 ? "" : ", ") + std::string(H::spec);
    if constexpr (H::named_by_bits) {
      const std::string bits = detail::family_values<List>(H::fam, true, ",", ",");
      const std::string groups = detail::family_values<List>(H::fam, false, ",", ",");
      out += "{" + bits + "}";
      if (!groups.empty()) out += "[/g{" + groups + "}]";
    }
  });
  return out;
}

/// Parses one role's format of a list: a float family's name or alias (`fp16`, `fp8_e4m3`), or an
/// integer family's name or alias, its bits and an optional `/g<N>` (default: the family's
/// `default_group`). Errors are `invalid_argument` naming the bad part and listing
/// `valid_names`.
template <class List>
result<format_id> parse_format_in(std::string_view spec, std::string_view valid_names) {
  using reg = format_registry<List>;
  const std::string_view orig = spec;
  auto bad = [&](const std::string& why) -> status {
    return {errc::invalid_argument,
            "bad format '" + std::string(orig) + "': " + why + "; valid formats: " + std::string(valid_names)};
  };
  // the family: a float family's whole name, else the longest integer family name that prefixes it
  int id = -1;
  size_t best = 0;
  family fam{};
  int default_group = 0;
  for_each_type(typename reg::heads{}, [&]<size_t, class H>() {
    for (const char* name : {H::spec, H::spec_alias}) {
      if (name == nullptr) continue;
      const std::string_view n = name;
      if (!H::named_by_bits && spec == n) id = reg::find(H::fam, H::bits, H::group);
      if (H::named_by_bits && n.size() > best && spec.substr(0, n.size()) == n)
        best = n.size(), fam = H::fam, default_group = H::default_group;
    }
  });
  if (id >= 0) return format_id(id);
  if (best == 0) return bad("unknown family");
  spec.remove_prefix(best);
  int bits = 0;
  auto [p, ec] = std::from_chars(spec.data(), spec.data() + spec.size(), bits);
  bool known_bits = false;
  for (const format_traits& t : reg::table) known_bits = known_bits || (t.fam == fam && t.bits == bits);
  if (ec != std::errc() || !known_bits) return bad("bits must be " + detail::family_values<List>(fam, true, ", ", " or "));
  spec.remove_prefix(size_t(p - spec.data()));
  int group = default_group;
  if (!spec.empty()) {
    if (!detail::eat_prefix(spec, "/g")) return bad("unexpected '" + std::string(spec) + "' after the bit width (expected /g<N>)");
    auto [q, ec2] = std::from_chars(spec.data(), spec.data() + spec.size(), group);
    if (ec2 != std::errc() || q != spec.data() + spec.size()) return bad("group '" + std::string(spec) + "' is not a number");
  }
  id = reg::find(fam, bits, group);
  if (id < 0)
    return bad("group size " + std::to_string(group) + " is not supported (" + detail::family_values<List>(fam, false, ", ", ", ") + ")");
  return format_id(id);
}

KVQ_NAMESPACE_END
