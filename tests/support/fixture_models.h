#pragma once
// The random fixture checkpoints (tools/make_fixture_models.py, under $KVSERVE_FIXTURES) as
// parameters of gtests that run a model, and the deterministic prompts those tests feed them.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace kvserve::test {

// The fixture's directory, or "" when $KVSERVE_FIXTURES does not hold it (the test skips).
inline std::string fixture(const std::string& name) {
  const char* env = std::getenv("KVSERVE_FIXTURES");
  if (!env) return "";
  const std::string dir = std::string(env) + "/" + name;
  return std::filesystem::exists(dir + "/config.json") ? dir : "";
}

// Every architecture variant among the fixtures (not the sharded or bf16 copies) whose RoPE does
// not depend on the sequence length.
inline ::testing::internal::ParamGenerator<std::string> fixture_models() {
  return ::testing::Values(std::string("llama-gqa"), std::string("llama-mha"), std::string("llama-kvfew"),
                           std::string("qwen2-bias"), std::string("mistral"), std::string("llama3-rope"),
                           std::string("llama-tied"), std::string("qwen3"), std::string("llama-yarn"),
                           std::string("gemma3"));
}

// The fixtures whose RoPE frequencies change with the sequence length (dynamic NTK, longrope): a
// prompt's rows take the frequencies of its own end, so a chunk of a prompt differs from the whole.
inline ::testing::internal::ParamGenerator<std::string> length_dependent_rope_models() {
  return ::testing::Values(std::string("llama-dynamic"), std::string("llama-longrope"));
}

// gtest names allow no '-': llama-gqa -> llama_gqa.
inline std::string fixture_param_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string s = info.param;
  for (char& ch : s)
    if (ch == '-') ch = '_';
  return s;
}

// T token ids below `vocab`, different per salt, the same on every run.
inline std::vector<int64_t> make_prompt(int64_t T, int64_t salt, int64_t vocab) {
  std::vector<int64_t> p;
  for (int64_t t = 0; t < T; ++t) p.push_back((t * 7919 + salt * 104729 + (t * t) % 97) % vocab);
  return p;
}

}  // namespace kvserve::test
