// The CUDA backend of KVCache: the arena, page tables and windows in device memory; the host keeps
// the bookkeeping (page_store) and launches the kernels of kernels.cu on the caller's stream.
#include <kvq/cuda/canary.hpp>
#include <kvq/cuda/paged_attention.hpp>
#include <kvq/detail/backend.hpp>

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <vector>

KVQ_NAMESPACE_BEGIN
namespace detail {
namespace {

status cuda_ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  return {errc::cuda_error, fmt::format("{}: {} ({})", what, cudaGetErrorName(e), cudaGetErrorString(e))};
}

template <class T>
struct device_buffer {
  T* ptr = nullptr;
  size_t count = 0;
  device_buffer() = default;
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() {
    if (ptr) cudaFree(ptr);
  }
  // Replaces the buffer (its contents are not kept). On failure it is empty (count 0), so a later
  // size check asks for it again instead of writing through a null pointer.
  status allocate(size_t n, const char* what) {
    if (ptr) cudaFree(ptr);
    ptr = nullptr;
    count = 0;
    if (n == 0) return {};
    const cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&ptr), n * sizeof(T));
    if (e != cudaSuccess) {
      ptr = nullptr;
      return {errc::out_of_budget,
              fmt::format("cudaMalloc of {} bytes for the {} failed: {}", n * sizeof(T), what, cudaGetErrorString(e))};
    }
    count = n;
    return {};
  }
};

class cuda_backend final : public cache_backend {
 public:
  explicit cuda_backend(const cache_state& st) : cache_backend(st) {}

  ~cuda_backend() override {
    for (canary_slot& c : canary_slots_) {
      if (c.done) {
        cudaEventSynchronize(c.done);  // a kernel in flight may still write the results
        cudaEventDestroy(c.done);
      }
      if (c.host) cudaFreeHost(c.host);
    }
    if (flag_host_) cudaFreeHost(flag_host_);
  }

  status init() {
    const auto& sh = cfg_.shape;
    if (pol_->wants_queries()) {
      canary_protocol* proto = pol_->canary();
      const canary_spec* spec = proto ? proto->device_canary() : nullptr;
      if (!spec)
        return {errc::unsupported,
                fmt::format("policy {} observes queries on the host and has no device canary; the CUDA backend feeds "
                            "no host observations",
                            pol_->name())};
      canary_ = *spec;
      cuda::canary_args a = canary_args(nullptr, {});
      if (status s = cuda::canary_can_implement(a); !s.ok())
        return {s.code(), fmt::format("policy {}: {}", pol_->name(), s.message())};
    }
    int dev = 0;
    KVQ_TRY(cuda_ok(cudaGetDevice(&dev), "cudaGetDevice"));
    KVQ_TRY(cuda_ok(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute"));
    max_pages_ = int((cfg_.max_tokens + sh.page_tokens - 1) / sh.page_tokens);
    layer_bits_.assign(size_t(sh.layers), 2);
    head_pair_.assign(size_t(sh.layers) * sh.kv_heads, -1);
    KVQ_TRY(arena_.allocate(store_.arena().capacity(), "cache arena"));
    const size_t rows = size_t(cfg_.max_sequences) * sh.layers * max_pages_;
    KVQ_TRY(blocks_.allocate(rows, "device page table"));
    KVQ_TRY(fmts_.allocate(rows * sh.kv_heads * 2, "device format table"));
    KVQ_TRY(flag_.allocate(1, "value-check flag"));
    KVQ_TRY(cuda_ok(cudaMallocHost(reinterpret_cast<void**>(&flag_host_), sizeof(int)), "cudaMallocHost"));
    view_.arena = arena_.ptr;
    view_.blocks = blocks_.ptr;
    view_.fmts = fmts_.ptr;
    view_.layers = sh.layers;
    view_.kv_heads = sh.kv_heads;
    view_.head_dim = sh.head_dim;
    view_.page_tokens = sh.page_tokens;
    view_.window = sh.window;
    view_.max_pages = max_pages_;
    for (size_t f = 0; f < format_count; ++f) {
      view_.k_page_bytes[f] = uint32_t(store_.page_bytes_of(format_id(f), role::k));
      view_.v_page_bytes[f] = uint32_t(store_.page_bytes_of(format_id(f), role::v));
    }
    // Probe the kernels' constraints once, with a one-item batch.
    const cuda::decode_item probe{0, 1, 1, 0, 0, 0};
    cuda::attend_args a;
    a.kv = view_;
    a.q_heads = sh.q_heads;
    a.items = {&probe, 1};
    return cuda::attend_can_implement(a);
  }

  cudaStream_t stream() const { return static_cast<cudaStream_t>(cfg_.stream); }

  // With check_values: rejects NaN/Inf/out-of-range values of the whole call before anything is
  // stored (one synchronization).
  status check(const tensor_view& k, const tensor_view& v, const std::string& what) {
    if (!cfg_.check_values) return {};
    KVQ_TRY(cuda::check_values(k, v, flag_.ptr, cfg_.stream));
    KVQ_TRY(cuda_ok(cudaMemcpyAsync(flag_host_, flag_.ptr, sizeof(int), cudaMemcpyDeviceToHost, stream()), "cudaMemcpyAsync"));
    KVQ_TRY(cuda_ok(cudaStreamSynchronize(stream()), "cudaStreamSynchronize"));
    if (*flag_host_)
      return {errc::non_finite,
              fmt::format("{} holds NaN, Inf or a value outside the fp16 range; nothing was stored", what)};
    return {};
  }

  status write(sequence_state& s, int layer, const tensor_view& k, const tensor_view& v, const append_plan& plan) override {
    KVQ_TRY(check(k, v, fmt::format("append: K or V of sequence {} layer {}", s.id, layer)));
    KVQ_TRY(flush_canaries_of(layer));  // before the layer's rings change
    return write_pieces(s, layer, k, v, plan);
  }

  status write_batch(std::span<const batch_entry> entries, int layer, const tensor_view& k, const tensor_view& v) override {
    KVQ_TRY(check(k, v, fmt::format("append_batch: K or V of the batch (layer {})", layer)));
    KVQ_TRY(flush_canaries_of(layer));  // before the layer's rings change
    // One launch pair for as many sequences as fit (max_append_items, max_append_pages); a
    // sequence with more new pages than that (a long prefill) goes through the piecewise path.
    const int per_page = cfg_.shape.kv_heads * 2;
    batch_items_.clear();
    batch_blocks_.clear();
    batch_fmts_.clear();
    int64_t first_row = 0, rows = 0;
    auto flush = [&]() -> status {
      if (batch_items_.empty()) return {};
      cuda::append_args a = append_args(layer);
      a.items = batch_items_;
      a.k = rows_of(k, first_row, rows);
      a.v = rows_of(v, first_row, rows);
      a.page_blocks = batch_blocks_.data();
      a.page_fmts = batch_fmts_.data();
      KVQ_TRY(cuda::append_run(a, cfg_.stream));
      batch_items_.clear();
      batch_blocks_.clear();
      batch_fmts_.clear();
      first_row += rows;
      rows = 0;
      return {};
    };
    for (const batch_entry& b : entries) {
      const layer_state& ls = b.s->layers[size_t(layer)];
      const int pages = int(b.plan->entries.size() / size_t(per_page));
      if (pages > cuda::max_append_pages) {
        KVQ_TRY(flush());
        KVQ_TRY(write_pieces(*b.s, layer, rows_of(k, b.row, b.tokens), rows_of(v, b.row, b.tokens), *b.plan));
        first_row = b.row + b.tokens;
        continue;
      }
      if (batch_items_.size() == size_t(cuda::max_append_items) ||
          int(batch_blocks_.size()) + pages > cuda::max_append_pages)
        KVQ_TRY(flush());
      batch_items_.push_back({b.s->slot, int32_t(ls.n), int32_t(ls.e), int32_t(b.tokens), uint32_t(b.s->window_offset / 256),
                              int(b.plan->first_page), pages});
      add_pages(layer, *b.plan, 0, pages, batch_blocks_, batch_fmts_);
      rows += b.tokens;
    }
    return flush();
  }

  // The fields of an append call shared by every sequence of the layer.
  cuda::append_args append_args(int layer) const {
    cuda::append_args a;
    a.kv = view_;
    a.arena = arena_.ptr;
    a.blocks = blocks_.ptr;
    a.fmts = fmts_.ptr;
    a.layer = layer;
    a.clip = clip_.data() + size_t(layer) * cfg_.shape.kv_heads * 2;
    return a;
  }

  // Appends pages [first, first + count) of a plan to the block and format lists of a call (and
  // notes, for the decode kernel's choice, the widest format and whether each head has kept one
  // format pair).
  void add_pages(int layer, const append_plan& plan, int first, int count, std::vector<uint32_t>& blocks,
                 std::vector<uint8_t>& fmts) {
    const int per_page = cfg_.shape.kv_heads * 2;
    for (int i = first; i < first + count; ++i) {
      const size_t at = size_t(i) * per_page;
      blocks.push_back(uint32_t(plan.entries[at].offset / 256));
      for (int j = 0; j < per_page; ++j) {
        fmts.push_back(plan.entries[at + size_t(j)].fmt);
        layer_bits_[size_t(layer)] = std::max(layer_bits_[size_t(layer)], traits_of(plan.entries[at + size_t(j)].fmt).bits);
      }
      for (int h = 0; h < cfg_.shape.kv_heads; ++h) {
        const int pair =
            256 * int(plan.entries[at + size_t(2 * h)].fmt) + int(plan.entries[at + size_t(2 * h + 1)].fmt);
        int16_t& hp = head_pair_[size_t(layer) * cfg_.shape.kv_heads + size_t(h)];
        if (hp == -1) hp = int16_t(pair);
        else if (hp != pair) hp = -2;
      }
    }
  }

  // One sequence's append, in pieces of at most max_append_pages new pages each.
  status write_pieces(sequence_state& s, int layer, const tensor_view& k, const tensor_view& v, const append_plan& plan) {
    const auto& sh = cfg_.shape;
    const layer_state& ls = s.layers[size_t(layer)];
    int64_t n = ls.n, e = ls.e, done = 0;
    int page = 0;
    std::vector<uint32_t> blocks;
    std::vector<uint8_t> fmts;
    while (done < k.tokens) {
      int64_t piece = k.tokens - done;
      const int64_t cap = int64_t(cuda::max_append_pages) * sh.page_tokens;
      if (store_.pages_after(n, e, piece) > cuda::max_append_pages) piece = std::max<int64_t>(1, e + cap + sh.recent - n);
      const int pages = int(store_.pages_after(n, e, piece));
      blocks.clear();
      fmts.clear();
      add_pages(layer, plan, page, pages, blocks, fmts);
      const cuda::append_seq item{s.slot, int32_t(n), int32_t(e), int32_t(piece), uint32_t(s.window_offset / 256),
                                  int(plan.first_page) + page, pages};
      cuda::append_args a = append_args(layer);
      a.items = {&item, 1};
      a.k = rows_of(k, done, piece);
      a.v = rows_of(v, done, piece);
      a.page_blocks = blocks.data();
      a.page_fmts = fmts.data();
      KVQ_TRY(cuda::append_run(a, cfg_.stream));
      n += piece;
      e += int64_t(pages) * sh.page_tokens;
      page += pages;
      done += piece;
    }
    return {};
  }

  status attend(std::span<const attend_item> items, int layer, const tensor_view& q, const tensor_mut& o) override {
    KVQ_TRY(flush_canaries_of(layer));  // a repeated step of the layer
    const auto& sh = cfg_.shape;
    items_.clear();
    int32_t row = 0;
    for (const auto& it : items) {
      const sequence_state& s = *store_.find(it.seq);
      const layer_state& ls = s.layers[size_t(layer)];
      items_.push_back({s.slot, it.q_len, int32_t(ls.n), int32_t(std::min(ls.e, ls.n - it.q_len)),
                        uint32_t(s.window_offset / 256), row});
      row += it.q_len;
    }
    cuda::attend_args a;
    a.kv = view_;
    a.layer = layer;
    a.q_heads = sh.q_heads;
    a.items = items_;
    a.q = q.data;
    a.q_type = q.type;
    a.q_stride = q.stride();
    a.o = o.data;
    a.o_type = o.type;
    a.o_stride = o.stride();
    a.scale = softmax_scale();
    a.num_sms = sms_;
    a.max_page_bits = layer_bits_[size_t(layer)];
    const auto heads = head_pair_.begin() + ptrdiff_t(layer) * cfg_.shape.kv_heads;
    a.one_format_per_head = std::find(heads, heads + cfg_.shape.kv_heads, int16_t(-2)) == heads + cfg_.shape.kv_heads;
    const size_t need = cuda::attend_workspace_bytes(a);
    if (need > workspace_.count)  // grows to the largest batch shape seen, then never again
      KVQ_TRY(workspace_.allocate(need, "attention workspace"));
    KVQ_TRY(due_canaries(items, layer));
    if (!due_.empty()) a.q_stage = q_stage_.ptr;
    KVQ_TRY(cuda::attend_run(a, workspace_.ptr, workspace_.count, cfg_.stream));
    defer_canaries(layer);
    return {};
  }

  void poll_policy() override { note(drain(false)); }

  status flush_policy() override { return flush_canaries(); }

  status sync_policy() override {
    note(flush_canaries());
    note(drain(true));
    status s = canary_error_;
    canary_error_ = {};
    return s;
  }

  status read(const sequence_state& s, int layer, role r, std::span<float> out) const override {
    const auto& sh = cfg_.shape;
    KVQ_TRY(cuda_ok(cudaStreamSynchronize(stream()), "cudaStreamSynchronize"));
    const layer_state& ls = s.layers[size_t(layer)];
    std::vector<std::vector<uint8_t>> pages;
    std::vector<uint16_t> ring(size_t(sh.window) * sh.head_dim);
    std::vector<uint8_t> buf;
    int ring_head = -1;
    status err;
    auto page_at = [&](const page_entry& pe) -> const uint8_t* {
      buf.resize(store_.page_bytes_of(pe.fmt, r));
      if (status st = cuda_ok(cudaMemcpy(buf.data(), arena_.ptr + pe.offset, buf.size(), cudaMemcpyDeviceToHost), "cudaMemcpy");
          !st.ok())
        err = st;
      return buf.data();
    };
    auto ring_at = [&](int h) -> const uint16_t* {
      if (ring_head != h) {
        ring_head = h;
        if (status st = cuda_ok(cudaMemcpy(ring.data(), arena_.ptr + store_.window_offset(s, layer, h, r),
                                           ring.size() * 2, cudaMemcpyDeviceToHost),
                                "cudaMemcpy");
            !st.ok())
          err = st;
      }
      return ring.data();
    };
    gather(sh, ls, r, 0, page_at, ring_at, out.data());
    return err;
  }

 private:
  int sms_ = 132;
  int max_pages_ = 0;
  device_buffer<uint8_t> arena_;
  device_buffer<uint32_t> blocks_;
  device_buffer<uint8_t> fmts_;
  device_buffer<uint8_t> workspace_;
  device_buffer<int> flag_;
  int* flag_host_ = nullptr;
  cuda::paged_view view_;
  std::vector<cuda::decode_item> items_;
  std::vector<uint8_t> layer_bits_;  // [layers] the widest code bits of any page the layer has held
  std::vector<int16_t> head_pair_;   // [layers][kv_heads] 256 K + V of the head's pages; -1 none yet, -2 several
  std::vector<cuda::append_seq> batch_items_;  // reused by write_batch
  std::vector<uint32_t> batch_blocks_;
  std::vector<uint8_t> batch_fmts_;

  // ---- device canary -----------------------------------------------------------------------
  // An attend call with due canaries only stages the items' queries (its own launch copies them,
  // `decode_item::stage_row`); the canary of every layer of the step is launched together, once,
  // by `flush_canaries` at the next append to or attend of a layer with deferred items (before
  // its rings change), or `sync_policy`. The launch writes [items][kv_heads][tiers] sums into a
  // slot of mapped pinned memory and records the slot's event; `pending_` keeps the launches in
  // step order, and `drain` ingests them in that order once their events complete. One launch
  // per canary step instead of one per layer: the canary is latency-bound (a 128-key window), so
  // 32 layers cost little more than one does.
  struct canary_slot {
    double* host = nullptr;  // mapped pinned [max_sequences][kv_heads][tiers]
    double* dev = nullptr;   // its device alias
    cudaEvent_t done = nullptr;
  };
  struct canary_entry {
    seq_id seq;
    int layer;
    int64_t context;
    int rows;  // query rows that see a key
  };
  struct canary_launch {
    size_t slot;
    std::vector<canary_entry> entries;
  };

  cuda::canary_args canary_args(const tensor_view* q, std::span<const cuda::canary_item> items) const {
    const auto& sh = cfg_.shape;
    cuda::canary_args a;
    a.q_heads = sh.q_heads;
    a.kv_heads = sh.kv_heads;
    a.head_dim = sh.head_dim;
    a.window = sh.window;
    a.ring_head_stride = int64_t(2) * sh.window * sh.head_dim;  // store layout: [kv_heads][K, V][window][d]
    a.tiers = canary_.tiers;
    a.align = canary_.align;
    a.scale = canary_.softmax_scale;
    a.items = items;
    if (q) {
      a.q = q->data;
      a.q_type = q->type;
      a.q_stride = q->stride();
    }
    return a;
  }

  // Picks the items of this attend whose step is due (the policy's host RNG, as on the CPU) and
  // gives each a row of the query staging buffer, which the attend launch fills (its split merge
  // copies the rows: no launch of its own). The staging buffer grows, rarely (to a whole step of
  // the largest canary call seen, doubling): the earlier layers' rows live in the old one, so
  // they are launched first and the launch finishes before the buffer goes.
  status due_canaries(std::span<const attend_item> items, int layer) {
    due_.clear();
    if (!pol_->wants_queries()) return {};
    const auto& sh = cfg_.shape;
    int32_t rows = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      const attend_item& it = items[i];
      const sequence_state& s = *store_.find(it.seq);
      const int64_t n = s.layers[size_t(layer)].n;
      pol_->canary()->note_observation();
      if (!pol_->canary()->canary_due(it.seq, n)) continue;
      const canary_keys keys(canary_.align, std::max<int64_t>(0, n - sh.window), n);
      if (keys.count() < canary_.align) {
        pol_->canary()->note_skipped();
        continue;
      }
      const auto* ring = reinterpret_cast<const uint16_t*>(arena_.ptr + store_.window_offset(s, layer, 0, role::k));
      due_.push_back({i, {ring, rows, it.q_len, int32_t(n), int32_t(keys.first), int32_t(keys.count())},
                      {it.seq, layer, n, keys.rows_seeing(it.q_len, n)}});
      rows += it.q_len;
    }
    if (due_.empty()) return {};
    const size_t width = size_t(sh.q_heads) * sh.head_dim;
    if (size_t(staged_rows_ + rows) * width > q_stage_.count) {
      KVQ_TRY(flush_canaries());
      KVQ_TRY(cuda_ok(cudaStreamSynchronize(stream()), "cudaStreamSynchronize"));
      // room for a whole step like this call (every layer) and at least twice what was there
      const size_t have = q_stage_.count / width;
      const size_t want = std::max(size_t(2) * have, size_t(rows) * size_t(sh.layers));
      KVQ_TRY(q_stage_.allocate(want * width, "canary query staging"));
    }
    for (due_canary& d : due_) {
      d.item.q_row += staged_rows_;
      items_[d.index].stage_row = d.item.q_row;
    }
    return {};
  }

  // After the attend launch that staged their queries: the due items wait for the step's flush.
  void defer_canaries(int layer) {
    if (due_.empty()) return;
    for (const due_canary& d : due_) {
      deferred_items_.push_back(d.item);
      deferred_entries_.push_back(d.entry);
      staged_rows_ += d.item.q_len;
    }
    if (deferred_layer_.empty()) deferred_layer_.assign(size_t(cfg_.shape.layers), 0);
    deferred_layer_[size_t(layer)] = 1;
  }

  // The deferred canaries of a layer read its rings as they are now: an append to the layer, or
  // its next attend (the staged rows are one per layer and step), first launches every deferred
  // canary. In a decode step (per layer: append, attend) that is the first layer's append of the
  // next step, so the whole step's canary is one launch.
  status flush_canaries_of(int layer) {
    if (deferred_layer_.size() > size_t(layer) && deferred_layer_[size_t(layer)]) return flush_canaries();
    return {};
  }

  // Launches the canary of every staged item (every layer of the step) in one launch.
  status flush_canaries() {
    if (deferred_items_.empty()) return {};
    const auto& sh = cfg_.shape;
    canary_launch launch{0, std::move(deferred_entries_)};
    deferred_entries_ = {};
    std::fill(deferred_layer_.begin(), deferred_layer_.end(), uint8_t(0));
    staged_rows_ = 0;
    const std::vector<cuda::canary_item> items = std::move(deferred_items_);
    deferred_items_.clear();
    KVQ_TRY(take_slot(launch.slot));
    const canary_slot& c = canary_slots_[launch.slot];
    cuda::canary_args a = canary_args(nullptr, items);
    a.q = q_stage_.ptr;
    a.q_type = dtype::f32;
    a.q_stride = int64_t(sh.q_heads) * sh.head_dim;
    a.out = c.dev;
    if (status s = cuda::canary_run(a, cfg_.stream); !s.ok()) {
      free_slots_.push_back(launch.slot);
      return s;
    }
    if (status s = cuda_ok(cudaEventRecord(c.done, stream()), "cudaEventRecord"); !s.ok()) {
      free_slots_.push_back(launch.slot);
      return s;
    }
    pending_.push_back(std::move(launch));
    return {};
  }

  status take_slot(size_t& slot) {
    if (!free_slots_.empty()) {
      slot = free_slots_.back();
      free_slots_.pop_back();
      return {};
    }
    // Grows to the number of launches in flight (how far the host runs ahead), then never again.
    canary_slot c;
    const size_t bytes =
        size_t(cfg_.shape.layers) * cfg_.max_sequences * cfg_.shape.kv_heads * canary_.tiers.size() * sizeof(double);
    KVQ_TRY(cuda_ok(cudaHostAlloc(reinterpret_cast<void**>(&c.host), bytes, cudaHostAllocMapped), "cudaHostAlloc"));
    canary_slots_.push_back(c);  // owned from here on: the destructor frees it
    canary_slot& owned = canary_slots_.back();
    KVQ_TRY(cuda_ok(cudaHostGetDevicePointer(reinterpret_cast<void**>(&owned.dev), owned.host, 0),
                    "cudaHostGetDevicePointer"));
    KVQ_TRY(cuda_ok(cudaEventCreateWithFlags(&owned.done, cudaEventDisableTiming), "cudaEventCreate"));
    slot = canary_slots_.size() - 1;
    return {};
  }

  // Ingests the finished launches in step order; with `wait`, all of them.
  status drain(bool wait) {
    const auto& sh = cfg_.shape;
    const size_t T = canary_.tiers.size();
    const int H = sh.kv_heads, group = sh.q_heads / sh.kv_heads;
    status first;
    while (!pending_.empty()) {
      canary_launch& l = pending_.front();
      const canary_slot& c = canary_slots_[l.slot];
      const cudaError_t e = wait ? cudaEventSynchronize(c.done) : cudaEventQuery(c.done);
      if (e == cudaErrorNotReady) break;
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        if (first.ok()) first = cuda_ok(e, "canary event");
      } else {
        for (size_t i = 0; i < l.entries.size(); ++i) {
          const canary_entry& en = l.entries[i];
          const double* sums = c.host + i * size_t(H) * T;
          canary_measurement m{en.seq, en.layer, en.context, {}};
          if (canary_.per_head) {
            m.delta.resize(size_t(H) * T);
            for (size_t k = 0; k < m.delta.size(); ++k) m.delta[k] = sums[k] / (double(en.rows) * group);
          } else {
            m.delta.assign(T, 0.0);
            for (int h = 0; h < H; ++h)
              for (size_t t = 0; t < T; ++t) m.delta[t] += sums[size_t(h) * T + t];
            for (double& x : m.delta) x /= double(en.rows) * sh.q_heads;
          }
          if (status s = pol_->canary()->ingest(m); !s.ok() && first.ok()) first = s;
        }
      }
      free_slots_.push_back(l.slot);
      pending_.pop_front();
    }
    return first;
  }

  void note(status s) {
    if (!s.ok() && canary_error_.ok()) canary_error_ = std::move(s);
  }

  canary_spec canary_;
  std::vector<cuda::canary_item> deferred_items_;   // staged, not yet launched (this step's layers)
  std::vector<canary_entry> deferred_entries_;
  std::vector<uint8_t> deferred_layer_;              // [layers] 1 while the layer has staged items
  struct due_canary {
    size_t index;  // in the attend call's items
    cuda::canary_item item;
    canary_entry entry;
  };
  std::vector<due_canary> due_;                      // this attend call's due items
  device_buffer<float> q_stage_;                     // staged queries, [rows][q_heads * head_dim]
  int32_t staged_rows_ = 0;
  std::deque<canary_slot> canary_slots_;  // deque: slots never move (the destructor walks them)
  std::vector<size_t> free_slots_;
  std::deque<canary_launch> pending_;
  status canary_error_;
};

}  // namespace

result<std::unique_ptr<cache_backend>> make_cuda_backend(const cache_state& st) {
  const cache_config& cfg = st.cfg;
  if (cfg.max_tokens <= 0 || cfg.max_tokens > (int64_t(1) << 30))
    return status{errc::invalid_argument, fmt::format("cache_config: max_tokens {} must be in [1, 2^30]", cfg.max_tokens)};
  auto b = std::make_unique<cuda_backend>(st);
  KVQ_TRY(b->init());
  return std::unique_ptr<cache_backend>(std::move(b));
}

}  // namespace detail
KVQ_NAMESPACE_END
