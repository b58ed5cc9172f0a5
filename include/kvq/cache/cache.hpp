#pragma once
/// \file
/// `kvq::KVCache`: the one interface an engine talks to (docs/architecture.md).
///
/// Per layer and step, an engine calls `append` with the K and V of the new tokens of a sequence,
/// then `attend` with the queries of a batch of sequences. The cache quantizes on write into
/// pages whose format the policy picks, keeps the newest tokens in an FP16 recent window, and
/// attends over any mix of formats.
///
/// Token life cycle (per sequence and layer; P = page_tokens, R = window, r = recent):
/// - every appended token enters the FP16 ring of the last R tokens;
/// - once P + r tokens are not yet encoded, the oldest P of them are encoded into a new page of
///   each (kv head, role) in the format the policy gives at that moment (forward-only);
/// - attention reads each token once: from its page once encoded, else from the ring; the tokens
///   of the current step (the last q_len appended) are always read in FP16 from the ring, so a
///   prompt attends to itself at full precision (q_len <= R);
/// - `prefill` takes a chunk of any length in one call: it appends the chunk and each of its
///   queries attends to the tokens before the chunk as stored after the append and, causally,
///   to the chunk's own tokens in FP16 (what `append` + `attend` give for a chunk of at most R
///   tokens). A query never sees an earlier token of its own chunk quantized.
///
/// Errors: every call validates first and returns a `status` naming the problem; a failed call
/// leaves stored bytes and statistics exactly as they were.
///
/// Thread-safety: a cache is not thread-safe; calls on one cache must not overlap. `stats()` and
/// other const calls may run concurrently with each other. Distinct caches are independent.

#include <array>
#include <cstdint>
#include <kvq/cache/cache_config.hpp>
#include <kvq/cache/types.hpp>
#include <kvq/config.hpp>
#include <kvq/format/format.hpp>
#include <kvq/policy/policy.hpp>
#include <kvq/rotation/rotation.hpp>
#include <kvq/status.hpp>
#include <kvq/tensor.hpp>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

KVQ_NAMESPACE_BEGIN

/// Why `p` cannot be a rolealign clip percentile, or empty when it can: p must be in [50, 100]
/// and its percentiles of the largest rolealign group (`codec::max_rolealign_group` values) must
/// need at most `codec::max_percentile_tail` order statistics from each end (p >= about 88.2).
KVQ_EXPORT std::string clip_percentile_error(float p);

namespace detail {
struct cache_state;
class cache_backend;
class step_backend;
}  // namespace detail

/// The cache. Move-only; create with `KVCache::create`.
class decode_step;

class KVQ_EXPORT KVCache {
 public:
  /// Validates the configuration and binds the policy (shared: a policy may serve several caches
  /// only if it says it is safe to). Errors name the bad field.
  static result<KVCache> create(const cache_config& cfg, std::shared_ptr<policy> pol);

  /// What a cache of this configuration allocates outside `budget_bytes` when it is created (the
  /// CUDA page tables; zero on the CPU), without creating it: an engine sizes `budget_bytes` as the
  /// memory it gives the cache minus this. Workspaces come later and grow with the call shapes
  /// (`cache_stats::overhead` reports them). Errors: an invalid configuration.
  static result<cache_overhead> overhead(const cache_config& cfg);

  KVCache(KVCache&&) noexcept;
  KVCache& operator=(KVCache&&) noexcept;
  ~KVCache();

  /// Starts an empty sequence with a window of one lane (page_tokens slots of every ring), taken
  /// from a ring block that has one free, else from a new ring block of the budget; the window
  /// grows a lane at a time with the appends, up to the full window (include/kvq/store/store.hpp).
  status create_sequence(seq_id id, stream_ref stream = {});
  /// Returns every page and window of the sequence to the budget.
  status release_sequence(seq_id id);
  bool has_sequence(seq_id id) const;
  /// Tokens stored for (sequence, layer), or -1 for an unknown sequence.
  int64_t length(seq_id id, int layer) const;
  /// Tokens that appends to (sequence, layer) can add before one encodes a page: an append of at
  /// most this many leaves every token where it is (pages as they are, the new tokens in the
  /// FP16 ring), a longer one encodes the oldest unencoded tokens into a page (a page is encoded
  /// as soon as page_tokens + recent tokens are unencoded). A decode step after such an append
  /// reads what a step after the same tokens appended one at a time reads, which lets an
  /// evaluation feed a teacher-forced text in chunks with decode semantics (tools/eval). -1 for
  /// an unknown sequence or layer.
  int64_t tokens_before_encode(seq_id id, int layer) const;

  /// Starts sequence `dst` as a copy of `src` (a shared prompt, beams, parallel samples): dst
  /// lists every encoded page of src, shared and reference-counted (stored and counted once; a
  /// page's bytes return to the budget when its last sharer releases or truncates it), and gets
  /// its own copy of src's FP16 windows, so both then append and attend independently. Costs as
  /// many lanes as src's window (a new ring block when no block has them free). Errors: unknown src (`not_found`),
  /// existing dst
  /// (`invalid_argument`), no slot or no budget for the window (`out_of_budget`); then nothing
  /// changed.
  status fork(seq_id src, seq_id dst, stream_ref stream = {});

  /// Drops the newest tokens of sequence `id`: every layer keeps its first `length` tokens
  /// (rejected speculative drafts). Needs 0 <= length <= the tokens of every layer. Each layer is
  /// left as appending its first `length` tokens directly would leave it (the pages that append
  /// would have written, the rest unencoded in the ring) whenever its ring still holds the tokens
  /// that go back to the ring; a page whose tokens left the ring stays encoded unless the cut
  /// falls inside it, and then its kept tokens that left the ring come back as the page's decoded
  /// values rounded to fp16 (a later append re-encodes them from there). Pages another sequence
  /// shares stay for it: a sharer never changes. docs/architecture.md has the rule in full.
  /// On CUDA the restore of a cut page's tokens runs on the device (no synchronization).
  status truncate(seq_id id, int64_t length, stream_ref stream = {});

  /// Budget bytes that appending `tokens` more tokens to every layer of sequence `seq` would
  /// allocate (its new page blocks, in the formats the policy holds now: `current`, and a ring
  /// block when its window must grow and no free lanes serve it), or, without `seq`, what a new
  /// sequence of `tokens` tokens takes (its pages, and a ring block unless free lanes serve its
  /// window). For admission control against `stats().free_bytes` (a ring block is one contiguous
  /// block: `stats().largest_free_block`). Exact, for the cache as it is now, for policies whose
  /// formats do not change meanwhile: free lanes counted for one request are free for the next
  /// too, so an engine that reserves for several requests before creating them counts a ring
  /// block for each. A sliding layer (`cache_config::attention`) counts what it holds more after
  /// the tokens came one step at a time: its new pages that its window still reaches, less the
  /// bytes of the pages it returns meanwhile (at least 0); an append of many tokens in one call
  /// allocates its pages before it returns the old ones. Errors: tokens < 0, an unknown sequence.
  result<uint64_t> bytes_for(int64_t tokens, std::optional<seq_id> seq = std::nullopt) const;

  /// Appends the K and V of `k.tokens` new tokens of one sequence and layer.
  /// \param k [tokens][kv_heads][head_dim] f32/f16/bf16, finite and within fp16 range
  /// \param v same shape as k
  status append(seq_id id, int layer, const tensor_view& k, const tensor_view& v, stream_ref stream = {});

  /// Appends the new tokens of several sequences of one layer in one call: a decode step's
  /// writes for a whole batch. On CUDA it is one page-encode launch and one ring-write launch for
  /// the batch (and, with check_values, one synchronization), where per-sequence `append` costs
  /// that per sequence. All or nothing: an unknown or repeated sequence, a bad shape, a bad value
  /// or a full budget stores nothing for any sequence.
  /// \param items one entry per sequence (distinct), tokens >= 1
  /// \param k [sum of tokens][kv_heads][head_dim], the items' rows in order
  /// \param v same shape as k
  status append_batch(std::span<const append_item> items, int layer, const tensor_view& k, const tensor_view& v,
                      stream_ref stream = {});

  /// Decode / extend attention of one layer for a batch of sequences.
  /// \param items one entry per sequence; each q_len <= its appended length and <= window
  /// \param q [sum q_len][q_heads][head_dim], items' queries in order
  /// \param o [sum q_len][q_heads][head_dim] output
  status attend(std::span<const attend_item> items, int layer, const tensor_view& q, const tensor_mut& o,
                stream_ref stream = {});

  /// Appends a chunk of any length of one sequence and layer and attends its queries, in one
  /// call (docs/architecture.md, "Prefill of any length"). With n0 tokens stored before the
  /// call and T = k.tokens, query i (position n0 + i) sees
  /// - tokens 0..n0-1 as stored after the chunk's append: from their page where encoded, else
  ///   from the FP16 ring (what `attend_prefix` with prefix n0 reads), and
  /// - chunk tokens 0..i in FP16: the given K and V rounded to fp16, as the ring would hold them,
  ///   even where the append already encoded them into pages.
  /// For T <= window this is `append` + `attend` with q_len T (equal up to summation order); for
  /// a longer chunk it is what those would give with a ring large enough. The two parts are
  /// computed separately and merged by log-sum-exp (`merge_attention`, attention/merge.hpp).
  /// Appending is `append`'s (same validation, storage and policy calls); everything (shapes,
  /// token counts, values, budget) is validated before anything is stored.
  /// Both backends take any T. CUDA: T <= window as `append` + `attend`; a longer chunk as the
  /// prefix part on the prefix kernel (128 query rows a block) and the chunk's causal part on a
  /// FlashAttention-2-style kernel over its fp16 K/V, merged by log-sum-exp, its workspace grown
  /// before the append (a failed call stores nothing); a device canary (EchoKV) does not measure
  /// the queries of such a chunk.
  /// \param k [T][kv_heads][head_dim] f32/f16/bf16, finite and within fp16 range
  /// \param v same shape as k
  /// \param q [T][q_heads][head_dim]
  /// \param o [T][q_heads][head_dim] output
  status prefill(seq_id id, int layer, const tensor_view& k, const tensor_view& v, const tensor_view& q,
                 const tensor_mut& o, stream_ref stream = {});

  /// Attention of `q.tokens` queries over the first `prefix` stored tokens of (sequence, layer),
  /// unmasked (every query sees all of them), read as stored now: from the page where encoded,
  /// else from the FP16 ring. It also writes each (query, head)'s log-sum-exp, so an engine can
  /// merge it (`merge_attention`) with its own attention over other keys, e.g. a chunk's causal
  /// attention over its own K/V after appending the chunk with `append`: that is `prefill`.
  /// Both backends; on CUDA `lse` is device memory.
  /// \param prefix stored tokens to attend to, 0 <= prefix <= length(id, layer); 0 gives o = 0
  ///        and lse = -inf
  /// \param q [tokens][q_heads][head_dim]
  /// \param o [tokens][q_heads][head_dim] output
  /// \param lse [tokens][q_heads] float, in the backend's memory: the natural-log log-sum-exp
  ///        ln(sum_j exp(s_j)) of the scaled scores s_j = softmax_scale * (q . k_j)
  status attend_prefix(seq_id id, int layer, int64_t prefix, const tensor_view& q, const tensor_mut& o, float* lse,
                       stream_ref stream = {});

  /// What the next step will read for (sequence, layer, role): token j of kv head h is
  /// dequantized from its page if encoded, else read from the FP16 ring; the tokens whose pages a
  /// sliding layer released (no later query sees them) read as 0.
  /// \param out host [length][kv_heads][head_dim] float
  /// CUDA: synchronizes `stream` (the work that wrote the sequence must be on it or done).
  status read(seq_id id, int layer, role r, std::span<float> out, stream_ref stream = {}) const;

  /// Moving sequences (docs/architecture.md, "Moving sequences"; the blob format:
  /// cache/sequence_blob.hpp). A blob holds sequences' pages and FP16 windows bit for bit with
  /// everything needed to read them; a page block that several of them list (a fork) is stored
  /// once. Import restores them, into this cache or another of the same shape, rotation and sink
  /// pages, on the CPU or a GPU, with pages identical to the exported ones: attention over them is
  /// what it was.
  ///
  /// Bytes the blob of sequences `ids` takes (`export_sequences`).
  result<uint64_t> export_bytes(std::span<const seq_id> ids) const;
  /// Writes the blob of sequences `ids` (distinct, resident) into `out` (at least `export_bytes`
  /// bytes) and returns its size. CUDA: copies on `stream` and synchronizes it (the blob's
  /// checksums are computed on the host); pinned memory for `out` copies fastest. The sequences
  /// stay as they were.
  result<uint64_t> export_sequences(std::span<const seq_id> ids, std::span<uint8_t> out, stream_ref stream = {}) const;
  /// The blob of `ids` in a new buffer.
  result<std::vector<uint8_t>> export_sequences(std::span<const seq_id> ids, stream_ref stream = {}) const;
  /// Creates sequences `ids` (one per sequence of the blob, in its order; none existing) from a
  /// blob, with the lengths, pages, windows and sharing the blob holds. Errors, with nothing
  /// changed: a malformed, truncated or corrupted blob (`inspect_blob`'s message), another
  /// shape (naming the field), another rotation or sink-page count, a sequence longer than
  /// `max_tokens` (CUDA), an id that exists, too few slots or budget (`out_of_budget`). CUDA:
  /// copies on `stream` (the blob must stay valid until that work is done; a pageable blob is
  /// read before the call returns).
  status import_sequences(std::span<const uint8_t> blob, std::span<const seq_id> ids, stream_ref stream = {});
  /// `export_sequences` into a file (written whole, then renamed into place) and
  /// `import_sequences` from one (CUDA: it synchronizes the stream); errors name the path.
  status export_file(const std::string& path, std::span<const seq_id> ids, stream_ref stream = {}) const;
  status import_file(const std::string& path, std::span<const seq_id> ids, stream_ref stream = {});

  /// Moves a sequence's pages and window out of the budget into the swap space
  /// (`cache_config::swap_bytes`), asynchronously on `stream`: its budget bytes and slot are free
  /// when the call returns (a later call on the same stream may reuse them; work on other streams
  /// that reads the sequence must be ordered before, as for `release_sequence`). Pages shared with
  /// another sequence are copied too and come back as the sequence's own. A swapped-out sequence
  /// keeps its id and lengths (`has_sequence`, `length`); every other call on it is refused
  /// naming the swap, except `release_sequence` and `swap_in`. Errors, with nothing changed: an
  /// unknown or swapped-out sequence, no swap space left (`out_of_budget`). CUDA with
  /// `check_values`: call `check()` first (where the engine synchronizes anyway), so that a
  /// sequence whose appends the device refused is restored before it moves; the same holds for
  /// `export_sequences`.
  status swap_out(seq_id id, stream_ref stream = {});
  /// Brings a swapped-out sequence back into the budget, asynchronously on `stream`, bit for bit
  /// as it was. Errors, with nothing changed (it stays swapped out): no slot or budget
  /// (`out_of_budget`; `swap_in_bytes` says what it needs).
  status swap_in(seq_id id, stream_ref stream = {});
  bool is_swapped(seq_id id) const;
  /// Budget bytes `swap_in(id)` would allocate now: its page blocks and, unless free lanes serve
  /// its window, a ring block. Errors: `id` not swapped out.
  result<uint64_t> swap_in_bytes(seq_id id) const;

  /// Reports what the device-side value checks refused (`cache_config::check_values`) and makes
  /// the bookkeeping match what the device holds. CUDA: synchronizes `stream` (default: the
  /// cache's), so it covers the appends queued there and every append already complete on other
  /// streams. Each held sequence is restored, layer by layer, to its state before its first
  /// refused append (its length, pages and window; a truncate of it issued before this call
  /// stands where it cut deeper), and takes appends again. Returns `non_finite` naming the
  /// sequence, layer and token of the first refused row, the rows refused and the sequences
  /// restored; OK when nothing was refused. CPU: always OK (the CPU refuses at the call).
  status check(stream_ref stream = {});

  /// rolealign clip percentiles, [layers][kv_heads][2] (K then V): each group's range becomes
  /// the (100-p)-th to p-th percentile of its values (format/kivi.hpp); 100 clips nothing (the
  /// default). Each p must pass `clip_percentile_error`. Applies to pages encoded afterwards.
  status set_clip_percentiles(std::span<const float> percentiles);

  /// The levels codebook format `f` (`cb<b>[/g<G>]`) encodes with, [layers][kv_heads][2][2^b]
  /// (K then V), each (layer, kv head, role) 2^b finite, strictly ascending values in units of
  /// the group's rms (format/codebook.hpp), e.g. fitted by the calibrator
  /// (`calib::artifact::codebook_levels_for`). Applies to pages encoded afterwards: each page
  /// carries its levels, so the pages already stored and the attention kernels are unaffected.
  /// Rotated heads take levels fitted in the rotated space. Until set: the Lloyd-Max levels of a
  /// standard normal. Errors (nothing changes): `f` not a codebook format, a wrong count, levels
  /// not finite or not ascending (naming the layer, head and role).
  status set_codebook_levels(format_id f, std::span<const float> levels);
  /// The levels of codebook format `f` now, in `set_codebook_levels`'s layout.
  result<std::vector<float>> codebook_levels(format_id f) const;

  /// Waits for the policy's canaries still in flight and feeds their measurements to the policy.
  /// CPU backend: nothing to do (the canary runs inside `attend`). CUDA backend: a policy with a
  /// device canary (`policy::device_canary`, e.g. EchoKV) is measured on the GPU: each attend
  /// stages the due queries, and one kernel for all layers of the step runs on the stream at the
  /// next append to or attend of a layer with staged queries (in a decode step: the next step's
  /// first append), at `flush_policy`, or at this call; completed measurements are
  /// ingested without blocking at the start of later `append`/`attend` calls, so a decision
  /// reaches `choose` one or more steps after its canary (pages planned in between keep the
  /// previous tier), and this call launches what is staged, synchronizes the stream's canaries
  /// and ingests the rest. A live canary makes the launch
  /// sequence data-dependent (a canary kernel on some steps only): freeze the policy before
  /// capturing a step in a CUDA graph. Returns the first canary failure since the last call.
  status sync_policy();

  /// Launches the canaries staged so far (CUDA backend; nothing elsewhere) without waiting for
  /// them. An engine may call it after a step's last attend: the canary then runs ahead of the
  /// rest of the step rather than at the next step's first append (the same GPU time, its
  /// decisions one step sooner). The measurements are ingested as usual. Returns the launch's
  /// failure, if any.
  status flush_policy();

  cache_stats stats() const;
  const cache_config& config() const;
  policy& active_policy() const;

 private:
  friend class decode_step;  // a replayable step keeps the bookkeeping of the cache it was made from
  KVCache(std::unique_ptr<detail::cache_state> st, std::unique_ptr<detail::cache_backend> b);
  std::unique_ptr<detail::cache_state> state_;   ///< bookkeeping: config, policy, store, encoder parameters
  std::unique_ptr<detail::cache_backend> impl_;  ///< the data plane; reads `state_`
};

/// The snake_case spelling of the same type.
using kv_cache = KVCache;

KVQ_NAMESPACE_END
