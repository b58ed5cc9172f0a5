// CUDA kernels of kvq: quantize-on-append (through the shared codec, so bytes equal the CPU's)
// and fused mixed-format paged decode/extend attention on tensor cores.
//
// Attention design (DESIGN.md section 5):
// - Grid: (split, kv head x 16-row query tile, sequence). A thread block serves every query head
//   of one GQA group (rows = group x q_len, 16 per MMA tile) with one read of K and V, over a
//   contiguous range of 64-token tiles of the sequence (flash-decoding split); a second kernel
//   merges the splits by log-sum-exp.
// - Per tile the 4 warps dequantize the page's K and V into shared memory as fp16 (one
//   warp-uniform branch per page format, 16-byte loads, codes turned into halves by
//   byte-permute / magic-number bit tricks, no per-element int->float conversions). KIVI keys keep
//   their raw codes: the per-channel scale is folded into the query (q' = q * s per token group)
//   and the zero point into one dot product per row (q . z), so key dequantization is one
//   subtraction per two elements.
// - Each warp owns 16 tokens of the tile: S = Q K^T and O += P V with mma.sync m16n8k16
//   (fp16 operands, fp32 accumulation), online softmax in fp32 registers.
#include <kvq/codec/codec.hpp>
#include <kvq/cuda/paged_attention.hpp>

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <sstream>

#include <algorithm>
#include <cmath>

KVQ_NAMESPACE_BEGIN
namespace cuda {
namespace {

constexpr int tile_tokens = 64;
constexpr int threads = 128;
constexpr int max_items = 256;
constexpr int max_kv_heads = 32;

// NOTE: fmt's compile-time format checks do not survive nvcc's host pass; messages here are
// built with a stream.
template <class... A>
std::string msg(const A&... a) {
  std::ostringstream os;
  (os << ... << a);
  return os.str();
}

status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  return {errc::cuda_error, msg(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")")};
}

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
// Group sizes, head_dim and page_tokens are powers of two: divisions become shifts (a runtime
// integer division costs dozens of instructions in the per-tile path).
__device__ __forceinline__ int log2i(int x) { return 31 - __clz(x); }

// ---------------------------------------------------------------------------------------------
// attention
// ---------------------------------------------------------------------------------------------

struct attend_params {
  const uint8_t* arena;
  const uint32_t* blocks;
  const uint8_t* fmts;
  int layers, kv_heads, page_tokens, window, max_pages;
  uint32_t k_bytes[format_count];
  uint32_t v_bytes[format_count];
  int layer, q_heads, group, mtiles;
  const void* q;
  int64_t q_stride;
  void* o;
  int64_t o_stride;
  dtype q_type, o_type;
  float scale_log2;
  int tiles_per_split, max_splits;
  int unit_tokens;  // tokens of a work unit: 64 (tile kernel) or 16 (decode kernel slabs)
  float* ws_o;   // [partials][16][D]
  float* ws_ml;  // [partials][16][2]
  int n_items;
  decode_item items[max_items];
};

__device__ __forceinline__ float load_any(const void* base, dtype t, int64_t i) {
  switch (t) {
    case dtype::f32: return static_cast<const float*>(base)[i];
    case dtype::f16: return __half2float(static_cast<const __half*>(base)[i]);
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  }
}

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
  return p.arena + size_t(item.window_unit) * 256 + ((size_t(p.layer) * p.kv_heads + h) * 2) * size_t(p.window) * D * 2;
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
    const int page = (t * tile_tokens) >> log2i(p.page_tokens);
    const size_t table_row = (size_t(item.slot) * p.layers + p.layer) * p.max_pages + page;
    const uint8_t* fm = p.fmts + table_row * p.kv_heads * 2;
    uint32_t off = 0;
    for (int hh = 0; hh < h; ++hh) off += p.k_bytes[fm[2 * hh]] + p.v_bytes[fm[2 * hh + 1]];
    tt.page16[t - t0] = uint32_t((size_t(p.blocks[table_row]) * 256 + off) / 16);
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
    s.row0 = s.tok0 & (p.page_tokens - 1);
    s.fk = tt.fk[t - t0];
    s.fv = tt.fv[t - t0];
    s.page[0] = p.arena + size_t(tt.page16[t - t0]) * 16;
    s.page[1] = s.page[0] + p.k_bytes[s.fk];
    role_ranges<D>(s.fk, role::k, p.page_tokens, s.row0, tile_tokens, s.size[0], s.from[0]);
    role_ranges<D>(s.fv, role::v, p.page_tokens, s.row0, tile_tokens, s.size[1], s.from[1]);
  } else {
    s.ring = true;
    s.tok0 = item.from_pages + (t - page_tiles) * tile_tokens;
    s.valid = min(tile_tokens, item.n - s.tok0);
    s.row0 = 0;
    s.fk = s.fv = fp16_format;
    s.page[0] = ring_base<D>(p, item, h);
    s.page[1] = s.page[0] + size_t(p.window) * D * 2;
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
      issue_tile<D>(s, raw_base + head % ring_bytes, p.window, lane);
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
  const size_t part = ((size_t(blockIdx.z) * p.kv_heads + h) * p.mtiles + mt) * p.max_splits + split;
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
// tile; with 8 warps per SM that left the SMs issue-bound at a fraction of the bandwidth
// (docs/results/decode_h200.md). For decode the query side is tiny (at most 8 columns: GQA heads
// x q_len), so this kernel swaps the MMA operands (S^T = K Q^T with tokens as M, queries as N) and
// lets each warp stream its own 16-token slabs through a private cp.async ring, with no barrier
// in the main loop:
// - lane (g, t) owns the K channels [(D/4) t, (D/4)(t+1)) of rows g and g+8 and turns their codes
//   straight into MMA A fragments (a per-lane channel permutation, applied to Q as well);
// - lane g owns the V channels [(D/8) g, (D/8)(g+1)) of tokens 2t, 2t+1, 2t+8, 2t+9, so the
//   A fragments of O^T = V^T P^T come from pairing two tokens' halves with one byte-permute;
// - P^T comes from the S^T accumulators by movmatrix (register transpose);
// - per-token scales (fp8 K) scale S rows, per-token V scales (fp8) scale P, KIVI key scales
//   fold into the query (q' = q s per token group) and their zeros into one dot product.
constexpr int slab = 16;
constexpr int dec_warps = 4;
constexpr int max_cta_slabs = 1024;
constexpr int slab_queue = 8;  // slabs in flight per warp at most (cp.async groups)

template <int D>
constexpr uint32_t warp_ring_bytes = D == 128 ? 24 * 1024 : 12 * 1024;

struct slab_src {
  int tok0, valid, row0;
  bool ring;
  format_id fk, fv;
  uint32_t at;       // offset of the slab's bytes in the warp's ring
  uint32_t size[2][3];
  uint32_t from[2][3];
  const uint8_t* page[2];
};

struct page_table_cache {
  int first_page;
  uint32_t page16[max_cta_slabs * slab / 64 + 2];
  format_id fk[max_cta_slabs * slab / 64 + 2];
  format_id fv[max_cta_slabs * slab / 64 + 2];
};

template <int D>
struct decode_smem {
  uint8_t ring[dec_warps][warp_ring_bytes<D>];
  slab_src slot[dec_warps][slab_queue];
  page_table_cache pages;
};

template <int D>
__device__ __forceinline__ slab_src describe_slab(const attend_params& p, const decode_item& item, int h, int j,
                                                  const page_table_cache& pc) {
  slab_src s{};
  const int page_slabs = ceil_div(item.from_pages, slab);
  if (j < page_slabs) {
    s.ring = false;
    s.tok0 = j * slab;
    s.valid = min(slab, item.from_pages - s.tok0);
    s.row0 = s.tok0 & (p.page_tokens - 1);
    const int e = (s.tok0 >> log2i(p.page_tokens)) - pc.first_page;
    s.fk = pc.fk[e];
    s.fv = pc.fv[e];
    s.page[0] = p.arena + size_t(pc.page16[e]) * 16;
    s.page[1] = s.page[0] + p.k_bytes[s.fk];
    role_ranges<D>(s.fk, role::k, p.page_tokens, s.row0, slab, s.size[0], s.from[0]);
    role_ranges<D>(s.fv, role::v, p.page_tokens, s.row0, slab, s.size[1], s.from[1]);
  } else {
    s.ring = true;
    s.tok0 = item.from_pages + (j - page_slabs) * slab;
    s.valid = min(slab, item.n - s.tok0);
    s.row0 = 0;
    s.fk = s.fv = fp16_format;
    s.page[0] = ring_base<D>(p, item, h);
    s.page[1] = s.page[0] + size_t(p.window) * D * 2;
    for (int r = 0; r < 2; ++r) {
      s.size[r][0] = slab * D * 2;
      s.size[r][1] = s.size[r][2] = 0;
    }
  }
  return s;
}

__device__ __forceinline__ uint32_t slab_bytes(const slab_src& s) {
  return s.size[0][0] + s.size[0][1] + s.size[0][2] + s.size[1][0] + s.size[1][1] + s.size[1][2];
}

template <int D>
__device__ __forceinline__ void issue_slab(const slab_src& s, uint32_t dst, int window, int lane) {
  if (s.ring) {
    constexpr int cpr = D * 2 / 16;
    for (int c = lane; c < 2 * slab * cpr; c += 32) {
      const int r = c / (slab * cpr), rem = c % (slab * cpr), row = rem / cpr, ch = rem % cpr;
      if (row < s.valid) cp_async16(dst + uint32_t(c) * 16, s.page[r] + size_t((s.tok0 + row) % window) * D * 2 + ch * 16);
    }
  } else {
    uint32_t at = dst;
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        const uint8_t* src = s.page[r] + s.from[r][k];
        for (uint32_t c = lane; c < s.size[r][k] / 16; c += 32) cp_async16(at + c * 16, src + c * 16);
        at += s.size[r][k];
      }
  }
  cp_commit();
}

// Codes of `Pairs` channel pairs (in channel order) -> half2 words holding 1024 + code (integer
// families) or the values (fp16; bf16 and fp8 converted).
template <int Bits, int Pairs>
__device__ __forceinline__ void to_pairs(const uint32_t* w, format_traits f, uint32_t (&out)[Pairs]) {
  if constexpr (Bits == 16) {
#pragma unroll
    for (int i = 0; i < Pairs; ++i)
      out[i] = f.fam == family::fp16
                   ? w[i]
                   : h2_bits(__floats2half2_rn(__uint_as_float(w[i] << 16), __uint_as_float(w[i] & 0xffff0000u)));
  } else if constexpr (Bits == 8) {
    if (f.fam == family::fp8_e4m3) {
#pragma unroll
      for (int i = 0; i < Pairs; ++i) {
        const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t((w[i / 2] >> (16 * (i % 2))) & 0xffffu), __NV_E4M3);
        out[i] = uint32_t(hr.x) | (uint32_t(hr.y) << 16);
      }
    } else {
#pragma unroll
      for (int i = 0; i < Pairs; ++i) out[i] = __byte_perm(w[i / 2], 0x64646464u, (i % 2) ? 0x7342 : 0x5140);
    }
  } else if constexpr (Bits == 4) {
#pragma unroll
    for (int i = 0; i < Pairs / 4; ++i) {
      const uint32_t ev = w[i] & 0x0F0F0F0Fu, od = (w[i] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
      for (int k = 0; k < 4; ++k)
        out[4 * i + k] = (__byte_perm(ev, od, k | (k << 4) | ((4 + k) << 8) | ((4 + k) << 12)) & 0x00FF00FFu) | 0x64006400u;
    }
  } else {
#pragma unroll
    for (int b = 0; b < Pairs / 2; ++b) {  // byte b holds channels 4b .. 4b+3
      const int i = b / 4, k = b % 4;
      const uint32_t c0 = w[i] & 0x03030303u, c1 = (w[i] >> 2) & 0x03030303u, c2 = (w[i] >> 4) & 0x03030303u,
                     c3 = (w[i] >> 6) & 0x03030303u;
      const uint32_t sel = k | (k << 4) | ((4 + k) << 8) | ((4 + k) << 12);
      out[2 * b] = (__byte_perm(c0, c1, sel) & 0x00FF00FFu) | 0x64006400u;
      out[2 * b + 1] = (__byte_perm(c2, c3, sel) & 0x00FF00FFu) | 0x64006400u;
    }
  }
}

// Reads `Bytes` bytes of shared memory (a multiple of 4, 16-byte or smaller-aligned as it comes).
template <int Bytes>
__device__ __forceinline__ void lds_words(const uint8_t* src, uint32_t* w) {
  if constexpr (Bytes % 16 == 0) {
#pragma unroll
    for (int i = 0; i < Bytes / 16; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(src)[i];
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else if constexpr (Bytes == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    w[0] = v.x, w[1] = v.y;
  } else if constexpr (Bytes == 4) {
    w[0] = *reinterpret_cast<const uint32_t*>(src);
  } else {
    w[0] = *reinterpret_cast<const uint16_t*>(src);
  }
}

// K rows g and g+8 of a slab -> this lane's A fragments, pairs in channel order over the lane's
// D/4 channels. KIVI keys: centered codes. sym: values (scale of the lane's channel group).
template <int D, int Bits>
__device__ __forceinline__ void k_fragments(const uint8_t* raw, const uint8_t* par1, format_traits f, int g, int t,
                                            uint32_t (&kg)[D / 8], uint32_t (&kg8)[D / 8]) {
  constexpr int lane_bytes = (D / 4) * Bits / 8, row_bytes = D * Bits / 8;
  uint32_t w[lane_bytes / 4];
  lds_words<lane_bytes>(raw + g * row_bytes + t * lane_bytes, w);
  to_pairs<Bits, D / 8>(w, f, kg);
  lds_words<lane_bytes>(raw + (g + 8) * row_bytes + t * lane_bytes, w);
  to_pairs<Bits, D / 8>(w, f, kg8);
  if constexpr (Bits != 16) {
    if (f.fam == family::fp8_e4m3) return;  // its per-token scale multiplies the scores
    const __half2 bias = __float2half2_rn(1024.f + float(1 << (Bits - 1)));
    if (f.fam == family::sym) {
      const int g_sz = f.group == 0 ? D : f.group, ng = D >> log2i(g_sz), grp = (t * (D / 4)) >> log2i(g_sz);
      const __half2 s0 = __half2half2(reinterpret_cast<const __half*>(par1)[g * ng + grp]);
      const __half2 s8 = __half2half2(reinterpret_cast<const __half*>(par1)[(g + 8) * ng + grp]);
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        kg[i] = h2_bits(__hmul2(__hsub2(bits_h2(kg[i]), bias), s0));
        kg8[i] = h2_bits(__hmul2(__hsub2(bits_h2(kg8[i]), bias), s8));
      }
    } else {
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        kg[i] = h2_bits(__hsub2(bits_h2(kg[i]), bias));
        kg8[i] = h2_bits(__hsub2(bits_h2(kg8[i]), bias));
      }
    }
  }
}

// V of tokens a and b (rows of the slab) over this lane's D/8 channels -> dequantized half2 pairs
// (channel order) of each token.
template <int D, int Bits>
__device__ __forceinline__ void v_pairs(const uint8_t* raw, const uint8_t* par1, const uint8_t* par2, format_traits f,
                                        int row, int g, uint32_t (&out)[D / 16]) {
  constexpr int lane_bytes = (D / 8) * Bits / 8, row_bytes = D * Bits / 8;
  uint32_t w[lane_bytes >= 4 ? lane_bytes / 4 : 1];
  lds_words<lane_bytes>(raw + row * row_bytes + g * lane_bytes, w);
  to_pairs<Bits, D / 16>(w, f, out);
  if constexpr (Bits != 16) {
    if (f.fam == family::fp8_e4m3) return;  // its per-token scale multiplies P
    const int g_sz = f.group == 0 ? D : f.group, ng = D >> log2i(g_sz), gi = row * ng + ((g * (D / 8)) >> log2i(g_sz));
    const __half2 s = __half2half2(reinterpret_cast<const __half*>(par1)[gi]);
    if (f.fam == family::sym) {
      const __half2 bias = __float2half2_rn(1024.f + float(1 << (Bits - 1)));
#pragma unroll
      for (int i = 0; i < D / 16; ++i) out[i] = h2_bits(__hmul2(__hsub2(bits_h2(out[i]), bias), s));
    } else {
      const __half2 bias = __float2half2_rn(1024.f);
      const __half2 z = __half2half2(reinterpret_cast<const __half*>(par2)[gi]);
#pragma unroll
      for (int i = 0; i < D / 16; ++i) out[i] = h2_bits(__hfma2(__hsub2(bits_h2(out[i]), bias), s, z));
    }
  }
}

__device__ __forceinline__ uint32_t movmatrix_t(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

template <int D>
__global__ void __launch_bounds__(dec_warps * 32, 2) decode_kernel(const __grid_constant__ attend_params p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  decode_smem<D>& sm = *reinterpret_cast<decode_smem<D>*>(smem_raw);
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const decode_item item = p.items[blockIdx.z];
  const int cols_used = p.group * item.q_len;  // <= 8
  const int S = ceil_div(item.from_pages, slab) + ceil_div(item.n - item.from_pages, slab);
  const int c0 = blockIdx.x * p.tiles_per_split, c1 = min(S, c0 + p.tiles_per_split);
  if (c0 >= S) return;

  // page lookups of the block's slabs, once
  {
    const int page_slabs = ceil_div(item.from_pages, slab);
    const int lg = log2i(p.page_tokens);
    const int first = (c0 * slab) >> lg;
    const int last_slab = min(c1, page_slabs) - 1;
    const int npages = last_slab >= c0 ? ((last_slab * slab) >> lg) - first + 1 : 0;
    if (threadIdx.x == 0) sm.pages.first_page = first;
    for (int e = threadIdx.x; e < npages; e += dec_warps * 32) {
      const size_t row = (size_t(item.slot) * p.layers + p.layer) * p.max_pages + first + e;
      const uint8_t* fm = p.fmts + row * p.kv_heads * 2;
      uint32_t off = 0;
      for (int hh = 0; hh < h; ++hh) off += p.k_bytes[fm[2 * hh]] + p.v_bytes[fm[2 * hh + 1]];
      sm.pages.page16[e] = uint32_t((size_t(p.blocks[row]) * 256 + off) / 16);
      sm.pages.fk[e] = fm[2 * h];
      sm.pages.fv[e] = fm[2 * h + 1];
    }
    __syncthreads();
  }

  // this warp's slabs
  const int per_warp = ceil_div(c1 - c0, dec_warps);
  const int s0 = c0 + warp * per_warp, s1 = min(c1, s0 + per_warp);

  // query columns: col n -> query i = n / group, head h*group + n % group; lane holds column g
  float q[D / 4];
  {
    const bool live = g < cols_used;
    const int i = g / p.group, qh = h * p.group + g % p.group;
    const int64_t base = int64_t(item.q_row + i) * p.q_stride + int64_t(qh) * D + t * (D / 4);
#pragma unroll
    for (int c = 0; c < D / 4; ++c) q[c] = live ? load_any(p.q, p.q_type, base + c) : 0.f;
  }
  uint32_t qb[D / 8];  // B fragments: pairs of the lane's channels
  auto plain_query = [&] {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) qb[i] = h2_bits(__floats2half2_rn(q[2 * i], q[2 * i + 1]));
  };
  plain_query();
  const uint8_t* q_scales_of = nullptr;  // the KIVI group whose scales qb holds (nullptr: plain)
  float cz_col[2] = {0.f, 0.f};
  const int q_first = item.n - item.q_len;
  const int last_visible[2] = {q_first + (2 * t) / p.group, q_first + (2 * t + 1) / p.group};

  float m_col[2] = {-INFINITY, -INFINITY}, l_col[2] = {0.f, 0.f};
  float acc[D / 16][4];
#pragma unroll
  for (int i = 0; i < D / 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  // private copy pipeline
  constexpr uint32_t ring_bytes = warp_ring_bytes<D>;
  const uint32_t ring_base = smem_addr(sm.ring[warp]);
  int issued = s0;
  uint32_t head = 0, tail = 0, ends[slab_queue];
  auto pump = [&](int consumed_upto) {
    while (issued < s1 && issued - consumed_upto < slab_queue) {
      slab_src s = describe_slab<D>(p, item, h, issued, sm.pages);
      const uint32_t need = slab_bytes(s), off = head % ring_bytes;
      const uint32_t pad = off + need > ring_bytes ? ring_bytes - off : 0;
      if (head + pad + need - tail > ring_bytes) break;
      head += pad;
      s.at = head % ring_bytes;
      if (lane == 0) sm.slot[warp][issued % slab_queue] = s;
      issue_slab<D>(s, ring_base + s.at, p.window, lane);
      head += need;
      ends[issued % slab_queue] = head;
      ++issued;
    }
  };
  pump(s0);
  __syncwarp();

  for (int j = s0; j < s1; ++j) {
    cp_wait_dyn(issued - j - 1);
    __syncwarp();
    const slab_src s = sm.slot[warp][j % slab_queue];
    const uint8_t* raw = sm.ring[warp] + s.at;
    const uint8_t* kp1 = raw + s.size[0][0];
    const uint8_t* kp2 = kp1 + s.size[0][1];
    const uint8_t* vraw = kp2 + s.size[0][2];
    const uint8_t* vp1 = vraw + s.size[1][0];
    const uint8_t* vp2 = vp1 + s.size[1][1];
    const format_traits fk = traits_of(s.fk), fv = traits_of(s.fv);

    // ---- K fragments; the query for this slab's format ----
    uint32_t kg[D / 8], kg8[D / 8];
    switch (fk.bits) {
      case 16: k_fragments<D, 16>(raw, kp1, fk, g, t, kg, kg8); break;
      case 8: k_fragments<D, 8>(raw, kp1, fk, g, t, kg, kg8); break;
      case 4: k_fragments<D, 4>(raw, kp1, fk, g, t, kg, kg8); break;
      default: k_fragments<D, 2>(raw, kp1, fk, g, t, kg, kg8); break;
    }
    const bool k_codes = !s.ring && fk.k_along_tokens();
    const uint8_t* group_key = k_codes ? s.page[0] + s.from[0][1] : nullptr;
    if (group_key != q_scales_of) {
      if (!k_codes) {
        plain_query();
        cz_col[0] = cz_col[1] = 0.f;
      } else {
        const __half* sc = reinterpret_cast<const __half*>(kp1) + t * (D / 4);
        const __half* zr = reinterpret_cast<const __half*>(kp2) + t * (D / 4);
        const float mid = float(1 << (fk.bits - 1));
        float cz = 0.f;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
          const float2 s2 = __half22float2(*reinterpret_cast<const __half2*>(sc + 2 * i));
          const float2 z2 = __half22float2(*reinterpret_cast<const __half2*>(zr + 2 * i));
          qb[i] = h2_bits(__floats2half2_rn(q[2 * i] * s2.x, q[2 * i + 1] * s2.y));
          cz += q[2 * i] * fmaf(s2.x, mid, z2.x) + q[2 * i + 1] * fmaf(s2.y, mid, z2.y);
        }
        cz += __shfl_xor_sync(0xffffffffu, cz, 1);
        cz += __shfl_xor_sync(0xffffffffu, cz, 2);  // all lanes of group g: q_g . z'
        cz_col[0] = __shfl_sync(0xffffffffu, cz, (2 * t) * 4);
        cz_col[1] = __shfl_sync(0xffffffffu, cz, (2 * t + 1) * 4);
      }
      q_scales_of = group_key;
    }

    // ---- S^T = K Q^T: rows tokens g / g+8, columns 2t, 2t+1 ----
    float sc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      mma16816(sc, kg[2 * ks], kg8[2 * ks], kg[2 * ks + 1], kg8[2 * ks + 1], qb[2 * ks], qb[2 * ks + 1]);
    float rs[2] = {1.f, 1.f};  // fp8 keys: per-token scales of rows g, g+8
    if (!s.ring && fk.fam == family::fp8_e4m3) {
      rs[0] = g < s.valid ? reinterpret_cast<const float*>(kp1)[g] : 0.f;
      rs[1] = g + 8 < s.valid ? reinterpret_cast<const float*>(kp1)[g + 8] : 0.f;
    }
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = g + (e / 2) * 8, jt = s.tok0 + row;
      const float x = (sc[e] * rs[e / 2] + cz_col[e % 2]) * p.scale_log2;
      const bool ok = row < s.valid && jt <= last_visible[e % 2];
      sc[e] = ok ? x : -INFINITY;
      tile_max[e % 2] = fmaxf(tile_max[e % 2], sc[e]);
    }
    float alpha[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      tile_max[c] = fmaxf(tile_max[c], __shfl_xor_sync(0xffffffffu, tile_max[c], 4));
      tile_max[c] = fmaxf(tile_max[c], __shfl_xor_sync(0xffffffffu, tile_max[c], 8));
      tile_max[c] = fmaxf(tile_max[c], __shfl_xor_sync(0xffffffffu, tile_max[c], 16));
      const float m_new = fmaxf(m_col[c], tile_max[c]);
      alpha[c] = m_new == -INFINITY ? 1.f : exp2f(m_col[c] - m_new);
      m_col[c] = m_new;
    }
    float pv[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) pv[e] = m_col[e % 2] == -INFINITY ? 0.f : exp2f(sc[e] - m_col[e % 2]);
    l_col[0] = l_col[0] * alpha[0] + pv[0] + pv[2];
    l_col[1] = l_col[1] * alpha[1] + pv[1] + pv[3];
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int i = 0; i < D / 16; ++i) {
        acc[i][0] *= alpha[0];
        acc[i][1] *= alpha[1];
        acc[i][2] *= alpha[0];
        acc[i][3] *= alpha[1];
      }
    }
    if (!s.ring && fv.fam == family::fp8_e4m3) {  // per-token V scales fold into P
      // rows at or beyond `valid` hold stale bytes: their scale must not turn P = 0 into NaN
      const float v0 = g < s.valid ? reinterpret_cast<const float*>(vp1)[g] : 0.f;
      const float v8 = g + 8 < s.valid ? reinterpret_cast<const float*>(vp1)[g + 8] : 0.f;
      pv[0] *= v0, pv[1] *= v0, pv[2] *= v8, pv[3] *= v8;
    }
    const uint32_t pb0 = movmatrix_t(h2_bits(__floats2half2_rn(pv[0], pv[1])));
    const uint32_t pb1 = movmatrix_t(h2_bits(__floats2half2_rn(pv[2], pv[3])));

    // ---- O^T += V^T P^T: A fragments pair tokens (2t, 2t+1) and (2t+8, 2t+9) per channel ----
    uint32_t va[D / 16], vb[D / 16], vc[D / 16], vd[D / 16];
    switch (fv.bits) {
      case 16:
        v_pairs<D, 16>(vraw, vp1, vp2, fv, 2 * t, g, va), v_pairs<D, 16>(vraw, vp1, vp2, fv, 2 * t + 1, g, vb);
        v_pairs<D, 16>(vraw, vp1, vp2, fv, 2 * t + 8, g, vc), v_pairs<D, 16>(vraw, vp1, vp2, fv, 2 * t + 9, g, vd);
        break;
      case 8:
        v_pairs<D, 8>(vraw, vp1, vp2, fv, 2 * t, g, va), v_pairs<D, 8>(vraw, vp1, vp2, fv, 2 * t + 1, g, vb);
        v_pairs<D, 8>(vraw, vp1, vp2, fv, 2 * t + 8, g, vc), v_pairs<D, 8>(vraw, vp1, vp2, fv, 2 * t + 9, g, vd);
        break;
      case 4:
        v_pairs<D, 4>(vraw, vp1, vp2, fv, 2 * t, g, va), v_pairs<D, 4>(vraw, vp1, vp2, fv, 2 * t + 1, g, vb);
        v_pairs<D, 4>(vraw, vp1, vp2, fv, 2 * t + 8, g, vc), v_pairs<D, 4>(vraw, vp1, vp2, fv, 2 * t + 9, g, vd);
        break;
      default:
        v_pairs<D, 2>(vraw, vp1, vp2, fv, 2 * t, g, va), v_pairs<D, 2>(vraw, vp1, vp2, fv, 2 * t + 1, g, vb);
        v_pairs<D, 2>(vraw, vp1, vp2, fv, 2 * t + 8, g, vc), v_pairs<D, 2>(vraw, vp1, vp2, fv, 2 * t + 9, g, vd);
        break;
    }
    // rows of the slab at or beyond `valid` hold stale bytes: zero them (P is 0 there, but 0 x NaN is not)
    if (s.valid < slab) {
      const uint32_t za = 2 * t < s.valid, zb = 2 * t + 1 < s.valid, zc = 2 * t + 8 < s.valid, zd = 2 * t + 9 < s.valid;
#pragma unroll
      for (int i = 0; i < D / 16; ++i) {
        va[i] = za ? va[i] : 0u, vb[i] = zb ? vb[i] : 0u, vc[i] = zc ? vc[i] : 0u, vd[i] = zd ? vd[i] : 0u;
      }
    }
#pragma unroll
    for (int mtile = 0; mtile < D / 16; ++mtile)
      mma16816(acc[mtile], __byte_perm(va[mtile], vb[mtile], 0x5410), __byte_perm(va[mtile], vb[mtile], 0x7632),
               __byte_perm(vc[mtile], vd[mtile], 0x5410), __byte_perm(vc[mtile], vd[mtile], 0x7632), pb0, pb1);

    __syncwarp();  // every lane is done with this slab's bytes
    tail = ends[j % slab_queue];
    pump(j + 1);
  }

  // ---- merge the warps (over the ring memory), write the block's partial ----
  float l_tot[2] = {l_col[0], l_col[1]};
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    l_tot[c] += __shfl_xor_sync(0xffffffffu, l_tot[c], 4);
    l_tot[c] += __shfl_xor_sync(0xffffffffu, l_tot[c], 8);
    l_tot[c] += __shfl_xor_sync(0xffffffffu, l_tot[c], 16);
  }
  __syncthreads();
  float* wo = reinterpret_cast<float*>(sm.ring);  // [warps][8 cols][D]
  float* wml = wo + dec_warps * 8 * D;           // [warps][8][2]
  static_assert(sizeof(float) * (dec_warps * 8 * D + dec_warps * 16) <= sizeof(sm.ring), "merge area fits");
  const bool has_work = s0 < s1;
#pragma unroll
  for (int i = 0; i < D / 16; ++i) {
    const int ch = (D / 8) * g + 2 * i;
    wo[(warp * 8 + 2 * t) * D + ch] = has_work ? acc[i][0] : 0.f;
    wo[(warp * 8 + 2 * t + 1) * D + ch] = has_work ? acc[i][1] : 0.f;
    wo[(warp * 8 + 2 * t) * D + ch + 1] = has_work ? acc[i][2] : 0.f;
    wo[(warp * 8 + 2 * t + 1) * D + ch + 1] = has_work ? acc[i][3] : 0.f;
  }
  if (g == 0)
    for (int c = 0; c < 2; ++c) {
      wml[(warp * 8 + 2 * t + c) * 2] = has_work ? m_col[c] : -INFINITY;
      wml[(warp * 8 + 2 * t + c) * 2 + 1] = has_work ? l_tot[c] : 0.f;
    }
  __syncthreads();
  const size_t part = (size_t(blockIdx.z) * p.kv_heads + h) * p.max_splits + blockIdx.x;
  for (int idx = threadIdx.x; idx < 8 * D; idx += dec_warps * 32) {
    const int r = idx / D, c = idx % D;
    float m = -INFINITY;
    for (int w = 0; w < dec_warps; ++w) m = fmaxf(m, wml[(w * 8 + r) * 2]);
    float o = 0.f, l = 0.f;
    for (int w = 0; w < dec_warps; ++w) {
      const float mw = wml[(w * 8 + r) * 2];
      const float f = mw == -INFINITY ? 0.f : exp2f(mw - m);
      o += f * wo[(w * 8 + r) * D + c];
      l += f * wml[(w * 8 + r) * 2 + 1];
    }
    p.ws_o[part * 16 * D + r * D + c] = o;
    if (c == 0) {
      p.ws_ml[(part * 16 + r) * 2] = m;
      p.ws_ml[(part * 16 + r) * 2 + 1] = l;
    }
  }
}

template <int D>
__global__ void __launch_bounds__(threads) merge_kernel(const __grid_constant__ attend_params p) {
  const int h = blockIdx.y / p.mtiles, mt = blockIdx.y % p.mtiles;
  const decode_item item = p.items[blockIdx.x];
  const int rows_used = p.group * item.q_len;
  if (mt * 16 >= rows_used) return;
  const int T = ceil_div(item.from_pages, p.unit_tokens) + ceil_div(item.n - item.from_pages, p.unit_tokens);
  const int splits = ceil_div(T, p.tiles_per_split);
  const size_t part0 = ((size_t(blockIdx.x) * p.kv_heads + h) * p.mtiles + mt) * p.max_splits;
  for (int idx = threadIdx.x; idx < 16 * D; idx += threads) {
    const int r = idx / D, c = idx % D, mm = mt * 16 + r;
    if (mm >= rows_used) continue;
    float m = -INFINITY;
    for (int s = 0; s < splits; ++s) m = fmaxf(m, p.ws_ml[((part0 + s) * 16 + r) * 2]);
    float o = 0.f, l = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float ms = p.ws_ml[((part0 + s) * 16 + r) * 2];
      const float f = ms == -INFINITY ? 0.f : exp2f(ms - m);
      o += f * p.ws_o[(part0 + s) * 16 * D + idx];
      l += f * p.ws_ml[((part0 + s) * 16 + r) * 2 + 1];
    }
    const int i = mm / p.group, qh = h * p.group + mm % p.group;
    store_any(p.o, p.o_type, int64_t(item.q_row + i) * p.o_stride + int64_t(qh) * D + c, o / l);
  }
}

// Splits and tiles for a batch: enough thread blocks to fill the chip about four times over.
struct launch_plan {
  bool decode;  // group x q_len <= 8: the warp-split decode kernel
  int unit, mtiles, tiles_per_split, max_splits, max_tiles;
};

launch_plan plan_for(const attend_args& a) {
  launch_plan lp{};
  const int group = a.q_heads / a.kv.kv_heads;
  int max_q = 1;
  for (const auto& it : a.items) max_q = std::max(max_q, int(it.q_len));
  lp.decode = group * max_q <= 8;
  lp.unit = lp.decode ? slab : tile_tokens;
  lp.max_tiles = 1;
  int64_t total = 0;
  for (const auto& it : a.items) {
    const int units = ceil_div(it.from_pages, lp.unit) + ceil_div(it.n - it.from_pages, lp.unit);
    lp.max_tiles = std::max(lp.max_tiles, units);
    total += units;
  }
  if (lp.decode) {
    // two waves of 8 independent warps per SM; at least 4 slabs per warp to amortize the query
    const int64_t warps = int64_t(a.num_sms) * 8 * 2;
    const int per_warp = int(std::clamp<int64_t>((total * a.kv.kv_heads + warps - 1) / warps, 4, max_cta_slabs / dec_warps));
    lp.mtiles = 1;
    lp.tiles_per_split = per_warp * dec_warps;
    lp.max_splits = ceil_div(lp.max_tiles, lp.tiles_per_split);
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
  const dim3 mgrid(unsigned(items), unsigned(kv_heads * lp.mtiles));
  if (lp.decode) {
    const int smem = int(sizeof(decode_smem<D>));
    KVQ_TRY(cuda_status(cudaFuncSetAttribute(decode_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                        "cudaFuncSetAttribute"));
    decode_kernel<D><<<dim3(unsigned(lp.max_splits), unsigned(kv_heads), unsigned(items)), dec_warps * 32, smem, st>>>(p);
  } else {
    const int smem = int(sizeof(attend_smem<D>));
    KVQ_TRY(cuda_status(cudaFuncSetAttribute(attend_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                        "cudaFuncSetAttribute"));
    attend_kernel<D><<<dim3(unsigned(lp.max_splits), unsigned(kv_heads * lp.mtiles), unsigned(items)), threads, smem, st>>>(p);
  }
  merge_kernel<D><<<mgrid, threads, 0, st>>>(p);
  return cuda_status(cudaGetLastError(), "attention launch");
}

}  // namespace

status attend_can_implement(const attend_args& a) {
  const auto& kv = a.kv;
  if (kv.head_dim != 64 && kv.head_dim != 128)
    return {errc::unsupported, msg("CUDA attention supports head_dim 64 and 128, not ", kv.head_dim)};
  if (kv.page_tokens % tile_tokens != 0)
    return {errc::unsupported, msg("CUDA attention needs page_tokens a multiple of 64, not ", kv.page_tokens)};
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
    p.arena = a.kv.arena;
    p.blocks = a.kv.blocks;
    p.fmts = a.kv.fmts;
    p.layers = a.kv.layers;
    p.kv_heads = a.kv.kv_heads;
    p.page_tokens = a.kv.page_tokens;
    p.window = a.kv.window;
    p.max_pages = a.kv.max_pages;
    for (size_t f = 0; f < format_count; ++f) p.k_bytes[f] = a.kv.k_page_bytes[f], p.v_bytes[f] = a.kv.v_page_bytes[f];
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
    p.n_items = int(sub.items.size());
    std::copy(sub.items.begin(), sub.items.end(), p.items);
    p.unit_tokens = lp.unit;
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
  uint8_t* arena;
  uint32_t* blocks;
  uint8_t* fmts;
  int layers, kv_heads, head_dim, page_tokens, window, max_pages;
  uint32_t k_bytes[format_count];
  uint32_t v_bytes[format_count];
  int slot, layer;
  int32_t n, e, m;
  uint32_t window_unit;
  const void* src[2];
  dtype src_type[2];
  int64_t src_stride[2];
  int first_page, pages;
  uint32_t page_blocks[max_append_pages];
  uint8_t page_fmts[max_append_pages][max_kv_heads * 2];
  float clip[max_kv_heads * 2];
};

__device__ __forceinline__ uint16_t src_half(const append_params& p, int r, int64_t token, int h, int c) {
  const int64_t i = token * p.src_stride[r] + int64_t(h) * p.head_dim + c;
  switch (p.src_type[r]) {
    case dtype::f32: return float_to_half(static_cast<const float*>(p.src[r])[i]);
    case dtype::f16: return static_cast<const uint16_t*>(p.src[r])[i];
    default: return float_to_half(bf16_to_float(static_cast<const uint16_t*>(p.src[r])[i]));
  }
}

__device__ __forceinline__ uint16_t* ring_of(const append_params& p, int h, int r) {
  return reinterpret_cast<uint16_t*>(p.arena + size_t(p.window_unit) * 256) +
         ((size_t(p.layer) * p.kv_heads + h) * 2 + r) * size_t(p.window) * p.head_dim;
}

// One block per (new page, kv head, role): stage the page's fp16 rows (old tokens from the ring,
// new ones from the input) in shared memory, then encode every unit with the shared codec.
__global__ void __launch_bounds__(threads) encode_kernel(const __grid_constant__ append_params p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  uint16_t* src = reinterpret_cast<uint16_t*>(smem_raw);
  const int pg = blockIdx.x, h = blockIdx.y, r = blockIdx.z, d = p.head_dim, P = p.page_tokens;
  const uint16_t* ring = ring_of(p, h, r);
  const int first_tok = p.e + pg * P;
  for (int idx = threadIdx.x; idx < P * d; idx += threads) {
    const int row = idx / d, c = idx % d, j = first_tok + row;
    src[idx] = j < p.n ? ring[size_t(j % p.window) * d + c] : src_half(p, r, j - p.n, h, c);
  }
  const uint8_t* fm = p.page_fmts[pg];
  uint32_t off = 0;
  for (int hh = 0; hh < h; ++hh) off += p.k_bytes[fm[2 * hh]] + p.v_bytes[fm[2 * hh + 1]];
  if (r == 1) off += p.k_bytes[fm[2 * h]];
  const format_id f = fm[2 * h + r];
  const codec::page_geom g = codec::make_geom(f, r == 0 ? role::k : role::v, P, d);
  uint8_t* page = p.arena + size_t(p.page_blocks[pg]) * 256 + off;
  for (uint32_t i = threadIdx.x * 16; i < g.lay.total(); i += threads * 16) *reinterpret_cast<uint4*>(page + i) = make_uint4(0, 0, 0, 0);
  __syncthreads();
  const float clip = p.clip[2 * h + r];
  for (int u = threadIdx.x; u < g.unit_count(); u += threads) codec::encode_unit(g, src, d, u, page, clip);
  if (h == 0 && r == 0) {
    const size_t row = (size_t(p.slot) * p.layers + p.layer) * p.max_pages + p.first_page + pg;
    if (threadIdx.x == 0) p.blocks[row] = p.page_blocks[pg];
    for (int i = threadIdx.x; i < p.kv_heads * 2; i += threads) p.fmts[row * p.kv_heads * 2 + i] = fm[i];
  }
}

// The ring keeps the last `window` tokens: write the new ones that remain among them.
__global__ void ring_kernel(const __grid_constant__ append_params p) {
  const int32_t first = max(p.n, p.n + p.m - p.window);
  const int d = p.head_dim;
  const int64_t total = int64_t(p.n + p.m - first) * p.kv_heads * 2 * d;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total; idx += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(idx % d);
    const int r = int((idx / d) % 2);
    const int h = int((idx / (2 * d)) % p.kv_heads);
    const int32_t j = first + int32_t(idx / (int64_t(2) * d * p.kv_heads));
    ring_of(p, h, r)[size_t(j % p.window) * d + c] = src_half(p, r, j - p.n, h, c);
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
  if (a.pages > max_append_pages)
    return {errc::invalid_argument, msg("append: ", a.pages, " new pages in one call, at most ", max_append_pages)};
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  append_params p{};
  p.arena = a.arena;
  p.blocks = a.blocks;
  p.fmts = a.fmts;
  p.layers = kv.layers;
  p.kv_heads = kv.kv_heads;
  p.head_dim = kv.head_dim;
  p.page_tokens = kv.page_tokens;
  p.window = kv.window;
  p.max_pages = kv.max_pages;
  for (size_t f = 0; f < format_count; ++f) p.k_bytes[f] = kv.k_page_bytes[f], p.v_bytes[f] = kv.v_page_bytes[f];
  p.slot = a.slot;
  p.layer = a.layer;
  p.n = a.n;
  p.e = a.e;
  p.m = a.m;
  p.window_unit = a.window_unit;
  p.src[0] = a.k.data;
  p.src[1] = a.v.data;
  p.src_type[0] = a.k.type;
  p.src_type[1] = a.v.type;
  p.src_stride[0] = a.k.stride();
  p.src_stride[1] = a.v.stride();
  p.first_page = a.first_page;
  p.pages = a.pages;
  for (int i = 0; i < a.pages; ++i) {
    p.page_blocks[i] = a.page_blocks[i];
    for (int j = 0; j < kv.kv_heads * 2; ++j) p.page_fmts[i][j] = a.page_fmts[i * kv.kv_heads * 2 + j];
  }
  for (int j = 0; j < kv.kv_heads * 2; ++j) p.clip[j] = a.clip ? a.clip[j] : 1.0f;
  if (a.pages > 0) {
    const int smem = kv.page_tokens * kv.head_dim * 2;
    KVQ_TRY(cuda_status(cudaFuncSetAttribute(encode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                        "cudaFuncSetAttribute"));
    encode_kernel<<<dim3(unsigned(a.pages), unsigned(kv.kv_heads), 2), threads, smem, st>>>(p);
  }
  const int64_t ring_elems = int64_t(std::min(a.m, kv.window)) * kv.kv_heads * 2 * kv.head_dim;
  const int blocks = int(std::min<int64_t>(1024, (ring_elems + 255) / 256));
  ring_kernel<<<std::max(1, blocks), 256, 0, st>>>(p);
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
