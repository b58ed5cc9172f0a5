// libFuzzer target of the sequence blob reader (include/kvq/cache/sequence_blob.hpp): any input
// must give an error status or a blob that imports into a CPU cache of its shape (or is refused
// by name) and exports again to a blob of the same size, without an exception escaping, a crash, a
// leak or an out-of-bounds access. Built with clang and -DKVQ_FUZZ=ON (scripts/test does, in
// build-fuzz/):
//   build-fuzz/tests/fuzz/fuzz_blob -max_total_time=30 corpus/ tests/fuzz/blob_corpus/
// Random bytes rarely keep three CRC-32Cs valid, so half the inputs (the first byte odd) have
// their checksums recomputed before the read: the fuzzer then reaches the meta section's checks.
// The seeds in tests/fuzz/blob_corpus/ come from tests/fuzz/make_blob_seeds.py.
#include <kvq/cache/cache.hpp>
#include <kvq/cache/sequence_blob.hpp>
#include <kvq/policy/static_policy.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

namespace {

// Rewrites the three checksums of a blob-shaped input (header fields as given).
void reseal(std::vector<uint8_t>& b) {
  if (b.size() < kvq::blob_header_bytes) return;
  uint64_t meta = 0;
  std::memcpy(&meta, b.data() + 16, 8);
  const uint64_t rest = b.size() - kvq::blob_header_bytes;
  if (meta > rest) return;
  const std::span<const uint8_t> all(b);
  const uint32_t m = kvq::crc32c(all.subspan(kvq::blob_header_bytes, meta));
  const uint32_t p = kvq::crc32c(all.subspan(kvq::blob_header_bytes + meta));
  std::memcpy(b.data() + 32, &m, 4);
  std::memcpy(b.data() + 36, &p, 4);
  const uint32_t h = kvq::crc32c(all.first(44));
  std::memcpy(b.data() + 44, &h, 4);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::vector<uint8_t> blob(data + 1, data + size);
  if (data[0] & 1) reseal(blob);
  auto info = kvq::inspect_blob(blob);
  if (!info.ok()) return 0;
  // A blob the reader accepts imports into a small CPU cache of its shape, or is refused by name.
  const kvq::cache_shape& sh = info->shape;
  if (uint64_t(sh.layers) * sh.kv_heads * sh.window * sh.head_dim > (uint64_t(1) << 22)) return 0;
  kvq::cache_config cfg;
  cfg.shape = sh;
  cfg.budget_bytes = std::min<uint64_t>(info->total_bytes() * 2 + (1u << 20), uint64_t(1) << 28);
  cfg.sink_pages = info->sink_pages;
  cfg.rotation = info->rotation;
  for (int32_t w : info->windows) cfg.attention.push_back({w, 0.f, {}});
  cfg.max_sequences = int(std::min<size_t>(info->sequences.size(), 64));
  auto made = kvq::KVCache::create(cfg, std::make_shared<kvq::static_policy>(kvq::static_policy::parse("fp16").value()));
  if (!made.ok()) return 0;
  kvq::KVCache cache = std::move(made).value();
  std::vector<kvq::seq_id> ids;
  for (size_t i = 0; i < info->sequences.size(); ++i) ids.push_back(kvq::seq_id(i));
  if (!cache.import_sequences(blob, ids).ok()) return 0;
  auto again = cache.export_sequences(ids);
  // (an older version's blob comes back in this build's version: the same sequences, other sizes)
  if (!again.ok() || !kvq::inspect_blob(*again).ok()) std::abort();
  if (info->version == kvq::blob_version && again->size() != blob.size()) std::abort();
  return 0;
}
