// Every format behind KVCache on the CPU backend: values that are not finite are rejected before
// anything is stored, and what `read` returns is the codec's decode of the stored pages.
#include <kvq/cache/cache.hpp>
#include <kvq/codec/codec.hpp>
#include <kvq/policy/static_policy.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

using namespace kvq;

TEST_CASE("every format: NaN or Inf input is rejected and nothing is stored", "[format][errors]") {
  const int fi = GENERATE(range(0, int(format_count)));
  const auto f = format_id(fi);
  const int layers = 1, hq = 4, h = 2, d = 64, P = 64, R = 128, r = 64;
  if (!check_shape(f, role::k, P, d).ok() || !check_shape(f, role::v, P, d).ok()) return;
  CAPTURE(format_name(f));
  cache_config cfg;
  cfg.shape = {layers, hq, h, d, P, R, r};
  cfg.budget_bytes = 8ull << 20;
  auto pol = std::make_shared<static_policy>(static_policy::parse(format_name(f)).value_or_throw());
  KVCache c = KVCache::create(cfg, pol).value_or_throw();
  check(c.create_sequence(0));
  std::mt19937 rng(uint32_t(100 + fi));
  std::normal_distribution<float> nd(0.f, 2.f);
  const int T = 200;  // one page encoded (P + r <= T), more in the ring
  std::vector<float> k(size_t(T) * h * d), v(k.size());
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  check(c.append(0, 0, {k.data(), dtype::f32, T, h, d}, {v.data(), dtype::f32, T, h, d}));
  const auto read_all = [&](role ro) {
    std::vector<float> out(size_t(c.length(0, 0)) * h * d);
    check(c.read(0, 0, ro, out));
    return out;
  };
  const std::vector<float> k0 = read_all(role::k), v0 = read_all(role::v);
  const cache_stats s0 = c.stats();

  // the stored page is the codec's encoding of the fp16 input: read returns its decode, bit for bit
  for (role ro : {role::k, role::v}) {
    const codec::page_geom g = codec::make_geom(f, ro, P, d);
    const std::vector<float>& x = ro == role::k ? k : v;
    const std::vector<float>& got = ro == role::k ? k0 : v0;
    for (int head = 0; head < h; ++head) {
      std::vector<uint16_t> src(size_t(P) * d);
      for (int t = 0; t < P; ++t)
        for (int ch = 0; ch < d; ++ch) src[size_t(t) * d + ch] = float_to_half(x[(size_t(t) * h + head) * d + ch]);
      std::vector<uint8_t> page(g.lay.total(), 0);
      for (int u = 0; u < g.unit_count(); ++u) codec::encode_unit(g, src.data(), d, u, page.data(), codec::no_clip);
      size_t diff = 0;
      for (int t = 0; t < P; ++t)
        for (int ch = 0; ch < d; ++ch) {
          const float want = codec::decode_element(g, page.data(), t, ch);
          diff += std::memcmp(&want, &got[(size_t(t) * h + head) * d + ch], 4) != 0;
        }
      CAPTURE(role_name(ro), head);
      REQUIRE(diff == 0);
    }
  }

  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    for (bool in_k : {true, false}) {
      // deep inside an append that would complete a page
      auto k2 = k, v2 = v;
      (in_k ? k2 : v2)[(size_t(90) * h + 1) * d + 7] = bad;
      const status st = c.append(0, 0, {k2.data(), dtype::f32, 100, h, d}, {v2.data(), dtype::f32, 100, h, d});
      CAPTURE(bad, in_k);
      REQUIRE(st.code() == errc::non_finite);
      REQUIRE(c.length(0, 0) == T);
      REQUIRE(c.stats().pages == s0.pages);
      REQUIRE(c.stats().page_bytes == s0.page_bytes);
      REQUIRE(read_all(role::k) == k0);
      REQUIRE(read_all(role::v) == v0);
    }
  }
}
