#pragma once
// KVzip's reconstruction scoring (Kim et al., 2025, arXiv 2505.23416; docs/eval/kvzip-notes.md):
// after a prompt's prefill has written its whole K/V, the model is fed a repeat prompt followed by the
// prompt's context again (teacher-forced, in chunks), attending to the cached K/V; each (layer, KV
// head, position) scores the most attention any query of the head's group gives it
// (policies/kvzip_scores.h keeps the books); then the policy's allocator selects and each layer is
// rewritten with what it keeps (KvMemory::select_by_scores).
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "cache_manager/kv_memory.h"
#include "policies/policy_config.h"

namespace kvserve {

class DecoderModel;

// The token ids a model's reconstruction passes start with, from its tokenizer and chat template
// (as kvpress's KVzipPress derives them): the repeat instruction of the first chunk and of the later
// ones (which then repeat the previous chunk's last `tail` tokens), the chat template's text between
// a user message and the assistant's answer, and the template's text before a user message
// (kvpress leaves that many leading prompt positions out of the reconstruction).
struct KvzipPrompts {
  std::vector<int64_t> first, later, suffix;
  int64_t prefix_len = 0;
  int64_t tail = 8;
};
// Built from <model_dir>'s tokenizer files, once per directory and semantics (cached).
const KvzipPrompts& kvzip_prompts(const std::string& model_dir, Semantics semantics);

// What one sequence's passes feed the model: for each chunk [start, stop) of the context, the ids
// (repeat prompt, the previous chunk's tail for later chunks, suffix, the chunk's tokens).
struct KvzipPass {
  int64_t start = 0, stop = 0;
  std::vector<int64_t> ids;
};
std::vector<KvzipPass> kvzip_passes(const KvzipPrompts& prompts, std::span<const int64_t> tokens, int64_t begin,
                                    int64_t end, int64_t chunk_size);

// Where a pass's hidden states come from and go to on a pipeline stage: the first stage embeds the
// pass's ids, a later one receives the previous stage's; a stage before the last sends its own on.
// Empty functions: a whole model (embed; nothing to send).
struct KvzipStageIo {
  std::function<torch::Tensor(const std::vector<int64_t>& ids)> input;
  std::function<void(const torch::Tensor& x)> output;
};

// Scores of every layer of `kv` for the prompt `tokens` (whose prefill wrote its whole K/V):
// fp32 [KV, prompt - window] per layer. The passes attend to positions [0, prompt - window) only, at
// positions after them, so the scores are a function of those tokens alone. In a sharded job every
// rank calls it together, each scoring its own layers and KV heads.
std::vector<torch::Tensor> kvzip_scores(DecoderModel& model, KvMemory& kv, int64_t seq_id, std::span<const int64_t> tokens,
                                        const PolicyConfig& cfg, const KvzipStageIo& io = {});

// kvzip_scores, then kv.select_by_scores.
void kvzip_score_and_select(DecoderModel& model, KvMemory& kv, int64_t seq_id, std::span<const int64_t> tokens,
                            const PolicyConfig& cfg, const KvzipStageIo& io = {});

}  // namespace kvserve
