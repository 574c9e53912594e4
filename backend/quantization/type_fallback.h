#pragma once
// The ggml block type a linear weight is quantized to at load when its rows are not whole blocks of
// the type asked for: llama-quantize's fallback, so that a K-quant asked of a model whose hidden size
// is not a multiple of 256 (the default model's 576, Gemma 3 270M's 640) quantizes as llama.cpp's
// own files of that model are made, instead of being refused.
#include <cstdint>

namespace kvserve {

// `type` when `cols` is a whole number of its blocks; otherwise llama.cpp's fallback for it (Q2_K and
// Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), or -1 (the weight stays as it is, in
// float) where even that type's 32-value blocks do not fit, or `type` has no fallback.
int quant_type_for_cols(int type, int64_t cols);

}  // namespace kvserve
