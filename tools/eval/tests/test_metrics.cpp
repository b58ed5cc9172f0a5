// KL, top-1 agreement and perplexity on hand-made distributions.
#include <catch2/catch.hpp>
#include <cmath>
#include <eval/metrics.hpp>
#include <random>
#include <vector>

using namespace kvq::eval;

namespace {
std::vector<double> logsm(const std::vector<float>& logits) {
  std::vector<double> out(logits.size());
  log_softmax(logits, out);
  return out;
}
}  // namespace

TEST_CASE("log_softmax gives the normalized log-probabilities", "[metrics]") {
  // logits log(1), log(2), log(3): probabilities 1/6, 2/6, 3/6
  const auto lp = logsm({0.f, float(std::log(2.0)), float(std::log(3.0))});
  CHECK(std::exp(lp[0]) == Approx(1.0 / 6).epsilon(1e-6));
  CHECK(std::exp(lp[1]) == Approx(2.0 / 6).epsilon(1e-6));
  CHECK(std::exp(lp[2]) == Approx(3.0 / 6).epsilon(1e-6));
  // shift invariance and no overflow for large logits
  const auto big = logsm({1000.f, float(1000 + std::log(2.0)), float(1000 + std::log(3.0))});
  for (int i = 0; i < 3; ++i) CHECK(big[size_t(i)] == Approx(lp[size_t(i)]).margin(1e-4));
  // a single token has probability 1
  CHECK(logsm({-5.f})[0] == 0.0);
}

TEST_CASE("KL divergence matches closed forms", "[metrics]") {
  SECTION("two-point distributions") {
    const std::vector<double> p = {std::log(0.5), std::log(0.5)};
    const std::vector<double> q = {std::log(0.25), std::log(0.75)};
    const double expected = 0.5 * std::log(0.5 / 0.25) + 0.5 * std::log(0.5 / 0.75);
    CHECK(kl_divergence(p, q) == Approx(expected).epsilon(1e-12));
    // asymmetric: KL(q || p) differs
    const double reverse = 0.25 * std::log(0.25 / 0.5) + 0.75 * std::log(0.75 / 0.5);
    CHECK(kl_divergence(q, p) == Approx(reverse).epsilon(1e-12));
  }
  SECTION("identical distributions give exactly 0") {
    const auto lp = logsm({0.3f, -1.f, 2.f, 0.f});
    CHECK(kl_divergence(lp, lp) == 0.0);
  }
  SECTION("zero-probability reference tokens contribute nothing") {
    const double ninf = -INFINITY;
    const std::vector<double> p = {0.0, ninf};  // P = (1, 0)
    const std::vector<double> q = {std::log(0.5), std::log(0.5)};
    CHECK(kl_divergence(p, q) == Approx(std::log(2.0)).epsilon(1e-12));
  }
  SECTION("a large vocabulary: equals a long double reference") {
    const size_t n = 49152;
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.f, 3.f), small(0.f, 0.05f);
    std::vector<float> a(n), b(n);
    for (size_t i = 0; i < n; ++i) {
      a[i] = nd(rng);
      b[i] = a[i] + small(rng);
    }
    const auto la = logsm(a), lb = logsm(b);
    long double ref = 0;
    for (size_t i = 0; i < n; ++i) ref += std::exp((long double)la[i]) * ((long double)la[i] - (long double)lb[i]);
    INFO("seed 7, n " << n);
    CHECK(kl_divergence(la, lb) == Approx(double(ref)).epsilon(1e-9));
    CHECK(kl_divergence(la, lb) > 0);
  }
}

TEST_CASE("argmax takes the first maximum", "[metrics]") {
  CHECK(argmax(std::vector<double>{1, 3, 3, 2}) == 1);
  CHECK(argmax(std::vector<double>{}) == -1);
}

TEST_CASE("metric_accumulator: means, agreement, perplexity, quantiles, buckets", "[metrics]") {
  metric_accumulator m;
  CHECK(m.top1_agreement() == 1.0);
  CHECK(m.mean_kl() == 0.0);
  // uniform over 4 tokens: NLL ln 4 everywhere -> perplexity 4
  const double nll = std::log(4.0);
  m.add(0.1, true, nll);
  m.add(0.3, false, nll);
  m.add(0.2, true, nll);
  m.add(0.0, true, nll);
  CHECK(m.positions() == 4);
  CHECK(m.mean_kl() == Approx(0.15));
  CHECK(m.max_kl() == 0.3);
  CHECK(m.top1_agreement() == 0.75);
  CHECK(m.perplexity() == Approx(4.0));
  CHECK(m.kl_quantile(0.5) == 0.1);  // nearest rank: sorted 0, .1, .2, .3 -> 2nd
  CHECK(m.kl_quantile(1.0) == 0.3);
  CHECK(m.kl_quantile(0.0) == 0.0);
  const auto b = m.kl_by_bucket(3);
  REQUIRE(b.size() == 2);
  CHECK(b[0] == Approx(0.2));
  CHECK(b[1] == 0.0);
  // perplexity of a sequence of probabilities 1/2, 1/8: exp((ln2 + ln8)/2) = 4
  metric_accumulator p;
  p.add(0, true, std::log(2.0));
  p.add(0, true, std::log(8.0));
  CHECK(p.perplexity() == Approx(4.0));
}

TEST_CASE("position_bucket_edges: 0, 512, then doubling to cover the run", "[metrics]") {
  CHECK(position_bucket_edges(1) == std::vector<int64_t>{0, 512});
  CHECK(position_bucket_edges(512) == std::vector<int64_t>{0, 512});
  CHECK(position_bucket_edges(513) == std::vector<int64_t>{0, 512, 1024});
  CHECK(position_bucket_edges(8448) == std::vector<int64_t>{0, 512, 1024, 2048, 4096, 8192, 16384});
}

TEST_CASE("metric_accumulator::by_position: means over ranges of absolute positions", "[metrics]") {
  // positions 500..1099 (first 500): KL = position / 1000, agreement off at even positions of
  // [1024, 1100), NLL ln 2 below 512 and ln 8 above
  metric_accumulator m;
  const int64_t first = 500, n = 600;
  for (int64_t p = first; p < first + n; ++p)
    m.add(double(p) / 1000, !(p >= 1024 && p % 2 == 0), p < 512 ? std::log(2.0) : std::log(8.0));
  const auto edges = position_bucket_edges(first + n);
  REQUIRE(edges == std::vector<int64_t>{0, 512, 1024, 2048});
  const auto b = m.by_position(first, edges);
  REQUIRE(b.size() == 3);  // [0, 512) holds 500..511 only
  CHECK(b[0].first == 0);
  CHECK(b[0].end == 512);
  CHECK(b[0].positions == 12);
  CHECK(b[0].mean_kl == Approx((500 + 511) / 2.0 / 1000));
  CHECK(b[0].perplexity() == Approx(2.0));
  CHECK(b[0].top1_agreement == 1.0);
  CHECK(b[1].positions == 512);
  CHECK(b[1].mean_kl == Approx((512 + 1023) / 2.0 / 1000));
  CHECK(b[1].perplexity() == Approx(8.0));
  CHECK(b[2].first == 1024);
  CHECK(b[2].end == 2048);
  CHECK(b[2].positions == 76);  // 1024..1099
  CHECK(b[2].top1_agreement == Approx(0.5));
  int64_t total = 0;
  for (const auto& x : b) total += x.positions;
  CHECK(total == n);
  // a range no position falls in is left out; no edges, no buckets
  const std::vector<int64_t> far = {0, 100, 4096};
  const auto f = m.by_position(first, far);
  REQUIRE(f.size() == 1);
  CHECK(f[0].positions == n);
  CHECK(m.by_position(first, std::vector<int64_t>{}).empty());
}
