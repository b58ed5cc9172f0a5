// The EchoKV controller: canary scheduling, the KL measurement on the FP16 window, EMA and
// hysteresis decisions, the budget controller, snapshots and votes.
#include <kvq/policy/echokv.hpp>
#include <kvq/codec/codec.hpp>
#include <kvq/format/numeric.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

KVQ_NAMESPACE_BEGIN

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Token group of a K format along tokens (1 when K groups run along channels or there are none).
int token_group(format_id f) {
  const format_traits t = traits_of(f);
  return t.k_along_tokens() ? int(t.group) : 1;
}

// Dot product of two float rows of d elements (d a multiple of 8 in kvq) in 8 independent lanes,
// which the compiler vectorizes without reassociation flags.
float dot(const float* x, const float* y, int d) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int c = 0;
  for (; c + 8 <= d; c += 8)
    for (int k = 0; k < 8; ++k) acc[k] += x[c + k] * y[c + k];
  float s = 0.f;
  for (; c < d; ++c) s += x[c] * y[c];
  for (int k = 0; k < 8; ++k) s += acc[k];
  return s;
}

}  // namespace

echokv_policy::echokv_policy(echokv_options opt) : opt_(std::move(opt)) {}

std::string echokv_policy::name() const {
  std::string tiers;
  for (size_t t = 0; t < opt_.tiers.size(); ++t) {
    if (t) tiers += '|';
    tiers += opt_.v_tiers.empty() ? format_name(opt_.tiers[t]) : format_pair_name(pair_of_tier(t));
  }
  return fmt::format("echokv({},rate={},seed={},{},k={},h={})", tiers, opt_.rate, opt_.seed,
                     opt_.granularity == echokv_granularity::per_layer ? "per_layer" : "per_head",
                     opt_.hysteresis_steps, opt_.hysteresis_margin);
}

result<format_pair> echokv_policy::tier_formats(int t) const {
  if (t < 0 || size_t(t) >= opt_.tiers.size())
    return status{errc::invalid_argument, fmt::format("echokv: tier {} outside [0, {})", t, opt_.tiers.size())};
  return pair_of_tier(size_t(t));
}

// Also called on options `bind` has not validated (`describe`, `current` before `bind`): a tier
// past the lists reads as fp16, a missing V format as the K format.
format_pair echokv_policy::pair_of_tier(size_t t) const {
  const format_id k = t < opt_.tiers.size() ? opt_.tiers[t] : format_pair{}.k;
  return {k, t < opt_.v_tiers.size() ? opt_.v_tiers[t] : k};
}

status echokv_policy::bind(const cache_shape& shape) {
  const auto bad = [](std::string m) { return status{errc::invalid_argument, "echokv: " + std::move(m)}; };
  const echokv_options& o = opt_;
  if (shape.layers <= 0 || shape.kv_heads <= 0 || shape.q_heads <= 0 || shape.q_heads % shape.kv_heads != 0)
    return bad(fmt::format("cache shape of {} layers, {} q heads, {} kv heads is not servable", shape.layers,
                           shape.q_heads, shape.kv_heads));
  if (o.tiers.empty() || o.tiers.size() > 255) return bad(fmt::format("needs 1 to 255 tiers, got {}", o.tiers.size()));
  if (!o.v_tiers.empty() && o.v_tiers.size() != o.tiers.size())
    return bad(fmt::format("{} V tier formats for {} tiers (give one per tier, or none for V = K)", o.v_tiers.size(),
                           o.tiers.size()));
  if (!(o.rate > 0.0 && o.rate <= 1.0)) return bad(fmt::format("rate {} must be in (0, 1]", o.rate));
  if (!(o.alpha > 0.0 && o.alpha <= 1.0)) return bad(fmt::format("alpha {} must be in (0, 1]", o.alpha));
  if (!(o.tau0 > 0.0 && std::isfinite(o.tau0))) return bad(fmt::format("tau0 {} must be finite and > 0", o.tau0));
  if (!(o.context0 > 0.0 && std::isfinite(o.context0)))
    return bad(fmt::format("context0 {} must be finite and > 0", o.context0));
  if (o.hysteresis_steps < 1) return bad(fmt::format("hysteresis_steps {} must be >= 1", o.hysteresis_steps));
  if (!(o.hysteresis_margin >= 0.0 && o.hysteresis_margin < 1.0))
    return bad(fmt::format("hysteresis_margin {} must be in [0, 1)", o.hysteresis_margin));
  if (o.initial_tier < -1 || o.initial_tier >= int(o.tiers.size()))
    return bad(fmt::format("initial_tier {} is not -1 or a tier index below {}", o.initial_tier, o.tiers.size()));
  if (!(o.softmax_scale >= 0.f && std::isfinite(o.softmax_scale)))
    return bad(fmt::format("softmax_scale {} must be finite and >= 0", o.softmax_scale));
  if (!(o.pid.max_log_scale > 0.0) || !std::isfinite(o.pid.kp) || !std::isfinite(o.pid.ki) ||
      !std::isfinite(o.pid.kd) || !std::isfinite(o.pid.deadband))
    return bad("pid gains must be finite and max_log_scale > 0");
  uint64_t prev_k_bytes = 0;
  align_ = 1;
  for (size_t t = 0; t < o.tiers.size(); ++t) {
    for (role r : {role::k, role::v}) {
      const format_id f = r == role::k ? o.tiers[t] : (o.v_tiers.empty() ? o.tiers[t] : o.v_tiers[t]);
      if (status s = check_shape(f, r, shape.page_tokens, shape.head_dim); !s.ok())
        return bad(fmt::format("tier {} {}: {}", t, role_name(r), s.message()));
    }
    const uint64_t kb = layout_of(traits_of(o.tiers[t]), role::k, shape.page_tokens, shape.head_dim).total();
    if (t > 0 && kb <= prev_k_bytes)
      return bad(
          fmt::format("tier {} ({}) does not store more K bytes than tier {} ({}); order tiers lowest precision "
                      "first",
                      t, format_name(o.tiers[t]), t - 1, format_name(o.tiers[t - 1])));
    prev_k_bytes = kb;
    align_ = std::lcm(align_, token_group(o.tiers[t]));
  }
  if (align_ > shape.window)
    return bad(fmt::format("token group {} of the tiers exceeds the window of {} tokens", align_, shape.window));

  shape_ = shape;
  const size_t T = o.tiers.size();
  const size_t U = o.granularity == echokv_granularity::per_layer ? size_t(shape.layers)
                                                                  : size_t(shape.layers) * size_t(shape.kv_heads);
  tier_bits_.resize(T);
  for (size_t t = 0; t < T; ++t) {
    const format_pair p = pair_of_tier(t);
    tier_bits_[t] = 0.5 * (bits_per_element(traits_of(p.k), role::k, shape.page_tokens, shape.head_dim) +
                           bits_per_element(traits_of(p.v), role::v, shape.page_tokens, shape.head_dim));
  }
  spec_ = {o.tiers, align_, o.softmax_scale > 0.f ? o.softmax_scale : 1.0f / std::sqrt(float(shape.head_dim)),
           o.granularity == echokv_granularity::per_head};
  tiers_.assign(U, uint8_t(o.initial_tier < 0 ? int(T) - 1 : o.initial_tier));
  agreed_ = tiers_;
  ema_.assign(U * T, std::numeric_limits<double>::quiet_NaN());
  streak_.assign(U * T, 0);
  counters_ = {};
  history_.clear();
  ctl_ = {};
  in_step_ = false;
  frozen_ = false;
  bound_ = true;
  return {};
}

format_pair echokv_policy::current(int layer, int kv_head) const {
  if (!bound_ || layer < 0 || layer >= shape_.layers || kv_head < 0 || kv_head >= shape_.kv_heads)
    return pair_of_tier(opt_.tiers.size() - 1);
  return pair_of_tier((agreement_ ? agreed_ : tiers_)[size_t(unit_of(layer, kv_head))]);
}

bool echokv_policy::is_canary(seq_id seq, int64_t context) const {
  if (opt_.rate >= 1.0) return true;
  const uint64_t h = splitmix64(splitmix64(splitmix64(opt_.seed) ^ uint64_t(seq)) ^ uint64_t(context));
  return double(h >> 11) * 0x1.0p-53 < opt_.rate;
}

void echokv_policy::observe(const query_observation& obs) {
  if (frozen_ || !bound_) return;
  ++counters_.observations;
  if (!is_canary(obs.seq, obs.context)) return;
  auto m = measure(obs);
  if (!m) {
    ++counters_.skipped;
    return;
  }
  (void)ingest(*m);  // a measurement from `measure` has the right shape and finite values
}

result<canary_measurement> echokv_policy::measure(const query_observation& o) const {
  if (!bound_) return status{errc::invalid_argument, "echokv: measure before bind"};
  const int H = shape_.kv_heads, Hq = shape_.q_heads, d = shape_.head_dim, R = shape_.window;
  if (o.layer < 0 || o.layer >= shape_.layers)
    return status{errc::invalid_argument, fmt::format("echokv: layer {} outside [0, {})", o.layer, shape_.layers)};
  if (!o.q || !o.window || o.q_len < 1 || o.context < o.q_len)
    return status{errc::invalid_argument,
                  fmt::format("echokv: observation of layer {} has no queries or window (q_len {}, context {})",
                              o.layer, o.q_len, o.context)};
  if (o.window_first < 0 || o.window_first > o.context || o.context - o.window_first > R)
    return status{errc::invalid_argument, fmt::format("echokv: window [{}, {}) does not fit a ring of {} tokens",
                                                      o.window_first, o.context, R)};
  // Whole groups aligned to token positions that are multiples of the largest token group.
  const int64_t G = align_;
  const canary_keys keys(G, o.window_first, o.context);
  const int64_t a = keys.first, b = keys.end;
  if (b - a < G)
    return status{errc::not_found, fmt::format("echokv: window [{}, {}) holds no whole group of {} tokens",
                                               o.window_first, o.context, G)};
  const int n = int(b - a);
  const size_t T = opt_.tiers.size();
  const float scale = spec_.softmax_scale;
  const size_t head_elems = size_t(n) * d;

  // K_ref per kv head: fp16 bits [H][n][d] (the codec's source layout) and as float; then the
  // quantization error K^ - K_ref per tier, [T][H][n][d] float.
  scratch_src_.resize(size_t(H) * head_elems);
  scratch_ref_.resize(size_t(H) * head_elems);
  for (int h = 0; h < H; ++h) {
    const uint16_t* ring = o.window + size_t(h) * 2 * R * d;  // role K of head h
    for (int j = 0; j < n; ++j)
      std::memcpy(&scratch_src_[size_t(h) * head_elems + size_t(j) * d], ring + size_t((a + j) % R) * d, size_t(d) * 2);
  }
  for (size_t i = 0; i < scratch_src_.size(); ++i) scratch_ref_[i] = half_to_float(scratch_src_[i]);
  scratch_err_.resize(T * size_t(H) * head_elems);
  for (size_t t = 0; t < T; ++t) {
    const codec::page_geom g = codec::make_geom(opt_.tiers[t], role::k, n, d);
    scratch_page_.resize(g.lay.total());
    for (int h = 0; h < H; ++h) {
      std::fill(scratch_page_.begin(), scratch_page_.end(), uint8_t(0));
      const uint16_t* src = &scratch_src_[size_t(h) * head_elems];
      const float* ref = &scratch_ref_[size_t(h) * head_elems];
      const uint8_t* page = scratch_page_.data();
      for (int u = 0; u < g.unit_count(); ++u) codec::encode_unit(g, src, d, u, scratch_page_.data(), codec::no_clip);
      float* err = &scratch_err_[(t * H + size_t(h)) * head_elems];
      if (g.k_columns() && g.fmt.bits != 3) {  // 3-bit codes are in two planes: decode_element below
        // NOTE: the per-element `decode_element` converts a scale and a zero for every element and
        // dominated the canary (about 2/3 of its time at d = 128); per-group conversion gives the
        // same floats: x = code * s + z, the codec's own arithmetic.
        const int G = g.fmt.group, bits = g.fmt.bits, rb = g.row_bytes();
        const uint16_t* s16 = reinterpret_cast<const uint16_t*>(page + g.lay.code_bytes);
        const uint16_t* z16 = reinterpret_cast<const uint16_t*>(page + g.lay.code_bytes + g.lay.scale_bytes);
        scratch_sz_.resize(2 * size_t(n / G) * d);
        float* sf = scratch_sz_.data();
        float* zf = sf + size_t(n / G) * d;
        for (size_t i = 0; i < size_t(n / G) * d; ++i) {
          sf[i] = half_to_float(s16[i]);
          zf[i] = half_to_float(z16[i]);
        }
        for (int j = 0; j < n; ++j) {
          const uint8_t* row = page + size_t(j) * rb;
          const float* sj = sf + size_t(j / G) * d;
          const float* zj = zf + size_t(j / G) * d;
          for (int c = 0; c < d; ++c)
            err[size_t(j) * d + c] = codec::add_rn(codec::mul_rn(float(codec::get_code(row, bits, c)), sj[c]), zj[c]) -
                                     ref[size_t(j) * d + c];
        }
      } else {
        for (int j = 0; j < n; ++j)
          for (int c = 0; c < d; ++c)
            err[size_t(j) * d + c] = codec::decode_element(g, page, j, c) - ref[size_t(j) * d + c];
      }
    }
  }

  // Per query row and head: p = softmax(z), z_j = s q.k_j; the quantized logits are z + D with
  // D_j = s q.(k^_j - k_j), so KL(p || softmax(z + D)) = log(sum_j p_j e^D_j) - sum_j p_j D_j,
  // computed as log1p(sum p expm1(D)) - sum p D: exact for D = 0 and free of the cancellation of
  // two log-sum-exps when D is small (8-bit tiers).
  const int per_layer = opt_.granularity == echokv_granularity::per_layer;
  const int unit_count = per_layer ? 1 : H;
  const int group = Hq / H;
  canary_measurement m{o.seq, o.layer, o.context, std::vector<double>(size_t(unit_count) * T, 0.0)};
  std::vector<int> samples(size_t(unit_count), 0);
  std::vector<double> p(static_cast<size_t>(n));
  for (int i = 0; i < o.q_len; ++i) {
    const int64_t pos = o.context - o.q_len + i;  // the last key this query may see
    const int visible = int(std::min<int64_t>(b, pos + 1) - a);
    if (visible <= 0) continue;
    for (int qh = 0; qh < Hq; ++qh) {
      const int h = qh / group, unit = per_layer ? 0 : h;
      const float* q = o.q + (size_t(i) * Hq + qh) * d;
      const float* ref = &scratch_ref_[size_t(h) * head_elems];
      double mx = -std::numeric_limits<double>::infinity();
      for (int j = 0; j < visible; ++j) {
        p[size_t(j)] = double(scale * dot(q, ref + size_t(j) * d, d));
        mx = std::max(mx, p[size_t(j)]);
      }
      double sum = 0.0;
      for (int j = 0; j < visible; ++j) sum += (p[size_t(j)] = std::exp(p[size_t(j)] - mx));
      for (int j = 0; j < visible; ++j) p[size_t(j)] /= sum;
      for (size_t t = 0; t < T; ++t) {
        const float* err = &scratch_err_[(t * H + size_t(h)) * head_elems];
        double e1 = 0.0, e2 = 0.0;
        for (int j = 0; j < visible; ++j) {
          const double dj = double(scale * dot(q, err + size_t(j) * d, d));
          e1 += p[size_t(j)] * std::expm1(dj);
          e2 += p[size_t(j)] * dj;
        }
        m.delta[size_t(unit) * T + t] += std::max(std::log1p(e1) - e2, 0.0);  // rounding can give -1e-17
      }
      ++samples[size_t(unit)];
    }
  }
  for (int u = 0; u < unit_count; ++u) {
    if (samples[size_t(u)] == 0)
      return status{errc::not_found, fmt::format("echokv: no query of layer {} sees a key of the window", o.layer)};
    for (size_t t = 0; t < T; ++t) m.delta[size_t(u) * T + t] /= samples[size_t(u)];
  }
  return m;
}

double echokv_policy::tau(int64_t context) const {
  return opt_.tau0 * std::sqrt(double(std::max<int64_t>(context, 1)) / opt_.context0) * std::exp(ctl_.log_scale);
}

double echokv_policy::average_bits() const {
  if (tiers_.empty()) return 0.0;
  double s = 0.0;
  for (uint8_t t : tiers_) s += tier_bits_[t];
  return s / double(tiers_.size());
}

double echokv_policy::projected_bits(int64_t context) const {
  if (tiers_.empty()) return 0.0;
  const size_t T = opt_.tiers.size();
  const double t_eff = tau(context), strict = t_eff * (1.0 - opt_.hysteresis_margin);
  double s = 0.0;
  for (size_t u = 0; u < tiers_.size(); ++u) {
    const double* e = &ema_[u * T];
    int settle = tiers_[u];
    if (!std::isnan(e[0])) {
      int want = int(T) - 1;
      for (size_t t = 0; t < T; ++t)
        if (e[t] < t_eff) {
          want = int(t);
          break;
        }
      if (want > settle) {
        settle = want;
      } else {
        for (int t = 0; t < settle; ++t)
          if (e[t] < strict) {
            settle = t;
            break;
          }
      }
    }
    s += tier_bits_[size_t(settle)];
  }
  return s / double(tiers_.size());
}

void echokv_policy::update_controller(int64_t context) {
  if (!ctl_.active) return;
  const echokv_pid& p = opt_.pid;
  double e = projected_bits(context) - ctl_.target_bits;
  if (std::abs(e) <= ctl_.deadband) e = 0.0;
  const double lim = p.max_log_scale;
  ctl_.integral = std::clamp(ctl_.integral + p.ki * e, -lim, lim);
  ctl_.log_scale = std::clamp(p.kp * e + ctl_.integral + p.kd * (e - ctl_.last_error), -lim, lim);
  ctl_.last_error = e;
}

void echokv_policy::decide(int unit, double tau) {
  const size_t T = opt_.tiers.size(), base = size_t(unit) * T;
  const double strict = tau * (1.0 - opt_.hysteresis_margin);
  int want = int(T) - 1;
  for (size_t t = 0; t < T; ++t)
    if (ema_[base + t] < tau) {
      want = int(t);
      break;
    }
  for (size_t t = 0; t < T; ++t) streak_[base + t] = ema_[base + t] < strict ? streak_[base + t] + 1 : 0;
  const int cur = tiers_[size_t(unit)];
  if (want > cur) {
    tiers_[size_t(unit)] = uint8_t(want);
    ++counters_.promotions;
  } else if (want < cur) {
    for (int t = 0; t < cur; ++t)
      if (streak_[base + size_t(t)] >= opt_.hysteresis_steps) {
        tiers_[size_t(unit)] = uint8_t(t);
        ++counters_.demotions;
        break;
      }
  }
}

status echokv_policy::ingest(const canary_measurement& m) {
  if (!bound_) return {errc::invalid_argument, "echokv: ingest before bind"};
  if (frozen_) return {};
  const size_t T = opt_.tiers.size();
  const int per_layer = opt_.granularity == echokv_granularity::per_layer;
  const size_t unit_count = per_layer ? 1 : size_t(shape_.kv_heads);
  if (m.layer < 0 || m.layer >= shape_.layers)
    return {errc::invalid_argument,
            fmt::format("echokv: measurement of layer {}, the cache has {}", m.layer, shape_.layers)};
  if (m.delta.size() != unit_count * T)
    return {errc::invalid_argument,
            fmt::format("echokv: measurement of layer {} has {} values, needs {} ({} units x {} "
                        "tiers)",
                        m.layer, m.delta.size(), unit_count * T, unit_count, T)};
  for (size_t i = 0; i < m.delta.size(); ++i)
    if (!std::isfinite(m.delta[i]) || m.delta[i] < 0.0)
      return {errc::invalid_argument,
              fmt::format("echokv: measurement of layer {} value {} is {}; must be finite and >= 0", m.layer, i,
                          m.delta[i])};
  if (m.context < 1) return {errc::invalid_argument, fmt::format("echokv: context {} must be >= 1", m.context)};

  if (!in_step_ || m.seq != step_seq_ || m.context != step_context_) {
    in_step_ = true;
    step_seq_ = m.seq;
    step_context_ = m.context;
    ++counters_.canary_steps;
    update_controller(m.context);
    history_.push_back({counters_.canary_steps, m.seq, m.context, 0.0, 0.0, {}});
    while (history_.size() > std::max<size_t>(opt_.max_history, 1)) history_.pop_front();
  }
  ++counters_.canary_evaluations;
  const double t_eff = tau(m.context);
  for (size_t u = 0; u < unit_count; ++u) {
    const int unit = per_layer ? m.layer : m.layer * shape_.kv_heads + int(u);
    for (size_t t = 0; t < T; ++t) {
      double& e = ema_[size_t(unit) * T + t];
      const double x = m.delta[u * T + t];
      e = std::isnan(e) ? x : (1.0 - opt_.alpha) * e + opt_.alpha * x;
    }
    decide(unit, t_eff);
  }
  echokv_history_entry& h = history_.back();
  h.tau = t_eff;
  h.average_bits = average_bits();
  h.tiers = tiers_;
  return {};
}

status echokv_policy::check_tiers(std::span<const uint8_t> tiers, const char* what) const {
  if (!bound_) return {errc::invalid_argument, fmt::format("echokv: {} before bind", what)};
  if (tiers.size() != tiers_.size())
    return {errc::invalid_argument,
            fmt::format("echokv: {} of {} tiers, the policy has {} units", what, tiers.size(), tiers_.size())};
  for (size_t u = 0; u < tiers.size(); ++u)
    if (tiers[u] >= opt_.tiers.size())
      return {errc::invalid_argument, fmt::format("echokv: {}: unit {} has tier {}, there are {} tiers", what, u,
                                                  int(tiers[u]), opt_.tiers.size())};
  return {};
}

status echokv_policy::restore(std::span<const uint8_t> tiers) {
  if (status s = check_tiers(tiers, "restore"); !s) return s;
  tiers_.assign(tiers.begin(), tiers.end());
  agreed_ = tiers_;
  std::fill(streak_.begin(), streak_.end(), 0);
  return {};
}

status echokv_policy::apply_agreed(std::span<const uint8_t> tiers) {
  if (status s = check_tiers(tiers, "apply_agreed"); !s) return s;
  tiers_.assign(tiers.begin(), tiers.end());
  agreed_ = tiers_;
  return {};
}

result<std::vector<uint8_t>> echokv_policy::majority_vote(std::span<const std::vector<uint8_t>> snapshots) {
  if (snapshots.empty()) return status{errc::invalid_argument, "echokv: majority vote of no snapshots"};
  const size_t U = snapshots[0].size();
  for (size_t i = 1; i < snapshots.size(); ++i)
    if (snapshots[i].size() != U)
      return status{
          errc::invalid_argument,
          fmt::format("echokv: majority vote: snapshot {} has {} units, snapshot 0 has {}", i, snapshots[i].size(), U)};
  std::vector<uint8_t> out(U);
  std::vector<int> votes(256);
  for (size_t u = 0; u < U; ++u) {
    std::fill(votes.begin(), votes.end(), 0);
    for (const auto& s : snapshots) ++votes[s[u]];
    int best = 0;
    for (int t = 1; t < 256; ++t)
      if (votes[size_t(t)] >= votes[size_t(best)]) best = t;  // >=: a tie goes to the higher tier
    out[u] = uint8_t(best);
  }
  return out;
}

status echokv_policy::set_target_bits(double bits) {
  if (!bound_) return {errc::invalid_argument, "echokv: set_target_bits before bind"};
  const double lo = tier_bits_.front(), hi = tier_bits_.back();
  if (!(bits >= lo - 1e-12 && bits <= hi + 1e-12))
    return {errc::invalid_argument,
            fmt::format("echokv: target {} bits is outside [{:.4f}, {:.4f}], the bits of the lowest and highest tiers",
                        bits, lo, hi)};
  const bool was_active = ctl_.active;
  ctl_.active = true;
  ctl_.target_bits = bits;
  if (opt_.pid.deadband >= 0.0) {
    ctl_.deadband = opt_.pid.deadband;
  } else {
    double step = 0.0;
    for (size_t t = 1; t < tier_bits_.size(); ++t) step = std::max(step, tier_bits_[t] - tier_bits_[t - 1]);
    ctl_.deadband = 0.5 * step / double(tiers_.size());
  }
  if (!was_active) {
    ctl_.integral = ctl_.log_scale = ctl_.last_error = 0.0;
  }
  return {};
}

void echokv_policy::clear_target() { ctl_ = {}; }

KVQ_NAMESPACE_END
