#pragma once
/// \file
/// Policies by name: the configuration string a user writes (kvq-eval, the Python package, the
/// benchmarks) and the policy it names. One table (`policy_registry`) holds every named policy;
/// `make_policy` and every `--help` text read it, so adding a policy is one entry.
///
/// Grammar of a configuration (without the `+rot` / `+sink` suffixes, `parse_cache_suffixes`):
/// `<policy>:<params>` or a bare format spec.
/// - `static:<spec>`: `static_policy::parse` spec, e.g. `static:k=kivi4/g32,v=kivi2/g32;0=fp16`.
/// - a bare spec (no known `<policy>:` prefix) is the same as `static:<spec>`: `fp16`, `int8`,
///   `kivi4/g32`, `ra4/g32`, `fp8`, `k=sym8,v=kivi4/g32;0.1=fp16`.
/// - `kl_budget:`, `autok:`, `random:`, `echokv:` with `key=value` parameters (their syntax and
///   help in the registry); kl_budget and autok read a calibration artifact (`artifact=PATH`).

#include <kvq/config.hpp>
#include <kvq/format/format.hpp>
#include <kvq/policy/policy.hpp>
#include <kvq/status.hpp>

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

KVQ_NAMESPACE_BEGIN

/// What a policy is made for: the cache's shape, and whether every (layer, kv head) is rotated
/// (`<config>+rot`). Policies that read a calibration artifact (kl_budget, autok) read its rotated
/// damages for a rotated cache: a format's damage differs a lot with and without rotation.
struct policy_target {
  cache_shape shape;
  bool rotated = false;
};

/// Builds a policy from its parameter string (the part after `<name>:`) for `target`.
/// Errors name the bad parameter.
using policy_factory =
    std::function<result<std::shared_ptr<policy>>(std::string_view params, const policy_target& target)>;

/// One named policy of the registry.
struct policy_entry {
  std::string name;    ///< prefix before ':' in a configuration, e.g. "static"
  std::string syntax;  ///< e.g. "static:<format spec>"
  std::string help;    ///< one line for --help
  policy_factory make;
};

/// Every policy known by name, in --help order; the first is `static`.
KVQ_EXPORT const std::vector<policy_entry>& policy_registry();

/// The policy a configuration string names (grammar above, without the suffixes), for a cache of
/// `shape`, rotated or not. The policy is not bound yet (`KVCache::create` binds it). Errors
/// (invalid_argument) quote the configuration: an unknown `<policy>:` prefix lists the known ones;
/// a bad spec gives the parser's message; a rotated cache's kl_budget or autok whose artifact
/// holds no rotated damages (or damages of another rotation seed than `+rot`'s) says so.
KVQ_EXPORT result<std::shared_ptr<policy>> make_policy(std::string_view name_and_params, const cache_shape& shape,
                                                       bool rotated = false);

KVQ_NAMESPACE_END
