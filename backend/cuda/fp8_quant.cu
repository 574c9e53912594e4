#include "backend/cuda/fp8_quant.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "backend/cuda/element_load.cuh"

namespace kvserve::fp8_kernels {
namespace {

constexpr int kThreads = 256;
constexpr float kE4m3Max = 448.0f;

using cuda_elements::load;

// One block per row: the row's largest magnitude, then every value divided by its scale (IEEE
// division, as torch's) and rounded to e4m3 (nearest even; the clamp to +-448 first, as the chain's).
// Bit for bit the chain's for finite activations (fmaxf / fminf drop a NaN where torch keeps it).
template <typename T>
__global__ void fp8_quantize_rows_kernel(const T* __restrict__ x, int64_t x_stride, int64_t cols,
                                         __nv_fp8_storage_t* __restrict__ out, float* __restrict__ scale) {
  const int64_t r = blockIdx.x;
  const T* row = x + r * x_stride;
  float m = 0.0f;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) m = fmaxf(m, fabsf(load(row, i)));
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  __shared__ float warp_max[kThreads / 32];
  __shared__ float row_scale;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  if (warp == 0) {
    m = lane < static_cast<int>(blockDim.x / 32) ? warp_max[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) {
      row_scale = m > 0.0f ? __fdiv_rn(m, kE4m3Max) : 1.0f;
      scale[r] = row_scale;
    }
  }
  __syncthreads();
  const float s = row_scale;
  __nv_fp8_storage_t* o = out + r * cols;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    const float v = fminf(fmaxf(__fdiv_rn(load(row, i), s), -kE4m3Max), kE4m3Max);
    o[i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  }
}

template <typename T>
cudaError_t launch(const void* x, int64_t x_stride, int64_t rows, int64_t cols, void* out, float* scale, cudaStream_t stream) {
  fp8_quantize_rows_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      static_cast<const T*>(x), x_stride, cols, static_cast<__nv_fp8_storage_t*>(out), scale);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_fp8_quantize_rows(const void* x, int64_t x_stride, DType dtype, int64_t rows, int64_t cols, void* out,
                                     float* scale, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0 || x_stride < cols) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32: return launch<float>(x, x_stride, rows, cols, out, scale, stream);
    case DType::kBFloat16: return launch<__nv_bfloat16>(x, x_stride, rows, cols, out, scale, stream);
    case DType::kFloat16: return launch<__half>(x, x_stride, rows, cols, out, scale, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kvserve::fp8_kernels
