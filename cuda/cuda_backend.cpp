// The CUDA backend of KVCache: the arena, page tables and windows in device memory; the host keeps
// the bookkeeping (page_store) and launches the kernels of cuda/ (README.md) on the caller's stream.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <kvq/cuda/canary.hpp>
#include <kvq/cuda/paged_attention.hpp>
#include <kvq/detail/backend.hpp>
#include <kvq/cuda/read_plan.hpp>
#include <kvq/rotation/rotation.hpp>
#include <kvq/store/window_layout.hpp>
#include <vector>

#include "attention/prefill.hpp"
#include "canary_runner.hpp"
#include "device_buffer.hpp"
#include "launch_plan.hpp"
#include "replay.hpp"
#include "ring_undo.hpp"
#include "status.hpp"

KVQ_NAMESPACE_BEGIN
namespace detail {
namespace {

using cuda::detail::cuda_status;

// Makes a device current for the length of a call and gives the caller's back afterwards, so that
// a cache created on one device serves calls made while another is current (two caches on two
// devices in one process), and the engine's current device never changes under it.
class device_scope {
 public:
  device_scope() = default;
  explicit device_scope(int dev) { (void)enter(dev); }
  device_scope(const device_scope&) = delete;
  device_scope& operator=(const device_scope&) = delete;
  ~device_scope() {
    if (switched_) (void)cudaSetDevice(prev_);
  }
  /// Makes `dev` current until the scope ends; the status says if that failed.
  status enter(int dev) {
    if (status st = cuda_status(cudaGetDevice(&prev_), "cudaGetDevice"); !st.ok()) return error_ = st;
    if (prev_ != dev) {
      if (status st = cuda_status(cudaSetDevice(dev), "cudaSetDevice (the cache's device)"); !st.ok())
        return error_ = st;
      switched_ = true;
    }
    return {};
  }
  const status& error() const { return error_; }

 private:
  int prev_ = 0;
  bool switched_ = false;
  status error_;
};

// The first statement of every backend entry point: the cache's device is current until the call
// returns, or the call fails naming why it is not.
#define KVQ_ON_DEVICE()                \
  const device_scope on_device_(dev_); \
  KVQ_TRY(on_device_.error())

class cuda_backend final : public cache_backend {
 public:
  explicit cuda_backend(const cache_state& st) : cache_backend(st), canary_(cfg_, *pol_, store_) {}

  ~cuda_backend() override {
    (void)teardown_.enter(dev_);  // the members free their memory on the cache's device; restored last
    if (swap_) cudaFreeHost(swap_);
  }

  // Binds the cache to the device current at creation.
  status init() {
    const auto& sh = cfg_.shape;
    KVQ_TRY(cuda_status(cudaGetDevice(&dev_), "cudaGetDevice"));
    KVQ_TRY(canary_.init());
    KVQ_TRY(cuda_status(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, dev_), "cudaDeviceGetAttribute"));
    max_pages_ = int(cuda_max_pages(cfg_));
    layer_bits_.assign(size_t(sh.layers), 2);
    layer_bits3_.assign(size_t(sh.layers), 2);
    head_pair_.assign(size_t(sh.layers) * sh.kv_heads, -1);
    hints_.assign(size_t(sh.layers), decode_hint{2, true, false});
    KVQ_TRY(arena_.allocate(store_.arena().capacity(), "cache arena"));
    if (cfg_.swap_bytes) {
      const cudaError_t e = cudaMallocHost(reinterpret_cast<void**>(&swap_), cfg_.swap_bytes);
      if (e != cudaSuccess) {
        swap_ = nullptr;
        return {errc::out_of_budget, fmt::format("cudaMallocHost of the swap space ({} bytes, cache_config.swap_bytes) "
                                                 "failed: {}",
                                                 cfg_.swap_bytes, cudaGetErrorString(e))};
      }
    }
    const size_t rows = size_t(cfg_.max_sequences) * sh.layers * max_pages_;
    KVQ_TRY(blocks_.allocate(rows, "device page table"));
    KVQ_TRY(fmts_.allocate(rows * sh.kv_heads * 2, "device format table"));
    // zeroed: a held sequence's attention (docs/architecture.md, "Value checks on the device") may
    // read rows of pages whose append was refused; they name block 0 and format 0, never memory
    // outside the arena
    KVQ_TRY(cuda_status(cudaMemset(blocks_.ptr, 0, blocks_.count * sizeof(uint32_t)), "cudaMemset (page table)"));
    KVQ_TRY(cuda_status(cudaMemset(fmts_.ptr, 0, fmts_.count), "cudaMemset (format table)"));
    KVQ_TRY(levels_d_.allocate(levels_.size(), "codebook level table"));
    KVQ_TRY(levels_changed_here());
    KVQ_TRY(upload_sinks());
    if (cfg_.check_values) {
      KVQ_TRY(held_.allocate(size_t(cfg_.max_sequences), "value-check guard"));
      KVQ_TRY(since_.allocate(size_t(cfg_.max_sequences) * sh.layers * 3, "value-check guard"));
      KVQ_TRY(fault_.allocate(1, "value-check fault record"));
      KVQ_TRY(cuda::clear_guard(guard(), sh.layers, 0, cfg_.max_sequences, stream()));
      KVQ_TRY(cuda_status(cudaMemsetAsync(fault_.ptr, 0, sizeof(cuda::append_fault), stream()), "cudaMemsetAsync"));
      KVQ_TRY(cuda_status(cudaStreamSynchronize(stream()), "cudaStreamSynchronize (creation)"));
    }
    view_.arena = arena_.ptr;
    view_.blocks = blocks_.ptr;
    view_.fmts = fmts_.ptr;
    view_.layers = sh.layers;
    view_.kv_heads = sh.kv_heads;
    view_.head_dim = sh.head_dim;
    view_.page_tokens = sh.page_tokens;
    view_.window = sh.window;
    view_.max_pages = max_pages_;
    view_.slots = cfg_.max_sequences;
    view_.arena_bytes = arena_.count;
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

  // The layers' sink logits (`attention_variant::sink_logits`), once, to the device:
  // [layers][q_heads] floats, zero in layers without them (whose calls pass no pointer).
  status upload_sinks() {
    const auto& sh = cfg_.shape;
    bool any = false;
    for (int l = 0; l < sh.layers; ++l) any = any || !cfg_.layer_attention(l).sink_logits.empty();
    if (!any) return {};
    std::vector<float> host(size_t(sh.layers) * sh.q_heads, 0.f);
    for (int l = 0; l < sh.layers; ++l) {
      const std::vector<float>& s = cfg_.layer_attention(l).sink_logits;
      std::copy(s.begin(), s.end(), host.begin() + ptrdiff_t(size_t(l) * sh.q_heads));
    }
    KVQ_TRY(sinks_.allocate(host.size(), "sink logits"));
    return cuda_status(cudaMemcpy(sinks_.ptr, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice),
                       "cudaMemcpy (sink logits)");
  }

  // A layer's attention rule as the kernels take it, its sink logits in device memory.
  variant_args variant_of_layer(int layer) const {
    const attention_variant& v = cfg_.layer_attention(layer);
    return {v.window, v.softcap, v.sink_logits.empty() ? nullptr : sinks_.ptr + size_t(layer) * cfg_.shape.q_heads};
  }

  // The stream of the call in progress (`cache_backend::stream_`: the caller's, else the cache's).
  cudaStream_t stream() const { return static_cast<cudaStream_t>(stream_); }
  cudaStream_t cache_stream() const { return static_cast<cudaStream_t>(cfg_.stream); }

  // The device-side value checks (cuda::append_guard); none without check_values.
  cuda::append_guard guard() const { return {held_.ptr, since_.ptr, fault_.ptr, false}; }

  // A stream's own workspaces: calls on different streams may run at once, so none shares them.
  struct stream_buffers {
    void* stream = nullptr;
    device_buffer<uint8_t> workspace;  // attention split partials, prefill staging
    device_buffer<uint16_t> undo;      // the rings' rows saved by a multi-call write
  };
  stream_buffers& buffers() {
    for (auto& b : per_stream_)
      if (b->stream == stream_) return *b;
    per_stream_.push_back(std::make_unique<stream_buffers>());
    per_stream_.back()->stream = stream_;
    return *per_stream_.back();
  }

  // The codebook levels copied to the device on the cache's stream, behind the work already on
  // it (a replay in flight reads the old ones); the copy completes before the call returns.
  status levels_changed_here() {
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    KVQ_TRY(cuda_status(cudaStreamIsCapturing(stream(), &cs), "cudaStreamIsCapturing"));
    if (cs != cudaStreamCaptureStatusNone)
      return {errc::invalid_argument, "the cache's stream is being captured; set codebook levels outside a capture"};
    KVQ_TRY(cuda_status(cudaMemcpyAsync(levels_d_.ptr, levels_.data(), levels_.size() * sizeof(float),
                                        cudaMemcpyHostToDevice, stream()),
                        "cudaMemcpyAsync (codebook levels)"));
    return cuda_status(cudaStreamSynchronize(stream()), "cudaStreamSynchronize");
  }

  status levels_changed() override {
    KVQ_ON_DEVICE();
    return levels_changed_here();
  }

  bool reads(format_id f) const override { return cuda::kernels_read(f); }
  int plan_bits(format_id f, bool three_bit) const override {
    return three_bit ? cuda::three_bit_kernel_bits(f) : cuda::kernel_bits(f);
  }

  // Pages of a format the attention kernels do not read are refused before any launch.
  static status check_readable(const append_plan& plan) {
    for (const page_entry& pe : plan.entries)
      if (!cuda::kernels_read(pe.fmt))
        return {errc::unsupported,
                fmt::format("format {} is not read by the CUDA attention kernels (the CPU backend reads it)",
                            format_name(pe.fmt))};
    return {};
  }

  status write(sequence_state& s, int layer, const tensor_view& k, const tensor_view& v,
               const append_plan& plan) override {
    KVQ_ON_DEVICE();
    KVQ_TRY(canary_.flush_of(layer));  // before the layer's rings change
    calls_used_ = 0;
    undo_rows_.clear();
    add_pieces(s, layer, plan, 0, k.tokens);
    KVQ_TRY(launch_calls(layer, k, v));
    note_pages(layer, plan);
    return {};
  }

  status write_batch(std::span<const batch_entry> entries, int layer, const tensor_view& k,
                     const tensor_view& v) override {
    KVQ_ON_DEVICE();
    KVQ_TRY(canary_.flush_of(layer));  // before the layer's rings change
    // One launch pair for as many sequences as fit (max_append_items, max_append_pages); a
    // sequence with more new pages than that (a long prefill) goes through pieces of its own.
    const int per_page = cfg_.shape.kv_heads * 2;
    calls_used_ = 0;
    undo_rows_.clear();
    append_call* open = nullptr;  // the call that gathers sequences, if any
    for (const batch_entry& b : entries) {
      const layer_state& ls = b.s->layers[size_t(layer)];
      const int pages = int(b.plan->entries.size() / size_t(per_page));
      if (pages > cuda::max_append_pages) {
        add_pieces(*b.s, layer, *b.plan, b.row, b.tokens);
        open = nullptr;
        continue;
      }
      if (!open || open->items.size() == size_t(cuda::max_append_items) ||
          int(open->blocks.size()) + pages > cuda::max_append_pages || open->first_row + open->rows != b.row)
        open = &next_call(b.row);
      open->items.push_back({b.s->slot, int32_t(ls.n), int32_t(ls.e), int32_t(b.tokens),
                             uint32_t(b.s->window_offset / block_unit), int(b.plan->first_page), pages,
                             int32_t(ls.ring_from), b.s->id});
      add_pages(*b.plan, 0, pages, *open);
      open->rows += b.tokens;
      undo_rows_.push_back(undo_of(*b.s, layer, b.tokens));
    }
    KVQ_TRY(launch_calls(layer, k, v));
    for (const batch_entry& b : entries) note_pages(layer, *b.plan);
    return {};
  }

  // One append_run of a write: its sequences, their new pages' blocks and formats, its rows of K/V.
  struct append_call {
    std::vector<cuda::append_seq> items;
    std::vector<uint32_t> blocks;
    std::vector<uint8_t> fmts;
    int64_t first_row = 0, rows = 0;
  };

  // A cleared call at the end of the list (the list keeps its vectors' memory across writes).
  append_call& next_call(int64_t first_row) {
    if (calls_used_ == calls_.size()) calls_.emplace_back();
    append_call& c = calls_[calls_used_++];
    c.items.clear();
    c.blocks.clear();
    c.fmts.clear();
    c.first_row = first_row;
    c.rows = 0;
    return c;
  }

  // The ring rows an append of `m` tokens to (s, layer) overwrites: its last min(m, window) tokens.
  cuda::detail::ring_rows undo_of(const sequence_state& s, int layer, int64_t m) const {
    const int64_t n = s.layers[size_t(layer)].n, count = std::min<int64_t>(m, cfg_.shape.window);
    return {uint32_t(s.window_offset / block_unit), int32_t(n + m - count), int32_t(count), 0};
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
    a.levels = levels_d_.ptr + size_t(layer) * cfg_.shape.kv_heads * 2 * codebook_table_floats;
    a.rotation = rotation_of(layer);
    a.guard = guard();
    return a;
  }

  // The rotated kv heads of a layer, for the kernels (docs/architecture.md, "Rotation").
  cuda::head_rotation rotation_of(int layer) const {
    cuda::head_rotation r{cfg_.rotation.seed, 0};
    for (int h = 0; h < cfg_.shape.kv_heads; ++h)
      if (cfg_.rotation.rotated(layer, h, cfg_.shape.kv_heads)) r.mask |= 1u << h;
    return r;
  }

  // Appends pages [first, first + count) of a plan to the block and format lists of a call.
  void add_pages(const append_plan& plan, int first, int count, append_call& c) const {
    const int per_page = cfg_.shape.kv_heads * 2;
    for (int i = first; i < first + count; ++i) {
      const size_t at = size_t(i) * per_page;
      c.blocks.push_back(uint32_t(plan.entries[at].offset / block_unit));
      for (int j = 0; j < per_page; ++j) c.fmts.push_back(plan.entries[at + size_t(j)].fmt);
    }
  }

  // After a write succeeded: notes, for the decode kernel's choice, the widest format of the
  // layer (a format read by element counts as 16 bits: `kernel_bits`; in `layer_bits3_` the 3-bit
  // kinds count as 3: `three_bit_kernel_bits`), whether each head has kept one format pair, and
  // the hint that follows (`hints_`). Sink pages (FP16,
  // `cache_config::sink_pages`) are left out: a decode call gives them a split of their own
  // (`attend_args::sink_pages`), which reads them from global memory, so a layer's plan stays
  // the one of the pages the policy chose.
  void note_pages(int layer, const append_plan& plan) { note_pages(layer, plan.first_page, plan.entries); }
  // The same for pages `entries` ([pages][kv_heads][2]) from page index `first_page` on.
  void note_pages(int layer, int64_t first_page, std::span<const page_entry> entries) {
    const int per_page = cfg_.shape.kv_heads * 2;
    const int64_t pages = int64_t(entries.size()) / per_page;
    const size_t sinks = size_t(cache_state::sink_pages_among(cfg_, first_page, pages));
    for (size_t at = sinks * size_t(per_page); at < entries.size(); at += size_t(per_page)) {
      if (entries[at].offset == released_page) continue;  // (a sliding layer's page released: no format)
      for (int j = 0; j < per_page; ++j) {
        const format_id f = entries[at + size_t(j)].fmt;
        layer_bits_[size_t(layer)] = std::max(layer_bits_[size_t(layer)], uint8_t(cuda::kernel_bits(f)));
        layer_bits3_[size_t(layer)] = std::max(layer_bits3_[size_t(layer)], uint8_t(cuda::three_bit_kernel_bits(f)));
      }
      for (int h = 0; h < cfg_.shape.kv_heads; ++h) {
        const int pair = 256 * int(entries[at + size_t(2 * h)].fmt) + int(entries[at + size_t(2 * h + 1)].fmt);
        int16_t& hp = head_pair_[size_t(layer) * cfg_.shape.kv_heads + size_t(h)];
        if (hp == -1)
          hp = int16_t(pair);
        else if (hp != pair)
          hp = -2;
      }
    }
    decode_hint h{2, true, layer_bits3_[size_t(layer)] < layer_bits_[size_t(layer)]};
    for (int i = 0; i < cfg_.shape.kv_heads && h.one_pair; ++i) {
      const int16_t hp = head_pair_[size_t(layer) * cfg_.shape.kv_heads + size_t(i)];
      if (hp == -2) h.one_pair = false;
      if (hp < 0) continue;
      const format_id k = format_id(hp >> 8), v = format_id(hp & 255);
      const int bits = cuda::head_kernel_bits(k, v);
      h.bits = uint8_t(std::max(int(h.bits), bits));
      // (a head of one 3-bit kind beside another format, e.g. K 4 / V 3 bits: the whole-unit
      // instance reads 3-bit pages only in blocks of one 3-bit pair, so the layer plans as mixed)
      if ((cuda::three_bit_kind(k) || cuda::three_bit_kind(v)) && bits != 3) h.one_pair = false;
    }
    hints_[size_t(layer)] = h;
  }

  // One sequence's append (rows [row, row + m) of K/V), in calls of at most max_append_pages new
  // pages each.
  void add_pieces(const sequence_state& s, int layer, const append_plan& plan, int64_t row, int64_t m) {
    const auto& sh = cfg_.shape;
    const layer_state& ls = s.layers[size_t(layer)];
    int64_t n = ls.n, e = ls.e, done = 0;
    int page = 0;
    while (done < m) {
      int64_t piece = m - done;
      const int64_t cap = int64_t(cuda::max_append_pages) * sh.page_tokens;
      if (store_.pages_after(n, e, piece) > cuda::max_append_pages)
        piece = std::max<int64_t>(1, e + cap + sh.recent - n);
      const int pages = int(store_.pages_after(n, e, piece));
      append_call& c = next_call(row + done);
      c.items.push_back({s.slot, int32_t(n), int32_t(e), int32_t(piece), uint32_t(s.window_offset / block_unit),
                         int(plan.first_page) + page, pages,
                         int32_t(std::max(ls.ring_from, n - int64_t(sh.window))), s.id});
      add_pages(plan, page, pages, c);
      c.rows = piece;
      n += piece;
      e += int64_t(pages) * sh.page_tokens;
      page += pages;
      done += piece;
    }
    undo_rows_.push_back(undo_of(s, layer, m));
  }

  // Runs the planned calls. All or nothing on the device too: a call's ring write is its last
  // launch, so a single call that fails changed nothing the cache reads (its encoder may have
  // written page bytes into the planned blocks, which the cache gives back, and page-table rows
  // past the sequences' listed pages, which nothing reads). With several calls, a failure after
  // the first would leave earlier calls' ring writes behind: those rows are copied aside before
  // the first launch and copied back after a failure.
  //
  // With check_values, every call's rows are checked on the device before the first call's
  // launches (`cuda::check_append_values`): a sequence with a bad row is held, and no call writes
  // anything of it (KVCache::check reports it). No synchronization.
  status launch_calls(int layer, const tensor_view& k, const tensor_view& v) {
    auto call_args = [&](const append_call& c) {
      cuda::append_args a = append_args(layer);
      a.items = c.items;
      a.k = rows_of(k, c.first_row, c.rows);
      a.v = rows_of(v, c.first_row, c.rows);
      a.page_blocks = c.blocks.data();
      a.page_fmts = c.fmts.data();
      return a;
    };
    const bool undo = calls_used_ > 1;
    stream_buffers& buf = buffers();
    if (undo) {
      int64_t rows = 0;
      for (cuda::detail::ring_rows& r : undo_rows_) r.saved_row = uint32_t(rows), rows += r.count;
      const size_t halves = cuda::detail::ring_undo_bytes(view_, rows) / 2;
      if (halves > buf.undo.count) {  // grows to the largest multi-call append seen
        KVQ_TRY(refuse_growth_in_capture("the append undo record", buf.undo.count * 2, halves * 2));
        KVQ_TRY(buf.undo.allocate(halves, "append undo record"));
      }
    }
    if (cfg_.check_values)
      for (size_t i = 0; i < calls_used_; ++i) {
        cuda::append_args a = call_args(calls_[i]);
        a.guard.check = true;
        KVQ_TRY(cuda::check_append_values(a, stream()));
      }
    if (undo) KVQ_TRY(cuda::detail::ring_undo(view_, arena_.ptr, layer, undo_rows_, buf.undo.ptr, true, stream()));
    for (size_t i = 0; i < calls_used_; ++i) {
      status st = cuda::append_run(call_args(calls_[i]), stream());
      if (st.ok()) continue;
      if (undo && i > 0)
        if (status back = cuda::detail::ring_undo(view_, arena_.ptr, layer, undo_rows_, buf.undo.ptr, false, stream());
            !back.ok())
          return {st.code(), fmt::format("{}; restoring the rings of the earlier launches failed too ({}): the FP16 "
                                         "windows of layer {} may hold tokens of the failed call",
                                         st.message(), back.message(), layer)};
      return st;
    }
    return {};
  }

  status attend(std::span<const attend_item> items, int layer, const tensor_view& q, const tensor_mut& o) override {
    KVQ_ON_DEVICE();
    KVQ_TRY(canary_.flush_of(layer));  // a repeated step of the layer
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
    set_call(a, layer, q, o);
    a.items = items_;
    a.rotation = rotation_of(layer);  // before the plan: the workspace holds the rotated queries
    // Pages of the 3-bit kinds count 3 bits (`three_bit_pages`): heads of one 3-bit kind pair each
    // (kivi3/kivi3, sym3/sym3) in the block-staged kernel's Whole instance, other layers in the
    // staged kernels' Three instances (block-staged or per-warp).
    const decode_hint hint = hints_[size_t(layer)];
    a.one_format_per_head = hint.one_pair;
    a.three_bit_pages = hint.three;
    a.max_page_bits = hint.one_pair ? hint.bits : (hint.three ? layer_bits3_ : layer_bits_)[size_t(layer)];
    const result<cuda::detail::launch_plan> plan = cuda::detail::checked_plan(a);  // once per call
    if (!plan) return plan.error();
    const size_t need = cuda::detail::workspace_bytes(a, *plan);
    KVQ_TRY(reserve_workspace(need));
    KVQ_TRY(canary_.pick(items, layer, arena_.ptr, items_));
    a.q_stage = canary_.q_stage();
    const device_buffer<uint8_t>& ws = buffers().workspace;
    KVQ_TRY(cuda::detail::launch_planned(a, *plan, ws.ptr, ws.count, stream()));
    canary_.defer(layer);
    return {};
  }

  // ---- prefill of any length and the prefix attention (docs/architecture.md, "Prefill of any length")

  bool prefill_any_length() const override { return true; }

  // The call's arguments over (s, layer) with `prefix` stored tokens seen by every query: the
  // pages the layer holds now, the rest from the ring.
  cuda::detail::prefill_args prefill_args_of(const sequence_state& s, int layer, int64_t prefix, const tensor_view& q,
                                             const tensor_mut& o) const {
    const layer_state& ls = s.layers[size_t(layer)];
    cuda::detail::prefill_args a;
    set_call(a, layer, q, o);
    a.slot = s.slot;
    a.window_unit = uint32_t(s.window_offset / block_unit);
    a.prefix = int32_t(prefix);
    a.from_pages = int32_t(std::min(ls.e, prefix));
    a.queries = q.tokens;
    a.rotation = rotation_of(layer);
    a.quantized_pages = quantized_pages(layer);
    return a;
  }

  // Whether a page of `layer` may hold a format other than FP16: a format pair other than
  // (FP16, FP16) that one of its heads has held (`head_pair_`).
  bool quantized_pages(int layer) const {
    constexpr int fp16_pair = 256 * int(fp16_format) + int(fp16_format);
    const int heads = cfg_.shape.kv_heads;
    for (int h = 0; h < heads; ++h) {
      const int16_t hp = head_pair_[size_t(layer) * size_t(heads) + size_t(h)];
      if (hp != -1 && hp != fp16_pair) return true;
    }
    return false;
  }

  // Grows the call's stream's workspace to what the call needs (to the largest call seen; it never
  // shrinks), in that stream's order: the host does not wait for the device. Not while the stream
  // is being captured (a graph cannot own a buffer the cache keeps).
  status reserve_workspace(size_t need) {
    device_buffer<uint8_t>& ws = buffers().workspace;
    if (need <= ws.count) return {};
    KVQ_TRY(refuse_growth_in_capture("the attention workspace", ws.count, need));
    return ws.allocate_on(need, "attention workspace", stream());
  }

  // A workspace cannot grow while the call's stream is being captured (a graph cannot own a
  // buffer the cache keeps): the error says how to size it first.
  status refuse_growth_in_capture(const char* what, size_t have, size_t need) const {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    KVQ_TRY(cuda_status(cudaStreamIsCapturing(stream(), &capturing), "cudaStreamIsCapturing"));
    if (capturing == cudaStreamCaptureStatusNone) return {};
    return {errc::invalid_argument,
            fmt::format("{} must grow from {} to {} bytes while the call's stream is being captured; run a call of "
                        "this shape on that stream once before the capture (or capture a decode_step, whose "
                        "workspace is sized when it is made)",
                        what, have, need)};
  }

  // Before the chunk's append: the call's checks and its workspace, sized for the prefix the
  // chunk will see (the stored tokens now), so that nothing can fail for want of them after it.
  status prepare_prefill(const sequence_state& s, int layer, int64_t tokens) override {
    if (tokens <= cfg_.shape.window) return {};  // (an attend step)
    KVQ_ON_DEVICE();
    const int64_t n0 = s.layers[size_t(layer)].n;
    cuda::detail::prefill_args a =
        prefill_args_of(s, layer, n0, {nullptr, dtype::f16, tokens, cfg_.shape.q_heads, cfg_.shape.head_dim, 0}, {});
    a.from_pages = a.prefix;  // (the append may encode prefix tokens; the workspace does not depend on it)
    const tensor_view chunk{
        reinterpret_cast<const void*>(uintptr_t(1)), dtype::f16, tokens, cfg_.shape.kv_heads, cfg_.shape.head_dim, 0};
    a.k = a.v = chunk;  // (only its shape: sizes the chunk's part)
    KVQ_TRY(cuda::detail::prefill_can_implement(a));
    return reserve_workspace(cuda::detail::prefill_workspace_bytes(a));
  }

  // A chunk of at most the window is an `attend` step of q_len T (the chunk is the ring's newest
  // tokens), so a device canary measures its queries as it measures any step's; a longer one runs
  // the prefix and chunk parts.
  status prefill(const sequence_state& s, int layer, int64_t prefix, const tensor_view& k, const tensor_view& v,
                 const tensor_view& q, const tensor_mut& o) override {
    if (q.tokens <= cfg_.shape.window) {
      const attend_item item{s.id, int(q.tokens)};
      return attend({&item, 1}, layer, q, o);
    }
    KVQ_ON_DEVICE();
    cuda::detail::prefill_args a = prefill_args_of(s, layer, prefix, q, o);
    a.k = k;
    a.v = v;
    KVQ_TRY(reserve_workspace(cuda::detail::prefill_workspace_bytes(a)));
    const device_buffer<uint8_t>& ws = buffers().workspace;
    return cuda::detail::prefill_run(a, ws.ptr, ws.count, stream());
  }

  status attend_prefix(const sequence_state& s, int layer, int64_t prefix, const tensor_view& q, const tensor_mut& o,
                       float* lse) override {
    KVQ_ON_DEVICE();
    cuda::detail::prefill_args a = prefill_args_of(s, layer, prefix, q, o);
    a.lse = lse;
    KVQ_TRY(cuda::detail::prefill_can_implement(a));
    KVQ_TRY(reserve_workspace(cuda::detail::prefill_workspace_bytes(a)));
    const device_buffer<uint8_t>& ws = buffers().workspace;
    return cuda::detail::prefill_run(a, ws.ptr, ws.count, stream());
  }

  // The fields an attention call (`cuda::attend_args`) and a prefix / prefill call
  // (`cuda::detail::prefill_args`) share: the layer's view, the queries and outputs, the scale.
  template <class Args>
  void set_call(Args& a, int layer, const tensor_view& q, const tensor_mut& o) const {
    a.kv = view_;
    a.layer = layer;
    a.q_heads = cfg_.shape.q_heads;
    a.q = q.data;
    a.q_type = q.type;
    a.q_stride = q.stride();
    a.o = o.data;
    a.o_type = o.type;
    a.o_stride = o.stride();
    a.scale = softmax_scale();
    a.num_sms = sms_;
    if constexpr (requires { a.sink_pages; }) a.sink_pages = cfg_.sink_pages;  // (attend_args: a split of their own)
    a.variant = variant_of_layer(layer);
  }

  result<std::unique_ptr<step_backend>> make_step(int max_batch, int64_t max_tokens,
                                                  std::span<step_layer> layers) override;

  cache_overhead overhead() const override {
    cache_overhead o;
    o.device_tables = blocks_.count * sizeof(uint32_t) + fmts_.count + levels_d_.count * sizeof(float) +
                      held_.count + since_.count * sizeof(int32_t) + fault_.count * sizeof(cuda::append_fault);
    o.device_workspace = canary_.staging_bytes();
    for (const auto& b : per_stream_) o.device_workspace += b->workspace.count + b->undo.count * sizeof(uint16_t);
    o.pinned_host = canary_.pinned_bytes() + (swap_ ? cfg_.swap_bytes : 0);
    return o;
  }

  void poll_policy() override {
    const device_scope on_device(dev_);
    if (!on_device.error().ok()) return note(on_device.error());
    note(canary_.drain(false));
  }

  status flush_policy() override {
    KVQ_ON_DEVICE();
    return canary_.flush();
  }

  status sync_policy() override {
    KVQ_ON_DEVICE();
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
    KVQ_ON_DEVICE();
    const auto& sh = cfg_.shape;
    const size_t row = size_t(sh.layers) * max_pages_;
    const size_t fmt_row = row * sh.kv_heads * 2;
    KVQ_TRY(copy_rings(src.window_offset, dst.window_offset, int64_t(src.ring_lanes) * sh.page_tokens));
    KVQ_TRY(cuda_status(cudaMemcpyAsync(blocks_.ptr + size_t(dst.slot) * row, blocks_.ptr + size_t(src.slot) * row,
                                        row * sizeof(uint32_t), cudaMemcpyDeviceToDevice, stream()),
                        "cudaMemcpyAsync (fork: page table)"));
    KVQ_TRY(cuda_status(cudaMemcpyAsync(fmts_.ptr + size_t(dst.slot) * fmt_row, fmts_.ptr + size_t(src.slot) * fmt_row,
                                        fmt_row, cudaMemcpyDeviceToDevice, stream()),
                        "cudaMemcpyAsync (fork: format table)"));
    return cuda::copy_guard(guard(), sh.layers, src.slot, dst.slot, stream());  // a held src's fork is held
  }

  // A policy's device canary reads the rings at the next step's first call, on the cache's stream:
  // its cache runs every call there.
  status use_stream(stream_ref s) const override {
    void* to = s.given ? s.stream : cfg_.stream;
    if (to != cfg_.stream && canary_.active())
      return {errc::unsupported,
              fmt::format("policy {} measures its canary on the cache's stream; its cache runs every call there (a "
                          "call on another stream was given)",
                          pol_->name())};
    stream_ = to;
    return {};
  }

  // A new sequence's slot starts clear of an earlier holder's refusals.
  status on_sequence_change(const sequence_state& s, bool created) override {
    if (!created || !cfg_.check_values) return {};
    KVQ_ON_DEVICE();
    return cuda::clear_guard(guard(), cfg_.shape.layers, s.slot, 1, stream());
  }

  // Synchronizes the call's stream, reads the guard and clears it (KVCache::check).
  result<refusals> take_refusals() override {
    refusals out;
    if (!cfg_.check_values) return out;
    KVQ_ON_DEVICE();
    const int L = cfg_.shape.layers;
    KVQ_TRY(cuda_status(cudaStreamSynchronize(stream()), "cudaStreamSynchronize (check)"));
    cuda::append_fault f;
    KVQ_TRY(cuda_status(cudaMemcpy(&f, fault_.ptr, sizeof f, cudaMemcpyDeviceToHost), "cudaMemcpy (check)"));
    std::vector<uint8_t> held(held_.count);
    KVQ_TRY(cuda_status(cudaMemcpy(held.data(), held_.ptr, held.size(), cudaMemcpyDeviceToHost), "cudaMemcpy (check)"));
    std::vector<int32_t> since(size_t(L) * 3);
    for (int slot = 0; slot < int(held.size()); ++slot) {
      if (!held[size_t(slot)]) continue;
      out.slots.push_back(slot);
      KVQ_TRY(cuda_status(cudaMemcpy(since.data(), since_.ptr + size_t(slot) * L * 3, since.size() * 4,
                                     cudaMemcpyDeviceToHost),
                          "cudaMemcpy (check)"));
      for (int l = 0; l < L; ++l)
        if (since[size_t(l) * 3] >= 0)
          out.layers.push_back({slot, l, since[size_t(l) * 3], since[size_t(l) * 3 + 1], since[size_t(l) * 3 + 2]});
    }
    out.rows = f.count;
    out.layer = f.layer;
    out.seq = f.seq;
    out.token = f.token;
    if (f.count == 0 && out.slots.empty()) return out;
    for (int slot : out.slots) KVQ_TRY(cuda::clear_guard(guard(), L, slot, 1, stream()));
    KVQ_TRY(cuda_status(cudaMemsetAsync(fault_.ptr, 0, sizeof f, stream()), "cudaMemsetAsync (check)"));
    KVQ_TRY(cuda_status(cudaStreamSynchronize(stream()), "cudaStreamSynchronize (check)"));
    return out;
  }

  // Arena <-> host copies on the caller's stream, a 2D copy where rows are strided (a window).
  status copy_host(std::span<const host_copy> copies, uint8_t* host, bool out) {
    KVQ_ON_DEVICE();
    if (out) KVQ_TRY(canary_.flush());  // staged canaries read rings a swap frees
    const cudaMemcpyKind kind = out ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
    for (const host_copy& c : copies) {
      uint8_t* dev = arena_.ptr + c.arena;
      uint8_t* h = host + c.host;
      const cudaError_t e =
          c.rows == 1 ? cudaMemcpyAsync(out ? h : dev, out ? dev : h, c.width, kind, stream())
                      : cudaMemcpy2DAsync(out ? h : dev, out ? c.width : c.pitch, out ? dev : h, out ? c.pitch : c.width,
                                          c.width, c.rows, kind, stream());
      KVQ_TRY(cuda_status(e, out ? "cudaMemcpyAsync (sequence out of the arena)" : "cudaMemcpyAsync (sequence into the arena)"));
    }
    return {};
  }
  status copy_to_host(std::span<const host_copy> copies, uint8_t* host) override { return copy_host(copies, host, true); }
  status copy_from_host(std::span<const host_copy> copies, const uint8_t* host) override {
    return copy_host(copies, const_cast<uint8_t*>(host), false);
  }

  status wait() override {
    KVQ_ON_DEVICE();
    return cuda_status(cudaStreamSynchronize(stream()), "cudaStreamSynchronize (sequence copies)");
  }

  // The page-table rows of a placed sequence ([slot][layers][max_pages] block units, [...][kv_heads]
  // [2] format ids), two 2D copies on the caller's stream, and the layers' notes of its pages.
  status on_placed(const sequence_state& s) override {
    KVQ_ON_DEVICE();
    const auto& sh = cfg_.shape;
    const size_t per_page = size_t(sh.kv_heads) * 2;
    size_t most = 0;
    for (const layer_state& ls : s.layers) most = std::max(most, ls.pages.size() / per_page);
    if (most > size_t(max_pages_))
      return {errc::out_of_budget, fmt::format("sequence {} holds {} pages; the page tables index {} (max_tokens)",
                                               s.id, most, max_pages_)};
    for (int l = 0; l < sh.layers; ++l) note_pages(l, 0, s.layers[size_t(l)].pages);
    if (most == 0) return {};
    std::vector<uint32_t> blocks(size_t(sh.layers) * most, 0);
    std::vector<uint8_t> fmts(blocks.size() * per_page, 0);
    for (int l = 0; l < sh.layers; ++l) {
      const std::vector<page_entry>& pages = s.layers[size_t(l)].pages;
      for (size_t i = 0; i < pages.size(); ++i) {
        if (pages[i].offset == released_page) continue;  // a released page: block 0, format 0, never read
        if (i % per_page == 0) blocks[size_t(l) * most + i / per_page] = uint32_t(pages[i].offset / block_unit);
        fmts[size_t(l) * most * per_page + i] = pages[i].fmt;
      }
    }
    const size_t row = size_t(sh.layers) * max_pages_;
    KVQ_TRY(cuda_status(cudaMemcpy2DAsync(blocks_.ptr + size_t(s.slot) * row, size_t(max_pages_) * 4, blocks.data(),
                                          most * 4, most * 4, size_t(sh.layers), cudaMemcpyHostToDevice, stream()),
                        "cudaMemcpy2DAsync (placed sequence: page table)"));
    return cuda_status(cudaMemcpy2DAsync(fmts_.ptr + size_t(s.slot) * row * per_page, size_t(max_pages_) * per_page,
                                         fmts.data(), most * per_page, most * per_page, size_t(sh.layers),
                                         cudaMemcpyHostToDevice, stream()),
                       "cudaMemcpy2DAsync (placed sequence: format table)");
  }

  uint8_t* swap_memory() const override { return swap_; }

  // One 2D copy on the caller's stream: a row per ring, `slots` slots wide. Staged canaries are
  // launched first: they read rings at their current place, whose lanes a move frees.
  status copy_rings(uint64_t from, uint64_t to, int64_t slots) override {
    KVQ_ON_DEVICE();
    KVQ_TRY(canary_.flush());
    const auto& sh = cfg_.shape;
    const size_t pitch = size_t(sh.window) * sh.head_dim * 2;
    return cuda_status(
        cudaMemcpy2DAsync(arena_.ptr + to, pitch, arena_.ptr + from, pitch, size_t(slots) * sh.head_dim * 2,
                          size_t(sh.layers) * sh.kv_heads * 2, cudaMemcpyDeviceToDevice, stream()),
        "cudaMemcpy2DAsync (the FP16 windows)");
  }

  // A cut in the ring needs nothing on the device (the lengths are launch arguments). A cut page
  // whose overwritten tokens must come back is decoded on the device into the ring
  // (`cuda::restore_run`: the CPU's bytes), on the call's stream, after the layer's staged
  // canaries (they read the ring as it was). No synchronization.
  status restore_ring(const sequence_state& s, int64_t length) override {
    KVQ_ON_DEVICE();
    restore_jobs_.clear();
    for (int l = 0; l < cfg_.shape.layers; ++l) {
      const auto [first, last] = ring_restore_range(store_, s.layers[size_t(l)], length);
      if (first == last) continue;
      restore_jobs_.push_back({l, int32_t(first), int32_t(last)});
      KVQ_TRY(canary_.flush_of(l));  // before the layer's rings change
    }
    if (restore_jobs_.empty()) return {};
    cuda::restore_args a;
    a.kv = view_;
    a.arena = arena_.ptr;
    a.slot = s.slot;
    a.window_unit = uint32_t(s.window_offset / block_unit);
    a.layers = restore_jobs_;
    a.guard = guard();
    return cuda::restore_run(a, stream());
  }

  status read(const sequence_state& s, int layer, role r, std::span<float> out) const override {
    KVQ_ON_DEVICE();
    const auto& sh = cfg_.shape;
    KVQ_TRY(cuda_status(cudaStreamSynchronize(stream()), "cudaStreamSynchronize"));
    const layer_state& ls = s.layers[size_t(layer)];
    std::vector<std::vector<uint8_t>> pages;
    // The slots of the sequence's lanes (a short sequence's rings interleave with others').
    std::vector<uint16_t> ring(size_t(std::min(sh.window, s.ring_lanes * sh.page_tokens)) * sh.head_dim);
    std::vector<uint8_t> buf;
    int ring_head = -1;
    status err;
    auto page_at = [&](const page_entry& pe) -> const uint8_t* {
      buf.resize(store_.page_bytes_of(pe.fmt, r));
      if (status st = cuda_status(cudaMemcpy(buf.data(), arena_.ptr + pe.offset, buf.size(), cudaMemcpyDeviceToHost),
                                  "cudaMemcpy");
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
    rotation::apply_rows(cfg_.rotation, layer, sh.kv_heads, 1, out.data(), ls.n, sh.kv_heads, sh.head_dim, true);
    return err;
  }

 private:
  friend class cuda_step;
  device_scope teardown_;  // first member: destroyed last, after every buffer is freed on dev_
  int dev_ = 0;            // the device current at creation: every call runs on it
  int sms_ = 132;
  int max_pages_ = 0;
  device_buffer<uint8_t> arena_;
  uint8_t* swap_ = nullptr;  // pinned host memory of cache_config::swap_bytes
  device_buffer<uint32_t> blocks_;
  device_buffer<uint8_t> fmts_;
  device_buffer<float> levels_d_;  // cache_state::levels
  device_buffer<float> sinks_;     // [layers][q_heads] sink logits (`upload_sinks`); empty without any
  device_buffer<uint8_t> held_;              // guard: [max_sequences] held slots (check_values)
  device_buffer<int32_t> since_;             // guard: [max_sequences][layers][3] first refused append
  device_buffer<cuda::append_fault> fault_;  // guard: the first refused row
  std::vector<std::unique_ptr<stream_buffers>> per_stream_;  // workspaces, one set per stream used
  cuda::paged_view view_;
  std::vector<cuda::decode_item> items_;
  std::vector<cuda::ring_restore> restore_jobs_;  // a truncation's layers (kept: no allocation per call)
  std::vector<uint8_t> layer_bits_;   // [layers] the widest `kernel_bits` of any page the layer has held
  std::vector<uint8_t> layer_bits3_;  // [layers] the same in `three_bit_kernel_bits` (3-bit kinds: 3)
  std::vector<int16_t> head_pair_;    // [layers][kv_heads] 256 K + V of the head's pages; -1 none yet, -2 several
  // A layer's decode hint, from its `head_pair_`: whether each kv head has kept one pair (and no
  // head holds a 3-bit kind beside another format), the widest `head_kernel_bits` of its heads (a
  // 3-bit kind pair at 3), and whether the layer has held a page of a 3-bit kind
  // (`attend_args::three_bit_pages`).
  struct decode_hint {
    uint8_t bits;
    bool one_pair, three;
  };
  std::vector<decode_hint> hints_;  // [layers]
  std::vector<append_call> calls_;   // the launches of the current write ([0, calls_used_)), reused
  size_t calls_used_ = 0;
  std::vector<cuda::detail::ring_rows> undo_rows_;  // per sequence of the current write

  void note(status s) {
    if (!s.ok() && canary_error_.ok()) canary_error_ = std::move(s);
  }

  canary_runner canary_;  // after the buffers: destroyed first (it waits for its launches)
  status canary_error_;   // the first canary failure since the last sync_policy
};

// The CUDA data plane of a replayable decode step (include/kvq/cache/decode_step.hpp). Its device
// tables hold, per layer, the append tables of the batch's groups of max_append_pages sequences
// (one token each encodes at most one page per sequence) and one attention table; two pinned
// host copies of them take turns, each reused once the copy that read it two steps before is
// done (an event), so the host prepares a step while the previous one runs.
class cuda_step final : public step_backend {
 public:
  cuda_step(cuda_backend& b, int max_batch, int64_t max_tokens)
      : b_(b),
        dev_(b.dev_),
        max_batch_(max_batch),
        max_tokens_(max_tokens),
        groups_((max_batch + cuda::max_append_pages - 1) / cuda::max_append_pages) {}

  // Each layer's attention plan, as the eager call would plan it for pages of the widest format
  // the layer holds or will hold (`layers`, from the policy; raised to the plan's) and
  // max_tokens; the workspace fits the largest.
  status plan(std::span<step_layer> layers) {
    const int heads = b_.cfg_.shape.kv_heads;
    size_t ws = 0;
    plans_.resize(layers.size());
    for (size_t l = 0; l < layers.size(); ++l) {
      cuda::attend_args a;
      b_.set_call(a, int(l), {}, {});
      a.max_page_bits = std::max(layers[l].max_bits, int(b_.layer_bits_[l]));
      a.one_format_per_head = layers[l].one_pair_per_head;
      // The 3-bit kinds count 3 bits (`three_bit_pages`, as the eager call's hint) where neither the
      // policy's formats nor the pages held are 16-bit or read by element: `bits3` below `a`'s bits.
      int bits3 = int(b_.layer_bits3_[l]);
      bool mixed3 = !b_.hints_[l].one_pair;  // a head with a 3-bit kind beside another format
      for (int h = 0; h < heads; ++h) {  // the pages held so far must keep the policy's pair
        const format_pair f = b_.pol_->current(int(l), h);
        const int16_t held = b_.head_pair_[l * size_t(heads) + size_t(h)];
        if (held != -1 && held != 256 * int(f.k) + int(f.v)) a.one_format_per_head = false;
        bits3 = std::max({bits3, cuda::three_bit_kernel_bits(f.k), cuda::three_bit_kernel_bits(f.v)});
        mixed3 = mixed3 || ((cuda::three_bit_kind(f.k) || cuda::three_bit_kind(f.v)) && cuda::head_kernel_bits(f.k, f.v) != 3);
      }
      a.three_bit_pages = bits3 < a.max_page_bits;
      if (a.three_bit_pages) {
        a.max_page_bits = bits3;
        // (the whole-unit instance reads 3-bit pages only in blocks of one 3-bit pair)
        if (mixed3) a.one_format_per_head = false;
      }
      size_t need = 0;
      const result<cuda::detail::launch_plan> lp = cuda::detail::replay_plan(a, max_batch_, max_tokens_, need);
      if (!lp) return lp.error();
      plans_[l] = *lp;
      ws = std::max(ws, need);
      // (the plan of 3-bit pages counted as 3 bits is always one of narrow stages: a Three or the
      // Whole instance reads them)
      layers[l] = {a.max_page_bits, a.one_format_per_head, a.three_bit_pages};
    }
    return workspace_.allocate(ws, "decode step workspace");
  }

  ~cuda_step() override {
    (void)teardown_.enter(dev_);
    for (int i = 0; i < 2; ++i) {
      if (done_[i]) (void)cudaEventSynchronize(done_[i]);  // a copy in flight still reads host_[i]
      if (done_[i]) cudaEventDestroy(done_[i]);
      if (host_[i]) cudaFreeHost(host_[i]);
    }
  }

  status init() {
    KVQ_TRY(teardown_.enter(dev_));
    // (tables sized for the step's batch: the step copies them all before each replay)
    append_bytes_ = round16(cuda::detail::append_table_bytes(std::min(max_batch_, cuda::max_append_pages)));
    layer_bytes_ = size_t(groups_) * append_bytes_ + round16(cuda::detail::decode_table_bytes(max_batch_));
    const size_t bytes = layer_bytes_ * size_t(b_.cfg_.shape.layers);
    KVQ_TRY(tables_.allocate(bytes, "decode step tables"));
    for (int i = 0; i < 2; ++i) {
      KVQ_TRY(cuda_status(cudaMallocHost(reinterpret_cast<void**>(&host_[i]), bytes), "cudaMallocHost (decode step)"));
      KVQ_TRY(cuda_status(cudaEventCreateWithFlags(&done_[i], cudaEventDisableTiming), "cudaEventCreate"));
    }
    return {};
  }

  status can_prepare() override {
    KVQ_ON_DEVICE();
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    KVQ_TRY(cuda_status(cudaStreamIsCapturing(b_.cache_stream(), &capturing), "cudaStreamIsCapturing"));
    if (capturing != cudaStreamCaptureStatusNone)
      return {errc::invalid_argument,
              "decode_step::prepare: the cache's stream is being captured; prepare a step "
              "before the capture (its descriptor copy is not part of the graph)"};
    return {};
  }

  status stage(std::span<const entry> entries, int layer) override {
    KVQ_ON_DEVICE();
    const auto& sh = b_.cfg_.shape;
    if (!staging_) {  // the buffer's previous copy (two steps ago) has read it
      KVQ_TRY(cuda_status(cudaEventSynchronize(done_[cur_]), "cudaEventSynchronize (decode step)"));
      staging_ = true;
    }
    uint8_t* at = host_[cur_] + size_t(layer) * layer_bytes_;
    std::vector<cuda::decode_item> items;
    items.reserve(entries.size());
    for (int g = 0; g < groups_; ++g) {
      const size_t first = size_t(g) * cuda::max_append_pages;
      const size_t last = std::min(entries.size(), first + cuda::max_append_pages);
      b_.calls_used_ = 0;
      cuda_backend::append_call& c = b_.next_call(int64_t(first));
      for (size_t i = first; i < last; ++i) {
        const sequence_state& s = *entries[i].s;
        const layer_state& ls = s.layers[size_t(layer)];
        const append_plan& plan = *entries[i].plan;
        const uint32_t window = uint32_t(s.window_offset / block_unit);
        c.items.push_back({s.slot, int32_t(ls.n), int32_t(ls.e), 1, window, int(plan.first_page), plan.pages,
                           int32_t(ls.ring_from), s.id});
        b_.add_pages(plan, 0, plan.pages, c);
        const int64_t n = ls.n + 1, e = ls.e + int64_t(plan.pages) * sh.page_tokens;
        items.push_back({s.slot, 1, int32_t(n), int32_t(std::min(e, n - 1)), window, int32_t(i)});
      }
      cuda::append_args a = b_.append_args(layer);
      a.items = c.items;
      a.page_blocks = c.blocks.data();
      a.page_fmts = c.fmts.data();
      KVQ_TRY(cuda::detail::fill_append_table(a, int(first), at + size_t(g) * append_bytes_));
    }
    cuda::detail::fill_decode_table(items, at + size_t(groups_) * append_bytes_);
    for (const entry& en : entries) b_.note_pages(layer, *en.plan);
    return {};
  }

  status upload() override {
    KVQ_ON_DEVICE();
    staging_ = false;
    KVQ_TRY(cuda_status(cudaMemcpyAsync(tables_.ptr, host_[cur_], tables_.count, cudaMemcpyHostToDevice, b_.cache_stream()),
                        "cudaMemcpyAsync (decode step tables)"));
    KVQ_TRY(cuda_status(cudaEventRecord(done_[cur_], b_.cache_stream()), "cudaEventRecord (decode step)"));
    cur_ ^= 1;
    return {};
  }

  size_t descriptor_bytes() const override { return tables_.count; }

  status append(int layer, const tensor_view& k, const tensor_view& v) override {
    KVQ_ON_DEVICE();
    cuda::append_args a = b_.append_args(layer);
    a.k = k;
    a.v = v;
    for (int g = 0; g < groups_; ++g)
      KVQ_TRY(cuda::detail::launch_append_replay(
          a, tables_.ptr + size_t(layer) * layer_bytes_ + size_t(g) * append_bytes_,
          std::min(cuda::max_append_pages, max_batch_ - g * cuda::max_append_pages), b_.cfg_.stream));
    return {};
  }

  status attend(int layer, const tensor_view& q, const tensor_mut& o) override {
    KVQ_ON_DEVICE();
    cuda::attend_args a;
    b_.set_call(a, layer, q, o);
    a.rotation = b_.rotation_of(layer);
    const uint8_t* table = tables_.ptr + size_t(layer) * layer_bytes_ + size_t(groups_) * append_bytes_;
    return cuda::detail::launch_attend_replay(a, plans_[size_t(layer)], table, max_batch_, workspace_.ptr,
                                              b_.cfg_.stream);
  }

 private:
  static size_t round16(size_t x) { return (x + 15) / 16 * 16; }

  device_scope teardown_;  // first member: destroyed last
  cuda_backend& b_;
  int dev_;
  int max_batch_;
  int64_t max_tokens_;
  int groups_;                                    // append tables per layer
  std::vector<cuda::detail::launch_plan> plans_;  // [layers]
  size_t append_bytes_ = 0, layer_bytes_ = 0;
  device_buffer<uint8_t> tables_;          // [layers][groups append tables, one attention table]
  device_buffer<uint8_t> workspace_;       // the attention's partial results under the largest of plans_
  uint8_t* host_[2] = {nullptr, nullptr};  // pinned, tables_'s layout
  cudaEvent_t done_[2] = {nullptr, nullptr};
  int cur_ = 0;
  bool staging_ = false;
};

result<std::unique_ptr<step_backend>> cuda_backend::make_step(int max_batch, int64_t max_tokens,
                                                              std::span<step_layer> layers) {
  KVQ_ON_DEVICE();
  auto step = std::make_unique<cuda_step>(*this, max_batch, max_tokens);
  KVQ_TRY(step->init());
  KVQ_TRY(step->plan(layers));
  return std::unique_ptr<step_backend>(std::move(step));
}

}  // namespace

result<std::unique_ptr<cache_backend>> make_cuda_backend(const cache_state& st) {
  auto b = std::make_unique<cuda_backend>(st);
  KVQ_TRY(b->init());
  return std::unique_ptr<cache_backend>(std::move(b));
}

}  // namespace detail
KVQ_NAMESPACE_END
