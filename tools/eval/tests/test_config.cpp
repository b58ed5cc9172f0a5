// Configuration strings, policies by name, cache creation and option / input errors.
#include <algorithm>
#include <catch2/catch.hpp>
#include <eval/config.hpp>
#include <eval/report.hpp>
#include <eval/runner.hpp>
#include <fstream>

#include "test_util.hpp"

using namespace kvq::eval;
using Catch::Contains;

namespace {
kvq::cache_shape smol_shape() {
  kvq::cache_shape s;
  s.layers = 30;
  s.q_heads = 9;
  s.kv_heads = 3;
  s.head_dim = 64;
  return s;
}
}  // namespace

TEST_CASE("make_policy: bare specs and static:<spec> give static policies", "[config]") {
  const auto shape = smol_shape();
  for (auto [cfg, name] :
       {std::pair{"kivi4/g32", "static(kivi4/g32)"}, std::pair{"static:kivi4/g32", "static(kivi4/g32)"},
        std::pair{"int8", "static(sym8)"}, std::pair{"fp8", "static(fp8)"},
        std::pair{"static:k=kivi4/g32,v=kivi2/g32;0=fp16", "static(k=kivi4/g32,v=kivi2/g32;0=fp16)"}}) {
    CAPTURE(cfg);
    auto p = make_policy(cfg, shape);
    REQUIRE(p.ok());
    CHECK((*p)->name() == name);
  }
}

TEST_CASE("make_policy: errors quote the configuration", "[config]") {
  const auto shape = smol_shape();
  auto unknown = make_policy("autokk:phi=0.5", shape);
  REQUIRE_FALSE(unknown.ok());
  CHECK(unknown.error().code() == kvq::errc::invalid_argument);
  CHECK_THAT(unknown.error().message(),
             Contains("autokk:phi=0.5") && Contains("unknown policy 'autokk'") && Contains("static"));
  auto bad = make_policy("kivi5/g32", shape);
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.error().message(), Contains("configuration 'kivi5/g32'"));
  auto bad_static = make_policy("static:k=kivi4/g32,v=nope", shape);
  REQUIRE_FALSE(bad_static.ok());
  CHECK_THAT(bad_static.error().message(), Contains("static:k=kivi4/g32,v=nope") && Contains("nope"));
  CHECK_FALSE(make_policy("", shape).ok());
  CHECK_FALSE(policy_registry().empty());
  CHECK(policy_registry().front().name == "static");
}

TEST_CASE("is_fp16_reference", "[config]") {
  CHECK(is_fp16_reference("fp16"));
  CHECK(is_fp16_reference("static:fp16"));
  CHECK(is_fp16_reference("k=fp16,v=fp16"));
  CHECK_FALSE(is_fp16_reference("bf16"));
  CHECK_FALSE(is_fp16_reference("fp16;0=int8"));
  CHECK_FALSE(is_fp16_reference("kivi4/g32"));
  CHECK_FALSE(is_fp16_reference("garbage"));
}

TEST_CASE("fp16_bytes counts K and V in two bytes", "[config]") {
  CHECK(fp16_bytes(smol_shape(), 1) == 30u * 3 * 64 * 2 * 2);
  CHECK(fp16_bytes(smol_shape(), 2048) == 2048ull * 30 * 3 * 64 * 4);
}

TEST_CASE("make_eval_cache: a format the model cannot take names the configuration", "[config]") {
  auto model = kvq::llama::llama_model::load(test::stories_path());
  REQUIRE(model.ok());
  cache_settings s;
  s.max_tokens = 256;
  auto ok = make_eval_cache(*model, "bf16", s);
  REQUIRE(ok.ok());
  CHECK(ok->config().shape.head_dim == 8);
  CHECK(ok->config().budget_bytes > fp16_bytes(ok->config().shape, 256));
  auto bad = make_eval_cache(*model, "kivi4/g32", s);  // head_dim 8 is no multiple of 32
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.error().message(), Contains("configuration 'kivi4/g32'"));
}

TEST_CASE("make_eval_cache: '+rot' rotates every head of the configuration's cache", "[config]") {
  cache_settings s;
  s.max_tokens = 256;
  auto plain = make_eval_cache(smol_shape(), "kivi2/g32", s);
  auto rot = make_eval_cache(smol_shape(), "kivi2/g32+rot", s);
  REQUIRE(plain.ok());
  REQUIRE(rot.ok());
  CHECK_FALSE(plain->config().rotation.any());
  const auto& heads = rot->config().rotation.heads;
  CHECK(heads.size() == size_t(30 * 3));
  CHECK(std::all_of(heads.begin(), heads.end(), [](uint8_t h) { return h == 1; }));
  CHECK(rot->active_policy().name() == plain->active_policy().name());
  auto echo = make_eval_cache(smol_shape(), "echokv:seed=3+rot", s);
  REQUIRE(echo.ok());
  CHECK(echo->config().rotation.any());

  // clip percentiles chosen on unrotated heads only: a rotated rolealign run is refused
  s.clip_percentiles.assign(size_t(30 * 3 * 2), 95.f);
  auto ra = make_eval_cache(smol_shape(), "ra4/g32+rot", s);
  REQUIRE_FALSE(ra.ok());
  CHECK_THAT(ra.error().message(), Contains("configuration 'ra4/g32+rot'") && Contains("no rotated ones"));
  CHECK(make_eval_cache(smol_shape(), "kivi4/g32+rot", s).ok());
  CHECK(make_eval_cache(smol_shape(), "ra4/g32", s).ok());
  s.rotated_clip_percentiles.assign(size_t(30 * 3 * 2), 97.f);  // with rotated ones it runs
  CHECK(make_eval_cache(smol_shape(), "ra4/g32+rot", s).ok());
  s.clip_percentiles.clear();
  s.rotated_clip_percentiles.clear();
  auto bare = make_eval_cache(smol_shape(), "+rot", s);
  REQUIRE_FALSE(bare.ok());
}

TEST_CASE("make_eval_cache: '+sink' and '+sink<N>' keep the first pages FP16, beside '+rot' in any order", "[config]") {
  cache_settings s;
  s.max_tokens = 256;
  CHECK(make_eval_cache(smol_shape(), "kivi2/g32", s)->config().sink_pages == 0);
  auto one = make_eval_cache(smol_shape(), "kivi2/g32+sink", s);
  REQUIRE(one.ok());
  CHECK(one->config().sink_pages == 1);
  CHECK_FALSE(one->config().rotation.any());
  for (const char* both : {"kivi2/g32+rot+sink3", "kivi2/g32+sink3+rot"}) {
    CAPTURE(both);
    auto c = make_eval_cache(smol_shape(), both, s);
    REQUIRE(c.ok());
    CHECK(c->config().sink_pages == 3);
    CHECK(c->config().rotation.any());
    CHECK(c->active_policy().name() == "static(kivi2/g32)");
  }
  for (const char* bad : {"kivi2/g32+sink0", "kivi2/g32+sinkx", "kivi2/g32+sink+sink"}) {
    CAPTURE(bad);
    auto c = make_eval_cache(smol_shape(), bad, s);
    REQUIRE_FALSE(c.ok());
    CHECK_THAT(c.error().message(), Contains(bad));
  }
}

TEST_CASE("teacher_forced_chunk: a chunk ends before the next page encode, at the run's end and a map sample",
          "[config]") {
  cache_settings s;
  s.max_tokens = 1024;
  auto a = make_eval_cache(smol_shape(), "kivi4/g32", s);
  auto b = make_eval_cache(smol_shape(), "fp16", s);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  kvq::KVCache* both[] = {&a.value(), &b.value()};
  std::vector<float> rows(size_t(127) * 3 * 64);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = float(int(i % 17) - 8) / 8.f;
  auto feed = [&](int64_t m) {
    for (kvq::KVCache* c : both)
      REQUIRE(c->append(0, 0, {rows.data(), kvq::dtype::f32, m, 3, 64}, {rows.data(), kvq::dtype::f32, m, 3, 64}).ok());
  };
  for (kvq::KVCache* c : both) REQUIRE(c->create_sequence(0).ok());
  eval_options o;
  o.tokens = 1000;
  o.map_every = 0;
  CHECK(teacher_forced_chunk(both, o, 0) == 64);  // 127 before the first encode, at most 64 a step
  feed(100);                                       // 100 unencoded: 27 more before page_tokens + recent
  CHECK(teacher_forced_chunk(both, o, 100) == 27);
  o.tokens = 110;
  CHECK(teacher_forced_chunk(both, o, 100) == 10);  // the run's end
  o.tokens = 1000;
  o.map_every = 16;
  CHECK(teacher_forced_chunk(both, o, 100) == 12);  // the next format-map sample at 112
  o.map_every = 0;
  feed(27);  // 127 unencoded: the next token encodes a page and goes alone
  CHECK(teacher_forced_chunk(both, o, 127) == 1);
  // a policy that watches queries (EchoKV) decides on every step: one token per step
  auto echo = make_eval_cache(smol_shape(), "echokv:seed=3", s);
  REQUIRE(echo.ok());
  REQUIRE(echo.value().create_sequence(0).ok());
  kvq::KVCache* with_echo[] = {&a.value(), &echo.value()};
  CHECK(teacher_forced_chunk(with_echo, o, 0) == 1);
}

namespace {
// A run of fp16 over 8 + 8 tokens of the tiny story on stories260K, without needle or progress.
eval_options tiny_options() {
  eval_options o;
  o.model_path = test::stories_path();
  o.text_path = test::own_data("tiny_story.txt");
  o.configs = {"fp16"};
  o.needle_contexts.clear();
  o.prefill = 8;
  o.tokens = 8;
  o.progress = false;
  return o;
}
}  // namespace

TEST_CASE("validate_options and run_eval: errors name the option, file or configuration", "[config]") {
  eval_options o = tiny_options();
  REQUIRE(validate_options(o).ok());

  SECTION("duplicate configuration") {
    o.configs = {"bf16", "bf16"};
    CHECK_THAT(validate_options(o).message(), Contains("'bf16' is given twice"));
  }
  SECTION("bad depth") {
    o.needle_contexts = {128};
    o.needle_depths = {1.5};
    CHECK_THAT(validate_options(o).message(), Contains("--needle-depths 1.5"));
  }
  SECTION("no configuration") {
    o.configs.clear();
    CHECK_THAT(validate_options(o).message(), Contains("--config"));
  }
  SECTION("missing model") {
    o.model_path = "/nonexistent/model.gguf";
    auto r = run_eval(o);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == kvq::errc::io_error);
    CHECK_THAT(r.error().message(), Contains("/nonexistent/model.gguf"));
  }
  SECTION("bad configuration spec") {
    o.configs = {"fp16", "kivi5/g32"};
    auto r = run_eval(o);
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.error().message(), Contains("kivi5/g32"));
  }
  SECTION("text too short") {
    o.tokens = 100000;
    auto r = run_eval(o);
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.error().message(), Contains("tiny_story.txt") && Contains("--tokens 100000"));
  }
  SECTION("needle context beyond the model's training context") {
    o.needle_contexts = {4096};
    auto r = run_eval(o);
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.error().message(), Contains("--needle-ctx 4096") && Contains("512"));
  }
  SECTION("a run in process: the reference is added when no fp16 is given") {
    o.configs = {"bf16"};
    auto r = run_eval(o);
    REQUIRE(r.ok());
    REQUIRE(r->configs.size() == 2);
    CHECK(r->configs[0].config == "fp16");
    CHECK(r->configs[0].reference);
    CHECK(r->reference == 0);
    CHECK(r->configs[1].quality.positions() == 8);
    CHECK(r->configs[1].policy_name == "static(bf16)");
  }
}

// ---- policies by name (kl_budget, autok, random, echokv) ------------------------------------------

#include <fmt/format.h>
#include <unistd.h>

#include <kvq/calib/artifact.hpp>
#include <kvq/policy/random_policy.hpp>
#include <kvq/policy/sensitivity.hpp>

namespace {

// A calibration artifact for smol_shape(): kivi8/4/2 damages that grow with the layer index
// (layer 29 is the most sensitive), written to a temporary file; with `rotated`, also rotated
// damages that shrink with the layer index (layer 0 the most sensitive on rotated heads).
struct temp_artifact {
  std::string path;
  /// `clip`: every rolealign clip percentile of the artifact; `rotated_clip` > 0: every rotated one.
  explicit temp_artifact(const kvq::cache_shape& s, float clip = 100.f, bool rotated = false,
                         float rotated_clip = 0.f) {
    kvq::calib::artifact a;
    a.shape = {s.layers, s.q_heads, s.kv_heads, s.head_dim};
    a.text_hash = kvq::calib::artifact::hash_text("calibration");
    a.calibration_tokens = 512;
    a.sensitivity = kvq::sensitivity_profile::make(s.layers, s.kv_heads,
                                                   {kvq::parse_format("kivi8/g32").value_or_throw(),
                                                    kvq::parse_format("kivi4/g32").value_or_throw(),
                                                    kvq::parse_format("kivi2/g32").value_or_throw()})
                        .value_or_throw();
    for (int l = 0; l < s.layers; ++l)
      for (int h = 0; h < s.kv_heads; ++h)
        for (kvq::role r : {kvq::role::k, kvq::role::v})
          for (int f = 0; f < 3; ++f) a.sensitivity.at(l, h, r, f) = (1.0 + l + 0.1 * h) * std::pow(16.0, f) * 1e-6;
    if (rotated) {
      a.rotated_sensitivity = a.sensitivity;
      for (int l = 0; l < s.layers; ++l)
        for (int h = 0; h < s.kv_heads; ++h)
          for (kvq::role r : {kvq::role::k, kvq::role::v})
            for (int f = 0; f < 3; ++f)
              a.rotated_sensitivity.at(l, h, r, f) = (double(s.layers) - l + 0.1 * h) * std::pow(16.0, f) * 1e-7;
    }
    a.clip_percentiles.assign(size_t(s.layers) * s.kv_heads * 2, clip);
    if (rotated_clip > 0.f) a.rotated_clip_percentiles.assign(a.clip_percentiles.size(), rotated_clip);
    path = (std::filesystem::temp_directory_path() / fmt::format("kvq_eval_artifact_{}_{}_{}_{}.json", ::getpid(), clip,
                                                                 rotated ? "rot" : "plain", rotated_clip))
               .string();
    kvq::check(a.save(path));
  }
  ~temp_artifact() { std::filesystem::remove(path); }
};

std::shared_ptr<kvq::policy> bound(std::string_view cfg, const kvq::cache_shape& shape, bool rotated = false) {
  auto p = make_policy(cfg, shape, rotated);
  INFO(cfg << ": " << (p.ok() ? std::string("ok") : p.error().to_string()));
  REQUIRE(p.ok());
  REQUIRE((*p)->bind(shape).ok());
  return *p;
}

double map_bits(const kvq::policy& p, const kvq::cache_shape& s) {
  return kvq::format_map::of(p, s.layers, s.kv_heads).average_bits(s.page_tokens, s.head_dim);
}

}  // namespace

TEST_CASE("make_policy: kl_budget, autok, random and echokv by name", "[config]") {
  const auto shape = smol_shape();
  const temp_artifact art(shape);
  const std::string A = ",artifact=" + art.path;

  SECTION("kl_budget reaches the bits target") {
    for (double bits : {4.0, 5.0, 6.0}) {
      CAPTURE(bits);
      const auto p = bound(fmt::format("kl_budget:bits={}", bits) + A, shape);
      CHECK_THAT(p->name(), Contains("kl_budget"));
      CHECK(map_bits(*p, shape) <= bits);
      CHECK(map_bits(*p, shape) > bits - 0.1);
    }
    CHECK(bound("kl_budget:kl=1e9" + A, shape) != nullptr);
  }
  SECTION("autok protects the most sensitive layers") {
    const auto p = bound("autok:phi=0.1,high=kivi8/g32,low=kivi2/g32" + A, shape);
    CHECK(p->current(29, 0) == kvq::format_pair{kvq::parse_format("kivi8/g32").value_or_throw(),
                                                kvq::parse_format("kivi8/g32").value_or_throw()});
    CHECK(p->current(0, 0) == kvq::format_pair{kvq::parse_format("kivi2/g32").value_or_throw(),
                                               kvq::parse_format("kivi2/g32").value_or_throw()});
  }
  SECTION("a rotated cache's kl_budget and autok read the artifact's rotated damages") {
    const temp_artifact rot(shape, 100.f, true);
    const std::string R = ",artifact=" + rot.path;
    const auto k8 = kvq::parse_format("kivi8/g32").value_or_throw();
    const auto k2 = kvq::parse_format("kivi2/g32").value_or_throw();
    const std::string autok = "autok:phi=0.1,high=kivi8/g32,low=kivi2/g32";
    // unrotated: layer 29 is the most sensitive; rotated: layer 0
    CHECK(bound(autok + R, shape)->current(29, 0) == kvq::format_pair{k8, k8});
    const auto p = bound(autok + R, shape, true);
    CHECK(p->current(0, 0) == kvq::format_pair{k8, k8});
    CHECK(p->current(29, 0) == kvq::format_pair{k2, k2});
    // kl_budget moves the least damaging units down first: the rotated table inverts the order
    const auto plain = kvq::format_map::of(*bound("kl_budget:bits=4" + R, shape), shape.layers, shape.kv_heads);
    const auto rotated = kvq::format_map::of(*bound("kl_budget:bits=4" + R, shape, true), shape.layers, shape.kv_heads);
    CHECK_FALSE(plain == rotated);
    CHECK(map_bits(*bound("kl_budget:bits=5" + R, shape, true), shape) <= 5.0);
    CHECK(bound("random:seed=1,like=kl_budget:bits=4" + R, shape, true) != nullptr);
    // an artifact without rotated damages is refused for a rotated cache, naming the fix
    auto no_rot = make_policy("kl_budget:bits=5" + A, shape, true);
    REQUIRE_FALSE(no_rot.ok());
    CHECK_THAT(no_rot.error().message(), Contains("no rotated damages") && Contains("kvq-calibrate --rotated"));
    CHECK_FALSE(make_policy(autok + A, shape, true).ok());
    // the eval cache passes the rotation through: `<config>+rot`
    cache_settings cs;
    cs.max_tokens = 128;
    CHECK_FALSE(make_eval_cache(shape, "kl_budget:bits=5" + A + "+rot", cs).ok());
    CHECK(make_eval_cache(shape, "kl_budget:bits=5" + R + "+rot", cs).ok());
  }
  SECTION("random keeps the bytes of the configuration it copies and moves its formats") {
    const std::string like = "kl_budget:bits=4" + A;  // a mix of kivi4 and kivi2
    const auto base = bound(like, shape);
    const auto r1 = bound("random:seed=1,like=" + like, shape), r2 = bound("random:seed=2,like=" + like, shape);
    const auto m0 = kvq::format_map::of(*base, shape.layers, shape.kv_heads);
    const auto m1 = kvq::format_map::of(*r1, shape.layers, shape.kv_heads);
    const auto m2 = kvq::format_map::of(*r2, shape.layers, shape.kv_heads);
    CHECK(m1.page_bytes(64, 64) == m0.page_bytes(64, 64));
    CHECK(m2.page_bytes(64, 64) == m0.page_bytes(64, 64));
    CHECK_FALSE(m1 == m0);
    CHECK_FALSE(m1 == m2);
    CHECK(bound("random:seed=1,like=" + like, shape)->name() == r1->name());
    // random of a random, and of a static configuration
    CHECK(bound("random:seed=3,like=random:seed=1,like=" + like, shape) != nullptr);
    CHECK(bound("random:like=k=kivi4/g32,v=kivi2/g32;0=fp16", shape) != nullptr);
  }
  SECTION("echokv parameters") {
    CHECK(bound("echokv:seed=7", shape)->name() ==
          "echokv(kivi2/g32|kivi4/g32|kivi8/g32,rate=0.015625,seed=7,per_layer,k=3,h=0.1)");
    CHECK_THAT(bound("echokv:seed=7,hysteresis=1", shape)->name(), Contains("k=1,h=0)"));
    CHECK_THAT(bound("echokv:seed=1,hysteresis=5,margin=0.2,rate=0.25,per_head", shape)->name(),
               Contains("rate=0.25,seed=1,per_head,k=5,h=0.2"));
    CHECK_THAT(bound("echokv:seed=1,tiers=kivi4/g32|kivi8/g32", shape)->name(), Contains("(kivi4/g32|kivi8/g32,"));
    const auto t = bound("echokv:seed=1,target_bits=5", shape);
    CHECK_THAT(t->name(), Contains("target_bits=5"));
    CHECK(t->wants_queries());
  }
  SECTION("echokv starting tier: init=low|mid|high or a tier index") {
    const auto fmt_of = [](const char* f) {
      const kvq::format_id id = kvq::parse_format(f).value_or_throw();
      return kvq::format_pair{id, id};
    };
    const kvq::format_pair k2 = fmt_of("kivi2/g32"), k4 = fmt_of("kivi4/g32"), k8 = fmt_of("kivi8/g32");
    CHECK(bound("echokv:seed=1", shape)->current(0, 0) == k8);  // default: the highest
    for (const auto& [init, want] : std::vector<std::pair<std::string, kvq::format_pair>>{
             {"0", k2}, {"1", k4}, {"2", k8}, {"low", k2}, {"mid", k4}, {"high", k8}}) {
      CAPTURE(init);
      const auto p = bound("echokv:seed=1,init=" + init, shape);
      CHECK(p->current(0, 0) == want);
      CHECK(p->current(shape.layers - 1, shape.kv_heads - 1) == want);
      CHECK(map_bits(*p, shape) == map_bits(*bound("static:" + kvq::format_pair_name(want), shape), shape));
    }
    // with budget mode, and with other tiers (mid of two is the lower one)
    CHECK(bound("echokv:seed=1,init=1,target_bits=4", shape)->current(3, 1) == k4);
    CHECK(bound("echokv:seed=1,tiers=kivi4/g32|kivi8/g32,init=mid", shape)->current(0, 0) == k4);
    CHECK(bound("echokv:seed=1,tiers=kivi4/g32|kivi8/g32,init=high", shape)->current(0, 0) == k8);
  }
  SECTION("errors name the configuration and the parameter") {
    const auto err = [&](const std::string& cfg) {
      auto p = make_policy(cfg, shape);
      REQUIRE_FALSE(p.ok());
      CHECK_THAT(p.error().message(), Contains("configuration '" + cfg + "'"));
      return p.error().message();
    };
    CHECK_THAT(err("kl_budget:bits=4"), Contains("'artifact=' is required"));
    CHECK_THAT(err("kl_budget:bits=4,kl=1" + A), Contains("exactly one of"));
    CHECK_THAT(err("kl_budget:bits=four" + A), Contains("'bits=four' is not a number"));
    CHECK_THAT(err("kl_budget:bits=4,budget=2" + A), Contains("unknown parameter 'budget'"));
    CHECK_THAT(err("kl_budget:bits=4,artifact=/nonexistent/a.json"), Contains("/nonexistent/a.json"));
    CHECK_THAT(err("autok:phi=0.5,high=kivi8/g32" + A), Contains("'low=' is required"));
    CHECK_THAT(err("autok:phi=0.5,high=kivi8/g32,low=kivi3" + A), Contains("low=kivi3"));
    CHECK_THAT(err("autok:phi=0.5,high=kivi8/g32,low=sym4/g32" + A), Contains("not a candidate"));
    CHECK_THAT(err("random:seed=1"), Contains("'like=' is required"));
    CHECK_THAT(err("random:seed=x,like=fp16"), Contains("'seed=x'"));
    CHECK_THAT(err("random:seed=1,like=nope:x"), Contains("unknown policy 'nope'"));
    CHECK_THAT(err("echokv:hysteresis=0"), Contains("hysteresis=0 must be in [1, 1000]"));
    CHECK_THAT(err("echokv:tiers=kivi4/g32|kivi9"), Contains("kivi9"));
    CHECK_THAT(err("echokv:seed=1,,rate=1"), Contains("two commas"));
    CHECK_THAT(err("echokv:seed=1,init=3"),
               Contains("parameter 'init=3' is not low, mid, high or a tier index in [0, 2]"));
    CHECK_THAT(err("echokv:seed=1,init=top"), Contains("parameter 'init=top'"));
    CHECK_THAT(err("echokv:seed=1,init=-1"), Contains("parameter 'init=-1'"));
    CHECK_THAT(err("echokv:seed=1,init="), Contains("parameter 'init='"));
    CHECK_THAT(err("echokv:seed=1,tiers=kivi4/g32|kivi8/g32,init=2"), Contains("tier index in [0, 1]"));
    CHECK_THAT(err("echokv:seed=1,initial=1"), Contains("unknown parameter 'initial'"));
    // another model's artifact
    kvq::cache_shape other = shape;
    other.layers = 12;
    auto p = make_policy("kl_budget:bits=4" + A, other);
    REQUIRE_FALSE(p.ok());
    CHECK_THAT(p.error().message(), Contains("layers"));
  }
}

// ---- rolealign clip percentiles (--clip-percentiles) -----------------------------------------------

#include <eval/report.hpp>
#include <random>

namespace {

// K then V of layer 0 as the cache reads them back after 320 tokens of fixed Gaussian data (pages
// hold tokens 0..255, the FP16 ring the rest): what a configuration stores.
std::vector<float> stored_layer0(std::string_view cfg, const cache_settings& settings) {
  const auto shape = smol_shape();
  cache_settings s = settings;
  s.max_tokens = 320;
  auto c = make_eval_cache(shape, cfg, s);
  INFO(cfg << ": " << (c.ok() ? std::string("ok") : c.error().to_string()));
  REQUIRE(c.ok());
  kvq::KVCache cache = std::move(c).value();
  kvq::check(cache.create_sequence(0));
  const size_t n = size_t(320) * shape.kv_heads * shape.head_dim;
  std::mt19937 rng(42);
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<float> k(n), v(n);
  for (size_t i = 0; i < n; ++i) k[i] = g(rng) + (i % 64 == 3 ? 6.f : 0.f), v[i] = g(rng);
  kvq::check(cache.append(0, 0, {k.data(), kvq::dtype::f32, 320, shape.kv_heads, shape.head_dim},
                          {v.data(), kvq::dtype::f32, 320, shape.kv_heads, shape.head_dim}));
  std::vector<float> out(2 * n);
  kvq::check(cache.read(0, 0, kvq::role::k, std::span<float>(out.data(), n)));
  kvq::check(cache.read(0, 0, kvq::role::v, std::span<float>(out.data() + n, n)));
  return out;
}

}  // namespace

TEST_CASE("clip percentiles: rolealign stores what kivi stores at 100 and differs below", "[config]") {
  const auto shape = smol_shape();
  const temp_artifact ones(shape, 100.f), clipped(shape, 90.f, false, 95.f);
  auto r1 = load_clip_percentiles(ones.path, shape);
  auto r08 = load_clip_percentiles(clipped.path, shape);
  REQUIRE(r1.ok());
  REQUIRE(r08.ok());
  REQUIRE(r1->unrotated.size() == size_t(shape.layers) * shape.kv_heads * 2);
  CHECK(r1->rotated.empty());
  CHECK(r08->unrotated == std::vector<float>(r1->unrotated.size(), 90.f));
  CHECK(r08->rotated == std::vector<float>(r1->unrotated.size(), 95.f));

  cache_settings none, at1, at08;
  at1.clip_percentiles = r1->unrotated;
  at08.clip_percentiles = r08->unrotated;
  at08.rotated_clip_percentiles = r08->rotated;
  // a rotated cache takes the rotated table: 95 rotated differs from 90 rotated
  cache_settings rot90 = at08;
  rot90.rotated_clip_percentiles = r08->unrotated;
  CHECK(stored_layer0("ra2/g32+rot", at08) != stored_layer0("ra2/g32+rot", rot90));
  CHECK(stored_layer0("ra2/g32", at08) == stored_layer0("ra2/g32", rot90));
  for (const char* b : {"4", "2"}) {
    const std::string ra = fmt::format("ra{}/g32", b), kivi = fmt::format("kivi{}/g32", b);
    CAPTURE(ra);
    const auto kivi_stored = stored_layer0(kivi, none);
    CHECK(stored_layer0(ra, none) == kivi_stored);    // no percentiles: nothing clipped
    CHECK(stored_layer0(ra, at1) == kivi_stored);     // every percentile 100: nothing clipped, kivi's bytes
    CHECK(stored_layer0(kivi, at08) == kivi_stored);  // other families ignore the percentiles
    const auto ra_clipped = stored_layer0(ra, at08);
    REQUIRE(ra_clipped.size() == kivi_stored.size());
    // pages (tokens 0..255) differ; the FP16 ring (tokens 256..319) is the same
    const size_t n = kivi_stored.size() / 2, page_part = size_t(256) * shape.kv_heads * shape.head_dim;
    for (size_t part : {size_t(0), n}) {
      size_t differ = 0;
      for (size_t i = 0; i < page_part; ++i) differ += ra_clipped[part + i] != kivi_stored[part + i];
      CHECK(differ > page_part / 4);
      CHECK(std::equal(ra_clipped.begin() + long(part + page_part), ra_clipped.begin() + long(part + n),
                       kivi_stored.begin() + long(part + page_part)));
    }
  }

  // The SmolLM2 artifact of docs/data clips some heads, unrotated and rotated (not in layer 0).
  if (std::filesystem::exists(KVQ_EVAL_CALIB_ARTIFACT)) {
    auto smol = load_clip_percentiles(KVQ_EVAL_CALIB_ARTIFACT, shape);
    REQUIRE(smol.ok());
    const auto clips = [](const std::vector<float>& t) {
      return std::count_if(t.begin(), t.end(), [](float p) { return p < 100.f; });
    };
    CHECK(clips(smol->unrotated) > 0);
    REQUIRE(smol->rotated.size() == smol->unrotated.size());
    CHECK(clips(smol->rotated) > 0);
  }
}

TEST_CASE("clip percentiles: a missing, malformed or other model's artifact names the file and the field", "[config]") {
  const auto shape = smol_shape();
  auto missing = load_clip_percentiles("/nonexistent/clips.json", shape);
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.error().code() == kvq::errc::io_error);
  CHECK_THAT(missing.error().message(), Contains("/nonexistent/clips.json"));

  const temp_artifact art(shape, 95.f);
  kvq::cache_shape other = shape;
  other.layers = 12;
  auto wrong = load_clip_percentiles(art.path, other);
  REQUIRE_FALSE(wrong.ok());
  CHECK_THAT(wrong.error().message(), Contains(art.path) && Contains("model.layers"));

  std::string text = test::read_text(art.path);
  const size_t at = text.find("\"clip_percentiles\"");
  REQUIRE(at != std::string::npos);
  text.replace(at, 18, "\"clips\"");
  const std::string bad_path = art.path + ".bad.json";
  REQUIRE(write_text_file(bad_path, text).ok());
  auto malformed = load_clip_percentiles(bad_path, shape);
  std::filesystem::remove(bad_path);
  REQUIRE_FALSE(malformed.ok());
  CHECK_THAT(malformed.error().message(), Contains(bad_path) && Contains("'clip_percentiles' is missing"));

  // kvq-eval --clip-percentiles: stories260K is not the artifact's model
  eval_options o = tiny_options();
  o.clip_percentiles_path = art.path;
  auto r = run_eval(o);
  REQUIRE_FALSE(r.ok());
  CHECK_THAT(r.error().message(), Contains("--clip-percentiles") && Contains(art.path) && Contains("model.layers"));
}

// ---- bad input found before any long work; resumed runs -------------------------------------------

namespace {

/// A file in the temporary folder, removed at the end of the scope.
struct scratch_file {
  std::string path;
  scratch_file(std::string_view name, std::string_view bytes)
      : path((std::filesystem::temp_directory_path() / fmt::format("kvq_eval_{}_{}", ::getpid(), name)).string()) {
    std::ofstream(path, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
  }
  ~scratch_file() { std::filesystem::remove(path); }
};

/// A GGUF v3 file with no tensors and one key, general.architecture = `arch`.
std::string gguf_of_architecture(std::string_view arch) {
  std::string s = "GGUF";
  auto put = [&](auto v) { s.append(reinterpret_cast<const char*>(&v), sizeof v); };
  auto str = [&](std::string_view v) {
    put(uint64_t(v.size()));
    s += v;
  };
  put(uint32_t(3));  // version
  put(uint64_t(0));  // tensors
  put(uint64_t(1));  // key-value pairs
  str("general.architecture");
  put(uint32_t(8));  // string
  str(arch);
  return s;
}

}  // namespace

TEST_CASE("run_eval: a model file that is not a llama GGUF is named before any work", "[config]") {
  eval_options o = tiny_options();
  SECTION("not a GGUF file") {
    o.model_path = test::own_data("tiny_story.txt");
    auto r = run_eval(o);
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.error().message(), Contains("tiny_story.txt") && Contains("not a GGUF file"));
  }
  SECTION("a GGUF of another architecture") {
    scratch_file f("gpt2.gguf", gguf_of_architecture("gpt2"));
    o.model_path = f.path;
    auto r = run_eval(o);
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.error().message(), Contains(f.path) && Contains("architecture 'gpt2' is not supported"));
  }
  SECTION("an unknown policy") {
    o.configs = {"fp16", "nosuch:x=1"};
    auto r = run_eval(o);
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.error().message(), Contains("nosuch"));
  }
}

TEST_CASE("run_eval --resume: the teacher-forced phase and finished trials are read back", "[config]") {
  eval_options o = tiny_options();
  o.configs = {"fp16", "bf16"};
  o.needle_contexts = {256};
  o.needle_depths = {0.5};
  o.needle_kinds = {"single"};
  scratch_file rec("resume_run.json", "");
  std::filesystem::remove(rec.path);
  o.resume_path = rec.path;  // missing: the run starts afresh
  int checkpoints = 0;
  o.on_checkpoint = [&](const eval_report& r) {
    ++checkpoints;
    kvq::check(write_text_file(rec.path, to_json(r).dump()));
  };
  auto first = run_eval(o);
  INFO((first.ok() ? std::string() : first.error().to_string()));
  REQUIRE(first.ok());
  CHECK_FALSE(first->resumed);
  CHECK(checkpoints == 2);  // after the teacher-forced phase and after the trial
  REQUIRE(std::filesystem::exists(rec.path));

  auto second = run_eval(o);
  REQUIRE(second.ok());
  CHECK(second->resumed);
  CHECK(checkpoints == 2);  // nothing new to save: every trial was read back
  REQUIRE(second->configs.size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    CAPTURE(i);
    CHECK(second->configs[i].quality.kl_values() == first->configs[i].quality.kl_values());
    CHECK(second->configs[i].quality.nll_values() == first->configs[i].quality.nll_values());
    CHECK(second->configs[i].decode_seconds == first->configs[i].decode_seconds);  // read, not re-measured
    REQUIRE(second->configs[i].needle.size() == 1);
    CHECK(second->configs[i].needle[0].done);
    CHECK(second->configs[i].needle[0].output == first->configs[i].needle[0].output);
  }

  // a finished record: every trial done, nothing is rerun
  kvq::check(write_text_file(rec.path, to_json(*second).dump()));
  auto third = run_eval(o);
  REQUIRE(third.ok());
  CHECK(third->configs[1].needle_prefill_seconds == second->configs[1].needle_prefill_seconds);

  // another run's record is refused, naming what differs
  o.prefill = 17;
  auto other = run_eval(o);
  REQUIRE_FALSE(other.ok());
  CHECK_THAT(other.error().message(), Contains(rec.path) && Contains("prefill differs (8 there, 17 here)"));
}
