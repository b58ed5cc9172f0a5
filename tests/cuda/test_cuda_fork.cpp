// Fork and truncate through the CUDA backend against the CPU backend fed the same calls: what
// every sequence reads equal bit for bit (shared pages through the copied page-table rows, the
// copied ring, restored ring rows), statistics equal, attention within the NMSE bound, and a
// forked source that never changes.
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <kvq/cache/cache.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/static_policy.hpp>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gpu_test.hpp"

using namespace kvq;
using namespace kvq::gpu_test;

namespace {

// P = 64, R = 128, r = 32: a page is encoded once 96 tokens are unencoded.
constexpr int layers = 2, hq = 8, kvh = 2, d = 64;
constexpr double nmse_bound = 2e-5;  // GPU attention against the CPU reference (test_cuda_cache.cpp)

struct caches {
  KVCache cpu, gpu;
};

caches make(const std::string& spec) {
  cache_config cfg;
  cfg.shape = {layers, hq, kvh, d, 64, 128, 32};
  cfg.budget_bytes = 64ull << 20;
  cfg.max_sequences = 8;
  cfg.max_tokens = 4096;
  auto pol = std::make_shared<static_policy>(static_policy::parse(spec).value_or_throw());
  auto c = KVCache::create(cfg, pol).value_or_throw();
  cfg.where = backend::cuda;
  return {std::move(c), KVCache::create(cfg, pol).value_or_throw()};
}

// The same `n` random fp16 tokens appended to every layer of `seq` on both caches.
void append_both(caches& c, seq_id seq, int64_t n, std::mt19937& rng) {
  for (int l = 0; l < layers; ++l) {
    const auto k = randn_h(rng, size_t(n) * kvh * d), v = randn_h(rng, size_t(n) * kvh * d);
    check(c.cpu.append(seq, l, {k.data(), dtype::f16, n, kvh, d}, {v.data(), dtype::f16, n, kvh, d}));
    dev_mem dk(k.size() * 2), dv(v.size() * 2);
    upload(dk, k);
    upload(dv, v);
    check(c.gpu.append(seq, l, {dk.p, dtype::f16, n, kvh, d}, {dv.p, dtype::f16, n, kvh, d}));
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  }
}

// What every layer and role of `seq` reads on one cache.
std::vector<float> read_all(const KVCache& c, seq_id seq) {
  std::vector<float> out;
  for (int l = 0; l < layers; ++l)
    for (role r : {role::k, role::v}) {
      std::vector<float> x(size_t(c.length(seq, l)) * kvh * d);
      check(c.read(seq, l, r, x));
      out.insert(out.end(), x.begin(), x.end());
    }
  return out;
}

auto summary(const cache_stats& s) {
  return std::make_tuple(s.used_bytes, s.free_bytes, s.page_bytes, s.pages, s.shared_pages, s.shared_saved_bytes,
                         s.sequences, s.tokens);
}

// Both backends hold the same bytes for `seq` and the same statistics.
void require_same(caches& c, seq_id seq) {
  const std::vector<float> a = read_all(c.cpu, seq), b = read_all(c.gpu, seq);
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) {
      CAPTURE(seq, i, a[i], b[i]);
      REQUIRE(a[i] == b[i]);
    }
  REQUIRE(summary(c.cpu.stats()) == summary(c.gpu.stats()));
}

// One attention batch of every layer on both backends; the largest NMSE of GPU against CPU.
double attend_both(caches& c, const std::vector<attend_item>& items, std::mt19937& rng) {
  int total = 0;
  for (const auto& it : items) total += it.q_len;
  double worst = 0;
  for (int l = 0; l < layers; ++l) {
    const auto qh = randn_h(rng, size_t(total) * hq * d);
    std::vector<float> qf(qh.size()), oc(qh.size()), og(qh.size(), std::nanf(""));
    for (size_t i = 0; i < qh.size(); ++i) qf[i] = half_to_float(qh[i]);
    check(c.cpu.attend(items, l, {qf.data(), dtype::f32, total, hq, d}, {oc.data(), dtype::f32, total, hq, d}));
    dev_mem dq(qh.size() * 2), dout(og.size() * 4);
    upload(dq, qh);
    upload(dout, og);  // poisoned: every element must be written
    check(c.gpu.attend(items, l, {dq.p, dtype::f16, total, hq, d}, {dout.p, dtype::f32, total, hq, d}));
    REQUIRE(cudaMemcpy(og.data(), dout.p, og.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
    worst = std::max(worst, nmse(og, oc));
  }
  return worst;
}

}  // namespace

TEST_CASE("gpu: forked sequences read shared pages and their own rings as the CPU does", "[gpu][fork]") {
  const std::string spec = GENERATE("fp16", "int8", "kivi4/g32", "kivi2/g32", "k=kivi4/g32,v=kivi2/g32");
  const int64_t prefix = GENERATE(1, 95, 96, 97, 200, 300);
  const bool src_first = GENERATE(true, false);
  CAPTURE(spec, prefix, src_first);
  std::mt19937 rng(uint32_t(prefix * 3 + src_first));
  caches c = make(spec);
  for (KVCache* k : {&c.cpu, &c.gpu}) check(k->create_sequence(1));
  append_both(c, 1, prefix, rng);
  for (KVCache* k : {&c.cpu, &c.gpu}) check(k->fork(1, 2));
  require_same(c, 2);
  // The fork attends through its copied page-table rows before anything diverges.
  REQUIRE(attend_both(c, {{1, 1}, {2, 1}}, rng) < nmse_bound);
  append_both(c, 1, 70, rng);
  append_both(c, 2, 131, rng);
  require_same(c, 1);
  require_same(c, 2);
  REQUIRE(attend_both(c, {{2, 5}, {1, 1}}, rng) < nmse_bound);
  const std::vector<float> kept = read_all(c.gpu, src_first ? 2 : 1);
  for (KVCache* k : {&c.cpu, &c.gpu}) check(k->release_sequence(src_first ? 1 : 2));
  REQUIRE(read_all(c.gpu, src_first ? 2 : 1) == kept);
  require_same(c, src_first ? 2 : 1);
  REQUIRE(c.gpu.stats().shared_pages == 0);
}

TEST_CASE("gpu: truncate leaves what the CPU leaves, each cut", "[gpu][truncate]") {
  // n = 300 holds pages [0, 256) and ring tokens [172, 300): a cut at 250 puts page 3 back into
  // the ring (exact), 200 and 195 keep page 2 (its first tokens left the ring), 180 and 170 cut
  // inside page 2 (tokens 128..171 come back decoded), 0 keeps nothing.
  const std::string spec = GENERATE("int8", "kivi4/g32", "kivi2/g32");
  const int64_t keep = GENERATE(300, 250, 200, 195, 180, 170, 0);
  CAPTURE(spec, keep);
  std::mt19937 rng(uint32_t(keep + 17));
  caches c = make(spec);
  for (KVCache* k : {&c.cpu, &c.gpu}) {
    check(k->create_sequence(1));
    check(k->create_sequence(3));
  }
  append_both(c, 1, 300, rng);
  append_both(c, 3, 40, rng);
  for (KVCache* k : {&c.cpu, &c.gpu}) check(k->fork(1, 2));
  const std::vector<float> src = read_all(c.gpu, 1);
  for (KVCache* k : {&c.cpu, &c.gpu}) check(k->truncate(2, keep));
  require_same(c, 2);
  REQUIRE(read_all(c.gpu, 1) == src);  // the other sharer never changes
  append_both(c, 2, 150, rng);
  require_same(c, 2);
  REQUIRE(read_all(c.gpu, 1) == src);
  // One batch over the truncated fork, its source and an unrelated sequence.
  REQUIRE(attend_both(c, {{2, 4}, {1, 1}, {3, 2}}, rng) < nmse_bound);
}

TEST_CASE("gpu: a fork or truncate that cannot be done changes nothing", "[gpu][fork][errors]") {
  std::mt19937 rng(5);
  caches c = make("kivi4/g32");
  for (KVCache* k : {&c.cpu, &c.gpu}) check(k->create_sequence(1));
  append_both(c, 1, 150, rng);
  const auto before = summary(c.gpu.stats());
  const std::vector<float> r = read_all(c.gpu, 1);
  CHECK(c.gpu.fork(4, 2).code() == errc::not_found);
  CHECK(c.gpu.fork(1, 1).code() == errc::invalid_argument);
  CHECK(c.gpu.truncate(1, 151).code() == errc::invalid_argument);
  CHECK(c.gpu.truncate(1, -3).code() == errc::invalid_argument);
  CHECK(summary(c.gpu.stats()) == before);
  CHECK(read_all(c.gpu, 1) == r);
}
