// The thread communicator: all-gather in rank order, all-reduce of every type and op, and the
// failures that must reach every rank (timeout, abort, mismatched calls, bad arguments); the NCCL
// entry points of a build without NCCL.
#include <atomic>
#include <catch2/catch.hpp>
#include <cstring>
#include <kvq/dist/nccl_communicator.hpp>
#include <kvq/dist/thread_communicator.hpp>
#include <vector>

#include "tp_ranks.hpp"

using namespace kvq;
using namespace kvq::dist;
using namespace std::chrono_literals;
using kvq_test::all_ok;
using kvq_test::run_ranks;

namespace {

std::vector<std::unique_ptr<communicator>> group(int n, std::chrono::milliseconds timeout = 10s) {
  return make_thread_group(n, timeout).value_or_throw();
}

}  // namespace

TEST_CASE("thread communicator: all_gather returns every contribution in rank order", "[tp]") {
  const int ranks = GENERATE(1, 2, 3, 4);
  const size_t bytes = GENERATE(size_t(1), size_t(7), size_t(64));
  CAPTURE(ranks, bytes);
  auto comms = group(ranks);
  constexpr int rounds = 200;  // back-to-back collectives: a fast rank must not overwrite a slow one's round
  std::vector<int> wrong(size_t(ranks), 0);
  auto errors = run_ranks(ranks, [&](int r) {
    communicator& c = *comms[size_t(r)];
    std::vector<uint8_t> send(bytes), recv(bytes * size_t(ranks));
    for (int round = 0; round < rounds; ++round) {
      for (size_t i = 0; i < bytes; ++i) send[i] = uint8_t(r * 31 + round * 7 + int(i));
      check(c.all_gather(send.data(), recv.data(), bytes, memory_space::host, nullptr));
      for (int from = 0; from < ranks; ++from)
        for (size_t i = 0; i < bytes; ++i)
          wrong[size_t(r)] += recv[size_t(from) * bytes + i] != uint8_t(from * 31 + round * 7 + int(i));
    }
  });
  REQUIRE(all_ok(errors));
  for (int r = 0; r < ranks; ++r) CHECK(wrong[size_t(r)] == 0);
  CHECK(comms[0]->size() == ranks);
  CHECK(comms[size_t(ranks - 1)]->rank() == ranks - 1);
  CHECK_FALSE(comms[0]->device_capable());
}

TEST_CASE("thread communicator: all_reduce of every type and op, the same on every rank", "[tp]") {
  constexpr int ranks = 3;
  auto comms = group(ranks);
  std::vector<std::vector<double>> f64(ranks);
  std::vector<std::vector<int32_t>> i32(ranks);
  std::vector<std::vector<uint8_t>> u8(ranks);
  std::vector<std::vector<float>> f32(ranks);
  std::vector<std::vector<int64_t>> i64(ranks);
  auto errors = run_ranks(ranks, [&](int r) {
    communicator& c = *comms[size_t(r)];
    // rank order matters for a float sum: 1e16 + 1 - 1e16 is 0 in that order, 1 in another
    std::vector<double> d = {r == 0 ? 1e16 : r == 1 ? 1.0 : -1e16, double(r)};
    check(c.all_reduce(d.data(), d.data(), 2, element_type::f64, reduce_op::sum, memory_space::host, nullptr));
    f64[size_t(r)] = d;
    std::vector<int32_t> a = {r - 1, 10 * r}, out(2);
    check(c.all_reduce(a.data(), out.data(), 2, element_type::i32, reduce_op::min, memory_space::host, nullptr));
    i32[size_t(r)] = out;
    std::vector<uint8_t> b = {uint8_t(r), uint8_t(200 - r)};
    check(c.all_reduce(b.data(), b.data(), 2, element_type::u8, reduce_op::max, memory_space::host, nullptr));
    u8[size_t(r)] = b;
    std::vector<float> f = {0.5f * float(r)};
    check(c.all_reduce(f.data(), f.data(), 1, element_type::f32, reduce_op::max, memory_space::host, nullptr));
    f32[size_t(r)] = f;
    std::vector<int64_t> l = {int64_t(1) << (40 + r)};
    check(c.all_reduce(l.data(), l.data(), 1, element_type::i64, reduce_op::sum, memory_space::host, nullptr));
    i64[size_t(r)] = l;
  });
  REQUIRE(all_ok(errors));
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(f64[size_t(r)] == std::vector<double>{0.0, 3.0});
    CHECK(i32[size_t(r)] == std::vector<int32_t>{-1, 0});
    CHECK(u8[size_t(r)] == std::vector<uint8_t>{2, 200});
    CHECK(f32[size_t(r)] == std::vector<float>{1.0f});
    CHECK(i64[size_t(r)] == std::vector<int64_t>{(int64_t(1) << 40) + (int64_t(1) << 41) + (int64_t(1) << 42)});
  }
}

TEST_CASE("thread communicator: a rank that never comes breaks the group on every rank", "[tp]") {
  auto comms = group(3, 150ms);
  std::vector<status> got(3);
  kvq_test::signal timed_out;
  auto errors = run_ranks(3, [&](int r) {
    uint8_t s = uint8_t(r), out[3] = {};
    if (r == 2) timed_out.wait();  // comes after the others gave up
    got[size_t(r)] = comms[size_t(r)]->all_gather(&s, out, 1, memory_space::host, nullptr);
    if (r == 0) timed_out.set();
  });
  REQUIRE(all_ok(errors));
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r, got[size_t(r)].to_string());
    CHECK(got[size_t(r)].code() == errc::comm_error);
    CHECK(got[size_t(r)].message().find("waited 150 ms") != std::string::npos);
    CHECK(comms[size_t(r)]->broken());
  }
  // the group stays broken: a later call fails at once
  uint8_t s = 0, out[3];
  CHECK(comms[0]->all_gather(&s, out, 1, memory_space::host, nullptr).code() == errc::comm_error);
}

TEST_CASE("thread communicator: abort reaches a rank already waiting", "[tp]") {
  auto comms = group(2, 10s);
  status waiting;
  auto errors = run_ranks(2, [&](int r) {
    if (r == 0) {
      std::this_thread::sleep_for(50ms);
      comms[0]->abort("device fault");
    } else {
      uint8_t s = 1, out[2];
      waiting = comms[1]->all_gather(&s, out, 1, memory_space::host, nullptr);
    }
  });
  REQUIRE(all_ok(errors));
  CAPTURE(waiting.to_string());
  CHECK(waiting.code() == errc::comm_error);
  CHECK(waiting.message().find("rank 0 aborted: device fault") != std::string::npos);
}

TEST_CASE("thread communicator: mismatched calls and bad arguments fail on every rank", "[tp]") {
  SECTION("different sizes") {
    auto comms = group(2);
    std::vector<status> got(2);
    auto errors = run_ranks(2, [&](int r) {
      uint8_t s[8] = {}, out[16];
      got[size_t(r)] = comms[size_t(r)]->all_gather(s, out, r == 0 ? 4 : 8, memory_space::host, nullptr);
    });
    REQUIRE(all_ok(errors));
    for (const status& s : got) {
      CAPTURE(s.to_string());
      CHECK(s.code() == errc::comm_error);
      CHECK(s.message().find("all_gather of") != std::string::npos);
    }
  }
  SECTION("a null buffer on one rank") {
    auto comms = group(2);
    std::vector<status> got(2);
    auto errors = run_ranks(2, [&](int r) {
      uint8_t s = 0, out[2];
      got[size_t(r)] = comms[size_t(r)]->all_gather(r == 1 ? nullptr : &s, out, 1, memory_space::host, nullptr);
    });
    REQUIRE(all_ok(errors));
    CHECK(got[1].code() == errc::invalid_argument);
    CHECK(got[0].code() == errc::comm_error);
    CHECK(got[0].message().find("null buffer") != std::string::npos);
  }
  SECTION("device buffers, an empty buffer") {
    auto comms = group(1);
    uint8_t s = 0, out = 0;
    CHECK(comms[0]->all_gather(&s, &out, 1, memory_space::device, nullptr).code() == errc::invalid_argument);
    auto fresh = group(1);
    CHECK(fresh[0]->all_reduce(&s, &out, 0, element_type::u8, reduce_op::sum, memory_space::host, nullptr).code() ==
          errc::invalid_argument);
  }
  SECTION("group parameters") {
    CHECK(make_thread_group(0).error().code() == errc::invalid_argument);
    CHECK(make_thread_group(2, 0ms).error().code() == errc::invalid_argument);
  }
}

#ifndef KVQ_WITH_NCCL
TEST_CASE("a build without NCCL says so", "[tp]") {
  CHECK_FALSE(nccl_available());
  CHECK(nccl_make_id().error().code() == errc::unsupported);
  CHECK(make_nccl_communicator(2, 0, nccl_id{}, 0).error().code() == errc::unsupported);
}
#endif
