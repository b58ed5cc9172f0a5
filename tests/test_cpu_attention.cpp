// The CPU backend's attention (attention/cpu_attention.hpp) against the plain reference
// (KVCache::read + kvq::ref::attend) on every format of the registry, mixed formats across pages,
// GQA groups, head dims, q_len, batches and threads; and `prefill` / `attend_prefix` /
// `merge_attention` against a float reference built from the stored prefix and the fp16 chunk.
#include "attention_checks.hpp"

#include <kvq/attention/cpu_attention.hpp>
#include <kvq/attention/merge.hpp>
#include <kvq/attention/reference.hpp>
#include <kvq/cache/cache.hpp>
#include <kvq/codec/codec.hpp>
#include <kvq/format/numeric.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

using namespace kvq;

namespace {

// Formats by page and kv head: page i of kv head h, role r takes ks/vs[(i + 3h) % size]. One
// entry per role: every page in that format.
class rotating_policy final : public policy {
 public:
  rotating_policy(std::vector<format_id> ks, std::vector<format_id> vs, int page) : ks_(ks), vs_(vs), page_(page) {}
  std::string name() const override { return "rotating"; }
  status bind(const cache_shape&) override { return {}; }
  format_id choose(const page_request& r) override {
    const auto& l = r.r == role::k ? ks_ : vs_;
    return l[size_t(r.first_token / page_ + 3 * r.kv_head) % l.size()];
  }
  format_pair current(int, int) const override { return {ks_[0], vs_[0]}; }

 private:
  std::vector<format_id> ks_, vs_;
  int page_;
};

// Every format of the registry that can store pages of this shape for role r.
std::vector<format_id> usable(role r, int page, int d) {
  std::vector<format_id> out;
  for (size_t f = 0; f < format_count; ++f)
    if (check_shape(format_id(f), r, page, d).ok()) out.push_back(format_id(f));
  return out;
}

// A policy per format of the registry that stores this shape (K and V the same where both
// roles take it), then one that mixes all of them across pages and heads.
std::vector<std::shared_ptr<rotating_policy>> every_format(int page, int d) {
  const auto ks = usable(role::k, page, d), vs = usable(role::v, page, d);
  const size_t n = std::max(ks.size(), vs.size());
  std::vector<std::shared_ptr<rotating_policy>> out;
  for (size_t i = 0; i < n; ++i)
    out.push_back(std::make_shared<rotating_policy>(std::vector{ks[std::min(i, ks.size() - 1)]},
                                                    std::vector{vs[std::min(i, vs.size() - 1)]}, page));
  out.push_back(std::make_shared<rotating_policy>(ks, vs, page));
  return out;
}

struct setup {
  int hq, h, d, page = 128, window = 256, recent = 32, threads = 1;
  uint64_t budget = 64ull << 20;
};

KVCache make(const setup& s, std::shared_ptr<policy> pol) {
  cache_config cfg;
  cfg.shape = {1, s.hq, s.h, s.d, s.page, s.window, s.recent};
  cfg.budget_bytes = s.budget;
  cfg.cpu_threads = s.threads;
  return KVCache::create(cfg, std::move(pol)).value_or_throw();
}

using test::randn;
using test::require_close;
using test::round16;
using test::view;

// What (seq, layer 0, r) reads, rows [from, n) replaced by round16(tail).
std::vector<float> stored(const KVCache& c, seq_id s, role r, int64_t from, const std::vector<float>& tail) {
  return test::stored(c, s, 0, r, from, tail);
}

// Appends `n` random tokens to (c, s) in chunks of 1..97 tokens.
void fill(KVCache& c, seq_id s, int64_t n, std::mt19937& rng) {
  const auto& sh = c.config().shape;
  for (int64_t done = 0; done < n;) {
    const int64_t m = std::min<int64_t>(n - done, 1 + int64_t(rng() % 97));
    auto k = randn(rng, size_t(m) * sh.kv_heads * sh.head_dim), v = randn(rng, k.size());
    check(c.append(s, 0, view(k.data(), m, sh.kv_heads, sh.head_dim), view(v.data(), m, sh.kv_heads, sh.head_dim)));
    done += m;
  }
}

// Two caches of one policy holding the same `before` random tokens of sequence 0.
std::pair<KVCache, KVCache> twins(const setup& s, std::shared_ptr<policy> pol, int64_t before, uint32_t seed) {
  KVCache a = make(s, pol), b = make(s, pol);
  for (KVCache* c : {&a, &b}) {
    std::mt19937 r(seed);
    check(c->create_sequence(0));
    fill(*c, 0, before, r);
  }
  return {std::move(a), std::move(b)};
}

// One batched step: each sequence appends q_lens[i] tokens, then one attend for all; the
// output is compared with the reference of each sequence alone. Returns the output.
std::vector<float> step_and_check(KVCache& c, const std::vector<int>& q_lens, std::mt19937& rng) {
  const auto& sh = c.config().shape;
  const int H = sh.kv_heads, Hq = sh.q_heads, d = sh.head_dim;
  std::vector<attend_item> items;
  std::vector<std::vector<float>> ks, vs;
  int64_t total = 0;
  for (size_t i = 0; i < q_lens.size(); ++i) {
    const int m = q_lens[i];
    ks.push_back(randn(rng, size_t(m) * H * d));
    vs.push_back(randn(rng, size_t(m) * H * d));
    check(c.append(seq_id(i), 0, view(ks.back().data(), m, H, d), view(vs.back().data(), m, H, d)));
    items.push_back({seq_id(i), m});
    total += m;
  }
  auto q = randn(rng, size_t(total) * Hq * d);
  std::vector<float> o(q.size());
  check(c.attend(items, 0, view(q.data(), total, Hq, d), {o.data(), dtype::f32, total, Hq, d}));
  int64_t row = 0;
  for (size_t i = 0; i < q_lens.size(); ++i) {
    const int m = q_lens[i];
    const int64_t n = c.length(seq_id(i), 0);
    CAPTURE(i, n, m);
    auto kf = stored(c, seq_id(i), role::k, n - m, ks[i]), vf = stored(c, seq_id(i), role::v, n - m, vs[i]);
    std::vector<float> ref(size_t(m) * Hq * d);
    ref::attend(kf.data(), vf.data(), n, q.data() + row * Hq * d, m, Hq, H, d, 1.f / std::sqrt(float(d)), ref.data());
    require_close(std::vector<float>(o.begin() + row * Hq * d, o.begin() + (row + m) * Hq * d), ref);
    row += m;
  }
  return o;
}

}  // namespace

TEST_CASE("a page decoded a page at a time equals the codec element by element, every format", "[cpu_attention]") {
  const int d = GENERATE(64, 128);
  const int P = 128;
  std::mt19937 rng(uint32_t(17 + d));
  for (role r : {role::k, role::v})
    for (format_id f : usable(r, P, d)) {
      CAPTURE(d, role_name(r), format_name(f));
      const codec::page_geom g = codec::make_geom(f, r, P, d);
      std::vector<uint16_t> src(size_t(P) * d);
      for (size_t i = 0; i < src.size(); ++i) {
        // normal values, a channel of outliers, an all-zero token and fp16 subnormals
        const float x = (i % d == 5 ? 40.f : 1.f) * std::normal_distribution<float>(0.f, 1.f)(rng);
        src[i] = float_to_half(i / d == 3 ? 0.f : i / d == 7 ? x * 1e-6f : x);
      }
      std::vector<uint8_t> page(g.lay.total(), 0);
      for (int u = 0; u < g.unit_count(); ++u) codec::encode_unit(g, src.data(), d, u, page.data(), 95.f);
      for (int rows : {P, 37}) {
        std::vector<float> out(size_t(rows) * d, -1.f);
        cpu::decode_page_rows(g, page.data(), rows, out.data());
        size_t diff = 0;
        for (int t = 0; t < rows; ++t)
          for (int c = 0; c < d; ++c) {
            const float want = codec::decode_element(g, page.data(), t, c);
            diff += std::memcmp(&want, &out[size_t(t) * d + c], 4) != 0;
          }
        REQUIRE(diff == 0);
      }
    }
}

TEST_CASE("attend equals the reference on every format, GQA group, head dim and q_len", "[cpu_attention]") {
  const int d = GENERATE(64, 128);
  const int group = GENERATE(1, 3, 4);
  const setup s{2 * group, 2, d};
  const auto policies = every_format(s.page, d);
  for (size_t i = 0; i < policies.size(); ++i) {
    const auto& pol = policies[i];
    const bool mixed = i + 1 == policies.size();
    CAPTURE(d, group, mixed, format_name(pol->current(0, 0).k), format_name(pol->current(0, 0).v));
    std::mt19937 rng(uint32_t(1000 * d + 10 * group + i));
    KVCache c = make(s, pol);
    // lengths that end mid-page, inside the ring and before the first page
    const std::vector<int64_t> lens = {3, 290, 611};
    for (size_t j = 0; j < lens.size(); ++j) {
      check(c.create_sequence(seq_id(j)));
      fill(c, seq_id(j), lens[j], rng);
    }
    step_and_check(c, {1, 1, 1}, rng);
    step_and_check(c, {7, 1, 5}, rng);
    step_and_check(c, {1, 64, 130}, rng);
  }
}

TEST_CASE("attend on a pool of threads gives the one-thread output bit for bit", "[cpu_attention]") {
  const int threads = GENERATE(2, 3);
  setup one{12, 4, 64}, many = one;
  many.threads = threads;
  auto pol = std::make_shared<rotating_policy>(usable(role::k, 128, 64), usable(role::v, 128, 64), 128);
  KVCache a = make(one, pol), b = make(many, pol);
  for (KVCache* c : {&a, &b}) {
    std::mt19937 rng(5);
    for (seq_id j = 0; j < 3; ++j) {
      check(c->create_sequence(j));
      fill(*c, j, 200 + 150 * j, rng);
    }
  }
  std::mt19937 ra(6), rb(6);
  const std::vector<int> q_lens = {1, 9, 2};
  REQUIRE(step_and_check(a, q_lens, ra) == step_and_check(b, q_lens, rb));
}

namespace {

// The prefill of a chunk of T tokens into sequence 0 after `before` tokens, checked against
// ref::attend over the stored prefix (read after the call) plus the fp16 chunk.
void check_prefill(KVCache& c, int64_t before, int64_t T, std::mt19937& rng) {
  const auto& sh = c.config().shape;
  const int H = sh.kv_heads, Hq = sh.q_heads, d = sh.head_dim;
  check(c.create_sequence(0));
  fill(c, 0, before, rng);
  auto k = randn(rng, size_t(T) * H * d), v = randn(rng, k.size()), q = randn(rng, size_t(T) * Hq * d);
  std::vector<float> o(q.size());
  check(c.prefill(0, 0, view(k.data(), T, H, d), view(v.data(), T, H, d), view(q.data(), T, Hq, d),
                  {o.data(), dtype::f32, T, Hq, d}));
  REQUIRE(c.length(0, 0) == before + T);
  auto kf = stored(c, 0, role::k, before, k), vf = stored(c, 0, role::v, before, v);
  std::vector<float> ref(o.size());
  ref::attend(kf.data(), vf.data(), before + T, q.data(), int(T), Hq, H, d, 1.f / std::sqrt(float(d)), ref.data());
  require_close(o, ref);
  check(c.release_sequence(0));
}

}  // namespace

TEST_CASE("prefill of T = 1, R and 3R + 17 tokens equals the reference, every format", "[cpu_attention][prefill]") {
  // (head_dim, threads); pages of 64 tokens keep the 3R + 17 chunk short (K groups of 128
  // tokens need pages of 128: the attend test above covers them)
  const auto [d, threads] = GENERATE(table<int, int>({{64, 1}, {128, 2}}));
  const setup s{3, 1, d, 64, 128, 32, threads};
  const auto policies = every_format(s.page, d);
  for (size_t i = 0; i < policies.size(); ++i) {
    const auto& pol = policies[i];
    const bool mixed = i + 1 == policies.size();
    KVCache c = make(s, pol);
    std::mt19937 rng(uint32_t(77 + i + d));
    for (int64_t before : {int64_t(0), int64_t(301)})
      for (int64_t T : {int64_t(1), int64_t(s.window), int64_t(3 * s.window + 17)}) {
        CAPTURE(d, threads, mixed, format_name(pol->current(0, 0).k), format_name(pol->current(0, 0).v), before, T);
        check_prefill(c, before, T, rng);
      }
  }
}

TEST_CASE("prefill of at most the window equals append + attend", "[cpu_attention][prefill]") {
  const int64_t T = GENERATE(1, 37, 128);
  const setup s{8, 2, 64, 64, 128, 32};
  auto pol = std::make_shared<rotating_policy>(usable(role::k, 64, 64), usable(role::v, 64, 64), 64);
  auto [a, b] = twins(s, pol, 250, 3);
  std::mt19937 rng(4);
  auto k = randn(rng, size_t(T) * 2 * 64), v = randn(rng, k.size()), q = randn(rng, size_t(T) * 8 * 64);
  std::vector<float> oa(q.size()), ob(q.size());
  check(a.prefill(0, 0, view(k.data(), T, 2, 64), view(v.data(), T, 2, 64), view(q.data(), T, 8, 64),
                  {oa.data(), dtype::f32, T, 8, 64}));
  check(b.append(0, 0, view(k.data(), T, 2, 64), view(v.data(), T, 2, 64)));
  const attend_item it{0, int(T)};
  check(b.attend({&it, 1}, 0, view(q.data(), T, 8, 64), {ob.data(), dtype::f32, T, 8, 64}));
  CAPTURE(T);
  require_close(oa, ob);
  REQUIRE(a.stats().used_bytes == b.stats().used_bytes);
}

TEST_CASE("attend_prefix writes the log-sum-exp, and merged with the chunk's own part gives prefill",
          "[cpu_attention][prefill]") {
  const setup s{6, 2, 64, 64, 128, 32};
  auto pol = std::make_shared<rotating_policy>(std::vector{format_id(find_format(family::kivi, 4, 32))},
                                               std::vector{format_id(find_format(family::kivi, 2, 32))}, 64);
  const int H = 2, Hq = 6, d = 64;
  const int64_t before = 190, T = 300;
  auto [a, b] = twins(s, pol, before, 8);
  std::mt19937 rng(9);
  auto k = randn(rng, size_t(T) * H * d), v = randn(rng, k.size()), q = randn(rng, size_t(T) * Hq * d);
  std::vector<float> want(q.size()), o(q.size()), lse(size_t(T) * Hq);
  check(a.prefill(0, 0, view(k.data(), T, H, d), view(v.data(), T, H, d), view(q.data(), T, Hq, d),
                  {want.data(), dtype::f32, T, Hq, d}));
  // the engine's way: append, attend over the stored prefix, attend the chunk itself, merge
  check(b.append(0, 0, view(k.data(), T, H, d), view(v.data(), T, H, d)));
  check(b.attend_prefix(0, 0, before, view(q.data(), T, Hq, d), {o.data(), dtype::f32, T, Hq, d}, lse.data()));
  const float scale = 1.f / std::sqrt(float(d));
  auto kf = stored(b, 0, role::k, before, {}), vf = stored(b, 0, role::v, before, {});
  std::vector<float> o2(q.size()), lse2(lse.size());
  for (int64_t i = 0; i < T; ++i)
    for (int qh = 0; qh < Hq; ++qh) {
      const int kh = qh / (Hq / H);
      const float* qi = q.data() + (i * Hq + qh) * d;
      // the prefix's lse in double, from the stored prefix
      double mx = -1e300, sum = 0;
      std::vector<double> sc(static_cast<size_t>(before));
      for (int64_t j = 0; j < before; ++j) {
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += double(qi[c]) * kf[size_t((j * H + kh) * d + c)];
        mx = std::max(mx, sc[size_t(j)] = dot * scale);
      }
      for (double x : sc) sum += std::exp(x - mx);
      REQUIRE(std::fabs(lse[size_t(i * Hq + qh)] - (mx + std::log(sum))) < 1e-4);
      // the chunk's causal part over its fp16 K/V
      std::vector<double> cs(size_t(i + 1));
      double cm = -1e300, csum = 0;
      for (int64_t j = 0; j <= i; ++j) {
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += double(qi[c]) * round16(k[size_t((j * H + kh) * d + c)]);
        cm = std::max(cm, cs[size_t(j)] = dot * scale);
      }
      for (auto& x : cs) csum += (x = std::exp(x - cm));
      for (int c = 0; c < d; ++c) {
        double acc = 0;
        for (int64_t j = 0; j <= i; ++j) acc += cs[size_t(j)] * round16(v[size_t((j * H + kh) * d + c)]);
        o2[size_t((i * Hq + qh) * d + c)] = float(acc / csum);
      }
      lse2[size_t(i * Hq + qh)] = float(cm + std::log(csum));
    }
  merge_attention(o.data(), lse.data(), o2.data(), lse2.data(), T * Hq, d);
  require_close(o, want);

  // an empty prefix: o = 0, lse = -inf; merging it changes nothing
  std::vector<float> oe(size_t(Hq) * d, 1.f), le(size_t(Hq), 0.f);
  check(b.attend_prefix(0, 0, 0, view(q.data(), 1, Hq, d), {oe.data(), dtype::f32, 1, Hq, d}, le.data()));
  for (float x : oe) REQUIRE(x == 0.f);
  for (float x : le) REQUIRE(x == -INFINITY);
  std::vector<float> keep(o2.begin(), o2.begin() + Hq * d), lk(lse2.begin(), lse2.begin() + Hq);
  merge_attention(keep.data(), lk.data(), oe.data(), le.data(), Hq, d);
  REQUIRE(std::equal(keep.begin(), keep.end(), o2.begin()));
  REQUIRE(b.attend_prefix(0, 0, before + T + 1, view(q.data(), 1, Hq, d), {oe.data(), dtype::f32, 1, Hq, d}, le.data())
              .code() == errc::invalid_argument);
}

TEST_CASE("a prefill that fails changes nothing", "[cpu_attention][prefill][errors]") {
  setup s{6, 2, 64, 64, 128, 32};
  s.budget = 160ull << 10;  // a window and a few pages
  auto pol = std::make_shared<rotating_policy>(std::vector{fp16_format}, std::vector{fp16_format}, 64);
  KVCache c = make(s, pol);
  std::mt19937 rng(11);
  check(c.create_sequence(0));
  fill(c, 0, 100, rng);
  const int H = 2, Hq = 6, d = 64;
  const auto before = c.stats();
  std::vector<float> kv0(size_t(100) * H * d);
  check(c.read(0, 0, role::k, kv0));
  auto unchanged = [&] {
    REQUIRE(c.length(0, 0) == 100);
    REQUIRE(c.stats().used_bytes == before.used_bytes);
    REQUIRE(c.stats().pages == before.pages);
    std::vector<float> now(kv0.size());
    check(c.read(0, 0, role::k, now));
    REQUIRE(now == kv0);
  };
  const int64_t T = 400;
  auto k = randn(rng, size_t(T) * H * d), v = randn(rng, k.size()), q = randn(rng, size_t(T) * Hq * d);
  std::vector<float> o(q.size());
  const tensor_mut om{o.data(), dtype::f32, T, Hq, d};
  // Q rows differ from K rows
  REQUIRE(c.prefill(0, 0, view(k.data(), T, H, d), view(v.data(), T, H, d), view(q.data(), T - 1, Hq, d), om).code() ==
          errc::invalid_argument);
  unchanged();
  // K and V token counts differ
  REQUIRE(c.prefill(0, 0, view(k.data(), T, H, d), view(v.data(), T - 1, H, d), view(q.data(), T, Hq, d), om).code() ==
          errc::invalid_argument);
  unchanged();
  // a NaN in V (a chunk that fits the budget)
  auto vbad = v;
  vbad[size_t(50) * H * d - 3] = NAN;
  REQUIRE(c.prefill(0, 0, view(k.data(), 50, H, d), view(vbad.data(), 50, H, d), view(q.data(), 50, Hq, d),
                    {o.data(), dtype::f32, 50, Hq, d})
              .code() == errc::non_finite);
  unchanged();
  // more pages than the budget holds
  const status full = c.prefill(0, 0, view(k.data(), T, H, d), view(v.data(), T, H, d), view(q.data(), T, Hq, d), om);
  REQUIRE(full.code() == errc::out_of_budget);
  unchanged();
  // unknown sequence, bad layer, wrong head count
  REQUIRE(c.prefill(9, 0, view(k.data(), T, H, d), view(v.data(), T, H, d), view(q.data(), T, Hq, d), om).code() ==
          errc::not_found);
  REQUIRE(c.prefill(0, 1, view(k.data(), T, H, d), view(v.data(), T, H, d), view(q.data(), T, Hq, d), om).code() ==
          errc::invalid_argument);
  REQUIRE(c.prefill(0, 0, view(k.data(), T, H, d), view(v.data(), T, H, d), view(q.data(), T, H, d), om).code() ==
          errc::invalid_argument);
  unchanged();
}

TEST_CASE("f16 and strided queries, bf16 and strided outputs give the f32 results", "[cpu_attention]") {
  const setup s{8, 2, 64, 64, 128, 32};
  const int H = 2, Hq = 8, d = 64, stride = 3 * Hq * d;  // rows of a wider buffer
  auto pol = std::make_shared<rotating_policy>(usable(role::k, 64, 64), usable(role::v, 64, 64), 64);
  auto [a, b] = twins(s, pol, 300, 21);
  std::mt19937 rng(22);
  const int64_t T = 150;  // above the window: the prefill path
  auto k = randn(rng, size_t(T) * H * d), v = randn(rng, k.size()), q = randn(rng, size_t(T) * Hq * d);
  std::vector<uint16_t> qh(size_t(T) * stride), ob(size_t(T) * stride);
  for (int64_t i = 0; i < T; ++i)
    for (int e = 0; e < Hq * d; ++e) {
      const size_t at = size_t(i) * Hq * d + size_t(e);
      qh[size_t(i) * stride + Hq * d + e] = float_to_half(q[at]);
      q[at] = half_to_float(qh[size_t(i) * stride + Hq * d + e]);
    }
  std::vector<float> of(q.size());
  check(a.prefill(0, 0, view(k.data(), T, H, d), view(v.data(), T, H, d), view(q.data(), T, Hq, d),
                  {of.data(), dtype::f32, T, Hq, d}));
  check(b.prefill(0, 0, view(k.data(), T, H, d), view(v.data(), T, H, d),
                  {qh.data() + Hq * d, dtype::f16, T, Hq, d, stride}, {ob.data() + 2 * Hq * d, dtype::bf16, T, Hq, d, stride}));
  // a decode step of the same query rows (the first one) through attend
  std::vector<float> of1(size_t(Hq) * d);
  const attend_item it{0, 1};
  check(a.append(0, 0, view(k.data(), 1, H, d), view(v.data(), 1, H, d)));
  check(b.append(0, 0, view(k.data(), 1, H, d), view(v.data(), 1, H, d)));
  check(a.attend({&it, 1}, 0, view(q.data(), 1, Hq, d), {of1.data(), dtype::f32, 1, Hq, d}));
  std::vector<uint16_t> ob1(static_cast<size_t>(stride));
  check(b.attend({&it, 1}, 0, {qh.data() + Hq * d, dtype::f16, 1, Hq, d, stride},
                 {ob1.data() + Hq * d, dtype::bf16, 1, Hq, d, stride}));
  size_t diff = 0;
  for (int64_t i = 0; i < T; ++i)
    for (int e = 0; e < Hq * d; ++e)
      diff += ob[size_t(i) * stride + 2 * Hq * d + e] != float_to_bf16(of[size_t(i) * Hq * d + e]);
  for (int e = 0; e < Hq * d; ++e) diff += ob1[size_t(Hq * d + e)] != float_to_bf16(of1[size_t(e)]);
  REQUIRE(diff == 0);
}

TEST_CASE("causal_attention equals the plain causal softmax in double", "[cpu_attention]") {
  const int threads = GENERATE(1, 2);
  cpu::worker_pool pool(threads);
  const cpu::task_runner run = [&](int n, const std::function<void(int)>& fn) { pool.run(n, fn); };
  const uint32_t seed = 11;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  struct shape {
    int q_heads, kv_heads, head_dim;
  };
  for (const shape sh : {shape{9, 3, 64}, shape{8, 4, 8}, shape{4, 2, 12}, shape{8, 2, 16}, shape{3, 3, 16},
                         shape{5, 1, 8}})
    for (int64_t T : {1, 3, 17, 65, 130})
      for (int64_t pos0 : {0, 5, 70}) {
        CAPTURE(seed, threads, sh.q_heads, sh.kv_heads, sh.head_dim, T, pos0);
        const int64_t n = pos0 + T, hd = sh.head_dim;
        std::vector<float> q(size_t(T * sh.q_heads * hd)), k(size_t(n * sh.kv_heads * hd)), v(k.size());
        for (auto& x : q) x = 2.f * nd(rng);
        for (auto& x : k) x = 2.f * nd(rng);
        for (auto& x : v) x = nd(rng);
        std::vector<float> o(q.size());
        cpu::causal_attention(run, q.data(), k.data(), v.data(), o.data(), T, pos0, sh.q_heads, sh.kv_heads,
                              sh.head_dim, float(1.0 / std::sqrt(double(hd))));
        double worst = 0;
        const int group = sh.q_heads / sh.kv_heads;
        for (int64_t t = 0; t < T; ++t)
          for (int h = 0; h < sh.q_heads; ++h) {
            const int kvh = h / group;
            std::vector<double> w(size_t(pos0 + t + 1));
            double mx = -1e300, sum = 0;
            for (int64_t j = 0; j <= pos0 + t; ++j) {
              double dot = 0;
              for (int64_t c = 0; c < hd; ++c)
                dot += double(q[size_t((t * sh.q_heads + h) * hd + c)]) * k[size_t((j * sh.kv_heads + kvh) * hd + c)];
              w[size_t(j)] = dot / std::sqrt(double(hd));
              mx = std::max(mx, w[size_t(j)]);
            }
            for (auto& x : w) sum += (x = std::exp(x - mx));
            for (int64_t c = 0; c < hd; ++c) {
              double want = 0;
              for (int64_t j = 0; j <= pos0 + t; ++j)
                want += w[size_t(j)] / sum * v[size_t((j * sh.kv_heads + kvh) * hd + c)];
              worst = std::max(worst, std::fabs(want - o[size_t((t * sh.q_heads + h) * hd + c)]));
            }
          }
        CHECK(worst < 2e-5);  // measured below 1e-5, as far as a plain float loop is
      }
}
