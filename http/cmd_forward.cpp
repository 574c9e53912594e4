// `kvserve forward`: runs one prompt through the model and writes every position's logits.
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "kv_check.h"
#include "llama_model.h"
#include "paged_kv_memory.h"
#include "policy_cli.h"
#include "safetensors_writer.h"

namespace kvserve::cli {

namespace {
struct ForwardArgs {
  std::string model, input_ids, output, device = "cpu", dtype, dump_kept;
  PolicyFlags policy;
};

std::vector<int64_t> read_ids(const std::string& path) {
  std::ifstream f(path);
  KV_CHECK(f, path << ": cannot open");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::parse_error& e) {
    KV_FAIL(path << ": malformed JSON: " << e.what());
  }
  KV_CHECK(j.is_array() && !j.empty(), path << ": expected a non-empty JSON list of token ids");
  std::vector<int64_t> ids;
  for (const auto& e : j) {
    KV_CHECK(e.is_number_integer(), path << ": token ids must be integers");
    ids.push_back(e.get<int64_t>());
  }
  return ids;
}
}  // namespace

void add_forward_command(CLI::App& app) {
  auto args = std::make_shared<ForwardArgs>();
  auto* cmd = app.add_subcommand("forward", "Run a prompt through the model and write all logits (.safetensors)");
  cmd->add_option("--model", args->model, "Hugging Face model directory")->required();
  cmd->add_option("--input-ids", args->input_ids, "JSON file with a list of token ids")->required();
  cmd->add_option("--output", args->output, "output .safetensors file (tensor 'logits' [seq, vocab] fp32)")->required();
  cmd->add_option("--device", args->device, "cpu, cuda or cuda:N");
  cmd->add_option("--dtype", args->dtype, "compute dtype: float32, bfloat16, float16");
  args->policy.add_to(cmd);
  cmd->add_option("--dump-kept", args->dump_kept,
                  "write the per-layer budgets and kept positions per KV head as JSON to this file");
  cmd->callback([args] {
    auto ids = read_ids(args->input_ids);
    auto model = LlamaModel::load(args->model, LoadOptions{args->device, args->dtype, true});
    const auto& c = model->config();
    KvPoolOptions pool;
    pool.num_kv_heads = c.num_key_value_heads;
    pool.head_dim = c.head_dim;
    pool.dtype = model->dtype();
    pool.device = model->device();
    // Room for the whole prompt in every layer: the policy decides, not the pool size.
    pool.num_blocks = c.num_hidden_layers * (static_cast<int64_t>(ids.size()) / pool.block_size + 2);
    const auto specs = args->policy.specs();
    const std::string policy = PolicyFlags::selected(specs);
    PagedKvMemory kv(c.num_hidden_layers, pool, resolve_policies(specs), policy);
    const int64_t seq = 0;
    auto logits = model->prefill(seq, ids, kv, /*all_logits=*/true, policy);
    if (!args->dump_kept.empty()) {
      nlohmann::json dump = {{"policy", to_json(kv.policy(policy))},
                             {"prompt_len", ids.size()},
                             {"budgets", kv.prefill_budgets(seq)},
                             {"layers", nlohmann::json::array()}};
      for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        auto pos = kv.cache().positions(seq, l).contiguous();
        nlohmann::json heads = nlohmann::json::array();
        for (int64_t h = 0; h < pos.size(0); ++h) {
          auto row = pos[h];
          heads.push_back(std::vector<int64_t>(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel()));
        }
        dump["layers"].push_back({{"layer", l}, {"kept", heads}});
      }
      std::ofstream f(args->dump_kept);
      KV_CHECK(f, args->dump_kept << ": cannot open for writing");
      f << dump.dump() << "\n";
    }
    kv.release(seq);
    write_safetensors(args->output, {{"logits", logits}});
  });
}

}  // namespace kvserve::cli
