#pragma once
/// \file
/// The sequence blob: quantized sequences moved out of a cache and back, bit for bit
/// (`KVCache::export_sequences`, `import_sequences`, docs/architecture.md "Moving sequences").
///
/// A blob holds one or more sequences of one cache: their page blocks as the arena holds them
/// (each page's scales, zeros, codebook levels and tensor scale inside it), their FP16 windows,
/// and everything needed to read them: the shape, each page's format (by name), the rotation
/// (seed and rotated heads), the sink pages, and the cache's encoder parameters (rolealign clip
/// percentiles, the codebook levels of the codebook formats present), which later pages of the
/// sequence would be encoded with. A page block listed by several of its sequences (a fork) is
/// stored once and shared again after import.
///
/// Layout, version 3, little-endian (version 2 is the same without the sliding windows and the
/// released counts: every layer global; version 1 as 2, its clip floats rolealign's former clip
/// ratios in (0, 1]: they read as percentile 100, no clipping):
///
///     header (48 bytes)
///       0  magic "KVQSEQ\r\n"
///       8  u32 version (3)              12 u32 flags (0)
///      16  u64 meta bytes               24 u64 payload bytes
///      32  u32 CRC-32C of the meta      36 u32 CRC-32C of the payload
///      40  u32 block unit (256)         44 u32 CRC-32C of bytes 0..43
///     meta
///       i32 layers, q_heads, kv_heads, head_dim, page_tokens, window, recent, sink_pages
///       u64 rotation seed, u8 rotated [layers][kv_heads]
///       i32 sliding window [layers] (0: a global layer)
///       u32 formats; per format: u8 name length, name (`format_name`), u32 K page bytes, u32 V page bytes
///       f32 clip percentiles [layers][kv_heads][2]
///       u32 level tables; per table: u8 format index, f32 levels [layers][kv_heads][2][2^bits]
///       u32 blocks; per block: u8 format index [kv_heads][2] (K, V)
///       u32 sequences; per sequence: i64 id, i32 lanes, per layer: i64 n, e, ring_from, released
///           and u32 block index per page (e / page_tokens pages; 0xffffffff for the pages a
///           sliding layer released, tokens [0, released))
///     payload
///       the blocks in order, each its pages back to back ([kv_heads][K, V]), padded with zeros
///       to a multiple of the block unit; then per sequence its window: [layers][kv_heads][K, V]
///       [lanes x page_tokens slots][head_dim] fp16, token j in slot j % window, slots that hold
///       no token of [ring_from, n) zero.
///
/// The reader (`inspect_blob`) checks the header, the three checksums, every count and index
/// against the sizes, each format's name and page sizes against this build's layouts, and each
/// layer's lengths (0 <= ring_from <= e <= n, e a whole number of pages, n - ring_from <= window,
/// the window's lanes enough for n); any failure is an error naming the first problem.

#include <kvq/config.hpp>
#include <kvq/core.hpp>
#include <kvq/format/format.hpp>
#include <kvq/rotation/rotation.hpp>
#include <kvq/status.hpp>

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

KVQ_NAMESPACE_BEGIN

/// The blob format this build writes and the newest it reads.
inline constexpr uint32_t blob_version = 3;
/// Bytes of the header before the meta section.
inline constexpr uint64_t blob_header_bytes = 48;

/// One page block: the pages of one (sequence, layer, page index) for every kv head and role.
struct blob_block {
  std::vector<format_id> formats;  ///< [kv_heads][2] (K, V), this build's ids
  uint64_t at = 0;                 ///< its offset in the payload
  uint64_t bytes = 0;              ///< its pages' bytes (the payload holds it padded to the block unit)
};

/// The block index of a page a sliding layer released (`layer_state::released`): no block.
inline constexpr uint32_t blob_released_block = ~uint32_t(0);

/// One layer of a sequence.
struct blob_layer {
  int64_t n = 0;          ///< tokens
  int64_t e = 0;          ///< tokens encoded into pages
  int64_t ring_from = 0;  ///< first token the FP16 window holds
  int64_t released = 0;   ///< tokens whose pages a sliding layer released (their blocks: blob_released_block)
  std::vector<uint32_t> blocks;  ///< [e / page_tokens] block index per page
};

struct blob_sequence {
  int64_t id = 0;  ///< its id in the cache it was exported from
  int lanes = 1;   ///< window lanes (page_tokens slots each)
  std::vector<blob_layer> layers;
  uint64_t window_at = 0;     ///< payload offset of its window
  uint64_t window_bytes = 0;  ///< layers x kv_heads x 2 x lanes x page_tokens x head_dim x 2
};

/// What a blob holds (`inspect_blob`), and the plan `export_sequences` writes.
struct KVQ_EXPORT blob_info {
  uint32_t version = blob_version;
  cache_shape shape;
  int sink_pages = 0;
  rotation_config rotation;  ///< `heads` always [layers][kv_heads]
  std::vector<int32_t> windows;  ///< [layers] sliding window of each layer, 0: global
  std::vector<float> clip;   ///< [layers][kv_heads][2]
  /// The codebook formats present and their levels, [layers][kv_heads][2][2^bits] each.
  std::vector<std::pair<format_id, std::vector<float>>> levels;
  std::vector<blob_block> blocks;
  std::vector<blob_sequence> sequences;
  uint64_t block_unit = 256;
  uint64_t meta_bytes = 0;
  uint64_t payload_bytes = 0;

  uint64_t payload_offset() const { return blob_header_bytes + meta_bytes; }
  uint64_t total_bytes() const { return payload_offset() + payload_bytes; }
  /// Payload bytes of the page blocks (padding included) and of the windows.
  uint64_t block_bytes() const;
  uint64_t window_bytes() const;
};

/// Reads and checks a blob (everything listed in the file comment); the payload is checked by its
/// checksum only. Errors: `invalid_argument` naming the first problem (a truncated blob, a bad
/// magic, a checksum that does not match, a count or index out of range, an unknown format, a
/// newer version).
KVQ_EXPORT result<blob_info> inspect_blob(std::span<const uint8_t> blob);

/// CRC-32C (Castagnoli, reflected, as iSCSI and ext4 use it) of `bytes`, continuing from `crc`
/// (0 to start). SSE 4.2's crc32 instruction where the CPU has it, else a table.
KVQ_EXPORT uint32_t crc32c(std::span<const uint8_t> bytes, uint32_t crc = 0);

namespace detail {
// (Exported from a shared libkvq for the tests, which forge blobs with them.)
/// Lays out the payload of `info`: each block's offset and page bytes, each window's offset and
/// bytes, `payload_bytes`.
KVQ_EXPORT void lay_out_blob(blob_info& info);
/// Lays out the payload of `info` (`lay_out_blob`) and returns its meta section (`meta_bytes` set).
KVQ_EXPORT std::vector<uint8_t> plan_blob(blob_info& info);
/// Writes the header and the meta section into `blob` (at least `info.total_bytes()` bytes, the
/// payload already in place) and its checksums.
KVQ_EXPORT void seal_blob(const blob_info& info, std::span<const uint8_t> meta, std::span<uint8_t> blob);
}  // namespace detail

KVQ_NAMESPACE_END
