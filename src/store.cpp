// Host-side bookkeeping of the paged store (see store.hpp).
#include <kvq/store/store.hpp>

#include <fmt/format.h>

#include <algorithm>

KVQ_NAMESPACE_BEGIN

page_store::page_store(const cache_shape& shape, uint64_t budget, int max_sequences)
    : shape_(shape), arena_(budget), max_sequences_(max_sequences) {
  for (int s = max_sequences - 1; s >= 0; --s) free_slots_.push_back(s);
  for (size_t f = 0; f < format_count; ++f)
    for (role r : {role::k, role::v})
      page_bytes_[r == role::k ? 0 : 1][f] = layout_of(format_table[f], r, shape.page_tokens, shape.head_dim).total();
}

uint64_t page_store::window_bytes_per_sequence() const {
  return uint64_t(shape_.layers) * shape_.kv_heads * 2 * shape_.window * shape_.head_dim * 2;
}

uint64_t page_store::window_offset(const sequence_state& s, int layer, int kv_head, role r) const {
  return s.window_offset + ring_offset(layer, shape_.kv_heads, kv_head, r == role::k ? 0 : 1, shape_.window, shape_.head_dim);
}

result<sequence_state*> page_store::create(seq_id id) {
  return add_sequence(id, fmt::format("create_sequence({})", id));
}

result<sequence_state*> page_store::add_sequence(seq_id id, const std::string& call) {
  if (seqs_.count(id)) return status{errc::invalid_argument, fmt::format("{}: sequence {} already exists", call, id)};
  if (free_slots_.empty())
    return status{errc::out_of_budget,
                  fmt::format("{}: all {} sequence slots are in use (cache_config.max_sequences)", call, max_sequences_)};
  const uint64_t wb = window_bytes_per_sequence();
  auto off = arena_.allocate(wb);
  if (!off)
    return status{errc::out_of_budget,
                  fmt::format("{} needs {} bytes for its FP16 windows; {} of {} budget bytes free (largest block {})",
                              call, wb, arena_.free_bytes(), arena_.capacity(), arena_.largest_free())};
  sequence_state s;
  s.id = id;
  s.window_offset = *off;
  s.slot = free_slots_.back();
  free_slots_.pop_back();
  s.layers.resize(size_t(shape_.layers));
  totals_.window_bytes += wb;
  return &(seqs_[id] = std::move(s));
}

result<sequence_state*> page_store::fork(seq_id src, seq_id dst) {
  const std::string call = fmt::format("fork({}, {})", src, dst);
  const sequence_state* from = find(src);
  if (!from) return status{errc::not_found, fmt::format("{}: unknown sequence {}", call, src)};
  auto made = add_sequence(dst, call);
  if (!made) return made;
  sequence_state& to = **made;
  const size_t per_page = size_t(shape_.kv_heads) * 2;
  for (size_t l = 0; l < to.layers.size(); ++l) {
    to.layers[l] = from->layers[l];  // node-based map: `from` stays valid across the insertion
    for (size_t i = 0; i < to.layers[l].pages.size(); i += per_page) ref_block(to.layers[l], i);
    totals_.tokens += to.layers[l].n;
  }
  return &to;
}

int64_t page_store::kept_encoded(const layer_state& ls, int64_t length) const {
  const int64_t P = shape_.page_tokens;
  const int64_t direct = pages_after(0, 0, length) * P;                       // a direct append's pages
  const int64_t in_ring = (ls.ring_from + P - 1) / P * P;                   // pages whose tokens the ring holds
  const int64_t most = length < ls.e ? length / P * P : ls.e;                 // no page with a dropped token
  return std::min(most, std::max(direct, in_ring));
}

int64_t page_store::restore_from(const layer_state& ls, int64_t length) const {
  return std::min(length, std::max(kept_encoded(ls, length), ls.ring_from));
}

void page_store::truncate(sequence_state& s, int64_t length) {
  const size_t per_page = size_t(shape_.kv_heads) * 2;
  for (layer_state& ls : s.layers) {
    const int64_t e = kept_encoded(ls, length);
    const size_t keep = size_t(e / shape_.page_tokens) * per_page;
    for (size_t i = keep; i < ls.pages.size(); i += per_page) unref_block(ls, i);
    ls.pages.resize(keep);
    ls.e = e;
    ls.ring_from = std::min(ls.ring_from, e);  // tokens [e, ring_from) were written back
    totals_.tokens -= ls.n - length;
    ls.n = length;
  }
}

uint64_t page_store::block_bytes(std::span<const format_pair> pairs) const {
  uint64_t b = 0;
  for (const format_pair& p : pairs) b += page_bytes_of(p.k, role::k) + page_bytes_of(p.v, role::v);
  return arena_allocator::rounded(b);
}

uint64_t page_store::listed_bytes(const layer_state& ls, size_t first) const {
  uint64_t b = 0;
  for (size_t j = 0; j < size_t(shape_.kv_heads) * 2; ++j)
    b += page_bytes_of(ls.pages[first + j].fmt, j % 2 == 0 ? role::k : role::v);
  return b;
}

void page_store::ref_block(const layer_state& ls, size_t first) {
  const size_t per_page = size_t(shape_.kv_heads) * 2;
  uint32_t& refs = refs_[ls.pages[first].offset];
  if (refs++ == 0) {
    for (size_t j = 0; j < per_page; ++j) account(ls.pages[first + j], j % 2 == 0 ? role::k : role::v, +1);
    return;
  }
  if (refs == 2) totals_.shared_pages += per_page;
  totals_.shared_saved_bytes += listed_bytes(ls, first);
}

void page_store::unref_block(const layer_state& ls, size_t first) {
  const size_t per_page = size_t(shape_.kv_heads) * 2;
  auto it = refs_.find(ls.pages[first].offset);
  if (--it->second == 0) {
    for (size_t j = 0; j < per_page; ++j) account(ls.pages[first + j], j % 2 == 0 ? role::k : role::v, -1);
    arena_.free(it->first);
    refs_.erase(it);
    return;
  }
  if (it->second == 1) totals_.shared_pages -= per_page;
  totals_.shared_saved_bytes -= listed_bytes(ls, first);
}

void page_store::account(const page_entry& p, role r, int sign) {
  const uint64_t b = page_bytes_of(p.fmt, r);
  const uint64_t elems = uint64_t(shape_.page_tokens) * shape_.head_dim;
  if (sign > 0) {
    totals_.page_bytes += b;
    totals_.pages += 1;
    totals_.encoded_elements += elems;
    totals_.bytes_by_format[p.fmt] += b;
    totals_.pages_by_format[p.fmt] += 1;
  } else {
    totals_.page_bytes -= b;
    totals_.pages -= 1;
    totals_.encoded_elements -= elems;
    totals_.bytes_by_format[p.fmt] -= b;
    totals_.pages_by_format[p.fmt] -= 1;
  }
}

status page_store::release(seq_id id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return {errc::not_found, fmt::format("release_sequence: unknown sequence {}", id)};
  sequence_state& s = it->second;
  for (auto& ls : s.layers) {
    for (size_t i = 0; i < ls.pages.size(); i += size_t(shape_.kv_heads) * 2) unref_block(ls, i);
    totals_.tokens -= ls.n;
  }
  arena_.free(s.window_offset);
  totals_.window_bytes -= window_bytes_per_sequence();
  free_slots_.push_back(s.slot);
  seqs_.erase(it);
  return {};
}

sequence_state* page_store::find(seq_id id) {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : &it->second;
}
const sequence_state* page_store::find(seq_id id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : &it->second;
}

int64_t page_store::pages_after(int64_t n, int64_t e, int64_t m) const {
  // A page is encoded as soon as P + r tokens are unencoded, so after the append the unencoded
  // count is below P + r: k = max(0, floor((n + m - e - r) / P)).
  const int64_t u = n + m - e - shape_.recent;
  return u >= shape_.page_tokens ? u / shape_.page_tokens : 0;
}

result<append_plan> page_store::plan_append(sequence_state& s, int layer, int64_t m,
                                            std::span<const format_id> formats) {
  layer_state& ls = s.layers[size_t(layer)];
  append_plan plan;
  plan.pages = new_pages(s, layer, m);
  plan.first_page = int64_t(ls.pages.size()) / (2 * shape_.kv_heads);
  const size_t per_page = size_t(shape_.kv_heads) * 2;
  if (formats.size() != size_t(plan.pages) * per_page)
    return status{errc::invalid_argument,
                  fmt::format("append of {} tokens to sequence {} layer {} creates {} pages per (kv head, role): {} formats "
                              "needed, {} given",
                              m, s.id, layer, plan.pages, size_t(plan.pages) * per_page, formats.size())};
  for (size_t j = 0; j < formats.size(); ++j) {
    const int h = int(j / 2 % size_t(shape_.kv_heads));
    const role r = j % 2 == 0 ? role::k : role::v;
    if (status st = check_shape(formats[j], r, shape_.page_tokens, shape_.head_dim); !st.ok())
      return status{errc::invalid_argument, fmt::format("sequence {} layer {} page {} head {} {}: {}", s.id, layer,
                                                        plan.first_page + int64_t(j / per_page), h, role_name(r),
                                                        st.message())};
  }
  plan.entries.reserve(formats.size());
  uint64_t need = 0;
  // One block per page index holds the pages of every (kv head, role), back to back in the order
  // of the page list: one allocation instead of 2*kv_heads, and one block offset per page for the
  // device tables.
  for (int i = 0; i < plan.pages; ++i) {
    const size_t first = plan.entries.size();
    uint64_t block = 0;
    for (size_t j = first; j < first + per_page; ++j) {
      plan.entries.push_back({block, formats[j]});  // offset within the block for now
      block += page_bytes_of(formats[j], j % 2 == 0 ? role::k : role::v);
    }
    need += arena_allocator::rounded(block);
    auto off = arena_.allocate(block);
    if (!off) {
      plan.entries.resize(first);
      abandon(std::move(plan));
      return status{errc::out_of_budget,
                    fmt::format("append of {} tokens to sequence {} layer {} needs {} new pages (at least {} bytes); "
                                "{} of {} budget bytes free, largest block {}; nothing was stored",
                                m, s.id, layer, plan.pages * shape_.kv_heads * 2, need, arena_.free_bytes(),
                                arena_.capacity(), arena_.largest_free())};
    }
    for (size_t j = first; j < plan.entries.size(); ++j) plan.entries[j].offset += *off;
  }
  return plan;
}

void page_store::abandon(append_plan&& plan) {
  const size_t per_page = size_t(shape_.kv_heads) * 2;
  for (size_t i = 0; i < plan.entries.size(); i += per_page) arena_.free(plan.entries[i].offset);
}

void page_store::commit_append(sequence_state& s, int layer, int64_t m, append_plan&& plan) {
  layer_state& ls = s.layers[size_t(layer)];
  const size_t first = ls.pages.size();
  ls.pages.insert(ls.pages.end(), plan.entries.begin(), plan.entries.end());
  for (size_t i = first; i < ls.pages.size(); i += size_t(shape_.kv_heads) * 2) ref_block(ls, i);
  ls.n += m;
  ls.e += int64_t(plan.pages) * shape_.page_tokens;
  ls.ring_from = std::max(ls.ring_from, ls.n - shape_.window);
  totals_.tokens += m;
}

KVQ_NAMESPACE_END
