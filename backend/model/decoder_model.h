#pragma once
// DecoderModel: the decoder skeleton every family runs (fused QKV, RoPE, paged KV, TP/PP, prefill and
// batched decode) in libtorch; a family's differences come from its ModelConfig (BlockSpec, biases,
// RoPE, layer windows), set by its file in backend/model/families/.
#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/kernels/dense.h"
#include "backend/scoring/kvzap_predictor.h"
#include "backend/model/model_config.h"
#include "backend/quantization/linear_weight.h"
#include "backend/model/rope.h"
#include "backend/engine/step_profile.h"
#include "parallel/shard_layout.h"
#include "cache_manager/kv_memory.h"
#include "cache_manager/kv_memory_factory.h"

namespace kvserve::parallel {
class ProcessGroup;
}

namespace kvserve {

// One prompt of a batched prefill, or one chunk of a prompt prefilled over several steps (the
// prompt's positions [start, start + tokens.size()) of prompt_len); `tokens` must outlive the call.
struct PrefillInput {
  int64_t seq_id = 0;
  std::span<const int64_t> tokens;
  std::string policy;      // "" = the KV memory's default
  int64_t start = 0;       // > 0: earlier chunks' K/V are in the KV memory
  int64_t prompt_len = 0;  // the whole prompt; 0 = tokens.size() (not chunked)
  // Prefix caching (KvMemory::prefill_tokens): a first chunk may start after the blocks the memory
  // holds from its cache; a compressing policy may copy its full prompt blocks into the cache.
  bool reuse_prefix = true;
  bool keep_copy = true;
  // prefix_reuse: compressed: the parked sequence whose KV the prompt continues.
  ResumeFrom resume{};
  // Compressed contexts (KvMemory::begin_context): > 0 for a whole prompt whose policy compresses
  // its first context_len tokens alone; the rest follows them uncompressed.
  int64_t context_len = 0;

  int64_t total() const { return prompt_len > 0 ? prompt_len : static_cast<int64_t>(tokens.size()); }
  bool last_chunk() const { return start + static_cast<int64_t>(tokens.size()) == total(); }
};

// Thrown between layers of a prefill whose sequence was cancelled (DecoderModel::set_cancel_check):
// the prefill's usual failure path frees its KV, and the engine finishes the request as aborted.
struct PrefillCancelled : std::runtime_error {
  explicit PrefillCancelled(int64_t seq_id)
      : std::runtime_error("the prefill of sequence " + std::to_string(seq_id) + " was cancelled") {}
};

// How to load a checkpoint: device, compute dtype (default fp32 on CPU, bf16 on CUDA), progress output.
struct LoadOptions {
  LoadOptions(std::string device_ = "cpu", std::string dtype_ = "", bool progress_ = true)
      : device(std::move(device_)), dtype(std::move(dtype_)), progress(progress_) {}
  std::string device;
  std::string dtype;  // empty = device default
  bool progress;
  CpuGemm cpu_gemm = CpuGemm::kMkl;  // prefill-sized fp32 CPU products
  // Storage dtype of the KV cache built from kv_layout(): "" or "auto" = the compute dtype (float16 for
  // a GGUF file under fp32 compute on the CPU, as llama.cpp); on CPU
  // float16 / bfloat16 under fp32 compute halve the cache (CUDA takes only the compute dtype).
  std::string kv_cache_dtype;
  // Weight quantization at load (vLLM's --quantization): "" / "none" keeps the checkpoint's weights
  // (a GGUF file's blocks as they are); int8 / int4 quantize a float checkpoint's linear layers to
  // ggml's Q8_0 / Q4_0 on the CPU (backend/quantization/weight_quantization.h).
  std::string quantization;
  // Tensor/pipeline parallel shard to load (default: the whole model) and, when tp_size > 1, the
  // tensor-parallel group whose members hold the other slices.
  ShardLayout layout;
  std::shared_ptr<parallel::ProcessGroup> tp_group;
};

class DecoderModel {
 public:
  // Loads config.json + safetensors weights from `model_dir`; errors name the file and tensor.
  static std::shared_ptr<DecoderModel> load(const std::string& model_dir, const LoadOptions& options);

  const ModelConfig& config() const { return config_; }
  const std::string& model_dir() const { return model_dir_; }
  torch::Device device() const { return device_; }
  torch::Dtype dtype() const { return dtype_; }
  torch::Dtype kv_dtype() const { return kv_dtype_; }  // the KV cache's storage dtype (decoded, if quantized)
  KvQuant kv_quant() const { return kv_quant_; }        // the KV cache's quantized row format, or none
  int64_t kv_bytes_per_token() const;  // all layers, K and V, in kv_dtype()
  // The weights' storage: "float32", or the ggml block types of quantized layers ("Q4_1+Q8_0"),
  // and the bytes this shard holds.
  const std::string& weight_format() const { return weight_format_; }
  int64_t weight_bytes() const;

  const ShardLayout& layout() const { return layout_; }
  // This shard's KV shape, for make_kv_memory.
  KvMemoryLayout kv_layout() const;
  // The same in another KV cache dtype (a policy's kv_dtype: "float16", "int8", "int4", "fp8", ...;
  // "" = kv_layout()); throws naming the dtype where this model or device cannot store it.
  KvMemoryLayout kv_layout(const std::string& kv_cache_dtype) const;
  // kv_layout() and one layout per other kv_dtype the policies name, for make_mixed_kv_memory.
  KvFormats kv_formats(const std::map<std::string, PolicyConfig>& policies) const;

  // Runs the whole prompt through every layer, handing each layer's K/V to `kv`. Returns fp32
  // logits for every position ([T, V]) when all_logits, else for the last position ([1, V]).
  // Needs the first and last stage (a whole model, or tensor-parallel only).
  // A failed prefill leaves no KV state behind (as prefill_batch).
  torch::Tensor prefill(int64_t seq_id, const std::vector<int64_t>& tokens, KvMemory& kv, bool all_logits = false,
                        const std::string& policy = "");
  // Several prompts in one forward: their token rows run concatenated through every matmul, RoPE
  // positions restart at 0 per prompt and attention stays within each prompt, so each sequence gets
  // the K/V (and the policy selections) that prefill() would give it. Returns fp32 logits of each
  // prompt's last position ([n, V], in input order), or of every position ([sum T, V], prompts
  // concatenated) when all_logits. On an exception the KV state of every listed sequence this call
  // began is released, so the caller can retry them one by one; a chunk that continues a prompt
  // (start > 0) loses its earlier chunks' KV too (its request fails, it cannot be retried).
  // Chunks: a chunk's queries attend to the earlier chunks' K/V (read back from `kv`) and causally
  // to its own; RoPE positions are the prompt's; begin_prefill runs at the first chunk, end_prefill
  // after the last.
  torch::Tensor prefill_batch(const std::vector<PrefillInput>& seqs, KvMemory& kv, bool all_logits = false);
  // A prompt's compressed context (PrefillInput::context_len): from the memory's cache or prefilled
  // and compressed on its own. Returns the positions the sequence now covers (the context's).
  int64_t compress_context(const PrefillInput& s, KvMemory& kv);
  // One new token per sequence at batch.positions; returns fp32 logits [B, V]. padded_rows > B runs
  // the step padded to that many rows, as a CUDA graph of that batch bucket does (plan_decode); the
  // padding's logits are dropped.
  torch::Tensor decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens, KvMemory& kv,
                       int64_t padded_rows = 0);

  // decode() in its two halves, so that the second can be captured in a CUDA graph
  // (backend/engine/decode_graphs.h). Whole model only (no pipeline stages).
  // The step's host work: checks the token ids, has `kv` plan the step (evictions, blocks, its
  // device tables; padded to padded_rows entries when that is larger than the batch) and grows the
  // RoPE tables to the step's positions.
  void plan_decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens, KvMemory& kv, int64_t padded_rows = 0);
  // Runs the planned step on the device alone: ids and positions are int64 [P] on the model's
  // device (P = the planned entries; padding: id 0, position 0). Returns fp32 logits [P, V]. Builds
  // nothing on the host and never syncs (CUDA, device kernels), so a CUDA graph can capture it.
  torch::Tensor decode_planned(const DecodeBatch& batch, const torch::Tensor& ids, const torch::Tensor& positions,
                               KvMemory& kv);
  // Rows of the RoPE tables: a captured step reads them in place, so a growth means a recapture.
  int64_t rope_capacity() const { return rope_->capacity(); }
  bool tensor_parallel() const { return tp_ != nullptr; }

  // The pieces a pipeline stage runs (every tensor-parallel shard of the stage calls them together).
  // Hidden states [T, hidden] of the token ids (first stage).
  torch::Tensor embed(const std::vector<int64_t>& tokens) const;
  // This shard's layers over a prompt's hidden states [T, hidden] at positions start..start+T-1 of a
  // prompt of prompt_len (0 = start + T); start > 0: the earlier positions' K/V are in `kv`.
  torch::Tensor prefill_layers(int64_t seq_id, torch::Tensor x, KvMemory& kv, int64_t start = 0, int64_t prompt_len = 0);
  // A detached pass (kvzip's reconstruction, backend/scoring/kvzip_scorer.h): hidden states x [n, hidden] of
  // token ids at positions start..start+n-1 through this shard's layers, attending to
  // context(layer)'s K/V ([KV, P, D] of this shard's heads after RoPE at positions start-P..start-1,
  // every one visible; a sliding-window layer sees only its window of them) and causally to
  // themselves, writing nothing to any KV memory. hook(layer, q [H, n, D], k [KV, n, D]) sees each layer's post-RoPE
  // queries and keys. Returns the hidden states for the next stage; after the model's last layer's
  // hook nothing more is computed (the result is then undefined). Every TP shard of a stage calls it
  // together.
  using ContextKv = std::function<std::pair<torch::Tensor, torch::Tensor>(int64_t layer)>;
  using LayerQkHook = std::function<void(int64_t layer, const torch::Tensor& q, const torch::Tensor& k)>;
  torch::Tensor detached_layers(torch::Tensor x, int64_t start, const ContextKv& context, const LayerQkHook& hook);
  // This shard's layers over one new token per sequence, x [B, hidden].
  torch::Tensor decode_layers(const DecodeBatch& batch, torch::Tensor x, KvMemory& kv);
  // kvzap: the predictor of a policy (loaded at its first use, then kept per directory;
  // throws naming the directory when it is missing or does not fit the model).
  const KvzapPredictor& kvzap_predictor(const PolicyConfig& cfg);
  // fp32 logits [rows, V] of hidden states (last stage).
  torch::Tensor logits(const torch::Tensor& x) const;

  // Decode steps add their stages' wall time to `profile` (null: off). CPU only: on CUDA the
  // stages would time kernel launches, not kernels.
  void set_profile(StepProfile* profile) { profile_ = profile; }
  // Asked before every layer of a prefill (and of kvzip's passes over it) with the sequences the
  // prefill runs: when it answers true the prefill stops there with PrefillCancelled, so that a
  // client that left mid-prompt does not hold the engine for the rest of a long forward. A whole
  // model only: tensor-parallel shards run their layers together and must not stop alone.
  using CancelCheck = std::function<bool(std::span<const int64_t> seq_ids)>;
  void set_cancel_check(CancelCheck check) { cancel_check_ = std::move(check); }

 private:
  KvMemoryLayout layout_in(torch::Dtype kv, KvQuant quant) const;  // kv_layout() in a KV dtype and row format
  struct Layer {
    torch::Tensor input_norm, post_norm;  // before attention, before the MLP
    torch::Tensor attn_out_norm, mlp_out_norm;  // BlockSpec::sandwich_norms: after attention, after the MLP (else undefined)
    LinearWeight wqkv;  // fused q,k,v projection
    torch::Tensor bqkv;  // its bias where ModelConfig::attention_bias
    torch::Tensor q_norm, k_norm;  // BlockSpec::qk_norm: [head_dim] RMSNorm weights of every q / k head (else undefined)
    LinearWeight wo;
    torch::Tensor bo;
    LinearWeight wgate_up;  // fused gate and up projections
    torch::Tensor bgate_up;
    LinearWeight wdown;
    torch::Tensor bdown;
  };
  DecoderModel() = default;
  torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w) const;
  torch::Tensor mlp(const Layer& l, const torch::Tensor& x) const;
  // Sandwich norms of the attention and MLP outputs before their residual adds (w undefined: t as is).
  torch::Tensor out_norm(const torch::Tensor& t, const torch::Tensor& w) const;
  // Throws unless `kv` applies this shard's sliding windows (ModelConfig::layer_windows) in decode.
  void check_windows(const KvMemory& kv) const;
  // The rotated q [rows, H, D] and k [rows, KV, D] of a fused q,k,v projection, with v [rows, KV, D]
  // beside them. Where the layer has per-head norms they apply first, and q carries the
  // query_pre_attn_scalar factor (block_ops::query_factor); v is then a view of the projection.
  // Without either, one pass (one kernel on CUDA, fused::rope_qkv) makes all three contiguous.
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rotated_qkv(const Layer& l, const torch::Tensor& qkv,
                                                                      const RopeAngles& angles) const;
  // The residual stream's next norm, with the add that precedes it deferred into it: x += pending
  // (when defined; pending is then cleared) and returns rms_norm(x, w), one fused kernel on CUDA
  // (fused::add_rms_norm) for Llama's norm. Deferring the add saves a pass over the rows per norm.
  torch::Tensor add_norm(torch::Tensor& x, torch::Tensor& pending, const torch::Tensor& w) const;
  // The RoPE angles of layer `li`: the local layers' table for a sliding-window layer.
  const RopeAngles& layer_angles(int64_t li, const RopeAngles& global, const RopeAngles& local) const {
    return local_rope_ && config_.layer_window(li) > 0 ? local : global;
  }
  // Sums a row-parallel layer's partial outputs over the TP group, then adds the bias once.
  torch::Tensor row_parallel(const torch::Tensor& x, const LinearWeight& w, const torch::Tensor& b) const;
  // A row-parallel layer's partial output: summed over the TP group, then the bias added once.
  torch::Tensor reduce_partial(torch::Tensor partial, const torch::Tensor& b) const;
  const Layer& layer(int64_t global) const;
  // kvzap: records layer li's predicted scores of the prompts in a prefill batch whose policy
  // predicts them (`whole[i]`: sequence i runs its whole prompt here), h [sum lens, hidden] the
  // layer's normed input.
  void record_predicted_scores(int64_t li, const torch::Tensor& h, const std::vector<const PolicyConfig*>& predicted,
                               const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& offsets,
                               const std::vector<int64_t>& lens, KvMemory& kv);
  // Hidden states of token ids already on the model's device (int64 [N], in range).
  torch::Tensor embed_ids(const torch::Tensor& ids) const;
  // The vocab-parallel lookup: each TP rank's rows, summed over the group.
  torch::Tensor embed_ids_parallel(const torch::Tensor& ids) const;
  // This shard's layers over a planned decode step: x [P, hidden], the rows' RoPE angles.
  // local_angles: the sliding-window layers' (unused without them).
  torch::Tensor run_decode_layers(const DecodeBatch& batch, torch::Tensor x, const RopeAngles& angles,
                                  const RopeAngles& local_angles, KvMemory& kv);
  // This shard's layers over several prompts' concatenated hidden states x [sum lens, hidden].
  // starts: each prompt's first position (a chunk of a longer prompt when > 0 or short of its
  // prompt_lens entry); empty = whole prompts.
  torch::Tensor prefill_layers_batch(const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& lens, torch::Tensor x,
                                     KvMemory& kv, const std::vector<int64_t>& starts = {},
                                     const std::vector<int64_t>& prompt_lens = {});

  ModelConfig config_;
  std::string model_dir_;
  torch::Device device_{torch::kCPU};
  torch::Dtype dtype_ = torch::kFloat32;
  CpuGemm gemm_ = CpuGemm::kMkl;
  torch::Dtype kv_dtype_ = torch::kFloat32;
  KvQuant kv_quant_ = KvQuant::none;
  LinearWeight embed_, lm_head_;
  torch::Tensor final_norm_;
  std::string weight_format_;  // "float32", "Q4_1", "Q4_1+Q8_0" ...: what the linear layers hold
  std::vector<Layer> layers_;
  std::unique_ptr<Rope> rope_;
  std::unique_ptr<Rope> local_rope_;  // the sliding-window layers' (another base); null without them
  double q_factor_ = 1.0;             // block_ops::query_factor
  ShardLayout layout_;
  std::shared_ptr<parallel::ProcessGroup> tp_;
  StepProfile* profile_ = nullptr;
  CancelCheck cancel_check_;
  std::vector<int64_t> prefilling_;  // the sequences of the running prefill_batch, for cancel_check_
  // Throws PrefillCancelled when cancel_check_ says one of prefilling_ was cancelled.
  void check_cancelled() const;
  std::map<std::string, std::unique_ptr<KvzapPredictor>> kvzap_predictors_;
};

}  // namespace kvserve
