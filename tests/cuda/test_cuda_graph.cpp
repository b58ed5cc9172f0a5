// A decode step of the CUDA backend captured into a CUDA graph: `attend` and `append_batch` (its
// value check included) on the caller's stream launch kernels only (no allocation, no
// synchronization, no legacy-stream work), so a thread-local capture of them ends with
// cudaSuccess, and replaying the graph once computes exactly (bit for bit) what the eager calls
// compute.
//
// Eager calls captured this way are good for that one step only. Replaying them later does not
// advance the cache:
// - attention's per-sequence descriptors (slot, q_len, n = tokens held, from_pages = tokens read
//   from pages, window block, query row) are copied by value into the kernel parameters
//   (`attend_params::items` in cuda/attention/params.cuh, a __grid_constant__ argument), and the launch
//   shape (splits, from the longest sequence) and workspace layout are fixed from them on the
//   host. The page tables themselves (`paged_view::blocks` / `fmts`) are device memory read at
//   run time, but a replay still attends over the lengths of the captured step.
// - append's kernels likewise take each sequence's n / e / m, window block and the new pages'
//   block offsets and formats as parameters (`append_params`), and the host bookkeeping (lengths,
//   page allocation) advances once, at capture time: a replay rewrites the same positions.
// The replayable step is `decode_step` (include/kvq/cache/decode_step.hpp, tested in
// test_cuda_decode_step.cpp): its descriptors live in device tables the host rewrites per step.
#include <kvq/cache/cache.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/static_policy.hpp>

#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include "gpu_test.hpp"

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace kvq;
using namespace kvq::gpu_test;

namespace {

constexpr int Hq = 8, H = 2, D = 128;

struct stream_guard {
  cudaStream_t s = nullptr;
  stream_guard() { REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess); }
  ~stream_guard() { cudaStreamDestroy(s); }
};

struct graph_guard {
  cudaGraph_t g = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~graph_guard() {
    if (exec) cudaGraphExecDestroy(exec);
    if (g) cudaGraphDestroy(g);
  }
};

// Host to device on the cache's stream (ordered before the stream's later work), then waits: the
// test's own copies never run on the legacy stream, which a non-blocking stream does not wait for.
template <class T>
void upload(cudaStream_t st, dev_mem& d, const std::vector<T>& h) {
  REQUIRE(cudaMemcpyAsync(d.p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice, st) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(st) == cudaSuccess);
}

std::vector<uint16_t> download(cudaStream_t st, const dev_mem& d, size_t n) {
  std::vector<uint16_t> h(n);
  REQUIRE(cudaMemcpyAsync(h.data(), d.p, n * 2, cudaMemcpyDeviceToHost, st) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(st) == cudaSuccess);
  return h;
}

KVCache make(const std::string& spec, cudaStream_t st) {
  cache_config cfg;
  cfg.shape = {1, Hq, H, D, 64, 128, 32};
  cfg.where = backend::cuda;
  cfg.budget_bytes = 64ull << 20;
  cfg.max_sequences = 8;
  cfg.max_tokens = 4096;
  cfg.stream = st;
  return KVCache::create(cfg, std::make_shared<static_policy>(static_policy::parse(spec).value_or_throw())).value_or_throw();
}

// Captures `step` (calls on `cache`, all on stream `st`) into a graph; the capture must end with
// cudaSuccess (a forbidden synchronization or allocation inside invalidates it) and every call
// must have succeeded. Leaves the graph and its instantiation in `g`.
template <class F>
void capture(cudaStream_t st, graph_guard& g, F&& step) {
  REQUIRE(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  std::vector<status> calls;
  try {
    step(calls);
  } catch (...) {
    cudaGraph_t dropped = nullptr;
    cudaStreamEndCapture(st, &dropped);
    if (dropped) cudaGraphDestroy(dropped);
    throw;
  }
  const cudaError_t end = cudaStreamEndCapture(st, &g.g);
  const std::string end_name = cudaGetErrorName(end), end_text = cudaGetErrorString(end);
  if (end != cudaSuccess) (void)cudaGetLastError();  // else the next launch check reports it again
  CAPTURE(end_name, end_text);
  for (const status& s : calls) {
    CAPTURE(s.to_string());
    REQUIRE(s.ok());
  }
  REQUIRE(end == cudaSuccess);
  REQUIRE(g.g != nullptr);
  size_t nodes = 0;
  REQUIRE(cudaGraphGetNodes(g.g, nullptr, &nodes) == cudaSuccess);
  REQUIRE(nodes > 0);  // the calls were recorded, not run
  REQUIRE(cudaGraphInstantiate(&g.exec, g.g, 0) == cudaSuccess);
}

void require_same_bits(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) {
      CAPTURE(i, a[i], b[i]);
      REQUIRE(a[i] == b[i]);
    }
  }
}

}  // namespace

TEST_CASE("gpu: a decode step is captured into a CUDA graph and replays the eager result", "[gpu][graph]") {
  const std::string spec = "kivi4/g32";
  stream_guard st;
  // Two identical caches with identical contents: `a` is captured, `b` stays eager (reference).
  KVCache a = make(spec, st.s), b = make(spec, st.s);
  // Unequal lengths; the third one completes a page (and encodes it) at the captured append:
  // 94 -> 95 (warm-up) -> 96 = page_tokens + recent tokens not yet encoded.
  const std::vector<int64_t> lens = {300, 1000, 94};
  const int n = int(lens.size());
  std::mt19937 rng(17);
  for (int s = 0; s < n; ++s) {
    check(a.create_sequence(s));
    check(b.create_sequence(s));
    const auto k = randn_h(rng, size_t(lens[size_t(s)]) * H * D), v = randn_h(rng, size_t(lens[size_t(s)]) * H * D);
    dev_mem dk(k.size() * 2), dv(v.size() * 2);
    upload(st.s, dk, k);
    upload(st.s, dv, v);
    check(a.append(s, 0, {dk.p, dtype::f16, lens[size_t(s)], H, D}, {dv.p, dtype::f16, lens[size_t(s)], H, D}));
    check(b.append(s, 0, {dk.p, dtype::f16, lens[size_t(s)], H, D}, {dv.p, dtype::f16, lens[size_t(s)], H, D}));
    REQUIRE(cudaStreamSynchronize(st.s) == cudaSuccess);  // before dk / dv go
  }
  std::vector<attend_item> items;
  std::vector<append_item> adds;
  for (int s = 0; s < n; ++s) items.push_back({s, 1}), adds.push_back({s, 1});
  const size_t out_elems = size_t(n) * Hq * D;
  const std::vector<uint16_t> poison(out_elems, 0x7e00);  // fp16 NaN: every element must be written
  dev_mem dq(out_elems * 2), o_eager(out_elems * 2), o_graph(out_elems * 2);
  const tensor_view q{dq.p, dtype::f16, n, Hq, D};
  const tensor_mut oe{o_eager.p, dtype::f16, n, Hq, D}, og{o_graph.p, dtype::f16, n, Hq, D};

  SECTION("attend") {
    upload(st.s, dq, randn_h(rng, out_elems));
    upload(st.s, o_eager, poison);
    upload(st.s, o_graph, poison);
    check(a.attend(items, 0, q, oe));  // eager; also sizes the attention workspace for this batch
    REQUIRE(cudaStreamSynchronize(st.s) == cudaSuccess);
    graph_guard g;
    capture(st.s, g, [&](std::vector<status>& calls) { calls.push_back(a.attend(items, 0, q, og)); });
    // nothing ran at capture time
    require_same_bits(download(st.s, o_graph, out_elems), poison);
    REQUIRE(cudaGraphLaunch(g.exec, st.s) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(st.s) == cudaSuccess);
    const auto eager = download(st.s, o_eager, out_elems), graph = download(st.s, o_graph, out_elems);
    for (uint16_t x : eager) REQUIRE(std::isfinite(half_to_float(x)));
    require_same_bits(graph, eager);
  }

  SECTION("append_batch then attend") {
    // A warm-up step of the same shape, eager, on both caches (one new token per sequence).
    // The lengths keep attention's launch plan, hence its workspace need, unchanged between the
    // warm-up and the captured step (the longest sequence stays at 63 slabs of 16 tokens): a
    // larger need would have to grow the workspace inside the capture (refused: next section).
    dev_mem dk(size_t(n) * H * D * 2), dv(size_t(n) * H * D * 2);
    upload(st.s, dk, randn_h(rng, size_t(n) * H * D));
    upload(st.s, dv, randn_h(rng, size_t(n) * H * D));
    upload(st.s, dq, randn_h(rng, out_elems));
    const tensor_view kr{dk.p, dtype::f16, n, H, D}, vr{dv.p, dtype::f16, n, H, D};
    for (KVCache* c : {&a, &b}) {
      check(c->append_batch(adds, 0, kr, vr));
      check(c->attend(items, 0, q, oe));
    }
    REQUIRE(cudaStreamSynchronize(st.s) == cudaSuccess);
    // The captured step's inputs (new K/V rows and queries).
    upload(st.s, dk, randn_h(rng, size_t(n) * H * D));
    upload(st.s, dv, randn_h(rng, size_t(n) * H * D));
    upload(st.s, dq, randn_h(rng, out_elems));
    upload(st.s, o_eager, poison);
    upload(st.s, o_graph, poison);
    const auto pages_before = a.stats().pages;
    graph_guard g;
    capture(st.s, g, [&](std::vector<status>& calls) {
      calls.push_back(a.append_batch(adds, 0, kr, vr));
      calls.push_back(a.attend(items, 0, q, og));
    });
    // the host bookkeeping advanced at capture time (the page of sequence 2 is allocated)
    REQUIRE(a.stats().pages > pages_before);
    for (int s = 0; s < n; ++s) REQUIRE(a.length(s, 0) == lens[size_t(s)] + 2);
    REQUIRE(cudaGraphLaunch(g.exec, st.s) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(st.s) == cudaSuccess);
    // the same step, eager, on the reference cache
    check(b.append_batch(adds, 0, kr, vr));
    check(b.attend(items, 0, q, oe));
    REQUIRE(cudaStreamSynchronize(st.s) == cudaSuccess);
    const auto eager = download(st.s, o_eager, out_elems), graph = download(st.s, o_graph, out_elems);
    for (uint16_t x : eager) REQUIRE(std::isfinite(half_to_float(x)));
    require_same_bits(graph, eager);
    // and the replayed append stored what the eager one stored (pages and rings)
    REQUIRE(a.stats().page_bytes == b.stats().page_bytes);
    for (int s = 0; s < n; ++s)
      for (role r : {role::k, role::v}) {
        const size_t m = size_t(a.length(s, 0)) * H * D;
        std::vector<float> x(m), y(m);
        check(a.read(s, 0, r, x));
        check(b.read(s, 0, r, y));
        CAPTURE(s, int(r));
        REQUIRE(std::memcmp(x.data(), y.data(), m * sizeof(float)) == 0);
      }
  }

  SECTION("a call that must grow the workspace is refused inside a capture, which stays valid") {
    upload(st.s, dq, randn_h(rng, out_elems));
    upload(st.s, o_eager, poison);
    upload(st.s, o_graph, poison);
    // no call has sized `a`'s workspace yet: attending must grow it
    REQUIRE(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    const status refused = a.attend(items, 0, q, og);
    cudaGraph_t dropped = nullptr;
    const cudaError_t end = cudaStreamEndCapture(st.s, &dropped);
    if (dropped) cudaGraphDestroy(dropped);
    CAPTURE(refused.to_string());
    REQUIRE(refused.code() == errc::invalid_argument);
    REQUIRE(refused.message().find("being captured") != std::string::npos);
    REQUIRE(end == cudaSuccess);  // kvq did nothing that invalidates the engine's capture
    // eager, the same call grows the workspace in stream order and computes what `b` computes
    check(a.attend(items, 0, q, og));
    check(b.attend(items, 0, q, oe));
    REQUIRE(cudaStreamSynchronize(st.s) == cudaSuccess);
    const auto eager = download(st.s, o_eager, out_elems), grown = download(st.s, o_graph, out_elems);
    for (uint16_t x : eager) REQUIRE(std::isfinite(half_to_float(x)));
    require_same_bits(grown, eager);
  }
}
