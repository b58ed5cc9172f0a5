#pragma once
/// \file
/// The data the offline policies (autok, kl_budget, random) consume and produce:
///
/// - `sensitivity_profile`: a measured damage number per (layer, kv head, role, candidate
///   format). For K it is the attention KL a quantization of that head's keys causes, for V the
///   perturbation of the attention output. Calibration fills it; the
///   artifact (`kvq/calib/artifact.hpp`) stores it.
/// - `format_map`: a table of one `format_pair` per (layer, kv head): what an allocation policy
///   decided, and what `random_policy` permutes.
///
/// Both are plain values, header-only, with no link dependency.

#include <kvq/config.hpp>
#include <kvq/format/format.hpp>
#include <kvq/policy/policy.hpp>
#include <kvq/status.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

KVQ_NAMESPACE_BEGIN

/// Measured damage of each candidate format per (layer, kv head, role), stored densely as
/// `values[((layer * kv_heads + kv_head) * 2 + role) * formats.size() + format_index]`.
/// Numbers are non-negative and finite (checked by `validate`); larger means more damage. K
/// numbers (attention KL, nats) and V numbers (output perturbation, relative squared error) are in
/// different units: consumers that add them say how (kl_budget has a V weight).
struct sensitivity_profile {
  int layers = 0;                  ///< layers of the model
  int kv_heads = 0;                ///< kv heads per layer
  std::vector<format_id> formats;  ///< candidate formats, in the order of the innermost axis
  std::vector<double> values;      ///< [layers][kv_heads][2 roles][formats.size()]

  /// An all-zero profile of this shape; errors name a non-positive dimension, an empty or
  /// duplicated candidate list, or an id outside the format table.
  static result<sensitivity_profile> make(int layers, int kv_heads, std::vector<format_id> formats) {
    sensitivity_profile p;
    p.layers = layers;
    p.kv_heads = kv_heads;
    p.formats = std::move(formats);
    p.values.assign(p.expected_size(), 0.0);
    if (status s = p.validate(); !s.ok()) return s;
    return p;
  }

  /// Number of entries `values` must hold for this shape and candidate list.
  size_t expected_size() const {
    return layers > 0 && kv_heads > 0 ? size_t(layers) * size_t(kv_heads) * 2 * formats.size() : 0;
  }

  /// Position of `f` in `formats`, or -1 if it is not a candidate.
  int format_index(format_id f) const {
    const auto it = std::find(formats.begin(), formats.end(), f);
    return it == formats.end() ? -1 : int(it - formats.begin());
  }

  /// Flat index of (layer, kv head, role, candidate index); the caller keeps them in range.
  size_t index(int layer, int kv_head, role r, int fi) const {
    return ((size_t(layer) * size_t(kv_heads) + size_t(kv_head)) * 2 + (r == role::k ? 0 : 1)) * formats.size() +
           size_t(fi);
  }

  /// Damage of candidate `fi` at (layer, kv head, role).
  double at(int layer, int kv_head, role r, int fi) const { return values[index(layer, kv_head, r, fi)]; }
  /// Writable damage of candidate `fi` at (layer, kv head, role).
  double& at(int layer, int kv_head, role r, int fi) { return values[index(layer, kv_head, r, fi)]; }

  /// Checks dimensions, candidates and numbers; the message names the first bad entry.
  status validate() const {
    if (layers <= 0 || kv_heads <= 0)
      return {errc::invalid_argument, "sensitivity profile: layers " + std::to_string(layers) + " and kv_heads " +
                                          std::to_string(kv_heads) + " must be positive"};
    if (formats.empty()) return {errc::invalid_argument, "sensitivity profile: no candidate formats"};
    for (size_t i = 0; i < formats.size(); ++i) {
      if (formats[i] >= format_count)
        return {errc::invalid_argument, "sensitivity profile: candidate " + std::to_string(i) + " has format id " +
                                            std::to_string(int(formats[i])) + ", outside the format table"};
      for (size_t j = 0; j < i; ++j)
        if (formats[j] == formats[i])
          return {errc::invalid_argument,
                  "sensitivity profile: format " + format_name(formats[i]) + " is listed twice"};
    }
    if (values.size() != expected_size())
      return {errc::invalid_argument, "sensitivity profile: " + std::to_string(values.size()) +
                                          " values, the shape needs " + std::to_string(expected_size())};
    for (int l = 0; l < layers; ++l)
      for (int h = 0; h < kv_heads; ++h)
        for (role r : {role::k, role::v})
          for (size_t f = 0; f < formats.size(); ++f) {
            const double x = at(l, h, r, int(f));
            if (!std::isfinite(x) || x < 0.0)
              return {errc::invalid_argument, "sensitivity profile: layer " + std::to_string(l) + " head " +
                                                  std::to_string(h) + " " + role_name(r) + " " +
                                                  format_name(formats[f]) + " is " + std::to_string(x) +
                                                  "; must be finite and >= 0"};
          }
    return {};
  }

  /// Per-layer sensitivity at a reference format: the sum over kv heads and both roles of the
  /// damage of `reference` (the input of autok). `v_weight` scales the V terms (0 = K only).
  result<std::vector<double>> per_layer(format_id reference, double v_weight = 1.0) const {
    const int fi = format_index(reference);
    if (fi < 0)
      return status{errc::invalid_argument,
                    "sensitivity profile: reference format " + format_name(reference) + " is not a candidate"};
    std::vector<double> out(size_t(std::max(layers, 0)), 0.0);
    for (int l = 0; l < layers; ++l)
      for (int h = 0; h < kv_heads; ++h) out[size_t(l)] += at(l, h, role::k, fi) + v_weight * at(l, h, role::v, fi);
    return out;
  }
};

/// One `format_pair` per (layer, kv head), row-major: `pairs[layer * kv_heads + kv_head]`.
struct format_map {
  int layers = 0;                  ///< rows
  int kv_heads = 0;                ///< columns
  std::vector<format_pair> pairs;  ///< [layers][kv_heads]

  /// A map with every entry `p`.
  static format_map uniform(int layers, int kv_heads, format_pair p) {
    return {layers, kv_heads, std::vector<format_pair>(size_t(layers) * size_t(kv_heads), p)};
  }
  /// The current decisions of a bound policy (its `current` for every (layer, kv head)).
  static format_map of(const policy& pol, int layers, int kv_heads) {
    format_map m = uniform(layers, kv_heads, {});
    for (int l = 0; l < layers; ++l)
      for (int h = 0; h < kv_heads; ++h) m.at(l, h) = pol.current(l, h);
    return m;
  }

  /// Entry of (layer, kv head); the caller keeps them in range.
  format_pair& at(int layer, int kv_head) { return pairs[size_t(layer) * size_t(kv_heads) + size_t(kv_head)]; }
  /// Entry of (layer, kv head); the caller keeps them in range.
  const format_pair& at(int layer, int kv_head) const {
    return pairs[size_t(layer) * size_t(kv_heads) + size_t(kv_head)];
  }

  /// Page bytes of one page index over all (layer, kv head, role): what the map costs per
  /// `page_tokens` tokens.
  uint64_t page_bytes(int page_tokens, int head_dim) const {
    uint64_t b = 0;
    for (const format_pair& p : pairs)
      b += layout_of(traits_of(p.k), role::k, page_tokens, head_dim).total() +
           layout_of(traits_of(p.v), role::v, page_tokens, head_dim).total();
    return b;
  }
  /// Average bits per K and V element of pages in this map, scales and zeros included.
  double average_bits(int page_tokens, int head_dim) const {
    if (pairs.empty()) return 0.0;
    return 8.0 * double(page_bytes(page_tokens, head_dim)) / (double(pairs.size()) * 2.0 * page_tokens * head_dim);
  }

  /// Checks that the map has `layers * kv_heads` entries matching the shape and that every
  /// format can store pages of the shape; the message names the first bad entry.
  status check(const cache_shape& shape, const std::string& who) const {
    if (layers != shape.layers || kv_heads != shape.kv_heads)
      return {errc::invalid_argument, who + ": format map is " + std::to_string(layers) + " layers x " +
                                          std::to_string(kv_heads) + " kv heads, the cache has " +
                                          std::to_string(shape.layers) + " x " + std::to_string(shape.kv_heads)};
    if (pairs.size() != size_t(layers) * size_t(kv_heads))
      return {errc::invalid_argument, who + ": format map holds " + std::to_string(pairs.size()) + " entries, needs " +
                                          std::to_string(size_t(layers) * size_t(kv_heads))};
    for (int l = 0; l < layers; ++l)
      for (int h = 0; h < kv_heads; ++h)
        for (role r : {role::k, role::v}) {
          const format_id f = r == role::k ? at(l, h).k : at(l, h).v;
          if (status s = check_shape(f, r, shape.page_tokens, shape.head_dim); !s.ok())
            return {s.code(), who + ", layer " + std::to_string(l) + " head " + std::to_string(h) + ": " + s.message()};
        }
    return {};
  }

  friend bool operator==(const format_map&, const format_map&) = default;
};

KVQ_NAMESPACE_END
