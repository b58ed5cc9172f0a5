// EchoKV's tier vote across tensor-parallel ranks (see tp_echokv.hpp).
#include <fmt/format.h>

#include <cstring>
#include <kvq/dist/tp_echokv.hpp>

KVQ_NAMESPACE_BEGIN

namespace dist {

namespace {

// What every rank must share for the votes to line up: the same units, tiers and canary draw.
struct rank_config {
  int32_t layers = 0;
  int32_t tiers = 0;
  uint64_t tier_formats = 0;  // FNV-1a of the K and V tier format ids
  uint64_t seed = 0;
  double rate = 0.0;
};

uint64_t fnv1a(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ull;
  return h;
}

rank_config config_of(const echokv_policy& pol, int layers) {
  const echokv_options& o = pol.options();
  rank_config c;
  c.layers = layers;
  c.tiers = pol.tier_count();
  uint64_t h = 14695981039346656037ull;
  for (int t = 0; t < pol.tier_count(); ++t) {
    const format_pair p = pol.tier_formats(t).value();
    h = fnv1a(fnv1a(h, uint64_t(p.k)), uint64_t(p.v));
  }
  c.tier_formats = h;
  c.seed = o.seed;
  c.rate = o.rate;
  return c;
}

// The first field where `c` differs from `ref`, or nullptr.
const char* differing_field(const rank_config& c, const rank_config& ref) {
  if (c.layers != ref.layers) return "layers";
  if (c.tiers != ref.tiers) return "tier count";
  if (c.tier_formats != ref.tier_formats) return "tier formats";
  if (c.seed != ref.seed) return "canary seed";
  if (c.rate != ref.rate) return "canary rate";
  return nullptr;
}

}  // namespace

result<tp_echokv> tp_echokv::create(KVCache& cache, communicator& comm) {
  auto* pol = dynamic_cast<echokv_policy*>(&cache.active_policy());
  if (!pol)
    return status{errc::invalid_argument, fmt::format("tensor-parallel vote: the cache's policy is {}, not echokv",
                                                      cache.active_policy().name())};
  if (pol->options().granularity != echokv_granularity::per_layer)
    return status{errc::invalid_argument,
                  "tensor-parallel vote: echokv decides per kv head; each rank's heads are its own, so only "
                  "per-layer units are voted on"};
  const rank_config mine = config_of(*pol, cache.config().shape.layers);
  std::vector<rank_config> all(size_t(comm.size()));
  if (status s = comm.all_gather(&mine, all.data(), sizeof(rank_config), memory_space::host, cache.config().stream); !s)
    return status{s.code(),
                  fmt::format("tensor-parallel vote: configuration exchange on rank {}: {}", comm.rank(), s.message())};
  for (size_t r = 1; r < all.size(); ++r)
    if (const char* f = differing_field(all[r], all[0]))
      return status{errc::invalid_argument,
                    fmt::format("tensor-parallel vote: rank {} has another {} than rank 0; every rank needs the same "
                                "layers, tiers, canary seed and rate",
                                r, f)};
  pol->set_agreement(true);
  return tp_echokv(cache, *pol, comm);
}

result<bool> tp_echokv::end_step(std::span<const seq_id> seqs) {
  bool canary = false;
  for (seq_id s : seqs) {
    const int64_t n = cache_->length(s, 0);
    if (n < 0) {
      const std::string why = fmt::format("end_step: unknown sequence {}", s);
      comm_->abort(why);
      return status{errc::not_found, fmt::format("tensor-parallel vote on rank {}: {}", comm_->rank(), why)};
    }
    canary = canary || pol_->is_canary(s, n);
  }
  if (!canary) return false;
  if (status s = cache_->sync_policy(); !s) {
    comm_->abort(fmt::format("sync_policy failed: {}", s.message()));
    ++counters_.failures;
    return s;
  }
  if (status s = vote(); !s) return s;
  return true;
}

status tp_echokv::vote() {
  const std::vector<uint8_t> proposal = pol_->snapshot(), before = pol_->agreed();
  const size_t units = proposal.size(), ranks = size_t(comm_->size());
  gathered_.resize(units * ranks);
  const status s =
      comm_->all_gather(proposal.data(), gathered_.data(), units, memory_space::host, cache_->config().stream);
  if (!s) {
    ++counters_.failures;
    (void)pol_->apply_agreed(before);  // the proposal returns to the agreed tiers; sizes match
    return {s.code(), fmt::format("tensor-parallel vote on rank {}: tiers kept: {}", comm_->rank(), s.message())};
  }
  std::vector<std::vector<uint8_t>> snapshots(ranks);
  for (size_t r = 0; r < ranks; ++r)
    snapshots[r].assign(gathered_.begin() + std::ptrdiff_t(r * units),
                        gathered_.begin() + std::ptrdiff_t((r + 1) * units));
  auto agreed = echokv_policy::majority_vote(snapshots);
  if (!agreed) return agreed.error();  // unreachable: equal lengths, checked at create
  if (status a = pol_->apply_agreed(agreed.value()); !a) {
    // A tier out of range can only come from a rank with other tiers or corrupted bytes.
    comm_->abort(a.message());
    ++counters_.failures;
    (void)pol_->apply_agreed(before);
    return a;
  }
  ++counters_.votes;
  for (size_t u = 0; u < units; ++u) {
    counters_.moves += agreed.value()[u] != before[u];
    counters_.overruled += agreed.value()[u] != proposal[u];
  }
  return {};
}

}  // namespace dist

KVQ_NAMESPACE_END
