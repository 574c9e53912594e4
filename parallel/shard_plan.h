#pragma once
// Shard planning: how a model splits over tensor-parallel (TP) x pipeline-parallel (PP) GPUs, and
// how many sequences each shard's KV cache holds under a policy. Pure arithmetic, no devices.
//
// Split rules (the pipeline/tensor code must use the same ones):
// - PP: contiguous layer ranges; L layers over P stages give every stage L / P layers and the first
//   L % P stages one more (pipeline_layer_ranges). Stage 0 holds the token embedding; the last
//   stage holds the final norm and the LM head (both stages hold a copy when the embedding is tied
//   and P > 1).
// - TP: attention heads (q_proj rows, o_proj columns) and MLP columns (gate/up rows, down columns)
//   split evenly; the embedding and LM head are vocab-parallel (ceil(vocab / T) rows per rank, the
//   last rank padded); norms are replicated. KV heads split across ranks (KV / T each) when
//   KV >= T; with fewer KV heads than ranks every rank holds one KV head (each replicated T / KV
//   times), so T must divide or be divided by KV.
// - KV bytes: per layer, 2 (K and V) x local KV heads x head_dim x dtype bytes per token; each
//   layer's kept tokens are rounded up to whole paged blocks (block_size tokens) per sequence.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "policies/policy_config.h"

namespace kvserve::parallel {

// The model numbers planning needs (filled from backend's ModelConfig by the CLI).
struct ModelShape {
  int64_t num_layers = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t vocab_size = 0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v biases
  bool o_proj_bias = false;
  bool mlp_bias = false;
};

struct PlanOptions {
  int64_t tp = 1;
  int64_t pp = 1;
  int64_t gpu_memory_bytes = 0;     // per GPU
  double reserve_fraction = 0.1;    // of gpu_memory kept free for activations, workspace, CUDA context
  int64_t context = 0;              // tokens per sequence (prompt) the KV figures are for
  int64_t block_size = 16;          // paged KV block, tokens
  int64_t weight_dtype_bytes = 2;   // bfloat16
  int64_t kv_dtype_bytes = 2;       // bfloat16
};

// [begin, end) of global layer indices.
struct LayerRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};

// Contiguous layer ranges of `pp` stages; the first num_layers % pp stages take one extra layer.
std::vector<LayerRange> pipeline_layer_ranges(int64_t num_layers, int64_t pp);

// KV heads each TP rank holds: num_kv_heads / tp, or 1 (replicated) when num_kv_heads < tp.
// Throws KvError when neither divides the other.
int64_t kv_heads_per_rank(int64_t num_kv_heads, int64_t tp);

// Parameters one TP rank of a stage holds (the largest rank where a split is uneven).
int64_t stage_weight_params(const ModelShape& m, int64_t tp, const LayerRange& layers, bool first_stage, bool last_stage);

// One pipeline stage (every TP rank in it holds the same amounts).
struct StagePlan {
  int64_t stage = 0;
  LayerRange layers;
  bool has_embedding = false;
  bool has_lm_head = false;  // and the final norm
  int64_t weight_params = 0;
  int64_t weight_bytes = 0;
  int64_t kv_heads = 0;                   // per rank
  int64_t kv_bytes_per_token_layer = 0;   // 2 x kv_heads x head_dim x kv dtype bytes
  int64_t kv_bytes_per_token = 0;         // the above x this stage's layers (no block rounding)
  int64_t block_bytes = 0;                // one paged block of one layer
  int64_t kv_capacity_bytes = 0;          // gpu_memory x (1 - reserve) - weights (may be negative)
};

// One policy's KV footprint on every stage at the planned context.
struct PolicyPlan {
  std::string policy;
  std::vector<int64_t> kept_per_layer;  // steady state after prefill (DynamicKV: the mean budget)
  std::vector<int64_t> peak_per_layer;  // what admission reserves (DynamicKV: its candidate sets)
  std::vector<int64_t> kv_bytes_per_seq;       // per stage, steady, block-rounded
  std::vector<int64_t> kv_bytes_per_seq_peak;  // per stage, peak, block-rounded
  std::vector<int64_t> max_seqs_per_stage;     // floor(capacity / steady bytes)
  int64_t max_seqs = 0;       // min over stages (the tightest shard), steady
  int64_t max_seqs_peak = 0;  // min over stages if every sequence held its peak
  int64_t tightest_stage = 0;
};

struct ShardPlan {
  ModelShape model;
  PlanOptions options;
  int64_t gpus = 0;
  int64_t usable_bytes = 0;  // per GPU: gpu_memory x (1 - reserve)
  std::vector<StagePlan> stages;
  std::vector<PolicyPlan> policies;
  bool weights_fit = true;  // every stage's weights fit in usable_bytes
};

// Kept tokens per layer at `context` under `cfg`: (steady, peak). Full layers keep the context.
// Static policies: both are PrefillSelector::budgets(). DynamicKV: peak = its candidate sets,
// steady = min(peak, the mean budget) per compressed layer (the final per-layer split depends on
// scores; the total is the same).
std::pair<std::vector<int64_t>, std::vector<int64_t>> policy_kept_tokens(const PolicyConfig& cfg, int64_t context,
                                                                         int64_t num_layers, int64_t num_kv_heads);

// The plan for `policies` (typically full and one compressing policy). Throws KvError on a shape
// that cannot split (heads % tp, KV heads vs tp, pp > layers, non-positive sizes).
ShardPlan make_shard_plan(const ModelShape& model, const PlanOptions& options, const std::vector<PolicyConfig>& policies);

nlohmann::json to_json(const ShardPlan& plan);

}  // namespace kvserve::parallel
