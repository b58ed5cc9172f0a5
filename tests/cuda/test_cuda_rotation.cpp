// Rotated heads on the GPU against the CPU backend (docs/architecture.md, "Rotation"): the append
// kernels rotate K/V bit for bit as the CPU does (every format, single and batched appends, a
// layer with some heads rotated), decode and extend attention with the query rotation and the
// merge's inverse within the NMSE bound of the unrotated tests, an FP16 rotated cache against the
// unrotated one to fp16 rounding, and EchoKV's device canary in the rotated space.
#include <kvq/cache/cache.hpp>
#include <kvq/cuda/read_plan.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/echokv.hpp>
#include <kvq/policy/static_policy.hpp>

#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include "gpu_test.hpp"

#include <cmath>
#include <random>
#include <vector>

using namespace kvq;
using namespace kvq::gpu_test;

namespace {

constexpr double nmse_bound = 2e-5;  // as tests/cuda/test_cuda_cache.cpp: fp16 MMA operands
constexpr int L = 2, H = 2, Hq = 8;

// Layer 0: both kv heads rotated; layer 1: head 0 only (a layer mixing rotated and plain heads).
cache_config config(int d, bool rotated) {
  cache_config cfg;
  cfg.shape = {L, Hq, H, d, 64, 128, 32};
  cfg.budget_bytes = 256ull << 20;
  cfg.max_sequences = 8;
  cfg.max_tokens = 1 << 14;
  if (rotated) cfg.rotation = {{1, 1, 1, 0}, 4321};
  return cfg;
}

struct twin {
  KVCache cpu, gpu;
};

twin make_twin(std::shared_ptr<policy> pc, std::shared_ptr<policy> pg, int d, bool rotated = true) {
  cache_config cfg = config(d, rotated);
  auto c = KVCache::create(cfg, std::move(pc)).value_or_throw();
  cfg.where = backend::cuda;
  return {std::move(c), KVCache::create(cfg, std::move(pg)).value_or_throw()};
}

twin make_static(const std::string& spec, int d, bool rotated = true) {
  auto pol = std::make_shared<static_policy>(parse_format_pair(spec).value_or_throw());
  return make_twin(pol, pol, d, rotated);
}

void append_both(twin& t, const std::vector<append_item>& items, int layer, const std::vector<uint16_t>& k,
                 const std::vector<uint16_t>& v, int64_t rows, int d) {
  check(t.cpu.append_batch(items, layer, {k.data(), dtype::f16, rows, H, d}, {v.data(), dtype::f16, rows, H, d}));
  dev_mem dk(k.size() * 2), dv(v.size() * 2);
  upload(dk, k);
  upload(dv, v);
  check(t.gpu.append_batch(items, layer, {dk.p, dtype::f16, rows, H, d}, {dv.p, dtype::f16, rows, H, d}));
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
}

// One attention batch on both backends (f16 queries, f32 outputs): GPU output and CPU output.
std::pair<std::vector<float>, std::vector<float>> attend_both(twin& t, const std::vector<attend_item>& items, int layer,
                                                              std::mt19937& rng) {
  const int d = t.cpu.config().shape.head_dim;
  int total = 0;
  for (auto& it : items) total += it.q_len;
  const auto qh = randn_h(rng, size_t(total) * Hq * d);
  std::vector<float> qf(qh.size()), oc(qh.size()), og(qh.size(), std::nanf(""));
  for (size_t i = 0; i < qh.size(); ++i) qf[i] = half_to_float(qh[i]);
  check(t.cpu.attend(items, layer, {qf.data(), dtype::f32, total, Hq, d}, {oc.data(), dtype::f32, total, Hq, d}));
  dev_mem dq(qh.size() * 2), dout(og.size() * 4);
  upload(dq, qh);
  upload(dout, og);  // poisoned: every element must be written
  check(t.gpu.attend(items, layer, {dq.p, dtype::f16, total, Hq, d}, {dout.p, dtype::f32, total, Hq, d}));
  REQUIRE(cudaMemcpy(og.data(), dout.p, og.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  return {og, oc};
}

}  // namespace

TEST_CASE("gpu rotation: rotated appends store what the CPU stores, every format", "[gpu][rotation]") {
  const int fi = GENERATE(range(0, int(format_count)));
  const int d = GENERATE(64, 128, 256);
  const std::string spec = format_name(format_id(fi));
  if (!check_shape(format_id(fi), role::k, 64, d).ok() || !check_shape(format_id(fi), role::v, 64, d).ok()) return;
  if (!cuda::kernels_read(format_id(fi))) return;  // refused before anything is stored (test_cuda_cache.cpp)
  CAPTURE(spec, d);
  twin t = make_static(spec, d);
  std::mt19937 rng(uint32_t(fi * 7 + d));
  for (seq_id s : {1, 2}) {
    check(t.cpu.create_sequence(s));
    check(t.gpu.create_sequence(s));
  }
  for (int layer = 0; layer < L; ++layer)
    for (int64_t len : {1, 95, 64, 3, 300}) {  // page edges, a long append, then a batch of both sequences
      auto k = randn_h(rng, size_t(len) * H * d), v = randn_h(rng, size_t(len) * H * d);
      append_both(t, {{1, len}}, layer, k, v, len, d);
      auto k2 = randn_h(rng, size_t(len + 2) * H * d), v2 = randn_h(rng, k2.size());
      append_both(t, {{1, 2}, {2, len}}, layer, k2, v2, len + 2, d);
    }
  for (int layer = 0; layer < L; ++layer)
    for (seq_id s : {1, 2}) require_same_store(t.cpu, t.gpu, s, layer);
}

TEST_CASE("gpu rotation: decode and extend attention of rotated heads match the CPU", "[gpu][rotation]") {
  const std::string spec = GENERATE("fp16", "fp8", "int8", "sym4/g32", "kivi8/g32", "kivi4/g32", "kivi2/g32",
                                    "ra4/g32", "k=kivi4/g32,v=kivi2/g32", "sym3/g32", "kivi3/g32", "cb4", "cb3/g32",
                                    "cb2/g32", "nvfp4", "k=kivi4/g32,v=cb2", "k=cb4,v=fp16");
  const int d = GENERATE(64, 128, 256);
  const int q_len = GENERATE(1, 2, 3, 16);  // GQA 4: 1 and 2 decode kernels, 3 and 16 the tile kernel (> 8 rows)
  CAPTURE(spec, d, q_len);
  twin t = make_static(spec, d);
  std::mt19937 rng(uint32_t(spec.size() * 31 + d + q_len));
  std::vector<attend_item> items;
  const std::vector<int64_t> lens = {q_len + 1, 127, 200, 700};
  for (size_t i = 0; i < lens.size(); ++i) {
    check(t.cpu.create_sequence(seq_id(i)));
    check(t.gpu.create_sequence(seq_id(i)));
    for (int layer = 0; layer < L; ++layer) {
      auto k = randn_h(rng, size_t(lens[i]) * H * d), v = randn_h(rng, k.size());
      append_both(t, {{seq_id(i), lens[i]}}, layer, k, v, lens[i], d);
    }
    items.push_back({seq_id(i), q_len});
  }
  for (int layer = 0; layer < L; ++layer) {
    CAPTURE(layer);
    const auto [g, c] = attend_both(t, items, layer, rng);
    REQUIRE(nmse(g, c) < nmse_bound);
  }
}

TEST_CASE("gpu rotation: an FP16 rotated cache matches the unrotated one to fp16 rounding", "[gpu][rotation]") {
  const int d = GENERATE(64, 128, 256);
  CAPTURE(d);
  auto pol = std::make_shared<static_policy>();
  twin rot = make_twin(pol, pol, d, true), plain = make_twin(pol, pol, d, false);
  std::mt19937 rng{uint32_t(d)};
  const int64_t n = 333;
  const auto k = randn_h(rng, size_t(n) * H * d), v = randn_h(rng, k.size());
  for (twin* t : {&rot, &plain}) {
    check(t->cpu.create_sequence(5));
    check(t->gpu.create_sequence(5));
    append_both(*t, {{5, n}}, 0, k, v, n, d);
  }
  const std::vector<attend_item> items = {{5, 1}};
  std::mt19937 r1(9), r2(9);  // the same queries for both
  const auto [gr, cr] = attend_both(rot, items, 0, r1);
  const auto [gp, cp] = attend_both(plain, items, 0, r2);
  REQUIRE(nmse(gr, gp) < nmse_bound);
  REQUIRE(nmse(cr, cp) < 1e-6);
}

TEST_CASE("gpu rotation: EchoKV's device canary measures what its host canary measures on rotated heads",
          "[gpu][rotation][canary]") {
  const int d = GENERATE(64, 128, 256);
  CAPTURE(d);
  echokv_options o;
  o.rate = 1.0;
  o.granularity = echokv_granularity::per_head;
  o.tiers = {parse_format("sym4/g32").value_or_throw(), parse_format("kivi8/g32").value_or_throw()};
  auto pc = std::make_shared<echokv_policy>(o), pg = std::make_shared<echokv_policy>(o);
  twin t = make_twin(pc, pg, d);
  std::mt19937 rng{uint32_t(d + 1)};
  check(t.cpu.create_sequence(1));
  check(t.gpu.create_sequence(1));
  // steps of 1 query (decode kernels: the merge rotates the staged rows) and of 3 (the tile
  // kernel: the rows come rotated from the workspace)
  for (int64_t len : {100, 1, 3, 1}) {
    for (int layer = 0; layer < L; ++layer) {
      auto k = randn_h(rng, size_t(len) * H * d), v = randn_h(rng, k.size());
      append_both(t, {{1, len}}, layer, k, v, len, d);
      (void)attend_both(t, {{1, int(std::min<int64_t>(len, 3))}}, layer, rng);
    }
  }
  check(t.gpu.sync_policy());
  REQUIRE(pc->counters().canary_evaluations == pg->counters().canary_evaluations);
  REQUIRE(pc->counters().canary_evaluations > 0);
  for (int u = 0; u < pc->units(); ++u)
    for (int k = 0; k < pc->tier_count(); ++k) {
      const double x = pc->ema(u, k), y = pg->ema(u, k);
      CAPTURE(u, k, x, y);
      REQUIRE(std::abs(x - y) <= 1e-3 * std::abs(x) + 1e-9);
    }
}
