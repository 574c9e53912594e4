// Engine::submit_all: the requests of one batch (an HTTP request's choices, a prompts file) reach the
// scheduler in the same step, or none is queued when one of them is refused. On the real tiny model
// and runner; the runner is wrapped only to see which sequences each step prefills.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "backend/engine/engine.h"
#include "backend/engine/model_runner.h"
#include "backend/model/decoder_model.h"
#include "common/check.h"
#include "text/tokenizer.h"

using namespace kvserve;

namespace {

const std::string kModel = std::string(KVSERVE_SOURCE_DIR) + "/models/tiny-llama";

// The real runner; records the sequences of the first step that prefills anything.
class RecordingRunner : public ModelRunner {
 public:
  explicit RecordingRunner(std::unique_ptr<ModelRunner> real) : real_(std::move(real)) {}
  StepResult execute(const StepPlan& plan) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (first_prefill_.empty())
        for (const PrefillWork& w : plan.prefill) first_prefill_.insert(w.seq_id);
    }
    return real_->execute(plan);
  }
  std::set<int64_t> first_prefill() const {
    std::lock_guard<std::mutex> lock(mu_);
    return first_prefill_;
  }

 private:
  std::unique_ptr<ModelRunner> real_;
  mutable std::mutex mu_;
  std::set<int64_t> first_prefill_;
};

// An engine on the tiny model whose runner records its first prefill; events go to `finished`.
struct Fixture {
  explicit Fixture(int64_t max_waiting = 256) {
    auto model = DecoderModel::load(kModel, LoadOptions{"cpu", "", false});
    auto tok = std::make_shared<Tokenizer>(Tokenizer::from_dir(kModel));
    EngineOptions eo;
    eo.kv_cache_bytes = 16 << 20;
    eo.max_num_seqs = 8;
    eo.max_num_batched_tokens = 2048;
    eo.max_waiting = max_waiting;
    auto memory = make_kv_memory(model->kv_layout(), {eo.block_size, 0, eo.kv_cache_bytes}, resolve_policies(eo.policies));
    auto runner = std::make_unique<RecordingRunner>(std::make_unique<LocalRunner>(model, std::move(memory)));
    recorder = runner.get();
    engine = std::make_unique<Engine>(model, tok, eo, std::move(runner));
  }

  Submission request(const std::string& id, int64_t salt, const std::string& policy = "") {
    Submission s;
    s.request.request_id = id;
    for (int t = 0; t < 24; ++t) s.request.prompt_ids.push_back(5 + (t * 31 + 17 * salt) % 2000);
    s.request.sampling.temperature = 0;
    s.request.sampling.max_tokens = 4;
    s.request.sampling.ignore_eos = true;
    s.request.kv_policy = policy;
    s.on_event = [this, id](const GenerationEvent& ev) {
      std::lock_guard<std::mutex> lock(mu);
      ++events[id];
      if (ev.finished) {
        reasons[id] = ev.finish_reason;
        cv.notify_all();
      }
    };
    return s;
  }

  bool wait_finished(size_t n) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(60), [&] { return reasons.size() >= n; });
  }

  RecordingRunner* recorder = nullptr;
  std::unique_ptr<Engine> engine;
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, int> events;
  std::map<std::string, std::string> reasons;
};

}  // namespace

TEST(EngineSubmitAll, ABatchIsPrefilledInOneStep) {
  Fixture f;
  std::vector<Submission> batch;
  for (int i = 0; i < 6; ++i) batch.push_back(f.request("r" + std::to_string(i), i));
  f.engine->submit_all(std::move(batch));
  ASSERT_TRUE(f.wait_finished(6));
  // Sequence ids follow queue order from 1; one submit at a time let the engine thread start a step
  // with the first few only.
  EXPECT_EQ(f.recorder->first_prefill(), (std::set<int64_t>{1, 2, 3, 4, 5, 6}));
  for (const auto& [id, reason] : f.reasons) EXPECT_EQ(reason, "length") << id;
}

TEST(EngineSubmitAll, OneBadRequestQueuesNone) {
  Fixture f;
  std::vector<Submission> batch;
  batch.push_back(f.request("good-0", 0));
  batch.push_back(f.request("bad", 1, "no-such-policy"));
  batch.push_back(f.request("good-2", 2));
  try {
    f.engine->submit_all(std::move(batch));
    FAIL() << "a batch with an unknown kv_policy was queued";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("no-such-policy"), std::string::npos) << e.what();
  }
  // A later request runs alone, as the first sequence: nothing of the refused batch was queued.
  std::vector<Submission> later;
  later.push_back(f.request("later", 3));
  f.engine->submit_all(std::move(later));
  ASSERT_TRUE(f.wait_finished(1));
  EXPECT_EQ(f.recorder->first_prefill(), (std::set<int64_t>{1}));
  std::lock_guard<std::mutex> lock(f.mu);
  EXPECT_EQ(f.events.count("good-0") + f.events.count("good-2"), 0u);
  EXPECT_EQ(f.reasons.at("later"), "length");
}

TEST(EngineSubmitAll, ABatchOverTheQueueBoundIsRefusedWhole) {
  Fixture f(/*max_waiting=*/4);
  std::vector<Submission> batch;
  for (int i = 0; i < 5; ++i) batch.push_back(f.request("r" + std::to_string(i), i));
  try {
    f.engine->submit_all(std::move(batch));
    FAIL() << "five requests were queued under max_waiting 4";
  } catch (const EngineOverloaded& e) {
    EXPECT_NE(std::string(e.what()).find("too many requests waiting (4) for 5 more"), std::string::npos) << e.what();
  }
  std::vector<Submission> four;
  for (int i = 0; i < 4; ++i) four.push_back(f.request("s" + std::to_string(i), i));
  f.engine->submit_all(std::move(four));
  ASSERT_TRUE(f.wait_finished(4));
  EXPECT_EQ(f.recorder->first_prefill(), (std::set<int64_t>{1, 2, 3, 4}));
  std::lock_guard<std::mutex> lock(f.mu);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(f.events.count("r" + std::to_string(i)), 0u);
}
