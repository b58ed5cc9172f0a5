// The CUDA backend's device canary scheduling (canary_runner.hpp).
#include "canary_runner.hpp"

#include <kvq/store/window_layout.hpp>

#include "status.hpp"

#include <fmt/format.h>

#include <algorithm>

KVQ_NAMESPACE_BEGIN
namespace detail {

using cuda::detail::cuda_status;

canary_runner::~canary_runner() {
  for (slot& c : slots_) {
    if (c.done) {
      cudaEventSynchronize(c.done);  // a kernel in flight may still write the results
      cudaEventDestroy(c.done);
    }
    if (c.host) cudaFreeHost(c.host);
  }
}

status canary_runner::init() {
  if (!pol_.wants_queries()) return {};
  proto_ = pol_.canary();
  const canary_spec* spec = proto_ ? proto_->device_canary() : nullptr;
  if (!spec)
    return {errc::unsupported, fmt::format("policy {} observes queries on the host and has no device canary; the CUDA "
                                           "backend feeds no host observations",
                                           pol_.name())};
  spec_ = *spec;
  if (status s = cuda::canary_can_implement(args({})); !s.ok())
    return {s.code(), fmt::format("policy {}: {}", pol_.name(), s.message())};
  return {};
}

cuda::canary_args canary_runner::args(std::span<const cuda::canary_item> items) const {
  const auto& sh = cfg_.shape;
  cuda::canary_args a;
  a.q_heads = sh.q_heads;
  a.kv_heads = sh.kv_heads;
  a.head_dim = sh.head_dim;
  a.window = sh.window;
  a.ring_head_stride = int64_t(ring_halves(0, sh.kv_heads, 1, 0, sh.window, sh.head_dim));  // halves from kv head h's K ring to h + 1's
  a.tiers = spec_.tiers;
  a.align = spec_.align;
  a.scale = spec_.softmax_scale;
  a.items = items;
  return a;
}

// The staging buffer grows, rarely (to a whole step of the largest canary call seen, doubling):
// the earlier layers' rows live in the old one, so they are launched first and the launch
// finishes before the buffer goes.
status canary_runner::pick(std::span<const attend_item> items, int layer, const uint8_t* arena,
                           std::span<cuda::decode_item> launch_items) {
  due_.clear();
  if (!pol_.wants_queries()) return {};
  const auto& sh = cfg_.shape;
  int32_t rows = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const attend_item& it = items[i];
    const sequence_state& s = *store_.find(it.seq);
    const int64_t n = s.layers[size_t(layer)].n;
    proto_->note_observation();
    if (!proto_->canary_due(it.seq, n)) continue;
    const canary_keys keys(spec_.align, std::max<int64_t>(0, n - sh.window), n);
    if (keys.count() < spec_.align) {
      proto_->note_skipped();
      continue;
    }
    const auto* ring = reinterpret_cast<const uint16_t*>(arena + store_.window_offset(s, layer, 0, role::k));
    due_.push_back({i,
                    {ring, rows, it.q_len, int32_t(n), int32_t(keys.first), int32_t(keys.count())},
                    {it.seq, layer, n, keys.rows_seeing(it.q_len, n)}});
    rows += it.q_len;
  }
  if (due_.empty()) return {};
  const size_t width = size_t(sh.q_heads) * sh.head_dim;
  if (size_t(staged_rows_ + rows) * width > q_stage_.count) {
    KVQ_TRY(flush());
    KVQ_TRY(cuda_status(cudaStreamSynchronize(static_cast<cudaStream_t>(cfg_.stream)), "cudaStreamSynchronize"));
    // room for a whole step like this call (every layer) and at least twice what was there
    const size_t have = q_stage_.count / width;
    const size_t want = std::max(size_t(2) * have, size_t(rows) * size_t(sh.layers));
    KVQ_TRY(q_stage_.allocate(want * width, "canary query staging"));
  }
  for (due_item& d : due_) {
    d.item.q_row += staged_rows_;
    launch_items[d.index].stage_row = d.item.q_row;
  }
  return {};
}

void canary_runner::defer(int layer) {
  if (due_.empty()) return;
  for (const due_item& d : due_) {
    deferred_items_.push_back(d.item);
    deferred_entries_.push_back(d.e);
    staged_rows_ += d.item.q_len;
  }
  if (deferred_layer_.empty()) deferred_layer_.assign(size_t(cfg_.shape.layers), 0);
  deferred_layer_[size_t(layer)] = 1;
}

// In a decode step (per layer: append, attend) the first layer's append of the next step flushes,
// so the whole step's canary is one launch.
status canary_runner::flush_of(int layer) {
  if (deferred_layer_.size() > size_t(layer) && deferred_layer_[size_t(layer)]) return flush();
  return {};
}

status canary_runner::flush() {
  if (deferred_items_.empty()) return {};
  const auto& sh = cfg_.shape;
  launch l{0, std::move(deferred_entries_)};
  deferred_entries_ = {};
  std::fill(deferred_layer_.begin(), deferred_layer_.end(), uint8_t(0));
  staged_rows_ = 0;
  const std::vector<cuda::canary_item> items = std::move(deferred_items_);
  deferred_items_.clear();
  KVQ_TRY(take_slot(l.slot));
  const slot& c = slots_[l.slot];
  cuda::canary_args a = args(items);
  a.q = q_stage_.ptr;
  a.q_type = dtype::f32;
  a.q_stride = int64_t(sh.q_heads) * sh.head_dim;
  a.out = c.dev;
  if (status s = cuda::canary_run(a, cfg_.stream); !s.ok()) {
    free_slots_.push_back(l.slot);
    return s;
  }
  if (status s = cuda_status(cudaEventRecord(c.done, static_cast<cudaStream_t>(cfg_.stream)), "cudaEventRecord");
      !s.ok()) {
    free_slots_.push_back(l.slot);
    return s;
  }
  pending_.push_back(std::move(l));
  return {};
}

status canary_runner::take_slot(size_t& index) {
  if (!free_slots_.empty()) {
    index = free_slots_.back();
    free_slots_.pop_back();
    return {};
  }
  // Grows to the number of launches in flight (how far the host runs ahead), then never again.
  slot c;
  const size_t bytes = slot_bytes();
  KVQ_TRY(cuda_status(cudaHostAlloc(reinterpret_cast<void**>(&c.host), bytes, cudaHostAllocMapped), "cudaHostAlloc"));
  slots_.push_back(c);  // owned from here on: the destructor frees it
  slot& owned = slots_.back();
  KVQ_TRY(cuda_status(cudaHostGetDevicePointer(reinterpret_cast<void**>(&owned.dev), owned.host, 0),
                      "cudaHostGetDevicePointer"));
  KVQ_TRY(cuda_status(cudaEventCreateWithFlags(&owned.done, cudaEventDisableTiming), "cudaEventCreate"));
  index = slots_.size() - 1;
  return {};
}

status canary_runner::drain(bool wait) {
  const auto& sh = cfg_.shape;
  const size_t T = spec_.tiers.size();
  const int H = sh.kv_heads, group = sh.q_heads / sh.kv_heads;
  status first;
  while (!pending_.empty()) {
    launch& l = pending_.front();
    const slot& c = slots_[l.slot];
    const cudaError_t e = wait ? cudaEventSynchronize(c.done) : cudaEventQuery(c.done);
    if (e == cudaErrorNotReady) break;
    if (e != cudaSuccess) {
      if (first.ok()) first = cuda_status(e, "canary event");
    } else {
      for (size_t i = 0; i < l.entries.size(); ++i) {
        const entry& en = l.entries[i];
        const double* sums = c.host + i * size_t(H) * T;
        canary_measurement m{en.seq, en.layer, en.context, {}};
        if (spec_.per_head) {
          m.delta.resize(size_t(H) * T);
          for (size_t k = 0; k < m.delta.size(); ++k) m.delta[k] = sums[k] / (double(en.rows) * group);
        } else {
          m.delta.assign(T, 0.0);
          for (int h = 0; h < H; ++h)
            for (size_t t = 0; t < T; ++t) m.delta[t] += sums[size_t(h) * T + t];
          for (double& x : m.delta) x /= double(en.rows) * sh.q_heads;
        }
        if (status s = proto_->ingest(m); !s.ok() && first.ok()) first = s;
      }
    }
    free_slots_.push_back(l.slot);
    pending_.pop_front();
  }
  return first;
}

}  // namespace detail
KVQ_NAMESPACE_END
