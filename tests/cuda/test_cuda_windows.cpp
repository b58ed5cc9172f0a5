// Windows that grow in lanes of shared ring blocks, on the GPU: sequences created together
// interleave their rings in one block, grow in place or move (a 2D device copy of their rings),
// and every sequence reads bit for bit what the CPU backend reads after the same calls, with the
// attention within the NMSE bound; the memory outside the budget is what `KVCache::overhead`
// announced.
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <kvq/cache/cache.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/static_policy.hpp>
#include <random>
#include <string>
#include <vector>

#include "cache_reads.hpp"
#include "gpu_test.hpp"

using namespace kvq;
using namespace kvq::gpu_test;
using kvq::test::read_all;

namespace {

// P = 64, R = 256 (4 lanes per ring block), r = 32.
constexpr int layers = 2, hq = 8, kvh = 2, d = 128;
constexpr double nmse_bound = 2e-5;  // GPU attention against the CPU reference (test_cuda_cache.cpp)

cache_config config(backend where) {
  cache_config cfg;
  cfg.shape = {layers, hq, kvh, d, 64, 256, 32};
  cfg.budget_bytes = 64ull << 20;
  cfg.max_sequences = 16;
  cfg.max_tokens = 2048;
  cfg.where = where;
  return cfg;
}

// The same random fp16 tokens appended to every layer of `s` on both caches.
void append_both(KVCache& cpu, KVCache& gpu, seq_id s, int64_t n, std::mt19937& rng) {
  for (int l = 0; l < layers; ++l) {
    const auto k = randn_h(rng, size_t(n) * kvh * d), v = randn_h(rng, size_t(n) * kvh * d);
    append_same(cpu, gpu, s, l, k, v, n);
  }
}

// One decode-style batch (q_len 1 each) over every layer on both backends; the largest NMSE.
double attend_both(KVCache& cpu, KVCache& gpu, const std::vector<attend_item>& items, std::mt19937& rng) {
  const int total = int(items.size());
  double worst = 0;
  for (int l = 0; l < layers; ++l) {
    const auto qh = randn_h(rng, size_t(total) * hq * d);
    std::vector<float> qf(qh.size()), oc(qh.size()), og(qh.size());
    for (size_t i = 0; i < qh.size(); ++i) qf[i] = half_to_float(qh[i]);
    check(cpu.attend(items, l, {qf.data(), dtype::f32, total, hq, d}, {oc.data(), dtype::f32, total, hq, d}));
    dev_mem dq(qh.size() * 2), dout(og.size() * 4);
    upload(dq, qh);
    check(gpu.attend(items, l, {dq.p, dtype::f16, total, hq, d}, {dout.p, dtype::f32, total, hq, d}));
    REQUIRE(cudaMemcpy(og.data(), dout.p, og.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
    worst = std::max(worst, nmse(og, oc));
  }
  return worst;
}

}  // namespace

TEST_CASE("gpu: interleaved windows grow and move as on the CPU", "[gpu][windows]") {
  const std::string spec = GENERATE("kivi4/g32", "k=kivi4/g32,v=kivi2/g32", "fp16");
  CAPTURE(spec);
  std::mt19937 rng(21);
  auto pol = std::make_shared<static_policy>(static_policy::parse(spec).value_or_throw());
  KVCache cpu = KVCache::create(config(backend::cpu), pol).value_or_throw();
  KVCache gpu = KVCache::create(config(backend::cuda), pol).value_or_throw();
  constexpr int seqs = 6;
  std::vector<attend_item> items;
  for (seq_id s = 0; s < seqs; ++s) {
    for (KVCache* c : {&cpu, &gpu}) check(c->create_sequence(s));
    items.push_back({s, 1});
  }
  // Round-robin growth: lanes fill, sequences extend in place where the next lane is free and
  // move otherwise; one sequence jumps to the whole window at once.
  const int64_t chunks[] = {3, 61, 1, 70, 129, 5};
  for (int round = 0; round < 4; ++round)
    for (seq_id s = 0; s < seqs; ++s) {
      append_both(cpu, gpu, s, chunks[(s + round) % 6], rng);
      CAPTURE(round, s);
      REQUIRE(gpu.stats().window_bytes == cpu.stats().window_bytes);
    }
  for (seq_id s = 0; s < seqs; ++s) REQUIRE(read_all(gpu, s) == read_all(cpu, s));
  REQUIRE(attend_both(cpu, gpu, items, rng) < nmse_bound);
  // A fork takes its source's lanes and copies its rings on the device.
  for (KVCache* c : {&cpu, &gpu}) check(c->fork(2, 9));
  append_both(cpu, gpu, 9, 40, rng);
  REQUIRE(read_all(gpu, 9) == read_all(cpu, 9));
  REQUIRE(read_all(gpu, 2) == read_all(cpu, 2));
  REQUIRE(attend_both(cpu, gpu, {{9, 1}, {2, 1}}, rng) < nmse_bound);
}

TEST_CASE("gpu: the memory outside the budget is what overhead(cfg) announced", "[gpu][windows][stats]") {
  const cache_config cfg = config(backend::cuda);
  const cache_overhead before = KVCache::overhead(cfg).value_or_throw();
  CHECK(before.device_tables == uint64_t(cfg.max_sequences) * layers * (2048 / 64) * (4 + kvh * 2) +  // page tables
                                     uint64_t(layers) * kvh * 2 * 12 * 16 * sizeof(float) +  // codebook levels
                                     uint64_t(cfg.max_sequences) * (1 + layers * 12) + 24);  // value-check guard
  KVCache gpu = KVCache::create(cfg, std::make_shared<static_policy>()).value_or_throw();
  CHECK(gpu.stats().overhead.device_tables == before.device_tables);
  std::mt19937 rng(22);
  KVCache cpu = KVCache::create(config(backend::cpu), std::make_shared<static_policy>()).value_or_throw();
  for (KVCache* c : {&cpu, &gpu}) check(c->create_sequence(1));
  append_both(cpu, gpu, 1, 300, rng);
  (void)attend_both(cpu, gpu, {{1, 1}}, rng);
  const cache_overhead now = gpu.stats().overhead;
  CHECK(now.device_tables == before.device_tables);
  CHECK(now.device_workspace > 0);  // the attention's split partials
  CHECK(cpu.stats().overhead.device_bytes() == 0);
}
