#pragma once
// The config.json readers that model families share (backend/model/families/): typed fields whose
// errors name the file and key, and the RoPE parameters as transformers writes them.
#include <cmath>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/model/model_config.h"
#include "common/check.h"

namespace kvserve::config_fields {

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

// An integer or a list of integers (token ids); absent = empty.
std::vector<int64_t> id_list(const json& j, const char* key, const std::string& where);
// The object transformers 5 (rope_parameters) or 4.x (rope_scaling) wrote, or null.
const json* rope_json(const json& j, const std::string& where);
// One RoPE parameter object into a scaling and its base (`sub` names it in errors).
void parse_rope_object(const json* rp, const ModelConfig& c, RopeScaling& s, double& theta, const std::string& sub);
// The model's RoPE as a Llama-style config writes it: rope_theta and one scaling for every layer.
void parse_rope(const json& j, ModelConfig& c, const std::string& where);
// Mistral-style sliding_window, read only where use_sliding_window (default `default_on`) allows.
void parse_sliding_window(const json& j, ModelConfig& c, const std::string& where, bool default_on);

}  // namespace kvserve::config_fields
