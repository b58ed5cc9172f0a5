// How the CUDA backend behaves inside an engine's process: a kernel launch that fails at any point
// of an append (injected with cuda::testing::fail_launch) leaves what the cache reads, attends
// and counts exactly as before, and the same append then stores what a cache that never failed
// stores; kvq leaves the engine's pending CUDA error and its current device alone; two caches on
// two devices work side by side.
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <deque>
#include <kvq/cache/cache.hpp>
#include <kvq/cuda/testing.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/static_policy.hpp>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cache_reads.hpp"
#include "gpu_test.hpp"

using namespace kvq;
using namespace kvq::gpu_test;

namespace {

// P = 64, R = 128, r = 32.
constexpr int layers = 2, hq = 8, kvh = 2, d = 64;

KVCache make_gpu(const std::string& spec, int max_sequences = 8) {
  cache_config cfg;
  cfg.shape = {layers, hq, kvh, d, 64, 128, 32};
  cfg.budget_bytes = 96ull << 20;
  cfg.max_sequences = max_sequences;
  cfg.max_tokens = 8192;
  cfg.where = backend::cuda;
  auto pol = std::make_shared<static_policy>(static_policy::parse(spec).value_or_throw());
  return KVCache::create(cfg, pol).value_or_throw();
}

// Random fp16 K/V of `n` tokens on the device.
struct kv_rows {
  std::vector<uint16_t> k, v;
  dev_mem dk, dv;
  int64_t n;
  kv_rows(std::mt19937& rng, int64_t tokens)
      : k(randn_h(rng, size_t(tokens) * kvh * d)),
        v(randn_h(rng, size_t(tokens) * kvh * d)),
        dk(k.size() * 2),
        dv(v.size() * 2),
        n(tokens) {
    upload(dk, k);
    upload(dv, v);
  }
  tensor_view kt() const { return {dk.p, dtype::f16, n, kvh, d}; }
  tensor_view vt() const { return {dv.p, dtype::f16, n, kvh, d}; }
};

using kvq::test::read_all;

auto summary(const cache_stats& s) {
  return std::make_tuple(s.used_bytes, s.free_bytes, s.largest_free_block, s.page_bytes, s.pages, s.sequences, s.tokens,
                         s.bytes_by_format);
}

// Every layer's attention of one batch (q_len 1 per item), as raw output bits.
std::vector<float> attend_all(KVCache& c, const std::vector<attend_item>& items, uint32_t seed) {
  std::mt19937 rng(seed);
  const int total = int(items.size());
  std::vector<float> out;
  for (int l = 0; l < layers; ++l) {
    const auto qh = randn_h(rng, size_t(total) * hq * d);
    std::vector<float> o(qh.size());
    dev_mem dq(qh.size() * 2), dout(o.size() * 4);
    upload(dq, qh);
    check(c.attend(items, l, {dq.p, dtype::f16, total, hq, d}, {dout.p, dtype::f32, total, hq, d}));
    REQUIRE(cudaMemcpy(o.data(), dout.p, o.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
    out.insert(out.end(), o.begin(), o.end());
  }
  return out;
}

// Runs `call` with its 1st, 2nd, ... kernel launch failing until it succeeds; after each failure
// `same()` must hold. Returns the launches the successful call made.
template <class Call, class Same>
int fail_each_launch(Call call, Same same) {
  for (int nth = 1;; ++nth) {
    CAPTURE(nth);
    REQUIRE(nth < 64);
    const long before = cuda::testing::launch_count();
    cuda::testing::fail_launch(nth);
    const status st = call();
    cuda::testing::fail_launch(0);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    if (st.ok()) return int(cuda::testing::launch_count() - before);
    REQUIRE(st.code() == errc::cuda_error);
    REQUIRE(st.message().find("injected") != std::string::npos);
    same();
  }
}

}  // namespace

TEST_CASE("gpu: a launch failing anywhere in a multi-launch append changes nothing", "[gpu][hygiene]") {
  const std::string spec = GENERATE("kivi4/g32", "int8");
  CAPTURE(spec);
  std::mt19937 rng(11);
  KVCache a = make_gpu(spec), ref = make_gpu(spec);
  for (KVCache* c : {&a, &ref}) check(c->create_sequence(1));
  // 200 tokens: pages [0, 128), tokens [128, 200) unencoded in ring slots 0..71.
  std::deque<kv_rows> prefix;  // (kv_rows does not move)
  for (int l = 0; l < layers; ++l) prefix.emplace_back(rng, 200);
  for (KVCache* c : {&a, &ref})
    for (int l = 0; l < layers; ++l) check(c->append(1, l, prefix[size_t(l)].kt(), prefix[size_t(l)].vt()));
  const auto stats0 = summary(a.stats());
  const std::vector<float> read0 = read_all(a, 1), att0 = attend_all(a, {{1, 1}}, 3);
  REQUIRE(read0 == read_all(ref, 1));
  // 3000 tokens: 46 new pages, two encode + ring launch pairs of at most cuda::max_append_pages
  // pages (the first ring write overwrites every slot, the unencoded tokens' included).
  const kv_rows big(rng, 3000);
  const int launches = fail_each_launch([&] { return a.append(1, 0, big.kt(), big.vt()); },
                                        [&] {
                                          REQUIRE(summary(a.stats()) == stats0);
                                          REQUIRE(read_all(a, 1) == read0);
                                          REQUIRE(attend_all(a, {{1, 1}}, 3) == att0);
                                        });
  CHECK(launches >= 6);  // value check, undo record, 2 x (encode, ring)
  check(ref.append(1, 0, big.kt(), big.vt()));
  REQUIRE(summary(a.stats()) == summary(ref.stats()));
  REQUIRE(read_all(a, 1) == read_all(ref, 1));
  // Layer 1 keeps 200 tokens: one step over both layers attends the same.
  REQUIRE(attend_all(a, {{1, 1}}, 4) == attend_all(ref, {{1, 1}}, 4));
}

TEST_CASE("gpu: a launch failing in an append_batch of two launch pairs changes nothing", "[gpu][hygiene]") {
  constexpr int seqs = 130;  // more than cuda::max_append_items: two launch pairs
  std::mt19937 rng(12);
  KVCache a = make_gpu("kivi4/g32", seqs), ref = make_gpu("kivi4/g32", seqs);
  std::vector<attend_item> items;
  for (int s = 0; s < seqs; ++s) {
    const kv_rows kv(rng, 90 + s % 70);  // some sequences encode a page with the step's token
    for (KVCache* c : {&a, &ref}) {
      check(c->create_sequence(s));
      for (int l = 0; l < layers; ++l) check(c->append(s, l, kv.kt(), kv.vt()));
    }
    items.push_back({s, 1});
  }
  const auto stats0 = summary(a.stats());
  const std::vector<float> att0 = attend_all(a, items, 5);
  std::vector<std::vector<float>> read0;
  for (int s = 0; s < seqs; ++s) read0.push_back(read_all(a, s));
  const kv_rows step(rng, seqs);
  std::vector<append_item> batch;
  for (int s = 0; s < seqs; ++s) batch.push_back({s, 1});
  const int launches = fail_each_launch([&] { return a.append_batch(batch, 1, step.kt(), step.vt()); },
                                        [&] {
                                          REQUIRE(summary(a.stats()) == stats0);
                                          for (int s = 0; s < seqs; ++s) REQUIRE(read_all(a, s) == read0[size_t(s)]);
                                          REQUIRE(attend_all(a, items, 5) == att0);
                                        });
  CHECK(launches >= 5);  // value check, undo record, encode + ring, ring (the last two items: no page)
  check(ref.append_batch(batch, 1, step.kt(), step.vt()));
  REQUIRE(summary(a.stats()) == summary(ref.stats()));
  for (int s = 0; s < seqs; ++s) REQUIRE(read_all(a, s) == read_all(ref, s));
}

// An error of the engine's own that it has not read yet (a failed allocation) must survive every
// kvq call: kvq neither clears it nor reports it. Each call is checked alone, so a failure names
// it; the first checks are the plain runtime calls kvq makes, which show what the runtime itself
// keeps.
TEST_CASE("gpu: kvq leaves the engine's pending CUDA error and current device alone", "[gpu][hygiene]") {
  std::mt19937 rng(13);
  KVCache a = make_gpu("kivi4/g32");
  check(a.create_sequence(1));
  const kv_rows kv(rng, 150), step(rng, 1);
  for (int l = 0; l < layers; ++l) check(a.append(1, l, kv.kt(), kv.vt()));
  dev_mem scratch(64);
  auto keeps_pending = [](const char* what, auto&& call) {
    INFO(what);
    void* huge = nullptr;
    REQUIRE(cudaMalloc(&huge, size_t(1) << 50) == cudaErrorMemoryAllocation);  // the engine's, unread
    call();
    CHECK(cudaGetLastError() == cudaErrorMemoryAllocation);
    REQUIRE(cudaGetLastError() == cudaSuccess);
  };
  keeps_pending("runtime: cudaGetDevice", [] {
    int dev = 0;
    REQUIRE(cudaGetDevice(&dev) == cudaSuccess);
  });
  keeps_pending("runtime: cudaMemsetAsync + cudaStreamSynchronize", [&] {
    REQUIRE(cudaMemsetAsync(scratch.p, 0, 64, nullptr) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(nullptr) == cudaSuccess);
  });
  keeps_pending("runtime: cudaMalloc, cudaMemcpy, cudaFree (what the test's own buffers do)", [] {
    dev_mem d(256);
    upload(d, std::vector<uint16_t>(128, 0));
  });
  keeps_pending("append (value check, encode, ring)", [&] { check(a.append(1, 0, step.kt(), step.vt())); });
  keeps_pending("append_batch", [&] {
    const append_item it{1, 1};
    check(a.append_batch({&it, 1}, 1, step.kt(), step.vt()));
  });
  keeps_pending("attend (attention, merge)", [&] { (void)attend_all(a, {{1, 1}}, 6); });
  keeps_pending("read", [&] { (void)read_all(a, 1); });
  keeps_pending("sync_policy", [&] { check(a.sync_policy()); });
  int dev = -1;
  REQUIRE(cudaGetDevice(&dev) == cudaSuccess);
  REQUIRE(dev == 0);
}

TEST_CASE("gpu: two caches on two devices in one process, each call from the other device",
          "[gpu][hygiene][multi_gpu]") {
  int n = 0;
  REQUIRE(cudaGetDeviceCount(&n) == cudaSuccess);
  if (n < 2) {
    WARN("SKIPPED: needs two CUDA devices");
    return;
  }
  std::mt19937 rng(14);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  KVCache c0 = make_gpu("k=kivi4/g32,v=kivi2/g32");
  const kv_rows kv0(rng, 300);
  std::mt19937 rng1(14);
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  KVCache c1 = make_gpu("k=kivi4/g32,v=kivi2/g32");
  const kv_rows kv1(rng1, 300);  // the same values, on device 1
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  for (KVCache* c : {&c0, &c1}) check(c->create_sequence(1));
  // Every call of each cache is made while the other device is current.
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  for (int l = 0; l < layers; ++l) check(c0.append(1, l, kv0.kt(), kv0.vt()));
  int dev = -1;
  REQUIRE((cudaGetDevice(&dev) == cudaSuccess && dev == 1));
  const std::vector<float> r0 = read_all(c0, 1);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  for (int l = 0; l < layers; ++l) check(c1.append(1, l, kv1.kt(), kv1.vt()));
  REQUIRE((cudaGetDevice(&dev) == cudaSuccess && dev == 0));
  REQUIRE(read_all(c1, 1) == r0);
  REQUIRE((cudaGetDevice(&dev) == cudaSuccess && dev == 0));
}
