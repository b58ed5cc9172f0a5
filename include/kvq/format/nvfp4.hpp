#pragma once
/// \file
/// `nvfp4`: the NVFP4 format of Blackwell engines. e2m1 values (sign, 2 exponent bits, 1 mantissa
/// bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6), one e4m3 scale per block of 16 consecutive channels of a
/// token, and one fp32 tensor scale, which in kvq is per page (one (layer, kv head, role) page of
/// P tokens). A unit is the whole page: the tensor scale depends on every value in it.
///
/// ts = amax(page) / (6 * 448) (1 for an all-zero page, so a stored tensor scale is never 0);
/// per block: bs = e4m3(amax(block) / (6 * ts)) (saturating at 448), S = bs * ts,
/// code = e2m1(x / S) rounded to nearest, ties to even, saturating at +-6 (code 0 when S = 0);
/// x^ = (e2m1(code) * bs) * ts.
///
/// Page byte layout (P = page_tokens, d = head_dim; K and V alike):
///
/// | offset          | bytes  | contents                                                  |
/// |-----------------|--------|-----------------------------------------------------------|
/// | 0               | P*d/2  | [P][d/2] e2m1 codes; channel 2i in the low nibble of byte i, sign in bit 3 |
/// | P*d/2           | P*d/16 | [P][d/16] e4m3 block scales, block j = channels 16j..16j+15 |
/// | P*d/2 + P*d/16  | 16     | fp32 tensor scale of the page, then 12 zero bytes         |
///
/// The codes and block scales are NVFP4's linear layout, what an NVFP4 engine's KV reader takes
/// per token row: codes packed as `__nv_fp4x2_e2m1` (first element in the low nibble), one e4m3
/// scale per 16 elements along head_dim, the value (code * block scale) * tensor scale. An engine
/// that keeps one tensor scale per (layer, kv head) applies each page's own. Sections are 16-byte
/// aligned when P*d is a multiple of 256 (`check_shape`).

#include <kvq/format/unit_codec.hpp>
#include <kvq/config.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/format/protocol.hpp>
#include <kvq/format/traits.hpp>
#include <kvq/status.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

KVQ_NAMESPACE_BEGIN

/// The largest e2m1 magnitude.
inline constexpr float e2m1_max = 6.0f;

/// e2m1 code (sign in bit 3) of v, rounded to nearest with ties to even, saturating at +-6;
/// values that round to zero give code 0 (+0).
KVQ_HOST_DEVICE constexpr uint32_t float_to_e2m1(float v) {
  const float a = v < 0.f ? -v : v;
  // magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: the midpoints, a tie going to the even code
  const uint32_t m = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.f);
  return m == 0 ? 0u : (v < 0.f ? 8u : 0u) | m;
}

/// Value of an e2m1 code (exact).
KVQ_HOST_DEVICE constexpr float e2m1_to_float(uint32_t code) {
  const uint32_t m = code & 7u, e = m >> 1;
  const float mag = e == 0 ? 0.5f * float(m & 1u) : float(2u + (m & 1u)) * float(1u << e) * 0.25f;
  return code & 8u ? -mag : mag;
}

/// Checks an fp4 tensor scale a caller supplies: finite and positive (a zero scale would decode
/// every value to 0 and make the encoder divide by zero). `field` names its origin.
inline status check_nvfp4_tensor_scale(float s, std::string_view field) {
  if (!std::isfinite(s) || !(s > 0.f))
    return {errc::invalid_argument,
            "fp4 tensor scale '" + std::string(field) + "' must be finite and positive, not " + std::to_string(s)};
  return {};
}

/// The codec of `nvfp4`.
struct nvfp4_codec {
  KVQ_HOST_DEVICE static constexpr page_layout layout(const format_traits&, role, int page_tokens, int head_dim) {
    const uint32_t n = uint32_t(page_tokens) * uint32_t(head_dim);
    return {n / 2, n / 16, 16};
  }
  /// The page's tensor scale.
  KVQ_HOST_DEVICE static float tensor_scale(const codec::page_geom& g, const uint8_t* page) {
    return *reinterpret_cast<const float*>(page + g.lay.zero_offset());
  }
  /// The tensor scale of a page whose largest magnitude is `amax` (1 for an all-zero page).
  KVQ_HOST_DEVICE static float tensor_scale_of(float amax) {
    return amax > 0.f ? codec::div_rn(amax, e2m1_max * fp8_e4m3_max) : 1.0f;
  }
  /// Writes the page's tensor scale `ts` and the zero bytes after it.
  KVQ_HOST_DEVICE static void put_tensor_scale(const codec::page_geom& g, uint8_t* page, float ts) {
    float* tail = reinterpret_cast<float*>(page + g.lay.zero_offset());
    tail[0] = ts;
    tail[1] = tail[2] = tail[3] = 0.f;
  }
  /// Encodes block j (channels 16j .. 16j + 15) of token t with tensor scale `ts`: its e4m3
  /// scale and its 8 code bytes (blocks touch disjoint bytes, so they may be encoded in parallel).
  KVQ_HOST_DEVICE static void encode_block(const codec::page_geom& g, const uint16_t* src, int src_stride,
                                           uint8_t* page, float ts, int t, int j) {
    const int d = g.head_dim;
    const uint16_t* x = src + t * src_stride + 16 * j;
    float amax = 0.f;
    for (int c = 0; c < 16; ++c) amax = codec::fmax_(amax, codec::fabs_(half_to_float(x[c])));
    const uint8_t bs = float_to_e4m3(codec::div_rn(amax, codec::mul_rn(e2m1_max, ts)));
    page[g.lay.code_bytes + t * (d / 16) + j] = bs;
    const float S = codec::mul_rn(e4m3_to_float(bs), ts);
    for (int c = 0; c < 16; ++c)
      codec::put_code(page + t * (d / 2), 4, 16 * j + c,
                      S > 0.f ? float_to_e2m1(codec::div_rn(half_to_float(x[c]), S)) : 0u);
  }
  /// Encodes the whole page with tensor scale `ts` (checked by `check_nvfp4_tensor_scale`).
  KVQ_HOST_DEVICE static void encode_page_with(const codec::page_geom& g, const uint16_t* src, int src_stride,
                                               uint8_t* page, float ts) {
    put_tensor_scale(g, page, ts);
    for (int t = 0; t < g.page_tokens; ++t)
      for (int j = 0; j < g.head_dim / 16; ++j) encode_block(g, src, src_stride, page, ts, t, j);
  }
  /// Encodes the page (its one unit) with the tensor scale of its absmax.
  KVQ_HOST_DEVICE static void encode_unit(const codec::page_geom& g, const uint16_t* src, int src_stride, int,
                                          uint8_t* page, float) {
    float amax = 0.f;
    for (int t = 0; t < g.page_tokens; ++t)
      for (int c = 0; c < g.head_dim; ++c)
        amax = codec::fmax_(amax, codec::fabs_(half_to_float(src[t * src_stride + c])));
    encode_page_with(g, src, src_stride, page, tensor_scale_of(amax));
  }
  KVQ_HOST_DEVICE static float decode_element(const codec::page_geom& g, const uint8_t* page, int t, int c) {
    const float bs = e4m3_to_float(page[g.lay.code_bytes + t * (g.head_dim / 16) + c / 16]);
    const float v = e2m1_to_float(codec::get_code(page + t * (g.head_dim / 2), 4, c));
    return codec::mul_rn(codec::mul_rn(v, bs), tensor_scale(g, page));
  }
};

/// NVFP4: e2m1 codes, an e4m3 scale per 16 channels, an fp32 tensor scale per page.
struct nvfp4 : format_base<family::nvfp4, 4, 16, nvfp4_codec> {
  static constexpr const char* spec = "nvfp4";
  static constexpr const char* spec_alias = "fp4";
  static constexpr bool named_by_bits = false;
};

// 64 tokens x 128 channels: 4096 code bytes, 512 block scales, 16 bytes of tensor scale: 4.52 bits
static_assert(nvfp4::page(role::k, 64, 128).total() == 4096 + 512 + 16);
static_assert(float_to_e2m1(2.5f) == 4 && float_to_e2m1(1.75f) == 4 && float_to_e2m1(-7.f) == 15 &&
              float_to_e2m1(-0.1f) == 0);
static_assert(e2m1_to_float(7) == 6.f && e2m1_to_float(3) == 1.5f && e2m1_to_float(9) == -0.5f &&
              e2m1_to_float(4) == 2.f);

KVQ_NAMESPACE_END
