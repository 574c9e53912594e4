// `kvserve generate`: one prompt through the engine, printed as text or as one JSON object.
#include <chrono>
#include <future>
#include <iostream>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "engine.h"
#include "kv_check.h"
#include "llama_model.h"
#include "tokenizer.h"

namespace kvserve::cli {

namespace {
struct GenerateArgs {
  std::string model, prompt, device = "cpu", dtype, policy;
  std::vector<int64_t> prompt_ids;
  int64_t max_tokens = 64;
  double temperature = 0.0, top_p = 1.0, min_p = 0.0, repetition_penalty = 1.0;
  int64_t top_k = 0;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool json = false, ignore_eos = false, stream = false;
  std::string kv_cache = "1GiB";
};

int64_t parse_bytes(const std::string& s) {
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(s, &pos);
  } catch (const std::exception&) {
    KV_FAIL("--kv-cache: '" << s << "' is not a size such as 512MiB or 2GiB");
  }
  const std::string unit = s.substr(pos);
  double mul = 1;
  if (unit == "" || unit == "B") mul = 1;
  else if (unit == "KiB" || unit == "K") mul = 1024.0;
  else if (unit == "MiB" || unit == "M") mul = 1024.0 * 1024;
  else if (unit == "GiB" || unit == "G") mul = 1024.0 * 1024 * 1024;
  else KV_FAIL("--kv-cache: unknown unit '" << unit << "' (use B, KiB, MiB, GiB)");
  KV_CHECK(v > 0, "--kv-cache must be positive");
  return static_cast<int64_t>(v * mul);
}
}  // namespace

void add_generate_command(CLI::App& app) {
  auto a = std::make_shared<GenerateArgs>();
  auto* cmd = app.add_subcommand("generate", "Generate a completion for one prompt");
  cmd->add_option("--model", a->model, "Hugging Face model directory")->required();
  auto* p = cmd->add_option("--prompt", a->prompt, "prompt text (tokenized with the model's tokenizer)");
  auto* pi = cmd->add_option("--prompt-ids", a->prompt_ids, "prompt as token ids (instead of --prompt)");
  p->excludes(pi);
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
  cmd->add_option("--kv-cache", a->kv_cache, "KV cache size, e.g. 512MiB");
  cmd->add_flag("--json", a->json, "print one JSON object with text, token_ids, counts and timings");
  cmd->callback([a] {
    KV_CHECK(!a->prompt.empty() || !a->prompt_ids.empty(), "generate: give --prompt or --prompt-ids");
    auto t0 = std::chrono::steady_clock::now();
    auto model = LlamaModel::load(a->model, LoadOptions{a->device, a->dtype, !a->json});
    auto tok = std::make_shared<Tokenizer>(Tokenizer::from_dir(a->model));
    EngineOptions eo;
    eo.kv_cache_bytes = parse_bytes(a->kv_cache);
    Engine engine(model, tok, eo);
    auto t_loaded = std::chrono::steady_clock::now();

    GenerationRequest req;
    req.request_id = "cli";
    req.prompt_ids = a->prompt_ids.empty() ? tok->encode(a->prompt) : a->prompt_ids;
    req.sampling.max_tokens = a->max_tokens;
    req.sampling.temperature = a->temperature;
    req.sampling.top_p = a->top_p;
    req.sampling.top_k = a->top_k;
    req.sampling.min_p = a->min_p;
    req.sampling.repetition_penalty = a->repetition_penalty;
    req.sampling.seed = a->seed;
    req.sampling.stop = a->stop;
    req.sampling.ignore_eos = a->ignore_eos;
    req.kv_policy = a->policy;

    std::promise<void> done;
    std::string text, finish_reason, error;
    std::vector<int64_t> ids;
    int64_t prompt_tokens = 0;
    std::optional<std::chrono::steady_clock::time_point> t_first;
    const bool json = a->json;
    engine.submit(req, [&](const GenerationEvent& ev) {
      if (!t_first) t_first = std::chrono::steady_clock::now();
      text += ev.text_delta;
      ids.insert(ids.end(), ev.token_ids.begin(), ev.token_ids.end());
      if (!json) std::cout << ev.text_delta << std::flush;
      if (ev.finished) {
        finish_reason = ev.finish_reason;
        error = ev.error;
        prompt_tokens = ev.prompt_tokens;
        done.set_value();
      }
    });
    done.get_future().wait();
    auto t_end = std::chrono::steady_clock::now();
    engine.shutdown(true);
    if (finish_reason == "error") KV_FAIL(error);
    using secs = std::chrono::duration<double>;
    if (json) {
      const double ttft = secs(*t_first - t_loaded).count();
      const double decode_s = secs(t_end - *t_first).count();
      nlohmann::json out = {{"text", text},
                            {"token_ids", ids},
                            {"prompt_tokens", prompt_tokens},
                            {"completion_tokens", ids.size()},
                            {"finish_reason", finish_reason},
                            {"timings",
                             {{"load_s", secs(t_loaded - t0).count()},
                              {"time_to_first_token_s", ttft},
                              {"decode_s", decode_s},
                              {"decode_tokens_per_s", ids.size() > 1 ? (ids.size() - 1) / decode_s : 0.0}}}};
      std::cout << out.dump() << "\n";
    } else {
      std::cout << "\n";
    }
  });
}

}  // namespace kvserve::cli
