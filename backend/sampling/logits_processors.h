#pragma once
// The logit edits a request asks for (OpenAI's logit_bias, vLLM's allowed_token_ids and bad_words),
// applied by the sampler to a batch's fp32 logits on their device, before penalties and sampling.
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "backend/sampling/sampling_params.h"

namespace kvserve {

// Whether `p` asks for any logit edit.
bool has_logit_edits(const SamplingParams& p);

// One row of a batch to edit: its row in the logits, its params and the tokens it generated so far.
struct LogitEditRow {
  int64_t row = 0;
  const SamplingParams* params = nullptr;
  const std::vector<int64_t>* output = nullptr;
};

// Edits rows of fp32 `logits` [B, V] (contiguous, any device) in place, as vLLM does: with
// allowed_token_ids every other token is masked; logit_bias adds its values; a bad word's last token
// is masked where the output ends with the word's other tokens (a one-token word: always). Masked
// logits are -inf. Ids outside [0, V) are skipped (the HTTP edge refuses them).
void apply_logit_edits(torch::Tensor& logits, const std::vector<LogitEditRow>& rows);

// vLLM's token sequences for bad_words: each word with its leading whitespace stripped, and with one
// leading space as well when that encoding has as many tokens and a different first one (the word
// inside a text). Words that encode to nothing give no sequence.
std::vector<std::vector<int64_t>> bad_words_token_ids(
    const std::vector<std::string>& words, const std::function<std::vector<int64_t>(const std::string&)>& encode);

}  // namespace kvserve
