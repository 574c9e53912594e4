#pragma once
// LinearWeight: a linear layer's weight as the model holds it: a dense tensor on the model's
// device, ggml blocks (QuantizedWeight) multiplied on the CPU, fp8 with per-channel scales
// (Fp8Weight, at::_scaled_mm), or int8 / 4-bit groups for CUDA (Int8Weight, Int4Weight).
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "backend/kernels/dense.h"
#include "backend/quantization/fp8_weight.h"
#include "backend/quantization/int4_weight.h"
#include "backend/quantization/int8_weight.h"
#include "backend/quantization/quantized_weight.h"

namespace kvserve {

struct LinearWeight {
  torch::Tensor dense;                           // [N, K], or undefined when quantized
  std::shared_ptr<const QuantizedWeight> quant;  // or null when dense
  std::shared_ptr<const Fp8Weight> fp8;          // or null
  std::shared_ptr<const Int4Weight> int4;        // or null
  std::shared_ptr<const Int8Weight> int8;        // or null

  LinearWeight() = default;
  LinearWeight(torch::Tensor w) : dense(std::move(w)) {}  // NOLINT: a dense tensor is a weight
  explicit LinearWeight(QuantizedWeight q) : quant(std::make_shared<const QuantizedWeight>(std::move(q))) {}
  explicit LinearWeight(Fp8Weight f) : fp8(std::make_shared<const Fp8Weight>(std::move(f))) {}
  explicit LinearWeight(Int4Weight f) : int4(std::make_shared<const Int4Weight>(std::move(f))) {}
  explicit LinearWeight(Int8Weight f) : int8(std::make_shared<const Int8Weight>(std::move(f))) {}

  bool defined() const { return dense.defined() || quant != nullptr || fp8 != nullptr || int4 != nullptr || int8 != nullptr; }
  // ggml blocks (fp8, int4 and int8 groups are asked for with is_fp8(), is_int4() and is_int8()).
  bool quantized() const { return quant != nullptr; }
  bool is_fp8() const { return fp8 != nullptr; }
  bool is_int4() const { return int4 != nullptr; }
  bool is_int8() const { return int8 != nullptr; }
  int64_t rows() const {
    return quant ? quant->rows() : fp8 ? fp8->rows() : int4 ? int4->rows() : int8 ? int8->rows() : dense.size(0);
  }
  int64_t cols() const {
    return quant ? quant->cols() : fp8 ? fp8->cols() : int4 ? int4->cols() : int8 ? int8->cols() : dense.size(1);
  }
  int64_t bytes() const {
    return quant  ? quant->bytes()
           : fp8  ? fp8->bytes()
           : int4 ? int4->bytes()
           : int8 ? int8->bytes()
                  : static_cast<int64_t>(dense.nbytes());
  }
  // The storage format: the ggml type names, "float8_e4m3fn", "int4_g<group>", "int8_g<group>", or
  // the dense tensor's dtype ("float32").
  std::string format() const;

  // Rows `ids` (int64, on the weight's device) as `dtype`: an embedding lookup.
  torch::Tensor lookup(const torch::Tensor& ids, torch::Dtype dtype) const;
  // The rows of several weights stacked in order (a fused projection): dense with dense, blocks
  // with blocks, fp8 with fp8, int4 with int4, int8 with int8 (in the smallest of their scale
  // groups). Mixed kinds are stacked dense: in the dense parts' dtype, or `dense_dtype` where no
  // part is dense (on CUDA a GGUF's int4-form q_proj beside an int8-form v_proj).
  static LinearWeight stack(const std::vector<LinearWeight>& parts, torch::Dtype dense_dtype = torch::kFloat32);
};

// y = x Wᵀ (+ b): dense() for a dense weight, QuantizedWeight::matmul for blocks, Fp8Weight::matmul,
// Int4Weight::matmul, Int8Weight::matmul.
torch::Tensor linear(const torch::Tensor& x, const LinearWeight& w, const torch::Tensor& b = {}, CpuGemm gemm = CpuGemm::kMkl);

}  // namespace kvserve
