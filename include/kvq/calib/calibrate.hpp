#pragma once
/// \file
/// The calibrator: measures, from the queries, keys and values of real text, how much each
/// candidate format damages each (layer, kv head), and picks the `rolealign` clip percentiles.
/// Engine-agnostic: it sees only tensors, so any engine (or the model runner of tools/llama,
/// through `kvq-calibrate`) feeds it.
///
/// **What one `observe` measures.** A *chunk* is T consecutive tokens of one sequence starting at
/// position 0 of what the calibrator sees: queries attend causally to the chunk's own keys (query
/// t sees keys 0..t). For every kv head h, candidate format f and (for rolealign) clip percentile p:
///
/// - K̂ = K encoded and decoded by the codec exactly as the cache stores it: K rounded to fp16
///   (the FP16 window's precision), cut into pages of `page_tokens` tokens starting at token 0
///   (so kivi/rolealign token groups are aligned as in the cache), every unit of the page through
///   `codec::encode_unit` and back through `codec::decode_element`. Tokens after the last whole
///   page stay fp16, as a partial page does in the cache (it has not been encoded yet).
/// - K attention KL = mean over the query rows (token t, query head of h's GQA group) of
///   KL( softmax(s·q·K/√d) ‖ softmax(s·q·K̂/√d) ) over keys 0..t, in nats, where K is the fp16
///   reference (so `fp16` scores exactly 0). Computed as log(Σ_j P_j e^{u_j}) with u = δ − E_P[δ],
///   δ_j = s·q·(K̂_j − K_j)/√d, in double from e^u − 1 − u, which keeps the small KLs of 8-bit
///   formats (~1e-6) free of cancellation.
/// - V output perturbation = Σ_rows ‖P(V̂ − V)‖² / Σ_rows ‖P V‖², with P the reference attention
///   (fp16 K) of each query row and V̂ the V pages' codec round trip: a relative squared error of
///   the attention output, summed over every query row of every chunk before the ratio.
///
/// Both accumulate over all `observe` calls of a layer. `result` reports the means.
///
/// **Rotated candidates.** With `calibrator_options::rotated`, every candidate of `formats` is
/// also measured rotated (docs/architecture.md, "Rotation"): q, K and V of the head rotated by
/// the cache's randomized Hadamard transform of `rotation_seed`, K̂ and V̂ the codec round trip of
/// the rotated fp16 rows, the damage measured in the rotated space against the rotated fp16 rows
/// (where a rotated cache's window lives; the reference attention P is the unrotated one, equal
/// in exact arithmetic). The rolealign clip formats are measured rotated at every percentile of
/// the grid too, and the rotated percentiles are chosen on them (a rotated head's groups differ).
/// `result` puts them in `artifact::rotated_sensitivity` and `artifact::rotated_clip_percentiles`.
///
/// **Codebook levels.** With `calibrator_options::fit_codebooks`, every value of K and V (rotated
/// too, with `rotated`) is also counted, in units of its group's rms exactly as the codebook codec
/// computes it (v = x / fp16(rms)), into a histogram per (layer, kv head, role, channel group of
/// the codebook candidates), weighted by the squared scale: the squared error of a value is
/// s^2 (v - level)^2. `fitted_codebooks` runs Lloyd's iteration on each histogram from the
/// Lloyd-Max levels of a standard normal: for each codebook candidate, per (layer, kv head,
/// role), the levels of least weighted squared error (a unit with no nonzero group, or whose fit
/// would not be strictly ascending, keeps the Lloyd-Max levels). The candidates' damages are
/// measured with `calibrator_options::codebook_levels` (Lloyd-Max where none are given): a fit,
/// then a second run over the same text with the fit, gives the damage of the fitted levels
/// (kvq-calibrate --fit-codebooks does both).
///
/// **Clip percentiles.** The seed's rule, offline percentile clipping per role: keys chosen by
/// attention KL, values by output perturbation. For each (layer, kv head, role) the percentile is
/// the one of `clip_percentile_grid` that minimizes the mean over `clip_formats` of
/// damage(f, p) / damage(f, 100), K attention KL for K and V perturbation for V (a format whose
/// damage at 100 is 0 is left out; if all are, p is 100); ties go to the larger p (less
/// clipping). At encode time p clips each group to its own (100-p)-th..p-th percentiles
/// (format/kivi.hpp): K groups are one channel over G tokens, V groups one token over g
/// channels. rolealign candidates among `formats` are reported at the chosen percentile of their
/// (layer, head, role); rotated ones at the rotated choice.
///
/// Thread-safety: `observe` calls for *different layers* may run concurrently (each layer has its
/// own accumulators and each call its own scratch); calls for one layer must not overlap, and
/// `result` must not overlap any `observe`.

#include <cstdint>
#include <kvq/calib/artifact.hpp>
#include <kvq/config.hpp>
#include <kvq/format/format.hpp>
#include <kvq/policy/policy.hpp>
#include <kvq/policy/sensitivity.hpp>
#include <kvq/rotation/hadamard.hpp>
#include <kvq/status.hpp>
#include <kvq/tensor.hpp>
#include <string>
#include <string_view>
#include <vector>

KVQ_NAMESPACE_BEGIN
namespace calib {

/// The default candidates: kivi8/4/2 (g32), sym8/4 (g32), fp8.
KVQ_EXPORT std::vector<format_id> default_candidates();

/// What to measure.
struct calibrator_options {
  /// Candidate formats (the profile's and the artifact's format list), in this order.
  std::vector<format_id> formats = default_candidates();
  /// Clip percentiles tried for rolealign, each accepted by `clip_percentile_error`. At G = 32
  /// (position p/100 * 31 among the sorted values) 99.9 to 99.5 move the end 3 % to 15 % of the
  /// way from the extreme value to the next, 99 and 98 past half of it, 96 to the second value,
  /// 93 and 90 to the third and fourth; at G = 128 the same grid drops up to 13 values per end,
  /// within the 16 the encoder keeps. The steps are fine near 100 because the damage is: on
  /// SmolLM2 most units choose 99.6 to 99.9 and none below 99.5 (docs/quality.md).
  std::vector<float> clip_percentile_grid = {100.f, 99.9f, 99.8f, 99.7f, 99.6f, 99.5f, 99.f, 98.f, 96.f, 93.f, 90.f};
  /// rolealign formats whose damage chooses the clip percentile (see the file comment). Empty:
  /// the rolealign candidates of `formats`; if there are none either, every percentile is 100.
  std::vector<format_id> clip_formats = {format_id(find_format(family::rolealign, 4, 32)),
                                         format_id(find_format(family::rolealign, 2, 32))};
  float softmax_scale = 0.f;  ///< s·q·k; 0: 1/sqrt(head_dim), as the cache's default
  std::string model_name;     ///< recorded in the artifact (informational)
  /// Also measure every candidate rotated (see the file comment; head_dim a power of two).
  bool rotated = false;
  /// Seed of the rotation's signs: the `rotation_config::seed` of the caches it is for.
  uint64_t rotation_seed = rotation::default_seed;
  /// Count K and V for `fitted_codebooks` (see the file comment); needs a codebook candidate.
  bool fit_codebooks = false;
  /// The levels codebook candidates are measured with, at most one per (candidate, rotated);
  /// others: Lloyd-Max. `result` copies them into the artifact's `codebooks`.
  std::vector<codebook_fit> codebook_levels;
};

/// Accumulates sensitivities over calibration chunks; see the file comment.
class KVQ_EXPORT calibrator {
 public:
  /// Validates the shape (layers, heads, head_dim, page_tokens positive, q_heads a multiple of
  /// kv_heads) and the options (every format and clip format able to store pages of this shape,
  /// no duplicates, clip formats of the rolealign family, percentiles `clip_percentile_error`
  /// accepts). Errors name the field.
  static kvq::result<calibrator> create(const cache_shape& shape, calibrator_options opt = {});

  /// Measures one causal chunk of one layer.
  /// \param q [T][q_heads][head_dim] queries, after RoPE, f32/f16/bf16
  /// \param k [T][kv_heads][head_dim] keys, after RoPE, within fp16 range
  /// \param v [T][kv_heads][head_dim] values, within fp16 range
  /// Errors (nothing is accumulated then): layer out of range, heads, head_dim or token counts
  /// that differ from the shape or each other, T = 0, a null pointer (invalid_argument); NaN or
  /// Inf, naming tensor, token, head and channel (non_finite); K or V beyond fp16 range.
  status observe(int layer, const tensor_view& q, const tensor_view& k, const tensor_view& v);

  /// The measured profile (K attention KL and V perturbation per candidate). When `out` is given,
  /// also fills a complete artifact: shape, model name, `artifact::hash_text(calibration_text)`,
  /// tokens, profile and clip percentiles (rotated ones too with `rotated`). Errors: a layer that
  /// was never observed.
  kvq::result<sensitivity_profile> result(artifact* out = nullptr, std::string_view calibration_text = {}) const;

  /// The profile of the rotated candidates (`calibrator_options::rotated`), with the formats of
  /// `result`'s. Errors: rotation not measured, a layer never observed.
  kvq::result<sensitivity_profile> rotated_result() const;

  /// The codebook levels fitted to what was observed (`calibrator_options::fit_codebooks`): one
  /// entry per codebook candidate, unrotated, then the rotated ones with `rotated`. Errors:
  /// fitting was not asked for, a layer never observed.
  kvq::result<std::vector<codebook_fit>> fitted_codebooks() const;

  /// Chosen clip percentiles, [layers][kv_heads][2] (K then V): the layout of
  /// `KVCache::set_clip_percentiles`; of the rotated heads with `rotated` (100 everywhere when
  /// rotation was not measured). 100 where a layer has not been observed.
  std::vector<float> clip_percentiles(bool rotated = false) const;

  /// Mean damage of (layer, kv head, role) for format `f` at clip percentile `clip` (100 for every
  /// family but rolealign): K attention KL or V perturbation. Errors name a combination that was
  /// not measured (a format outside the candidates and clip formats, a percentile outside the
  /// grid) or a layer never observed.
  kvq::result<double> damage(int layer, int kv_head, role r, format_id f, float clip = 100.f,
                             bool rotated = false) const;

  /// Tokens observed in `layer` (sum of the chunks' T).
  int64_t tokens(int layer) const { return layer >= 0 && layer < shape_.layers ? tokens_[size_t(layer)] : 0; }
  /// The shape the calibrator measures.
  const cache_shape& shape() const { return shape_; }
  /// The options in use.
  const calibrator_options& options() const { return opt_; }

 private:
  // One codec configuration measured: a format at a clip percentile, rotated or not. rolealign
  // at 100 is stored as the kivi format of the same bits and group (the codec writes the same
  // bytes).
  struct variant {
    format_id f;
    float clip;
    bool rotated;
  };
  calibrator() = default;
  int variant_of(format_id f, float clip, bool rotated = false) const;
  kvq::result<sensitivity_profile> profile(bool rotated, const std::vector<float>& clips) const;
  float choose_clip(int layer, int kv_head, role r, bool rotated) const;
  double mean_damage(int layer, int kv_head, role r, int variant) const;

  cache_shape shape_{};
  calibrator_options opt_;
  float scale_ = 0.f;
  std::vector<variant> variants_;
  std::vector<format_id> objective_formats_;  // rolealign formats that choose the clip percentile
  std::vector<int64_t> tokens_;               // [layers]
  std::vector<double> rows_;                  // [layers][kv_heads] query rows measured
  std::vector<double> k_kl_;                  // [layers][kv_heads][variants] summed KL
  std::vector<double> v_err_;                 // [layers][kv_heads][variants] Σ‖P(V̂−V)‖²
  std::vector<double> v_ref_;                 // [layers][kv_heads] Σ‖PV‖²
  // Codebook fit: the channel groups of the codebook candidates, and per (layer, kv head, role,
  // group, rotated) a histogram of v = x / s: [.. ][fit_bins] Σ s² and Σ s² v.
  std::vector<int> fit_groups_;
  std::vector<double> fit_w_, fit_wv_;
  size_t fit_index(int layer, int kv_head, role r, size_t group, bool rotated) const;
  void count_for_fit(int layer, int kv_head, role r, const uint16_t* x16, int T, bool rotated);
  const float* levels_of(format_id f, bool rotated, int layer, int kv_head, role r) const;
};

}  // namespace calib
KVQ_NAMESPACE_END
