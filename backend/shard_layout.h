#pragma once
// ShardLayout: which layers, heads, MLP columns and vocabulary rows one TP x PP rank holds; the
// split rules are parallel/shard_plan.h's, so `kvserve plan` describes what actually runs.
#include <cstdint>
#include <string>
#include <vector>

#include "backend/model_config.h"

namespace kvserve {

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

// The layout of rank (stage, tp_rank). `stage_layers` (optional) gives the layer count of every
// stage (a custom pipeline split, summing to the model's layers); empty = the even split.
ShardLayout make_shard_layout(const ModelConfig& c, int64_t tp, int64_t tp_rank, int64_t pp, int64_t stage,
                              const std::vector<int64_t>& stage_layers = {});

// Validates a TP x PP split for `c` (heads and KV heads divisibility, stage layers); throws KvError.
void validate_parallel_shape(const ModelConfig& c, int64_t tp, int64_t pp, const std::vector<int64_t>& stage_layers);

}  // namespace kvserve
