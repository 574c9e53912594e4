#pragma once
// Raw-pointer launcher of the kernel that expands a tinygemm-packed int4 weight
// (backend/quantization/int4_weight.h) into a dense bfloat16 [N, K] matrix, so that products of many
// rows (prefill) run as one bf16 GEMM instead of tinygemm, whose tiles are shaped for a few rows.
// Plain CUDA: the torch side (int4_weight.cpp) is compiled by the host compiler.
#include <cuda_runtime.h>

#include <cstdint>

namespace kvserve::int4_kernels {

// packed: int32 words [N / 8, K / (tiles * 16), 32, tiles / 2]; scales_zeros: bfloat16 [K / group, N, 2];
// out: bfloat16 [N, K] row-major. Each code q becomes (q - 8) * scale + zero, rounded once to bf16.
cudaError_t launch_int4_dequant(const int32_t* packed, const void* scales_zeros, void* out, int64_t N, int64_t K,
                                int64_t group, int tiles, cudaStream_t stream);

}  // namespace kvserve::int4_kernels
