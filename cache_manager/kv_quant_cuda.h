#pragma once
// The device twins of kv_quant_encode / kv_quant_decode / kv_quant_rotate (cache_manager/kv_quant.h)
// for tensors on a CUDA device: the same bytes and values bit for bit, computed on the GPU, with no
// host round trip (the host versions send CUDA tensors here when this build has the kernels).
#include <torch/torch.h>

#include <cstdint>

#include "cache_manager/kv_quant.h"

namespace kvserve::cuda {

// x [..., D] float32 / bfloat16 / float16 on CUDA -> uint8 [..., row_bytes] on x's device.
torch::Tensor kv_quant_encode(const torch::Tensor& x, KvQuant q, bool rotate);
// rows uint8 [..., row_bytes] on CUDA -> [..., D] of `out` (float32 / bfloat16 / float16).
torch::Tensor kv_quant_decode(const torch::Tensor& rows, KvQuant q, int64_t head_dim, torch::ScalarType out,
                              bool rotate);
// x [..., D] on CUDA, D a multiple of 32 -> the rotated rows, x's dtype (computed in fp32).
torch::Tensor kv_quant_rotate(const torch::Tensor& x);

}  // namespace kvserve::cuda
