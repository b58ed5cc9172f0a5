// `KVCache::prefill` of any length and `KVCache::attend_prefix` on the CUDA backend against the
// CPU backend (docs/architecture.md, "Prefill of any length"): chunks of T tokens around tile,
// window and item edges after n0 stored tokens, every tested format and a striped (mixed) layer,
// head_dim 64/128, GQA 1/4, rotation on and off; the prefix part alone and its log-sum-exps; bad
// input that must change nothing; each launch failing in turn.
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <kvq/cache/cache.hpp>
#include <kvq/cuda/testing.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/static_policy.hpp>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpu_test.hpp"

using namespace kvq;
using namespace kvq::gpu_test;

namespace {

bool small() { return std::getenv("KVQ_GPU_TEST_SMALL") != nullptr; }

constexpr double nmse_bound = 2e-5;  // as tests/cuda/test_cuda_cache.cpp: fp16 MMA operands
constexpr int H = 2;                 // kv heads (of every twin but the segment test's: `twin::h`)
using sizes = std::vector<int64_t>;

// "mixed": the prefix is appended in pieces under changing tiers, one head on its own format;
// "mixed by element": the same with tiers of formats the kernels read by element among them.
const char* const mixed_tiers[] = {"kivi4/g32", "k=kivi2/g32,v=fp8", "fp16", "k=int8,v=kivi2/g64"};
const char* const mixed_element_tiers[] = {"cb4", "k=kivi2/g32,v=nvfp4", "fp16", "k=kivi3/g32,v=kivi4/g32"};
const char* const* tiers_of(const std::string& spec) {
  return spec == "mixed" ? mixed_tiers : spec == "mixed by element" ? mixed_element_tiers : nullptr;
}

struct twin {
  KVCache cpu, gpu;
  std::shared_ptr<static_policy> pol;
  int hq, d, h;
};

// spec: a format pair or a `mixed` spec, optionally followed by `+sink` (the first page FP16:
// cache_config::sink_pages 1).
twin make(std::string spec, int gqa, int d, bool rotated, int kv_heads = H) {
  cache_config cfg;
  cfg.shape = {1, kv_heads * gqa, kv_heads, d, 64, 128, 32};
  cfg.budget_bytes = 256ull << 20;
  cfg.max_sequences = 4;
  cfg.max_tokens = 1 << 14;
  cfg.cpu_threads = 4;
  if (rotated) cfg.rotation = {{1, 0}, 4321};  // head 0 rotated, head 1 plain
  if (spec.ends_with("+sink")) cfg.sink_pages = 1, spec.resize(spec.size() - 5);
  auto pol =
      std::make_shared<static_policy>(parse_format_pair(tiers_of(spec) ? tiers_of(spec)[0] : spec).value_or_throw());
  auto c = KVCache::create(cfg, pol).value_or_throw();
  cfg.where = backend::cuda;
  auto g = KVCache::create(cfg, pol).value_or_throw();
  check(c.create_sequence(0));
  check(g.create_sequence(0));
  return {std::move(c), std::move(g), pol, kv_heads * gqa, d, kv_heads};
}

// n0 stored tokens on both caches (a mixed layer: in pieces under changing tiers).
void fill_prefix(twin& t, const std::string& spec, int64_t n0, std::mt19937& rng) {
  const int H = t.h;
  int64_t done = 0;
  const char* const* tiers = tiers_of(spec);
  for (int piece = 0; done < n0; ++piece) {
    const int64_t m = tiers ? std::min<int64_t>(n0 - done, 150 + 37 * piece) : n0 - done;
    if (tiers) {
      t.pol->set_all(*parse_format_pair(tiers[piece % 4]));
      t.pol->set_head(0, 1, *parse_format_pair("sym4/g32"));
    }
    const auto k = randn_h(rng, size_t(m) * H * t.d), v = randn_h(rng, size_t(m) * H * t.d);
    check(t.cpu.append(0, 0, {k.data(), dtype::f16, m, H, t.d}, {v.data(), dtype::f16, m, H, t.d}));
    dev_mem dk(k.size() * 2), dv(v.size() * 2);
    upload(dk, k);
    upload(dv, v);
    check(t.gpu.append(0, 0, {dk.p, dtype::f16, m, H, t.d}, {dv.p, dtype::f16, m, H, t.d}));
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    done += m;
  }
}

std::vector<float> to_float(const std::vector<uint16_t>& h) {
  std::vector<float> f(h.size());
  for (size_t i = 0; i < h.size(); ++i) f[i] = half_to_float(h[i]);
  return f;
}

// One prefill of T tokens on both caches; the NMSE of the GPU's output against the CPU's.
double prefill_both(twin& t, int64_t T, std::mt19937& rng) {
  const int H = t.h;
  const auto k = randn_h(rng, size_t(T) * H * t.d), v = randn_h(rng, size_t(T) * H * t.d);
  const auto q = randn_h(rng, size_t(T) * t.hq * t.d);
  const auto qf = to_float(q);
  std::vector<float> oc(q.size()), og(q.size(), std::nanf(""));
  check(t.cpu.prefill(0, 0, {k.data(), dtype::f16, T, H, t.d}, {v.data(), dtype::f16, T, H, t.d},
                      {qf.data(), dtype::f32, T, t.hq, t.d}, {oc.data(), dtype::f32, T, t.hq, t.d}));
  dev_mem dk(k.size() * 2), dv(v.size() * 2), dq(q.size() * 2), dout(og.size() * 4);
  upload(dk, k);
  upload(dv, v);
  upload(dq, q);
  upload(dout, og);  // poisoned: every element must be written
  check(t.gpu.prefill(0, 0, {dk.p, dtype::f16, T, H, t.d}, {dv.p, dtype::f16, T, H, t.d},
                      {dq.p, dtype::f16, T, t.hq, t.d}, {dout.p, dtype::f32, T, t.hq, t.d}));
  REQUIRE(cudaMemcpy(og.data(), dout.p, og.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(t.gpu.length(0, 0) == t.cpu.length(0, 0));
  require_same_store(t.cpu, t.gpu, 0, 0);
  return nmse(og, oc);
}

// attend_prefix of T fp16 queries over `prefix` stored tokens on both caches: outputs and lses.
struct prefix_result {
  std::vector<float> q, oc, og, lc, lg;
};
prefix_result prefix_both(twin& t, int64_t prefix, int64_t T, std::mt19937& rng) {
  prefix_result r;
  const auto q = randn_h(rng, size_t(T) * t.hq * t.d);
  r.q = to_float(q);
  r.oc.resize(q.size());
  r.og.assign(q.size(), std::nanf(""));
  r.lc.resize(size_t(T) * t.hq);
  r.lg.assign(r.lc.size(), std::nanf(""));
  check(t.cpu.attend_prefix(0, 0, prefix, {r.q.data(), dtype::f32, T, t.hq, t.d},
                            {r.oc.data(), dtype::f32, T, t.hq, t.d}, r.lc.data()));
  dev_mem dq(q.size() * 2), dout(r.og.size() * 4), dl(r.lg.size() * 4);
  upload(dq, q);
  upload(dout, r.og);
  upload(dl, r.lg);
  check(t.gpu.attend_prefix(0, 0, prefix, {dq.p, dtype::f16, T, t.hq, t.d}, {dout.p, dtype::f32, T, t.hq, t.d},
                            static_cast<float*>(dl.p)));
  REQUIRE(cudaMemcpy(r.og.data(), dout.p, r.og.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(cudaMemcpy(r.lg.data(), dl.p, r.lg.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  return r;
}

// LSEs agree to the fp16 rounding of the operands. The LSE moves by at most the largest change
// of a score, and a score q.k changes by at most 2^-11 |q| |k| when q is rounded to fp16 (the
// GPU rounds the rotated query for the tensor cores, the CPU keeps it in float): the bound is
// 2e-3 (1 + |lse|) + 2^-10 scale |q| max_j |k_j| per (query, head), over the first `prefix`
// stored tokens as read() returns them (the rotation keeps norms).
void require_close_lse(twin& t, int64_t prefix, const prefix_result& r) {
  const int H = t.h;
  const std::vector<float>& got = r.lg;
  const std::vector<float>& want = r.lc;
  REQUIRE(got.size() == want.size());
  const int64_t n = t.cpu.length(0, 0);
  std::vector<float> k(size_t(n) * H * t.d);
  check(t.cpu.read(0, 0, role::k, k));
  std::vector<double> kmax(H, 0.0);
  for (int64_t j = 0; j < prefix; ++j)
    for (int h = 0; h < H; ++h) {
      double s2 = 0;
      for (int c = 0; c < t.d; ++c) s2 += double(k[(size_t(j) * H + h) * t.d + c]) * k[(size_t(j) * H + h) * t.d + c];
      kmax[h] = std::max(kmax[h], std::sqrt(s2));
    }
  const double scale = 1.0 / std::sqrt(double(t.d));
  const int group = t.hq / H;
  for (size_t i = 0; i < got.size(); ++i) {
    const float* qi = r.q.data() + i * t.d;  // lse row i is (token i / hq, head i % hq)
    double q2 = 0;
    for (int c = 0; c < t.d; ++c) q2 += double(qi[c]) * qi[c];
    const double bound = 2e-3 * (1.0 + std::abs(want[i])) + std::ldexp(scale * std::sqrt(q2) * kmax[(i % t.hq) / group], -10);
    CAPTURE(i, got[i], want[i], bound);
    REQUIRE(std::isfinite(got[i]));
    REQUIRE(std::abs(got[i] - want[i]) <= bound);
  }
}

}  // namespace

TEST_CASE("gpu prefill: chunks of any length after stored tokens match the CPU, every format", "[gpu][prefill]") {
  const std::string spec = GENERATE("fp16", "kivi4/g32", "kivi2/g32", "int8", "mixed", "cb4", "kivi3/g32",
                                    "k=nvfp4,v=cb2/g32", "mixed by element", "kivi4/g32+sink", "kivi3/g32+sink");
  const int64_t n0 = GENERATE_COPY(from_range(small() ? sizes{0, 37} : sizes{0, 37, 1000}));
  const int64_t T = GENERATE_COPY(from_range(small() ? sizes{1, 129, 300} : sizes{1, 100, 128, 129, 700, 4096}));
  CAPTURE(spec, n0, T);
  auto t = make(spec, 4, 128, false);
  std::mt19937 rng(uint32_t(n0 * 7919 + T));
  fill_prefix(t, spec, n0, rng);
  REQUIRE(prefill_both(t, T, rng) < nmse_bound);
}

TEST_CASE("gpu prefill: head_dim 64/128, GQA 1/4, rotation on and off", "[gpu][prefill][rotation]") {
  const int d = GENERATE(64, 128, 256);
  const int gqa = GENERATE(1, 4);
  const bool rotated = GENERATE(false, true);
  const std::string spec = GENERATE("kivi4/g32", "mixed", "mixed by element");
  const int64_t T = GENERATE_COPY(from_range(small() ? sizes{129} : sizes{129, 700, 4096}));
  const int64_t n0 = small() ? 300 : 1000;
  CAPTURE(d, gqa, rotated, spec, T, n0);
  auto t = make(spec, gqa, d, rotated);
  std::mt19937 rng(uint32_t(d * 31 + gqa * 7 + rotated + T));
  fill_prefix(t, spec, n0, rng);
  REQUIRE(prefill_both(t, T, rng) < nmse_bound);
  // a second chunk: its prefix now holds the first chunk's pages
  REQUIRE(prefill_both(t, small() ? 65 : 300, rng) < nmse_bound);
}

// The prefix part runs the prefix kernel (128-row blocks, two m-tiles a warp) when an item has more
// than 16 query rows (T x group), else the 16-row tile kernel: rows around both edges and not a
// multiple of 128 or of a warp's 32 (a warp with one m-tile of rows and one of padding), prefixes
// around page (64) and window (128) edges, GQA 1 and 8, KIVI keys of one and two token groups per
// tile, and the ring.
TEST_CASE("gpu prefill: the prefix kernel's edges (rows per item, prefix at page and ring edges, GQA 1 and 8)",
          "[gpu][prefill][prefix_kernel]") {
  const int gqa = GENERATE(1, 8);
  const std::string spec = GENERATE("fp16", "k=kivi4/g64,v=kivi2/g32", "kivi2/g32", "k=int8,v=fp8", "mixed");
  const int64_t n0 = GENERATE_COPY(from_range(small() ? sizes{65, 200} : sizes{1, 63, 64, 65, 127, 129, 200, 1000}));
  const int64_t T = GENERATE_COPY(from_range(small() ? sizes{17, 65} : sizes{2, 16, 17, 33, 65, 257, 300}));
  const bool rotated = gqa == 8;
  CAPTURE(gqa, spec, n0, T, rotated);
  auto t = make(spec, gqa, 128, rotated);
  std::mt19937 rng(uint32_t(n0 * 7919 + T * 31 + gqa));
  fill_prefix(t, spec, n0, rng);
  const prefix_result r = prefix_both(t, n0, T, rng);
  REQUIRE(nmse(r.og, r.oc) < nmse_bound);
  require_close_lse(t, n0, r);
  REQUIRE(prefill_both(t, T, rng) < nmse_bound);
}

TEST_CASE("gpu prefill: the prefix kernel at head_dim 64, KIVI and FP16 pages and the ring",
          "[gpu][prefill][prefix_kernel]") {
  const int gqa = GENERATE(1, 4);
  const std::string spec = GENERATE("fp16", "kivi4/g32", "mixed");
  const int64_t T = GENERATE_COPY(from_range(small() ? sizes{65} : sizes{17, 65, 300}));
  CAPTURE(gqa, spec, T);
  auto t = make(spec, gqa, 64, false);
  std::mt19937 rng(uint32_t(T * 17 + gqa));
  fill_prefix(t, spec, 450, rng);
  const prefix_result r = prefix_both(t, 450, T, rng);
  REQUIRE(nmse(r.og, r.oc) < nmse_bound);
  require_close_lse(t, 450, r);
  REQUIRE(prefill_both(t, T, rng) < nmse_bound);
}

// The prefix kernel reads quantized page tiles as fp16 images staged in the workspace, at most
// `prefill_stage_bytes` of them at a time: with 32 kv heads at head_dim 256 (2 MiB of images a
// tile) a segment holds 32 tiles, so a prefix of 35 tiles runs as two segments (staging, then the
// prefix kernel over its splits, twice), FP16 and sym4 pages (read from the page) among them.
TEST_CASE("gpu prefill: the prefix kernel's staged tiles in segments (32 kv heads, head_dim 256)",
          "[gpu][prefill][prefix_kernel]") {
  const std::string spec = GENERATE("kivi4/g32", "mixed");
  CAPTURE(spec);
  auto t = make(spec, 1, 256, false, 32);
  std::mt19937 rng(spec.size());
  const int64_t n0 = 2200, T = small() ? 65 : 300;
  fill_prefix(t, spec, n0, rng);
  const prefix_result r = prefix_both(t, n0, T, rng);
  REQUIRE(nmse(r.og, r.oc) < nmse_bound);
  require_close_lse(t, n0, r);
  REQUIRE(prefill_both(t, T, rng) < nmse_bound);
}

TEST_CASE("gpu prefill: attend_prefix alone matches the CPU, outputs and log-sum-exps",
          "[gpu][prefill][attend_prefix]") {
  const std::string spec = GENERATE("fp16", "kivi2/g32", "mixed");
  const int gqa = GENERATE(1, 4);
  const bool rotated = GENERATE(false, true);
  CAPTURE(spec, gqa, rotated);
  auto t = make(spec, gqa, 128, rotated);
  std::mt19937 rng(uint32_t(gqa * 13 + rotated));
  const int64_t n = small() ? 300 : 1000;
  fill_prefix(t, spec, n, rng);
  // prefixes inside a page, at a page edge, reaching into the ring, and all of it
  for (int64_t prefix : {int64_t(1), int64_t(64), int64_t(200), n - 20, n}) {
    for (int64_t T : {int64_t(1), int64_t(300)}) {
      CAPTURE(prefix, T);
      const prefix_result r = prefix_both(t, prefix, T, rng);
      REQUIRE(nmse(r.og, r.oc) < nmse_bound);
      require_close_lse(t, prefix, r);
    }
  }
}

TEST_CASE("gpu prefill: the log-sum-exp is ln sum exp of the scaled scores over what read() returns",
          "[gpu][prefill][attend_prefix]") {
  // The LSE against an fp64 computation from the stored tokens themselves; an empty prefix gives
  // o = 0 and lse = -inf exactly.
  auto t = make("k=kivi4/g32,v=int8", 4, 64, true);
  std::mt19937 rng(77);
  const int64_t n = 260, T = 40, prefix = 230;
  fill_prefix(t, "k=kivi4/g32,v=int8", n, rng);
  const int d = t.d, hq = t.hq, group = hq / H;
  std::vector<float> keys(size_t(n) * H * d);
  check(t.gpu.read(0, 0, role::k, keys));
  const prefix_result r = prefix_both(t, prefix, T, rng);
  const double scale = 1.0 / std::sqrt(double(d));
  for (int64_t i = 0; i < T; ++i)
    for (int qh = 0; qh < hq; ++qh) {
      const int h = qh / group;
      std::vector<double> s(static_cast<size_t>(prefix));
      double mx = -INFINITY;
      for (int64_t j = 0; j < prefix; ++j) {
        double dot = 0;
        for (int c = 0; c < d; ++c)
          dot += double(r.q[(size_t(i) * hq + qh) * d + c]) * keys[(size_t(j) * H + h) * d + c];
        s[size_t(j)] = dot * scale;
        mx = std::max(mx, s[size_t(j)]);
      }
      double sum = 0;
      for (double x : s) sum += std::exp(x - mx);
      const double want = mx + std::log(sum), got = r.lg[size_t(i) * hq + qh];
      CAPTURE(i, qh, got, want);
      REQUIRE(std::abs(got - want) <= 2e-3 * (1.0 + std::abs(want)));
    }
  const prefix_result e = prefix_both(t, 0, T, rng);
  for (size_t i = 0; i < e.og.size(); ++i) REQUIRE(e.og[i] == 0.f);
  for (float l : e.lg) REQUIRE(l == -std::numeric_limits<float>::infinity());
}

TEST_CASE("gpu prefill: bad input returns an error and changes nothing", "[gpu][prefill][errors]") {
  auto t = make("kivi4/g32", 4, 128, false);
  std::mt19937 rng(3);
  fill_prefix(t, "kivi4/g32", 100, rng);
  const int64_t T = 300, d = t.d;
  std::vector<float> before_k(size_t(100) * H * d), before_v(before_k.size()), after(before_k.size());
  check(t.gpu.read(0, 0, role::k, before_k));
  check(t.gpu.read(0, 0, role::v, before_v));
  const auto stats = t.gpu.stats();
  auto k = randn_h(rng, size_t(T) * H * d);
  const auto v = randn_h(rng, size_t(T) * H * d), q = randn_h(rng, size_t(T) * t.hq * d);
  dev_mem dk(k.size() * 2), dv(v.size() * 2), dq(q.size() * 2), dout(q.size() * 4);
  upload(dk, k);
  upload(dv, v);
  upload(dq, q);
  const auto unchanged = [&] {
    REQUIRE(t.gpu.length(0, 0) == 100);
    check(t.gpu.read(0, 0, role::k, after));
    REQUIRE(after == before_k);
    check(t.gpu.read(0, 0, role::v, after));
    REQUIRE(after == before_v);
    REQUIRE(t.gpu.stats().page_bytes == stats.page_bytes);
    REQUIRE(t.gpu.stats().used_bytes == stats.used_bytes);
  };
  const tensor_view kv_k{dk.p, dtype::f16, T, H, int(d)}, kv_v{dv.p, dtype::f16, T, H, int(d)};
  const tensor_mut o{dout.p, dtype::f32, T, t.hq, int(d)};
  SECTION("Q with one token too few") {
    const status s = t.gpu.prefill(0, 0, kv_k, kv_v, {dq.p, dtype::f16, T - 1, t.hq, int(d)}, o);
    REQUIRE(s.code() == errc::invalid_argument);
    unchanged();
  }
  SECTION("Q with the kv heads' head count") {
    const status s = t.gpu.prefill(0, 0, kv_k, kv_v, {dq.p, dtype::f16, T, H, int(d)}, o);
    REQUIRE(s.code() == errc::invalid_argument);
    unchanged();
  }
  SECTION("NaN in K") {
    k[size_t(250) * H * d + 17] = 0x7e00;  // fp16 NaN, past the window
    upload(dk, k);
    check(t.gpu.prefill(0, 0, kv_k, kv_v, {dq.p, dtype::f16, T, t.hq, int(d)}, o));  // (refused on the device)
    const status s = t.gpu.check();
    REQUIRE(s.code() == errc::non_finite);
    unchanged();
  }
  SECTION("attend_prefix past the stored tokens") {
    dev_mem dl(size_t(T) * t.hq * 4);
    const status s = t.gpu.attend_prefix(0, 0, 101, {dq.p, dtype::f16, T, t.hq, int(d)}, o, static_cast<float*>(dl.p));
    REQUIRE(s.code() == errc::invalid_argument);
    unchanged();
  }
}

TEST_CASE("gpu prefill: a failed launch before the chunk is stored stores nothing; after it, the call says so",
          "[gpu][prefill][errors]") {
  // Each launch of a prefill of T > window fails in turn (cuda::testing::fail_launch): the value
  // check and the append's launches leave the cache as it was; the attention's leave the chunk
  // stored (as a direct append stores it) and return the launch's error.
  const int64_t n0 = 100, T = 300;
  const auto fresh = [&] {
    auto t = make("kivi4/g32", 4, 128, true);
    std::mt19937 rng(9);
    fill_prefix(t, "kivi4/g32", n0, rng);
    return t;
  };
  std::mt19937 rng(10);
  const int d = 128, hq = 8;
  const auto k = randn_h(rng, size_t(T) * H * d), v = randn_h(rng, size_t(T) * H * d),
             q = randn_h(rng, size_t(T) * hq * d);
  dev_mem dk(k.size() * 2), dv(v.size() * 2), dq(q.size() * 2), dout(q.size() * 4);
  upload(dk, k);
  upload(dv, v);
  upload(dq, q);
  const tensor_view tk{dk.p, dtype::f16, T, H, d}, tv{dv.p, dtype::f16, T, H, d}, tq{dq.p, dtype::f16, T, hq, d};
  const tensor_mut to{dout.p, dtype::f32, T, hq, d};
  long append_launches = 0, prefill_launches = 0;
  {
    auto t = fresh();
    const long a0 = cuda::testing::launch_count();
    check(t.gpu.append(0, 0, tk, tv));
    append_launches = cuda::testing::launch_count() - a0;
    auto u = fresh();
    const long p0 = cuda::testing::launch_count();
    check(u.gpu.prefill(0, 0, tk, tv, tq, to));
    prefill_launches = cuda::testing::launch_count() - p0;
  }
  REQUIRE(prefill_launches > append_launches);
  for (long nth = 1; nth <= prefill_launches; ++nth) {
    CAPTURE(nth, append_launches, prefill_launches);
    auto t = fresh();
    std::vector<float> before(size_t(n0) * H * d), after(before.size());
    check(t.gpu.read(0, 0, role::k, before));
    cuda::testing::fail_launch(int(nth));
    const status s = t.gpu.prefill(0, 0, tk, tv, tq, to);
    cuda::testing::fail_launch(0);
    REQUIRE(s.code() == errc::cuda_error);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    if (nth <= append_launches) {
      REQUIRE(t.gpu.length(0, 0) == n0);
      check(t.gpu.read(0, 0, role::k, after));
      REQUIRE(after == before);
    } else {
      REQUIRE(t.gpu.length(0, 0) == n0 + T);
      check(t.cpu.append(0, 0, {k.data(), dtype::f16, T, H, d}, {v.data(), dtype::f16, T, H, d}));
      require_same_store(t.cpu, t.gpu, 0, 0);
    }
  }
}
