#pragma once
/// \file
/// The format-type protocol: what a format type provides (`format_type`) and the defaults a
/// format derives (`format_base`), so that it states its traits, codec and spec name and only
/// what differs from them (see format/sym.hpp for an example):
/// - `F::fam`, `F::bits`, `F::group`: its traits; `F::spec`, `F::spec_alias`, `F::named_by_bits`,
///   `F::default_group`: its spec name (format/spec.hpp);
/// - `F::decode_as`: the family whose decode reads its pages (rolealign: kivi's);
/// - `F::codec_type`: a `codec::unit_codec` (format/unit_codec.hpp), its page layout and unit codec.
/// How the CUDA kernels read a format is theirs to decide (include/kvq/cuda/read_plan.hpp).

#include <kvq/config.hpp>
#include <kvq/format/traits.hpp>
#include <kvq/format/unit_codec.hpp>

#include <concepts>
#include <cstdint>

KVQ_NAMESPACE_BEGIN

/// The members of a format type and their defaults: a format derives from
/// `format_base<family, bits, group, codec>` and states `spec` and what differs.
template <family Fam, int Bits, int Group, class Codec>
struct format_base {
  using codec_type = Codec;
  static constexpr family fam = Fam;
  static constexpr int bits = Bits, group = Group;
  static constexpr const char* spec_alias = nullptr;  ///< a second spec name, or none
  static constexpr bool named_by_bits = true;         ///< spec names carry the bits and group (`kivi4/g32`)
  static constexpr int default_group = Group;         ///< the group of a spec name without `/g`
  static constexpr family decode_as = Fam;            ///< the family whose decode reads its pages
  /// Page byte layout for role `r` (the codec's).
  static constexpr page_layout page(role r, int page_tokens, int head_dim) {
    return Codec::layout({Fam, uint8_t(Bits), uint16_t(Group)}, r, page_tokens, head_dim);
  }
};

/// A format type (see the file comment).
template <class F>
concept format_type = codec::unit_codec<typename F::codec_type> && requires {
  { F::fam } -> std::convertible_to<family>;
  { F::bits } -> std::convertible_to<int>;
  { F::group } -> std::convertible_to<int>;
  { F::spec } -> std::convertible_to<const char*>;
  { F::spec_alias } -> std::convertible_to<const char*>;
  { F::named_by_bits } -> std::convertible_to<bool>;
  { F::default_group } -> std::convertible_to<int>;
  { F::decode_as } -> std::convertible_to<family>;
  { F::page(role::k, 64, 64) } -> std::same_as<page_layout>;
};

KVQ_NAMESPACE_END
