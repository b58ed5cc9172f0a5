// GGUF parsing: the real model files, every metadata type, and bad files rejected with the right
// message.
#include <catch2/catch.hpp>
#include <cmath>
#include <llama/gguf.hpp>

#include "catch_skip.hpp"
#include "test_util.hpp"

using namespace kvq::llama;
using kvq::errc;
using test::gguf_builder;

TEST_CASE("stories260K parses: header, metadata, tensor infos, data", "[gguf]") {
  auto f = gguf_file::open(test::stories_path());
  REQUIRE(f.ok());
  CHECK(f->version() == 3);
  CHECK(f->file_size() == 1054240);
  CHECK(f->alignment() == 32);
  CHECK(f->metadata().size() == 20);
  CHECK(f->tensors().size() == 47);  // token_embd, output_norm, 5 x 9 per block
  CHECK(f->data_offset() == 14112);  // header ends at 14110, padded to 32
  CHECK(f->get_string("general.architecture").value() == "llama");
  CHECK(f->get_int("llama.block_count").value() == 5);
  CHECK(f->get_int("llama.attention.head_count_kv").value() == 4);
  CHECK(f->get_float("llama.rope.freq_base").value() == 10000.0);
  CHECK(std::fabs(f->get_float("llama.attention.layer_norm_rms_epsilon").value() - 1e-5) < 1e-9);
  auto tokens = f->get_string_array("tokenizer.ggml.tokens");
  REQUIRE(tokens.ok());
  REQUIRE(tokens->size() == 512);
  CHECK((*tokens)[0] == "<unk>");
  CHECK((*tokens)[1] == "<s>");
  CHECK((*tokens)[3] == "<0x00>");
  CHECK((*tokens)[258] == "<0xFF>");
  CHECK(f->get_float_array("tokenizer.ggml.scores")->size() == 512);
  auto types = f->get_int_array("tokenizer.ggml.token_type");
  REQUIRE(types.ok());
  CHECK((*types)[0] == 2);  // unknown
  CHECK((*types)[1] == 3);  // control
  CHECK((*types)[3] == 6);  // byte

  const gguf_tensor_info* emb = f->find_tensor("token_embd.weight");
  REQUIRE(emb != nullptr);
  CHECK(emb->n_dims == 2);
  CHECK(emb->ne[0] == 64);
  CHECK(emb->ne[1] == 512);
  CHECK(emb->type == uint32_t(ggml_type::f32));
  CHECK(emb->offset == 0);
  CHECK(emb->bytes == 64 * 512 * 4);
  CHECK(emb->shape_string() == "[64, 512]");
  CHECK(f->find_tensor("output.weight") == nullptr);  // tied head
  const gguf_tensor_info* last = f->find_tensor("output_norm.weight");
  REQUIRE(last != nullptr);
  CHECK(f->data_offset() + last->offset + last->bytes == f->file_size());  // data runs to the end

  auto w = f->dequantize("blk.0.attn_q.weight");
  REQUIRE(w.ok());
  CHECK(w->size() == 64 * 64);
  float first = 0;
  std::memcpy(&first, f->tensor_bytes(*f->find_tensor("blk.0.attn_q.weight")).data(), 4);
  CHECK((*w)[0] == first);
}

TEST_CASE("SmolLM2-135M-Instruct Q4_1 parses and dequantizes", "[gguf][smollm2]") {
  if (!test::have_smollm2()) KVQ_SKIP(test::smollm2_path() << " is missing (scripts/setup puts it there)");
  auto f = gguf_file::open(test::smollm2_path());
  REQUIRE(f.ok());
  CHECK(f->version() == 3);
  CHECK(f->tensors().size() == 272);
  CHECK(f->get_string("tokenizer.ggml.model").value() == "gpt2");
  CHECK(f->get_string_array("tokenizer.ggml.merges")->size() == 48900);
  CHECK(f->get_bool("tokenizer.ggml.add_bos_token").value() == false);
  CHECK(f->get_int("llama.attention.head_count").value() == 9);
  CHECK(f->get_float("llama.rope.freq_base").value() == 100000.0);
  CHECK(f->get_string_array("general.languages").value() == std::vector<std::string>{"en"});
  const gguf_tensor_info* emb = f->find_tensor("token_embd.weight");
  REQUIRE(emb != nullptr);
  CHECK(type_name(emb->type) == "Q8_0");
  CHECK(emb->bytes == 576ull * 49152 / 32 * 34);
  CHECK(type_name(f->find_tensor("blk.0.attn_q.weight")->type) == "Q4_1");
  // Sum of squares of every weight, compared with gguf-py 0.19.0's dequantize of the same file:
  // 4.49548e+06 (Python: sum((gguf.quants.dequantize(t.data, t.tensor_type)**2).sum() ...)).
  double total = 0;
  for (const auto& t : f->tensors()) {
    auto d = f->dequantize(t.name);
    REQUIRE(d.ok());
    for (float x : *d) total += double(x) * x;
  }
  CHECK(total == Approx(4.49548e6).epsilon(1e-5));
}

TEST_CASE("every metadata value type, arrays of strings and nested arrays", "[gguf]") {
  gguf_builder b;
  b.scalar("t.u8", 0, uint8_t(200))
      .scalar("t.i8", 1, int8_t(-100))
      .scalar("t.u16", 2, uint16_t(60000))
      .scalar("t.i16", 3, int16_t(-30000))
      .u32("t.u32", 4000000000u)
      .scalar("t.i32", 5, int32_t(-2000000000))
      .f32("t.f32", 1.5f)
      .boolean("t.bool", true)
      .str("t.string", "héllo ▁ world")
      .scalar("t.u64", 10, uint64_t(1) << 63)
      .scalar("t.i64", 11, int64_t(-1) << 62)
      .scalar("t.f64", 12, 2.25)
      .str_array("t.strings", {"a", "", "ünïcode", std::string(1000, 'x')})
      .num_array<float>("t.floats", 6, {1.f, -2.f, 0.5f})
      .num_array<int32_t>("t.ints", 5, {1, -2, 3});
  {
    // [[1, 2], [3]] as an array of arrays of u8.
    std::vector<uint8_t> v;
    gguf_builder::put<uint32_t>(v, 9);
    gguf_builder::put<uint64_t>(v, 2);
    gguf_builder::put<uint32_t>(v, 0);
    gguf_builder::put<uint64_t>(v, 2);
    v.push_back(1);
    v.push_back(2);
    gguf_builder::put<uint32_t>(v, 0);
    gguf_builder::put<uint64_t>(v, 1);
    v.push_back(3);
    b.raw_kv("t.nested", 9, v);
  }
  b.tensor("x", {4}, 0, test::f32_bytes({1, 2, 3, 4}));
  auto f = gguf_file::from_bytes(b.build(), "types.gguf");
  REQUIRE(f.ok());
  CHECK(f->metadata().size() == 16);
  CHECK(f->metadata()[0].key == "t.u8");
  CHECK(f->get_int("t.u8").value() == 200);
  CHECK(f->get_int("t.i8").value() == -100);
  CHECK(f->get_int("t.u16").value() == 60000);
  CHECK(f->get_int("t.i16").value() == -30000);
  CHECK(f->get_int("t.u32").value() == 4000000000ll);
  CHECK(f->get_int("t.i32").value() == -2000000000ll);
  CHECK(f->get_float("t.f32").value() == 1.5);
  CHECK(f->get_bool("t.bool").value() == true);
  CHECK(f->get_string("t.string").value() == "héllo ▁ world");
  CHECK(std::get<uint64_t>(f->find("t.u64")->scalar) == uint64_t(1) << 63);
  CHECK(f->get_int("t.i64").value() == int64_t(-1) << 62);
  CHECK(f->get_float("t.f64").value() == 2.25);
  CHECK(f->get_string_array("t.strings").value() ==
        std::vector<std::string>{"a", "", "ünïcode", std::string(1000, 'x')});
  CHECK(f->get_float_array("t.floats").value() == std::vector<float>{1.f, -2.f, 0.5f});
  CHECK(f->get_int_array("t.ints").value() == std::vector<int64_t>{1, -2, 3});
  const gguf_value* nested = f->find("t.nested");
  REQUIRE(nested != nullptr);
  REQUIRE(nested->items.size() == 2);
  CHECK(nested->items[0].items.size() == 2);
  CHECK(std::get<uint64_t>(nested->items[1].items[0].scalar) == 3);
  CHECK(f->dequantize("x").value() == std::vector<float>{1, 2, 3, 4});

  SECTION("typed getters name the key and the types") {
    auto s = f->get_int("t.string");
    CHECK(s.error().code() == errc::invalid_argument);
    CHECK_THAT(s.error().message(), Catch::Contains("types.gguf") && Catch::Contains("'t.string'") &&
                                        Catch::Contains("string") && Catch::Contains("integer"));
    auto u64 = f->get_int("t.u64");  // 2^63 does not fit int64
    CHECK(u64.error().code() == errc::invalid_argument);
    auto arr = f->get_string_array("t.floats");
    CHECK_THAT(arr.error().message(), Catch::Contains("array of f32"));
    auto missing = f->get_string("no.such.key");
    CHECK(missing.error().code() == errc::not_found);
    CHECK_THAT(missing.error().message(), Catch::Contains("'no.such.key' is missing"));
    CHECK(f->get_int_or("no.such.key", 7).value() == 7);
    CHECK(!f->get_int_or("t.string", 7).ok());  // present with a wrong type is still an error
  }
}

TEST_CASE("alignment from general.alignment", "[gguf]") {
  gguf_builder b;
  b.u32("general.alignment", 64)
      .tensor("a", {3}, 0, test::f32_bytes({1, 2, 3}))
      .tensor("b", {2}, 0, test::f32_bytes({4, 5}));
  auto f = gguf_file::from_bytes(b.build(64), "aligned.gguf");
  REQUIRE(f.ok());
  CHECK(f->alignment() == 64);
  CHECK(f->data_offset() % 64 == 0);
  CHECK(f->find_tensor("b")->offset == 64);
  CHECK(f->dequantize("b").value() == std::vector<float>{4, 5});
}

namespace {

// Expects `bytes` to be rejected with `code` and a message containing each of `parts`.
void expect_rejected(const std::vector<uint8_t>& bytes, errc code, std::initializer_list<std::string> parts) {
  auto f = gguf_file::from_bytes(bytes, "bad.gguf");
  REQUIRE_FALSE(f.ok());
  const auto s = f.error();
  CAPTURE(s.to_string());
  CHECK(s.code() == code);
  CHECK_THAT(s.message(), Catch::StartsWith("bad.gguf: "));
  for (const auto& p : parts) CHECK_THAT(s.message(), Catch::Contains(p));
}

std::vector<uint8_t> one_tensor_file() {
  gguf_builder b;
  b.str("general.architecture", "llama").tensor("w", {8}, 0, test::f32_bytes({1, 2, 3, 4, 5, 6, 7, 8}));
  return b.build();
}

}  // namespace

TEST_CASE("bad files are rejected with a message naming file, entry and problem", "[gguf]") {
  SECTION("missing file") {
    auto f = gguf_file::open("/nonexistent/dir/model.gguf");
    REQUIRE_FALSE(f.ok());
    CHECK(f.error().code() == errc::io_error);
    CHECK_THAT(f.error().message(), Catch::Contains("/nonexistent/dir/model.gguf") && Catch::Contains("cannot open"));
  }
  SECTION("empty and tiny files") {
    expect_rejected({}, errc::io_error, {"too short"});
    expect_rejected({'G', 'G'}, errc::io_error, {"too short"});
  }
  SECTION("bad magic") { expect_rejected({'G', 'G', 'M', 'L', 3, 0, 0, 0}, errc::io_error, {"not a GGUF file"}); }
  SECTION("unsupported version") {
    gguf_builder b;
    expect_rejected(b.build(32, 4), errc::unsupported, {"version 4"});
    expect_rejected(b.build(32, 0x03000000u), errc::unsupported, {"big-endian"});
  }
  SECTION("truncated header fields") {
    const auto good = one_tensor_file();
    expect_rejected({good.begin(), good.begin() + 10}, errc::io_error, {"truncated", "tensor count"});
    expect_rejected({good.begin(), good.begin() + 30}, errc::io_error, {"claims 1 metadata entries", "6 bytes left"});
    expect_rejected({good.begin(), good.begin() + 50}, errc::io_error,
                    {"truncated at byte 32", "key of metadata entry 0"});
    expect_rejected({good.begin(), good.begin() + 60}, errc::io_error,
                    {"truncated at byte 56", "'general.architecture'"});
    expect_rejected({good.begin(), good.begin() + 75}, errc::io_error, {"claims 1 tensors"});
    expect_rejected({good.begin(), good.begin() + 101}, errc::io_error,
                    {"truncated at byte 94", "tensor 'w' (offset)"});
  }
  SECTION("truncated tensor data") {
    auto bytes = one_tensor_file();
    bytes.resize(bytes.size() - 1);
    expect_rejected(bytes, errc::io_error, {"tensor 'w'", "extends past the end"});
  }
  SECTION("huge counts do not allocate") {
    gguf_builder b;
    auto bytes = b.build();
    uint64_t huge = uint64_t(1) << 60;
    std::memcpy(bytes.data() + 16, &huge, 8);  // n_kv
    expect_rejected(bytes, errc::io_error, {"metadata entries"});
    std::memset(bytes.data() + 16, 0, 8);
    std::memcpy(bytes.data() + 8, &huge, 8);  // n_tensors
    expect_rejected(bytes, errc::io_error, {"tensors"});
    gguf_builder s;
    std::vector<uint8_t> arr;
    gguf_builder::put<uint32_t>(arr, 8);
    gguf_builder::put<uint64_t>(arr, uint64_t(1) << 62);
    s.raw_kv("big", 9, arr);
    expect_rejected(s.build(), errc::io_error, {"'big'", "claims"});
    gguf_builder l;
    std::vector<uint8_t> str;
    gguf_builder::put<uint64_t>(str, uint64_t(1) << 40);
    l.raw_kv("long", 8, str);
    expect_rejected(l.build(), errc::io_error, {"'long'", "truncated"});
  }
  SECTION("one-byte array elements cannot make the metadata take many times the file's size") {
    // 2 MiB of u8 elements, each of which would be a whole gguf_value in memory (> 64 MiB in all).
    const size_t n = size_t(2) << 20;
    gguf_builder b;
    b.u32("general.alignment", 32).num_array<uint8_t>("evil.bytes", 0, std::vector<uint8_t>(n, 7));
    expect_rejected(b.build(), errc::io_error, {"metadata 'evil.bytes'", std::to_string(n) + " elements", "limit"});
    // as elements of a nested array too
    std::vector<uint8_t> nested;
    gguf_builder::put<uint32_t>(nested, 9);  // array of arrays
    gguf_builder::put<uint64_t>(nested, 1);
    gguf_builder::put<uint32_t>(nested, 7);  // of bools
    gguf_builder::put<uint64_t>(nested, n);
    nested.resize(nested.size() + n, 1);
    gguf_builder c;
    c.raw_kv("evil.nested", 9, nested);
    expect_rejected(c.build(), errc::io_error, {"metadata 'evil.nested' element 0", std::to_string(n) + " elements"});
    // the same count in a file that is large anyway (its tensor data) parses
    gguf_builder ok;
    ok.num_array<uint8_t>("fine.bytes", 0, std::vector<uint8_t>(n, 7))
        .tensor("w", {uint64_t(n) * 12}, 0, std::vector<uint8_t>(n * 48));
    auto f = gguf_file::from_bytes(ok.build(), "big.gguf");
    REQUIRE(f.ok());
    CHECK(f->find("fine.bytes")->items.size() == n);
  }
  SECTION("unknown metadata value type") {
    gguf_builder b;
    b.raw_kv("odd", 13, {0, 0, 0, 0});
    expect_rejected(b.build(), errc::io_error, {"'odd'", "unknown value type 13"});
  }
  SECTION("arrays nested too deep") {
    std::vector<uint8_t> v;
    for (int i = 0; i < 20; ++i) {
      gguf_builder::put<uint32_t>(v, 9);
      gguf_builder::put<uint64_t>(v, 1);
    }
    gguf_builder b;
    b.raw_kv("deep", 9, v);
    expect_rejected(b.build(), errc::io_error, {"'deep'", "deeper"});
  }
  SECTION("duplicate key and tensor name") {
    gguf_builder b;
    b.u32("k", 1).u32("k", 2);
    expect_rejected(b.build(), errc::io_error, {"'k' appears twice"});
    gguf_builder t;
    t.tensor("w", {1}, 0, test::f32_bytes({1})).tensor("w", {1}, 0, test::f32_bytes({2}));
    expect_rejected(t.build(), errc::io_error, {"'w' appears twice"});
  }
  SECTION("bad alignment") {
    gguf_builder b;
    b.u32("general.alignment", 48);
    expect_rejected(b.build(), errc::io_error, {"general.alignment 48"});
    gguf_builder s;
    s.str("general.alignment", "32");
    expect_rejected(s.build(), errc::io_error, {"general.alignment has type string"});
  }
  SECTION("bad tensor infos") {
    gguf_builder dims;
    dims.tensor("t5", {1, 1, 1, 1, 1}, 0, test::f32_bytes({1}));
    expect_rejected(dims.build(), errc::io_error, {"tensor 't5'", "5 dimensions"});
    gguf_builder zero;
    zero.tensor("t0", {4, 0}, 0, {});
    expect_rejected(zero.build(), errc::io_error, {"tensor 't0'", "invalid dimension 1 = 0"});
    gguf_builder overflow;
    overflow.tensor("big", {uint64_t(1) << 40, uint64_t(1) << 40}, 0, {});
    expect_rejected(overflow.build(), errc::io_error, {"tensor 'big'", "overflows"});
    gguf_builder type;
    type.tensor("q", {32}, 77, std::vector<uint8_t>(32));
    expect_rejected(type.build(), errc::unsupported, {"tensor 'q'", "unknown type id 77"});
    gguf_builder block;
    block.tensor("q", {48}, uint32_t(ggml_type::q8_0), std::vector<uint8_t>(68));
    expect_rejected(block.build(), errc::io_error, {"tensor 'q'", "Q8_0", "ne[0] = 48", "block of 32"});
    gguf_builder misaligned;
    misaligned.tensor("m", {1}, 0, test::f32_bytes({1}), 4);
    expect_rejected(misaligned.build(), errc::io_error, {"tensor 'm'", "offset 4", "alignment 32"});
    gguf_builder past;
    past.tensor("p", {1}, 0, test::f32_bytes({1}), 1 << 20);
    expect_rejected(past.build(), errc::io_error, {"tensor 'p'", "extends past the end"});
  }
}

TEST_CASE("tensor lookups and unsupported tensor types name the file and tensor", "[gguf]") {
  gguf_builder b;
  b.tensor("iq", {256}, uint32_t(ggml_type::iq2_xxs), std::vector<uint8_t>(66));
  auto f = gguf_file::from_bytes(b.build(), "iq.gguf");
  REQUIRE(f.ok());  // a known type without a dequantizer still parses
  auto d = f->dequantize("iq");
  REQUIRE_FALSE(d.ok());
  CHECK(d.error().code() == errc::unsupported);
  CHECK_THAT(d.error().message(), Catch::Contains("iq.gguf") && Catch::Contains("'iq'") && Catch::Contains("IQ2_XXS"));
  auto m = f->dequantize("nope");
  CHECK(m.error().code() == errc::not_found);
  CHECK_THAT(m.error().message(), Catch::Contains("iq.gguf") && Catch::Contains("tensor 'nope' is missing"));
}
