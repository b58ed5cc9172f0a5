#pragma once
/// \file
/// The low-level calls of kvq/cuda/paged_attention.hpp on the CPU, over host memory: an engine
/// that owns its pool (an int32 block table shared by every layer, self-describing blocks,
/// `page_tables::shared`; or kvq's own tables) appends and attends with the same argument
/// structs on either device. The bytes written are the CUDA calls' (one codec), and attention is
/// the CPU backend's (`cpu::attend`, `cpu::prefill`, `cpu::attend_prefix`), checked against the
/// reference like `KVCache` on the CPU. Every pointer of the arguments is host memory.
///
/// Differences from the CUDA calls: values are checked at the call (a row with a NaN, an Inf or a
/// value beyond the fp16 range fails it with `non_finite` naming the item and token, and nothing
/// is written; `append_args::guard` is not used); rotated heads are `unsupported` here (`KVCache`
/// rotates on the CPU); every format is read, not only those with CUDA kernels. Not thread-safe
/// per pool of workers.
#include <kvq/attention/cpu_attention.hpp>
#include <kvq/cuda/paged_attention.hpp>
#include <kvq/status.hpp>

KVQ_NAMESPACE_BEGIN
namespace cpu {

/// `cuda::append_run` over host memory: each item's new tokens into its ring, its new pages
/// encoded (and, per `kv.tables`, listed in kvq's tables or their formats written in the block's
/// header). All or nothing: every check (`cuda::append_run`'s and the values) runs first.
KVQ_EXPORT status pool_append(const cuda::append_args& a);

/// `cuda::attend_run` over host memory: causal GQA attention of each item's q_len queries over its
/// n stored tokens (`from_pages` of them from pages, the rest from the ring). Tasks: (item, kv head).
KVQ_EXPORT status pool_attend(worker_pool& pool, const cuda::attend_args& a);

/// `cuda::prefill_run` over host memory: the prefix part (and, with the chunk's K/V, its causal
/// part merged by log-sum-exp). `lse` is written for a prefix-only call (a chunk's merged LSE: not
/// on the CPU, `unsupported`).
KVQ_EXPORT status pool_prefill(worker_pool& pool, const cuda::prefill_args& a);

}  // namespace cpu
KVQ_NAMESPACE_END
