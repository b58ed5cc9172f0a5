#pragma once
/// \file
/// `kivi<Bits, Group>` and `rolealign<Bits, Group>`: asymmetric integer codes with an fp16 scale
/// and zero per group. Keys have outlier channels, so K groups run along tokens (one scale and
/// zero per channel per `Group` tokens); V groups run along the channels of one token.
/// `rolealign` is kivi's layout and decode with each group's range clipped to percentiles of its
/// values, a calibrated percentile p per (layer, kv head, role) (`KVCache::set_clip_percentiles`).
///
/// [lo, hi] = group min and max (kivi, and rolealign at p = 100: the same bytes); for rolealign at
/// p < 100 the (100-p)-th and p-th percentiles of the group's values, linear between order
/// statistics (`codec::percentile_range`); values outside are clamped to the end codes.
/// s = fp16((hi-lo)/(2^b-1)), z = fp16(lo); q = clamp(rint((x-z)/s), 0, 2^b-1); x^ = q*s + z. A
/// zero scale stores code 0.
///
/// Units: for K, one token group x 8 channels (writes b bytes per token); for V, one token x one
/// channel group.
///
/// Page byte layout (P = page_tokens, d = head_dim, b = Bits, G = g = Group):
///
/// | role | offset            | bytes       | contents                         |
/// |------|-------------------|-------------|----------------------------------|
/// | K    | 0                 | P*d*b/8     | [P][d] codes, unsigned           |
/// |      | P*d*b/8           | (P/G)*d*2   | [P/G][d] fp16 scales             |
/// |      | + (P/G)*d*2       | (P/G)*d*2   | [P/G][d] fp16 zeros (group min)  |
/// | V    | 0                 | P*d*b/8     | [P][d] codes, unsigned           |
/// |      | P*d*b/8           | P*(d/g)*2   | [P][d/g] fp16 scales             |
/// |      | + P*(d/g)*2       | P*(d/g)*2   | [P][d/g] fp16 zeros              |
///
/// Codes are packed along channels as for `sym`, 3-bit codes in its two planes (format/sym.hpp).

#include <kvq/format/unit_codec.hpp>
#include <kvq/config.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/format/protocol.hpp>
#include <kvq/format/traits.hpp>

#include <cstdint>

KVQ_NAMESPACE_BEGIN

/// The codec of every kivi and rolealign format; the family (whether to clip), bits and group
/// are read from the page geometry.
struct kivi_codec {
  KVQ_HOST_DEVICE static constexpr page_layout layout(const format_traits& t, role r, int page_tokens, int head_dim) {
    const uint32_t P = uint32_t(page_tokens), d = uint32_t(head_dim);
    const uint32_t params = r == role::k ? (P / t.group) * d * 2 : P * (d / t.group) * 2;
    return {P * d * t.bits / 8, params, params};
  }
  /// Encodes unit `u` (see the file comment); `pct` is rolealign's clip percentile in [50, 100]
  /// (100: no clipping; kivi ignores it).
  KVQ_HOST_DEVICE static void encode_unit(const codec::page_geom& g, const uint16_t* src, int src_stride, int u,
                                          uint8_t* page, float pct) {
    const int d = g.head_dim, bits = g.fmt.bits;
    const float p = g.fmt.fam == family::rolealign ? pct : 100.f;
    uint16_t* scales = g.scales(page);
    uint16_t* zeros = g.zeros(page);
    if (g.k_columns()) {
      // unit = (token group, 8-channel block): per channel, the range over G tokens
      const int G = g.fmt.group, nb = d / 8, tg = u / nb, c0 = (u % nb) * 8;
      for (int cc = 0; cc < 8; ++cc) {
        const int c = c0 + cc;
        float lo, hi;
        codec::percentile_range(src + (tg * G) * src_stride + c, src_stride, G, p, lo, hi);
        uint16_t s16, z16;
        codec::kivi_range(lo, hi, bits, s16, z16);
        scales[tg * d + c] = s16;
        zeros[tg * d + c] = z16;
        const float s = half_to_float(s16), z = half_to_float(z16);
        for (int t = 0; t < G; ++t) {
          const int tok = tg * G + t;
          codec::put_page_code(g, page, tok, c, codec::kivi_code(half_to_float(src[tok * src_stride + c]), s, z, bits));
        }
      }
    } else {
      const int gs = g.fmt.group, ng = d / gs, t = u / ng, c0 = (u % ng) * gs;
      const uint16_t* x = src + t * src_stride + c0;
      float lo, hi;
      codec::percentile_range(x, 1, gs, p, lo, hi);
      uint16_t s16, z16;
      codec::kivi_range(lo, hi, bits, s16, z16);
      scales[t * ng + u % ng] = s16;
      zeros[t * ng + u % ng] = z16;
      const float s = half_to_float(s16), z = half_to_float(z16);
      for (int c = 0; c < gs; ++c)
        codec::put_page_code(g, page, t, c0 + c, codec::kivi_code(half_to_float(x[c]), s, z, bits));
    }
  }
  KVQ_HOST_DEVICE static float decode_element(const codec::page_geom& g, const uint8_t* page, int t, int c) {
    const int gs = g.fmt.group;
    const int idx = g.k_columns() ? (t / gs) * g.head_dim + c : t * (g.head_dim / gs) + c / gs;
    const float s = half_to_float(g.scales(page)[idx]), z = half_to_float(g.zeros(page)[idx]);
    return codec::add_rn(codec::mul_rn(float(codec::page_code(g, page, t, c)), s), z);
  }
};

/// A format of kivi's layout: kivi or rolealign.
template <family Fam, int Bits, int Group>
struct kivi_layout_format : format_base<Fam, Bits, Group, kivi_codec> {
  static_assert(Fam == family::kivi || Fam == family::rolealign);
  static_assert(Bits == 2 || Bits == 3 || Bits == 4 || Bits == 8, "codes pack whole bytes (3 bits: two planes)");
  static_assert(Group >= 32 && (Group & (Group - 1)) == 0, "groups are powers of two >= 32");
  static constexpr const char* spec = Fam == family::kivi ? "kivi" : "ra";
  static constexpr const char* spec_alias = Fam == family::kivi ? nullptr : "rolealign";
  static constexpr int default_group = 32;
  static constexpr family decode_as = family::kivi;  ///< rolealign decodes as kivi
};

/// KIVI: `Bits`-bit asymmetric codes; K per channel over `Group` tokens, V per token over
/// `Group` channels.
template <int Bits, int Group>
struct kivi : kivi_layout_format<family::kivi, Bits, Group> {};

/// RoleAlign: kivi's layout and decode, each group's range clipped to calibrated percentiles.
template <int Bits, int Group>
struct rolealign : kivi_layout_format<family::rolealign, Bits, Group> {};

// kivi4/g32 at 64 tokens x 128 channels: codes + 2 token groups x 128 channels x (scale + zero)
static_assert(kivi<4, 32>::page(role::k, 64, 128).total() == 64 * 128 / 2 + 2 * 128 * 2 * 2);
// ... and V: codes + 64 tokens x 4 channel groups x (scale + zero)
static_assert(kivi<4, 32>::page(role::v, 64, 128).total() == 64 * 128 / 2 + 64 * 4 * 2 * 2);
static_assert(rolealign<2, 128>::page(role::v, 64, 128).total() == 64 * 128 / 4 + 64 * 1 * 2 * 2);

KVQ_NAMESPACE_END
