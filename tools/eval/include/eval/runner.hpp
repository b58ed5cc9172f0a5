#pragma once
/// \file
/// The evaluation itself: one model, one text, several cache configurations, the same positions
/// for all (docs/architecture.md).
///
/// **Teacher forcing.** The text is tokenized once. Every configuration gets its own cache and
/// reads the same tokens: the first `prefill` tokens as one prefill, computed once for all
/// configurations at full precision (`llama_model::prefill_shared`, as an engine's prefill attends
/// in FP16) and stored by each cache in its format, then `tokens` decode steps of one token each
/// (q_len = 1). Step s feeds token `prefill + s` and yields the next-token distribution for
/// token `prefill + s + 1`. Only decode steps are measured: every measured position saw exactly
/// what a decoding engine sees (the step's own token in FP16, everything older from pages or the
/// ring). The configurations run in lockstep, step by step, the FP16-cache reference among them,
/// so the reference's distribution at each step is at hand without storing [tokens][vocab]
/// log-probabilities.
///
/// **Reference.** The plain FP16 cache (`fp16`); added first when no configuration is fp16.
///
/// **Needle.** For each context length, kind (single pass key, multi-key), depth and repetition
/// a prompt is built once (`build_needle_prompt`) and answered by every configuration. Its
/// haystack part (everything before the question, `needle_prompt::question_start`) is prefilled
/// once for all configurations (`llama_model::prefill_shared`: attention in float over K/V
/// rounded to fp16, as an engine prefills a prompt at full precision), its K and V appended to
/// each configuration's cache, which stores them in its own format. Then each configuration feeds
/// the question and the answer prefix one token at a time (decode steps, q_len 1) through its own
/// cache, so the question reads the haystack as the cache stores it, as decoding does, and
/// decodes greedily until the first digit run ends, an end-of-turn token, or `needle_max_new`
/// tokens. A trial the reference fails says nothing about a cache: every result records whether
/// the reference passed it, and `needle_rates` counts passes over all trials and over those.
/// Trials run one after another, longest first, the configurations answering in lockstep.
///
/// **Lockstep.** Teacher forcing and needle answers run every configuration in one model step
/// (`llama_model::forward_lanes`): the matrix products once over all configurations, each
/// configuration's append and attention through its own cache, on the model's `threads`.
///
/// **Speed.** Decode tokens per second of each configuration = teacher-forced steps / (the steps'
/// products shared equally among the configurations + the time of its own cache calls): compare
/// speeds within one run only.

#include <cstdint>
#include <eval/config.hpp>
#include <eval/metrics.hpp>
#include <eval/needle.hpp>
#include <functional>
#include <kvq/cache/cache.hpp>
#include <kvq/status.hpp>
#include <llama/model.hpp>
#include <string>
#include <vector>

namespace kvq::eval {

struct eval_report;

/// Everything a run needs; the defaults are the documented defaults of kvq-eval.
struct eval_options {
  std::string model_path;            ///< GGUF file (llama architecture)
  std::string text_path;             ///< evaluation text (UTF-8)
  std::string haystack_path;         ///< needle haystack text; empty: the evaluation text
  std::vector<std::string> configs;  ///< configuration strings (config.hpp grammar)
  int64_t prefill = 256;             ///< tokens fed as a prefill before the measured decode steps
  int64_t tokens = 2048;             ///< teacher-forced decode steps (measured positions)
  std::vector<int64_t> needle_contexts = {1024, 2048, 4096, 8192};  ///< prompt lengths in tokens; empty: no needle
  std::vector<std::string> needle_kinds = {"single", "multi"};  ///< needle kinds (`parse_needle_kind` names)
  std::vector<double> needle_depths = {0.1, 0.5, 0.9};       ///< needle depths (fraction of the haystack)
  int needle_reps = 1;                                       ///< repetitions (keys) per (context, depth)
  int needle_max_new = 12;                                   ///< greedy tokens at most per needle answer
  std::string prompt_template = "auto";  ///< auto (chatml if the model has a chat template), chatml, plain
  uint64_t seed = 1234;                  ///< needle keys
  int threads = 0;                       ///< threads of the model's pool; 0 = hardware concurrency
  cache_settings cache;                  ///< paging and budget (budget 0 = automatic)
  /// Calibration artifact (kvq-calibrate) whose rolealign clip percentiles every cache gets
  /// (--clip-percentiles; rotated heads the rotated ones); loaded by `run_eval` into
  /// `cache.clip_percentiles` and `cache.rotated_clip_percentiles`. Empty: no clipping.
  std::string clip_percentiles_path;
  /// Calibration artifact whose fitted codebook levels every cache gets (--codebook-levels);
  /// loaded by `run_eval` into `cache.codebooks`. Empty: the Lloyd-Max levels.
  std::string codebook_levels_path;
  int64_t kl_bucket = 64;    ///< positions per bucket of the KL-over-position series
  int64_t map_every = 64;    ///< steps between format-map samples (a snapshot is kept when it changed)
  bool progress = true;      ///< progress bars on stderr
  std::string command_line;  ///< recorded in the report
  /// A JSON record of an earlier run (--resume): when the file exists and was written by the
  /// same run (run_identity), its teacher-forced results are taken instead of recomputed and its
  /// finished needle trials are not rerun; a record of another run is an error naming what
  /// differs. A missing file starts the run from the beginning. Empty: no resume.
  std::string resume_path;
  /// Called with the report so far when the teacher-forced phase is done and needle trials are
  /// still to run (`complete` false, needle results empty), so a long run can save what it has.
  std::function<void(const eval_report&)> on_checkpoint;
};

/// What was evaluated on.
struct model_info {
  std::string path, name;
  std::string hash;  ///< fnv1a64 of the file's bytes, "fnv1a64:<16 hex>"
  kvq::llama::llama_hparams hparams;
  bool has_chat_template = false;  ///< `tokenizer.chat_template` present (an instruct model)
  prompt_template tmpl = prompt_template::plain;
};

struct text_info {
  std::string path;
  std::string hash;  ///< fnv1a64 of the bytes, "fnv1a64:<16 hex>"
  int64_t bytes = 0;
  int64_t tokens_in_file = 0;
  int64_t first_position = 0;  ///< first measured position (= prefill)
};

/// One needle trial of one configuration.
struct needle_result {
  needle_trial trial;         ///< context, requested depth, repetition, key
  int64_t prompt_tokens = 0;  ///< actual prompt length
  double depth = 0;           ///< actual depth (sentence boundary)
  bool pass = false;
  bool reference_pass = false;  ///< the reference configuration passed the same trial
  std::string output;           ///< what the model wrote after the answer prefix
  bool done = false;            ///< the trial ran (a checkpoint holds trials not run yet too)
};

/// Pass counts of one configuration for one (kind, context).
struct needle_rate {
  needle_kind kind = needle_kind::single;
  int64_t context = 0;
  int trials = 0;
  int passed = 0;
  int reference_passed = 0;           ///< trials the reference passed
  int passed_where_reference_passed = 0;  ///< of those, the ones this configuration passed
};

/// The per-(layer, kv head) decisions of a policy at one moment.
struct format_map_snapshot {
  int64_t step = 0;                   ///< teacher-forced step (0 = right after the prefill)
  int64_t position = 0;               ///< sequence position of that step
  std::vector<kvq::format_pair> map;  ///< [layers][kv_heads]
};

/// Results of one configuration.
struct config_result {
  std::string config;          ///< as given
  std::string policy_name;     ///< the policy's own name, e.g. "static(kivi4/g32)"
  bool reference = false;      ///< the FP16 cache all others are compared to
  metric_accumulator quality;  ///< against the reference, over the teacher-forced positions
  kvq::cache_stats stats;      ///< after the teacher-forced run
  int64_t tokens_held = 0;     ///< tokens in the cache then (per layer)
  /// Teacher-forced positions (run in chunks, `teacher_forced_chunk`) and their wall time: the
  /// steps' products shared equally among the configurations plus this one's cache calls.
  double decode_seconds = 0;
  int64_t decode_tokens = 0;
  /// Needle prompts' shared prefill (the same computation for every configuration: its wall
  /// time and tokens over all trials).
  double needle_prefill_seconds = 0;
  int64_t needle_prefill_tokens = 0;
  /// Needle decode steps through this configuration's own cache (question, answer prefix,
  /// generated tokens) and their wall time.
  double needle_decode_seconds = 0;
  int64_t needle_decode_tokens = 0;
  std::vector<needle_result> needle;
  std::vector<format_map_snapshot> format_map_history;  ///< first sample, then each change

  double decode_tokens_per_s() const { return decode_seconds > 0 ? double(decode_tokens) / decode_seconds : 0; }
  double prefill_tokens_per_s() const {
    return needle_prefill_seconds > 0 ? double(needle_prefill_tokens) / needle_prefill_seconds : 0;
  }
  double needle_decode_tokens_per_s() const {
    return needle_decode_seconds > 0 ? double(needle_decode_tokens) / needle_decode_seconds : 0;
  }
  int needle_passed() const;
  /// Bytes of pages and windows after the teacher-forced run.
  uint64_t kv_bytes() const { return stats.page_bytes + stats.window_bytes; }
};

/// A finished run.
struct eval_report {
  eval_options options;
  model_info model;
  text_info text;
  std::string haystack_hash;
  kvq::cache_shape shape;
  std::string created_utc;  ///< ISO 8601
  double wall_seconds = 0;
  int threads = 1;
  std::vector<needle_trial> trials;
  std::vector<config_result> configs;  ///< in the order given; the reference first if it was added
  /// Index of the reference in `configs`.
  size_t reference = 0;
  /// False in a checkpoint (needle trials not run yet), true when the run finished.
  bool complete = false;
  /// The teacher-forced results were taken from `options.resume_path`, not recomputed.
  bool resumed = false;
};

/// Mean bits per element of the formats of a format map (K and V averaged, scales and zeros
/// included, window not): what pages cost under those decisions.
double nominal_bits(const std::vector<kvq::format_pair>& map, const kvq::cache_shape& shape);

/// Pass counts of `c` per (kind, context), in the order of the run's trials.
std::vector<needle_rate> needle_rates(const config_result& c);

/// fnv1a64 of `bytes` as "fnv1a64:<16 hex digits>".
std::string hash_text(std::string_view bytes);

/// fnv1a64 of the bytes of the file at `path`, as `hash_text` gives it. Errors name the file.
kvq::result<std::string> hash_file(const std::string& path);

/// Checks `o` before anything is loaded: at least one configuration, no duplicate, positive
/// token counts, depths in [0, 1], ... Errors name the option.
kvq::status validate_options(const eval_options& o);

/// Tokens of the next teacher-forced step starting at decode step `s`: as many as every cache can
/// append before it encodes a page (`KVCache::tokens_before_encode`), so each position's query
/// reads exactly what a one-token decode step at that position reads (the same pages, the rest
/// in FP16) and the step runs as one chunk per configuration (matrix products over the chunk's
/// rows, each page decoded once for the chunk's queries); at least 1 (a step that encodes a page
/// is one token, as in decode), at most `max_chunk`, ending at the run's end and at the next
/// format-map sample. One token when a policy watches queries or runs a canary: their decisions
/// depend on every decode step's queries (docs/decisions.md, "Policies and evaluation").
int64_t teacher_forced_chunk(std::span<kvq::KVCache* const> caches, const eval_options& o, int64_t s);

/// Runs the whole evaluation. Errors name the file, the configuration or the option at fault (a
/// missing model or text, a bad configuration spec, a text shorter than prefill + tokens + 1, a
/// needle context beyond the model's training context, ...).
kvq::result<eval_report> run_eval(const eval_options& o);

}  // namespace kvq::eval
