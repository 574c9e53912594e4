#pragma once
// Int4Weight: a linear layer's weight in 4-bit groups for CUDA GPUs (`--quantization int4` there),
// in the layout of libtorch's tinygemm kernel (at::_convert_weight_to_int4pack, multiplied by
// at::_weight_int4pack_mm: bfloat16 activations, tensor cores, compute capability 8.0+). Each group
// of `group()` input columns of a row has a bfloat16 scale s and zero z, and a code q in [0, 15]
// stands for (q - 8) * s + z (min/max asymmetric, as gpt-fast and torchao's int4 weight-only).
// On the CPU the same codes (two a byte) run libtorch's CPU twin of the kernel
// (_weight_int4pack_mm_for_cpu, packed at each product): the reference the tests use there; the
// CPU's own int4 is ggml's Q4_0 (QuantizedWeight), faster.
#include <torch/torch.h>

#include <string>
#include <vector>

namespace kvserve {

class Int4Weight {
 public:
  // Whether a [N, K] weight can be stored: N a multiple of 8 (the kernel's n tile), K of 32 (its
  // smallest group and k tiles).
  static bool fits(int64_t rows, int64_t cols);
  // The group size a K-column weight gets: 128 (4.25 bits a weight with its scale and zero), or 64
  // / 32 where K is not a multiple of 128.
  static int64_t group_for(int64_t cols);
  // w: [N, K] float weights (any float dtype) on the CPU or a CUDA device; the result lives there.
  // Throws naming `what` when the shape does not fit.
  static Int4Weight quantize(const torch::Tensor& w, const std::string& what);
  // Codes chosen elsewhere (a GGUF's 4-bit blocks, backend/quantization/ggml_cuda_forms.h): q [N, K]
  // integers in [0, 15] on the device the weight is to live on, scale and zero [N, K / group] (any
  // float dtype, rounded to bfloat16 here), group 32, 64 or 128. Throws naming `what` where the
  // shape does not fit.
  static Int4Weight from_codes(const torch::Tensor& q, const torch::Tensor& scale, const torch::Tensor& zero,
                               int64_t group, const std::string& what);
  // The rows of several weights with the same columns, in order (a fused projection).
  static Int4Weight stack(const std::vector<Int4Weight>& parts);
  // Runs a small product on `device` and checks it against the float weight it came from: throws
  // with the kernel's own error (e.g. a GPU older than compute capability 8.0) or when the result
  // is off by more than the quantization allows. On CUDA it checks the many-row path too, and turns
  // that path off (said in the log) if it disagrees.
  static void check_device(const torch::Device& device);

  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  int64_t group() const { return group_; }
  // The packed codes and the bfloat16 scales and zeros.
  int64_t bytes() const { return static_cast<int64_t>(packed_.nbytes() + scales_zeros_.nbytes()); }
  const torch::Tensor& scales_and_zeros() const { return scales_zeros_; }  // [K / group, N, 2] bfloat16

  // The weight [N, K] as `dtype`: on CUDA expanded by kvserve's kernel; elsewhere a product with the
  // identity (O(K² N), for tests and rare fallbacks).
  torch::Tensor dequantize(torch::Dtype dtype) const;
  // y = x Wᵀ (+ b) in x's dtype, x: [..., K] on the weight's device. On CUDA: bfloat16 activations,
  // tinygemm for up to 64 rows (decode), one bf16 GEMM over the expanded weight beyond (prefill).
  torch::Tensor matmul(const torch::Tensor& x, const torch::Tensor& b = {}) const;

 private:
  // The weight as bfloat16 [N, K] (backend/cuda/int4_dequant.cuh; CUDA builds with kvserve's kernels).
  torch::Tensor expand() const;

  torch::Tensor packed_, scales_zeros_;
  int64_t rows_ = 0, cols_ = 0, group_ = 0;
};

}  // namespace kvserve
