// The Llama forward pass: stories260K against its float64 golden reference, the FP16 cache
// against the no-cache reference path, bad models rejected with the right message, and SmolLM2
// end to end when its file is present.
#include <catch2/catch.hpp>
#include <cmath>
#include <iostream>
#include <llama/model.hpp>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "catch_skip.hpp"
#include "test_util.hpp"

using namespace kvq::llama;
using kvq::errc;

namespace {

const llama_model& stories() {
  static const llama_model m = [] {
    auto r = llama_model::load(test::stories_path());
    if (!r) FAIL(r.error().to_string());
    return std::move(r).value();
  }();
  return m;
}

struct golden_position {
  token_id input;
  double logsumexp;
  std::vector<std::pair<token_id, double>> top;
};

std::vector<golden_position> golden() {
  const auto j = nlohmann::json::parse(test::read_text(test::stories_dir() + "/golden.json"));
  std::vector<golden_position> out;
  for (const auto& p : j["positions"]) {
    golden_position g{p["input"].get<token_id>(), p["logsumexp"].get<double>(), {}};
    for (const auto& t : p["top"]) g.top.emplace_back(t[0].get<token_id>(), t[1].get<double>());
    out.push_back(std::move(g));
  }
  return out;
}

double logsumexp(std::span<const float> x) {
  double mx = -INFINITY;
  for (float v : x) mx = std::max(mx, double(v));
  double s = 0;
  for (float v : x) s += std::exp(double(v) - mx);
  return mx + std::log(s);
}

// Checks one position's logits (logsumexp, the top-8 logits, the argmax) against the golden
// entry within `tol`; returns the largest deviation.
double check_position(const golden_position& g, std::span<const float> logits, int pos, double tol) {
  CAPTURE(pos);
  double worst = std::fabs(logsumexp(logits) - g.logsumexp);
  CHECK(std::fabs(logsumexp(logits) - g.logsumexp) < tol);
  for (const auto& [id, want] : g.top) {
    CAPTURE(id);
    const double got = logits[size_t(id)];
    CHECK(std::fabs(got - want) < tol);
    worst = std::max(worst, std::fabs(got - want));
  }
  CHECK(argmax(logits) == g.top[0].first);
  return worst;
}

constexpr uint64_t budget = 64ull << 20;

/// `n` token ids drawn from `rng`, uniform over stories260K's vocabulary of 512.
std::vector<token_id> random_tokens(std::mt19937& rng, size_t n) {
  std::vector<token_id> t(n);
  for (auto& x : t) x = token_id(rng() % 512);
  return t;
}

kvq::KVCache fp16_cache(const llama_model& m, int page_tokens = 64, int window = 128, int recent = 64) {
  auto c = make_cache(m, "fp16", budget, page_tokens, window, recent);
  if (!c) FAIL(c.error().to_string());
  return std::move(c).value();
}

// The quote of the README: the line that starts with "> ".
std::string readme_text() {
  const std::string md = test::read_text(test::stories_dir() + "/README.md");
  const size_t at = md.find("\n> ");
  REQUIRE(at != std::string::npos);
  const size_t end = md.find('\n', at + 3);
  return md.substr(at + 3, end - at - 3);
}

}  // namespace

TEST_CASE("stories260K hyper-parameters and tied output", "[model]") {
  const auto& hp = stories().hparams();
  CHECK(hp.n_vocab == 512);
  CHECK(hp.n_embd == 64);
  CHECK(hp.n_layer == 5);
  CHECK(hp.n_head == 8);
  CHECK(hp.n_head_kv == 4);
  CHECK(hp.head_dim == 8);
  CHECK(hp.n_ff == 172);
  CHECK(hp.n_rot == 8);
  CHECK(hp.rope_base == 10000.f);
  CHECK(hp.rms_eps == Approx(1e-5));
  CHECK(stories().tied_output());
}

// The golden reference is a float64 forward pass: float32 matches it to ~1e-5 (README: about
// 1e-4), so the no-cache path is held to 1e-3. An FP16 cache stores K and V rounded to fp16
// (relative error up to 2^-11), which moves stories260K's logits by up to ~0.01 (measured:
// 0.0097 over the 48 positions): the cache paths are held to 2e-2 and must pick the golden
// argmax at every position; the exactness of the cache itself is tested further below against
// the no-cache path with the same fp16 rounding (1e-4).
TEST_CASE("stories260K matches the float64 golden logits", "[model]") {
  const auto gold = golden();
  REQUIRE(gold.size() == 48);
  const llama_model& m = stories();
  const size_t V = 512;
  const double cache_tol = 2e-2;
  std::vector<float> logits(V);
  std::vector<token_id> in;
  for (const auto& g : gold) in.push_back(g.input);

  SECTION("reference path (no cache), one token at a time: 1e-3") {
    reference_kv kv;
    double worst = 0;
    for (size_t p = 0; p < gold.size(); ++p) {
      const token_id t = gold[p].input;
      REQUIRE(m.forward_reference(kv, std::span(&t, 1), logits).ok());
      worst = std::max(worst, check_position(gold[p], logits, int(p), 1e-3));
    }
    std::cerr << "golden, no-cache float path: largest deviation " << worst << "\n";
  }
  SECTION("reference path (no cache), the 48 tokens as one chunk: 1e-3") {
    reference_kv kv;
    std::vector<float> all(in.size() * V);
    REQUIRE(m.forward_reference(kv, in, all, logits_mode::all).ok());
    for (size_t p = 0; p < gold.size(); ++p) check_position(gold[p], std::span(all).subspan(p * V, V), int(p), 1e-3);
  }
  SECTION("FP16 cache, decode one token at a time") {
    auto cache = fp16_cache(m);
    REQUIRE(cache.create_sequence(7).ok());
    double worst = 0;
    for (size_t p = 0; p < gold.size(); ++p) {
      const token_id t = gold[p].input;
      REQUIRE(m.forward(cache, 7, std::span(&t, 1), logits).ok());
      worst = std::max(worst, check_position(gold[p], logits, int(p), cache_tol));
    }
    std::cerr << "golden, FP16 cache decode: largest deviation " << worst << "\n";
    CHECK(cache.length(7, 0) == 48);
    CHECK(cache.length(7, 4) == 48);
  }
  SECTION("FP16 cache, the 48 tokens as one prefill chunk, logits of every position") {
    auto cache = fp16_cache(m);
    REQUIRE(cache.create_sequence(0).ok());
    std::vector<float> all(in.size() * V);
    REQUIRE(m.forward(cache, 0, in, all, logits_mode::all).ok());
    for (size_t p = 0; p < gold.size(); ++p)
      check_position(gold[p], std::span(all).subspan(p * V, V), int(p), cache_tol);
  }
  SECTION("FP16 cache with 32-token pages and window: the 48 tokens as one chunk longer than the window") {
    auto cache = fp16_cache(m, 32, 32, 0);
    REQUIRE(cache.create_sequence(0).ok());
    std::vector<float> all(in.size() * V);
    REQUIRE(m.forward(cache, 0, in, all, logits_mode::all).ok());
    CHECK(cache.stats().pages > 0);
    for (size_t p = 0; p < gold.size(); ++p)
      check_position(gold[p], std::span(all).subspan(p * V, V), int(p), cache_tol);
  }
}

TEST_CASE("greedy decoding from BOS through the FP16 cache reproduces the README text", "[model]") {
  const llama_model& m = stories();
  auto f = gguf_file::open(test::stories_path());
  REQUIRE(f.ok());
  auto tok = tokenizer::from_gguf(*f);
  REQUIRE(tok.ok());
  auto cache = fp16_cache(m);
  REQUIRE(cache.create_sequence(1).ok());
  std::vector<float> logits(512);
  std::vector<token_id> out;
  token_id t = tok->bos();
  for (int i = 0; i < 48; ++i) {
    REQUIRE(m.forward(cache, 1, std::span(&t, 1), logits).ok());
    t = argmax(logits);
    out.push_back(t);
  }
  const std::string text = tok->decode(out).value();
  const std::string want = readme_text();
  REQUIRE(want.rfind("Once upon a time", 0) == 0);
  CHECK(text == " " + want);
}

TEST_CASE("forward through the FP16 cache equals the no-cache forward", "[model]") {
  const llama_model& m = stories();
  const size_t V = 512;
  // 300 seeded random tokens: one prefill chunk (longer than the window: KVCache::prefill) through
  // 64-token pages, then 40 decode steps; every position's logits are compared.
  const uint64_t seed = 99;
  std::mt19937 rng(seed);
  CAPTURE(seed);
  const auto prompt = random_tokens(rng, 300);
  const auto decode = random_tokens(rng, 40);

  auto cache = fp16_cache(m);
  REQUIRE(cache.create_sequence(3).ok());
  std::vector<float> got(prompt.size() * V);
  REQUIRE(m.forward(cache, 3, prompt, got, logits_mode::all).ok());
  CHECK(cache.stats().pages > 0);

  // Two references: K/V rounded to fp16 as an FP16 cache stores them (isolates the cache's
  // attention), and plain float (the whole difference an FP16 cache makes).
  reference_kv ref16, ref32;
  ref16.round_to_f16 = true;
  std::vector<float> want16(prompt.size() * V), want32(prompt.size() * V);
  REQUIRE(m.forward_reference(ref16, prompt, want16, logits_mode::all).ok());
  REQUIRE(m.forward_reference(ref32, prompt, want32, logits_mode::all).ok());

  double d16 = 0, d32 = 0;
  auto compare = [&](std::span<const float> a, std::span<const float> b16, std::span<const float> b32) {
    for (size_t i = 0; i < a.size(); ++i) {
      d16 = std::max(d16, double(std::fabs(a[i] - b16[i])));
      d32 = std::max(d32, double(std::fabs(a[i] - b32[i])));
    }
  };
  compare(got, want16, want32);
  std::vector<float> g(V), w16(V), w32(V);
  for (token_id t : decode) {
    REQUIRE(m.forward(cache, 3, std::span(&t, 1), g).ok());
    REQUIRE(m.forward_reference(ref16, std::span(&t, 1), w16).ok());
    REQUIRE(m.forward_reference(ref32, std::span(&t, 1), w32).ok());
    compare(g, w16, w32);
  }
  std::cerr << "fp16 cache vs no-cache forward over 340 positions: max |dlogit| " << d16 << " (K/V rounded to fp16), "
            << d32 << " (plain float)\n";
  // d16: the fp32 summation order of the cache's vector attention against the reference's plain
  // loops (measured 0.0017 for seed 99), an order below what fp16 storage of K and V does (d32,
  // measured 0.019).
  CHECK(d16 < 1e-2);
  CHECK(d32 < 5e-2);
}

TEST_CASE("prefill_shared: one prompt into two caches, as the FP16 reference computes it", "[model]") {
  const llama_model& m = stories();
  const auto& hp = m.hparams();
  const size_t V = 512;
  // 600 seeded random tokens: two chunks of prefill_shared (512 + 88); the second cache has
  // another paging (window 64), so its appends are split differently.
  const uint64_t seed = 7;
  std::mt19937 rng(seed);
  CAPTURE(seed);
  const auto prompt = random_tokens(rng, 600);
  const auto decode = random_tokens(rng, 12);

  auto a = fp16_cache(m);
  auto b = fp16_cache(m, 32, 64, 32);
  REQUIRE(a.create_sequence(1).ok());
  REQUIRE(b.create_sequence(5).ok());
  kvq::KVCache* caches[] = {&a, &b};
  const kvq::seq_id seqs[] = {1, 5};
  std::vector<float> got(prompt.size() * V);
  REQUIRE(m.prefill_shared(caches, seqs, prompt, got, logits_mode::all).ok());
  CHECK(a.length(1, hp.n_layer - 1) == 600);
  CHECK(b.length(5, 0) == 600);

  reference_kv ref16;
  ref16.round_to_f16 = true;
  std::vector<float> want(prompt.size() * V);
  REQUIRE(m.forward_reference(ref16, prompt, want, logits_mode::all).ok());
  double worst = 0;
  double sum = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, double(std::fabs(got[i] - want[i])));
    sum += std::fabs(got[i] - want[i]);
  }
  std::cerr << "prefill_shared vs fp16-rounded reference over 600 positions: max |dlogit| " << worst << ", mean "
            << sum / double(got.size()) << "\n";
  // The blocked attention sums in another order than the reference's plain loop (both within
  // 1e-5 of double, tests/test_cpu_attention.cpp's causal_attention case); on random tokens
  // stories260K carries that float noise to about 0.02 in the logits by position 600 (with
  // kvq::ref::attend in place of kvq::cpu::causal_attention the logits are equal bit for bit).
  CHECK(worst < 5e-2);
  CHECK(sum / double(got.size()) < 2e-3);
  // the last-token mode gives the last row of mode all
  {
    auto c = fp16_cache(m);
    REQUIRE(c.create_sequence(0).ok());
    kvq::KVCache* one[] = {&c};
    const kvq::seq_id zero[] = {0};
    std::vector<float> last(V);
    REQUIRE(m.prefill_shared(one, zero, prompt, last).ok());
    for (size_t i = 0; i < V; ++i) CHECK(last[i] == got[(prompt.size() - 1) * V + i]);
  }

  // Both caches hold the same K/V, bit for bit, and what a per-cache prefill stores (up to the
  // fp16 rounding of slightly different float activations).
  auto own = fp16_cache(m);
  REQUIRE(own.create_sequence(0).ok());
  std::vector<float> own_logits(V);
  REQUIRE(m.forward(own, 0, prompt, own_logits).ok());
  const size_t n = prompt.size() * size_t(hp.n_head_kv) * size_t(hp.head_dim);
  std::vector<float> ra(n), rb(n), ro(n);
  double kv_worst = 0;
  for (int l = 0; l < hp.n_layer; ++l)
    for (kvq::role r : {kvq::role::k, kvq::role::v}) {
      CAPTURE(l);
      REQUIRE(a.read(1, l, r, ra).ok());
      REQUIRE(b.read(5, l, r, rb).ok());
      REQUIRE(own.read(0, l, r, ro).ok());
      CHECK(ra == rb);
      for (size_t i = 0; i < n; ++i)
        kv_worst = std::max(kv_worst, double(std::fabs(ra[i] - ro[i])) / std::max(1.0, double(std::fabs(ro[i]))));
    }
  CHECK(kv_worst < 1e-2);  // the same float noise, seen through fp16 rounding
  // layer 0's K and V come from the embeddings alone: equal bit for bit
  REQUIRE(a.read(1, 0, kvq::role::k, ra).ok());
  REQUIRE(own.read(0, 0, kvq::role::k, ro).ok());
  CHECK(ra == ro);
  REQUIRE(a.read(1, 0, kvq::role::v, ra).ok());
  REQUIRE(own.read(0, 0, kvq::role::v, ro).ok());
  CHECK(ra == ro);

  // decoding goes on from the shared prompt through each cache as usual
  std::vector<float> ga(V), gb(V), w(V);
  double dec_worst = 0;
  for (token_id t : decode) {
    REQUIRE(m.forward(a, 1, std::span(&t, 1), ga).ok());
    REQUIRE(m.forward(b, 5, std::span(&t, 1), gb).ok());
    REQUIRE(m.forward_reference(ref16, std::span(&t, 1), w).ok());
    for (size_t i = 0; i < V; ++i)
      dec_worst = std::max({dec_worst, double(std::fabs(ga[i] - w[i])), double(std::fabs(gb[i] - w[i]))});
  }
  CHECK(dec_worst < 5e-2);
}

TEST_CASE("prefill_shared errors name the problem and store nothing", "[model]") {
  const llama_model& m = stories();
  auto a = fp16_cache(m);
  auto b = fp16_cache(m);
  REQUIRE(a.create_sequence(0).ok());
  REQUIRE(b.create_sequence(0).ok());
  std::vector<float> logits(512);
  const std::vector<token_id> prompt = {1, 5, 9, 13};
  kvq::KVCache* both[] = {&a, &b};
  const kvq::seq_id zeros[] = {0, 0};

  const kvq::seq_id one_seq[] = {0};
  auto s = m.prefill_shared(both, one_seq, prompt, logits);
  CHECK(s.code() == errc::invalid_argument);
  CHECK_THAT(s.message(), Catch::Contains("2 caches but 1 sequences"));

  s = m.prefill_shared({}, {}, prompt, logits);
  CHECK_THAT(s.message(), Catch::Contains("no cache"));

  kvq::KVCache* with_null[] = {&a, nullptr};
  s = m.prefill_shared(with_null, zeros, prompt, logits);
  CHECK_THAT(s.message(), Catch::Contains("cache 1 is null"));

  kvq::KVCache* twice[] = {&a, &a};
  s = m.prefill_shared(twice, zeros, prompt, logits);
  CHECK_THAT(s.message(), Catch::Contains("sequence 0 of cache 1 is given twice"));

  const kvq::seq_id unknown[] = {0, 9};
  s = m.prefill_shared(both, unknown, prompt, logits);
  CHECK(s.code() == errc::not_found);
  CHECK_THAT(s.message(), Catch::Contains("sequence 9 is not in cache 1"));

  const token_id t = 3;
  REQUIRE(m.forward(b, 0, std::span(&t, 1), logits).ok());
  s = m.prefill_shared(both, zeros, prompt, logits);
  CHECK(s.code() == errc::invalid_argument);
  CHECK_THAT(s.message(), Catch::Contains("sequence 0 of cache 1 already holds 1 tokens; it must be empty"));
  CHECK(a.length(0, 0) == 0);  // nothing was appended to the first cache either

  // a cache whose budget cannot take the prompt: the error, and both sequences empty again
  auto tight = make_cache(m, "fp16", 200ull << 10);  // the windows (80 KiB) and a few pages
  REQUIRE(tight.ok());
  REQUIRE(tight.value().create_sequence(0).ok());
  auto c = fp16_cache(m);
  REQUIRE(c.create_sequence(0).ok());
  std::vector<token_id> longer(2000, 7);
  kvq::KVCache* budgeted[] = {&c, &tight.value()};
  s = m.prefill_shared(budgeted, zeros, longer, logits);
  CHECK_FALSE(s.ok());
  CAPTURE(s.message());
  CHECK(c.length(0, 0) == 0);
  CHECK(tight.value().length(0, 0) == 0);
}

TEST_CASE("forward_lanes: one step of several streams equals each stream's own forward", "[model]") {
  const llama_model& m = stories();
  std::mt19937 rng(41);
  // Three lanes at different positions, paging and windows; the twins take the same steps alone.
  const int shapes[3][3] = {{64, 128, 64}, {32, 64, 16}, {32, 96, 32}};
  const size_t prompt_len[3] = {5, 70, 150};
  std::vector<kvq::KVCache> lanes, twins;
  for (int i = 0; i < 3; ++i) {
    lanes.push_back(fp16_cache(m, shapes[i][0], shapes[i][1], shapes[i][2]));
    twins.push_back(fp16_cache(m, shapes[i][0], shapes[i][1], shapes[i][2]));
  }
  std::vector<float> logits(512), lane_logits(3 * 512);
  for (int i = 0; i < 3; ++i) {
    const auto prompt = random_tokens(rng, prompt_len[i]);
    for (auto* c : {&lanes[size_t(i)], &twins[size_t(i)]}) {
      REQUIRE(c->create_sequence(0).ok());
      REQUIRE(m.forward(*c, 0, prompt, logits).ok());
    }
  }
  // a fourth lane: a second sequence of the first lane's cache (its twin: sequence 1 of twins[0])
  const auto prompt4 = random_tokens(rng, 40);
  for (auto* c : {&lanes[0], &twins[0]}) {
    REQUIRE(c->create_sequence(1).ok());
    REQUIRE(m.forward(*c, 1, prompt4, logits).ok());
  }
  kvq::KVCache* ptrs[] = {&lanes[0], &lanes[1], &lanes[2], &lanes[0]};
  const kvq::seq_id seqs[] = {0, 0, 0, 1};
  lane_logits.resize(4 * 512);
  std::vector<double> seconds(4, 0.0);
  // decode steps (one token per lane) and chunks of a few tokens per lane (up to the smallest window)
  for (int step = 0; step < 40; ++step) {
    const size_t C = step % 4 == 3 ? size_t(1 + step % 29) : 1;
    const auto toks = random_tokens(rng, 4 * C);
    lane_logits.resize(4 * C * 512);
    logits.resize(C * 512);
    REQUIRE(m.forward_lanes(ptrs, seqs, toks, lane_logits, seconds).ok());
    for (size_t i = 0; i < 4; ++i) {
      kvq::KVCache& twin = twins[i == 3 ? 0 : i];
      REQUIRE(m.forward(twin, seqs[i], std::span(&toks[i * C], C), logits, logits_mode::all).ok());
      CAPTURE(step, i, C);
      // each product's dot runs per token, so the lanes' logits are the twins' bit for bit
      CHECK(std::equal(logits.begin(), logits.end(), lane_logits.begin() + std::ptrdiff_t(i * C * 512)));
      CHECK(ptrs[i]->length(seqs[i], 0) == twin.length(seqs[i], 0));
    }
  }
  for (double s : seconds) CHECK(s > 0);
}

TEST_CASE("forward_lanes errors name the problem and append nothing", "[model]") {
  const llama_model& m = stories();
  auto a = fp16_cache(m);
  auto b = fp16_cache(m);
  REQUIRE(a.create_sequence(0).ok());
  REQUIRE(b.create_sequence(0).ok());
  kvq::KVCache* both[] = {&a, &b};
  const kvq::seq_id zeros[] = {0, 0};
  const token_id two[] = {3, 4};
  std::vector<float> logits(2 * 512);

  const token_id one[] = {3};
  auto s = m.forward_lanes(both, zeros, one, logits);
  CHECK(s.code() == errc::invalid_argument);
  CHECK_THAT(s.message(), Catch::Contains("1 tokens for 2 lanes"));

  std::vector<float> short_logits(512);
  s = m.forward_lanes(both, zeros, two, short_logits);
  CHECK_THAT(s.message(), Catch::Contains("logits hold 512 floats"));

  const token_id outside[] = {3, 900};
  s = m.forward_lanes(both, zeros, outside, logits);
  CHECK_THAT(s.message(), Catch::Contains("id 900"));

  const token_id three[] = {3, 4, 5};
  s = m.forward_lanes(both, zeros, three, logits);
  CHECK_THAT(s.message(), Catch::Contains("3 tokens for 2 lanes (the same number for each lane)"));

  const std::vector<token_id> long_chunks(2 * 129, 3);  // 129 tokens per lane, windows of 128
  std::vector<float> long_logits(long_chunks.size() * 512);
  s = m.forward_lanes(both, zeros, long_chunks, long_logits);
  CHECK_THAT(s.message(), Catch::Contains("129 tokens per lane; cache 0 takes at most its window 128"));

  std::vector<double> seconds(1);
  s = m.forward_lanes(both, zeros, two, logits, seconds);
  CHECK_THAT(s.message(), Catch::Contains("1 timings for 2 lanes"));

  kvq::KVCache* twice[] = {&a, &a};
  s = m.forward_lanes(twice, zeros, two, logits);
  CHECK_THAT(s.message(), Catch::Contains("forward_lanes: sequence 0 of cache 1 is given twice"));

  const kvq::seq_id unknown[] = {0, 9};
  s = m.forward_lanes(both, unknown, two, logits);
  CHECK(s.code() == errc::not_found);
  CHECK(a.length(0, 0) == 0);
  CHECK(b.length(0, 0) == 0);
}

TEST_CASE("layer_observer sees every layer's q, k, v after RoPE", "[model]") {
  const llama_model& m = stories();
  const auto& hp = m.hparams();
  std::vector<token_id> prompt(150);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = token_id((i * 37 + 5) % 512);
  // one chunk through the cache (longer than the window) and through the reference: the observer's K
  // is what the cache stores (up to its fp16 rounding) and what the reference keeps.
  std::vector<std::vector<float>> ks(size_t(hp.n_layer));
  std::vector<int64_t> calls(size_t(hp.n_layer), 0);
  const layer_observer obs = [&](int l, int64_t pos0, std::span<const float> q, std::span<const float> k,
                                 std::span<const float> v) {
    const size_t T = k.size() / size_t(hp.n_head_kv * hp.head_dim);
    CHECK(q.size() == T * size_t(hp.n_head * hp.head_dim));
    CHECK(v.size() == k.size());
    CHECK(pos0 == int64_t(ks[size_t(l)].size()) / (hp.n_head_kv * hp.head_dim));
    ks[size_t(l)].insert(ks[size_t(l)].end(), k.begin(), k.end());
    ++calls[size_t(l)];
  };
  auto cache = fp16_cache(m);
  REQUIRE(cache.create_sequence(1).ok());
  std::vector<float> logits(size_t(hp.n_vocab));
  REQUIRE(m.forward(cache, 1, prompt, logits, logits_mode::last, obs).ok());
  for (int l = 0; l < hp.n_layer; ++l) {
    CHECK(calls[size_t(l)] == 1);
    std::vector<float> stored(ks[size_t(l)].size());
    REQUIRE(cache.read(1, l, kvq::role::k, stored).ok());
    for (size_t i = 0; i < stored.size(); ++i)
      REQUIRE(std::fabs(stored[i] - ks[size_t(l)][i]) <= 1e-3f * (1 + std::fabs(stored[i])));
  }
  reference_kv ref;
  std::vector<std::vector<float>> ks_cache = ks;
  for (auto& k : ks) k.clear();
  REQUIRE(m.forward_reference(ref, prompt, logits, logits_mode::last, obs).ok());
  for (int l = 0; l < hp.n_layer; ++l) {
    CHECK(ks[size_t(l)] == ref.k[size_t(l)]);
    CHECK(calls[size_t(l)] == 2);
  }
}

TEST_CASE("forward errors name the problem", "[model]") {
  const llama_model& m = stories();
  auto cache = fp16_cache(m);
  REQUIRE(cache.create_sequence(0).ok());
  std::vector<float> logits(512);
  const token_id bos = 1;

  auto s = m.forward(cache, 42, std::span(&bos, 1), logits);
  CHECK(s.code() == errc::not_found);
  CHECK_THAT(s.message(), Catch::Contains("sequence 42"));

  std::vector<token_id> bad_chunk(129, 5);
  bad_chunk[100] = -3;  // a chunk longer than the window is fine; a bad id in it stores nothing
  s = m.forward(cache, 0, bad_chunk, logits);
  CHECK(s.code() == errc::invalid_argument);
  CHECK_THAT(s.message(), Catch::Contains("token 100 of the chunk is id -3"));
  CHECK(cache.length(0, 0) == 0);

  const token_id bad = 512;
  s = m.forward(cache, 0, std::span(&bad, 1), logits);
  CHECK(s.code() == errc::invalid_argument);
  CHECK_THAT(s.message(), Catch::Contains("id 512"));

  std::vector<float> small(10);
  s = m.forward(cache, 0, std::span(&bos, 1), small);
  CHECK(s.code() == errc::invalid_argument);
  CHECK_THAT(s.message(), Catch::Contains("logits hold 10 floats"));

  s = m.forward(cache, 0, {}, logits);
  CHECK(s.code() == errc::invalid_argument);

  // Quantized formats need head_dim a multiple of 32; stories260K's is 8.
  auto q = make_cache(m, "kivi4/g32", budget);
  REQUIRE_FALSE(q.ok());
  CHECK_THAT(q.error().message(), Catch::Contains("head_dim"));
}

namespace {

// Loads `bytes` as a model named "bad.gguf" and expects `code` and each part in the message.
void expect_bad_model(const std::vector<uint8_t>& bytes, errc code, std::initializer_list<std::string> parts) {
  auto f = gguf_file::from_bytes(bytes, "bad.gguf");
  REQUIRE(f.ok());
  auto m = llama_model::load(*f);
  REQUIRE_FALSE(m.ok());
  CAPTURE(m.error().to_string());
  CHECK(m.error().code() == code);
  CHECK_THAT(m.error().message(), Catch::StartsWith("bad.gguf: "));
  for (const auto& p : parts) CHECK_THAT(m.error().message(), Catch::Contains(p));
}

// The real file with the first occurrence of `from` replaced by `to` (same length).
std::vector<uint8_t> patched(std::string_view from, std::string_view to) {
  REQUIRE(from.size() == to.size());
  auto bytes = test::read_bytes(test::stories_path());
  const size_t at = test::find_bytes(bytes, from);
  REQUIRE(at != std::string::npos);
  std::copy(to.begin(), to.end(), bytes.begin() + long(at));
  return bytes;
}

}  // namespace

TEST_CASE("bad model files are rejected with the right message", "[model]") {
  SECTION("missing tensor") {
    expect_bad_model(patched("blk.4.ffn_up.weight", "blk.4.ffn_up.weighX"), errc::not_found,
                     {"tensor 'blk.4.ffn_up.weight' is missing"});
  }
  SECTION("unsupported architecture") {
    // The value of general.architecture: u64 length 5, then "llama".
    expect_bad_model(
        patched(std::string_view("\x05\0\0\0\0\0\0\0llama", 13), std::string_view("\x05\0\0\0\0\0\0\0llamb", 13)),
        errc::unsupported, {"architecture 'llamb'"});
  }
  SECTION("shape disagrees with the hyper-parameters") {
    // llama.feed_forward_length: u32 172 -> 171.
    auto bytes = test::read_bytes(test::stories_path());
    const size_t at = test::find_bytes(bytes, "llama.feed_forward_length");
    REQUIRE(at != std::string::npos);
    const size_t value = at + std::string_view("llama.feed_forward_length").size() + 4;
    REQUIRE(bytes[value] == 172);
    bytes[value] = 171;
    expect_bad_model(bytes, errc::io_error, {"tensor 'blk.0.ffn_gate.weight' has shape [64, 172], expected [64, 171]"});
  }
  SECTION("inconsistent head counts") {
    auto bytes = test::read_bytes(test::stories_path());
    const size_t at = test::find_bytes(bytes, "llama.attention.head_count_kv");
    REQUIRE(at != std::string::npos);
    const size_t value = at + std::string_view("llama.attention.head_count_kv").size() + 4;
    REQUIRE(bytes[value] == 4);
    bytes[value] = 3;
    expect_bad_model(bytes, errc::io_error, {"head_count 8 is not a multiple of head_count_kv 3"});
  }
  SECTION("missing file") {
    auto m = llama_model::load("/nonexistent/model.gguf");
    REQUIRE_FALSE(m.ok());
    CHECK(m.error().code() == errc::io_error);
    CHECK_THAT(m.error().message(), Catch::Contains("/nonexistent/model.gguf"));
  }
}

namespace {

// A one-layer file of random F32 weights (width 32, 2 heads of 16 channels, 16 tokens) of
// architecture `arch` (qwen2: with Q/K/V biases and RoPE base 1e6), with `rope_freqs` as its
// `rope_freqs.weight` when not empty. `weights`, when given, receives every tensor's floats.
// A one-layer file of architecture `arch` with random F32 weights (into `*weights` when given);
// gemma3 files get the q/k and post norms, a sliding window of 4 and a global RoPE base of 1e6.
// The tensor named `omit` is left out.
std::vector<uint8_t> tiny_llama(const std::vector<float>& rope_freqs, const std::string& arch = "llama",
                                std::map<std::string, std::vector<float>>* weights = nullptr,
                                const std::string& omit = "") {
  constexpr uint64_t E = 32, F = 32, V = 16, Dh = 16, H = 2;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 0.3f);
  test::gguf_builder b;
  const auto put = [&](const std::string& name, std::vector<uint64_t> ne) {  // a random F32 tensor
    if (name == omit) return;
    size_t n = 1;
    for (uint64_t d : ne) n *= d;
    std::vector<float> w(n);
    for (auto& x : w) x = nd(rng);
    if (weights) (*weights)[name] = w;
    b.tensor(name, std::move(ne), 0, test::f32_bytes(w));
  };
  b.str("general.architecture", arch)
      .u32(arch + ".embedding_length", E)
      .u32(arch + ".block_count", 1)
      .u32(arch + ".feed_forward_length", F)
      .u32(arch + ".attention.head_count", H)
      .u32(arch + ".attention.head_count_kv", H);
  if (arch == "qwen2") {
    b.f32("qwen2.rope.freq_base", 1e6f);
    for (const char* w : {"attn_q", "attn_k", "attn_v"}) put(std::string("blk.0.") + w + ".bias", {H * Dh});
  }
  if (arch == "gemma3") {
    b.f32("gemma3.rope.freq_base", 1e6f).u32("gemma3.attention.sliding_window", 4);
    put("blk.0.attn_q_norm.weight", {Dh});
    put("blk.0.attn_k_norm.weight", {Dh});
    put("blk.0.post_attention_norm.weight", {E});
    put("blk.0.post_ffw_norm.weight", {E});
  }
  put("token_embd.weight", {E, V});
  put("output_norm.weight", {E});
  put("blk.0.attn_norm.weight", {E});
  put("blk.0.ffn_norm.weight", {E});
  for (const char* w : {"attn_q", "attn_k", "attn_v"}) put(std::string("blk.0.") + w + ".weight", {E, H * Dh});
  put("blk.0.attn_output.weight", {H * Dh, E});
  put("blk.0.ffn_gate.weight", {E, F});
  put("blk.0.ffn_up.weight", {E, F});
  put("blk.0.ffn_down.weight", {F, E});
  if (!rope_freqs.empty()) b.tensor("rope_freqs.weight", {rope_freqs.size()}, 0, test::f32_bytes(rope_freqs));
  return b.build();
}

llama_model load_bytes(const std::vector<uint8_t>& bytes) {
  auto f = gguf_file::from_bytes(bytes, "tiny.gguf");
  REQUIRE(f.ok());
  auto m = llama_model::load(*f);
  if (!m) FAIL(m.error().to_string());
  return std::move(m).value();
}

// Layer 0's queries and keys after RoPE of `tokens` from position 0 (reference path).
std::pair<std::vector<float>, std::vector<float>> layer0_qk(const llama_model& m, const std::vector<token_id>& tokens) {
  std::vector<float> q, k, logits(size_t(m.hparams().n_vocab));
  reference_kv ref;
  const layer_observer obs = [&](int l, int64_t, std::span<const float> qs, std::span<const float> ks,
                                 std::span<const float>) {
    if (l == 0) q.assign(qs.begin(), qs.end()), k.assign(ks.begin(), ks.end());
  };
  REQUIRE(m.forward_reference(ref, tokens, logits, logits_mode::last, obs).ok());
  return {q, k};
}

}  // namespace

// Llama 3.1+ files scale RoPE by per-pair frequency divisors. With every factor 2, a token at
// position 2m turns as the same token at position m of a file without them (layer 0's q and k
// depend only on the token and its position).
TEST_CASE("rope_freqs.weight divides each pair's frequency", "[model]") {
  const llama_model plain = load_bytes(tiny_llama({}));
  const llama_model scaled = load_bytes(tiny_llama(std::vector<float>(8, 2.f)));
  CHECK_FALSE(plain.hparams().rope_freq_factors);
  CHECK(scaled.hparams().rope_freq_factors);
  std::vector<token_id> a(40), b(20);
  for (size_t i = 0; i < a.size(); ++i) a[i] = token_id((i * 5 + 3) % 16);
  for (size_t m = 0; m < b.size(); ++m) b[m] = a[2 * m];
  const auto [qa, ka] = layer0_qk(scaled, a);
  const auto [qb, kb] = layer0_qk(plain, b);
  const size_t row = 2 * 16;  // heads x head_dim
  REQUIRE(qa.size() == a.size() * row);
  REQUIRE(qb.size() == b.size() * row);
  double worst = 0;
  for (size_t m = 0; m < b.size(); ++m)
    for (size_t c = 0; c < row; ++c) {
      worst = std::max(worst, double(std::fabs(qa[2 * m * row + c] - qb[m * row + c])));
      worst = std::max(worst, double(std::fabs(ka[2 * m * row + c] - kb[m * row + c])));
    }
  CHECK(worst <= 1e-6);
  // and the odd positions of the scaled file are not those of any plain position pair: the factors
  // were applied, not ignored
  const auto [qp, kp] = layer0_qk(plain, a);
  double moved = 0;
  for (size_t c = 0; c < row; ++c) moved = std::max(moved, double(std::fabs(qa[5 * row + c] - qp[5 * row + c])));
  CHECK(moved > 1e-3);
}

// Qwen2: the llama block with Q/K/V biases, RoPE on channel halves (pair i: i, i + n_rot/2) and
// hyper-parameters under "qwen2.": layer 0's q and k after RoPE against the same computed here in
// double from the file's weights (RMSNorm, projection + bias, neox rotation at base 1e6).
TEST_CASE("qwen2 files: biases and RoPE on channel halves", "[model]") {
  std::map<std::string, std::vector<float>> w;
  const llama_model m = load_bytes(tiny_llama({}, "qwen2", &w));
  CHECK(m.hparams().rope_neox);
  CHECK(m.hparams().rope_base == 1e6f);
  const std::vector<token_id> tokens = {3, 7, 1, 12, 5, 9, 0, 15, 4, 4, 11};
  const auto [q, k] = layer0_qk(m, tokens);
  constexpr int E = 32, H = 2, Dh = 16, half = Dh / 2;
  double worst = 0, scale = 0;
  for (size_t p = 0; p < tokens.size(); ++p) {
    const float* x = w["token_embd.weight"].data() + size_t(tokens[p]) * E;
    double ss = 0;
    for (int i = 0; i < E; ++i) ss += double(x[i]) * x[i];
    const double r = 1.0 / std::sqrt(ss / E + 1e-5);
    for (const char* role : {"attn_q", "attn_k"}) {
      const auto& W = w[std::string("blk.0.") + role + ".weight"];
      const auto& B = w[std::string("blk.0.") + role + ".bias"];
      std::vector<double> y(H * Dh);
      for (int o = 0; o < H * Dh; ++o) {
        double acc = B[size_t(o)];
        for (int i = 0; i < E; ++i) acc += double(W[size_t(o) * E + i]) * x[i] * r * w["blk.0.attn_norm.weight"][size_t(i)];
        y[size_t(o)] = acc;
      }
      const std::vector<float>& got = std::string(role) == "attn_q" ? q : k;
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < half; ++i) {
          const double th = double(p) * std::pow(1e6, -2.0 * i / Dh), c = std::cos(th), s = std::sin(th);
          const double a = y[size_t(h * Dh + i)], b2 = y[size_t(h * Dh + i + half)];
          const size_t at = (p * H + size_t(h)) * Dh + size_t(i);
          worst = std::max({worst, std::fabs(got[at] - (a * c - b2 * s)), std::fabs(got[at + half] - (a * s + b2 * c))});
          scale = std::max({scale, std::fabs(a), std::fabs(b2)});
        }
    }
  }
  CHECK(worst <= 1e-4 * scale);
  // the same weights read as a llama file (no biases, adjacent pairs) give other q and k
  const llama_model as_llama = load_bytes(tiny_llama({}, "llama"));
  CHECK(layer0_qk(as_llama, tokens).first != q);
}

// Gemma (1): the whole forward of a one-layer gemma file against the same computed here in double
// from its weights: embeddings x sqrt(n_embd), RoPE on channel halves, causal attention at
// 1/sqrt(head_dim), GELU (tanh) gating, the output tied to the embeddings. Gemma 3 adds q and k
// RMS-normed per head before RoPE, the post-attention and post-FFN norms, and its layer 0 is a
// sliding one: a window of 4 tokens and RoPE base 10000 (the file's 1e6 is the global layers').
TEST_CASE("gemma and gemma3 files: the forward pass against a float64 one", "[model]") {
  const std::string arch = GENERATE(as<std::string>(), "gemma", "gemma3");
  CAPTURE(arch);
  const bool g3 = arch == "gemma3";
  std::map<std::string, std::vector<float>> w;
  const llama_model m = load_bytes(tiny_llama({}, arch, &w));
  CHECK(m.hparams().gemma);
  CHECK(m.hparams().gemma3 == g3);
  CHECK(m.attention_variants().size() == (g3 ? 1u : 0u));
  const int W = g3 ? 4 : 1 << 30;  // layer 0's window
  CHECK(m.hparams().rope_neox);
  CHECK(m.tied_output());
  const std::vector<token_id> tokens = {3, 7, 1, 12, 5, 9, 0, 15, 4, 4, 11};
  constexpr int E = 32, H = 2, Dh = 16, F = 32, V = 16, half = Dh / 2;
  const size_t T = tokens.size();
  using vec = std::vector<double>;
  const auto norm = [&](const vec& x, const std::string& weight) {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double r = 1.0 / std::sqrt(ss / double(x.size()) + 1e-5);
    vec y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * r * w[weight][i];
    return y;
  };
  const auto mul = [&](const std::string& weight, const vec& x, size_t out) {  // [out][in] row-major
    vec y(out, 0.0);
    for (size_t o = 0; o < out; ++o)
      for (size_t i = 0; i < x.size(); ++i) y[o] += double(w[weight][o * x.size() + i]) * x[i];
    return y;
  };
  std::vector<vec> xs(T), qs(T), ks(T), vs(T);
  for (size_t t = 0; t < T; ++t) {
    xs[t].resize(E);
    for (int e = 0; e < E; ++e) xs[t][size_t(e)] = w["token_embd.weight"][size_t(tokens[t]) * E + size_t(e)] * std::sqrt(double(E));
    const vec xn = norm(xs[t], "blk.0.attn_norm.weight");
    qs[t] = mul("blk.0.attn_q.weight", xn, H * Dh);
    ks[t] = mul("blk.0.attn_k.weight", xn, H * Dh);
    vs[t] = mul("blk.0.attn_v.weight", xn, H * Dh);
    if (g3)
      for (int h = 0; h < H; ++h)
        for (auto [r, nw] :
             {std::pair{&qs[t], "blk.0.attn_q_norm.weight"}, std::pair{&ks[t], "blk.0.attn_k_norm.weight"}}) {
          const vec head(r->begin() + h * Dh, r->begin() + (h + 1) * Dh);
          const vec normed = norm(head, nw);
          std::copy(normed.begin(), normed.end(), r->begin() + h * Dh);
        }
    for (vec* r : {&qs[t], &ks[t]})
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < half; ++i) {
          const double th = double(t) * std::pow(10000.0, -2.0 * i / Dh), c = std::cos(th), s = std::sin(th);
          double& a = (*r)[size_t(h * Dh + i)];
          double& b2 = (*r)[size_t(h * Dh + i + half)];
          const double a0 = a, b0 = b2;
          a = a0 * c - b0 * s, b2 = a0 * s + b0 * c;
        }
  }
  std::vector<float> logits(T * V);
  reference_kv ref;
  REQUIRE(m.forward_reference(ref, tokens, logits, logits_mode::all).ok());
  double worst = 0, scale = 0;
  for (size_t t = 0; t < T; ++t) {
    vec attn(H * Dh, 0.0);
    for (int h = 0; h < H; ++h) {
      vec s(t + 1);
      double mx = -1e300, sum = 0;
      const size_t first = t + 1 > size_t(W) ? t + 1 - size_t(W) : 0;
      for (size_t j = first; j <= t; ++j) {
        for (int c = 0; c < Dh; ++c) s[j] += qs[t][size_t(h * Dh + c)] * ks[j][size_t(h * Dh + c)];
        s[j] /= std::sqrt(double(Dh));
        mx = std::max(mx, s[j]);
      }
      for (size_t j = first; j <= t; ++j) sum += (s[j] = std::exp(s[j] - mx));
      for (size_t j = first; j <= t; ++j)
        for (int c = 0; c < Dh; ++c) attn[size_t(h * Dh + c)] += s[j] / sum * vs[j][size_t(h * Dh + c)];
    }
    vec x = xs[t];
    vec o = mul("blk.0.attn_output.weight", attn, E);
    if (g3) o = norm(o, "blk.0.post_attention_norm.weight");
    for (int e = 0; e < E; ++e) x[size_t(e)] += o[size_t(e)];
    const vec xn = norm(x, "blk.0.ffn_norm.weight");
    vec g = mul("blk.0.ffn_gate.weight", xn, F);
    const vec u = mul("blk.0.ffn_up.weight", xn, F);
    for (int i = 0; i < F; ++i) {
      const double a = g[size_t(i)];
      g[size_t(i)] = 0.5 * a * (1 + std::tanh(std::sqrt(2 / M_PI) * (a + 0.044715 * a * a * a))) * u[size_t(i)];
    }
    vec d = mul("blk.0.ffn_down.weight", g, E);
    if (g3) d = norm(d, "blk.0.post_ffw_norm.weight");
    for (int e = 0; e < E; ++e) x[size_t(e)] += d[size_t(e)];
    const vec xf = norm(x, "output_norm.weight");
    const vec want = mul("token_embd.weight", xf, V);
    for (int v = 0; v < V; ++v) {
      worst = std::max(worst, std::fabs(logits[t * V + size_t(v)] - want[size_t(v)]));
      scale = std::max(scale, std::fabs(want[size_t(v)]));
    }
  }
  CAPTURE(worst, scale);
  CHECK(worst <= 1e-4 * scale);

  // The FP16 cache (a chunk, then one token at a time) and prefill_shared apply the window as the
  // reference does: equal to it with K and V rounded to fp16.
  reference_kv ref16;
  ref16.round_to_f16 = true;
  std::vector<float> want16(T * V), got(V), shared(T * V);
  REQUIRE(m.forward_reference(ref16, tokens, want16, logits_mode::all).ok());
  auto cache = make_cache(m, "fp16", 64ull << 20);
  REQUIRE(cache.ok());
  REQUIRE(cache.value().create_sequence(0).ok());
  REQUIRE(cache.value().create_sequence(1).ok());
  double worst16 = 0;
  const std::span<const token_id> all(tokens);
  REQUIRE(m.forward(cache.value(), 0, all.first(3), got).ok());
  for (size_t t = 3; t < T; ++t) {
    REQUIRE(m.forward(cache.value(), 0, all.subspan(t, 1), got).ok());
    for (int v = 0; v < V; ++v)
      worst16 = std::max(worst16, double(std::fabs(got[size_t(v)] - want16[t * V + size_t(v)])));
  }
  kvq::KVCache* caches[] = {&cache.value()};
  const kvq::seq_id seqs[] = {1};
  REQUIRE(m.prefill_shared(caches, seqs, tokens, shared, logits_mode::all).ok());
  for (size_t i = 0; i < shared.size(); ++i) worst16 = std::max(worst16, double(std::fabs(shared[i] - want16[i])));
  CAPTURE(worst16);
  CHECK(worst16 <= 1e-4 * scale);
}

TEST_CASE("a gemma3 file without one of its norms is rejected naming the tensor", "[model]") {
  for (const char* name : {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight", "blk.0.post_attention_norm.weight",
                           "blk.0.post_ffw_norm.weight"}) {
    CAPTURE(name);
    auto f = gguf_file::from_bytes(tiny_llama({}, "gemma3", nullptr, name), "tiny.gguf");
    REQUIRE(f.ok());
    auto m = llama_model::load(*f);
    REQUIRE_FALSE(m.ok());
    CHECK(m.error().code() == errc::not_found);
    CHECK_THAT(m.error().message(),
               Catch::Contains("tiny.gguf") && Catch::Contains(name) && Catch::Contains("missing"));
  }
  // a cache made for another model (no windows) is refused by a gemma3 model
  const llama_model g3 = load_bytes(tiny_llama({}, "gemma3"));
  const llama_model plain = load_bytes(tiny_llama({}, "gemma"));
  auto cache = make_cache(plain, "fp16", 64ull << 20);
  if (!cache) FAIL(cache.error().to_string());
  REQUIRE(cache.ok());
  REQUIRE(cache.value().create_sequence(0).ok());
  std::vector<float> logits(16);
  const std::vector<token_id> t = {1, 2};
  const auto st = g3.forward(cache.value(), 0, t, logits);
  REQUIRE_FALSE(st.ok());
  CHECK_THAT(st.message(), Catch::Contains("layer 0") && Catch::Contains("window 4"));
}

TEST_CASE("bad rope_freqs.weight is rejected naming the tensor", "[model]") {
  auto expect = [](const std::vector<uint8_t>& bytes, errc code, const std::string& part) {
    auto f = gguf_file::from_bytes(bytes, "tiny.gguf");
    REQUIRE(f.ok());
    auto m = llama_model::load(*f);
    REQUIRE_FALSE(m.ok());
    CHECK(m.error().code() == code);
    CHECK_THAT(m.error().message(), Catch::Contains("rope_freqs.weight") && Catch::Contains(part));
  };
  expect(tiny_llama(std::vector<float>(6, 1.f)), errc::io_error, "expected [8]");
  std::vector<float> zero(8, 1.f), nan(8, 1.f);
  zero[3] = 0.f;
  nan[5] = std::nanf("");
  expect(tiny_llama(zero), errc::io_error, "positive");
  expect(tiny_llama(nan), errc::io_error, "finite");
}

TEST_CASE("SmolLM2-135M-Instruct: FP16 cache vs reference, and a chat answer", "[model][smollm2]") {
  if (!test::have_smollm2()) KVQ_SKIP(test::smollm2_path() << " is missing (scripts/setup puts it there)");
  std::cerr << "loading " << test::smollm2_path() << " (dequantizing 135M weights)...\n";
  auto f = gguf_file::open(test::smollm2_path());
  REQUIRE(f.ok());
  auto m = llama_model::load(*f);
  REQUIRE(m.ok());
  auto tok = tokenizer::from_gguf(*f);
  REQUIRE(tok.ok());
  const auto& hp = m->hparams();
  CHECK(hp.n_layer == 30);
  CHECK(hp.n_head == 9);
  CHECK(hp.n_head_kv == 3);
  CHECK(hp.head_dim == 64);
  CHECK(hp.rope_base == 100000.f);
  CHECK(m->tied_output());

  const std::vector<chat_message> chat = {{"user", "What is the capital of France?"}};
  const auto prompt = tok->encode(chatml_prompt(chat), false, true);
  const size_t V = size_t(hp.n_vocab);

  auto cache = make_cache(*m, "fp16", 256ull << 20);
  REQUIRE(cache.ok());
  REQUIRE(cache.value().create_sequence(0).ok());
  reference_kv ref;
  ref.round_to_f16 = true;
  std::vector<float> got(V), want(V);
  REQUIRE(m->forward(cache.value(), 0, prompt, got).ok());
  REQUIRE(m->forward_reference(ref, prompt, want).ok());
  double worst = 0;
  std::vector<token_id> answer;
  std::cerr << "SmolLM2 greedy answer: ";
  for (int i = 0; i < 24; ++i) {
    for (size_t k = 0; k < V; ++k) worst = std::max(worst, double(std::fabs(got[k] - want[k])));
    const token_id t = argmax(got);
    CHECK(t == argmax(want));
    if (t == tok->eos()) break;
    answer.push_back(t);
    std::cerr << tok->piece(t).value() << std::flush;
    REQUIRE(m->forward(cache.value(), 0, std::span(&t, 1), got).ok());
    REQUIRE(m->forward_reference(ref, std::span(&t, 1), want).ok());
  }
  std::cerr << "\nSmolLM2 fp16 cache vs reference: max |dlogit| " << worst << "\n";
  CHECK(worst < 5e-2);  // measured 0.022: fp32 summation order (vector attention vs plain loops)
  CHECK_THAT(tok->decode(answer).value(), Catch::Contains("Paris"));
}
