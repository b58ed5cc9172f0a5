// The undo record of a multi-launch append (ring_undo.hpp).
#include <algorithm>
#include <kvq/store/window_layout.hpp>

#include "launch.hpp"
#include "ring_undo.hpp"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {
namespace {

constexpr int undo_items = 1024;

struct undo_params {
  uint8_t* arena;
  uint16_t* saved;
  int layer, kv_heads, window, head_dim, n_items;
  bool save;
  ring_rows items[undo_items];
};

// Grid (chunks, item); a thread moves 16 bytes (8 channels) of one (token, kv head, role) row.
__global__ void ring_undo_kernel(const __grid_constant__ undo_params p) {
  const ring_rows& it = p.items[blockIdx.y];
  const int d8 = p.head_dim / 8, rows = it.count * p.kv_heads * 2;
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < rows * d8; idx += gridDim.x * blockDim.x) {
    const int c = (idx % d8) * 8, row = idx / d8, hr = row % (2 * p.kv_heads), t = row / (2 * p.kv_heads);
    const int32_t j = it.first + t;
    uint4* ring = reinterpret_cast<uint4*>(reinterpret_cast<uint16_t*>(p.arena + size_t(it.window_unit) * block_unit) +
                                           ring_halves(p.layer, p.kv_heads, hr / 2, hr % 2, p.window, p.head_dim) +
                                           size_t(j % p.window) * p.head_dim + c);
    uint4* saved =
        reinterpret_cast<uint4*>(p.saved + (size_t(it.saved_row + t) * 2 * p.kv_heads + hr) * p.head_dim + c);
    if (p.save)
      *saved = *ring;
    else
      *ring = *saved;
  }
}

}  // namespace

status ring_undo(const paged_view& kv, uint8_t* arena, int layer, std::span<const ring_rows> rows, uint16_t* saved,
                 bool save, void* stream) {
  undo_params p{};
  p.arena = arena;
  p.saved = saved;
  p.layer = layer;
  p.kv_heads = kv.kv_heads;
  p.window = kv.window;
  p.head_dim = kv.head_dim;
  p.save = save;
  for (size_t first = 0; first < rows.size(); first += undo_items) {
    const size_t count = std::min<size_t>(undo_items, rows.size() - first);
    int most = 1;
    for (size_t i = 0; i < count; ++i) {
      p.items[i] = rows[first + i];
      most = std::max(most, int(rows[first + i].count));
    }
    p.n_items = int(count);
    const int64_t chunks = int64_t(most) * kv.kv_heads * 2 * (kv.head_dim / 8);
    const unsigned blocks = unsigned(std::clamp<int64_t>((chunks + 255) / 256, 1, 1024));
    KVQ_TRY(launch(save ? "append undo record (save)" : "append undo record (restore)", ring_undo_kernel,
                   dim3(blocks, unsigned(count)), dim3(256), 0, static_cast<cudaStream_t>(stream), p));
  }
  return {};
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
