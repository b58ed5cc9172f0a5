// CPU reference attention (see reference.hpp) and the attention variants' checks (variant.hpp).
#include <kvq/attention/reference.hpp>
#include <kvq/attention/variant.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

KVQ_NAMESPACE_BEGIN

status check_variant(const attention_variant& v, int q_heads, const char* what) {
  if (v.window < 0) return {errc::invalid_argument, fmt::format("{}: sliding window {} is negative", what, v.window)};
  if (!(v.softcap >= 0.f) || !std::isfinite(v.softcap))
    return {errc::invalid_argument, fmt::format("{}: softcap {} must be finite and >= 0", what, v.softcap)};
  if (!v.sink_logits.empty() && v.sink_logits.size() != size_t(q_heads))
    return {errc::invalid_argument, fmt::format("{}: {} sink logits for {} query heads (one per query head, or none)",
                                                what, v.sink_logits.size(), q_heads)};
  for (size_t h = 0; h < v.sink_logits.size(); ++h)
    if (!std::isfinite(v.sink_logits[h]))
      return {errc::non_finite, fmt::format("{}: sink logit of query head {} is {}", what, h, v.sink_logits[h])};
  return {};
}

namespace ref {

void attend(const float* k, const float* v, int64_t n, const float* q, int q_len, int q_heads, int kv_heads, int d,
            float scale, float* o, const attention_variant& var) {
  const int group = q_heads / kv_heads;
  std::vector<float> p(size_t(n > 0 ? n : 1));
  for (int i = 0; i < q_len; ++i) {
    const int64_t last = n - q_len + i;  // inclusive
    const int64_t first = var.first_key(last);
    for (int h = 0; h < q_heads; ++h) {
      const int kh = h / group;
      const float* qi = q + (int64_t(i) * q_heads + h) * d;
      const float sink = var.sink(h);
      float mx = sink;
      for (int64_t j = first; j <= last; ++j) {
        const float* kj = k + (j * kv_heads + kh) * d;
        float s = 0.f;
        for (int c = 0; c < d; ++c) s += qi[c] * kj[c];
        p[size_t(j)] = var.cap(s * scale);
        mx = std::max(mx, p[size_t(j)]);
      }
      float sum = std::exp(sink - mx);  // 0 without a sink logit
      for (int64_t j = first; j <= last; ++j) {
        p[size_t(j)] = std::exp(p[size_t(j)] - mx);
        sum += p[size_t(j)];
      }
      float* oi = o + (int64_t(i) * q_heads + h) * d;
      std::fill(oi, oi + d, 0.f);
      for (int64_t j = first; j <= last; ++j) {
        const float w = p[size_t(j)] / sum;
        const float* vj = v + (j * kv_heads + kh) * d;
        for (int c = 0; c < d; ++c) oi[c] += w * vj[c];
      }
    }
  }
}

}  // namespace ref
KVQ_NAMESPACE_END
