// KVCache on the CPU backend: window and page edges, mixed formats over time, extend, GQA,
// batches, bad input leaving the cache unchanged, and a soak of random appends and releases.
#include <catch2/catch.hpp>
#include <cmath>
#include <kvq/cache/cache.hpp>
#include <kvq/cache/config_string.hpp>
#include <kvq/cache/decode_step.hpp>
#include <kvq/codec/codec.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/static_policy.hpp>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace kvq;

namespace {

struct shape_args {
  int layers = 2, hq = 8, h = 2, d = 64, page = 64, window = 128, recent = 32;
  uint64_t budget = 64ull << 20;
};

std::pair<KVCache, std::shared_ptr<static_policy>> make(const std::string& spec, shape_args a = {}, int sink_pages = 0) {
  cache_config cfg;
  cfg.shape = {a.layers, a.hq, a.h, a.d, a.page, a.window, a.recent};
  cfg.budget_bytes = a.budget;
  cfg.sink_pages = sink_pages;
  auto pol = std::make_shared<static_policy>(static_policy::parse(spec).value_or_throw());
  return {KVCache::create(cfg, pol).value_or_throw(), pol};
}

std::vector<float> randn(std::mt19937& rng, size_t n, float sigma = 1.f) {
  std::normal_distribution<float> nd(0.f, sigma);
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng);
  return x;
}

// float64 causal GQA attention, written independently of kvq::ref.
std::vector<double> attention64(const std::vector<float>& k, const std::vector<float>& v, int64_t n,
                                const std::vector<float>& q, int q_len, int hq, int h, int d) {
  std::vector<double> o(size_t(q_len) * hq * d, 0.0);
  const double scale = 1.0 / std::sqrt(double(d));
  for (int i = 0; i < q_len; ++i)
    for (int qh = 0; qh < hq; ++qh) {
      const int kh = qh / (hq / h);
      const int64_t last = n - q_len + i;
      std::vector<double> s(size_t(last + 1));
      double mx = -1e300;
      for (int64_t j = 0; j <= last; ++j) {
        double acc = 0;
        for (int c = 0; c < d; ++c) acc += double(q[(size_t(i) * hq + qh) * d + c]) * k[(size_t(j) * h + kh) * d + c];
        s[size_t(j)] = acc * scale;
        mx = std::max(mx, s[size_t(j)]);
      }
      double sum = 0;
      for (auto& x : s) sum += (x = std::exp(x - mx));
      for (int64_t j = 0; j <= last; ++j)
        for (int c = 0; c < d; ++c)
          o[(size_t(i) * hq + qh) * d + c] += s[size_t(j)] / sum * v[(size_t(j) * h + kh) * d + c];
    }
  return o;
}

double rel_err(const std::vector<float>& a, const std::vector<double>& ref) {
  double e = 0, n = 0;
  for (size_t i = 0; i < a.size(); ++i) e += (a[i] - ref[i]) * (a[i] - ref[i]), n += ref[i] * ref[i];
  return std::sqrt(e / n);
}

tensor_view view(const std::vector<float>& x, int64_t tokens, int heads, int d) {
  return {x.data(), dtype::f32, tokens, heads, d};
}

// What a step of q_len tokens reads: the stored view, with the step's own tokens in fp16.
std::vector<float> step_view(KVCache& c, seq_id s, int layer, role r, const std::vector<float>& orig, int q_len) {
  const auto& sh = c.config().shape;
  const int64_t n = c.length(s, layer);
  std::vector<float> out(size_t(n) * sh.kv_heads * sh.head_dim);
  check(c.read(s, layer, r, out));
  for (size_t i = size_t(n - q_len) * sh.kv_heads * sh.head_dim; i < out.size(); ++i)
    out[i] = half_to_float(float_to_half(orig[i]));
  return out;
}

// One decode query (random) of sequence s at `layer`: the relative error of the cache's output
// against float64 attention over what the step reads (`step_view`) of its n tokens.
double decode_error(KVCache& c, seq_id s, int layer, const std::vector<float>& k, const std::vector<float>& v, int64_t n,
                    std::mt19937& rng) {
  const auto& sh = c.config().shape;
  const int Hq = sh.q_heads, H = sh.kv_heads, d = sh.head_dim;
  const auto q = randn(rng, size_t(Hq) * d);
  std::vector<float> o(size_t(Hq) * d);
  const attend_item it{s, 1};
  check(c.attend({&it, 1}, layer, {q.data(), dtype::f32, 1, Hq, d}, {o.data(), dtype::f32, 1, Hq, d}));
  return rel_err(o, attention64(step_view(c, s, layer, role::k, k, 1), step_view(c, s, layer, role::v, v, 1), n, q, 1,
                                Hq, H, d));
}

}  // namespace

TEST_CASE("decode attention is exact over the dequantized cache at page and window edges", "[cache]") {
  const std::string spec = GENERATE("fp16", "bf16", "fp8", "int8", "sym4/g32", "sym2/g64", "kivi4/g32", "kivi2/g64",
                                    "k=kivi8/g32,v=kivi4/g32", "ra4/g32");
  const int64_t n = GENERATE(1, 3, 31, 32, 33, 63, 64, 65, 95, 96, 97, 127, 128, 129, 200, 450);
  CAPTURE(spec, n);
  auto [c, pol] = make(spec);
  std::mt19937 rng{static_cast<uint32_t>(n * 31 + spec.size())};
  const int H = 2, Hq = 8, d = 64;
  auto k = randn(rng, size_t(n) * H * d), v = randn(rng, size_t(n) * H * d), q = randn(rng, size_t(Hq) * d);
  check(c.create_sequence(1));
  check(c.append(1, 0, view(k, n, H, d), view(v, n, H, d)));
  // pages hold exactly the tokens that fell P + recent behind
  const auto st = c.stats();
  const int64_t expect_pages = n >= 64 + 32 ? (n - 32) / 64 : 0;
  REQUIRE(st.pages == uint64_t(expect_pages * H * 2));
  std::vector<float> o(size_t(Hq) * d);
  const attend_item it{1, 1};
  check(c.attend({&it, 1}, 0, {q.data(), dtype::f32, 1, Hq, d}, {o.data(), dtype::f32, 1, Hq, d}));
  auto kd = step_view(c, 1, 0, role::k, k, 1), vd = step_view(c, 1, 0, role::v, v, 1);
  REQUIRE(rel_err(o, attention64(kd, vd, n, q, 1, Hq, H, d)) < 1e-5);
  if (spec == "fp16") REQUIRE(rel_err(o, attention64(k, v, n, q, 1, Hq, H, d)) < 1e-3);
}

TEST_CASE("token-by-token and one-shot appends store the same cache", "[cache]") {
  const std::string spec = GENERATE("kivi2/g32", "k=sym4/g32,v=fp8");
  auto [a, pa] = make(spec);
  auto [b, pb] = make(spec);
  std::mt19937 rng(9);
  const int n = 333, H = 2, d = 64;
  auto k = randn(rng, size_t(n) * H * d), v = randn(rng, size_t(n) * H * d);
  check(a.create_sequence(5));
  check(b.create_sequence(5));
  check(a.append(5, 1, view(k, n, H, d), view(v, n, H, d)));
  for (int t = 0; t < n; ++t)
    check(b.append(5, 1, {k.data() + size_t(t) * H * d, dtype::f32, 1, H, d},
                   {v.data() + size_t(t) * H * d, dtype::f32, 1, H, d}));
  REQUIRE(b.flush_policy().ok());  // nothing deferred on the CPU backend: both are no-ops
  REQUIRE(b.sync_policy().ok());
  for (role r : {role::k, role::v}) {
    std::vector<float> ra(size_t(n) * H * d), rb(ra.size());
    check(a.read(5, 1, r, ra));
    check(b.read(5, 1, r, rb));
    REQUIRE(ra == rb);
  }
  REQUIRE(a.stats().page_bytes == b.stats().page_bytes);
}

TEST_CASE("a tier change mid-sequence leaves earlier pages identical (temporal striping)", "[cache]") {
  auto [c, pol] = make("kivi4/g32");
  std::mt19937 rng(21);
  const int H = 2, d = 64, n1 = 300, n2 = 260;
  auto k = randn(rng, size_t(n1 + n2) * H * d), v = randn(rng, size_t(n1 + n2) * H * d);
  check(c.create_sequence(3));
  check(c.append(3, 0, view(k, n1, H, d), view(v, n1, H, d)));
  const int64_t e1 = c.stats().pages / (2 * H) * 64;  // tokens in pages before the change
  std::vector<float> before(size_t(n1) * H * d);
  check(c.read(3, 0, role::k, before));

  pol->set_all(*parse_format_pair("k=kivi2/g32,v=fp8"));  // demote: affects new pages only
  pol->set_head(0, 1, *parse_format_pair("fp16"));
  check(c.append(3, 0, {k.data() + size_t(n1) * H * d, dtype::f32, n2, H, d},
                 {v.data() + size_t(n1) * H * d, dtype::f32, n2, H, d}));
  std::vector<float> after(size_t(n1 + n2) * H * d);
  check(c.read(3, 0, role::k, after));
  for (size_t i = 0; i < size_t(e1) * H * d; ++i) REQUIRE(after[i] == before[i]);

  const auto st = c.stats();
  REQUIRE(st.pages_by_format[*parse_format("kivi4/g32")] == uint64_t(e1 / 64 * H * 2));
  REQUIRE(st.pages_by_format[*parse_format("kivi2/g32")] > 0);
  REQUIRE(st.pages_by_format[*parse_format("fp8")] > 0);
  REQUIRE(st.pages_by_format[fp16_format] > 0);
  REQUIRE(st.format_map[1] == *parse_format_pair("fp16"));
  REQUIRE(st.format_map[0] == *parse_format_pair("k=kivi2/g32,v=fp8"));

  REQUIRE(decode_error(c, 3, 0, k, v, n1 + n2, rng) < 1e-5);
}

TEST_CASE("extend attention (q_len > 1) is causal and sees its own tokens in fp16", "[cache]") {
  const int q_len = GENERATE(2, 7, 16, 64, 128);
  const int gqa = GENERATE(1, 4, 8);
  CAPTURE(q_len, gqa);
  shape_args a;
  a.h = 2;
  a.hq = 2 * gqa;
  auto [c, pol] = make("k=kivi4/g32,v=kivi2/g32", a);
  std::mt19937 rng{static_cast<uint32_t>(q_len * 13 + gqa)};
  const int H = a.h, Hq = a.hq, d = a.d, n0 = 250, n = n0 + q_len;
  auto k = randn(rng, size_t(n) * H * d), v = randn(rng, size_t(n) * H * d), q = randn(rng, size_t(q_len) * Hq * d);
  check(c.create_sequence(0));
  check(c.append(0, 1, view(k, n0, H, d), view(v, n0, H, d)));
  check(c.append(0, 1, {k.data() + size_t(n0) * H * d, dtype::f32, q_len, H, d},
                 {v.data() + size_t(n0) * H * d, dtype::f32, q_len, H, d}));
  std::vector<float> o(size_t(q_len) * Hq * d);
  const attend_item it{0, q_len};
  check(c.attend({&it, 1}, 1, {q.data(), dtype::f32, q_len, Hq, d}, {o.data(), dtype::f32, q_len, Hq, d}));
  auto kd = step_view(c, 0, 1, role::k, k, q_len), vd = step_view(c, 0, 1, role::v, v, q_len);
  REQUIRE(rel_err(o, attention64(kd, vd, n, q, q_len, Hq, H, d)) < 1e-5);
}

TEST_CASE("chunks of tokens_before_encode attend as token-by-token decode steps do", "[cache]") {
  const std::string spec = GENERATE("kivi2/g32", "k=sym4/g32,v=fp8");
  CAPTURE(spec);
  auto [a, pa] = make(spec);  // one token per step
  auto [b, pb] = make(spec);  // chunks that end where a page would be encoded
  auto [c, pc] = make(spec);  // chunks one token longer: they cross page encodes
  std::mt19937 rng(31);
  const int H = 2, Hq = 8, d = 64, n0 = 40, n = 520;
  auto k = randn(rng, size_t(n) * H * d), v = randn(rng, size_t(n) * H * d), q = randn(rng, size_t(n) * Hq * d);
  auto tok = [&](const std::vector<float>& x, int64_t t, int64_t m, int heads) {
    return tensor_view{x.data() + size_t(t) * heads * d, dtype::f32, m, heads, d};
  };
  // Feeds tokens [n0, n) to `cache` in chunks of chunk_of(cache) tokens (each appended, then
  // attended with q_len = the chunk) and returns every position's output.
  auto run = [&](KVCache& cache, auto chunk_of) {
    check(cache.create_sequence(0));
    check(cache.append(0, 0, tok(k, 0, n0, H), tok(v, 0, n0, H)));
    std::vector<float> o(size_t(n) * Hq * d, 0.f);
    for (int64_t t = n0; t < n;) {
      const int64_t m = std::min<int64_t>(chunk_of(cache), n - t);
      check(cache.append(0, 0, tok(k, t, m, H), tok(v, t, m, H)));
      const attend_item it{0, int(m)};
      check(cache.attend({&it, 1}, 0, tok(q, t, m, Hq), {o.data() + size_t(t) * Hq * d, dtype::f32, m, Hq, d}));
      t += m;
    }
    return o;
  };
  const auto oa = run(a, [](KVCache&) { return int64_t(1); });
  const auto ob = run(b, [](KVCache& x) { return std::max<int64_t>(1, x.tokens_before_encode(0, 0)); });
  const auto oc = run(c, [](KVCache& x) { return x.tokens_before_encode(0, 0) + 1; });
  std::vector<double> ref(oa.begin(), oa.end());
  REQUIRE(rel_err(ob, ref) < 1e-5);
  REQUIRE(rel_err(oc, ref) > 1e-3);  // reading encoded tokens a decode step read in fp16 shows
  REQUIRE(b.stats().page_bytes == a.stats().page_bytes);

  // The count itself: an append of that many encodes nothing, one more token encodes a page.
  const int64_t m = b.tokens_before_encode(0, 1);
  REQUIRE(m == 64 + 32 - 1);  // layer 1 is empty: page_tokens + recent - 1
  check(b.append(0, 1, tok(k, 0, m, H), tok(v, 0, m, H)));
  REQUIRE(b.tokens_before_encode(0, 1) == 0);
  const uint64_t pages = b.stats().pages;
  check(b.append(0, 1, tok(k, m, 1, H), tok(v, m, 1, H)));
  REQUIRE(b.stats().pages == pages + 2 * H);
  REQUIRE(b.tokens_before_encode(0, 1) == 64 - 1);
  REQUIRE(b.tokens_before_encode(7, 0) == -1);
  REQUIRE(b.tokens_before_encode(0, 2) == -1);
}

TEST_CASE("a batch of unequal sequences equals each sequence alone", "[cache]") {
  auto [c, pol] = make("k=kivi4/g32,v=sym4/g32");
  std::mt19937 rng(77);
  const int H = 2, Hq = 8, d = 64;
  const std::vector<int64_t> lens = {5, 64, 97, 300, 129};
  std::vector<attend_item> items;
  for (size_t s = 0; s < lens.size(); ++s) {
    auto k = randn(rng, size_t(lens[s]) * H * d), v = randn(rng, size_t(lens[s]) * H * d);
    check(c.create_sequence(int64_t(s) + 10));
    check(c.append(int64_t(s) + 10, 0, view(k, lens[s], H, d), view(v, lens[s], H, d)));
    items.push_back({int64_t(s) + 10, s == 3 ? 3 : 1});
  }
  int total = 0;
  for (auto& it : items) total += it.q_len;
  auto q = randn(rng, size_t(total) * Hq * d);
  std::vector<float> o(q.size()), o1(q.size());
  check(c.attend(items, 0, {q.data(), dtype::f32, total, Hq, d}, {o.data(), dtype::f32, total, Hq, d}));
  int row = 0;
  for (auto& it : items) {
    check(c.attend({&it, 1}, 0, {q.data() + size_t(row) * Hq * d, dtype::f32, it.q_len, Hq, d},
                   {o1.data() + size_t(row) * Hq * d, dtype::f32, it.q_len, Hq, d}));
    row += it.q_len;
  }
  REQUIRE(o == o1);
}

TEST_CASE("f16, bf16 and strided inputs store what f32 input stores", "[cache]") {
  auto [a, pa] = make("kivi4/g32");
  auto [b, pb] = make("kivi4/g32");
  std::mt19937 rng(4);
  const int n = 200, H = 2, d = 64, stride = 3 * H * d;  // a fused QKV row: K at offset H*d
  auto k = randn(rng, size_t(n) * H * d), v = randn(rng, size_t(n) * H * d);
  std::vector<uint16_t> fused(size_t(n) * stride), vh(v.size());
  for (int t = 0; t < n; ++t)
    for (int e = 0; e < H * d; ++e) fused[size_t(t) * stride + H * d + e] = float_to_half(k[size_t(t) * H * d + e]);
  for (size_t i = 0; i < v.size(); ++i) vh[i] = float_to_half(v[i]);
  check(a.create_sequence(1));
  check(b.create_sequence(1));
  check(a.append(1, 0, view(k, n, H, d), view(v, n, H, d)));
  check(b.append(1, 0, {fused.data() + H * d, dtype::f16, n, H, d, stride}, {vh.data(), dtype::f16, n, H, d}));
  std::vector<float> ra(size_t(n) * H * d), rb(ra.size());
  for (role r : {role::k, role::v}) {
    check(a.read(1, 0, r, ra));
    check(b.read(1, 0, r, rb));
    REQUIRE(ra == rb);
  }
  // bf16 input goes through fp16 exactly like f32 input of the same values
  std::vector<uint16_t> kb(k.size());
  std::vector<float> kbf(k.size());
  for (size_t i = 0; i < k.size(); ++i) kbf[i] = bf16_to_float(kb[i] = float_to_bf16(k[i]));
  auto [e, pe] = make("kivi4/g32");
  auto [f, pf] = make("kivi4/g32");
  check(e.create_sequence(1));
  check(f.create_sequence(1));
  check(e.append(1, 0, {kb.data(), dtype::bf16, n, H, d}, view(v, n, H, d)));
  check(f.append(1, 0, view(kbf, n, H, d), view(v, n, H, d)));
  check(e.read(1, 0, role::k, ra));
  check(f.read(1, 0, role::k, rb));
  REQUIRE(ra == rb);
}

namespace {
// Everything observable about a cache, to prove a failed call changed nothing.
struct snapshot {
  cache_stats st;
  std::vector<float> k, v;
  bool operator==(const snapshot& o) const {
    return st.used_bytes == o.st.used_bytes && st.page_bytes == o.st.page_bytes && st.pages == o.st.pages &&
           st.tokens == o.st.tokens && st.bytes_by_format == o.st.bytes_by_format && k == o.k && v == o.v;
  }
};
// A failed call: the code, and a message that contains `text`.
void require_error(const status& s, errc code, const char* text) {
  CAPTURE(s.to_string());
  REQUIRE_FALSE(s.ok());
  REQUIRE(s.code() == code);
  REQUIRE_THAT(s.message(), Catch::Contains(text));
}

snapshot snap(KVCache& c, seq_id s) {
  snapshot out{c.stats(), {}, {}};
  const auto& sh = c.config().shape;
  out.k.resize(size_t(c.length(s, 0)) * sh.kv_heads * sh.head_dim);
  out.v.resize(out.k.size());
  check(c.read(s, 0, role::k, out.k));
  check(c.read(s, 0, role::v, out.v));
  return out;
}
}  // namespace

TEST_CASE("bad input is a clear error and leaves the cache unchanged", "[cache][errors]") {
  shape_args a;
  a.budget = 200 * 1024;
  auto [c, pol] = make("kivi4/g32", a);
  std::mt19937 rng(8);
  const int H = 2, Hq = 8, d = 64;
  auto k = randn(rng, 2000 * H * d), v = randn(rng, 2000 * H * d);
  check(c.create_sequence(1));
  check(c.append(1, 0, view(k, 150, H, d), view(v, 150, H, d)));
  const snapshot before = snap(c, 1);

  auto expect = [&](status s, errc code, const char* text) {
    require_error(s, code, text);
    REQUIRE(snap(c, 1) == before);
  };
  // NaN / Inf deep inside a multi-page append: nothing stored
  auto kn = k;
  kn[size_t(140) * H * d + 70] = std::numeric_limits<float>::quiet_NaN();
  expect(c.append(1, 0, view(kn, 200, H, d), view(v, 200, H, d)), errc::non_finite, "K[token 140][head 1][channel 6]");
  auto vi = v;
  vi[5] = std::numeric_limits<float>::infinity();
  expect(c.append(1, 0, view(k, 10, H, d), view(vi, 10, H, d)), errc::non_finite, "not finite");
  auto kb = k;
  kb[3] = 1e6f;
  expect(c.append(1, 0, view(kb, 10, H, d), view(v, 10, H, d)), errc::invalid_argument, "outside the fp16 range");
  // shapes
  expect(c.append(1, 0, view(k, 10, 3, d), view(v, 10, 3, d)), errc::invalid_argument, "expects [tokens][2][64]");
  expect(c.append(1, 0, view(k, 10, H, d), view(v, 9, H, d)), errc::invalid_argument, "K has 10 tokens but V has 9");
  expect(c.append(1, 7, view(k, 10, H, d), view(v, 10, H, d)), errc::invalid_argument, "layer 7 out of range");
  expect(c.append(2, 0, view(k, 10, H, d), view(v, 10, H, d)), errc::not_found, "unknown sequence 2");
  // full budget: a long append that needs more pages than the budget holds
  expect(c.append(1, 0, view(k, 2000, H, d), view(v, 2000, H, d)), errc::out_of_budget, "nothing was stored");
  // attention requests
  std::vector<float> q(size_t(Hq) * d * 200), o(q.size());
  attend_item big{1, 129};
  expect(c.attend({&big, 1}, 0, {q.data(), dtype::f32, 129, Hq, d}, {o.data(), dtype::f32, 129, Hq, d}),
         errc::invalid_argument, "q_len 129");
  attend_item one{1, 1};
  expect(c.attend({&one, 1}, 0, {q.data(), dtype::f32, 2, Hq, d}, {o.data(), dtype::f32, 2, Hq, d}),
         errc::invalid_argument, "expected [1][8][64]");
  attend_item unknown{9, 1};
  expect(c.attend({&unknown, 1}, 0, {q.data(), dtype::f32, 1, Hq, d}, {o.data(), dtype::f32, 1, Hq, d}),
         errc::not_found, "unknown sequence 9");
  expect(c.release_sequence(4), errc::not_found, "unknown sequence 4");
  expect(c.create_sequence(1), errc::invalid_argument, "already exists");
  std::vector<float> bad_pcts(a.layers * H * 2, 100.f);
  bad_pcts[3] = 0.95f;  // a former clip ratio: layer 0, head 1, V
  expect(c.set_clip_percentiles(bad_pcts), errc::invalid_argument,
         "layer 0, head 1, V: clip percentile 0.95 is not in [50, 100]");
  bad_pcts[3] = 80.f;  // 26 order statistics of a 128-value group
  expect(c.set_clip_percentiles(bad_pcts), errc::invalid_argument, "clip percentile 80 needs the");
  bad_pcts[3] = 90.f;
  check(c.set_clip_percentiles(bad_pcts));
  // and the cache still works afterwards
  check(c.append(1, 0, view(k, 10, H, d), view(v, 10, H, d)));
  REQUIRE(c.length(1, 0) == 160);
}

TEST_CASE("a batched append stores what per-sequence appends store", "[cache][batch]") {
  const std::string spec = GENERATE("kivi4/g32", "k=sym8,v=fp8;1=kivi2/g64");
  auto [a, pa] = make(spec);
  auto [b, pb] = make(spec);
  std::mt19937 rng(21);
  const int H = 2, d = 64;
  const std::vector<seq_id> seqs = {3, 9, 4, 7};
  for (seq_id s : seqs) check(a.create_sequence(s)), check(b.create_sequence(s));
  // steps of unequal token counts per sequence, crossing page and window edges (a prefill of 300,
  // single tokens, a chunk of 70), on both layers
  const std::vector<std::vector<int64_t>> steps = {{300, 1, 64, 129}, {1, 1, 1, 1}, {70, 2, 1, 33}, {1, 200, 1, 1}};
  for (int layer : {0, 1})
    for (const auto& counts : steps) {
      std::vector<append_item> items;
      int64_t rows = 0;
      for (size_t i = 0; i < seqs.size(); ++i) items.push_back({seqs[i], counts[i]}), rows += counts[i];
      auto k = randn(rng, size_t(rows) * H * d), v = randn(rng, size_t(rows) * H * d);
      check(a.append_batch(items, layer, view(k, rows, H, d), view(v, rows, H, d)));
      int64_t row = 0;
      for (const auto& it : items) {
        check(b.append(it.seq, layer, {k.data() + size_t(row) * H * d, dtype::f32, it.tokens, H, d},
                       {v.data() + size_t(row) * H * d, dtype::f32, it.tokens, H, d}));
        row += it.tokens;
      }
    }
  for (seq_id s : seqs)
    for (int layer : {0, 1})
      for (role r : {role::k, role::v}) {
        REQUIRE(a.length(s, layer) == b.length(s, layer));
        std::vector<float> ra(size_t(a.length(s, layer)) * H * d), rb(ra.size());
        check(a.read(s, layer, r, ra));
        check(b.read(s, layer, r, rb));
        REQUIRE(ra == rb);
      }
  REQUIRE(a.stats().page_bytes == b.stats().page_bytes);
  REQUIRE(a.stats().used_bytes == b.stats().used_bytes);
}

TEST_CASE("a batched append that fails stores nothing for any sequence", "[cache][batch][errors]") {
  shape_args a;
  a.budget = 400 * 1024;  // two sequences' windows (256 KiB), their pages, and ~120 KiB free
  auto [c, pol] = make("kivi4/g32", a);
  std::mt19937 rng(22);
  const int H = 2, d = 64;
  auto k = randn(rng, 3000 * H * d), v = randn(rng, 3000 * H * d);
  for (seq_id s : {1, 2}) {
    check(c.create_sequence(s));
    check(c.append(s, 0, view(k, 150, H, d), view(v, 150, H, d)));
  }
  const snapshot b1 = snap(c, 1), b2 = snap(c, 2);
  auto expect = [&](status s, errc code, const char* text) {
    require_error(s, code, text);
    REQUIRE(snap(c, 1) == b1);
    REQUIRE(snap(c, 2) == b2);
  };
  const append_item both[] = {{1, 100}, {2, 100}};
  // a bad value in the second sequence's rows: the first sequence is not written either
  auto kn = k;
  kn[size_t(170) * H * d + 3] = std::numeric_limits<float>::quiet_NaN();
  expect(c.append_batch(both, 0, view(kn, 200, H, d), view(v, 200, H, d)), errc::non_finite,
         "K[token 170][head 0][channel 3]");
  expect(c.append_batch(both, 0, view(k, 199, H, d), view(v, 199, H, d)), errc::invalid_argument,
         "the items append 200 tokens but K and V have 199 rows");
  const append_item twice[] = {{1, 1}, {2, 1}, {1, 1}};
  expect(c.append_batch(twice, 0, view(k, 3, H, d), view(v, 3, H, d)), errc::invalid_argument,
         "sequence 1 appears more than once");
  const append_item unknown[] = {{1, 1}, {5, 1}};
  expect(c.append_batch(unknown, 0, view(k, 2, H, d), view(v, 2, H, d)), errc::not_found, "unknown sequence 5");
  const append_item zero[] = {{1, 0}, {2, 1}};
  expect(c.append_batch(zero, 0, view(k, 1, H, d), view(v, 1, H, d)), errc::invalid_argument, "appends 0 tokens");
  expect(c.append_batch({}, 0, view(k, 1, H, d), view(v, 1, H, d)), errc::invalid_argument, "empty batch");
  expect(c.append_batch(both, 2, view(k, 200, H, d), view(v, 200, H, d)), errc::invalid_argument,
         "layer 2 out of range");
  // the budget holds the first sequence's new pages but not the second's: neither is planned
  const append_item big[] = {{1, 600}, {2, 1500}};
  expect(c.append_batch(big, 0, view(k, 2100, H, d), view(v, 2100, H, d)), errc::out_of_budget, "");
  // and the cache still works afterwards
  check(c.append_batch(both, 0, view(k, 200, H, d), view(v, 200, H, d)));
  REQUIRE(c.length(1, 0) == 250);
  REQUIRE(c.length(2, 0) == 250);
}

TEST_CASE("configuration and policy errors name the problem", "[cache][errors]") {
  cache_config cfg;
  cfg.shape = {2, 8, 3, 64, 64, 128, 32};
  cfg.budget_bytes = 1 << 20;
  auto pol = std::make_shared<static_policy>(*parse_format_pair("kivi4/g32"));
  auto r = KVCache::create(cfg, pol);
  REQUIRE_FALSE(r.ok());
  REQUIRE_THAT(r.error().message(), Catch::Contains("q_heads 8 is not a multiple of kv_heads 3"));
  cfg.shape = {2, 8, 2, 64, 64, 96, 32};
  REQUIRE_THAT(KVCache::create(cfg, pol).error().message(), Catch::Contains("window 96"));
  cfg.shape = {2, 8, 2, 64, 64, 128, 32};
  auto p128 = std::make_shared<static_policy>(*parse_format_pair("kivi4/g128"));
  REQUIRE_THAT(KVCache::create(cfg, p128).error().message(), Catch::Contains("does not divide page_tokens 64"));
  cfg.shape = {2, 8, 2, 8, 64, 128, 32};
  REQUIRE_THAT(KVCache::create(cfg, pol).error().message(), Catch::Contains("multiple of 32"));
  auto fp16 = std::make_shared<static_policy>();
  REQUIRE(KVCache::create(cfg, fp16).ok());  // head_dim 8 is fine for fp16 (stories260K)
  cfg.where = backend::cuda;
#if !defined(KVQ_WITH_CUDA)
  REQUIRE(KVCache::create(cfg, fp16).error().code() == errc::unsupported);
#endif
}

// AddressSanitizer stops the process at an allocation above its limit (1 TiB) unless
// allocator_may_return_null is set; this default (ASAN_OPTIONS still overrides it) lets the
// impossible-budget test below run under ASan however the binary is started.
#if defined(__SANITIZE_ADDRESS__)
#define KVQ_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVQ_TEST_ASAN 1
#endif
#endif
#ifdef KVQ_TEST_ASAN
extern "C" __attribute__((visibility("default"))) const char* __asan_default_options() {
  return "allocator_may_return_null=1";
}
#endif

TEST_CASE("a budget the host cannot allocate is an out_of_budget status naming the bytes", "[cache][errors]") {
  cache_config cfg;
  cfg.shape = {2, 8, 2, 64, 64, 128, 32};
  cfg.budget_bytes = 1ull << 60;
  auto pol = std::make_shared<static_policy>(*parse_format_pair("kivi4/g32"));
  auto r = KVCache::create(cfg, pol);  // an exception escaping fails the test case
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code() == errc::out_of_budget);
  CHECK_THAT(r.error().message(), Catch::Contains(std::to_string(1ull << 60) + " bytes"));
  cfg.budget_bytes = 1 << 20;  // the same configuration with a budget that fits
  CHECK(KVCache::create(cfg, pol).ok());
}

TEST_CASE("every size of a configuration is bounded: a huge one is a status, never an exception", "[cache][errors]") {
  auto pol = std::make_shared<static_policy>(*parse_format_pair("kivi4/g32"));
  const auto refused = [&](const cache_config& cfg, const std::string& part) {
    result<KVCache> r = KVCache::create(cfg, pol);  // an exception escaping fails the test case
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == errc::invalid_argument);
    CHECK_THAT(r.error().message(), Catch::Contains(part));
  };
  cache_config cfg;
  cfg.shape = {2, 8, 2, 64, 64, 128, 32};
  cfg.budget_bytes = 1 << 20;
  cache_config c = cfg;
  c.shape.layers = 1 << 30;
  refused(c, "layers 1073741824");
  c = cfg;
  c.shape.kv_heads = 1 << 20;
  c.shape.q_heads = 1 << 20;
  refused(c, "kv_heads 1048576");
  c = cfg;
  c.max_sequences = 1 << 30;
  refused(c, "max_sequences 1073741824");
  c = cfg;
  c.shape.window = 1 << 24;
  refused(c, "window 16777216");
  c = cfg;
  c.shape.page_tokens = 1 << 20;
  refused(c, "page_tokens 1048576");
  // CUDA's page tables: refused before any device is touched (KVCache::overhead validates too)
  c = cfg;
  c.where = backend::cuda;
  c.max_sequences = 1 << 20;
  c.shape.layers = 4096;
  c.max_tokens = 1 << 30;
  CHECK_THAT(KVCache::overhead(c).error().message(), Catch::Contains("CUDA page tables"));
  c = cfg;
  c.where = backend::cuda;
  c.shape = {2, 64, 64, 64, 64, 128, 32};
  c.rotation = rotation_config::all(c.shape);
  CHECK_THAT(KVCache::overhead(c).error().message(), Catch::Contains("at most 32 kv heads"));
}

TEST_CASE("a moved-from cache answers every call with a status", "[cache][errors]") {
  auto [c, pol] = make("kivi4/g32");
  constexpr int hq = 8, kvh = 2, d = 64;
  check(c.create_sequence(1));
  KVCache moved = std::move(c);
  CHECK(moved.has_sequence(1));
  std::vector<float> x(size_t(hq) * d), out(x.size());
  const attend_item it{1, 1};
  const append_item ap{1, 1};
  const std::vector<seq_id> one{1};
  const std::vector<status> answers = {
      c.create_sequence(2), c.release_sequence(1), c.fork(1, 2), c.truncate(1, 0),
      c.append(1, 0, {x.data(), dtype::f32, 1, kvh, d}, {x.data(), dtype::f32, 1, kvh, d}),
      c.append_batch({&ap, 1}, 0, {x.data(), dtype::f32, 1, kvh, d}, {x.data(), dtype::f32, 1, kvh, d}),
      c.attend({&it, 1}, 0, {x.data(), dtype::f32, 1, hq, d}, {out.data(), dtype::f32, 1, hq, d}),
      c.read(1, 0, role::k, out), c.check(), c.sync_policy(), c.flush_policy(), c.set_clip_percentiles({}),
      c.import_sequences({}, one), c.swap_out(1), c.swap_in(1), c.export_file("/tmp/x", one),
      c.bytes_for(1).error(), c.export_bytes(one).error(), c.export_sequences(one).error(),
      c.codebook_levels(format_id(0)).error(), c.swap_in_bytes(1).error(), decode_step::create(c, 1, 64).error()};
  for (const status& s : answers) {
    CAPTURE(s.message());
    CHECK(s.code() == errc::invalid_argument);
    CHECK_THAT(s.message(), Catch::Contains("moved from"));
  }
  CHECK_FALSE(c.has_sequence(1));
  CHECK(c.length(1, 0) == -1);
  CHECK(c.stats().sequences == 0);
  CHECK_FALSE(c.is_swapped(1));
  CHECK(c.config().shape.layers == 0);
  CHECK(moved.stats().sequences == 1);  // the cache went with the move
}

TEST_CASE("soak: 100,000 random appends and releases leak no bytes", "[cache][soak]") {
  shape_args a;
  a.layers = 2;
  a.budget = 6 << 20;
  a.d = 32;
  auto [c, pol] = make("k=kivi4/g32,v=kivi2/g32;1=fp8", a);
  const uint64_t base = c.stats().used_bytes;
  std::mt19937 rng(2024);
  const int H = 2, d = 32;
  auto k = randn(rng, 200 * H * d), v = randn(rng, 200 * H * d);
  std::vector<seq_id> live;
  seq_id next = 0;
  int fails = 0;
  for (int op = 0; op < 100000; ++op) {
    const unsigned r = rng() % 100;
    if (live.empty() || r < 8) {
      if (c.create_sequence(next).ok()) live.push_back(next);
      ++next;
    } else if (r < 15) {
      const size_t i = rng() % live.size();
      check(c.release_sequence(live[i]));
      live[i] = live.back();
      live.pop_back();
    } else {
      const seq_id s = live[rng() % live.size()];
      const int n = 1 + int(rng() % (r < 20 ? 200 : 4));
      const int layer = int(rng() % 2);
      const auto before = c.stats().used_bytes;
      status st = c.append(s, layer, view(k, n, H, d), view(v, n, H, d));
      if (!st.ok()) {
        REQUIRE(st.code() == errc::out_of_budget);
        REQUIRE(c.stats().used_bytes == before);
        ++fails;
      }
    }
  }
  for (auto s : live) check(c.release_sequence(s));
  const auto st = c.stats();
  REQUIRE(st.used_bytes == base);
  REQUIRE(st.pages == 0);
  REQUIRE(st.page_bytes == 0);
  REQUIRE(st.window_bytes == 0);
  REQUIRE(st.tokens == 0);
  INFO("appends refused for budget: " << fails);
  REQUIRE(fails > 0);  // the budget was really exercised
}

TEST_CASE("codebook levels set on a cache encode the pages after, nothing before", "[cache][codebook]") {
  shape_args a;
  auto expect = [&](status s, errc code, const char* text) {
    CAPTURE(s.message());
    CHECK(s.code() == code);
    CHECK(s.message().find(text) != std::string::npos);
  };
  const int H = a.h, d = a.d, P = a.page;
  auto [c, pol] = make("k=cb2,v=cb2/g32", a);
  const format_id cb2 = parse_format("cb2").value_or_throw(), cb2g = parse_format("cb2/g32").value_or_throw();
  // Lloyd-Max until set
  const std::vector<float> lm = c.codebook_levels(cb2).value_or_throw();
  REQUIRE(lm.size() == size_t(a.layers) * H * 2 * 4);
  for (size_t i = 0; i < lm.size(); ++i) CHECK(lm[i] == lloyd_max_level(2, int(i % 4)));
  std::mt19937 rng(3);
  const int n1 = 200, n2 = 100;
  const std::vector<float> k = randn(rng, size_t(n1 + n2) * H * d), v = randn(rng, size_t(n1 + n2) * H * d);
  check(c.create_sequence(1));
  for (int l = 0; l < a.layers; ++l) check(c.append(1, l, view(k, n1, H, d), view(v, n1, H, d)));
  std::vector<float> before(size_t(n1) * H * d);
  check(c.read(1, 0, role::k, before));
  // bad levels change nothing
  std::vector<float> fitted(lm.size());
  for (size_t u = 0; u < fitted.size() / 4; ++u)
    for (int kk = 0; kk < 4; ++kk) fitted[u * 4 + size_t(kk)] = (kk - 1.5f) * (0.8f + 0.01f * float(u));
  std::vector<float> bad = fitted;
  std::swap(bad[(1 * H + 0) * 2 * 4 + 4 + 1], bad[(1 * H + 0) * 2 * 4 + 4 + 2]);  // layer 1 head 0 V
  expect(c.set_codebook_levels(cb2, bad), errc::invalid_argument, "cb2 layer 1 head 0 V");
  bad = fitted;
  bad[5] = std::numeric_limits<float>::quiet_NaN();
  expect(c.set_codebook_levels(cb2, bad), errc::invalid_argument, "level 1 is not finite");
  bad.pop_back();
  expect(c.set_codebook_levels(cb2, bad), errc::invalid_argument, "has 31 levels; needs 32 (layers x kv heads x 2 x 4)");
  expect(c.set_codebook_levels(parse_format("kivi2/g32").value_or_throw(), fitted), errc::invalid_argument,
         "not a codebook format");
  REQUIRE(c.codebook_levels(cb2).value_or_throw() == lm);
  check(c.set_codebook_levels(cb2, fitted));
  REQUIRE(c.codebook_levels(cb2).value_or_throw() == fitted);
  REQUIRE(c.codebook_levels(cb2g).value_or_throw() == c.codebook_levels(cb2g).value_or_throw());  // other slot
  for (int l = 0; l < a.layers; ++l)
    check(c.append(1, l, view(std::vector<float>(k.begin() + std::ptrdiff_t(size_t(n1) * H * d), k.end()), n2, H, d),
                   view(std::vector<float>(v.begin() + std::ptrdiff_t(size_t(n1) * H * d), v.end()), n2, H, d)));
  std::vector<float> after(size_t(n1 + n2) * H * d);
  check(c.read(1, 0, role::k, after));
  // the pages stored before keep their bytes: tokens 0..127 (two pages) read the same
  const size_t old_pages = size_t(2 * P) * H * d;
  REQUIRE(std::equal(before.begin(), before.begin() + std::ptrdiff_t(old_pages), after.begin()));
  // the page of tokens 128..191 was encoded with the new levels: the codec's bytes for them
  const codec::page_geom g = codec::make_geom(cb2, role::k, P, d);
  for (int h = 0; h < H; ++h) {
    std::vector<uint16_t> src(size_t(P) * d);
    for (int t = 0; t < P; ++t)
      for (int ch = 0; ch < d; ++ch) src[size_t(t) * d + ch] = float_to_half(k[(size_t(2 * P + t) * H + h) * d + ch]);
    std::vector<uint8_t> page(g.lay.total(), 0);
    const float* lv = fitted.data() + size_t((0 * H + h) * 2 + 0) * 4;
    for (int u = 0; u < g.unit_count(); ++u) codebook_codec::encode_unit_with(g, src.data(), d, u, page.data(), lv);
    for (int t = 0; t < P; ++t)
      for (int ch = 0; ch < d; ++ch)
        REQUIRE(after[(size_t(2 * P + t) * H + h) * d + ch] == codec::decode_element(g, page.data(), t, ch));
  }
}

TEST_CASE("sink pages hold FP16 whatever the policy chooses; later pages as without sinks", "[cache][sinks]") {
  const std::string spec = GENERATE("kivi2/g32", "k=kivi4/g32,v=sym4/g32", "cb2", "fp8");
  const int sinks = GENERATE(1, 2);
  const int64_t n = GENERATE(95, 96, 160, 333);
  CAPTURE(spec, sinks, n);
  shape_args a;
  const int H = a.h, d = a.d, P = a.page;
  auto [c, pol] = make(spec, a, sinks);
  auto [plain, pp] = make(spec, a);
  std::mt19937 rng{uint32_t(n + 7 * sinks)};
  const auto k = randn(rng, size_t(n) * H * d, 3.f), v = randn(rng, size_t(n) * H * d);
  for (KVCache* x : {&c, &plain}) {
    check(x->create_sequence(1));
    for (int l = 0; l < a.layers; ++l) check(x->append(1, l, view(k, n, H, d), view(v, n, H, d)));
  }
  const int64_t pages = n >= P + a.recent ? (n - a.recent) / P : 0;
  const int64_t fp16_pages = std::min<int64_t>(pages, sinks);
  const cache_stats st = c.stats();
  CHECK(st.pages == uint64_t(pages * a.layers * H * 2));
  CHECK(st.pages_by_format[fp16_format] == uint64_t(fp16_pages * a.layers * H * 2));
  CHECK(st.format_map == plain.stats().format_map);  // (the policy's map: sinks are not a tier)
  for (int l = 0; l < a.layers; ++l)
    for (role r : {role::k, role::v}) {
      const auto& x = r == role::k ? k : v;
      std::vector<float> got(size_t(n) * H * d), ref(got.size());
      check(c.read(1, l, r, got));
      check(plain.read(1, l, r, ref));
      const size_t sink_end = size_t(fp16_pages * P) * H * d;
      for (size_t i = 0; i < sink_end; ++i) REQUIRE(got[i] == half_to_float(float_to_half(x[i])));
      for (size_t i = sink_end; i < got.size(); ++i) REQUIRE(got[i] == ref[i]);
    }
  REQUIRE(decode_error(c, 1, 1, k, v, n, rng) < 1e-5);
}

TEST_CASE("sink pages out of range are a configuration error naming sink_pages", "[cache][sinks][errors]") {
  cache_config cfg;
  cfg.shape = {2, 8, 2, 64, 64, 128, 32};
  cfg.budget_bytes = 1 << 20;
  cfg.max_tokens = 1024;
  auto pol = std::make_shared<static_policy>(*parse_format_pair("kivi4/g32"));
  for (int bad : {-1, 17}) {
    cfg.sink_pages = bad;
    auto r = KVCache::create(cfg, pol);
    REQUIRE_FALSE(r.ok());
    REQUIRE_THAT(r.error().message(), Catch::Contains("sink_pages " + std::to_string(bad) +
                                                      " must be in [0, max_tokens / page_tokens = 16]"));
  }
  cfg.sink_pages = 16;
  REQUIRE(KVCache::create(cfg, pol).ok());
}

TEST_CASE("parse_cache_suffixes: '+rot' and '+sink<N>' in any order after the spec, bad ones named", "[cache][sinks]") {
  const auto ok = [](std::string_view config) { return parse_cache_suffixes(config).value_or_throw(); };
  const cache_suffixes none = ok("kivi4/g32");
  CHECK(none.spec == "kivi4/g32");
  CHECK_FALSE(none.rotated);
  CHECK(none.sink_pages == 0);
  for (std::string_view both : {"k=kivi4/g32,v=kivi2/g32+rot+sink3", "k=kivi4/g32,v=kivi2/g32+sink3+rot"}) {
    CAPTURE(both);
    const cache_suffixes s = ok(both);
    CHECK(s.spec == "k=kivi4/g32,v=kivi2/g32");
    CHECK(s.rotated);
    CHECK(s.sink_pages == 3);
  }
  CHECK(ok("kivi2/g32+sink").sink_pages == 1);
  // a '+' that is not a cache suffix ends them: it is the spec's
  const cache_suffixes inner = ok("a+b+rot");
  CHECK(inner.spec == "a+b");
  CHECK(inner.rotated);
  CHECK(ok("+rot").spec == "+rot");  // (nothing before it: left to the spec's parser, which rejects it)
  for (const char* bad : {"kivi2/g32+sink0", "kivi2/g32+sinkx", "kivi2/g32+sink1025", "kivi2/g32+sink+sink2",
                          "kivi2/g32+rot+sink+rot"}) {
    CAPTURE(bad);
    auto r = parse_cache_suffixes(bad);
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.error().message(), Catch::Contains(std::string("configuration '") + bad + "'"));
  }
  CHECK_THAT(parse_cache_suffixes("x+sink2+sink").error().message(), Catch::Contains("'+sink' given twice"));
  // apply: every kv head of the shape rotated, the sink pages set
  cache_config cfg;
  cfg.shape = {2, 8, 2, 64, 64, 128, 32};
  ok("kivi2/g32+sink2+rot").apply(cfg);
  CHECK(cfg.sink_pages == 2);
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 2; ++h) CHECK(cfg.rotation.rotated(l, h, 2));
  ok("kivi2/g32").apply(cfg);
  CHECK(cfg.sink_pages == 0);
  CHECK_FALSE(cfg.rotation.any());
}
