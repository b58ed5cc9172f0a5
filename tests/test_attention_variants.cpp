// Attention variants (include/kvq/attention/variant.hpp): the reference against a direct double
// computation; the CPU cache's attend, prefill and attend_prefix, the model runner's
// causal_attention and the engine-pool calls against the reference for every format and head_dim;
// a sliding layer's pages going back to the budget (stats, bytes_for) and staying correct through
// fork, truncate, export / import and swap; bad variants refused by name.
#include "attention_checks.hpp"

#include <kvq/attention/cpu_attention.hpp>
#include <kvq/attention/reference.hpp>
#include <kvq/attention/variant.hpp>
#include <kvq/cache/cache.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/static_policy.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

using namespace kvq;

namespace {

using test::randn;
using test::require_close;
using test::stored;
using test::view;

// The variants every test runs: a window shorter than a page, one of several pages that does not
// divide them, soft-capping, sink logits, and all three together.
std::vector<attention_variant> variants(int q_heads, std::mt19937& rng) {
  std::vector<float> sinks(static_cast<size_t>(q_heads));
  for (auto& s : sinks) s = std::normal_distribution<float>(1.f, 2.f)(rng);
  return {{37, 0.f, {}}, {200, 0.f, {}}, {0, 2.5f, {}}, {0, 0.f, sinks}, {150, 3.f, sinks}};
}

std::string describe(const attention_variant& v) {
  return "window " + std::to_string(v.window) + " softcap " + std::to_string(v.softcap) +
         (v.sink_logits.empty() ? "" : " sinks");
}

// One cache layer per variant (layer i takes variants[i]), every page in one format pair.
KVCache make(int q_heads, int kv_heads, int d, const std::vector<attention_variant>& vars, const std::string& spec,
             uint64_t budget = 64ull << 20, int page = 64, int window = 128) {
  cache_config cfg;
  cfg.shape = {int(vars.size()), q_heads, kv_heads, d, page, window, 32};
  cfg.budget_bytes = budget;
  cfg.attention = vars;
  auto pol = std::make_shared<static_policy>(static_policy::parse(spec).value_or_throw());
  return KVCache::create(cfg, pol).value_or_throw();
}

// Appends `n` random tokens to every layer of (c, s) in chunks of 1..97.
void fill(KVCache& c, seq_id s, int64_t n, std::mt19937& rng) {
  const auto& sh = c.config().shape;
  for (int64_t done = 0; done < n;) {
    const int64_t m = std::min<int64_t>(n - done, 1 + int64_t(rng() % 97));
    for (int l = 0; l < sh.layers; ++l) {
      auto k = randn(rng, size_t(m) * sh.kv_heads * sh.head_dim), v = randn(rng, k.size());
      check(c.append(s, l, view(k.data(), m, sh.kv_heads, sh.head_dim), view(v.data(), m, sh.kv_heads, sh.head_dim)));
    }
    done += m;
  }
}

// Every layer of (c, s): appends q_len tokens, attends them, compares with the reference.
void step_and_check(KVCache& c, seq_id s, int q_len, std::mt19937& rng, double tol = 1e-5) {
  const auto& sh = c.config().shape;
  const int H = sh.kv_heads, Hq = sh.q_heads, d = sh.head_dim;
  for (int l = 0; l < sh.layers; ++l) {
    auto k = randn(rng, size_t(q_len) * H * d), v = randn(rng, k.size()), q = randn(rng, size_t(q_len) * Hq * d, 2.f);
    check(c.append(s, l, view(k.data(), q_len, H, d), view(v.data(), q_len, H, d)));
    std::vector<float> o(q.size()), want(q.size());
    const attend_item it{s, q_len};
    check(c.attend({&it, 1}, l, view(q.data(), q_len, Hq, d), {o.data(), dtype::f32, q_len, Hq, d}));
    const int64_t n = c.length(s, l);
    auto kf = stored(c, s, l, role::k, n - q_len, k), vf = stored(c, s, l, role::v, n - q_len, v);
    ref::attend(kf.data(), vf.data(), n, q.data(), q_len, Hq, H, d, 1.f / std::sqrt(float(d)), want.data(),
                c.config().attention[size_t(l)]);
    CAPTURE(l, describe(c.config().attention[size_t(l)]), n, q_len);
    require_close(o, want, tol);
  }
}

}  // namespace

TEST_CASE("the reference applies window, soft-capping and sink logits as their definitions say", "[variants]") {
  std::mt19937 rng(3);
  const int Hq = 4, H = 2, d = 16, n = 40, q_len = 3;
  auto k = randn(rng, size_t(n) * H * d), v = randn(rng, k.size()), q = randn(rng, size_t(q_len) * Hq * d, 2.f);
  const float scale = 0.25f;
  for (const attention_variant& var : variants(Hq, rng)) {
    CAPTURE(describe(var));
    std::vector<float> o(q.size());
    ref::attend(k.data(), v.data(), n, q.data(), q_len, Hq, H, d, scale, o.data(), var);
    double worst = 0;
    for (int i = 0; i < q_len; ++i)
      for (int h = 0; h < Hq; ++h) {
        const int64_t pos = n - q_len + i, lo = var.window ? std::max<int64_t>(0, pos - var.window + 1) : 0;
        std::vector<double> w;
        for (int64_t j = lo; j <= pos; ++j) {
          double s = 0;
          for (int c = 0; c < d; ++c) s += double(q[size_t((i * Hq + h) * d + c)]) * k[size_t((j * H + h / 2) * d + c)];
          s *= scale;
          if (var.softcap > 0) s = var.softcap * std::tanh(s / var.softcap);
          w.push_back(s);
        }
        double sum = var.sink_logits.empty() ? 0.0 : std::exp(double(var.sink_logits[size_t(h)]));
        for (double& x : w) sum += (x = std::exp(x));
        for (int c = 0; c < d; ++c) {
          double want = 0;
          for (size_t t = 0; t < w.size(); ++t) want += w[t] / sum * v[size_t(((lo + int64_t(t)) * H + h / 2) * d + c)];
          worst = std::max(worst, std::fabs(want - o[size_t((i * Hq + h) * d + c)]));
        }
      }
    CHECK(worst < 1e-5);
  }
}

TEST_CASE("attend and prefill with attention variants equal the reference, every format and head_dim",
          "[variants][cpu_attention]") {
  const int d = GENERATE(64, 128, 256);
  std::mt19937 rng{uint32_t(d)};
  const int Hq = 4, H = 2;
  const auto vars = variants(Hq, rng);
  // every family at the widths pages of 64 tokens and this head_dim take, and a mix per head
  for (const std::string spec : {"fp16", "int8", "k=kivi4/g32,v=kivi2/g32", "kivi3/g32", "fp8", "nvfp4", "cb4",
                                 "ra4/g32", "k=kivi2/g32,v=int8;1=fp8;2.1=k=fp8,v=kivi4/g32"}) {
    CAPTURE(d, spec);
    KVCache c = make(Hq, H, d, vars, spec);
    check(c.create_sequence(0));
    fill(c, 0, 301, rng);
    step_and_check(c, 0, 1, rng);
    step_and_check(c, 0, 9, rng);
    fill(c, 0, 200, rng);
    step_and_check(c, 0, 1, rng);
    // a prefill chunk of more than the ring, after the stored prefix
    for (int l = 0; l < c.config().shape.layers; ++l) {
      const int64_t before = c.length(0, l), T = 300;
      auto k = randn(rng, size_t(T) * H * d), v = randn(rng, k.size()), q = randn(rng, size_t(T) * Hq * d, 2.f);
      std::vector<float> o(q.size()), want(q.size());
      check(c.prefill(0, l, view(k.data(), T, H, d), view(v.data(), T, H, d), view(q.data(), T, Hq, d),
                      {o.data(), dtype::f32, T, Hq, d}));
      auto kf = stored(c, 0, l, role::k, before, k), vf = stored(c, 0, l, role::v, before, v);
      ref::attend(kf.data(), vf.data(), before + T, q.data(), int(T), Hq, H, d, 1.f / std::sqrt(float(d)), want.data(),
                  vars[size_t(l)]);
      CAPTURE(l, describe(vars[size_t(l)]), before);
      require_close(o, want);
    }
    step_and_check(c, 0, 1, rng);
  }
}

TEST_CASE("a sliding layer returns the pages its window left behind, and fork, truncate and export stay correct",
          "[variants][store]") {
  std::mt19937 rng(9);
  const int Hq = 4, H = 2, d = 64, W = 150;
  const std::vector<attention_variant> vars = {{W, 0.f, {}}, {0, 0.f, {}}};  // layer 0 slides, layer 1 is global
  KVCache c = make(Hq, H, d, vars, "k=kivi4/g32,v=kivi2/g32");
  check(c.create_sequence(0));
  fill(c, 0, 2000, rng);
  std::vector<float> kr(size_t(2000) * H * d);
  check(c.read(0, 0, role::k, kr));
  REQUIRE(std::all_of(kr.begin(), kr.begin() + 1600 * H * d, [](float x) { return x == 0.f; }));  // released: 0
  step_and_check(c, 0, 1, rng);
  fill(c, 0, 1000, rng);
  step_and_check(c, 0, 1, rng);
  // the sliding layer holds the pages its window reaches (at most ceil(W / 64) + 2 per kv head and
  // role, the one being filled included), the global layer every page
  const uint64_t global_pages = uint64_t(c.length(0, 1) - 32) / 64 * H * 2;
  CAPTURE(c.stats().pages, global_pages);
  REQUIRE(c.stats().pages >= global_pages);
  REQUIRE(c.stats().pages <= global_pages + uint64_t((W + 63) / 64 + 2) * H * 2);
  // tokens held: the global layer's all, the sliding layer's from its first live page on, so that
  // total_bits is bits per element held (an FP16 window costs 16, not 16 x the share still held)
  const cache_stats held = c.stats();
  const int64_t n = c.length(0, 0), sliding_held = held.tokens - n;
  CAPTURE(n, held.tokens);
  REQUIRE(sliding_held >= W);
  REQUIRE(sliding_held <= ((W + 63) / 64 + 2) * 64);
  REQUIRE(held.encoded_elements <= uint64_t(held.tokens) * H * d * 2);
  REQUIRE(held.total_bits(H, d) >= held.page_bits());

  SECTION("bytes_for counts the sliding layer's net growth") {
    // the cache with only the global layer grows like this one does
    KVCache g = make(Hq, H, d, {vars[1]}, "k=kivi4/g32,v=kivi2/g32");
    check(g.create_sequence(0));
    std::mt19937 r2(1);
    fill(g, 0, 3001, r2);
    const uint64_t mine = c.bytes_for(1024, seq_id(0)).value(), global = g.bytes_for(1024, seq_id(0)).value();
    CAPTURE(mine, global);
    REQUIRE(mine <= global);  // the sliding layer's new pages are offset by the ones it returns
    // and appending that many tokens one step at a time takes what it says
    const uint64_t before = c.stats().used_bytes;
    for (int i = 0; i < 1024; ++i)
      for (int l = 0; l < 2; ++l) {
        auto k = randn(rng, size_t(H) * d), v = randn(rng, k.size());
        check(c.append(0, l, view(k.data(), 1, H, d), view(v.data(), 1, H, d)));
      }
    REQUIRE(c.stats().used_bytes - before == mine);
  }
  SECTION("fork shares the live pages; the fork and the parent go on independently") {
    check(c.fork(0, 1));
    REQUIRE(c.stats().tokens == 2 * held.tokens);
    step_and_check(c, 1, 1, rng);
    step_and_check(c, 0, 3, rng);
    check(c.release_sequence(0));
    step_and_check(c, 1, 1, rng);
  }
  SECTION("truncate keeps what the window needs and refuses a cut below it, changing nothing") {
    const int64_t n = c.length(0, 0);
    const uint64_t used = c.stats().used_bytes;
    const status st = c.truncate(0, n - 400);
    REQUIRE(st.code() == errc::invalid_argument);
    REQUIRE(st.message().find("sliding layer") != std::string::npos);
    REQUIRE(c.length(0, 0) == n);
    REQUIRE(c.stats().used_bytes == used);
    check(c.truncate(0, n - 30));
    step_and_check(c, 0, 1, rng);
  }
  SECTION("export and import move a sliding layer's live pages only; a cache with other windows refuses it") {
    const auto blob = c.export_sequences(std::vector<seq_id>{0}).value_or_throw();
    KVCache d2 = make(Hq, H, d, vars, "k=kivi4/g32,v=kivi2/g32");
    check(d2.import_sequences(blob, std::vector<seq_id>{5}));
    REQUIRE(d2.stats().used_bytes <= c.stats().used_bytes);
    REQUIRE(d2.stats().tokens == c.stats().tokens);
    for (role r : {role::k, role::v}) {
      std::vector<float> a(size_t(c.length(0, 0)) * H * d), b(a.size());
      check(c.read(0, 0, r, a));
      check(d2.read(5, 0, r, b));
      REQUIRE(a == b);
    }
    step_and_check(d2, 5, 1, rng);
    KVCache other = make(Hq, H, d, {{W + 1, 0.f, {}}, {0, 0.f, {}}}, "k=kivi4/g32,v=kivi2/g32");
    const status st = other.import_sequences(blob, std::vector<seq_id>{5});
    REQUIRE(st.code() == errc::invalid_argument);
    REQUIRE(st.message().find("sliding window") != std::string::npos);
  }
  SECTION("an attend of tokens appended before the last append of a sliding layer is refused") {
    for (int i = 0; i < 3; ++i) {
      auto k = randn(rng, size_t(40) * H * d), v = randn(rng, k.size());
      check(c.append(0, 0, view(k.data(), 40, H, d), view(v.data(), 40, H, d)));
    }
    std::vector<float> q(size_t(120) * Hq * d), o(q.size());
    const attend_item it{0, 120};
    const status st = c.attend({&it, 1}, 0, view(q.data(), 120, Hq, d), {o.data(), dtype::f32, 120, Hq, d});
    CAPTURE(st.message());
    REQUIRE(st.code() == errc::invalid_argument);
    REQUIRE(st.message().find("released") != std::string::npos);
  }
}

TEST_CASE("causal_attention with attention variants equals the reference", "[variants][cpu_attention]") {
  cpu::worker_pool pool(2);
  const cpu::task_runner run = [&](int n, const std::function<void(int)>& fn) { pool.run(n, fn); };
  std::mt19937 rng(21);
  const int Hq = 6, H = 2;
  for (const int d : {64, 256})
    for (const attention_variant& var : variants(Hq, rng))
      for (const auto [T, pos0] : {std::pair<int64_t, int64_t>{70, 0}, {33, 300}, {130, 90}}) {
        CAPTURE(d, describe(var), T, pos0);
        const int64_t n = pos0 + T;
        auto q = randn(rng, size_t(T) * Hq * d, 2.f), k = randn(rng, size_t(n) * H * d), v = randn(rng, k.size());
        std::vector<float> o(q.size()), want(q.size());
        cpu::causal_attention(run, q.data(), k.data(), v.data(), o.data(), T, pos0, Hq, H, d,
                              1.f / std::sqrt(float(d)), var);
        ref::attend(k.data(), v.data(), n, q.data(), int(T), Hq, H, d, 1.f / std::sqrt(float(d)), want.data(), var);
        require_close(o, want);
      }
}

TEST_CASE("bad attention variants are refused by name", "[variants][errors]") {
  cache_config cfg;
  cfg.shape = {2, 4, 2, 64, 64, 128, 32};
  cfg.budget_bytes = 1 << 24;
  const auto pol = [] { return std::make_shared<static_policy>(static_policy::parse("fp16").value_or_throw()); };
  const auto refused = [&](std::vector<attention_variant> vars, const char* words) {
    cfg.attention = std::move(vars);
    auto c = KVCache::create(cfg, pol());
    REQUIRE(!c);
    CAPTURE(c.error().message());
    REQUIRE(c.error().message().find(words) != std::string::npos);
  };
  refused({{}}, "1 variants for 2 layers");
  refused({{}, {-1, 0.f, {}}}, "layer 1: sliding window -1");
  refused({{0, -2.f, {}}, {}}, "softcap -2");
  refused({{0, NAN, {}}, {}}, "softcap");
  refused({{}, {0, 0.f, {1.f, 2.f}}}, "2 sink logits for 4 query heads");
  refused({{}, {0, 0.f, {1.f, 2.f, INFINITY, 0.f}}}, "sink logit of query head 2");
  cfg.attention = {{128, 0.f, {}}, {}};
  REQUIRE(KVCache::create(cfg, pol()).ok());
}
