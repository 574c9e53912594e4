#include "backend/model/weight_source.h"

#include <mutex>
#include <regex>
#include <set>

#include "backend/quantization/gguf_cuda_forms.h"
#include "backend/quantization/gguf_file.h"
#include "backend/quantization/int4_weight.h"
#include "ggml.h"
#include "common/check.h"
#include "common/log.h"
#include "common/model_path.h"

namespace kvserve {
namespace {

torch::Tensor take_slice(const torch::Tensor& t, const std::optional<TensorSlice>& slice) {
  return slice ? t.narrow(slice->dim, slice->start, slice->length).contiguous() : t;
}

// A Hugging Face model directory: what Checkpoint reads.
class SafetensorsSource final : public WeightSource {
 public:
  explicit SafetensorsSource(const std::string& dir) : ckpt_(dir) {}
  bool contains(const std::string& name) const override { return ckpt_.contains(name); }
  torch::Tensor load(const std::string& name, const std::vector<int64_t>& shape, torch::Dtype dtype,
                     const torch::Device& device, std::optional<TensorSlice> slice) const override {
    return ckpt_.load(name, shape, dtype, device, slice);
  }
  LinearWeight load_linear(const std::string& name, const std::vector<int64_t>& shape, torch::Dtype dtype,
                           const torch::Device& device, std::optional<TensorSlice> slice) const override {
    return LinearWeight(ckpt_.load(name, shape, dtype, device, slice));
  }
  size_t num_tensors() const override { return ckpt_.num_tensors(); }
  std::string format() const override { return "safetensors"; }

 private:
  Checkpoint ckpt_;
};

// A GGUF file, read through Hugging Face names. llama.cpp's converter renames every tensor, stores
// Llama's q/k projections with each head's rotary halves interleaved (its RoPE pairs neighbours;
// transformers' pairs the halves) and Gemma's norm weights as 1 + w; both are undone here, so the
// weights are the Hugging Face model's (what transformers' own GGUF loader gives).
class GgufSource final : public WeightSource {
 public:
  GgufSource(const std::string& path, const ModelConfig& c) : f_(path), c_(c), arch_(f_.architecture()) {}

  bool contains(const std::string& name) const override {
    const auto g = gguf_name(name);
    return g && f_.has_tensor(*g);
  }

  torch::Tensor load(const std::string& name, const std::vector<int64_t>& shape, torch::Dtype dtype,
                     const torch::Device& device, std::optional<TensorSlice> slice) const override {
    const std::string g = checked(name, shape);
    torch::Tensor t = f_.load_float(g);
    const auto order = row_order(name);
    if (!order.empty()) t = t.index_select(0, torch::tensor(order, torch::kInt64));
    if (arch_ == "gemma3" && ends_with(name, "norm.weight")) t = t - 1.0f;
    return take_slice(t, slice).to(device, dtype);
  }

  LinearWeight load_linear(const std::string& name, const std::vector<int64_t>& shape, torch::Dtype dtype,
                           const torch::Device& device, std::optional<TensorSlice> slice) const override {
    const std::string g = checked(name, shape);
    const int type = f_.tensor_type(g);
    // On CUDA the types with a CUDA form keep their integers (gguf_cuda_forms.h: Q4_0, Q4_1 and Q4_K
    // as int4 where tinygemm runs, the other legacy and K-quant types as int8); the i-quants are
    // dequantized there.
    // An embedding is read a few rows at a time, which tinygemm's tiles of 8 rows cannot do: in a
    // 4-bit type it is dequantized (the int8 forms read their rows' codes).
    const GgufCudaForm form = gguf_cuda_form(type);
    const bool embedding = name == "model.embed_tokens.weight";
    const bool cuda_form = device.is_cuda() && form != GgufCudaForm::kNone &&
                           (form != GgufCudaForm::kInt4 || (!embedding && int4_runs(device)));
    if ((!device.is_cpu() && !cuda_form) || type == 0 /* F32 */) {
      if (type != GGML_TYPE_F32 && type != GGML_TYPE_F16 && type != GGML_TYPE_BF16) note_dequantized(type);
      return LinearWeight(load(name, shape, dtype, device, slice));
    }
    QuantizedWeight q = f_.load_blocks(g);
    const auto order = row_order(name);
    if (!order.empty()) q = q.permute_rows(order);
    if (slice) {
      q = slice->dim == 0 ? q.slice_rows(slice->start, slice->length)
                          : q.slice_cols(slice->start, slice->length, f_.path() + ": tensor '" + g + "'");
    }
    if (cuda_form) {
      if (auto w = gguf_cuda_weight(q, device, f_.path() + ": tensor '" + g + "'")) return std::move(*w);
      note_dequantized(type, " (some shapes)");
      return LinearWeight(q.dequantize().to(device, dtype));
    }
    return LinearWeight(std::move(q));
  }

  size_t num_tensors() const override { return f_.tensor_names().size(); }
  std::string format() const override { return "gguf"; }
  std::string dequantized_types() const override {
    std::lock_guard<std::mutex> lk(mu_);
    std::string out;
    for (const auto& t : dequantized_) out += (out.empty() ? "" : ", ") + t;
    return out;
  }

 private:
  static bool ends_with(const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
  }

  // The GGUF tensor a Hugging Face name stands for (llama.cpp's tensor names), or nullopt.
  std::optional<std::string> gguf_name(const std::string& hf) const {
    if (hf == "model.embed_tokens.weight") return "token_embd.weight";
    if (hf == "lm_head.weight") return "output.weight";
    if (hf == "model.norm.weight") return "output_norm.weight";
    static const std::regex layer(R"(model\.layers\.(\d+)\.(.+)\.(weight|bias))");
    std::smatch m;
    if (!std::regex_match(hf, m, layer)) return std::nullopt;
    const std::string i = m[1], part = m[2], kind = m[3];
    const bool sandwich = arch_ == "gemma3";
    static const std::map<std::string, std::string> names = {
        {"input_layernorm", "attn_norm"},        {"self_attn.q_proj", "attn_q"},   {"self_attn.k_proj", "attn_k"},
        {"self_attn.v_proj", "attn_v"},          {"self_attn.o_proj", "attn_output"}, {"self_attn.q_norm", "attn_q_norm"},
        {"self_attn.k_norm", "attn_k_norm"},     {"mlp.gate_proj", "ffn_gate"},    {"mlp.up_proj", "ffn_up"},
        {"mlp.down_proj", "ffn_down"},           {"pre_feedforward_layernorm", "ffn_norm"},
        {"post_feedforward_layernorm", "post_ffw_norm"}};
    std::string g;
    if (part == "post_attention_layernorm") {
      // Llama-style blocks norm the MLP's input with it; Gemma's sandwich norms the attention output.
      g = sandwich ? "post_attention_norm" : "ffn_norm";
    } else {
      auto it = names.find(part);
      if (it == names.end()) return std::nullopt;
      g = it->second;
    }
    return "blk." + i + "." + g + "." + kind;
  }

  // Checks the GGUF tensor behind `hf` exists and has `shape`; returns its name.
  std::string checked(const std::string& hf, const std::vector<int64_t>& shape) const {
    const auto g = gguf_name(hf);
    KV_CHECK(g && f_.has_tensor(*g), f_.path() << ": tensor '" << (g ? *g : hf) << "' (" << hf << ") is missing");
    const auto s = f_.shape(*g);
    KV_CHECK(s == shape, f_.path() << ": tensor '" << *g << "' (" << hf << ") has shape " << c10::IntArrayRef(s)
                                   << ", expected " << c10::IntArrayRef(shape));
    return *g;
  }

  // Llama's q/k rows in Hugging Face order: GGUF row h*D + 2i + j holds HF row h*D + j*D/2 + i.
  // Empty when the rows stay as stored.
  std::vector<int64_t> row_order(const std::string& hf) const {
    if (arch_ != "llama") return {};
    const bool q = hf.find("self_attn.q_proj.") != std::string::npos, k = hf.find("self_attn.k_proj.") != std::string::npos;
    if (!q && !k) return {};
    const int64_t heads = q ? c_.num_attention_heads : c_.num_key_value_heads, D = c_.head_dim, half = D / 2;
    std::vector<int64_t> order(static_cast<size_t>(heads * D));
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < 2; ++j)
        for (int64_t i = 0; i < half; ++i) order[static_cast<size_t>(h * D + j * half + i)] = h * D + 2 * i + j;
    return order;
  }

  void note_dequantized(int type, const std::string& why = "") const {
    std::lock_guard<std::mutex> lk(mu_);
    dequantized_.insert(ggml_type_name(static_cast<ggml_type>(type)) + why);
  }

  // Whether tinygemm runs on `device` (Int4Weight::check_device, once); where it does not, the
  // 4-bit types are dequantized and the log says why.
  bool int4_runs(const torch::Device& device) const {
    std::lock_guard<std::mutex> lk(mu_);
    if (!int4_checked_) {
      int4_checked_ = true;
      try {
        Int4Weight::check_device(device);
        int4_ok_ = true;
      } catch (const std::exception& e) {
        KV_LOG(f_.path() << ": its 4-bit tensors are dequantized on " << device << ": " << e.what());
      }
    }
    return int4_ok_;
  }

  GgufFile f_;
  ModelConfig c_;
  std::string arch_;
  mutable std::mutex mu_;  // load_linear is const and may be called from several threads
  mutable std::set<std::string> dequantized_;
  mutable bool int4_checked_ = false, int4_ok_ = false;
};

}  // namespace

ModelConfig read_model_config(const std::string& path) {
  if (is_gguf_file_path(path)) return parse_model_config(gguf_hf_config_json(GgufFile(path)), path + " (GGUF metadata)");
  return load_model_config(path);
}

std::unique_ptr<WeightSource> WeightSource::open(const std::string& path, const ModelConfig& config) {
  if (is_gguf_file_path(path)) return std::make_unique<GgufSource>(path, config);
  return std::make_unique<SafetensorsSource>(path);
}

}  // namespace kvserve
