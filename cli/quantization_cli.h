#pragma once
// --quantization: weight quantization at load (model.quantization) for serve, generate, forward,
// perplexity and bench decode, with vLLM's flag name.
#include <CLI/CLI.hpp>

#include <string>

#include "backend/quantization/weight_quantization.h"

namespace kvserve::cli {

inline CLI::Option* add_quantization_option(CLI::App* cmd, std::string& value) {
  return cmd
      ->add_option("--quantization", value,
                   "quantize a float checkpoint's linear layers at load: on the CPU none, int8 (ggml Q8_0), int4 (ggml "
                   "Q4_0), or a ggml type (q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k); fp8 (e4m3, a scale per output "
                   "channel, per-token fp8 activations) on CUDA GPUs of compute capability 8.9+ (on the CPU a slow "
                   "reference path); on CUDA int4 is libtorch's tinygemm (4-bit groups of 128 with a bfloat16 scale and "
                   "zero, compute capability 8.0+); a .gguf model is served in the blocks it ships")
      ->check(CLI::IsMember(weight_quantization_names(), CLI::ignore_case));
}

}  // namespace kvserve::cli
