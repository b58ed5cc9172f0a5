// Truncation's ring restore on the device (`restore_run`, include/kvq/cuda/paged_attention.hpp):
// the kept tokens of a cut page whose ring slots later tokens overwrote are decoded from the page
// through the shared codec and rounded to fp16 into their slots, as the CPU backend's
// `restore_rows` writes them (the same bytes). No host copy, no synchronization.
#include <cuda_runtime.h>

#include <algorithm>
#include <kvq/codec/codec.hpp>
#include <kvq/cuda/paged_attention.hpp>
#include <kvq/store/window_layout.hpp>

#include "launch.hpp"
#include "status.hpp"
#include <kvq/detail/view_checks.hpp>

KVQ_NAMESPACE_BEGIN
namespace cuda {
namespace {

using detail::msg;

constexpr int restore_layers_per_launch = 128;  // (one launch for every model of up to 128 layers)

struct restore_params {
  paged_view kv;
  uint8_t* rings;  // writable alias of rings_base(kv)
  int slot;
  uint32_t window_unit;
  append_guard guard;
  ring_restore jobs[restore_layers_per_launch];
};

// A block per (layer job, kv head, role): tokens [first, last) of the page holding them.
__global__ void restore_kernel(const __grid_constant__ restore_params p) {
  const ring_restore& job = p.jobs[blockIdx.x];
  const int h = blockIdx.y, r = blockIdx.z, d = p.kv.head_dim, P = p.kv.page_tokens;
  const int page = job.first / P;
  if (p.guard.held != nullptr && p.guard.held[p.slot] != 0) {
    const int32_t* since = p.guard.since + (size_t(p.slot) * p.kv.layers + job.layer) * 3;
    if (since[0] >= 0 && page * P >= since[1]) return;  // a page of a refused append: never written
  }
  const block_ref b = locate_block(p.kv, job.layer, p.slot, page);
  const uint8_t* fm = b.fmts;
  uint32_t off = 0;
  for (int hh = 0; hh < h; ++hh) off += p.kv.k_page_bytes[fm[2 * hh]] + p.kv.v_page_bytes[fm[2 * hh + 1]];
  if (r == 1) off += p.kv.k_page_bytes[fm[2 * h]];
  const codec::page_geom g = codec::make_geom(fm[2 * h + r], r == 0 ? role::k : role::v, P, d);
  const uint8_t* bytes = pages_base(p.kv, job.layer) + b.offset + off;
  uint16_t* ring = reinterpret_cast<uint16_t*>(p.rings + size_t(p.window_unit) * block_unit) +
                   ring_halves(job.layer, p.kv.kv_heads, h, r, p.kv.window, d);
  const int count = (job.last - job.first) * d;
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int j = job.first + i / d, c = i % d;
    ring[size_t(j % p.kv.window) * d + c] = float_to_half(codec::decode_element(g, bytes, j % P, c));
  }
}

}  // namespace

status restore_run(const restore_args& a, void* stream) {
  const paged_view& kv = a.kv;
  if (a.slot < 0 || (kv.slots > 0 && a.slot >= kv.slots))
    return {errc::invalid_argument, msg("restore: slot ", a.slot, " outside the page tables' slots [0, ", kv.slots, ")")};
  KVQ_TRY(detail::check_tables(kv, "restore"));
  for (size_t i = 0; i < a.layers.size(); ++i) {
    const ring_restore& j = a.layers[i];
    const int64_t P = kv.page_tokens;
    if (j.layer < 0 || j.layer >= kv.layers || j.first < 0 || j.last <= j.first || j.first / P != (j.last - 1) / P ||
        j.first / P >= kv.max_pages)
      return {errc::invalid_argument,
              msg("restore: entry ", i, " (layer ", j.layer, ", tokens [", j.first, ", ", j.last,
                  ")) must name a layer in [0, ", kv.layers, ") and a non-empty range inside one page of the first ",
                  kv.max_pages, " pages")};
    KVQ_TRY(detail::check_item_indices(kv, "restore", i, a.slot, a.window_unit, int64_t(j.last)));
  }
  restore_params p{};
  p.kv = kv;
  p.rings = a.windows ? a.windows : a.arena;
  p.slot = a.slot;
  p.window_unit = a.window_unit;
  p.guard = a.guard;
  for (size_t at = 0; at < a.layers.size(); at += restore_layers_per_launch) {
    const size_t n = std::min(a.layers.size() - at, size_t(restore_layers_per_launch));
    std::copy_n(a.layers.begin() + ptrdiff_t(at), n, p.jobs);
    KVQ_TRY(detail::launch("truncate launch (ring restore)", restore_kernel, dim3(unsigned(n), unsigned(kv.kv_heads), 2),
                           dim3(256), 0, static_cast<cudaStream_t>(stream), p));
  }
  return {};
}

}  // namespace cuda
KVQ_NAMESPACE_END
