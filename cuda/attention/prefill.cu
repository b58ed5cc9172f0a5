// Launch glue of a prefix / prefill call (attention/prefill.hpp): the query rotation of rotated
// heads, the chunk's fp16 K/V and its causal part (attention/chunk_causal.cuh), the prefix part on
// the prefix kernel (attention/prefix_tile.cuh), its quantized page tiles dequantized first into
// the workspace, a segment of at most `prefill_stage_bytes` at a time (an item of at most 16 query
// rows: the tile kernel, attention/attend_tile.cuh, unmasked, dequantizing as it reads), then the
// split merge, which merges both parts by log-sum-exp and writes O and the log-sum-exps.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "attention/attend_launch.hpp"
#include "attention/chunk_causal.cuh"
#include "attention/prefill.hpp"
#include "attention/prefix_tile.cuh"
#include "attention/tile_launch.cuh"
#include "launch.hpp"
#include "status.hpp"
#include <kvq/detail/view_checks.hpp>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {
namespace {

// How a call splits: items of `prefill_item_queries` queries, launches of up to `max_items` items,
// the prefix's 64-token tiles over `prefix_splits` blocks per (item, kv head, row block), and the
// chunk's part (a prefill) as one more split. A row block is `prefill_block_rows` rows (the prefix
// kernel) when an item has more than 16 rows, else the tile kernel's one m-tile. The prefix
// kernel's splits run in segments of `segment_splits` splits, each after its page tiles' fp16
// images are staged (at most `prefill_stage_bytes`, so a split holds at most that many tiles).
struct prefill_plan {
  int items;         // ceil(T / prefill_item_queries)
  int launch_items;  // items of one launch, at most max_items
  int mtiles;        // 16-row m-tiles per item
  bool wide;         // the prefix kernel (prefill_block_rows a block), else the tile kernel (16)
  int row_blocks;    // blocks per (item, kv head) of the prefix part
  int prefix_tiles;  // 64-token tiles of the prefix the call reads: after `skip`
  int skip;          // a sliding layer: tiles before the window of the call's first query (`window_skip_units`)
  int tiles_per_split, prefix_splits, max_splits;
  int segment_splits;  // prefix-kernel splits per segment
  int stage_tiles;     // page tiles a segment stages at most (the staging buffer's tiles per kv head)
  int ws_stage_tiles;  // the same bound for any from_pages <= n0 (the workspace's)
  size_t parts;        // partials of one launch
  size_t ws_parts;     // partials the workspace holds: a bound that depends on n0, not on from_pages
};

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

prefill_plan plan_of(const prefill_args& a) {
  prefill_plan lp{};
  const int group = a.q_heads / a.kv.kv_heads;
  const int64_t per_item = std::min<int64_t>(a.queries, prefill_item_queries);
  lp.items = int((a.queries + prefill_item_queries - 1) / prefill_item_queries);
  lp.launch_items = std::min(lp.items, max_items);
  lp.mtiles = ceil_div(int(per_item) * group, 16);
  lp.wide = lp.mtiles > 1;
  lp.row_blocks = lp.wide ? ceil_div(lp.mtiles, prefill_block_rows(a.kv.head_dim) / 16) : lp.mtiles;
  lp.skip = window_skip_units(a.variant.window, a.prefix, a.from_pages, a.kv.page_tokens, tile_tokens);
  lp.prefix_tiles = ceil_div(a.from_pages, tile_tokens) + ceil_div(a.prefix - a.from_pages, tile_tokens) - lp.skip;
  // the tile kernel's rule (launch_plan.cpp): about four blocks per SM, at most max_split_tiles
  // tiles per block
  const int64_t base = int64_t(lp.launch_items) * a.kv.kv_heads * lp.row_blocks;
  // the staging buffer's tiles: one tile's images of every kv head, K and V
  const int64_t image_bytes = int64_t(a.kv.kv_heads) * 2 * tile_tokens * a.kv.head_dim * 2;
  const int cap_tiles = lp.wide
                            ? int(std::clamp<int64_t>(int64_t(prefill_stage_bytes) / image_bytes, 1, max_split_tiles))
                            : max_split_tiles;
  const auto splits_for = [&](int tiles) {  // non-decreasing in tiles
    const int64_t want = int64_t(a.num_sms) * 4;
    const int s = int(std::clamp<int64_t>((want + base - 1) / base, 1, std::max(1, tiles)));
    return std::max(s, ceil_div(tiles, cap_tiles));
  };
  const int splits = splits_for(lp.prefix_tiles);
  lp.tiles_per_split = std::max(1, ceil_div(lp.prefix_tiles, splits));  // <= cap_tiles
  lp.prefix_splits = ceil_div(lp.prefix_tiles, lp.tiles_per_split);  // <= splits
  lp.segment_splits = std::max(1, cap_tiles / lp.tiles_per_split);
  lp.stage_tiles =
      lp.wide ? std::min(ceil_div(a.from_pages, tile_tokens) - lp.skip, lp.segment_splits * lp.tiles_per_split) : 0;
  lp.ws_stage_tiles = lp.wide ? std::min(ceil_div(a.prefix, tile_tokens), cap_tiles) : 0;
  const int chunk = a.k.data ? 1 : 0;
  lp.max_splits = lp.prefix_splits + chunk;
  lp.parts = size_t(lp.launch_items) * a.kv.kv_heads * lp.mtiles * lp.max_splits;
  // any from_pages gives at most ceil(n0 / 64) + 1 tiles
  const int tiles_bound = ceil_div(a.prefix, tile_tokens) + (a.prefix > 0 ? 1 : 0);
  lp.ws_parts = size_t(lp.launch_items) * a.kv.kv_heads * lp.mtiles * (splits_for(tiles_bound) + chunk);
  return lp;
}

// Workspace: partials | rotated queries (rotated heads) | the chunk's fp16 K/V (a prefill) | the
// staged fp16 images of a segment's page tiles (the prefix kernel).
struct prefill_layout {
  size_t rotated_q, chunk_kv, staged, total;
};
prefill_layout layout_of(const prefill_args& a, const prefill_plan& lp) {
  prefill_layout l{};
  const size_t d = size_t(a.kv.head_dim);
  l.rotated_q = align256(lp.ws_parts * 16 * (d + 2) * sizeof(float));
  const size_t q_bytes = a.rotation.mask ? size_t(a.queries) * a.q_heads * d * sizeof(float) : 0;
  l.chunk_kv = align256(l.rotated_q + q_bytes);
  const size_t kv_bytes = a.k.data ? 2 * size_t(a.kv.kv_heads) * size_t(a.queries) * d * sizeof(__half) : 0;
  l.staged = align256(l.chunk_kv + kv_bytes);
  l.total = l.staged + size_t(a.kv.kv_heads) * lp.ws_stage_tiles * 2 * tile_tokens * d * sizeof(__half);
  return l;
}

template <int D>
status launch_prefill(const prefill_args& a, const prefill_plan& lp, const prefill_layout& ly, uint8_t* ws,
                      cudaStream_t st) {
  const int H = a.kv.kv_heads, group = a.q_heads / H;
  const float scale = a.scale > 0.f ? a.scale : 1.0f / std::sqrt(float(D));
  // Rotated heads: the queries rotated once into the workspace (both parts read them there).
  const void* q = a.q;
  dtype q_type = a.q_type;
  int64_t q_stride = a.q_stride ? a.q_stride : int64_t(a.q_heads) * D;
  if (a.rotation.mask) {
    float* qr = reinterpret_cast<float*>(ws + ly.rotated_q);
    KVQ_TRY(launch_rotate_query_d<D>(a.q, a.q_type, q_stride, int(a.queries), a.q_heads, group, a.layer, a.rotation,
                                     qr, st));
    q = qr, q_type = dtype::f32, q_stride = int64_t(a.q_heads) * D;
  }
  __half* ckv = reinterpret_cast<__half*>(ws + ly.chunk_kv);
  if (a.k.data) {
    const int warps = int(a.queries) * H * 2;
    KVQ_TRY(launch("prefill: chunk K/V launch", stage_chunk_kernel<D>, dim3(unsigned(ceil_div(warps, 4))), dim3(128), 0,
                   st, a.k, a.v, a.layer, a.rotation, ckv));
  }
  float* ws_o = reinterpret_cast<float*>(ws);
  float* ws_ml = ws_o + lp.parts * 16 * D;
  const int page_tiles = ceil_div(a.from_pages, tile_tokens);
  const int segments = ceil_div(lp.prefix_splits, lp.segment_splits);
  const int per_launch = lp.launch_items * prefill_item_queries;
  for (int64_t q0 = 0; q0 < a.queries; q0 += per_launch) {
    const int count = int(std::min<int64_t>(per_launch, a.queries - q0));
    const int items = ceil_div(count, prefill_item_queries);
    attend_params p{};
    set_view(p, a.kv, a.layer);
    p.q_heads = a.q_heads;
    p.group = group;
    p.mtiles = lp.mtiles;
    p.q = q;
    p.q_type = q_type;
    p.q_stride = q_stride;
    p.o = a.o;
    p.o_type = a.o_type;
    p.o_stride = a.o_stride ? a.o_stride : int64_t(a.q_heads) * D;
    p.scale_log2 = scale * 1.4426950408889634f;
    p.tiles_per_split = lp.tiles_per_split;
    p.max_splits = lp.max_splits;
    p.unit_tokens = tile_tokens;
    p.ws_o = ws_o;
    p.ws_ml = ws_ml;
    p.rot = a.rotation;
    p.q_rotated = a.rotation.mask ? 1 : 0;
    p.prefix = 1;
    p.extra_splits = a.k.data ? 1 : 0;
    p.lse = a.lse;
    set_variant(p, a.variant);
    p.prefix_skip = lp.skip;
    p.n_items = items;
    for (int i = 0; i < items; ++i) {
      const int first = int(q0) + i * prefill_item_queries;
      p.items[i] = decode_item{a.slot,
                               int32_t(std::min<int64_t>(prefill_item_queries, a.queries - first)),
                               a.prefix,
                               a.from_pages,
                               a.window_unit,
                               first,
                               -1};
    }
    if (a.k.data) {
      chunk_params c{};
      c.ck = ckv;
      c.cv = ckv + size_t(H) * a.queries * D;
      c.q = q;
      c.q_type = q_type;
      c.q_stride = q_stride;
      c.T = int(a.queries);
      c.q0 = int(q0);
      c.rows = count * group;
      c.group = group;
      c.kv_heads = H;
      c.item_rows = prefill_item_queries * group;
      c.mtiles = lp.mtiles;
      c.max_splits = lp.max_splits;
      c.scale_log2 = p.scale_log2;
      c.window = a.variant.window;
      c.softcap_log2 = p.softcap_log2;
      c.ws_o = ws_o;
      c.ws_ml = ws_ml;
      const int smem = int(sizeof(chunk_smem<D>));
      KVQ_TRY(set_max_dynamic_smem(chunk_kernel<D>, smem));
      KVQ_TRY(launch("prefill: chunk attention launch", chunk_kernel<D>,
                     dim3(unsigned(ceil_div(c.rows, prefill_block_rows(D)) * H)), dim3(threads),
                     size_t(smem), st, c));
    }
    if (lp.prefix_splits > 0 && lp.wide) {
      const int smem = int(sizeof(prefix_smem<D>));
      KVQ_TRY(set_max_dynamic_smem(prefix_kernel<D>, smem));
      p.staged = reinterpret_cast<const __half*>(ws + ly.staged);
      p.stage_tiles = lp.stage_tiles;
      for (int seg = 0; seg < segments; ++seg) {
        p.split0 = seg * lp.segment_splits;
        p.stage_t0 = lp.skip + p.split0 * lp.tiles_per_split;
        const int splits = std::min(lp.segment_splits, lp.prefix_splits - p.split0);
        // the segment's page tiles, staged once per call when one segment holds them all (none
        // where every page is FP16)
        const int staged = std::min(page_tiles - p.stage_t0, splits * lp.tiles_per_split);
        if (staged > 0 && a.quantized_pages && (segments > 1 || q0 == 0))
          KVQ_TRY(launch("prefill: prefix staging launch", stage_prefix_kernel<D>,
                         dim3(unsigned(staged), unsigned(H), 2u), dim3(threads), 0, st, p));
        KVQ_TRY(launch("prefill: prefix attention launch", prefix_kernel<D>,
                       dim3(unsigned(splits), unsigned(H * lp.row_blocks), unsigned(items)), dim3(threads),
                       size_t(smem), st, p));
      }
    } else if (lp.prefix_splits > 0) {
      const dim3 pgrid(unsigned(lp.prefix_splits), unsigned(H * lp.row_blocks), unsigned(items));
      KVQ_TRY(launch_tile<D>("prefill: prefix attention launch", p, pgrid, st));
    }
    KVQ_TRY(launch_merge_rows<D>("prefill: merge launch", p, items, st));
  }
  return {};
}

}  // namespace
}  // namespace cuda::detail

namespace cuda {
using namespace detail;

status prefill_can_implement(const prefill_args& a) {
  const paged_view& kv = a.kv;
  if (!attention_head_dim(kv.head_dim))
    return {errc::unsupported, msg("CUDA prefill supports head_dim 64, 128 and 256, not ", kv.head_dim)};
  if (kv.page_tokens % tile_tokens != 0 || (kv.page_tokens & (kv.page_tokens - 1)) != 0)
    return {errc::unsupported,
            msg("CUDA prefill needs page_tokens a power of two and a multiple of 64, not ", kv.page_tokens)};
  if (kv.kv_heads <= 0 || kv.kv_heads > max_kv_heads || a.q_heads % kv.kv_heads != 0 || a.q_heads / kv.kv_heads > 16)
    return {errc::unsupported,
            msg("CUDA prefill supports kv_heads <= ", max_kv_heads, " and a GQA group of at most 16; got ", a.q_heads,
                " query heads over ", kv.kv_heads, " kv heads")};
  return check_prefill_range(a);
}

size_t prefill_workspace_bytes(const prefill_args& a) { return layout_of(a, plan_of(a)).total; }

status prefill_run(const prefill_args& a, void* workspace, size_t workspace_bytes, void* stream) {
  KVQ_TRY(prefill_can_implement(a));
  const prefill_plan lp = plan_of(a);
  const prefill_layout ly = layout_of(a, lp);
  if (workspace_bytes < ly.total)
    return {errc::invalid_argument, msg("prefill: workspace of ", workspace_bytes, " bytes, need ", ly.total)};
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return with_head_dim(a.kv.head_dim, [&]<int D>() { return launch_prefill<D>(a, lp, ly, ws, st); });
}

}  // namespace cuda
KVQ_NAMESPACE_END
