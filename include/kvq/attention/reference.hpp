#pragma once
/// \file
/// The CPU reference attention: plain, readable, obviously right. Every other backend is tested
/// against it. Library code, not test-only: the CPU backend runs it.

#include <kvq/attention/variant.hpp>
#include <kvq/config.hpp>

#include <cstdint>

KVQ_NAMESPACE_BEGIN
namespace ref {

/// Causal grouped-query attention of `q_len` new queries over `n` tokens, the last `q_len` of
/// which are the queries' own tokens. Query i (position n - q_len + i) sees tokens 0..n-q_len+i.
/// Query head h reads kv head h / (q_heads / kv_heads). Scores, softmax and the output sum in
/// fp32. `var` (default: plain) restricts each query to its window, soft-caps the scaled scores
/// and adds its head's sink logit to the softmax.
/// \param k [n][kv_heads][d] keys as the step reads them
/// \param v [n][kv_heads][d] values
/// \param q [q_len][q_heads][d]
/// \param o [q_len][q_heads][d] output
KVQ_EXPORT void attend(const float* k, const float* v, int64_t n, const float* q, int q_len, int q_heads, int kv_heads,
                       int d, float scale, float* o, const attention_variant& var = {});

}  // namespace ref
KVQ_NAMESPACE_END
