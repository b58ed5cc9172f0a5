// The static policy: table precedence, spec parsing, binding errors.
#include <kvq/policy/static_policy.hpp>

#include <catch2/catch.hpp>

using namespace kvq;

TEST_CASE("static policy: head overrides layer overrides default, K and V separate", "[policy]") {
  auto p = static_policy::parse("k=kivi4/g32,v=kivi2/g32;0=fp16;3.1=k=sym8,v=fp8").value_or_throw();
  const cache_shape shape{4, 8, 2, 64, 64, 128, 32};
  REQUIRE(p.bind(shape).ok());
  CHECK(p.current(0, 0) == *parse_format_pair("fp16"));
  CHECK(p.current(3, 1) == *parse_format_pair("k=sym8,v=fp8"));
  CHECK(p.current(3, 0) == *parse_format_pair("k=kivi4/g32,v=kivi2/g32"));
  CHECK(p.choose({0, 3, 1, role::v, 0}) == *parse_format("fp8"));
  CHECK(p.choose({0, 2, 0, role::k, 64}) == *parse_format("kivi4/g32"));
  CHECK(p.name() == "static(k=kivi4/g32,v=kivi2/g32;0=fp16;3.1=k=sym8,v=fp8)");
}

TEST_CASE("static policy errors name the clause", "[policy]") {
  CHECK_THAT(static_policy::parse("kivi4;x=fp16").error().message(), Catch::Contains("'x' is not <layer>"));
  CHECK_THAT(static_policy::parse("kivi4;2").error().message(), Catch::Contains("needs <layer>[.<head>]=<formats>"));
  CHECK_THAT(static_policy::parse("kivi4;2=kivi5").error().message(), Catch::Contains("clause '2=kivi5'"));
  // a layer or head named twice is an error, not the last clause winning
  CHECK_THAT(static_policy::parse("kivi4;2=fp16;1=sym8;2=kivi2").error().message(),
             Catch::Contains("layer 2 is named twice (clause '2=kivi2')"));
  CHECK_THAT(static_policy::parse("kivi4;2.1=fp16;2.1=fp8").error().message(),
             Catch::Contains("layer 2 head 1 is named twice"));
  CHECK(static_policy::parse("kivi4;2=fp16;2.1=fp8").ok());  // a head inside a named layer is not a repeat
  auto p = static_policy::parse("kivi4;9=fp16").value_or_throw();
  CHECK_THAT(p.bind({4, 8, 2, 64, 64, 128, 32}).message(), Catch::Contains("layer 9, the cache has 4 layers"));
  auto q = static_policy::parse("kivi4;1.5=fp16").value_or_throw();
  CHECK_THAT(q.bind({4, 8, 2, 64, 64, 128, 32}).message(), Catch::Contains("head 5"));
}
