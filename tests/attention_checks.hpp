#pragma once
// Test helpers shared by the CPU attention tests (test_cpu_attention.cpp,
// test_attention_variants.cpp): random rows, what a cache stores, and the closeness check of an
// attention output against the reference.
#include <kvq/cache/cache.hpp>
#include <kvq/format/numeric.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace kvq::test {

/// n normal values of standard deviation `sd`.
inline std::vector<float> randn(std::mt19937& rng, size_t n, float sd = 1.f) {
  std::normal_distribution<float> nd(0.f, sd);
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng);
  return x;
}
inline float round16(float x) { return half_to_float(float_to_half(x)); }
inline tensor_view view(const float* x, int64_t tokens, int heads, int d) { return {x, dtype::f32, tokens, heads, d}; }

/// What (seq, layer, r) reads, rows [from, n) replaced by the fp16 rounding of `tail`.
inline std::vector<float> stored(const KVCache& c, seq_id s, int layer, role r, int64_t from,
                                 const std::vector<float>& tail) {
  const auto& sh = c.config().shape;
  std::vector<float> out(size_t(c.length(s, layer)) * sh.kv_heads * sh.head_dim);
  check(c.read(s, layer, r, out));
  for (size_t i = 0; i < tail.size(); ++i) out[size_t(from) * sh.kv_heads * sh.head_dim + i] = round16(tail[i]);
  return out;
}

/// |a - b| <= tol (1 + |b|) everywhere (1e-5: the same decoded values, summation order aside).
inline void require_close(const std::vector<float>& a, const std::vector<float>& b, double tol = 1e-5) {
  REQUIRE(a.size() == b.size());
  size_t bad = 0;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double e = std::fabs(double(a[i]) - b[i]) / (1.0 + std::fabs(b[i]));
    worst = std::max(worst, e);
    bad += !(e <= tol);
  }
  CAPTURE(worst);
  REQUIRE(bad == 0);
}

}  // namespace kvq::test
