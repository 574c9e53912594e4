// Qwen2 / Qwen2.5 (Qwen2ForCausalLM): Llama's block with a bias on q, k and v (always, whatever the
// config says) and none on o_proj or the MLP; sliding_window only where use_sliding_window is set.
#include "backend/model/config_fields.h"
#include "backend/model/model_family.h"

namespace kvserve {
namespace {

using namespace config_fields;

void parse_qwen2(const json& j, ModelConfig& c, const std::string& where) {
  c.attention_bias = true;
  parse_rope(j, c, where);
  parse_sliding_window(j, c, where, /*default_on=*/false);
}

}  // namespace

const ModelFamily& qwen2_family() {
  static const ModelFamily f{.architectures = {"Qwen2ForCausalLM"}, .model_types = {"qwen2"}, .parse = parse_qwen2};
  return f;
}

}  // namespace kvserve
