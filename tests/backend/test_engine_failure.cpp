// A request whose decode step fails inside the engine fails alone: the others in its batch finish
// with exactly the tokens they produce in a run without it, and every KV block comes back.
//
// The failure comes from the real model runner wrapped so that a decode step containing one chosen
// sequence throws after the real step ran (its KV, and everyone else's, already appended): the worst
// case for the engine, which cannot know which sequence failed nor trust the batch's KV.
#include <gtest/gtest.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <string>
#include <vector>

#include "backend/engine/engine.h"
#include "common/check.h"
#include "backend/model/decoder_model.h"
#include "backend/engine/model_runner.h"
#include "text/tokenizer.h"

using namespace kvserve;

namespace {

const std::string kModel = std::string(KVSERVE_SOURCE_DIR) + "/models/tiny-llama";

// The real runner, except that a decode step containing `poisoned` fails (after the real step ran)
// once `poisoned` has produced `after` tokens.
class FailingRunner : public ModelRunner {
 public:
  FailingRunner(std::unique_ptr<ModelRunner> real, int64_t poisoned, int after)
      : real_(std::move(real)), poisoned_(poisoned), after_(after) {}
  StepResult execute(const StepPlan& plan) override {
    StepResult r = real_->execute(plan);
    for (int64_t id : plan.decode.seq_ids) {
      if (id == poisoned_ && r.decode_error.empty() && ++steps_ > after_) {
        ++failures_;
        r.decoded.clear();
        r.decode_error = "injected decode failure (batch of " + std::to_string(plan.decode.seq_ids.size()) + ")";
      }
    }
    return r;
  }
  int failures() const { return failures_; }

 private:
  std::unique_ptr<ModelRunner> real_;
  int64_t poisoned_;
  int after_;
  int steps_ = 0;
  int failures_ = 0;
};

struct Result {
  std::vector<int64_t> tokens;
  std::string reason, error;
  bool done = false;
};

// Submits `n` greedy requests (ids 1..n in submission order) and waits for all of them.
std::vector<Result> run(int n, int64_t poisoned, int after, int* failures, KvUsage* usage_after) {
  auto model = DecoderModel::load(kModel, LoadOptions{"cpu", "", false});
  auto tok = std::make_shared<Tokenizer>(Tokenizer::from_dir(kModel));
  EngineOptions eo;
  eo.kv_cache_bytes = 16 << 20;
  eo.max_num_seqs = 8;
  auto memory = make_kv_memory(model->kv_layout(), {eo.block_size, 0, eo.kv_cache_bytes}, resolve_policies(eo.policies));
  auto runner = std::make_unique<FailingRunner>(std::make_unique<LocalRunner>(model, std::move(memory)), poisoned, after);
  FailingRunner* raw = runner.get();
  std::vector<Result> results(static_cast<size_t>(n));
  std::mutex mu;
  std::condition_variable cv;
  {
    Engine engine(model, tok, eo, std::move(runner));
    for (int i = 0; i < n; ++i) {
      GenerationRequest r;
      r.request_id = "r" + std::to_string(i);
      for (int t = 0; t < 20 + 7 * i; ++t) r.prompt_ids.push_back(5 + (t * 31 + 17 * i) % 2000);
      r.sampling.temperature = 0;
      r.sampling.max_tokens = 24;
      r.sampling.ignore_eos = true;
      engine.submit(std::move(r), [&, i](const GenerationEvent& ev) {
        std::lock_guard<std::mutex> lock(mu);
        Result& res = results[static_cast<size_t>(i)];
        res.tokens.insert(res.tokens.end(), ev.token_ids.begin(), ev.token_ids.end());
        if (ev.finished) {
          res.done = true;
          res.reason = ev.finish_reason;
          res.error = ev.error;
          cv.notify_all();
        }
      });
    }
    std::unique_lock<std::mutex> lock(mu);
    EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(120), [&] {
      for (const auto& r : results)
        if (!r.done) return false;
      return true;
    }));
    lock.unlock();
    for (int i = 0; i < 200 && engine.stats().kv_blocks_used > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    *usage_after = {engine.stats().kv_blocks_total, engine.stats().kv_blocks_used, 0};
    *failures = raw->failures();
  }
  return results;
}

}  // namespace

TEST(EngineFailure, ADecodeFailureFailsOnlyItsRequest) {
  int failures = 0;
  KvUsage usage;
  const auto clean = run(4, /*poisoned=*/-1, 0, &failures, &usage);
  ASSERT_EQ(failures, 0);
  for (const auto& r : clean) {
    ASSERT_EQ(r.reason, "length") << r.error;
    ASSERT_EQ(r.tokens.size(), 24u);
  }
  // Sequence ids follow submission order from 1: poison the third request after 5 decode steps.
  const auto faulty = run(4, /*poisoned=*/3, 5, &failures, &usage);
  EXPECT_GE(failures, 2);  // once in the shared batch, once more alone
  EXPECT_EQ(usage.blocks_used, 0);
  EXPECT_EQ(faulty[2].reason, "error");
  EXPECT_NE(faulty[2].error.find("injected decode failure (batch of 1)"), std::string::npos) << faulty[2].error;
  EXPECT_GE(faulty[2].tokens.size(), 6u);  // it failed mid-decode, after producing tokens
  for (size_t i : {0u, 1u, 3u}) {
    EXPECT_EQ(faulty[i].reason, "length") << i << ": " << faulty[i].error;
    EXPECT_EQ(faulty[i].tokens, clean[i].tokens) << "request " << i << " changed because another one failed";
  }
}
