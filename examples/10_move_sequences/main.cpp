// Example 10: quantized sequences that move: disaggregated prefill and decode, a system prompt
// kept in a file, and preemption by swapping to host memory.
//
// What an engine developer learns here:
// - `export_sequences` / `import_sequences`: a prefill worker's cache hands each prefilled request
//   to a decode worker's cache as a blob (the bytes a connector would send), pages bit for bit with
//   their scales, so nothing is quantized twice;
// - `export_file` / `import_file`: a system prompt prefilled once, kept on disk, loaded by a new
//   cache and forked to every request (its pages shared again);
// - `swap_out` / `swap_in` (`cache_config::swap_bytes`): when a decode step's new pages do not fit
//   (`bytes_for(1, seq)` against `stats().free_bytes`), the newest request leaves for host memory,
//   freeing its budget and slot, and comes back when `swap_in_bytes` fits again.
//
// Self-checking: returns non-zero unless every request finishes, something was swapped, and each
// finished request's attention at every step equals, bit for bit, that of one cache that prefilled
// and decoded it alone with no move.
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <kvq/cache/cache.hpp>
#include <kvq/policy/static_policy.hpp>
#include <memory>
#include <random>
#include <vector>

namespace {

constexpr int layers = 4, q_heads = 8, kv_heads = 2, d = 64;
constexpr int64_t system_prompt = 200, prompt = 300;  // every request: the system prompt + its own
constexpr int requests = 5, outputs = 150;
constexpr const char* spec = "k=kivi4/g32,v=kivi2/g32";

// Stand-in for the model: the K, V, Q rows of (request, layer, position), deterministic. The
// system prompt's rows are the same for every request (request -1).
void model_rows(int req, int layer, int64_t pos, float* k, float* v, float* q) {
  if (pos < system_prompt) req = -1;
  std::mt19937 rng(uint32_t(req * 7919 + layer * 104729 + pos * 31 + 17));
  std::normal_distribution<float> nd;
  for (int i = 0; i < kv_heads * d; ++i) k[i] = nd(rng), v[i] = nd(rng);
  for (int i = 0; i < q_heads * d; ++i) q[i] = nd(rng);
}

kvq::KVCache make(uint64_t budget, uint64_t swap = 0) {
  kvq::cache_config cfg;
  cfg.shape = {layers, q_heads, kv_heads, d, 64, 128, 64};
  cfg.budget_bytes = budget;
  cfg.sink_pages = 1;
  cfg.swap_bytes = swap;
  return kvq::KVCache::create(cfg, std::make_shared<kvq::static_policy>(kvq::static_policy::parse(spec).value_or_throw()))
      .value_or_throw();
}

// Positions [from, to) of request `req` through every layer of `seq` (prefill in chunks of any
// length, or a decode step of one token); the outputs of the last position, every layer.
std::vector<float> run(kvq::KVCache& cache, kvq::seq_id seq, int req, int64_t from, int64_t to) {
  const int64_t m = to - from;
  std::vector<float> k(size_t(m) * kv_heads * d), v(k.size()), q(size_t(m) * q_heads * d), o(q.size()), last;
  for (int l = 0; l < layers; ++l) {
    for (int64_t t = 0; t < m; ++t)
      model_rows(req, l, from + t, &k[size_t(t) * kv_heads * d], &v[size_t(t) * kv_heads * d], &q[size_t(t) * q_heads * d]);
    kvq::check(cache.prefill(seq, l, {k.data(), kvq::dtype::f32, m, kv_heads, d}, {v.data(), kvq::dtype::f32, m, kv_heads, d},
                             {q.data(), kvq::dtype::f32, m, q_heads, d}, {o.data(), kvq::dtype::f32, m, q_heads, d}));
    last.insert(last.end(), o.end() - q_heads * d, o.end());
  }
  return last;
}

}  // namespace

int main() {
  const std::string file = (std::filesystem::temp_directory_path() / "kvq_example_10_system.kvqseq").string();
  // The reference: each request prefilled and decoded alone in one cache; its outputs per step.
  std::vector<std::vector<std::vector<float>>> want(requests);
  for (int r = 0; r < requests; ++r) {
    kvq::KVCache alone = make(64u << 20);
    kvq::check(alone.create_sequence(0));
    run(alone, 0, r, 0, system_prompt);
    run(alone, 0, r, system_prompt, system_prompt + prompt);
    for (int t = 0; t < outputs; ++t) want[size_t(r)].push_back(run(alone, 0, r, system_prompt + prompt + t, system_prompt + prompt + t + 1));
  }

  // The system prompt, prefilled once and kept in a file.
  {
    kvq::KVCache once = make(8u << 20);
    kvq::check(once.create_sequence(0));
    run(once, 0, -1, 0, system_prompt);
    const kvq::seq_id ids[] = {0};
    kvq::check(once.export_file(file, ids));
  }
  // The prefill worker loads it, forks it to every request and prefills each one's prompt; the
  // decode worker imports each request's blob. Its budget holds fewer requests than arrive at
  // their longest, so the newest are swapped out when a step's pages do not fit.
  kvq::KVCache prefill_worker = make(64u << 20);
  const kvq::seq_id sys[] = {1000};
  kvq::check(prefill_worker.import_file(file, sys));
  std::remove(file.c_str());
  std::vector<std::vector<uint8_t>> blobs;
  uint64_t moved = 0;
  for (int r = 0; r < requests; ++r) {
    kvq::check(prefill_worker.fork(1000, r));
    run(prefill_worker, r, r, system_prompt, system_prompt + prompt);
    const kvq::seq_id id[] = {r};
    blobs.push_back(prefill_worker.export_sequences(id).value_or_throw());
    moved += blobs.back().size();
    kvq::check(prefill_worker.release_sequence(r));
  }
  // The decode worker's budget holds every prefilled request but not their outputs (each grows
  // by three page blocks per layer): measured on a cache that imports them all.
  uint64_t held = 0;
  {
    kvq::KVCache probe = make(64u << 20);
    for (int r = 0; r < requests; ++r) {
      const kvq::seq_id id[] = {r};
      kvq::check(probe.import_sequences(blobs[size_t(r)], id));
    }
    held = probe.stats().used_bytes;
  }
  kvq::KVCache decode_worker = make(held + (128u << 10), 16u << 20);
  for (int r = 0; r < requests; ++r) {
    const kvq::seq_id id[] = {r};
    kvq::check(decode_worker.import_sequences(blobs[size_t(r)], id));
  }
  fmt::print("prefill -> decode: {} requests in {:.1f} KiB of blobs ({:.0f} bytes a token)\n", requests, moved / 1024.0,
             double(moved) / double(requests * (system_prompt + prompt)));

  // Decode: every resident request one token a step; swap out the newest when the step does not
  // fit, swap in the oldest swapped-out one when it does.
  std::vector<int> done(requests, 0), resident, swapped;
  for (int r = 0; r < requests; ++r) resident.push_back(r);
  int swaps = 0, mismatches = 0, steps = 0;
  auto step_bytes = [&] {
    uint64_t b = 0;
    for (int r : resident) b += decode_worker.bytes_for(1, r).value_or_throw();
    return b;
  };
  while (!resident.empty() || !swapped.empty()) {
    // (64 KiB: room for the resumed request's next page in every layer, so it is not swapped
    // out again at once)
    while (!swapped.empty() && decode_worker.swap_in_bytes(swapped.front()).value_or_throw() + step_bytes() +
                                       (64u << 10) <=
                                   decode_worker.stats().free_bytes) {
      kvq::check(decode_worker.swap_in(swapped.front()));
      resident.push_back(swapped.front());
      swapped.erase(swapped.begin());
    }
    while (resident.size() > 1 && step_bytes() > decode_worker.stats().free_bytes) {
      kvq::check(decode_worker.swap_out(resident.back()));
      swapped.insert(swapped.begin(), resident.back());
      resident.pop_back();
      ++swaps;
    }
    for (size_t i = 0; i < resident.size();) {
      const int r = resident[i];
      const int64_t pos = system_prompt + prompt + done[size_t(r)];
      if (run(decode_worker, r, r, pos, pos + 1) != want[size_t(r)][size_t(done[size_t(r)])]) ++mismatches;
      if (++done[size_t(r)] == outputs) {
        kvq::check(decode_worker.release_sequence(r));
        resident.erase(resident.begin() + std::ptrdiff_t(i));
      } else {
        ++i;
      }
    }
    ++steps;
  }
  const kvq::cache_stats st = decode_worker.stats();
  fmt::print("decode: {} steps, {} swaps out, {:.1f} KiB swapped out and {:.1f} KiB in, {} outputs differ\n", steps, swaps,
             st.swapped_out_bytes / 1024.0, st.swapped_in_bytes / 1024.0, mismatches);
  const bool ok = mismatches == 0 && swaps > 0 && st.swapped_out_bytes == st.swapped_in_bytes && st.sequences == 0 &&
                  st.swapped_sequences == 0;
  fmt::print("{}\n", ok ? "ok: every output equals the unmoved cache's, bit for bit" : "FAILED");
  return ok ? 0 : 1;
}
