// Gemma 3 text (Gemma3ForCausalLM), as transformers' modeling_gemma3.py computes it:
//  - embeddings times sqrt(hidden_size), that factor rounded to the model's dtype first;
//  - RMSNorm with (1 + w), normalised and scaled in fp32, cast at the end, on the input, after
//    attention, before and after the MLP, the final norm, and per q / k head before RoPE;
//  - GeGLU: gelu(gate, tanh approximation) * up;
//  - attention logits scaled by query_pre_attn_scalar^-0.5 instead of head_dim^-0.5;
//  - local (sliding-window) layers with their own RoPE base (layer_windows, local_rope_theta),
//    global layers with rope_theta and its scaling; tied embeddings by default.
#include <tuple>

#include "backend/model/config_fields.h"
#include "backend/model/model_family.h"

namespace kvserve {
namespace {

using namespace config_fields;

// Gemma 3 text (transformers' Gemma3TextConfig): the fields its block variant reads and the layer
// mix. Every field that would change the arithmetic in a way not implemented is refused by name.
void parse_gemma3(const json& j, ModelConfig& c, const std::string& where) {
  // Gemma3ForCausalLM also loads the multimodal model's text tower, whose config is "gemma3".
  KV_CHECK(c.model_type.empty() || c.model_type == "gemma3_text",
           where << ": model_type '" << c.model_type << "' with Gemma3ForCausalLM: only the text model (gemma3_text) is supported");
  // attention_bias covers q/k/v and o_proj; no MLP bias; q_norm / k_norm every layer.
  c.attention_bias = get_opt<bool>(j, "attention_bias", where).value_or(false);
  c.o_proj_bias = c.attention_bias;
  c.block = BlockSpec{.norm = BlockSpec::Norm::kRmsOnePlus,
                      .activation = BlockSpec::Activation::kGeluTanh,
                      .qk_norm = true,
                      .sandwich_norms = true,
                      .scaled_embeddings = true};
  const std::string act = get_opt<std::string>(j, "hidden_activation", where).value_or("gelu_pytorch_tanh");
  if (act != "gelu_pytorch_tanh")
    KV_FAIL(where << ": hidden_activation '" << act << "' is not supported (only gelu_pytorch_tanh)");
  c.query_pre_attn_scalar = get_opt<double>(j, "query_pre_attn_scalar", where).value_or(256.0);
  KV_CHECK(c.query_pre_attn_scalar > 0 && std::isfinite(c.query_pre_attn_scalar),
           where << ": query_pre_attn_scalar must be positive");
  for (const char* key : {"final_logit_softcapping", "attn_logit_softcapping"}) {
    if (auto cap = get_opt<double>(j, key, where))
      KV_FAIL(where << ": " << key << " " << *cap << " is not supported (Gemma 3 leaves it null; Gemma 2 sets it)");
  }
  if (get_opt<bool>(j, "use_bidirectional_attention", where).value_or(false))
    KV_FAIL(where << ": use_bidirectional_attention true is not supported (a causal decoder only)");
  const int64_t window = get_opt<int64_t>(j, "sliding_window", where).value_or(4096);
  KV_CHECK(window > 0, where << ": sliding_window must be positive, got " << window);
  c.sliding_window = window;
  const size_t L = static_cast<size_t>(c.num_hidden_layers);
  c.layer_windows.assign(L, 0);
  auto types = j.find("layer_types");
  if (types != j.end() && !types->is_null()) {
    if (!types->is_array() || types->size() != L)
      KV_FAIL(where << ": key 'layer_types' must be a list of " << L << " layer types (num_hidden_layers)");
    for (size_t i = 0; i < L; ++i) {
      const json& t = (*types)[i];
      const std::string name = t.is_string() ? t.get<std::string>() : t.dump();
      if (name == "sliding_attention") c.layer_windows[i] = window;
      else if (name != "full_attention")
        KV_FAIL(where << ": layer_types[" << i << "] '" << name << "' is unknown (sliding_attention or full_attention)");
    }
  } else {
    // Configs written before layer_types: every pattern-th layer is global, the others local.
    const int64_t pattern = get_opt<int64_t>(j, "sliding_window_pattern", where).value_or(6);
    KV_CHECK(pattern > 0, where << ": sliding_window_pattern must be positive, got " << pattern);
    for (size_t i = 0; i < L; ++i) c.layer_windows[i] = (static_cast<int64_t>(i) + 1) % pattern != 0 ? window : 0;
  }
  // RoPE: transformers 5 writes rope_parameters per layer type; older configs wrote rope_theta (+
  // rope_scaling) for the global layers and rope_local_base_freq for the local ones, unscaled.
  c.rope_theta = 1e6;
  c.local_rope_theta = 10000.0;
  const json* rp = rope_json(j, where);
  const bool per_type = rp && (rp->contains("full_attention") || rp->contains("sliding_attention"));
  if (per_type) {
    for (auto [key, scaling, theta] : {std::tuple{"full_attention", &c.rope_scaling, &c.rope_theta},
                                       {"sliding_attention", &c.local_rope_scaling, &c.local_rope_theta}}) {
      auto it = rp->find(key);
      if (it == rp->end() || it->is_null()) continue;
      if (!it->is_object()) KV_FAIL(where << ": rope parameters '" << key << "' must be an object");
      parse_rope_object(&*it, c, *scaling, *theta, where + ": rope parameters '" + key + "'");
    }
  } else {
    if (auto theta = get_opt<double>(j, "rope_theta", where)) c.rope_theta = *theta;
    if (auto theta = get_opt<double>(j, "rope_local_base_freq", where)) c.local_rope_theta = *theta;
    if (rp) parse_rope_object(rp, c, c.rope_scaling, c.rope_theta, where + ": rope parameters");
  }
  KV_CHECK(c.rope_theta > 0, where << ": the global layers' rope_theta must be positive");
  KV_CHECK(c.local_rope_theta > 0, where << ": the local layers' rope theta (rope_local_base_freq) must be positive");
}

}  // namespace

const ModelFamily& gemma3_family() {
  static const ModelFamily f{.architectures = {"Gemma3ForCausalLM"},
                             .model_types = {"gemma3_text"},
                             .default_head_dim = 256,
                             .default_max_position_embeddings = 131072,
                             .default_tie_word_embeddings = true,
                             .parse = parse_gemma3};
  return f;
}

}  // namespace kvserve
