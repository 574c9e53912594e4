#include "backend/spec_decode/draft_verifier.h"

#include <algorithm>

#include "common/check.h"

namespace kvserve {

bool has_drafts(const DecodeBatch& batch) {
  for (size_t i = 1; i < batch.seq_ids.size(); ++i)
    if (batch.seq_ids[i] == batch.seq_ids[i - 1]) return true;
  return false;
}

RowRuns sequence_runs(const DecodeBatch& batch) {
  RowRuns r;
  for (size_t i = 0; i < batch.seq_ids.size(); ++i) {
    if (i > 0 && batch.seq_ids[i] == batch.seq_ids[i - 1]) {
      ++r.rows.back();
    } else {
      r.first.push_back(i);
      r.rows.push_back(1);
    }
  }
  return r;
}

VerifiedTokens verify_drafts(SamplerBank& samplers, const DecodeBatch& batch, const std::vector<int64_t>& tokens,
                             const torch::Tensor& logits, const std::vector<char>& ban_eos,
                             const std::vector<SampledDraft>& sampled) {
  const size_t R = batch.seq_ids.size();
  KV_CHECK(tokens.size() == R && ban_eos.size() == R && logits.dim() == 2 && logits.size(0) == static_cast<int64_t>(R) &&
               (sampled.empty() || sampled.size() == R),
           "internal: verifying " << R << " rows with " << tokens.size() << " tokens, " << ban_eos.size()
                                  << " flags, " << sampled.size() << " sampled drafts and logits " << logits.sizes());
  const RowRuns runs = sequence_runs(batch);
  const std::vector<size_t>& first = runs.first;
  const std::vector<size_t>& len = runs.rows;
  const size_t S = first.size();
  std::vector<std::vector<SampledToken>> emitted(S);
  std::vector<size_t> alive(S);
  for (size_t g = 0; g < S; ++g) alive[g] = g;
  for (size_t r = 0; !alive.empty(); ++r) {
    std::vector<int64_t> ids, rows;
    std::vector<char> ban;
    std::vector<const SampledDraft*> drafts;
    for (size_t g : alive) {
      const size_t row = first[g] + r;
      ids.push_back(batch.seq_ids[first[g]]);
      rows.push_back(static_cast<int64_t>(row));
      ban.push_back(ban_eos[row]);
      const bool drawn = !sampled.empty() && r + 1 < len[g] && sampled[row].token >= 0;
      KV_CHECK(!drawn || sampled[row].token == tokens[row + 1],
               "internal: row " << row << " verifies draft " << tokens[row + 1] << ", drawn as " << sampled[row].token);
      drafts.push_back(drawn ? &sampled[row] : nullptr);
    }
    const torch::Tensor sel =
        rows.size() == R ? logits : logits.index_select(0, torch::tensor(rows).to(logits.device()));
    std::vector<SampledToken> got = sampled.empty() ? samplers.sample_batch(ids, sel, ban)
                                                    : samplers.sample_batch(ids, sel, ban, drafts);
    std::vector<size_t> next;
    for (size_t j = 0; j < alive.size(); ++j) {
      const size_t g = alive[j];
      const size_t row = first[g] + r;
      const bool accepted = r + 1 < len[g] && !got[j].grammar_dead_end && got[j].token == tokens[row + 1];
      emitted[g].push_back(std::move(got[j]));
      if (accepted) next.push_back(g);
    }
    alive.swap(next);
  }
  VerifiedTokens out;
  for (size_t g = 0; g < S; ++g) {
    if (S < R) out.counts.push_back(static_cast<int64_t>(emitted[g].size()));
    for (auto& t : emitted[g]) out.tokens.push_back(std::move(t));
  }
  return out;
}

}  // namespace kvserve
