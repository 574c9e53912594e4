// Policies that name their own KV dtype (kv_dtype) on one engine: sequences of a float32, an int8
// and an int4 policy decode in the same steps, each generating what an engine whose whole cache
// has that dtype generates; a budget_bytes buys more tokens at fewer bits; the pool drains to
// nothing. On the tiny model (head_dim 32) and the real engine, runner and scheduler.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <iostream>
#include <map>
#include <mutex>
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

using Specs = std::map<std::string, std::map<std::string, std::string>>;

struct Result {
  std::vector<int64_t> tokens;
  std::vector<double> logprobs;  // the chosen tokens': they tell the dtypes apart where tokens agree
  std::string finish_reason, error, kv_cache_dtype;
  int64_t kept = 0, kv_token_layer_bytes = 0;
};

// An engine on the tiny model whose whole cache is `kv_cache_dtype`, with `policies`.
struct EngineRun {
  EngineRun(const std::string& kv_cache_dtype, Specs policies, bool speculate = false, int64_t kv_cache_bytes = 8 << 20,
            int64_t max_num_seqs = 8) {
    LoadOptions lo{"cpu", "", false};
    lo.kv_cache_dtype = kv_cache_dtype;
    auto model = DecoderModel::load(kModel, lo);
    auto tok = std::make_shared<Tokenizer>(Tokenizer::from_dir(kModel));
    EngineOptions eo;
    eo.kv_cache_bytes = kv_cache_bytes;
    eo.max_num_seqs = max_num_seqs;
    eo.max_num_batched_tokens = 4096;
    eo.enable_chunked_prefill = false;
    eo.warmup_tokens = 0;
    eo.policies = std::move(policies);
    if (speculate) {  // prompt lookup: a sequence's drafts are further rows of its format's part
      eo.speculative.method = "ngram";
      eo.speculative.num_speculative_tokens = 4;
      eo.speculative.prompt_lookup_min = 1;
      eo.speculative.auto_disable = false;
    }
    engine = std::make_unique<Engine>(model, tok, eo);
  }

  // Submits one prompt per policy in one batch (one step prefills them all, later steps decode them
  // together) and waits for every one.
  std::map<std::string, Result> generate(const std::vector<std::pair<std::string, std::string>>& id_policy,
                                         const std::vector<int>& lengths = {}, const std::vector<int>& max_tokens = {}) {
    std::vector<Submission> batch;
    for (size_t i = 0; i < id_policy.size(); ++i) {
      const auto& [id, policy] = id_policy[i];
      Submission s;
      s.request.request_id = id;
      const int len = i < lengths.size() ? lengths[i] : 300;
      for (int t = 0; t < len; ++t) s.request.prompt_ids.push_back(5 + (t * 37 + 101 * static_cast<int>(i)) % 1900);
      s.request.sampling.temperature = 0;
      s.request.sampling.max_tokens = i < max_tokens.size() ? max_tokens[i] : 12;
      s.request.sampling.ignore_eos = true;
      s.request.sampling.logprobs = 0;
      s.request.kv_policy = policy;
      s.on_event = [this, id](const GenerationEvent& ev) {
        std::lock_guard<std::mutex> lock(mu);
        Result& r = results[id];
        r.tokens.insert(r.tokens.end(), ev.token_ids.begin(), ev.token_ids.end());
        for (const TokenLogprob& c : ev.chosen) r.logprobs.push_back(c.logprob);
        if (ev.kept_kv_tokens > 0) r.kept = ev.kept_kv_tokens;
        if (ev.finished) {
          r.finish_reason = ev.finish_reason;
          r.error = ev.error;
          r.kv_cache_dtype = ev.kv_cache_dtype;
          r.kv_token_layer_bytes = ev.kv_token_layer_bytes;
          ++finished;
          cv.notify_all();
        }
      };
      batch.push_back(std::move(s));
    }
    engine->submit_all(std::move(batch));
    std::unique_lock<std::mutex> lock(mu);
    EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(120), [&] { return finished >= id_policy.size(); }));
    return results;
  }

  // KV bytes in use once the engine has released what finished (a finished sequence's blocks go
  // in the step after its last event): polled for up to 30 s.
  int64_t bytes_used_when_idle() const {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    EngineStats st = engine->stats();
    while (st.kv_bytes_used > 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      st = engine->stats();
    }
    return st.kv_bytes_used;
  }

  std::unique_ptr<Engine> engine;
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, Result> results;
  size_t finished = 0;
};

// What the mixed engine names "p8" / "p4" are the plain engines' "p" in int8 / int4.
Specs snap(const std::string& budget_key, const std::string& budget, const std::string& kv_dtype = "") {
  std::map<std::string, std::string> p{{"name", "snapkv"}, {budget_key, budget}, {"window", "8"}};
  if (!kv_dtype.empty()) p["kv_dtype"] = kv_dtype;
  return {{"p", p}};
}

}  // namespace

TEST(MixedKvEngine, EachPolicyGeneratesWhatItsDtypeAloneGenerates) {
  // One engine: full in float32 (the cache's dtype), full in int8, snapkv keeping 64 tokens in int4.
  Specs mixed{{"full8", {{"name", "full"}, {"kv_dtype", "int8"}}},
              {"snap4", {{"name", "snapkv"}, {"budget", "64"}, {"window", "8"}, {"kv_dtype", "int4"}}}};
  EngineRun m("", mixed);
  const auto got = m.generate({{"a", ""}, {"b", "full8"}, {"c", "snap4"}});
  for (const auto& [id, r] : got) {
    EXPECT_EQ(r.finish_reason, "length") << id << ": " << r.error;
    EXPECT_EQ(r.tokens.size(), 12u) << id;
  }
  // The same prompts in engines of one dtype each, three rows a step as in the mixed engine.
  EngineRun f32("", {});
  EngineRun i8("int8", {});
  EngineRun i4("int4", snap("budget", "64"));
  const auto want32 = f32.generate({{"a", ""}, {"b", ""}, {"c", ""}});
  const auto want8 = i8.generate({{"a", ""}, {"b", ""}, {"c", ""}});
  const auto want4 = i4.generate({{"a", "p"}, {"b", "p"}, {"c", "p"}});
  EXPECT_EQ(got.at("a").tokens, want32.at("a").tokens);
  EXPECT_EQ(got.at("b").tokens, want8.at("b").tokens);
  EXPECT_EQ(got.at("c").tokens, want4.at("c").tokens);
  EXPECT_EQ(got.at("c").kept, want4.at("c").kept);
  // Bit for bit: each row's attention read its own format's blocks, and the step's other rows
  // changed nothing in it.
  EXPECT_EQ(got.at("a").logprobs, want32.at("a").logprobs);
  EXPECT_EQ(got.at("b").logprobs, want8.at("b").logprobs);
  EXPECT_EQ(got.at("c").logprobs, want4.at("c").logprobs);
  ASSERT_EQ(want8.at("b").logprobs.size(), 12u);
  EXPECT_NE(want8.at("b").logprobs, want32.at("b").logprobs) << "int8 and float32 should differ in the last bits";
  // Everything went back: the step's three formats hold nothing once their sequences finished.
  EXPECT_EQ(m.bytes_used_when_idle(), 0);
  const EngineStats s = m.engine->stats();
  EXPECT_GT(s.kv_bytes_total, 0);
  EXPECT_LE(s.kv_bytes_total, int64_t{8} << 20);
}

TEST(MixedKvEngine, BudgetBytesBuysMoreTokensAtFewerBits) {
  // 24 KiB per sequence: float32 K/V of 2 KV heads × 32 dims are 512 bytes a token-layer, int4's 72.
  Specs both{{"snap32", {{"name", "snapkv"}, {"budget_bytes", "24576"}, {"window", "8"}}},
             {"snap4", {{"name", "snapkv"}, {"budget_bytes", "24576"}, {"window", "8"}, {"kv_dtype", "int4"}}}};
  EngineRun m("", both);
  const auto got = m.generate({{"x", "snap32"}, {"y", "snap4"}});
  ASSERT_GT(got.at("x").kept, 0);
  // Each kept what an engine of its dtype keeps under the same bytes.
  EngineRun i4("int4", snap("budget_bytes", "24576"));
  EXPECT_EQ(got.at("y").kept, i4.generate({{"x", "p"}, {"y", "p"}}).at("y").kept);
  EXPECT_GE(got.at("y").kept, 6 * got.at("x").kept);
}

TEST(MixedKvEngine, AKvDtypeTheModelCannotStoreNamesThePolicy) {
  try {
    EngineRun m("", {{"odd", {{"name", "full"}, {"kv_dtype", "int3"}}}});
    FAIL() << "an engine started with kv_dtype int3";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("policy 'odd'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("int3"), std::string::npos) << e.what();
  }
}

TEST(MixedKvEngine, ALadderPicksTheRungByPromptLength) {
  // 24 KiB over 4 layers: 12 float32 tokens a layer, 45 int8, 85 int4 (512, 136, 72 bytes a token-layer).
  EngineRun m("", {{"lad", {{"name", "snapkv"}, {"budget_bytes", "24576"}, {"window", "4"}, {"kv_dtype", "ladder"}}}});
  const auto got = m.generate({{"short", "lad"}, {"mid", "lad"}, {"long", "lad"}}, {10, 80, 300});
  for (const auto& [id, r] : got) EXPECT_EQ(r.finish_reason, "length") << id << ": " << r.error;
  EXPECT_EQ(got.at("short").kept, 4 * 10);  // the whole prompt in float32
  EXPECT_EQ(got.at("mid").kept, 4 * 45);    // 45 of 80 in int8: over half
  EXPECT_EQ(got.at("long").kept, 4 * 85);   // 45 of 300 is under half: int4
  // Each request reports the dtype of its rung and what a token-layer costs in it.
  EXPECT_EQ(got.at("short").kv_cache_dtype, "float32");
  EXPECT_EQ(got.at("mid").kv_cache_dtype, "int8");
  EXPECT_EQ(got.at("long").kv_cache_dtype, "int4");
  EXPECT_EQ(got.at("short").kv_token_layer_bytes, 512);
  EXPECT_EQ(got.at("mid").kv_token_layer_bytes, 136);
  EXPECT_EQ(got.at("long").kv_token_layer_bytes, 72);
  EXPECT_EQ(m.bytes_used_when_idle(), 0);
}

TEST(MixedKvEngine, KvzipInInt8BesideFloat32) {
  // kvzip scores from the full-precision prefill, then keeps its heads' tokens in int8 blocks
  // (head-wise layout), beside a float32 full-KV request in the same steps.
  EngineRun m("", {{"zip8", {{"name", "kvzip"}, {"budget", "64"}, {"kv_dtype", "int8"}}}});
  const auto got = m.generate({{"a", ""}, {"z", "zip8"}});
  EngineRun i8("int8", {{"p", {{"name", "kvzip"}, {"budget", "64"}}}});
  const auto want = i8.generate({{"a", ""}, {"z", "p"}});
  EXPECT_EQ(got.at("z").finish_reason, "length") << got.at("z").error;
  EXPECT_EQ(got.at("z").tokens, want.at("z").tokens);
  EXPECT_EQ(got.at("z").logprobs, want.at("z").logprobs);
  EXPECT_EQ(got.at("z").kept, want.at("z").kept);
  EXPECT_LT(got.at("z").kept, 4 * 300);
  EXPECT_EQ(m.bytes_used_when_idle(), 0);
}

TEST(MixedKvEngine, SpeculationOverSeveralFormatsKeepsTheTokens) {
  Specs mixed{{"full8", {{"name", "full"}, {"kv_dtype", "int8"}}},
              {"snap4", {{"name", "snapkv"}, {"budget", "64"}, {"window", "8"}, {"kv_dtype", "int4"}}}};
  EngineRun plain("", mixed);
  EngineRun spec("", mixed, /*speculate=*/true);
  const std::vector<std::pair<std::string, std::string>> reqs{{"a", ""}, {"b", "full8"}, {"c", "snap4"}};
  const auto want = plain.generate(reqs), got = spec.generate(reqs);
  for (const auto& [id, r] : want) {
    EXPECT_EQ(got.at(id).finish_reason, "length") << id << ": " << got.at(id).error;
    EXPECT_EQ(got.at(id).tokens, r.tokens) << id;
  }
  EXPECT_GT(spec.engine->stats().spec_decode_num_draft_tokens, 0);
  EXPECT_EQ(spec.bytes_used_when_idle(), 0);
}

TEST(MixedKvEngine, ASoakOfTwoFormatsInAFullPoolFinishesEveryRequest) {
  // int8 (the cache's dtype) and int4 sequences in a pool that holds a few of them at a time: they
  // are admitted, grow, are preempted and recomputed, and their slabs change hands. Every request
  // must end with all its tokens and no error (the scheduler counts only a format's own slabs and
  // free slabs as its room, so no decode step meets a pool it thought had room), and the pool must
  // end empty.
  Specs specs = {{"full4", {{"name", "full"}, {"kv_dtype", "int4"}}},
                 {"snap4", {{"name", "snapkv"}, {"budget", "48"}, {"window", "8"}, {"kv_dtype", "int4"}}},
                 {"snap8", {{"name", "snapkv"}, {"budget", "48"}, {"window", "8"}}}};
  EngineRun run("int8", specs, false, 160 << 10, 12);
  const std::vector<std::string> policies = {"full", "full4", "snap4", "snap8"};
  std::vector<std::pair<std::string, std::string>> ids;
  std::vector<int> lengths, max_tokens;
  uint32_t x = 12345;
  auto next = [&](int lo, int hi) {
    x = x * 1664525u + 1013904223u;
    return lo + static_cast<int>((x >> 8) % static_cast<uint32_t>(hi - lo + 1));
  };
  for (int i = 0; i < 48; ++i) {
    ids.emplace_back("r" + std::to_string(i), policies[static_cast<size_t>(next(0, 3))]);
    lengths.push_back(next(8, 160));
    max_tokens.push_back(next(4, 48));
  }
  const auto results = run.generate(ids, lengths, max_tokens);
  ASSERT_EQ(results.size(), ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const Result& r = results.at(ids[i].first);
    EXPECT_EQ(r.error, "") << ids[i].first << " (" << ids[i].second << ")";
    EXPECT_EQ(r.finish_reason, "length") << ids[i].first;
    EXPECT_EQ(static_cast<int>(r.tokens.size()), max_tokens[i]) << ids[i].first;
  }
  const EngineStats st = run.engine->stats();
  EXPECT_GT(st.preemptions_total + st.kv_admission_waits_total, 0) << "the pool never ran short: no soak";
  EXPECT_LE(st.kv_blocks_high_water, st.kv_blocks_total);  // the most held at once, not each format's most
  std::cout << "preemptions " << st.preemptions_total << ", admission waits " << st.kv_admission_waits_total
            << ", high water " << st.kv_blocks_high_water << " of " << st.kv_blocks_total << " units\n";
  EXPECT_EQ(run.bytes_used_when_idle(), 0);
}
