#pragma once
// A small engine that owns its KV pool (`page_tables::shared`), for the tests of the low-level
// calls on the CPU (tests/test_pool.cpp) and on CUDA (tests/cuda/test_cuda_pool.cpp): one pool of
// [layers][pool_blocks] blocks of one size, an int32 block table per sequence shared by every
// layer, windows in a buffer of their own, and per sequence its slot, window and lengths. It cuts
// pages by KVCache's rule and lists a new block the first time a page index is reached. Its
// memory is host memory; the CUDA test mirrors it on the device.
#include <kvq/attention/cpu_pool.hpp>
#include <kvq/cache/cache.hpp>
#include <kvq/policy/static_policy.hpp>

#include <algorithm>
#include <memory>
#include <random>
#include <span>
#include <vector>

namespace kvq::pool_test {

constexpr int layers = 2, hq = 8, kvh = 2, d = 64, P = 64, R = 128, recent = 64;
constexpr int slots = 3, max_blocks = 12, table_stride = 16, pool_blocks = 40;
// The policy both sides run: layer 0 kivi4/g32, layer 1 sym8 keys and kivi2 values.
inline const char* const policy_spec = "kivi4/g32;1=k=sym8,v=kivi2/g32";

inline format_pair layer_pair(int layer) {
  return parse_format_pair(layer == 0 ? "kivi4/g32" : "k=sym8,v=kivi2/g32").value_or_throw();
}

inline cache_config cache_cfg() {
  cache_config cfg;
  cfg.shape = {layers, hq, kvh, d, P, R, recent};
  cfg.budget_bytes = 16ull << 20;
  cfg.max_sequences = slots;
  return cfg;
}
inline std::shared_ptr<static_policy> cache_policy() {
  return std::make_shared<static_policy>(static_policy::parse(policy_spec).value_or_throw());
}

inline std::vector<float> randn(std::mt19937& rng, size_t count) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(count);
  for (auto& v : x) v = nd(rng);
  return x;
}

inline tensor_view rows(const std::vector<float>& x, int64_t tokens, int heads) {
  return {x.data(), dtype::f32, tokens, heads, d};
}

struct engine {
  uint32_t block_bytes = 0;
  std::vector<uint8_t> pool, windows;
  std::vector<int32_t> table = std::vector<int32_t>(size_t(slots) * table_stride, -1);
  int32_t next_block = 0;
  struct sequence {
    int slot;
    uint32_t window_unit;
    int32_t n = 0, e = 0;
  };
  std::vector<sequence> seqs;
  cpu::worker_pool workers{2};

  engine() {
    const format_pair cands[] = {layer_pair(0), layer_pair(1)};
    block_bytes = cuda::pool_block_bytes(kvh, d, P, cands).value_or_throw();
    pool.assign(size_t(layers) * pool_blocks * block_bytes, 0);
    const uint64_t wb = cuda::window_block_bytes(layers, kvh, d, R);
    windows.assign(size_t(slots) * wb, 0);
    for (int s = 0; s < slots; ++s) seqs.push_back({s, uint32_t(s * wb / 256)});
  }

  // The pool as the calls read it (host memory).
  cuda::paged_view view() const {
    cuda::paged_view kv;
    kv.arena = pool.data();
    kv.blocks = reinterpret_cast<const uint32_t*>(table.data());
    kv.layers = layers, kv.kv_heads = kvh, kv.head_dim = d, kv.page_tokens = P, kv.window = R;
    kv.max_pages = max_blocks, kv.slots = slots, kv.arena_bytes = pool.size();
    kv.k_page_bytes = cuda::page_bytes(role::k, P, d), kv.v_page_bytes = cuda::page_bytes(role::v, P, d);
    kv.tables = cuda::page_tables::shared;
    kv.windows = windows.data(), kv.windows_bytes = windows.size();
    kv.table_stride = table_stride, kv.block_bytes = block_bytes, kv.layer_blocks = pool_blocks;
    kv.layer_bytes = uint64_t(pool_blocks) * block_bytes;
    return kv;
  }

  // One layer's append of m[i] tokens to sequences `ids` (rows of k, v in order): its items, new
  // blocks and formats, and the arguments over the host pool. Lists the new blocks (layer 0).
  struct append_call {
    std::vector<cuda::append_seq> items;
    std::vector<uint32_t> blocks;
    std::vector<uint8_t> fmts;
    cuda::append_args args;
  };
  std::unique_ptr<append_call> plan_append(std::span<const int> ids, std::span<const int32_t> m, int layer,
                                           const tensor_view& k, const tensor_view& v, int32_t bad_block = -1) {
    auto c = std::make_unique<append_call>();
    for (size_t i = 0; i < ids.size(); ++i) {
      const sequence& s = seqs[size_t(ids[i])];
      const int pages = int(pages_to_encode(s.n, s.e, m[i], P, recent));
      for (int p = 0; p < pages; ++p) {
        int32_t& entry = table[size_t(s.slot) * table_stride + size_t(s.e / P + p)];
        if (layer == 0) entry = next_block++;
        c->blocks.push_back(bad_block >= 0 ? uint32_t(bad_block) : uint32_t(entry));
        for (int h = 0; h < kvh; ++h) c->fmts.push_back(layer_pair(layer).k), c->fmts.push_back(layer_pair(layer).v);
      }
      c->items.push_back({s.slot, s.n, s.e, m[i], s.window_unit, s.e / P, pages});
    }
    cuda::append_args& a = c->args;
    a.kv = view();
    a.arena = pool.data(), a.windows = windows.data();
    a.layer = layer;
    a.items = c->items;
    a.k = k, a.v = v;
    a.page_blocks = c->blocks.data(), a.page_fmts = c->fmts.data();
    return c;
  }
  // The lengths move once the last layer appended.
  void commit(std::span<const int> ids, std::span<const int32_t> m, int layer) {
    if (layer != layers - 1) return;
    for (size_t i = 0; i < ids.size(); ++i) {
      sequence& s = seqs[size_t(ids[i])];
      s.e += int32_t(pages_to_encode(s.n, s.e, m[i], P, recent)) * P;
      s.n += m[i];
    }
  }
  status append(std::span<const int> ids, std::span<const int32_t> m, int layer, const tensor_view& k,
                const tensor_view& v, int32_t bad_block = -1) {
    const auto c = plan_append(ids, m, layer, k, v, bad_block);
    KVQ_TRY(cpu::pool_append(c->args));
    commit(ids, m, layer);
    return {};
  }

  // A decode step's items: one query per sequence, after its token was appended to every layer.
  std::vector<cuda::decode_item> decode_items(std::span<const int> ids) const {
    std::vector<cuda::decode_item> items;
    for (size_t i = 0; i < ids.size(); ++i) {
      const sequence& s = seqs[size_t(ids[i])];
      items.push_back({s.slot, 1, s.n, std::min(s.e, s.n - 1), s.window_unit, int32_t(i)});
    }
    return items;
  }
  status attend(std::span<const int> ids, int layer, const std::vector<float>& q, std::vector<float>& o) {
    const auto items = decode_items(ids);
    cuda::attend_args a;
    a.kv = view();
    a.layer = layer, a.q_heads = hq;
    a.items = items;
    a.q = q.data(), a.q_type = dtype::f32, a.o = o.data(), a.o_type = dtype::f32;
    return cpu::pool_attend(workers, a);
  }

  // A chunk's prefill arguments for layer `layer` after its append: `before` is the sequence's
  // state before the chunk (its lengths move after the last layer).
  cuda::prefill_args prefill_args(const sequence& before, int layer, int32_t T) const {
    const int32_t e_after = before.e + int32_t(pages_to_encode(before.n, before.e, T, P, recent)) * P;
    cuda::prefill_args a;
    a.kv = view();
    a.layer = layer, a.q_heads = hq, a.slot = before.slot, a.window_unit = before.window_unit;
    a.prefix = before.n, a.from_pages = std::min(e_after, before.n), a.queries = T;
    return a;
  }
};

}  // namespace kvq::pool_test
