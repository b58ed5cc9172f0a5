// Moving sequences on the CPU backend: export and import bit for bit for every format (rotated,
// with sink pages, after a truncation, forks stored once), the blob's checks (truncated,
// corrupted, incompatible caches, a full budget: errors that change nothing), files, and swap.
#include <catch2/catch.hpp>
#include <kvq/cache/cache.hpp>
#include <kvq/cache/sequence_blob.hpp>
#include <kvq/policy/static_policy.hpp>

#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cache_reads.hpp"

using namespace kvq;
using kvq::test::attend_all;
using kvq::test::read_all;

namespace {

// P = 32, R = 64, r = 16: a page is encoded once 48 tokens are unencoded.
constexpr int layers = 2, hq = 4, kvh = 2, d = 32, page = 32, window = 64, recent = 16;

struct options {
  uint64_t budget = 16ull << 20;
  bool rotated = false;
  int sink_pages = 0;
  uint64_t swap = 0;
  int kv_heads = kvh;
};

KVCache make(const std::string& spec, const options& o = {}) {
  cache_config cfg;
  cfg.shape = {layers, hq, o.kv_heads, d, page, window, recent};
  cfg.budget_bytes = o.budget;
  cfg.max_sequences = 8;
  cfg.sink_pages = o.sink_pages;
  cfg.swap_bytes = o.swap;
  if (o.rotated) cfg.rotation = rotation_config::all(cfg.shape, 1234);
  return KVCache::create(cfg, std::make_shared<static_policy>(static_policy::parse(spec).value_or_throw()))
      .value_or_throw();
}

// Appends `n` seeded random tokens to every layer of `seq`, in chunks of at most 40.
void feed(KVCache& c, seq_id seq, int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int64_t a = 0; a < n; a += 40) {
    const int64_t m = std::min<int64_t>(40, n - a);
    std::vector<float> k(size_t(m) * kvh * d), v(k.size());
    for (int l = 0; l < layers; ++l) {
      for (auto& x : k) x = nd(rng);
      for (auto& x : v) x = nd(rng);
      check(c.append(seq, l, {k.data(), dtype::f32, m, kvh, d}, {v.data(), dtype::f32, m, kvh, d}));
    }
  }
}


std::vector<uint8_t> export_of(const KVCache& c, std::vector<seq_id> ids) {
  return c.export_sequences(ids).value_or_throw();
}

// A blob's sequences in a form that does not depend on where the arena placed their blocks: per
// sequence its lengths, each page's block bytes in page order, and its window.
std::vector<uint8_t> canonical(const std::vector<uint8_t>& blob) {
  const blob_info info = inspect_blob(blob).value_or_throw();
  const uint8_t* payload = blob.data() + info.payload_offset();
  std::vector<uint8_t> out;
  for (const blob_sequence& s : info.sequences) {
    for (const blob_layer& l : s.layers) {
      for (int64_t x : {l.n, l.e, l.ring_from})
        out.insert(out.end(), reinterpret_cast<const uint8_t*>(&x), reinterpret_cast<const uint8_t*>(&x) + 8);
      for (uint32_t b : l.blocks)
        out.insert(out.end(), payload + info.blocks[b].at, payload + info.blocks[b].at + info.blocks[b].bytes);
    }
    out.insert(out.end(), payload + s.window_at, payload + s.window_at + s.window_bytes);
  }
  return out;
}

auto summary(const cache_stats& s) {
  return std::make_tuple(s.used_bytes, s.free_bytes, s.page_bytes, s.window_bytes, s.pages, s.shared_pages,
                         s.sequences, s.tokens, s.swapped_sequences, s.swap_used_bytes);
}

// A failed call: its code and a part of its message; nothing of the cache changed.
void expect_refused(const KVCache& c, const status& st, errc code, const std::string& part,
                    const decltype(summary(cache_stats{}))& before) {
  CAPTURE(st.message());
  CHECK(st.code() == code);
  CHECK(st.message().find(part) != std::string::npos);
  CHECK(summary(c.stats()) == before);
}

// Every format this build has, as a static policy spec (all formats hold this shape).
std::vector<std::string> every_format() {
  std::vector<std::string> out;
  for (size_t f = 0; f < format_count; ++f)
    if (check_shape(format_id(f), role::k, page, d).ok() && check_shape(format_id(f), role::v, page, d).ok())
      out.push_back(format_name(format_id(f)));
  return out;
}

}  // namespace

TEST_CASE("export and import: every format, bit for bit, and the sequence goes on as before", "[transfer]") {
  const std::vector<std::string> formats = every_format();
  REQUIRE(formats.size() >= 20);
  for (const std::string& spec : formats)
    for (const options& o : {options{}, options{16ull << 20, true, 1}}) {
      if (o.rotated && (spec == "fp16" || spec == "bf16")) continue;
      CAPTURE(spec, o.rotated, o.sink_pages);
      KVCache a = make(spec, o);
      check(a.create_sequence(1));
      check(a.create_sequence(2));
      feed(a, 1, 217, 1);  // pages and a full window
      feed(a, 2, 21, 2);   // the window only, one lane
      const std::vector<uint8_t> blob = export_of(a, {1, 2});
      const blob_info info = inspect_blob(blob).value_or_throw();
      REQUIRE(info.sequences.size() == 2);
      CHECK(info.sequences[0].layers[0].n == 217);
      CHECK(info.sequences[0].layers[0].e == 192);  // 6 pages: 217 - 192 = 25 < P + r
      CHECK(info.blocks.size() == size_t(layers) * 6);
      CHECK(info.sequences[1].lanes == 1);
      CHECK(blob.size() == a.export_bytes(std::vector<seq_id>{1, 2}).value_or_throw());

      KVCache b = make(spec, o);
      check(b.import_sequences(blob, std::vector<seq_id>{1, 2}));
      // pages and windows bit for bit: the blob of the imported sequences is the same blob
      CHECK(export_of(b, {1, 2}) == blob);
      CHECK(read_all(b, 1) == read_all(a, 1));
      CHECK(read_all(b, 2) == read_all(a, 2));
      CHECK(attend_all(b, 1, 3) == attend_all(a, 1, 3));
      CHECK(attend_all(b, 2, 1) == attend_all(a, 2, 1));
      CHECK(b.stats().page_bytes == a.stats().page_bytes);
      CHECK(b.stats().tokens == a.stats().tokens);
      // the same appends after the round trip encode the same pages
      feed(a, 1, 70, 3);
      feed(b, 1, 70, 3);
      feed(a, 2, 90, 4);
      feed(b, 2, 90, 4);
      CHECK(attend_all(b, 1, 1) == attend_all(a, 1, 1));
      CHECK(attend_all(b, 2, 2) == attend_all(a, 2, 2));
      CHECK(canonical(export_of(b, {1, 2})) == canonical(export_of(a, {1, 2})));
    }
}

TEST_CASE("export and import: mixed formats, truncated and empty sequences, the encoder's parameters", "[transfer]") {
  const std::string spec = "k=kivi4/g32,v=kivi2/g32;1=cb3/g32;0.1=sym8";
  KVCache a = make(spec, {16ull << 20, false, 0});
  check(a.create_sequence(5));
  feed(a, 5, 300, 9);
  check(a.truncate(5, 131));  // a cut inside a page whose first tokens left the ring
  check(a.create_sequence(6));  // empty
  const std::vector<uint8_t> blob = export_of(a, {5, 6});
  const blob_info info = inspect_blob(blob).value_or_throw();
  CHECK(info.sequences[1].layers[0].n == 0);
  REQUIRE(info.levels.size() == 1);  // cb3/g32's levels; the clip percentiles always
  CHECK(format_name(info.levels[0].first) == "cb3/g32");
  CHECK(info.clip.size() == size_t(layers) * kvh * 2);
  KVCache b = make(spec);
  check(b.import_sequences(blob, std::vector<seq_id>{50, 60}));
  CHECK(read_all(b, 50) == read_all(a, 5));
  CHECK(b.length(60, 1) == 0);
  feed(a, 5, 100, 10);
  feed(b, 50, 100, 10);
  CHECK(attend_all(b, 50, 2) == attend_all(a, 5, 2));
  feed(a, 6, 50, 11);
  feed(b, 60, 50, 11);
  CHECK(attend_all(b, 60, 1) == attend_all(a, 6, 1));
}

TEST_CASE("export: pages a fork shares are stored once and shared again after import", "[transfer]") {
  KVCache a = make("kivi4/g32");
  check(a.create_sequence(1));
  feed(a, 1, 200, 1);
  check(a.fork(1, 2));
  feed(a, 2, 100, 2);
  const uint64_t alone = a.export_bytes(std::vector<seq_id>{1}).value_or_throw();
  const std::vector<uint8_t> blob = export_of(a, {1, 2});
  const blob_info info = inspect_blob(blob).value_or_throw();
  // sequence 1's pages once, plus sequence 2's own pages and its window
  CHECK(info.blocks.size() == size_t(layers) * (5 + 3));
  CHECK(blob.size() < 2 * alone);
  KVCache b = make("kivi4/g32");
  check(b.import_sequences(blob, std::vector<seq_id>{1, 2}));
  CHECK(b.stats().shared_pages == a.stats().shared_pages);
  CHECK(b.stats().page_bytes == a.stats().page_bytes);
  CHECK(attend_all(b, 2, 1) == attend_all(a, 2, 1));
  // releasing one sharer keeps the other's pages
  check(b.release_sequence(1));
  CHECK(b.stats().shared_pages == 0);
  CHECK(attend_all(b, 2, 1) == attend_all(a, 2, 1));
}

TEST_CASE("import: a corrupted, truncated or incompatible blob, a taken id or a full budget changes nothing",
          "[transfer]") {
  KVCache a = make("kivi4/g32", {16ull << 20, true, 1});
  check(a.create_sequence(1));
  feed(a, 1, 150, 1);
  const std::vector<uint8_t> blob = export_of(a, {1});

  KVCache b = make("kivi4/g32", {16ull << 20, true, 1});
  check(b.create_sequence(9));
  feed(b, 9, 77, 5);
  const auto before = summary(b.stats());
  const std::vector<float> reads = read_all(b, 9);
  const std::vector<seq_id> one{1};
  // every truncation, and a byte flipped at positions across header, meta and payload
  for (size_t n : {size_t(0), size_t(10), size_t(47), size_t(48), size_t(100), blob.size() / 2, blob.size() - 1})
    expect_refused(b, b.import_sequences(std::span(blob).first(n), one), errc::invalid_argument, "sequence blob", before);
  for (size_t at = 0; at < blob.size(); at += 1 + blob.size() / 97) {
    std::vector<uint8_t> bad = blob;
    bad[at] ^= 0x10;
    CAPTURE(at);
    expect_refused(b, b.import_sequences(bad, one), errc::invalid_argument, "sequence blob", before);
  }
  std::vector<uint8_t> longer = blob;
  longer.push_back(0);
  expect_refused(b, b.import_sequences(longer, one), errc::invalid_argument, "trailing", before);
  expect_refused(b, b.import_sequences(blob, std::vector<seq_id>{1, 2}), errc::invalid_argument, "holds 1", before);
  expect_refused(b, b.import_sequences(blob, std::vector<seq_id>{9}), errc::invalid_argument, "already exists", before);
  CHECK(read_all(b, 9) == reads);

  // other caches: shape, rotation, sink pages, budget
  {
    KVCache c = make("kivi4/g32", {16ull << 20, true, 1, 0, 1});
    const auto s = summary(c.stats());
    expect_refused(c, c.import_sequences(blob, one), errc::invalid_argument, "kv_heads is 2, this cache's 1", s);
  }
  {
    KVCache c = make("kivi4/g32", {16ull << 20, false, 1});
    const auto s = summary(c.stats());
    expect_refused(c, c.import_sequences(blob, one), errc::invalid_argument, "rotated in the blob", s);
  }
  {
    KVCache c = make("kivi4/g32", {16ull << 20, true, 0});
    const auto s = summary(c.stats());
    expect_refused(c, c.import_sequences(blob, one), errc::invalid_argument, "sink_pages", s);
  }
  {
    // room for the window but not every page block
    KVCache c = make("kivi4/g32", {48 * 1024, true, 1});
    check(c.create_sequence(3));
    const auto s = summary(c.stats());
    expect_refused(c, c.import_sequences(blob, one), errc::out_of_budget, "nothing was stored", s);
  }
  // a format this kvq does not know: the name in the meta changed, checksums made valid again
  {
    std::vector<uint8_t> renamed = blob;
    const std::string name = "kivi4/g32";
    auto at = std::search(renamed.begin(), renamed.end(), name.begin(), name.end());
    REQUIRE(at != renamed.end());
    *(at + 4) = '5';  // kivi5/g32
    blob_info info = inspect_blob(blob).value_or_throw();
    std::vector<uint8_t> meta(renamed.begin() + blob_header_bytes, renamed.begin() + long(info.payload_offset()));
    detail::seal_blob(info, meta, renamed);
    expect_refused(b, b.import_sequences(renamed, one), errc::invalid_argument, "unknown to this kvq", before);
  }
  // the good blob still imports
  check(b.import_sequences(blob, one));
  CHECK(attend_all(b, 1, 2) == attend_all(a, 1, 2));
}

TEST_CASE("export_file and import_file", "[transfer]") {
  KVCache a = make("sym4");
  check(a.create_sequence(1));
  feed(a, 1, 99, 1);
  const std::string path = (std::filesystem::temp_directory_path() / "kvq_test_transfer.kvqseq").string();
  check(a.export_file(path, std::vector<seq_id>{1}));
  KVCache b = make("sym4");
  check(b.import_file(path, std::vector<seq_id>{4}));
  CHECK(read_all(b, 4) == read_all(a, 1));
  std::remove(path.c_str());
  const status missing = b.import_file(path, std::vector<seq_id>{5});
  CHECK(missing.code() == errc::io_error);
  CHECK(missing.message().find(path) != std::string::npos);
  const status nowhere = a.export_file("/nonexistent-dir/x.kvqseq", std::vector<seq_id>{1});
  CHECK(nowhere.code() == errc::io_error);
}

TEST_CASE("swap_out and swap_in: budget freed and taken back, bit for bit, refusals by name", "[transfer]") {
  KVCache c = make("k=kivi4/g32,v=kivi2/g32", {16ull << 20, false, 0, 4u << 20});
  check(c.create_sequence(1));
  check(c.create_sequence(2));
  feed(c, 1, 250, 1);
  feed(c, 2, 90, 2);
  const std::vector<float> reads = read_all(c, 1);
  const std::vector<float> out = attend_all(c, 1, 2);
  const std::vector<uint8_t> blob = export_of(c, {1});
  const uint64_t free_before = c.stats().free_bytes;
  const int64_t tokens_before = c.stats().tokens;

  check(c.swap_out(1));
  CHECK(c.is_swapped(1));
  CHECK(c.has_sequence(1));
  CHECK(c.length(1, 1) == 250);
  CHECK(c.stats().free_bytes > free_before);
  CHECK(c.stats().swapped_sequences == 1);
  CHECK(c.stats().swap_used_bytes > 0);
  CHECK(c.stats().tokens == tokens_before - 250 * layers);
  const uint64_t need = c.swap_in_bytes(1).value_or_throw();
  CHECK(need == c.stats().free_bytes - free_before);
  // a swapped-out sequence refuses everything but swap_in and release, naming the swap
  std::vector<float> q(size_t(hq) * d), o(q.size());
  const attend_item it{1, 1};
  const status refused = c.attend({&it, 1}, 0, {q.data(), dtype::f32, 1, hq, d}, {o.data(), dtype::f32, 1, hq, d});
  CHECK(refused.message().find("swapped out") != std::string::npos);
  CHECK(c.append(1, 0, {q.data(), dtype::f32, 1, kvh, d}, {q.data(), dtype::f32, 1, kvh, d}).message().find(
            "swapped out") != std::string::npos);
  CHECK(c.fork(1, 3).message().find("swapped out") != std::string::npos);
  CHECK(c.truncate(1, 3).message().find("swapped out") != std::string::npos);
  CHECK(c.export_bytes(std::vector<seq_id>{1}).error().message().find("swapped out") != std::string::npos);
  CHECK(c.swap_out(1).message().find("swapped out") != std::string::npos);
  CHECK(c.create_sequence(1).code() == errc::invalid_argument);
  // sequence 2 goes on meanwhile
  feed(c, 2, 30, 3);

  check(c.swap_in(1));
  CHECK(!c.is_swapped(1));
  CHECK(read_all(c, 1) == reads);
  CHECK(attend_all(c, 1, 2) == out);
  CHECK(export_of(c, {1}).size() == blob.size());
  CHECK(c.stats().swapped_out_bytes == c.stats().swapped_in_bytes);
  CHECK(c.stats().swap_used_bytes == 0);
  CHECK(c.swap_in(1).message().find("not swapped out") != std::string::npos);

  // no swap space, too little swap space, no budget to come back: nothing changes
  {
    KVCache none = make("kivi4/g32");
    check(none.create_sequence(1));
    feed(none, 1, 100, 1);
    const auto s = summary(none.stats());
    expect_refused(none, none.swap_out(1), errc::unsupported, "swap_bytes", s);
    KVCache small = make("kivi4/g32", {16ull << 20, false, 0, 4096});
    check(small.create_sequence(1));
    feed(small, 1, 100, 1);
    const auto t = summary(small.stats());
    expect_refused(small, small.swap_out(1), errc::out_of_budget, "swap space", t);
  }
  {
    KVCache tight = make("kivi4/g32", {64 * 1024, false, 0, 1u << 20});
    check(tight.create_sequence(1));
    feed(tight, 1, 120, 1);
    const std::vector<float> r1 = read_all(tight, 1);
    check(tight.swap_out(1));
    check(tight.create_sequence(2));
    feed(tight, 2, 120, 2);  // takes the room sequence 1 left
    const auto s = summary(tight.stats());
    expect_refused(tight, tight.swap_in(1), errc::out_of_budget, "nothing was stored", s);
    CHECK(tight.is_swapped(1));
    check(tight.release_sequence(2));
    check(tight.swap_in(1));
    CHECK(read_all(tight, 1) == r1);
    // releasing a swapped-out sequence frees its swap space
    check(tight.swap_out(1));
    check(tight.release_sequence(1));
    CHECK(!tight.has_sequence(1));
    CHECK(tight.stats().swap_used_bytes == 0);
  }
}

TEST_CASE("crc32c: the Castagnoli check value, continuation, and large inputs in parallel", "[transfer]") {
  const std::string nine = "123456789";
  const std::span<const uint8_t> b(reinterpret_cast<const uint8_t*>(nine.data()), nine.size());
  CHECK(crc32c(b) == 0xE3069283u);
  CHECK(crc32c(b.subspan(4), crc32c(b.first(4))) == 0xE3069283u);
  // 100 MiB + 7 bytes: split over threads and combined, equal to the byte-at-a-time continuation
  std::vector<uint8_t> big((size_t(100) << 20) + 7);
  std::mt19937 rng(3);
  for (auto& x : big) x = uint8_t(rng());
  const uint32_t whole = crc32c(big);
  uint32_t running = 0;
  for (size_t at = 0; at < big.size(); at += size_t(3) << 20)
    running = crc32c(std::span(big).subspan(at, std::min(size_t(3) << 20, big.size() - at)), running);
  CHECK(whole == running);
  big[12345678] ^= 1;
  CHECK(crc32c(big) != whole);
}
