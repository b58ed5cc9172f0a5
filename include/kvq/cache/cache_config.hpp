#pragma once
/// \file
/// `kvq::cache_config`: everything fixed at a cache's creation (the shape, the budget, the
/// backend, rotation, sink pages, swap space). Its own header so that the backends and the tools
/// that only describe caches need not include the `KVCache` facade (include/kvq/cache/cache.hpp).

#include <kvq/attention/variant.hpp>
#include <kvq/config.hpp>
#include <kvq/format/format.hpp>
#include <kvq/rotation/rotation.hpp>

#include <cstdint>
#include <vector>

KVQ_NAMESPACE_BEGIN

/// Where the cache's bytes live and where its attention runs.
enum class backend : uint8_t { cpu, cuda };

/// Everything fixed at cache creation.
struct cache_config {
  cache_shape shape;          ///< layers, heads, head_dim, page_tokens, window R, recent r
  uint64_t budget_bytes = 0;  ///< one budget for pages of every format and the windows
  backend where = backend::cpu;
  float softmax_scale = 0.f;     ///< 0: 1/sqrt(head_dim)
  int max_sequences = 256;       ///< live sequences at most (and rows of the CUDA page tables)
  int64_t max_tokens = 1 << 17;  ///< CUDA: tokens per sequence the device page tables can index
  /// CUDA: the stream of calls that name none (`stream_ref`); nullptr = the legacy default stream.
  void* stream = nullptr;
  /// Check appended K/V for NaN, Inf and values beyond the fp16 range. CPU: at the call, which
  /// then fails and stores nothing. CUDA: on the device, without a synchronization: a sequence
  /// with a bad row is *held* (nothing of that append or any later one is written for it) and
  /// `check()` reports it and restores it to its state before its first refused append
  /// (docs/architecture.md, "Value checks on the device"). Off: bad values are stored as they come
  /// (CUDA: one launch less per append).
  bool check_values = true;
  /// CPU: threads of the attention (the calling thread included), split over (sequence, kv head)
  /// in `attend` and over (kv head, tile of 64 queries) in `prefill` and `attend_prefix`, on a
  /// pool the cache keeps for its lifetime. 1 (the default) runs everything on the caller; an
  /// application that runs several caches concurrently (kvq-eval) keeps 1.
  int cpu_threads = 1;
  /// The rotated (layer, kv head)s (docs/architecture.md, "Rotation"): their pages of every
  /// format and their FP16 window hold K and V rotated by a randomized Hadamard transform, q is
  /// rotated at attend and the output rotated back, so attention and `read` see the same values
  /// as unrotated up to rounding. Empty (the default): nothing rotated. Needs head_dim a power of
  /// two when any head is rotated.
  rotation_config rotation;
  /// Attention sinks: the first `sink_pages` pages of every sequence (its tokens
  /// [0, sink_pages x page_tokens) in every layer, kv head and role) are written FP16 whatever
  /// the policy chooses. The first tokens draw a large share of every query's attention; a KIVI
  /// key group that holds them loses the most (docs/quality.md, "Attention sinks"). 0 (the
  /// default): every page as the policy chooses. At most max_tokens / page_tokens.
  int sink_pages = 0;
  /// Host memory for sequences swapped out of the budget (`KVCache::swap_out`), allocated at
  /// creation: pinned on CUDA, so swaps run asynchronously on the caller's stream. 0 (the default):
  /// no swap space, and `swap_out` is refused.
  uint64_t swap_bytes = 0;
  /// Each layer's attention rule (include/kvq/attention/variant.hpp): a sliding window, logit
  /// soft-capping, learned sink logits. Empty (the default): every layer global with a plain
  /// softmax; else one entry per layer. The pages of a sliding layer that no later query can see
  /// return to the budget as the sequence grows (docs/architecture.md, "Attention variants").
  std::vector<attention_variant> attention;
  /// Layer `l`'s rule (the plain one when `attention` is empty).
  const attention_variant& layer_attention(int l) const {
    static const attention_variant plain;
    return attention.empty() ? plain : attention[size_t(l)];
  }
};

KVQ_NAMESPACE_END
