// AVX2 dot-product kernels (tested against dot_scalar.cpp in tests/test_dot.cpp). This file is
// compiled with -mavx2 -mfma -mf16c (tools/llama/CMakeLists.txt) and only called after
// `isa_available(cpu_isa::avx2)`; it includes no header with inline functions other code shares,
// so no AVX2 code leaks into paths a non-AVX2 CPU runs.
#include <llama/dot.hpp>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include <cstring>

namespace kvq::llama::detail {

namespace {

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

// 16 int16 weights times 16 int16 activation codes, summed in pairs: 8 int32 lanes.
inline __m256i madd16(__m256i w, const int16_t* a) { return _mm256_madd_epi16(w, load256(a)); }

// Sum over one 32-element block of the nibbles (16 bytes qs: element j < 16 in the low nibble
// of qs[j], j >= 16 in the high nibble of qs[j - 16]) times int16 codes: 8 int32 lanes.
inline __m256i nibble_dot(const uint8_t* qs, const int16_t* a) {
  const __m256i bytes = _mm256_cvtepu8_epi16(load128(qs));
  const __m256i lo = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0f));
  const __m256i hi = _mm256_srli_epi16(bytes, 4);
  return _mm256_add_epi32(madd16(lo, a), madd16(hi, a + 16));
}

float dot_f32(const uint8_t* w, const uint8_t* act, int64_t n) {
  const float* x = reinterpret_cast<const float*>(act);
  const float* wf = reinterpret_cast<const float*>(w);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(wf + i), _mm256_loadu_ps(x + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(wf + i + 8), _mm256_loadu_ps(x + i + 8), acc1);
  }
  float sum = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) sum += wf[i] * x[i];
  return sum;
}

float dot_f16(const uint8_t* w, const uint8_t* act, int64_t n) {
  const float* x = reinterpret_cast<const float*>(act);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2 * i)));
    const __m256 w1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2 * i + 16)));
    acc0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i), acc0);
    acc1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i + 8), acc1);
  }
  float sum = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) sum += f16_at(w + 2 * i) * x[i];
  return sum;
}

float dot_q4_0(const uint8_t* w, const uint8_t* act, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  float offset = 0.f;
  for (int64_t b = 0; b < n / 32; ++b, w += sizeof(block_q4_0), act += sizeof(q16_block)) {
    const q16_block* a = reinterpret_cast<const q16_block*>(act);
    const float d = f16_at(w);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(d * a->d), _mm256_cvtepi32_ps(nibble_dot(w + 2, a->qs)), acc);
    offset += d * a->s;
  }
  return hsum(acc) - 8.f * offset;
}

float dot_q4_1(const uint8_t* w, const uint8_t* act, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  float mins = 0.f;
  for (int64_t b = 0; b < n / 32; ++b, w += sizeof(block_q4_1), act += sizeof(q16_block)) {
    const q16_block* a = reinterpret_cast<const q16_block*>(act);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(w) * a->d), _mm256_cvtepi32_ps(nibble_dot(w + 4, a->qs)), acc);
    mins += f16_at(w + 2) * a->s;
  }
  return hsum(acc) + mins;
}

// Four activation rows (act, act + stride, ...) against one weight row: the weight's bytes are
// unpacked once per block for all four, and each row's sum is formed in exactly the order of
// `dot_q4_1` (so the results are equal bit for bit).
void dot4_q4_1(const uint8_t* w, const uint8_t* act, size_t stride, int64_t n, float* out) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  float mins[4] = {};
  for (int64_t b = 0; b < n / 32; ++b, w += sizeof(block_q4_1)) {
    const __m256i bytes = _mm256_cvtepu8_epi16(load128(w + 4));
    const __m256i lo = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0f));
    const __m256i hi = _mm256_srli_epi16(bytes, 4);
    const float d = f16_at(w), m = f16_at(w + 2);
    for (int i = 0; i < 4; ++i) {
      const q16_block* a = reinterpret_cast<const q16_block*>(act + i * stride + size_t(b) * sizeof(q16_block));
      const __m256i p = _mm256_add_epi32(madd16(lo, a->qs), madd16(hi, a->qs + 16));
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * a->d), _mm256_cvtepi32_ps(p), acc[i]);
      mins[i] += m * a->s;
    }
  }
  for (int i = 0; i < 4; ++i) out[i] = hsum(acc[i]) + mins[i];
}

// `dot_q4_0` for four activation rows, as `dot4_q4_1`.
void dot4_q4_0(const uint8_t* w, const uint8_t* act, size_t stride, int64_t n, float* out) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  float offset[4] = {};
  for (int64_t b = 0; b < n / 32; ++b, w += sizeof(block_q4_0)) {
    const __m256i bytes = _mm256_cvtepu8_epi16(load128(w + 2));
    const __m256i lo = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0f));
    const __m256i hi = _mm256_srli_epi16(bytes, 4);
    const float d = f16_at(w);
    for (int i = 0; i < 4; ++i) {
      const q16_block* a = reinterpret_cast<const q16_block*>(act + i * stride + size_t(b) * sizeof(q16_block));
      const __m256i p = _mm256_add_epi32(madd16(lo, a->qs), madd16(hi, a->qs + 16));
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * a->d), _mm256_cvtepi32_ps(p), acc[i]);
      offset[i] += d * a->s;
    }
  }
  for (int i = 0; i < 4; ++i) out[i] = hsum(acc[i]) - 8.f * offset[i];
}

float dot_q8_0(const uint8_t* w, const uint8_t* act, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < n / 32; ++b, w += sizeof(block_q8_0), act += sizeof(q16_block)) {
    const q16_block* a = reinterpret_cast<const q16_block*>(act);
    const __m256i q0 = _mm256_cvtepi8_epi16(load128(w + 2));
    const __m256i q1 = _mm256_cvtepi8_epi16(load128(w + 18));
    const __m256i p = _mm256_add_epi32(madd16(q0, a->qs), madd16(q1, a->qs + 16));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(w) * a->d), _mm256_cvtepi32_ps(p), acc);
  }
  return hsum(acc);
}

// `dot_q8_0` for four activation rows, as `dot4_q4_1`.
void dot4_q8_0(const uint8_t* w, const uint8_t* act, size_t stride, int64_t n, float* out) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < n / 32; ++b, w += sizeof(block_q8_0)) {
    const __m256i q0 = _mm256_cvtepi8_epi16(load128(w + 2));
    const __m256i q1 = _mm256_cvtepi8_epi16(load128(w + 18));
    const float d = f16_at(w);
    for (int i = 0; i < 4; ++i) {
      const q16_block* a = reinterpret_cast<const q16_block*>(act + i * stride + size_t(b) * sizeof(q16_block));
      const __m256i p = _mm256_add_epi32(madd16(q0, a->qs), madd16(q1, a->qs + 16));
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * a->d), _mm256_cvtepi32_ps(p), acc[i]);
    }
  }
  for (int i = 0; i < 4; ++i) out[i] = hsum(acc[i]);
}

float dot_q4_k(const uint8_t* w, const uint8_t* act, int64_t n) {
  float sum = 0.f;
  for (int64_t b = 0; b < n / qk_k; ++b, w += sizeof(block_q4_k), act += sizeof(q16_k_block)) {
    const q16_k_block* a = reinterpret_cast<const q16_k_block*>(act);
    const uint8_t* sc = w + 4;
    const uint8_t* qs = w + 16;
    // Per sub-block: int32 sums (at most 32 * 15 * 32767), then float times the 6-bit scale.
    __m256 acc = _mm256_setzero_ps();
    float msum = 0.f;
    for (int s = 0; s < 8; ++s) {
      int scale, min;  // packing described at block_q4_k
      if (s < 4) {
        scale = sc[s] & 63, min = sc[s + 4] & 63;
      } else {
        scale = (sc[s + 4] & 0xf) | (sc[s - 4] >> 6) << 4, min = (sc[s + 4] >> 4) | (sc[s] >> 6) << 4;
      }
      const uint8_t* q = qs + 32 * (s / 2);
      const __m256i b0 = _mm256_cvtepu8_epi16(load128(q)), b1 = _mm256_cvtepu8_epi16(load128(q + 16));
      const __m256i n0 = s % 2 ? _mm256_srli_epi16(b0, 4) : _mm256_and_si256(b0, _mm256_set1_epi16(0x0f));
      const __m256i n1 = s % 2 ? _mm256_srli_epi16(b1, 4) : _mm256_and_si256(b1, _mm256_set1_epi16(0x0f));
      const __m256i p = _mm256_add_epi32(madd16(n0, a->qs + 32 * s), madd16(n1, a->qs + 32 * s + 16));
      acc = _mm256_fmadd_ps(_mm256_set1_ps(float(scale)), _mm256_cvtepi32_ps(p), acc);
      msum += float(min) * float(a->bsums[2 * s] + a->bsums[2 * s + 1]);
    }
    sum += a->d * (f16_at(w) * hsum(acc) - f16_at(w + 2) * msum);
  }
  return sum;
}

float dot_q6_k(const uint8_t* w, const uint8_t* act, int64_t n) {
  float sum = 0.f;
  for (int64_t b = 0; b < n / qk_k; ++b, w += sizeof(block_q6_k), act += sizeof(q16_k_block)) {
    const q16_k_block* a = reinterpret_cast<const q16_k_block*>(act);
    const uint8_t* ql = w;
    const uint8_t* qh = w + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(w + 192);
    __m256 acc = _mm256_setzero_ps();
    float offset = 0.f;  // sum over sub-blocks of scale * (sum of its codes): the "- 32" of q
    for (int s = 0; s < 16; ++s) offset += float(scales[s]) * float(a->bsums[s]);
    for (int h = 0; h < 2; ++h) {
      const __m256i high = load256(qh + 32 * h);
      for (int g = 0; g < 4; ++g) {
        // The 32 codes of elements 128h + 32g + l (l < 32) as bytes: low 4 bits from ql, high 2 from qh.
        const __m256i lbytes = load256(ql + 64 * h + 32 * (g % 2));
        const __m256i lo = g < 2 ? lbytes : _mm256_srli_epi16(lbytes, 4);
        const __m256i hi = _mm256_srli_epi16(high, 2 * g);
        const __m256i q = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi8(0x0f)),
                                          _mm256_slli_epi16(_mm256_and_si256(hi, _mm256_set1_epi8(3)), 4));
        const int16_t* av = a->qs + 128 * h + 32 * g;
        const int s0 = 8 * h + 2 * g;  // sub-blocks s0 (l < 16) and s0 + 1
        const __m256i p0 = madd16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(q)), av);
        const __m256i p1 = madd16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1)), av + 16);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(float(scales[s0])), _mm256_cvtepi32_ps(p0), acc);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(float(scales[s0 + 1])), _mm256_cvtepi32_ps(p1), acc);
      }
    }
    sum += f16_at(w + 208) * a->d * (hsum(acc) - 32.f * offset);
  }
  return sum;
}

}  // namespace

dot_kernels avx2_kernels() {
  return {dot_f32, dot_f16, dot_q4_0, dot_q4_1, dot_q8_0, dot_q4_k, dot_q6_k, dot4_q4_0, dot4_q4_1, dot4_q8_0};
}

}  // namespace kvq::llama::detail

#else

namespace kvq::llama::detail {
dot_kernels avx2_kernels() { return {}; }
}  // namespace kvq::llama::detail

#endif
