#pragma once
// ModelFamily: one decoder family as config.json names it — the architectures it serves, the defaults
// its config class gives the shared fields, and how it reads its own fields into ModelConfig (its
// BlockSpec, biases, RoPE, layer windows). Each family is one file in backend/model/families/; the
// decoder skeleton (decoder_model.h) runs any of them from the ModelConfig alone.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/model/model_config.h"

namespace kvserve {

struct ModelFamily {
  std::vector<std::string> architectures;  // config.json "architectures"[0]
  std::vector<std::string> model_types;    // for configs without "architectures"
  // Defaults of the shared fields when config.json leaves them out (those of the family's config class).
  int64_t default_head_dim = 0;  // 0: hidden_size / num_attention_heads
  int64_t default_max_position_embeddings = 2048;
  bool default_tie_word_embeddings = false;
  // Reads the family's own fields after the shared ones (architecture, sizes, head_dim, eps) are set.
  void (*parse)(const nlohmann::json& j, ModelConfig& c, const std::string& where) = nullptr;
};

// The families, one per file in backend/model/families/ (a new family adds itself to all_families()).
const ModelFamily& llama_family();   // LlamaForCausalLM, MistralForCausalLM
const ModelFamily& qwen2_family();   // Qwen2ForCausalLM
const ModelFamily& qwen3_family();   // Qwen3ForCausalLM (dense)
const ModelFamily& gemma3_family();  // Gemma3ForCausalLM (text)
const std::vector<const ModelFamily*>& all_families();

// The family serving `architecture`, or null.
const ModelFamily* family_of_architecture(const std::string& architecture);
// The architecture a config without "architectures" means by its model_type ("" if none).
std::string architecture_of_model_type(const std::string& model_type);
// "LlamaForCausalLM, MistralForCausalLM, ..." for error messages.
std::string supported_architectures();

}  // namespace kvserve
