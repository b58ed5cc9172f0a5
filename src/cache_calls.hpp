#pragma once
// The request checks and the bookkeeping steps of KVCache's calls (src/cache.cpp), shared with
// the replayable decode step (src/decode_step.cpp).
#include <kvq/detail/backend.hpp>

KVQ_NAMESPACE_BEGIN
namespace detail {

/// A K or V view of a call: [tokens >= 1][kv_heads][head_dim], data set.
status check_kv_view(const tensor_view& t, const char* call, const char* which, const cache_shape& s);
/// Q and O views of `expected` rows: [expected][q_heads][head_dim].
status check_q_o(const char* call, const tensor_view& q, const tensor_mut& o, int64_t expected, const cache_shape& sh);
/// The CUDA page tables' limit: (id, layer) holding n + tokens tokens stays within max_tokens.
status check_capacity(const cache_config& cfg, const char* call, seq_id id, int layer, int64_t n, int64_t tokens);
/// The pages of an append of m tokens to (s, layer), in the formats `cache_state::page_format`
/// gives (the policy's, FP16 for sink pages), allocated.
result<append_plan> plan_pages(cache_state& st, sequence_state& s, int layer, int64_t m);
/// A planned append that moves the window: copies its rings to the new run and points s there.
status move_window(const cache_shape& sh, cache_backend& b, sequence_state& s, const append_plan& plan);

}  // namespace detail
KVQ_NAMESPACE_END
