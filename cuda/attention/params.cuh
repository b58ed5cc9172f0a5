#pragma once
// The launch parameters of every attention kernel (one `__grid_constant__` struct: the layer's
// paged view, the query and output, the split plan and the batch's items).
#include <kvq/cuda/paged_attention.hpp>
#include <kvq/store/window_layout.hpp>

#include "attention/layout.hpp"
#include "dtype.cuh"
#include "ptx.cuh"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

/// The items of a replayed attention call (a captured decode step, cache/decode_step.hpp), in
/// device memory at an address fixed at capture: the host rewrites them before every replay.
/// Blocks of the fixed grid past `n_items` exit at once.
struct decode_table {
  int32_t n_items;
  decode_item items[max_items];
};

struct attend_params {
  paged_view kv;      // (kv.windows never null: the rings' base, resolved on the host)
  const uint8_t* pages;  // pages_base(kv, layer), resolved on the host (page16 offsets count from here)
  int layer, q_heads, group, mtiles;
  const void* q;
  int64_t q_stride;
  void* o;
  int64_t o_stride;
  dtype q_type, o_type;
  float scale_log2;
  int tiles_per_split, max_splits;
  int sink_units;   // decode: split 0 holds units [0, sink_units), split s > 0 the units from
                    // sink_units + (s - 1) x tiles_per_split (`attend_args::sink_pages`); 0: none
  int unit_tokens;  // tokens of a work unit: 64 (tile kernel) or 16 (decode kernel slabs)
  int stages, stage_cap;  // staged decode kernels: stages (per warp or per block), code bits
  uint32_t page_stage;           // block-staged decode kernel: bytes of a stage (a page-head's K and V), 0: not used
  float* ws_o;   // [partials][16][D]
  float* ws_ml;  // [partials][16][2]
  float* q_stage;  // optional: items' query rows copied here as fp32 (decode_item::stage_row)
  head_rotation rot;  // the layer's rotated heads: the merge rotates their output back
  int q_rotated;      // 1: q holds the rotated queries (tile kernel); 0: the decode kernels rotate them
  int prefix;         // tile kernel, 1: every query sees all n tokens of its item (no causal mask; attend_prefix)
  int extra_splits;   // merge: partials past the item's own splits (1: a prefill chunk's causal part)
  float* lse;         // merge, optional: [rows][q_heads] natural-log log-sum-exp of each output row
  // prefix kernel: its splits start at split `split0`; the page tiles [stage_t0, stage_t0 +
  // stage_tiles) of every kv head, dequantized to swizzled fp16 images ([kv head][tile][role]
  // [64 x D]) by `stage_prefix_kernel` (roles of FP16 pages are read from the page instead)
  const __half* staged;
  int stage_t0, stage_tiles, split0;
  // The layer's attention rule (`variant_args`, attention/variant.hpp). window: a query at position
  // q sees tokens q - window + 1 .. q (0: all); softcap_log2: softcap x log2(e), each scaled score
  // soft-capped (0: off); sinks: [q_heads] sink logits on the device, merged into each output row
  // once, by the final merge (nullptr: none). prefix_skip: the prefix kernels' units left out
  // before the window of the call's first query (`window_skip_units`, one for every item of a
  // call, so that its staged tiles serve all of them).
  int window;
  float softcap_log2;
  const float* sinks;
  int prefix_skip;
  int n_items;
  decode_item items[max_items];
  const decode_table* table;  // replay instances: the items, read from device memory (`items` unused)
};

// The view of one layer's call: its pages' and rings' bases resolved once on the host, so the
// kernels add offsets to a parameter.
inline void set_view(attend_params& p, const paged_view& kv, int layer) {
  p.kv = kv;
  p.kv.windows = rings_base(kv);
  p.pages = pages_base(kv, layer);
  p.layer = layer;
}

// The layer's attention rule (`variant_args`) in a call's parameters.
inline void set_variant(attend_params& p, const variant_args& v) {
  p.window = v.window;
  p.softcap_log2 = v.softcap * 1.4426950408889634f;
  p.sinks = v.sink_logits;
}

// Item i of a call: from the parameters (eager), or from the device table (`Replay`), where it is
// false for a block past the step's items.
template <bool Replay>
__device__ __forceinline__ bool load_item(const attend_params& p, int i, decode_item& out) {
  if constexpr (Replay) {
    if (i >= p.table->n_items) return false;
    out = p.table->items[i];
  } else {
    out = p.items[i];
  }
  return true;
}
// The decode kernels: the replayed step's table where the call has one (a branch once per block,
// not kernel instances of their own: they doubled the decode kernels' code, which the `Rules`
// instances needed room for).
__device__ __forceinline__ bool load_item(const attend_params& p, int i, decode_item& out) {
  return p.table ? load_item<true>(p, i, out) : load_item<false>(p, i, out);
}

// The units an item's attention leaves out in a sliding layer (`window_skip_units`): from its first
// query's position on (the prefix kernels and the tile kernel's prefix mode: the call's, set on the
// host). 0 in a global layer.
__device__ __forceinline__ int item_skip(const attend_params& p, const decode_item& item) {
  if (p.prefix) return p.prefix_skip;
  return window_skip_units(p.window, item.n - item.q_len, item.from_pages, p.kv.page_tokens, p.unit_tokens);
}

// The splits [first, end) of an item of T units, its first `skip` left out: tiles_per_split each,
// after the sink split where there is one (split 0: units [skip, sink_units), empty where the
// window left the sink pages behind, so that `first` is 1).
struct split_span {
  int first, end;
};
__device__ __forceinline__ split_span item_splits(const attend_params& p, int T, int skip) {
  if (p.sink_units == 0) return {0, ceil_div(T - skip, p.tiles_per_split)};
  const int rest = max(skip, p.sink_units);
  return {skip < p.sink_units ? 0 : 1, 1 + (T > rest ? ceil_div(T - rest, p.tiles_per_split) : 0)};
}

// The end of a merged row: m the max (base 2, of the scaled scores), l the sum of 2^(s - m). `lse`
// is the row's log-sum-exp (natural log; -inf for an empty row) and `out(o)` turns its
// unnormalized output into the row's output: o / l, 0 for an empty row (no partial: an empty
// prefix). A layer's sink logit (natural units; `sinks`, per query head) joins the sum here, once,
// after every split, as in `merge_sink_row`: its weight multiplies no value.
struct row_end {
  float scale, lse;
  bool divide;  // no sink: o / l, as before sinks existed
  float l;
  __device__ __forceinline__ float out(float o) const { return l > 0.f ? (divide ? o / l : o * scale) : 0.f; }
};
__device__ __forceinline__ row_end end_row(float m, float l, const float* sinks, int qh) {
  if (!sinks) return {0.f, l > 0.f ? (m + log2f(l)) * 0.6931471805599453f : -INFINITY, true, l};
  const float s2 = sinks[qh] * 1.4426950408889634f;
  const float mm = l > 0.f ? fmaxf(m, s2) : s2;
  const float a = l > 0.f ? l * exp2f(m - mm) : 0.f, total = a + exp2f(s2 - mm);
  return {l > 0.f ? exp2f(m - mm) / total : 0.f, (mm + log2f(total)) * 0.6931471805599453f, false, l};
}

static_assert(slab <= ring_slack_slots, "the ring blocks' slack covers a slab read past a sequence's last slot");
static_assert(sizeof(attend_params) <= 32764, "kernel parameters of at most 32764 bytes (sm_70+, CUDA 12.1+)");

}  // namespace cuda::detail
KVQ_NAMESPACE_END
