#pragma once
// Weight quantization at load (`model.quantization`, `--quantization`, vLLM's names): which ggml
// block type a float checkpoint's linear layers become on the CPU (on CUDA: fp8, int8 as Int8Weight,
// or int4 as Int4Weight).
#include <string>
#include <vector>

namespace kvserve {

// The names model.quantization / --quantization take: none, int8, int4, fp8, and ggml block types
// for who wants one exactly.
const std::vector<std::string>& weight_quantization_names();

// The ggml type a CPU linear layer is quantized to: -1 for "" / none and for fp8 (not a ggml type:
// Fp8Weight); int8 = Q8_0 (a scale per 32 weights); int4 = Q4_0 (docs/architecture.md "Quantized
// weights" gives the measured choice); a ggml type by its name (q4_1, q5_0, q5_1, q8_0, q2_K, q3_K, q4_K, q5_K,
// q6_K). Throws naming `field` and the accepted values.
int weight_quantization_ggml_type(const std::string& name, const std::string& field = "quantization");

// Whether `name` asks for fp8 weights (e4m3, a scale per output channel, Fp8Weight).
bool weight_quantization_is_fp8(const std::string& name);
// Whether `name` is int4: ggml's Q4_0 on the CPU, Int4Weight (tinygemm) on a CUDA device.
bool weight_quantization_is_int4(const std::string& name);
// Whether `name` is int8: ggml's Q8_0 on the CPU, Int8Weight (int8 groups of 128) on a CUDA device.
bool weight_quantization_is_int8(const std::string& name);

}  // namespace kvserve
