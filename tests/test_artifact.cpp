// The calibration artifact: exact round trip through a file (with and without the optional
// output_kl), the text hash, and rejection of bad files (malformed JSON, missing fields, wrong
// version, another model's shape, NaN, bad ranges, a malformed output_kl) with messages that name
// the file and the field.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <kvq/calib/artifact.hpp>
#include <kvq/policy/autok.hpp>
#include <random>
#include <sstream>
#include <string>

using namespace kvq;
using calib::artifact;
using calib::model_shape;

namespace {

const model_shape tiny{2, 4, 2, 64};

artifact make_artifact() {
  artifact a;
  a.model_name = "tiny-test";
  a.shape = tiny;
  a.text_hash = artifact::hash_text("Once upon a time");
  a.calibration_tokens = 4096;
  a.sensitivity =
      sensitivity_profile::make(2, 2,
                                {parse_format("kivi2/g32").value_or_throw(), parse_format("kivi4/g32").value_or_throw(),
                                 parse_format("ra8/g64").value_or_throw()})
          .value_or_throw();
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (auto& v : a.sensitivity.values) v = std::pow(10.0, -8.0 * u(rng)) * u(rng);  // 17 digits, wide range
  a.sensitivity.values[3] = 0.0;
  a.sensitivity.values[4] = 1e-300;
  // [l][h][K, V]: k = [[100, 97.25], [90, 99.999]], v = [[99.5, 93.123456789], [95.5, 92]]
  a.clip_percentiles = {100.f, 99.5f, 97.25f, 93.123456789f, 90.f, 95.5f, 99.999f, 92.f};
  return a;
}

// make_artifact() with an output_kl table over two of its three formats.
artifact make_artifact_with_output_kl() {
  artifact a = make_artifact();
  a.output_kl = calib::output_kl_table::make(
      2, 2, {parse_format("kivi4/g32").value_or_throw(), parse_format("kivi2/g32").value_or_throw()}, 96);
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (auto& v : a.output_kl.kl) v = std::pow(10.0, -6.0 * u(rng)) * u(rng);
  a.output_kl.kl[1] = 0.0;
  return a;
}

struct temp_dir {
  std::filesystem::path path;
  temp_dir() {
    path = std::filesystem::temp_directory_path() /
           ("kvq_artifact_test_" + std::to_string(std::random_device{}()) + "_" + std::to_string(::getpid()));
    std::filesystem::create_directories(path);
  }
  ~temp_dir() { std::filesystem::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

std::string read_text(const std::string& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_text(const std::string& p, const std::string& s) {
  std::ofstream f(p, std::ios::trunc);
  f << s;
}

// Replaces the one occurrence of `from` (the test fails if it is not there exactly once).
std::string edit(std::string s, const std::string& from, const std::string& to) {
  const size_t at = s.find(from);
  REQUIRE(at != std::string::npos);
  REQUIRE(s.find(from, at + 1) == std::string::npos);
  return s.replace(at, from.size(), to);
}

// Writes `text` as a file of `dir`, checks that loading it fails with a message naming the file,
// and returns the message.
std::string load_error(const temp_dir& dir, const std::string& text) {
  const std::string p = dir.file("bad.json");
  write_text(p, text);
  auto r = artifact::load(p, tiny);
  REQUIRE_FALSE(r.ok());
  CHECK_THAT(r.error().message(), Catch::Contains(p));  // every message names the file
  return r.error().message();
}

}  // namespace

TEST_CASE("artifact round trip through a file is exact", "[artifact]") {
  temp_dir dir;
  const artifact a = make_artifact();
  const std::string path = dir.file("sens.json");
  REQUIRE(a.save(path).ok());
  const std::string text = read_text(path);
  CHECK_THAT(text, Catch::Contains("\"version\": 4"));
  CHECK_THAT(text, Catch::Contains("\"kind\": \"kvq.calibration\""));
  CHECK_THAT(text, Catch::Contains("99.5,"));  // floats written as their shortest decimal
  CHECK_THAT(text, Catch::Contains("\"clip_percentiles\"") && !Catch::Contains("clip_ratios"));
  auto b = artifact::load(path, tiny).value_or_throw();
  CHECK(b.version == 4);
  CHECK(b.model_name == a.model_name);
  CHECK(b.shape == a.shape);
  CHECK(b.text_hash == a.text_hash);
  CHECK(b.calibration_tokens == 4096);
  CHECK(b.sensitivity.formats == a.sensitivity.formats);
  CHECK(b.sensitivity.values == a.sensitivity.values);  // bit-exact doubles
  CHECK(b.clip_percentiles == a.clip_percentiles);      // bit-exact floats
  CHECK(b.rotated_clip_percentiles.empty());            // optional, absent
  CHECK(b.output_kl.empty());                           // optional, absent
  CHECK_THAT(text, !Catch::Contains("output_kl"));
  // the loaded profile drives a policy like any other
  auto p = autok_policy::create(b.sensitivity, b.sensitivity.formats[0], {0.5, {}, {}}).value_or_throw();
  CHECK(p.protected_layers().size() >= 1);
  // and saving what was loaded gives the same file
  REQUIRE(b.save(dir.file("again.json")).ok());
  CHECK(read_text(dir.file("again.json")) == text);
}

TEST_CASE("artifact: rotated clip percentiles, and versions 1-3 load as no clipping", "[artifact]") {
  artifact a = make_artifact();
  a.rotated_clip_percentiles = {93.f, 100.f, 99.f, 90.f, 95.f, 96.f, 97.f, 98.f};
  const std::string text = a.to_json().value_or_throw();
  CHECK_THAT(text, Catch::Contains("\"rotated_clip_percentiles\""));
  const artifact b = artifact::parse(text, "rot", tiny).value_or_throw();
  CHECK(b.rotated_clip_percentiles == a.rotated_clip_percentiles);
  // a cache's table: each (layer, kv head) from its space's percentiles
  const std::vector<uint8_t> rotated_heads = {1, 0, 0, 1};  // [layer][kv head]
  const auto mixed = b.clip_percentiles_for(rotated_heads).value_or_throw();
  CHECK(mixed == std::vector<float>{93.f, 100.f, 97.25f, 93.123456789f, 90.f, 95.5f, 97.f, 98.f});
  CHECK(b.clip_percentiles_for({}).value_or_throw() == b.clip_percentiles);
  CHECK_THAT(b.clip_percentiles_for({1, 0}).error().message(), Catch::Contains("2 rotated-head flags"));
  // without a rotated table a rotated head gets 100: no clipping
  CHECK(make_artifact().clip_percentiles_for(rotated_heads).value_or_throw() ==
        std::vector<float>{100.f, 100.f, 97.25f, 93.123456789f, 90.f, 95.5f, 100.f, 100.f});

  // version 3: clip ratios (the former rule) are checked, then read as percentile 100
  artifact old = make_artifact();
  old.version = 3;
  old.clip_percentiles.assign(8, 100.f);
  std::string v3 = old.to_json().value_or_throw();
  CHECK_THAT(v3, Catch::Contains("\"clip_ratios\"") && !Catch::Contains("clip_percentiles"));
  v3 = edit(v3, "\"clip_ratios\": {\n  \"k\": [\n   [\n    1.0,", "\"clip_ratios\": {\n  \"k\": [\n   [\n    0.95,");
  const artifact c = artifact::parse(v3, "v3", tiny).value_or_throw();
  CHECK(c.version == 3);
  CHECK(c.clip_percentiles == std::vector<float>(8, 100.f));  // 0.95 is not a percentile: no clipping
  CHECK(c.rotated_clip_percentiles.empty());
  CHECK_THAT(artifact::parse(edit(v3, "    0.95,", "    1.5,"), "v3bad", tiny).error().message(),
             Catch::Contains("'clip_ratios.k[0][0]' is 1.5, must be in (0, 1]"));
  // a field of the other version is refused
  CHECK_THAT(artifact::parse(edit(text, "\"version\": 4", "\"version\": 3"), "v3pct", tiny).error().message(),
             Catch::Contains("field 'clip_ratios' is missing"));
  CHECK_THAT(artifact::parse(edit(v3, "\"version\": 3", "\"version\": 4"), "v4ratio", tiny).error().message(),
             Catch::Contains("field 'clip_percentiles' is missing"));
}

TEST_CASE("artifact round trip with the optional output_kl", "[artifact]") {
  temp_dir dir;
  const artifact a = make_artifact_with_output_kl();
  const std::string path = dir.file("okl.json");
  REQUIRE(a.save(path).ok());
  const std::string text = read_text(path);
  CHECK_THAT(text, Catch::Contains("\"output_kl\": {"));
  auto b = artifact::load(path, tiny).value_or_throw();
  REQUIRE_FALSE(b.output_kl.empty());
  CHECK(b.output_kl.layers == 2);
  CHECK(b.output_kl.kv_heads == 2);
  CHECK(b.output_kl.formats == a.output_kl.formats);
  CHECK(b.output_kl.tokens == 96);
  CHECK(b.output_kl.kl == a.output_kl.kl);  // bit-exact doubles
  CHECK(b.output_kl.at(1, 0, 1) == a.output_kl.kl[(1 * 2 + 0) * 2 + 1]);
  CHECK(b.sensitivity.values == a.sensitivity.values);
  REQUIRE(b.save(dir.file("again.json")).ok());
  CHECK(read_text(dir.file("again.json")) == text);
}

// make_artifact() with fitted levels of cb2 (unrotated) and cb3/g32 (rotated).
artifact make_artifact_with_codebooks() {
  artifact a = make_artifact();
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> u(0.05f, 0.5f);
  for (auto [spec, rotated] : {std::pair{"cb2", false}, std::pair{"cb3/g32", true}}) {
    calib::codebook_fit c{parse_format(spec).value_or_throw(), rotated, {}};
    const int n = 1 << traits_of(c.format).bits;
    for (int unit = 0; unit < 2 * 2 * 2; ++unit) {
      float x = -2.5f;
      for (int k = 0; k < n; ++k) c.levels.push_back(x += u(rng));  // ascending
    }
    a.codebooks.push_back(std::move(c));
  }
  return a;
}

TEST_CASE("artifact round trip with fitted codebook levels; a cache's levels per head space", "[artifact][codebook]") {
  temp_dir dir;
  const artifact a = make_artifact_with_codebooks();
  const std::string path = dir.file("cb.json");
  REQUIRE(a.save(path).ok());
  const std::string text = read_text(path);
  CHECK_THAT(text, Catch::Contains("\"codebooks\": [") && Catch::Contains("\"format\": \"cb3/g32\""));
  const artifact b = artifact::load(path, tiny).value_or_throw();
  REQUIRE(b.codebooks.size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    CHECK(b.codebooks[i].format == a.codebooks[i].format);
    CHECK(b.codebooks[i].rotated == a.codebooks[i].rotated);
    CHECK(b.codebooks[i].levels == a.codebooks[i].levels);  // bit-exact floats
  }
  REQUIRE(b.save(dir.file("again.json")).ok());
  CHECK(read_text(dir.file("again.json")) == text);
  // levels for a cache: cb2 has an unrotated fit only, so a rotated head keeps Lloyd-Max
  const format_id cb2 = parse_format("cb2").value_or_throw(), cb3 = parse_format("cb3/g32").value_or_throw();
  const std::vector<uint8_t> rotated_heads = {0, 1, 0, 0};  // layer 0 head 1 rotated
  const auto lv = b.codebook_levels_for(cb2, rotated_heads).value_or_throw();
  REQUIRE(lv.size() == 2 * 2 * 2 * 4);
  for (int unit = 0; unit < 8; ++unit)
    for (int k = 0; k < 4; ++k) {
      const bool rotated = unit / 2 == 1;
      CHECK(lv[size_t(unit * 4 + k)] ==
            (rotated ? lloyd_max_level(2, k) : a.codebooks[0].levels[size_t(unit * 4 + k)]));
    }
  const auto lv3 = b.codebook_levels_for(cb3, rotated_heads).value_or_throw();
  CHECK(lv3[2 * 8 + 3] == a.codebooks[1].levels[2 * 8 + 3]);  // layer 0 head 1 K: the rotated fit
  CHECK(lv3[3] == lloyd_max_level(3, 3));                     // layer 0 head 0: unrotated, no fit
  CHECK(b.codebook_levels_for(parse_format("cb4").value_or_throw(), {}).error().code() == errc::not_found);
  CHECK_THAT(b.codebook_levels_for(parse_format("kivi4/g32").value_or_throw(), {}).error().message(),
             Catch::Contains("not a codebook format"));
  // an older version without codebooks still loads; a version 2 file with them does not
  artifact old = make_artifact();
  old.version = 2;
  old.clip_percentiles.assign(8, 100.f);  // versions 1-3 hold clip ratios: no percentiles
  const std::string v2 = old.to_json().value_or_throw();
  REQUIRE(artifact::parse(v2, "v2", tiny).value_or_throw().codebooks.empty());
  old.version = 3;
  old.codebooks = b.codebooks;
  CHECK_THAT(artifact::parse(edit(old.to_json().value_or_throw(), "\"version\": 3", "\"version\": 2"), "v2cb", tiny)
                 .error()
                 .message(),
             Catch::Contains("'codebooks' needs version 3, the file is version 2"));
}

TEST_CASE("artifact load rejects bad codebook levels, naming the field", "[artifact][codebook]") {
  temp_dir dir;
  const artifact a = make_artifact_with_codebooks();
  const std::string good = a.to_json().value_or_throw();
  // cb2's (unrotated) K levels of layer 1 head 0: the fifth list of 4 ([layer][head][K, V])
  artifact bad = a;
  std::swap(bad.codebooks[0].levels[4 * 4 + 1], bad.codebooks[0].levels[4 * 4 + 2]);
  CHECK_THAT(bad.save(dir.file("x.json")).message(),
             Catch::Contains("codebooks[0].k[1][0]") && Catch::Contains("strictly ascending"));
  CHECK_FALSE(std::filesystem::exists(dir.file("x.json")));
  bad = a;
  bad.codebooks[1].levels[7] = INFINITY;
  CHECK_THAT(bad.save(dir.file("x.json")).message(),
             Catch::Contains("codebooks[1].k[0][0]") && Catch::Contains("not finite"));
  bad = a;
  bad.codebooks[1].levels.pop_back();
  CHECK_THAT(bad.save(dir.file("x.json")).message(), Catch::Contains("has 63 levels; needs 64 (layers x kv heads x 2 x 8)"));
  bad = a;
  bad.codebooks[1] = bad.codebooks[0];
  CHECK_THAT(bad.save(dir.file("x.json")).message(), Catch::Contains("codebooks[1] repeats codebooks[0]"));
  // in a file: each rejection names the file and the field
  const size_t at = good.find("\"k\": [", good.find("\"codebooks\""));
  REQUIRE(at != std::string::npos);
  CHECK_THAT(load_error(dir, edit(good, "\"format\": \"cb2\"", "\"format\": \"kivi2/g32\"")),
             Catch::Contains("codebooks[0].format") && Catch::Contains("not a codebook format"));
  CHECK_THAT(load_error(dir, edit(good, "\"rotated\": false", "\"rotated\": 0")),
             Catch::Contains("codebooks[0].rotated") && Catch::Contains("true or false"));
  CHECK_THAT(load_error(dir, edit(good, "\"format\": \"cb2\"", "\"format\": \"cb9\"")),
             Catch::Contains("codebooks[0].format"));
  std::string reversed = good;  // the first list of cb2 written in descending order
  {
    const size_t open = good.find('[', good.find('[', good.find('[', at) + 1) + 1);
    const size_t close = good.find(']', open);
    std::string inner = good.substr(open + 1, close - open - 1);
    std::vector<std::string> parts;
    for (size_t p = 0, q; p <= inner.size(); p = q + 1) {
      q = inner.find(',', p);
      if (q == std::string::npos) q = inner.size();
      parts.push_back(inner.substr(p, q - p));
    }
    std::string rev;
    for (size_t i = parts.size(); i-- > 0;) rev += parts[i] + (i ? "," : "");
    reversed = good.substr(0, open + 1) + rev + good.substr(close);
  }
  CHECK_THAT(load_error(dir, reversed),
             Catch::Contains("codebook levels 'codebooks[0].k[0][0]'") && Catch::Contains("strictly ascending"));
  CHECK_THAT(load_error(dir, edit(good, "\"codebooks\": [", "\"codebooks\": {\"a\": 1}, \"x\": [")),
             Catch::Contains("'codebooks' must be an array"));
}

TEST_CASE("artifact load rejects a malformed output_kl, naming the field", "[artifact]") {
  temp_dir dir;
  const artifact a = make_artifact_with_output_kl();
  REQUIRE(a.save(dir.file("good.json")).ok());
  const std::string good = read_text(dir.file("good.json"));
  const auto load_text = [&](const std::string& text) { return load_error(dir, text); };
  const std::string first = "\"kl\": [\n   [\n    [\n     ";
  const size_t at = good.find(first) + first.size();
  const size_t end = good.find(',', at);
  CHECK_THAT(load_text(good.substr(0, at) + "null" + good.substr(end)),
             Catch::Contains("field 'output_kl.kl[0][0][0]' is null"));
  CHECK_THAT(load_text(good.substr(0, at) + "-" + good.substr(at)), Catch::Contains("'output_kl.kl[0][0][0]' is -"));
  CHECK_THAT(load_text(good.substr(0, at) + "\"x\"" + good.substr(end)),
             Catch::Contains("'output_kl.kl[0][0][0]' must be a number"));
  // one format more than the values
  CHECK_THAT(
      load_text(edit(good, "\"formats\": [\n   \"kivi4/g32\",", "\"formats\": [\n   \"kivi4/g32\", \"ra8/g64\",")),
      Catch::Contains("'output_kl.kl[0][0]' has 2 entries, needs 3 (one per output_kl format)"));
  CHECK_THAT(load_text(edit(good, "\"formats\": [\n   \"kivi4/g32\",", "\"formats\": [\n   \"sym8/g32\",")),
             Catch::Contains("field 'output_kl.formats[0]' 'sym8/g32' is not one of 'formats'"));
  CHECK_THAT(load_text(edit(good, "\"formats\": [\n   \"kivi4/g32\",", "\"formats\": [\n   \"kivi2/g32\",")),
             Catch::Contains("'output_kl.formats[1]' repeats output_kl.formats[0]"));
  CHECK_THAT(load_text(edit(good, "\"tokens\": 96", "\"tokens\": 0")), Catch::Contains("'output_kl.tokens' is 0"));
  CHECK_THAT(load_text(edit(good, "\"tokens\": 96", "\"tokenz\": 96")),
             Catch::Contains("field 'output_kl.tokens' is missing"));
  CHECK_THAT(load_text(edit(good, "\"output_kl\": {", "\"output_kl\": [], \"x\": {")),
             Catch::Contains("field 'output_kl' must be an object"));
  // a layer too few: the output_kl of a one-layer artifact in the two-layer file
  artifact one_layer = a;
  one_layer.shape.layers = 1;
  one_layer.sensitivity = sensitivity_profile::make(1, 2, a.sensitivity.formats).value_or_throw();
  one_layer.clip_percentiles.resize(4);
  one_layer.output_kl = calib::output_kl_table::make(1, 2, a.output_kl.formats, 96);
  auto short_text = one_layer.to_json().value_or_throw();
  const size_t okl = short_text.find("\"output_kl\"");
  REQUIRE(okl != std::string::npos);
  CHECK_THAT(load_text(edit(good, good.substr(good.find("\"output_kl\"")), short_text.substr(okl))),
             Catch::Contains("field 'output_kl.kl' has 1 entries, needs 2 (model.layers)"));
}

TEST_CASE("artifact text hash is FNV-1a 64", "[artifact]") {
  CHECK(artifact::hash_text("") == "fnv1a64:cbf29ce484222325");
  CHECK(artifact::hash_text("a") == "fnv1a64:af63dc4c8601ec8c");
  CHECK(artifact::hash_text("foobar") == "fnv1a64:85944171f73967e8");
}

TEST_CASE("artifact load rejects bad files, naming the file and the field", "[artifact]") {
  temp_dir dir;
  const artifact a = make_artifact();
  const std::string good_path = dir.file("good.json");
  REQUIRE(a.save(good_path).ok());
  const std::string good = read_text(good_path);
  const auto load_text = [&](const std::string& text) { return load_error(dir, text); };

  SECTION("missing file") {
    auto r = artifact::load(dir.file("nope.json"), tiny);
    CHECK(r.error().code() == errc::io_error);
    CHECK_THAT(r.error().message(), Catch::Contains("nope.json") && Catch::Contains("cannot open"));
  }
  SECTION("malformed JSON") {
    CHECK_THAT(load_text(good.substr(0, good.size() / 2)), Catch::Contains("malformed JSON at byte"));
    CHECK_THAT(load_text(""), Catch::Contains("malformed JSON"));
    CHECK_THAT(load_text("[1, 2]"), Catch::Contains("must be an object"));
  }
  SECTION("NaN, as a bare literal, as null, as a string") {
    const std::string first = "\"k_attention_kl\": [\n   [\n    [\n     ";
    const size_t at = good.find(first) + first.size();
    const size_t end = good.find(',', at);
    const std::string num = good.substr(at, end - at);
    CAPTURE(num);
    CHECK_THAT(load_text(good.substr(0, at) + "NaN" + good.substr(end)), Catch::Contains("malformed JSON"));
    CHECK_THAT(load_text(good.substr(0, at) + "null" + good.substr(end)),
               Catch::Contains("field 'sensitivity.k_attention_kl[0][0][0]' is null"));
    CHECK_THAT(load_text(good.substr(0, at) + "\"nan\"" + good.substr(end)),
               Catch::Contains("'sensitivity.k_attention_kl[0][0][0]' must be a number, is string"));
  }
  SECTION("missing fields") {
    CHECK_THAT(load_text(edit(good, "\"kind\": \"kvq.calibration\",", "")), Catch::Contains("field 'kind' is missing"));
    CHECK_THAT(load_text(edit(good, "  \"kv_heads\": 2,\n", "")), Catch::Contains("field 'model.kv_heads' is missing"));
    CHECK_THAT(load_text(edit(good, "\"text_hash\"", "\"texthash\"")),
               Catch::Contains("field 'calibration.text_hash' is missing"));
    CHECK_THAT(load_text(edit(good, "\"v_output_perturbation\"", "\"v_perturbation\"")),
               Catch::Contains("field 'sensitivity.v_output_perturbation' is missing"));
    CHECK_THAT(load_text(edit(good, "\"clip_percentiles\"", "\"clips\"")),
               Catch::Contains("field 'clip_percentiles' is missing"));
  }
  SECTION("wrong kind or version") {
    CHECK_THAT(load_text(edit(good, "\"version\": 4", "\"version\": 5")),
               Catch::Contains("field 'version' is 5, this build reads versions 1 to 4"));
    CHECK_THAT(load_text(edit(good, "\"version\": 4", "\"version\": 0")),
               Catch::Contains("field 'version' is 0, this build reads versions 1 to 4"));
    CHECK_THAT(load_text(edit(good, "\"version\": 4", "\"version\": \"1\"")),
               Catch::Contains("field 'version' must be an integer"));
    CHECK_THAT(load_text(edit(good, "kvq.calibration", "kvq.something")), Catch::Contains("is 'kvq.something'"));
  }
  SECTION("a model shape other than the expected one") {
    auto r = artifact::load(good_path, {2, 4, 4, 64});
    CHECK_THAT(
        r.error().message(),
        Catch::Contains(good_path) && Catch::Contains("field 'model.kv_heads' is 2, the model it is loaded for has 4"));
    CHECK_THAT(artifact::load(good_path, {3, 4, 2, 64}).error().message(), Catch::Contains("'model.layers' is 2"));
    CHECK_THAT(artifact::load(good_path, {2, 4, 2, 128}).error().message(), Catch::Contains("'model.head_dim' is 64"));
  }
  SECTION("arrays of the wrong size, bad formats, numbers out of range") {
    // drop the last kv head of layer 1's V clip percentiles (l1: K 90, 99.999; V 95.5, 92)
    const std::string tail = "   [\n    95.5,\n    92.0\n   ]\n  ]\n }";
    CHECK_THAT(load_text(edit(good, tail, "   [\n    95.5\n   ]\n  ]\n }")),
               Catch::Contains("field 'clip_percentiles.v[1]' has 1 entries, needs 2 (model.kv_heads)"));
    CHECK_THAT(
        load_text(edit(good, "    99.999\n", "    101\n")),
        Catch::Contains("'clip_percentiles.k[1][1]' (layer 1, head 1, K): clip percentile 101 is not in [50, 100]"));
    CHECK_THAT(load_text(edit(good, "    99.999\n", "    0.9\n")),  // a former clip ratio
               Catch::Contains("'clip_percentiles.k[1][1]' (layer 1, head 1, K): clip percentile 0.9 is not in"));
    CHECK_THAT(load_text(edit(good, "    99.999\n", "    70\n")),
               Catch::Contains("clip percentile 70 needs the") && Catch::Contains("keeps at most 16"));
    CHECK_THAT(load_text(edit(good, "\"kivi4/g32\"", "\"kivi5/g32\"")),
               Catch::Contains("field 'formats[1]' bad format 'kivi5/g32'"));
    CHECK_THAT(load_text(edit(good, "\"kivi4/g32\"", "\"kivi2/g32\"")),
               Catch::Contains("'formats[1]' repeats formats[0]"));
    CHECK_THAT(load_text(edit(good, "\"formats\": [", "\"formats\": [\"fp16\",")),
               Catch::Contains("'sensitivity.k_attention_kl[0][0]' has 3 entries, needs 4 (one per format)"));
    const std::string first = "\"k_attention_kl\": [\n   [\n    [\n     ";
    const size_t at = good.find(first) + first.size();
    CHECK_THAT(load_text(good.substr(0, at) + "-" + good.substr(at)),
               Catch::Contains("'sensitivity.k_attention_kl[0][0][0]' is -"));
    CHECK_THAT(load_text(edit(good, "\"layers\": 2", "\"layers\": 0")),
               Catch::Contains("'model.layers' is 0, must be in"));
    CHECK_THAT(load_text(edit(good, "\"tokens\": 4096", "\"tokens\": -1")),
               Catch::Contains("'calibration.tokens' is -1"));
  }
}

TEST_CASE("artifact save validates first and never writes NaN", "[artifact]") {
  temp_dir dir;
  artifact a = make_artifact();
  a.sensitivity.values[7] = NAN;
  const std::string p = dir.file("nan.json");
  auto s = a.save(p);
  CHECK_THAT(s.message(), Catch::Contains(p) && Catch::Contains("must be finite"));
  CHECK_FALSE(std::filesystem::exists(p));
  a = make_artifact();
  a.clip_percentiles[2] = 0.f;
  CHECK_THAT(a.save(p).message(),
             Catch::Contains("clip percentiles: layer 0 head 1 K: clip percentile 0 is not in [50, 100]"));
  a = make_artifact();
  a.clip_percentiles.pop_back();
  CHECK_THAT(a.save(p).message(), Catch::Contains("7 clip percentiles, the model needs 8"));
  a = make_artifact();
  a.rotated_clip_percentiles.assign(8, 100.f);
  a.rotated_clip_percentiles[7] = 49.f;
  CHECK_THAT(a.save(p).message(),
             Catch::Contains("rotated clip percentiles: layer 1 head 1 V: clip percentile 49 is not in [50, 100]"));
  a = make_artifact();
  a.version = 3;  // versions 1-3 hold no percentiles: only 100 everywhere can be written as one
  CHECK_THAT(a.save(p).message(), Catch::Contains("clip percentiles: layer 0 head 0 V: needs version 4"));
  a = make_artifact();
  a.version = 5;
  CHECK_THAT(a.save(p).message(), Catch::Contains("version 5"));
  a = make_artifact_with_output_kl();
  a.output_kl.kl[5] = NAN;
  CHECK_THAT(a.save(p).message(), Catch::Contains("output_kl of layer 1 head 0 format kivi2/g32 is nan"));
  a = make_artifact_with_output_kl();
  a.output_kl.kl.pop_back();
  CHECK_THAT(a.save(p).message(), Catch::Contains("7 output_kl values, needs 8"));
  a = make_artifact_with_output_kl();
  a.output_kl.formats[1] = parse_format("sym8/g32").value_or_throw();
  CHECK_THAT(a.save(p).message(), Catch::Contains("output_kl format sym8/g32 is not one of the artifact's formats"));
  a = make_artifact_with_output_kl();
  a.output_kl.tokens = 0;
  CHECK_THAT(a.save(p).message(), Catch::Contains("output_kl tokens 0 must be >= 1"));
  a = make_artifact();
  CHECK_THAT(a.save(dir.file("no/such/dir/x.json")).message(), Catch::Contains("cannot open for writing"));
}

TEST_CASE("artifact parse turns every JSON library exception into a status naming the source", "[artifact]") {
  const std::string good = make_artifact_with_output_kl().to_json().value_or_throw();
  const auto parse_error = [](const std::string& text) {
    auto r = artifact::parse(text, "mem.json", tiny);  // an escaping exception fails the test case
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == errc::invalid_argument);
    CHECK_THAT(r.error().message(), Catch::StartsWith("artifact 'mem.json': "));
    return r.error().message();
  };
  // numbers the library cannot hold (out_of_range.406 from the parser)
  CHECK_THAT(parse_error(edit(good, "\"tokens\": 96", "\"tokens\": 1e400")), Catch::Contains("1e400"));
  CHECK_THAT(parse_error(edit(good, "\"version\": 4", "\"version\": -1e400")), Catch::Contains("-1e400"));
  CHECK_THAT(parse_error("{\"kind\": 1e999999999999}"), Catch::Contains("malformed JSON"));
  // integers past 64 bits parse as doubles: a type error naming the field
  CHECK_THAT(parse_error(edit(good, "\"tokens\": 4096", "\"tokens\": 18446744073709551616")),
             Catch::Contains("'calibration.tokens' must be an integer"));
  CHECK_THAT(parse_error(edit(good, "\"version\": 4", "\"version\": 1.5")),
             Catch::Contains("'version' must be an integer"));
  // wrong types where objects and arrays are expected
  CHECK_THAT(parse_error(edit(good, "\"model\": {", "\"model\": 3, \"x\": {")),
             Catch::Contains("field 'model' must be an object, is number"));
  CHECK_THAT(parse_error(edit(good, "\"calibration\": {", "\"calibration\": [], \"x\": {")),
             Catch::Contains("field 'calibration' must be an object, is array"));
  CHECK_THAT(parse_error(edit(good, "\"sensitivity\": {", "\"sensitivity\": \"s\", \"x\": {")),
             Catch::Contains("field 'sensitivity' must be an object, is string"));
  CHECK_THAT(parse_error(edit(good, "\"name\": \"tiny-test\"", "\"name\": [1]")),
             Catch::Contains("'model.name' must be a string, is array"));
  CHECK_THAT(parse_error(edit(good, "\"formats\": [\n  \"kivi2/g32\"", "\"formats\": [\n  {}")),
             Catch::Contains("'formats[0]' must be a string, is object"));
}

TEST_CASE("2000 seeded corruptions of an artifact: an error naming the source or a valid artifact", "[artifact]") {
  const std::string good = make_artifact_with_output_kl().to_json().value_or_throw();
  REQUIRE(artifact::parse(good, "good.json", tiny).ok());
  const uint64_t seed = 0x61727466;  // printed so a failure can be replayed
  std::cerr << "artifact corruption test: seed " << seed << ", 2000 mutations\n";
  std::mt19937_64 rng(seed);
  const auto below = [&](size_t n) { return n ? size_t(rng() % n) : size_t(0); };
  // Tokens that reach the parser's and the reader's edge cases.
  const std::vector<std::string> tokens = {"1e400",
                                           "-1e400",
                                           "18446744073709551616",
                                           "-0",
                                           "1.5",
                                           "null",
                                           "true",
                                           "\"\"",
                                           "[]",
                                           "{}",
                                           "[",
                                           "{",
                                           "}",
                                           "]",
                                           ",",
                                           ":",
                                           "\"",
                                           "\\u0000",
                                           "\\ud800",
                                           "\xff",
                                           "NaN",
                                           "0e-999",
                                           "-9223372036854775809",
                                           "1e-400"};
  int rejected = 0, accepted = 0;
  for (int i = 0; i < 2000; ++i) {
    std::string text = good;
    std::string what;
    switch (i % 4) {
      case 0: {
        const size_t n = below(text.size());
        text.resize(n);
        what = "truncated to " + std::to_string(n);
        break;
      }
      case 1: {
        const int flips = 1 + int(below(8));
        for (int k = 0; k < flips; ++k) text[below(text.size())] ^= char(1u << below(8));
        what = std::to_string(flips) + " bit flips";
        break;
      }
      case 2: {  // a number, a literal or a token replaces a run of 1..8 bytes
        const std::string& t = tokens[below(tokens.size())];
        const size_t at = below(text.size());
        text.replace(at, std::min<size_t>(1 + below(8), text.size() - at), t);
        what = "'" + t + "' at " + std::to_string(at);
        break;
      }
      default: {  // a run of bytes deleted or duplicated
        const size_t at = below(text.size()), n = std::min<size_t>(1 + below(64), text.size() - at);
        if (rng() & 1) {
          text.erase(at, n);
          what = std::to_string(n) + " bytes deleted at " + std::to_string(at);
        } else {
          text.insert(at, text.substr(at, n));
          what = std::to_string(n) + " bytes duplicated at " + std::to_string(at);
        }
        break;
      }
    }
    CAPTURE(i, what);
    result<artifact> r = status{};
    REQUIRE_NOTHROW(r = artifact::parse(text, "bad.json", tiny));
    if (r.ok()) {
      CHECK(r->validate().ok());
      ++accepted;
    } else {
      CHECK(r.error().code() == errc::invalid_argument);
      CHECK_THAT(r.error().message(), Catch::StartsWith("artifact 'bad.json': "));
      ++rejected;
    }
  }
  std::cerr << "  rejected " << rejected << ", accepted " << accepted << "\n";
  CHECK(rejected > 1500);  // nearly every mutation breaks the JSON or a field
}
