#pragma once
/// \file
/// `echokv` policy: the online closed loop (docs/architecture.md, "Policies"). While the model generates,
/// it measures the attention KL that quantizing the keys would cause on live queries and moves
/// each layer's (or each kv head's) tier up or down.
///
/// **Canary.** A step of a sequence is a canary with probability `rate`, decided by a
/// counter-based RNG: splitmix64 of (seed, sequence id, context length). The decision is
/// deterministic for a seed, independent of call order and batching, and the same for every
/// layer of one step (all layers of a step share its context length). On a canary, for every
/// tier t (K format f_t, lowest precision first; by default kivi2/g32, kivi4/g32, kivi8/g32):
///
///     δ(u, t) = mean over queries q of  KL( softmax(q·K_ref/√d) ‖ softmax(q·f_t(K_ref)/√d) )
///
/// where K_ref is the FP16 recent window of K, cut to whole token groups aligned to multiples of
/// the largest token group of the tiers (as pages are); f_t(K_ref) is K_ref encoded and decoded
/// with the codec of f_t (`kvq::codec`) on a page-shaped scratch buffer; the KL sums over the
/// keys each query may see (causal within a step of q_len > 1); the mean runs over the query
/// rows of the step and over the query heads of unit u: all heads of the layer in per-layer
/// mode, the heads of one GQA group (query head h reads kv head h / (Hq/Hkv)) in per-head mode.
///
/// **Decision.** EMA_t ← (1-α)·EMA_t + α·δ_t (α = 0.1; the first measurement initializes the
/// EMA). τ(L) = τ0·sqrt(L/L0) (τ0 = 0.022, L0 = 4096, L = the step's context length), times
/// exp(c) where c is the budget controller's output (0 without a target). The wanted tier is the
/// lowest t with EMA_t < τ, else the highest. A higher wanted tier is taken at once (promotion).
/// A lower one only with hysteresis: the unit moves down to the lowest tier t below its own whose
/// EMA_t has been below τ·(1-h) for k consecutive canaries of the unit (demotion). With k = 1 and
/// h = 0 this is the original rule.
///
/// **Budget mode** (the design card's "PID"): `set_target_bits` makes a PID controller adjust
/// log τ so that the average bits per element of the chosen tiers (K and V pages, scales and
/// zeros included, averaged over units) tracks the target; see `echokv_pid` for the loop and how
/// its gains were chosen.
///
/// **Forward-only.** The policy only answers `choose` for new pages; stored pages keep the
/// format they were written in (temporal striping).
///
/// **Device canary** (`canary_protocol`). `device_canary` describes the same measurement for a backend that runs it
/// itself (the CUDA backend: a kernel over the device ring, results ingested a step or more
/// later, in step order); `canary_due`, `note_observation`, `note_skipped` and `ingest` keep the
/// counters and state exactly as `observe` does on the host.
///
/// Thread-safety: none. `observe`, `ingest` and the setters mutate state; call them from the
/// thread that drives the cache. One instance serves one cache.

#include <kvq/policy/policy.hpp>

#include <cstdint>
#include <deque>
#include <limits>
#include <span>
#include <vector>

KVQ_NAMESPACE_BEGIN

/// Whether EchoKV decides per layer or per (layer, kv head).
enum class echokv_granularity : uint8_t {
  per_layer,  ///< one tier per layer; δ averaged over all query heads of the layer
  per_head,   ///< one tier per (layer, kv head); δ averaged over the query heads of its GQA group
};

/// The budget controller: a PID on log τ driven by the error in average bits.
///
/// At the start of each canary step n, with e_n = projected_bits − target (positive: too many
/// bits, so τ must grow), set to 0 inside the deadband:
///
///     I_n = clamp(I_{n-1} + ki·e_n, ±max_log_scale)
///     c_n = clamp(kp·e_n + I_n + kd·(e_n − e_{n-1}), ±max_log_scale),   τ_eff = τ(L)·exp(c_n)
///
/// The regulated quantity is `projected_bits`, the bits the tiers are heading to, not the
/// current tiers: demotions wait k canaries (hysteresis), and regulating the lagging tiers puts
/// that k-step dead time inside the loop, which winds the integrator up and overshoots by whole
/// tiers (measured on the sweep below when regulating the current tiers: 1.4 to 2 bits of
/// overshoot for ki = 0.4 to 0.6). The current tiers follow the projection within k canaries.
///
/// The plant (log τ → bits) is a decreasing staircase: a unit changes tier when τ crosses one of
/// its EMAs. Kivi KL falls about 16x per 2 bits (KL ~ error²), so one tier spans ~2.8 nats of log
/// τ, and the spread of δ across units adds a few nats: the mean slope is 0.4 to 1 bit per nat
/// for the (3, 5, 9)-bit kivi ladder. The deadband is half of the largest move one unit makes
/// (tier gap / units): two staircase levels that straddle the target are then both "on target"
/// and the integrator stops hunting between them; the steady error is at most one unit move.
///
/// How the gains were chosen: a sweep over kp ∈ {0, .05, .1, .2, .4}, ki ∈ {.1 … 1.2} on the
/// synthetic plant of tests/test_echokv.cpp (16 layers in per-layer mode, δ spread over 2, 4 and
/// 8 nats, target steps 6→4, 4→6, 7→4, 4→7, 5→4, 3.5→6.5, 8→5 bits, with and without ±0.5 nat
/// of noise per measurement, hysteresis k = 3, h = 0.1), scoring the worst settling time to
/// within one unit move (0.25 bit) and the worst overshoot. ki ≤ 0.3 settles in up to 40 canary
/// steps; ki ≥ 0.8 (or kp = 0.4 with ki ≥ 0.4) overshoots by 0.5 to 3 bits; kp = 0.05,
/// ki = 0.5 settles within 10 steps with at most 0.25 bit of overshoot, with a margin of ~1.6x
/// on ki before the overshoot grows. A derivative term did not help: kd ≤ 0.1 changed nothing
/// measurable and kd = 0.2 overshot by 2 bits (the staircase makes e_n − e_{n-1} a train of
/// spikes), so kd = 0. A plant whose units all share one δ moves every unit at once; then no
/// gain can settle between two levels and the error stays within one such jump.
struct echokv_pid {
  double kp = 0.05;             ///< proportional gain, nats of log τ per bit of error
  double ki = 0.5;              ///< integral gain per canary step, nats per bit
  double kd = 0.0;              ///< derivative gain, nats per bit per step
  double deadband = -1.0;       ///< |error| in bits below which it counts as 0; < 0: automatic (see above)
  double max_log_scale = 12.0;  ///< bound of |c| and of the integrator (anti-windup), nats
};

/// Parameters of `echokv_policy`. The defaults are the measured ones of docs/decisions.md.
struct echokv_options {
  /// K format of each tier, lowest precision first (strictly increasing K bytes per page).
  std::vector<format_id> tiers = {format_id(find_format(family::kivi, 2, 32)),
                                  format_id(find_format(family::kivi, 4, 32)),
                                  format_id(find_format(family::kivi, 8, 32))};
  /// V format of each tier; empty: V uses the tier's K format (V follows K's bits).
  std::vector<format_id> v_tiers = {};
  echokv_granularity granularity = echokv_granularity::per_layer;  ///< decision unit
  double rate = 1.0 / 64;          ///< canary probability per step, in (0, 1]; 1 = every step
  uint64_t seed = 0;               ///< seed of the canary RNG
  double alpha = 0.1;              ///< EMA weight of a new measurement, in (0, 1]
  double tau0 = 0.022;             ///< threshold at context L0, nats
  double context0 = 4096;          ///< L0 of τ(L) = τ0·sqrt(L/L0)
  int hysteresis_steps = 3;        ///< k: consecutive canaries below τ·(1-h) before a demotion, >= 1
  double hysteresis_margin = 0.1;  ///< h, in [0, 1)
  int initial_tier = -1;           ///< tier every unit starts in; -1: the highest
  float softmax_scale = 0.f;       ///< scale of q·k in the canary; 0: 1/sqrt(head_dim)
  size_t max_history = 1 << 16;    ///< history entries kept (oldest dropped first)
  echokv_pid pid = {};             ///< budget controller (active after `set_target_bits`)
};

/// What happened so far.
struct echokv_counters {
  uint64_t observations = 0;        ///< `observe` calls
  uint64_t canary_steps = 0;        ///< distinct (sequence, context) steps with a canary
  uint64_t canary_evaluations = 0;  ///< (step, layer) measurements ingested
  uint64_t skipped = 0;             ///< canaries skipped: no whole token group in the window
  uint64_t promotions = 0;          ///< unit moves to a higher tier
  uint64_t demotions = 0;           ///< unit moves to a lower tier
};

/// The tier vector after one canary step, for the format map over time.
struct echokv_history_entry {
  uint64_t canary_step = 0;    ///< 1-based index of the canary step
  seq_id seq = 0;              ///< sequence of the step
  int64_t context = 0;         ///< its context length
  double tau = 0.0;            ///< τ_eff used by the step
  double average_bits = 0.0;   ///< average bits of the tiers after the step
  std::vector<uint8_t> tiers;  ///< [units] tier indices after the step
};

/// State of the budget controller.
struct echokv_control {
  bool active = false;       ///< a target is set
  double target_bits = 0.0;  ///< the target
  double log_scale = 0.0;    ///< c: τ_eff = τ(L)·exp(c)
  double integral = 0.0;     ///< integrator state, nats
  double last_error = 0.0;   ///< e of the last update (after the deadband), bits
  double deadband = 0.0;     ///< deadband in use, bits
};

/// The EchoKV controller.
class KVQ_EXPORT echokv_policy final : public policy, public canary_protocol {
 public:
  /// Keeps the options; they are validated by `bind`.
  explicit echokv_policy(echokv_options opt = {});

  /// "echokv(kivi2/g32|kivi4/g32|kivi8/g32,rate=0.015625,seed=0,per_layer,k=3,h=0.1)".
  std::string name() const override;
  /// Validates the options against the shape (every tier format must store its role's pages,
  /// tiers strictly increasing in K bytes, ranges of rate, α, τ0, L0, k, h, initial tier) and
  /// resets all state: tiers to the initial one, EMAs unset, counters, history, controller.
  status bind(const cache_shape& shape) override;
  /// Format of the page's role in its unit's current tier.
  format_id choose(const page_request& req) override {
    const format_pair p = current(req.layer, req.kv_head);
    return req.r == role::k ? p.k : p.v;
  }
  /// (K, V) formats of the current tier of (layer, kv head); the highest tier before `bind`.
  format_pair current(int layer, int kv_head) const override;
  /// Always true: the canary needs the queries and the FP16 window.
  bool wants_queries() const override { return true; }
  /// Runs the canary on the chosen steps: `measure`, then `ingest`. Does nothing while frozen.
  void observe(const query_observation& obs) override;
  /// This policy's canary protocol (itself).
  canary_protocol* canary() override { return this; }
  /// The measurement of `measure` for a backend to run (tiers, alignment, scale, granularity);
  /// nullptr before `bind`.
  const canary_spec* device_canary() const override { return bound_ ? &spec_ : nullptr; }
  /// `is_canary`, and false while frozen or unbound.
  bool canary_due(seq_id seq, int64_t context) const override { return bound_ && !frozen_ && is_canary(seq, context); }
  /// Counts an observation (as `observe` does), unless frozen or unbound.
  void note_observation() override {
    if (bound_ && !frozen_) ++counters_.observations;
  }
  /// Counts a skipped canary (as `observe` does when `measure` finds no whole group).
  void note_skipped() override {
    if (bound_ && !frozen_) ++counters_.skipped;
  }

  /// True if the step of `seq` at `context` is a canary (the documented counter-based RNG).
  bool is_canary(seq_id seq, int64_t context) const;
  /// δ of every (unit of the layer, tier) for one observation, without changing any state.
  /// Errors: not bound, a layer or window outside the shape, no whole token group in the window.
  result<canary_measurement> measure(const query_observation& obs) const;
  /// Feeds one measurement (from `measure`, or from another rank or a test): EMA update,
  /// decisions, controller and history. A new (seq, context) starts a new canary step. Does
  /// nothing while frozen. Errors name a bad layer, a wrong δ count or a non-finite δ.
  status ingest(const canary_measurement& m) override;

  /// Stops every move, measurement and controller update until `unfreeze`.
  void freeze() { frozen_ = true; }
  /// Resumes after `freeze`.
  void unfreeze() { frozen_ = false; }
  /// True while frozen.
  bool frozen() const { return frozen_; }

  /// The tier vector, [units] (units = layers, or layers*kv_heads in per-head mode, row-major);
  /// in agreement mode the proposal (as are the tiers of `history`).
  std::vector<uint8_t> snapshot() const { return tiers_; }
  /// Sets the tier vector (e.g. one from `snapshot` or `majority_vote`) and clears the hysteresis
  /// streaks; EMAs are kept. Errors name a wrong length or a tier out of range.
  status restore(std::span<const uint8_t> tiers);
  /// Agreement mode, for tensor-parallel ranks that must store every layer in one format
  /// (docs/architecture.md, "Tensor parallel"). While on, canary decisions move only the
  /// *proposal* (`snapshot`); the tiers `choose` and `current` answer with (`agreed`) change only
  /// through `apply_agreed` or `restore`. Turning it on makes the current tiers the agreed ones;
  /// turning it off makes the proposal current.
  void set_agreement(bool on) {
    agreement_ = on;
    agreed_ = tiers_;
  }
  /// True while in agreement mode.
  bool agreement() const { return agreement_; }
  /// The tiers `choose` answers with, [units]: the agreed ones in agreement mode, else `snapshot`.
  std::vector<uint8_t> agreed() const { return agreement_ ? agreed_ : tiers_; }
  /// Makes `tiers` (the ranks' majority vote) both the agreed tiers and the proposal, keeping the
  /// EMAs and the hysteresis streaks: a unit that was outvoted proposes its move again at its next
  /// canary, as its own measurements warrant. Errors name a wrong length or a tier out of range.
  status apply_agreed(std::span<const uint8_t> tiers);
  /// Per unit, the tier most of the snapshots hold; a tie goes to the highest of the tied tiers
  /// (the safer precision). What tensor-parallel ranks exchange. Errors: no
  /// snapshots, or snapshots of different lengths.
  static result<std::vector<uint8_t>> majority_vote(std::span<const std::vector<uint8_t>> snapshots);

  /// Turns on budget mode: the controller steers τ so the average bits track `bits`. Errors: not
  /// bound, or a target outside [bits of the lowest tier, bits of the highest tier].
  status set_target_bits(double bits);
  /// Turns budget mode off and resets the controller (τ_eff = τ(L) again).
  void clear_target();
  /// State of the budget controller.
  const echokv_control& control() const { return ctl_; }

  /// τ_eff at context length `context`: τ0·sqrt(L/L0)·exp(c).
  double tau(int64_t context) const;
  /// Average bits per K/V page element of the current tiers, scales and zeros included.
  double average_bits() const;
  /// Average bits the tiers are heading to at `context`: every unit at the tier the decision
  /// rule would settle it in if its EMAs stayed as they are (a promotion target, else the lowest
  /// lower tier below τ·(1-h), else its tier). What the budget controller regulates.
  double projected_bits(int64_t context) const;
  /// Average bits per K/V page element of tier `t` (mean of its K and V formats); NaN for a `t`
  /// outside [0, tier_count()) or before `bind`.
  double tier_bits(int t) const {
    return t >= 0 && size_t(t) < tier_bits_.size() ? tier_bits_[size_t(t)] : std::numeric_limits<double>::quiet_NaN();
  }
  /// Number of tiers.
  int tier_count() const { return int(opt_.tiers.size()); }
  /// (K, V) formats of tier `t`. Errors: `t` outside [0, tier_count()), naming it.
  result<format_pair> tier_formats(int t) const;
  /// Number of decision units (0 before `bind`).
  int units() const { return int(tiers_.size()); }
  /// Unit of (layer, kv head): the layer in per-layer mode, layer*kv_heads + head in per-head mode.
  int unit_of(int layer, int kv_head) const {
    return opt_.granularity == echokv_granularity::per_layer ? layer : layer * shape_.kv_heads + kv_head;
  }
  /// Current tier of a unit; -1 for a `unit` outside [0, units()).
  int tier(int unit) const { return unit >= 0 && size_t(unit) < tiers_.size() ? tiers_[size_t(unit)] : -1; }
  /// EMA of δ for (unit, tier); NaN before the unit's first measurement, and for a `unit` outside
  /// [0, units()) or a `t` outside [0, tier_count()).
  double ema(int unit, int t) const {
    if (unit < 0 || size_t(unit) >= tiers_.size() || t < 0 || size_t(t) >= opt_.tiers.size())
      return std::numeric_limits<double>::quiet_NaN();
    return ema_[size_t(unit) * opt_.tiers.size() + size_t(t)];
  }
  /// Counters since `bind`.
  const echokv_counters& counters() const { return counters_; }
  /// Tier vectors after each canary step, oldest first (at most `max_history`).
  const std::deque<echokv_history_entry>& history() const { return history_; }
  /// The options in use.
  const echokv_options& options() const { return opt_; }

 private:
  void decide(int unit, double tau);
  format_pair pair_of_tier(size_t t) const;  // `tier_formats` without the range check
  void update_controller(int64_t context);
  status check_tiers(std::span<const uint8_t> tiers, const char* what) const;

  echokv_options opt_;
  cache_shape shape_{};
  bool bound_ = false;
  bool frozen_ = false;
  int align_ = 1;                  // token alignment of the canary window (largest K token group)
  canary_spec spec_;               // what `device_canary` hands a backend
  std::vector<double> tier_bits_;  // [tiers]
  std::vector<uint8_t> tiers_;     // [units] the decisions (the proposal in agreement mode)
  bool agreement_ = false;
  std::vector<uint8_t> agreed_;    // [units] what `choose` answers in agreement mode
  std::vector<double> ema_;        // [units][tiers]
  std::vector<int> streak_;        // [units][tiers] consecutive canaries below τ(1-h)
  echokv_counters counters_;
  std::deque<echokv_history_entry> history_;
  echokv_control ctl_;
  bool in_step_ = false;
  seq_id step_seq_ = 0;
  int64_t step_context_ = 0;
  // Scratch of `measure`, reused across canaries (hence no thread-safety).
  mutable std::vector<uint16_t> scratch_src_;  // [kv_heads][n][d] fp16 K_ref
  mutable std::vector<float> scratch_ref_;     // [kv_heads][n][d] K_ref
  mutable std::vector<float> scratch_err_;     // [tiers][kv_heads][n][d] K^ - K_ref
  mutable std::vector<float> scratch_sz_;      // per-group scales and zeros of one page
  mutable std::vector<uint8_t> scratch_page_;  // one page-shaped encode buffer
};

KVQ_NAMESPACE_END
