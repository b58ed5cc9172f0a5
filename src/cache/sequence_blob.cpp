// The sequence blob's writer and reader (include/kvq/cache/sequence_blob.hpp).
#include <kvq/cache/cache.hpp>
#include <kvq/cache/sequence_blob.hpp>
#include <kvq/codec/codec.hpp>
#include <kvq/store/arena.hpp>

#include <fmt/format.h>

#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <algorithm>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define KVQ_CRC_SSE42 1
#endif

KVQ_NAMESPACE_BEGIN

namespace {

constexpr char magic[8] = {'K', 'V', 'Q', 'S', 'E', 'Q', '\r', '\n'};

constexpr std::array<uint32_t, 256> crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // Castagnoli, reflected
    t[i] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> crc_bytes = crc_table();

uint32_t crc_by_table(const uint8_t* p, size_t n, uint32_t c) {
  for (size_t i = 0; i < n; ++i) c = crc_bytes[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c;
}

#ifdef KVQ_CRC_SSE42
__attribute__((target("sse4.2"))) uint32_t crc_by_instruction(const uint8_t* p, size_t n, uint32_t c) {
  uint64_t c64 = c;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = _mm_crc32_u64(c64, w);
  }
  c = uint32_t(c64);
  for (; n > 0; --n, ++p) c = _mm_crc32_u8(c, *p);
  return c;
}
bool cpu_has_sse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

// Little-endian appends to the meta section.
struct writer {
  std::vector<uint8_t>& out;
  template <class T>
  void put(T v) {
    uint8_t b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    out.insert(out.end(), b, b + sizeof(T));
  }
  void bytes(const void* p, size_t n) {
    out.insert(out.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
  }
};

// Bounds-checked reads of the meta section; the first failure is kept and every later read
// yields zeros.
struct reader {
  std::span<const uint8_t> in;
  size_t at = 0;
  std::string error;
  bool take(void* dst, size_t n, const char* what) {
    if (!error.empty()) return false;
    if (n > in.size() - at) {
      error = fmt::format("the meta section ends inside {} (at byte {} of {})", what, at, in.size());
      return false;
    }
    std::memcpy(dst, in.data() + at, n);
    at += n;
    return true;
  }
  template <class T>
  T get(const char* what) {
    T v{};
    if (!take(&v, sizeof(T), what)) return T{};
    return v;
  }
};

uint32_t load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

status bad(const std::string& what) { return {errc::invalid_argument, "sequence blob: " + what}; }

uint64_t window_image_bytes(const cache_shape& sh, int lanes) {
  return uint64_t(sh.layers) * uint64_t(sh.kv_heads) * 2 * uint64_t(lanes) * uint64_t(sh.page_tokens) *
         uint64_t(sh.head_dim) * 2;
}

// The page bytes of a block of these formats ([kv_heads][2]).
uint64_t pages_bytes(const cache_shape& sh, std::span<const format_id> fmts) {
  uint64_t b = 0;
  for (size_t j = 0; j < fmts.size(); ++j)
    b += layout_of(format_table[fmts[j]], j % 2 == 0 ? role::k : role::v, sh.page_tokens, sh.head_dim).total();
  return b;
}

}  // namespace

namespace {

uint32_t crc_one_thread(std::span<const uint8_t> bytes, uint32_t crc) {
  crc = ~crc;
#ifdef KVQ_CRC_SSE42
  if (cpu_has_sse42()) return ~crc_by_instruction(bytes.data(), bytes.size(), crc);
#endif
  return ~crc_by_table(bytes.data(), bytes.size(), crc);
}

// CRC arithmetic over GF(2): a 32x32 bit matrix (a column per word) times a vector, and its square.
uint32_t gf2_times(const uint32_t* m, uint32_t v) {
  uint32_t sum = 0;
  for (; v; v >>= 1, ++m)
    if (v & 1) sum ^= *m;
  return sum;
}
void gf2_square(uint32_t* out, const uint32_t* m) {
  for (int i = 0; i < 32; ++i) out[i] = gf2_times(m, m[i]);
}

// The CRC of A followed by B from crc(A), crc(B) and B's length: crc(A) is carried through
// len(B) zero bytes (the operator of one zero bit squared up to the length's bits) and xored
// with crc(B).
uint32_t crc_combine(uint32_t a, uint32_t b, uint64_t len_b) {
  if (len_b == 0) return a;
  uint32_t even[32], odd[32];
  odd[0] = 0x82F63B78u;  // one zero bit: the reflected polynomial ...
  for (int i = 1; i < 32; ++i) odd[i] = 1u << (i - 1);  // ... and a shift
  gf2_square(even, odd);  // two zero bits
  gf2_square(odd, even);  // four
  do {  // one zero byte, then doubling
    gf2_square(even, odd);
    if (len_b & 1) a = gf2_times(even, a);
    len_b >>= 1;
    if (!len_b) break;
    gf2_square(odd, even);
    if (len_b & 1) a = gf2_times(odd, a);
    len_b >>= 1;
  } while (len_b);
  return a ^ b;
}

}  // namespace

uint32_t crc32c(std::span<const uint8_t> bytes, uint32_t crc) {
  // Large inputs (a sequence's pages) in parallel: a chunk per thread, combined in order.
  constexpr size_t per_thread = size_t(32) << 20;
  const size_t threads = std::min<size_t>({bytes.size() / per_thread, std::max(1u, std::thread::hardware_concurrency()), 16});
  if (threads < 2) return crc_one_thread(bytes, crc);
  const size_t chunk = (bytes.size() + threads - 1) / threads;
  std::vector<uint32_t> part(threads);
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t)
    pool.emplace_back([&, t] { part[t] = crc_one_thread(bytes.subspan(t * chunk, std::min(chunk, bytes.size() - t * chunk)), 0); });
  part[0] = crc_one_thread(bytes.first(chunk), crc);
  for (std::thread& th : pool) th.join();
  uint32_t out = part[0];
  for (size_t t = 1; t < threads; ++t) out = crc_combine(out, part[t], std::min(chunk, bytes.size() - t * chunk));
  return out;
}

uint64_t blob_info::block_bytes() const {
  uint64_t b = 0;
  for (const blob_block& k : blocks) b += (k.bytes + block_unit - 1) / block_unit * block_unit;
  return b;
}
uint64_t blob_info::window_bytes() const {
  uint64_t b = 0;
  for (const blob_sequence& s : sequences) b += s.window_bytes;
  return b;
}

namespace detail {

void lay_out_blob(blob_info& info) {
  const cache_shape& sh = info.shape;
  uint64_t at = 0;
  for (blob_block& b : info.blocks) {
    b.bytes = pages_bytes(sh, b.formats);
    b.at = at;
    at += (b.bytes + info.block_unit - 1) / info.block_unit * info.block_unit;
  }
  for (blob_sequence& s : info.sequences) {
    s.window_bytes = window_image_bytes(sh, s.lanes);
    s.window_at = at;
    at += s.window_bytes;
  }
  info.payload_bytes = at;
}

std::vector<uint8_t> plan_blob(blob_info& info) {
  lay_out_blob(info);
  const cache_shape& sh = info.shape;
  // The blob's format table: the formats of its blocks, in order of first use.
  std::vector<format_id> table;
  std::array<int, format_count> index_of;
  index_of.fill(-1);
  for (const blob_block& b : info.blocks)
    for (format_id f : b.formats)
      if (index_of[f] < 0) {
        index_of[f] = int(table.size());
        table.push_back(f);
      }

  std::vector<uint8_t> meta;
  writer w{meta};
  for (int v : {sh.layers, sh.q_heads, sh.kv_heads, sh.head_dim, sh.page_tokens, sh.window, sh.recent, info.sink_pages})
    w.put<int32_t>(v);
  w.put<uint64_t>(info.rotation.seed);
  for (int l = 0; l < sh.layers; ++l)
    for (int h = 0; h < sh.kv_heads; ++h) w.put<uint8_t>(info.rotation.rotated(l, h, sh.kv_heads) ? 1 : 0);
  for (int l = 0; l < sh.layers; ++l) w.put<int32_t>(info.windows.empty() ? 0 : info.windows[size_t(l)]);
  w.put<uint32_t>(uint32_t(table.size()));
  for (format_id f : table) {
    const std::string name = format_name(f);
    w.put<uint8_t>(uint8_t(name.size()));
    w.bytes(name.data(), name.size());
    w.put<uint32_t>(uint32_t(layout_of(format_table[f], role::k, sh.page_tokens, sh.head_dim).total()));
    w.put<uint32_t>(uint32_t(layout_of(format_table[f], role::v, sh.page_tokens, sh.head_dim).total()));
  }
  w.bytes(info.clip.data(), info.clip.size() * sizeof(float));
  w.put<uint32_t>(uint32_t(info.levels.size()));
  for (const auto& [f, levels] : info.levels) {
    w.put<uint8_t>(uint8_t(index_of[f]));
    w.bytes(levels.data(), levels.size() * sizeof(float));
  }
  w.put<uint32_t>(uint32_t(info.blocks.size()));
  for (const blob_block& b : info.blocks)
    for (format_id f : b.formats) w.put<uint8_t>(uint8_t(index_of[f]));
  w.put<uint32_t>(uint32_t(info.sequences.size()));
  for (const blob_sequence& s : info.sequences) {
    w.put<int64_t>(s.id);
    w.put<int32_t>(s.lanes);
    for (const blob_layer& l : s.layers) {
      w.put<int64_t>(l.n);
      w.put<int64_t>(l.e);
      w.put<int64_t>(l.ring_from);
      w.put<int64_t>(l.released);
      for (uint32_t b : l.blocks) w.put<uint32_t>(b);
    }
  }
  info.meta_bytes = meta.size();
  return meta;
}

void seal_blob(const blob_info& info, std::span<const uint8_t> meta, std::span<uint8_t> blob) {
  uint8_t* p = blob.data();
  std::memcpy(p + blob_header_bytes, meta.data(), meta.size());
  std::memcpy(p, magic, 8);
  const uint32_t version = blob_version, flags = 0, unit = uint32_t(info.block_unit);
  const uint64_t meta_bytes = meta.size(), payload_bytes = info.payload_bytes;
  const uint32_t meta_crc = crc32c(meta);
  const uint32_t payload_crc = crc32c(blob.subspan(info.payload_offset(), info.payload_bytes));
  std::memcpy(p + 8, &version, 4);
  std::memcpy(p + 12, &flags, 4);
  std::memcpy(p + 16, &meta_bytes, 8);
  std::memcpy(p + 24, &payload_bytes, 8);
  std::memcpy(p + 32, &meta_crc, 4);
  std::memcpy(p + 36, &payload_crc, 4);
  std::memcpy(p + 40, &unit, 4);
  const uint32_t header_crc = crc32c(blob.first(44));
  std::memcpy(p + 44, &header_crc, 4);
}

}  // namespace detail

result<blob_info> inspect_blob(std::span<const uint8_t> blob) {
  if (blob.size() < blob_header_bytes)
    return bad(fmt::format("{} bytes, shorter than its {}-byte header (truncated?)", blob.size(), blob_header_bytes));
  const uint8_t* p = blob.data();
  if (std::memcmp(p, magic, 8) != 0) return bad("no KVQSEQ magic at its start (not a kvq sequence blob)");
  if (crc32c(blob.first(44)) != load32(p + 44)) return bad("the header's checksum does not match (corrupted header)");
  blob_info info;
  info.version = load32(p + 8);
  if (info.version == 0 || info.version > blob_version)
    return bad(fmt::format("version {}; this kvq reads versions 1 to {}", info.version, blob_version));
  if (load32(p + 12) != 0) return bad(fmt::format("unknown flags {:#x}", load32(p + 12)));
  info.meta_bytes = load64(p + 16);
  info.payload_bytes = load64(p + 24);
  info.block_unit = load32(p + 40);
  if (info.block_unit != arena_allocator::alignment)
    return bad(fmt::format("block unit {}; this kvq pads blocks to {}", info.block_unit, arena_allocator::alignment));
  const uint64_t rest = blob.size() - blob_header_bytes;
  if (info.meta_bytes > rest || info.payload_bytes != rest - info.meta_bytes)
    return bad(fmt::format("the header says {} meta and {} payload bytes after the header; {} bytes follow it ({})",
                           info.meta_bytes, info.payload_bytes, rest,
                           info.meta_bytes > rest || info.payload_bytes > rest - info.meta_bytes ? "truncated"
                                                                                                  : "trailing bytes"));
  const std::span<const uint8_t> meta = blob.subspan(blob_header_bytes, info.meta_bytes);
  if (crc32c(meta) != load32(p + 32)) return bad("the meta section's checksum does not match (corrupted)");
  if (crc32c(blob.subspan(info.payload_offset(), info.payload_bytes)) != load32(p + 36))
    return bad("the payload's checksum does not match (corrupted page or window bytes)");

  reader r{meta, 0, {}};
  cache_shape& sh = info.shape;
  sh.layers = r.get<int32_t>("the shape");
  sh.q_heads = r.get<int32_t>("the shape");
  sh.kv_heads = r.get<int32_t>("the shape");
  sh.head_dim = r.get<int32_t>("the shape");
  sh.page_tokens = r.get<int32_t>("the shape");
  sh.window = r.get<int32_t>("the shape");
  sh.recent = r.get<int32_t>("the shape");
  info.sink_pages = r.get<int32_t>("the shape");
  if (!r.error.empty()) return bad(r.error);
  if (sh.layers < 1 || sh.layers > 4096 || sh.kv_heads < 1 || sh.kv_heads > 256 || sh.q_heads < sh.kv_heads ||
      sh.q_heads % sh.kv_heads != 0 || sh.head_dim < 8 || sh.head_dim > 256 || sh.head_dim % 8 != 0 ||
      sh.page_tokens < 32 || sh.page_tokens % 32 != 0 || sh.page_tokens > 4096 || sh.recent < 0 ||
      sh.window < sh.page_tokens + sh.recent || sh.window % sh.page_tokens != 0 || sh.window > 65536 ||
      info.sink_pages < 0)
    return bad(fmt::format("shape layers {} q_heads {} kv_heads {} head_dim {} page_tokens {} window {} recent {} "
                           "sink_pages {} is not one a cache can have",
                           sh.layers, sh.q_heads, sh.kv_heads, sh.head_dim, sh.page_tokens, sh.window, sh.recent,
                           info.sink_pages));
  const size_t units = size_t(sh.layers) * size_t(sh.kv_heads);
  info.rotation.seed = r.get<uint64_t>("the rotation");
  info.rotation.heads.resize(units);
  if (!r.take(info.rotation.heads.data(), units, "the rotated heads")) return bad(r.error);
  for (uint8_t h : info.rotation.heads)
    if (h > 1) return bad(fmt::format("a rotated-head flag is {}, not 0 or 1", h));
  if (info.rotation.any() && (sh.head_dim & (sh.head_dim - 1)) != 0)
    return bad(fmt::format("rotated heads with head_dim {} (rotation needs a power of two)", sh.head_dim));
  info.windows.assign(size_t(sh.layers), 0);  // (before version 3: every layer global)
  if (info.version >= 3)
    for (int l = 0; l < sh.layers; ++l) {
      const int32_t w = r.get<int32_t>("the sliding windows");
      if (!r.error.empty()) return bad(r.error);
      if (w < 0) return bad(fmt::format("layer {} has sliding window {}", l, w));
      info.windows[size_t(l)] = w;
    }

  const uint32_t formats = r.get<uint32_t>("the format table");
  if (!r.error.empty()) return bad(r.error);
  if (formats > format_count) return bad(fmt::format("{} formats; this kvq knows {}", formats, format_count));
  std::vector<format_id> table;
  for (uint32_t i = 0; i < formats; ++i) {
    const uint8_t len = r.get<uint8_t>("the format table");
    std::string name(len, '\0');
    r.take(name.data(), len, "a format name");
    const uint32_t kb = r.get<uint32_t>("the format table"), vb = r.get<uint32_t>("the format table");
    if (!r.error.empty()) return bad(r.error);
    auto f = parse_format(name);
    if (!f) return bad(fmt::format("format '{}' is unknown to this kvq", name));
    for (role ro : {role::k, role::v})
      if (status st = check_shape(*f, ro, sh.page_tokens, sh.head_dim); !st.ok())
        return bad(fmt::format("format '{}' cannot hold this shape: {}", name, st.message()));
    const uint64_t k_bytes = layout_of(format_table[*f], role::k, sh.page_tokens, sh.head_dim).total();
    const uint64_t v_bytes = layout_of(format_table[*f], role::v, sh.page_tokens, sh.head_dim).total();
    if (kb != k_bytes || vb != v_bytes)
      return bad(fmt::format("format '{}' has K/V pages of {}/{} bytes in the blob, {}/{} in this kvq (another layout)",
                             name, kb, vb, k_bytes, v_bytes));
    table.push_back(*f);
  }
  info.clip.resize(units * 2);
  if (!r.take(info.clip.data(), info.clip.size() * sizeof(float), "the clip percentiles")) return bad(r.error);
  if (info.version == 1) {  // clip ratios in (0, 1]: not percentiles, read as no clipping
    for (float c : info.clip)
      if (!(c > 0.f && c <= 1.f)) return bad(fmt::format("a version 1 clip ratio is {}, not in (0, 1]", c));
    std::fill(info.clip.begin(), info.clip.end(), codec::no_clip);
  }
  for (size_t i = 0; i < info.clip.size(); ++i)
    if (const std::string e = clip_percentile_error(info.clip[i]); !e.empty())
      return bad(fmt::format("layer {}, head {}, {}: {}", i / 2 / size_t(sh.kv_heads), (i / 2) % size_t(sh.kv_heads),
                             i % 2 ? "V" : "K", e));
  const uint32_t tables = r.get<uint32_t>("the level tables");
  if (!r.error.empty()) return bad(r.error);
  if (tables > formats) return bad(fmt::format("{} level tables for {} formats", tables, formats));
  for (uint32_t i = 0; i < tables; ++i) {
    const uint8_t idx = r.get<uint8_t>("a level table");
    if (!r.error.empty()) return bad(r.error);
    if (idx >= formats || !codec::is_codebook_format(table[idx]))
      return bad(fmt::format("level table {} names format index {}, not a codebook format of the blob", i, idx));
    std::vector<float> levels(units * 2 * (size_t(1) << traits_of(table[idx]).bits));
    if (!r.take(levels.data(), levels.size() * sizeof(float), "a level table")) return bad(r.error);
    for (float x : levels)
      if (!std::isfinite(x)) return bad(fmt::format("a level of {} is not finite", format_name(table[idx])));
    info.levels.emplace_back(table[idx], std::move(levels));
  }

  const uint32_t blocks = r.get<uint32_t>("the block list");
  if (!r.error.empty()) return bad(r.error);
  const size_t per_block = units / size_t(sh.layers) * 2;
  if (uint64_t(blocks) * per_block > meta.size()) return bad(fmt::format("{} blocks do not fit the meta section", blocks));
  info.blocks.resize(blocks);
  std::vector<uint8_t> ids(per_block);
  for (uint32_t b = 0; b < blocks; ++b) {
    if (!r.take(ids.data(), per_block, "the block list")) return bad(r.error);
    for (uint8_t i : ids) {
      if (i >= formats) return bad(fmt::format("block {} names format index {} of {}", b, i, formats));
      info.blocks[b].formats.push_back(table[i]);
    }
  }
  const uint32_t seqs = r.get<uint32_t>("the sequence list");
  if (!r.error.empty()) return bad(r.error);
  if (seqs == 0) return bad("no sequence");
  if (uint64_t(seqs) * (12 + 24 * uint64_t(sh.layers)) > meta.size())
    return bad(fmt::format("{} sequences do not fit the meta section", seqs));
  info.sequences.resize(seqs);
  std::vector<uint8_t> listed(blocks, 0);
  uint64_t windows = 0;  // their payload bytes so far
  const int lanes_per_block = sh.window / sh.page_tokens;
  for (uint32_t i = 0; i < seqs; ++i) {
    blob_sequence& s = info.sequences[i];
    s.id = r.get<int64_t>("a sequence");
    s.lanes = r.get<int32_t>("a sequence");
    if (!r.error.empty()) return bad(r.error);
    if (s.lanes < 1 || s.lanes > lanes_per_block)
      return bad(fmt::format("sequence {} holds {} window lanes, not in [1, {}]", s.id, s.lanes, lanes_per_block));
    windows += window_image_bytes(sh, s.lanes);
    if (windows > info.payload_bytes)
      return bad(fmt::format("the windows of the first {} sequences take more than the {} payload bytes", i + 1,
                             info.payload_bytes));
    std::vector<uint8_t> mine(blocks, 0);
    s.layers.resize(size_t(sh.layers));
    for (int l = 0; l < sh.layers; ++l) {
      blob_layer& ly = s.layers[size_t(l)];
      ly.n = r.get<int64_t>("a layer");
      ly.e = r.get<int64_t>("a layer");
      ly.ring_from = r.get<int64_t>("a layer");
      ly.released = info.version >= 3 ? r.get<int64_t>("a layer") : 0;
      if (!r.error.empty()) return bad(r.error);
      const int64_t P = sh.page_tokens;
      if (ly.released < 0 || ly.released % P != 0 || ly.released > std::max<int64_t>(ly.e, 0) ||
          (ly.released > 0 && info.windows[size_t(l)] == 0))
        return bad(fmt::format("sequence {} layer {}: {} released tokens (e {}, sliding window {}) is not a state a "
                               "layer can have",
                               s.id, l, ly.released, ly.e, info.windows[size_t(l)]));
      if (!(0 <= ly.ring_from && ly.ring_from <= ly.e && ly.e <= ly.n && ly.n <= (int64_t(1) << 40) && ly.e % P == 0 &&
            ly.n - ly.ring_from <= sh.window && (s.lanes == lanes_per_block || ly.n <= int64_t(s.lanes) * P)))
        return bad(fmt::format("sequence {} layer {}: n {} e {} ring_from {} with {} lanes is not a state a layer can "
                               "have",
                               s.id, l, ly.n, ly.e, ly.ring_from, s.lanes));
      const int64_t pages = ly.e / P;
      if (uint64_t(pages) * 4 > meta.size() - r.at)
        return bad(fmt::format("sequence {} layer {} lists {} pages past the end of the meta section", s.id, l, pages));
      ly.blocks.resize(size_t(pages));
      for (int64_t pg = 0; pg < pages; ++pg) {
        const uint32_t b = r.get<uint32_t>("a page list");
        if (!r.error.empty()) return bad(r.error);
        if ((pg * P < ly.released) != (b == blob_released_block))
          return bad(fmt::format("sequence {} layer {} page {} names block {}; the layer released its first {} tokens",
                                 s.id, l, pg, b, ly.released));
        if (b == blob_released_block) {
          ly.blocks[size_t(pg)] = b;
          continue;
        }
        if (b >= blocks) return bad(fmt::format("sequence {} layer {} page {} names block {} of {}", s.id, l, pg, b, blocks));
        if (mine[b]) return bad(fmt::format("sequence {} lists block {} twice", s.id, b));
        mine[b] = listed[b] = 1;
        ly.blocks[size_t(pg)] = b;
      }
    }
  }
  if (r.at != meta.size()) return bad(fmt::format("{} bytes follow the sequence list in the meta section", meta.size() - r.at));
  for (uint32_t b = 0; b < blocks; ++b)
    if (!listed[b]) return bad(fmt::format("block {} is listed by no sequence", b));
  // The payload's layout follows from the meta; it must be the size the header says.
  const uint64_t stated = info.payload_bytes;
  detail::lay_out_blob(info);
  if (info.payload_bytes != stated)
    return bad(fmt::format("the blocks and windows take {} payload bytes; the header says {}", info.payload_bytes,
                           stated));
  return info;
}

KVQ_NAMESPACE_END
