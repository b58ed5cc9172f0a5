#pragma once
/// \file
/// The calibration artifact: sensitivities and clip percentiles measured on calibration text, as a
/// versioned JSON file that the offline policies and the rolealign formats consume (DESIGN.md
/// section 6). Loading validates everything and fails with a message naming the file and the
/// field; nothing half-read is returned.
///
/// File format, version 4 (every field required unless marked optional):
///
/// ```json
/// {
///   "kind": "kvq.calibration",
///   "version": 4,
///   "model": { "name": "SmolLM2-135M",            // optional, informational
///              "layers": 30, "q_heads": 9, "kv_heads": 3, "head_dim": 64 },
///   "calibration": { "text_hash": "fnv1a64:8c3d9a0e5b7f1a22",  // of the calibration text
///                    "tokens": 4096 },                          // tokens measured
///   "formats": ["kivi2/g32", "kivi4/g32", "kivi8/g32"],         // `parse_format` specs
///   "sensitivity": {
///     "k_attention_kl":        [[[...per format...] ...per kv head...] ...per layer...],
///     "v_output_perturbation": [[[...per format...] ...per kv head...] ...per layer...]
///   },
///   "clip_percentiles": { "k": [[...per kv head...] ...per layer...],   // rolealign, in [50, 100]
///                         "v": [[...per kv head...] ...per layer...] },
///   "rotated_clip_percentiles": { "k": ..., "v": ... },   // optional: chosen on rotated heads
///   "output_kl": {                                  // optional (kvq-calibrate --output-kl)
///     "formats": ["kivi2/g32", "kivi4/g32"],        // a subset of "formats", no repeats
///     "tokens": 128,                                // teacher-forced tokens of each run
///     "kl": [[[...per output_kl format...] ...per kv head...] ...per layer...]   // nats
///   },
///   "rotated": {                                    // optional (calibrator_options::rotated)
///     "seed": "0x6b76712d726f7461",                 // rotation_config::seed, 16 hex digits
///     "k_attention_kl":        [[[...per format...] ...per kv head...] ...per layer...],
///     "v_output_perturbation": [[[...per format...] ...per kv head...] ...per layer...]
///   },
///   "codebooks": [                                  // optional, version 3 (calibrator_options::fit_codebooks)
///     { "format": "cb4", "rotated": true,           // a codebook format; fitted on rotated heads or not
///       "k": [[[...2^bits levels...] ...per kv head...] ...per layer...],
///       "v": [[[...2^bits levels...] ...per kv head...] ...per layer...] }
///   ]
/// }
/// ```
///
/// `codebooks` holds codebook levels fitted per (layer, kv head, role): each list strictly
/// ascending and finite, in units of the group's rms (format/codebook.hpp), at most one entry per
/// (format, rotated). When an artifact has them, its sensitivities of those formats were measured
/// with them. `codebook_levels_for` gives a cache's levels (`KVCache::set_codebook_levels`).
///
/// `rotated` holds the damage of each of "formats" on rotated (layer, kv head)s
/// (docs/architecture.md, "Rotation"; calib/calibrate.hpp): what a spec `<format>+rot` costs.
///
/// `output_kl.kl[l][h][f]` is the mean KL(P_fp16 ‖ P) of the model's next-token distribution
/// over the teacher-forced positions, P from a run whose cache is FP16 except (layer l, kv head h),
/// stored (K and V) in `output_kl.formats[f]`. Files without the field (older ones included) load
/// with `artifact::output_kl` empty; a file that has it must have it complete and valid.
///
/// `clip_percentiles` are the rolealign clip percentiles per (layer, kv head, role), chosen by
/// the calibrator (K by attention KL, V by output perturbation; calib/calibrate.hpp); each clips
/// a group to its (100-p)-th..p-th percentiles at encode time (format/kivi.hpp) and must pass
/// `clip_percentile_error`. `rotated_clip_percentiles`, when present, were chosen on rotated
/// heads: `clip_percentiles_for` gives a cache the table of each head's space.
///
/// Numbers must be finite (JSON has no NaN; a NaN written by another tool appears as `null` or a
/// string and is rejected), sensitivities >= 0. This build reads versions 1 to 4
/// (`artifact::current_version`); version 3 is version 4 with `clip_ratios` (rolealign's former
/// rule: each range narrowed about its midpoint by a ratio in (0, 1]) instead of
/// `clip_percentiles` and without `rotated_clip_percentiles`, version 2 version 3 without
/// `codebooks`, version 1 version 2 without `rotated` (a file with a field newer than its version
/// is rejected), any other version is rejected naming it. A ratio is not a percentile, so a
/// version 1-3 file's `clip_ratios` are checked, then dropped: it loads with every clip
/// percentile 100 (no clipping) and no rotated ones, and recalibrating gives percentiles. It
/// writes the artifact's `version`: 4 for what the calibrator makes (an older version writes
/// `clip_ratios` of 1, which needs every percentile 100).

#include <cstdint>
#include <kvq/config.hpp>
#include <kvq/policy/sensitivity.hpp>
#include <kvq/rotation/hadamard.hpp>
#include <kvq/status.hpp>
#include <string>
#include <string_view>
#include <vector>

KVQ_NAMESPACE_BEGIN
namespace calib {

/// The model dimensions an artifact was measured on; loading compares them to the model's.
struct model_shape {
  int layers = 0;    ///< transformer layers
  int q_heads = 0;   ///< query heads per layer
  int kv_heads = 0;  ///< key/value heads per layer
  int head_dim = 0;  ///< channels per head
  friend bool operator==(const model_shape&, const model_shape&) = default;
};

/// The optional end-to-end sensitivity of an artifact: output KL with one unit quantized at a time.
struct output_kl_table {
  int layers = 0;                  ///< the artifact's layers (when not empty)
  int kv_heads = 0;                ///< the artifact's kv heads (when not empty)
  std::vector<format_id> formats;  ///< measured formats, each one of the artifact's formats
  int64_t tokens = 0;              ///< teacher-forced tokens of each run (>= 1)
  std::vector<double> kl;          ///< [layers][kv_heads][formats], nats, finite and >= 0

  /// A table of zeros for `layers` x `kv_heads` x `formats`.
  static output_kl_table make(int layers, int kv_heads, std::vector<format_id> formats, int64_t tokens) {
    output_kl_table t{layers, kv_heads, std::move(formats), tokens, {}};
    t.kl.assign(size_t(layers) * size_t(kv_heads) * t.formats.size(), 0.0);
    return t;
  }
  /// True when nothing was measured (the artifact has no `output_kl` field).
  bool empty() const { return formats.empty(); }
  /// Entry of (layer, kv head, index into `formats`).
  double& at(int layer, int kv_head, int f) { return kl[index(layer, kv_head, f)]; }
  double at(int layer, int kv_head, int f) const { return kl[index(layer, kv_head, f)]; }

 private:
  size_t index(int layer, int kv_head, int f) const {
    return (size_t(layer) * size_t(kv_heads) + size_t(kv_head)) * formats.size() + size_t(f);
  }
};

/// Codebook levels fitted for one codebook format on rotated heads or unrotated ones.
struct codebook_fit {
  format_id format = 0;       ///< a codebook format (`cb<b>[/g<G>]`)
  bool rotated = false;       ///< fitted in the rotated space (for the heads a cache rotates)
  std::vector<float> levels;  ///< [layers][kv_heads][2][2^bits], K then V: `set_codebook_levels`'s layout
};

/// Contents of a calibration artifact.
struct KVQ_EXPORT artifact {
  /// The version this build writes and reads.
  static constexpr int current_version = 4;
  /// The oldest version this build reads (the same fields without `rotated` and `codebooks`).
  static constexpr int oldest_version = 1;

  int version = current_version;   ///< format version of the file
  std::string model_name;          ///< informational, may be empty
  model_shape shape;               ///< dimensions of the calibrated model
  std::string text_hash;           ///< hash of the calibration text (see `hash_text`)
  int64_t calibration_tokens = 0;  ///< tokens the measurement ran over
  /// K attention KL (`role::k`) and V output perturbation (`role::v`) per (layer, kv head,
  /// format); its `formats` are the artifact's formats.
  sensitivity_profile sensitivity;
  /// rolealign clip percentiles, [layers][kv_heads][2] (K then V): the layout of
  /// `KVCache::set_clip_percentiles` (all 100 for a file of version 1 to 3).
  std::vector<float> clip_percentiles;
  /// Optional (version 4): the clip percentiles chosen on rotated heads, same layout; empty
  /// when the file has none.
  std::vector<float> rotated_clip_percentiles;
  /// Optional output KL with one unit quantized at a time; `empty()` when the file has none.
  output_kl_table output_kl;
  /// Optional (version 2): the damage of each of `sensitivity.formats` on rotated heads, same
  /// layout; `formats` empty when the file has none.
  sensitivity_profile rotated_sensitivity;
  /// The rotation seed `rotated_sensitivity` was measured with (`rotation_config::seed`).
  uint64_t rotation_seed = rotation::default_seed;

  /// Optional (version 3): fitted codebook levels, at most one per (format, rotated).
  std::vector<codebook_fit> codebooks;

  /// True when the artifact holds rotated damages.
  bool has_rotated() const { return !rotated_sensitivity.formats.empty(); }

  /// The clip percentiles a cache gets (`KVCache::set_clip_percentiles`): for each (layer, kv
  /// head) those of its space, `rotated_clip_percentiles` where `rotated_heads` (empty: none,
  /// else [layers][kv_heads]) says so, 100 (no clipping) for a rotated head when the artifact has
  /// no rotated ones. Errors: `rotated_heads` of the wrong size.
  result<std::vector<float>> clip_percentiles_for(const std::vector<uint8_t>& rotated_heads) const;

  /// The fit of (format, rotated), or null.
  const codebook_fit* find_codebook(format_id f, bool rotated) const;
  /// The levels a cache gives codebook format `f` (`KVCache::set_codebook_levels`): for each
  /// (layer, kv head) the fit of its space, rotated where `rotated_head(layer, kv_head)` says
  /// so; a (layer, kv head) whose space has no fit keeps the Lloyd-Max levels. Errors: `f` not a
  /// codebook format, or no fit of `f` at all.
  result<std::vector<float>> codebook_levels_for(format_id f, const std::vector<uint8_t>& rotated_heads) const;

  /// Checks internal consistency (dimensions, numbers, ranges); the message names the field.
  status validate() const;
  /// Writes the JSON file (validating first; never writes NaN). Errors name the path.
  status save(const std::string& path) const;
  /// Serializes to the JSON text `save` writes.
  result<std::string> to_json() const;
  /// Reads and validates a file; `expected` is the model it will be used with, and a different
  /// shape is an error naming the first differing dimension.
  static result<artifact> load(const std::string& path, const model_shape& expected);
  /// Parses JSON text; `source` names it in messages (e.g. the path).
  static result<artifact> parse(std::string_view json, std::string_view source, const model_shape& expected);
  /// "fnv1a64:<16 hex digits>" of a text: the calibration-text hash this build writes.
  static std::string hash_text(std::string_view text);
};

}  // namespace calib
KVQ_NAMESPACE_END
