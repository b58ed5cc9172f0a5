// The nvfp4 format against CUDA's own NVFP4 conversions (cuda_fp4.h, cuda_fp8.h), on the host:
// kvq's e2m1 rounding, nibble order and e4m3 block scales are the bytes an NVFP4 engine reads.
// No device needed (part of the host-only plan tests).
#include <kvq/codec/codec.hpp>
#include <kvq/format/format.hpp>

#include <catch2/catch.hpp>
#include <cuda_fp16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

using namespace kvq;

TEST_CASE("nvfp4 pages hold the bytes CUDA's own NVFP4 conversions give", "[cuda][nvfp4]") {
  // e2m1 codes: kvq's rounding equals cuda_fp4.h's round-to-nearest (satfinite), over every
  // multiple of 1/256 in [-8, 8] and the ties; a value rounding to zero is +0 in kvq, where CUDA
  // keeps the sign (0x8), the same value.
  for (int i = -2048; i <= 2048; ++i) {
    const float v = float(i) / 256.f;
    const uint32_t want = __nv_cvt_float_to_fp4(v, __NV_E2M1, cudaRoundNearest);
    CAPTURE(v, want);
    REQUIRE(float_to_e2m1(v) == (want == 8u ? 0u : want));
    REQUIRE(e2m1_to_float(want) == __half2float(__nv_cvt_fp4_to_halfraw(__nv_fp4_storage_t(want), __NV_E2M1)));
  }
  // a page's byte pair: channel 2i in the low nibble, as __nv_cvt_float2_to_fp4x2 packs (x, y)
  const int P = 64, d = 32;
  const codec::page_geom g = codec::make_geom(format_id_v<nvfp4>, role::v, P, d);
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.f, 2.f);
  std::vector<uint16_t> src(size_t(P) * d);
  for (auto& h : src) h = float_to_half(nd(rng));
  std::vector<uint8_t> page(g.lay.total(), 0);
  codec::encode_unit(g, src.data(), d, 0, page.data(), codec::no_clip);
  const float ts = *reinterpret_cast<const float*>(page.data() + g.lay.zero_offset());
  for (int t = 0; t < P; ++t)
    for (int c = 0; c < d; c += 2) {
      const uint8_t bs = page[g.lay.code_bytes + t * (d / 16) + c / 16];
      const float S = e4m3_to_float(bs) * ts;
      const float2 x{half_to_float(src[size_t(t) * d + c]) / S, half_to_float(src[size_t(t) * d + c + 1]) / S};
      uint32_t want = __nv_cvt_float2_to_fp4x2(x, __NV_E2M1, cudaRoundNearest);
      if ((want & 15u) == 8u) want &= 0xF0u;  // -0 -> +0
      if ((want >> 4) == 8u) want &= 0x0Fu;
      CAPTURE(t, c, x.x, x.y);
      REQUIRE(page[size_t(t) * (d / 2) + c / 2] == want);
    }
  // block scales are e4m3 as __nv_cvt_float_to_fp8 (satfinite) gives them
  for (int i = 0; i < 8192; ++i) {  // 2^-13 to about 4092: subnormals to saturation
    const float v = std::ldexp(float(i % 512) + 0.5f, i / 512 - 12);
    REQUIRE(float_to_e4m3(v) == __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
  }
}
