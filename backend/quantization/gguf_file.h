#pragma once
// GgufFile: a GGUF model file (llama.cpp's format) opened with ggml's own reader: its metadata,
// and its tensors as ggml blocks (QuantizedWeight) or as fp32 torch tensors.
#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/quantization/quantized_weight.h"

struct gguf_context;

namespace kvserve {

class GgufFile {
 public:
  // Opens and validates the header, metadata and tensor table; the tensor data is mapped, not read.
  // Throws naming the file when it is missing, truncated or not GGUF.
  explicit GgufFile(const std::string& path);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const { return path_; }
  // general.architecture ("llama", "qwen2", "qwen3", "gemma3" ...).
  std::string architecture() const;

  bool has_key(const std::string& key) const;
  // Scalar metadata of any integer / float / bool / string type, converted; nullopt when absent,
  // throws naming the key when it holds another kind of value.
  std::optional<int64_t> get_int(const std::string& key) const;
  std::optional<double> get_float(const std::string& key) const;
  std::optional<std::string> get_string(const std::string& key) const;
  // Array metadata.
  std::vector<std::string> get_strings(const std::string& key) const;
  std::vector<int64_t> get_ints(const std::string& key) const;
  std::vector<double> get_floats(const std::string& key) const;

  std::vector<std::string> tensor_names() const;
  bool has_tensor(const std::string& name) const;
  // The torch shape (outermost first: a linear weight is [N, K]), the ggml type and the bytes.
  std::vector<int64_t> shape(const std::string& name) const;
  int tensor_type(const std::string& name) const;
  const uint8_t* tensor_data(const std::string& name) const;
  int64_t tensor_bytes(const std::string& name) const;

  // A 2-D tensor as ggml blocks, copied out of the file.
  QuantizedWeight load_blocks(const std::string& name) const;
  // Any tensor as fp32 in its torch shape (dequantized by ggml's to_float).
  torch::Tensor load_float(const std::string& name) const;

 private:
  int64_t tensor_id(const std::string& name) const;
  std::string path_;
  gguf_context* ctx_ = nullptr;
  const uint8_t* map_ = nullptr;
  size_t map_bytes_ = 0;
  size_t data_offset_ = 0;
};

// A Hugging Face config.json (text) for the model a GGUF file holds, from its metadata: what
// parse_model_config reads. Llama (and Mistral, which GGUF files call llama), Qwen2, Qwen3 and
// Gemma 3; another architecture throws naming it.
std::string gguf_hf_config_json(const GgufFile& f);

}  // namespace kvserve
