#pragma once
/// \file
/// Merging two partial attentions of the same queries over disjoint sets of keys.
///
/// A partial attention of one query row over a key set S is its output o = sum_j p_j v_j / sum_j
/// p_j and its log-sum-exp lse = ln(sum_{j in S} exp(s_j)), where s_j = scale * (q . k_j) are the
/// scaled scores (natural log, the scale already applied). An empty key set has o = 0 and
/// lse = -inf. Two partials over disjoint sets merge exactly into the attention over their union:
/// weights exp(lse_a - lse) and exp(lse_b - lse) with lse = ln(exp(lse_a) + exp(lse_b)).
/// `KVCache::prefill` is `KVCache::attend_prefix` (the stored prefix) merged with the chunk's
/// causal attention over its own fp16 K/V (docs/architecture.md, "Prefill of any length").

#include <kvq/config.hpp>

#include <cmath>
#include <cstdint>

KVQ_NAMESPACE_BEGIN

/// Merges partial b into partial a for one query row: afterwards (o_a, lse_a) is the attention
/// over both key sets. Either side may be empty (lse = -inf); both empty leaves o_a = 0.
/// \param o_a [d] output of part a, overwritten with the merged output
/// \param lse_a log-sum-exp of part a, overwritten with the merged one
/// \param o_b [d] output of part b
/// \param lse_b log-sum-exp of part b
KVQ_HOST_DEVICE void merge_attention_row(float* o_a, float& lse_a, const float* o_b, float lse_b, int d) {
  const float m = lse_a > lse_b ? lse_a : lse_b;
  if (m == -INFINITY) return;  // both empty
  const float wa = std::exp(lse_a - m), wb = std::exp(lse_b - m), sum = wa + wb;
  const float fa = wa / sum, fb = wb / sum;
  for (int c = 0; c < d; ++c) o_a[c] = fa * o_a[c] + fb * o_b[c];
  lse_a = m + std::log(sum);
}

/// Adds a learned sink logit to one row's softmax (`attention_variant::sink_logits`): a part with
/// no value and log-sum-exp `sink`, merged as `merge_attention_row` merges (-inf: nothing).
KVQ_HOST_DEVICE void merge_sink_row(float* o, float& lse, float sink, int d) {
  const float m = lse > sink ? lse : sink;
  if (m == -INFINITY) return;
  const float wa = std::exp(lse - m), sum = wa + std::exp(sink - m), f = wa / sum;
  for (int c = 0; c < d; ++c) o[c] *= f;
  lse = m + std::log(sum);
}

/// `merge_attention_row` for `rows` query rows (e.g. tokens x q_heads) of `d` channels.
/// \param o_a [rows][d] outputs of part a, overwritten with the merged outputs
/// \param lse_a [rows] log-sum-exps of part a, overwritten with the merged ones
/// \param o_b [rows][d] outputs of part b
/// \param lse_b [rows] log-sum-exps of part b
inline void merge_attention(float* o_a, float* lse_a, const float* o_b, const float* lse_b, int64_t rows, int d) {
  for (int64_t r = 0; r < rows; ++r) merge_attention_row(o_a + r * d, lse_a[r], o_b + r * d, lse_b[r], d);
}

KVQ_NAMESPACE_END
