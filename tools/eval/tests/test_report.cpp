// JSON schema fields, the terminal table and the self-contained HTML, on a hand-made report.
#include <fmt/format.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <eval/report.hpp>
#include <filesystem>
#include <fstream>
#include <iterator>

using namespace kvq::eval;
using Catch::Contains;

namespace {

kvq::format_id fmt_id(const char* s) { return kvq::parse_format(s).value(); }

/// A report as a two-configuration run on a 4-layer, 2-head model would give, with one policy
/// that changed its map during the run.
eval_report make_report() {
  eval_report r;
  r.options.model_path = "m.gguf";
  r.options.text_path = "text.txt";
  r.options.prefill = 16;
  r.options.tokens = 6;
  r.options.kl_bucket = 4;
  r.options.needle_contexts = {512};
  r.options.needle_depths = {0.5};
  r.options.command_line = "kvq-eval -m m.gguf";
  r.model.path = "m.gguf";
  r.model.name = "test-model";
  r.model.hparams.n_layer = 4;
  r.model.hparams.n_head = 4;
  r.model.hparams.n_head_kv = 2;
  r.model.hparams.head_dim = 64;
  r.model.hparams.n_vocab = 100;
  r.model.hparams.n_ctx_train = 2048;
  r.model.tmpl = prompt_template::chatml;
  r.text.path = "text.txt";
  r.text.hash = "fnv1a64:0000000000000000";
  r.shape = {4, 4, 2, 64, 64, 128, 64};
  r.created_utc = "2025-01-01T00:00:00Z";
  r.trials = {{512, 0.5, 0, "48213"}};
  const kvq::format_pair fp16{}, k4{fmt_id("kivi4/g32"), fmt_id("kivi4/g32")},
      k2{fmt_id("kivi2/g32"), fmt_id("kivi2/g32")};
  for (int i = 0; i < 2; ++i) {
    config_result c;
    c.config = i == 0 ? "fp16" : "k=kivi4/g32,v=kivi2/g32";
    c.policy_name = i == 0 ? "static(fp16)" : "static(k=kivi4/g32,v=kivi2/g32)";
    c.reference = i == 0;
    for (int s = 0; s < 6; ++s) c.quality.add(i == 0 ? 0.0 : 0.01 * (s + 1), i == 0 || s != 2, std::log(3.0));
    c.tokens_held = 22;
    c.stats.page_bytes = i == 0 ? 4096 : 1200;
    c.stats.window_bytes = 1000;
    c.stats.tokens = 22 * 4;
    c.stats.encoded_elements = 16 * 4 * 2 * 64 * 2;
    c.stats.bytes_by_format[i == 0 ? 0 : fmt_id("kivi4/g32")] = c.stats.page_bytes;
    c.decode_seconds = 0.5;
    c.decode_tokens = 6;
    needle_result n;
    n.trial = r.trials[0];
    n.prompt_tokens = 500;
    n.depth = 0.48;
    n.pass = i == 0;
    n.output = i == 0 ? " 48213." : " <b>oops</b>";
    c.needle = {n};
    std::vector<kvq::format_pair> m0(8, i == 0 ? fp16 : k4), m1 = m0;
    if (i == 1) m1[3] = k2;
    c.format_map_history.push_back({0, 16, m0});
    if (i == 1) c.format_map_history.push_back({4, 20, m1});
    r.configs.push_back(std::move(c));
  }
  r.reference = 0;
  return r;
}

}  // namespace

TEST_CASE("JSON record has every schema field", "[report]") {
  const auto r = make_report();
  const auto j = to_json(r);
  CHECK(j.at("kind") == "kvq.eval");
  CHECK(j.at("version") == 1);
  for (const char* p : {"/complete",
                        "/created_utc",
                        "/command",
                        "/wall_seconds",
                        "/threads",
                        "/model/path",
                        "/model/name",
                        "/model/layers",
                        "/model/q_heads",
                        "/model/kv_heads",
                        "/model/head_dim",
                        "/model/n_vocab",
                        "/model/n_ctx_train",
                        "/model/chat_template",
                        "/model/prompt_template",
                        "/cache/backend",
                        "/cache/page_tokens",
                        "/cache/window",
                        "/cache/recent",
                        "/cache/budget_bytes",
                        "/cache/clip_percentiles_artifact",
                        "/cache/clip_percentiles_below_100",
                        "/cache/rotated_clip_percentiles_below_100",
                        "/text/path",
                        "/text/hash",
                        "/text/bytes",
                        "/text/tokens_in_file",
                        "/text/prefill",
                        "/text/teacher_forced",
                        "/text/first_position",
                        "/text/positions",
                        "/needle/haystack_path",
                        "/needle/haystack_hash",
                        "/needle/contexts",
                        "/needle/depths",
                        "/needle/repetitions",
                        "/needle/max_new_tokens",
                        "/needle/seed",
                        "/needle/sentence",
                        "/needle/trials/0/key",
                        "/reference"}) {
    CAPTURE(p);
    CHECK(j.contains(nlohmann::json::json_pointer(p)));
  }
  REQUIRE(j.at("configs").size() == 2);
  for (const auto& c : j.at("configs")) {
    for (const char* p : {"/name",
                          "/policy",
                          "/reference",
                          "/bits/page_bits",
                          "/bits/total_bits",
                          "/bits/nominal_bits",
                          "/kv_bytes/pages",
                          "/kv_bytes/window",
                          "/kv_bytes/total",
                          "/kv_bytes/fp16_equivalent",
                          "/kv_bytes/compression",
                          "/kv_bytes/tokens",
                          "/bytes_by_format",
                          "/quality/positions",
                          "/quality/mean_kl",
                          "/quality/median_kl",
                          "/quality/p99_kl",
                          "/quality/max_kl",
                          "/quality/top1_agreement",
                          "/quality/perplexity",
                          "/quality/perplexity_delta",
                          "/quality/mean_nll",
                          "/kl_by_position/bucket",
                          "/kl_by_position/first_position",
                          "/kl_by_position/mean_kl",
                          "/speed/decode_tokens_per_s",
                          "/speed/decode_seconds",
                          "/speed/decode_tokens",
                          "/speed/prefill_tokens_per_s",
                          "/needle/passed",
                          "/needle/trials",
                          "/needle/results/0/pass",
                          "/needle/results/0/output",
                          "/needle/results/0/prompt_tokens",
                          "/needle/results/0/actual_depth",
                          "/format_map/layers",
                          "/format_map/kv_heads",
                          "/format_map/k",
                          "/format_map/v",
                          "/format_map_history/0/step",
                          "/format_map_history/0/position",
                          "/format_map_history/0/k",
                          "/format_map_history/0/v"}) {
      CAPTURE(c.at("name"), p);
      CHECK(c.contains(nlohmann::json::json_pointer(p)));
    }
  }
  const auto& q = j.at("configs").at(1);
  CHECK(q.at("quality").at("mean_kl").get<double>() == Approx(0.035));
  CHECK(q.at("quality").at("top1_agreement").get<double>() == Approx(5.0 / 6));
  CHECK(q.at("quality").at("perplexity").get<double>() == Approx(3.0));
  CHECK(q.at("quality").at("perplexity_delta").get<double>() == Approx(0.0).margin(1e-12));
  CHECK(q.at("kl_by_position").at("mean_kl").size() == 2);  // buckets of 4 over 6 positions
  CHECK(q.at("bits").at("nominal_bits").get<double>() > 2.0);
  CHECK(q.at("kv_bytes").at("total") == 2200);
  CHECK(q.at("bytes_by_format").at("kivi4/g32") == 1200);
  CHECK(q.at("format_map").at("k").size() == 4);           // layers
  CHECK(q.at("format_map").at("k")[0].size() == 2);        // kv heads
  CHECK(q.at("format_map").at("k")[1][1] == "kivi2/g32");  // the final map (entry 3 = layer 1 head 1)
  CHECK(q.at("format_map_history").size() == 2);
  CHECK(q.at("format_map_history")[0].at("k")[1][1] == "kivi4/g32");
  CHECK(j.at("configs")[0].at("format_map_history").size() == 1);
  CHECK(j.at("reference") == "fp16");
  CHECK(j.at("needle").at("sentence") == "The pass key is {key}. Remember it.");
}

TEST_CASE("a checkpoint says it is one", "[report]") {
  auto r = make_report();
  r.complete = false;
  CHECK(to_json(r).at("complete") == false);
  CHECK_THAT(render_html(r), Contains("Checkpoint"));
  r.complete = true;
  CHECK(to_json(r).at("complete") == true);
  CHECK(render_html(r).find("Checkpoint") == std::string::npos);
}

TEST_CASE("the clip percentiles' artifact is recorded", "[report]") {
  auto r = make_report();
  auto j = to_json(r);
  CHECK(j.at("cache").at("clip_percentiles_artifact") == "");
  CHECK(j.at("cache").at("clip_percentiles_below_100") == 0);
  CHECK(render_table(r).find("clip percentiles") == std::string::npos);
  r.options.clip_percentiles_path = "calib.json";
  r.options.cache.clip_percentiles.assign(4 * 2 * 2, 100.f);
  r.options.cache.clip_percentiles[1] = r.options.cache.clip_percentiles[6] = 95.f;
  r.options.cache.rotated_clip_percentiles.assign(4 * 2 * 2, 100.f);
  r.options.cache.rotated_clip_percentiles[3] = 99.f;
  j = to_json(r);
  CHECK(j.at("cache").at("clip_percentiles_artifact") == "calib.json");
  CHECK(j.at("cache").at("clip_percentiles_below_100") == 2);
  CHECK(j.at("cache").at("rotated_clip_percentiles_below_100") == 1);
  CHECK_THAT(render_table(r), Contains("rolealign clip percentiles from calib.json"));
  CHECK_THAT(render_html(r), Contains("rolealign clip percentiles from <code>calib.json</code>"));
}

TEST_CASE("JSON never holds NaN", "[report]") {
  auto r = make_report();
  r.configs[1].quality.add(NAN, false, 1.0);
  const std::string s = to_json(r).dump();
  CHECK(s.find("NaN") == std::string::npos);
  CHECK(s.find("nan") == std::string::npos);
  CHECK(nlohmann::json::parse(s).at("configs")[1].at("quality").at("mean_kl").is_null());
}

TEST_CASE("terminal table lists every configuration", "[report]") {
  const std::string t = render_table(make_report());
  CHECK_THAT(t, Contains("fp16 (ref)"));
  CHECK_THAT(t, Contains("k=kivi4/g32,v=kivi2/g32"));
  CHECK_THAT(t, Contains("mean KL"));
  CHECK_THAT(t, Contains("1/1"));
  CHECK_THAT(t, Contains("0/1"));
}

TEST_CASE("HTML report is self-contained and has the charts", "[report]") {
  const std::string h = render_html(make_report());
  CHECK_THAT(h, Contains("<!DOCTYPE html>"));
  CHECK_THAT(h, Contains("<svg"));
  // no external reference of any kind
  for (const char* bad : {"http://", "https://", "<script", "<link", " src=", "href=", "@import", "url("}) {
    CAPTURE(bad);
    CHECK(h.find(bad) == std::string::npos);
  }
  // every chart is there
  for (const char* part : {"bits per element against mean KL", "mean KL over position", "perplexity change vs FP16",
                           "top-1 disagreement", "needle pass matrix", "format map of fp16",
                           "format map of k=kivi4/g32,v=kivi2/g32", "format map over decode steps of k=kivi4/g32"}) {
    CAPTURE(part);
    CHECK_THAT(h, Contains(part));
  }
  // untrusted strings (model output) are escaped
  CHECK_THAT(h, Contains("&lt;b&gt;oops&lt;/b&gt;"));
  CHECK(h.find("<b>oops") == std::string::npos);
  // balanced svg elements
  size_t open = 0, close = 0;
  for (size_t p = 0; (p = h.find("<svg", p)) != std::string::npos; ++p) ++open;
  for (size_t p = 0; (p = h.find("</svg>", p)) != std::string::npos; ++p) ++close;
  CHECK(open == close);
  CHECK(open >= 6);
}

TEST_CASE("long-context buckets in the JSON, the table and the HTML", "[report]") {
  const auto r = make_report();  // positions 16..21: all in [0, 512)
  const auto j = to_json(r);
  const auto& b = j.at("configs")[1].at("position_buckets");
  REQUIRE(b.size() == 1);
  CHECK(b[0].at("first") == 0);
  CHECK(b[0].at("end") == 512);
  CHECK(b[0].at("positions") == 6);
  CHECK(b[0].at("mean_kl").get<double>() == Approx(0.035));
  CHECK(b[0].at("top1_agreement").get<double>() == Approx(5.0 / 6));
  CHECK(b[0].at("perplexity").get<double>() == Approx(3.0));
  CHECK(b[0].at("perplexity_delta").get<double>() == Approx(0.0).margin(1e-12));
  const auto& per = j.at("configs")[1].at("per_position");
  CHECK(per.at("kl").size() == 6);
  CHECK(per.at("top1") == nlohmann::json({1, 1, 0, 1, 1, 1}));
  CHECK(per.at("nll")[0].get<double>() == std::log(3.0));  // exact: read back by --resume
  CHECK_THAT(render_table(r), Contains("0-512") && Contains("dPPL"));
  CHECK_THAT(render_html(r), Contains("By position range") && Contains("<th>0-512</th>"));
  CHECK(render_table(r).find("training context") == std::string::npos);
  auto past = r;
  past.model.hparams.n_ctx_train = 20;  // positions 16..21
  CHECK_THAT(render_table(past), Contains("positions 20..21 are beyond the model's training context of 20 tokens"));
  CHECK(position_range_label(512, 1024) == "512-1K");
  CHECK(position_range_label(4096, 8192) == "4K-8K");
}

namespace {

/// A file in the temporary folder, removed at the end of the scope.
struct temp_file {
  std::string path;
  explicit temp_file(std::string_view name)
      : path((std::filesystem::temp_directory_path() / fmt::format("kvq_eval_{}_{}", ::getpid(), name)).string()) {}
  ~temp_file() { std::filesystem::remove(path); }
};

/// `r` as a run about to resume would hold it: identity and trials, no results yet.
eval_report unrun(const eval_report& r) {
  eval_report u = r;
  for (auto& c : u.configs) {
    config_result fresh;
    fresh.config = c.config;
    fresh.reference = c.reference;
    c = std::move(fresh);
  }
  return u;
}

}  // namespace

TEST_CASE("read_resume reads back what to_json wrote, for the same run only", "[report]") {
  auto r = make_report();
  r.configs[1].quality.add(std::nan(""), false, 1.0);  // a NaN is written as null and read back as NaN
  r.options.tokens = 7;
  r.configs[0].quality.add(0, true, 1.0);
  r.configs[1].needle[0].done = true;
  r.configs[0].needle[0].done = false;  // a checkpoint before this trial ran
  r.configs[1].needle_prefill_seconds = 0.25;
  r.configs[1].needle_prefill_tokens = 500;
  r.configs[1].stats.pages_by_format[fmt_id("kivi4/g32")] = 3;
  r.configs[1].stats.used_bytes = 4096;
  r.configs[1].stats.pages = 3;
  temp_file f("resume.json");
  REQUIRE(write_text_file(f.path, to_json(r).dump(1)).ok());

  SECTION("the same run") {
    eval_report u = unrun(r);
    REQUIRE(read_resume(f.path, u).ok());
    CHECK(u.resumed);
    REQUIRE(u.configs.size() == 2);
    const auto &a = r.configs[1], &b = u.configs[1];
    CHECK(b.policy_name == a.policy_name);
    CHECK(b.quality.positions() == 7);
    for (size_t i = 0; i < 6; ++i) {
      CAPTURE(i);
      CHECK(b.quality.kl_values()[i] == a.quality.kl_values()[i]);  // bit for bit
      CHECK(b.quality.nll_values()[i] == a.quality.nll_values()[i]);
    }
    CHECK(std::isnan(b.quality.kl_values()[6]));
    CHECK(b.quality.agree_values() == a.quality.agree_values());
    CHECK(b.stats.page_bytes == a.stats.page_bytes);
    CHECK(b.stats.window_bytes == a.stats.window_bytes);
    CHECK(b.stats.used_bytes == 4096);
    CHECK(b.stats.pages == 3);
    CHECK(b.stats.tokens == a.stats.tokens);
    CHECK(b.stats.encoded_elements == a.stats.encoded_elements);
    CHECK(b.stats.bytes_by_format == a.stats.bytes_by_format);
    CHECK(b.stats.pages_by_format == a.stats.pages_by_format);
    CHECK(b.tokens_held == a.tokens_held);
    CHECK(b.decode_seconds == a.decode_seconds);
    CHECK(b.decode_tokens == a.decode_tokens);
    REQUIRE(b.format_map_history.size() == 2);
    CHECK(b.format_map_history[1].step == 4);
    CHECK(b.format_map_history[1].map == a.format_map_history[1].map);
    REQUIRE(b.needle.size() == 1);
    CHECK(b.needle[0].done);
    CHECK(b.needle[0].output == a.needle[0].output);
    CHECK(b.needle[0].prompt_tokens == 500);
    CHECK(b.needle_prefill_seconds == 0.25);
    CHECK_FALSE(u.configs[0].needle[0].done);  // not run yet: the resumed run runs it
    // what the record says of a configuration whose trials all ran is what the resumed run reports
    CHECK(to_json(u).at("configs")[1] == to_json(r).at("configs")[1]);
    u.options.resume_path = f.path;
    CHECK_THAT(render_table(u), Contains("read back from " + f.path));
    CHECK_THAT(render_html(u), Contains("read back from <code>" + f.path));
    CHECK(to_json(u).at("resumed") == true);
  }
  SECTION("another run: the first field that differs is named, nothing changes") {
    eval_report u = unrun(r);
    u.text.hash = "fnv1a64:1111111111111111";
    auto s = read_resume(f.path, u);
    REQUIRE_FALSE(s.ok());
    CHECK_THAT(s.message(), Contains(f.path) && Contains("another run") && Contains("text_hash") &&
                                Contains("fnv1a64:1111111111111111"));
    CHECK_FALSE(u.resumed);
    CHECK(u.configs[1].quality.positions() == 0);
    u = unrun(r);
    u.options.tokens = 8;
    CHECK_THAT(read_resume(f.path, u).message(), Contains("tokens differs (7 there, 8 here)"));
    u = unrun(r);
    u.configs[1].config = "kivi2/g32";
    CHECK_THAT(read_resume(f.path, u).message(), Contains("configs differs"));
  }
  SECTION("a malformed record names the field") {
    auto j = to_json(r);
    j["configs"][1]["per_position"]["kl"].erase(0);
    REQUIRE(write_text_file(f.path, j.dump()).ok());
    eval_report u = unrun(r);
    auto s = read_resume(f.path, u);
    CHECK_THAT(s.message(), Contains("/configs/1/per_position/kl") && Contains("7 positions"));
    CHECK(u.configs[1].quality.positions() == 0);
    REQUIRE(write_text_file(f.path, "{ not json").ok());
    CHECK_THAT(read_resume(f.path, u).message(), Contains("not valid JSON"));
    REQUIRE(write_text_file(f.path, R"({"kind": "something else"})").ok());
    CHECK_THAT(read_resume(f.path, u).message(), Contains("not a kvq-eval record"));
    CHECK_THAT(read_resume(f.path + ".missing", u).message(), Contains("cannot open"));
  }
}

TEST_CASE("write_text_file replaces the file whole and leaves nothing beside it", "[report]") {
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("kvq_eval_write_{}", ::getpid());
  const std::string path = (dir / "sub" / "r.json").string();
  REQUIRE(write_text_file(path, "first, longer contents").ok());  // creates the folders
  REQUIRE(write_text_file(path, "second").ok());
  std::ifstream in(path, std::ios::binary);
  CHECK(std::string(std::istreambuf_iterator<char>(in), {}) == "second");
  CHECK_FALSE(std::filesystem::exists(path + ".partial"));
  // a path that cannot be written: named, the folder in its way untouched
  const auto s = write_text_file((dir / "sub").string(), "x");
  CHECK_FALSE(s.ok());
  CHECK_THAT(s.message(), Contains((dir / "sub").string()));
  CHECK(std::filesystem::is_directory(dir / "sub"));
  std::filesystem::remove_all(dir);
}
