#pragma once
/// \file
/// The byte budget of a cache: one range of `capacity` bytes from which pages of every format
/// and the recent windows are carved. A block freed by one format is reusable by any other (no
/// per-format partition): free ranges are coalesced with their neighbours and requests are served
/// best-fit. Offsets, not pointers: the same allocator serves host and device arenas.
///
/// Not thread-safe; owned by one cache.

#include <kvq/config.hpp>
#include <kvq/store/window_layout.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>

KVQ_NAMESPACE_BEGIN

class arena_allocator {
 public:
  /// Every block starts at a multiple of this many bytes (16-byte loads, 128-byte lines).
  static constexpr uint64_t alignment = block_unit;

  arena_allocator() = default;
  explicit arena_allocator(uint64_t capacity) : capacity_(capacity / alignment * alignment) {
    if (capacity_) insert_free(0, capacity_);
  }

  /// Bytes a request of `bytes` really takes.
  static constexpr uint64_t rounded(uint64_t bytes) { return (bytes + alignment - 1) / alignment * alignment; }

  /// Offset of a new block of at least `bytes`, or nothing when no free range is large enough.
  std::optional<uint64_t> allocate(uint64_t bytes) {
    const uint64_t need = rounded(bytes ? bytes : 1);
    auto it = by_size_.lower_bound({need, 0});
    if (it == by_size_.end()) return std::nullopt;
    const auto [size, off] = *it;
    erase_free(off, size);
    if (size > need) insert_free(off + need, size - need);
    used_ += need;
    live_.emplace(off, need);
    return off;
  }

  /// Returns a block; its neighbours coalesce, so allocate-then-free restores the exact free
  /// list (multi-page appends roll back this way). Freeing an unknown offset is a no-op returning false.
  bool free(uint64_t off) {
    auto lv = live_.find(off);
    if (lv == live_.end()) return false;
    uint64_t start = off, size = lv->second;
    live_.erase(lv);
    used_ -= size;
    auto next = by_offset_.lower_bound(start);
    if (next != by_offset_.end() && next->first == start + size) {
      size += next->second;
      erase_free(next->first, next->second);
    }
    auto prev = by_offset_.lower_bound(start);
    if (prev != by_offset_.begin()) {
      --prev;
      if (prev->first + prev->second == start) {
        start = prev->first;
        size += prev->second;
        erase_free(prev->first, prev->second);
      }
    }
    insert_free(start, size);
    return true;
  }

  uint64_t capacity() const { return capacity_; }
  uint64_t used() const { return used_; }
  uint64_t free_bytes() const { return capacity_ - used_; }
  size_t live_blocks() const { return live_.size(); }
  /// Largest single block that can be allocated now.
  uint64_t largest_free() const { return by_size_.empty() ? 0 : by_size_.rbegin()->first; }

 private:
  void insert_free(uint64_t off, uint64_t size) {
    by_offset_.emplace(off, size);
    by_size_.emplace(size, off);
  }
  void erase_free(uint64_t off, uint64_t size) {
    by_offset_.erase(off);
    by_size_.erase({size, off});
  }

  uint64_t capacity_ = 0;
  uint64_t used_ = 0;
  std::map<uint64_t, uint64_t> by_offset_;        // free: offset -> size
  std::set<std::pair<uint64_t, uint64_t>> by_size_;  // free: (size, offset)
  std::map<uint64_t, uint64_t> live_;             // allocated: offset -> size
};

KVQ_NAMESPACE_END
