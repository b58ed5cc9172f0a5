// Needle prompt construction (single and multi-key), pass detection, and the needle phase of a run.
#include <algorithm>
#include <cmath>
#include <catch2/catch.hpp>
#include <eval/needle.hpp>
#include <eval/report.hpp>
#include <eval/runner.hpp>
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
  // the shared (prefilled) part ends with the haystack; the rest is the question and the answer prefix
  const std::vector<kvq::llama::token_id> tail(p->tokens.begin() + p->question_start, p->tokens.end());
  CHECK(tok.decode(tail, true).value() == "\n\nWhat is the pass key?<|im_end|>\n<|im_start|>assistant\nThe pass key is");
  CHECK(tail.size() < 20);
}

TEST_CASE("needle kinds by name", "[needle]") {
  CHECK(parse_needle_kind("single") == needle_kind::single);
  CHECK(parse_needle_kind("multi") == needle_kind::multi_key);
  CHECK_FALSE(parse_needle_kind("multikey").has_value());
  CHECK(std::string(kind_name(needle_kind::multi_key)) == "multi");
  CHECK(multi_key_sentence("apple", "1234567") == "The special magic number for apple is 1234567.");
}

TEST_CASE("multi-key trials: distinct labels, keys and depths, drawn from the seed", "[needle]") {
  for (uint64_t seed = 0; seed < 50; ++seed)
    for (double depth : {0.0, 0.1, 0.5, 0.9, 1.0}) {
      CAPTURE(seed, depth);
      const needle_trial t = make_multi_key_trial(4096, depth, 2, seed);
      CHECK(t.kind == needle_kind::multi_key);
      CHECK(t.context == 4096);
      CHECK(t.rep == 2);
      CHECK(t.depth == depth);
      REQUIRE(int(t.others.size()) == multi_key_count - 1);
      std::set<std::string> labels{t.label}, keys{t.key};
      std::set<double> depths{t.depth};
      for (const auto& o : t.others) {
        labels.insert(o.label);
        keys.insert(o.key);
        depths.insert(o.depth);
        CHECK(o.key.size() == size_t(multi_key_digits));
        CHECK(o.key[0] != '0');
        // spread evenly, none at the slot nearest to the asked key
        const double slot = o.depth * multi_key_count - 0.5;
        CHECK(slot == Approx(std::round(slot)));
        CHECK(std::abs(o.depth - depth) >= 0.125 - 1e-9);
      }
      CHECK(int(labels.size()) == multi_key_count);
      CHECK(int(keys.size()) == multi_key_count);
      CHECK(int(depths.size()) == multi_key_count);
      CHECK(t.key.size() == size_t(multi_key_digits));
      const needle_trial again = make_multi_key_trial(4096, depth, 2, seed);
      CHECK(again.label == t.label);
      CHECK(again.key == t.key);
    }
  CHECK(make_multi_key_trial(1024, 0.5, 0, 1).key != make_multi_key_trial(1024, 0.5, 0, 2).key);
}

TEST_CASE("needle prompts: the haystack part ends where the question starts", "[needle]") {
  const auto tok = load_tokenizer(test::stories_path());
  const std::string hay = test::read_text(test::own_data("tiny_story.txt"));
  for (const bool multi : {false, true}) {
    CAPTURE(multi);
    const needle_trial t =
        multi ? make_multi_key_trial(400, 0.5, 0, 77) : needle_trial{400, 0.5, 0, "48213"};
    auto p = build_needle_prompt(tok, hay, t, prompt_template::plain);
    REQUIRE(p.ok());
    CHECK(int64_t(p->tokens.size()) <= 400);
    REQUIRE(p->question_start > 0);
    REQUIRE(p->question_start < int64_t(p->tokens.size()));
    const std::vector<kvq::llama::token_id> head(p->tokens.begin(), p->tokens.begin() + p->question_start);
    const std::vector<kvq::llama::token_id> tail(p->tokens.begin() + p->question_start, p->tokens.end());
    const std::string head_text = tok.decode(head).value(), tail_text = tok.decode(tail).value();
    CHECK_THAT(head_text, !Contains("What is"));
    CHECK(head_text + tail_text == tok.decode(p->tokens).value());
    if (multi) {
      CHECK_THAT(head_text, Contains("Some special magic numbers are hidden"));
      CHECK_THAT(head_text, Contains(multi_key_sentence(t.label, t.key)));
      for (const auto& o : t.others) CHECK_THAT(head_text, Contains(multi_key_sentence(o.label, o.key)));
      // the question and the answer prefix only
      CHECK(tail_text ==
            "\n\nWhat is the special magic number for " + t.label + "? The special magic number for " + t.label + " is");
      // the asked key sits at its depth, the others at theirs, in order of depth
      const size_t at = head_text.find(multi_key_sentence(t.label, t.key));
      CHECK(double(at) / double(head_text.size()) == Approx(0.5).margin(0.2));
      CHECK(p->depth == Approx(0.5).margin(0.2));
    } else {
      CHECK_THAT(head_text, Contains("The pass key is 48213. Remember it."));
      CHECK(tail_text == "\n\nWhat is the pass key? The pass key is");
    }
  }
  auto no_label = make_multi_key_trial(400, 0.5, 0, 77);
  no_label.label.clear();
  auto bad = build_needle_prompt(tok, hay, no_label, prompt_template::plain);
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.error().message(), Contains("without the label"));
  auto far = make_multi_key_trial(400, 0.5, 0, 77);
  far.others[1].depth = -0.5;
  auto bad_depth = build_needle_prompt(tok, hay, far, prompt_template::plain);
  REQUIRE_FALSE(bad_depth.ok());
  CHECK_THAT(bad_depth.error().message(), Contains("depth -0.5"));
}

TEST_CASE("run_eval needle phase: both kinds, reference marks and rates per (kind, context)", "[needle]") {
  eval_options o;
  o.model_path = test::stories_path();
  o.text_path = test::own_data("tiny_story.txt");
  o.configs = {"fp16", "bf16"};
  o.prefill = 8;
  o.tokens = 8;
  o.needle_contexts = {300, 400};
  o.needle_depths = {0.5};
  o.progress = false;
  o.threads = 2;

  SECTION("bad kind and too long a context are errors before any work") {
    o.needle_kinds = {"single", "many"};
    CHECK_THAT(validate_options(o).message(), Contains("--needle-kinds 'many'"));
    o.needle_kinds = {};
    CHECK_THAT(validate_options(o).message(), Contains("--needle-kinds is empty"));
    o.needle_kinds = {"multi"};
    o.needle_contexts = {400, 4096};
    auto r = run_eval(o);
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.error().message(), Contains("--needle-ctx 4096"));
  }
  SECTION("a run") {
    auto r = run_eval(o);
    REQUIRE(r.ok());
    REQUIRE(r->trials.size() == 4);  // 2 contexts x 2 kinds
    CHECK(r->trials[0].kind == needle_kind::single);
    CHECK(r->trials[1].kind == needle_kind::multi_key);
    CHECK(r->trials[2].context == 400);
    const auto& ref = r->configs[r->reference];
    for (const auto& c : r->configs) {
      CAPTURE(c.config);
      REQUIRE(c.needle.size() == 4);
      for (size_t t = 0; t < 4; ++t) {
        CHECK(c.needle[t].trial.kind == r->trials[t].kind);
        CHECK(c.needle[t].reference_pass == ref.needle[t].pass);
        CHECK(c.needle[t].pass == needle_passed(c.needle[t].output, r->trials[t].key));
      }
      const auto rates = needle_rates(c);
      REQUIRE(rates.size() == 4);
      CHECK(rates[1].kind == needle_kind::multi_key);
      CHECK(rates[1].context == 300);
      int trials = 0, passed = 0;
      for (const auto& nr : rates) {
        trials += nr.trials;
        passed += nr.passed;
        CHECK(nr.passed_where_reference_passed <= nr.reference_passed);
        CHECK(nr.passed_where_reference_passed <= nr.passed);
      }
      CHECK(trials == 4);
      CHECK(passed == c.needle_passed());
      CHECK(c.needle_prefill_tokens > 0);
      CHECK(c.needle_decode_tokens > 0);
    }
    // the reference's own rates count every trial it passed
    for (const auto& nr : needle_rates(ref)) CHECK(nr.passed == nr.reference_passed);
    // the shared prefill is one computation: the same time and tokens for every configuration
    CHECK(r->configs[0].needle_prefill_seconds == r->configs[1].needle_prefill_seconds);
    // the table has the pass counts per kind@context, the reference's beside the others
    const std::string table = render_table(*r);
    CHECK_THAT(table, Contains("single@300") && Contains("multi@300") && Contains("single@400") &&
                          Contains("multi@400") && Contains("over the trials the reference passed"));
  }
}
