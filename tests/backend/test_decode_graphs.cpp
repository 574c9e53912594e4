// Decode steps padded to a batch bucket and CUDA graphs of them (backend/engine/decode_graphs.h).
// On CPU: the bucket and split-hint arithmetic, the padded step run eagerly (the padding's null row
// reads nothing, writes nowhere, and changes neither the real rows' logits nor any cache state), and
// DecodeGraphs in its capture-free mode over a schedule where sequences join and finish.
// DecodeGraphsCuda: the same on a GPU with captured graphs (skipped without one).
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "backend/engine/decode_graphs.h"
#include "backend/model/decoder_model.h"
#include "cache_manager/paged_attention_cuda.h"
#include "cache_manager/paged_kv_cache.h"
#include "cache_manager/paged_kv_memory.h"

namespace kvserve {
namespace {

using Specs = std::map<std::string, std::map<std::string, std::string>>;

const std::string kTinyModel = std::string(KVSERVE_SOURCE_DIR) + "/models/tiny-llama";

bool have_gpu() { return cuda::compiled() && torch::cuda::is_available(); }

float max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kCPU, torch::kFloat32) - b.to(torch::kCPU, torch::kFloat32)).abs().max().item<float>();
}

// ---------------------------------------------------------------------------------------------------
// buckets and hints

TEST(DecodeGraphBuckets, SpacingAndTheLargestBatch) {
  EXPECT_EQ(decode_graph_buckets(1), (std::vector<int64_t>{1}));
  EXPECT_EQ(decode_graph_buckets(5), (std::vector<int64_t>{1, 2, 4, 5}));
  EXPECT_EQ(decode_graph_buckets(32), (std::vector<int64_t>{1, 2, 4, 8, 16, 24, 32}));
  EXPECT_EQ(decode_graph_buckets(100), (std::vector<int64_t>{1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100}));
  const auto big = decode_graph_buckets(512);
  EXPECT_EQ(big.back(), 512);
  EXPECT_EQ(std::vector<int64_t>(big.end() - 5, big.end()), (std::vector<int64_t>{256, 320, 384, 448, 512}));
  EXPECT_TRUE(std::is_sorted(big.begin(), big.end()));
  EXPECT_EQ(std::adjacent_find(big.begin(), big.end()), big.end());
  EXPECT_THROW(decode_graph_buckets(0), KvError);
}

TEST(DecodeGraphBuckets, TheLargestBucketIsCapped) {
  auto model = DecoderModel::load(std::string(KVSERVE_SOURCE_DIR) + "/models/tiny-llama", LoadOptions{"cpu", "", false});
  const auto& c = model->config();
  KvPoolOptions pool;
  pool.num_kv_heads = c.num_key_value_heads;
  pool.head_dim = c.head_dim;
  pool.num_blocks = 16;
  PagedKvMemory kv(c.num_hidden_layers, pool, resolve_policies({}));
  DecodeGraphs g(*model, kv, DecodeGraphOptions{int64_t{1} << 20, false});
  EXPECT_EQ(g.buckets().back(), kMaxDecodeGraphBatch);
  EXPECT_GE(kv.cache().device_tables().row_capacity(), kMaxDecodeGraphBatch + 1);  // reserved up front
}

TEST(DecodeGraphBuckets, ABatchGoesToTheSmallestBucketThatHoldsIt) {
  const auto b = decode_graph_buckets(32);
  EXPECT_EQ(decode_graph_bucket(b, 1), 1);
  EXPECT_EQ(decode_graph_bucket(b, 3), 4);
  EXPECT_EQ(decode_graph_bucket(b, 8), 8);
  EXPECT_EQ(decode_graph_bucket(b, 9), 16);
  EXPECT_EQ(decode_graph_bucket(b, 17), 24);
  EXPECT_EQ(decode_graph_bucket(b, 32), 32);
  EXPECT_EQ(decode_graph_bucket(b, 33), 0);  // above the largest: eager
  EXPECT_THROW(decode_graph_bucket(b, 0), KvError);
}

TEST(DecodeGraphBuckets, SplitHintIsAQuarterOctaveAbove) {
  EXPECT_EQ(decode_graph_split_hint(0), 16);
  EXPECT_EQ(decode_graph_split_hint(16), 16);
  EXPECT_EQ(decode_graph_split_hint(17), 20);
  EXPECT_EQ(decode_graph_split_hint(20), 20);
  EXPECT_EQ(decode_graph_split_hint(21), 24);
  EXPECT_EQ(decode_graph_split_hint(29), 32);
  EXPECT_EQ(decode_graph_split_hint(33), 40);
  EXPECT_EQ(decode_graph_split_hint(2049), 2560);
  for (int64_t n = 1; n < 5000; ++n) {
    const int64_t h = decode_graph_split_hint(n);
    ASSERT_GE(h, n);
    ASSERT_LE(h, std::max<int64_t>(16, n + n / 4 + 1)) << n;  // at most a quarter (plus rounding) above
  }
}

// ---------------------------------------------------------------------------------------------------
// the padded step on the cache alone: what the kernels do with a length-0 (null) row

// Two caches with the same content; one decodes 3 sequences plainly, the other padded to 8 entries
// whose q/k/v rows are huge garbage. The real rows' outputs must agree, the padding's must be zero,
// and the pools must stay byte-identical (the padding wrote nowhere).
void padded_cache_step(torch::Device dev, float tol) {
  KvPoolOptions o;
  o.num_kv_heads = 2;
  o.head_dim = 32;
  o.block_size = 4;
  o.num_blocks = 96;
  o.device = dev;
  const int64_t L = 3, KV = 2, H = 4, D = 32, B = 3, P = 8;
  PagedKvCache a(L, o), b(L, o);
  for (PagedKvCache* c : {&a, &b}) {
    torch::Tensor s = c->pool().storage();
    s.zero_();
  }
  torch::manual_seed(3);
  const std::vector<int64_t> ids = {11, 12, 13}, lens = {5, 9, 0};  // one sequence holds nothing yet
  for (size_t i = 0; i < ids.size(); ++i) {
    for (PagedKvCache* c : {&a, &b}) c->add_sequence(ids[i]);
    for (int64_t l = 0; l < L; ++l) {
      const int64_t n = lens[i] + l;  // layers differ in length
      auto k = torch::randn({KV, n, D}), v = torch::randn({KV, n, D});
      auto pos = torch::arange(n, torch::kLong).unsqueeze(0).expand({KV, n}).contiguous();
      for (PagedKvCache* c : {&a, &b}) c->write(ids[i], l, k, v, pos);
    }
  }
  const auto fo = torch::TensorOptions().device(dev);
  for (int step = 0; step < 3; ++step) {
    std::vector<int64_t> pos;
    for (size_t i = 0; i < ids.size(); ++i) pos.push_back(100 + step + static_cast<int64_t>(i));
    a.begin_decode(ids, pos);
    b.begin_decode(ids, pos, P);
    ASSERT_EQ(b.planned_rows(), P);
    ASSERT_EQ(a.planned_rows(), B);
    for (int64_t l = 0; l < L; ++l) {
      auto q = torch::randn({B, H, D}, fo), k = torch::randn({B, KV, D}, fo), v = torch::randn({B, KV, D}, fo);
      auto junk = torch::full({P - B, KV, D}, 1e4, fo);
      auto oa = a.decode_layer(l, q, k, v);
      auto ob = b.decode_layer(l, torch::cat({q, torch::full({P - B, H, D}, 1e4, fo)}), torch::cat({k, junk}),
                               torch::cat({v, junk}));
      ASSERT_EQ(ob.size(0), P);
      EXPECT_LE(max_diff(ob.narrow(0, 0, B), oa), tol) << "step " << step << " layer " << l;
      EXPECT_EQ(ob.narrow(0, B, P - B).abs().max().item<float>(), 0.0f) << "padding rows must be zero";
    }
    ASSERT_FALSE(b.decode_planned(ids, 0));
  }
  a.check_invariants();
  b.check_invariants();
  EXPECT_EQ(a.used_blocks(), b.used_blocks());
  EXPECT_TRUE(torch::equal(a.pool().storage().to(torch::kCPU), b.pool().storage().to(torch::kCPU)))
      << "the padding wrote into the pool";
  for (int64_t id : ids) {
    for (int64_t l = 0; l < L; ++l) {
      ASSERT_EQ(a.length(id, l), b.length(id, l));
      EXPECT_TRUE(torch::equal(a.positions(id, l), b.positions(id, l)));
      EXPECT_EQ(a.layer_blocks(id, l).blocks, b.layer_blocks(id, l).blocks);
    }
  }
  // The padding pointed at one row that no sequence owns and that holds nothing in any layer.
  b.begin_decode(ids, {200, 201, 202}, P);
  const auto& t = b.device_tables();
  auto rows = t.batch_rows(P).to(torch::kCPU);
  const int32_t null_row = rows[B].item<int32_t>();
  for (int64_t e = B; e < P; ++e) EXPECT_EQ(rows[e].item<int32_t>(), null_row);
  for (int64_t id : ids) EXPECT_NE(t.row(id), null_row);
  for (int64_t l = 0; l < L; ++l) EXPECT_EQ(t.lengths(l)[null_row].item<int32_t>(), 0) << "layer " << l;
}

TEST(PaddedDecode, NullRowsReadNothingAndWriteNowhere) { padded_cache_step(torch::kCPU, 0.0f); }

TEST(PaddedDecode, PaddingMustNotShrinkTheBatch) {
  KvPoolOptions o;
  o.num_kv_heads = 1;
  o.head_dim = 8;
  o.num_blocks = 8;
  PagedKvCache c(1, o);
  c.add_sequence(1);
  c.add_sequence(2);
  EXPECT_THROW(c.begin_decode({1, 2}, {0, 0}, 1), KvError);
}

// ---------------------------------------------------------------------------------------------------
// the padded step through the model, and DecodeGraphs over a changing batch

const Specs& specs() {
  // stream_dec evicts during decode (in begin_decode, before any graph): compaction changes tables.
  static const Specs s = {{"stream_dec",
                           {{"name", "streamingllm"}, {"budget", "20"}, {"sink", "2"}, {"decode_budget", "24"},
                            {"decode_evict_chunk", "4"}}}};
  return s;
}

std::unique_ptr<PagedKvMemory> make_memory(const DecoderModel& m, int64_t block_size = 4) {
  const auto& c = m.config();
  KvPoolOptions pool;
  pool.num_kv_heads = c.num_key_value_heads;
  pool.head_dim = c.head_dim;
  pool.block_size = block_size;
  pool.num_blocks = 2048;
  pool.dtype = m.dtype();
  pool.device = m.device();
  return std::make_unique<PagedKvMemory>(c.num_hidden_layers, pool, resolve_policies(specs()));
}

std::vector<int64_t> prompt(int64_t n, int64_t salt, int64_t vocab) {
  std::vector<int64_t> p;
  for (int64_t t = 0; t < n; ++t) p.push_back((t * 131 + salt * 7919 + (t * t) % 31) % vocab);
  return p;
}

int64_t top_token(const torch::Tensor& row) { return row.argmax().item<int64_t>(); }

// Sequences join and finish so that the batch moves across buckets {1, 2, 4, 6} and once above
// the largest (7 > 6); a 70-token prompt joining at step 15 outgrows the device tables' 16 blocks
// (block_size 4), so every graph captured before must be dropped and recaptured.
struct Event {
  int step;
  std::vector<int64_t> join, finish;
};
const std::vector<Event> kSchedule = {
    {0, {1}, {}},       {2, {2, 3}, {}},      {4, {}, {2}},       {6, {4, 5, 6}, {}}, {8, {7, 8}, {}},
    {10, {}, {1, 5, 7}}, {13, {}, {3, 4, 6}}, {15, {9, 10}, {}}, {19, {11}, {}},     {22, {}, {8}},
};
constexpr int kSteps = 26;
constexpr int64_t kMaxBatch = 6;

int64_t prompt_len(int64_t id) { return id == 9 ? 70 : 20 + 7 * id; }

using DecodeFn = std::function<torch::Tensor(const DecodeBatch&, const std::vector<int64_t>&)>;

// Greedy tokens per step (one per running sequence, in batch order) and each step's logits.
struct Trace {
  std::vector<std::vector<int64_t>> tokens;
  std::vector<torch::Tensor> logits;
};

Trace run_schedule(DecoderModel& m, PagedKvMemory& kv, const DecodeFn& decode) {
  Trace tr;
  std::vector<int64_t> running;
  std::map<int64_t, int64_t> next, pos;
  const int64_t V = m.config().vocab_size;
  for (int step = 0; step < kSteps; ++step) {
    for (const Event& e : kSchedule) {
      if (e.step != step) continue;
      for (int64_t id : e.finish) {
        kv.release(id);
        running.erase(std::find(running.begin(), running.end(), id));
      }
      for (int64_t id : e.join) {
        const auto p = prompt(prompt_len(id), id, V);
        auto logits = m.prefill(id, p, kv, false, id % 2 ? "full" : "stream_dec");
        next[id] = top_token(logits[0]);
        pos[id] = static_cast<int64_t>(p.size());
        running.push_back(id);
      }
    }
    DecodeBatch batch;
    std::vector<int64_t> tokens;
    for (int64_t id : running) {
      batch.seq_ids.push_back(id);
      batch.positions.push_back(pos[id]);
      tokens.push_back(next[id]);
    }
    torch::Tensor logits = decode(batch, tokens).clone();
    std::vector<int64_t> out;
    for (size_t b = 0; b < running.size(); ++b) {
      const int64_t t = top_token(logits[static_cast<int64_t>(b)]);
      out.push_back(t);
      next[running[b]] = t;
      ++pos[running[b]];
    }
    tr.tokens.push_back(out);
    tr.logits.push_back(logits.to(torch::kCPU));
    kv.cache().check_invariants();
  }
  return tr;
}

void expect_same_cache(DecoderModel& m, PagedKvMemory& a, PagedKvMemory& b, float tol) {
  EXPECT_EQ(a.blocks_used(), b.blocks_used());
  for (int64_t id : a.cache().sequence_ids()) {
    for (int64_t l = 0; l < m.config().num_hidden_layers; ++l) {
      ASSERT_EQ(a.cached_tokens(id, l), b.cached_tokens(id, l)) << "sequence " << id << " layer " << l;
      EXPECT_TRUE(torch::equal(a.kept_positions(id, l), b.kept_positions(id, l)));
      auto [ka, va] = a.cache().gather(id, l);
      auto [kb, vb] = b.cache().gather(id, l);
      EXPECT_LE(max_diff(ka, kb), tol);
      EXPECT_LE(max_diff(va, vb), tol);
    }
  }
}

// The model's padded step against its plain step, on CPU: same logits for the real rows, the same
// cache afterwards (lengths, kept positions, K/V, blocks), invariants hold.
TEST(PaddedDecode, ModelStepPaddedToABucketChangesNothing) {
  auto model = DecoderModel::load(kTinyModel, LoadOptions{"cpu", "", false});
  auto plain = make_memory(*model), padded = make_memory(*model);
  const Trace want = run_schedule(*model, *plain, [&](const DecodeBatch& b, const std::vector<int64_t>& t) {
    return model->decode(b, t, *plain);
  });
  const Trace got = run_schedule(*model, *padded, [&](const DecodeBatch& b, const std::vector<int64_t>& t) {
    auto out = model->decode(b, t, *padded, 8);
    EXPECT_EQ(out.size(0), static_cast<int64_t>(t.size()));
    return out;
  });
  float worst = 0;
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_EQ(got.tokens[s], want.tokens[s]) << "step " << s;
    worst = std::max(worst, max_diff(got.logits[s], want.logits[s]));
  }
  std::cout << "[ padded vs plain, CPU fp32 ] max |logit diff| " << worst << "\n";
  EXPECT_LE(worst, 1e-4);
  expect_same_cache(*model, *plain, *padded, 1e-5f);
}

// DecodeGraphs with capture off runs exactly the padded bodies a graph would (static inputs, null
// rows, fixed split hint); over the schedule its greedy tokens equal the plain eager decode's.
TEST(DecodeGraphs, PaddedEagerModeMatchesPlainDecodeAsSequencesJoinAndFinish) {
  auto model = DecoderModel::load(kTinyModel, LoadOptions{"cpu", "", false});
  auto plain = make_memory(*model), mem = make_memory(*model);
  DecodeGraphOptions go;
  go.max_batch = kMaxBatch;
  go.capture = false;
  DecodeGraphs graphs(*model, *mem, go);
  EXPECT_EQ(graphs.buckets(), (std::vector<int64_t>{1, 2, 4, 6}));
  EXPECT_NE(DecodeGraphs::unsupported(*model, *mem), "");  // a CPU model never captures
  EXPECT_THROW(DecodeGraphs(*model, *mem, DecodeGraphOptions{4, true}), KvError);
  const Trace want = run_schedule(*model, *plain, [&](const DecodeBatch& b, const std::vector<int64_t>& t) {
    return model->decode(b, t, *plain);
  });
  const int64_t gen0 = mem->cache().device_tables().generation();
  std::vector<double> plan_s;  // stats().last_plan_s after each step
  const Trace got = run_schedule(*model, *mem, [&](const DecodeBatch& b, const std::vector<int64_t>& t) {
    auto logits = graphs.decode(b, t);
    plan_s.push_back(graphs.stats().last_plan_s);
    return logits;
  });
  // The host planning is timed on every step DecodeGraphs plans itself; the two it hands whole to
  // DecoderModel::decode (above the largest bucket) say -1.
  ASSERT_EQ(static_cast<int>(plan_s.size()), kSteps);
  EXPECT_EQ(std::count(plan_s.begin(), plan_s.end(), -1.0), 2);
  EXPECT_TRUE(std::all_of(plan_s.begin(), plan_s.end(), [](double v) { return v == -1.0 || v >= 0; }));
  // The schedule outgrows the tables (what makes the CUDA test recapture).
  EXPECT_GT(mem->cache().device_tables().generation(), gen0);
  float worst = 0;
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_EQ(got.tokens[s], want.tokens[s]) << "step " << s;
    worst = std::max(worst, max_diff(got.logits[s], want.logits[s]));
  }
  EXPECT_LE(worst, 1e-4);
  expect_same_cache(*model, *plain, *mem, 1e-5f);
  const DecodeGraphStats& st = graphs.stats();
  EXPECT_EQ(st.eager, 2);  // steps 8 and 9 decode 7 sequences
  EXPECT_EQ(st.padded_eager, kSteps - 2);
  EXPECT_EQ(st.replays, 0);
  EXPECT_EQ(st.captures, 0);
}

// ---------------------------------------------------------------------------------------------------
// on a GPU

TEST(DecodeGraphsCuda, NullRowsReadNothingAndWriteNowhere) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (or built without the CUDA kernels)";
  padded_cache_step(torch::kCUDA, 1e-5f);  // the split plan depends on the batch size
}

// Three runs of the schedule on one fp32 CUDA model: plain eager decode, DecodeGraphs replaying
// captured graphs, and DecodeGraphs running the same padded bodies eagerly.
TEST(DecodeGraphsCuda, ReplayMatchesEagerAsSequencesJoinAndFinish) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (or built without the CUDA kernels)";
  auto model = DecoderModel::load(kTinyModel, LoadOptions{"cuda", "float32", false});
  auto plain = make_memory(*model), replayed = make_memory(*model), padded = make_memory(*model);
  ASSERT_EQ(DecodeGraphs::unsupported(*model, *replayed), "");
  DecodeGraphs graphs(*model, *replayed, DecodeGraphOptions{kMaxBatch, true});
  DecodeGraphs eager_padded(*model, *padded, DecodeGraphOptions{kMaxBatch, false});
  const Trace want = run_schedule(*model, *plain, [&](const DecodeBatch& b, const std::vector<int64_t>& t) {
    return model->decode(b, t, *plain);
  });
  const int64_t gen0 = replayed->cache().device_tables().generation();
  const Trace got = run_schedule(*model, *replayed, [&](const DecodeBatch& b, const std::vector<int64_t>& t) {
    return graphs.decode(b, t);
  });
  const Trace same_body = run_schedule(*model, *padded, [&](const DecodeBatch& b, const std::vector<int64_t>& t) {
    return eager_padded.decode(b, t);
  });
  float vs_eager = 0, vs_body = 0;
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_EQ(got.tokens[s], want.tokens[s]) << "step " << s;
    EXPECT_EQ(same_body.tokens[s], want.tokens[s]) << "step " << s;
    vs_eager = std::max(vs_eager, max_diff(got.logits[s], want.logits[s]));
    vs_body = std::max(vs_body, max_diff(got.logits[s], same_body.logits[s]));
  }
  const DecodeGraphStats& st = graphs.stats();
  std::cout << "[ CUDA fp32 ] max |replay - eager| " << vs_eager << ", |replay - padded eager body| " << vs_body
            << (vs_body == 0 ? " (bitwise)" : "") << "; captures " << st.captures << ", replays " << st.replays
            << ", eager " << st.eager << ", invalidations " << st.invalidations << "\n";
  EXPECT_LE(vs_eager, 1e-3);  // different split plans and GEMM row counts
  EXPECT_LE(vs_body, 1e-5);   // the same kernels on the same shapes: expected bitwise
  expect_same_cache(*model, *plain, *replayed, 1e-4f);
  EXPECT_EQ(st.eager, 2);
  EXPECT_EQ(st.replays, kSteps - 2);
  // Buckets 1, 2, 4 and 6 were all used; the tables grew after graphs existed, so they were recaptured.
  EXPECT_GT(replayed->cache().device_tables().generation(), gen0);
  EXPECT_GE(st.invalidations, 1);
  EXPECT_GE(st.captures, 5);
  EXPECT_LT(st.captures, st.replays);  // most steps replay an existing graph
}

// bf16 (the CUDA default): the replay equals the same padded body run eagerly.
TEST(DecodeGraphsCuda, Bf16ReplayEqualsThePaddedBody) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (or built without the CUDA kernels)";
  auto model = DecoderModel::load(kTinyModel, LoadOptions{"cuda", "bfloat16", false});
  auto replayed = make_memory(*model), padded = make_memory(*model);
  DecodeGraphs graphs(*model, *replayed, DecodeGraphOptions{kMaxBatch, true});
  DecodeGraphs eager_padded(*model, *padded, DecodeGraphOptions{kMaxBatch, false});
  const Trace got = run_schedule(*model, *replayed, [&](const DecodeBatch& b, const std::vector<int64_t>& t) {
    return graphs.decode(b, t);
  });
  const Trace same_body = run_schedule(*model, *padded, [&](const DecodeBatch& b, const std::vector<int64_t>& t) {
    return eager_padded.decode(b, t);
  });
  float worst = 0;
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_EQ(got.tokens[s], same_body.tokens[s]) << "step " << s;
    worst = std::max(worst, max_diff(got.logits[s], same_body.logits[s]));
  }
  std::cout << "[ CUDA bf16 ] max |replay - padded eager body| " << worst << "\n";
  EXPECT_LE(worst, 1e-2);
  EXPECT_GT(graphs.stats().replays, 0);
}

}  // namespace
}  // namespace kvserve
