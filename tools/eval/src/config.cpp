#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <eval/config.hpp>
#include <kvq/calib/artifact.hpp>
#include <kvq/policy/autok.hpp>
#include <kvq/policy/echokv.hpp>
#include <kvq/policy/kl_budget.hpp>
#include <kvq/policy/random_policy.hpp>
#include <kvq/policy/sensitivity.hpp>
#include <kvq/policy/static_policy.hpp>
#include <map>

namespace kvq::eval {

namespace {

kvq::result<std::shared_ptr<kvq::policy>> make_static(std::string_view spec, const policy_target&) {
  auto p = kvq::static_policy::parse(spec);
  if (!p) return p.error();
  return std::shared_ptr<kvq::policy>(std::make_shared<kvq::static_policy>(std::move(p).value()));
}

// ---- parameters of the named policies: key=value pairs separated by ',' ---------------------------

using kvq::errc;
using kvq::status;

// Parsed `key=value,...`; `rest_key` (e.g. "like") takes everything after it, commas included, so
// it must come last. Flags without '=' get the value "". Errors name the bad clause.
struct params {
  std::map<std::string, std::string, std::less<>> kv;
  std::map<std::string, bool, std::less<>> used;

  static kvq::result<params> parse(std::string_view text, std::string_view rest_key = {}) {
    params p;
    while (!text.empty()) {
      if (!rest_key.empty() && text.starts_with(std::string(rest_key) + "=")) {
        p.kv[std::string(rest_key)] = std::string(text.substr(rest_key.size() + 1));
        break;
      }
      const size_t comma = text.find(',');
      const std::string_view clause = text.substr(0, comma);
      text = comma == std::string_view::npos ? std::string_view{} : text.substr(comma + 1);
      if (clause.empty()) return status{errc::invalid_argument, "empty parameter (two commas in a row?)"};
      const size_t eq = clause.find('=');
      const std::string key(clause.substr(0, eq));
      if (key.empty()) return status{errc::invalid_argument, fmt::format("parameter '{}' has no name", clause)};
      if (p.kv.count(key)) return status{errc::invalid_argument, fmt::format("parameter '{}' given twice", key)};
      p.kv[key] = eq == std::string_view::npos ? std::string() : std::string(clause.substr(eq + 1));
    }
    return p;
  }
  bool has(std::string_view k) const { return kv.find(k) != kv.end(); }
  // The value of `k`, or nullptr; marks it used.
  const std::string* get(std::string_view k) {
    const auto it = kv.find(k);
    if (it == kv.end()) return nullptr;
    used[it->first] = true;
    return &it->second;
  }
  kvq::result<std::string> required(std::string_view k) {
    const std::string* v = get(k);
    if (!v || v->empty()) return status{errc::invalid_argument, fmt::format("parameter '{}=' is required", k)};
    return *v;
  }
  kvq::result<double> number(std::string_view k, double fallback) {
    const std::string* v = get(k);
    if (!v) return fallback;
    double x = 0;
    const auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), x);
    if (ec != std::errc() || end != v->data() + v->size() || !std::isfinite(x))
      return status{errc::invalid_argument, fmt::format("parameter '{}={}' is not a number", k, *v)};
    return x;
  }
  kvq::result<uint64_t> unsigned_int(std::string_view k, uint64_t fallback) {
    const std::string* v = get(k);
    if (!v) return fallback;
    uint64_t x = 0;
    const auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), x);
    if (ec != std::errc() || end != v->data() + v->size() || v->empty())
      return status{errc::invalid_argument, fmt::format("parameter '{}={}' is not a non-negative integer", k, *v)};
    return x;
  }
  // Every parameter given must have been read: a typo is an error, not a silent default.
  status check_all_used(std::string_view known) const {
    for (const auto& [k, v] : kv)
      if (!used.count(k))
        return status{errc::invalid_argument, fmt::format("unknown parameter '{}' (known: {})", k, known)};
    return {};
  }
};

#define KVQ_EVAL_ASSIGN(var, expr)      \
  auto var##_r = (expr);                \
  if (!var##_r) return var##_r.error(); \
  auto var = std::move(var##_r).value()

kvq::result<kvq::calib::artifact> load_artifact_file(const std::string& path, const kvq::cache_shape& shape) {
  return kvq::calib::artifact::load(path, {shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim});
}

/// The artifact named by `artifact=`, its damages those of the target's heads: for a rotated
/// cache the rotated ones, moved into `sensitivity` (an artifact without them, or measured with
/// another rotation seed than the caches', is refused).
kvq::result<kvq::calib::artifact> load_artifact(params& p, const policy_target& target) {
  KVQ_EVAL_ASSIGN(path, p.required("artifact"));
  KVQ_EVAL_ASSIGN(art, load_artifact_file(path, target.shape));
  if (!target.rotated) return art;
  if (!art.has_rotated())
    return status{errc::invalid_argument,
                  fmt::format("artifact '{}' holds no rotated damages, which a rotated configuration reads "
                              "(kvq-calibrate --rotated writes them)",
                              path)};
  if (art.rotation_seed != kvq::rotation::default_seed)
    return status{errc::invalid_argument,
                  fmt::format("artifact '{}': its rotated damages were measured with rotation seed {}, kvq-eval's "
                              "caches use {}",
                              path, art.rotation_seed, kvq::rotation::default_seed)};
  art.sensitivity = std::move(art.rotated_sensitivity);
  return art;
}

kvq::result<std::shared_ptr<kvq::policy>> make_kl_budget(std::string_view text, const policy_target& target) {
  KVQ_EVAL_ASSIGN(p, params::parse(text));
  kvq::kl_budget_options opt;
  if (p.has("bits") == p.has("kl"))
    return status{errc::invalid_argument, "give exactly one of 'bits=<average bits>' and 'kl=<damage budget>'"};
  if (p.has("bits")) {
    opt.objective = kvq::kl_objective::bits_target;
    KVQ_EVAL_ASSIGN(b, p.number("bits", 0));
    opt.value = b;
  } else {
    opt.objective = kvq::kl_objective::kl_budget;
    KVQ_EVAL_ASSIGN(k, p.number("kl", 0));
    opt.value = k;
  }
  KVQ_EVAL_ASSIGN(vw, p.number("v_weight", 1.0));
  opt.v_weight = vw;
  KVQ_EVAL_ASSIGN(art, load_artifact(p, target));
  KVQ_TRY(p.check_all_used("bits, kl, artifact, v_weight"));
  return std::shared_ptr<kvq::policy>(std::make_shared<kvq::kl_budget_policy>(std::move(art.sensitivity), opt));
}

kvq::result<std::shared_ptr<kvq::policy>> make_autok(std::string_view text, const policy_target& target) {
  KVQ_EVAL_ASSIGN(p, params::parse(text));
  kvq::autok_options opt;
  KVQ_EVAL_ASSIGN(phi, p.number("phi", 0.5));
  opt.phi = phi;
  KVQ_EVAL_ASSIGN(high, p.required("high"));
  KVQ_EVAL_ASSIGN(low, p.required("low"));
  auto hf = kvq::parse_format(high);
  if (!hf) return status{hf.error().code(), "high=" + high + ": " + hf.error().message()};
  auto lf = kvq::parse_format(low);
  if (!lf) return status{lf.error().code(), "low=" + low + ": " + lf.error().message()};
  opt.high = {*hf, *hf};
  opt.low = {*lf, *lf};
  kvq::format_id ref = *lf;
  if (const std::string* r = p.get("ref")) {
    auto rf = kvq::parse_format(*r);
    if (!rf) return status{rf.error().code(), "ref=" + *r + ": " + rf.error().message()};
    ref = *rf;
  }
  KVQ_EVAL_ASSIGN(vw, p.number("v_weight", 1.0));
  KVQ_EVAL_ASSIGN(art, load_artifact(p, target));
  KVQ_TRY(p.check_all_used("phi, high, low, ref, v_weight, artifact"));
  auto layers = art.sensitivity.per_layer(ref, vw);
  if (!layers) return layers.error();
  auto pol = kvq::autok_policy::create(std::move(layers).value(), opt);
  if (!pol) return pol.error();
  return std::shared_ptr<kvq::policy>(std::make_shared<kvq::autok_policy>(std::move(pol).value()));
}

kvq::result<std::shared_ptr<kvq::policy>> make_random(std::string_view text, const policy_target& target) {
  KVQ_EVAL_ASSIGN(p, params::parse(text, "like"));
  KVQ_EVAL_ASSIGN(seed, p.unsigned_int("seed", 0));
  KVQ_EVAL_ASSIGN(like, p.required("like"));
  KVQ_TRY(p.check_all_used("seed, like (last)"));
  auto inner = make_policy(like, target.shape, target.rotated);
  if (!inner) return inner.error();
  if (status s = (*inner)->bind(target.shape); !s.ok())
    return status{s.code(), fmt::format("like={}: {}", like, s.message())};
  const kvq::format_map map = kvq::format_map::of(**inner, target.shape.layers, target.shape.kv_heads);
  auto pol = kvq::random_policy::create(map, seed);
  if (!pol) return pol.error();
  return std::shared_ptr<kvq::policy>(std::make_shared<kvq::random_policy>(std::move(pol).value()));
}

kvq::result<std::shared_ptr<kvq::policy>> make_echokv(std::string_view text, const policy_target&) {
  KVQ_EVAL_ASSIGN(p, params::parse(text));
  kvq::echokv_options opt;
  KVQ_EVAL_ASSIGN(seed, p.unsigned_int("seed", 0));
  opt.seed = seed;
  KVQ_EVAL_ASSIGN(k, p.unsigned_int("hysteresis", uint64_t(opt.hysteresis_steps)));
  if (k < 1 || k > 1000) return status{errc::invalid_argument, fmt::format("hysteresis={} must be in [1, 1000]", k)};
  opt.hysteresis_steps = int(k);
  // hysteresis=1 without a margin is the original rule (no hysteresis at all)
  KVQ_EVAL_ASSIGN(h, p.number("margin", k == 1 ? 0.0 : opt.hysteresis_margin));
  opt.hysteresis_margin = h;
  KVQ_EVAL_ASSIGN(rate, p.number("rate", opt.rate));
  opt.rate = rate;
  KVQ_EVAL_ASSIGN(tau0, p.number("tau0", opt.tau0));
  opt.tau0 = tau0;
  KVQ_EVAL_ASSIGN(alpha, p.number("alpha", opt.alpha));
  opt.alpha = alpha;
  if (p.get("per_head")) opt.granularity = kvq::echokv_granularity::per_head;
  if (const std::string* t = p.get("tiers")) {
    opt.tiers.clear();
    std::string_view rest = *t;
    while (!rest.empty()) {
      const size_t bar = rest.find('|');
      const std::string_view one = rest.substr(0, bar);
      auto f = kvq::parse_format(one);
      if (!f) return status{f.error().code(), fmt::format("tiers: '{}': {}", one, f.error().message())};
      opt.tiers.push_back(*f);
      rest = bar == std::string_view::npos ? std::string_view{} : rest.substr(bar + 1);
    }
  }
  // init=low|mid|high or a tier index (0 = lowest): the tier every unit starts in; default the highest
  if (const std::string* v = p.get("init")) {
    const int n = int(opt.tiers.size());
    if (*v == "low") {
      opt.initial_tier = 0;
    } else if (*v == "mid") {
      opt.initial_tier = (n - 1) / 2;
    } else if (*v == "high") {
      opt.initial_tier = n - 1;
    } else {
      auto t = p.unsigned_int("init", 0);
      if (!t || *t >= uint64_t(n))
        return status{errc::invalid_argument,
                      fmt::format("parameter 'init={}' is not low, mid, high or a tier index in [0, {}]", *v, n - 1)};
      opt.initial_tier = int(*t);
    }
  }
  const std::string* target = p.get("target_bits");
  double target_bits = 0;
  if (target) {
    KVQ_EVAL_ASSIGN(b, p.number("target_bits", 0));
    target_bits = b;
  }
  KVQ_TRY(p.check_all_used("seed, hysteresis, margin, rate, tau0, alpha, per_head, tiers, init, target_bits"));
  if (!target) return std::shared_ptr<kvq::policy>(std::make_shared<kvq::echokv_policy>(opt));
  // Budget mode needs a bound policy; KVCache::create binds again, which resets the target, so
  // the target is applied by a thin wrapper at bind time.
  struct targeted final : kvq::policy {
    kvq::echokv_policy inner;
    double bits;
    targeted(kvq::echokv_options o, double b) : inner(std::move(o)), bits(b) {}
    std::string name() const override { return inner.name() + fmt::format("[target_bits={}]", bits); }
    status bind(const kvq::cache_shape& s) override {
      KVQ_TRY(inner.bind(s));
      return inner.set_target_bits(bits);
    }
    kvq::format_id choose(const kvq::page_request& r) override { return inner.choose(r); }
    kvq::format_pair current(int l, int h) const override { return inner.current(l, h); }
    bool wants_queries() const override { return true; }
    void observe(const kvq::query_observation& o) override { inner.observe(o); }
    // the device canary (CUDA backend) is EchoKV's own protocol
    kvq::canary_protocol* canary() override { return &inner; }
  };
  return std::shared_ptr<kvq::policy>(std::make_shared<targeted>(opt, target_bits));
}

std::string known_names() {
  std::string s;
  for (const auto& e : policy_registry()) s += (s.empty() ? "" : ", ") + e.name;
  return s;
}

}  // namespace

const std::vector<policy_entry>& policy_registry() {
  // NOTE: one entry per policy; adaptive policies (autok, kl_budget, random, echokv) are added here.
  static const std::vector<policy_entry> registry = {
      {"static", "static:<format spec>",
       "one format pair for all (layer, kv head), optional per-layer / per-head overrides, e.g. "
       "static:k=kivi4/g32,v=kivi2/g32;0=fp16 (a bare spec means the same)",
       make_static},
      {"kl_budget", "kl_budget:bits=B|kl=K,artifact=PATH[,v_weight=W]",
       "per-(layer, kv head) greedy over the artifact's damage per byte: least damage at <= B average bits, or fewest "
       "bytes with summed damage <= K (V damage weighted by W, default 1)",
       make_kl_budget},
      {"autok", "autok:phi=F,high=FMT,low=FMT,artifact=PATH[,ref=FMT][,v_weight=W]",
       "protect the fewest layers holding a share F of the per-layer sensitivity (the artifact's damage of ref, "
       "default low, summed over heads, K + W*V) with high; the rest low (one format for K and V)",
       make_autok},
      {"random", "random:seed=N,like=CONFIG",
       "the formats of another configuration (any of these, e.g. like=kl_budget:bits=4,artifact=a.json) placed "
       "at random over (layer, kv head): the same bytes; like= takes the rest of the string, so it comes last",
       make_random},
      {"echokv",
       "echokv:seed=N[,hysteresis=K][,margin=H][,rate=R][,tau0=T][,alpha=A][,per_head][,tiers=F|F|F][,init=I]"
       "[,target_bits=B]",
       "online canary KL per layer (or per kv head) on live queries; tiers kivi2|kivi4|kivi8 /g32 by default; "
       "hysteresis=K demotes after K canaries below tau*(1-H) (default K=3, H=0.1; hysteresis=1 alone = none); "
       "rate default 1/64; init=low|mid|high or a tier index (0 = lowest) is the starting tier (default high); "
       "target_bits turns on the budget (PID) mode",
       make_echokv},
  };
  return registry;
}

kvq::result<std::shared_ptr<kvq::policy>> make_policy(std::string_view name_and_params, const kvq::cache_shape& shape,
                                                      bool rotated) {
  if (name_and_params.empty())
    return kvq::status{kvq::errc::invalid_argument,
                       "empty configuration (expected a format spec or <policy>:<params>)"};
  const size_t colon = name_and_params.find(':');
  const policy_entry* entry = nullptr;
  std::string_view params = name_and_params;
  if (colon != std::string_view::npos) {
    const std::string_view name = name_and_params.substr(0, colon);
    for (const auto& e : policy_registry())
      if (e.name == name) entry = &e;
    if (!entry)
      return kvq::status{kvq::errc::invalid_argument,
                         fmt::format("configuration '{}': unknown policy '{}' (known: {}; or a bare format spec)",
                                     name_and_params, name, known_names())};
    params = name_and_params.substr(colon + 1);
  } else {
    entry = &policy_registry().front();  // a bare spec is a static policy
  }
  auto p = entry->make(params, policy_target{shape, rotated});
  if (!p)
    return kvq::status{p.error().code(), fmt::format("configuration '{}': {}", name_and_params, p.error().message())};
  return p;
}

kvq::result<std::vector<float>> load_clip_ratios(const std::string& path, const kvq::cache_shape& shape) {
  auto a = load_artifact_file(path, shape);
  if (!a) return a.error();
  return std::move(a).value().clip_ratios;
}

kvq::result<std::vector<kvq::calib::codebook_fit>> load_codebook_levels(const std::string& path,
                                                                        const kvq::cache_shape& shape) {
  auto a = load_artifact_file(path, shape);
  if (!a) return a.error();
  if (a->codebooks.empty())
    return kvq::status{kvq::errc::not_found,
                       fmt::format("artifact '{}' holds no codebook levels (kvq-calibrate --fit-codebooks)", path)};
  return std::move(a).value().codebooks;
}

namespace {
kvq::cache_shape with_paging(kvq::cache_shape shape, const cache_settings& s) {
  shape.page_tokens = s.page_tokens;
  shape.window = s.window;
  shape.recent = s.recent;
  return shape;
}
}  // namespace

kvq::cache_shape eval_shape(const kvq::llama::llama_model& model, const cache_settings& s) {
  return with_paging(model.cache_shape(), s);
}

uint64_t fp16_bytes(const kvq::cache_shape& shape, int64_t tokens) {
  return uint64_t(tokens) * uint64_t(shape.layers) * uint64_t(shape.kv_heads) * uint64_t(shape.head_dim) * 2u * 2u;
}

kvq::result<kvq::KVCache> make_eval_cache(const kvq::llama::llama_model& model, std::string_view config,
                                          const cache_settings& s) {
  return make_eval_cache(model.cache_shape(), config, s);
}

namespace {

/// True when a policy spec names a rolealign format (`ra<b>`, alone or after '=', ',', ':' or ';').
bool names_rolealign(std::string_view spec) {
  for (size_t i = spec.find("ra"); i != std::string_view::npos; i = spec.find("ra", i + 1)) {
    const bool starts = i == 0 || std::string_view("=,:;").find(spec[i - 1]) != std::string_view::npos;
    if (starts && i + 2 < spec.size() && spec[i + 2] >= '0' && spec[i + 2] <= '9') return true;
  }
  return false;
}

}  // namespace

kvq::result<kvq::KVCache> make_eval_cache(const kvq::cache_shape& model_shape, std::string_view config,
                                          const cache_settings& s) {
  const kvq::cache_shape shape = with_paging(model_shape, s);
  auto suffixes = kvq::parse_cache_suffixes(config);
  if (!suffixes) return suffixes.error();
  const bool rotated = suffixes->rotated;
  const std::string_view spec = suffixes->spec;
  if (rotated && !s.clip_ratios.empty() && names_rolealign(spec))
    return kvq::status{kvq::errc::invalid_argument,
                       fmt::format("configuration '{}': the clip ratios were calibrated on unrotated heads; run the "
                                   "rotated rolealign configuration without --clip-ratios",
                                   config)};
  auto pol = make_policy(spec, shape, rotated);
  if (!pol) return pol.error();
  kvq::cache_config cfg;
  cfg.shape = shape;
  suffixes->apply(cfg);
  cfg.where = kvq::backend::cpu;
  cfg.budget_bytes = s.budget_bytes;
  if (cfg.budget_bytes == 0) {
    // Every token in FP16 (the largest format) rounded up to whole pages, plus the windows, twice
    // over for the 256-byte block alignment of small pages.
    const int64_t tokens = (s.max_tokens / s.page_tokens + 2) * s.page_tokens;
    const uint64_t window = uint64_t(shape.layers) * shape.kv_heads * 2u * uint64_t(s.window) * shape.head_dim * 2u;
    cfg.budget_bytes = 2 * (fp16_bytes(shape, tokens) + window) + (16u << 20);
  }
  auto cache = kvq::KVCache::create(cfg, std::move(pol).value());
  if (!cache)
    return kvq::status{cache.error().code(), fmt::format("configuration '{}': {}", config, cache.error().message())};
  if (!s.clip_ratios.empty())
    if (kvq::status st = cache.value().set_clip_ratios(s.clip_ratios); !st.ok())
      return kvq::status{st.code(), fmt::format("configuration '{}': {}", config, st.message())};
  if (!s.codebooks.empty()) {
    kvq::calib::artifact fits;  // only its shape and codebooks are read
    fits.shape = {shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim};
    fits.codebooks = s.codebooks;
    for (const kvq::calib::codebook_fit& c : s.codebooks) {
      auto lv = fits.codebook_levels_for(c.format, cfg.rotation.heads);
      kvq::status st = lv ? cache.value().set_codebook_levels(c.format, *lv) : lv.error();
      if (!st.ok()) return kvq::status{st.code(), fmt::format("configuration '{}': {}", config, st.message())};
    }
  }
  return cache;
}

bool is_fp16_reference(std::string_view config) {
  std::string_view spec = config;
  if (spec.starts_with("static:")) spec.remove_prefix(7);
  auto p = kvq::static_policy::parse(spec);
  return p.ok() && p->name() == "static(fp16)";
}

}  // namespace kvq::eval
