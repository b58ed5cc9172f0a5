#pragma once
/// \file
/// `codebook<Bits, Group>`: 2^b non-uniform levels with one fp16 scale per token per group of
/// `Group` channels (0: the whole head). A unit is one (token, channel group).
///
/// s = fp16(rms of the group) (sqrt of the mean square, float32, correctly rounded steps);
/// v = x / s; code = the index of the level nearest v (a value on a midpoint between two levels
/// takes the lower one; beyond the outer levels, the outer level); x^ = level[code] * s. A zero
/// scale decodes to 0 whatever the code. The levels are in units of the group's rms: by default
/// the Lloyd-Max levels of a standard normal (the MSE-optimal b-bit quantizer of N(0, 1), which
/// rotated K and V follow closely), or levels a caller supplies (fitted per (layer, kv head,
/// role)), checked by `check_codebook_levels`.
///
/// Each page carries its levels, so a decoder never needs a side table and a page encoded with
/// fitted levels decodes like any other. Page byte layout (P = page_tokens, d = head_dim,
/// b = Bits, g = Group; K and V alike):
///
/// | offset              | bytes       | contents                                         |
/// |---------------------|-------------|--------------------------------------------------|
/// | 0                   | P*d*b/8     | [P][d] level indices (3 bits: two planes, sym.hpp) |
/// | P*d*b/8             | P*(d/g)*2   | [P][d/g] fp16 scales (group rms)                 |
/// | + P*(d/g)*2         | 2^b*4       | [2^b] fp32 levels, strictly ascending            |
///
/// Codes are packed along channels as for `sym` (format/sym.hpp). The sections are 16-byte
/// aligned when P*(d/g) is a multiple of 8 (and P*d of 128 for 3 bits; `check_shape`).

#include <kvq/format/unit_codec.hpp>
#include <kvq/config.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/format/protocol.hpp>
#include <kvq/format/traits.hpp>
#include <kvq/status.hpp>

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

KVQ_NAMESPACE_BEGIN

/// Level k (0 <= k < 2^bits, ascending) of the Lloyd-Max quantizer of a standard normal at
/// `bits` = 2, 3 or 4 bits (fixed points of Lloyd's iteration in float64, rounded to float;
/// tests/test_codec.cpp checks that each is the centroid of its cell). Host and device.
KVQ_HOST_DEVICE constexpr float lloyd_max_level(int bits, int k) {
  // the positive half of each symmetric table, innermost first
  constexpr float l2[] = {0.452780035f, 1.510417608f};
  constexpr float l3[] = {0.245094179f, 0.756005281f, 1.343909279f, 2.151945705f};
  constexpr float l4[] = {0.128395030f, 0.388048299f, 0.656759119f, 0.942340456f,
                          1.256231197f, 1.618046386f, 2.069017227f, 2.732589571f};
  const int half = 1 << (bits - 1), i = k < half ? half - 1 - k : k - half;
  const float m = bits == 2 ? l2[i] : bits == 3 ? l3[i] : l4[i];
  return k < half ? -m : m;
}

/// Checks levels a caller supplies for a `bits`-bit codebook: exactly 2^bits values, finite and
/// strictly ascending. `field` names their origin (an artifact field) in the message.
inline status check_codebook_levels(std::span<const float> levels, int bits, std::string_view field) {
  const std::string where = "codebook levels '" + std::string(field) + "'";
  if (bits < 2 || bits > 4)
    return {errc::invalid_argument, where + ": bits must be 2, 3 or 4, not " + std::to_string(bits)};
  if (levels.size() != size_t(1) << bits)
    return {errc::invalid_argument, where + ": a " + std::to_string(bits) + "-bit codebook has " +
                                        std::to_string(1 << bits) + " levels, not " + std::to_string(levels.size())};
  for (size_t k = 0; k < levels.size(); ++k) {
    if (!std::isfinite(levels[k]))
      return {errc::invalid_argument, where + ": level " + std::to_string(k) + " is not finite"};
    if (k > 0 && !(levels[k] > levels[k - 1]))
      return {errc::invalid_argument, where + ": levels must be strictly ascending, but level " + std::to_string(k) +
                                          " (" + std::to_string(levels[k]) + ") <= level " + std::to_string(k - 1) +
                                          " (" + std::to_string(levels[k - 1]) + ")"};
  }
  return {};
}

/// Checks a table of `bits`-bit codebook levels for `units` (layer, kv head, role) units:
/// [units][2^bits], unit u = (layer * kv_heads + head) * 2 + (V ? 1 : 0), each unit's levels as
/// `check_codebook_levels` wants them. `table` names the whole table in a count mismatch;
/// `field_of(layer, head, is_v)` names one unit's levels (a std::string).
template <class FieldOf>
status check_codebook_table(std::span<const float> levels, int bits, size_t units, int kv_heads,
                            std::string_view table, FieldOf&& field_of) {
  if (bits < 2 || bits > 4)
    return {errc::invalid_argument, std::string(table) + ": bits must be 2, 3 or 4, not " + std::to_string(bits)};
  const size_t n = size_t(1) << bits;
  if (levels.size() != units * n)
    return {errc::invalid_argument, std::string(table) + " has " + std::to_string(levels.size()) + " levels; needs " +
                                        std::to_string(units * n) + " (layers x kv heads x 2 x " + std::to_string(n) +
                                        ")"};
  for (size_t u = 0; u < units; ++u) {
    const size_t lh = u / 2;
    const std::string field = field_of(int(lh / size_t(kv_heads)), int(lh % size_t(kv_heads)), u % 2 == 1);
    if (status s = check_codebook_levels(levels.subspan(u * n, n), bits, field); !s.ok()) return s;
  }
  return {};
}

/// The codec of every codebook format; bits and group are read from the page geometry.
struct codebook_codec {
  KVQ_HOST_DEVICE static constexpr page_layout layout(const format_traits& t, role, int page_tokens, int head_dim) {
    const uint32_t P = uint32_t(page_tokens), d = uint32_t(head_dim);
    return {P * d * t.bits / 8, P * (d / uint32_t(group_of(t, head_dim))) * 2, (1u << t.bits) * 4};
  }
  /// The page's level table: [2^bits] fp32, ascending.
  KVQ_HOST_DEVICE static const float* levels(const codec::page_geom& g, const uint8_t* page) {
    return reinterpret_cast<const float*>(page + g.lay.zero_offset());
  }
  /// Encodes unit u = (token u / groups, channel group u % groups) with the given levels
  /// ([2^bits] fp32, checked by `check_codebook_levels`); unit 0 also writes them to the page.
  KVQ_HOST_DEVICE static void encode_unit_with(const codec::page_geom& g, const uint16_t* src, int src_stride, int u,
                                               uint8_t* page, const float* lv) {
    const int n = 1 << g.fmt.bits, gs = g.group(), ng = g.head_dim / gs, t = u / ng, c0 = (u % ng) * gs;
    if (u == 0)
      for (int k = 0; k < n; ++k) reinterpret_cast<float*>(page + g.lay.zero_offset())[k] = lv[k];
    const uint16_t* x = src + t * src_stride + c0;
    float ss = 0.f;
    for (int c = 0; c < gs; ++c) {
      const float v = half_to_float(x[c]);
      ss = codec::add_rn(ss, codec::mul_rn(v, v));
    }
    const uint16_t s16 = float_to_half(codec::sqrt_rn(codec::div_rn(ss, float(gs))));
    g.scales(page)[t * ng + u % ng] = s16;
    const float s = half_to_float(s16);
    for (int c = 0; c < gs; ++c) {
      uint32_t q = 0;
      if (s > 0.f) {
        const float v = codec::div_rn(half_to_float(x[c]), s);
        for (int k = 0; k + 1 < n; ++k) q += v > codec::mul_rn(0.5f, codec::add_rn(lv[k], lv[k + 1])) ? 1u : 0u;
      }
      codec::put_page_code(g, page, t, c0 + c, q);
    }
  }
  /// Encodes unit u with the default (Lloyd-Max) levels.
  KVQ_HOST_DEVICE static void encode_unit(const codec::page_geom& g, const uint16_t* src, int src_stride, int u,
                                          uint8_t* page, float) {
    float lv[16];
    for (int k = 0; k < (1 << g.fmt.bits); ++k) lv[k] = lloyd_max_level(g.fmt.bits, k);
    encode_unit_with(g, src, src_stride, u, page, lv);
  }
  KVQ_HOST_DEVICE static float decode_element(const codec::page_geom& g, const uint8_t* page, int t, int c) {
    const int gs = g.group(), ng = g.head_dim / gs;
    const float s = half_to_float(g.scales(page)[t * ng + c / gs]);
    return codec::mul_rn(levels(g, page)[codec::page_code(g, page, t, c)], s);
  }
};

/// `Bits`-bit codebook codes (2^Bits levels), one rms scale per `Group` channels of a token
/// (0: the whole head).
template <int Bits, int Group>
struct codebook : format_base<family::codebook, Bits, Group, codebook_codec> {
  static_assert(Bits >= 2 && Bits <= 4, "codebooks of 4, 8 or 16 levels");
  static_assert(Group == 0 || (Group >= 32 && (Group & (Group - 1)) == 0), "channel groups are powers of two >= 32");
  static constexpr const char* spec = "cb";
  static constexpr const char* spec_alias = "codebook";
  static constexpr int default_group = 0;  ///< `cb4` scales by the rms of the whole head
};

// cb4 at 64 tokens x 128 channels, whole-head scale: codes + 64 fp16 scales + 16 fp32 levels
static_assert(codebook<4, 0>::page(role::k, 64, 128).total() == 64 * 64 + 64 * 2 + 16 * 4);
static_assert(codebook<3, 32>::page(role::v, 64, 128).total() == 64 * 48 + 64 * 4 * 2 + 8 * 4);

KVQ_NAMESPACE_END
