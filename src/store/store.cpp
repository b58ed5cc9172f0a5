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

uint64_t page_store::window_block_bytes() const {
  return ring_block_bytes(shape_.layers, shape_.kv_heads, shape_.head_dim, shape_.window);
}

int page_store::lanes_for(int64_t tokens) const {
  const int64_t lanes = (tokens + shape_.page_tokens - 1) / shape_.page_tokens;
  return int(std::clamp<int64_t>(lanes, 1, lanes_per_block()));
}

bool page_store::lanes_free(uint64_t block, int lane, int count) const {
  if (lane + count > lanes_per_block()) return false;
  const std::vector<uint8_t>& taken = ring_blocks_.at(block);
  return std::none_of(taken.begin() + lane, taken.begin() + lane + count, [](uint8_t t) { return t != 0; });
}

std::optional<lane_run> page_store::free_run(int lanes) const {
  for (const auto& [block, taken] : ring_blocks_)
    for (int lane = 0; lane + lanes <= lanes_per_block(); ++lane)
      if (lanes_free(block, lane, lanes)) return lane_run{block, lane, lanes};
  return std::nullopt;
}

std::optional<lane_run> page_store::take_lanes(int lanes) {
  std::optional<lane_run> run = free_run(lanes);
  if (!run) {
    const std::optional<uint64_t> block = arena_.allocate(window_block_bytes());
    if (!block) return std::nullopt;
    ring_blocks_[*block].assign(size_t(lanes_per_block()), 0);
    totals_.window_bytes += window_block_bytes();
    run = lane_run{*block, 0, lanes};
  }
  std::vector<uint8_t>& taken = ring_blocks_[run->block];
  std::fill(taken.begin() + run->lane, taken.begin() + run->lane + lanes, uint8_t(1));
  return run;
}

void page_store::give_lanes(const lane_run& run) {
  if (run.lanes == 0) return;
  auto it = ring_blocks_.find(run.block);
  std::fill(it->second.begin() + run.lane, it->second.begin() + run.lane + run.lanes, uint8_t(0));
  if (std::any_of(it->second.begin(), it->second.end(), [](uint8_t t) { return t != 0; })) return;
  arena_.free(run.block);
  ring_blocks_.erase(it);
  totals_.window_bytes -= window_block_bytes();
}

uint64_t page_store::window_bytes_for(const sequence_state* s, int64_t tokens) const {
  if (s) {
    int64_t most = 0;
    for (const layer_state& ls : s->layers) most = std::max(most, ls.n);
    const int need = lanes_for(most + tokens);
    if (need <= s->ring_lanes || lanes_free(s->ring_block, s->ring_lane + s->ring_lanes, need - s->ring_lanes))
      return 0;
    return free_run(need) ? 0 : arena_allocator::rounded(window_block_bytes());
  }
  // A new sequence takes one lane, then grows to its tokens' lanes: free when some block has a
  // free lane with the rest of the run free after it (or a free run elsewhere besides it).
  const int need = lanes_for(tokens);
  const std::optional<lane_run> first = free_run(1);
  if (!first) return arena_allocator::rounded(window_block_bytes());
  if (need == 1 || lanes_free(first->block, first->lane + 1, need - 1)) return 0;
  for (const auto& [block, taken] : ring_blocks_)  // a run that does not use the first lane
    for (int lane = 0; lane + need <= lanes_per_block(); ++lane)
      if (lanes_free(block, lane, need) && !(block == first->block && lane <= first->lane && first->lane < lane + need))
        return 0;
  return arena_allocator::rounded(window_block_bytes());
}

uint64_t page_store::window_offset(const sequence_state& s, int layer, int kv_head, role r) const {
  return s.window_offset + ring_offset(layer, shape_.kv_heads, kv_head, r == role::k ? 0 : 1, shape_.window, shape_.head_dim);
}

result<sequence_state*> page_store::create(seq_id id) {
  return add_sequence(id, fmt::format("create_sequence({})", id), 1);
}

result<sequence_state*> page_store::add_sequence(seq_id id, const std::string& call, int lanes) {
  if (seqs_.count(id)) return status{errc::invalid_argument, fmt::format("{}: sequence {} already exists", call, id)};
  if (free_slots_.empty())
    return status{errc::out_of_budget,
                  fmt::format("{}: all {} sequence slots are in use (cache_config.max_sequences)", call, max_sequences_)};
  const std::optional<lane_run> run = take_lanes(lanes);
  if (!run)
    return status{errc::out_of_budget,
                  fmt::format("{} needs a ring block of {} bytes for its FP16 windows (no block has {} free lanes); {} "
                              "of {} budget bytes free (largest block {})",
                              call, window_block_bytes(), lanes, arena_.free_bytes(), arena_.capacity(),
                              arena_.largest_free())};
  return &(seqs_[id] = new_state(id, *run));
}

sequence_state page_store::new_state(seq_id id, const lane_run& run) {
  sequence_state s;
  s.id = id;
  s.ring_block = run.block;
  s.ring_lane = run.lane;
  s.ring_lanes = run.lanes;
  s.window_offset = run.block + uint64_t(run.lane) * lane_bytes();
  s.slot = free_slots_.back();
  free_slots_.pop_back();
  s.layers.resize(size_t(shape_.layers));
  return s;
}

result<sequence_state*> page_store::fork(seq_id src, seq_id dst) {
  const std::string call = fmt::format("fork({}, {})", src, dst);
  const sequence_state* from = find(src);
  if (!from) return status{errc::not_found, fmt::format("{}: unknown sequence {}", call, src)};
  auto made = add_sequence(dst, call, from->ring_lanes);
  if (!made) return made;
  sequence_state& to = **made;
  const size_t per_page = size_t(shape_.kv_heads) * 2;
  for (size_t l = 0; l < to.layers.size(); ++l) {
    to.layers[l] = from->layers[l];  // node-based map: `from` stays valid across the insertion
    const layer_state& ls = to.layers[l];
    for (size_t i = live_entry(ls); i < ls.pages.size(); i += per_page) ref_block(ls, i);
    totals_.tokens += ls.n - ls.released;
  }
  return &to;
}

uint64_t page_store::place_bytes(std::span<const blob_block> blocks, const blob_sequence& seq) const {
  uint64_t b = free_run(seq.lanes) ? 0 : arena_allocator::rounded(window_block_bytes());
  for (const blob_block& k : blocks) b += arena_allocator::rounded(k.bytes);
  return b;
}

result<std::vector<uint64_t>> page_store::place(std::span<const blob_block> blocks, std::span<const blob_sequence> seqs,
                                                std::span<const seq_id> ids, const std::string& call) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (seqs_.count(ids[i]))
      return status{errc::invalid_argument, fmt::format("{}: sequence {} already exists", call, ids[i])};
    for (size_t j = 0; j < i; ++j)
      if (ids[j] == ids[i]) return status{errc::invalid_argument, fmt::format("{}: sequence {} given twice", call, ids[i])};
  }
  if (free_slots_.size() < ids.size())
    return status{errc::out_of_budget, fmt::format("{}: {} sequences need slots; {} of {} are free "
                                                   "(cache_config.max_sequences)",
                                                   call, ids.size(), free_slots_.size(), max_sequences_)};
  std::vector<uint64_t> offsets;
  std::vector<lane_run> runs;
  const auto undo = [&] {
    for (uint64_t o : offsets) arena_.free(o);
    for (auto it = runs.rbegin(); it != runs.rend(); ++it) give_lanes(*it);
  };
  uint64_t need = 0;
  for (const blob_block& b : blocks) need += arena_allocator::rounded(b.bytes);
  const auto no_room = [&](const char* what) {
    undo();
    return status{errc::out_of_budget,
                  fmt::format("{}: no room for {}: its {} sequence(s) need {} bytes of page blocks and their FP16 "
                              "windows; {} of {} budget bytes are free (largest block {}); nothing was stored",
                              call, what, seqs.size(), need, arena_.free_bytes(), arena_.capacity(),
                              arena_.largest_free())};
  };
  for (const blob_block& b : blocks) {
    const std::optional<uint64_t> off = arena_.allocate(b.bytes);
    if (!off) return no_room("a page block");
    offsets.push_back(*off);
  }
  for (const blob_sequence& q : seqs) {
    const std::optional<lane_run> run = take_lanes(q.lanes);
    if (!run) return no_room("a window");
    runs.push_back(*run);
  }
  const size_t per_page = size_t(shape_.kv_heads) * 2;
  for (size_t i = 0; i < seqs.size(); ++i) {
    sequence_state s = new_state(ids[i], runs[i]);
    for (size_t l = 0; l < s.layers.size(); ++l) {
      const blob_layer& from = seqs[i].layers[l];
      layer_state& ls = s.layers[l];
      ls.n = from.n;
      ls.e = from.e;
      ls.ring_from = from.ring_from;
      ls.released = from.released;
      ls.pages.reserve(from.blocks.size() * per_page);
      for (uint32_t b : from.blocks) {
        if (b == blob_released_block) {
          ls.pages.insert(ls.pages.end(), per_page, page_entry{released_page, format_id(0)});
          continue;
        }
        uint64_t at = offsets[b];
        for (size_t j = 0; j < per_page; ++j) {
          const format_id f = blocks[b].formats[j];
          ls.pages.push_back({at, f});
          at += page_bytes_of(f, j % 2 == 0 ? role::k : role::v);
        }
        ref_block(ls, ls.pages.size() - per_page);
      }
      totals_.tokens += ls.n - ls.released;
    }
    seqs_[ids[i]] = std::move(s);
  }
  return offsets;
}

int64_t page_store::kept_encoded(const layer_state& ls, int64_t length) const {
  const int64_t P = shape_.page_tokens;
  const int64_t direct = pages_after(0, 0, length) * P;                       // a direct append's pages
  const int64_t in_ring = (ls.ring_from + P - 1) / P * P;                   // pages whose tokens the ring holds
  const int64_t most = length < ls.e ? length / P * P : ls.e;                 // no page with a dropped token
  // never fewer than a sliding layer released (the cache refuses a cut that needs them)
  return std::max(std::min(ls.released, most), std::min(most, std::max(direct, in_ring)));
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

void page_store::release_before(sequence_state& s, int layer, int64_t token) {
  const int64_t P = shape_.page_tokens;
  const size_t per_page = size_t(shape_.kv_heads) * 2;
  layer_state& ls = s.layers[size_t(layer)];
  const int64_t upto = std::min(token / P * P, ls.e);
  for (int64_t t = ls.released; t < upto; t += P) {
    const size_t first = size_t(t / P) * per_page;
    unref_block(ls, first);
    for (size_t j = 0; j < per_page; ++j) ls.pages[first + j].offset = released_page;
  }
  if (upto > ls.released) totals_.tokens -= upto - ls.released;
  ls.released = std::max(ls.released, upto);
}

uint64_t page_store::release_bytes(const sequence_state& s, int layer, int64_t token) const {
  const int64_t P = shape_.page_tokens;
  const size_t per_page = size_t(shape_.kv_heads) * 2;
  const layer_state& ls = s.layers[size_t(layer)];
  uint64_t bytes = 0;
  for (int64_t t = ls.released; t < std::min(token / P * P, ls.e); t += P) {
    const size_t first = size_t(t / P) * per_page;
    if (refs_.at(ls.pages[first].offset) == 1) bytes += arena_allocator::rounded(listed_bytes(ls, first));
  }
  return bytes;
}

void page_store::rewind(sequence_state& s, int layer, int64_t n, int64_t e, int64_t ring_from) {
  const size_t per_page = size_t(shape_.kv_heads) * 2;
  layer_state& ls = s.layers[size_t(layer)];
  const int64_t keep_n = std::min(ls.n, n), keep_e = std::min(ls.e, e);
  const size_t keep = size_t(keep_e / shape_.page_tokens) * per_page;
  for (size_t i = std::max(keep, live_entry(ls)); i < ls.pages.size(); i += per_page) unref_block(ls, i);
  ls.pages.resize(std::min(keep, ls.pages.size()));
  const int64_t keep_released = std::min(ls.released, keep_e);
  totals_.tokens -= (ls.n - ls.released) - (keep_n - keep_released);
  ls.released = keep_released;
  ls.e = keep_e;
  ls.ring_from = std::min({ls.ring_from, ring_from, keep_e});
  ls.n = keep_n;
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
    for (size_t i = live_entry(ls); i < ls.pages.size(); i += size_t(shape_.kv_heads) * 2) unref_block(ls, i);
    totals_.tokens -= ls.n - ls.released;
  }
  give_lanes({s.ring_block, s.ring_lane, s.ring_lanes});
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
  return pages_to_encode(n, e, m, shape_.page_tokens, shape_.recent);
}

int64_t page_store::tokens_before_encode(int64_t n, int64_t e) const {
  return std::max<int64_t>(0, shape_.page_tokens + shape_.recent - 1 - (n - e));
}

result<append_plan> page_store::plan_append(sequence_state& s, int layer, int64_t m,
                                            std::span<const format_id> formats) {
  layer_state& ls = s.layers[size_t(layer)];
  append_plan plan;
  plan.window_offset = s.window_offset;
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
  // The window first: the lanes after the sequence's run, or a run elsewhere.
  if (const int lanes = lanes_for(ls.n + m); lanes > s.ring_lanes) {
    const int more = lanes - s.ring_lanes;
    if (lanes_free(s.ring_block, s.ring_lane + s.ring_lanes, more)) {
      plan.grown = {s.ring_block, s.ring_lane + s.ring_lanes, more};
      std::fill_n(ring_blocks_[s.ring_block].begin() + plan.grown.lane, more, uint8_t(1));
    } else if (const std::optional<lane_run> run = take_lanes(lanes)) {
      plan.grown = *run;
      plan.moved = true;
      plan.window_offset = run->block + uint64_t(run->lane) * lane_bytes();
    } else {
      return status{errc::out_of_budget,
                    fmt::format("append of {} tokens to sequence {} layer {} grows its FP16 windows to {} lanes and needs "
                                "a ring block of {} bytes; {} of {} budget bytes free, largest block {}; nothing was "
                                "stored",
                                m, s.id, layer, lanes, window_block_bytes(), arena_.free_bytes(), arena_.capacity(),
                                arena_.largest_free())};
    }
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
  give_lanes(plan.grown);
  plan.grown = {};
}

void page_store::commit_append(sequence_state& s, int layer, int64_t m, append_plan&& plan) {
  layer_state& ls = s.layers[size_t(layer)];
  const size_t first = ls.pages.size();
  ls.pages.insert(ls.pages.end(), plan.entries.begin(), plan.entries.end());
  for (size_t i = first; i < ls.pages.size(); i += size_t(shape_.kv_heads) * 2) ref_block(ls, i);
  if (plan.moved) {
    give_lanes({s.ring_block, s.ring_lane, s.ring_lanes});
    s.ring_block = plan.grown.block;
    s.ring_lane = plan.grown.lane;
    s.ring_lanes = plan.grown.lanes;
    s.window_offset = plan.window_offset;
  } else {
    s.ring_lanes += plan.grown.lanes;
  }
  ls.n += m;
  ls.e += int64_t(plan.pages) * shape_.page_tokens;
  ls.ring_from = std::max(ls.ring_from, ls.n - shape_.window);
  totals_.tokens += m;
}

KVQ_NAMESPACE_END
