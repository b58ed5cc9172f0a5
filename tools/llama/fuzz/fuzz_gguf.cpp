// libFuzzer target of the GGUF loader, the tokenizers and the model loader: any input must give
// an error or a file that parses, tokenizes and runs, without a crash, a leak or an
// out-of-bounds read. Built with clang and -DKVQ_FUZZ=ON (scripts/test does, in build-fuzz/):
//   build-fuzz/tools/llama/fuzz_gguf -max_total_time=30 -max_len=1100000 corpus/ tests/data/stories260K/
#include <cstddef>
#include <cstdint>
#include <llama/model.hpp>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvq::llama;
  auto f = gguf_file::from_bytes(std::vector<uint8_t>(data, data + size), "fuzz.gguf");
  if (!f.ok()) return 0;
  for (const auto& t : f->tensors()) (void)f->dequantize(t.name);
  if (auto tok = tokenizer::from_gguf(*f); tok.ok()) {
    const auto ids = tok->encode("Hello <s> world, 123 caf\xc3\xa9 \xff!", true, true);
    (void)tok->decode(ids, true);
  }
  auto m = llama_model::load(*f);
  if (!m.ok()) return 0;
  // Keep the run short: only tiny models are executed.
  const auto& hp = m->hparams();
  if (int64_t(hp.n_embd) * hp.n_layer * (hp.n_ff + hp.n_embd) > (1 << 22)) return 0;
  reference_kv kv;
  std::vector<float> logits(size_t(hp.n_vocab));
  const token_id t = 0;
  (void)m->forward_reference(kv, std::span(&t, 1), logits);
  return 0;
}
