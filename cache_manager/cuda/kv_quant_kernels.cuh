#pragma once
// Raw-pointer launchers of the CUDA kernels for quantized KV pools: rows in cache_manager/kv_quant.h's
// q8_0 / q4_0 / q4_1 / fp8_e4m3 formats, encoded, decoded and rotated on the device bit for bit as the host
// does; a step's K/V encoded straight into its slots; decode attention that reads the pool's small
// bytes. Plain CUDA, as paged_decode.cuh (the torch wrappers are compiled by the host compiler).
#include <cuda_runtime.h>

#include <cstdint>

#include "cache_manager/cuda/paged_decode.cuh"

namespace kvserve::cuda_kernels {

enum class QuantFormat { kQ8_0, kQ4_0, kQ4_1, kFp8E4M3 };

// Bytes of one row of head_dim values (head_dim a multiple of 32), as kv_quant_row_bytes.
int64_t quant_row_bytes(QuantFormat f, int64_t head_dim);

// x [rows, D] of `dtype` -> out uint8 [rows, row_bytes]; with rotate each group of 32 values is
// Walsh-Hadamard rotated first, scaled by rot_scale (the host's 1 / sqrt(32)).
cudaError_t launch_kv_quant_encode(const void* x, DType dtype, int64_t rows, int64_t head_dim, QuantFormat f,
                                   bool rotate, float rot_scale, uint8_t* out, cudaStream_t stream);
// in uint8 [rows, row_bytes] -> out [rows, D] of `dtype`; with rotate each decoded row is rotated back.
cudaError_t launch_kv_quant_decode(const uint8_t* in, int64_t rows, int64_t head_dim, QuantFormat f, bool rotate,
                                   float rot_scale, void* out, DType dtype, cudaStream_t stream);
// x [rows, D] -> out [rows, D] (may be x), every group of 32 rotated, computed in fp32.
cudaError_t launch_kv_rotate(const void* x, void* out, DType dtype, int64_t rows, int64_t head_dim, float rot_scale,
                             cudaStream_t stream);

// paged_append's quantized twin: k, v [B, KV, D] of `dtype` are encoded into slot lengths[rows[b]] - 1
// of table row rows[b] in a pool of uint8 rows [N, 2, KV, bs, row_bytes].
struct QuantAppendArgs {
  uint8_t* pool = nullptr;
  const int32_t* tables = nullptr;
  int64_t table_stride = 0;
  int64_t table_cols = 0;
  const int32_t* rows = nullptr;
  const int32_t* lengths = nullptr;
  int64_t num_rows = 0;
  const void* k = nullptr;
  const void* v = nullptr;
  DType dtype = DType::kFloat32;
  int64_t batch = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  QuantFormat format = QuantFormat::kQ8_0;
  bool rotate = false;
  float rot_scale = 0.0f;
};
cudaError_t launch_paged_append_quant(const QuantAppendArgs& a, cudaStream_t stream);

// paged_decode's quantized twin, in fp32: q [B, H, D] fp32 (already rotated when the pool is), out
// [B, H, D] fp32; the tables, rows, lengths, splits (plan_splits, workspace_floats) and window as
// PagedDecodeArgs. The splits are merged by a second kernel.
struct QuantDecodeArgs {
  const float* q = nullptr;
  const uint8_t* pool = nullptr;
  const int32_t* tables = nullptr;
  int64_t table_stride = 0;
  int64_t table_cols = 0;
  const int32_t* rows = nullptr;
  const int32_t* lengths = nullptr;
  int64_t num_rows = 0;
  float* out = nullptr;
  float* partial_acc = nullptr;
  float* partial_ml = nullptr;
  int64_t batch = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int num_splits = 1;
  int blocks_per_split = 1;
  float scale = 0.0f;
  int64_t window = 0;
  QuantFormat format = QuantFormat::kQ8_0;
};
cudaError_t launch_paged_decode_quant(const QuantDecodeArgs& a, cudaStream_t stream);

}  // namespace kvserve::cuda_kernels
