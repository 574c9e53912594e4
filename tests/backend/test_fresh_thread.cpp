// run_on_fresh_thread (common/fresh_thread.h): results and exceptions come back, and the OpenMP
// worker pool a parallel region starts on that thread is gone once it returns, where the same region
// run on the calling thread leaves its pool behind for the process's life.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <stdexcept>
#include <thread>

#include "common/fresh_thread.h"

namespace kvserve {
namespace {

int64_t process_threads() {
  int64_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// Waits up to 2 s for the process to have at most `n` threads (a finished pool's threads exit on
// their own schedule); returns the count it saw last.
int64_t settle_to(int64_t n) {
  int64_t now = process_threads();
  for (int i = 0; i < 200 && now > n; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    now = process_threads();
  }
  return now;
}

// A region big enough for at::parallel_for to start the thread pool.
void parallel_region() {
  auto t = torch::randn({2048, 2048});
  auto u = (t * 2 + 1).sum();
  ASSERT_TRUE(u.defined());
}

TEST(FreshThread, ReturnsTheResultAndRunsElsewhere) {
  const auto caller = std::this_thread::get_id();
  EXPECT_EQ(run_on_fresh_thread([] { return 42; }), 42);
  EXPECT_NE(run_on_fresh_thread([] { return std::this_thread::get_id(); }), caller);
  auto p = run_on_fresh_thread([] { return std::make_unique<int>(7); });  // move-only results
  EXPECT_EQ(*p, 7);
  int touched = 0;
  run_on_fresh_thread([&] { touched = 1; });  // void
  EXPECT_EQ(touched, 1);
}

TEST(FreshThread, RethrowsOnTheCaller) {
  EXPECT_THROW(run_on_fresh_thread([]() -> int { throw std::runtime_error("load failed"); }), std::runtime_error);
  try {
    run_on_fresh_thread([] { throw std::invalid_argument("bad checkpoint"); });
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "bad checkpoint");
  }
}

// The property generate and serve rely on. Runs the fresh-thread half first: once the calling
// thread has a pool, it stays.
TEST(FreshThread, TakesItsOpenMpPoolWithIt) {
  if (at::get_num_threads() < 2) GTEST_SKIP() << "one intra-op thread: no pool to leave behind";
  const int64_t before = process_threads();
  run_on_fresh_thread(parallel_region);
  EXPECT_EQ(settle_to(before), before) << "a pool started on the fresh thread outlived it";
  // The contrast: the same region on this thread leaves its workers (so the check above can fail).
  parallel_region();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_GT(process_threads(), before) << "this OpenMP runtime keeps no pool (the test shows nothing here)";
}

}  // namespace
}  // namespace kvserve
