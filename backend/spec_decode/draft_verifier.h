#pragma once
// Verification of a speculative decode step: the target model's logits at a sequence's last token
// and at each of its draft tokens, turned into the tokens it emits.
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "backend/sampling/sampler.h"
#include "cache_manager/kv_memory.h"

namespace kvserve {

// What a decode step's sequences emitted: tokens sequence after sequence, counts per sequence
// (empty for a step without drafts: one token per row).
struct VerifiedTokens {
  std::vector<SampledToken> tokens;
  std::vector<int64_t> counts;
};

// Whether a decode batch carries drafts (some sequence in several consecutive rows).
bool has_drafts(const DecodeBatch& batch);

// A decode batch's sequences as runs of consecutive rows: each run's first row and its row count
// (the last token, then the drafts).
struct RowRuns {
  std::vector<size_t> first, rows;
};
RowRuns sequence_runs(const DecodeBatch& batch);

// Samples a speculative step row by row as plain decoding would sample its tokens one per step:
// round r samples row r of every sequence still verifying (with its sampler state as the accepted
// tokens left it: penalties, grammar, RNG stream); the sampled token is emitted, and the sequence
// goes on to its next row only when that token equals its next draft (tokens[row + 1]). A draft
// proposer that proposes one token (prompt lookup) is deterministic, so "sample, then compare" is
// exactly rejection sampling with a one-hot draft distribution: every emitted token is distributed
// as plain decoding's, and with a seeded request it is the same token (one uniform per emitted
// token, as plain decoding draws). logits: fp32 [rows, V] of the batch's rows; ban_eos per row.
// A step without drafts is one sample_batch of every row.
//
// sampled (self-drafts with draft_sampling "sample"): per batch row, the draft that row's logits
// verify (the token of the next row) when it was drawn from a distribution q rather than chosen as
// an argmax; a sampling sequence's row then keeps it by speculative sampling (min(1, p / q), else a
// draw from max(0, p - q)), so more drafts are kept at temperature > 0 and every emitted token is
// still distributed as plain decoding's, though a seeded request no longer draws plain decoding's
// tokens. Empty: every draft is one-hot.
VerifiedTokens verify_drafts(SamplerBank& samplers, const DecodeBatch& batch, const std::vector<int64_t>& tokens,
                             const torch::Tensor& logits, const std::vector<char>& ban_eos,
                             const std::vector<SampledDraft>& sampled = {});

}  // namespace kvserve
