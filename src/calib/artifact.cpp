// The calibration artifact: JSON writing, and reading with a validation that names the file and
// the field of every problem. nlohmann-json stays inside this file (kvq's headers do not need it).
#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <fstream>
#include <kvq/cache/cache.hpp>
#include <kvq/calib/artifact.hpp>
#include <kvq/codec/codec.hpp>
#include <limits>
#include <new>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

KVQ_NAMESPACE_BEGIN
namespace calib {

namespace {

using json = nlohmann::json;
constexpr const char* artifact_kind = "kvq.calibration";

// Builds errors "artifact '<source>': <field>: <what>".
struct reader {
  std::string_view source;

  status fail(std::string_view field, std::string_view what) const {
    return {errc::invalid_argument, fmt::format("artifact '{}': field '{}' {}", source, field, what)};
  }

  static std::string type_of(const json& j) { return j.type_name(); }

  // The member `key` of object `j` (at `path`), or an error naming the missing field.
  result<const json*> member(const json& j, std::string_view path, const char* key) const {
    const std::string field = path.empty() ? std::string(key) : fmt::format("{}.{}", path, key);
    if (!j.is_object()) return fail(path, fmt::format("must be an object, is {}", type_of(j)));
    const auto it = j.find(key);
    if (it == j.end()) return fail(field, "is missing");
    return &*it;
  }

  result<double> number(const json& j, std::string_view field) const {
    if (j.is_null()) return fail(field, "is null (NaN and Inf are not allowed)");
    if (!j.is_number()) return fail(field, fmt::format("must be a number, is {} {}", type_of(j), j.dump()));
    const double x = j.get<double>();
    if (!std::isfinite(x)) return fail(field, "is not finite");
    return x;
  }

  result<int64_t> integer(const json& j, std::string_view field, int64_t min, int64_t max) const {
    if (!j.is_number_integer()) return fail(field, fmt::format("must be an integer, is {} {}", type_of(j), j.dump()));
    const int64_t v = j.is_number_unsigned() && j.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max())
                          ? std::numeric_limits<int64_t>::max()
                          : j.get<int64_t>();
    if (v < min || v > max) return fail(field, fmt::format("is {}, must be in [{}, {}]", v, min, max));
    return v;
  }

  result<std::string> string(const json& j, std::string_view field) const {
    if (!j.is_string()) return fail(field, fmt::format("must be a string, is {}", type_of(j)));
    return j.get<std::string>();
  }

  // An array of exactly `n` entries; `what` names the expected length in the message.
  status array_of(const json& j, std::string_view field, size_t n, std::string_view what) const {
    if (!j.is_array()) return fail(field, fmt::format("must be an array, is {}", type_of(j)));
    if (j.size() != n) return fail(field, fmt::format("has {} entries, needs {} ({})", j.size(), n, what));
    return {};
  }

  // A [layers][kv_heads][n] array `j` (field `base`) of finite numbers >= 0 (any sign where
  // `signed_values`), each handed to `put(l, h, f, x)`; `what` names the innermost length.
  template <class Put>
  status grid(const json& j, const std::string& base, int layers, int kv_heads, size_t n, std::string_view what,
              Put&& put, bool signed_values = false) const {
    KVQ_TRY(array_of(j, base, size_t(layers), "model.layers"));
    for (int l = 0; l < layers; ++l) {
      const json& heads = j[size_t(l)];
      KVQ_TRY(array_of(heads, fmt::format("{}[{}]", base, l), size_t(kv_heads), "model.kv_heads"));
      for (int h = 0; h < kv_heads; ++h) {
        const json& vals = heads[size_t(h)];
        KVQ_TRY(array_of(vals, fmt::format("{}[{}][{}]", base, l, h), n, what));
        for (size_t f = 0; f < n; ++f) {
          const std::string field = fmt::format("{}[{}][{}][{}]", base, l, h, f);
          auto x = number(vals[f], field);
          if (!x) return x.error();
          if (*x < 0.0 && !signed_values) return fail(field, fmt::format("is {}, must be >= 0", *x));
          put(l, h, f, *x);
        }
      }
    }
    return {};
  }
};

#define KVQ_ASSIGN(var, expr)           \
  auto var##_r = (expr);                \
  if (!var##_r) return var##_r.error(); \
  auto var = std::move(var##_r).value()

// The double nearest to the shortest decimal that reads back as `x`: clip percentiles are floats, and
// 0.9f written as a double would print as 0.8999999761581421. Locale-independent.
double float_as_decimal(float x) {
  const std::string s = fmt::format("{}", x);
  double d = double(x);
  std::from_chars(s.data(), s.data() + s.size(), d);
  return d;
}

// A [layers][kv_heads][n] JSON array of get(l, h, f).
template <class Get>
nlohmann::ordered_json grid_json(int layers, int kv_heads, size_t n, Get&& get) {
  using ojson = nlohmann::ordered_json;
  ojson out = ojson::array();
  for (int l = 0; l < layers; ++l) {
    ojson heads = ojson::array();
    for (int h = 0; h < kv_heads; ++h) {
      ojson vals = ojson::array();
      for (size_t f = 0; f < n; ++f) vals.push_back(get(l, h, f));
      heads.push_back(vals);
    }
    out.push_back(heads);
  }
  return out;
}

}  // namespace

std::string artifact::hash_text(std::string_view text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return fmt::format("fnv1a64:{:016x}", h);
}

status artifact::validate() const {
  const auto bad = [](std::string m) { return status{errc::invalid_argument, "artifact: " + std::move(m)}; };
  if (version < oldest_version || version > current_version)
    return bad(
        fmt::format("version {}, this build writes versions {} to {}", version, oldest_version, current_version));
  if (shape.layers <= 0 || shape.q_heads <= 0 || shape.kv_heads <= 0 || shape.head_dim <= 0)
    return bad(fmt::format("model shape {} layers, {} q heads, {} kv heads, head_dim {} must be positive", shape.layers,
                           shape.q_heads, shape.kv_heads, shape.head_dim));
  if (shape.q_heads % shape.kv_heads != 0)
    return bad(fmt::format("q_heads {} is not a multiple of kv_heads {}", shape.q_heads, shape.kv_heads));
  if (text_hash.empty()) return bad("text_hash is empty");
  if (calibration_tokens < 0) return bad(fmt::format("calibration_tokens {} is negative", calibration_tokens));
  if (sensitivity.layers != shape.layers || sensitivity.kv_heads != shape.kv_heads)
    return bad(fmt::format("sensitivity covers {} layers x {} kv heads, the model has {} x {}", sensitivity.layers,
                           sensitivity.kv_heads, shape.layers, shape.kv_heads));
  if (status s = sensitivity.validate(); !s.ok()) return bad(s.message());
  const size_t nclip = size_t(shape.layers) * size_t(shape.kv_heads) * 2;
  for (const bool rot : {false, true}) {
    const std::vector<float>& table = rot ? rotated_clip_percentiles : clip_percentiles;
    const char* name = rot ? "rotated clip percentiles" : "clip percentiles";
    if (rot && table.empty()) continue;
    if (rot && version < 4)
      return bad(fmt::format("rotated clip percentiles need version 4, the artifact is version {}", version));
    if (table.size() != nclip)
      return bad(fmt::format("{} {}, the model needs {} (layers x kv heads x 2)", table.size(), name, nclip));
    for (size_t i = 0; i < nclip; ++i) {
      const std::string e = clip_percentile_error(table[i]);
      const char* hole = !e.empty() ? e.c_str() : version < 4 && table[i] != 100.f ? "needs version 4" : nullptr;
      if (hole)
        return bad(fmt::format("{}: layer {} head {} {}: {}", name, i / 2 / size_t(shape.kv_heads),
                               (i / 2) % size_t(shape.kv_heads), i % 2 ? "V" : "K", hole));
    }
  }
  if (!output_kl.empty()) {
    const output_kl_table& o = output_kl;
    if (o.layers != shape.layers || o.kv_heads != shape.kv_heads)
      return bad(fmt::format("output_kl covers {} layers x {} kv heads, the model has {} x {}", o.layers, o.kv_heads,
                             shape.layers, shape.kv_heads));
    for (size_t i = 0; i < o.formats.size(); ++i) {
      if (sensitivity.format_index(o.formats[i]) < 0)
        return bad(fmt::format("output_kl format {} is not one of the artifact's formats", format_name(o.formats[i])));
      for (size_t k = 0; k < i; ++k)
        if (o.formats[k] == o.formats[i])
          return bad(fmt::format("output_kl format {} appears twice", format_name(o.formats[i])));
    }
    if (o.tokens < 1) return bad(fmt::format("output_kl tokens {} must be >= 1", o.tokens));
    const size_t n = size_t(shape.layers) * size_t(shape.kv_heads) * o.formats.size();
    if (o.kl.size() != n)
      return bad(fmt::format("{} output_kl values, needs {} (layers x kv heads x output_kl formats)", o.kl.size(), n));
    for (size_t i = 0; i < n; ++i)
      if (!(std::isfinite(o.kl[i]) && o.kl[i] >= 0.0))
        return bad(fmt::format("output_kl of layer {} head {} format {} is {}; must be finite and >= 0",
                               i / o.formats.size() / size_t(shape.kv_heads),
                               (i / o.formats.size()) % size_t(shape.kv_heads),
                               format_name(o.formats[i % o.formats.size()]), o.kl[i]));
  }
  if (has_rotated()) {
    if (version < 2) return bad(fmt::format("rotated damages need version 2, the artifact is version {}", version));
    if (rotated_sensitivity.layers != shape.layers || rotated_sensitivity.kv_heads != shape.kv_heads ||
        rotated_sensitivity.formats != sensitivity.formats)
      return bad("rotated sensitivity must cover the same layers, kv heads and formats as sensitivity");
    if (status s = rotated_sensitivity.validate(); !s.ok()) return bad("rotated: " + s.message());
  }
  if (!codebooks.empty() && version < 3)
    return bad(fmt::format("codebook levels need version 3, the artifact is version {}", version));
  for (size_t i = 0; i < codebooks.size(); ++i) {
    const codebook_fit& c = codebooks[i];
    if (!codec::is_codebook_format(c.format))
      return bad(fmt::format("codebooks[{}]: format {} is not a codebook format", i,
                             c.format < format_count ? format_name(c.format) : std::to_string(int(c.format))));
    for (size_t k = 0; k < i; ++k)
      if (codebooks[k].format == c.format && codebooks[k].rotated == c.rotated)
        return bad(fmt::format("codebooks[{}] repeats codebooks[{}] ({}{})", i, k, format_name(c.format),
                               c.rotated ? ", rotated" : ""));
    const size_t units = size_t(shape.layers) * size_t(shape.kv_heads) * 2;
    if (status s = check_codebook_table(c.levels, traits_of(c.format).bits, units, shape.kv_heads,
                                        fmt::format("codebooks[{}] ({})", i, format_name(c.format)),
                                        [&](int l, int h, bool v) {
                                          return fmt::format("codebooks[{}].{}[{}][{}]", i, v ? "v" : "k", l, h);
                                        });
        !s.ok())
      return bad(s.message());
  }
  return {};
}

result<std::vector<float>> artifact::clip_percentiles_for(const std::vector<uint8_t>& rotated_heads) const {
  const size_t units = size_t(shape.layers) * size_t(shape.kv_heads);
  if (!rotated_heads.empty() && rotated_heads.size() != units)
    return status{errc::invalid_argument,
                  fmt::format("artifact: {} rotated-head flags, the model has {} (layers x kv heads)",
                              rotated_heads.size(), units)};
  std::vector<float> out = clip_percentiles;
  for (size_t u = 0; u < units && !rotated_heads.empty(); ++u)
    if (rotated_heads[u])
      for (size_t r = 0; r < 2; ++r)
        out[u * 2 + r] = rotated_clip_percentiles.empty() ? codec::no_clip : rotated_clip_percentiles[u * 2 + r];
  return out;
}

const codebook_fit* artifact::find_codebook(format_id f, bool rotated) const {
  for (const codebook_fit& c : codebooks)
    if (c.format == f && c.rotated == rotated) return &c;
  return nullptr;
}

result<std::vector<float>> artifact::codebook_levels_for(format_id f, const std::vector<uint8_t>& rotated_heads) const {
  const std::string name = f < format_count ? format_name(f) : std::to_string(int(f));
  if (!codec::is_codebook_format(f))
    return status{errc::invalid_argument, fmt::format("artifact: {} is not a codebook format", name)};
  const codebook_fit* fits[2] = {find_codebook(f, false), find_codebook(f, true)};
  if (!fits[0] && !fits[1]) return status{errc::not_found, fmt::format("artifact: no codebook levels of {}", name)};
  const size_t units = size_t(shape.layers) * size_t(shape.kv_heads);
  if (!rotated_heads.empty() && rotated_heads.size() != units)
    return status{errc::invalid_argument,
                  fmt::format("artifact: {} rotated-head flags, the model has {} (layers x kv heads)",
                              rotated_heads.size(), units)};
  const int bits = traits_of(f).bits, n = 1 << bits;
  std::vector<float> out(units * 2 * size_t(n));
  for (size_t u = 0; u < units * 2; ++u) {
    const codebook_fit* fit = fits[!rotated_heads.empty() && rotated_heads[u / 2] ? 1 : 0];
    for (int k = 0; k < n; ++k)
      out[u * size_t(n) + size_t(k)] = fit ? fit->levels[u * size_t(n) + size_t(k)] : lloyd_max_level(bits, k);
  }
  return out;
}

result<std::string> artifact::to_json() const {
  KVQ_TRY(validate());
  using ojson = nlohmann::ordered_json;  // keeps the documented field order
  ojson j;
  j["kind"] = artifact_kind;
  j["version"] = version;
  j["model"] = {{"name", model_name},
                {"layers", shape.layers},
                {"q_heads", shape.q_heads},
                {"kv_heads", shape.kv_heads},
                {"head_dim", shape.head_dim}};
  j["calibration"] = {{"text_hash", text_hash}, {"tokens", calibration_tokens}};
  ojson formats = ojson::array();
  for (format_id f : sensitivity.formats) formats.push_back(format_name(f));
  j["formats"] = formats;
  for (role r : {role::k, role::v}) {
    j["sensitivity"][r == role::k ? "k_attention_kl" : "v_output_perturbation"] =
        grid_json(shape.layers, shape.kv_heads, sensitivity.formats.size(),
                  [&](int l, int h, size_t f) { return sensitivity.at(l, h, r, int(f)); });
  }
  // the clip percentiles (version 4), or an older version's clip ratios: all 1, as validated
  for (const bool rot : {false, true}) {
    const std::vector<float>& table = rot ? rotated_clip_percentiles : clip_percentiles;
    if (rot && table.empty()) continue;
    const char* key = version < 4 ? "clip_ratios" : rot ? "rotated_clip_percentiles" : "clip_percentiles";
    for (role r : {role::k, role::v}) {
      ojson clips = ojson::array();
      for (int l = 0; l < shape.layers; ++l) {
        ojson heads = ojson::array();
        for (int h = 0; h < shape.kv_heads; ++h)
          heads.push_back(version < 4
                              ? 1.0
                              : float_as_decimal(table[(size_t(l) * shape.kv_heads + h) * 2 + (r == role::k ? 0 : 1)]));
        clips.push_back(heads);
      }
      j[key][r == role::k ? "k" : "v"] = clips;
    }
  }
  if (!output_kl.empty()) {
    ojson fmts = ojson::array();
    for (format_id f : output_kl.formats) fmts.push_back(format_name(f));
    j["output_kl"] = {{"formats", fmts},
                      {"tokens", output_kl.tokens},
                      {"kl", grid_json(shape.layers, shape.kv_heads, output_kl.formats.size(),
                                       [&](int l, int h, size_t f) { return output_kl.at(l, h, int(f)); })}};
  }
  if (has_rotated()) {
    j["rotated"]["seed"] = fmt::format("0x{:016x}", rotation_seed);
    for (role r : {role::k, role::v})
      j["rotated"][r == role::k ? "k_attention_kl" : "v_output_perturbation"] =
          grid_json(shape.layers, shape.kv_heads, sensitivity.formats.size(),
                    [&](int l, int h, size_t f) { return rotated_sensitivity.at(l, h, r, int(f)); });
  }
  if (!codebooks.empty()) {
    ojson list = ojson::array();
    for (const codebook_fit& c : codebooks) {
      const size_t n = size_t(1) << traits_of(c.format).bits;
      ojson e = {{"format", format_name(c.format)}, {"rotated", c.rotated}};
      for (role r : {role::k, role::v})
        e[r == role::k ? "k" : "v"] = grid_json(shape.layers, shape.kv_heads, n, [&](int l, int h, size_t k) {
          return float_as_decimal(c.levels[((size_t(l) * shape.kv_heads + h) * 2 + (r == role::k ? 0 : 1)) * n + k]);
        });
      list.push_back(e);
    }
    j["codebooks"] = list;
  }
  return j.dump(1);
}

status artifact::save(const std::string& path) const {
  auto text = to_json();
  if (!text) return {text.error().code(), fmt::format("saving '{}': {}", path, text.error().message())};
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return {errc::io_error, fmt::format("artifact '{}': cannot open for writing", path)};
  f << *text << '\n';
  f.close();
  if (!f) return {errc::io_error, fmt::format("artifact '{}': write failed", path)};
  return {};
}

result<artifact> artifact::load(const std::string& path, const model_shape& expected) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return status{errc::io_error, fmt::format("artifact '{}': cannot open for reading", path)};
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) return status{errc::io_error, fmt::format("artifact '{}': read failed", path)};
  return parse(ss.str(), path, expected);
}

namespace {

// The artifact in the parsed document `j`, validated field by field.
result<artifact> read_artifact(const json& j, std::string_view source, const model_shape& expected) {
  const reader rd{source};
  if (!j.is_object()) return rd.fail("<root>", fmt::format("must be an object, is {}", j.type_name()));

  artifact a;
  {
    KVQ_ASSIGN(kind, rd.member(j, "", "kind"));
    KVQ_ASSIGN(kind_s, rd.string(*kind, "kind"));
    if (kind_s != artifact_kind) return rd.fail("kind", fmt::format("is '{}', expected '{}'", kind_s, artifact_kind));
    KVQ_ASSIGN(ver, rd.member(j, "", "version"));
    KVQ_ASSIGN(v, rd.integer(*ver, "version", std::numeric_limits<int>::min(), std::numeric_limits<int>::max()));
    if (v < artifact::oldest_version || v > artifact::current_version)
      return rd.fail("version", fmt::format("is {}, this build reads versions {} to {}", v, artifact::oldest_version,
                                            artifact::current_version));
    a.version = int(v);
  }
  {
    KVQ_ASSIGN(model, rd.member(j, "", "model"));
    if (model->contains("name")) {
      KVQ_ASSIGN(name, rd.string((*model)["name"], "model.name"));
      a.model_name = name;
    }
    const auto dim = [&](const char* key, int& out) -> status {
      const std::string field = fmt::format("model.{}", key);
      KVQ_ASSIGN(m, rd.member(*model, "model", key));
      KVQ_ASSIGN(v, rd.integer(*m, field, 1, 1 << 20));
      out = int(v);
      return {};
    };
    KVQ_TRY(dim("layers", a.shape.layers));
    KVQ_TRY(dim("q_heads", a.shape.q_heads));
    KVQ_TRY(dim("kv_heads", a.shape.kv_heads));
    KVQ_TRY(dim("head_dim", a.shape.head_dim));
    const std::pair<const char*, int> mine[] = {{"layers", a.shape.layers},
                                                {"q_heads", a.shape.q_heads},
                                                {"kv_heads", a.shape.kv_heads},
                                                {"head_dim", a.shape.head_dim}};
    const int theirs[] = {expected.layers, expected.q_heads, expected.kv_heads, expected.head_dim};
    for (int i = 0; i < 4; ++i)
      if (mine[i].second != theirs[i])
        return rd.fail(fmt::format("model.{}", mine[i].first),
                       fmt::format("is {}, the model it is loaded for has {} (artifact of another model?)",
                                   mine[i].second, theirs[i]));
  }
  {
    KVQ_ASSIGN(cal, rd.member(j, "", "calibration"));
    KVQ_ASSIGN(hash, rd.member(*cal, "calibration", "text_hash"));
    KVQ_ASSIGN(hash_s, rd.string(*hash, "calibration.text_hash"));
    if (hash_s.empty()) return rd.fail("calibration.text_hash", "is empty");
    a.text_hash = hash_s;
    KVQ_ASSIGN(tok, rd.member(*cal, "calibration", "tokens"));
    KVQ_ASSIGN(tok_v, rd.integer(*tok, "calibration.tokens", 0, std::numeric_limits<int64_t>::max()));
    a.calibration_tokens = tok_v;
  }
  std::vector<format_id> formats;
  {
    KVQ_ASSIGN(fm, rd.member(j, "", "formats"));
    if (!fm->is_array() || fm->empty()) return rd.fail("formats", "must be a non-empty array of format specs");
    for (size_t i = 0; i < fm->size(); ++i) {
      const std::string field = fmt::format("formats[{}]", i);
      KVQ_ASSIGN(spec, rd.string((*fm)[i], field));
      auto f = parse_format(spec);
      if (!f) return rd.fail(field, f.error().message());
      for (size_t k = 0; k < formats.size(); ++k)
        if (formats[k] == *f) return rd.fail(field, fmt::format("repeats formats[{}] ({})", k, spec));
      formats.push_back(*f);
    }
  }
  const int L = a.shape.layers, H = a.shape.kv_heads;
  auto prof = sensitivity_profile::make(L, H, formats);
  if (!prof) return rd.fail("formats", prof.error().message());
  a.sensitivity = std::move(prof).value();
  {
    KVQ_ASSIGN(sens, rd.member(j, "", "sensitivity"));
    for (role r : {role::k, role::v}) {
      const char* key = r == role::k ? "k_attention_kl" : "v_output_perturbation";
      const std::string base = fmt::format("sensitivity.{}", key);
      KVQ_ASSIGN(arr, rd.member(*sens, "sensitivity", key));
      KVQ_TRY(rd.grid(*arr, base, L, H, formats.size(), "one per format",
                      [&](int l, int h, size_t f, double x) { a.sensitivity.at(l, h, r, int(f)) = x; }));
    }
  }
  // clip_percentiles (version 4; rotated_clip_percentiles optional), or clip_ratios (1 to 3): a
  // ratio is not a percentile, so those are checked and read as percentile 100 (no clipping)
  a.clip_percentiles.assign(size_t(L) * H * 2, codec::no_clip);
  for (const bool rot : {false, true}) {
    const bool v4 = a.version >= 4;
    const char* key = !v4 ? "clip_ratios" : rot ? "rotated_clip_percentiles" : "clip_percentiles";
    if (rot && !j.contains(key)) continue;
    if (rot && !v4) break;
    KVQ_ASSIGN(clips, rd.member(j, "", key));
    std::vector<float>& table = rot ? a.rotated_clip_percentiles : a.clip_percentiles;
    table.assign(size_t(L) * H * 2, codec::no_clip);
    for (role r : {role::k, role::v}) {
      const char* rk = r == role::k ? "k" : "v";
      const std::string base = fmt::format("{}.{}", key, rk);
      KVQ_ASSIGN(arr, rd.member(*clips, key, rk));
      KVQ_TRY(rd.array_of(*arr, base, size_t(L), "model.layers"));
      for (int l = 0; l < L; ++l) {
        const json& heads = (*arr)[size_t(l)];
        KVQ_TRY(rd.array_of(heads, fmt::format("{}[{}]", base, l), size_t(H), "model.kv_heads"));
        for (int h = 0; h < H; ++h) {
          const std::string field = fmt::format("{}[{}][{}]", base, l, h);
          KVQ_ASSIGN(x, rd.number(heads[size_t(h)], field));
          if (!v4) {
            if (!(x > 0.0 && x <= 1.0)) return rd.fail(field, fmt::format("is {}, must be in (0, 1]", x));
            continue;  // read as percentile 100
          }
          if (const std::string e = clip_percentile_error(float(x)); !e.empty())
            return rd.fail(field, fmt::format("(layer {}, head {}, {}): {}", l, h, r == role::k ? "K" : "V", e));
          table[(size_t(l) * H + h) * 2 + (r == role::k ? 0 : 1)] = float(x);
        }
      }
    }
  }
  if (a.version < 4 && j.contains("clip_percentiles"))
    return rd.fail("clip_percentiles", fmt::format("needs version 4, the file is version {}", a.version));
  if (a.version < 4 && j.contains("rotated_clip_percentiles"))
    return rd.fail("rotated_clip_percentiles", fmt::format("needs version 4, the file is version {}", a.version));
  if (a.version >= 4 && j.contains("clip_ratios"))
    return rd.fail("clip_ratios", "is version 3's; version 4 has clip_percentiles instead");
  if (j.contains("output_kl")) {  // optional
    const json& o = j["output_kl"];
    if (!o.is_object()) return rd.fail("output_kl", fmt::format("must be an object, is {}", o.type_name()));
    KVQ_ASSIGN(fm, rd.member(o, "output_kl", "formats"));
    if (!fm->is_array() || fm->empty())
      return rd.fail("output_kl.formats", "must be a non-empty array of format specs");
    std::vector<format_id> okl;
    for (size_t i = 0; i < fm->size(); ++i) {
      const std::string field = fmt::format("output_kl.formats[{}]", i);
      KVQ_ASSIGN(spec, rd.string((*fm)[i], field));
      auto f = parse_format(spec);
      if (!f) return rd.fail(field, f.error().message());
      if (a.sensitivity.format_index(*f) < 0) return rd.fail(field, fmt::format("'{}' is not one of 'formats'", spec));
      for (size_t k = 0; k < okl.size(); ++k)
        if (okl[k] == *f) return rd.fail(field, fmt::format("repeats output_kl.formats[{}] ({})", k, spec));
      okl.push_back(*f);
    }
    KVQ_ASSIGN(tok, rd.member(o, "output_kl", "tokens"));
    KVQ_ASSIGN(tok_v, rd.integer(*tok, "output_kl.tokens", 1, std::numeric_limits<int64_t>::max()));
    a.output_kl = output_kl_table::make(L, H, std::move(okl), tok_v);
    KVQ_ASSIGN(kl, rd.member(o, "output_kl", "kl"));
    KVQ_TRY(rd.grid(*kl, "output_kl.kl", L, H, a.output_kl.formats.size(), "one per output_kl format",
                    [&](int l, int h, size_t f, double x) { a.output_kl.at(l, h, int(f)) = x; }));
  }
  if (j.contains("rotated")) {  // optional, version 2
    const json& o = j["rotated"];
    if (a.version < 2) return rd.fail("rotated", fmt::format("needs version 2, the file is version {}", a.version));
    if (!o.is_object()) return rd.fail("rotated", fmt::format("must be an object, is {}", o.type_name()));
    KVQ_ASSIGN(seed, rd.member(o, "rotated", "seed"));
    KVQ_ASSIGN(seed_s, rd.string(*seed, "rotated.seed"));
    uint64_t sv = 0;
    const char* b = seed_s.data() + (seed_s.starts_with("0x") ? 2 : 0);
    const auto [end, ec] = std::from_chars(b, seed_s.data() + seed_s.size(), sv, 16);
    if (!seed_s.starts_with("0x") || ec != std::errc() || end != seed_s.data() + seed_s.size())
      return rd.fail("rotated.seed", fmt::format("is '{}', must be 0x and up to 16 hex digits", seed_s));
    a.rotation_seed = sv;
    auto rp = sensitivity_profile::make(L, H, formats);
    if (!rp) return rd.fail("rotated", rp.error().message());
    a.rotated_sensitivity = std::move(rp).value();
    for (role r : {role::k, role::v}) {
      const char* key = r == role::k ? "k_attention_kl" : "v_output_perturbation";
      KVQ_ASSIGN(arr, rd.member(o, "rotated", key));
      KVQ_TRY(rd.grid(*arr, fmt::format("rotated.{}", key), L, H, formats.size(), "one per format",
                      [&](int l, int h, size_t f, double x) { a.rotated_sensitivity.at(l, h, r, int(f)) = x; }));
    }
  }
  if (j.contains("codebooks")) {  // optional, version 3
    const json& o = j["codebooks"];
    if (a.version < 3) return rd.fail("codebooks", fmt::format("needs version 3, the file is version {}", a.version));
    if (!o.is_array()) return rd.fail("codebooks", fmt::format("must be an array, is {}", o.type_name()));
    for (size_t i = 0; i < o.size(); ++i) {
      const std::string base = fmt::format("codebooks[{}]", i);
      const json& e = o[i];
      if (!e.is_object()) return rd.fail(base, fmt::format("must be an object, is {}", e.type_name()));
      KVQ_ASSIGN(fm, rd.member(e, base, "format"));
      KVQ_ASSIGN(spec, rd.string(*fm, base + ".format"));
      auto f = parse_format(spec);
      if (!f) return rd.fail(base + ".format", f.error().message());
      if (!codec::is_codebook_format(*f))
        return rd.fail(base + ".format", fmt::format("'{}' is not a codebook format", spec));
      KVQ_ASSIGN(rot, rd.member(e, base, "rotated"));
      if (!rot->is_boolean())
        return rd.fail(base + ".rotated", fmt::format("must be true or false, is {}", rot->dump()));
      codebook_fit c{*f, rot->get<bool>(), {}};
      const size_t n = size_t(1) << traits_of(*f).bits;
      c.levels.assign(size_t(L) * H * 2 * n, 0.f);
      for (role r : {role::k, role::v}) {
        const char* key = r == role::k ? "k" : "v";
        KVQ_ASSIGN(arr, rd.member(e, base, key));
        KVQ_TRY(rd.grid(
            *arr, fmt::format("{}.{}", base, key), L, H, n, "2^bits levels",
            [&](int l, int h, size_t k, double x) {
              c.levels[((size_t(l) * H + h) * 2 + (r == role::k ? 0 : 1)) * n + k] = float(x);
            },
            true));
      }
      a.codebooks.push_back(std::move(c));
    }
  }
  if (status s = a.validate(); !s.ok()) return status{s.code(), fmt::format("artifact '{}': {}", source, s.message())};
  return a;
}

}  // namespace

result<artifact> artifact::parse(std::string_view text, std::string_view source, const model_shape& expected) {
  // Every exception of the JSON library becomes a status naming the source: parse errors, numbers
  // out of range (1e400), and any type or access error the field checks above might have missed.
  json j;
  try {
    j = json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    return status{errc::invalid_argument,
                  fmt::format("artifact '{}': malformed JSON at byte {}: {} (NaN and Inf are not JSON numbers)", source,
                              e.byte, e.what())};
  } catch (const json::exception& e) {
    return status{errc::invalid_argument, fmt::format("artifact '{}': malformed JSON: {}", source, e.what())};
  } catch (const std::bad_alloc&) {
    return status{errc::out_of_budget,
                  fmt::format("artifact '{}': out of memory parsing {} bytes of JSON", source, text.size())};
  }
  try {
    return read_artifact(j, source, expected);
  } catch (const json::exception& e) {
    return status{errc::invalid_argument, fmt::format("artifact '{}': {}", source, e.what())};
  }
}

#undef KVQ_ASSIGN

}  // namespace calib
KVQ_NAMESPACE_END
