// Quantized linear layers at decode batch sizes (QuantizedWeight::matmul inside a decode step) on
// the default model's shapes (SmolLM2-135M: 30 layers, hidden 576, MLP 1536, GQA 9/3 heads, tied
// 49152-token LM head in Q8_0, the rest in the benchmark's type). Reports weight bytes read per
// call as GB/s and multiply-adds per second, to set against the float32 GEMV of bench_dense.
// BENCH_LAYERS=N times N layers and no LM head instead: with N = 1 the weights stay in L2, which
// shows the kernels' compute rate apart from DRAM.
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <ATen/Parallel.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/quantization/quantized_weight.h"
#include "backend/kernels/decode_scope.h"

namespace {

struct Weights {
  std::vector<kvserve::QuantizedWeight> w;
  int64_t bytes = 0, macs = 0;
  explicit Weights(const std::string& type) {
    const int t = kvserve::quant_type_from_name(type);
    const char* env = std::getenv("BENCH_LAYERS");
    const int layers = env ? std::atoi(env) : 30;
    // A K-quant row is whole super-blocks of 256 values: 576-wide inputs become 768 for those types.
    const bool k_quant = type.size() == 4 && type[3] == 'k';
    const int64_t hidden_in = k_quant ? 768 : 576;
    for (int l = 0; l < layers; ++l)
      for (auto [n, k] : std::vector<std::pair<int64_t, int64_t>>{
               {960, hidden_in}, {576, hidden_in}, {3072, hidden_in}, {576, 1536}})
        w.push_back(kvserve::QuantizedWeight::quantize(torch::randn({n, k}) * 0.02, t, type));
    if (!env) w.push_back(kvserve::QuantizedWeight::quantize(torch::randn({49152, 576}) * 0.02,
                                                   kvserve::quant_type_from_name("q8_0"), "lm_head"));
    for (const auto& q : w) {
      bytes += q.bytes();
      macs += q.rows() * q.cols();
    }
  }
};

const Weights& weights(int type_index) {
  static const char* const kTypes[] = {"q4_1", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q5_0", "q3_k", "q2_k"};
  static std::map<int, std::unique_ptr<Weights>> made;  // built on first use: 30 layers each
  auto& w = made[type_index];
  if (!w) w = std::make_unique<Weights>(kTypes[type_index]);
  return *w;
}

void BM_Step(benchmark::State& state) {
  const Weights& W = weights(static_cast<int>(state.range(0)));
  const int64_t M = state.range(1);
  std::vector<torch::Tensor> xs;
  for (const auto& w : W.w) xs.push_back(torch::randn({M, w.cols()}));
  kvserve::DecodeScope scope;
  for (auto _ : state) {
    for (size_t i = 0; i < W.w.size(); ++i) {
      auto y = W.w[i].matmul(xs[i]);
      benchmark::DoNotOptimize(y.data_ptr<float>());
    }
  }
  state.SetBytesProcessed(state.iterations() * W.bytes);
  state.counters["GMAC/s"] = benchmark::Counter(static_cast<double>(W.macs * M) * 1e-9 * state.iterations(),
                                                benchmark::Counter::kIsRate);
}

}  // namespace

// type: 0 = Q4_1 (the default model's GGUF), 1 = Q8_0 (--quantization int8), 2 = Q4_0 (int4),
// 3-5 = Q4_K, Q5_K, Q6_K (a Q4_K_M GGUF's types, e.g. Gemma 3's; inputs of 576 widened to 768),
// 6 = Q5_0 (most of Gemma 3's Q4_K_M file: q, k, gate and up), 7-8 = Q3_K, Q2_K (Q3_K_M / Q2_K files).
BENCHMARK(BM_Step)->ArgNames({"type", "M"})->ArgsProduct({{0, 1, 2, 3, 4, 5, 6, 7, 8}, {1, 2, 4, 8}})->Unit(benchmark::kMillisecond)->UseRealTime();

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::AddCustomContext("intra-op threads", std::to_string(at::get_num_threads()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
