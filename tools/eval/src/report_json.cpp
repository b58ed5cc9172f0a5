#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <eval/report.hpp>
#include <filesystem>
#include <fstream>
#include <limits>
#include <type_traits>

namespace kvq::eval {

namespace {

using nlohmann::json;

/// JSON has no NaN or Inf: such a value is written as null (never happens for a sane run).
json num(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

json map_json(const std::vector<kvq::format_pair>& map, const kvq::cache_shape& shape, kvq::role r) {
  json rows = json::array();
  for (int l = 0; l < shape.layers; ++l) {
    json row = json::array();
    for (int h = 0; h < shape.kv_heads; ++h) {
      const size_t i = size_t(l) * size_t(shape.kv_heads) + size_t(h);
      const kvq::format_pair p = i < map.size() ? map[i] : kvq::format_pair{};
      row.push_back(kvq::format_name(r == kvq::role::k ? p.k : p.v));
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

json buckets_json(const eval_report& r, const config_result& c) {
  json out = json::array();
  for (const auto& [b, delta] : long_context_buckets(r, c))
    out.push_back({{"first", b.first},
                   {"end", b.end},
                   {"positions", b.positions},
                   {"mean_kl", num(b.mean_kl)},
                   {"top1_agreement", num(b.top1_agreement)},
                   {"perplexity", num(b.perplexity())},
                   {"perplexity_delta", num(delta)}});
  return out;
}

}  // namespace

std::vector<bucket_row> long_context_buckets(const eval_report& r, const config_result& c) {
  const int64_t first = r.options.prefill;
  const auto edges = position_bucket_edges(first + c.quality.positions());
  const auto mine = c.quality.by_position(first, edges);
  const auto ref = r.configs.empty() ? mine : r.configs[r.reference].quality.by_position(first, edges);
  std::vector<bucket_row> out;
  for (size_t b = 0; b < mine.size(); ++b) {
    const bool same = b < ref.size() && ref[b].first == mine[b].first;
    out.push_back({mine[b], same ? mine[b].perplexity() - ref[b].perplexity() : 0.0});
  }
  return out;
}

std::string position_range_label(int64_t first, int64_t end) {
  auto k = [](int64_t v) { return v >= 1024 && v % 1024 == 0 ? fmt::format("{}K", v / 1024) : fmt::format("{}", v); };
  return k(first) + "-" + k(end);
}

// A hash of fitted codebook levels ("" when none): a run with other levels is another run.
std::string codebook_levels_hash(const std::vector<kvq::calib::codebook_fit>& fits) {
  std::string bytes;
  for (const auto& c : fits) {
    bytes += fmt::format("{}:{}:", int(c.format), c.rotated ? 1 : 0);
    bytes.append(reinterpret_cast<const char*>(c.levels.data()), c.levels.size() * sizeof(float));
  }
  return fits.empty() ? std::string() : hash_text(bytes);
}

json run_identity(const eval_report& r) {
  const auto& o = r.options;
  json configs = json::array();
  for (const auto& c : r.configs) configs.push_back(c.config);
  std::vector<float> clips = o.cache.clip_percentiles;
  clips.insert(clips.end(), o.cache.rotated_clip_percentiles.begin(), o.cache.rotated_clip_percentiles.end());
  const std::string_view clip_bytes(reinterpret_cast<const char*>(clips.data()), clips.size() * sizeof(float));
  return {{"model_hash", r.model.hash},
          {"text_hash", r.text.hash},
          {"haystack_hash", r.haystack_hash},
          {"configs", std::move(configs)},
          {"prefill", o.prefill},
          {"tokens", o.tokens},
          {"page_tokens", o.cache.page_tokens},
          {"window", o.cache.window},
          {"recent", o.cache.recent},
          {"budget_bytes", o.cache.budget_bytes},
          {"clip_percentiles", clips.empty() ? std::string() : hash_text(clip_bytes)},
          {"codebook_levels", codebook_levels_hash(o.cache.codebooks)},
          {"map_every", o.map_every},
          {"needle_contexts", r.trials.empty() ? std::vector<int64_t>() : o.needle_contexts},
          {"needle_depths", r.trials.empty() ? std::vector<double>() : o.needle_depths},
          {"needle_reps", o.needle_reps},
          {"needle_max_new", o.needle_max_new},
          {"needle_seed", o.seed},
          {"prompt_template", template_name(r.model.tmpl)}};
}

json to_json(const eval_report& r) {
  const auto& o = r.options;
  const auto& hp = r.model.hparams;
  json j;
  j["kind"] = "kvq.eval";
  j["version"] = 1;
  j["complete"] = r.complete;
  j["resumed"] = r.resumed;
  j["run"] = run_identity(r);
  j["created_utc"] = r.created_utc;
  j["command"] = o.command_line;
  j["wall_seconds"] = num(r.wall_seconds);
  j["threads"] = r.threads;
  j["model"] = {{"path", r.model.path},
                {"name", r.model.name},
                {"hash", r.model.hash},
                {"layers", hp.n_layer},
                {"q_heads", hp.n_head},
                {"kv_heads", hp.n_head_kv},
                {"head_dim", hp.head_dim},
                {"n_vocab", hp.n_vocab},
                {"n_ctx_train", hp.n_ctx_train},
                {"chat_template", r.model.has_chat_template},
                {"prompt_template", template_name(r.model.tmpl)}};
  j["cache"] = {
      {"backend", "cpu"},
      {"page_tokens", r.shape.page_tokens},
      {"window", r.shape.window},
      {"recent", r.shape.recent},
      {"budget_bytes", o.cache.budget_bytes},
      {"clip_percentiles_artifact", o.clip_percentiles_path},
      {"codebook_levels_artifact", o.codebook_levels_path},
      {"clip_percentiles_below_100", std::count_if(o.cache.clip_percentiles.begin(), o.cache.clip_percentiles.end(),
                                                   [](float c) { return c < 100.f; })},
      {"rotated_clip_percentiles_below_100",
       std::count_if(o.cache.rotated_clip_percentiles.begin(), o.cache.rotated_clip_percentiles.end(),
                     [](float c) { return c < 100.f; })}};
  j["text"] = {{"path", r.text.path},
               {"hash", r.text.hash},
               {"bytes", r.text.bytes},
               {"tokens_in_file", r.text.tokens_in_file},
               {"prefill", o.prefill},
               {"teacher_forced", o.tokens},
               {"first_position", r.text.first_position},
               {"positions", json::array({o.prefill, o.prefill + o.tokens - 1})}};
  json trials = json::array();
  for (const auto& t : r.trials)
    trials.push_back({{"context", t.context},
                      {"depth", num(t.depth)},
                      {"rep", t.rep},
                      {"key", t.key},
                      {"kind", kind_name(t.kind)},
                      {"label", t.label}});
  j["needle"] = {{"haystack_path", o.haystack_path.empty() ? o.text_path : o.haystack_path},
                 {"haystack_hash", r.haystack_hash},
                 {"contexts", r.trials.empty() ? json::array() : json(o.needle_contexts)},
                 {"depths", r.trials.empty() ? json::array() : json(o.needle_depths)},
                 {"repetitions", o.needle_reps},
                 {"max_new_tokens", o.needle_max_new},
                 {"seed", o.seed},
                 {"sentence", needle_sentence("{key}")},
                 {"kinds", r.trials.empty() ? json::array() : json(o.needle_kinds)},
                 {"multi_key_sentence", multi_key_sentence("{label}", "{key}")},
                 {"trials", std::move(trials)}};
  j["reference"] = r.configs.empty() ? std::string() : r.configs[r.reference].config;

  const double ref_ppl = r.configs.empty() ? 0.0 : r.configs[r.reference].quality.perplexity();
  json configs = json::array();
  for (const auto& c : r.configs) {
    json cj;
    cj["name"] = c.config;
    cj["policy"] = c.policy_name;
    cj["reference"] = c.reference;
    const auto final_map = c.format_map_history.empty() ? c.stats.format_map : c.format_map_history.back().map;
    cj["bits"] = {{"page_bits", num(c.stats.page_bits())},
                  {"total_bits", num(c.stats.total_bits(r.shape.kv_heads, r.shape.head_dim))},
                  {"nominal_bits", num(nominal_bits(final_map, r.shape))}};
    const uint64_t fp16 = fp16_bytes(r.shape, c.tokens_held);
    cj["kv_bytes"] = {{"pages", c.stats.page_bytes},
                      {"window", c.stats.window_bytes},
                      {"total", c.kv_bytes()},
                      {"fp16_equivalent", fp16},
                      {"compression", num(c.kv_bytes() ? double(fp16) / double(c.kv_bytes()) : 0.0)},
                      {"tokens", c.tokens_held}};
    json by_format = json::object();
    for (size_t f = 0; f < kvq::format_count; ++f)
      if (c.stats.bytes_by_format[f]) by_format[kvq::format_name(kvq::format_id(f))] = c.stats.bytes_by_format[f];
    cj["bytes_by_format"] = std::move(by_format);
    json pages_by_format = json::object();
    for (size_t f = 0; f < kvq::format_count; ++f)
      if (c.stats.pages_by_format[f]) pages_by_format[kvq::format_name(kvq::format_id(f))] = c.stats.pages_by_format[f];
    cj["cache_stats"] = {{"budget_bytes", c.stats.budget_bytes},
                         {"used_bytes", c.stats.used_bytes},
                         {"page_bytes", c.stats.page_bytes},
                         {"window_bytes", c.stats.window_bytes},
                         {"pages", c.stats.pages},
                         {"sequences", c.stats.sequences},
                         {"tokens", c.stats.tokens},
                         {"encoded_elements", c.stats.encoded_elements},
                         {"pages_by_format", std::move(pages_by_format)}};
    const auto& q = c.quality;
    cj["quality"] = {{"positions", q.positions()},
                     {"mean_kl", num(q.mean_kl())},
                     {"median_kl", num(q.kl_quantile(0.5))},
                     {"p99_kl", num(q.kl_quantile(0.99))},
                     {"max_kl", num(q.max_kl())},
                     {"top1_agreement", num(q.top1_agreement())},
                     {"perplexity", num(q.perplexity())},
                     {"perplexity_delta", num(q.perplexity() - ref_ppl)},
                     {"mean_nll", num(q.mean_nll())}};
    json buckets = json::array();
    for (double v : q.kl_by_bucket(o.kl_bucket)) buckets.push_back(num(v));
    cj["kl_by_position"] = {{"bucket", o.kl_bucket}, {"first_position", o.prefill}, {"mean_kl", std::move(buckets)}};
    cj["position_buckets"] = buckets_json(r, c);
    json kl = json::array(), nll = json::array();
    for (double v : q.kl_values()) kl.push_back(num(v));
    for (double v : q.nll_values()) nll.push_back(num(v));
    cj["per_position"] = {{"kl", std::move(kl)}, {"top1", q.agree_values()}, {"nll", std::move(nll)}};
    cj["speed"] = {{"decode_tokens_per_s", num(c.decode_tokens_per_s())},
                   {"decode_seconds", num(c.decode_seconds)},
                   {"decode_tokens", c.decode_tokens},
                   {"prefill_tokens_per_s", num(c.prefill_tokens_per_s())},
                   {"needle_prefill_seconds", num(c.needle_prefill_seconds)},
                   {"needle_prefill_tokens", c.needle_prefill_tokens},
                   {"needle_decode_tokens_per_s", num(c.needle_decode_tokens_per_s())},
                   {"needle_decode_seconds", num(c.needle_decode_seconds)},
                   {"needle_decode_tokens", c.needle_decode_tokens}};
    json results = json::array();
    for (const auto& n : c.needle)
      results.push_back({{"context", n.trial.context},
                         {"depth", num(n.trial.depth)},
                         {"actual_depth", num(n.depth)},
                         {"rep", n.trial.rep},
                         {"key", n.trial.key},
                         {"kind", kind_name(n.trial.kind)},
                         {"label", n.trial.label},
                         {"prompt_tokens", n.prompt_tokens},
                         {"pass", n.pass},
                         {"reference_pass", n.reference_pass},
                         {"output", n.output},
                         {"done", n.done}});
    json rates = json::array();
    for (const auto& nr : needle_rates(c))
      rates.push_back({{"kind", kind_name(nr.kind)},
                       {"context", nr.context},
                       {"trials", nr.trials},
                       {"passed", nr.passed},
                       {"reference_passed", nr.reference_passed},
                       {"passed_where_reference_passed", nr.passed_where_reference_passed}});
    cj["needle"] = {{"passed", c.needle_passed()},
                    {"trials", c.needle.size()},
                    {"results", std::move(results)},
                    {"by_context", std::move(rates)}};
    cj["format_map"] = {{"layers", r.shape.layers},
                        {"kv_heads", r.shape.kv_heads},
                        {"k", map_json(final_map, r.shape, kvq::role::k)},
                        {"v", map_json(final_map, r.shape, kvq::role::v)}};
    json history = json::array();
    for (const auto& s : c.format_map_history)
      history.push_back({{"step", s.step},
                         {"position", s.position},
                         {"k", map_json(s.map, r.shape, kvq::role::k)},
                         {"v", map_json(s.map, r.shape, kvq::role::v)}});
    cj["format_map_history"] = std::move(history);
    configs.push_back(std::move(cj));
  }
  j["configs"] = std::move(configs);
  return j;
}

namespace {

/// A field of a record being read back, with the path it came from for error messages.
struct reader {
  const std::string& file;
  kvq::status bad(std::string_view where, std::string_view what) const {
    return {kvq::errc::invalid_argument, fmt::format("--resume: '{}': {} {}", file, where, what)};
  }
  template <class T>
  kvq::result<T> get(const json& j, const char* pointer, const std::string& where) const {
    const json::json_pointer p(pointer);
    if (!j.contains(p)) return bad(where + pointer, "is missing");
    const json& v = j.at(p);
    if constexpr (std::is_same_v<T, double>) {
      if (v.is_null()) return std::numeric_limits<double>::quiet_NaN();  // written for NaN
      if (!v.is_number()) return bad(where + pointer, "is not a number");
    } else if constexpr (std::is_same_v<T, std::string>) {
      if (!v.is_string()) return bad(where + pointer, "is not a string");
    } else if constexpr (std::is_same_v<T, bool>) {
      if (!v.is_boolean()) return bad(where + pointer, "is not true or false");
    } else {
      if (!v.is_number_integer()) return bad(where + pointer, "is not an integer");
      if (std::is_unsigned_v<T> && v.get<int64_t>() < 0) return bad(where + pointer, "is negative");
    }
    return v.get<T>();
  }
  /// `get` into `out`; `out` is unchanged on an error.
  template <class T>
  kvq::status into(const json& j, const char* pointer, const std::string& where, T& out) const {
    auto v = get<T>(j, pointer, where);
    if (!v) return v.error();
    out = std::move(v).value();
    return {};
  }
  kvq::result<std::vector<kvq::format_pair>> map(const json& k, const json& v, const kvq::cache_shape& shape,
                                                 const std::string& where) const {
    std::vector<kvq::format_pair> m;
    if (!k.is_array() || !v.is_array() || k.size() != size_t(shape.layers) || v.size() != size_t(shape.layers))
      return bad(where, fmt::format("does not have {} layers", shape.layers));
    for (int l = 0; l < shape.layers; ++l) {
      if (!k[l].is_array() || !v[l].is_array() || k[l].size() != size_t(shape.kv_heads) ||
          v[l].size() != size_t(shape.kv_heads))
        return bad(where, fmt::format("layer {} does not have {} kv heads", l, shape.kv_heads));
      for (int h = 0; h < shape.kv_heads; ++h) {
        if (!k[l][h].is_string() || !v[l][h].is_string()) return bad(where, "holds a format that is not a string");
        auto fk = kvq::parse_format(k[l][h].get<std::string>());
        auto fv = kvq::parse_format(v[l][h].get<std::string>());
        if (!fk || !fv) return bad(where, fmt::format("names an unknown format at layer {} kv head {}", l, h));
        m.push_back({*fk, *fv});
      }
    }
    return m;
  }
};

/// Reads the format ids and counts of a {"name": count} object into `out`.
kvq::status read_by_format(const reader& rd, const json& j, const std::string& where,
                           std::array<uint64_t, kvq::format_count>& out) {
  if (!j.is_object()) return rd.bad(where, "is not an object");
  for (const auto& [name, count] : j.items()) {
    auto f = kvq::parse_format(name);
    if (!f) return rd.bad(where, fmt::format("names an unknown format '{}'", name));
    if (!count.is_number_unsigned()) return rd.bad(where + "/" + name, "is not a count");
    out[size_t(*f)] = count.get<uint64_t>();
  }
  return {};
}

/// One configuration of the record into `c` (which holds its name already).
kvq::status read_config(const reader& rd, const json& cj, const eval_report& current, const std::string& where,
                        config_result& c) {
  const auto& shape = current.shape;
  KVQ_TRY(rd.into(cj, "/policy", where, c.policy_name));
  // per-position measures: every teacher-forced position, in order
  const json::json_pointer pp("/per_position");
  if (!cj.contains(pp)) return rd.bad(where + "/per_position", "is missing");
  const json& per = cj.at(pp);
  const size_t n = size_t(current.options.tokens);
  for (const char* key : {"kl", "top1", "nll"})
    if (!per.contains(key) || !per.at(key).is_array() || per.at(key).size() != n)
      return rd.bad(fmt::format("{}/per_position/{}", where, key), fmt::format("does not hold {} positions", n));
  for (size_t i = 0; i < n; ++i) {
    const json &kl = per["kl"][i], &top1 = per["top1"][i], &nll = per["nll"][i];
    if (!(kl.is_number() || kl.is_null()) || !(nll.is_number() || nll.is_null()) || !top1.is_number_integer())
      return rd.bad(fmt::format("{}/per_position", where), fmt::format("position {} is not a number", i));
    const double nan = std::numeric_limits<double>::quiet_NaN();
    c.quality.add(kl.is_null() ? nan : kl.get<double>(), top1.get<int>() != 0, nll.is_null() ? nan : nll.get<double>());
  }
  // cache statistics after the teacher-forced run
  const std::string st = where + "/cache_stats";
  KVQ_TRY(rd.into(cj, "/cache_stats/budget_bytes", where, c.stats.budget_bytes));
  KVQ_TRY(rd.into(cj, "/cache_stats/used_bytes", where, c.stats.used_bytes));
  KVQ_TRY(rd.into(cj, "/cache_stats/page_bytes", where, c.stats.page_bytes));
  KVQ_TRY(rd.into(cj, "/cache_stats/window_bytes", where, c.stats.window_bytes));
  KVQ_TRY(rd.into(cj, "/cache_stats/pages", where, c.stats.pages));
  KVQ_TRY(rd.into(cj, "/cache_stats/encoded_elements", where, c.stats.encoded_elements));
  KVQ_TRY(rd.into(cj, "/cache_stats/sequences", where, c.stats.sequences));
  KVQ_TRY(rd.into(cj, "/cache_stats/tokens", where, c.stats.tokens));
  KVQ_TRY(rd.into(cj, "/kv_bytes/tokens", where, c.tokens_held));
  if (!cj.contains("bytes_by_format")) return rd.bad(where + "/bytes_by_format", "is missing");
  KVQ_TRY(read_by_format(rd, cj["bytes_by_format"], where + "/bytes_by_format", c.stats.bytes_by_format));
  if (!cj["cache_stats"].contains("pages_by_format")) return rd.bad(st + "/pages_by_format", "is missing");
  KVQ_TRY(read_by_format(rd, cj["cache_stats"]["pages_by_format"], st + "/pages_by_format", c.stats.pages_by_format));
  // speed of the teacher-forced phase
  KVQ_TRY(rd.into(cj, "/speed/decode_seconds", where, c.decode_seconds));
  KVQ_TRY(rd.into(cj, "/speed/decode_tokens", where, c.decode_tokens));
  // format maps
  if (!cj.contains("format_map_history") || !cj["format_map_history"].is_array())
    return rd.bad(where + "/format_map_history", "is missing");
  for (size_t i = 0; i < cj["format_map_history"].size(); ++i) {
    const json& e = cj["format_map_history"][i];
    const std::string w = fmt::format("{}/format_map_history/{}", where, i);
    format_map_snapshot snap;
    KVQ_TRY(rd.into(e, "/step", w, snap.step));
    KVQ_TRY(rd.into(e, "/position", w, snap.position));
    auto m = rd.map(e.value("k", json()), e.value("v", json()), shape, w);
    if (!m) return m.error();
    snap.map = std::move(m).value();
    c.format_map_history.push_back(std::move(snap));
  }
  c.stats.format_map = c.format_map_history.empty() ? std::vector<kvq::format_pair>() : c.format_map_history.back().map;
  // needle trials that ran, matched to this run's trials by position and key
  c.needle.assign(current.trials.size(), needle_result{});
  const json::json_pointer np("/needle/results");
  if (!cj.contains(np) || !cj.at(np).is_array()) return rd.bad(where + "/needle/results", "is missing");
  for (size_t t = 0; t < cj.at(np).size(); ++t) {
    const json& e = cj.at(np)[t];
    const std::string w = fmt::format("{}/needle/results/{}", where, t);
    needle_result r;
    KVQ_TRY(rd.into(e, "/done", w, r.done));
    if (!r.done) continue;
    KVQ_TRY(rd.into(e, "/key", w, r.trial.key));
    KVQ_TRY(rd.into(e, "/prompt_tokens", w, r.prompt_tokens));
    KVQ_TRY(rd.into(e, "/actual_depth", w, r.depth));
    KVQ_TRY(rd.into(e, "/pass", w, r.pass));
    KVQ_TRY(rd.into(e, "/reference_pass", w, r.reference_pass));
    KVQ_TRY(rd.into(e, "/output", w, r.output));
    if (t >= current.trials.size() || current.trials[t].key != r.trial.key)
      return rd.bad(w, fmt::format("is not trial {} of this run (key {})", t, r.trial.key));
    r.trial = current.trials[t];
    c.needle[t] = std::move(r);
  }
  KVQ_TRY(rd.into(cj, "/speed/needle_prefill_seconds", where, c.needle_prefill_seconds));
  KVQ_TRY(rd.into(cj, "/speed/needle_prefill_tokens", where, c.needle_prefill_tokens));
  KVQ_TRY(rd.into(cj, "/speed/needle_decode_seconds", where, c.needle_decode_seconds));
  KVQ_TRY(rd.into(cj, "/speed/needle_decode_tokens", where, c.needle_decode_tokens));
  return {};
}

}  // namespace

kvq::status read_resume(const std::string& path, eval_report& current) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {kvq::errc::io_error, fmt::format("--resume: cannot open '{}'", path)};
  json j = json::parse(in, nullptr, false);
  const reader rd{path};
  if (j.is_discarded()) return rd.bad("the file", "is not valid JSON");
  if (!j.is_object() || j.value("kind", "") != "kvq.eval") return rd.bad("the file", "is not a kvq-eval record");
  if (!j.contains("run")) return rd.bad("/run", "is missing (a record without the run's identity)");
  // The first field that differs names the mismatch.
  const json here = run_identity(current), there = j["run"];
  for (const auto& [key, value] : here.items()) {
    if (!there.contains(key)) return rd.bad("/run/" + key, "is missing");
    if (there[key] != value)
      return {kvq::errc::invalid_argument,
              fmt::format("--resume: '{}' is from another run: {} differs ({} there, {} here); rerun it "
                          "with that run's options, or name another --json to start afresh",
                          path, key, there[key].dump(), value.dump())};
  }
  if (!j.contains("configs") || !j["configs"].is_array() || j["configs"].size() != current.configs.size())
    return rd.bad("/configs", fmt::format("does not hold {} configurations", current.configs.size()));
  std::vector<config_result> configs;
  for (size_t i = 0; i < current.configs.size(); ++i) {
    config_result c;
    c.config = current.configs[i].config;
    c.reference = current.configs[i].reference;
    KVQ_TRY(read_config(rd, j["configs"][i], current, fmt::format("/configs/{}", i), c));
    configs.push_back(std::move(c));
  }
  current.configs = std::move(configs);
  current.resumed = true;
  return {};
}

kvq::status write_text_file(const std::string& path, std::string_view contents) {
  std::error_code ec;
  const std::filesystem::path p(path);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  if (ec) return {kvq::errc::io_error, fmt::format("cannot create the folder of '{}': {}", path, ec.message())};
  // Written beside and renamed over: a run stopped mid-write leaves the previous record whole.
  const std::string tmp = path + ".partial";
  std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
  if (!out) return {kvq::errc::io_error, fmt::format("cannot open '{}' for writing", tmp)};
  out.write(contents.data(), std::streamsize(contents.size()));
  out.close();
  if (!out) {
    std::filesystem::remove(tmp, ec);
    return {kvq::errc::io_error, fmt::format("cannot write '{}'", tmp)};
  }
  std::filesystem::rename(tmp, p, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    return {kvq::errc::io_error, fmt::format("cannot replace '{}': {}", path, ec.message())};
  }
  return {};
}

}  // namespace kvq::eval
