#pragma once
// Host helpers the torch wrappers of the quantized-pool kernels share: kvserve's enums in the
// kernels' terms. Included only where KVSERVE_HAVE_CUDA_KERNELS is defined.
#include <torch/torch.h>

#include "cache_manager/cuda/kv_quant_kernels.cuh"
#include "cache_manager/kv_quant.h"
#include "common/check.h"

namespace kvserve::cuda {

inline cuda_kernels::QuantFormat quant_format(KvQuant q) {
  switch (q) {
    case KvQuant::q8_0: return cuda_kernels::QuantFormat::kQ8_0;
    case KvQuant::q4_0: return cuda_kernels::QuantFormat::kQ4_0;
    case KvQuant::q4_1: return cuda_kernels::QuantFormat::kQ4_1;
    case KvQuant::fp8_e4m3: return cuda_kernels::QuantFormat::kFp8E4M3;
    case KvQuant::none: break;
  }
  KV_FAIL("internal: no CUDA kernel format for KV quantization '" << kv_quant_name(q) << "'");
}

// float32 / bfloat16 / float16 (the callers checked it).
inline cuda_kernels::DType quant_kernel_dtype(torch::ScalarType t) {
  switch (t) {
    case torch::kBFloat16: return cuda_kernels::DType::kBFloat16;
    case torch::kFloat16: return cuda_kernels::DType::kFloat16;
    default: return cuda_kernels::DType::kFloat32;
  }
}

}  // namespace kvserve::cuda
