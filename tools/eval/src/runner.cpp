#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <ctime>
#include <eval/progress.hpp>
#include <eval/report.hpp>
#include <eval/runner.hpp>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <numeric>
#include <set>
#include <thread>

namespace kvq::eval {

namespace {

using clock_type = std::chrono::steady_clock;
using kvq::llama::token_id;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

kvq::result<std::string> read_file(const std::string& path, std::string_view what) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    return kvq::status{kvq::errc::io_error, fmt::format("{} '{}' does not exist or is not a file", what, path)};
  std::ifstream in(path, std::ios::binary);
  if (!in) return kvq::status{kvq::errc::io_error, fmt::format("{} '{}' cannot be opened", what, path)};
  std::string s{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (s.empty()) return kvq::status{kvq::errc::invalid_argument, fmt::format("{} '{}' is empty", what, path)};
  return s;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::vector<kvq::format_pair> current_map(const kvq::KVCache& cache) {
  const auto& sh = cache.config().shape;
  std::vector<kvq::format_pair> m;
  m.reserve(size_t(sh.layers) * sh.kv_heads);
  for (int l = 0; l < sh.layers; ++l)
    for (int h = 0; h < sh.kv_heads; ++h) m.push_back(cache.active_policy().current(l, h));
  return m;
}

void sample_map(config_result& r, const kvq::KVCache& cache, int64_t step, int64_t position) {
  auto m = current_map(cache);
  if (r.format_map_history.empty() || r.format_map_history.back().map != m)
    r.format_map_history.push_back({step, position, std::move(m)});
}

/// Caches of every configuration for `max_tokens` tokens, each with an empty sequence 0.
kvq::result<std::vector<kvq::KVCache>> make_caches(const kvq::llama::llama_model& model,
                                                   const std::vector<config_result>& configs, cache_settings cs,
                                                   int64_t max_tokens) {
  cs.max_tokens = max_tokens;
  std::vector<kvq::KVCache> caches;
  caches.reserve(configs.size());
  for (const auto& c : configs) {
    auto cache = make_eval_cache(model, c.config, cs);
    if (!cache) return cache.error();
    caches.push_back(std::move(cache).value());
    KVQ_TRY(caches.back().create_sequence(0));
  }
  return caches;
}

std::vector<kvq::KVCache*> pointers(std::vector<kvq::KVCache>& caches) {
  std::vector<kvq::KVCache*> p;
  for (auto& c : caches) p.push_back(&c);
  return p;
}

/// The teacher-forced run: the first `o.prefill` tokens prefilled once for all configurations at
/// full precision (`prefill_shared`), then every configuration in lockstep (`forward_lanes`: one
/// pass over the weights per step), in steps of `teacher_forced_chunk` positions.
kvq::status teacher_forced(const kvq::llama::llama_model& model, const eval_options& o,
                           const std::vector<token_id>& text, std::vector<config_result>& results, size_t ref) {
  const size_t V = size_t(model.hparams().n_vocab), n = results.size();
  auto made = make_caches(model, results, o.cache, o.prefill + o.tokens);
  if (!made) return made.error();
  std::vector<kvq::KVCache> caches = std::move(made).value();
  const std::vector<kvq::KVCache*> ptrs = pointers(caches);
  const std::vector<kvq::seq_id> seqs(n, 0);
  for (size_t i = 0; i < n; ++i) results[i].policy_name = caches[i].active_policy().name();

  // One unit per position of the lockstep (every configuration has fed it): positions per second.
  progress_bar bar("teacher-forced", o.prefill + o.tokens, o.progress, "pos");
  std::vector<float> logits(n * V);
  std::vector<double> logp(n * V), seconds(n);
  if (o.prefill > 0) {
    const std::span<const token_id> pre(text.data(), size_t(o.prefill));
    KVQ_TRY(model.prefill_shared(ptrs, seqs, pre, std::span<float>(logits.data(), V)));
    bar.advance(o.prefill);
  }
  std::vector<token_id> toks;
  for (int64_t s = 0; s < o.tokens;) {
    const int64_t pos = o.prefill + s, C = teacher_forced_chunk(ptrs, o, s);
    if (o.map_every > 0 && s % o.map_every == 0)
      for (size_t i = 0; i < n; ++i) sample_map(results[i], caches[i], s, pos);
    toks.clear();
    for (size_t i = 0; i < n; ++i) toks.insert(toks.end(), text.begin() + pos, text.begin() + pos + C);
    logits.resize(n * size_t(C) * V);
    std::fill(seconds.begin(), seconds.end(), 0.0);
    KVQ_TRY(model.forward_lanes(ptrs, seqs, toks, logits, seconds));
    for (size_t i = 0; i < n; ++i) {
      results[i].decode_seconds += seconds[i];
      results[i].decode_tokens += C;
    }
    for (int64_t j = 0; j < C; ++j) {  // lane i's row j: logits[(i * C + j) * V ...]
      for (size_t i = 0; i < n; ++i)
        log_softmax(std::span<const float>(logits.data() + (i * size_t(C) + size_t(j)) * V, V),
                    std::span<double>(logp.data() + i * V, V));
      const token_id next = text[size_t(pos + j) + 1];
      const std::span<const double> ref_logp(logp.data() + ref * V, V);
      const int64_t ref_top = argmax(ref_logp);
      for (size_t i = 0; i < n; ++i) {
        const std::span<const double> lp(logp.data() + i * V, V);
        const double kl = i == ref ? 0.0 : kl_divergence(ref_logp, lp);
        results[i].quality.add(kl, argmax(lp) == ref_top, -lp[size_t(next)]);
      }
    }
    bar.advance(C);
    s += C;
  }
  bar.finish();
  for (size_t i = 0; i < n; ++i) {
    sample_map(results[i], caches[i], o.tokens, o.prefill + o.tokens);
    results[i].stats = caches[i].stats();
    results[i].tokens_held = caches[i].length(0, 0);
  }
  return {};
}

/// Tokens of `p` prefilled once for every configuration: those before the question, at least
/// the first token and at most all but the last.
int64_t shared_part(const needle_prompt& p) {
  return std::clamp<int64_t>(p.question_start, 1, std::max<int64_t>(1, int64_t(p.tokens.size()) - 1));
}

/// Needle timings of one configuration in one trial.
struct needle_timing {
  double decode_seconds = 0;
  int64_t decode_tokens = 0;
};

/// Greedy answers of every configuration whose cache holds the needle prompt's haystack part, in
/// lockstep (`forward_lanes`): the question and the answer prefix one token at a time, then each
/// lane its own greedy tokens until a run of digits has ended, an end-of-turn token, or
/// `needle_max_new` tokens; a lane that has finished leaves the lockstep.
kvq::status answer_needles(const kvq::llama::llama_model& model, const kvq::llama::tokenizer& tok,
                           const eval_options& o, std::vector<kvq::KVCache>& caches, const needle_trial& trial,
                           const needle_prompt& prompt, int64_t shared, std::vector<needle_result>& out,
                           std::vector<needle_timing>& time, progress_bar& bar) {
  const size_t V = size_t(model.hparams().n_vocab), n = caches.size();
  std::vector<kvq::KVCache*> ptrs = pointers(caches);
  std::vector<kvq::seq_id> seqs(n, 0);
  std::vector<float> logits(n * V);
  std::vector<double> seconds(n);
  std::vector<token_id> toks(n);
  time.assign(n, {});
  // lanes: indices of the configurations still decoding; step feeds toks[j] to lane j
  std::vector<size_t> lanes(n);
  std::iota(lanes.begin(), lanes.end(), size_t(0));
  auto step = [&]() -> kvq::status {
    std::vector<kvq::KVCache*> p;
    for (size_t c : lanes) p.push_back(ptrs[c]);
    const size_t m = lanes.size();
    std::fill_n(seconds.begin(), m, 0.0);
    KVQ_TRY(model.forward_lanes(p, std::span(seqs.data(), m), std::span(toks.data(), m),
                                std::span(logits.data(), m * V), std::span(seconds.data(), m)));
    for (size_t j = 0; j < m; ++j) {
      time[lanes[j]].decode_seconds += seconds[j];
      time[lanes[j]].decode_tokens += 1;
    }
    return {};
  };
  for (size_t i = size_t(shared); i < prompt.tokens.size(); ++i) {
    std::fill(toks.begin(), toks.end(), prompt.tokens[i]);
    KVQ_TRY(step());
  }
  bar.advance(int64_t(n) * (int64_t(prompt.tokens.size()) - shared));

  const auto im_end = tok.find("<|im_end|>");
  std::vector<std::string> text(n);
  for (int generated = 0; generated < o.needle_max_new && !lanes.empty(); ++generated) {
    std::vector<size_t> going;
    std::vector<token_id> next;
    for (size_t j = 0; j < lanes.size(); ++j) {
      const size_t c = lanes[j];
      const token_id t = kvq::llama::argmax(std::span<const float>(logits.data() + j * V, V));
      if (t == tok.eos() || (im_end && t == *im_end)) continue;
      auto piece = tok.piece(t);
      if (!piece) return piece.error();
      text[c] += *piece;
      // Stop as soon as a run of digits has ended: the answer is decided.
      const std::string run = first_digit_run(text[c]);
      if (!run.empty() && text[c].find(run) + run.size() < text[c].size()) continue;
      if (generated + 1 == o.needle_max_new) continue;
      going.push_back(c);
      next.push_back(t);
    }
    lanes = std::move(going);
    std::copy(next.begin(), next.end(), toks.begin());
    if (!lanes.empty()) KVQ_TRY(step());
  }
  bar.advance(int64_t(n) * o.needle_max_new);
  for (size_t c = 0; c < n; ++c) {
    needle_result& r = out[c];
    r.trial = trial;
    r.prompt_tokens = int64_t(prompt.tokens.size());
    r.depth = prompt.depth;
    r.output = text[c];
    r.pass = needle_passed(text[c], trial.key);
    r.done = true;
  }
  return {};
}

/// One needle trial for every configuration: the haystack part prefilled once into all their
/// caches (its wall time in `prefill_seconds`), then the configurations' answers
/// (`answer_needles`) into `results[i]`, their timings into `times[i]`.
kvq::status run_needle_trial(const kvq::llama::llama_model& model, const kvq::llama::tokenizer& tok,
                             const eval_options& o, const std::vector<config_result>& configs,
                             const needle_trial& trial, const needle_prompt& prompt, double& prefill_seconds,
                             std::vector<needle_timing>& times, std::vector<needle_result>& results,
                             progress_bar& bar) {
  auto made = make_caches(model, configs, o.cache, int64_t(prompt.tokens.size()) + o.needle_max_new);
  if (!made) return made.error();
  std::vector<kvq::KVCache> caches = std::move(made).value();
  const std::vector<kvq::KVCache*> ptrs = pointers(caches);
  const std::vector<kvq::seq_id> seqs(caches.size(), 0);
  const int64_t shared = shared_part(prompt);
  std::vector<float> logits(size_t(model.hparams().n_vocab));
  const auto t0 = clock_type::now();
  KVQ_TRY(model.prefill_shared(ptrs, seqs,
                               std::span<const token_id>(prompt.tokens.data(), size_t(shared)), logits));
  prefill_seconds = seconds_since(t0);
  bar.advance(shared);
  return answer_needles(model, tok, o, caches, trial, prompt, shared, results, times, bar);
}

/// The trials of the run: per context, kind, depth and repetition, keys drawn from `seed`.
std::vector<needle_trial> make_trials(const eval_options& o) {
  std::vector<needle_trial> trials;
  uint64_t index = 0;
  for (int64_t ctx : o.needle_contexts)
    for (const auto& kind_name : o.needle_kinds) {
      const needle_kind kind = parse_needle_kind(kind_name).value_or(needle_kind::single);
      for (double depth : o.needle_depths)
        for (int r = 0; r < o.needle_reps; ++r, ++index) {
          const uint64_t seed = o.seed * 1000003ull + index;
          trials.push_back(kind == needle_kind::multi_key ? make_multi_key_trial(ctx, depth, r, seed)
                                                          : needle_trial{ctx, depth, r, make_key(seed)});
        }
    }
  return trials;
}

}  // namespace

int64_t teacher_forced_chunk(std::span<kvq::KVCache* const> caches, const eval_options& o, int64_t s) {
  constexpr int64_t max_chunk = 64;
  for (kvq::KVCache* c : caches)
    if (c->active_policy().wants_queries() || c->active_policy().canary()) return 1;
  int64_t chunk = std::min(max_chunk, o.tokens - s);
  for (const kvq::KVCache* c : caches) chunk = std::min(chunk, c->tokens_before_encode(0, 0));
  if (o.map_every > 0) chunk = std::min(chunk, o.map_every - s % o.map_every);
  return std::max<int64_t>(chunk, 1);
}

int config_result::needle_passed() const {
  return int(std::count_if(needle.begin(), needle.end(), [](const needle_result& r) { return r.pass; }));
}

std::vector<needle_rate> needle_rates(const config_result& c) {
  std::vector<needle_rate> rates;
  for (const auto& n : c.needle) {
    auto it = std::find_if(rates.begin(), rates.end(), [&](const needle_rate& r) {
      return r.kind == n.trial.kind && r.context == n.trial.context;
    });
    if (it == rates.end()) it = rates.insert(rates.end(), needle_rate{n.trial.kind, n.trial.context});
    it->trials += 1;
    it->passed += n.pass;
    it->reference_passed += n.reference_pass;
    it->passed_where_reference_passed += n.pass && n.reference_pass;
  }
  return rates;
}

double nominal_bits(const std::vector<kvq::format_pair>& map, const kvq::cache_shape& shape) {
  if (map.empty()) return 0;
  double sum = 0;
  for (const auto& p : map)
    sum += kvq::bits_per_element(kvq::traits_of(p.k), kvq::role::k, shape.page_tokens, shape.head_dim) +
           kvq::bits_per_element(kvq::traits_of(p.v), kvq::role::v, shape.page_tokens, shape.head_dim);
  return sum / (2.0 * double(map.size()));
}

std::string hash_text(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return fmt::format("fnv1a64:{:016x}", h);
}

kvq::result<std::string> hash_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return kvq::status{kvq::errc::io_error, fmt::format("cannot open '{}' to hash it", path)};
  uint64_t h = 0xcbf29ce484222325ull;
  std::vector<char> buf(size_t(1) << 20);
  while (in) {
    in.read(buf.data(), std::streamsize(buf.size()));
    for (std::streamsize i = 0; i < in.gcount(); ++i) {
      h ^= static_cast<unsigned char>(buf[size_t(i)]);
      h *= 0x100000001b3ull;
    }
  }
  if (in.bad()) return kvq::status{kvq::errc::io_error, fmt::format("cannot read '{}' to hash it", path)};
  return fmt::format("fnv1a64:{:016x}", h);
}

kvq::status validate_options(const eval_options& o) {
  auto bad = [](std::string msg) { return kvq::status{kvq::errc::invalid_argument, std::move(msg)}; };
  if (o.model_path.empty()) return bad("no model given (--model)");
  if (o.text_path.empty()) return bad("no evaluation text given (--text)");
  if (o.configs.empty()) return bad("no cache configuration given (--config)");
  std::set<std::string> seen;
  for (const auto& c : o.configs)
    if (!seen.insert(c).second) return bad(fmt::format("configuration '{}' is given twice", c));
  if (o.prefill < 0) return bad(fmt::format("--prefill {} is negative", o.prefill));
  if (o.tokens < 1) return bad(fmt::format("--tokens {} must be at least 1", o.tokens));
  for (auto c : o.needle_contexts)
    if (c < 16) return bad(fmt::format("--needle-ctx {} is too small (at least 16 tokens)", c));
  for (auto d : o.needle_depths)
    if (!(d >= 0 && d <= 1)) return bad(fmt::format("--needle-depths {} is outside [0, 1]", d));
  if (!o.needle_contexts.empty() && o.needle_depths.empty()) return bad("--needle-depths is empty");
  if (o.needle_reps < 1) return bad(fmt::format("--needle-reps {} must be at least 1", o.needle_reps));
  if (!o.needle_contexts.empty() && o.needle_kinds.empty()) return bad("--needle-kinds is empty");
  for (const auto& k : o.needle_kinds)
    if (!parse_needle_kind(k)) return bad(fmt::format("--needle-kinds '{}' is not single or multi", k));
  if (o.needle_max_new < 1) return bad(fmt::format("--needle-max-new {} must be at least 1", o.needle_max_new));
  if (o.prompt_template != "auto" && o.prompt_template != "chatml" && o.prompt_template != "plain")
    return bad(fmt::format("--template '{}' is not auto, chatml or plain", o.prompt_template));
  if (o.threads < 0) return bad(fmt::format("--threads {} is negative", o.threads));
  if (o.kl_bucket < 1) return bad(fmt::format("--kl-bucket {} must be at least 1", o.kl_bucket));
  return {};
}

kvq::result<eval_report> run_eval(const eval_options& given) {
  KVQ_TRY(validate_options(given));
  eval_options o = given;  // gets the clip percentiles of o.clip_percentiles_path
  const auto t_start = clock_type::now();
  eval_report rep;
  rep.options = o;
  rep.created_utc = utc_now();
  rep.threads = o.threads > 0 ? o.threads : int(std::max(1u, std::thread::hardware_concurrency()));

  // ---- model and tokenizer
  std::error_code ec;
  if (!std::filesystem::is_regular_file(o.model_path, ec))
    return kvq::status{kvq::errc::io_error, fmt::format("model '{}' does not exist or is not a file", o.model_path)};
  auto file = kvq::llama::gguf_file::open(o.model_path);
  if (!file) return file.error();
  auto model_r = kvq::llama::llama_model::load(*file);
  if (!model_r) return model_r.error();
  // Every phase runs on the model's pool: the products over all configurations at once, the
  // configurations' attention one per task.
  model_r.value().set_threads(rep.threads);
  auto tok_r = kvq::llama::tokenizer::from_gguf(*file);
  if (!tok_r) return tok_r.error();
  const kvq::llama::llama_model& model = *model_r;
  const kvq::llama::tokenizer& tok = *tok_r;
  rep.model.path = o.model_path;
  rep.model.name = model.name();
  {  // the model's identity, so that a later --resume can tell its record from another model's
    auto h = hash_file(o.model_path);
    if (!h) return h.error();
    rep.model.hash = std::move(h).value();
  }
  rep.model.hparams = model.hparams();
  rep.model.has_chat_template = file->find("tokenizer.chat_template") != nullptr;
  const bool has_chatml_tokens = tok.find("<|im_start|>").has_value() && tok.find("<|im_end|>").has_value();
  if (o.prompt_template == "chatml" && !has_chatml_tokens)
    return kvq::status{
        kvq::errc::invalid_argument,
        fmt::format("--template chatml: the vocabulary of '{}' has no <|im_start|>/<|im_end|> tokens", o.model_path)};
  rep.model.tmpl =
      o.prompt_template == "chatml" ? prompt_template::chatml
      : o.prompt_template == "plain"
          ? prompt_template::plain
          : (rep.model.has_chat_template && has_chatml_tokens ? prompt_template::chatml : prompt_template::plain);
  rep.shape = eval_shape(model, o.cache);
  if (!o.clip_percentiles_path.empty()) {
    auto clips = load_clip_percentiles(o.clip_percentiles_path, rep.shape);
    if (!clips)
      return kvq::status{clips.error().code(), fmt::format("--clip-percentiles: {}", clips.error().message())};
    o.cache.clip_percentiles = std::move(clips->unrotated);
    o.cache.rotated_clip_percentiles = std::move(clips->rotated);
    rep.options.cache.clip_percentiles = o.cache.clip_percentiles;
    rep.options.cache.rotated_clip_percentiles = o.cache.rotated_clip_percentiles;
  }
  if (!o.codebook_levels_path.empty()) {
    auto fits = load_codebook_levels(o.codebook_levels_path, rep.shape);
    if (!fits) return kvq::status{fits.error().code(), fmt::format("--codebook-levels: {}", fits.error().message())};
    o.cache.codebooks = std::move(fits).value();
    rep.options.cache.codebooks = o.cache.codebooks;
  }

  // ---- every configuration must make a cache before any work starts
  size_t ref = 0;
  bool have_ref = false;
  for (size_t i = 0; i < o.configs.size() && !have_ref; ++i)
    if (is_fp16_reference(o.configs[i])) have_ref = true, ref = i;
  std::vector<std::string> configs;
  if (!have_ref) configs.push_back("fp16");  // ref = 0
  configs.insert(configs.end(), o.configs.begin(), o.configs.end());
  for (const auto& c : configs) {
    cache_settings cs = o.cache;
    cs.max_tokens = o.cache.page_tokens;
    auto cache = make_eval_cache(model, c, cs);
    if (!cache) return cache.error();
  }
  rep.reference = ref;
  for (size_t i = 0; i < configs.size(); ++i) {
    config_result r;
    r.config = configs[i];
    r.reference = i == ref;
    rep.configs.push_back(std::move(r));
  }

  // ---- text
  auto text = read_file(o.text_path, "evaluation text");
  if (!text) return text.error();
  rep.text.path = o.text_path;
  rep.text.hash = hash_text(*text);
  rep.text.bytes = int64_t(text->size());
  const std::vector<token_id> tokens = tok.encode(*text, tok.add_bos(), false);
  rep.text.tokens_in_file = int64_t(tokens.size());
  rep.text.first_position = o.prefill;
  if (int64_t(tokens.size()) < o.prefill + o.tokens + 1)
    return kvq::status{kvq::errc::invalid_argument,
                       fmt::format("evaluation text '{}' has {} tokens; --prefill {} + --tokens {} needs {}",
                                   o.text_path, tokens.size(), o.prefill, o.tokens, o.prefill + o.tokens + 1)};

  // ---- needle prompts (built once, shared by every configuration)
  std::vector<needle_prompt> prompts;
  if (!o.needle_contexts.empty()) {
    const std::string hay_path = o.haystack_path.empty() ? o.text_path : o.haystack_path;
    auto hay = read_file(hay_path, "needle haystack");
    if (!hay) return hay.error();
    rep.haystack_hash = hash_text(*hay);
    for (int64_t ctx : o.needle_contexts)
      if (ctx > model.hparams().n_ctx_train)
        return kvq::status{kvq::errc::invalid_argument,
                           fmt::format("--needle-ctx {} exceeds the training context {} of '{}'", ctx,
                                       model.hparams().n_ctx_train, o.model_path)};
    for (auto& t : make_trials(o)) {
      auto p = build_needle_prompt(tok, *hay, t, rep.model.tmpl);
      if (!p)
        return kvq::status{p.error().code(), fmt::format("haystack '{}' ({} needle, --needle-ctx {}): {}", hay_path,
                                                         kind_name(t.kind), t.context, p.error().message())};
      rep.trials.push_back(std::move(t));
      prompts.push_back(std::move(p).value());
    }
  }

  // ---- teacher forcing, all configurations in lockstep, unless an earlier record of this run has it
  if (!o.resume_path.empty() && std::filesystem::exists(o.resume_path, ec)) {
    KVQ_TRY(read_resume(o.resume_path, rep));
    if (o.progress)
      fmt::print(
          stderr, "resumed from '{}': teacher-forced results read back, {} needle trials to run\n", o.resume_path,
          std::accumulate(rep.configs.begin(), rep.configs.end(), size_t(0), [](size_t a, const config_result& c) {
            return a + size_t(std::count_if(c.needle.begin(), c.needle.end(),
                                            [](const needle_result& n) { return !n.done; }));
          }));
  } else {
    KVQ_TRY(teacher_forced(model, o, tokens, rep.configs, ref));
  }
  if (o.on_checkpoint && !rep.trials.empty() && !rep.resumed) {
    rep.wall_seconds = seconds_since(t_start);
    o.on_checkpoint(rep);  // teacher-forced results are safe before the (long) needle phase
  }

  // ---- needle trials: one job per trial (shared prefill, then every configuration), longest first
  if (!rep.trials.empty()) {
    std::vector<size_t> order(rep.trials.size());
    int64_t total = 0;
    for (size_t t = 0; t < order.size(); ++t) {
      order[t] = t;
      if (!rep.configs.empty() && t < rep.configs[0].needle.size() && rep.configs[0].needle[t].done)
        continue;  // read back by --resume
      total += shared_part(prompts[t]) +
               int64_t(rep.configs.size()) * (int64_t(prompts[t].tokens.size()) - shared_part(prompts[t]) +
                                              o.needle_max_new);
    }
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return prompts[a].tokens.size() > prompts[b].tokens.size(); });
    // Timings are summed afterwards.
    for (auto& c : rep.configs) {
      c.needle.resize(rep.trials.size());
      for (size_t t = 0; t < rep.trials.size(); ++t) c.needle[t].trial = rep.trials[t];
    }
    std::erase_if(order, [&](size_t t) { return !rep.configs.empty() && rep.configs[0].needle[t].done; });
    std::vector<double> prefill_s(rep.trials.size());
    std::vector<std::vector<needle_timing>> times(rep.trials.size());
    progress_bar bar("needle", total, o.progress);
    // Trials one at a time (each one's products and attention use every thread), longest first; a
    // finished trial is stored and the record checkpointed, so an interrupted run resumes at the
    // trials not done.
    for (const size_t t : order) {
      std::vector<needle_result> results(rep.configs.size());
      KVQ_TRY(run_needle_trial(model, tok, o, rep.configs, rep.trials[t], prompts[t], prefill_s[t], times[t], results,
                               bar));
      for (size_t c = 0; c < rep.configs.size(); ++c) {
        results[c].reference_pass = results[ref].pass;
        rep.configs[c].needle[t] = std::move(results[c]);
      }
      if (o.on_checkpoint) {
        rep.wall_seconds = seconds_since(t_start);
        o.on_checkpoint(rep);
      }
    }
    bar.finish();
    for (size_t t = 0; t < rep.trials.size(); ++t)
      for (size_t c = 0; c < rep.configs.size() && c < times[t].size(); ++c) {
        auto& r = rep.configs[c];
        r.needle_prefill_seconds += prefill_s[t];
        r.needle_prefill_tokens += shared_part(prompts[t]);
        r.needle_decode_seconds += times[t][c].decode_seconds;
        r.needle_decode_tokens += times[t][c].decode_tokens;
      }
  }
  rep.wall_seconds = seconds_since(t_start);
  rep.complete = true;
  return rep;
}

}  // namespace kvq::eval
