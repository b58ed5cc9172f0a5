// CPU microbenchmarks of the reference backend: encode and decode throughput per format (bytes
// processed = fp16 input bytes, so GB/s is of FP16 data), and decode attention of a
// Llama-8B-like layer (32 query heads, 8 kv heads, head_dim 128) at 4K context per format.
// These are reference numbers; the GPU benchmark owns speed.
#include <kvq/cache/cache.hpp>
#include <kvq/codec/codec.hpp>
#include <kvq/policy/static_policy.hpp>

#include <benchmark/benchmark.h>

#include <random>
#include <vector>

namespace {

const char* const formats[] = {"fp16",      "bf16",      "fp8",       "int8",     "sym4/g32",  "sym2/g32",
                               "kivi8/g32", "kivi4/g32", "kivi2/g32", "sym3/g32", "kivi3/g32", "cb4",
                               "cb4/g32",   "cb3",       "cb2",       "nvfp4"};
constexpr int P = 64, d = 128;

std::vector<uint16_t> random_fp16(size_t n) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<uint16_t> x(n);
  for (auto& h : x) h = kvq::float_to_half(nd(rng));
  return x;
}

void bm_encode(benchmark::State& state, kvq::format_id f, kvq::role r) {
  const auto g = kvq::codec::make_geom(f, r, P, d);
  const int pages = 64;
  auto src = random_fp16(size_t(pages) * P * d);
  std::vector<uint8_t> dst(size_t(pages) * g.lay.total());
  for (auto _ : state) {
    for (int p = 0; p < pages; ++p)
      for (int u = 0; u < g.unit_count(); ++u)
        kvq::codec::encode_unit(g, src.data() + size_t(p) * P * d, d, u, dst.data() + size_t(p) * g.lay.total(),
                                kvq::codec::no_clip);
    benchmark::DoNotOptimize(dst.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * pages * P * d * 2);
}

void bm_decode(benchmark::State& state, kvq::format_id f, kvq::role r) {
  const auto g = kvq::codec::make_geom(f, r, P, d);
  const int pages = 64;
  auto src = random_fp16(size_t(pages) * P * d);
  std::vector<uint8_t> bytes(size_t(pages) * g.lay.total());
  for (int p = 0; p < pages; ++p)
    for (int u = 0; u < g.unit_count(); ++u)
      kvq::codec::encode_unit(g, src.data() + size_t(p) * P * d, d, u, bytes.data() + size_t(p) * g.lay.total(),
                              kvq::codec::no_clip);
  std::vector<float> out(size_t(P) * d);
  for (auto _ : state) {
    for (int p = 0; p < pages; ++p)
      for (int t = 0; t < P; ++t)
        for (int c = 0; c < d; ++c)
          out[size_t(t) * d + c] = kvq::codec::decode_element(g, bytes.data() + size_t(p) * g.lay.total(), t, c);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * pages * P * d * 2);
}

void bm_attend(benchmark::State& state, const char* spec) {
  const int Hq = 32, H = 8, n = 4096;
  kvq::cache_config cfg;
  cfg.shape = {1, Hq, H, d, P, 128, 64};
  cfg.budget_bytes = 256ull << 20;
  auto pol = std::make_shared<kvq::static_policy>(kvq::static_policy::parse(spec).value_or_throw());
  auto cache = kvq::KVCache::create(cfg, pol).value_or_throw();
  kvq::check(cache.create_sequence(0));
  std::mt19937 rng(2);
  std::normal_distribution<float> nd;
  std::vector<float> kv(size_t(n) * H * d), q(size_t(Hq) * d), o(q.size());
  for (auto& x : kv) x = nd(rng);
  for (auto& x : q) x = nd(rng);
  kvq::check(cache.append(0, 0, {kv.data(), kvq::dtype::f32, n, H, d}, {kv.data(), kvq::dtype::f32, n, H, d}));
  const kvq::attend_item it{0, 1};
  for (auto _ : state) {
    kvq::check(cache.attend({&it, 1}, 0, {q.data(), kvq::dtype::f32, 1, Hq, d}, {o.data(), kvq::dtype::f32, 1, Hq, d}));
    benchmark::DoNotOptimize(o.data());
  }
  const auto st = cache.stats();
  state.counters["bits"] = st.page_bits();
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(st.page_bytes + st.window_bytes));
}

const int registered = [] {
  for (const char* spec : formats) {
    const auto f = kvq::parse_format(spec).value();
    for (kvq::role r : {kvq::role::k, kvq::role::v}) {
      const std::string tag = std::string(spec) + "/" + kvq::role_name(r);
      benchmark::RegisterBenchmark(("encode/" + tag).c_str(), bm_encode, f, r);
      benchmark::RegisterBenchmark(("decode/" + tag).c_str(), bm_decode, f, r);
    }
    benchmark::RegisterBenchmark((std::string("attend_4k_llama8b/") + spec).c_str(), bm_attend, spec)
        ->Unit(benchmark::kMillisecond);
  }
  return 0;
}();

}  // namespace

BENCHMARK_MAIN();
