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
}  // namespace kind
static_assert(kvq::cuda::kind_of(fp16_format) == kind::wide, "16-bit formats have no kind");
static_assert(kind::staged16 != kind::dispatch && kind::staged16 < 0, "staged16 is no kind and not dispatch");

// The decode families whose staged pages `scores_kind` and `values_kind` read (fp8 and nvfp4 by
// their own paths, codebook by its levels, kivi and sym by the integer path): a kind of any other
// decode family fails to build there.
template <family Fam>
inline constexpr bool staged_family = Fam == family::kivi || Fam == family::sym || Fam == family::fp8_e4m3 ||
                                      Fam == family::codebook || Fam == family::nvfp4;

// Generated `switch` statements over kinds and kind pairs. A switch with named cases, not a fold of
// compares over the pair list: the fold reorders the decode kernel's code and measured 1-3 % slower
// (docs/decisions.md, "The kernels dispatch on kinds through `switch`"). The cases are written by
// index (`KVQ_KIND_CASES`) and take their values from the kinds or the pair lists, so that nothing
// is named by hand; an index past the list's end gets a value no kind code has.
inline constexpr int max_switch_cases = 16;
static_assert(kind_count <= max_switch_cases, "switch_kind writes 16 cases");

#define KVQ_KIND_CASES(CASE)                                                                                            \
  CASE(0) CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) \
  CASE(14) CASE(15)

// The kinds the per-page dispatch reads: every kind but the 3-bit ones (only the chunk loops of
// `three_bit_pairs` read those). Case value of index i: the kind i, or a value no kind has.
template <int I>
inline constexpr bool page_kind = I < kind_count && kind_bits(I) != 3;
template <int I>
inline constexpr int page_kind_case = page_kind<I> ? I : -100 - I;

// Calls `f.template operator()<K>()` for the page kind K == k; nothing for any other k.
template <class F>
__device__ __forceinline__ void switch_kind(int k, F&& f) {
#define KVQ_KIND_CASE(I)                                           \
  case page_kind_case<I>:                                          \
    if constexpr (page_kind<I>) f.template operator()<(I < kind_count ? I : 0)>(); \
    break;
  switch (k) { KVQ_KIND_CASES(KVQ_KIND_CASE) }
#undef KVQ_KIND_CASE
}

// The (K, V) kinds of pair I of a pair list (`kv_types`), and its case value: `kind_pair`, or a
// value no pair has (-1000 x (Tag + 1) - I, Tag telling the lists of one switch apart).
template <class List, int I>
struct pair_at {
  static constexpr bool in = false;
  static constexpr int kk = 0, kv = 0;
};
template <class K, class V, class... Rest>
struct pair_at<type_list<kv_types<K, V>, Rest...>, 0> {
  static constexpr bool in = true;
  static constexpr int kk = kind_v<K>, kv = kind_v<V>;
};
template <class K, class V, class... Rest, int I>
  requires(I > 0)
struct pair_at<type_list<kv_types<K, V>, Rest...>, I> : pair_at<type_list<Rest...>, I - 1> {};
template <class List, int I, int Tag>
inline constexpr int pair_case = pair_at<List, I>::in ? kind_pair(pair_at<List, I>::kk, pair_at<List, I>::kv)
                                                       : -1000 * (Tag + 1) - I;
template <class... Ps>
inline constexpr bool fits_switch = sizeof...(Ps) <= max_switch_cases;

// Calls `a.template operator()<KK, KV>()` for the pair (KK, KV) of list A whose `kind_pair` is
// `combo`, else `b.template operator()<KK, KV>()` for that of list B, else `other()`.
template <class... As, class... Bs, class FA, class FB, class FO>
__device__ __forceinline__ void switch_kind_pairs(int combo, type_list<As...>, FA&& a, type_list<Bs...>, FB&& b,
                                                  FO&& other) {
  using LA = type_list<As...>;
  using LB = type_list<Bs...>;
  static_assert(fits_switch<As...> && fits_switch<Bs...>, "switch_kind_pairs writes 16 cases per list");
#define KVQ_PAIR_CASE_A(I)                                                                      \
  case pair_case<LA, I, 0>:                                                                     \
    if constexpr (pair_at<LA, I>::in) a.template operator()<pair_at<LA, I>::kk, pair_at<LA, I>::kv>(); \
    break;
#define KVQ_PAIR_CASE_B(I)                                                                      \
  case pair_case<LB, I, 1>:                                                                     \
    if constexpr (pair_at<LB, I>::in) b.template operator()<pair_at<LB, I>::kk, pair_at<LB, I>::kv>(); \
    break;
  switch (combo) {
    KVQ_KIND_CASES(KVQ_PAIR_CASE_A)
    KVQ_KIND_CASES(KVQ_PAIR_CASE_B)
    default: other(); break;
  }
#undef KVQ_PAIR_CASE_A
#undef KVQ_PAIR_CASE_B
}
// The same over one list.
template <class... As, class FA, class FO>
__device__ __forceinline__ void switch_kind_pairs(int combo, type_list<As...> la, FA&& a, FO&& other) {
  switch_kind_pairs(combo, la, a, type_list<>{}, [] <int, int>() {}, other);
}

// A block's pages of differing or unstaged kinds (not a `kind_pair`).
inline constexpr int no_combo = -1;
// A block whose pages all have 16-bit K and V in the stages (a stage plan of 16 bits).
inline constexpr int wide_pair = -2;

}  // namespace cuda::detail
KVQ_NAMESPACE_END
