// What one block size per layer costs an engine that owns its KV pool, against kvq's arena of
// variable-size blocks (docs/performance.md, "Engine pools of one block size"): an engine that
// allocates every block of a layer at one size (vLLM's and SGLang's pools) must size it for the
// widest page block the layer can ever hold, while kvq's arena allocates each page block at its
// own size. For the Llama-3-8B attention shape (32 layers, 8 kv heads, head_dim 128, pages of 64
// tokens) and a sequence of `tokens` tokens, per scenario: the bytes of its page blocks in kvq's
// arena (each block rounded to the arena's 256 bytes) and in pools of one block size per layer,
// or one for the whole model. Host only; prints a markdown table.
//   kvq_bench_pool_bytes [tokens (default 32768)]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <kvq/format/format.hpp>
#include <kvq/format/spec.hpp>
#include <kvq/store/arena.hpp>
#include <string>
#include <vector>

namespace {

constexpr int layers = 32, kv_heads = 8, head_dim = 128, page_tokens = 64;

// Bytes of one page block: every kv head's K and V page in its format.
uint64_t block_bytes(const std::vector<kvq::format_pair>& heads) {
  uint64_t b = 0;
  for (const kvq::format_pair& p : heads)
    b += kvq::layout_of(kvq::traits_of(p.k), kvq::role::k, page_tokens, head_dim).total() +
         kvq::layout_of(kvq::traits_of(p.v), kvq::role::v, page_tokens, head_dim).total();
  return b;
}
std::vector<kvq::format_pair> all_heads(const char* spec) {
  return std::vector<kvq::format_pair>(kv_heads, kvq::parse_format_pair(spec).value_or_throw());
}

// A scenario: the page blocks of each layer over a sequence's pages (`blocks[l][page]`), and the
// blocks each layer may hold at any time (`may_hold[l]`: what a one-size pool must fit).
struct scenario {
  std::string name;
  std::vector<std::vector<uint64_t>> blocks;
  std::vector<uint64_t> may_hold;
};

}  // namespace

int main(int argc, char** argv) {
  const int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 32768;
  if (tokens < page_tokens) {
    std::fprintf(stderr, "need at least %d tokens\n", page_tokens);
    return 2;
  }
  const int pages = int(tokens / page_tokens);
  const uint64_t fp16 = block_bytes(all_heads("fp16")), k4 = block_bytes(all_heads("kivi4/g32")),
                 k2 = block_bytes(all_heads("kivi2/g32")), i8 = block_bytes(all_heads("kivi8/g32"));
  std::vector<scenario> sc;
  auto uniform = [&](const std::string& name, uint64_t b) {
    scenario s{name, std::vector<std::vector<uint64_t>>(layers, std::vector<uint64_t>(size_t(pages), b)),
               std::vector<uint64_t>(layers, b)};
    sc.push_back(s);
  };
  uniform("fp16", fp16);
  uniform("kivi4/g32", k4);
  {  // layer 0 FP16, the rest 4-bit keys and 2-bit values
    const uint64_t mixed = block_bytes(all_heads("k=kivi4/g32,v=kivi2/g32"));
    scenario s{"k=kivi4/g32,v=kivi2/g32;0=fp16 (per layer)", {}, {}};
    for (int l = 0; l < layers; ++l) {
      s.blocks.emplace_back(size_t(pages), l == 0 ? fp16 : mixed);
      s.may_hold.push_back(l == 0 ? fp16 : mixed);
    }
    sc.push_back(s);
  }
  {  // per head: two heads of every layer at int8, the rest kivi2/g32 (a kl_budget-like mix)
    std::vector<kvq::format_pair> heads = all_heads("kivi2/g32");
    heads[0] = heads[1] = kvq::parse_format_pair("kivi8/g32").value_or_throw();
    const uint64_t b = block_bytes(heads);
    uniform("per head: 2 of 8 heads kivi8/g32, 6 kivi2/g32", b);
  }
  {  // kivi4/g32 with its first page FP16 (an attention sink page)
    scenario s{"kivi4/g32+sink (first page FP16)", {}, {}};
    for (int l = 0; l < layers; ++l) {
      std::vector<uint64_t> b(static_cast<size_t>(pages), k4);
      b[0] = fp16;
      s.blocks.push_back(b);
      s.may_hold.push_back(fp16);
    }
    sc.push_back(s);
  }
  {  // over time (EchoKV's tiers fp16 / kivi8 / kivi4 / kivi2): the first quarter of the pages
     // at kivi4, then kivi2, the layers of the top quarter at kivi8 throughout; a layer may be
     // promoted to any tier at any time, FP16 included
    scenario s{"over time: EchoKV tiers fp16/kivi8/kivi4/kivi2", {}, {}};
    for (int l = 0; l < layers; ++l) {
      std::vector<uint64_t> b(static_cast<size_t>(pages));
      for (int p = 0; p < pages; ++p) b[size_t(p)] = l < layers / 4 ? i8 : (p < pages / 4 ? k4 : k2);
      s.blocks.push_back(b);
      s.may_hold.push_back(fp16);
    }
    sc.push_back(s);
  }
  std::printf("# %lld tokens, %d layers x %d kv heads x head_dim %d, pages of %d tokens\n", (long long)tokens, layers,
              kv_heads, head_dim, page_tokens);
  std::printf("| scenario | kvq arena MiB | one block size per layer MiB | / arena | one block size per model MiB | / arena |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: | ---: |\n");
  for (const scenario& s : sc) {
    uint64_t arena = 0, per_layer = 0;
    const uint64_t widest = *std::max_element(s.may_hold.begin(), s.may_hold.end());
    for (int l = 0; l < layers; ++l) {
      for (uint64_t b : s.blocks[size_t(l)]) arena += kvq::arena_allocator::rounded(b);
      per_layer += uint64_t(pages) * s.may_hold[size_t(l)];
    }
    const uint64_t per_model = uint64_t(pages) * layers * widest;
    const double mib = 1024.0 * 1024.0;
    std::printf("| %s | %.1f | %.1f | %.2f | %.1f | %.2f |\n", s.name.c_str(), arena / mib, per_layer / mib,
                double(per_layer) / double(arena), per_model / mib, double(per_model) / double(arena));
  }
  return 0;
}
