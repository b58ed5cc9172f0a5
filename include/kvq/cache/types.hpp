#pragma once
/// \file
/// The value types of the `KVCache` calls (include/kvq/cache/cache.hpp): the stream a call runs
/// on, the items of a batch, and the statistics. Their own header so that the backends
/// (include/kvq/detail/backend.hpp) need not include the facade.

#include <kvq/config.hpp>
#include <kvq/core.hpp>
#include <kvq/format/format.hpp>

#include <array>
#include <cstdint>
#include <vector>

KVQ_NAMESPACE_BEGIN

/// The CUDA stream one call runs on: a `cudaStream_t` (converts implicitly; `nullptr` is the
/// legacy default stream), or, when not given, the cache's own (`cache_config::stream`). The CPU
/// backend ignores it. Ordering across streams: docs/architecture.md, "Streams".
struct stream_ref {
  stream_ref() = default;
  stream_ref(void* s) : stream(s), given(true) {}  // NOLINT: implicit, from cudaStream_t
  void* stream = nullptr;
  bool given = false;
};

/// Memory a cache holds outside `budget_bytes`: the CUDA backend's page tables, workspaces and
/// canary buffers (all zero on the CPU, whose only memory is the budget's arena). `budget_bytes`
/// is what the KV data may take; a cache takes `budget_bytes` plus these in all.
struct cache_overhead {
  /// Device page tables, fixed at creation: a block offset per (slot, layer, page) and a format id
  /// per (slot, layer, page, kv head, role), for `max_sequences` slots of `max_tokens` tokens.
  uint64_t device_tables = 0;
  /// Device workspaces: the attention's split partials, the undo record of multi-launch appends,
  /// the canary's query staging and the value-check flag. They grow to the largest call shape
  /// seen (a batch's size and lengths, not the tokens stored), then never again.
  uint64_t device_workspace = 0;
  /// Pinned host memory: the device canary's mapped results (EchoKV on CUDA) and the swap space
  /// (`cache_config::swap_bytes`, CUDA).
  uint64_t pinned_host = 0;
  uint64_t device_bytes() const { return device_tables + device_workspace; }
};

/// Statistics at any moment.
struct cache_stats {
  uint64_t budget_bytes = 0;
  uint64_t used_bytes = 0;          ///< pages + windows, as allocated (256-byte aligned blocks)
  uint64_t free_bytes = 0;          ///< budget bytes not allocated (budget_bytes - used_bytes)
  uint64_t largest_free_block = 0;  ///< the largest block one allocation can take now (a window needs one)
  uint64_t page_bytes = 0;          ///< bytes of live pages (their layout sizes), a shared page once
  uint64_t window_bytes = 0;        ///< bytes of the FP16 recent windows
  uint64_t pages = 0;               ///< live pages (per kv head and role), a shared page once
  uint64_t shared_pages = 0;        ///< pages listed by more than one sequence (`fork`)
  uint64_t shared_saved_bytes = 0;  ///< page bytes the extra listings of shared pages would take unshared
  int64_t sequences = 0;
  /// Tokens held, summed over sequences and layers; a sliding layer holds its tokens from its
  /// first live page on (those before it were released, `attention_variant::window`).
  int64_t tokens = 0;
  uint64_t encoded_elements = 0;  ///< K and V elements held in pages
  std::array<uint64_t, format_count> bytes_by_format{};
  std::array<uint64_t, format_count> pages_by_format{};
  std::vector<format_pair> format_map;  ///< [layers][kv_heads] current policy decision
  cache_overhead overhead;              ///< memory held outside the budget now
  /// Swapped-out sequences (`KVCache::swap_out`: not counted in `sequences`, `tokens` or the page
  /// counters) and the swap space they use of `cache_config::swap_bytes`.
  int64_t swapped_sequences = 0;
  uint64_t swap_used_bytes = 0;
  uint64_t swap_capacity_bytes = 0;
  /// Bytes copied by every `swap_out` and `swap_in` since creation (the swap traffic).
  uint64_t swapped_out_bytes = 0;
  uint64_t swapped_in_bytes = 0;

  /// Average bits per element of the pages, scales and zeros included.
  double page_bits() const { return encoded_elements ? 8.0 * page_bytes / double(encoded_elements) : 0.0; }
  /// Bits per element of everything held (pages + windows) over the K and V elements of the
  /// tokens held: what the cache really costs per stored value (a sliding layer's released
  /// tokens are in neither sum).
  double total_bits(int kv_heads, int head_dim) const {
    const double elems = double(tokens) * kv_heads * head_dim * 2;
    return elems > 0 ? 8.0 * double(page_bytes + window_bytes) / elems : 0.0;
  }
};

/// One sequence's part of an attention batch.
struct attend_item {
  seq_id seq;
  int q_len = 1;
};

/// One sequence's part of a batched append.
struct append_item {
  seq_id seq;
  int64_t tokens = 1;
};

KVQ_NAMESPACE_END
