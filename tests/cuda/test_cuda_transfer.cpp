// Moving sequences on CUDA: a blob exported from the GPU is the blob the CPU exports for the same
// calls, byte for byte; CPU -> CUDA -> CPU round trips keep every byte; attention after an import
// or a swap on the GPU equals attention before it bit for bit; swaps run on the caller's stream.
// And an engine's own block copies (plain cudaMemcpyAsync of kvq's blocks in an engine-owned pool,
// to pinned host memory and back into other block ids, and device to device) leave attention
// bit for bit as it was.
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <kvq/cache/cache.hpp>
#include <kvq/cache/sequence_blob.hpp>
#include <kvq/cuda/paged_attention.hpp>
#include <kvq/policy/static_policy.hpp>
#include <random>
#include <string>
#include <vector>

#include "cache_reads.hpp"
#include "gpu_test.hpp"
#include "pool_engine.hpp"

using namespace kvq;
using namespace kvq::gpu_test;

namespace {

// P = 64, R = 128, r = 32: a page is encoded once 96 tokens are unencoded.
constexpr int layers = 2, hq = 8, kvh = 2, d = 64;

cache_config config(const std::string& suffixes, backend where) {
  cache_config cfg;
  cfg.shape = {layers, hq, kvh, d, 64, 128, 32};
  cfg.budget_bytes = 64ull << 20;
  cfg.max_sequences = 8;
  cfg.max_tokens = 4096;
  cfg.where = where;
  cfg.swap_bytes = 16u << 20;
  if (suffixes.find("+rot") != std::string::npos) cfg.rotation = rotation_config::all(cfg.shape, 99);
  if (suffixes.find("+sink") != std::string::npos) cfg.sink_pages = 1;
  return cfg;
}

KVCache make(const std::string& spec, const std::string& suffixes, backend where) {
  return KVCache::create(config(suffixes, where),
                         std::make_shared<static_policy>(static_policy::parse(spec).value_or_throw()))
      .value_or_throw();
}

// The same `n` random fp16 tokens appended to every layer of `seq` on every cache of `cs`.
void append_all(std::vector<KVCache*> cs, seq_id seq, int64_t n, std::mt19937& rng) {
  for (int l = 0; l < layers; ++l) {
    const auto k = randn_h(rng, size_t(n) * kvh * d), v = randn_h(rng, size_t(n) * kvh * d);
    dev_mem dk(k.size() * 2), dv(v.size() * 2);
    upload(dk, k);
    upload(dv, v);
    for (KVCache* c : cs) {
      const bool gpu = c->config().where == backend::cuda;
      check(c->append(seq, l, {gpu ? dk.p : k.data(), dtype::f16, n, kvh, d},
                      {gpu ? dv.p : v.data(), dtype::f16, n, kvh, d}));
    }
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  }
}

// One decode query per layer (seeded) on a GPU cache, on `stream`; the outputs.
std::vector<float> attend_gpu(KVCache& c, seq_id seq, cudaStream_t stream = nullptr) {
  std::mt19937 rng(5);
  std::vector<float> out;
  for (int l = 0; l < layers; ++l) {
    const auto q = randn_h(rng, size_t(hq) * d);
    dev_mem dq(q.size() * 2), dout(q.size() * 4);
    upload(dq, q);
    const attend_item it{seq, 1};
    check(c.attend({&it, 1}, l, {dq.p, dtype::f16, 1, hq, d}, {dout.p, dtype::f32, 1, hq, d}, stream));
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    std::vector<float> o(q.size());
    REQUIRE(cudaMemcpy(o.data(), dout.p, o.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
    out.insert(out.end(), o.begin(), o.end());
  }
  return out;
}

const std::vector<std::pair<std::string, std::string>> cases = {
    {"kivi4/g32", ""},  {"k=kivi4/g32,v=kivi2/g32", "+rot+sink"}, {"sym8", ""},     {"fp8", "+rot"},
    {"cb4/g32", "+rot"}, {"nvfp4", ""},                             {"kivi3/g32", ""}, {"fp16", "+sink"},
    {"kivi2/g32;1=sym4", ""}};

}  // namespace

TEST_CASE("gpu: blobs of the GPU are the CPU's, and round trips between them keep every byte", "[gpu][transfer]") {
  for (const auto& [spec, suffixes] : cases) {
    CAPTURE(spec, suffixes);
    std::mt19937 rng(3);
    KVCache cpu = make(spec, suffixes, backend::cpu), gpu = make(spec, suffixes, backend::cuda);
    for (KVCache* c : {&cpu, &gpu}) {
      check(c->create_sequence(1));
      check(c->create_sequence(2));
    }
    append_all({&cpu, &gpu}, 1, 700, rng);
    append_all({&cpu, &gpu}, 2, 45, rng);
    check(cpu.fork(1, 3));
    check(gpu.fork(1, 3));
    append_all({&cpu, &gpu}, 3, 130, rng);
    const std::vector<seq_id> ids{1, 2, 3};
    const std::vector<uint8_t> from_cpu = cpu.export_sequences(ids).value_or_throw();
    const std::vector<uint8_t> from_gpu = gpu.export_sequences(ids).value_or_throw();
    REQUIRE(from_gpu.size() == from_cpu.size());
    CHECK(from_gpu == from_cpu);

    // CPU -> CUDA -> CPU
    KVCache gpu2 = make(spec, suffixes, backend::cuda);
    check(gpu2.import_sequences(from_cpu, ids));
    const std::vector<uint8_t> back = gpu2.export_sequences(ids).value_or_throw();
    CHECK(back == from_cpu);
    KVCache cpu2 = make(spec, suffixes, backend::cpu);
    check(cpu2.import_sequences(back, ids));
    CHECK(cpu2.export_sequences(ids).value_or_throw() == from_cpu);
    CHECK(gpu2.stats().shared_pages == gpu.stats().shared_pages);

    // the imported sequences go on as the originals: the same appends write the same bytes
    append_all({&gpu, &gpu2}, 3, 70, rng);
    append_all({&gpu, &gpu2}, 2, 100, rng);
    for (seq_id s : ids) CHECK(kvq::test::read_all(gpu2, s) == kvq::test::read_all(gpu, s));
  }
}

TEST_CASE("gpu: attention after an import or a swap equals attention before it, bit for bit", "[gpu][transfer]") {
  cudaStream_t stream;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  for (const auto& [spec, suffixes] : cases) {
    CAPTURE(spec, suffixes);
    std::mt19937 rng(4);
    KVCache a = make(spec, suffixes, backend::cuda);
    check(a.create_sequence(1));
    append_all({&a}, 1, 900, rng);
    const std::vector<float> before = attend_gpu(a, 1);
    const std::vector<seq_id> one{1};
    const std::vector<uint8_t> blob = a.export_sequences(one).value_or_throw();

    // into a fresh cache of the same configuration (its decode plan: these pages only, as a's)
    KVCache b = make(spec, suffixes, backend::cuda);
    check(b.import_sequences(blob, one));
    CHECK(attend_gpu(b, 1) == before);

    // swapped out and back on a stream of the caller's, with a sequence taking the freed bytes
    // in between: the swap-in lands elsewhere in the arena
    const uint64_t free_before = a.stats().free_bytes;
    check(a.swap_out(1, stream));
    CHECK(a.stats().free_bytes > free_before);
    check(a.create_sequence(2, stream));
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    append_all({&a}, 2, 300, rng);
    check(a.swap_in(1, stream));
    CHECK(attend_gpu(a, 1, stream) == before);
    CHECK(a.export_sequences(one, stream).value_or_throw().size() == blob.size());
  }
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
}

TEST_CASE("gpu: an engine's own block copies move kvq's blocks unchanged", "[gpu][transfer][pool]") {
  namespace pt = kvq::pool_test;
  std::mt19937 rng(8);
  pt::engine host;
  const size_t layer_bytes = size_t(pt::pool_blocks) * host.block_bytes;
  dev_mem pool(host.pool.size()), windows(host.windows.size()), table(host.table.size() * sizeof(int32_t));
  dev_mem workspace(64u << 20);
  REQUIRE(cudaMemset(pool.p, 0, host.pool.size()) == cudaSuccess);
  REQUIRE(cudaMemset(windows.p, 0, host.windows.size()) == cudaSuccess);
  const auto view = [&] {
    cuda::paged_view kv = host.view();
    kv.arena = static_cast<const uint8_t*>(pool.p);
    kv.blocks = static_cast<const uint32_t*>(table.p);
    kv.windows = static_cast<const uint8_t*>(windows.p);
    return kv;
  };
  // sequence 0: 330 tokens in chunks (5 pages per layer), written by kvq's encoder on the device
  const int one[] = {0};
  for (int32_t T : {200, 130})
    for (int l = 0; l < pt::layers; ++l) {
      const auto k = pt::randn(rng, size_t(T) * pt::kvh * pt::d), v = pt::randn(rng, size_t(T) * pt::kvh * pt::d);
      const int32_t m[] = {T};
      const auto c = host.plan_append(one, m, l, pt::rows(k, T, pt::kvh), pt::rows(v, T, pt::kvh));
      upload(table, host.table);
      dev_mem kd(k.size() * 4), vd(v.size() * 4);
      upload(kd, k);
      upload(vd, v);
      cuda::append_args a = c->args;
      a.kv = view();
      a.arena = static_cast<uint8_t*>(pool.p), a.windows = static_cast<uint8_t*>(windows.p);
      a.k = {kd.p, dtype::f32, T, pt::kvh, pt::d}, a.v = {vd.p, dtype::f32, T, pt::kvh, pt::d};
      REQUIRE(cuda::append_run(a, nullptr).ok());
      host.commit(one, m, l);
    }
  const auto q = pt::randn(rng, size_t(pt::layers) * pt::hq * pt::d);
  const auto attend = [&] {
    std::vector<float> out;
    for (int l = 0; l < pt::layers; ++l) {
      const auto items = host.decode_items(one);
      cuda::attend_args a;
      a.kv = view();
      a.layer = l, a.q_heads = pt::hq;
      a.items = items;
      std::vector<float> ql(q.begin() + l * pt::hq * pt::d, q.begin() + (l + 1) * pt::hq * pt::d);
      dev_mem qd(ql.size() * 4), od(ql.size() * 4);
      upload(qd, ql);
      a.q = qd.p, a.q_type = dtype::f32, a.o = od.p, a.o_type = dtype::f32;
      a.one_format_per_head = true;
      REQUIRE(cuda::attend_run(a, workspace.p, 64u << 20, nullptr).ok());
      std::vector<float> o(ql.size());
      REQUIRE(cudaMemcpy(o.data(), od.p, o.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
      out.insert(out.end(), o.begin(), o.end());
    }
    return out;
  };
  const std::vector<float> before = attend();
  const int pages = host.seqs[0].e / pt::P;
  REQUIRE(pages == 4);

  // The engine swaps the sequence out: its blocks of every layer and its window block to pinned
  // host memory, by cudaMemcpyAsync on its stream; then another sequence overwrites them.
  cudaStream_t s;
  REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
  const uint64_t wb = cuda::window_block_bytes(pt::layers, pt::kvh, pt::d, pt::R);
  uint8_t* pinned = nullptr;
  REQUIRE(cudaMallocHost(reinterpret_cast<void**>(&pinned), size_t(pt::layers) * pages * host.block_bytes + wb) ==
          cudaSuccess);
  uint8_t* dpool = static_cast<uint8_t*>(pool.p);
  uint8_t* dwin = static_cast<uint8_t*>(windows.p);
  const auto block_at = [&](int l, int32_t id) { return dpool + size_t(l) * layer_bytes + size_t(id) * host.block_bytes; };
  size_t at = 0;
  for (int l = 0; l < pt::layers; ++l)
    for (int p = 0; p < pages; ++p, at += host.block_bytes)
      REQUIRE(cudaMemcpyAsync(pinned + at, block_at(l, host.table[size_t(p)]), host.block_bytes,
                              cudaMemcpyDeviceToHost, s) == cudaSuccess);
  const size_t win0 = size_t(host.seqs[0].window_unit) * 256;
  REQUIRE(cudaMemcpyAsync(pinned + at, dwin + win0, wb, cudaMemcpyDeviceToHost, s) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(dpool, 0x5a, host.pool.size(), s) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(dwin, 0x5a, host.windows.size(), s) == cudaSuccess);

  // ... and in again, into other block ids and another slot's window
  const int32_t moved = 20;
  at = 0;
  for (int l = 0; l < pt::layers; ++l)
    for (int p = 0; p < pages; ++p, at += host.block_bytes)
      REQUIRE(cudaMemcpyAsync(block_at(l, moved + p), pinned + at, host.block_bytes, cudaMemcpyHostToDevice, s) ==
              cudaSuccess);
  const size_t win2 = size_t(host.seqs[2].window_unit) * 256;
  REQUIRE(cudaMemcpyAsync(dwin + win2, pinned + at, wb, cudaMemcpyHostToDevice, s) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  for (int p = 0; p < pages; ++p) host.table[size_t(p)] = moved + p;
  host.seqs[0].window_unit = host.seqs[2].window_unit;
  upload(table, host.table);
  CHECK(attend() == before);

  // a device-to-device copy of the blocks (an engine's copy_blocks), the old ones overwritten
  for (int l = 0; l < pt::layers; ++l)
    for (int p = 0; p < pages; ++p)
      REQUIRE(cudaMemcpyAsync(block_at(l, 30 + p), block_at(l, moved + p), host.block_bytes, cudaMemcpyDeviceToDevice,
                              s) == cudaSuccess);
  for (int l = 0; l < pt::layers; ++l)
    REQUIRE(cudaMemsetAsync(block_at(l, moved), 0, size_t(pages) * host.block_bytes, s) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  for (int p = 0; p < pages; ++p) host.table[size_t(p)] = 30 + p;
  upload(table, host.table);
  CHECK(attend() == before);
  REQUIRE(cudaFreeHost(pinned) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}
