#pragma once
// Host checks of the indices a low-level call writes or reads through (include/kvq/cuda/
// paged_attention.hpp, `paged_view`): each names the call, the item or page and the bound.
#include <algorithm>
#include <kvq/cuda/paged_attention.hpp>
#include <kvq/store/window_layout.hpp>

#include "status.hpp"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

/// Bytes from the start of a sequence's window to the end of the last slot a sequence of `tokens`
/// tokens uses: [layers][kv_heads][2][window][head_dim] fp16 rings, of which it uses the first
/// min(tokens, window) slots (the rest of a short sequence's rings may belong to others).
inline uint64_t window_extent(const paged_view& kv, int64_t tokens) {
  const uint64_t ring = uint64_t(kv.window) * kv.head_dim * 2;
  const uint64_t used = uint64_t(std::min<int64_t>(std::max<int64_t>(tokens, 1), kv.window)) * kv.head_dim * 2;
  return (uint64_t(kv.layers) * kv.kv_heads * 2 - 1) * ring + used;
}

/// Item `i`'s slot (page-table row) and window (256-byte units; `tokens` tokens held after the
/// call) lie inside the view.
inline status check_item_indices(const paged_view& kv, const char* call, size_t i, int slot, uint32_t window_unit,
                                 int64_t tokens) {
  if (slot < 0 || (kv.slots > 0 && slot >= kv.slots))
    return {errc::invalid_argument,
            msg(call, ": item ", i, " has slot ", slot, ", outside the page tables' slots [0, ", kv.slots, ")")};
  if (kv.arena_bytes > 0 && uint64_t(window_unit) * block_unit + window_extent(kv, tokens) > kv.arena_bytes)
    return {errc::invalid_argument, msg(call, ": item ", i, " (slot ", slot, ") has its window at unit ", window_unit,
                                        " (byte ", uint64_t(window_unit) * block_unit, "), whose rings of ", tokens,
                                        " tokens end past the arena's ", kv.arena_bytes, " bytes")};
  return {};
}

/// New page `i` (block offset `unit` in 256-byte units, `bytes` long) lies inside the arena.
inline status check_page_block(const paged_view& kv, const char* call, int i, uint32_t unit, uint64_t bytes) {
  if (kv.arena_bytes > 0 && uint64_t(unit) * block_unit + bytes > kv.arena_bytes)
    return {errc::invalid_argument,
            msg(call, ": new page ", i, " has its block at unit ", unit, " (byte ", uint64_t(unit) * block_unit,
                "), whose ", bytes, " bytes end past the arena's ", kv.arena_bytes)};
  return {};
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
