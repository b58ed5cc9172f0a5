// decode_step: the host half of a replayable decode step (include/kvq/cache/decode_step.hpp):
// validation and bookkeeping as KVCache::append_batch keeps it, every layer at once; the
// descriptors and launches are the backend's (`detail::step_backend`).
#include <kvq/cache/decode_step.hpp>
#include <kvq/detail/backend.hpp>

#include "cache_calls.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

KVQ_NAMESPACE_BEGIN

result<decode_step> decode_step::create(KVCache& cache, int max_batch, int64_t max_tokens) {
  if (!cache.state_) return detail::moved_from("decode_step::create");
  const detail::cache_state& st = *cache.state_;
  if (max_batch < 1) return status{errc::invalid_argument, fmt::format("decode_step: max_batch {} (need >= 1)", max_batch)};
  if (st.cfg.where == backend::cuda && max_tokens > st.cfg.max_tokens)
    return status{errc::invalid_argument, fmt::format("decode_step: max_tokens {} above the cache's max_tokens {}",
                                                      max_tokens, st.cfg.max_tokens)};
  if (st.pol->wants_queries())
    return status{errc::unsupported, fmt::format("decode_step: policy {} watches queries; its device canary runs outside "
                                                 "a replayed step (use eager append_batch + attend)",
                                                 st.pol->name())};
  // The formats each layer's new pages will have: the policy's map (table-driven policies keep
  // it; a page chosen wider is refused by prepare). The launches are planned for them and for
  // the pages the layers hold (the backend raises `layers` to its plan).
  const cache_shape& sh = st.cfg.shape;
  std::vector<detail::step_layer> layers(size_t(sh.layers));
  for (int l = 0; l < sh.layers; ++l) {
    detail::step_layer& sl = layers[size_t(l)];
    sl = {0, true, false};  // (a map gives each head one pair; the backend adds the pages the layer holds)
    for (int h = 0; h < sh.kv_heads; ++h) {
      const format_pair f = st.pol->current(l, h);
      // the bits the backend's kernels plan for (`cache_backend::plan_bits`)
      sl.max_bits = std::max({sl.max_bits, cache.impl_->plan_bits(f.k), cache.impl_->plan_bits(f.v)});
    }
  }
  auto impl = cache.impl_->make_step(max_batch, max_tokens, layers);
  if (!impl) return impl.error();
  return decode_step(cache, std::move(impl).value(), max_batch, max_tokens, std::move(layers));
}

decode_step::decode_step(KVCache& cache, std::unique_ptr<detail::step_backend> impl, int max_batch, int64_t max_tokens,
                         std::vector<detail::step_layer> layers)
    : cache_(&cache),
      impl_(std::move(impl)),
      layers_(std::move(layers)),
      max_batch_(max_batch),
      max_tokens_(max_tokens) {}
decode_step::decode_step(decode_step&&) noexcept = default;
decode_step& decode_step::operator=(decode_step&&) noexcept = default;
decode_step::~decode_step() = default;

status decode_step::prepare(std::span<const seq_id> seqs) {
  if (!impl_ || !cache_ || !cache_->state_) return detail::moved_from("decode_step::prepare (the step or its cache)");
  detail::cache_state& st = *cache_->state_;
  const cache_shape& sh = st.cfg.shape;
  if (seqs.empty() || seqs.size() > size_t(max_batch_))
    return {errc::invalid_argument,
            fmt::format("decode_step::prepare: {} sequences; the step takes 1 to max_batch {}", seqs.size(), max_batch_)};
  std::vector<sequence_state*> ss;
  ss.reserve(seqs.size());
  for (const seq_id id : seqs) {
    sequence_state* s = st.store.find(id);
    if (!s) return missing_sequence(st, "decode_step::prepare", id);
    for (int l = 0; l < sh.layers; ++l) {
      const int64_t n = s->layers[size_t(l)].n;
      if (n + 1 > max_tokens_)
        return {errc::out_of_budget, fmt::format("decode_step::prepare: sequence {} layer {} would hold {} tokens, above "
                                                 "the step's max_tokens {}",
                                                 id, l, n + 1, max_tokens_)};
      KVQ_TRY(detail::check_capacity(st.cfg, "decode_step::prepare", id, l, n, 1));
    }
    ss.push_back(s);
  }
  KVQ_TRY(impl_->can_prepare());
  // The pages the step creates, in the formats the policy chooses for them: none may be wider
  // than the formats the step's launches were planned for. Their bytes (and the windows') must
  // fit in one free block: then none of the step's allocations can fail, and every check is
  // behind us before the first layer's bookkeeping changes.
  uint64_t need = 0;
  std::vector<format_pair> pairs(size_t(sh.kv_heads));
  for (const sequence_state* s : ss) {
    need += st.store.window_bytes_for(s, 1);
    for (int l = 0; l < sh.layers; ++l) {
      const int pages = st.store.new_pages(*s, l, 1);
      for (int i = 0; i < pages; ++i) {
        for (int h = 0; h < sh.kv_heads; ++h)
          for (const role r : {role::k, role::v}) {
            const int64_t first = s->layers[size_t(l)].e + int64_t(i) * sh.page_tokens;
            const format_id f = st.page_format({s->id, l, h, r, first});
            (r == role::k ? pairs[size_t(h)].k : pairs[size_t(h)].v) = f;
            // (a sink page's FP16 is read from global memory under any plan)
            const detail::step_layer& sl = layers_[size_t(l)];
            const int bits = cache_->impl_->plan_bits(f, sl.three_bit);
            if (first >= st.sink_tokens() && bits > sl.max_bits)
              return {errc::unsupported,
                      fmt::format("decode_step::prepare: layer {} kv head {}: policy {} chose {} ({} bits) for a new "
                                  "page of sequence {}; the step was planned for at most {} kernel bits in this layer (make "
                                  "a new decode_step); nothing was changed",
                                  l, h, st.pol->name(), format_name(f), bits, s->id, sl.max_bits)};
          }
        need += st.store.block_bytes(pairs);
      }
    }
  }
  std::vector<seq_id> ids(seqs.begin(), seqs.end());
  std::sort(ids.begin(), ids.end());
  if (auto d = std::adjacent_find(ids.begin(), ids.end()); d != ids.end())
    return {errc::invalid_argument, fmt::format("decode_step::prepare: sequence {} appears more than once", *d)};
  const cache_stats now = cache_->stats();
  if (need > now.largest_free_block)
    return {errc::out_of_budget,
            fmt::format("decode_step::prepare: the step's new pages and windows take {} bytes; the largest free block "
                        "holds {} ({} of the budget free); nothing was changed",
                        need, now.largest_free_block, now.free_bytes)};
  std::vector<append_plan> plans(ss.size());
  std::vector<uint64_t> windows(ss.size());
  std::vector<detail::step_backend::entry> entries(ss.size());
  for (int l = 0; l < sh.layers; ++l) {
    // Not reached by an allocation (the step's bytes fit one free block) nor by a format (each
    // was checked): a failed ring copy or descriptor check gives the layer's plans back, and the
    // layers before it stay advanced.
    auto undo = [&](size_t planned, const status& why) {
      for (size_t j = 0; j < planned; ++j) {
        ss[j]->window_offset = windows[j];
        st.store.abandon(std::move(plans[j]));
      }
      return status{why.code(), fmt::format("decode_step::prepare: layer {}: {}; the layers before it hold the step's "
                                            "token (drop it with truncate)",
                                            l, why.message())};
    };
    for (size_t i = 0; i < ss.size(); ++i) {
      windows[i] = ss[i]->window_offset;
      auto plan = detail::plan_pages(st, *ss[i], l, 1);
      if (!plan) return undo(i, plan.error());
      plans[i] = std::move(plan).value();
      if (status moved = detail::move_window(sh, *cache_->impl_, *ss[i], plans[i]); !moved.ok()) return undo(i + 1, moved);
      entries[i] = {ss[i], &plans[i]};
    }
    if (status staged = impl_->stage(entries, l); !staged.ok()) return undo(ss.size(), staged);
    for (size_t i = 0; i < ss.size(); ++i) detail::commit_append(st, *ss[i], l, 1, std::move(plans[i]));
  }
  KVQ_TRY(impl_->upload());
  batch_ = int(seqs.size());
  return {};
}

size_t decode_step::descriptor_bytes() const { return impl_ ? impl_->descriptor_bytes() : 0; }

status decode_step::append(int layer, const tensor_view& k, const tensor_view& v) {
  if (!impl_ || !cache_ || !cache_->state_) return detail::moved_from("decode_step::append (the step or its cache)");
  const cache_shape& sh = cache_->state_->cfg.shape;
  if (batch_ == 0) return {errc::invalid_argument, "decode_step::append: no step prepared (call prepare first)"};
  if (layer < 0 || layer >= sh.layers)
    return {errc::invalid_argument, fmt::format("decode_step::append: layer {} out of range [0, {})", layer, sh.layers)};
  KVQ_TRY(detail::check_kv_view(k, "decode_step::append", "K", sh));
  KVQ_TRY(detail::check_kv_view(v, "decode_step::append", "V", sh));
  if (k.tokens != max_batch_ || v.tokens != max_batch_)
    return {errc::invalid_argument, fmt::format("decode_step::append: K has {} rows and V {}; the step takes max_batch {}",
                                                k.tokens, v.tokens, max_batch_)};
  return impl_->append(layer, k, v);
}

status decode_step::attend(int layer, const tensor_view& q, const tensor_mut& o) {
  if (!impl_ || !cache_ || !cache_->state_) return detail::moved_from("decode_step::attend (the step or its cache)");
  const cache_shape& sh = cache_->state_->cfg.shape;
  if (batch_ == 0) return {errc::invalid_argument, "decode_step::attend: no step prepared (call prepare first)"};
  if (layer < 0 || layer >= sh.layers)
    return {errc::invalid_argument, fmt::format("decode_step::attend: layer {} out of range [0, {})", layer, sh.layers)};
  KVQ_TRY(detail::check_q_o("decode_step::attend", q, o, max_batch_, sh));
  return impl_->attend(layer, q, o);
}

KVQ_NAMESPACE_END
