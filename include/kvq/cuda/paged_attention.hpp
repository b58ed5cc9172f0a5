#pragma once
/// \file
/// Low-level CUDA entry points for engines that own their memory (CUTLASS-style
/// `can_implement` -> `workspace_bytes` -> `run`). `KVCache` with `backend::cuda` is built on
/// these; an engine may call them directly over its own arena and page tables, laid out as below.
/// Host-compilable: streams are passed as `void*` (a `cudaStream_t`).
///
/// Device memory: page blocks, page tables and FP16 windows, in one of two table layouts
/// (`paged_view::tables`). A *page block* holds the pages of one (sequence, layer, page index) for
/// every (kv head, role), back to back in the order (h0 K, h0 V, h1 K, ...), each page laid out as
/// in format/format.hpp (its scales, zeros, codebook levels and tensor scale inside the page).
/// - `page_tables::per_layer` (kvq's own, what `KVCache` uses): `arena` holds page blocks of any
///   size at multiples of 256 bytes; `blocks` [slots][layers][max_pages] uint32 block offsets in
///   256-byte units; `fmts` [slots][layers][max_pages][kv_heads][2] format ids.
/// - `page_tables::shared` (an engine's pool): `arena` holds each layer's pool of `layer_blocks`
///   blocks of `block_bytes` bytes (layer l's at `arena + l * layer_bytes`; an engine that gives
///   each layer its own buffer passes that layer's as `arena` with `layer_bytes` 0); `blocks` is the
///   engine's int32 block table [slots][table_stride] of block ids, one row per sequence, shared by
///   every layer (as vLLM's and FlashInfer's). A block begins with a header of
///   `block_header_bytes(kv_heads)` bytes holding its format ids [kv_heads][2] (written by
///   `append_run`), its pages follow: a block is self-describing, so copying or swapping it by id
///   moves its formats along; `fmts` is unused. `pool_block_bytes` gives the block size that holds
///   any of a set of candidate formats (`pool_block_bytes_per_head`: a mix fixed per head). The engine writes its table; the kernels only read it.
/// - windows: per sequence, [layers][kv_heads][2][window][head_dim] fp16 rings at
///   `window_unit * 256` bytes from `windows` (null: from `arena`); token j lives in slot j %
///   window (`window_block_bytes`). A sequence of n < window tokens uses
///   only slots [0, n) of each ring, so the rings of short sequences may interleave in one block
///   (`KVCache` places them in lanes of page_tokens slots: include/kvq/store/store.hpp). The
///   decode kernels read the ring in 16-token slabs and may read up to 15 slots past the last
///   token (values they select away): such a window needs `ring_slack_slots` slots of memory
///   after its last ring (kvq/store/window_layout.hpp).
/// The FP16 window holds a sequence's newest tokens (the last `window`, of which at least the
/// unencoded ones); a page is encoded when page_tokens + recent tokens are unencoded (the caller
/// decides: `KVCache`'s rule is `pages_to_encode`, kvq/store/window_layout.hpp). Sink pages are ordinary pages in FP16.
///
/// Supported: head_dim 64, 128 or 256, page_tokens a power of two of at least 64 (64 and 128 tested),
/// q_heads / kv_heads <= 16, any mix of formats per page. Launches take the caller's stream,
/// allocate nothing and never synchronize, so they can be captured in a CUDA graph (batch
/// descriptors travel as kernel parameters).

#include <array>
#include <cstddef>
#include <cstdint>
#include <kvq/attention/variant.hpp>
#include <kvq/config.hpp>
#include <kvq/format/format.hpp>
#include <kvq/store/window_layout.hpp>
#include <kvq/status.hpp>
#include <kvq/tensor.hpp>
#include <span>
#include <string>

KVQ_NAMESPACE_BEGIN
namespace cuda {

/// How a `paged_view`'s tables address a page block (see the file comment).
enum class page_tables : uint8_t {
  per_layer,  ///< kvq's: `blocks` [slots][layers][max_pages] 256-byte offsets, `fmts` beside them
  shared,     ///< an engine's: int32 block ids [slots][table_stride] shared by every layer, formats in the block
};

/// Bytes at the start of a `page_tables::shared` block: its format ids [kv_heads][2], padded to
/// 16 bytes (the pages after it stay 16-byte aligned).
KVQ_HOST_DEVICE constexpr uint32_t block_header_bytes(int kv_heads) { return (uint32_t(kv_heads) * 2 + 15) / 16 * 16; }

/// Non-owning view of a paged store in device memory (see file comment). Every call checks the
/// indices it is given on the host before launching: page counts against `max_pages`, and where
/// the view states its extents (`slots`, `arena_bytes`: the checked mode, which `KVCache` always
/// uses) slots, window blocks and new page blocks against them. The block offsets already stored
/// in the device tables are the caller's (they were checked when appended).
struct paged_view {
  const uint8_t* arena = nullptr;
  const uint32_t* blocks = nullptr;  ///< per_layer: [slots][layers][max_pages]; shared: [slots][table_stride] (int32 ids)
  const uint8_t* fmts = nullptr;     ///< per_layer: [slots][layers][max_pages][kv_heads][2]; shared: unused
  int layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int page_tokens = 0;
  int window = 0;
  int max_pages = 0;  ///< pages a sequence may hold (shared: at most `table_stride`)
  /// Rows of the page tables (sequence slots), for the index checks of every call: a slot outside
  /// [0, slots) is refused, naming the item. 0: unknown, slots unchecked.
  int slots = 0;
  /// Bytes of `arena`, for the index checks: a window block or (append) a new page block that
  /// does not lie inside the arena is refused, naming the item or page. 0: unknown, unchecked.
  uint64_t arena_bytes = 0;
  std::array<uint32_t, format_count> k_page_bytes{};  ///< page bytes of each format, role K
  std::array<uint32_t, format_count> v_page_bytes{};  ///< page bytes of each format, role V
  page_tables tables = page_tables::per_layer;
  /// The rings' base (null: `arena`), and its bytes for the index checks (0: unchecked; with
  /// `windows` null the rings are checked against `arena_bytes`).
  const uint8_t* windows = nullptr;
  uint64_t windows_bytes = 0;
  // page_tables::shared only:
  int64_t table_stride = 0;  ///< int32 elements between two rows of `blocks`
  uint32_t block_bytes = 0;  ///< bytes of a block, a multiple of 256
  int64_t layer_blocks = 0;  ///< blocks of each layer's pool: ids are read clamped to [0, layer_blocks)
  uint64_t layer_bytes = 0;  ///< bytes from layer l's pool to layer l + 1's (0: `arena` is the call's layer's pool)
};

/// Page bytes of every format in role `r` at this page shape, 0 where the format does not fit it:
/// what `paged_view::k_page_bytes` / `v_page_bytes` hold.
inline std::array<uint32_t, format_count> page_bytes(role r, int page_tokens, int head_dim) {
  std::array<uint32_t, format_count> b{};
  for (size_t f = 0; f < format_count; ++f)
    if (check_shape(format_id(f), r, page_tokens, head_dim).ok())
      b[f] = uint32_t(layout_of(format_table[f], r, page_tokens, head_dim).total());
  return b;
}

/// Where the page blocks of `layer` start (shared: that layer's pool).
KVQ_HOST_DEVICE const uint8_t* pages_base(const paged_view& kv, int layer) {
  return kv.tables == page_tables::shared ? kv.arena + uint64_t(layer) * kv.layer_bytes : kv.arena;
}
/// Where the FP16 rings are (`window_unit`s count from here).
KVQ_HOST_DEVICE const uint8_t* rings_base(const paged_view& kv) { return kv.windows ? kv.windows : kv.arena; }

/// Page `page` of (`slot`, `layer`): the offset of its block's first page from `pages_base` and
/// its format ids [kv_heads][2] (device memory: the kernels' lookup).
struct block_ref {
  uint64_t offset;
  const uint8_t* fmts;
};
KVQ_HOST_DEVICE block_ref locate_block(const paged_view& kv, int layer, int slot, int page) {
  if (kv.tables == page_tables::shared) {
    const uint32_t id = kv.blocks[uint64_t(slot) * uint64_t(kv.table_stride) + uint64_t(page)];
    // an id outside the pool (an engine's table is not checked on the host) reads its last block
    const uint64_t b = uint64_t(id < uint64_t(kv.layer_blocks) ? id : uint64_t(kv.layer_blocks) - 1) * kv.block_bytes;
    return {b + block_header_bytes(kv.kv_heads), kv.arena + uint64_t(layer) * kv.layer_bytes + b};
  }
  const uint64_t row = (uint64_t(slot) * kv.layers + uint64_t(layer)) * uint64_t(kv.max_pages) + uint64_t(page);
  return {uint64_t(kv.blocks[row]) * 256, kv.fmts + row * uint64_t(kv.kv_heads) * 2};
}

namespace detail {
/// The bytes of a shared block: the header and, per kv head h, the widest K and V pages of the pairs
/// `head_pairs(h)` it may hold, rounded up to 256; each pair checked against the page shape.
template <class HeadPairs>
result<uint32_t> block_bytes_of(int kv_heads, int head_dim, int page_tokens, HeadPairs head_pairs) {
  if (kv_heads < 1 || head_dim < 1 || page_tokens < 1)
    return status{errc::invalid_argument, "pool_block_bytes: kv_heads, head_dim and page_tokens >= 1"};
  uint64_t bytes = block_header_bytes(kv_heads);
  for (int h = 0; h < kv_heads; ++h) {
    const std::span<const format_pair> pairs = head_pairs(h);
    if (pairs.empty()) return status{errc::invalid_argument, "pool_block_bytes: a kv head without a format"};
    uint64_t k = 0, v = 0;
    for (const format_pair& c : pairs) {
      if (c.k >= format_count || c.v >= format_count)
        return status{errc::invalid_argument, "pool_block_bytes: a format id that is not a format"};
      for (const status& s : {check_shape(c.k, role::k, page_tokens, head_dim), check_shape(c.v, role::v, page_tokens, head_dim)})
        if (!s.ok()) return status{s.code(), "pool_block_bytes: " + std::string(s.message())};
      const uint64_t kb = layout_of(format_table[c.k], role::k, page_tokens, head_dim).total();
      const uint64_t vb = layout_of(format_table[c.v], role::v, page_tokens, head_dim).total();
      k = kb > k ? kb : k, v = vb > v ? vb : v;
    }
    bytes += k + v;
  }
  bytes = (bytes + 255) / 256 * 256;
  if (bytes > UINT32_MAX) return status{errc::invalid_argument, "pool_block_bytes: a block above 4 GiB"};
  return uint32_t(bytes);
}
}  // namespace detail

/// The size of a `page_tables::shared` block for pages of `page_tokens` tokens whose (kv head,
/// role) may take any of `candidates`, per head and over time: the header, then per kv head the
/// largest K page and the largest V page of the candidates, rounded up to 256 bytes. (One block
/// size per layer for formats that change over time costs memory against kvq's arena of blocks of
/// any size: docs/performance.md, "Engine pools of one block size".)
inline result<uint32_t> pool_block_bytes(int kv_heads, int head_dim, int page_tokens,
                                         std::span<const format_pair> candidates) {
  return detail::block_bytes_of(kv_heads, head_dim, page_tokens, [&](int) { return candidates; });
}
/// The size of a block whose kv head h always holds `heads[h]` (formats mixed per head, fixed):
/// the header and each head's own pages, rounded up to 256 bytes (no byte lost to the mix).
inline result<uint32_t> pool_block_bytes_per_head(int head_dim, int page_tokens, std::span<const format_pair> heads) {
  return detail::block_bytes_of(int(heads.size()), head_dim, page_tokens,
                                [&](int h) { return heads.subspan(size_t(h), 1); });
}

/// Bytes of one sequence's window block: its [layers][kv_heads][2][window][head_dim] fp16 rings and
/// the slack the decode kernels may read past them, rounded up to 256 (`window_unit`s count 256 bytes).
inline uint64_t window_block_bytes(int layers, int kv_heads, int head_dim, int window) {
  return (ring_block_bytes(layers, kv_heads, head_dim, window) + 255) / 256 * 256;
}

/// One sequence of an attention batch.
struct decode_item {
  int32_t slot;            ///< row of the page tables
  int32_t q_len;           ///< new queries (their tokens are the last q_len of the n)
  int32_t n;               ///< tokens held for the layer, the step's own included
  int32_t from_pages;      ///< tokens read from pages: min(encoded, n - q_len); the rest from the ring
  uint32_t window_unit;    ///< the sequence's window block, in 256-byte units
  int32_t q_row;           ///< first row of this item's queries in q and o
  int32_t stage_row = -1;  ///< >= 0: copy the item's query rows to this row of `attend_args::q_stage`
};

/// The rotated kv heads of one layer (docs/architecture.md, "Rotation"; rotation/hadamard.hpp):
/// bit h of `mask` set means kv head h's pages and ring hold K and V rotated by the randomized
/// Hadamard transform of (`seed`, layer, h). Needs head_dim a power of two (32 to 256) when
/// `mask` is not 0.
struct head_rotation {
  uint64_t seed = 0;
  uint32_t mask = 0;  ///< bit h: kv head h rotated (kv_heads <= 32)
};

/// Arguments of one attention call over one layer.
struct attend_args {
  paged_view kv;
  int layer = 0;
  int q_heads = 0;
  std::span<const decode_item> items;  ///< host memory; copied into the launch parameters
  const void* q = nullptr;             ///< device [rows][q_heads][head_dim]
  dtype q_type = dtype::f16;
  int64_t q_stride = 0;  ///< elements between rows (0: packed)
  void* o = nullptr;     ///< device [rows][q_heads][head_dim]
  dtype o_type = dtype::f16;
  int64_t o_stride = 0;
  float scale = 0.f;  ///< 0: 1/sqrt(head_dim)
  /// The layer's attention rule (sliding window, soft-capping, sink logits: attention/variant.hpp);
  /// plain by default.
  variant_args variant;
  int num_sms = 132;  ///< used to size the split across thread blocks
  /// Widest code width (bits) of any page of the layer, if the caller knows it: 16 (the default)
  /// is always correct; 8 or less lets decode stage pages in narrower stages (more stages in
  /// flight) and run the kernel instances that have no code for 16-bit pages. A 16-bit page under
  /// a smaller hint is still read correctly, slower. A page of a format read by element (3-bit:
  /// `cuda::read_by_element`) counts as 16 bits (`cuda::kernel_bits`, include/kvq/cuda/read_plan.hpp): only the
  /// decode kernels' 16-bit instances read it, so a layer that may hold one needs a hint of 16;
  /// except the 3-bit kinds (kivi3, sym3: `cuda::three_bit_kind`) under `three_bit_pages`.
  int max_page_bits = 16;
  /// True if the layer may hold pages of the 3-bit kinds (kivi and sym at 3 bits) and
  /// `max_page_bits` counts them as 3 bits (`cuda::three_bit_kernel_bits`): decode then reads them
  /// staged, beside the layer's other pages, in kernel instances whose per-page dispatch has code
  /// for them (kept apart from the other instances, where that code made layers without 3-bit
  /// pages 5-14 % slower): the block-staged kernel's and the per-warp staged kernel's Three
  /// instances. Implied by a hint of 3 (e.g. heads of 3-bit kind pairs: `cuda::head_kernel_bits`).
  bool three_bit_pages = false;
  /// True if the caller knows that every page of each kv head of the layer has one K format and
  /// one V format (the heads may differ: a static policy's layers, or EchoKV's until it moves
  /// one). 4- and 2-bit layers at page_tokens 64 and up then run a kernel that reads whole 64-token
  /// units per step (6-11 % faster on the H200 at 8-32 x 32K). Each thread block checks its pages: where they
  /// differ, the call is still correct, slower than without the hint (unless some are 3-bit pages
  /// counted as 3 bits: the whole-unit instance reads those only in blocks of one 3-bit pair).
  bool one_format_per_head = false;
  /// The first `sink_pages` pages of every item are attention-sink pages (KVCache's
  /// `cache_config::sink_pages`: FP16 where the layer's other pages are narrower). A decode call
  /// then gives them a thread block of their own per (item, kv head), so that every other block
  /// holds the layer's other pages only and keeps the kernel instance of `max_page_bits` and
  /// `one_format_per_head`, which describe those pages; 0 (the default): no such split.
  int sink_pages = 0;
  /// Optional, for a device canary that runs after the engine has reused `q` (EchoKV's): the
  /// launch also copies the query rows of every item with `stage_row >= 0` into `q_stage`
  /// ([rows][q_heads * head_dim] float, packed) from that row on. No extra launch: the split
  /// merge does it.
  float* q_stage = nullptr;
  /// The layer's rotated heads. q and o stay unrotated for the caller: the decode kernels rotate
  /// the queries of rotated heads in their prologue (a tile-kernel call rotates them into the
  /// workspace first, one small launch for the batch), the split merge rotates their output
  /// back, and the staged canary rows are the rotated queries.
  head_rotation rotation;
};

/// Checks that the arguments are supported; the message names what is not.
KVQ_EXPORT status attend_can_implement(const attend_args& a);

/// The attention kernel a call runs (see `attend_plan`).
enum class attend_kernel {
  tile,                 ///< more than 8 query rows per kv head (extend, large speculative steps)
  decode_staged,        ///< decode, page-heads that leave room for fewer than 3 page stages (8-bit at
                        ///< page_tokens 128 and up, 16-bit at head_dim 256 and page_tokens 128): per-warp
                        ///< stages of one 16-token slab
  decode_block_staged,  ///< decode: whole pages in 3-8 stages shared by a block
};
/// How `attend_run` runs a call, seen from the host (no device work): the kernel, its stages and
/// shared memory, and how each sequence splits across thread blocks. For engines that size or log
/// their launches, and for tests of the plan's rules. (A batch longer than the launch limit is run
/// in parts, each under this plan of the whole batch.)
struct attend_plan_info {
  attend_kernel kernel = attend_kernel::tile;
  int stages = 0;            ///< staged kernels: stages per warp (staged) or per block (block-staged)
  uint32_t stage_bytes = 0;  ///< staged kernels: bytes of one stage
  int smem_bytes = 0;        ///< staged kernels: dynamic shared memory per thread block
  int blocks_per_sm = 0;     ///< staged kernels: resident thread blocks per SM
  bool whole_units = false;  ///< block-staged kernel: the instance for `one_format_per_head` (64-token steps)
  bool rule_code = false;    ///< decode kernels: the instance with a sliding window's masks and soft-capping
  bool three_bit_dispatch = false;  ///< staged kernels: an instance whose per-page dispatch reads 3-bit pages
  int stage_bits = 0;        ///< staged kernels: the widest code width the stages hold (2, 3, 4, 8 or 16)
  int max_splits = 0;        ///< thread blocks per (sequence, kv head), at most
  int tokens_per_split = 0;  ///< tokens each of them reads, at most
};
/// The plan of a call with supported arguments (`attend_can_implement`), or why they are not.
KVQ_EXPORT result<attend_plan_info> attend_plan(const attend_args& a);
/// Device workspace the call needs (partial results of the split sequence).
KVQ_EXPORT size_t attend_workspace_bytes(const attend_args& a);
/// Runs decode/extend attention on `stream`; `workspace` holds `attend_workspace_bytes(a)`.
/// Two launches: the attention kernel, then the split merge, which on sm_90+ is a programmatic
/// dependent launch of the first (it starts during the attention's last wave and waits for its
/// grid before reading the workspace; in a captured graph this is a programmatic edge).
KVQ_EXPORT status attend_run(const attend_args& a, void* workspace, size_t workspace_bytes, void* stream);

/// One prefill (or prefix) attention call over one sequence and layer of a paged store: T
/// queries at positions n0 .. n0 + T - 1 see the first n0 stored tokens (`prefix`) unmasked, read
/// from their pages where encoded (`from_pages` of them) and else from the ring, and, where the
/// chunk's K/V are given, the chunk's tokens 0..i causally in fp16 (as the ring would hold them,
/// rotated on rotated heads), the two parts merged by log-sum-exp. A chunk of any length: an
/// engine appends it with `append_run` (which may encode prefix tokens into pages: pass the
/// `from_pages` of after the append) and then runs this, as `KVCache::prefill` does.
/// `prefill_can_implement` -> `prefill_workspace_bytes` -> `prefill_run`; the run allocates
/// nothing and never synchronizes.
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
  /// The layer's attention rule (attention/variant.hpp): query i stands at position prefix + i;
  /// plain by default.
  variant_args variant;
  int num_sms = 132;
  head_rotation rotation;
  /// False where no page of the layer holds a format other than FP16: the prefix kernel reads
  /// every page as it is, and the staging launch is skipped.
  bool quantized_pages = true;
};
/// Checks the arguments (shapes, indices, what the ring holds); the message names the problem.
KVQ_EXPORT status prefill_can_implement(const prefill_args& a);
/// Device workspace of a call: the partial results, the rotated queries (rotated heads), the
/// chunk's fp16 K/V (a prefill) and the staged fp16 images of a segment's page tiles (at most
/// 64 MiB). It does not depend on `from_pages`, so it can be sized before the chunk's append
/// decides how many tokens are encoded.
KVQ_EXPORT size_t prefill_workspace_bytes(const prefill_args& a);
/// Launches the call on `stream` (no synchronization, no allocation).
KVQ_EXPORT status prefill_run(const prefill_args& a, void* workspace, size_t workspace_bytes, void* stream);

/// New pages of one append call, over all its sequences.
inline constexpr int max_append_pages = 32;
/// Sequences of one append call.
inline constexpr int max_append_items = 128;

/// One sequence of an append call (one layer).
struct append_seq {
  int slot = 0;
  int32_t n = 0;             ///< tokens held before the append
  int32_t e = 0;             ///< tokens encoded before the append
  int32_t m = 0;             ///< tokens appended (its rows of k and v, in item order)
  uint32_t window_unit = 0;  ///< the sequence's window block, in 256-byte units
  int first_page = 0;        ///< page index of its first new page
  int pages = 0;             ///< its new pages (each spans every kv head and role)
  int32_t ring_from = 0;     ///< the first token its ring holds (`layer_state::ring_from`): recorded by a guard
  int64_t seq = 0;           ///< the caller's sequence id: named in a guard's fault record
};

/// A refused append's report (`append_guard::fault`), device memory written by the check kernel.
struct append_fault {
  int32_t count = 0;  ///< K/V rows refused since the record was cleared (a row counts once per role)
  int32_t layer = -1;
  int64_t seq = -1;    ///< `append_seq::seq` of the first refused row's sequence
  int64_t token = -1;  ///< its position in the sequence (n + its row within the item)
};

/// Value checks of an append on the device, without a synchronization (`KVCache`'s
/// `check_values`). Before the append's kernels, a check kernel looks at every row: a row with a
/// NaN, an Inf or a value beyond the fp16 range marks its sequence's slot *held* and fills
/// `fault` (the first such row). The append kernels then write nothing for a held slot, in this
/// call and every later one, until the caller clears it; for each (slot, layer) whose append was
/// skipped, the first skipped append's n, e and ring_from are recorded in `since`, so the caller
/// can restore its bookkeeping to what the device holds (KVCache::check). All device memory.
struct append_guard {
  uint8_t* held = nullptr;        ///< [slots] nonzero: writes to the slot are refused
  int32_t* since = nullptr;       ///< [slots][layers][3] n, e, ring_from of the first refused append; n = -1: none
  append_fault* fault = nullptr;  ///< the first refused row
  bool check = true;              ///< run the value check where `held` is set (false: only honour `held`)
};

/// Arguments of quantize-on-append for a batch of sequences of one layer: one launch of the page
/// encoder for every new page and one ring write for every sequence, whatever the batch size.
struct append_args {
  paged_view kv;
  uint8_t* arena = nullptr;    ///< writable alias of kv.arena
  uint8_t* windows = nullptr;  ///< writable alias of kv.windows (null: the rings are in `arena`)
  uint32_t* blocks = nullptr;  ///< per_layer: writable alias of kv.blocks (the encoder lists the new pages); shared: unused
  uint8_t* fmts = nullptr;     ///< per_layer: writable alias of kv.fmts; shared: unused (formats go in the block header)
  int layer = 0;
  std::span<const append_seq> items;      ///< host memory; at most max_append_items
  tensor_view k, v;                       ///< device [sum of m][kv_heads][head_dim], items in order
  /// Host [sum of pages], items in order: per_layer, the new blocks' offsets in 256-byte units;
  /// shared, the block ids the engine's table lists at the new pages (checked against
  /// `layer_blocks`; the table itself is the engine's to write).
  const uint32_t* page_blocks = nullptr;
  const uint8_t* page_fmts = nullptr;     ///< host [sum of pages][kv_heads][2]
  const float* clip = nullptr;            ///< host [kv_heads][2] rolealign clip percentiles of the layer
  /// Device [kv_heads][2][codec::codebook_format_count][codec::codebook_slot_floats]: the levels
  /// each codebook format of (kv head, role) encodes with (the first 2^bits of its slot); null:
  /// the Lloyd-Max levels. Read by the kernel, so it must outlive the launch (and a replay).
  const float* levels = nullptr;
  /// The layer's rotated heads: their K and V rows are rotated inside the append kernels before
  /// they are rounded to fp16, in the ring and in the pages alike (the bytes equal the CPU's).
  head_rotation rotation;
  /// Optional device-side value checks and held slots (null pointers: none).
  append_guard guard;
};

/// Writes each sequence's m tokens into its ring and encodes the new pages (at most
/// max_append_pages in all): bytes identical to the CPU codec.
KVQ_EXPORT status append_run(const append_args& a, void* stream);

/// The guard's value check of an append call (`append_guard`): marks held the slots of the items
/// with a NaN, Inf or out-of-range row, fills the fault record, and records `since` for every item
/// whose slot is held after the check. One launch; no synchronization. `append_run` runs it itself
/// when `a.guard.check`; a caller that splits one logical append into several `append_run`s
/// checks every part first (with `guard.check` off in the runs) so that no part is stored when
/// another is refused.
KVQ_EXPORT status check_append_values(const append_args& a, void* stream);

/// Clears the guard of `count` slots from `slot` on (not held, nothing recorded), on `stream`:
/// for a new sequence, or once a refusal was reported and the bookkeeping restored.
KVQ_EXPORT status clear_guard(const append_guard& g, int layers, int slot, int count, void* stream);
/// Copies slot `src`'s guard (held flag and records) to slot `dst` on `stream`: a fork of a held
/// sequence is held too.
KVQ_EXPORT status copy_guard(const append_guard& g, int layers, int src, int dst, void* stream);

/// Writes back into the FP16 ring the tokens a truncation keeps that its page holds but its ring
/// slots no longer do (KVCache::truncate; docs/architecture.md, "Truncation"): for each listed
/// layer, tokens [first, last) of one page (its page index first / page_tokens in the page
/// tables), decoded through the codec and rounded to fp16, as the CPU does, into every (kv head,
/// role) ring of the sequence. One launch per 128 layers; no synchronization. With a guard, a
/// held slot's pages at or past its recorded e (never written: their append was refused) are
/// skipped.
struct ring_restore {
  int layer;
  int32_t first, last;
};
struct restore_args {
  paged_view kv;
  uint8_t* arena = nullptr;    ///< writable alias of kv.arena
  uint8_t* windows = nullptr;  ///< writable alias of kv.windows (null: the rings are in `arena`)
  int slot = 0;
  uint32_t window_unit = 0;
  std::span<const ring_restore> layers;  ///< host memory
  append_guard guard;                    ///< held / since read; null: none
};
KVQ_EXPORT status restore_run(const restore_args& a, void* stream);

}  // namespace cuda
KVQ_NAMESPACE_END
