#include "backend/cuda/int4_dequant.cuh"

#include <cuda_bf16.h>

#include "backend/quantization/int4_tinygemm_layout.h"

namespace kvserve::int4_kernels {
namespace {

constexpr int kThreads = 256;

// One thread per packed word: its 8 codes all belong to one row.
__global__ void int4_dequant_kernel(const int32_t* __restrict__ packed, const __nv_bfloat16* __restrict__ sz,
                                    __nv_bfloat16* __restrict__ out, int64_t words, int64_t N, int64_t K, int64_t group,
                                    int tiles) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (w >= words) return;
  const uint32_t bits = static_cast<uint32_t>(packed[w]);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int4_layout::Where at = int4_layout::locate(w, i, K, tiles);
    if (at.row >= N) continue;
    const int64_t g = at.col / group;
    const float s = __bfloat162float(sz[(g * N + at.row) * 2]);
    const float z = __bfloat162float(sz[(g * N + at.row) * 2 + 1]);
    const float q = static_cast<float>((bits >> (4 * i)) & 0xFu);
    out[at.row * K + at.col] = __float2bfloat16_rn(__fmaf_rn(q - 8.0f, s, z));
  }
}

}  // namespace

cudaError_t launch_int4_dequant(const int32_t* packed, const void* scales_zeros, void* out, int64_t N, int64_t K,
                                int64_t group, int tiles, cudaStream_t stream) {
  if (N <= 0 || K <= 0 || group <= 0 || (tiles != 2 && tiles != 4 && tiles != 8) || K % (tiles * 16) != 0)
    return cudaErrorInvalidValue;
  const int64_t words = ((N + 7) / 8) * 8 * K / 8;  // 8 codes a word, rows padded to the 8-row tile
  const int64_t blocks = (words + kThreads - 1) / kThreads;
  int4_dequant_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      packed, static_cast<const __nv_bfloat16*>(scales_zeros), static_cast<__nv_bfloat16*>(out), words, N, K, group,
      tiles);
  return cudaGetLastError();
}

}  // namespace kvserve::int4_kernels
