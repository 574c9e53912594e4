// The small-batch dense kernel against torch::linear (fp64 reference), and its batch invariance.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/kernels/decode_scope.h"
#include "backend/kernels/dense.h"
#include "backend/kernels/dense_kernel.h"

namespace kvserve {
namespace {

torch::Tensor reference(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  auto y = torch::matmul(x.to(torch::kFloat64), w.to(torch::kFloat64).t());
  if (b.defined()) y = y + b.to(torch::kFloat64);
  return y.to(torch::kFloat32);
}

TEST(SmallBatchDense, MatchesFp64ReferenceOverShapes) {
  torch::manual_seed(7);
  // K not a multiple of 8, N not a multiple of the 4/8-row tiles or the 64-row tasks, odd M.
  for (int64_t M : {1, 2, 3, 7, 8, 16, 17}) {
    for (auto [N, K] : std::vector<std::pair<int64_t, int64_t>>{{1, 8}, {5, 3}, {64, 64}, {131, 100}, {320, 768}}) {
      for (bool with_bias : {false, true}) {
        auto x = torch::randn({M, K});
        auto w = torch::randn({N, K});
        torch::Tensor b = with_bias ? torch::randn({N}) : torch::Tensor();
        auto y = small_batch_dense(x, w, b);
        ASSERT_EQ(y.sizes(), (std::vector<int64_t>{M, N}));
        EXPECT_TRUE(torch::allclose(y, reference(x, w, b), 1e-4, 1e-4 * std::sqrt(static_cast<double>(K))))
            << "M=" << M << " N=" << N << " K=" << K << " bias=" << with_bias;
      }
    }
  }
}

// Each instruction set's kernel on its own (the dispatcher runs only the widest one this CPU has).
TEST(SmallBatchDense, EveryKernelThisCpuRunsMatchesTheReference) {
  torch::manual_seed(9);
  int ran = 0;
  for (auto [name, fn] : {std::pair{"avx2", dense_kernel::rows_avx2()}, std::pair{"avx512", dense_kernel::rows_avx512()}}) {
    if (!fn) continue;
    ++ran;
    for (int64_t M : {1, 2, 3, 4, 5, 8, 9, 16}) {
      for (auto [N, K] : std::vector<std::pair<int64_t, int64_t>>{{1, 8}, {7, 5}, {13, 33}, {70, 768}}) {
        auto x = torch::randn({M, K});
        auto w = torch::randn({N, K});
        auto b = torch::randn({N});
        auto y = torch::full({M, N}, std::nanf(""));
        // Two column ranges, as two threads would split them.
        fn(x.data_ptr<float>(), M, K, w.data_ptr<float>(), b.data_ptr<float>(), y.data_ptr<float>(), N, 0, N / 2);
        fn(x.data_ptr<float>(), M, K, w.data_ptr<float>(), b.data_ptr<float>(), y.data_ptr<float>(), N, N / 2, N);
        EXPECT_TRUE(torch::allclose(y, reference(x, w, b), 1e-4, 1e-4 * std::sqrt(static_cast<double>(K))))
            << name << " M=" << M << " N=" << N << " K=" << K;
      }
    }
  }
#if defined(__AVX2__)
  EXPECT_GE(ran, 1) << "an AVX2 build must have the AVX2 kernel";
#endif
}

TEST(SmallBatchDense, RowResultsDoNotDependOnTheBatch) {
  torch::manual_seed(3);
  auto x = torch::randn({9, 200});
  auto w = torch::randn({77, 200});
  auto b = torch::randn({77});
  auto all = small_batch_dense(x, w, b);
  for (int64_t m = 0; m < 9; ++m) {
    EXPECT_TRUE(torch::equal(small_batch_dense(x.narrow(0, m, 1), w, b), all.narrow(0, m, 1))) << "row " << m;
  }
  EXPECT_TRUE(torch::equal(small_batch_dense(x.narrow(0, 2, 5), w, b), all.narrow(0, 2, 5)));
}

TEST(SmallBatchDense, KeepsLeadingDimensionsAndAcceptsStridedInput) {
  torch::manual_seed(5);
  auto x = torch::randn({3, 2, 40}).transpose(0, 1);  // not contiguous
  auto w = torch::randn({12, 40});
  auto y = small_batch_dense(x, w);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 3, 12}));
  EXPECT_TRUE(torch::allclose(y, reference(x.reshape({-1, 40}), w, {}).view({2, 3, 12}), 1e-4, 1e-3));
}

// The kernel's file must be compiled with OpenMP, or at::parallel_for runs serially in it.
TEST(SmallBatchDense, ParallelRegionsGetEveryThread) {
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  EXPECT_EQ(dense_parallel_width(), 2);
  at::set_num_threads(before);
}

TEST(SmallBatchDense, RejectsWhatItCannotRun) {
  auto w = torch::randn({4, 8});
  EXPECT_THROW(small_batch_dense(torch::randn({2, 8}, torch::kFloat64), w), std::exception);
  EXPECT_THROW(small_batch_dense(torch::randn({2, 7}), w), std::exception);
  EXPECT_THROW(small_batch_dense(torch::randn({2, 8}), w.t()), std::exception);  // W not contiguous
  EXPECT_THROW(small_batch_dense(torch::randn({2, 8}), w, torch::randn({3})), std::exception);
}

TEST(Dense, RoutesLongInputsAndOtherDtypesToTorchLinear) {
  torch::manual_seed(11);
  auto w = torch::randn({24, 32});
  auto b = torch::randn({24});
  auto x = torch::randn({kSmallBatchMaxRows + 5, 32});  // prefill-sized
  EXPECT_TRUE(torch::allclose(dense(x, w, b), torch::linear(x, w, b), 1e-5, 1e-5));
  auto xd = x.to(torch::kFloat64), wd = w.to(torch::kFloat64), bd = b.to(torch::kFloat64);
  EXPECT_TRUE(torch::equal(dense(xd.narrow(0, 0, 2), wd, bd), torch::linear(xd.narrow(0, 0, 2), wd, bd)));
  auto xs = x.narrow(0, 0, 4);
  EXPECT_TRUE(torch::equal(dense(xs, w, b), small_batch_dense(xs, w, b)));
}

// Inside a decode step every row count takes the small-batch kernel (either GEMM choice), so a
// verify step's 40 rows give each row the bits it gets in a step of its own; outside, 40 rows are
// a prefill and go to MKL.
TEST(Dense, ADecodeStepsRowsAreTheSameInAnyRowCount) {
  torch::manual_seed(13);
  auto w = torch::randn({72, 96}), b = torch::randn({72});
  // 301 rows: three passes over W (128 rows each, the last 45), none a multiple of the row tile.
  auto x = torch::randn({301, 96});
  for (const CpuGemm gemm : {CpuGemm::kMkl, CpuGemm::kOneDnn}) {
    torch::Tensor all;
    {
      const DecodeScope decoding;
      all = dense(x, w, b, gemm);
      for (int64_t m : {0, 17, 39, 127, 128, 300})
        EXPECT_TRUE(torch::equal(dense(x.narrow(0, m, 1), w, b, gemm), all.narrow(0, m, 1))) << m;
      EXPECT_TRUE(torch::equal(dense(x.narrow(0, 3, 20), w, b, gemm), all.narrow(0, 3, 20)));
      EXPECT_TRUE(torch::equal(dense(x.narrow(0, 100, 150), w, b, gemm), all.narrow(0, 100, 150)));
    }
    EXPECT_FALSE(DecodeScope::active());
    EXPECT_TRUE(torch::equal(all, small_batch_dense(x, w, b)));
    EXPECT_TRUE(torch::allclose(all, reference(x, w, b), 1e-4, 1e-3));
  }
  EXPECT_TRUE(torch::equal(dense(x, w, b), torch::linear(x, w, b)));
}

TEST(Dense, OneDnnMatchesTheReferenceAndRoutesOnlyLongInputs) {
  torch::manual_seed(12);
  for (auto [M, N, K] : {std::tuple<int64_t, int64_t, int64_t>{kSmallBatchMaxRows + 1, 40, 96}, {300, 72, 768}, {64, 33, 3072}}) {
    auto w = torch::randn({N, K}), b = torch::randn({N}), x = torch::randn({M, K});
    const auto ref = reference(x, w, b);
    const double atol = 1e-4 * std::sqrt(static_cast<double>(K));
    EXPECT_TRUE(torch::allclose(onednn_dense(x, w, b), ref, 1e-4, atol)) << M << "x" << N << "x" << K;
    EXPECT_TRUE(torch::allclose(onednn_dense(x, w), reference(x, w, {}), 1e-4, atol)) << "no bias";
    EXPECT_TRUE(torch::allclose(dense(x.view({M, 1, K}), w, b, CpuGemm::kOneDnn), ref.view({M, 1, N}), 1e-4, atol));
  }
  auto w = torch::randn({24, 32}), b = torch::randn({24});
  auto xs = torch::randn({4, 32});  // decode-sized rows stay on the small-batch kernel
  EXPECT_TRUE(torch::equal(dense(xs, w, b, CpuGemm::kOneDnn), small_batch_dense(xs, w, b)));
  auto xd = torch::randn({40, 32}, torch::kFloat64);  // only fp32 goes to oneDNN
  EXPECT_TRUE(torch::equal(dense(xd, w.to(torch::kFloat64), {}, CpuGemm::kOneDnn), torch::linear(xd, w.to(torch::kFloat64))));
  EXPECT_THROW(onednn_dense(torch::randn({40, 31}), w), std::exception);
}

TEST(Dense, CpuGemmNames) {
  EXPECT_EQ(cpu_gemm_from_name("mkl"), CpuGemm::kMkl);
  EXPECT_EQ(cpu_gemm_from_name("onednn"), CpuGemm::kOneDnn);
  try {
    cpu_gemm_from_name("blis");
    FAIL();
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("unknown CPU GEMM 'blis' (use mkl or onednn)"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kvserve
