#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <llama/matmul.hpp>
#include <llama/quant.hpp>

namespace kvq::llama {

result<weight_matrix> weight_matrix::from_bytes(ggml_type type, int64_t rows, int64_t cols,
                                                std::vector<uint8_t> bytes) {
  const type_info* info = find_type(uint32_t(type));
  if (!info || activation_of(type) == activation_kind::none)
    return status{errc::invalid_argument,
                  fmt::format("weight_matrix: no dot-product kernel for type {}", type_name(uint32_t(type)))};
  if (rows <= 0 || cols <= 0 || cols % info->block_elems != 0)
    return status{errc::invalid_argument, fmt::format("weight_matrix: {} x {} of {}: columns must be a positive "
                                                      "multiple of {}",
                                                      rows, cols, info->name, info->block_elems)};
  const size_t row_bytes = size_t(cols / info->block_elems) * info->block_bytes;
  if (bytes.size() != row_bytes * size_t(rows))
    return status{errc::invalid_argument, fmt::format("weight_matrix: {} x {} of {} needs {} bytes, got {}", rows, cols,
                                                      info->name, row_bytes * size_t(rows), bytes.size())};
  weight_matrix m;
  m.type_ = type;
  m.rows_ = rows;
  m.cols_ = cols;
  m.row_bytes_ = row_bytes;
  m.bytes_ = std::move(bytes);
  return m;
}

namespace {

// Q5_0 (d * (q - 16), q of 5 bits) re-encoded as Q8_0 (d * q8, q8 = q - 16 in -16..15): the same
// values exactly, run by the Q8_0 kernels instead of being expanded to F32 (Gemma 3's Q4_K_M file
// stores its Q, K, gate and up projections as Q5_0). Each block's codes are read by dequantizing it
// with d = 1 (exact small integers); the block keeps its own d.
// NOTE: Gemma 3 270M decodes at 37.8 tok/s so, 25.5 with Q5_0 expanded to F32 (tools/llama/README.md, "Speed").
result<weight_matrix> q5_0_as_q8_0(const gguf_file& f, const gguf_tensor_info& t) {
  const int64_t cols = t.ne[0], rows = t.rows();
  const auto src = f.tensor_bytes(t);
  const size_t blocks = src.size() / sizeof(block_q5_0);
  if (cols % 32 != 0 || blocks * sizeof(block_q5_0) != src.size() || int64_t(blocks) * 32 != t.elements)
    return status{errc::io_error, fmt::format("{}: tensor '{}': {} bytes are not whole Q5_0 blocks of its {} x {}",
                                              f.path(), t.name, src.size(), rows, cols)};
  std::vector<uint8_t> bytes(blocks * sizeof(block_q8_0));
  std::array<float, 32> q{};
  for (size_t i = 0; i < blocks; ++i) {
    block_q5_0 in;
    std::memcpy(&in, src.data() + i * sizeof(block_q5_0), sizeof in);
    block_q8_0 out;
    out.d = in.d;
    in.d = 0x3c00;  // 1.0 in fp16
    KVQ_TRY(dequantize(ggml_type::q5_0, std::span(reinterpret_cast<const uint8_t*>(&in), sizeof in), q));
    for (int e = 0; e < 32; ++e) out.qs[e] = int8_t(q[size_t(e)]);
    std::memcpy(bytes.data() + i * sizeof(block_q8_0), &out, sizeof out);
  }
  return weight_matrix::from_bytes(ggml_type::q8_0, rows, cols, std::move(bytes));
}

}  // namespace

result<weight_matrix> weight_matrix::from_gguf(const gguf_file& f, const gguf_tensor_info& t) {
  const int64_t cols = t.ne[0], rows = t.rows();
  const auto type = ggml_type(t.type);
  if (activation_of(type) != activation_kind::none) {
    const auto src = f.tensor_bytes(t);
    auto m = from_bytes(type, rows, cols, std::vector<uint8_t>(src.begin(), src.end()));
    if (!m) return status{m.error().code(), fmt::format("{}: tensor '{}': {}", f.path(), t.name, m.error().message())};
    return m;
  }
  if (type == ggml_type::q5_0) return q5_0_as_q8_0(f, t);
  std::vector<uint8_t> bytes(size_t(t.elements) * sizeof(float));
  std::vector<float> values(size_t(t.elements));
  KVQ_TRY(f.dequantize_into(t, values));
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return from_bytes(ggml_type::f32, rows, cols, std::move(bytes));
}

void weight_matrix::dequantize_row(int64_t r, float* out) const {
  // The size is consistent by construction, so this cannot fail.
  (void)dequantize(type_, std::span(row(r), row_bytes_), std::span(out, size_t(cols_)));
}

namespace {

// NOTE: tasks are few and long: one run of weight rows per thread for the whole call (at least 16
// rows each), taken dynamically, so a worker that wakes late leaves its share to the others. With
// 16-row tasks SmolLM2's decode on two threads of this project's 2-core virtual machine ran slower
// than on one (77 against 111 tokens/s); with one task per thread, 145-181 (docs/performance.md).
constexpr int64_t min_rows_per_task = 16;
constexpr int64_t tasks_per_thread = 1;
constexpr int64_t tokens_per_task = 64;  // activation rows of one task (a prefill chunk is tiled)
constexpr int activation_kinds = 3;  // f32, q8, q8_k

}  // namespace

void matmul(std::span<const matmul_job> jobs, const float* x, int64_t T, thread_pool& pool, cpu_isa isa) {
  if (jobs.empty() || T <= 0) return;
  const int64_t cols = jobs[0].w->cols();

  // The activation rows, quantized once per form that some job reads.
  std::array<std::vector<uint8_t>, activation_kinds> act;
  std::array<size_t, activation_kinds> act_row{};
  for (const auto& j : jobs) {
    const activation_kind k = activation_of(j.w->type());
    auto& buf = act[size_t(k)];
    if (!buf.empty()) continue;
    act_row[size_t(k)] = activation_bytes(k, cols);
    buf.resize(act_row[size_t(k)] * size_t(T));
    for (int64_t t = 0; t < T; ++t)
      quantize_activation(k, x + t * cols, cols, buf.data() + size_t(t) * act_row[size_t(k)]);
  }

  std::vector<dot_fn> dots(jobs.size());
  std::vector<dot4_fn> dots4(jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    dots[i] = find_dot(jobs[i].w->type(), isa);
    dots4[i] = find_dot4(jobs[i].w->type(), isa);
  }

  int64_t all_rows = 0;
  for (const auto& j : jobs) all_rows += j.w->rows();
  const int64_t per = all_rows / (int64_t(pool.threads()) * tasks_per_thread);
  const int64_t rows_per_task = std::max(min_rows_per_task, per / min_rows_per_task * min_rows_per_task);
  // Tasks: runs of rows_per_task rows of one job times a tile of tokens_per_task activation rows,
  // token tiles outermost: the tasks that run together share one activation tile (in cache), and
  // a task reads each of its weight rows once for the whole tile.
  std::vector<int64_t> first_task(jobs.size() + 1, 0);
  for (size_t i = 0; i < jobs.size(); ++i)
    first_task[i + 1] = first_task[i] + (jobs[i].w->rows() + rows_per_task - 1) / rows_per_task;
  const int64_t row_tasks = first_task.back(), tiles = (T + tokens_per_task - 1) / tokens_per_task;

  pool.run(row_tasks * tiles, [&](int64_t task) {
    const int64_t tile = task / row_tasks, row_task = task % row_tasks;
    const size_t j = size_t(std::upper_bound(first_task.begin(), first_task.end(), row_task) - first_task.begin() - 1);
    const matmul_job& job = jobs[j];
    const weight_matrix& w = *job.w;
    const activation_kind k = activation_of(w.type());
    const uint8_t* a = act[size_t(k)].data();
    const size_t stride = act_row[size_t(k)];
    const dot_fn dot = dots[j];
    const int64_t r0 = (row_task - first_task[j]) * rows_per_task, r1 = std::min(w.rows(), r0 + rows_per_task);
    const int64_t t0 = tile * tokens_per_task, t1 = std::min(T, t0 + tokens_per_task);
    const dot4_fn dot4 = dots4[j];
    auto put = [&](int64_t t, int64_t r, float v) {
      float& out = job.y[t * w.rows() + r];
      out = job.accumulate ? out + v : v;
    };
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* wr = w.row(r);
      int64_t t = t0;
      if (dot4)  // four tokens per pass over the weight row
        for (; t + 4 <= t1; t += 4) {
          float v[4];
          dot4(wr, a + size_t(t) * stride, stride, cols, v);
          for (int i = 0; i < 4; ++i) put(t + i, r, v[i]);
        }
      for (; t < t1; ++t) put(t, r, dot(wr, a + size_t(t) * stride, cols));
    }
  });
}

}  // namespace kvq::llama
