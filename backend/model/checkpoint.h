#pragma once
// Checkpoint: the weights of a Hugging Face model directory (single or sharded safetensors), read lazily.
#include <torch/torch.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/model/safetensors_file.h"
#include "cache_manager/kv_quant.h"

namespace kvserve {

// A contiguous range along one dimension; tensor parallelism reads only its rows or columns.
struct TensorSlice {
  int64_t dim = 0;
  int64_t start = 0;
  int64_t length = 0;
};

class Checkpoint {
 public:
  // Opens model.safetensors or model.safetensors.index.json (+ shards) in `model_dir`.
  explicit Checkpoint(const std::string& model_dir);

  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  std::vector<int64_t> shape(const std::string& name) const;
  // Returns a new tensor (own memory) in `dtype` on `device`, optionally just a slice.
  // `expected_shape` (full shape) is checked first so a mismatch names the tensor and file.
  torch::Tensor load(const std::string& name, const std::vector<int64_t>& expected_shape, torch::Dtype dtype,
                     const torch::Device& device, std::optional<TensorSlice> slice = std::nullopt) const;
  size_t num_tensors() const { return where_.size(); }
  const std::vector<std::string>& files() const { return file_names_; }

 private:
  const SafetensorsFile& file_of(const std::string& name) const;
  std::string dir_;
  std::vector<std::string> file_names_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;  // tensor name -> index into files_
};

torch::Dtype dtype_from_name(const std::string& name);  // "float32"/"fp32"/"bfloat16"/"bf16"/"float16"/"fp16"
// The KV cache's storage dtype: "" or "auto" = `compute` (the model's dtype), else as dtype_from_name;
// a quantized cache's name (kv_cache_quant_from_name) gives `compute`, what its rows decode to.
torch::Dtype kv_cache_dtype_from_name(const std::string& name, torch::Dtype compute);
// The quantized format a KV cache dtype names: int8 = q8_0, int4 = q4_0 (docs/architecture.md,
// "Quantized KV"), q8_0, q4_0, q4_1 as llama.cpp spells them; none for the float names. fp8 names
// are refused (no fp8 cache yet: int8 stores as few bytes).
KvQuant kv_cache_quant_from_name(const std::string& name);
std::string dtype_name(torch::Dtype dtype);  // "float32", "bfloat16", "float16" (others: torch's name)

}  // namespace kvserve
