#pragma once
// Fp8Weight: a linear layer's weight in fp8 (e4m3) with a scale per output channel, multiplied by
// at::_scaled_mm with the activations quantized to fp8 per token at each product (vLLM's dynamic
// fp8): half the bytes of a 16-bit weight on GPUs with fp8 tensor cores (compute capability 8.9+).
// On the CPU libtorch's own _scaled_mm runs it: a reference path, slower than float32.
#include <torch/torch.h>

#include <string>
#include <vector>

namespace kvserve {

class Fp8Weight {
 public:
  // w: [N, K] float weights (any float dtype and device). Each row's scale is its largest
  // magnitude / 448 (e4m3's largest finite value). K and N must be multiples of 16 (_scaled_mm's
  // tiles); throws naming `what` otherwise.
  static Fp8Weight quantize(const torch::Tensor& w, const std::string& what);
  // The rows of several weights in order (a fused projection): rows keep their own scales.
  static Fp8Weight stack(const std::vector<Fp8Weight>& parts);
  // Whether a [N, K] weight can be stored in fp8 (both dimensions multiples of 16).
  static bool fits(int64_t rows, int64_t cols);

  int64_t rows() const { return w_.size(0); }
  int64_t cols() const { return w_.size(1); }
  // fp8 values and the float32 scales.
  int64_t bytes() const { return static_cast<int64_t>(w_.nbytes() + scale_.nbytes()); }
  const torch::Tensor& values() const { return w_; }  // [N, K] float8_e4m3fn
  const torch::Tensor& scales() const { return scale_; }  // [1, N] float32

  // The weight as `dtype` (each fp8 value times its row's scale); rows `ids` only for a lookup.
  torch::Tensor dequantize(torch::Dtype dtype) const;
  torch::Tensor dequantize_rows(const torch::Tensor& ids, torch::Dtype dtype) const;

  // y = x Wᵀ (+ b) in x's dtype, x: [..., K] on the weight's device.
  torch::Tensor matmul(const torch::Tensor& x, const torch::Tensor& b = {}) const;

 private:
  torch::Tensor w_, scale_;
};

// x [M, K] quantized per row as the products do: scale = max |x_row| / 448 (a row of zeros gets
// scale 1), values = x / scale rounded to e4m3. Returns the fp8 values; `scale` gets [M, 1] float32.
// On CUDA one fused kernel (backend/cuda/fp8_quant.cuh), bit for bit the torch chain's.
torch::Tensor fp8_quantize_rows(const torch::Tensor& x, torch::Tensor& scale);

}  // namespace kvserve
