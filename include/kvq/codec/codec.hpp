#pragma once
/// \file
/// The codec of every format: encode and decode of one *unit* of a page, `KVQ_HOST_DEVICE`, used
/// unchanged by the CPU reference (a loop over units) and by the CUDA append kernel (a thread per
/// unit), so the two write identical bytes. Each format type owns its codec (format/*.hpp, where
/// each file documents its units and math); these functions dispatch on the page's family through
/// `format_list` (format/registry.hpp).
///
/// All quantization math is float32 with every step correctly rounded; on the device through the
/// `__f*_rn` intrinsics so that no fused multiply-add changes a bit (codec/unit.hpp). Inputs are
/// fp16 (the recent window's precision) and finite: callers validate before encoding.

#include <kvq/codec/unit.hpp>
#include <kvq/config.hpp>
#include <kvq/format/format.hpp>

#include <cstdint>

KVQ_NAMESPACE_BEGIN
namespace codec {

/// Builds the geometry of a page of format `id` (host or device).
KVQ_HOST_DEVICE page_geom make_geom(format_id id, role r, int page_tokens, int head_dim) {
  return formats::geom(id, r, page_tokens, head_dim);
}

/// Encodes unit `u` of a page (units: `page_geom::unit_count`).
/// \param src  [page_tokens][src_stride] fp16 bits; row t is token t of the page
/// \param page the page's bytes (layout in the format's header)
/// \param clip rolealign clip ratio in (0, 1]; ignored by other families
KVQ_HOST_DEVICE void encode_unit(const page_geom& g, const uint16_t* src, int src_stride, int u, uint8_t* page,
                                 float clip) {
  formats::encode_unit(g, src, src_stride, u, page, clip);
}

/// Decodes element (t, c) of a page to float. The reference path: plain and obviously right.
KVQ_HOST_DEVICE float decode_element(const page_geom& g, const uint8_t* page, int t, int c) {
  return formats::decode_element(g, page, t, c);
}

}  // namespace codec
KVQ_NAMESPACE_END
