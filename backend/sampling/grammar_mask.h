#pragma once
// GrammarMasks: the grammar matchers of the sequences a sampler serves (one per sequence of a
// structured-output request) and the per-step token mask they put on the logits.
#include <torch/torch.h>

#include <cstdint>
#include <future>
#include <memory>
#include <unordered_map>
#include <vector>

#include "backend/sampling/grammar_compiler.h"

namespace xgrammar {
class GrammarMatcher;
}

namespace kvserve {

class GrammarMasks {
 public:
  GrammarMasks();
  ~GrammarMasks();
  GrammarMasks(GrammarMasks&&) noexcept;
  GrammarMasks& operator=(GrammarMasks&&) noexcept;

  void add(int64_t seq_id, std::shared_ptr<const StructuredGrammar> grammar);
  void remove(int64_t seq_id);
  // Whether any of these sequences is constrained (then apply() writes into the logits).
  bool any(const std::vector<int64_t>& seq_ids) const;
  // Starts computing the masks of these sequences' next tokens on a worker thread, so that it runs
  // beside the model's forward; apply() with the same ids uses it.
  void prepare(const std::vector<int64_t>& seq_ids);
  // Sets row i of fp32 logits [B, V] (any device; written in place) to -inf wherever seq_ids[i]'s
  // grammar forbids the token. Returns per row whether the grammar allows no token at all (with
  // its stop tokens not allowed either where ban_eos[i]): a dead end, whose sampled token is void.
  std::vector<char> apply(const std::vector<int64_t>& seq_ids, torch::Tensor& logits, const std::vector<char>& ban_eos);
  // Advances the matchers of the rows that are not dead with the sampled tokens; a token the
  // grammar refuses (it cannot be, after apply) marks its row dead too.
  void accept(const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& tokens, std::vector<char>& dead);

 private:
  // One sequence's matcher and the grammar it runs.
  struct Entry {
    std::shared_ptr<const StructuredGrammar> grammar;
    std::unique_ptr<xgrammar::GrammarMatcher> matcher;
  };
  // Host bitmasks [rows, words] of the constrained rows of one batch.
  struct Masks {
    std::vector<int64_t> seq_ids;  // the batch they were computed for
    std::vector<int64_t> rows;     // constrained rows of that batch
    std::vector<int32_t> bits;     // rows.size() x words
    std::vector<char> terminated;  // per constrained row: the matcher had already ended
    int64_t words = 0;
  };
  Masks compute(const std::vector<int64_t>& seq_ids);

  std::unordered_map<int64_t, Entry> entries_;
  std::future<Masks> pending_;
};

}  // namespace kvserve
