// BlockAllocator: invariants under random alloc / free / incref traffic.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "cache_manager/block_allocator.h"
#include "common/check.h"

namespace kvserve {
namespace {

TEST(BlockAllocator, FreshPoolHandsOutAscendingIds) {
  BlockAllocator a(8);
  EXPECT_EQ(a.total_blocks(), 8);
  EXPECT_EQ(a.free_blocks(), 8);
  auto v = a.allocate(3);
  EXPECT_EQ(v, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(a.allocate(), 3);
  EXPECT_EQ(a.used_blocks(), 4);
  EXPECT_EQ(a.high_water_blocks(), 4);
  a.check_invariants();
}

TEST(BlockAllocator, AllOrNothingAndClearError) {
  BlockAllocator a(4);
  a.allocate(3);
  try {
    a.allocate(2);
    FAIL() << "expected KvError";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("KV pool exhausted: need 2 blocks, 1 free"), std::string::npos) << e.what();
  }
  EXPECT_EQ(a.free_blocks(), 1);
  a.check_invariants();
}

TEST(BlockAllocator, RefcountFreesAtZeroAndCatchesDoubleFree) {
  BlockAllocator a(2);
  const int32_t b = a.allocate();
  a.incref(b);
  EXPECT_EQ(a.refcount(b), 2);
  EXPECT_FALSE(a.decref(b));
  EXPECT_EQ(a.free_blocks(), 1);
  EXPECT_TRUE(a.decref(b));
  EXPECT_EQ(a.free_blocks(), 2);
  EXPECT_THROW(a.decref(b), KvError);
  EXPECT_THROW(a.incref(b), KvError);
  EXPECT_THROW(a.refcount(7), KvError);
  a.check_invariants();
}

TEST(BlockAllocator, HighWaterResets) {
  BlockAllocator a(10);
  auto v = a.allocate(6);
  for (int32_t b : v) a.decref(b);
  EXPECT_EQ(a.high_water_blocks(), 6);
  a.allocate(2);
  a.reset_high_water();
  EXPECT_EQ(a.high_water_blocks(), 2);
}

TEST(BlockAllocator, RandomTrafficKeepsInvariants) {
  std::mt19937 rng(1234);
  BlockAllocator a(64);
  std::vector<int32_t> held;  // one entry per reference we own
  int64_t peak = 0;
  for (int step = 0; step < 20000; ++step) {
    const int op = static_cast<int>(rng() % 4);
    if (op == 0) {
      const int64_t n = rng() % 5;
      if (n <= a.free_blocks()) {
        for (int32_t b : a.allocate(n)) held.push_back(b);
      } else {
        EXPECT_THROW(a.allocate(n), KvError);
      }
    } else if (op == 1 && !held.empty()) {
      const int32_t b = held[rng() % held.size()];
      a.incref(b);
      held.push_back(b);
    } else if (!held.empty()) {
      const size_t i = rng() % held.size();
      const int32_t b = held[i];
      held[i] = held.back();
      held.pop_back();
      const bool last = std::count(held.begin(), held.end(), b) == 0;
      EXPECT_EQ(a.decref(b), last);
    }
    peak = std::max(peak, a.used_blocks());
    ASSERT_EQ(a.used_blocks() + a.free_blocks(), a.total_blocks());
    if (step % 97 == 0) a.check_invariants();
  }
  EXPECT_EQ(a.high_water_blocks(), peak);
  for (int32_t b : held) a.decref(b);
  EXPECT_EQ(a.free_blocks(), 64);
  a.check_invariants();
}

}  // namespace
}  // namespace kvserve
