#pragma once
/// \file
/// Host-side bookkeeping of the paged store, shared by every backend: the byte budget, the
/// sequences, their per-(layer, kv head, role) page lists and the recent-window placement. It
/// knows offsets and formats, never bytes: the backend owns the memory (host or device) the
/// offsets point into.
///
/// Window layout of one sequence: [layers][kv_heads][2 roles][window][head_dim] fp16 from its
/// `window_offset`; token j in slot j % window.
///
/// Windows grow with the sequence. A *ring block* of that layout (`window_block_bytes`) is cut
/// into window / page_tokens *lanes* of page_tokens slots: lane i starts i * page_tokens slots
/// into every ring of the block. A sequence holds a run of lanes, whose first lane gives its
/// `window_offset`; with k lanes it can hold k * page_tokens tokens before its slots wrap, which
/// only a sequence of every lane does (k = window / page_tokens). Every address is the layout's
/// own (slot j % window of ring (layer, kv head, role)), so the rings of several short
/// sequences interleave in one block and the backends and kernels read them unchanged. A new
/// sequence takes one lane; an append that needs more takes the lanes after its run when they are
/// free, else moves the sequence to a free run elsewhere (a new block if none: the backend copies
/// the rings). A block's bytes return to the budget when its last lane does.
/// Page list of (layer): entry (page i, kv head h, role r) at index (i*kv_heads + h)*2 + r.
/// The pages of one page index (all kv heads and roles) share one arena block, back to back in
/// that order; the first entry's offset is the block's.
///
/// Sharing: a page block may be listed by several sequences (`fork`). The store counts the
/// sequences that list each block and frees the block's bytes when the last one drops it. Pages
/// are written once, when full, and never change, so sharing needs no copy-on-write of page bytes.

#include <kvq/cache/sequence_blob.hpp>
#include <kvq/config.hpp>
#include <kvq/format/format.hpp>
#include <kvq/core.hpp>
#include <kvq/status.hpp>
#include <kvq/store/arena.hpp>

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

KVQ_NAMESPACE_BEGIN

/// One page: where its bytes start in the arena and its format.
struct page_entry {
  uint64_t offset;
  format_id fmt;
};

/// The offset of a page a sliding layer returned to the budget (`layer_state::released`).
inline constexpr uint64_t released_page = ~uint64_t(0);

/// Per (sequence, layer): tokens appended (n), tokens encoded into pages (e), the pages, and the
/// first token the FP16 ring still holds.
struct layer_state {
  int64_t n = 0;
  int64_t e = 0;
  /// Tokens [ring_from, n) are in their ring slots (j % window): max(0, n - window) after
  /// appends; a truncation can leave it higher (slots of older tokens that dropped tokens
  /// overwrote) or lower (tokens written back). Always <= e.
  int64_t ring_from = 0;
  /// Tokens [0, released) of a sliding layer whose pages went back to the budget because no later
  /// query's window reaches them (`page_store::release_before`): a whole number of pages, <= e.
  /// Their entries stay in `pages` with offset `released_page`. 0 in a global layer.
  int64_t released = 0;
  std::vector<page_entry> pages;  ///< [page][kv_head][role]
};

struct sequence_state {
  seq_id id = 0;
  uint64_t window_offset = 0;  ///< its rings: ring_block + ring_lane lanes
  uint64_t ring_block = 0;     ///< the ring block holding its lanes
  int ring_lane = 0;           ///< its first lane
  int ring_lanes = 0;          ///< its lanes: it holds up to ring_lanes * page_tokens tokens
  int slot = 0;  ///< dense index (0 .. max_sequences-1), for device tables
  std::vector<layer_state> layers;
};

/// A run of lanes of one ring block.
struct lane_run {
  uint64_t block = 0;
  int lane = 0;
  int lanes = 0;  ///< 0: none
};

/// Pages an append will create, allocated up front (all or nothing), and the lanes its window
/// grows by.
struct append_plan {
  int64_t first_page = 0;  ///< index of the first new page in the layer's list
  int pages = 0;           ///< new pages per (kv head, role)
  std::vector<page_entry> entries;  ///< [pages][kv_heads][2]
  /// Lanes taken for the window: after the sequence's own run (it grows in place) or, when
  /// `moved`, a run elsewhere that replaces its run at commit (the backend copies its rings to
  /// `window_offset` first). None when the window holds the append.
  lane_run grown;
  bool moved = false;
  uint64_t window_offset = 0;  ///< the sequence's window_offset from commit on
};

class KVQ_EXPORT page_store {
 public:
  page_store() = default;
  page_store(const cache_shape& shape, uint64_t budget, int max_sequences);

  const cache_shape& shape() const { return shape_; }
  /// Bytes of one ring block: every lane, [layers][kv_heads][2][window][head_dim] fp16, and
  /// `ring_slack_slots` slots of slack after it (window_layout.hpp).
  uint64_t window_block_bytes() const;
  /// Lanes of a ring block: window / page_tokens.
  int lanes_per_block() const { return shape_.window / shape_.page_tokens; }
  /// Bytes from one lane to the next: page_tokens slots.
  uint64_t lane_bytes() const { return uint64_t(shape_.page_tokens) * shape_.head_dim * 2; }
  /// Lanes a sequence of `tokens` tokens needs: ceil(tokens / page_tokens), 1 to lanes_per_block.
  int lanes_for(int64_t tokens) const;
  /// Budget bytes that giving `s` (or, without it, a new sequence) room for `tokens` tokens would
  /// allocate now: a ring block when no free run of lanes serves it, else 0.
  uint64_t window_bytes_for(const sequence_state* s, int64_t tokens) const;
  /// Offset of the ring of (layer, kv head, role) inside the arena.
  uint64_t window_offset(const sequence_state& s, int layer, int kv_head, role r) const;

  result<sequence_state*> create(seq_id id);
  /// Releases the sequence's window block and drops its reference to each of its page blocks
  /// (a block shared with another sequence stays).
  status release(seq_id id);
  /// Creates `dst` listing every page of `src` (shared, reference-counted) with a window of its own
  /// of src's lanes (the caller copies the ring bytes). On failure (unknown `src`, existing `dst`,
  /// no slot, no budget for a ring block) nothing changed and the status names the problem.
  result<sequence_state*> fork(seq_id src, seq_id dst);
  /// Creates sequence `ids[i]` as `seqs[i]` of an image (an import, a swap-in): new page blocks
  /// for `blocks` (a block several of the sequences list is shared by them, reference-counted),
  /// each sequence's lanes and slot, its lengths and page lists. All or nothing: on failure (an
  /// existing or repeated id, no slot, no budget) nothing changed and the status names the
  /// problem. Returns the arena offset of each block; the caller writes the bytes.
  result<std::vector<uint64_t>> place(std::span<const blob_block> blocks, std::span<const blob_sequence> seqs,
                                      std::span<const seq_id> ids, const std::string& call);
  /// Budget bytes `place` of one sequence would allocate now: its blocks and, unless a free run of
  /// its lanes exists, a ring block.
  uint64_t place_bytes(std::span<const blob_block> blocks, const blob_sequence& seq) const;
  /// Every layer of `s` keeps its first `length` tokens (the caller checked length <= n of each
  /// layer) and its first `kept_encoded(layer, length)` tokens encoded: the later pages are
  /// dropped (a page another sequence lists stays for it) and their kept tokens are unencoded
  /// again (the caller put them in the ring first).
  void truncate(sequence_state& s, int64_t length);
  /// Returns the pages of (s, layer) whose tokens all lie before `token` (and are encoded) to the
  /// budget, a page another sequence lists staying for it: what a sliding layer no longer needs.
  /// Their entries stay listed as `released_page`; `released` moves up.
  void release_before(sequence_state& s, int layer, int64_t token);
  /// Budget bytes `release_before(s, layer, token)` would return now (pages no other sequence lists).
  uint64_t release_bytes(const sequence_state& s, int layer, int64_t token) const;
  /// Makes one layer of `s` what the device holds after appends it refused (KVCache::check): the
  /// layer's state before its first refused append was (n, e, ring_from); a truncation since then
  /// stands where it cut deeper. Keeps min(n, now) tokens and the pages below min(e, now)
  /// (listings of later pages are dropped: their bytes were never written), the ring from
  /// min(ring_from, now).
  void rewind(sequence_state& s, int layer, int64_t n, int64_t e, int64_t ring_from);
  /// Tokens a layer keeps encoded when cut to `length`: what appending the first `length` tokens
  /// would have encoded (floor((length - r) / P) pages), except that a page whose tokens the ring
  /// no longer holds (tokens before `ring_from`) stays, and never a page holding a dropped
  /// token. So a layer is left exactly as that direct append would leave it whenever the
  /// ring still holds the tokens it would keep unencoded; only a cut inside a page whose first
  /// tokens left the ring brings tokens back from codes (`restore_from`).
  int64_t kept_encoded(const layer_state& ls, int64_t length) const;
  /// End of the kept tokens that go back to the ring but that it no longer holds: tokens
  /// [kept_encoded, restore_from) of a layer cut to `length` must come back decoded from the page
  /// that holds them (none when restore_from <= kept_encoded).
  int64_t restore_from(const layer_state& ls, int64_t length) const;
  sequence_state* find(seq_id id);
  const sequence_state* find(seq_id id) const;
  const std::unordered_map<seq_id, sequence_state>& sequences() const { return seqs_; }

  /// Number of pages to encode when m tokens are appended to a layer holding n tokens of which
  /// e are encoded.
  int64_t pages_after(int64_t n, int64_t e, int64_t m) const;
  /// The largest m for which `pages_after(n, e, m)` is 0.
  int64_t tokens_before_encode(int64_t n, int64_t e) const;

  /// New pages per (kv head, role) that an append of m tokens to (s, layer) creates.
  int new_pages(const sequence_state& s, int layer, int64_t m) const {
    const layer_state& ls = s.layers[size_t(layer)];
    return int(pages_after(ls.n, ls.e, m));
  }

  /// Allocates the pages an append of m tokens to (s, layer) creates, in the formats the caller
  /// chose: `formats` is [new_pages(s, layer, m)][kv_heads][2 roles] (K then V). A wrong count or
  /// a format that cannot store this shape is `invalid_argument`, a full budget `out_of_budget`;
  /// on failure nothing is allocated and the status names the page.
  result<append_plan> plan_append(sequence_state& s, int layer, int64_t m, std::span<const format_id> formats);
  /// Returns the planned pages and lanes to the budget (the backend rejected the data).
  void abandon(append_plan&& plan);
  /// Records the planned pages, lanes and the new token count (after the backend wrote the bytes).
  void commit_append(sequence_state& s, int layer, int64_t m, append_plan&& plan);

  uint64_t page_bytes_of(format_id f, role r) const { return page_bytes_[r == role::k ? 0 : 1][f]; }
  const arena_allocator& arena() const { return arena_; }

  /// Budget bytes of one page block whose (kv head) pages take the formats `pairs` [kv_heads],
  /// as the arena allocates it.
  uint64_t block_bytes(std::span<const format_pair> pairs) const;

  /// Counters for `cache_stats` (page bytes by format, pages, elements). A shared page counts
  /// once; `shared_pages` counts the pages listed by more than one sequence and `shared_saved_bytes`
  /// the page bytes the extra listings would take if each sequence held its own copy.
  struct counters {
    uint64_t page_bytes = 0, pages = 0, window_bytes = 0, encoded_elements = 0;
    uint64_t shared_pages = 0, shared_saved_bytes = 0;
    int64_t tokens = 0;
    std::array<uint64_t, format_count> bytes_by_format{}, pages_by_format{};
  };
  const counters& totals() const { return totals_; }

 private:
  void account(const page_entry& p, role r, int sign);
  // A free run of `lanes` lanes: the first that fits, by block offset, or a new block (nothing
  // when the budget has no room for one).
  std::optional<lane_run> take_lanes(int lanes);
  // Marks a run free; a block whose lanes are all free goes back to the budget.
  void give_lanes(const lane_run& run);
  // The first free run of `lanes` lanes in the existing blocks, if any.
  std::optional<lane_run> free_run(int lanes) const;
  // True when lanes [lane, lane + count) of `block` are free and inside it.
  bool lanes_free(uint64_t block, int lane, int count) const;
  result<sequence_state*> add_sequence(seq_id id, const std::string& call, int lanes);
  // A sequence's state on the lanes `run` (taken) and a free slot (taken), every layer empty.
  sequence_state new_state(seq_id id, const lane_run& run);
  // Index in ls.pages of the first page that was not released.
  size_t live_entry(const layer_state& ls) const {
    return size_t(ls.released / shape_.page_tokens) * size_t(shape_.kv_heads) * 2;
  }
  // Layout bytes of the page block whose first entry is ls.pages[first].
  uint64_t listed_bytes(const layer_state& ls, size_t first) const;
  // One more / one fewer sequence lists the page block at ls.pages[first]; the first listing
  // accounts its pages, dropping the last frees its bytes.
  void ref_block(const layer_state& ls, size_t first);
  void unref_block(const layer_state& ls, size_t first);

  cache_shape shape_;
  arena_allocator arena_;
  int max_sequences_ = 0;
  std::unordered_map<seq_id, sequence_state> seqs_;
  std::vector<int> free_slots_;
  std::unordered_map<uint64_t, uint32_t> refs_;  // page block offset -> sequences listing it
  std::map<uint64_t, std::vector<uint8_t>> ring_blocks_;  // ring block offset -> [lanes] 1 where taken
  std::array<std::array<uint64_t, format_count>, 2> page_bytes_{};
  counters totals_;
};

KVQ_NAMESPACE_END
