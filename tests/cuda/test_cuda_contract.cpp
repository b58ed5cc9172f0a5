// The call contract an engine relies on (docs/architecture.md, "Streams" and "Value checks on the
// device"): no call of the hot path synchronizes or allocates, value checks included, so append,
// attend, a long prefill, truncate and fork capture into one CUDA graph in the global capture
// mode (which fails on any synchronization or allocation) and replay the eager result bit for
// bit; bad values are refused on the device and reported by `check`, which restores what was
// refused; and calls on two streams at once (one prefilling, the other decoding) compute what one
// stream computes.
#include <kvq/cache/cache.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/static_policy.hpp>

#include <catch2/catch.hpp>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include "cache_reads.hpp"
#include "gpu_test.hpp"

#include <deque>
#include <random>
#include <string>
#include <vector>

using namespace kvq;
using namespace kvq::gpu_test;

namespace {

constexpr int L = 2, Hq = 8, H = 2, D = 128;

struct stream_guard {
  cudaStream_t s = nullptr;
  stream_guard() { REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess); }
  ~stream_guard() { cudaStreamDestroy(s); }
};

KVCache make(cudaStream_t st, const std::string& spec = "kivi4/g32", bool check_values = true) {
  cache_config cfg;
  cfg.shape = {L, Hq, H, D, 64, 128, 32};
  cfg.where = backend::cuda;
  cfg.budget_bytes = 128ull << 20;
  cfg.max_sequences = 16;
  cfg.max_tokens = 4096;
  cfg.stream = st;
  cfg.check_values = check_values;
  return KVCache::create(cfg, std::make_shared<static_policy>(static_policy::parse(spec).value_or_throw()))
      .value_or_throw();
}

// Device fp16 rows [tokens][heads][D] of random values, kept for the test's scope.
struct rows {
  std::vector<uint16_t> host;
  dev_mem dev;
  int64_t tokens;
  int heads;
  rows(std::mt19937& rng, int64_t t, int h) : host(randn_h(rng, size_t(t) * h * D)), dev(host.size() * 2), tokens(t), heads(h) {
    upload(dev, host);
  }
  tensor_view view() const { return {dev.p, dtype::f16, tokens, heads, D}; }
  tensor_mut out() const { return {dev.p, dtype::f16, tokens, heads, D}; }
  void reload() { upload(dev, host); }
};

std::vector<uint16_t> download(const rows& r) {
  std::vector<uint16_t> h(r.host.size());
  REQUIRE(cudaMemcpy(h.data(), r.dev.p, h.size() * 2, cudaMemcpyDeviceToHost) == cudaSuccess);
  return h;
}

void require_same(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i])) {
      CAPTURE(i, a[i], b[i]);
      REQUIRE(a[i] == b[i]);
    }
}
void require_same(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) {
      CAPTURE(i, a[i], b[i]);
      REQUIRE(a[i] == b[i]);
    }
}

}  // namespace

TEST_CASE("gpu contract: append, attend, a long prefill, truncate and fork in one graph (global capture mode)",
          "[gpu][contract][graph]") {
  const std::string spec = GENERATE("kivi4/g32", "k=kivi2/g32,v=cb4+rot");
  CAPTURE(spec);
  const bool rotated = spec.ends_with("+rot");
  stream_guard sa, sb;
  std::mt19937 rng(3);
  const std::string pair = rotated ? spec.substr(0, spec.size() - 4) : spec;
  auto make_one = [&](cudaStream_t st) {
    cache_config cfg = make(st, pair).config();
    if (rotated) cfg.rotation = rotation_config::all(cfg.shape);
    return KVCache::create(cfg, std::make_shared<static_policy>(static_policy::parse(pair).value_or_throw()))
        .value_or_throw();
  };
  KVCache a = make_one(sa.s), b = make_one(sb.s);  // a: eager; b: captured, then replayed once
  const int64_t n0 = 300, prefix = 100, T = 300;   // decode sequences 0, 1; prefill 2 (and 9, the warm-up)
  rows prompt(rng, n0, H), pre(rng, prefix, H), chunk_k(rng, T, H), chunk_v(rng, T, H), chunk_q(rng, T, Hq);
  for (KVCache* c : {&a, &b}) {
    for (seq_id s : {0, 1, 2, 9}) {
      check(c->create_sequence(s));
      for (int l = 0; l < L; ++l)
        check(c->append(s, l, s < 2 ? prompt.view() : pre.view(), s < 2 ? prompt.view() : pre.view()));
    }
  }
  rows step_k(rng, 2, H), step_v(rng, 2, H), step_q(rng, 2, Hq);
  const std::vector<append_item> adds = {{0, 1}, {1, 1}};
  const std::vector<attend_item> items = {{0, 1}, {1, 1}};
  // Warm-up on both (workspaces sized before the capture; the same calls on each)
  rows warm_o(rng, T, Hq), warm_step_o(rng, 2, Hq);
  for (KVCache* c : {&a, &b})
    for (int l = 0; l < L; ++l) {
      check(c->prefill(9, l, chunk_k.view(), chunk_v.view(), chunk_q.view(), warm_o.out()));
      check(c->attend(items, l, step_q.view(), warm_step_o.out()));
    }
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);

  // The calls: a decode step of 0 and 1, a prefill of 300 tokens of 2, 0 cut back to 150 (its cut
  // page comes back into the ring from the page), 1 forked into 5, then a decode step of 0 and 5.
  std::deque<rows> outs;
  for (int i = 0; i < 2 * L; ++i) outs.emplace_back(rng, 2, Hq);
  std::deque<rows> pre_outs;
  for (int i = 0; i < L; ++i) pre_outs.emplace_back(rng, T, Hq);
  auto calls = [&](KVCache& c, std::vector<status>& st) {
    for (int l = 0; l < L; ++l) {
      st.push_back(c.append_batch(adds, l, step_k.view(), step_v.view()));
      st.push_back(c.attend(items, l, step_q.view(), outs[size_t(l)].out()));
    }
    for (int l = 0; l < L; ++l)
      st.push_back(c.prefill(2, l, chunk_k.view(), chunk_v.view(), chunk_q.view(), pre_outs[size_t(l)].out()));
    st.push_back(c.truncate(0, 150));
    st.push_back(c.fork(1, 5));
    const std::vector<append_item> adds2 = {{0, 1}, {5, 1}};
    const std::vector<attend_item> items2 = {{0, 1}, {5, 1}};
    for (int l = 0; l < L; ++l) {
      st.push_back(c.append_batch(adds2, l, step_k.view(), step_v.view()));
      st.push_back(c.attend(items2, l, step_q.view(), outs[size_t(L + l)].out()));
    }
  };
  std::vector<status> eager;
  calls(a, eager);
  for (const status& s : eager) REQUIRE(s.ok());
  REQUIRE(cudaStreamSynchronize(sa.s) == cudaSuccess);
  std::vector<std::vector<uint16_t>> want;
  for (const rows& r : outs) want.push_back(download(r));
  for (const rows& r : pre_outs) want.push_back(download(r));
  for (rows& r : outs) r.reload();  // (the outputs hold their random fill again)
  for (rows& r : pre_outs) r.reload();

  REQUIRE(cudaStreamBeginCapture(sb.s, cudaStreamCaptureModeGlobal) == cudaSuccess);
  std::vector<status> captured;
  calls(b, captured);
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(sb.s, &graph);
  CAPTURE(cudaGetErrorString(end));
  for (const status& s : captured) {
    CAPTURE(s.to_string());
    REQUIRE(s.ok());
  }
  REQUIRE(end == cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  REQUIRE(cudaGraphLaunch(exec, sb.s) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(sb.s) == cudaSuccess);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);

  size_t i = 0;
  for (const rows& r : outs) require_same(download(r), want[i++]);
  for (const rows& r : pre_outs) require_same(download(r), want[i++]);
  for (seq_id s : {0, 1, 2, 5}) {
    CAPTURE(s);
    for (int l = 0; l < L; ++l) REQUIRE(b.length(s, l) == a.length(s, l));
    require_same(test::read_all(b, s), test::read_all(a, s));
  }
  REQUIRE(b.check().ok());
  REQUIRE(a.check().ok());
}

TEST_CASE("gpu contract: NaN and Inf rows are refused on the device; check reports them and restores the sequence",
          "[gpu][contract][errors]") {
  const uint16_t bad = GENERATE(uint16_t(0x7e00), uint16_t(0x7c00), uint16_t(0xfc00));  // NaN, +Inf, -Inf
  CAPTURE(bad);
  stream_guard st;
  KVCache g = make(st.s), ref = make(st.s);  // ref: the same calls without the refused ones
  std::mt19937 rng(5);
  rows prompt(rng, 150, H);
  for (KVCache* c : {&g, &ref})
    for (seq_id s : {0, 1}) {
      check(c->create_sequence(s));
      for (int l = 0; l < L; ++l) check(c->append(s, l, prompt.view(), prompt.view()));
    }
  const auto ref_stats = ref.stats();
  // A decode step whose row of sequence 1 (row 1) holds a bad value in layer 0's K: sequence 0 is
  // stored, sequence 1 is held; everything after it for sequence 1 (layer 1, longer appends that
  // would encode pages, a fork and its appends, a truncate) is refused on the device too.
  rows step(rng, 2, H), step_bad(rng, 2, H);
  step_bad.host = step.host;
  step_bad.host[size_t(1) * H * D + 77] = bad;
  step_bad.reload();
  const std::vector<append_item> adds = {{0, 1}, {1, 1}};
  check(g.append_batch(adds, 0, step_bad.view(), step.view()));
  check(g.append_batch(adds, 1, step.view(), step.view()));
  check(ref.append(0, 0, {step.dev.p, dtype::f16, 1, H, D}, {step.dev.p, dtype::f16, 1, H, D}));
  check(ref.append(0, 1, {step.dev.p, dtype::f16, 1, H, D}, {step.dev.p, dtype::f16, 1, H, D}));
  rows more(rng, 150, H), q(rng, 1, Hq), o(rng, 1, Hq);
  for (int l = 0; l < L; ++l) check(g.append(1, l, more.view(), more.view()));
  check(g.fork(1, 7));
  for (int l = 0; l < L; ++l) check(g.append(7, l, more.view(), more.view()));
  const std::vector<attend_item> one = {{7, 1}};
  check(g.attend(one, 0, q.view(), o.out()));  // (reads what the device holds; its output is not used)
  check(g.truncate(1, 200));                   // a cut above the length before the refused append
  check(ref.fork(1, 7));

  const status s = g.check();
  REQUIRE(s.code() == errc::non_finite);
  CAPTURE(s.message());
  REQUIRE(s.message().find("sequence 1 layer 0 token 150") != std::string::npos);
  REQUIRE(s.message().find("1 row(s) refused") != std::string::npos);
  REQUIRE(s.message().find("sequence(s) 1, 7 restored") != std::string::npos);
  REQUIRE(g.check().ok());  // reported once
  for (seq_id id : {0, 1, 7}) {
    CAPTURE(id);
    for (int l = 0; l < L; ++l) REQUIRE(g.length(id, l) == ref.length(id, l));
    require_same(test::read_all(g, id), test::read_all(ref, id));
  }
  REQUIRE(g.stats().pages == ref.stats().pages);
  REQUIRE(g.stats().page_bytes == ref.stats().page_bytes);
  REQUIRE(ref_stats.tokens < ref.stats().tokens);
  REQUIRE(g.stats().tokens == ref.stats().tokens);
  // the restored sequences take appends again, as the reference does
  for (KVCache* c : {&g, &ref})
    for (seq_id id : {1, 7})
      for (int l = 0; l < L; ++l) check(c->append(id, l, more.view(), more.view()));
  REQUIRE(g.check().ok());
  for (seq_id id : {1, 7}) require_same(test::read_all(g, id), test::read_all(ref, id));
  // a released held sequence's slot serves the next sequence clean
  check(g.append(1, 0, step_bad.view(), step.view()));
  check(g.release_sequence(1));
  check(g.create_sequence(11));
  check(g.append(11, 0, more.view(), more.view()));
  const status late = g.check();
  REQUIRE(late.code() == errc::non_finite);  // the refusal is still reported, naming sequence 1
  REQUIRE(late.message().find("sequence 1 layer 0") != std::string::npos);
  REQUIRE(g.length(11, 0) == 150);
  std::vector<float> got(size_t(150) * H * D);
  check(g.read(11, 0, role::k, got));
  for (float x : got) REQUIRE(std::isfinite(x));
}

TEST_CASE("gpu contract: two streams, one prefilling while the other decodes, compute what one stream computes",
          "[gpu][contract][streams]") {
  stream_guard own, p, d;
  KVCache two = make(own.s), one = make(own.s);
  std::mt19937 rng(7);
  rows prompt(rng, 200, H), chunk_k(rng, 400, H), chunk_v(rng, 400, H), chunk_q(rng, 400, Hq);
  for (KVCache* c : {&two, &one}) {
    for (seq_id s = 0; s < 4; ++s) {
      check(c->create_sequence(s));
      for (int l = 0; l < L; ++l) check(c->append(s, l, prompt.view(), prompt.view()));
    }
    check(c->create_sequence(10));
  }
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  const std::vector<append_item> adds = {{0, 1}, {1, 1}, {2, 1}, {3, 1}};
  const std::vector<attend_item> items = {{0, 1}, {1, 1}, {2, 1}, {3, 1}};
  rows step_k(rng, 4, H), step_v(rng, 4, H), step_q(rng, 4, Hq);
  const int steps = 6;
  std::deque<rows> dec_two, dec_one, pre_two, pre_one;
  for (int i = 0; i < steps * L; ++i) dec_two.emplace_back(rng, 4, Hq), dec_one.emplace_back(rng, 4, Hq);
  for (int i = 0; i < L; ++i) pre_two.emplace_back(rng, 400, Hq), pre_one.emplace_back(rng, 400, Hq);
  // `two`: the prefill of sequence 10 on stream p, decode steps of 0-3 on stream d, issued
  // interleaved from the host; `one`: the same calls on its own stream.
  for (int l = 0; l < L; ++l) {
    check(two.prefill(10, l, chunk_k.view(), chunk_v.view(), chunk_q.view(), pre_two[size_t(l)].out(), p.s));
    check(one.prefill(10, l, chunk_k.view(), chunk_v.view(), chunk_q.view(), pre_one[size_t(l)].out()));
    for (int i = 0; i < steps / L; ++i) {
      const int at = l * (steps / L) + i;
      for (int ll = 0; ll < L; ++ll) {
        check(two.append_batch(adds, ll, step_k.view(), step_v.view(), d.s));
        check(two.attend(items, ll, step_q.view(), dec_two[size_t(at * L + ll)].out(), d.s));
        check(one.append_batch(adds, ll, step_k.view(), step_v.view()));
        check(one.attend(items, ll, step_q.view(), dec_one[size_t(at * L + ll)].out()));
      }
    }
  }
  // Sequence 10 decodes next, on stream d: d waits for p's prefill first (the caller's ordering
  // of two streams touching one sequence).
  cudaEvent_t done;
  REQUIRE(cudaEventCreateWithFlags(&done, cudaEventDisableTiming) == cudaSuccess);
  REQUIRE(cudaEventRecord(done, p.s) == cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(d.s, done, 0) == cudaSuccess);
  const std::vector<append_item> add10 = {{10, 1}};
  const std::vector<attend_item> item10 = {{10, 1}};
  rows o10_two(rng, 1, Hq), o10_one(rng, 1, Hq);
  for (int l = 0; l < L; ++l) {
    check(two.append_batch(add10, l, {step_k.dev.p, dtype::f16, 1, H, D}, {step_v.dev.p, dtype::f16, 1, H, D}, d.s));
    check(one.append_batch(add10, l, {step_k.dev.p, dtype::f16, 1, H, D}, {step_v.dev.p, dtype::f16, 1, H, D}));
  }
  check(two.attend(item10, 1, {step_q.dev.p, dtype::f16, 1, Hq, D}, o10_two.out(), d.s));
  check(one.attend(item10, 1, {step_q.dev.p, dtype::f16, 1, Hq, D}, o10_one.out()));
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  cudaEventDestroy(done);
  for (size_t i = 0; i < dec_two.size(); ++i) require_same(download(dec_two[i]), download(dec_one[i]));
  for (size_t i = 0; i < pre_two.size(); ++i) require_same(download(pre_two[i]), download(pre_one[i]));
  require_same(download(o10_two), download(o10_one));
  for (seq_id s : {0, 1, 2, 3, 10}) require_same(test::read_all(two, s), test::read_all(one, s));
  REQUIRE(two.check(d.s).ok());
  // Each stream keeps workspaces of its own (both counted)
  REQUIRE(two.stats().overhead.device_workspace > one.stats().overhead.device_workspace);
}
