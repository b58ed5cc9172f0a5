// KVCache: moving sequences out and back in (export, import, swap; docs/architecture.md "Moving
// sequences"). A sequence's *image* is its page blocks, each once, in arena order, and its FP16
// window; the blob is the image with a header and checksums, the swap space holds the image's
// payload alone.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <kvq/cache/cache.hpp>
#include <kvq/cache/sequence_blob.hpp>
#include <kvq/detail/backend.hpp>

#include "cache_calls.hpp"

KVQ_NAMESPACE_BEGIN
namespace detail {
namespace {

using host_copy = cache_backend::host_copy;

// The image of resident sequences `ids`: the info the blob's meta states (its payload laid out)
// and the arena offsets of its blocks and windows.
struct image {
  blob_info info;
  std::vector<uint8_t> meta;
  std::vector<uint64_t> block_at;   // arena offset of each block
  std::vector<uint64_t> window_at;  // arena offset of each sequence's window
};

image image_of(const cache_state& st, std::span<const seq_id> ids) {
  const page_store& store = st.store;
  const cache_shape& sh = st.cfg.shape;
  const size_t per_page = size_t(sh.kv_heads) * 2;
  image im;
  blob_info& info = im.info;
  info.shape = sh;
  info.sink_pages = st.cfg.sink_pages;
  info.rotation.seed = st.cfg.rotation.seed;
  info.rotation.heads.assign(size_t(sh.layers) * size_t(sh.kv_heads), 0);
  for (int l = 0; l < sh.layers; ++l)
    for (int h = 0; h < sh.kv_heads; ++h)
      info.rotation.heads[size_t(l) * size_t(sh.kv_heads) + size_t(h)] = st.cfg.rotation.rotated(l, h, sh.kv_heads);
  info.clip = st.clip;
  info.windows.assign(size_t(sh.layers), 0);
  for (int l = 0; l < sh.layers; ++l) info.windows[size_t(l)] = st.cfg.layer_attention(l).window;
  // The blocks, each once (a fork's shared block too), in arena order: neighbours in the arena are
  // neighbours in the payload, so their copies merge.
  std::vector<std::pair<uint64_t, const page_entry*>> blocks;
  for (seq_id id : ids)
    for (const layer_state& ls : store.find(id)->layers)
      for (size_t i = 0; i < ls.pages.size(); i += per_page)
        if (ls.pages[i].offset != released_page) blocks.emplace_back(ls.pages[i].offset, &ls.pages[i]);
  std::sort(blocks.begin(), blocks.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  blocks.erase(std::unique(blocks.begin(), blocks.end(), [](const auto& a, const auto& b) { return a.first == b.first; }),
               blocks.end());
  std::array<bool, format_count> present{};
  for (const auto& [offset, first] : blocks) {
    blob_block b;
    for (size_t j = 0; j < per_page; ++j) {
      b.formats.push_back(first[j].fmt);
      present[first[j].fmt] = true;
    }
    info.blocks.push_back(std::move(b));
    im.block_at.push_back(offset);
  }
  const auto index_of = [&](uint64_t offset) {
    return uint32_t(std::lower_bound(im.block_at.begin(), im.block_at.end(), offset) - im.block_at.begin());
  };
  for (seq_id id : ids) {
    const sequence_state& s = *store.find(id);
    blob_sequence q;
    q.id = id;
    q.lanes = s.ring_lanes;
    for (const layer_state& ls : s.layers) {
      blob_layer l{ls.n, ls.e, ls.ring_from, ls.released, {}};
      for (size_t i = 0; i < ls.pages.size(); i += per_page)
        l.blocks.push_back(ls.pages[i].offset == released_page ? blob_released_block : index_of(ls.pages[i].offset));
      q.layers.push_back(std::move(l));
    }
    info.sequences.push_back(std::move(q));
    im.window_at.push_back(s.window_offset);
  }
  // The levels of the codebook formats present: what the sequence's next pages encode with.
  const size_t units = size_t(sh.layers) * sh.kv_heads * 2;
  for (size_t f = 0; f < format_count; ++f) {
    if (!present[f] || !codec::is_codebook_format(format_id(f))) continue;
    const size_t n = size_t(1) << traits_of(format_id(f)).bits;
    std::vector<float> levels(units * n);
    for (size_t u = 0; u < units; ++u)
      std::copy_n(st.levels.begin() + std::ptrdiff_t(codec::codebook_level_offset(u, format_id(f))), n,
                  levels.begin() + std::ptrdiff_t(u * n));
    info.levels.emplace_back(format_id(f), std::move(levels));
  }
  im.meta = plan_blob(info);
  return im;
}

// The copies between the arena and an image's payload at host offset `base`: the blocks, merged
// where both sides are contiguous, then each window (a row of lanes x page_tokens slots per ring).
std::vector<host_copy> copies_of(const blob_info& info, std::span<const uint64_t> block_at,
                                 std::span<const uint64_t> window_at, uint64_t base) {
  const cache_shape& sh = info.shape;
  std::vector<host_copy> out;
  for (size_t b = 0; b < info.blocks.size(); ++b) {
    const uint64_t width = arena_allocator::rounded(info.blocks[b].bytes), host = base + info.blocks[b].at;
    if (!out.empty() && out.back().arena + out.back().width == block_at[b] && out.back().host + out.back().width == host)
      out.back().width += width;
    else
      out.push_back({block_at[b], host, width, 1, 0});
  }
  for (size_t s = 0; s < info.sequences.size(); ++s)
    out.push_back({window_at[s], base + info.sequences[s].window_at,
                   uint64_t(info.sequences[s].lanes) * sh.page_tokens * sh.head_dim * 2,
                   uint64_t(sh.layers) * sh.kv_heads * 2, uint64_t(sh.window) * sh.head_dim * 2});
  return out;
}

// What an exported payload must not carry from elsewhere in the arena: the padding after each
// block, and window slots that hold no token of [ring_from, n) (another sequence's lanes before,
// tokens a truncation dropped).
void scrub(const blob_info& info, uint8_t* payload) {
  const cache_shape& sh = info.shape;
  for (const blob_block& b : info.blocks)
    std::fill(payload + b.at + b.bytes, payload + b.at + arena_allocator::rounded(b.bytes), uint8_t(0));
  const size_t slot_bytes = size_t(sh.head_dim) * 2;
  for (const blob_sequence& s : info.sequences) {
    const int64_t slots = int64_t(s.lanes) * sh.page_tokens;
    std::vector<uint8_t> held(static_cast<size_t>(slots));
    for (int l = 0; l < sh.layers; ++l) {
      const blob_layer& ly = s.layers[size_t(l)];
      std::fill(held.begin(), held.end(), uint8_t(0));
      for (int64_t j = ly.ring_from; j < ly.n; ++j) held[size_t(j % sh.window)] = 1;
      for (int ring = 0; ring < sh.kv_heads * 2; ++ring) {
        uint8_t* row = payload + s.window_at + (size_t(l) * sh.kv_heads * 2 + size_t(ring)) * size_t(slots) * slot_bytes;
        for (int64_t j = 0; j < slots; ++j)
          if (!held[size_t(j)]) std::fill_n(row + size_t(j) * slot_bytes, slot_bytes, uint8_t(0));
      }
    }
  }
}

// Sequences `ids` exist, are resident and distinct, and there is at least one.
status check_resident(const cache_state& st, const char* call, std::span<const seq_id> ids) {
  if (ids.empty()) return {errc::invalid_argument, fmt::format("{}: no sequence given", call)};
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!st.store.find(ids[i])) return missing_sequence(st, call, ids[i]);
    for (size_t j = 0; j < i; ++j)
      if (ids[j] == ids[i]) return {errc::invalid_argument, fmt::format("{}: sequence {} given twice", call, ids[i])};
  }
  return {};
}

// A blob this cache can hold: its shape, rotation and sink pages, its lengths (CUDA's page
// tables) and formats (those its attention reads) are this cache's.
status check_compatible(const cache_config& cfg, const detail::cache_backend& impl, const blob_info& b,
                        const char* call) {
  const cache_shape &mine = cfg.shape, &theirs = b.shape;
  const std::pair<const char*, std::pair<int, int>> fields[] = {
      {"layers", {theirs.layers, mine.layers}},
      {"q_heads", {theirs.q_heads, mine.q_heads}},
      {"kv_heads", {theirs.kv_heads, mine.kv_heads}},
      {"head_dim", {theirs.head_dim, mine.head_dim}},
      {"page_tokens", {theirs.page_tokens, mine.page_tokens}},
      {"window", {theirs.window, mine.window}},
      {"recent", {theirs.recent, mine.recent}},
      {"sink_pages", {b.sink_pages, cfg.sink_pages}}};
  for (const auto& [name, v] : fields)
    if (v.first != v.second)
      return {errc::invalid_argument,
              fmt::format("{}: the blob's {} is {}, this cache's {}; nothing was imported", call, name, v.first, v.second)};
  for (int l = 0; l < mine.layers; ++l)
    if (const int32_t w = cfg.layer_attention(l).window; b.windows[size_t(l)] != w)
      return {errc::invalid_argument,
              fmt::format("{}: layer {} has sliding window {} in the blob and {} in this cache (cache_config.attention); "
                          "nothing was imported",
                          call, l, b.windows[size_t(l)], w)};
  for (int l = 0; l < mine.layers; ++l)
    for (int h = 0; h < mine.kv_heads; ++h)
      if (b.rotation.rotated(l, h, mine.kv_heads) != cfg.rotation.rotated(l, h, mine.kv_heads))
        return {errc::invalid_argument,
                fmt::format("{}: layer {} kv head {} is {} in the blob and {} in this cache (cache_config.rotation); "
                            "nothing was imported",
                            call, l, h, b.rotation.rotated(l, h, mine.kv_heads) ? "rotated" : "not rotated",
                            cfg.rotation.rotated(l, h, mine.kv_heads) ? "rotated" : "not rotated")};
  if (cfg.rotation.any() && b.rotation.seed != cfg.rotation.seed)
    return {errc::invalid_argument, fmt::format("{}: the blob's rotation seed is {}, this cache's {}; nothing was "
                                                "imported",
                                                call, b.rotation.seed, cfg.rotation.seed)};
  if (cfg.where == backend::cuda) {
    for (const blob_sequence& s : b.sequences)
      for (const blob_layer& l : s.layers)
        if (l.n > cfg.max_tokens)
          return {errc::out_of_budget, fmt::format("{}: sequence {} holds {} tokens, above this cache's max_tokens {}; "
                                                   "nothing was imported",
                                                   call, s.id, l.n, cfg.max_tokens)};
  }
  for (const blob_block& k : b.blocks)
    for (format_id f : k.formats)
      if (!impl.reads(f))
        return {errc::unsupported, fmt::format("{}: format {} is not read by {}; nothing was imported",
                                               call, format_name(f),
                                               cfg.where == backend::cuda ? "the CUDA attention kernels" : "the CPU attention")};
  return {};
}

// Creates `ids` from an image whose payload lies at host address `payload`: the store places its
// blocks and windows, the backend copies the bytes in and fills its tables. All or nothing.
status place_image(cache_state& st, cache_backend& b, const blob_info& info, std::span<const seq_id> ids,
                   const uint8_t* payload, const std::string& call) {
  auto at = st.store.place(info.blocks, info.sequences, ids, call);
  if (!at) return at.error();
  const auto undo = [&](const status& s) {
    for (seq_id id : ids) (void)st.store.release(id);
    return status{s.code(), fmt::format("{}: {}; nothing was stored", call, s.message())};
  };
  std::vector<uint64_t> windows;
  for (seq_id id : ids) {
    const sequence_state& s = *st.store.find(id);
    windows.push_back(s.window_offset);
    if (status e = b.on_sequence_change(s, true); !e.ok()) return undo(e);
  }
  if (status e = b.copy_from_host(copies_of(info, *at, windows, 0), payload); !e.ok()) return undo(e);
  for (seq_id id : ids)
    if (status e = b.on_placed(*st.store.find(id)); !e.ok()) return undo(e);
  return {};
}

}  // namespace

status missing_sequence(const cache_state& st, const char* call, seq_id id) {
  if (st.swapped.count(id))
    return {errc::invalid_argument, fmt::format("{}: sequence {} is swapped out (swap_in first)", call, id)};
  return {errc::not_found, fmt::format("{}: unknown sequence {}", call, id)};
}

}  // namespace detail
using namespace detail;

result<uint64_t> KVCache::export_bytes(std::span<const seq_id> ids) const {
  KVQ_LIVE();
  KVQ_TRY(check_resident(*state_, "export_bytes", ids));
  return image_of(*state_, ids).info.total_bytes();
}

result<uint64_t> KVCache::export_sequences(std::span<const seq_id> ids, std::span<uint8_t> out, stream_ref stream) const {
  KVQ_CALL_STREAM(stream);
  KVQ_TRY(check_resident(*state_, "export_sequences", ids));
  const image im = image_of(*state_, ids);
  const uint64_t total = im.info.total_bytes();
  if (out.size() < total)
    return status{errc::invalid_argument,
                  fmt::format("export_sequences: the output holds {} bytes; the blob takes {} (export_bytes)",
                              out.size(), total)};
  uint8_t* payload = out.data() + im.info.payload_offset();
  KVQ_TRY(impl_->copy_to_host(copies_of(im.info, im.block_at, im.window_at, 0), payload));
  KVQ_TRY(impl_->wait());
  scrub(im.info, payload);
  seal_blob(im.info, im.meta, out.first(total));
  return total;
}

result<std::vector<uint8_t>> KVCache::export_sequences(std::span<const seq_id> ids, stream_ref stream) const {
  auto bytes = export_bytes(ids);
  if (!bytes) return bytes.error();
  std::vector<uint8_t> out(*bytes);
  auto wrote = export_sequences(ids, out, stream);
  if (!wrote) return wrote.error();
  return out;
}

status KVCache::import_sequences(std::span<const uint8_t> blob, std::span<const seq_id> ids, stream_ref stream) {
  KVQ_CALL_STREAM(stream);
  auto info = inspect_blob(blob);
  if (!info) return {info.error().code(), "import_sequences: " + info.error().message() + "; nothing was imported"};
  if (ids.size() != info->sequences.size())
    return {errc::invalid_argument, fmt::format("import_sequences: the blob holds {} sequence(s); {} id(s) given",
                                                info->sequences.size(), ids.size())};
  for (seq_id id : ids)
    if (state_->swapped.count(id))
      return {errc::invalid_argument, fmt::format("import_sequences: sequence {} already exists (swapped out)", id)};
  KVQ_TRY(check_compatible(state_->cfg, *impl_, *info, "import_sequences"));
  return place_image(*state_, *impl_, *info, ids, blob.data() + info->payload_offset(), "import_sequences");
}

status KVCache::export_file(const std::string& path, std::span<const seq_id> ids, stream_ref stream) const {
  KVQ_LIVE();
  auto blob = export_sequences(ids, stream);
  if (!blob) return blob.error();
  const std::string part = path + ".part";
  {
    std::ofstream f(part, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(blob->data()), std::streamsize(blob->size()));
    f.close();
    if (!f) {
      std::remove(part.c_str());
      return {errc::io_error, fmt::format("export_file: cannot write '{}'", part)};
    }
  }
  if (std::rename(part.c_str(), path.c_str()) != 0) {
    std::remove(part.c_str());
    return {errc::io_error, fmt::format("export_file: cannot rename '{}' to '{}'", part, path)};
  }
  return {};
}

status KVCache::import_file(const std::string& path, std::span<const seq_id> ids, stream_ref stream) {
  KVQ_CALL_STREAM(stream);
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) return {errc::io_error, fmt::format("import_file: cannot open '{}'", path)};
  const std::streamoff size = f.tellg();
  if (size < 0) return {errc::io_error, fmt::format("import_file: cannot read '{}'", path)};
  std::vector<uint8_t> blob(static_cast<size_t>(size));
  f.seekg(0);
  if (!f.read(reinterpret_cast<char*>(blob.data()), size))
    return {errc::io_error, fmt::format("import_file: cannot read '{}'", path)};
  status s = import_sequences(blob, ids, stream);
  if (!s.ok()) return {s.code(), fmt::format("{} (file '{}')", s.message(), path)};
  return impl_->wait();  // the copies read `blob`, which goes now
}

status KVCache::swap_out(seq_id id, stream_ref stream) {
  KVQ_CALL_STREAM(stream);
  const seq_id ids[] = {id};
  KVQ_TRY(check_resident(*state_, "swap_out", ids));
  if (state_->cfg.swap_bytes == 0)
    return {errc::unsupported, "swap_out: the cache has no swap space (cache_config.swap_bytes is 0)"};
  image im = image_of(*state_, ids);
  const uint64_t bytes = im.info.payload_bytes;
  const std::optional<uint64_t> at = state_->swap.allocate(bytes);
  if (!at)
    return {errc::out_of_budget,
            fmt::format("swap_out: sequence {} takes {} bytes of swap space; {} of {} are free (largest block {}); "
                        "nothing changed",
                        id, bytes, state_->swap.free_bytes(), state_->swap.capacity(), state_->swap.largest_free())};
  if (status s = impl_->copy_to_host(copies_of(im.info, im.block_at, im.window_at, 0), impl_->swap_memory() + *at);
      !s.ok()) {
    state_->swap.free(*at);
    return {s.code(), "swap_out: " + s.message() + "; nothing changed"};
  }
  (void)impl_->on_sequence_change(*state_->store.find(id), false);
  KVQ_TRY(state_->store.release(id));
  state_->swapped[id] = {std::move(im.info), *at};
  state_->swapped_out_bytes += bytes;
  return {};
}

status KVCache::swap_in(seq_id id, stream_ref stream) {
  KVQ_CALL_STREAM(stream);
  auto it = state_->swapped.find(id);
  if (it == state_->swapped.end())
    return {state_->store.find(id) ? errc::invalid_argument : errc::not_found,
            fmt::format("swap_in: sequence {} is {}", id, state_->store.find(id) ? "not swapped out" : "unknown")};
  const seq_id ids[] = {id};
  const cache_state::swapped_sequence& sw = it->second;
  // the id is free in the store while swapped out; place takes it back
  KVQ_TRY(place_image(*state_, *impl_, sw.image, ids, impl_->swap_memory() + sw.host, "swap_in"));
  state_->swap.free(sw.host);
  state_->swapped_in_bytes += sw.image.payload_bytes;
  state_->swapped.erase(it);
  return {};
}

bool KVCache::is_swapped(seq_id id) const { return state_ && state_->swapped.count(id) != 0; }

result<uint64_t> KVCache::swap_in_bytes(seq_id id) const {
  KVQ_LIVE();
  auto it = state_->swapped.find(id);
  if (it == state_->swapped.end())
    return status{errc::invalid_argument, fmt::format("swap_in_bytes: sequence {} is not swapped out", id)};
  return state_->store.place_bytes(it->second.image.blocks, it->second.image.sequences[0]);
}

KVQ_NAMESPACE_END
