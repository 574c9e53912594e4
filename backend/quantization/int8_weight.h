#pragma once
// Int8Weight: a linear layer's weight as int8 codes with a float32 scale per group of input columns
// (`--quantization int8` on a CUDA device; the CPU's int8 is ggml's Q8_0, QuantizedWeight). Each
// group's scale is its largest magnitude / 127 and a code q in [-127, 127] stands for q * scale: half
// the bytes of a bfloat16 weight on any GPU (no fp8 tensor cores needed, unlike Fp8Weight). A GGUF's
// Q8_0 tensors are served on CUDA in this form too (groups of 32, from_q8_0), and its other 5-bit and
// K-quant tensors (gguf_cuda_forms.h), the affine ones (Q5_1, Q5_K, Q2_K: value = d q - m) with an
// offset per group besides the scale: value = code x scale + offset.
// Products of a few rows (decode) run kvserve's kernel (backend/cuda/int8_gemv.cuh), which reads the
// codes as they are stored; more rows expand the weight to the activations' dtype and run one GEMM.
// On the CPU the product is the expansion's: a reference path for tests.
#include <torch/torch.h>

#include <string>
#include <vector>

#include "backend/quantization/quantized_weight.h"

namespace kvserve {

class Int8Weight {
 public:
  // Whether a [N, K] weight can be stored: K a multiple of 32 (the smallest group; the kernel's
  // 16-byte loads).
  static bool fits(int64_t rows, int64_t cols);
  // The group a K-column weight gets: 128 (8.25 bits a weight with its scale), or 64 / 32 where K is
  // not a multiple of 128.
  static int64_t group_for(int64_t cols);
  // w: [N, K] float weights (any float dtype) on the CPU or a CUDA device; the result lives there.
  // Throws naming `what` when the shape does not fit.
  static Int8Weight quantize(const torch::Tensor& w, const std::string& what);
  // A Q8_0 weight (a GGUF's blocks: 32 int8 codes and an fp16 scale) as it stands: groups of 32, each
  // scale widened to float32, so every value dequantizes bit for bit as ggml's. On the CPU.
  static Int8Weight from_q8_0(const QuantizedWeight& q);
  // Codes chosen elsewhere (a GGUF's blocks, backend/quantization/gguf_cuda_forms.h): int8 codes
  // [N, K], float32 scales [N, K / group] and, for an affine type, float32 offsets of that shape
  // (undefined: none), group a multiple of 16 dividing K; the weight lives where the codes are. Each
  // value is code x scale + offset, each step rounded to float32 (ggml's own order: exact products).
  static Int8Weight from_codes(torch::Tensor codes, torch::Tensor scales, int64_t group, const std::string& what,
                               torch::Tensor offsets = {});
  // The same weight with scale groups of `group` columns (a divisor of group(): each scale repeated),
  // so that weights of different groups stack (a GGUF's Q8_0 beside its Q6_K) with every value kept.
  Int8Weight regrouped(int64_t group) const;
  // The rows of several weights with the same columns, in order (a fused projection).
  static Int8Weight stack(const std::vector<Int8Weight>& parts);
  // The same weight on `device`.
  Int8Weight to(const torch::Device& device) const;
  // Runs small products on `device` (the kernel's one-pass and several-pass row counts, and the
  // expansion) against fp64 over the stored codes; throws with the kernel's error or the excess.
  static void check_device(const torch::Device& device);

  int64_t rows() const { return codes_.size(0); }
  int64_t cols() const { return codes_.size(1); }
  int64_t group() const { return group_; }
  int64_t bytes() const {
    return static_cast<int64_t>(codes_.nbytes() + scales_.nbytes() + (offsets_.defined() ? offsets_.nbytes() : 0));
  }
  const torch::Tensor& codes() const { return codes_; }      // [N, K] int8
  const torch::Tensor& scales() const { return scales_; }    // [N, K / group] float32
  const torch::Tensor& offsets() const { return offsets_; }  // [N, K / group] float32, or undefined

  // The weight [N, K] as `dtype` (each code times its group's scale in fp32, rounded once; exact in
  // fp64); rows
  // `ids` only for a lookup.
  torch::Tensor dequantize(torch::Dtype dtype) const;
  torch::Tensor dequantize_rows(const torch::Tensor& ids, torch::Dtype dtype) const;
  // y = x Wᵀ (+ b) in x's dtype, x: [..., K] on the weight's device.
  torch::Tensor matmul(const torch::Tensor& x, const torch::Tensor& b = {}) const;

 private:
  torch::Tensor codes_, scales_, offsets_;
  int64_t group_ = 0;
};

}  // namespace kvserve
