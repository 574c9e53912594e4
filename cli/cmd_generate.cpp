// `kvserve generate`: one prompt through the engine, printed as text or as one JSON object.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <limits>
#include <mutex>
#include <iostream>
#include <nlohmann/json.hpp>

#include "backend/engine/engine.h"
#include "backend/model/decoder_model.h"
#include "backend/model/checkpoint.h"
#include "backend/quantization/gguf_tokenizer.h"
#include "cache_manager/kv_block_pool.h"
#include "cli/cli_files.h"
#include "cli/commands.h"
#include "cli/kv_cache_dtype_cli.h"
#include "cli/quantization_cli.h"
#include "cli/speculative_cli.h"
#include "cli/parallel_cli.h"
#include "cli/policy_cli.h"
#include "common/check.h"
#include "common/fresh_thread.h"
#include "configs/server_config.h"
#include "text/tokenizer.h"

namespace kvserve::cli {

namespace {
struct GenerateArgs {
  std::string model, prompt, prompts_file, device = "cpu", dtype, cpu_gemm = "mkl";
  PolicyFlags policy;
  ParallelFlags parallel;
  std::vector<int64_t> prompt_ids;
  int64_t max_tokens = 64;
  double temperature = 0.0, top_p = 1.0, min_p = 0.0, repetition_penalty = 1.0;
  int64_t top_k = 0;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool json = false, ignore_eos = false, stream = false, enforce_eager = false;
  std::string kv_cache = "1GiB";
  int64_t max_num_batched_tokens = EngineOptions{}.max_num_batched_tokens;
  int64_t warmup_tokens = EngineOptions{}.warmup_tokens;
  bool enable_chunked_prefill = false;
  bool enable_prefix_caching = EngineOptions{}.enable_prefix_caching;
  std::string prefix_cache = "0";
  std::string kv_cache_dtype = "auto", quantization = "none", tokenizer;
  std::string kv_layout = "auto";
  std::string speculative_config;  // JSON; empty = none
};

}  // namespace

void add_generate_command(CLI::App& app) {
  auto a = std::make_shared<GenerateArgs>();
  auto* cmd = app.add_subcommand("generate", "Generate a completion for one prompt");
  cmd->add_option("--model", a->model, "Hugging Face model directory or .gguf file")->required();
  cmd->add_option("--tokenizer", a->tokenizer, "directory with tokenizer.json (default: the model directory; for a .gguf file the tokenizer.json beside it, else the file's own tokenizer metadata)");
  auto* p = cmd->add_option("--prompt", a->prompt, "prompt text (tokenized with the model's tokenizer)");
  auto* pi = cmd->add_option("--prompt-ids", a->prompt_ids, "prompt as token ids (instead of --prompt)");
  p->excludes(pi);
  cmd->add_option("--prompts-file", a->prompts_file,
                  "JSON list of prompts (strings or token-id lists), generated together in one batch");
  cmd->add_option("--max-tokens", a->max_tokens, "tokens to generate at most")->check(CLI::Range(1, 1 << 24));
  cmd->add_option("--temperature", a->temperature, "0 = greedy")->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--top-p", a->top_p)->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--top-k", a->top_k)->check(CLI::Range(int64_t{0}, int64_t{1} << 31));
  cmd->add_option("--min-p", a->min_p)->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--repetition-penalty", a->repetition_penalty)->check(CLI::Range(0.01, 100.0));
  cmd->add_option("--seed", a->seed, "sampling seed (reproducible)");
  cmd->add_option("--stop", a->stop, "stop string (repeatable)");
  cmd->add_flag("--ignore-eos", a->ignore_eos, "keep generating past end-of-sequence tokens");
  cmd->add_option("--device", a->device, "cpu, cuda or cuda:N");
  cmd->add_option("--dtype", a->dtype, "compute dtype: float32, bfloat16, float16");
  cmd->add_option("--cpu-gemm", a->cpu_gemm, "mkl (default; logits equal transformers') or onednn (faster prefill on AMD CPUs)")
      ->check(CLI::IsMember({"mkl", "onednn"}));
  cmd->add_option("--kv-cache", a->kv_cache, "KV cache size, e.g. 512MiB");
  cmd->add_option("--kv-layout", a->kv_layout, "KV block layout: auto (head-wise for head_budgets=adaptive), layer, head")
      ->check(CLI::IsMember({"auto", "layer", "head"}));
  cmd->add_option("--max-num-batched-tokens", a->max_num_batched_tokens, "prompt tokens prefilled per step")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  cmd->add_flag("--enable-chunked-prefill", a->enable_chunked_prefill,
                "prefill prompts longer than --max-num-batched-tokens over several steps");
  cmd->add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", a->enable_prefix_caching,
                "reuse the cached blocks of earlier prompts with the same prefix (default on)");
  cmd->add_option("--prefix-cache", a->prefix_cache, "host-RAM tier of the prefix cache, e.g. 4GiB (0 = none)");
  add_kv_cache_dtype_option(cmd, a->kv_cache_dtype);
  add_quantization_option(cmd, a->quantization);
  add_speculative_option(cmd, a->speculative_config);
  cmd->add_flag("--enforce-eager", a->enforce_eager, "decode without CUDA graphs (they are used on CUDA otherwise)");
  cmd->add_option("--warmup-tokens", a->warmup_tokens,
                  "prompt tokens of the engine's warm-up before the prompts (-1 = auto: the token budget on CUDA, none "
                  "on CPU; 0 = off); its time is reported apart from the prompts' (timings.warmup_s)")
      ->check(CLI::Range(int64_t{-1}, int64_t{1} << 40));
  a->policy.add_to(cmd);
  a->parallel.add_to(cmd);
  cmd->add_flag("--json", a->json, "print one JSON object with text, token_ids, counts and timings");
  cmd->callback([a] {
    KV_CHECK(!a->prompt.empty() || !a->prompt_ids.empty() || !a->prompts_file.empty(),
             "generate: give --prompt, --prompt-ids or --prompts-file");
    auto t0 = std::chrono::steady_clock::now();
    LoadOptions load;
    load.device = a->device;
    load.dtype = a->dtype;
    load.cpu_gemm = cpu_gemm_from_name(a->cpu_gemm);
    load.kv_cache_dtype = a->kv_cache_dtype;
    load.quantization = a->quantization;
    load.progress = !a->json;
    auto job = ParallelJob::start(a->parallel.apply(), a->model, load);
    auto model = job->model();
    EngineOptions eo;
    try {
      eo.kv_cache_bytes = config::parse_byte_size(a->kv_cache);
    } catch (const std::invalid_argument& e) {
      KV_FAIL("--kv-cache: " << e.what());
    }
    try {
      eo.prefix_cache_bytes = config::parse_byte_size(a->prefix_cache);
    } catch (const std::invalid_argument& e) {
      KV_FAIL("--prefix-cache: " << e.what());
    }
    eo.policies = a->policy.specs();
    eo.default_policy = PolicyFlags::selected(eo.policies);
    eo.max_num_batched_tokens = a->max_num_batched_tokens;
    eo.enable_chunked_prefill = a->enable_chunked_prefill;
    eo.enable_prefix_caching = a->enable_prefix_caching;
    eo.enforce_eager = a->enforce_eager;
    eo.warmup_tokens = a->warmup_tokens;
    eo.kv_layout = parse_kv_layout(a->kv_layout);
    if (!a->speculative_config.empty())
      eo.speculative = parse_speculative_config_json(a->speculative_config, "--speculative-config");
    // A prompts file is one batch, queued whole: no bound on the queue.
    eo.max_waiting = std::numeric_limits<int32_t>::max();
    if (!job->is_driver()) {  // another rank of a sharded job: follow rank 0's steps
      const int rc = job->run_worker(eo);
      if (rc != 0) throw CLI::RuntimeError(rc);
      return;
    }
    auto tok = std::make_shared<Tokenizer>(load_model_tokenizer(a->tokenizer.empty() ? a->model : a->tokenizer));
    // The engine's start-up (KV pool, warm-up) runs on a thread that ends, as the load does
    // (common/fresh_thread.h): no idle OpenMP pool outlives it to slow the engine thread's steps.
    auto engine_ptr = run_on_fresh_thread([&] { return std::make_unique<Engine>(model, tok, eo, job->make_runner(eo)); });
    Engine& engine = *engine_ptr;
    job->set_on_failure([&engine](const std::string& why) { engine.mark_unhealthy(why); });
    auto t_loaded = std::chrono::steady_clock::now();

    std::vector<std::vector<int64_t>> prompts;
    if (!a->prompts_file.empty()) {
      const nlohmann::json j = read_json_file(a->prompts_file);
      KV_CHECK(j.is_array() && !j.empty(), a->prompts_file << ": expected a non-empty JSON list of prompts");
      for (size_t i = 0; i < j.size(); ++i) {
        if (j[i].is_string()) {
          prompts.push_back(tok->encode(j[i].get<std::string>()));
        } else if (j[i].is_array() && std::all_of(j[i].begin(), j[i].end(), [](auto& e) { return e.is_number_integer(); })) {
          prompts.push_back(j[i].get<std::vector<int64_t>>());
        } else {
          KV_FAIL(a->prompts_file << ": prompt " << i << " must be a string or a list of token ids");
        }
      }
    } else {
      prompts.push_back(a->prompt_ids.empty() ? tok->encode(a->prompt) : a->prompt_ids);
    }

    // One result per prompt, filled by engine callbacks (engine thread) and read after all finish.
    struct Result {
      std::string text, finish_reason, error, kv_cache_dtype;
      std::vector<int64_t> ids;
      int64_t prompt_tokens = 0, kept_kv = 0, full_kv = 0, head_min = 0, head_max = 0, token_layer_bytes = 0;
      double head_mean = 0.0;
      std::optional<std::chrono::steady_clock::time_point> t_first, t_end;
    };
    std::vector<Result> results(prompts.size());
    std::mutex mu;
    std::condition_variable cv;
    size_t finished = 0;
    const bool print_text = !a->json && prompts.size() == 1;
    // All prompts queued together (Engine::submit_all): they meet the scheduler in the same step.
    std::vector<Submission> batch;
    for (size_t i = 0; i < prompts.size(); ++i) {
      GenerationRequest req;
      req.request_id = "cli-" + std::to_string(i);
      req.prompt_ids = prompts[i];
      auto& sp = req.sampling;
      sp.max_tokens = a->max_tokens;
      sp.temperature = a->temperature;
      sp.top_p = a->top_p;
      sp.top_k = a->top_k;
      sp.min_p = a->min_p;
      sp.repetition_penalty = a->repetition_penalty;
      sp.seed = a->seed;
      sp.stop = a->stop;
      sp.ignore_eos = a->ignore_eos;
      req.kv_policy = eo.default_policy;
      batch.push_back({std::move(req), [&, i](const GenerationEvent& ev) {
        Result& r = results[i];
        if (!r.t_first) r.t_first = std::chrono::steady_clock::now();
        r.text += ev.text_delta;
        r.ids.insert(r.ids.end(), ev.token_ids.begin(), ev.token_ids.end());
        if (print_text) std::cout << ev.text_delta << std::flush;
        if (ev.finished) {
          r.finish_reason = ev.finish_reason;
          r.error = ev.error;
          r.prompt_tokens = ev.prompt_tokens;
          r.kept_kv = ev.kept_kv_tokens;
          r.full_kv = ev.full_kv_tokens;
          r.kv_cache_dtype = ev.kv_cache_dtype;
          r.token_layer_bytes = ev.kv_token_layer_bytes;
          r.head_min = ev.kept_head_min;
          r.head_max = ev.kept_head_max;
          r.head_mean = ev.kept_head_mean;
          r.t_end = std::chrono::steady_clock::now();
          std::lock_guard<std::mutex> lk(mu);
          ++finished;
          cv.notify_all();
        }
      }});
    }
    engine.submit_all(std::move(batch));
    {
      std::unique_lock<std::mutex> lk(mu);
      cv.wait(lk, [&] { return finished == prompts.size(); });
    }
    const EngineStats stats = engine.stats();
    // A batch the pool cannot hold runs a few sequences at a time, so its timings are not those of
    // the batch asked for: say so (the pool filled up, or sequences were preempted).
    const int64_t wanted_together = std::min<int64_t>(static_cast<int64_t>(prompts.size()), eo.max_num_seqs);
    if (stats.running_high_water < wanted_together &&
        (stats.kv_admission_waits_total > 0 || stats.preemptions_total > 0))
      std::cerr << "generate: warning: at most " << stats.running_high_water << " of " << prompts.size()
                << " prompts decoded together: the KV cache (--kv-cache " << a->kv_cache << ", "
                << stats.kv_blocks_total << " blocks) held prompts back for " << stats.kv_admission_waits_total
                << " steps and preempted " << stats.preemptions_total
                << " sequences; a larger --kv-cache runs more of them at once\n";
    // KV bytes a kept token costs in one layer, all KV heads of the model, in the dtype its policy
    // stored it in (the engine's report; the cache's where a runner leaves it out).
    const int64_t cache_token_layer_bytes =
        2 * model->config().num_key_value_heads *
        KvBlockPool::row_bytes(model->config().head_dim, model->kv_dtype(), model->kv_quant());
    // load_s covers everything before the prompts were submitted, the warm-up (warmup_s) included.
    const WarmupReport warmup = engine.warmup();
    const nlohmann::json warmup_json{{"prompts", warmup.prompts}, {"tokens", warmup.tokens},
                                     {"decode_steps", warmup.decode_steps}, {"graph_captures", warmup.graph_captures},
                                     {"skipped", warmup.skipped}};
    // Captures after the warm-up's happened while requests decoded (their steps waited for them).
    // Speculative decoding: drafts verified, their tokens, those accepted; acceptance rate and mean
    // tokens a verify step emitted (accepted drafts and the one sampled after them).
    const double drafts = static_cast<double>(stats.spec_decode_num_drafts);
    const nlohmann::json spec_json{
        {"config", nlohmann::json::parse(speculative_config_json(eo.speculative))},
        {"drafts", stats.spec_decode_num_drafts},
        {"draft_tokens", stats.spec_decode_num_draft_tokens},
        {"accepted_tokens", stats.spec_decode_num_accepted_tokens},
        {"accepted_per_position", stats.spec_decode_accepted_per_pos},
        {"draft_steps", stats.spec_decode_draft_steps},
        {"draft_prefix_hits", stats.spec_decode_draft_prefix_hits},
        {"draft_s", stats.spec_decode_draft_seconds},
        {"verify_steps", stats.spec_decode_verify_steps},
        {"verify_s", stats.spec_decode_verify_seconds},
        {"pauses", stats.spec_decode_pauses},
        {"acceptance_rate", stats.spec_decode_num_draft_tokens > 0
                                ? static_cast<double>(stats.spec_decode_num_accepted_tokens) /
                                      static_cast<double>(stats.spec_decode_num_draft_tokens)
                                : 0.0},
        {"mean_acceptance_length",
         drafts > 0 ? 1.0 + static_cast<double>(stats.spec_decode_num_accepted_tokens) / drafts : 0.0}};
    const nlohmann::json graphs_json{{"captures", stats.cuda_graph_captures_total},
                                     {"capture_s", stats.cuda_graph_capture_seconds_total},
                                     {"captures_after_warmup", stats.cuda_graph_captures_total - warmup.graph_captures}};
    engine.shutdown(true);
    job->set_on_failure(nullptr);
    job->join_workers();
    for (const auto& r : results)
      if (r.finish_reason == "error") KV_FAIL(r.error);
    using secs = std::chrono::duration<double>;
    auto token_layer_bytes = [&](const Result& r) {
      return r.token_layer_bytes > 0 ? r.token_layer_bytes : cache_token_layer_bytes;
    };
    auto as_json = [&](const Result& r) {
      const double decode_s = secs(*r.t_end - *r.t_first).count();
      return nlohmann::json{{"text", r.text},
                            {"token_ids", r.ids},
                            {"prompt_tokens", r.prompt_tokens},
                            {"completion_tokens", r.ids.size()},
                            {"finish_reason", r.finish_reason},
                            {"kv_tokens_kept", r.kept_kv},
                            {"kv_tokens_full", r.full_kv},
                            {"kv_bytes_kept", r.kept_kv * token_layer_bytes(r)},
                            {"kv_bytes_full", r.full_kv * token_layer_bytes(r)},
                            {"kv_cache_dtype", r.kv_cache_dtype.empty()
                                                   ? kv_cache_dtype_label(model->kv_dtype(), model->kv_quant())
                                                   : r.kv_cache_dtype},
                            {"weights", {{"format", model->weight_format()}, {"bytes", model->weight_bytes()}}},
                            {"kv_tokens_per_head", {{"min", r.head_min}, {"mean", r.head_mean}, {"max", r.head_max}}},
                            {"timings",
                             {{"time_to_first_token_s", secs(*r.t_first - t_loaded).count()},
                              {"decode_s", decode_s},
                              {"decode_tokens_per_s", r.ids.size() > 1 ? (r.ids.size() - 1) / decode_s : 0.0}}}};
    };
    if (a->json) {
      nlohmann::json out;
      if (prompts.size() == 1 && a->prompts_file.empty()) {
        out = as_json(results[0]);
        out["timings"]["load_s"] = secs(t_loaded - t0).count();
        out["timings"]["warmup_s"] = warmup.seconds;
        out["warmup"] = warmup_json;
        out["cuda_graphs"] = graphs_json;
        out["speculative"] = spec_json;
      } else {
        out = {{"results", nlohmann::json::array()}, {"max_running", stats.running_high_water},
               {"steps", stats.steps_total}, {"kv_blocks_total", stats.kv_blocks_total},
               {"kv_blocks_high_water", stats.kv_blocks_high_water}, {"kv_admission_waits", stats.kv_admission_waits_total},
               {"preemptions", stats.preemptions_total},
               {"load_s", secs(t_loaded - t0).count()}, {"warmup_s", warmup.seconds},
               {"warmup", warmup_json}, {"cuda_graphs", graphs_json}, {"speculative", spec_json}};
        for (const auto& r : results) out["results"].push_back(as_json(r));
      }
      std::cout << out.dump() << "\n";
    } else if (print_text) {
      std::cout << "\n";
    } else {
      for (const auto& r : results) std::cout << nlohmann::json(r.text).dump() << "\n";
    }
  });
}

}  // namespace kvserve::cli
