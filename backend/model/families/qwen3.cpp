// Qwen3 dense (Qwen3ForCausalLM): Llama's block plus an RMSNorm over head_dim of every q and k head
// before RoPE (q_norm / k_norm); attention_bias covers q/k/v and o_proj, the MLP has no bias;
// head_dim defaults to 128 whatever hidden_size / num_attention_heads is (Qwen3Config).
#include "backend/model/config_fields.h"
#include "backend/model/model_family.h"

namespace kvserve {
namespace {

using namespace config_fields;

void parse_qwen3(const json& j, ModelConfig& c, const std::string& where) {
  c.attention_bias = get_opt<bool>(j, "attention_bias", where).value_or(false);
  c.o_proj_bias = c.attention_bias;
  c.block.qk_norm = true;
  parse_rope(j, c, where);
  parse_sliding_window(j, c, where, /*default_on=*/false);
}

}  // namespace

const ModelFamily& qwen3_family() {
  static const ModelFamily f{
      .architectures = {"Qwen3ForCausalLM"}, .model_types = {"qwen3"}, .default_head_dim = 128, .parse = parse_qwen3};
  return f;
}

}  // namespace kvserve
