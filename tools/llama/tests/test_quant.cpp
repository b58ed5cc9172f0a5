// Dequantization of every supported GGML type against an independent reference.
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <llama/gguf.hpp>
#include <llama/quant.hpp>

#include "test_util.hpp"

using namespace kvq::llama;

TEST_CASE("f16 and bf16 conversion is exact for special and boundary patterns", "[quant]") {
  CHECK(f16_to_float(0x0000) == 0.f);
  CHECK(std::signbit(f16_to_float(0x8000)));
  CHECK(f16_to_float(0x3c00) == 1.f);
  CHECK(f16_to_float(0xc000) == -2.f);
  CHECK(f16_to_float(0x7bff) == 65504.f);               // largest normal
  CHECK(f16_to_float(0x0400) == std::ldexp(1.f, -14));  // smallest normal
  CHECK(f16_to_float(0x0001) == std::ldexp(1.f, -24));  // smallest subnormal
  CHECK(f16_to_float(0x03ff) == std::ldexp(1023.f, -24));
  CHECK(std::isinf(f16_to_float(0x7c00)));
  CHECK(f16_to_float(0xfc00) < 0);
  CHECK(std::isnan(f16_to_float(0x7e00)));
  CHECK(bf16_to_float(0x3f80) == 1.f);
  CHECK(bf16_to_float(0xc040) == -3.f);
  // Every finite positive f16 pattern against the value formula of binary16.
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const uint32_t e = h >> 10, m = h & 0x3ff;
    const float want = e == 0 ? std::ldexp(float(m), -24) : std::ldexp(float(1024 + m), int(e) - 25);
    REQUIRE(f16_to_float(uint16_t(h)) == want);
    REQUIRE(f16_to_float(uint16_t(h | 0x8000)) == -want);
  }
}

TEST_CASE("dequantization matches gguf-py's reference for every supported type", "[quant]") {
  // quant_ref.gguf holds, per type T, random blocks `T.q` and gguf-py's dequantization of them
  // `T.ref` (tests/data/make_quant_ref.py says how it was made).
  auto f = gguf_file::open(test::own_data("quant_ref.gguf"));
  REQUIRE(f.ok());
  const char* types[] = {"F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"};
  for (const char* name : types) {
    CAPTURE(name);
    const gguf_tensor_info* q = f->find_tensor(std::string(name) + ".q");
    REQUIRE(q != nullptr);
    CHECK(type_name(q->type) == name);
    auto got = f->dequantize(std::string(name) + ".q");
    auto ref = f->dequantize(std::string(name) + ".ref");
    REQUIRE(got.ok());
    REQUIRE(ref.ok());
    REQUIRE(got->size() == ref->size());
    REQUIRE(got->size() == 1024);
    size_t mismatches = 0;
    double worst = 0;
    for (size_t i = 0; i < got->size(); ++i) {
      const double a = (*got)[i], b = (*ref)[i];
      const double err = std::fabs(a - b);
      worst = std::max(worst, err / std::max(1.0, std::fabs(b)));
      if (err > 1e-6 * std::max(1.0, std::fabs(b))) ++mismatches;
    }
    CAPTURE(worst);
    CHECK(mismatches == 0);
  }
}

TEST_CASE("Q8_K dequantizes as d * q (hand-built block)", "[quant]") {
  block_q8_k b{};
  b.d = 0.5f;
  for (int i = 0; i < 256; ++i) b.qs[i] = int8_t(i - 128);
  std::vector<uint8_t> raw(sizeof b);
  std::memcpy(raw.data(), &b, sizeof b);
  std::vector<float> out(256);
  REQUIRE(dequantize(ggml_type::q8_k, raw, out).ok());
  for (int i = 0; i < 256; ++i) CHECK(out[size_t(i)] == 0.5f * float(i - 128));
}

TEST_CASE("Q4_0 block layout: low nibbles first, then high nibbles (hand-built block)", "[quant]") {
  // Element j < 16 is the low nibble of byte j, element j >= 16 the high nibble of byte j - 16.
  block_q4_0 b{};
  b.d = 0x4000;  // 2.0
  for (int j = 0; j < 16; ++j) b.qs[j] = uint8_t(j | (15 - j) << 4);
  std::vector<uint8_t> raw(sizeof b);
  std::memcpy(raw.data(), &b, sizeof b);
  std::vector<float> out(32);
  REQUIRE(dequantize(ggml_type::q4_0, raw, out).ok());
  for (int j = 0; j < 16; ++j) {
    CHECK(out[size_t(j)] == 2.f * float(j - 8));
    CHECK(out[size_t(j + 16)] == 2.f * float(15 - j - 8));
  }
}

TEST_CASE("dequantize rejects unsupported types and wrong sizes with a message", "[quant]") {
  std::vector<uint8_t> raw(66);
  std::vector<float> out(256);
  auto s = dequantize(ggml_type::iq2_xxs, raw, out);
  CHECK(s.code() == kvq::errc::unsupported);
  CHECK_THAT(s.message(), Catch::Contains("IQ2_XXS"));
  std::vector<float> out32(32), out31(31);
  s = dequantize(ggml_type::q8_0, std::vector<uint8_t>(33), out32);
  CHECK(s.code() == kvq::errc::invalid_argument);
  CHECK_THAT(s.message(), Catch::Contains("34 bytes"));
  s = dequantize(ggml_type::q8_0, std::vector<uint8_t>(34), out31);
  CHECK(s.code() == kvq::errc::invalid_argument);
  CHECK(find_type(77) == nullptr);
  CHECK(type_name(77) == "type 77");
  CHECK(find_type(14)->block_bytes == sizeof(block_q6_k));
}
