// The engine's warm-up (backend/engine/warmup.h) runs real steps through the real runner and leaves nothing
// behind: an empty pool, an empty prefix cache, a high-water mark from zero, and requests that get
// exactly the tokens and cache hits they get from an engine that never warmed up.
#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "backend/engine/engine.h"
#include "backend/model/decoder_model.h"
#include "backend/engine/model_runner.h"
#include "backend/engine/warmup.h"
#include "common/check.h"
#include "text/tokenizer.h"

using namespace kvserve;

namespace {

const std::string kModel = std::string(KVSERVE_SOURCE_DIR) + "/models/tiny-llama";

std::shared_ptr<DecoderModel> model() {
  static auto m = DecoderModel::load(kModel, LoadOptions{"cpu", "", false});
  return m;
}

std::unique_ptr<LocalRunner> runner(int64_t num_blocks, bool prefix_caching = true) {
  auto m = model();
  return std::make_unique<LocalRunner>(
      m, make_kv_memory(m->kv_layout(), {16, num_blocks, 0, prefix_caching, 0, KvLayout::kAuto, true},
                        resolve_policies({{"snapkv", {{"window", "4"}, {"budget", "24"}}}})));
}

WarmupOptions options(int64_t tokens, int64_t prompts, const std::string& policy = "full") {
  WarmupOptions o;
  o.tokens = tokens;
  o.prompts = prompts;
  o.vocab_size = model()->config().vocab_size;
  o.max_model_len = model()->config().max_position_embeddings;
  o.policy = policy;
  o.policy_config = resolve_policies({{"snapkv", {{"window", "4"}, {"budget", "24"}}}}).at(policy);
  return o;
}

// The real runner, with an injected prefill failure (after the real prefill ran).
class FailingPrefill : public ModelRunner {
 public:
  explicit FailingPrefill(ModelRunner& real) : real_(real) {}
  StepResult execute(const StepPlan& plan) override {
    StepResult r = real_.execute(plan);
    if (!r.prefilled.empty()) r.prefilled.back().error = "injected prefill failure";
    return r;
  }
  bool reset_caches() override { return real_.reset_caches(); }

 private:
  ModelRunner& real_;
};

// Forwards steps only: like a sharded runner, it cannot reset caches.
class NoReset : public ModelRunner {
 public:
  explicit NoReset(ModelRunner& real) : real_(real) {}
  StepResult execute(const StepPlan& plan) override { return real_.execute(plan); }

 private:
  ModelRunner& real_;
};

}  // namespace

TEST(Warmup, ResolvesTheTokenCount) {
  EXPECT_EQ(resolve_warmup_tokens(-1, /*cuda=*/true, 8192), 8192);
  EXPECT_EQ(resolve_warmup_tokens(-1, /*cuda=*/false, 8192), 0);
  EXPECT_EQ(resolve_warmup_tokens(0, true, 8192), 0);
  EXPECT_EQ(resolve_warmup_tokens(300, false, 8192), 300);
  try {
    resolve_warmup_tokens(-2, true, 8192);
    FAIL() << "no error";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("model.warmup_tokens"), std::string::npos) << e.what();
  }
}

TEST(Warmup, LeavesAnEmptyPoolAndPrefixCache) {
  for (const std::string policy : {"full", "snapkv"}) {
    auto r = runner(4096);
    const WarmupReport rep = warm_up(*r, options(200, 4, policy));
    EXPECT_EQ(rep.prompts, 4) << policy;
    EXPECT_EQ(rep.tokens, 200) << policy;
    EXPECT_EQ(rep.decode_steps, 4) << policy;  // two with all four prompts, two with one
    EXPECT_TRUE(rep.skipped.empty()) << rep.skipped;
    EXPECT_GT(rep.seconds, 0.0);
    const ShardUsage u = r->execute(StepPlan{}).shards.at(0);
    EXPECT_EQ(u.blocks_used, 0) << policy;
    EXPECT_EQ(u.blocks_cached, 0) << policy;
    EXPECT_EQ(u.context_entries, 0) << policy;
    EXPECT_EQ(u.blocks_high_water, 0) << policy;
  }
}

TEST(Warmup, ShrinksItsPromptsToThePool) {
  auto r = runner(64);  // 64 blocks of 16 tokens over every layer of the model
  const WarmupReport rep = warm_up(*r, options(100000, 2));
  ASSERT_EQ(rep.prompts, 2) << rep.skipped;
  EXPECT_GE(rep.tokens, 2);
  EXPECT_LT(rep.tokens, 100000);
  EXPECT_EQ(r->execute(StepPlan{}).shards.at(0).blocks_used, 0);
}

TEST(Warmup, SkipsARunnerThatCannotResetItsCaches) {
  auto r = runner(4096);
  NoReset wrapped(*r);
  const WarmupReport rep = warm_up(wrapped, options(200, 4));
  EXPECT_EQ(rep.prompts, 0);
  EXPECT_NE(rep.skipped.find("cannot reset"), std::string::npos) << rep.skipped;
  EXPECT_EQ(r->execute(StepPlan{}).shards.at(0).blocks_high_water, 0);  // nothing ran
}

TEST(Warmup, AFailedStepNamesItselfAndFreesThePool) {
  auto r = runner(4096);
  FailingPrefill failing(*r);
  try {
    warm_up(failing, options(200, 4));
    FAIL() << "no error";
  } catch (const KvError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("engine warm-up: the prefill failed: injected prefill failure"), std::string::npos) << what;
    EXPECT_NE(what.find("warmup_tokens: 0"), std::string::npos) << what;
  }
  const ShardUsage u = r->execute(StepPlan{}).shards.at(0);
  EXPECT_EQ(u.blocks_used, 0);
  EXPECT_EQ(u.blocks_cached, 0);
}

namespace {

struct Finished {
  std::vector<int64_t> tokens;
  int64_t cached = 0;
  std::string reason;
};

// Greedy requests: three prompts, then the first one again (a prefix-cache hit), each after the
// previous one finished.
std::vector<Finished> serve(int64_t warmup_tokens, EngineStats* stats, WarmupReport* report) {
  auto tok = std::make_shared<Tokenizer>(Tokenizer::from_dir(kModel));
  EngineOptions eo;
  eo.kv_cache_bytes = 16 << 20;
  eo.max_num_seqs = 4;
  eo.warmup_tokens = warmup_tokens;
  Engine engine(model(), tok, eo);
  *report = engine.warmup();
  std::vector<Finished> out;
  for (int i : {0, 1, 2, 0}) {
    GenerationRequest r;
    r.request_id = "w" + std::to_string(out.size());
    for (int t = 0; t < 40 + 9 * i; ++t) r.prompt_ids.push_back(3 + (t * 37 + 11 * i) % 1500);
    r.sampling.temperature = 0;
    r.sampling.max_tokens = 12;
    r.sampling.ignore_eos = true;
    std::mutex mu;
    std::condition_variable cv;
    Finished f;
    bool done = false;
    engine.submit(std::move(r), [&](const GenerationEvent& ev) {
      std::lock_guard<std::mutex> lock(mu);
      f.tokens.insert(f.tokens.end(), ev.token_ids.begin(), ev.token_ids.end());
      if (ev.finished) {
        f.reason = ev.finish_reason;
        f.cached = ev.cached_tokens;
        done = true;
        cv.notify_all();
      }
    });
    std::unique_lock<std::mutex> lock(mu);
    EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(120), [&] { return done; }));
    out.push_back(f);
  }
  *stats = engine.stats();
  engine.shutdown(true);
  return out;
}

}  // namespace

TEST(Warmup, AnEngineAnswersAsOneWithoutIt) {
  EngineStats cold_stats, warm_stats;
  WarmupReport cold_rep, warm_rep;
  const auto cold = serve(0, &cold_stats, &cold_rep);
  const auto warm = serve(300, &warm_stats, &warm_rep);
  EXPECT_EQ(cold_rep.prompts, 0);
  EXPECT_EQ(warm_rep.prompts, 4);  // max_num_seqs
  EXPECT_EQ(warm_rep.tokens, 300);
  ASSERT_EQ(cold.size(), warm.size());
  for (size_t i = 0; i < cold.size(); ++i) {
    EXPECT_EQ(warm[i].reason, "length");
    EXPECT_EQ(warm[i].tokens, cold[i].tokens) << "request " << i;
    EXPECT_EQ(warm[i].cached, cold[i].cached) << "request " << i;
  }
  EXPECT_GT(warm.back().cached, 0);  // the repeated prompt hit the prefix cache, in both
  EXPECT_EQ(warm_stats.kv_blocks_high_water, cold_stats.kv_blocks_high_water);
  EXPECT_EQ(warm_stats.prefix_cache_queries_total, cold_stats.prefix_cache_queries_total);
  EXPECT_EQ(warm_stats.prefix_cache_hits_total, cold_stats.prefix_cache_hits_total);
  EXPECT_EQ(warm_stats.kv_blocks_cached, cold_stats.kv_blocks_cached);
}
