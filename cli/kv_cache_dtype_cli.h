#pragma once
// --kv-cache-dtype: the KV cache's storage dtype flag of serve, generate, forward, perplexity and bench decode.
#include <CLI/CLI.hpp>

#include <string>

namespace kvserve::cli {

// The names cache.kv_cache_dtype takes in YAML; CLI11 rejects anything else, naming the flag.
inline CLI::Option* add_kv_cache_dtype_option(CLI::App* cmd, std::string& value) {
  return cmd
      ->add_option("--kv-cache-dtype", value,
                   "KV cache storage dtype: auto (= the compute dtype; float16 for a GGUF file on the CPU), float32, bfloat16, float16, or quantized "
                   "rows with a scale per 32 values: int8 (= q8_0, 8.5 bits a value), int4 (= q4_0, 4.5 bits), q4_1 "
                   "(5 bits), fp8 (= fp8_e4m3, 8.5 bits)")
      ->check(CLI::IsMember({"auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "int8", "int4", "q8_0",
                             "q4_0", "q4_1", "fp8", "fp8_e4m3"}));
}

}  // namespace kvserve::cli
