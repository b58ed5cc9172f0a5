#pragma once
/// \file
/// A compile-time list of types and the two folds kvq runs over it: every type in order
/// (`for_each_type`, for tables and names) and the type at a runtime index (`visit_at`, for
/// dispatch). Both are `KVQ_HOST_DEVICE` and unroll completely: no table, no indirect call.

#include <kvq/config.hpp>

#include <cstddef>
#include <utility>

KVQ_NAMESPACE_BEGIN

/// An ordered list of types; the order is meaningful (a format's id is its index).
template <class... Ts>
struct type_list {
  static constexpr size_t size = sizeof...(Ts);
};

/// Calls `f.template operator()<I, T>()` for each type T of the list, I its index, in order.
template <class... Ts, class F>
KVQ_HOST_DEVICE constexpr void for_each_type(type_list<Ts...>, F&& f) {
  [&]<size_t... Is>(std::index_sequence<Is...>) {
    (f.template operator()<Is, Ts>(), ...);
  }(std::index_sequence_for<Ts...>{});
}

/// Calls `f.template operator()<T>()` for the type T at index `i` of the list and returns true,
/// or returns false (calling nothing) when `i` is out of range.
template <class... Ts, class F>
KVQ_HOST_DEVICE constexpr bool visit_at(type_list<Ts...>, size_t i, F&& f) {
  return [&]<size_t... Is>(std::index_sequence<Is...>) {
    return ((i == Is ? (f.template operator()<Ts>(), true) : false) || ...);
  }(std::index_sequence_for<Ts...>{});
}

KVQ_NAMESPACE_END
