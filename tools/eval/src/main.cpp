// kvq-eval: compares KV-cache configurations on one model and one text (docs/architecture.md).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <eval/config.hpp>
#include <eval/report.hpp>
#include <eval/runner.hpp>
#include <iostream>
#include <mutex>

namespace {

const std::vector<std::string> default_configs = {"fp16", "int8", "kivi4/g32", "kivi2/g32", "ra4/g32", "fp8"};

std::string quote_arg(std::string_view a) {
  if (!a.empty() && a.find_first_of(" \t\"'$;&|<>()*?`\\") == std::string_view::npos) return std::string(a);
  std::string s = "'";
  for (char c : a) s += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return s + "'";
}

std::string footer() {
  std::string s = R"(
CONFIGURATIONS (--config, repeatable; default: fp16 int8 kivi4/g32 kivi2/g32 ra4/g32 fp8)
  A configuration is <policy>:<params> or a bare format spec (= static:<spec>). Policies:
)";
  for (const auto& e : kvq::eval::policy_registry()) s += fmt::format("    {:<24} {}\n", e.syntax, e.help);
  s += R"(  Policy parameters are key=value pairs separated by commas; an unknown key is an error.
  artifact=PATH is a calibration artifact written by kvq-calibrate (tools/calib) for this model.
  random's like= takes the rest of the string (commas included), so it comes last, e.g.
  random:seed=2,like=kl_budget:bits=4,artifact=docs/data/calib_smollm2.json
)";
  s += R"(  Format specs: fp16, bf16, fp8, nvfp4, int8 (= sym8), int4 (= sym4/g32), int2, sym<b>[/g<G>],
  kivi<b>/g<G>, ra<b>/g<G> (rolealign: clips each group to the percentiles of --clip-percentiles;
  without them it clips nothing and equals kivi<b>/g<G>), b in {8,4,3,2}, cb<b>[/g<G>] (codebook: Lloyd-Max
  levels, b in {4,3,2}), G in {32,64,128}; K and V apart: k=kivi4/g32,v=kivi2/g32; per layer /
  head overrides after ';': k=kivi2/g32,v=kivi2/g32;0=fp16;5.1=int8. A '+rot' suffix on a
  configuration rotates every (layer, kv head) (randomized Hadamard: kivi2/g32+rot,
  echokv:...+rot); a rotated rolealign configuration takes the artifact's rotated clip
  percentiles (kvq-calibrate --rotated) and is refused with an artifact that has none. A
  '+sink' suffix keeps the first page of every sequence FP16 (attention sinks; '+sink<N>': N pages): kivi2/g32+rot+sink. The FP16 cache
  (fp16) is the reference; it is added when no configuration is fp16.

WHAT IS MEASURED (every configuration on the same tokens and positions)
  The text is tokenized; the first --prefill tokens are prefilled once at full precision into
  every cache (each stores them in its format), then --tokens teacher-forced positions, each
  query reading exactly what a one-token decode step at its position reads (the pages encoded by
  then, the rest in FP16): positions go in chunks that end before the next page encode (a step
  that encodes a page is one token), one token per step when a policy watches queries
  (EchoKV); all configurations in lockstep (one step of the model over all of them, each
  attending through its own cache).
  At each position: KL(P_fp16 || P_config) of the next-token distributions (nats), top-1
  agreement with the FP16 cache, and the log-likelihood of the true next token (perplexity).
  Bits per element = bytes of pages + FP16 windows over all K/V elements held (scales and zeros
  included); page bits = pages only; KV bytes and the ratio to an FP16 cache of the same tokens.
  Forced tok/s = positions / (the steps' matrix products shared equally among the
  configurations + the configuration's own cache calls): compare speeds within one run.
  Needle: for each --needle-ctx, --needle-kinds, --needle-depths and --needle-reps: single,
  "The pass key is NNNNN. Remember it." at that depth of the haystack, the prompt asks "What is
  the pass key?"; multi, four "The special magic number for <label> is NNNNNNN." at different
  depths, the prompt asks for one label's number. The haystack part is prefilled once in full
  precision into every cache; the question and the answer prefix go through each cache one token
  at a time, then greedy decoding; a trial passes when the first digits written are the key.

OUTPUT
  A table on stdout; --json writes the full record (schema kvq.eval v1: per configuration bits,
  bytes, KL statistics, KL by position, agreement, perplexity, needle answers, speed, format
  map and format_map_history); --html writes a self-contained report with SVG charts.
  Long-context buckets: KL, top-1 and perplexity per range of absolute positions with fixed
  edges 0, 512, 1K, 2K, 4K, 8K (position_buckets; the table prints them below the summary).
  Progress bars go to stderr (--no-progress to silence them).

RESUME
  The JSON is written when the teacher-forced phase ends ("complete": false) and at the end.
  Rerun the same command with --resume to continue a run that stopped: the teacher-forced
  results are read back from --json and finished needle trials are not rerun. A record of
  another run (model, text, haystack, configurations, positions, cache or needle options)
  is refused with a line naming what differs.

EXAMPLE
  kvq-eval -m models/SmolLM2-135M-Instruct.Q4_1.gguf -t data/eval/eval_persuasion.txt \
    --haystack data/eval/haystack_sense_and_sensibility.txt \
    --json eval.json --html eval.html
)";
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  kvq::eval::eval_options o;
  std::string json_path, html_path;
  bool no_progress = false, no_needle = false, resume = false;
  double budget_mib = 0;

  CLI::App app{
      "kvq-eval: compare KV-cache configurations (formats and policies) of kvq on a GGUF model and a text:\n"
      "bits per element, KV bytes, KL to the FP16 cache, top-1 agreement, perplexity, needle retrieval, "
      "decode speed and format maps.",
      "kvq-eval"};
  app.get_formatter()->column_width(34);
  app.footer(footer());
  app.add_option("-m,--model", o.model_path, "GGUF model file (llama, qwen2 or gemma architecture)")->required();
  app.add_option("-t,--text", o.text_path, "evaluation text, UTF-8 (needs prefill + tokens + 1 tokens)")->required();
  app.add_option("--haystack", o.haystack_path, "needle haystack text (default: the evaluation text)");
  app.add_option("-c,--config", o.configs, "cache configuration, repeatable (see CONFIGURATIONS)");
  app.add_option("--prefill", o.prefill, "text tokens fed as a prefill before the measured decode steps")
      ->capture_default_str();
  app.add_option("-n,--tokens", o.tokens, "teacher-forced decode steps (measured positions)")->capture_default_str();
  app.add_option("--needle-ctx", o.needle_contexts, "needle prompt lengths in tokens, comma separated")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--needle-depths", o.needle_depths,
                 "needle depths in [0, 1] (fraction of the haystack), comma separated")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--needle-kinds", o.needle_kinds,
                 "needle kinds, comma separated: single (pass key), multi (multi-key, one of several asked)")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--needle-reps", o.needle_reps, "repetitions (different keys) per context and depth")
      ->capture_default_str();
  app.add_option("--needle-max-new", o.needle_max_new, "most tokens generated per needle answer")
      ->capture_default_str();
  app.add_flag("--no-needle", no_needle, "skip the needle trials");
  app.add_option("--template", o.prompt_template,
                 "needle prompt template: auto (chatml if the model has a chat template), chatml, plain")
      ->capture_default_str();
  app.add_option("--seed", o.seed, "seed of the needle keys")->capture_default_str();
  app.add_option("-j,--threads", o.threads, "threads of the model's products and of the configurations' attention; 0 = all cores")
      ->capture_default_str();
  app.add_option("--page-tokens", o.cache.page_tokens, "cache page size in tokens")->capture_default_str();
  app.add_option("--window", o.cache.window, "FP16 recent window R (and the longest prefill chunk)")
      ->capture_default_str();
  app.add_option("--recent", o.cache.recent, "tokens kept unencoded r")->capture_default_str();
  app.add_option("--budget-mib", budget_mib, "cache byte budget in MiB per cache; 0 = enough for the run in FP16")
      ->capture_default_str();
  app.add_option("--clip-percentiles", o.clip_percentiles_path,
                 "calibration artifact (kvq-calibrate, same model) whose rolealign clip percentiles every cache gets "
                 "(rotated heads: its rotated ones); without it ra<b> clips nothing (= kivi<b>)");
  app.add_option("--codebook-levels", o.codebook_levels_path,
                 "calibration artifact (kvq-calibrate --fit-codebooks, same model) whose fitted codebook levels every "
                 "cache's cb<b> pages encode with (rotated heads: the rotated fit); without it the Lloyd-Max levels");
  app.add_option("--kl-bucket", o.kl_bucket, "positions per point of the KL-over-position series")
      ->capture_default_str();
  app.add_option("--map-every", o.map_every, "decode steps between format-map samples (format_map_history)")
      ->capture_default_str();
  app.add_option("--json", json_path, "write the JSON record here");
  app.add_option("--html", html_path, "write the self-contained HTML report here");
  app.add_flag("--no-progress", no_progress, "no progress bars on stderr");
  app.add_flag("--resume", resume,
               "continue the run whose record --json names (same model, texts, configurations and options): its "
               "teacher-forced results are read back, its finished needle trials not rerun; a missing file starts "
               "afresh");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (o.configs.empty()) o.configs = default_configs;
  if (no_needle) o.needle_contexts.clear();
  o.progress = !no_progress;
  if (resume && json_path.empty()) {
    fmt::print(stderr, "kvq-eval: --resume needs --json PATH (the record to continue)\n");
    return 1;
  }
  if (resume) o.resume_path = json_path;
  o.cache.budget_bytes = uint64_t(budget_mib * 1024.0 * 1024.0);
  for (int i = 0; i < argc; ++i) o.command_line += (i ? " " : "") + quote_arg(argv[i]);

  // Writes the JSON and HTML files; on a checkpoint quietly (the final write reports).
  auto write_outputs = [&](const kvq::eval::eval_report& r, bool final) -> kvq::status {
    if (!json_path.empty()) {
      KVQ_TRY(kvq::eval::write_text_file(json_path, kvq::eval::to_json(r).dump(1)));
      if (final) fmt::print("JSON: {}\n", json_path);
    }
    if (!html_path.empty()) {
      KVQ_TRY(kvq::eval::write_text_file(html_path, kvq::eval::render_html(r)));
      if (final) fmt::print("HTML: {}\n", html_path);
    }
    return {};
  };
  // Checkpoints may come from the needle workers too (one after each trial): one at a time, and
  // only the first, when the teacher-forced phase is done, is announced.
  std::mutex checkpoint_mu;
  o.on_checkpoint = [&](const kvq::eval::eval_report& r) {
    std::lock_guard lock(checkpoint_mu);
    const bool first = std::none_of(r.configs.begin(), r.configs.end(), [](const kvq::eval::config_result& c) {
      return std::any_of(c.needle.begin(), c.needle.end(), [](const kvq::eval::needle_result& n) { return n.done; });
    });
    if (auto s = write_outputs(r, false); !s.ok())
      fmt::print(stderr, "kvq-eval: checkpoint: {}\n", s.to_string());
    else if (first && (!json_path.empty() || !html_path.empty()))
      fmt::print(stderr, "teacher-forced phase done: checkpoint written (\"complete\": false); needle trials next\n");
  };

  auto report = kvq::eval::run_eval(o);
  if (!report) {
    fmt::print(stderr, "kvq-eval: {}\n", report.error().to_string());
    return 1;
  }
  fmt::print("{}", kvq::eval::render_table(*report));
  if (auto s = write_outputs(*report, true); !s.ok()) {
    fmt::print(stderr, "kvq-eval: {}\n", s.to_string());
    return 1;
  }
  return 0;
}
