// EchoKV's device canary against its host canary: the same steps into a CPU-backend cache and a
// CUDA-backend cache, each with its own echokv_policy; after `sync_policy` both policies hold the
// same counters, history and tiers, and EMAs of δ equal to a relative 1e-3 (the GPU sums the dot
// products in another order and in fused multiply-adds).
#include <kvq/cache/cache.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/echokv.hpp>

#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include "gpu_test.hpp"

#include <cmath>
#include <random>
#include <vector>

using namespace kvq;
using namespace kvq::gpu_test;

namespace {

struct twin {
  std::shared_ptr<echokv_policy> cpu_pol, gpu_pol;
  KVCache cpu, gpu;
};

twin make_twin(const echokv_options& o, int layers, int kv_heads, int d) {
  cache_config cfg;
  cfg.shape = {layers, 4 * kv_heads, kv_heads, d, 64, 128, 32};  // GQA 4
  cfg.budget_bytes = 256ull << 20;
  cfg.max_sequences = 8;
  cfg.max_tokens = 4096;
  auto a = std::make_shared<echokv_policy>(o);
  auto b = std::make_shared<echokv_policy>(o);
  auto c = KVCache::create(cfg, a).value_or_throw();
  cfg.where = backend::cuda;
  auto g = KVCache::create(cfg, b).value_or_throw();
  return {a, b, std::move(c), std::move(g)};
}

// One step of every sequence: append q_len tokens per layer, attend them, on both caches.
void step(twin& t, std::mt19937& rng, const std::vector<seq_id>& seqs, int q_len) {
  const cache_shape& sh = t.cpu.config().shape;
  const int H = sh.kv_heads, Hq = sh.q_heads, d = sh.head_dim;
  std::vector<attend_item> items;
  for (seq_id s : seqs) items.push_back({s, q_len});
  const int64_t rows = int64_t(seqs.size()) * q_len;
  for (int l = 0; l < sh.layers; ++l) {
    for (seq_id s : seqs) {
      const auto k = randn_h(rng, size_t(q_len) * H * d), v = randn_h(rng, k.size());
      check(t.cpu.append(s, l, {k.data(), dtype::f16, q_len, H, d}, {v.data(), dtype::f16, q_len, H, d}));
      dev_mem dk(k.size() * 2), dv(v.size() * 2);
      upload(dk, k);
      upload(dv, v);
      check(t.gpu.append(s, l, {dk.p, dtype::f16, q_len, H, d}, {dv.p, dtype::f16, q_len, H, d}));
      REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    }
    const auto q = randn_h(rng, size_t(rows) * Hq * d);
    std::vector<uint16_t> o(q.size());
    check(t.cpu.attend(items, l, {q.data(), dtype::f16, rows, Hq, d}, {o.data(), dtype::f16, rows, Hq, d}));
    dev_mem dq(q.size() * 2), dout(q.size() * 2);
    upload(dq, q);
    check(t.gpu.attend(items, l, {dq.p, dtype::f16, rows, Hq, d}, {dout.p, dtype::f16, rows, Hq, d}));
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);  // the buffers above die here
  }
}

void require_same_state(twin& t) {
  check(t.gpu.sync_policy());
  const echokv_policy &a = *t.cpu_pol, &b = *t.gpu_pol;
  const echokv_counters &ca = a.counters(), &cb = b.counters();
  CHECK(ca.observations == cb.observations);
  CHECK(ca.canary_steps == cb.canary_steps);
  CHECK(ca.canary_evaluations == cb.canary_evaluations);
  CHECK(ca.skipped == cb.skipped);
  CHECK(ca.promotions == cb.promotions);
  CHECK(ca.demotions == cb.demotions);
  REQUIRE(a.history().size() == b.history().size());
  for (size_t i = 0; i < a.history().size(); ++i) {
    CAPTURE(i);
    CHECK(a.history()[i].seq == b.history()[i].seq);
    CHECK(a.history()[i].context == b.history()[i].context);
    CHECK(a.history()[i].tiers == b.history()[i].tiers);
  }
  CHECK(a.snapshot() == b.snapshot());
  for (int u = 0; u < a.units(); ++u)
    for (int k = 0; k < a.tier_count(); ++k) {
      const double x = a.ema(u, k), y = b.ema(u, k);
      CAPTURE(u, k, x, y);
      if (std::isnan(x)) {
        CHECK(std::isnan(y));
      } else {
        CHECK(std::abs(x - y) <= 1e-3 * std::abs(x) + 1e-9);
      }
    }
}

}  // namespace

TEST_CASE("gpu canary: echokv's device canary measures what its host canary measures", "[canary]") {
  const auto gran = GENERATE(echokv_granularity::per_layer, echokv_granularity::per_head);
  const int d = GENERATE(64, 128, 256);
  const int q_len = GENERATE(1, 3);
  CAPTURE(int(gran), d, q_len);
  echokv_options o;
  o.rate = 1.0;
  o.granularity = gran;
  o.initial_tier = 1;
  twin t = make_twin(o, 2, 2, d);
  std::mt19937 rng(uint32_t(17 + d + q_len));
  // sequence 1 starts under one group (skipped canaries), sequence 2 ahead of it; both run past
  // the 128-token window so the ring wraps
  check(t.cpu.create_sequence(1));
  check(t.gpu.create_sequence(1));
  check(t.cpu.create_sequence(2));
  check(t.gpu.create_sequence(2));
  step(t, rng, {1}, q_len);
  step(t, rng, {2}, 40);
  REQUIRE(t.cpu_pol->counters().skipped > 0);
  const int steps = 170 / q_len;
  for (int i = 0; i < steps; ++i) {
    step(t, rng, {1, 2}, q_len);
    if (i % 2) check(t.gpu.flush_policy());  // an early launch changes when the canary runs, not what it measures
    if (i % 16 == 0) require_same_state(t);
  }
  require_same_state(t);
  CHECK(t.cpu_pol->counters().canary_evaluations > 100);
  CHECK(t.gpu_pol->counters().skipped == t.cpu_pol->counters().skipped);
}

TEST_CASE("gpu canary: rate 1/64 fires on the same steps on both backends", "[canary]") {
  echokv_options o;  // rate 1/64
  o.seed = 5;
  twin t = make_twin(o, 1, 2, 64);
  std::mt19937 rng(23);
  const std::vector<seq_id> seqs = {3, 4, 9, 12};
  for (seq_id s : seqs) {
    check(t.cpu.create_sequence(s));
    check(t.gpu.create_sequence(s));
  }
  step(t, rng, seqs, 64);
  for (int i = 0; i < 400; ++i) step(t, rng, seqs, 1);
  require_same_state(t);
  const auto& h = t.gpu_pol->history();
  CAPTURE(h.size());
  CHECK(h.size() > 5);  // 1600 sequence steps at 1/64: about 25 canaries
  for (const auto& e : h) CHECK(t.gpu_pol->is_canary(e.seq, e.context));
}

TEST_CASE("gpu canary: frozen policies launch nothing; host-only observers stay rejected", "[canary]") {
  echokv_options o;
  o.rate = 1.0;
  twin t = make_twin(o, 1, 2, 64);
  t.cpu_pol->freeze();
  t.gpu_pol->freeze();
  std::mt19937 rng(3);
  check(t.cpu.create_sequence(0));
  check(t.gpu.create_sequence(0));
  for (int i = 0; i < 3; ++i) step(t, rng, {0}, 40);
  require_same_state(t);
  CHECK(t.gpu_pol->counters().observations == 0);
  CHECK(t.gpu_pol->history().empty());

  struct host_observer final : policy {
    std::string name() const override { return "host_observer"; }
    status bind(const cache_shape&) override { return {}; }
    format_pair current(int, int) const override { return {format_id(0), format_id(0)}; }
    bool wants_queries() const override { return true; }
  };
  cache_config cfg;
  cfg.shape = {1, 8, 2, 64, 64, 128, 32};
  cfg.budget_bytes = 64ull << 20;
  cfg.where = backend::cuda;
  auto r = KVCache::create(cfg, std::make_shared<host_observer>());
  REQUIRE(!r.ok());
  CHECK(r.error().code() == errc::unsupported);
  CHECK_THAT(r.error().message(), Catch::Contains("no device canary"));
}
