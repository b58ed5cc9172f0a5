#pragma once
/// \file
/// Formats: what a page of one (layer, kv head, role) stores and how many bytes it takes.
///
/// A format is a type: `fp16`, `bf16`, `fp8_e4m3` (format/float_formats.hpp), `sym<Bits, Group>`
/// (format/sym.hpp), `kivi<Bits, Group>` and `rolealign<Bits, Group>` (format/kivi.hpp),
/// `codebook<Bits, Group>` (format/codebook.hpp) and `nvfp4` (format/nvfp4.hpp). Each owns
/// its unit codec, its page layout (the byte table beside it) and its spec name. `format_list`
/// below is the one list of the formats kvq supports; a format's id is its index there, stored in
/// every page. From the list come the descriptor table `format_table`, `traits_of`, the spec
/// parser's names, the codec dispatch (format/registry.hpp, codec/codec.hpp) and the CUDA
/// kernels' read plan (include/kvq/cuda/read_plan.hpp). Adding a format is adding a
/// `format_type` (format/protocol.hpp) to the list (at the end: ids are stored).
///
/// Grouping (docs/architecture.md): keys have outlier channels, so `kivi`/`rolealign` K groups
/// run along tokens (one scale and zero per channel per G tokens); V groups, and all groups of
/// `sym` and `codebook`, run along channels of one token. `fp8_e4m3` has one fp32 scale per
/// token-head; `nvfp4` an e4m3 scale per 16 channels and an fp32 scale per page.

#include <kvq/config.hpp>
#include <kvq/format/codebook.hpp>
#include <kvq/format/float_formats.hpp>
#include <kvq/format/kivi.hpp>
#include <kvq/format/nvfp4.hpp>
#include <kvq/format/registry.hpp>
#include <kvq/format/sym.hpp>
#include <kvq/format/traits.hpp>
#include <kvq/format/type_list.hpp>
#include <kvq/status.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

KVQ_NAMESPACE_BEGIN

/// Every format kvq supports; `format_id` indexes it. The order is stored in pages and artifacts.
using format_list = type_list<fp16, bf16, fp8_e4m3,                                                      //
                              sym<8, 32>, sym<8, 64>, sym<8, 128>, sym<8, 0>,                            //
                              sym<4, 32>, sym<4, 64>, sym<4, 128>, sym<4, 0>,                            //
                              sym<2, 32>, sym<2, 64>, sym<2, 128>, sym<2, 0>,                            //
                              kivi<8, 32>, kivi<8, 64>, kivi<8, 128>,                                    //
                              kivi<4, 32>, kivi<4, 64>, kivi<4, 128>,                                    //
                              kivi<2, 32>, kivi<2, 64>, kivi<2, 128>,                                    //
                              rolealign<8, 32>, rolealign<8, 64>, rolealign<8, 128>,                     //
                              rolealign<4, 32>, rolealign<4, 64>, rolealign<4, 128>,                     //
                              rolealign<2, 32>, rolealign<2, 64>, rolealign<2, 128>,                     //
                              sym<3, 32>, sym<3, 64>, sym<3, 128>, sym<3, 0>,                            //
                              kivi<3, 32>, kivi<3, 64>, kivi<3, 128>,                                    //
                              codebook<4, 32>, codebook<4, 64>, codebook<4, 128>, codebook<4, 0>,        //
                              codebook<3, 32>, codebook<3, 64>, codebook<3, 128>, codebook<3, 0>,        //
                              codebook<2, 32>, codebook<2, 64>, codebook<2, 128>, codebook<2, 0>,        //
                              nvfp4>;

/// The tables and dispatch generated from `format_list`.
using formats = format_registry<format_list>;

/// Every format kvq supports, generated from `format_list`. `format_id` indexes it.
inline constexpr auto format_table = formats::table;
inline constexpr size_t format_count = formats::count;

/// Id of format type F in `format_list`, e.g. `format_id_v<kivi<4, 32>>`.
template <class F>
inline constexpr format_id format_id_v = formats::id_of<F>();

/// Traits of a format id (caller guarantees id < format_count); host and device.
KVQ_HOST_DEVICE constexpr format_traits traits_of(format_id id) { return formats::traits_of(id); }

/// Id of the format with these traits, or -1 if kvq does not support it.
constexpr int find_format(family f, int bits, int group) { return formats::find(f, bits, group); }

/// Spec name of a family: "fp16", "bf16", "fp8", "sym", "kivi", "ra".
constexpr const char* family_name(family f) { return formats::family_name(f); }

inline constexpr format_id fp16_format = format_id_v<fp16>;
static_assert(fp16_format == 0 && format_id_v<kivi<8, 32>> == 15 && format_id_v<rolealign<2, 128>> == 32 &&
                  format_id_v<sym<3, 32>> == 33 && format_id_v<kivi<3, 32>> == 37 &&
                  format_id_v<codebook<4, 32>> == 40 && format_id_v<nvfp4> == 52,
              "format ids are stored in pages and artifacts");

/// Layout of a page of `page_tokens` tokens of `head_dim` channels in format `t` for role `r`.
/// Callers validate the shape first with `check_shape`.
KVQ_HOST_DEVICE constexpr page_layout layout_of(const format_traits& t, role r, int page_tokens, int head_dim) {
  return formats::layout_of(t, r, page_tokens, head_dim);
}

/// Bits per element of a format, scales and zeros included.
constexpr double bits_per_element(const format_traits& t, role r, int page_tokens, int head_dim) {
  return 8.0 * layout_of(t, r, page_tokens, head_dim).total() / (double(page_tokens) * head_dim);
}

/// Short name of a format: "fp16", "fp8", "sym4/g32", "sym8" (whole-head group), "kivi4/g32",
/// "cb3" (whole-head scale), "nvfp4".
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

/// Parses one role's format: `fp16`, `bf16`, `fp8` (or `fp8_e4m3`), `nvfp4` (or `fp4`), `sym8`,
/// `sym4/g32`, `sym3/g32`, `kivi4/g32`, `kivi3/g64`, `ra2/g64` (or `rolealign2/g64`), `cb4`,
/// `cb3/g32` (or `codebook3/g32`), and the aliases `int8` = `sym8`, `int4` = `sym4/g32`,
/// `int2` = `sym2/g32`. Without `/g`, kivi and rolealign take g32, sym and cb the whole head.
KVQ_EXPORT result<format_id> parse_format(std::string_view spec);

/// Parses a spec for both roles: either one role format for both (`kivi4/g32`) or
/// `k=<format>,v=<format>` in either order. Errors name the bad part and list what is valid.
KVQ_EXPORT result<format_pair> parse_format_pair(std::string_view spec);

/// `k=kivi4/g32,v=kivi4/g32`, or the single name when both roles agree.
KVQ_EXPORT std::string format_pair_name(format_pair p);

KVQ_NAMESPACE_END
