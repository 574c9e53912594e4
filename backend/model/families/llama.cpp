// Llama 2/3 and Mistral (LlamaForCausalLM, MistralForCausalLM): the reference block — pre-norm
// RMSNorm, SiLU-gated MLP, one RoPE for every layer; attention_bias biases q/k/v and o_proj,
// mlp_bias the MLP; Mistral's sliding_window is honoured as a limit check.
#include "backend/model/config_fields.h"
#include "backend/model/model_family.h"

namespace kvserve {
namespace {

using namespace config_fields;

void parse_llama(const json& j, ModelConfig& c, const std::string& where) {
  c.attention_bias = get_opt<bool>(j, "attention_bias", where).value_or(false);
  c.o_proj_bias = c.attention_bias;
  c.mlp_bias = get_opt<bool>(j, "mlp_bias", where).value_or(false);
  parse_rope(j, c, where);
  parse_sliding_window(j, c, where, /*default_on=*/true);
}

}  // namespace

const ModelFamily& llama_family() {
  static const ModelFamily f{.architectures = {"LlamaForCausalLM", "MistralForCausalLM"},
                             .model_types = {"llama", "mistral"},
                             .parse = parse_llama};
  return f;
}

}  // namespace kvserve
