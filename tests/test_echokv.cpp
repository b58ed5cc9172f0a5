// EchoKV: decisions on synthetic δ streams that cross τ (promote, demote, hysteresis, τ(L), freeze,
// per-head mode), snapshots and votes, the canary RNG, the KL measurement on real windows (exact
// cases, GQA mapping, group alignment), the budget controller's step response, and a real
// KVCache whose stored pages never change when the tiers do.
#include <kvq/cache/cache.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/echokv.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

using namespace kvq;

namespace {

format_id F(const char* spec) { return parse_format(spec).value_or_throw(); }

const cache_shape shape2{2, 8, 2, 64, 64, 128, 32};

echokv_options every_step(int k = 1, double h = 0.0, int initial = -1) {
  echokv_options o;
  o.rate = 1.0;
  o.hysteresis_steps = k;
  o.hysteresis_margin = h;
  o.initial_tier = initial;
  return o;
}

// One canary step: every layer gets the same δ for tiers (2, 4, 8 bits).
void feed(echokv_policy& p, int64_t context, std::vector<double> delta, int layers = 2, seq_id seq = 0) {
  for (int l = 0; l < layers; ++l) check(p.ingest({seq, l, context, delta}));
}

}  // namespace

TEST_CASE("echokv promotes at once when the EMA of its tier crosses tau", "[echokv]") {
  echokv_policy p(every_step(1, 0.0, 0));
  REQUIRE(p.bind(shape2).ok());
  CHECK(p.current(1, 0) == format_pair{F("kivi2/g32"), F("kivi2/g32")});  // V follows K by default
  // 2 bits damages 0.1 > tau = 0.022 at L = L0; 4 bits 0.01 < tau: the first canary promotes to 4
  feed(p, 4096, {0.1, 0.01, 0.001});
  CHECK(p.tier(0) == 1);
  CHECK(p.tier(1) == 1);
  CHECK(p.counters().promotions == 2);
  CHECK(p.ema(0, 1) == 0.01);  // the first measurement initializes the EMA
  // now 4 bits damages 0.05: EMA_4 = 0.05 - 0.04 * 0.9^n crosses 0.022 at n = 4 (alpha = 0.1)
  for (int n = 1; n <= 3; ++n) {
    feed(p, 4096 + n, {0.1, 0.05, 0.001});
    CAPTURE(n, p.ema(0, 1));
    CHECK(p.tier(0) == 1);
  }
  feed(p, 4100, {0.1, 0.05, 0.001});
  CHECK(p.ema(0, 1) == Approx(0.05 - 0.04 * std::pow(0.9, 4)));
  CHECK(p.tier(0) == 2);
  CHECK(p.current(0, 1).k == F("kivi8/g32"));
  CHECK(p.counters().promotions == 4);
  CHECK(p.counters().demotions == 0);
}

TEST_CASE("echokv demotes only after k consecutive canaries below tau*(1-h)", "[echokv]") {
  auto o = every_step(3, 0.1);
  o.alpha = 1.0;  // EMA = last δ, so each canary's side of the threshold is set by hand
  echokv_policy p(o);
  REQUIRE(p.bind(shape2).ok());
  REQUIRE(p.tier(0) == 2);                                    // starts at the highest tier
  const double below = 0.015, between = 0.021, above = 0.03;  // tau(1-h) = 0.0198, tau = 0.022
  SECTION("three in a row demote, two do not") {
    feed(p, 4096, {1, below, 0});
    feed(p, 4097, {1, below, 0});
    CHECK(p.tier(0) == 2);
    feed(p, 4098, {1, below, 0});
    CHECK(p.tier(0) == 1);
    CHECK(p.counters().demotions == 2);  // both layers
  }
  SECTION("below tau but inside the margin holds forever") {
    for (int n = 0; n < 50; ++n) feed(p, 4096 + n, {1, between, 0});
    CHECK(p.tier(0) == 2);
    CHECK(p.counters().demotions == 0);
  }
  SECTION("an interruption restarts the count") {
    int64_t L = 4096;
    for (int rep = 0; rep < 5; ++rep) {
      feed(p, L++, {1, below, 0});
      feed(p, L++, {1, below, 0});
      feed(p, L++, {1, above, 0});
    }
    CHECK(p.tier(0) == 2);
    feed(p, L++, {1, below, 0});
    feed(p, L++, {1, below, 0});
    feed(p, L++, {1, below, 0});
    CHECK(p.tier(0) == 1);
  }
  SECTION("it demotes to the lowest tier whose streak is complete, and promotes back at once") {
    for (int n = 0; n < 3; ++n) feed(p, 4096 + n, {0.001, 0.0001, 0});
    CHECK(p.tier(0) == 0);
    feed(p, 5000, {0.05, 0.0001, 0});  // one canary above tau promotes
    CHECK(p.tier(0) == 1);
    CHECK(p.counters().promotions == 2);
  }
}

TEST_CASE("echokv: tau grows with sqrt(context), so decisions move both ways with L", "[echokv]") {
  auto o = every_step();
  o.alpha = 1.0;
  echokv_policy p(o);
  REQUIRE(p.bind(shape2).ok());
  CHECK(p.tau(4096) == Approx(0.022));
  CHECK(p.tau(4 * 4096) == Approx(0.044));
  CHECK(p.tau(1024) == Approx(0.011));
  feed(p, 4096, {1, 0.03, 0.0});  // 0.03 > 0.022: stays at 8 bits
  CHECK(p.tier(0) == 2);
  feed(p, 4 * 4096, {1, 0.03, 0.0});  // 0.03 < 0.044: 4 bits
  CHECK(p.tier(0) == 1);
  feed(p, 1024, {1, 0.03, 0.0});  // a shorter sequence: back to 8 bits
  CHECK(p.tier(0) == 2);
}

TEST_CASE("echokv per-head mode decides per (layer, kv head)", "[echokv]") {
  auto o = every_step();
  o.granularity = echokv_granularity::per_head;
  echokv_policy p(o);
  REQUIRE(p.bind(shape2).ok());
  REQUIRE(p.units() == 4);
  CHECK(p.unit_of(1, 1) == 3);
  // layer 1: head 0 tolerates 2 bits, head 1 needs 8
  check(p.ingest({0, 1, 4096, {0.001, 0.0005, 0.0, 0.5, 0.1, 0.01}}));
  CHECK(p.current(1, 0).k == F("kivi2/g32"));
  CHECK(p.current(1, 1).k == F("kivi8/g32"));
  CHECK(p.current(0, 0).k == F("kivi8/g32"));  // layer 0 not measured yet
  CHECK(p.snapshot() == std::vector<uint8_t>{2, 2, 0, 2});
  CHECK(p.choose({0, 1, 0, role::v, 0}) == F("kivi2/g32"));
  CHECK_THAT(p.ingest({0, 1, 4096, {0.1, 0.1, 0.1}}).message(),
             Catch::Contains("has 3 values, needs 6 (2 units x 3 tiers)"));
}

TEST_CASE("echokv: V tier formats, freeze, snapshot and restore", "[echokv]") {
  auto o = every_step(1, 0.0);
  o.v_tiers = {F("kivi4/g32"), F("kivi4/g32"), F("kivi8/g32")};
  echokv_policy p(o);
  REQUIRE(p.bind(shape2).ok());
  CHECK(p.current(0, 0) == format_pair{F("kivi8/g32"), F("kivi8/g32")});
  feed(p, 4096, {0.001, 0, 0});
  CHECK(p.current(0, 0) == format_pair{F("kivi2/g32"), F("kivi4/g32")});
  CHECK(p.tier_bits(0) == Approx((3.0 + 5.0) / 2));  // kivi2/g32 K 3 bits, kivi4/g32 V 5 bits
  CHECK(p.average_bits() == Approx(4.0));

  const auto snap = p.snapshot();
  p.freeze();
  const auto before = p.counters();
  feed(p, 4097, {1, 1, 0});  // would promote both layers
  CHECK(p.snapshot() == snap);
  CHECK(p.counters().canary_evaluations == before.canary_evaluations);
  p.unfreeze();
  feed(p, 4098, {1, 1, 0});
  CHECK(p.snapshot() == std::vector<uint8_t>{2, 2});
  REQUIRE(p.restore(snap).ok());
  CHECK(p.snapshot() == snap);
  CHECK(p.current(1, 1) == format_pair{F("kivi2/g32"), F("kivi4/g32")});
  const std::vector<uint8_t> too_long = {0, 0, 0}, bad_tier = {0, 3};
  CHECK_THAT(p.restore(too_long).message(), Catch::Contains("restore of 3 tiers, the policy has 2 units"));
  CHECK_THAT(p.restore(bad_tier).message(), Catch::Contains("unit 1 has tier 3"));
  CHECK(p.snapshot() == snap);  // a failed restore changes nothing
}

TEST_CASE("echokv majority vote over snapshots; ties go to the higher tier", "[echokv]") {
  const std::vector<std::vector<uint8_t>> s = {{0, 1, 2, 0}, {0, 2, 2, 2}, {1, 1, 0, 1}};
  CHECK(echokv_policy::majority_vote(s).value_or_throw() == std::vector<uint8_t>{0, 1, 2, 2});
  const std::vector<std::vector<uint8_t>> tie = {{0, 2}, {2, 0}};
  CHECK(echokv_policy::majority_vote(tie).value_or_throw() == std::vector<uint8_t>{2, 2});
  const std::vector<std::vector<uint8_t>> one = {{1, 0, 2}};
  CHECK(echokv_policy::majority_vote(one).value_or_throw() == one[0]);
  CHECK_THAT(echokv_policy::majority_vote({}).error().message(), Catch::Contains("no snapshots"));
  const std::vector<std::vector<uint8_t>> ragged = {{0, 1}, {0}};
  CHECK_THAT(echokv_policy::majority_vote(ragged).error().message(), Catch::Contains("snapshot 1 has 1 units"));
}

TEST_CASE("echokv canary RNG: deterministic per seed, rate as asked, same for all layers", "[echokv]") {
  echokv_options o;  // rate 1/64
  o.seed = 7;
  echokv_policy a(o), b(o);
  o.seed = 8;
  echokv_policy c(o);
  int fired = 0, differ = 0;
  const int N = 64000;
  for (int64_t L = 1; L <= N; ++L) {
    const bool x = a.is_canary(3, L);
    CHECK(x == b.is_canary(3, L));
    fired += x;
    differ += x != c.is_canary(3, L);
  }
  CAPTURE(fired, differ);
  CHECK(fired > 1000 - 5 * 31);  // binomial(64000, 1/64): mean 1000, sd 31
  CHECK(fired < 1000 + 5 * 31);
  CHECK(differ > 1500);  // two independent seeds agree on few firings
  echokv_options all = o;
  all.rate = 1.0;
  echokv_policy d(all);
  for (int64_t L = 1; L < 100; ++L) CHECK(d.is_canary(1, L));
}

TEST_CASE("echokv history records the tier vector per canary step; counters count", "[echokv]") {
  auto o = every_step(1, 0.0);
  o.alpha = 1.0;
  o.max_history = 2;
  echokv_policy p(o);
  REQUIRE(p.bind(shape2).ok());
  check(p.ingest({5, 0, 100, {0.001, 0.0, 0.0}}));
  check(p.ingest({5, 1, 100, {1.0, 1.0, 0.0}}));  // same step: same entry, updated
  REQUIRE(p.history().size() == 1);
  CHECK(p.history().back().tiers == std::vector<uint8_t>{0, 2});
  CHECK(p.history().back().context == 100);
  CHECK(p.history().back().tau == Approx(p.tau(100)));
  CHECK(p.history().back().average_bits == Approx((3.0 + 9.0) / 2));
  check(p.ingest({5, 0, 101, {1.0, 1.0, 0.0}}));
  check(p.ingest({5, 0, 102, {1.0, 0.0, 0.0}}));
  CHECK(p.history().size() == 2);  // capped; the oldest went
  CHECK(p.history().front().canary_step == 2);
  CHECK(p.history().back().canary_step == 3);
  CHECK(p.history().back().tiers == std::vector<uint8_t>{1, 2});
  CHECK(p.counters().canary_steps == 3);
  CHECK(p.counters().canary_evaluations == 4);
  CHECK(p.counters().promotions == 1);
  CHECK(p.counters().demotions == 2);
  CHECK_THAT(p.ingest({5, 2, 102, {0, 0, 0}}).message(), Catch::Contains("layer 2, the cache has 2"));
  CHECK_THAT(p.ingest({5, 1, 102, {0, NAN, 0}}).message(), Catch::Contains("value 1 is nan"));
}

TEST_CASE("echokv bind validates its options", "[echokv]") {
  const auto msg = [](echokv_options o, cache_shape s = shape2) {
    return echokv_policy(std::move(o)).bind(s).message();
  };
  echokv_options o;
  o.tiers = {F("kivi4/g32"), F("kivi2/g32")};
  CHECK_THAT(msg(o), Catch::Contains("tier 1 (kivi2/g32) does not store more K bytes than tier 0"));
  o = {};
  o.rate = 0;
  CHECK_THAT(msg(o), Catch::Contains("rate 0"));
  o = {};
  o.hysteresis_margin = 1.0;
  CHECK_THAT(msg(o), Catch::Contains("hysteresis_margin 1"));
  o = {};
  o.v_tiers = {F("kivi4/g32")};
  CHECK_THAT(msg(o), Catch::Contains("1 V tier formats for 3 tiers"));
  o = {};
  o.tiers = {F("kivi2/g128"), F("kivi8/g128")};
  CHECK_THAT(msg(o), Catch::Contains("tier 0 K"));  // 128-token groups do not fit 64-token pages
  o = {};
  o.initial_tier = 3;
  CHECK_THAT(msg(o), Catch::Contains("initial_tier 3"));
  echokv_policy ok;
  CHECK(ok.bind(shape2).ok());
  CHECK(ok.name() == "echokv(kivi2/g32|kivi4/g32|kivi8/g32,rate=0.015625,seed=0,per_layer,k=3,h=0.1)");
}

namespace {

// A ring [kv_heads][2][R][d] holding tokens [first, context) of K, slot = token % R.
struct window_builder {
  int H, R, d;
  std::vector<uint16_t> ring;
  window_builder(int h, int r, int dd) : H(h), R(r), d(dd), ring(size_t(h) * 2 * r * dd, 0) {}
  void set(int h, int64_t token, int c, float x) {
    ring[((size_t(h) * 2) * R + size_t(token % R)) * d + c] = float_to_half(x);
  }
};

}  // namespace

TEST_CASE("echokv measures KL with the real codecs: exact cases, GQA mapping, group alignment", "[echokv]") {
  const cache_shape s{1, 4, 2, 64, 64, 128, 32};
  auto o = every_step();
  o.granularity = echokv_granularity::per_head;
  echokv_policy p(o);
  REQUIRE(p.bind(s).ok());
  const int64_t context = 150, first = context - 128;  // ring holds [22, 150); whole groups [32, 128)
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> lvl(0, 3);
  window_builder w(2, 128, 64);
  for (int64_t t = first; t < context; ++t)
    for (int c = 0; c < 64; ++c) {
      // head 0: per 32-token group g (aligned to multiples of 32), values lo_g + s_g * {0..3} with
      // both ends present: exactly representable by kivi2 on aligned groups, not across them
      const int g = int(t / 32), i = int(t % 32);
      const float lo = -3.0f + 2.0f * g, sg = 0.25f * float(g + 1);
      const int q = i == 0 ? 0 : i == 1 ? 3 : lvl(rng);
      w.set(0, t, c, lo + sg * float(q));
      w.set(1, t, c, nd(rng) * (c == 5 ? 8.f : 1.f));  // head 1: gaussian with an outlier channel
    }
  std::vector<float> q(size_t(4) * 64);
  for (auto& x : q) x = nd(rng);
  const query_observation obs{0, 0, context, 1, q.data(), w.ring.data(), first};
  auto m = p.measure(obs).value_or_throw();
  REQUIRE(m.delta.size() == 6);
  CAPTURE(m.delta[0], m.delta[1], m.delta[2], m.delta[3], m.delta[4], m.delta[5]);
  // head 0 (read by query heads 0 and 1): 2 bits are exact on aligned groups
  CHECK(m.delta[0] < 1e-12);
  CHECK(m.delta[1] < 1e-4);  // 4-bit scales (range/15) are not fp16-exact: tiny but real
  // head 1 (query heads 2 and 3): gaussian keys, damage falls with bits
  CHECK(m.delta[3] > m.delta[4]);
  CHECK(m.delta[4] > m.delta[5]);
  CHECK(m.delta[5] > 0.0);
  CHECK(m.delta[3] > 1e-4);

  // GQA: kv head 1 is read by query heads 2 and 3 only; with those queries zero its softmax is
  // uniform whatever the keys, so its δ vanishes while head 0's does not change
  auto q0 = q;
  std::fill(q0.begin() + 2 * 64, q0.end(), 0.f);
  const query_observation obs0{0, 0, context, 1, q0.data(), w.ring.data(), first};
  auto m0 = p.measure(obs0).value_or_throw();
  for (int t = 0; t < 3; ++t) {
    CHECK(m0.delta[size_t(t)] == m.delta[size_t(t)]);
    CHECK(m0.delta[size_t(3 + t)] == 0.0);
  }

  // per-layer mode averages the two heads' query heads
  echokv_policy pl(every_step());
  REQUIRE(pl.bind(s).ok());
  auto ml = pl.measure(obs).value_or_throw();
  REQUIRE(ml.delta.size() == 3);
  for (int t = 0; t < 3; ++t) CHECK(ml.delta[size_t(t)] == Approx((m.delta[size_t(t)] + m.delta[size_t(3 + t)]) / 2));

  // a window too short for one whole group is skipped, not measured on a partial group
  const query_observation tiny{0, 0, 20, 1, q.data(), w.ring.data(), 0};
  CHECK(p.measure(tiny).error().code() == errc::not_found);
  const query_observation wrong{0, 0, 300, 1, q.data(), w.ring.data(), 0};
  CHECK_THAT(p.measure(wrong).error().message(), Catch::Contains("does not fit a ring of 128"));
}

TEST_CASE("echokv budget mode: the PID settles on a step of the target without oscillating", "[echokv]") {
  // Synthetic plant: 16 layers whose δ spreads over 4 nats, falling 16x per tier (KL ~ error^2).
  const int L = 16;
  const double spread = GENERATE(2.0, 4.0, 8.0);
  const auto [t0, t1] = GENERATE(table<double, double>({{6.0, 4.0}, {4.0, 6.5}, {8.0, 5.0}, {3.5, 7.0}}));
  CAPTURE(spread, t0, t1);
  echokv_options o;
  o.rate = 1.0;  // hysteresis k = 3, h = 0.1 and the default gains
  echokv_policy p(o);
  REQUIRE(p.bind({L, 8, 2, 64, 64, 128, 32}).ok());
  const auto step = [&](int64_t n) {
    for (int l = 0; l < L; ++l) {
      const double x = spread * (double(l) / (L - 1) - 0.5);
      // one canary step per sequence id at a fixed context, so tau(L) stays put
      check(p.ingest({n, l, 4096, {0.022 * std::exp(x) * 16.0, 0.022 * std::exp(x), 0.022 * std::exp(x) / 16.0}}));
    }
  };
  REQUIRE(p.set_target_bits(t0).ok());
  int64_t n = 0;
  for (; n < 60; ++n) step(n);
  const double quantum = 4.0 / L;  // the largest move of one unit: 5 -> 9 bits of one layer
  CHECK(std::abs(p.average_bits() - t0) <= quantum + 1e-9);
  REQUIRE(p.set_target_bits(t1).ok());
  const double dir = t1 > t0 ? 1.0 : -1.0;
  double overshoot = 0.0;
  int settled_at = -1;
  std::vector<double> tail;
  for (int i = 0; i < 80; ++i, ++n) {
    step(n);
    const double e = p.average_bits() - t1;
    overshoot = std::max(overshoot, dir * e);
    if (std::abs(e) > quantum + 1e-9)
      settled_at = -1;
    else if (settled_at < 0)
      settled_at = i;
    if (i >= 40) tail.push_back(p.average_bits());
  }
  CAPTURE(settled_at, overshoot, p.average_bits(), p.control().log_scale);
  CHECK(settled_at >= 0);
  CHECK(settled_at <= 15);                         // within 15 canary steps, to within one unit move
  CHECK(overshoot <= quantum + 1e-9);              // never past the target by more than one unit move
  for (double b : tail) CHECK(b == tail.front());  // settled: no limit cycle
  // turning budget mode off returns to the plain threshold
  p.clear_target();
  CHECK(p.tau(4096) == Approx(0.022));
  CHECK_THAT(p.set_target_bits(2.0).message(), Catch::Contains("outside [3.0000, 9.0000]"));
}

namespace {

std::vector<float> read_all(const KVCache& c, seq_id s, int layer, role r) {
  const auto& sh = c.config().shape;
  std::vector<float> out(size_t(c.length(s, layer)) * sh.kv_heads * sh.head_dim);
  check(c.read(s, layer, r, out));
  return out;
}

}  // namespace

TEST_CASE("echokv in a KVCache: tier changes never rewrite stored pages", "[echokv]") {
  // up: start at 2 bits and let a tiny tau promote; down: start at 8 bits and let a huge tau demote
  const bool up = GENERATE(true, false);
  CAPTURE(up);
  auto o = every_step(1, 0.0, up ? 0 : 2);
  o.tau0 = up ? 1e-12 : 1e6;
  auto pol = std::make_shared<echokv_policy>(o);
  cache_config cfg;
  cfg.shape = {2, 4, 2, 64, 64, 128, 32};
  cfg.budget_bytes = 16ull << 20;
  KVCache c = KVCache::create(cfg, pol).value_or_throw();
  const int H = 2, Hq = 4, d = 64;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 1.f);
  const auto randn = [&](size_t n) {
    std::vector<float> x(n);
    for (auto& v : x) v = nd(rng);
    return x;
  };
  check(c.create_sequence(1));
  // prefill 200 tokens while frozen: pages of tokens [0, 128) in the initial tier
  pol->freeze();
  for (int layer = 0; layer < 2; ++layer) {
    auto k = randn(200 * H * d), v = randn(200 * H * d);
    check(c.append(1, layer, {k.data(), dtype::f32, 200, H, d}, {v.data(), dtype::f32, 200, H, d}));
  }
  const format_id first_fmt = up ? F("kivi2/g32") : F("kivi8/g32");
  const format_id later_fmt = up ? F("kivi8/g32") : F("kivi2/g32");
  REQUIRE(c.stats().pages_by_format[first_fmt] == 2 * 2 * H * 2);  // 2 pages x 2 layers x heads x roles
  const auto k0 = read_all(c, 1, 0, role::k), v0 = read_all(c, 1, 1, role::v);
  pol->unfreeze();
  // decode 150 steps: every step is a canary on both layers
  std::vector<float> o_buf(size_t(Hq) * d);
  for (int step = 0; step < 150; ++step)
    for (int layer = 0; layer < 2; ++layer) {
      auto k = randn(H * d), v = randn(H * d), q = randn(Hq * d);
      check(c.append(1, layer, {k.data(), dtype::f32, 1, H, d}, {v.data(), dtype::f32, 1, H, d}));
      const attend_item it{1, 1};
      check(c.attend({&it, 1}, layer, {q.data(), dtype::f32, 1, Hq, d}, {o_buf.data(), dtype::f32, 1, Hq, d}));
    }
  CHECK(pol->counters().canary_steps == 150);
  CHECK(pol->counters().canary_evaluations == 300);
  CHECK(pol->counters().skipped == 0);
  CHECK((up ? pol->counters().promotions : pol->counters().demotions) == 2);
  CHECK(pol->current(0, 1).k == later_fmt);
  CHECK(c.stats().format_map[0].k == later_fmt);
  CHECK(pol->history().front().tiers == std::vector<uint8_t>(2, up ? 2 : 0));
  // the tier change took effect for new pages only: both formats are stored now ...
  const auto st = c.stats();
  CHECK(st.pages_by_format[first_fmt] == 2 * 2 * H * 2);
  CHECK(st.pages_by_format[later_fmt] > 0);
  // ... and the early tokens read back bit for bit as before
  const auto k1 = read_all(c, 1, 0, role::k), v1 = read_all(c, 1, 1, role::v);
  const size_t early = size_t(128) * H * d;
  REQUIRE(k1.size() > early);
  CHECK(std::equal(k0.begin(), k0.begin() + long(early), k1.begin()));
  CHECK(std::equal(v0.begin(), v0.begin() + long(early), v1.begin()));
}

TEST_CASE("echokv device canary: spec, due steps, counters as observe keeps them", "[echokv]") {
  auto o = every_step();
  o.granularity = echokv_granularity::per_head;
  echokv_policy p(o);
  CHECK(p.device_canary() == nullptr);  // not bound
  CHECK(!p.canary_due(0, 100));
  REQUIRE(p.bind(shape2).ok());
  const canary_spec* s = p.device_canary();
  REQUIRE(s != nullptr);
  CHECK(s->tiers == o.tiers);
  CHECK(s->align == 32);
  CHECK(s->per_head);
  CHECK(s->softmax_scale == Approx(1.0 / 8.0));
  CHECK(p.canary_due(0, 100));
  p.note_observation();
  p.note_skipped();
  CHECK(p.counters().observations == 1);
  CHECK(p.counters().skipped == 1);
  p.freeze();
  CHECK(!p.canary_due(0, 100));  // frozen: no canary, nothing counted
  p.note_observation();
  CHECK(p.counters().observations == 1);
  p.unfreeze();
  policy& base = p;  // the backend's view: ingest through the policy's canary protocol
  REQUIRE(base.canary() == &p);
  check(base.canary()->ingest({0, 1, 100, std::vector<double>(2 * 3, 0.0)}));
  CHECK(p.counters().canary_evaluations == 1);

  // the window cut: whole groups at multiples of align inside [window_first, context)
  const canary_keys k(32, 22, 150);
  CHECK(k.first == 32);
  CHECK(k.end == 128);
  CHECK(k.rows_seeing(1, 150) == 1);
  CHECK(k.rows_seeing(40, 40 + 32) == 40);
  CHECK(canary_keys(32, 0, 20).count() < 32);
  CHECK(canary_keys(32, 10, 70).rows_seeing(40, 70) == 38);  // keys [32, 64): rows 0, 1 end at 30, 31
}

TEST_CASE("echokv accessors outside their range give the documented value or a status, never throw", "[echokv]") {
  auto o = every_step(1, 0.0);
  o.v_tiers = {F("kivi4/g32"), F("kivi4/g32"), F("kivi8/g32")};
  echokv_policy p(o);
  // before bind: no units, no tier bits
  CHECK(p.tier(0) == -1);
  CHECK(std::isnan(p.ema(0, 0)));
  CHECK(std::isnan(p.tier_bits(0)));
  REQUIRE(p.bind(shape2).ok());
  REQUIRE(p.units() == 2);
  REQUIRE(p.tier_count() == 3);
  feed(p, 4096, {0.001, 0.001, 0.001});
  for (int bad : {-1, 2, 1 << 30}) {
    CAPTURE(bad);
    CHECK(p.tier(bad) == -1);
    CHECK(std::isnan(p.ema(bad, 0)));
  }
  for (int bad : {-1, 3, 1 << 30}) {
    CAPTURE(bad);
    CHECK(std::isnan(p.ema(0, bad)));
    CHECK(std::isnan(p.tier_bits(bad)));
    auto f = p.tier_formats(bad);
    REQUIRE_FALSE(f.ok());
    CHECK(f.error().code() == errc::invalid_argument);
    CHECK_THAT(f.error().message(), Catch::Contains("tier " + std::to_string(bad) + " outside [0, 3)"));
  }
  // ema(0, 3) must not read unit 1's first EMA: the row of (unit 0, tier 3) is not (unit 1, tier 0)
  CHECK_FALSE(std::isnan(p.ema(1, 0)));
  // valid indices are unchanged
  CHECK(p.tier(1) == 0);
  CHECK(p.ema(0, 0) == 0.001);
  CHECK(p.tier_formats(0).value() == format_pair{F("kivi2/g32"), F("kivi4/g32")});
  CHECK(p.tier_formats(2).value() == format_pair{F("kivi8/g32"), F("kivi8/g32")});
  CHECK(p.tier_bits(0) == Approx((3.0 + 5.0) / 2));
}
