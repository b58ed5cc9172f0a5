#pragma once
// Host checks of the indices a low-level call writes or reads through (include/kvq/cuda/
// paged_attention.hpp, `paged_view`): each names the call, the item or page and the bound. Shared
// by the CUDA calls and their CPU counterparts over host memory (kvq/cpu_pool.hpp); not public API.
#include <algorithm>
#include <kvq/cuda/paged_attention.hpp>
#include <kvq/rotation/hadamard.hpp>
#include <kvq/store/window_layout.hpp>
#include <sstream>
#include <string>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

/// The pieces `a` written one after the other.
/// NOTE: fmt's compile-time format checks do not survive nvcc's host pass; messages in .cu files
/// are built with a stream.
template <class... A>
std::string msg(const A&... a) {
  std::ostringstream os;
  (os << ... << a);
  return os.str();
}

/// Bytes from the start of a sequence's window to the end of the last slot a sequence of `tokens`
/// tokens uses: [layers][kv_heads][2][window][head_dim] fp16 rings, of which it uses the first
/// min(tokens, window) slots (the rest of a short sequence's rings may belong to others).
inline uint64_t window_extent(const paged_view& kv, int64_t tokens) {
  const uint64_t ring = uint64_t(kv.window) * kv.head_dim * 2;
  const uint64_t used = uint64_t(std::min<int64_t>(std::max<int64_t>(tokens, 1), kv.window)) * kv.head_dim * 2;
  return (uint64_t(kv.layers) * kv.kv_heads * 2 - 1) * ring + used;
}

/// The view's table layout (`page_tables::shared`: the engine pool's strides and sizes; the kernels
/// address a layer's pool in 16-byte units of 32 bits, so at most 64 GiB a layer).
inline status check_tables(const paged_view& kv, const char* call) {
  if (kv.tables == page_tables::per_layer) return {};
  if (kv.tables != page_tables::shared) return {errc::invalid_argument, msg(call, ": unknown page_tables value")};
  if (kv.blocks == nullptr || kv.table_stride < kv.max_pages || kv.block_bytes == 0 || kv.block_bytes % block_unit != 0 ||
      kv.layer_blocks < 1 || (kv.layer_bytes != 0 && kv.layer_bytes < uint64_t(kv.layer_blocks) * kv.block_bytes) ||
      uint64_t(kv.layer_blocks) * kv.block_bytes > (uint64_t(1) << 36))
    return {errc::invalid_argument,
            msg(call, ": an engine pool (page_tables::shared) needs a block table, table_stride >= max_pages (",
                kv.table_stride, " < ", kv.max_pages, "?), block_bytes a nonzero multiple of 256 (", kv.block_bytes,
                "), layer_blocks >= 1 (", kv.layer_blocks, "), layer_bytes 0 or at least layer_blocks x block_bytes (",
                kv.layer_bytes, ") and a layer's pool of at most 64 GiB")};
  if (kv.arena_bytes > 0 &&
      (kv.layer_bytes == 0 ? uint64_t(kv.layer_blocks) * kv.block_bytes
                           : uint64_t(kv.layers - 1) * kv.layer_bytes + uint64_t(kv.layer_blocks) * kv.block_bytes) >
          kv.arena_bytes)
    return {errc::invalid_argument, msg(call, ": the engine pool's ", kv.layer_blocks, " blocks of ", kv.block_bytes,
                                        " bytes per layer end past the arena's ", kv.arena_bytes, " bytes")};
  return {};
}

/// Item `i`'s slot (page-table row) and window (256-byte units; `tokens` tokens held after the
/// call) lie inside the view.
inline status check_item_indices(const paged_view& kv, const char* call, size_t i, int slot, uint32_t window_unit,
                                 int64_t tokens) {
  if (slot < 0 || (kv.slots > 0 && slot >= kv.slots))
    return {errc::invalid_argument,
            msg(call, ": item ", i, " has slot ", slot, ", outside the page tables' slots [0, ", kv.slots, ")")};
  const uint64_t ring_bytes = kv.windows ? kv.windows_bytes : kv.arena_bytes;
  if (ring_bytes > 0 && uint64_t(window_unit) * block_unit + window_extent(kv, tokens) > ring_bytes)
    return {errc::invalid_argument, msg(call, ": item ", i, " (slot ", slot, ") has its window at unit ", window_unit,
                                        " (byte ", uint64_t(window_unit) * block_unit, "), whose rings of ", tokens,
                                        " tokens end past the ", kv.windows ? "windows' " : "arena's ", ring_bytes,
                                        " bytes")};
  return {};
}

/// New page `i` (block offset `unit` in 256-byte units, `bytes` long; shared tables: block id `unit`
/// of a pool) lies inside the arena (the pool, and its pages inside the block).
inline status check_page_block(const paged_view& kv, const char* call, int i, uint32_t unit, uint64_t bytes) {
  if (kv.tables == page_tables::shared) {
    if (int64_t(unit) >= kv.layer_blocks)
      return {errc::invalid_argument,
              msg(call, ": new page ", i, " has block id ", int32_t(unit), ", outside the pool's [0, ", kv.layer_blocks, ")")};
    if (block_header_bytes(kv.kv_heads) + bytes > kv.block_bytes)
      return {errc::invalid_argument,
              msg(call, ": new page ", i, "'s formats take ", bytes, " bytes and its header ",
                  block_header_bytes(kv.kv_heads), ", more than the pool's blocks of ", kv.block_bytes)};
    return {};
  }
  if (kv.arena_bytes > 0 && uint64_t(unit) * block_unit + bytes > kv.arena_bytes)
    return {errc::invalid_argument,
            msg(call, ": new page ", i, " has its block at unit ", unit, " (byte ", uint64_t(unit) * block_unit,
                "), whose ", bytes, " bytes end past the arena's ", kv.arena_bytes)};
  return {};
}

/// A call's attention rule (`variant_args`): window and softcap in range (the sink logits are read
/// by the kernels; the CPU calls check their values too).
inline status check_variant_args(const variant_args& v, const char* call) {
  if (v.window < 0) return {errc::invalid_argument, msg(call, ": sliding window ", v.window, " is negative")};
  if (!(v.softcap >= 0.f) || !(v.softcap < INFINITY))
    return {errc::invalid_argument, msg(call, ": softcap ", v.softcap, " must be finite and >= 0")};
  return {};
}

/// The batch of an attention call (`attend_can_implement`, `cpu::pool_attend`): sink pages,
/// rotation mask, tables, and each item's lengths and indices.
inline status check_attend_items(const attend_args& a) {
  const auto& kv = a.kv;
  if (a.items.empty()) return {errc::invalid_argument, "attend: empty batch"};
  if (a.sink_pages < 0 || a.sink_pages > kv.max_pages)
    return {errc::invalid_argument, msg("attend: sink_pages ", a.sink_pages, " outside [0, max_pages ", kv.max_pages, "]")};
  if (kv.kv_heads < 32 && (a.rotation.mask >> kv.kv_heads) != 0)
    return {errc::invalid_argument, msg("attend: rotation mask ", a.rotation.mask, " names kv heads beyond the layer's ",
                                        kv.kv_heads)};
  KVQ_TRY(check_tables(kv, "attend"));
  KVQ_TRY(check_variant_args(a.variant, "attend"));
  for (size_t i = 0; i < a.items.size(); ++i) {
    const decode_item& it = a.items[i];
    if (it.q_len < 1 || it.q_len > it.n || it.from_pages < 0 || it.from_pages > it.n - it.q_len ||
        it.n - it.from_pages > kv.window)
      return {errc::invalid_argument, msg("attend: inconsistent item (slot ", it.slot, ", q_len ", it.q_len, ", n ", it.n,
                                          ", from_pages ", it.from_pages, "), item ", i, " of the batch")};
    if (int64_t(it.from_pages) > int64_t(kv.max_pages) * kv.page_tokens)
      return {errc::invalid_argument, msg("attend: item ", i, " (slot ", it.slot, ") reads ", it.from_pages,
                                          " tokens from pages, past the page tables' ", kv.max_pages, " pages of ",
                                          kv.page_tokens, " tokens")};
    if (it.q_row < 0) return {errc::invalid_argument, msg("attend: item ", i, " has q_row ", it.q_row)};
    KVQ_TRY(check_item_indices(kv, "attend", i, it.slot, it.window_unit, it.n));
  }
  return {};
}

/// The lengths, chunk and indices of a prefill call (`prefill_can_implement`, `cpu::pool_prefill`).
inline status check_prefill_range(const prefill_args& a) {
  const paged_view& kv = a.kv;
  KVQ_TRY(check_variant_args(a.variant, "prefill"));
  if (a.queries < 1 || a.queries > INT32_MAX / 16)
    return {errc::invalid_argument, msg("prefill: ", a.queries, " queries; need 1 to ", INT32_MAX / 16)};
  if (a.prefix < 0 || a.from_pages < 0 || a.from_pages > a.prefix || a.prefix - a.from_pages > kv.window)
    return {errc::invalid_argument, msg("prefill: inconsistent prefix (", a.prefix, " tokens, ", a.from_pages,
                                        " from pages, window ", kv.window, ")")};
  if (int64_t(a.from_pages) > int64_t(kv.max_pages) * kv.page_tokens)
    return {errc::invalid_argument, msg("prefill: ", a.from_pages, " tokens from pages, past the page tables' ",
                                        kv.max_pages, " pages of ", kv.page_tokens, " tokens")};
  if (a.k.data && (a.k.tokens != a.queries || a.v.tokens != a.queries || a.k.heads != kv.kv_heads ||
                   a.v.heads != kv.kv_heads || a.k.head_dim != kv.head_dim || a.v.head_dim != kv.head_dim || !a.v.data))
    return {errc::invalid_argument,
            msg("prefill: the chunk's K/V are not [", a.queries, "][", kv.kv_heads, "][", kv.head_dim, "]")};
  if (kv.kv_heads < 32 && (a.rotation.mask >> kv.kv_heads) != 0)
    return {errc::invalid_argument,
            msg("prefill: rotation mask ", a.rotation.mask, " names kv heads beyond the layer's ", kv.kv_heads)};
  KVQ_TRY(check_tables(kv, "prefill"));
  return check_item_indices(kv, "prefill", 0, a.slot, a.window_unit, a.prefix);
}

/// The checks of an append call (`append_run`, and `cpu::pool_append`): the items' indices, page
/// count, rows (`check_rows`: the items' m sum to K's and V's tokens), rotation, formats (`reads`:
/// the formats the caller's attention reads, `cuda::kernels_read`; nullptr: every format) and new
/// blocks. `pages`: its new pages; `max_m`: its longest item.
inline status check_append(const append_args& a, bool check_rows, bool (*reads)(format_id), int& pages, int& max_m) {
  const auto& kv = a.kv;
  if (a.items.size() > size_t(max_append_items))
    return {errc::invalid_argument,
            msg("append: ", a.items.size(), " sequences in one call, at most ", max_append_items)};
  if (a.layer < 0 || a.layer >= kv.layers)
    return {errc::invalid_argument, msg("append: layer ", a.layer, " outside [0, ", kv.layers, ")")};
  KVQ_TRY(detail::check_tables(kv, "append"));
  int rows = 0;
  pages = 0;
  max_m = 0;
  for (size_t i = 0; i < a.items.size(); ++i) {
    const append_seq& it = a.items[i];
    // Indices the kernels write through: checked here, since a bad one writes outside the tables.
    if (it.slot < 0 || it.m < 1 || it.n < 0 || it.e < 0 || it.e > it.n || it.e % kv.page_tokens != 0 || it.pages < 0 ||
        it.first_page != it.e / kv.page_tokens || it.first_page + it.pages > kv.max_pages ||
        int64_t(it.e) + int64_t(it.pages) * kv.page_tokens > int64_t(it.n) + it.m)
      return {errc::invalid_argument,
              msg("append: item ", i, " (slot ", it.slot, ", n ", it.n, ", e ", it.e, ", m ", it.m, ", first_page ",
                  it.first_page, ", pages ", it.pages, ") is inconsistent: need slot >= 0, m >= 1, 0 <= e <= n, e a ",
                  "multiple of page_tokens ", kv.page_tokens, ", first_page = e / page_tokens, first_page + pages <= ",
                  "max_pages ", kv.max_pages, " and the new pages within the n + m tokens")};
    KVQ_TRY(detail::check_item_indices(kv, "append", i, it.slot, it.window_unit, int64_t(it.n) + it.m));
    pages += it.pages, rows += it.m, max_m = std::max(max_m, int(it.m));
  }
  if (pages > max_append_pages)
    return {errc::invalid_argument, msg("append: ", pages, " new pages in one call, at most ", max_append_pages)};
  if (check_rows && (rows != a.k.tokens || rows != a.v.tokens))
    return {errc::invalid_argument,
            msg("append: the items append ", rows, " tokens, K has ", a.k.tokens, " and V ", a.v.tokens)};
  if (a.rotation.mask != 0 && (!rotation::is_power_of_two(kv.head_dim) || kv.head_dim < 32 || kv.head_dim > 256 ||
                               (kv.kv_heads < 32 && (a.rotation.mask >> kv.kv_heads) != 0)))
    return {errc::invalid_argument,
            msg("append: rotation (mask ", a.rotation.mask, ") needs head_dim a power of two in [32, ",
                "256] (got head_dim ", kv.head_dim, ") and names only the layer's ", kv.kv_heads, " kv heads")};
  for (int i = 0; i < pages * kv.kv_heads * 2; ++i) {
    if (a.page_fmts[i] >= format_count || (i % 2 == 0 ? kv.k_page_bytes : kv.v_page_bytes)[a.page_fmts[i]] == 0)
      return {errc::invalid_argument, msg("append: new page ", i / (kv.kv_heads * 2), " has format id ",
                                          int(a.page_fmts[i]), ", which the paged view cannot store")};
    if (reads && !reads(a.page_fmts[i]))
      return {errc::unsupported, msg("append: format ", format_name(a.page_fmts[i]),
                                     " is not read by the CUDA attention kernels (the CPU backend reads it)")};
  }
  for (int i = 0; i < pages; ++i) {
    uint64_t bytes = 0;
    for (int j = 0; j < kv.kv_heads * 2; ++j)
      bytes += (j % 2 == 0 ? kv.k_page_bytes : kv.v_page_bytes)[a.page_fmts[i * kv.kv_heads * 2 + j]];
    KVQ_TRY(detail::check_page_block(kv, "append", i, a.page_blocks[i], bytes));
  }
  if (pages > 0 && kv.tables == page_tables::per_layer && (a.blocks == nullptr || a.fmts == nullptr))
    return {errc::invalid_argument, "append: new pages in per_layer page tables need writable `blocks` and `fmts`"};
  return {};
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
