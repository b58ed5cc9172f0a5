// Attention variants (sliding window, logit soft-capping, learned sink logits:
// include/kvq/attention/variant.hpp) on the CUDA backend against the CPU backend, which applies
// them as the reference does (tests/test_attention_variants.cpp): decode steps of batches at q_len 1
// and more (the decode kernels, and the tile kernel past 8 rows a kv head), a prefill chunk longer
// than the ring after a stored prefix, attend_prefix and its log-sum-exps, every format family
// and a per-head mix at head_dim 64, 128 and 256, with and without an FP16 sink page; a sliding
// layer long after its first pages were released; a decode step replayed from a CUDA graph. The
// low-level calls with `variant_args`: tests/cuda/test_cuda_pool.cpp.
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <kvq/attention/variant.hpp>
#include <kvq/cache/cache.hpp>
#include <kvq/cache/decode_step.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/static_policy.hpp>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gpu_test.hpp"

using namespace kvq;
using namespace kvq::gpu_test;

namespace {

bool small() { return std::getenv("KVQ_GPU_TEST_SMALL") != nullptr; }

constexpr double nmse_bound = 2e-5;  // as tests/cuda/test_cuda_cache.cpp: fp16 MMA operands

// Layer 0 plain (the control), then one layer per variant: a window shorter than a page, one of
// several pages that does not divide them, soft-capping, sink logits, and all three together.
std::vector<attention_variant> variants(int q_heads, std::mt19937& rng) {
  std::vector<float> sinks(static_cast<size_t>(q_heads));
  for (auto& s : sinks) s = std::normal_distribution<float>(1.f, 2.f)(rng);
  return {{}, {37, 0.f, {}}, {200, 0.f, {}}, {0, 2.5f, {}}, {0, 0.f, sinks}, {150, 3.f, sinks}};
}

std::string describe(const attention_variant& v) {
  return "window " + std::to_string(v.window) + " softcap " + std::to_string(v.softcap) +
         (v.sink_logits.empty() ? "" : " sinks");
}

struct twin {
  KVCache cpu, gpu;
  int hq, h, d;
};

// spec: a policy spec, optionally followed by `+sink` (the first page FP16: cache_config::sink_pages 1).
twin make(std::string spec, int hq, int h, int d, const std::vector<attention_variant>& vars) {
  cache_config cfg;
  cfg.shape = {int(vars.size()), hq, h, d, 64, 128, 32};
  cfg.budget_bytes = 512ull << 20;
  cfg.max_sequences = 4;
  cfg.max_tokens = 1 << 14;
  cfg.cpu_threads = 4;
  cfg.attention = vars;
  if (spec.ends_with("+sink")) cfg.sink_pages = 1, spec.resize(spec.size() - 5);
  auto pol = std::make_shared<static_policy>(static_policy::parse(spec).value_or_throw());
  auto c = KVCache::create(cfg, pol).value_or_throw();
  cfg.where = backend::cuda;
  auto g = KVCache::create(cfg, pol).value_or_throw();
  return {std::move(c), std::move(g), hq, h, d};
}

std::vector<float> to_float(const std::vector<uint16_t>& h) {
  std::vector<float> f(h.size());
  for (size_t i = 0; i < h.size(); ++i) f[i] = half_to_float(h[i]);
  return f;
}

std::vector<float> download(const dev_mem& m, size_t count) {
  std::vector<float> x(count);
  REQUIRE(cudaMemcpy(x.data(), m.p, count * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  return x;
}

// The GPU's output rows [rows][hq][d] against the CPU's: every element finite, NMSE within the
// fp16-MMA bound; on failure the worst element's row, head and channel. Returns whether it passed
// (the callers check every layer of a step, then stop at a failed one).
bool check_close(const std::vector<float>& got, const std::vector<float>& want, int hq, int d, const std::string& what) {
  REQUIRE(got.size() == want.size());
  double e = 0, n = 0, worst = -1;
  size_t at = 0, bad = got.size();
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      bad = i;
      break;
    }
    const double x = double(got[i]) - want[i];
    e += x * x, n += double(want[i]) * want[i];
    if (std::fabs(x) > worst) worst = std::fabs(x), at = i;
  }
  if (bad < got.size()) at = bad;
  const double err = n > 0 ? e / n : e;
  std::ostringstream os;
  os << what << ": nmse " << err << ", worst |error| " << worst << " at row " << at / (size_t(hq) * d) << " head "
     << (at / size_t(d)) % size_t(hq) << " channel " << at % size_t(d) << " (got " << got[at] << ", want " << want[at]
     << ")" << (bad < got.size() ? " NOT FINITE" : "");
  INFO(os.str());
  CHECK(bad == got.size());
  CHECK(err < nmse_bound);
  return bad == got.size() && err < nmse_bound;
}

// The same random tokens appended to (s, layer) of both caches.
void append_both(twin& t, seq_id s, int layer, int64_t m, std::mt19937& rng) {
  const auto k = randn_h(rng, size_t(m) * t.h * t.d), v = randn_h(rng, size_t(m) * t.h * t.d);
  append_same(t.cpu, t.gpu, s, layer, k, v, m);
}

// n tokens appended to every layer of s, in chunks of 1 to `most` tokens (pages encoded, and a
// sliding layer's released, along the way).
void fill(twin& t, seq_id s, int64_t n, std::mt19937& rng, int most = 97) {
  const int layers = t.cpu.config().shape.layers;
  for (int64_t done = 0; done < n;) {
    const int64_t m = std::min<int64_t>(n - done, 1 + int64_t(rng() % uint32_t(most)));
    for (int l = 0; l < layers; ++l) append_both(t, s, l, m, rng);
    done += m;
  }
}

// A step of every layer on both caches: q_len tokens appended to each sequence of `seqs`, then one
// attend call over all of them; the outputs compared layer by layer.
void step_both(twin& t, const std::vector<seq_id>& seqs, int q_len, std::mt19937& rng, const std::string& what) {
  const int layers = t.cpu.config().shape.layers;
  const int64_t rows = int64_t(seqs.size()) * q_len;
  bool ok = true;
  for (int l = 0; l < layers; ++l) {
    for (seq_id s : seqs) append_both(t, s, l, q_len, rng);
    const auto q = randn_h(rng, size_t(rows) * t.hq * t.d);
    const auto qf = to_float(q);
    std::vector<attend_item> items;
    for (seq_id s : seqs) items.push_back({s, q_len});
    std::vector<float> oc(q.size()), og(q.size(), std::nanf(""));
    check(t.cpu.attend(items, l, {qf.data(), dtype::f32, rows, t.hq, t.d}, {oc.data(), dtype::f32, rows, t.hq, t.d}));
    dev_mem dq(q.size() * 2), dout(og.size() * 4);
    upload(dq, q);
    upload(dout, og);  // poisoned: every element must be written
    check(t.gpu.attend(items, l, {dq.p, dtype::f16, rows, t.hq, t.d}, {dout.p, dtype::f32, rows, t.hq, t.d}));
    std::ostringstream os;
    os << what << " layer " << l << " (" << describe(t.cpu.config().attention[size_t(l)]) << ") q_len " << q_len
       << " lengths";
    for (seq_id s : seqs) os << ' ' << t.cpu.length(s, l);
    ok = check_close(download(dout, og.size()), oc, t.hq, t.d, os.str()) && ok;
  }
  REQUIRE(ok);
}

// A prefill of T tokens of s on every layer of both caches, compared; the stores must stay equal.
void prefill_both(twin& t, seq_id s, int64_t T, std::mt19937& rng, const std::string& what) {
  const int layers = t.cpu.config().shape.layers;
  bool ok = true;
  for (int l = 0; l < layers; ++l) {
    const int64_t before = t.cpu.length(s, l);
    const auto k = randn_h(rng, size_t(T) * t.h * t.d), v = randn_h(rng, size_t(T) * t.h * t.d);
    const auto q = randn_h(rng, size_t(T) * t.hq * t.d);
    const auto qf = to_float(q);
    std::vector<float> oc(q.size()), og(q.size(), std::nanf(""));
    check(t.cpu.prefill(s, l, {k.data(), dtype::f16, T, t.h, t.d}, {v.data(), dtype::f16, T, t.h, t.d},
                        {qf.data(), dtype::f32, T, t.hq, t.d}, {oc.data(), dtype::f32, T, t.hq, t.d}));
    dev_mem dk(k.size() * 2), dv(v.size() * 2), dq(q.size() * 2), dout(og.size() * 4);
    upload(dk, k);
    upload(dv, v);
    upload(dq, q);
    upload(dout, og);
    check(t.gpu.prefill(s, l, {dk.p, dtype::f16, T, t.h, t.d}, {dv.p, dtype::f16, T, t.h, t.d},
                        {dq.p, dtype::f16, T, t.hq, t.d}, {dout.p, dtype::f32, T, t.hq, t.d}));
    REQUIRE(t.gpu.length(s, l) == t.cpu.length(s, l));
    require_same_store(t.cpu, t.gpu, s, l);
    ok = check_close(download(dout, og.size()), oc, t.hq, t.d,
                     what + " prefill of " + std::to_string(T) + " after " + std::to_string(before) + ", layer " +
                         std::to_string(l) + " (" + describe(t.cpu.config().attention[size_t(l)]) + ")") &&
         ok;
  }
  REQUIRE(ok);
}

// attend_prefix of T queries over the first `prefix` stored tokens of s (every layer): outputs and
// log-sum-exps (the sink logits join them: -inf only where a row sees nothing and has no sink).
void prefix_both(twin& t, seq_id s, int64_t T, std::mt19937& rng, const std::string& what) {
  const int layers = t.cpu.config().shape.layers;
  bool ok = true;
  for (int l = 0; l < layers; ++l) {
    const int64_t prefix = t.cpu.length(s, l);
    const auto q = randn_h(rng, size_t(T) * t.hq * t.d);
    const auto qf = to_float(q);
    std::vector<float> oc(q.size()), og(q.size(), std::nanf("")), lc(size_t(T) * t.hq), lg(lc.size(), std::nanf(""));
    check(t.cpu.attend_prefix(s, l, prefix, {qf.data(), dtype::f32, T, t.hq, t.d}, {oc.data(), dtype::f32, T, t.hq, t.d},
                              lc.data()));
    dev_mem dq(q.size() * 2), dout(og.size() * 4), dl(lg.size() * 4);
    upload(dq, q);
    upload(dout, og);
    upload(dl, lg);
    check(t.gpu.attend_prefix(s, l, prefix, {dq.p, dtype::f16, T, t.hq, t.d}, {dout.p, dtype::f32, T, t.hq, t.d},
                              static_cast<float*>(dl.p)));
    const std::string about = what + " attend_prefix of " + std::to_string(T) + " over " + std::to_string(prefix) +
                              ", layer " + std::to_string(l) + " (" + describe(t.cpu.config().attention[size_t(l)]) + ")";
    ok = check_close(download(dout, og.size()), oc, t.hq, t.d, about) && ok;
    lg = download(dl, lg.size());
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < lg.size(); ++i) {
      const double e = std::isinf(lc[i]) ? (lg[i] == lc[i] ? 0.0 : INFINITY)
                                         : std::fabs(double(lg[i]) - lc[i]) / (1.0 + std::fabs(lc[i]));
      if (!(e <= worst)) worst = e, at = i;
    }
    // To the fp16 rounding of the operands, as in test_cuda_prefill.cpp's require_close_lse: the
    // GPU's tensor cores take the dequantized keys in fp16, the CPU keeps them in float, and an LSE
    // moves by the largest change of a score (2^-11 |q| |k| scale: up to 4.3e-4 (1 + |lse|) here,
    // at LSEs of about 26). A wrong window or cap moves it by far more; a sink logit counts where
    // the scores are near it: layer 5 of `variants`, whose capped scores are at most 3.
    INFO(about << ": lse worst relative error " << worst << " at row " << at / size_t(t.hq) << " head "
               << at % size_t(t.hq) << " (got " << lg[at] << ", want " << lc[at] << ")");
    CHECK(worst < 2e-3);
    ok = ok && worst < 2e-3;
  }
  REQUIRE(ok);
}

}  // namespace

TEST_CASE("gpu: attention variants in decode, prefill and attend_prefix equal the CPU backend, every format family",
          "[gpu][variants]") {
  using dims = std::vector<int>;
  using specs = std::vector<std::string>;
  const int d = GENERATE_COPY(from_range(small() ? dims{128} : dims{64, 128, 256}));
  // every family, a per-head mix (layer 1 and head 1 of layer 2 on their own pairs), FP16 sink pages
  const std::string spec = GENERATE_COPY(from_range(
      small() ? specs{"kivi4/g32", "k=kivi2/g32,v=int8;1=fp8;2.1=k=fp8,v=kivi4/g32+sink", "k=kivi3/g32,v=kivi4/g32"}
              : specs{"fp16", "int8", "kivi4/g32", "kivi2/g32", "kivi3/g32", "fp8", "nvfp4", "cb4", "ra4/g32",
                      "k=kivi2/g32,v=int8;1=fp8;2.1=k=fp8,v=kivi4/g32", "kivi4/g32+sink",
                      "k=kivi2/g32,v=int8;1=fp8;2.1=k=fp8,v=kivi4/g32+sink",
                      // (3-bit pages beside other formats: the Three instances, 4- and 8-bit stages)
                      "k=kivi3/g32,v=kivi4/g32", "k=sym3/g32,v=kivi8/g32+sink"}));
  const uint32_t seed = uint32_t(d) * 7919u + uint32_t(std::hash<std::string>{}(spec) % 1000u);
  CAPTURE(d, spec, seed);
  std::mt19937 rng(seed);
  const int hq = 4, h = 2;  // GQA 2: q_len 1 and 3 run the decode kernels, q_len 6 the tile kernel
  twin t = make(spec, hq, h, d, variants(hq, rng));
  const std::vector<seq_id> seqs = {0, 1, 2};
  const std::vector<int64_t> lens = {301, 530, small() ? 700 : 1000};
  for (size_t i = 0; i < seqs.size(); ++i) {
    check(t.cpu.create_sequence(seqs[i]));
    check(t.gpu.create_sequence(seqs[i]));
    fill(t, seqs[i], lens[i], rng);
  }
  const std::string what = spec + " d " + std::to_string(d);
  step_both(t, seqs, 1, rng, what);
  step_both(t, seqs, 3, rng, what);
  step_both(t, seqs, 6, rng, what);
  step_both(t, {2}, 1, rng, what);
  fill(t, 1, 200, rng);
  step_both(t, seqs, 1, rng, what);
  for (int l = 0; l < t.cpu.config().shape.layers; ++l)
    for (seq_id s : seqs) require_same_store(t.cpu, t.gpu, s, l);
  // a chunk longer than the ring (128) after the stored prefix, then the prefix part alone
  prefill_both(t, 0, 300, rng, what);
  prefill_both(t, 1, 70, rng, what);  // (a chunk within the ring: append + attend)
  prefix_both(t, 2, 40, rng, what);
  step_both(t, seqs, 1, rng, what);
}

TEST_CASE("gpu: a sliding layer long after its first pages were released equals the CPU backend",
          "[gpu][variants][sliding]") {
  const std::string spec = GENERATE(as<std::string>{}, "kivi4/g32", "int8", "k=kivi4/g32,v=kivi2/g32+sink");
  CAPTURE(spec);
  std::mt19937 rng(20261207);
  const int hq = 8, h = 2, d = 128;
  std::vector<float> sinks(static_cast<size_t>(hq));
  for (auto& s : sinks) s = std::normal_distribution<float>(0.f, 1.f)(rng);
  // windows of 1000 (not a multiple of the page) and 4096 tokens over sequences of up to 8K
  twin t = make(spec, hq, h, d, {{}, {1000, 0.f, {}}, {4096, 0.f, sinks}});
  const std::vector<seq_id> seqs = {0, 1};
  const int64_t n_long = small() ? 3000 : 8000;
  check(t.cpu.create_sequence(0));
  check(t.gpu.create_sequence(0));
  check(t.cpu.create_sequence(1));
  check(t.gpu.create_sequence(1));
  fill(t, 0, n_long, rng, 700);
  fill(t, 1, 333, rng);
  step_both(t, seqs, 1, rng, spec);
  step_both(t, seqs, 2, rng, spec);  // (GQA 4: 8 rows a kv head, the decode kernels)
  step_both(t, seqs, 5, rng, spec);  // (20 rows: the tile kernel)
  for (int i = 0; i < (small() ? 3 : 20); ++i) step_both(t, seqs, 1, rng, spec);
  prefill_both(t, 0, 200, rng, spec);
  step_both(t, seqs, 1, rng, spec);
  for (int l = 0; l < 3; ++l)
    for (seq_id s : seqs) require_same_store(t.cpu, t.gpu, s, l);
  CHECK(t.gpu.stats().page_bytes == t.cpu.stats().page_bytes);
}

TEST_CASE("gpu: a replayed decode step applies the layers' attention variants", "[gpu][variants][replay]") {
  const std::string map = GENERATE(as<std::string>{}, "kivi4/g32", "k=kivi4/g32,v=kivi2/g32;0.1=fp16", "int8");
  const int sinks = GENERATE(0, 1);
  CAPTURE(map, sinks);
  cudaStream_t st = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) == cudaSuccess);
  const int Hq = 8, H = 2, D = 128;
  std::mt19937 rng(20261208);
  std::vector<attention_variant> vars = variants(Hq, rng);
  const int L = int(vars.size());
  cache_config cfg;
  cfg.sink_pages = sinks;
  cfg.shape = {L, Hq, H, D, 64, 128, 32};
  cfg.budget_bytes = 128ull << 20;
  cfg.max_sequences = 8;
  cfg.max_tokens = 1024;
  cfg.cpu_threads = 4;
  cfg.attention = vars;
  auto pol = std::make_shared<static_policy>(static_policy::parse(map).value_or_throw());
  KVCache c = KVCache::create(cfg, pol).value_or_throw();  // the CPU's eager steps
  cfg.where = backend::cuda;
  cfg.stream = st;
  cfg.check_values = false;
  {
    KVCache a = KVCache::create(cfg, pol).value_or_throw();
    const std::vector<int64_t> lens = {1, 63, 94, 200, 700};
    const int n = int(lens.size()), max_batch = 6;
    for (int s = 0; s < n; ++s) {
      check(a.create_sequence(s));
      check(c.create_sequence(s));
      const int64_t m = lens[size_t(s)];
      for (int l = 0; l < L; ++l) {
        const auto k = randn_h(rng, size_t(m) * H * D), v = randn_h(rng, size_t(m) * H * D);
        append_same(c, a, s, l, k, v, m);
      }
    }
    decode_step sa = decode_step::create(a, max_batch, 1024).value_or_throw();
    const size_t kv_row = size_t(H) * D, q_row = size_t(Hq) * D;
    const size_t kv_all = size_t(L) * max_batch * kv_row, q_all = size_t(L) * max_batch * q_row;
    dev_mem dk(kv_all * 2), dv(kv_all * 2), dq(q_all * 2), oa(q_all * 4);
    auto at = [&](const dev_mem& m, int l, size_t row, size_t elem) {
      return static_cast<uint8_t*>(m.p) + size_t(l) * max_batch * row * elem;
    };
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    const int steps = small() ? 30 : 120;
    for (int t = 0; t < steps; ++t) {
      std::vector<seq_id> seqs;
      for (int s = 0; s < n; ++s)
        if (!(s == 1 && t % 7 == 3)) seqs.push_back(s);
      const int batch = int(seqs.size());
      const auto k = randn_h(rng, kv_all), v = randn_h(rng, kv_all), q = randn_h(rng, q_all);
      upload(dk, k);
      upload(dv, v);
      upload(dq, q);
      check(sa.prepare(seqs));
      if (t == 0) {
        REQUIRE(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
        for (int l = 0; l < L; ++l) {
          check(sa.append(l, {at(dk, l, kv_row, 2), dtype::f16, max_batch, H, D},
                          {at(dv, l, kv_row, 2), dtype::f16, max_batch, H, D}));
          check(sa.attend(l, {at(dq, l, q_row, 2), dtype::f16, max_batch, Hq, D},
                          {at(oa, l, q_row, 4), dtype::f32, max_batch, Hq, D}));
        }
        REQUIRE(cudaStreamEndCapture(st, &graph) == cudaSuccess);
        REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
      }
      REQUIRE(cudaGraphLaunch(exec, st) == cudaSuccess);
      REQUIRE(cudaStreamSynchronize(st) == cudaSuccess);
      std::vector<append_item> adds;
      std::vector<attend_item> items;
      for (seq_id s : seqs) adds.push_back({s, 1}), items.push_back({s, 1});
      const auto qf = to_float(q);
      bool ok = true;
      for (int l = 0; l < L; ++l) {
        const size_t kv0 = size_t(l) * max_batch * kv_row, q0 = size_t(l) * max_batch * q_row;
        check(c.append_batch(adds, l, {k.data() + kv0, dtype::f16, batch, H, D}, {v.data() + kv0, dtype::f16, batch, H, D}));
        std::vector<float> oc(size_t(batch) * q_row);
        check(c.attend(items, l, {qf.data() + q0, dtype::f32, batch, Hq, D}, {oc.data(), dtype::f32, batch, Hq, D}));
        std::vector<float> og(oc.size());
        REQUIRE(cudaMemcpy(og.data(), at(oa, l, q_row, 4), og.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
        ok = check_close(og, oc, Hq, D,
                         map + " replayed step " + std::to_string(t) + " layer " + std::to_string(l) + " (" +
                             describe(vars[size_t(l)]) + ") batch " + std::to_string(batch)) &&
             ok;
      }
      REQUIRE(ok);
    }
    for (int s = 0; s < n; ++s)
      for (int l = 0; l < L; ++l) require_same_store(c, a, s, l);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(st);
}
