#include "backend/model_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>
#include <type_traits>

#include "common/check.h"

namespace kvserve {
namespace {

using nlohmann::json;

// Reads a field with a clear error naming the file and key when it has the wrong type.
template <typename T>
std::optional<T> get_opt(const json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    // nlohmann converts a float to an integer with a plain cast: 1e300 would be undefined
    // behaviour and 3.5 would silently become 3. Only integers (or integral floats such as 4096.0)
    // that fit are accepted.
    if (it->is_number_float()) {
      const double d = it->template get<double>();
      constexpr double lo = static_cast<double>(std::numeric_limits<T>::min());  // -2^(bits-1), exact
      if (!(std::isfinite(d) && std::floor(d) == d && d >= lo && d < -lo))
        KV_FAIL(where << ": key '" << key << "' must be an integer, got " << it->dump());
      return static_cast<T>(d);
    }
    if (it->is_number_unsigned() && it->template get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      KV_FAIL(where << ": key '" << key << "' is out of range: " << it->dump());
  }
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    KV_FAIL(where << ": key '" << key << "' has the wrong type (" << it->type_name() << ")");
  }
}

template <typename T>
T get_req(const json& j, const char* key, const std::string& where) {
  auto v = get_opt<T>(j, key, where);
  if (!v) KV_FAIL(where << ": missing required key '" << key << "'");
  return *v;
}

std::vector<int64_t> id_list(const json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return {};
  if (it->is_number_integer()) return {it->get<int64_t>()};
  if (it->is_array()) {
    std::vector<int64_t> out;
    for (const auto& e : *it) {
      if (!e.is_number_integer()) KV_FAIL(where << ": key '" << key << "' must hold integers");
      out.push_back(e.get<int64_t>());
    }
    return out;
  }
  KV_FAIL(where << ": key '" << key << "' must be an integer or a list of integers");
}

std::vector<double> number_list(const json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) KV_FAIL(where << ": missing required key '" << key << "'");
  if (!it->is_array()) KV_FAIL(where << ": key '" << key << "' must be a list of numbers");
  std::vector<double> out;
  for (const auto& e : *it) {
    if (!e.is_number()) KV_FAIL(where << ": key '" << key << "' must hold numbers only");
    out.push_back(e.get<double>());
  }
  return out;
}

// transformers' get_mscale (YaRN's attention temperature): 1 for no extension.
double yarn_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

// One rope parameter object (rope_parameters, or one layer type's entry of it, or rope_scaling):
// its base (when it states one) into `theta`, its scaling into `s`.
void parse_rope_object(const json* rp, const ModelConfig& c, RopeScaling& s, double& theta, const std::string& sub) {
  {
    if (auto t = get_opt<double>(*rp, "rope_theta", sub)) theta = *t;
    std::string type = get_opt<std::string>(*rp, "rope_type", sub)
                           .value_or(get_opt<std::string>(*rp, "type", sub).value_or("default"));
    // Every type below rotates the whole head; a partial rotation would silently rotate too much.
    if (auto partial = get_opt<double>(*rp, "partial_rotary_factor", sub); partial && *partial != 1.0)
      KV_FAIL(sub << ": partial_rotary_factor " << *partial << " is not supported (only 1.0)");
    // transformers fills a missing original_max_position_embeddings with max_position_embeddings
    // (standardize_rope_params), and derives a missing yarn/longrope factor from the two.
    auto original_ctx = [&] {
      return get_opt<int64_t>(*rp, "original_max_position_embeddings", sub).value_or(c.max_position_embeddings);
    };
    if (type == "default") {
      s.kind = RopeScaling::Kind::kDefault;
    } else if (type == "linear") {
      s.kind = RopeScaling::Kind::kLinear;
      s.factor = get_req<double>(*rp, "factor", sub);
    } else if (type == "llama3") {
      s.kind = RopeScaling::Kind::kLlama3;
      s.factor = get_req<double>(*rp, "factor", sub);
      s.low_freq_factor = get_req<double>(*rp, "low_freq_factor", sub);
      s.high_freq_factor = get_req<double>(*rp, "high_freq_factor", sub);
      s.original_max_position_embeddings = get_req<int64_t>(*rp, "original_max_position_embeddings", sub);
      KV_CHECK(s.high_freq_factor > s.low_freq_factor,
               sub << ": high_freq_factor must exceed low_freq_factor");
    } else if (type == "dynamic") {
      // Dynamic NTK stretches the base past max_position_embeddings itself (transformers ignores
      // original_max_position_embeddings for this type).
      s.kind = RopeScaling::Kind::kDynamic;
      s.factor = get_req<double>(*rp, "factor", sub);
      s.original_max_position_embeddings = c.max_position_embeddings;
      KV_CHECK(c.head_dim > 2, sub << ": dynamic scaling needs head_dim > 2");
    } else if (type == "yarn") {
      s.kind = RopeScaling::Kind::kYarn;
      s.original_max_position_embeddings = original_ctx();
      KV_CHECK(s.original_max_position_embeddings > 0, sub << ": original_max_position_embeddings must be positive");
      s.factor = get_opt<double>(*rp, "factor", sub)
                     .value_or(static_cast<double>(c.max_position_embeddings) /
                               static_cast<double>(s.original_max_position_embeddings));
      // Python truthiness as transformers tests it: 0 counts as absent.
      const double mscale = get_opt<double>(*rp, "mscale", sub).value_or(0.0);
      const double mscale_all_dim = get_opt<double>(*rp, "mscale_all_dim", sub).value_or(0.0);
      if (auto af = get_opt<double>(*rp, "attention_factor", sub)) {
        s.attention_factor = *af;
      } else if (mscale != 0.0 && mscale_all_dim != 0.0) {
        s.attention_factor = yarn_mscale(s.factor, mscale) / yarn_mscale(s.factor, mscale_all_dim);
      } else {
        s.attention_factor = yarn_mscale(s.factor, 1.0);
      }
      const double bf = get_opt<double>(*rp, "beta_fast", sub).value_or(0.0);
      const double bs = get_opt<double>(*rp, "beta_slow", sub).value_or(0.0);
      s.beta_fast = bf != 0.0 ? bf : 32.0;
      s.beta_slow = bs != 0.0 ? bs : 1.0;
      KV_CHECK(s.beta_fast > 0 && s.beta_slow > 0, sub << ": beta_fast and beta_slow must be positive");
      s.truncate = get_opt<bool>(*rp, "truncate", sub).value_or(true);
    } else if (type == "longrope") {
      s.kind = RopeScaling::Kind::kLongRope;
      s.original_max_position_embeddings = original_ctx();
      KV_CHECK(s.original_max_position_embeddings > 1, sub << ": original_max_position_embeddings must exceed 1");
      s.factor = get_opt<double>(*rp, "factor", sub)
                     .value_or(static_cast<double>(c.max_position_embeddings) /
                               static_cast<double>(s.original_max_position_embeddings));
      if (auto af = get_opt<double>(*rp, "attention_factor", sub)) {
        s.attention_factor = *af;
      } else {
        s.attention_factor = s.factor <= 1.0 ? 1.0
                                             : std::sqrt(1 + std::log(s.factor) /
                                                                 std::log(static_cast<double>(s.original_max_position_embeddings)));
      }
      s.short_factor = number_list(*rp, "short_factor", sub);
      s.long_factor = number_list(*rp, "long_factor", sub);
      for (auto [key, v] : {std::pair{"short_factor", &s.short_factor}, {"long_factor", &s.long_factor}}) {
        KV_CHECK(static_cast<int64_t>(v->size()) == c.head_dim / 2,
                 sub << ": key '" << key << "' has " << v->size() << " entries, head_dim / 2 = " << c.head_dim / 2);
        for (double f : *v) KV_CHECK(f > 0, sub << ": key '" << key << "' must hold positive numbers");
      }
    } else {
      KV_FAIL(sub << ": unsupported rope_type '" << type
                  << "' (supported: default, linear, llama3, yarn, dynamic, longrope)");
    }
    KV_CHECK(s.factor > 0, sub << ": factor must be positive");
    KV_CHECK(std::isfinite(s.attention_factor) && s.attention_factor > 0, sub << ": attention_factor must be positive");
  }
}

// The object transformers 5 (rope_parameters) or 4.x (rope_scaling) wrote, or null.
const json* rope_json(const json& j, const std::string& where) {
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    auto it = j.find(key);
    if (it != j.end() && !it->is_null()) {
      if (!it->is_object()) KV_FAIL(where << ": key '" << key << "' must be an object");
      return &*it;
    }
  }
  return nullptr;
}

void parse_rope(const json& j, ModelConfig& c, const std::string& where) {
  if (const json* rp = rope_json(j, where)) parse_rope_object(rp, c, c.rope_scaling, c.rope_theta, where + ": rope parameters");
  if (auto theta = get_opt<double>(j, "rope_theta", where)) c.rope_theta = *theta;
  KV_CHECK(c.rope_theta > 0, where << ": rope_theta must be positive");
}

// Gemma 3 text (transformers' Gemma3TextConfig): the fields its block variant reads and the layer
// mix. Every field that would change the arithmetic in a way not implemented is refused by name.
void parse_gemma3(const json& j, ModelConfig& c, const std::string& where) {
  c.gemma = true;
  c.hidden_act = get_opt<std::string>(j, "hidden_activation", where).value_or("gelu_pytorch_tanh");
  if (c.hidden_act != "gelu_pytorch_tanh")
    KV_FAIL(where << ": hidden_activation '" << c.hidden_act << "' is not supported (only gelu_pytorch_tanh)");
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

ModelConfig parse_model_config(const std::string& text, const std::string& where) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number like 1e400
    KV_FAIL(where << ": malformed JSON: " << e.what());
  }
  if (!j.is_object()) KV_FAIL(where << ": top level must be a JSON object");

  ModelConfig c;
  auto archs = j.find("architectures");
  if (archs != j.end() && archs->is_array() && !archs->empty() && (*archs)[0].is_string()) {
    c.architecture = (*archs)[0].get<std::string>();
  }
  c.model_type = get_opt<std::string>(j, "model_type", where).value_or("");
  if (c.architecture.empty()) {
    if (c.model_type == "llama") c.architecture = "LlamaForCausalLM";
    else if (c.model_type == "mistral") c.architecture = "MistralForCausalLM";
    else if (c.model_type == "qwen2") c.architecture = "Qwen2ForCausalLM";
    else if (c.model_type == "qwen3") c.architecture = "Qwen3ForCausalLM";
    else if (c.model_type == "gemma3_text") c.architecture = "Gemma3ForCausalLM";
  }
  if (c.architecture != "LlamaForCausalLM" && c.architecture != "MistralForCausalLM" &&
      c.architecture != "Qwen2ForCausalLM" && c.architecture != "Qwen3ForCausalLM" &&
      c.architecture != "Gemma3ForCausalLM") {
    KV_FAIL(where << ": unknown architecture '" << c.architecture
                  << "' (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                     "Gemma3ForCausalLM)");
  }
  const bool qwen2 = c.architecture == "Qwen2ForCausalLM";
  const bool qwen3 = c.architecture == "Qwen3ForCausalLM";
  const bool gemma3 = c.architecture == "Gemma3ForCausalLM";
  // Gemma3ForCausalLM also loads the multimodal model's text tower, whose config is "gemma3".
  KV_CHECK(!gemma3 || c.model_type.empty() || c.model_type == "gemma3_text",
           where << ": model_type '" << c.model_type << "' with Gemma3ForCausalLM: only the text model (gemma3_text) is supported");

  c.vocab_size = get_req<int64_t>(j, "vocab_size", where);
  c.hidden_size = get_req<int64_t>(j, "hidden_size", where);
  c.intermediate_size = get_req<int64_t>(j, "intermediate_size", where);
  c.num_hidden_layers = get_req<int64_t>(j, "num_hidden_layers", where);
  c.num_attention_heads = get_req<int64_t>(j, "num_attention_heads", where);
  c.num_key_value_heads = get_opt<int64_t>(j, "num_key_value_heads", where).value_or(c.num_attention_heads);
  c.max_position_embeddings = get_opt<int64_t>(j, "max_position_embeddings", where).value_or(gemma3 ? 131072 : 2048);
  c.rms_norm_eps = get_opt<double>(j, "rms_norm_eps", where).value_or(1e-6);
  c.tie_word_embeddings = get_opt<bool>(j, "tie_word_embeddings", where).value_or(gemma3);
  if (qwen2) {
    c.attention_bias = true;
  } else if (qwen3) {
    // Qwen3's attention_bias covers q/k/v and o_proj as Llama's does; its MLP has no bias; every
    // layer normalises each q and k head (q_norm / k_norm over head_dim).
    c.attention_bias = get_opt<bool>(j, "attention_bias", where).value_or(false);
    c.o_proj_bias = c.attention_bias;
    c.qk_norm = true;
  } else if (gemma3) {
    // Gemma 3: attention_bias covers q/k/v and o_proj; no MLP bias; q_norm / k_norm every layer.
    c.attention_bias = get_opt<bool>(j, "attention_bias", where).value_or(false);
    c.o_proj_bias = c.attention_bias;
    c.qk_norm = true;
  } else {
    c.attention_bias = get_opt<bool>(j, "attention_bias", where).value_or(false);
    c.o_proj_bias = c.attention_bias;
    c.mlp_bias = get_opt<bool>(j, "mlp_bias", where).value_or(false);
  }
  for (auto [key, v] : {std::pair{"vocab_size", c.vocab_size}, {"hidden_size", c.hidden_size},
                        {"intermediate_size", c.intermediate_size}, {"num_hidden_layers", c.num_hidden_layers},
                        {"num_attention_heads", c.num_attention_heads},
                        {"num_key_value_heads", c.num_key_value_heads},
                        {"max_position_embeddings", c.max_position_embeddings}}) {
    KV_CHECK(v > 0 && v < (int64_t{1} << 31), where << ": key '" << key << "' must be a positive integer, got " << v);
  }
  KV_CHECK(c.num_attention_heads % c.num_key_value_heads == 0,
           where << ": num_attention_heads (" << c.num_attention_heads
                 << ") must be a multiple of num_key_value_heads (" << c.num_key_value_heads << ")");
  // Qwen3Config defaults head_dim to 128 whatever hidden_size / num_attention_heads is.
  // Gemma3TextConfig defaults it to 256.
  c.head_dim = get_opt<int64_t>(j, "head_dim", where).value_or(qwen3 ? 128 : gemma3 ? 256 : 0);
  if (c.head_dim == 0) {
    KV_CHECK(c.hidden_size % c.num_attention_heads == 0,
             where << ": hidden_size must be a multiple of num_attention_heads when head_dim is absent");
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  KV_CHECK(c.head_dim > 0 && c.head_dim % 2 == 0, where << ": head_dim must be a positive even number");
  KV_CHECK(c.rms_norm_eps > 0, where << ": rms_norm_eps must be positive");
  if (gemma3) {
    parse_gemma3(j, c, where);
  } else {
    parse_rope(j, c, where);
    const bool sliding = get_opt<bool>(j, "use_sliding_window", where).value_or(!qwen2 && !qwen3);
    if (sliding) c.sliding_window = get_opt<int64_t>(j, "sliding_window", where);
  }
  c.bos_token_ids = id_list(j, "bos_token_id", where);
  c.eos_token_ids = id_list(j, "eos_token_id", where);
  c.torch_dtype = get_opt<std::string>(j, "dtype", where).value_or(get_opt<std::string>(j, "torch_dtype", where).value_or(""));
  return c;
}

ModelConfig load_model_config(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  std::ifstream f(path, std::ios::binary);
  if (!f) KV_FAIL(path << ": cannot open (is --model a Hugging Face model directory?)");
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_model_config(ss.str(), path);
}

int64_t context_length(const ModelConfig& c) {
  const auto& s = c.rope_scaling;
  auto scaled = [&](int64_t len) {
    const double n = std::floor(static_cast<double>(len) * s.factor);
    return n >= static_cast<double>(int64_t{1} << 40) ? int64_t{1} << 40 : static_cast<int64_t>(n);
  };
  switch (s.kind) {
    case RopeScaling::Kind::kDynamic: return std::max(c.max_position_embeddings, scaled(c.max_position_embeddings));
    case RopeScaling::Kind::kYarn:
      return std::max(c.max_position_embeddings, scaled(s.original_max_position_embeddings));
    default: return c.max_position_embeddings;
  }
}

parallel::ModelShape model_shape(const ModelConfig& c) {
  parallel::ModelShape m;
  m.num_layers = c.num_hidden_layers;
  m.hidden_size = c.hidden_size;
  m.intermediate_size = c.intermediate_size;
  m.num_heads = c.num_attention_heads;
  m.num_kv_heads = c.num_key_value_heads;
  m.head_dim = c.head_dim;
  m.vocab_size = c.vocab_size;
  m.tie_word_embeddings = c.tie_word_embeddings;
  m.attention_bias = c.attention_bias;
  m.o_proj_bias = c.o_proj_bias;
  m.mlp_bias = c.mlp_bias;
  m.qk_norm = c.qk_norm;
  return m;
}

}  // namespace kvserve
