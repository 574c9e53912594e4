#pragma once
// PyramidKV layer budgets: the authors' integer arithmetic (paper) and kvpress's float variant.
#include <cstdint>
#include <vector>

namespace kvserve {

// Kept tokens per layer, window included, the way the PyramidKV authors compute them (docs/architecture.md, "The methods' arithmetic"):
// A = budget - window, min = A // beta, max = 2A - min; if max >= prompt - window then
// max = prompt - window, min = 2A - max; steps = (max - min) // (L - 1); layer l keeps
// max - l*steps scored tokens plus the window. prompt <= budget: every layer keeps the whole prompt;
// prompt < 2A: every layer keeps A + window. L == 1 keeps A + window (the authors divide by zero).
std::vector<int64_t> pyramid_budgets_paper(int64_t prompt_len, int64_t budget, int64_t window, int64_t beta,
                                           int64_t num_layers);

// kvpress PyramidKVPress.get_layer_budget: `kept_avg` is the mean kept tokens per layer, window
// included (q_len * (1 - compression_ratio) there); float steps and round-half-to-even, and a uniform
// max(1, round(kept_avg)) whenever !(prompt >= max >= min >= window). Kept counts include the window.
std::vector<int64_t> pyramid_budgets_kvpress(int64_t prompt_len, double kept_avg, int64_t window, int64_t beta,
                                             int64_t num_layers);

// Python's a // b for integers (floor division).
int64_t floor_div(int64_t a, int64_t b);

}  // namespace kvserve
