#include "backend/quantization/weight_quantization.h"

#include <cctype>

#include "backend/quantization/quantized_weight.h"
#include "common/check.h"
#include "ggml.h"

namespace kvserve {

namespace {
std::string lower(std::string n) {
  for (char& ch : n) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return n;
}
}  // namespace

const std::vector<std::string>& weight_quantization_names() {
  static const std::vector<std::string> names = {"none", "int8", "int4", "fp8",  "q8_0", "q4_0",
                                                 "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"};
  return names;
}

int weight_quantization_ggml_type(const std::string& name_in, const std::string& field) {
  const std::string name = lower(name_in);
  if (name.empty() || name == "none") return -1;
  if (name == "int8") return GGML_TYPE_Q8_0;
  if (name == "int4") return GGML_TYPE_Q4_0;
  if (name == "fp8") return -1;
  for (const std::string& n : weight_quantization_names())
    if (n == name) return quant_type_from_name(name);
  KV_FAIL(field << ": unknown weight quantization '" << name_in
                << "' (use none, int8, int4, fp8, or a ggml type: q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k)");
}

bool weight_quantization_is_fp8(const std::string& name) { return lower(name) == "fp8"; }

bool weight_quantization_is_int4(const std::string& name) { return lower(name) == "int4"; }

bool weight_quantization_is_int8(const std::string& name) { return lower(name) == "int8"; }

}  // namespace kvserve
