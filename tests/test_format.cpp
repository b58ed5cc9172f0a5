// The format table, byte counts and the spec parser.
#include <kvq/format/format.hpp>

#include <catch2/catch.hpp>

using namespace kvq;

TEST_CASE("format table: names parse back to the same id", "[format]") {
  for (size_t i = 0; i < format_count; ++i) {
    const std::string name = format_name(format_id(i));
    CAPTURE(i, name);
    auto p = parse_format(name);
    REQUIRE(p.ok());
    REQUIRE(*p == i);
  }
}

TEST_CASE("page byte counts include scales and zeros", "[format]") {
  const int P = 64, d = 128;
  auto bytes = [&](const char* spec, role r) { return layout_of(traits_of(*parse_format(spec)), r, P, d).total(); };
  CHECK(bytes("fp16", role::k) == P * d * 2);
  CHECK(bytes("fp8", role::v) == P * d + P * 4);
  CHECK(bytes("sym8", role::k) == P * d + P * 2);
  CHECK(bytes("sym4/g32", role::k) == P * d / 2 + P * 4 * 2);
  // kivi4/g32 K: codes + (64/32 groups) x 128 channels x (scale + zero) fp16
  CHECK(bytes("kivi4/g32", role::k) == P * d / 2 + 2 * d * 2 * 2);
  // kivi4/g32 V: codes + 64 tokens x 4 groups x (scale + zero)
  CHECK(bytes("kivi4/g32", role::v) == P * d / 2 + P * 4 * 2 * 2);
  CHECK(bytes("kivi2/g128", role::v) == P * d / 4 + P * 1 * 2 * 2);
  // 3 bits: a 2-bit plane and a 1-bit plane
  CHECK(bytes("sym3/g32", role::k) == P * d / 4 + P * d / 8 + P * 4 * 2);
  CHECK(bytes("kivi3/g32", role::k) == P * d * 3 / 8 + 2 * d * 2 * 2);
  // codebooks carry their 2^b fp32 levels
  CHECK(bytes("cb4", role::k) == P * d / 2 + P * 2 + 16 * 4);
  CHECK(bytes("cb2/g32", role::v) == P * d / 4 + P * 4 * 2 + 4 * 4);
  // nvfp4: e2m1 codes, an e4m3 scale per 16 channels, a 16-byte line for the page's fp32 scale
  CHECK(bytes("nvfp4", role::v) == P * d / 2 + P * d / 16 + 16);
  CHECK(bits_per_element(traits_of(*parse_format("fp4")), role::k, P, d) == Approx(4.5 + 128.0 / (P * d)));
  CHECK(bits_per_element(traits_of(*parse_format("kivi4/g32")), role::k, P, d) == Approx(5.0));
  CHECK(bits_per_element(traits_of(*parse_format("kivi2/g32")), role::v, P, d) == Approx(3.0));
  // every section is 16-byte aligned for every format at d = 32
  for (size_t i = 0; i < format_count; ++i)
    for (role r : {role::k, role::v}) {
      const auto l = layout_of(format_table[i], r, 128, 32);
      CAPTURE(format_name(format_id(i)), int(r));
      CHECK(l.code_bytes % 16 == 0);
      CHECK(l.scale_bytes % 16 == 0);
      CHECK(l.zero_bytes % 16 == 0);
    }
}

TEST_CASE("format spec parser accepts the grammar", "[format]") {
  CHECK(format_name(*parse_format("kivi4")) == "kivi4/g32");
  CHECK(format_name(*parse_format("rolealign2/g64")) == "ra2/g64");
  CHECK(format_name(*parse_format("int8")) == "sym8");
  CHECK(format_name(*parse_format(" fp8_e4m3 ")) == "fp8");
  auto p = parse_format_pair("v=kivi2/g32,k=kivi4/g128");
  REQUIRE(p.ok());
  CHECK(format_name(p->k) == "kivi4/g128");
  CHECK(format_name(p->v) == "kivi2/g32");
  CHECK(format_pair_name(*p) == "k=kivi4/g128,v=kivi2/g32");
  CHECK(format_pair_name(*parse_format_pair("sym4/g64")) == "sym4/g64");
  CHECK(format_name(*parse_format("sym3")) == "sym3");
  CHECK(format_name(*parse_format("kivi3")) == "kivi3/g32");
  CHECK(format_name(*parse_format("codebook3/g64")) == "cb3/g64");
  CHECK(format_name(*parse_format("cb2")) == "cb2");
  CHECK(format_name(*parse_format("fp4")) == "nvfp4");
  CHECK(format_pair_name(*parse_format_pair("k=cb4,v=nvfp4")) == "k=cb4,v=nvfp4");
}

TEST_CASE("format spec parser names the bad part", "[format]") {
  struct bad_case {
    const char* spec;
    const char* must_contain;
  };
  const bad_case cases[] = {
      {"kivi5", "bits must be 8, 4, 2 or 3"},  {"kivi4/g48", "group size 48"},
      {"ra3", "bits must be 8, 4 or 2"},      {"cb8", "bits must be 4, 3 or 2"},
      {"cb4/g16", "group size 16"},           {"nvfp4/g32", "unknown family"},
      {"kivi4/x32", "unexpected '/x32'"},     {"fp9", "unknown family"},
      {"k=kivi4,x=fp16", "part 'x=fp16'"},    {"k=kivi4", "needs both k= and v="},
      {"k=kivi4,k=fp16,v=fp8", "k given twice"}, {"k=kivi4,v=sym5", "v part"},
      {"", "empty format spec"},              {"kivi4/g", "group '' is not a number"},
  };
  for (const auto& c : cases) {
    auto r = parse_format_pair(c.spec);
    CAPTURE(c.spec);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == errc::invalid_argument);
    CHECK_THAT(r.error().message(), Catch::Contains(c.must_contain));
  }
}

TEST_CASE("check_shape rejects shapes a format cannot store", "[format]") {
  CHECK(check_shape(*parse_format("kivi4/g128"), role::k, 64, 128).message().find("does not divide page_tokens 64") !=
        std::string::npos);
  CHECK(check_shape(*parse_format("kivi4/g128"), role::v, 64, 128).ok());
  CHECK(check_shape(*parse_format("sym4/g64"), role::v, 64, 96).message().find("does not divide head_dim 96") !=
        std::string::npos);
  CHECK(check_shape(*parse_format("kivi4"), role::v, 64, 8).message().find("multiple of 32") != std::string::npos);
  CHECK(check_shape(fp16_format, role::k, 64, 8).ok());
  // the new formats' sections are whole 16-byte lines
  CHECK(check_shape(*parse_format("sym3/g32"), role::k, 64, 32).ok());
  CHECK(check_shape(*parse_format("sym3/g32"), role::k, 2, 32).message().find("16-byte lines") != std::string::npos);
  CHECK(check_shape(*parse_format("cb4"), role::v, 4, 128).message().find("page_tokens 4 x head_dim 128") !=
        std::string::npos);
  CHECK(check_shape(*parse_format("cb4"), role::v, 8, 128).ok());
  CHECK(check_shape(*parse_format("nvfp4"), role::k, 4, 32).message().find("gives a section of 8 bytes") !=
        std::string::npos);
  CHECK(check_shape(*parse_format("cb3/g64"), role::k, 64, 96).message().find("does not divide head_dim 96") !=
        std::string::npos);
}
