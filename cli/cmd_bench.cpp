// `kvserve bench decode`: steady-state decode speed at a given context length, batch and KV policy,
// without running the (slow on CPU) long prefill.
//
// Each sequence's KV is filled layer by layer through the engine's own PagedKvMemory with random
// q/k/v of `context` tokens: the policy's real PrefillSelector picks what each layer keeps (its real
// per-layer budgets) and the kept tokens are written into the paged pool. Then `steps` real decode
// steps run through DecoderModel::decode for the whole batch at positions context + t (greedy argmax
// fed back); on CUDA through DecodeGraphs (captured in the warmup) unless --enforce-eager. Decode cost depends only on how many KV entries each (sequence, layer, head) holds, not
// on their values, so this times what a real run with that context would time per decode step.
// host_plan_s_median is the step's host planning (plan_decode; with graphs also the split hint and the
// inputs' copy): the bench waits on each step's argmax, so the GPU idles for that long every step.
// --cuda-profiler-steps N brackets the first N timed steps with cudaProfilerStart/Stop, so that
// `ncu --profile-from-start off` records those steps' kernels and nothing of the fill or warmup.
#include <algorithm>
#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>

#include <ATen/Parallel.h>

#include "backend/model/checkpoint.h"
#include "backend/engine/cuda_profiler.h"
#include "backend/engine/decode_graphs.h"
#include "backend/model/decoder_model.h"
#include "cache_manager/kv_memory_factory.h"
#include "cli/commands.h"
#include "cli/kv_cache_dtype_cli.h"
#include "cli/quantization_cli.h"
#include "cli/policy_cli.h"
#include "common/check.h"

namespace kvserve::cli {

namespace {

struct BenchDecodeArgs {
  std::string model, device = "cpu", dtype, cpu_gemm = "mkl", kv_cache_dtype = "auto", quantization = "none", kv_layout = "auto";
  PolicyFlags policy;
  std::vector<int64_t> contexts{4096}, batches{1};
  int64_t steps = 32, warmup = 4, threads = 0, block_size = 16, cuda_profiler_steps = 0;
  uint64_t seed = 0;
  double bandwidth_gbs = 30.0;
  bool profile = false, enforce_eager = false;
};

// One eager step as DecoderModel::decode runs it, in its two halves so that the host planning
// (plan_decode: evictions, blocks, the device tables' copy, RoPE growth) is timed apart into plan_s.
torch::Tensor eager_step(DecoderModel& model, const DecodeBatch& db, const std::vector<int64_t>& tokens, KvMemory& mem,
                         double& plan_s) {
  const auto t0 = std::chrono::steady_clock::now();
  model.plan_decode(db, tokens, mem);
  plan_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto dev = model.device();
  return model.decode_planned(db, torch::tensor(tokens, torch::kInt64).to(dev),
                              torch::tensor(db.positions, torch::kInt64).to(dev), mem);
}

// The median of a non-empty list (the upper middle of an even count, as step_s_median takes it).
double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

nlohmann::json run_one(DecoderModel& model, const BenchDecodeArgs& a, const std::string& policy_name,
                       const std::map<std::string, PolicyConfig>& policies, int64_t context, int64_t batch) {
  torch::NoGradGuard ng;
  const ModelConfig& c = model.config();
  const int64_t L = c.num_hidden_layers, KV = c.num_key_value_heads, H = c.num_attention_heads, D = c.head_dim;
  KV_CHECK(context >= 1 && context + a.warmup + a.steps < c.max_position_embeddings,
           "--context " << context << " plus the steps must stay below max_position_embeddings "
                        << c.max_position_embeddings);
  PolicyConfig cfg = policies.at(policy_name);
  cfg.local_layers = model.kv_layout().local_layers;  // a sliding-window model's budget goes to its global layers
  const int64_t token_layer_bytes = 2 * KV * KvBlockPool::row_bytes(D, model.kv_dtype(), model.kv_quant());

  // Pool: every sequence's peak per-layer size (DynamicKV: its candidates) plus the decoded tokens.
  std::vector<int64_t> peak(L, context);
  if (!cfg.is_full()) peak = PrefillSelector(cfg, L, KV, context).budgets();
  const KvLayout layout = parse_kv_layout(a.kv_layout);
  const bool head_blocks = uses_head_blocks(layout, policies);
  int64_t blocks = 0;
  for (int64_t n : peak) {
    const int64_t tokens = n + a.warmup + a.steps + 1;
    // Head-wise, a layer's KV * tokens spread over its heads: one partial block per head on top.
    blocks += head_blocks ? (KV * tokens + a.block_size - 1) / a.block_size + 2 * KV
                          : (tokens + a.block_size - 1) / a.block_size + 1;
  }
  auto memory = make_kv_memory(model.kv_layout(), {a.block_size, blocks * batch + L * (head_blocks ? KV : 1), 0, false, 0, layout},
                               policies, policy_name);
  PagedKvMemory& mem = *memory;

  // Fill: random q/k/v (one set reused by every layer and sequence; values do not change decode cost).
  const auto t_fill = std::chrono::steady_clock::now();
  torch::manual_seed(a.seed);
  const auto topt = torch::TensorOptions().dtype(model.dtype()).device(model.device());
  auto q = torch::randn({H, context, D}, topt);
  auto k = torch::randn({KV, context, D}, topt);
  auto v = torch::randn({KV, context, D}, topt);
  std::vector<int64_t> ids;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t id = b + 1;
    ids.push_back(id);
    mem.begin_prefill(id, context, policy_name);
    for (int64_t l = 0; l < L; ++l) mem.store_prefill(id, l, q, k, v);
    mem.end_prefill(id);
  }
  q = k = v = torch::Tensor();
  const double fill_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_fill).count();
  const int64_t kept = mem.kept_tokens(1);
  std::vector<int64_t> kept_per_layer;
  for (int64_t l = 0; l < L; ++l) kept_per_layer.push_back(mem.cached_tokens(1, l));
  const auto hk = mem.head_kept(1);  // after prefill, before decode appends

  // On CUDA the steps replay CUDA graphs (captured during the warmup) unless --enforce-eager.
  std::unique_ptr<DecodeGraphs> graphs;
  if (model.device().is_cuda() && !a.enforce_eager) {
    const std::string why = DecodeGraphs::unsupported(model, mem);
    KV_CHECK(why.empty(), "bench decode: no CUDA graphs here (" << why << "); pass --enforce-eager");
    DecodeGraphOptions go;
    go.max_batch = batch;
    graphs = std::make_unique<DecodeGraphs>(model, mem, go);
  }

  // Decode: warmup, then timed steps; tokens are the previous step's argmax.
  std::vector<int64_t> tokens(batch, 1);
  std::vector<double> step_s, plan_s;
  bool plan_timed = true;  // false once a timed step ran whole in DecoderModel::decode (graphs' eager fallback)
  StepProfile profile;
  // The profiler range: timed steps [warmup, warmup + cuda_profiler_steps).
  const int64_t range_end = a.warmup + a.cuda_profiler_steps;
  double live_kv_bytes_sum = 0;
  for (int64_t t = 0; t < a.warmup + a.steps; ++t) {
    DecodeBatch db;
    db.seq_ids = ids;
    int64_t live = 0;
    for (int64_t id : ids) {
      db.positions.push_back(context + t);
      live += mem.kept_tokens(id);
    }
    if (a.profile && t == a.warmup) model.set_profile(&profile);
    if (t == a.warmup && a.cuda_profiler_steps > 0) cuda_profiler_start(model.device());
    const auto s0 = std::chrono::steady_clock::now();
    double plan = -1;
    torch::Tensor logits;
    if (graphs) {
      logits = graphs->decode(db, tokens);
      plan = graphs->stats().last_plan_s;
    } else {
      logits = eager_step(model, db, tokens, mem, plan);
    }
    auto next = logits.argmax(-1).to(torch::kCPU);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
    if (t + 1 == range_end && a.cuda_profiler_steps > 0) cuda_profiler_stop(model.device());
    for (int64_t b = 0; b < batch; ++b) tokens[b] = next[b].item<int64_t>();
    if (t >= a.warmup) {
      step_s.push_back(dt);
      if (plan >= 0) plan_s.push_back(plan);
      else plan_timed = false;
      live_kv_bytes_sum += static_cast<double>((live + batch * L) * token_layer_bytes);
    }
  }
  model.set_profile(nullptr);
  std::vector<double> sorted = step_s;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  double mean = 0;
  for (double s : step_s) mean += s;
  mean /= static_cast<double>(step_s.size());
  // The bytes the model holds, quantized blocks as stored.
  const double wbytes = static_cast<double>(model.weight_bytes());
  const double live_kv = live_kv_bytes_sum / static_cast<double>(step_s.size());
  const double floor_s = (wbytes + live_kv) / (a.bandwidth_gbs * 1e9);
  nlohmann::json out{{"policy", policy_name},
                        {"context", context},
                        {"batch", batch},
                        {"steps", a.steps},
                        {"warmup", a.warmup},
                        {"threads", at::get_num_threads()},
                        {"kv_cache_dtype", kv_cache_dtype_label(model.kv_dtype(), model.kv_quant())},
                        {"weights", model.weight_format()},
                        {"fill_s", fill_s},
                        {"step_s_median", median},
                        {"step_s_mean", mean},
                        {"step_s_min", sorted.front()},
                        {"step_s_max", sorted.back()},
                        {"decode_tokens_per_s", static_cast<double>(batch) / median},
                        {"kv_tokens_kept", kept},
                        {"kv_tokens_full", context * L},
                        {"kv_tokens_kept_per_layer", kept_per_layer},
                        {"kv_bytes_per_token_layer", token_layer_bytes},
                        {"kv_bytes_per_seq", kept * token_layer_bytes},
                        {"kv_bytes_per_seq_full", context * L * token_layer_bytes},
                        {"pool_bytes_per_seq", mem.cache().bytes_of(1)},
                        {"weight_bytes", wbytes},
                        {"live_kv_bytes", live_kv},
                        {"bandwidth_gbs", a.bandwidth_gbs},
                        {"floor_step_s", floor_s},
                        {"fraction_of_floor", floor_s / median},
                        {"cuda_graphs", graphs != nullptr},
                        {"kv_layout", head_blocks ? "head" : "layer"}};
  out["kv_tokens_per_head"] = {{"min", hk.min}, {"mean", hk.mean()}, {"max", hk.max}};
  // Absent when a timed step's planning could not be timed apart (it ran inside DecoderModel::decode).
  if (plan_timed) out["host_plan_s_median"] = median_of(plan_s);
  if (a.cuda_profiler_steps > 0) out["cuda_profiler_steps"] = a.cuda_profiler_steps;
  if (graphs) {
    const DecodeGraphStats& gs = graphs->stats();
    out["cuda_graph_stats"] = {{"captures", gs.captures}, {"replays", gs.replays}, {"eager", gs.eager},
                               {"invalidations", gs.invalidations},
                               {"kernel_nodes", gs.kernel_nodes}, {"kernels_by_name", gs.kernels_by_name}};
  }
  if (a.profile) {
    // Mean ms per step of each stage; "other" is the rest of the mean step (argmax, host work).
    nlohmann::json stages;
    double staged = 0;
    for (int i = 0; i < StepProfile::kCount; ++i) {
      stages[StepProfile::kNames[i]] = profile.seconds[i] / static_cast<double>(profile.steps) * 1e3;
      staged += profile.seconds[i];
    }
    stages["other"] = (mean - staged / static_cast<double>(profile.steps)) * 1e3;
    out["profile_ms_per_step"] = stages;
  }
  return out;
}

}  // namespace

void add_bench_commands(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "Micro benchmarks of the engine");
  bench->require_subcommand(1);
  auto a = std::make_shared<BenchDecodeArgs>();
  auto* cmd = bench->add_subcommand(
      "decode", "Decode tokens/s at a context length, batch and KV policy (KV filled with random values at the "
                "policy's kept size; prints one JSON object per line)");
  cmd->add_option("--model", a->model, "Hugging Face model directory")->required();
  cmd->add_option("--context", a->contexts, "context length(s) before decoding")->expected(1, 64);
  cmd->add_option("--batch", a->batches, "sequences decoded together (one or more)")->expected(1, 64);
  cmd->add_option("--steps", a->steps, "timed decode steps")->check(CLI::Range(1, 100000));
  cmd->add_option("--warmup", a->warmup, "untimed decode steps first")->check(CLI::Range(0, 100000));
  cmd->add_option("--threads", a->threads, "torch intra-op threads (0 = torch's default)")->check(CLI::Range(0, 1024));
  cmd->add_option("--block-size", a->block_size, "KV block size in tokens")->check(CLI::Range(1, 4096));
  cmd->add_option("--seed", a->seed, "seed of the random KV");
  cmd->add_option("--bandwidth-gbs", a->bandwidth_gbs, "memory bandwidth for the floor, GB/s")->check(CLI::Range(0.001, 1e6));
  cmd->add_option("--device", a->device, "cpu, cuda or cuda:N");
  cmd->add_flag("--enforce-eager", a->enforce_eager, "CUDA: decode without CUDA graphs (the A/B against them)");
  cmd->add_option("--cuda-profiler-steps", a->cuda_profiler_steps,
                  "CUDA: bracket the first N timed steps of each cell with cudaProfilerStart/Stop (for ncu "
                  "--profile-from-start off, nsys --capture-range=cudaProfilerApi); 0 = off")
      ->check(CLI::Range(0, 100000));
  cmd->add_flag("--profile", a->profile, "time each stage of the decode step (CPU; adds profile_ms_per_step)");
  cmd->add_option("--dtype", a->dtype, "compute dtype: float32, bfloat16, float16");
  cmd->add_option("--cpu-gemm", a->cpu_gemm, "mkl (default; logits equal transformers') or onednn (faster prefill on AMD CPUs)")
      ->check(CLI::IsMember({"mkl", "onednn"}));
  add_kv_cache_dtype_option(cmd, a->kv_cache_dtype);
  add_quantization_option(cmd, a->quantization);
  cmd->add_option("--kv-layout", a->kv_layout, "KV block layout: auto (head-wise for head_budgets=adaptive), layer, head")
      ->check(CLI::IsMember({"auto", "layer", "head"}));
  a->policy.add_to(cmd);
  cmd->callback([a] {
    KV_CHECK(a->cuda_profiler_steps == 0 || torch::Device(a->device).is_cuda(),
             "--cuda-profiler-steps needs a CUDA device (--device cuda), not " << a->device);
    KV_CHECK(a->cuda_profiler_steps <= a->steps,
             "--cuda-profiler-steps " << a->cuda_profiler_steps << " is more than the " << a->steps << " timed --steps");
    if (a->threads > 0) at::set_num_threads(static_cast<int>(a->threads));
    LoadOptions load{a->device, a->dtype, false};
    load.cpu_gemm = cpu_gemm_from_name(a->cpu_gemm);
    load.kv_cache_dtype = a->kv_cache_dtype;
    load.quantization = a->quantization;
    auto model = DecoderModel::load(a->model, load);
    const auto specs = a->policy.specs();
    const std::string name = PolicyFlags::selected(specs);
    auto policies = resolve_policies(specs);
    apply_model_layout(policies, model->kv_layout());  // budget_bytes in tokens of this cache dtype
    for (int64_t ctx : a->contexts)
      for (int64_t b : a->batches) {
        KV_CHECK(b >= 1, "--batch must be at least 1");
        std::cout << run_one(*model, *a, name, policies, ctx, b).dump() << std::endl;
      }
  });
}

}  // namespace kvserve::cli
