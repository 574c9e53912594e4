#pragma once
// Self-speculative drafts: the target model itself proposes a sequence's next tokens, attending
// through a compressed view of the sequence's own paged KV (sinks + recent window) instead of all of
// it, so that a draft step reads little KV while the verify step reads everything.
#include <cstdint>
#include <functional>
#include <vector>

#include "backend/sampling/sampler.h"
#include "cache_manager/kv_memory.h"

namespace kvserve {

class DecoderModel;

// Fills the draft rows of a speculative decode batch (a sequence's last token followed by rows whose
// tokens are placeholders): draft step j decodes, for every sequence with more than j drafts, its
// token of row j at that row's position through `view`, and row j + 1 gets the greedy token of its
// logits. What the draft steps appended to the cache is truncated before returning, so the verify
// step then appends every row again with full attention. tokens: one per batch row, drafts
// overwritten. Throws what a decode step throws (the caller's failed-step path releases the KV).
// Returns the draft steps it ran (the most drafts any sequence had).
//
// sampled (draft_sampling "sample"): a sampling sequence's drafts are drawn from its draft logits
// (SamplerBank::draft) instead of taken as their argmax; sampled is resized to the batch's rows and
// its entry at row r holds the draft put at row r + 1 with the distribution it came from (token < 0:
// an argmax draft). Null: every draft is an argmax.
int64_t draft_with_own_kv(DecoderModel& model, KvMemory& kv, const DecodeBatch& batch, const DraftView& view,
                          std::vector<int64_t>& tokens, SamplerBank* samplers = nullptr,
                          std::vector<SampledDraft>* sampled = nullptr);

// A draft step's tokens from its logits [rows.size(), V] (row k: the sequence step.seq_ids[k]): the
// argmax, or with a sampler bank a draw from a sampling sequence's draft distribution, recorded in
// sampled at rows[k] - 1 (rows: the batch rows the drafts go to).
void choose_drafts(const torch::Tensor& logits, const DecodeBatch& step, const std::vector<size_t>& rows,
                   std::vector<int64_t>& chosen, SamplerBank* samplers, std::vector<SampledDraft>* sampled);

// The same loop where one step's forward spans processes (a tensor x pipeline parallel job: every
// rank runs every draft step on its shard). forward runs a draft step and returns its fp32 logits
// [rows, V] on the one rank that chooses the drafts (the sampler rank), an undefined tensor on the
// others; share then gives every rank the drafts that rank chose (the same vector on return;
// in-out, one token per step row). samplers / sampled: on the choosing rank only, as above.
struct DraftStepFns {
  std::function<torch::Tensor(const DecodeBatch& step, const std::vector<int64_t>& tokens)> forward;
  std::function<void(std::vector<int64_t>& chosen)> share;
};
int64_t draft_steps(const DraftStepFns& fns, KvMemory& kv, const DecodeBatch& batch, const DraftView& view,
                    std::vector<int64_t>& tokens, SamplerBank* samplers = nullptr,
                    std::vector<SampledDraft>* sampled = nullptr);

}  // namespace kvserve
