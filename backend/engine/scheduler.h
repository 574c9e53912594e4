#pragma once
// Scheduler: the engine's queues and decisions — preemption, first-come-first-served admission at
// each prompt's compressed size — turned into one StepPlan per step. It has no thread and no model:
// what it knows of the KV pools comes from the runners' StepResults (every shard's occupancy and
// each sequence's blocks), so a sharded step needs no admission questions, and tests drive it with
// a fake runner.
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend/engine/sequence.h"
#include "backend/engine/step_plan.h"
#include "backend/spec_decode/speculation_governor.h"
#include "backend/spec_decode/speculative_config.h"
#include "cache_manager/conversation_cache.h"
#include "policies/policy_config.h"

namespace kvserve {

// long_prefill_token_threshold's automatic value (-1) on a CPU, measured on the default model and 2
// cores (docs/benchmarks.md, "Decode while prompts arrive"): while two 3K prompts prefill, two
// running streams get a token every ~0.4 s (worst 0.55-0.78 s; 128: 0.6 s, worst 1.1 s; whole
// prompts: none for ~10 s), and the prompts' first tokens come 2.0-2.2x later than whole. On
// CUDA no cap applies: a decode step is bound by reading the weights, and a 2048-token chunk costs
// about as much.
inline constexpr int64_t kAutoLongPrefillTokensCpu = 64;
// The threshold a scheduler runs with: `configured` (-1 = auto: the CPU value, or no cap on CUDA).
int64_t resolve_long_prefill_token_threshold(int64_t configured, bool cuda);

class Scheduler {
 public:
  struct Options {
    int64_t max_num_seqs = 32;              // sequences decoding at once
    int64_t max_num_batched_tokens = 8192;  // prompt tokens prefilled per step
    // A prompt longer than what is left of the step's max_num_batched_tokens is prefilled in chunks
    // over several steps while the running sequences keep decoding (policies whose selection needs
    // the whole prompt at once, and prompts whose uncompressed size does not fit a pool, run whole).
    // Prompts may compress their context alone (GenerationRequest::context_len, `compress: context`).
    bool compressed_contexts = false;
    bool enable_chunked_prefill = false;
    // While any sequence decodes, a step prefills at most this many prompt tokens (0 = no cap but
    // max_num_batched_tokens): the running streams then wait one decode plus this many prompt
    // tokens per token, never a whole prompt. An idle engine prefills at the full budget.
    int64_t long_prefill_token_threshold = 0;
    std::map<std::string, PolicyConfig> policies;  // by name; what a prompt may occupy
    std::vector<int64_t> eos_ids;                  // the model's and the tokenizer's
    // Parked conversations kept at most (prefix_reuse: compressed): the oldest goes beyond this,
    // so the index's token lists stay bounded in host memory whatever the pools hold.
    int64_t max_parked_conversations = 1024;
    // Called once per request with the seconds from submit() to its first admission.
    std::function<void(double seconds)> on_queue_time;
    // ModelRunner::shared_prefix_blocks (one KV shard): a whole `full` prompt is admitted for the
    // blocks it adds, not for the cached ones it shares with running requests. Unset or nullopt:
    // every block counts.
    using SharedPrefixBlocks = std::function<std::optional<int64_t>(
        std::span<const int64_t> prompt, const std::string& policy, std::span<const int64_t> leaving)>;
    SharedPrefixBlocks shared_prefix_blocks;
    // Speculative decoding (backend/spec_decode/): drafts verified in the decode step.
    SpeculativeConfig speculative;
  };
  // Speculative decoding so far (vLLM's spec_decode counters): steps in which a sequence verified
  // drafts, drafts proposed, drafts accepted, and accepted per draft position (0-based).
  struct SpecCounters {
    int64_t drafts = 0, draft_tokens = 0, accepted_tokens = 0;
    std::vector<int64_t> accepted_per_pos;
    int64_t pauses = 0;  // times the governor paused speculation (auto_disable)
  };
  // A decision about one sequence the engine turns into events.
  struct Output {
    Sequence* seq = nullptr;
    std::optional<SampledToken> token;  // a sampled token (decode, or a prefill's first)
    std::string error;                  // non-empty: the sequence failed
  };

  explicit Scheduler(Options options) : options_(std::move(options)) {}

  // Queues an accepted request (FCFS behind the others).
  void add(std::unique_ptr<Sequence> s) { waiting_.push_back(std::move(s)); }
  // Takes every queued or running sequence `pred` selects out of the scheduler (cancellation,
  // shutdown); its KV and sampler go in the next plan. The caller sends the final event.
  std::vector<std::unique_ptr<Sequence>> take_if(const std::function<bool(const Sequence&)>& pred);
  // Takes a running sequence out once it is done (its final event is the caller's). `completed`:
  // it ended normally (stop or length), so its KV may be parked for its conversation's next turn
  // (when its policy compressed its prompt).
  std::unique_ptr<Sequence> finish(int64_t seq_id, bool completed = false);

  // A waiting sequence that can never fit in the pool, and why (the caller fails it).
  using Rejected = std::pair<std::unique_ptr<Sequence>, std::string>;
  // The next step; `rejected` gets the sequences it refused.
  StepPlan schedule(std::vector<Rejected>* rejected);
  // Reads a runner's report of `plan`: occupancy for the next plan, and what each sequence got.
  std::vector<Output> update(const StepPlan& plan, StepResult result);

  bool idle() const { return running_.empty() && waiting_.empty(); }
  // The running (or prefilling) sequence with this id, or null.
  const Sequence* running(int64_t seq_id) const;
  // KV or samplers of finished sequences still to free (the next plan does it).
  bool has_pending() const { return !release_.empty() || !park_.empty() || !remove_.empty() || !truncate_.empty(); }
  const SpecCounters& spec_counters() const { return spec_; }
  bool knows_pools() const { return !shards_.empty(); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  // When the longest-waiting request that has not started yet arrived (none: nothing waits).
  std::optional<std::chrono::steady_clock::time_point> oldest_waiting_arrival() const;
  int64_t preemptions() const { return preemptions_; }
  // Steps in which the next waiting prompt stayed waiting because the KV pool could not hold it.
  int64_t kv_admission_waits() const { return kv_admission_waits_; }
  // Prefix cache lookups so far, in prompt tokens: looked up, and found (vLLM's queries and hits).
  int64_t prefix_queries() const { return prefix_queries_; }
  int64_t prefix_hits() const { return prefix_hits_; }
  KvUsage usage() const;

 private:
  // One shard's pool as of the last StepResult, plus the sequences' blocks there.
  struct Pool {
    ShardUsage usage;
    std::unordered_map<int64_t, int64_t> held, demand;
    std::unordered_map<int64_t, size_t> format;  // each sequence's KV format there (ShardUsage::format)
    size_t format_of(const Sequence& s) const { return usage.format(s.req.kv_policy); }
  };
  // Frees `id` from the books at the start of the next plan (parks its KV when `park`).
  void drop_later(Sequence& s, bool park = false);
  // Whether `s` leaves its KV for its conversation's next turn (prefix_reuse: compressed).
  bool reuses_compressed(const Sequence& s) const;
  // The most draft tokens `s` may carry a step: the engine's num_speculative_tokens, capped by its
  // request (0 = it decodes plainly).
  int64_t max_drafts(const Sequence& s) const;
  // Whether the sequence drafts when speculation is on (it asked for it, and its KV allows it).
  bool may_draft(const Sequence& s) const;
  // The parked conversation a waiting sequence's prompt continues, if any.
  const ConversationCache::Entry* resumable(const Sequence& s, const std::vector<int64_t>& prompt) const;
  // Why a prompt of `n` tokens under `policy` can never fit some shard's whole pool, if it cannot.
  std::optional<std::string> unfit_reason(int64_t n, const std::string& policy) const;
  // Whether a prompt of `n` tokens under `policy` is prefilled in chunks when it exceeds a step's budget.
  // The context length a prompt of n tokens (s's prompt and what it generated) runs with: its
  // request's context where its policy compresses contexts alone (compress: context), else 0.
  int64_t context_len(const Sequence& s, int64_t n) const;
  bool may_chunk(int64_t n, const std::string& policy) const;
  // Blocks a prompt being prefilled in chunks still reserves on shard `i` (its peak less what it holds).
  int64_t reserved(const Sequence& s, size_t i) const;
  // Drafts `s` verifies this step (prompt lookup), at most `k`.
  std::vector<int64_t> propose(const Sequence& s, int64_t k) const;
  // Plans the next chunk of `s` (at most `budget` tokens; the rest of its prompt if it fits).
  void plan_chunk(Sequence& s, int64_t budget, StepPlan& plan) const;

  Options options_;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;  // admission order (preemption takes the last)
  std::vector<int64_t> release_, remove_;           // for the next plan
  std::vector<std::pair<int64_t, int64_t>> truncate_;  // rejected drafts' KV, for the next plan
  SpecCounters spec_;
  SpeculationGovernor governor_;  // auto_disable: pauses speculation while it does not pay
  std::vector<int64_t> park_;
  // Finished sequences whose KV stays in the pools for their conversations' next turns. Their
  // blocks count as used (Pool::held keeps them) until a prompt resumes them or they are evicted,
  // oldest first, before anything is preempted or a prompt waits for room.
  ConversationCache parked_;
  std::vector<Pool> shards_;
  int64_t preemptions_ = 0;
  int64_t kv_admission_waits_ = 0;
  int64_t prefix_queries_ = 0, prefix_hits_ = 0;
};

}  // namespace kvserve
