// Tokenizers: known encodings, round trips, special tokens, the chat template, bad vocabularies.
//
// Where the expected ids come from:
// - "reference": tools/llama/scripts/tokenizer_reference.py, i.e. Hugging Face `tokenizers`
//   0.23.3 configured from the same GGUF vocabulary (its docstring gives the configuration);
// - "golden": the token sequence of tests/data/stories260K/golden.json (the model's own greedy
//   output, whose text is the README's);
// - "by hand": derived from the vocabulary as the comment beside it shows.
#include <catch2/catch.hpp>
#include <llama/tokenizer.hpp>
#include <nlohmann/json.hpp>
#include <random>

#include "catch_skip.hpp"
#include "test_util.hpp"

using namespace kvq::llama;
using kvq::errc;
using ids = std::vector<token_id>;

namespace {

const tokenizer& stories_tokenizer() {
  static const tokenizer t = [] {
    auto f = gguf_file::open(test::stories_path());
    REQUIRE(f.ok());
    auto tk = tokenizer::from_gguf(*f);
    REQUIRE(tk.ok());
    return std::move(tk).value();
  }();
  return t;
}

const tokenizer* smollm2_tokenizer() {
  static const std::optional<tokenizer> t = []() -> std::optional<tokenizer> {
    if (!test::have_smollm2()) return std::nullopt;
    auto f = gguf_file::open(test::smollm2_path());
    REQUIRE(f.ok());
    auto tk = tokenizer::from_gguf(*f);
    REQUIRE(tk.ok());
    return std::move(tk).value();
  }();
  return t ? &*t : nullptr;
}

std::string random_bytes(std::mt19937& rng, size_t n) {
  std::string s(n, '\0');
  for (auto& c : s) c = char(rng() & 0xff);
  return s;
}

// Texts that exercise the splitters: contractions, digits, punctuation runs, whitespace runs,
// multi-byte UTF-8 in several scripts, emoji with modifiers, lone combining marks.
const std::vector<std::string> round_trip_texts = {
    "Hello, world!",
    "I'm sure they'll say we've done it, isn't it? 'S not.",
    "Numbers: 12345 and 3.14159, plus 2024-06-07 and 1,000,000.",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\nand  double  spaces\r\n",
    "Unicode: café, naïve, Ελληνικά, русский, 日本語のテキスト, 한국어, emoji "
    "😀👍🏽!",
    "Symbols: @#$%^&*()_+-=[]{}|;':\",./<>?`~ and ... — “quotes” ½ ² ٣",
    "def f(x):\n    return x**2  # square\n",
    "a\u00a0b\u2003c\u3000d e\u0301",
    std::string(300, 'x'),
};

}  // namespace

TEST_CASE("llama (sentencepiece-style) vocabulary of stories260K", "[tokenizer]") {
  const tokenizer& t = stories_tokenizer();
  CHECK(t.kind() == vocab_kind::spm);
  CHECK(t.n_vocab() == 512);
  CHECK(t.bos() == 1);
  CHECK(t.eos() == 2);
  CHECK(t.unk() == 0);
  CHECK(t.add_bos());
  CHECK(t.attr(1) == token_attr::control);
  CHECK(t.attr(3) == token_attr::byte);

  SECTION("golden: the README text encodes to golden.json's token sequence") {
    const auto golden = nlohmann::json::parse(test::read_text(test::stories_dir() + "/golden.json"));
    // The inputs after BOS, then the last position's greedy token.
    ids want;
    for (const auto& p : golden["positions"]) want.push_back(p["input"].get<token_id>());
    REQUIRE(want.front() == 1);
    want.erase(want.begin());
    want.push_back(golden["positions"].back()["top"][0][0].get<token_id>());
    const std::string text = golden["text"].get<std::string>();
    REQUIRE(text.front() == ' ');
    // The space prefix of the encoder stands for the text's leading space.
    CHECK(t.encode(text.substr(1), false) == want);
    CHECK(t.decode(want).value() == text);
    ids with_bos = want;
    with_bos.insert(with_bos.begin(), 1);
    CHECK(t.encode(text.substr(1), true) == with_bos);
  }
  SECTION("reference encodings") {
    CHECK(t.encode("Hello world", false) == ids{346, 306, 414, 263, 304, 341});
    CHECK(t.encode("  two  spaces", false) == ids{410, 410, 259, 424, 414, 410, 262, 427, 412, 331, 419});
    CHECK(t.encode("tab\tand\nnewline", false) == ids{259, 412, 430, 12, 412, 264, 13, 416, 411, 424, 421, 271, 411});
    // Byte fallback: "é" (C3 A9), "日本" and "😀" have no tokens; <0xXX> is id XX + 3.
    CHECK(t.encode("café 日本 😀", false) ==
          ids{280, 412, 431, 485, 410, 233, 154, 168, 233, 159, 175, 410, 243, 162, 155, 131});
    // Special-token text is plain text unless parse_special.
    CHECK(t.encode("x<s>y", false) == ids{410, 444, 504, 419, 505, 422});
  }
  SECTION("by hand: byte fallback and the space marker") {
    // "\x01" is no token: "▁" (410) then <0x01> = id 4.
    CHECK(t.encode("\x01", false) == ids{410, 4});
    CHECK(t.text(410) == "\xe2\x96\x81");
    CHECK(t.piece(410).value() == " ");
    CHECK(t.piece(3 + 0x41).value() == "A");   // <0x41>
    CHECK(t.piece(1).value().empty());         // control tokens decode to nothing...
    CHECK(t.piece(1, true).value() == "<s>");  // ...unless rendered
    CHECK(t.encode("", false).empty());
    CHECK(t.encode("", true) == ids{1});
    // With parse_special "<s>" is BOS (1); only the first fragment gets the space prefix.
    REQUIRE(t.find("x").has_value());
    REQUIRE(t.find("y").has_value());
    CHECK(t.encode("x<s>y", false, true) == ids{410, *t.find("x"), 1, *t.find("y")});
  }
  SECTION("special tokens in text with parse_special") {
    const auto got = t.encode("a</s>b", false, true);
    REQUIRE(got.size() >= 3);
    CHECK(std::count(got.begin(), got.end(), 2) == 1);
    CHECK(t.decode(got, true).value() == " a</s>b");
  }
  SECTION("round trips: decode(encode(s)) == ' ' + s, also for random bytes") {
    for (const auto& s : round_trip_texts) {
      CAPTURE(s);
      CHECK(t.decode(t.encode(s, false)).value() == " " + s);
    }
    std::mt19937 rng(1234);
    for (int i = 0; i < 200; ++i) {
      const std::string s = random_bytes(rng, 1 + rng() % 64);
      CAPTURE(i);
      REQUIRE(t.decode(t.encode(s, false)).value() == " " + s);
    }
  }
  SECTION("ids outside the vocabulary are errors") {
    auto d = t.decode(ids{5, 512});
    CHECK(d.error().code() == errc::invalid_argument);
    CHECK_THAT(d.error().message(), Catch::Contains("512") && Catch::Contains("outside the vocabulary"));
    CHECK(!t.piece(-1).ok());
  }
}

TEST_CASE("gpt2 (byte-level BPE) vocabulary of SmolLM2", "[tokenizer][smollm2]") {
  const tokenizer* tp = smollm2_tokenizer();
  if (!tp) KVQ_SKIP(test::smollm2_path() << " is missing (scripts/setup puts it there)");
  const tokenizer& t = *tp;
  CHECK(t.kind() == vocab_kind::bpe);
  CHECK(t.n_vocab() == 49152);
  CHECK(t.bos() == 1);
  CHECK(t.eos() == 2);
  CHECK_FALSE(t.add_bos());

  SECTION("reference encodings") {
    CHECK(t.encode("Hello world", false) == ids{19556, 905});
    CHECK(t.encode("I'm sure they'll say we've done it, isn't it?", false) ==
          ids{57, 5248, 2090, 502, 3060, 1643, 392, 3543, 2294, 357, 28, 3247, 982, 357, 47});
    // Digits split one by one; the space before them stands alone (216 = "Ġ").
    CHECK(t.encode("Numbers: 12345 and 3.14", false) ==
          ids{39006, 42, 216, 33, 34, 35, 36, 37, 284, 216, 35, 30, 33, 36});
    CHECK(t.encode("café 日本 😀", false) == ids{83, 1939, 2756, 17097, 241, 115, 40993, 40303, 218});
    CHECK(t.encode("  two  spaces\n", false) == ids{216, 827, 216, 5600, 198});
    CHECK(t.encode("What is the capital of France?", false) == ids{1780, 314, 260, 3575, 282, 4649, 47});
    CHECK(t.encode("<|im_start|>user\nHi<|im_end|>", false, true) == ids{1, 4093, 198, 26843, 2});
  }
  SECTION("by hand: byte-to-unicode mapping") {
    // " " is byte 0x20, mapped to U+0120 "Ġ"; "\n" (0x0A) to U+010A "Ċ".
    CHECK(t.text(216) == "\xc4\xa0");
    CHECK(t.text(198) == "\xc4\x8a");
    CHECK(t.piece(216).value() == " ");
    CHECK(t.piece(198).value() == "\n");
    // Without parse_special the text of <|im_start|> is ordinary text (no id 1).
    const auto plain = t.encode("<|im_start|>", false, false);
    CHECK(std::find(plain.begin(), plain.end(), 1) == plain.end());
    CHECK(t.decode(plain).value() == "<|im_start|>");
  }
  SECTION("round trips, also for random bytes (invalid UTF-8 included)") {
    for (const auto& s : round_trip_texts) {
      CAPTURE(s);
      CHECK(t.decode(t.encode(s, false)).value() == s);
    }
    // SmolLM2's vocabulary has no token for 21 of the 256 byte characters (bytes that never
    // occur in UTF-8, like 0xC0, 0xF5..0xFF, and a few control bytes): those become the unknown
    // token, as in llama.cpp. Random strings are drawn from the other 235 bytes.
    std::string covered;
    for (int b = 0; b < 256; ++b) {
      const std::string one(1, char(b));
      if (t.encode(one, false) != ids{t.unk()}) covered += char(b);
    }
    CHECK(covered.size() == 235);
    CHECK(t.encode("\xff", false) == ids{0});
    CHECK(t.encode("\xc0", false) == ids{0});
    std::mt19937 rng(4321);
    for (int i = 0; i < 200; ++i) {
      std::string s = random_bytes(rng, 1 + rng() % 64);
      for (auto& c : s) c = covered[uint8_t(c) % covered.size()];
      CAPTURE(i);
      REQUIRE(t.decode(t.encode(s, false)).value() == s);
    }
  }
  SECTION("chat template") {
    const std::vector<chat_message> chat = {{"user", "What is the capital of France?"}};
    const std::string prompt = chatml_prompt(chat);
    CHECK(prompt ==
          "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n");
    CHECK(chatml_prompt(chat, true, std::nullopt) ==
          "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n");
    const std::vector<chat_message> with_system = {{"system", "Be brief."}, {"user", "Hi"}};
    CHECK(chatml_prompt(with_system, false) ==
          "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
    const auto toks = t.encode(chatml_prompt(chat, true, std::nullopt), false, true);
    // <|im_start|> user \n What is the capital of France ? <|im_end|> \n <|im_start|> assistant \n
    CHECK(toks == ids{1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198});
    CHECK(t.decode(toks, true).value() == chatml_prompt(chat, true, std::nullopt));
  }
}

TEST_CASE("bad vocabularies are rejected naming the file and key", "[tokenizer]") {
  using test::gguf_builder;
  auto expect = [](const gguf_builder& b, errc code, std::initializer_list<std::string> parts) {
    auto f = gguf_file::from_bytes(b.build(), "vocab.gguf");
    REQUIRE(f.ok());
    auto t = tokenizer::from_gguf(*f);
    REQUIRE_FALSE(t.ok());
    CAPTURE(t.error().to_string());
    CHECK(t.error().code() == code);
    CHECK_THAT(t.error().message(), Catch::StartsWith("vocab.gguf: "));
    for (const auto& p : parts) CHECK_THAT(t.error().message(), Catch::Contains(p));
  };
  {
    gguf_builder b;
    expect(b, errc::not_found, {"'tokenizer.ggml.model' is missing"});
  }
  {
    gguf_builder b;
    b.str("tokenizer.ggml.model", "bert");
    expect(b, errc::unsupported, {"'bert'"});
  }
  {
    gguf_builder b;
    b.str("tokenizer.ggml.model", "llama");
    expect(b, errc::not_found, {"'tokenizer.ggml.tokens' is missing"});
  }
  {
    gguf_builder b;
    b.str("tokenizer.ggml.model", "llama")
        .str_array("tokenizer.ggml.tokens", {"a", "b"})
        .num_array<float>("tokenizer.ggml.scores", 6, {0.f});
    expect(b, errc::io_error, {"tokenizer.ggml.scores has 1 entries for 2 tokens"});
  }
  {
    gguf_builder b;
    b.str("tokenizer.ggml.model", "llama")
        .str_array("tokenizer.ggml.tokens", {"a", "b"})
        .num_array<int32_t>("tokenizer.ggml.token_type", 5, {1, 9});
    expect(b, errc::io_error, {"token_type[1] = 9"});
  }
  {
    gguf_builder b;
    b.str("tokenizer.ggml.model", "llama")
        .str_array("tokenizer.ggml.tokens", {"a", "b"})
        .u32("tokenizer.ggml.bos_token_id", 2);
    expect(b, errc::io_error, {"tokenizer.ggml.bos_token_id = 2", "outside the vocabulary"});
  }
  {
    gguf_builder b;
    b.str("tokenizer.ggml.model", "gpt2").str_array("tokenizer.ggml.tokens", {"a", "b"});
    expect(b, errc::not_found, {"'tokenizer.ggml.merges' is missing"});
  }
  {
    gguf_builder b;
    b.str("tokenizer.ggml.model", "gpt2")
        .str_array("tokenizer.ggml.tokens", {"a", "b"})
        .str_array("tokenizer.ggml.merges", {"a b", "ab"});
    expect(b, errc::io_error, {"tokenizer.ggml.merges[1] = 'ab'"});
  }
}
