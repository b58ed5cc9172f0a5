// The host launch plan of attention calls (launch_plan.hpp) and the public planning API of
// include/kvq/cuda/paged_attention.hpp: `attend_can_implement`, `attend_plan`,
// `attend_workspace_bytes`.
#include "launch_plan.hpp"

#include <kvq/cuda/read_plan.hpp>

#include "attention/attend_launch.hpp"
#include "attention/layout.hpp"
#include "status.hpp"
#include <kvq/detail/view_checks.hpp>

#include <algorithm>
#include <climits>

KVQ_NAMESPACE_BEGIN
namespace cuda {
namespace detail {
namespace {

// Stages of a decode call. cap: the bits a stage holds (the layer's widest format, rounded up to
// 2/4/8/16; 3 for a layer of 3-bit kind pairs, whose page-heads are smaller than 4-bit ones;
// formats read by element are never staged). The block-staged kernel (page stages shared
// by the block's warps) when at least 3 page stages fit with `staged_blocks` blocks per SM, a
// page-head of the largest K and V formats the stages hold each (8-bit page-heads: 18 KB at
// page_tokens 64, 3 stages); else the per-warp staged kernel, one slab per stage, as many stages as
// fit, 2 at least. A 16-bit plan starts from `wide_staged_blocks`, and its page-heads (16 KB at
// head_dim 64, 32 KB at 128, 64 KB at 256, page_tokens 64) take the block-staged kernel at fewer
// blocks per SM where 3 page stages fit there.
template <int D>
void plan_stages(const paged_view& kv, int max_bits, bool one_format, launch_plan& lp) {
  constexpr int sm_bytes = 227 * 1024, reserved = 1024;
  lp.stage_cap = max_bits <= 3 ? std::max(max_bits, 2) : max_bits <= 4 ? 4 : max_bits <= 8 ? 8 : 16;
  const auto room = [](int blocks) { return sm_bytes / blocks - reserved - int(staged_head_bytes<D>); };
  uint32_t kb = 0, vb = 0;  // the largest K and V page-heads the stages hold
  for (int f = 0; f < int(format_count); ++f)
    if (stages_hold(format_id(f), lp.stage_cap)) kb = std::max(kb, kv.k_page_bytes[f]), vb = std::max(vb, kv.v_page_bytes[f]);
  const int ps = int((kb + vb + 127) / 128 * 128);
  // Page stages: any count of at least 3. Where stages x chunks per page is not a multiple of the
  // block's 4 warps, warp pairs take a stage's pages in turn, and the kernel instance with one
  // full barrier per fill parity runs (two_full).
  const int max_blocks = lp.stage_cap == 16 ? wide_staged_blocks<D> : staged_blocks<D>;
  int blocks = max_blocks;
  if (lp.stage_cap == 16)
    while (blocks > 1 && ps > 0 && room(blocks) / ps < 3) --blocks;
  int pns = ps > 0 ? std::min(room(blocks) / ps, max_stages) : 0;
  const auto two_full = [&](int stages) { return (stages * (kv.page_tokens / (2 * slab))) % dec_warps != 0; };
  // Pages of 3-bit kind pairs are read staged by the Whole instance only, which has no two_full
  // variant: one stage fewer where that makes the ring fit it (an even count at page_tokens 64).
  const bool three = lp.stage_cap == 3 && one_format;
  if (three && pns > 3 && two_full(pns)) --pns;
  int st, ring;  // stage bytes; rings of stages (one per warp, or one per block)
  if (pns >= 3) {
    lp.page_stage = uint32_t(ps), st = ps, ring = 1, lp.stages = pns;
    lp.two_full = two_full(pns);
    // The Whole instance: 64-token units need a stage in flight beyond the pages the 4 warps
    // hold; 3-bit kind pairs run their chunk loops there at any stage count.
    lp.whole = one_format && lp.stage_cap <= 4 && !lp.two_full &&
               (three || (kv.page_tokens >= 4 * slab && pns * (kv.page_tokens / (4 * slab)) > dec_warps));
  } else {
    blocks = max_blocks;
    lp.page_stage = 0, lp.two_full = lp.whole = false, st = int(stage_bytes(D, lp.stage_cap)), ring = dec_warps;
    lp.stages = std::clamp(room(blocks) / (ring * st), 2, max_stages);
  }
  lp.smem = int(staged_head_bytes<D>) + std::max(ring * lp.stages * st, int(sizeof(merge_area<D>)));
  lp.per_sm = std::min(blocks, sm_bytes / (lp.smem + reserved));
}

}  // namespace

launch_plan plan_for(const attend_args& a) {
  launch_plan lp{};
  const int group = a.q_heads / a.kv.kv_heads;
  int max_q = 1;
  for (const auto& it : a.items) max_q = std::max(max_q, int(it.q_len));
  lp.decode = group * max_q <= 8;
  lp.rows = std::min(16, group * max_q);
  lp.unit = lp.decode ? slab : tile_tokens;
  lp.max_tiles = 1;
  int64_t total = 0;
  // a sliding layer's items start at their first query's window (`window_skip_units`); with sink
  // pages, the units after the sink split (`rest`) start at the later of it and the window's
  int rest_units = 1;
  const int sink_units = lp.decode && a.sink_pages > 0 ? a.sink_pages * (a.kv.page_tokens / slab) : 0;
  for (const auto& it : a.items) {
    const int units = ceil_div(it.from_pages, lp.unit) + ceil_div(it.n - it.from_pages, lp.unit);
    const int skip = window_skip_units(a.variant.window, it.n - it.q_len, it.from_pages, a.kv.page_tokens, lp.unit);
    lp.max_tiles = std::max(lp.max_tiles, units - skip);
    rest_units = std::max(rest_units, units - std::max(skip, sink_units));
    total += units - skip;
  }
  if (lp.decode) {
    // Whole waves: the blocks resident at once are num_sms x the plan's blocks per SM (the launch
    // bounds, or fewer where the stages take the shared memory). A split count s costs waves(s) x (slabs per block(s) + a block's fixed cost, about
    // 8 slabs: page lookups, query, warp merge, its share of the split merge) for the longest
    // item; a partial last wave is paid in full (ncu showed 2.1 waves costing up to a third of the
    // time), so take the s of least cost, the fewest splits on a tie. At least 4 slabs per warp,
    // at most max_cta_slabs per block (the page table cache).
    // A soft-capped layer never runs the whole-unit instance (compiled without soft-capping: the
    // code made its loop spill).
    const bool capped = a.variant.softcap > 0.f;
    // The window's masks and soft-capping are compiled into instances of their own (`rules`): in
    // the plain instances they made global layers' decode up to 10 % slower (spills).
    lp.rules = capped || a.variant.window > 0;
    const auto stages_for = [&](int bits) {
      with_head_dim(a.kv.head_dim, [&]<int D>() { plan_stages<D>(a.kv, bits, a.one_format_per_head && !capped, lp); });
    };
    stages_for(a.max_page_bits);
    // 3-bit pages counted as 3 bits (`three_bit_pages`, or a hint of 3: heads of 3-bit pairs):
    // the Whole instance reads blocks of one 3-bit pair; any other plan of narrow stages runs a
    // Three instance (block-staged or per-warp), whose dispatch reads them beside other formats.
    // Where 8-bit page-heads leave room for fewer than 3 page stages (head_dim 256, page_tokens
    // 128 and up), block-staged 4-bit stages if those fit (8-bit pages read from global memory, as
    // under any smaller hint), else the per-warp kernel in the layer's own stage width.
    const bool three_bits = a.three_bit_pages || a.max_page_bits == 3;
    if (three_bits && lp.stage_cap < 16 && !lp.whole) {
      if (!lp.page_stage && a.max_page_bits > 4) {
        stages_for(4);
        if (!lp.page_stage) stages_for(a.max_page_bits);
      }
      lp.three = !lp.whole;
    }
    // Sink pages: split 0 of every (item, kv head), so that no other block holds them; the
    // other splits share the rest. A sink block is short (its units + 8): it costs nothing where
    // it fits in the last wave's free slots, else a short wave of its own per wave it overflows.
    // (Counted as a whole block in the waves, it made the plan take fewer, longer splits: 1.2-1.3x
    // at 8-32 x 32K; not counted at all, it pushed plans of one full wave into a second: 1.2x at
    // 1 x 128K, 1.35x at 8 x 4K.)
    lp.sink_units = sink_units;
    const int rest = rest_units, sinks = lp.sink_units > 0 ? 1 : 0;
    const int64_t wave = int64_t(a.num_sms) * lp.per_sm;
    const int64_t base = int64_t(std::max<size_t>(1, a.items.size())) * a.kv.kv_heads;
    const int s_min = ceil_div(rest, max_cta_slabs);
    const int s_max = std::max(s_min, ceil_div(rest, 4 * dec_warps));
    int64_t best_cost = INT64_MAX;
    int best = s_min;
    for (int sp = s_min; sp <= s_max; ++sp) {
      const int64_t waves = (base * sp + wave - 1) / wave, spill = base * sinks - (waves * wave - base * sp);
      const int64_t cost = waves * (ceil_div(rest, sp) + 8) + (spill > 0 ? (spill + wave - 1) / wave * (lp.sink_units + 8) : 0);
      if (cost < best_cost) best_cost = cost, best = sp;
    }
    lp.mtiles = 1;
    const int quantum = dec_warps * (lp.page_stage ? 2 : 1);  // whole slabs (block-staged: 32-token chunks) per warp
    lp.tiles_per_split = ceil_div(ceil_div(rest, best), quantum) * quantum;
    lp.max_splits = sinks + ceil_div(rest, lp.tiles_per_split);
    (void)total;
    return lp;
  }
  lp.mtiles = ceil_div(group * max_q, 16);
  const int64_t base = int64_t(std::max<size_t>(1, a.items.size())) * a.kv.kv_heads * lp.mtiles;
  const int64_t want = int64_t(a.num_sms) * 4;
  int splits = int(std::clamp<int64_t>((want + base - 1) / base, 1, lp.max_tiles));
  splits = std::max(splits, ceil_div(lp.max_tiles, max_split_tiles));
  lp.tiles_per_split = ceil_div(lp.max_tiles, splits);
  lp.max_splits = ceil_div(lp.max_tiles, lp.tiles_per_split);
  return lp;
}

result<launch_plan> checked_plan(const attend_args& a) {
  KVQ_TRY(attend_can_implement(a));
  return plan_for(a);
}

size_t workspace_bytes(const attend_args& a, const launch_plan& lp) {
  const size_t batch = std::min<size_t>(a.items.size(), max_items);
  const size_t parts = batch * a.kv.kv_heads * lp.mtiles * lp.max_splits;
  const size_t partials = parts * 16 * (size_t(a.kv.head_dim) + 2) * sizeof(float);
  return a.rotation.mask == 0 ? partials : rotated_q_offset(a, lp) + rotated_q_bytes(a);
}

size_t rotated_q_offset(const attend_args& a, const launch_plan& lp) {
  const size_t batch = std::min<size_t>(a.items.size(), max_items);
  const size_t parts = batch * a.kv.kv_heads * lp.mtiles * lp.max_splits;
  return (parts * 16 * (size_t(a.kv.head_dim) + 2) * sizeof(float) + 255) / 256 * 256;
}

size_t rotated_q_bytes(const attend_args& a) {
  if (a.rotation.mask == 0) return 0;  // (also reserved under a decode plan, whose kernels rotate in their prologue)
  size_t rows = 0;
  for (const decode_item& it : a.items) rows = std::max(rows, size_t(std::max(it.q_row + it.q_len, 0)));
  return rows * size_t(a.q_heads) * size_t(a.kv.head_dim) * sizeof(float);
}

}  // namespace detail

using detail::msg;
using detail::max_kv_heads;
using detail::stage_bytes;
using detail::tile_tokens;

status attend_can_implement(const attend_args& a) {
  const auto& kv = a.kv;
  if (!detail::attention_head_dim(kv.head_dim))
    return {errc::unsupported, msg("CUDA attention supports head_dim 64, 128 and 256, not ", kv.head_dim)};
  if (kv.page_tokens % tile_tokens != 0 || (kv.page_tokens & (kv.page_tokens - 1)) != 0)
    return {errc::unsupported, msg("CUDA attention needs page_tokens a power of two and a multiple of 64, not ", kv.page_tokens)};
  if (kv.kv_heads <= 0 || kv.kv_heads > max_kv_heads || a.q_heads % kv.kv_heads != 0 || a.q_heads / kv.kv_heads > 16)
    return {errc::unsupported, msg("CUDA attention supports kv_heads <= ", max_kv_heads, " and a GQA group of at most 16; got ",
                                   a.q_heads, " query heads over ", kv.kv_heads, " kv heads")};
  return detail::check_attend_items(a);
}

result<attend_plan_info> attend_plan(const attend_args& a) {
  const result<detail::launch_plan> planned = detail::checked_plan(a);
  if (!planned) return planned.error();
  const detail::launch_plan& lp = *planned;
  attend_plan_info info;
  info.max_splits = lp.max_splits;
  info.tokens_per_split = lp.tiles_per_split * lp.unit;
  if (!lp.decode) return info;
  info.kernel = lp.page_stage ? attend_kernel::decode_block_staged : attend_kernel::decode_staged;
  info.stages = lp.stages;
  info.stage_bytes = lp.page_stage ? lp.page_stage : stage_bytes(a.kv.head_dim, lp.stage_cap);
  info.smem_bytes = lp.smem;
  info.blocks_per_sm = lp.per_sm;
  info.whole_units = lp.decode && lp.page_stage && lp.whole;
  info.rule_code = lp.rules;
  info.three_bit_dispatch = lp.three;
  info.stage_bits = lp.stage_cap;
  return info;
}

size_t attend_workspace_bytes(const attend_args& a) { return detail::workspace_bytes(a, detail::plan_for(a)); }

}  // namespace cuda
KVQ_NAMESPACE_END
