#pragma once
// The chunk kernels of a prefill (docs/architecture.md, "Prefill of any length"):
// - `stage_chunk_kernel`: the chunk's K and V as the ring would hold them, fp16 [kv_heads][T][D]
//   per role, rotated first on rotated heads (the append's arithmetic, so the values equal the
//   ring's);
// - `chunk_kernel`: the chunk's causal self-attention over those fp16 K/V, FlashAttention-2
//   style: a block of 4 warps takes 128 query rows of one kv head (64 at head_dim 256; row = query
//   x GQA group + head, as the tile kernel orders them), each warp 32 rows (16) as two m-tiles that
//   share every K and V fragment (attention/mma_tile.cuh), their query fragments read from shared
//   memory; 64-token K/V tiles come through a two-stage cp.async pipeline into swizzled shared
//   memory; S = Q K^T and O += P V with mma.sync m16n8k16 (fp16 operands, fp32 accumulation),
//   online softmax in fp32 registers. Each warp writes its rows' partial (max, sum, unnormalized
//   O, base 2) as the last split of the split merge's workspace, which merges it with the prefix
//   part by log-sum-exp.
#include <climits>
#include <cmath>

#include "attention/dequant.cuh"
#include "attention/mma_tile.cuh"
#include "attention/params.cuh"
#include "rotation.cuh"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

struct chunk_params {
  const __half* ck;  // [kv_heads][T][D] fp16 keys of the chunk
  const __half* cv;  // [kv_heads][T][D] fp16 values
  const void* q;     // [T][q_heads][D] (rotated already on rotated heads)
  dtype q_type;
  int64_t q_stride;
  int T;     // chunk tokens
  int q0;    // first query of this launch
  int rows;  // query rows of this launch: its queries x group
  int group, kv_heads;
  int item_rows;  // rows per item of the split merge (prefill_item_queries x group)
  int mtiles, max_splits;
  float scale_log2;
  int window;          // a sliding layer: chunk query i sees chunk tokens i - window + 1 .. i (0: 0 .. i)
  float softcap_log2;  // soft-capping (`attend_params::softcap_log2`), 0: off
  float* ws_o;   // [partials][16][D]
  float* ws_ml;  // [partials][16][2]
};

// One warp per (token, kv head, role): D/32 channels per lane, rotated on a rotated head, rounded
// to fp16. Grid: ceil(T x kv_heads x 2 / 4) blocks of 128 threads.
template <int D>
__global__ void __launch_bounds__(128) stage_chunk_kernel(tensor_view k, tensor_view v, int layer, head_rotation rot,
                                                          __half* out /* [2][kv_heads][T][D] */) {
  constexpr int per_lane = D / 32;
  const int lane = threadIdx.x % 32, w = blockIdx.x * 4 + threadIdx.x / 32;
  const int H = k.heads, T = int(k.tokens);
  if (w >= T * H * 2) return;  // (warp-uniform)
  const int r = w / (T * H), h = (w / T) % H, t = w % T;
  const tensor_view& src = r == 0 ? k : v;
  float x[per_lane];
#pragma unroll
  for (int i = 0; i < per_lane; ++i)
    x[i] = load_any(src.data, src.type, int64_t(t) * src.stride() + h * D + lane * per_lane + i);
  if (head_rotated(rot, h)) warp_rotate<per_lane>(x, lane, rot.seed, layer, h, false);
  __half* dst = out + ((size_t(r) * H + h) * T + t) * D + lane * per_lane;
#pragma unroll
  for (int i = 0; i < per_lane; ++i) dst[i] = __float2half_rn(x[i]);
}

template <int D>
struct chunk_smem {
  __half q[prefill_block_rows(D) * D];  // the block's query rows, swizzled
  __half k[2][tile_tokens * D];  // key tiles (two stages), swizzled
  __half v[2][tile_tokens * D];  // value tiles
};

// Copies key/value tile `t` (tokens [64 t, 64 t + 64) of kv head h) into stage `st`; rows past T
// are zero (their scores are masked, and P V must not meet garbage).
template <int D>
__device__ __forceinline__ void chunk_tile_copy(const chunk_params& p, int h, int t, chunk_smem<D>& sm, int st) {
  const size_t at = (size_t(h) * p.T + size_t(t) * tile_tokens) * D;
  copy_tile_rows<D>(sm.k[st], p.ck + at, p.T - t * tile_tokens);
  copy_tile_rows<D>(sm.v[st], p.cv + at, p.T - t * tile_tokens);
  cp_commit();
}

// Grid (row blocks of `prefill_block_rows` rows x kv heads): blockIdx.x takes the kv heads
// fastest and the row blocks from the last (longest) down, so that over all heads the blocks with
// the most key tiles start first and the short ones fill the tail.
template <int D>
__global__ void __launch_bounds__(threads, 2) chunk_kernel(const __grid_constant__ chunk_params p) {
  constexpr int M = prefill_warp_mtiles<D>, rows = prefill_block_rows(D);
  extern __shared__ __align__(16) uint8_t smem_raw[];
  chunk_smem<D>& sm = *reinterpret_cast<chunk_smem<D>*>(smem_raw);
  const int h = int(blockIdx.x) % p.kv_heads;
  const int row0 = (int(gridDim.x) / p.kv_heads - 1 - int(blockIdx.x) / p.kv_heads) * rows;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // the last query of the block's rows bounds its key tiles
  const int q_last = min(p.T - 1, p.q0 + (min(row0 + rows, p.rows) - 1) / p.group);
  const int tiles = q_last / tile_tokens + 1;
  // a sliding layer: from the tile of the block's first query's first key on
  const int w = p.window > 0 ? p.window - 1 : INT_MAX / 2;
  const int t_first = max(0, p.q0 + min(row0, p.rows - 1) / p.group - w) / tile_tokens;
  chunk_tile_copy<D>(p, h, t_first, sm, t_first % 2);

  // query rows: row rr -> query q0 + rr / group, head h * group + rr % group
  for (int idx = tid; idx < rows * D; idx += threads) {
    const int r = idx / D, c = idx % D, rr = row0 + r;
    float x = 0.f;
    if (rr < p.rows) {
      const int i = p.q0 + rr / p.group, qh = h * p.group + rr % p.group;
      x = load_any(p.q, p.q_type, int64_t(i) * p.q_stride + int64_t(qh) * D + c);
    }
    sm.q[swz<D>(r, c / 8) + c % 8] = __float2half_rn(x);
  }
  const int wrow = warp * 16 * M;  // the warp's first row in the block
  const bool active = row0 + wrow < p.rows;  // (warp-uniform) rows of padding only: no math

  const int r_lo = lane / 4;
  // the query of each of this lane's rows ([m-tile][row half]): its last visible chunk token
  int last_visible[M][2];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) last_visible[m][hr] = p.q0 + (row0 + wrow + 16 * m + r_lo + 8 * hr) / p.group;
  const int first_visible = p.q0 + (row0 + wrow) / p.group;  // (the least of them over the warp)
  // a sliding layer: the first key of the warp's last used row, from which every row sees
  const int warp_first = max(0, p.q0 + (min(row0 + wrow + 16 * M, p.rows) - 1) / p.group - w);
  float row_max[M][2], row_sum[M][2], acc[M][D / 8][4];
  rows_init<D, M>(row_max, row_sum, acc);

  for (int t = t_first; t < tiles; ++t) {
    const int st = t % 2;
    if (t + 1 < tiles) {
      chunk_tile_copy<D>(p, h, t + 1, sm, st ^ 1);
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();  // tile t (and, first, the query rows) visible to every warp
    if (active) {
      const int tok0 = t * tile_tokens;
      // ---- S = Q K^T: M x 16 rows x 64 tokens ----
      float s[M][8][4];
      qk_mma_tile<D, M>(sm.q, wrow, sm.k[st], s);
      // ---- causal mask, online softmax, O += P V ----
      uint32_t pf[M][8][2];  // P as fp16 pairs: [m-tile][n-tile][row half]
      const auto visible = [&](int m, int hr, int j) {
        return tok0 + j <= last_visible[m][hr] && tok0 + j < p.T && tok0 + j >= last_visible[m][hr] - w;
      };
      // every row of the warp sees the whole tile: its last token is in the chunk and at or before
      // the query of the warp's first row (`first_visible`), its first in every row's window
      const bool all = tok0 + tile_tokens - 1 <= first_visible && tok0 + tile_tokens <= p.T && tok0 >= warp_first;
      softmax_tile<D, M>(s, p.scale_log2, p.softcap_log2, all, visible, row_max, row_sum, acc, pf);
      pv_mma_tile<D, M>(sm.v[st], pf, acc);
    }
    __syncthreads();  // every warp is done with stage st before the next copy into it
  }
  if (!active) return;

  // ---- this warp's m-tiles (each 16 rows of one item): the partials of the merge's last split ----
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const int rr = row0 + wrow + 16 * m;
    if (rr >= p.rows) break;
    const int item = rr / p.item_rows, mt = (rr % p.item_rows) / 16;
    const size_t part = ((size_t(item) * p.kv_heads + h) * p.mtiles + mt) * p.max_splits + (p.max_splits - 1);
    store_warp_partial<D>(p.ws_o + part * 16 * D, p.ws_ml + part * 16 * 2, acc[m], row_max[m], row_sum[m]);
  }
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
