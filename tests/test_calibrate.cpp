// The calibrator on hand-made inputs whose answer is known: K and V exactly representable at 4
// bits give zero damage for kivi4; fp16 gives zero; damage grows as bits fall; the KL and the V
// perturbation equal a brute-force double-precision evaluation of their definitions (through
// the codec); clip percentiles < 100 win on Gaussian groups at 2 bits, and 100 keeps a one-value
// outlier that a percentile below drops; rotated percentiles are chosen on rotated heads;
// the artifact it fills round-trips; bad inputs give errors naming the problem.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <kvq/calib/calibrate.hpp>
#include <kvq/codec/codec.hpp>
#include <kvq/format/numeric.hpp>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace kvq;
using calib::calibrator;
using calib::calibrator_options;

namespace {

format_id fmt_of(const char* spec) { return parse_format(spec).value_or_throw(); }

cache_shape make_shape(int layers, int q_heads, int kv_heads, int head_dim, int page_tokens = 64) {
  cache_shape s;
  s.layers = layers;
  s.q_heads = q_heads;
  s.kv_heads = kv_heads;
  s.head_dim = head_dim;
  s.page_tokens = page_tokens;
  return s;
}

// [T][heads][d] float tensor with its view.
struct tensor3 {
  int T, heads, d;
  std::vector<float> x;
  tensor3(int T_, int heads_, int d_) : T(T_), heads(heads_), d(d_), x(size_t(T_) * heads_ * d_) {}
  float& at(int t, int h, int c) { return x[(size_t(t) * heads + h) * d + c]; }
  float at(int t, int h, int c) const { return x[(size_t(t) * heads + h) * d + c]; }
  tensor_view view() const { return {x.data(), dtype::f32, T, heads, d, 0}; }
};

tensor3 gaussian(int T, int heads, int d, uint64_t seed, float sigma = 1.f) {
  tensor3 a(T, heads, d);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.f, sigma);
  for (float& e : a.x) e = n(rng);
  return a;
}

// Brute force, in double, of the file comment's definitions for one head: the mean KL over the
// query rows and the V perturbation ratio, with K̂ / V̂ from the codec (whole pages only).
struct brute {
  double kl, v;
};
std::vector<double> round_trip(const tensor3& x, int h, format_id f, role r, int P, float clip) {
  const int T = x.T, d = x.d;
  std::vector<uint16_t> x16(size_t(T) * d);
  std::vector<double> out(size_t(T) * d);
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < d; ++c) {
      x16[size_t(t) * d + c] = float_to_half(x.at(t, h, c));
      out[size_t(t) * d + c] = half_to_float(x16[size_t(t) * d + c]);
    }
  if (f == fp16_format) return out;
  const codec::page_geom g = codec::make_geom(f, r, P, d);
  std::vector<uint8_t> page(g.lay.total());
  for (int p0 = 0; p0 + P <= T; p0 += P) {
    for (int u = 0; u < g.unit_count(); ++u)
      codec::encode_unit(g, x16.data() + size_t(p0) * d, d, u, page.data(), clip);
    for (int t = 0; t < P; ++t)
      for (int c = 0; c < d; ++c) out[size_t(p0 + t) * d + c] = codec::decode_element(g, page.data(), t, c);
  }
  return out;
}
brute brute_force(const tensor3& q, const tensor3& k, const tensor3& v, int h, format_id f, int P, float clip = 100.f) {
  const int T = q.T, d = q.d, group = q.heads / k.heads;
  const auto K = round_trip(k, h, fp16_format, role::k, P, 100.f), Kq = round_trip(k, h, f, role::k, P, clip);
  const auto V = round_trip(v, h, fp16_format, role::v, P, 100.f), Vq = round_trip(v, h, f, role::v, P, clip);
  double kl = 0, num = 0, den = 0;
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < group; ++g) {
      std::vector<double> a(size_t(t) + 1), b(size_t(t) + 1);
      for (int j = 0; j <= t; ++j) {
        double sa = 0, sb = 0;
        for (int c = 0; c < d; ++c) {
          // the calibrator rounds the scaled query to float; do the same
          const double qc = double(q.at(t, h * group + g, c) * float(1.0 / std::sqrt(double(d))));
          sa += qc * K[size_t(j) * d + c];
          sb += qc * Kq[size_t(j) * d + c];
        }
        a[size_t(j)] = sa;
        b[size_t(j)] = sb;
      }
      const double ma = *std::max_element(a.begin(), a.end()), mb = *std::max_element(b.begin(), b.end());
      double za = 0, zb = 0;
      for (int j = 0; j <= t; ++j) {
        za += std::exp(a[size_t(j)] - ma);
        zb += std::exp(b[size_t(j)] - mb);
      }
      double row = 0;
      std::vector<double> o(size_t(d), 0.0), e(size_t(d), 0.0);
      for (int j = 0; j <= t; ++j) {
        const double lp = a[size_t(j)] - ma - std::log(za), lq = b[size_t(j)] - mb - std::log(zb), p = std::exp(lp);
        row += p * (lp - lq);
        for (int c = 0; c < d; ++c) {
          o[size_t(c)] += p * V[size_t(j) * d + c];
          e[size_t(c)] += p * (Vq[size_t(j) * d + c] - V[size_t(j) * d + c]);
        }
      }
      kl += row;
      for (int c = 0; c < d; ++c) {
        num += e[size_t(c)] * e[size_t(c)];
        den += o[size_t(c)] * o[size_t(c)];
      }
    }
  return {kl / (double(T) * group), num / den};
}

}  // namespace

TEST_CASE("calibrator: K and V exactly representable at 4 bits cost kivi4 nothing", "[calibrate]") {
  const int T = GENERATE(64, 128, 150), d = 64;
  CAPTURE(T);
  // x = -1 + q/8 with q = (t + c + h) mod 16: every 32-token group of a channel and every
  // 32-channel group of a token holds codes 0 and 15, so the range is exactly 15/8 and every
  // value is on the 4-bit grid (scale 1/8 and zero -1 are exact in fp16).
  tensor3 k(T, 2, d), v(T, 2, d);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < d; ++c) {
        k.at(t, h, c) = -1.f + float((t + c + h) % 16) / 8.f;
        v.at(t, h, c) = -1.f + float((t + 3 * c + h) % 16) / 8.f;
      }
  const tensor3 q = gaussian(T, 4, d, 11, 2.f);
  calibrator_options opt;
  opt.formats = {fp16_format, fmt_of("kivi8/g32"), fmt_of("kivi4/g32"), fmt_of("kivi2/g32"), fmt_of("ra4/g32")};
  auto c = calibrator::create(make_shape(1, 4, 2, d), opt).value_or_throw();
  REQUIRE(c.observe(0, q.view(), k.view(), v.view()).ok());
  for (int h = 0; h < 2; ++h)
    for (role r : {role::k, role::v}) {
      CAPTURE(h, role_name(r));
      CHECK(c.damage(0, h, r, fp16_format).value_or_throw() == 0.0);
      CHECK(c.damage(0, h, r, fmt_of("kivi4/g32")).value_or_throw() == 0.0);
      CHECK(c.damage(0, h, r, fmt_of("kivi2/g32")).value_or_throw() > 0.0);
      // p = 100 is kivi4 exactly, so the percentile chosen for ra4 (grid includes 100) is 100 or no worse
      CHECK(c.damage(0, h, r, fmt_of("ra4/g32"), 100.f).value_or_throw() == 0.0);
    }
  const auto clips = c.clip_percentiles();
  REQUIRE(clips.size() == 4);
  const auto prof = c.result().value_or_throw();
  for (int h = 0; h < 2; ++h) {
    CHECK(prof.at(0, h, role::k, 2) == 0.0);
    CHECK(prof.at(0, h, role::v, 2) == 0.0);
  }
}

TEST_CASE("calibrator: damage grows as bits fall", "[calibrate]") {
  const int d = 64, T = 192;
  const tensor3 q = gaussian(T, 6, d, 21, 1.5f), k = gaussian(T, 2, d, 22, 1.f), v = gaussian(T, 2, d, 23, 1.f);
  auto c = calibrator::create(make_shape(2, 6, 2, d)).value_or_throw();  // default candidates
  REQUIRE(c.observe(1, q.view(), k.view(), v.view()).ok());
  REQUIRE(c.observe(0, q.view(), k.view(), v.view()).ok());
  for (int h = 0; h < 2; ++h)
    for (role r : {role::k, role::v}) {
      CAPTURE(h, role_name(r));
      const double k8 = c.damage(0, h, r, fmt_of("kivi8/g32")).value_or_throw();
      const double k4 = c.damage(0, h, r, fmt_of("kivi4/g32")).value_or_throw();
      const double k2 = c.damage(0, h, r, fmt_of("kivi2/g32")).value_or_throw();
      const double s8 = c.damage(0, h, r, fmt_of("sym8/g32")).value_or_throw();
      const double s4 = c.damage(0, h, r, fmt_of("sym4/g32")).value_or_throw();
      const double f8 = c.damage(0, h, r, fmt_of("fp8")).value_or_throw();
      CHECK(0.0 < k8);
      CHECK(k8 < k4);
      CHECK(k4 < k2);
      CHECK(0.0 < s8);
      CHECK(s8 < s4);
      // fp8 (3 mantissa bits) lies between the 8-bit and the 2-bit integer formats
      CHECK(k8 < f8);
      CHECK(f8 < k2);
      // KL ~ error^2: each 2-4 bit step costs far more than a factor 4
      CHECK(k2 / k4 > 8.0);
      CHECK(k4 / k8 > 50.0);
      // the same data in layer 1 gives the same numbers
      CHECK(c.damage(1, h, r, fmt_of("kivi4/g32")).value_or_throw() == k4);
    }
}

TEST_CASE("calibrator: KL and V perturbation equal a brute-force evaluation", "[calibrate]") {
  const int d = 64;
  const int T = GENERATE(1, 3, 63, 64, 65, 129, 200);
  const int P = GENERATE(32, 64);
  CAPTURE(T, P);
  const tensor3 q = gaussian(T, 4, d, 100 + T, 2.f), k = gaussian(T, 2, d, 200 + T), v = gaussian(T, 2, d, 300 + T);
  calibrator_options opt;
  opt.formats = {fmt_of("kivi8/g32"), fmt_of("kivi4/g32"), fmt_of("kivi2/g32"),
                 fmt_of("sym4/g32"),  fmt_of("fp8"),       fmt_of("ra2/g32")};
  opt.clip_percentile_grid = {100.f, 90.f};
  auto c = calibrator::create(make_shape(1, 4, 2, d, P), opt).value_or_throw();
  REQUIRE(c.observe(0, q.view(), k.view(), v.view()).ok());
  for (int h = 0; h < 2; ++h)
    for (format_id f : opt.formats)
      for (float clip : {100.f, 90.f}) {
        if (clip != 100.f && traits_of(f).fam != family::rolealign) continue;
        CAPTURE(h, format_name(f), clip);
        const brute b = brute_force(q, k, v, h, f, P, clip);
        const double kl = c.damage(0, h, role::k, f, clip).value_or_throw();
        const double vp = c.damage(0, h, role::v, f, clip).value_or_throw();
        if (T < P) {
          CHECK(kl == 0.0);  // no whole page: nothing is quantized
          CHECK(vp == 0.0);
          continue;
        }
        CHECK(kl == Approx(b.kl).epsilon(1e-4));
        CHECK(vp == Approx(b.v).epsilon(1e-4));
      }
}

TEST_CASE("calibrator: f16 and strided inputs measure the same as packed f32", "[calibrate]") {
  const int d = 64, T = 128, Hq = 3, Hkv = 1;
  const tensor3 q = gaussian(T, Hq, d, 5), k = gaussian(T, Hkv, d, 6), v = gaussian(T, Hkv, d, 7);
  // the same values rounded to f16 (k and v are rounded by the calibrator anyway; q is not)
  std::vector<uint16_t> k16(k.x.size()), v16(v.x.size());
  for (size_t i = 0; i < k.x.size(); ++i) {
    k16[i] = float_to_half(k.x[i]);
    v16[i] = float_to_half(v.x[i]);
  }
  // q inside a wider row (a fused QKV buffer): stride 5*d
  std::vector<float> fused(size_t(T) * 5 * d, std::numeric_limits<float>::quiet_NaN());
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < Hq; ++h)
      for (int c = 0; c < d; ++c) fused[size_t(t) * 5 * d + size_t(h) * d + c] = q.at(t, h, c);
  auto a = calibrator::create(make_shape(1, Hq, Hkv, d)).value_or_throw();
  auto b = calibrator::create(make_shape(1, Hq, Hkv, d)).value_or_throw();
  REQUIRE(a.observe(0, q.view(), k.view(), v.view()).ok());
  REQUIRE(b.observe(0, {fused.data(), dtype::f32, T, Hq, d, 5 * d}, {k16.data(), dtype::f16, T, Hkv, d, 0},
                    {v16.data(), dtype::f16, T, Hkv, d, 0})
              .ok());
  const auto pa = a.result().value_or_throw(), pb = b.result().value_or_throw();
  CHECK(pa.values == pb.values);
  CHECK(a.clip_percentiles() == b.clip_percentiles());
}

TEST_CASE("calibrator: accumulates over chunks", "[calibrate]") {
  const int d = 64, T = 128;
  const tensor3 q = gaussian(T, 2, d, 31), k = gaussian(T, 1, d, 32), v = gaussian(T, 1, d, 33);
  const tensor3 q2 = gaussian(T, 2, d, 41), k2 = gaussian(T, 1, d, 42, 3.f), v2 = gaussian(T, 1, d, 43, 0.5f);
  auto one = calibrator::create(make_shape(1, 2, 1, d)).value_or_throw();
  auto two = calibrator::create(make_shape(1, 2, 1, d)).value_or_throw();
  auto other = calibrator::create(make_shape(1, 2, 1, d)).value_or_throw();
  REQUIRE(one.observe(0, q.view(), k.view(), v.view()).ok());
  REQUIRE(two.observe(0, q.view(), k.view(), v.view()).ok());
  REQUIRE(two.observe(0, q.view(), k.view(), v.view()).ok());
  REQUIRE(other.observe(0, q2.view(), k2.view(), v2.view()).ok());
  CHECK(two.tokens(0) == 2 * T);
  const format_id k4 = fmt_of("kivi4/g32");
  // the same chunk twice: the same mean
  CHECK(two.damage(0, 0, role::k, k4).value_or_throw() == Approx(one.damage(0, 0, role::k, k4).value_or_throw()));
  CHECK(two.damage(0, 0, role::v, k4).value_or_throw() == Approx(one.damage(0, 0, role::v, k4).value_or_throw()));
  // two different chunks (same T): the K KL is the mean of the two means
  REQUIRE(one.observe(0, q2.view(), k2.view(), v2.view()).ok());
  const double a = two.damage(0, 0, role::k, k4).value_or_throw(), b = other.damage(0, 0, role::k, k4).value_or_throw();
  CHECK(one.damage(0, 0, role::k, k4).value_or_throw() == Approx((a + b) / 2).epsilon(1e-12));
}

TEST_CASE("calibrator: clip percentiles", "[calibrate]") {
  const int d = 64, T = 256;
  calibrator_options opt;
  opt.formats = {fmt_of("kivi2/g32"), fmt_of("ra2/g32")};
  opt.clip_formats = {fmt_of("ra2/g32")};
  const auto ra2 = fmt_of("ra2/g32");

  SECTION("Gaussian groups at 2 bits: a percentile < 100 wins for K and V") {
    const tensor3 q = gaussian(T, 2, d, 51, 2.f), k = gaussian(T, 1, d, 52), v = gaussian(T, 1, d, 53);
    auto c = calibrator::create(make_shape(1, 2, 1, d), opt).value_or_throw();
    REQUIRE(c.observe(0, q.view(), k.view(), v.view()).ok());
    const auto clips = c.clip_percentiles();
    REQUIRE(clips.size() == 2);
    CHECK(c.clip_percentiles(true) == std::vector<float>{100.f, 100.f});  // rotation not measured
    for (role r : {role::k, role::v}) {
      CAPTURE(role_name(r));
      const float chosen = clips[r == role::k ? 0 : 1];
      CHECK(chosen < 100.f);
      const double at100 = c.damage(0, 0, r, ra2, 100.f).value_or_throw();
      const double atc = c.damage(0, 0, r, ra2, chosen).value_or_throw();
      CHECK(at100 == c.damage(0, 0, r, fmt_of("kivi2/g32")).value_or_throw());  // p = 100 is kivi
      CHECK(atc < at100);
      for (float g : opt.clip_percentile_grid) CHECK(atc <= c.damage(0, 0, r, ra2, g).value_or_throw());
      // the profile reports ra2 at the chosen percentile, kivi2 at none
      const auto prof = c.result().value_or_throw();
      CHECK(prof.at(0, 0, r, 1) == atc);
      CHECK(prof.at(0, 0, r, 0) == at100);
    }
  }

  SECTION("one huge outlier per group: 100 keeps it, a percentile below drops it, which costs") {
    // The bulk ~N(0, 0.3²), one value of +40 in every 32-token group of every channel (K) and
    // every 32-channel group of every token (V). At p = 100 (kivi) the 2-bit levels of [-1, 40]
    // are 13.7 apart and the whole bulk decodes to the group minimum; at p = 99.5 the top end
    // moves 85 % of the way from the bulk's largest value to 40 (position 30.845 of 31), which
    // changes that little; at p <= 96 (position < 30) the outlier is out of the range and clamps
    // to the bulk's top (about 0.6), and the bulk gets the levels.
    tensor3 k = gaussian(T, 1, d, 61, 0.3f), v = gaussian(T, 1, d, 62, 0.3f);
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < d; ++c) {
        if (t % 32 == c % 32) k.at(t, 0, c) = 40.f;
        if (c % 32 == t % 32) v.at(t, 0, c) = 40.f;
      }
    const tensor3 q = gaussian(T, 2, d, 63, 1.f);
    auto c = calibrator::create(make_shape(1, 2, 1, d), opt).value_or_throw();
    REQUIRE(c.observe(0, q.view(), k.view(), v.view()).ok());
    const auto clips = c.clip_percentiles();
    for (role r : {role::k, role::v}) {
      CAPTURE(role_name(r));
      const double at100 = c.damage(0, 0, r, ra2, 100.f).value_or_throw();
      const double at995 = c.damage(0, 0, r, ra2, 99.5f).value_or_throw();
      const double at96 = c.damage(0, 0, r, ra2, 96.f).value_or_throw();
      CAPTURE(at100, at995, at96, clips[r == role::k ? 0 : 1]);
      CHECK(at995 != at100);
      CHECK(std::fabs(at995 - at100) < std::fabs(at96 - at100));  // a slight clip moves little
      // the outlier carries the attention (K) and the output (V): clamping it to the bulk costs
      // far more than rounding the bulk to the group minimum, so at most a slight clip is chosen
      CHECK(at96 > 10 * at100);
      CHECK(at995 > at100);
      const float chosen = clips[r == role::k ? 0 : 1];
      CHECK(chosen >= 99.9f);
      CHECK(c.damage(0, 0, r, ra2, chosen).value_or_throw() <= at100);
    }
  }

  SECTION("no damage at 100: the percentile stays 100") {
    tensor3 k(T, 1, d), v(T, 1, d);  // all zero: every format is exact
    const tensor3 q = gaussian(T, 2, d, 71);
    auto c = calibrator::create(make_shape(1, 2, 1, d), opt).value_or_throw();
    REQUIRE(c.observe(0, q.view(), k.view(), v.view()).ok());
    CHECK(c.clip_percentiles() == std::vector<float>{100.f, 100.f});
  }

  SECTION("rotated: percentiles chosen on the rotated heads, in the artifact") {
    opt.rotated = true;
    const tensor3 q = gaussian(T, 2, d, 81, 2.f), k = gaussian(T, 1, d, 82), v = gaussian(T, 1, d, 83);
    auto c = calibrator::create(make_shape(1, 2, 1, d), opt).value_or_throw();
    REQUIRE(c.observe(0, q.view(), k.view(), v.view()).ok());
    const auto rot = c.clip_percentiles(true);
    REQUIRE(rot.size() == 2);
    for (role r : {role::k, role::v}) {
      CAPTURE(role_name(r));
      const float chosen = rot[r == role::k ? 0 : 1];
      const double atc = c.damage(0, 0, r, ra2, chosen, true).value_or_throw();
      CHECK(c.damage(0, 0, r, ra2, 100.f, true).value_or_throw() ==
            c.damage(0, 0, r, fmt_of("kivi2/g32"), 100.f, true).value_or_throw());
      for (float g : opt.clip_percentile_grid) CHECK(atc <= c.damage(0, 0, r, ra2, g, true).value_or_throw());
      CHECK(c.rotated_result().value_or_throw().at(0, 0, r, 1) == atc);
    }
    calib::artifact a;
    REQUIRE(c.result(&a, "text").ok());
    CHECK(a.clip_percentiles == c.clip_percentiles());
    CHECK(a.rotated_clip_percentiles == rot);
  }
}

TEST_CASE("calibrator: fills a valid artifact that round-trips", "[calibrate]") {
  const int d = 64, T = 64, L = 3;
  calibrator_options opt;
  opt.model_name = "tiny";
  auto c = calibrator::create(make_shape(L, 4, 2, d), opt).value_or_throw();
  const std::string text = "It was a truth universally acknowledged.";
  {
    calib::artifact a;
    const auto r = c.result(&a, text);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().message().find("layer 0 was never observed") != std::string::npos);
  }
  for (int l = 0; l < L; ++l) {
    const tensor3 q = gaussian(T, 4, d, 80 + l), k = gaussian(T, 2, d, 90 + l, 1.f + l), v = gaussian(T, 2, d, 95 + l);
    REQUIRE(c.observe(l, q.view(), k.view(), v.view()).ok());
  }
  calib::artifact a;
  const auto prof = c.result(&a, text).value_or_throw();
  CHECK(a.validate().ok());
  CHECK(a.text_hash == calib::artifact::hash_text(text));
  CHECK(a.calibration_tokens == T);
  CHECK(a.model_name == "tiny");
  CHECK(a.shape == calib::model_shape{L, 4, 2, d});
  CHECK(a.sensitivity.values == prof.values);
  CHECK(a.sensitivity.formats == calib::default_candidates());
  CHECK(a.clip_percentiles == c.clip_percentiles());
  CHECK(a.rotated_clip_percentiles.empty());
  const auto path =
      (std::filesystem::temp_directory_path() / ("kvq_calib_test_" + std::to_string(::getpid()) + ".json")).string();
  REQUIRE(a.save(path).ok());
  const auto back = calib::artifact::load(path, a.shape).value_or_throw();
  std::filesystem::remove(path);
  CHECK(back.sensitivity.values == a.sensitivity.values);
  CHECK(back.clip_percentiles == a.clip_percentiles);
  // larger K spread (layer 2) -> larger K KL at the same q
  CHECK(prof.at(2, 0, role::k, 1) > prof.at(0, 0, role::k, 1));
}

TEST_CASE("calibrator: errors name the problem", "[calibrate]") {
  const int d = 64;
  SECTION("create") {
    auto e = calibrator::create(make_shape(0, 4, 2, d));
    REQUIRE_FALSE(e.ok());
    CHECK(e.error().message().find("must be positive") != std::string::npos);
    e = calibrator::create(make_shape(1, 3, 2, d));
    REQUIRE_FALSE(e.ok());
    CHECK(e.error().message().find("not a multiple") != std::string::npos);
    calibrator_options o;
    o.formats = {fmt_of("kivi4/g32"), fmt_of("kivi4/g32")};
    e = calibrator::create(make_shape(1, 4, 2, d), o);
    REQUIRE_FALSE(e.ok());
    CHECK(e.error().message().find("kivi4/g32 is listed twice") != std::string::npos);
    o = {};
    o.clip_percentile_grid = {100.f, 0.95f};  // a former clip ratio
    e = calibrator::create(make_shape(1, 4, 2, d), o);
    REQUIRE_FALSE(e.ok());
    CHECK(e.error().message().find("clip_percentile_grid: clip percentile 0.95 is not in [50, 100]") !=
          std::string::npos);
    o.clip_percentile_grid = {100.f, 75.f};  // beyond the 16 order statistics kept per end
    e = calibrator::create(make_shape(1, 4, 2, d), o);
    REQUIRE_FALSE(e.ok());
    CHECK(e.error().message().find("clip percentile 75 needs the") != std::string::npos);
    o = {};
    o.clip_formats = {fmt_of("kivi2/g32")};
    e = calibrator::create(make_shape(1, 4, 2, d), o);
    REQUIRE_FALSE(e.ok());
    CHECK(e.error().message().find("not a rolealign format") != std::string::npos);
    o = {};
    o.formats = {fmt_of("kivi4/g64")};
    e = calibrator::create(make_shape(1, 4, 2, d, 32), o);  // token group 64 > page of 32
    REQUIRE_FALSE(e.ok());
    CHECK(e.error().message().find("kivi4/g64") != std::string::npos);
  }
  SECTION("observe") {
    auto c = calibrator::create(make_shape(2, 4, 2, d)).value_or_throw();
    const int T = 64;
    tensor3 q = gaussian(T, 4, d, 1), k = gaussian(T, 2, d, 2), v = gaussian(T, 2, d, 3);
    auto s = c.observe(2, q.view(), k.view(), v.view());
    CHECK(s.code() == errc::invalid_argument);
    CHECK(s.message().find("outside the model's 2 layers") != std::string::npos);
    const tensor3 wrong = gaussian(T, 3, d, 4);
    s = c.observe(0, q.view(), wrong.view(), v.view());
    CHECK(s.message().find("k is [64][3][64], the shape needs [T][2][64]") != std::string::npos);
    const tensor3 shorter = gaussian(T - 1, 2, d, 5);
    s = c.observe(0, q.view(), k.view(), shorter.view());
    CHECK(s.message().find("token counts differ: q 64, k 64, v 63") != std::string::npos);
    k.at(5, 1, 7) = std::numeric_limits<float>::quiet_NaN();
    s = c.observe(0, q.view(), k.view(), v.view());
    CHECK(s.code() == errc::non_finite);
    CHECK(s.message().find("k is nan at token 5 head 1 channel 7") != std::string::npos);
    k.at(5, 1, 7) = 1.f;
    v.at(9, 0, 3) = 1e6f;
    s = c.observe(0, q.view(), k.view(), v.view());
    CHECK(s.message().find("v is 1000000 at token 9 head 0 channel 3, beyond fp16 range") != std::string::npos);
    v.at(9, 0, 3) = 0.f;
    q.at(0, 3, 0) = std::numeric_limits<float>::infinity();
    s = c.observe(0, q.view(), k.view(), v.view());
    CHECK(s.code() == errc::non_finite);
    CHECK(s.message().find("q is inf at token 0 head 3 channel 0") != std::string::npos);
    // nothing was accumulated by the failed calls
    CHECK(c.tokens(0) == 0);
    CHECK(c.damage(0, 0, role::k, fmt_of("kivi4/g32")).error().code() == errc::not_found);
    q.at(0, 3, 0) = 0.f;
    REQUIRE(c.observe(0, q.view(), k.view(), v.view()).ok());
    const auto miss = c.damage(0, 0, role::k, fmt_of("ra4/g32"), 50.f);
    CHECK(miss.error().code() == errc::not_found);
    CHECK(miss.error().message().find("ra4/g32 at clip percentile 50 was not measured") != std::string::npos);
    CHECK(c.damage(0, 0, role::k, fmt_of("kivi4/g64")).error().code() == errc::not_found);
  }
}

namespace {

// Squared error of the codebook codec's round trip of head h of x ([T][heads][d], whole pages)
// with the given levels of (layer 0, head h, role) in `fit` (Lloyd-Max when null).
double codebook_sq_error(const tensor3& x, int h, format_id f, role r, const calib::codebook_fit* fit) {
  const int P = 64, d = x.d, n = 1 << traits_of(f).bits;
  const codec::page_geom g = codec::make_geom(f, r, P, d);
  std::vector<uint16_t> src(size_t(P) * d);
  std::vector<uint8_t> page(g.lay.total());
  const float* lv = fit ? fit->levels.data() + size_t(h * 2 + (r == role::k ? 0 : 1)) * size_t(n) : nullptr;
  double e = 0.0;
  for (int p0 = 0; p0 + P <= x.T; p0 += P) {
    for (int t = 0; t < P; ++t)
      for (int c = 0; c < d; ++c) src[size_t(t) * d + c] = float_to_half(x.at(p0 + t, h, c));
    std::fill(page.begin(), page.end(), 0);
    for (int u = 0; u < g.unit_count(); ++u)
      codec::encode_unit(g, src.data(), d, u, page.data(), codec::encode_params{codec::no_clip, lv});
    for (int t = 0; t < P; ++t)
      for (int c = 0; c < d; ++c) {
        const double diff = double(codec::decode_element(g, page.data(), t, c)) - half_to_float(src[size_t(t) * d + c]);
        e += diff * diff;
      }
  }
  return e;
}

}  // namespace

TEST_CASE("calibrator: fitted codebook levels", "[calibrate][codebook]") {
  const int d = 64, T = 512;
  const format_id cb2 = fmt_of("cb2"), cb3 = fmt_of("cb3/g32"), cb4 = fmt_of("cb4");
  calibrator_options opt;
  opt.formats = {fmt_of("kivi4/g32"), cb2, cb3, cb4};
  opt.fit_codebooks = true;
  opt.rotated = true;
  const tensor3 q = gaussian(T, 2, d, 41);
  // K: Gaussian rows; V: Laplace rows (heavier tails than the normal the default levels assume)
  const tensor3 k = gaussian(T, 1, d, 42, 2.f);
  tensor3 v(T, 1, d);
  {
    std::mt19937_64 rng(43);
    std::exponential_distribution<float> ex(1.f);
    std::bernoulli_distribution sign(0.5);
    for (float& e : v.x) e = (sign(rng) ? 1.f : -1.f) * ex(rng);
  }
  auto c = calibrator::create(make_shape(1, 2, 1, d), opt).value_or_throw();
  CHECK(c.fitted_codebooks().error().message().find("layer 0 was never observed") != std::string::npos);
  REQUIRE(c.observe(0, q.view(), k.view(), v.view()).ok());
  const auto fits = c.fitted_codebooks().value_or_throw();
  REQUIRE(fits.size() == 6);  // three candidates, unrotated then rotated
  for (size_t i = 0; i < fits.size(); ++i) {
    CHECK(fits[i].format == opt.formats[1 + i % 3]);
    CHECK(fits[i].rotated == (i >= 3));
    CHECK(fits[i].levels.size() == size_t(2) << traits_of(fits[i].format).bits);
    CHECK(check_codebook_levels(std::span(fits[i].levels).first(size_t(1) << traits_of(fits[i].format).bits),
                                traits_of(fits[i].format).bits, "k")
              .ok());
  }
  // Gaussian K in units of its rms: the fit lands near the Lloyd-Max levels of N(0, 1)
  for (int kk = 0; kk < 4; ++kk) CHECK(std::abs(fits[0].levels[size_t(kk)] - lloyd_max_level(2, kk)) < 0.06);
  // Laplace V: the fit spreads the outer levels and lowers the squared error of the round trip
  CHECK(fits[0].levels[4 + 3] > lloyd_max_level(2, 3) + 0.1f);
  for (size_t i = 0; i < 3; ++i) {
    const double def = codebook_sq_error(v, 0, fits[i].format, role::v, nullptr);
    const double fit = codebook_sq_error(v, 0, fits[i].format, role::v, &fits[i]);
    INFO(format_name(fits[i].format) << ": default " << def << ", fitted " << fit);
    CHECK(fit < 0.97 * def);
    CHECK(codebook_sq_error(k, 0, fits[i].format, role::k, &fits[i]) <=
          1.001 * codebook_sq_error(k, 0, fits[i].format, role::k, nullptr));
  }
  // measured with the fit, the V damage falls (rotated, the Laplace rows are close to normal and
  // the fit close to Lloyd-Max: about equal); the artifact keeps the levels it was measured with
  calibrator_options opt2 = opt;
  opt2.fit_codebooks = false;
  opt2.codebook_levels = fits;
  auto c2 = calibrator::create(make_shape(1, 2, 1, d), opt2).value_or_throw();
  REQUIRE(c2.observe(0, q.view(), k.view(), v.view()).ok());
  for (format_id f : {cb2, cb3, cb4})
    for (bool rotated : {false, true}) {
      INFO(format_name(f) << (rotated ? " rotated" : ""));
      const double fitted = *c2.damage(0, 0, role::v, f, 100.f, rotated),
                   lloyd = *c.damage(0, 0, role::v, f, 100.f, rotated);
      CHECK(fitted < (rotated ? 1.01 : 0.97) * lloyd);
    }
  CHECK(*c2.damage(0, 0, role::k, opt.formats[0]) == *c.damage(0, 0, role::k, opt.formats[0]));  // kivi4 untouched
  calib::artifact a;
  REQUIRE(c2.result(&a, "text").ok());
  REQUIRE(a.codebooks.size() == 6);
  CHECK(a.codebooks[4].levels == fits[4].levels);
  const auto back = calib::artifact::parse(a.to_json().value_or_throw(), "mem", a.shape).value_or_throw();
  CHECK(back.codebooks[2].levels == fits[2].levels);
}

TEST_CASE("calibrator: codebook options are checked, naming the problem", "[calibrate][codebook]") {
  const int d = 64;
  calibrator_options o;
  o.fit_codebooks = true;  // the default candidates hold no codebook
  CHECK(
      calibrator::create(make_shape(1, 4, 2, d), o).error().message().find("no codebook format among the candidates") !=
      std::string::npos);
  o = {};
  o.formats = {fmt_of("cb2")};
  calib::codebook_fit f{fmt_of("cb2"), false, std::vector<float>(2 * 2 * 4, 0.f)};
  for (size_t i = 0; i < f.levels.size(); ++i) f.levels[i] = float(i % 4) - 1.5f;
  f.levels[2 * 4 + 1] = 5.f;  // layer 0 head 1 K: not ascending
  o.codebook_levels = {f};
  CHECK_THAT(calibrator::create(make_shape(1, 4, 2, d), o).error().message(),
             Catch::Contains("codebook_levels[0] layer 0 head 1 K") && Catch::Contains("strictly ascending"));
  f.levels[2 * 4 + 1] = -0.5f;
  f.levels.pop_back();
  o.codebook_levels = {f};
  CHECK_THAT(calibrator::create(make_shape(1, 4, 2, d), o).error().message(), Catch::Contains("needs 16 (layers x kv heads x 2 x"));
  f.levels.push_back(1.5f);
  f.format = fmt_of("cb4");
  o.codebook_levels = {f};
  CHECK_THAT(calibrator::create(make_shape(1, 4, 2, d), o).error().message(),
             Catch::Contains("cb4 is not a codebook candidate"));
  f.format = fmt_of("cb2");
  f.rotated = true;
  o.codebook_levels = {f};
  CHECK_THAT(calibrator::create(make_shape(1, 4, 2, d), o).error().message(),
             Catch::Contains("rotated candidates are not measured"));
  o.rotated = true;
  REQUIRE(calibrator::create(make_shape(1, 4, 2, d), o).ok());
  auto c = calibrator::create(make_shape(1, 4, 2, d)).value_or_throw();
  CHECK(c.fitted_codebooks().error().message().find("were not fitted") != std::string::npos);
}
