#include <algorithm>
#include <cmath>
#include <cstring>
#include <llama/dot.hpp>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

namespace kvq::llama {

bool isa_available(cpu_isa isa) {
  switch (isa) {
    case cpu_isa::scalar:
      return true;
    case cpu_isa::avx2:
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    {
      // Asked once: CPUID traps to the hypervisor in a virtual machine (microseconds), and
      // `find_dot` asks on every matrix product.
      static const bool available = [] {
        // F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c".
        unsigned a = 0, b = 0, c = 0, d = 0;
        const bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29)) != 0;
        return detail::avx2_kernels().q8_0 != nullptr && __builtin_cpu_supports("avx2") &&
               __builtin_cpu_supports("fma") && f16c;
      }();
      return available;
    }
#else
      return false;
#endif
  }
  return false;
}

cpu_isa best_isa() { return isa_available(cpu_isa::avx2) ? cpu_isa::avx2 : cpu_isa::scalar; }

const char* isa_name(cpu_isa isa) { return isa == cpu_isa::avx2 ? "avx2" : "scalar"; }

activation_kind activation_of(ggml_type t) {
  switch (t) {
    case ggml_type::f32:
    case ggml_type::f16:
      return activation_kind::f32;
    case ggml_type::q4_0:
    case ggml_type::q4_1:
    case ggml_type::q8_0:
      return activation_kind::q16;
    case ggml_type::q4_k:
    case ggml_type::q6_k:
      return activation_kind::q16_k;
    default:
      return activation_kind::none;
  }
}

size_t activation_bytes(activation_kind kind, int64_t n) {
  switch (kind) {
    case activation_kind::f32:
      return size_t(n) * sizeof(float);
    case activation_kind::q16:
      return size_t(n / 32) * sizeof(q16_block);
    case activation_kind::q16_k:
      return size_t(n / qk_k) * sizeof(q16_k_block);
    case activation_kind::none:
      break;
  }
  return 0;
}

namespace {

// Scale and int16 codes of one block of `len` elements: d = max|x| / 32767, q = round(x / d).
float quantize_block(const float* x, int len, int16_t* q) {
  float amax = 0.f;
  for (int i = 0; i < len; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 32767.f;
  const float id = d > 0.f ? 1.f / d : 0.f;
  for (int i = 0; i < len; ++i) q[i] = int16_t(std::clamp(std::lrintf(x[i] * id), -32767l, 32767l));
  return d;
}

}  // namespace

void quantize_activation(activation_kind kind, const float* x, int64_t n, uint8_t* dst) {
  switch (kind) {
    case activation_kind::f32:
      std::memcpy(dst, x, size_t(n) * sizeof(float));
      return;
    case activation_kind::q16:
      for (int64_t b = 0; b < n / 32; ++b) {
        q16_block blk;
        blk.d = quantize_block(x + 32 * b, 32, blk.qs);
        int sum = 0;
        for (int16_t q : blk.qs) sum += q;
        blk.s = blk.d * float(sum);
        std::memcpy(dst + size_t(b) * sizeof(q16_block), &blk, sizeof(blk));
      }
      return;
    case activation_kind::q16_k:
      for (int64_t b = 0; b < n / qk_k; ++b) {
        q16_k_block blk;
        blk.d = quantize_block(x + qk_k * b, qk_k, blk.qs);
        for (int g = 0; g < 16; ++g) {
          int32_t sum = 0;
          for (int i = 0; i < 16; ++i) sum += blk.qs[16 * g + i];
          blk.bsums[g] = sum;
        }
        std::memcpy(dst + size_t(b) * sizeof(q16_k_block), &blk, sizeof(blk));
      }
      return;
    case activation_kind::none:
      return;
  }
}

namespace {
// The kernel table of `isa` (all nullptr where this CPU or build cannot run it).
detail::dot_kernels kernels_of(cpu_isa isa) {
  if (!isa_available(isa)) return {};
  return isa == cpu_isa::avx2 ? detail::avx2_kernels() : detail::scalar_kernels();
}
}  // namespace

dot_fn find_dot(ggml_type t, cpu_isa isa) {
  const detail::dot_kernels k = kernels_of(isa);
  switch (t) {
    case ggml_type::f32:
      return k.f32;
    case ggml_type::f16:
      return k.f16;
    case ggml_type::q4_0:
      return k.q4_0;
    case ggml_type::q4_1:
      return k.q4_1;
    case ggml_type::q8_0:
      return k.q8_0;
    case ggml_type::q4_k:
      return k.q4_k;
    case ggml_type::q6_k:
      return k.q6_k;
    default:
      return nullptr;
  }
}

dot4_fn find_dot4(ggml_type t, cpu_isa isa) {
  const detail::dot_kernels k = kernels_of(isa);
  switch (t) {
    case ggml_type::q4_0:
      return k.q4_0x4;
    case ggml_type::q4_1:
      return k.q4_1x4;
    case ggml_type::q8_0:
      return k.q8_0x4;
    default:
      return nullptr;
  }
}

}  // namespace kvq::llama
