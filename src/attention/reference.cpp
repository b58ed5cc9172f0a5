// CPU reference attention (see reference.hpp).
#include <kvq/attention/reference.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

KVQ_NAMESPACE_BEGIN
namespace ref {

void attend(const float* k, const float* v, int64_t n, const float* q, int q_len, int q_heads, int kv_heads, int d,
            float scale, float* o) {
  const int group = q_heads / kv_heads;
  std::vector<float> p(size_t(n > 0 ? n : 1));
  for (int i = 0; i < q_len; ++i) {
    const int64_t last = n - q_len + i;  // inclusive
    for (int h = 0; h < q_heads; ++h) {
      const int kh = h / group;
      const float* qi = q + (int64_t(i) * q_heads + h) * d;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j <= last; ++j) {
        const float* kj = k + (j * kv_heads + kh) * d;
        float s = 0.f;
        for (int c = 0; c < d; ++c) s += qi[c] * kj[c];
        p[size_t(j)] = s * scale;
        mx = std::max(mx, p[size_t(j)]);
      }
      float sum = 0.f;
      for (int64_t j = 0; j <= last; ++j) {
        p[size_t(j)] = std::exp(p[size_t(j)] - mx);
        sum += p[size_t(j)];
      }
      float* oi = o + (int64_t(i) * q_heads + h) * d;
      std::fill(oi, oi + d, 0.f);
      for (int64_t j = 0; j <= last; ++j) {
        const float w = p[size_t(j)] / sum;
        const float* vj = v + (j * kv_heads + kh) * d;
        for (int c = 0; c < d; ++c) oi[c] += w * vj[c];
      }
    }
  }
}

}  // namespace ref
KVQ_NAMESPACE_END
