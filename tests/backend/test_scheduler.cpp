// The scheduler without a model: a fake runner keeps a block pool per shard (each sequence holds
// ceil(len / block) blocks in every layer) and samples token = position, so admission, preemption,
// rejection and cancellation are checked from the plans alone.
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <random>
#include <tuple>

#include "backend/engine/model_runner.h"
#include "backend/engine/scheduler.h"
#include "cache_manager/paged_kv_memory.h"

namespace kvserve {
namespace {

constexpr int64_t kLayers = 2;
constexpr int64_t kBlock = 4;

// One shard of `layers` layers and `blocks` blocks; a prefill keeps min(prompt, keep) tokens.
class FakeRunner final : public ModelRunner {
 public:
  FakeRunner(std::vector<int64_t> shard_blocks, std::map<std::string, int64_t> keep)
      : totals_(std::move(shard_blocks)), keep_(std::move(keep)) {}

  StepResult execute(const StepPlan& plan) override {
    plans.push_back(plan);
    for (int64_t id : plan.release) {
      EXPECT_TRUE(len_.count(id) || failed_.count(id)) << "released sequence " << id << " holds nothing";
      len_.erase(id);
      failed_.erase(id);
    }
    for (int64_t id : plan.park) EXPECT_TRUE(len_.count(id) && parked.insert(id).second) << "parked " << id;
    for (int64_t id : plan.release) parked.erase(id);
    for (int64_t id : plan.remove) EXPECT_EQ(samplers_.erase(id), 1u) << "no sampler for " << id;
    for (const auto& s : plan.start) EXPECT_TRUE(samplers_.insert(s.seq_id).second) << "sampler twice " << s.seq_id;
    StepResult r;
    const auto& rows = plan.decode.seq_ids;
    if (std::find(rows.begin(), rows.end(), fail_decode_of) != rows.end()) {
      r.decode_error = "injected failure";
      for (int64_t id : rows) ++len_.at(id);  // the step may have appended before it failed
    }
    for (size_t i = 0; i < plan.decode.seq_ids.size() && r.decode_error.empty(); ++i) {
      const int64_t id = plan.decode.seq_ids[i];
      EXPECT_TRUE(samplers_.count(id));
      ++len_.at(id);
      SampledToken t;
      t.token = plan.decode.positions[i] + 1000;
      r.decoded.push_back(t);
    }
    for (const auto& p : plan.prefill) {
      // A resumed prompt takes its parked conversation's KV over and appends the rest whole.
      if (p.resume.seq_id >= 0) {
        EXPECT_EQ(parked.erase(p.resume.seq_id), 1u) << "resumed " << p.resume.seq_id << ", which is not parked";
        len_[p.seq_id] = len_.at(p.resume.seq_id) + static_cast<int64_t>(p.tokens.size()) - p.resume.length;
        len_.erase(p.resume.seq_id);
        PrefillOutcome o;
        if (p.sample) o.first = SampledToken{static_cast<int64_t>(p.tokens.size()) + 1000, {}, {}};
        o.cached_tokens = p.resume.length;
        r.prefilled.push_back(o);
        continue;
      }
      // A chunk continues where the sequence's last one ended; a first chunk starts from nothing.
      if (p.start == 0) {
        EXPECT_FALSE(len_.count(p.seq_id)) << "prefill of a sequence that holds KV";
      } else {
        EXPECT_EQ(len_.count(p.seq_id) ? len_.at(p.seq_id) : -1, p.start) << "chunk of sequence " << p.seq_id;
      }
      EXPECT_TRUE(!p.sample || p.last_chunk()) << "a chunk before the last samples";
      PrefillOutcome o;
      if (p.seq_id == fail_prefill_of) {  // as LocalRunner: the failed chunk frees its earlier ones
        len_.erase(p.seq_id);
        failed_.insert(p.seq_id);
        o.error = "injected prefill failure";
        r.prefilled.push_back(o);
        continue;
      }
      const int64_t n = p.start + static_cast<int64_t>(p.tokens.size());
      auto k = keep_.find(p.policy);
      // A compressing policy holds every position until the last chunk selects.
      len_[p.seq_id] = k == keep_.end() || !p.last_chunk() ? n : std::min(n, k->second);
      if (p.sample) o.first = SampledToken{n + 1000, {}, {}};
      o.kept_tokens = len_[p.seq_id] * kLayers;
      r.prefilled.push_back(o);
    }
    for (int64_t total : totals_) {
      ShardUsage u;
      u.geometry = {0, kLayers, kLayers, 1, kBlock, rounds_kv, prefix_caching};
      u.blocks_total = total;
      for (auto& [id, n] : len_) u.blocks_used += held(n) - shares(id);
      u.blocks_high_water = u.blocks_used;
      if (u.blocks_used > total) overflow = true;
      for (int64_t id : plan.decode.seq_ids) u.held.push_back(held(len_.at(id)) - shares(id)), u.demand.push_back(demand(len_.at(id)));
      for (const auto& p : plan.prefill) {
        const int64_t len = len_.count(p.seq_id) ? len_.at(p.seq_id) : 0;
        u.held.push_back(len ? held(len) - shares(p.seq_id) : 0), u.demand.push_back(len_.count(p.seq_id) ? demand(len) : 0);
      }
      r.shards.push_back(u);
    }
    return r;
  }
  static int64_t held(int64_t len) { return kLayers * ((len + kBlock - 1) / kBlock); }
  static int64_t demand(int64_t len) { return len % kBlock == 0 ? kLayers : 0; }

  std::vector<StepPlan> plans;
  std::set<int64_t> parked;
  bool overflow = false;       // the scheduler admitted more than a pool holds
  int64_t fail_decode_of = -1;  // a decode step containing this sequence fails
  int64_t fail_prefill_of = -1;  // this sequence's next prefill (or chunk) fails
  bool rounds_kv = false;        // the pools report a KV dtype other than the compute dtype
  bool prefix_caching = false;   // the pools report a prefix cache
  std::map<int64_t, int64_t> shared;  // blocks a sequence shares with others (a prefix-cache hit): not its own
  int64_t shares(int64_t id) const { return shared.count(id) ? shared.at(id) : 0; }
  int64_t used() const {
    int64_t n = 0;
    for (auto& [id, len] : len_) n += held(len);
    return n;
  }
  bool holds(int64_t id) const { return len_.count(id) != 0; }

 private:
  std::vector<int64_t> totals_;
  std::map<std::string, int64_t> keep_;
  std::map<int64_t, int64_t> len_;
  std::set<int64_t> failed_;  // freed by a failed prefill, released by the scheduler later
  std::set<int64_t> samplers_;
};

std::map<std::string, PolicyConfig> policies() {
  return resolve_policies({{"stream8", {{"name", "streamingllm"}, {"budget", "8"}, {"sink", "4"}}},
                           {"stream8c", {{"name", "streamingllm"}, {"budget", "8"}, {"sink", "4"}, {"prefix_reuse", "compressed"}}},
                           {"h2o8", {{"name", "h2o"}, {"budget", "8"}, {"window", "2"}}}});
}

class SchedulerTest : public ::testing::Test {
 protected:
  void make(std::vector<int64_t> shard_blocks, int64_t max_seqs = 8, int64_t max_tokens = 8192, bool chunked = false,
            int64_t long_prefill_threshold = 0) {
    runner = std::make_unique<FakeRunner>(std::move(shard_blocks), std::map<std::string, int64_t>{{"stream8", 8}, {"stream8c", 8}, {"h2o8", 8}});
    Scheduler::Options o;
    o.max_num_seqs = max_seqs;
    o.max_num_batched_tokens = max_tokens;
    o.enable_chunked_prefill = chunked;
    o.long_prefill_token_threshold = long_prefill_threshold;
    o.policies = policies();
    o.shared_prefix_blocks = shared_prefix_blocks;
    sched = std::make_unique<Scheduler>(std::move(o));
    sched->update(StepPlan{}, runner->execute(StepPlan{}));
  }
  Sequence* add(int64_t id, int64_t prompt_len, int64_t max_tokens = 100, const std::string& policy = "full",
               std::vector<int64_t> prompt = {}) {
    auto s = std::make_unique<Sequence>();
    s->id = id;
    s->req.request_id = "r" + std::to_string(id);
    s->req.prompt_ids = prompt.empty() ? std::vector<int64_t>(static_cast<size_t>(prompt_len), 7) : std::move(prompt);
    s->req.kv_policy = policy;
    s->req.sampling.max_tokens = max_tokens;
    Sequence* raw = s.get();
    sched->add(std::move(s));
    return raw;
  }
  // One step; sequences that reached their max_tokens finish (the output processor's part).
  StepPlan step() {
    rejected.clear();
    StepPlan plan = sched->schedule(&rejected);
    if (plan.empty()) return plan;
    for (auto& o : sched->update(plan, runner->execute(plan))) {
      if (!o.error.empty()) {
        errors.push_back(o.seq->id);
        finished.push_back(sched->finish(o.seq->id));
        continue;
      }
      o.seq->output.push_back(o.token->token);
      if (static_cast<int64_t>(o.seq->output.size()) >= o.seq->req.sampling.max_tokens)
        finished.push_back(sched->finish(o.seq->id, /*completed=*/true));
    }
    return plan;
  }
  std::unique_ptr<FakeRunner> runner;
  std::unique_ptr<Scheduler> sched;
  Scheduler::Options::SharedPrefixBlocks shared_prefix_blocks;  // passed on by make()
  std::vector<Scheduler::Rejected> rejected;
  std::vector<std::unique_ptr<Sequence>> finished;
  std::vector<int64_t> errors;  // sequences that failed
};

std::vector<int64_t> prefill_ids(const StepPlan& p) {
  std::vector<int64_t> ids;
  for (const auto& w : p.prefill) ids.push_back(w.seq_id);
  return ids;
}

TEST_F(SchedulerTest, AdmitsInOrderUpToMaxNumSeqsThenDecodesEveryRunningSequence) {
  make({1000}, /*max_seqs=*/2);
  add(1, 5), add(2, 6), add(3, 7);
  StepPlan p = step();
  EXPECT_EQ(prefill_ids(p), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(p.start.size(), 2u);
  EXPECT_TRUE(p.decode.seq_ids.empty());
  EXPECT_EQ(sched->num_waiting(), 1);
  p = step();
  EXPECT_EQ(p.decode.seq_ids, (std::vector<int64_t>{1, 2}));
  // Each sequence decodes at its true position: prompt + generated - 1.
  EXPECT_EQ(p.decode.positions, (std::vector<int64_t>{5, 6}));
  EXPECT_EQ(p.decode_tokens, (std::vector<int64_t>{1005, 1006}));
  EXPECT_TRUE(p.prefill.empty());
}

TEST_F(SchedulerTest, FinishedSequencesFreeTheirKvAndSamplerInTheNextPlan) {
  make({1000}, /*max_seqs=*/1);
  add(1, 5, /*max_tokens=*/2), add(2, 5);
  step();  // prefill 1 (first token)
  step();  // decode 1: its second token, done
  ASSERT_EQ(finished.size(), 1u);
  EXPECT_TRUE(sched->has_pending());
  StepPlan p = step();
  EXPECT_EQ(p.release, (std::vector<int64_t>{1}));
  EXPECT_EQ(p.remove, (std::vector<int64_t>{1}));
  EXPECT_EQ(prefill_ids(p), (std::vector<int64_t>{2}));
}

TEST_F(SchedulerTest, AdmissionWaitsForRoomAtTheCompressedSize) {
  // 2 layers x blocks of 4: a full 39-token prompt needs 2 * ceil(40 / 4) = 20 blocks; streamingllm
  // at budget 8 needs 2 * ceil(9 / 4) = 6.
  make({26});
  add(1, 39), add(2, 39), add(3, 39, 100, "stream8"), add(4, 39);
  StepPlan p = step();
  EXPECT_EQ(prefill_ids(p), (std::vector<int64_t>{1}));  // FCFS: 2 does not fit, 3 waits behind it
  EXPECT_EQ(sched->num_waiting(), 3);
  auto taken = sched->take_if([](const Sequence& s) { return s.id == 1; });
  ASSERT_EQ(taken.size(), 1u);
  p = step();
  EXPECT_EQ(p.release, (std::vector<int64_t>{1}));
  EXPECT_EQ(prefill_ids(p), (std::vector<int64_t>{2, 3}));  // 20 + 6 blocks; 4 (full) waits
  EXPECT_EQ(sched->num_waiting(), 1);
  EXPECT_FALSE(runner->overflow);
}

TEST_F(SchedulerTest, CompressedPromptsFitWhereFullOnesCannot) {
  make({30});
  for (int64_t id = 1; id <= 4; ++id) add(id, 200, 100, "stream8");
  StepPlan p = step();
  EXPECT_EQ(prefill_ids(p), (std::vector<int64_t>{1, 2, 3, 4}));  // 4 x 6 blocks
  EXPECT_FALSE(runner->overflow);
}

TEST_F(SchedulerTest, PreemptsTheLastAdmittedWhenDecodeCannotGrowAndRecomputesItLater) {
  // Two 8-token prompts: 2 * ceil(9 / 4) = 6 blocks reserved each; they hold 4 each after prefill.
  make({12});
  add(1, 8, /*max_tokens=*/6), add(2, 8);
  StepPlan p = step();
  ASSERT_EQ(prefill_ids(p), (std::vector<int64_t>{1, 2}));
  // Decoding fills block 3 of each sequence; at length 12 both need a fourth block per layer.
  for (int i = 0; i < 10 && sched->preemptions() == 0; ++i) p = step();
  ASSERT_EQ(sched->preemptions(), 1);
  EXPECT_EQ(p.release, (std::vector<int64_t>{2}));
  EXPECT_EQ(p.decode.seq_ids, (std::vector<int64_t>{1}));
  EXPECT_TRUE(p.remove.empty());  // the sampler stays across the preemption
  EXPECT_FALSE(runner->overflow);
  // Once 1 finishes, 2 is prefilled again with what it had generated (but its last token), unsampled.
  while (sched->num_waiting() > 0 && runner->plans.size() < 200) {
    p = step();
    if (!p.prefill.empty()) break;
  }
  ASSERT_EQ(prefill_ids(p), (std::vector<int64_t>{2}));
  EXPECT_FALSE(p.prefill[0].sample);
  EXPECT_TRUE(p.start.empty());
  EXPECT_GT(p.prefill[0].tokens.size(), 8u);
  EXPECT_FALSE(runner->overflow);
}

TEST_F(SchedulerTest, RejectsAPromptNoPoolCouldEverHold) {
  make({1000, 20});  // the second shard is the smaller one
  add(1, 40), add(2, 4);
  StepPlan p = step();
  ASSERT_EQ(rejected.size(), 1u);
  EXPECT_EQ(rejected[0].first->id, 1);
  EXPECT_NE(rejected[0].second.find("more KV cache than the whole pool holds"), std::string::npos);
  EXPECT_EQ(prefill_ids(p), (std::vector<int64_t>{2}));
}

TEST_F(SchedulerTest, EveryShardMustHoldAnAdmittedPrompt) {
  make({1000, 12});
  add(1, 8), add(2, 8), add(3, 8);
  StepPlan p = step();
  EXPECT_EQ(prefill_ids(p), (std::vector<int64_t>{1, 2}));  // 6 + 6 blocks on the small shard
  EXPECT_FALSE(runner->overflow);
}

TEST_F(SchedulerTest, LimitsPromptTokensPerStepButAlwaysAdmitsOne) {
  make({1000}, 8, /*max_tokens=*/10);
  add(1, 12), add(2, 4), add(3, 4);
  EXPECT_EQ(prefill_ids(step()), (std::vector<int64_t>{1}));
  EXPECT_EQ(prefill_ids(step()), (std::vector<int64_t>{2, 3}));
}

TEST_F(SchedulerTest, CancellingAWaitingSequenceNeedsNoRunnerWork) {
  make({1000}, 1);
  add(1, 4), add(2, 4);
  step();
  auto taken = sched->take_if([](const Sequence& s) { return s.id == 2; });
  ASSERT_EQ(taken.size(), 1u);
  EXPECT_FALSE(sched->has_pending());
  StepPlan p = step();
  EXPECT_TRUE(p.release.empty());
  EXPECT_EQ(sched->num_waiting(), 0);
}

TEST_F(SchedulerTest, AFailedDecodeRecomputesItsBatchAndOnlyTheFailingSequenceFails) {
  make({1000});
  add(1, 5), add(2, 6), add(3, 7);
  step();
  runner->fail_decode_of = 2;
  StepPlan p = step();  // decodes 1, 2, 3 together: fails; nobody knows which one
  EXPECT_EQ(p.decode.seq_ids, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_TRUE(errors.empty());
  EXPECT_EQ(sched->num_waiting(), 3);
  p = step();  // all three are recomputed from their prompt and output (unsampled)
  EXPECT_EQ(p.release, (std::vector<int64_t>{1, 2, 3}));
  ASSERT_EQ(prefill_ids(p), (std::vector<int64_t>{1, 2, 3}));
  for (const auto& w : p.prefill) EXPECT_FALSE(w.sample);
  EXPECT_EQ(step().decode.seq_ids, (std::vector<int64_t>{1}));  // then each decodes alone
  EXPECT_EQ(step().decode.seq_ids, (std::vector<int64_t>{2}));  // fails again: alone, so it fails
  EXPECT_EQ(errors, (std::vector<int64_t>{2}));
  p = step();
  EXPECT_EQ(p.decode.seq_ids, (std::vector<int64_t>{3}));
  EXPECT_EQ(p.release, (std::vector<int64_t>{2}));
  EXPECT_EQ(p.remove, (std::vector<int64_t>{2}));
  EXPECT_EQ(step().decode.seq_ids, (std::vector<int64_t>{1, 3}));  // the survivors batch again
}

// --- chunked prefill ---------------------------------------------------------------------------

// (start, size, samples) of each prefill of a plan.
std::vector<std::tuple<int64_t, int64_t, int64_t, bool>> chunks(const StepPlan& p) {
  std::vector<std::tuple<int64_t, int64_t, int64_t, bool>> out;
  for (const auto& w : p.prefill) out.emplace_back(w.seq_id, w.start, static_cast<int64_t>(w.tokens.size()), w.sample);
  return out;
}
using Chunks = std::vector<std::tuple<int64_t, int64_t, int64_t, bool>>;

TEST_F(SchedulerTest, ChunkedPrefillSplitsALongPromptWhileTheOthersDecodeEveryStep) {
  make({1000}, 8, /*max_tokens=*/10, /*chunked=*/true);
  add(1, 4), add(2, 4);
  EXPECT_EQ(chunks(step()), (Chunks{{1, 0, 4, true}, {2, 0, 4, true}}));
  Sequence* s3 = add(3, 25);
  StepPlan p = step();
  EXPECT_EQ(p.decode.seq_ids, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(chunks(p), (Chunks{{3, 0, 10, false}}));
  EXPECT_EQ(p.prefill[0].prompt_len, 25);
  EXPECT_EQ(p.start.size(), 1u);  // the sampler comes with the first chunk
  EXPECT_TRUE(s3->output.empty());
  p = step();
  EXPECT_EQ(p.decode.seq_ids, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(chunks(p), (Chunks{{3, 10, 10, false}}));
  EXPECT_TRUE(p.start.empty());
  p = step();
  EXPECT_EQ(p.decode.seq_ids, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(chunks(p), (Chunks{{3, 20, 5, true}}));  // only the last chunk samples
  EXPECT_EQ(s3->output, (std::vector<int64_t>{1025}));
  EXPECT_EQ(s3->full_kv, 25 * kLayers);
  p = step();
  EXPECT_EQ(p.decode.seq_ids, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(p.decode.positions.back(), 25);
  EXPECT_TRUE(p.prefill.empty());
  EXPECT_FALSE(runner->overflow);
}

TEST_F(SchedulerTest, ChunksShareTheStepBudgetInAdmissionOrder) {
  make({1000}, 8, /*max_tokens=*/10, /*chunked=*/true);
  add(1, 14), add(2, 14), add(3, 3);
  EXPECT_EQ(chunks(step()), (Chunks{{1, 0, 10, false}}));
  // 1 goes on first; 2 gets a first chunk from what is left; 3 waits behind it (FCFS).
  EXPECT_EQ(chunks(step()), (Chunks{{1, 10, 4, true}, {2, 0, 6, false}}));
  StepPlan p = step();
  EXPECT_EQ(p.decode.seq_ids, (std::vector<int64_t>{1}));
  EXPECT_EQ(chunks(p), (Chunks{{2, 6, 8, true}, {3, 0, 2, false}}));
  p = step();
  EXPECT_EQ(p.decode.seq_ids, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(chunks(p), (Chunks{{3, 2, 1, true}}));
}

TEST_F(SchedulerTest, WhileSequencesDecodeAStepPrefillsAtMostTheLongPrefillThreshold) {
  make({1000}, 8, /*max_tokens=*/10, /*chunked=*/true, /*long_prefill_threshold=*/3);
  // Nothing decodes yet: the whole budget, and a prompt within it runs whole.
  add(1, 8);
  EXPECT_EQ(chunks(step()), (Chunks{{1, 0, 8, true}}));
  // 1 decodes from now on: a step carries at most 3 prompt tokens, shared in admission order.
  add(2, 7), add(3, 2);
  StepPlan p = step();
  EXPECT_EQ(p.decode.seq_ids, (std::vector<int64_t>{1}));
  EXPECT_EQ(chunks(p), (Chunks{{2, 0, 3, false}}));
  EXPECT_EQ(chunks(step()), (Chunks{{2, 3, 3, false}}));
  EXPECT_EQ(chunks(step()), (Chunks{{2, 6, 1, true}, {3, 0, 2, true}}));
  EXPECT_FALSE(sched->oldest_waiting_arrival());
  Sequence* s4 = add(4, 5);
  add(5, 5);
  s4->arrival -= std::chrono::seconds(3);
  EXPECT_EQ(sched->oldest_waiting_arrival(), s4->arrival);
  EXPECT_EQ(chunks(step()), (Chunks{{4, 0, 3, false}}));  // 4 started: 5 is the oldest waiting now
  EXPECT_GT(*sched->oldest_waiting_arrival(), s4->arrival);
}

TEST(SchedulerOptions, LongPrefillThresholdAutoIsACpuValueAndNoCapOnCuda) {
  EXPECT_EQ(resolve_long_prefill_token_threshold(-1, /*cuda=*/false), kAutoLongPrefillTokensCpu);
  EXPECT_EQ(resolve_long_prefill_token_threshold(-1, /*cuda=*/true), 0);
  EXPECT_EQ(resolve_long_prefill_token_threshold(0, false), 0);
  EXPECT_EQ(resolve_long_prefill_token_threshold(512, true), 512);
}

TEST_F(SchedulerTest, WithoutChunkingALongPromptRunsWholeInOneStep) {
  make({1000}, 8, /*max_tokens=*/10);
  add(1, 25);
  EXPECT_EQ(chunks(step()), (Chunks{{1, 0, 25, true}}));
}

TEST_F(SchedulerTest, H2oPromptsArePrefilledWhole) {
  make({1000}, 8, /*max_tokens=*/10, /*chunked=*/true);
  add(1, 25, 100, "h2o8"), add(2, 25, 100, "stream8");
  EXPECT_EQ(chunks(step()), (Chunks{{1, 0, 25, true}}));  // alone, as without chunking
  EXPECT_EQ(chunks(step()), (Chunks{{2, 0, 10, false}}));
}

TEST_F(SchedulerTest, OverARoundingKvCacheOnlyFullPromptsAreChunked) {
  make({1000}, 8, /*max_tokens=*/10, /*chunked=*/true);
  runner->rounds_kv = true;
  sched->update(StepPlan{}, runner->execute(StepPlan{}));
  add(1, 25, 100, "stream8"), add(2, 25);
  EXPECT_EQ(chunks(step()), (Chunks{{1, 0, 25, true}}));  // compressing: whole, its selection sees fp32 keys
  EXPECT_EQ(chunks(step()), (Chunks{{2, 0, 10, false}}));
}

TEST_F(SchedulerTest, AChunkedCompressedPromptReservesItsUncompressedSizeUntilItsLastChunk) {
  // stream8, 30 tokens: 2 * ceil(9 / 4) = 6 blocks whole, 2 * ceil(31 / 4) = 16 chunked. A full
  // 8-token prompt needs 6. After the first chunk (20 tokens, 10 blocks held) the first prompt still
  // reserves 6 more, so the second fits beside it only in a pool of 22.
  for (int64_t pool : {21, 22}) {
    make({pool}, 8, /*max_tokens=*/20, /*chunked=*/true);
    add(1, 30, 100, "stream8"), add(2, 8);
    EXPECT_EQ(chunks(step()), (Chunks{{1, 0, 20, false}})) << pool;
    StepPlan p = step();
    if (pool == 21) {
      EXPECT_EQ(chunks(p), (Chunks{{1, 20, 10, true}}));
      EXPECT_EQ(chunks(step()), (Chunks{{2, 0, 8, true}}));  // once 1 is compacted to 8 tokens
    } else {
      EXPECT_EQ(chunks(p), (Chunks{{1, 20, 10, true}, {2, 0, 8, true}}));
    }
    EXPECT_FALSE(runner->overflow) << pool;
  }
  // A pool that cannot hold the uncompressed prompt prefills it whole, at its compressed size.
  make({15}, 8, /*max_tokens=*/20, /*chunked=*/true);
  add(1, 30, 100, "stream8");
  EXPECT_EQ(chunks(step()), (Chunks{{1, 0, 30, true}}));
}

TEST_F(SchedulerTest, PreemptionMidPromptFreesItsChunksAndStartsItOver) {
  // 1 (7 tokens, 4 blocks) decodes; 2 (24 tokens) reserves 2 * ceil(25 / 4) = 14 of the 18 blocks.
  // When 1's next token needs a fresh block per layer, 2 (admitted last) is preempted mid-prompt.
  make({18}, 8, /*max_tokens=*/8, /*chunked=*/true);
  add(1, 7, 5);
  step();
  add(2, 24);
  EXPECT_EQ(chunks(step()), (Chunks{{2, 0, 8, false}}));
  StepPlan p = step();
  EXPECT_EQ(sched->preemptions(), 1);
  EXPECT_EQ(p.release, (std::vector<int64_t>{2}));
  EXPECT_EQ(p.decode.seq_ids, (std::vector<int64_t>{1}));
  EXPECT_FALSE(runner->holds(2));
  EXPECT_FALSE(runner->overflow);
  // It comes back from its first token, unsampled chunks included, and samples at its last chunk.
  bool restarted = false, sampled = false;
  for (int i = 0; i < 60 && !sampled; ++i) {
    p = step();
    for (const auto& w : p.prefill) {
      if (w.seq_id != 2) continue;
      restarted = restarted || w.start == 0;
      sampled = w.sample;
      EXPECT_EQ(w.prompt_len, 24);
    }
  }
  EXPECT_TRUE(restarted && sampled);
  EXPECT_FALSE(runner->overflow);
}

TEST_F(SchedulerTest, CancellingMidPromptFreesTheStagedChunks) {
  make({1000}, 8, /*max_tokens=*/8, /*chunked=*/true);
  add(1, 30);
  step();
  EXPECT_TRUE(runner->holds(1));
  auto taken = sched->take_if([](const Sequence& s) { return s.id == 1; });
  ASSERT_EQ(taken.size(), 1u);
  StepPlan p = step();
  EXPECT_EQ(p.release, (std::vector<int64_t>{1}));
  EXPECT_EQ(p.remove, (std::vector<int64_t>{1}));
  EXPECT_TRUE(p.prefill.empty());
  EXPECT_EQ(runner->used(), 0);
}

TEST_F(SchedulerTest, AFailedChunkFailsOnlyItsRequest) {
  make({1000}, 8, /*max_tokens=*/8, /*chunked=*/true);
  add(1, 4), add(2, 20);
  step();  // 1 whole, 2's first chunk [0, 4)
  runner->fail_prefill_of = 2;
  StepPlan p = step();
  EXPECT_EQ(chunks(p), (Chunks{{2, 4, 8, false}}));
  EXPECT_EQ(errors, (std::vector<int64_t>{2}));
  p = step();
  EXPECT_EQ(p.release, (std::vector<int64_t>{2}));
  EXPECT_EQ(p.decode.seq_ids, (std::vector<int64_t>{1}));
  EXPECT_FALSE(runner->holds(2));
  EXPECT_EQ(sched->num_running(), 1);
}

// prefix_reuse: compressed. A finished conversation's KV is parked (its blocks stay counted as
// used); the next turn's prompt, which extends it, resumes it and adds only its new positions.
TEST_F(SchedulerTest, AFinishedConversationIsParkedAndItsNextTurnResumesIt) {
  make({1000});
  add(1, 20, /*max_tokens=*/3, "stream8c");
  while (finished.empty()) step();
  const Sequence& first = *finished[0];
  StepPlan p = step();
  EXPECT_EQ(p.park, (std::vector<int64_t>{1}));
  EXPECT_TRUE(p.release.empty());
  EXPECT_TRUE(runner->holds(1));
  EXPECT_EQ(sched->usage().conversations_parked, 1);
  EXPECT_GT(sched->usage().blocks_parked, 0);
  // The next turn: the first prompt, what was generated, and five new tokens.
  std::vector<int64_t> next = first.req.prompt_ids;
  next.insert(next.end(), first.output.begin(), first.output.end());
  next.insert(next.end(), 5, 9);
  add(2, 0, 2, "stream8c", next);
  p = step();
  ASSERT_EQ(prefill_ids(p), (std::vector<int64_t>{2}));
  EXPECT_EQ(p.prefill[0].resume.seq_id, 1);
  EXPECT_EQ(p.prefill[0].resume.length, 20 + 3 - 1) << "the prompt and every fed token";
  EXPECT_FALSE(runner->holds(1));
  EXPECT_EQ(sched->usage().conversations_parked, 0);
  // Asked for exactly, the third turn neither resumes nor parks.
  while (finished.size() < 2) step();
  step();
  std::vector<int64_t> third = next;
  third.insert(third.end(), finished[1]->output.begin(), finished[1]->output.end());
  third.push_back(11);
  Sequence* s = add(3, 0, 1, "stream8c", third);
  s->req.reuse_compressed = false;
  p = step();
  ASSERT_EQ(prefill_ids(p), (std::vector<int64_t>{3}));
  EXPECT_EQ(p.prefill[0].resume.seq_id, -1);
  EXPECT_TRUE(runner->holds(2)) << "still parked";
  while (finished.size() < 3) step();
  p = step();
  EXPECT_EQ(p.release, (std::vector<int64_t>{3}));
  EXPECT_TRUE(p.park.empty());
  EXPECT_FALSE(runner->overflow);
}

TEST_F(SchedulerTest, AnExactRequestNeitherParksNorResumes) {
  make({1000});
  Sequence* s = add(1, 20, 2, "stream8c");
  s->req.reuse_compressed = false;
  while (finished.empty()) step();
  StepPlan p = step();
  EXPECT_EQ(p.release, (std::vector<int64_t>{1}));
  EXPECT_TRUE(p.park.empty());
  // A full-KV policy has nothing compressed to keep, whatever the request asks.
  Sequence* f = add(2, 20, 2, "full");
  f->req.reuse_compressed = true;
  while (finished.size() < 2) step();
  p = step();
  EXPECT_EQ(p.release, (std::vector<int64_t>{2}));
}

TEST_F(SchedulerTest, ParkedConversationsGoBeforeAPromptWaitsOrAnythingIsPreempted) {
  // 2 layers x ceil(9 / 4) = 6 blocks for a compressed prompt (8 kept + 1); the pool holds 14.
  make({14});
  add(1, 20, 2, "stream8c"), add(2, 20, 2, "stream8c");
  while (finished.size() < 2) step();
  StepPlan p = step();
  EXPECT_EQ(p.park.size(), 2u);
  // A long full-KV prompt needs 2 x ceil(11 / 4) = 6 blocks: the oldest conversation goes first.
  add(3, 10, 30, "full");
  p = step();
  EXPECT_EQ(p.release, (std::vector<int64_t>{1}));
  EXPECT_EQ(prefill_ids(p), (std::vector<int64_t>{3}));
  // As it decodes, the other parked conversation goes before sequence 3 would be preempted.
  while (runner->parked.count(2) && runner->plans.size() < 100) p = step();
  EXPECT_FALSE(runner->parked.count(2));
  EXPECT_EQ(sched->preemptions(), 0);
  EXPECT_FALSE(runner->overflow);
}

// Found by the soak (a 4 MiB pool): a conversation that finished in the last step is parked by the
// next plan, and when that plan evicts it for room it must only release it (the shards release
// before they park: a plan with both parked a sequence that was gone, and the engine failed).
TEST_F(SchedulerTest, AConversationEvictedByThePlanThatWouldParkItIsOnlyReleased) {
  // 14 blocks: the finished conversation holds 6, a 20-token full prompt needs 2 x ceil(21 / 4) = 12.
  make({14});
  add(1, 20, 2, "stream8c");
  while (finished.empty()) step();
  add(2, 20, 2, "full");
  StepPlan p = step();
  EXPECT_TRUE(p.park.empty());
  EXPECT_EQ(p.release, (std::vector<int64_t>{1}));
  EXPECT_EQ(prefill_ids(p), (std::vector<int64_t>{2}));
  EXPECT_FALSE(runner->holds(1));
  EXPECT_TRUE(runner->parked.empty());
  EXPECT_EQ(sched->usage().conversations_parked, 0);
  EXPECT_FALSE(runner->overflow);
}

TEST_F(SchedulerTest, AtMostMaxParkedConversationsStayParked) {
  runner = std::make_unique<FakeRunner>(std::vector<int64_t>{1000}, std::map<std::string, int64_t>{{"stream8c", 8}});
  Scheduler::Options o;
  o.policies = policies();
  o.max_parked_conversations = 2;
  sched = std::make_unique<Scheduler>(std::move(o));
  sched->update(StepPlan{}, runner->execute(StepPlan{}));
  for (int64_t id = 1; id <= 3; ++id) add(id, 20 + id, 2, "stream8c");
  while (finished.size() < 3) step();
  step();
  EXPECT_EQ(sched->usage().conversations_parked, 2);
  EXPECT_EQ(runner->parked, (std::set<int64_t>{2, 3})) << "the oldest went";
  EXPECT_FALSE(runner->holds(1));
}

// Conversations under pressure: turns that resume parked KV, exact requests, parked conversations
// evicted to make room. The pool must never overflow and nothing may fail or be preempted for want
// of room a parked conversation held.
TEST_F(SchedulerTest, ConversationsUnderPressureNeverOverflowThePool) {
  make({60}, /*max_seqs=*/4);
  std::mt19937 rng(7);
  std::map<int64_t, std::vector<int64_t>> next_turn;  // a finished turn's id -> its conversation so far
  int64_t id = 0, resumed = 0;
  for (int step_no = 0; step_no < 600; ++step_no) {
    if (sched->num_waiting() < 2 && rng() % 3 == 0) {
      ++id;
      std::vector<int64_t> prompt;
      if (!next_turn.empty() && rng() % 2 == 0) {
        auto it = next_turn.begin();
        std::advance(it, static_cast<long>(rng() % next_turn.size()));
        prompt = it->second;
        next_turn.erase(it);
      } else {
        prompt.assign(static_cast<size_t>(10 + rng() % 20), 100 + id);
      }
      prompt.insert(prompt.end(), static_cast<size_t>(1 + rng() % 6), 7);
      Sequence* s = add(id, 0, 1 + static_cast<int64_t>(rng() % 5), rng() % 4 == 0 ? "full" : "stream8c", prompt);
      if (rng() % 5 == 0) s->req.reuse_compressed = false;
    }
    const size_t before = finished.size();
    StepPlan p = step();
    for (const auto& w : p.prefill) resumed += w.resume.seq_id >= 0;
    for (size_t f = before; f < finished.size(); ++f) {
      const Sequence& done = *finished[f];
      std::vector<int64_t> conv = done.req.prompt_ids;
      conv.insert(conv.end(), done.output.begin(), done.output.end());
      next_turn[done.id] = conv;
    }
    ASSERT_FALSE(runner->overflow) << "step " << step_no;
  }
  EXPECT_TRUE(errors.empty());
  EXPECT_GT(resumed, 10) << "turns resumed their parked conversations";
  std::cout << id << " requests, " << resumed << " resumed, " << sched->preemptions() << " preemptions\n";
}

// A whole compressing prompt may start from the prefix cache only where admission reserved the
// copies' room: the cached blocks it takes stay pinned until it ends, and that bound covers them.
TEST_F(SchedulerTest, ACompressingPromptReusesThePrefixCacheOnlyWithRoomForItsCopies) {
  // stream8 on 20 tokens: a peak of 2 x ceil(9 / 4) = 6 blocks, copies of 2 x 20 / 4 = 10.
  for (const auto& [pool, reuse] : {std::pair<int64_t, bool>{12, false}, {40, true}}) {
    make({pool});
    runner->prefix_caching = true;
    sched->update(StepPlan{}, runner->execute(StepPlan{}));
    add(1, 20, 1, "stream8");
    add(2, 20, 1, "full");
    StepPlan p = step();
    ASSERT_FALSE(p.prefill.empty());
    ASSERT_EQ(p.prefill[0].seq_id, 1);
    EXPECT_EQ(p.prefill[0].keep_copy, reuse) << pool;
    EXPECT_EQ(p.prefill[0].reuse_prefix, reuse) << pool;
    while (p.prefill.empty() || p.prefill.back().seq_id != 2) p = step();
    EXPECT_TRUE(p.prefill.back().reuse_prefix) << "full KV counts its cached blocks in its own need";
  }
}

TEST_F(SchedulerTest, AWholeFullPromptIsAdmittedForTheBlocksItDoesNotShare) {
  // The runner's answer stands in for PagedKvMemory::shared_prefix_blocks (tested on a real memory
  // in test_prefix_caching.cpp): 16 of a 39-token prompt's 20 blocks are in use by others.
  std::vector<std::pair<int64_t, std::vector<int64_t>>> asked;  // prompt length, leaving
  shared_prefix_blocks = [&](std::span<const int64_t> prompt, const std::string& policy, std::span<const int64_t> leaving) {
    EXPECT_EQ(policy, "full");
    asked.push_back({static_cast<int64_t>(prompt.size()), {leaving.begin(), leaving.end()}});
    return std::optional<int64_t>(prompt.size() == 39 ? 16 : 0);
  };
  make({32});
  runner->shared[2] = 16;
  add(1, 38), add(2, 39);
  StepPlan p = step();  // 1 takes 20 blocks; 2 needs 20 - 16 = 4 of the 12 left
  EXPECT_EQ(prefill_ids(p), (std::vector<int64_t>{1, 2}));
  add(3, 39, 100, "stream8");  // a compressing prompt is never asked about
  add(4, 40);                  // nothing shared: 22 blocks do not fit
  p = step();
  EXPECT_EQ(prefill_ids(p), (std::vector<int64_t>{3}));
  EXPECT_FALSE(runner->overflow);
  auto taken = sched->take_if([](const Sequence& s) { return s.id == 1; });
  ASSERT_EQ(taken.size(), 1u);
  asked.clear();
  step();
  // The plan that releases 1 tells the runner so, with 4's admission question.
  ASSERT_FALSE(asked.empty());
  EXPECT_EQ(asked[0], (std::pair<int64_t, std::vector<int64_t>>{40, {1}}));
  // A prompt that asks every position's logits takes nothing from the cache: all its blocks count.
  make({32});
  runner->shared[2] = 16;
  add(1, 38);
  add(2, 39)->req.sampling.prompt_logprobs = 0;
  EXPECT_EQ(prefill_ids(step()), (std::vector<int64_t>{1}));
  // One shard of a sharded job: no answer, so every block counts.
  shared_prefix_blocks = [](std::span<const int64_t>, const std::string&, std::span<const int64_t>) {
    return std::optional<int64_t>();
  };
  make({32});
  add(1, 38), add(2, 39);
  EXPECT_EQ(prefill_ids(step()), (std::vector<int64_t>{1}));
}

}  // namespace
}  // namespace kvserve
