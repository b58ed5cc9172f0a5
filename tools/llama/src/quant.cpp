#include <fmt/format.h>

#include <array>
#include <bit>
#include <cstring>
#include <llama/quant.hpp>

namespace kvq::llama {

namespace {

// One list of known types: names and block sizes as in the GGUF specification.
constexpr std::array<type_info, 32> types = {{
    {ggml_type::f32, "F32", 1, 4, true},
    {ggml_type::f16, "F16", 1, 2, true},
    {ggml_type::q4_0, "Q4_0", 32, sizeof(block_q4_0), true},
    {ggml_type::q4_1, "Q4_1", 32, sizeof(block_q4_1), true},
    {ggml_type::q5_0, "Q5_0", 32, sizeof(block_q5_0), true},
    {ggml_type::q5_1, "Q5_1", 32, sizeof(block_q5_1), true},
    {ggml_type::q8_0, "Q8_0", 32, sizeof(block_q8_0), true},
    {ggml_type::q8_1, "Q8_1", 32, 40, false},  // size as in gguf-py's GGML_QUANT_SIZES
    {ggml_type::q2_k, "Q2_K", qk_k, sizeof(block_q2_k), true},
    {ggml_type::q3_k, "Q3_K", qk_k, sizeof(block_q3_k), true},
    {ggml_type::q4_k, "Q4_K", qk_k, sizeof(block_q4_k), true},
    {ggml_type::q5_k, "Q5_K", qk_k, sizeof(block_q5_k), true},
    {ggml_type::q6_k, "Q6_K", qk_k, sizeof(block_q6_k), true},
    {ggml_type::q8_k, "Q8_K", qk_k, sizeof(block_q8_k), true},
    {ggml_type::iq2_xxs, "IQ2_XXS", qk_k, 66, false},
    {ggml_type::iq2_xs, "IQ2_XS", qk_k, 74, false},
    {ggml_type::iq3_xxs, "IQ3_XXS", qk_k, 98, false},
    {ggml_type::iq1_s, "IQ1_S", qk_k, 50, false},
    {ggml_type::iq4_nl, "IQ4_NL", 32, 18, false},
    {ggml_type::iq3_s, "IQ3_S", qk_k, 110, false},
    {ggml_type::iq2_s, "IQ2_S", qk_k, 82, false},
    {ggml_type::iq4_xs, "IQ4_XS", qk_k, 136, false},
    {ggml_type::i8, "I8", 1, 1, false},
    {ggml_type::i16, "I16", 1, 2, false},
    {ggml_type::i32, "I32", 1, 4, false},
    {ggml_type::i64, "I64", 1, 8, false},
    {ggml_type::f64, "F64", 1, 8, false},
    {ggml_type::iq1_m, "IQ1_M", qk_k, 56, false},
    {ggml_type::bf16, "BF16", 1, 2, true},
    {ggml_type::tq1_0, "TQ1_0", qk_k, 54, false},
    {ggml_type::tq2_0, "TQ2_0", qk_k, 66, false},
    {ggml_type::mxfp4, "MXFP4", 32, 17, false},
}};

template <class Block>
Block load_block(const uint8_t* p) {
  Block b;
  std::memcpy(&b, p, sizeof(Block));
  return b;
}

// Nibble j of the 32-element 4-bit layout shared by Q4_0, Q4_1, Q5_0 and Q5_1.
inline int nibble32(const uint8_t* qs, int j) { return j < 16 ? (qs[j] & 0xf) : (qs[j - 16] >> 4); }

inline uint32_t load_u32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

void deq_q4_0(const uint8_t* src, float* y) {
  const auto b = load_block<block_q4_0>(src);
  const float d = f16_to_float(b.d);
  for (int j = 0; j < 32; ++j) y[j] = d * float(nibble32(b.qs, j) - 8);
}

void deq_q4_1(const uint8_t* src, float* y) {
  const auto b = load_block<block_q4_1>(src);
  const float d = f16_to_float(b.d), m = f16_to_float(b.m);
  for (int j = 0; j < 32; ++j) y[j] = d * float(nibble32(b.qs, j)) + m;
}

void deq_q5_0(const uint8_t* src, float* y) {
  const auto b = load_block<block_q5_0>(src);
  const float d = f16_to_float(b.d);
  const uint32_t qh = load_u32(b.qh);
  for (int j = 0; j < 32; ++j) {
    const int q = nibble32(b.qs, j) | int((qh >> j) & 1) << 4;
    y[j] = d * float(q - 16);
  }
}

void deq_q5_1(const uint8_t* src, float* y) {
  const auto b = load_block<block_q5_1>(src);
  const float d = f16_to_float(b.d), m = f16_to_float(b.m);
  const uint32_t qh = load_u32(b.qh);
  for (int j = 0; j < 32; ++j) {
    const int q = nibble32(b.qs, j) | int((qh >> j) & 1) << 4;
    y[j] = d * float(q) + m;
  }
}

void deq_q8_0(const uint8_t* src, float* y) {
  const auto b = load_block<block_q8_0>(src);
  const float d = f16_to_float(b.d);
  for (int j = 0; j < 32; ++j) y[j] = d * float(b.qs[j]);
}

void deq_q2_k(const uint8_t* src, float* y) {
  const auto b = load_block<block_q2_k>(src);
  const float d = f16_to_float(b.d), dmin = f16_to_float(b.dmin);
  for (int e = 0; e < qk_k; ++e) {
    const int h = e / 128, r = e % 128, j = r / 32, l = r % 32;
    const int q = (b.qs[32 * h + l] >> (2 * j)) & 3;
    const int s = 8 * h + 2 * j + l / 16;
    y[e] = d * float(b.scales[s] & 0xf) * float(q) - dmin * float(b.scales[s] >> 4);
  }
}

// 6-bit scale s of Q3_K (16 of them packed in 12 bytes), unbiased to [-32, 31].
inline int q3_k_scale(const uint8_t* sc, int s) {
  const int lo = s < 8 ? (sc[s] & 0xf) : (sc[s - 8] >> 4);
  const int hi = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
  return (lo | hi << 4) - 32;
}

void deq_q3_k(const uint8_t* src, float* y) {
  const auto b = load_block<block_q3_k>(src);
  const float d = f16_to_float(b.d);
  for (int e = 0; e < qk_k; ++e) {
    const int h = e / 128, r = e % 128, j = r / 32, l = r % 32;
    const int low = (b.qs[32 * h + l] >> (2 * j)) & 3;
    const bool high = (b.hmask[l] >> (4 * h + j)) & 1;
    const int q = high ? low : low - 4;
    const int s = 8 * h + 2 * j + l / 16;
    y[e] = d * float(q3_k_scale(b.scales, s)) * float(q);
  }
}

void deq_q4_k(const uint8_t* src, float* y) {
  const auto b = load_block<block_q4_k>(src);
  const float d = f16_to_float(b.d), dmin = f16_to_float(b.dmin);
  for (int s = 0; s < 8; ++s) {
    int sc, mn;
    q4_k_scale_min(b.scales, s, sc, mn);
    const float ds = d * float(sc), ms = dmin * float(mn);
    const int c = s / 2;
    const bool high = s % 2;
    for (int l = 0; l < 32; ++l) {
      const uint8_t byte = b.qs[32 * c + l];
      const int q = high ? byte >> 4 : byte & 0xf;
      y[32 * s + l] = ds * float(q) - ms;
    }
  }
}

void deq_q5_k(const uint8_t* src, float* y) {
  const auto b = load_block<block_q5_k>(src);
  const float d = f16_to_float(b.d), dmin = f16_to_float(b.dmin);
  for (int s = 0; s < 8; ++s) {
    int sc, mn;
    q4_k_scale_min(b.scales, s, sc, mn);
    const float ds = d * float(sc), ms = dmin * float(mn);
    const int c = s / 2;
    const bool high = s % 2;
    for (int l = 0; l < 32; ++l) {
      const uint8_t byte = b.qs[32 * c + l];
      const int q = (high ? byte >> 4 : byte & 0xf) + 16 * ((b.qh[l] >> s) & 1);
      y[32 * s + l] = ds * float(q) - ms;
    }
  }
}

void deq_q6_k(const uint8_t* src, float* y) {
  const auto b = load_block<block_q6_k>(src);
  const float d = f16_to_float(b.d);
  for (int e = 0; e < qk_k; ++e) {
    const int h = e / 128, r = e % 128, g = r / 32, l = r % 32;
    const uint8_t lbyte = b.ql[64 * h + 32 * (g % 2) + l];
    const int lo = g < 2 ? (lbyte & 0xf) : (lbyte >> 4);
    const int hi = (b.qh[32 * h + l] >> (2 * g)) & 3;
    const int s = 8 * h + 2 * g + l / 16;
    y[e] = d * float(b.scales[s]) * float((lo | hi << 4) - 32);
  }
}

void deq_q8_k(const uint8_t* src, float* y) {
  const auto b = load_block<block_q8_k>(src);
  for (int e = 0; e < qk_k; ++e) y[e] = b.d * float(b.qs[e]);
}

using block_fn = void (*)(const uint8_t*, float*);

block_fn block_dequantizer(ggml_type t) {
  switch (t) {
    case ggml_type::q4_0:
      return deq_q4_0;
    case ggml_type::q4_1:
      return deq_q4_1;
    case ggml_type::q5_0:
      return deq_q5_0;
    case ggml_type::q5_1:
      return deq_q5_1;
    case ggml_type::q8_0:
      return deq_q8_0;
    case ggml_type::q2_k:
      return deq_q2_k;
    case ggml_type::q3_k:
      return deq_q3_k;
    case ggml_type::q4_k:
      return deq_q4_k;
    case ggml_type::q5_k:
      return deq_q5_k;
    case ggml_type::q6_k:
      return deq_q6_k;
    case ggml_type::q8_k:
      return deq_q8_k;
    default:
      return nullptr;
  }
}

}  // namespace

const type_info* find_type(uint32_t id) {
  for (const auto& t : types)
    if (uint32_t(t.type) == id) return &t;
  return nullptr;
}

std::string type_name(uint32_t id) {
  const type_info* t = find_type(id);
  return t ? std::string(t->name) : fmt::format("type {}", id);
}

status dequantize(ggml_type t, std::span<const uint8_t> src, std::span<float> dst) {
  const type_info* info = find_type(uint32_t(t));
  if (!info || !info->dequantizable)
    return {errc::unsupported, fmt::format("cannot dequantize tensors of type {} (this loader converts F32, F16, "
                                           "BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K and Q8_K)",
                                           type_name(uint32_t(t)))};
  const size_t n = dst.size();
  if (n % info->block_elems != 0)
    return {errc::invalid_argument,
            fmt::format("{} elements are not a multiple of the {} block of {}", n, info->name, info->block_elems)};
  const size_t blocks = n / info->block_elems;
  if (src.size() != blocks * info->block_bytes)
    return {errc::invalid_argument, fmt::format("{} elements of {} need {} bytes, got {}", n, info->name,
                                                blocks * info->block_bytes, src.size())};
  const uint8_t* p = src.data();
  float* y = dst.data();
  switch (t) {
    case ggml_type::f32:
      std::memcpy(y, p, n * 4);
      return {};
    case ggml_type::f16:
      for (size_t i = 0; i < n; ++i) y[i] = f16_to_float(uint16_t(p[2 * i] | p[2 * i + 1] << 8));
      return {};
    case ggml_type::bf16:
      for (size_t i = 0; i < n; ++i) y[i] = bf16_to_float(uint16_t(p[2 * i] | p[2 * i + 1] << 8));
      return {};
    default:
      break;
  }
  const block_fn fn = block_dequantizer(t);
  for (size_t b = 0; b < blocks; ++b) fn(p + b * info->block_bytes, y + b * info->block_elems);
  return {};
}

}  // namespace kvq::llama
