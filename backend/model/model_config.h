#pragma once
// ModelConfig: the decoder architecture read from a Hugging Face config.json: the fields every family
// shares, parsed here, and what its family (backend/model/model_family.h) states about its block.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "parallel/shard_layout.h"

namespace kvserve {

// RoPE frequency scaling as in transformers' rope_scaling / rope_parameters (modeling_rope_utils.py).
struct RopeScaling {
  enum class Kind { kDefault, kLinear, kLlama3, kYarn, kDynamic, kLongRope };
  Kind kind = Kind::kDefault;
  double factor = 1.0;
  // llama3
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  // llama3, yarn, longrope: the pretraining context (dynamic uses max_position_embeddings instead,
  // as transformers does).
  int64_t original_max_position_embeddings = 8192;
  // yarn, longrope: the factor cos and sin are multiplied by (transformers' attention_factor,
  // resolved at parse time from factor / mscale / mscale_all_dim when the config leaves it out).
  double attention_factor = 1.0;
  // yarn: the rotation counts that bound the interpolation ramp, and whether its ends are rounded
  // outwards to whole dimensions.
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  bool truncate = true;
  // longrope: per-frequency divisors ([head_dim / 2] each) for sequences up to / past the original context.
  std::vector<double> short_factor, long_factor;

  // dynamic and longrope change the frequencies with the sequence length (a forward's last position
  // + 1), so a position's K depends on how long its prompt was (backend/model/rope.h).
  bool length_dependent() const { return kind == Kind::kDynamic || kind == Kind::kLongRope; }
};

// How a family's decoder block computes, as the shared skeleton (backend/model/decoder_model.h) runs it.
// A family file (backend/model/families/) sets it; the skeleton never asks which family it runs.
struct BlockSpec {
  enum class Norm {
    kRms,         // x * rsqrt(mean(x^2) + eps), cast to the dtype, times w (Llama)
    kRmsOnePlus,  // the same scaled by (1 + w) in fp32 and cast last (Gemma)
  };
  enum class Activation { kSilu, kGeluTanh };  // of the gated MLP's gate
  Norm norm = Norm::kRms;
  Activation activation = Activation::kSilu;
  // RMSNorm over head_dim of every q and k head before RoPE (Qwen3, Gemma 3).
  bool qk_norm = false;
  // Norms of the attention and of the MLP outputs before their residual adds; the checkpoint then
  // names the pre-MLP norm pre_feedforward_layernorm (Gemma 2/3).
  bool sandwich_norms = false;
  // Embedding rows times sqrt(hidden_size), that factor rounded to the model's dtype (Gemma).
  bool scaled_embeddings = false;
};

struct ModelConfig {
  // LlamaForCausalLM | MistralForCausalLM | Qwen2ForCausalLM | Qwen3ForCausalLM | Gemma3ForCausalLM
  std::string architecture;
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
  BlockSpec block;
  std::optional<int64_t> sliding_window;  // Mistral/Qwen2/Qwen3: only honoured as a limit check; Gemma 3: local layers' window
  // Attention logits are q.k * query_pre_attn_scalar^-0.5 (0: head_dim, the usual 1/sqrt(D)).
  double query_pre_attn_scalar = 0.0;
  // Per layer: 0 = full (global) attention, w > 0 = a local layer that sees the last w positions
  // (its own included). Empty = every layer global.
  std::vector<int64_t> layer_windows;
  // Local layers' RoPE: base and scaling (Gemma 3: rope_local_base_freq, no scaling).
  double local_rope_theta = 10000.0;
  RopeScaling local_rope_scaling;
  std::vector<int64_t> bos_token_ids;
  std::vector<int64_t> eos_token_ids;
  std::string torch_dtype;  // dtype on disk as declared, informational

  int64_t q_per_kv() const { return num_attention_heads / num_key_value_heads; }
  // The window of a (global) layer: 0 for a global layer.
  int64_t layer_window(int64_t layer) const {
    return layer_windows.empty() ? 0 : layer_windows.at(static_cast<size_t>(layer));
  }
  bool has_local_layers() const {
    for (int64_t w : layer_windows) if (w > 0) return true;
    return false;
  }
};

// Parses and validates config.json text; `where` names the file in error messages.
ModelConfig parse_model_config(const std::string& json_text, const std::string& where);

// The longest sequence served when max_model_len is not set, derived as vLLM derives it: RoPE
// scalings that extend the context at run time count their factor (dynamic NTK:
// max_position_embeddings x factor; yarn: original_max_position_embeddings x factor, at least
// max_position_embeddings); the others' configs already state the extended length.
int64_t context_length(const ModelConfig& c);

// The numbers the tensor/pipeline split needs (parallel/shard_layout.h).
parallel::ModelShape model_shape(const ModelConfig& c);
// Reads <dir>/config.json.
ModelConfig load_model_config(const std::string& model_dir);

}  // namespace kvserve
