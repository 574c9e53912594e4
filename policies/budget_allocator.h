#pragma once
// Budget allocation: how many tokens each layer keeps for a prompt (uniform, pyramid, dynamic's
// candidate sets), as window + scored counts.
#include <cstdint>
#include <vector>

#include "policies/policy_config.h"

namespace kvserve {

// What one layer keeps of a prompt: everything, or `window` trailing positions plus `scored`
// positions chosen by score from [0, prompt - cfg.window).
struct LayerBudget {
  bool full = true;
  int64_t window = 0;  // trailing positions kept unconditionally (<= cfg.window)
  int64_t scored = 0;  // positions kept by score
  int64_t kept(int64_t prompt_len) const { return full ? prompt_len : window + scored; }
};

// kvpress's kept count for a uniform layer: max(1, int(prompt * (1 - (1 - ratio)))) for a ratio
// (kvpress takes compression_ratio = 1 - ratio), else the token budget.
int64_t kvpress_kept_tokens(const PolicyConfig& cfg, int64_t prompt_len);
// The mean kept tokens per layer kvpress's PyramidKVPress starts from: prompt * (1 - (1 - ratio)),
// or the token budget.
double kvpress_kept_average(const PolicyConfig& cfg, int64_t prompt_len);

// A layer keeping `kept` tokens in total with the window inside it (kvpress: the window wins ties
// at the top of the score order, so a budget below the window keeps the window's first positions).
LayerBudget budget_with_window_inside(int64_t kept, int64_t window, int64_t prompt_len);

// DynamicKV's sizes for a prompt: base = B - window and bs = min(r_max * base, prompt - window).
struct DynamicSizes {
  int64_t base = 0;
  int64_t bs = 0;
};
DynamicSizes dynamic_sizes(const PolicyConfig& cfg, int64_t prompt_len);

// Per-layer budgets for a prompt. For the dynamic allocator these are the candidate sets
// (bs + window) that DynamicBudget later shrinks. Skipped layers and prompts no longer than the
// budget (or the window) are full.
std::vector<LayerBudget> allocate_layer_budgets(const PolicyConfig& cfg, int64_t prompt_len, int64_t num_layers);

// Kept counts per layer (window included) of allocate_layer_budgets.
std::vector<int64_t> kept_counts(const std::vector<LayerBudget>& budgets, int64_t prompt_len);

}  // namespace kvserve
