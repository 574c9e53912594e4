#pragma once
// ModelRunner: what the engine's scheduler asks of the model and its KV memory. LocalRunner is one
// process; ShardedRunner (sharded_runner.h) drives a tensor x pipeline parallel job from rank 0.
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine.h"
#include "kv_memory.h"
#include "paged_kv_memory.h"
#include "sampler.h"

namespace kvserve {

class LlamaModel;

// Pool occupancy in blocks, summed over every shard of the job.
struct KvUsage {
  int64_t blocks_total = 0;
  int64_t blocks_used = 0;
  int64_t blocks_high_water = 0;
};

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;
  // A new request's sampler (kept until remove_sequence, across preemptions), placed where the
  // logits are: here, or on a pipeline's last stage.
  virtual void add_sequence(int64_t seq_id, const SamplingParams& params, const std::vector<int64_t>& prompt,
                            uint64_t seed, const std::vector<int64_t>& eos_ids) = 0;
  virtual void remove_sequence(int64_t seq_id) = 0;
  // Prefills the prompt into the KV memory; samples the first token when `sample` (not after a
  // preemption, whose next token is already known). ban_eos: min_tokens not reached yet.
  virtual std::optional<SampledToken> prefill(int64_t seq_id, const std::vector<int64_t>& tokens,
                                              const std::string& policy, bool sample, bool ban_eos) = 0;
  // One token per sequence in, one sampled token per sequence out.
  virtual std::vector<SampledToken> decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens,
                                           const std::vector<char>& ban_eos) = 0;
  virtual void release(int64_t seq_id) = 0;
  // Admission: true only when every shard can hold it.
  virtual bool can_prefill(int64_t prompt_len, const std::string& policy) = 0;
  virtual bool fits_when_empty(int64_t prompt_len, const std::string& policy) = 0;
  virtual bool can_decode(const std::vector<int64_t>& seq_ids) = 0;
  // KV tokens the sequence holds, summed over layers (every stage's).
  virtual int64_t kept_tokens(int64_t seq_id) = 0;
  virtual KvUsage usage() = 0;
  // The engine has been idle for a while (a sharded runner keeps its workers' links alive).
  virtual void idle() {}
  // The engine loop ended: a sharded runner tells its workers to exit.
  virtual void stop() {}
};

// The paged KV memory an engine's options describe, for a model shard (the whole model by default).
std::unique_ptr<PagedKvMemory> make_kv_memory(const LlamaModel& model, const EngineOptions& options, KvShard shard = {});

class LocalRunner final : public ModelRunner {
 public:
  LocalRunner(std::shared_ptr<LlamaModel> model, std::unique_ptr<PagedKvMemory> kv)
      : model_(std::move(model)), kv_(std::move(kv)) {}
  void add_sequence(int64_t seq_id, const SamplingParams& params, const std::vector<int64_t>& prompt, uint64_t seed,
                    const std::vector<int64_t>& eos_ids) override {
    samplers_.add(seq_id, params, prompt, seed, eos_ids);
  }
  void remove_sequence(int64_t seq_id) override { samplers_.remove(seq_id); }
  std::optional<SampledToken> prefill(int64_t seq_id, const std::vector<int64_t>& tokens, const std::string& policy,
                                      bool sample, bool ban_eos) override;
  std::vector<SampledToken> decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens,
                                   const std::vector<char>& ban_eos) override;
  void release(int64_t seq_id) override { kv_->release(seq_id); }
  bool can_prefill(int64_t n, const std::string& policy) override { return kv_->can_prefill(n, policy); }
  bool fits_when_empty(int64_t n, const std::string& policy) override { return kv_->fits_when_empty(n, policy); }
  bool can_decode(const std::vector<int64_t>& ids) override { return kv_->can_decode(ids); }
  int64_t kept_tokens(int64_t seq_id) override { return kv_->kept_tokens(seq_id); }
  KvUsage usage() override { return {kv_->blocks_total(), kv_->blocks_used(), kv_->blocks_high_water()}; }

 private:
  std::shared_ptr<LlamaModel> model_;
  std::unique_ptr<PagedKvMemory> kv_;
  SamplerBank samplers_;
};

}  // namespace kvserve
