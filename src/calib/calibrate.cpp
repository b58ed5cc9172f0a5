// The calibrator: per (layer, kv head, format) K attention KL and V output perturbation over causal
// chunks, and the rolealign clip percentiles they choose. See kvq/calib/calibrate.hpp for the
// definitions; this file is the arithmetic.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <kvq/cache/cache.hpp>
#include <kvq/calib/calibrate.hpp>
#include <kvq/codec/codec.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/rotation/hadamard.hpp>
#include <limits>

KVQ_NAMESPACE_BEGIN
namespace calib {

namespace {

// Key block of the score kernel and channel block of the output kernel (floats). Buffers are
// padded to multiples of these with zeros, so the kernels never branch on a remainder.
constexpr int key_block = 16;
constexpr int chan_block = 32;
// Bins of a codebook-fit histogram over [-range, range] (`fit_range`).
constexpr int fit_bins = 4096;

int round_up(int x, int m) { return (x + m - 1) / m * m; }

float load(const tensor_view& t, int64_t token, int head, int c) {
  const int64_t i = token * t.stride() + int64_t(head) * t.head_dim + c;
  switch (t.type) {
    case dtype::f32:
      return static_cast<const float*>(t.data)[i];
    case dtype::f16:
      return half_to_float(static_cast<const uint16_t*>(t.data)[i]);
    case dtype::bf16:
      return bf16_to_float(static_cast<const uint16_t*>(t.data)[i]);
  }
  return 0.f;
}

// s[r][j] = Σ_c q[r][c]·kt[c][j] for every row r of token t (rows t*group .. t*group+group-1) and
// key j <= t, rounded up to whole key blocks (the extra entries are never read).
// q: [T*group][dp], kt: [dp][tp] (K transposed, zero-padded), s: [T*group][tp].
// NOTE: a key block of 16 floats accumulated over the channels stays in registers and the block
// of kt it reads (dp x 16 floats, 4 KiB for d = 64) stays in L1 across all rows, which makes this
// loop compute-bound; the plain row-times-column form was 3x slower (SmolLM2 chunk, 2-core VM).
void causal_scores(const float* q, const float* kt, int T, int group, int dp, int tp, float* s) {
  for (int j0 = 0; j0 < T; j0 += key_block) {
    const float* ktb = kt + j0;
    for (int t = j0; t < T; ++t)
      for (int g = 0; g < group; ++g) {
        const int r = t * group + g;
        const float* qr = q + size_t(r) * size_t(dp);
        float acc[key_block] = {};
        for (int c = 0; c < dp; ++c) {
          const float a = qr[c];
          const float* kc = ktb + size_t(c) * size_t(tp);
          for (int jj = 0; jj < key_block; ++jj) acc[jj] += a * kc[jj];
        }
        std::memcpy(s + size_t(r) * size_t(tp) + j0, acc, sizeof acc);
      }
  }
}

// o[r][c] = Σ_{j<=t} p[r][j]·x[j][c]. p: [T*group][tp], x: [tp][dp], o: [T*group][dp].
void causal_mix(const float* p, const float* x, int T, int group, int dp, int tp, float* o) {
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < group; ++g) {
      const int r = t * group + g;
      const float* pr = p + size_t(r) * size_t(tp);
      float* orow = o + size_t(r) * size_t(dp);
      for (int c0 = 0; c0 < dp; c0 += chan_block) {
        float acc[chan_block] = {};
        for (int j = 0; j <= t; ++j) {
          const float a = pr[j];
          const float* xj = x + size_t(j) * size_t(dp) + c0;
          for (int cc = 0; cc < chan_block; ++cc) acc[cc] += a * xj[cc];
        }
        std::memcpy(orow + c0, acc, sizeof acc);
      }
    }
}

// e^u − 1 − u without cancellation: Taylor series to u^9 for |u| <= 1/2 (relative error < 1e-8),
// the direct form beyond.
double exp_excess(double u) {
  if (std::abs(u) > 0.5) return std::exp(u) - 1.0 - u;
  double p = 1.0 / 362880.0;
  for (double inv : {1.0 / 40320, 1.0 / 5040, 1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 1.0 / 2}) p = p * u + inv;
  return p * u * u;
}

// Codec round trip of one head's [T][d] fp16 rows (whole pages only; the tail stays as it is):
// writes x̂ − x into err ([T][ld], zero for the tail).
void round_trip_error(format_id f, const codec::encode_params& ep, role r, int page_tokens, int d, int T,
                      const uint16_t* x16, const float* x, int ld, std::vector<uint8_t>& page, float* err) {
  for (int t = 0; t < T; ++t) std::fill_n(err + size_t(t) * size_t(ld), ld, 0.f);
  if (f == fp16_format) return;
  const codec::page_geom g = codec::make_geom(f, r, page_tokens, d);
  page.assign(g.lay.total(), 0);
  for (int p0 = 0; p0 + page_tokens <= T; p0 += page_tokens) {
    const uint16_t* src = x16 + size_t(p0) * size_t(d);
    for (int u = 0, n = g.unit_count(); u < n; ++u) codec::encode_unit(g, src, d, u, page.data(), ep);
    for (int t = 0; t < page_tokens; ++t)
      for (int c = 0; c < d; ++c) {
        const size_t i = size_t(p0 + t) * size_t(d) + size_t(c);
        err[size_t(p0 + t) * size_t(ld) + size_t(c)] = codec::decode_element(g, page.data(), t, c) - x[i];
      }
  }
}

// The codebook codec's scale of a group of `gs` fp16 values: fp16(rms), the same float steps.
float group_rms_scale(const uint16_t* x, int gs) {
  float ss = 0.f;
  for (int c = 0; c < gs; ++c) {
    const float v = half_to_float(x[c]);
    ss = codec::add_rn(ss, codec::mul_rn(v, v));
  }
  return half_to_float(float_to_half(codec::sqrt_rn(codec::div_rn(ss, float(gs)))));
}

// |v| <= sqrt(group) when the scale is the group's rms (fp16 rounding of the scale aside).
double fit_range(int group) { return std::sqrt(double(group)) * 1.01 + 0.01; }

// Lloyd's iteration over one histogram (bins of width 2 range / fit_bins; w: Σ s², wv: Σ s² v)
// from the Lloyd-Max levels: cells split at the midpoints as the codec splits them, each level
// the weighted mean of its cell (a bin goes whole to the cell of its mean). The Lloyd-Max levels
// when there is nothing to fit or the result is not strictly ascending.
std::vector<float> lloyd_fit(const double* w, const double* wv, double range, int bits) {
  const int n = 1 << bits;
  std::vector<float> start(static_cast<size_t>(n));
  for (int k = 0; k < n; ++k) start[size_t(k)] = lloyd_max_level(bits, k);
  double total = 0.0;
  for (int b = 0; b < fit_bins; ++b) total += w[b];
  if (!(total > 0.0)) return start;
  std::vector<double> lv(start.begin(), start.end()), cw(static_cast<size_t>(n)), cwv(static_cast<size_t>(n));
  for (int it = 0; it < 500; ++it) {
    std::fill(cw.begin(), cw.end(), 0.0);
    std::fill(cwv.begin(), cwv.end(), 0.0);
    int cell = 0;
    for (int b = 0; b < fit_bins; ++b) {
      if (!(w[b] > 0.0)) continue;
      const double m = wv[b] / w[b];
      while (cell + 1 < n && m > 0.5 * (lv[size_t(cell)] + lv[size_t(cell) + 1])) ++cell;
      cw[size_t(cell)] += w[b];
      cwv[size_t(cell)] += wv[b];
    }
    double moved = 0.0;
    for (int k = 0; k < n; ++k)
      if (cw[size_t(k)] > 0.0) {
        const double nl = cwv[size_t(k)] / cw[size_t(k)];
        moved = std::max(moved, std::abs(nl - lv[size_t(k)]));
        lv[size_t(k)] = nl;
      }
    if (moved < 1e-7 * range) break;
  }
  std::vector<float> out(static_cast<size_t>(n));
  for (int k = 0; k < n; ++k) out[size_t(k)] = float(lv[size_t(k)]);
  if (!check_codebook_levels(out, bits, "fit").ok()) return start;
  return out;
}

}  // namespace

std::vector<format_id> default_candidates() {
  return {format_id(find_format(family::kivi, 8, 32)), format_id(find_format(family::kivi, 4, 32)),
          format_id(find_format(family::kivi, 2, 32)), format_id(find_format(family::sym, 8, 32)),
          format_id(find_format(family::sym, 4, 32)),  format_id(find_format(family::fp8_e4m3, 8, 1))};
}

kvq::result<calibrator> calibrator::create(const cache_shape& shape, calibrator_options opt) {
  const auto bad = [](std::string m) { return status{errc::invalid_argument, "calibrator: " + std::move(m)}; };
  if (shape.layers <= 0 || shape.q_heads <= 0 || shape.kv_heads <= 0 || shape.head_dim <= 0 || shape.page_tokens <= 0)
    return bad(fmt::format("layers {}, q_heads {}, kv_heads {}, head_dim {} and page_tokens {} must be positive",
                           shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim, shape.page_tokens));
  if (shape.q_heads % shape.kv_heads != 0)
    return bad(fmt::format("q_heads {} is not a multiple of kv_heads {}", shape.q_heads, shape.kv_heads));
  if (opt.rotated && !(rotation::is_power_of_two(shape.head_dim) && shape.head_dim <= 256))
    return bad(
        fmt::format("rotated candidates need head_dim a power of two up to 256; got head_dim {}", shape.head_dim));
  if (opt.formats.empty()) return bad("no candidate formats");
  for (size_t i = 0; i < opt.formats.size(); ++i) {
    if (opt.formats[i] >= format_count) return bad(fmt::format("candidate {} is outside the format table", i));
    for (size_t j = 0; j < i; ++j)
      if (opt.formats[j] == opt.formats[i])
        return bad(fmt::format("format {} is listed twice", format_name(opt.formats[i])));
  }
  if (opt.clip_percentile_grid.empty()) return bad("the clip percentile grid is empty");
  for (float p : opt.clip_percentile_grid)
    if (const std::string e = clip_percentile_error(p); !e.empty()) return bad("clip_percentile_grid: " + e);
  for (format_id f : opt.clip_formats)
    if (f >= format_count || traits_of(f).fam != family::rolealign)
      return bad(fmt::format("clip format {} is not a rolealign format",
                             f < format_count ? format_name(f) : std::to_string(int(f))));

  const bool any_codebook = std::any_of(opt.formats.begin(), opt.formats.end(), codec::is_codebook_format);
  if (opt.fit_codebooks && !any_codebook) return bad("fit_codebooks: no codebook format among the candidates");
  const size_t levels_per_unit = size_t(shape.layers) * size_t(shape.kv_heads) * 2;
  for (size_t i = 0; i < opt.codebook_levels.size(); ++i) {
    const codebook_fit& cf = opt.codebook_levels[i];
    const std::string name = cf.format < format_count ? format_name(cf.format) : std::to_string(int(cf.format));
    if (std::find(opt.formats.begin(), opt.formats.end(), cf.format) == opt.formats.end() ||
        !codec::is_codebook_format(cf.format))
      return bad(fmt::format("codebook_levels[{}]: {} is not a codebook candidate", i, name));
    if (cf.rotated && !opt.rotated)
      return bad(
          fmt::format("codebook_levels[{}]: rotated levels of {}, but rotated candidates are not measured", i, name));
    for (size_t k = 0; k < i; ++k)
      if (opt.codebook_levels[k].format == cf.format && opt.codebook_levels[k].rotated == cf.rotated)
        return bad(fmt::format("codebook_levels[{}] repeats codebook_levels[{}] ({})", i, k, name));
    if (status st = check_codebook_table(cf.levels, traits_of(cf.format).bits, levels_per_unit, shape.kv_heads,
                                         fmt::format("codebook_levels[{}] ({})", i, name),
                                         [&](int l, int h, bool v) {
                                           return fmt::format("codebook_levels[{}] layer {} head {} {}", i, l, h,
                                                              v ? "V" : "K");
                                         });
        !st.ok())
      return bad(st.message());
  }

  calibrator c;
  c.shape_ = shape;
  c.opt_ = std::move(opt);
  if (c.opt_.fit_codebooks)
    for (format_id f : c.opt_.formats)
      if (codec::is_codebook_format(f)) {
        const int g = group_of(traits_of(f), shape.head_dim);
        if (std::find(c.fit_groups_.begin(), c.fit_groups_.end(), g) == c.fit_groups_.end()) c.fit_groups_.push_back(g);
      }
  c.scale_ = c.opt_.softmax_scale > 0.f ? c.opt_.softmax_scale : 1.f / std::sqrt(float(shape.head_dim));

  std::vector<format_id> grid_formats;  // rolealign formats measured at every percentile
  c.objective_formats_ = c.opt_.clip_formats;
  for (format_id f : c.opt_.formats)
    if (traits_of(f).fam == family::rolealign) {
      grid_formats.push_back(f);
      if (c.opt_.clip_formats.empty()) c.objective_formats_.push_back(f);
    }
  for (format_id f : c.opt_.clip_formats)
    if (std::find(grid_formats.begin(), grid_formats.end(), f) == grid_formats.end()) grid_formats.push_back(f);
  for (format_id f : c.opt_.formats)
    for (role r : {role::k, role::v})
      if (status s = check_shape(f, r, shape.page_tokens, shape.head_dim); !s.ok()) return bad(s.message());
  for (format_id f : grid_formats)
    for (role r : {role::k, role::v})
      if (status s = check_shape(f, r, shape.page_tokens, shape.head_dim); !s.ok()) return bad(s.message());

  const auto add = [&](format_id f, float clip, bool rotated) {
    if (traits_of(f).fam == family::rolealign && clip == codec::no_clip) {
      const format_traits t = traits_of(f);
      f = format_id(find_format(family::kivi, t.bits, t.group));
    }
    if (traits_of(f).fam != family::rolealign) clip = codec::no_clip;
    for (const variant& v : c.variants_)
      if (v.f == f && v.clip == clip && v.rotated == rotated) return;
    c.variants_.push_back({f, clip, rotated});
  };
  for (format_id f : c.opt_.formats) add(f, codec::no_clip, false);
  if (c.opt_.rotated)
    for (format_id f : c.opt_.formats) add(f, codec::no_clip, true);
  for (bool rot : {false, true}) {
    if (rot && !c.opt_.rotated) continue;
    for (format_id f : grid_formats) {
      add(f, codec::no_clip, rot);  // the normalization of the clip objective
      for (float p : c.opt_.clip_percentile_grid) add(f, p, rot);
    }
  }

  const size_t units = size_t(shape.layers) * size_t(shape.kv_heads);
  c.tokens_.assign(size_t(shape.layers), 0);
  c.rows_.assign(units, 0.0);
  c.k_kl_.assign(units * c.variants_.size(), 0.0);
  c.v_err_.assign(units * c.variants_.size(), 0.0);
  c.v_ref_.assign(units, 0.0);
  const size_t fit_cells = units * 2 * c.fit_groups_.size() * (c.opt_.rotated ? 2 : 1) * size_t(fit_bins);
  c.fit_w_.assign(fit_cells, 0.0);
  c.fit_wv_.assign(fit_cells, 0.0);
  return c;
}

size_t calibrator::fit_index(int layer, int kv_head, role r, size_t group, bool rotated) const {
  const size_t unit = (size_t(layer) * size_t(shape_.kv_heads) + size_t(kv_head)) * 2 + (r == role::k ? 0 : 1);
  const size_t spaces = opt_.rotated ? 2 : 1;
  return ((unit * fit_groups_.size() + group) * spaces + (rotated ? 1 : 0)) * size_t(fit_bins);
}

// Counts one head's [T][d] fp16 rows: v = x / s per channel group, s the codebook codec's scale.
void calibrator::count_for_fit(int layer, int kv_head, role r, const uint16_t* x16, int T, bool rotated) {
  const int d = shape_.head_dim;
  for (size_t gi = 0; gi < fit_groups_.size(); ++gi) {
    const int gs = fit_groups_[gi];
    const double range = fit_range(gs);
    double* w = &fit_w_[fit_index(layer, kv_head, r, gi, rotated)];
    double* wv = &fit_wv_[fit_index(layer, kv_head, r, gi, rotated)];
    for (int t = 0; t < T; ++t)
      for (int c0 = 0; c0 < d; c0 += gs) {
        const uint16_t* x = x16 + size_t(t) * size_t(d) + size_t(c0);
        const float s = group_rms_scale(x, gs);
        if (!(s > 0.f)) continue;
        const double s2 = double(s) * s;
        for (int c = 0; c < gs; ++c) {
          const float v = codec::div_rn(half_to_float(x[c]), s);
          const int b = std::clamp(int((double(v) + range) / (2 * range) * fit_bins), 0, fit_bins - 1);
          w[b] += s2;
          wv[b] += s2 * v;
        }
      }
  }
}

const float* calibrator::levels_of(format_id f, bool rotated, int layer, int kv_head, role r) const {
  for (const codebook_fit& cf : opt_.codebook_levels)
    if (cf.format == f && cf.rotated == rotated) {
      const size_t unit = (size_t(layer) * size_t(shape_.kv_heads) + size_t(kv_head)) * 2 + (r == role::k ? 0 : 1);
      return cf.levels.data() + unit * (size_t(1) << traits_of(f).bits);
    }
  return nullptr;
}

kvq::result<std::vector<codebook_fit>> calibrator::fitted_codebooks() const {
  if (!opt_.fit_codebooks)
    return status{errc::not_found, "calibrator: codebook levels were not fitted (options.fit_codebooks)"};
  for (int l = 0; l < shape_.layers; ++l)
    if (tokens_[size_t(l)] == 0)
      return status{errc::not_found, fmt::format("calibrator: layer {} was never observed", l)};
  std::vector<codebook_fit> out;
  for (bool rotated : {false, true}) {
    if (rotated && !opt_.rotated) break;
    for (format_id f : opt_.formats) {
      if (!codec::is_codebook_format(f)) continue;
      const format_traits t = traits_of(f);
      const size_t gi =
          size_t(std::find(fit_groups_.begin(), fit_groups_.end(), group_of(t, shape_.head_dim)) - fit_groups_.begin());
      const double range = fit_range(fit_groups_[gi]);
      codebook_fit cf{f, rotated, {}};
      for (int l = 0; l < shape_.layers; ++l)
        for (int h = 0; h < shape_.kv_heads; ++h)
          for (role r : {role::k, role::v}) {
            const size_t at = fit_index(l, h, r, gi, rotated);
            const std::vector<float> lv = lloyd_fit(&fit_w_[at], &fit_wv_[at], range, t.bits);
            cf.levels.insert(cf.levels.end(), lv.begin(), lv.end());
          }
      out.push_back(std::move(cf));
    }
  }
  return out;
}

int calibrator::variant_of(format_id f, float clip, bool rotated) const {
  if (f >= format_count) return -1;
  const format_traits t = traits_of(f);
  if (t.fam == family::rolealign && clip == codec::no_clip) f = format_id(find_format(family::kivi, t.bits, t.group));
  if (traits_of(f).fam != family::rolealign) {
    if (clip != codec::no_clip) return -1;
  }
  for (size_t i = 0; i < variants_.size(); ++i)
    if (variants_[i].f == f && variants_[i].clip == clip && variants_[i].rotated == rotated) return int(i);
  return -1;
}

status calibrator::observe(int layer, const tensor_view& q, const tensor_view& k, const tensor_view& v) {
  const auto bad = [&](std::string m) {
    return status{errc::invalid_argument, fmt::format("calibrator: layer {}: {}", layer, m)};
  };
  if (layer < 0 || layer >= shape_.layers) return bad(fmt::format("outside the model's {} layers", shape_.layers));
  const int d = shape_.head_dim, Hq = shape_.q_heads, Hkv = shape_.kv_heads, group = Hq / Hkv;
  const struct {
    const char* name;
    const tensor_view* t;
    int heads;
  } inputs[] = {{"q", &q, Hq}, {"k", &k, Hkv}, {"v", &v, Hkv}};
  for (const auto& in : inputs) {
    if (in.t->data == nullptr) return bad(fmt::format("{} is a null pointer", in.name));
    if (in.t->heads != in.heads || in.t->head_dim != d)
      return bad(fmt::format("{} is [{}][{}][{}], the shape needs [T][{}][{}]", in.name, in.t->tokens, in.t->heads,
                             in.t->head_dim, in.heads, d));
    if (in.t->token_stride != 0 && in.t->token_stride < int64_t(in.heads) * d)
      return bad(fmt::format("{} has token stride {} < heads x head_dim {}", in.name, in.t->token_stride,
                             int64_t(in.heads) * d));
  }
  if (q.tokens <= 0) return bad("empty chunk (T = 0)");
  if (k.tokens != q.tokens || v.tokens != q.tokens)
    return bad(fmt::format("token counts differ: q {}, k {}, v {}", q.tokens, k.tokens, v.tokens));
  if (q.tokens > std::numeric_limits<int>::max() / std::max(Hq, 1))
    return bad(fmt::format("chunk of {} tokens is too long", q.tokens));
  const int T = int(q.tokens);
  for (const auto& in : inputs)
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < in.heads; ++h)
        for (int c = 0; c < d; ++c) {
          const float x = load(*in.t, t, h, c);
          if (!std::isfinite(x))
            return {errc::non_finite, fmt::format("calibrator: layer {}: {} is {} at token {} head {} channel {}",
                                                  layer, in.name, x, t, h, c)};
          if (in.t != &q && std::abs(x) > fp16_max)
            return bad(fmt::format("{} is {} at token {} head {} channel {}, beyond fp16 range", in.name, x, t, h, c));
        }

  const int dp = round_up(d, chan_block), tp = round_up(T, key_block), rows = T * group;
  const size_t nv = variants_.size();
  std::vector<uint16_t> x16(size_t(T) * size_t(d));
  std::vector<float> xf(size_t(T) * size_t(d)), err(size_t(tp) * size_t(dp)), errt(size_t(dp) * size_t(tp));
  std::vector<float> qh(size_t(rows) * size_t(dp)), s(size_t(rows) * size_t(tp)), ds(size_t(rows) * size_t(tp));
  std::vector<float> o(size_t(rows) * size_t(dp));
  std::vector<double> pz(static_cast<size_t>(rows));  // 1 / Σ_j P_j of each row
  std::vector<uint8_t> page;
  // Rotated variants: the head's rows rotated, as fp16 bits and floats, and the rotated queries.
  const bool any_rotated = opt_.rotated;
  std::vector<uint16_t> x16r(any_rotated ? x16.size() : 0);
  std::vector<float> xfr(any_rotated ? xf.size() : 0), qhr(any_rotated ? qh.size() : 0);
  // Loads head h of k or v as fp16 bits and their float values, [T][d], and with rotated
  // variants the same of the rotated rows.
  const auto load_head = [&](const tensor_view& src, int h) {
    const rotation::signs sg = rotation::signs::of(opt_.rotation_seed, layer, h);
    float row[256];
    for (int t = 0; t < T; ++t) {
      for (int c = 0; c < d; ++c) {
        const float x = load(src, t, h, c);
        const uint16_t b = float_to_half(x);
        x16[size_t(t) * size_t(d) + size_t(c)] = b;
        xf[size_t(t) * size_t(d) + size_t(c)] = half_to_float(b);
        if (any_rotated) row[c] = x;
      }
      if (!any_rotated) continue;
      rotation::rotate(row, d, sg);  // as the cache stores it: rotated, then rounded to fp16
      for (int c = 0; c < d; ++c) {
        const uint16_t b = float_to_half(row[c]);
        x16r[size_t(t) * size_t(d) + size_t(c)] = b;
        xfr[size_t(t) * size_t(d) + size_t(c)] = half_to_float(b);
      }
    }
  };
  const auto transpose = [&](const float* a /* [tp][dp] */, float* at /* [dp][tp] */) {
    for (int t = 0; t < tp; ++t)
      for (int c = 0; c < dp; ++c) at[size_t(c) * size_t(tp) + size_t(t)] = a[size_t(t) * size_t(dp) + size_t(c)];
  };

  for (int h = 0; h < Hkv; ++h) {
    const size_t unit = size_t(layer) * size_t(Hkv) + size_t(h);
    // Queries of the group, pre-multiplied by the softmax scale: [T*group][dp].
    std::fill(qh.begin(), qh.end(), 0.f);
    for (int t = 0; t < T; ++t)
      for (int g = 0; g < group; ++g)
        for (int c = 0; c < d; ++c)
          qh[size_t(t * group + g) * size_t(dp) + size_t(c)] = load(q, t, h * group + g, c) * scale_;
    if (any_rotated) {
      const rotation::signs sg = rotation::signs::of(opt_.rotation_seed, layer, h);
      qhr = qh;
      for (int r = 0; r < rows; ++r) rotation::rotate(&qhr[size_t(r) * size_t(dp)], d, sg);
    }

    // Reference attention P over the fp16 keys, stored in place of the scores: [rows][tp].
    load_head(k, h);
    std::fill(err.begin(), err.end(), 0.f);
    for (int t = 0; t < T; ++t) std::copy_n(&xf[size_t(t) * size_t(d)], d, &err[size_t(t) * size_t(dp)]);
    transpose(err.data(), errt.data());
    causal_scores(qh.data(), errt.data(), T, group, dp, tp, s.data());
    for (int r = 0; r < rows; ++r) {
      float* sr = &s[size_t(r) * size_t(tp)];
      const int n = r / group + 1;
      const float mx = *std::max_element(sr, sr + n);
      double z = 0.0;
      for (int j = 0; j < n; ++j) z += (sr[j] = std::exp(sr[j] - mx));
      for (int j = n; j < tp; ++j) sr[j] = 0.f;
      pz[size_t(r)] = 1.0 / z;
    }

    if (opt_.fit_codebooks) {
      count_for_fit(layer, h, role::k, x16.data(), T, false);
      if (any_rotated) count_for_fit(layer, h, role::k, x16r.data(), T, true);
    }

    // K: per variant, δ = scaled q·(K̂ − K) and the KL of each row.
    for (size_t vi = 0; vi < nv; ++vi) {
      const bool rot = variants_[vi].rotated;  // δ = (R q)·(R̂k − R k): the error in the rotated space
      const codec::encode_params ep{variants_[vi].clip, levels_of(variants_[vi].f, rot, layer, h, role::k)};
      round_trip_error(variants_[vi].f, ep, role::k, shape_.page_tokens, d, T, rot ? x16r.data() : x16.data(),
                       rot ? xfr.data() : xf.data(), dp, page, err.data());
      transpose(err.data(), errt.data());
      causal_scores(rot ? qhr.data() : qh.data(), errt.data(), T, group, dp, tp, ds.data());
      double kl = 0.0;
      for (int r = 0; r < rows; ++r) {
        const float* pr = &s[size_t(r) * size_t(tp)];
        const float* dr = &ds[size_t(r) * size_t(tp)];
        const int n = r / group + 1;
        double m = 0.0;
        for (int j = 0; j < n; ++j) m += double(pr[j]) * dr[j];
        m *= pz[size_t(r)];
        double e = 0.0;
        for (int j = 0; j < n; ++j) e += double(pr[j]) * exp_excess(double(dr[j]) - m);
        kl += std::log1p(e * pz[size_t(r)]);
      }
      k_kl_[unit * nv + vi] += kl;
    }

    // V: reference output P·V, then per variant P·(V̂ − V).
    load_head(v, h);
    std::fill(err.begin(), err.end(), 0.f);
    for (int t = 0; t < T; ++t) std::copy_n(&xf[size_t(t) * size_t(d)], d, &err[size_t(t) * size_t(dp)]);
    causal_mix(s.data(), err.data(), T, group, dp, tp, o.data());
    // Σ_rows ‖o_r‖² pz_r² of the mixed rows in `o`
    const auto weighted_norm2 = [&] {
      double sum = 0.0;
      for (int r = 0; r < rows; ++r) {
        double n2 = 0.0;
        for (int c = 0; c < d; ++c)
          n2 += double(o[size_t(r) * size_t(dp) + size_t(c)]) * o[size_t(r) * size_t(dp) + size_t(c)];
        sum += n2 * pz[size_t(r)] * pz[size_t(r)];
      }
      return sum;
    };
    v_ref_[unit] += weighted_norm2();
    if (opt_.fit_codebooks) {
      count_for_fit(layer, h, role::v, x16.data(), T, false);
      if (any_rotated) count_for_fit(layer, h, role::v, x16r.data(), T, true);
    }
    for (size_t vi = 0; vi < nv; ++vi) {
      const bool rot = variants_[vi].rotated;  // ‖P(R̂v − Rv)‖ = ‖R^T P(R̂v − Rv)‖: R is orthogonal
      const codec::encode_params ep{variants_[vi].clip, levels_of(variants_[vi].f, rot, layer, h, role::v)};
      round_trip_error(variants_[vi].f, ep, role::v, shape_.page_tokens, d, T, rot ? x16r.data() : x16.data(),
                       rot ? xfr.data() : xf.data(), dp, page, err.data());
      causal_mix(s.data(), err.data(), T, group, dp, tp, o.data());
      v_err_[unit * nv + vi] += weighted_norm2();
    }
    rows_[unit] += double(rows);
  }
  tokens_[size_t(layer)] += T;
  return {};
}

double calibrator::mean_damage(int layer, int kv_head, role r, int vi) const {
  const size_t unit = size_t(layer) * size_t(shape_.kv_heads) + size_t(kv_head), nv = variants_.size();
  if (r == role::k) return rows_[unit] > 0 ? k_kl_[unit * nv + size_t(vi)] / rows_[unit] : 0.0;
  return v_ref_[unit] > 0 ? v_err_[unit * nv + size_t(vi)] / v_ref_[unit] : 0.0;
}

float calibrator::choose_clip(int layer, int kv_head, role r, bool rotated) const {
  if (tokens_[size_t(layer)] == 0) return codec::no_clip;
  float best_p = codec::no_clip;
  double best = std::numeric_limits<double>::infinity();
  for (float p : opt_.clip_percentile_grid) {
    double sum = 0.0;
    int n = 0;
    for (format_id f : objective_formats_) {
      const double base = mean_damage(layer, kv_head, r, variant_of(f, codec::no_clip, rotated));
      if (!(base > 0.0)) continue;
      sum += mean_damage(layer, kv_head, r, variant_of(f, p, rotated)) / base;
      ++n;
    }
    if (n == 0) return codec::no_clip;
    const double obj = sum / n;
    if (obj < best || (obj == best && p > best_p)) {
      best = obj;
      best_p = p;
    }
  }
  return best_p;
}

std::vector<float> calibrator::clip_percentiles(bool rotated) const {
  std::vector<float> out;
  out.reserve(size_t(shape_.layers) * size_t(shape_.kv_heads) * 2);
  for (int l = 0; l < shape_.layers; ++l)
    for (int h = 0; h < shape_.kv_heads; ++h)
      for (role r : {role::k, role::v})
        out.push_back(rotated && !opt_.rotated ? codec::no_clip : choose_clip(l, h, r, rotated));
  return out;
}

kvq::result<double> calibrator::damage(int layer, int kv_head, role r, format_id f, float clip, bool rotated) const {
  if (layer < 0 || layer >= shape_.layers || kv_head < 0 || kv_head >= shape_.kv_heads)
    return status{errc::invalid_argument,
                  fmt::format("calibrator: layer {} head {} is outside the shape", layer, kv_head)};
  if (tokens_[size_t(layer)] == 0)
    return status{errc::not_found, fmt::format("calibrator: layer {} was never observed", layer)};
  const int vi = variant_of(f, clip, rotated);
  if (vi < 0)
    return status{errc::not_found, fmt::format("calibrator: {}{} at clip percentile {} was not measured",
                                               f < format_count ? format_name(f) : std::to_string(int(f)),
                                               rotated ? " rotated" : "", clip)};
  return mean_damage(layer, kv_head, r, vi);
}

kvq::result<sensitivity_profile> calibrator::profile(bool rotated, const std::vector<float>& clips) const {
  for (int l = 0; l < shape_.layers; ++l)
    if (tokens_[size_t(l)] == 0)
      return status{errc::not_found, fmt::format("calibrator: layer {} was never observed", l)};
  auto made = sensitivity_profile::make(shape_.layers, shape_.kv_heads, opt_.formats);
  if (!made) return made.error();
  sensitivity_profile p = std::move(made).value();
  for (int l = 0; l < shape_.layers; ++l)
    for (int h = 0; h < shape_.kv_heads; ++h)
      for (role r : {role::k, role::v}) {
        const float clip = clips[(size_t(l) * size_t(shape_.kv_heads) + size_t(h)) * 2 + (r == role::k ? 0 : 1)];
        for (size_t fi = 0; fi < opt_.formats.size(); ++fi) {
          const format_id f = opt_.formats[fi];
          const bool clipped = traits_of(f).fam == family::rolealign;
          const int vi = variant_of(f, clipped ? clip : codec::no_clip, rotated);
          p.at(l, h, r, int(fi)) = std::max(0.0, mean_damage(l, h, r, vi));
        }
      }
  if (status s = p.validate(); !s.ok()) return status{s.code(), "calibrator: " + s.message()};
  return p;
}

kvq::result<sensitivity_profile> calibrator::rotated_result() const {
  if (!opt_.rotated)
    return status{errc::not_found, "calibrator: rotated candidates were not measured (options.rotated)"};
  return profile(true, clip_percentiles(true));
}

kvq::result<sensitivity_profile> calibrator::result(artifact* out, std::string_view calibration_text) const {
  const std::vector<float> clips = clip_percentiles();
  auto made = profile(false, clips);
  if (!made) return made.error();
  sensitivity_profile p = std::move(made).value();
  if (out != nullptr) {
    artifact a;
    a.model_name = opt_.model_name;
    a.shape = {shape_.layers, shape_.q_heads, shape_.kv_heads, shape_.head_dim};
    a.text_hash = artifact::hash_text(calibration_text);
    a.calibration_tokens = *std::min_element(tokens_.begin(), tokens_.end());
    a.sensitivity = p;
    a.clip_percentiles = clips;
    if (opt_.rotated) {
      a.rotated_clip_percentiles = clip_percentiles(true);
      auto rp = profile(true, a.rotated_clip_percentiles);
      if (!rp) return rp.error();
      a.rotated_sensitivity = std::move(rp).value();
      a.rotation_seed = opt_.rotation_seed;
    }
    a.codebooks = opt_.codebook_levels;
    if (status s = a.validate(); !s.ok()) return status{s.code(), "calibrator: " + s.message()};
    *out = std::move(a);
  }
  return p;
}

}  // namespace calib
KVQ_NAMESPACE_END
