#pragma once
// Raw-pointer launcher of the product of a few activation rows with an int8 weight
// (backend/quantization/int8_weight.h): y = x Wᵀ where W's row n is int8 codes with a float32 scale
// per group of `group` columns. It reads each weight byte once per 8 activation rows, so a decode
// step moves half the bytes of a bfloat16 weight. Plain CUDA: the torch side (int8_weight.cpp) is
// compiled by the host compiler.
#include <cuda_runtime.h>

#include <cstdint>

namespace kvserve::int8_kernels {

// Element type of x and out.
enum class DType { kFloat32, kBFloat16, kFloat16 };

// The most activation rows one pass over the weight serves; more rows take several passes.
constexpr int64_t kRowsPerPass = 8;

// x: [M, K] of `dtype`, contiguous, 16-byte aligned; w: int8 [N, K] row-major, 16-byte aligned;
// scales: float32 [N, K / group]; out: [M, N] of `dtype`, contiguous. K and group must be multiples
// of 16 with K a multiple of group. Each output is fp32 sums of x * code per group, times the
// group's scale, rounded once to `dtype`.
cudaError_t launch_int8_weight_product(const void* x, DType dtype, int64_t M, int64_t K, const int8_t* w,
                                       const float* scales, int64_t N, int64_t group, void* out, cudaStream_t stream);

}  // namespace kvserve::int8_kernels
