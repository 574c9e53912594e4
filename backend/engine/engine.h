#pragma once
// Engine: the continuous-batching loop on its own thread; HTTP and the CLI submit requests to it.
#include <atomic>
#include <stdexcept>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cache_manager/kv_memory_factory.h"
#include "backend/engine/engine_types.h"
#include "backend/spec_decode/speculative_config.h"
#include "backend/model/model_config.h"
#include "backend/sampling/structured_output_spec.h"
#include "backend/engine/warmup.h"

namespace kvserve {

class GrammarCompiler;
class DecoderModel;
struct StructuredGrammar;
class ModelRunner;
class Tokenizer;

// Scheduler and memory limits of one engine.
struct EngineOptions {
  int64_t max_num_seqs = 32;              // sequences decoding at once
  int64_t max_num_batched_tokens = 8192;  // prompt tokens prefilled per step
  // Longer prompts are prefilled over several steps while the others decode (Scheduler::Options;
  // a runner that cannot take chunks, the sharded one, prefills whole prompts).
  bool enable_chunked_prefill = false;
  // While requests decode, the most prompt tokens a step prefills (Scheduler::Options): -1 = auto
  // (kAutoLongPrefillTokensCpu on a CPU, no cap on CUDA), 0 = no cap.
  int64_t long_prefill_token_threshold = -1;
  int64_t max_waiting = 256;              // queue bound; submit() beyond it throws EngineOverloaded
  // Admission on queue time (0 = off): while the oldest request not yet started has waited more than
  // half of this, submit() refuses new ones (EngineOverloaded, over capacity), and a request still
  // waiting to start after this long fails as over capacity. A rate estimate was tried first: the
  // first cold step and decode-heavy steps made it refuse work a server had minutes of room for.
  double max_queue_time_s = 0.0;
  int64_t max_model_len = 0;              // 0 = context_length(config) (max_position_embeddings, x factor for dynamic / yarn)
  int64_t kv_cache_bytes = int64_t{1} << 30;
  int64_t block_size = 16;
  bool enforce_eager = false;  // no CUDA graphs for decode (model.enforce_eager, --enforce-eager)
  // Prompt tokens of the warm-up run before the engine serves (backend/engine/warmup.h; model.warmup_tokens,
  // --warmup-tokens): -1 = max_num_batched_tokens on a CUDA device and none on a CPU, 0 = none.
  int64_t warmup_tokens = -1;
  // Automatic prefix caching (cache.enable_prefix_caching): full prompt blocks stay in the pool
  // for later requests that start with the same tokens; on by default, as in vLLM.
  bool enable_prefix_caching = true;
  // Compressed contexts stay in the pool for the next request with the same context
  // (cache.enable_context_caching; docs/architecture.md, "Compressed contexts").
  bool enable_context_caching = true;
  // Host-RAM tier of the prefix cache per shard (cache.prefix_cache_bytes; 0 = none): cached
  // blocks the pool reclaims move there and come back on a hit.
  int64_t prefix_cache_bytes = 0;
  // Block layout of the pool (cache.kv_layout): head-wise when a policy has head_budgets=adaptive.
  KvLayout kv_layout = KvLayout::kAuto;
  std::string default_policy = "full";
  // Speculative decoding (speculative_config, --speculative-config): off unless a method is set.
  SpeculativeConfig speculative;
  // Named KV policies as JSON objects {"name":..., params...}; resolved by the policies library.
  std::map<std::string, std::map<std::string, std::string>> policies;
  // Called on the engine thread, once per request, with the seconds it waited from submit() until
  // the scheduler first admitted it for prefill (a preempted request that is re-queued is not
  // counted again). Must not block. Feeds kvserve:request_queue_time_seconds.
  std::function<void(double seconds)> on_queue_time;
};

// The options as the model allows them. Dynamic NTK and longrope RoPE rotate a prompt's keys with
// the frequencies of the prompt's whole length (backend/model/rope.h), so a prefix cached from another
// prompt, or the earlier chunks of a chunked prefill, would hold other keys than one forward of the
// prompt computes: for such models prefix caching (with its host tier) and chunked prefill are off.
EngineOptions options_for_model(EngineOptions options, const ModelConfig& config);

// A snapshot for /metrics and /health.
struct EngineStats {
  int64_t running = 0;
  int64_t running_high_water = 0;  // most sequences decoded together in one step
  int64_t waiting = 0;
  int64_t kv_blocks_total = 0;
  int64_t kv_blocks_used = 0;
  int64_t kv_blocks_high_water = 0;
  int64_t kv_bytes_total = 0;  // the pools' bytes, and those of the blocks in use (per KV cache dtype)
  int64_t kv_bytes_used = 0;
  std::map<std::string, int64_t> kv_bytes_used_by_dtype;  // per KV cache dtype (policies' kv_dtype)
  int64_t prompt_tokens_total = 0;
  int64_t generation_tokens_total = 0;
  int64_t preemptions_total = 0;
  int64_t kv_admission_waits_total = 0;  // steps whose next waiting prompt did not fit the KV pool
  int64_t steps_total = 0;
  // Speculative decoding (vLLM's spec_decode counters): verify steps with drafts (per sequence),
  // draft tokens, accepted ones, and accepted per draft position.
  int64_t spec_decode_num_drafts = 0;
  int64_t spec_decode_num_draft_tokens = 0;
  int64_t spec_decode_num_accepted_tokens = 0;
  std::vector<int64_t> spec_decode_accepted_per_pos;
  // Their cost: self-draft steps and seconds, steps that verified drafts and their seconds.
  int64_t spec_decode_draft_steps = 0;
  // Prompt tokens a draft model of another shape took from its own prefix cache.
  int64_t spec_decode_draft_prefix_hits = 0;
  double spec_decode_draft_seconds = 0.0;
  int64_t spec_decode_verify_steps = 0;
  double spec_decode_verify_seconds = 0.0;
  int64_t spec_decode_pauses = 0;  // times speculation paused because it did not pay (auto_disable)
  int64_t step_collectives_total = 0;  // control-path collectives of a sharded job's steps
  // CUDA graph captures of decode steps (the warm-up's included) and their host seconds.
  int64_t cuda_graph_captures_total = 0;
  double cuda_graph_capture_seconds_total = 0;
  int64_t prefix_cache_queries_total = 0;  // prompt tokens looked up in the prefix cache
  int64_t prefix_cache_hits_total = 0;     // of those, served from it
  int64_t kv_blocks_cached = 0;            // blocks the prefix cache holds (part of the pool)
  int64_t prefix_cache_bytes = 0;
  // The host-RAM tier (cache.prefix_cache_bytes): bytes held and capacity, entries moved to it
  // (reclaimed from the pool) and back (hits).
  int64_t prefix_cache_host_bytes = 0;
  int64_t prefix_cache_host_capacity_bytes = 0;
  int64_t prefix_cache_host_stores_total = 0;
  int64_t prefix_cache_host_loads_total = 0;
  // Compressed contexts (cache.enable_context_caching): entries, their blocks and bytes, and the
  // blocks the same contexts would hold uncompressed.
  int64_t compressed_contexts = 0;
  int64_t kv_blocks_compressed_contexts = 0;
  int64_t compressed_context_bytes = 0;
  int64_t compressed_context_full_blocks = 0;
  // prefix_reuse: compressed: conversations whose KV is parked, and the blocks and bytes it holds.
  int64_t conversations_parked = 0;
  int64_t kv_blocks_parked = 0;
  int64_t conversation_cache_bytes = 0;
};

// Thrown by submit() when the queue is full (HTTP 429) or the engine is over capacity, its queue
// holding more than max_queue_time_s of prefill (HTTP 503).
class EngineOverloaded : public std::runtime_error {
 public:
  explicit EngineOverloaded(const std::string& what, bool over_capacity = false)
      : std::runtime_error(what), over_capacity_(over_capacity) {}
  bool over_capacity() const { return over_capacity_; }

 private:
  bool over_capacity_;
};

// A request with the callback its events go to: one of a batch that Engine::submit_all queues together.
struct Submission {
  GenerationRequest request;
  EventCallback on_event;
};

class Engine {
 public:
  // `runner` executes the model (a sharded job's ShardedRunner); null = this process, a LocalRunner.
  Engine(std::shared_ptr<DecoderModel> model, std::shared_ptr<const Tokenizer> tokenizer, EngineOptions options,
         std::unique_ptr<ModelRunner> runner = nullptr);
  ~Engine();  // shutdown(false)
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates and queues. Throws KvError for a bad request (unknown kv_policy, prompt longer than
  // max_model_len, empty prompt) and EngineOverloaded when the queue is full. `on_event` runs on the
  // engine thread and must not block; the last event it gets has finished = true.
  void submit(GenerationRequest request, EventCallback on_event);
  // The same for several requests (an HTTP request's choices and prompts): each is validated, then
  // all are queued under one lock or none is. They reach the scheduler in the same step, so how they
  // are batched (and with it the last bits of their prefill's products) does not hang on when the
  // engine thread woke between two submits.
  void submit_all(std::vector<Submission> batch);
  // Compiles a structured-output spec for SamplingParams::grammar (any thread; cached; bounded in
  // time). Throws GrammarError naming the spec's field.
  std::shared_ptr<const StructuredGrammar> compile_grammar(const StructuredOutputSpec& spec);
  // Cancels a queued or running request (its blocks return to the pool within one step); the
  // request's last event has finish_reason "abort". Unknown ids are ignored.
  void cancel(const std::string& request_id);
  // Stops admitting; drain = finish in-flight work first, else abort it; joins the loop thread.
  void shutdown(bool drain);
  // False once the model runner failed for good (a shard of a sharded job died or hung): every
  // in-flight request got an error, and new ones are refused.
  bool healthy() const { return healthy_.load(); }
  std::string unhealthy_reason() const;
  // Marks the engine unhealthy from outside (the launcher saw a shard's process exit); in-flight requests fail
  // at their next step.
  void mark_unhealthy(const std::string& reason);

  EngineStats stats() const;
  // What the warm-up ran before the engine started serving (zeros when none ran).
  const WarmupReport& warmup() const { return warmup_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const DecoderModel& model() const { return *model_; }
  std::vector<std::string> policy_names() const;
  bool has_policy(const std::string& name) const;
  // Whether requests under the policy compress their context alone (compress: context, one process).
  bool compresses_context(const std::string& name) const { return context_policies_.count(name) != 0; }
  // The speculative decoding in effect (method none when off, or when the runtime cannot speculate).
  const SpeculativeConfig& speculative() const { return speculative_; }

 private:
  struct Impl;
  void loop();
  std::shared_ptr<DecoderModel> model_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  EngineOptions options_;
  std::set<std::string> context_policies_;  // compresses_context
  SpeculativeConfig speculative_;
  WarmupReport warmup_;
  std::unique_ptr<Impl> impl_;
  std::once_flag grammar_once_;
  std::unique_ptr<GrammarCompiler> grammar_;  // made on the first structured-output request
  std::atomic<bool> healthy_{true};
  std::thread thread_;
};

}  // namespace kvserve
