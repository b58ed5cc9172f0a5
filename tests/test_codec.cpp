// Codecs: packing, per-format reconstruction error against float64 formulas, edge groups, and
// unit independence (the CUDA append kernel runs units in any order).
#include <kvq/codec/codec.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

using namespace kvq;

namespace {

constexpr int P = 64;

struct encoded {
  codec::page_geom g;
  std::vector<uint16_t> src;  // [P][d] fp16
  std::vector<uint8_t> page;
};

encoded encode(format_id f, role r, int d, const std::vector<float>& x, float clip = 1.0f, bool reverse = false) {
  encoded e{codec::make_geom(f, r, P, d), {}, {}};
  e.src.resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) e.src[i] = float_to_half(x[i]);
  e.page.assign(e.g.lay.total(), 0);
  const int n = e.g.unit_count();
  for (int i = 0; i < n; ++i) codec::encode_unit(e.g, e.src.data(), d, reverse ? n - 1 - i : i, e.page.data(), clip);
  return e;
}

// float64 bound on |x - decode(x)| from the stored parameters; also checks the parameters.
void check_bounds(const encoded& e, float clip) {
  const auto& g = e.g;
  const int d = g.head_dim, bits = g.fmt.bits;
  const uint16_t* scales = reinterpret_cast<const uint16_t*>(e.page.data() + g.lay.code_bytes);
  const uint16_t* zeros = reinterpret_cast<const uint16_t*>(e.page.data() + g.lay.code_bytes + g.lay.scale_bytes);
  for (int t = 0; t < P; ++t)
    for (int c = 0; c < d; ++c) {
      const double x = half_to_float(e.src[size_t(t) * d + c]);
      const double y = codec::decode_element(g, e.page.data(), t, c);
      double bound = 0;
      switch (g.fmt.fam) {
        case family::fp16: bound = 0; break;
        case family::bf16: bound = std::ldexp(std::fabs(x), -8); break;  // half ulp: 2^-8 relative
        case family::fp8_e4m3: {
          const double s = reinterpret_cast<const float*>(scales)[t];
          bound = std::ldexp(std::fabs(x), -4) * (1 + 1e-6) + std::ldexp(s, -10) + 1e-30;
          break;
        }
        case family::sym: {
          const int gs = g.group(), ng = d / gs;
          const double s = half_to_float(scales[t * ng + c / gs]);
          double amax = 0;
          for (int cc = c / gs * gs; cc < c / gs * gs + gs; ++cc)
            amax = std::max(amax, double(std::fabs(half_to_float(e.src[size_t(t) * d + cc]))));
          const int qmax = (1 << (bits - 1)) - 1;
          REQUIRE(std::fabs(s - amax / qmax) <= std::ldexp(amax / qmax, -11) + std::ldexp(1.0, -25));
          bound = 0.5 * s + std::max(0.0, std::fabs(x) - qmax * s) + 1e-6 * std::fabs(x);
          break;
        }
        case family::kivi:
        case family::rolealign: {
          const bool cols = g.k_columns();
          const int gs = g.fmt.group;
          const int idx = cols ? (t / gs) * d + c : t * (d / gs) + c / gs;
          const double s = half_to_float(scales[idx]), z = half_to_float(zeros[idx]);
          double lo = 1e300, hi = -1e300;
          for (int i = 0; i < gs; ++i) {
            const double xi = cols ? half_to_float(e.src[size_t(t / gs * gs + i) * d + c])
                                   : half_to_float(e.src[size_t(t) * d + c / gs * gs + i]);
            lo = std::min(lo, xi);
            hi = std::max(hi, xi);
          }
          const double L = (1 << bits) - 1;
          if (g.fmt.fam == family::kivi || clip == 1.0f) {
            REQUIRE(std::fabs(z - lo) <= std::ldexp(std::fabs(lo), -11) + std::ldexp(1.0, -25));
            REQUIRE(std::fabs(s - (hi - lo) / L) <= std::ldexp((hi - lo) / L, -11) + std::ldexp(1.0, -25));
          }
          bound = 0.5 * s + std::max(0.0, z - x) + std::max(0.0, x - (z + L * s)) + 1e-6 * (std::fabs(x) + std::fabs(z));
          break;
        }
      }
      CAPTURE(format_name(find_format(g.fmt.fam, g.fmt.bits, g.fmt.group)), int(g.r), t, c, x, y, bound);
      REQUIRE(std::isfinite(y));
      REQUIRE(std::fabs(x - y) <= bound);
    }
}

std::vector<float> random_page(std::mt19937& rng, int d, float sigma) {
  std::normal_distribution<float> nd(0.f, sigma);
  std::vector<float> x(size_t(P) * d);
  for (auto& v : x) v = nd(rng);
  // outlier channels, as real keys have
  for (int t = 0; t < P; ++t) x[size_t(t) * d + 3] *= 20.f;
  return x;
}

}  // namespace

TEST_CASE("2- and 4-bit packing round-trips and leaves neighbours alone", "[codec]") {
  std::mt19937 rng(11);
  for (int bits : {2, 4, 8}) {
    const int d = 128;
    std::vector<uint8_t> row(size_t(d * bits / 8), 0xA5);
    std::vector<uint32_t> codes(d);
    for (int c = 0; c < d; ++c) {
      codes[c] = rng() & ((1u << bits) - 1);
      codec::put_code(row.data(), bits, c, codes[c]);
    }
    for (int c = 0; c < d; ++c) REQUIRE(codec::get_code(row.data(), bits, c) == codes[c]);
    // overwrite one code; all others stay
    codec::put_code(row.data(), bits, 5, (codes[5] + 1) & ((1u << bits) - 1));
    for (int c = 0; c < d; ++c) REQUIRE(codec::get_code(row.data(), bits, c) == (c == 5 ? (codes[5] + 1) & ((1u << bits) - 1) : codes[c]));
  }
  // documented layout: 4-bit channel 2i is the low nibble of byte i
  uint8_t b[1] = {0};
  codec::put_code(b, 4, 0, 0x3);
  codec::put_code(b, 4, 1, 0xC);
  REQUIRE(b[0] == 0xC3);
}

TEST_CASE("every format reconstructs within its float64 error bound", "[codec]") {
  const int fi = GENERATE(range(0, int(format_count)));
  const role r = GENERATE(role::k, role::v);
  const int d = GENERATE(32, 64, 128);
  const auto f = format_id(fi);
  if (!check_shape(f, r, P, d).ok()) return;
  const uint32_t seed = uint32_t(1000 + fi * 7 + d + int(r));
  CAPTURE(format_name(f), int(r), d, seed);
  std::mt19937 rng(seed);
  const float clip = traits_of(f).fam == family::rolealign ? 0.9f : 1.0f;
  for (float sigma : {1.0f, 1e-3f, 300.f}) {
    auto x = random_page(rng, d, sigma);
    check_bounds(encode(f, r, d, x, clip), clip);
  }
}

TEST_CASE("edge groups: all zero, one outlier, +-max fp16, constant", "[codec]") {
  const int fi = GENERATE(range(0, int(format_count)));
  const role r = GENERATE(role::k, role::v);
  const int d = 64;
  const auto f = format_id(fi);
  if (!check_shape(f, r, P, d).ok()) return;
  CAPTURE(format_name(f), int(r));
  std::vector<float> zero(size_t(P) * d, 0.f);
  auto ez = encode(f, r, d, zero);
  for (int t = 0; t < P; ++t)
    for (int c = 0; c < d; ++c) REQUIRE(codec::decode_element(ez.g, ez.page.data(), t, c) == 0.f);
  check_bounds(ez, 1.f);

  std::vector<float> outlier(size_t(P) * d, 0.01f);
  outlier[size_t(17) * d + 9] = 3000.f;
  check_bounds(encode(f, r, d, outlier), 1.f);

  std::vector<float> extreme(size_t(P) * d);
  for (size_t i = 0; i < extreme.size(); ++i) extreme[i] = (i % 3 == 0) ? fp16_max : (i % 3 == 1 ? -fp16_max : 1.f);
  auto ee = encode(f, r, d, extreme);
  check_bounds(ee, 1.f);

  std::vector<float> constant(size_t(P) * d, -2.5f);
  auto ec = encode(f, r, d, constant);
  check_bounds(ec, 1.f);
  for (int c = 0; c < d; ++c) REQUIRE(std::isfinite(codec::decode_element(ec.g, ec.page.data(), 0, c)));
}

TEST_CASE("units are independent: any order gives the same bytes", "[codec]") {
  const int fi = GENERATE(range(0, int(format_count)));
  const role r = GENERATE(role::k, role::v);
  const auto f = format_id(fi);
  if (!check_shape(f, r, P, 128).ok()) return;
  std::mt19937 rng{static_cast<uint32_t>(fi)};
  auto x = random_page(rng, 128, 1.f);
  REQUIRE(encode(f, r, 128, x, 0.8f, false).page == encode(f, r, 128, x, 0.8f, true).page);
}
