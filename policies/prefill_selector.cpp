#include "policies/prefill_selector.h"

#include <algorithm>
#include <limits>

#include "common/check.h"
#include "policies/head_allocation.h"
#include "policies/pyramid_budget.h"
#include "policies/token_scorer.h"
#include "policies/top_select.h"

namespace kvserve {

namespace {
ScoreExchange& one_process() {
  static LocalScoreExchange exchange;
  return exchange;
}
}  // namespace

PrefillSelector::PrefillSelector(const PolicyConfig& cfg, int64_t num_layers, int64_t num_kv_heads,
                                 int64_t prompt_len)
    : cfg_(cfg), num_layers_(num_layers), num_kv_heads_(num_kv_heads), prompt_len_(prompt_len),
      exchange_(&one_process()) {
  KV_CHECK(num_layers >= 1, "PrefillSelector: num_layers must be >= 1, got " << num_layers);
  KV_CHECK(num_kv_heads >= 1, "PrefillSelector: num_kv_heads must be >= 1, got " << num_kv_heads);
  KV_CHECK(prompt_len >= 1, "PrefillSelector: prompt_len must be >= 1, got " << prompt_len);
  validate_policy_config(cfg_);
  scored_region_ = prompt_len - std::min(cfg_.window, prompt_len);
  plan_ = allocate_layer_budgets(cfg_, prompt_len, num_layers);
  compresses_ = std::any_of(plan_.begin(), plan_.end(), [](const LayerBudget& b) { return !b.full; });
  if (compresses_ && cfg_.allocator == AllocatorKind::kDynamic) {
    // DynamicKV re-budgets the layers it scores: on a model with sliding-window layers the global
    // ones alone, counted among themselves (its update interval, pooling and prior see a model of
    // the global layers).
    dyn_layers_ = cfg_.global_layers(num_layers);
    dyn_index_.assign(num_layers, -1);
    for (size_t j = 0; j < dyn_layers_.size(); ++j) dyn_index_[static_cast<size_t>(dyn_layers_[j])] = static_cast<int64_t>(j);
    const int64_t scored_layers = static_cast<int64_t>(dyn_layers_.size());
    const auto s = dynamic_sizes(cfg_, prompt_len);
    std::vector<int64_t> prior;
    if (cfg_.dynamic.prior == BudgetPrior::kPyramid) {
      const int64_t w = std::min(cfg_.window, prompt_len);
      for (int64_t kept : pyramid_budgets_paper(prompt_len, s.base + w, w, cfg_.beta, scored_layers)) {
        prior.push_back(std::max<int64_t>(0, kept - w));
      }
    }
    dynamic_.emplace(scored_layers, s.base, s.bs, cfg_.update_interval, scored_region_, cfg_.dynamic, std::move(prior));
    order_.resize(num_layers);
    head_scores_.resize(num_layers);
    kept_scored_.assign(num_layers, -1);
    kept_budget_.assign(num_layers, -1);
    held_.resize(num_layers);
    if (cfg_.head_adaptive()) {
      ada_scores_.resize(num_layers);
      ada_held_.resize(num_layers);
      ada_counts_.resize(num_layers);
    }
  }
}

torch::Tensor PrefillSelector::with_window(const torch::Tensor& scored_positions, int64_t window_kept,
                                           const torch::Device& dev) const {
  auto win = position_range(num_kv_heads_, scored_region_, window_kept, dev);
  if (scored_positions.size(1) == 0) return win;
  return torch::cat({scored_positions, win}, 1);
}

torch::Tensor PrefillSelector::on_layer(int64_t layer, const torch::Tensor& q, const torch::Tensor& k) {
  KV_CHECK(layer >= 0 && layer < num_layers_, "PrefillSelector: layer " << layer << " outside [0, " << num_layers_ << ")");
  KV_CHECK(layer > last_layer_, "PrefillSelector: layers must come in ascending order (got " << layer << " after "
                                                                                             << last_layer_ << ")");
  KV_CHECK(k.defined() && k.dim() == 3 && k.size(0) == num_kv_heads_ && k.size(1) == prompt_len_,
           "PrefillSelector: layer " << layer << " keys must be [" << num_kv_heads_ << ", " << prompt_len_
                                     << ", D], got " << (k.defined() ? k.sizes() : at::IntArrayRef{}));
  last_layer_ = layer;
  last_counts_.clear();
  const auto dev = k.device();
  const LayerBudget& lb = plan_[layer];
  if (lb.full) return position_range(num_kv_heads_, 0, prompt_len_, dev);
  if (scorer_needs_queries(cfg_.scorer)) {
    KV_CHECK(q.defined() && q.dim() == 3 && q.size(0) % num_kv_heads_ == 0,
             "PrefillSelector: layer " << layer << " needs queries [H, T, D] with H a multiple of " << num_kv_heads_);
  }
  if (dynamic_ && per_query_head()) {
    // Ranked per query head; a KV head's query heads travel side by side as one row [KV, G * N].
    auto hs = window_attention_head_scores(q, k, cfg_.window, cfg_.kernel, cfg_.pooling, /*mean_over_window=*/false);
    const int64_t d = dyn(layer);
    dynamic_->set_layer_scores(d, exchange_->gather_scores(layer, hs.reshape({num_kv_heads_, -1})));
    head_scores_[layer] = hs;
    auto kept = with_window(union_selection(layer, dynamic_->budgets()[d]), lb.window, dev);
    if (dynamic_->update_due_after(d)) apply_dynamic_budgets(dynamic_->update(d + 1));
    return kept;
  }
  return select_scored(layer, score_tokens(cfg_, layer, q, k), dev);  // scores [KV, prompt - window]
}

torch::Tensor PrefillSelector::on_layer_scores(int64_t layer, const torch::Tensor& scores) {
  KV_CHECK(layer >= 0 && layer < num_layers_, "PrefillSelector: layer " << layer << " outside [0, " << num_layers_ << ")");
  KV_CHECK(layer > last_layer_, "PrefillSelector: layers must come in ascending order (got " << layer << " after "
                                                                                             << last_layer_ << ")");
  KV_CHECK(!per_query_head(), "PrefillSelector: policy '" << cfg_.name << "' ranks per query head; it cannot take KV-head scores");
  KV_CHECK(scores.defined() && scores.dim() == 2 && scores.size(0) == num_kv_heads_ && scores.size(1) == scored_region_,
           "PrefillSelector: layer " << layer << " scores must be [" << num_kv_heads_ << ", " << scored_region_ << "], got "
                                     << (scores.defined() ? scores.sizes() : at::IntArrayRef{}));
  last_layer_ = layer;
  last_counts_.clear();
  const auto dev = scores.device();
  if (plan_[layer].full) return position_range(num_kv_heads_, 0, prompt_len_, dev);
  return select_scored(layer, scores.to(torch::kFloat32), dev);
}

torch::Tensor PrefillSelector::select_scored(int64_t layer, const torch::Tensor& scores, const torch::Device& dev) {
  const LayerBudget& lb = plan_[layer];
  if (!dynamic_) {
    if (cfg_.head_adaptive()) {
      return adaptive_selection(layer, exchange_->gather_scores(layer, scores), std::min(lb.scored, scored_region_),
                                lb.window);
    }
    return with_window(stable_top_positions(scores, std::min(lb.scored, scored_region_)), lb.window, dev);
  }

  // DynamicKV: keep the bs best as candidates in score order; budget from every KV head's scores.
  const torch::Tensor all = exchange_->gather_scores(layer, scores);
  const int64_t d = dyn(layer);
  dynamic_->set_layer_scores(d, all);
  if (cfg_.head_adaptive()) {
    // Head-adaptive candidates: the layer's bs per head on average, chosen jointly; a later
    // re-budget chooses again among them (apply_dynamic_budgets).
    ada_scores_[layer] = all;
    kept_scored_[layer] = std::min(dynamic_->budgets()[d], scored_region_);
    auto kept = adaptive_selection(layer, all, kept_scored_[layer], lb.window);
    const std::vector<int64_t> counts = last_counts_;  // re-selections of earlier layers overwrite it
    if (dynamic_->update_due_after(d)) apply_dynamic_budgets(dynamic_->update(d + 1));
    last_counts_ = counts;
    return kept;
  }
  order_[layer] = stable_rank_order(scores, std::min(dynamic_->budgets()[d], scored_region_));
  kept_scored_[layer] = order_[layer].size(1);
  auto kept = with_window(std::get<0>(torch::sort(order_[layer], 1)), lb.window, dev);
  if (dynamic_->update_due_after(d)) apply_dynamic_budgets(dynamic_->update(d + 1));
  return kept;
}

int64_t PrefillSelector::guaranteed(int64_t per_head, int64_t window) const {
  if (cfg_.semantics == Semantics::kKvpress) {
    // AdaKVPress protects each head's top int(alpha * kept) scores (at least one), the window
    // (scored above everything else) first: what is left of it guards scored positions.
    const int64_t kept = window + per_head;
    int64_t safe = static_cast<int64_t>(static_cast<double>(kept) * cfg_.alpha);
    if (cfg_.alpha > 0.0 && kept > 0) safe = std::max<int64_t>(1, safe);
    return std::clamp<int64_t>(safe - window, 0, per_head);
  }
  return std::min(per_head, static_cast<int64_t>(static_cast<double>(per_head) * cfg_.alpha));
}

torch::Tensor PrefillSelector::adaptive_selection(int64_t layer, const torch::Tensor& all, int64_t per_head,
                                                  int64_t window) {
  // One top-k over the whole layer: a shard holding some of the heads selects from every head's
  // scores, exactly as one process, and keeps its own rows.
  const int64_t first = all.size(0) == num_kv_heads_ ? 0 : exchange_->first_kv_head();
  KV_CHECK(first >= 0 && first + num_kv_heads_ <= all.size(0),
           "PrefillSelector: layer " << layer << ": KV heads [" << first << ", " << first + num_kv_heads_
                                     << ") outside the " << all.size(0) << " gathered");
  HeadSelection sel = adaptive_head_selection(all, per_head, guaranteed(per_head, window), window);
  last_counts_.assign(sel.counts.begin() + first, sel.counts.begin() + first + num_kv_heads_);
  if (dynamic_) {
    ada_held_[layer] = sel.kept.narrow(1, 0, all.size(1));
    ada_counts_[layer] = last_counts_;
  }
  const int64_t width = *std::max_element(last_counts_.begin(), last_counts_.end());
  return sel.positions.narrow(0, first, num_kv_heads_).narrow(1, 0, width).contiguous();
}

std::vector<int64_t> PrefillSelector::head_counts(int64_t layer) const {
  if (layer < 0 || layer >= static_cast<int64_t>(ada_counts_.size())) return {};
  return ada_counts_[static_cast<size_t>(layer)];
}

void PrefillSelector::apply_dynamic_budgets(const std::vector<int64_t>& new_budgets) {
  const int64_t n = static_cast<int64_t>(new_budgets.size());
  for (int64_t j = 0; j < n; ++j) {
    const int64_t i = dyn_layers_[static_cast<size_t>(j)];  // the model layer of scored layer j
    torch::Tensor kept;
    if (per_query_head()) {
      const auto& hs = head_scores_[i];
      if (!hs.defined() || new_budgets[j] >= kept_budget_[i]) continue;  // not local, or unchanged
      kept = with_window(union_selection(i, new_budgets[j]), plan_[i].window, hs.device());
    } else if (cfg_.head_adaptive()) {
      const auto& all = ada_scores_[i];
      if (!all.defined() || new_budgets[j] >= kept_scored_[i]) continue;  // not local, or unchanged
      // The same joint choice among what the layer holds: a subset of it, each head's safeguard
      // recomputed for the smaller share.
      constexpr float kLow = -std::numeric_limits<float>::infinity();
      const auto held = ada_held_[i];
      kept_scored_[i] = new_budgets[j];
      kept = adaptive_selection(i, all.to(torch::kFloat32).masked_fill(held.logical_not(), kLow), new_budgets[j],
                                plan_[i].window);
    } else {
      const auto& ord = order_[i];
      if (!ord.defined() || new_budgets[j] >= ord.size(1)) continue;  // not local, or unchanged
      order_[i] = ord.narrow(1, 0, new_budgets[j]);
      kept_scored_[i] = new_budgets[j];
      kept = with_window(std::get<0>(torch::sort(order_[i], 1)), plan_[i].window, ord.device());
    }
    auto it = std::find_if(pending_.begin(), pending_.end(), [i](const auto& p) { return p.first == i; });
    if (it != pending_.end()) {
      it->second = kept;
    } else {
      pending_.emplace_back(i, kept);
    }
  }
  std::sort(pending_.begin(), pending_.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
}

namespace {
// Which positions of each KV head some query head ranks in its top b: rows [KV * G, N] -> [KV, N].
torch::Tensor union_mask(const torch::Tensor& rows, int64_t groups, int64_t b) {
  auto mask = torch::zeros(rows.sizes(), rows.options().dtype(torch::kBool));
  if (b > 0) mask.scatter_(1, stable_rank_order(rows, b), true);
  return mask.view({-1, groups, rows.size(1)}).any(1);
}
}  // namespace

int64_t PrefillSelector::union_width(int64_t layer, int64_t b) const {
  b = std::min(b, scored_region_);
  if (b <= 0) return 0;
  const auto& all = dynamic_->layer_scores(dyn(layer));  // [every KV head, G * N]
  const int64_t groups = all.size(1) / scored_region_;
  return union_mask(all.reshape({-1, scored_region_}), groups, b).sum(1).max().item<int64_t>();
}

torch::Tensor PrefillSelector::union_selection(int64_t layer, int64_t b) {
  const auto& hs = head_scores_[layer];  // [local KV * G, N]
  const int64_t groups = hs.size(0) / num_kv_heads_;
  b = std::min(b, scored_region_);
  const int64_t width = union_width(layer, b);
  kept_scored_[layer] = width;
  kept_budget_[layer] = b;
  // The union ranks first (+inf); the padding is the KV head's next best by its query heads' mean,
  // among the positions still held (a re-selection keeps a subset of what the layer holds).
  constexpr float kInf = std::numeric_limits<float>::infinity();
  auto ranked = hs.view({num_kv_heads_, groups, scored_region_}).mean(1);
  if (held_[layer].defined()) ranked = ranked.masked_fill(held_[layer].logical_not(), -kInf);
  ranked = ranked.masked_fill(union_mask(hs, groups, b), kInf);
  auto order = stable_rank_order(ranked, width);
  held_[layer] = torch::zeros(ranked.sizes(), ranked.options().dtype(torch::kBool)).scatter_(1, order, true);
  return std::get<0>(torch::sort(order, 1));
}

std::vector<std::pair<int64_t, torch::Tensor>> PrefillSelector::take_updates() {
  std::vector<std::pair<int64_t, torch::Tensor>> out;
  out.swap(pending_);
  return out;
}

void PrefillSelector::finish() {
  if (!dynamic_) return;
  if (auto nb = dynamic_->final_update()) apply_dynamic_budgets(*nb);
}

std::vector<int64_t> PrefillSelector::budgets() const {
  auto out = kept_counts(plan_, prompt_len_);
  if (dynamic_) {
    for (int64_t l = 0; l < num_layers_; ++l) {
      if (plan_[l].full) continue;
      int64_t scored = dynamic_->budgets()[dyn(l)];
      // Head-adaptive: what the layer's heads hold on average (an earlier pipeline stage shrinks
      // to the last stage's final budgets without updating its own schedule).
      if (cfg_.head_adaptive() && kept_scored_[l] >= 0) scored = std::min(scored, kept_scored_[l]);
      if (per_query_head()) {
        // The union a layer holds (or would hold, for another shard's layer whose scores are here).
        // Before its scores are known a layer's union is bounded only by the scored region.
        if (kept_scored_[l] >= 0) {
          scored = kept_scored_[l];
        } else if (dynamic_->has_layer_scores(dyn(l))) {
          scored = union_width(l, scored);
        } else {
          scored = scored_region_;
        }
      }
      out[l] = plan_[l].window + scored;
    }
  }
  return out;
}

torch::Tensor PrefillSelector::layer_scores(int64_t layer) const {
  KV_CHECK(dynamic_.has_value(), "PrefillSelector::layer_scores: policy '" << cfg_.name << "' is not DynamicKV");
  return dynamic_->layer_scores(dyn(layer));
}

void PrefillSelector::import_layer_scores(int64_t layer, const torch::Tensor& scores) {
  KV_CHECK(dynamic_.has_value(), "PrefillSelector::import_layer_scores: policy '" << cfg_.name << "' is not DynamicKV");
  const int64_t rows = per_query_head() ? scores.size(1) / std::max<int64_t>(1, scored_region_) : 1;
  KV_CHECK(scores.dim() == 2 && scores.size(1) == rows * scored_region_ && rows >= 1,
           "PrefillSelector::import_layer_scores: scores must be [heads, " << (per_query_head() ? "G * " : "")
                                                                          << scored_region_ << "], got " << scores.sizes());
  dynamic_->set_layer_scores(dyn(layer), scores);
}

void PrefillSelector::replay_layer(int64_t layer, const torch::Tensor& scores) {
  KV_CHECK(layer > last_layer_, "PrefillSelector: layers must come in ascending order (got " << layer << " after "
                                                                                             << last_layer_ << ")");
  import_layer_scores(layer, scores);
  last_layer_ = layer;
  const int64_t d = dyn(layer);
  if (dynamic_->update_due_after(d)) apply_dynamic_budgets(dynamic_->update(d + 1));
}

int64_t PrefillSelector::dyn(int64_t layer) const {
  const int64_t d = layer >= 0 && layer < static_cast<int64_t>(dyn_index_.size()) ? dyn_index_[layer] : -1;
  KV_CHECK(d >= 0, "PrefillSelector: layer " << layer << " is not one DynamicKV budgets (a sliding-window layer keeps "
                                             << "its window)");
  return d;
}

std::vector<int64_t> PrefillSelector::dynamic_budgets() const {
  KV_CHECK(dynamic_.has_value(), "PrefillSelector::dynamic_budgets: policy '" << cfg_.name << "' is not DynamicKV");
  std::vector<int64_t> out(static_cast<size_t>(num_layers_), -1);
  for (size_t j = 0; j < dyn_layers_.size(); ++j) out[static_cast<size_t>(dyn_layers_[j])] = dynamic_->budgets()[j];
  return out;
}

void PrefillSelector::apply_final_budgets(const std::vector<int64_t>& scored) {
  KV_CHECK(dynamic_.has_value(), "PrefillSelector::apply_final_budgets: policy '" << cfg_.name << "' is not DynamicKV");
  KV_CHECK(static_cast<int64_t>(scored.size()) == num_layers_,
           "PrefillSelector::apply_final_budgets: " << scored.size() << " budgets for " << num_layers_ << " layers");
  std::vector<int64_t> compact;
  for (int64_t l : dyn_layers_) compact.push_back(scored[static_cast<size_t>(l)]);
  apply_dynamic_budgets(compact);
}

}  // namespace kvserve
