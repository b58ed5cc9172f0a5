#pragma once
/// \file
/// Internal: the backend interface behind `KVCache`. The base validates every request and keeps
/// the bookkeeping (`page_store`); a backend owns the bytes and runs the data plane. Not part of
/// the public API.

#include <algorithm>
#include <cmath>
#include <functional>
#include <kvq/cache/cache_config.hpp>
#include <kvq/cache/types.hpp>
#include <kvq/codec/codec.hpp>
#include <kvq/policy/policy.hpp>
#include <kvq/tensor.hpp>
#include <kvq/store/store.hpp>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

KVQ_NAMESPACE_BEGIN
namespace detail {

/// Floats of the codebook level table of one (layer, kv head, role): a slot per codebook format.
inline constexpr size_t codebook_table_floats = size_t(codec::codebook_format_count) * codec::codebook_slot_floats;

/// What `KVCache` keeps for every backend: the configuration, the policy, the bookkeeping of the
/// store, the rolealign clip percentiles and the codebook levels. The cache validates requests and
/// updates it; a backend reads it and owns nothing of it.
struct cache_state {
  cache_state(const cache_config& c, std::shared_ptr<policy> p)
      : cfg(c),
        pol(std::move(p)),
        store(c.shape, c.budget_bytes, c.max_sequences),
        clip(size_t(c.shape.layers) * c.shape.kv_heads * 2, codec::no_clip),
        levels(size_t(c.shape.layers) * c.shape.kv_heads * 2 * codebook_table_floats, 0.0f) {
    for (size_t unit = 0; unit < levels.size() / codebook_table_floats; ++unit)
      for (int slot = 0; slot < codec::codebook_format_count; ++slot) {
        const int bits = traits_of(format_id(codec::first_codebook_format + slot)).bits;
        for (int k = 0; k < (1 << bits); ++k)
          levels[codec::codebook_level_offset(unit, format_id(codec::first_codebook_format + slot)) + size_t(k)] =
              lloyd_max_level(bits, k);
      }
  }
  cache_config cfg;
  std::shared_ptr<policy> pol;
  page_store store;
  /// Tokens of the sink pages (`cache_config::sink_pages`): a page whose first token is below
  /// holds FP16.
  int64_t sink_tokens() const { return int64_t(cfg.sink_pages) * cfg.shape.page_tokens; }
  /// How many of `pages` new pages of a layer, from page index `first_page` on, are sink pages.
  int64_t sink_pages_among(int64_t first_page, int64_t pages) const {
    return sink_pages_among(cfg, first_page, pages);
  }
  static int64_t sink_pages_among(const cache_config& c, int64_t first_page, int64_t pages) {
    return std::clamp(int64_t(c.sink_pages) - first_page, int64_t(0), pages);
  }
  /// The format of a new page: FP16 for a sink page, else the policy's choice.
  format_id page_format(const page_request& r) const {
    return r.first_token < sink_tokens() ? fp16_format : pol->choose(r);
  }
  std::vector<float> clip;  ///< [layers][kv_heads][2] rolealign clip percentiles
  /// [layers][kv_heads][2][codebook formats][codebook_slot_floats]: the levels each codebook
  /// format encodes with (`KVCache::set_codebook_levels`; Lloyd-Max until set).
  std::vector<float> levels;
  /// A swapped-out sequence (`KVCache::swap_out`): its image (one sequence; the payload layout of
  /// its blocks and window) and where that payload lies in the swap space.
  struct swapped_sequence {
    blob_info image;
    uint64_t host = 0;
  };
  std::unordered_map<seq_id, swapped_sequence> swapped;
  arena_allocator swap{cfg.swap_bytes};  ///< offsets into the backend's swap memory
  uint64_t swapped_out_bytes = 0, swapped_in_bytes = 0;
};

/// The pages a replayed step's layer can hold, from the policy when the step is made: the widest
/// code bits of its formats, and whether every kv head keeps one (K, V) format pair. The backend
/// raises them to its plan; `three_bit`: its plan reads the 3-bit kinds staged, so that they count
/// by their own bits (`cache_backend::plan_bits`).
struct step_layer {
  int max_bits;
  bool one_pair_per_head;
  bool three_bit = false;
};

/// The data plane of a replayable decode step (`decode_step`, cache/decode_step.hpp): launches
/// whose per-step descriptors live in device memory at fixed addresses, so a capture of them is
/// replayed for every later step. The caller keeps the bookkeeping and validates every request.
class step_backend {
 public:
  step_backend() = default;
  step_backend(const step_backend&) = delete;
  step_backend& operator=(const step_backend&) = delete;
  virtual ~step_backend() = default;
  /// One sequence of the next step, before its one-token append to the layer is committed: its
  /// state as it is (its window already where the append writes) and the append's planned pages.
  struct entry {
    const sequence_state* s;
    const append_plan* plan;
  };
  /// Before a step's bookkeeping changes: whether a step can be prepared now (not while the
  /// cache's stream is being captured: the descriptor copy would land in the graph).
  virtual status can_prepare() = 0;
  /// Writes the descriptors of one layer's append and attention of the next step into host
  /// memory (entry i is batch row i); checks them as the eager calls do. Runs nothing.
  virtual status stage(std::span<const entry> entries, int layer) = 0;
  /// Makes the staged step the one the next launches read: one copy of every layer's descriptors
  /// to the device, on the cache's stream.
  virtual status upload() = 0;
  /// Bytes `upload` copies.
  virtual size_t descriptor_bytes() const = 0;
  /// The layer's append kernels over the device descriptors (capturable).
  virtual status append(int layer, const tensor_view& k, const tensor_view& v) = 0;
  /// The layer's attention kernels over the device descriptors (capturable).
  virtual status attend(int layer, const tensor_view& q, const tensor_mut& o) = 0;
};

/// The data plane of a cache: it owns the bytes (host or device) and runs append and attention
/// over the bookkeeping of `cache_state`, which it only reads. Its own state is private to it.
class cache_backend {
 public:
  explicit cache_backend(const cache_state& st)
      : cfg_(st.cfg), pol_(st.pol), store_(st.store), clip_(st.clip), levels_(st.levels), stream_(st.cfg.stream) {}
  cache_backend(const cache_backend&) = delete;
  cache_backend& operator=(const cache_backend&) = delete;
  virtual ~cache_backend() = default;

  /// Called after `cache_state::levels` changed (`KVCache::set_codebook_levels`): a backend that
  /// keeps a copy (the CUDA one, on the device) refreshes it. On failure the cache restores the
  /// previous levels and calls it again.
  virtual status levels_changed() { return {}; }
  /// True when this backend's attention reads pages of format `f` (the CPU reads every format;
  /// CUDA: `cuda::kernels_read`). Appends and imports of other formats are refused.
  virtual bool reads(format_id /*f*/) const { return true; }
  /// The code width a page of format `f` counts as in the choice of this backend's decode kernels,
  /// which a replayed decode step plans each layer for (CUDA: `cuda::kernel_bits`, 16 for a format
  /// read by element; with `three_bit`, in a layer planned for the 3-bit kinds staged,
  /// `cuda::three_bit_kernel_bits`; the CPU: the format's bits).
  virtual int plan_bits(format_id f, bool /*three_bit*/ = false) const { return traits_of(f).bits; }

  /// Converts, validates (finite, within fp16 range) and stores m tokens; encodes the planned
  /// pages. With `check_values`, values are rejected before anything is stored: at the call
  /// (CPU: the call fails) or on the device (CUDA: the sequence is held, `take_refusals`).
  virtual status write(sequence_state& s, int layer, const tensor_view& k, const tensor_view& v,
                       const append_plan& plan) = 0;
  /// One sequence of a validated batched append: its rows of k and v and its planned pages.
  struct batch_entry {
    sequence_state* s;
    const append_plan* plan;
    int64_t row;     ///< first row of the sequence in k and v
    int64_t tokens;  ///< rows of the sequence
  };
  /// `write` for several sequences of one layer, all or nothing: every value of every sequence
  /// is validated before anything is stored.
  virtual status write_batch(std::span<const batch_entry> entries, int layer, const tensor_view& k,
                             const tensor_view& v) = 0;
  /// Attention for a validated batch.
  virtual status attend(std::span<const attend_item> items, int layer, const tensor_view& q, const tensor_mut& o) = 0;
  /// True when `prefill` takes a chunk of any length; otherwise `KVCache::prefill` serves
  /// chunks of at most the window as `append` + `attend` and refuses longer ones.
  virtual bool prefill_any_length() const { return false; }
  /// Before the chunk's append of `KVCache::prefill` (`tokens` tokens after the `s`'s stored ones):
  /// checks that the backend can run the prefill and reserves what it needs (a device workspace),
  /// so that a failure stores nothing.
  virtual status prepare_prefill(const sequence_state& /*s*/, int /*layer*/, int64_t /*tokens*/) { return {}; }
  /// The attention of `KVCache::prefill`, after the chunk (k, v) was appended: query i sees the
  /// first `prefix` stored tokens and chunk tokens 0..i rounded to fp16 (docs/architecture.md,
  /// "Prefill of any length"). Inputs are validated.
  virtual status prefill(const sequence_state& /*s*/, int /*layer*/, int64_t /*prefix*/, const tensor_view& /*k*/,
                         const tensor_view& /*v*/, const tensor_view& /*q*/, const tensor_mut& /*o*/) {
    return {errc::unsupported, "prefill of q_len > window on this backend is not implemented yet"};
  }
  /// `KVCache::attend_prefix` for a validated request: every query sees the first `prefix`
  /// stored tokens; `lse` [q.tokens][q_heads] receives the log-sum-exps.
  virtual status attend_prefix(const sequence_state& /*s*/, int /*layer*/, int64_t /*prefix*/, const tensor_view& /*q*/,
                               const tensor_mut& /*o*/, float* /*lse*/) {
    return {errc::unsupported, "attend_prefix on this backend is not implemented yet"};
  }
  /// Dequantized view of one (sequence, layer, role) into host memory.
  virtual status read(const sequence_state& s, int layer, role r, std::span<float> out) const = 0;
  /// Called after a sequence is created or released (device tables). A failure after a creation
  /// makes the cache release the sequence again.
  virtual status on_sequence_change(const sequence_state&, bool /*created*/) { return {}; }
  /// The stream the device work of the calls that follow runs on: `s` where given, else the
  /// cache's (`cache_config::stream`). KVCache sets it for each call and sets the cache's back
  /// after it. A backend may refuse a stream (the message says why).
  virtual status use_stream(stream_ref s) const {
    stream_ = s.given ? s.stream : cfg_.stream;
    return {};
  }
  void* current_stream() const { return stream_; }
  /// What the device-side value checks refused since the last call (`KVCache::check`).
  struct refusal {
    int slot, layer;
    int64_t n, e, ring_from;  ///< the (slot, layer)'s state before its first refused append
  };
  struct refusals {
    int64_t rows = 0;  ///< rows refused for their values
    int layer = -1;    ///< the first of them: its layer, sequence and token
    int64_t seq = -1, token = -1;
    std::vector<int> slots;         ///< the held slots
    std::vector<refusal> layers;    ///< their layers with a refused append
  };
  /// Waits for the work on the call's stream and takes (and clears) the refusals of the device's
  /// value checks. Backends that check at the call (the CPU) have none.
  virtual result<refusals> take_refusals() { return refusals{}; }
  /// A copy between the arena and a host buffer: `rows` rows of `width` bytes, `pitch` bytes apart
  /// in the arena from offset `arena`, back to back in the host buffer from offset `host`.
  struct host_copy {
    uint64_t arena = 0, host = 0, width = 0, rows = 1, pitch = 0;
  };
  /// Enqueues arena -> host copies on the call's stream (the host buffer stays valid until they
  /// ran). Staged canaries are launched first (a swap frees the rings they read).
  virtual status copy_to_host(std::span<const host_copy> copies, uint8_t* host) = 0;
  /// Enqueues host -> arena copies on the call's stream.
  virtual status copy_from_host(std::span<const host_copy> copies, const uint8_t* host) = 0;
  /// Waits for the call's stream (the CPU's copies are done when they return).
  virtual status wait() { return {}; }
  /// After the store created `s` with pages and a window of its own (an import, a swap-in) and
  /// `copy_from_host` wrote their bytes: the device page tables and the decode plan's notes of its
  /// pages. On failure the caller releases `s`.
  virtual status on_placed(const sequence_state& /*s*/) { return {}; }
  /// The swap space, `cache_config::swap_bytes` bytes of host memory (pinned on CUDA) allocated at
  /// creation; null when swap_bytes is 0.
  virtual uint8_t* swap_memory() const = 0;
  /// After the store forked `src` into `dst` (dst lists src's pages): copies src's FP16 windows
  /// into dst's (`copy_rings`) and dst's page-table rows where the backend keeps them. On failure
  /// the caller releases `dst`.
  virtual status fork(const sequence_state& src, const sequence_state& dst) = 0;
  /// Copies the first `slots` slots of every ring of the window at arena offset `from` into the
  /// window at `to` (two `sequence_state::window_offset`s, whose lanes do not overlap): a window
  /// that moves to a longer run of lanes, or a fork.
  virtual status copy_rings(uint64_t from, uint64_t to, int64_t slots) = 0;
  /// Before the store truncates `s` to `length` tokens per layer: writes into the ring, as fp16,
  /// the kept tokens that go back to the ring but whose slots a later token overwrote
  /// (`ring_restore_range`), decoded from their page. Nothing is written when it fails.
  virtual status restore_ring(const sequence_state& s, int64_t length) = 0;
  /// Start of a validated append or attend: hand the policy the canary measurements that are
  /// complete, without waiting (the CUDA backend's device canary).
  virtual void poll_policy() {}
  /// Waits for every canary in flight and hands its measurement to the policy; returns the first
  /// failure since the last call (a launch, an event or a malformed measurement).
  virtual status sync_policy() { return {}; }
  /// Launches the deferred canaries without waiting (`KVCache::flush_policy`).
  virtual status flush_policy() { return {}; }
  /// Memory held outside the budget now (`cache_stats::overhead`).
  virtual cache_overhead overhead() const { return {}; }
  /// The data plane of a replayable decode step of up to `max_batch` sequences of up to
  /// `max_tokens` tokens whose layers hold pages as `layers` says (raised on return to what the
  /// launches were planned for, with the pages the layers hold); its buffers are allocated here,
  /// once.
  virtual result<std::unique_ptr<step_backend>> make_step(int /*max_batch*/, int64_t /*max_tokens*/,
                                                          std::span<step_layer> /*layers*/) {
    return status{errc::unsupported, "decode_step: a replayable step needs the CUDA backend"};
  }

 protected:
  const cache_config& cfg_;
  const std::shared_ptr<policy>& pol_;
  const page_store& store_;
  const std::vector<float>& clip_;    ///< [layers][kv_heads][2]
  const std::vector<float>& levels_;  ///< cache_state::levels
  mutable void* stream_;              ///< the current call's stream (`use_stream`)

  float softmax_scale() const {
    return cfg_.softmax_scale > 0.f ? cfg_.softmax_scale : 1.0f / std::sqrt(float(cfg_.shape.head_dim));
  }
  float clip_of(int layer, int kv_head, role r) const {
    return clip_[(size_t(layer) * cfg_.shape.kv_heads + kv_head) * 2 + (r == role::k ? 0 : 1)];
  }
  /// The encoder's parameters of a page of format f of (layer, kv head, role).
  codec::encode_params encode_of(int layer, int kv_head, role r, format_id f) const {
    const size_t unit = (size_t(layer) * cfg_.shape.kv_heads + kv_head) * 2 + (r == role::k ? 0 : 1);
    codec::encode_params e{clip_[unit], nullptr};
    if (codec::is_codebook_format(f)) e.levels = levels_.data() + codec::codebook_level_offset(unit, f);
    return e;
  }
};

/// Rows [row, row + n) of a [tokens][heads][head_dim] view.
inline tensor_view rows_of(const tensor_view& t, int64_t row, int64_t n) {
  tensor_view r = t;
  r.data = static_cast<const uint8_t*>(t.data) + row * t.stride() * int64_t(dtype_size(t.type));
  r.tokens = n;
  r.token_stride = t.stride();
  return r;
}

/// Fills `out` [n][kv_heads][d] floats with what a step of `q_len` new tokens of (sequence, layer)
/// reads for role `r`: pages (through the codec) for encoded tokens older than the step, the FP16
/// ring for the rest; 0 for the tokens whose pages a sliding layer released. `page_at(entry)` and
/// `ring_at(kv_head)` give host copies of the bytes.
void gather(const cache_shape& sh, const layer_state& ls, role r, int q_len,
            const std::function<const uint8_t*(const page_entry&)>& page_at,
            const std::function<const uint16_t*(int kv_head)>& ring_at, float* out);

/// Tokens [first, last) of a layer cut to `length` that must come back into its ring decoded from
/// their page (`page_store::kept_encoded`, `restore_from`); they all lie in the page starting at
/// `first`, which the layer still lists. Empty (first == last) in every other case.
inline std::pair<int64_t, int64_t> ring_restore_range(const page_store& store, const layer_state& ls, int64_t length) {
  const int64_t first = store.kept_encoded(ls, length);
  return {first, std::max(first, store.restore_from(ls, length))};
}

/// Writes the fp16 rounding of tokens [first, last) decoded from their page into the ring of one
/// (kv head, role): `page` holds the page's bytes (entry `pe`, whose first token is a multiple of
/// page_tokens), `ring` [window][head_dim] halves.
void restore_rows(const cache_shape& sh, const page_entry& pe, role r, const uint8_t* page, int64_t first, int64_t last,
                  uint16_t* ring);

/// Pages the CUDA page tables index per sequence: ceil(max_tokens / page_tokens).
inline int64_t cuda_max_pages(const cache_config& cfg) {
  return (cfg.max_tokens + cfg.shape.page_tokens - 1) / cfg.shape.page_tokens;
}
/// Bytes of the CUDA codebook level table: `cache_state::levels` on the device.
inline uint64_t cuda_levels_bytes(const cache_config& cfg) {
  return uint64_t(cfg.shape.layers) * uint64_t(cfg.shape.kv_heads) * 2 * codebook_table_floats * sizeof(float);
}
/// Bytes of the CUDA value-check guard (`check_values`): a held flag and [layers][3] int32
/// records per sequence slot, and one fault record of 24 bytes.
inline uint64_t cuda_guard_bytes(const cache_config& cfg) {
  return cfg.check_values ? uint64_t(cfg.max_sequences) * (1 + uint64_t(cfg.shape.layers) * 12) + 24 : 0;
}
/// Bytes of the CUDA tables of a configuration: the page tables ([max_sequences][layers][max_pages]
/// uint32 block offsets and [...][kv_heads][2] format ids), the codebook level table and the
/// value-check guard.
inline uint64_t cuda_table_bytes(const cache_config& cfg) {
  const uint64_t rows = uint64_t(cfg.max_sequences) * uint64_t(cfg.shape.layers) * uint64_t(cuda_max_pages(cfg));
  return rows * (sizeof(uint32_t) + uint64_t(cfg.shape.kv_heads) * 2) + cuda_levels_bytes(cfg) +
         cuda_guard_bytes(cfg);
}

/// The CPU reference backend, or an `out_of_budget` status when its arena cannot be allocated.
result<std::unique_ptr<cache_backend>> make_cpu_backend(const cache_state& st);
/// The CUDA backend, or an `unsupported` status when kvq was built without CUDA.
result<std::unique_ptr<cache_backend>> make_cuda_backend(const cache_state& st);

}  // namespace detail
KVQ_NAMESPACE_END
