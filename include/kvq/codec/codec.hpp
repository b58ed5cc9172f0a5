#pragma once
/// \file
/// The codec of every format: encode and decode of one *unit* of a page, `KVQ_HOST_DEVICE`, used
/// unchanged by the CPU reference (a loop over units) and by the CUDA append kernel (a thread per
/// unit), so the two write identical bytes. Each format type owns its codec (format/*.hpp, where
/// each file documents its units and math); these functions dispatch on the page's family through
/// `format_list` (format/registry.hpp).
///
/// All quantization math is float32 with every step correctly rounded; on the device through the
/// `__f*_rn` intrinsics so that no fused multiply-add changes a bit (format/unit_codec.hpp). Inputs are
/// fp16 (the recent window's precision) and finite: callers validate before encoding.

#include <cstdint>
#include <kvq/format/unit_codec.hpp>
#include <kvq/config.hpp>
#include <kvq/format/format.hpp>

KVQ_NAMESPACE_BEGIN
namespace codec {

/// Builds the geometry of a page of format `id` (host or device).
KVQ_HOST_DEVICE page_geom make_geom(format_id id, role r, int page_tokens, int head_dim) {
  return formats::geom(id, r, page_tokens, head_dim);
}

/// The rolealign clip percentile that clips nothing: each group's range is its min and max.
inline constexpr float no_clip = 100.0f;

/// The largest group of a rolealign format: the group clip percentiles are checked against.
KVQ_HOST_DEVICE constexpr int largest_rolealign_group() {
  int m = 0;
  for (int f = 0; f < int(format_count); ++f)
    if (traits_of(format_id(f)).fam == family::rolealign && traits_of(format_id(f)).group > m)
      m = traits_of(format_id(f)).group;
  return m;
}
inline constexpr int max_rolealign_group = largest_rolealign_group();
static_assert(max_rolealign_group == 128);

/// Encodes unit `u` of a page (units: `page_geom::unit_count`).
/// \param src  [page_tokens][src_stride] fp16 bits; row t is token t of the page
/// \param page the page's bytes (layout in the format's header)
/// \param pct  rolealign clip percentile in [50, 100] (`no_clip`: none); ignored by other families
KVQ_HOST_DEVICE void encode_unit(const page_geom& g, const uint16_t* src, int src_stride, int u, uint8_t* page,
                                 float pct) {
  formats::encode_unit(g, src, src_stride, u, page, pct);
}

/// The codebook formats are the contiguous ids [first_codebook_format, + codebook_format_count):
/// a cache keeps, per (layer, kv head, role), one slot of `codebook_slot_floats` levels for each
/// (`KVCache::set_codebook_levels`; 2^bits of a slot are used).
inline constexpr format_id first_codebook_format = format_id_v<codebook<4, 32>>;
inline constexpr int codebook_format_count = 12;
inline constexpr int codebook_slot_floats = 16;
static_assert(format_id_v<codebook<2, 0>> == first_codebook_format + codebook_format_count - 1,
              "the codebook formats are contiguous in format_list");
/// True for a codebook format id; its slot is `f - first_codebook_format`.
KVQ_HOST_DEVICE constexpr bool is_codebook_format(format_id f) {
  return f >= first_codebook_format && f < first_codebook_format + codebook_format_count;
}
/// Offset of codebook format f's levels in a table of `codebook_slot_floats`-float slots,
/// [units][codebook formats][codebook_slot_floats], at unit `unit` (a (layer, kv head, role) of
/// a cache, or a (kv head, role) of one layer's table).
KVQ_HOST_DEVICE constexpr size_t codebook_level_offset(size_t unit, format_id f) {
  return (unit * size_t(codebook_format_count) + size_t(f - first_codebook_format)) * size_t(codebook_slot_floats);
}

/// What a cache holds per (layer, kv head, role) for the encoder besides the format: the rolealign
/// clip percentile and a codebook page's levels.
struct encode_params {
  float clip = no_clip;           ///< rolealign clip percentile in [50, 100]; ignored by other families
  const float* levels = nullptr;  ///< codebook: the page format's 2^bits levels; null: Lloyd-Max
};

/// `encode_unit` with the cache's parameters: a codebook page with levels given is encoded with
/// them (`codebook_codec::encode_unit_with`; they are written into the page), else as above.
KVQ_HOST_DEVICE void encode_unit(const page_geom& g, const uint16_t* src, int src_stride, int u, uint8_t* page,
                                 const encode_params& e) {
  if (e.levels != nullptr && g.fmt.fam == family::codebook)
    codebook_codec::encode_unit_with(g, src, src_stride, u, page, e.levels);
  else
    formats::encode_unit(g, src, src_stride, u, page, e.clip);
}

/// Decodes element (t, c) of a page to float. The reference path: plain and obviously right.
KVQ_HOST_DEVICE float decode_element(const page_geom& g, const uint8_t* page, int t, int c) {
  return formats::decode_element(g, page, t, c);
}

}  // namespace codec
KVQ_NAMESPACE_END
