#pragma once
// A test helper shared by CPU and GPU tests: everything a sequence reads, for bit-for-bit
// comparisons of two caches (or of one cache before and after a call).
#include <kvq/cache/cache.hpp>

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

}  // namespace kvq::test
