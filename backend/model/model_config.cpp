#include "backend/model/model_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>
#include <type_traits>

#include "backend/model/config_fields.h"
#include "backend/model/model_family.h"
#include "common/check.h"

namespace kvserve {

using namespace config_fields;

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
  if (c.architecture.empty()) c.architecture = architecture_of_model_type(c.model_type);
  const ModelFamily* family = family_of_architecture(c.architecture);
  if (!family) {
    KV_FAIL(where << ": unknown architecture '" << c.architecture << "' (supported: " << supported_architectures() << ")");
  }

  c.vocab_size = get_req<int64_t>(j, "vocab_size", where);
  c.hidden_size = get_req<int64_t>(j, "hidden_size", where);
  c.intermediate_size = get_req<int64_t>(j, "intermediate_size", where);
  c.num_hidden_layers = get_req<int64_t>(j, "num_hidden_layers", where);
  c.num_attention_heads = get_req<int64_t>(j, "num_attention_heads", where);
  c.num_key_value_heads = get_opt<int64_t>(j, "num_key_value_heads", where).value_or(c.num_attention_heads);
  c.max_position_embeddings =
      get_opt<int64_t>(j, "max_position_embeddings", where).value_or(family->default_max_position_embeddings);
  c.rms_norm_eps = get_opt<double>(j, "rms_norm_eps", where).value_or(1e-6);
  c.tie_word_embeddings = get_opt<bool>(j, "tie_word_embeddings", where).value_or(family->default_tie_word_embeddings);
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
  c.head_dim = get_opt<int64_t>(j, "head_dim", where).value_or(family->default_head_dim);
  if (c.head_dim == 0) {
    KV_CHECK(c.hidden_size % c.num_attention_heads == 0,
             where << ": hidden_size must be a multiple of num_attention_heads when head_dim is absent");
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  KV_CHECK(c.head_dim > 0 && c.head_dim % 2 == 0, where << ": head_dim must be a positive even number");
  KV_CHECK(c.rms_norm_eps > 0, where << ": rms_norm_eps must be positive");
  family->parse(j, c, where);
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
  m.qk_norm = c.block.qk_norm;
  return m;
}

}  // namespace kvserve
