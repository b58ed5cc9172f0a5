#pragma once
// The CUDA half of `KVCache::prefill` and `KVCache::attend_prefix` (docs/architecture.md,
// "Prefill of any length"): T queries of one sequence over its first n0 stored tokens (the tile
// kernel, unmasked), and for a prefill also over the chunk's own K/V in fp16, causally (the chunk
// kernel, attention/chunk_causal.cuh), merged by log-sum-exp in the split merge. Host-readable:
// the backend (cuda_backend.cpp) sizes the workspace and launches through these.
#include <cstddef>
#include <cstdint>
#include <kvq/cuda/paged_attention.hpp>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

/// One prefix (and chunk) attention call over one sequence and layer.
struct prefill_args {
  paged_view kv;
  int layer = 0;
  int q_heads = 0;
  int32_t slot = 0;          ///< the sequence's page-table row
  uint32_t window_unit = 0;  ///< its window block, 256-byte units
  int32_t prefix = 0;        ///< n0: the stored tokens every query sees, unmasked
  int32_t from_pages = 0;    ///< of those, read from pages: min(encoded tokens, n0); the rest from the ring
  int64_t queries = 0;       ///< T
  const void* q = nullptr;   ///< device [T][q_heads][head_dim]
  dtype q_type = dtype::f16;
  int64_t q_stride = 0;  ///< elements between rows (0: packed)
  void* o = nullptr;     ///< device [T][q_heads][head_dim]
  dtype o_type = dtype::f16;
  int64_t o_stride = 0;
  /// A prefill: the chunk's K and V (device [T][kv_heads][head_dim]); query i also sees chunk
  /// tokens 0..i rounded to fp16 (rotated first on rotated heads). Null `k.data`: the prefix only.
  tensor_view k, v;
  float* lse = nullptr;  ///< optional, device [T][q_heads]: natural-log log-sum-exp of each row
  float scale = 0.f;     ///< 0: 1/sqrt(head_dim)
  int num_sms = 132;
  head_rotation rotation;
  /// False where no page of the layer holds a format other than FP16: the prefix kernel reads
  /// every page as it is, and the staging launch is skipped.
  bool quantized_pages = true;
};

/// Queries per item of the tile kernel's batch: a call of T queries is ceil(T / 256) items of one
/// sequence, so that the grid's (kv head x m-tile) dimension stays small for any T.
constexpr int prefill_item_queries = 256;
/// The prefix kernel reads fp16 tiles only: the quantized page tiles of the prefix are dequantized
/// once per call into the workspace first, in segments of at most this many bytes (at the
/// Llama-8B shape, 8 kv heads x head_dim 128: 256 tiles, 16K tokens, a segment).
constexpr size_t prefill_stage_bytes = size_t(64) << 20;

/// Checks the arguments (shapes, indices, what the ring holds); the message names the problem.
status prefill_can_implement(const prefill_args& a);
/// Device workspace of a call: the partial results, the rotated queries (rotated heads), the
/// chunk's fp16 K/V (a prefill) and the staged fp16 images of a segment's page tiles (at most
/// `prefill_stage_bytes`). It does not depend on `from_pages`, so it can be sized before the
/// chunk's append decides how many tokens are encoded.
size_t prefill_workspace_bytes(const prefill_args& a);
/// Launches the call on `stream` (no synchronization, no allocation). Defined in
/// attention/prefill.cu.
status prefill_run(const prefill_args& a, void* workspace, size_t workspace_bytes, void* stream);

}  // namespace cuda::detail
KVQ_NAMESPACE_END
