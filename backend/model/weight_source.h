#pragma once
// WeightSource: where DecoderModel::load reads a model's tensors, by their Hugging Face names: a
// safetensors checkpoint (backend/model/checkpoint.h), or a GGUF file whose tensors are renamed and
// reshaped into the Hugging Face layout, and whose linear weights stay in their ggml blocks.
#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/model/checkpoint.h"
#include "backend/model/model_config.h"
#include "backend/quantization/linear_weight.h"

namespace kvserve {

// A model's config: <dir>/config.json (load_model_config), or a .gguf file's metadata.
ModelConfig read_model_config(const std::string& path);

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // A model directory (config.json + safetensors) or a .gguf file.
  static std::unique_ptr<WeightSource> open(const std::string& path, const ModelConfig& config);

  virtual bool contains(const std::string& name) const = 0;
  // A tensor (a norm, a bias, a dense weight) in `dtype` on `device`, optionally a slice; the full
  // shape is checked first so a mismatch names the tensor and file.
  virtual torch::Tensor load(const std::string& name, const std::vector<int64_t>& shape, torch::Dtype dtype,
                             const torch::Device& device, std::optional<TensorSlice> slice = std::nullopt) const = 0;
  // A linear weight [N, K]: blocks as the file stores them where the device is the CPU and they are
  // quantized, else dense in `dtype` on `device`.
  virtual LinearWeight load_linear(const std::string& name, const std::vector<int64_t>& shape, torch::Dtype dtype,
                                   const torch::Device& device, std::optional<TensorSlice> slice = std::nullopt) const = 0;
  virtual size_t num_tensors() const = 0;
  // "safetensors" or "gguf".
  virtual std::string format() const = 0;
  // The block types (ggml names, e.g. "q4_1, q6_K") of the linear tensors load_linear dequantized
  // because the device has no kernel for them (a GGUF on CUDA keeps only Q8_0 as codes); "" if none.
  virtual std::string dequantized_types() const { return ""; }
};

}  // namespace kvserve
