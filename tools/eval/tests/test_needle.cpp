// Needle prompt construction and pass detection.
#include <algorithm>
#include <catch2/catch.hpp>
#include <eval/needle.hpp>
#include <llama/gguf.hpp>
#include <set>

#include <catch_skip.hpp>

#include "test_util.hpp"

using namespace kvq::eval;
using Catch::Contains;
using Catch::EndsWith;
using Catch::StartsWith;

namespace {
kvq::llama::tokenizer load_tokenizer(const std::string& path) {
  auto f = kvq::llama::gguf_file::open(path);
  REQUIRE(f.ok());
  auto t = kvq::llama::tokenizer::from_gguf(*f);
  REQUIRE(t.ok());
  return std::move(t).value();
}
}  // namespace

TEST_CASE("needle sentence and keys", "[needle]") {
  CHECK(needle_sentence("48213") == "The pass key is 48213. Remember it.");
  std::set<std::string> keys;
  for (uint64_t seed = 0; seed < 200; ++seed) {
    const std::string k = make_key(seed);
    CAPTURE(seed, k);
    REQUIRE(k.size() == 5);
    CHECK(k[0] != '0');
    for (char c : k) CHECK((c >= '0' && c <= '9'));
    CHECK(make_key(seed) == k);  // deterministic
    keys.insert(k);
  }
  CHECK(keys.size() > 190);  // distinct seeds give (almost always) distinct keys
  CHECK(make_key(3, 7).size() == 7);
}

TEST_CASE("pass detection reads the first run of digits", "[needle]") {
  CHECK(needle_passed(" 48213.", "48213"));
  CHECK(needle_passed("48213", "48213"));
  CHECK(needle_passed(": 48213, remember", "48213"));
  CHECK_FALSE(needle_passed(" 4821", "48213"));
  CHECK_FALSE(needle_passed(" 482130", "48213"));
  CHECK_FALSE(needle_passed(" 12 and 48213", "48213"));
  CHECK_FALSE(needle_passed(" a very important item", "48213"));
  CHECK_FALSE(needle_passed("", "48213"));
  CHECK_FALSE(needle_passed("48213", ""));
  CHECK(first_digit_run("abc 0123x 9") == "0123");
}

TEST_CASE("sentence_ends", "[needle]") {
  const std::string t = "One. Two! \"Three?\" Four\n\nFive";
  const auto e = sentence_ends(t);
  // after "One.", "Two!", "Three?\"", the paragraph break, and the end
  REQUIRE(e.size() == 5);
  CHECK(t.substr(0, e[0]) == "One.");
  CHECK(t.substr(0, e[1]) == "One. Two!");
  CHECK(t.substr(0, e[2]) == "One. Two! \"Three?\"");
  CHECK(t.substr(0, e[3]) == "One. Two! \"Three?\" Four");
  CHECK(e[4] == t.size());
  CHECK(sentence_ends("no end") == std::vector<size_t>{6});
}

TEST_CASE("needle prompt: plain template on stories260K", "[needle]") {
  const auto tok = load_tokenizer(test::stories_path());
  const std::string hay = test::read_text(test::own_data("tiny_story.txt"));
  for (double depth : {0.0, 0.5, 1.0}) {
    for (int64_t ctx : {int64_t(300), int64_t(450)}) {
      CAPTURE(depth, ctx);
      const needle_trial t{ctx, depth, 0, "48213"};
      auto p = build_needle_prompt(tok, hay, t, prompt_template::plain);
      REQUIRE(p.ok());
      CHECK(int64_t(p->tokens.size()) <= ctx);
      CHECK(int64_t(p->tokens.size()) > ctx / 2);
      CHECK(p->tokens.front() == tok.bos());
      const std::string text = tok.decode(p->tokens).value();
      CHECK_THAT(text, Contains("The pass key is 48213. Remember it."));
      CHECK_THAT(text, Contains("What is the pass key?"));
      CHECK_THAT(text, EndsWith("What is the pass key? The pass key is"));
      CHECK_THAT(text, Contains("Find it and memorize it."));
      // the needle sits where the depth says: nowhere else than at a sentence boundary
      CHECK(p->depth == Approx(depth).margin(0.2));
      if (depth == 0.0) CHECK_THAT(text, Contains("about the pass key.\n\nThe pass key is 48213. Remember it. Once"));
      if (depth == 1.0) CHECK_THAT(text, Contains("Remember it.\n\nWhat is the pass key?"));
      // the haystack is cut at a sentence end
      const auto ends = sentence_ends(hay);
      CHECK(std::find(ends.begin(), ends.end(), size_t(p->haystack_chars)) != ends.end());
    }
  }
}

TEST_CASE("needle prompt: errors", "[needle]") {
  const auto tok = load_tokenizer(test::stories_path());
  const std::string hay = test::read_text(test::own_data("tiny_story.txt"));
  auto small = build_needle_prompt(tok, hay, {20, 0.5, 0, "48213"}, prompt_template::plain);
  REQUIRE_FALSE(small.ok());
  CHECK_THAT(small.error().message(), Contains("context 20 is too small"));
  auto depth = build_needle_prompt(tok, hay, {200, 1.5, 0, "48213"}, prompt_template::plain);
  REQUIRE_FALSE(depth.ok());
  CHECK_THAT(depth.error().message(), Contains("depth 1.5"));
  auto key = build_needle_prompt(tok, hay, {200, 0.5, 0, ""}, prompt_template::plain);
  CHECK_FALSE(key.ok());
  auto too_short = build_needle_prompt(tok, "Just one sentence here.", {400, 0.5, 0, "48213"}, prompt_template::plain);
  REQUIRE_FALSE(too_short.ok());
  CHECK_THAT(too_short.error().message(), Contains("haystack is too short"));
}

TEST_CASE("needle prompt: SmolLM2 chat template", "[needle][smollm2]") {
  if (!test::have_smollm2()) KVQ_SKIP(test::smollm2_path() << " is missing (scripts/setup puts it there)");
  const auto tok = load_tokenizer(test::smollm2_path());
  const std::string hay = test::read_text(test::own_data("tiny_story.txt"));
  auto p = build_needle_prompt(tok, hay, {256, 0.5, 0, "76497"}, prompt_template::chatml);
  REQUIRE(p.ok());
  CHECK(int64_t(p->tokens.size()) <= 256);
  CHECK(p->tokens.front() == *tok.find("<|im_start|>"));
  const std::string text = tok.decode(p->tokens, true).value();
  CHECK_THAT(text, StartsWith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
  CHECK_THAT(text, Contains("<|im_start|>user\nThere is a pass key hidden"));
  CHECK_THAT(text, Contains("The pass key is 76497. Remember it."));
  CHECK_THAT(text, EndsWith("What is the pass key?<|im_end|>\n<|im_start|>assistant\nThe pass key is"));
}
