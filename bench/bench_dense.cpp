// Dense layers at decode batch sizes: the small-batch kernel vs torch::linear (MKL) on bench-125m's
// weight shapes. Reports W bytes read per call as GB/s, to compare with the ~30 GB/s floor of
// docs/benchmarks.md; W is larger than the last-level cache share, as in a real step.
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <ATen/Parallel.h>

#include <string>
#include <vector>

#include "backend/kernels/dense.h"

namespace {

// All of one step's projections of bench-125m (12 layers) plus the LM head, so W comes from DRAM.
struct Weights {
  std::vector<torch::Tensor> w;
  int64_t bytes = 0;
  Weights() {
    for (int l = 0; l < 12; ++l) {
      for (auto [n, k] : std::vector<std::pair<int64_t, int64_t>>{{1280, 768}, {768, 768}, {4096, 768}, {768, 2048}}) {
        w.push_back(torch::randn({n, k}) * 0.02);
      }
    }
    w.push_back(torch::randn({32000, 768}) * 0.02);
    for (auto& t : w) bytes += t.numel() * 4;
  }
};

const Weights& weights() {
  static Weights w;
  return w;
}

template <bool kSmall>
void BM_Step(benchmark::State& state) {
  const int64_t M = state.range(0);
  const Weights& W = weights();
  std::vector<torch::Tensor> xs;
  for (const auto& w : W.w) xs.push_back(torch::randn({M, w.size(1)}));
  for (auto _ : state) {
    for (size_t i = 0; i < W.w.size(); ++i) {
      auto y = kSmall ? kvserve::small_batch_dense(xs[i], W.w[i]) : torch::linear(xs[i], W.w[i]);
      benchmark::DoNotOptimize(y.data_ptr<float>());
    }
  }
  state.SetBytesProcessed(state.iterations() * W.bytes);
}

}  // namespace

BENCHMARK(BM_Step<true>)->Arg(1)->Arg(2)->Arg(4)->Arg(8)->Arg(16)->Arg(24)->Arg(32)->Arg(40)->Arg(64)->Arg(128)->Arg(256)->Arg(512)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Step<false>)->Arg(1)->Arg(2)->Arg(4)->Arg(8)->Arg(16)->Arg(24)->Arg(32)->Arg(40)->Arg(64)->Arg(128)->Arg(256)->Arg(512)->Unit(benchmark::kMillisecond)->UseRealTime();
int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::AddCustomContext("intra-op threads", std::to_string(at::get_num_threads()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
