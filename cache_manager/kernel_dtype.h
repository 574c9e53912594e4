#pragma once
// The element dtypes kvserve's CUDA cache kernels (paged attention, the quantized rows' device
// twins) read and write: float32, bfloat16 and float16.
#include <c10/core/ScalarType.h>

namespace kvserve {

inline bool is_cuda_kernel_dtype(c10::ScalarType t) {
  return t == c10::ScalarType::Float || t == c10::ScalarType::BFloat16 || t == c10::ScalarType::Half;
}

}  // namespace kvserve
