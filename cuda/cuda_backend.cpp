// The CUDA backend of KVCache: the arena, page tables and windows in device memory; the host keeps
// the bookkeeping (page_store) and launches the kernels of cuda/ (README.md) on the caller's stream.
#include <kvq/cuda/canary.hpp>
#include <kvq/cuda/paged_attention.hpp>
#include <kvq/detail/backend.hpp>
#include <kvq/format/kinds.hpp>
#include <kvq/store/window_layout.hpp>

#include "canary_runner.hpp"
#include "device_buffer.hpp"
#include "launch_plan.hpp"
#include "status.hpp"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <vector>

KVQ_NAMESPACE_BEGIN
namespace detail {
namespace {

using cuda::detail::cuda_status;

class cuda_backend final : public cache_backend {
 public:
  explicit cuda_backend(const cache_state& st) : cache_backend(st), canary_(cfg_, *pol_, store_) {}

  ~cuda_backend() override {
    if (flag_host_) cudaFreeHost(flag_host_);
  }

  status init() {
    const auto& sh = cfg_.shape;
    KVQ_TRY(canary_.init());
    int dev = 0;
    KVQ_TRY(cuda_status(cudaGetDevice(&dev), "cudaGetDevice"));
    KVQ_TRY(cuda_status(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute"));
    max_pages_ = int((cfg_.max_tokens + sh.page_tokens - 1) / sh.page_tokens);
    layer_bits_.assign(size_t(sh.layers), 2);
    head_pair_.assign(size_t(sh.layers) * sh.kv_heads, -1);
    KVQ_TRY(arena_.allocate(store_.arena().capacity(), "cache arena"));
    const size_t rows = size_t(cfg_.max_sequences) * sh.layers * max_pages_;
    KVQ_TRY(blocks_.allocate(rows, "device page table"));
    KVQ_TRY(fmts_.allocate(rows * sh.kv_heads * 2, "device format table"));
    KVQ_TRY(flag_.allocate(1, "value-check flag"));
    KVQ_TRY(cuda_status(cudaMallocHost(reinterpret_cast<void**>(&flag_host_), sizeof(int)), "cudaMallocHost"));
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
    KVQ_TRY(cuda_status(cudaMemcpyAsync(flag_host_, flag_.ptr, sizeof(int), cudaMemcpyDeviceToHost, stream()), "cudaMemcpyAsync"));
    KVQ_TRY(cuda_status(cudaStreamSynchronize(stream()), "cudaStreamSynchronize"));
    if (*flag_host_)
      return {errc::non_finite,
              fmt::format("{} holds NaN, Inf or a value outside the fp16 range; nothing was stored", what)};
    return {};
  }

  // Pages of a format the attention kernels do not read are refused before any launch.
  static status check_readable(const append_plan& plan) {
    for (const page_entry& pe : plan.entries)
      if (!kernels_read(pe.fmt))
        return {errc::unsupported,
                fmt::format("format {} is not read by the CUDA attention kernels (the CPU backend reads it)",
                            format_name(pe.fmt))};
    return {};
  }

  status write(sequence_state& s, int layer, const tensor_view& k, const tensor_view& v, const append_plan& plan) override {
    KVQ_TRY(check_readable(plan));
    KVQ_TRY(check(k, v, fmt::format("append: K or V of sequence {} layer {}", s.id, layer)));
    KVQ_TRY(canary_.flush_of(layer));  // before the layer's rings change
    return write_pieces(s, layer, k, v, plan);
  }

  status write_batch(std::span<const batch_entry> entries, int layer, const tensor_view& k, const tensor_view& v) override {
    for (const batch_entry& b : entries) KVQ_TRY(check_readable(*b.plan));
    KVQ_TRY(check(k, v, fmt::format("append_batch: K or V of the batch (layer {})", layer)));
    KVQ_TRY(canary_.flush_of(layer));  // before the layer's rings change
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
      batch_items_.push_back({b.s->slot, int32_t(ls.n), int32_t(ls.e), int32_t(b.tokens), uint32_t(b.s->window_offset / block_unit),
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
      blocks.push_back(uint32_t(plan.entries[at].offset / block_unit));
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
      const cuda::append_seq item{s.slot, int32_t(n), int32_t(e), int32_t(piece), uint32_t(s.window_offset / block_unit),
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
    KVQ_TRY(canary_.flush_of(layer));  // a repeated step of the layer
    const auto& sh = cfg_.shape;
    items_.clear();
    int32_t row = 0;
    for (const auto& it : items) {
      const sequence_state& s = *store_.find(it.seq);
      const layer_state& ls = s.layers[size_t(layer)];
      items_.push_back({s.slot, it.q_len, int32_t(ls.n), int32_t(std::min(ls.e, ls.n - it.q_len)),
                        uint32_t(s.window_offset / block_unit), row});
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
    const result<cuda::detail::launch_plan> plan = cuda::detail::checked_plan(a);  // once per call
    if (!plan) return plan.error();
    const size_t need = cuda::detail::workspace_bytes(a, *plan);
    if (need > workspace_.count)  // grows to the largest batch shape seen, then never again
      KVQ_TRY(workspace_.allocate(need, "attention workspace"));
    KVQ_TRY(canary_.pick(items, layer, arena_.ptr, items_));
    a.q_stage = canary_.q_stage();
    KVQ_TRY(cuda::detail::launch_planned(a, *plan, workspace_.ptr, workspace_.count, cfg_.stream));
    canary_.defer(layer);
    return {};
  }

  void poll_policy() override { note(canary_.drain(false)); }

  status flush_policy() override { return canary_.flush(); }

  status sync_policy() override {
    note(canary_.flush());
    note(canary_.drain(true));
    status s = canary_error_;
    canary_error_ = {};
    return s;
  }

  // Device-to-device copies on the caller's stream: src's window block, then src's rows of the
  // page tables ([slot][layers][max_pages] blocks, [...][kv_heads][2] formats), so the kernels
  // read dst's pages through the same offsets as src's. No synchronization.
  status fork(const sequence_state& src, const sequence_state& dst) override {
    const auto& sh = cfg_.shape;
    const size_t row = size_t(sh.layers) * max_pages_;
    const size_t fmt_row = row * sh.kv_heads * 2;
    KVQ_TRY(cuda_status(cudaMemcpyAsync(arena_.ptr + dst.window_offset, arena_.ptr + src.window_offset,
                                        store_.window_bytes_per_sequence(), cudaMemcpyDeviceToDevice, stream()),
                        "cudaMemcpyAsync (fork: window)"));
    KVQ_TRY(cuda_status(cudaMemcpyAsync(blocks_.ptr + size_t(dst.slot) * row, blocks_.ptr + size_t(src.slot) * row,
                                        row * sizeof(uint32_t), cudaMemcpyDeviceToDevice, stream()),
                        "cudaMemcpyAsync (fork: page table)"));
    return cuda_status(cudaMemcpyAsync(fmts_.ptr + size_t(dst.slot) * fmt_row, fmts_.ptr + size_t(src.slot) * fmt_row,
                                       fmt_row, cudaMemcpyDeviceToDevice, stream()),
                       "cudaMemcpyAsync (fork: format table)");
  }

  // A cut in the ring needs nothing on the device (the lengths are launch arguments). A cut page
  // whose overwritten tokens must come back is read to the host, decoded there with the codec and
  // written back into the ring: every read happens before the first write, so a failed read
  // changes nothing. Two stream synchronizations when anything must be restored.
  status restore_ring(const sequence_state& s, int64_t length) override {
    const auto& sh = cfg_.shape;
    struct pending {
      uint64_t offset;              // first ring byte of the rows
      std::vector<uint16_t> rows;   // ring slots [first % R, ...) contiguous (no wrap), fp16
    };
    std::vector<pending> writes;
    std::vector<uint8_t> page;
    std::vector<uint16_t> ring(size_t(sh.window) * sh.head_dim);
    bool synced = false;
    for (int l = 0; l < sh.layers; ++l) {
      const layer_state& ls = s.layers[size_t(l)];
      const auto [first, last] = ring_restore_range(store_, ls, length);
      if (first == last) continue;
      if (!synced) {
        KVQ_TRY(cuda_status(cudaStreamSynchronize(stream()), "cudaStreamSynchronize"));
        synced = true;
      }
      // The rows of one page never wrap: the page starts at a multiple of page_tokens, which
      // divides the window.
      const int64_t slot0 = first % sh.window, count = last - first;
      for (int h = 0; h < sh.kv_heads; ++h)
        for (role r : {role::k, role::v}) {
          const page_entry& pe = ls.pages[(size_t(first / sh.page_tokens) * sh.kv_heads + h) * 2 + (r == role::k ? 0 : 1)];
          page.resize(store_.page_bytes_of(pe.fmt, r));
          KVQ_TRY(cuda_status(cudaMemcpy(page.data(), arena_.ptr + pe.offset, page.size(), cudaMemcpyDeviceToHost),
                              "cudaMemcpy (truncate: page)"));
          restore_rows(sh, pe, r, page.data(), first, last, ring.data());
          const auto at = ring.begin() + ptrdiff_t(slot0 * sh.head_dim);
          writes.push_back({store_.window_offset(s, l, h, r) + uint64_t(slot0) * sh.head_dim * 2,
                            std::vector<uint16_t>(at, at + ptrdiff_t(count * sh.head_dim))});
        }
      KVQ_TRY(canary_.flush_of(l));  // before the layer's rings change
    }
    if (writes.empty()) return {};
    // On the stream, after the canaries just launched read the rings; the host rows live until
    // the copies are done.
    for (const pending& w : writes)
      KVQ_TRY(cuda_status(cudaMemcpyAsync(arena_.ptr + w.offset, w.rows.data(), w.rows.size() * 2, cudaMemcpyHostToDevice,
                                          stream()),
                          "cudaMemcpyAsync (truncate: ring)"));
    return cuda_status(cudaStreamSynchronize(stream()), "cudaStreamSynchronize");
  }

  status read(const sequence_state& s, int layer, role r, std::span<float> out) const override {
    const auto& sh = cfg_.shape;
    KVQ_TRY(cuda_status(cudaStreamSynchronize(stream()), "cudaStreamSynchronize"));
    const layer_state& ls = s.layers[size_t(layer)];
    std::vector<std::vector<uint8_t>> pages;
    std::vector<uint16_t> ring(size_t(sh.window) * sh.head_dim);
    std::vector<uint8_t> buf;
    int ring_head = -1;
    status err;
    auto page_at = [&](const page_entry& pe) -> const uint8_t* {
      buf.resize(store_.page_bytes_of(pe.fmt, r));
      if (status st = cuda_status(cudaMemcpy(buf.data(), arena_.ptr + pe.offset, buf.size(), cudaMemcpyDeviceToHost), "cudaMemcpy");
          !st.ok())
        err = st;
      return buf.data();
    };
    auto ring_at = [&](int h) -> const uint16_t* {
      if (ring_head != h) {
        ring_head = h;
        if (status st = cuda_status(cudaMemcpy(ring.data(), arena_.ptr + store_.window_offset(s, layer, h, r),
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

  void note(status s) {
    if (!s.ok() && canary_error_.ok()) canary_error_ = std::move(s);
  }

  canary_runner canary_;  // after the buffers: destroyed first (it waits for its launches)
  status canary_error_;  // the first canary failure since the last sync_policy
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
