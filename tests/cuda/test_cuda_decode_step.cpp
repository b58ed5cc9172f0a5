// decode_step (include/kvq/cache/decode_step.hpp): a decode step of every layer captured once into
// a CUDA graph and replayed for 200 steps of changing lengths and batches. Three caches take the
// same steps: `a` replays the graph, `b` runs the same decode_step calls without a graph, `c`
// runs the eager append_batch + attend. After every step a's outputs equal b's bit for bit and
// c's within summation order; a and c store the same bytes. Then the bad requests: each is a
// status naming the problem, and nothing changes.
#include <kvq/cache/cache.hpp>
#include <kvq/cache/decode_step.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/policy.hpp>
#include <kvq/policy/static_policy.hpp>

#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include "gpu_test.hpp"

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace kvq;
using namespace kvq::gpu_test;

namespace {

constexpr int L = 2, Hq = 8, H = 2, D = 128, P = 64, W = 128, R = 32;
// Layer 0 holds kivi4 / kivi2 pages on head 0 and fp16 pages on head 1 (the eager calls run a
// staged kernel's 16-bit instance there); layer 1 kivi4 and kivi2 only (the staged kernel) with both heads rotated.
const std::string spec = "k=kivi4/g32,v=kivi2/g32;0.1=fp16;1.0=k=kivi2/g32,v=kivi4/g32";

struct stream_guard {
  cudaStream_t s = nullptr;
  stream_guard() { REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess); }
  ~stream_guard() { cudaStreamDestroy(s); }
};

// The step's launches are planned per layer from these maps: a 16-bit instance for layer 0 of
// `spec` and of the fp16 map, the block-staged kernel for the others (the whole-unit instance on
// the 4/2-bit rings of their layer 1; 8-bit page-heads, mixed formats per head, on rings with two
// full barriers in both layers of the narrow map).
const std::string narrow_spec = "k=kivi8/g32,v=sym4/g32;0.1=k=kivi4/g32,v=kivi2/g32;1.0=k=sym8/g32,v=fp8;1.1=kivi2/g32";
const std::string fp16_spec = "fp16;1=kivi4/g32";
// 3-bit pages read staged in the replay as in the eager calls: layer 0 a kivi3 head beside a K 4 /
// V 3-bit one (a Three instance, 4-bit stages), layer 1 a kivi3 head beside a kivi2 one (one pair
// per head: the whole-unit instance in 3-bit stages, both heads rotated).
const std::string three_spec = "kivi3/g32;0.1=k=kivi4/g32,v=sym3/g32;1.1=kivi2/g32";

KVCache make(cudaStream_t st, uint64_t budget = 64ull << 20, std::shared_ptr<policy> pol = nullptr, int sinks = 0) {
  cache_config cfg;
  cfg.sink_pages = sinks;
  cfg.shape = {L, Hq, H, D, P, W, R};
  cfg.where = backend::cuda;
  cfg.budget_bytes = budget;
  cfg.max_sequences = 8;
  cfg.max_tokens = 1024;
  cfg.stream = st;
  cfg.check_values = false;  // (a replayed step checks no values; the eager reference would run the check)
  cfg.rotation.heads = {0, 0, 1, 1};
  if (!pol) pol = std::make_shared<static_policy>(static_policy::parse(spec).value_or_throw());
  return KVCache::create(cfg, std::move(pol)).value_or_throw();
}

template <class T>
void put(cudaStream_t st, void* d, const std::vector<T>& h) {
  REQUIRE(cudaMemcpyAsync(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice, st) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(st) == cudaSuccess);
}

std::vector<uint16_t> get(cudaStream_t st, const void* d, size_t n) {
  std::vector<uint16_t> h(n);
  REQUIRE(cudaMemcpyAsync(h.data(), d, n * 2, cudaMemcpyDeviceToHost, st) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(st) == cudaSuccess);
  return h;
}

std::vector<float> to_float(const std::vector<uint16_t>& h, size_t n) {
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = half_to_float(h[i]);
  return f;
}

void require_same_reads(const KVCache& x, const KVCache& y, seq_id s) {
  for (int l = 0; l < L; ++l) {
    REQUIRE(x.length(s, l) == y.length(s, l));
    for (role r : {role::k, role::v}) {
      const size_t m = size_t(x.length(s, l)) * H * D;
      std::vector<float> a(m), b(m);
      check(x.read(s, l, r, a));
      check(y.read(s, l, r, b));
      CAPTURE(s, l, int(r));
      REQUIRE(std::memcmp(a.data(), b.data(), m * sizeof(float)) == 0);
    }
  }
}

// Appends `n` random tokens to every layer of sequence `s` of each cache (the same tokens).
void fill(cudaStream_t st, std::mt19937& rng, std::vector<KVCache*> caches, seq_id s, int64_t n) {
  const auto k = randn_h(rng, size_t(n) * H * D), v = randn_h(rng, size_t(n) * H * D);
  dev_mem dk(k.size() * 2), dv(v.size() * 2);
  put(st, dk.p, k);
  put(st, dv.p, v);
  for (KVCache* c : caches)
    for (int l = 0; l < L; ++l) check(c->append(s, l, {dk.p, dtype::f16, n, H, D}, {dv.p, dtype::f16, n, H, D}));
  REQUIRE(cudaStreamSynchronize(st) == cudaSuccess);
}

// Reduced sizes for compute-sanitizer runs (tests/cuda/main.cpp).
bool small() { return std::getenv("KVQ_GPU_TEST_SMALL") != nullptr; }

}  // namespace

TEST_CASE("gpu: a decode step captured once replays 200 steps as its eager calls compute", "[gpu][graph][replay]") {
  const std::string map = GENERATE(spec, narrow_spec, fp16_spec, three_spec);
  // with a sink page, the shorter sequences encode it during the replayed steps (FP16, read from
  // global memory under the plans of the narrower formats)
  const int sinks = GENERATE(0, 1);
  CAPTURE(map, sinks);
  stream_guard st;
  const auto pol = [&] { return std::make_shared<static_policy>(static_policy::parse(map).value_or_throw()); };
  KVCache a = make(st.s, 64ull << 20, pol(), sinks), b = make(st.s, 64ull << 20, pol(), sinks),
          c = make(st.s, 64ull << 20, pol(), sinks);
  // Lengths around page and slab edges; the longest crosses several pages during the 200 steps.
  const std::vector<int64_t> lens = {1, 63, 94, 200, 700};
  const int n = int(lens.size()), max_batch = 6;
  const uint32_t seed = 20261202;
  CAPTURE(seed);
  std::mt19937 rng(seed);
  for (int s = 0; s < n; ++s) {
    for (KVCache* x : {&a, &b, &c}) check(x->create_sequence(s));
    fill(st.s, rng, {&a, &b, &c}, s, lens[size_t(s)]);
  }
  decode_step sa = decode_step::create(a, max_batch, 1024).value_or_throw();
  decode_step sb = decode_step::create(b, max_batch, 1024).value_or_throw();
  const size_t kv_row = size_t(H) * D, q_row = size_t(Hq) * D;
  dev_mem dk(L * max_batch * kv_row * 2), dv(L * max_batch * kv_row * 2), dq(L * max_batch * q_row * 2);
  dev_mem oa(L * max_batch * q_row * 2), ob(L * max_batch * q_row * 2), oc(L * max_batch * q_row * 2);
  const std::vector<uint16_t> poison(L * max_batch * q_row, 0x7e00);  // fp16 NaN
  put(st.s, oa.p, poison);
  auto at = [](const dev_mem& m, int l, size_t row) { return static_cast<uint8_t*>(m.p) + size_t(l) * max_batch * row * 2; };
  auto kv_view = [&](const dev_mem& m, int l, int64_t rows) { return tensor_view{at(m, l, kv_row), dtype::f16, rows, H, D}; };
  auto q_view = [&](int l, int64_t rows) { return tensor_view{at(dq, l, q_row), dtype::f16, rows, Hq, D}; };
  auto o_view = [&](const dev_mem& m, int l, int64_t rows) { return tensor_mut{at(m, l, q_row), dtype::f16, rows, Hq, D}; };
  // The step's calls on a decode_step (captured for a, run directly for b).
  auto calls = [&](decode_step& x, const dev_mem& o) {
    for (int l = 0; l < L; ++l) {
      check(x.append(l, kv_view(dk, l, max_batch), kv_view(dv, l, max_batch)));
      check(x.attend(l, q_view(l, max_batch), o_view(o, l, max_batch)));
    }
  };
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  int64_t encodes = 0;  // steps whose append encoded a page of some sequence
  const int steps = small() ? 80 : 200;
  for (int t = 0; t < steps; ++t) {
    // Every 7th step leaves sequence 1 out and every 11th reverses the rows: the batch and its
    // order change under the same graph.
    std::vector<seq_id> seqs;
    for (int s = 0; s < n; ++s)
      if (!(s == 1 && t % 7 == 3)) seqs.push_back(s);
    if (t % 11 == 5) std::reverse(seqs.begin(), seqs.end());
    const int batch = int(seqs.size());
    CAPTURE(t, batch);
    put(st.s, dk.p, randn_h(rng, L * max_batch * kv_row));
    put(st.s, dv.p, randn_h(rng, L * max_batch * kv_row));
    put(st.s, dq.p, randn_h(rng, L * max_batch * q_row));
    const auto pages_before = c.stats().pages;
    check(sa.prepare(seqs));
    if (t == 0) {
      REQUIRE(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
      calls(sa, oa);
      REQUIRE(cudaStreamEndCapture(st.s, &graph) == cudaSuccess);
      REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    }
    REQUIRE(cudaGraphLaunch(exec, st.s) == cudaSuccess);
    check(sb.prepare(seqs));
    calls(sb, ob);
    std::vector<append_item> adds;
    std::vector<attend_item> items;
    for (seq_id s : seqs) adds.push_back({s, 1}), items.push_back({s, 1});
    for (int l = 0; l < L; ++l) {
      check(c.append_batch(adds, l, kv_view(dk, l, batch), kv_view(dv, l, batch)));
      check(c.attend(items, l, q_view(l, batch), o_view(oc, l, batch)));
    }
    REQUIRE(cudaStreamSynchronize(st.s) == cudaSuccess);
    encodes += c.stats().pages > pages_before;
    REQUIRE(a.stats().pages == c.stats().pages);
    for (int l = 0; l < L; ++l) {
      CAPTURE(l);
      const auto ga = get(st.s, at(oa, l, q_row), size_t(max_batch) * q_row);
      const auto gb = get(st.s, at(ob, l, q_row), size_t(max_batch) * q_row);
      const auto gc = get(st.s, at(oc, l, q_row), size_t(batch) * q_row);
      const size_t used = size_t(batch) * q_row;
      REQUIRE(std::memcmp(ga.data(), gb.data(), used * 2) == 0);  // the replay = its calls, bit for bit
      for (size_t i = size_t(max_batch - 1) * q_row; i < ga.size(); ++i) REQUIRE(ga[i] == 0x7e00);  // past every batch
      REQUIRE(nmse(to_float(ga, used), to_float(gc, used)) < 1e-5);  // = the eager calls up to summation order
    }
    if (t % 50 == 49)
      for (int s = 0; s < n; ++s) require_same_reads(a, c, s);
  }
  REQUIRE(encodes >= (small() ? 3 : 5));  // pages were encoded during the replay
  for (int s = 0; s < n; ++s) require_same_reads(a, b, s);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_CASE("gpu: decode_step refuses bad requests and changes nothing", "[gpu][graph][replay]") {
  stream_guard st;
  std::mt19937 rng(7);
  SECTION("creation") {
    KVCache a = make(st.s);
    REQUIRE(decode_step::create(a, 0, 512).error().code() == errc::invalid_argument);
    REQUIRE(decode_step::create(a, 300, 512).error().code() == errc::invalid_argument);  // above max_items
    REQUIRE(decode_step::create(a, 4, 4096).error().code() == errc::invalid_argument);   // above the cache's max_tokens
    cache_config cpu = a.config();
    cpu.where = backend::cpu;
    KVCache h = KVCache::create(cpu, std::make_shared<static_policy>(static_policy::parse(spec).value_or_throw())).value_or_throw();
    REQUIRE(decode_step::create(h, 4, 512).error().code() == errc::unsupported);
  }
  SECTION("prepare and the calls") {
    KVCache a = make(st.s);
    for (int s = 0; s < 3; ++s) check(a.create_sequence(s));
    fill(st.s, rng, {&a}, 0, 100);
    fill(st.s, rng, {&a}, 1, 127);
    fill(st.s, rng, {&a}, 2, 5);
    decode_step x = decode_step::create(a, 2, 128).value_or_throw();
    dev_mem dk(2 * H * D * 2), dq(2 * Hq * D * 2);
    const tensor_view k{dk.p, dtype::f16, 2, H, D}, q{dq.p, dtype::f16, 2, Hq, D};
    const tensor_mut o{dq.p, dtype::f16, 2, Hq, D};
    REQUIRE(x.append(0, k, k).code() == errc::invalid_argument);  // nothing prepared yet
    REQUIRE(x.attend(0, q, o).code() == errc::invalid_argument);
    const auto before = a.stats();
    const std::vector<seq_id> none, three = {0, 1, 2}, unknown = {0, 9}, twice = {2, 2}, full = {1, 0};
    const auto refused = [&](std::span<const seq_id> seqs, errc code, const char* names) {
      const status s = x.prepare(seqs);
      CAPTURE(s.to_string());
      REQUIRE(s.code() == code);
      REQUIRE(s.message().find(names) != std::string::npos);
      for (int id = 0; id < 3; ++id)
        for (int l = 0; l < L; ++l) REQUIRE(a.length(id, l) == (id == 0 ? 100 : id == 1 ? 127 : 5));
      REQUIRE(a.stats().pages == before.pages);
      REQUIRE(a.stats().used_bytes == before.used_bytes);
    };
    refused(none, errc::invalid_argument, "max_batch");
    refused(three, errc::invalid_argument, "max_batch");
    refused(unknown, errc::not_found, "sequence 9");
    refused(twice, errc::invalid_argument, "more than once");
    check(x.prepare(std::vector<seq_id>{1}));  // 127 -> 128 = the step's max_tokens
    REQUIRE(a.length(1, 0) == 128);
    const status past = x.prepare(full);
    REQUIRE(past.code() == errc::out_of_budget);
    REQUIRE(past.message().find("max_tokens") != std::string::npos);
    REQUIRE(a.length(0, 0) == 100);
    // inside a capture of the cache's stream
    REQUIRE(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    const status captured = x.prepare(std::vector<seq_id>{0});
    cudaGraph_t dropped = nullptr;
    REQUIRE(cudaStreamEndCapture(st.s, &dropped) == cudaSuccess);
    if (dropped) cudaGraphDestroy(dropped);
    REQUIRE(captured.code() == errc::invalid_argument);
    REQUIRE(captured.message().find("captured") != std::string::npos);
    REQUIRE(a.length(0, 0) == 100);
    REQUIRE(x.append(L, k, k).code() == errc::invalid_argument);  // layer out of range
    const tensor_view k1{dk.p, dtype::f16, 1, H, D};
    REQUIRE(x.append(0, k1, k1).code() == errc::invalid_argument);  // not max_batch rows
  }
  SECTION("a full budget") {
    // A budget of one ring block and a few page blocks: one sequence grows until its next step's
    // pages no longer fit.
    KVCache a = make(st.s, 512u << 10);
    check(a.create_sequence(0));
    decode_step x = decode_step::create(a, 1, 1024).value_or_throw();
    const std::vector<seq_id> one = {0};
    int64_t grown = 0;
    while (a.bytes_for(1, 0).value_or_throw() <= a.stats().largest_free_block && grown < 1000) {
      fill(st.s, rng, {&a}, 0, 1);
      ++grown;
    }
    REQUIRE(grown < 1000);
    const auto before = a.stats();
    const status s = x.prepare(one);
    CAPTURE(s.to_string());
    REQUIRE(s.code() == errc::out_of_budget);
    REQUIRE(s.message().find("largest free block") != std::string::npos);
    REQUIRE(a.length(0, 0) == grown);
    REQUIRE(a.stats().used_bytes == before.used_bytes);
  }
}

namespace {

// A table-driven policy whose map the test changes: kivi4 everywhere until `widen`, then fp16 on
// layer 1, head 0.
struct changing_policy final : policy {
  bool widen = false;
  std::string name() const override { return "changing"; }
  status bind(const cache_shape&) override { return {}; }
  format_pair current(int layer, int kv_head) const override {
    const format_id f = widen && layer == 1 && kv_head == 0 ? parse_format("fp16").value_or_throw()
                                                            : parse_format("kivi4/g32").value_or_throw();
    return {f, f};
  }
};

}  // namespace

TEST_CASE("gpu: decode_step refuses a page wider than its layer's planned formats", "[gpu][graph][replay]") {
  stream_guard st;
  std::mt19937 rng(11);
  const auto pol = std::make_shared<changing_policy>();
  KVCache a = make(st.s, 64ull << 20, pol);
  check(a.create_sequence(0));
  fill(st.s, rng, {&a}, 0, 60);
  decode_step x = decode_step::create(a, 1, 1024).value_or_throw();  // planned for 4-bit pages
  pol->widen = true;
  const std::vector<seq_id> one = {0};
  // Steps that encode no page pass; the first that would encode one (in fp16, layer 1) is refused.
  status s;
  int steps = 0;
  for (; steps < 2 * W && (s = x.prepare(one)).ok(); ++steps) {}
  CAPTURE(steps, s.to_string());
  REQUIRE(s.code() == errc::unsupported);
  REQUIRE(s.message().find("layer 1") != std::string::npos);
  REQUIRE(s.message().find("fp16") != std::string::npos);
  const auto before = a.stats();
  const int64_t n = a.length(0, 0);
  REQUIRE(x.prepare(one).code() == errc::unsupported);  // again: nothing changed
  for (int l = 0; l < L; ++l) REQUIRE(a.length(0, l) == n);
  REQUIRE(a.stats().pages == before.pages);
  REQUIRE(a.stats().used_bytes == before.used_bytes);
  // A step made now plans layer 1 for fp16 pages and takes the same step.
  decode_step y = decode_step::create(a, 1, 1024).value_or_throw();
  check(y.prepare(one));
  REQUIRE(a.length(0, 1) == n + 1);
}

namespace {

// A policy whose new pages are wider in bytes than its map says (sym4/g32 in the map, kivi4/g32
// chosen: the same kernel bits, 4.5 against 5 bits per element), so that the bytes of a step
// counted from the map understate what its pages take.
struct understating_policy final : policy {
  std::string name() const override { return "understating"; }
  status bind(const cache_shape&) override { return {}; }
  format_pair current(int, int) const override {
    const format_id f = parse_format("sym4/g32").value_or_throw();
    return {f, f};
  }
  format_id choose(const page_request&) override { return parse_format("kivi4/g32").value_or_throw(); }
};

}  // namespace

TEST_CASE("gpu: decode_step counts a step's bytes in the formats its pages get; a full budget changes nothing",
          "[gpu][graph][replay]") {
  stream_guard st;
  KVCache a = make(st.s, 512u << 10, std::make_shared<understating_policy>());
  check(a.create_sequence(0));
  decode_step x = decode_step::create(a, 1, 1024).value_or_throw();
  const std::vector<seq_id> one = {0};
  // Steps (bookkeeping only: no graph runs) until the budget refuses one, which must leave every
  // layer as it was, as a refusal before any layer changed does.
  status s;
  int steps = 0;
  for (; steps < 1000 && (s = x.prepare(one)).ok(); ++steps) {}
  CAPTURE(steps, s.to_string());
  REQUIRE(s.code() == errc::out_of_budget);
  REQUIRE(s.message().find("largest free block") != std::string::npos);
  const auto before = a.stats();
  for (int l = 0; l < L; ++l) REQUIRE(a.length(0, l) == steps);
  REQUIRE(x.prepare(one).code() == errc::out_of_budget);  // again: nothing changed
  for (int l = 0; l < L; ++l) REQUIRE(a.length(0, l) == steps);
  REQUIRE(a.stats().used_bytes == before.used_bytes);
  REQUIRE(a.stats().pages == before.pages);
  REQUIRE(cudaStreamSynchronize(st.s) == cudaSuccess);
}
