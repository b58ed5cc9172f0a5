// Consumer check: builds a cache through the installed package, appends, attends, and checks
// the output against kvq::ref on the same dequantized data. Returns non-zero on mismatch.
#include <kvq/attention/reference.hpp>
#include <kvq/cache/cache.hpp>
#include <kvq/policy/static_policy.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  kvq::cache_config cfg;
  cfg.shape = {.layers = 2, .q_heads = 8, .kv_heads = 2, .head_dim = 64, .page_tokens = 64, .window = 128, .recent = 32};
  cfg.budget_bytes = 8 << 20;
  auto pol = std::make_shared<kvq::static_policy>(kvq::parse_format_pair("k=kivi4/g32,v=kivi2/g32").value());
  auto cache = kvq::KVCache::create(cfg, pol).value_or_throw();
  kvq::check(cache.create_sequence(7));
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  const int n = 300, d = 64, H = 2, Hq = 8;
  std::vector<float> k(n * H * d), v(k.size()), q(Hq * d), o(q.size()), ref(q.size());
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  for (auto& x : q) x = nd(rng);
  kvq::check(cache.append(7, 1, {k.data(), kvq::dtype::f32, n, H, d}, {v.data(), kvq::dtype::f32, n, H, d}));
  const kvq::attend_item item{7, 1};
  kvq::check(cache.attend({&item, 1}, 1, {q.data(), kvq::dtype::f32, 1, Hq, d}, {o.data(), kvq::dtype::f32, 1, Hq, d}));
  std::vector<float> kd(k.size()), vd(v.size());
  kvq::check(cache.read(7, 1, kvq::role::k, kd));
  kvq::check(cache.read(7, 1, kvq::role::v, vd));
  kvq::ref::attend(kd.data(), vd.data(), n, q.data(), 1, Hq, H, d, 1.0f / std::sqrt(float(d)), ref.data());
  double err = 0, nrm = 0;
  for (size_t i = 0; i < o.size(); ++i) err += (o[i] - ref[i]) * (o[i] - ref[i]), nrm += ref[i] * ref[i];
  const auto st = cache.stats();
  std::printf("consumer: %lld pages, %.3f bits/element in pages, relative error %.2e\n", (long long)st.pages,
              st.page_bits(), std::sqrt(err / nrm));
  return (st.pages > 0 && std::sqrt(err / nrm) < 1e-5) ? 0 : 1;
}
