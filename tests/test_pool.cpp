// An engine-owned pool on the CPU (kvq/attention/cpu_pool.hpp over `page_tables::shared`): one
// int32 block table per sequence shared by every layer, blocks of one size per layer that name
// their formats in a header, windows in a buffer of their own. Driven like an engine (it decides
// when a page is cut, allocates its blocks, passes lengths), it must store the bytes and compute
// the attention of `KVCache` on the CPU bit for bit, and refuse bad calls without changing a byte.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "pool_engine.hpp"

using namespace kvq;
using namespace kvq::pool_test;

TEST_CASE("engine pool on the CPU: prefill and batched decode equal KVCache bit for bit", "[pool]") {
  std::mt19937 rng(11);
  KVCache cache = KVCache::create(cache_cfg(), cache_policy()).value_or_throw();
  engine eng;
  const int ids[] = {0, 1};
  for (int id : ids) REQUIRE(cache.create_sequence(id).ok());

  // Prefill: sequence 0 in one chunk of 300 tokens (longer than the window), sequence 1 in two
  // chunks (130, then 90 over a stored prefix); each layer appends, then attends its chunk.
  const std::vector<std::vector<int32_t>> chunks = {{300}, {130, 90}};
  for (int id : ids)
    for (int32_t T : chunks[size_t(id)]) {
      for (int l = 0; l < layers; ++l) {
        const auto k = randn(rng, size_t(T) * kvh * d), v = randn(rng, size_t(T) * kvh * d), q = randn(rng, size_t(T) * hq * d);
        std::vector<float> o_cache(q.size()), o_pool(q.size());
        REQUIRE(cache.prefill(id, l, rows(k, T, kvh), rows(v, T, kvh), rows(q, T, hq),
                              {o_cache.data(), dtype::f32, T, hq, d})
                    .ok());
        const engine::sequence before = eng.seqs[size_t(id)];
        const int one[] = {id};
        const int32_t m[] = {T};
        REQUIRE(eng.append(one, m, l, rows(k, T, kvh), rows(v, T, kvh)).ok());
        cuda::prefill_args a = eng.prefill_args(before, l, T);
        a.q = q.data(), a.q_type = dtype::f32, a.o = o_pool.data(), a.o_type = dtype::f32;
        a.k = rows(k, T, kvh), a.v = rows(v, T, kvh);
        REQUIRE(cpu::pool_prefill(eng.workers, a).ok());
        CHECK(std::memcmp(o_cache.data(), o_pool.data(), o_pool.size() * sizeof(float)) == 0);
      }
    }
  // Batched decode: 150 steps of one token for both sequences (pages are cut along the way).
  for (int step = 0; step < 150; ++step) {
    for (int l = 0; l < layers; ++l) {
      const auto k = randn(rng, 2 * kvh * d), v = randn(rng, 2 * kvh * d);
      const append_item items[] = {{0, 1}, {1, 1}};
      REQUIRE(cache.append_batch(items, l, rows(k, 2, kvh), rows(v, 2, kvh)).ok());
      const int32_t m[] = {1, 1};
      REQUIRE(eng.append(ids, m, l, rows(k, 2, kvh), rows(v, 2, kvh)).ok());
    }
    for (int l = 0; l < layers; ++l) {
      const auto q = randn(rng, 2 * hq * d);
      std::vector<float> o_cache(q.size()), o_pool(q.size());
      const attend_item items[] = {{0, 1}, {1, 1}};
      REQUIRE(cache.attend(items, l, rows(q, 2, hq), {o_cache.data(), dtype::f32, 2, hq, d}).ok());
      REQUIRE(eng.attend(ids, l, q, o_pool).ok());
      CHECK(std::memcmp(o_cache.data(), o_pool.data(), o_pool.size() * sizeof(float)) == 0);
    }
  }
  CHECK(eng.seqs[0].n == 450);
  CHECK(eng.seqs[0].e == 384);  // fewer than page_tokens + recent unencoded
  // Each block names its formats: block 0 (sequence 0's first page) in layer 1's pool is sym8 / kivi2.
  const uint8_t* header = eng.pool.data() + uint64_t(pool_blocks) * eng.block_bytes;
  CHECK(header[0] == layer_pair(1).k);
  CHECK(header[1] == layer_pair(1).v);
}

TEST_CASE("engine pool on the CPU: bad calls are refused by name and change nothing", "[pool]") {
  std::mt19937 rng(5);
  engine eng;
  const int one[] = {0};
  const int32_t m[] = {200};
  auto k = randn(rng, 200 * kvh * d), v = randn(rng, 200 * kvh * d);
  for (int l = 0; l < layers; ++l) REQUIRE(eng.append(one, m, l, rows(k, 200, kvh), rows(v, 200, kvh)).ok());
  const std::vector<uint8_t> pool = eng.pool, windows = eng.windows;
  auto unchanged = [&] { return eng.pool == pool && eng.windows == windows; };
  auto names = [](const status& s, const std::string& what) { return s.message().find(what) != std::string::npos; };
  const int32_t m2[] = {64};
  k.resize(64 * kvh * d), v.resize(64 * kvh * d);

  // A block id outside the pool.
  status s = eng.append(one, m2, 0, rows(k, 64, kvh), rows(v, 64, kvh), pool_blocks);
  CHECK(s.code() == errc::invalid_argument);
  CHECK(names(s, "block id 40, outside the pool's [0, 40)"));
  CHECK(unchanged());
  // A NaN in V: nothing is written, the message names the token.
  v[5 * kvh * d + 3] = std::nanf("");
  s = eng.append(one, m2, 0, rows(k, 64, kvh), rows(v, 64, kvh));
  CHECK(s.code() == errc::non_finite);
  CHECK(names(s, "V of item 0 (slot 0) token 205"));
  CHECK(unchanged());
  v[5 * kvh * d + 3] = 0.f;
  // Blocks too small for the pages' formats (an engine sized its blocks for narrower formats).
  cuda::append_args a;
  a.kv = eng.view();
  a.kv.block_bytes = 4096;
  const cuda::append_seq item{0, 200, 0, 64, 0, 0, 1};
  a.items = {&item, 1};
  a.arena = eng.pool.data(), a.windows = eng.windows.data();
  a.k = rows(k, 64, kvh), a.v = rows(v, 64, kvh);
  const uint32_t block = 3;
  const std::vector<uint8_t> fmts(kvh * 2, fp16_format);
  a.page_blocks = &block, a.page_fmts = fmts.data();
  s = cpu::pool_append(a);
  CHECK(s.code() == errc::invalid_argument);
  CHECK(names(s, "more than the pool's blocks of 4096"));
  // A table narrower than the pages a sequence may hold; a pool larger than its arena.
  a.kv = eng.view();
  a.kv.table_stride = max_blocks - 1;
  CHECK(names(cpu::pool_append(a), "table_stride >= max_pages"));
  a.kv = eng.view();
  a.kv.layer_blocks = pool_blocks + 1;
  a.kv.layer_bytes = uint64_t(pool_blocks + 1) * eng.block_bytes;
  CHECK(names(cpu::pool_append(a), "end past the arena's"));
  // A window past the windows buffer.
  a.kv = eng.view();
  const cuda::append_seq far{0, 200, 0, 64, uint32_t(eng.windows.size() / 256), 0, 1};
  a.items = {&far, 1};
  CHECK(names(cpu::pool_append(a), "past the windows'"));
  CHECK(unchanged());
  // Attention and prefill run the same checks.
  const std::vector<float> q(hq * d);
  std::vector<float> o(q.size());
  cuda::attend_args at;
  at.kv = eng.view();
  at.kv.block_bytes = 100;
  at.layer = 0, at.q_heads = hq;
  const cuda::decode_item di{0, 1, 200, 128, 0, 0};
  at.items = {&di, 1};
  at.q = q.data(), at.q_type = dtype::f32, at.o = o.data(), at.o_type = dtype::f32;
  CHECK(names(cpu::pool_attend(eng.workers, at), "block_bytes a nonzero multiple of 256 (100)"));
  at.kv = eng.view();
  const cuda::decode_item far_item{0, 1, 200, 128, uint32_t(eng.windows.size() / 256), 0};
  at.items = {&far_item, 1};
  CHECK(names(cpu::pool_attend(eng.workers, at), "item 0 (slot 0) has its window"));
  at.items = {&di, 1};
  CHECK(cpu::pool_attend(eng.workers, at).ok());
  cuda::prefill_args pa = eng.prefill_args(eng.seqs[0], 0, 1);
  pa.from_pages = 300;
  pa.q = q.data(), pa.o = o.data(), pa.q_type = pa.o_type = dtype::f32;
  CHECK(names(cpu::pool_prefill(eng.workers, pa), "inconsistent prefix"));
  // Rotated heads are KVCache's on the CPU.
  a.items = {&item, 1};
  const std::vector<uint8_t> narrow = {layer_pair(0).k, layer_pair(0).v, layer_pair(0).k, layer_pair(0).v};
  a.page_fmts = narrow.data();
  a.rotation.mask = 1;
  CHECK(cpu::pool_append(a).code() == errc::unsupported);
  CHECK(unchanged());
}

TEST_CASE("pool_block_bytes: the header and the widest page of each role, per kv head", "[pool]") {
  const format_pair pairs[] = {parse_format_pair("kivi2/g32").value_or_throw(), parse_format_pair("fp16").value_or_throw()};
  // fp16 pages are the widest of both roles: 2 kv heads x 2 roles x 64 tokens x 128 channels x 2 bytes + 16
  CHECK(cuda::pool_block_bytes(2, 128, 64, pairs).value_or_throw() == (2 * 2 * 64 * 128 * 2 + 16 + 255) / 256 * 256);
  // kivi2/g32 on head 0 and fp16 on head 1, fixed: each head its own pages (kivi2 pages from the layouts)
  const uint64_t k2 = layout_of(format_table[pairs[0].k], role::k, 64, 128).total(),
                 v2 = layout_of(format_table[pairs[0].v], role::v, 64, 128).total();
  CHECK(cuda::pool_block_bytes_per_head(128, 64, pairs).value_or_throw() == (16 + k2 + v2 + 2 * 64 * 128 * 2 + 255) / 256 * 256);
  CHECK(cuda::block_header_bytes(8) == 16);
  CHECK(cuda::block_header_bytes(9) == 32);
  CHECK(cuda::pool_block_bytes(2, 128, 64, {}).error().code() == errc::invalid_argument);
  const format_pair wide_group[] = {parse_format_pair("kivi4/g128").value_or_throw()};  // groups of 128 channels
  CHECK(cuda::pool_block_bytes(2, 64, 64, wide_group).error().code() == errc::invalid_argument);
  CHECK(cuda::window_block_bytes(2, 2, 64, 128) == (2ull * 2 * 2 * 128 * 64 * 2 + 16 * 64 * 2));
}
