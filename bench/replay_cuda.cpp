// A decode step replayed from one CUDA graph (`decode_step`) against the same step's eager calls,
// on a Llama-8B-like stack (32 layers, 32 query heads, 8 kv heads, head_dim 128, CUDA backend,
// kivi4/g32 pages): two caches of the same contents, eager steps on one and replayed steps on the
// other, in interleaved blocks (so that clock drift cancels and block k of each kind covers the
// same context lengths: a step's time depends on them), after 0.5 s of graph replays that bring
// the GPU's clocks up from idle. A step is, for every layer, the new token of every sequence
// appended and the batch attended: eager, `append_batch` + `attend` per layer (2 + 4 launches
// per layer from the host); replayed, `prepare` on the host (bookkeeping and one descriptor copy)
// and one graph launch. Time per step: wall time over a block of steps from the host's first
// call to the stream's end, so host launch costs count where the GPU waits for them. The
// replayed step plans its splits for `max_tokens` (context + steps), the eager one for the batch's
// longest sequence; both run the block-staged kernel (the policy's widest format, 4 bits).
// Diagnostics: KVQ_REPLAY_PARTS=1 times the graph's attention and append launches apart (and in
// other orders) at the same lengths as the eager attention; KVQ_REPLAY_TRACE=1 prints each step's
// host time and GPU span over a block of each kind.
//   kvq_bench_replay_cuda [--batch 8] [--context 32768] [--steps 256] [--block 16]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <kvq/cache/cache.hpp>
#include <kvq/cache/decode_step.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/static_policy.hpp>
#include <random>
#include <string>
#include <vector>

#include "cuda_check.hpp"

namespace {

constexpr int layers = 32, Hq = 32, H = 8, D = 128;

struct device_halves {
  explicit device_halves(size_t n) { CUDA_CHECK(cudaMalloc(&p, n * 2)); }
  ~device_halves() { cudaFree(p); }
  device_halves(const device_halves&) = delete;
  device_halves& operator=(const device_halves&) = delete;
  void* p = nullptr;
};

double mean(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += v;
  return s / double(x.size());
}

double stderr_of(const std::vector<double>& x) {
  const double m = mean(x);
  double s = 0;
  for (double v : x) s += (v - m) * (v - m);
  return std::sqrt(s / double(x.size() - 1) / double(x.size()));
}

}  // namespace

int main(int argc, char** argv) {
  int batch = 8, context = 32768, steps = 256, block = 16;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (a == "--batch")
      batch = v;
    else if (a == "--context")
      context = v;
    else if (a == "--steps")
      steps = v;
    else if (a == "--block")
      block = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
  }
  if (batch < 1 || batch > 256 || context < 1 || steps < 2 * block || block < 1) {
    std::fprintf(stderr, "need 1 <= batch <= 256, context >= 1, block >= 1, steps >= 2 x block\n");
    return 2;
  }
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  kvq::cache_config cfg;
  cfg.shape = {layers, Hq, H, D, 64, 128, 32};
  cfg.where = kvq::backend::cuda;
  cfg.max_sequences = batch;
  cfg.max_tokens = context + steps + 128;  // (the timed steps, then the step parts' 60 and a trace's 16)
  cfg.stream = stream;
  cfg.check_values = false;
  // kivi4/g32: 5 bits per element with its scales and zeros; a ring block (16.8 MB) and slack per sequence
  cfg.budget_bytes = uint64_t(batch) * (uint64_t(cfg.max_tokens) * layers * H * D * 2 * 5 / 8 + (24ull << 20));
  auto pol = kvq::static_policy::parse("kivi4/g32").value_or_throw();
  // two caches of the same contents: eager steps on one, replayed steps on the other, so that both
  // kinds of step run at the same context lengths (a step's time depends on them)
  kvq::KVCache eager_cache = kvq::KVCache::create(cfg, std::make_shared<kvq::static_policy>(pol)).value_or_throw();
  kvq::KVCache replay_cache = kvq::KVCache::create(cfg, std::make_shared<kvq::static_policy>(pol)).value_or_throw();
  {  // the context: the same random tokens in every sequence and layer (speed does not depend on them)
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    std::vector<uint16_t> h(size_t(context) * H * D);
    for (auto& x : h) x = kvq::float_to_half(nd(rng));
    device_halves kv(h.size());
    CUDA_CHECK(cudaMemcpy(kv.p, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    const kvq::tensor_view t{kv.p, kvq::dtype::f16, context, H, D};
    for (kvq::KVCache* cache : {&eager_cache, &replay_cache})
      for (int s = 0; s < batch; ++s) {
        kvq::check(cache->create_sequence(s));
        for (int l = 0; l < layers; ++l) kvq::check(cache->append(s, l, t, t));
      }
    CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  device_halves k(size_t(layers) * batch * H * D), v(size_t(layers) * batch * H * D),
      q(size_t(layers) * batch * Hq * D), o(size_t(layers) * batch * Hq * D);
  CUDA_CHECK(cudaMemset(k.p, 0, size_t(layers) * batch * H * D * 2));
  CUDA_CHECK(cudaMemset(v.p, 0, size_t(layers) * batch * H * D * 2));
  CUDA_CHECK(cudaMemset(q.p, 0, size_t(layers) * batch * Hq * D * 2));
  auto rows = [&](const device_halves& m, int l, int heads) {
    return static_cast<uint16_t*>(m.p) + size_t(l) * batch * heads * D;
  };
  std::vector<kvq::seq_id> seqs;
  std::vector<kvq::append_item> adds;
  std::vector<kvq::attend_item> items;
  for (int s = 0; s < batch; ++s) seqs.push_back(s), adds.push_back({s, 1}), items.push_back({s, 1});
  auto eager_step = [&] {
    for (int l = 0; l < layers; ++l) {
      const kvq::tensor_view kr{rows(k, l, H), kvq::dtype::f16, batch, H, D},
          vr{rows(v, l, H), kvq::dtype::f16, batch, H, D};
      kvq::check(eager_cache.append_batch(adds, l, kr, vr));
      kvq::check(eager_cache.attend(items, l, {rows(q, l, Hq), kvq::dtype::f16, batch, Hq, D},
                              kvq::tensor_mut{rows(o, l, Hq), kvq::dtype::f16, batch, Hq, D}));
    }
  };
  kvq::decode_step step = kvq::decode_step::create(replay_cache, batch, cfg.max_tokens).value_or_throw();
  kvq::check(step.prepare(seqs));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int l = 0; l < layers; ++l) {
    kvq::check(
        step.append(l, {rows(k, l, H), kvq::dtype::f16, batch, H, D}, {rows(v, l, H), kvq::dtype::f16, batch, H, D}));
    kvq::check(step.attend(l, {rows(q, l, Hq), kvq::dtype::f16, batch, Hq, D},
                           kvq::tensor_mut{rows(o, l, Hq), kvq::dtype::f16, batch, Hq, D}));
  }
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_CHECK(cudaGraphLaunch(exec, stream));
  // host time of the replayed step's two calls, summed over the timed steps
  double prepare_us = 0, launch_us = 0;
  int replays = 0;
  auto replay_step = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    kvq::check(step.prepare(seqs));
    const auto t1 = std::chrono::steady_clock::now();
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    const auto t2 = std::chrono::steady_clock::now();
    prepare_us += std::chrono::duration<double, std::micro>(t1 - t0).count();
    launch_us += std::chrono::duration<double, std::micro>(t2 - t1).count();
    ++replays;
  };
  eager_step();  // warm-up: the eager workspace
  CUDA_CHECK(cudaStreamSynchronize(stream));
  replay_step();
  CUDA_CHECK(cudaStreamSynchronize(stream));
  {  // the GPU's clocks up from idle first: the prepared graph replayed for 0.5 s (the context stays)
    const auto t0 = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(500)) {
      for (int i = 0; i < 4; ++i) CUDA_CHECK(cudaGraphLaunch(exec, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
    }
  }
  prepare_us = launch_us = 0, replays = 0;
  std::vector<double> eager_us, replay_us;
  for (int done = 0; done + 2 * block <= steps; done += 2 * block)
    for (int i = 0; i < 2; ++i) {
      const int kind = i;  // (E R E R ...: block k of each kind covers the same context lengths)
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < block; ++i) kind == 0 ? eager_step() : replay_step();
      CUDA_CHECK(cudaStreamSynchronize(stream));
      const double us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / block;
      (kind == 0 ? eager_us : replay_us).push_back(us);
    }
  const double e = mean(eager_us), r = mean(replay_us);
  std::printf(
      "batch %d context %d: eager step %.1f us (+- %.1f), replayed step %.1f us (+- %.1f), replay / eager %.3f "
      "(%zu blocks of %d steps each)\n",
      batch, context, e, stderr_of(eager_us), r, stderr_of(replay_us), r / e, eager_us.size(), block);
  // The steps' parts. Host: `prepare` alone and an eager step's calls alone, each issued with the
  // stream idle (nothing to wait for; the eager calls only queue their kernels). GPU: the graph
  // replayed back to back, events around 8 replays issued at once (each rewrites the step it was
  // prepared for: the same kernels over the same tables), so the GPU never waits for the host.
  cudaEvent_t ev0, ev1;
  CUDA_CHECK(cudaEventCreate(&ev0));
  CUDA_CHECK(cudaEventCreate(&ev1));
  std::vector<double> prepare_alone, eager_issue;
  const auto since = [](auto t0) {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  };
  for (int i = 0; i < 8; ++i) {
    CUDA_CHECK(cudaStreamSynchronize(stream));
    auto t0 = std::chrono::steady_clock::now();
    kvq::check(step.prepare(seqs));
    prepare_alone.push_back(since(t0));
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    t0 = std::chrono::steady_clock::now();
    eager_step();
    eager_issue.push_back(since(t0));
  }
  // GPU time per step of 8 steps issued at once (events around them), each step: `what`.
  const auto gpu_per_step = [&](auto&& what) {
    std::vector<double> us;
    for (int i = 0; i < 4; ++i) {
      constexpr int back_to_back = 8;
      CUDA_CHECK(cudaStreamSynchronize(stream));
      CUDA_CHECK(cudaEventRecord(ev0, stream));
      for (int j = 0; j < back_to_back; ++j) what();
      CUDA_CHECK(cudaEventRecord(ev1, stream));
      CUDA_CHECK(cudaEventSynchronize(ev1));
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, ev0, ev1));
      us.push_back(1000.0 * ms / back_to_back);
    }
    return us;
  };
  // KVQ_REPLAY_PARTS: right after the timed blocks, both caches at the same lengths, the GPU time
  // per step (8 issued at once) of the replayed graph, of graphs of its attention launches alone
  // and of its append launches alone (each replay rewrites the last prepared step), and of the
  // eager `attend` calls alone (no append: the context stays).
  if (std::getenv("KVQ_REPLAY_PARTS")) {
    const auto capture = [&](bool appends, bool attends) {
      cudaGraph_t g;
      cudaGraphExec_t e;
      CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      for (int l = 0; l < layers; ++l) {
        if (appends)
          kvq::check(step.append(l, {rows(k, l, H), kvq::dtype::f16, batch, H, D},
                                 {rows(v, l, H), kvq::dtype::f16, batch, H, D}));
        if (attends)
          kvq::check(step.attend(l, {rows(q, l, Hq), kvq::dtype::f16, batch, Hq, D},
                                 kvq::tensor_mut{rows(o, l, Hq), kvq::dtype::f16, batch, Hq, D}));
      }
      CUDA_CHECK(cudaStreamEndCapture(stream, &g));
      CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
      CUDA_CHECK(cudaGraphDestroy(g));
      return e;
    };
    cudaGraphExec_t attend_only = capture(false, true), append_only = capture(true, false);
    cudaGraphExec_t appends_first = nullptr, memsets = nullptr;
    {  // every layer's append, then every layer's attention; and attention with a 4-byte memset before each layer's
      void* word = nullptr;
      CUDA_CHECK(cudaMalloc(&word, 4));
      for (int variant = 0; variant < 2; ++variant) {
        cudaGraph_t g;
        CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        if (variant == 0)
          for (int l = 0; l < layers; ++l)
            kvq::check(step.append(l, {rows(k, l, H), kvq::dtype::f16, batch, H, D},
                                   {rows(v, l, H), kvq::dtype::f16, batch, H, D}));
        for (int l = 0; l < layers; ++l) {
          if (variant == 1) CUDA_CHECK(cudaMemsetAsync(word, 0, 4, stream));
          kvq::check(step.attend(l, {rows(q, l, Hq), kvq::dtype::f16, batch, Hq, D},
                                 kvq::tensor_mut{rows(o, l, Hq), kvq::dtype::f16, batch, Hq, D}));
        }
        CUDA_CHECK(cudaStreamEndCapture(stream, &g));
        CUDA_CHECK(cudaGraphInstantiate(variant == 0 ? &appends_first : &memsets, g, 0));
        CUDA_CHECK(cudaGraphDestroy(g));
      }
      const auto first = gpu_per_step([&] { CUDA_CHECK(cudaGraphLaunch(appends_first, stream)); });
      const auto ms = gpu_per_step([&] { CUDA_CHECK(cudaGraphLaunch(memsets, stream)); });
      std::printf("  appends first, then attentions %.1f us; attentions after a memset each %.1f us\n", mean(first),
                  mean(ms));
      CUDA_CHECK(cudaGraphExecDestroy(appends_first));
      CUDA_CHECK(cudaGraphExecDestroy(memsets));
      CUDA_CHECK(cudaFree(word));
    }
    const auto full = gpu_per_step([&] { CUDA_CHECK(cudaGraphLaunch(exec, stream)); });
    const auto att = gpu_per_step([&] { CUDA_CHECK(cudaGraphLaunch(attend_only, stream)); });
    const auto app = gpu_per_step([&] { CUDA_CHECK(cudaGraphLaunch(append_only, stream)); });
    const auto eager_att = gpu_per_step([&] {
      for (int l = 0; l < layers; ++l)
        kvq::check(eager_cache.attend(items, l, {rows(q, l, Hq), kvq::dtype::f16, batch, Hq, D},
                                      kvq::tensor_mut{rows(o, l, Hq), kvq::dtype::f16, batch, Hq, D}));
    });
    std::printf("  parts at %lld / %lld tokens (eager / replayed cache), GPU per step: replayed graph %.1f us, its attention "
                "alone %.1f, its append alone %.1f; eager attention alone %.1f\n",
                (long long)eager_cache.length(0, 0), (long long)replay_cache.length(0, 0), mean(full), mean(att),
                mean(app), mean(eager_att));
    CUDA_CHECK(cudaGraphExecDestroy(attend_only));
    CUDA_CHECK(cudaGraphExecDestroy(append_only));
  }
  // the graph alone (each replay rewrites the step it was prepared for: the same kernels over the
  // same tables); after a host-to-device copy of the step's descriptor bytes (pinned, the same
  // size, not the step's own buffers); after a 4-byte memset; and the whole replayed step
  const size_t desc = step.descriptor_bytes();
  void *pinned = nullptr, *landing = nullptr, *word = nullptr;
  CUDA_CHECK(cudaMallocHost(&pinned, desc));
  CUDA_CHECK(cudaMalloc(&landing, desc));
  CUDA_CHECK(cudaMalloc(&word, 4));
  kvq::check(step.prepare(seqs));
  const std::vector<double> graph_us = gpu_per_step([&] { CUDA_CHECK(cudaGraphLaunch(exec, stream)); });
  const std::vector<double> copy_graph_us = gpu_per_step([&] {
    CUDA_CHECK(cudaMemcpyAsync(landing, pinned, desc, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
  });
  const std::vector<double> memset_graph_us = gpu_per_step([&] {
    CUDA_CHECK(cudaMemsetAsync(word, 0, 4, stream));
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
  });
  const double loop_prepare_us = prepare_us / replays, loop_launch_us = launch_us / replays;
  const std::vector<double> step_us = gpu_per_step(replay_step);
  if (std::getenv("KVQ_REPLAY_TRACE")) {  // a block of 16 eager steps, then 16 replayed: each step's GPU span and host time
    constexpr int n = 16;
    std::vector<cudaEvent_t> evs(n + 1);
    for (auto& e : evs) CUDA_CHECK(cudaEventCreate(&e));
    for (int kind = 0; kind < 2; ++kind) {
      std::vector<double> host(n), at(n);
      CUDA_CHECK(cudaStreamSynchronize(stream));
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < n; ++i) {
        const auto a = std::chrono::steady_clock::now();
        at[size_t(i)] = std::chrono::duration<double, std::micro>(a - t0).count();
        CUDA_CHECK(cudaEventRecord(evs[size_t(i)], stream));
        if (kind == 0) {
          eager_step();
        } else {
          kvq::check(step.prepare(seqs));
        }
        host[size_t(i)] = since(a);
        if (kind == 1) CUDA_CHECK(cudaGraphLaunch(exec, stream));
      }
      CUDA_CHECK(cudaEventRecord(evs[n], stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
      const double wall = since(t0);
      for (int i = 0; i < n; ++i) {
        float ms = 0, from0 = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, evs[size_t(i)], evs[size_t(i) + 1]));
        CUDA_CHECK(cudaEventElapsedTime(&from0, evs[0], evs[size_t(i)]));
        std::printf("  trace %s step %2d: host starts %8.1f us, takes %7.1f us; GPU from %8.1f us, span %7.1f us\n",
                    kind == 0 ? "eager" : "replay", i, at[size_t(i)], host[size_t(i)], 1000.0 * from0, 1000.0 * ms);
      }
      std::printf("  trace %s: wall %.1f us for %d steps\n", kind == 0 ? "eager" : "replay", wall, n);
    }
    for (auto& e : evs) CUDA_CHECK(cudaEventDestroy(e));
  }
  CUDA_CHECK(cudaFreeHost(pinned));
  CUDA_CHECK(cudaFree(landing));
  CUDA_CHECK(cudaFree(word));
  std::printf(
      "  step parts: replayed: prepare (host, in the loop) %.1f us, graph launch (host) %.1f us; prepare alone (host, "
      "stream idle) %.1f us (+- %.1f); eager step's calls alone (host, stream idle) %.1f us (+- %.1f)\n"
      "  GPU per step, 8 issued at once: graph %.1f us (+- %.1f); %zu-byte copy + graph %.1f (+- %.1f); memset + graph "
      "%.1f (+- %.1f); replayed step (prepare + graph) %.1f (+- %.1f)\n",
      loop_prepare_us, loop_launch_us, mean(prepare_alone), stderr_of(prepare_alone), mean(eager_issue),
      stderr_of(eager_issue), mean(graph_us), stderr_of(graph_us), desc, mean(copy_graph_us),
      stderr_of(copy_graph_us), mean(memset_graph_us), stderr_of(memset_graph_us), mean(step_us), stderr_of(step_us));
  CUDA_CHECK(cudaEventDestroy(ev0));
  CUDA_CHECK(cudaEventDestroy(ev1));
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  return 0;
}
