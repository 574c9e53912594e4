#pragma once
// Prompt-lookup drafts (vLLM's "ngram" method): the tokens that followed the latest earlier
// occurrence of the sequence's last n tokens, in its prompt and output. No model, no KV: it costs
// a scan of the sequence's tokens on the host.
#include <cstdint>
#include <span>
#include <vector>

namespace kvserve {

// Up to k tokens proposed after the sequence prompt ++ output: for n from max_n down to min_n, the
// latest occurrence of its last n tokens that ends before them is looked up, and the tokens that
// followed it are the draft (fewer than k where the sequence ends first). Empty: no match.
std::vector<int64_t> propose_ngram(std::span<const int64_t> prompt, std::span<const int64_t> output, int64_t k,
                                   int64_t min_n, int64_t max_n);

}  // namespace kvserve
