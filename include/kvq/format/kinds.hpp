#pragma once
/// \file
/// Kernel kinds: the decode kernels compile their inner loop once per *kind*, a (decode family,
/// bits) pair of the staged formats (8 bits or fewer), and store each page's kind in their page
/// table so that a step's dispatch is a byte load. rolealign decodes as kivi, so they share kinds.
///
/// Generated from `format_list` (each type declares `staged` and `decode_as`): kinds are the
/// distinct (decode_as, bits) pairs of its staged types, numbered kivi before sym before fp8
/// before codebook before nvfp4, wider before narrower:
///
/// | kind | 0     | 1     | 2     | 3    | 4    | 5    | 6   | 7   | 8   | 9   |
/// |------|-------|-------|-------|------|------|------|-----|-----|-----|-----|
/// |      | kivi8 | kivi4 | kivi2 | sym8 | sym4 | sym2 | fp8 | cb4 | cb2 | fp4 |
///
/// 16-bit formats have kind -1 (the unstaged path). 3-bit formats are not staged and have kind
/// -1 too: the decode kernels read them by element (`read_by_element`).

#include <kvq/config.hpp>
#include <kvq/format/format.hpp>
#include <kvq/format/registry.hpp>
#include <kvq/format/type_list.hpp>

#include <array>
#include <cstddef>
#include <utility>

KVQ_NAMESPACE_BEGIN

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
    const bool is_staged[] = {Ts::staged...};
    for (size_t i = 0; i < sizeof...(Ts); ++i) {
      bool seen = !is_staged[i];
      for (size_t j = 0; j < n && !seen; ++j) seen = k[j].fam == all[i].fam && k[j].bits == all[i].bits;
      if (!seen) k[n++] = all[i];
    }
    // order: decode family (kivi, sym, fp8: descending in `family`'s order; then codebook, then
    // nvfp4), then bits descending
    const auto rank = [](family f) { return f == family::codebook ? -1 : f == family::nvfp4 ? -2 : int(f); };
    for (size_t i = 1; i < n; ++i)
      for (size_t j = i; j > 0; --j) {
        const decode_class a = k[j - 1], b = k[j];
        if (rank(a.fam) > rank(b.fam) || (a.fam == b.fam && a.bits >= b.bits)) break;
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
  static constexpr int kind_of_type = F::staged ? find(F::decode_as, F::bits, std::make_integer_sequence<int, count>{}) : -1;

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
/// True for the narrow formats without a kind (3-bit sym, kivi, rolealign and codebook):
/// the CUDA decode kernels read their pages unstaged, each element through its codec
/// (cuda/attention/element_read.cuh; docs/architecture.md).
KVQ_HOST_DEVICE constexpr bool read_by_element(const format_traits& f) {
  return kind_of(f) < 0 && f.bits < 16 &&
         (f.fam == family::sym || f.has_zero() || f.fam == family::codebook || f.fam == family::nvfp4);
}
/// True for the formats the CUDA tile and prefix kernels (prefill) read by element: those the
/// decode kernels read by element, every codebook format and nvfp4 (the tile kernels dequantize
/// integer and fp8 codes only; the decode kernels have codebook and nvfp4 kinds).
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
/// `kind_of`): a format with a kind, or a 16-bit one, of at most `cap` bits. Pages read by element
/// are never staged (their kernels read them from global memory where they are used).
KVQ_HOST_DEVICE constexpr bool stages_hold(const format_traits& f, int k, int cap) {
  return f.bits <= cap && (k >= 0 || f.bits == 16);
}
KVQ_HOST_DEVICE constexpr bool stages_hold(format_id id, int cap) { return stages_hold(traits_of(id), kind_of(id), cap); }

/// The code width a page of format `id` counts as in the choice of decode kernel
/// (`cuda::attend_args::max_page_bits`): its bits, or 16 for a format read by element, which
/// only the decode kernels' 16-bit instances (and the tile kernel) read.
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
inline constexpr int kivi8 = kind_v<kivi<8, 32>>, kivi4 = kind_v<kivi<4, 32>>, kivi2 = kind_v<kivi<2, 32>>;
inline constexpr int sym8 = kind_v<sym<8, 32>>, sym4 = kind_v<sym<4, 32>>, sym2 = kind_v<sym<2, 32>>;
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
/// same pairs.
using whole_unit_pairs =
    type_list<kv_types<kivi<4, 32>, kivi<4, 32>>, kv_types<kivi<2, 32>, kivi<2, 32>>, kv_types<kivi<4, 32>, kivi<2, 32>>,
              kv_types<sym<4, 32>, sym<4, 32>>, kv_types<sym<2, 32>, sym<2, 32>>, kv_types<codebook<4, 0>, codebook<4, 0>>,
              kv_types<codebook<2, 0>, codebook<2, 0>>, kv_types<nvfp4, nvfp4>>;

/// The (K, V) kind pairs whose 8-bit-ring chunk loops (two full barriers) are compiled for one
/// pair: kivi8/kivi8, sym8/sym8, fp8/fp8.
using eight_bit_pairs = type_list<kv_types<kivi<8, 32>, kivi<8, 32>>, kv_types<sym<8, 32>, sym<8, 32>>,
                                  kv_types<fp8_e4m3, fp8_e4m3>>;

/// Calls `f.template operator()<KK, KV>()` for the pair of `Pairs` (a `type_list` of `kv_types`)
/// whose `kind_pair` is `combo` and returns true; returns false (calling nothing) when none is.
template <class... K, class... V, class F>
KVQ_HOST_DEVICE constexpr bool visit_kind_pair(type_list<kv_types<K, V>...>, int combo, F&& f) {
  return ((combo == kind_pair(kind_v<K>, kind_v<V>) ? (f.template operator()<kind_v<K>, kind_v<V>>(), true) : false) ||
          ...);
}

/// True when the (K kind, V kind) pair `combo` (`kind_pair`) is one of `Pairs`.
template <class... K, class... V>
KVQ_HOST_DEVICE constexpr bool in_kind_pairs(type_list<kv_types<K, V>...>, int combo) {
  return (false || ... || (combo == kind_pair(kind_v<K>, kind_v<V>)));
}

/// True when the (K kind, V kind) pair `combo` (`kind_pair`) has whole-unit loops.
KVQ_HOST_DEVICE constexpr bool has_whole_units(int combo) { return in_kind_pairs(whole_unit_pairs{}, combo); }

static_assert(kind_count == 10 && kernel_kind::fp4 == 9 && kernel_kind::kivi8 == 0 && kernel_kind::kivi2 == 2 && kernel_kind::sym8 == 3 &&
                  kernel_kind::sym2 == 5 && kernel_kind::fp8 == 6 && kernel_kind::cb4 == 7 && kernel_kind::cb2 == 8 &&
                  kind_v<rolealign<4, 64>> == kernel_kind::kivi4 && kind_v<codebook<4, 32>> == kernel_kind::cb4 &&
                  kind_v<fp16> == -1 && kind_v<sym<3, 32>> == -1 && kind_v<codebook<3, 32>> == -1,
              "the kernels' kind numbering");
static_assert(kernels_read(fp16_format) && kernels_read(format_id_v<kivi<2, 32>>) &&
                  kernels_read(format_id_v<kivi<3, 32>>) && kernels_read(format_id_v<codebook<2, 32>>) &&
                  kernels_read(format_id_v<nvfp4>) && read_by_element(traits_of(format_id_v<sym<3, 32>>)) &&
                  !read_by_element(traits_of(format_id_v<codebook<4, 0>>)) &&
                  tile_reads_by_element(traits_of(format_id_v<codebook<2, 32>>)) &&
                  !read_by_element(traits_of(format_id_v<nvfp4>)) && tile_reads_by_element(traits_of(format_id_v<nvfp4>)) &&
                  !tile_reads_by_element(traits_of(format_id_v<sym<4, 32>>)) &&
                  !read_by_element(traits_of(format_id_v<kivi<4, 32>>)) && !read_by_element(traits_of(fp16_format)),
              "the formats the CUDA kernels read");
/// Every format the kernels read is staged under a stage width of at least its bits unless it is
/// read by element (`stages_hold` and `read_by_element` agree).
constexpr bool stages_hold_agrees() {
  for (size_t i = 0; i < format_count; ++i)
    for (int cap : {2, 4, 8, 16}) {
      const format_traits t = traits_of(format_id(i));
      if (kernels_read(format_id(i)) && stages_hold(format_id(i), cap) != (t.bits <= cap && !read_by_element(t))) return false;
    }
  return true;
}
static_assert(stages_hold_agrees(), "stages_hold: the staged formats are those not read by element");

KVQ_NAMESPACE_END
