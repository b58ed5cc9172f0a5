// The CPU backend's attention over quantized pages (see attention/cpu_attention.hpp).
#include "cpu_attention_simd.hpp"

#include <kvq/attention/cpu_attention.hpp>
#include <kvq/attention/merge.hpp>
#include <kvq/codec/codec.hpp>

#include <algorithm>
#include <cmath>
#include <limits>

KVQ_NAMESPACE_BEGIN
namespace cpu {

// ---- worker pool ----------------------------------------------------------------------------

worker_pool::worker_pool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
}

worker_pool::~worker_pool() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void worker_pool::drain() {
  for (int i = next_.fetch_add(1); i < tasks_; i = next_.fetch_add(1)) (*fn_)(i);
}

void worker_pool::work() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock lk(mu_);
      wake_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    drain();
    std::lock_guard lk(mu_);
    if (--busy_ == 0) done_.notify_one();
  }
}

void worker_pool::run(int tasks, const std::function<void(int)>& fn) {
  if (workers_.empty() || tasks <= 1) {
    for (int i = 0; i < tasks; ++i) fn(i);
    return;
  }
  {
    std::lock_guard lk(mu_);
    fn_ = &fn;
    tasks_ = tasks;
    next_.store(0);
    busy_ = int(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  drain();
  std::unique_lock lk(mu_);
  done_.wait(lk, [&] { return busy_ == 0; });
  fn_ = nullptr;
}

namespace {

constexpr int query_tile = 64;  // queries per prefill / prefix task
constexpr int key_tile = 64;    // tokens per block read from the ring or the chunk

// Online softmax of `rows` query rows of one kv head: running max m, sum l and unnormalized
// output acc, in fp32. Row r sees the positions <= last[r].
struct softmax_rows {
  int rows = 0, d = 0;
  const float* q = nullptr;  // [rows][d], scaled by the softmax scale
  const int64_t* last = nullptr;
  float* m = nullptr;    // [rows]
  float* l = nullptr;    // [rows]
  float* acc = nullptr;  // [rows][d]

  KVQ_CPU_INLINE void reset() {
    std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
    std::fill(l, l + rows, 0.f);
    std::fill(acc, acc + int64_t(rows) * d, 0.f);
  }

  KVQ_CPU_INLINE int visible(int r, int64_t pos0, int tokens) const {
    return int(std::clamp<int64_t>(last[r] - pos0 + 1, 0, tokens));
  }

  // Folds in `tokens` keys/values at positions pos0.. (k, v: [tokens][d], readable up to
  // `tokens` rounded up to 8 rows, finite). p: scratch [rows][tokens rounded up to 8]; corr:
  // scratch [rows].
  KVQ_CPU_INLINE void absorb(const float* k, const float* v, int tokens, int64_t pos0, float* p, float* corr) {
    const int stride = (tokens + 7) & ~7;
    const f8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    const f8 none = splat8(-std::numeric_limits<float>::infinity());
    // the scores of each row, eight keys at a time, then its softmax weights (0 past what it sees)
    for (int r = 0; r < rows; ++r) {
      float* pr = p + int64_t(r) * stride;
      const int vis = visible(r, pos0, tokens);
      corr[r] = 1.f;
      if (vis == 0) {
        std::fill(pr, pr + stride, 0.f);
        continue;
      }
      const float* qr = q + int64_t(r) * d;
      const int vis8 = (vis + 7) & ~7;
      f8 mx = splat8(m[r]);
      for (int t = 0; t < vis8; t += 8) {
        f8 sc = dot8(qr, k + int64_t(t) * d, d);
        sc = lane < float(vis - t) ? sc : none;  // keys the row does not see
        mx = max8(mx, sc);
        store8(pr + t, sc);
      }
      const float m_new = hmax8(mx);
      const f8 mv = splat8(m_new);
      f8 sum = {};
      for (int t = 0; t < vis8; t += 8) {
        const f8 e = exp8_nonpositive(load8(pr + t) - mv);
        const f8 w = lane < float(vis - t) ? e : f8{};
        sum += w;
        store8(pr + t, w);
      }
      for (int t = vis8; t < stride; ++t) pr[t] = 0.f;
      corr[r] = exp_nonpositive(m[r] - m_new);
      l[r] = l[r] * corr[r] + hsum8(sum);
      m[r] = m_new;
    }
    // acc = acc * corr + p V, up to four rows at a time sharing each load of V
    int r0 = 0;
    for (; r0 + 4 <= rows; r0 += 4) accumulate<4>(r0, v, pos0, tokens, stride, p, corr);
    switch (rows - r0) {
      case 3: accumulate<3>(r0, v, pos0, tokens, stride, p, corr); break;
      case 2: accumulate<2>(r0, v, pos0, tokens, stride, p, corr); break;
      case 1: accumulate<1>(r0, v, pos0, tokens, stride, p, corr); break;
      default: break;
    }
  }

  // Rows r0..r0+N-1: acc = acc * corr + p V over the keys any of them sees, C channel blocks of
  // 8 at a time from channel c (2N independent sums per key: enough to hide the FMA latency).
  template <int N, int C>
  KVQ_CPU_INLINE void accumulate_blocks(int r0, int c, const float* v, int vis, int stride, const float* p,
                                        const float* corr) {
    f8 x[C][N];
    for (int b = 0; b < C; ++b)
      for (int i = 0; i < N; ++i) x[b][i] = load8(acc + int64_t(r0 + i) * d + c + 8 * b) * corr[r0 + i];
    for (int t = 0; t < vis; ++t) {
      f8 vt[C];
      for (int b = 0; b < C; ++b) vt[b] = load8(v + int64_t(t) * d + c + 8 * b);
      for (int i = 0; i < N; ++i) {
        const f8 w = splat8(p[int64_t(r0 + i) * stride + t]);
        for (int b = 0; b < C; ++b) x[b][i] += w * vt[b];
      }
    }
    for (int b = 0; b < C; ++b)
      for (int i = 0; i < N; ++i) store8(acc + int64_t(r0 + i) * d + c + 8 * b, x[b][i]);
  }

  template <int N>
  KVQ_CPU_INLINE void accumulate(int r0, const float* v, int64_t pos0, int tokens, int stride, const float* p,
                                 const float* corr) {
    int vis = 0;
    for (int i = 0; i < N; ++i) vis = std::max(vis, visible(r0 + i, pos0, tokens));
    if (vis == 0) return;
    int c = 0;
    for (; c + 16 <= d; c += 16) accumulate_blocks<N, 2>(r0, c, v, vis, stride, p, corr);
    if (c < d) accumulate_blocks<N, 1>(r0, c, v, vis, stride, p, corr);
  }

  // Row r's output (acc / l) into o_row [d] and its log-sum-exp (-inf: no key seen, o = 0).
  KVQ_CPU_INLINE float finish(int r, float* o_row) const {
    const float* a = acc + int64_t(r) * d;
    if (l[r] == 0.f) {
      std::fill(o_row, o_row + d, 0.f);
      return -std::numeric_limits<float>::infinity();
    }
    const float inv = 1.f / l[r];
    for (int c = 0; c < d; ++c) o_row[c] = a[c] * inv;
    return m[r] + std::log(l[r]);
  }
};

// Per-thread scratch, grown as needed and kept between calls (no allocation in steady state).
struct scratch {
  std::vector<float> k, v, p, corr, q, m, l, acc, o, lse, o2, lse2;
  std::vector<int64_t> last;
  void size_for(int rows, int d, int tile_tokens) {
    const size_t rd = size_t(rows) * d;
    for (auto* x : {&q, &acc, &o, &o2}) x->resize(rd);
    for (auto* x : {&m, &l, &corr, &lse, &lse2}) x->resize(size_t(rows));
    last.resize(size_t(rows));
    k.resize(size_t(tile_tokens) * d);
    v.resize(k.size());
    p.resize(size_t(rows) * ((tile_tokens + 7) & ~7));
  }
  softmax_rows state(int rows, int d) {
    return {rows, d, q.data(), last.data(), m.data(), l.data(), acc.data()};
  }
};
scratch& local_scratch() {
  thread_local scratch s;
  return s;
}

// The stored tokens [0, end) of one kv head, a block at a time: whole pages decoded for tokens
// before `from_pages`, then the FP16 ring in blocks of `key_tile` tokens.
struct stored_blocks {
  const stored_layer& kv;
  int h;
  int64_t from_pages, end, pos = 0;

  KVQ_CPU_INLINE bool next(float* kt, float* vt, int& tokens, int64_t& pos0) {
    if (pos >= end) return false;
    const cache_shape& sh = *kv.shape;
    const int P = sh.page_tokens, d = sh.head_dim, H = sh.kv_heads, R = sh.window;
    pos0 = pos;
    if (pos < from_pages) {
      tokens = int(std::min<int64_t>(P, from_pages - pos));
      const size_t at = (size_t(pos / P) * H + h) * 2;
      for (role r : {role::k, role::v}) {
        const page_entry& pe = kv.ls->pages[at + (r == role::k ? 0 : 1)];
        decode_page_rows(codec::make_geom(pe.fmt, r, P, d), kv.arena + pe.offset, tokens, r == role::k ? kt : vt);
      }
    } else {
      tokens = int(std::min<int64_t>(key_tile, end - pos));
      for (int r = 0; r < 2; ++r) {
        const uint16_t* ring = kv.window + (int64_t(h) * 2 + r) * R * d;
        float* out = r == 0 ? kt : vt;
        // the ring's slots of these tokens: at most two contiguous runs
        for (int t = 0; t < tokens;) {
          const int64_t slot = (pos + t) % R;
          const int run = int(std::min<int64_t>(tokens - t, R - slot));
          halves_to_floats(ring + slot * d, out + int64_t(t) * d, int64_t(run) * d);
          t += run;
        }
      }
    }
    pos += tokens;
    return true;
  }
};

int tile_tokens(const cache_shape& sh) { return std::max(sh.page_tokens, key_tile); }

// Loads query rows [i0, i0 + count) of kv head h's group, scaled: row (i - i0) * group + g.
KVQ_CPU_INLINE void load_queries(const tensor_view& q, int64_t row0, int i0, int count, int h, int group, int d,
                                 float scale, float* out) {
  for (int i = 0; i < count; ++i)
    for (int g = 0; g < group; ++g) {
      const int64_t src = (row0 + i0 + i) * q.stride() + int64_t(h * group + g) * d;
      float* dst = out + (int64_t(i) * group + g) * d;
      if (q.type == dtype::f32) {
        const float* x = static_cast<const float*>(q.data) + src;
        for (int c = 0; c < d; ++c) dst[c] = x[c] * scale;
      } else {
        for (int c = 0; c < d; ++c) dst[c] = load(q.data, q.type, src + c) * scale;
      }
    }
}

// Writes rows of one kv head's group (as `load_queries` orders them) from `src` [rows][d].
void store_rows(const tensor_mut& o, int64_t row0, int i0, int count, int h, int group, int d, const float* src) {
  for (int i = 0; i < count; ++i)
    for (int g = 0; g < group; ++g) {
      const int64_t dst = (row0 + i0 + i) * o.stride() + int64_t(h * group + g) * d;
      const float* x = src + (int64_t(i) * group + g) * d;
      for (int c = 0; c < d; ++c) store(o.data, o.type, dst + c, x[c]);
    }
}

// One (item, kv head) of an attend: causal over the item's n stored tokens.
KVQ_CPU_CLONES void attend_task(const attend_task_item& it, int h, const tensor_view& q, const tensor_mut& o,
                                float scale) {
  const cache_shape& sh = *it.kv.shape;
  const int d = sh.head_dim, group = sh.q_heads / sh.kv_heads, rows = it.q_len * group;
  const int64_t n = it.kv.ls->n;
  scratch& sc = local_scratch();
  sc.size_for(rows, d, tile_tokens(sh));
  load_queries(q, it.row, 0, it.q_len, h, group, d, scale, sc.q.data());
  for (int r = 0; r < rows; ++r) sc.last[size_t(r)] = n - it.q_len + r / group;
  softmax_rows st = sc.state(rows, d);
  st.reset();
  stored_blocks blocks{it.kv, h, std::min(it.kv.ls->e, n - it.q_len), n};
  int tokens = 0;
  int64_t pos0 = 0;
  while (blocks.next(sc.k.data(), sc.v.data(), tokens, pos0)) st.absorb(sc.k.data(), sc.v.data(), tokens, pos0, sc.p.data(), sc.corr.data());
  for (int r = 0; r < rows; ++r) st.finish(r, sc.o.data() + int64_t(r) * d);
  store_rows(o, it.row, 0, it.q_len, h, group, d, sc.o.data());
}

// The stored-prefix part of queries [i0, i0 + count) of kv head h: every row sees [0, prefix).
// Leaves the outputs in sc.o and the log-sum-exps in sc.lse.
KVQ_CPU_CLONES void prefix_part(const stored_layer& kv, int64_t prefix, int h, const tensor_view& q, int i0, int count,
                                float scale) {
  const cache_shape& sh = *kv.shape;
  const int d = sh.head_dim, group = sh.q_heads / sh.kv_heads, rows = count * group;
  scratch& sc = local_scratch();
  sc.size_for(rows, d, tile_tokens(sh));
  load_queries(q, 0, i0, count, h, group, d, scale, sc.q.data());
  std::fill(sc.last.begin(), sc.last.begin() + rows, prefix - 1);
  softmax_rows st = sc.state(rows, d);
  st.reset();
  stored_blocks blocks{kv, h, std::min(kv.ls->e, prefix), prefix};
  int tokens = 0;
  int64_t pos0 = 0;
  while (blocks.next(sc.k.data(), sc.v.data(), tokens, pos0)) st.absorb(sc.k.data(), sc.v.data(), tokens, pos0, sc.p.data(), sc.corr.data());
  for (int r = 0; r < rows; ++r) sc.lse[size_t(r)] = st.finish(r, sc.o.data() + int64_t(r) * d);
}

// The chunk part of queries [i0, i0 + count) of kv head h: query i sees chunk tokens 0..i of
// ck/cv ([kv_heads][T][d], fp16-rounded). Leaves the outputs in sc.o2 and the lse in sc.lse2.
// Expects sc.q to hold the tile's scaled queries (prefix_part loads them).
KVQ_CPU_CLONES void chunk_part(const cache_shape& sh, const float* ck, const float* cv, int64_t T, int h, int i0,
                               int count) {
  const int d = sh.head_dim, group = sh.q_heads / sh.kv_heads, rows = count * group;
  scratch& sc = local_scratch();
  for (int r = 0; r < rows; ++r) sc.last[size_t(r)] = i0 + r / group;
  softmax_rows st = sc.state(rows, d);
  st.reset();
  const float* kh = ck + int64_t(h) * T * d;
  const float* vh = cv + int64_t(h) * T * d;
  for (int64_t j = 0; j < i0 + count; j += key_tile) {
    const int tokens = int(std::min<int64_t>(key_tile, i0 + count - j));
    st.absorb(kh + j * d, vh + j * d, tokens, j, sc.p.data(), sc.corr.data());
  }
  for (int r = 0; r < rows; ++r) sc.lse2[size_t(r)] = st.finish(r, sc.o2.data() + int64_t(r) * d);
}

int query_tiles(int64_t T) { return int((T + query_tile - 1) / query_tile); }

}  // namespace

void attend(worker_pool& pool, std::span<const attend_task_item> items, const tensor_view& q, const tensor_mut& o,
            float scale) {
  if (items.empty()) return;
  const int H = items[0].kv.shape->kv_heads;
  pool.run(int(items.size()) * H, [&](int t) { attend_task(items[size_t(t / H)], t % H, q, o, scale); });
}

void attend_prefix(worker_pool& pool, const stored_layer& kv, int64_t prefix, const tensor_view& q,
                   const tensor_mut& o, float* lse, float scale) {
  const cache_shape& sh = *kv.shape;
  const int H = sh.kv_heads, d = sh.head_dim, group = sh.q_heads / H, tiles = query_tiles(q.tokens);
  pool.run(tiles * H, [&](int t) {
    const int h = t % H, i0 = (t / H) * query_tile, count = int(std::min<int64_t>(query_tile, q.tokens - i0));
    prefix_part(kv, prefix, h, q, i0, count, scale);
    const scratch& sc = local_scratch();
    store_rows(o, 0, i0, count, h, group, d, sc.o.data());
    for (int i = 0; i < count; ++i)
      for (int g = 0; g < group; ++g) lse[int64_t(i0 + i) * sh.q_heads + h * group + g] = sc.lse[size_t(i * group + g)];
  });
}

void prefill(worker_pool& pool, const stored_layer& kv, int64_t prefix, const tensor_view& k, const tensor_view& v,
             const tensor_view& q, const tensor_mut& o, float scale) {
  const cache_shape& sh = *kv.shape;
  const int H = sh.kv_heads, d = sh.head_dim, group = sh.q_heads / H, tiles = query_tiles(q.tokens);
  const int64_t T = k.tokens;
  // The chunk's K and V as the ring would hold them (fp16), per kv head: [kv_heads][T][d], and 8
  // rows of zeros after the last head's (`absorb` reads keys in eights).
  std::vector<float> ck(size_t(H) * T * d + 8 * size_t(d)), cv(ck.size());
  for (int64_t i = 0; i < T; ++i)
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < d; ++c) {
        const size_t dst = (size_t(h) * T + i) * d + c;
        ck[dst] = half_to_float(float_to_half(load(k.data, k.type, i * k.stride() + h * d + c)));
        cv[dst] = half_to_float(float_to_half(load(v.data, v.type, i * v.stride() + h * d + c)));
      }
  pool.run(tiles * H, [&](int t) {
    const int h = t % H, i0 = (t / H) * query_tile, count = int(std::min<int64_t>(query_tile, T - i0));
    prefix_part(kv, prefix, h, q, i0, count, scale);
    chunk_part(sh, ck.data(), cv.data(), T, h, i0, count);
    scratch& sc = local_scratch();
    merge_attention(sc.o.data(), sc.lse.data(), sc.o2.data(), sc.lse2.data(), int64_t(count) * group, d);
    store_rows(o, 0, i0, count, h, group, d, sc.o.data());
  });
}

}  // namespace cpu
KVQ_NAMESPACE_END
