#pragma once
/// \file
/// How the CUDA attention kernels read each format: the one read plan of the CUDA backend, its
/// kernels and the engine-owned API (include/kvq/cuda/paged_attention.hpp), generated from the
/// format list (`format_list`: each type's `decode_as` and bits, `staged_type`). The formats know
/// nothing of it; the CPU backend reads every format.
///
/// - Per format: its *kind* (`kind_of`), a (decode family, bits) pair of the staged formats that
///   the decode kernels compile their inner loops for, or -1; whether the kernels read it at all
///   (`kernels_read`), by element through its codec (`read_by_element`, `tile_reads_by_element`),
///   and in which stage widths (`stages_hold`, `staged_kind`).
/// - Per layer: the code width the decode kernel is chosen for (`kernel_bits`, `head_kernel_bits`:
///   the hint `attend_args::max_page_bits`), computed by the CUDA backend as pages are written and
///   by an engine for its own pages, and passed down to the launch plan (cuda/launch_plan.cpp),
///   which fixes the stage width from which the page table gives each page its kind.
/// - The kernels' switches over kinds and (K, V) kind pairs are written by hand, each case label
///   checked against these lists at compile time (`listed_kind`, `listed_pair` in
///   cuda/attention/kinds.cuh, with each switch's list counted beside it), and every kind must be
///   in the pair list of its width (`pair_lists_cover_kinds`), so that a new format gets its kind's
///   code or fails to build, never a silent fallback.
///
/// Kinds are the distinct (decode_as, bits) pairs of the staged types, the 3-bit ones last; within
/// each part numbered kivi before sym before fp8 before codebook before nvfp4, wider before
/// narrower. rolealign decodes as kivi, so they share kinds:
///
/// | kind | 0     | 1     | 2     | 3    | 4    | 5    | 6   | 7   | 8   | 9   | 10    | 11   |
/// |------|-------|-------|-------|------|------|------|-----|-----|-----|-----|-------|------|
/// |      | kivi8 | kivi4 | kivi2 | sym8 | sym4 | sym2 | fp8 | cb4 | cb2 | fp4 | kivi3 | sym3 |
///
/// 16-bit formats have kind -1 (the unstaged path). The 3-bit codebooks have no kind either: the
/// decode kernels read them by element. The 3-bit kinds (kivi3, sym3) are read by the chunk loops
/// compiled for a block whose pages all hold one pair kivi3/kivi3 or sym3/sym3 (`three_bit_pairs`:
/// in the block-staged kernel's Whole instance and its Three instances; kivi4 K + kivi3 V,
/// `three_bit_mixed_pairs`, in those of one full barrier) and by the per-page dispatch of the Three
/// instances only (block-staged and per-warp, `kind::dispatch3`: layers whose 3-bit pages are among
/// other formats or too large for 3 page stages, `attend_args::three_bit_pages`); a 16-bit stage
/// plan reads a 3-bit page by element. (Numbered last, they leave the other kinds' numbers, and so the plain dispatch's code,
/// as they were without them.)

#include <kvq/config.hpp>
#include <kvq/format/format.hpp>
#include <kvq/format/registry.hpp>
#include <kvq/format/type_list.hpp>

#include <array>
#include <cstddef>
#include <utility>

KVQ_NAMESPACE_BEGIN
namespace cuda {

/// True for the format types whose pages the decode kernels stage (and so have a kind): every one
/// narrower than 16 bits but the 3-bit codebooks (eight levels: no byte-permute lookup of two
/// words), which they read by element.
template <class F>
inline constexpr bool staged_type = F::bits < 16 && !(F::decode_as == family::codebook && F::bits == 3);

/// How a decode kernel reads a staged format: its decode family and bit width.
struct decode_class {
  family fam;
  int bits;
};

template <class List>
struct kernel_kinds;

/// The kinds of one list of format types (see the file comment).
template <class... Ts>
struct kernel_kinds<type_list<Ts...>> {
 private:
  static constexpr auto make() {
    std::array<decode_class, sizeof...(Ts)> k{};
    size_t n = 0;
    const decode_class all[] = {decode_class{Ts::decode_as, Ts::bits}...};
    const bool is_staged[] = {staged_type<Ts>...};
    for (size_t i = 0; i < sizeof...(Ts); ++i) {
      bool seen = !is_staged[i];
      for (size_t j = 0; j < n && !seen; ++j) seen = k[j].fam == all[i].fam && k[j].bits == all[i].bits;
      if (!seen) k[n++] = all[i];
    }
    // order: the 3-bit kinds last; within each part decode family (kivi, sym, fp8: descending in
    // `family`'s order; then codebook, then nvfp4), then bits descending
    const auto rank = [](family f) { return f == family::codebook ? -1 : f == family::nvfp4 ? -2 : int(f); };
    const auto before = [&](decode_class a, decode_class b) {
      if ((a.bits == 3) != (b.bits == 3)) return b.bits == 3;
      return rank(a.fam) > rank(b.fam) || (a.fam == b.fam && a.bits >= b.bits);
    };
    for (size_t i = 1; i < n; ++i)
      for (size_t j = i; j > 0; --j) {
        const decode_class a = k[j - 1], b = k[j];
        if (before(a, b)) break;
        k[j - 1] = b, k[j] = a;
      }
    return std::pair{k, n};
  }
  static constexpr auto made = make();
  template <int K>
  static constexpr family fam_at = made.first[K].fam;
  template <int K>
  static constexpr int bits_at = made.first[K].bits;

  template <int... Ks>
  KVQ_HOST_DEVICE static constexpr int find(family decode_fam, int bits, std::integer_sequence<int, Ks...>) {
    int k = -1;
    ((k = decode_fam == fam_at<Ks> && bits == bits_at<Ks> ? Ks : k), ...);
    return k;
  }
  template <class... Hs>
  KVQ_HOST_DEVICE static constexpr family decode_family(family fam, type_list<Hs...>) {
    family d = fam;
    ((d = fam == Hs::fam ? Hs::decode_as : d), ...);
    return d;
  }

 public:
  /// Number of kinds.
  static constexpr int count = int(made.second);
  /// Kind of a format's traits, or -1 for a format the kernels read unstaged (its decode family
  /// and bits are no staged type's).
  KVQ_HOST_DEVICE static constexpr int kind_of(const format_traits& f) {
    using heads = typename family_heads<type_list<Ts...>>::type;
    return find(decode_family(f.fam, heads{}), f.bits, std::make_integer_sequence<int, count>{});
  }
  /// Decode family of kind k (0 <= k < count).
  KVQ_HOST_DEVICE static constexpr family kind_family(int k) { return family_of(k, std::make_integer_sequence<int, count>{}); }
  /// Bit width of kind k (0 <= k < count).
  KVQ_HOST_DEVICE static constexpr int kind_bits(int k) { return bits_of(k, std::make_integer_sequence<int, count>{}); }
  /// Kind of format type F, or -1.
  template <class F>
  static constexpr int kind_of_type = staged_type<F> ? find(F::decode_as, F::bits, std::make_integer_sequence<int, count>{}) : -1;

 private:
  template <int... Ks>
  KVQ_HOST_DEVICE static constexpr family family_of(int k, std::integer_sequence<int, Ks...>) {
    family f = fam_at<0>;
    ((f = k == Ks ? fam_at<Ks> : f), ...);
    return f;
  }
  template <int... Ks>
  KVQ_HOST_DEVICE static constexpr int bits_of(int k, std::integer_sequence<int, Ks...>) {
    int b = bits_at<0>;
    ((b = k == Ks ? bits_at<Ks> : b), ...);
    return b;
  }
};

/// The kinds of kvq's formats.
using format_kinds = kernel_kinds<format_list>;

/// Number of kernel kinds.
inline constexpr int kind_count = format_kinds::count;

/// Kind of a format (-1: read unstaged); host and device.
KVQ_HOST_DEVICE constexpr int kind_of(const format_traits& f) { return format_kinds::kind_of(f); }
KVQ_HOST_DEVICE constexpr int kind_of(format_id id) { return format_kinds::kind_of(traits_of(id)); }
/// True for the narrow formats the CUDA decode kernels read unstaged, each element through its
/// codec (cuda/attention/element_read.cuh; docs/architecture.md), in their 16-bit instances: those
/// without a kind (the 3-bit codebooks) and, outside the instances with code for the 3-bit kinds
/// (`three_bit_pairs`, `attend_args::three_bit_pages`), every other 3-bit format.
KVQ_HOST_DEVICE constexpr bool read_by_element(const format_traits& f) {
  return (kind_of(f) < 0 || f.bits == 3) && f.bits < 16 &&
         (f.fam == family::sym || f.has_zero() || f.fam == family::codebook || f.fam == family::nvfp4);
}
/// True for the formats the CUDA tile and prefix kernels (prefill) read by element: every 3-bit
/// format, every codebook format and nvfp4 (the tile kernels dequantize 8-, 4- and 2-bit integer
/// codes and fp8 only).
KVQ_HOST_DEVICE constexpr bool tile_reads_by_element(const format_traits& f) {
  return read_by_element(f) || ((f.fam == family::codebook || f.fam == family::nvfp4) && f.bits < 16);
}
/// True for the formats the CUDA attention kernels read: those with a kind, the 16-bit ones and
/// those read by element (a format of none of these is refused at append; the CPU backend reads
/// every format).
KVQ_HOST_DEVICE constexpr bool kernels_read(format_id id) {
  return kind_of(id) >= 0 || traits_of(id).bits == 16 || read_by_element(traits_of(id));
}
/// True where the decode kernels' stages of `cap` bits hold a page of format f (kind k, from
/// `kind_of`): a format with a kind, or a 16-bit one, of at most `cap` bits; a 3-bit one in stages
/// of 3, 4 or 8 bits only (the 16-bit instances read it by element). Pages read by element are never
/// staged (their kernels read them from global memory where they are used).
KVQ_HOST_DEVICE constexpr bool stages_hold(const format_traits& f, int k, int cap) {
  return f.bits <= cap && (k >= 0 || f.bits == 16) && !(f.bits == 3 && cap == 16);
}
/// The kind a decode kernel of stage width `cap` gives a page of format f in its page table: its
/// kind, or -1 (`kind::wide`: 16-bit, or read by element) where 16-bit stages do not hold it.
KVQ_HOST_DEVICE constexpr int staged_kind(const format_traits& f, int cap) {
  const int k = kind_of(f);
  return stages_hold(f, k, cap) || f.bits == 16 ? k : -1;
}
KVQ_HOST_DEVICE constexpr bool stages_hold(format_id id, int cap) { return stages_hold(traits_of(id), kind_of(id), cap); }

/// The code width a page of format `id` counts as in the choice of decode kernel
/// (`cuda::attend_args::max_page_bits`): its bits, or 16 for a format read by element, which
/// only the decode kernels' 16-bit instances (and the tile kernel) read (`head_kernel_bits` for the
/// heads whose 3-bit pages the kinds kivi3 and sym3 may read).
KVQ_HOST_DEVICE constexpr int kernel_bits(format_id id) {
  return read_by_element(traits_of(id)) ? 16 : int(traits_of(id).bits);
}
/// Decode family of kind k: `family::kivi` (kivi and rolealign), `family::sym` or `family::fp8_e4m3`.
KVQ_HOST_DEVICE constexpr family kind_family(int k) { return format_kinds::kind_family(k); }
/// Bit width of kind k.
KVQ_HOST_DEVICE constexpr int kind_bits(int k) { return format_kinds::kind_bits(k); }

/// Kind of format type F, usable as a `case` label: `case kind_v<kivi<4, 32>>:`.
template <class F>
inline constexpr int kind_v = format_kinds::kind_of_type<F>;

/// The kinds by name.
namespace kernel_kind {
inline constexpr int kivi8 = kind_v<kivi<8, 32>>, kivi4 = kind_v<kivi<4, 32>>, kivi3 = kind_v<kivi<3, 32>>,
                     kivi2 = kind_v<kivi<2, 32>>;
inline constexpr int sym8 = kind_v<sym<8, 32>>, sym4 = kind_v<sym<4, 32>>, sym3 = kind_v<sym<3, 32>>, sym2 = kind_v<sym<2, 32>>;
inline constexpr int fp8 = kind_v<fp8_e4m3>;
inline constexpr int cb4 = kind_v<codebook<4, 0>>, cb2 = kind_v<codebook<2, 0>>;
inline constexpr int fp4 = kind_v<kvq::nvfp4>;
}  // namespace kernel_kind

/// One code for a (K kind, V kind) pair, usable as a `case` label.
KVQ_HOST_DEVICE constexpr int kind_pair(int k, int v) { return 16 * k + v; }
static_assert(kind_count <= 16, "kind_pair packs a kind in 4 bits");

/// A (K format, V format) pair of types.
template <class K, class V>
struct kv_types {};

/// The (K, V) kind pairs whose decode kernels have whole 64-token-unit loops (pages whose K and V
/// kinds are one of these pairs): kivi4/kivi4, kivi2/kivi2, kivi4 K + kivi2 V, sym4/sym4,
/// sym2/sym2, cb4/cb4, cb2/cb2, fp4/fp4. The 4- and 2-bit rings' chunk loops are compiled for the
/// same pairs; the Whole instance also has chunk loops (only) for `three_bit_pairs`.
using whole_unit_pairs =
    type_list<kv_types<kivi<4, 32>, kivi<4, 32>>, kv_types<kivi<2, 32>, kivi<2, 32>>, kv_types<kivi<4, 32>, kivi<2, 32>>,
              kv_types<sym<4, 32>, sym<4, 32>>, kv_types<sym<2, 32>, sym<2, 32>>, kv_types<codebook<4, 0>, codebook<4, 0>>,
              kv_types<codebook<2, 0>, codebook<2, 0>>, kv_types<nvfp4, nvfp4>>;

/// The (K, V) kind pairs whose 8-bit-ring chunk loops (two full barriers) are compiled for one
/// pair: kivi8/kivi8, sym8/sym8, fp8/fp8.
using eight_bit_pairs = type_list<kv_types<kivi<8, 32>, kivi<8, 32>>, kv_types<sym<8, 32>, sym<8, 32>>,
                                  kv_types<fp8_e4m3, fp8_e4m3>>;

/// True when the (K kind, V kind) pair `combo` (`kind_pair`) is one of `Pairs`.
template <class... K, class... V>
KVQ_HOST_DEVICE constexpr bool in_kind_pairs(type_list<kv_types<K, V>...>, int combo) {
  return (false || ... || (combo == kind_pair(kind_v<K>, kind_v<V>)));
}

/// True when the (K kind, V kind) pair `combo` (`kind_pair`) has whole-unit loops.
KVQ_HOST_DEVICE constexpr bool has_whole_units(int combo) { return in_kind_pairs(whole_unit_pairs{}, combo); }

/// The (K, V) kind pairs of 3-bit pages that the block-staged decode kernel reads staged, in chunk
/// loops compiled for them, when every page of a block (one kv head of one sequence) holds the pair:
/// kivi3/kivi3 (and rolealign), sym3/sym3.
using three_bit_pairs = type_list<kv_types<kivi<3, 32>, kivi<3, 32>>, kv_types<sym<3, 32>, sym<3, 32>>>;

/// The (K, V) kind pairs of a 3-bit kind beside a wider one whose chunk loops the block-staged
/// kernel's Three instances of one full barrier per stage compile (`attend_args::three_bit_pages`;
/// the pair's 4-bit stages never need two), for a block whose pages all hold the pair: kivi4 K +
/// kivi3 V (KIVI's keys a bit wider than its values). Other such pairs dispatch on each page's
/// kinds.
using three_bit_mixed_pairs = type_list<kv_types<kivi<4, 32>, kivi<3, 32>>>;

/// True for the formats of the 3-bit kinds (kivi3, sym3: kivi and sym at 3 bits),
/// which the decode kernels read staged where the plan gives them an instance with code for them
/// (`attend_args::three_bit_pages`), else by element.
KVQ_HOST_DEVICE constexpr bool three_bit_kind(format_id id) { return kind_of(id) >= 0 && traits_of(id).bits == 3; }

/// The code width a page of format `id` counts as in `attend_args::max_page_bits` when the call
/// sets `three_bit_pages`: 3 for a format of a 3-bit kind (read staged, by the instances whose
/// per-page dispatch has 3-bit cases), else `kernel_bits`.
KVQ_HOST_DEVICE constexpr int three_bit_kernel_bits(format_id id) { return three_bit_kind(id) ? 3 : kernel_bits(id); }

/// The code width a kv head's pages of one (K, V) pair count as in the choice of decode kernel
/// when every page of the head holds that pair: 3 for a pair of `three_bit_pairs` (read staged by
/// the block-staged kernel's chunk loops, in stages of 3 bits, or 4 beside 4-bit heads; where
/// page-heads leave room for fewer than 3 page stages, the per-warp kernel's Three instance), else
/// the wider `kernel_bits` (a 4-bit K beside a 3-bit V: `three_bit_mixed_pairs`, read staged under
/// `attend_args::three_bit_pages`).
KVQ_HOST_DEVICE constexpr int head_kernel_bits(format_id k, format_id v) {
  if (in_kind_pairs(three_bit_pairs{}, kind_pair(kind_of(k), kind_of(v)))) return 3;
  return kernel_bits(k) > kernel_bits(v) ? kernel_bits(k) : kernel_bits(v);
}

static_assert(three_bit_kind(format_id_v<kivi<3, 32>>) && three_bit_kind(format_id_v<sym<3, 0>>) &&
                  !three_bit_kind(format_id_v<codebook<3, 32>>) &&
                  !three_bit_kind(format_id_v<kivi<4, 32>>) && three_bit_kernel_bits(format_id_v<sym<3, 32>>) == 3 &&
                  three_bit_kernel_bits(format_id_v<codebook<3, 32>>) == 16 &&
                  three_bit_kernel_bits(format_id_v<kivi<8, 32>>) == 8 && three_bit_kernel_bits(fp16_format) == 16,
              "three_bit_pages counts the 3-bit kinds only at 3 bits");

/// Every kind has the loops of its code width: its (K, K) pair is in `whole_unit_pairs` (4 and 2
/// bits), `eight_bit_pairs` (8 bits) or `three_bit_pairs` (3 bits). A new staged format whose kind
/// is in none fails this check instead of falling into the per-page dispatch's slower loops.
constexpr bool pair_lists_cover_kinds() {
  for (int k = 0; k < kind_count; ++k) {
    const int b = kind_bits(k), c = kind_pair(k, k);
    const bool listed = b == 8   ? in_kind_pairs(eight_bit_pairs{}, c)
                        : b == 3 ? in_kind_pairs(three_bit_pairs{}, c)
                                 : in_kind_pairs(whole_unit_pairs{}, c);
    if (!listed || (b != 4 && b != 2 && b != 8 && b != 3)) return false;
  }
  return true;
}
static_assert(pair_lists_cover_kinds(), "a kind without the loops of its width: add its (K, K) pair to the list of its bits");

/// True when some format of family `fam` is read by element by the decode or tile kernels (the
/// families whose codec `cuda::detail::with_element_codec` compiles).
KVQ_HOST_DEVICE constexpr bool family_read_by_element(family fam) {
  for (size_t i = 0; i < format_count; ++i)
    if (traits_of(format_id(i)).fam == fam && tile_reads_by_element(traits_of(format_id(i)))) return true;
  return false;
}

static_assert(kind_count == 12 && kernel_kind::kivi8 == 0 && kernel_kind::kivi2 == 2 && kernel_kind::sym8 == 3 &&
                  kernel_kind::sym2 == 5 && kernel_kind::fp8 == 6 && kernel_kind::cb4 == 7 && kernel_kind::cb2 == 8 &&
                  kernel_kind::fp4 == 9 && kernel_kind::kivi3 == 10 && kernel_kind::sym3 == 11 &&
                  kind_v<rolealign<4, 64>> == kernel_kind::kivi4 &&
                  kind_v<codebook<4, 32>> == kernel_kind::cb4 && kind_v<fp16> == -1 && kind_v<sym<3, 64>> == kernel_kind::sym3 &&
                  kind_v<codebook<3, 32>> == -1,
              "the kernels' kind numbering");
static_assert(kernels_read(fp16_format) && kernels_read(format_id_v<kivi<2, 32>>) &&
                  kernels_read(format_id_v<kivi<3, 32>>) && kernels_read(format_id_v<codebook<2, 32>>) &&
                  kernels_read(format_id_v<nvfp4>) && read_by_element(traits_of(format_id_v<sym<3, 32>>)) &&
                  read_by_element(traits_of(format_id_v<codebook<3, 32>>)) &&
                  tile_reads_by_element(traits_of(format_id_v<sym<3, 32>>)) &&
                  tile_reads_by_element(traits_of(format_id_v<kivi<3, 64>>)) &&
                  !read_by_element(traits_of(format_id_v<codebook<4, 0>>)) &&
                  tile_reads_by_element(traits_of(format_id_v<codebook<2, 32>>)) &&
                  !read_by_element(traits_of(format_id_v<nvfp4>)) && tile_reads_by_element(traits_of(format_id_v<nvfp4>)) &&
                  !tile_reads_by_element(traits_of(format_id_v<sym<4, 32>>)) &&
                  !read_by_element(traits_of(format_id_v<kivi<4, 32>>)) && !read_by_element(traits_of(fp16_format)),
              "the formats the CUDA kernels read");
/// Every format the kernels read is staged under a stage width of at least its bits unless it is
/// read by element, the 3-bit kinds in stages of 3, 4 and 8 bits (`stages_hold` and
/// `read_by_element` agree).
constexpr bool stages_hold_agrees() {
  for (size_t i = 0; i < format_count; ++i)
    for (int cap : {2, 3, 4, 8, 16}) {
      const format_traits t = traits_of(format_id(i));
      const bool staged = t.bits <= cap && (!read_by_element(t) || (t.bits == 3 && kind_of(t) >= 0 && cap < 16));
      if (kernels_read(format_id(i)) && stages_hold(format_id(i), cap) != staged) return false;
    }
  return true;
}
static_assert(stages_hold_agrees(), "stages_hold: the staged formats are those not read by element");
static_assert(head_kernel_bits(format_id_v<kivi<3, 32>>, format_id_v<kivi<3, 128>>) == 3 &&
                  head_kernel_bits(format_id_v<sym<3, 0>>, format_id_v<sym<3, 64>>) == 3 &&
                  head_kernel_bits(format_id_v<kivi<3, 32>>, format_id_v<sym<3, 32>>) == 16 &&
                  head_kernel_bits(format_id_v<kivi<4, 32>>, format_id_v<kivi<2, 32>>) == 4 &&
                  kernel_bits(format_id_v<kivi<3, 32>>) == 16 && staged_kind(traits_of(format_id_v<sym<3, 32>>), 3) == kernel_kind::sym3 &&
                  staged_kind(traits_of(format_id_v<sym<3, 32>>), 4) == kernel_kind::sym3 &&
                  staged_kind(traits_of(format_id_v<kivi<4, 32>>), 3) == -1 &&
                  staged_kind(traits_of(format_id_v<sym<3, 32>>), 16) == -1 && staged_kind(traits_of(fp16_format), 16) == -1 &&
                  staged_kind(traits_of(format_id_v<kivi<4, 32>>), 16) == 1,
              "3-bit kinds: staged in stages of 3, 4 and 8 bits only, read by element in 16-bit ones");

}  // namespace cuda
KVQ_NAMESPACE_END
