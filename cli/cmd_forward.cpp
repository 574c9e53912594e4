// `kvserve forward`: runs one prompt through the model and writes every position's logits.
#include <algorithm>
#include <fstream>
#include <map>
#include <iostream>
#include <nlohmann/json.hpp>

#include "backend/model/decoder_model.h"
#include "backend/model/safetensors_writer.h"
#include "backend/sharded/sharded_executor.h"
#include "cache_manager/kv_memory_factory.h"
#include "cli/cli_files.h"
#include "cli/commands.h"
#include "cli/kv_cache_dtype_cli.h"
#include "cli/quantization_cli.h"
#include "cli/parallel_cli.h"
#include "cli/policy_cli.h"
#include "common/check.h"
#include "parallel/communicator.h"

namespace kvserve::cli {

namespace {
struct ForwardArgs {
  std::string model, input_ids, output, device = "cpu", dtype, dump_kept, cpu_gemm = "mkl";
  std::string kv_cache_dtype = "auto", quantization = "none";
  PolicyFlags policy;
  ParallelFlags parallel;
};

// This shard's budgets and kept positions, with where its layers and KV heads sit in the model.
nlohmann::json shard_dump(const PagedKvMemory& kv, const ShardLayout& s, int64_t seq) {
  nlohmann::json layers = nlohmann::json::array();
  for (int64_t l = s.layer_begin; l < s.layer_end; ++l) {
    auto pos = kv.kept_positions(seq, l).cpu().contiguous();
    nlohmann::json heads = nlohmann::json::array();
    for (int64_t h = 0; h < pos.size(0); ++h) {
      auto row = pos[h];
      std::vector<int64_t> kept(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
      kept.erase(std::remove(kept.begin(), kept.end(), int64_t{-1}), kept.end());  // a shorter head's padding
      heads.push_back(std::move(kept));
    }
    layers.push_back({{"layer", l}, {"kept", heads}});
  }
  return {{"stage", s.stage},
          {"tp_rank", s.tp_rank},
          {"layer_begin", s.layer_begin},
          {"layer_end", s.layer_end},
          {"kv_head_begin", s.kv_head_begin},
          {"kv_heads", s.kv_heads},
          {"budgets", kv.prefill_budgets(seq)},
          {"layers", layers}};
}

// Rank 0 collects every rank's part and merges them into the single-process layout: layers in
// order, each layer's KV heads in order (a replicated KV head once). Other ranks get `part` back.
nlohmann::json gather_dumps(parallel::ProcessGroup& world, const nlohmann::json& part) {
  const std::string text = part.dump();
  if (world.rank() != 0) {
    world.send_tensor(torch::from_blob(const_cast<char*>(text.data()), {static_cast<int64_t>(text.size())}, torch::kUInt8).clone(), 0, 7);
    world.wait_sends();
    return part;
  }
  std::vector<nlohmann::json> parts{part};
  for (int r = 1; r < world.size(); ++r) {
    auto t = world.recv_tensor(r, 7, torch::kCPU).contiguous();
    parts.push_back(nlohmann::json::parse(std::string(reinterpret_cast<const char*>(t.data_ptr<uint8_t>()), t.numel())));
  }
  std::map<int64_t, std::map<int64_t, nlohmann::json>> heads;  // layer -> kv head -> kept
  std::map<int64_t, int64_t> budgets;
  nlohmann::json shards = nlohmann::json::array();
  for (const auto& p : parts) {
    shards.push_back({{"stage", p["stage"]}, {"tp_rank", p["tp_rank"]}, {"layer_begin", p["layer_begin"]},
                      {"layer_end", p["layer_end"]}, {"kv_head_begin", p["kv_head_begin"]}, {"kv_heads", p["kv_heads"]},
                      {"budgets", p["budgets"]}});
    const int64_t first = p["layer_begin"].get<int64_t>(), h0 = p["kv_head_begin"].get<int64_t>();
    for (size_t i = 0; i < p["budgets"].size(); ++i) budgets.emplace(first + static_cast<int64_t>(i), p["budgets"][i].get<int64_t>());
    for (const auto& layer : p["layers"]) {
      const int64_t l = layer["layer"].get<int64_t>();
      for (size_t h = 0; h < layer["kept"].size(); ++h) heads[l].emplace(h0 + static_cast<int64_t>(h), layer["kept"][h]);
    }
  }
  nlohmann::json merged = {{"budgets", nlohmann::json::array()}, {"layers", nlohmann::json::array()}, {"shards", shards}};
  for (const auto& [l, b] : budgets) merged["budgets"].push_back(b);
  for (const auto& [l, hs] : heads) {
    nlohmann::json kept = nlohmann::json::array();
    for (const auto& [h, k] : hs) kept.push_back(k);
    merged["layers"].push_back({{"layer", l}, {"kept", kept}});
  }
  return merged;
}

std::vector<int64_t> read_ids(const std::string& path) {
  const nlohmann::json j = read_json_file(path);
  KV_CHECK(j.is_array() && !j.empty(), path << ": expected a non-empty JSON list of token ids");
  return token_ids_of(j, path);
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
  cmd->add_option("--cpu-gemm", args->cpu_gemm, "mkl (default; logits equal transformers') or onednn (faster prefill on AMD CPUs)")
      ->check(CLI::IsMember({"mkl", "onednn"}));
  add_kv_cache_dtype_option(cmd, args->kv_cache_dtype);
  add_quantization_option(cmd, args->quantization);
  args->policy.add_to(cmd);
  cmd->add_option("--dump-kept", args->dump_kept,
                  "write the per-layer budgets and kept positions per KV head as JSON to this file");
  args->parallel.add_to(cmd);
  cmd->callback([args] {
    auto ids = read_ids(args->input_ids);
    LoadOptions load;
    load.device = args->device;
    load.dtype = args->dtype;
    load.cpu_gemm = cpu_gemm_from_name(args->cpu_gemm);
    load.kv_cache_dtype = args->kv_cache_dtype;
    load.quantization = args->quantization;
    // Every rank of a sharded job runs this same command on the same prompt (SPMD).
    auto job = ParallelJob::start(args->parallel.apply(), args->model, load);
    auto model = job->model();
    const ShardLayout& layout = model->layout();
    // Room for the whole prompt in every layer, plus one layer's compaction copy (DynamicKV shrinks
    // a layer into fresh blocks): the policy decides, not the pool size.
    KvPoolSize size;
    size.num_blocks = (layout.num_layers() + 1) * (static_cast<int64_t>(ids.size()) / size.block_size + 2);
    const auto specs = args->policy.specs();
    const std::string policy = PolicyFlags::selected(specs);
    auto policies = resolve_policies(specs);
    // Head-wise blocks hold one KV head each: as many more blocks for the same room.
    if (uses_head_blocks(size.layout, policies)) size.num_blocks *= model->kv_layout().num_kv_heads;
    auto memory = make_kv_memory(model->kv_layout(), size, std::move(policies), policy, job->kv_shard());
    PagedKvMemory& kv = *memory;
    const int64_t seq = 0;
    torch::Tensor logits;
    if (job->sharded()) {
      ShardedExecutor exec(model, kv, job->groups(), job->options().micro_batches);
      logits = exec.prefill(seq, ids, policy, /*all_logits=*/true);
    } else {
      logits = model->prefill(seq, ids, kv, /*all_logits=*/true, policy);
    }
    if (!args->dump_kept.empty()) {
      nlohmann::json part = shard_dump(kv, layout, seq);
      if (job->sharded()) part = gather_dumps(*job->groups().world, part);
      if (job->is_driver()) {
        nlohmann::json dump = {{"policy", to_json(kv.policy(policy))},
                               {"prompt_len", ids.size()},
                               {"budgets", part["budgets"]},
                               {"layers", part["layers"]}};
        if (job->sharded()) dump["shards"] = part["shards"];
        std::ofstream f(args->dump_kept);
        KV_CHECK(f, args->dump_kept << ": cannot open for writing");
        f << dump.dump() << "\n";
      }
    }
    kv.release(seq);
    // A rank whose part ended early (a first stage's other TP ranks, while the last stage still sends
    // rank 0 the logits) would exit first, and the launcher takes an early exit for a failure.
    if (job->sharded()) job->groups().world->barrier();
    if (job->is_driver()) write_safetensors(args->output, {{"logits", logits}});
    job->join_workers();
  });
}

}  // namespace kvserve::cli
