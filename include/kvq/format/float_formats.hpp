#pragma once
/// \file
/// The float formats: fp16, bf16 (16-bit values, no parameters) and fp8 e4m3 (one fp32 scale per
/// token-head). A unit is one token.
///
/// Page byte layout (P = page_tokens, d = head_dim; K and V alike):
///
/// | format      | offset | bytes  | contents                      |
/// |-------------|--------|--------|-------------------------------|
/// | fp16 / bf16 | 0      | P*d*2  | [P][d] values                 |
/// | fp8_e4m3    | 0      | P*d    | [P][d] e4m3 codes             |
/// |             | P*d    | P*4    | [P] fp32 scales (absmax/448)  |

#include <kvq/format/unit_codec.hpp>
#include <kvq/config.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/format/protocol.hpp>
#include <kvq/format/traits.hpp>

#include <cstdint>

KVQ_NAMESPACE_BEGIN

/// The codec of the 16-bit float formats: values stored as they are (fp16) or rounded to nearest
/// even (bf16); the family is read from the page geometry.
struct float16_codec {
  KVQ_HOST_DEVICE static constexpr page_layout layout(const format_traits&, role, int page_tokens, int head_dim) {
    return {uint32_t(page_tokens) * uint32_t(head_dim) * 2, 0, 0};
  }
  /// Encodes token `u` (source row u, fp16 bits).
  KVQ_HOST_DEVICE static void encode_unit(const codec::page_geom& g, const uint16_t* src, int src_stride, int u,
                                          uint8_t* page, float) {
    uint16_t* dst = reinterpret_cast<uint16_t*>(page + u * g.row_bytes());
    for (int c = 0; c < g.head_dim; ++c) {
      const uint16_t h = src[u * src_stride + c];
      dst[c] = g.fmt.fam == family::fp16 ? h : float_to_bf16(half_to_float(h));
    }
  }
  KVQ_HOST_DEVICE static float decode_element(const codec::page_geom& g, const uint8_t* page, int t, int c) {
    const uint16_t v = reinterpret_cast<const uint16_t*>(page + t * g.row_bytes())[c];
    return g.fmt.fam == family::fp16 ? half_to_float(v) : bf16_to_float(v);
  }
};

/// A 16-bit float format: fp16 or bf16.
template <family Fam>
struct float16_format : format_base<Fam, 16, 1, float16_codec> {
  static_assert(Fam == family::fp16 || Fam == family::bf16);
  static constexpr const char* spec = Fam == family::fp16 ? "fp16" : "bf16";
  static constexpr const char* spec_alias = Fam == family::fp16 ? "f16" : nullptr;
  static constexpr bool named_by_bits = false;  ///< the spec name carries no bit width
};

/// IEEE fp16 values.
struct fp16 : float16_format<family::fp16> {};
/// bfloat16 values.
struct bf16 : float16_format<family::bf16> {};

/// OCP fp8 e4m3 codes with one fp32 scale per token: s = absmax/448, code = e4m3(x/s),
/// x^ = e4m3(code) * s; a zero scale stores code 0.
struct fp8_e4m3 : format_base<family::fp8_e4m3, 8, 1, fp8_e4m3> {
  static constexpr const char* spec = "fp8";
  static constexpr const char* spec_alias = "fp8_e4m3";
  static constexpr bool named_by_bits = false;

  KVQ_HOST_DEVICE static constexpr page_layout layout(const format_traits&, role, int page_tokens, int head_dim) {
    return {uint32_t(page_tokens) * uint32_t(head_dim), uint32_t(page_tokens) * 4, 0};
  }
  /// Encodes token `u` (source row u, fp16 bits).
  KVQ_HOST_DEVICE static void encode_unit(const codec::page_geom& g, const uint16_t* src, int src_stride, int u,
                                          uint8_t* page, float) {
    const int d = g.head_dim, rb = g.row_bytes();
    const uint16_t* x = src + u * src_stride;
    float amax = 0.f;
    for (int c = 0; c < d; ++c) amax = codec::fmax_(amax, codec::fabs_(half_to_float(x[c])));
    const float s = codec::div_rn(amax, fp8_e4m3_max);
    reinterpret_cast<float*>(g.scales(page))[u] = s;
    for (int c = 0; c < d; ++c) page[u * rb + c] = s > 0.f ? float_to_e4m3(codec::div_rn(half_to_float(x[c]), s)) : uint8_t(0);
  }
  KVQ_HOST_DEVICE static float decode_element(const codec::page_geom& g, const uint8_t* page, int t, int c) {
    return codec::mul_rn(e4m3_to_float(page[t * g.row_bytes() + c]), reinterpret_cast<const float*>(g.scales(page))[t]);
  }
};

static_assert(fp16::page(role::k, 64, 128).total() == 64 * 128 * 2);
static_assert(fp8_e4m3::page(role::v, 64, 128).total() == 64 * 128 + 64 * 4);

KVQ_NAMESPACE_END
