// Launch glue of the attention kernels: the launch parameters of a planned call
// (launch_plan.hpp), the query rotation of rotated heads, the attention kernel its plan names,
// then the split merge as a programmatic dependent launch (those per head_dim:
// attend_launch.hpp). The kernels, by concept: cuda/README.md.
#include "attention/attend_launch.hpp"
#include "attention/params.cuh"
#include "launch.hpp"
#include "launch_plan.hpp"
#include "replay.hpp"
#include "status.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <vector>

KVQ_NAMESPACE_BEGIN
namespace cuda {
namespace detail {
namespace {

// The launch parameters of a part of `items` items of a call, but its items.
void set_params(const attend_args& a, const launch_plan& lp, const void* q, dtype q_type, int64_t q_stride,
                bool q_rotated, void* workspace, size_t items, attend_params& p) {
  set_view(p, a.kv, a.layer);
  p.q_heads = a.q_heads;
  p.group = a.q_heads / a.kv.kv_heads;
  p.mtiles = lp.mtiles;
  p.q = q;
  p.q_type = q_type;
  p.q_stride = q_stride;
  p.rot = a.rotation;
  p.q_rotated = q_rotated ? 1 : 0;
  p.o = a.o;
  p.o_type = a.o_type;
  p.o_stride = a.o_stride ? a.o_stride : int64_t(a.q_heads) * a.kv.head_dim;
  const float scale = a.scale > 0.f ? a.scale : 1.0f / std::sqrt(float(a.kv.head_dim));
  p.scale_log2 = scale * 1.4426950408889634f;
  p.tiles_per_split = lp.tiles_per_split;
  p.max_splits = lp.max_splits;
  p.sink_units = lp.sink_units;
  const size_t parts = items * a.kv.kv_heads * lp.mtiles * lp.max_splits;
  p.ws_o = static_cast<float*>(workspace);
  p.ws_ml = p.ws_o + parts * 16 * a.kv.head_dim;
  p.q_stage = a.q_stage;
  p.unit_tokens = lp.unit;
  p.stages = lp.stages;
  p.stage_cap = lp.stage_cap;
  p.page_stage = lp.page_stage;
  set_variant(p, a.variant);
}

}  // namespace

status launch_planned(const attend_args& a, const launch_plan& lp, void* workspace, size_t workspace_bytes_given,
                      void* stream) {
  const size_t need = workspace_bytes(a, lp);
  if (workspace_bytes_given < need)
    return {errc::invalid_argument, msg("attend: workspace of ", workspace_bytes_given, " bytes, need ", need)};
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  // Rotated heads: the decode kernels rotate their queries in the prologue (`load_query`); for
  // the tile kernel they are rotated into the workspace once for the batch (query.cuh).
  const void* q = a.q;
  dtype q_type = a.q_type;
  int64_t q_stride = a.q_stride ? a.q_stride : int64_t(a.q_heads) * a.kv.head_dim;
  const bool q_rotated = a.rotation.mask != 0 && !lp.decode;
  if (q_rotated) {
    float* qr = reinterpret_cast<float*>(static_cast<uint8_t*>(workspace) + rotated_q_offset(a, lp));
    const int rows = int(rotated_q_bytes(a) / (sizeof(float) * size_t(a.q_heads) * a.kv.head_dim));
    KVQ_TRY(with_head_dim(a.kv.head_dim, [&]<int D>() {
      return launch_rotate_query_d<D>(a.q, a.q_type, q_stride, rows, a.q_heads, a.q_heads / a.kv.kv_heads, a.layer,
                                      a.rotation, qr, st);
    }));
    q = qr, q_type = dtype::f32, q_stride = int64_t(a.q_heads) * a.kv.head_dim;
  }
  for (size_t first = 0; first < a.items.size(); first += max_items) {
    const std::span<const decode_item> items = a.items.subspan(first, std::min<size_t>(max_items, a.items.size() - first));
    attend_params p{};
    set_params(a, lp, q, q_type, q_stride, q_rotated, workspace, items.size(), p);
    p.n_items = int(items.size());
    std::copy(items.begin(), items.end(), p.items);
    KVQ_TRY(with_head_dim(a.kv.head_dim,
                          [&]<int D>() { return launch_attend_d<D>(p, lp, a.kv.kv_heads, int(items.size()), st); }));
  }
  return {};
}

size_t decode_table_bytes(int max_items) { return offsetof(decode_table, items) + size_t(max_items) * sizeof(decode_item); }

void fill_decode_table(std::span<const decode_item> items, void* table) {
  decode_table& t = *static_cast<decode_table*>(table);
  t.n_items = int32_t(items.size());
  std::copy(items.begin(), items.end(), t.items);
}

result<launch_plan> replay_plan(const attend_args& a, int max_items_, int64_t max_tokens, size_t& workspace) {
  const int group = a.q_heads / std::max(1, a.kv.kv_heads);
  if (max_items_ < 1 || max_items_ > max_items)
    return status{errc::invalid_argument, msg("replayed attention: a batch of 1 to ", max_items, " sequences, not ", max_items_)};
  if (max_tokens < 2 || max_tokens > int64_t(a.kv.max_pages) * a.kv.page_tokens)
    return status{errc::invalid_argument, msg("replayed attention: max_tokens ", max_tokens, " outside [2, ",
                                              int64_t(a.kv.max_pages) * a.kv.page_tokens, "] (the page tables' tokens)")};
  // The longest item a step can hold, every one of the batch: its units are the most any item of
  // at most max_tokens tokens has (from_pages off a slab edge adds one).
  // A sliding layer: an item reads from the page of its window's start (`window_skip_units`), at
  // most the window or the ring, a page before it, and the sink split's pages: planned as a
  // global item of that many tokens (whose units bound every item's after its skip, wherever
  // page and slab edges fall).
  attend_args w = a;  // (its max_page_bits and one_format_per_head: the formats the step's layer can hold)
  int64_t plan_tokens = max_tokens;
  if (a.variant.window > 0) {
    plan_tokens = std::min<int64_t>(max_tokens, int64_t(std::max(a.variant.window, a.kv.window)) +
                                                    int64_t(2 + std::max(a.sink_pages, 0)) * a.kv.page_tokens);
    w.variant.window = 0;
  }
  std::vector<decode_item> longest(size_t(max_items_), decode_item{0, 1, int32_t(plan_tokens), int32_t(plan_tokens - 1), 0, 0});
  for (int i = 0; i < max_items_; ++i) longest[size_t(i)].q_row = i;
  w.items = longest;
  result<launch_plan> lp = checked_plan(w);
  if (!lp) return lp.error();
  if (!lp->decode)
    return status{errc::unsupported, msg("replayed attention runs the decode kernel: a GQA group of at most 8, not ", group)};
  launch_plan out = *lp;
  out.rules = out.rules || a.variant.window > 0;  // (planned as a global item: the layer's window masks still)
  workspace = workspace_bytes(w, out);
  return out;
}

status launch_attend_replay(const attend_args& a, const launch_plan& lp, const void* table, int max_items_,
                            void* workspace, void* stream) {
  attend_params p{};
  set_params(a, lp, a.q, a.q_type, a.q_stride ? a.q_stride : int64_t(a.q_heads) * a.kv.head_dim, false, workspace,
             size_t(max_items_), p);
  p.q_stage = nullptr;
  p.n_items = max_items_;
  p.table = static_cast<const decode_table*>(table);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const dim3 grid(unsigned(lp.max_splits), unsigned(a.kv.kv_heads), unsigned(max_items_));
  const dim3 mgrid(unsigned(max_items_), unsigned(a.kv.kv_heads * lp.mtiles), unsigned(lp.rows));
  return with_head_dim(a.kv.head_dim, [&]<int D>() { return launch_attend_replay_d<D>(p, lp, grid, mgrid, st); });
}

}  // namespace detail

status attend_run(const attend_args& a, void* workspace, size_t workspace_bytes, void* stream) {
  const result<detail::launch_plan> lp = detail::checked_plan(a);
  if (!lp) return lp.error();
  return detail::launch_planned(a, *lp, workspace, workspace_bytes, stream);
}

}  // namespace cuda
KVQ_NAMESPACE_END
