#pragma once
// LlamaModel: the Llama-family decoder (Llama 2/3, Mistral, Qwen2 shapes) in libtorch, prefill and batched decode.
#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kv_memory.h"
#include "model_config.h"
#include "rope.h"

namespace kvserve {

// How to load a checkpoint: device, compute dtype (default fp32 on CPU, bf16 on CUDA), progress output.
struct LoadOptions {
  std::string device = "cpu";
  std::string dtype;  // empty = device default
  bool progress = true;
};

class LlamaModel {
 public:
  // Loads config.json + safetensors weights from `model_dir`; errors name the file and tensor.
  static std::shared_ptr<LlamaModel> load(const std::string& model_dir, const LoadOptions& options);

  const ModelConfig& config() const { return config_; }
  const std::string& model_dir() const { return model_dir_; }
  torch::Device device() const { return device_; }
  torch::Dtype dtype() const { return dtype_; }
  int64_t kv_bytes_per_token() const;  // all layers, K and V

  // Runs the whole prompt through every layer, handing each layer's K/V to `kv`. Returns fp32
  // logits for every position ([T, V]) when all_logits, else for the last position ([1, V]).
  torch::Tensor prefill(int64_t seq_id, const std::vector<int64_t>& tokens, KvMemory& kv, bool all_logits = false,
                        const std::string& policy = "");
  // One new token per sequence at batch.positions; returns fp32 logits [B, V].
  torch::Tensor decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens, KvMemory& kv);

 private:
  struct Layer {
    torch::Tensor input_norm, post_norm;
    torch::Tensor wqkv, bqkv;  // fused q,k,v projection (bias only for Qwen2-style checkpoints)
    torch::Tensor wo, bo;
    torch::Tensor wgate_up, bgate_up;  // fused gate and up projections
    torch::Tensor wdown, bdown;
  };
  LlamaModel() = default;
  torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w) const;
  torch::Tensor mlp(const Layer& l, const torch::Tensor& x) const;
  torch::Tensor lm_head(const torch::Tensor& x) const;

  ModelConfig config_;
  std::string model_dir_;
  torch::Device device_{torch::kCPU};
  torch::Dtype dtype_ = torch::kFloat32;
  torch::Tensor embed_, final_norm_, lm_head_;
  std::vector<Layer> layers_;
  std::unique_ptr<Rope> rope_;
};

}  // namespace kvserve
