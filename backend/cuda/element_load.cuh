#pragma once
// One element of a float32 / bfloat16 / float16 buffer read as fp32 inside a kernel (the kernels of
// backend/cuda/ take any of the three activation dtypes).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace kvserve::cuda_elements {

template <typename T> __device__ __forceinline__ float load(const T* p, int64_t i);
template <> __device__ __forceinline__ float load<float>(const float* p, int64_t i) { return p[i]; }
template <> __device__ __forceinline__ float load<__nv_bfloat16>(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
template <> __device__ __forceinline__ float load<__half>(const __half* p, int64_t i) { return __half2float(p[i]); }

}  // namespace kvserve::cuda_elements
