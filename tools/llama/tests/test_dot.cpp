// Dot products on quantized blocks (scalar and AVX2) against dequantize-then-dot, the matrix
// products over the thread pool, and the pool itself.
#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <iostream>
#include <llama/dot.hpp>
#include <llama/matmul.hpp>
#include <llama/thread_pool.hpp>
#include <random>
#include <thread>
#include <vector>

using namespace kvq::llama;

namespace {

constexpr uint64_t seed = 0x646f74;  // printed by the first test so a failure can be replayed

// An f16 bit pattern of a random scale in [lo, hi).
uint16_t random_f16(std::mt19937_64& rng, float lo, float hi) {
  // Round a float to f16 by search over patterns near it: exactness is not needed, only a value
  // the format can hold, so take the pattern of the largest f16 <= v among normal numbers.
  const float v = std::uniform_real_distribution<float>(lo, hi)(rng);
  uint16_t best = 0;
  for (uint16_t h = 0x0400; h < 0x7c00; h = uint16_t(h + 1))
    if (f16_to_float(h) <= v)
      best = h;
    else
      break;
  return best;
}

void put_f16(uint8_t* p, uint16_t h) { std::memcpy(p, &h, 2); }

// Random blocks of type t for n elements: random bytes, with every f16 scale field set to a
// finite value (random bytes there could be Inf or NaN).
std::vector<uint8_t> random_row(ggml_type t, int64_t n, std::mt19937_64& rng) {
  const type_info* info = find_type(uint32_t(t));
  std::vector<uint8_t> bytes(size_t(n / info->block_elems) * info->block_bytes);
  for (auto& b : bytes) b = uint8_t(rng());
  if (t == ggml_type::f32) {
    std::normal_distribution<float> nd;
    for (int64_t i = 0; i < n; ++i) {
      const float v = nd(rng);
      std::memcpy(bytes.data() + 4 * i, &v, 4);
    }
    return bytes;
  }
  for (size_t off = 0; off < bytes.size(); off += info->block_bytes) {
    uint8_t* b = bytes.data() + off;
    switch (t) {
      case ggml_type::f16:
        put_f16(b, random_f16(rng, -2.f, 2.f) | (rng() & 1 ? 0x8000 : 0));
        break;
      case ggml_type::q4_0:
      case ggml_type::q8_0:
        put_f16(b, random_f16(rng, 1e-3f, 0.1f));
        break;
      case ggml_type::q4_1:
      case ggml_type::q4_k:
        put_f16(b, random_f16(rng, 1e-3f, 0.1f));
        put_f16(b + 2, random_f16(rng, 1e-3f, 0.1f) | 0x8000);
        break;
      case ggml_type::q6_k:
        put_f16(b + 208, random_f16(rng, 1e-3f, 0.1f));
        break;
      default:
        break;
    }
  }
  return bytes;
}

// The activation values the quantized form stands for (d * q per block), [n].
std::vector<float> activation_values(activation_kind kind, const std::vector<uint8_t>& act, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  if (kind == activation_kind::f32) {
    std::memcpy(out.data(), act.data(), out.size() * 4);
  } else if (kind == activation_kind::q16) {
    for (int64_t b = 0; b < n / 32; ++b) {
      q16_block blk;
      std::memcpy(&blk, act.data() + b * sizeof(q16_block), sizeof blk);
      int sum = 0;
      for (int j = 0; j < 32; ++j) out[size_t(32 * b + j)] = blk.d * float(blk.qs[j]), sum += blk.qs[j];
      REQUIRE(blk.s == blk.d * float(sum));
    }
  } else {
    for (int64_t b = 0; b < n / qk_k; ++b) {
      q16_k_block blk;
      std::memcpy(&blk, act.data() + b * sizeof(q16_k_block), sizeof blk);
      for (int g = 0; g < 16; ++g) {
        int sum = 0;
        for (int j = 0; j < 16; ++j) sum += blk.qs[16 * g + j];
        REQUIRE(blk.bsums[g] == sum);
      }
      for (int j = 0; j < qk_k; ++j) out[size_t(qk_k * b + j)] = blk.d * float(blk.qs[j]);
    }
  }
  return out;
}

const ggml_type kernel_types[] = {ggml_type::f32,  ggml_type::f16,  ggml_type::q4_0, ggml_type::q4_1,
                                  ggml_type::q8_0, ggml_type::q4_k, ggml_type::q6_k};

}  // namespace

TEST_CASE("every dot kernel equals dequantize-then-dot, scalar and AVX2", "[quant][dot]") {
  std::cerr << "dot kernels: seed " << seed << ", best isa " << isa_name(best_isa()) << "\n";
  if (!isa_available(cpu_isa::avx2)) std::cerr << "NOTE: no AVX2 on this CPU: only the scalar kernels are tested\n";
  std::mt19937_64 rng(seed);
  for (const ggml_type t : kernel_types) {
    const type_info* info = find_type(uint32_t(t));
    const activation_kind kind = activation_of(t);
    // Odd block counts (and odd lengths for the plain types, whose AVX2 loop has a tail).
    const std::vector<int64_t> blocks = info->block_elems == 1 ? std::vector<int64_t>{1, 3, 15, 17, 63, 65, 129, 1001}
                                                               : std::vector<int64_t>{1, 3, 5, 9, 27};
    for (const int64_t nb : blocks) {
      const int64_t n = nb * info->block_elems;
      CAPTURE(info->name, n);
      const auto w = random_row(t, n, rng);
      std::vector<float> x(static_cast<size_t>(n));
      std::normal_distribution<float> nd;
      for (auto& v : x) v = nd(rng);
      x[size_t(rng() % size_t(n))] *= 20.f;          // a single outlier
      if (n >= 64) std::fill_n(x.begin(), 32, 0.f);  // an all-zero activation block

      std::vector<uint8_t> act(activation_bytes(kind, n));
      quantize_activation(kind, x.data(), n, act.data());
      const auto a = activation_values(kind, act, n);
      std::vector<float> wf(static_cast<size_t>(n));
      REQUIRE(dequantize(t, w, wf).ok());
      double ref = 0, mag = 0, quant_bound = 0;
      for (int64_t i = 0; i < n; ++i) {
        ref += double(wf[size_t(i)]) * a[size_t(i)];
        mag += std::fabs(double(wf[size_t(i)]) * a[size_t(i)]);
        // rounding x to d * q moves each element by at most d / 2 (d = this block's scale)
        quant_bound += std::fabs(double(wf[size_t(i)]) * (double(x[size_t(i)]) - a[size_t(i)]));
        if (kind != activation_kind::f32) {
          const int64_t be = kind == activation_kind::q16 ? 32 : qk_k;
          float amax = 0;
          for (int64_t j = i / be * be; j < (i / be + 1) * be; ++j) amax = std::max(amax, std::fabs(x[size_t(j)]));
          REQUIRE(std::fabs(x[size_t(i)] - a[size_t(i)]) <= amax / 32767.f * 0.5f + 2e-7f * amax);
        }
      }
      double x_dot = 0;
      for (int64_t i = 0; i < n; ++i) x_dot += double(wf[size_t(i)]) * x[size_t(i)];
      for (const cpu_isa isa : {cpu_isa::scalar, cpu_isa::avx2}) {
        if (!isa_available(isa)) continue;
        CAPTURE(isa_name(isa));
        const dot_fn dot = find_dot(t, isa);
        REQUIRE(dot != nullptr);
        const double got = dot(w.data(), act.data(), n);
        CHECK(std::fabs(got - ref) <= 1e-5 * mag + 1e-30);
        // and against the float activation: off by no more than the activation's rounding
        CHECK(std::fabs(got - x_dot) <= quant_bound + 1e-5 * mag + 1e-30);
      }
    }
  }
}

TEST_CASE("four-row kernels equal the one-row kernel bit for bit", "[quant][dot]") {
  std::mt19937_64 rng(seed + 4);
  int tested = 0;
  for (const ggml_type t : kernel_types)
    for (const cpu_isa isa : {cpu_isa::scalar, cpu_isa::avx2}) {
      const dot4_fn dot4 = find_dot4(t, isa);
      if (!dot4) continue;
      const type_info* info = find_type(uint32_t(t));
      const activation_kind kind = activation_of(t);
      for (const int64_t nb : {1, 7, 18}) {
        const int64_t n = nb * info->block_elems;
        CAPTURE(info->name, isa_name(isa), n);
        const auto w = random_row(t, n, rng);
        const size_t stride = activation_bytes(kind, n);
        std::vector<uint8_t> act(4 * stride);
        std::normal_distribution<float> nd;
        for (int r = 0; r < 4; ++r) {
          std::vector<float> x(static_cast<size_t>(n));
          for (auto& v : x) v = nd(rng) * float(r + 1);
          quantize_activation(kind, x.data(), n, act.data() + size_t(r) * stride);
        }
        float got[4];
        dot4(w.data(), act.data(), stride, n, got);
        const dot_fn dot = find_dot(t, isa);
        for (int r = 0; r < 4; ++r) CHECK(got[r] == dot(w.data(), act.data() + size_t(r) * stride, n));
        ++tested;
      }
    }
  if (isa_available(cpu_isa::avx2)) CHECK(tested >= 9);  // q4_0, q4_1 and q8_0 in AVX2
}

TEST_CASE("types without a kernel have none, and the ISA query is consistent", "[quant][dot]") {
  for (const ggml_type t :
       {ggml_type::q5_0, ggml_type::q5_1, ggml_type::q2_k, ggml_type::q3_k, ggml_type::q5_k, ggml_type::bf16}) {
    CAPTURE(type_name(uint32_t(t)));
    CHECK(activation_of(t) == activation_kind::none);
    CHECK(find_dot(t, cpu_isa::scalar) == nullptr);
  }
  CHECK(isa_available(cpu_isa::scalar));
  CHECK(isa_available(best_isa()));
}

TEST_CASE("weight_matrix rejects bad shapes and types with a message naming them", "[quant][dot]") {
  auto no_kernel = weight_matrix::from_bytes(ggml_type::q5_k, 1, 256, std::vector<uint8_t>(176));
  REQUIRE_FALSE(no_kernel.ok());
  CHECK_THAT(no_kernel.error().message(), Catch::Contains("Q5_K"));
  auto odd_cols = weight_matrix::from_bytes(ggml_type::q4_1, 2, 48, std::vector<uint8_t>(40));
  REQUIRE_FALSE(odd_cols.ok());
  CHECK_THAT(odd_cols.error().message(), Catch::Contains("multiple of 32"));
  auto short_bytes = weight_matrix::from_bytes(ggml_type::q8_0, 2, 64, std::vector<uint8_t>(100));
  REQUIRE_FALSE(short_bytes.ok());
  CHECK_THAT(short_bytes.error().message(), Catch::Contains("needs 136 bytes, got 100"));
}

TEST_CASE("matmul on the pool equals one dot per row and token, for 1 and 2 threads", "[quant][dot]") {
  std::mt19937_64 rng(seed + 1);
  const int64_t cols = 512, T = 3;
  std::vector<float> x(static_cast<size_t>(T * cols));
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(rng);
  // Row counts that are not multiples of the task size, two types in one call.
  auto a = weight_matrix::from_bytes(ggml_type::q4_1, 37, cols, random_row(ggml_type::q4_1, 37 * cols, rng));
  auto b = weight_matrix::from_bytes(ggml_type::q6_k, 5, cols, random_row(ggml_type::q6_k, 5 * cols, rng));
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  for (const int threads : {1, 2}) {
    CAPTURE(threads);
    thread_pool pool(threads);
    std::vector<float> ya(size_t(T * 37)), yb(size_t(T * 5), 1.f);
    const matmul_job jobs[] = {{&*a, ya.data()}, {&*b, yb.data(), true}};
    matmul(jobs, x.data(), T, pool, best_isa());
    for (const auto* m : {&*a, &*b}) {
      const activation_kind kind = activation_of(m->type());
      std::vector<uint8_t> act(activation_bytes(kind, cols));
      for (int64_t t = 0; t < T; ++t) {
        quantize_activation(kind, x.data() + t * cols, cols, act.data());
        for (int64_t r = 0; r < m->rows(); ++r) {
          const float want = find_dot(m->type(), best_isa())(m->row(r), act.data(), cols);
          if (m == &*a)
            REQUIRE(ya[size_t(t * 37 + r)] == want);
          else
            REQUIRE(yb[size_t(t * 5 + r)] == 1.f + want);
        }
      }
    }
  }
}

TEST_CASE("thread_pool runs every task once, also with runs from two threads at once", "[quant][dot]") {
  thread_pool pool(3);
  CHECK(pool.threads() == 3);
  // True when 50 runs of n tasks hit every task exactly 50 times (no Catch2 assertion inside, so
  // it can run on a second thread).
  auto runs_ok = [&](int64_t n) {
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
    for (int rep = 0; rep < 50; ++rep) pool.run(n, [&](int64_t i) { hits[size_t(i)].fetch_add(1); });
    for (auto& h : hits)
      if (h.load() != 50) return false;
    return true;
  };
  CHECK(runs_ok(1));
  CHECK(runs_ok(1000));
  // Many short runs back to back: a worker still holding a ticket of the previous run must not
  // claim a task of the next (a lost or extra task count hangs or skips a task here).
  {
    thread_pool two(2);
    int64_t wrong = 0;
    for (int rep = 0; rep < 100000; ++rep) {
      const int64_t n = 2 + rep % 37;
      std::atomic<int64_t> count{0};
      two.run(n, [&](int64_t i) { count.fetch_add(i + 1); });
      wrong += count.load() != n * (n + 1) / 2;
    }
    CHECK(wrong == 0);
  }
  bool other_ok = false;
  std::thread other([&] { other_ok = runs_ok(777); });
  CHECK(runs_ok(333));
  other.join();
  CHECK(other_ok);
}
