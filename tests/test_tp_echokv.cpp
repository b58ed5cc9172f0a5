// EchoKV across tensor-parallel ranks over the thread communicator: agreement mode of the policy,
// identical format maps and page formats on every rank after many steps with different data per
// rank (and, without the vote, maps that differ: the data really disagree), the tie-break, a failed
// or timed-out exchange that keeps every rank's tiers, and the configuration check of `create`.
#include <catch2/catch.hpp>
#include <kvq/cache/cache.hpp>
#include <kvq/dist/thread_communicator.hpp>
#include <kvq/dist/tp_echokv.hpp>
#include <kvq/policy/echokv.hpp>
#include <kvq/policy/static_policy.hpp>
#include <memory>
#include <random>
#include <vector>

#include "tp_ranks.hpp"

using namespace kvq;
using namespace kvq::dist;
using namespace std::chrono_literals;
using kvq_test::all_ok;
using kvq_test::run_ranks;

namespace {

constexpr int layers = 6, kv_local = 2, group_size = 2, d = 64;

// Query scale per (rank, layer): how sharp each rank's heads attend, so how much key quantization
// damages them. The ranks disagree on most layers.
constexpr float sharpness[3][layers] = {
    {0.1f, 0.3f, 1.0f, 2.5f, 4.0f, 0.1f}, {0.1f, 2.5f, 0.3f, 1.0f, 4.0f, 4.0f}, {4.0f, 0.3f, 1.0f, 0.1f, 0.2f, 2.5f}};

echokv_options options(uint64_t seed = 7) {
  echokv_options o;
  o.rate = 1.0 / 4;
  o.seed = seed;
  o.hysteresis_steps = 2;
  return o;
}

KVCache rank_cache(std::shared_ptr<policy> pol) {
  cache_config cfg;
  cfg.shape = {layers, kv_local * group_size, kv_local, d, 64, 128, 64};
  cfg.budget_bytes = 32 << 20;
  return KVCache::create(cfg, std::move(pol)).value_or_throw();
}

// One step of `m` tokens at position `pos` through every layer of one rank: its own K, V, Q.
void step(KVCache& cache, int rank, int64_t pos, int m) {
  const int qh = kv_local * group_size;
  std::vector<float> k(size_t(m) * kv_local * d), v(k.size()), q(size_t(m) * qh * d), o(q.size());
  for (int l = 0; l < layers; ++l) {
    std::mt19937 rng(uint32_t(rank * 1000003 + l * 7919 + pos * 31));
    std::normal_distribution<float> nd;
    for (size_t i = 0; i < k.size(); ++i) k[i] = nd(rng) * (i % 16 == 5 ? 6.f : 1.f), v[i] = nd(rng);
    for (auto& x : q) x = nd(rng) * sharpness[rank][l];
    check(cache.append(0, l, {k.data(), dtype::f32, m, kv_local, d}, {v.data(), dtype::f32, m, kv_local, d}));
    const attend_item it{0, m};
    check(cache.attend({&it, 1}, l, {q.data(), dtype::f32, m, qh, d}, {o.data(), dtype::f32, m, qh, d}));
  }
}

// What one rank saw over a run: its agreed tiers after each step, and its final stats.
struct rank_trace {
  std::vector<std::vector<uint8_t>> agreed;
  cache_stats stats;
  tp_vote_counters counters;
};

// Decodes `steps` tokens after a 128-token prompt on `ranks` ranks, voting when `vote`.
std::vector<rank_trace> decode(int ranks, int steps, bool vote) {
  auto comms = make_thread_group(ranks, 10s).value_or_throw();
  std::vector<rank_trace> traces(static_cast<size_t>(ranks));
  auto errors = run_ranks(ranks, [&](int r) {
    KVCache cache = rank_cache(std::make_shared<echokv_policy>(options()));
    check(cache.create_sequence(0));
    std::unique_ptr<tp_echokv> tp;
    if (vote) tp = std::make_unique<tp_echokv>(tp_echokv::create(cache, *comms[size_t(r)]).value_or_throw());
    auto& pol = dynamic_cast<echokv_policy&>(cache.active_policy());
    const seq_id seqs[] = {0};
    step(cache, r, 0, 128);
    if (tp) tp->end_step(seqs).value_or_throw();
    for (int s = 0; s < steps; ++s) {
      step(cache, r, 128 + s, 1);
      if (tp) tp->end_step(seqs).value_or_throw();
      traces[size_t(r)].agreed.push_back(pol.agreed());
    }
    traces[size_t(r)].stats = cache.stats();
    if (tp) traces[size_t(r)].counters = tp->counters();
  });
  INFO(errors[0] << " | " << errors[1]);
  REQUIRE(all_ok(errors));
  return traces;
}

std::vector<format_pair> per_layer(const cache_stats& s) {
  std::vector<format_pair> out;
  for (int l = 0; l < layers; ++l) out.push_back(s.format_map[size_t(l * kv_local)]);
  return out;
}

// In agreement mode, proposals are set by feeding the policy δ of one canary step per layer:
// with k = 1 and h = 0 the proposal goes to the lowest tier whose δ is under τ(4096) = 0.022.
echokv_options scripted() {
  echokv_options o;
  o.rate = 1.0;
  o.hysteresis_steps = 1;
  o.hysteresis_margin = 0.0;
  return o;
}

void propose(echokv_policy& p, const std::vector<int>& tier_per_layer, int64_t context) {
  for (int l = 0; l < layers; ++l) {
    const int t = tier_per_layer[size_t(l)];
    std::vector<double> delta = {t > 0 ? 1.0 : 0.001, t > 1 ? 1.0 : 0.001, 0.001};
    check(p.ingest({0, l, context, delta}));
  }
}

}  // namespace

TEST_CASE("echokv agreement mode: decisions move the proposal, choose answers the agreed tiers", "[tp][echokv]") {
  echokv_policy p(scripted());
  const cache_shape shape{layers, 4, 2, d, 64, 128, 64};
  REQUIRE(p.bind(shape).ok());
  p.set_agreement(true);
  const format_pair top = p.tier_formats(2).value(), low = p.tier_formats(0).value();
  propose(p, {0, 0, 1, 2, 2, 0}, 4096);
  CHECK(p.snapshot() == std::vector<uint8_t>{0, 0, 1, 2, 2, 0});
  CHECK(p.agreed() == std::vector<uint8_t>(layers, 2));
  CHECK(p.current(0, 1) == top);
  CHECK(p.choose({0, 0, 1, role::k, 0}) == top.k);
  const std::vector<uint8_t> vote = {0, 2, 1, 2, 0, 0};
  REQUIRE(p.apply_agreed(vote).ok());
  CHECK(p.agreed() == vote);
  CHECK(p.snapshot() == vote);
  CHECK(p.current(0, 0) == low);
  // a wrong length or tier changes nothing
  CHECK(p.apply_agreed(std::vector<uint8_t>(3, 0)).code() == errc::invalid_argument);
  CHECK(p.apply_agreed(std::vector<uint8_t>(layers, 3)).message().find("unit 0 has tier 3") != std::string::npos);
  CHECK(p.agreed() == vote);
  // out of agreement mode the proposal is current again
  propose(p, {2, 2, 2, 2, 2, 2}, 4097);
  p.set_agreement(false);
  CHECK(p.agreed() == std::vector<uint8_t>(layers, 2));
  CHECK(p.current(0, 0) == top);
}

TEST_CASE("tensor-parallel echokv: every rank keeps the same format map with different data", "[tp][echokv]") {
  const int ranks = GENERATE(2, 3);
  CAPTURE(ranks);
  constexpr int steps = 256;
  const auto traces = decode(ranks, steps, true);
  uint64_t overruled = 0, moves = traces[0].counters.moves;
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    const rank_trace& t = traces[size_t(r)];
    REQUIRE(t.agreed.size() == size_t(steps));
    for (int s = 0; s < steps; ++s) {
      CAPTURE(s);
      REQUIRE(t.agreed[size_t(s)] == traces[0].agreed[size_t(s)]);
    }
    CHECK(t.stats.format_map == traces[0].stats.format_map);
    CHECK(t.stats.pages_by_format == traces[0].stats.pages_by_format);
    CHECK(t.stats.page_bytes == traces[0].stats.page_bytes);
    CHECK(t.counters.votes == traces[0].counters.votes);
    CHECK(t.counters.failures == 0);
    overruled += t.counters.overruled;
  }
  // about one step in four is a canary, and the vote ran on each
  CHECK(traces[0].counters.votes > steps / 8);
  CHECK(traces[0].counters.votes < steps / 2);
  // the ranks did disagree, and the tiers did move
  CHECK(overruled > 0);
  CHECK(moves > 0);
  // the flat layer of every rank went down, the sharp one stayed up
  CHECK(traces[0].agreed.back()[0] < traces[0].agreed.back()[4]);
}

TEST_CASE("tensor-parallel echokv: a decision that lands between votes stores nothing alone", "[tp][echokv]") {
  // On CUDA a canary is ingested a step or more after it ran, at a moment that differs between
  // ranks. Here rank 0 ingests one between two votes and then both ranks write pages: the pages
  // must still take the agreed tiers on both.
  auto comms = make_thread_group(2, 10s).value_or_throw();
  std::vector<cache_stats> stats(2);
  std::vector<std::vector<uint8_t>> proposal(2), agreed(2);
  auto errors = run_ranks(2, [&](int r) {
    echokv_options o = scripted();
    o.rate = 1e-9;  // no canary of its own in these steps
    auto pol = std::make_shared<echokv_policy>(o);
    KVCache cache = rank_cache(pol);
    auto tp = tp_echokv::create(cache, *comms[size_t(r)]).value_or_throw();
    check(cache.create_sequence(0));
    if (r == 0) propose(*pol, {0, 0, 0, 0, 0, 0}, 4096);  // a late measurement: every layer down
    step(cache, r, 0, 128);
    for (int s = 0; s < 128; ++s) step(cache, r, 128 + s, 1);  // three pages per (layer, kv head)
    stats[size_t(r)] = cache.stats();
    proposal[size_t(r)] = pol->snapshot();
    agreed[size_t(r)] = pol->agreed();
  });
  REQUIRE(all_ok(errors));
  CHECK(proposal[0] == std::vector<uint8_t>(layers, 0));
  CHECK(agreed[0] == std::vector<uint8_t>(layers, 2));
  CHECK(stats[0].pages == stats[1].pages);
  CHECK(stats[0].pages > 0);
  CHECK(stats[0].pages_by_format == stats[1].pages_by_format);
  CHECK(stats[0].format_map == stats[1].format_map);
}

TEST_CASE("tensor-parallel echokv: without the vote the same ranks diverge", "[tp][echokv]") {
  const auto traces = decode(2, 256, false);
  CHECK(per_layer(traces[0].stats) != per_layer(traces[1].stats));
}

TEST_CASE("tensor-parallel echokv: ties go to the higher tier, the same on every rank and every run", "[tp][echokv]") {
  struct scenario {
    std::vector<std::vector<int>> proposals;  // [rank][layer]
    std::vector<uint8_t> expect;
  };
  const scenario sc = GENERATE(
      scenario{{{0, 1, 2, 0, 0, 1}, {2, 0, 0, 0, 1, 1}}, {2, 1, 2, 0, 1, 1}},
      scenario{{{0, 0, 2, 1, 0, 1}, {0, 1, 1, 1, 2, 0}, {1, 1, 0, 1, 1, 2}, {2, 0, 1, 0, 2, 0}}, {0, 1, 1, 1, 2, 0}},
      scenario{{{0, 0, 0, 1, 2, 2}, {1, 0, 2, 1, 2, 0}, {2, 2, 2, 0, 1, 0}}, {2, 0, 2, 1, 2, 0}});
  const int ranks = int(sc.proposals.size());
  CAPTURE(ranks);
  for (int run = 0; run < 4; ++run) {
    CAPTURE(run);
    auto comms = make_thread_group(ranks, 10s).value_or_throw();
    std::vector<std::vector<uint8_t>> agreed(static_cast<size_t>(ranks));
    auto errors = run_ranks(ranks, [&](int r) {
      auto pol = std::make_shared<echokv_policy>(scripted());
      KVCache cache = rank_cache(pol);
      auto tp = tp_echokv::create(cache, *comms[size_t(r)]).value_or_throw();
      propose(*pol, sc.proposals[size_t(r)], 4096);
      // ranks reach the vote in a different order on every run
      std::this_thread::sleep_for(std::chrono::milliseconds(((r + run) % ranks) * 5));
      check(tp.vote());
      agreed[size_t(r)] = pol->agreed();
    });
    REQUIRE(all_ok(errors));
    for (int r = 0; r < ranks; ++r) CHECK(agreed[size_t(r)] == sc.expect);
  }
}

TEST_CASE("tensor-parallel echokv: a failed or timed-out exchange keeps every rank's tiers", "[tp][echokv]") {
  const bool timeout = GENERATE(false, true);
  CAPTURE(timeout);
  auto comms = make_thread_group(2, 1s).value_or_throw();
  kvq_test::signal rank0_done;
  std::vector<status> got(2), later(2);
  std::vector<std::vector<uint8_t>> before(2), after(2), proposal_after(2);
  std::vector<std::vector<format_pair>> map_before(2), map_after(2);
  auto errors = run_ranks(2, [&](int r) {
    auto pol = std::make_shared<echokv_policy>(scripted());
    KVCache cache = rank_cache(pol);
    auto tp = tp_echokv::create(cache, *comms[size_t(r)]).value_or_throw();
    // one good vote moves the tiers off the initial ones
    propose(*pol, {0, 0, 1, 1, 2, 2}, 4096);
    check(tp.vote());
    before[size_t(r)] = pol->agreed();
    map_before[size_t(r)] = cache.stats().format_map;
    // both ranks now propose something else; rank 1 fails before the exchange
    propose(*pol, r == 0 ? std::vector<int>{2, 2, 2, 0, 0, 0} : std::vector<int>{1, 2, 0, 2, 0, 1}, 4097);
    if (r == 1) {
      if (timeout)
        rank0_done.wait();  // misses rank 0's deadline, then comes late
      else
        comms[1]->abort("forward pass failed");
    }
    got[size_t(r)] = tp.vote();
    if (r == 0) rank0_done.set();
    after[size_t(r)] = pol->agreed();
    proposal_after[size_t(r)] = pol->snapshot();
    map_after[size_t(r)] = cache.stats().format_map;
    later[size_t(r)] = tp.vote();
  });
  REQUIRE(all_ok(errors));
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r, got[size_t(r)].to_string());
    CHECK(got[size_t(r)].code() == errc::comm_error);
    CHECK(got[size_t(r)].message().find("tiers kept") != std::string::npos);
    CHECK(got[size_t(r)].message().find(timeout ? "waited 1000 ms" : "forward pass failed") != std::string::npos);
    CHECK(before[size_t(r)] == std::vector<uint8_t>{0, 0, 1, 1, 2, 2});
    CHECK(after[size_t(r)] == before[size_t(r)]);
    CHECK(proposal_after[size_t(r)] == before[size_t(r)]);
    CHECK(map_after[size_t(r)] == map_before[size_t(r)]);
    CHECK(later[size_t(r)].code() == errc::comm_error);  // the group stays broken
  }
}

TEST_CASE("tensor-parallel echokv: create checks the policy and that the ranks match", "[tp][echokv]") {
  SECTION("not echokv, or per-head units") {
    auto comms = make_thread_group(1).value_or_throw();
    KVCache st = rank_cache(std::make_shared<static_policy>(format_pair{format_id(0), format_id(0)}));
    CHECK(tp_echokv::create(st, *comms[0]).error().message().find("not echokv") != std::string::npos);
    echokv_options o = options();
    o.granularity = echokv_granularity::per_head;
    KVCache ph = rank_cache(std::make_shared<echokv_policy>(o));
    CHECK(tp_echokv::create(ph, *comms[0]).error().code() == errc::invalid_argument);
  }
  SECTION("a rank with another canary seed") {
    auto comms = make_thread_group(3).value_or_throw();
    std::vector<status> got(3);
    std::vector<bool> agreement(3);
    auto errors = run_ranks(3, [&](int r) {
      auto pol = std::make_shared<echokv_policy>(options(r == 2 ? 8 : 7));
      KVCache cache = rank_cache(pol);
      got[size_t(r)] = tp_echokv::create(cache, *comms[size_t(r)]).error();
      agreement[size_t(r)] = pol->agreement();
    });
    REQUIRE(all_ok(errors));
    for (int r = 0; r < 3; ++r) {
      CAPTURE(r, got[size_t(r)].to_string());
      CHECK(got[size_t(r)].message().find("rank 2 has another canary seed") != std::string::npos);
      CHECK_FALSE(agreement[size_t(r)]);
    }
  }
}
