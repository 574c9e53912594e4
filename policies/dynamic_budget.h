#pragma once
// DynamicKV (Algorithm 1) cross-layer re-budgeting: pooled scores of the layers seen so far decide
// how many scored tokens each layer keeps.
#include <cstdint>
#include <optional>
#include <vector>

#include <torch/torch.h>

#include "policies/policy_config.h"

namespace kvserve {

// Hits per layer of the global top-k over the concatenated scores of `layer_scores` (each
// [heads, N], same shape), ties broken by the lower flat index (layer, then head, then position).
std::vector<int64_t> dynamic_topk_hits(const std::vector<torch::Tensor>& layer_scores, int64_t k);

// One Update_Buffer_Length step in exact integer arithmetic. hits: per layer seen so far (n of
// them). c_i = hits_i // n (hits itself if all c are 0); b_i = (bs * c_i) // sum(c);
// b_i = (b_i * base * L) // sum(b) with the remainder added to the last seen layer (uniform split if
// sum(b) == 0); then b_i = min(b_i, cap, current_i) (budgets only shrink). Returns scored-token
// budgets (window excluded) of the n layers.
std::vector<int64_t> dynamic_rebudget(const std::vector<int64_t>& hits, int64_t bs, int64_t base,
                                      int64_t num_layers, int64_t cap, const std::vector<int64_t>& current);

// The variants' shaping of one update's budgets (layers [0, n) of L): a per-layer minimum of
// min_ratio * base taken from the layers above it in proportion, then a mix
// w * b + (1 - w) * prior (prior: scored budgets of all L layers, empty = none). Integer results.
std::vector<int64_t> dynamic_shape(std::vector<int64_t> b, const DynamicOptions& opts, int64_t base,
                                   const std::vector<int64_t>& prior);

// Scores of one layer scaled as `norm` says, `cap` positions a ranking row ([rows, cap] view); kth:
// the rank that ScoreNorm::kKth scales to 1 (1-based).
torch::Tensor normalize_scores(const torch::Tensor& scores, ScoreNorm norm, int64_t cap, int64_t kth = 1);

// The state of DynamicKV budgets for one sequence: per-layer scored budgets (window excluded) and
// the pooled per-layer scores they are computed from: every KV head's (a shard holding only some
// heads gets the others' through its ScoreExchange), so budgets come out the same on every shard.
class DynamicBudget {
 public:
  // base = B - window, bs = min(r_max * base, prompt - window), m = update interval. cap: scored
  // positions per ranking row (prompt - window); a layer's scores are [heads, rows_per_head * cap]
  // (variant=authors: a KV head's query heads side by side). prior: scored budgets per layer for
  // BudgetPrior::kPyramid (empty otherwise).
  // cap 0: the width of the first scores set (one row per head).
  DynamicBudget(int64_t num_layers, int64_t base, int64_t bs, int64_t update_interval, int64_t cap = 0,
                DynamicOptions opts = {}, std::vector<int64_t> prior = {});

  int64_t num_layers() const { return num_layers_; }
  int64_t base() const { return base_; }
  int64_t candidates() const { return bs_; }
  // True when an update runs right after `layer` (0-based): (layer + 1) % m == 0.
  bool update_due_after(int64_t layer) const { return (layer + 1) % m_ == 0; }
  // True when finish() still owes the final update (num_layers % m != 0).
  // variant=authors never re-budgets the last num_layers % m layers (they keep bs).
  bool final_update_due() const {
    return num_layers_ % m_ != 0 && !final_done_ && opts_.variant != DynamicVariant::kAuthors;
  }

  // Pooled scores of `layer` [heads, N] (fp32, kept on their device).
  void set_layer_scores(int64_t layer, torch::Tensor scores);
  bool has_layer_scores(int64_t layer) const;
  const torch::Tensor& layer_scores(int64_t layer) const;

  // Re-budgets layers [0, n) from their (normalised) scores (k = base * ranking rows * n) and returns
  // their new budgets.
  std::vector<int64_t> update(int64_t n);
  // The final update over all layers when num_layers % m != 0; std::nullopt when not due.
  std::optional<std::vector<int64_t>> final_update();

  // Scored-token budget per layer (bs until an update shrinks it).
  const std::vector<int64_t>& budgets() const { return budgets_; }

 private:
  int64_t num_layers_, base_, bs_, m_, cap_;
  DynamicOptions opts_;
  std::vector<int64_t> prior_;
  bool final_done_ = false;
  std::vector<int64_t> budgets_;
  std::vector<torch::Tensor> scores_, normed_;
};

}  // namespace kvserve
