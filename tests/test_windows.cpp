// Windows that grow with the sequence (page_store lanes, include/kvq/store/store.hpp): short
// sequences share ring blocks, a window grows a lane at a time in place or moves, every address
// stays the layout's own, so each sequence reads and attends exactly as in a cache of its own;
// the budget sees ring blocks, `bytes_for` predicts them, and a growth without budget is an error
// that changes nothing.
#include <algorithm>
#include <catch2/catch.hpp>
#include <kvq/cache/cache.hpp>
#include <kvq/policy/static_policy.hpp>
#include <kvq/store/window_layout.hpp>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "cache_reads.hpp"

using namespace kvq;

namespace {

// P = 32, R = 128 (4 lanes per ring block), r = 16.
constexpr int layers = 2, hq = 4, kvh = 2, d = 32, page = 32, window = 128, recent = 16;
// A ring block: 64 KiB of rings and a 16-slot slack (window_layout.hpp).
constexpr uint64_t block = (uint64_t(layers) * kvh * 2 * window + ring_slack_slots) * d * 2;

KVCache make(uint64_t budget = 8ull << 20, int max_sequences = 64) {
  cache_config cfg;
  cfg.shape = {layers, hq, kvh, d, page, window, recent};
  cfg.budget_bytes = budget;
  cfg.max_sequences = max_sequences;
  return KVCache::create(cfg, std::make_shared<static_policy>(static_policy::parse("kivi4/g32").value_or_throw()))
      .value_or_throw();
}

// A sequence's K and V rows per layer, generated on demand from its id (the same in every cache).
std::vector<float> rows(seq_id s, int layer, int r, int64_t from, int64_t n) {
  std::vector<float> x(size_t(n) * kvh * d);
  for (int64_t t = 0; t < n; ++t) {
    std::mt19937 rng(uint32_t(((s * 7 + layer) * 2 + r) * 100003 + (from + t)));
    std::normal_distribution<float> nd(0.f, 1.f);
    for (size_t i = 0; i < size_t(kvh * d); ++i) x[size_t(t) * kvh * d + i] = nd(rng);
  }
  return x;
}

// Appends tokens [from, from + n) of sequence `src`'s rows to every layer of `s`.
void feed(KVCache& c, seq_id s, int64_t from, int64_t n, seq_id src) {
  for (int l = 0; l < layers; ++l) {
    const std::vector<float> k = rows(src, l, 0, from, n), v = rows(src, l, 1, from, n);
    check(c.append(s, l, {k.data(), dtype::f32, n, kvh, d}, {v.data(), dtype::f32, n, kvh, d}));
  }
}
void feed(KVCache& c, seq_id s, int64_t from, int64_t n) { feed(c, s, from, n, s); }

// One append of a sequence's history: `m` tokens of `src`'s rows.
struct chunk {
  seq_id src;
  int64_t m;
};

using kvq::test::read_all;

std::vector<float> attend_all(KVCache& c, seq_id s) {
  std::mt19937 rng{uint32_t(s)};
  std::normal_distribution<float> nd(0.f, 1.f);
  const int q_len = int(std::min<int64_t>(3, c.length(s, 0)));
  std::vector<float> q(size_t(q_len) * hq * d), o(q.size()), out;
  for (int l = 0; l < layers; ++l) {
    for (auto& x : q) x = nd(rng);
    const attend_item it{s, q_len};
    check(c.attend({&it, 1}, l, {q.data(), dtype::f32, q_len, hq, d}, {o.data(), dtype::f32, q_len, hq, d}));
    out.insert(out.end(), o.begin(), o.end());
  }
  return out;
}

// Sequence `s` fed alone to a fresh cache, in the same chunks.
void require_as_alone(KVCache& c, seq_id s, const std::vector<chunk>& chunks) {
  KVCache one = make();
  check(one.create_sequence(s));
  int64_t n = 0;
  for (const chunk& ch : chunks) feed(one, s, n, ch.m, ch.src), n += ch.m;
  REQUIRE(c.length(s, 0) == n);
  REQUIRE(read_all(c, s) == read_all(one, s));
  REQUIRE(attend_all(c, s) == attend_all(one, s));
}

}  // namespace

TEST_CASE("short sequences share a ring block, a lane each", "[windows]") {
  KVCache c = make();
  for (seq_id s = 0; s < 4; ++s) {
    check(c.create_sequence(s));
    feed(c, s, 0, 1);
    CHECK(c.stats().window_bytes == block);  // four one-token sequences: one block
  }
  check(c.create_sequence(4));
  CHECK(c.stats().window_bytes == 2 * block);
  feed(c, 4, 0, 1);
  for (seq_id s = 0; s < 5; ++s) require_as_alone(c, s, {{s, 1}});
  // Releasing frees a block only with its last lane.
  for (seq_id s = 0; s < 3; ++s) {
    check(c.release_sequence(s));
    CHECK(c.stats().window_bytes == 2 * block);
  }
  check(c.release_sequence(3));
  CHECK(c.stats().window_bytes == block);
  check(c.release_sequence(4));
  CHECK(c.stats().window_bytes == 0);
  CHECK(c.stats().used_bytes == 0);
}

TEST_CASE("a window grows a lane at a time, in place or moved, and reads as alone", "[windows]") {
  KVCache c = make();
  for (seq_id s = 0; s < 3; ++s) check(c.create_sequence(s)), feed(c, s, 0, 5);  // lanes 0, 1, 2 of block A
  // Sequence 2 grows into lane 3 in place; sequence 0 cannot (lane 1 is taken): it moves to a
  // new block B and its lane 0 frees.
  feed(c, 2, 5, 40);
  CHECK(c.stats().window_bytes == block);
  feed(c, 0, 5, 30);
  CHECK(c.stats().window_bytes == 2 * block);
  // A new sequence takes the freed lane 0 of block A; sequence 1 grows to 4 lanes: a new block.
  check(c.create_sequence(3));
  feed(c, 3, 0, 7);
  CHECK(c.stats().window_bytes == 2 * block);
  feed(c, 1, 5, 200);
  CHECK(c.stats().window_bytes == 3 * block);
  require_as_alone(c, 0, {{0, 5}, {0, 30}});
  require_as_alone(c, 1, {{1, 5}, {1, 200}});
  require_as_alone(c, 2, {{2, 5}, {2, 40}});
  require_as_alone(c, 3, {{3, 7}});
  // Each grows on, in small steps and large ones.
  for (int step = 0; step < 40; ++step) feed(c, 3, 7 + step, 1);
  feed(c, 2, 45, 100);
  require_as_alone(c, 2, {{2, 5}, {2, 40}, {2, 100}});
  std::vector<chunk> ones(40, {3, 1});
  ones.insert(ones.begin(), {3, 7});
  require_as_alone(c, 3, ones);
}

TEST_CASE("interleaved sequences with random appends, releases and forks read as alone", "[windows]") {
  const uint32_t seed = GENERATE(1u, 2u, 3u);
  CAPTURE(seed);
  std::mt19937 rng(seed);
  KVCache c = make(64ull << 20);
  std::map<seq_id, std::vector<chunk>> live;  // each sequence's history
  seq_id next = 0;
  for (int step = 0; step < 150; ++step) {
    const int op = int(rng() % 10);
    auto pick = [&] { return std::next(live.begin(), ptrdiff_t(rng() % live.size())); };
    if (live.empty() || op < 2) {
      check(c.create_sequence(next));
      live[next++] = {};
    } else if (op == 2 && live.size() > 1) {
      const auto it = pick();
      check(c.release_sequence(it->first));
      live.erase(it);
    } else if (op == 3) {  // the fork takes lanes like its source's, and grows on from them
      const auto it = pick();
      check(c.fork(it->first, next));
      live[next++] = it->second;
    } else {
      const auto it = pick();
      const int64_t n = c.length(it->first, 0);
      const int64_t m = 1 + int64_t(rng() % (rng() % 4 == 0 ? 150 : 20));
      if (n + m > 600) continue;
      feed(c, it->first, n, m);
      it->second.push_back({it->first, m});
    }
  }
  uint64_t blocks = 0;
  for (auto& [s, chunks] : live) {
    if (!chunks.empty()) require_as_alone(c, s, chunks);
    const int64_t n = c.length(s, 0);
    blocks += uint64_t(std::clamp<int64_t>((n + page - 1) / page, 1, window / page));
  }
  // The lanes held never take more blocks than one per sequence, nor fewer than they fill.
  const cache_stats st = c.stats();
  CHECK(st.window_bytes <= live.size() * block);
  CHECK(st.window_bytes >= (blocks + window / page - 1) / (window / page) * block);
}

TEST_CASE("bytes_for counts a ring block only when no free lanes serve the window", "[windows][stats]") {
  KVCache c = make();
  CHECK(c.bytes_for(1).value_or_throw() == block);  // no block yet
  check(c.create_sequence(0));
  feed(c, 0, 0, 1);
  CHECK(c.bytes_for(1).value_or_throw() == 0);  // lane 1 of the block is free
  CHECK(c.bytes_for(60).value_or_throw() > 0);  // (pages of the 60 tokens)
  const uint64_t used = c.stats().used_bytes;
  const uint64_t need = c.bytes_for(40, seq_id(0)).value_or_throw();  // grows into lane 1 in place
  feed(c, 0, 1, 40);
  CHECK(c.stats().used_bytes == used + need);
  CHECK(c.stats().window_bytes == block);
  check(c.create_sequence(1));
  check(c.create_sequence(2));  // lanes 2 and 3
  const uint64_t before = c.stats().used_bytes;
  const uint64_t grow = c.bytes_for(50, seq_id(1)).value_or_throw();  // lane 2 cannot extend: a new block
  feed(c, 1, 0, 50);
  CHECK(c.stats().used_bytes == before + grow);
  CHECK(c.stats().window_bytes == 2 * block);
}

TEST_CASE("a window that cannot grow is out_of_budget and changes nothing", "[windows][errors]") {
  KVCache c = make(block + 16 * 1024);  // one ring block and a few pages
  for (seq_id s = 0; s < 4; ++s) check(c.create_sequence(s)), feed(c, s, 0, 3);
  const cache_stats before = c.stats();
  const std::vector<float> r0 = read_all(c, 0);
  const std::vector<float> k = rows(0, 0, 0, 3, 40), v = rows(0, 0, 1, 3, 40);
  const status st = c.append(0, 0, {k.data(), dtype::f32, 40, kvh, d}, {v.data(), dtype::f32, 40, kvh, d});
  CAPTURE(st.message());
  CHECK(st.code() == errc::out_of_budget);
  CHECK(st.message().find("ring block") != std::string::npos);
  CHECK(c.stats().used_bytes == before.used_bytes);
  CHECK(c.stats().window_bytes == before.window_bytes);
  CHECK(read_all(c, 0) == r0);
  // A shorter append still fits in the sequence's lane.
  feed(c, 0, 3, 20);
  require_as_alone(c, 0, {{0, 3}, {0, 20}});
}

TEST_CASE("overhead(cfg) states the memory outside the budget before creation", "[windows][stats]") {
  cache_config cfg;
  cfg.shape = {32, 32, 8, 128, 64, 128, 64};  // Llama-3-8B's attention shape
  cfg.budget_bytes = 40ull << 30;
  cfg.max_sequences = 256;
  cfg.max_tokens = 1 << 17;
  CHECK(KVCache::overhead(cfg).value_or_throw().device_bytes() == 0);  // the CPU holds only the budget
  cfg.where = backend::cuda;
  // [256 slots][32 layers][2048 pages]: a 4-byte block offset and 8 x 2 format ids each (320
  // MiB), the codebook level table: [32 layers][8 heads][2] x 12 formats x 16 floats, and the
  // value-check guard: a held byte and [32 layers] x 12 bytes per slot, a 24-byte fault record.
  const cache_overhead o = KVCache::overhead(cfg).value_or_throw();
  CHECK(o.device_tables == 256ull * 32 * 2048 * (4 + 16) + 32ull * 8 * 2 * 12 * 16 * 4 + 256ull * (1 + 32 * 12) + 24);
  CHECK(o.device_tables == (320ull << 20) + (384ull << 10) + 98584);
  cfg.check_values = false;  // no guard
  CHECK(KVCache::overhead(cfg).value_or_throw().device_tables == (320ull << 20) + (384ull << 10));
  cfg.check_values = true;
  CHECK(o.device_workspace == 0);  // workspaces grow with the calls, after creation
  cfg.max_tokens = 0;
  CHECK(KVCache::overhead(cfg).error().code() == errc::invalid_argument);
  cfg.max_tokens = 1 << 17;
  cfg.shape.layers = 0;
  CHECK(KVCache::overhead(cfg).error().code() == errc::invalid_argument);
  // The CPU cache's statistics report nothing outside the budget.
  CHECK(make().stats().overhead.device_bytes() == 0);
}
