#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <eval/report.hpp>
#include <filesystem>
#include <fstream>

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

}  // namespace

json to_json(const eval_report& r) {
  const auto& o = r.options;
  const auto& hp = r.model.hparams;
  json j;
  j["kind"] = "kvq.eval";
  j["version"] = 1;
  j["complete"] = r.complete;
  j["created_utc"] = r.created_utc;
  j["command"] = o.command_line;
  j["wall_seconds"] = num(r.wall_seconds);
  j["threads"] = r.threads;
  j["model"] = {{"path", r.model.path},
                {"name", r.model.name},
                {"layers", hp.n_layer},
                {"q_heads", hp.n_head},
                {"kv_heads", hp.n_head_kv},
                {"head_dim", hp.head_dim},
                {"n_vocab", hp.n_vocab},
                {"n_ctx_train", hp.n_ctx_train},
                {"chat_template", r.model.has_chat_template},
                {"prompt_template", template_name(r.model.tmpl)}};
  j["cache"] = {{"backend", "cpu"},
                {"page_tokens", r.shape.page_tokens},
                {"window", r.shape.window},
                {"recent", r.shape.recent},
                {"budget_bytes", o.cache.budget_bytes},
                {"clip_ratios_artifact", o.clip_ratios_path},
                {"clip_ratios_below_1", std::count_if(o.cache.clip_ratios.begin(), o.cache.clip_ratios.end(),
                                                      [](float c) { return c < 1.f; })}};
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
    cj["speed"] = {{"decode_tokens_per_s", num(c.decode_tokens_per_s())},
                   {"decode_seconds", num(c.decode_seconds)},
                   {"decode_tokens", c.decode_tokens},
                   {"prefill_tokens_per_s", num(c.prefill_tokens_per_s())},
                   {"needle_decode_tokens_per_s", num(c.needle_decode_tokens_per_s())}};
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
                         {"output", n.output}});
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

kvq::status write_text_file(const std::string& path, std::string_view contents) {
  std::error_code ec;
  const std::filesystem::path p(path);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  if (ec) return {kvq::errc::io_error, fmt::format("cannot create the folder of '{}': {}", path, ec.message())};
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return {kvq::errc::io_error, fmt::format("cannot open '{}' for writing", path)};
  out.write(contents.data(), std::streamsize(contents.size()));
  out.close();
  if (!out) return {kvq::errc::io_error, fmt::format("cannot write '{}'", path)};
  return {};
}

}  // namespace kvq::eval
