#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <kvq/attention/cpu_attention.hpp>
#include <kvq/attention/reference.hpp>
#include <kvq/policy/static_policy.hpp>
#include <numeric>
#include <llama/model.hpp>

namespace kvq::llama {

namespace {

/// y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, row by row.
void rms_norm(const float* x, int64_t T, int64_t n, const std::vector<float>& w, float eps, float* y) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * n;
    float* yr = y + t * n;
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(xr[i]) * xr[i];
    const float inv = float(1.0 / std::sqrt(ss / double(n) + double(eps)));
    for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] * inv * w[size_t(i)];
  }
}

/// Rounds a float to the nearest fp16 value (ties to even) and back; fp16 overflow gives ±inf.
float round_f16(float f) { return half_to_float(float_to_half(f)); }

constexpr int64_t max_dim = 1 << 20;  // sanity bound on every hyper-parameter read from a file

/// Gemma 3's hyper-parameters beyond Gemma 1's, as llama.cpp reads them (llama-model.cpp,
/// LLM_ARCH_GEMMA3): `attention.sliding_window` tokens on the sliding layers, which are the layers
/// l with l % 6 < 5 (set_swa_pattern(6): five sliding, then one global), their RoPE base fixed at
/// 10000 (rope_freq_base_train_swa), and the scores scaled by 1/sqrt(head_dim), or by
/// 1/sqrt(n_embd / n_head) for the 62-layer 27B. Without `sliding_window` every layer is global.
/// `final_logit_softcapping` is refused (llama.cpp applies it only to files without sliding layers).
status load_gemma3_hparams(const gguf_file& f, const std::string& a, llama_hparams& hp) {
  const std::string& path = f.path();
  constexpr int pattern = 6;
  if (f.find(a + "final_logit_softcapping"))
    return {errc::unsupported, fmt::format("{}: {}final_logit_softcapping is not supported", path, a)};
  if (f.find(a + "attention.sliding_window")) {
    auto w = f.get_int(a + "attention.sliding_window");
    if (!w) return w.error();
    if (*w < 0 || *w > max_dim)
      return {errc::io_error,
              fmt::format("{}: {}attention.sliding_window = {} is out of range (0..{})", path, a, *w, max_dim)};
    hp.sliding_window = int(*w);
  }
  if (hp.sliding_window > 0) {
    hp.sliding.resize(size_t(hp.n_layer));
    for (int l = 0; l < hp.n_layer; ++l) hp.sliding[size_t(l)] = l % pattern < pattern - 1;
  }
  hp.rope_base_local = 10000.f;
  const int scale_dim = hp.n_layer == 62 ? hp.n_embd / hp.n_head : hp.head_dim;
  hp.attn_scale = 1.f / std::sqrt(float(scale_dim));
  return {};
}

}  // namespace

// ---- loading ------------------------------------------------------------------------------------

result<llama_model> llama_model::load(const std::string& path) {
  auto f = gguf_file::open(path);
  if (!f) return f.error();
  return load(*f);
}

result<llama_model> llama_model::load(const gguf_file& f) {
  llama_model m;
  const std::string& path = f.path();
  auto arch = f.get_string("general.architecture");
  if (!arch) return arch.error();
  if (*arch != "llama" && *arch != "qwen2" && *arch != "gemma" && *arch != "gemma3")
    return status{errc::unsupported, fmt::format("{}: architecture '{}' is not supported (expected 'llama', 'qwen2', "
                                                 "'gemma' or 'gemma3')",
                                                 path, *arch)};
  // Hyper-parameters are keyed by the architecture ("llama.block_count", "qwen2.block_count").
  const std::string a = *arch + ".";
  m.name_ = f.get_string("general.name").ok() ? f.get_string("general.name").value() : path;

  auto int_key = [&](const std::string& key, int64_t fallback, bool required, int& out) -> status {
    auto v = required ? f.get_int(key) : f.get_int_or(key, fallback);
    if (!v) return v.error();
    if (*v <= 0 || *v > max_dim)
      return {errc::io_error, fmt::format("{}: {} = {} is out of range (1..{})", path, key, *v, max_dim)};
    out = int(*v);
    return {};
  };
  llama_hparams& hp = m.hp_;
  hp.rope_neox = *arch == "qwen2" || *arch == "gemma" || *arch == "gemma3";  // (llama.cpp's rope type of each)
  // Gemma: embeddings scaled by sqrt(n_embd), GELU (tanh form) gating; its files store the norm
  // weights with the + 1 already added (every norm of Gemma 3 too, q/k and post norms included:
  // convert_hf_to_gguf.py adds 1 to each tensor named *norm.weight)
  hp.gemma3 = *arch == "gemma3";
  hp.gemma = *arch == "gemma" || hp.gemma3;
  KVQ_TRY(int_key(a + "embedding_length", 0, true, hp.n_embd));
  KVQ_TRY(int_key(a + "block_count", 0, true, hp.n_layer));
  KVQ_TRY(int_key(a + "feed_forward_length", 0, true, hp.n_ff));
  KVQ_TRY(int_key(a + "attention.head_count", 0, true, hp.n_head));
  KVQ_TRY(int_key(a + "attention.head_count_kv", hp.n_head, false, hp.n_head_kv));
  KVQ_TRY(int_key(a + "context_length", 2048, false, hp.n_ctx_train));
  if (hp.n_embd % hp.n_head != 0 && !f.find(a + "attention.key_length"))
    return status{errc::io_error, fmt::format("{}: embedding_length {} is not a multiple of head_count {}", path,
                                              hp.n_embd, hp.n_head)};
  KVQ_TRY(int_key(a + "attention.key_length", hp.n_embd / std::max(hp.n_head, 1), false, hp.head_dim));
  int value_length = 0;
  KVQ_TRY(int_key(a + "attention.value_length", hp.head_dim, false, value_length));
  if (value_length != hp.head_dim)
    return status{errc::unsupported,
                  fmt::format("{}: key_length {} differs from value_length {}", path, hp.head_dim, value_length)};
  KVQ_TRY(int_key(a + "rope.dimension_count", hp.head_dim, false, hp.n_rot));
  if (hp.n_head % hp.n_head_kv != 0)
    return status{errc::io_error, fmt::format("{}: head_count {} is not a multiple of head_count_kv {}", path,
                                              hp.n_head, hp.n_head_kv)};
  if (hp.n_rot > hp.head_dim || hp.n_rot % 2 != 0)
    return status{errc::io_error, fmt::format("{}: rope.dimension_count {} must be even and at most head_dim {}", path,
                                              hp.n_rot, hp.head_dim)};
  auto eps = f.get_float_or(a + "attention.layer_norm_rms_epsilon", 1e-5);
  if (!eps) return eps.error();
  auto base = f.get_float_or(a + "rope.freq_base", 10000.0);
  if (!base) return base.error();
  if (!(*eps >= 0 && *eps < 1))
    return status{errc::io_error, fmt::format("{}: layer_norm_rms_epsilon {} is out of range", path, *eps)};
  if (!(*base > 1 && std::isfinite(*base)))
    return status{errc::io_error, fmt::format("{}: rope.freq_base {} is out of range", path, *base)};
  hp.rms_eps = float(*eps);
  hp.rope_base = float(*base);
  hp.attn_scale = 1.f / std::sqrt(float(hp.head_dim));
  if (hp.gemma3) KVQ_TRY(load_gemma3_hparams(f, a, hp));
  if (f.find(a + "rope.scaling.type")) {
    auto v = f.get_string(a + "rope.scaling.type");
    if (!v) return v.error();
    if (*v != "none")
      return status{errc::unsupported, fmt::format("{}: {}rope.scaling.type '{}' is not supported", path, a, *v)};
  }
  if (auto v = f.get_float_or(a + "rope.scaling.factor", 1.0); !v) {
    return v.error();
  } else if (*v != 1.0 && *v != 0.0) {
    return status{errc::unsupported, fmt::format("{}: {}rope.scaling.factor {} is not supported", path, a, *v)};
  }

  // Tensors: check the shape of each before loading it.
  auto find_shaped = [&](const std::string& name, std::initializer_list<int64_t> shape,
                         const gguf_tensor_info*& found) -> status {
    const gguf_tensor_info* t = f.find_tensor(name);
    if (!t) return {errc::not_found, fmt::format("{}: tensor '{}' is missing", path, name)};
    bool same = t->n_dims == int(shape.size());
    size_t i = 0;
    for (int64_t d : shape) same = same && t->ne[i++] == d;
    if (!same) {
      std::string want = "[";
      i = 0;
      for (int64_t d : shape) want += fmt::format("{}{}", i++ ? ", " : "", d);
      return {errc::io_error,
              fmt::format("{}: tensor '{}' has shape {}, expected {}", path, name, t->shape_string(), want + "]")};
    }
    found = t;
    return {};
  };
  auto load_tensor = [&](const std::string& name, std::initializer_list<int64_t> shape,
                         std::vector<float>& out) -> status {
    const gguf_tensor_info* t = nullptr;
    KVQ_TRY(find_shaped(name, shape, t));
    out.assign(size_t(t->elements), 0.f);
    return f.dequantize_into(*t, out);
  };
  auto load_matrix = [&](const std::string& name, std::initializer_list<int64_t> shape, weight_matrix& out) -> status {
    const gguf_tensor_info* t = nullptr;
    KVQ_TRY(find_shaped(name, shape, t));
    auto w = weight_matrix::from_gguf(f, *t);
    if (!w) return w.error();
    out = std::move(w).value();
    return {};
  };

  const gguf_tensor_info* emb = f.find_tensor("token_embd.weight");
  if (!emb) return status{errc::not_found, fmt::format("{}: tensor 'token_embd.weight' is missing", path)};
  if (emb->n_dims != 2 || emb->ne[1] > max_dim)
    return status{errc::io_error, fmt::format("{}: tensor 'token_embd.weight' has shape {}, expected [{}, n_vocab]",
                                              path, emb->shape_string(), hp.n_embd)};
  hp.n_vocab = int(emb->ne[1]);
  if (auto v = f.get_int_or(a + "vocab_size", hp.n_vocab); !v.ok() || *v != hp.n_vocab)
    return status{errc::io_error,
                  fmt::format("{}: {}vocab_size disagrees with token_embd.weight's {} rows", path, a, hp.n_vocab)};
  const int64_t E = hp.n_embd, Dq = int64_t(hp.n_head) * hp.head_dim, Dkv = int64_t(hp.n_head_kv) * hp.head_dim;
  KVQ_TRY(load_matrix("token_embd.weight", {E, hp.n_vocab}, m.tok_embd_));
  KVQ_TRY(load_tensor("output_norm.weight", {E}, m.out_norm_));
  if (f.find_tensor("output.weight")) {
    KVQ_TRY(load_matrix("output.weight", {E, hp.n_vocab}, m.output_));
  } else {
    m.tied_output_ = true;
  }
  // Grown layer by layer: a corrupt block_count fails at its first missing tensor, not after a
  // huge allocation.
  for (int l = 0; l < hp.n_layer; ++l) {
    llama_layer& L = m.layers_.emplace_back();
    const std::string p = fmt::format("blk.{}.", l);
    KVQ_TRY(load_tensor(p + "attn_norm.weight", {E}, L.attn_norm));
    KVQ_TRY(load_matrix(p + "attn_q.weight", {E, Dq}, L.wq));
    KVQ_TRY(load_matrix(p + "attn_k.weight", {E, Dkv}, L.wk));
    KVQ_TRY(load_matrix(p + "attn_v.weight", {E, Dkv}, L.wv));
    // projection biases where the file has them (Qwen2 has all three)
    if (f.find_tensor(p + "attn_q.bias")) KVQ_TRY(load_tensor(p + "attn_q.bias", {Dq}, L.bq));
    if (f.find_tensor(p + "attn_k.bias")) KVQ_TRY(load_tensor(p + "attn_k.bias", {Dkv}, L.bk));
    if (f.find_tensor(p + "attn_v.bias")) KVQ_TRY(load_tensor(p + "attn_v.bias", {Dkv}, L.bv));
    KVQ_TRY(load_matrix(p + "attn_output.weight", {Dq, E}, L.wo));
    KVQ_TRY(load_tensor(p + "ffn_norm.weight", {E}, L.ffn_norm));
    KVQ_TRY(load_matrix(p + "ffn_gate.weight", {E, hp.n_ff}, L.w_gate));
    KVQ_TRY(load_matrix(p + "ffn_up.weight", {E, hp.n_ff}, L.w_up));
    KVQ_TRY(load_matrix(p + "ffn_down.weight", {hp.n_ff, E}, L.w_down));
    if (hp.gemma3) {
      KVQ_TRY(load_tensor(p + "attn_q_norm.weight", {hp.head_dim}, L.q_norm));
      KVQ_TRY(load_tensor(p + "attn_k_norm.weight", {hp.head_dim}, L.k_norm));
      KVQ_TRY(load_tensor(p + "post_attention_norm.weight", {E}, L.post_attn_norm));
      KVQ_TRY(load_tensor(p + "post_ffw_norm.weight", {E}, L.post_ffn_norm));
    }
  }

  m.inv_freq_.resize(size_t(hp.n_rot / 2));
  for (int i = 0; i < hp.n_rot / 2; ++i) m.inv_freq_[size_t(i)] = std::pow(double(hp.rope_base), -2.0 * i / hp.n_rot);
  if (!hp.sliding.empty()) {
    m.inv_freq_local_.resize(size_t(hp.n_rot / 2));
    for (int i = 0; i < hp.n_rot / 2; ++i)
      m.inv_freq_local_[size_t(i)] = std::pow(double(hp.rope_base_local), -2.0 * i / hp.n_rot);
    m.variants_.resize(size_t(hp.n_layer));
    for (int l = 0; l < hp.n_layer; ++l)
      if (hp.sliding[size_t(l)]) m.variants_[size_t(l)].window = hp.sliding_window;
  }
  // Llama 3.1+ files carry their RoPE scaling as per-frequency divisors (`rope_freqs.weight`,
  // llama.cpp's freq_factors): pair i turns by pos * base^(-2i/n_rot) / factor[i].
  if (f.find_tensor("rope_freqs.weight")) {
    std::vector<float> factors;
    KVQ_TRY(load_tensor("rope_freqs.weight", {hp.n_rot / 2}, factors));
    for (size_t i = 0; i < factors.size(); ++i) {
      if (!(std::isfinite(factors[i]) && factors[i] > 0.f))
        return status{errc::io_error, fmt::format("{}: tensor 'rope_freqs.weight' has factor {} at {}; need finite "
                                                  "and positive",
                                                  path, factors[i], i)};
      m.inv_freq_[i] /= double(factors[i]);
    }
    m.hp_.rope_freq_factors = true;
    if (!m.inv_freq_local_.empty())
      return status{errc::unsupported,
                    fmt::format("{}: rope_freqs.weight with sliding-window layers is not supported", path)};
  }
  return m;
}

const kvq::attention_variant& llama_model::layer_attention(int l) const {
  static const kvq::attention_variant plain;
  return variants_.empty() ? plain : variants_[size_t(l)];
}

kvq::cache_shape llama_model::cache_shape() const {
  kvq::cache_shape s;
  s.layers = hp_.n_layer;
  s.q_heads = hp_.n_head;
  s.kv_heads = hp_.n_head_kv;
  s.head_dim = hp_.head_dim;
  return s;
}

void llama_model::set_threads(int threads) { pool_ = std::make_shared<thread_pool>(threads); }

status llama_model::set_isa(cpu_isa isa) {
  if (!isa_available(isa))
    return {errc::unsupported, fmt::format("set_isa: this CPU (or build) cannot run {} kernels", isa_name(isa))};
  isa_ = isa;
  return {};
}

// ---- shared pieces ------------------------------------------------------------------------------

status llama_model::check_chunk(std::span<const token_id> tokens, std::span<const float> logits,
                                logits_mode mode) const {
  if (tokens.empty()) return {errc::invalid_argument, "forward: empty chunk of tokens"};
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= hp_.n_vocab)
      return {errc::invalid_argument,
              fmt::format("forward: token {} of the chunk is id {}, outside the vocabulary of {}", i, tokens[i],
                          hp_.n_vocab)};
  const size_t want = (mode == logits_mode::all ? tokens.size() : 1) * size_t(hp_.n_vocab);
  if (logits.size() != want)
    return {errc::invalid_argument,
            fmt::format("forward: logits hold {} floats, expected {} ({} x n_vocab {})", logits.size(), want,
                        mode == logits_mode::all ? "tokens" : "1", hp_.n_vocab)};
  return {};
}

void llama_model::embed(std::span<const token_id> tokens, std::vector<float>& x) const {
  const size_t E = size_t(hp_.n_embd);
  x.resize(tokens.size() * E);
  for (size_t t = 0; t < tokens.size(); ++t) tok_embd_.dequantize_row(tokens[t], x.data() + t * E);
  if (hp_.gemma) {
    const float s = std::sqrt(float(E));
    for (float& v : x) v *= s;
  }
}

void llama_model::rope(float* rows, int64_t T, int heads, std::span<const int64_t> pos,
                       const std::vector<double>& inv_freq) const {
  const int hd = hp_.head_dim, half = hp_.n_rot / 2;
  // pair i: channels (2i, 2i + 1) (llama), or (i, i + n_rot / 2) (neox: qwen2, gemma)
  const int first = hp_.rope_neox ? 1 : 2, second = hp_.rope_neox ? half : 1;
  for (int64_t t = 0; t < T; ++t) {
    const double p = double(pos[size_t(t)]);
    for (int i = 0; i < half; ++i) {
      const double theta = p * inv_freq[size_t(i)];
      const float c = float(std::cos(theta)), s = float(std::sin(theta));
      for (int h = 0; h < heads; ++h) {
        float* r = rows + (t * heads + h) * hd + first * i;
        const float x0 = r[0], x1 = r[second];
        r[0] = x0 * c - x1 * s;
        r[second] = x0 * s + x1 * c;
      }
    }
  }
}

namespace {
// Positions pos0, pos0 + 1, ... of a chunk of T rows.
std::vector<int64_t> consecutive(int64_t pos0, int64_t T) {
  std::vector<int64_t> pos(static_cast<size_t>(T));
  std::iota(pos.begin(), pos.end(), pos0);
  return pos;
}
}  // namespace

void llama_model::attention_inputs(int layer, const std::vector<float>& x, int64_t T, std::span<const int64_t> pos,
                                   std::vector<float>& q, std::vector<float>& k, std::vector<float>& v) const {
  const llama_layer& L = layers_[size_t(layer)];
  const int64_t E = hp_.n_embd, Dq = int64_t(hp_.n_head) * hp_.head_dim, Dkv = int64_t(hp_.n_head_kv) * hp_.head_dim;
  std::vector<float> xn(size_t(T * E));
  rms_norm(x.data(), T, E, L.attn_norm, hp_.rms_eps, xn.data());
  q.resize(size_t(T * Dq));
  k.resize(size_t(T * Dkv));
  v.resize(size_t(T * Dkv));
  const matmul_job qkv[] = {{&L.wq, q.data()}, {&L.wk, k.data()}, {&L.wv, v.data()}};
  matmul(qkv, xn.data(), T, *pool_, isa_);
  const auto add_bias = [T](std::vector<float>& rows, const std::vector<float>& bias) {
    const size_t n = bias.size();
    for (size_t t = 0; n && t < size_t(T); ++t)
      for (size_t j = 0; j < n; ++j) rows[t * n + j] += bias[j];
  };
  add_bias(q, L.bq);
  add_bias(k, L.bk);
  add_bias(v, L.bv);
  if (!L.q_norm.empty()) {  // gemma3: each head's q and k RMS-normed over head_dim (in place)
    rms_norm(q.data(), T * hp_.n_head, hp_.head_dim, L.q_norm, hp_.rms_eps, q.data());
    rms_norm(k.data(), T * hp_.n_head_kv, hp_.head_dim, L.k_norm, hp_.rms_eps, k.data());
  }
  const bool local = !hp_.sliding.empty() && hp_.sliding[size_t(layer)];
  const std::vector<double>& inv_freq = local ? inv_freq_local_ : inv_freq_;
  rope(q.data(), T, hp_.n_head, pos, inv_freq);
  rope(k.data(), T, hp_.n_head_kv, pos, inv_freq);
}

void llama_model::attention_output_and_ffn(int layer, std::vector<float>& x, const std::vector<float>& attn,
                                           int64_t T) const {
  const llama_layer& L = layers_[size_t(layer)];
  const int64_t E = hp_.n_embd, F = hp_.n_ff;
  std::vector<float> xn(size_t(T * E)), g(size_t(T * F)), u(size_t(T * F));
  // x += w . in, or with gemma3's sandwich norm x += rms_norm(w . in) * post_norm: the attention's
  // and the FFN's output projections and their residual adds
  const auto project_add = [&](const weight_matrix& w, const float* in, const std::vector<float>& post_norm) {
    if (post_norm.empty()) {
      const matmul_job job[] = {{&w, x.data(), true}};
      matmul(job, in, T, *pool_, isa_);
      return;
    }
    const matmul_job job[] = {{&w, xn.data()}};
    matmul(job, in, T, *pool_, isa_);
    rms_norm(xn.data(), T, E, post_norm, hp_.rms_eps, xn.data());
    for (size_t i = 0; i < xn.size(); ++i) x[i] += xn[i];
  };
  project_add(L.wo, attn.data(), L.post_attn_norm);

  rms_norm(x.data(), T, E, L.ffn_norm, hp_.rms_eps, xn.data());
  const matmul_job gate_up[] = {{&L.w_gate, g.data()}, {&L.w_up, u.data()}};
  matmul(gate_up, xn.data(), T, *pool_, isa_);
  if (hp_.gemma) {  // GELU, tanh form (llama.cpp's ggml_gelu; Gemma's gelu_pytorch_tanh)
    for (size_t i = 0; i < g.size(); ++i) {
      const float a = g[i];
      g[i] = 0.5f * a * (1.f + std::tanh(0.7978845608f * (a + 0.044715f * a * a * a))) * u[i];
    }
  } else {  // SiLU
    for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
  project_add(L.w_down, g.data(), L.post_ffn_norm);
}

void llama_model::output_logits(const std::vector<float>& x, int64_t T, std::span<float> logits,
                                logits_mode mode) const {
  const int64_t E = hp_.n_embd;
  const int64_t first = mode == logits_mode::all ? 0 : T - 1, rows = T - first;
  std::vector<float> xn(size_t(rows * E));
  rms_norm(x.data() + first * E, rows, E, out_norm_, hp_.rms_eps, xn.data());
  const matmul_job head[] = {{tied_output_ ? &tok_embd_ : &output_, logits.data()}};
  matmul(head, xn.data(), rows, *pool_, isa_);
}

// ---- forward through the cache ------------------------------------------------------------------

status llama_model::check_cache_shape(const kvq::KVCache& cache, std::string_view what) const {
  const kvq::cache_shape& cs = cache.config().shape;
  if (cs.layers != hp_.n_layer || cs.q_heads != hp_.n_head || cs.kv_heads != hp_.n_head_kv ||
      cs.head_dim != hp_.head_dim)
    return {errc::invalid_argument,
            fmt::format("{}: the cache is shaped layers {} q_heads {} kv_heads {} head_dim {}, the model {} {} {} {}",
                        what, cs.layers, cs.q_heads, cs.kv_heads, cs.head_dim, hp_.n_layer, hp_.n_head, hp_.n_head_kv,
                        hp_.head_dim)};
  // A cache must attend as the model does: each layer's window (gemma3) and the softmax scale.
  for (int l = 0; l < hp_.n_layer; ++l)
    if (!(cache.config().layer_attention(l) == layer_attention(l)))
      return {errc::invalid_argument,
              fmt::format("{}: the cache's attention of layer {} (window {}) differs from the model's (window {}); "
                          "create it with cache_config::attention = attention_variants()",
                          what, l, cache.config().layer_attention(l).window, layer_attention(l).window)};
  const float scale =
      cache.config().softmax_scale > 0.f ? cache.config().softmax_scale : 1.f / std::sqrt(float(cs.head_dim));
  if (scale != hp_.attn_scale)
    return {errc::invalid_argument,
            fmt::format("{}: the cache's softmax scale {} differs from the model's {}", what, scale, hp_.attn_scale)};
  return {};
}

status llama_model::forward(kvq::KVCache& cache, kvq::seq_id seq, std::span<const token_id> tokens,
                            std::span<float> logits, logits_mode mode, const layer_observer& observer) const {
  KVQ_TRY(check_chunk(tokens, logits, mode));
  KVQ_TRY(check_cache_shape(cache, "forward"));
  const kvq::cache_shape& cs = cache.config().shape;
  const int64_t T = int64_t(tokens.size());
  const int64_t pos0 = cache.length(seq, 0);
  if (pos0 < 0) return {errc::not_found, fmt::format("forward: sequence {} is not in the cache", seq)};

  std::vector<float> x, q, k, v, o(size_t(T) * hp_.n_head * hp_.head_dim);
  const std::vector<int64_t> pos = consecutive(pos0, T);
  embed(tokens, x);
  for (int l = 0; l < hp_.n_layer; ++l) {
    attention_inputs(l, x, T, pos, q, k, v);
    if (observer) observer(l, pos0, q, k, v);
    const kvq::tensor_view kv_k{k.data(), kvq::dtype::f32, T, hp_.n_head_kv, hp_.head_dim, 0};
    const kvq::tensor_view kv_v{v.data(), kvq::dtype::f32, T, hp_.n_head_kv, hp_.head_dim, 0};
    const kvq::tensor_view qv{q.data(), kvq::dtype::f32, T, hp_.n_head, hp_.head_dim, 0};
    const kvq::tensor_mut ov{o.data(), kvq::dtype::f32, T, hp_.n_head, hp_.head_dim, 0};
    if (T <= cs.window) {  // a decode step or a short chunk: what an engine's step does
      KVQ_TRY(cache.append(seq, l, kv_k, kv_v));
      const kvq::attend_item item{seq, int(T)};
      KVQ_TRY(cache.attend(std::span<const kvq::attend_item>(&item, 1), l, qv, ov));
    } else {  // the same semantics for a chunk of any length, in one call
      KVQ_TRY(cache.prefill(seq, l, kv_k, kv_v, qv, ov));
    }
    attention_output_and_ffn(l, x, o, T);
  }
  output_logits(x, T, logits, mode);
  return {};
}

// ---- several streams in one step ----------------------------------------------------------------

status llama_model::check_lanes(std::span<kvq::KVCache* const> caches, std::span<const kvq::seq_id> seqs,
                                std::string_view what) const {
  if (caches.empty()) return {errc::invalid_argument, fmt::format("{}: no cache given", what)};
  if (caches.size() != seqs.size())
    return {errc::invalid_argument, fmt::format("{}: {} caches but {} sequences (one sequence per cache)", what,
                                                caches.size(), seqs.size())};
  for (size_t i = 0; i < caches.size(); ++i) {
    if (!caches[i]) return {errc::invalid_argument, fmt::format("{}: cache {} is null", what, i)};
    KVQ_TRY(check_cache_shape(*caches[i], fmt::format("{}: cache {}", what, i)));
    for (size_t j = 0; j < i; ++j)
      if (caches[j] == caches[i] && seqs[j] == seqs[i])
        return {errc::invalid_argument, fmt::format("{}: sequence {} of cache {} is given twice (entries {} and {})",
                                                    what, seqs[i], i, j, i)};
    if (caches[i]->length(seqs[i], 0) < 0)
      return {errc::not_found, fmt::format("{}: sequence {} is not in cache {}", what, seqs[i], i)};
  }
  return {};
}

status llama_model::forward_lanes(std::span<kvq::KVCache* const> caches, std::span<const kvq::seq_id> seqs,
                                  std::span<const token_id> tokens, std::span<float> logits,
                                  std::span<double> seconds) const {
  KVQ_TRY(check_lanes(caches, seqs, "forward_lanes"));
  const size_t B = caches.size();
  if (tokens.empty() || tokens.size() % B != 0)
    return {errc::invalid_argument, fmt::format("forward_lanes: {} tokens for {} lanes (the same number for each lane)",
                                                tokens.size(), B)};
  const int64_t C = int64_t(tokens.size() / B);  // tokens per lane
  for (size_t i = 0; i < B; ++i)
    if (const int window = caches[i]->config().shape.window; C > window)
      return {errc::invalid_argument,
              fmt::format("forward_lanes: {} tokens per lane; cache {} takes at most its window {} per step", C, i,
                          window)};
  KVQ_TRY(check_chunk(tokens, logits, logits_mode::all));
  if (!seconds.empty() && seconds.size() != B)
    return {errc::invalid_argument,
            fmt::format("forward_lanes: {} timings for {} lanes (give one per lane or none)", seconds.size(), B)};
  const auto t_start = std::chrono::steady_clock::now();
  const int64_t T = int64_t(tokens.size());  // rows: lane i's tokens are rows i * C .. i * C + C - 1
  const int H = hp_.n_head, Hkv = hp_.n_head_kv, hd = hp_.head_dim;
  std::vector<int64_t> pos(static_cast<size_t>(T));
  for (size_t i = 0; i < B; ++i) {
    const int64_t p0 = caches[i]->length(seqs[i], 0);
    for (int64_t j = 0; j < C; ++j) pos[i * size_t(C) + size_t(j)] = p0 + j;
  }
  std::vector<float> x, q, k, v, o(size_t(T) * H * hd);
  std::vector<status> lane_status(B);
  std::vector<double> cache_seconds(B, 0.0);
  std::vector<std::vector<size_t>> by_cache;  // lane indices per distinct cache, first use first
  for (size_t i = 0; i < B; ++i) {
    size_t g = 0;
    while (g < by_cache.size() && caches[by_cache[g][0]] != caches[i]) ++g;
    if (g == by_cache.size()) by_cache.emplace_back();
    by_cache[g].push_back(i);
  }
  embed(tokens, x);
  for (int l = 0; l < hp_.n_layer; ++l) {
    attention_inputs(l, x, T, pos, q, k, v);
    // One task per distinct cache (a KVCache is not called from two threads at once), its
    // lanes in order; each lane's step is `forward`'s for a chunk of at most the window.
    pool_->run(int64_t(by_cache.size()), [&](int64_t g) {
      for (const size_t i : by_cache[size_t(g)]) {
        const auto t0 = std::chrono::steady_clock::now();
        const int64_t r = int64_t(i) * C;
        const kvq::tensor_view kv_k{k.data() + r * Hkv * hd, kvq::dtype::f32, C, Hkv, hd, 0};
        const kvq::tensor_view kv_v{v.data() + r * Hkv * hd, kvq::dtype::f32, C, Hkv, hd, 0};
        const kvq::tensor_view qv{q.data() + r * H * hd, kvq::dtype::f32, C, H, hd, 0};
        const kvq::tensor_mut ov{o.data() + r * H * hd, kvq::dtype::f32, C, H, hd, 0};
        kvq::KVCache& cache = *caches[i];
        status st = cache.append(seqs[i], l, kv_k, kv_v);
        const kvq::attend_item item{seqs[i], int(C)};
        if (st.ok()) st = cache.attend(std::span<const kvq::attend_item>(&item, 1), l, qv, ov);
        lane_status[i] = std::move(st);
        cache_seconds[i] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
    });
    for (auto& st : lane_status)
      if (!st.ok()) return std::move(st);
    attention_output_and_ffn(l, x, o, T);
  }
  output_logits(x, T, logits, logits_mode::all);
  if (!seconds.empty()) {
    // The products' share: the step's wall time less the lanes' cache time spread over the threads.
    const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    const double cache_all = std::accumulate(cache_seconds.begin(), cache_seconds.end(), 0.0);
    const double products = std::max(0.0, total - cache_all / std::min<double>(pool_->threads(), double(by_cache.size())));
    for (size_t i = 0; i < B; ++i) seconds[i] += products / double(B) + cache_seconds[i];
  }
  return {};
}

// ---- one prompt into several caches ------------------------------------------------------------

status llama_model::prefill_shared(std::span<kvq::KVCache* const> caches, std::span<const kvq::seq_id> seqs,
                                   std::span<const token_id> tokens, std::span<float> logits,
                                   logits_mode mode) const {
  KVQ_TRY(check_chunk(tokens, logits, mode));
  KVQ_TRY(check_lanes(caches, seqs, "prefill_shared"));
  for (size_t i = 0; i < caches.size(); ++i)
    if (const int64_t held = caches[i]->length(seqs[i], 0); held != 0)
      return {errc::invalid_argument,
              fmt::format("prefill_shared: sequence {} of cache {} already holds {} tokens; it must be empty", seqs[i],
                          i, held)};
  // A refused append (budget) leaves the sequences empty again, as they were.
  auto undo = [&](status failed) {
    for (size_t i = 0; i < caches.size(); ++i) {
      (void)caches[i]->release_sequence(seqs[i]);
      (void)caches[i]->create_sequence(seqs[i]);
    }
    return failed;
  };

  const int64_t N = int64_t(tokens.size()), V = hp_.n_vocab;
  const int hd = hp_.head_dim, H = hp_.n_head, Hkv = hp_.n_head_kv;
  const int64_t Dkv = int64_t(Hkv) * hd;
  // K and V of every position so far, rounded to fp16 as every cache's ring holds them.
  std::vector<std::vector<float>> K(size_t(hp_.n_layer)), Vs(size_t(hp_.n_layer));
  std::vector<float> x, q, k, v, o;
  const kvq::cpu::task_runner run_tasks = [this](int n, const std::function<void(int)>& fn) {
    pool_->run(n, [&](int64_t i) { fn(int(i)); });
  };
  for (int64_t start = 0; start < N; start += shared_chunk) {
    const int64_t T = std::min(shared_chunk, N - start);
    embed(tokens.subspan(size_t(start), size_t(T)), x);
    o.resize(size_t(T) * H * hd);
    for (int l = 0; l < hp_.n_layer; ++l) {
      attention_inputs(l, x, T, consecutive(start, T), q, k, v);
      for (size_t i = 0; i < caches.size(); ++i) {
        const int64_t window = std::max(caches[i]->config().shape.window, 1);
        for (int64_t s0 = 0; s0 < T; s0 += window) {
          const int64_t n = std::min(window, T - s0);
          const kvq::tensor_view kv_k{k.data() + s0 * Dkv, kvq::dtype::f32, n, Hkv, hd, 0};
          const kvq::tensor_view kv_v{v.data() + s0 * Dkv, kvq::dtype::f32, n, Hkv, hd, 0};
          if (status st = caches[i]->append(seqs[i], l, kv_k, kv_v); !st.ok()) return undo(std::move(st));
        }
      }
      for (float& e : k) e = round_f16(e);
      for (float& e : v) e = round_f16(e);
      auto& Kl = K[size_t(l)];
      auto& Vl = Vs[size_t(l)];
      Kl.insert(Kl.end(), k.begin(), k.end());
      Vl.insert(Vl.end(), v.begin(), v.end());
      kvq::cpu::causal_attention(run_tasks, q.data(), Kl.data(), Vl.data(), o.data(), T, start, H, Hkv, hd,
                                 hp_.attn_scale, layer_attention(l));
      attention_output_and_ffn(l, x, o, T);
    }
    if (mode == logits_mode::all)
      output_logits(x, T, logits.subspan(size_t(start * V), size_t(T * V)), logits_mode::all);
    else if (start + T == N)
      output_logits(x, T, logits, logits_mode::last);
  }
  return {};
}

// ---- reference forward (no cache) ---------------------------------------------------------------

status llama_model::forward_reference(reference_kv& kv, std::span<const token_id> tokens, std::span<float> logits,
                                      logits_mode mode, const layer_observer& observer) const {
  KVQ_TRY(check_chunk(tokens, logits, mode));
  if (kv.k.empty()) {
    kv.k.resize(size_t(hp_.n_layer));
    kv.v.resize(size_t(hp_.n_layer));
    kv.length = 0;
  }
  if (kv.k.size() != size_t(hp_.n_layer) || kv.v.size() != size_t(hp_.n_layer))
    return {errc::invalid_argument,
            fmt::format("forward_reference: reference_kv has {} layers, the model {}", kv.k.size(), hp_.n_layer)};
  const int64_t T = int64_t(tokens.size()), pos0 = kv.length;
  const int hd = hp_.head_dim, H = hp_.n_head, Hkv = hp_.n_head_kv;
  std::vector<float> x, q, k, v, o(size_t(T) * H * hd);
  const std::vector<int64_t> pos = consecutive(pos0, T);
  embed(tokens, x);
  for (int l = 0; l < hp_.n_layer; ++l) {
    attention_inputs(l, x, T, pos, q, k, v);
    if (observer) observer(l, pos0, q, k, v);
    if (kv.round_to_f16) {
      for (float& e : k) e = round_f16(e);
      for (float& e : v) e = round_f16(e);
    }
    auto& K = kv.k[size_t(l)];
    auto& Vs = kv.v[size_t(l)];
    K.insert(K.end(), k.begin(), k.end());
    Vs.insert(Vs.end(), v.begin(), v.end());
    kvq::ref::attend(K.data(), Vs.data(), pos0 + T, q.data(), int(T), H, Hkv, hd, hp_.attn_scale, o.data(),
                     layer_attention(l));
    attention_output_and_ffn(l, x, o, T);
  }
  kv.length += T;
  output_logits(x, T, logits, mode);
  return {};
}

// ---- helpers ------------------------------------------------------------------------------------

token_id argmax(std::span<const float> logits) {
  if (logits.empty()) return -1;
  return token_id(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

result<kvq::KVCache> make_cache(const llama_model& model, std::string_view policy_spec, uint64_t budget_bytes,
                                int page_tokens, int window, int recent) {
  auto pol = kvq::static_policy::parse(policy_spec);
  if (!pol) return pol.error();
  kvq::cache_config cfg;
  cfg.shape = model.cache_shape();
  cfg.shape.page_tokens = page_tokens;
  cfg.shape.window = window;
  cfg.shape.recent = recent;
  cfg.budget_bytes = budget_bytes;
  cfg.where = kvq::backend::cpu;
  cfg.cpu_threads = model.threads();
  cfg.attention = model.attention_variants();
  cfg.softmax_scale = model.hparams().attn_scale;
  return kvq::KVCache::create(cfg, std::make_shared<kvq::static_policy>(std::move(pol).value()));
}

}  // namespace kvq::llama
