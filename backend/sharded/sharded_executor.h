#pragma once
// ShardedExecutor: one rank's part of a prefill or decode step of a tensor x pipeline parallel job.
// Every rank calls the same method with the same arguments (SPMD); activations travel stage to
// stage, decode batches as micro-batches so that the stages overlap, and logits end on rank 0.
#include <torch/torch.h>

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cache_manager/kv_memory.h"
#include "parallel/parallel_groups.h"
#include "parallel/shard_layout.h"

namespace kvserve {

class DecoderModel;

class ShardedExecutor {
 public:
  // micro_batches: decode micro-batches in flight (0 = one per pipeline stage).
  ShardedExecutor(std::shared_ptr<DecoderModel> model, KvMemory& kv, parallel::ParallelGroups groups, int64_t micro_batches = 0);

  // fp32 logits: every position's ([T, V]) when all_logits, else the last one's ([1, V]). With
  // to_rank0 they end on global rank 0 (CPU), else they stay on the last stage's ranks (where the
  // samplers are); an undefined tensor on the other ranks.
  torch::Tensor prefill(int64_t seq_id, const std::vector<int64_t>& tokens, const std::string& policy, bool all_logits,
                        bool to_rank0 = true);
  // The same in two halves, so that a step can start all its prompts before any of them allocates
  // (an allocation may reclaim cached blocks another prompt of the step found). begin_prefill
  // starts a prompt on this shard and takes exactly `hit` leading positions from its prefix cache,
  // the count every shard agreed on (KvMemory::kNoLookup: no lookup); run_prefill then computes
  // positions [start, prompt.size()) through every stage and ends the prompt.
  // `resume`: the prompt continues a parked sequence's KV instead (prefix_reuse: compressed).
  void begin_prefill(int64_t seq_id, std::span<const int64_t> prompt, const std::string& policy, int64_t hit,
                     bool keep_copy, ResumeFrom resume = {});
  torch::Tensor run_prefill(int64_t seq_id, std::span<const int64_t> prompt, int64_t start, bool all_logits,
                            bool to_rank0 = true);
  // A prompt whose first context_len tokens are compressed alone (PrefillWork::context_len), in the
  // same two halves. begin_context starts the context on this shard and, when `cached` (what every
  // shard agreed on), takes its compressed KV from the memory's cache; otherwise the context is
  // prefilled as a prompt of its own by run_context (its stages, reconstruction passes and
  // selection), after which the rest of the prompt runs as run_prefill from context_len.
  void begin_context(int64_t seq_id, std::span<const int64_t> prompt, int64_t context_len, const std::string& policy,
                     bool cached, bool keep_copy);
  torch::Tensor run_context(int64_t seq_id, std::span<const int64_t> prompt, int64_t context_len, bool cached,
                            bool to_rank0 = true);
  // [B, V], placed as for prefill. with_draft: the draft model's shard runs the step (a draft step
  // of speculative_config method "draft_model"; set_draft_model).
  torch::Tensor decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens, bool to_rank0 = true,
                       bool with_draft = false);
  // This rank's shard of the draft model (the same layers and KV heads as the served model's).
  void set_draft_model(std::shared_ptr<DecoderModel> draft) { draft_ = std::move(draft); }
  bool has_draft_model() const { return draft_ != nullptr; }

  const ShardLayout& layout() const;

 private:
  int64_t prev_rank() const;  // same TP rank, previous stage (data-group rank)
  int64_t next_rank() const;
  int64_t last_stage_head() const;  // TP rank 0 of the last stage: sends logits to rank 0
  std::shared_ptr<DecoderModel> model_;
  std::shared_ptr<DecoderModel> draft_;  // null: no draft model
  KvMemory& kv_;
  parallel::ParallelGroups g_;
  int64_t micro_batches_;
};

}  // namespace kvserve
