// parallel/shard_plan: TP x PP weight / KV arithmetic against hand calculations (Llama-3-70B).
#include <gtest/gtest.h>

#include "common/check.h"
#include "parallel/shard_plan.h"
#include "policies/pyramid_budget.h"
#include "policies/policy_config.h"

namespace kvserve::parallel {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

ModelShape llama3_70b() {
  ModelShape m;
  m.num_layers = 80;
  m.hidden_size = 8192;
  m.intermediate_size = 28672;
  m.num_heads = 64;
  m.num_kv_heads = 8;
  m.head_dim = 128;
  m.vocab_size = 128256;
  return m;
}

PlanOptions opts(int64_t tp, int64_t pp, int64_t context) {
  PlanOptions o;
  o.tp = tp;
  o.pp = pp;
  o.gpu_memory_bytes = 80 * kGiB;
  o.reserve_fraction = 0.1;
  o.context = context;
  o.block_size = 16;
  o.weight_dtype_bytes = 2;  // bf16
  o.kv_dtype_bytes = 2;
  return o;
}

std::vector<PolicyConfig> full_and(const std::string& name, const std::string& budget) {
  return {make_policy_config("full"), make_policy_config(name, {{"budget", budget}})};
}

TEST(ShardPlan, APolicyInItsOwnKvDtypeHoldsItsTokensInThoseBytes) {
  // TP 4 x PP 2 at 32K, a bfloat16 cache: snapkv-2048 in the cache's dtype, and in int8 (a row of
  // 128 values is 128 bytes + 4 scales of 2 against 256), out of the same capacity.
  const auto m = llama3_70b();
  PolicyConfig snap = make_policy_config("snapkv", {{"budget", "2048"}});
  PolicyConfig snap8 = make_policy_config("snapkv", {{"budget", "2048"}, {"kv_dtype", "int8"}});
  snap8.name = "snapkv8";
  const auto plan = make_shard_plan(m, opts(4, 2, 32768), {make_policy_config("full"), snap, snap8});
  ASSERT_EQ(plan.policies.size(), 3u);
  const PolicyPlan &b = plan.policies[1], &q = plan.policies[2];
  EXPECT_EQ(b.kv_dtype, "");
  EXPECT_EQ(q.kv_dtype, "int8");
  EXPECT_EQ(q.kept_per_layer, b.kept_per_layer);
  for (size_t s = 0; s < 2; ++s) {
    EXPECT_EQ(q.kv_bytes_per_seq[s] * 256, b.kv_bytes_per_seq[s] * 136);
    EXPECT_GE(q.max_seqs_per_stage[s], b.max_seqs_per_stage[s] * 185 / 100);
  }
  EXPECT_EQ(to_json(plan)["policies"][2]["kv_dtype"], "int8");
  EXPECT_FALSE(to_json(plan)["policies"][1].contains("kv_dtype"));
  PolicyConfig bad = snap;
  bad.kv_dtype = "int3";
  try {
    make_shard_plan(m, opts(4, 2, 32768), {bad});
    FAIL() << "int3 planned";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("'int3'"), std::string::npos) << e.what();
  }
}

TEST(ShardPlan, PipelineRangesFirstStagesTakeTheExtraLayer) {
  auto r = pipeline_layer_ranges(80, 2);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].begin, 0);
  EXPECT_EQ(r[0].end, 40);
  EXPECT_EQ(r[1].begin, 40);
  EXPECT_EQ(r[1].end, 80);
  r = pipeline_layer_ranges(80, 3);  // 27, 27, 26
  EXPECT_EQ(r[0].size(), 27);
  EXPECT_EQ(r[1].size(), 27);
  EXPECT_EQ(r[2].size(), 26);
  EXPECT_EQ(r[2].begin, 54);
  EXPECT_EQ(r[2].end, 80);
  r = pipeline_layer_ranges(10, 4);  // 3, 3, 2, 2
  EXPECT_EQ(r[0].size(), 3);
  EXPECT_EQ(r[1].size(), 3);
  EXPECT_EQ(r[2].size(), 2);
  EXPECT_EQ(r[3].size(), 2);
  EXPECT_EQ(r[3].end, 10);
  EXPECT_THROW(pipeline_layer_ranges(3, 4), KvError);
}

TEST(ShardPlan, KvHeadsSplitOrReplicate) {
  EXPECT_EQ(kv_heads_per_rank(8, 1), 8);
  EXPECT_EQ(kv_heads_per_rank(8, 4), 2);
  EXPECT_EQ(kv_heads_per_rank(8, 8), 1);
  EXPECT_EQ(kv_heads_per_rank(8, 16), 1);  // each KV head replicated on 2 ranks
  EXPECT_THROW(kv_heads_per_rank(8, 3), KvError);
  EXPECT_THROW(kv_heads_per_rank(8, 12), KvError);
}

// Hand calculation, Llama-3-70B, TP=4, PP=2, bf16 weights and KV, 80 GiB per GPU, 10% reserve.
//
// Per layer per TP rank (16 of 64 query heads, 2 of 8 KV heads, 7168 of 28672 MLP columns):
//   q_proj 8192 x 2048 = 16,777,216      k_proj 8192 x 256 = 2,097,152   v_proj 2,097,152
//   o_proj 2048 x 8192 = 16,777,216      gate/up/down 3 x 8192 x 7168 = 176,160,768
//   2 RMSNorms 2 x 8192 = 16,384                                  sum 213,925,888 params
// Stage 0 = layers [0, 40) + embedding (128256 / 4 = 32064 rows x 8192 = 262,668,288):
//   40 x 213,925,888 + 262,668,288 = 8,819,703,808 params = 17,639,407,616 bytes
// Stage 1 = layers [40, 80) + final norm (8192) + LM head (262,668,288):
//   8,819,712,000 params = 17,639,424,000 bytes
// Usable per GPU: int(0.9 x 85,899,345,920) = 77,309,411,328 bytes.
// KV per token per layer per rank: 2 (K,V) x 2 heads x 128 x 2 bytes = 1,024; x 40 layers = 40,960.
// full at 32K: 32768 tokens (already 2048 blocks of 16) x 40,960 = 1,342,177,280 bytes per stage.
//   stage 1 capacity 77,309,411,328 - 17,639,424,000 = 59,669,987,328 -> 44 sequences (44.46).
// pyramidkv-128 at 32K (paper semantics, window 8, beta 20, global layer indices):
//   A = 120, min = 120 / 20 = 6, max = 2 x 120 - 6 = 234, steps = (234 - 6) / 79 = 2;
//   layer l keeps 234 - 2l + 8 = 242 - 2l tokens, rounded up to blocks of 16:
//   stage 0 (l = 0..39): 8,400 tokens of blocks -> 8,601,600 bytes;
//   stage 1 (l = 40..79): 5,200 tokens of blocks -> 5,324,800 bytes.
//   stage 0: 59,670,003,712 / 8,601,600 = 6937.1 -> 6937 (the tightest);
//   stage 1: 59,669,987,328 / 5,324,800 = 11206.0 -> 11206.
TEST(ShardPlan, Llama70bTp4Pp2MatchesHandCalculation) {
  const auto plan = make_shard_plan(llama3_70b(), opts(4, 2, 32768), full_and("pyramidkv", "128"));
  EXPECT_EQ(plan.gpus, 8);
  EXPECT_EQ(plan.usable_bytes, 77309411328);
  ASSERT_EQ(plan.stages.size(), 2u);
  const int64_t per_layer = 8192 * 2048 + 2 * 8192 * 256 + 2048 * 8192 + 3 * 8192 * 7168 + 2 * 8192;
  EXPECT_EQ(per_layer, 213925888);
  const int64_t vocab_shard = (128256 / 4) * 8192;
  EXPECT_EQ(plan.stages[0].weight_params, 40 * per_layer + vocab_shard);
  EXPECT_EQ(plan.stages[0].weight_bytes, 17639407616);
  EXPECT_EQ(plan.stages[1].weight_params, 40 * per_layer + 8192 + vocab_shard);
  EXPECT_EQ(plan.stages[1].weight_bytes, 17639424000);
  EXPECT_TRUE(plan.stages[0].has_embedding);
  EXPECT_FALSE(plan.stages[0].has_lm_head);
  EXPECT_FALSE(plan.stages[1].has_embedding);
  EXPECT_TRUE(plan.stages[1].has_lm_head);
  for (const auto& s : plan.stages) {
    EXPECT_EQ(s.kv_heads, 2);
    EXPECT_EQ(s.kv_bytes_per_token_layer, 1024);
    EXPECT_EQ(s.kv_bytes_per_token, 40960);
  }
  EXPECT_EQ(plan.stages[1].kv_capacity_bytes, 59669987328);

  ASSERT_EQ(plan.policies.size(), 2u);
  const auto& full = plan.policies[0];
  EXPECT_EQ(full.kv_bytes_per_seq[0], 1342177280);
  EXPECT_EQ(full.kv_bytes_per_seq[1], 1342177280);
  EXPECT_EQ(full.max_seqs, 44);
  EXPECT_EQ(full.tightest_stage, 1);  // same count, less room

  const auto& pyr = plan.policies[1];
  int64_t blocks0 = 0, blocks1 = 0;
  for (int64_t l = 0; l < 80; ++l) {
    EXPECT_EQ(pyr.kept_per_layer[l], 242 - 2 * l) << "layer " << l;
    (l < 40 ? blocks0 : blocks1) += (242 - 2 * l + 15) / 16;
  }
  EXPECT_EQ(blocks0 * 16, 8400);
  EXPECT_EQ(blocks1 * 16, 5200);
  EXPECT_EQ(pyr.kv_bytes_per_seq[0], 8601600);
  EXPECT_EQ(pyr.kv_bytes_per_seq[1], 5324800);
  EXPECT_EQ(pyr.max_seqs_per_stage[0], 6937);
  EXPECT_EQ(pyr.max_seqs_per_stage[1], 11206);
  EXPECT_EQ(pyr.max_seqs, 6937);
  EXPECT_EQ(pyr.tightest_stage, 0);
  EXPECT_EQ(pyr.max_seqs_peak, pyr.max_seqs);  // static policy: steady == peak
}

// TP=8: one KV head per rank. Per layer per rank: q 8192 x 1024, k/v 8192 x 128 each,
// o 1024 x 8192, MLP 3 x 8192 x 3584, norms 2 x 8192 = 106,971,136; x 80 layers
// + embedding and LM head (16032 x 8192 each) + final norm = 8,820,367,360 params.
// KV per token: 80 layers x 2 x 1 x 128 x 2 = 40,960 bytes; full at 32K: 1,342,177,280 bytes;
// capacity 77,309,411,328 - 17,640,734,720 = 59,668,676,608 -> 44 sequences.
TEST(ShardPlan, Llama70bTp8OneKvHeadPerRank) {
  const auto plan = make_shard_plan(llama3_70b(), opts(8, 1, 32768), full_and("pyramidkv", "128"));
  ASSERT_EQ(plan.stages.size(), 1u);
  const auto& s = plan.stages[0];
  EXPECT_EQ(s.kv_heads, 1);
  EXPECT_EQ(s.weight_params, 80 * int64_t{106971136} + 2 * int64_t{16032} * 8192 + 8192);
  EXPECT_EQ(s.weight_params, 8820367360);
  EXPECT_EQ(s.kv_bytes_per_token, 40960);
  EXPECT_EQ(plan.policies[0].kv_bytes_per_seq[0], 1342177280);
  EXPECT_EQ(plan.policies[0].max_seqs, 44);
  // pyramidkv-128 over all 80 layers: (8400 + 5200) tokens of blocks x 512 bytes = 6,963,200.
  EXPECT_EQ(plan.policies[1].kv_bytes_per_seq[0], (8400 + 5200) * 512);
  EXPECT_EQ(plan.policies[1].max_seqs, 59668676608 / 6963200);
}

// TP=16 > 8 KV heads: each rank holds one KV head (replicated twice), so KV per GPU does not
// shrink below TP=8's, while the query heads (4 per rank) and MLP still split 16 ways.
// Quantized weights (a GGUF's or --quantization's block format): bytes = params x bits / 8, rounded
// up, and what they free goes to the KV cache. TP 8 of Llama-3-70B at 4.5 bits a weight (ggml's Q4_K):
// 8,820,367,360 params -> 4,961,456,640 bytes, against 17,640,734,720 in bf16.
TEST(ShardPlan, QuantizedWeightsCountTheirBitsAndLeaveTheRestToKv) {
  PlanOptions o = opts(8, 1, 32768);
  const auto bf16 = make_shard_plan(llama3_70b(), o, full_and("pyramidkv", "128"));
  o.weight_bits = 4.5;
  const auto q4 = make_shard_plan(llama3_70b(), o, full_and("pyramidkv", "128"));
  const auto& a = bf16.stages.at(0);
  const auto& b = q4.stages.at(0);
  EXPECT_EQ(b.weight_params, a.weight_params);
  EXPECT_EQ(b.weight_params, 8820367360);
  EXPECT_EQ(b.weight_bytes, 4961456640);
  EXPECT_EQ(a.weight_bytes, 17640734720);
  EXPECT_EQ(b.kv_capacity_bytes - a.kv_capacity_bytes, a.weight_bytes - b.weight_bytes);
  EXPECT_EQ(q4.policies[0].max_seqs, (77309411328 - 4961456640) / 1342177280);  // 53 full 32K sequences, not 44
  EXPECT_EQ(bf16.policies[0].max_seqs, 44);
  o.weight_bits = 8.5;  // 34 bytes per 32 weights (ggml's Q8_0)
  EXPECT_EQ(make_shard_plan(llama3_70b(), o, full_and("pyramidkv", "128")).stages.at(0).weight_bytes, 9371640320);
}

TEST(ShardPlan, Llama70bTp16ReplicatesKvHeads) {
  const auto plan = make_shard_plan(llama3_70b(), opts(16, 1, 32768), {make_policy_config("full")});
  const auto& s = plan.stages[0];
  EXPECT_EQ(s.kv_heads, 1);
  const int64_t per_layer = 8192 * 512 + 2 * 8192 * 128 + 512 * 8192 + 3 * 8192 * 1792 + 2 * 8192;
  EXPECT_EQ(per_layer, 54542336);
  EXPECT_EQ(s.weight_params, 80 * per_layer + 2 * int64_t{8016} * 8192 + 8192);
  EXPECT_EQ(s.kv_bytes_per_token_layer, 512);
  EXPECT_EQ(s.kv_bytes_per_token, 40960);
  EXPECT_EQ(plan.policies[0].kv_bytes_per_seq[0], int64_t{32768} * 40960);
  // 64 heads do not split over 24 ranks.
  EXPECT_THROW(make_shard_plan(llama3_70b(), opts(24, 1, 32768), {make_policy_config("full")}), KvError);
}

// PP=3 over 80 layers: 27, 27, 26. Stage 0 has the embedding, stage 2 norm + LM head, stage 1
// neither; with TP=1 every rank holds all 8 KV heads (2 x 8 x 128 x 2 = 4096 bytes per token-layer).
TEST(ShardPlan, UnevenPipelineSplit) {
  const auto plan = make_shard_plan(llama3_70b(), opts(1, 3, 8192), full_and("pyramidkv", "128"));
  ASSERT_EQ(plan.stages.size(), 3u);
  const int64_t layer = 8192 * 8192 + 2 * 8192 * 1024 + 8192 * 8192 + 3 * int64_t{8192} * 28672 + 2 * 8192;
  const int64_t vocab = int64_t{128256} * 8192;
  EXPECT_EQ(plan.stages[0].weight_params, 27 * layer + vocab);
  EXPECT_EQ(plan.stages[1].weight_params, 27 * layer);
  EXPECT_EQ(plan.stages[2].weight_params, 26 * layer + 8192 + vocab);
  EXPECT_EQ(plan.stages[0].kv_bytes_per_token, 27 * 4096);
  EXPECT_EQ(plan.stages[2].kv_bytes_per_token, 26 * 4096);
  // 70B in bf16 on 3 x 80 GiB: each stage holds ~47 GB of weights, still fits.
  EXPECT_TRUE(plan.weights_fit);
  // full at 8K: stage 0 and 1 hold 27 layers x 8192 x 4096 bytes; stage 0 has less room.
  EXPECT_EQ(plan.policies[0].kv_bytes_per_seq[0], int64_t{27} * 8192 * 4096);
  EXPECT_EQ(plan.policies[0].kv_bytes_per_seq[2], int64_t{26} * 8192 * 4096);
  EXPECT_EQ(plan.policies[0].tightest_stage, 0);
  // Pyramid budgets use global layer indices: stage 2 starts at layer 54.
  EXPECT_EQ(plan.policies[1].kept_per_layer[54], 242 - 2 * 54);
}

TEST(ShardPlan, TiedEmbeddingsShareOneMatrixOnlyOnASingleStage) {
  ModelShape m = llama3_70b();
  m.tie_word_embeddings = true;
  const auto one = make_shard_plan(m, opts(8, 1, 4096), {make_policy_config("full")});
  const auto two = make_shard_plan(m, opts(8, 2, 4096), {make_policy_config("full")});
  const int64_t vocab = int64_t{16032} * 8192;
  EXPECT_EQ(one.stages[0].weight_params, 80 * int64_t{106971136} + vocab + 8192);
  EXPECT_EQ(two.stages[0].weight_params, 40 * int64_t{106971136} + vocab);
  EXPECT_EQ(two.stages[1].weight_params, 40 * int64_t{106971136} + vocab + 8192);
}

TEST(ShardPlan, DynamicKvSteadyIsTheMeanBudgetPeakIsTheCandidates) {
  const auto plan = make_shard_plan(llama3_70b(), opts(4, 2, 32768), full_and("dynamickv", "128"));
  const auto& dyn = plan.policies[1];
  for (int64_t l = 0; l < 80; ++l) {
    EXPECT_EQ(dyn.kept_per_layer[l], 128);
    // candidates: min(r_max x (B - w), prompt - w) + w = 10 x 120 + 8
    EXPECT_EQ(dyn.peak_per_layer[l], 1208);
  }
  EXPECT_EQ(dyn.kv_bytes_per_seq[0], 40 * 128 * 1024);
  EXPECT_EQ(dyn.kv_bytes_per_seq_peak[0], 40 * ((1208 + 15) / 16 * 16) * 1024);
  EXPECT_LT(dyn.max_seqs_peak, dyn.max_seqs);
}

TEST(ShardPlan, ShortContextKeepsEverything) {
  // A prompt no longer than the budget is not compressed.
  const auto plan = make_shard_plan(llama3_70b(), opts(4, 2, 100), full_and("pyramidkv", "128"));
  EXPECT_EQ(plan.policies[1].kv_bytes_per_seq, plan.policies[0].kv_bytes_per_seq);
  EXPECT_EQ(plan.policies[0].kv_bytes_per_seq[0], 40 * 112 * 1024);  // 100 -> 7 blocks of 16
}

// A shared 8K prefix (prefix caching), same shapes: its 512 blocks per layer are held once per
// stage: 512 x 40 layers x 16 tokens x 1024 B = 335,544,320 B. A full sequence owns only the
// other 24K tokens (1536 blocks x 40 x 16,384 B = 1,006,632,960 B): stage 1 holds
// (59,669,987,328 - 335,544,320) / 1,006,632,960 = 58.9 -> 58 (44 without). PyramidKV keeps
// its own compressed copy: 8,601,600 B per sequence as before, in 335 MB less room.
TEST(ShardPlan, ASharedPrefixIsHeldOnceAndFullSequencesOwnOnlyTheRest) {
  auto o = opts(4, 2, 32768);
  o.shared_prefix = 8192 + 5;  // the partial block is not cached
  const auto plan = make_shard_plan(llama3_70b(), o, full_and("pyramidkv", "128"));
  for (const auto& s : plan.stages) EXPECT_EQ(s.prefix_cache_bytes, 335544320);
  EXPECT_EQ(plan.policies[0].kv_bytes_per_seq[1], 1006632960);
  EXPECT_EQ(plan.policies[0].max_seqs, 58);
  EXPECT_EQ(plan.policies[1].kv_bytes_per_seq[0], 8601600);
  EXPECT_EQ(plan.policies[1].max_seqs_per_stage[0], (59670003712 - 335544320) / 8601600);
  o.shared_prefix = o.context + 1;
  EXPECT_THROW(make_shard_plan(llama3_70b(), o, full_and("pyramidkv", "128")), KvError);
}


// Gemma 3 27B's shape: 62 layers, every sixth global (10), the others local with a 1024-token
// window. Only the global layers' KV grows with the context; each local layer holds a ring of
// 1024 / 16 + 1 = 65 blocks per sequence.
TEST(ShardPlan, Gemma3SlidingWindowLayersCountOnlyTheirRing) {
  ModelShape m;
  m.num_layers = 62;
  m.hidden_size = 5376;
  m.intermediate_size = 21504;
  m.num_heads = 32;
  m.num_kv_heads = 16;
  m.head_dim = 128;
  m.vocab_size = 262208;
  m.tie_word_embeddings = true;
  m.qk_norm = true;
  for (int64_t tp : {1, 2}) {
    PlanOptions o = opts(tp, 2, 32768);
    for (int64_t l = 0; l < 62; ++l) o.layer_windows.push_back((l + 1) % 6 == 0 ? 0 : 1024);
    const auto plan = make_shard_plan(m, o, {make_policy_config("full")});
    ASSERT_EQ(plan.stages.size(), 2u);
    const int64_t per_layer_token = 2 * (16 / tp) * 128 * 2;  // K and V, bf16
    for (const auto& st : plan.stages) {
      EXPECT_EQ(st.local_layers, 26);  // layers [0, 31): globals 5, 11, 17, 23, 29; [31, 62): 35 ... 59
      EXPECT_EQ(st.kv_bytes_per_token, 5 * per_layer_token);
      EXPECT_EQ(st.local_blocks_per_seq, 26 * 65);
    }
    const auto& full = plan.policies[0];
    for (size_t s = 0; s < 2; ++s) {
      EXPECT_EQ(full.kv_bytes_per_seq[s], (5 * 2048 + 26 * 65) * 16 * per_layer_token);
      EXPECT_EQ(full.kv_bytes_per_seq_peak[s], 31 * 2048 * 16 * per_layer_token) << "the prompt passes whole";
    }
    EXPECT_EQ(full.kept_per_layer[0], 1024);
    EXPECT_EQ(full.kept_per_layer[5], 32768);
    // A context inside the window: the ring is the context.
    PlanOptions short_ctx = o;
    short_ctx.context = 100;
    const auto small = make_shard_plan(m, short_ctx, {make_policy_config("full")});
    EXPECT_EQ(small.policies[0].kv_bytes_per_seq[0], 31 * 7 * 16 * per_layer_token);
    // PyramidKV spends its budget on the 10 global layers, in their order, as one pyramid.
    const auto pyr = make_shard_plan(m, o, {make_policy_config("pyramidkv", {{"budget", "2048"}})}).policies[0];
    const auto slope = pyramid_budgets_paper(32768, 2048, 8, 20, 10);
    for (int64_t g = 0; g < 10; ++g) EXPECT_EQ(pyr.kept_per_layer[static_cast<size_t>(6 * g + 5)], slope[static_cast<size_t>(g)]);
    EXPECT_EQ(pyr.kept_per_layer[0], 1024);
    int64_t blocks = 26 * 65;  // stage 0: its ring blocks, then its five global layers' kept blocks
    for (int64_t g = 0; g < 5; ++g) blocks += (slope[static_cast<size_t>(g)] + 15) / 16;
    EXPECT_EQ(pyr.kv_bytes_per_seq[0], blocks * 16 * per_layer_token);
  }
}

}  // namespace
}  // namespace kvserve::parallel
