// GPU decode-attention benchmark of kvq's CUDA backend: Llama-8B-like layer (32 query heads,
// 8 kv heads, head_dim 128), batch x context from the peer script's shapes, one format per run;
// and the attention shapes of other models (`decode_shape/<model>/...`: head_dim 64, 128 and 256,
// GQA groups 1 to 8; KVQ_BENCH_MODELS=0 leaves them out, =only runs just them; KVQ_BENCH_SHAPE_FORMATS
// picks their formats), each beside
// peer_decode.py run with the same heads (bench/run_gpu.sh shapes; report: bench/report_shapes.py).
// CUDA-event timing (median over iterations), cold L2 by rotating over sets of sequences larger
// than the L2, bytes processed = the bytes the kernel must read (pages with scales + the FP16
// window part), counters: TB/s and the fraction of the copy-bandwidth floor measured in this run.
// Run beside ../shared/bench/peer_decode.py (see bench/run_gpu.sh) and compare ratios.
// Every format also runs rotated (spec suffix `+rot`: every kv head under the Hadamard rotation,
// docs/architecture.md "Rotation"), beside the same format unrotated, shape by shape;
// KVQ_BENCH_ROTATED=0 leaves the rotated runs out, =only runs just them. A format's `@<n>` suffix
// (after `+rot`, `+sink`): pages of n tokens, 64 without it (e.g. `kivi3/g32@256`).
#include <kvq/cache/cache.hpp>
#include <kvq/cache/config_string.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/static_policy.hpp>

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include "cuda_check.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {

// A layer's attention shape: query heads, kv heads, head_dim.
struct model_shape {
  const char* name;
  int hq, h, d;
};
constexpr model_shape llama8b{"llama3-8b", 32, 8, 128};
// Models from 135M to 70B parameters (their attention layer; head counts as published).
constexpr model_shape model_shapes[] = {
    {"smollm2-135m", 9, 3, 64},  {"llama3.2-1b", 32, 8, 64}, {"llama2-7b", 32, 32, 128}, {"qwen2.5-7b", 28, 4, 128},
    {"llama3-8b", 32, 8, 128},   {"llama3-70b", 64, 8, 128}, {"gemma2-9b", 16, 8, 256},  {"gemma-7b", 16, 16, 256},
};

double copy_bandwidth() {  // bytes read + written per second of a large device-to-device copy
  static double bw = 0;
  if (bw > 0) return bw;
  const size_t bytes = size_t(2) << 30;
  void *a, *b;
  CUDA_CHECK(cudaMalloc(&a, bytes));
  CUDA_CHECK(cudaMalloc(&b, bytes));
  CUDA_CHECK(cudaMemset(a, 1, bytes));
  cudaEvent_t s, e;
  cudaEventCreate(&s);
  cudaEventCreate(&e);
  std::vector<float> t;
  for (int i = 0; i < 12; ++i) {
    cudaEventRecord(s);
    CUDA_CHECK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
    cudaEventRecord(e);
    cudaEventSynchronize(e);
    float ms;
    cudaEventElapsedTime(&ms, s, e);
    if (i >= 2) t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  bw = 2.0 * bytes / (t[t.size() / 2] * 1e-3);
  cudaFree(a);
  cudaFree(b);
  return bw;
}

// `rows` random fp16 tokens of [H][D] (host): normal draws from `nd`, every 16th element (index 3
// mod 16) scaled by `outlier` (1: none). Random data, never zeros.
std::vector<uint16_t> random_rows(std::mt19937& rng, std::normal_distribution<float>& nd, int rows, int H, int D,
                                  float outlier) {
  std::vector<uint16_t> host(size_t(rows) * H * D);
  for (size_t i = 0; i < host.size(); ++i) host[i] = kvq::float_to_half(nd(rng) * ((i % 16) == 3 ? outlier : 1.f));
  return host;
}

// A device copy of host fp16 data (the caller frees it).
void* upload(const std::vector<uint16_t>& host) {
  void* d;
  CUDA_CHECK(cudaMalloc(&d, host.size() * 2));
  CUDA_CHECK(cudaMemcpy(d, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  return d;
}

// Creates sequences 0 .. n-1 of `context` tokens each, one layer: the first rows of the device
// chunks `dk` / `dv` (`chunk` tokens each) appended repeatedly.
void fill(kvq::KVCache& cache, int n, int context, const void* dk, const void* dv, int chunk, int H, int D) {
  for (int s = 0; s < n; ++s) {
    kvq::check(cache.create_sequence(s));
    for (int done = 0; done < context; done += chunk) {
      const int m = std::min(chunk, context - done);
      kvq::check(cache.append(s, 0, {dk, kvq::dtype::f16, m, H, D}, {dv, kvq::dtype::f16, m, H, D}));
    }
  }
}

// Pages alternate between two format pairs, page by page: a layer whose precision moved over time
// (EchoKV's), where every page's formats differ from its neighbours' (the kernels' per-page
// dispatch, not the loop compiled for one format).
class striped_policy final : public kvq::policy {
 public:
  striped_policy(kvq::format_pair a, kvq::format_pair b) : a_(a), b_(b) {}
  std::string name() const override { return "striped"; }
  kvq::status bind(const kvq::cache_shape& shape) override {
    page_ = shape.page_tokens;
    return {};
  }
  kvq::format_id choose(const kvq::page_request& req) override {
    const kvq::format_pair& p = (req.first_token / page_) % 2 ? b_ : a_;
    return req.r == kvq::role::k ? p.k : p.v;
  }
  kvq::format_pair current(int, int) const override { return a_; }

 private:
  kvq::format_pair a_, b_;
  int64_t page_ = 64;
};

// Takes the cache suffixes (`+rot`, `+sink`, `+sink<N>`: kvq::parse_cache_suffixes) off `spec`.
kvq::cache_suffixes strip_suffixes(std::string& spec) {
  kvq::cache_suffixes s = kvq::parse_cache_suffixes(spec).value();
  spec.resize(s.spec.size());
  s.spec = {};  // (viewed the string just cut)
  return s;
}

double pair_bits(const kvq::format_pair& fp, int D) {
  return 0.5 * (kvq::bits_per_element(kvq::traits_of(fp.k), kvq::role::k, 64, D) +
                kvq::bits_per_element(kvq::traits_of(fp.v), kvq::role::v, 64, D));
}

// spec: a format pair, or two joined by '|' (pages alternating between them: `striped_policy`),
// optionally followed by `+rot` and `+sink<N>` (`strip_suffixes`), then by `@<page tokens>` (this
// benchmark's own: pages of that many tokens, 64 without it). window > 0: a sliding layer of
// that many tokens (`attention_variant::window`), whose pages before the window are released as
// the sequences fill; a call reads the window's pages only, so the sets rotating through the L2
// are sized as for a context of the window.
void bm_decode(benchmark::State& state, std::string spec, model_shape m, int batch, int context, int window) {
  const int Hq = m.hq, H = m.h, D = m.d;
  int P = 64;  // page tokens (`@<n>`)
  if (const size_t at = spec.find('@'); at != std::string::npos) {
    P = std::stoi(spec.substr(at + 1));
    spec.resize(at);
  }
  const kvq::cache_suffixes suffixes = strip_suffixes(spec);
  // memory: pages for every set + windows
  const size_t bar = spec.find('|');
  const auto fp = kvq::parse_format_pair(spec.substr(0, bar)).value();
  const auto fp2 = bar == std::string::npos ? fp : kvq::parse_format_pair(spec.substr(bar + 1)).value();
  const double bpe = 0.5 * (pair_bits(fp, D) + pair_bits(fp2, D));
  const int chunk = 4096;  // tokens of an append while filling
  const double set_bytes = double(batch) * (window > 0 ? std::min(context, window) : context) * H * D * 2 * bpe / 8;
  const int sets = int(std::clamp(std::ceil(512e6 / set_bytes), 1.0, 64.0));
  // a sliding layer holds at most its window, the chunk being appended and a page per sequence, and
  // one set more while the next set fills (a global layer's pool: the sets, as before windows)
  const double held_bytes =
      window > 0 ? double(batch) * std::min(context, window + chunk + 128) * H * D * 2 * bpe / 8 * (sets + 1) : 0.0;
  kvq::cache_config cfg;
  cfg.shape = {1, Hq, H, D, P, 2 * P, 64};
  cfg.where = kvq::backend::cuda;
  cfg.max_sequences = batch * sets;
  cfg.max_tokens = context;
  cfg.budget_bytes = uint64_t(std::max(set_bytes * sets, held_bytes) * 1.05) +
                     uint64_t(batch) * sets * (H * 2 * 2 * P * D * 2 + 4096) + (64 << 20);
  if (window > 0) cfg.attention = {kvq::attention_variant{window, 0.f, {}}};
  suffixes.apply(cfg);
  std::shared_ptr<kvq::policy> pol;
  if (bar == std::string::npos) pol = std::make_shared<kvq::static_policy>(fp);
  else pol = std::make_shared<striped_policy>(fp, fp2);
  auto cr = kvq::KVCache::create(cfg, pol);
  if (!cr.ok()) {
    state.SkipWithError(cr.error().to_string().c_str());
    return;
  }
  auto cache = std::move(cr).value();
  // fill: one random fp16 chunk appended repeatedly (random data, never zeros)
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  void* dk = upload(random_rows(rng, nd, chunk, H, D, 5.f));
  fill(cache, batch * sets, context, dk, dk, chunk, H, D);
  void *dq, *dout;
  std::vector<uint16_t> q(size_t(batch) * Hq * D);
  for (auto& x : q) x = kvq::float_to_half(nd(rng));
  CUDA_CHECK(cudaMalloc(&dq, q.size() * 2));
  CUDA_CHECK(cudaMalloc(&dout, q.size() * 2));
  CUDA_CHECK(cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  std::vector<std::vector<kvq::attend_item>> items(static_cast<size_t>(sets));
  for (int s = 0; s < sets; ++s)
    for (int b = 0; b < batch; ++b) items[size_t(s)].push_back({s * batch + b, 1});
  const auto st = cache.stats();
  // bytes one call must read: its set's pages + the ring tokens not in pages
  const int64_t in_pages = (context - P) / P * P;
  const double bytes = double(st.page_bytes) / sets + double(batch) * (context - in_pages) * H * D * 2 * 2;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  int it = 0;
  auto call = [&] {
    kvq::check(cache.attend(items[size_t(it++ % sets)], 0, {dq, kvq::dtype::f16, batch, Hq, D},
                            {dout, kvq::dtype::f16, batch, Hq, D}));
  };
  for (int w = 0; w < 5; ++w) call();
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<double> times;
  for (auto _ : state) {
    cudaEventRecord(e0);
    call();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    state.SetIterationTime(ms * 1e-3);
    times.push_back(ms * 1e-3);
  }
  CUDA_CHECK(cudaGetLastError());
  std::sort(times.begin(), times.end());
  const double med = times[times.size() / 2];
  state.SetBytesProcessed(int64_t(bytes * double(state.iterations())));
  state.counters["median_us"] = med * 1e6;
  state.counters["TBps"] = bytes / med / 1e12;
  state.counters["floor_frac"] = (bytes / copy_bandwidth()) / med;
  state.counters["bits"] = st.page_bits();
  state.counters["hq"] = Hq;
  state.counters["hkv"] = H;
  state.counters["d"] = D;
  state.counters["sets"] = sets;
  state.counters["window"] = window;
  cudaFree(dk);
  cudaFree(dq);
  cudaFree(dout);
}

// One decode step's cache writes for a batch: one new token (K and V) appended to each of `batch`
// sequences of `context` tokens, one layer, by one `KVCache::append_batch` call (append_us) and,
// for comparison, by one `KVCache::append` call per sequence (append_each_us); value checks off
// (the synchronization-free path an engine would take). The same step's attention over the batch
// is timed in the same process; append_frac = batched append time / attention time is the
// quantity the 5 % goal is about. Each iteration appends 2 tokens per sequence (both paths).
void bm_append_step(benchmark::State& state, std::string spec, int batch, int context) {
  constexpr int Hq = llama8b.hq, H = llama8b.h, D = llama8b.d;
  const kvq::cache_suffixes suffixes = strip_suffixes(spec);
  const auto fp = kvq::parse_format_pair(spec).value();
  const double bpe = pair_bits(fp, D);
  const int steps = 512;  // tokens appended at most (warm-up: two per step; iterations: three)
  kvq::cache_config cfg;
  cfg.shape = {1, Hq, H, D, 64, 128, 64};
  cfg.where = kvq::backend::cuda;
  cfg.max_sequences = batch;
  cfg.max_tokens = context + steps;
  cfg.check_values = false;
  cfg.budget_bytes = uint64_t(double(batch) * (context + steps) * H * D * 2 * bpe / 8 * 1.1) +
                     uint64_t(batch) * (H * 2 * 128 * D * 2 + 4096) + (64 << 20);
  suffixes.apply(cfg);
  auto cr = kvq::KVCache::create(cfg, std::make_shared<kvq::static_policy>(fp));
  if (!cr.ok()) {
    state.SkipWithError(cr.error().to_string().c_str());
    return;
  }
  auto cache = std::move(cr).value();
  const int chunk = 4096;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  const std::vector<uint16_t> host = random_rows(rng, nd, chunk, H, D, 1.f);
  void* dk = upload(host);
  fill(cache, batch, context, dk, dk, chunk, H, D);
  void *dq, *dout;
  CUDA_CHECK(cudaMalloc(&dq, size_t(batch) * Hq * D * 2));
  CUDA_CHECK(cudaMalloc(&dout, size_t(batch) * Hq * D * 2));
  CUDA_CHECK(cudaMemcpy(dq, host.data(), size_t(batch) * Hq * D * 2, cudaMemcpyHostToDevice));
  std::vector<kvq::attend_item> items;
  for (int b = 0; b < batch; ++b) items.push_back({b, 1});
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  auto since_e0 = [&] {  // seconds from e0 to now on the stream
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    return double(ms) * 1e-3;
  };
  auto timed = [&](auto&& f) {
    cudaEventRecord(e0);
    f();
    return since_e0();
  };
  int row = 0;
  auto each_step = [&] {  // one append call per sequence
    const kvq::tensor_view one{static_cast<const uint16_t*>(dk) + size_t(row++ % chunk) * H * D, kvq::dtype::f16, 1, H, D};
    for (int b = 0; b < batch; ++b) kvq::check(cache.append(b, 0, one, one));
  };
  std::vector<kvq::append_item> adds;
  for (int b = 0; b < batch; ++b) adds.push_back({b, 1});
  auto append_step = [&] {  // one append_batch call for the batch
    const int at = (row++ % (chunk / batch)) * batch;
    const kvq::tensor_view rows{static_cast<const uint16_t*>(dk) + size_t(at) * H * D, kvq::dtype::f16, batch, H, D};
    kvq::check(cache.append_batch(adds, 0, rows, rows));
  };
  auto attend_step = [&] {
    kvq::check(cache.attend(items, 0, {dq, kvq::dtype::f16, batch, Hq, D}, {dout, kvq::dtype::f16, batch, Hq, D}));
  };
  for (int w = 0; w < 5; ++w) append_step(), each_step(), attend_step();
  CUDA_CHECK(cudaDeviceSynchronize());
  // Behind the attention of the previous step (the stream busy, as in an engine's decode loop): the
  // host work of the call overlaps the GPU, and the events enclose the append's device work only.
  auto busy = [&] {
    attend_step();
    cudaEventRecord(e0);
    append_step();
    return since_e0();
  };
  std::vector<double> ta, te, tt, tb;
  for (auto _ : state) {
    const double a = timed(append_step);
    state.SetIterationTime(a);
    ta.push_back(a);
    te.push_back(timed(each_step));
    tt.push_back(timed(attend_step));
    tb.push_back(busy());
  }
  CUDA_CHECK(cudaGetLastError());
  auto median = [](std::vector<double>& x) {
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
  };
  const double a = median(ta), e = median(te), t = median(tt), b = median(tb);
  state.counters["append_us"] = a * 1e6;
  state.counters["append_busy_us"] = b * 1e6;
  state.counters["append_busy_frac"] = b / t;
  state.counters["append_each_us"] = e * 1e6;
  state.counters["attend_us"] = t * 1e6;
  state.counters["append_frac"] = a / t;
  state.counters["append_each_frac"] = e / t;
  cudaFree(dk);
  cudaFree(dq);
  cudaFree(dout);
}

const int registered = [] {
  // A ';'-separated list from the environment variable `name`, else `fallback`.
  const auto formats_from = [](const char* name, std::vector<std::string> fallback) {
    const char* env = std::getenv(name);
    if (!env) return fallback;
    std::vector<std::string> out;
    std::string s = env;
    for (size_t p = 0; p <= s.size();) {
      const size_t q = s.find(';', p);
      out.push_back(s.substr(p, q == std::string::npos ? std::string::npos : q - p));
      if (q == std::string::npos) break;
      p = q + 1;
    }
    return out;
  };
  // (cb4, cb2: codebook kinds, nvfp4, beside kivi4 / kivi2 at the same bits; kivi3: the 3-bit kind)
  std::vector<std::string> formats =
      formats_from("KVQ_BENCH_FORMATS", {"fp16", "sym8", "kivi8/g32", "fp8", "kivi4/g32", "k=kivi4/g32,v=kivi2/g32",
                                         "kivi2/g32", "kivi4/g32|kivi2/g32", "cb4", "cb2", "kivi3/g32", "nvfp4"});
  const char* rot_env = std::getenv("KVQ_BENCH_ROTATED");
  const std::string rot = rot_env ? rot_env : "";
  std::vector<std::string> runs;  // each format, then (unless excluded) the same rotated
  for (const auto& f : formats) {
    if (rot != "only") runs.push_back(f);
    if (rot != "0" && f.find("+rot") == std::string::npos) runs.push_back(f + "+rot");
  }
  formats = runs;
  const char* models_env = std::getenv("KVQ_BENCH_MODELS");
  const std::string models = models_env ? models_env : "";
  const std::pair<int, int> shapes[] = {{1, 4096}, {8, 4096}, {32, 4096}, {1, 32768}, {8, 32768}, {32, 32768}, {1, 131072}, {8, 131072}};
  if (models != "only")
    for (const auto& f : formats)
      for (auto [b, l] : shapes)
        benchmark::RegisterBenchmark(("decode/" + f + "/B" + std::to_string(b) + "/L" + std::to_string(l)).c_str(),
                                     bm_decode, f, llama8b, b, l, 0)
            ->UseManualTime()
            ->Iterations(100)
            ->Unit(benchmark::kMicrosecond);
  // A sliding layer (Gemma, Mistral, gpt-oss): a 4096-token window over 8 x 32K, which reads the
  // bytes of the 8 x 4K row; named to sort beside the 8 x 32K and 8 x 4K rows of its format
  // (bench/report_decode.py prints its time over the 8 x 4K row's).
  if (models != "only")
    for (const char* f : {"kivi4/g32", "kivi2/g32", "sym8", "fp8", "fp16"})
      if (std::find(formats.begin(), formats.end(), std::string(f)) != formats.end())
        benchmark::RegisterBenchmark(("decode/" + std::string(f) + "/B8/L32768/W4096").c_str(), bm_decode,
                                     std::string(f), llama8b, 8, 32768, 4096)
            ->UseManualTime()
            ->Iterations(100)
            ->Unit(benchmark::kMicrosecond);
  // Other models' shapes: the formats of each bit width and decode family the kernels stage (the
  // codebooks and nvfp4 for their level lookups), at a short and a long
  // context (KVQ_BENCH_SHAPE_FORMATS, a list as KVQ_BENCH_FORMATS's, replaces them: e.g. formats
  // with and without `+sink`). Each also rotated (`<format>+rot`), as the formats above, unless
  // KVQ_BENCH_ROTATED excludes it.
  const std::pair<int, int> model_contexts[] = {{8, 4096}, {8, 32768}};
  std::vector<std::string> shape_formats;
  for (const std::string& f : formats_from("KVQ_BENCH_SHAPE_FORMATS", {"fp16", "fp8", "int8", "kivi8/g32", "kivi4/g32",
                                                                      "kivi3/g32", "kivi2/g32", "cb4", "cb2", "nvfp4"})) {
    if (rot != "only") shape_formats.push_back(f);
    if (rot != "0" && f.find("+rot") == std::string::npos) shape_formats.push_back(f + "+rot");
  }
  if (models != "0")
    for (const model_shape& m : model_shapes)
      for (const std::string& f : shape_formats)
        for (auto [b, l] : model_contexts)
          benchmark::RegisterBenchmark(
              ("decode_shape/" + std::string(m.name) + "/" + f + "/B" + std::to_string(b) + "/L" + std::to_string(l))
                  .c_str(),
              bm_decode, f, m, b, l, 0)
              ->UseManualTime()
              ->Iterations(100)
              ->Unit(benchmark::kMicrosecond);
  for (const char* f : {"kivi4/g32", "fp16", "kivi4/g32+rot"})
    for (int l : {4096, 32768})
      benchmark::RegisterBenchmark(("append_step/" + std::string(f) + "/B64/L" + std::to_string(l)).c_str(), bm_append_step, f, 64, l)
          ->UseManualTime()
          ->Iterations(100)
          ->Unit(benchmark::kMicrosecond);
  return 0;
}();

}  // namespace

BENCHMARK_MAIN();
