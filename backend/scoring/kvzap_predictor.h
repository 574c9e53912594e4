#pragma once
// KVzap's score predictor (arXiv 2601.07891; kvpress's KVzapModel and KVzapPress;
// docs/eval/kvzip-notes.md, "kvzap"): per layer a linear map, or a two-layer MLP (Linear, exact GELU,
// Linear), from the hidden states entering the layer's attention (after its input norm) to one
// score per KV head: a prediction of KVzip+'s log score, so the global top-k needs no reconstruction pass.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "cache_manager/kv_memory.h"
#include "policies/policy_config.h"

namespace kvserve {

// The model a predictor must fit: every layer's input width and the model's KV heads (all shards').
struct KvzapShape {
  int64_t hidden = 0, kv_heads = 0, num_layers = 0;
};

class KvzapPredictor {
 public:
  // Loads <dir>/config.json (kvpress's KVzapConfig: input_dim, output_dim, n_modules, hidden_dim,
  // null for a linear predictor) and <dir>/model.safetensors (`layers.{i}.weight|bias`, or
  // `layers.{i}.0.*` and `layers.{i}.2.*` for the MLP) in `dtype` on `device`. Errors name the file,
  // the tensor and what the model needs (`shape`).
  KvzapPredictor(const std::string& dir, const KvzapShape& shape, torch::Dtype dtype, const torch::Device& device);

  // Scores [n, KV] (fp32, every KV head of the model) of h [n, hidden] entering layer `layer`.
  torch::Tensor scores(int64_t layer, const torch::Tensor& h) const;
  bool is_mlp() const { return hidden_dim_ > 0; }
  const std::string& dir() const { return dir_; }

 private:
  struct Layer {
    torch::Tensor w1, b1, w2, b2;  // linear: w1 [KV, hidden], b1 [KV]; MLP: w1 [mlp, hidden] ... w2 [KV, mlp]
  };
  std::string dir_;
  int64_t hidden_dim_ = 0;  // the MLP's width (0: linear)
  std::vector<Layer> layers_;
};

// The predictor directory of a policy for the model in model_dir: cfg.predictor, or <model_dir>/kvzap.
std::string kvzap_predictor_dir(const PolicyConfig& cfg, const std::string& model_dir);

// kvzap's selection once the prefill's layers recorded their scores (KvMemory::record_scores): the
// first `sink` positions above every score of this memory's layers (as kvzip's), the trailing window
// left out (kept whole), then KvMemory::select_by_scores. In a sharded job every rank calls it together.
void kvzap_select(KvMemory& kv, int64_t seq_id, int64_t prompt_len, const PolicyConfig& cfg);

}  // namespace kvserve
