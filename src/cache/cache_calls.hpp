#pragma once
// The request checks and the bookkeeping steps of KVCache's calls (src/cache/cache.cpp), shared with
// the replayable decode step (src/cache/decode_step.cpp).
#include <kvq/detail/backend.hpp>

#include <optional>
#include <string>

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
/// Records a planned append of m tokens to (s, layer) (`page_store::commit_append`); in a sliding
/// layer, then returns the pages no later query can see: the layer held n tokens before the append,
/// so every query still to come stands at n or later and reads from `first_key(n)` on.
void commit_append(cache_state& st, sequence_state& s, int layer, int64_t m, append_plan&& plan);
/// The first token a query at position `pos` of (s, layer) reads (`attention_variant::first_key`)
/// where a sliding layer has released it already; nothing where every token it reads is held.
std::optional<int64_t> released_read(const cache_state& st, const sequence_state& s, int layer, int64_t pos);
/// A call whose queries start at position `pos` of (s, layer) reads from the layer's window there:
/// refused when a sliding layer released some of those tokens (`released_read`).
status check_window_reach(const cache_state& st, const sequence_state& s, int layer, int64_t pos, const char* call);

/// The error of a call on a moved-from cache (its state went with the move).
inline status moved_from(const char* call) {
  return {errc::invalid_argument, std::string(call) + ": this KVCache was moved from (it holds no cache any more)"};
}

/// The error of a call naming sequence `id` that is not resident: swapped out (`swap_in` first)
/// or unknown.
status missing_sequence(const cache_state& st, const char* call, seq_id id);

// A call's device work runs on its stream (`stream_ref`); the stream before it is current again
// after it (a call inside a call keeps the outer one's).
class call_stream {
 public:
  call_stream(const cache_backend& b, stream_ref s) : b_(b), prev_(b.current_stream()), error_(b.use_stream(s)) {}
  call_stream(const call_stream&) = delete;
  call_stream& operator=(const call_stream&) = delete;
  ~call_stream() { (void)b_.use_stream(stream_ref(prev_)); }
  const status& error() const { return error_; }

 private:
  const cache_backend& b_;
  void* prev_;
  status error_;
};
}  // namespace detail
KVQ_NAMESPACE_END

// The first statement of every call with device work: the call's stream, or the reason it is refused.
#define KVQ_CALL_STREAM(s)                              \
  if (!impl_) return detail::moved_from(__func__);      \
  const detail::call_stream call_stream_(*impl_, (s)); \
  KVQ_TRY(call_stream_.error())
// The first statement of every other call that returns a status: refused on a moved-from cache.
#define KVQ_LIVE() \
  if (!state_) return detail::moved_from(__func__)

