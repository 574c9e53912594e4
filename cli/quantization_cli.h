#pragma once
// --quantization: weight quantization at load (model.quantization) for serve, generate, forward,
// perplexity and bench decode, with vLLM's flag name.
#include <CLI/CLI.hpp>

#include <string>

namespace kvserve::cli {

inline CLI::Option* add_quantization_option(CLI::App* cmd, std::string& value) {
  return cmd
      ->add_option("--quantization", value,
                   "quantize a float checkpoint's linear layers at load (CPU): none, int8 (ggml Q8_0), int4 (ggml Q4_0); "
                   "a .gguf model is served in the blocks it ships")
      ->check(CLI::IsMember({"none", "int8", "int4", "fp8"}));
}

}  // namespace kvserve::cli
