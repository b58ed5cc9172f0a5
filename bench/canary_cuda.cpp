// Cost of EchoKV's device canary on a Llama-8B-like stack (32 layers, 32 query heads, 8 kv heads,
// head_dim 128, CUDA backend, kivi4/g32 pages, EchoKV's default tiers), batch 1 and 8 at a 32K
// context. A decode step = for every layer: one append_batch of a token per sequence, then one attend of
// the batch. The policy is wrapped so that one cache runs four modes, in interleaved blocks of
// steps (so that clock and context drift cancel):
//   frozen  no canary (the baseline),
//   quiet   the controller's host work of every call (observation counts, the canary RNG) with
//           no canary ever due: (quiet - frozen) is what a live controller costs besides canaries,
//   live    the controller at its rate (1/64): the real A/B against frozen,
//   one     the first sequence's canary on every step (a canary step with one item due),
//   all     every sequence's canary on every step.
// The canary alone costs (one - frozen) per canary step; at rate r the expected overhead is
// P(a step has a canary) x that / frozen step time, with P = 1 - (1 - r)^batch (= r at batch 1),
// printed beside the direct (live - frozen) difference and its standard error, against the
// 0.1 % target (docs/performance.md). The step here is attention and append only: a real model
// step (weights, GEMMs) is several times longer, so the real overhead is lower still.
//   kvq_bench_canary_cuda [--batches 1,8] [--context 32768] [--steps 640] [--block 16] [--json PATH]
#include <kvq/cache/cache.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/echokv.hpp>

#include <cuda_runtime.h>

#include "cuda_check.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {


constexpr int layers = 32, Hq = 32, H = 8, D = 128;

enum mode { frozen, quiet, live, one, all, modes };
const char* const mode_names[modes] = {"frozen", "quiet", "live", "one", "all"};

// EchoKV behind a switch that decides which steps are canaries; everything else is EchoKV's.
class switched_policy final : public kvq::policy, public kvq::canary_protocol {
 public:
  explicit switched_policy(std::shared_ptr<kvq::echokv_policy> p) : p_(std::move(p)) {}
  std::string name() const override { return "switched(" + p_->name() + ")"; }
  kvq::status bind(const kvq::cache_shape& s) override { return p_->bind(s); }
  kvq::format_id choose(const kvq::page_request& r) override { return p_->choose(r); }
  kvq::format_pair current(int l, int h) const override { return p_->current(l, h); }
  bool wants_queries() const override { return true; }
  kvq::canary_protocol* canary() override { return this; }
  const kvq::canary_spec* device_canary() const override { return p_->device_canary(); }
  bool canary_due(kvq::seq_id s, int64_t n) const override {
    switch (m_) {
      case quiet:
        (void)p_->canary_due(s, n);  // the decision is paid for (an out-of-line call), then dropped
        return false;
      case live: return p_->canary_due(s, n);
      case one: return s == 0;
      case all: return true;
      default: return false;
    }
  }
  void note_observation() override {
    if (m_ != frozen) p_->note_observation();
  }
  void note_skipped() override { p_->note_skipped(); }
  kvq::status ingest(const kvq::canary_measurement& m) override { return p_->ingest(m); }
  mode m_ = frozen;

 private:
  std::shared_ptr<kvq::echokv_policy> p_;
};

struct result {
  int batch = 0;
  double step_ms[modes] = {};
  int steps[modes] = {};
  double live_canary_frac = 0;  // live steps with at least one canary launch
  double diff_sem_ms = 0;       // standard error of the paired live - frozen block difference
  double quiet_sem_ms = 0;      // the same for quiet - frozen
  double one_sem_ms = 0;        // the same for one - frozen (the canary step extra)
  double flush_one_ms = 0, flush_frozen_ms = 0;  // the canary launch's own time on the stream
  double expected_p = 0, modeled_pct = 0, direct_pct = 0, quiet_pct = 0, extra_one_ms = 0, extra_all_ms = 0;
};

// Standard error of the mean.
double sem(const std::vector<double>& x) {
  if (x.size() < 2) return 0;
  double mean = 0, var = 0;
  for (double v : x) mean += v / double(x.size());
  for (double v : x) var += (v - mean) * (v - mean) / double(x.size() - 1);
  return std::sqrt(var / double(x.size()));
}

result run(int batch, int context, int steps_per_mode, int block) {
  result r;
  r.batch = batch;
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  kvq::echokv_options o;  // tiers kivi2/4/8 g32, rate 1/64
  o.initial_tier = 1;     // kivi4/g32 pages
  auto echo = std::make_shared<kvq::echokv_policy>(o);
  auto pol = std::make_shared<switched_policy>(echo);
  const int64_t total = context + int64_t(steps_per_mode + 2 * block) * modes + 64;
  kvq::cache_config cfg;
  cfg.shape = {layers, Hq, H, D, 64, 128, 64};
  cfg.where = kvq::backend::cuda;
  cfg.stream = stream;
  cfg.check_values = false;  // no synchronization on the append path
  cfg.max_sequences = batch;
  cfg.max_tokens = total;
  // the worst case: every page promoted to kivi8/g32 (9 bits per element), plus the windows
  cfg.budget_bytes = uint64_t(double(batch) * layers * total * H * D * 2 * 9.0 / 8 * 1.05) +
                     uint64_t(batch) * layers * H * 2 * 128 * D * 2 + (256ull << 20);
  auto cache = kvq::KVCache::create(cfg, pol).value_or_throw();

  const int chunk = 4096;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<uint16_t> host(size_t(chunk) * H * D);
  for (size_t i = 0; i < host.size(); ++i) host[i] = kvq::float_to_half(nd(rng) * ((i % 16) == 3 ? 5.f : 1.f));
  void *dk, *dv, *dq, *dout;
  CUDA_CHECK(cudaMalloc(&dk, host.size() * 2));
  CUDA_CHECK(cudaMemcpy(dk, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  for (auto& x : host) x = kvq::float_to_half(nd(rng));
  CUDA_CHECK(cudaMalloc(&dv, host.size() * 2));
  CUDA_CHECK(cudaMemcpy(dv, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  for (int s = 0; s < batch; ++s) {
    kvq::check(cache.create_sequence(s));
    for (int l = 0; l < layers; ++l)
      for (int done = 0; done < context; done += chunk) {
        const int n = std::min(chunk, context - done);
        kvq::check(cache.append(s, l, {dk, kvq::dtype::f16, n, H, D}, {dv, kvq::dtype::f16, n, H, D}));
      }
    CUDA_CHECK(cudaStreamSynchronize(stream));
    std::fprintf(stderr, "batch %d: filled sequence %d of %d to %d tokens x %d layers\n", batch, s + 1, batch, context,
                 layers);
  }
  std::vector<uint16_t> q(size_t(batch) * Hq * D);
  for (auto& x : q) x = kvq::float_to_half(nd(rng));
  CUDA_CHECK(cudaMalloc(&dq, q.size() * 2));
  CUDA_CHECK(cudaMalloc(&dout, q.size() * 2));
  CUDA_CHECK(cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  std::vector<kvq::attend_item> items;
  std::vector<kvq::append_item> adds;
  for (int b = 0; b < batch; ++b) items.push_back({b, 1}), adds.push_back({b, 1});

  auto decode_step = [&] {
    for (int l = 0; l < layers; ++l) {
      // row b of the K/V buffers: different tokens per sequence, one append_batch for the batch
      kvq::check(cache.append_batch(adds, l, {dk, kvq::dtype::f16, batch, H, D}, {dv, kvq::dtype::f16, batch, H, D}));
      kvq::check(cache.attend(items, l, {dq, kvq::dtype::f16, batch, Hq, D}, {dout, kvq::dtype::f16, batch, Hq, D}));
    }
  };
  cudaEvent_t e0, e1, f0, f1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  CUDA_CHECK(cudaEventCreate(&f0));
  CUDA_CHECK(cudaEventCreate(&f1));
  // In `one` and `frozen` blocks, the middle step's canary is launched explicitly right after the
  // step (flush_policy, which the next step's first append would otherwise do) between two
  // events: the canary's own time on the stream (frozen: the empty flush, the events' floor).
  double flush_ms[modes] = {};
  int flushes[modes] = {};
  double sum_ms[modes] = {};
  std::vector<double> diffs, quiet_diffs, one_diffs;  // live, quiet and one - frozen per round, ms per step
  int live_with_canary = 0;
  const int rounds = steps_per_mode / block + 2;  // the first 2 rounds warm up
  for (int round = 0; round < rounds; ++round) {
    double block_ms[modes] = {};
    for (int i = 0; i < modes; ++i) {
      const int m = round % 2 ? modes - 1 - i : i;  // the order alternates: drift does not favour a mode
      pol->m_ = mode(m);
      int canary_steps = 0;
      CUDA_CHECK(cudaEventRecord(e0, stream));
      for (int s = 0; s < block; ++s) {
        if (m == live) {
          const int64_t n = cache.length(0, 0) + 1;  // the context the step's attend sees
          bool any = false;
          for (int b = 0; b < batch; ++b) any = any || echo->canary_due(b, n);
          canary_steps += any;
        }
        decode_step();
        if (s == block / 2 && (m == one || m == frozen)) {
          CUDA_CHECK(cudaEventRecord(f0, stream));
          kvq::check(cache.flush_policy());
          CUDA_CHECK(cudaEventRecord(f1, stream));
        }
      }
      // The block's last canary launches inside its time; the host ingestion of the block's
      // measurements does not (sync_policy after the stop event: in a running engine the host is
      // ahead of the GPU and ingests while the GPU works, here the block's end would idle the GPU).
      kvq::check(cache.flush_policy());
      CUDA_CHECK(cudaEventRecord(e1, stream));
      CUDA_CHECK(cudaEventSynchronize(e1));
      kvq::check(cache.sync_policy());
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (round >= 2 && (m == one || m == frozen)) {
        float fm = 0;
        CUDA_CHECK(cudaEventElapsedTime(&fm, f0, f1));
        flush_ms[m] += fm;
        ++flushes[m];
      }
      if (round < 2) continue;
      block_ms[m] = ms / block;
      sum_ms[m] += ms;
      r.steps[m] += block;
      if (m == live) live_with_canary += canary_steps;
    }
    if (round >= 2) {
      diffs.push_back(block_ms[live] - block_ms[frozen]);
      quiet_diffs.push_back(block_ms[quiet] - block_ms[frozen]);
      one_diffs.push_back(block_ms[one] - block_ms[frozen]);
    }
    if (round >= 2 && round % 8 == 0)
      std::fprintf(stderr, "batch %d: round %d of %d, context %lld\n", batch, round, rounds,
                   static_cast<long long>(cache.length(0, 0)));
  }
  for (int m = 0; m < modes; ++m) r.step_ms[m] = sum_ms[m] / std::max(1, r.steps[m]);
  r.diff_sem_ms = sem(diffs);
  r.quiet_sem_ms = sem(quiet_diffs);
  r.one_sem_ms = sem(one_diffs);
  r.live_canary_frac = double(live_with_canary) / std::max(1, r.steps[live]);
  r.expected_p = 1.0 - std::pow(1.0 - o.rate, batch);
  r.extra_one_ms = r.step_ms[one] - r.step_ms[frozen];
  r.extra_all_ms = r.step_ms[all] - r.step_ms[frozen];
  r.modeled_pct = 100.0 * r.expected_p * r.extra_one_ms / r.step_ms[frozen];
  r.direct_pct = 100.0 * (r.step_ms[live] - r.step_ms[frozen]) / r.step_ms[frozen];
  r.quiet_pct = 100.0 * (r.step_ms[quiet] - r.step_ms[frozen]) / r.step_ms[frozen];
  const auto& c = echo->counters();
  std::printf("\nbatch %d, context %d..%lld, %d layers, kivi4/g32 pages, %s\n", batch, context,
              static_cast<long long>(cache.length(0, 0)), layers, echo->name().c_str());
  for (int m = 0; m < modes; ++m)
    std::printf("  %-7s %8.4f ms per decode step (%d steps)\n", mode_names[m], r.step_ms[m], r.steps[m]);
  std::printf("  canary step extra: one item due %+.4f ms +- %.4f ms (1 s.e.), all %d due %+.4f ms\n", r.extra_one_ms,
              r.one_sem_ms, batch, r.extra_all_ms);
  std::printf("  live steps with a canary: %.4f (expected 1-(1-r)^B = %.4f); echokv: %llu canary steps, %llu "
              "evaluations\n",
              r.live_canary_frac, r.expected_p, static_cast<unsigned long long>(c.canary_steps),
              static_cast<unsigned long long>(c.canary_evaluations));
  std::printf("  overhead modeled  P x extra(one) / step = %.4f %% +- %.4f %%   (target <= 0.1 %%: %s)\n", r.modeled_pct,
              100.0 * r.expected_p * r.one_sem_ms / r.step_ms[frozen], r.modeled_pct <= 0.1 ? "met" : "NOT met");
  std::printf("  overhead direct   (live - frozen) / step = %.4f %% +- %.4f %% (1 s.e., %zu block pairs)\n",
              r.direct_pct, 100.0 * r.diff_sem_ms / r.step_ms[frozen], diffs.size());
  std::printf("  host work alone   (quiet - frozen) / step = %.4f %% +- %.4f %%\n", r.quiet_pct,
              100.0 * r.quiet_sem_ms / r.step_ms[frozen]);
  r.flush_one_ms = flush_ms[one] / std::max(1, flushes[one]);
  r.flush_frozen_ms = flush_ms[frozen] / std::max(1, flushes[frozen]);
  std::printf("  canary launch on the stream (one item due): %.4f ms (empty flush: %.4f ms; %d samples); "
              "P x that / step = %.4f %%\n",
              r.flush_one_ms, r.flush_frozen_ms, flushes[one], 100.0 * r.expected_p * r.flush_one_ms / r.step_ms[frozen]);
  std::fflush(stdout);
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(dq);
  cudaFree(dout);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaEventDestroy(f0);
  cudaEventDestroy(f1);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return r;
}

std::vector<int> parse_list(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p;) {
    v.push_back(std::atoi(p));
    const char* c = std::strchr(p, ',');
    if (!c) break;
    p = c + 1;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> batches = {1, 8};
  int context = 32768, steps = 640, block = 16;
  const char* json = nullptr;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--batches") batches = parse_list(argv[i + 1]);
    else if (a == "--context") context = std::atoi(argv[i + 1]);
    else if (a == "--steps") steps = std::atoi(argv[i + 1]);
    else if (a == "--block") block = std::atoi(argv[i + 1]);
    else if (a == "--json") json = argv[i + 1];
    else {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::fprintf(stderr, "kvq_bench_canary_cuda needs a CUDA device\n");
    return 77;
  }
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("EchoKV device canary cost on %s: %d steps per mode in blocks of %d\n", prop.name, steps, block);
  std::vector<result> rs;
  for (int b : batches) rs.push_back(run(b, context, steps, block));
  if (json) {
    FILE* f = std::fopen(json, "w");
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", json);
      return 1;
    }
    std::fprintf(f, "{\"device\": \"%s\", \"context\": %d, \"steps_per_mode\": %d, \"block\": %d, \"runs\": [", prop.name,
                 context, steps, block);
    for (size_t i = 0; i < rs.size(); ++i) {
      const result& r = rs[i];
      std::fprintf(f,
                   "%s\n {\"batch\": %d, \"frozen_ms\": %.6f, \"live_ms\": %.6f, \"one_ms\": %.6f, \"all_ms\": %.6f, "
                   "\"extra_one_ms\": %.6f, \"extra_one_sem_ms\": %.6f, \"extra_all_ms\": %.6f, \"live_canary_frac\": %.6f, \"expected_p\": %.6f, "
                   "\"overhead_modeled_pct\": %.6f, \"overhead_direct_pct\": %.6f, \"direct_sem_pct\": %.6f, "
                   "\"quiet_ms\": %.6f, \"host_work_pct\": %.6f, \"host_work_sem_pct\": %.6f, "
                   "\"canary_launch_ms\": %.6f, \"empty_flush_ms\": %.6f, "
                   "\"target_pct\": 0.1}",
                   i ? "," : "", r.batch, r.step_ms[frozen], r.step_ms[live], r.step_ms[one], r.step_ms[all],
                   r.extra_one_ms, r.one_sem_ms, r.extra_all_ms, r.live_canary_frac, r.expected_p, r.modeled_pct, r.direct_pct,
                   100.0 * r.diff_sem_ms / r.step_ms[frozen], r.step_ms[quiet], r.quiet_pct,
                   100.0 * r.quiet_sem_ms / r.step_ms[frozen], r.flush_one_ms, r.flush_frozen_ms);
    }
    std::fprintf(f, "\n]}\n");
    std::fclose(f);
  }
  return 0;
}
