#include "backend/quantization/weight_quantization.h"

#include "common/check.h"
#include "ggml.h"

namespace kvserve {

WeightQuantization weight_quantization_from_name(const std::string& name, const std::string& field) {
  if (name.empty() || name == "none") return WeightQuantization::kNone;
  if (name == "int8") return WeightQuantization::kInt8;
  if (name == "int4") return WeightQuantization::kInt4;
  if (name == "fp8") return WeightQuantization::kFp8;
  KV_FAIL(field << ": unknown weight quantization '" << name << "' (use none, int8, int4 or fp8)");
}

std::string weight_quantization_name(WeightQuantization q) {
  switch (q) {
    case WeightQuantization::kInt8: return "int8";
    case WeightQuantization::kInt4: return "int4";
    case WeightQuantization::kFp8: return "fp8";
    default: return "none";
  }
}

int weight_quantization_ggml_type(WeightQuantization q, const std::string& field) {
  switch (q) {
    case WeightQuantization::kInt8: return GGML_TYPE_Q8_0;
    case WeightQuantization::kInt4: return GGML_TYPE_Q4_0;
    case WeightQuantization::kFp8:
      KV_FAIL(field << ": fp8 weights have no CPU kernel (use int8 or int4 on the CPU)");
    default: return -1;
  }
}

}  // namespace kvserve
