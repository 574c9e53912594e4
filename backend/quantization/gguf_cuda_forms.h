#pragma once
// The forms a GGUF's ggml blocks take on a CUDA device, where ggml's CPU kernels do not run: the
// 4-bit types (Q4_0, Q4_1, Q4_K) as Int4Weight (tinygemm: a bfloat16 scale and zero per 32 values),
// the others (Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q5_K, Q6_K) as Int8Weight (their integers as int8 codes,
// a float32 scale per 32 or 16 values and, for the affine ones, a float32 offset: every value as
// ggml computes it). The i-quants are dequantized at load (weight_source.cpp says so).
#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <string>

#include "backend/quantization/linear_weight.h"
#include "backend/quantization/quantized_weight.h"

namespace kvserve {

// Which CUDA form a ggml type takes: none (dequantized: F16 / BF16 / F32 are dense anyway, the
// i-quants), int4 or int8.
enum class GgufCudaForm { kNone, kInt4, kInt8 };
GgufCudaForm gguf_cuda_form(int ggml_type);

// A weight's ggml blocks as integers per value with a scale and an offset per group of `group`
// values along a row: value = code x scale + offset, exactly (each product and the sum are exact in
// float64, so rounding it to float32 gives ggml's dequantized value bit for bit).
struct GgufGroups {
  torch::Tensor codes;   // int8 [N, K]
  torch::Tensor scale;   // float32 [N, K / group]
  torch::Tensor offset;  // float32 [N, K / group]; all zero for a symmetric type
  int64_t group = 0;
  int code_min = 0;      // the type's least code (4-bit types: code - code_min is the 0..15 nibble)
  bool affine = false;   // the type has an offset (a minimum) per group
};
// Decodes a single-type weight of one of the types above on the CPU; throws naming `what` for
// another type.
GgufGroups gguf_groups(const QuantizedWeight& q, const std::string& what);

// The weight in its CUDA form on `device` (a CUDA device, or the CPU for the tests' reference
// paths), or nullopt where its type has none or its shape does not fit the form (the caller
// dequantizes it). int4: tinygemm's (u - 8) x s + z with s = scale and z = offset + (code_min + 8)
// x scale, both rounded to bfloat16.
std::optional<LinearWeight> gguf_cuda_weight(const QuantizedWeight& q, const torch::Device& device,
                                             const std::string& what);

}  // namespace kvserve
