// kvq_coverage_cuda: which CUDA attention kernel serves each format, head_dim and page size, as the
// launch plan (`cuda::attend_plan`) chooses it on this host: no GPU needed. Prints the markdown
// coverage table of docs/performance.md ("Which kernel reads what"). One row per format the
// kernels read (K and V of that format); per head_dim and page_tokens, a decode step of 8 x 32K
// (GQA 4, one query each) in a layer whose kv heads hold that one format pair, the same step in a
// mixed layer (pages of other formats beside it: the per-page dispatch), and an extend call of 4
// queries (16 rows a kv head).
//   kvq_coverage_cuda [--page-tokens 64,128] [--head-dims 64,128,256] [--formats fp16,kivi4/g32,...]
// (--formats: those formats, in that order; default: every format the kernels read)
#include <kvq/cuda/paged_attention.hpp>
#include <kvq/cuda/read_plan.hpp>
#include <kvq/format/format.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::vector<std::string> split(const char* s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

std::vector<int> int_list(const char* s) {
  std::vector<int> out;
  for (const std::string& item : split(s)) out.push_back(std::atoi(item.c_str()));
  return out;
}

// A step of `batch` sequences of `n` tokens, `q_len` queries each, in a layer of 8 kv heads and
// 32 query heads; `bits`, `one_format` and `three`: the layer's hint (`attend_args::max_page_bits`,
// `one_format_per_head`, `three_bit_pages`).
kvq::result<kvq::cuda::attend_plan_info> plan(int head_dim, int page_tokens, int bits, bool one_format, int q_len,
                                              bool three = false) {
  using namespace kvq;
  cuda::paged_view kv;
  kv.layers = 1;
  kv.kv_heads = 8;
  kv.head_dim = head_dim;
  kv.page_tokens = page_tokens;
  kv.window = 2 * page_tokens;
  kv.max_pages = 1 << 16;
  kv.k_page_bytes = cuda::page_bytes(role::k, page_tokens, head_dim);
  kv.v_page_bytes = cuda::page_bytes(role::v, page_tokens, head_dim);
  const int batch = 8, n = 32768, ring = page_tokens / 2;
  std::vector<cuda::decode_item> items;
  for (int i = 0; i < batch; ++i) items.push_back({i, q_len, n, n - ring, 0, i * q_len});
  cuda::attend_args a;
  a.kv = kv;
  a.q_heads = 32;
  a.items = items;
  a.max_page_bits = bits;
  a.one_format_per_head = one_format;
  a.three_bit_pages = three;
  return cuda::attend_plan(a);
}

// "block-staged, whole units, 4-bit stages x 6" and the like; `by_element`: the format's note
// where its pages are read by element (16-bit stages).
std::string describe(const kvq::result<kvq::cuda::attend_plan_info>& p, const std::string& by_element = "") {
  using kvq::cuda::attend_kernel;
  if (!p) return "refused";
  const auto& i = p.value();
  if (i.kernel == attend_kernel::tile) return "tile";
  std::string s = i.kernel == attend_kernel::decode_block_staged ? "block-staged" : "per-warp staged";
  if (i.whole_units) s += ", whole units";
  if (i.three_bit_dispatch) s += ", 3-bit dispatch";
  s += ", " + std::to_string(i.stage_bits) + "-bit stages x " + std::to_string(i.stages);
  return i.stage_bits == 16 ? s + by_element : s;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvq;
  std::vector<int> pages{64, 128}, dims{64, 128, 256};
  std::vector<format_id> ids;
  for (size_t f = 0; f < format_count; ++f)
    if (cuda::kernels_read(format_id(f))) ids.push_back(format_id(f));
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 < argc && !std::strcmp(argv[i], "--page-tokens")) pages = int_list(argv[i + 1]);
    else if (i + 1 < argc && !std::strcmp(argv[i], "--head-dims")) dims = int_list(argv[i + 1]);
    else if (i + 1 < argc && !std::strcmp(argv[i], "--formats")) {
      ids.clear();
      for (const std::string& name : split(argv[i + 1])) {
        const result<format_id> id = parse_format(name);
        if (!id) {
          std::fprintf(stderr, "kvq_coverage_cuda: %s\n", id.error().message().c_str());
          return 2;
        }
        ids.push_back(id.value());
      }
    } else {
      std::fprintf(stderr, "usage: %s [--page-tokens 64,128] [--head-dims 64,128,256] [--formats fp16,kivi4/g32,...]\n",
                   argv[0]);
      return 2;
    }
  }
  std::printf("| format | bits | page tokens | head_dim | decode, one format a kv head | decode, mixed layer | "
              "extend (16 rows) | prefill's prefix |\n| --- | ---: | ---: | ---: | --- | --- | --- | --- |\n");
  for (const format_id id : ids) {
    const size_t f = size_t(id);
    const format_traits& t = traits_of(id);
    if (!cuda::kernels_read(id)) {
      std::printf("| %s | %d | | | not read by the CUDA kernels | | | |\n", format_name(id).c_str(), int(t.bits));
      continue;
    }
    for (int P : pages)
      for (int D : dims) {
        if (cuda::page_bytes(role::k, P, D)[f] == 0 || cuda::page_bytes(role::v, P, D)[f] == 0) continue;
        // the hints the CUDA backend gives a layer of this format on every head, and a layer of
        // it among other formats (3-bit kinds counted as 3 bits: `three_bit_pages`)
        const bool three = cuda::three_bit_kind(id);
        const auto one = plan(D, P, cuda::head_kernel_bits(id, id), true, 1, three);
        const auto mixed = plan(D, P, cuda::three_bit_kernel_bits(id), false, 1, three);
        const auto extend = plan(D, P, cuda::kernel_bits(id), false, 4);
        const std::string by_element = cuda::read_by_element(t) ? " (pages read by element)" : "";
        std::printf("| %s | %d | %d | %d | %s | %s | %s | %s |\n", format_name(id).c_str(), int(t.bits), P, D,
                    describe(one, by_element).c_str(), describe(mixed, by_element).c_str(), describe(extend).c_str(),
                    t.bits == 16                      ? "read in place (fp16)"
                    : cuda::tile_reads_by_element(t) ? "staged to fp16, by element"
                                                     : "staged to fp16");
      }
  }
  return 0;
}
