#include "backend/quantization/type_fallback.h"

#include "ggml.h"

namespace kvserve {

int quant_type_for_cols(int type, int64_t cols) {
  const auto fits = [&](int t) { return cols > 0 && cols % ggml_blck_size(static_cast<ggml_type>(t)) == 0; };
  if (fits(type)) return type;
  int fallback = -1;
  switch (type) {
    case GGML_TYPE_Q2_K:
    case GGML_TYPE_Q3_K: fallback = GGML_TYPE_Q4_0; break;
    case GGML_TYPE_Q4_K: fallback = GGML_TYPE_Q5_0; break;
    case GGML_TYPE_Q5_K: fallback = GGML_TYPE_Q5_1; break;
    case GGML_TYPE_Q6_K: fallback = GGML_TYPE_Q8_0; break;
    default: break;
  }
  return fallback >= 0 && fits(fallback) ? fallback : -1;
}

}  // namespace kvserve
