// Deterministic corruption test: 2000 seeded mutations of the real stories260K file (truncations,
// bit flips, overwritten header fields). Each must give an error with a message naming the file,
// or a file that loads and runs; never a crash or an out-of-bounds read (run it under ASan:
// -DKVQ_SANITIZE=address,undefined).
#include <array>
#include <catch2/catch.hpp>
#include <iostream>
#include <llama/model.hpp>
#include <map>
#include <random>

#include "test_util.hpp"

using namespace kvq::llama;
using kvq::errc;

TEST_CASE("2000 seeded corruptions of stories260K: an error or a valid model, never a crash", "[corrupt]") {
  const auto original = test::read_bytes(test::stories_path());
  REQUIRE(original.size() == 1054240);
  auto parsed = gguf_file::from_bytes(original, "stories260K.gguf");
  REQUIRE(parsed.ok());
  const uint64_t header = parsed->data_offset();  // mutations favour the header: that is where the counts are

  const uint64_t seed = 0x6b7671;  // printed so a failure can be replayed
  std::cerr << "corruption test: seed " << seed << ", 2000 mutations\n";
  std::mt19937_64 rng(seed);
  auto below = [&](uint64_t n) { return n ? rng() % n : 0; };
  auto header_or_anywhere = [&] { return below(5) ? below(header) : below(original.size()); };

  std::map<std::string, int> outcomes;
  int truncations = 0, truncations_rejected = 0;
  const std::array<uint64_t, 6> extremes = {0, 1, 0xffffffffull, 0x7fffffffffffffffull, ~0ull, 1ull << 32};

  for (int i = 0; i < 2000; ++i) {
    if (i % 500 == 0) std::cerr << "  mutation " << i << "/2000\n";
    std::vector<uint8_t> bytes = original;
    const int kind = i % 4;
    std::string what;
    switch (kind) {
      case 0: {  // truncation
        const uint64_t n = below(original.size());
        bytes.resize(n);
        what = "truncated to " + std::to_string(n);
        ++truncations;
        break;
      }
      case 1: {  // 1..8 bit flips
        const int flips = 1 + int(below(8));
        for (int k = 0; k < flips; ++k) bytes[header_or_anywhere()] ^= uint8_t(1u << below(8));
        what = std::to_string(flips) + " bit flips";
        break;
      }
      case 2: {  // an 8-byte field in the header overwritten with an extreme value
        const uint64_t at = below(header - 8);
        const uint64_t v = extremes[below(extremes.size())];
        std::memcpy(bytes.data() + at, &v, 8);
        what = "u64 at " + std::to_string(at) + " = " + std::to_string(v);
        break;
      }
      default: {  // 1..4 random bytes
        const int n = 1 + int(below(4));
        for (int k = 0; k < n; ++k) bytes[header_or_anywhere()] = uint8_t(rng());
        what = std::to_string(n) + " random bytes";
        break;
      }
    }
    CAPTURE(i, what);
    auto f = gguf_file::from_bytes(std::move(bytes), "stories260K.gguf");
    if (!f.ok()) {
      const auto s = f.error();
      CAPTURE(s.to_string());
      CHECK((s.code() == errc::io_error || s.code() == errc::unsupported));
      CHECK_THAT(s.message(), Catch::StartsWith("stories260K.gguf: "));
      ++outcomes[std::string("gguf rejected: ") + kvq::errc_name(s.code())];
      if (kind == 0) ++truncations_rejected;
      continue;
    }
    // Parsed: every tensor's bytes are inside the file; read them all.
    for (const auto& t : f->tensors()) {
      auto d = f->dequantize(t.name);
      if (!d) CHECK(d.error().code() == errc::unsupported);
    }
    if (auto tok = tokenizer::from_gguf(*f); tok.ok()) {
      const auto ids = tok->encode("Once upon a time, 42 cafés.", true);
      CHECK(tok->decode(ids).ok());
    } else {
      CHECK_THAT(tok.error().message(), Catch::StartsWith("stories260K.gguf: "));
    }
    auto m = llama_model::load(*f);
    if (!m.ok()) {
      CHECK_THAT(m.error().message(), Catch::StartsWith("stories260K.gguf: "));
      ++outcomes[std::string("model rejected: ") + kvq::errc_name(m.error().code())];
      continue;
    }
    // A model that loads must run (its weights may be garbage, its logits NaN).
    reference_kv kv;
    const int vocab = m->hparams().n_vocab;
    const std::vector<token_id> toks = {std::min(1, vocab - 1), std::min(403, vocab - 1)};
    std::vector<float> logits(static_cast<size_t>(vocab));
    CHECK(m->forward_reference(kv, toks, logits).ok());
    ++outcomes["loaded and ran"];
  }
  for (const auto& [k, n] : outcomes) std::cerr << "  " << k << ": " << n << "\n";
  // The file's data runs to its last byte, so every truncation must be caught.
  CHECK(truncations_rejected == truncations);
  CHECK(outcomes["loaded and ran"] > 0);  // bit flips in weights leave a loadable model
}
