#pragma once
/// \file
/// The vocabulary of formats: families, the runtime traits of one format and the section
/// sizes of a page. The formats themselves are types (`format/float_formats.hpp`,
/// `format/sym.hpp`, `format/kivi.hpp`, `format/codebook.hpp`, `format/nvfp4.hpp`);
/// `format/format.hpp` lists them.

#include <kvq/config.hpp>
#include <kvq/core.hpp>  // role

#include <cstdint>

KVQ_NAMESPACE_BEGIN

/// Format families (docs/architecture.md). The value is stored in `format_traits`; a family
/// defined outside the library may use any other value.
enum class family : uint8_t { fp16, bf16, fp8_e4m3, sym, kivi, rolealign, codebook, nvfp4 };

/// Runtime traits of one format. `group` is G (tokens) for the K of kivi/rolealign and g
/// (channels) otherwise; 0 means "the whole head" (g = head_dim) for `sym` and `codebook`;
/// `nvfp4` blocks are 16 channels.
struct format_traits {
  family fam;
  uint8_t bits;   ///< code bits per element
  uint16_t group;  ///< group size, see above; 0 = head_dim (sym, codebook), 1 for fp16/bf16/fp8
  /// True when the family stores a zero point (asymmetric).
  constexpr bool has_zero() const { return fam == family::kivi || fam == family::rolealign; }
  /// True for the families whose K groups run along tokens.
  constexpr bool k_along_tokens() const { return has_zero(); }
  constexpr bool is_integer() const { return fam == family::sym || has_zero(); }
  /// True for the families with one scale per token per channel group (sym, codebook).
  constexpr bool channel_groups() const { return fam == family::sym || fam == family::codebook; }
};

/// Index into `format_table`. Stored in every page; small enough for a byte.
using format_id = uint8_t;

/// Effective group size in channels or tokens (resolves g = 0 to head_dim).
KVQ_HOST_DEVICE constexpr int group_of(const format_traits& t, int head_dim) { return t.group == 0 ? head_dim : t.group; }

/// Byte sizes of the sections of one page: codes, then scales, then zeros, each 16-byte aligned
/// for head_dim a multiple of 32.
struct page_layout {
  uint32_t code_bytes = 0;   ///< offset of the scales
  uint32_t scale_bytes = 0;  ///< size of the scale section
  uint32_t zero_bytes = 0;   ///< size of the zero section (follows the scales)
  constexpr uint32_t total() const { return code_bytes + scale_bytes + zero_bytes; }
  /// Offset of the zero section.
  constexpr uint32_t zero_offset() const { return code_bytes + scale_bytes; }
};

KVQ_NAMESPACE_END
