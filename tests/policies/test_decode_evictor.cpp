// DecodeEvictor: chunked decode-time eviction that never drops the sinks or the recent window.
#include <gtest/gtest.h>

#include <set>

#include <torch/torch.h>

#include "common/check.h"
#include "policies/decode_evictor.h"

using namespace kvserve;

TEST(DecodeEvictor, InactiveWithoutDecodeBudget) {
  DecodeEvictor e(make_policy_config("knorm"), 5);
  EXPECT_FALSE(e.active());
  EXPECT_FALSE(e.needs_eviction(1 << 20));
  DecodeEvictor skipped(make_policy_config("knorm", {{"decode_budget", "64"}}), 0);  // layer 0 skipped
  EXPECT_FALSE(skipped.active());
}

TEST(DecodeEvictor, KnormEvictsInChunksKeepingWindow) {
  auto cfg = make_policy_config("knorm", {{"decode_budget", "64"}, {"decode_evict_chunk", "16"}, {"window", "4"}});
  DecodeEvictor e(cfg, 3);
  ASSERT_TRUE(e.active());
  EXPECT_FALSE(e.needs_eviction(64));
  EXPECT_TRUE(e.needs_eviction(65));
  EXPECT_EQ(e.target_count(), 48);
  torch::manual_seed(0);
  const int64_t n = 65;
  auto positions = (torch::arange(n) * 2).unsqueeze(0).repeat({2, 1});  // non-contiguous original positions
  auto keys = torch::randn({2, n, 8});
  keys.narrow(1, n - 4, 4).mul_(100);  // the recent window has huge norms but must stay
  auto kept = e.select(positions, keys);
  ASSERT_EQ(kept.sizes(), (std::vector<int64_t>{2, 48}));
  auto norms = torch::linalg_vector_norm(keys, 2, {-1});
  for (int64_t h = 0; h < 2; ++h) {
    auto row = kept[h].contiguous();
    std::set<int64_t> s(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
    for (int64_t i = n - 4; i < n; ++i) EXPECT_TRUE(s.count(i));
    // Every kept non-window slot has a norm no larger than any evicted slot.
    float max_kept = 0, min_evicted = 1e30f;
    for (int64_t i = 0; i < n - 4; ++i) {
      float v = norms[h][i].item<float>();
      if (s.count(i)) max_kept = std::max(max_kept, v);
      else min_evicted = std::min(min_evicted, v);
    }
    EXPECT_LE(max_kept, min_evicted);
  }
}

TEST(DecodeEvictor, StreamingKeepsSinksAndNewest) {
  auto cfg = make_policy_config("streamingllm", {{"decode_budget", "40"}, {"decode_evict_chunk", "8"}});
  DecodeEvictor e(cfg, 0);
  auto positions = torch::arange(41).unsqueeze(0);
  auto kept = e.select(positions, {});
  ASSERT_EQ(kept.size(1), 32);
  auto row = kept[0].contiguous();
  std::vector<int64_t> v(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
  EXPECT_EQ(v.front(), 0);
  EXPECT_EQ(v[3], 3);
  EXPECT_EQ(v[4], 41 - 28);
  EXPECT_EQ(v.back(), 40);
}

TEST(DecodeEvictor, AccumulatedNeedsScores) {
  auto cfg = make_policy_config("h2o", {{"decode_budget", "40"}, {"decode_evict_chunk", "8"}});
  DecodeEvictor e(cfg, 0);
  auto positions = torch::arange(50).unsqueeze(0);
  EXPECT_THROW(e.select(positions, {}), KvError);
  auto scores = torch::arange(50, 0, -1).to(torch::kFloat32).unsqueeze(0);  // older = more attention
  auto kept = e.select(positions, {}, scores);
  ASSERT_EQ(kept.size(1), 32);
  EXPECT_EQ(kept[0][0].item<int64_t>(), 0);
  EXPECT_EQ(kept[0][31].item<int64_t>(), 49);  // recent window kept despite low score
  EXPECT_EQ(kept[0][23].item<int64_t>(), 23);
  EXPECT_EQ(kept[0][24].item<int64_t>(), 42);
}
