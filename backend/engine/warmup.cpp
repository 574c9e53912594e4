#include "backend/engine/warmup.h"

#include <algorithm>
#include <chrono>

#include "backend/engine/model_runner.h"
#include "backend/engine/step_plan.h"
#include "common/check.h"
#include "common/log.h"

namespace kvserve {
namespace {

// Far above the engine's request ids (which count from 1), so a warm-up sequence can never share
// an id with a request even in a log line.
constexpr int64_t kFirstWarmupId = int64_t{1} << 40;

// Deterministic token ids in [0, vocab): the same warm-up on every start.
std::vector<int64_t> warmup_prompt(int64_t n, int64_t vocab, uint64_t stream) {
  std::vector<int64_t> ids(static_cast<size_t>(n));
  uint64_t x = 0x9E3779B97F4A7C15ull * (stream + 1);
  for (auto& id : ids) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    id = static_cast<int64_t>((x >> 33) % static_cast<uint64_t>(vocab));
  }
  return ids;
}

// The first error a step reported, or "".
std::string step_error(const StepResult& r) {
  if (!r.decode_error.empty()) return r.decode_error;
  for (const auto& p : r.prefilled)
    if (!p.error.empty()) return p.error;
  return "";
}

}  // namespace

int64_t resolve_warmup_tokens(int64_t requested, bool cuda, int64_t max_num_batched_tokens) {
  KV_CHECK(requested >= -1, "model.warmup_tokens must be -1 (auto), 0 (off) or a token count, got " << requested);
  if (requested >= 0) return requested;
  return cuda ? max_num_batched_tokens : 0;
}

WarmupReport warm_up(ModelRunner& runner, const WarmupOptions& o) {
  WarmupReport rep;
  if (o.tokens <= 0) return rep;
  KV_CHECK(o.prompts >= 1 && o.decode_steps >= 0 && o.vocab_size >= 1,
           "internal: warm-up of " << o.prompts << " prompts, " << o.decode_steps << " decode steps, vocab "
                                   << o.vocab_size);
  const auto t0 = std::chrono::steady_clock::now();
  // At start the caches are empty, so this changes nothing; it tells whether the runner can reset them.
  if (!runner.reset_caches()) {
    rep.skipped = "this runner cannot reset its caches (sharded job)";
    return rep;
  }
  const StepResult before = runner.execute(StepPlan{});
  KV_CHECK(before.shards.size() == 1, "internal: warm-up on " << before.shards.size() << " KV shards");
  const ShardUsage& pool = before.shards.front();
  KV_CHECK(pool.blocks_used == 0, "internal: warm-up on a pool with " << pool.blocks_used << " blocks in use");

  // Shrink the prompts until they and their decoded tokens fit the model's length and half the pool
  // (the scheduler's own admission would take them; half leaves room for its safety margins).
  const int64_t prompts = std::min(o.prompts, o.tokens);
  int64_t n = o.tokens / prompts;
  const int64_t extra = 2 * o.decode_steps + 1;
  if (o.max_model_len > 0) n = std::min(n, o.max_model_len - extra);
  auto fits = [&](int64_t len) {
    return prompts * PagedKvMemory::prompt_blocks(o.policy_config, pool.geometry, len + extra) <= pool.blocks_total / 2;
  };
  while (n >= 1 && !fits(n)) n /= 2;
  if (n < 1) {
    rep.skipped = "the KV pool or max_model_len leaves no room for a warm-up prompt";
    return rep;
  }

  std::vector<int64_t> ids, last(static_cast<size_t>(prompts)), lens(static_cast<size_t>(prompts), n);
  StepPlan prefill;
  for (int64_t i = 0; i < prompts; ++i) {
    const int64_t id = kFirstWarmupId + i;
    ids.push_back(id);
    SequenceStart s;
    s.seq_id = id;
    s.sampling.temperature = 0.0;
    s.prompt = warmup_prompt(n, o.vocab_size, static_cast<uint64_t>(i));
    s.seed = static_cast<uint64_t>(i);
    PrefillWork w;
    w.seq_id = id;
    w.tokens = s.prompt;
    w.policy = o.policy;
    w.reuse_prefix = false;
    prefill.start.push_back(std::move(s));
    prefill.prefill.push_back(std::move(w));
  }

  std::vector<int64_t> live = ids;  // sequences with KV and a sampler
  // Ends every live sequence and empties the caches: after the warm-up, and on the way out of a failure.
  auto clean_up = [&] {
    StepPlan end;
    end.release = live;
    end.remove = live;
    live.clear();
    runner.execute(end);
    runner.reset_caches();
  };
  auto run = [&](const StepPlan& plan, const char* what) {
    StepResult r;
    try {
      r = runner.execute(plan);
    } catch (const std::exception& e) {
      KV_FAIL("engine warm-up: the " << what << " failed: " << e.what()
                                     << " (model.warmup_tokens: 0 or --warmup-tokens 0 turns the warm-up off)");
    }
    const std::string err = step_error(r);
    if (!err.empty()) {
      clean_up();
      KV_FAIL("engine warm-up: the " << what << " failed: " << err
                                     << " (model.warmup_tokens: 0 or --warmup-tokens 0 turns the warm-up off)");
    }
    return r;
  };

  const StepResult first = run(prefill, "prefill");
  for (int64_t i = 0; i < prompts; ++i) {
    const auto& f = first.prefilled[static_cast<size_t>(i)].first;
    KV_CHECK(f.has_value(), "internal: warm-up prompt " << i << " sampled no token");
    last[static_cast<size_t>(i)] = f->token;
  }
  rep.prompts = prompts;
  rep.tokens = prompts * n;

  // Decode with every prompt, then with the first alone.
  auto decode = [&](int64_t batch) {
    for (int64_t s = 0; s < o.decode_steps; ++s) {
      StepPlan step;
      for (int64_t i = 0; i < batch; ++i) {
        step.decode.seq_ids.push_back(ids[static_cast<size_t>(i)]);
        step.decode.positions.push_back(lens[static_cast<size_t>(i)]++);
        step.decode_tokens.push_back(last[static_cast<size_t>(i)]);
        step.decode_ban_eos.push_back(0);
      }
      const StepResult r = run(step, "decode step");
      for (int64_t i = 0; i < batch; ++i) last[static_cast<size_t>(i)] = r.decoded[static_cast<size_t>(i)].token;
      ++rep.decode_steps;
    }
  };
  decode(prompts);
  if (prompts > 1) {
    StepPlan shrink;
    shrink.release.assign(ids.begin() + 1, ids.end());
    shrink.remove = shrink.release;
    live.resize(1);
    run(shrink, "release");
    decode(1);
  }
  clean_up();
  const StepResult after = runner.execute(StepPlan{});
  KV_CHECK(after.shards.front().blocks_used == 0 && after.shards.front().blocks_cached == 0,
           "internal: the warm-up left " << after.shards.front().blocks_used << " blocks in use, "
                                         << after.shards.front().blocks_cached << " cached");
  rep.graph_captures = runner.graph_captures();
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

}  // namespace kvserve
