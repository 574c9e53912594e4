#pragma once
// The split rules of a tensor-parallel (TP) x pipeline-parallel (PP) job, in one place: which
// layers, heads, MLP columns and vocabulary rows each rank holds. The sharded runtime loads and
// runs exactly these slices, and `kvserve plan` (shard_plan.h) sizes memory from the same layouts.
//
// - PP: contiguous layer ranges; L layers over P stages give every stage L / P layers and the first
//   L % P stages one more (or a custom split listing each stage's layers). Stage 0 holds the token
//   embedding; the last stage holds the final norm and the LM head (both stages hold a copy when
//   the embedding is tied and P > 1).
// - TP: attention heads (q_proj rows, o_proj columns) split evenly; MLP columns (gate/up rows, down
//   columns) in ceil(I / T) slices, the last shorter; the embedding and LM head are vocab-parallel
//   (ceil(vocab / T) rows per rank, the last rank padded); norms are replicated. KV heads split
//   across ranks (KV / T each) when KV >= T; with fewer KV heads than ranks every rank holds one KV
//   head (each replicated T / KV times), so T must divide or be divided by KV.
#include <cstdint>
#include <string>
#include <vector>

namespace kvserve::parallel {

// The model numbers the split needs (filled from backend's ModelConfig by model_shape()).
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
  bool qk_norm = false;  // per-head q/k RMSNorm weights ([head_dim] each, replicated on every rank)
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

// Validates a TP x PP split of `m` (heads and KV heads divisibility, MLP width, stage layers; an
// empty `stage_layers` is the even split); throws KvError naming what does not split.
void validate_parallel_shape(const ModelShape& m, int64_t tp, int64_t pp, const std::vector<int64_t>& stage_layers = {});

// What one rank (stage, tp_rank) holds.
struct ShardLayout {
  int64_t tp_size = 1, tp_rank = 0;
  int64_t pp_size = 1, stage = 0;
  int64_t layer_begin = 0, layer_end = 0;  // global layer indices [begin, end)
  int64_t num_layers_total = 0;
  int64_t q_heads = 0, q_head_begin = 0;      // attention (query) heads held
  int64_t kv_heads = 0, kv_head_begin = 0;    // KV heads held (replicated when KV < tp)
  int64_t kv_replicas = 1;                    // ranks holding each KV head (tp / KV when KV < tp)
  int64_t inter_begin = 0, inter_len = 0;     // MLP intermediate columns
  int64_t vocab_begin = 0, vocab_len = 0;     // real vocabulary rows held
  int64_t vocab_per_rank = 0;                 // ceil(vocab / tp): rows per rank, the last padded

  bool first_stage() const { return stage == 0; }
  bool last_stage() const { return stage == pp_size - 1; }
  int64_t num_layers() const { return layer_end - layer_begin; }
  bool owns_layer(int64_t global) const { return global >= layer_begin && global < layer_end; }
  bool whole() const { return tp_size == 1 && pp_size == 1; }
  // Global rank of (stage, tp_rank): stages are blocks of tp consecutive ranks.
  int64_t global_rank(int64_t stage_, int64_t tp_rank_) const { return stage_ * tp_size + tp_rank_; }
  std::string describe() const;
};

// The layout of rank (stage, tp_rank); `stage_layers` as for validate_parallel_shape.
ShardLayout make_shard_layout(const ModelShape& m, int64_t tp, int64_t tp_rank, int64_t pp, int64_t stage,
                              const std::vector<int64_t>& stage_layers = {});

}  // namespace kvserve::parallel

namespace kvserve {
// The layout is vocabulary the model, the executor and the KV memory share.
using parallel::ShardLayout;
}  // namespace kvserve
