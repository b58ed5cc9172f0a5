#pragma once
/// \file
/// GGML tensor element types as stored in GGUF files: their block structs (size pinned by
/// `static_assert`, byte layout in a table beside each), one runtime table of block sizes and
/// names, and dequantization to float.
///
/// A quantized type stores `block_elems` consecutive elements of a row in one block of
/// `block_bytes` bytes; a row's element count is a multiple of `block_elems`. All fields are
/// little-endian; `f16` fields are IEEE binary16 bit patterns. Blocks in a file are not
/// necessarily aligned to their struct's alignment, so the dequantizers copy each block into a
/// local struct before reading it.
///
/// Naming within a block: "sub-block" = the group of elements sharing one scale (and min).

#include <cstdint>
#include <kvq/format/numeric.hpp>
#include <kvq/status.hpp>
#include <span>
#include <string>

namespace kvq::llama {

/// Bit pattern of an IEEE binary16 value.
using f16_bits = uint16_t;

/// IEEE binary16 → float, exact for every pattern (kvq's own conversion, `kvq/format/numeric.hpp`).
inline float f16_to_float(f16_bits h) { return kvq::half_to_float(h); }
/// bfloat16 → float (exact: the upper half of a float).
inline float bf16_to_float(uint16_t h) { return kvq::bf16_to_float(h); }

/// Element types of GGML/GGUF, numbered as in the file format. Only the types listed in
/// `type_table` are known to this loader; the ones with a dequantizer are marked there.
enum class ggml_type : uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q5_0 = 6,
  q5_1 = 7,
  q8_0 = 8,
  q8_1 = 9,
  q2_k = 10,
  q3_k = 11,
  q4_k = 12,
  q5_k = 13,
  q6_k = 14,
  q8_k = 15,
  iq2_xxs = 16,
  iq2_xs = 17,
  iq3_xxs = 18,
  iq1_s = 19,
  iq4_nl = 20,
  iq3_s = 21,
  iq2_s = 22,
  iq4_xs = 23,
  i8 = 24,
  i16 = 25,
  i32 = 26,
  i64 = 27,
  f64 = 28,
  iq1_m = 29,
  bf16 = 30,
  tq1_0 = 34,
  tq2_0 = 35,
  mxfp4 = 39,
};

/// Elements per block of the "K" quantizations.
inline constexpr int qk_k = 256;

// ---- block structs ---------------------------------------------------------------------------

/// Q4_0: 32 elements, x = d * (q - 8), q unsigned 4 bit.
///
/// | offset | bytes | field | contents                                                     |
/// |--------|-------|-------|--------------------------------------------------------------|
/// | 0      | 2     | d     | f16 scale                                                    |
/// | 2      | 16    | qs    | element j < 16: low nibble of qs[j]; j >= 16: high nibble of qs[j-16] |
struct block_q4_0 {
  f16_bits d;
  uint8_t qs[16];
};
static_assert(sizeof(block_q4_0) == 18, "Q4_0 block is 18 bytes");

/// Q4_1: 32 elements, x = d * q + m, q unsigned 4 bit (same nibble order as Q4_0).
///
/// | offset | bytes | field | contents          |
/// |--------|-------|-------|-------------------|
/// | 0      | 2     | d     | f16 scale         |
/// | 2      | 2     | m     | f16 offset (min)  |
/// | 4      | 16    | qs    | nibbles as Q4_0   |
struct block_q4_1 {
  f16_bits d;
  f16_bits m;
  uint8_t qs[16];
};
static_assert(sizeof(block_q4_1) == 20, "Q4_1 block is 20 bytes");

/// Q5_0: 32 elements, x = d * (q - 16), q unsigned 5 bit: low 4 bits as the nibbles of Q4_0,
/// bit 4 of element j = bit j of qh read as a little-endian uint32.
///
/// | offset | bytes | field | contents                         |
/// |--------|-------|-------|----------------------------------|
/// | 0      | 2     | d     | f16 scale                        |
/// | 2      | 4     | qh    | fifth bits, element j = bit j    |
/// | 6      | 16    | qs    | low nibbles as Q4_0              |
struct block_q5_0 {
  f16_bits d;
  uint8_t qh[4];
  uint8_t qs[16];
};
static_assert(sizeof(block_q5_0) == 22, "Q5_0 block is 22 bytes");

/// Q5_1: 32 elements, x = d * q + m, q as Q5_0.
///
/// | offset | bytes | field | contents            |
/// |--------|-------|-------|---------------------|
/// | 0      | 2     | d     | f16 scale           |
/// | 2      | 2     | m     | f16 offset (min)    |
/// | 4      | 4     | qh    | fifth bits as Q5_0  |
/// | 8      | 16    | qs    | low nibbles as Q4_0 |
struct block_q5_1 {
  f16_bits d;
  f16_bits m;
  uint8_t qh[4];
  uint8_t qs[16];
};
static_assert(sizeof(block_q5_1) == 24, "Q5_1 block is 24 bytes");

/// Q8_0: 32 elements, x = d * q, q signed 8 bit.
///
/// | offset | bytes | field | contents        |
/// |--------|-------|-------|-----------------|
/// | 0      | 2     | d     | f16 scale       |
/// | 2      | 32    | qs    | int8 element j  |
struct block_q8_0 {
  f16_bits d;
  int8_t qs[32];
};
static_assert(sizeof(block_q8_0) == 34, "Q8_0 block is 34 bytes");

/// Q2_K: 256 elements in 16 sub-blocks of 16; x = d * sc * q - dmin * mn, q unsigned 2 bit.
/// Element e: half h = e / 128, r = e % 128, pair index j = r / 32, l = r % 32;
/// q = bits 2j..2j+1 of qs[32h + l]; sub-block s = 8h + 2j + l / 16;
/// sc = low nibble, mn = high nibble of scales[s].
///
/// | offset | bytes | field  | contents                              |
/// |--------|-------|--------|---------------------------------------|
/// | 0      | 16    | scales | per sub-block: scale (lo 4), min (hi 4) |
/// | 16     | 64    | qs     | 2-bit codes, see above                |
/// | 80     | 2     | d      | f16 super-scale of the scales         |
/// | 82     | 2     | dmin   | f16 super-scale of the mins           |
struct block_q2_k {
  uint8_t scales[16];
  uint8_t qs[64];
  f16_bits d;
  f16_bits dmin;
};
static_assert(sizeof(block_q2_k) == 84, "Q2_K block is 84 bytes");

/// Q3_K: 256 elements in 16 sub-blocks of 16; x = d * (sc - 32) * q, q signed 3 bit in [-4, 3].
/// Element e: h = e / 128, r = e % 128, j = r / 32, l = r % 32; low bits = bits 2j..2j+1 of
/// qs[32h + l]; q = low - 4 unless bit (4h + j) of hmask[l] is set (then q = low);
/// sub-block s = 8h + 2j + l / 16. Scale s is 6 bit: low 4 bits = s < 8 ? low nibble of
/// scales[s] : high nibble of scales[s - 8]; high 2 bits = bits 2(s/4)..2(s/4)+1 of
/// scales[8 + s % 4].
///
/// | offset | bytes | field  | contents                       |
/// |--------|-------|--------|--------------------------------|
/// | 0      | 32    | hmask  | third bits, see above          |
/// | 32     | 64    | qs     | low 2 bits, see above          |
/// | 96     | 12    | scales | sixteen 6-bit scales, packed   |
/// | 108    | 2     | d      | f16 super-scale                |
struct block_q3_k {
  uint8_t hmask[32];
  uint8_t qs[64];
  uint8_t scales[12];
  f16_bits d;
};
static_assert(sizeof(block_q3_k) == 110, "Q3_K block is 110 bytes");

/// Q4_K: 256 elements in 8 sub-blocks of 32; x = d * sc * q - dmin * mn, q unsigned 4 bit.
/// Element e: chunk c = e / 64, r = e % 64; q = low (r < 32) or high (r >= 32) nibble of
/// qs[32c + r % 32]; sub-block s = 2c + r / 32. The 6-bit sc and mn of sub-block s
/// (12 packed bytes, `scales`): s < 4: sc = scales[s] & 63, mn = scales[s + 4] & 63;
/// s >= 4: sc = (scales[s + 4] & 15) | (scales[s - 4] >> 6) << 4,
///         mn = (scales[s + 4] >> 4) | (scales[s] >> 6) << 4.
///
/// | offset | bytes | field  | contents                           |
/// |--------|-------|--------|------------------------------------|
/// | 0      | 2     | d      | f16 super-scale of the scales      |
/// | 2      | 2     | dmin   | f16 super-scale of the mins        |
/// | 4      | 12    | scales | eight 6-bit scales and mins        |
/// | 16     | 128   | qs     | nibbles, see above                 |
struct block_q4_k {
  f16_bits d;
  f16_bits dmin;
  uint8_t scales[12];
  uint8_t qs[128];
};
static_assert(sizeof(block_q4_k) == 144, "Q4_K block is 144 bytes");

/// The 6-bit scale and min of sub-block s (0..7) of Q4_K and Q5_K from their 12 packed bytes
/// `sc` (packing in the comment of `block_q4_k`).
inline void q4_k_scale_min(const uint8_t* sc, int s, int& scale, int& min) {
  if (s < 4) {
    scale = sc[s] & 63;
    min = sc[s + 4] & 63;
  } else {
    scale = (sc[s + 4] & 0xf) | (sc[s - 4] >> 6) << 4;
    min = (sc[s + 4] >> 4) | (sc[s] >> 6) << 4;
  }
}

/// Q5_K: Q4_K plus a fifth bit: q = nibble + 16 * (bit s of qh[r % 32]), with the sub-block s
/// and r as in Q4_K.
///
/// | offset | bytes | field  | contents                       |
/// |--------|-------|--------|--------------------------------|
/// | 0      | 2     | d      | f16 super-scale of the scales  |
/// | 2      | 2     | dmin   | f16 super-scale of the mins    |
/// | 4      | 12    | scales | as Q4_K                        |
/// | 16     | 32    | qh     | fifth bits                     |
/// | 48     | 128   | qs     | nibbles as Q4_K                |
struct block_q5_k {
  f16_bits d;
  f16_bits dmin;
  uint8_t scales[12];
  uint8_t qh[32];
  uint8_t qs[128];
};
static_assert(sizeof(block_q5_k) == 176, "Q5_K block is 176 bytes");

/// Q6_K: 256 elements in 16 sub-blocks of 16; x = d * scales[s] * (q - 32), q unsigned 6 bit.
/// Element e: h = e / 128, r = e % 128, quarter g = r / 32, l = r % 32; low 4 bits = low (g < 2)
/// or high (g >= 2) nibble of ql[64h + 32(g % 2) + l]; high 2 bits = bits 2g..2g+1 of
/// qh[32h + l]; sub-block s = 8h + 2g + l / 16.
///
/// | offset | bytes | field  | contents               |
/// |--------|-------|--------|------------------------|
/// | 0      | 128   | ql     | low 4 bits             |
/// | 128    | 64    | qh     | high 2 bits            |
/// | 192    | 16    | scales | int8 scale per sub-block |
/// | 208    | 2     | d      | f16 super-scale        |
struct block_q6_k {
  uint8_t ql[128];
  uint8_t qh[64];
  int8_t scales[16];
  f16_bits d;
};
static_assert(sizeof(block_q6_k) == 210, "Q6_K block is 210 bytes");

/// Q8_K: 256 elements, x = d * q (the intermediate type of K-quant dot products).
///
/// | offset | bytes | field | contents                               |
/// |--------|-------|-------|----------------------------------------|
/// | 0      | 4     | d     | f32 scale                              |
/// | 4      | 256   | qs    | int8 element e                         |
/// | 260    | 32    | bsums | int16 sums of 16-element groups (unused here) |
struct block_q8_k {
  float d;
  int8_t qs[256];
  int16_t bsums[16];
};
static_assert(sizeof(block_q8_k) == 292, "Q8_K block is 292 bytes");

// ---- the type table --------------------------------------------------------------------------

/// Runtime descriptor of one element type.
struct type_info {
  ggml_type type;
  const char* name;      ///< "Q4_K", as llama.cpp spells it
  uint32_t block_elems;  ///< elements per block (1 for plain types)
  uint32_t block_bytes;  ///< bytes per block
  bool dequantizable;    ///< this loader can convert it to float
};

/// Descriptor of a type id read from a file, or nullptr for an id this loader does not know.
const type_info* find_type(uint32_t id);

/// Name of a type id ("Q4_K", or "type 77" for an unknown id).
std::string type_name(uint32_t id);

/// Converts `elems` elements of type `t` to float.
/// \param src [elems / block_elems][block_bytes] raw bytes; its size must be exactly that
/// \param dst [elems] output
/// Errors (unsupported type, size mismatch) name the type and the sizes.
status dequantize(ggml_type t, std::span<const uint8_t> src, std::span<float> dst);

}  // namespace kvq::llama
