#pragma once
/// \file
/// Cache configurations of kvq-eval: the string a user writes for one configuration, the policy
/// it names, and the cache built from it.
///
/// Grammar of a configuration: `<policy>:<params>` or a bare format spec.
/// - `static:<spec>`: `kvq::static_policy::parse` spec, e.g. `static:k=kivi4/g32,v=kivi2/g32;0=fp16`.
/// - a bare spec (no known `<policy>:` prefix) is the same as `static:<spec>`: `fp16`, `int8`,
///   `kivi4/g32`, `ra4/g32`, `fp8`, `k=sym8,v=kivi4/g32;0.1=fp16`.
///
/// Policies plug in by name through one table of the library (`kvq::policy_registry`,
/// kvq/policy/registry.hpp): an adaptive policy (autok, kl_budget, random, echokv) is one entry, a
/// name, a one-line help and a factory from its parameter string and the cache shape.

#include <cstdint>
#include <functional>
#include <kvq/cache/cache.hpp>
#include <kvq/calib/artifact.hpp>
#include <kvq/policy/policy.hpp>
#include <kvq/policy/registry.hpp>
#include <kvq/status.hpp>
#include <llama/model.hpp>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kvq::eval {

// The policies by name live in the library (kvq/policy/registry.hpp); kvq-eval's configuration
// strings are those, with the `+rot` / `+sink` suffixes.
using kvq::make_policy;
using kvq::policy_entry;
using kvq::policy_registry;
using kvq::policy_target;

/// Paging and budget of every cache kvq-eval creates.
struct cache_settings {
  int page_tokens = 64;       ///< tokens per page
  int window = 128;           ///< FP16 ring R (also the longest prefill chunk)
  int recent = 64;            ///< tokens kept unencoded r
  uint64_t budget_bytes = 0;  ///< 0: enough for `max_tokens` tokens in FP16, plus slack
  int64_t max_tokens = 0;     ///< the longest sequence a run will hold (sizes the automatic budget)
  /// rolealign clip percentiles set on every cache (`KVCache::set_clip_percentiles` layout,
  /// [layers][kv_heads][2], K then V) for its unrotated heads; other families ignore them.
  /// Empty: 100, no clipping (`ra<b>` stores what `kivi<b>` stores).
  std::vector<float> clip_percentiles;
  /// The same for rotated heads (the artifact's `rotated_clip_percentiles`). A rotated rolealign
  /// configuration with `clip_percentiles` but none of these is refused.
  std::vector<float> rotated_clip_percentiles;
  /// Fitted codebook levels set on every cache (`kvq::calib::artifact::codebooks`): each cache
  /// gives every fitted format the levels of its heads' space (`codebook_levels_for`). Empty:
  /// the Lloyd-Max levels.
  std::vector<kvq::calib::codebook_fit> codebooks;
};

/// The cache shape `model` needs with the paging of `s`.
kvq::cache_shape eval_shape(const kvq::llama::llama_model& model, const cache_settings& s);

/// Bytes an FP16 cache takes for `tokens` tokens of `shape` (K and V, no window): the yardstick
/// of the compression ratios.
uint64_t fp16_bytes(const kvq::cache_shape& shape, int64_t tokens);

/// The rolealign clip percentiles of a calibration artifact: unrotated, and rotated (empty when
/// the artifact has none).
struct clip_percentile_tables {
  std::vector<float> unrotated, rotated;
};

/// The rolealign clip percentiles of the calibration artifact at `path` (written by
/// kvq-calibrate), loaded and validated by `kvq::calib::artifact::load` for a model of `shape`:
/// a missing or malformed file, or one measured on another model shape, is an error naming the
/// file and the field (an artifact of version 1-3 gives 100 everywhere: no clipping).
kvq::result<clip_percentile_tables> load_clip_percentiles(const std::string& path, const kvq::cache_shape& shape);

/// The fitted codebook levels of the calibration artifact at `path` (kvq-calibrate
/// --fit-codebooks), loaded and validated as for `load_clip_percentiles`; an artifact without any is
/// an error.
kvq::result<std::vector<kvq::calib::codebook_fit>> load_codebook_levels(const std::string& path,
                                                                        const kvq::cache_shape& shape);

/// A CPU cache for `model` under the policy of configuration `config`, attending as the model
/// does (its per-layer `attention_variants()`, e.g. Gemma 3's sliding windows, and its softmax
/// scale). Errors name the configuration (e.g. "configuration 'kivi4/g32': ... head_dim 8 ...").
/// The cache gets `s.clip_percentiles` (those of its heads' space) and `s.codebooks` when there
/// are any.
kvq::result<kvq::KVCache> make_eval_cache(const kvq::llama::llama_model& model, std::string_view config,
                                          const cache_settings& s);
/// The same for a model of `model_shape` (its paging fields are ignored: `s` gives them), with
/// `attention` as `cache_config::attention` (empty: every layer plain) and `softmax_scale` (0:
/// 1/sqrt(head_dim)).
kvq::result<kvq::KVCache> make_eval_cache(const kvq::cache_shape& model_shape, std::string_view config,
                                          const cache_settings& s,
                                          const std::vector<kvq::attention_variant>& attention = {},
                                          float softmax_scale = 0.f);

/// True when `config` names the plain FP16 cache (`fp16`, `static:fp16`, `k=fp16,v=fp16`): such a
/// configuration serves as the reference instead of running a second FP16 cache.
bool is_fp16_reference(std::string_view config);

}  // namespace kvq::eval
