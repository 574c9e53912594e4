#pragma once
// Weight quantization at load (`model.quantization`, `--quantization`, vLLM's names): which ggml
// block type a float checkpoint's linear layers become on the CPU.
#include <string>

namespace kvserve {

enum class WeightQuantization { kNone, kInt8, kInt4, kFp8 };

// "" / "none" / "int8" / "int4" / "fp8"; throws naming `field` and the accepted values.
WeightQuantization weight_quantization_from_name(const std::string& name, const std::string& field = "quantization");
std::string weight_quantization_name(WeightQuantization q);
// The ggml type a CPU linear layer is quantized to: int8 = Q8_0 (a scale per 32 weights), int4 =
// Q4_0 (the same, 4-bit; docs/architecture.md "Quantized weights" gives the measured choice);
// -1 for none. fp8 has no CPU kernel: it throws naming `field`.
int weight_quantization_ggml_type(WeightQuantization q, const std::string& field = "quantization");

}  // namespace kvserve
