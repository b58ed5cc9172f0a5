// Scalar conversions (format/numeric.hpp) against independent oracles: the compiler's _Float16
// for fp16, exact enumeration for bf16 and e4m3.
#include <kvq/format/numeric.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

using namespace kvq;

TEST_CASE("fp16 decode is exact for all 65536 codes and round-trips", "[numeric]") {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = half_to_float(uint16_t(h));
#if defined(__FLT16_MAX__)
    _Float16 ref;
    const uint16_t hh = uint16_t(h);
    std::memcpy(&ref, &hh, 2);
    if (std::isnan(float(ref))) {
      REQUIRE(std::isnan(f));
      continue;
    }
    REQUIRE(f == float(ref));
#endif
    if (!std::isnan(f)) REQUIRE(float_to_half(f) == h);
  }
}

TEST_CASE("fp16 encode rounds to nearest even like _Float16", "[numeric]") {
#if defined(__FLT16_MAX__)
  const uint64_t seed = GENERATE(1u, 2u);
  CAPTURE(seed);
  std::mt19937 rng{static_cast<uint32_t>(seed)};
  for (int i = 0; i < 2000000; ++i) {
    uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, 4);
    if (std::isnan(f)) continue;
    const _Float16 ref = _Float16(f);
    uint16_t rb;
    std::memcpy(&rb, &ref, 2);
    if (float_to_half(f) != rb) {
      CAPTURE(f);
      REQUIRE(float_to_half(f) == rb);
    }
  }
  // Ties and the overflow threshold.
  REQUIRE(float_to_half(65504.f) == 0x7bff);
  REQUIRE(float_to_half(65519.996f) == 0x7bff);
  REQUIRE(float_to_half(65520.f) == 0x7c00);
  REQUIRE(float_to_half(std::ldexp(1.f, -25)) == 0);          // tie to even (0)
  REQUIRE(float_to_half(std::ldexp(1.5f, -25)) == 1);         // above the tie
  REQUIRE(float_to_half(std::ldexp(3.f, -25)) == 2);          // 1.5 ulp: tie to even (2)
#else
  WARN("compiler lacks _Float16: oracle comparison skipped");
#endif
}

TEST_CASE("bf16 round trip and rounding", "[numeric]") {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = bf16_to_float(uint16_t(b));
    if (std::isnan(f)) continue;
    REQUIRE(float_to_bf16(f) == b);
  }
  REQUIRE(float_to_bf16(1.0f + std::ldexp(1.f, -8)) == float_to_bf16(1.0f));  // tie to even
  REQUIRE(bf16_to_float(float_to_bf16(1.0f + 3 * std::ldexp(1.f, -8))) == 1.0f + std::ldexp(1.f, -6));
}

TEST_CASE("e4m3 encodes to the nearest representable value, saturating", "[numeric]") {
  // All 254 finite codes decode to distinct values that re-encode to themselves (0x80 is -0).
  for (int c = 0; c < 256; ++c) {
    const float f = e4m3_to_float(uint8_t(c));
    if ((c & 0x7f) == 0x7f) {
      REQUIRE(std::isnan(f));
      continue;
    }
    if (c == 0x80) continue;
    REQUIRE(float_to_e4m3(f) == c);
  }
  REQUIRE(e4m3_to_float(0x7e) == 448.f);
  REQUIRE(e4m3_to_float(0x01) == std::ldexp(1.f, -9));
  REQUIRE(float_to_e4m3(1e6f) == 0x7e);
  REQUIRE(float_to_e4m3(-1e6f) == 0xfe);
  REQUIRE(float_to_e4m3(470.f) == 0x7e);
  // Random values: the chosen code is the nearest finite e4m3 value (ties to even code).
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> ud(-460.f, 460.f);
  for (int i = 0; i < 200000; ++i) {
    const float x = ud(rng) * (i % 3 == 0 ? 0.01f : 1.f);
    const uint8_t c = float_to_e4m3(x);
    const double err = std::fabs(double(e4m3_to_float(c)) - x);
    double best = 1e300;
    for (int o = 0; o < 256; ++o) {
      const float f = e4m3_to_float(uint8_t(o));
      if (!std::isnan(f)) best = std::min(best, std::fabs(double(f) - x));
    }
    CAPTURE(x, int(c));
    REQUIRE(err == best);
  }
}
