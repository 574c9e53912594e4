#include "backend/quantization/gguf_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/check.h"
#include "common/model_path.h"
#include "ggml.h"
#include "gguf.h"

namespace kvserve {
namespace {

bool is_int_type(gguf_type t) {
  switch (t) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16:
    case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_BOOL:
      return true;
    default:
      return false;
  }
}

// An integer element of a scalar (data = gguf_get_val_data) or of an array.
int64_t int_at(gguf_type t, const void* data, size_t i) {
  switch (t) {
    case GGUF_TYPE_UINT8: return static_cast<const uint8_t*>(data)[i];
    case GGUF_TYPE_INT8: return static_cast<const int8_t*>(data)[i];
    case GGUF_TYPE_UINT16: return static_cast<const uint16_t*>(data)[i];
    case GGUF_TYPE_INT16: return static_cast<const int16_t*>(data)[i];
    case GGUF_TYPE_UINT32: return static_cast<const uint32_t*>(data)[i];
    case GGUF_TYPE_INT32: return static_cast<const int32_t*>(data)[i];
    case GGUF_TYPE_UINT64: return static_cast<int64_t>(static_cast<const uint64_t*>(data)[i]);
    case GGUF_TYPE_INT64: return static_cast<const int64_t*>(data)[i];
    case GGUF_TYPE_BOOL: return static_cast<const int8_t*>(data)[i] != 0;
    default: return 0;
  }
}

}  // namespace

GgufFile::GgufFile(const std::string& path) : path_(path) {
  namespace fs = std::filesystem;
  KV_CHECK(fs::is_regular_file(path), path << ": GGUF file not found");
  // ggml's reader checks the magic, version, every key and tensor record, and that each tensor's
  // data lies inside the file; it explains a failure on stderr and returns null.
  gguf_init_params params{};
  params.no_alloc = true;
  params.ctx = nullptr;
  ctx_ = gguf_init_from_file(path.c_str(), params);
  KV_CHECK(ctx_ != nullptr, path << ": not a valid GGUF file (ggml's reader refused it; its reason is printed above)");
  const int fd = ::open(path.c_str(), O_RDONLY);
  KV_CHECK(fd >= 0, path << ": cannot open: " << std::strerror(errno));
  struct stat st{};
  ::fstat(fd, &st);
  map_bytes_ = static_cast<size_t>(st.st_size);
  void* m = map_bytes_ > 0 ? ::mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0) : MAP_FAILED;
  ::close(fd);
  if (m == MAP_FAILED) {
    gguf_free(ctx_);
    KV_FAIL(path << ": cannot map the file: " << std::strerror(errno));
  }
  map_ = static_cast<const uint8_t*>(m);
  data_offset_ = gguf_get_data_offset(ctx_);
  for (int64_t i = 0; i < gguf_get_n_tensors(ctx_); ++i) {
    const size_t end = data_offset_ + gguf_get_tensor_offset(ctx_, i) + gguf_get_tensor_size(ctx_, i);
    if (end > map_bytes_) {
      const std::string name = gguf_get_tensor_name(ctx_, i);
      ::munmap(m, map_bytes_);
      gguf_free(ctx_);
      KV_FAIL(path << ": tensor '" << name << "' ends at byte " << end << " past the file's " << map_bytes_ << " (truncated?)");
    }
  }
}

GgufFile::~GgufFile() {
  if (map_) ::munmap(const_cast<uint8_t*>(map_), map_bytes_);
  map_ = nullptr;
  if (ctx_) gguf_free(ctx_);
  ctx_ = nullptr;
}

std::string GgufFile::architecture() const {
  auto a = get_string("general.architecture");
  KV_CHECK(a.has_value(), path_ << ": metadata key 'general.architecture' is missing");
  return *a;
}

bool GgufFile::has_key(const std::string& key) const { return gguf_find_key(ctx_, key.c_str()) >= 0; }

std::optional<int64_t> GgufFile::get_int(const std::string& key) const {
  const int64_t id = gguf_find_key(ctx_, key.c_str());
  if (id < 0) return std::nullopt;
  const gguf_type t = gguf_get_kv_type(ctx_, id);
  KV_CHECK(is_int_type(t), path_ << ": metadata key '" << key << "' holds " << gguf_type_name(t) << ", not an integer");
  return int_at(t, gguf_get_val_data(ctx_, id), 0);
}

std::optional<double> GgufFile::get_float(const std::string& key) const {
  const int64_t id = gguf_find_key(ctx_, key.c_str());
  if (id < 0) return std::nullopt;
  const gguf_type t = gguf_get_kv_type(ctx_, id);
  if (t == GGUF_TYPE_FLOAT32) return gguf_get_val_f32(ctx_, id);
  if (t == GGUF_TYPE_FLOAT64) return gguf_get_val_f64(ctx_, id);
  KV_CHECK(is_int_type(t), path_ << ": metadata key '" << key << "' holds " << gguf_type_name(t) << ", not a number");
  return static_cast<double>(int_at(t, gguf_get_val_data(ctx_, id), 0));
}

std::optional<std::string> GgufFile::get_string(const std::string& key) const {
  const int64_t id = gguf_find_key(ctx_, key.c_str());
  if (id < 0) return std::nullopt;
  const gguf_type t = gguf_get_kv_type(ctx_, id);
  KV_CHECK(t == GGUF_TYPE_STRING, path_ << ": metadata key '" << key << "' holds " << gguf_type_name(t) << ", not a string");
  return std::string(gguf_get_val_str(ctx_, id));
}

std::vector<std::string> GgufFile::get_strings(const std::string& key) const {
  const int64_t id = gguf_find_key(ctx_, key.c_str());
  if (id < 0) return {};
  KV_CHECK(gguf_get_kv_type(ctx_, id) == GGUF_TYPE_ARRAY && gguf_get_arr_type(ctx_, id) == GGUF_TYPE_STRING,
           path_ << ": metadata key '" << key << "' is not an array of strings");
  std::vector<std::string> out(gguf_get_arr_n(ctx_, id));
  for (size_t i = 0; i < out.size(); ++i) out[i] = gguf_get_arr_str(ctx_, id, i);
  return out;
}

std::vector<int64_t> GgufFile::get_ints(const std::string& key) const {
  const int64_t id = gguf_find_key(ctx_, key.c_str());
  if (id < 0) return {};
  const gguf_type t = gguf_get_kv_type(ctx_, id) == GGUF_TYPE_ARRAY ? gguf_get_arr_type(ctx_, id) : GGUF_TYPE_COUNT;
  KV_CHECK(is_int_type(t), path_ << ": metadata key '" << key << "' is not an array of integers");
  std::vector<int64_t> out(gguf_get_arr_n(ctx_, id));
  const void* data = gguf_get_arr_data(ctx_, id);
  for (size_t i = 0; i < out.size(); ++i) out[i] = int_at(t, data, i);
  return out;
}

std::vector<double> GgufFile::get_floats(const std::string& key) const {
  const int64_t id = gguf_find_key(ctx_, key.c_str());
  if (id < 0) return {};
  const gguf_type t = gguf_get_kv_type(ctx_, id) == GGUF_TYPE_ARRAY ? gguf_get_arr_type(ctx_, id) : GGUF_TYPE_COUNT;
  KV_CHECK(t == GGUF_TYPE_FLOAT32 || t == GGUF_TYPE_FLOAT64 || is_int_type(t),
           path_ << ": metadata key '" << key << "' is not an array of numbers");
  std::vector<double> out(gguf_get_arr_n(ctx_, id));
  const void* data = gguf_get_arr_data(ctx_, id);
  for (size_t i = 0; i < out.size(); ++i) {
    if (t == GGUF_TYPE_FLOAT32) out[i] = static_cast<const float*>(data)[i];
    else if (t == GGUF_TYPE_FLOAT64) out[i] = static_cast<const double*>(data)[i];
    else out[i] = static_cast<double>(int_at(t, data, i));
  }
  return out;
}

std::vector<std::string> GgufFile::tensor_names() const {
  std::vector<std::string> out;
  for (int64_t i = 0; i < gguf_get_n_tensors(ctx_); ++i) out.emplace_back(gguf_get_tensor_name(ctx_, i));
  return out;
}

bool GgufFile::has_tensor(const std::string& name) const { return gguf_find_tensor(ctx_, name.c_str()) >= 0; }

int64_t GgufFile::tensor_id(const std::string& name) const {
  const int64_t id = gguf_find_tensor(ctx_, name.c_str());
  KV_CHECK(id >= 0, path_ << ": tensor '" << name << "' is missing");
  return id;
}

std::vector<int64_t> GgufFile::shape(const std::string& name) const {
  const int64_t* ne = gguf_get_tensor_ne(ctx_, tensor_id(name));
  int dims = GGML_MAX_DIMS;
  while (dims > 1 && ne[dims - 1] == 1) --dims;
  std::vector<int64_t> s;
  for (int d = dims - 1; d >= 0; --d) s.push_back(ne[d]);  // ggml's ne[0] is the innermost dimension
  return s;
}

int GgufFile::tensor_type(const std::string& name) const { return gguf_get_tensor_type(ctx_, tensor_id(name)); }

const uint8_t* GgufFile::tensor_data(const std::string& name) const {
  return map_ + data_offset_ + gguf_get_tensor_offset(ctx_, tensor_id(name));
}

int64_t GgufFile::tensor_bytes(const std::string& name) const {
  return static_cast<int64_t>(gguf_get_tensor_size(ctx_, tensor_id(name)));
}

QuantizedWeight GgufFile::load_blocks(const std::string& name) const {
  const auto s = shape(name);
  KV_CHECK(s.size() == 2, path_ << ": tensor '" << name << "' has " << s.size() << " dimensions, a linear weight has 2");
  const std::string what = path_ + ": tensor '" + name + "'";
  KV_CHECK(quant_row_bytes(tensor_type(name), s[1], what) * s[0] == tensor_bytes(name),
           what << ": its byte size does not match its shape and type");
  return QuantizedWeight::from_blocks(tensor_type(name), s[0], s[1], tensor_data(name), what);
}

torch::Tensor GgufFile::load_float(const std::string& name) const {
  const auto s = shape(name);
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < s.size(); ++d) rows *= s[d];
  const int64_t K = s.back();
  const std::string what = path_ + ": tensor '" + name + "'";
  const int type = tensor_type(name);
  KV_CHECK(quant_row_bytes(type, K, what) * rows == tensor_bytes(name), what << ": its byte size does not match its shape and type");
  if (type == GGML_TYPE_F32)  // ggml has no to_float for its own float type: the bytes are the values
    return torch::from_blob(const_cast<uint8_t*>(tensor_data(name)), s, torch::kFloat32).clone();
  KV_CHECK(quant_type_served(type), what << ": tensor type " << quant_type_name(type) << " has no CPU kernel in kvserve");
  // Straight from the mapped file: no copy of the blocks first.
  torch::Tensor out = torch::empty(s, torch::kFloat32);
  const auto to_float = ggml_get_type_traits(static_cast<ggml_type>(type))->to_float;
  const int64_t row_bytes = quant_row_bytes(type, K, what);
  const uint8_t* src = tensor_data(name);
  float* dst = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) to_float(src + r * row_bytes, dst + r * K, K);
  return out;
}

// ---------------------------------------------------------------------------------------------
// config.json from GGUF metadata

std::string gguf_hf_config_json(const GgufFile& f) {
  using nlohmann::json;
  const std::string arch = f.architecture();
  auto req_int = [&](const std::string& key) {
    auto v = f.get_int(arch + "." + key);
    KV_CHECK(v.has_value(), f.path() << ": metadata key '" << arch << "." << key << "' is missing");
    return *v;
  };
  auto opt_int = [&](const std::string& key) { return f.get_int(arch + "." + key); };
  auto opt_float = [&](const std::string& key) { return f.get_float(arch + "." + key); };
  json j;
  if (arch == "llama") {
    j["architectures"] = {"LlamaForCausalLM"};
    j["model_type"] = "llama";
  } else if (arch == "qwen2") {
    j["architectures"] = {"Qwen2ForCausalLM"};
    j["model_type"] = "qwen2";
  } else if (arch == "qwen3") {
    j["architectures"] = {"Qwen3ForCausalLM"};
    j["model_type"] = "qwen3";
  } else if (arch == "gemma3") {
    j["architectures"] = {"Gemma3ForCausalLM"};
    j["model_type"] = "gemma3_text";
  } else {
    KV_FAIL(f.path() << ": GGUF architecture '" << arch << "' is not served (llama, qwen2, qwen3, gemma3)");
  }
  const int64_t hidden = req_int("embedding_length"), heads = req_int("attention.head_count");
  // Every block holds tensors: a count past the file's tensors is not a model (and Gemma 3's layer
  // types below would otherwise be built for it, however large).
  const int64_t blocks = req_int("block_count");
  const auto tensors = static_cast<int64_t>(f.tensor_names().size());
  KV_CHECK(blocks <= tensors, f.path() << ": metadata key '" << arch << ".block_count' is " << blocks
                                       << " but the file holds " << tensors << " tensors");
  j["hidden_size"] = hidden;
  j["intermediate_size"] = req_int("feed_forward_length");
  j["num_hidden_layers"] = blocks;
  j["num_attention_heads"] = heads;
  j["num_key_value_heads"] = opt_int("attention.head_count_kv").value_or(heads);
  // A head count below 1 is refused with the config's other checks (parse_model_config); it must not
  // divide here first.
  const int64_t split = heads > 0 ? hidden / heads : 0;
  j["head_dim"] = opt_int("attention.key_length").value_or(opt_int("rope.dimension_count").value_or(split));
  j["max_position_embeddings"] = opt_int("context_length").value_or(2048);
  j["rms_norm_eps"] = opt_float("attention.layer_norm_rms_epsilon").value_or(1e-6);
  j["rope_theta"] = opt_float("rope.freq_base").value_or(10000.0);
  int64_t vocab = opt_int("vocab_size").value_or(0);
  if (vocab == 0) vocab = static_cast<int64_t>(f.get_strings("tokenizer.ggml.tokens").size());
  if (vocab == 0 && f.has_tensor("token_embd.weight")) vocab = f.shape("token_embd.weight").front();
  j["vocab_size"] = vocab;
  j["tie_word_embeddings"] = !f.has_tensor("output.weight");
  const bool qkv_bias = f.has_tensor("blk.0.attn_q.bias");
  if (arch == "llama") {
    j["attention_bias"] = qkv_bias;
    j["mlp_bias"] = f.has_tensor("blk.0.ffn_up.bias");
  }
  if (auto type = f.get_string(arch + ".rope.scaling.type"); type && *type != "none") {
    json rs;
    rs["rope_type"] = *type;
    rs["factor"] = opt_float("rope.scaling.factor").value_or(1.0);
    if (auto orig = opt_int("rope.scaling.original_context_length")) rs["original_max_position_embeddings"] = *orig;
    j["rope_scaling"] = rs;
  }
  if (arch == "gemma3") {
    const int64_t window = opt_int("attention.sliding_window").value_or(0);
    KV_CHECK(window > 0, f.path() << ": metadata key 'gemma3.attention.sliding_window' is missing");
    j["sliding_window"] = window;
    // Gemma 3 interleaves five local layers with one global one (llama.cpp assumes the same).
    json types = json::array();
    for (int64_t i = 0; i < blocks; ++i) types.push_back((i + 1) % 6 == 0 ? "full_attention" : "sliding_attention");
    j["layer_types"] = types;
    j["query_pre_attn_scalar"] = j["head_dim"];
    j["rope_local_base_freq"] = 10000.0;
    j["hidden_activation"] = "gelu_pytorch_tanh";
  }
  if (auto bos = f.get_int("tokenizer.ggml.bos_token_id")) j["bos_token_id"] = *bos;
  if (auto eos = f.get_int("tokenizer.ggml.eos_token_id")) j["eos_token_id"] = *eos;
  j["torch_dtype"] = "float32";
  return j.dump(2);
}

}  // namespace kvserve
