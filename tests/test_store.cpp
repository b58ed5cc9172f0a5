// The page store: it allocates pages in the formats its caller chose and knows no policy.
#include <kvq/store/store.hpp>

#include <catch2/catch.hpp>

#include <vector>

using namespace kvq;

namespace {
const cache_shape shape{.layers = 2, .q_heads = 4, .kv_heads = 2, .head_dim = 64, .page_tokens = 64, .window = 128,
                        .recent = 32};

format_id id_of(const char* spec) { return parse_format(spec).value_or_throw(); }
}  // namespace

TEST_CASE("the store allocates the formats it is given, page by page", "[store]") {
  page_store st(shape, 1 << 20, 4);
  sequence_state* s = st.create(7).value_or_throw();
  // a page is encoded once P + r = 96 tokens are unencoded: none after 95 tokens, one per head/role after 100
  CHECK(st.new_pages(*s, 0, 95) == 0);
  REQUIRE(st.new_pages(*s, 0, 100) == 1);
  const std::vector<format_id> f = {id_of("kivi4/g32"), id_of("kivi2/g32"), id_of("sym8"), id_of("fp8")};
  auto plan = st.plan_append(*s, 0, 100, f);
  REQUIRE(plan.ok());
  REQUIRE(plan->entries.size() == 4);
  for (size_t j = 0; j < f.size(); ++j) CHECK(plan->entries[j].fmt == f[j]);
  // the pages of one page index sit back to back in one block, in list order
  CHECK(plan->entries[1].offset == plan->entries[0].offset + st.page_bytes_of(f[0], role::k));
  CHECK(plan->entries[3].offset == plan->entries[2].offset + st.page_bytes_of(f[2], role::k));
  st.commit_append(*s, 0, 100, std::move(plan).value());
  CHECK(st.totals().pages == 4);
  CHECK(st.totals().bytes_by_format[f[1]] == st.page_bytes_of(f[1], role::v));
}

TEST_CASE("the store rejects a wrong format count or an unusable format and allocates nothing", "[store][errors]") {
  page_store st(shape, 1 << 20, 4);
  sequence_state* s = st.create(1).value_or_throw();
  const uint64_t used = st.arena().used();
  const format_id k4 = id_of("kivi4/g32");
  auto few = st.plan_append(*s, 0, 100, std::vector<format_id>(3, k4));
  REQUIRE(!few.ok());
  CHECK(few.error().code() == errc::invalid_argument);
  CHECK_THAT(few.error().message(), Catch::Contains("4 formats needed, 3 given"));
  // sym4/g128 groups 128 channels, which does not divide head_dim 64: named with its page and head
  auto bad = st.plan_append(*s, 0, 100, std::vector<format_id>{k4, k4, k4, id_of("sym4/g128")});
  REQUIRE(!bad.ok());
  CHECK_THAT(bad.error().message(), Catch::Contains("layer 0 page 0 head 1 V"));
  CHECK_THAT(bad.error().message(), Catch::Contains("sym4/g128"));
  CHECK(st.arena().used() == used);
  CHECK(st.totals().pages == 0);
}

TEST_CASE("rewind makes a layer what its appends before a refused one left; shared pages stay", "[store][rewind]") {
  // (KVCache::check on CUDA: the device refused the appends from n = 150 on, the host counted them)
  page_store st(shape, 4 << 20, 4);
  sequence_state* s = st.create(3).value_or_throw();
  const std::vector<format_id> f(4, id_of("kivi4/g32"));
  auto append = [&](sequence_state& q, int64_t m) {
    const int pages = st.new_pages(q, 0, m);
    auto plan = st.plan_append(q, 0, m, std::vector<format_id>(size_t(pages) * 4, f[0])).value_or_throw();
    st.commit_append(q, 0, m, std::move(plan));
  };
  append(*s, 150);  // pages [0, 64); ring from 22
  const layer_state before = s->layers[0];
  const auto totals = st.totals();
  const uint64_t used = st.arena().used();
  REQUIRE(before.e == 64);
  append(*s, 1);    // refused on the device ...
  append(*s, 150);  // ... and so are the appends after it: pages [64, 256) never written
  sequence_state* fork = st.fork(3, 4).value_or_throw();  // lists them too
  REQUIRE(s->layers[0].pages.size() == 4 * 4);
  st.rewind(*s, 0, before.n, before.e, before.ring_from);
  st.rewind(*fork, 0, before.n, before.e, before.ring_from);
  for (const sequence_state* q : {s, fork}) {
    const layer_state& ls = q->layers[0];
    CHECK(ls.n == before.n);
    CHECK(ls.e == before.e);
    CHECK(ls.ring_from == before.ring_from);
    REQUIRE(ls.pages.size() == before.pages.size());
    for (size_t i = 0; i < ls.pages.size(); ++i) CHECK(ls.pages[i].offset == before.pages[i].offset);
  }
  CHECK(st.totals().pages == totals.pages);  // the never-written pages are freed; page 0 is shared
  CHECK(st.totals().page_bytes == totals.page_bytes);
  CHECK(st.totals().tokens == 2 * before.n);
  REQUIRE(st.release(4).ok());
  CHECK(st.arena().used() == used);
  // a truncation issued since stands where it cut deeper
  append(*s, 1);
  append(*s, 150);
  st.truncate(*s, 100);
  st.rewind(*s, 0, before.n, before.e, before.ring_from);
  CHECK(s->layers[0].n == 100);
  CHECK(s->layers[0].e == 64);
  CHECK(s->layers[0].pages.size() == 4);
}
