// KVCache: validation and bookkeeping shared by every backend; the data plane is the backend's.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <kvq/cache/cache.hpp>
#include <kvq/detail/backend.hpp>
#include <kvq/format/spec.hpp>
#include <kvq/policy/static_policy.hpp>

#include "cache_calls.hpp"

KVQ_NAMESPACE_BEGIN

namespace detail {
status validate_config(const cache_config& c) {
  const auto& s = c.shape;
  auto bad = [](std::string m) { return status{errc::invalid_argument, "cache_config: " + m}; };
  // Every size has an upper bound, so that no allocation made from it can fail as anything but
  // a status (the bounds are far above any model's).
  if (s.layers <= 0 || s.layers > 4096) return bad(fmt::format("layers {} must be in [1, 4096]", s.layers));
  if (s.kv_heads <= 0 || s.q_heads <= 0 || s.kv_heads > 256 || s.q_heads > 2048)
    return bad(fmt::format("q_heads {} and kv_heads {} must be in [1, 2048] and [1, 256]", s.q_heads, s.kv_heads));
  if (s.q_heads % s.kv_heads != 0)
    return bad(
        fmt::format("q_heads {} is not a multiple of kv_heads {} (GQA groups must be whole)", s.q_heads, s.kv_heads));
  if (s.head_dim <= 0 || s.head_dim % 8 != 0 || s.head_dim > 256)
    return bad(fmt::format("head_dim {} must be a multiple of 8 in [8, 256]", s.head_dim));
  if (s.page_tokens <= 0 || s.page_tokens % 32 != 0 || s.page_tokens > 4096)
    return bad(fmt::format("page_tokens {} must be a multiple of 32 in [32, 4096]", s.page_tokens));
  if (s.recent < 0) return bad(fmt::format("recent {} must be >= 0", s.recent));
  if (s.window > 65536) return bad(fmt::format("window {} must be at most 65536", s.window));
  if (s.window < s.page_tokens + s.recent || s.window % s.page_tokens != 0)
    return bad(fmt::format("window {} must be a multiple of page_tokens {} and >= page_tokens + recent ({})", s.window,
                           s.page_tokens, s.page_tokens + s.recent));
  if (c.cpu_threads < 1 || c.cpu_threads > 256)
    return bad(fmt::format("cpu_threads {} must be in [1, 256]", c.cpu_threads));
  if (c.max_sequences <= 0 || c.max_sequences > (1 << 20))
    return bad(fmt::format("max_sequences {} must be in [1, 2^20]", c.max_sequences));
  if (c.where == backend::cuda && (c.max_tokens <= 0 || c.max_tokens > (int64_t(1) << 30)))
    return bad(fmt::format("max_tokens {} must be in [1, 2^30]", c.max_tokens));
  if (!(c.softmax_scale >= 0.f) || !std::isfinite(c.softmax_scale))
    return bad(fmt::format("softmax_scale {} must be finite and >= 0 (0 = 1/sqrt(head_dim))", c.softmax_scale));
  if (c.sink_pages < 0 || int64_t(c.sink_pages) * s.page_tokens > c.max_tokens)
    return bad(fmt::format("sink_pages {} must be in [0, max_tokens / page_tokens = {}]", c.sink_pages,
                           c.max_tokens / s.page_tokens));
  if (c.where == backend::cuda) {  // the page tables, allocated at creation: a size that overflows is refused here
    const double pages = std::ceil(double(c.max_tokens) / s.page_tokens);
    const double bytes = double(c.max_sequences) * s.layers * pages * (4.0 + 2.0 * s.kv_heads);
    if (bytes > double(uint64_t(1) << 48))
      return bad(fmt::format("the CUDA page tables of max_sequences {} x layers {} x max_tokens {} would take {:.3g} "
                             "bytes",
                             c.max_sequences, s.layers, c.max_tokens, bytes));
  }
  if (c.where == backend::cuda && c.rotation.any() && s.kv_heads > 32)
    return bad(fmt::format("rotation on CUDA takes at most 32 kv heads (a bit mask per layer); kv_heads is {}",
                           s.kv_heads));
  if (!c.attention.empty() && c.attention.size() != size_t(s.layers))
    return bad(fmt::format("attention holds {} variants for {} layers (one per layer, or none)", c.attention.size(),
                           s.layers));
  for (size_t l = 0; l < c.attention.size(); ++l) {
    const std::string what = fmt::format("cache_config: attention of layer {}", l);
    KVQ_TRY(check_variant(c.attention[l], s.q_heads, what.c_str()));
  }
  return c.rotation.validate(s);
}

status check_kv_view(const tensor_view& t, const char* call, const char* which, const cache_shape& s) {
  if (!t.data && t.tokens > 0) return {errc::invalid_argument, fmt::format("{}: {} data is null", call, which)};
  if (t.tokens <= 0)
    return {errc::invalid_argument, fmt::format("{}: {} has {} tokens; need at least 1", call, which, t.tokens)};
  if (t.heads != s.kv_heads || t.head_dim != s.head_dim)
    return {errc::invalid_argument, fmt::format("{}: {} is [{}][{}][{}], the cache expects [tokens][{}][{}]", call,
                                                which, t.tokens, t.heads, t.head_dim, s.kv_heads, s.head_dim)};
  if (t.stride() < int64_t(s.kv_heads) * s.head_dim)
    return {errc::invalid_argument, fmt::format("{}: {} token_stride {} is smaller than kv_heads*head_dim {}", call,
                                                which, t.stride(), s.kv_heads * s.head_dim)};
  return {};
}

// The checks `append` and `append_batch` share: the layer, both views, equal token counts.
status check_append(const char* call, int layer, const tensor_view& k, const tensor_view& v, const cache_shape& s) {
  if (layer < 0 || layer >= s.layers)
    return {errc::invalid_argument, fmt::format("{}: layer {} out of range [0, {})", call, layer, s.layers)};
  KVQ_TRY(check_kv_view(k, call, "K", s));
  KVQ_TRY(check_kv_view(v, call, "V", s));
  if (k.tokens != v.tokens)
    return {errc::invalid_argument, fmt::format("{}: K has {} tokens but V has {}", call, k.tokens, v.tokens)};
  return {};
}

// A query or output view of `tokens` rows: [tokens][q_heads][head_dim].
status check_queries(const char* call, const char* which, const void* data, int64_t tokens, int heads, int d,
                     int64_t stride, int64_t expected, const cache_shape& sh) {
  if (!data) return {errc::invalid_argument, fmt::format("{}: {} data is null", call, which)};
  if (tokens != expected || heads != sh.q_heads || d != sh.head_dim)
    return {errc::invalid_argument,
            fmt::format("{}: {} is [{}][{}][{}], expected [{}][{}][{}] (tokens, q_heads, head_dim)", call, which,
                        tokens, heads, d, expected, sh.q_heads, sh.head_dim)};
  if (stride < int64_t(heads) * d)
    return {errc::invalid_argument,
            fmt::format("{}: {} token_stride {} is below q_heads*head_dim", call, which, stride)};
  return {};
}
status check_q_o(const char* call, const tensor_view& q, const tensor_mut& o, int64_t expected, const cache_shape& sh) {
  KVQ_TRY(check_queries(call, "Q", q.data, q.tokens, q.heads, q.head_dim, q.stride(), expected, sh));
  return check_queries(call, "O", o.data, o.tokens, o.heads, o.head_dim, o.stride(), expected, sh);
}

// CUDA page tables hold max_tokens per sequence.
status check_capacity(const cache_config& cfg, const char* call, seq_id id, int layer, int64_t n, int64_t tokens) {
  if (cfg.where == backend::cuda && n + tokens > cfg.max_tokens)
    return {errc::out_of_budget, fmt::format("{}: sequence {} layer {} would hold {} tokens, above max_tokens {}", call,
                                             id, layer, n + tokens, cfg.max_tokens)};
  return {};
}
// Asks the policy for the formats of the pages an append of m tokens to (s, layer) creates and
// has the store allocate them; the store knows formats, not policies.
// A planned append that moves the sequence's window to a longer run of lanes: its rings are copied
// there and the backend writes the append there (the caller restores `window_offset` if the
// append fails; the store commits or abandons the move with the plan).
status move_window(const cache_shape& sh, detail::cache_backend& b, sequence_state& s, const append_plan& plan) {
  if (!plan.moved) return {};
  KVQ_TRY(b.copy_rings(s.window_offset, plan.window_offset, int64_t(s.ring_lanes) * sh.page_tokens));
  s.window_offset = plan.window_offset;
  return {};
}

result<append_plan> plan_pages(cache_state& st, sequence_state& s, int layer, int64_t m) {
  page_store& store = st.store;
  const cache_shape& sh = store.shape();
  const int pages = store.new_pages(s, layer, m);
  const int64_t first_token = s.layers[size_t(layer)].e;
  std::vector<format_id> formats;
  formats.reserve(size_t(pages) * sh.kv_heads * 2);
  for (int i = 0; i < pages; ++i)
    for (int h = 0; h < sh.kv_heads; ++h)
      for (role r : {role::k, role::v})
        formats.push_back(st.page_format({s.id, layer, h, r, first_token + int64_t(i) * sh.page_tokens}));
  auto plan = store.plan_append(s, layer, m, formats);
  if (!plan && plan.error().code() == errc::invalid_argument)
    return status{errc::invalid_argument,
                  fmt::format("policy {} chose an unusable format: {}", st.pol->name(), plan.error().message())};
  return plan;
}

void commit_append(cache_state& st, sequence_state& s, int layer, int64_t m, append_plan&& plan) {
  const int64_t n = s.layers[size_t(layer)].n;
  st.store.commit_append(s, layer, m, std::move(plan));
  if (const attention_variant& var = st.cfg.layer_attention(layer); var.window > 0)
    st.store.release_before(s, layer, var.first_key(n));
}

std::optional<int64_t> released_read(const cache_state& st, const sequence_state& s, int layer, int64_t pos) {
  const int64_t first = st.cfg.layer_attention(layer).first_key(pos);
  if (first >= s.layers[size_t(layer)].released) return std::nullopt;
  return first;
}

status check_window_reach(const cache_state& st, const sequence_state& s, int layer, int64_t pos, const char* call) {
  const std::optional<int64_t> first = released_read(st, s, layer, pos);
  if (!first) return {};
  const int64_t released = s.layers[size_t(layer)].released;
  return {errc::invalid_argument,
          fmt::format("{}: a query of sequence {} at position {} reads layer {} from token {}, but that sliding layer "
                      "(window {}) released its tokens before {} (attend each call's tokens before the next append)",
                      call, s.id, pos, layer, *first, st.cfg.layer_attention(layer).window, released)};
}

}  // namespace detail
using namespace detail;


result<KVCache> KVCache::create(const cache_config& cfg, std::shared_ptr<policy> pol) try {
  KVQ_TRY(validate_config(cfg));
  if (!pol) return status{errc::invalid_argument, "KVCache::create: policy is null"};
  if (status s = pol->bind(cfg.shape); !s.ok()) return s;
  auto st = std::make_unique<detail::cache_state>(cfg, std::move(pol));
  if (cfg.where == backend::cpu) {
    auto b = detail::make_cpu_backend(*st);
    if (!b) return b.error();
    return KVCache(std::move(st), std::move(b).value());
  }
  auto b = detail::make_cuda_backend(*st);
  if (!b) return b.error();
  return KVCache(std::move(st), std::move(b).value());
} catch (const std::bad_alloc&) {
  return status{errc::out_of_budget,
                fmt::format("KVCache::create: host memory ran out allocating the bookkeeping of {} layers x {} kv heads x "
                            "{} sequences",
                            cfg.shape.layers, cfg.shape.kv_heads, cfg.max_sequences)};
}

result<cache_overhead> KVCache::overhead(const cache_config& cfg) {
  KVQ_TRY(validate_config(cfg));
  cache_overhead o;
  if (cfg.where == backend::cuda) o.device_tables = detail::cuda_table_bytes(cfg);
  return o;
}

KVCache::KVCache(std::unique_ptr<detail::cache_state> st, std::unique_ptr<detail::cache_backend> b)
    : state_(std::move(st)), impl_(std::move(b)) {}
KVCache::KVCache(KVCache&&) noexcept = default;
KVCache& KVCache::operator=(KVCache&&) noexcept = default;
KVCache::~KVCache() = default;

status KVCache::create_sequence(seq_id id, stream_ref stream) {
  KVQ_CALL_STREAM(stream);
  if (state_->swapped.count(id))
    return {errc::invalid_argument, fmt::format("create_sequence({}): sequence {} already exists (swapped out)", id, id)};
  auto s = state_->store.create(id);
  if (!s) return s.error();
  if (status st = impl_->on_sequence_change(**s, true); !st.ok()) {
    (void)state_->store.release(id);
    return st;
  }
  return {};
}

status KVCache::release_sequence(seq_id id) {
  KVQ_LIVE();
  if (auto it = state_->swapped.find(id); it != state_->swapped.end()) {
    state_->swap.free(it->second.host);
    state_->swapped.erase(it);
    return {};
  }
  const sequence_state* s = state_->store.find(id);
  if (!s) return missing_sequence(*state_, "release_sequence", id);
  (void)impl_->on_sequence_change(*s, false);
  return state_->store.release(id);
}

status KVCache::fork(seq_id src, seq_id dst, stream_ref stream) {
  KVQ_CALL_STREAM(stream);
  if (state_->swapped.count(src)) return missing_sequence(*state_, "fork", src);
  if (state_->swapped.count(dst))
    return {errc::invalid_argument, fmt::format("fork({}, {}): sequence {} already exists (swapped out)", src, dst, dst)};
  auto made = state_->store.fork(src, dst);
  if (!made) return made.error();
  if (status st = impl_->fork(*state_->store.find(src), **made); !st.ok()) {
    (void)state_->store.release(dst);  // drops the new listings and the window: nothing changed
    return st;
  }
  return {};
}

status KVCache::truncate(seq_id id, int64_t length, stream_ref stream) {
  KVQ_CALL_STREAM(stream);
  sequence_state* s = state_->store.find(id);
  if (!s) return missing_sequence(*state_, "truncate", id);
  if (length < 0)
    return {errc::invalid_argument, fmt::format("truncate: sequence {} cannot keep {} tokens (negative)", id, length)};
  for (size_t l = 0; l < s->layers.size(); ++l)
    if (length > s->layers[l].n)
      return {errc::invalid_argument, fmt::format("truncate: sequence {} layer {} holds {} tokens; cannot keep {}", id,
                                                  l, s->layers[l].n, length)};
  for (int l = 0; l < int(s->layers.size()); ++l)  // the next query, at position `length`, reads what it needs
    if (const std::optional<int64_t> first = released_read(*state_, *s, l, length)) {
      const int64_t released = s->layers[size_t(l)].released;
      const int window = state_->cfg.layer_attention(l).window;
      return {errc::invalid_argument,
              fmt::format("truncate: sequence {} cannot keep {} tokens: its next query would read layer {} from token {}, "
                          "but that sliding layer (window {}) released its tokens before {}; keep at least {}",
                          id, length, l, *first, window, released, released + window - 1)};
    }
  KVQ_TRY(impl_->restore_ring(*s, length));
  state_->store.truncate(*s, length);
  return {};
}

result<uint64_t> KVCache::bytes_for(int64_t tokens, std::optional<seq_id> seq) const {
  KVQ_LIVE();
  if (tokens < 0) return status{errc::invalid_argument, fmt::format("bytes_for: {} tokens (negative)", tokens)};
  const page_store& store = state_->store;
  const sequence_state* s = nullptr;
  if (seq && !(s = store.find(*seq)))
    return missing_sequence(*state_, "bytes_for", *seq);
  const auto& sh = state_->cfg.shape;
  uint64_t bytes = store.window_bytes_for(s, tokens);
  std::vector<format_pair> pairs(size_t(sh.kv_heads));
  const uint64_t sink_block = store.block_bytes(std::vector<format_pair>(size_t(sh.kv_heads)));  // (FP16)
  for (int l = 0; l < sh.layers; ++l) {
    const int64_t n = s ? s->layers[size_t(l)].n : 0, e = s ? s->layers[size_t(l)].e : 0;
    int64_t pages = s ? store.new_pages(*s, l, tokens) : store.pages_after(0, 0, tokens);
    if (pages == 0) continue;
    // the new pages' first is page e / P of the layer; sink pages hold FP16
    int64_t first_page = e / sh.page_tokens;
    // A sliding layer keeps the pages from its last append's first_key on (`detail::commit_append`):
    // of the new ones, those after it; and the old pages it releases meanwhile free their bytes.
    uint64_t freed = 0;
    if (const attention_variant& var = state_->cfg.layer_attention(l); var.window > 0) {
      const int64_t keep_from = var.first_key(n + tokens - 1) / sh.page_tokens;  // first page kept
      const int64_t dead_new = std::clamp<int64_t>(keep_from - first_page, 0, pages);
      first_page += dead_new;
      pages -= dead_new;
      if (s) freed = store.release_bytes(*s, l, var.first_key(n + tokens - 1));
    }
    const int64_t sinks = state_->sink_pages_among(first_page, pages);
    for (int h = 0; h < sh.kv_heads; ++h) pairs[size_t(h)] = state_->pol->current(l, h);
    const uint64_t grown = uint64_t(sinks) * sink_block + uint64_t(pages - sinks) * store.block_bytes(pairs);
    bytes += grown > freed ? grown - freed : 0;
  }
  return bytes;
}

bool KVCache::has_sequence(seq_id id) const {
  if (!state_) return false;
  return state_->store.find(id) != nullptr || state_->swapped.count(id) != 0;
}

int64_t KVCache::length(seq_id id, int layer) const {
  if (!state_ || layer < 0 || layer >= state_->cfg.shape.layers) return -1;
  if (auto it = state_->swapped.find(id); it != state_->swapped.end())
    return it->second.image.sequences[0].layers[size_t(layer)].n;
  const sequence_state* s = state_->store.find(id);
  return s ? s->layers[size_t(layer)].n : -1;
}

int64_t KVCache::tokens_before_encode(seq_id id, int layer) const {
  if (!state_ || layer < 0 || layer >= state_->cfg.shape.layers) return -1;
  if (auto it = state_->swapped.find(id); it != state_->swapped.end()) {
    const blob_layer& l = it->second.image.sequences[0].layers[size_t(layer)];
    return state_->store.tokens_before_encode(l.n, l.e);
  }
  const sequence_state* s = state_->store.find(id);
  if (!s) return -1;
  const layer_state& ls = s->layers[size_t(layer)];
  return state_->store.tokens_before_encode(ls.n, ls.e);
}

status KVCache::append(seq_id id, int layer, const tensor_view& k, const tensor_view& v, stream_ref stream) {
  KVQ_CALL_STREAM(stream);
  sequence_state* s = state_->store.find(id);
  if (!s) return missing_sequence(*state_, "append", id);
  KVQ_TRY(check_append("append", layer, k, v, state_->cfg.shape));
  KVQ_TRY(check_capacity(state_->cfg, "append", id, layer, s->layers[size_t(layer)].n, k.tokens));
  impl_->poll_policy();  // decisions of finished canaries reach the pages planned now
  auto plan = plan_pages(*state_, *s, layer, k.tokens);
  if (!plan) return plan.error();
  const uint64_t window = s->window_offset;
  status st = move_window(state_->cfg.shape, *impl_, *s, *plan);
  if (st.ok()) st = impl_->write(*s, layer, k, v, *plan);
  if (!st.ok()) {
    s->window_offset = window;
    state_->store.abandon(std::move(plan).value());  // nothing was committed: give the pages back
    return st;
  }
  detail::commit_append(*state_, *s, layer, k.tokens, std::move(plan).value());
  return {};
}

status KVCache::append_batch(std::span<const append_item> items, int layer, const tensor_view& k,
                             const tensor_view& v, stream_ref stream) {
  KVQ_CALL_STREAM(stream);
  if (items.empty()) return {errc::invalid_argument, "append_batch: empty batch"};
  KVQ_TRY(check_append("append_batch", layer, k, v, state_->cfg.shape));
  std::vector<detail::cache_backend::batch_entry> entries;
  entries.reserve(items.size());
  std::vector<seq_id> ids;
  ids.reserve(items.size());
  int64_t rows = 0;
  for (const auto& it : items) {
    sequence_state* s = state_->store.find(it.seq);
    if (!s) return missing_sequence(*state_, "append_batch", it.seq);
    if (it.tokens < 1)
      return {errc::invalid_argument,
              fmt::format("append_batch: sequence {} appends {} tokens; need at least 1", it.seq, it.tokens)};
    KVQ_TRY(check_capacity(state_->cfg, "append_batch", it.seq, layer, s->layers[size_t(layer)].n, it.tokens));
    entries.push_back({s, nullptr, rows, it.tokens});
    ids.push_back(it.seq);
    rows += it.tokens;
  }
  std::sort(ids.begin(), ids.end());
  if (auto d = std::adjacent_find(ids.begin(), ids.end()); d != ids.end())
    return {errc::invalid_argument, fmt::format("append_batch: sequence {} appears more than once", *d)};
  if (rows != k.tokens)
    return {errc::invalid_argument,
            fmt::format("append_batch: the items append {} tokens but K and V have {} rows", rows, k.tokens)};
  impl_->poll_policy();  // decisions of finished canaries reach the pages planned now
  // Plan every sequence's pages; on any failure give back what was planned: nothing is stored.
  std::vector<append_plan> plans;
  plans.reserve(entries.size());
  auto abandon_all = [&] {
    for (auto& pl : plans) state_->store.abandon(std::move(pl));
  };
  for (const auto& e : entries) {
    auto plan = plan_pages(*state_, *e.s, layer, e.tokens);
    if (!plan) {
      abandon_all();
      return plan.error();
    }
    plans.push_back(std::move(plan).value());
  }
  std::vector<uint64_t> windows;
  windows.reserve(entries.size());
  status st;
  for (size_t i = 0; i < entries.size(); ++i) {
    entries[i].plan = &plans[i];
    windows.push_back(entries[i].s->window_offset);
    if (st.ok()) st = move_window(state_->cfg.shape, *impl_, *entries[i].s, plans[i]);
  }
  if (st.ok()) st = impl_->write_batch(entries, layer, k, v);
  if (!st.ok()) {
    for (size_t i = 0; i < entries.size(); ++i) entries[i].s->window_offset = windows[i];
    abandon_all();
    return st;
  }
  for (size_t i = 0; i < entries.size(); ++i)
    detail::commit_append(*state_, *entries[i].s, layer, entries[i].tokens, std::move(plans[i]));
  return {};
}

status KVCache::attend(std::span<const attend_item> items, int layer, const tensor_view& q, const tensor_mut& o,
                       stream_ref stream) {
  KVQ_CALL_STREAM(stream);
  const auto& sh = state_->cfg.shape;
  if (layer < 0 || layer >= sh.layers)
    return {errc::invalid_argument, fmt::format("attend: layer {} out of range [0, {})", layer, sh.layers)};
  if (items.empty()) return {errc::invalid_argument, "attend: empty batch"};
  int64_t total = 0;
  for (const auto& it : items) {
    const sequence_state* s = state_->store.find(it.seq);
    if (!s) return missing_sequence(*state_, "attend", it.seq);
    const int64_t n = s->layers[size_t(layer)].n;
    if (it.q_len < 1 || it.q_len > n || it.q_len > sh.window)
      return {
          errc::invalid_argument,
          fmt::format("attend: sequence {} layer {} has q_len {}; need 1 <= q_len <= min(appended tokens {}, window {})"
                      " (append the step's tokens first; a longer chunk goes through prefill)",
                      it.seq, layer, it.q_len, n, sh.window)};
    if (const int64_t from = s->layers[size_t(layer)].ring_from; n - it.q_len < from)
      return {errc::invalid_argument,
              fmt::format("attend: sequence {} layer {} has q_len {}; the ring holds only its last {} tokens since a "
                          "truncate (a step attends to the tokens appended after the cut)",
                          it.seq, layer, it.q_len, n - from)};
    KVQ_TRY(check_window_reach(*state_, *s, layer, n - it.q_len, "attend"));
    total += it.q_len;
  }
  KVQ_TRY(check_q_o("attend", q, o, total, sh));
  impl_->poll_policy();
  return impl_->attend(items, layer, q, o);
}

status KVCache::prefill(seq_id id, int layer, const tensor_view& k, const tensor_view& v, const tensor_view& q,
                        const tensor_mut& o, stream_ref stream) {
  KVQ_CALL_STREAM(stream);
  const auto& sh = state_->cfg.shape;
  sequence_state* s = state_->store.find(id);
  if (!s) return missing_sequence(*state_, "prefill", id);
  KVQ_TRY(check_append("prefill", layer, k, v, sh));
  KVQ_TRY(check_q_o("prefill", q, o, k.tokens, sh));
  if (!impl_->prefill_any_length()) {
    if (k.tokens > sh.window)
      return {
          errc::unsupported,
          fmt::format("prefill: a chunk of {} tokens is longer than the window {}, and this backend serves a prefill "
                      "as append + attend (feed chunks of at most the window)",
                      k.tokens, sh.window)};
    KVQ_TRY(append(id, layer, k, v, stream));
    const attend_item item{id, int(k.tokens)};
    return attend({&item, 1}, layer, q, o, stream);
  }
  const int64_t prefix = s->layers[size_t(layer)].n;
  KVQ_TRY(impl_->prepare_prefill(*s, layer, k.tokens));  // e.g. the device workspace, before anything is stored
  KVQ_TRY(append(id, layer, k, v, stream));              // validates values and budget; stores nothing on failure
  return impl_->prefill(*s, layer, prefix, k, v, q, o);  // (on this call's stream, as the append)
}

status KVCache::attend_prefix(seq_id id, int layer, int64_t prefix, const tensor_view& q, const tensor_mut& o,
                              float* lse, stream_ref stream) {
  KVQ_CALL_STREAM(stream);
  const auto& sh = state_->cfg.shape;
  const sequence_state* s = state_->store.find(id);
  if (!s) return missing_sequence(*state_, "attend_prefix", id);
  if (layer < 0 || layer >= sh.layers)
    return {errc::invalid_argument, fmt::format("attend_prefix: layer {} out of range [0, {})", layer, sh.layers)};
  const int64_t n = s->layers[size_t(layer)].n;
  if (prefix < 0 || prefix > n)
    return {errc::invalid_argument, fmt::format("attend_prefix: prefix {} of sequence {} layer {} is outside [0, {}] "
                                                "(the stored tokens)",
                                                prefix, id, layer, n)};
  if (q.tokens < 1)
    return {errc::invalid_argument, fmt::format("attend_prefix: Q has {} tokens; need at least 1", q.tokens)};
  KVQ_TRY(check_q_o("attend_prefix", q, o, q.tokens, sh));
  if (!lse) return {errc::invalid_argument, "attend_prefix: lse is null"};
  KVQ_TRY(check_window_reach(*state_, *s, layer, prefix, "attend_prefix"));
  impl_->poll_policy();
  return impl_->attend_prefix(*s, layer, prefix, q, o, lse);
}

status KVCache::read(seq_id id, int layer, role r, std::span<float> out, stream_ref stream) const {
  KVQ_CALL_STREAM(stream);
  const auto& sh = state_->cfg.shape;
  const sequence_state* s = state_->store.find(id);
  if (!s) return missing_sequence(*state_, "read", id);
  if (layer < 0 || layer >= sh.layers)
    return {errc::invalid_argument, fmt::format("read: layer {} out of range", layer)};
  const size_t need = size_t(s->layers[size_t(layer)].n) * sh.kv_heads * sh.head_dim;
  if (out.size() < need)
    return {errc::invalid_argument, fmt::format("read: output holds {} floats, need {}", out.size(), need)};
  return impl_->read(*s, layer, r, out);
}

std::string clip_percentile_error(float p) {
  if (!(p >= 50.f && p <= 100.f)) return fmt::format("clip percentile {} is not in [50, 100]", p);
  const int tail = codec::percentile_tail(p, codec::max_rolealign_group);
  if (tail > codec::max_percentile_tail)
    return fmt::format(
        "clip percentile {} needs the {} smallest and largest values of a {}-value group (ra<b>/g{}); the encoder "
        "keeps at most {} from each end",
        p, tail, codec::max_rolealign_group, codec::max_rolealign_group, codec::max_percentile_tail);
  return {};
}

status KVCache::set_clip_percentiles(std::span<const float> percentiles) {
  KVQ_LIVE();
  const auto& sh = state_->cfg.shape;
  const size_t need = size_t(sh.layers) * sh.kv_heads * 2;
  if (percentiles.size() != need)
    return {errc::invalid_argument, fmt::format("set_clip_percentiles: got {} percentiles, need layers*kv_heads*2 = {}",
                                                percentiles.size(), need)};
  for (size_t i = 0; i < need; ++i)
    if (const std::string e = clip_percentile_error(percentiles[i]); !e.empty())
      return {errc::invalid_argument, fmt::format("set_clip_percentiles: layer {}, head {}, {}: {}",
                                                  i / (2 * sh.kv_heads), (i / 2) % sh.kv_heads, i % 2 ? "V" : "K", e)};
  state_->clip.assign(percentiles.begin(), percentiles.end());
  return {};
}

status KVCache::set_codebook_levels(format_id f, std::span<const float> levels) {
  KVQ_LIVE();
  const auto& sh = state_->cfg.shape;
  if (!codec::is_codebook_format(f))
    return {errc::invalid_argument,
            fmt::format("set_codebook_levels: format {} is not a codebook format (cb2, cb3 or cb4, any group)",
                        f < format_count ? format_name(f) : std::to_string(int(f)))};
  const int n = 1 << traits_of(f).bits;
  const size_t units = size_t(sh.layers) * sh.kv_heads * 2;
  if (status s = check_codebook_table(levels, traits_of(f).bits, units, sh.kv_heads, format_name(f),
                                      [&](int l, int h, bool v) {
                                        return fmt::format("{} layer {} head {} {}", format_name(f), l, h,
                                                           v ? "V" : "K");
                                      });
      !s.ok())
    return {s.code(), "set_codebook_levels: " + s.message()};
  std::vector<float> before = state_->levels;
  for (size_t u = 0; u < units; ++u)
    std::copy_n(levels.begin() + std::ptrdiff_t(u * size_t(n)), n,
                state_->levels.begin() + std::ptrdiff_t(codec::codebook_level_offset(u, f)));
  if (status s = impl_->levels_changed(); !s.ok()) {
    state_->levels = std::move(before);
    (void)impl_->levels_changed();
    return {s.code(), "set_codebook_levels: " + s.message() + "; the previous levels stay"};
  }
  return {};
}

result<std::vector<float>> KVCache::codebook_levels(format_id f) const {
  KVQ_LIVE();
  const auto& sh = state_->cfg.shape;
  if (!codec::is_codebook_format(f))
    return status{errc::invalid_argument, fmt::format("codebook_levels: format {} is not a codebook format",
                                                      f < format_count ? format_name(f) : std::to_string(int(f)))};
  const int n = 1 << traits_of(f).bits;
  const size_t units = size_t(sh.layers) * sh.kv_heads * 2;
  std::vector<float> out(units * size_t(n));
  for (size_t u = 0; u < units; ++u)
    std::copy_n(state_->levels.begin() + std::ptrdiff_t(codec::codebook_level_offset(u, f)), n,
                out.begin() + std::ptrdiff_t(u * size_t(n)));
  return out;
}

status KVCache::check(stream_ref stream) {
  KVQ_CALL_STREAM(stream);
  auto got = impl_->take_refusals();
  if (!got) return got.error();
  const auto& r = *got;
  if (r.rows == 0 && r.slots.empty()) return {};
  page_store& store = state_->store;
  std::vector<seq_id> restored;
  for (auto& [id, s] : store.sequences()) {
    if (std::find(r.slots.begin(), r.slots.end(), s.slot) == r.slots.end()) continue;
    restored.push_back(id);
    sequence_state& seq = *store.find(id);
    for (const auto& x : r.layers)
      if (x.slot == seq.slot) store.rewind(seq, x.layer, x.n, x.e, x.ring_from);
  }
  std::sort(restored.begin(), restored.end());
  return {errc::non_finite,
          fmt::format("check: append of sequence {} layer {} token {} held NaN, Inf or a value outside the fp16 range: "
                      "{} row(s) refused on the device since the last check; {}",
                      r.seq, r.layer, r.token, r.rows,
                      restored.empty() ? std::string("no sequence is held now (released since)")
                                       : fmt::format("sequence(s) {} restored to their state before their first "
                                                     "refused append",
                                                     fmt::join(restored, ", ")))};
}

status KVCache::sync_policy() {
  KVQ_LIVE();
  return impl_->sync_policy();
}

status KVCache::flush_policy() {
  KVQ_LIVE();
  return impl_->flush_policy();
}

cache_stats KVCache::stats() const {
  if (!state_) return {};
  const auto& st = state_->store;
  const auto& t = st.totals();
  cache_stats out;
  out.budget_bytes = st.arena().capacity();
  out.used_bytes = st.arena().used();
  out.free_bytes = st.arena().free_bytes();
  out.largest_free_block = st.arena().largest_free();
  out.page_bytes = t.page_bytes;
  out.shared_pages = t.shared_pages;
  out.shared_saved_bytes = t.shared_saved_bytes;
  out.window_bytes = t.window_bytes;
  out.pages = t.pages;
  out.sequences = int64_t(st.sequences().size());
  out.tokens = t.tokens;
  out.encoded_elements = t.encoded_elements;
  out.bytes_by_format = t.bytes_by_format;
  out.pages_by_format = t.pages_by_format;
  const auto& sh = state_->cfg.shape;
  out.format_map.reserve(size_t(sh.layers) * sh.kv_heads);
  for (int l = 0; l < sh.layers; ++l)
    for (int h = 0; h < sh.kv_heads; ++h) out.format_map.push_back(state_->pol->current(l, h));
  out.overhead = impl_->overhead();
  out.swapped_sequences = int64_t(state_->swapped.size());
  out.swap_used_bytes = state_->swap.used();
  out.swap_capacity_bytes = state_->swap.capacity();
  out.swapped_out_bytes = state_->swapped_out_bytes;
  out.swapped_in_bytes = state_->swapped_in_bytes;
  return out;
}

const cache_config& KVCache::config() const {
  static const cache_config none;
  return state_ ? state_->cfg : none;
}
policy& KVCache::active_policy() const {
  static static_policy none;  // a moved-from cache's: FP16, binds to nothing
  return state_ ? *state_->pol : none;
}

KVQ_NAMESPACE_END
