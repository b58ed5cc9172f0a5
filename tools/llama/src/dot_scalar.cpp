// Portable dot-product kernels: the reference every vectorized kernel is tested against
// (tests/test_dot.cpp). Block layouts in llama/quant.hpp and llama/dot.hpp.
#include <cstring>
#include <llama/dot.hpp>

namespace kvq::llama::detail {

namespace {

inline float f16_at(const uint8_t* p) { return f16_to_float(uint16_t(p[0] | p[1] << 8)); }

template <class T>
inline T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

float dot_f32(const uint8_t* w, const uint8_t* act, int64_t n) {
  const float* x = reinterpret_cast<const float*>(act);
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += load<float>(w + 4 * i) * x[i];
  return sum;
}

float dot_f16(const uint8_t* w, const uint8_t* act, int64_t n) {
  const float* x = reinterpret_cast<const float*>(act);
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += f16_at(w + 2 * i) * x[i];
  return sum;
}

// Sum over the 32 elements of a Q4_0/Q4_1 nibble block (qs: 16 bytes) times int16 codes.
inline int nibble_dot(const uint8_t* qs, const int16_t* a) {
  int sum = 0;
  for (int j = 0; j < 16; ++j) sum += (qs[j] & 0xf) * a[j] + (qs[j] >> 4) * a[j + 16];
  return sum;
}

float dot_q4_0(const uint8_t* w, const uint8_t* act, int64_t n) {
  float sum = 0.f;
  for (int64_t b = 0; b < n / 32; ++b, w += sizeof(block_q4_0)) {
    const auto a = load<q16_block>(act + b * sizeof(q16_block));
    const float d = f16_at(w);
    // sum (q - 8) * a = sum q * a - 8 * sum a
    sum += d * (a.d * float(nibble_dot(w + 2, a.qs)) - 8.f * a.s);
  }
  return sum;
}

float dot_q4_1(const uint8_t* w, const uint8_t* act, int64_t n) {
  float sum = 0.f;
  for (int64_t b = 0; b < n / 32; ++b, w += sizeof(block_q4_1)) {
    const auto a = load<q16_block>(act + b * sizeof(q16_block));
    sum += f16_at(w) * a.d * float(nibble_dot(w + 4, a.qs)) + f16_at(w + 2) * a.s;
  }
  return sum;
}

float dot_q8_0(const uint8_t* w, const uint8_t* act, int64_t n) {
  float sum = 0.f;
  for (int64_t b = 0; b < n / 32; ++b, w += sizeof(block_q8_0)) {
    const auto a = load<q16_block>(act + b * sizeof(q16_block));
    const int8_t* q = reinterpret_cast<const int8_t*>(w + 2);
    int isum = 0;
    for (int j = 0; j < 32; ++j) isum += q[j] * a.qs[j];
    sum += f16_at(w) * a.d * float(isum);
  }
  return sum;
}

float dot_q4_k(const uint8_t* w, const uint8_t* act, int64_t n) {
  float sum = 0.f;
  for (int64_t b = 0; b < n / qk_k; ++b, w += sizeof(block_q4_k)) {
    const auto a = load<q16_k_block>(act + b * sizeof(q16_k_block));
    const uint8_t* scales = w + 4;
    const uint8_t* qs = w + 16;
    int64_t isum = 0, msum = 0;
    for (int s = 0; s < 8; ++s) {
      int sc, mn;
      q4_k_scale_min(scales, s, sc, mn);
      const uint8_t* q = qs + 32 * (s / 2);
      const int shift = 4 * (s % 2);
      int sub = 0;
      for (int l = 0; l < 32; ++l) sub += ((q[l] >> shift) & 0xf) * a.qs[32 * s + l];
      isum += int64_t(sc) * sub;
      msum += int64_t(mn) * (a.bsums[2 * s] + a.bsums[2 * s + 1]);
    }
    sum += a.d * (f16_at(w) * float(isum) - f16_at(w + 2) * float(msum));
  }
  return sum;
}

float dot_q6_k(const uint8_t* w, const uint8_t* act, int64_t n) {
  float sum = 0.f;
  for (int64_t b = 0; b < n / qk_k; ++b, w += sizeof(block_q6_k)) {
    const auto a = load<q16_k_block>(act + b * sizeof(q16_k_block));
    const uint8_t* ql = w;
    const uint8_t* qh = w + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(w + 192);
    int64_t isum = 0;
    for (int e = 0; e < qk_k; e += 16) {
      const int h = e / 128, g = (e % 128) / 32, l0 = e % 32;
      int sub = 0;
      for (int l = l0; l < l0 + 16; ++l) {
        const uint8_t lbyte = ql[64 * h + 32 * (g % 2) + l];
        const int lo = g < 2 ? (lbyte & 0xf) : (lbyte >> 4);
        const int hi = (qh[32 * h + l] >> (2 * g)) & 3;
        sub += ((lo | hi << 4) - 32) * a.qs[e + l - l0];
      }
      isum += int64_t(scales[8 * h + 2 * g + l0 / 16]) * sub;
    }
    sum += f16_at(w + 208) * a.d * float(isum);
  }
  return sum;
}

}  // namespace

dot_kernels scalar_kernels() {
  return {dot_f32, dot_f16, dot_q4_0, dot_q4_1, dot_q8_0, dot_q4_k, dot_q6_k, nullptr, nullptr, nullptr};
}

}  // namespace kvq::llama::detail
