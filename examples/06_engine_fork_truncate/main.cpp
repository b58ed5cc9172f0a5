// Example 06: an engine loop with a shared system prompt, speculative decoding and admission
// control.
//
// What an engine developer learns here:
// - `fork(src, dst)`: the system prompt is prefilled once into sequence 0; every request starts
//   as a fork of it. The prompt's pages are shared (stored and counted once, reference-counted:
//   a request's release frees nothing the others use); each fork gets its own FP16 window, which
//   is all a fork costs;
// - `truncate(seq, length)`: each step appends a speculative draft of several tokens, verifies
//   it with one `attend` (q_len = draft length) and rolls the rejected tokens back. A cut never
//   reaches past the ring, so the cache ends exactly as if only the accepted tokens had been
//   appended;
// - `bytes_for`: what a request will take (its window: `bytes_for(0)`, and the pages of its
//   prompt, outputs and one draft on top of the shared prefix: `bytes_for(tokens, 0)`) is known
//   before it is admitted; a request that does not fit waits for a release. `stats()` gives the
//   free bytes, the largest free block and what sharing saves.
//
// Self-checking: returns non-zero when a request never completes, an append would have exceeded
// what admission reserved, nothing waited or nothing was shared (the scenario would not show
// them), or a finished request's cache differs, bit for bit (read and attention), from a cache fed
// the system prompt and the accepted tokens alone.
#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <kvq/cache/cache.hpp>
#include <kvq/policy/static_policy.hpp>
#include <memory>
#include <random>
#include <vector>

namespace {

constexpr int layers = 4, q_heads = 8, kv_heads = 2, d = 64;
constexpr int64_t system_prompt = 300;  // tokens shared by every request
constexpr int draft = 4;                // speculative tokens per step
constexpr const char* spec = "kivi4/g32";

// Stand-in for the model: K, V, Q rows of (request, layer, position, attempt), deterministic.
// A draft token rejected at a position differs from the one later accepted there (its attempt).
void model_rows(int req, int layer, int64_t pos, int attempt, float* k, float* v, float* q) {
  std::mt19937 rng(uint32_t(req * 7919 + layer * 104729 + pos * 31 + attempt * 15485863));
  std::normal_distribution<float> nd;
  for (int i = 0; i < kv_heads * d; ++i) k[i] = nd(rng), v[i] = nd(rng);
  for (int i = 0; i < q_heads * d; ++i) q[i] = nd(rng);
}

// Appends `m` tokens (positions pos.., attempt) of a request through every layer, then attends
// with their queries: a prefill chunk or a draft to verify.
void step(kvq::KVCache& cache, kvq::seq_id seq, int req, int64_t pos, int m, int attempt) {
  std::vector<float> k(size_t(m) * kv_heads * d), v(k.size()), q(size_t(m) * q_heads * d), o(q.size());
  for (int l = 0; l < layers; ++l) {
    for (int t = 0; t < m; ++t)
      model_rows(req, l, pos + t, attempt, &k[size_t(t) * kv_heads * d], &v[size_t(t) * kv_heads * d],
                 &q[size_t(t) * q_heads * d]);
    kvq::check(
        cache.append(seq, l, {k.data(), kvq::dtype::f32, m, kv_heads, d}, {v.data(), kvq::dtype::f32, m, kv_heads, d}));
    const kvq::attend_item it{seq, m};
    kvq::check(cache.attend({&it, 1}, l, {q.data(), kvq::dtype::f32, m, q_heads, d},
                            {o.data(), kvq::dtype::f32, m, q_heads, d}));
  }
}

kvq::cache_config config(uint64_t budget) {
  kvq::cache_config cfg;
  cfg.shape = {layers, q_heads, kv_heads, d, 64, 128, 64};
  cfg.budget_bytes = budget;
  return cfg;
}

kvq::KVCache make(uint64_t budget) {
  return kvq::KVCache::create(config(budget),
                              std::make_shared<kvq::static_policy>(kvq::static_policy::parse(spec).value_or_throw()))
      .value_or_throw();
}

// Prefills the system prompt (request -1) in chunks of at most the window.
void prefill_system(kvq::KVCache& cache, kvq::seq_id seq) {
  for (int64_t p = 0; p < system_prompt; p += 128)
    step(cache, seq, -1, p, int(std::min<int64_t>(128, system_prompt - p)), 0);
}

struct request {
  int id;
  int64_t prompt, max_new;
};

struct running {
  request req;
  int64_t produced = 0;         // accepted output tokens
  std::vector<int> attempt_of;  // per position after the system prompt: the attempt it was accepted in
  uint64_t reserved = 0;        // bytes admission set aside
};

// Appends the tokens of a request at positions from..from + attempts.size() to every layer, each
// token as accepted in its attempt, without attention: how the reference cache is fed.
void append_accepted(kvq::KVCache& cache, kvq::seq_id seq, int req, int64_t from, const std::vector<int>& attempts) {
  std::vector<float> k(kv_heads * d), v(k.size()), q(q_heads * d);
  for (size_t p = 0; p < attempts.size(); ++p)
    for (int l = 0; l < layers; ++l) {
      model_rows(req, l, from + int64_t(p), attempts[p], k.data(), v.data(), q.data());
      kvq::check(cache.append(seq, l, {k.data(), kvq::dtype::f32, 1, kv_heads, d},
                              {v.data(), kvq::dtype::f32, 1, kv_heads, d}));
    }
}

// Everything a sequence's layers and roles read, bit for bit, then the output of one attention
// step (q_len 1, fixed queries) of every layer.
std::vector<float> fingerprint(kvq::KVCache& cache, kvq::seq_id seq) {
  std::vector<float> out, x, k(kv_heads * d), v(k.size()), q(q_heads * d), o(q.size());
  for (int l = 0; l < layers; ++l) {
    for (kvq::role r : {kvq::role::k, kvq::role::v}) {
      x.resize(size_t(cache.length(seq, l)) * kv_heads * d);
      kvq::check(cache.read(seq, l, r, x));
      out.insert(out.end(), x.begin(), x.end());
    }
    model_rows(-2, l, 0, 0, k.data(), v.data(), q.data());
    const kvq::attend_item it{seq, 1};
    kvq::check(cache.attend({&it, 1}, l, {q.data(), kvq::dtype::f32, 1, q_heads, d},
                            {o.data(), kvq::dtype::f32, 1, q_heads, d}));
    out.insert(out.end(), o.begin(), o.end());
  }
  return out;
}

}  // namespace

int main() {
  int failures = 0;
  auto expect = [&](bool ok, const std::string& what) {
    if (!ok) fmt::print(stderr, "check failed: {}\n", what), ++failures;
  };
  kvq::KVCache cache = make(1536 << 10);
  kvq::check(cache.create_sequence(0));
  prefill_system(cache, 0);

  std::deque<request> queue;
  for (int i = 0; i < 8; ++i) queue.push_back({i, 20 + 37 * (i % 4), 40 + 29 * (i % 3)});
  std::vector<running> batch;
  std::mt19937 accept_rng(5);
  uint64_t committed = cache.stats().used_bytes;  // the system prompt's bytes plus every reservation
  uint64_t peak_saved = 0, peak_shared = 0;
  int completed = 0, waited = 0, steps = 0, rolled_back = 0;

  while (!queue.empty() || !batch.empty()) {
    // Admission: a fork's window plus the pages its prompt, outputs and one draft add to the
    // shared prefix, admitted while the budget can hold every reservation.
    while (!queue.empty()) {
      const request r = queue.front();
      const uint64_t need = cache.bytes_for(0).value_or_throw() +
                            cache.bytes_for(r.prompt + r.max_new + draft, kvq::seq_id(0)).value_or_throw();
      if (committed + need > cache.stats().budget_bytes ||
          cache.stats().largest_free_block < cache.bytes_for(0).value_or_throw())
        break;
      queue.pop_front();
      waited += steps > 0;
      committed += need;
      const kvq::seq_id seq = r.id + 1;
      kvq::check(cache.fork(0, seq));
      for (int64_t p = 0; p < r.prompt; p += 128)
        step(cache, seq, r.id, system_prompt + p, int(std::min<int64_t>(128, r.prompt - p)), 0);
      running run{r};
      run.attempt_of.assign(size_t(r.prompt), 0);
      run.reserved = need;
      batch.push_back(std::move(run));
    }
    if (batch.empty()) {
      fmt::print(stderr, "request {} never fits the budget\n", queue.front().id);
      return 1;
    }
    // One decode step: every request appends a draft, verifies it and keeps what was accepted.
    ++steps;
    for (running& run : batch) {
      const kvq::seq_id seq = run.req.id + 1;
      const int64_t n = cache.length(seq, 0);
      const int attempt = steps;
      step(cache, seq, run.req.id, n, draft, attempt);
      const int accepted = int(
          std::min<int64_t>(std::uniform_int_distribution<int>(0, draft)(accept_rng), run.req.max_new - run.produced));
      if (accepted < draft) {
        kvq::check(cache.truncate(seq, n + accepted));
        ++rolled_back;
      }
      run.produced += accepted;
      run.attempt_of.insert(run.attempt_of.end(), size_t(accepted), attempt);
    }
    const kvq::cache_stats st = cache.stats();
    expect(st.used_bytes <= committed,
           fmt::format("step {}: {} bytes used, {} committed", steps, st.used_bytes, committed));
    peak_saved = std::max(peak_saved, st.shared_saved_bytes);
    peak_shared = std::max(peak_shared, st.shared_pages);
    // Retire finished requests after checking each against a cache fed only what it accepted.
    for (size_t i = 0; i < batch.size();) {
      running& run = batch[i];
      if (run.produced < run.req.max_new) {
        ++i;
        continue;
      }
      const kvq::seq_id seq = run.req.id + 1;
      kvq::KVCache ref = make(64ull << 20);
      kvq::check(ref.create_sequence(seq));
      prefill_system(ref, seq);
      append_accepted(ref, seq, run.req.id, system_prompt, run.attempt_of);
      expect(fingerprint(cache, seq) == fingerprint(ref, seq),
             fmt::format("request {} reads what a cache fed its accepted tokens alone reads", run.req.id));
      kvq::check(cache.release_sequence(seq));
      committed -= run.reserved;
      ++completed;
      batch.erase(batch.begin() + ptrdiff_t(i));
    }
  }
  const kvq::cache_stats st = cache.stats();
  kvq::KVCache prefix_only = make(64ull << 20);
  kvq::check(prefix_only.create_sequence(0));
  prefill_system(prefix_only, 0);
  fmt::print("{} requests over {} steps, {} drafts rolled back, {} admitted after waiting for memory\n", completed,
             steps, rolled_back, waited);
  fmt::print(
      "sharing: up to {} shared pages, {} bytes saved at once; now {} of {} budget bytes used (free {}, largest "
      "block {})\n",
      peak_shared, peak_saved, st.used_bytes, st.budget_bytes, st.free_bytes, st.largest_free_block);
  expect(completed == 8, "every request completed");
  expect(waited > 0, "some request waited for memory (the scenario shows admission control)");
  expect(rolled_back > 0, "some draft was rolled back");
  expect(peak_saved > 0 && peak_shared > 0, "the system prompt's pages were shared");
  expect(st.used_bytes == prefix_only.stats().used_bytes && st.shared_pages == 0,
         "after every release only the system prompt is held");
  expect(fingerprint(cache, 0) == fingerprint(prefix_only, 0), "the system prompt never changed");
  return failures ? 1 : 0;
}
