#pragma once
// ShardedRunner: the engine's ModelRunner on rank 0 of a TP x PP job. Samplers live on the last
// stage (TP rank 0), which sends rank 0 only the sampled tokens and requested logprobs. Each call is broadcast to
// every rank as a command; all ranks then run the same ShardedExecutor step or answer the same
// admission question about their own shard (the answer is the strictest one). ShardWorker is the
// other ranks' side of that loop.
#include <functional>
#include <memory>

#include "model_runner.h"
#include "sharded_executor.h"

namespace kvserve {

struct ShardCommand;  // a command rank 0 broadcasts (sharded_runner.cpp)

class ShardedRunner final : public ModelRunner {
 public:
  // on_comm_failure runs once when a transfer fails (the job is dead; e.g. stop the workers).
  ShardedRunner(std::unique_ptr<PagedKvMemory> kv, std::shared_ptr<LlamaModel> model, ParallelGroups groups,
                int64_t micro_batches, std::function<void(const std::string&)> on_comm_failure);
  ~ShardedRunner() override;  // tells the workers to exit

  void add_sequence(int64_t seq_id, const SamplingParams& params, const std::vector<int64_t>& prompt, uint64_t seed,
                    const std::vector<int64_t>& eos_ids) override;
  void remove_sequence(int64_t seq_id) override;
  std::optional<SampledToken> prefill(int64_t seq_id, const std::vector<int64_t>& tokens, const std::string& policy,
                                      bool sample, bool ban_eos) override;
  std::vector<SampledToken> decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens,
                                   const std::vector<char>& ban_eos) override;
  void release(int64_t seq_id) override;
  bool can_prefill(int64_t prompt_len, const std::string& policy) override;
  bool fits_when_empty(int64_t prompt_len, const std::string& policy) override;
  bool can_decode(const std::vector<int64_t>& seq_ids) override;
  int64_t kept_tokens(int64_t seq_id) override;
  KvUsage usage() override;
  void idle() override;
  void stop() override;


 private:
  template <typename F>
  auto guarded(F&& f) -> decltype(f());
  // Broadcasts `c`, then true only when every shard's `local` answer is yes.
  bool every_shard(const ShardCommand& c, const std::function<bool()>& local);
  std::unique_ptr<PagedKvMemory> kv_;
  ParallelGroups groups_;
  ShardedExecutor exec_;
  std::function<void(const std::string&)> on_comm_failure_;
  SamplerBank samplers_;  // used when rank 0 is also the last stage (no pipeline)
  bool dead_ = false;
  bool stopped_ = false;
};

// A worker rank's loop: runs the commands rank 0 broadcasts until told to stop. Returns the
// process exit status (0 = clean stop, 1 = the job failed; the error is printed).
int run_shard_worker(std::unique_ptr<PagedKvMemory> kv, std::shared_ptr<LlamaModel> model, ParallelGroups groups,
                     int64_t micro_batches);

}  // namespace kvserve
