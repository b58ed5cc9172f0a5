#pragma once
// Kinds of page format of the staged decode kernels. The kinds, their family and bits, and the
// (K kind, V kind) pairs with loops of their own come from the format type list
// (include/kvq/cuda/read_plan.hpp); kernels name kinds through `kind`, never by number.
#include <kvq/cuda/read_plan.hpp>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// The staged kernel compiles the K part (loads, dequantization, score MMAs) and the V part (loads,
// dequantization, P, output MMAs) once per kind of page format, each a straight run of code with the
// format's family and bits constant (branches inside a slab cost issue slots and split the code the
// scheduler can interleave). 16-bit formats in the stages have code of their own (`kind::staged16`,
// `wide_pair`). The page table cache holds each
// page's kinds (`kvq::cuda::kind_of`), so that a step's dispatch is a byte load, not a chain of compares
// per step.
namespace kind {
using namespace kvq::cuda::kernel_kind;    // kivi8, kivi4, kivi2 (KIVI and RoleAlign), sym8, sym4, sym2, fp8, cb4, cb2, fp4 (nvfp4)
inline constexpr int wide = -1;      // `kind_of` a format without a kind: 16-bit ones (and the FP16 ring), those read by element
inline constexpr int dispatch = -1;  // as a kernel template argument: no fixed kind, read per page
inline constexpr int staged16 = -2;  // as a kernel template argument: 16-bit pages in the stages
inline constexpr int dispatch3 = -3;  // as a kernel template argument: read per page, 3-bit kinds included
                                      // (the Three instances: `attend_args::three_bit_pages`)
}  // namespace kind
// True for the kernel template arguments that read each page by its own kinds.
KVQ_HOST_DEVICE constexpr bool per_page(int k) { return k == kind::dispatch || k == kind::dispatch3; }
static_assert(kvq::cuda::kind_of(fp16_format) == kind::wide, "16-bit formats have no kind");
static_assert(kind::staged16 != kind::dispatch && kind::staged16 < 0 && kind::dispatch3 < 0 && !per_page(kind::staged16),
              "staged16 and dispatch3 are no kinds; staged16 is no dispatch");

// The decode families whose staged pages `scores_kind` and `values_kind` read (fp8 and nvfp4 by
// their own paths, codebook by its levels, kivi and sym by the integer path): a kind of any other
// decode family fails to build there.
template <family Fam>
inline constexpr bool staged_family = Fam == family::kivi || Fam == family::sym || Fam == family::fp8_e4m3 ||
                                      Fam == family::codebook || Fam == family::nvfp4;

// Case labels of the kernels' switches over kinds and kind pairs, checked at compile time against
// the read plan (include/kvq/cuda/read_plan.hpp), so that a new kind or pair fails to build until
// its case is written. A switch with named cases, not a dispatcher over the lists: a fold of
// compares, and a switch generated through wrapper lambdas, each measured slower (docs/decisions.md,
// "The kernels dispatch on kinds through `switch`").
// - `listed_pair<List, K, V>`: the `kind_pair` of (K, V), which must be in `List`;
// - `listed_kind<K>`: kind K, which must be a kind of the plain per-page dispatch (not 3-bit: the
//   chunk loops of `three_bit_pairs` and the Three instances' dispatch read those, `three_kind<K>`);
// - beside each switch, a `static_assert` that it has as many cases as its list has entries.
template <class List, int K, int V>
  requires(in_kind_pairs(List{}, kind_pair(K, V)))
inline constexpr int listed_pair = kind_pair(K, V);

template <int K>
inline constexpr bool page_kind = K >= 0 && K < kind_count && kind_bits(K) != 3;
template <int K>
  requires(page_kind<K>)
inline constexpr int listed_kind = K;
template <int K>
  requires(K >= 0 && K < kind_count && kind_bits(K) == 3)
inline constexpr int three_kind = K;
// The number of kinds of the plain per-page dispatch.
inline constexpr int page_kind_count = [] {
  int n = 0;
  for (int k = 0; k < kind_count; ++k) n += kind_bits(k) != 3;
  return n;
}();

// A block's pages of differing or unstaged kinds (not a `kind_pair`).
inline constexpr int no_combo = -1;
// A block whose pages all have 16-bit K and V in the stages (a stage plan of 16 bits).
inline constexpr int wide_pair = -2;

}  // namespace cuda::detail
KVQ_NAMESPACE_END
