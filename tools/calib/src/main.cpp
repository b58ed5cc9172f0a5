// kvq-calibrate: runs a model over calibration text and writes the calibration artifact
// (docs/architecture.md, "Calibration artifacts"): per (layer, kv head, format) K attention KL and V output
// perturbation, and rolealign clip percentiles, measured by kvq::calib::calibrator on the model's own q, k, v.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <eval/metrics.hpp>
#include <eval/progress.hpp>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <kvq/calib/artifact.hpp>
#include <kvq/calib/calibrate.hpp>
#include <kvq/codec/codec.hpp>
#include <kvq/format/format.hpp>
#include <llama/gguf.hpp>
#include <llama/model.hpp>
#include <llama/tokenizer.hpp>
#include <mutex>
#include <numeric>
#include <optional>
#include <span>
#include <sstream>
#include <thread>

namespace {

using kvq::llama::token_id;

const char* footer = R"(
WHAT IT DOES
  The text is tokenized and cut into segments of --segment tokens (BOS first when the model
  adds one), --tokens in all. Each segment is a fresh sequence run through the model with an
  FP16 kvq cache, in chunks of at most --window tokens; the q, k, v of every layer (after RoPE)
  are collected over the whole segment and given to kvq::calib::calibrator as one causal chunk.
  Per (layer, kv head, candidate format) it measures
    K attention KL  = mean over query rows of KL(softmax(q.K/sqrt d) || softmax(q.K^/sqrt d))
    V perturbation  = sum ||P(V^ - V)||^2 / sum ||P V||^2
  with K^ and V^ the codec's round trip of the segment in pages of --page-tokens tokens (token
  groups aligned as in the cache), and picks per (layer, kv head, role) the rolealign clip
  percentile of --clip-percentiles that minimizes the damage of --clip-formats relative to no
  clipping (p = 100): K by attention KL, V by output perturbation (with --rotated, also on the
  rotated heads: the artifact's rotated_clip_percentiles).
  With --rotated, every candidate is measured a second time on rotated heads (q, K and V rotated
  by the caches' randomized Hadamard transform, damage measured where a rotated cache quantizes)
  into the artifact's "rotated" table (schema version 2).
  With --fit-codebooks, a first pass over the text fits the levels of every codebook candidate
  per (layer, kv head, role) (Lloyd's iteration on the values in units of their group's rms,
  rotated too with --rotated); the second pass measures the candidates with the fitted levels,
  and the artifact's "codebooks" holds them (schema version 3; kvq-eval --codebook-levels).
  See include/kvq/calib/calibrate.hpp for the exact definitions.

OUTPUT KL (--output-kl, slower)
  For each (layer, kv head) and each of --output-kl-formats, the first --output-kl-tokens tokens
  of the text (BOS first when the model adds one) are run through the model with a cache that is
  FP16 except that one unit, whose K and V pages are stored in the format; the artifact's
  output_kl records the mean over teacher-forced positions of KL(P_fp16 || P) of the next-token
  distribution, against the all-FP16 run. These caches encode every full page at once (recent 0,
  window = --page-tokens, the model fed in chunks of --page-tokens tokens), so a position sees the
  unit quantized for every page before its own chunk; positions of the first chunk see nothing
  quantized and are left out of the mean (--output-kl-tokens must exceed --page-tokens). Runs:
  layers x kv heads x formats, + 1 reference, spread over --threads. The summary gives the
  Spearman rank correlation over units of output KL with K attention KL and V perturbation.

OUTPUT
  The artifact JSON (kvq.calibration v2, include/kvq/calib/artifact.hpp), reloaded and
  validated after writing; a per-layer summary on stdout; progress on stderr.

COST
  The calibrator's work per segment grows with segment^2 x (candidates + rolealign variants);
  --threads spreads the layers of a segment over threads.

EXAMPLE
  kvq-calibrate -m models/SmolLM2-135M-Instruct.Q4_1.gguf -t data/eval/calib_emma.txt \
    --tokens 2048 --segment 512 -o docs/data/calib_smollm2.json
)";

kvq::result<std::string> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return kvq::status{kvq::errc::io_error, fmt::format("cannot open text '{}'", path)};
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

kvq::result<std::vector<kvq::format_id>> parse_formats(const std::vector<std::string>& specs, const char* option) {
  std::vector<kvq::format_id> out;
  for (const auto& s : specs) {
    auto f = kvq::parse_format(s);
    if (!f) return kvq::status{f.error().code(), fmt::format("{} '{}': {}", option, s, f.error().message())};
    out.push_back(*f);
  }
  return out;
}

int fail(const kvq::status& s) {
  std::cerr << "kvq-calibrate: " << s.to_string() << "\n";
  return 1;
}

/// Runs work() on `threads` threads (the caller's included) and joins them.
template <class F>
void run_threads(int threads, F&& work) {
  std::vector<std::jthread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back(work);
  work();
}

/// Bytes of an FP16 cache of `model` holding `tokens` tokens with a ring of `window`, with slack.
uint64_t fp16_budget(const kvq::llama::llama_hparams& hp, int64_t tokens, int page_tokens, int window) {
  const uint64_t per_token = uint64_t(hp.n_layer) * uint64_t(hp.n_head_kv) * uint64_t(hp.head_dim) * 2u * 2u;
  return 2 * per_token * uint64_t(tokens + 2 * page_tokens + window) + (16u << 20);
}

/// Output KL with one unit quantized at a time (see the footer, OUTPUT KL).
kvq::result<kvq::calib::output_kl_table> measure_output_kl(const kvq::llama::llama_model& model,
                                                           std::span<const token_id> tokens,
                                                           std::vector<kvq::format_id> formats, int page_tokens,
                                                           const std::vector<float>& clip_percentiles, int threads,
                                                           bool progress) {
  const auto& hp = model.hparams();
  const int64_t N = int64_t(tokens.size()), P = page_tokens, V = hp.n_vocab;
  if (N <= P)
    return kvq::status{kvq::errc::invalid_argument,
                       fmt::format("--output-kl-tokens {} must exceed --page-tokens {}: positions of the first page "
                                   "see no quantized token",
                                   N, P)};
  const uint64_t budget = fp16_budget(hp, N, page_tokens, page_tokens);
  // Log-probabilities of positions [P, N) under the policy `spec`, into `logp` ([N - P][V]).
  const auto run = [&](const std::string& spec, std::vector<float>& logits, std::vector<double>& logp) -> kvq::status {
    auto cache_r = kvq::llama::make_cache(model, spec, budget, page_tokens, page_tokens, 0);
    if (!cache_r) return cache_r.error();
    kvq::KVCache& cache = cache_r.value();
    KVQ_TRY(cache.set_clip_percentiles(clip_percentiles));
    KVQ_TRY(cache.create_sequence(0));
    KVQ_TRY(model.forward(cache, 0, tokens, logits, kvq::llama::logits_mode::all));
    for (int64_t p = P; p < N; ++p)
      kvq::eval::log_softmax(std::span<const float>(logits).subspan(size_t(p * V), size_t(V)),
                             std::span<double>(logp).subspan(size_t((p - P) * V), size_t(V)));
    return {};
  };
  auto table = kvq::calib::output_kl_table::make(hp.n_layer, hp.n_head_kv, std::move(formats), N);
  const int64_t F = int64_t(table.formats.size()), units = int64_t(hp.n_layer) * hp.n_head_kv;
  kvq::eval::progress_bar bar("output KL", units * F + 1, progress);
  std::vector<float> logits(size_t(N * V));
  std::vector<double> ref(size_t((N - P) * V));
  KVQ_TRY(run("fp16", logits, ref));
  bar.advance(1);
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  kvq::status first_error;
  std::mutex mu;
  run_threads(threads, [&] {
    std::vector<float> lg(size_t(N * V));
    std::vector<double> lp(ref.size());
    for (int64_t i; !failed.load() && (i = next.fetch_add(1)) < units * F;) {
      const int l = int(i / F / hp.n_head_kv), h = int((i / F) % hp.n_head_kv), f = int(i % F);
      kvq::status s = run(fmt::format("fp16;{}.{}={}", l, h, kvq::format_name(table.formats[size_t(f)])), lg, lp);
      if (!s.ok()) {
        std::lock_guard lock(mu);
        if (!failed.exchange(true)) first_error = std::move(s);
        return;
      }
      double sum = 0;
      for (int64_t p = 0; p < N - P; ++p)
        sum += kvq::eval::kl_divergence(std::span<const double>(ref).subspan(size_t(p * V), size_t(V)),
                                        std::span<const double>(lp).subspan(size_t(p * V), size_t(V)));
      table.at(l, h, f) = sum / double(N - P);
      bar.advance(1);
    }
  });
  bar.finish();
  if (failed) return first_error;
  return table;
}

/// Ranks of `x` (1 = smallest), ties given their average rank.
std::vector<double> ranks(const std::vector<double>& x) {
  std::vector<size_t> order(x.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return x[a] < x[b]; });
  std::vector<double> r(x.size());
  for (size_t i = 0; i < order.size();) {
    size_t j = i;
    while (j + 1 < order.size() && x[order[j + 1]] == x[order[i]]) ++j;
    for (size_t k = i; k <= j; ++k) r[order[k]] = double(i + j) / 2.0 + 1.0;
    i = j + 1;
  }
  return r;
}

/// Spearman rank correlation of `a` and `b` (Pearson correlation of their ranks); 0 when either is
/// constant.
double spearman(const std::vector<double>& a, const std::vector<double>& b) {
  const std::vector<double> ra = ranks(a), rb = ranks(b);
  const double n = double(ra.size()), mean = (n + 1.0) / 2.0;
  double sab = 0, saa = 0, sbb = 0;
  for (size_t i = 0; i < ra.size(); ++i) {
    sab += (ra[i] - mean) * (rb[i] - mean);
    saa += (ra[i] - mean) * (ra[i] - mean);
    sbb += (rb[i] - mean) * (rb[i] - mean);
  }
  return saa > 0 && sbb > 0 ? sab / std::sqrt(saa * sbb) : 0.0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "kvq-calibrate: measure per-(layer, kv head, format) sensitivities and rolealign clip percentiles on "
      "calibration text; write the calibration artifact"};
  app.footer(footer);
  std::string model_path, text_path, out_path, model_name;
  int64_t max_tokens = 2048;
  int segment = 512, page_tokens = 64, window = 128, threads = 1;
  std::vector<std::string> formats, clip_formats = {"ra4/g32", "ra2/g32"};
  std::vector<float> clip_grid = kvq::calib::calibrator_options{}.clip_percentile_grid;
  bool no_progress = false, output_kl = false, rotated = false, fit_codebooks = false;
  int64_t output_kl_tokens = 128;
  std::vector<std::string> output_kl_formats;
  app.add_option("-m,--model", model_path, "GGUF model (llama, qwen2 or gemma architecture)")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("-t,--text", text_path, "calibration text (UTF-8)")->required()->check(CLI::ExistingFile);
  app.add_option("-o,--out", out_path, "artifact JSON to write")->required();
  app.add_option("--tokens", max_tokens, "tokens to calibrate on (0: the whole text)")->capture_default_str();
  app.add_option("--segment", segment, "tokens per segment: one sequence, one causal chunk for the calibrator")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 16));
  app.add_option("--page-tokens", page_tokens, "page size the formats are measured at")->capture_default_str();
  app.add_option("--window", window, "FP16 window R of the runner's cache (longest forward chunk)")
      ->capture_default_str();
  app.add_option("--formats", formats,
                 "candidate formats (default: kivi8/g32 kivi4/g32 kivi2/g32 sym8/g32 sym4/g32 fp8)");
  app.add_option("--clip-percentiles", clip_grid,
                 "rolealign clip percentiles to try, in [50, 100] (100: no clipping; at most 16 order statistics "
                 "per end of a 128-value group)")
      ->capture_default_str();
  app.add_option("--clip-formats", clip_formats, "rolealign formats whose damage picks the clip percentile")
      ->capture_default_str();
  app.add_option("--model-name", model_name, "name recorded in the artifact (default: the GGUF's general.name)");
  app.add_option("--threads", threads, "threads for the calibrator (layers in parallel)")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  app.add_flag(
      "--rotated", rotated,
      "also measure every candidate on rotated heads (randomized Hadamard, the caches' default seed) into the "
      "artifact's rotated damages, which kl_budget and autok read for a rotated cache (kvq-eval <config>+rot)");
  app.add_flag(
      "--fit-codebooks", fit_codebooks,
      "fit the levels of every codebook candidate (cb<b>[/g<G>] in --formats; rotated too with --rotated) per "
      "(layer, kv head, role) in a first pass over the text, then measure the candidates with them; the artifact's "
      "codebooks hold them (kvq-eval --codebook-levels)");
  app.add_flag("--output-kl", output_kl,
               "also measure the output KL with one (layer, kv head) quantized at a time (slow; see OUTPUT KL)");
  app.add_option("--output-kl-tokens", output_kl_tokens, "teacher-forced tokens of each output-KL run")
      ->capture_default_str()
      ->check(CLI::Range(int64_t(2), int64_t(1) << 20));
  app.add_option("--output-kl-formats", output_kl_formats,
                 "formats of the output-KL runs, of --formats (default: all of them)")
      ->delimiter(',');
  app.add_flag("--no-progress", no_progress, "no progress bar on stderr");
  CLI11_PARSE(app, argc, argv);

  // ---- model, tokenizer, text
  auto file = kvq::llama::gguf_file::open(model_path);
  if (!file) return fail(file.error());
  auto model_r = kvq::llama::llama_model::load(*file);
  if (!model_r) return fail(model_r.error());
  auto tok_r = kvq::llama::tokenizer::from_gguf(*file);
  if (!tok_r) return fail(tok_r.error());
  const auto& model = *model_r;
  const auto& tok = *tok_r;
  const auto& hp = model.hparams();
  auto text = read_file(text_path);
  if (!text) return fail(text.error());
  const std::vector<token_id> all = tok.encode(*text, false, false);
  const bool bos = tok.add_bos() && tok.bos() >= 0;
  const int per_segment = segment - (bos ? 1 : 0);
  if (per_segment < 1) return fail({kvq::errc::invalid_argument, "--segment must leave room for one text token"});
  const int64_t want = max_tokens > 0 ? max_tokens : int64_t(all.size()) + int64_t(all.size() / per_segment + 1);
  std::vector<std::vector<token_id>> segments;
  int64_t total = 0;
  for (size_t at = 0; at < all.size() && total < want;) {
    const int64_t room = std::min<int64_t>(segment, want - total);
    if (room <= (bos ? 1 : 0)) break;
    std::vector<token_id> s;
    if (bos) s.push_back(tok.bos());
    const size_t n = std::min(all.size() - at, size_t(room - (bos ? 1 : 0)));
    s.insert(s.end(), all.begin() + int64_t(at), all.begin() + int64_t(at + n));
    at += n;
    total += int64_t(s.size());
    segments.push_back(std::move(s));
  }
  if (max_tokens > 0 && total < max_tokens)
    return fail({kvq::errc::invalid_argument,
                 fmt::format("text '{}' gives {} tokens in segments of {}; --tokens {} asks for more", text_path, total,
                             segment, max_tokens)});

  // ---- calibrator
  kvq::cache_shape shape = model.cache_shape();
  shape.page_tokens = page_tokens;
  shape.window = window;
  shape.recent = std::min(shape.recent, window / 2);
  kvq::calib::calibrator_options opt;
  if (!formats.empty()) {
    auto f = parse_formats(formats, "--formats");
    if (!f) return fail(f.error());
    opt.formats = *f;
  }
  {
    auto f = parse_formats(clip_formats, "--clip-formats");
    if (!f) return fail(f.error());
    opt.clip_formats = *f;
  }
  opt.clip_percentile_grid = clip_grid;
  opt.rotated = rotated;
  opt.model_name = model_name.empty() ? model.name() : model_name;
  auto cal_r = kvq::calib::calibrator::create(shape, opt);
  if (!cal_r) return fail(cal_r.error());
  std::vector<kvq::format_id> okf = opt.formats;  // of the output-KL runs
  if (output_kl && !output_kl_formats.empty()) {
    auto f = parse_formats(output_kl_formats, "--output-kl-formats");
    if (!f) return fail(f.error());
    for (size_t i = 0; i < f->size(); ++i)
      if (std::find(opt.formats.begin(), opt.formats.end(), (*f)[i]) == opt.formats.end())
        return fail(
            {kvq::errc::invalid_argument,
             fmt::format("--output-kl-formats '{}' is not one of the calibration's formats", output_kl_formats[i])});
    okf = *f;
  }
  std::vector<token_id> first;  // the tokens of the output-KL runs
  if (output_kl) {
    if (output_kl_tokens <= page_tokens)
      return fail({kvq::errc::invalid_argument,
                   fmt::format("--output-kl-tokens {} must exceed --page-tokens {}", output_kl_tokens, page_tokens)});
    if (bos) first.push_back(tok.bos());
    const size_t n_text = size_t(output_kl_tokens) - first.size();
    if (all.size() < n_text)
      return fail(
          {kvq::errc::invalid_argument, fmt::format("text '{}' has {} tokens; --output-kl-tokens {} asks for more",
                                                    text_path, all.size(), output_kl_tokens)});
    first.insert(first.end(), all.begin(), all.begin() + int64_t(n_text));
  }
  auto& cal = cal_r.value();
  // With --fit-codebooks, a first pass fits the codebook candidates' levels (only they are measured
  // there); the calibrator of the second pass, which writes the artifact, measures with them.
  std::optional<kvq::calib::calibrator> fit_cal;
  if (fit_codebooks) {
    kvq::calib::calibrator_options fo = opt;
    fo.formats.clear();
    for (kvq::format_id f : opt.formats)
      if (kvq::codec::is_codebook_format(f)) fo.formats.push_back(f);
    if (fo.formats.empty())
      return fail({kvq::errc::invalid_argument, "--fit-codebooks: no codebook format (cb<b>[/g<G>]) in --formats"});
    fo.clip_formats.clear();
    fo.clip_percentile_grid = {kvq::codec::no_clip};
    fo.fit_codebooks = true;
    auto fc = kvq::calib::calibrator::create(shape, fo);
    if (!fc) return fail(fc.error());
    fit_cal.emplace(std::move(fc).value());
  }

  // ---- the runner's cache (FP16, one segment at a time)
  auto cache_r = kvq::llama::make_cache(model, "fp16", fp16_budget(hp, segment, page_tokens, window), page_tokens,
                                        window, shape.recent);
  if (!cache_r) return fail(cache_r.error());
  auto& cache = cache_r.value();

  std::cerr << fmt::format(
      "kvq-calibrate: {} ({} layers, {} q heads, {} kv heads, head_dim {}), {} tokens of '{}' "
      "in {} segment(s) of up to {}, {} candidate formats, clip percentile grid of {}, {} thread(s)\n",
      opt.model_name, hp.n_layer, hp.n_head, hp.n_head_kv, hp.head_dim, total, text_path, segments.size(), segment,
      opt.formats.size(), opt.clip_percentile_grid.size(), threads);

  const int L = hp.n_layer;
  const int64_t dq = int64_t(hp.n_head) * hp.head_dim, dkv = int64_t(hp.n_head_kv) * hp.head_dim;
  std::vector<std::vector<float>> qs(static_cast<size_t>(L)), ks(static_cast<size_t>(L)), vs(static_cast<size_t>(L));
  std::vector<float> logits(size_t(hp.n_vocab));
  double t_model = 0, t_calib = 0;
  // One pass of the model over every segment, each layer's q, k, v given to `c`.
  const auto run_pass = [&](kvq::calib::calibrator& c, const char* label) -> kvq::status {
    kvq::eval::progress_bar bar(label, total, !no_progress);
    for (size_t si = 0; si < segments.size(); ++si) {
      const auto& seg = segments[si];
      const int64_t T = int64_t(seg.size());
      for (int l = 0; l < L; ++l) {
        qs[size_t(l)].assign(size_t(T * dq), 0.f);
        ks[size_t(l)].assign(size_t(T * dkv), 0.f);
        vs[size_t(l)].assign(size_t(T * dkv), 0.f);
      }
      const kvq::llama::layer_observer collect = [&](int l, int64_t pos0, std::span<const float> q,
                                                     std::span<const float> k, std::span<const float> v) {
        std::copy(q.begin(), q.end(), qs[size_t(l)].begin() + pos0 * dq);
        std::copy(k.begin(), k.end(), ks[size_t(l)].begin() + pos0 * dkv);
        std::copy(v.begin(), v.end(), vs[size_t(l)].begin() + pos0 * dkv);
      };
      const auto t0 = std::chrono::steady_clock::now();
      if (auto s = cache.create_sequence(kvq::seq_id(si)); !s.ok()) return s;
      if (auto s = model.forward(cache, kvq::seq_id(si), seg, logits, kvq::llama::logits_mode::last, collect); !s.ok())
        return s;
      if (auto s = cache.release_sequence(kvq::seq_id(si)); !s.ok()) return s;
      const auto t1 = std::chrono::steady_clock::now();
      // Layers are independent for the calibrator: spread them over the threads.
      std::vector<kvq::status> st(static_cast<size_t>(L));
      std::atomic<int> next{0};
      const auto work = [&] {
        for (int l; (l = next.fetch_add(1)) < L;)
          st[size_t(l)] = c.observe(l, {qs[size_t(l)].data(), kvq::dtype::f32, T, hp.n_head, hp.head_dim, 0},
                                    {ks[size_t(l)].data(), kvq::dtype::f32, T, hp.n_head_kv, hp.head_dim, 0},
                                    {vs[size_t(l)].data(), kvq::dtype::f32, T, hp.n_head_kv, hp.head_dim, 0});
      };
      run_threads(threads, work);
      for (const auto& s : st)
        if (!s.ok()) return s;
      const auto t2 = std::chrono::steady_clock::now();
      t_model += std::chrono::duration<double>(t1 - t0).count();
      t_calib += std::chrono::duration<double>(t2 - t1).count();
      bar.advance(T);
    }
    bar.finish();
    return {};
  };
  if (fit_cal) {
    if (auto s = run_pass(*fit_cal, "codebook fit"); !s.ok()) return fail(s);
    auto fitted = fit_cal->fitted_codebooks();
    if (!fitted) return fail(fitted.error());
    opt.codebook_levels = std::move(fitted).value();
    auto c2 = kvq::calib::calibrator::create(shape, opt);
    if (!c2) return fail(c2.error());
    cal = std::move(c2).value();
  }
  if (auto s = run_pass(cal, "calibration"); !s.ok()) return fail(s);

  // ---- artifact
  kvq::calib::artifact art;
  auto prof = cal.result(&art, *text);
  if (!prof) return fail(prof.error());
  // The hash is of the whole file; record the tokens actually measured.
  art.calibration_tokens = total;
  double t_output_kl = 0;
  if (output_kl) {
    std::cerr << fmt::format("kvq-calibrate: output KL over {} tokens: {} units x {} format(s) = {} runs + 1\n",
                             first.size(), hp.n_layer * hp.n_head_kv, okf.size(),
                             int64_t(hp.n_layer) * hp.n_head_kv * int64_t(okf.size()));
    const auto t0 = std::chrono::steady_clock::now();
    auto table = measure_output_kl(model, first, okf, page_tokens, art.clip_percentiles, threads, !no_progress);
    if (!table) return fail(table.error());
    art.output_kl = std::move(table).value();
    t_output_kl = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  if (const auto dir = std::filesystem::path(out_path).parent_path(); !dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
  }
  if (auto s = art.save(out_path); !s.ok()) return fail(s);
  auto back = kvq::calib::artifact::load(out_path, art.shape);
  if (!back) return fail(back.error());

  // ---- summary: per layer, K KL and V perturbation (mean over kv heads) of each candidate
  std::cout << "mean over kv heads of K attention KL (nats) and V output perturbation, per layer:\n";
  std::cout << fmt::format("{:>5}", "layer");
  for (auto f : opt.formats) std::cout << fmt::format(" {:>12}", "K " + kvq::format_name(f));
  for (auto f : opt.formats) std::cout << fmt::format(" {:>12}", "V " + kvq::format_name(f));
  std::cout << "  clip percentile K / V per head\n";
  const auto clips = cal.clip_percentiles();
  for (int l = 0; l < L; ++l) {
    std::cout << fmt::format("{:>5}", l);
    for (kvq::role r : {kvq::role::k, kvq::role::v})
      for (size_t fi = 0; fi < opt.formats.size(); ++fi) {
        double sum = 0;
        for (int h = 0; h < hp.n_head_kv; ++h) sum += prof->at(l, h, r, int(fi));
        std::cout << fmt::format(" {:>12.3e}", sum / hp.n_head_kv);
      }
    std::cout << " ";
    for (int h = 0; h < hp.n_head_kv; ++h)
      std::cout << fmt::format(" {}/{}", clips[(size_t(l) * hp.n_head_kv + h) * 2],
                               clips[(size_t(l) * hp.n_head_kv + h) * 2 + 1]);
    std::cout << "\n";
  }
  // how many units clip, per role, unrotated and (with --rotated) rotated
  for (const bool rot : {false, true}) {
    if (rot && !opt.rotated) continue;
    const auto table = cal.clip_percentiles(rot);
    int below[2] = {0, 0};
    for (size_t i = 0; i < table.size(); ++i) below[i % 2] += table[i] < kvq::codec::no_clip;
    std::cout << fmt::format("{}clip percentile below 100: K {} and V {} of {} (layer, kv head) units\n",
                             rot ? "rotated heads: " : "", below[0], below[1], table.size() / 2);
  }
  if (!art.output_kl.empty()) {
    // Does the one-pass measure rank the units as the output KL does?
    std::cout << fmt::format("output KL (nats, mean over {} positions) per unit, Spearman over {} units:\n",
                             art.output_kl.tokens - page_tokens, L * hp.n_head_kv);
    for (size_t f = 0; f < art.output_kl.formats.size(); ++f) {
      const int pf = prof->format_index(art.output_kl.formats[f]);
      std::vector<double> o, k, v;
      for (int l = 0; l < L; ++l)
        for (int h = 0; h < hp.n_head_kv; ++h) {
          o.push_back(art.output_kl.at(l, h, int(f)));
          k.push_back(prof->at(l, h, kvq::role::k, pf));
          v.push_back(prof->at(l, h, kvq::role::v, pf));
        }
      const auto top = std::max_element(o.begin(), o.end()) - o.begin();
      std::cout << fmt::format(
          "  {:>10}: mean {:.3e}, max {:.3e} (layer {} head {}); spearman vs K attention KL {:+.3f}, "
          "vs V perturbation {:+.3f}\n",
          kvq::format_name(art.output_kl.formats[f]), std::accumulate(o.begin(), o.end(), 0.0) / double(o.size()),
          o[size_t(top)], top / hp.n_head_kv, top % hp.n_head_kv, spearman(o, k), spearman(o, v));
    }
  }
  std::cout << fmt::format(
      "wrote {}: {} tokens in {} segment(s) of up to {}; model {:.1f} s, calibrator {:.1f} s, output KL {:.1f} s "
      "({} thread(s)); reloaded and validated\n",
      out_path, total, segments.size(), segment, t_model, t_calib, t_output_kl, threads);
  return 0;
}
