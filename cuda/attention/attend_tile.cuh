#pragma once
// The tile kernel `attend_kernel` (more than 8 query rows per kv head: extend, chunked prefill,
// speculative decoding with big groups). Grid (split, kv head x 16-row query tile, sequence); per
// 64-token tile the 4 warps dequantize the page's K and V into shared memory as fp16 (one
// warp-uniform branch per page format, 16-byte loads, codes turned into halves by byte-permute /
// magic-number bit tricks). KIVI keys keep their raw codes: the per-channel scale is folded into
// the query (q' = q * s per token group) and the zero point into one dot product per row (q . z).
// Each warp owns 16 tokens of the tile: S = Q K^T and O += P V with mma.sync m16n8k16 (fp16
// operands, fp32 accumulation), online softmax in fp32 registers.
#include "attention/mma_tile.cuh"
#include "attention/tile_pages.cuh"

#include <climits>
#include <cmath>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// Raw ring of the copy pipeline: two FP16 tiles (the largest) for head_dim 128; four for 64; at
// 256, one FP16 tile and room for the warps' merge area, which overlays the ring after the loop.
template <int D>
constexpr uint32_t raw_ring_bytes = D >= 256 ? 72 * 1024 : 64 * 1024;

template <int D>
struct attend_smem {
  uint8_t raw[raw_ring_bytes<D>];  // in-flight page bytes, tile after tile
  __half k[tile_tokens * D];       // the tile's keys (values or centered codes), swizzled
  __half v[tile_tokens * D];       // the tile's values, swizzled
  __half qh[16 * D];               // the query tile, fp16, swizzled
  __half qs[2][16 * D];            // KIVI keys: query scaled by each token group's channel scales
  float cz[2][16];                 // KIVI keys: q . (z + s 2^(b-1)) per token group and row
  tile_table tiles;                // page lookups of this block's tiles
  tile_src slot[pipeline_tiles];   // tiles in flight, written by the producer warp
  uint32_t slot_at[pipeline_tiles];
};

template <int D>
__global__ void __launch_bounds__(threads, 2) attend_kernel(const __grid_constant__ attend_params p) {
  pdl_trigger();
  extern __shared__ __align__(16) uint8_t smem_raw[];
  attend_smem<D>& sm = *reinterpret_cast<attend_smem<D>*>(smem_raw);
  const int split = blockIdx.x, h = blockIdx.y / p.mtiles, mt = blockIdx.y % p.mtiles;
  const decode_item item = p.items[blockIdx.z];
  const int rows_used = p.group * item.q_len;
  if (mt * 16 >= rows_used) return;
  const int page_tiles = ceil_div(item.from_pages, tile_tokens);
  const int T = page_tiles + ceil_div(item.n - item.from_pages, tile_tokens);
  const int t0 = item_skip(p, item) + split * p.tiles_per_split, t1 = min(T, t0 + p.tiles_per_split);
  if (t0 >= T) return;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  constexpr uint32_t ring_bytes = raw_ring_bytes<D>;
  const uint32_t raw_base = smem_addr(sm.raw);

  // The copy pipeline: warp 0 issues tiles in order into the raw ring while space and group slots
  // last, and publishes each tile's description in a shared slot; a tile's bytes are freed once
  // it is dequantized. Only warp 0 keeps the counters and waits on the copy groups.
  load_tile_table<D>(p, item, h, t0, t1, sm.tiles);
  __syncthreads();
  uint32_t pipe_end[pipeline_tiles];
  tile_pump<D, ring_bytes> pipe(t0, t1, pipe_end);
  const auto pump = [&](int consumed_upto) {
    pipe.run(p, item, h, t0, sm.tiles, sm.slot, sm.slot_at, raw_base, lane, consumed_upto);
  };
  if (warp == 0) pump(t0);

  // query tile: row r -> query i = (mt*16 + r) / group, head h*group + (mt*16 + r) % group
  for (int idx = tid; idx < 16 * D; idx += threads) {
    const int r = idx / D, c = idx % D, mm = mt * 16 + r;
    float x = 0.f;
    if (mm < rows_used) {
      const int i = mm / p.group, qh = h * p.group + mm % p.group;
      x = load_any(p.q, p.q_type, int64_t(item.q_row + i) * p.q_stride + int64_t(qh) * D + c);
    }
    sm.qh[swz<D>(r, c / 8) + c % 8] = __float2half_rn(x);
    sm.qs[0][idx] = sm.qs[1][idx] = __float2half_rn(0.f);
  }

  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  float acc[1][D / 8][4];  // one m-tile of 16 query rows
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[0][j][0] = acc[0][j][1] = acc[0][j][2] = acc[0][j][3] = 0.f;
  const int q_first = item.n - item.q_len;  // position of query 0
  // last visible token of this lane's two rows (lane/4 and lane/4 + 8): causal mask bound
  // (a prefix call: every row sees all n tokens)
  const int last_visible[2] = {p.prefix ? item.n - 1 : q_first + (mt * 16 + lane / 4) / p.group,
                               p.prefix ? item.n - 1 : q_first + (mt * 16 + lane / 4 + 8) / p.group};
  // a sliding layer: the first token each row sees (its query stands at q_first + i, or, in a
  // prefix call, at the prefix's end + the item's first query + i); none below 0 otherwise
  const int q_pos0 = p.prefix ? item.n + item.q_row : q_first, w = p.window > 0 ? p.window - 1 : INT_MAX / 2;
  const int first_visible[2] = {q_pos0 + (mt * 16 + lane / 4) / p.group - w, q_pos0 + (mt * 16 + lane / 4 + 8) / p.group - w};

  for (int t = t0; t < t1; ++t) {
    if (warp == 0) cp_wait_dyn(pipe.issued - t - 1);  // this tile's copies have landed
    __syncthreads();  // ... visible to all; the previous tile is consumed
    const tile_src s = sm.slot[t % pipeline_tiles];
    const uint8_t* raw = sm.raw + sm.slot_at[t % pipeline_tiles];
    bool k_codes = false;
    int groups_base = 0, G = 1;
    tile_to_fp16<D>(s, raw, sm.k, sm.v, p.kv.page_tokens);
    if (!s.ring) {
      const format_traits fk = traits_of(s.fk);
      k_codes = fk.k_along_tokens() && !tile_reads_by_element(fk);  // (by element: values, the plain query)
      if (k_codes) {
        // fold the channel scales into the query and the zero points into one dot product per row
        G = fk.group;
        groups_base = s.row0 >> log2i(G);
        const int ngroups = G >= tile_tokens ? 1 : tile_tokens >> log2i(G);
        const float mid = float(1 << (fk.bits - 1));  // codes are centered by 2^(b-1)
        const __half* sc = reinterpret_cast<const __half*>(raw + s.size[0][0]);
        const __half* zr = reinterpret_cast<const __half*>(raw + s.size[0][0] + s.size[0][1]);
        const int r = tid / 8, c0 = (tid % 8) * (D / 8);
        // rows of padding (beyond group x q_len) stay zero: skip warps that hold only those
        for (int gi = 0; gi < ngroups && warp * 4 < rows_used - mt * 16; ++gi) {
          float cz = 0.f;
#pragma unroll
          for (int c = c0; c < c0 + D / 8; c += 2) {
            const float2 s2 = __half22float2(*reinterpret_cast<const __half2*>(sc + gi * D + c));
            const float2 z2 = __half22float2(*reinterpret_cast<const __half2*>(zr + gi * D + c));
            const float2 q2 = __half22float2(*reinterpret_cast<const __half2*>(&sm.qh[swz<D>(r, c / 8) + c % 8]));
            *reinterpret_cast<__half2*>(&sm.qs[gi][swz<D>(r, c / 8) + c % 8]) = __floats2half2_rn(q2.x * s2.x, q2.y * s2.y);
            cz += q2.x * fmaf(s2.x, mid, z2.x) + q2.y * fmaf(s2.y, mid, z2.y);
          }
          cz += __shfl_xor_sync(0xffffffffu, cz, 1);
          cz += __shfl_xor_sync(0xffffffffu, cz, 2);
          cz += __shfl_xor_sync(0xffffffffu, cz, 4);
          if (tid % 8 == 0) sm.cz[gi][r] = cz;
        }
      }
    }
    __syncthreads();  // tile ready; its raw bytes are free
    if (warp == 0) {
      pipe.release(t);
      pump(t + 1);  // keep the copies flowing while the tensor cores work
    }

    // ---- S = Q K^T for this warp's 16 tokens ----
    const int tok0 = s.tok0, valid = s.valid;
    const int wrow = warp * 16;
    const int gsel = k_codes ? ((s.row0 + wrow) >> log2i(G)) - groups_base : 0;
    const __half* qa = k_codes ? sm.qs[gsel] : sm.qh;
    float sc4[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a0, a1, a2, a3, b0, b1, b2, b3;
      ldsm_x4(smem_addr(qa + swz<D>((lane % 8) + ((lane / 8) % 2) * 8, ks * 2 + lane / 16)), a0, a1, a2, a3);
      ldsm_x4(smem_addr(sm.k + swz<D>(wrow + (lane / 16) * 8 + lane % 8, ks * 2 + (lane / 8) % 2)), b0, b1, b2, b3);
      mma16816(sc4[0], a0, a1, a2, a3, b0, b1);
      mma16816(sc4[1], a0, a1, a2, a3, b2, b3);
    }
    // ---- scale, zero-point term, mask, online softmax ----
    const int r_lo = lane / 4;
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = r_lo + (e / 2) * 8;
        const int j = tok0 + wrow + nt * 8 + (lane % 4) * 2 + (e % 2);
        float x = sc4[nt][e];
        if (k_codes) x += sm.cz[gsel][r];
        if (p.softcap_log2 > 0.f) x = score_cap(p.softcap_log2, p.scale_log2)(x);
        const bool ok = (j - tok0) < valid && j <= last_visible[e / 2] && j >= first_visible[e / 2];
        sc4[nt][e] = ok ? x : -INFINITY;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], sc4[nt][e]);
      }
    uint32_t pf[1][2][2];
    row_softmax_step<2, D>(sc4, p.scale_log2, tile_max, row_max, row_sum, acc[0], pf[0]);
    pv_mma_tile<D, 1, 1>(sm.v + wrow * D, pf, acc);  // O += P V over the warp's 16 tokens
  }

  // ---- merge the 4 warps, write this split's partial (max, sum, unnormalized O) ----
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    row_sum[hr] += __shfl_xor_sync(0xffffffffu, row_sum[hr], 1);
    row_sum[hr] += __shfl_xor_sync(0xffffffffu, row_sum[hr], 2);
  }
  __syncthreads();
  float* wo = reinterpret_cast<float*>(sm.raw);  // [4 warps][16][D] floats
  float* wml = wo + 4 * 16 * D;                  // [4 warps][16][2]
  static_assert(sizeof(float) * (4 * 16 * D + 4 * 16 * 2) <= raw_ring_bytes<D>, "merge area fits the raw ring");
  const int r_lo = lane / 4;
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      wo[(warp * 16 + r_lo + (e / 2) * 8) * D + j * 8 + (lane % 4) * 2 + (e % 2)] = acc[0][j][e];
  if (lane % 4 == 0)
    for (int hr = 0; hr < 2; ++hr) {
      wml[(warp * 16 + r_lo + hr * 8) * 2] = row_max[hr];
      wml[(warp * 16 + r_lo + hr * 8) * 2 + 1] = row_sum[hr];
    }
  __syncthreads();
  const size_t part = ((size_t(blockIdx.z) * p.kv.kv_heads + h) * p.mtiles + mt) * p.max_splits + split;
  for (int idx = tid; idx < 16 * D; idx += threads) {
    const int r = idx / D, c = idx % D;
    float m = -INFINITY;
    for (int w = 0; w < 4; ++w) m = fmaxf(m, wml[(w * 16 + r) * 2]);
    float o = 0.f, l = 0.f;
    for (int w = 0; w < 4; ++w) {
      const float mw = wml[(w * 16 + r) * 2];
      const float f = mw == -INFINITY ? 0.f : exp2f(mw - m);
      o += f * wo[(w * 16 + r) * D + c];
      l += f * wml[(w * 16 + r) * 2 + 1];
    }
    p.ws_o[part * 16 * D + idx] = o;
    if (c == 0) {
      p.ws_ml[(part * 16 + r) * 2] = m;
      p.ws_ml[(part * 16 + r) * 2 + 1] = l;
    }
  }
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
