#pragma once
// The CUDA half of `KVCache::prefill` and `KVCache::attend_prefix` (docs/architecture.md,
// "Prefill of any length"): T queries of one sequence over its first n0 stored tokens (the tile
// kernel, unmasked), and for a prefill also over the chunk's own K/V in fp16, causally (the chunk
// kernel, attention/chunk_causal.cuh), merged by log-sum-exp in the split merge. The call itself
// is public (`cuda::prefill_run`, include/kvq/cuda/paged_attention.hpp); this header holds the
// sizes the backend and tests share.
#include <cstddef>
#include <cstdint>
#include <kvq/cuda/paged_attention.hpp>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

using cuda::prefill_args;
using cuda::prefill_can_implement;
using cuda::prefill_run;
using cuda::prefill_workspace_bytes;

/// Queries per item of the tile kernel's batch: a call of T queries is ceil(T / 256) items of one
/// sequence, so that the grid's (kv head x m-tile) dimension stays small for any T.
constexpr int prefill_item_queries = 256;
/// The prefix kernel reads fp16 tiles only: the quantized page tiles of the prefix are dequantized
/// once per call into the workspace first, in segments of at most this many bytes (at the
/// Llama-8B shape, 8 kv heads x head_dim 128: 256 tiles, 16K tokens, a segment).
constexpr size_t prefill_stage_bytes = size_t(64) << 20;

}  // namespace cuda::detail
KVQ_NAMESPACE_END
