// SamplerBank::sample_batch on CPU at decode batch sizes over the default model's vocabulary
// (49152): greedy, top-k 40 + repetition penalty, top-p 0.9, and greedy with 5 top logprobs.
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <ATen/Parallel.h>

#include <vector>

#include "backend/sampling/sampler.h"

namespace {

using kvserve::SamplerBank;
using kvserve::SamplingParams;

constexpr int64_t kVocab = 49152;

SamplingParams params_for(int mode) {
  SamplingParams p;
  p.temperature = 0.0;
  if (mode == 1) p.temperature = 0.7, p.top_k = 40, p.repetition_penalty = 1.2;
  if (mode == 2) p.temperature = 0.8, p.top_p = 0.9;
  if (mode == 3) p.logprobs = 5;
  return p;
}

void BM_SampleBatch(benchmark::State& state) {
  at::set_num_threads(2);
  const int64_t B = state.range(0);
  const int mode = static_cast<int>(state.range(1));
  SamplerBank bank;
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < B; ++i) {
    bank.add(i, params_for(mode), std::vector<int64_t>(200, 7 + i), static_cast<uint64_t>(i), {});
    ids.push_back(i);
  }
  torch::manual_seed(0);
  const torch::Tensor logits = torch::randn({B, kVocab}) * 3.0;
  const std::vector<char> ban(static_cast<size_t>(B), 0);
  for (auto _ : state) benchmark::DoNotOptimize(bank.sample_batch(ids, logits, ban));
  state.SetLabel(mode == 0 ? "greedy" : mode == 1 ? "top-k 40 + rep. penalty" : mode == 2 ? "top-p 0.9" : "greedy + 5 logprobs");
}

}  // namespace

BENCHMARK(BM_SampleBatch)->ArgsProduct({{1, 8, 32}, {0, 1, 2, 3}})->Unit(benchmark::kMicrosecond);
BENCHMARK_MAIN();
