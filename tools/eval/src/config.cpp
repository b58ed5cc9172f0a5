#include <fmt/format.h>

#include <eval/config.hpp>
#include <kvq/cache/config_string.hpp>
#include <kvq/calib/artifact.hpp>
#include <kvq/policy/static_policy.hpp>

namespace kvq::eval {

namespace {
kvq::result<kvq::calib::artifact> load_artifact_file(const std::string& path, const kvq::cache_shape& shape) {
  return kvq::calib::artifact::load(path, {shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim});
}
}  // namespace


kvq::result<clip_percentile_tables> load_clip_percentiles(const std::string& path, const kvq::cache_shape& shape) {
  auto a = load_artifact_file(path, shape);
  if (!a) return a.error();
  return clip_percentile_tables{std::move(a->clip_percentiles), std::move(a->rotated_clip_percentiles)};
}

kvq::result<std::vector<kvq::calib::codebook_fit>> load_codebook_levels(const std::string& path,
                                                                        const kvq::cache_shape& shape) {
  auto a = load_artifact_file(path, shape);
  if (!a) return a.error();
  if (a->codebooks.empty())
    return kvq::status{kvq::errc::not_found,
                       fmt::format("artifact '{}' holds no codebook levels (kvq-calibrate --fit-codebooks)", path)};
  return std::move(a).value().codebooks;
}

namespace {
kvq::cache_shape with_paging(kvq::cache_shape shape, const cache_settings& s) {
  shape.page_tokens = s.page_tokens;
  shape.window = s.window;
  shape.recent = s.recent;
  return shape;
}
}  // namespace

kvq::cache_shape eval_shape(const kvq::llama::llama_model& model, const cache_settings& s) {
  return with_paging(model.cache_shape(), s);
}

uint64_t fp16_bytes(const kvq::cache_shape& shape, int64_t tokens) {
  return uint64_t(tokens) * uint64_t(shape.layers) * uint64_t(shape.kv_heads) * uint64_t(shape.head_dim) * 2u * 2u;
}

kvq::result<kvq::KVCache> make_eval_cache(const kvq::llama::llama_model& model, std::string_view config,
                                          const cache_settings& s) {
  return make_eval_cache(model.cache_shape(), config, s, model.attention_variants(), model.hparams().attn_scale);
}

namespace {

/// True when a policy spec names a rolealign format (`ra<b>`, alone or after '=', ',', ':' or ';').
bool names_rolealign(std::string_view spec) {
  for (size_t i = spec.find("ra"); i != std::string_view::npos; i = spec.find("ra", i + 1)) {
    const bool starts = i == 0 || std::string_view("=,:;").find(spec[i - 1]) != std::string_view::npos;
    if (starts && i + 2 < spec.size() && spec[i + 2] >= '0' && spec[i + 2] <= '9') return true;
  }
  return false;
}

}  // namespace

kvq::result<kvq::KVCache> make_eval_cache(const kvq::cache_shape& model_shape, std::string_view config,
                                          const cache_settings& s, const std::vector<kvq::attention_variant>& attention,
                                          float softmax_scale) {
  const kvq::cache_shape shape = with_paging(model_shape, s);
  auto suffixes = kvq::parse_cache_suffixes(config);
  if (!suffixes) return suffixes.error();
  const bool rotated = suffixes->rotated;
  const std::string_view spec = suffixes->spec;
  if (rotated && !s.clip_percentiles.empty() && s.rotated_clip_percentiles.empty() && names_rolealign(spec))
    return kvq::status{kvq::errc::invalid_argument,
                       fmt::format("configuration '{}': the artifact's clip percentiles were chosen on unrotated "
                                   "heads and it has no rotated ones (kvq-calibrate --rotated); run the rotated "
                                   "rolealign configuration without --clip-percentiles",
                                   config)};
  auto pol = make_policy(spec, shape, rotated);
  if (!pol) return pol.error();
  kvq::cache_config cfg;
  cfg.shape = shape;
  suffixes->apply(cfg);
  cfg.where = kvq::backend::cpu;
  cfg.attention = attention;
  cfg.softmax_scale = softmax_scale;
  cfg.budget_bytes = s.budget_bytes;
  if (cfg.budget_bytes == 0) {
    // Every token in FP16 (the largest format) rounded up to whole pages, plus the windows, twice
    // over for the 256-byte block alignment of small pages.
    const int64_t tokens = (s.max_tokens / s.page_tokens + 2) * s.page_tokens;
    const uint64_t window = uint64_t(shape.layers) * shape.kv_heads * 2u * uint64_t(s.window) * shape.head_dim * 2u;
    cfg.budget_bytes = 2 * (fp16_bytes(shape, tokens) + window) + (16u << 20);
  }
  auto cache = kvq::KVCache::create(cfg, std::move(pol).value());
  if (!cache)
    return kvq::status{cache.error().code(), fmt::format("configuration '{}': {}", config, cache.error().message())};
  if (!s.clip_percentiles.empty()) {
    kvq::calib::artifact clips;  // only its shape and clip percentiles are read
    clips.shape = {shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim};
    clips.clip_percentiles = s.clip_percentiles;
    clips.rotated_clip_percentiles = s.rotated_clip_percentiles;
    auto table = clips.clip_percentiles_for(cfg.rotation.heads);
    kvq::status st = table ? cache.value().set_clip_percentiles(*table) : table.error();
    if (!st.ok()) return kvq::status{st.code(), fmt::format("configuration '{}': {}", config, st.message())};
  }
  if (!s.codebooks.empty()) {
    kvq::calib::artifact fits;  // only its shape and codebooks are read
    fits.shape = {shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim};
    fits.codebooks = s.codebooks;
    for (const kvq::calib::codebook_fit& c : s.codebooks) {
      auto lv = fits.codebook_levels_for(c.format, cfg.rotation.heads);
      kvq::status st = lv ? cache.value().set_codebook_levels(c.format, *lv) : lv.error();
      if (!st.ok()) return kvq::status{st.code(), fmt::format("configuration '{}': {}", config, st.message())};
    }
  }
  return cache;
}

bool is_fp16_reference(std::string_view config) {
  std::string_view spec = config;
  if (spec.starts_with("static:")) spec.remove_prefix(7);
  auto p = kvq::static_policy::parse(spec);
  return p.ok() && p->name() == "static(fp16)";
}

}  // namespace kvq::eval
