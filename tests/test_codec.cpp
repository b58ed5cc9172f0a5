// Codecs: packing, per-format reconstruction error against float64 formulas, edge groups, and
// unit independence (the CUDA append kernel runs units in any order).
#include <kvq/codec/codec.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
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

encoded encode(format_id f, role r, int d, const std::vector<float>& x, float clip = codec::no_clip,
               bool reverse = false) {
  encoded e{codec::make_geom(f, r, P, d), {}, {}};
  e.src.resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) e.src[i] = float_to_half(x[i]);
  e.page.assign(e.g.lay.total(), 0);
  const int n = e.g.unit_count();
  for (int i = 0; i < n; ++i) codec::encode_unit(e.g, e.src.data(), d, reverse ? n - 1 - i : i, e.page.data(), clip);
  return e;
}

// numpy.percentile(v, p) ('linear'): position p/100 * (n-1) between the sorted values.
double np_percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  const double pos = p / 100.0 * double(v.size() - 1);
  const size_t i = size_t(pos);
  const double f = pos - double(i);
  return i + 1 < v.size() ? v[i] + (v[i + 1] - v[i]) * f : v[i];
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
          std::vector<double> grp(static_cast<size_t>(gs));
          for (int i = 0; i < gs; ++i)
            grp[size_t(i)] = cols ? half_to_float(e.src[size_t(t / gs * gs + i) * d + c])
                                  : half_to_float(e.src[size_t(t) * d + c / gs * gs + i]);
          const double p = g.fmt.fam == family::kivi ? 100.0 : double(clip);
          const double lo = np_percentile(grp, 100.0 - p), hi = np_percentile(grp, p);
          const double L = (1 << bits) - 1, mag = std::max(std::fabs(lo), std::fabs(hi));
          // [lo, hi] = the group's (100-p)-th and p-th percentiles (min and max at p = 100)
          REQUIRE(std::fabs(z - lo) <= std::ldexp(std::fabs(lo), -11) + 1e-6 * mag + std::ldexp(1.0, -25));
          REQUIRE(std::fabs(s - (hi - lo) / L) <= std::ldexp((hi - lo) / L, -11) + 1e-6 * mag + std::ldexp(1.0, -25));
          bound = 0.5 * s + std::max(0.0, z - x) + std::max(0.0, x - (z + L * s)) + 1e-6 * (std::fabs(x) + std::fabs(z));
          break;
        }
        case family::codebook: {
          // the scale is the group's rms; the value is the level nearest x / s
          const int gs = g.group(), ng = d / gs;
          const double s = half_to_float(scales[t * ng + c / gs]);
          double ss = 0;
          for (int cc = c / gs * gs; cc < c / gs * gs + gs; ++cc) {
            const double xi = half_to_float(e.src[size_t(t) * d + cc]);
            ss += xi * xi;
          }
          const double rms = std::sqrt(ss / gs);
          REQUIRE(std::fabs(s - rms) <= std::ldexp(rms, -11) * (1 + 1e-4) + std::ldexp(1.0, -25));
          const float* lv = reinterpret_cast<const float*>(e.page.data() + g.lay.zero_offset());
          double nearest = 1e300;
          for (int k = 0; k < (1 << bits); ++k) {
            REQUIRE(lv[k] == lloyd_max_level(bits, k));
            nearest = std::min(nearest, std::fabs(x - double(lv[k]) * s));
          }
          bound = nearest + 1e-6 * (std::fabs(x) + 3 * s);
          break;
        }
        case family::nvfp4: {
          // the page's tensor scale and the block's e4m3 scale as the recipe gives them; the value
          // is the e2m1 grid point nearest x / (bs ts)
          const double ts = *reinterpret_cast<const float*>(e.page.data() + g.lay.zero_offset());
          double amax = 0, bmax = 0;
          for (size_t i = 0; i < e.src.size(); ++i) amax = std::max(amax, double(std::fabs(half_to_float(e.src[i]))));
          for (int cc = c / 16 * 16; cc < c / 16 * 16 + 16; ++cc)
            bmax = std::max(bmax, double(std::fabs(half_to_float(e.src[size_t(t) * d + cc]))));
          REQUIRE(ts > 0);
          if (amax > 0) REQUIRE(std::fabs(ts - amax / 2688) <= ts * 1e-6);
          const double bs = e4m3_to_float(e.page[g.lay.code_bytes + size_t(t) * (d / 16) + c / 16]);
          const double want = std::min(bmax / (6 * ts), 448.0);
          REQUIRE(std::fabs(bs - want) <= std::ldexp(want, -4) + std::ldexp(1.0, -10) + 1e-6 * want);
          const double S = bs * ts;
          const double grid[] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
          double nearest = 1e300;
          for (double gv : grid) nearest = std::min({nearest, std::fabs(x - gv * S), std::fabs(x + gv * S)});
          bound = nearest + 1e-6 * std::fabs(x) + 1e-30;
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
  const float clip = traits_of(f).fam == family::rolealign ? 95.f : codec::no_clip;
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
  check_bounds(ez, codec::no_clip);

  std::vector<float> outlier(size_t(P) * d, 0.01f);
  outlier[size_t(17) * d + 9] = 3000.f;
  check_bounds(encode(f, r, d, outlier), codec::no_clip);

  std::vector<float> extreme(size_t(P) * d);
  for (size_t i = 0; i < extreme.size(); ++i) extreme[i] = (i % 3 == 0) ? fp16_max : (i % 3 == 1 ? -fp16_max : 1.f);
  auto ee = encode(f, r, d, extreme);
  check_bounds(ee, codec::no_clip);

  std::vector<float> constant(size_t(P) * d, -2.5f);
  auto ec = encode(f, r, d, constant);
  check_bounds(ec, codec::no_clip);
  for (int c = 0; c < d; ++c) REQUIRE(std::isfinite(codec::decode_element(ec.g, ec.page.data(), 0, c)));
}

TEST_CASE("units are independent: any order gives the same bytes", "[codec]") {
  const int fi = GENERATE(range(0, int(format_count)));
  const role r = GENERATE(role::k, role::v);
  const auto f = format_id(fi);
  if (!check_shape(f, r, P, 128).ok()) return;
  std::mt19937 rng{static_cast<uint32_t>(fi)};
  auto x = random_page(rng, 128, 1.f);
  REQUIRE(encode(f, r, 128, x, 93.f, false).page == encode(f, r, 128, x, 93.f, true).page);
}

TEST_CASE("rolealign clips each group to its percentiles; 100 is kivi bit for bit", "[codec]") {
  const int G = GENERATE(32, 64, 128);
  const int bits = GENERATE(2, 4);
  const role r = GENERATE(role::k, role::v);
  const int d = 128;
  const auto ra = format_id(find_format(family::rolealign, bits, G));
  const auto kv = format_id(find_format(family::kivi, bits, G));
  if (!check_shape(ra, r, P, d).ok()) return;
  CAPTURE(G, bits, int(r));
  std::mt19937 rng(uint32_t(G * 10 + bits + int(r)));
  const auto x = random_page(rng, d, 1.f);
  // p = 100 stores exactly kivi's bytes (min and max)
  REQUIRE(encode(ra, r, d, x, codec::no_clip).page == encode(kv, r, d, x).page);
  // p < 100: the same bytes as a plain sort would give (check_bounds compares with numpy's rule)
  for (float p : {99.9f, 99.5f, 99.f, 97.f, 95.f, 93.f, 90.f}) {
    if (codec::percentile_tail(p, G) > codec::max_percentile_tail) continue;
    CAPTURE(p);
    const auto e = encode(ra, r, d, x, p);
    check_bounds(e, p);
    CHECK(e.page != encode(kv, r, d, x).page);
  }
}

TEST_CASE("a group with one outlier: p = 100 keeps it as the max, p just below drops it", "[codec]") {
  const role r = GENERATE(role::k, role::v);
  const int d = 64, G = 32;
  const auto ra = format_id(find_format(family::rolealign, 4, G));
  // every group: 0, 1/31, ..., 1 (ascending in the group's direction), one value 100 in group 0
  std::vector<float> x(size_t(P) * d);
  for (int t = 0; t < P; ++t)
    for (int c = 0; c < d; ++c) x[size_t(t) * d + c] = float((r == role::k ? t : c) % G) / 31.f;
  x[size_t(5) * d + 3] = 100.f;  // token 5, channel 3: in K's (channel 3, tokens 0-31) and V's (token 5, channels 0-31)
  const auto params = [&](const encoded& e) {  // (scale, zero) of the outlier's group
    const int idx = r == role::k ? 3 : 5 * (d / G);
    return std::pair{half_to_float(e.g.scales(e.page.data())[idx]), half_to_float(e.g.zeros(e.page.data())[idx])};
  };
  const auto at_outlier = [&](const encoded& e) { return codec::decode_element(e.g, e.page.data(), 5, 3); };
  {  // p = 100: the range is [0, 100], the outlier decodes exactly
    const auto e = encode(ra, r, d, x, 100.f);
    const auto [s, z] = params(e);
    CHECK(z == 0.f);
    CHECK(s == half_to_float(float_to_half(100.f / 15.f)));
    CHECK(at_outlier(e) == Approx(100.f).epsilon(1e-3));
  }
  {  // p = 99.5: position 30.845 between the two largest, 1 (= 31/31) and 100; 0.155 at the bottom
    const auto e = encode(ra, r, d, x, 99.5f);
    const auto [s, z] = params(e);
    const double hi = 1.0 + (100.0 - 1.0) * (99.5 / 100.0 * 31.0 - 30.0), lo = 0.155 / 31.0;
    CHECK(z == Approx(lo).epsilon(2e-3));
    CHECK(s == Approx((hi - lo) / 15.0).epsilon(2e-3));
    CHECK(at_outlier(e) == Approx(z + 15.f * s).epsilon(1e-6));  // clamped to the top code
  }
  {  // p = 96: position 29.76, below the outlier (sorted, x[29] = 30/31 and x[30] = 1: the value
     // the outlier replaced is gone); position 1.24 at the bottom. The outlier clamps to the top.
    const auto e = encode(ra, r, d, x, 96.f);
    const auto [s, z] = params(e);
    const double hi = 30.0 / 31.0 + (1.0 - 30.0 / 31.0) * (96.0 / 100.0 * 31.0 - 29.0);
    const double lo = 1.0 / 31.0 + (1.0 / 31.0) * ((100.0 - 96.0) / 100.0 * 31.0 - 1.0);
    CHECK(z == Approx(lo).epsilon(2e-3));
    CHECK(s == Approx((hi - lo) / 15.0).epsilon(2e-3));
    CHECK(at_outlier(e) == Approx(z + 15.f * s).epsilon(1e-6));
  }
  // the tail the encoder keeps: 16 values per end at most
  CHECK(codec::percentile_tail(100.f, 128) == 1);
  CHECK(codec::percentile_tail(90.f, 32) == 5);    // 27.9: x[27], x[28] -> 5 from the top
  CHECK(codec::percentile_tail(90.f, 128) == 14);  // 114.3: x[114], x[115]
  CHECK(codec::percentile_tail(50.f, 32) == 17);   // the median needs half the group
}

TEST_CASE("3-bit codes are a 2-bit plane and a 1-bit plane, as documented", "[codec]") {
  const int d = 64;
  for (format_id f : {format_id_v<sym<3, 32>>, format_id_v<kivi<3, 32>>, format_id_v<codebook<3, 0>>}) {
    const codec::page_geom g = codec::make_geom(f, role::v, P, d);
    CAPTURE(format_name(f));
    REQUIRE(g.lay.code_bytes == uint32_t(P * d * 3 / 8));
    std::vector<uint8_t> page(g.lay.total(), 0x5A);
    std::mt19937 rng(5);
    std::vector<uint32_t> codes(size_t(P) * d);
    for (int t = 0; t < P; ++t)
      for (int c = 0; c < d; ++c) codec::put_page_code(g, page.data(), t, c, codes[size_t(t) * d + c] = rng() & 7u);
    for (int t = 0; t < P; ++t)
      for (int c = 0; c < d; ++c) {
        const uint32_t q = codes[size_t(t) * d + c];
        REQUIRE(codec::page_code(g, page.data(), t, c) == q);
        // plane 0: channel 4i in bits 0-1 of byte i of the token's d/4 bytes
        REQUIRE(((page[size_t(t) * (d / 4) + c / 4] >> (2 * (c % 4))) & 3u) == (q & 3u));
        // plane 1 from P*d/4: channel c in bit c%8 of byte c/8 of the token's d/8 bytes
        REQUIRE(((page[size_t(P) * (d / 4) + size_t(t) * (d / 8) + c / 8] >> (c % 8)) & 1u) == (q >> 2));
      }
    // the code section ends where the scales begin: nothing beyond it was written
    for (uint32_t i = g.lay.code_bytes; i < g.lay.total(); ++i) REQUIRE(page[i] == 0x5A);
  }
}

TEST_CASE("the default codebook levels are the Lloyd-Max quantizer of a standard normal", "[codec]") {
  // Each level is the mean of N(0, 1) over its cell (the midpoints of its neighbours), the
  // fixed point of Lloyd's iteration; a wrong or misordered digit moves a centroid.
  const auto phi = [](double x) { return std::isinf(x) ? 0.0 : std::exp(-x * x / 2) / std::sqrt(2 * M_PI); };
  const auto cdf = [](double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); };
  for (int bits : {2, 3, 4}) {
    const int n = 1 << bits;
    std::vector<float> lv(static_cast<size_t>(n));
    for (int k = 0; k < n; ++k) lv[size_t(k)] = lloyd_max_level(bits, k);
    REQUIRE(check_codebook_levels(lv, bits, "default").ok());
    for (int k = 0; k < n; ++k) {
      const double a = k == 0 ? -INFINITY : 0.5 * (double(lv[k - 1]) + lv[k]);
      const double b = k == n - 1 ? INFINITY : 0.5 * (double(lv[k]) + lv[k + 1]);
      const double centroid = (phi(a) - phi(b)) / (cdf(b) - cdf(a));
      CAPTURE(bits, k, lv[k], centroid);
      REQUIRE(std::fabs(lv[k] - centroid) <= 1e-6);
      REQUIRE(lv[k] == -lv[n - 1 - k]);
    }
  }
  // the 4-bit quantizer's MSE on N(0, 1): 0.0095010 (by quadrature too; Max's 1960 table prints 0.009497)
  double mse = 0;
  for (int k = 0; k < 16; ++k) {
    const double l = lloyd_max_level(4, k);
    const double a = k == 0 ? -INFINITY : 0.5 * (double(lloyd_max_level(4, k - 1)) + l);
    const double b = k == 15 ? INFINITY : 0.5 * (l + double(lloyd_max_level(4, k + 1)));
    // integral of (x - l)^2 phi over [a, b]
    const double pa = phi(a), pb = phi(b), ea = std::isinf(a) ? 0 : a * pa, eb = std::isinf(b) ? 0 : b * pb;
    const double p = cdf(b) - cdf(a), m1 = pa - pb, m2 = p + ea - eb;
    mse += m2 - 2 * l * m1 + l * l * p;
  }
  CHECK(mse == Approx(0.0095010).margin(1e-7));
}

TEST_CASE("supplied codebook levels: checked, written to the page, used to decode", "[codec]") {
  const float good[] = {-2.f, -0.5f, 0.25f, 1.75f};
  REQUIRE(check_codebook_levels(good, 2, "layer 3 head 1 k").ok());
  const float unsorted[] = {-2.f, 0.5f, 0.25f, 1.75f};
  const status s1 = check_codebook_levels(unsorted, 2, "layer 3 head 1 k");
  CHECK(s1.code() == errc::invalid_argument);
  CHECK_THAT(s1.message(), Catch::Contains("'layer 3 head 1 k'") && Catch::Contains("strictly ascending") &&
                               Catch::Contains("level 2"));
  const float twice[] = {-2.f, 0.5f, 0.5f, 1.75f};
  CHECK_THAT(check_codebook_levels(twice, 2, "f").message(), Catch::Contains("strictly ascending"));
  const float nan[] = {-2.f, std::numeric_limits<float>::quiet_NaN(), 0.5f, 1.75f};
  CHECK_THAT(check_codebook_levels(nan, 2, "f").message(), Catch::Contains("level 1 is not finite"));
  const float inf[] = {-2.f, 0.f, 0.5f, std::numeric_limits<float>::infinity()};
  CHECK_THAT(check_codebook_levels(inf, 2, "f").message(), Catch::Contains("level 3 is not finite"));
  CHECK_THAT(check_codebook_levels(good, 3, "f").message(), Catch::Contains("has 8 levels, not 4"));
  CHECK_THAT(check_codebook_levels(good, 5, "f").message(), Catch::Contains("bits must be 2, 3 or 4"));

  // a page encoded with them decodes to them, through the page's own table
  const int d = 64;
  const codec::page_geom g = codec::make_geom(format_id_v<codebook<2, 32>>, role::k, P, d);
  std::mt19937 rng(3);
  auto x = random_page(rng, d, 1.f);
  std::vector<uint16_t> src(x.size());
  for (size_t i = 0; i < x.size(); ++i) src[i] = float_to_half(x[i]);
  std::vector<uint8_t> page(g.lay.total(), 0);
  for (int u = g.unit_count() - 1; u >= 0; --u)
    codebook_codec::encode_unit_with(g, src.data(), d, u, page.data(), good);
  for (int t = 0; t < P; ++t)
    for (int c = 0; c < d; ++c) {
      const double s = half_to_float(g.scales(page.data())[t * 2 + c / 32]);
      const double xv = half_to_float(src[size_t(t) * d + c]);
      double nearest = 1e300;
      for (float l : good) nearest = std::min(nearest, std::fabs(xv - l * s));
      const double y = codec::decode_element(g, page.data(), t, c);
      CAPTURE(t, c, xv, y, s);
      REQUIRE(std::fabs(xv - y) <= nearest + 1e-6 * (std::fabs(xv) + 2 * s));
    }
}

TEST_CASE("e2m1 rounds to nearest even and saturates; the fp4 tensor scale is checked", "[codec]") {
  const double grid[] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  for (uint32_t code = 0; code < 16; ++code) CHECK(e2m1_to_float(code) == (code & 8 ? -1 : 1) * grid[code & 7]);
  // every multiple of 1/64 in [-8, 8]: the nearest grid point, a tie to the even mantissa code
  for (int i = -512; i <= 512; ++i) {
    const float v = float(i) / 64.f;
    double best = 1e300;
    uint32_t want = 0;
    for (uint32_t m = 0; m < 8; ++m) {
      const double dist = std::fabs(std::fabs(v) - grid[m]);
      if (dist < best || (dist == best && (m & 1) == 0)) best = dist, want = m;
    }
    if (want != 0 && v < 0) want |= 8;
    CAPTURE(v);
    REQUIRE(float_to_e2m1(v) == want);
  }
  CHECK(float_to_e2m1(1e30f) == 7);
  CHECK(float_to_e2m1(-1e30f) == 15);

  CHECK(check_nvfp4_tensor_scale(0.5f, "layer 2 head 0 v").ok());
  const status z = check_nvfp4_tensor_scale(0.f, "layer 2 head 0 v");
  CHECK(z.code() == errc::invalid_argument);
  CHECK_THAT(z.message(), Catch::Contains("fp4 tensor scale 'layer 2 head 0 v' must be finite and positive"));
  CHECK_FALSE(check_nvfp4_tensor_scale(-1.f, "s").ok());
  CHECK_FALSE(check_nvfp4_tensor_scale(std::numeric_limits<float>::infinity(), "s").ok());
  CHECK_FALSE(check_nvfp4_tensor_scale(std::numeric_limits<float>::quiet_NaN(), "s").ok());
}

TEST_CASE("nvfp4 pages hold NVFP4's bytes: packed e2m1, e4m3 block scales, an fp32 page scale", "[codec]") {
  const int d = 32;
  const codec::page_geom g = codec::make_geom(format_id_v<nvfp4>, role::k, P, d);
  REQUIRE(g.unit_count() == 1);
  // token t, channel c holds (c % 8) * 0.5 * 2^(t % 4), with channel 16 of every token 6 * 2^(t % 4)
  std::vector<uint16_t> src(size_t(P) * d);
  for (int t = 0; t < P; ++t)
    for (int c = 0; c < d; ++c)
      src[size_t(t) * d + c] = float_to_half((c == 16 ? 12 : c % 8) * 0.5f * float(1 << (t % 4)));
  std::vector<uint8_t> page(g.lay.total(), 0xEE);
  codec::encode_unit(g, src.data(), d, 0, page.data(), codec::no_clip);
  const float ts = *reinterpret_cast<const float*>(page.data() + g.lay.zero_offset());
  CHECK(ts == 48.f / 2688.f);  // page amax 48
  for (uint32_t i = g.lay.zero_offset() + 4; i < g.lay.total(); ++i) CHECK(page[i] == 0);
  // block 1 of token 3 has amax 48: its scale is e4m3(448); block 0 of token 0 amax 3.5
  CHECK(page[g.lay.code_bytes + 3 * 2 + 1] == float_to_e4m3(448.f));
  CHECK(page[g.lay.code_bytes + 0] == float_to_e4m3(3.5f / (6 * ts)));
  // token 3, block 1: S = 448 ts, about 8, so the codes are the grid indices of x / 8
  const uint8_t* row3 = page.data() + 3 * (d / 2);
  CHECK((row3[8] & 15) == 7);  // channel 16: 48 / 8 = 6
  CHECK((row3[8] >> 4) == 1);  // channel 17: 0.5 * 8 = 4 -> 0.5
  CHECK((row3[9] & 15) == 2);  // channel 18: 1 * 8 -> 1.0
  CHECK(codec::decode_element(g, page.data(), 3, 16) == (6.f * 448.f) * ts);
  CHECK(codec::decode_element(g, page.data(), 3, 16) == Approx(48.f).epsilon(1e-6));
}
