// Example 04: EchoKV, the online precision controller, in a decode loop.
//
// What an engine developer learns here:
// - EchoKV is a policy like any other: hand it to `KVCache::create` and decode as usual. On a
//   fraction of the steps (`rate`) it measures, on the live queries and the FP16 window, the
//   attention KL each tier's key format would cause, and moves each layer between tiers
//   (kivi2/g32, kivi4/g32, kivi8/g32 by default). Pages already written keep their format;
//   new pages take the layer's current tier;
// - warm-up: from the highest tier, layers whose attention is flat (small queries) move down and
//   sharp ones stay up;
// - budget mode (`set_target_bits`): a controller moves the threshold so that the average bits of
//   the tiers track a target;
// - `freeze` stops every measurement and move (what an engine does before capturing a step in a
//   CUDA graph, or to serve with fixed decisions); `snapshot` / `restore` carry the decisions to
//   another cache (a restart, another tensor-parallel rank).
//
// Self-checking: returns non-zero when the warm-up does not order the layers by sharpness, the
// budget is not tracked, a frozen policy moves or measures, or a cache restored from the snapshot
// stores or attends differently from the original for the same tokens.
#include <kvq/cache/cache.hpp>
#include <kvq/policy/echokv.hpp>
#include <kvq/policy/sensitivity.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int layers = 6, q_heads = 8, kv_heads = 2, d = 64;
// Query scale of each layer: the larger, the sharper its attention and the more key quantization
// damages it.
constexpr float sharpness[layers] = {0.1f, 0.2f, 0.5f, 1.0f, 2.5f, 4.0f};

// Stand-in for the model: K, V, Q rows of (sequence, layer, position), deterministic.
void model_rows(kvq::seq_id seq, int layer, int64_t pos, float* k, float* v, float* q) {
  std::mt19937 rng(uint32_t(seq * 7919 + layer * 104729 + pos * 31));
  std::normal_distribution<float> nd;
  for (int i = 0; i < kv_heads * d; ++i) k[i] = nd(rng) * (i % 16 == 3 ? 6.f : 1.f), v[i] = nd(rng);
  for (int i = 0; i < q_heads * d; ++i) q[i] = nd(rng) * sharpness[layer];
}

// Feeds positions [pos, pos + m) of a sequence through every layer: append, then attend with the
// m new queries (m <= the window). Appends the outputs to `out` when given.
void feed(kvq::KVCache& cache, kvq::seq_id seq, int64_t pos, int m, std::vector<float>* out = nullptr) {
  std::vector<float> k(size_t(m) * kv_heads * d), v(k.size()), q(size_t(m) * q_heads * d), o(q.size());
  for (int l = 0; l < layers; ++l) {
    for (int t = 0; t < m; ++t)
      model_rows(seq, l, pos + t, &k[size_t(t) * kv_heads * d], &v[size_t(t) * kv_heads * d], &q[size_t(t) * q_heads * d]);
    kvq::check(cache.append(seq, l, {k.data(), kvq::dtype::f32, m, kv_heads, d}, {v.data(), kvq::dtype::f32, m, kv_heads, d}));
    const kvq::attend_item it{seq, m};
    kvq::check(cache.attend({&it, 1}, l, {q.data(), kvq::dtype::f32, m, q_heads, d}, {o.data(), kvq::dtype::f32, m, q_heads, d}));
    if (out) out->insert(out->end(), o.begin(), o.end());
  }
}

// From position 0: a new sequence and its prompt of 256 tokens in two chunks. Then `steps` decode steps; returns the next position.
int64_t generate(kvq::KVCache& cache, kvq::seq_id seq, int64_t pos, int steps, std::vector<float>* out = nullptr) {
  if (pos == 0) {
    kvq::check(cache.create_sequence(seq));
    feed(cache, seq, 0, 128, out);
    feed(cache, seq, 128, 128, out);
    pos = 256;
  }
  for (int s = 0; s < steps; ++s, ++pos) feed(cache, seq, pos, 1, out);
  return pos;
}

kvq::KVCache make_cache(std::shared_ptr<kvq::echokv_policy> pol) {
  kvq::cache_config cfg;
  cfg.shape = {layers, q_heads, kv_heads, d, 64, 128, 64};
  cfg.budget_bytes = 64 << 20;
  return kvq::KVCache::create(cfg, std::move(pol)).value_or_throw();
}

std::string tiers_of(const kvq::echokv_policy& pol) {
  std::string s;
  for (int u = 0; u < pol.units(); ++u) s += kvq::format_name(pol.tier_formats(pol.tier(u)).value().k) + " ";
  return s;
}

}  // namespace

int main() {
  int failures = 0;
  const auto expect = [&](bool ok, const std::string& what) {
    if (!ok) fmt::print(stderr, "check failed: {}\n", what), ++failures;
  };
  kvq::echokv_options opt;
  opt.rate = 0.25;  // a canary every fourth step on average (the default, 1/64, suits long runs)
  opt.seed = 7;
  auto pol = std::make_shared<kvq::echokv_policy>(opt);
  auto cache = make_cache(pol);

  // 1. Warm-up: every layer starts in the highest tier; flat layers move down.
  int64_t pos = generate(cache, 1, 0, 256);
  fmt::print("after warm-up ({} canary steps, {} demotions): {}| {:.2f} bits\n", pol->counters().canary_steps,
             pol->counters().demotions, tiers_of(*pol), pol->average_bits());
  bool ordered = true;
  for (int l = 1; l < layers; ++l) ordered = ordered && pol->tier(l) >= pol->tier(l - 1);
  expect(ordered, "tiers grow with the layers' sharpness");
  expect(pol->tier(0) == 0 && pol->tier(layers - 1) == pol->tier_count() - 1,
         "the flattest layer is in the lowest tier, the sharpest in the highest");

  // 2. Budget mode: the controller steers the threshold until the tiers average the target.
  const double target = 4.5;
  kvq::check(pol->set_target_bits(target));
  pos = generate(cache, 1, pos, 384);
  const double one_move = 2 * pol->control().deadband;  // the largest change one unit's move makes
  fmt::print("budget {:.1f} bits: {}| {:.2f} bits (threshold x{:.2f})\n", target, tiers_of(*pol), pol->average_bits(),
             std::exp(pol->control().log_scale));
  expect(std::abs(pol->average_bits() - target) <= one_move, "the tiers track the bits target within one unit move");
  const kvq::cache_stats st = cache.stats();
  int formats_stored = 0;
  for (uint64_t n : st.pages_by_format) formats_stored += n > 0;
  fmt::print("the cache holds pages of {} formats (pages keep the format they were written in)\n", formats_stored);
  expect(formats_stored >= 2, "pages of several formats are held at once");

  // 3. Freeze: no measurement and no move until unfrozen.
  pol->freeze();
  const std::vector<uint8_t> snap = pol->snapshot();
  const uint64_t evaluations = pol->counters().canary_evaluations;
  pos = generate(cache, 1, pos, 64);
  expect(pol->snapshot() == snap && pol->counters().canary_evaluations == evaluations, "a frozen policy stays put");

  // 4. Restore the snapshot into a fresh policy and cache; a new sequence then gets the same
  //    formats, hence the same bytes and the same attention, in both caches.
  auto pol2 = std::make_shared<kvq::echokv_policy>(opt);
  auto cache2 = make_cache(pol2);
  kvq::check(pol2->restore(snap));
  pol2->freeze();
  expect(kvq::format_map::of(*pol2, layers, kv_heads) == kvq::format_map::of(*pol, layers, kv_heads),
         "the restored policy decides as the original");
  std::vector<float> out1, out2;
  const auto before = cache.stats();
  generate(cache, 2, 0, 128, &out1);
  generate(cache2, 2, 0, 128, &out2);
  const auto after = cache.stats(), restored = cache2.stats();
  bool same_pages = true;
  for (size_t f = 0; f < kvq::format_count; ++f)
    same_pages = same_pages && after.pages_by_format[f] - before.pages_by_format[f] == restored.pages_by_format[f];
  expect(same_pages, "the restored cache stores the new sequence's pages in the same formats");
  expect(out1 == out2, "the restored cache attends bit for bit as the original");
  fmt::print("restored snapshot [{}]: {} pages, attention {}\n", fmt::join(snap, ","), restored.pages,
             out1 == out2 ? "identical" : "DIFFERENT");
  return failures ? 1 : 0;
}
