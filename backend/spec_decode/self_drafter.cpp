#include "backend/spec_decode/self_drafter.h"

#include <algorithm>

#include "backend/model/decoder_model.h"
#include "backend/spec_decode/draft_verifier.h"
#include "common/check.h"

namespace kvserve {

void choose_drafts(const torch::Tensor& logits, const DecodeBatch& step, const std::vector<size_t>& rows,
                   std::vector<int64_t>& chosen, SamplerBank* samplers, std::vector<SampledDraft>* sampled) {
  std::vector<char> drawn(rows.size(), 0);  // rows whose sequence samples: drafts drawn from q
  if (samplers != nullptr)
    for (size_t k = 0; k < rows.size(); ++k) drawn[k] = samplers->samples(step.seq_ids[k]);
  if (std::find(drawn.begin(), drawn.end(), 1) != drawn.end()) {
    const torch::Tensor host = logits.to(torch::kCPU, torch::kFloat32).contiguous();
    const int64_t V = host.size(1);
    for (size_t k = 0; k < rows.size(); ++k) {
      const float* row = host.data_ptr<float>() + static_cast<int64_t>(k) * V;
      if (drawn[k]) {
        SampledDraft d = samplers->draft(step.seq_ids[k], row, V);
        chosen[k] = d.token;
        (*sampled)[rows[k] - 1] = std::move(d);
      } else {
        chosen[k] = std::max_element(row, row + V) - row;  // the first maximum, as argmax
      }
    }
    return;
  }
  const torch::Tensor best = logits.argmax(-1).to(torch::kCPU).to(torch::kInt64).contiguous();
  const int64_t* b = best.data_ptr<int64_t>();
  for (size_t k = 0; k < rows.size(); ++k) chosen[k] = b[k];
}

int64_t draft_with_own_kv(DecoderModel& model, KvMemory& kv, const DecodeBatch& batch, const DraftView& view,
                          std::vector<int64_t>& tokens, SamplerBank* samplers, std::vector<SampledDraft>* sampled) {
  DraftStepFns fns;
  fns.forward = [&](const DecodeBatch& step, const std::vector<int64_t>& in) { return model.decode(step, in, kv); };
  return draft_steps(fns, kv, batch, view, tokens, samplers, sampled);
}

int64_t draft_steps(const DraftStepFns& fns, KvMemory& kv, const DecodeBatch& batch, const DraftView& view,
                    std::vector<int64_t>& tokens, SamplerBank* samplers, std::vector<SampledDraft>* sampled) {
  const size_t R = batch.seq_ids.size();
  KV_CHECK(tokens.size() == R && batch.positions.size() == R && (samplers == nullptr) == (sampled == nullptr),
           "internal: self-drafting " << R << " rows with " << tokens.size() << " tokens");
  if (sampled != nullptr) sampled->assign(R, SampledDraft{});
  // Each sequence's first row and how many drafts follow it.
  auto [first, drafts] = sequence_runs(batch);
  for (size_t& d : drafts) --d;
  const size_t most = drafts.empty() ? 0 : *std::max_element(drafts.begin(), drafts.end());
  for (size_t j = 0; j < most; ++j) {
    DecodeBatch step;
    step.view = view;
    step.draft = true;
    std::vector<int64_t> in;
    std::vector<size_t> rows;
    for (size_t g = 0; g < first.size(); ++g) {
      if (drafts[g] <= j) continue;
      const size_t row = first[g] + j;
      step.seq_ids.push_back(batch.seq_ids[row]);
      step.positions.push_back(batch.positions[row]);
      in.push_back(tokens[row]);
      rows.push_back(row + 1);
    }
    const torch::Tensor logits = fns.forward(step, in);
    std::vector<int64_t> chosen(rows.size(), 0);
    if (logits.defined()) choose_drafts(logits, step, rows, chosen, samplers, sampled);
    if (fns.share) fns.share(chosen);
    for (size_t k = 0; k < rows.size(); ++k) tokens[rows[k]] = chosen[k];
  }
  for (size_t g = 0; g < first.size(); ++g)
    if (drafts[g] > 0) kv.truncate(batch.seq_ids[first[g]], static_cast<int64_t>(drafts[g]));
  return static_cast<int64_t>(most);
}

}  // namespace kvserve
