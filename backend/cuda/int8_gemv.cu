#include "backend/cuda/int8_gemv.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kvserve::int8_kernels {
namespace {

constexpr int kWarps = 4;        // a block's warps
constexpr int kRowsPerWarp = 2;  // weight rows a warp computes: x's loads serve both
constexpr int kChunk = 16;       // weight bytes (one 16-byte load) a lane takes at a time

// Two 16-bit values as fp32, and the pair type each 16-bit dtype loads in.
__device__ __forceinline__ float2 widen2(__nv_bfloat162 h) { return __bfloat1622float2(h); }
__device__ __forceinline__ float2 widen2(__half2 h) { return __half22float2(h); }
template <typename T> struct PairOf;
template <> struct PairOf<__nv_bfloat16> { using type = __nv_bfloat162; };
template <> struct PairOf<__half> { using type = __half2; };

// Sixteen consecutive elements of x as fp32 (p 16-byte aligned: 16-byte loads).
template <typename T>
__device__ __forceinline__ void load16(const T* p, float (&v)[kChunk]) {
  const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint4 u = q[i];
    const auto* h = reinterpret_cast<const typename PairOf<T>::type*>(&u);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = widen2(h[j]);
      v[8 * i + 2 * j] = f.x;
      v[8 * i + 2 * j + 1] = f.y;
    }
  }
}
template <>
__device__ __forceinline__ void load16<float>(const float* p, float (&v)[kChunk]) {
  const float4* q = reinterpret_cast<const float4*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 f = q[i];
    v[4 * i] = f.x;
    v[4 * i + 1] = f.y;
    v[4 * i + 2] = f.z;
    v[4 * i + 3] = f.w;
  }
}

template <typename T> __device__ __forceinline__ T store_as(float v);
template <> __device__ __forceinline__ float store_as<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 store_as<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half store_as<__half>(float v) { return __float2half_rn(v); }

// A warp takes kRowsPerWarp weight rows and up to MT activation rows (blockIdx.y picks which MT):
// each lane walks the rows 16 bytes at a time, 512 columns apart from its neighbours' (coalesced), and
// the warp's partial sums meet by shuffles at the end. A 16-column chunk lies in one scale group.
template <typename T, int MT>
__global__ void __launch_bounds__(kWarps * 32) int8_product_kernel(const T* __restrict__ x, int64_t M, int64_t K,
                                                                   const int8_t* __restrict__ w,
                                                                   const float* __restrict__ scales, int64_t N,
                                                                   int64_t group, T* __restrict__ out) {
  const int lane = threadIdx.x % 32;
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32) * kRowsPerWarp;
  if (n0 >= N) return;  // the whole warp leaves together
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * MT;
  const int rows = static_cast<int>(M - m0 < MT ? M - m0 : MT);
  const int64_t groups = K / group;
  float acc[kRowsPerWarp][MT];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = 0.0f;
  for (int64_t k = static_cast<int64_t>(lane) * kChunk; k < K; k += 32 * kChunk) {
    float wf[kRowsPerWarp][kChunk];
    float s[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int64_t n = n0 + r < N ? n0 + r : n0;  // a missing last row repeats the first, never stored
      const int4 packed = __ldg(reinterpret_cast<const int4*>(w + n * K + k));
      const int8_t* b = reinterpret_cast<const int8_t*>(&packed);
#pragma unroll
      for (int i = 0; i < kChunk; ++i) wf[r][i] = static_cast<float>(b[i]);
      s[r] = __ldg(scales + n * groups + k / group);
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      // A missing last row reads row 0 again (uniform across the warp) and is never stored.
      float xv[kChunk];
      load16(x + (m0 + (m < rows ? m : 0)) * K + k, xv);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        float part = 0.0f;
#pragma unroll
        for (int i = 0; i < kChunk; ++i) part = fmaf(xv[i], wf[r][i], part);
        acc[r][m] = fmaf(s[r], part, acc[r][m]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      float v = acc[r][m];
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0 && m < rows && n0 + r < N) out[(m0 + m) * N + n0 + r] = store_as<T>(v);
    }
  }
}

template <typename T, int MT>
cudaError_t launch_rows(const void* x, int64_t M, int64_t K, const int8_t* w, const float* scales, int64_t N,
                        int64_t group, void* out, cudaStream_t stream) {
  const int64_t per_block = static_cast<int64_t>(kWarps) * kRowsPerWarp;
  const dim3 grid(static_cast<unsigned>((N + per_block - 1) / per_block), static_cast<unsigned>((M + MT - 1) / MT));
  int8_product_kernel<T, MT><<<grid, kWarps * 32, 0, stream>>>(static_cast<const T*>(x), M, K, w, scales, N, group,
                                                                 static_cast<T*>(out));
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_typed(const void* x, int64_t M, int64_t K, const int8_t* w, const float* scales, int64_t N,
                         int64_t group, void* out, cudaStream_t stream) {
  // The fewest accumulators that hold the rows: one step of one sequence keeps a single row's registers.
  if (M == 1) return launch_rows<T, 1>(x, M, K, w, scales, N, group, out, stream);
  if (M == 2) return launch_rows<T, 2>(x, M, K, w, scales, N, group, out, stream);
  if (M <= 4) return launch_rows<T, 4>(x, M, K, w, scales, N, group, out, stream);
  return launch_rows<T, kRowsPerPass>(x, M, K, w, scales, N, group, out, stream);
}

}  // namespace

cudaError_t launch_int8_weight_product(const void* x, DType dtype, int64_t M, int64_t K, const int8_t* w,
                                       const float* scales, int64_t N, int64_t group, void* out, cudaStream_t stream) {
  if (M <= 0 || N <= 0 || K <= 0 || group <= 0 || group % kChunk != 0 || K % group != 0) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || reinterpret_cast<uintptr_t>(w) % 16 != 0) return cudaErrorMisalignedAddress;
  if ((M + kRowsPerPass - 1) / kRowsPerPass > 65535) return cudaErrorInvalidValue;  // grid.y
  switch (dtype) {
    case DType::kFloat32: return launch_typed<float>(x, M, K, w, scales, N, group, out, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(x, M, K, w, scales, N, group, out, stream);
    case DType::kFloat16: return launch_typed<__half>(x, M, K, w, scales, N, group, out, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kvserve::int8_kernels
