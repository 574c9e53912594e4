// `kvserve plan`: per-GPU weight bytes, KV bytes per sequence per shard and the maximum concurrent
// sequences of a model split over TP x PP GPUs, for `full` and a chosen policy (parallel/shard_plan.h).
#include <cstdio>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/model/model_config.h"
#include "cli/cli_files.h"
#include "cli/commands.h"
#include "cli/policy_cli.h"
#include "common/check.h"
#include "configs/server_config.h"
#include "parallel/shard_plan.h"
#include "policies/kv_dtype_ladder.h"
#include "policies/policy_config.h"

namespace kvserve::cli {

namespace {

struct PlanArgs {
  std::string model_config;
  int64_t tp = 1, pp = 1;
  std::string gpu_memory = "80GiB";
  std::string context = "32768";
  std::string shared_prefix;  // tokens, like --context; empty = none
  std::string policy = "full";
  std::string budget;
  std::vector<std::string> params;
  std::string dtype = "bfloat16";
  std::string kv_dtype;  // default: dtype
  double reserve = 0.1;
  int64_t block_size = 16;
  bool json = false;
};

int64_t dtype_bytes(const std::string& d) {
  if (d == "bfloat16" || d == "bf16" || d == "float16" || d == "fp16" || d == "half") return 2;
  if (d == "float32" || d == "fp32" || d == "float") return 4;
  if (d == "fp8" || d == "float8" || d == "fp8_e4m3" || d == "fp8_e5m2") return 1;
  KV_FAIL("unknown dtype '" << d << "' (bfloat16, float16, float32, fp8)");
}

// Quantized weights as a GPU holds them, bits per weight with their scales: --quantization int8 (codes
// with a float32 scale per 128) and int4 (tinygemm: a bf16 scale and zero per 128), and a GGUF's block
// types in their CUDA forms (backend/quantization/gguf_cuda_forms.h): int8 codes with a float32 scale per
// 32 values (q8_0, q5_0: 9 bits) or 16 (q3_k, q6_k: 10), and an offset besides where the type is
// affine (q5_1, q5_k: 10; q2_k: 12); q4_0 / q4_1 / q4_k as int4 with a bf16 scale and zero per 32 (5).
// 0 for a plain dtype.
double quantized_weight_bits(const std::string& d) {
  static const std::map<std::string, double> bits = {
      {"int8", 8.25}, {"q8_0", 9.0},  {"int4", 4.25}, {"q4_0", 5.0}, {"q4_1", 5.0},  {"q5_0", 9.0},
      {"q5_1", 10.0}, {"q2_k", 12.0}, {"q3_k", 10.0}, {"q4_k", 5.0}, {"q5_k", 10.0}, {"q6_k", 10.0}};
  const auto it = bits.find(d);
  return it == bits.end() ? 0.0 : it->second;
}

// "32768", "32k"/"32K" (x1024) -> tokens.
int64_t parse_context(const std::string& t) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(t, &used);
  } catch (const std::exception&) {
    KV_FAIL("--context '" << t << "' is not a token count");
  }
  const std::string rest = t.substr(used);
  if (rest == "k" || rest == "K") {
    v *= 1024;
  } else {
    KV_CHECK(rest.empty(), "--context '" << t << "' is not a token count (e.g. 32768 or 32k)");
  }
  KV_CHECK(v > 0, "--context must be positive");
  return v;
}

std::string gib(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

std::string mib(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

void print_text(const parallel::ShardPlan& p) {
  const auto& o = p.options;
  std::cout << "plan: TP=" << o.tp << " PP=" << o.pp << " (" << p.gpus << " GPUs), " << gib(o.gpu_memory_bytes)
            << " per GPU, reserve " << o.reserve_fraction << " -> usable " << gib(p.usable_bytes) << "\n"
            << "context " << o.context << " tokens, block " << o.block_size << ", weights ";
  if (o.weight_bits > 0) {
    std::cout << o.weight_bits << " bits/param";
  } else {
    std::cout << o.weight_dtype_bytes << " B/param";
  }
  std::cout << ", KV ";
  if (o.kv_quant_bits > 0) {
    std::cout << o.kv_quant_bits << " bits/elem + " << o.kv_quant_scale_bytes << " B scale per 32\n";
  } else {
    std::cout << o.kv_dtype_bytes << " B/elem\n";
  }
  for (const auto& s : p.stages) {
    std::cout << "stage " << s.stage << ": layers [" << s.layers.begin << ", " << s.layers.end << ")"
              << (s.has_embedding ? " +embedding" : "") << (s.has_lm_head ? " +norm+lm_head" : "")
              << "  weights/GPU " << gib(s.weight_bytes) << " (" << s.weight_params << " params)"
              << "  KV heads/GPU " << s.kv_heads << "  KV/token " << s.kv_bytes_per_token << " B";
    if (s.local_layers > 0) {
      std::cout << " (" << s.layers.size() - s.local_layers << " global layers; " << s.local_layers
                << " sliding-window layers hold at most " << s.local_blocks_per_seq << " blocks = "
                << mib(s.local_blocks_per_seq * s.block_bytes) << " per sequence)";
    }
    std::cout
              << "  KV capacity " << gib(s.kv_capacity_bytes);
    if (s.prefix_cache_bytes > 0) std::cout << " (shared prefix cached: " << gib(s.prefix_cache_bytes) << ")";
    std::cout << "\n";
  }
  if (!p.weights_fit) std::cout << "WARNING: weights do not fit in usable memory on some stage\n";
  for (const auto& pol : p.policies) {
    std::cout << "policy " << pol.policy;
    if (!pol.kv_dtype.empty()) std::cout << " (KV " << pol.kv_dtype << ")";
    std::cout << ": KV/seq per stage";
    for (size_t i = 0; i < pol.kv_bytes_per_seq.size(); ++i) {
      std::cout << (i ? ", " : " ") << mib(pol.kv_bytes_per_seq[i]);
      if (pol.kv_bytes_per_seq_peak[i] != pol.kv_bytes_per_seq[i]) std::cout << " (peak " << mib(pol.kv_bytes_per_seq_peak[i]) << ")";
    }
    std::cout << "  -> max sequences " << pol.max_seqs << " (tightest stage " << pol.tightest_stage << ")";
    if (pol.max_seqs_peak != pol.max_seqs) std::cout << ", " << pol.max_seqs_peak << " if all at peak";
    std::cout << "\n";
  }
}

void run_plan(const PlanArgs& a) {
  const ModelConfig mc = parse_model_config(read_text_file(a.model_config), a.model_config);
  const parallel::ModelShape m = model_shape(mc);

  parallel::PlanOptions o;
  o.tp = a.tp;
  o.pp = a.pp;
  o.gpu_memory_bytes = config::parse_byte_size(a.gpu_memory);
  o.context = parse_context(a.context);
  if (!a.shared_prefix.empty()) o.shared_prefix = parse_context(a.shared_prefix);
  o.reserve_fraction = a.reserve;
  o.block_size = a.block_size;
  o.layer_windows = mc.layer_windows;
  o.weight_bits = quantized_weight_bits(a.dtype);
  // Quantized weights compute in bfloat16 on a GPU (their KV cache's "auto" dtype).
  const std::string compute = o.weight_bits > 0 ? "bfloat16" : a.dtype;
  o.weight_dtype_bytes = dtype_bytes(compute);
  // "auto" as in cache.kv_cache_dtype / --kv-cache-dtype: the KV cache takes the compute dtype.
  const std::string kv = a.kv_dtype.empty() || a.kv_dtype == "auto" ? compute : a.kv_dtype;
  try {
    parallel::set_kv_dtype(o, kv);
  } catch (const KvError& e) {
    KV_FAIL("--kv-dtype: " << e.what());
  }

  std::map<std::string, std::string> params = parse_key_values(a.params, "--param");
  if (!a.budget.empty()) params["budget"] = a.budget;
  // budget_bytes: tokens per layer in the policy's KV dtype (a row is one token's K or V of one KV
  // head), the cache's unless the policy names its own (--param kv_dtype=int4).
  auto resolve = [&](PolicyConfig& p) {
    for (int64_t l = 0; l < mc.num_hidden_layers; ++l)
      if (mc.layer_window(l) > 0) p.local_layers.push_back(l);
    parallel::PlanOptions own = o;
    if (!p.kv_dtype.empty()) parallel::set_kv_dtype(own, p.kv_dtype);
    p.resolve_budget_bytes(2 * m.num_kv_heads * parallel::kv_row_bytes(own, m.head_dim), m.num_layers,
                           p.kv_dtype.empty() ? kv : p.kv_dtype);
  };
  std::vector<PolicyConfig> policies{make_policy_config("full")};
  resolve(policies[0]);
  if (a.policy != "full") {
    PolicyConfig p = make_policy_config(a.policy, params);
    if (p.kv_dtype == "ladder") {
      // The rung the engine would pick for a prompt of --context tokens (policies/kv_dtype_ladder.h).
      std::map<std::string, PolicyConfig> rungs;
      const std::string name = p.name;
      expand_kv_dtype_ladder(name, p, rungs);
      for (auto& [rung, cfg] : rungs) resolve(cfg);
      p = rungs.at(choose_kv_rung(rungs, name, o.context));
    } else {
      resolve(p);
    }
    policies.push_back(std::move(p));
  }

  const auto plan = parallel::make_shard_plan(m, o, policies);
  if (a.json) {
    std::cout << parallel::to_json(plan).dump(2) << "\n";
  } else {
    print_text(plan);
  }
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  auto* cmd = app.add_subcommand("plan", "per-GPU weights, KV bytes and max sequences of a TP x PP split");
  cmd->add_option("--model-config", a->model_config, "Hugging Face config.json")->required()->check(CLI::ExistingFile);
  cmd->add_option("--tp", a->tp, "tensor parallel size")->check(CLI::PositiveNumber);
  cmd->add_option("--pp", a->pp, "pipeline parallel size")->check(CLI::PositiveNumber);
  cmd->add_option("--gpu-memory", a->gpu_memory, "memory per GPU (e.g. 80GiB)")->capture_default_str();
  cmd->add_option("--context", a->context, "tokens per sequence (e.g. 32768 or 32k)")->capture_default_str();
  cmd->add_option("--policy", a->policy, "KV policy shown beside full")->capture_default_str();
  cmd->add_option("--shared-prefix", a->shared_prefix,
                  "leading tokens of the context every sequence shares, held once by the prefix cache (e.g. 8k)");
  cmd->add_option("--budget", a->budget, "policy budget: tokens per layer incl. the window, or a ratio in (0, 1)");
  cmd->add_option("--param", a->params, "policy parameter key=value (repeatable); kv_dtype=int4 holds the policy's KV in "
                  "that dtype, kv_dtype=ladder with budget_bytes=B shows the rung a prompt of --context tokens gets");
  cmd->add_option("--dtype", a->dtype, "weights: bfloat16, float16, float32, fp8, a GPU's groups of 128: int8 (8.25 bits), "
                  "int4 (tinygemm, 4.25 bits), or a GGUF's block type as a GPU holds it: q4_0, q4_1, q4_k (5 bits), "
                  "q8_0, q5_0 (9), q5_1, q5_k, q3_k, q6_k (10), q2_k (12)")->capture_default_str();
  cmd->add_option("--kv-dtype", a->kv_dtype, "KV cache dtype: auto (= --dtype, the default), bfloat16, float16, float32, fp8, int8 (q8_0), "
                  "int4 (q4_0), q4_1");
  cmd->add_option("--gpu-reserve-fraction", a->reserve, "fraction of GPU memory kept for activations/workspace")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 0.99));
  cmd->add_option("--block-size", a->block_size, "paged KV block size in tokens")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_flag("--json", a->json, "print JSON");
  cmd->callback([a] { run_plan(*a); });
}

}  // namespace kvserve::cli
