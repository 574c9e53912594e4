#pragma once
// LinearWeight: a linear layer's weight as the model holds it: a dense tensor on the model's
// device, ggml blocks (QuantizedWeight) multiplied on the CPU, or fp8 with per-channel scales
// (Fp8Weight, at::_scaled_mm).
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "backend/dense.h"
#include "backend/quantization/fp8_weight.h"
#include "backend/quantization/quantized_weight.h"

namespace kvserve {

struct LinearWeight {
  torch::Tensor dense;                           // [N, K], or undefined when quantized
  std::shared_ptr<const QuantizedWeight> quant;  // or null when dense
  std::shared_ptr<const Fp8Weight> fp8;          // or null

  LinearWeight() = default;
  LinearWeight(torch::Tensor w) : dense(std::move(w)) {}  // NOLINT: a dense tensor is a weight
  explicit LinearWeight(QuantizedWeight q) : quant(std::make_shared<const QuantizedWeight>(std::move(q))) {}
  explicit LinearWeight(Fp8Weight f) : fp8(std::make_shared<const Fp8Weight>(std::move(f))) {}

  bool defined() const { return dense.defined() || quant != nullptr || fp8 != nullptr; }
  // ggml blocks (fp8 is asked for with is_fp8()).
  bool quantized() const { return quant != nullptr; }
  bool is_fp8() const { return fp8 != nullptr; }
  int64_t rows() const { return quant ? quant->rows() : fp8 ? fp8->rows() : dense.size(0); }
  int64_t cols() const { return quant ? quant->cols() : fp8 ? fp8->cols() : dense.size(1); }
  int64_t bytes() const {
    return quant ? quant->bytes() : fp8 ? fp8->bytes() : static_cast<int64_t>(dense.nbytes());
  }
  // The storage format: the ggml type names, or the dense tensor's dtype ("float32").
  std::string format() const;

  // Rows `ids` (int64, on the weight's device) as `dtype`: an embedding lookup.
  torch::Tensor lookup(const torch::Tensor& ids, torch::Dtype dtype) const;
  // The rows of several weights stacked in order (a fused projection): dense with dense, blocks
  // with blocks, fp8 with fp8 (mixed kinds are stacked dense).
  static LinearWeight stack(const std::vector<LinearWeight>& parts);
};

// y = x Wᵀ (+ b): dense() for a dense weight, QuantizedWeight::matmul for blocks, Fp8Weight::matmul.
torch::Tensor linear(const torch::Tensor& x, const LinearWeight& w, const torch::Tensor& b = {}, CpuGemm gemm = CpuGemm::kMkl);

}  // namespace kvserve
