// Paged decode attention: exact against a contiguous fp64 softmax over the same K/V, for pools of
// every KV cache dtype (a 16-bit pool against the values it stores).
#include <gtest/gtest.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "cache_manager/paged_attention.h"
#include "cache_manager/paged_kv_cache.h"
#include "common/check.h"

namespace kvserve {
namespace {

struct Case {
  int64_t kv, g, d, bs;
  std::vector<int64_t> lens;
  float q_scale = 1.0f;
  torch::ScalarType kv_dtype = torch::kFloat32;  // the pool's; q stays fp32
  int64_t window = 0;  // > 0: a sliding-window layer sees only its last `window` slots
  KvQuant quant = KvQuant::none;  // a quantized pool (kv_dtype is then what its rows decode to)
};

// Contiguous reference straight from the tensors that were written (never from the pool).
torch::Tensor contiguous_attention(const torch::Tensor& q, const std::vector<torch::Tensor>& ks,
                                   const std::vector<torch::Tensor>& vs, int64_t kv, int64_t window) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), G = H / kv;
  torch::Tensor out = torch::zeros({B, H, D}, torch::kFloat64);
  for (int64_t b = 0; b < B; ++b) {
    if (ks[b].size(1) == 0) continue;
    const int64_t n = ks[b].size(1), lo = window > 0 ? std::max<int64_t>(0, n - window) : 0;
    auto qb = q[b].to(torch::kFloat64).view({kv, G, D});
    auto s = torch::matmul(qb, ks[b].narrow(1, lo, n - lo).to(torch::kFloat64).transpose(1, 2)) /
             std::sqrt(static_cast<double>(D));
    out[b] = torch::matmul(torch::softmax(s, -1), vs[b].narrow(1, lo, n - lo).to(torch::kFloat64)).reshape({H, D});
  }
  return out;
}

void run_case(const Case& c, uint64_t seed) {
  torch::manual_seed(seed);
  const int64_t B = static_cast<int64_t>(c.lens.size());
  int64_t blocks = 4;
  for (int64_t n : c.lens) blocks += 3 * ((n + c.bs - 1) / c.bs + 1);
  KvPoolOptions o;
  o.num_kv_heads = c.kv;
  o.head_dim = c.d;
  o.block_size = c.bs;
  o.num_blocks = blocks;
  o.dtype = c.kv_dtype;
  o.quant = c.quant;
  PagedKvCache cache(2, o);
  // Stale slots must never leak into results (0xFF bytes decode to NaN scales in a quantized pool).
  if (c.quant == KvQuant::none) {
    cache.pool().storage().fill_(std::nanf(""));
  } else {
    cache.pool().storage().fill_(255);
  }
  // Interleave a filler sequence so every sequence's blocks are scattered through the pool. Layer 1
  // holds the whole context, layer 0 a third of it (as a compressing policy leaves it).
  std::vector<int64_t> ids;
  std::vector<torch::Tensor> ks[2], vs[2];
  cache.add_sequence(-1);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t id = 10 + b;
    cache.add_sequence(id);
    ids.push_back(id);
    for (int64_t l : {1, 0}) {
      const int64_t n = l == 1 ? c.lens[b] : (c.lens[b] + 2) / 3;
      ks[l].push_back(torch::randn({c.kv, n, c.d}));
      vs[l].push_back(torch::randn({c.kv, n, c.d}));
      cache.write(-1, b % 2, torch::randn({c.kv, c.bs, c.d}), torch::randn({c.kv, c.bs, c.d}),
                  torch::zeros({c.kv, c.bs}, torch::kLong));
      cache.write(id, l, ks[l][b], vs[l][b], torch::zeros({c.kv, n}, torch::kLong));
      // What the pool holds: the values rounded (to nearest even) to its dtype, or a quantized
      // pool's rows (rotated first where the cache rotates) decoded; the kernel reads them as they are.
      if (c.quant != KvQuant::none) {
        auto held = [&](const torch::Tensor& x) {
          return kv_quant_decode(kv_quant_encode(cache.rotates() ? kv_quant_rotate(x) : x, c.quant), c.quant, c.d);
        };
        ks[l][b] = held(ks[l][b]);
        vs[l][b] = held(vs[l][b]);
      }
      ks[l][b] = ks[l][b].to(c.kv_dtype);
      vs[l][b] = vs[l][b].to(c.kv_dtype);
    }
  }
  const torch::Tensor q = torch::randn({B, c.kv * c.g, c.d}) * c.q_scale;
  const auto& pool = cache.pool().storage();
  for (int64_t l : {1, 0}) {
    SCOPED_TRACE(::testing::Message() << "layer " << l << " kv dtype " << c.kv_dtype);
    const torch::Tensor want = contiguous_attention(q, ks[l], vs[l], c.kv, c.window);
    const DecodeTables t = cache.decode_tables(l, ids);
    const torch::Tensor fast = paged_attention(q, pool, t.block_table, t.lengths, -1.0, c.window, c.quant);
    const torch::Tensor gath = paged_attention_gather(q, pool, t.block_table, t.lengths, -1.0, c.window, c.quant);
    const torch::Tensor ref = paged_attention_reference(q, pool, t.block_table, t.lengths, -1.0, c.window, c.quant);
    EXPECT_EQ(fast.sizes(), q.sizes());
    EXPECT_EQ(fast.scalar_type(), torch::kFloat32);
    EXPECT_EQ(gath.scalar_type(), torch::kFloat32);
    // fp32 accumulation over exactly the stored values: as tight for a 16-bit or quantized pool as
    // for fp32 (against fp64 attention over the decoded rows).
    const double tol = 1e-5;
    EXPECT_LE((fast.to(torch::kFloat64) - want).abs().max().item<double>(), tol);
    EXPECT_LE((gath.to(torch::kFloat64) - want).abs().max().item<double>(), tol);
    EXPECT_LE((ref.to(torch::kFloat64) - want).abs().max().item<double>(), tol);
    EXPECT_LE((fast - gath).abs().max().item<float>(), tol);
    if (c.quant != KvQuant::none && cache.rotates()) {
      // Rotated rows read as what they stand for: the rotated query in, the output rotated back.
      std::vector<torch::Tensor> kr, vr;
      for (int64_t b = 0; b < B; ++b) {
        kr.push_back(kv_quant_rotate(ks[l][b]));
        vr.push_back(kv_quant_rotate(vs[l][b]));
      }
      const torch::Tensor want_r = contiguous_attention(q, kr, vr, c.kv, c.window);
      for (const torch::Tensor& got : {paged_attention(q, pool, t.block_table, t.lengths, -1.0, c.window, c.quant, true),
                                       paged_attention_gather(q, pool, t.block_table, t.lengths, -1.0, c.window, c.quant, true),
                                       paged_attention_reference(q, pool, t.block_table, t.lengths, -1.0, c.window, c.quant, true)}) {
        EXPECT_LE((got.to(torch::kFloat64) - want_r).abs().max().item<double>(), tol);
      }
      if (c.window == 0) {
        EXPECT_LE((cache.attend(l, ids, q).to(torch::kFloat64) - want_r).abs().max().item<double>(), tol);
      }
    }
  }
  EXPECT_EQ(cache.attend(1, ids, q).sizes(), q.sizes());
}

// The kernel's file must be compiled with OpenMP, or at::parallel_for runs serially in it.
TEST(PagedAttention, ParallelRegionsGetEveryThread) {
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  EXPECT_EQ(paged_attention_parallel_width(), 2);
  at::set_num_threads(before);
}

TEST(PagedAttention, GqaFourToOneHeadDim64) { run_case({2, 4, 64, 16, {1, 17, 100, 16, 33}}, 1); }
TEST(PagedAttention, MhaHeadDim128) { run_case({4, 1, 128, 16, {5, 64, 1, 250}}, 2); }
TEST(PagedAttention, GroupOfThree) { run_case({4, 3, 64, 16, {300, 2, 47}}, 3); }
TEST(PagedAttention, VeryDifferentLengths) { run_case({4, 3, 64, 16, {3000, 1, 15, 1, 777, 16, 17, 2}}, 4); }
TEST(PagedAttention, LongSingleSequenceSplitsAcrossThreads) { run_case({1, 4, 128, 16, {5001}}, 5); }
TEST(PagedAttention, LargeScoresStayStable) { run_case({2, 2, 64, 16, {40, 700}, 8.0f}, 6); }
TEST(PagedAttention, GenericHeadDimAndBlockSize) {
  run_case({2, 2, 32, 8, {9, 31, 1}}, 7);   // generic-D kernel
  run_case({3, 2, 24, 5, {9, 31, 1}}, 8);   // block size not a multiple of 8: libtorch path
  run_case({1, 1, 16, 32, {70, 64}}, 9);
}

// Sliding-window layers: windows shorter than a block, spanning several, longer than the sequence;
// the slots before the window hold real K/V that must not count.
TEST(PagedAttention, SlidingWindowSeesOnlyTheLastSlots) {
  for (int64_t window : {1, 5, 12, 16, 17, 40, 5000}) {
    SCOPED_TRACE(::testing::Message() << "window " << window);
    Case c{2, 4, 64, 16, {1, 17, 100, 16, 33, 12, 700}};
    c.window = window;
    run_case(c, 60 + static_cast<uint64_t>(window));
    Case generic{2, 3, 32, 8, {9, 31, 1, 90}};  // generic-D kernel
    generic.window = window;
    run_case(generic, 70 + static_cast<uint64_t>(window));
    Case gather{3, 2, 24, 5, {9, 31, 1}};  // libtorch path
    gather.window = window;
    run_case(gather, 80 + static_cast<uint64_t>(window));
    Case split{1, 4, 128, 16, {5001}};  // split-K: the chunks start at the window's block
    split.window = window;
    run_case(split, 90 + static_cast<uint64_t>(window));
    Case half{2, 2, 64, 16, {40, 700}, 1.0f, torch::kBFloat16};
    half.window = window;
    run_case(half, 95 + static_cast<uint64_t>(window));
  }
}

TEST(PagedAttention, RandomShapes) {
  std::mt19937 rng(42);
  for (int i = 0; i < 25; ++i) {
    Case c;
    c.kv = 1 + rng() % 4;
    c.g = 1 + rng() % 4;
    c.d = (rng() % 2) ? 64 : 128;
    c.bs = (rng() % 3 == 0) ? 32 : 16;
    const int64_t B = 1 + rng() % 6;
    for (int64_t b = 0; b < B; ++b) c.lens.push_back(1 + rng() % (rng() % 4 == 0 ? 2000 : 70));
    SCOPED_TRACE(::testing::Message() << "case " << i << " kv " << c.kv << " g " << c.g << " d " << c.d);
    run_case(c, 100 + i);
  }
}

// 16-bit pools: the kernel widens fp16 (F16C) and bf16 (shift) K/V; the same shapes as above.
class PagedAttention16 : public ::testing::TestWithParam<torch::ScalarType> {};

TEST_P(PagedAttention16, OddShapes) {
  const torch::ScalarType t = GetParam();
  run_case({2, 4, 64, 16, {1, 17, 100, 16, 33}, 1.0f, t}, 21);    // GQA 4:1
  run_case({4, 3, 64, 16, {300, 2, 47}, 1.0f, t}, 22);            // group of 3 (bench-125m's)
  run_case({4, 1, 128, 32, {5, 64, 1, 250}, 1.0f, t}, 23);        // MHA, block 32
  run_case({1, 4, 128, 16, {5001}, 1.0f, t}, 24);                 // split-K over threads
  run_case({2, 2, 64, 16, {40, 700}, 8.0f, t}, 25);               // large scores
  run_case({2, 2, 32, 8, {9, 31, 1}, 1.0f, t}, 26);               // generic D, block 8
  run_case({3, 2, 24, 5, {9, 31, 1}, 1.0f, t}, 27);               // libtorch path
  run_case({4, 3, 64, 16, {3000, 1, 15, 1, 777, 16, 17, 2}, 1.0f, t}, 28);
}

TEST_P(PagedAttention16, RandomShapes) {
  std::mt19937 rng(7);
  for (int i = 0; i < 12; ++i) {
    Case c;
    c.kv_dtype = GetParam();
    c.kv = 1 + rng() % 4;
    c.g = 1 + rng() % 4;
    c.d = (rng() % 2) ? 64 : 128;
    c.bs = (rng() % 3 == 0) ? 32 : 16;
    const int64_t B = 1 + rng() % 6;
    for (int64_t b = 0; b < B; ++b) c.lens.push_back(1 + rng() % (rng() % 4 == 0 ? 2000 : 70));
    SCOPED_TRACE(::testing::Message() << "case " << i << " kv " << c.kv << " g " << c.g << " d " << c.d);
    run_case(c, 200 + i);
  }
}

// A 16-bit compute dtype on CPU (q in the pool's dtype) runs the same kernel; out in q's dtype.
TEST_P(PagedAttention16, QueryInThePoolsDtype) {
  torch::manual_seed(31);
  const torch::ScalarType t = GetParam();
  KvPoolOptions o;
  o.num_kv_heads = 2;
  o.head_dim = 64;
  o.num_blocks = 16;
  o.dtype = t;
  PagedKvCache cache(1, o);
  cache.add_sequence(0);
  cache.write(0, 0, torch::randn({2, 50, 64}), torch::randn({2, 50, 64}), torch::zeros({2, 50}, torch::kLong));
  const torch::Tensor q = torch::randn({1, 6, 64}).to(t);
  const DecodeTables d = cache.decode_tables(0, {0});
  const torch::Tensor out = paged_attention(q, cache.pool().storage(), d.block_table, d.lengths);
  const torch::Tensor ref = paged_attention_reference(q, cache.pool().storage(), d.block_table, d.lengths);
  EXPECT_EQ(out.scalar_type(), t);
  // Both end in one rounding to q's dtype.
  EXPECT_LE((out.to(torch::kFloat32) - ref.to(torch::kFloat32)).abs().max().item<float>(), t == torch::kBFloat16 ? 1e-2 : 2e-3);
}

// Decode appends convert on write: append-and-attend on a 16-bit pool against the rounded values.
TEST_P(PagedAttention16, AppendAndAttendMatchesContiguous) {
  torch::manual_seed(12);
  const int64_t KV = 4, G = 3, D = 64;
  KvPoolOptions o;
  o.num_kv_heads = KV;
  o.head_dim = D;
  o.num_blocks = 32;
  o.dtype = GetParam();
  PagedKvCache cache(1, o);
  const std::vector<int64_t> ids = {1, 2};
  std::vector<torch::Tensor> ks, vs;
  for (int64_t id : ids) {
    cache.add_sequence(id);
    const int64_t n = 13 + 7 * id;
    ks.push_back(torch::randn({KV, n, D}));
    vs.push_back(torch::randn({KV, n, D}));
    cache.write(id, 0, ks.back(), vs.back(), torch::arange(n, torch::kLong).expand({KV, n}));
    ks.back() = ks.back().to(o.dtype);
    vs.back() = vs.back().to(o.dtype);
  }
  for (int step = 0; step < 12; ++step) {
    auto q = torch::randn({2, KV * G, D}), k = torch::randn({2, KV, D}), v = torch::randn({2, KV, D});
    for (size_t b = 0; b < ids.size(); ++b) {
      ks[b] = torch::cat({ks[b], k[b].to(o.dtype).unsqueeze(1)}, 1);
      vs[b] = torch::cat({vs[b], v[b].to(o.dtype).unsqueeze(1)}, 1);
    }
    const std::vector<int64_t> pos = {20 + step, 27 + step};
    cache.begin_decode(ids, pos);  // the planned step's write_slots path
    auto out = cache.decode_layer(0, q, k, v);
    ASSERT_LE((out.to(torch::kFloat64) - contiguous_attention(q, ks, vs, KV, 0)).abs().max().item<double>(), 1e-5)
        << "step " << step;
  }
  // Bitwise: what the pool holds is torch's round-to-nearest-even of what was appended.
  for (size_t b = 0; b < ids.size(); ++b) {
    auto [k, v] = cache.gather(ids[b], 0);
    EXPECT_TRUE(torch::equal(k, ks[b]));
    EXPECT_TRUE(torch::equal(v, vs[b]));
  }
}

INSTANTIATE_TEST_SUITE_P(KvDtypes, PagedAttention16, ::testing::Values(torch::kFloat16, torch::kBFloat16),
                         [](const ::testing::TestParamInfo<torch::ScalarType>& i) {
                           return std::string(i.param == torch::kFloat16 ? "float16" : "bfloat16");
                         });

TEST(PagedAttention, EmptyLayerGivesZeros) {
  KvPoolOptions o;
  o.num_kv_heads = 2;
  o.head_dim = 64;
  o.num_blocks = 4;
  PagedKvCache cache(1, o);
  cache.add_sequence(0);
  cache.add_sequence(1);
  cache.write(1, 0, torch::randn({2, 3, 64}), torch::randn({2, 3, 64}), torch::zeros({2, 3}, torch::kLong));
  auto q = torch::randn({2, 4, 64});
  auto out = cache.attend(0, {0, 1}, q);
  EXPECT_TRUE(torch::equal(out[0], torch::zeros({4, 64})));
  EXPECT_FALSE(out[1].isnan().any().item<bool>());
  const DecodeTables t = cache.decode_tables(0, {0, 1});
  auto g = paged_attention_gather(q, cache.pool().storage(), t.block_table, t.lengths);
  EXPECT_TRUE(torch::equal(g[0], torch::zeros({4, 64})));
}

TEST(PagedAttention, RejectsBadShapes) {
  auto pool = torch::zeros({4, 2, 2, 16, 64});
  auto table = torch::zeros({1, 1}, torch::kInt32);
  auto lens = torch::full({1}, 16, torch::kInt32);
  EXPECT_THROW(paged_attention(torch::randn({1, 3, 64}), pool, table, lens), KvError);   // 3 heads, 2 KV
  EXPECT_THROW(paged_attention(torch::randn({1, 4, 32}), pool, table, lens), KvError);   // wrong D
  EXPECT_THROW(paged_attention(torch::randn({1, 4, 64}), pool, table, torch::full({1}, 17, torch::kInt32)),
               KvError);  // table too short
  EXPECT_THROW(paged_attention(torch::randn({1, 4, 64}), pool, table.to(torch::kLong), lens), KvError);
}

// The model's decode hook: append then attend equals attention over prompt + new token.
TEST(PagedAttention, AppendAndAttendMatchesContiguous) {
  torch::manual_seed(11);
  const int64_t KV = 4, G = 3, D = 64, L = 2;
  KvPoolOptions o;
  o.num_kv_heads = KV;
  o.head_dim = D;
  o.num_blocks = 64;
  PagedKvCache cache(L, o);
  const std::vector<int64_t> ids = {5, 6, 7};
  const std::vector<int64_t> prompt = {15, 16, 3};
  std::vector<std::vector<torch::Tensor>> ks(L), vs(L);
  for (size_t b = 0; b < ids.size(); ++b) {
    cache.add_sequence(ids[b]);
    for (int64_t l = 0; l < L; ++l) {
      const int64_t n = prompt[b] - l;  // layers already differ, as after compression
      ks[l].push_back(torch::randn({KV, n, D}));
      vs[l].push_back(torch::randn({KV, n, D}));
      cache.write(ids[b], l, ks[l][b], vs[l][b], torch::arange(n, torch::kLong).expand({KV, n}));
    }
  }
  for (int step = 0; step < 20; ++step) {
    std::vector<int64_t> pos;
    for (size_t b = 0; b < ids.size(); ++b) pos.push_back(prompt[b] + step);
    for (int64_t l = 0; l < L; ++l) {
      auto q = torch::randn({3, KV * G, D}), k = torch::randn({3, KV, D}), v = torch::randn({3, KV, D});
      for (size_t b = 0; b < ids.size(); ++b) {
        ks[l][b] = torch::cat({ks[l][b], k[b].unsqueeze(1)}, 1);
        vs[l][b] = torch::cat({vs[l][b], v[b].unsqueeze(1)}, 1);
      }
      auto out = cache.append_and_attend(l, ids, pos, q, k, v);
      auto want = contiguous_attention(q, ks[l], vs[l], KV, 0);
      ASSERT_LE((out.to(torch::kFloat64) - want).abs().max().item<double>(), 1e-5) << "step " << step;
      ASSERT_EQ(cache.length(ids[0], l), prompt[0] - l + step + 1);
    }
    cache.check_invariants();
  }
  EXPECT_EQ(cache.positions(7, 1)[2][21].item<int64_t>(), 3 + 19);
  for (int64_t id : ids) cache.release(id);
  cache.check_invariants();
  EXPECT_EQ(cache.free_blocks(), cache.total_blocks());
}

}  // namespace
}  // namespace kvserve

namespace kvserve {
namespace {

// Quantized pools (cache_manager/kv_quant.h): the kernel decodes int8 / 4-bit rows in L1; against
// fp64 attention over the decoded K/V, the same shapes as the 16-bit pools'.
class PagedAttentionQuant : public ::testing::TestWithParam<KvQuant> {};

Case quant_case(Case c, KvQuant q) {
  c.quant = q;
  return c;
}

TEST_P(PagedAttentionQuant, OddShapes) {
  const KvQuant q = GetParam();
  run_case(quant_case({2, 4, 64, 16, {1, 17, 100, 16, 33}}, q), 41);    // GQA 4:1
  run_case(quant_case({4, 3, 64, 16, {300, 2, 47}}, q), 42);            // group of 3 (bench-125m's)
  run_case(quant_case({4, 1, 128, 32, {5, 64, 1, 250}}, q), 43);        // MHA, block 32
  run_case(quant_case({1, 4, 128, 16, {5001}}, q), 44);                 // split-K over threads
  run_case(quant_case({2, 2, 64, 16, {40, 700}, 8.0f}, q), 45);         // large scores
  run_case(quant_case({2, 2, 32, 8, {9, 31, 1}}, q), 46);               // generic D, block 8
  run_case(quant_case({3, 2, 32, 5, {9, 31, 1}}, q), 47);               // block 5: libtorch path
  run_case(quant_case({4, 3, 64, 16, {3000, 1, 15, 1, 777, 16, 17, 2}}, q), 48);
  run_case(quant_case({2, 3, 96, 16, {70, 5}}, q), 49);                 // D 96: generic kernel, 3 groups
}

TEST_P(PagedAttentionQuant, SlidingWindow) {
  for (int64_t window : {1, 12, 17, 5000}) {
    Case c = quant_case({2, 4, 64, 16, {1, 17, 100, 16, 33, 12, 700}}, GetParam());
    c.window = window;
    run_case(c, 300 + static_cast<uint64_t>(window));
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, PagedAttentionQuant,
                         ::testing::Values(KvQuant::q8_0, KvQuant::q4_0, KvQuant::q4_1, KvQuant::fp8_e4m3),
                         [](const auto& info) { return std::string(kv_quant_name(info.param)); });

TEST(PagedAttentionQuantArgs, RefusesAMismatchedPool) {
  KvPoolOptions o;
  o.num_kv_heads = 1;
  o.head_dim = 64;
  o.num_blocks = 2;
  o.quant = KvQuant::q8_0;
  PagedKvCache cache(1, o);
  cache.add_sequence(0);
  cache.write(0, 0, torch::randn({1, 3, 64}), torch::randn({1, 3, 64}), torch::zeros({1, 3}, torch::kLong));
  const DecodeTables t = cache.decode_tables(0, {0});
  const torch::Tensor q = torch::randn({1, 2, 64});
  EXPECT_THROW(paged_attention(q, cache.pool().storage(), t.block_table, t.lengths, -1.0, 0, KvQuant::q4_0), KvError);
  EXPECT_THROW(paged_attention(q, cache.pool().storage(), t.block_table, t.lengths), KvError);
}

}  // namespace
}  // namespace kvserve

namespace kvserve {
namespace {

// A speculative verify step: a sequence's last token and drafts are consecutive rows with one table
// row and lengths n - r + 1, ..., n. The kernel reads each block once for the whole run (its rows as
// extra query heads, the causal tail masked per row); every row must equal fp64 attention over its
// own prefix, whatever the other rows of the batch are.
void run_verify_case(int64_t kv, int64_t g, int64_t d, const std::vector<std::pair<int64_t, int64_t>>& seqs,
                     torch::ScalarType dtype, KvQuant quant, uint64_t seed) {
  torch::manual_seed(seed);
  constexpr int64_t bs = 16;
  KvPoolOptions o;
  o.num_kv_heads = kv;
  o.head_dim = d;
  o.block_size = bs;
  o.dtype = dtype;
  o.quant = quant;
  o.num_blocks = 8;
  for (const auto& [n, r] : seqs) o.num_blocks += (n + bs - 1) / bs + 1;
  PagedKvCache cache(1, o);
  if (quant == KvQuant::none) {
    cache.pool().storage().fill_(std::nanf(""));
  } else {
    cache.pool().storage().fill_(255);
  }
  std::vector<int64_t> ids, run_ids;
  std::vector<int32_t> lens;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const auto [n, r] = seqs[i];
    const int64_t id = 100 + static_cast<int64_t>(i);
    cache.add_sequence(id);
    cache.write(id, 0, torch::randn({kv, n, d}), torch::randn({kv, n, d}), torch::zeros({kv, n}, torch::kLong));
    ids.push_back(id);
    for (int64_t j = 0; j < r; ++j) {
      run_ids.push_back(static_cast<int64_t>(i));
      lens.push_back(static_cast<int32_t>(n - r + 1 + j));
    }
  }
  const DecodeTables t = cache.decode_tables(0, ids);
  const torch::Tensor table = t.block_table.index_select(0, torch::tensor(run_ids));
  const torch::Tensor lengths = torch::tensor(lens, torch::kInt32);
  const torch::Tensor q = torch::randn({static_cast<int64_t>(lens.size()), kv * g, d});
  const auto& pool = cache.pool().storage();
  const torch::Tensor fast = paged_attention(q, pool, table, lengths, -1.0, 0, quant);
  const torch::Tensor ref = paged_attention_reference(q, pool, table, lengths, -1.0, 0, quant);
  EXPECT_EQ(fast.sizes(), q.sizes());
  EXPECT_LE((fast.to(torch::kFloat64) - ref.to(torch::kFloat64)).abs().max().item<double>(), 1e-5);
}

TEST(PagedAttentionVerifyRuns, EveryRowSeesItsOwnPrefix) {
  // Runs of 5, 1, 3 (across a block boundary) and 2 (in the first block), beside plain rows.
  const std::vector<std::pair<int64_t, int64_t>> seqs{{100, 5}, {37, 1}, {33, 3}, {2, 2}, {16, 1}, {70, 4}};
  run_verify_case(3, 3, 64, seqs, torch::kFloat32, KvQuant::none, 1);  // the default model's groups of 3
  run_verify_case(2, 4, 64, seqs, torch::kFloat32, KvQuant::none, 2);
  run_verify_case(4, 1, 128, seqs, torch::kBFloat16, KvQuant::none, 3);
  run_verify_case(2, 2, 64, seqs, torch::kFloat16, KvQuant::none, 4);
  run_verify_case(3, 3, 64, seqs, torch::kFloat32, KvQuant::q8_0, 5);
  run_verify_case(2, 4, 64, seqs, torch::kFloat32, KvQuant::q4_0, 6);
}

// The kernel is built twice (AVX2, and AVX-512 where the CPU has it): both builds against fp64
// attention for every pool dtype, the register-blocked group sizes, a generic head_dim, sliding
// windows and verify runs. The other tests run whichever build the CPU picks.
TEST(PagedAttentionIsa, BothBuildsMatchTheReference) {
  __builtin_cpu_init();
  const bool wide = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl");
  EXPECT_EQ(paged_attention_isa(torch::kFloat16, KvQuant::none, 64), wide ? "avx512" : "avx2");
  EXPECT_EQ(paged_attention_isa(torch::kFloat32, KvQuant::none, 40), "avx2");  // D not a multiple of 16
  EXPECT_THROW(set_paged_attention_isa("sse2"), std::exception);
  for (const std::string isa : {"avx2", "avx512"}) {
    SCOPED_TRACE(isa);
    set_paged_attention_isa(isa);
    EXPECT_EQ(paged_attention_isa(torch::kFloat32, KvQuant::q8_0, 64), isa == "avx2" || !wide ? "avx2" : "avx512");
    uint64_t seed = isa == "avx2" ? 700 : 800;
    for (const auto dt : {torch::kFloat32, torch::kFloat16, torch::kBFloat16}) {
      for (const KvQuant q : {KvQuant::none, KvQuant::q8_0, KvQuant::q4_0, KvQuant::q4_1}) {
        if (q != KvQuant::none && dt != torch::kFloat32) continue;
        auto with = [&](Case c) {
          c.kv_dtype = dt;
          c.quant = q;
          return c;
        };
        run_case(with({2, 3, 64, 16, {300, 2, 47, 16}}), ++seed);      // bench-125m's groups of 3
        run_case(with({1, 8, 128, 16, {333, 17}}), ++seed);            // 8:1 GQA, D 128
        run_case(with({2, 6, 64, 32, {100, 1}}), ++seed);              // groups of 6, block 32
        run_case(with({3, 1, 128, 16, {5001, 9, 64}}), ++seed);        // MHA, split-K
        run_case(with({2, 5, 96, 16, {70, 5}}), ++seed);               // generic D and G
        Case w = with({2, 4, 64, 16, {1, 17, 100, 700}});
        w.window = 17;
        run_case(w, ++seed);
        run_verify_case(3, 3, 64, {{100, 5}, {37, 1}, {33, 3}, {2, 2}}, dt, q, ++seed);
      }
    }
  }
  set_paged_attention_isa("avx512");
}

TEST(PagedAttentionVerifyRuns, SplitKChunkAnEarlierRowCannotSee) {
  // 1,025 slots: 65 blocks, split into chunks of 16, the last holding block 64 alone, which the
  // run's first row (1,024 slots) does not see: its partial must not poison the merge.
  run_verify_case(1, 2, 64, {{1025, 2}}, torch::kFloat32, KvQuant::none, 7);
  run_verify_case(1, 2, 64, {{1026, 3}, {5001, 6}}, torch::kFloat32, KvQuant::none, 8);
}

// A row's output does not depend on what it is batched with: the split-K chunks follow from the
// row's own length, so alone, beside much longer or shorter rows, or repeated (a verify run), it
// is the same bit for bit. Greedy outputs under speculation and with quantized weights rely on it.
TEST(PagedAttention, ARowsOutputIsTheSameInAnyBatch) {
  for (const KvQuant quant : {KvQuant::none, KvQuant::q8_0, KvQuant::q4_0}) {
    torch::manual_seed(9);
    const int64_t kv = 3, g = 3, d = 64, bs = 16;
    const std::vector<int64_t> lens{5001, 17, 300, 2048, 1};
    KvPoolOptions o;
    o.num_kv_heads = kv;
    o.head_dim = d;
    o.block_size = bs;
    o.num_blocks = 600;
    o.quant = quant;
    PagedKvCache cache(1, o);
    std::vector<int64_t> ids;
    for (size_t i = 0; i < lens.size(); ++i) {
      const int64_t id = 20 + static_cast<int64_t>(i), n = lens[i];
      cache.add_sequence(id);
      cache.write(id, 0, torch::randn({kv, n, d}), torch::randn({kv, n, d}), torch::zeros({kv, n}, torch::kLong));
      ids.push_back(id);
    }
    const DecodeTables t = cache.decode_tables(0, ids);
    const auto& pool = cache.pool().storage();
    const torch::Tensor q = torch::randn({static_cast<int64_t>(lens.size()), kv * g, d});
    const torch::Tensor all = paged_attention(q, pool, t.block_table, t.lengths, -1.0, 0, quant);
    for (int64_t i = 0; i < static_cast<int64_t>(lens.size()); ++i) {
      const torch::Tensor one = paged_attention(q.narrow(0, i, 1), pool, t.block_table.narrow(0, i, 1),
                                                t.lengths.narrow(0, i, 1), -1.0, 0, quant);
      EXPECT_TRUE(torch::equal(one[0], all[i])) << "row " << i << " of " << lens[i] << " slots";
      // Beside the longest row alone, and twice over.
      const auto pair = torch::tensor({i, int64_t{0}, i});
      const torch::Tensor three = paged_attention(q.index_select(0, pair), pool, t.block_table.index_select(0, pair),
                                                  t.lengths.index_select(0, pair), -1.0, 0, quant);
      EXPECT_TRUE(torch::equal(three[0], all[i]) && torch::equal(three[2], all[i])) << "row " << i;
    }
    // A verify run of r rows (one kernel row of r * 3 query heads: a register-blocked group size for
    // 2, the generic kernel for 9, 12 and 15 heads) against each of its rows alone.
    for (const int64_t r : {2, 3, 4, 5}) for (const int64_t L : {lens[0], lens[2], int64_t{40}, int64_t{47}}) {
      const auto run_rows = torch::zeros({r}, torch::kLong);
      std::vector<int32_t> run_lens;
      for (int64_t j = 0; j < r; ++j) run_lens.push_back(static_cast<int32_t>(L - r + 1 + j));
      const torch::Tensor qr = torch::randn({r, kv * g, d});
      const torch::Tensor run = paged_attention(qr, pool, t.block_table.index_select(0, run_rows),
                                                torch::tensor(run_lens, torch::kInt32), -1.0, 0, quant);
      for (int64_t j = 0; j < r; ++j) {
        const torch::Tensor one = paged_attention(qr.narrow(0, j, 1), pool, t.block_table.narrow(0, 0, 1),
                                                  torch::tensor({run_lens[static_cast<size_t>(j)]}, torch::kInt32),
                                                  -1.0, 0, quant);
        EXPECT_TRUE(torch::equal(one[0], run[j])) << "row " << j << " of a run of " << r << " ending at " << L;
      }
    }
  }
}

}  // namespace
}  // namespace kvserve
