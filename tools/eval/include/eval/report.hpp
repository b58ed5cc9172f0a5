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
///   needle trials ran), "resumed": bool (teacher-forced results read from an earlier record),
///   "run": { run_identity below: "model_hash", "text_hash", "configs", ... }, "created_utc": "2025-01-01T00:00:00Z",
///   "command": "...", "wall_seconds": 812.3, "threads": 2, "model": { "path", "name", "hash", "layers", "q_heads",
///   "kv_heads", "head_dim", "n_vocab",
///              "n_ctx_train", "chat_template": bool, "prompt_template": "chatml"|"plain" },
///   "cache": { "backend": "cpu", "page_tokens", "window", "recent", "budget_bytes" (0 = auto),
///              "clip_percentiles_artifact" (--clip-percentiles path, "" = none: rolealign clips nothing),
///              "clip_percentiles_below_100" (how many of the layers x kv heads x 2 percentiles clip),
///              "rotated_clip_percentiles_below_100" (the same of the rotated heads' table),
///              "codebook_levels_artifact" (--codebook-levels path, "" = none: Lloyd-Max levels) },
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
///     "cache_stats": { "budget_bytes", "used_bytes", "page_bytes", "window_bytes", "pages",
///                      "sequences", "tokens", "encoded_elements", "pages_by_format": {...} },
///     "quality": { "positions", "mean_kl", "median_kl", "p99_kl", "max_kl", "top1_agreement",
///                  "perplexity", "perplexity_delta", "mean_nll" },
///     "kl_by_position": { "bucket", "first_position", "mean_kl": [...] },
///     "position_buckets": [ { "first", "end" (absolute positions, fixed edges 0, 512, 1K, 2K,
///                             4K, 8K, ...), "positions", "mean_kl", "top1_agreement",
///                             "perplexity", "perplexity_delta" (vs the reference's bucket) } ],
///     "per_position": { "kl": [...], "top1": [0|1 ...], "nll": [...] } (every measured position,
///                       in order: what a resumed run reads back),
///     "speed": { "decode_tokens_per_s", "decode_seconds", "decode_tokens",
///                "prefill_tokens_per_s" (the needle prompts' shared prefill, the same for all),
///                "needle_decode_tokens_per_s" (needle question and answer steps through this cache) },
///     "needle": { "passed", "trials", "results": [ { "context", "depth", "actual_depth", "rep",
///                 "key", "kind", "label", "prompt_tokens", "pass",
///                 "reference_pass" (the reference passed this trial), "output", "done" } ],
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

/// One long-context position bucket of a configuration with its perplexity change against the
/// reference's same bucket.
struct bucket_row {
  position_bucket bucket;
  double perplexity_delta = 0;
};

/// The long-context buckets of `c` (fixed edges of `position_bucket_edges`, only those holding
/// measured positions): what the JSON's `position_buckets`, the table and the HTML show.
std::vector<bucket_row> long_context_buckets(const eval_report& r, const config_result& c);

/// "0-512", "512-1K", "1K-2K", "8K-16K": a bucket's range of absolute positions.
std::string position_range_label(int64_t first, int64_t end);

/// The JSON record (schema above).
nlohmann::json to_json(const eval_report& r);

/// What makes two runs the same run, as the `run` object of the record: the hashes of the model,
/// text and haystack files, the configurations (reference included, in order), prefill, tokens,
/// the cache settings, the clip ratios, the map sampling and the needle trials' options. A
/// resumed run must have the identity of the record it resumes.
nlohmann::json run_identity(const eval_report& r);

/// The results a resumed run takes from the record at `path` (written by `to_json` for a run
/// whose identity equals `run_identity(current)`), into `current`: per configuration the
/// per-position measures, cache statistics, tokens held, decode speed, format-map history and
/// the needle trials that ran (`done`). Errors (unreadable or malformed file, another run)
/// name the file and the field that differs or is wrong; `current` is unchanged then.
kvq::status read_resume(const std::string& path, eval_report& current);

/// The terminal table (ends with a newline).
std::string render_table(const eval_report& r);

/// The self-contained HTML report.
std::string render_html(const eval_report& r);

/// Writes `contents` to `path`, creating parent folders: to `path`.partial first, then renamed
/// over `path`, so an interrupted write never leaves a truncated record for `--resume`. Errors
/// name the path.
kvq::status write_text_file(const std::string& path, std::string_view contents);

}  // namespace kvq::eval
