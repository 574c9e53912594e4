#pragma once
// LinearWeight: a linear layer's weight as the model holds it: a dense tensor on the model's
// device, or ggml blocks (QuantizedWeight) multiplied on the CPU.
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "backend/dense.h"
#include "backend/quantization/quantized_weight.h"

namespace kvserve {

struct LinearWeight {
  torch::Tensor dense;                           // [N, K], or undefined when quantized
  std::shared_ptr<const QuantizedWeight> quant;  // or null when dense

  LinearWeight() = default;
  LinearWeight(torch::Tensor w) : dense(std::move(w)) {}  // NOLINT: a dense tensor is a weight
  explicit LinearWeight(QuantizedWeight q) : quant(std::make_shared<const QuantizedWeight>(std::move(q))) {}

  bool defined() const { return dense.defined() || quant != nullptr; }
  bool quantized() const { return quant != nullptr; }
  int64_t rows() const { return quant ? quant->rows() : dense.size(0); }
  int64_t cols() const { return quant ? quant->cols() : dense.size(1); }
  int64_t bytes() const { return quant ? quant->bytes() : static_cast<int64_t>(dense.nbytes()); }
  // The storage format: the ggml type names, or the dense tensor's dtype ("float32").
  std::string format() const;

  // Rows `ids` (int64, on the weight's device) as `dtype`: an embedding lookup.
  torch::Tensor lookup(const torch::Tensor& ids, torch::Dtype dtype) const;
  // The rows of several weights stacked in order (a fused projection): dense with dense, blocks
  // with blocks.
  static LinearWeight stack(const std::vector<LinearWeight>& parts);
};

// y = x Wᵀ (+ b): dense() for a dense weight, QuantizedWeight::matmul for blocks.
torch::Tensor linear(const torch::Tensor& x, const LinearWeight& w, const torch::Tensor& b = {}, CpuGemm gemm = CpuGemm::kMkl);

}  // namespace kvserve
