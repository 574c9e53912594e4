// `kvserve policy budgets|select`: KV-policy budgets and kept positions without a model (for tests
// against the Python references), and `budgets --model` for a real prompt (DynamicKV's budgets
// depend on the prompt's attention scores).
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "backend/quantization/gguf_tokenizer.h"
#include "backend/model/safetensors_file.h"
#include "backend/sharded/parallel_job.h"
#include "cache_manager/kv_memory_factory.h"
#include "cli/cli_files.h"
#include "text/tokenizer.h"
#include "cli/commands.h"
#include "cli/policy_cli.h"
#include "common/check.h"
#include "policies/budget_allocator.h"
#include "policies/policy_config.h"
#include "policies/prefill_selector.h"

namespace kvserve::cli {

namespace {

// Options shared by both subcommands.
struct PolicyArgs {
  std::string policy;
  std::string budget;
  std::vector<std::string> params;
};

void add_policy_args(CLI::App* cmd, PolicyArgs& a) {
  cmd->add_option("--policy", a.policy, "policy name (" + policy_name_list() + ")")
      ->required();
  cmd->add_option("--budget", a.budget, "tokens per layer incl. the window, or a ratio in (0, 1)");
  cmd->add_option("--param", a.params, "policy parameter key=value (repeatable)");
}

PolicyConfig build_config(const PolicyArgs& a) {
  std::map<std::string, std::string> params = parse_key_values(a.params, "--param");
  if (!a.budget.empty()) params["budget"] = a.budget;
  return make_policy_config(a.policy, params);
}

torch::Tensor load_tensor(const SafetensorsFile& f, const std::string& name) {
  const auto& e = f.at(name);
  torch::ScalarType t;
  if (e.dtype == "F32") {
    t = torch::kFloat32;
  } else if (e.dtype == "BF16") {
    t = torch::kBFloat16;
  } else if (e.dtype == "F16") {
    t = torch::kFloat16;
  } else {
    KV_FAIL(f.path() << ": tensor '" << name << "' has dtype " << e.dtype << " (want F32, BF16 or F16)");
  }
  KV_CHECK(e.shape.size() == 3, f.path() << ": tensor '" << name << "' must be 3-D, got " << e.shape.size() << "-D");
  // Copy out of the mapping (the data may be unaligned for the dtype).
  auto out = torch::empty(e.shape, torch::TensorOptions().dtype(t));
  KV_CHECK(static_cast<size_t>(out.nbytes()) == e.nbytes, f.path() << ": tensor '" << name << "' size mismatch");
  std::memcpy(out.data_ptr(), e.data, e.nbytes);
  return out;
}

nlohmann::json positions_json(const torch::Tensor& kept) {
  auto c = kept.to(torch::kCPU).contiguous();
  nlohmann::json heads = nlohmann::json::array();
  for (int64_t h = 0; h < c.size(0); ++h) {
    const int64_t* p = c.data_ptr<int64_t>() + h * c.size(1);
    heads.push_back(std::vector<int64_t>(p, p + c.size(1)));
  }
  return heads;
}

void run_budgets(const PolicyArgs& a, int64_t prompt_len, int64_t layers, int64_t kv_heads) {
  auto cfg = build_config(a);
  auto plan = allocate_layer_budgets(cfg, prompt_len, layers);
  nlohmann::json j;
  j["policy"] = to_json(cfg);
  j["prompt_len"] = prompt_len;
  j["layers"] = layers;
  j["kv_heads"] = kv_heads;
  j["budgets"] = kept_counts(plan, prompt_len);
  // DynamicKV's final budgets depend on scores: these are its candidate sets (use `select`).
  j["dynamic_candidates"] = cfg.allocator == AllocatorKind::kDynamic;
  std::cout << j.dump() << "\n";
}

// A real prompt for `policy budgets --model`.
struct PromptArgs {
  std::string model, prompt, prompt_file, input_ids, device = "cpu", dtype;
};

// Prefills the prompt with the policy (one process) and prints the budgets each layer ended with.
void run_prompt_budgets(const PolicyArgs& a, const PromptArgs& p) {
  const int given = !p.prompt.empty() + !p.prompt_file.empty() + !p.input_ids.empty();
  KV_CHECK(given == 1, "policy budgets --model: give exactly one of --prompt, --prompt-file, --input-ids");
  auto cfg = build_config(a);
  LoadOptions load;
  load.device = p.device;
  load.dtype = p.dtype;
  load.progress = false;
  auto job = ParallelJob::start(ParallelOptions{}, p.model, load);
  auto model = job->model();
  std::vector<int64_t> ids;
  if (!p.input_ids.empty()) {
    ids = token_ids_of(read_json_file(p.input_ids), p.input_ids);
  } else {
    std::string text = p.prompt;
    if (!p.prompt_file.empty()) {
      std::ifstream f(p.prompt_file);
      KV_CHECK(f.good(), "--prompt-file " << p.prompt_file << ": cannot open");
      text.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    }
    ids = load_model_tokenizer(p.model).encode(text);
  }
  KV_CHECK(!ids.empty(), "policy budgets --model: the prompt is empty");
  const auto& layout = model->layout();
  KvPoolSize size;  // every layer's whole prompt plus one compaction copy: the policy decides
  size.num_blocks = (layout.num_layers() + 1) * (static_cast<int64_t>(ids.size()) / size.block_size + 2);
  std::map<std::string, PolicyConfig> policies{{cfg.name, cfg}};
  auto memory = make_kv_memory(model->kv_layout(), size, policies, cfg.name, job->kv_shard());
  model->prefill(0, ids, *memory, /*all_logits=*/false, cfg.name);
  const auto& budgets = memory->prefill_budgets(0);
  int64_t total = 0;
  for (int64_t b : budgets) total += b;
  nlohmann::json j;
  j["policy"] = to_json(cfg);
  j["prompt_len"] = ids.size();
  j["layers"] = budgets.size();
  j["budgets"] = budgets;
  j["total"] = total;
  j["full_total"] = static_cast<int64_t>(ids.size() * budgets.size());
  memory->release(0);
  std::cout << j.dump() << "\n";
}

void run_select(const PolicyArgs& a, const std::string& qk_path, const std::string& out_path) {
  auto cfg = build_config(a);
  SafetensorsFile f(qk_path);
  int64_t layers = 0;
  while (f.contains("k." + std::to_string(layers))) ++layers;
  KV_CHECK(layers > 0, qk_path << ": no tensor 'k.0' (want q.{layer} [H,T,D] and k.{layer} [KV,T,D])");
  const auto k0 = load_tensor(f, "k.0");
  const int64_t kv = k0.size(0), prompt_len = k0.size(1);
  PrefillSelector sel(cfg, layers, kv, prompt_len);
  std::vector<torch::Tensor> kept(layers);
  for (int64_t l = 0; l < layers; ++l) {
    auto k = l == 0 ? k0 : load_tensor(f, "k." + std::to_string(l));
    const std::string qn = "q." + std::to_string(l);
    torch::Tensor q = f.contains(qn) ? load_tensor(f, qn) : torch::Tensor();
    kept[l] = sel.on_layer(l, q, k);
    for (auto& [layer, positions] : sel.take_updates()) kept[layer] = positions;
  }
  sel.finish();
  for (auto& [layer, positions] : sel.take_updates()) kept[layer] = positions;
  nlohmann::json j;
  j["policy"] = to_json(cfg);
  j["prompt_len"] = prompt_len;
  j["budgets"] = sel.budgets();
  j["layers"] = nlohmann::json::array();
  for (int64_t l = 0; l < layers; ++l) j["layers"].push_back({{"layer", l}, {"kept", positions_json(kept[l])}});
  std::ofstream out(out_path);
  KV_CHECK(out.good(), "cannot write " << out_path);
  out << j.dump() << "\n";
  KV_CHECK(out.good(), "error writing " << out_path);
}

}  // namespace

void add_policy_commands(CLI::App& app) {
  auto* policy = app.add_subcommand("policy", "inspect KV-compression policies (budgets, kept positions)");
  policy->require_subcommand(1);

  auto budgets_args = std::make_shared<PolicyArgs>();
  auto prompt_len = std::make_shared<int64_t>(0);
  auto layers = std::make_shared<int64_t>(0);
  auto kv_heads = std::make_shared<int64_t>(1);
  auto prompt = std::make_shared<PromptArgs>();
  auto* budgets = policy->add_subcommand(
      "budgets", "print per-layer kept-token budgets as JSON: from --prompt-len/--layers, or (DynamicKV's, which "
                 "depend on the prompt) from a --model run on a prompt");
  add_policy_args(budgets, *budgets_args);
  budgets->add_option("--prompt-len", *prompt_len, "prompt length in tokens (without --model)")->check(CLI::PositiveNumber);
  budgets->add_option("--layers", *layers, "number of layers (without --model)")->check(CLI::PositiveNumber);
  budgets->add_option("--kv-heads", *kv_heads, "KV heads per layer")->check(CLI::PositiveNumber);
  budgets->add_option("--model", prompt->model, "model directory: prefill the prompt and print the budgets it got");
  budgets->add_option("--prompt", prompt->prompt, "prompt text (with --model; tokenized as is, no chat template)");
  budgets->add_option("--prompt-file", prompt->prompt_file, "file holding the prompt text (with --model)");
  budgets->add_option("--input-ids", prompt->input_ids, "JSON file with the prompt's token ids (with --model)");
  budgets->add_option("--device", prompt->device, "cpu, cuda or cuda:N (with --model)");
  budgets->add_option("--dtype", prompt->dtype, "compute dtype (with --model)");
  budgets->callback([=] {
    if (!prompt->model.empty()) return run_prompt_budgets(*budgets_args, *prompt);
    KV_CHECK(*prompt_len > 0 && *layers > 0, "policy budgets: give --prompt-len and --layers, or --model and a prompt");
    run_budgets(*budgets_args, *prompt_len, *layers, *kv_heads);
  });

  auto select_args = std::make_shared<PolicyArgs>();
  auto qk = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto* select = policy->add_subcommand("select", "kept positions per layer and KV head for given q/k tensors");
  add_policy_args(select, *select_args);
  select->add_option("--qk", *qk, "safetensors with q.{layer} [H,T,D] and k.{layer} [KV,T,D]")->required();
  select->add_option("--out", *out, "output JSON file")->required();
  select->callback([=] { run_select(*select_args, *qk, *out); });
}

}  // namespace kvserve::cli
