#pragma once
/// \file
/// Which (layer, kv head)s of a cache are rotated, and the host helpers that rotate rows of
/// them (docs/architecture.md, "Rotation"). The transform itself is rotation/hadamard.hpp.
///
/// Rotation is a property of a (layer, kv head), fixed when the cache is created: every page of
/// the head, whatever its format, and its FP16 window hold R k and R v; queries of the head's
/// GQA group are rotated at attend and the output rotated back, and `read` returns unrotated
/// values. The spec spelling is a `+rot` suffix (`kivi2/g32+rot`, `parse_format_spec`).

#include <kvq/core.hpp>
#include <kvq/format/format.hpp>
#include <kvq/rotation/hadamard.hpp>
#include <kvq/status.hpp>

#include <cstdint>
#include <string>
#include <vector>

KVQ_NAMESPACE_BEGIN

/// The rotated (layer, kv head)s of a cache and the seed of their signs.
struct rotation_config {
  /// [layers][kv_heads], 1 = rotated, 0 = not; empty: no head is rotated.
  std::vector<uint8_t> heads;
  /// Seed of the sign flips; each (layer, kv head) draws its own signs from it.
  uint64_t seed = rotation::default_seed;

  /// Every (layer, kv head) of `shape` rotated.
  static rotation_config all(const cache_shape& shape, uint64_t seed = rotation::default_seed) {
    return {std::vector<uint8_t>(size_t(shape.layers) * size_t(shape.kv_heads), 1), seed};
  }
  /// True when some head is rotated.
  bool any() const {
    for (uint8_t h : heads)
      if (h) return true;
    return false;
  }
  /// True when (layer, kv head) is rotated; `kv_heads` is the shape's.
  bool rotated(int layer, int kv_head, int kv_heads) const {
    return !heads.empty() && heads[size_t(layer) * size_t(kv_heads) + size_t(kv_head)] != 0;
  }
  /// True when some kv head of `layer` is rotated.
  bool layer_rotated(int layer, int kv_heads) const {
    for (int h = 0; h < kv_heads; ++h)
      if (rotated(layer, h, kv_heads)) return true;
    return false;
  }
  /// The sign words of (layer, kv head).
  rotation::signs signs_of(int layer, int kv_head) const { return rotation::signs::of(seed, layer, kv_head); }

  /// Checks the configuration against a shape: `heads` empty or [layers][kv_heads] of 0/1, and,
  /// when a head is rotated, head_dim a power of two. Errors name the field.
  status validate(const cache_shape& shape) const {
    const size_t need = size_t(shape.layers) * size_t(shape.kv_heads);
    if (!heads.empty() && heads.size() != need)
      return {errc::invalid_argument, "cache_config.rotation.heads has " + std::to_string(heads.size()) +
                                          " entries; need 0 or layers*kv_heads = " + std::to_string(need)};
    for (size_t i = 0; i < heads.size(); ++i)
      if (heads[i] > 1)
        return {errc::invalid_argument, "cache_config.rotation.heads[" + std::to_string(i) + "] is " +
                                            std::to_string(int(heads[i])) + "; must be 0 or 1"};
    if (any() && !rotation::is_power_of_two(shape.head_dim))
      return {errc::invalid_argument, "cache_config.rotation: the Hadamard rotation needs head_dim a power of two; got "
                                      "head_dim " + std::to_string(shape.head_dim)};
    return {};
  }
};

/// A (layer, kv head)'s format pair and whether it is rotated: what a spec `<pair>[+rot]` names.
struct format_spec {
  format_pair pair;
  bool rotated = false;
  friend constexpr bool operator==(const format_spec&, const format_spec&) = default;
};

/// Parses `<pair>[+rot]`: a `parse_format_pair` spec (`kivi2/g32`, `k=kivi4/g32,v=kivi2/g32`),
/// optionally followed by `+rot`, which asks for the Hadamard rotation of the (layer, kv head)s
/// it applies to (`kivi2/g32+rot`, `k=kivi4/g32,v=kivi2/g32+rot`). The suffix belongs to the
/// whole pair: K and V of a head are rotated together. Errors name the bad part.
KVQ_EXPORT result<format_spec> parse_format_spec(std::string_view spec);

/// The spec of `s`: `format_pair_name`, with `+rot` when rotated.
KVQ_EXPORT std::string format_spec_name(const format_spec& s);

namespace rotation {

/// Rotates (or, with `inverse`, rotates back) in place the rows of the rotated heads of one
/// layer: x [rows][heads][d] floats, head i belongs to kv head i / group (group 1 for K/V rows,
/// the GQA group for query and output rows). Rows of heads that are not rotated are unchanged.
inline void apply_rows(const rotation_config& cfg, int layer, int kv_heads, int group, float* x, int64_t rows,
                       int heads, int d, bool inverse) {
  for (int h = 0; h < heads; ++h) {
    const int kvh = h / group;
    if (!cfg.rotated(layer, kvh, kv_heads)) continue;
    const signs s = cfg.signs_of(layer, kvh);
    for (int64_t t = 0; t < rows; ++t) {
      float* row = x + (t * heads + h) * d;
      inverse ? unrotate(row, d, s) : rotate(row, d, s);
    }
  }
}

}  // namespace rotation
KVQ_NAMESPACE_END
