#pragma once
// ParallelJob: this process's place in a tensor x pipeline parallel job, set up end to end: the
// launcher (this node's workers), the rendezvous, the process groups, and this rank's model shard.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/engine/engine.h"
#include "backend/model/decoder_model.h"
#include "backend/engine/model_runner.h"
#include "backend/sharded/sharded_executor.h"
#include "backend/sharded/sharded_runner.h"

namespace kvserve {

namespace parallel {
class Communicator;
class WorkerGroup;
}  // namespace parallel

// The parallel layout and launch settings (YAML `parallel:` and the CLI flags).
struct ParallelOptions {
  int64_t tensor_parallel_size = 1;
  int64_t pipeline_parallel_size = 1;
  std::vector<int64_t> pipeline_layers;  // layers per stage; empty = even split
  int64_t micro_batches = 0;             // decode micro-batches in flight; 0 = one per stage
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;      // 0 = a free port (single node)
  double timeout_s = 20.0;  // every collective; a hung rank fails the job after this long
  int64_t world_size() const { return tensor_parallel_size * pipeline_parallel_size; }
};

class ParallelJob {
 public:
  // Single process when the world is 1 and no torchrun variables are set. Otherwise: launches this
  // node's other ranks (unless RANK is already set), joins the rendezvous, creates the process
  // groups and loads only this rank's slices of the model (on cuda:LOCAL_RANK for CUDA jobs).
  static std::unique_ptr<ParallelJob> start(const ParallelOptions& options, const std::string& model_dir,
                                            LoadOptions load);
  ~ParallelJob();

  bool sharded() const { return world_size_ > 1; }
  bool is_driver() const { return rank_ == 0; }
  int rank() const { return rank_; }
  std::shared_ptr<DecoderModel> model() const { return model_; }
  const parallel::ParallelGroups& groups() const { return groups_; }
  const ParallelOptions& options() const { return options_; }

  // This rank's KV memory (its layers and KV heads, its score exchange wired in).
  std::unique_ptr<PagedKvMemory> make_memory(const EngineOptions& options) const;
  // A single process's memory: one format per KV dtype its policies name (make_mixed_kv_memory).
  std::unique_ptr<MixedKvMemory> make_local_memory(const EngineOptions& options) const;
  // The score exchange that makes this rank's policies decide as one process would (none when the
  // job is one process).
  KvShard kv_shard() const;
  // Driver: the engine's runner (a LocalRunner when not sharded, with the draft model of
  // speculative_config method "draft_model" loaded as the model was).
  std::unique_ptr<ModelRunner> make_runner(const EngineOptions& options);
  // Non-driver ranks: serve rank 0's commands until told to stop; returns the exit status.
  int run_worker(const EngineOptions& options);

  // Runs when a local worker process dies (from the monitor thread).
  void set_on_failure(std::function<void(const std::string&)> f);
  // Stops and reaps this node's worker processes (after a failure, or when the job ends).
  void stop_workers();
  // Waits for the workers to exit by themselves (they were told to), then stops the rest.
  void join_workers();

 private:
  ParallelJob() = default;
  // This rank's part of speculative_config's draft model (none: no model).
  ShardDraft load_draft(const EngineOptions& options) const;
  ParallelOptions options_;
  int rank_ = 0, world_size_ = 1;
  std::unique_ptr<parallel::WorkerGroup> workers_;
  std::shared_ptr<parallel::Communicator> comm_;
  parallel::ParallelGroups groups_;
  std::shared_ptr<DecoderModel> model_;
  std::string model_dir_;  // what was loaded, and how: a draft model is loaded alike
  LoadOptions load_;
};

}  // namespace kvserve
