#include "backend/scoring/kvzap_predictor.h"

#include "common/model_path.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "backend/model/checkpoint.h"
#include "common/check.h"
#include "policies/kvzip_scores.h"

namespace kvserve {
namespace fs = std::filesystem;

namespace {
int64_t positive_field(const nlohmann::json& j, const char* key, const std::string& where) {
  KV_CHECK(j.contains(key) && j[key].is_number_integer() && j[key].get<int64_t>() > 0,
           where << ": '" << key << "' must be a positive integer");
  return j[key].get<int64_t>();
}
}  // namespace

KvzapPredictor::KvzapPredictor(const std::string& dir, const KvzapShape& shape, torch::Dtype dtype,
                               const torch::Device& device)
    : dir_(dir) {
  const fs::path config = fs::path(dir) / "config.json";
  KV_CHECK(fs::is_regular_file(config), "kvzap predictor: no " << config.string()
                                            << " (train one with `make train-kvzap`, or give the policy parameter "
                                            << "predictor=<dir> of a kvpress KVzapModel)");
  nlohmann::json j;
  {
    std::ifstream in(config);
    std::stringstream text;
    text << in.rdbuf();
    try {
      j = nlohmann::json::parse(text.str());
    } catch (const nlohmann::json::exception& e) {
      KV_FAIL(config.string() << ": not valid JSON: " << e.what());
    }
  }
  const std::string where = config.string();
  KV_CHECK(j.is_object(), where << ": expected a JSON object");
  const int64_t in = positive_field(j, "input_dim", where), out = positive_field(j, "output_dim", where);
  const int64_t n = positive_field(j, "n_modules", where);
  if (j.contains("hidden_dim") && !j["hidden_dim"].is_null()) hidden_dim_ = positive_field(j, "hidden_dim", where);
  KV_CHECK(in == shape.hidden && out == shape.kv_heads && n == shape.num_layers,
           where << ": a predictor for " << n << " layers of width " << in << " scoring " << out
                 << " KV heads does not fit this model (" << shape.num_layers << " layers, hidden size " << shape.hidden
                 << ", " << shape.kv_heads << " KV heads)");
  const Checkpoint ckpt(dir);
  auto load = [&](const std::string& name, std::vector<int64_t> s) { return ckpt.load(name, s, dtype, device); };
  for (int64_t l = 0; l < n; ++l) {
    const std::string p = "layers." + std::to_string(l);
    Layer layer;
    if (hidden_dim_ == 0) {
      layer.w1 = load(p + ".weight", {out, in});
      layer.b1 = load(p + ".bias", {out});
    } else {
      layer.w1 = load(p + ".0.weight", {hidden_dim_, in});
      layer.b1 = load(p + ".0.bias", {hidden_dim_});
      layer.w2 = load(p + ".2.weight", {out, hidden_dim_});
      layer.b2 = load(p + ".2.bias", {out});
    }
    layers_.push_back(std::move(layer));
  }
}

torch::Tensor KvzapPredictor::scores(int64_t layer, const torch::Tensor& h) const {
  KV_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()),
           "kvzap predictor: layer " << layer << " outside [0, " << layers_.size() << ")");
  const Layer& l = layers_[static_cast<size_t>(layer)];
  auto x = h.to(l.w1.scalar_type());
  auto y = torch::nn::functional::linear(x, l.w1, l.b1);
  if (hidden_dim_ > 0) y = torch::nn::functional::linear(torch::gelu(y), l.w2, l.b2);  // exact (erf) GELU, as nn.GELU()
  return y.to(torch::kFloat32);
}

std::string kvzap_predictor_dir(const PolicyConfig& cfg, const std::string& model_dir) {
  return cfg.predictor.empty() ? (fs::path(model_side_dir(model_dir)) / "kvzap").string() : cfg.predictor;
}

void kvzap_select(KvMemory& kv, int64_t seq_id, int64_t prompt_len, const PolicyConfig& cfg) {
  std::vector<torch::Tensor> scores = kv.take_scores(seq_id);
  const int64_t scored = prompt_len - std::min(cfg.window, prompt_len);
  for (auto& s : scores) {
    KV_CHECK(s.size(1) == prompt_len, "internal: kvzap scores of " << s.size(1) << " positions for a prompt of " << prompt_len);
    s = s.narrow(1, 0, scored).contiguous();
  }
  protect_sinks(scores, cfg.sink);
  kv.select_by_scores(seq_id, scores);
}

}  // namespace kvserve
