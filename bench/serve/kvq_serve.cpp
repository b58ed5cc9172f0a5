// The serving benchmark's C ABI over kvq::KVCache (bench/serve/kvq_serve.h).
#include "kvq_serve.h"

#include <cstdio>
#include <cstring>
#include <exception>
#include <kvq/cache/cache.hpp>
#include <kvq/policy/echokv.hpp>
#include <kvq/policy/static_policy.hpp>
#include <memory>
#include <string>
#include <utility>
#include <vector>

struct kvq_serve {
  kvq::KVCache cache;
  std::shared_ptr<kvq::echokv_policy> echo;  // null for a static policy
  std::string error;
  std::vector<kvq::append_item> append_items;  // reused by every step
  std::vector<kvq::attend_item> attend_items;
};

namespace {

// Records the outcome of a call on `s` and returns its code.
int finish(kvq_serve* s, const kvq::status& st) {
  s->error = st.ok() ? std::string() : st.to_string();
  return int(st.code());
}

int fail(kvq_serve* s, std::string what) { return finish(s, {kvq::errc::invalid_argument, std::move(what)}); }

// Checks the arguments every tensor call shares; an empty string when they are fine.
std::string check_tensor_args(const kvq_serve& s, int layer, int dtype, int64_t k_stride, int64_t v_stride) {
  const auto& shape = s.cache.config().shape;
  if (layer < 0 || layer >= shape.layers)
    return "layer " + std::to_string(layer) + " outside [0, " + std::to_string(shape.layers) + ")";
  if (dtype < KVQ_SERVE_F32 || dtype > KVQ_SERVE_BF16)
    return "dtype " + std::to_string(dtype) + " is not f32 (0), f16 (1) or bf16 (2)";
  for (const auto& [name, stride] : {std::pair{"k_stride", k_stride}, std::pair{"v_stride", v_stride}})
    if (stride != 0 && stride < int64_t(shape.kv_heads) * shape.head_dim)
      return std::string(name) + " " + std::to_string(stride) + " below kv_heads x head_dim";
  return {};
}

// Checks `n` distinct sequence ids; an empty string when they are fine.
std::string check_seqs(const kvq_serve& s, const int64_t* seqs, int n) {
  if (!seqs) return "seqs is null";
  if (n < 1 || n > s.cache.config().max_sequences)
    return "n = " + std::to_string(n) +
           " outside [1, max_sequences = " + std::to_string(s.cache.config().max_sequences) + "]";
  return {};
}

kvq::tensor_view view(const void* p, int dtype, int64_t rows, int heads, int head_dim, int64_t stride) {
  return {p, kvq::dtype(dtype), rows, heads, head_dim, stride};
}

void write_error(char* err, int err_len, const std::string& what) {
  if (err && err_len > 0) std::snprintf(err, size_t(err_len), "%s", what.c_str());
}

}  // namespace

extern "C" {

KVQ_EXPORT kvq_serve* kvq_serve_create(const char* policy, int cuda, int layers, int q_heads, int kv_heads,
                                       int head_dim, uint64_t budget_bytes, int max_sequences, int64_t max_tokens,
                                       void* stream, char* err, int err_len) {
  if (!policy) {
    write_error(err, err_len, "invalid_argument: policy is null");
    return nullptr;
  }
  if (cuda != 0 && cuda != 1) {
    write_error(err, err_len, "invalid_argument: cuda must be 0 or 1, not " + std::to_string(cuda));
    return nullptr;
  }
  try {
    kvq::cache_config cfg;
    cfg.shape = {layers, q_heads, kv_heads, head_dim, 64, 128, 64};
    cfg.budget_bytes = budget_bytes;
    cfg.where = cuda ? kvq::backend::cuda : kvq::backend::cpu;
    cfg.stream = stream;
    cfg.check_values = false;  // no check launch per append, as an engine with finite inputs runs it
    cfg.max_sequences = max_sequences;
    cfg.max_tokens = max_tokens;
    std::shared_ptr<kvq::policy> pol;
    std::shared_ptr<kvq::echokv_policy> echo;
    if (std::strcmp(policy, "echokv") == 0) {
      kvq::echokv_options o;
      o.initial_tier = 1;  // kivi4/g32, the middle of kivi2/4/8
      echo = std::make_shared<kvq::echokv_policy>(o);
      pol = echo;
    } else {
      auto p = kvq::static_policy::parse(policy);
      if (!p) {
        write_error(err, err_len, p.error().to_string());
        return nullptr;
      }
      pol = std::make_shared<kvq::static_policy>(std::move(p).value());
    }
    auto c = kvq::KVCache::create(cfg, pol);
    if (!c) {
      write_error(err, err_len, c.error().to_string());
      return nullptr;
    }
    return new kvq_serve{std::move(c).value(), std::move(echo), {}, {}, {}};
  } catch (const std::exception& e) {
    write_error(err, err_len, std::string("exception: ") + e.what());
    return nullptr;
  }
}

KVQ_EXPORT void kvq_serve_destroy(kvq_serve* s) { delete s; }

KVQ_EXPORT const char* kvq_serve_error(const kvq_serve* s) { return s ? s->error.c_str() : "handle is null"; }

KVQ_EXPORT int kvq_serve_create_sequence(kvq_serve* s, int64_t seq) {
  if (!s) return int(kvq::errc::invalid_argument);
  return finish(s, s->cache.create_sequence(seq));
}

KVQ_EXPORT int kvq_serve_release_sequence(kvq_serve* s, int64_t seq) {
  if (!s) return int(kvq::errc::invalid_argument);
  return finish(s, s->cache.release_sequence(seq));
}

KVQ_EXPORT int kvq_serve_bytes_for(kvq_serve* s, int64_t tokens, int64_t seq, uint64_t* out) {
  if (!s) return int(kvq::errc::invalid_argument);
  if (!out) return fail(s, "out is null");
  auto r = seq < 0 ? s->cache.bytes_for(tokens) : s->cache.bytes_for(tokens, seq);
  if (!r) return finish(s, r.error());
  *out = r.value();
  return finish(s, kvq::status{});
}

KVQ_EXPORT int kvq_serve_stats_get(kvq_serve* s, kvq_serve_stats* out) {
  if (!s) return int(kvq::errc::invalid_argument);
  if (!out) return fail(s, "out is null");
  const kvq::cache_stats st = s->cache.stats();
  *out = {st.budget_bytes, st.used_bytes,   st.free_bytes,       st.largest_free_block,
          st.page_bytes,   st.window_bytes, st.encoded_elements, st.overhead.device_bytes(),
          st.sequences,    st.tokens};
  return finish(s, kvq::status{});
}

KVQ_EXPORT int kvq_serve_append(kvq_serve* s, int64_t seq, int layer, const void* k, const void* v, int64_t tokens,
                                int64_t k_stride, int64_t v_stride, int dtype) {
  if (!s) return int(kvq::errc::invalid_argument);
  if (auto e = check_tensor_args(*s, layer, dtype, k_stride, v_stride); !e.empty()) return fail(s, e);
  if (!k || !v) return fail(s, "k or v is null");
  if (tokens < 1) return fail(s, "tokens = " + std::to_string(tokens) + " below 1");
  const auto& sh = s->cache.config().shape;
  return finish(s, s->cache.append(seq, layer, view(k, dtype, tokens, sh.kv_heads, sh.head_dim, k_stride),
                                   view(v, dtype, tokens, sh.kv_heads, sh.head_dim, v_stride)));
}

KVQ_EXPORT int kvq_serve_append_batch(kvq_serve* s, int layer, const int64_t* seqs, int n, const void* k, const void* v,
                                      int64_t k_stride, int64_t v_stride, int dtype) {
  if (!s) return int(kvq::errc::invalid_argument);
  if (auto e = check_tensor_args(*s, layer, dtype, k_stride, v_stride); !e.empty()) return fail(s, e);
  if (auto e = check_seqs(*s, seqs, n); !e.empty()) return fail(s, e);
  if (!k || !v) return fail(s, "k or v is null");
  s->append_items.resize(size_t(n));
  for (int i = 0; i < n; ++i) s->append_items[size_t(i)] = {seqs[i], 1};
  const auto& sh = s->cache.config().shape;
  return finish(s, s->cache.append_batch(s->append_items, layer, view(k, dtype, n, sh.kv_heads, sh.head_dim, k_stride),
                                         view(v, dtype, n, sh.kv_heads, sh.head_dim, v_stride)));
}

KVQ_EXPORT int kvq_serve_attend(kvq_serve* s, int layer, const int64_t* seqs, int n, const void* q, int64_t q_stride,
                                void* o, int dtype) {
  if (!s) return int(kvq::errc::invalid_argument);
  if (auto e = check_tensor_args(*s, layer, dtype, 0, 0); !e.empty()) return fail(s, e);
  if (auto e = check_seqs(*s, seqs, n); !e.empty()) return fail(s, e);
  if (!q || !o) return fail(s, "q or o is null");
  const auto& sh = s->cache.config().shape;
  if (q_stride != 0 && q_stride < int64_t(sh.q_heads) * sh.head_dim)
    return fail(s, "q_stride " + std::to_string(q_stride) + " below q_heads x head_dim");
  s->attend_items.resize(size_t(n));
  for (int i = 0; i < n; ++i) s->attend_items[size_t(i)] = {seqs[i], 1};
  return finish(s, s->cache.attend(s->attend_items, layer, view(q, dtype, n, sh.q_heads, sh.head_dim, q_stride),
                                   {o, kvq::dtype(dtype), n, sh.q_heads, sh.head_dim, 0}));
}

KVQ_EXPORT int kvq_serve_set_canary(kvq_serve* s, int on) {
  if (!s) return int(kvq::errc::invalid_argument);
  if (!s->echo) return finish(s, {kvq::errc::unsupported, "the canary switch needs the echokv policy"});
  if (on != 0 && on != 1) return fail(s, "on must be 0 or 1, not " + std::to_string(on));
  if (auto st = s->cache.sync_policy(); !st.ok()) return finish(s, st);
  if (on)
    s->echo->unfreeze();
  else
    s->echo->freeze();
  return finish(s, kvq::status{});
}

KVQ_EXPORT int kvq_serve_sync_policy(kvq_serve* s) {
  if (!s) return int(kvq::errc::invalid_argument);
  return finish(s, s->cache.sync_policy());
}

}  // extern "C"
