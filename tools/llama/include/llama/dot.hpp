#pragma once
/// \file
/// Dot products of one GGUF weight row with one activation row, computed on the quantized
/// blocks themselves (no dequantization to float), in two instruction sets: portable scalar C++
/// and AVX2 (chosen at run time). The matrix products of the model runner
/// (`llama/matmul.hpp`) call these per output row.
///
/// The activation row is quantized first, once per row, to the integer blocks its weight type
/// pairs with:
///
/// | weight type          | activation     | block of the activation                       |
/// |----------------------|----------------|-----------------------------------------------|
/// | F32, F16             | float          | the float row itself                          |
/// | Q4_0, Q4_1, Q8_0     | `q16_block`    | 32 int16 codes, f32 scale, f32 scaled sum     |
/// | Q4_K, Q6_K           | `q16_k_block`  | 256 int16 codes, f32 scale, int32 group sums  |
///
/// so the inner loops are integer multiply-adds, one float multiply per block or sub-block.
/// NOTE: the codes are 16 bit, not llama.cpp's 8: with 8-bit activations SmolLM2-135M's greedy
/// answer in tools/llama/tests/test_model.cpp flips (its top two logits are 0.024 apart), while
/// 16-bit codes (error 1/65534 of a block's largest value) keep it; decode stays bound by the
/// weight bytes it reads either way (docs/decisions.md, "Policies and evaluation").
///
/// Weight types without a kernel here (Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, BF16) are converted to F32
/// at load by the model runner.

#include <cstdint>
#include <llama/quant.hpp>

namespace kvq::llama {

/// Instruction set of a dot-product kernel.
enum class cpu_isa : uint8_t {
  scalar,  ///< portable C++, every CPU
  avx2,    ///< x86-64 AVX2 + FMA + F16C
};

/// True when this CPU (and this build) can run kernels of `isa`.
bool isa_available(cpu_isa isa);
/// The fastest instruction set available here.
cpu_isa best_isa();
/// "scalar" / "avx2".
const char* isa_name(cpu_isa isa);

/// Activation block of the 32-element weight types: x[j] ~= d * qs[j]; s = d * sum(qs) (the
/// term that Q4_0's offset and Q4_1's min multiply).
///
/// | offset | bytes | field | contents            |
/// |--------|-------|-------|---------------------|
/// | 0      | 4     | d     | f32 scale           |
/// | 4      | 4     | s     | f32 d * sum(qs)     |
/// | 8      | 64    | qs    | int16 codes         |
struct q16_block {
  float d;
  float s;
  int16_t qs[32];
};
static_assert(sizeof(q16_block) == 72, "q16_block is 72 bytes");

/// Activation block of the 256-element ("K") weight types: x[e] ~= d * qs[e]; bsums[g] = sum of
/// qs over elements 16g..16g+15 (what the K types' mins and offsets multiply).
///
/// | offset | bytes | field | contents                       |
/// |--------|-------|-------|--------------------------------|
/// | 0      | 4     | d     | f32 scale                      |
/// | 4      | 64    | bsums | int32 sums of 16-element groups |
/// | 68     | 512   | qs    | int16 codes                    |
struct q16_k_block {
  float d;
  int32_t bsums[16];
  int16_t qs[256];
};
static_assert(sizeof(q16_k_block) == 580, "q16_k_block is 580 bytes");

/// The activation form a weight type's kernel reads.
enum class activation_kind : uint8_t {
  f32,    ///< float row
  q16,    ///< `q16_block` per 32 elements
  q16_k,  ///< `q16_k_block` per 256 elements
  none,   ///< no kernel for this weight type
};

/// The activation a weight type pairs with (`none` for types without a kernel).
activation_kind activation_of(ggml_type t);

/// Bytes of one activation row of `n` elements in form `kind` (n a multiple of its block).
size_t activation_bytes(activation_kind kind, int64_t n);

/// Quantizes `x` [n] into `dst` [activation_bytes(kind, n)] bytes in form `kind`: per block,
/// d = max|x| / 32767 and qs = round(x / d) (all zero for an all-zero block). n must be a
/// multiple of 32 (q16) or 256 (q16_k); kind f32 copies the row.
void quantize_activation(activation_kind kind, const float* x, int64_t n, uint8_t* dst);

/// A dot-product kernel: `w` [n / block_elems][block_bytes] one weight row, `act` one
/// activation row of the matching form (`activation_of`), n elements (a multiple of the weight
/// type's block).
using dot_fn = float (*)(const uint8_t* w, const uint8_t* act, int64_t n);

/// The kernel of weight type `t` in instruction set `isa`, or nullptr when there is none (type
/// without a kernel, or `isa` not available).
dot_fn find_dot(ggml_type t, cpu_isa isa);

/// Four dot products at once: one weight row `w` against the activation rows act, act + stride,
/// act + 2 stride, act + 3 stride, into out[4]; each equal bit for bit to the `dot_fn` of the
/// same type and ISA on that row (the weight's blocks are unpacked once for the four).
using dot4_fn = void (*)(const uint8_t* w, const uint8_t* act, size_t stride, int64_t n, float* out);

/// The four-row kernel of weight type `t` in `isa`, or nullptr (then `matmul` calls the `dot_fn`
/// per row).
dot4_fn find_dot4(ggml_type t, cpu_isa isa);

namespace detail {
/// The kernels of one instruction set, one per weight type with a kernel (four-row kernels:
/// nullptr where there is none).
struct dot_kernels {
  dot_fn f32, f16, q4_0, q4_1, q8_0, q4_k, q6_k;
  dot4_fn q4_0x4 = nullptr, q4_1x4 = nullptr, q8_0x4 = nullptr;
};
/// Per-ISA kernel tables (dot_scalar.cpp, dot_avx2.cpp); the AVX2 one is all nullptr in a build
/// without AVX2 kernels.
dot_kernels scalar_kernels();
dot_kernels avx2_kernels();
}  // namespace detail

}  // namespace kvq::llama
