// The low-level calls over host memory (kvq/attention/cpu_pool.hpp): an engine's pool read and
// written by the CPU backend's codec and attention. The checks are the CUDA calls' own
// (kvq/detail/view_checks.hpp).
#include <kvq/attention/cpu_pool.hpp>
#include <kvq/codec/codec.hpp>
#include <kvq/detail/view_checks.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/store/window_layout.hpp>

#include <cmath>
#include <cstring>
#include <vector>

KVQ_NAMESPACE_BEGIN
namespace cpu {
namespace {

using cuda::detail::msg;

cache_shape shape_of(const cuda::paged_view& kv, int q_heads) {
  cache_shape s;
  s.layers = kv.layers, s.q_heads = q_heads, s.kv_heads = kv.kv_heads, s.head_dim = kv.head_dim;
  s.page_tokens = kv.page_tokens, s.window = kv.window, s.recent = 0;  // (recent: the caller's rule, unused here)
  return s;
}

// One (sequence, layer) of the view as the CPU attention reads it: n tokens, the first
// `from_pages` from their pages (offsets from the arena, the formats their tables or headers name).
layer_state layer_of(const cuda::paged_view& kv, int layer, int slot, int64_t n, int64_t from_pages) {
  layer_state ls;
  ls.n = n, ls.e = from_pages, ls.ring_from = std::max<int64_t>(0, n - kv.window);
  const uint64_t base = uint64_t(cuda::pages_base(kv, layer) - kv.arena);
  const int64_t pages = (from_pages + kv.page_tokens - 1) / kv.page_tokens;
  ls.pages.reserve(size_t(pages) * kv.kv_heads * 2);
  for (int64_t p = 0; p < pages; ++p) {
    const cuda::block_ref b = cuda::locate_block(kv, layer, slot, int(p));
    uint64_t off = base + b.offset;
    for (int j = 0; j < kv.kv_heads * 2; ++j) {
      ls.pages.push_back({off, b.fmts[j]});
      off += (j % 2 == 0 ? kv.k_page_bytes : kv.v_page_bytes)[b.fmts[j]];
    }
  }
  return ls;
}

const uint16_t* rings_of(const cuda::paged_view& kv, int layer, uint32_t window_unit) {
  return reinterpret_cast<const uint16_t*>(cuda::rings_base(kv) + uint64_t(window_unit) * block_unit) +
         ring_halves(layer, kv.kv_heads, 0, 0, kv.window, kv.head_dim);
}

// What the CPU calls add to the CUDA calls' checks: no rotated head; (attention) a GQA group.
status cpu_supports(const cuda::head_rotation& r, const cuda::paged_view& kv, int q_heads, const char* call) {
  if (r.mask != 0)
    return {errc::unsupported, msg(call, ": rotated heads on the CPU run through KVCache (cpu::", call,
                                   " reads and writes unrotated pools)")};
  if (q_heads >= 0 && (kv.kv_heads < 1 || q_heads < 1 || q_heads % kv.kv_heads != 0))
    return {errc::invalid_argument, msg(call, ": ", q_heads, " query heads over ", kv.kv_heads, " kv heads")};
  return {};
}

// The attention's scale: the call's, else 1 / sqrt(head_dim).
float scale_of(float scale, int head_dim) { return scale > 0.f ? scale : 1.f / std::sqrt(float(head_dim)); }

}  // namespace

status pool_append(const cuda::append_args& a) {
  int pages = 0, max_m = 0;
  KVQ_TRY(cuda::detail::check_append(a, true, nullptr, pages, max_m));
  KVQ_TRY(cpu_supports(a.rotation, a.kv, -1, "pool_append"));
  const cuda::paged_view& kv = a.kv;
  const int d = kv.head_dim, H = kv.kv_heads, P = kv.page_tokens, R = kv.window;
  if (a.k.heads != H || a.v.heads != H || a.k.head_dim != d || a.v.head_dim != d)
    return {errc::invalid_argument, msg("pool_append: K/V are not [tokens][", H, "][", d, "]")};
  int64_t row = 0;
  for (size_t i = 0; i < a.items.size(); ++i) {  // every value first: a refused call writes nothing
    for (const tensor_view* t : {&a.k, &a.v}) {
      const int64_t bad = first_bad_value(*t, row, a.items[i].m).row;
      if (bad >= 0)
        return {errc::non_finite, msg("pool_append: ", t == &a.k ? "K" : "V", " of item ", i, " (slot ",
                                      a.items[i].slot, ") token ", a.items[i].n + bad,
                                      " holds a NaN, an Inf or a value beyond the fp16 range; nothing was stored")};
    }
    row += a.items[i].m;
  }
  std::vector<uint16_t> src(size_t(P) * d);
  row = 0;
  int page = 0;
  for (const cuda::append_seq& it : a.items) {
    uint16_t* rings = reinterpret_cast<uint16_t*>((a.windows ? a.windows : a.arena) + uint64_t(it.window_unit) * block_unit);
    auto ring = [&](int h, int r) { return rings + ring_halves(a.layer, H, h, r, R, d); };
    auto input = [&](int r, int64_t j, int h, int c) {  // token j >= n of the item, as fp16
      const tensor_view& t = r == 0 ? a.k : a.v;
      return float_to_half(load(t.data, t.type, (row + (j - it.n)) * t.stride() + int64_t(h) * d + c));
    };
    for (int pg = 0; pg < it.pages; ++pg, ++page) {  // pages first: they read ring slots the new tokens overwrite
      const uint8_t* fm = a.page_fmts + size_t(page) * H * 2;
      const bool shared = kv.tables == cuda::page_tables::shared;
      uint8_t* block = shared ? a.arena + uint64_t(a.layer) * kv.layer_bytes + uint64_t(a.page_blocks[page]) * kv.block_bytes
                              : a.arena + uint64_t(a.page_blocks[page]) * block_unit;
      uint8_t* out = block + (shared ? cuda::block_header_bytes(H) : 0u);
      const int64_t first = it.e + int64_t(pg) * P;
      for (int h = 0; h < H; ++h)
        for (int r = 0; r < 2; ++r) {
          const format_id f = fm[2 * h + r];
          for (int t = 0; t < P; ++t)
            for (int c = 0; c < d; ++c) {
              const int64_t j = first + t;
              src[size_t(t) * d + c] = j < it.n ? ring(h, r)[(j % R) * d + c] : input(r, j, h, c);
            }
          const codec::page_geom g = codec::make_geom(f, r == 0 ? role::k : role::v, P, d);
          std::memset(out, 0, g.lay.total());
          codec::encode_params ep{a.clip ? a.clip[2 * h + r] : codec::no_clip, nullptr};
          if (a.levels != nullptr && codec::is_codebook_format(f))
            ep.levels = a.levels + codec::codebook_level_offset(size_t(2 * h + r), f);
          for (int u = 0; u < g.unit_count(); ++u) codec::encode_unit(g, src.data(), d, u, out, ep);
          out += g.lay.total();
        }
      if (shared) {
        std::memcpy(block, fm, size_t(H) * 2);
      } else {
        const size_t trow = (size_t(it.slot) * kv.layers + a.layer) * kv.max_pages + size_t(it.first_page + pg);
        a.blocks[trow] = a.page_blocks[page];
        std::memcpy(a.fmts + trow * H * 2, fm, size_t(H) * 2);
      }
    }
    for (int64_t j = std::max<int64_t>(it.n, int64_t(it.n) + it.m - R); j < int64_t(it.n) + it.m; ++j)
      for (int h = 0; h < H; ++h)
        for (int r = 0; r < 2; ++r)
          for (int c = 0; c < d; ++c) ring(h, r)[(j % R) * d + c] = input(r, j, h, c);
    row += it.m;
  }
  return {};
}

status pool_attend(worker_pool& pool, const cuda::attend_args& a) {
  KVQ_TRY(cuda::detail::check_attend_items(a));
  KVQ_TRY(cpu_supports(a.rotation, a.kv, a.q_heads, "pool_attend"));
  const cuda::paged_view& kv = a.kv;
  const cache_shape sh = shape_of(kv, a.q_heads);
  std::vector<layer_state> layers;
  layers.reserve(a.items.size());
  std::vector<attend_task_item> items;
  int64_t rows = 0;
  for (const cuda::decode_item& it : a.items) {
    layers.push_back(layer_of(kv, a.layer, it.slot, it.n, it.from_pages));
    items.push_back({{&sh, &layers.back(), kv.arena, rings_of(kv, a.layer, it.window_unit)}, it.q_len, it.q_row});
    rows = std::max<int64_t>(rows, int64_t(it.q_row) + it.q_len);
  }
  const tensor_view q{a.q, a.q_type, rows, a.q_heads, kv.head_dim, a.q_stride};
  const tensor_mut o{a.o, a.o_type, rows, a.q_heads, kv.head_dim, a.o_stride};
  const attention_variant var = variant_of(a.variant, a.q_heads);
  KVQ_TRY(check_variant(var, a.q_heads, "pool_attend"));
  attend(pool, items, q, o, scale_of(a.scale, kv.head_dim), var);
  return {};
}

status pool_prefill(worker_pool& pool, const cuda::prefill_args& a) {
  KVQ_TRY(cuda::detail::check_prefill_range(a));
  KVQ_TRY(cpu_supports(a.rotation, a.kv, a.q_heads, "pool_prefill"));
  const cuda::paged_view& kv = a.kv;
  if (a.k.data && a.lse)
    return {errc::unsupported, "pool_prefill: the merged LSE of a chunk (attend its prefix with lse and merge)"};
  const cache_shape sh = shape_of(kv, a.q_heads);
  const layer_state ls = layer_of(kv, a.layer, a.slot, a.prefix, a.from_pages);
  const stored_layer stored{&sh, &ls, kv.arena, rings_of(kv, a.layer, a.window_unit)};
  const tensor_view q{a.q, a.q_type, a.queries, a.q_heads, kv.head_dim, a.q_stride};
  const tensor_mut o{a.o, a.o_type, a.queries, a.q_heads, kv.head_dim, a.o_stride};
  const float scale = scale_of(a.scale, kv.head_dim);
  const attention_variant var = variant_of(a.variant, a.q_heads);
  KVQ_TRY(check_variant(var, a.q_heads, "pool_prefill"));
  if (a.k.data) {
    prefill(pool, stored, a.prefix, a.k, a.v, q, o, scale, var);
  } else {
    std::vector<float> lse(a.lse ? 0 : size_t(a.queries) * a.q_heads);
    attend_prefix(pool, stored, a.prefix, q, o, a.lse ? a.lse : lse.data(), scale, var);
  }
  return {};
}

}  // namespace cpu
KVQ_NAMESPACE_END
