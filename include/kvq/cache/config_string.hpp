#pragma once
/// \file
/// Configuration strings: the spelling kvq-eval, the decode benchmark and the Python package take
/// for a cache, a policy or format spec (`make_policy`) followed by cache suffixes. Not part of the
/// `KVCache` facade: a cache is configured by `cache_config`; this is the tools' shorthand for it.

#include <kvq/cache/cache_config.hpp>
#include <kvq/config.hpp>
#include <kvq/status.hpp>

#include <string_view>

KVQ_NAMESPACE_BEGIN

/// The cache properties a configuration string names after its policy or format spec, in any
/// order: `+rot` (every (layer, kv head) rotated, `cache_config::rotation`) and `+sink` /
/// `+sink<N>` (the first page, or N pages, of every sequence FP16, `cache_config::sink_pages`).
/// `kivi4/g32+rot+sink` is the spec `kivi4/g32`, rotated, one sink page. The spelling kvq-eval
/// and the decode benchmark take.
struct cache_suffixes {
  std::string_view spec;  ///< what precedes the suffixes (a view into the parsed string)
  bool rotated = false;
  int sink_pages = 0;
  /// Sets `cfg.rotation` (every kv head of `cfg.shape`, which must be set, or none) and
  /// `cfg.sink_pages` to what the suffixes name.
  KVQ_EXPORT void apply(cache_config& cfg) const;
};

/// Takes the suffixes off the end of `config`. A '+' followed by anything else ends them (it
/// belongs to the spec); a repeated suffix, `+sink0` or `+sink` followed by other than a number
/// in [1, 1024] is an error naming the configuration.
KVQ_EXPORT result<cache_suffixes> parse_cache_suffixes(std::string_view config);

KVQ_NAMESPACE_END
