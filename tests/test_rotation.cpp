// The randomized Hadamard rotation (rotation/hadamard.hpp) and rotated caches on the CPU: the
// transform against its matrix, the cache configuration's checks, an FP16 rotated cache against
// the unrotated one, every format rotated through read() and attention, prefill and
// attend_prefix, and rotated kivi against unrotated on data with outlier channels.
#include <kvq/attention/reference.hpp>
#include <kvq/calib/calibrate.hpp>
#include <kvq/cache/cache.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/echokv.hpp>
#include <kvq/policy/static_policy.hpp>
#include <kvq/rotation/rotation.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <vector>

using namespace kvq;

namespace {

constexpr int L = 2, Hq = 4, H = 2;

cache_config make_config(int d, bool rotated, int window = 128, int recent = 32) {
  cache_config cfg;
  cfg.shape = {L, Hq, H, d, 64, window, recent};
  cfg.budget_bytes = 64ull << 20;
  if (rotated) cfg.rotation = rotation_config::all(cfg.shape, 1234);
  return cfg;
}

KVCache make_cache(format_pair p, int d, bool rotated) {
  return KVCache::create(make_config(d, rotated), std::make_shared<static_policy>(p)).value_or_throw();
}

std::vector<float> randn(std::mt19937& rng, size_t n, float sigma = 1.f) {
  std::normal_distribution<float> nd(0.f, sigma);
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng);
  return x;
}

// An outlier channel's value from a unit normal draw z: a large offset and a wider spread, as the
// massive channels of real keys and values.
float outlier(float z) { return 10.f + 3.f * z; }

tensor_view view(const std::vector<float>& x, int64_t tokens, int heads, int d) { return {x.data(), dtype::f32, tokens, heads, d}; }
tensor_mut out_view(std::vector<float>& x, int64_t tokens, int heads, int d) { return {x.data(), dtype::f32, tokens, heads, d}; }

double nmse(const std::vector<float>& a, const std::vector<float>& ref) {
  double e = 0, n = 0;
  for (size_t i = 0; i < a.size(); ++i) e += double(a[i] - ref[i]) * (a[i] - ref[i]), n += double(ref[i]) * ref[i];
  return e / n;
}

std::vector<float> read_all(const KVCache& c, seq_id s, int layer, role r) {
  const auto& sh = c.config().shape;
  std::vector<float> out(size_t(c.length(s, layer)) * sh.kv_heads * sh.head_dim);
  check(c.read(s, layer, r, out));
  return out;
}

// The decode output of a cache holding (k, v) of n tokens, for q_len queries.
std::vector<float> decode(KVCache& c, const std::vector<float>& q, int q_len, int layer = 1) {
  const int d = c.config().shape.head_dim;
  std::vector<float> o(size_t(q_len) * Hq * d);
  const attend_item it{7, q_len};
  check(c.attend({&it, 1}, layer, view(q, q_len, Hq, d), out_view(o, q_len, Hq, d)));
  return o;
}

}  // namespace

TEST_CASE("the rotation is H*D/sqrt(d) and its inverse undoes it", "[rotation]") {
  const int d = GENERATE(8, 64, 128, 256);
  CAPTURE(d);
  const auto s = rotation::signs::of(99, 3, 1);
  std::mt19937 rng{uint32_t(d)};
  auto x = randn(rng, size_t(d));
  std::vector<float> y = x;
  rotation::rotate(y.data(), d, s);
  for (int i = 0; i < d; ++i) {  // the Sylvester matrix: H[i][j] = (-1)^popcount(i & j)
    double acc = 0;
    for (int j = 0; j < d; ++j) acc += (__builtin_popcount(unsigned(i & j)) & 1 ? -1.0 : 1.0) * (s.flip(j) ? -x[j] : x[j]);
    REQUIRE(std::fabs(y[i] - acc / std::sqrt(double(d))) < 1e-5);
  }
  rotation::unrotate(y.data(), d, s);
  for (int i = 0; i < d; ++i) REQUIRE(std::fabs(y[i] - x[i]) < 1e-5);
  // roughly half the channels flip, and another head flips others
  int flips = 0, differ = 0;
  const auto other = rotation::signs::of(99, 3, 2);
  for (int c = 0; c < 256; ++c) flips += s.flip(c), differ += s.flip(c) != other.flip(c);
  REQUIRE(flips > 96);
  REQUIRE(flips < 160);
  REQUIRE(differ > 96);
  REQUIRE(rotation::inv_sqrt(d) == float(1.0 / std::sqrt(double(d))));
}

TEST_CASE("a rotation configuration is checked: head_dim a power of two, heads of the shape", "[rotation]") {
  auto pol = std::make_shared<static_policy>(*parse_format_pair("kivi4/g32"));
  cache_config cfg = make_config(96, true);
  auto c = KVCache::create(cfg, pol);
  REQUIRE_FALSE(c.ok());
  REQUIRE(c.error().code() == errc::invalid_argument);
  REQUIRE_THAT(c.error().message(), Catch::Contains("head_dim 96") && Catch::Contains("power of two"));
  cfg.rotation = {};  // unrotated, head_dim 96 is fine
  REQUIRE(KVCache::create(cfg, pol).ok());
  cfg = make_config(64, true);
  cfg.rotation.heads.pop_back();
  c = KVCache::create(cfg, pol);
  REQUIRE_FALSE(c.ok());
  REQUIRE_THAT(c.error().message(), Catch::Contains("rotation.heads has 3 entries"));
  cfg.rotation.heads.push_back(2);
  REQUIRE_THAT(KVCache::create(cfg, pol).error().message(), Catch::Contains("rotation.heads[3] is 2"));
}

TEST_CASE("an FP16 rotated cache attends as the unrotated one, to fp16 rounding", "[rotation]") {
  const int d = GENERATE(64, 128, 256);
  const int64_t n = GENERATE(1, 63, 97, 200);
  const int q_len = GENERATE(1, 3);
  CAPTURE(d, n, q_len);
  if (q_len > n) return;
  std::mt19937 rng(uint32_t(d * 1000 + n));
  auto k = randn(rng, size_t(n) * H * d), v = randn(rng, size_t(n) * H * d), q = randn(rng, size_t(q_len) * Hq * d);
  KVCache plain = make_cache({}, d, false), rot = make_cache({}, d, true);
  for (KVCache* c : {&plain, &rot}) {
    check(c->create_sequence(7));
    check(c->append(7, 1, view(k, n, H, d), view(v, n, H, d)));
  }
  const auto a = decode(plain, q, q_len), b = decode(rot, q, q_len);
  REQUIRE(nmse(b, a) < 1e-6);  // fp16 storage of rotated vs unrotated values: 2^-11 relative each
  for (role r : {role::k, role::v}) REQUIRE(nmse(read_all(rot, 7, 1, r), read_all(plain, 7, 1, r)) < 1e-6);
  // a layer's output matches float64 attention over the input to fp16 rounding
  std::vector<float> ref(size_t(q_len) * Hq * d);
  ref::attend(k.data(), v.data(), n, q.data(), q_len, Hq, H, d, 1.f / std::sqrt(float(d)), ref.data());
  REQUIRE(nmse(b, ref) < 1e-6);
}

TEST_CASE("every format rotated round-trips through read() and attends over what read() returns", "[rotation]") {
  const int d = 64;
  const int64_t n = 200;  // two pages per head and role, 72 tokens in the ring
  std::mt19937 rng(5);
  auto k = randn(rng, size_t(n) * H * d), v = randn(rng, size_t(n) * H * d), q = randn(rng, size_t(Hq) * d);
  for (format_id f = 0; f < format_count; ++f) {
    if (!check_shape(f, role::k, 64, d).ok() || !check_shape(f, role::v, 64, d).ok()) continue;  // g128 at d 64
    const std::string name = format_name(f);
    CAPTURE(name);
    KVCache c = make_cache({f, f}, d, true);
    check(c.create_sequence(7));
    check(c.append(7, 1, view(k, n, H, d), view(v, n, H, d)));
    const auto kr = read_all(c, 7, 1, role::k), vr = read_all(c, 7, 1, role::v);
    const int bits = format_table[f].bits;
    // per-format error budgets of Gaussian rows (symmetric 2-bit has three levels); a wrong
    // rotation back gives an NMSE near 2
    const double bound = bits >= 8 ? 1e-3 : bits == 4 ? 2e-2 : 0.4;
    REQUIRE(nmse(kr, k) < bound);
    REQUIRE(nmse(vr, v) < bound);
    // ring tokens come back as the fp16 rounding of the rotated value, rotated back
    const size_t ring0 = size_t(128) * H * d;
    const std::vector<float> kt(kr.begin() + ring0, kr.end()), kin(k.begin() + ring0, k.end());
    REQUIRE(nmse(kt, kin) < 1e-6);
    // attention over the cache is attention over read()'s values
    std::vector<float> ref(size_t(Hq) * d);
    ref::attend(kr.data(), vr.data(), n, q.data(), 1, Hq, H, d, 1.f / std::sqrt(float(d)), ref.data());
    REQUIRE(nmse(decode(c, q, 1), ref) < 1e-9);
  }
}

TEST_CASE("prefill and attend_prefix of a rotated cache match the unrotated FP16 cache", "[rotation]") {
  const int d = 128;
  const int64_t n0 = 150, T = 200;  // a chunk longer than the window, after a stored prefix
  std::mt19937 rng(11);
  auto k = randn(rng, size_t(n0 + T) * H * d), v = randn(rng, size_t(n0 + T) * H * d);
  auto q = randn(rng, size_t(T) * Hq * d);
  KVCache plain = make_cache({}, d, false), rot = make_cache({}, d, true);
  std::vector<float> oa(size_t(T) * Hq * d), ob(oa.size()), la(size_t(T) * Hq), lb(la.size()), pa(oa.size()),
      pb(oa.size());
  for (auto [c, o, po, lse] : {std::tuple{&plain, &oa, &pa, &la}, std::tuple{&rot, &ob, &pb, &lb}}) {
    check(c->create_sequence(7));
    check(c->append(7, 0, view(k, n0, H, d), view(v, n0, H, d)));
    check(c->prefill(7, 0, {k.data() + n0 * H * d, dtype::f32, T, H, d}, {v.data() + n0 * H * d, dtype::f32, T, H, d},
                     view(q, T, Hq, d), out_view(*o, T, Hq, d)));
    check(c->attend_prefix(7, 0, n0, view(q, T, Hq, d), out_view(*po, T, Hq, d), lse->data()));
  }
  REQUIRE(nmse(ob, oa) < 1e-6);
  REQUIRE(nmse(pb, pa) < 1e-6);
  for (size_t i = 0; i < la.size(); ++i) REQUIRE(std::fabs(la[i] - lb[i]) < 1e-3);
}

TEST_CASE("rotated kivi4 and kivi2 lose less than unrotated on keys and values with outlier channels", "[rotation]") {
  const std::string spec = GENERATE("kivi4/g32", "kivi2/g32");
  CAPTURE(spec);
  const int d = 128;
  const int64_t n = 544;  // 7 pages per head and role
  std::mt19937 rng(2024);
  auto k = randn(rng, size_t(n) * H * d), v = randn(rng, size_t(n) * H * d), q = randn(rng, size_t(Hq) * d, 0.5f);
  // a few channels per head carry most of the magnitude, as in real keys and values
  for (int64_t t = 0; t < n; ++t)
    for (int h = 0; h < H; ++h)
      for (int c : {5, 40, 77, 100}) {
        k[(size_t(t) * H + h) * d + c] = outlier(k[(size_t(t) * H + h) * d + c]);
        v[(size_t(t) * H + h) * d + c] = outlier(v[(size_t(t) * H + h) * d + c]);
      }
  std::vector<double> err[2];
  for (bool rotated : {false, true}) {
    KVCache c = make_cache(*parse_format_pair(spec), d, rotated);
    check(c.create_sequence(7));
    check(c.append(7, 1, view(k, n, H, d), view(v, n, H, d)));
    std::vector<float> ref(size_t(Hq) * d);
    ref::attend(k.data(), v.data(), n, q.data(), 1, Hq, H, d, 1.f / std::sqrt(float(d)), ref.data());
    err[rotated] = {nmse(read_all(c, 7, 1, role::k), k), nmse(read_all(c, 7, 1, role::v), v), nmse(decode(c, q, 1), ref)};
  }
  CAPTURE(err[0], err[1]);
  REQUIRE(err[1][1] < 0.5 * err[0][1]);  // V: per-token groups no longer sized by the outlier channels
  REQUIRE(err[1][2] < err[0][2]);        // the attention output
  REQUIRE(err[1][0] + err[1][1] < err[0][0] + err[0][1]);
}

TEST_CASE("the +rot suffix of a format spec", "[rotation]") {
  const auto a = parse_format_spec("kivi2/g32+rot");
  REQUIRE(a.ok());
  REQUIRE(a->rotated);
  REQUIRE(a->pair == *parse_format_pair("kivi2/g32"));
  REQUIRE(format_spec_name(*a) == "kivi2/g32+rot");
  const auto b = parse_format_spec(" k=kivi4/g32,v=kivi2/g32+rot ");
  REQUIRE(b.ok());
  REQUIRE(b->rotated);
  REQUIRE(format_spec_name(*b) == "k=kivi4/g32,v=kivi2/g32+rot");
  const auto c = parse_format_spec("sym4/g32");
  REQUIRE(c.ok());
  REQUIRE_FALSE(c->rotated);
  REQUIRE(format_spec_name(*c) == "sym4/g32");
  REQUIRE_THAT(parse_format_spec("+rot").error().message(), Catch::Contains("needs a format"));
  REQUIRE_THAT(parse_format_spec("kivi2+rot/g32").error().message(), Catch::Contains("only suffix is '+rot'"));
  REQUIRE_THAT(parse_format_spec("kivi2/g32+rotx").error().message(), Catch::Contains("only suffix"));
  REQUIRE_FALSE(parse_format_spec("kivi5+rot").ok());
  // a page format has no rotation: the pair parser points to where it belongs
  REQUIRE_THAT(parse_format_pair("kivi2/g32+rot").error().message(),
               Catch::Contains("cache_config::rotation") && Catch::Contains("parse_format_spec"));
}

TEST_CASE("EchoKV's canary on a rotated cache measures the damage in the rotated space", "[rotation]") {
  const int d = 64;
  const int64_t n = 120;
  std::mt19937 rng(77);
  auto k = randn(rng, size_t(n) * H * d), v = randn(rng, size_t(n) * H * d), q = randn(rng, size_t(Hq) * d);
  for (int64_t t = 0; t < n; ++t)
    for (int h = 0; h < H; ++h) k[(size_t(t) * H + h) * d + 9] = outlier(k[(size_t(t) * H + h) * d + 9]);
  // The rotated inputs, as the rotated cache computes them (the same float arithmetic).
  const rotation_config rc = rotation_config::all(make_config(d, true).shape, 1234);
  std::vector<float> kr = k, vr = v, qr = q;
  rotation::apply_rows(rc, 1, H, 1, kr.data(), n, H, d, false);
  rotation::apply_rows(rc, 1, H, 1, vr.data(), n, H, d, false);
  rotation::apply_rows(rc, 1, H, Hq / H, qr.data(), 1, Hq, d, false);
  echokv_options eo;
  eo.tiers = {*parse_format("sym4/g32"), *parse_format("sym8/g32")};
  eo.rate = 1.0;
  eo.granularity = echokv_granularity::per_head;
  const auto run = [&](bool rotated, const std::vector<float>& kk, const std::vector<float>& vv,
                       const std::vector<float>& qq) {
    auto pol = std::make_shared<echokv_policy>(eo);
    KVCache c = KVCache::create(make_config(d, rotated), pol).value_or_throw();
    check(c.create_sequence(7));
    check(c.append(7, 1, view(kk, n, H, d), view(vv, n, H, d)));
    (void)decode(c, qq, 1);
    REQUIRE(pol->counters().canary_evaluations == 1);
    return std::vector<double>{pol->ema(pol->unit_of(1, 0), 0), pol->ema(pol->unit_of(1, 1), 0)};
  };
  const auto rotated = run(true, k, v, q), in_rotated_space = run(false, kr, vr, qr), plain = run(false, k, v, q);
  CAPTURE(rotated, plain);
  REQUIRE(rotated == in_rotated_space);  // bit for bit: the canary sees the rotated ring and queries
  for (int h = 0; h < H; ++h) REQUIRE(rotated[size_t(h)] < 0.5 * plain[size_t(h)]);
}

TEST_CASE("the calibrator measures rotated candidates; the artifact keeps them (version 2)", "[rotation]") {
  const int d = 64, T = 128;
  const cache_shape shape{1, Hq, H, d, 64, 128, 32};
  calib::calibrator_options opt;
  opt.formats = {fp16_format, *parse_format("kivi2/g32"), *parse_format("sym4/g32"), *parse_format("ra4/g32")};
  opt.rotated = true;
  opt.rotation_seed = 1234;
  auto cal = calib::calibrator::create(shape, opt).value_or_throw();
  std::mt19937 rng(3);
  auto q = randn(rng, size_t(T) * Hq * d), k = randn(rng, size_t(T) * H * d), v = randn(rng, size_t(T) * H * d);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h)
      for (int c : {2, 33}) {
        k[(size_t(t) * H + h) * d + c] = outlier(k[(size_t(t) * H + h) * d + c]);
        v[(size_t(t) * H + h) * d + c] = outlier(v[(size_t(t) * H + h) * d + c]);
      }
  check(cal.observe(0, view(q, T, Hq, d), view(k, T, H, d), view(v, T, H, d)));
  for (int h = 0; h < H; ++h)
    for (role r : {role::k, role::v}) {
      REQUIRE(*cal.damage(0, h, r, fp16_format, 100.f, true) == 0.0);
      const double s4 = *cal.damage(0, h, r, opt.formats[2]), s4r = *cal.damage(0, h, r, opt.formats[2], 100.f, true);
      CAPTURE(h, r, s4, s4r);
      REQUIRE(s4r < 0.5 * s4);  // per-token groups no longer sized by the outlier channels
    }
  const double v2 = *cal.damage(0, 0, role::v, opt.formats[1]),
               v2r = *cal.damage(0, 0, role::v, opt.formats[1], 100.f, true);
  REQUIRE(v2r < v2);
  calib::artifact a;
  const auto prof = cal.result(&a, "text").value_or_throw();
  const auto rprof = cal.rotated_result().value_or_throw();
  REQUIRE(a.version == 4);
  REQUIRE(a.has_rotated());
  REQUIRE(a.rotated_clip_percentiles == cal.clip_percentiles(true));
  REQUIRE(a.rotation_seed == 1234);
  REQUIRE(a.rotated_sensitivity.values == rprof.values);
  REQUIRE(rprof.at(0, 0, role::v, 2) == *cal.damage(0, 0, role::v, opt.formats[2], 100.f, true));
  REQUIRE(prof.at(0, 0, role::v, 2) == *cal.damage(0, 0, role::v, opt.formats[2]));
  // the JSON round trip keeps them bit for bit
  const std::string text = a.to_json().value_or_throw();
  REQUIRE_THAT(text, Catch::Contains("\"seed\": \"0x00000000000004d2\""));
  const calib::model_shape ms{1, Hq, H, d};
  const auto b = calib::artifact::parse(text, "mem", ms).value_or_throw();
  REQUIRE(b.rotation_seed == 1234);
  REQUIRE(b.rotated_sensitivity.values == a.rotated_sensitivity.values);
  REQUIRE(b.rotated_sensitivity.formats == a.rotated_sensitivity.formats);
  // version 1 (no rotated damages) still loads; a version 1 file with them does not
  calib::artifact old = a;
  old.clip_percentiles.assign(old.clip_percentiles.size(), 100.f);  // versions 1-3 hold no percentiles
  old.rotated_clip_percentiles.clear();
  old.version = 3;
  std::string v1_rot = old.to_json().value_or_throw();
  old.rotated_sensitivity = {};
  old.version = 1;
  const std::string v1 = old.to_json().value_or_throw();
  REQUIRE(calib::artifact::parse(v1, "v1", ms).value_or_throw().version == 1);
  v1_rot.replace(v1_rot.find("\"version\": 3"), 12, "\"version\": 1");
  REQUIRE_THAT(calib::artifact::parse(v1_rot, "v1rot", ms).error().message(),
               Catch::Contains("'rotated' needs version 2, the file is version 1"));
  std::string bad_seed = text;
  bad_seed.replace(bad_seed.find("0x00000000000004d2"), 18, "1234");
  REQUIRE_THAT(calib::artifact::parse(bad_seed, "seed", ms).error().message(), Catch::Contains("rotated.seed"));
  // a rotated calibration needs a power-of-two head_dim
  const cache_shape odd{1, Hq, H, 96, 64, 128, 32};
  opt.formats = {fp16_format};
  REQUIRE_THAT(calib::calibrator::create(odd, opt).error().message(), Catch::Contains("head_dim 96"));
}

TEST_CASE("a K/V row whose rotation leaves the fp16 range is rejected and nothing is stored", "[rotation]") {
  const int d = 64;
  KVCache c = make_cache({}, d, true);
  check(c.create_sequence(7));
  std::vector<float> k(size_t(H) * d, 1.f), v(k.size(), 1.f);
  const auto sg = c.config().rotation.signs_of(1, 1);
  for (int ch = 0; ch < d; ++ch) k[size_t(d) + ch] = sg.apply(30000.f, ch);  // R x = (240000, 0, ..., 0)
  const status st = c.append(7, 1, view(k, 1, H, d), view(v, 1, H, d));
  REQUIRE(st.code() == errc::invalid_argument);
  REQUIRE_THAT(st.message(), Catch::Contains("K[token 0][head 1]") && Catch::Contains("rotated"));
  REQUIRE(c.length(7, 1) == 0);
  REQUIRE(c.stats().tokens == 0);
  KVCache plain = make_cache({}, d, false);  // unrotated, the same row fits
  check(plain.create_sequence(7));
  REQUIRE(plain.append(7, 1, view(k, 1, H, d), view(v, 1, H, d)).ok());
}

TEST_CASE("fork and truncate of a rotated cache leave it as a direct append would", "[rotation]") {
  const int d = 64;
  // n = 230: pages [0, 192), the ring holds [102, 230). Cuts that leave the kept tokens' pages as
  // a direct append would (the rule of docs/architecture.md, "Truncation")
  const int64_t n = 230, keep = GENERATE(229, 200, 192, 170, 166);
  CAPTURE(keep);
  std::mt19937 rng{uint32_t(keep)};
  auto k = randn(rng, size_t(n) * H * d), v = randn(rng, size_t(n) * H * d);
  const format_pair p = *parse_format_pair("kivi4/g32");
  KVCache c = make_cache(p, d, true), direct = make_cache(p, d, true);
  check(c.create_sequence(1));
  for (int l = 0; l < L; ++l) check(c.append(1, l, view(k, n, H, d), view(v, n, H, d)));
  check(c.fork(1, 7));
  check(c.truncate(7, keep));
  check(direct.create_sequence(7));
  for (int l = 0; l < L; ++l) check(direct.append(7, l, view(k, keep, H, d), view(v, keep, H, d)));
  for (role r : {role::k, role::v}) REQUIRE(read_all(c, 7, 1, r) == read_all(direct, 7, 1, r));
  // both continue alike, and attend alike
  auto k2 = randn(rng, size_t(40) * H * d), v2 = randn(rng, k2.size()), q = randn(rng, size_t(Hq) * d);
  for (KVCache* x : {&c, &direct})
    for (int l = 0; l < L; ++l) check(x->append(7, l, view(k2, 40, H, d), view(v2, 40, H, d)));
  for (role r : {role::k, role::v}) REQUIRE(read_all(c, 7, 1, r) == read_all(direct, 7, 1, r));
  REQUIRE(decode(c, q, 1) == decode(direct, q, 1));
  REQUIRE(read_all(c, 1, 1, role::k).size() == size_t(n) * H * d);  // the source is untouched
}

TEST_CASE("a cut inside a rotated page whose tokens left the ring restores them to fp16 rounding", "[rotation]") {
  const int d = 64;
  const int64_t n = 230, keep = 100;  // inside page [64, 128), whose tokens 64..101 left the ring
  std::mt19937 rng(8);
  auto k = randn(rng, size_t(n) * H * d), v = randn(rng, size_t(n) * H * d);
  KVCache c = make_cache(*parse_format_pair("kivi2/g32"), d, true);
  check(c.create_sequence(1));
  for (int l = 0; l < L; ++l) check(c.append(1, l, view(k, n, H, d), view(v, n, H, d)));
  const auto before = read_all(c, 1, 1, role::k);
  check(c.truncate(1, keep));
  const auto after = read_all(c, 1, 1, role::k);
  REQUIRE(after.size() == size_t(keep) * H * d);
  const std::vector<float> kept(before.begin(), before.begin() + ptrdiff_t(after.size()));
  REQUIRE(nmse(after, kept) < 1e-6);  // the page's values, rounded to fp16 in the rotated space
}

TEST_CASE("a rotated cache takes f16/bf16 and strided views, and writes f16 outputs", "[rotation]") {
  const int d = 128;
  const int64_t n = 150;
  std::mt19937 rng(31);
  auto k = randn(rng, size_t(n) * H * d), v = randn(rng, size_t(n) * H * d), q = randn(rng, size_t(3) * Hq * d);
  // K as bf16 and V as f16, then q with a padded token stride and an f16 output with one too
  std::vector<uint16_t> kb(k.size()), vh(v.size());
  for (size_t i = 0; i < k.size(); ++i) kb[i] = float_to_bf16(k[i]), k[i] = bf16_to_float(kb[i]);
  for (size_t i = 0; i < v.size(); ++i) vh[i] = float_to_half(v[i]), v[i] = half_to_float(vh[i]);
  const int64_t qs = int64_t(Hq) * d + 16, os = int64_t(Hq) * d + 8;
  std::vector<float> qpad(size_t(3) * qs, 1e30f);
  for (int i = 0; i < 3; ++i) std::copy_n(q.begin() + i * Hq * d, Hq * d, qpad.begin() + i * qs);
  KVCache a = make_cache({}, d, true), b = make_cache({}, d, true);
  check(a.create_sequence(7));
  check(b.create_sequence(7));
  check(a.append(7, 1, {kb.data(), dtype::bf16, n, H, d}, {vh.data(), dtype::f16, n, H, d}));
  check(b.append(7, 1, view(k, n, H, d), view(v, n, H, d)));
  for (role r : {role::k, role::v}) REQUIRE(read_all(a, 7, 1, r) == read_all(b, 7, 1, r));
  std::vector<uint16_t> oh(size_t(3) * os, 0);
  const attend_item it{7, 3};
  check(a.attend({&it, 1}, 1, {qpad.data(), dtype::f32, 3, Hq, d, qs}, {oh.data(), dtype::f16, 3, Hq, d, os}));
  const auto ref = decode(b, q, 3);
  for (int i = 0; i < 3; ++i)
    for (int e = 0; e < Hq * d; ++e) {
      CAPTURE(i, e);
      REQUIRE(half_to_float(oh[size_t(i) * os + e]) == half_to_float(float_to_half(ref[size_t(i) * Hq * d + e])));
    }
  for (int i = 0; i < 3; ++i)
    for (int64_t e = Hq * d; e < os; ++e) REQUIRE(oh[size_t(i * os + e)] == 0);  // the padding is not written
}
