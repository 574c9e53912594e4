#pragma once
// QuantizedWeight: a linear layer's weight W [N, K] kept in ggml's block formats (the tensor types
// of GGUF files: Q4_0, Q4_1, Q8_0, K-quants, F16 ...) and multiplied on the CPU by ggml's own dot
// products, as llama.cpp multiplies them.
#include <torch/torch.h>

#include <string>
#include <vector>

#include "backend/kernels/dense.h"

namespace kvserve {

// Rows of x up to which QuantizedWeight::matmul takes ggml's dot products (x quantized per block,
// W read once in its small bytes: decode steps); longer inputs (prefill) dequantize W and run the
// float GEMM, which is faster there and gives the float checkpoint's logits bit for bit. Measured
// on the default model (docs/benchmarks-quantized-weights.md): a dot-product step costs ~10 ms
// plus ~4 ms a row, the dequantizing one ~60 ms plus the GEMM, so they cross near 48 rows; 32 keeps
// batched decode on the dot products and prefill chunks on the GEMM.
constexpr int64_t kQuantDotMaxRows = 32;

// A ggml tensor type (enum ggml_type) by its GGUF name, any case ("Q4_1", "q8_0", "F16"); throws
// naming the types kvserve multiplies.
int quant_type_from_name(const std::string& name);
std::string quant_type_name(int type);
// Whether kvserve multiplies and dequantizes weights of this ggml type on the CPU.
bool quant_type_served(int type);
// Bytes of one row of `cols` values of a ggml type; throws unless cols is a whole number of blocks.
int64_t quant_row_bytes(int type, int64_t cols, const std::string& what);
int64_t quant_block_size(int type);

class QuantizedWeight {
 public:
  QuantizedWeight() = default;
  // N rows of K values of `type`, copied from `data` (N * quant_row_bytes(type, K) bytes); `what`
  // names the tensor in errors.
  static QuantizedWeight from_blocks(int type, int64_t rows, int64_t cols, const void* data, const std::string& what);
  // W (fp32 [N, K], any float dtype is converted) quantized to `type` by ggml's quantizers.
  static QuantizedWeight quantize(const torch::Tensor& w, int type, const std::string& what);
  // The rows of several weights with the same K stacked in order (a fused projection); each part
  // keeps its own type.
  static QuantizedWeight stack(const std::vector<QuantizedWeight>& parts);

  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  bool defined() const { return rows_ > 0; }
  int64_t bytes() const;
  // "Q4_1", or the parts' types joined by '+' ("Q4_K+Q6_K") when they differ.
  std::string type_names() const;

  // Rows [start, start + len) (a column-parallel shard, a vocabulary slice).
  QuantizedWeight slice_rows(int64_t start, int64_t len) const;
  // Columns [start, start + len) (a row-parallel shard): both ends must fall on block boundaries of
  // every part, else it throws naming the block size.
  QuantizedWeight slice_cols(int64_t start, int64_t len, const std::string& what) const;
  // Rows in the order `order` gives (order[i] = the source row of row i).
  QuantizedWeight permute_rows(const std::vector<int64_t>& order) const;

  // W as fp32 [N, K] (ggml's to_float of every block).
  torch::Tensor dequantize() const;
  // Rows `ids` (int64, in range) as fp32 [n, K]: an embedding lookup.
  torch::Tensor dequantize_rows(const torch::Tensor& ids) const;
  // y = x Wᵀ (+ b) for fp32 CPU x [.., K]: up to kQuantDotMaxRows rows (any number in a
  // DecodeScope, where every part is tiled) by ggml's dot products against x quantized to
  // each type's activation format; more rows by the dequantized W through dense().
  torch::Tensor matmul(const torch::Tensor& x, const torch::Tensor& b = {}, CpuGemm gemm = CpuGemm::kMkl) const;
  // The vec_dot path alone (any number of rows): each output is one ggml dot product, so a row's
  // result does not depend on the other rows in the batch.
  torch::Tensor dot(const torch::Tensor& x, const torch::Tensor& b = {}) const;
  // Whether every part runs tiled products for several rows (and the tiles are enabled).
  bool tiled() const;
  // The ggml type of every row, or -1 when stacked parts differ.
  int single_type() const;
  // The blocks as stored: uint8 [N, row bytes] (a copy when the weight was stacked from parts).
  torch::Tensor block_bytes() const;

 private:
  struct Part {
    int type = 0;
    int64_t rows = 0;
    int64_t row_bytes = 0;
    torch::Tensor data;  // uint8 [rows * row_bytes], contiguous
  };
  std::vector<Part> parts_;
  int64_t rows_ = 0, cols_ = 0;
};

}  // namespace kvserve
