// Decode speed of the model runner as kvq-eval measures it: a prefill, then teacher-forced
// decode steps through an FP16 cache, one token per forward call (logits of the last token),
// timed over the forward calls only. Repeats the measurement and prints every run, the best and
// the spread, since the machine may be shared.
//
//   kvq_llama_bench MODEL.gguf TEXT.txt [--threads N] [--isa scalar|avx2] [--prefill P]
//                   [--tokens N] [--repeat R] [--cache SPEC] [--prefill-path forward|shared]
// --prefill-path shared prefills through `prefill_shared` (what kvq-eval's needle haystacks and
// its first teacher-forced tokens take: the prompt's causal attention in float, `chunk_attention`).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <llama/model.hpp>
#include <llama/tokenizer.hpp>
#include <string>
#include <vector>

using namespace kvq::llama;

namespace {

int fail(const std::string& message) {
  std::fprintf(stderr, "kvq_llama_bench: %s\n", message.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3)
    return fail(
        "usage: kvq_llama_bench MODEL.gguf TEXT.txt [--threads N] [--isa scalar|avx2] "
        "[--prefill P] [--tokens N] [--repeat R] [--cache SPEC] [--prefill-path forward|shared]");
  int threads = 0, prefill = 64, tokens = 128, repeat = 3;
  std::string isa = "best", cache_spec = "fp16", prefill_path = "forward";
  for (int i = 3; i + 1 < argc; i += 2) {
    const std::string key = argv[i], value = argv[i + 1];
    if (key == "--threads")
      threads = std::stoi(value);
    else if (key == "--isa")
      isa = value;
    else if (key == "--prefill")
      prefill = std::stoi(value);
    else if (key == "--tokens")
      tokens = std::stoi(value);
    else if (key == "--repeat")
      repeat = std::stoi(value);
    else if (key == "--cache")
      cache_spec = value;
    else if (key == "--prefill-path")
      prefill_path = value;
    else
      return fail("unknown option " + key);
  }
  if (prefill < 1 || tokens < 1 || repeat < 1) return fail("--prefill, --tokens and --repeat must be positive");
  if (prefill_path != "forward" && prefill_path != "shared")
    return fail("--prefill-path must be forward or shared, got " + prefill_path);
  auto f = gguf_file::open(argv[1]);
  if (!f) return fail(f.error().to_string());
  const auto load0 = std::chrono::steady_clock::now();
  auto loaded = llama_model::load(*f);
  if (!loaded) return fail(loaded.error().to_string());
  llama_model model = std::move(loaded).value();
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - load0).count();
  model.set_threads(threads);
  if (isa != "best") {
    if (isa != "scalar" && isa != "avx2") return fail("--isa must be scalar or avx2, got " + isa);
    if (auto s = model.set_isa(isa == "avx2" ? cpu_isa::avx2 : cpu_isa::scalar); !s.ok()) return fail(s.to_string());
  }
  auto tok = tokenizer::from_gguf(*f);
  if (!tok) return fail(tok.error().to_string());
  std::ifstream in(argv[2], std::ios::binary);
  if (!in) return fail(std::string("cannot read ") + argv[2]);
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  const std::vector<token_id> ids = tok->encode(text, true, false);
  if (ids.size() < size_t(prefill + tokens))
    return fail("the text has " + std::to_string(ids.size()) +
                " tokens, the run needs prefill + tokens = " + std::to_string(prefill + tokens));

  std::printf("model %s (loaded in %.2f s), isa %s, threads %d, cache %s, prefill %d (%s), decode %d tokens\n",
              model.name().c_str(), load_s, isa_name(model.isa()), model.threads(), cache_spec.c_str(), prefill,
              prefill_path.c_str(), tokens);
  std::vector<float> logits(size_t(model.hparams().n_vocab));
  std::vector<double> decode_rates, prefill_rates;
  for (int r = 0; r < repeat; ++r) {
    auto made = make_cache(model, cache_spec, 512ull << 20);
    if (!made) return fail(made.error().to_string());
    kvq::KVCache cache = std::move(made).value();
    if (auto s = cache.create_sequence(0); !s.ok()) return fail(s.to_string());
    const auto p0 = std::chrono::steady_clock::now();
    const std::span<const token_id> prompt(ids.data(), size_t(prefill));
    kvq::KVCache* const caches[] = {&cache};
    const kvq::seq_id seqs[] = {0};
    if (auto s = prefill_path == "shared" ? model.prefill_shared(caches, seqs, prompt, logits)
                                          : model.forward(cache, 0, prompt, logits);
        !s.ok())
      return fail(s.to_string());
    const double prefill_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - p0).count();
    double decode_s = 0;
    for (int t = 0; t < tokens; ++t) {
      const token_id id = ids[size_t(prefill + t)];
      const auto t0 = std::chrono::steady_clock::now();
      if (auto s = model.forward(cache, 0, std::span(&id, 1), logits); !s.ok()) return fail(s.to_string());
      decode_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    decode_rates.push_back(tokens / decode_s);
    prefill_rates.push_back(prefill / prefill_s);
    std::printf("run %d: decode %.1f tok/s, prefill %.1f tok/s\n", r + 1, decode_rates.back(), prefill_rates.back());
    std::fflush(stdout);
  }
  const auto [lo, hi] = std::minmax_element(decode_rates.begin(), decode_rates.end());
  const auto [plo, phi] = std::minmax_element(prefill_rates.begin(), prefill_rates.end());
  std::printf("decode tok/s: best %.1f, worst %.1f (spread %.0f%%); prefill tok/s: best %.1f, worst %.1f\n", *hi, *lo,
              100.0 * (*hi - *lo) / *hi, *phi, *plo);
  return 0;
}
