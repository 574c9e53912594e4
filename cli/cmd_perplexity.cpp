// `kvserve perplexity`: teacher-forced perplexity of token sequences, decoded one token at a time
// through the paged KV memory, so a policy's decode-time eviction (decode_budget) is what the model
// sees -- the language-modelling check of the key-L2-norm paper (perplexity against kept KV).
#include <cmath>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "backend/model/decoder_model.h"
#include "cache_manager/kv_memory_factory.h"
#include "cli/cli_files.h"
#include "cli/commands.h"
#include "cli/kv_cache_dtype_cli.h"
#include "cli/quantization_cli.h"
#include "cli/policy_cli.h"
#include "common/check.h"

namespace kvserve::cli {

namespace {
struct PerplexityArgs {
  std::string model, input_ids, device = "cpu", dtype, cpu_gemm = "mkl", kv_cache_dtype = "auto", quantization = "none";
  PolicyFlags policy;
  int64_t prefill = 1;
  bool per_token = false;
};

// A JSON list of token ids, or a list of such lists (documents).
std::vector<std::vector<int64_t>> read_docs(const std::string& path) {
  const nlohmann::json j = read_json_file(path);
  KV_CHECK(j.is_array() && !j.empty(), path << ": expected a JSON list of token ids or a list of lists");
  std::vector<std::vector<int64_t>> docs;
  auto one = [&](const nlohmann::json& a) {
    std::vector<int64_t> ids = token_ids_of(a, path);
    KV_CHECK(ids.size() >= 2, path << ": every document needs at least 2 tokens");
    docs.push_back(std::move(ids));
  };
  if (j[0].is_array()) {
    for (const auto& d : j) one(d);
  } else {
    one(j);
  }
  return docs;
}

// -log softmax(logits)[target] for each row; logits [N, V] fp32.
std::vector<double> nll_rows(const torch::Tensor& logits, const std::vector<int64_t>& targets) {
  auto lp = torch::log_softmax(logits.to(torch::kFloat32).cpu(), -1);
  auto t = torch::tensor(targets, torch::kInt64).unsqueeze(1);
  auto g = lp.gather(1, t).squeeze(1).contiguous();
  std::vector<double> out(g.size(0));
  for (int64_t i = 0; i < g.size(0); ++i) out[i] = -g[i].item<double>();
  return out;
}
}  // namespace

void add_perplexity_command(CLI::App& app) {
  auto a = std::make_shared<PerplexityArgs>();
  auto* cmd = app.add_subcommand(
      "perplexity", "Teacher-forced perplexity, token by token through the KV cache (decode-time eviction applies)");
  cmd->add_option("--model", a->model, "Hugging Face model directory")->required();
  cmd->add_option("--input-ids", a->input_ids, "JSON file: a list of token ids, or a list of documents (lists)")
      ->required();
  cmd->add_option("--prefill", a->prefill, "tokens of each document prefilled at once (the rest is decoded)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--device", a->device, "cpu, cuda or cuda:N");
  cmd->add_option("--dtype", a->dtype, "compute dtype: float32, bfloat16, float16");
  cmd->add_option("--cpu-gemm", a->cpu_gemm, "mkl (default; logits equal transformers') or onednn (faster prefill on AMD CPUs)")
      ->check(CLI::IsMember({"mkl", "onednn"}));
  add_kv_cache_dtype_option(cmd, a->kv_cache_dtype);
  add_quantization_option(cmd, a->quantization);
  cmd->add_flag("--per-token", a->per_token, "also print every scored token's NLL per document");
  a->policy.add_to(cmd);
  cmd->callback([a] {
    const auto docs = read_docs(a->input_ids);
    LoadOptions load{a->device, a->dtype, false};
    load.cpu_gemm = cpu_gemm_from_name(a->cpu_gemm);
    load.kv_cache_dtype = a->kv_cache_dtype;
    load.quantization = a->quantization;
    auto model = DecoderModel::load(a->model, load);
    const auto& c = model->config();
    KvPoolSize size;
    int64_t blocks = 0;
    for (const auto& d : docs) blocks += static_cast<int64_t>(d.size()) / size.block_size + 2;
    // Every document whole in every layer, three times over: kvzip's and kvzap's selection runs
    // over the prompt's KV before it is compacted (with room for one copy they exhausted the pool).
    size.num_blocks = 3 * c.num_hidden_layers * blocks;
    const auto specs = a->policy.specs();
    const std::string policy = PolicyFlags::selected(specs);
    auto memory = make_kv_memory(model->kv_layout(), size, resolve_policies(specs), policy);
    PagedKvMemory& kv = *memory;

    const int64_t n = static_cast<int64_t>(docs.size());
    std::vector<std::vector<double>> nll(n);
    std::vector<double> visible_sum(n, 0.0);  // sum over decode steps of mean(cached / context)
    std::vector<int64_t> visible_steps(n, 0);
    for (int64_t s = 0; s < n; ++s) {
      const auto& d = docs[s];
      const int64_t p = std::min<int64_t>(a->prefill, static_cast<int64_t>(d.size()) - 1);
      std::vector<int64_t> head(d.begin(), d.begin() + p);
      auto logits = model->prefill(s, head, kv, /*all_logits=*/true, policy);
      std::vector<int64_t> targets(d.begin() + 1, d.begin() + p + 1);
      nll[s] = nll_rows(logits, targets);
    }
    // Decode all documents together, one position per step, feeding the true tokens.
    int64_t max_len = 0;
    for (const auto& d : docs) max_len = std::max<int64_t>(max_len, d.size());
    for (int64_t t = 1; t < max_len - 1; ++t) {
      DecodeBatch batch;
      std::vector<int64_t> tokens, targets;
      for (int64_t s = 0; s < n; ++s) {
        const auto& d = docs[s];
        const int64_t p = std::min<int64_t>(a->prefill, static_cast<int64_t>(d.size()) - 1);
        if (t < p || t + 1 >= static_cast<int64_t>(d.size())) continue;
        batch.seq_ids.push_back(s);
        batch.positions.push_back(t);
        tokens.push_back(d[t]);
        targets.push_back(d[t + 1]);
      }
      if (batch.seq_ids.empty()) continue;
      auto logits = model->decode(batch, tokens, kv);
      auto rows = nll_rows(logits, targets);
      for (size_t i = 0; i < batch.seq_ids.size(); ++i) {
        const int64_t s = batch.seq_ids[i];
        nll[s].push_back(rows[i]);
        double frac = 0.0;
        for (int64_t l = 0; l < c.num_hidden_layers; ++l)
          frac += static_cast<double>(kv.cached_tokens(s, l)) / static_cast<double>(t + 1);
        visible_sum[s] += frac / static_cast<double>(c.num_hidden_layers);
        visible_steps[s] += 1;
      }
    }
    nlohmann::json out = {{"policy", policy}, {"documents", nlohmann::json::array()}};
    if (!specs.empty()) out["policy_config"] = to_json(kv.policy(policy));
    double total = 0.0, vis = 0.0;
    int64_t count = 0, vis_steps = 0;
    for (int64_t s = 0; s < n; ++s) {
      double sum = 0.0;
      for (double x : nll[s]) sum += x;
      total += sum;
      count += static_cast<int64_t>(nll[s].size());
      vis += visible_sum[s];
      vis_steps += visible_steps[s];
      nlohmann::json doc = {{"tokens", docs[s].size()},
                            {"scored", nll[s].size()},
                            {"nll", sum},
                            {"perplexity", std::exp(sum / static_cast<double>(nll[s].size()))},
                            {"mean_visible_fraction",
                             visible_steps[s] ? visible_sum[s] / static_cast<double>(visible_steps[s]) : 1.0},
                            {"final_cached", nlohmann::json::array()}};
      for (int64_t l = 0; l < c.num_hidden_layers; ++l) doc["final_cached"].push_back(kv.cached_tokens(s, l));
      if (a->per_token) doc["nll_per_token"] = nll[s];
      out["documents"].push_back(doc);
      kv.release(s);
    }
    out["scored"] = count;
    out["mean_nll"] = total / static_cast<double>(count);
    out["perplexity"] = std::exp(total / static_cast<double>(count));
    out["mean_visible_fraction"] = vis_steps ? vis / static_cast<double>(vis_steps) : 1.0;
    std::cout << out.dump() << "\n";
  });
}

}  // namespace kvserve::cli
