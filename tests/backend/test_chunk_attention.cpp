// chunk_attention against attention written out in fp64 (softmax over the visible positions): split
// and one-call chunks, GQA groups, no earlier positions, bf16; and the split rule.
#include <gtest/gtest.h>

#include <cmath>

#include "backend/kernels/chunk_attention.h"

namespace kvserve {
namespace {

// Every query t sees the P earlier positions and the chunk's positions 0..t.
torch::Tensor reference(const torch::Tensor& q, const torch::Tensor& pk, const torch::Tensor& pv, const torch::Tensor& k,
                        const torch::Tensor& v) {
  const int64_t H = q.size(0), T = q.size(1), D = q.size(2), KV = k.size(0), P = pk.size(1);
  auto kc = torch::cat({pk, k}, 1).to(torch::kFloat64).repeat_interleave(H / KV, 0);
  auto vc = torch::cat({pv, v}, 1).to(torch::kFloat64).repeat_interleave(H / KV, 0);
  auto s = torch::matmul(q.to(torch::kFloat64), kc.transpose(1, 2)) / std::sqrt(static_cast<double>(D));
  auto qi = torch::arange(T).unsqueeze(1), kj = torch::arange(P + T).unsqueeze(0);
  s = s.masked_fill((kj > qi + P).unsqueeze(0), -INFINITY);
  return torch::matmul(torch::softmax(s, -1), vc);
}

struct Shape {
  int64_t heads, kv_heads, head_dim, earlier, queries;
};

class ChunkAttention : public ::testing::TestWithParam<Shape> {};

TEST_P(ChunkAttention, EqualsAttentionWrittenOut) {
  const Shape sh = GetParam();
  torch::manual_seed(7);
  auto q = torch::randn({sh.heads, sh.queries, sh.head_dim});
  auto pk = torch::randn({sh.kv_heads, sh.earlier, sh.head_dim}), pv = torch::randn({sh.kv_heads, sh.earlier, sh.head_dim});
  auto k = torch::randn({sh.kv_heads, sh.queries, sh.head_dim}), v = torch::randn({sh.kv_heads, sh.queries, sh.head_dim});
  auto out = chunk_attention(q, pk, pv, k, v);
  ASSERT_EQ(out.sizes(), q.sizes());
  EXPECT_EQ(out.scalar_type(), torch::kFloat32);
  EXPECT_LT((out.to(torch::kFloat64) - reference(q, pk, pv, k, v)).abs().max().item<double>(), 2e-5);
}

INSTANTIATE_TEST_SUITE_P(Shapes, ChunkAttention,
                         ::testing::Values(Shape{9, 3, 64, 700, 600},    // split, GQA 3 (SmolLM2's heads)
                                           Shape{4, 4, 32, 1000, 520},   // split, one query head per KV head
                                           Shape{8, 1, 16, 33, 513},     // split, few earlier positions
                                           Shape{8, 2, 32, 900, 40},     // one call: a short question
                                           Shape{6, 2, 16, 0, 600},      // nothing earlier
                                           Shape{6, 3, 16, 0, 7}));

TEST(ChunkAttention, Bf16TracksFp32) {
  torch::manual_seed(3);
  auto q = torch::randn({8, 600, 64}), pk = torch::randn({2, 800, 64}), pv = torch::randn({2, 800, 64});
  auto k = torch::randn({2, 600, 64}), v = torch::randn({2, 600, 64});
  auto bf = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
  auto out = chunk_attention(bf(q), bf(pk), bf(pv), bf(k), bf(v));
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  EXPECT_LT((out.to(torch::kFloat64) - reference(q, pk, pv, k, v)).abs().max().item<double>(), 3e-2);
}

TEST(ChunkAttention, SplitsLongChunksOnCpuOnly) {
  EXPECT_TRUE(chunk_attention_splits(5500, 2500, torch::kCPU));
  EXPECT_FALSE(chunk_attention_splits(64, 8000, torch::kCPU));
  EXPECT_FALSE(chunk_attention_splits(5500, 0, torch::kCPU));
  EXPECT_FALSE(chunk_attention_splits(5500, 2500, torch::Device(torch::kCUDA, 0)));
}

}  // namespace
}  // namespace kvserve
