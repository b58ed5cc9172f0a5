// CUDA kernels of kvq: quantize-on-append (through the shared codec, so bytes equal the CPU's)
// and fused mixed-format paged decode/extend attention on tensor cores.
//
// Attention design (DESIGN.md section 5): two kernels and a log-sum-exp merge of their splits.
// - Decode (GQA group x q_len <= 8): warp-independent 16-token slabs with the MMA operands
//   swapped (see its section below). It serves the decode step, in two kernels by the layer's
//   widest page: `decode_kernel` (pages of at most 8 bits, staged into shared memory by bulk
//   copies) and `decode_wide_kernel` (a layer that holds a 16-bit page).
// - Tile (more query rows: speculative decoding with big groups, extend/chunked prefill):
//   `attend_kernel`. Grid (split, kv head x 16-row query tile, sequence); per 64-token tile the 4
//   warps dequantize the page's K and V into shared memory as fp16 (one warp-uniform branch per
//   page format, 16-byte loads, codes turned into halves by byte-permute / magic-number bit
//   tricks). KIVI keys keep their raw codes: the per-channel scale is folded into the query
//   (q' = q * s per token group) and the zero point into one dot product per row (q . z). Each
//   warp owns 16 tokens of the tile: S = Q K^T and O += P V with mma.sync m16n8k16 (fp16
//   operands, fp32 accumulation), online softmax in fp32 registers.
#include <kvq/codec/codec.hpp>
#include <kvq/cuda/paged_attention.hpp>

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "common.cuh"

#include <algorithm>
#include <cmath>
#include <type_traits>

KVQ_NAMESPACE_BEGIN
namespace cuda {
namespace {

constexpr int tile_tokens = 64;
constexpr int threads = 128;
constexpr int max_items = 256;
constexpr int max_kv_heads = 32;

using detail::cuda_status;
using detail::msg;
using detail::load_any;

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
// Group sizes, head_dim and page_tokens are powers of two: divisions become shifts (a runtime
// integer division costs dozens of instructions in the per-tile path).
__device__ __forceinline__ int log2i(int x) { return 31 - __clz(x); }

// Programmatic dependent launch (sm_90+): an attention kernel lets the split merge that follows it
// launch at once (`pdl_trigger`, first thing), so that the merge's launch and block scheduling
// overlap the attention's last wave; the merge waits for the attention grid's completion and
// memory (`pdl_wait`) before it touches any. Below sm_90 both compile to nothing and the merge
// is launched without the attribute (plain stream order).
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// ---------------------------------------------------------------------------------------------
// attention
// ---------------------------------------------------------------------------------------------

struct attend_params {
  paged_view kv;
  int layer, q_heads, group, mtiles;
  const void* q;
  int64_t q_stride;
  void* o;
  int64_t o_stride;
  dtype q_type, o_type;
  float scale_log2;
  int tiles_per_split, max_splits;
  int unit_tokens;  // tokens of a work unit: 64 (tile kernel) or 16 (decode kernel slabs)
  int stages, stage_cap;  // staged decode kernels: stages (per warp or per block), code bits
  uint32_t page_stage;           // block-staged decode kernel: bytes of a stage (a page-head's K and V), 0: not used
  float* ws_o;   // [partials][16][D]
  float* ws_ml;  // [partials][16][2]
  float* q_stage;  // optional: items' query rows copied here as fp32 (decode_item::stage_row)
  int n_items;
  decode_item items[max_items];
};

__device__ __forceinline__ void store_any(void* base, dtype t, int64_t i, float x) {
  switch (t) {
    case dtype::f32: static_cast<float*>(base)[i] = x; break;
    case dtype::f16: static_cast<__half*>(base)[i] = __float2half_rn(x); break;
    default: static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(x); break;
  }
}

// Shared-memory tiles are [rows][D] halves with 16-byte chunks XOR-swizzled by row, so that
// ldmatrix's 8 row addresses hit 8 different bank groups.
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t h2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 bits_h2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// Codes -> halves (1024 + code) by bit tricks. `out` receives channel pairs in order.
// 8-bit: one byte-permute per pair. 4-bit: split even/odd nibbles once per word, then one
// permute + one lop3 per pair. 2-bit likewise with four phases.
template <int Bits>
__device__ __forceinline__ void codes_to_magic(const uint32_t (&w)[4], uint32_t (&out)[64 / Bits]) {
  if constexpr (Bits == 8) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __byte_perm(w[i], 0x64646464u, 0x5140);
      out[2 * i + 1] = __byte_perm(w[i], 0x64646464u, 0x7342);
    }
  } else if constexpr (Bits == 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t ev = w[i] & 0x0F0F0F0Fu, od = (w[i] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
      for (int k = 0; k < 4; ++k)
        out[4 * i + k] = (__byte_perm(ev, od, k | (k << 4) | ((4 + k) << 8) | ((4 + k) << 12)) & 0x00FF00FFu) | 0x64006400u;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t c0 = w[i] & 0x03030303u, c1 = (w[i] >> 2) & 0x03030303u, c2 = (w[i] >> 4) & 0x03030303u,
                     c3 = (w[i] >> 6) & 0x03030303u;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t sel = k | (k << 4) | ((4 + k) << 8) | ((4 + k) << 12);
        out[8 * i + 2 * k] = (__byte_perm(c0, c1, sel) & 0x00FF00FFu) | 0x64006400u;
        out[8 * i + 2 * k + 1] = (__byte_perm(c2, c3, sel) & 0x00FF00FFu) | 0x64006400u;
      }
    }
  }
}

// One 16-byte chunk of integer codes (128/Bits channels of one token) -> halves in the tile.
template <int D, int Bits>
__device__ __forceinline__ void dequant_int_chunk(const uint32_t (&w)[4], format_traits f, bool k_codes,
                                                  const uint16_t* scales, const uint16_t* zeros, int tok, int ch0, int g,
                                                  uint4* out, int row) {
  constexpr int elems = 128 / Bits, pairs = elems / 2;
  uint32_t m[pairs];
  codes_to_magic<Bits>(w, m);
  if (k_codes) {  // centered codes: smaller terms to cancel against q . z
    const __half2 bias = __float2half2_rn(1024.f + float(1 << (Bits - 1)));
#pragma unroll
    for (int i = 0; i < pairs; ++i) m[i] = h2_bits(__hsub2(bits_h2(m[i]), bias));
  } else {
    const int lg = log2i(g), ng = D >> lg;
    const bool sym = f.fam == family::sym;
    const __half2 bias = __float2half2_rn(sym ? 1024.f + float(1 << (Bits - 1)) : 1024.f);
    // a chunk spans at most two groups (g >= 32); scales change only at 8-channel boundaries
#pragma unroll
    for (int q = 0; q < elems / 8; ++q) {
      const int gi = tok * ng + ((ch0 + 8 * q) >> lg);
      const __half2 s = __half2half2(__ushort_as_half(scales[gi]));
      const __half2 z = sym ? __float2half2_rn(0.f) : __half2half2(__ushort_as_half(zeros[gi]));
#pragma unroll
      for (int i = 4 * q; i < 4 * q + 4; ++i) m[i] = h2_bits(__hfma2(__hsub2(bits_h2(m[i]), bias), s, z));
    }
  }
#pragma unroll
  for (int k = 0; k < elems / 8; ++k) out[swz<D>(row, ch0 / 8 + k) / 8] = make_uint4(m[4 * k], m[4 * k + 1], m[4 * k + 2], m[4 * k + 3]);
}

// ---- the asynchronous copy pipeline --------------------------------------------------------------
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// Waits until at most n copy groups are pending (n is uniform; at most pipeline_tiles - 1).
__device__ __forceinline__ void cp_wait_dyn(int n) {
  switch (n) {
    case 0: cp_wait<0>(); break;
    case 1: cp_wait<1>(); break;
    case 2: cp_wait<2>(); break;
    case 3: cp_wait<3>(); break;
    case 4: cp_wait<4>(); break;
    case 5: cp_wait<5>(); break;
    case 6: cp_wait<6>(); break;
    default: cp_wait<7>(); break;
  }
}

constexpr int pipeline_tiles = 8;  // tiles in flight at most (cp.async groups)

// Where the bytes of one 64-token tile come from, and their sizes: the K and V code rows and up to
// two parameter sections per role (scales, zeros), each a contiguous, 16-byte aligned range of its
// page. A tile of the FP16 ring has only row copies.
struct tile_src {
  int tok0, valid, row0;
  bool ring;
  format_id fk, fv;
  const uint8_t* page[2];  // K, V page
  uint32_t size[2][3];     // [role][codes, params 1, params 2] bytes
  uint32_t from[2][3];     // offsets of those ranges inside the page
  __device__ uint32_t bytes() const { return size[0][0] + size[0][1] + size[0][2] + size[1][0] + size[1][1] + size[1][2]; }
};

// The byte ranges `rows` token rows starting at `row0` of a page need: codes, then up to two
// parameter sections (scales, zeros), each contiguous and 16-byte aligned. KIVI keys need the
// channel scales and zeros of the token groups the rows touch.
template <int D>
__device__ __forceinline__ void role_ranges(format_id fid, role r, int P, int row0, int rows, uint32_t (&size)[3],
                                            uint32_t (&from)[3]) {
  const format_traits f = traits_of(fid);
  const uint32_t row_bytes = (D * f.bits) >> 3, code_bytes = uint32_t(P) * row_bytes;
  size[0] = uint32_t(rows) * row_bytes;
  from[0] = uint32_t(row0) * row_bytes;
  size[1] = size[2] = 0;
  from[1] = from[2] = code_bytes;
  if (f.fam == family::fp8_e4m3) {
    size[1] = uint32_t(rows) * 4;
    from[1] += uint32_t(row0) * 4;
  } else if (f.fam == family::sym || (f.has_zero() && r == role::v)) {
    const uint32_t per_row = uint32_t(D >> log2i(f.group == 0 ? D : f.group)) * 2;
    size[1] = uint32_t(rows) * per_row;
    from[1] += uint32_t(row0) * per_row;
    if (f.has_zero()) {
      size[2] = size[1];
      from[2] = from[1] + uint32_t(P) * per_row;
    }
  } else if (f.has_zero()) {
    const int lg = log2i(f.group);
    const uint32_t ngroups = rows > f.group ? uint32_t(rows >> lg) : 1u;
    size[1] = size[2] = ngroups * D * 2;
    from[1] += uint32_t(row0 >> lg) * D * 2;
    from[2] = from[1] + uint32_t(P >> lg) * D * 2;
  }
}

// The FP16 ring of (layer, kv head) of a sequence: K, then V `window * D` halves later.
template <int D>
__device__ __forceinline__ const uint8_t* ring_base(const attend_params& p, const decode_item& item, int h) {
  return p.kv.arena + size_t(item.window_unit) * 256 + ((size_t(p.layer) * p.kv.kv_heads + h) * 2) * size_t(p.kv.window) * D * 2;
}

// Per-tile page lookups of one thread block, loaded once at kernel start (one memory latency for
// the whole split instead of one per tile): the K page's offset in 16-byte units and both formats.
constexpr int max_split_tiles = 256;
struct tile_table {
  uint32_t page16[max_split_tiles];
  format_id fk[max_split_tiles];
  format_id fv[max_split_tiles];
};

template <int D>
__device__ __forceinline__ void load_tile_table(const attend_params& p, const decode_item& item, int h, int t0, int t1,
                                                tile_table& tt) {
  const int page_tiles = ceil_div(item.from_pages, tile_tokens);
  for (int t = t0 + int(threadIdx.x); t < min(t1, page_tiles); t += threads) {
    const int page = (t * tile_tokens) >> log2i(p.kv.page_tokens);
    const size_t table_row = (size_t(item.slot) * p.kv.layers + p.layer) * p.kv.max_pages + page;
    const uint8_t* fm = p.kv.fmts + table_row * p.kv.kv_heads * 2;
    uint32_t off = 0;
    for (int hh = 0; hh < h; ++hh) off += p.kv.k_page_bytes[fm[2 * hh]] + p.kv.v_page_bytes[fm[2 * hh + 1]];
    tt.page16[t - t0] = uint32_t((size_t(p.kv.blocks[table_row]) * 256 + off) / 16);
    tt.fk[t - t0] = fm[2 * h];
    tt.fv[t - t0] = fm[2 * h + 1];
  }
}

template <int D>
__device__ __forceinline__ tile_src describe_tile(const attend_params& p, const decode_item& item, int h, int t, int t0,
                                                  const tile_table& tt) {
  tile_src s{};
  const int page_tiles = ceil_div(item.from_pages, tile_tokens);
  if (t < page_tiles) {
    s.ring = false;
    s.tok0 = t * tile_tokens;
    s.valid = min(tile_tokens, item.from_pages - s.tok0);
    s.row0 = s.tok0 & (p.kv.page_tokens - 1);
    s.fk = tt.fk[t - t0];
    s.fv = tt.fv[t - t0];
    s.page[0] = p.kv.arena + size_t(tt.page16[t - t0]) * 16;
    s.page[1] = s.page[0] + p.kv.k_page_bytes[s.fk];
    role_ranges<D>(s.fk, role::k, p.kv.page_tokens, s.row0, tile_tokens, s.size[0], s.from[0]);
    role_ranges<D>(s.fv, role::v, p.kv.page_tokens, s.row0, tile_tokens, s.size[1], s.from[1]);
  } else {
    s.ring = true;
    s.tok0 = item.from_pages + (t - page_tiles) * tile_tokens;
    s.valid = min(tile_tokens, item.n - s.tok0);
    s.row0 = 0;
    s.fk = s.fv = fp16_format;
    s.page[0] = ring_base<D>(p, item, h);
    s.page[1] = s.page[0] + size_t(p.kv.window) * D * 2;
    for (int r = 0; r < 2; ++r) {
      s.size[r][0] = tile_tokens * D * 2;
      s.size[r][1] = s.size[r][2] = 0;
    }
  }
  return s;
}

// Issues the copies of one tile into the raw ring at `dst` (shared address) from one warp (the
// producer); commits one group.
template <int D>
__device__ __forceinline__ void issue_tile(const tile_src& s, uint32_t dst, int window, int lane) {
  if (s.ring) {
    constexpr int chunks_per_row = D * 2 / 16;
    for (int c = lane; c < 2 * tile_tokens * chunks_per_row; c += 32) {
      const int r = c / (tile_tokens * chunks_per_row), rem = c % (tile_tokens * chunks_per_row);
      const int row = rem / chunks_per_row, ch = rem % chunks_per_row;
      if (row < s.valid)
        cp_async16(dst + uint32_t(c) * 16, s.page[r] + size_t((s.tok0 + row) % window) * D * 2 + ch * 16);
    }
  } else {
    uint32_t at = dst;
    for (int r = 0; r < 2; ++r)
      for (int k = 0; k < 3; ++k) {
        const uint8_t* src = s.page[r] + s.from[r][k];
        for (uint32_t c = lane; c < s.size[r][k] / 16; c += 32) cp_async16(at + c * 16, src + c * 16);
        at += s.size[r][k];
      }
  }
  cp_commit();
}

// One 16-byte chunk (128/Bits channels of one token row) from the raw ring -> halves in the tile.
// KIVI/RoleAlign keys keep centered codes (code - 2^(b-1), exact in fp16): the caller folds their
// scales and zero points into the query.
template <int D, int Bits>
__device__ __forceinline__ void tile_from_raw(const uint8_t* codes, const uint8_t* par1, const uint8_t* par2,
                                              format_traits f, role r, int valid, __half* dst) {
  constexpr int row_bytes = D * Bits / 8, cpr = row_bytes / 16, total = tile_tokens * cpr, elems = 128 / Bits;
  const bool k_codes = r == role::k && f.k_along_tokens();
  const int g = f.group == 0 ? D : f.group;
  const uint16_t* scales = reinterpret_cast<const uint16_t*>(par1);
  const uint16_t* zeros = reinterpret_cast<const uint16_t*>(par2);
  uint4* out = reinterpret_cast<uint4*>(dst);
#pragma unroll
  for (int i = 0; i < (total + threads - 1) / threads; ++i) {
    const int c = threadIdx.x + i * threads, row = c / cpr, col = c % cpr, ch0 = col * elems;
    if (c >= total) break;
    if (row >= valid) {
#pragma unroll
      for (int k = 0; k < elems / 8; ++k) out[swz<D>(row, ch0 / 8 + k) / 8] = make_uint4(0, 0, 0, 0);
      continue;
    }
    const uint4 raw = reinterpret_cast<const uint4*>(codes)[c];
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    if constexpr (Bits == 16) {
      if (f.fam == family::fp16) {
        out[swz<D>(row, ch0 / 8) / 8] = raw;
      } else {
        uint32_t hh[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
          hh[j] = h2_bits(__floats2half2_rn(__uint_as_float(w[j] << 16), __uint_as_float(w[j] & 0xffff0000u)));
        out[swz<D>(row, ch0 / 8) / 8] = make_uint4(hh[0], hh[1], hh[2], hh[3]);
      }
    } else {
      if (Bits == 8 && f.fam == family::fp8_e4m3) {
        const float sc = reinterpret_cast<const float*>(par1)[row];
        uint32_t hh[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const __half2_raw hr =
              __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t((w[j / 2] >> (16 * (j % 2))) & 0xffffu), __NV_E4M3);
          const float2 v = __half22float2(bits_h2(uint32_t(hr.x) | (uint32_t(hr.y) << 16)));
          hh[j] = h2_bits(__floats2half2_rn(v.x * sc, v.y * sc));
        }
        out[swz<D>(row, ch0 / 8) / 8] = make_uint4(hh[0], hh[1], hh[2], hh[3]);
        out[swz<D>(row, ch0 / 8 + 1) / 8] = make_uint4(hh[4], hh[5], hh[6], hh[7]);
      } else {
        dequant_int_chunk<D, Bits>(w, f, k_codes, scales, zeros, row, ch0, g, out, row);
      }
    }
  }
}

template <int D>
__device__ __forceinline__ void dequant_role(const uint8_t* raw, const uint32_t (&size)[3], format_id fid, role r,
                                             int valid, __half* dst) {
  const format_traits f = traits_of(fid);
  const uint8_t* p1 = raw + size[0];
  const uint8_t* p2 = p1 + size[1];
  switch (f.bits) {
    case 16: tile_from_raw<D, 16>(raw, p1, p2, f, r, valid, dst); break;
    case 8: tile_from_raw<D, 8>(raw, p1, p2, f, r, valid, dst); break;
    case 4: tile_from_raw<D, 4>(raw, p1, p2, f, r, valid, dst); break;
    default: tile_from_raw<D, 2>(raw, p1, p2, f, r, valid, dst); break;
  }
}

// Raw ring of the copy pipeline: two FP16 tiles (the largest) for head_dim 128; four for 64.
template <int D>
constexpr uint32_t raw_ring_bytes = 64 * 1024;

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
  const int t0 = split * p.tiles_per_split, t1 = min(T, t0 + p.tiles_per_split);
  if (t0 >= T) return;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  constexpr uint32_t ring_bytes = raw_ring_bytes<D>;
  const uint32_t raw_base = smem_addr(sm.raw);

  // The copy pipeline: warp 0 issues tiles in order into the raw ring while space and group slots
  // last, and publishes each tile's description in a shared slot; a tile's bytes are freed once
  // it is dequantized. Only warp 0 keeps the counters and waits on the copy groups.
  load_tile_table<D>(p, item, h, t0, t1, sm.tiles);
  __syncthreads();
  int issued = t0;
  uint32_t head = 0, tail = 0;  // monotone byte counters over the ring
  uint32_t end[pipeline_tiles];
  auto pump = [&](int consumed_upto) {
    while (issued < t1 && issued - consumed_upto < pipeline_tiles) {
      const tile_src s = describe_tile<D>(p, item, h, issued, t0, sm.tiles);
      const uint32_t need = s.bytes();
      const uint32_t off = head % ring_bytes;
      const uint32_t pad = off + need > ring_bytes ? ring_bytes - off : 0;
      if (head + pad + need - tail > ring_bytes) break;
      head += pad;
      if (lane == 0) {
        sm.slot[issued % pipeline_tiles] = s;
        sm.slot_at[issued % pipeline_tiles] = head % ring_bytes;
      }
      issue_tile<D>(s, raw_base + head % ring_bytes, p.kv.window, lane);
      head += need;
      end[issued % pipeline_tiles] = head;
      ++issued;
    }
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
  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  const int q_first = item.n - item.q_len;  // position of query 0
  // last visible token of this lane's two rows (lane/4 and lane/4 + 8): causal mask bound
  const int last_visible[2] = {q_first + (mt * 16 + lane / 4) / p.group, q_first + (mt * 16 + lane / 4 + 8) / p.group};

  for (int t = t0; t < t1; ++t) {
    if (warp == 0) cp_wait_dyn(issued - t - 1);  // this tile's copies have landed
    __syncthreads();  // ... visible to all; the previous tile is consumed
    const tile_src s = sm.slot[t % pipeline_tiles];
    const uint8_t* raw = sm.raw + sm.slot_at[t % pipeline_tiles];
    bool k_codes = false;
    int groups_base = 0, G = 1;
    if (s.ring) {
      constexpr int cpr = D * 2 / 16;
#pragma unroll
      for (int i = 0; i < tile_tokens * cpr / threads; ++i) {
        const int c = tid + i * threads, row = c / cpr, ch = c % cpr;
        const bool ok = row < s.valid;
        const uint4 kk = ok ? reinterpret_cast<const uint4*>(raw)[c] : make_uint4(0, 0, 0, 0);
        const uint4 vv = ok ? reinterpret_cast<const uint4*>(raw + tile_tokens * D * 2)[c] : make_uint4(0, 0, 0, 0);
        reinterpret_cast<uint4*>(sm.k)[swz<D>(row, ch) / 8] = kk;
        reinterpret_cast<uint4*>(sm.v)[swz<D>(row, ch) / 8] = vv;
      }
    } else {
      const uint8_t* vraw = raw + s.size[0][0] + s.size[0][1] + s.size[0][2];
      dequant_role<D>(raw, s.size[0], s.fk, role::k, s.valid, sm.k);
      dequant_role<D>(vraw, s.size[1], s.fv, role::v, s.valid, sm.v);
      const format_traits fk = traits_of(s.fk);
      k_codes = fk.k_along_tokens();
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
      tail = end[t % pipeline_tiles];
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
        x *= p.scale_log2;
        const bool ok = (j - tok0) < valid && j <= last_visible[e / 2];
        sc4[nt][e] = ok ? x : -INFINITY;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], sc4[nt][e]);
      }
    __half2 pf[2][2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      tile_max[hr] = fmaxf(tile_max[hr], __shfl_xor_sync(0xffffffffu, tile_max[hr], 1));
      tile_max[hr] = fmaxf(tile_max[hr], __shfl_xor_sync(0xffffffffu, tile_max[hr], 2));
      const float m_new = fmaxf(row_max[hr], tile_max[hr]);
      const float alpha = m_new == -INFINITY ? 1.f : exp2f(row_max[hr] - m_new);
      row_max[hr] = m_new;
      row_sum[hr] *= alpha;
      if (__any_sync(0xffffffffu, alpha != 1.f)) {  // the running max rarely moves once settled
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
          acc[j][2 * hr] *= alpha;
          acc[j][2 * hr + 1] *= alpha;
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const float p0 = m_new == -INFINITY ? 0.f : exp2f(sc4[nt][2 * hr] - m_new);
        const float p1 = m_new == -INFINITY ? 0.f : exp2f(sc4[nt][2 * hr + 1] - m_new);
        row_sum[hr] += p0 + p1;
        pf[nt][hr] = __floats2half2_rn(p0, p1);
      }
    }
    // ---- O += P V ----
    const uint32_t pa0 = h2_bits(pf[0][0]), pa1 = h2_bits(pf[0][1]), pa2 = h2_bits(pf[1][0]), pa3 = h2_bits(pf[1][1]);
#pragma unroll
    for (int jp = 0; jp < D / 16; ++jp) {
      uint32_t b0, b1, b2, b3;
      ldsm_x4_t(smem_addr(sm.v + swz<D>(wrow + (lane % 8) + ((lane / 8) % 2) * 8, jp * 2 + lane / 16)), b0, b1, b2, b3);
      mma16816(acc[2 * jp], pa0, pa1, pa2, pa3, b0, b1);
      mma16816(acc[2 * jp + 1], pa0, pa1, pa2, pa3, b2, b3);
    }
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
      wo[(warp * 16 + r_lo + (e / 2) * 8) * D + j * 8 + (lane % 4) * 2 + (e % 2)] = acc[j][e];
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

// ---------------------------------------------------------------------------------------------
// decode kernel (group x q_len <= 8): every warp is an independent flash-decoding split
// ---------------------------------------------------------------------------------------------
// The tile kernel above pays CTA-wide barriers and shared-memory round trips on every 64-token
// tile. For decode the query side is tiny (at most 8 columns: GQA heads x q_len), so this kernel
// swaps the MMA operands (S^T = K Q^T with tokens as M, queries as N) and lets each warp stream
// its own 16-token slabs with no barrier in the main loop (docs/decisions.md, "Decode kernel"):
// - lane (g, t) owns the K channels [(D/4) t, (D/4)(t+1)) of rows g and g+8 and turns their
//   codes into MMA A fragments (a per-lane channel permutation, applied to Q as well);
// - lane g reads the V channels [(D/8) g, (D/8)(g+1)) of tokens 2t, 2t+1, 2t+8, 2t+9, so the A
//   fragments of O^T = V^T P^T pair two tokens per channel (built straight from the two tokens'
//   raw words for integer formats);
// - P^T comes from the S^T accumulators by movmatrix (register transpose);
// - per-token scales (fp8 K) scale S rows, per-token V scales (fp8) scale P, KIVI key scales
//   fold into the query (q' = q s per token group) and their zeros (centered) into one score
//   offset per column, itself an MMA of the zero row with q;
// - three kernels by the widest page of the layer (`attend_args::max_page_bits`): the
//   block-staged `decode_paged_kernel` (pages of at most 8 bits copied whole into page stages
//   shared by the block's warps; instances with two full barriers per stage for 8-bit rings, and
//   with whole 64-token steps for layers of one format pair per head, `one_format_per_head`),
//   the per-warp staged `decode_kernel` (8-bit layers whose page-heads leave room for fewer than 3
//   page stages; one slab per stage) and `decode_wide_kernel` (K codes of up to 16 bits loaded
//   into registers one slab ahead, V and KIVI key scales through two cp.async slots per warp;
//   2 blocks per SM). All read the FP16 ring, and the staged ones a page wider than their
//   stages, from global memory where used.
constexpr int slab = 16;
constexpr int dec_warps = 4;
constexpr int max_cta_slabs = 1024;

// The staged kernel compiles the K part (loads, dequantization, score MMAs) and the V part (loads,
// dequantization, P, output MMAs) once per kind of page format, each a straight run of code with the
// format's family and bits constant (branches inside a slab cost issue slots and split the code the
// scheduler can interleave). Kinds: KIVI/RoleAlign 8/4/2 bits (0-2), sym 8/4/2 (3-5), fp8 (6);
// 16-bit formats (-1) take the unstaged path. The page table cache holds each page's kinds, so
// that a step's dispatch is a byte load, not a chain of compares per step.
__device__ __forceinline__ int kind_of(format_traits f) {
  if (f.bits > 8) return -1;
  const int b = f.bits == 8 ? 0 : f.bits == 4 ? 1 : 2;
  return f.fam == family::fp8_e4m3 ? 6 : f.fam == family::sym ? 3 + b : b;
}

// The pages of one thread block's slabs, looked up once: the K block's offset in 16-byte units,
// the V block's offset from it, and both formats' traits (no per-slab table decoding). For the
// block-staged kernel, also the part of the page-head its page stage holds (`issue_page`). There,
// a page whose V the stages hold and whose K they do not has V offset 0: its V sits at the start
// of its page stage, and is never read from the page.
struct page_table_cache {
  int first_page;
  uint32_t page16[max_cta_slabs * slab / 64 + 2];
  uint32_t v_offset[max_cta_slabs * slab / 64 + 2];
  uint32_t copy_from[max_cta_slabs * slab / 64 + 2], copy_bytes[max_cta_slabs * slab / 64 + 2];
  format_traits fk[max_cta_slabs * slab / 64 + 2];
  format_traits fv[max_cta_slabs * slab / 64 + 2];
  format_id kid[max_cta_slabs * slab / 64 + 2];
  int8_t kk[max_cta_slabs * slab / 64 + 2], kv[max_cta_slabs * slab / 64 + 2];  // kind_of(fk), kind_of(fv)
  format_id vid[max_cta_slabs * slab / 64 + 2];
};

// One warp's staging slot for a slab: 16 V code rows of up to 8 bits, the rows' V parameters (at
// most two halves per 32-channel group per row, or one float per row), then the KIVI key scales
// and zeros of the slab's token group (D halves each).
template <int D>
constexpr uint32_t slot_kpar = 16 * D + 2 * 16 * (D / 32) * 2;
template <int D>
constexpr uint32_t slot_bytes = slot_kpar<D> + 2 * D * 2;

// The warps' partial outputs and (max, sum) per column, merged after the slab loop.
template <int D>
struct merge_area {
  float wo[dec_warps][8][D];   // [warp][column][channel]
  float wml[dec_warps][8][2];  // [warp][column] running max and sum
};

template <int D>
struct decode_smem {
  page_table_cache pages;
  uint4 qh[dec_warps][D / 32][32];  // each lane's fp16 query pairs (for KIVI re-scaling; `put_query`)
  union {
    __align__(16) uint8_t vslot[dec_warps][2][slot_bytes<D>];  // staging, two slabs per warp
    merge_area<D> m;                                             // after the loop
  };
};

// One 16-token slab: the K and V page-head blocks it lies in (or the two FP16 rings).
struct slab_ref {
  const uint8_t* k;
  const uint8_t* v;
  int tok0, valid, row0;
  format_traits fk, fv;
  int8_t kk, kv;  // kind_of(fk), kind_of(fv) (page slabs)
  bool ring;
};

template <int D>
__device__ __forceinline__ slab_ref locate_slab(const attend_params& p, const decode_item& item, int h, int j,
                                                int page_slabs, const page_table_cache& pc) {
  slab_ref s;
  if (j < page_slabs) {
    s.ring = false;
    s.tok0 = j * slab;
    s.valid = min(slab, item.from_pages - s.tok0);
    s.row0 = s.tok0 & (p.kv.page_tokens - 1);
    const int e = (s.tok0 >> log2i(p.kv.page_tokens)) - pc.first_page;
    s.fk = pc.fk[e];
    s.fv = pc.fv[e];
    s.kk = pc.kk[e];
    s.kv = pc.kv[e];
    s.k = p.kv.arena + size_t(pc.page16[e]) * 16;
    s.v = s.k + pc.v_offset[e];
  } else {
    s.ring = true;
    s.tok0 = item.from_pages + (j - page_slabs) * slab;
    s.valid = min(slab, item.n - s.tok0);
    s.row0 = 0;
    s.fk = s.fv = traits_of(fp16_format);
    s.kk = s.kv = -1;
    s.k = ring_base<D>(p, item, h);
    s.v = s.k + size_t(p.kv.window) * D * 2;
  }
  return s;
}

// Row r of a slab in one role: page row row0 + r, or the ring slot of token tok0 + r. Rows at or
// beyond `valid` are in bounds (a slab never leaves its page; ring slots wrap) but hold stale
// bytes: scores of such rows are selected away and their V zeroed.
template <int D>
__device__ __forceinline__ const uint8_t* slab_row(const slab_ref& s, const uint8_t* base, int r, uint32_t row_bytes,
                                                   int window) {
  return s.ring ? base + size_t((s.tok0 + r) % window) * (D * 2) : base + uint32_t(s.row0 + r) * row_bytes;
}

// Loads of global memory through the read-only path, or of any memory (Global = false: the
// staged V slabs in shared memory).
template <bool Global, class T>
__device__ __forceinline__ T ld(const T* p) {
  if constexpr (Global) return __ldg(p);
  else return *p;
}

// Reads `Bytes` bytes (4-byte multiples 16-byte aligned as they come, or 2).
template <int Bytes, bool Global = true>
__device__ __forceinline__ void ldg_words(const uint8_t* src, uint32_t* w) {
  if constexpr (Bytes % 16 == 0) {
#pragma unroll
    for (int i = 0; i < Bytes / 16; ++i) {
      const uint4 v = ld<Global>(reinterpret_cast<const uint4*>(src) + i);
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else if constexpr (Bytes == 8) {
    const uint2 v = ld<Global>(reinterpret_cast<const uint2*>(src));
    w[0] = v.x, w[1] = v.y;
  } else if constexpr (Bytes == 4) {
    w[0] = ld<Global>(reinterpret_cast<const unsigned int*>(src));
  } else {
    w[0] = ld<Global>(reinterpret_cast<const unsigned short*>(src));
  }
}

// Codes of `Pairs` channel pairs (in channel order) -> half2 words holding 1024 + code (8-bit
// integer families), 1024 + code / magic_mul (4 and 2 bits: one byte-permute and one lop3 per pair,
// no shifts), or the values (fp16; bf16 and fp8 converted).
template <int Bits, int Pairs>
__device__ __forceinline__ void to_pairs(const uint32_t* w, family fam, uint32_t (&out)[Pairs]) {
  if constexpr (Bits == 16) {
    if (fam == family::fp16) {
#pragma unroll
      for (int i = 0; i < Pairs; ++i) out[i] = w[i];
    } else {  // bf16 (a warp-uniform branch: a per-element select would convert fp16 pages too)
#pragma unroll
      for (int i = 0; i < Pairs; ++i)
        out[i] = h2_bits(__floats2half2_rn(__uint_as_float(w[i] << 16), __uint_as_float(w[i] & 0xffff0000u)));
    }
  } else if constexpr (Bits == 8) {
    if (fam == family::fp8_e4m3) {
#pragma unroll
      for (int i = 0; i < Pairs; ++i) {
        const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t((w[i / 2] >> (16 * (i % 2))) & 0xffffu), __NV_E4M3);
        out[i] = uint32_t(hr.x) | (uint32_t(hr.y) << 16);
      }
    } else {
#pragma unroll
      for (int i = 0; i < Pairs; ++i) out[i] = __byte_perm(w[i / 2], 0x64646464u, (i % 2) ? 0x7342 : 0x5140);
    }
  } else if constexpr (Bits == 4) {  // [byte j, 0x64, byte j, 0x64], then one mask per pair
#pragma unroll
    for (int i = 0; i < Pairs; ++i) out[i] = __byte_perm(w[i / 4], 0x64646464u, (i % 4) * 0x0101u + 0x4040u) & 0xFFF0FF0Fu;
  } else {
#pragma unroll
    for (int b = 0; b < Pairs / 2; ++b) {  // byte b holds channels 4b .. 4b+3
      const uint32_t x = __byte_perm(w[b / 4], 0x64646464u, (b % 4) * 0x0101u + 0x4040u);
      out[2 * b] = x & 0xFF0CFF03u;
      out[2 * b + 1] = x & 0xFFC0FF30u;
    }
  }
}

// Codes read in place within their byte (4 bits: the high nibble 16x; 2 bits: 1x, 4x, 16x, 64x)
// hold 1024 + code / mul in fp16, exact, with mul = code_mul(c) for channel c of the word.
template <int Bits>
__host__ __device__ constexpr float code_mul(int c) {
  return Bits == 8 ? 1.f : 1.f / float(1 << (Bits * (c % (8 / Bits))));
}
// The multipliers of the two halves of pair i of `to_pairs` (channels 2i, 2i + 1).
template <int Bits>
__device__ __forceinline__ __half2 magic_mul(int i) {
  return __floats2half2_rn(code_mul<Bits>(2 * i), code_mul<Bits>(2 * i + 1));
}

// Raw K words of one slab for lane (g, t): rows g and g + 8, the lane's D/4 channels, plus the
// per-row parameter (sym: the half scale of the lane's channel group; fp8: the float token scale).
// Sized for formats of up to `Cap` bits; wider slabs are read where they are used.
template <int D, int Cap>
struct k_raw {
  uint32_t w[2][D * Cap / 128];
  uint32_t ps[2];
};
// Raw V words of one slab for lane (g, t): rows 2t, 2t+1, 2t+8, 2t+9, the lane's D/8 channels,
// and their scales and zeros (sym, kivi) or the float token scales of rows g, g + 8 (fp8).
template <int D, int Cap>
struct v_raw {
  uint32_t w[4][(D * Cap + 255) / 256];
  uint32_t s[4], z[4];
};

template <int D, int Bits, int Cap, bool Global>
__device__ __forceinline__ void load_k_rows(const slab_ref& s, int g, int t, int window, uint32_t (&w)[2][D * Cap / 128]) {
  constexpr int lane_bytes = (D / 4) * Bits / 8;
  constexpr uint32_t row_bytes = D * Bits / 8;
  ldg_words<lane_bytes, Global>(slab_row<D>(s, s.k, g, row_bytes, window) + t * lane_bytes, w[0]);
  ldg_words<lane_bytes, Global>(slab_row<D>(s, s.k, g + 8, row_bytes, window) + t * lane_bytes, w[1]);
}

// K of a slab for lane (g, t), from its page (Global) or from its staged copy in shared memory
// (a 16-row page: P = 16, row0 = 0).
template <int D, int Cap, bool Global = true>
__device__ __forceinline__ void load_k(const slab_ref& s, format_traits f, int P, int window, int g, int t, k_raw<D, Cap>& kr) {
  switch (f.bits) {
    case 16:
      if constexpr (Cap >= 16) load_k_rows<D, 16, Cap, Global>(s, g, t, window, kr.w);
      break;
    case 8: load_k_rows<D, 8, Cap, Global>(s, g, t, window, kr.w); break;
    case 4: load_k_rows<D, 4, Cap, Global>(s, g, t, window, kr.w); break;
    default: load_k_rows<D, 2, Cap, Global>(s, g, t, window, kr.w); break;
  }
  if (s.ring) return;
  const uint32_t code_bytes = uint32_t(P) * ((D * f.bits) >> 3);
  if (f.fam == family::sym) {
    const int lg = log2i(f.group == 0 ? D : f.group), ng = D >> lg, grp = (t * (D / 4)) >> lg;
    const uint16_t* sc = reinterpret_cast<const uint16_t*>(s.k + code_bytes);
    kr.ps[0] = ld<Global>(sc + (s.row0 + g) * ng + grp);
    kr.ps[1] = ld<Global>(sc + (s.row0 + g + 8) * ng + grp);
  } else if (f.fam == family::fp8_e4m3) {
    const uint32_t* sc = reinterpret_cast<const uint32_t*>(s.k + code_bytes);
    kr.ps[0] = ld<Global>(sc + s.row0 + g);
    kr.ps[1] = ld<Global>(sc + s.row0 + g + 8);
  }
}

// Raw K words -> this lane's A fragments (pairs in channel order). KIVI keys: centered codes (their
// scales are folded into q); sym: values; fp8: values (the token scale multiplies the scores).
template <int D, int Bits, int Cap>
__device__ __forceinline__ void k_frags(const uint32_t (&w)[2][D * Cap / 128], family fam, const uint32_t (&ps)[2],
                                        uint32_t (&kg)[D / 8], uint32_t (&kg8)[D / 8]) {
  to_pairs<Bits, D / 8>(w[0], fam, kg);
  to_pairs<Bits, D / 8>(w[1], fam, kg8);
  if constexpr (Bits != 16) {
    if (fam == family::fp8_e4m3) return;
    // centered code c - 2^(b-1) = m * mul - (1024 mul + 2^(b-1)), one exact fma per pair
    const float mid = float(1 << (Bits - 1));
    const auto center = [&](uint32_t m, int i) {
      const __half2 mul = magic_mul<Bits>(i);
      const __half2 bias = __floats2half2_rn(-(1024.f * __low2float(mul) + mid), -(1024.f * __high2float(mul) + mid));
      return __hfma2(bits_h2(m), mul, bias);
    };
    if (fam == family::sym) {
      const __half2 s0 = __half2half2(__ushort_as_half(uint16_t(ps[0]))), s8 = __half2half2(__ushort_as_half(uint16_t(ps[1])));
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        kg[i] = h2_bits(__hmul2(center(kg[i], i), s0));
        kg8[i] = h2_bits(__hmul2(center(kg8[i], i), s8));
      }
    } else {
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        kg[i] = h2_bits(center(kg[i], i));
        kg8[i] = h2_bits(center(kg8[i], i));
      }
    }
  }
}

template <int D, int Bits, int Cap, bool Global>
__device__ __forceinline__ void load_v_rows(const slab_ref& s, int g, int t, int window, uint32_t (&w)[4][(D * Cap + 255) / 256]) {
  constexpr int lane_bytes = (D / 8) * Bits / 8;
  constexpr uint32_t row_bytes = D * Bits / 8;
  const int rows[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};
#pragma unroll
  for (int r = 0; r < 4; ++r)
    ldg_words<lane_bytes, Global>(slab_row<D>(s, s.v, rows[r], row_bytes, window) + g * lane_bytes, w[r]);
}

// V of a slab for lane (g, t), from its page (Global) or from its staged copy in shared memory,
// which has the shape of a 16-row page (P = 16, row0 = 0).
template <int D, int Cap, bool Global>
__device__ __forceinline__ void load_v(const slab_ref& s, format_traits f, int P, int window, int g, int t, v_raw<D, Cap>& vr) {
  switch (f.bits) {
    case 16:
      if constexpr (Cap >= 16) load_v_rows<D, 16, Cap, Global>(s, g, t, window, vr.w);
      break;
    case 8: load_v_rows<D, 8, Cap, Global>(s, g, t, window, vr.w); break;
    case 4: load_v_rows<D, 4, Cap, Global>(s, g, t, window, vr.w); break;
    default: load_v_rows<D, 2, Cap, Global>(s, g, t, window, vr.w); break;
  }
  if (s.ring) return;
  const uint32_t code_bytes = uint32_t(P) * ((D * f.bits) >> 3);
  if (f.fam == family::fp8_e4m3) {
    const uint32_t* sc = reinterpret_cast<const uint32_t*>(s.v + code_bytes);
    vr.s[0] = ld<Global>(sc + s.row0 + g);
    vr.s[1] = ld<Global>(sc + s.row0 + g + 8);
  } else if (f.is_integer()) {
    const int lg = log2i(f.group == 0 ? D : f.group), ng = D >> lg, grp = (g * (D / 8)) >> lg;
    const uint16_t* sc = reinterpret_cast<const uint16_t*>(s.v + code_bytes);
    const uint16_t* zr = sc + P * ng;
    const int rows[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int gi = (s.row0 + rows[r]) * ng + grp;
      vr.s[r] = ld<Global>(sc + gi);
      if (f.has_zero()) vr.z[r] = ld<Global>(zr + gi);
    }
  }
}

// Copies what a page slab needs from memory besides its K codes into a staging slot, with
// cp.async, so that the copy is in flight while the previous slab is computed: V (code rows and
// their parameter rows, laid out as a 16-row page) when V has at most 8 bits, and the KIVI key
// scales and zeros of the slab's token group.
template <int D>
__device__ __forceinline__ void stage_slab(const slab_ref& s, int P, int lane, uint32_t slot) {
  if (s.fk.has_zero()) {
    const int lg = log2i(s.fk.group);
    const uint8_t* sc = s.k + uint32_t(P) * ((D * s.fk.bits) >> 3) + uint32_t(s.row0 >> lg) * D * 2;
    if (lane < D / 8) cp_async16(slot + slot_kpar<D> + lane * 16, sc + lane * 16);
    else if (lane >= 16 && lane - 16 < D / 8)
      cp_async16(slot + slot_kpar<D> + D * 2 + (lane - 16) * 16, sc + uint32_t(P >> lg) * D * 2 + (lane - 16) * 16);
  }
  const format_traits f = s.fv;
  if (f.bits > 8) return;
  const uint32_t row_bytes = (D * f.bits) >> 3, code_bytes = uint32_t(P) * row_bytes;
  const uint8_t* src = s.v + uint32_t(s.row0) * row_bytes;
  for (uint32_t c = lane; c < row_bytes; c += 32) cp_async16(slot + c * 16, src + c * 16);  // 16 rows: row_bytes chunks
  const uint32_t dst = slot + 16 * row_bytes;
  if (f.fam == family::fp8_e4m3) {
    if (lane < 4) cp_async16(dst + lane * 16, s.v + code_bytes + uint32_t(s.row0) * 4 + lane * 16);
  } else if (f.is_integer()) {
    const uint32_t ng = uint32_t(D >> log2i(f.group == 0 ? D : f.group)), chunks = 2 * ng;  // 16 rows x ng halves
    const uint8_t* sc = s.v + code_bytes + uint32_t(s.row0) * ng * 2;
    if (lane < int(chunks)) cp_async16(dst + lane * 16, sc + lane * 16);
    if (f.has_zero() && lane >= 16 && lane - 16 < int(chunks))
      cp_async16(dst + 32 * ng + (lane - 16) * 16, sc + uint32_t(P) * ng * 2 + (lane - 16) * 16);
  }
}

// Raw V words of the lane's four rows -> half2 channel pairs of each (fp8: unscaled, the token
// scale multiplies P; 16 bits: the values).
template <int D, int Bits, int Cap>
__device__ __forceinline__ void v_all(const v_raw<D, Cap>& vr, family fam, uint32_t (&va)[D / 16], uint32_t (&vb)[D / 16],
                                      uint32_t (&vc)[D / 16], uint32_t (&vd)[D / 16]) {
  to_pairs<Bits, D / 16>(vr.w[0], fam, va);
  to_pairs<Bits, D / 16>(vr.w[1], fam, vb);
  to_pairs<Bits, D / 16>(vr.w[2], fam, vc);
  to_pairs<Bits, D / 16>(vr.w[3], fam, vd);
}

// The codes of channel c (of the lane's D/8) of two tokens, as the half2 (1024 + c_a / mul, 1024 +
// c_b / mul) with mul = code_mul<Bits>(c): one byte permute places the two tokens' bytes of the
// channel in bytes 0 and 2 (shared by the channels of that byte), one lop3 masks the code in place
// and inserts the magic exponent, so that V^T's A fragments (token pairs) come straight from the
// raw words. (The permute's selector is an immediate and the magic a register: a permute that
// inserted the magic itself took its selector from a register, rematerialized at every use.)
template <int Bits>
__device__ __forceinline__ uint32_t pair_codes(const uint32_t* wa, const uint32_t* wb, int c, uint32_t magic) {
  constexpr int per_word = 32 / Bits, per_byte = 8 / Bits;
  constexpr uint32_t mask = ((1u << Bits) - 1) * 0x00010001u;
  const int wi = c / per_word, j = (c % per_word) / per_byte, k = c % per_byte;
  const uint32_t x = __byte_perm(wa[wi], wb[wi], uint32_t(j * 0x11 + (4 + j) * 0x1100));  // a_j, a_j, b_j, b_j
  uint32_t d;  // (x & mask) | magic in one lop3 (written as and + or, it compiles to two)
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(x), "r"(mask << (Bits * k)), "r"(magic));
  return d;
}

// O^T += V^T P^T for a slab of integer V codes (sym, kivi, rolealign): each A fragment is built from
// its token pair's raw words and dequantized with the two tokens' scales and zeros (exact: subtract
// the magic, then one fma); rows at or beyond `valid` (stale bytes) get scale and zero 0.
template <int D, int Bits, int Cap>
__device__ __forceinline__ void values_int(const v_raw<D, Cap>& vr, bool sym, int valid, int t, uint32_t pb0, uint32_t pb1,
                                           float (&acc)[D / 16][4]) {
  uint32_t sr[4], zr[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) sr[r] = vr.s[r], zr[r] = sym ? 0u : vr.z[r];
  if (valid < slab) {  // (warp-uniform: a slab's last rows)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      if (2 * t + (r & 1) + 8 * (r >> 1) >= valid) sr[r] = zr[r] = 0u;
  }
  const __half2 s01 = bits_h2(__byte_perm(sr[0], sr[1], 0x5410)), s89 = bits_h2(__byte_perm(sr[2], sr[3], 0x5410));
  const __half2 z01 = bits_h2(__byte_perm(zr[0], zr[1], 0x5410)), z89 = bits_h2(__byte_perm(zr[2], zr[3], 0x5410));
  const float mid = sym ? float(1 << (Bits - 1)) : 0.f;
  uint32_t magic;  // 0x64006400 in a register (opaque, so that it is not folded back into an immediate)
  asm("mov.b32 %0, 0x64006400;\n" : "=r"(magic));
  const auto deq = [&](uint32_t x, int c, __half2 sc, __half2 z) {
    const float mul = code_mul<Bits>(c);  // compile-time after unrolling
    const __half2 v = __hsub2(bits_h2(x), __float2half2_rn(1024.f + mid / mul));  // (code - mid) / mul, exact
    return h2_bits(__hfma2(v, mul == 1.f ? sc : __hmul2(sc, __float2half2_rn(mul)), z));
  };
#pragma unroll
  for (int m = 0; m < D / 16; ++m)
    mma16816(acc[m], deq(pair_codes<Bits>(vr.w[0], vr.w[1], 2 * m, magic), 2 * m, s01, z01),
             deq(pair_codes<Bits>(vr.w[0], vr.w[1], 2 * m + 1, magic), 2 * m + 1, s01, z01),
             deq(pair_codes<Bits>(vr.w[2], vr.w[3], 2 * m, magic), 2 * m, s89, z89),
             deq(pair_codes<Bits>(vr.w[2], vr.w[3], 2 * m + 1, magic), 2 * m + 1, s89, z89), pb0, pb1);
}

// The narrow decode kernel's path for 16-bit slabs (fp16/bf16 pages, the FP16 ring): read where
// used, in two halves of the lane's channels so that at most 16 raw words per row are live.
template <int D>
__device__ __forceinline__ void scores_wide(const slab_ref& s, family fam, int g, int t, int window,
                                            const uint32_t (&qb)[D / 8], float (&sc)[4]) {
  constexpr uint32_t row_bytes = D * 2;
  const uint8_t* r0 = slab_row<D>(s, s.k, g, row_bytes, window) + t * (D / 2);
  const uint8_t* r8 = slab_row<D>(s, s.k, g + 8, row_bytes, window) + t * (D / 2);
#pragma unroll
  for (int hs = 0; hs < 2; ++hs) {
    uint32_t w0[D / 16], w8[D / 16], a0[D / 16], a8[D / 16];
    ldg_words<D / 4>(r0 + hs * (D / 4), w0);
    ldg_words<D / 4>(r8 + hs * (D / 4), w8);
    to_pairs<16, D / 16>(w0, fam, a0);
    to_pairs<16, D / 16>(w8, fam, a8);
#pragma unroll
    for (int ks = 0; ks < D / 32; ++ks)
      mma16816(sc, a0[2 * ks], a8[2 * ks], a0[2 * ks + 1], a8[2 * ks + 1], qb[hs * (D / 16) + 2 * ks],
               qb[hs * (D / 16) + 2 * ks + 1]);
  }
}

template <int D>
__device__ __forceinline__ void values_wide(const slab_ref& s, family fam, int g, int t, int window, uint32_t pb0,
                                            uint32_t pb1, float (&acc)[D / 16][4]) {
  constexpr uint32_t row_bytes = D * 2;
  const int rows[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};
#pragma unroll
  for (int hs = 0; hs < 2; ++hs) {
    uint32_t v[4][D / 32];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      uint32_t w[D / 32];
      ldg_words<D / 8>(slab_row<D>(s, s.v, rows[r], row_bytes, window) + g * (D / 4) + hs * (D / 8), w);
      to_pairs<16, D / 32>(w, fam, v[r]);
      if (rows[r] >= s.valid) {
#pragma unroll
        for (int i = 0; i < D / 32; ++i) v[r][i] = 0u;
      }
    }
#pragma unroll
    for (int i = 0; i < D / 32; ++i)
      mma16816(acc[hs * (D / 32) + i], __byte_perm(v[0][i], v[1][i], 0x5410), __byte_perm(v[0][i], v[1][i], 0x7632),
               __byte_perm(v[2][i], v[3][i], 0x5410), __byte_perm(v[2][i], v[3][i], 0x7632), pb0, pb1);
  }
}

// fp8: the float token scales of rows g and g + 8 of a slab. Rows at or beyond `valid` hold stale
// bytes: their scale is 0, so that a masked score or P = 0 never meets a NaN.
__device__ __forceinline__ float2 fp8_scales(uint32_t s0, uint32_t s8, int g, int valid) {
  return make_float2(g < valid ? __uint_as_float(s0) : 0.f, g + 8 < valid ? __uint_as_float(s8) : 0.f);
}

__device__ __forceinline__ uint32_t movmatrix_t(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// ---- pieces shared by the two decode kernels ---------------------------------------------------

// Page lookups of the block's slabs [c0, c1), once per block (threads of the block in parallel).
template <int D>
__device__ __forceinline__ void fill_page_table(const attend_params& p, const decode_item& item, int h, int c0, int c1,
                                                int page_slabs, page_table_cache& pc) {
  const int lg = log2i(p.kv.page_tokens);
  const int first = (c0 * slab) >> lg;
  const int last_slab = min(c1, page_slabs) - 1;
  const int npages = last_slab >= c0 ? ((last_slab * slab) >> lg) - first + 1 : 0;
  if (threadIdx.x == 0) pc.first_page = first;
  for (int e = threadIdx.x; e < npages; e += dec_warps * 32) {
    const size_t row = (size_t(item.slot) * p.kv.layers + p.layer) * p.kv.max_pages + first + e;
    const uint8_t* fm = p.kv.fmts + row * p.kv.kv_heads * 2;
    uint32_t off = 0;
    for (int hh = 0; hh < h; ++hh) off += p.kv.k_page_bytes[fm[2 * hh]] + p.kv.v_page_bytes[fm[2 * hh + 1]];
    pc.page16[e] = uint32_t((size_t(p.kv.blocks[row]) * 256 + off) / 16);
    const uint32_t kb = p.kv.k_page_bytes[fm[2 * h]], vb = p.kv.v_page_bytes[fm[2 * h + 1]];
    const format_traits fk = traits_of(fm[2 * h]), fv = traits_of(fm[2 * h + 1]);
    const bool k_st = fk.bits <= p.stage_cap, v_st = fv.bits <= p.stage_cap;
    pc.v_offset[e] = p.page_stage && !k_st && v_st ? 0u : kb;
    pc.copy_from[e] = k_st ? 0u : kb;
    pc.copy_bytes[e] = (k_st ? kb : 0u) + (v_st ? vb : 0u);  // (K and V blocks are contiguous)
    pc.fk[e] = fk, pc.fv[e] = fv;
    pc.kk[e] = int8_t(kind_of(fk)), pc.kv[e] = int8_t(kind_of(fv));
    pc.kid[e] = fm[2 * h];
    pc.vid[e] = fm[2 * h + 1];
  }
}

// The block's query columns as MMA B fragments: column n is query n / group of head
// h * group + n % group; lane (g, t) holds column g, the pairs of its channels [(D/4) t, (D/4)(t+1)).
template <int D>
__device__ __forceinline__ void load_query(const attend_params& p, const decode_item& item, int h, int g, int t,
                                           uint32_t (&qb)[D / 8]) {
  const bool live = g < p.group * item.q_len;
  const int i = g / p.group, qh_i = h * p.group + g % p.group;
  const int64_t base = int64_t(item.q_row + i) * p.q_stride + int64_t(qh_i) * D + t * (D / 4);
#pragma unroll
  for (int c = 0; c < D / 8; ++c)
    qb[c] = h2_bits(__floats2half2_rn(live ? load_any(p.q, p.q_type, base + 2 * c) : 0.f,
                                      live ? load_any(p.q, p.q_type, base + 2 * c + 1) : 0.f));
}

// Each lane's query fragments kept in shared memory for re-scaling, as [D / 32][lane] 16-byte
// words: one conflict-free 16-byte load per 4 fragments ([fragment][lane] words took one 4-byte
// load each).
template <int D>
__device__ __forceinline__ void put_query(uint4 (&qh)[D / 32][32], int lane, const uint32_t (&qb)[D / 8]) {
#pragma unroll
  for (int i = 0; i < D / 32; ++i) qh[i][lane] = make_uint4(qb[4 * i], qb[4 * i + 1], qb[4 * i + 2], qb[4 * i + 3]);
}
template <int D>
__device__ __forceinline__ void get_query(const uint4 (&qh)[D / 32][32], int lane, uint32_t (&qb)[D / 8]) {
#pragma unroll
  for (int i = 0; i < D / 32; ++i) {
    const uint4 v = qh[i][lane];
    qb[4 * i] = v.x, qb[4 * i + 1] = v.y, qb[4 * i + 2] = v.z, qb[4 * i + 3] = v.w;
  }
}

// The query for a KIVI key slab: the token group's channel scales fold into q (q' = q s) and the
// centered zeros (z + s 2^(b-1)) into one score offset per column, itself an MMA of the zero row
// with q. `scales`/`zeros`: the group's D halves each (any memory).
//
// Sub (keys read as subnormal codes, `k_frags_sub<D, Bits>`): q' takes the keys' pair order, and
// the codes are not centered, so the offset also takes -2^(b-1) sum_c q'_c, the sum of the fp16
// q' the keys' MMAs use (one more MMA per k-step): the scores then equal the centered ones up to
// fp32 rounding. (Without it, the fp16 rounding errors of q' meet codes 0..2^b - 1 instead of
// -2^(b-1)..2^(b-1) - 1: the kivi4 d64 NMSE of the GPU tests rose about 3x, past the bound.)
template <int D, int Sub = 0>
__device__ __forceinline__ void fold_kivi(const uint8_t* scales, const uint8_t* zeros, int bits, const uint4 (&qh)[D / 32][32],
                                          int lane, int t, uint32_t (&qb)[D / 8], float (&cz_col)[2]) {
  uint32_t sw[D / 8], zw[D / 8];
  ldg_words<D / 2, false>(scales + t * (D / 4) * 2, sw);
  ldg_words<D / 2, false>(zeros + t * (D / 4) * 2, zw);
  const __half2 mid = __float2half2_rn(float(1 << (bits - 1)));
  float cz[4] = {0.f, 0.f, 0.f, 0.f}, cq[4] = {0.f, 0.f, 0.f, 0.f};
  const uint32_t neg_mid = h2_bits(__hneg2(mid));
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const uint32_t z0 = h2_bits(__hfma2(bits_h2(sw[2 * ks]), mid, bits_h2(zw[2 * ks])));
    const uint32_t z1 = h2_bits(__hfma2(bits_h2(sw[2 * ks + 1]), mid, bits_h2(zw[2 * ks + 1])));
    const uint4 q4 = qh[ks / 2][lane];
    const uint32_t q0 = ks % 2 ? q4.z : q4.x, q1 = ks % 2 ? q4.w : q4.y;
    mma16816(cz, z0, 0u, z1, 0u, q0, q1);  // (rows g + 8 unused)
    qb[2 * ks] = h2_bits(__hmul2(bits_h2(q0), bits_h2(sw[2 * ks])));
    qb[2 * ks + 1] = h2_bits(__hmul2(bits_h2(q1), bits_h2(sw[2 * ks + 1])));
    if constexpr (Sub > 0) mma16816(cq, neg_mid, 0u, neg_mid, 0u, qb[2 * ks], qb[2 * ks + 1]);
  }
  if constexpr (Sub > 0) cz[0] += cq[0], cz[1] += cq[1];
  if constexpr (Sub > 0) {  // plain pairs (2k, 2k + 1) of a word's n channels -> (c, c + n / 2), `k_frags_sub`
    constexpr int np = 16 / Sub;  // plain pairs per word
#pragma unroll
    for (int w = 0; w < D * Sub / 128; ++w) {
      uint32_t pp[np];
#pragma unroll
      for (int k = 0; k < np; ++k) pp[k] = qb[np * w + k];
#pragma unroll
      for (int b = 0; b < np / 4; ++b) {
        qb[np * w + 4 * b] = __byte_perm(pp[2 * b], pp[2 * b + np / 2], 0x5410);
        qb[np * w + 4 * b + 1] = __byte_perm(pp[2 * b + 1], pp[2 * b + 1 + np / 2], 0x5410);
        qb[np * w + 4 * b + 2] = __byte_perm(pp[2 * b], pp[2 * b + np / 2], 0x7632);
        qb[np * w + 4 * b + 3] = __byte_perm(pp[2 * b + 1], pp[2 * b + 1 + np / 2], 0x7632);
      }
    }
  }
  cz_col[0] = cz[0], cz_col[1] = cz[1];
}

// 4- and 2-bit KIVI keys as fp16 subnormals: a code c in the low bits of a half with exponent
// field 0 is c 2^-24, exactly, so one lop3 (a mask) turns two channels of a word into a half2 with
// no magic to remove and no fma (the tensor cores take subnormal operands exactly, and products
// of about 2^-24 q' are far inside the fp32 accumulators' normal range). A
// word of n channels gives pairs (c, c + n / 2), c's code at bit Bits c of each half: shifted down
// by 2 Bits k, the mask of the lowest code takes channels (2k, 2k + n / 2), the mask of the next
// one channels (2k + 1, ...) as 2^Bits c. The pairs go to the MMA k-steps so that even steps hold
// the first and odd steps the second (`scores_mma<D, Bits>` adds the odd chain / 2^Bits); the
// query takes the same order (`fold_kivi<D, Bits>`); the scores come out in units of 2^-24.
template <int D, int Bits>
__device__ __forceinline__ void k_frags_sub(const uint32_t (&w)[2][D / 16], uint32_t (&kg)[D / 8],
                                            uint32_t (&kg8)[D / 8]) {
  constexpr int np = 16 / Bits;  // pairs per word
  constexpr uint32_t lo = ((1u << Bits) - 1) * 0x00010001u, hi = lo << Bits;
  const auto split = [](const uint32_t* ws, uint32_t* out) {
#pragma unroll
    for (int i = 0; i < D * Bits / 128; ++i)
#pragma unroll
      for (int b = 0; b < np / 4; ++b) {
        const uint32_t x = ws[i] >> (4 * Bits * b), y = ws[i] >> (4 * Bits * b + 2 * Bits);
        out[np * i + 4 * b] = x & lo;
        out[np * i + 4 * b + 1] = y & lo;
        out[np * i + 4 * b + 2] = x & hi;
        out[np * i + 4 * b + 3] = y & hi;
      }
  };
  split(w[0], kg);
  split(w[1], kg8);
}

// S^T = K Q^T of one slab from this lane's K fragments (rows g, g + 8): two accumulators, half
// the dependency chain each (Sub: the odd one holds 2^Sub x codes).
template <int D, int Sub = 0>
__device__ __forceinline__ void scores_mma(const uint32_t (&kg)[D / 8], const uint32_t (&kg8)[D / 8], const uint32_t (&qb)[D / 8],
                                           float (&sc)[4]) {
  float sd[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int ks = 0; ks < D / 16; ks += 2) {
    mma16816(sc, kg[2 * ks], kg8[2 * ks], kg[2 * ks + 1], kg8[2 * ks + 1], qb[2 * ks], qb[2 * ks + 1]);
    mma16816(sd, kg[2 * ks + 2], kg8[2 * ks + 2], kg[2 * ks + 3], kg8[2 * ks + 3], qb[2 * ks + 2], qb[2 * ks + 3]);
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) sc[e] = Sub ? fmaf(sd[e], 1.f / float(1 << Sub), sc[e]) : sc[e] + sd[e];
}

// A warp's running state of its query columns 2t, 2t+1: online-softmax max and sum, the output
// accumulators, the KIVI score offsets and the last token each column may see (causal within the
// step's queries).
template <int D>
struct column_state {
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float acc[D / 16][4];
  float cz[2] = {0.f, 0.f};
  int last_visible[2];
  int all_visible;  // the last token every column may see (warp-uniform)
  __device__ column_state(const attend_params& p, const decode_item& item, int t) {
    const int q_first = item.n - item.q_len;
    all_visible = q_first;
    last_visible[0] = q_first + (2 * t) / p.group;
    last_visible[1] = q_first + (2 * t + 1) / p.group;
#pragma unroll
    for (int i = 0; i < D / 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  }
};

__device__ __forceinline__ float ex2(float x) {  // 2^x, one MUFU op (-inf -> 0)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Online softmax over S consecutive slabs' scores (S^T rows g, g + 8 of slab s in sc[4s..4s+3],
// columns 2t, 2t + 1): rows at or beyond `valid` (counted from the first slab's row 0) and tokens
// after a column's query are masked; the running max, sum and accumulators are updated once for
// the S slabs and P is left in `pv`. `rs`: per-row score scales (fp8 keys), `cz`: per-column
// score offsets (KIVI zeros).
template <int D, int S>
__device__ __forceinline__ void softmax_tiles(float (&sc)[4 * S], const float (&rs)[2 * S], float scale_log2, int tok0, int valid,
                                              int g, column_state<D>& cs, float (&pv)[4 * S]) {
  float(&m_col)[2] = cs.m;
  float(&l_col)[2] = cs.l;
  float(&acc)[D / 16][4] = cs.acc;
  const float(&cz)[2] = cs.cz;
  const int(&last_visible)[2] = cs.last_visible;
  // The scores stay unscaled (the softmax scale is positive: the max commutes with it); the scale
  // goes into the exponent's fma, and into the two columns' maxima.
  float tile_max[2] = {-INFINITY, -INFINITY};
  if (valid >= slab * S && tok0 + slab * S - 1 <= cs.all_visible) {  // (warp-uniform) nothing to mask
#pragma unroll
    for (int i = 0; i < 4 * S; ++i) {
      sc[i] = sc[i] * rs[i / 2] + cz[i % 2];
      tile_max[i % 2] = fmaxf(tile_max[i % 2], sc[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4 * S; ++i) {
      const int e = i % 4, row = slab * (i / 4) + g + (e / 2) * 8;
      const float x = sc[i] * rs[i / 2] + cz[e % 2];
      sc[i] = row < valid && tok0 + row <= last_visible[e % 2] ? x : -INFINITY;
      tile_max[e % 2] = fmaxf(tile_max[e % 2], sc[i]);
    }
  }
  tile_max[0] *= scale_log2;
  tile_max[1] *= scale_log2;
  // The running max is raised only when a score exceeds it by more than `slack` (a warp vote
  // instead of a shuffle reduction per step): until then P = 2^(s - m) may reach 2^slack, far
  // inside fp16 P and fp32 sums, and the sums and accumulators keep their scale.
  constexpr float slack = 8.f;
  float alpha[2] = {1.f, 1.f};
  if (__any_sync(0xffffffffu, tile_max[0] > m_col[0] + slack || tile_max[1] > m_col[1] + slack)) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      tile_max[c] = fmaxf(tile_max[c], __shfl_xor_sync(0xffffffffu, tile_max[c], 4));
      tile_max[c] = fmaxf(tile_max[c], __shfl_xor_sync(0xffffffffu, tile_max[c], 8));
      tile_max[c] = fmaxf(tile_max[c], __shfl_xor_sync(0xffffffffu, tile_max[c], 16));
      const float m_new = fmaxf(m_col[c], tile_max[c]);
      alpha[c] = m_new == -INFINITY ? 1.f : ex2(m_col[c] - m_new);
      m_col[c] = m_new;
    }
  }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 4 * S; ++i) {
    pv[i] = m_col[i % 2] == -INFINITY ? 0.f : ex2(fmaf(sc[i], scale_log2, -m_col[i % 2]));
    sum[i % 2] += pv[i];
  }
  l_col[0] = l_col[0] * alpha[0] + sum[0];
  l_col[1] = l_col[1] * alpha[1] + sum[1];
  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      acc[i][0] *= alpha[0];
      acc[i][1] *= alpha[1];
      acc[i][2] *= alpha[0];
      acc[i][3] *= alpha[1];
    }
  }
}

// P^T as B fragments of O^T += V^T P^T, from the S^T accumulators by register transpose.
__device__ __forceinline__ void p_frags(const float (&pv)[4], uint32_t& pb0, uint32_t& pb1) {
  pb0 = movmatrix_t(h2_bits(__floats2half2_rn(pv[0], pv[1])));
  pb1 = movmatrix_t(h2_bits(__floats2half2_rn(pv[2], pv[3])));
}

// O^T += V^T P^T from this lane's V halves of tokens 2t, 2t+1, 2t+8, 2t+9 (va..vd): A fragments
// pair two tokens per channel. Rows at or beyond `valid` hold stale bytes and are zeroed (P is 0
// there, but 0 x NaN is not).
template <int D>
__device__ __forceinline__ void values_mma(uint32_t (&va)[D / 16], uint32_t (&vb)[D / 16], uint32_t (&vc)[D / 16],
                                           uint32_t (&vd)[D / 16], int valid, int t, uint32_t pb0, uint32_t pb1,
                                           float (&acc)[D / 16][4]) {
  if (valid < slab) {
    const bool za = 2 * t < valid, zb = 2 * t + 1 < valid, zc = 2 * t + 8 < valid, zd = 2 * t + 9 < valid;
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      va[i] = za ? va[i] : 0u, vb[i] = zb ? vb[i] : 0u, vc[i] = zc ? vc[i] : 0u, vd[i] = zd ? vd[i] : 0u;
    }
  }
#pragma unroll
  for (int mtile = 0; mtile < D / 16; ++mtile)
    mma16816(acc[mtile], __byte_perm(va[mtile], vb[mtile], 0x5410), __byte_perm(va[mtile], vb[mtile], 0x7632),
             __byte_perm(vc[mtile], vd[mtile], 0x5410), __byte_perm(vc[mtile], vd[mtile], 0x7632), pb0, pb1);
}

// O^T += V^T P^T for one slab from the lane's raw V words (any format the kernel holds in
// registers: up to Cap bits).
template <int D, int Cap>
__device__ __forceinline__ void values_slab(const v_raw<D, Cap>& vr, format_traits fv, int valid, int t, uint32_t pb0,
                                            uint32_t pb1, float (&acc)[D / 16][4]) {
  if (fv.is_integer()) {
    const bool sym = fv.fam == family::sym;
    switch (fv.bits) {
      case 8: values_int<D, 8, Cap>(vr, sym, valid, t, pb0, pb1, acc); break;
      case 4: values_int<D, 4, Cap>(vr, sym, valid, t, pb0, pb1, acc); break;
      default: values_int<D, 2, Cap>(vr, sym, valid, t, pb0, pb1, acc); break;
    }
    return;
  }
  uint32_t va[D / 16], vb[D / 16], vc[D / 16], vd[D / 16];
  if (Cap >= 16 && fv.bits == 16) v_all<D, Cap >= 16 ? 16 : 8, Cap>(vr, fv.fam, va, vb, vc, vd);
  else v_all<D, 8, Cap>(vr, fv.fam, va, vb, vc, vd);  // fp8
  values_mma<D>(va, vb, vc, vd, valid, t, pb0, pb1, acc);
}

// Merges the block's warps and writes the block's partial (split) result. The caller has synced
// the block after the last use of the memory that `m` overlays.
template <int D>
__device__ __forceinline__ void write_partial(const attend_params& p, merge_area<D>& m, const column_state<D>& cs, bool has_work,
                                              int warp, int g, int t) {
  const float(&acc)[D / 16][4] = cs.acc;
  const float(&m_col)[2] = cs.m;
  const float(&l_col)[2] = cs.l;
  float l_tot[2] = {l_col[0], l_col[1]};
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    l_tot[c] += __shfl_xor_sync(0xffffffffu, l_tot[c], 4);
    l_tot[c] += __shfl_xor_sync(0xffffffffu, l_tot[c], 8);
    l_tot[c] += __shfl_xor_sync(0xffffffffu, l_tot[c], 16);
  }
#pragma unroll
  for (int i = 0; i < D / 16; ++i) {
    const int ch = (D / 8) * g + 2 * i;
    m.wo[warp][2 * t][ch] = has_work ? acc[i][0] : 0.f;
    m.wo[warp][2 * t + 1][ch] = has_work ? acc[i][1] : 0.f;
    m.wo[warp][2 * t][ch + 1] = has_work ? acc[i][2] : 0.f;
    m.wo[warp][2 * t + 1][ch + 1] = has_work ? acc[i][3] : 0.f;
  }
  if (g == 0)
    for (int c = 0; c < 2; ++c) {
      m.wml[warp][2 * t + c][0] = has_work ? m_col[c] : -INFINITY;
      m.wml[warp][2 * t + c][1] = has_work ? l_tot[c] : 0.f;
    }
  __syncthreads();
  const size_t part = (size_t(blockIdx.z) * p.kv.kv_heads + blockIdx.y) * p.max_splits + blockIdx.x;
  for (int idx = threadIdx.x; idx < 8 * D; idx += dec_warps * 32) {
    const int r = idx / D, c = idx % D;
    float mx = -INFINITY;
    for (int w = 0; w < dec_warps; ++w) mx = fmaxf(mx, m.wml[w][r][0]);
    float o = 0.f, l = 0.f;
    for (int w = 0; w < dec_warps; ++w) {
      const float mw = m.wml[w][r][0];
      const float f = mw == -INFINITY ? 0.f : exp2f(mw - mx);
      o += f * m.wo[w][r][c];
      l += f * m.wml[w][r][1];
    }
    p.ws_o[part * 16 * D + r * D + c] = o;
    if (c == 0) {
      p.ws_ml[(part * 16 + r) * 2] = mx;
      p.ws_ml[(part * 16 + r) * 2 + 1] = l;
    }
  }
}

// The block's slab range and this warp's part of it (whole slabs; the block-staged kernel deals
// its 32-token chunks itself).
struct slab_range {
  int page_slabs, c0, c1, s0, s1;
};
__device__ __forceinline__ slab_range block_slabs(const attend_params& p, const decode_item& item, int warp) {
  slab_range r;
  r.page_slabs = ceil_div(item.from_pages, slab);
  const int S = r.page_slabs + ceil_div(item.n - item.from_pages, slab);
  r.c0 = blockIdx.x * p.tiles_per_split;  // a multiple of dec_warps (x 2: block-staged)
  r.c1 = min(S, r.c0 + p.tiles_per_split);
  const int per_warp = ceil_div(r.c1 - r.c0, dec_warps);
  r.s0 = r.c0 + warp * per_warp;
  r.s1 = min(r.c1, r.s0 + per_warp);
  return r;
}

// ---- the wide decode kernel: layers that hold a 16-bit page -------------------------------------
// K codes of up to 16 bits are loaded from global memory into registers one slab ahead; V of up
// to 8 bits and the KIVI key scales go through two cp.async staging slots per warp (2 blocks/SM).
template <int D>
__global__ void __launch_bounds__(dec_warps * 32, 2) decode_wide_kernel(const __grid_constant__ attend_params p) {
  pdl_trigger();
  constexpr int Cap = 16;
  __shared__ decode_smem<D> sm;
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const decode_item item = p.items[blockIdx.z];
  const slab_range rg = block_slabs(p, item, warp);
  if (rg.c0 >= rg.c1) return;
  const int P = p.kv.page_tokens, page_slabs = rg.page_slabs, s0 = rg.s0, s1 = rg.s1;
  fill_page_table<D>(p, item, h, rg.c0, rg.c1, page_slabs, sm.pages);
  __syncthreads();

  uint32_t qb[D / 8];
  uint4(&qh)[D / 32][32] = sm.qh[warp];
  load_query<D>(p, item, h, g, t, qb);
  put_query<D>(qh, lane, qb);
  const uint8_t* q_scales_of = nullptr;  // the KIVI token group whose scales qb holds (nullptr: plain)
  column_state<D> cs(p, item, t);

  slab_ref cur{};
  k_raw<D, Cap> kc;
  const uint32_t slots = smem_addr(sm.vslot[warp][0]);
  // V of page slabs of up to 8 bits goes through the staging slots; 16-bit V is read where it is
  // used (staging it measured slower: 8 copies per lane and 4-way bank conflicts on the reads)
  auto staged = [&](const slab_ref& s) { return !s.ring && s.fv.bits <= 8; };
  if (s0 < s1) {
    cur = locate_slab<D>(p, item, h, s0, page_slabs, sm.pages);
    load_k<D, Cap>(cur, cur.fk, P, p.kv.window, g, t, kc);
    if (!cur.ring) stage_slab<D>(cur, P, lane, slots + (s0 & 1) * slot_bytes<D>);
  }
  cp_commit();
  for (int j = s0; j < s1; ++j) {
    const format_traits fk = cur.fk, fv = cur.fv;
    // this slab's V, then the next slab's K: in flight while this slab's scores are computed
    k_raw<D, Cap> kn = kc;
    if (j + 1 < s1) {
      const slab_ref nxt = locate_slab<D>(p, item, h, j + 1, page_slabs, sm.pages);
      load_k<D, Cap>(nxt, nxt.fk, P, p.kv.window, g, t, kn);
      if (!nxt.ring) stage_slab<D>(nxt, P, lane, slots + ((j + 1) & 1) * slot_bytes<D>);
    }
    cp_commit();  // one group per slab (possibly empty): wait_group 1 leaves only the next in flight
    cp_wait<1>();
    __syncwarp();
    const uint8_t* slot = sm.vslot[warp][j & 1];

    const bool k_codes = !cur.ring && fk.k_along_tokens();
    const int lgk = k_codes ? log2i(fk.group) : 0;
    const uint8_t* group_key =
        k_codes ? cur.k + uint32_t(P) * ((D * fk.bits) >> 3) + uint32_t(cur.row0 >> lgk) * D * 2 : nullptr;
    if (group_key != q_scales_of) {
      if (!k_codes) {
        get_query<D>(qh, lane, qb);
        cs.cz[0] = cs.cz[1] = 0.f;
      } else {
        fold_kivi<D>(slot + slot_kpar<D>, slot + slot_kpar<D> + D * 2, fk.bits, qh, lane, t, qb, cs.cz);  // staged with the slab
      }
      q_scales_of = group_key;
    }

    float sc[4] = {0.f, 0.f, 0.f, 0.f};
    {
      uint32_t kg[D / 8], kg8[D / 8];
      switch (fk.bits) {
        case 16: k_frags<D, 16, Cap>(kc.w, fk.fam, kc.ps, kg, kg8); break;
        case 8: k_frags<D, 8, Cap>(kc.w, fk.fam, kc.ps, kg, kg8); break;
        case 4: k_frags<D, 4, Cap>(kc.w, fk.fam, kc.ps, kg, kg8); break;
        default: k_frags<D, 2, Cap>(kc.w, fk.fam, kc.ps, kg, kg8); break;
      }
      scores_mma<D>(kg, kg8, qb, sc);
    }
    v_raw<D, Cap> vr;
    if (staged(cur)) {
      slab_ref sv = cur;
      sv.v = slot;
      sv.row0 = 0;
      load_v<D, Cap, false>(sv, fv, 16, p.kv.window, g, t, vr);
    } else {
      load_v<D, Cap, true>(cur, fv, P, p.kv.window, g, t, vr);  // 16-bit pages and the ring
    }
    float rs[2] = {1.f, 1.f};  // fp8 keys: per-token scales of rows g, g+8
    if (!cur.ring && fk.fam == family::fp8_e4m3) {
      const float2 r = fp8_scales(kc.ps[0], kc.ps[1], g, cur.valid);
      rs[0] = r.x, rs[1] = r.y;
    }
    float pv[4];
    softmax_tiles<D, 1>(sc, rs, p.scale_log2, cur.tok0, cur.valid, g, cs, pv);
    if (!cur.ring && fv.fam == family::fp8_e4m3) {  // per-token V scales fold into P
      const float2 v = fp8_scales(vr.s[0], vr.s[1], g, cur.valid);
      pv[0] *= v.x, pv[1] *= v.x, pv[2] *= v.y, pv[3] *= v.y;
    }
    uint32_t pb0, pb1;
    p_frags(pv, pb0, pb1);
    values_slab<D, Cap>(vr, fv, cur.valid, t, pb0, pb1, cs.acc);

    __syncwarp();  // every lane is done with this slab's staging slot
    // the next slab's description again (cheaper than keeping it live across the slab)
    if (j + 1 < s1) cur = locate_slab<D>(p, item, h, j + 1, page_slabs, sm.pages);
    kc = kn;
  }
  cp_wait<0>();
  __syncthreads();  // the merge area overlays the staging slots of every warp
  write_partial<D>(p, sm.m, cs, s0 < s1, warp, g, t);
}

// ---- the staged decode kernel: layers whose pages all hold formats of at most 8 bits ------------
// Each warp streams its slabs through a ring of `stages` per-warp stages in shared memory, filled by
// the bulk-copy engine (cp.async.bulk, one instruction per section, completion counted in bytes
// by one mbarrier per stage): no addresses per lane and no register prefetch. A stage holds one
// page slab's K as a 16-row page (codes, then sym/fp8 parameter rows, or the KIVI token group's
// scales and zeros, D halves each) and, at `stage_k_bytes`, its V as a 16-row page (codes, scales
// rows, zeros rows). Slabs whose format is wider than the
// stages (a stray 16-bit page, an 8-bit page under a 4-bit stage plan) and the FP16 ring are read
// from global memory where they are used.

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

constexpr int max_stages = 8;
// Blocks per SM of the staged kernel: 168 registers. (128 registers for 4 blocks spill ~220 bytes and
// measured 13-30 % slower.)
constexpr int staged_blocks = 3;

// A per-warp stage holds one slab (16 rows) of each role. Its room for one role: the code rows of
// `cap` bits plus the largest parameter section (K: KIVI scales and zeros, 4 D bytes; V: scale and
// zero rows, at most 16 D / 8 bytes).
__host__ __device__ constexpr uint32_t stage_k_bytes(int d, int cap) { return uint32_t(slab * d * cap / 8 + 4 * d); }
__host__ __device__ constexpr uint32_t stage_bytes(int d, int cap) {
  return stage_k_bytes(d, cap) + uint32_t(slab * d * cap / 8 + slab * d / 8);
}

// The bulk copy of one section (0 codes, 1 scales, 2 zeros) of a format's page in one role, for
// one slab (16 rows): x = offset in the page's role block of row 0 (group 0), y = bytes per row
// (low 16 bits) | row shift (bits 16-23: rows >> shift) | "KIVI key group" flag (bit 24), z = bytes
// (0: nothing to copy, or a format wider than the stages), w = offset in the stage's role region.
__device__ __forceinline__ uint4 chunk_section(format_id f, int r, int part, uint32_t D, uint32_t P, int cap) {
  constexpr uint32_t rows = slab;
  const format_traits t = traits_of(f);
  if (t.bits > cap) return make_uint4(0, 0, 0, 0);
  const uint32_t rb = D * t.bits / 8, code = P * rb;
  if (part == 0) return make_uint4(0, rb, rows * rb, 0);
  if (t.fam == family::fp8_e4m3) return part == 1 ? make_uint4(code, 4, rows * 4, rows * rb) : make_uint4(0, 0, 0, 0);
  if (r == 0 && t.has_zero()) {  // KIVI keys: the chunk's token group, scales then zeros
    const uint32_t lg = uint32_t(log2i(t.group)), y = D * 2 | lg << 16 | 1u << 24;
    return part == 1 ? make_uint4(code, y, D * 2, rows * rb) : make_uint4(code + (P >> lg) * D * 2, y, D * 2, rows * rb + D * 2);
  }
  if (!t.is_integer() || (part == 2 && !t.has_zero())) return make_uint4(0, 0, 0, 0);
  const uint32_t ng = D >> log2i(group_of(t, int(D)));  // per-row scales (and zeros)
  return part == 1 ? make_uint4(code, ng * 2, rows * ng * 2, rows * rb)
                   : make_uint4(code + P * ng * 2, ng * 2, rows * ng * 2, rows * rb + rows * ng * 2);
}

template <int D>
struct staged_head {
  // The barriers first: compute-sanitizer's racecheck (CUDA 13.0) reported the bulk copies'
  // transaction updates of a barrier at the barrier's address less 0x400 (the reserved shared
  // memory), as a write racing with whatever the block keeps there (it flagged the query rows'
  // stores when the barriers followed them); at offset 0 nothing of the block's lies below them.
  uint64_t bar[dec_warps + 2][max_stages];  // (block-staged kernel: full, empty, odd full, 3 more full rows)
  page_table_cache pages;
  uint4 qh[D / 32][32];  // the fp16 query pairs of each lane (for KIVI re-scaling; `put_query`); all warps alike
  uint4 sect[format_count][2][3];  // chunk_section of every (format, role, section), filled per block
};
template <int D>
constexpr uint32_t staged_head_bytes = (sizeof(staged_head<D>) + 127) / 128 * 128;

// The staged kernels' common start: the block's page lookups, this lane's query fragments, and
// the fp16 query pairs in shared memory (for KIVI re-scaling; warp 0 stores them).
template <int D>
__device__ __forceinline__ void staged_start(const attend_params& p, const decode_item& item, int h, const slab_range& rg,
                                             int warp, int g, int t, int lane, staged_head<D>& sm, uint32_t (&qb)[D / 8]) {
  fill_page_table<D>(p, item, h, rg.c0, rg.c1, rg.page_slabs, sm.pages);
  load_query<D>(p, item, h, g, t, qb);
  // Every warp holds the same fragments: warp w stores row w of the D / 32 rows (warps past them
  // store nothing). No warp-0-only stores: in the build with per-kind chunk loops, ptxas
  // predicated those in every warp, and racecheck reported them as a hazard (unexplained).
  static_assert(D / 32 <= dec_warps, "one query row per warp");
  if (warp < D / 32) {
    uint4 v = make_uint4(qb[0], qb[1], qb[2], qb[3]);
#pragma unroll
    for (int i = 1; i < D / 32; ++i)
      if (warp == i) v = make_uint4(qb[4 * i], qb[4 * i + 1], qb[4 * i + 2], qb[4 * i + 3]);
    sm.qh[warp][lane] = v;
  }
}

// Issues the bulk copies of page slab j into a per-warp stage (lane
// l < 6 copies one section: K codes, K scales, K zeros, V codes, V scales, V zeros, as described by
// `chunk_section`) and arms the stage's barrier with their bytes. KIVI key scales and zeros are
// copied only when the warp enters their token group (`first`: the warp's first slab).
template <int D>
__device__ __forceinline__ void issue_chunk(const attend_params& p, const page_table_cache& pc, const uint4 (*sect)[2][3], int j,
                                            bool first, int lane, uint32_t stage, uint32_t bar) {
  const int P = p.kv.page_tokens;
  const int tok0 = j * slab, e = (tok0 >> log2i(P)) - pc.first_page;
  const uint32_t row0 = uint32_t(tok0 & (P - 1));
  const bool is_v = lane >= 3;
  const uint4 d = sect[is_v ? pc.vid[e] : pc.kid[e]][is_v][lane % 3];
  const uint32_t shift = (d.y >> 16) & 0xffu;
  uint32_t bytes = lane < 6 ? d.z : 0u;
  if ((d.y >> 24) && !first && (row0 & ((1u << shift) - 1u))) bytes = 0;
  const uint32_t total = __reduce_add_sync(0xffffffffu, bytes);
  if (bytes) {
    const uint8_t* src = p.kv.arena + size_t(pc.page16[e]) * 16 + (is_v ? pc.v_offset[e] : 0u) + d.x + (row0 >> shift) * (d.y & 0xffffu);
    bulk_copy(stage + (is_v ? stage_k_bytes(D, p.stage_cap) : 0u) + d.w, src, bytes, bar);
  }
  if (lane == 0) mbar_expect_tx(bar, total);
}


// S^T of S consecutive staged slabs (sk: the stage as a `rows`-row page, row0 the first slab's
// row) for one kind of K format; slab s's scores in sc[4s..4s+3], each column's accumulators
// starting from `init` (KIVI: the score offsets of the token group's zeros).
template <int D, int Cap, family Fam, int Bits, int S, bool Sub = false>  // Sub: `k_frags_sub`
__device__ __forceinline__ void scores_kind(const slab_ref& sk, uint16_t group, int rows, int window, int g, int t,
                                            const uint32_t (&qb)[D / 8], float (&sc)[4 * S], float (&rs)[2 * S],
                                            int valid, float2 init = make_float2(0.f, 0.f)) {
  static_assert(!Sub || (Fam == family::kivi && Bits <= 4), "subnormal codes: 4- and 2-bit KIVI keys");
  const format_traits f{Fam, uint8_t(Bits), group};
#pragma unroll
  for (int s = 0; s < S; ++s) {
    slab_ref ss = sk;
    ss.row0 = sk.row0 + slab * s;
    k_raw<D, Cap> kr;
    load_k<D, Cap, false>(ss, f, rows, window, g, t, kr);
    uint32_t kg[D / 8], kg8[D / 8];
    if constexpr (Sub) k_frags_sub<D, Bits>(kr.w, kg, kg8);
    else k_frags<D, Bits, Cap>(kr.w, Fam, kr.ps, kg, kg8);
    float part[4] = {init.x, init.y, init.x, init.y};
    scores_mma<D, Sub ? Bits : 0>(kg, kg8, qb, part);
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[4 * s + e] = part[e];
    if constexpr (Fam == family::fp8_e4m3) {
      const float2 r = fp8_scales(kr.ps[0], kr.ps[1], g, valid - slab * s);
      rs[2 * s] = r.x, rs[2 * s + 1] = r.y;
    }
  }
}

// O^T += V^T P^T for S consecutive staged slabs for one kind of V format (slab s's P in
// pv[4s..4s+3]).
template <int D, int Cap, family Fam, int Bits, int S>
__device__ __forceinline__ void values_kind(const slab_ref& sk, uint16_t group, int rows, int window, int g, int t,
                                            float (&pv)[4 * S], int valid, float (&acc)[D / 16][4]) {
  const format_traits f{Fam, uint8_t(Bits), group};
#pragma unroll
  for (int s = 0; s < S; ++s) {
    slab_ref ss = sk;
    ss.row0 = sk.row0 + slab * s;
    const int vs = valid - slab * s;
    v_raw<D, Cap> vr;
    load_v<D, Cap, false>(ss, f, rows, window, g, t, vr);
    float ps[4] = {pv[4 * s], pv[4 * s + 1], pv[4 * s + 2], pv[4 * s + 3]};
    uint32_t pb0, pb1;
    if constexpr (Fam == family::fp8_e4m3) {  // per-token V scales fold into P
      const float2 v = fp8_scales(vr.s[0], vr.s[1], g, vs);
      ps[0] *= v.x, ps[1] *= v.x, ps[2] *= v.y, ps[3] *= v.y;
      p_frags(ps, pb0, pb1);
      uint32_t va[D / 16], vb[D / 16], vc[D / 16], vd[D / 16];
      v_all<D, 8, Cap>(vr, Fam, va, vb, vc, vd);
      values_mma<D>(va, vb, vc, vd, min(vs, slab), t, pb0, pb1, acc);
    } else {
      p_frags(ps, pb0, pb1);
      values_int<D, Bits, Cap>(vr, Fam == family::sym, min(vs, slab), t, pb0, pb1, acc);
    }
  }
}

// The family and bits of a kind (`kind_of`).
constexpr family kind_family(int k) { return k == 6 ? family::fp8_e4m3 : k >= 3 ? family::sym : family::kivi; }
constexpr int kind_bits(int k) { return k == 6 ? 8 : 8 >> (k % 3); }

// The K part and the V part of a step of S staged slabs of one page, compiled per kind of format:
// the kind `Kind` (>= 0: a block whose pages are all of one kind), or a switch over the page's.
template <int D, int Cap, int S, int Kind = -1>
__device__ __forceinline__ void scores_staged(format_traits fk, const slab_ref& sk, int rows, int window, int g, int t,
                                              const uint32_t (&qb)[D / 8], float (&sc)[4 * S], float (&rs)[2 * S], int valid) {
  if constexpr (Kind >= 0) {
    scores_kind<D, Cap, kind_family(Kind), kind_bits(Kind), S>(sk, fk.group, rows, window, g, t, qb, sc, rs, valid);
    return;
  }
  switch (sk.kk) {
    case 0: scores_kind<D, Cap, family::kivi, 8, S>(sk, fk.group, rows, window, g, t, qb, sc, rs, valid); break;
    case 1: scores_kind<D, Cap, family::kivi, 4, S>(sk, fk.group, rows, window, g, t, qb, sc, rs, valid); break;
    case 2: scores_kind<D, Cap, family::kivi, 2, S>(sk, fk.group, rows, window, g, t, qb, sc, rs, valid); break;
    case 3: scores_kind<D, Cap, family::sym, 8, S>(sk, fk.group, rows, window, g, t, qb, sc, rs, valid); break;
    case 4: scores_kind<D, Cap, family::sym, 4, S>(sk, fk.group, rows, window, g, t, qb, sc, rs, valid); break;
    case 5: scores_kind<D, Cap, family::sym, 2, S>(sk, fk.group, rows, window, g, t, qb, sc, rs, valid); break;
    default: scores_kind<D, Cap, family::fp8_e4m3, 8, S>(sk, fk.group, rows, window, g, t, qb, sc, rs, valid); break;
  }
}
template <int D, int Cap, int S, int Kind = -1>
__device__ __forceinline__ void values_staged(format_traits fv, const slab_ref& sk, int rows, int window, int g, int t,
                                              float (&pv)[4 * S], int valid, float (&acc)[D / 16][4]) {
  if constexpr (Kind >= 0) {
    values_kind<D, Cap, kind_family(Kind), kind_bits(Kind), S>(sk, fv.group, rows, window, g, t, pv, valid, acc);
    return;
  }
  switch (sk.kv) {
    case 0: values_kind<D, Cap, family::kivi, 8, S>(sk, fv.group, rows, window, g, t, pv, valid, acc); break;
    case 1: values_kind<D, Cap, family::kivi, 4, S>(sk, fv.group, rows, window, g, t, pv, valid, acc); break;
    case 2: values_kind<D, Cap, family::kivi, 2, S>(sk, fv.group, rows, window, g, t, pv, valid, acc); break;
    case 3: values_kind<D, Cap, family::sym, 8, S>(sk, fv.group, rows, window, g, t, pv, valid, acc); break;
    case 4: values_kind<D, Cap, family::sym, 4, S>(sk, fv.group, rows, window, g, t, pv, valid, acc); break;
    case 5: values_kind<D, Cap, family::sym, 2, S>(sk, fv.group, rows, window, g, t, pv, valid, acc); break;
    default: values_kind<D, Cap, family::fp8_e4m3, 8, S>(sk, fv.group, rows, window, g, t, pv, valid, acc); break;
  }
}

// One step of a staged decode kernel: the query for the step's K format (KIVI keys: their token
// group's scales folded in), then scores, online softmax and P V for one slab, or for the two slabs
// of a staged chunk (`pair`). cur: the slab(s) in memory; sk: the same rows in their stage, which
// has the shape of a `rows`-row page (a chunk stage holds one token group's KIVI key parameters, a
// page stage (`page_stage`) the whole page's).
template <int D, int Cap, int KK = -1, int KV = -1>
__device__ __forceinline__ void decode_step(const attend_params& p, const slab_ref& cur, const slab_ref& sk, int rows,
                                            bool page_stage, bool k_st, bool v_st, bool pair, int g, int t, int lane,
                                            const uint4 (&qh)[D / 32][32], uint32_t (&qb)[D / 8], int& q_key,
                                            column_state<D>& cs) {
  const int P = p.kv.page_tokens;
  const format_traits fk = cur.fk, fv = cur.fv;
  // ---- the query for this slab's K format ----
  const bool k_codes = !cur.ring && fk.k_along_tokens();
  const int lgk = k_codes ? log2i(fk.group) : 0;
  const int key = k_codes ? cur.tok0 & ~(int(fk.group) - 1) : -1;
  if (key != q_key) {
    const uint32_t rbk = uint32_t(D * fk.bits) >> 3;
    if (!k_codes) {
      get_query<D>(qh, lane, qb);
      cs.cz[0] = cs.cz[1] = 0.f;
    } else if (k_st) {  // a chunk stage holds its token group's scales and zeros; a page stage, all groups
      const uint8_t* ks = sk.k + rows * rbk + (page_stage ? uint32_t(sk.row0 >> lgk) * D * 2 : 0u);
      fold_kivi<D>(ks, ks + (page_stage ? uint32_t(rows >> lgk) * D * 2 : uint32_t(D * 2)), fk.bits, qh, lane, t, qb, cs.cz);
    } else {
      const uint8_t* sc = cur.k + uint32_t(P) * rbk + uint32_t(cur.row0 >> lgk) * D * 2;
      fold_kivi<D>(sc, sc + uint32_t(P >> lgk) * D * 2, fk.bits, qh, lane, t, qb, cs.cz);
    }
    q_key = key;
  }
  const int wnd = p.kv.window;
  if (pair) {
    float sc[8], rs[4] = {1.f, 1.f, 1.f, 1.f}, pv[8];
    scores_staged<D, Cap, 2, KK>(fk, sk, rows, wnd, g, t, qb, sc, rs, cur.valid);
    softmax_tiles<D, 2>(sc, rs, p.scale_log2, cur.tok0, cur.valid, g, cs, pv);
    values_staged<D, Cap, 2, KV>(fv, sk, rows, wnd, g, t, pv, cur.valid, cs.acc);
  } else {
    // ---- S^T = K Q^T ----
    float sc[4] = {0.f, 0.f, 0.f, 0.f};
    float rs[2] = {1.f, 1.f};  // fp8 keys: per-token scales of rows g, g+8
    if (k_st) {
      scores_staged<D, Cap, 1, KK>(fk, sk, rows, wnd, g, t, qb, sc, rs, cur.valid);
    } else if (fk.bits == 16) {  // the FP16 ring, a stray 16-bit page
      scores_wide<D>(cur, fk.fam, g, t, wnd, qb, sc);
    } else {  // a page wider than the stages (under a smaller `max_page_bits` hint)
      k_raw<D, Cap> kr;
      load_k<D, Cap, true>(cur, fk, P, wnd, g, t, kr);
      uint32_t kg[D / 8], kg8[D / 8];
      if (fk.bits == 8) k_frags<D, 8, Cap>(kr.w, fk.fam, kr.ps, kg, kg8);
      else k_frags<D, 4, Cap>(kr.w, fk.fam, kr.ps, kg, kg8);  // (a 2-bit page is never wider)
      scores_mma<D>(kg, kg8, qb, sc);
      if (fk.fam == family::fp8_e4m3) {
        const float2 r = fp8_scales(kr.ps[0], kr.ps[1], g, cur.valid);
        rs[0] = r.x, rs[1] = r.y;
      }
    }
    float pv[4];
    softmax_tiles<D, 1>(sc, rs, p.scale_log2, cur.tok0, cur.valid, g, cs, pv);

    // ---- O^T += V^T P^T ----
    if (v_st) {
      values_staged<D, Cap, 1, KV>(fv, sk, rows, wnd, g, t, pv, cur.valid, cs.acc);
    } else if (fv.bits == 16) {
      uint32_t pb0, pb1;
      p_frags(pv, pb0, pb1);
      values_wide<D>(cur, fv.fam, g, t, wnd, pb0, pb1, cs.acc);
    } else {  // a page wider than the stages
      v_raw<D, Cap> vr;
      load_v<D, Cap, true>(cur, fv, P, wnd, g, t, vr);
      if (fv.fam == family::fp8_e4m3) {
        const float2 v = fp8_scales(vr.s[0], vr.s[1], g, cur.valid);
        pv[0] *= v.x, pv[1] *= v.x, pv[2] *= v.y, pv[3] *= v.y;
      }
      uint32_t pb0, pb1;
      p_frags(pv, pb0, pb1);
      values_slab<D, Cap>(vr, fv, cur.valid, t, pb0, pb1, cs.acc);
    }
  }
}

// One slab per stage (layers of 8 bits whose page-heads leave room for fewer than 3 page stages,
// e.g. page_tokens 128; the block-staged kernel takes the others). With the two-slab step compiled
// in, this path measured 3-10 % slower (one register allocation for both).
template <int D>
__global__ void __launch_bounds__(dec_warps * 32, staged_blocks) decode_kernel(const __grid_constant__ attend_params p) {
  pdl_trigger();
  constexpr int Cap = 8;
  extern __shared__ __align__(128) uint8_t dsm[];
  staged_head<D>& sm = *reinterpret_cast<staged_head<D>*>(dsm);
  uint8_t* stages = dsm + staged_head_bytes<D>;
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const decode_item item = p.items[blockIdx.z];
  const slab_range rg = block_slabs(p, item, warp);
  if (rg.c0 >= rg.c1) return;
  const int P = p.kv.page_tokens, page_slabs = rg.page_slabs, s0 = rg.s0, s1 = rg.s1;
  const int ns = p.stages, rows = slab;
  const uint32_t st_bytes = stage_bytes(D, p.stage_cap), st_v = stage_k_bytes(D, p.stage_cap);
  uint8_t* my_stages = stages + uint32_t(warp * ns) * st_bytes;
  const uint32_t my_stages_s = smem_addr(my_stages), my_bars = smem_addr(&sm.bar[warp][0]);
  uint32_t qb[D / 8];
  staged_start<D>(p, item, h, rg, warp, g, t, lane, sm, qb);
  for (int i = threadIdx.x; i < int(format_count) * 6; i += dec_warps * 32)
    sm.sect[i / 6][i / 3 % 2][i % 3] = chunk_section(format_id(i / 6), i / 3 % 2, i % 3, D, P, p.stage_cap);
  if (lane < ns) mbar_init(my_bars + lane * 8, 1);
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  __syncthreads();

  // prologue: the first ns - 1 page slabs in flight
  const int issue_end = min(s1, page_slabs);
  int issue_j = s0, issue_st = 0;
  for (; issue_j < issue_end && issue_st < ns - 1; ++issue_j, ++issue_st)
    issue_chunk<D>(p, sm.pages, sm.sect, issue_j, issue_j == s0, lane, my_stages_s + issue_st * st_bytes, my_bars + issue_st * 8);
  if (issue_st == ns) issue_st = 0;

  int q_key = -2;  // the KIVI token group (its first token) whose scales qb holds; -1: the plain query
  column_state<D> cs(p, item, t);
  int cur_st = 0, cur_e = -1;
  uint32_t phases = 0;  // bit s: parity of stage s's next phase
  format_traits pk{}, pv_fmt{};  // the current page's formats (kept across its slabs)
  int8_t pkk = -1, pvk = -1;     // and their kinds
  for (int j = s0; j < s1; ++j) {
    if (issue_j < issue_end) {  // refill the stage the previous slab freed
      issue_chunk<D>(p, sm.pages, sm.sect, issue_j, false, lane, my_stages_s + issue_st * st_bytes, my_bars + issue_st * 8);
      ++issue_j;
      if (++issue_st == ns) issue_st = 0;
    }
    slab_ref cur;
    if (j < page_slabs) {  // the page's formats are read only when the page changes
      cur.tok0 = j * slab;
      const int e = (cur.tok0 >> log2i(P)) - sm.pages.first_page;
      if (e != cur_e) cur_e = e, pk = sm.pages.fk[e], pv_fmt = sm.pages.fv[e], pkk = sm.pages.kk[e], pvk = sm.pages.kv[e];
      cur.fk = pk, cur.fv = pv_fmt, cur.kk = pkk, cur.kv = pvk;
      cur.k = p.kv.arena + size_t(sm.pages.page16[e]) * 16;  // (used by the unstaged paths only)
      cur.v = cur.k + sm.pages.v_offset[e];
      cur.ring = false;
      cur.row0 = cur.tok0 & (P - 1);
      mbar_wait(my_bars + cur_st * 8, (phases >> cur_st) & 1u);
      phases ^= 1u << cur_st;
    } else {
      cur = locate_slab<D>(p, item, h, j, page_slabs, sm.pages);
    }
    const format_traits fk = cur.fk, fv = cur.fv;
    const uint8_t* st = my_stages + cur_st * st_bytes;
    const bool k_st = !cur.ring && fk.bits <= p.stage_cap, v_st = !cur.ring && fv.bits <= p.stage_cap;
    if (!cur.ring) cur.valid = min(slab, item.from_pages - cur.tok0);
    // the slab in its stage: a 16-row page
    slab_ref sk = cur;
    sk.k = st, sk.v = st + st_v, sk.row0 = 0;

    decode_step<D, Cap>(p, cur, sk, rows, false, k_st, v_st, false, g, t, lane, sm.qh, qb, q_key, cs);
    __syncwarp();  // every lane is done with this step's rows of the stage
    if (!cur.ring && ++cur_st == ns) cur_st = 0;
  }
  __syncthreads();  // the merge area overlays every warp's stages (all their copies were waited for)
  write_partial<D>(p, *reinterpret_cast<merge_area<D>*>(stages), cs, s0 < s1, warp, g, t);
}

// ---- the block-staged decode kernel: layers of at most 8 bits ---------------------------------
// The block's pages go whole through a ring of `p.stages` page stages shared by its warps: one
// bulk copy per page (a page-head's K and V blocks are contiguous), where the per-warp chunk
// stages took six per 32 tokens (K and V codes, scales, zeros), each a loop over lanes in the
// compiled code. Warp w takes the 32-token chunks w, w + 4, ... of the block's page slabs. Each
// stage has full barriers (the copy's bytes; one for its even and one for its odd fills) and an
// empty one (every lane of the page's warps arrives when done with it); the warp of a page's last
// chunk waits for the others (working on the same page at the same time) and refills the stage
// with the page `stages` further on. The
// FP16 ring's slabs follow, one per warp in turn. Pages wider than the stages are read from
// global memory.

// Issues the bulk copy of the block's page e (relative) into a page stage: the page-head's K and
// V blocks, or the one of them whose format the stages hold, or nothing (the barrier still
// completes its phase). What is copied starts at the stage's start: a staged V block whose K is
// wider than the stages goes there (its `page_table_cache::v_offset` is 0), not at its offset in
// the page-head, which would run past the stage (a stage holds the largest staged K and V blocks,
// not a wider K).
template <int D>
__device__ __forceinline__ void issue_page(const attend_params& p, const page_table_cache& pc, int e, uint32_t stage, uint32_t bar) {
  const uint32_t bytes = pc.copy_bytes[e];
  mbar_expect_tx(bar, bytes);
  if (bytes) {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the warps' reads of the stage's last page
    bulk_copy(stage, p.kv.arena + size_t(pc.page16[e]) * 16 + pc.copy_from[e], bytes, bar);
  }
}

// TwoFull: two full barriers per stage (rings whose warp pairs take a stage's pages in turn; below).
// Whole: the caller says each kv head's pages have one format pair (`attend_args::
// one_format_per_head`): blocks of 4/2-bit pages of one pair read whole 64-token units per step
// (`pages`, below). An instance of its own: compiled into one kernel with the per-page dispatch,
// it made that dispatch 2-5 % slower (register allocation), and a decode step over mixed layers
// (EchoKV's tiers over time) 6-7 % slower.
template <int D, bool TwoFull, bool Whole>
__global__ void __launch_bounds__(dec_warps * 32, staged_blocks) decode_paged_kernel(const __grid_constant__ attend_params p) {
  pdl_trigger();
  constexpr int Cap = 8;
  extern __shared__ __align__(128) uint8_t dsm[];
  staged_head<D>& sm = *reinterpret_cast<staged_head<D>*>(dsm);
  uint8_t* stages = dsm + staged_head_bytes<D>;
  const int h = blockIdx.y, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int warp = __shfl_sync(0xffffffffu, int(threadIdx.x) / 32, 0);  // (known warp-uniform: uniform registers)
  const decode_item item = p.items[blockIdx.z];
  const slab_range rg = block_slabs(p, item, 0);  // (the block's range; warps interleave below)
  if (rg.c0 >= rg.c1) return;
  const int P = p.kv.page_tokens, page_slabs = rg.page_slabs, c0 = rg.c0;  // c0: on a page boundary
  const int pc_end = max(c0, min(rg.c1, page_slabs));  // the block's page slabs: [c0, pc_end)
  const int n_chunks = (pc_end - c0 + 1) / 2, cpp = P / (2 * slab), n_pages = ceil_div(n_chunks, cpp);
  const int ns = p.stages;
  const uint32_t st_bytes = p.page_stage, stages_s = smem_addr(stages);
  // Per stage: a full barrier (TwoFull: one for its even and one for its odd fills) and an empty
  // barrier. Page e of the block goes to the warps of its chunks, e x cpp .. e x cpp + cpp - 1
  // (mod 4). With stages x cpp a multiple of 4, every page of a stage goes to the same warps;
  // otherwise (8-bit page-heads on 3 stages) two warp pairs take a stage's pages in turn. A parity
  // wait cannot tell a barrier's phase from the one two before it, so a pair that came to its next
  // page of a stage before the other pair's page there had landed would pass a single full
  // barrier's wait; with one barrier per fill parity, each barrier's phases belong to one pair,
  // which waits for them in order. (An empty barrier's waiter, the page's last warp, is one of its
  // arrivers, and the previous fill was released before this one was issued: it waits on the
  // current phase.) The single-barrier instance is kept for the other rings: the two-barrier code
  // measured 3-4 % slower on 4-bit layers (register allocation).
  const uint32_t bars = smem_addr(&sm.bar[0][0]), bars_empty = smem_addr(&sm.bar[1][0]), bars_odd = smem_addr(&sm.bar[2][0]);
  const auto full_bar = [&](int stage, int fill) {
    if constexpr (TwoFull) return (fill & 1 ? bars_odd : bars) + uint32_t(stage) * 8;
    else return bars + uint32_t(stage) * 8;
  };
  const auto full_parity = [](int fill) { return uint32_t(TwoFull ? fill >> 1 : fill) & 1u; };
  uint32_t qb[D / 8];
  staged_start<D>(p, item, h, rg, warp, g, t, lane, sm, qb);
  // Layers of one format (a static policy's) mostly: a block whose pages all have the same staged
  // K and V kinds runs code compiled for those kinds (the rings' common kinds: 8-bit (two full
  // barriers) kivi8, sym8, fp8; 4/2-bit kivi4, kivi2, sym4, sym2 and KIVI's K4V2): whole 64-token
  // units per step (`pages`, the Whole instance, page_tokens 64 and up), else 32-token chunks
  // (`chunks`). Other blocks run 32-token chunks that dispatch on each page's kinds.
  const auto uniform_kinds = [&]() {  // the (K kind, V kind) of every page of the block, both staged; else -1
    bool same = true;
    for (int i = threadIdx.x; i < n_pages; i += dec_warps * 32)
      same = same && sm.pages.kk[i] == sm.pages.kk[0] && sm.pages.kv[i] == sm.pages.kv[0];
    const bool uni = __syncthreads_and(same) && n_pages > 0 && sm.pages.fk[0].bits <= p.stage_cap &&
                     sm.pages.fv[0].bits <= p.stage_cap;
    return uni ? 8 * sm.pages.kk[0] + sm.pages.kv[0] : -1;
  };
  int combo = -1;
  bool whole = false;
  if constexpr (Whole) {
    __syncthreads();  // the page table
    combo = uniform_kinds();
    // Whole units need a stage in flight beyond the pages the 4 warps hold (4/2-bit rings: 6-8
    // stages of one page each at page_tokens 64). 8-bit rings (3 stages, two full barriers)
    // measured 8-10 % slower with them: they run 32-token chunks compiled per kind (`chunks`).
    whole = P >= 4 * slab && ns * (P / (4 * slab)) > dec_warps &&
            (combo == 8 * 1 + 1 || combo == 8 * 2 + 2 || combo == 8 * 1 + 2 || combo == 8 * 4 + 4 ||
             combo == 8 * 5 + 5);
  }
  // Units per page: 32-token chunks, or 64-token units for `pages`. With 64-token units, the pages
  // of a stage may go to up to four warps in turn: its fill f has full barrier row f mod 4, each
  // row's phases belong to one warp (or one pair at page_tokens 128), which waits for them in order.
  const int upp = whole ? P / (4 * slab) : cpp;
  const auto quad_bar = [&](int stage, int fill) {
    const int r = fill & 3;
    return bars + uint32_t((r == 0 ? 0 : r + 1) * max_stages + stage) * 8;
  };
  // Lane 0 of the warp of a page's last chunk issues the page's copy and arms its stage's full
  // barrier.
  const auto last_chunk = [&](int e) { return (e + 1) * upp - 1; };
  const auto issuer = [&](int e) { return last_chunk(e) % dec_warps; };
  if (warp == 0) {  // (a warp-uniform branch first: the init's loop over lanes must not run in other warps)
    if (lane < ns) {
      mbar_init(bars + lane * 8, 1);
      if (TwoFull || whole) mbar_init(bars_odd + lane * 8, 1);
      if (whole) {
        mbar_init(bars + (3 * max_stages + lane) * 8, 1);
        mbar_init(bars + (4 * max_stages + lane) * 8, 1);
      }
      mbar_init(bars_empty + lane * 8, uint32_t(32 * upp));
    }
  }
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  __syncthreads();
  if (lane == 0)
    for (int e = 0; e < min(ns, n_pages); ++e)
      if (issuer(e) == warp) issue_page<D>(p, sm.pages, e, stages_s + e * st_bytes, full_bar(e, 0));

  int q_key = -2;  // the KIVI token group (its first token) whose scales qb holds; -1: the plain query
  column_state<D> cs(p, item, t);
  bool worked = false;
  // The chunks of the block's pages, compiled for one (K kind, V kind) where KK, KV >= 0 (every
  // page of the block of those kinds, both staged), else dispatching on each page's kinds.
  const auto chunks = [&]<int KK, int KV>() __attribute__((always_inline)) {
    // The warp's chunk u is in the block's page e = u / cpp, which is in stage st = e % ns, its fill
    // e / ns: kept as counters (pages advance by at most 4 / cpp <= 2 < ns per step), not divided
    // anew per chunk (a division by a runtime value is ~20 dependent instructions with a MUFU).
    const int lg_cpp = log2i(cpp);
    int e = warp >> lg_cpp, st = e % ns, fill = e / ns;
    for (int u = warp; u < n_chunks; u += dec_warps) {
      const int j = c0 + 2 * u;
      slab_ref cur;
      cur.tok0 = j * slab;
      cur.fk = sm.pages.fk[e], cur.fv = sm.pages.fv[e], cur.kk = sm.pages.kk[e], cur.kv = sm.pages.kv[e];
      cur.k = p.kv.arena + size_t(sm.pages.page16[e]) * 16;  // (used by the unstaged paths only)
      cur.v = cur.k + sm.pages.v_offset[e];
      cur.ring = false;
      cur.row0 = cur.tok0 & (P - 1);
      mbar_wait(full_bar(st, fill), full_parity(fill));
      const bool k_st = KK >= 0 || cur.fk.bits <= p.stage_cap, v_st = KV >= 0 || cur.fv.bits <= p.stage_cap;
      slab_ref sk = cur;
      sk.k = stages + st * st_bytes, sk.v = sk.k + sm.pages.v_offset[e];
      if (j + 1 < pc_end && k_st && v_st) {  // the chunk's two slabs as one step
        cur.valid = sk.valid = min(2 * slab, item.from_pages - cur.tok0);
        decode_step<D, Cap, KK, KV>(p, cur, sk, P, true, k_st, v_st, true, g, t, lane, sm.qh, qb, q_key, cs);
      } else {
        for (int i = 0; i < 2 && j + i < pc_end; ++i) {
          slab_ref c1 = cur, s1 = sk;
          c1.tok0 = cur.tok0 + slab * i, c1.row0 = s1.row0 = cur.row0 + slab * i;
          c1.valid = s1.valid = min(slab, item.from_pages - c1.tok0);
          decode_step<D, Cap, KK, KV>(p, c1, s1, P, true, k_st, v_st, false, g, t, lane, sm.qh, qb, q_key, cs);
        }
      }
      worked = true;
      __syncwarp();  // every lane is done with this chunk's rows of the stage
      if (e + ns < n_pages) {  // the page's warps release its stage; the warp of its last chunk refills it
        mbar_arrive(bars_empty + st * 8);  // every lane: an arrive releases its own thread's reads only
        if ((u & (cpp - 1)) == cpp - 1) {  // u == last_chunk(e) (in warp issuer(e))
          mbar_wait(bars_empty + st * 8, uint32_t(fill) & 1u);
          if (lane == 0) issue_page<D>(p, sm.pages, e + ns, stages_s + st * st_bytes, full_bar(st, fill + 1));
        }
      }
      const int e_next = (u + dec_warps) >> lg_cpp;
      st += e_next - e, e = e_next;
      if (st >= ns) st -= ns, ++fill;
    }
  };
  // Whole 64-token units of a block whose pages all have one (K kind, V kind), both staged: one
  // online-softmax update per unit (four slabs), half the per-step work of 32-token chunks. Warp w
  // takes units w, w + 4, ...; at page_tokens 64 a unit is its page.
  const auto pages = [&]<int KK, int KV>() __attribute__((always_inline)) {
    constexpr family FK = kind_family(KK), FV = kind_family(KV);
    constexpr int BK = kind_bits(KK), BV = kind_bits(KV);
    constexpr bool Sub = FK == family::kivi && BK <= 4;  // keys as subnormal codes (`k_frags_sub`): scores x 2^-24
    const float scale_log2 = Sub ? p.scale_log2 * 0x1p24f : p.scale_log2;
    const int lg_upp = log2i(upp), n_units = ceil_div(pc_end - c0, 4), wnd = p.kv.window;
    int e = warp >> lg_upp, st = e % ns, fill = e / ns;
    // (KIVI: each half's zero-point offsets start its score accumulators; -0 adds as nothing)
    cs.cz[0] = cs.cz[1] = -0.f;
    for (int u = warp; u < n_units; u += dec_warps) {
      const int tok0 = (c0 + 4 * u) * slab, valid = min(4 * slab, item.from_pages - tok0);
      mbar_wait(quad_bar(st, fill), uint32_t(fill >> 2) & 1u);
      const format_traits fk = sm.pages.fk[e];
      slab_ref sk;
      sk.k = stages + st * st_bytes, sk.v = sk.k + sm.pages.v_offset[e];
      sk.tok0 = tok0, sk.row0 = tok0 & (P - 1), sk.valid = valid, sk.ring = false;
      float sc[16], rs[8], pv[16];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {  // two 32-token halves (KIVI g32: a token group each)
        slab_ref sh = sk;
        sh.row0 = sk.row0 + 2 * slab * hf;
        float part[8], prs[4] = {1.f, 1.f, 1.f, 1.f}, cz[2] = {0.f, 0.f};
        if constexpr (FK == family::kivi) {
          const int lgk = log2i(fk.group);
          const uint8_t* ks = sk.k + P * (uint32_t(D * BK) >> 3) + uint32_t(sh.row0 >> lgk) * D * 2;
          fold_kivi<D, Sub ? BK : 0>(ks, ks + uint32_t(P >> lgk) * D * 2, BK, sm.qh, lane, t, qb, cz);
        }
        const float czs = Sub ? 0x1p-24f : 1.f;
        scores_kind<D, Cap, FK, BK, 2, Sub>(sh, fk.group, P, wnd, g, t, qb, part, prs, valid - 2 * slab * hf,
                                            make_float2(cz[0] * czs, cz[1] * czs));
#pragma unroll
        for (int i = 0; i < 8; ++i) sc[8 * hf + i] = part[i];
#pragma unroll
        for (int i = 0; i < 4; ++i) rs[4 * hf + i] = prs[i];
      }
      softmax_tiles<D, 4>(sc, rs, scale_log2, tok0, valid, g, cs, pv);
      values_kind<D, Cap, FV, BV, 4>(sk, sm.pages.fv[e].group, P, wnd, g, t, pv, valid, cs.acc);
      worked = true;
      __syncwarp();  // every lane is done with this unit's rows of the stage
      if (e + ns < n_pages) {  // the page's warps release its stage; the warp of its last unit refills it
        mbar_arrive(bars_empty + st * 8);
        if ((u & (upp - 1)) == upp - 1) {
          mbar_wait(bars_empty + st * 8, uint32_t(fill) & 1u);
          if (lane == 0) issue_page<D>(p, sm.pages, e + ns, stages_s + st * st_bytes, quad_bar(st, fill + 1));
        }
      }
      const int e_next = (u + dec_warps) >> lg_upp;
      st += e_next - e, e = e_next;
      while (st >= ns) st -= ns, ++fill;
    }
    q_key = -2;  // qb holds a token group's fold
  };
  if constexpr (Whole) {
    switch (whole ? combo : -1) {
      case 8 * 1 + 1: pages.template operator()<1, 1>(); break;
      case 8 * 2 + 2: pages.template operator()<2, 2>(); break;
      case 8 * 1 + 2: pages.template operator()<1, 2>(); break;
      case 8 * 4 + 4: pages.template operator()<4, 4>(); break;
      case 8 * 5 + 5: pages.template operator()<5, 5>(); break;
      default: chunks.template operator()<-1, -1>(); break;  // (a block of mixed pages: the hint was wrong)
    }
  } else {
    // A block whose pages all have the same staged K and V kinds runs the chunk loop compiled for
    // them (no dispatch per step).
    combo = uniform_kinds();
    if constexpr (TwoFull) {
      switch (combo) {
        case 8 * 0 + 0: chunks.template operator()<0, 0>(); break;
        case 8 * 3 + 3: chunks.template operator()<3, 3>(); break;
        case 8 * 6 + 6: chunks.template operator()<6, 6>(); break;
        default: chunks.template operator()<-1, -1>(); break;
      }
    } else {
      switch (combo) {
        case 8 * 1 + 1: chunks.template operator()<1, 1>(); break;
        case 8 * 2 + 2: chunks.template operator()<2, 2>(); break;
        case 8 * 1 + 2: chunks.template operator()<1, 2>(); break;
        case 8 * 4 + 4: chunks.template operator()<4, 4>(); break;
        case 8 * 5 + 5: chunks.template operator()<5, 5>(); break;
        default: chunks.template operator()<-1, -1>(); break;
      }
    }
  }
  for (int j = max(c0, page_slabs) + warp; j < rg.c1; j += dec_warps) {  // the FP16 ring
    const slab_ref cur = locate_slab<D>(p, item, h, j, page_slabs, sm.pages);
    decode_step<D, Cap>(p, cur, cur, P, true, false, false, false, g, t, lane, sm.qh, qb, q_key, cs);
    worked = true;
  }
  __syncthreads();  // the merge area overlays the stages (every page issued was waited for)
  write_partial<D>(p, *reinterpret_cast<merge_area<D>*>(stages), cs, worked, warp, g, t);
}

// The split merge: one block per output row (blockIdx.z: the row within its 16-row m-tile), two
// dependent rounds of loads: every split's max and sum at once (a thread per split), then the
// partial outputs, the warps taking the splits in turn and the lanes D / 32 channels each, with
// up to 8 loads in flight per lane; the warps' sums meet in shared memory. (A thread per output
// element walking the splits one dependent load at a time took 21 us of a 1 x 128K step: 49
// splits on 8 blocks.)
constexpr int merge_threads = 256;
template <int D>
__global__ void __launch_bounds__(merge_threads) merge_kernel(const __grid_constant__ attend_params p) {
  pdl_wait();  // the attention grid's partials
  constexpr int warps = merge_threads / 32, per_lane = D / 32;
  using vec = std::conditional_t<per_lane == 4, float4, float2>;
  __shared__ float red[warps], f_s[merge_threads];
  __shared__ __align__(16) float wo_sum[warps][D];
  const int h = blockIdx.y / p.mtiles, mt = blockIdx.y % p.mtiles, r = blockIdx.z;
  const decode_item item = p.items[blockIdx.x];
  const int rows_used = p.group * item.q_len;
  if (mt * 16 + r >= rows_used) return;
  if (r == 0 && p.q_stage && item.stage_row >= 0) {  // the canary's copy of this m-tile's query rows
    const int width = p.q_heads * D;
    for (int idx = threadIdx.x; idx < 16 * D; idx += merge_threads) {
      const int mm = mt * 16 + idx / D, c = idx % D;
      if (mm >= rows_used) break;
      const int i = mm / p.group, qh = h * p.group + mm % p.group;
      p.q_stage[int64_t(item.stage_row + i) * width + qh * D + c] =
          load_any(p.q, p.q_type, int64_t(item.q_row + i) * p.q_stride + int64_t(qh) * D + c);
    }
  }
  const int T = ceil_div(item.from_pages, p.unit_tokens) + ceil_div(item.n - item.from_pages, p.unit_tokens);
  const int splits = ceil_div(T, p.tiles_per_split);
  const size_t part0 = ((size_t(blockIdx.x) * p.kv.kv_heads + h) * p.mtiles + mt) * p.max_splits;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float2* ml = reinterpret_cast<const float2*>(p.ws_ml + (part0 * 16 + r) * 2);  // split s: ml[s * 16] (max, sum)
  const auto block_reduce = [&](float x, bool is_max) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float y = __shfl_xor_sync(0xffffffffu, x, o);
      x = is_max ? fmaxf(x, y) : x + y;
    }
    __syncthreads();  // red's previous readers are done
    if (lane == 0) red[warp] = x;
    __syncthreads();
    x = red[0];
#pragma unroll
    for (int w = 1; w < warps; ++w) x = is_max ? fmaxf(x, red[w]) : x + red[w];
    return x;
  };
  // (more than merge_threads splits: the maxima in a loop, then the splits in chunks)
  const float2 first = threadIdx.x < splits ? ml[size_t(threadIdx.x) * 16] : make_float2(-INFINITY, 0.f);
  float m = first.x;
  for (int s = threadIdx.x + merge_threads; s < splits; s += merge_threads) m = fmaxf(m, ml[size_t(s) * 16].x);
  m = block_reduce(m, true);
  float l = 0.f, acc[per_lane] = {};
  const float* wo = p.ws_o + (part0 * 16 + r) * D + lane * per_lane;  // split s: wo[s * 16 * D]
  for (int base = 0; base < splits; base += merge_threads) {
    const float2 e = base == 0 ? first : base + threadIdx.x < splits ? ml[size_t(base + threadIdx.x) * 16] : make_float2(-INFINITY, 0.f);
    const float f = e.x == -INFINITY ? 0.f : exp2f(e.x - m);
    l += f * e.y;
    if (base > 0) __syncthreads();  // f_s's previous readers are done
    f_s[threadIdx.x] = f;
    __syncthreads();
    const int n = min(merge_threads, splits - base);
#pragma unroll 8
    for (int s = warp; s < n; s += warps) {
      const float fs = f_s[s];
      const vec x = *reinterpret_cast<const vec*>(wo + size_t(base + s) * 16 * D);
      acc[0] += fs * x.x, acc[1] += fs * x.y;
      if constexpr (per_lane == 4) acc[2] += fs * x.z, acc[3] += fs * x.w;
    }
  }
  l = block_reduce(l, false);
#pragma unroll
  for (int c = 0; c < per_lane; ++c) wo_sum[warp][lane * per_lane + c] = acc[c];
  __syncthreads();
  const int mm = mt * 16 + r, i = mm / p.group, qh = h * p.group + mm % p.group;
  const int64_t out = int64_t(item.q_row + i) * p.o_stride + int64_t(qh) * D;
  for (int c = threadIdx.x; c < D; c += merge_threads) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < warps; ++w) o += wo_sum[w][c];
    store_any(p.o, p.o_type, out + c, o / l);
  }
}

// Splits and tiles for a batch: enough thread blocks to fill the chip about four times over.
struct launch_plan {
  bool decode;  // group x q_len <= 8: the warp-split decode kernel
  bool wide;    // decode: some page may hold a 16-bit format (registers for 16-bit prefetch)
  int unit, mtiles, tiles_per_split, max_splits, max_tiles;
  int rows;  // output rows per m-tile at most (the merge's blocks per m-tile)
  int stages, stage_cap, smem, per_sm;  // the staged decode kernel's stages and occupancy
  uint32_t page_stage;                         // > 0: the block-staged kernel, bytes of a page stage
  bool two_full;                               // its stage x chunks per page not a multiple of 4: two full barriers per stage
  bool whole;                                  // the caller's `one_format_per_head` on a ring without two_full
};

// Stages of a layer of at most 8 bits. cap: the bits a stage holds (the layer's widest format,
// rounded up to 2/4/8). The block-staged kernel (page stages shared by the block's warps) when at
// least 3 page stages fit with `staged_blocks` blocks per SM, a page-head of the largest K and V
// formats the stages hold each (8-bit page-heads: 18 KB at page_tokens 64, 3 stages); else the
// per-warp staged kernel, one slab per stage, as many stages as fit, 2 at least.
template <int D>
void plan_stages(const paged_view& kv, int max_bits, bool one_format, launch_plan& lp) {
  constexpr int sm_bytes = 227 * 1024, reserved = 1024;
  lp.stage_cap = max_bits <= 2 ? 2 : max_bits <= 4 ? 4 : 8;
  const int room = sm_bytes / staged_blocks - reserved - int(staged_head_bytes<D>);
  uint32_t kb = 0, vb = 0;  // the largest K and V page-heads the stages hold
  for (int f = 0; f < int(format_count); ++f)
    if (traits_of(format_id(f)).bits <= lp.stage_cap) kb = std::max(kb, kv.k_page_bytes[f]), vb = std::max(vb, kv.v_page_bytes[f]);
  const int ps = int((kb + vb + 127) / 128 * 128);
  // Page stages: any count of at least 3. Where stages x chunks per page is not a multiple of the
  // block's 4 warps, warp pairs take a stage's pages in turn, and the kernel instance with one
  // full barrier per fill parity runs (two_full).
  const int pns = ps > 0 ? std::min(room / ps, max_stages) : 0;
  int st, ring;  // stage bytes; rings of stages (one per warp, or one per block)
  if (pns >= 3) {
    lp.page_stage = uint32_t(ps), st = ps, ring = 1, lp.stages = pns;
    lp.two_full = (pns * (kv.page_tokens / (2 * slab))) % dec_warps != 0;
    lp.whole = one_format && !lp.two_full && kv.page_tokens >= 4 * slab &&
               pns * (kv.page_tokens / (4 * slab)) > dec_warps;
  } else {
    lp.page_stage = 0, st = int(stage_bytes(D, lp.stage_cap)), ring = dec_warps;
    lp.stages = std::clamp(room / (ring * st), 2, max_stages);
  }
  lp.smem = int(staged_head_bytes<D>) + std::max(ring * lp.stages * st, int(sizeof(merge_area<D>)));
  lp.per_sm = std::min(staged_blocks, sm_bytes / (lp.smem + reserved));
}

static_assert(sizeof(attend_params) <= 32764, "kernel parameters of at most 32764 bytes (sm_70+, CUDA 12.1+)");

launch_plan plan_for(const attend_args& a) {
  launch_plan lp{};
  const int group = a.q_heads / a.kv.kv_heads;
  int max_q = 1;
  for (const auto& it : a.items) max_q = std::max(max_q, int(it.q_len));
  lp.decode = group * max_q <= 8;
  lp.rows = std::min(16, group * max_q);
  lp.unit = lp.decode ? slab : tile_tokens;
  lp.max_tiles = 1;
  int64_t total = 0;
  for (const auto& it : a.items) {
    const int units = ceil_div(it.from_pages, lp.unit) + ceil_div(it.n - it.from_pages, lp.unit);
    lp.max_tiles = std::max(lp.max_tiles, units);
    total += units;
  }
  if (lp.decode) {
    // Whole waves: the blocks resident at once are num_sms x (2 wide, 3 narrow: the launch
    // bounds). A split count s costs waves(s) x (slabs per block(s) + a block's fixed cost, about
    // 8 slabs: page lookups, query, warp merge, its share of the split merge) for the longest
    // item; a partial last wave is paid in full (ncu showed 2.1 waves costing up to a third of the
    // time), so take the s of least cost, the fewest splits on a tie. At least 4 slabs per warp,
    // at most max_cta_slabs per block (the page table cache).
    lp.wide = a.max_page_bits > 8;
    if (!lp.wide) {
      if (a.kv.head_dim == 128) plan_stages<128>(a.kv, a.max_page_bits, a.one_format_per_head, lp);
      else plan_stages<64>(a.kv, a.max_page_bits, a.one_format_per_head, lp);
    }
    const int64_t wave = int64_t(a.num_sms) * (lp.wide ? 2 : lp.per_sm);
    const int64_t base = int64_t(std::max<size_t>(1, a.items.size())) * a.kv.kv_heads;
    const int s_min = ceil_div(lp.max_tiles, max_cta_slabs);
    const int s_max = std::max(s_min, ceil_div(lp.max_tiles, 4 * dec_warps));
    int64_t best_cost = INT64_MAX;
    int best = s_min;
    for (int sp = s_min; sp <= s_max; ++sp) {
      const int64_t cost = ((base * sp + wave - 1) / wave) * (ceil_div(lp.max_tiles, sp) + 8);
      if (cost < best_cost) best_cost = cost, best = sp;
    }
    lp.mtiles = 1;
    const int quantum = dec_warps * (lp.page_stage ? 2 : 1);  // whole slabs (block-staged: 32-token chunks) per warp
    lp.tiles_per_split = ceil_div(ceil_div(lp.max_tiles, best), quantum) * quantum;
    lp.max_splits = ceil_div(lp.max_tiles, lp.tiles_per_split);
    (void)total;
    return lp;
  }
  lp.mtiles = ceil_div(group * max_q, 16);
  const int64_t base = int64_t(std::max<size_t>(1, a.items.size())) * a.kv.kv_heads * lp.mtiles;
  const int64_t want = int64_t(a.num_sms) * 4;
  int splits = int(std::clamp<int64_t>((want + base - 1) / base, 1, lp.max_tiles));
  splits = std::max(splits, ceil_div(lp.max_tiles, max_split_tiles));
  lp.tiles_per_split = ceil_div(lp.max_tiles, splits);
  lp.max_splits = ceil_div(lp.max_tiles, lp.tiles_per_split);
  return lp;
}

template <int D>
status launch_attend(const attend_params& p, const launch_plan& lp, int kv_heads, int items, cudaStream_t st) {
  const dim3 mgrid(unsigned(items), unsigned(kv_heads * lp.mtiles), unsigned(lp.rows));
  if (lp.decode) {
    const dim3 grid(unsigned(lp.max_splits), unsigned(kv_heads), unsigned(items));
    if (lp.wide) {
      decode_wide_kernel<D><<<grid, dec_warps * 32, 0, st>>>(p);
    } else {
      const auto kernel = !lp.page_stage ? decode_kernel<D>
                          : lp.two_full  ? decode_paged_kernel<D, true, false>
                          : lp.whole     ? decode_paged_kernel<D, false, true>
                                         : decode_paged_kernel<D, false, false>;
      KVQ_TRY(cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, lp.smem), "cudaFuncSetAttribute"));
      kernel<<<grid, dec_warps * 32, lp.smem, st>>>(p);
    }
  } else {
    const int smem = int(sizeof(attend_smem<D>));
    KVQ_TRY(cuda_status(cudaFuncSetAttribute(attend_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                        "cudaFuncSetAttribute"));
    attend_kernel<D><<<dim3(unsigned(lp.max_splits), unsigned(kv_heads * lp.mtiles), unsigned(items)), threads, smem, st>>>(p);
  }
  KVQ_TRY(cuda_status(cudaGetLastError(), "attention launch"));
  cudaLaunchConfig_t mc = {};
  mc.gridDim = mgrid;
  mc.blockDim = dim3(merge_threads);
  mc.stream = st;
  cudaLaunchAttribute pdl[1];
  pdl[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;  // `pdl_trigger` / `pdl_wait`
  pdl[0].val.programmaticStreamSerializationAllowed = 1;
  int dev = 0, major = 0;  // (sm_90+ only: elsewhere the merge is launched in plain stream order)
  KVQ_TRY(cuda_status(cudaGetDevice(&dev), "cudaGetDevice"));
  KVQ_TRY(cuda_status(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev),
                      "cudaDeviceGetAttribute"));
  mc.attrs = pdl;
  mc.numAttrs = major >= 9 ? 1 : 0;
  return cuda_status(cudaLaunchKernelEx(&mc, merge_kernel<D>, p), "merge launch");
}

}  // namespace

status attend_can_implement(const attend_args& a) {
  const auto& kv = a.kv;
  if (kv.head_dim != 64 && kv.head_dim != 128)
    return {errc::unsupported, msg("CUDA attention supports head_dim 64 and 128, not ", kv.head_dim)};
  if (kv.page_tokens % tile_tokens != 0 || (kv.page_tokens & (kv.page_tokens - 1)) != 0)
    return {errc::unsupported, msg("CUDA attention needs page_tokens a power of two and a multiple of 64, not ", kv.page_tokens)};
  if (kv.kv_heads <= 0 || kv.kv_heads > max_kv_heads || a.q_heads % kv.kv_heads != 0 || a.q_heads / kv.kv_heads > 16)
    return {errc::unsupported, msg("CUDA attention supports kv_heads <= ", max_kv_heads, " and a GQA group of at most 16; got ",
                                   a.q_heads, " query heads over ", kv.kv_heads, " kv heads")};
  if (a.items.empty()) return {errc::invalid_argument, "attend: empty batch"};
  for (const auto& it : a.items)
    if (it.q_len < 1 || it.q_len > it.n || it.from_pages < 0 || it.from_pages > it.n - it.q_len ||
        it.n - it.from_pages > kv.window)
      return {errc::invalid_argument, msg("attend: inconsistent item (slot ", it.slot, ", q_len ", it.q_len, ", n ", it.n,
                                          ", from_pages ", it.from_pages, ")")};
  return {};
}

result<attend_plan_info> attend_plan(const attend_args& a) {
  KVQ_TRY(attend_can_implement(a));
  const launch_plan lp = plan_for(a);
  attend_plan_info info;
  info.max_splits = lp.max_splits;
  info.tokens_per_split = lp.tiles_per_split * lp.unit;
  if (!lp.decode) return info;
  if (lp.wide) {
    info.kernel = attend_kernel::decode_wide;
    return info;
  }
  info.kernel = lp.page_stage ? attend_kernel::decode_block_staged : attend_kernel::decode_staged;
  info.stages = lp.stages;
  info.stage_bytes = lp.page_stage ? lp.page_stage : stage_bytes(a.kv.head_dim, lp.stage_cap);
  info.smem_bytes = lp.smem;
  info.blocks_per_sm = lp.per_sm;
  info.whole_units = lp.decode && !lp.wide && lp.page_stage && lp.whole;
  return info;
}

size_t attend_workspace_bytes(const attend_args& a) {
  const launch_plan lp = plan_for(a);
  const size_t batch = std::min<size_t>(a.items.size(), max_items);
  const size_t parts = batch * a.kv.kv_heads * lp.mtiles * lp.max_splits;
  return parts * 16 * (size_t(a.kv.head_dim) + 2) * sizeof(float);
}

status attend_run(const attend_args& a, void* workspace, size_t workspace_bytes, void* stream) {
  KVQ_TRY(attend_can_implement(a));
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  for (size_t first = 0; first < a.items.size(); first += max_items) {
    attend_args sub = a;
    sub.items = a.items.subspan(first, std::min<size_t>(max_items, a.items.size() - first));
    const launch_plan lp = plan_for(sub);
    const size_t need = attend_workspace_bytes(sub);
    if (workspace_bytes < need)
      return {errc::invalid_argument, msg("attend: workspace of ", workspace_bytes, " bytes, need ", need)};
    attend_params p{};
    p.kv = a.kv;
    p.layer = a.layer;
    p.q_heads = a.q_heads;
    p.group = a.q_heads / a.kv.kv_heads;
    p.mtiles = lp.mtiles;
    p.q = a.q;
    p.q_type = a.q_type;
    p.q_stride = a.q_stride ? a.q_stride : int64_t(a.q_heads) * a.kv.head_dim;
    p.o = a.o;
    p.o_type = a.o_type;
    p.o_stride = a.o_stride ? a.o_stride : int64_t(a.q_heads) * a.kv.head_dim;
    const float scale = a.scale > 0.f ? a.scale : 1.0f / std::sqrt(float(a.kv.head_dim));
    p.scale_log2 = scale * 1.4426950408889634f;
    p.tiles_per_split = lp.tiles_per_split;
    p.max_splits = lp.max_splits;
    const size_t parts = sub.items.size() * a.kv.kv_heads * lp.mtiles * lp.max_splits;
    p.ws_o = static_cast<float*>(workspace);
    p.ws_ml = p.ws_o + parts * 16 * a.kv.head_dim;
    p.q_stage = a.q_stage;
    p.n_items = int(sub.items.size());
    std::copy(sub.items.begin(), sub.items.end(), p.items);
    p.unit_tokens = lp.unit;
    p.stages = lp.stages;
    p.stage_cap = lp.stage_cap;
    p.page_stage = lp.page_stage;
    if (a.kv.head_dim == 128)
      KVQ_TRY(launch_attend<128>(p, lp, a.kv.kv_heads, int(sub.items.size()), st));
    else
      KVQ_TRY(launch_attend<64>(p, lp, a.kv.kv_heads, int(sub.items.size()), st));
  }
  return {};
}

// ---------------------------------------------------------------------------------------------
// append
// ---------------------------------------------------------------------------------------------
namespace {

struct append_params {
  paged_view kv;
  uint8_t* arena;  // writable aliases of kv's
  uint32_t* blocks;
  uint8_t* fmts;
  int layer;
  const void* src[2];
  dtype src_type[2];
  int64_t src_stride[2];
  int n_items, pages;
  struct item {
    int slot;
    int32_t n, e, m;
    uint32_t window_unit;
    int32_t src_row;  // the item's first row in src
    int first_page;   // page index of its first new page
    int page0;        // its first new page in page_blocks / page_fmts
  } items[max_append_items];
  uint32_t page_blocks[max_append_pages];
  uint8_t page_item[max_append_pages];
  uint8_t page_fmts[max_append_pages][max_kv_heads * 2];
  float clip[max_kv_heads * 2];
};
static_assert(max_append_items <= 256, "page_item is one byte");

__device__ __forceinline__ uint16_t src_half(const append_params& p, int r, int64_t row, int h, int c) {
  const int64_t i = row * p.src_stride[r] + int64_t(h) * p.kv.head_dim + c;
  switch (p.src_type[r]) {
    case dtype::f32: return float_to_half(static_cast<const float*>(p.src[r])[i]);
    case dtype::f16: return static_cast<const uint16_t*>(p.src[r])[i];
    default: return float_to_half(bf16_to_float(static_cast<const uint16_t*>(p.src[r])[i]));
  }
}

__device__ __forceinline__ uint16_t* ring_of(const append_params& p, const append_params::item& it, int h, int r) {
  return reinterpret_cast<uint16_t*>(p.arena + size_t(it.window_unit) * 256) +
         ((size_t(p.layer) * p.kv.kv_heads + h) * 2 + r) * size_t(p.kv.window) * p.kv.head_dim;
}

// One block per (new page of any item, kv head, role): stage the page's fp16 rows (old tokens
// from the item's ring, new ones from the input) in shared memory, then encode every unit with
// the shared codec.
__global__ void __launch_bounds__(threads) encode_kernel(const __grid_constant__ append_params p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  uint16_t* src = reinterpret_cast<uint16_t*>(smem_raw);
  const int pg = blockIdx.x, h = blockIdx.y, r = blockIdx.z, d = p.kv.head_dim, P = p.kv.page_tokens;
  const append_params::item& it = p.items[p.page_item[pg]];
  const uint16_t* ring = ring_of(p, it, h, r);
  const int first_tok = it.e + (pg - it.page0) * P;
  for (int idx = threadIdx.x; idx < P * d; idx += threads) {
    const int row = idx / d, c = idx % d, j = first_tok + row;
    src[idx] = j < it.n ? ring[size_t(j % p.kv.window) * d + c] : src_half(p, r, it.src_row + (j - it.n), h, c);
  }
  const uint8_t* fm = p.page_fmts[pg];
  uint32_t off = 0;
  for (int hh = 0; hh < h; ++hh) off += p.kv.k_page_bytes[fm[2 * hh]] + p.kv.v_page_bytes[fm[2 * hh + 1]];
  if (r == 1) off += p.kv.k_page_bytes[fm[2 * h]];
  const format_id f = fm[2 * h + r];
  const codec::page_geom g = codec::make_geom(f, r == 0 ? role::k : role::v, P, d);
  uint8_t* page = p.arena + size_t(p.page_blocks[pg]) * 256 + off;
  for (uint32_t i = threadIdx.x * 16; i < g.lay.total(); i += threads * 16) *reinterpret_cast<uint4*>(page + i) = make_uint4(0, 0, 0, 0);
  __syncthreads();
  const float clip = p.clip[2 * h + r];
  for (int u = threadIdx.x; u < g.unit_count(); u += threads) codec::encode_unit(g, src, d, u, page, clip);
  if (h == 0 && r == 0) {
    const size_t row = (size_t(it.slot) * p.kv.layers + p.layer) * p.kv.max_pages + it.first_page + (pg - it.page0);
    if (threadIdx.x == 0) p.blocks[row] = p.page_blocks[pg];
    for (int i = threadIdx.x; i < p.kv.kv_heads * 2; i += threads) p.fmts[row * p.kv.kv_heads * 2 + i] = fm[i];
  }
}

// The ring keeps the last `window` tokens: write each item's new tokens that remain among them
// (grid y: the item). A thread writes 8 channels of one (token, head, role) row with one 16-byte
// store; 32-bit index math (a row count times d fits easily).
__global__ void ring_kernel(const __grid_constant__ append_params p) {
  const append_params::item& it = p.items[blockIdx.y];
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

__global__ void check_kernel(const void* k, const void* v, dtype kt, dtype vt, int64_t tokens, int hd, int64_t ks,
                             int64_t vs, int* flag) {
  const int64_t total = tokens * hd;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = idx / hd, e = idx % hd;
    const float a = load_any(k, kt, t * ks + e), b = load_any(v, vt, t * vs + e);
    if (!(fabsf(a) <= fp16_max) || !(fabsf(b) <= fp16_max)) *flag = 1;
  }
}

}  // namespace

status append_run(const append_args& a, void* stream) {
  const auto& kv = a.kv;
  if (kv.kv_heads > max_kv_heads) return {errc::unsupported, msg("append: kv_heads ", kv.kv_heads, " above ", max_kv_heads)};
  if (a.items.size() > size_t(max_append_items))
    return {errc::invalid_argument, msg("append: ", a.items.size(), " sequences in one call, at most ", max_append_items)};
  int pages = 0, rows = 0, max_m = 0;
  for (const append_seq& it : a.items) pages += it.pages, rows += it.m, max_m = std::max(max_m, int(it.m));
  if (pages > max_append_pages)
    return {errc::invalid_argument, msg("append: ", pages, " new pages in one call, at most ", max_append_pages)};
  if (rows != a.k.tokens || rows != a.v.tokens)
    return {errc::invalid_argument, msg("append: the items append ", rows, " tokens, K has ", a.k.tokens, " and V ", a.v.tokens)};
  if (a.items.empty()) return {};
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  append_params p{};
  p.arena = a.arena;
  p.blocks = a.blocks;
  p.fmts = a.fmts;
  p.kv = kv;
  p.layer = a.layer;
  p.src[0] = a.k.data;
  p.src[1] = a.v.data;
  p.src_type[0] = a.k.type;
  p.src_type[1] = a.v.type;
  p.src_stride[0] = a.k.stride();
  p.src_stride[1] = a.v.stride();
  p.n_items = int(a.items.size());
  p.pages = pages;
  int row = 0, page = 0;
  for (size_t i = 0; i < a.items.size(); ++i) {
    const append_seq& it = a.items[i];
    p.items[i] = {it.slot, it.n, it.e, it.m, it.window_unit, row, it.first_page, page};
    for (int k = 0; k < it.pages; ++k) p.page_item[page + k] = uint8_t(i);
    row += it.m;
    page += it.pages;
  }
  for (int i = 0; i < pages; ++i) {
    p.page_blocks[i] = a.page_blocks[i];
    for (int j = 0; j < kv.kv_heads * 2; ++j) p.page_fmts[i][j] = a.page_fmts[i * kv.kv_heads * 2 + j];
  }
  for (int j = 0; j < kv.kv_heads * 2; ++j) p.clip[j] = a.clip ? a.clip[j] : 1.0f;
  if (pages > 0) {  // before the ring kernel: pages read ring slots that the new tokens overwrite
    const int smem = kv.page_tokens * kv.head_dim * 2;
    KVQ_TRY(cuda_status(cudaFuncSetAttribute(encode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                        "cudaFuncSetAttribute"));
    encode_kernel<<<dim3(unsigned(pages), unsigned(kv.kv_heads), 2), threads, smem, st>>>(p);
  }
  const int64_t ring_chunks = int64_t(std::min(max_m, kv.window)) * kv.kv_heads * 2 * (kv.head_dim / 8);
  const int blocks = int(std::min<int64_t>(1024, (ring_chunks + 255) / 256));
  ring_kernel<<<dim3(unsigned(std::max(1, blocks)), unsigned(a.items.size())), 256, 0, st>>>(p);
  return cuda_status(cudaGetLastError(), "append launch");
}

status check_values(const tensor_view& k, const tensor_view& v, int* flag, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  KVQ_TRY(cuda_status(cudaMemsetAsync(flag, 0, sizeof(int), st), "cudaMemsetAsync"));
  const int64_t total = k.tokens * k.heads * k.head_dim;
  const int blocks = int(std::min<int64_t>(1024, (total + 255) / 256));
  check_kernel<<<std::max(1, blocks), 256, 0, st>>>(k.data, v.data, k.type, v.type, k.tokens, k.heads * k.head_dim,
                                                    k.stride(), v.stride(), flag);
  return cuda_status(cudaGetLastError(), "check launch");
}

}  // namespace cuda
KVQ_NAMESPACE_END
