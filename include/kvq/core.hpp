#pragma once
/// \file
/// The vocabulary every layer of kvq shares: which tensor of the cache (`role`), which sequence
/// (`seq_id`) and the shape of a cache (`cache_shape`). Formats, the store, policies and the
/// cache all include this header; it includes nothing of theirs.

#include <kvq/config.hpp>

#include <cstdint>

KVQ_NAMESPACE_BEGIN

/// Which tensor of the cache a page holds.
enum class role : uint8_t { k = 0, v = 1 };

constexpr const char* role_name(role r) { return r == role::k ? "K" : "V"; }

/// Engine-chosen sequence identifier.
using seq_id = int64_t;

/// Shape of a cache: model dimensions and the paging parameters (docs/architecture.md, "Token
/// life cycle").
struct cache_shape {
  int layers = 0;
  int q_heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int page_tokens = 64;  ///< P: tokens per page
  int window = 128;      ///< R: tokens the FP16 ring holds
  int recent = 64;       ///< r: newest tokens never encoded
};

KVQ_NAMESPACE_END
