#pragma once
// What the CUDA decode-attention kernels share (paged_decode.cu over 16/32-bit pools,
// kv_quant_kernels.cu over quantized ones): the CTA shape, element conversions, the online-softmax
// state merge and the split-K merge kernel. Included by .cu files only.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

namespace kvserve::cuda_kernels {
// Internal linkage: each .cu file gets its own copy of the kernels (no relocatable device code).
namespace {

constexpr int kWarps = 4;  // warps per CTA
constexpr int kThreads = kWarps * 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half(x);
}

// Merges state (mo, lo, ao) into (m, l, a); a max of -inf on both sides means "nothing yet".
template <int E>
__device__ __forceinline__ void merge_state(float& m, float& l, float* a, float mo, float lo, const float* ao) {
  const float mx = fmaxf(m, mo);
  if (mx == -INFINITY) return;
  const float cs = exp2f(m - mx);   // 0 when m == -inf
  const float co = exp2f(mo - mx);  // 0 when mo == -inf
  l = l * cs + lo * co;
#pragma unroll
  for (int e = 0; e < E; ++e) a[e] = a[e] * cs + ao[e] * co;
  m = mx;
}

// The end of a decode CTA, after its warps published their states (red_*: [kWarps][GMAX][...], a
// barrier passed): merges them per query head and writes its gn heads from row bh0 on, normalised
// into out (one split) or as the split's partial (acc, max, sum). Every thread takes part.
template <typename T, int GMAX, int DCAP, typename P>
__device__ __forceinline__ void write_cta_result(const P& p, const float (&red_m)[kWarps][GMAX],
                                                 const float (&red_l)[kWarps][GMAX],
                                                 const float (&red_acc)[kWarps][GMAX][DCAP], int64_t bh0, int gn,
                                                 int split, int D) {
  for (int i = threadIdx.x; i < gn * D; i += kThreads) {
    const int g = i / D;
    const int d = i % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, red_m[w][g]);
    float lsum = 0.0f, a = 0.0f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float c = exp2f(red_m[w][g] - mx);
        lsum += red_l[w][g] * c;
        a += red_acc[w][g][d] * c;
      }
    }
    const int64_t bh = bh0 + g;
    if (p.num_splits == 1) {
      static_cast<T*>(p.out)[bh * D + d] = from_float<T>(lsum > 0.0f ? a / lsum : 0.0f);
    } else {
      const int64_t ps = bh * p.num_splits + split;
      p.partial_acc[ps * D + d] = a;
      if (d == 0) {
        p.partial_ml[ps * 2] = mx;
        p.partial_ml[ps * 2 + 1] = lsum;
      }
    }
  }
}

// Log-sum-exp merge of the splits: one CTA per (b, h).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    merge_splits_kernel(const float* __restrict__ acc, const float* __restrict__ ml, T* __restrict__ out, int D,
                        int splits) {
  const int64_t bh = blockIdx.x;
  const float* mlp = ml + bh * splits * 2;
  float mx = -INFINITY;
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, mlp[2 * s]);
  float lsum = 0.0f;
  if (mx != -INFINITY) {
    for (int s = 0; s < splits; ++s) {
      const float ms = mlp[2 * s];
      if (ms != -INFINITY) lsum += mlp[2 * s + 1] * exp2f(ms - mx);
    }
  }
  const float inv = lsum > 0.0f ? 1.0f / lsum : 0.0f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float a = 0.0f;
    if (mx != -INFINITY) {
      for (int s = 0; s < splits; ++s) {
        const float ms = mlp[2 * s];
        if (ms != -INFINITY) a += acc[(bh * splits + s) * D + d] * exp2f(ms - mx);  // never reads empty splits
      }
    }
    out[bh * D + d] = from_float<T>(a * inv);
  }
}

// What one CTA of a decode launch reads of its batch entry: the entry's table row, its length
// (clamped to the table), the first slot a sliding window sees, and the blocks of this split. A
// sliding-window entry's splits start at its window's first block; slots before `lo` are masked.
struct SplitRange {
  int row;
  int64_t len, lo, blk_begin, blk_end;
};

// P: the kernel's parameters (rows, lengths, num_rows, table_cols, block_size, window, num_splits,
// blocks_per_split).
template <typename P>
__device__ __forceinline__ SplitRange split_range(const P& p, int64_t b, int split) {
  SplitRange r;
  r.row = p.rows[b];
  int64_t len = 0;
  if (r.row >= 0 && r.row < p.num_rows) len = p.lengths[r.row];
  const int64_t bs = p.block_size;
  r.len = max(int64_t{0}, min(len, p.table_cols * bs));
  const int64_t nblocks = (r.len + bs - 1) / bs;
  r.lo = p.window > 0 ? max(int64_t{0}, r.len - p.window) : 0;
  r.blk_begin = r.lo / bs + static_cast<int64_t>(split) * p.blocks_per_split;
  r.blk_end = split == p.num_splits - 1 ? nblocks
                                         : min(nblocks, r.blk_begin + static_cast<int64_t>(p.blocks_per_split));
  return r;
}

// Query heads of one GQA group a CTA takes (the rest go to further head chunks).
inline int heads_per_cta(int64_t group) {
  if (group <= 1) return 1;
  if (group <= 2) return 2;
  if (group <= 4) return 4;
  return 8;
}

}  // namespace
}  // namespace kvserve::cuda_kernels
