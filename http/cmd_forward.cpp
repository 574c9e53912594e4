// `kvserve forward`: runs one prompt through the model and writes every position's logits.
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "contiguous_kv_cache.h"
#include "kv_check.h"
#include "llama_model.h"
#include "safetensors_writer.h"

namespace kvserve::cli {

namespace {
struct ForwardArgs {
  std::string model, input_ids, output, device = "cpu", dtype;
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
  cmd->callback([args] {
    auto ids = read_ids(args->input_ids);
    auto model = LlamaModel::load(args->model, LoadOptions{args->device, args->dtype, true});
    const auto& c = model->config();
    ContiguousKvCache kv(c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                         torch::TensorOptions().dtype(model->dtype()).device(model->device()));
    auto logits = model->prefill(0, ids, kv, /*all_logits=*/true);
    write_safetensors(args->output, {{"logits", logits}});
  });
}

}  // namespace kvserve::cli
