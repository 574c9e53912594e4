#pragma once
// Shard planning: how many sequences each shard's KV cache holds under a policy, for a TP x PP
// split of a model (`kvserve plan`). Pure arithmetic, no devices; the split itself is
// shard_layout.h's, the same layouts the sharded runtime loads.
// - KV bytes: per layer, 2 (K and V) x local KV heads x head_dim x dtype bytes per token; each
//   layer's kept tokens are rounded up to whole paged blocks (block_size tokens) per sequence.
// - Sliding-window (local) layers (Gemma 3) hold a ring of at most ceil(window / block_size) + 1
//   blocks per sequence whatever the context and the policy (their window is their budget): only
//   the global layers' KV grows per token.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "parallel/shard_layout.h"
#include "policies/policy_config.h"

namespace kvserve::parallel {

struct PlanOptions {
  int64_t tp = 1;
  int64_t pp = 1;
  int64_t gpu_memory_bytes = 0;     // per GPU
  double reserve_fraction = 0.1;    // of gpu_memory kept free for activations, workspace, CUDA context
  int64_t context = 0;              // tokens per sequence (prompt) the KV figures are for
  int64_t block_size = 16;          // paged KV block, tokens
  int64_t weight_dtype_bytes = 2;   // bfloat16
  // > 0: the weights are in a quantized block format of this many bits per weight, scales included
  // (ggml's q8_0 = 8.5, q4_0 = 4.5, q4_k = 4.5 ...), instead of weight_dtype_bytes each.
  double weight_bits = 0;
  int64_t kv_dtype_bytes = 2;       // bfloat16
  // A quantized KV cache (int8 = 8 bits + a 2-byte scale per 32 values, int4 = 4 + 2, q4_1 = 4 + 4):
  // bits per value and scale bytes per group of 32 along head_dim; 0 bits = kv_dtype_bytes per value.
  int64_t kv_quant_bits = 0;
  int64_t kv_quant_scale_bytes = 0;
  // Leading tokens of `context` every sequence shares (a document, a system prompt): with prefix
  // caching their whole blocks are held once, in full precision, and uncompressed sequences use
  // them instead of their own (compressing policies keep their own compressed copy).
  int64_t shared_prefix = 0;
  // Per model layer: 0 = global attention, w > 0 = a local layer with window w (ModelConfig::
  // layer_windows). Empty = every layer global.
  std::vector<int64_t> layer_windows;
};

// Bytes of one (token, KV head) row of K or V in the planned KV dtype (quantized or not).
int64_t kv_row_bytes(const PlanOptions& o, int64_t head_dim);
// Sets o's KV dtype fields for a KV cache dtype as cache.kv_cache_dtype names it (bfloat16, float16,
// float32, fp8, int8, int4, q4_1, ...); throws naming it when it is none of them.
void set_kv_dtype(PlanOptions& o, const std::string& kv_dtype);

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
  int64_t kv_bytes_per_token_layer = 0;   // 2 x kv_heads x a row's bytes (head_dim x kv dtype bytes, or quantized)
  int64_t kv_bytes_per_token = 0;         // the above x this stage's global layers (no block rounding)
  int64_t local_layers = 0;               // this stage's sliding-window layers
  int64_t local_blocks_per_seq = 0;       // what they hold at most per sequence once it is past its windows
  int64_t block_bytes = 0;                // one paged block of one layer
  int64_t kv_capacity_bytes = 0;          // gpu_memory x (1 - reserve) - weights (may be negative)
  int64_t prefix_cache_bytes = 0;         // the shared prefix's cached blocks (PlanOptions::shared_prefix)
};

// One policy's KV footprint on every stage at the planned context.
struct PolicyPlan {
  std::string policy;
  std::string kv_dtype;  // the policy's own KV dtype (PolicyConfig::kv_dtype; "" = the cache's)
  std::vector<int64_t> kept_per_layer;  // steady state after prefill (DynamicKV: the mean budget; local layers: their window)
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

// The plan for `policies` (typically full and one compressing policy); a policy with its own
// kv_dtype holds its KV in that dtype, out of the same capacity. Throws KvError on a shape
// that cannot split (heads % tp, KV heads vs tp, pp > layers, non-positive sizes).
ShardPlan make_shard_plan(const ModelShape& model, const PlanOptions& options, const std::vector<PolicyConfig>& policies);

nlohmann::json to_json(const ShardPlan& plan);

}  // namespace kvserve::parallel
