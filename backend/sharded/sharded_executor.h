#pragma once
// ShardedExecutor: one rank's part of a prefill or decode step of a tensor x pipeline parallel job.
// Every rank calls the same method with the same arguments (SPMD); activations travel stage to
// stage, decode batches as micro-batches so that the stages overlap, and logits end on rank 0.
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "cache_manager/kv_memory.h"
#include "parallel/parallel_groups.h"
#include "parallel/shard_layout.h"

namespace kvserve {

class LlamaModel;

class ShardedExecutor {
 public:
  // micro_batches: decode micro-batches in flight (0 = one per pipeline stage).
  ShardedExecutor(std::shared_ptr<LlamaModel> model, KvMemory& kv, parallel::ParallelGroups groups, int64_t micro_batches = 0);

  // fp32 logits: every position's ([T, V]) when all_logits, else the last one's ([1, V]). With
  // to_rank0 they end on global rank 0 (CPU), else they stay on the last stage's ranks (where the
  // samplers are); an undefined tensor on the other ranks.
  torch::Tensor prefill(int64_t seq_id, const std::vector<int64_t>& tokens, const std::string& policy, bool all_logits,
                        bool to_rank0 = true);
  // [B, V], placed as for prefill.
  torch::Tensor decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens, bool to_rank0 = true);

  const ShardLayout& layout() const;

 private:
  int64_t prev_rank() const;  // same TP rank, previous stage (data-group rank)
  int64_t next_rank() const;
  int64_t last_stage_head() const;  // TP rank 0 of the last stage: sends logits to rank 0
  std::shared_ptr<LlamaModel> model_;
  KvMemory& kv_;
  parallel::ParallelGroups g_;
  int64_t micro_batches_;
};

}  // namespace kvserve
