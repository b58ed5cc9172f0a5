// Example 05: from calibration to a static format spec an engine can ship.
//
// What an engine developer learns here:
// - the calibrator (`kvq::calib::calibrator`) sees only tensors: feed it each layer's queries, keys
//   and values of calibration text (after RoPE), as an engine's forward pass produces them. Here a
//   synthetic "model" stands in, whose layers and heads differ in how sharply they attend and how
//   strong their key outlier channels are, so that they differ in sensitivity;
// - its result is the calibration artifact, a versioned JSON file (`artifact::save` / `load`, which
//   checks the file against the model's shape);
// - the `kl_budget` allocation turns the artifact's sensitivities into one format pair per (layer,
//   kv head): the least damage for an average-bits target;
// - that map becomes one `static_policy` spec string (`fmt;layer=fmt;layer.head=fmt`): all an
//   engine needs at serving time, no artifact and no greedy at startup.
//
// Self-checking: returns non-zero when the artifact does not round-trip through its file, the
// allocation misses its target or is uniform (nothing learned), or the shipped spec does not parse
// or does not reproduce the kl_budget decisions in a cache.
#include <kvq/cache/cache.hpp>
#include <kvq/calib/artifact.hpp>
#include <kvq/calib/calibrate.hpp>
#include <kvq/policy/kl_budget.hpp>
#include <kvq/policy/static_policy.hpp>

#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int layers = 4, q_heads = 8, kv_heads = 2, d = 64, tokens = 256;
constexpr double bits_target = 5.0;  // average bits per K/V element the engine can afford

// One calibration chunk of one layer: keys with outlier channels (strength per layer), queries that
// look for earlier keys (sharpness per kv head: head 1 of each layer attends more sharply).
void synthetic_layer(int layer, std::vector<float>& q, std::vector<float>& k, std::vector<float>& v) {
  std::mt19937 rng(uint32_t(1000 + layer));
  std::normal_distribution<float> nd;
  const float outlier = 1.f + 4.f * float(layer);
  for (int t = 0; t < tokens; ++t)
    for (int h = 0; h < kv_heads; ++h)
      for (int c = 0; c < d; ++c) {
        const size_t i = (size_t(t) * kv_heads + h) * d + c;
        k[i] = nd(rng) * (c % 16 == 5 ? outlier : 1.f);
        v[i] = nd(rng);
      }
  for (int t = 0; t < tokens; ++t)
    for (int hq = 0; hq < q_heads; ++hq) {
      const int h = hq / (q_heads / kv_heads);
      const float sharp = h == 1 ? 0.6f : 0.1f;
      const size_t key = (size_t(rng() % size_t(t + 1)) * kv_heads + h) * d;
      for (int c = 0; c < d; ++c) q[(size_t(t) * q_heads + hq) * d + c] = sharp * k[key + c] + 0.3f * nd(rng);
    }
}

// The allocation as a static spec: the most common pair for all, then per-layer and per-head
// overrides.
std::string to_spec(const kvq::format_map& m) {
  std::map<std::pair<int, int>, int> count;
  for (const auto& p : m.pairs) ++count[{p.k, p.v}];
  auto common = count.begin();
  for (auto it = count.begin(); it != count.end(); ++it)
    if (it->second > common->second) common = it;
  const kvq::format_pair all{kvq::format_id(common->first.first), kvq::format_id(common->first.second)};
  std::string spec = kvq::format_pair_name(all);
  for (int l = 0; l < m.layers; ++l) {
    bool uniform = true;
    for (int h = 1; h < m.kv_heads; ++h) uniform = uniform && m.at(l, h) == m.at(l, 0);
    if (uniform && m.at(l, 0) != all) spec += fmt::format(";{}={}", l, kvq::format_pair_name(m.at(l, 0)));
    if (uniform) continue;
    for (int h = 0; h < m.kv_heads; ++h)
      if (m.at(l, h) != all) spec += fmt::format(";{}.{}={}", l, h, kvq::format_pair_name(m.at(l, h)));
  }
  return spec;
}

// The format map a cache reports once the policy is bound to it.
kvq::format_map map_in_cache(const kvq::cache_shape& shape, std::shared_ptr<kvq::policy> pol) {
  kvq::cache_config cfg;
  cfg.shape = shape;
  cfg.budget_bytes = 16 << 20;
  auto cache = kvq::KVCache::create(cfg, std::move(pol)).value_or_throw();
  return {shape.layers, shape.kv_heads, cache.stats().format_map};
}

}  // namespace

int main() {
  const kvq::cache_shape shape{layers, q_heads, kv_heads, d, 64, 128, 64};
  int failures = 0;
  const auto expect = [&](bool ok, const std::string& what) {
    if (!ok) fmt::print(stderr, "check failed: {}\n", what), ++failures;
  };

  // 1. Calibration: the candidates, with fp16 as the undamaged top rung; no rolealign candidate,
  //    so no clip percentiles to choose (an engine shipping rolealign ships them with the spec).
  kvq::calib::calibrator_options opt;
  opt.formats = kvq::calib::default_candidates();
  opt.formats.insert(opt.formats.begin(), kvq::fp16_format);
  opt.clip_formats = {};
  opt.clip_percentile_grid = {100.f};
  opt.model_name = "synthetic";
  auto cal = kvq::calib::calibrator::create(shape, opt).value_or_throw();
  std::vector<float> q(size_t(tokens) * q_heads * d), k(size_t(tokens) * kv_heads * d), v(k.size());
  for (int l = 0; l < layers; ++l) {
    synthetic_layer(l, q, k, v);
    kvq::check(cal.observe(l, {q.data(), kvq::dtype::f32, tokens, q_heads, d}, {k.data(), kvq::dtype::f32, tokens, kv_heads, d},
                           {v.data(), kvq::dtype::f32, tokens, kv_heads, d}));
  }
  kvq::calib::artifact art;
  (void)cal.result(&art, "synthetic calibration text").value_or_throw();

  // 2. The artifact file: written once offline, loaded against the model's shape.
  const auto path = (std::filesystem::temp_directory_path() / "kvq_example_05_artifact.json").string();
  kvq::check(art.save(path));
  const kvq::calib::model_shape model{layers, q_heads, kv_heads, d};
  const auto loaded = kvq::calib::artifact::load(path, model).value_or_throw();
  std::filesystem::remove(path);
  expect(loaded.sensitivity.values == art.sensitivity.values, "the artifact round-trips through its file");
  fmt::print("K attention KL per (layer, head) at kivi2/g32 / kivi4/g32:\n");
  const int k2 = loaded.sensitivity.format_index(kvq::format_id(kvq::find_format(kvq::family::kivi, 2, 32)));
  const int k4 = loaded.sensitivity.format_index(kvq::format_id(kvq::find_format(kvq::family::kivi, 4, 32)));
  for (int l = 0; l < layers; ++l)
    for (int h = 0; h < kv_heads; ++h)
      fmt::print("  layer {} head {}: {:.2e} / {:.2e}\n", l, h, loaded.sensitivity.at(l, h, kvq::role::k, k2),
                 loaded.sensitivity.at(l, h, kvq::role::k, k4));

  // 3. kl_budget: the least summed damage at the bits target.
  const kvq::kl_budget_options kl{kvq::kl_objective::bits_target, bits_target, 1.0};
  const auto alloc = kvq::allocate_kl_budget(loaded.sensitivity, kl, shape.page_tokens, d).value_or_throw();
  fmt::print("kl_budget at {} bits: {:.3f} bits, summed damage {:.3e}, {} transitions\n", bits_target,
             alloc.average_bits, alloc.total_damage, alloc.steps.size());
  expect(alloc.average_bits <= bits_target, "the allocation meets its bits target");
  bool uniform = true;
  for (const auto& p : alloc.map.pairs) uniform = uniform && p == alloc.map.pairs[0];
  expect(!uniform, "the allocation differs between heads");

  // 4. The spec an engine ships, and what it reproduces.
  const std::string spec = to_spec(alloc.map);
  fmt::print("static spec: {}\n", spec);
  auto parsed = kvq::static_policy::parse(spec);
  expect(parsed.ok(), "the spec parses: " + parsed.error().to_string());
  if (!parsed.ok()) return 1;
  const auto shipped = map_in_cache(shape, std::make_shared<kvq::static_policy>(std::move(parsed).value()));
  const auto learned = map_in_cache(shape, std::make_shared<kvq::kl_budget_policy>(loaded.sensitivity, kl));
  expect(learned == alloc.map, "the kl_budget policy in a cache decides what the allocation did");
  expect(shipped == alloc.map, "the shipped spec reproduces every kl_budget decision");
  fmt::print("the shipped spec {} the kl_budget decisions of all {} (layer, kv head) pairs\n",
             shipped == alloc.map ? "reproduces" : "does NOT reproduce", alloc.map.pairs.size());
  return failures ? 1 : 0;
}
