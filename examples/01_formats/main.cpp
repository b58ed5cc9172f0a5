// Example 01: fill a cache under each format with keys and values shaped like a real model's
// (outlier key channels), then report bits per element, bytes, and the attention error of each
// format against the FP16 cache. Self-checking: with --check it returns non-zero when a format's
// error is out of its expected range or the byte accounting disagrees with the format table.
#include <kvq/cache/cache.hpp>
#include <kvq/policy/static_policy.hpp>

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  const bool check = argc > 1 && std::strcmp(argv[1], "--check") == 0;
  const int layers = 1, Hq = 32, H = 8, d = 128, n = 4096, steps = 16;
  std::mt19937 rng(42);
  std::normal_distribution<float> nd;
  std::vector<float> k(size_t(n) * H * d), v(k.size()), q(size_t(steps) * Hq * d);
  for (size_t i = 0; i < k.size(); ++i) {
    const int c = int(i % d);
    k[i] = nd(rng) * (c % 16 == 3 ? 8.f : 1.f) + (c % 32 == 7 ? 3.f : 0.f);  // outlier channels
    v[i] = nd(rng);
  }
  // Queries that attend to a few earlier tokens, as real heads do: a key of the context plus noise.
  for (int s = 0; s < steps; ++s)
    for (int h = 0; h < Hq; ++h) {
      const size_t key = size_t(rng() % (n - steps)) * H * d + size_t(h / (Hq / H)) * d;
      for (int c = 0; c < d; ++c) q[(size_t(s) * Hq + h) * d + c] = 0.25f * k[key + c] + 0.5f * nd(rng);
    }

  struct row {
    std::string spec;
    double max_err;
  };
  const std::vector<row> rows = {{"fp16", 1e-6},     {"bf16", 2e-2},          {"fp8", 8e-2},
                                 {"int8", 2e-2},     {"sym4/g32", 0.3},       {"kivi8/g32", 1e-2},
                                 {"kivi4/g32", 0.2}, {"k=kivi4/g32,v=kivi2/g32", 0.5}, {"kivi2/g32", 0.8},
                                 {"ra4/g32", 0.2}};
  std::vector<float> ref;
  fmt::print("{} tokens, {} query heads, {} kv heads, head_dim {}; error = |O - O_fp16| / |O_fp16| over {} queries\n", n,
             Hq, H, d, steps);
  fmt::print("{:<26} {:>10} {:>10} {:>12} {:>12} {:>10}\n", "format", "bits/elem", "total bits", "page bytes",
             "window bytes", "rel error");
  int failures = 0;
  for (const auto& r : rows) {
    kvq::cache_config cfg;
    cfg.shape = {layers, Hq, H, d, 64, 128, 64};
    cfg.budget_bytes = 256ull << 20;
    auto pol = std::make_shared<kvq::static_policy>(kvq::static_policy::parse(r.spec).value_or_throw());
    auto cache = kvq::KVCache::create(cfg, pol).value_or_throw();
    kvq::check(cache.create_sequence(0));
    kvq::check(cache.append(0, 0, {k.data(), kvq::dtype::f32, n - steps, H, d}, {v.data(), kvq::dtype::f32, n - steps, H, d}));
    std::vector<float> o(q.size());
    for (int s = 0; s < steps; ++s) {  // decode steps: one new token each
      const size_t off = size_t(n - steps + s) * H * d;
      kvq::check(cache.append(0, 0, {k.data() + off, kvq::dtype::f32, 1, H, d}, {v.data() + off, kvq::dtype::f32, 1, H, d}));
      const kvq::attend_item it{0, 1};
      kvq::check(cache.attend({&it, 1}, 0, {q.data() + size_t(s) * Hq * d, kvq::dtype::f32, 1, Hq, d},
                              {o.data() + size_t(s) * Hq * d, kvq::dtype::f32, 1, Hq, d}));
    }
    if (ref.empty()) ref = o;
    double e = 0, nr = 0;
    for (size_t i = 0; i < o.size(); ++i) e += (o[i] - ref[i]) * (o[i] - ref[i]), nr += ref[i] * ref[i];
    const double err = std::sqrt(e / nr);
    const auto st = cache.stats();
    const auto fp = kvq::parse_format_pair(r.spec.substr(0, r.spec.find(';'))).value();
    const uint64_t expect_bytes =
        st.pages / 2 / H * H *
        (kvq::layout_of(kvq::traits_of(fp.k), kvq::role::k, 64, d).total() + kvq::layout_of(kvq::traits_of(fp.v), kvq::role::v, 64, d).total());
    const bool ok = err <= r.max_err && st.page_bytes == expect_bytes;
    failures += !ok;
    fmt::print("{:<26} {:>10.3f} {:>10.3f} {:>12} {:>12} {:>10.2e}{}\n", r.spec, st.page_bits(), st.total_bits(H, d),
               st.page_bytes, st.window_bytes, err, ok ? "" : "  <-- out of range");
  }
  if (check && failures) {
    fmt::print(stderr, "{} format(s) out of their expected range\n", failures);
    return 1;
  }
  return 0;
}
