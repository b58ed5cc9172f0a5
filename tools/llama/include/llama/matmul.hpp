#pragma once
/// \file
/// Weight matrices kept in their GGUF quantization, and the matrix products of the model runner
/// computed on the quantized blocks (`llama/dot.hpp`) over a thread pool.
///
/// A product y[T][rows] = x[T][cols] * W^T quantizes each of the T activation rows once to the
/// form W's type pairs with, then splits the work into tasks of a run of weight rows (about one run
/// per thread, at least 16 rows) times a tile of 64 activation rows; a task reads each of its weight rows once and takes its dot product with
/// every activation row of the tile (so a prefill chunk reuses each weight block up to 64 times
/// while it is in L1, and a tile of activations stays in cache across the tasks that share it).

#include <cstdint>
#include <kvq/status.hpp>
#include <llama/dot.hpp>
#include <llama/gguf.hpp>
#include <llama/thread_pool.hpp>
#include <span>
#include <vector>

namespace kvq::llama {

/// A [rows][cols] row-major matrix in a GGUF element type, owning its bytes.
class weight_matrix {
 public:
  weight_matrix() = default;
  /// The 2-D tensor `t` of `f` (ne[0] = cols, ne[1] = rows). Types with a dot-product kernel
  /// (`activation_of` not none) keep their blocks; Q5_0 is re-encoded as Q8_0 (the same values);
  /// other dequantizable types are converted to F32. Errors: the dequantizer's (unsupported
  /// type), naming the file and the tensor.
  static result<weight_matrix> from_gguf(const gguf_file& f, const gguf_tensor_info& t);
  /// A matrix of type `type` over raw bytes [rows][cols / block_elems][block_bytes].
  /// Errors: invalid_argument (cols not a multiple of the block, wrong byte count, no kernel).
  static result<weight_matrix> from_bytes(ggml_type type, int64_t rows, int64_t cols, std::vector<uint8_t> bytes);

  ggml_type type() const { return type_; }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  /// Bytes of one row.
  size_t row_bytes() const { return row_bytes_; }
  /// [row_bytes()] the blocks of row r.
  const uint8_t* row(int64_t r) const { return bytes_.data() + size_t(r) * row_bytes_; }
  /// Dequantizes row r into `out` [cols].
  void dequantize_row(int64_t r, float* out) const;

 private:
  ggml_type type_ = ggml_type::f32;
  int64_t rows_ = 0, cols_ = 0;
  size_t row_bytes_ = 0;
  std::vector<uint8_t> bytes_;
};

/// One product of a `matmul` call: y [T][w->rows()] = x * w^T, or y += x * w^T with accumulate.
struct matmul_job {
  const weight_matrix* w;
  float* y;
  bool accumulate = false;
};

/// Computes every job on the same input x [T][cols] (every job's w has `cols` columns), the
/// rows of all jobs shared out over `pool` as one parallel run, each dot product in
/// instruction set `isa` (which must be available: `isa_available`).
void matmul(std::span<const matmul_job> jobs, const float* x, int64_t T, thread_pool& pool, cpu_isa isa);

}  // namespace kvq::llama
