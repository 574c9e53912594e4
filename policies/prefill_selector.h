#pragma once
// PrefillSelector: per-sequence, layer-by-layer choice of the prompt positions each layer keeps.
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "policies/budget_allocator.h"
#include "policies/dynamic_budget.h"
#include "policies/policy_config.h"
#include "policies/score_exchange.h"

namespace kvserve {

// Drives one sequence's prefill: call on_layer for each layer in ascending order, apply
// take_updates() after each call (DynamicKV shrinks earlier layers), then finish() and
// take_updates() once more. Device-agnostic: outputs live on the keys' device.
class PrefillSelector {
 public:
  PrefillSelector(const PolicyConfig& cfg, int64_t num_layers, int64_t num_kv_heads, int64_t prompt_len);

  // Kept positions of `layer`, int64 [KV, n_l] sorted ascending per head, the window included. For
  // a full layer: every position. For DynamicKV: the candidate set (bs + window). q [H, Tq, D]
  // post-RoPE (the last `window` rows are enough for window attention; accumulated attention needs
  // all T rows; other scorers ignore it and accept an undefined tensor), k [KV, T, D] post-RoPE.
  torch::Tensor on_layer(int64_t layer, const torch::Tensor& q, const torch::Tensor& k);
  // on_layer with the layer's scores given ([KV, prompt - window] fp32, higher = keep) instead of
  // computed from q and k: a scorer that runs after the prefill (kvzip's reconstruction) drives the
  // same allocators (uniform, pyramid, dynamic; head_budgets uniform or adaptive).
  torch::Tensor on_layer_scores(int64_t layer, const torch::Tensor& scores);
  // With head_budgets=adaptive the heads of a layer keep different numbers of positions: what the
  // last on_layer kept per KV head (its result's first counts[h] entries of row h are real, the rest
  // padding), empty when every head kept the whole row.
  const std::vector<int64_t>& last_head_counts() const { return last_counts_; }
  // The same for a layer take_updates() returned (DynamicKV re-selecting a head-adaptive layer).
  std::vector<int64_t> head_counts(int64_t layer) const;

  // Re-selections of earlier layers since the last call: (layer, kept positions [KV, n] that are a
  // subset of what that layer held), ascending by layer, at most one entry per layer.
  std::vector<std::pair<int64_t, torch::Tensor>> take_updates();

  // Runs DynamicKV's final update when num_layers % m != 0 (idempotent); call take_updates after.
  void finish();

  // Kept counts per layer (window included) as they stand now (final after finish()).
  std::vector<int64_t> budgets() const;

  // False when every layer keeps the whole prompt (nothing to score or drop).
  bool compresses() const { return compresses_; }
  bool is_dynamic() const { return dynamic_.has_value(); }

  // Where DynamicKV gets every KV head's scores of a layer when this shard holds only some of the
  // heads (default: the one-process exchange, which passes them through). Must outlive the selector.
  void set_exchange(ScoreExchange& exchange) { exchange_ = &exchange; }
  // DynamicKV's pooled scores of `layer` as used for budgeting (every KV head's).
  torch::Tensor layer_scores(int64_t layer) const;
  // Layers split across shards: scores of a layer this selector never sees (another shard holds
  // it), [all KV heads, T - w].
  void import_layer_scores(int64_t layer, const torch::Tensor& scores);
  // Layers split across shards: an earlier shard's layer, in layer order with on_layer: imports its
  // scores and runs the DynamicKV update due after it, exactly as if the layer had been seen here.
  void replay_layer(int64_t layer, const torch::Tensor& scores);
  // DynamicKV scored budgets per layer (window excluded) as they stand; -1 for a layer it does not
  // budget (a sliding-window layer, which keeps its window).
  std::vector<int64_t> dynamic_budgets() const;
  // Layers split across shards: the final DynamicKV budgets the shard holding the last layer
  // computed (scored, window excluded; budgets only shrink, so the final ones decide). Layers seen
  // here shrink to them; call take_updates after.
  void apply_final_budgets(const std::vector<int64_t>& scored);

  const PolicyConfig& config() const { return cfg_; }
  const std::vector<LayerBudget>& layer_budgets() const { return plan_; }

 private:
  // The selection of on_layer once the layer's scores are known.
  torch::Tensor select_scored(int64_t layer, const torch::Tensor& scores, const torch::Device& dev);
  torch::Tensor with_window(const torch::Tensor& scored_positions, int64_t window_kept, const torch::Device& dev) const;
  void apply_dynamic_budgets(const std::vector<int64_t>& new_budgets);
  bool per_query_head() const { return cfg_.dynamic.variant == DynamicVariant::kAuthors; }
  // variant=authors: the scored positions each local KV head keeps for a budget of b per query head:
  // the union of its query heads' top b, padded with the KV head's next best (by the mean of its
  // query heads' scores) to the widest union over every KV head (so all shards keep the same count).
  torch::Tensor union_selection(int64_t layer, int64_t b);
  // variant=authors: the widest union over every KV head of `layer` for b per query head.
  int64_t union_width(int64_t layer, int64_t b) const;

  // head_budgets=adaptive: a layer's kept positions chosen jointly over every KV head's scores
  // `all` (gathered across tensor-parallel shards; -inf where a head no longer holds a position),
  // per_head scored positions per head on average plus the window; this shard's rows returned and
  // their counts recorded for the layer.
  torch::Tensor adaptive_selection(int64_t layer, const torch::Tensor& all, int64_t per_head, int64_t window);
  int64_t guaranteed(int64_t per_head, int64_t window) const;

  PolicyConfig cfg_;
  int64_t num_layers_, num_kv_heads_, prompt_len_;
  std::vector<int64_t> last_counts_;
  // head_budgets=adaptive with DynamicKV: per layer every KV head's scores and what the layer holds
  // ([all KV, N]), and each pending update's per-head counts.
  std::vector<torch::Tensor> ada_scores_, ada_held_;
  std::vector<std::vector<int64_t>> ada_counts_;
  int64_t scored_region_;  // prompt - window: positions that are ranked
  bool compresses_ = false;
  int64_t last_layer_ = -1;
  std::vector<LayerBudget> plan_;
  std::optional<DynamicBudget> dynamic_;
  // DynamicKV budgets the layers it scores (all but a model's sliding-window layers) as a model of
  // those layers alone: dyn_layers_ lists them, dyn_index_ maps a model layer to its place (-1: not
  // scored), dyn() checks and maps.
  std::vector<int64_t> dyn_layers_, dyn_index_;
  int64_t dyn(int64_t layer) const;
  std::vector<torch::Tensor> order_;  // DynamicKV: per layer [KV, budget] positions in score order
  std::vector<torch::Tensor> head_scores_;  // variant=authors: per local layer [local KV * G, N]
  std::vector<int64_t> kept_scored_;        // DynamicKV: scored positions a layer holds now (-1: unknown)
  std::vector<int64_t> kept_budget_;        // variant=authors: the per-query-head budget a layer was selected with
  std::vector<torch::Tensor> held_;         // variant=authors: per local layer [local KV, N], positions held
  std::vector<std::pair<int64_t, torch::Tensor>> pending_;
  ScoreExchange* exchange_;
};

}  // namespace kvserve
