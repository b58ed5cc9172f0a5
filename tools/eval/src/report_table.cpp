#include <fmt/format.h>

#include <algorithm>
#include <eval/report.hpp>

namespace kvq::eval {

namespace {

struct column {
  std::string head;
  bool left = false;
};

/// Aligned columns (two spaces apart) under a head line and a rule.
std::string grid(const std::vector<column>& cols, const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width(cols.size());
  for (size_t i = 0; i < cols.size(); ++i) {
    width[i] = cols[i].head.size();
    for (const auto& row : rows) width[i] = std::max(width[i], row[i].size());
  }
  auto line = [&](const std::vector<std::string>& cells) {
    std::string s;
    for (size_t i = 0; i < cells.size(); ++i) {
      s += i ? "  " : "";
      s += cols[i].left ? fmt::format("{:<{}}", cells[i], width[i]) : fmt::format("{:>{}}", cells[i], width[i]);
    }
    return s + "\n";
  };
  std::vector<std::string> heads;
  for (const auto& c : cols) heads.push_back(c.head);
  std::string out = line(heads);
  size_t total = 0;
  for (size_t w : width) total += w;
  out += std::string(total + 2 * (cols.size() - 1), '-') + "\n";
  for (const auto& row : rows) out += line(row);
  return out;
}

/// Mean KL, top-1 and ΔPPL per long-context position bucket, a row per configuration and measure.
std::string bucket_table(const eval_report& r) {
  if (r.configs.empty()) return {};
  const auto ref_rows = long_context_buckets(r, r.configs[r.reference]);
  std::vector<column> cols = {{"positions", true}, {"", true}};
  for (const auto& b : ref_rows) cols.push_back({position_range_label(b.bucket.first, b.bucket.end)});
  std::vector<std::vector<std::string>> rows;
  for (const auto& c : r.configs) {
    if (c.reference) continue;
    const auto mine = long_context_buckets(r, c);
    std::vector<std::string> kl = {c.config, "KL"}, top1 = {"", "top-1"}, dppl = {"", "dPPL"};
    for (size_t b = 0; b + 2 < cols.size(); ++b) {
      const bool has = b < mine.size();
      kl.push_back(has ? fmt::format("{:.2e}", mine[b].bucket.mean_kl) : "-");
      top1.push_back(has ? fmt::format("{:.4f}", mine[b].bucket.top1_agreement) : "-");
      dppl.push_back(has ? fmt::format("{:+.3f}", mine[b].perplexity_delta) : "-");
    }
    rows.push_back(std::move(kl));
    rows.push_back(std::move(top1));
    rows.push_back(std::move(dppl));
  }
  if (rows.empty()) return {};
  std::vector<std::string> ppl = {"fp16 (ref)", "PPL"};
  for (const auto& b : ref_rows) ppl.push_back(fmt::format("{:.3f}", b.bucket.perplexity()));
  rows.push_back(std::move(ppl));
  return "\nby absolute position (means over each range):\n" + grid(cols, rows);
}

/// Needle pass counts per (kind, context) and configuration: "passed/trials", and for the other
/// configurations "(passed/trials)" over the trials the reference passed.
std::string needle_block(const eval_report& r) {
  if (r.configs.empty() || r.configs[r.reference].needle.empty()) return {};
  std::string out = "needle passed/trials per kind@context (in brackets: over the trials the reference passed)\n";
  size_t name_w = 6;
  for (const auto& c : r.configs) name_w = std::max(name_w, c.config.size() + 6);
  const auto ref_rates = needle_rates(r.configs[r.reference]);
  out += fmt::format("{:<{}}", "config", name_w);
  for (const auto& nr : ref_rates) out += fmt::format("  {:>15}", fmt::format("{}@{}", kind_name(nr.kind), nr.context));
  out += "\n";
  for (const auto& c : r.configs) {
    out += fmt::format("{:<{}}", c.config + (c.reference ? " (ref)" : ""), name_w);
    for (const auto& nr : needle_rates(c))
      out += fmt::format("  {:>15}", c.reference ? fmt::format("{}/{}", nr.passed, nr.trials)
                                                 : fmt::format("{}/{} ({}/{})", nr.passed, nr.trials,
                                                               nr.passed_where_reference_passed, nr.reference_passed));
    out += "\n";
  }
  return out;
}

}  // namespace

std::string render_table(const eval_report& r) {
  const std::vector<column> cols = {{"config", true}, {"bits/el"}, {"page bits"}, {"KV MiB"},
                                    {"vs fp16"},      {"mean KL"}, {"p99 KL"},    {"top-1"},
                                    {"PPL"},          {"dPPL"},    {"needle"},    {"forced tok/s"}};
  std::vector<std::vector<std::string>> rows;
  const double ref_ppl = r.configs.empty() ? 0.0 : r.configs[r.reference].quality.perplexity();
  for (const auto& c : r.configs) {
    const auto& q = c.quality;
    const double fp16 = double(fp16_bytes(r.shape, c.tokens_held));
    std::string needle = c.needle.empty() ? "-" : fmt::format("{}/{}", c.needle_passed(), c.needle.size());
    rows.push_back(
        {c.config + (c.reference ? " (ref)" : ""),
         fmt::format("{:.2f}", c.stats.total_bits(r.shape.kv_heads, r.shape.head_dim)),
         fmt::format("{:.2f}", c.stats.page_bits()), fmt::format("{:.2f}", double(c.kv_bytes()) / (1024.0 * 1024.0)),
         fmt::format("{:.2f}x", c.kv_bytes() ? fp16 / double(c.kv_bytes()) : 0.0), fmt::format("{:.2e}", q.mean_kl()),
         fmt::format("{:.2e}", q.kl_quantile(0.99)), fmt::format("{:.4f}", q.top1_agreement()),
         fmt::format("{:.3f}", q.perplexity()), fmt::format("{:+.3f}", q.perplexity() - ref_ppl), needle,
         fmt::format("{:.1f}", c.decode_tokens_per_s())});
  }
  std::string out = grid(cols, rows);
  out += fmt::format(
      "{} teacher-forced decode positions {}..{} of {}; KL = mean KL(P_ref || P_config) in nats; bits/el = pages + "
      "FP16 window over the K/V elements held; needle = passed/trials\n",
      r.options.tokens, r.options.prefill, r.options.prefill + r.options.tokens - 1, r.text.path);
  if (!r.options.clip_percentiles_path.empty())
    out += fmt::format("rolealign clip percentiles from {}\n", r.options.clip_percentiles_path);
  if (!r.options.codebook_levels_path.empty())
    out += fmt::format("codebook levels fitted in {}\n", r.options.codebook_levels_path);
  const int64_t ctx = r.model.hparams.n_ctx_train;
  if (ctx > 0 && r.options.prefill + r.options.tokens > ctx)
    out += fmt::format("positions {}..{} are beyond the model's training context of {} tokens\n", ctx,
                       r.options.prefill + r.options.tokens - 1, ctx);
  if (r.resumed) out += fmt::format("teacher-forced results read back from {} (--resume)\n", r.options.resume_path);
  out += needle_block(r);
  return out + bucket_table(r);
}

}  // namespace kvq::eval
