#pragma once
// ShardedRunner: the engine's ModelRunner on rank 0 of a TP x PP job. Each StepPlan is broadcast to
// every rank as one command; all ranks run the same ShardedExecutor step on their shard, and one
// all-reduce brings every shard's pool occupancy back to rank 0's scheduler. Samplers live on the
// last stage (TP rank 0), which sends rank 0 only the sampled tokens and requested logprobs.
// run_shard_worker is the other ranks' side of that loop.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "backend/engine/model_runner.h"
#include "backend/sharded/sharded_executor.h"

namespace kvserve {

class SeparateKvDrafter;

// This rank's part of speculative_config's draft model.
struct ShardDraft {
  // A draft of the served model's KV layout: this rank's slice of it (every rank). A draft of
  // another shape (own_cache): the whole of it on the sampler rank, null on the others.
  std::shared_ptr<DecoderModel> model;
  bool own_cache = false;
  std::string why;  // own_cache: how its KV layout differs (for the log)
};

// The sampler rank's drafter for a draft of another shape: it drafts alone, over a cache of its own,
// and one broadcast gives every rank the drafts (every rank knows that it is active).
struct OwnCacheDraft {
  bool active = false;
  std::unique_ptr<SeparateKvDrafter> drafter;  // on the sampler rank
  OwnCacheDraft();
  OwnCacheDraft(OwnCacheDraft&&) noexcept;
  OwnCacheDraft& operator=(OwnCacheDraft&&) noexcept;
  ~OwnCacheDraft();
};

// The rank that samples (and verifies drafts): the last stage's first tensor-parallel rank.
int sampler_rank(const ShardLayout& layout);

class ShardedRunner final : public ModelRunner {
 public:
  // on_comm_failure runs once when the job fails (a transfer failed, or the ranks fell out of step).
  // draft: this rank's part of speculative_config's draft model (none: no model).
  ShardedRunner(std::unique_ptr<PagedKvMemory> kv, std::shared_ptr<DecoderModel> model, parallel::ParallelGroups groups,
                int64_t micro_batches, std::function<void(const std::string&)> on_comm_failure, ShardDraft draft = {});
  ~ShardedRunner() override;  // tells the workers to exit

  StepResult execute(const StepPlan& plan) override;
  void idle() override;
  void stop() override;
  int64_t step_collectives() const override { return step_collectives_; }
  bool samples_in_process() const override;
  // Every shard compresses its layers and heads of a context; rank 0 decides (with the shards'
  // agreement) whether the context comes from the memories' caches.
  bool compressed_contexts() const override { return true; }
  // Every shard appends a verify step's rows and drops the rejected ones; the sampler rank verifies.
  bool speculative_decoding() const override { return true; }
  // Every rank runs the draft steps over its shard's view; the sampler rank chooses the drafts.
  bool self_drafting() const override { return true; }
  // Every rank runs a draft model's steps on its shard of it, as for self-drafts; or the sampler
  // rank alone runs a draft of another shape.
  bool model_drafting() const override { return exec_.has_draft_model() || own_draft_.active; }
  // Sets up rank 0's memory and sends the same setup to every worker (one command between steps).
  void configure_self_draft(const SpeculativeConfig& spec) override;

 private:
  template <typename F>
  auto guarded(F&& f) -> decltype(f());
  std::unique_ptr<PagedKvMemory> kv_;
  parallel::ParallelGroups groups_;
  ShardedExecutor exec_;
  std::function<void(const std::string&)> on_comm_failure_;
  SamplerBank samplers_;  // used when rank 0 is also the last stage (no pipeline)
  bool sampled_drafts_ = false;  // draft_sampling "sample"
  OwnCacheDraft own_draft_;
  int64_t step_collectives_ = 0;
  bool dead_ = false;
  bool stopped_ = false;
};

// A worker rank's loop: runs the plans rank 0 broadcasts until told to stop. Returns the process
// exit status (0 = clean stop, 1 = the job failed; the error is printed).
int run_shard_worker(std::unique_ptr<PagedKvMemory> kv, std::shared_ptr<DecoderModel> model, parallel::ParallelGroups groups,
                     int64_t micro_batches, ShardDraft draft = {});

}  // namespace kvserve
