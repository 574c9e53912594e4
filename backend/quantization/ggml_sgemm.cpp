#include "backend/quantization/ggml_sgemm.h"

// ggml-cpu's internal headers (the pinned sdist's): the compute-params struct llamafile_sgemm reads.
#include "ggml-cpu-impl.h"
#include "llamafile/sgemm.h"

namespace kvserve {

bool tiled_quant_matmul_supports(int weight_type, int act_type) {
#if defined(__x86_64__) && (defined(__AVX2__) || defined(__AVX512F__))
  if (act_type != GGML_TYPE_Q8_0) return false;
  switch (weight_type) {
    case GGML_TYPE_Q8_0:
    case GGML_TYPE_Q4_0:
    case GGML_TYPE_Q5_0:
    case GGML_TYPE_IQ4_NL:
      return true;
    default:
      return false;
  }
#else
  (void)weight_type;
  (void)act_type;
  return false;
#endif
}

bool tiled_quant_matmul(int weight_type, int act_type, int64_t rows, int64_t M, int64_t k_blocks, const void* w,
                        int64_t w_stride, const void* x, int64_t x_stride, float* y, int64_t ldy, int ith, int nth) {
  if (M < 2 || !tiled_quant_matmul_supports(weight_type, act_type)) return false;
  ggml_compute_params params{};
  params.ith = ith;
  params.nth = nth;
  return llamafile_sgemm(&params, rows, M, k_blocks, w, w_stride, x, x_stride, y, ldy, weight_type, act_type,
                         GGML_TYPE_F32);
}

}  // namespace kvserve
