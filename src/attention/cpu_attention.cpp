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
constexpr int chunk_tile = 32;  // queries per task of `causal_attention`

// Online-softmax step of one row over its block scores s[0, valid) (valid > 0; s readable and
// writable up to `valid` rounded up to 8, what lies past `valid` ignored): the running max m and
// sum l move on, s becomes the weights exp(s - m), zero from `valid` up to the larger of
// `zero_to` and `valid` rounded up to 8 (so that a V pass may run over more keys than the row
// sees); returns the factor that rescales the row's earlier accumulator. Whole vectors, the last
// one masked.
KVQ_CPU_INLINE float softmax_block(float* s, int valid, int zero_to, float& m, float& l) {
  const int whole = valid & ~7, n8 = (valid + 7) & ~7;
  const f8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const f8 none = splat8(-std::numeric_limits<float>::infinity());
  const auto seen = lane < float(valid - whole);  // all ones on the last vector's keys the row sees
  f8 vm = splat8(m);
  for (int j = 0; j < whole; j += 8) vm = max8(vm, load8(s + j));
  if (whole < valid) vm = max8(vm, seen ? load8(s + whole) : none);
  const float mx = hmax8(vm);
  const f8 mv = splat8(mx);
  f8 vs = {};
  for (int j = 0; j < whole; j += 8) {
    const f8 e = exp8_nonpositive(load8(s + j) - mv);
    store8(s + j, e);
    vs += e;
  }
  if (whole < valid) {
    const f8 e = exp8_nonpositive(seen ? load8(s + whole) - mv : none), w = seen ? e : f8{};
    store8(s + whole, w);
    vs += w;
  }
  for (int j = n8; j < zero_to; ++j) s[j] = 0.f;
  const float corr = exp_nonpositive(m - mx);
  l = l * corr + hsum8(vs);
  m = mx;
  return corr;
}

// a_u += x w_u and b_u += y w_u for u = 0..3: eight independent vector sums (the accumulators
// are named, not an array, so that they stay in registers).
KVQ_CPU_INLINE void fma_pair(f8& a0, f8& a1, f8& a2, f8& a3, f8& b0, f8& b1, f8& b2, f8& b3, float x, float y, f8 w0,
                             f8 w1, f8 w2, f8 w3) {
  a0 += x * w0;
  a1 += x * w1;
  a2 += x * w2;
  a3 += x * w3;
  b0 += y * w0;
  b1 += y * w1;
  b2 += y * w2;
  b3 += y * w3;
}
KVQ_CPU_INLINE void store4(float* p, f8 w0, f8 w1, f8 w2, f8 w3) {
  store8(p, w0);
  store8(p + 8, w1);
  store8(p + 16, w2);
  store8(p + 24, w3);
}

// Rows of one kv head over a contiguous chunk of keys and values (`chunk_fold`).
struct chunk_rows {
  const float* kt;  // the head's keys packed per block of key_tile, transposed: [blocks][d][key_tile], zero past the last key
  const float* v;   // the head's values: key j at v + j * ldv
  int64_t ldv;
  int d, group, rows;
  int64_t first;  // position of row 0's token; row r's token is first + r / group
  const float* q;  // [rows][d], scaled by the softmax scale
  float* acc;      // [rows][d] unnormalized output
  float* m;        // [rows] running max
  float* l;        // [rows] running sum
  float* s;        // scratch [2 key_tile]
  int64_t window = 0;  // > 0: row r sees keys from its token's position - window + 1 on (a sliding layer)
  float softcap = 0.f;  // > 0: scores soft-capped (`attention_variant::cap`)
};

// A row's scores over a block before its softmax: keys before `lo` (out of its window) at -inf,
// the ones it sees [lo, valid) soft-capped when `softcap` is set.
KVQ_CPU_INLINE void mask_and_cap(float* s, int lo, int valid, float softcap) {
  for (int j = 0; j < lo; ++j) s[j] = -std::numeric_limits<float>::infinity();
  if (softcap > 0.f)
    for (int j = lo; j < valid; ++j) s[j] = softcap * std::tanh(s[j] / softcap);
}

// Packs keys 0..n-1 of one kv head (key j at k + j * ldk, d floats) as `chunk_rows::kt` wants
// them; `kt` [ldt / key_tile][d][key_tile] must be zero beforehand.
void pack_keys(const float* k, int64_t ldk, int64_t n, int d, float* kt) {
  for (int64_t j = 0; j < n; ++j) {
    const float* kr = k + j * ldk;
    float* panel = kt + j / key_tile * key_tile * d + j % key_tile;
    for (int c = 0; c < d; ++c) panel[c * key_tile] = kr[c];
  }
}

// Causal attention of the rows over the chunk: row r sees keys 0..first + r / group (from its
// window's first key on in a sliding layer); leaves acc, m and l (every row sees its own key:
// l > 0). Rows go in pairs: each packed key vector (and, in
// the V pass, each V vector) is loaded once for two rows, eight independent vector sums in
// flight, a row's scores over 8 keys in one register across d (d a multiple of 8 for the
// vector V pass; other head sizes take plain loops).
template <bool in_registers>
KVQ_CPU_INLINE void chunk_fold_body(const chunk_rows& a) {
  constexpr int B = key_tile, L = 8;
  // Four vectors loaded once for both rows of a pair. GCC's AVX2 build keeps them in registers
  // (an empty asm that needs each in one register): otherwise GCC folds each load into both
  // rows' FMAs, twice the loads, and the loops are bound by loads. (Clang refuses a 32-byte
  // register operand in a file compiled without AVX, even in an AVX2 function: no pin there.)
  auto pin = [](f8& w0, f8& w1, f8& w2, f8& w3) {
#if defined(__GNUC__) && !defined(__clang__)
    if constexpr (in_registers) asm("" : "+x"(w0), "+x"(w1), "+x"(w2), "+x"(w3));
#else
    (void)w0, (void)w1, (void)w2, (void)w3;
#endif
  };
  const int d = a.d, rows = a.rows, group = a.group;
  const bool lanes = d % L == 0;
  float* s0 = a.s;
  float* s1 = s0 + B;
  std::fill(a.m, a.m + rows, -std::numeric_limits<float>::infinity());
  std::fill(a.l, a.l + rows, 0.f);
  std::fill(a.acc, a.acc + int64_t(rows) * d, 0.f);
  const int64_t kend = a.first + (rows - 1) / group + 1;  // keys the last row reads
  // the first key of the row whose token is at `pos` (0 without a window)
  const auto first_key = [&](int64_t pos) { return a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0; };
  for (int64_t j0 = first_key(a.first) / B * B; j0 < kend; j0 += B) {
    const int64_t nb = std::min<int64_t>(B, kend - j0);
    const float* kt = a.kt + j0 * d;  // channel c of key j0 + j at kt[c * B + j]
    for (int r0 = 0; r0 < rows; r0 += 2) {
      // rows r0 and r1 (r1 = r0 for a last lone row); r1's token is r0's or the next one
      const bool pair = r0 + 1 < rows;
      const int r1 = pair ? r0 + 1 : r0;
      const int valid0 = int(std::min<int64_t>(nb, a.first + r0 / group + 1 - j0));  // causal
      const int valid1 = int(std::min<int64_t>(nb, a.first + r1 / group + 1 - j0));
      if (valid1 <= 0) continue;
      // the rows' first keys in this block (their windows): a row sees [lo, valid)
      const int lo0 = int(std::clamp<int64_t>(first_key(a.first + r0 / group) - j0, 0, nb));
      const int lo1 = int(std::clamp<int64_t>(first_key(a.first + r1 / group) - j0, 0, nb));
      const bool live0 = valid0 > lo0, live1 = valid1 > lo1;
      if (!live0 && !live1) continue;
      const float* qa = a.q + int64_t(r0) * d;
      const float* qb = a.q + int64_t(r1) * d;
      // scores of both rows over 32 keys at a time (keys past a row's `valid` are finite: the
      // padding or this block's own later keys; the softmax leaves them out)
      for (int jv = 0; jv < valid1; jv += 4 * L) {
        f8 a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
        for (int c = 0; c < d; ++c) {
          const float* kc = kt + c * B + jv;
          f8 w0 = load8(kc), w1 = load8(kc + L), w2 = load8(kc + 2 * L), w3 = load8(kc + 3 * L);
          pin(w0, w1, w2, w3);
          fma_pair(a0, a1, a2, a3, b0, b1, b2, b3, qa[c], qb[c], w0, w1, w2, w3);
        }
        store4(s0 + jv, a0, a1, a2, a3);
        store4(s1 + jv, b0, b1, b2, b3);
      }
      float corr0 = 1.f, corr1 = 1.f;
      if (live0) {
        mask_and_cap(s0, lo0, valid0, a.softcap);
        corr0 = softmax_block(s0, valid0, valid1, a.m[r0], a.l[r0]);
        std::fill(s0, s0 + lo0, 0.f);  // (exp8_nonpositive clamps -inf to exp(-87), not 0)
      } else {
        std::fill(s0, s0 + valid1, 0.f);
      }
      if (!pair) {
        corr1 = corr0;
        std::copy(s0, s0 + valid1, s1);
      } else if (live1) {
        mask_and_cap(s1, lo1, valid1, a.softcap);
        corr1 = softmax_block(s1, valid1, valid1, a.m[r1], a.l[r1]);
        std::fill(s1, s1 + lo1, 0.f);
      } else {
        std::fill(s1, s1 + valid1, 0.f);
      }
      float* aa = a.acc + int64_t(r0) * d;
      float* ab = a.acc + int64_t(r1) * d;
      const float* vb = a.v + j0 * a.ldv;
      if (lanes) {
        // four channel blocks of 8 for both rows: eight independent vector sums across the keys
        // (a lone row writes the same values twice)
        int c0 = 0;
        for (; c0 + 4 * L <= d; c0 += 4 * L) {
          float* ea = aa + c0;
          float* fb = ab + c0;
          f8 e0 = load8(ea) * corr0, e1 = load8(ea + L) * corr0, e2 = load8(ea + 2 * L) * corr0,
             e3 = load8(ea + 3 * L) * corr0;
          f8 f0 = load8(fb) * corr1, f1 = load8(fb + L) * corr1, f2 = load8(fb + 2 * L) * corr1,
             f3 = load8(fb + 3 * L) * corr1;
          for (int j = 0; j < valid1; ++j) {
            const float* vr = vb + j * a.ldv + c0;
            f8 w0 = load8(vr), w1 = load8(vr + L), w2 = load8(vr + 2 * L), w3 = load8(vr + 3 * L);
            pin(w0, w1, w2, w3);
            fma_pair(e0, e1, e2, e3, f0, f1, f2, f3, s0[j], s1[j], w0, w1, w2, w3);
          }
          store4(ea, e0, e1, e2, e3);
          store4(fb, f0, f1, f2, f3);
        }
        for (; c0 < d; c0 += L) {
          f8 e = load8(aa + c0) * corr0, f = load8(ab + c0) * corr1;
          for (int j = 0; j < valid1; ++j) {
            const f8 w = load8(vb + j * a.ldv + c0);
            e += s0[j] * w;
            f += s1[j] * w;
          }
          store8(aa + c0, e);
          store8(ab + c0, f);
        }
      } else {
        for (int c = 0; c < d; ++c) aa[c] *= corr0;
        for (int j = 0; j < valid1; ++j)
          for (int c = 0; c < d; ++c) aa[c] += s0[j] * vb[j * a.ldv + c];
        if (pair) {
          for (int c = 0; c < d; ++c) ab[c] *= corr1;
          for (int j = 0; j < valid1; ++j)
            for (int c = 0; c < d; ++c) ab[c] += s1[j] * vb[j * a.ldv + c];
        }
      }
    }
  }
}

// NOTE: two explicit builds, not `target_clones`: the AVX2 one pins vectors in registers (an asm
// operand the baseline build cannot have), chosen once by CPU features.
void chunk_fold_baseline(const chunk_rows& a) { chunk_fold_body<false>(a); }
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(KVQ_NO_TARGET_CLONES)
__attribute__((target("avx2,fma"))) void chunk_fold_avx2(const chunk_rows& a) { chunk_fold_body<true>(a); }
#endif

void chunk_fold(const chunk_rows& a) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(KVQ_NO_TARGET_CLONES)
  static const auto fold = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? &chunk_fold_avx2
                                                                                           : &chunk_fold_baseline;
  fold(a);
#else
  chunk_fold_baseline(a);
#endif
}

// Online softmax of `rows` query rows of one kv head: running max m, sum l and unnormalized
// output acc, in fp32. Row r sees the positions first[r]..last[r].
struct softmax_rows {
  int rows = 0, d = 0;
  const float* q = nullptr;  // [rows][d], scaled by the softmax scale
  const int64_t* first = nullptr;
  const int64_t* last = nullptr;
  float* m = nullptr;    // [rows]
  float* l = nullptr;    // [rows]
  float* acc = nullptr;  // [rows][d]
  float softcap = 0.f;   // > 0: scores soft-capped

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
    // the scores of each row, eight keys at a time, then its softmax weights (0 past what it sees)
    for (int r = 0; r < rows; ++r) {
      float* pr = p + int64_t(r) * stride;
      const int vis = visible(r, pos0, tokens), lo = int(std::clamp<int64_t>(first[r] - pos0, 0, tokens));
      corr[r] = 1.f;
      if (vis <= lo) {
        std::fill(pr, pr + stride, 0.f);
        continue;
      }
      const float* qr = q + int64_t(r) * d;
      for (int t = lo & ~7; t < vis; t += 8) store8(pr + t, dot8(qr, k + int64_t(t) * d, d));
      mask_and_cap(pr, lo, vis, softcap);
      corr[r] = softmax_block(pr, vis, stride, m[r], l[r]);
      std::fill(pr, pr + lo, 0.f);
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
  std::vector<float> k, v, p, corr, q, m, l, acc, o, lse, o2, lse2, s;
  std::vector<int64_t> first, last;
  void size_for(int rows, int d, int tile_tokens) {
    s.resize(2 * key_tile);
    const size_t rd = size_t(rows) * d;
    for (auto* x : {&q, &acc, &o, &o2}) x->resize(rd);
    for (auto* x : {&m, &l, &corr, &lse, &lse2}) x->resize(size_t(rows));
    first.resize(size_t(rows));
    last.resize(size_t(rows));
    k.resize(size_t(tile_tokens) * d);
    v.resize(k.size());
    p.resize(size_t(rows) * ((tile_tokens + 7) & ~7));
  }
  softmax_rows state(int rows, int d, float softcap = 0.f) {
    return {rows, d, q.data(), first.data(), last.data(), m.data(), l.data(), acc.data(), softcap};
  }
};
scratch& local_scratch() {
  thread_local scratch s;
  return s;
}

// The stored tokens [pos, end) of one kv head, a block at a time: whole pages decoded for tokens
// before `from_pages`, then the FP16 ring in blocks of `key_tile` tokens. `pos` starts at 0, or
// at the first token a sliding window reaches (`start`).
struct stored_blocks {
  const stored_layer& kv;
  int h;
  int64_t from_pages, end, pos = 0;

  // Starts at the page (or, in the ring, the token) that holds token `first`.
  stored_blocks& start(int64_t first) {
    const int64_t P = kv.shape->page_tokens;
    pos = first < from_pages ? first / P * P : std::min(first, end);
    return *this;
  }

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

// Row r's output (acc / l) into o_row and its log-sum-exp, with its head's sink logit (query
// head h * group + r % group) merged in when the layer has them.
KVQ_CPU_INLINE float finish_row(const softmax_rows& st, int r, float* o_row, const attention_variant& var, int h,
                                int group) {
  float lse = st.finish(r, o_row);
  if (!var.sink_logits.empty()) merge_sink_row(o_row, lse, var.sink(h * group + r % group), st.d);
  return lse;
}

// One (item, kv head) of an attend: causal over the item's n stored tokens (the layer's window of
// them in a sliding layer: its earlier pages are not read).
KVQ_CPU_CLONES void attend_task(const attend_task_item& it, int h, const tensor_view& q, const tensor_mut& o,
                                float scale, const attention_variant& var) {
  const cache_shape& sh = *it.kv.shape;
  const int d = sh.head_dim, group = sh.q_heads / sh.kv_heads, rows = it.q_len * group;
  const int64_t n = it.kv.ls->n;
  scratch& sc = local_scratch();
  sc.size_for(rows, d, tile_tokens(sh));
  load_queries(q, it.row, 0, it.q_len, h, group, d, scale, sc.q.data());
  for (int r = 0; r < rows; ++r) {
    sc.last[size_t(r)] = n - it.q_len + r / group;
    sc.first[size_t(r)] = var.first_key(sc.last[size_t(r)]);
  }
  softmax_rows st = sc.state(rows, d, var.softcap);
  st.reset();
  stored_blocks blocks{it.kv, h, std::min(it.kv.ls->e, n - it.q_len), n};
  blocks.start(sc.first[0]);
  int tokens = 0;
  int64_t pos0 = 0;
  while (blocks.next(sc.k.data(), sc.v.data(), tokens, pos0)) st.absorb(sc.k.data(), sc.v.data(), tokens, pos0, sc.p.data(), sc.corr.data());
  for (int r = 0; r < rows; ++r) finish_row(st, r, sc.o.data() + int64_t(r) * d, var, h, group);
  store_rows(o, it.row, 0, it.q_len, h, group, d, sc.o.data());
}

// The stored-prefix part of queries [i0, i0 + count) of kv head h: every row sees [0, prefix)
// (query i, at position prefix + i, from its window's first key on in a sliding layer). Leaves
// the outputs in sc.o and the log-sum-exps in sc.lse, the rows' sink logits merged in when
// `with_sinks`.
KVQ_CPU_CLONES void prefix_part(const stored_layer& kv, int64_t prefix, int h, const tensor_view& q, int i0, int count,
                                float scale, const attention_variant& var, bool with_sinks) {
  const cache_shape& sh = *kv.shape;
  const int d = sh.head_dim, group = sh.q_heads / sh.kv_heads, rows = count * group;
  scratch& sc = local_scratch();
  sc.size_for(rows, d, tile_tokens(sh));
  load_queries(q, 0, i0, count, h, group, d, scale, sc.q.data());
  for (int r = 0; r < rows; ++r) {
    sc.last[size_t(r)] = prefix - 1;
    sc.first[size_t(r)] = var.first_key(prefix + i0 + r / group);
  }
  softmax_rows st = sc.state(rows, d, var.softcap);
  st.reset();
  stored_blocks blocks{kv, h, std::min(kv.ls->e, prefix), prefix};
  blocks.start(sc.first[0]);
  int tokens = 0;
  int64_t pos0 = 0;
  while (blocks.next(sc.k.data(), sc.v.data(), tokens, pos0)) st.absorb(sc.k.data(), sc.v.data(), tokens, pos0, sc.p.data(), sc.corr.data());
  for (int r = 0; r < rows; ++r)
    sc.lse[size_t(r)] = with_sinks ? finish_row(st, r, sc.o.data() + int64_t(r) * d, var, h, group)
                                   : st.finish(r, sc.o.data() + int64_t(r) * d);
}

// The chunk part of queries [i0, i0 + count) of kv head h: query i sees chunk tokens 0..i of
// kt (packed, `chunk_rows::kt`, ldt keys a head) and cv ([kv_heads][T][d]), fp16-rounded.
// Leaves the outputs in sc.o2 and the lse in sc.lse2. Expects sc.q to hold the tile's scaled
// queries (prefix_part loads them).
void chunk_part(const cache_shape& sh, const float* kt, int64_t ldt, const float* cv, int64_t T, int h, int i0,
                int count, const attention_variant& var) {
  const int d = sh.head_dim, group = sh.q_heads / sh.kv_heads, rows = count * group;
  scratch& sc = local_scratch();
  chunk_fold({kt + int64_t(h) * d * ldt, cv + int64_t(h) * T * d, d, d, group, rows, i0, sc.q.data(), sc.acc.data(),
              sc.m.data(), sc.l.data(), sc.s.data(), var.window, var.softcap});
  const softmax_rows st = sc.state(rows, d);
  for (int r = 0; r < rows; ++r) sc.lse2[size_t(r)] = st.finish(r, sc.o2.data() + int64_t(r) * d);
}

int query_tiles(int64_t T) { return int((T + query_tile - 1) / query_tile); }

}  // namespace

void attend(worker_pool& pool, std::span<const attend_task_item> items, const tensor_view& q, const tensor_mut& o,
            float scale, const attention_variant& var) {
  if (items.empty()) return;
  const int H = items[0].kv.shape->kv_heads;
  pool.run(int(items.size()) * H, [&](int t) { attend_task(items[size_t(t / H)], t % H, q, o, scale, var); });
}

void attend_prefix(worker_pool& pool, const stored_layer& kv, int64_t prefix, const tensor_view& q,
                   const tensor_mut& o, float* lse, float scale, const attention_variant& var) {
  const cache_shape& sh = *kv.shape;
  const int H = sh.kv_heads, d = sh.head_dim, group = sh.q_heads / H, tiles = query_tiles(q.tokens);
  pool.run(tiles * H, [&](int t) {
    const int h = t % H, i0 = (t / H) * query_tile, count = int(std::min<int64_t>(query_tile, q.tokens - i0));
    prefix_part(kv, prefix, h, q, i0, count, scale, var, true);
    const scratch& sc = local_scratch();
    store_rows(o, 0, i0, count, h, group, d, sc.o.data());
    for (int i = 0; i < count; ++i)
      for (int g = 0; g < group; ++g) lse[int64_t(i0 + i) * sh.q_heads + h * group + g] = sc.lse[size_t(i * group + g)];
  });
}

void prefill(worker_pool& pool, const stored_layer& kv, int64_t prefix, const tensor_view& k, const tensor_view& v,
             const tensor_view& q, const tensor_mut& o, float scale, const attention_variant& var) {
  const cache_shape& sh = *kv.shape;
  const int H = sh.kv_heads, d = sh.head_dim, group = sh.q_heads / H, tiles = query_tiles(q.tokens);
  const int64_t T = k.tokens;
  // The chunk's K and V as the ring would hold them (fp16), per kv head: K packed for
  // `chunk_fold` ([kv_heads][ldt / key_tile][d][key_tile], zero past the last key), V [kv_heads][T][d].
  const int64_t ldt = (T + key_tile - 1) / key_tile * key_tile;
  std::vector<float> kt(size_t(H) * d * size_t(ldt), 0.f), cv(size_t(H) * T * d);
  for (int64_t i = 0; i < T; ++i)
    for (int h = 0; h < H; ++h) {
      float* panel = kt.data() + (int64_t(h) * ldt + i / key_tile * key_tile) * d + i % key_tile;
      for (int c = 0; c < d; ++c) {
        panel[c * key_tile] = half_to_float(float_to_half(load(k.data, k.type, i * k.stride() + h * d + c)));
        cv[(size_t(h) * T + i) * d + c] = half_to_float(float_to_half(load(v.data, v.type, i * v.stride() + h * d + c)));
      }
    }
  pool.run(tiles * H, [&](int t) {
    const int h = t % H, i0 = (t / H) * query_tile, count = int(std::min<int64_t>(query_tile, T - i0));
    prefix_part(kv, prefix, h, q, i0, count, scale, var, false);
    chunk_part(sh, kt.data(), ldt, cv.data(), T, h, i0, count, var);
    scratch& sc = local_scratch();
    merge_attention(sc.o.data(), sc.lse.data(), sc.o2.data(), sc.lse2.data(), int64_t(count) * group, d);
    if (!var.sink_logits.empty())
      for (int r = 0; r < count * group; ++r)
        merge_sink_row(sc.o.data() + int64_t(r) * d, sc.lse[size_t(r)], var.sink(h * group + r % group), d);
    store_rows(o, 0, i0, count, h, group, d, sc.o.data());
  });
}

void causal_attention(const task_runner& run, const float* q, const float* k, const float* v, float* o, int64_t T,
                      int64_t pos0, int q_heads, int kv_heads, int head_dim, float scale,
                      const attention_variant& var) {
  const int group = q_heads / kv_heads, d = head_dim, tiles = int((T + chunk_tile - 1) / chunk_tile);
  const int64_t n = pos0 + T, ldt = (n + key_tile - 1) / key_tile * key_tile, ld = int64_t(kv_heads) * d;
  // K packed once per call for every tile (`chunk_rows::kt`)
  thread_local std::vector<float> kt;  // the caller's; the tasks see it through kt_all only
  kt.assign(size_t(kv_heads) * size_t(d) * size_t(ldt), 0.f);
  float* const kt_all = kt.data();
  run(kv_heads, [&](int h) { pack_keys(k + int64_t(h) * d, ld, n, d, kt_all + int64_t(h) * d * ldt); });
  run(tiles * kv_heads, [&](int task) {
    const int h = task % kv_heads;
    const int64_t t0 = int64_t(task / kv_heads) * chunk_tile, t1 = std::min<int64_t>(T, t0 + chunk_tile);
    const int rows = int(t1 - t0) * group;
    scratch& sc = local_scratch();
    sc.size_for(rows, d, key_tile);
    for (int r = 0; r < rows; ++r) {
      const float* src = q + ((t0 + r / group) * q_heads + int64_t(h) * group + r % group) * d;
      for (int c = 0; c < d; ++c) sc.q[size_t(r) * d + c] = src[c] * scale;
    }
    chunk_fold({kt_all + int64_t(h) * d * ldt, v + int64_t(h) * d, ld, d, group, rows, pos0 + t0, sc.q.data(),
                sc.acc.data(), sc.m.data(), sc.l.data(), sc.s.data(), var.window, var.softcap});
    for (int r = 0; r < rows; ++r) {
      float* dst = o + ((t0 + r / group) * q_heads + int64_t(h) * group + r % group) * d;
      const float inv = 1.f / sc.l[size_t(r)];
      for (int c = 0; c < d; ++c) dst[c] = sc.acc[size_t(r) * d + c] * inv;
      if (!var.sink_logits.empty()) {
        float lse = sc.m[size_t(r)] + std::log(sc.l[size_t(r)]);
        merge_sink_row(dst, lse, var.sink(h * group + r % group), d);
      }
    }
  });
}

}  // namespace cpu
KVQ_NAMESPACE_END
