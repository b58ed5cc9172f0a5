#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <kvq/calib/artifact.hpp>
#include <kvq/policy/autok.hpp>
#include <kvq/policy/echokv.hpp>
#include <kvq/policy/kl_budget.hpp>
#include <kvq/policy/random_policy.hpp>
#include <kvq/policy/registry.hpp>
#include <kvq/policy/sensitivity.hpp>
#include <kvq/policy/static_policy.hpp>
#include <map>

KVQ_NAMESPACE_BEGIN

namespace {

result<std::shared_ptr<policy>> make_static(std::string_view spec, const policy_target&) {
  auto p = static_policy::parse(spec);
  if (!p) return p.error();
  return std::shared_ptr<policy>(std::make_shared<static_policy>(std::move(p).value()));
}

// ---- parameters of the named policies: key=value pairs separated by ',' ---------------------------


// Parsed `key=value,...`; `rest_key` (e.g. "like") takes everything after it, commas included, so
// it must come last. Flags without '=' get the value "". Errors name the bad clause.
struct params {
  std::map<std::string, std::string, std::less<>> kv;
  std::map<std::string, bool, std::less<>> used;

  static result<params> parse(std::string_view text, std::string_view rest_key = {}) {
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
  result<std::string> required(std::string_view k) {
    const std::string* v = get(k);
    if (!v || v->empty()) return status{errc::invalid_argument, fmt::format("parameter '{}=' is required", k)};
    return *v;
  }
  result<double> number(std::string_view k, double fallback) {
    const std::string* v = get(k);
    if (!v) return fallback;
    double x = 0;
    const auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), x);
    if (ec != std::errc() || end != v->data() + v->size() || !std::isfinite(x))
      return status{errc::invalid_argument, fmt::format("parameter '{}={}' is not a number", k, *v)};
    return x;
  }
  result<uint64_t> unsigned_int(std::string_view k, uint64_t fallback) {
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

#define KVQ_POLICY_ASSIGN(var, expr)      \
  auto var##_r = (expr);                \
  if (!var##_r) return var##_r.error(); \
  auto var = std::move(var##_r).value()

result<calib::artifact> load_artifact_file(const std::string& path, const cache_shape& shape) {
  return calib::artifact::load(path, {shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim});
}

/// The artifact named by `artifact=`, its damages those of the target's heads: for a rotated
/// cache the rotated ones, moved into `sensitivity` (an artifact without them, or measured with
/// another rotation seed than the caches', is refused).
result<calib::artifact> load_artifact(params& p, const policy_target& target) {
  KVQ_POLICY_ASSIGN(path, p.required("artifact"));
  KVQ_POLICY_ASSIGN(art, load_artifact_file(path, target.shape));
  if (!target.rotated) return art;
  if (!art.has_rotated())
    return status{errc::invalid_argument,
                  fmt::format("artifact '{}' holds no rotated damages, which a rotated configuration reads "
                              "(kvq-calibrate --rotated writes them)",
                              path)};
  if (art.rotation_seed != rotation::default_seed)
    return status{errc::invalid_argument,
                  fmt::format("artifact '{}': its rotated damages were measured with rotation seed {}, '+rot' "
                              "rotates with seed {}",
                              path, art.rotation_seed, rotation::default_seed)};
  art.sensitivity = std::move(art.rotated_sensitivity);
  return art;
}

result<std::shared_ptr<policy>> make_kl_budget(std::string_view text, const policy_target& target) {
  KVQ_POLICY_ASSIGN(p, params::parse(text));
  kl_budget_options opt;
  if (p.has("bits") == p.has("kl"))
    return status{errc::invalid_argument, "give exactly one of 'bits=<average bits>' and 'kl=<damage budget>'"};
  if (p.has("bits")) {
    opt.objective = kl_objective::bits_target;
    KVQ_POLICY_ASSIGN(b, p.number("bits", 0));
    opt.value = b;
  } else {
    opt.objective = kl_objective::kl_budget;
    KVQ_POLICY_ASSIGN(k, p.number("kl", 0));
    opt.value = k;
  }
  KVQ_POLICY_ASSIGN(vw, p.number("v_weight", 1.0));
  opt.v_weight = vw;
  KVQ_POLICY_ASSIGN(art, load_artifact(p, target));
  KVQ_TRY(p.check_all_used("bits, kl, artifact, v_weight"));
  return std::shared_ptr<policy>(std::make_shared<kl_budget_policy>(std::move(art.sensitivity), opt));
}

result<std::shared_ptr<policy>> make_autok(std::string_view text, const policy_target& target) {
  KVQ_POLICY_ASSIGN(p, params::parse(text));
  autok_options opt;
  KVQ_POLICY_ASSIGN(phi, p.number("phi", 0.5));
  opt.phi = phi;
  KVQ_POLICY_ASSIGN(high, p.required("high"));
  KVQ_POLICY_ASSIGN(low, p.required("low"));
  auto hf = parse_format(high);
  if (!hf) return status{hf.error().code(), "high=" + high + ": " + hf.error().message()};
  auto lf = parse_format(low);
  if (!lf) return status{lf.error().code(), "low=" + low + ": " + lf.error().message()};
  opt.high = {*hf, *hf};
  opt.low = {*lf, *lf};
  format_id ref = *lf;
  if (const std::string* r = p.get("ref")) {
    auto rf = parse_format(*r);
    if (!rf) return status{rf.error().code(), "ref=" + *r + ": " + rf.error().message()};
    ref = *rf;
  }
  KVQ_POLICY_ASSIGN(vw, p.number("v_weight", 1.0));
  KVQ_POLICY_ASSIGN(art, load_artifact(p, target));
  KVQ_TRY(p.check_all_used("phi, high, low, ref, v_weight, artifact"));
  auto layers = art.sensitivity.per_layer(ref, vw);
  if (!layers) return layers.error();
  auto pol = autok_policy::create(std::move(layers).value(), opt);
  if (!pol) return pol.error();
  return std::shared_ptr<policy>(std::make_shared<autok_policy>(std::move(pol).value()));
}

result<std::shared_ptr<policy>> make_random(std::string_view text, const policy_target& target) {
  KVQ_POLICY_ASSIGN(p, params::parse(text, "like"));
  KVQ_POLICY_ASSIGN(seed, p.unsigned_int("seed", 0));
  KVQ_POLICY_ASSIGN(like, p.required("like"));
  KVQ_TRY(p.check_all_used("seed, like (last)"));
  auto inner = make_policy(like, target.shape, target.rotated);
  if (!inner) return inner.error();
  if (status s = (*inner)->bind(target.shape); !s.ok())
    return status{s.code(), fmt::format("like={}: {}", like, s.message())};
  const format_map map = format_map::of(**inner, target.shape.layers, target.shape.kv_heads);
  auto pol = random_policy::create(map, seed);
  if (!pol) return pol.error();
  return std::shared_ptr<policy>(std::make_shared<random_policy>(std::move(pol).value()));
}

result<std::shared_ptr<policy>> make_echokv(std::string_view text, const policy_target&) {
  KVQ_POLICY_ASSIGN(p, params::parse(text));
  echokv_options opt;
  KVQ_POLICY_ASSIGN(seed, p.unsigned_int("seed", 0));
  opt.seed = seed;
  KVQ_POLICY_ASSIGN(k, p.unsigned_int("hysteresis", uint64_t(opt.hysteresis_steps)));
  if (k < 1 || k > 1000) return status{errc::invalid_argument, fmt::format("hysteresis={} must be in [1, 1000]", k)};
  opt.hysteresis_steps = int(k);
  // hysteresis=1 without a margin is the original rule (no hysteresis at all)
  KVQ_POLICY_ASSIGN(h, p.number("margin", k == 1 ? 0.0 : opt.hysteresis_margin));
  opt.hysteresis_margin = h;
  KVQ_POLICY_ASSIGN(rate, p.number("rate", opt.rate));
  opt.rate = rate;
  KVQ_POLICY_ASSIGN(tau0, p.number("tau0", opt.tau0));
  opt.tau0 = tau0;
  KVQ_POLICY_ASSIGN(alpha, p.number("alpha", opt.alpha));
  opt.alpha = alpha;
  if (p.get("per_head")) opt.granularity = echokv_granularity::per_head;
  if (const std::string* t = p.get("tiers")) {
    opt.tiers.clear();
    std::string_view rest = *t;
    while (!rest.empty()) {
      const size_t bar = rest.find('|');
      const std::string_view one = rest.substr(0, bar);
      auto f = parse_format(one);
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
    KVQ_POLICY_ASSIGN(b, p.number("target_bits", 0));
    target_bits = b;
  }
  KVQ_TRY(p.check_all_used("seed, hysteresis, margin, rate, tau0, alpha, per_head, tiers, init, target_bits"));
  if (!target) return std::shared_ptr<policy>(std::make_shared<echokv_policy>(opt));
  // Budget mode needs a bound policy; KVCache::create binds again, which resets the target, so
  // the target is applied by a thin wrapper at bind time.
  struct targeted final : policy {
    echokv_policy inner;
    double bits;
    targeted(echokv_options o, double b) : inner(std::move(o)), bits(b) {}
    std::string name() const override { return inner.name() + fmt::format("[target_bits={}]", bits); }
    status bind(const cache_shape& s) override {
      KVQ_TRY(inner.bind(s));
      return inner.set_target_bits(bits);
    }
    format_id choose(const page_request& r) override { return inner.choose(r); }
    format_pair current(int l, int h) const override { return inner.current(l, h); }
    bool wants_queries() const override { return true; }
    void observe(const query_observation& o) override { inner.observe(o); }
    // the device canary (CUDA backend) is EchoKV's own protocol
    canary_protocol* canary() override { return &inner; }
  };
  return std::shared_ptr<policy>(std::make_shared<targeted>(opt, target_bits));
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

result<std::shared_ptr<policy>> make_policy(std::string_view name_and_params, const cache_shape& shape,
                                                      bool rotated) {
  if (name_and_params.empty())
    return status{errc::invalid_argument,
                       "empty configuration (expected a format spec or <policy>:<params>)"};
  const size_t colon = name_and_params.find(':');
  const policy_entry* entry = nullptr;
  std::string_view params = name_and_params;
  if (colon != std::string_view::npos) {
    const std::string_view name = name_and_params.substr(0, colon);
    for (const auto& e : policy_registry())
      if (e.name == name) entry = &e;
    if (!entry)
      return status{errc::invalid_argument,
                         fmt::format("configuration '{}': unknown policy '{}' (known: {}; or a bare format spec)",
                                     name_and_params, name, known_names())};
    params = name_and_params.substr(colon + 1);
  } else {
    entry = &policy_registry().front();  // a bare spec is a static policy
  }
  auto p = entry->make(params, policy_target{shape, rotated});
  if (!p)
    return status{p.error().code(), fmt::format("configuration '{}': {}", name_and_params, p.error().message())};
  return p;
}

KVQ_NAMESPACE_END
