// Python-identical float arithmetic below: no FMA contraction, round half to even.
#pragma GCC optimize("fp-contract=off")
#include "policies/pyramid_budget.h"

#include <algorithm>
#include <cfenv>
#include <cmath>

#include "common/check.h"

namespace kvserve {

int64_t floor_div(int64_t a, int64_t b) {
  KV_CHECK(b != 0, "floor_div by zero");
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

std::vector<int64_t> pyramid_budgets_paper(int64_t prompt_len, int64_t budget, int64_t window, int64_t beta,
                                           int64_t num_layers) {
  KV_CHECK(num_layers >= 1, "pyramid budgets: num_layers must be >= 1, got " << num_layers);
  KV_CHECK(prompt_len >= 0, "pyramid budgets: prompt_len must be >= 0, got " << prompt_len);
  KV_CHECK(beta >= 1, "pyramid budgets: beta must be >= 1, got " << beta);
  KV_CHECK(window >= 0, "pyramid budgets: window must be >= 0, got " << window);
  std::vector<int64_t> out(num_layers, prompt_len);
  if (prompt_len <= budget) return out;  // not compressed
  const int64_t a = std::max<int64_t>(budget - window, 0);
  if (prompt_len < 2 * a || num_layers == 1) {
    std::fill(out.begin(), out.end(), a + window);
    return out;
  }
  int64_t min_num = floor_div(a, beta);
  int64_t max_num = 2 * a - min_num;
  if (max_num >= prompt_len - window) {
    max_num = prompt_len - window;
    min_num = 2 * a - max_num;
  }
  const int64_t steps = floor_div(max_num - min_num, num_layers - 1);
  for (int64_t l = 0; l < num_layers; ++l) out[l] = max_num - l * steps + window;
  return out;
}

namespace {
int64_t py_round(double x) {
  // Python's round(): nearest, ties to even (the default FE_TONEAREST mode of nearbyint).
  return static_cast<int64_t>(std::nearbyint(x));
}
}  // namespace

std::vector<int64_t> pyramid_budgets_kvpress(int64_t prompt_len, double kept_avg, int64_t window, int64_t beta,
                                             int64_t num_layers) {
  KV_CHECK(num_layers >= 1, "pyramid budgets: num_layers must be >= 1, got " << num_layers);
  KV_CHECK(beta >= 1, "pyramid budgets: beta must be >= 1, got " << beta);
  KV_CHECK(std::fegetround() == FE_TONEAREST, "pyramid budgets: FPU rounding mode is not round-to-nearest");
  const double q_len = static_cast<double>(prompt_len);
  const double w = static_cast<double>(window);
  const double max_capacity_prompt = w + kept_avg;
  double min_num = (max_capacity_prompt - w) / static_cast<double>(beta);
  double max_num = (max_capacity_prompt - w) * 2.0 - min_num;
  if (max_num >= q_len - w) {
    max_num = q_len - w;
    min_num = (max_capacity_prompt - w) * 2.0 - max_num;
  }
  std::vector<int64_t> out(num_layers);
  if (!(q_len >= max_num && max_num >= min_num && min_num >= w)) {
    std::fill(out.begin(), out.end(), std::max<int64_t>(1, py_round(kept_avg)));
    return out;
  }
  const double steps = num_layers > 1 ? (max_num - min_num) / static_cast<double>(num_layers - 1) : 0.0;
  for (int64_t l = 0; l < num_layers; ++l) {
    const double prod = static_cast<double>(l) * steps;
    out[l] = py_round(max_num - prod);
  }
  return out;
}

}  // namespace kvserve
