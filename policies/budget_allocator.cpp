// kvpress-identical float arithmetic below: no FMA contraction.
#pragma GCC optimize("fp-contract=off")
#include "policies/budget_allocator.h"

#include <algorithm>

#include "common/check.h"
#include "policies/pyramid_budget.h"

namespace kvserve {

double kvpress_kept_average(const PolicyConfig& cfg, int64_t prompt_len) {
  if (cfg.budget_ratio > 0.0) {
    const double compression_ratio = 1.0 - cfg.budget_ratio;
    return static_cast<double>(prompt_len) * (1.0 - compression_ratio);
  }
  return static_cast<double>(cfg.budget);
}

int64_t kvpress_kept_tokens(const PolicyConfig& cfg, int64_t prompt_len) {
  if (cfg.budget_ratio > 0.0) {
    return std::max<int64_t>(1, static_cast<int64_t>(kvpress_kept_average(cfg, prompt_len)));
  }
  return cfg.budget;
}

LayerBudget budget_with_window_inside(int64_t kept, int64_t window, int64_t prompt_len) {
  LayerBudget b;
  if (kept >= prompt_len) return b;  // full
  b.full = false;
  b.window = std::min(kept, window);
  b.scored = kept - b.window;
  return b;
}

DynamicSizes dynamic_sizes(const PolicyConfig& cfg, int64_t prompt_len) {
  DynamicSizes s;
  const int64_t w = std::min(cfg.window, prompt_len);
  s.base = std::max<int64_t>(0, cfg.budget_tokens(prompt_len) - cfg.window);
  s.bs = std::min(cfg.r_max * s.base, prompt_len - w);
  s.base = std::min(s.base, s.bs);
  return s;
}

std::vector<LayerBudget> allocate_layer_budgets(const PolicyConfig& cfg, int64_t prompt_len, int64_t num_layers) {
  KV_CHECK(num_layers >= 1, "allocate_layer_budgets: num_layers must be >= 1, got " << num_layers);
  KV_CHECK(prompt_len >= 1, "allocate_layer_budgets: prompt_len must be >= 1, got " << prompt_len);
  std::vector<LayerBudget> out(num_layers);  // default: full
  if (cfg.is_full() || prompt_len <= cfg.window) return out;
  if (!cfg.local_layers.empty()) {
    // A model with sliding-window layers: those keep their window, so the budgets are the
    // allocator's over the global layers alone, in their order (a pyramid over the global layers).
    const std::vector<int64_t> global = cfg.global_layers(num_layers);
    if (global.empty()) return out;
    PolicyConfig g = cfg;
    g.local_layers.clear();
    g.skip_layers.clear();  // layer numbers of the whole model: applied below
    const auto compact = allocate_layer_budgets(g, prompt_len, static_cast<int64_t>(global.size()));
    for (size_t i = 0; i < global.size(); ++i) out[static_cast<size_t>(global[i])] = compact[i];
    for (int64_t l : cfg.skip_layers)
      if (l >= 0 && l < num_layers) out[static_cast<size_t>(l)] = LayerBudget{};
    return out;
  }
  const bool kvpress = cfg.semantics == Semantics::kKvpress;
  const int64_t w = cfg.window;

  switch (cfg.allocator) {
    case AllocatorKind::kFull:
      break;
    case AllocatorKind::kUniform:
    case AllocatorKind::kGlobal: {  // global: the per-layer mean; the top-k over layers spreads it
      LayerBudget lb;
      if (kvpress) {
        lb = budget_with_window_inside(kvpress_kept_tokens(cfg, prompt_len), w, prompt_len);
      } else {
        const int64_t b = cfg.budget_tokens(prompt_len);
        if (prompt_len > b) lb = LayerBudget{false, w, std::max<int64_t>(0, b - w)};
      }
      std::fill(out.begin(), out.end(), lb);
      break;
    }
    case AllocatorKind::kPyramid: {
      if (kvpress) {
        const auto kept =
            pyramid_budgets_kvpress(prompt_len, kvpress_kept_average(cfg, prompt_len), w, cfg.beta, num_layers);
        for (int64_t l = 0; l < num_layers; ++l) out[l] = budget_with_window_inside(kept[l], w, prompt_len);
      } else {
        const int64_t b = cfg.budget_tokens(prompt_len);
        const auto kept = pyramid_budgets_paper(prompt_len, b, w, cfg.beta, num_layers);
        if (prompt_len > b) {
          for (int64_t l = 0; l < num_layers; ++l) out[l] = LayerBudget{false, w, std::max<int64_t>(0, kept[l] - w)};
        }
      }
      break;
    }
    case AllocatorKind::kDynamic: {
      const int64_t b = cfg.budget_tokens(prompt_len);
      if (prompt_len > b) {
        const auto s = dynamic_sizes(cfg, prompt_len);
        std::fill(out.begin(), out.end(), LayerBudget{false, w, s.bs});
      }
      break;
    }
  }
  for (int64_t l : cfg.skip_layers) {
    if (l >= 0 && l < num_layers) out[l] = LayerBudget{};
  }
  return out;
}

std::vector<int64_t> kept_counts(const std::vector<LayerBudget>& budgets, int64_t prompt_len) {
  std::vector<int64_t> out;
  out.reserve(budgets.size());
  for (const auto& b : budgets) out.push_back(b.kept(prompt_len));
  return out;
}

}  // namespace kvserve
