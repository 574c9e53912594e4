#pragma once
// Random KVzap predictors for the fixture models, written as kvpress's KVzapModel saves them
// (config.json + model.safetensors), for gtests of `method: kvzap`.
#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "backend/model/model_config.h"
#include "backend/model/safetensors_writer.h"

namespace kvserve::test {

// Writes a predictor for the model `c` into `dir` (created): linear when mlp_hidden == 0, else a
// two-layer MLP of that width; weights from `seed`. Returns the weights written, by tensor name.
inline std::map<std::string, torch::Tensor> write_kvzap_predictor(const std::string& dir, const ModelConfig& c, int64_t mlp_hidden, uint64_t seed) {
  std::filesystem::create_directories(dir);
  torch::manual_seed(seed);
  const int64_t in = c.hidden_size, out = c.num_key_value_heads;
  std::map<std::string, torch::Tensor> t;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "layers." + std::to_string(l);
    if (mlp_hidden == 0) {
      t[p + ".weight"] = torch::randn({out, in}) / std::sqrt(static_cast<double>(in));
      t[p + ".bias"] = torch::randn({out});
    } else {
      t[p + ".0.weight"] = torch::randn({mlp_hidden, in}) / std::sqrt(static_cast<double>(in));
      t[p + ".0.bias"] = torch::randn({mlp_hidden}) * 0.1;
      t[p + ".2.weight"] = torch::randn({out, mlp_hidden}) / std::sqrt(static_cast<double>(mlp_hidden));
      t[p + ".2.bias"] = torch::randn({out});
    }
  }
  write_safetensors(dir + "/model.safetensors", t);
  nlohmann::json j = {{"model_type", "kvzap"}, {"input_dim", in}, {"output_dim", out}, {"n_modules", c.num_hidden_layers}};
  j["hidden_dim"] = mlp_hidden == 0 ? nlohmann::json(nullptr) : nlohmann::json(mlp_hidden);
  std::ofstream(dir + "/config.json") << j.dump(2);
  return t;
}

}  // namespace kvserve::test
