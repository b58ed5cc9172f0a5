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
  if (seqs_.count(id)) return status{errc::invalid_argument, fmt::format("sequence {} already exists", id)};
  if (free_slots_.empty())
    return status{errc::out_of_budget,
                  fmt::format("create_sequence({}): all {} sequence slots are in use (cache_config.max_sequences)", id,
                              max_sequences_)};
  const uint64_t wb = window_bytes_per_sequence();
  auto off = arena_.allocate(wb);
  if (!off)
    return status{errc::out_of_budget,
                  fmt::format("create_sequence({}) needs {} bytes for its FP16 windows; {} of {} budget bytes free "
                              "(largest block {})",
                              id, wb, arena_.free_bytes(), arena_.capacity(), arena_.largest_free())};
  sequence_state s;
  s.id = id;
  s.window_offset = *off;
  s.slot = free_slots_.back();
  free_slots_.pop_back();
  s.layers.resize(size_t(shape_.layers));
  totals_.window_bytes += wb;
  return &(seqs_[id] = std::move(s));
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
    for (size_t i = 0; i < ls.pages.size(); ++i) {
      account(ls.pages[i], i % 2 == 0 ? role::k : role::v, -1);
      if (i % (size_t(shape_.kv_heads) * 2) == 0) arena_.free(ls.pages[i].offset);  // the page block
    }
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
  for (size_t i = 0; i < plan.entries.size(); ++i) {
    account(plan.entries[i], i % 2 == 0 ? role::k : role::v, +1);
    ls.pages.push_back(plan.entries[i]);
  }
  ls.n += m;
  ls.e += int64_t(plan.pages) * shape_.page_tokens;
  totals_.tokens += m;
}

KVQ_NAMESPACE_END
