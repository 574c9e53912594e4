// kvserve:request_queue_time_seconds is the time a request waited in the engine's queue (arrival ->
// first admitted for prefill), reported once per request by EngineOptions::on_queue_time; it is not
// time to first token, and a preempted request that is re-queued does not report again.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <vector>

#include "backend/engine/engine.h"
#include "backend/model/decoder_model.h"
#include "backend/engine/model_runner.h"
#include "text/tokenizer.h"

using namespace kvserve;
using Clock = std::chrono::steady_clock;

namespace {

std::string fixture_dir() {
  const char* env = std::getenv("KVSERVE_FIXTURES");
  const std::string dir = env ? std::string(env) + "/llama-gqa" : "";
  return !dir.empty() && std::filesystem::exists(dir + "/config.json") ? dir : "";
}

// Per request: when the test submitted it and when its first and last events arrived.
struct Timeline {
  Clock::time_point before_submit, after_submit, first_token, finished;
  bool has_first = false, done = false;
  std::string finish_reason;
  int64_t tokens = 0;
};

class Recorder {
 public:
  // The engine hook: one call per admitted request, in admission order.
  void on_queue_time(double s) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(s);
  }
  void submit(Engine& engine, size_t index, int64_t prompt_len, int64_t max_tokens) {
    GenerationRequest r;
    r.request_id = "r";
    r.request_id += std::to_string(index);
    for (int64_t t = 0; t < prompt_len; ++t) r.prompt_ids.push_back(5 + (t * 37 + 11 * static_cast<int64_t>(index)) % 2000);
    r.sampling.temperature = 0;
    r.sampling.max_tokens = max_tokens;
    r.sampling.ignore_eos = true;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (timelines_.size() <= index) timelines_.resize(index + 1);
      timelines_[index].before_submit = Clock::now();
    }
    engine.submit(std::move(r), [this, index](const GenerationEvent& ev) {
      std::lock_guard<std::mutex> lock(mu_);
      Timeline& t = timelines_[index];
      const auto now = Clock::now();
      t.tokens += static_cast<int64_t>(ev.token_ids.size());
      if (!ev.token_ids.empty() && !t.has_first) t.has_first = true, t.first_token = now;
      if (ev.finished) {
        t.done = true;
        t.finished = now;
        t.finish_reason = ev.finish_reason;
        cv_.notify_all();
      }
    });
    std::lock_guard<std::mutex> lock(mu_);
    timelines_[index].after_submit = Clock::now();
  }
  void wait_all() {
    std::unique_lock<std::mutex> lock(mu_);
    ASSERT_TRUE(cv_.wait_for(lock, std::chrono::seconds(120), [&] {
      for (const auto& t : timelines_)
        if (!t.done) return false;
      return true;
    }));
  }
  std::vector<double> queue() {
    std::lock_guard<std::mutex> lock(mu_);
    return queue_;
  }
  Timeline timeline(size_t i) {
    std::lock_guard<std::mutex> lock(mu_);
    return timelines_.at(i);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<double> queue_;
  std::vector<Timeline> timelines_;
};

double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

}  // namespace

// One sequence at a time: the second request waits for the whole first one; the first hardly waits.
TEST(QueueTime, SecondRequestWaitsForTheFirstWithOneSequence) {
  const std::string dir = fixture_dir();
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  auto tok = std::make_shared<Tokenizer>(Tokenizer::from_dir(dir));
  Recorder rec;
  EngineOptions eo;
  eo.max_num_seqs = 1;
  eo.kv_cache_bytes = 8 << 20;
  eo.on_queue_time = [&rec](double s) { rec.on_queue_time(s); };
  {
    Engine engine(model, tok, eo);
    rec.submit(engine, 0, 20, 48);
    rec.submit(engine, 1, 20, 8);
    rec.wait_all();
    engine.shutdown(true);
  }
  const auto q = rec.queue();
  ASSERT_EQ(q.size(), 2u);  // once per request, in admission order
  const Timeline a = rec.timeline(0), b = rec.timeline(1);
  ASSERT_EQ(a.finish_reason, "length");
  ASSERT_EQ(b.finish_reason, "length");
  // Queue time ends before the prefill, so it is below what the client sees as time to first token.
  EXPECT_LE(q[0], seconds(a.before_submit, a.first_token));
  EXPECT_LE(q[1], seconds(b.before_submit, b.first_token));
  // The second was admitted only after the first finished (its finish event precedes the admission).
  EXPECT_GE(q[1], seconds(b.after_submit, a.finished));
  EXPECT_GT(seconds(b.after_submit, a.finished), 0.0);
  EXPECT_LT(q[0], q[1]);
}

// A request preempted (recompute) and re-admitted later reports its queue time once.
TEST(QueueTime, PreemptedRequestIsNotCountedTwice) {
  const std::string dir = fixture_dir();
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  auto tok = std::make_shared<Tokenizer>(Tokenizer::from_dir(dir));
  const auto& c = model->config();
  Recorder rec;
  EngineOptions eo;
  eo.block_size = 16;
  // 4 blocks of 16 tokens per layer: both 15-token prompts fit, but not both grown past 32 tokens.
  const int64_t block_bytes = 2 * c.num_key_value_heads * eo.block_size * c.head_dim * 4;  // fp32
  eo.kv_cache_bytes = 4 * c.num_hidden_layers * block_bytes;
  eo.on_queue_time = [&rec](double s) { rec.on_queue_time(s); };
  EngineStats stats;
  {
    Engine engine(model, tok, eo);
    rec.submit(engine, 0, 15, 40);
    rec.submit(engine, 1, 15, 40);
    rec.wait_all();
    stats = engine.stats();
    engine.shutdown(true);
  }
  ASSERT_EQ(rec.timeline(0).finish_reason, "length");
  ASSERT_EQ(rec.timeline(1).finish_reason, "length");
  EXPECT_EQ(rec.timeline(1).tokens, 40);
  ASSERT_GE(stats.preemptions_total, 1) << "the pool was meant to force a preemption";
  EXPECT_EQ(rec.queue().size(), 2u);
}
