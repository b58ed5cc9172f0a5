// Checks what the eval:smoke_run ctest wrote: kvq-eval on stories260K with fp16 (the reference),
// k=fp16,v=fp16 (the same cache spelled differently: must match the reference exactly) and bf16.
#include <catch2/catch.hpp>
#include <catch_skip.hpp>
#include <cmath>
#include <eval/runner.hpp>
#include <nlohmann/json.hpp>

#include "test_util.hpp"

using namespace kvq::eval;
using Catch::Contains;

TEST_CASE("kvq-eval smoke run on stories260K", "[smoke]") {
  const std::string json_path = test::smoke_out("smoke.json"), html_path = test::smoke_out("smoke.html");
  INFO("written by the eval:smoke_run ctest: " << json_path);
  REQUIRE(std::filesystem::exists(json_path));
  REQUIRE(std::filesystem::exists(html_path));
  const auto j = nlohmann::json::parse(test::read_text(json_path));

  CHECK(j.at("kind") == "kvq.eval");
  CHECK(j.at("version") == 1);
  CHECK(j.at("complete") == true);
  CHECK(j.at("model").at("head_dim") == 8);
  CHECK(j.at("model").at("prompt_template") == "plain");
  CHECK(j.at("text").at("teacher_forced") == 224);
  CHECK(j.at("reference") == "fp16");
  const auto& cs = j.at("configs");
  REQUIRE(cs.size() == 3);
  const auto& ref = cs[0];
  const auto& same = cs[1];
  const auto& bf16 = cs[2];
  CHECK(ref.at("name") == "fp16");
  CHECK(ref.at("reference") == true);
  CHECK(same.at("name") == "k=fp16,v=fp16");
  CHECK(same.at("reference") == false);
  CHECK(bf16.at("name") == "bf16");

  for (const auto& c : cs) {
    CAPTURE(c.at("name"));
    const auto& q = c.at("quality");
    CHECK(q.at("positions") == 224);
    CHECK(q.at("perplexity").get<double>() > 1.0);
    CHECK(std::isfinite(q.at("mean_kl").get<double>()));
    // 32 + 224 tokens held: 2 pages of 64 encoded per (layer, head, role) once 128 + 64 are in
    CHECK(c.at("kv_bytes").at("tokens") == 256);
    CHECK(c.at("kv_bytes").at("pages").get<uint64_t>() > 0);
    CHECK(c.at("bits").at("page_bits").get<double>() == Approx(16.0));
    CHECK(c.at("bits").at("total_bits").get<double>() > 16.0);  // the FP16 window is counted
    CHECK(c.at("speed").at("decode_tokens_per_s").get<double>() > 0);
    CHECK(c.at("needle").at("trials") == 1);
    CHECK(c.at("needle").at("results")[0].at("prompt_tokens").get<int>() <= 256);
    CHECK(c.at("format_map").at("layers") == 5);
    CHECK(c.at("format_map").at("kv_heads") == 4);
    CHECK(c.at("format_map_history").size() == 1);  // a static policy never changes its map
  }
  // the FP16 cache against itself: exactly the same distributions
  CHECK(ref.at("quality").at("mean_kl").get<double>() == 0.0);
  CHECK(ref.at("quality").at("top1_agreement").get<double>() == 1.0);
  CHECK(same.at("quality").at("mean_kl").get<double>() == 0.0);
  CHECK(same.at("quality").at("max_kl").get<double>() == 0.0);
  CHECK(same.at("quality").at("top1_agreement").get<double>() == 1.0);
  CHECK(same.at("quality").at("perplexity").get<double>() == ref.at("quality").at("perplexity").get<double>());
  CHECK(same.at("needle").at("results")[0].at("output") == ref.at("needle").at("results")[0].at("output"));
  // bf16 pages really are bf16 and cost what fp16 costs
  CHECK(bf16.at("bytes_by_format").contains("bf16"));
  CHECK(bf16.at("format_map").at("k")[0][0] == "bf16");
  CHECK(bf16.at("kv_bytes").at("total") == ref.at("kv_bytes").at("total"));
  CHECK(bf16.at("quality").at("mean_kl").get<double>() >= 0.0);

  const std::string html = test::read_text(html_path);
  CHECK_THAT(html, Contains("<svg"));
  CHECK(html.find("http://") == std::string::npos);
  CHECK(html.find("https://") == std::string::npos);
}

// kvq-eval's run on Gemma 3 270M (sliding-window layers): each cache attends with the model's
// windows, the FP16 reference agrees with itself, a 4-bit configuration stays close. Short (64
// measured positions, no needles): the windows themselves are checked by the runner's [gemma3]
// cases against llama.cpp.
TEST_CASE("kvq-eval runs Gemma 3 270M", "[gemma3]") {
  if (!test::have_gemma3()) KVQ_SKIP(test::gemma3_path() << " is missing (scripts/setup puts it there)");
  eval_options o;
  o.model_path = test::gemma3_path();
  o.text_path = test::own_data("tiny_story.txt");
  o.configs = {"fp16", "kivi4/g32"};
  o.prefill = 32;
  o.tokens = 64;
  o.needle_contexts = {};
  o.threads = 2;
  o.progress = false;
  auto r = run_eval(o);
  REQUIRE(r.ok());
  const eval_report& rep = r.value();
  CHECK(rep.model.hparams.gemma3);
  CHECK(rep.model.hparams.head_dim == 256);
  REQUIRE(rep.configs.size() == 2);
  const auto& ref = rep.configs[rep.reference];
  CHECK(ref.quality.positions() == 64);
  CHECK(ref.quality.mean_kl() == 0.0);
  for (const auto& c : rep.configs) {
    CAPTURE(c.config);
    CHECK(c.quality.positions() == 64);
    CHECK(std::isfinite(c.quality.mean_kl()));
    CHECK(c.quality.perplexity() > 1.0);
    CHECK(c.quality.perplexity() < 100.0);  // a simple story: the model predicts it well
  }
  const auto& k4 = rep.configs[1 - rep.reference];
  CHECK(k4.quality.mean_kl() < 0.1);
  CHECK(k4.quality.top1_agreement() > 0.8);
}
