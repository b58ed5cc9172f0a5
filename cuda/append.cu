// Quantize-on-append: each new page's fp16 rows (old tokens from the sequence's ring, new ones from
// the input) encoded with the shared codec, so the bytes equal the CPU's, and the new tokens that
// stay in the window written to the FP16 ring. The new rows of a rotated head are rotated by a
// warp each (rotation.cuh) before they are rounded to fp16, in both kernels.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <kvq/codec/codec.hpp>
#include <kvq/cuda/paged_attention.hpp>
#include <kvq/cuda/read_plan.hpp>
#include <kvq/format/nvfp4.hpp>
#include <kvq/store/window_layout.hpp>

#include "attention/layout.hpp"
#include "dtype.cuh"
#include "launch.hpp"
#include "replay.hpp"
#include "rotation.cuh"
#include "status.hpp"
#include <kvq/detail/view_checks.hpp>

KVQ_NAMESPACE_BEGIN
namespace cuda {
namespace {

using detail::cuda_status;
using detail::head_rotated;
using detail::load_any;
using detail::max_kv_heads;
using detail::msg;
using detail::threads;
using detail::warp_rotate;
using detail::with_per_lane;

// The per-call part of an append: its sequences and new pages. Eager calls carry it in the
// launch parameters; a replayed step's kernels read it from device memory (`append_params::table`),
// where a table holds only the items of its group (`append_table_bytes`: the items come last).
struct append_table {
  int n_items, pages;
  uint32_t page_blocks[max_append_pages];
  uint8_t page_item[max_append_pages];
  uint8_t page_fmts[max_append_pages][max_kv_heads * 2];
  struct item {
    int slot;
    int32_t n, e, m;
    uint32_t window_unit;
    int32_t src_row;  // the item's first row in src
    int first_page;   // page index of its first new page
    int page0;        // its first new page in page_blocks / page_fmts
    int32_t ring_from;  // for the guard's record
  } items[max_append_items];
};

struct append_params {
  paged_view kv;
  uint8_t* arena;  // writable aliases of kv's
  uint8_t* rings;  // (rings_base(kv))
  uint32_t* blocks;
  uint8_t* fmts;
  int layer;
  const void* src[2];
  dtype src_type[2];
  int64_t src_stride[2];
  float clip[max_kv_heads * 2];
  const float* levels;  // append_args::levels
  head_rotation rot;
  append_guard guard;         // held slots are not written (append_args::guard)
  const append_table* table;  // replay instances: the call's part, in device memory (`step` unused)
  append_table step;
};
static_assert(max_append_items <= 256, "page_item is one byte");


__device__ __forceinline__ uint16_t src_half(const append_params& p, int r, int64_t row, int h, int c) {
  const int64_t i = row * p.src_stride[r] + int64_t(h) * p.kv.head_dim + c;
  return detail::with_dtype(p.src_type[r], [&](auto z) -> uint16_t {  // the codec's conversions (bytes as the CPU's)
    using T = decltype(z);
    if constexpr (std::is_same_v<T, float>)
      return float_to_half(static_cast<const float*>(p.src[r])[i]);
    else if constexpr (std::is_same_v<T, __half>)
      return static_cast<const uint16_t*>(p.src[r])[i];
    else
      return float_to_half(bf16_to_float(static_cast<const uint16_t*>(p.src[r])[i]));
  });
}

// The warp's input row (row, kv head h) of role r rotated (R x) and rounded to fp16 into
// out [head_dim]: lane l writes channels [l * head_dim / 32, (l + 1) * head_dim / 32).
__device__ __forceinline__ void rotated_row(const append_params& p, int r, int64_t row, int h, int lane,
                                            uint16_t* out) {
  with_per_lane(p.kv.head_dim, [&](auto pl) {
    constexpr int per_lane = decltype(pl)::value;
    const int64_t base = row * p.src_stride[r] + int64_t(h) * p.kv.head_dim + lane * per_lane;
    float x[per_lane];
#pragma unroll
    for (int i = 0; i < per_lane; ++i) x[i] = load_any(p.src[r], p.src_type[r], base + i);
    warp_rotate<per_lane>(x, lane, p.rot.seed, p.layer, h, false);
#pragma unroll
    for (int i = 0; i < per_lane; ++i) out[lane * per_lane + i] = float_to_half(x[i]);
  });
}

// Whether the item's slot is held (append_guard): then nothing of it is written. With `record`
// (one thread of the item's ring write), the first refused append of (slot, layer) is recorded.
__device__ __forceinline__ bool refused(const append_params& p, const append_table::item& it, bool record) {
  if (p.guard.held == nullptr || p.guard.held[it.slot] == 0) return false;
  if (record) {
    int32_t* since = p.guard.since + (size_t(it.slot) * p.kv.layers + p.layer) * 3;
    if (atomicCAS(since, -1, it.n) == -1) since[1] = it.e, since[2] = it.ring_from;
  }
  return true;
}

__device__ __forceinline__ uint16_t* ring_of(const append_params& p, const append_table::item& it, int h, int r) {
  return reinterpret_cast<uint16_t*>(p.rings + size_t(it.window_unit) * block_unit) +
         ring_halves(p.layer, p.kv.kv_heads, h, r, p.kv.window, p.kv.head_dim);
}

// New page `pg` of table `t`, (kv head h, role r), by the whole block: stage the page's fp16 rows
// (old tokens from the item's ring, new ones from the input) in shared memory `src` ([P][d]),
// then encode every unit with the shared codec. `Rotating`: for layers with rotated heads (the
// plain instances keep their registers).
template <bool Rotating>
__device__ __forceinline__ void encode_page(const append_params& p, const append_table& t, int pg, int h, int r,
                                            uint16_t* src) {
  const int d = p.kv.head_dim, P = p.kv.page_tokens;
  const append_table::item& it = t.items[t.page_item[pg]];
  if (refused(p, it, false)) return;  // (uniform over the block)
  const uint16_t* ring = ring_of(p, it, h, r);
  const int first_tok = it.e + (pg - it.page0) * P;
  const bool rotated = Rotating && head_rotated(p.rot, h);
  for (int idx = threadIdx.x; idx < P * d; idx += threads) {
    const int row = idx / d, c = idx % d, j = first_tok + row;
    if (j < it.n)
      src[idx] = ring[size_t(j % p.kv.window) * d + c];
    else if (!rotated)
      src[idx] = src_half(p, r, it.src_row + (j - it.n), h, c);
  }
  if (rotated)  // the new rows, a warp each
    for (int row = max(0, it.n - first_tok) + threadIdx.x / 32; row < P; row += threads / 32)
      rotated_row(p, r, it.src_row + (first_tok + row - it.n), h, threadIdx.x % 32, src + size_t(row) * d);
  const uint8_t* fm = t.page_fmts[pg];
  uint32_t off = 0;
  for (int hh = 0; hh < h; ++hh) off += p.kv.k_page_bytes[fm[2 * hh]] + p.kv.v_page_bytes[fm[2 * hh + 1]];
  if (r == 1) off += p.kv.k_page_bytes[fm[2 * h]];
  const format_id f = fm[2 * h + r];
  const codec::page_geom g = codec::make_geom(f, r == 0 ? role::k : role::v, P, d);
  const bool shared = p.kv.tables == page_tables::shared;
  uint8_t* block = shared ? p.arena + uint64_t(p.layer) * p.kv.layer_bytes + uint64_t(t.page_blocks[pg]) * p.kv.block_bytes
                          : p.arena + uint64_t(t.page_blocks[pg]) * block_unit;
  uint8_t* page = block + (shared ? block_header_bytes(p.kv.kv_heads) : 0u) + off;
  for (uint32_t i = threadIdx.x * 16; i < g.lay.total(); i += threads * 16)
    *reinterpret_cast<uint4*>(page + i) = make_uint4(0, 0, 0, 0);
  __syncthreads();
  if (g.fmt.fam == family::nvfp4) {
    // the page's one unit in parallel: the block's absmax (a max: any order gives the CPU's), then
    // its 16-channel blocks, each encoded as the codec encodes it
    __shared__ float warp_max[threads / 32];
    float amax = 0.f;
    for (int i = threadIdx.x; i < P * d; i += threads) amax = codec::fmax_(amax, codec::fabs_(half_to_float(src[i])));
    for (int o = 16; o > 0; o /= 2) amax = codec::fmax_(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
    __syncthreads();
    for (int w = 0; w < threads / 32; ++w) amax = codec::fmax_(amax, warp_max[w]);
    const float ts = nvfp4_codec::tensor_scale_of(amax);
    if (threadIdx.x == 0) nvfp4_codec::put_tensor_scale(g, page, ts);
    for (int b = threadIdx.x; b < P * (d / 16); b += threads)
      nvfp4_codec::encode_block(g, src, d, page, ts, b / (d / 16), b % (d / 16));
  } else {
    codec::encode_params ep{p.clip[2 * h + r], nullptr};
    if (p.levels != nullptr && codec::is_codebook_format(f))
      ep.levels = p.levels + codec::codebook_level_offset(size_t(2 * h + r), f);
    for (int u = threadIdx.x; u < g.unit_count(); u += threads) codec::encode_unit(g, src, d, u, page, ep);
  }
  if (h == 0 && r == 0 && shared) {  // the engine's table lists the block: its header names the formats
    for (int i = threadIdx.x; i < p.kv.kv_heads * 2; i += threads) block[i] = fm[i];
  } else if (h == 0 && r == 0) {
    const size_t row = (size_t(it.slot) * p.kv.layers + p.layer) * p.kv.max_pages + it.first_page + (pg - it.page0);
    if (threadIdx.x == 0) p.blocks[row] = t.page_blocks[pg];
    for (int i = threadIdx.x; i < p.kv.kv_heads * 2; i += threads) p.fmts[row * p.kv.kv_heads * 2 + i] = fm[i];
  }
}

// One block per (new page of any item, kv head, role) of an eager call: `encode_page`.
template <bool Rotating>
__global__ void __launch_bounds__(threads) encode_kernel(const __grid_constant__ append_params p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  encode_page<Rotating>(p, p.step, blockIdx.x, blockIdx.y, blockIdx.z, reinterpret_cast<uint16_t*>(smem_raw));
}

// A replayed step's whole append of one layer in one launch (one token per sequence): a block per
// (sequence of the grid's max_items, kv head, role) encodes the sequence's new page of the head
// and role when it has one, then writes its token's row into the ring. The new token's ring slot
// held a token older than the sequence's first unencoded one (the ring keeps every unencoded
// token), so the page never reads it; the barrier after the page's staging orders the two anyway.
// Blocks past the step's sequences exit. (Eager calls keep two kernels: their many-token rings
// and pages share slots, and a decode step encodes a page once in page_tokens steps, where a
// replay cannot skip the launch.)
template <bool Rotating>
__global__ void __launch_bounds__(threads) step_append_kernel(const __grid_constant__ append_params p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const int i = blockIdx.x, h = blockIdx.y, r = blockIdx.z, d = p.kv.head_dim;
  const append_table& t = *p.table;
  if (i >= t.n_items) return;
  const append_table::item& it = t.items[i];
  if (refused(p, it, h == 0 && r == 0 && threadIdx.x == 0)) return;
  const int page_end = i + 1 < t.n_items ? t.items[i + 1].page0 : t.pages;
  for (int pg = it.page0; pg < page_end; ++pg) {
    encode_page<Rotating>(p, t, pg, h, r, reinterpret_cast<uint16_t*>(smem_raw));
    __syncthreads();  // the staged rows are read before the next page's staging
  }
  uint16_t* dst = ring_of(p, it, h, r) + size_t(it.n % p.kv.window) * d;
  if (Rotating && head_rotated(p.rot, h)) {
    if (threadIdx.x < 32) rotated_row(p, r, it.src_row, h, threadIdx.x, dst);
  } else {
    for (int c = threadIdx.x; c < d; c += threads) dst[c] = src_half(p, r, it.src_row, h, c);
  }
}

// The ring keeps the last `window` tokens: write each item's new tokens that remain among them
// (grid y: the item). A thread writes 8 channels of one (token, head, role) row with one 16-byte
// store; 32-bit index math (a row count times d fits easily).
__global__ void ring_kernel(const __grid_constant__ append_params p) {
  const append_table::item& it = p.step.items[blockIdx.y];
  if (refused(p, it, blockIdx.x == 0 && threadIdx.x == 0)) return;
  const int32_t first = max(it.n, it.n + it.m - p.kv.window);
  const int d8 = p.kv.head_dim / 8, rows = (it.n + it.m - first) * p.kv.kv_heads * 2;
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < rows * d8; idx += gridDim.x * blockDim.x) {
    const int c = (idx % d8) * 8, row = idx / d8;
    const int r = row % 2, h = (row / 2) % p.kv.kv_heads;
    const int32_t j = first + row / (2 * p.kv.kv_heads);
    const int64_t src_row = it.src_row + (j - it.n);
    uint16_t x[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = src_half(p, r, src_row, h, c + i);
    *reinterpret_cast<uint4*>(ring_of(p, it, h, r) + size_t(j % p.kv.window) * p.kv.head_dim + c) =
        make_uint4(x[0] | uint32_t(x[1]) << 16, x[2] | uint32_t(x[3]) << 16, x[4] | uint32_t(x[5]) << 16,
                   x[6] | uint32_t(x[7]) << 16);
  }
}

// `ring_kernel` for a layer with rotated heads (a kernel of its own: the plain one keeps its
// registers): a warp per (token, head, role) row, rotated where the head is.
__global__ void ring_rotated_kernel(const __grid_constant__ append_params p) {
  const append_table::item& it = p.step.items[blockIdx.y];
  if (refused(p, it, blockIdx.x == 0 && threadIdx.x == 0)) return;
  const int32_t first = max(it.n, it.n + it.m - p.kv.window);
  const int rows = (it.n + it.m - first) * p.kv.kv_heads * 2;
  const int lane = threadIdx.x % 32, warps = gridDim.x * blockDim.x / 32;
  for (int row = (blockIdx.x * blockDim.x + threadIdx.x) / 32; row < rows; row += warps) {
    const int r = row % 2, h = (row / 2) % p.kv.kv_heads;
    const int32_t j = first + row / (2 * p.kv.kv_heads);
    const int64_t src_row = it.src_row + (j - it.n);
    uint16_t* dst = ring_of(p, it, h, r) + size_t(j % p.kv.window) * p.kv.head_dim;
    if (head_rotated(p.rot, h))
      rotated_row(p, r, src_row, h, lane, dst);
    else
      for (int c = lane; c < p.kv.head_dim; c += 32) dst[c] = src_half(p, r, src_row, h, c);
  }
}

// The checks of an append call (`detail::check_append`), then its per-call part written into `t`,
// the items' source rows counted from `first_row`; `max_m`: its longest item. `t` is written only
// after every check passed.
status fill_table(const append_args& a, int first_row, bool check_rows, append_table& t, int& max_m) {
  const auto& kv = a.kv;
  if (kv.kv_heads > max_kv_heads)
    return {errc::unsupported, msg("append: kv_heads ", kv.kv_heads, " above ", max_kv_heads)};
  int pages = 0;
  KVQ_TRY(detail::check_append(a, check_rows, &kernels_read, pages, max_m));
  t.n_items = int(a.items.size());
  t.pages = pages;
  int row = first_row, page = 0;
  for (size_t i = 0; i < a.items.size(); ++i) {
    const append_seq& it = a.items[i];
    t.items[i] = {it.slot, it.n, it.e, it.m, it.window_unit, row, it.first_page, page, it.ring_from};
    for (int k = 0; k < it.pages; ++k) t.page_item[page + k] = uint8_t(i);
    row += it.m;
    page += it.pages;
  }
  for (int i = 0; i < pages; ++i) {
    t.page_blocks[i] = a.page_blocks[i];
    for (int j = 0; j < kv.kv_heads * 2; ++j) t.page_fmts[i][j] = a.page_fmts[i * kv.kv_heads * 2 + j];
  }
  return {};
}

// The launch parameters shared by every call of a layer (`a`'s items and pages not read).
void set_layer(const append_args& a, append_params& p) {
  p.arena = a.arena;
  p.rings = a.windows ? a.windows : a.arena;
  p.blocks = a.blocks;
  p.fmts = a.fmts;
  p.kv = a.kv;
  p.layer = a.layer;
  detail::set_kv_rows(a.k, a.v, p);
  for (int j = 0; j < a.kv.kv_heads * 2; ++j) p.clip[j] = a.clip ? a.clip[j] : codec::no_clip;
  p.levels = a.levels;
  p.rot = a.rotation;
  p.guard = a.guard;
}

// The encoder over the call's pages (when any), then the ring write of its items of at most
// `max_m` tokens each.
status launch_append(const append_params& p, int max_m, cudaStream_t st) {
  const auto& kv = p.kv;
  const bool rotating = p.rot.mask != 0;
  const int pages = p.step.pages, items = p.step.n_items;
  if (pages > 0) {  // before the ring kernel: pages read ring slots that the new tokens overwrite
    const int smem = kv.page_tokens * kv.head_dim * 2;
    const auto kernel = rotating ? encode_kernel<true> : encode_kernel<false>;
    KVQ_TRY(detail::set_max_dynamic_smem(kernel, smem));
    KVQ_TRY(detail::launch("append launch (encode)", kernel, dim3(unsigned(pages), unsigned(kv.kv_heads), 2),
                           dim3(threads), size_t(smem), st, p));
  }
  const int64_t ring_chunks = int64_t(std::min(max_m, kv.window)) * kv.kv_heads * 2 * (kv.head_dim / 8);
  const int blocks = int(std::min<int64_t>(1024, (ring_chunks + 255) / 256));
  const dim3 ring_grid(unsigned(std::max(1, blocks)), unsigned(items));
  return detail::launch("append launch (ring)", rotating ? ring_rotated_kernel : ring_kernel, ring_grid,
                        dim3(256), 0, st, p);
}

}  // namespace

status append_run(const append_args& a, void* stream) {
  append_params p{};
  int max_m = 0;
  KVQ_TRY(fill_table(a, 0, true, p.step, max_m));
  if (a.items.empty()) return {};
  if (a.guard.held && a.guard.check) KVQ_TRY(check_append_values(a, stream));
  set_layer(a, p);
  return launch_append(p, max_m, static_cast<cudaStream_t>(stream));
}

namespace detail {

size_t append_table_bytes(int max_items) {
  return offsetof(append_table, items) + size_t(max_items) * sizeof(append_table::item);
}

status fill_append_table(const append_args& a, int first_row, void* table) {
  int max_m = 0;
  KVQ_TRY(fill_table(a, first_row, false, *static_cast<append_table*>(table), max_m));
  if (max_m > 1)
    return {errc::invalid_argument, msg("append: a replayed step appends one token per sequence, not ", max_m)};
  return {};
}

status launch_append_replay(const append_args& a, const void* table, int max_items, void* stream) {
  if (max_items < 1 || max_items > max_append_pages)
    return {errc::invalid_argument,
            msg("append: a replayed call takes 1 to ", max_append_pages, " sequences, not ", max_items)};
  append_params p{};
  set_layer(a, p);
  p.table = static_cast<const append_table*>(table);
  // One launch: a block per (sequence, kv head, role) encodes the sequence's page, if any (one
  // token per sequence encodes at most one), and writes its token into the ring.
  const int smem = a.kv.page_tokens * a.kv.head_dim * 2;
  const auto kernel = p.rot.mask != 0 ? step_append_kernel<true> : step_append_kernel<false>;
  KVQ_TRY(detail::set_max_dynamic_smem(kernel, smem));
  return detail::launch("append launch (replay)", kernel, dim3(unsigned(max_items), unsigned(a.kv.kv_heads), 2),
                        dim3(threads), size_t(smem), static_cast<cudaStream_t>(stream), p);
}

}  // namespace detail
}  // namespace cuda
KVQ_NAMESPACE_END
