// The kl_budget policy: ladders of candidate formats per (layer, head, role) and the greedy over
// damage per byte saved.
#include <kvq/policy/kl_budget.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <queue>
#include <tuple>

KVQ_NAMESPACE_BEGIN

namespace {

struct rung {
  format_id f;
  uint64_t bytes;
  double damage;  // weighted
};

struct candidate_step {
  double price;
  int ladder;  // (layer * kv_heads + head) * 2 + role
  int from;    // rung index before the step
};

// Min-heap order: cheapest price first, then the lowest ladder index (lower layer, head, K first).
struct dearer {
  bool operator()(const candidate_step& a, const candidate_step& b) const {
    return std::tie(a.price, a.ladder) > std::tie(b.price, b.ladder);
  }
};

}  // namespace

result<kl_allocation> allocate_kl_budget(const sensitivity_profile& profile, const kl_budget_options& opt,
                                         int page_tokens, int head_dim) {
  if (status s = profile.validate(); !s.ok()) return status{s.code(), "kl_budget: " + s.message()};
  if (!std::isfinite(opt.value) || opt.value < 0.0)
    return status{errc::invalid_argument,
                  fmt::format("kl_budget: {} {} must be finite and >= 0",
                              opt.objective == kl_objective::kl_budget ? "damage budget" : "bits target", opt.value)};
  if (!std::isfinite(opt.v_weight) || opt.v_weight < 0.0)
    return status{errc::invalid_argument, fmt::format("kl_budget: v_weight {} must be finite and >= 0", opt.v_weight)};
  const int L = profile.layers, H = profile.kv_heads;

  // Ladders: usable candidates sorted by bytes, most first; equal bytes keep the least damage.
  std::vector<std::vector<rung>> ladders(size_t(L) * H * 2);
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h)
      for (role r : {role::k, role::v}) {
        auto& lad = ladders[(size_t(l) * H + h) * 2 + (r == role::k ? 0 : 1)];
        const double w = r == role::k ? 1.0 : opt.v_weight;
        for (size_t fi = 0; fi < profile.formats.size(); ++fi) {
          const format_id f = profile.formats[fi];
          if (!check_shape(f, r, page_tokens, head_dim).ok()) continue;
          lad.push_back(
              {f, layout_of(traits_of(f), r, page_tokens, head_dim).total(), w * profile.at(l, h, r, int(fi))});
        }
        if (lad.empty())
          return status{errc::invalid_argument,
                        fmt::format("kl_budget: no candidate format can store {} pages of {} tokens x {} channels "
                                    "(layer {} head {})",
                                    role_name(r), page_tokens, head_dim, l, h)};
        std::stable_sort(lad.begin(), lad.end(), [](const rung& a, const rung& b) {
          return a.bytes != b.bytes ? a.bytes > b.bytes : a.damage < b.damage;
        });
        lad.erase(std::unique(lad.begin(), lad.end(), [](const rung& a, const rung& b) { return a.bytes == b.bytes; }),
                  lad.end());
      }

  kl_allocation out;
  std::vector<int> pos(ladders.size(), 0);
  uint64_t bytes = 0, bottom_bytes = 0;
  double damage = 0.0;
  for (const auto& lad : ladders) {
    bytes += lad.front().bytes;
    bottom_bytes += lad.back().bytes;
    damage += lad.front().damage;
  }
  const double elements = double(ladders.size()) * page_tokens * head_dim;
  const auto bits_of = [&](uint64_t b) { return 8.0 * double(b) / elements; };
  const bool budget_mode = opt.objective == kl_objective::kl_budget;
  const double slack = 1e-12 * std::max(1.0, std::abs(opt.value));
  if (budget_mode && damage > opt.value + slack)
    return status{errc::invalid_argument,
                  fmt::format("kl_budget: budget {} is below the damage {} of the highest-precision allocation",
                              opt.value, damage)};
  if (!budget_mode && bits_of(bottom_bytes) > opt.value + 1e-12)
    return status{errc::invalid_argument,
                  fmt::format("kl_budget: bits target {} is below {:.4f}, the fewest bits the candidates reach",
                              opt.value, bits_of(bottom_bytes))};

  std::priority_queue<candidate_step, std::vector<candidate_step>, dearer> heap;
  const auto push_next = [&](int li) {
    const auto& lad = ladders[size_t(li)];
    const int p = pos[size_t(li)];
    if (p + 1 >= int(lad.size())) return;
    const double added = lad[size_t(p) + 1].damage - lad[size_t(p)].damage;
    heap.push({added / double(lad[size_t(p)].bytes - lad[size_t(p) + 1].bytes), li, p});
  };
  for (int li = 0; li < int(ladders.size()); ++li) push_next(li);

  while (!heap.empty()) {
    if (!budget_mode && bits_of(bytes) <= opt.value + 1e-12) break;
    const candidate_step s = heap.top();
    heap.pop();
    const auto& lad = ladders[size_t(s.ladder)];
    const rung& a = lad[size_t(s.from)];
    const rung& b = lad[size_t(s.from) + 1];
    const double added = b.damage - a.damage;
    if (budget_mode && damage + added > opt.value + slack) continue;  // drops the rest of this ladder
    damage += added;
    bytes -= a.bytes - b.bytes;
    pos[size_t(s.ladder)] = s.from + 1;
    const int layer = s.ladder / (2 * H), head = (s.ladder / 2) % H;
    out.steps.push_back({layer, head, s.ladder % 2 == 0 ? role::k : role::v, a.f, b.f, added, a.bytes - b.bytes});
    push_next(s.ladder);
  }

  out.map = format_map::uniform(L, H, {});
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h) {
      const size_t base = (size_t(l) * H + h) * 2;
      out.map.at(l, h) = {ladders[base][size_t(pos[base])].f, ladders[base + 1][size_t(pos[base + 1])].f};
    }
  out.total_damage = damage;
  out.page_bytes = bytes;
  out.average_bits = bits_of(bytes);
  return out;
}

std::string kl_budget_policy::name() const {
  const std::string goal = opt_.objective == kl_objective::kl_budget ? fmt::format("kl<={}", opt_.value)
                                                                     : fmt::format("bits<={}", opt_.value);
  if (alloc_.map.pairs.empty()) return fmt::format("kl_budget({})", goal);
  return fmt::format("kl_budget({};bits={:.3f},kl={:.4g})", goal, alloc_.average_bits, alloc_.total_damage);
}

status kl_budget_policy::bind(const cache_shape& shape) {
  if (profile_.layers != shape.layers || profile_.kv_heads != shape.kv_heads)
    return {errc::invalid_argument,
            fmt::format("kl_budget: the profile covers {} layers x {} kv heads, the cache has {} x {}", profile_.layers,
                        profile_.kv_heads, shape.layers, shape.kv_heads)};
  auto a = allocate_kl_budget(profile_, opt_, shape.page_tokens, shape.head_dim);
  if (!a) return a.error();
  alloc_ = std::move(a).value();
  return {};
}

KVQ_NAMESPACE_END
