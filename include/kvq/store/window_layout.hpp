#pragma once
/// \file
/// Layout facts of the arena shared by the host store and the CUDA kernels: the block unit, and
/// where the FP16 ring of one (layer, kv head, role) lies in a sequence's window block.

#include <cstdint>
#include <kvq/config.hpp>

KVQ_NAMESPACE_BEGIN

/// Every arena block (page-head, window) starts at a multiple of this many bytes (16-byte loads,
/// 128-byte lines); device page tables and window offsets count in this unit.
inline constexpr uint32_t block_unit = 256;

/// Slots after the last ring of a ring block that reads may touch: the decode kernels read the
/// ring in whole 16-token slabs, and select away the rows past the tokens held. A sequence whose
/// lanes end its ring block (include/kvq/store/store.hpp) has no slots of its own after its last
/// ring, so each ring block carries this slack.
inline constexpr int ring_slack_slots = 16;

/// Bytes of a ring block of `window` slots: [layers][kv_heads][K, V][window][head_dim] fp16 rings and
/// the slack after them.
KVQ_HOST_DEVICE constexpr uint64_t ring_block_bytes(int layers, int kv_heads, int head_dim, int window) {
  return (uint64_t(layers) * kv_heads * 2 * uint64_t(window) + ring_slack_slots) * uint64_t(head_dim) * 2;
}

/// Pages (each over every kv head and role) encoded when `m` tokens are appended to a layer
/// holding `n` tokens of which `e` are encoded: a page is encoded as soon as page_tokens + `recent`
/// tokens are unencoded, so after the append fewer are: max(0, floor((n + m - e - recent) / P)).
KVQ_HOST_DEVICE constexpr int64_t pages_to_encode(int64_t n, int64_t e, int64_t m, int page_tokens, int recent) {
  const int64_t u = n + m - e - recent;
  return u >= page_tokens ? u / page_tokens : 0;
}

/// Offset in halves of the FP16 ring of (`layer`, `kv_head`, role `r`: 0 K, 1 V) from the start of
/// a sequence's window block. Rings are laid out [layers][kv_heads][K, V][window][head_dim] halves.
KVQ_HOST_DEVICE constexpr uint64_t ring_halves(int layer, int kv_heads, int kv_head, int r, int window, int head_dim) {
  return ((uint64_t(layer) * kv_heads + kv_head) * 2 + r) * uint64_t(window) * head_dim;
}
/// The same offset in bytes.
KVQ_HOST_DEVICE constexpr uint64_t ring_offset(int layer, int kv_heads, int kv_head, int r, int window, int head_dim) {
  return ring_halves(layer, kv_heads, kv_head, r, window, head_dim) * 2;
}

KVQ_NAMESPACE_END
