#pragma once
/// \file
/// The three outputs of kvq-eval, all made from an `eval_report` alone (so they can be tested
/// without a model):
///
/// - `render_table`: the terminal table, one row per configuration.
/// - `to_json`: the machine-readable record, schema `kvq.eval` version 1 (below).
/// - `render_html`: one self-contained HTML file (inline CSS and SVG, no script, no external
///   reference): summary table, bits-per-element vs KL scatter (log KL axis), KL over position,
///   perplexity and top-1 agreement bars, needle pass matrix, per-(layer, kv head) format maps and,
///   when a policy changed its decisions during the run, the map over decode steps.
///
/// JSON schema, version 1 (every field always present; numbers finite):
///
/// ```
/// { "kind": "kvq.eval", "version": 1, "complete": true (false: a checkpoint written before the
///   needle trials ran), "created_utc": "2025-01-01T00:00:00Z", "command": "...",
///   "wall_seconds": 812.3, "threads": 2,
///   "model": { "path", "name", "layers", "q_heads", "kv_heads", "head_dim", "n_vocab",
///              "n_ctx_train", "chat_template": bool, "prompt_template": "chatml"|"plain" },
///   "cache": { "backend": "cpu", "page_tokens", "window", "recent", "budget_bytes" (0 = auto),
///              "clip_ratios_artifact" (--clip-ratios path, "" = none: rolealign clips nothing),
///              "clip_ratios_below_1" (how many of the layers x kv heads x 2 ratios clip) },
///   "text": { "path", "hash", "bytes", "tokens_in_file", "prefill", "teacher_forced",
///             "first_position", "positions": [first, last] },
///   "needle": { "haystack_path", "haystack_hash", "contexts": [...], "depths": [...],
///               "repetitions", "max_new_tokens", "seed", "sentence": "The pass key is {key}. Remember it.",
///               "kinds": ["single", "multi"],
///               "multi_key_sentence": "The special magic number for {label} is {key}.",
///               "trials": [ { "context", "depth", "rep", "key", "kind", "label" ("" for single) } ] },
///   "reference": "fp16",
///   "configs": [ {
///     "name", "policy", "reference": bool,
///     "bits": { "page_bits", "total_bits", "nominal_bits" },
///     "kv_bytes": { "pages", "window", "total", "fp16_equivalent", "compression", "tokens" },
///     "bytes_by_format": { "kivi4/g32": 123, ... },
///     "quality": { "positions", "mean_kl", "median_kl", "p99_kl", "max_kl", "top1_agreement",
///                  "perplexity", "perplexity_delta", "mean_nll" },
///     "kl_by_position": { "bucket", "first_position", "mean_kl": [...] },
///     "speed": { "decode_tokens_per_s", "decode_seconds", "decode_tokens",
///                "prefill_tokens_per_s" (the needle prompts' shared prefill, the same for all),
///                "needle_decode_tokens_per_s" (needle question and answer steps through this cache) },
///     "needle": { "passed", "trials", "results": [ { "context", "depth", "actual_depth", "rep",
///                 "key", "kind", "label", "prompt_tokens", "pass",
///                 "reference_pass" (the reference passed this trial), "output" } ],
///                 "by_context": [ { "kind", "context", "trials", "passed", "reference_passed",
///                                   "passed_where_reference_passed" } ] },
///     "format_map": { "layers", "kv_heads", "k": [[name per kv head] per layer], "v": [[...]] },
///     "format_map_history": [ { "step", "position", "k": [[...]], "v": [[...]] } ]
///   } ] }
/// ```
///
/// `format_map_history` holds the first sample and every change (sampled every `map_every`
/// steps): one entry for a static policy, a time series for adaptive ones.

#include <eval/runner.hpp>
#include <kvq/status.hpp>
#include <nlohmann/json.hpp>
#include <string>

namespace kvq::eval {

/// The JSON record (schema above).
nlohmann::json to_json(const eval_report& r);

/// The terminal table (ends with a newline).
std::string render_table(const eval_report& r);

/// The self-contained HTML report.
std::string render_html(const eval_report& r);

/// Writes `contents` to `path`, creating parent folders. Errors name the path.
kvq::status write_text_file(const std::string& path, std::string_view contents);

}  // namespace kvq::eval
