#pragma once
/// \file
/// A decode step an engine captures once into a CUDA graph and replays for every later step
/// (docs/architecture.md, "Graph replay"). The step's per-sequence descriptors (lengths, page
/// and window offsets, the new pages' blocks and formats) live in device memory at addresses
/// fixed when the step is made, and its launch shapes are planned from a maximum batch and a
/// maximum context, so the captured kernels read each step's descriptors at run time.
///
/// An engine loop:
///
///     auto step = kvq::decode_step::create(cache, max_batch, max_tokens).value_or_throw();
///     check(step.prepare(seqs));                       // host bookkeeping + one descriptor copy
///     cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
///     for (int l = 0; l < layers; ++l) {               // with the model's own kernels between
///       check(step.append(l, k[l], v[l]));
///       check(step.attend(l, q[l], o[l]));
///     }
///     cudaStreamEndCapture(stream, &graph);            // ... instantiate once
///     cudaGraphLaunch(exec, stream);                   // the first step
///     for (;;) { check(step.prepare(seqs)); cudaGraphLaunch(exec, stream); }
///
/// A replay computes bit for bit what the same step's `append` + `attend` calls compute when run
/// without a graph. Against the cache's own `append_batch` + `attend`: the stored pages and
/// windows are the same bytes; attention runs, per layer, the decode kernel the eager plan picks
/// for the widest format the policy's map (and the layer's pages) hold at `create`, with splits
/// planned for `max_tokens` rather than for the batch's longest sequence, so its outputs differ
/// from those calls' by summation order only (docs/decisions.md, "Graph replay").
#include <kvq/cache/cache.hpp>

#include <memory>
#include <span>
#include <vector>

KVQ_NAMESPACE_BEGIN
namespace detail {
struct step_layer;
}

/// A replayable decode step of a CUDA cache: one new token for each of up to `max_batch`
/// sequences, every layer, with one graph launch per step.
///
/// `prepare` runs on the host: it validates the step, advances the cache's bookkeeping (lengths,
/// page allocation with the formats the policy chooses, window growth) exactly as
/// `append_batch` of one token per sequence would for every layer, and enqueues one copy of the
/// step's descriptors, from pinned host memory to the step's device tables, on the cache's
/// stream; it launches no kernel (a window that must move to a longer run of lanes is a copy on
/// the stream too). `append` and `attend` only launch kernels that read those tables: capture
/// them once (the cache's stream), then replay the graph after each `prepare`. Stream order
/// makes step t + 1's copy wait for step t's replay; `prepare` waits (on the host) only for the
/// copy of two steps before, whose pinned buffer it reuses.
///
/// Not supported: the CPU backend, policies that watch queries (EchoKV's device canary runs
/// outside a replayed step), a GQA group above 8 (replay runs the decode kernel), q_len > 1.
/// The cache must outlive the step and not move (the step keeps its address); the eager calls of
/// the cache stay usable between steps.
class KVQ_EXPORT decode_step {
 public:
  /// A step of at most `max_batch` sequences (1 to 256) of at most `max_tokens` tokens each
  /// (2 to the cache's max_tokens). Allocates its device tables, its pinned host buffers and
  /// its attention workspace here, once (reported in no `stats()`: sizes in docs/architecture.md).
  static result<decode_step> create(KVCache& cache, int max_batch, int64_t max_tokens);

  decode_step(decode_step&&) noexcept;
  decode_step& operator=(decode_step&&) noexcept;
  ~decode_step();

  /// The next step: one new token for each of `seqs` (distinct existing sequences, in batch-row
  /// order), every layer. Call it outside any stream capture (its copy is not part of the graph).
  /// Validates everything first (batch size, unknown or repeated sequences, a sequence that would
  /// pass `max_tokens`, a budget that cannot hold the step's new pages and windows in one free
  /// block, a new page the policy would encode wider than its layer's formats at `create`): a
  /// refused step changes nothing.
  status prepare(std::span<const seq_id> seqs);

  /// The prepared step's append for `layer`: row i of k and v is the new token of the step's
  /// sequence i; rows past the step's batch are not read.
  /// \param k device [max_batch][kv_heads][head_dim] f32/f16/bf16 (finite; not checked on device)
  /// \param v same shape as k
  status append(int layer, const tensor_view& k, const tensor_view& v);

  /// The prepared step's attention for `layer`, after its append: row i of q and o is the
  /// step's sequence i; rows of o past the step's batch are not written.
  /// \param q device [max_batch][q_heads][head_dim]
  /// \param o device [max_batch][q_heads][head_dim] output
  status attend(int layer, const tensor_view& q, const tensor_mut& o);

  int max_batch() const { return max_batch_; }
  int64_t max_tokens() const { return max_tokens_; }
  /// Sequences of the prepared step (0 before the first `prepare`).
  int batch() const { return batch_; }
  /// Bytes of the descriptors each `prepare` copies to the device (every layer's append and
  /// attention tables, sized for max_batch).
  size_t descriptor_bytes() const;

 private:
  decode_step(KVCache& cache, std::unique_ptr<detail::step_backend> impl, int max_batch, int64_t max_tokens,
              std::vector<detail::step_layer> layers);
  KVCache* cache_;
  std::unique_ptr<detail::step_backend> impl_;
  std::vector<detail::step_layer> layers_;  // [layers] the formats the launches were planned for
  int max_batch_ = 0;
  int64_t max_tokens_ = 0;
  int batch_ = 0;
};

KVQ_NAMESPACE_END
