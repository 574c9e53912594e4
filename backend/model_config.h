#pragma once
// ModelConfig: the Llama-family architecture read from a Hugging Face config.json.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "parallel/shard_layout.h"

namespace kvserve {

// RoPE frequency scaling as in transformers' rope_scaling / rope_parameters.
struct RopeScaling {
  enum class Kind { kDefault, kLinear, kLlama3 };
  Kind kind = Kind::kDefault;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  std::string architecture;  // LlamaForCausalLM | MistralForCausalLM | Qwen2ForCausalLM
  std::string model_type;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v bias (Qwen2 always, Llama when attention_bias is set)
  bool o_proj_bias = false;     // Llama's attention_bias also biases o_proj
  bool mlp_bias = false;
  std::optional<int64_t> sliding_window;  // Mistral/Qwen2; only honoured as a limit check
  std::vector<int64_t> bos_token_ids;
  std::vector<int64_t> eos_token_ids;
  std::string torch_dtype;  // dtype on disk as declared, informational

  int64_t q_per_kv() const { return num_attention_heads / num_key_value_heads; }
};

// Parses and validates config.json text; `where` names the file in error messages.
ModelConfig parse_model_config(const std::string& json_text, const std::string& where);

// The numbers the tensor/pipeline split needs (parallel/shard_layout.h).
parallel::ModelShape model_shape(const ModelConfig& c);
// Reads <dir>/config.json.
ModelConfig load_model_config(const std::string& model_dir);

}  // namespace kvserve
