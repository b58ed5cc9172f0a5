#pragma once
/// \file
/// `sym<Bits, Group>`: symmetric integer codes with one fp16 scale per token per group of
/// `Group` channels (0: the whole head). A unit is one (token, channel group).
///
/// s = fp16(absmax / (2^(b-1)-1)); q = clamp(rint(x/s), -qmax, qmax), stored as q + 2^(b-1)
/// (offset binary); x^ = (u - 2^(b-1)) * s. A zero scale stores code 2^(b-1) (decodes to 0).
///
/// Page byte layout (P = page_tokens, d = head_dim, b = Bits, g = Group; K and V alike):
///
/// | offset  | bytes       | contents                      |
/// |---------|-------------|-------------------------------|
/// | 0       | P*d*b/8     | [P][d] codes, offset binary   |
/// | P*d*b/8 | P*(d/g)*2   | [P][d/g] fp16 scales          |
///
/// Codes of one token row are packed along channels, low bits first: for 4 bits, channel 2i is
/// the low nibble of byte i; for 2 bits, channel 4i is bits 0-1 of byte i. 3-bit codes are two
/// planes within the code section (`codec::page_code`):
///
/// | offset  | bytes   | contents                                              |
/// |---------|---------|-------------------------------------------------------|
/// | 0       | P*d/4   | [P][d/4] low 2 bits of each code, packed as 2-bit     |
/// | P*d/4   | P*d/8   | [P][d/8] bit 2 of each code, channel c in bit c%8     |
///
/// so a 16-byte load reads 64 channels of plane 0 or 128 of plane 1, and a 3-bit code is the
/// 2-bit unpack plus one masked bit. The sections stay 16-byte aligned when P*d is a multiple
/// of 128 (`check_shape`).

#include <kvq/format/unit_codec.hpp>
#include <kvq/config.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/format/protocol.hpp>
#include <kvq/format/traits.hpp>

#include <cstdint>

KVQ_NAMESPACE_BEGIN

/// The codec of every `sym` format; bits and group are read from the page geometry.
struct sym_codec {
  KVQ_HOST_DEVICE static constexpr page_layout layout(const format_traits& t, role, int page_tokens, int head_dim) {
    const uint32_t P = uint32_t(page_tokens), d = uint32_t(head_dim);
    return {P * d * t.bits / 8, P * (d / uint32_t(group_of(t, head_dim))) * 2, 0};
  }
  /// Encodes unit u = (token u / groups, channel group u % groups).
  KVQ_HOST_DEVICE static void encode_unit(const codec::page_geom& g, const uint16_t* src, int src_stride, int u,
                                          uint8_t* page, float) {
    const int bits = g.fmt.bits, gs = g.group(), ng = g.head_dim / gs, t = u / ng, c0 = (u % ng) * gs;
    const uint16_t* x = src + t * src_stride + c0;
    float amax = 0.f;
    for (int c = 0; c < gs; ++c) amax = codec::fmax_(amax, codec::fabs_(half_to_float(x[c])));
    const int qmax = (1 << (bits - 1)) - 1;
    const uint16_t s16 = float_to_half(codec::div_rn(amax, float(qmax)));
    g.scales(page)[t * ng + u % ng] = s16;
    const float s = half_to_float(s16);
    for (int c = 0; c < gs; ++c) {
      float q = s > 0.f ? round_even(codec::div_rn(half_to_float(x[c]), s)) : 0.f;
      q = codec::fmin_(codec::fmax_(q, float(-qmax)), float(qmax));
      codec::put_page_code(g, page, t, c0 + c, uint32_t(int(q) + (1 << (bits - 1))));
    }
  }
  KVQ_HOST_DEVICE static float decode_element(const codec::page_geom& g, const uint8_t* page, int t, int c) {
    const int bits = g.fmt.bits, gs = g.group(), ng = g.head_dim / gs;
    const float s = half_to_float(g.scales(page)[t * ng + c / gs]);
    return codec::mul_rn(float(int(codec::page_code(g, page, t, c)) - (1 << (bits - 1))), s);
  }
};

/// Symmetric `Bits`-bit codes, one scale per `Group` channels of a token (0: the whole head).
template <int Bits, int Group>
struct sym : format_base<family::sym, Bits, Group, sym_codec> {
  static_assert(Bits == 2 || Bits == 3 || Bits == 4 || Bits == 8, "codes pack whole bytes (3 bits: two planes)");
  static_assert(Group == 0 || (Group >= 32 && (Group & (Group - 1)) == 0), "channel groups are powers of two >= 32");
  static constexpr const char* spec = "sym";
  static constexpr int default_group = 0;  ///< `sym4` is the whole-head group
};

static_assert(sym<4, 32>::page(role::k, 64, 128).total() == 64 * 128 / 2 + 64 * 4 * 2);
static_assert(sym<8, 0>::page(role::v, 64, 128).total() == 64 * 128 + 64 * 2);
static_assert(sym<3, 32>::page(role::k, 64, 128).total() == 64 * 32 + 64 * 16 + 64 * 4 * 2);

KVQ_NAMESPACE_END
