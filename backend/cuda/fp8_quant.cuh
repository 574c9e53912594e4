#pragma once
// Raw-pointer launcher of the fused per-row fp8 quantization of a product's activations
// (backend/quantization/fp8_weight.h, fp8_quantize_rows): one kernel where the torch chain is six
// (cast, abs, row max, scale, divide and clamp, cast to e4m3), bit for bit the chain's result.
// Plain CUDA: the torch side is compiled by the host compiler.
#include <cuda_runtime.h>

#include <cstdint>

namespace kvserve::fp8_kernels {

enum class DType { kFloat32, kBFloat16, kFloat16 };

// x: [rows, cols] of `dtype`, row r at r * x_stride (elements contiguous). Writes scale[r] =
// max|x[r]| / 448 as float32 (1 for a row of zeros) and out[r, c] = e4m3(x[r, c] / scale[r]) into
// the contiguous [rows, cols] float8_e4m3fn buffer `out` (one byte each).
cudaError_t launch_fp8_quantize_rows(const void* x, int64_t x_stride, DType dtype, int64_t rows, int64_t cols, void* out,
                                     float* scale, cudaStream_t stream);

}  // namespace kvserve::fp8_kernels
