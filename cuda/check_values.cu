// The value check of appends on the device (`append_guard`, include/kvq/cuda/paged_attention.hpp):
// a row of K or V with a NaN, an Inf or a value beyond the fp16 range marks its sequence's slot
// held and fills the fault record; the append kernels then write nothing for held slots. No
// synchronization: the caller reads the record when it synchronizes anyway (KVCache::check).
#include <cuda_runtime.h>

#include <algorithm>
#include <kvq/cuda/paged_attention.hpp>
#include <kvq/format/numeric.hpp>

#include "dtype.cuh"
#include "launch.hpp"
#include "status.hpp"

KVQ_NAMESPACE_BEGIN
namespace cuda {
namespace {

using detail::cuda_status;
using detail::launch;
using detail::load_any;
using detail::msg;

struct check_params {
  const void* src[2];  // set_kv_rows
  dtype src_type[2];
  int64_t src_stride[2];  // elements between rows
  int row_elems;      // kv_heads * head_dim
  int layer;
  int n_items;
  int32_t row_end[max_append_items];  // the items' rows end here (cumulative)
  int32_t slot[max_append_items];
  int32_t n[max_append_items];
  int64_t seq[max_append_items];
  append_guard g;
};

// A warp per row (both roles): any bad value holds the row's slot; the first refused row of the
// record (count 0 before it) names itself.
__global__ void check_kernel(const __grid_constant__ check_params p, int32_t rows) {
  const int lane = threadIdx.x % 32, warps = gridDim.x * blockDim.x / 32;
  for (int32_t row = (blockIdx.x * blockDim.x + threadIdx.x) / 32; row < rows; row += warps) {
    bool bad = false;
    for (int r = 0; r < 2; ++r)
      for (int c = lane; c < p.row_elems; c += 32)
        bad |= !(fabsf(load_any(p.src[r], p.src_type[r], int64_t(row) * p.src_stride[r] + c)) <= fp16_max);
    if (!__any_sync(0xffffffffu, bad) || lane != 0) continue;
    int i = 0;
    while (p.row_end[i] <= row) ++i;  // (at most max_append_items items)
    p.g.held[p.slot[i]] = 1;
    if (atomicAdd(&p.g.fault->count, 1) == 0) {
      p.g.fault->layer = p.layer;
      p.g.fault->seq = p.seq[i];
      p.g.fault->token = int64_t(p.n[i]) + (row - (i > 0 ? p.row_end[i - 1] : 0));
    }
  }
}

__global__ void copy_guard_kernel(append_guard g, int layers, int src, int dst) {
  for (int i = threadIdx.x; i < layers * 3; i += blockDim.x)
    g.since[size_t(dst) * layers * 3 + i] = g.since[size_t(src) * layers * 3 + i];
  if (threadIdx.x == 0) g.held[dst] = g.held[src];
}

}  // namespace

static_assert(sizeof(append_fault) == 24, "detail::cuda_guard_bytes counts 24 bytes");

status check_append_values(const append_args& a, void* stream) {
  const append_guard& g = a.guard;
  if (!g.held || !g.since || !g.fault)
    return {errc::invalid_argument, "check_append_values: the guard's held, since and fault must all be set"};
  if (a.items.size() > size_t(max_append_items))
    return {errc::invalid_argument,
            msg("check_append_values: ", a.items.size(), " sequences in one call, at most ", max_append_items)};
  check_params p{};
  detail::set_kv_rows(a.k, a.v, p);
  p.row_elems = a.kv.kv_heads * a.kv.head_dim;
  p.layer = a.layer;
  p.n_items = int(a.items.size());
  p.g = g;
  int32_t rows = 0;
  for (size_t i = 0; i < a.items.size(); ++i) {
    rows += a.items[i].m;
    p.row_end[i] = rows;
    p.slot[i] = a.items[i].slot;
    p.n[i] = a.items[i].n;
    p.seq[i] = a.items[i].seq;
  }
  if (rows != a.k.tokens || rows != a.v.tokens)
    return {errc::invalid_argument, msg("check_append_values: the items append ", rows, " tokens, K has ",
                                        a.k.tokens, " and V ", a.v.tokens)};
  if (rows == 0) return {};
  const int blocks = int(std::min<int64_t>(1024, (int64_t(rows) + 7) / 8));  // 8 warps a block
  return launch("append launch (value check)", check_kernel, dim3(unsigned(blocks)), dim3(256), 0,
                static_cast<cudaStream_t>(stream), p, rows);
}

status clear_guard(const append_guard& g, int layers, int slot, int count, void* stream) {
  if (!g.held) return {};
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  KVQ_TRY(cuda_status(cudaMemsetAsync(g.held + slot, 0, size_t(count), st), "cudaMemsetAsync (guard)"));
  return cuda_status(cudaMemsetAsync(g.since + size_t(slot) * layers * 3, 0xff, size_t(count) * layers * 3 * 4, st),
                     "cudaMemsetAsync (guard)");
}

status copy_guard(const append_guard& g, int layers, int src, int dst, void* stream) {
  if (!g.held) return {};
  return launch("fork launch (guard)", copy_guard_kernel, dim3(1), dim3(128), 0, static_cast<cudaStream_t>(stream),
                g, layers, src, dst);
}

}  // namespace cuda
KVQ_NAMESPACE_END
