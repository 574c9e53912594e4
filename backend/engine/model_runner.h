#pragma once
// ModelRunner: executes the scheduler's StepPlans on the model and its KV memory. LocalRunner is one
// process; ShardedRunner (backend/sharded/) drives every shard of a tensor x pipeline parallel job.
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "backend/sampling/sampler.h"
#include "backend/spec_decode/speculative_config.h"
#include "backend/engine/step_plan.h"
#include "cache_manager/paged_kv_memory.h"

namespace kvserve {

class DecodeGraphs;
class DecoderModel;
class SeparateKvDrafter;

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
  // CUDA graph captures of decode steps so far and their host time (a capture holds up its step; a
  // context that grows past a graph's split hint is captured again). Zero without decode graphs.
  virtual int64_t graph_captures() const { return 0; }
  virtual double graph_capture_s() const { return 0; }
  // Whether plans may carry prompt chunks (PrefillWork::chunked). The sharded runtime prefills whole
  // prompts: its pipeline stages would have to pass each chunk's hidden states and its KV shards
  // run the selection together, which is not built yet.
  virtual bool chunked_prefill() const { return false; }
  // Asked between the layers of a prefill with the sequences it runs; true stops that prefill, which
  // then reports an error for them (their KV freed). Only where one process runs every layer: shards
  // that run layers together cannot stop alone, so the default ignores it and a cancellation waits
  // for the step's end.
  using CancelCheck = std::function<bool(std::span<const int64_t> seq_ids)>;
  virtual void set_cancel_check(CancelCheck check) { (void)check; }
  // Whether it verifies drafts (a sequence in several decode rows, StepPlan::truncate).
  virtual bool speculative_decoding() const { return false; }
  // Whether it drafts with the model over its own KV (StepPlan::self_draft).
  virtual bool self_drafting() const { return false; }
  // Whether it holds a draft model (speculative_config method "draft_model"; StepPlan::model_draft).
  virtual bool model_drafting() const { return false; }
  // Self-drafting as configured: over a policy's kept set (SpeculativeConfig::draft_policy;
  // PagedKvMemory::set_draft_policy), and how sampling requests draft (draft_sampling).
  virtual void configure_self_draft(const SpeculativeConfig& spec) {
    (void)spec;
    KV_FAIL("speculative_config: method 'self': this runner does not self-draft");
  }
  // Whether prompts may compress their context alone (PrefillWork::context_len).
  virtual bool compressed_contexts() const { return false; }
  // Whether a prefill can report prompt_logprobs (the logits of every prompt position). The sharded
  // runtime's last stage returns the last position's only.
  virtual bool prompt_logprobs() const { return false; }
  // Drops what the prefix cache and compressed contexts hold that no sequence uses, and restarts the
  // pools' high-water marks (after the engine's warm-up). False: this runner cannot (a sharded job's
  // shards are in other processes), and nothing changed.
  virtual bool reset_caches() { return false; }
  // Whether this process samples (a pipeline's last stage samples elsewhere): grammar-constrained
  // requests need the compiled grammar where the sampler runs.
  virtual bool samples_in_process() const { return true; }
  // PagedKvMemory::shared_prefix_blocks of the one KV shard; nullopt where the shards are in other
  // processes (admission then counts a prompt's cached blocks as new).
  virtual std::optional<int64_t> shared_prefix_blocks(std::span<const int64_t> prompt, const std::string& policy,
                                                      std::span<const int64_t> leaving) const {
    (void)prompt, (void)policy, (void)leaving;
    return std::nullopt;
  }
};

struct LocalRunnerOptions {
  int64_t max_num_seqs = 32;   // the largest decode batch: the largest CUDA graph bucket
  bool enforce_eager = false;  // never capture CUDA graphs (model.enforce_eager, --enforce-eager)
  // Prompt tokens per prefill forward: the prompts of a step run as one forward while they fit
  // (the scheduler's max_num_batched_tokens, so a step's prompts run together); a longer prompt runs alone.
  int64_t prefill_batch_tokens = 8192;
};

class LocalRunner final : public ModelRunner {
 public:
  // On a CUDA model whose decode step can be captured (DecodeGraphs::unsupported), and unless
  // enforce_eager, decode steps run as CUDA graphs.
  LocalRunner(std::shared_ptr<DecoderModel> model, std::unique_ptr<PagedKvMemory> kv, LocalRunnerOptions options = {});
  // Over a memory whose policies may store K/V in several formats; decode steps then run eagerly
  // (a CUDA graph captures one format's kernels) unless there is only one.
  LocalRunner(std::shared_ptr<DecoderModel> model, std::unique_ptr<MixedKvMemory> kv, LocalRunnerOptions options = {});
  ~LocalRunner() override;
  StepResult execute(const StepPlan& plan) override;
  bool chunked_prefill() const override { return true; }
  void set_cancel_check(CancelCheck check) override;
  bool speculative_decoding() const override { return true; }
  bool self_drafting() const override { return true; }
  void configure_self_draft(const SpeculativeConfig& spec) override {
    if (!spec.draft_policy.empty())
      kv_->set_draft_policy(spec.draft_policy, spec.draft_budget, spec.min_context_tokens(), spec.draft_sink_tokens,
                            spec.draft_refresh_tokens);
    sampled_drafts_ = spec.draft_sampling == "sample";
  }
  // The draft model of method "draft_model" (backend/spec_decode/draft_model.h), loaded by the
  // caller: it drafts over this runner's cache where it shares the model's KV layout, else over a
  // cache of its own for as many tokens as this runner's (SeparateKvDrafter). Null: none.
  void set_draft_model(std::shared_ptr<DecoderModel> draft);
  bool model_drafting() const override { return draft_model_ != nullptr || separate_ != nullptr; }
  bool compressed_contexts() const override { return true; }
  bool prompt_logprobs() const override { return true; }
  bool reset_caches() override {
    kv_->reset_caches();
    return true;
  }
  std::optional<int64_t> shared_prefix_blocks(std::span<const int64_t> prompt, const std::string& policy,
                                              std::span<const int64_t> leaving) const override {
    return kv_->shared_prefix_blocks(prompt, policy, leaving);
  }
  int64_t graph_captures() const override;
  double graph_capture_s() const override;
  // Null when decode runs eagerly.
  const DecodeGraphs* decode_graphs() const { return graphs_.get(); }

 private:
  std::shared_ptr<DecoderModel> model_;
  std::shared_ptr<DecoderModel> draft_model_;      // a draft model over kv_, or null
  std::unique_ptr<SeparateKvDrafter> separate_;  // a draft model over its own cache, or null
  std::unique_ptr<MixedKvMemory> kv_;
  std::unique_ptr<DecodeGraphs> graphs_;  // refers to *kv_: declared after it, destroyed before it
  size_t prefill_batch_tokens_ = 8192;
  SamplerBank samplers_;
  bool sampled_drafts_ = false;  // draft_sampling "sample"
};

}  // namespace kvserve
