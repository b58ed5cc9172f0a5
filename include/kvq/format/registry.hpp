#pragma once
/// \file
/// Everything kvq derives from a list of format types, for any list (kvq's is `format_list` in
/// format/format.hpp; a test may build its own): the descriptor table, `traits_of` for device
/// code, lookup by traits, the page layout of a runtime format and the codec dispatch.
///
/// Every type of a list is a `format_type` (format/protocol.hpp). A codec reads the family, bit
/// width and group from its arguments, so that the formats of a family (and families of one
/// layout, as kivi and rolealign) share one compiled codec: the dispatch branches once per codec,
/// not once per format.

#include <kvq/format/protocol.hpp>
#include <kvq/format/unit_codec.hpp>
#include <kvq/config.hpp>
#include <kvq/format/traits.hpp>
#include <kvq/format/type_list.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

KVQ_NAMESPACE_BEGIN

namespace detail {
template <class Out, class... Ts>
struct family_heads_impl {
  using type = Out;
};
template <class... Os, class T, class... Ts>
struct family_heads_impl<type_list<Os...>, T, Ts...> {
  static constexpr bool seen = (false || ... || (Os::fam == T::fam));
  using type = typename family_heads_impl<std::conditional_t<seen, type_list<Os...>, type_list<Os..., T>>, Ts...>::type;
};

template <class Out, class... Ts>
struct codec_heads_impl {
  using type = Out;
};
template <class... Os, class T, class... Ts>
struct codec_heads_impl<type_list<Os...>, T, Ts...> {
  static constexpr bool seen = (false || ... || std::is_same_v<typename Os::codec_type, typename T::codec_type>);
  using type = typename codec_heads_impl<std::conditional_t<seen, type_list<Os...>, type_list<Os..., T>>, Ts...>::type;
};

constexpr uint32_t log2_exact(uint32_t x) {
  uint32_t l = 0;
  while ((1u << l) < x) ++l;
  return l;
}
constexpr uint32_t pow2_width(uint32_t max_value) {  // bits to hold max_value, rounded up to 1, 2, 4, 8 or 16
  uint32_t w = 1;
  while (w < 16 && (max_value >> w) != 0) w *= 2;
  return w;
}
}  // namespace detail

/// The first type of each family in a list, in list order.
template <class List>
struct family_heads;
template <class... Ts>
struct family_heads<type_list<Ts...>> {
  using type = typename detail::family_heads_impl<type_list<>, Ts...>::type;
};

/// The first type of each codec (`F::codec_type`) in a list, in list order.
template <class List>
struct codec_heads;
template <class... Ts>
struct codec_heads<type_list<Ts...>> {
  using type = typename detail::codec_heads_impl<type_list<>, Ts...>::type;
};

template <class List>
struct format_registry;

/// The tables and dispatch of one list of format types (see the file comment).
template <class... Ts>
struct format_registry<type_list<Ts...>> {
  using list = type_list<Ts...>;
  using heads = typename family_heads<list>::type;
  using codecs = typename codec_heads<list>::type;
  static constexpr size_t count = sizeof...(Ts);
  static_assert(count > 0 && count < 256, "format_id is one byte");
  static_assert((format_type<Ts> && ...), "every type of a format list is a `format_type`");

  /// The descriptor table: entry i holds the traits of the list's type i.
  static constexpr std::array<format_traits, count> table = {format_traits{Ts::fam, uint8_t(Ts::bits), uint16_t(Ts::group)}...};

  /// Id of the format with these traits, or -1 if the list does not hold it.
  static constexpr int find(family f, int bits, int group) {
    for (size_t i = 0; i < count; ++i)
      if (table[i].fam == f && table[i].bits == bits && table[i].group == group) return int(i);
    return -1;
  }
  /// Id of a type of the list.
  template <class F>
  static constexpr format_id id_of() {
    constexpr int i = index_of<F>();
    static_assert(i >= 0, "the type is not in this format list");
    return format_id(i);
  }
  /// Index of a type in the list, or -1.
  template <class F>
  static constexpr int index_of() {
    const bool same[] = {std::is_same_v<Ts, F>...};
    for (size_t j = 0; j < count; ++j)
      if (same[j]) return int(j);
    return -1;
  }

 private:
  // traits_of reads three packed fields per id from 64-bit constants: the family, the bits (as
  // themselves up to 4, else log2(bits) + 2: 8 -> 5, 16 -> 6, so that the field stays 4 bits wide)
  // and log2(group) + 1 (0: the whole head). A handful of shifts and selects, no memory access.
  static constexpr uint32_t code(size_t i, int field) {
    const format_traits& t = table[i];
    if (field == 0) return uint32_t(t.fam);
    if (field == 1) return t.bits <= 4 ? t.bits : detail::log2_exact(t.bits) + 2;
    return t.group == 0 ? 0u : detail::log2_exact(t.group) + 1;
  }
  static constexpr uint32_t max_code(int field) {
    uint32_t m = 0;
    for (size_t i = 0; i < count; ++i) m = code(i, field) > m ? code(i, field) : m;
    return m;
  }
  template <int Field>
  static constexpr uint32_t width = detail::pow2_width(max_code(Field));
  template <int Field>
  static constexpr uint32_t per_word = 64 / width<Field>;
  template <int Field>
  static constexpr size_t words = (count + per_word<Field> - 1) / per_word<Field>;
  template <int Field, size_t W>
  static constexpr uint64_t word = [] {
    uint64_t w = 0;
    for (size_t j = 0; j < per_word<Field> && W * per_word<Field> + j < count; ++j)
      w |= uint64_t(code(W * per_word<Field> + j, Field)) << (j * width<Field>);
    return w;
  }();
  template <int Field, size_t... Ws>
  KVQ_HOST_DEVICE static constexpr uint32_t field(uint32_t i, std::index_sequence<Ws...>) {
    constexpr uint32_t per = per_word<Field>, last = uint32_t(sizeof...(Ws));
    uint64_t w = word<Field, last>;
    ((w = i < (last - Ws) * per ? word<Field, last - 1 - Ws> : w), ...);
    return uint32_t(w >> ((i & (per - 1)) * width<Field>)) & ((1u << width<Field>) - 1u);
  }
  template <int Field>
  KVQ_HOST_DEVICE static constexpr uint32_t field(uint32_t i) {
    return field<Field>(i, std::make_index_sequence<words<Field> - 1>{});
  }
  static constexpr bool packable() {
    for (const format_traits& t : table)
      if ((t.group & (t.group - 1)) != 0 || (t.bits > 4 && (t.bits & (t.bits - 1)) != 0)) return false;
    return true;
  }
  static_assert(packable(), "traits_of packs groups as powers of two, and bits above 4 too");

 public:
  /// Traits of format `id` (caller guarantees id < count); host and device.
  KVQ_HOST_DEVICE static constexpr format_traits traits_of(format_id id) {
    const uint32_t bc = field<1>(id), gc = field<2>(id);
    return {family(field<0>(id)), uint8_t(bc <= 4 ? bc : 1u << (bc - 2)), uint16_t(gc == 0 ? 0u : 1u << (gc - 1))};
  }

 private:
  static constexpr bool traits_match_table() {
    for (size_t i = 0; i < count; ++i) {
      const format_traits a = traits_of(format_id(i)), b = table[i];
      if (a.fam != b.fam || a.bits != b.bits || a.group != b.group) return false;
    }
    return true;
  }
  static constexpr bool each_once() {
    for (size_t i = 0; i < count; ++i)
      if (find(table[i].fam, table[i].bits, table[i].group) != int(i)) return false;
    return true;
  }
  static_assert(traits_match_table(), "the packed traits unpack to the table");
  static_assert(each_once(), "a format list holds each (family, bits, group) once");

 public:
  /// Calls `f.template operator()<H>()` for the first type H of family `fam` and returns true,
  /// or returns false when no format of the list has that family.
  template <class F>
  KVQ_HOST_DEVICE static constexpr bool visit_family(family fam, F&& f) {
    return visit_heads(fam, f, heads{});
  }

  /// Calls `f.template operator()<C>()` for the codec C of family `fam` and returns true, or
  /// returns false when no format of the list has that family.
  template <class F>
  KVQ_HOST_DEVICE static constexpr bool visit_codec(family fam, F&& f) {
    return visit_codecs(fam, f, codecs{});
  }

  /// Name of a family: its types' spec name ("fp8", "sym", "ra"), or "?".
  static constexpr const char* family_name(family fam) {
    const char* name = "?";
    visit_family(fam, [&]<class H>() { name = H::spec; });
    return name;
  }

  /// Page layout of format `t` for role `r` (format/*.hpp tables).
  KVQ_HOST_DEVICE static constexpr page_layout layout_of(const format_traits& t, role r, int page_tokens, int head_dim) {
    page_layout l;
    visit_codec(t.fam, [&]<class C>() { l = C::layout(t, r, page_tokens, head_dim); });
    return l;
  }

  /// Geometry of a page of format `id` (host or device).
  KVQ_HOST_DEVICE static codec::page_geom geom(format_id id, role r, int page_tokens, int head_dim) {
    codec::page_geom g{traits_of(id), r, page_tokens, head_dim, {}};
    g.lay = layout_of(g.fmt, r, page_tokens, head_dim);
    return g;
  }

  /// Encodes unit `u` of a page with its format's codec (codec/codec.hpp documents the arguments).
  KVQ_HOST_DEVICE static void encode_unit(const codec::page_geom& g, const uint16_t* src, int src_stride, int u,
                                          uint8_t* page, float pct) {
    visit_codec(g.fmt.fam, [&]<class C>() { C::encode_unit(g, src, src_stride, u, page, pct); });
  }

  /// Decodes element (t, c) of a page to float with its format's codec.
  KVQ_HOST_DEVICE static float decode_element(const codec::page_geom& g, const uint8_t* page, int t, int c) {
    float x = 0.f;
    visit_codec(g.fmt.fam, [&]<class C>() { x = C::decode_element(g, page, t, c); });
    return x;
  }

 private:
  template <class F, class... Hs>
  KVQ_HOST_DEVICE static constexpr bool visit_heads(family fam, F& f, type_list<Hs...>) {
    return ((fam == Hs::fam ? (f.template operator()<Hs>(), true) : false) || ...);
  }
  // True when codec C serves family `fam`: compares `fam` with C's families only.
  template <class C, class... Hs>
  KVQ_HOST_DEVICE static constexpr bool serves(family fam, type_list<Hs...>) {
    return (false || ... || (std::is_same_v<typename Hs::codec_type, C> && fam == Hs::fam));
  }
  template <class F, class... Cs>
  KVQ_HOST_DEVICE static constexpr bool visit_codecs(family fam, F& f, type_list<Cs...>) {
    return ((serves<typename Cs::codec_type>(fam, heads{}) ? (f.template operator()<typename Cs::codec_type>(), true) : false) || ...);
  }
};

KVQ_NAMESPACE_END
