// Sequence lifetime on the CPU backend: fork (shared, reference-counted pages; a window of its
// own), truncate (cut in the ring, in a page still in the ring, in a page whose tokens must be
// decoded), release order, stats counting a shared page once, bytes_for, and failures that change
// nothing.
#include <catch2/catch.hpp>
#include <kvq/cache/cache.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/static_policy.hpp>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cache_reads.hpp"

using namespace kvq;
using kvq::test::attend_all;

namespace {

// P = 32, R = 64, r = 16: a page is encoded once 48 tokens are unencoded.
constexpr int layers = 2, hq = 4, kvh = 2, d = 32, page = 32, window = 64, recent = 16;

// spec: a static policy's spec, optionally followed by `+sink<N>` (cache_config::sink_pages N).
KVCache make(const std::string& spec, uint64_t budget = 16ull << 20, int max_sequences = 8) {
  cache_config cfg;
  cfg.shape = {layers, hq, kvh, d, page, window, recent};
  cfg.budget_bytes = budget;
  cfg.max_sequences = max_sequences;
  const size_t sink = spec.find("+sink");
  if (sink != std::string::npos) cfg.sink_pages = std::stoi(spec.substr(sink + 5));
  return KVCache::create(cfg, std::make_shared<static_policy>(static_policy::parse(spec.substr(0, sink)).value_or_throw()))
      .value_or_throw();
}

// The K and V rows of one sequence: [layers][tokens][kv_heads][head_dim].
struct tokens {
  std::vector<std::vector<float>> k, v;
  int64_t count() const { return int64_t(k[0].size()) / (kvh * d); }
};

tokens random_tokens(std::mt19937& rng, int64_t n) {
  std::normal_distribution<float> nd(0.f, 1.f);
  tokens t;
  for (int l = 0; l < layers; ++l) {
    t.k.emplace_back(size_t(n) * kvh * d);
    t.v.emplace_back(size_t(n) * kvh * d);
    for (auto& x : t.k.back()) x = nd(rng);
    for (auto& x : t.v.back()) x = nd(rng);
  }
  return t;
}

tokens concat(const tokens& a, int64_t a_count, const tokens& b) {
  tokens t = a;
  const size_t keep = size_t(a_count) * kvh * d;
  for (int l = 0; l < layers; ++l) {
    t.k[size_t(l)].resize(keep);
    t.v[size_t(l)].resize(keep);
    t.k[size_t(l)].insert(t.k[size_t(l)].end(), b.k[size_t(l)].begin(), b.k[size_t(l)].end());
    t.v[size_t(l)].insert(t.v[size_t(l)].end(), b.v[size_t(l)].begin(), b.v[size_t(l)].end());
  }
  return t;
}

tokens prefix_of(const tokens& t, int64_t n) {
  return concat(t, n, tokens{std::vector<std::vector<float>>(layers), std::vector<std::vector<float>>(layers)});
}

// Appends tokens [from, to) of `t` to every layer of `seq`, in chunks of at most `chunk`.
void feed(KVCache& c, seq_id seq, const tokens& t, int64_t from, int64_t to, int64_t chunk = 40) {
  for (int64_t a = from; a < to; a += chunk) {
    const int64_t m = std::min(chunk, to - a);
    for (int l = 0; l < layers; ++l) {
      const size_t at = size_t(a) * kvh * d;
      check(c.append(seq, l, {t.k[size_t(l)].data() + at, dtype::f32, m, kvh, d},
                     {t.v[size_t(l)].data() + at, dtype::f32, m, kvh, d}));
    }
  }
}

// What every layer and role of `seq` reads, concatenated.
std::vector<float> read_all(const KVCache& c, seq_id seq) {
  std::vector<float> out;
  for (int l = 0; l < layers; ++l)
    for (role r : {role::k, role::v}) {
      std::vector<float> x(size_t(c.length(seq, l)) * kvh * d);
      check(c.read(seq, l, r, x));
      out.insert(out.end(), x.begin(), x.end());
    }
  return out;
}


// The same tokens fed to a fresh cache of the same configuration.
KVCache alone(const std::string& spec, const tokens& t) {
  KVCache c = make(spec);
  check(c.create_sequence(1));
  feed(c, 1, t, 0, t.count());
  return c;
}

// Requires each element of `got` (read_all of a sequence of `n` tokens) to equal
// want(layer, role index, i), i indexing that layer and role's [token][kv_heads][head_dim].
template <class Want>
void require_reads(const std::vector<float>& got, int64_t n, Want want) {
  REQUIRE(got.size() == size_t(n) * kvh * d * layers * 2);
  size_t at = 0;
  for (int l = 0; l < layers; ++l)
    for (int ri = 0; ri < 2; ++ri)
      for (size_t i = 0; i < size_t(n) * kvh * d; ++i, ++at)
        if (got[at] != want(l, ri, i)) {
          CAPTURE(l, ri, i / (kvh * d));
          REQUIRE(got[at] == want(l, ri, i));
        }
}

// The fields of stats() that sequence management changes.
auto summary(const cache_stats& s) {
  return std::make_tuple(s.used_bytes, s.free_bytes, s.page_bytes, s.window_bytes, s.pages, s.shared_pages,
                         s.shared_saved_bytes, s.sequences, s.tokens);
}

// A failed call on `c` returned `code` with `part` in its message and left the statistics and
// what sequence 1 reads as they were.
template <class Summary>
void expect_failed(const KVCache& c, const status& st, errc code, const std::string& part, const Summary& before,
                   const std::vector<float>& reads) {
  CAPTURE(st.message());
  CHECK(st.code() == code);
  CHECK(st.message().find(part) != std::string::npos);
  CHECK(summary(c.stats()) == before);
  CHECK(read_all(c, 1) == reads);
}

}  // namespace

TEST_CASE("a forked sequence diverges: each equals a cache fed that sequence alone", "[fork]") {
  const std::string spec = GENERATE("fp16", "int8", "kivi4/g32", "kivi2/g32");
  const int64_t prefix = GENERATE(1, 31, 47, 48, 49, 100, 130);
  const int64_t more = GENERATE(1, 17, 70);
  const uint32_t seed = 1000 + uint32_t(prefix * 7 + more);
  CAPTURE(spec, prefix, more, seed);
  std::mt19937 rng(seed);
  const tokens base = random_tokens(rng, prefix), a = random_tokens(rng, more), b = random_tokens(rng, more + 5);
  KVCache c = alone(spec, base);
  const cache_stats before = c.stats();
  check(c.fork(1, 2));
  const cache_stats forked = c.stats();
  // The fork's window takes as many lanes as the source's: free lanes of the source's ring block
  // when it holds one lane of two, else a new ring block. The pages are listed twice but stored
  // and counted once.
  CHECK(forked.used_bytes - before.used_bytes == forked.window_bytes - before.window_bytes);
  CHECK((forked.window_bytes == before.window_bytes) == (prefix <= page));
  CHECK(forked.pages == before.pages);
  CHECK(forked.page_bytes == before.page_bytes);
  CHECK(forked.shared_pages == before.pages);
  CHECK(forked.shared_saved_bytes == before.page_bytes);
  CHECK(forked.tokens == 2 * before.tokens);
  CHECK(read_all(c, 2) == read_all(c, 1));

  const tokens ta = concat(base, prefix, a), tb = concat(base, prefix, b);
  feed(c, 1, ta, prefix, ta.count(), 16);
  feed(c, 2, tb, prefix, tb.count(), 16);
  KVCache ca = alone(spec, ta), cb = alone(spec, tb);
  CHECK(read_all(c, 1) == read_all(ca, 1));
  CHECK(read_all(c, 2) == read_all(cb, 1));
  const int q_len = int(std::min<int64_t>(more, window));
  CHECK(attend_all(c, 1, q_len) == attend_all(ca, 1, q_len));
  CHECK(attend_all(c, 2, q_len) == attend_all(cb, 1, q_len));
  // The pages both still list are stored once: the bytes are the two alone caches' less the
  // shared part.
  const cache_stats s = c.stats();
  CHECK(s.page_bytes + s.shared_saved_bytes == ca.stats().page_bytes + cb.stats().page_bytes);
}

TEST_CASE("releasing either sharer first frees only what the other does not use", "[fork]") {
  const bool src_first = GENERATE(true, false);
  CAPTURE(src_first);
  std::mt19937 rng(11);
  const tokens base = random_tokens(rng, 150), extra = random_tokens(rng, 60);
  KVCache c = alone("kivi4/g32", base);
  check(c.fork(1, 2));
  check(c.fork(2, 3));  // a fork of a fork shares the same pages
  CHECK(c.stats().shared_saved_bytes == 2 * c.stats().page_bytes);
  check(c.release_sequence(3));
  const tokens t2 = concat(base, 150, extra);
  feed(c, 2, t2, 150, t2.count());
  const std::vector<float> r1 = read_all(c, 1), r2 = read_all(c, 2);
  const seq_id gone = src_first ? 1 : 2, kept = src_first ? 2 : 1;
  const cache_stats both = c.stats();
  check(c.release_sequence(gone));
  const cache_stats one = c.stats();
  CHECK(read_all(c, kept) == (src_first ? r2 : r1));
  CHECK(one.shared_pages == 0);
  CHECK(one.shared_saved_bytes == 0);
  // Releasing the fork's source frees only its window (every page it held is the fork's too);
  // releasing the fork frees its window and its own pages.
  if (src_first)
    CHECK(one.page_bytes == both.page_bytes);
  else
    CHECK(one.page_bytes < both.page_bytes);
  KVCache ref = alone("kivi4/g32", src_first ? t2 : base);
  CHECK(one.page_bytes == ref.stats().page_bytes);
  CHECK(one.pages == ref.stats().pages);
  check(c.release_sequence(kept));
  const cache_stats none = c.stats();
  CHECK(none.used_bytes == 0);
  CHECK(none.pages == 0);
  CHECK(none.page_bytes == 0);
  CHECK(none.free_bytes == none.budget_bytes);
  CHECK(none.largest_free_block == none.budget_bytes);
}

TEST_CASE("a fork that cannot be made is an error and changes nothing", "[fork][errors]") {
  std::mt19937 rng(12);
  const tokens base = random_tokens(rng, 100);
  const uint64_t window_block = uint64_t(layers) * kvh * 2 * window * d * 2;
  // Room for one window and the pages, not for a second window.
  KVCache c = make("int8", window_block + window_block * 3 / 4, 2);
  check(c.create_sequence(1));
  feed(c, 1, base, 0, 100);
  const auto before = summary(c.stats());
  const std::vector<float> r1 = read_all(c, 1);
  auto expect = [&](status st, errc code, const std::string& part) { expect_failed(c, st, code, part, before, r1); };
  expect(c.fork(1, 2), errc::out_of_budget, "FP16 windows");
  CHECK(!c.has_sequence(2));
  expect(c.fork(5, 2), errc::not_found, "unknown sequence 5");
  expect(c.fork(1, 1), errc::invalid_argument, "already exists");
}

TEST_CASE("a fork needs a free sequence slot", "[fork][errors]") {
  KVCache c = make("int8", 16ull << 20, 2);
  check(c.create_sequence(1));
  check(c.create_sequence(2));
  const auto before = summary(c.stats());
  const status st = c.fork(1, 3);
  CHECK(st.code() == errc::out_of_budget);
  CHECK(st.message().find("max_sequences") != std::string::npos);
  CHECK(summary(c.stats()) == before);
}

TEST_CASE("append, truncate, append equals appending the kept tokens directly", "[truncate]") {
  // n = 90 holds pages [0, 64) (e = 64) and ring tokens [26, 90). A cut at 64 or later falls in
  // the ring (at 80 or later page 1 stays; below, a direct append of the kept tokens would not
  // have encoded page 1 yet, so it goes and its tokens are read from the ring); a cut in
  // [48, 64) falls in page 1, whose tokens the ring still holds; a cut at 0 keeps nothing. Cuts
  // in (0, 48) keep page 0 because the ring lost its first tokens: the next tests.
  const std::string spec = GENERATE("fp16", "int8", "kivi4/g32", "kivi2/g32", "kivi2/g32+sink1");
  const int64_t n = 90;
  const int64_t keep = GENERATE(90, 89, 80, 79, 70, 64, 63, 50, 48, 0);
  const int64_t more = GENERATE(1, 30, 75);
  CAPTURE(spec, keep, more);
  std::mt19937 rng(uint32_t(20 + keep + more));
  const tokens all = random_tokens(rng, n), extra = random_tokens(rng, more);
  KVCache c = alone(spec, all);
  const cache_stats full = c.stats();
  check(c.truncate(1, keep));
  for (int l = 0; l < layers; ++l) CHECK(c.length(1, l) == keep);
  CHECK(c.stats().tokens == keep * layers);
  const int64_t direct_pages = keep >= page + recent ? (keep - recent) / page : 0;
  CHECK(c.stats().pages == full.pages / 2 * uint64_t(direct_pages));
  const tokens direct = concat(all, keep, extra);
  KVCache ref = alone(spec, prefix_of(all, keep));
  CHECK(read_all(c, 1) == read_all(ref, 1));
  feed(c, 1, direct, keep, direct.count(), 25);
  feed(ref, 1, direct, keep, direct.count(), 25);
  CHECK(read_all(c, 1) == read_all(ref, 1));
  const int q_len = int(std::min<int64_t>(more, window));
  CHECK(attend_all(c, 1, q_len) == attend_all(ref, 1, q_len));
  CHECK(summary(c.stats()) == summary(ref.stats()));
}

TEST_CASE("a page whose tokens left the ring stays encoded until a direct append would encode it", "[truncate]") {
  // n = 90: pages [0, 64), ring tokens [26, 90). A cut at 40 drops page 1 and keeps page 0 (its
  // tokens 0..25 left the ring), where a direct append of 40 tokens encodes nothing yet; once 48
  // tokens are held the direct cache encodes the same page 0 and both are equal.
  const std::string spec = GENERATE("fp16", "int8", "kivi4/g32", "kivi2/g32");
  CAPTURE(spec);
  std::mt19937 rng(71);
  const tokens all = random_tokens(rng, 90), extra = random_tokens(rng, 30);
  KVCache c = alone(spec, all);
  const std::vector<float> stored = read_all(c, 1);
  const uint64_t pages_per_index = c.stats().pages / 2;
  check(c.truncate(1, 40));
  CHECK(c.stats().pages == pages_per_index);
  require_reads(read_all(c, 1), 40, [&](int l, int ri, size_t i) {
    const float input = (ri == 0 ? all.k : all.v)[size_t(l)][i];
    return i / (kvh * d) < 32 ? stored[size_t(l * 2 + ri) * 90 * kvh * d + i] : half_to_float(float_to_half(input));
  });
  const tokens direct = concat(all, 40, extra);
  KVCache ref = alone(spec, prefix_of(all, 40));
  feed(c, 1, direct, 40, direct.count());
  feed(ref, 1, direct, 40, direct.count());
  CHECK(read_all(c, 1) == read_all(ref, 1));
  CHECK(attend_all(c, 1, 30) == attend_all(ref, 1, 30));
}

TEST_CASE("repeated truncations never read ring slots that dropped tokens overwrote", "[truncate]") {
  // After 90 -> 40 the ring holds tokens [26, 40) only (page 0 stays encoded); cutting again at
  // 40 or 35 keeps page 0, at 30 (inside it) restores its lost tokens from codes, never from
  // the slots dropped tokens overwrote.
  std::mt19937 rng(81);
  const tokens all = random_tokens(rng, 90);
  KVCache c = alone("kivi4/g32", all);
  check(c.truncate(1, 40));
  const std::vector<float> at40 = read_all(c, 1);
  check(c.truncate(1, 40));
  CHECK(read_all(c, 1) == at40);
  const uint64_t pages = c.stats().pages;
  check(c.truncate(1, 35));
  CHECK(c.stats().pages == pages);
  check(c.truncate(1, 30));
  CHECK(c.stats().pages == 0);  // the cut falls in page 0: its kept tokens go back to the ring
  // Tokens 0..25 come back decoded (rounded to fp16), 26..29 are the ring's exact values.
  require_reads(read_all(c, 1), 30, [&](int l, int ri, size_t i) {
    const float input = (ri == 0 ? all.k : all.v)[size_t(l)][i];
    return half_to_float(float_to_half(i / (kvh * d) < 26 ? at40[size_t(l * 2 + ri) * 40 * kvh * d + i] : input));
  });
  const attend_item whole{1, 30};  // the ring holds all 30 again
  std::vector<float> q(size_t(30) * hq * d, 0.5f), o(q.size());
  check(c.attend({&whole, 1}, 0, {q.data(), dtype::f32, 30, hq, d}, {o.data(), dtype::f32, 30, hq, d}));
}

TEST_CASE("a step may not reach back to tokens the ring lost in a truncation", "[truncate][errors]") {
  std::mt19937 rng(82);
  const tokens all = random_tokens(rng, 90);
  KVCache c = alone("int8", all);
  check(c.truncate(1, 40));  // the ring holds tokens [26, 40)
  std::vector<float> q(size_t(20) * hq * d, 0.5f), o(q.size());
  const attend_item back{1, 15}, ok{1, 14};
  const status st = c.attend({&back, 1}, 0, {q.data(), dtype::f32, 15, hq, d}, {o.data(), dtype::f32, 15, hq, d});
  CAPTURE(st.message());
  CHECK(st.code() == errc::invalid_argument);
  CHECK(st.message().find("last 14 tokens") != std::string::npos);
  check(c.attend({&ok, 1}, 0, {q.data(), dtype::f32, 14, hq, d}, {o.data(), dtype::f32, 14, hq, d}));
}

TEST_CASE("a cut in a page whose tokens left the ring restores them decoded from the page", "[truncate]") {
  // n = 100: pages [0, 64), ring tokens [36, 100). A cut at 50 keeps page 1's tokens [32, 50): 32..35
  // come back decoded from the page (rounded to fp16), 36..49 exact from the ring.
  const std::string spec = GENERATE("int8", "kivi4/g32", "kivi2/g32");
  const int64_t n = 100, keep = 50, more = 40;
  CAPTURE(spec);
  std::mt19937 rng(31);
  const tokens all = random_tokens(rng, n), extra = random_tokens(rng, more);
  KVCache c = alone(spec, all);
  std::vector<std::vector<float>> stored;  // [layer][role] what the page held before the cut
  for (int l = 0; l < layers; ++l)
    for (role r : {role::k, role::v}) {
      stored.emplace_back(size_t(n) * kvh * d);
      check(c.read(1, l, r, stored.back()));
    }
  check(c.truncate(1, keep));
  // The documented values: pages below the cut page as stored, 32..35 the page's decoded values in
  // fp16, 36..49 the fp16 of the input.
  tokens expected = prefix_of(all, keep);
  for (int l = 0; l < layers; ++l)
    for (int ri = 0; ri < 2; ++ri) {
      std::vector<float>& x = ri == 0 ? expected.k[size_t(l)] : expected.v[size_t(l)];
      const std::vector<float>& s = stored[size_t(l) * 2 + size_t(ri)];
      for (size_t i = size_t(32) * kvh * d; i < size_t(36) * kvh * d; ++i) x[i] = half_to_float(float_to_half(s[i]));
    }
  int decoded_differs = 0;
  require_reads(read_all(c, 1), keep, [&](int l, int ri, size_t i) {
    const std::vector<float>& x = ri == 0 ? expected.k[size_t(l)] : expected.v[size_t(l)];
    const size_t t = i / (kvh * d);
    const float input = (ri == 0 ? all.k : all.v)[size_t(l)][i];
    decoded_differs += t >= 32 && t < 36 && x[i] != half_to_float(float_to_half(input));
    return t < 32 ? stored[size_t(l) * 2 + size_t(ri)][i] : half_to_float(float_to_half(x[i]));
  });
  CHECK(decoded_differs > 0);  // the decoded tokens are the page's values, not the input's
  // A later append re-encodes them from there: the cache equals one fed the documented values.
  KVCache ref = alone(spec, expected);
  const tokens direct = concat(expected, keep, extra);
  feed(c, 1, direct, keep, direct.count());
  feed(ref, 1, direct, keep, direct.count());
  CHECK(read_all(c, 1) == read_all(ref, 1));
  CHECK(attend_all(c, 1, 7) == attend_all(ref, 1, 7));
}

TEST_CASE("truncating a sharer never changes the other", "[truncate][fork]") {
  const int64_t keep = GENERATE(0, 20, 40, 70, 120);
  CAPTURE(keep);
  std::mt19937 rng(41);
  const tokens base = random_tokens(rng, 130), extra = random_tokens(rng, 50);
  KVCache c = alone("kivi4/g32", base);
  check(c.fork(1, 2));
  const std::vector<float> r1 = read_all(c, 1);
  const int64_t shared_before = int64_t(c.stats().shared_pages);
  check(c.truncate(2, keep));
  CHECK(read_all(c, 1) == r1);
  CHECK(int64_t(c.stats().shared_pages) <= shared_before);
  const tokens t2 = concat(base, keep, extra);
  feed(c, 2, t2, keep, t2.count());
  CHECK(read_all(c, 1) == r1);
  check(c.truncate(1, 0));
  check(c.release_sequence(1));
  KVCache ref = alone("kivi4/g32", base);
  check(ref.truncate(1, keep));
  feed(ref, 1, t2, keep, t2.count());
  CHECK(read_all(c, 2) == read_all(ref, 1));
  CHECK(summary(c.stats()) == summary(ref.stats()));
}

TEST_CASE("a truncate that cannot be done is an error and changes nothing", "[truncate][errors]") {
  std::mt19937 rng(51);
  const tokens base = random_tokens(rng, 80);
  KVCache c = alone("kivi2/g32", base);
  check(c.append(1, 0, {base.k[0].data(), dtype::f32, 3, kvh, d}, {base.v[0].data(), dtype::f32, 3, kvh, d}));
  const auto before = summary(c.stats());
  const std::vector<float> r = read_all(c, 1);
  auto expect = [&](status st, errc code, const std::string& part) { expect_failed(c, st, code, part, before, r); };
  expect(c.truncate(9, 0), errc::not_found, "unknown sequence 9");
  expect(c.truncate(1, -1), errc::invalid_argument, "cannot keep -1");
  expect(c.truncate(1, 83), errc::invalid_argument, "layer 1 holds 80 tokens; cannot keep 83");
  check(c.truncate(1, 80));  // every layer can keep 80
  CHECK(c.length(1, 0) == 80);
}

TEST_CASE("bytes_for is what an append or a new sequence takes from the budget", "[stats]") {
  const std::string spec =
      GENERATE("fp16", "int8", "kivi2/g32", "k=kivi4/g32,v=kivi2/g32;1=fp16", "kivi2/g32+sink1", "int8+sink3");
  const int64_t first = GENERATE(0, 1, 47, 48, 200);
  const int64_t more = GENERATE(0, 1, 33, 64, 300);
  CAPTURE(spec, first, more);
  std::mt19937 rng(61);
  const tokens t = random_tokens(rng, first + more);
  KVCache c = make(spec);
  const uint64_t fresh = c.bytes_for(first).value_or_throw();
  check(c.create_sequence(1));
  feed(c, 1, t, 0, first);
  CHECK(c.stats().used_bytes == fresh);
  const uint64_t need = c.bytes_for(more, seq_id(1)).value_or_throw();
  feed(c, 1, t, first, first + more);
  const cache_stats s = c.stats();
  CHECK(s.used_bytes == fresh + need);
  CHECK(s.free_bytes == s.budget_bytes - s.used_bytes);
  CHECK(s.largest_free_block <= s.free_bytes);
  CHECK(c.bytes_for(-1).error().code() == errc::invalid_argument);
  CHECK(c.bytes_for(1, seq_id(4)).error().code() == errc::not_found);
}
