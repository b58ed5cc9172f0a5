// The CPU backend: the arena in host memory, quantize-on-write through the shared codec,
// attention a page at a time (attention/cpu_attention.hpp); `gather` + kvq::ref::attend is the
// plain reference it is tested against.
#include <kvq/attention/cpu_attention.hpp>
#include <kvq/codec/codec.hpp>
#include <kvq/detail/backend.hpp>
#include <kvq/rotation/rotation.hpp>

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

KVQ_NAMESPACE_BEGIN
namespace detail {
namespace {

using cpu::bad_value;
using cpu::first_bad_value;
using cpu::load;

class cpu_backend final : public cache_backend {
 public:
  cpu_backend(const cache_state& st, std::unique_ptr<uint8_t[]> bytes, std::unique_ptr<uint8_t[]> swap)
      : cache_backend(st), bytes_(std::move(bytes)), swap_(std::move(swap)), pool_(st.cfg.cpu_threads) {}

  uint16_t* ring(const sequence_state& s, int layer, int h, role r) const {
    return reinterpret_cast<uint16_t*>(bytes_.get() + store_.window_offset(s, layer, h, r));
  }

  // Every value finite and within the fp16 range; `first_row` numbers the rows in the message
  // (a batch's row of the sequence's first token).
  status validate(const sequence_state& s, int layer, const tensor_view& k, const tensor_view& v, const char* call,
                  int64_t first_row) const {
    const int d = cfg_.shape.head_dim, H = cfg_.shape.kv_heads;
    for (const tensor_view* t : {&k, &v}) {
      const bad_value b = first_bad_value(*t, 0, t->tokens);
      if (b.row >= 0)
        return {std::isfinite(b.x) ? errc::invalid_argument : errc::non_finite,
                fmt::format("{}: {}[token {}][head {}][channel {}] = {} of sequence {} layer {} is {}; nothing was "
                            "stored",
                            call, t == &k ? "K" : "V", first_row + b.row, b.elem / d, b.elem % d, b.x, s.id, layer,
                            std::isfinite(b.x) ? "outside the fp16 range" : "not finite")};
      // A rotated head stores R x in fp16: its rotated values must fit too.
      float row[256];
      for (int h = 0; h < H; ++h) {
        if (!cfg_.rotation.rotated(layer, h, H)) continue;
        const rotation::signs sg = cfg_.rotation.signs_of(layer, h);
        for (int64_t i = 0; i < t->tokens; ++i) {
          for (int c = 0; c < d; ++c) row[c] = load(t->data, t->type, i * t->stride() + h * d + c);
          rotation::rotate(row, d, sg);
          for (int c = 0; c < d; ++c)
            if (std::fabs(row[c]) > fp16_max)
              return {errc::invalid_argument,
                      fmt::format("{}: {}[token {}][head {}] of sequence {} layer {} rotated has {} in channel {}, "
                                  "outside the fp16 range; nothing was stored",
                                  call, t == &k ? "K" : "V", first_row + i, h, s.id, layer, row[c], c)};
        }
      }
    }
    return {};
  }

  status write(sequence_state& s, int layer, const tensor_view& k, const tensor_view& v, const append_plan& plan) override {
    KVQ_TRY(validate(s, layer, k, v, "append", 0));
    store(s, layer, k, v, plan);
    return {};
  }

  status write_batch(std::span<const batch_entry> entries, int layer, const tensor_view& k, const tensor_view& v) override {
    for (const batch_entry& b : entries)  // validate everything before anything is stored
      KVQ_TRY(validate(*b.s, layer, rows_of(k, b.row, b.tokens), rows_of(v, b.row, b.tokens), "append_batch", b.row));
    for (const batch_entry& b : entries) store(*b.s, layer, rows_of(k, b.row, b.tokens), rows_of(v, b.row, b.tokens), *b.plan);
    return {};
  }

  // Stores validated tokens: the ring, then every page the plan completes.
  void store(sequence_state& s, int layer, const tensor_view& k, const tensor_view& v, const append_plan& plan) {
    const auto& sh = cfg_.shape;
    const int d = sh.head_dim, H = sh.kv_heads, R = sh.window, P = sh.page_tokens;
    layer_state& ls = s.layers[size_t(layer)];
    int64_t n = ls.n, e = ls.e;
    int page = 0;
    float row[256];
    for (int64_t i = 0; i < k.tokens; ++i, ++n) {
      for (int h = 0; h < H; ++h)
        for (role r : {role::k, role::v}) {
          const tensor_view& t = r == role::k ? k : v;
          uint16_t* dst = ring(s, layer, h, r) + (n % R) * d;
          for (int c = 0; c < d; ++c) row[c] = load(t.data, t.type, i * t.stride() + h * d + c);
          if (cfg_.rotation.rotated(layer, h, H)) rotation::rotate(row, d, cfg_.rotation.signs_of(layer, h));
          for (int c = 0; c < d; ++c) dst[c] = float_to_half(row[c]);
        }
      if (n + 1 - e == P + sh.recent) {  // the oldest P unencoded tokens become a page
        for (int h = 0; h < H; ++h)
          for (role r : {role::k, role::v}) {
            const page_entry& pe = plan.entries[(size_t(page) * H + h) * 2 + (r == role::k ? 0 : 1)];
            const codec::page_geom g = codec::make_geom(pe.fmt, r, P, d);
            uint8_t* dst = bytes_.get() + pe.offset;
            std::memset(dst, 0, g.lay.total());
            const uint16_t* src = ring(s, layer, h, r) + (e % R) * d;
            const codec::encode_params ep = encode_of(layer, h, r, pe.fmt);
            for (int u = 0; u < g.unit_count(); ++u) codec::encode_unit(g, src, d, u, dst, ep);
          }
        e += P;
        ++page;
      }
    }
  }

  void gather(const sequence_state& s, int layer, role r, int q_len, float* out) const {
    detail::gather(
        cfg_.shape, s.layers[size_t(layer)], r, q_len, [&](const page_entry& pe) { return bytes_.get() + pe.offset; },
        [&](int h) { return ring(s, layer, h, r); }, out);
  }

  cpu::stored_layer stored(const sequence_state& s, int layer) const {
    return {&cfg_.shape, &s.layers[size_t(layer)], bytes_.get(), ring(s, layer, 0, role::k)};
  }

  // Hands a wanting policy (EchoKV) the step's queries: `q_len` rows of `q` from `row`, of a
  // step that ends at the layer's n tokens.
  void observe(const sequence_state& s, int layer, const tensor_view& q, int64_t row, int q_len) {
    if (!pol_->wants_queries()) return;
    const auto& sh = cfg_.shape;
    const int w = sh.q_heads * sh.head_dim;
    qf_.resize(size_t(q_len) * w);
    for (int i = 0; i < q_len; ++i)
      for (int e = 0; e < w; ++e) qf_[size_t(i) * w + e] = load(q.data, q.type, (row + i) * q.stride() + e);
    const int64_t n = s.layers[size_t(layer)].n;
    pol_->observe({s.id, layer, n, q_len, qf_.data(), ring(s, layer, 0, role::k), std::max<int64_t>(0, n - sh.window)});
  }

  // True when some kv head of `layer` is rotated: its queries, chunk K/V and outputs go through
  // f32 scratch rotated per head (docs/architecture.md, "Rotation").
  bool rotated(int layer) const { return cfg_.rotation.layer_rotated(layer, cfg_.shape.kv_heads); }

  // The rows of `t` as packed floats in `buf`, rotated where their kv head is; `group` heads of t
  // per kv head (the GQA group for queries, 1 for K/V).
  tensor_view rotated_rows(const tensor_view& t, int layer, int group, std::vector<float>& buf) const {
    const int w = t.heads * t.head_dim;
    buf.resize(size_t(t.tokens) * w);
    for (int64_t i = 0; i < t.tokens; ++i)
      for (int e = 0; e < w; ++e) buf[size_t(i) * w + e] = load(t.data, t.type, i * t.stride() + e);
    rotation::apply_rows(cfg_.rotation, layer, cfg_.shape.kv_heads, group, buf.data(), t.tokens, t.heads, t.head_dim,
                         false);
    return {buf.data(), dtype::f32, t.tokens, t.heads, t.head_dim, 0};
  }
  // A packed f32 output of o's shape over `buf`, in the rotated space.
  static tensor_mut scratch_like(const tensor_mut& o, std::vector<float>& buf) {
    buf.resize(size_t(o.tokens) * o.heads * o.head_dim);
    return {buf.data(), dtype::f32, o.tokens, o.heads, o.head_dim, 0};
  }
  // o <- the rotated output of `scratch` rotated back per head.
  void unrotate_into(const tensor_mut& scratch, int layer, const tensor_mut& o) const {
    const auto& sh = cfg_.shape;
    float* x = static_cast<float*>(scratch.data);
    rotation::apply_rows(cfg_.rotation, layer, sh.kv_heads, sh.q_heads / sh.kv_heads, x, o.tokens, o.heads, o.head_dim,
                         true);
    const int w = o.heads * o.head_dim;
    for (int64_t i = 0; i < o.tokens; ++i)
      for (int e = 0; e < w; ++e) cpu::store(o.data, o.type, i * o.stride() + e, x[size_t(i) * w + e]);
  }
  int q_group() const { return cfg_.shape.q_heads / cfg_.shape.kv_heads; }

  status attend(std::span<const attend_item> items, int layer, const tensor_view& q_in, const tensor_mut& o_in) override {
    const bool rot = rotated(layer);
    const tensor_view q = rot ? rotated_rows(q_in, layer, q_group(), q_rot_) : q_in;
    const tensor_mut o = rot ? scratch_like(o_in, o_rot_) : o_in;
    items_.clear();
    int64_t row = 0;
    for (const auto& it : items) {
      const sequence_state& s = *store_.find(it.seq);
      observe(s, layer, q, row, it.q_len);  // the canary measures in the space the pages live in
      items_.push_back({stored(s, layer), it.q_len, row});
      row += it.q_len;
    }
    cpu::attend(pool_, items_, q, o, softmax_scale(), cfg_.layer_attention(layer));
    if (rot) unrotate_into(o, layer, o_in);
    return {};
  }

  bool prefill_any_length() const override { return true; }

  status prefill(const sequence_state& s, int layer, int64_t prefix, const tensor_view& k_in, const tensor_view& v_in,
                 const tensor_view& q_in, const tensor_mut& o_in) override {
    // A rotated layer's chunk K/V are rotated as the ring holds them, so both parts of the merge
    // are in the rotated space.
    const bool rot = rotated(layer);
    const tensor_view q = rot ? rotated_rows(q_in, layer, q_group(), q_rot_) : q_in;
    const tensor_view k = rot ? rotated_rows(k_in, layer, 1, k_rot_) : k_in;
    const tensor_view v = rot ? rotated_rows(v_in, layer, 1, v_rot_) : v_in;
    const tensor_mut o = rot ? scratch_like(o_in, o_rot_) : o_in;
    // The policy sees the chunk's last queries, at most a window of them, as a step would.
    const int64_t seen = std::min<int64_t>(q.tokens, cfg_.shape.window);
    observe(s, layer, q, q.tokens - seen, int(seen));
    cpu::prefill(pool_, stored(s, layer), prefix, k, v, q, o, softmax_scale(), cfg_.layer_attention(layer));
    if (rot) unrotate_into(o, layer, o_in);
    return {};
  }

  status attend_prefix(const sequence_state& s, int layer, int64_t prefix, const tensor_view& q_in,
                       const tensor_mut& o_in, float* lse) override {
    const bool rot = rotated(layer);
    const tensor_view q = rot ? rotated_rows(q_in, layer, q_group(), q_rot_) : q_in;
    const tensor_mut o = rot ? scratch_like(o_in, o_rot_) : o_in;
    cpu::attend_prefix(pool_, stored(s, layer), prefix, q, o, lse, softmax_scale(), cfg_.layer_attention(layer));
    if (rot) unrotate_into(o, layer, o_in);
    return {};
  }

  status read(const sequence_state& s, int layer, role r, std::span<float> out) const override {
    gather(s, layer, r, 0, out.data());
    const auto& sh = cfg_.shape;
    rotation::apply_rows(cfg_.rotation, layer, sh.kv_heads, 1, out.data(), s.layers[size_t(layer)].n, sh.kv_heads,
                         sh.head_dim, true);
    return {};
  }

  status fork(const sequence_state& src, const sequence_state& dst) override {
    return copy_rings(src.window_offset, dst.window_offset, int64_t(src.ring_lanes) * cfg_.shape.page_tokens);
  }

  status copy_to_host(std::span<const host_copy> copies, uint8_t* host) override {
    copy_host(copies, host, true);
    return {};
  }

  status copy_from_host(std::span<const host_copy> copies, const uint8_t* host) override {
    copy_host(copies, const_cast<uint8_t*>(host), false);
    return {};
  }

  // Arena <-> host copies, a row at a time (rows `pitch` apart in the arena, back to back on the host).
  void copy_host(std::span<const host_copy> copies, uint8_t* host, bool out) {
    for (const host_copy& c : copies)
      for (uint64_t row = 0; row < c.rows; ++row) {
        uint8_t* arena = bytes_.get() + c.arena + row * c.pitch;
        uint8_t* h = host + c.host + row * c.width;
        std::memcpy(out ? h : arena, out ? arena : h, size_t(c.width));
      }
  }

  uint8_t* swap_memory() const override { return swap_.get(); }

  status copy_rings(uint64_t from, uint64_t to, int64_t slots) override {
    const auto& sh = cfg_.shape;
    const uint64_t pitch = uint64_t(sh.window) * sh.head_dim * 2;
    for (uint64_t ring = 0; ring < uint64_t(sh.layers) * sh.kv_heads * 2; ++ring)
      std::memcpy(bytes_.get() + to + ring * pitch, bytes_.get() + from + ring * pitch, size_t(slots) * sh.head_dim * 2);
    return {};
  }

  status restore_ring(const sequence_state& s, int64_t length) override {
    const auto& sh = cfg_.shape;
    for (int l = 0; l < sh.layers; ++l) {
      const layer_state& ls = s.layers[size_t(l)];
      const auto [first, last] = ring_restore_range(store_, ls, length);
      if (first == last) continue;
      for (int h = 0; h < sh.kv_heads; ++h)
        for (role r : {role::k, role::v}) {
          const page_entry& pe = ls.pages[(size_t(first / sh.page_tokens) * sh.kv_heads + h) * 2 + (r == role::k ? 0 : 1)];
          restore_rows(sh, pe, r, bytes_.get() + pe.offset, first, last, ring(s, l, h, r));
        }
    }
    return {};
  }

 private:
  std::unique_ptr<uint8_t[]> bytes_;
  std::unique_ptr<uint8_t[]> swap_;  // cache_config::swap_bytes
  cpu::worker_pool pool_;
  std::vector<cpu::attend_task_item> items_;  // the current attend's items (kept: no allocation per call)
  std::vector<float> qf_;                      // the queries handed to the policy
  std::vector<float> q_rot_, k_rot_, v_rot_, o_rot_;  // a rotated layer's rows (kept: no allocation per call)
};

}  // namespace

void gather(const cache_shape& sh, const layer_state& ls, role r, int q_len,
            const std::function<const uint8_t*(const page_entry&)>& page_at,
            const std::function<const uint16_t*(int kv_head)>& ring_at, float* out) {
  const int d = sh.head_dim, H = sh.kv_heads, R = sh.window, P = sh.page_tokens;
  const int64_t from_pages = std::min(ls.e, ls.n - q_len);
  for (int h = 0; h < H; ++h) {
    for (int64_t j = 0; j < std::min(ls.released, from_pages); ++j)  // a sliding layer's released pages
      std::fill(out + (j * H + h) * d, out + (j * H + h + 1) * d, 0.f);
    for (int64_t p0 = ls.released; p0 < from_pages; p0 += P) {
      const page_entry& pe = ls.pages[(size_t(p0 / P) * H + h) * 2 + (r == role::k ? 0 : 1)];
      const codec::page_geom g = codec::make_geom(pe.fmt, r, P, d);
      const uint8_t* page = page_at(pe);
      const int64_t rows = std::min<int64_t>(P, from_pages - p0);
      for (int t = 0; t < rows; ++t)
        for (int c = 0; c < d; ++c) out[((p0 + t) * H + h) * d + c] = codec::decode_element(g, page, t, c);
    }
    const uint16_t* rg = ring_at(h);
    for (int64_t j = from_pages; j < ls.n; ++j)
      for (int c = 0; c < d; ++c) out[(j * H + h) * d + c] = half_to_float(rg[(j % R) * d + c]);
  }
}

void restore_rows(const cache_shape& sh, const page_entry& pe, role r, const uint8_t* page, int64_t first, int64_t last,
                  uint16_t* ring) {
  const int d = sh.head_dim, P = sh.page_tokens;
  const codec::page_geom g = codec::make_geom(pe.fmt, r, P, d);
  for (int64_t j = first; j < last; ++j)
    for (int c = 0; c < d; ++c)
      ring[(j % sh.window) * d + c] = float_to_half(codec::decode_element(g, page, int(j % P), c));
}

result<std::unique_ptr<cache_backend>> make_cpu_backend(const cache_state& st) {
  const uint64_t n = st.store.arena().capacity();
  std::unique_ptr<uint8_t[]> bytes(n <= SIZE_MAX ? new (std::nothrow) uint8_t[size_t(n)] : nullptr);
  if (!bytes)
    return status{errc::out_of_budget,
                  fmt::format("KVCache::create: cannot allocate the CPU budget of {} bytes in host memory", n)};
  const uint64_t w = st.cfg.swap_bytes;
  std::unique_ptr<uint8_t[]> swap(w == 0 ? nullptr : w <= SIZE_MAX ? new (std::nothrow) uint8_t[size_t(w)] : nullptr);
  if (w && !swap)
    return status{errc::out_of_budget,
                  fmt::format("KVCache::create: cannot allocate the swap space of {} bytes (cache_config.swap_bytes)", w)};
  return std::unique_ptr<cache_backend>(std::make_unique<cpu_backend>(st, std::move(bytes), std::move(swap)));
}

}  // namespace detail
KVQ_NAMESPACE_END
