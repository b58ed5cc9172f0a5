// The random control policy: a portable seeded shuffle of a format map.
#include <kvq/policy/random_policy.hpp>

#include <fmt/format.h>

#include <random>
#include <utility>

KVQ_NAMESPACE_BEGIN

std::vector<size_t> random_policy::permutation(size_t n, uint64_t seed) {
  std::vector<size_t> p(n);
  for (size_t i = 0; i < n; ++i) p[i] = i;
  std::mt19937_64 rng(seed);
  // Fisher-Yates; j uniform in [0, i] by rejection of the biased top of the 64-bit range.
  for (size_t i = n; i-- > 1;) {
    const uint64_t m = uint64_t(i) + 1;
    const uint64_t limit = ~uint64_t(0) - (~uint64_t(0) % m + 1) % m;  // largest multiple of m, minus 1
    uint64_t x;
    do x = rng();
    while (x > limit);
    std::swap(p[i], p[size_t(x % m)]);
  }
  return p;
}

result<random_policy> random_policy::create(const format_map& source, uint64_t seed) {
  if (source.layers <= 0 || source.kv_heads <= 0 ||
      source.pairs.size() != size_t(source.layers) * size_t(source.kv_heads))
    return status{errc::invalid_argument,
                  fmt::format("random policy: format map of {} layers x {} kv heads holds {} entries", source.layers,
                              source.kv_heads, source.pairs.size())};
  for (size_t i = 0; i < source.pairs.size(); ++i)
    if (source.pairs[i].k >= format_count || source.pairs[i].v >= format_count)
      return status{errc::invalid_argument,
                    fmt::format("random policy: entry {} has a format id outside the table", i)};
  random_policy p;
  p.source_ = source;
  p.map_ = source;
  p.seed_ = seed;
  const auto perm = permutation(source.pairs.size(), seed);
  for (size_t i = 0; i < perm.size(); ++i) p.map_.pairs[i] = source.pairs[perm[i]];
  return p;
}

std::string random_policy::name() const { return fmt::format("random(seed={})", seed_); }

status random_policy::bind(const cache_shape& shape) { return map_.check(shape, "random policy"); }

KVQ_NAMESPACE_END
