#pragma once
// A test helper shared by CPU and GPU tests: everything a sequence reads, for bit-for-bit
// comparisons of two caches (or of one cache before and after a call).
#include <kvq/cache/cache.hpp>

#include <random>
#include <vector>

namespace kvq::test {

/// What every layer and role of sequence `s` reads (`KVCache::read`), concatenated
/// [layers][K, V][tokens][kv_heads][head_dim].
inline std::vector<float> read_all(const KVCache& c, seq_id s) {
  const cache_shape& sh = c.config().shape;
  std::vector<float> out;
  for (int l = 0; l < sh.layers; ++l)
    for (role r : {role::k, role::v}) {
      std::vector<float> x(size_t(c.length(s, l)) * sh.kv_heads * sh.head_dim);
      check(c.read(s, l, r, x));
      out.insert(out.end(), x.begin(), x.end());
    }
  return out;
}

/// Attention of every layer of `s` (host memory: the CPU backend) with `q_len` queries drawn from
/// a normal distribution seeded with 7, the same for every cache; the outputs concatenated.
inline std::vector<float> attend_all(KVCache& c, seq_id s, int q_len) {
  const cache_shape& sh = c.config().shape;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> q(size_t(q_len) * sh.q_heads * sh.head_dim), o(q.size()), out;
  for (int l = 0; l < sh.layers; ++l) {
    for (auto& x : q) x = nd(rng);
    const attend_item it{s, q_len};
    check(c.attend({&it, 1}, l, {q.data(), dtype::f32, q_len, sh.q_heads, sh.head_dim},
                   {o.data(), dtype::f32, q_len, sh.q_heads, sh.head_dim}));
    out.insert(out.end(), o.begin(), o.end());
  }
  return out;
}

}  // namespace kvq::test
