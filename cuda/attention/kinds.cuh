#pragma once
// Kinds of page format of the staged decode kernels. The kinds, their family and bits, and the
// (K kind, V kind) pairs with loops of their own come from the format type list
// (include/kvq/format/kinds.hpp); kernels name kinds through `kind`, never by number.
#include <kvq/format/kinds.hpp>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// The staged kernel compiles the K part (loads, dequantization, score MMAs) and the V part (loads,
// dequantization, P, output MMAs) once per kind of page format, each a straight run of code with the
// format's family and bits constant (branches inside a slab cost issue slots and split the code the
// scheduler can interleave). 16-bit formats in the stages have code of their own (`kind::staged16`,
// `wide_pair`). The page table cache holds each
// page's kinds (`kvq::kind_of`), so that a step's dispatch is a byte load, not a chain of compares
// per step.
namespace kind {
using namespace kvq::kernel_kind;    // kivi8, kivi4, kivi2 (KIVI and RoleAlign), sym8, sym4, sym2, fp8, cb4, cb2, fp4 (nvfp4)
inline constexpr int wide = -1;      // `kind_of` a format without a kind: 16-bit ones (and the FP16 ring), those read by element
inline constexpr int dispatch = -1;  // as a kernel template argument: no fixed kind, read per page
inline constexpr int staged16 = -2;  // as a kernel template argument: 16-bit pages in the stages
}  // namespace kind
static_assert(kvq::kind_of(fp16_format) == kind::wide, "16-bit formats have no kind");
static_assert(kind::staged16 != kind::dispatch && kind::staged16 < 0, "staged16 is no kind and not dispatch");

// A block's pages of differing or unstaged kinds (not a `kind_pair`).
inline constexpr int no_combo = -1;
// A block whose pages all have 16-bit K and V in the stages (a stage plan of 16 bits).
inline constexpr int wide_pair = -2;

}  // namespace cuda::detail
KVQ_NAMESPACE_END
