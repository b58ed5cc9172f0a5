#pragma once
// The launches of a replayed decode step (include/kvq/cache/decode_step.hpp): the per-step part of
// every append and attention call lives in device tables at fixed addresses, which the host
// rewrites before each replay, and the launch shapes are fixed from a maximum batch and context.
// The tables' host and device layouts are the same (one copy moves them).
#include <kvq/cuda/paged_attention.hpp>

#include <cstddef>

#include "launch_plan.hpp"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

/// Bytes of one append table of at most `max_items` sequences (and max_append_pages new pages):
/// the tables a step copies each time hold no room for more sequences than the step has.
size_t append_table_bytes(int max_items);
/// Checks an append call of one token per sequence as `append_run` does and writes its
/// sequences and pages into `table` (host, `append_table_bytes(a.items.size())` at least), their source rows counted
/// from `first_row`; `a.k` / `a.v` are not read. Nothing is written when a check fails.
status fill_append_table(const append_args& a, int first_row, void* table);
/// The append of one layer over the device `table`, for up to `max_items` sequences of one token
/// each (at most max_append_pages), in one launch (each sequence's new page, if any, and its ring
/// row): `a` gives the layer, the K / V rows of the whole batch, the clip ratios and codebook
/// levels; its items and pages are not read.
status launch_append_replay(const append_args& a, const void* table, int max_items, void* stream);

/// Bytes of one attention table (`decode_table`: a count and `max_items` items).
size_t decode_table_bytes(int max_items);
/// Writes `items` into `table` (host, `decode_table_bytes(items.size())` at least).
void fill_decode_table(std::span<const decode_item> items, void* table);
/// The plan of a replayed attention call of up to `max_items` single-query items of at most
/// `max_tokens` tokens: the decode kernel the eager plan picks for `a.max_page_bits` and
/// `a.one_format_per_head` (the formats the layer can hold: the staged or block-staged kernel,
/// its 16-bit instance where a format of more than 8 bits or one read by element may be there) and the splits of the longest item; `workspace`: the device
/// bytes its launches need. Checks that the call is one the
/// replay runs (a GQA group of at most 8, the batch and context within the launch's and the page
/// tables' limits).
result<launch_plan> replay_plan(const attend_args& a, int max_items, int64_t max_tokens, size_t& workspace);
/// Attention of one layer over the device `table` under `replay_plan`: `a` gives the layer, the
/// queries and outputs of the whole batch, the rotation and scale; its items are not read.
/// `workspace` holds the bytes `replay_plan` gave.
status launch_attend_replay(const attend_args& a, const launch_plan& lp, const void* table, int max_items,
                            void* workspace, void* stream);

}  // namespace cuda::detail
KVQ_NAMESPACE_END
