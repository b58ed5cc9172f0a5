#pragma once
// The host launch plan of an attention call: which kernel, its stages and shared memory, and how
// each sequence splits across thread blocks. Made once per call (`checked_plan`) and passed to the
// launch (attention/attend.cu); host code only, tested without a device (tests/cuda/test_cuda_plan.cpp).
#include <cstddef>
#include <cstdint>
#include <kvq/cuda/paged_attention.hpp>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

/// Splits and tiles for a batch: enough thread blocks to fill the chip about four times over.
struct launch_plan {
  bool decode;  // group x q_len <= 8: the warp-split decode kernel
  int unit, mtiles, tiles_per_split, max_splits, max_tiles;
  int sink_units;                       // decode: the units (slabs) of split 0 (`attend_args::sink_pages`), 0: none
  int rows;                             // output rows per m-tile at most (the merge's blocks per m-tile)
  int stages, stage_cap, smem, per_sm;  // the staged decode kernel's stages and occupancy
  uint32_t page_stage;                  // > 0: the block-staged kernel, bytes of a page stage
  bool two_full;                        // its stage x chunks per page not a multiple of 4: two full barriers per stage
  bool whole;                           // the caller's `one_format_per_head` on a ring without two_full
  bool rules;                           // decode: the instances with a sliding window's masks and soft-capping
  bool three;                           // narrow stages, not whole: a Three instance (3-bit kind pages)
};

/// The plan of a call, unchecked (`attend_can_implement` holds for `a`). A call of more than
/// `max_items` items runs in parts, each under this plan (sized for the whole batch).
launch_plan plan_for(const attend_args& a);
/// The checks of `attend_can_implement`, then the plan.
result<launch_plan> checked_plan(const attend_args& a);
/// Device workspace of a call under its plan: every part's partial results.
size_t workspace_bytes(const attend_args& a, const launch_plan& lp);
/// Where the rotated queries of a call with rotated heads start in its workspace (after the
/// partial results, 256-byte aligned), and their bytes: [rows][q_heads][head_dim] float, rows up
/// to the last item's q_row + q_len; 0 bytes without rotation.
size_t rotated_q_offset(const attend_args& a, const launch_plan& lp);
size_t rotated_q_bytes(const attend_args& a);
/// Launches a call under its plan (`checked_plan(a)`): the attention kernel and the split merge of
/// each part of at most `max_items` items. Defined in attention/attend.cu.
status launch_planned(const attend_args& a, const launch_plan& lp, void* workspace, size_t workspace_bytes,
                      void* stream);

}  // namespace cuda::detail
KVQ_NAMESPACE_END
