// The format types and what is generated from their list: descriptors, packed traits, names,
// layouts, kernel kinds; and a format family defined here, outside the library, that gets all of
// it from its own list.
#include <kvq/codec/codec.hpp>
#include <kvq/format/format.hpp>
#include <kvq/cuda/read_plan.hpp>
#include <kvq/format/spec.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <vector>

using namespace kvq;
using namespace kvq::cuda;  // the read plan: kinds and what the CUDA kernels read

TEMPLATE_LIST_TEST_CASE("each format type is its list entry", "[format]", format_list) {
  using F = TestType;
  constexpr format_id id = format_id_v<F>;
  const std::string name = spec_name<F>();
  CAPTURE(int(id), name);
  const format_traits t = traits_of(id);
  CHECK(t.fam == F::fam);
  CHECK(t.bits == F::bits);
  CHECK(t.group == F::group);
  CHECK(format_name(id) == name);
  REQUIRE(parse_format(name).ok());
  CHECK(*parse_format(name) == id);
  for (role r : {role::k, role::v})
    for (int d : {32, 64, 128}) {
      const page_layout a = F::page(r, 128, d), b = layout_of(t, r, 128, d);
      CHECK(a.code_bytes == b.code_bytes);
      CHECK(a.scale_bytes == b.scale_bytes);
      CHECK(a.zero_bytes == b.zero_bytes);
      CHECK(a.code_bytes == uint32_t(128 * d * F::bits / 8));
    }
  CHECK(kind_v<F> == kind_of(id));
}

TEST_CASE("format ids keep their order: fp16, bf16, fp8, sym, kivi, rolealign, sym3, kivi3, cb, nvfp4", "[format]") {
  // The ids of every format as they are stored in pages and artifacts.
  REQUIRE(format_count == 53);
  const int bits[] = {8, 4, 2};
  for (format_id id = 0; id < format_count; ++id) {
    CAPTURE(int(id), format_name(id));
    const format_traits t = traits_of(id);
    if (id < 3) {
      CHECK(t.fam == (id == 0 ? family::fp16 : id == 1 ? family::bf16 : family::fp8_e4m3));
      CHECK(t.bits == (id == 2 ? 8 : 16));
      CHECK(t.group == 1);
    } else if (id < 15) {
      const int k = id - 3;
      CHECK(t.fam == family::sym);
      CHECK(t.bits == bits[k / 4]);
      CHECK(t.group == (k % 4 == 3 ? 0 : 32 << (k % 4)));
    } else if (id >= 52) {
      CHECK(t.fam == family::nvfp4);
      CHECK(t.bits == 4);
      CHECK(t.group == 16);
    } else if (id >= 40) {
      const int k = id - 40;
      CHECK(t.fam == family::codebook);
      CHECK(t.bits == 4 - k / 4);
      CHECK(t.group == (k % 4 == 3 ? 0 : 32 << (k % 4)));
    } else if (id >= 33) {
      const int k = id - 33;
      CHECK(t.fam == (k < 4 ? family::sym : family::kivi));
      CHECK(t.bits == 3);
      CHECK(t.group == (k == 3 ? 0 : 32 << (k < 4 ? k : k - 4)));
    } else {
      const int k = (id - 15) % 9;
      CHECK(t.fam == (id < 24 ? family::kivi : family::rolealign));
      CHECK(t.bits == bits[k / 3]);
      CHECK(t.group == 32 << (k % 3));
    }
  }
  CHECK(valid_format_names<format_list>() ==
        "fp16, bf16, fp8, sym{8,4,2,3}[/g{32,64,128}], kivi{8,4,2,3}[/g{32,64,128}], ra{8,4,2}[/g{32,64,128}], "
        "cb{4,3,2}[/g{32,64,128}], nvfp4");
  CHECK(std::string(family_name(family::codebook)) == "cb");
  CHECK(std::string(family_name(family::rolealign)) == "ra");
  CHECK(std::string(family_name(family(77))) == "?");
}

TEST_CASE(
    "kernel kinds: kivi/ra 8, 4, 2 are 0-2, sym 8, 4, 2 are 3-5, fp8 is 6, cb 4, 2 are 7-8, nvfp4 is 9, kivi/ra 3 is 10, "
    "sym 3 is 11, 16-bit and the 3-bit codebooks are -1",
    "[format]") {
  REQUIRE(kind_count == 12);
  for (format_id id = 0; id < format_count; ++id) {
    const format_traits f = traits_of(id);
    CAPTURE(format_name(id));
    const int b = f.bits == 8 ? 0 : f.bits == 4 ? 1 : 2;
    // 3-bit codebook pages have no kernel kind (the CUDA decode kernels read them by element)
    const bool unstaged = f.bits > 8 || (f.bits == 3 && f.fam == family::codebook);
    const int expect = unstaged                       ? -1
                       : f.bits == 3                  ? (f.fam == family::sym ? 11 : 10)
                       : f.fam == family::nvfp4       ? 9
                       : f.fam == family::fp8_e4m3    ? 6
                       : f.fam == family::sym         ? 3 + b
                       : f.fam == family::codebook    ? (f.bits == 4 ? 7 : 8)
                                                      : b;
    CHECK(kind_of(f) == expect);
    // (3-bit pages outside a block of one 3-bit kind pair are read by element too)
    CHECK(read_by_element(f) == (f.bits < 16 && (unstaged || f.bits == 3)));
    CHECK(tile_reads_by_element(f) ==
          (f.bits < 16 && (unstaged || f.bits == 3 || f.fam == family::codebook || f.fam == family::nvfp4)));
    CHECK(kernel_bits(id) == (read_by_element(f) ? 16 : f.bits));
    if (expect < 0) continue;
    CHECK(kind_bits(expect) == f.bits);
    CHECK(kind_family(expect) == (f.fam == family::rolealign ? family::kivi : f.fam));
  }
  using namespace kernel_kind;
  const int named[] = {kivi8, kivi4, kivi2, sym8, sym4, sym2, fp8, cb4, cb2, fp4, kivi3, sym3};
  for (int k = 0; k < kind_count; ++k) CHECK(named[k] == k);
  // the pairs with whole-unit loops: kivi4/kivi4, kivi2/kivi2, kivi4 K + kivi2 V, sym4/sym4, sym2/sym2,
  // cb4/cb4, cb2/cb2, fp4/fp4
  int whole = 0;
  for (int k = 0; k < kind_count; ++k)
    for (int v = 0; v < kind_count; ++v) {
      const int combo = kind_pair(k, v);
      CAPTURE(k, v);
      CHECK(has_whole_units(combo) == ((k == v && (k == kivi4 || k == kivi2 || k == sym4 || k == sym2 || k == cb4 ||
                                                   k == cb2 || k == fp4)) ||
                                        (k == kivi4 && v == kivi2)));
      whole += has_whole_units(combo);
    }
  CHECK(whole == 8);
  CHECK_FALSE(has_whole_units(-1));
  // every kind is in the pair list of its width (the kernels' generated switches: cuda/attention/kinds.cuh)
  STATIC_REQUIRE(pair_lists_cover_kinds());
  CHECK(in_kind_pairs(whole_unit_pairs{}, kind_pair(kivi4, kivi2)));
  CHECK_FALSE(in_kind_pairs(whole_unit_pairs{}, kind_pair(kivi2, kivi4)));
  CHECK(in_kind_pairs(eight_bit_pairs{}, kind_pair(fp8, fp8)));
  CHECK_FALSE(in_kind_pairs(eight_bit_pairs{}, kind_pair(kivi8, sym8)));
  CHECK(in_kind_pairs(three_bit_pairs{}, kind_pair(kivi3, kivi3)));
  // (a 4-bit K beside a 3-bit V: a chunk loop of its own in the Three instances; its head still
  // counts by its wider kernel bits, read by element outside them)
  CHECK(in_kind_pairs(three_bit_mixed_pairs{}, kind_pair(kivi4, kivi3)));
  CHECK_FALSE(in_kind_pairs(three_bit_mixed_pairs{}, kind_pair(kivi3, kivi4)));
  CHECK(head_kernel_bits(format_id_v<kivi<4, 32>>, format_id_v<kivi<3, 32>>) == 16);
  CHECK(in_kind_pairs(eight_bit_pairs{}, kind_pair(sym8, sym8)));
}

namespace {

// A family defined outside the library: fp16 values truncated to their top byte (sign, 5
// exponent bits, 2 mantissa bits), no parameters; one unit per token. Its own `family` value,
// spec name, layout and codec: nothing else to write for it to join a list.
struct trunc8 : format_base<family(40), 8, 1, trunc8> {
  static constexpr const char* spec = "trunc8";
  static constexpr const char* spec_alias = "e5m2t";
  static constexpr bool named_by_bits = false;

  static constexpr page_layout layout(const format_traits&, role, int page_tokens, int head_dim) {
    return {uint32_t(page_tokens * head_dim), 0, 0};
  }
  static void encode_unit(const codec::page_geom& g, const uint16_t* src, int src_stride, int u, uint8_t* page, float) {
    for (int c = 0; c < g.head_dim; ++c) page[u * g.row_bytes() + c] = uint8_t(src[u * src_stride + c] >> 8);
  }
  static float decode_element(const codec::page_geom& g, const uint8_t* page, int t, int c) {
    return half_to_float(uint16_t(page[t * g.row_bytes() + c] << 8));
  }
};
static_assert(trunc8::page(role::k, 64, 128).total() == 64 * 128);
// the protocol: trunc8 states four members and takes the other defaults; a type short of a member
// (or whose codec is short of one) is not a format type, and a list holding it does not build
static_assert(format_type<trunc8> && codec::unit_codec<trunc8> && trunc8::default_group == 1 && trunc8::decode_as == family(40));
struct no_spec : format_base<family(41), 8, 1, trunc8> {};
struct no_codec {
  using codec_type = int;
  static constexpr family fam = family(42);
  static constexpr int bits = 8, group = 1;
  static constexpr const char* spec = "x";
};
static_assert(!format_type<no_spec> && !format_type<no_codec> && !codec::unit_codec<int>);

// The library's types and the new one, in one list.
using test_list = type_list<fp16, kivi<4, 32>, trunc8, sym<2, 0>>;
using test_formats = format_registry<test_list>;

}  // namespace

TEST_CASE("a family defined outside the library gets a descriptor, a name and a CPU round trip", "[format]") {
  constexpr format_id id = test_formats::id_of<trunc8>();
  static_assert(id == 2 && test_formats::count == 4);
  static_assert(test_formats::table[id].fam == family(40) && test_formats::traits_of(id).bits == 8);
  static_assert(test_formats::traits_of(3).group == 0 && test_formats::traits_of(1).bits == 4);
  CHECK(std::string(test_formats::family_name(family(40))) == "trunc8");

  // names: generated, parsed back, aliases and the other families of the list
  const std::string valid = valid_format_names<test_list>();
  CHECK(valid == "fp16, kivi{4}[/g{32}], trunc8, sym{2}");
  CHECK(format_name_in<test_list>(id) == "trunc8");
  CHECK(format_name_in<test_list>(9) == "<invalid format id 9>");
  CHECK(*parse_format_in<test_list>("trunc8", valid) == id);
  CHECK(*parse_format_in<test_list>("e5m2t", valid) == id);
  CHECK(*parse_format_in<test_list>("kivi4", valid) == 1);
  CHECK(*parse_format_in<test_list>("sym2", valid) == 3);
  const auto bad = parse_format_in<test_list>("kivi8", valid);
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.error().message(), Catch::Contains("bits must be 4") && Catch::Contains("valid formats: " + valid));
  CHECK_THAT(parse_format_in<test_list>("kivi4/g64", valid).error().message(), Catch::Contains("group size 64"));

  // the generic codec dispatch reaches the new family's codec; round trip within 2^-3 relative
  const int P = 16, d = 64;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 3.f);
  std::vector<uint16_t> src(size_t(P) * d);
  for (auto& h : src) h = float_to_half(nd(rng));
  const codec::page_geom g = test_formats::geom(id, role::v, P, d);
  REQUIRE(g.lay.total() == uint32_t(P * d));
  REQUIRE(g.unit_count() == P);
  std::vector<uint8_t> page(g.lay.total(), 0);
  for (int u = 0; u < g.unit_count(); ++u) test_formats::encode_unit(g, src.data(), d, u, page.data(), codec::no_clip);
  for (int t = 0; t < P; ++t)
    for (int c = 0; c < d; ++c) {
      const float x = half_to_float(src[size_t(t) * d + c]), y = test_formats::decode_element(g, page.data(), t, c);
      CAPTURE(t, c, x, y);
      REQUIRE(std::fabs(x - y) <= std::ldexp(std::fabs(x), -2));
      REQUIRE(std::fabs(y) <= std::fabs(x));  // truncation toward zero
    }

  // a library format of the same list encodes the same bytes as through kvq's own list
  const codec::page_geom gk = test_formats::geom(1, role::k, P * 2, d);
  const codec::page_geom gl = codec::make_geom(format_id_v<kivi<4, 32>>, role::k, P * 2, d);
  std::vector<uint16_t> src2(size_t(2 * P) * d);
  for (auto& h : src2) h = float_to_half(nd(rng));
  std::vector<uint8_t> a(gk.lay.total(), 0), b(gl.lay.total(), 0);
  REQUIRE(gk.unit_count() == gl.unit_count());
  for (int u = 0; u < gk.unit_count(); ++u) {
    test_formats::encode_unit(gk, src2.data(), d, u, a.data(), codec::no_clip);
    codec::encode_unit(gl, src2.data(), d, u, b.data(), codec::no_clip);
  }
  CHECK(a == b);
}
