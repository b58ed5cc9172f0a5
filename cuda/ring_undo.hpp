#pragma once
// The undo record of a multi-launch append: before its first launch, the ring rows its ring writes
// will overwrite are copied aside on the stream; if a later launch fails, they are copied back,
// so the rings hold what they held before the call (docs/architecture.md, "CUDA hygiene").
#include <cstdint>
#include <kvq/cuda/paged_attention.hpp>
#include <span>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

/// Ring rows of one sequence that an append overwrites: tokens [first, first + count) of every
/// (kv head, role) ring of the layer (count <= window).
struct ring_rows {
  uint32_t window_unit;  ///< the sequence's window block, in 256-byte units
  int32_t first;
  int32_t count;
  uint32_t saved_row;  ///< its first row in the undo buffer
};

/// Bytes of the undo buffer for `tokens` saved tokens (over all sequences).
inline size_t ring_undo_bytes(const paged_view& kv, int64_t tokens) {
  return size_t(tokens) * size_t(kv.kv_heads) * 2 * size_t(kv.head_dim) * 2;
}

/// Copies the rows into `saved` ([sum of count][kv_heads][2][head_dim] fp16; `save`) or back into
/// the rings (`!save`), on `stream`: one launch per 1024 sequences.
status ring_undo(const paged_view& kv, uint8_t* arena, int layer, std::span<const ring_rows> rows, uint16_t* saved,
                 bool save, void* stream);

}  // namespace cuda::detail
KVQ_NAMESPACE_END
