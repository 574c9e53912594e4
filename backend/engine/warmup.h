#pragma once
// Engine warm-up: a few throwaway steps through the model runner before the engine serves, so that
// the first request does not pay for the device's lazy start-up: cuBLAS handles and workspaces,
// kernel modules loaded on their first launch, the caching allocator growing to a step's
// activations, and the CUDA graphs of the first decode buckets. vLLM does the same at start (its
// profile run with max_num_batched_tokens dummy tokens, then its graph captures).
#include <cstdint>
#include <string>

#include "policies/policy_config.h"

namespace kvserve {

class ModelRunner;

// What the warm-up runs: `prompts` prompts of about tokens / prompts random token ids each,
// prefilled in one step under `policy`, then `decode_steps` decode steps with all of them and as
// many with one (two CUDA graph buckets).
struct WarmupOptions {
  int64_t tokens = 0;  // prompt tokens in all; 0 = no warm-up
  int64_t prompts = 1;
  int64_t decode_steps = 2;
  int64_t vocab_size = 0;     // token ids come from [0, vocab_size)
  int64_t max_model_len = 0;  // a prompt and its decoded tokens stay within it
  std::string policy = "full";
  PolicyConfig policy_config;  // the policy's (admission: the prompts must fit the pool)
};

// What ran (zeros when nothing did).
struct WarmupReport {
  double seconds = 0.0;
  int64_t prompts = 0;
  int64_t tokens = 0;  // prompt tokens prefilled
  int64_t decode_steps = 0;
  int64_t graph_captures = 0;  // CUDA graphs it captured (ModelRunner::graph_captures)
  std::string skipped;  // why nothing ran, when options asked for a warm-up
};

// Runs the warm-up on `runner` before any request: the prompts are shrunk to fit the pool, and
// afterwards every sequence is released and the runner's caches are reset (ModelRunner::
// reset_caches), so the engine starts with an empty pool and prefix cache. A runner that cannot
// reset its caches (a sharded job) is not warmed up. Throws KvError naming the step that failed;
// the pool is left empty then too.
WarmupReport warm_up(ModelRunner& runner, const WarmupOptions& options);

// The warm-up tokens of an engine: `requested` >= 0 as asked; -1 (auto) the scheduler's token
// budget on a CUDA device, and 0 on a CPU (where the first request pays no start-up worth a run).
int64_t resolve_warmup_tokens(int64_t requested, bool cuda, int64_t max_num_batched_tokens);

}  // namespace kvserve
