#pragma once
// Kinds of page format of the staged decode kernels: every kind code and kind helper of the
// kernels is here (kernels name kinds through `kind`, never by number).
#include <kvq/format/format.hpp>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// The staged kernel compiles the K part (loads, dequantization, score MMAs) and the V part (loads,
// dequantization, P, output MMAs) once per kind of page format, each a straight run of code with the
// format's family and bits constant (branches inside a slab cost issue slots and split the code the
// scheduler can interleave). 16-bit formats take the unstaged path. The page table cache holds each
// page's kinds, so that a step's dispatch is a byte load, not a chain of compares per step.
namespace kind {
inline constexpr int kivi8 = 0, kivi4 = 1, kivi2 = 2;  // KIVI and RoleAlign (KIVI's layout)
inline constexpr int sym8 = 3, sym4 = 4, sym2 = 5;
inline constexpr int fp8 = 6;
inline constexpr int wide = -1;      // `kind_of` a format of more than 8 bits (and of the FP16 ring)
inline constexpr int dispatch = -1;  // as a kernel template argument: no fixed kind, read per page
}  // namespace kind

// The kind of a format.
__device__ __forceinline__ int kind_of(format_traits f) {
  if (f.bits > 8) return kind::wide;
  const int b = f.bits == 8 ? 0 : f.bits == 4 ? 1 : 2;
  return f.fam == family::fp8_e4m3 ? kind::fp8 : f.fam == family::sym ? kind::sym8 + b : b;  // b: kind::kivi8 + b
}

// The family and bits of a kind (`kind_of`; each integer family has its 8, 4, 2 bits in turn).
constexpr family kind_family(int k) {
  return k == kind::fp8 ? family::fp8_e4m3 : k >= kind::sym8 ? family::sym : family::kivi;
}
constexpr int kind_bits(int k) { return k == kind::fp8 ? 8 : 8 >> (k % 3); }

// A (K kind, V kind) pair as one switch value; `no_combo`: pages of differing or unstaged kinds.
KVQ_HOST_DEVICE constexpr int combo(int k, int v) { return 8 * k + v; }
inline constexpr int no_combo = -1;

// The pairs of 4/2-bit kinds that the block-staged kernel's `Whole` instance runs as whole 64-token
// units (a block whose pages all have one of them).
inline constexpr int kivi4_kivi4 = combo(kind::kivi4, kind::kivi4), kivi2_kivi2 = combo(kind::kivi2, kind::kivi2),
                     kivi4_kivi2 = combo(kind::kivi4, kind::kivi2), sym4_sym4 = combo(kind::sym4, kind::sym4),
                     sym2_sym2 = combo(kind::sym2, kind::sym2);

}  // namespace cuda::detail
KVQ_NAMESPACE_END
