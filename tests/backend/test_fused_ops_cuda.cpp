// The fused elementwise ops (backend/kernels/fused_ops.h): on CUDA, each kernel against an fp64 reference
// and against the torch op chain it replaces on the same device; on CPU (and with the kernels off)
// the chain itself. The kernel tests skip without a CUDA device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "backend/kernels/fused_ops.h"
#include "backend/model/rope.h"
#include "cache_manager/paged_attention_cuda.h"

namespace kvserve {
namespace {

// KVSERVE_FUSED_OPS=0 in the environment would turn the kernels off; this binary tests them, so it
// turns them on before any op reads the switch.
const bool kKernelsOn = [] { return setenv("KVSERVE_FUSED_OPS", "1", 1) == 0; }();

// Runs body at each kernel level (1: the fused kernels, 2: their vectorized variants), then restores
// the level the process had.
template <typename F> void at_each_level(F body) {
  const int was = fused::level();
  for (int level : {1, 2}) {
    fused::set_level(level);
    body("level " + std::to_string(level) + " ");
  }
  fused::set_level(was);
}

#define SKIP_WITHOUT_GPU()                                                              \
  do {                                                                                  \
    if (!fused::compiled()) GTEST_SKIP() << "built without CUDA kernels";               \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";                 \
  } while (0)

const std::vector<torch::ScalarType> kDtypes = {torch::kFloat32, torch::kBFloat16, torch::kFloat16};

// Relative tolerance of one rounding step of the dtype (the kernels and the chains may differ by one
// rounding where RMSNorm's fp32 sum is accumulated in another order).
double ulp(torch::ScalarType t) { return t == torch::kFloat32 ? 1e-6 : t == torch::kBFloat16 ? 1.0 / 128 : 1.0 / 1024; }

// max |a - b| / (|b| + floor), elementwise, as a double.
double rel_err(const torch::Tensor& a, const torch::Tensor& b, double floor) {
  auto ad = a.to(torch::kCPU, torch::kFloat64), bd = b.to(torch::kCPU, torch::kFloat64);
  return ((ad - bd).abs() / (bd.abs() + floor)).max().item<double>();
}

// The fp64 RMSNorm of x (+ delta), both rounded to x's dtype first as the model holds them.
torch::Tensor norm_ref(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  auto xd = x.to(torch::kCPU, torch::kFloat64);
  auto var = xd.pow(2).mean(-1, true);
  return w.to(torch::kCPU, torch::kFloat64) * (xd * torch::rsqrt(var + eps));
}

TEST(FusedOpsCuda, RmsNormMatchesTheChainAndFp64) {
  SKIP_WITHOUT_GPU();
  ASSERT_TRUE(kKernelsOn);
  torch::manual_seed(1);
  at_each_level([](const std::string& lv) {
  for (auto dt : kDtypes) {
    // 16384 and 40000 columns hold 2-8 vectors per thread in the vectorized kernel (fp32 40000: scalar).
    for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
             {1, 4096}, {7, 64}, {64, 1000}, {3, 33}, {2, 16384}, {2, 40000}}) {
      auto opts = torch::TensorOptions().dtype(dt).device(torch::kCUDA);
      auto x = (torch::randn({rows, cols}) * 3).to(opts);
      auto w = (torch::rand({cols}) + 0.5).to(opts);
      auto got = fused::rms_norm(x, w, 1e-5);
      auto chain = w * (x.to(torch::kFloat32) * torch::rsqrt(x.to(torch::kFloat32).pow(2).mean(-1, true) + 1e-5))
                           .to(dt);
      const std::string where = lv + c10::toString(dt) + " " + std::to_string(rows) + "x" + std::to_string(cols);
      EXPECT_LE(rel_err(got, chain, 1e-3), 2 * ulp(dt)) << where;
      EXPECT_LE(rel_err(got, norm_ref(x, w, 1e-5), 1e-2), 4 * ulp(dt)) << where;
      // A strided view of rows (as a narrow of a wider activation; misaligned, so the scalar kernel)
      // gives the same up to the order of the sum of squares.
      auto wide = torch::zeros({rows, cols + 5}, opts);
      wide.narrow(1, 2, cols).copy_(x);
      EXPECT_LE(rel_err(fused::rms_norm(wide.narrow(1, 2, cols), w, 1e-5), got, 1e-3), 2 * ulp(dt)) << where;
    }
  }
  });
}

TEST(FusedOpsCuda, AddRmsNormWritesTheSumAndNormalisesIt) {
  SKIP_WITHOUT_GPU();
  torch::manual_seed(2);
  at_each_level([](const std::string& lv) {
  for (auto dt : kDtypes) {
    for (int64_t rows : {1, 5, 32}) {
      const int64_t cols = 2048;
      auto opts = torch::TensorOptions().dtype(dt).device(torch::kCUDA);
      auto x = torch::randn({rows, cols}).to(opts), delta = torch::randn({rows, cols}).to(opts);
      auto w = (torch::rand({cols}) + 0.5).to(opts);
      auto [sum, normed] = fused::add_rms_norm(x, delta, w, 1e-6);
      const std::string where = lv + c10::toString(dt) + " rows " + std::to_string(rows);
      // The sum is the dtype's own add, bit for bit.
      EXPECT_TRUE(torch::equal(sum, x + delta)) << where;
      EXPECT_LE(rel_err(normed, fused::rms_norm(x + delta, w, 1e-6), 1e-3), 2 * ulp(dt)) << where;
      EXPECT_LE(rel_err(normed, norm_ref(x + delta, w, 1e-6), 1e-2), 4 * ulp(dt)) << where;
    }
  }
  });
}

TEST(FusedOpsCuda, RopeQkvRotatesQAndKAndCopiesV) {
  SKIP_WITHOUT_GPU();
  torch::manual_seed(3);
  at_each_level([](const std::string& lv) {
  for (auto dt : kDtypes) {
    // {4, 2, 8}: whole vectors for fp32 only; {3, 1, 6}: for none.
    for (auto [H, KV, D] :
         std::vector<std::tuple<int64_t, int64_t, int64_t>>{{32, 8, 128}, {4, 2, 64}, {4, 2, 8}, {3, 1, 6}}) {
      const int64_t N = 9;
      auto opts = torch::TensorOptions().dtype(dt).device(torch::kCUDA);
      // A projection with a bias column block past the heads: rows strided wider than (H + 2 KV) D.
      auto wide = torch::randn({N, (H + 2 * KV) * D + 8}).to(opts);
      auto qkv = wide.narrow(1, 0, (H + 2 * KV) * D);
      auto theta = torch::rand({N, 1, D}) * 6.28;
      RopeAngles a{torch::cos(theta).to(opts), torch::sin(theta).to(opts)};
      auto [q, k, v] = fused::rope_qkv(qkv, a, H, KV, D);
      auto rq = Rope::apply(qkv.narrow(1, 0, H * D).view({N, H, D}), a);
      auto rk = Rope::apply(qkv.narrow(1, H * D, KV * D).view({N, KV, D}), a);
      const std::string where = lv + c10::toString(dt) + " H" + std::to_string(H) + " D" + std::to_string(D);
      ASSERT_TRUE(q.is_contiguous() && k.is_contiguous() && v.is_contiguous()) << where;
      // The same three roundings as the chain (no fused multiply-add): equal.
      EXPECT_TRUE(torch::equal(q, rq)) << where;
      EXPECT_TRUE(torch::equal(k, rk)) << where;
      EXPECT_TRUE(torch::equal(v, qkv.narrow(1, (H + KV) * D, KV * D).view({N, KV, D}))) << where;
      // fp64: x cos + rotate_half(x) sin.
      auto xd = qkv.narrow(1, 0, H * D).view({N, H, D}).to(torch::kCPU, torch::kFloat64);
      auto cd = a.cos.to(torch::kCPU, torch::kFloat64), sd = a.sin.to(torch::kCPU, torch::kFloat64);
      auto rot = torch::cat({-xd.narrow(-1, D / 2, D / 2), xd.narrow(-1, 0, D / 2)}, -1);
      EXPECT_LE((q.to(torch::kCPU, torch::kFloat64) - (xd * cd + rot * sd)).abs().max().item<double>(), 8 * ulp(dt) * 4)
          << where;
    }
  }
  });
}

TEST(FusedOpsCuda, SiluMulMatchesTheChain) {
  SKIP_WITHOUT_GPU();
  torch::manual_seed(4);
  for (auto dt : kDtypes) {
    for (auto [N, I] : std::vector<std::pair<int64_t, int64_t>>{{1, 14336}, {16, 512}, {3, 7}}) {
      auto opts = torch::TensorOptions().dtype(dt).device(torch::kCUDA);
      auto gu = (torch::randn({N, 2 * I}) * 4).to(opts);
      auto got = fused::silu_mul(gu, I);
      auto chain = torch::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I);
      const std::string where = std::string(c10::toString(dt)) + " " + std::to_string(N) + "x" + std::to_string(I);
      EXPECT_LE(rel_err(got, chain, 1e-3), ulp(dt)) << where;
      auto gd = gu.to(torch::kCPU, torch::kFloat64);
      auto ref = gd.narrow(1, 0, I) * torch::sigmoid(gd.narrow(1, 0, I)) * gd.narrow(1, I, I);
      EXPECT_LE(rel_err(got, ref, 1e-2), 3 * ulp(dt)) << where;
    }
  }
}

// Without a CUDA tensor (or with the kernels off) every op is the torch chain itself.
TEST(FusedOps, LevelIsCheckedAndCarriesTheAppendCopy) {
  const int was = fused::level();
  fused::set_level(2);
  EXPECT_EQ(fused::level(), 2);
  EXPECT_TRUE(cuda::append_vectorized());
  fused::set_level(0);
  EXPECT_FALSE(cuda::append_vectorized());
  EXPECT_FALSE(fused::active(torch::zeros({2, 8})));
  EXPECT_THROW(fused::set_level(3), std::exception);
  EXPECT_EQ(fused::level(), 0);
  fused::set_level(was);
}

// At the default CPU level (1) the CPU loops must give the torch chains' bits (test_fused_ops_cpu.cpp
// covers every level).
TEST(FusedOps, OnCpuEveryOpGivesTheTorchChainsBits) {
  torch::manual_seed(5);
  for (auto dt : kDtypes) {
    auto x = torch::randn({4, 64}).to(dt), d = torch::randn({4, 64}).to(dt), w = torch::rand({64}).to(dt);
    EXPECT_FALSE(fused::active(x));
    auto chain = w * (x.to(torch::kFloat32) * torch::rsqrt(x.to(torch::kFloat32).pow(2).mean(-1, true) + 1e-6)).to(dt);
    EXPECT_TRUE(torch::equal(fused::rms_norm(x, w, 1e-6), chain));
    auto [sum, normed] = fused::add_rms_norm(x, d, w, 1e-6);
    EXPECT_TRUE(torch::equal(sum, x + d));
    EXPECT_TRUE(torch::equal(normed, fused::rms_norm(x + d, w, 1e-6)));
    auto gu = torch::randn({3, 16}).to(dt);
    EXPECT_TRUE(torch::equal(fused::silu_mul(gu, 8), torch::silu(gu.narrow(1, 0, 8)) * gu.narrow(1, 8, 8)));
    auto qkv = torch::randn({2, (2 + 2) * 8}).to(dt);
    auto theta = torch::rand({2, 1, 8});
    RopeAngles a{torch::cos(theta).to(dt), torch::sin(theta).to(dt)};
    auto [q, k, v] = fused::rope_qkv(qkv, a, 2, 1, 8);
    EXPECT_TRUE(torch::equal(q, Rope::apply(qkv.narrow(1, 0, 16).view({2, 2, 8}), a)));
    EXPECT_TRUE(torch::equal(k, Rope::apply(qkv.narrow(1, 16, 8).view({2, 1, 8}), a)));
    EXPECT_TRUE(torch::equal(v, qkv.narrow(1, 24, 8).view({2, 1, 8})));
  }
}

}  // namespace
}  // namespace kvserve
