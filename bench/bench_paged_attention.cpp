// Decode attention for one layer: the paged kernel's AVX2 and AVX-512 builds (fp32, fp16, bf16, int8
// and int4 pools) vs libtorch on pre-gathered contiguous KV.
// Reports bytes of KV read per step and GB/s, to compare with the ~30 GB/s floor of docs/benchmarks.md (2 threads).
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <memory>

#include "cache_manager/paged_attention.h"
#include "cache_manager/paged_kv_cache.h"

namespace {

constexpr int64_t kB = 8, kKV = 4, kG = 3, kD = 64;

// A cache with B sequences of KV heads (kB and kKV unless given), `ctx` tokens each, in one layer;
// blocks interleaved between sequences as they would be after decoding them together.
struct Setup {
  Setup(int64_t ctx, torch::ScalarType dtype, kvserve::KvQuant quant, int64_t batch = kB, int64_t kv_heads = kKV)
      : B(batch), KV(kv_heads) {
    kvserve::KvPoolOptions o;
    o.num_kv_heads = KV;
    o.head_dim = kD;
    o.dtype = dtype;
    o.quant = quant;
    o.num_blocks = B * ((ctx + 15) / 16) + 8;
    cache = std::make_unique<kvserve::PagedKvCache>(1, o);
    std::vector<int64_t> pos(B, 0);
    for (int64_t b = 0; b < B; ++b) {
      ids.push_back(b);
      cache->add_sequence(b);
    }
    const int64_t chunk = 16;
    for (int64_t t = 0; t < ctx; t += chunk) {  // 16 tokens per sequence at a time: one block each
      const int64_t n = std::min(chunk, ctx - t);
      for (int64_t s = 0; s < n; ++s) cache->append(0, ids, torch::randn({B, KV, kD}), torch::randn({B, KV, kD}), pos);
    }
    q = torch::randn({B, KV * kG, kD});
    tables = cache->decode_tables(0, ids);
    for (int64_t b = 0; b < B && quant == kvserve::KvQuant::none; ++b) {
      auto [k, v] = cache->gather(b, 0);
      ks.push_back(k);
      vs.push_back(v);
    }
    if (!ks.empty()) {
      k_all = torch::stack(ks);  // [B, KV, S, D]
      v_all = torch::stack(vs);
    }
    bytes = 2 * B * KV * ctx * kvserve::KvBlockPool::row_bytes(kD, dtype, quant);
  }
  int64_t B, KV;
  std::unique_ptr<kvserve::PagedKvCache> cache;
  std::vector<int64_t> ids;
  torch::Tensor q, k_all, v_all;
  std::vector<torch::Tensor> ks, vs;
  kvserve::DecodeTables tables;
  int64_t bytes = 0;
};

// KV cache dtype by benchmark argument: 0 fp32, 1 fp16, 2 bf16, 3 int8 (q8_0), 4 int4 (q4_0).
torch::ScalarType pool_dtype(int64_t code) {
  return code == 1 ? torch::kFloat16 : code == 2 ? torch::kBFloat16 : torch::kFloat32;
}
kvserve::KvQuant pool_quant(int64_t code) {
  return code == 3 ? kvserve::KvQuant::q8_0 : code == 4 ? kvserve::KvQuant::q4_0 : kvserve::KvQuant::none;
}

// shape 0: kB sequences of kKV heads; 1: the default model's layer at batch 1 (SmolLM2-135M: one
// sequence, 3 KV heads of 3 query heads each).
Setup& setup_for(int64_t ctx, int64_t dtype_code = 0, int64_t shape = 0) {
  static std::map<std::tuple<int64_t, int64_t, int64_t>, std::unique_ptr<Setup>> cache;
  auto& s = cache[{ctx, dtype_code, shape}];
  if (!s) s = std::make_unique<Setup>(ctx, pool_dtype(dtype_code), pool_quant(dtype_code), shape == 0 ? kB : 1,
                                      shape == 0 ? kKV : 3);
  return *s;
}

void report(benchmark::State& state, int64_t bytes) {
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(bytes), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["floor_ms"] = static_cast<double>(bytes) / 30e9 * 1e3;
}

// isa 0: the AVX2 build, 1: the AVX-512 build (the AVX2 one where the CPU lacks AVX-512).
void BM_PagedKernel(benchmark::State& state) {
  Setup& s = setup_for(state.range(0), state.range(1));
  kvserve::set_paged_attention_isa(state.range(2) == 0 ? "avx2" : "avx512");
  const kvserve::KvQuant quant = pool_quant(state.range(1));
  for (auto _ : state) {
    auto t = s.cache->decode_tables(0, s.ids);  // included: the per-step table build
    benchmark::DoNotOptimize(kvserve::paged_attention(s.q, s.cache->pool().storage(), t.block_table, t.lengths, -1.0, 0,
                                                      quant, s.cache->rotates()));
  }
  state.SetLabel(kvserve::paged_attention_isa(pool_dtype(state.range(1)), quant, kD));
  kvserve::set_paged_attention_isa("avx512");
  report(state, s.bytes);
}

void BM_PagedGatherLibtorch(benchmark::State& state) {
  Setup& s = setup_for(state.range(0));
  for (auto _ : state) {
    benchmark::DoNotOptimize(
        kvserve::paged_attention_gather(s.q, s.cache->pool().storage(), s.tables.block_table, s.tables.lengths));
  }
  report(state, s.bytes);
}

// The naive peer: KV already contiguous per sequence (no gather cost), batched matmul + softmax.
void BM_ContiguousLibtorch(benchmark::State& state) {
  Setup& s = setup_for(state.range(0));
  const double scale = 1.0 / std::sqrt(static_cast<double>(kD));
  for (auto _ : state) {
    auto qg = s.q.view({kB, kKV, kG, kD});
    auto p = torch::softmax(torch::matmul(qg, s.k_all.transpose(-1, -2)).mul_(scale), -1);
    benchmark::DoNotOptimize(torch::matmul(p, s.v_all).view({kB, kKV * kG, kD}));
  }
  report(state, s.bytes);
}

BENCHMARK(BM_PagedKernel)
    ->ArgNames({"ctx", "kv_dtype", "isa"})
    ->ArgsProduct({{512, 4096, 16384}, {0, 1, 2, 3, 4}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0);
// One decode step's attention in one layer of the default model at batch 1 (the shape of a
// single-stream decode after 1K-16K tokens): per-call costs, not bandwidth, decide it.
void BM_PagedKernelOneSequence(benchmark::State& state) {
  Setup& s = setup_for(state.range(0), state.range(1), 1);
  const kvserve::KvQuant quant = pool_quant(state.range(1));
  for (auto _ : state) {
    auto t = s.cache->decode_tables(0, s.ids);
    benchmark::DoNotOptimize(kvserve::paged_attention(s.q, s.cache->pool().storage(), t.block_table, t.lengths, -1.0, 0,
                                                      quant, s.cache->rotates()));
  }
  state.SetLabel(kvserve::paged_attention_isa(pool_dtype(state.range(1)), quant, kD));
  report(state, s.bytes);
}

BENCHMARK(BM_PagedKernelOneSequence)
    ->ArgNames({"ctx", "kv_dtype"})
    ->ArgsProduct({{256, 512, 1024, 2048, 4096}, {0, 1, 3}})
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.5);
BENCHMARK(BM_PagedGatherLibtorch)->Arg(4096)->Arg(16384)->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(BM_ContiguousLibtorch)->Arg(512)->Arg(4096)->Arg(16384)->Unit(benchmark::kMillisecond)->MinTime(1.0);

}  // namespace

BENCHMARK_MAIN();
