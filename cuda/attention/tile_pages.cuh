#pragma once
// Page access of the tile kernel (`attend_kernel`): per-tile page lookups, the byte ranges a
// 64-token tile needs of its K and V pages (or of the FP16 ring), and their cp.async copies into
// the block's raw ring; then the raw ring -> fp16 tiles.
#include "attention/dequant.cuh"
#include "attention/element_read.cuh"
#include "attention/params.cuh"

#include <kvq/store/window_layout.hpp>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

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
// channel scales and zeros of the token groups the rows touch. A page read by element needs none
// (`dequant_role` reads it where it lies).
template <int D>
__device__ __forceinline__ void role_ranges(format_id fid, role r, int P, int row0, int rows, uint32_t (&size)[3],
                                            uint32_t (&from)[3]) {
  const format_traits f = traits_of(fid);
  const uint32_t row_bytes = (D * f.bits) >> 3, code_bytes = uint32_t(P) * row_bytes;
  size[0] = uint32_t(rows) * row_bytes;
  from[0] = uint32_t(row0) * row_bytes;
  size[1] = size[2] = 0;
  from[1] = from[2] = code_bytes;
  if (tile_reads_by_element(f)) {
    size[0] = 0;
  } else if (f.fam == family::fp8_e4m3) {
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
// NOTE: `ring_offset(p.layer, kv_heads, h, 0, window, D)` (kvq/store/window_layout.hpp) written out:
// the call compiled to other SASS at D = 128 (its x2 and x256 grouped into other shifts); the
// static_assert below pins the two together.
template <int D>
__device__ __forceinline__ const uint8_t* ring_base(const attend_params& p, const decode_item& item, int h) {
  return p.kv.windows + size_t(item.window_unit) * block_unit + ((size_t(p.layer) * p.kv.kv_heads + h) * 2) * size_t(p.kv.window) * D * 2;
}
static_assert(ring_offset(5, 8, 3, 0, 96, 128) == ((size_t(5) * 8 + 3) * 2) * size_t(96) * 128 * 2);

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
    const block_ref b = locate_block(p.kv, p.layer, item.slot, page);
    const uint8_t* fm = b.fmts;
    uint32_t off = 0;
    for (int hh = 0; hh < h; ++hh) off += p.kv.k_page_bytes[fm[2 * hh]] + p.kv.v_page_bytes[fm[2 * hh + 1]];
    tt.page16[t - t0] = uint32_t((b.offset + off) / 16);
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
    s.page[0] = p.pages + size_t(tt.page16[t - t0]) * 16;
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

// Issues the copies of role r's page bytes (codes, scales, zeros: its three ranges back to back)
// to shared address `dst`, 16 bytes a copy, from threads `first`, `first + stride`, ... (no
// commit); returns the address past them.
__device__ __forceinline__ uint32_t issue_role_bytes(const tile_src& s, int r, uint32_t dst, int first, int stride) {
  for (int k = 0; k < 3; ++k) {
    const uint8_t* src = s.page[r] + s.from[r][k];
    for (uint32_t c = uint32_t(first); c < s.size[r][k] / 16; c += uint32_t(stride)) cp_async16(dst + c * 16, src + c * 16);
    dst += s.size[r][k];
  }
  return dst;
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
    issue_role_bytes(s, 1, issue_role_bytes(s, 0, dst, lane, 32), lane, 32);
  }
  cp_commit();
}

// The copy pipeline of a tile loop over tiles [t0, t1): the producer warp issues tiles in order
// into the block's raw ring of `RingBytes` while space and group slots last, and publishes each
// tile's description and ring offset in shared slots; a tile's bytes are freed (`release`) once
// it is dequantized. Only the producer warp keeps it and waits on the copy groups. `end` (each
// in-flight tile's end offset) is the caller's array, so that the counters stay in registers
// while the dynamically indexed array lives in local memory. Tiles are placed by `ring_place`
// (attention/layout.hpp): tile t is issued by the time tiles before it are released, which the
// consumer's wait for tile t relies on.
template <int D, uint32_t RingBytes>
struct tile_pump {
  static_assert(RingBytes >= 2 * tile_tokens * D * 2, "the raw ring holds the largest tile (FP16 K and V rows)");
  static_assert(RingBytes % 16 == 0, "ring offsets stay 16-byte aligned");
  int issued, t1;
  uint32_t head = 0, tail = 0;  // monotone byte counters over the ring
  uint32_t* end;                // [pipeline_tiles]

  __device__ __forceinline__ tile_pump(int t0, int t1_, uint32_t* end_) : issued(t0), t1(t1_), end(end_) {}
  // Issues what fits, at most `pipeline_tiles` ahead of `consumed_upto`.
  __device__ __forceinline__ void run(const attend_params& p, const decode_item& item, int h, int t0,
                                      const tile_table& tt, tile_src* slot, uint32_t* slot_at, uint32_t raw_base,
                                      int lane, int consumed_upto) {
    while (issued < t1 && issued - consumed_upto < pipeline_tiles) {
      const tile_src s = describe_tile<D>(p, item, h, issued, t0, tt);
      const uint32_t need = s.bytes();
      if (!ring_place(head, tail, need, RingBytes)) break;
      if (lane == 0) {
        slot[issued % pipeline_tiles] = s;
        slot_at[issued % pipeline_tiles] = head % RingBytes;
      }
      issue_tile<D>(s, raw_base + head % RingBytes, p.kv.window, lane);
      head += need;
      end[issued % pipeline_tiles] = head;
      ++issued;
    }
  }
  __device__ __forceinline__ void release(int t) { ring_release(tail, end[t % pipeline_tiles]); }
};

// One 16-byte chunk (128/Bits channels of one token row) from the raw ring -> halves in the tile.
// KIVI/RoleAlign keys: centered codes (code - 2^(b-1), exact in fp16; the caller folds their
// scales and zero points into the query), or with `KeyValues` their values code x s + z.
template <int D, int Bits, bool KeyValues>
__device__ __forceinline__ void tile_from_raw(const uint8_t* codes, const uint8_t* par1, const uint8_t* par2,
                                              format_traits f, role r, int valid, __half* dst) {
  constexpr int row_bytes = D * Bits / 8, cpr = row_bytes / 16, total = tile_tokens * cpr, elems = 128 / Bits;
  const bool k_along = r == role::k && f.k_along_tokens();
  const int_read how = !k_along ? int_read::token_groups : KeyValues ? int_read::channel_scales : int_read::centered;
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
        dequant_int_chunk<D, Bits>(w, f, how, scales, zeros, row, ch0, g, out, row);
      }
    }
  }
}

// One role of a page tile -> fp16 tile: from its bytes in the raw ring, or (a format read by
// element) from the page itself, rows row0 .. row0 + 63 of page_tokens P. `KeyValues`: as
// `tile_from_raw`.
template <int D, bool KeyValues>
__device__ __forceinline__ void dequant_role(const uint8_t* raw, const uint32_t (&size)[3], format_id fid, role r,
                                             int valid, __half* dst, const uint8_t* page, int P, int row0) {
  const format_traits f = traits_of(fid);
  if (tile_reads_by_element(f)) {
    tile_by_element<D>(fid, r, P, page, row0, valid, dst);
    return;
  }
  const uint8_t* p1 = raw + size[0];
  const uint8_t* p2 = p1 + size[1];
  switch (f.bits) {
    case 16: tile_from_raw<D, 16, KeyValues>(raw, p1, p2, f, r, valid, dst); break;
    case 8: tile_from_raw<D, 8, KeyValues>(raw, p1, p2, f, r, valid, dst); break;
    case 4: tile_from_raw<D, 4, KeyValues>(raw, p1, p2, f, r, valid, dst); break;
    default: tile_from_raw<D, 2, KeyValues>(raw, p1, p2, f, r, valid, dst); break;
  }
}

// Role r (0: K, 1: V) of a page tile -> its fp16 tile at `dst` (shared or global memory,
// swizzled), from the role's bytes at `raw` (its three ranges back to back), or read by element
// from the page. `KeyValues`: as `tile_from_raw`.
template <int D, bool KeyValues>
__device__ __forceinline__ void role_to_fp16(const tile_src& s, int r, const uint8_t* raw, __half* dst,
                                             int page_tokens) {
  dequant_role<D, KeyValues>(raw, s.size[r], r == 0 ? s.fk : s.fv, r == 0 ? role::k : role::v, s.valid, dst, s.page[r],
                             page_tokens, s.row0);
}

// One tile's raw bytes -> the fp16 K and V tiles (swizzled, rows past `valid` zero): ring rows
// as they are, page rows through `dequant_role` (KIVI/RoleAlign keys as centered codes). All
// threads.
template <int D>
__device__ __forceinline__ void tile_to_fp16(const tile_src& s, const uint8_t* raw, __half* k, __half* v,
                                             int page_tokens) {
  if (s.ring) {
    constexpr int cpr = D * 2 / 16;
#pragma unroll
    for (int i = 0; i < tile_tokens * cpr / threads; ++i) {
      const int c = threadIdx.x + i * threads, row = c / cpr, ch = c % cpr;
      const bool ok = row < s.valid;
      const uint4 kk = ok ? reinterpret_cast<const uint4*>(raw)[c] : make_uint4(0, 0, 0, 0);
      const uint4 vv = ok ? reinterpret_cast<const uint4*>(raw + tile_tokens * D * 2)[c] : make_uint4(0, 0, 0, 0);
      reinterpret_cast<uint4*>(k)[swz<D>(row, ch) / 8] = kk;
      reinterpret_cast<uint4*>(v)[swz<D>(row, ch) / 8] = vv;
    }
  } else {
    role_to_fp16<D, false>(s, 0, raw, k, page_tokens);
    role_to_fp16<D, false>(s, 1, raw + s.size[0][0] + s.size[0][1] + s.size[0][2], v, page_tokens);
  }
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
