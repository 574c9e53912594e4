#pragma once
// ModelRunner: executes the scheduler's StepPlans on the model and its KV memory. LocalRunner is one
// process; ShardedRunner (backend/sharded/) drives every shard of a tensor x pipeline parallel job.
#include <memory>
#include <string>

#include "backend/sampler.h"
#include "backend/step_plan.h"
#include "cache_manager/paged_kv_memory.h"

namespace kvserve {

class LlamaModel;

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;
  // Runs one plan: releases, sampler changes, the decode, then the prefills. A failing decode or
  // prefill is reported in the result and the rest still runs; an exception means the runner is
  // dead (a sharded job lost a shard). An empty plan reports the pools only.
  virtual StepResult execute(const StepPlan& plan) = 0;
  // The engine has been idle for a while (a sharded runner keeps its workers' links alive).
  virtual void idle() {}
  // The engine loop ended: a sharded runner tells its workers to exit.
  virtual void stop() {}
  // Collectives the steps ran on the control path so far (0 for one process).
  virtual int64_t step_collectives() const { return 0; }
  // Whether plans may carry prompt chunks (PrefillWork::chunked). The sharded runtime prefills whole
  // prompts: its pipeline stages would have to pass each chunk's hidden states and its KV shards
  // run the selection together, which is not built yet.
  virtual bool chunked_prefill() const { return false; }
};

class LocalRunner final : public ModelRunner {
 public:
  LocalRunner(std::shared_ptr<LlamaModel> model, std::unique_ptr<PagedKvMemory> kv)
      : model_(std::move(model)), kv_(std::move(kv)) {}
  StepResult execute(const StepPlan& plan) override;
  bool chunked_prefill() const override { return true; }

 private:
  std::shared_ptr<LlamaModel> model_;
  std::unique_ptr<PagedKvMemory> kv_;
  SamplerBank samplers_;
};

}  // namespace kvserve
