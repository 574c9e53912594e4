// Int8Weight (backend/quantization/int8_weight.h): int8 codes with a float32 scale per group of
// input columns, against references built here in fp64 from the float weight and the stored scales.
// On the CPU the product is the expansion's GEMM; on a CUDA device (when there is one) kvserve's
// few-row kernel (backend/cuda/int8_gemv.cu) and, past KVSERVE_INT8_DENSE_ROWS rows, the expansion.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "backend/quantization/int8_weight.h"
#include "backend/quantization/linear_weight.h"
#include "backend/quantization/quantized_weight.h"
#include "backend/quantization/weight_quantization.h"
#include "common/check.h"
#include "ggml.h"

namespace kvserve {
namespace {

std::vector<torch::Device> devices() {
  std::vector<torch::Device> d{torch::kCPU};
  if (torch::cuda::is_available()) d.emplace_back(torch::kCUDA);
  return d;
}

// Every group's scale is its largest magnitude / 127 (fp64, rounded once to float32), every code an
// integer in [-127, 127] within half a step of its weight, and each nonzero group reaches +-127.
TEST(Int8Weight, EveryGroupIsItsLargestMagnitudeOver127) {
  torch::manual_seed(1);
  for (const auto& dev : devices()) {
    for (int64_t K : {256, 192, 96}) {
      const int64_t N = 24, g = Int8Weight::group_for(K);
      // Rows over five orders of magnitude, and one row of zeros (scale 0, codes 0).
      auto w = torch::randn({N, K}) * torch::pow(10.0, torch::arange(N).remainder(5) - 2).unsqueeze(1);
      w[5].zero_();
      const Int8Weight f = Int8Weight::quantize(w.to(dev), "w");
      ASSERT_EQ(f.rows(), N);
      ASSERT_EQ(f.cols(), K);
      EXPECT_EQ(g, K % 128 == 0 ? 128 : K % 64 == 0 ? 64 : 32);
      EXPECT_EQ(f.group(), g);
      EXPECT_EQ(f.bytes(), N * K + N * (K / g) * 4) << dev;
      ASSERT_EQ(f.codes().scalar_type(), torch::kInt8);
      ASSERT_EQ(f.scales().sizes(), (std::vector<int64_t>{N, K / g}));
      const auto w64 = w.to(torch::kFloat64).reshape({N, K / g, g});
      const auto s_ref = (w64.abs().amax({2}) / 127.0).to(torch::kFloat32);
      EXPECT_TRUE(torch::equal(f.scales().cpu(), s_ref)) << dev << " K=" << K;
      const auto s = f.scales().cpu().to(torch::kFloat64).unsqueeze(2);
      const auto q = f.codes().cpu().to(torch::kFloat64).reshape({N, K / g, g});
      EXPECT_TRUE((q.abs() <= 127).all().item<bool>());
      EXPECT_TRUE(((q * s - w64).abs() <= s * (0.5 + 1e-6) + 1e-30).all().item<bool>()) << dev << " K=" << K;
      const auto reach = q.abs().amax({2});
      EXPECT_TRUE((reach.narrow(0, 0, 5) == 127).all().item<bool>() && (reach[5] == 0).all().item<bool>()) << dev;
      // The expansion is code * scale, rounded once to the asked dtype.
      EXPECT_TRUE(torch::equal(f.dequantize(torch::kFloat64).cpu(), (q * s).reshape({N, K}))) << dev;
      const auto ids = torch::tensor({3, 0, 5}, torch::TensorOptions().dtype(torch::kInt64).device(dev));
      EXPECT_TRUE(torch::equal(f.dequantize_rows(ids, torch::kFloat32).cpu(),
                               f.dequantize(torch::kFloat32).cpu().index_select(0, ids.cpu())));
    }
  }
}

// y = x Wᵀ + b equals fp64 over the dequantized weight, for row counts the CUDA kernel serves in one
// pass (1, 2, 3, 5, 8), in several (9, 16) and by the expansion (17, 40), in each activation dtype;
// and for an activation that starts off a 16-byte boundary.
TEST(Int8Weight, ProductEqualsFp64OverTheDequantizedWeight) {
  torch::manual_seed(2);
  for (const auto& dev : devices()) {
    const auto opt = torch::TensorOptions().device(dev);
    const int64_t N = 70, K = 320;  // N not a multiple of the kernel's 8 rows a block; K of 64, not 128
    const Int8Weight f = Int8Weight::quantize(torch::randn({N, K}, opt), "w");
    const auto wref = f.dequantize(torch::kFloat64).cpu();
    const auto b = torch::randn({N}, opt);
    std::vector<torch::Dtype> dtypes{torch::kFloat32};
    if (dev.is_cuda()) dtypes.insert(dtypes.end(), {torch::kBFloat16, torch::kFloat16});
    for (const torch::Dtype dtype : dtypes) {
      for (int64_t M : {1, 2, 3, 5, 8, 9, 16, 17, 40}) {
        const auto x = torch::randn({M, K}, opt).to(dtype);
        const auto x64 = x.cpu().to(torch::kFloat64);
        const auto ref = torch::matmul(x64, wref.t()) + b.cpu().to(torch::kFloat64);
        const auto y = f.matmul(x, b);
        ASSERT_EQ(y.sizes(), (std::vector<int64_t>{M, N}));
        EXPECT_EQ(y.scalar_type(), dtype);
        // In units of sum |x| |w| (+ 1): 16-bit outputs, and past 16 rows on CUDA the weight expanded
        // to the 16-bit dtype, round twice at most.
        const double tol = dtype == torch::kBFloat16 ? 1e-2 : dtype == torch::kFloat16 ? 2e-3 : 1e-5;
        const auto scale = torch::matmul(x64.abs(), wref.abs().t()) + ref.abs() + 1;
        const double err = ((y.cpu().to(torch::kFloat64) - ref).abs() / scale).max().item<double>();
        EXPECT_LT(err, tol) << dev << " " << dtype << " M=" << M;
        EXPECT_EQ(f.matmul(x.view({M, 1, K})).sizes(), (std::vector<int64_t>{M, 1, N}));
      }
      // A contiguous view 4 bytes into its storage.
      const auto flat = torch::randn({3 * K + 1}, opt).to(dtype);
      const auto x = flat.narrow(0, 1, 3 * K).view({3, K});
      const auto x64 = x.cpu().to(torch::kFloat64);
      const auto ref = torch::matmul(x64, wref.t());
      const double tol = dtype == torch::kFloat32 ? 1e-5 : 1e-2;
      const auto scale = torch::matmul(x64.abs(), wref.abs().t()) + ref.abs() + 1;
      EXPECT_LT(((f.matmul(x).cpu().to(torch::kFloat64) - ref).abs() / scale).max().item<double>(), tol) << dev << " " << dtype;
    }
  }
}

// A fused projection: stacking quantized parts equals quantizing the stacked rows (rows and their
// groups are quantized on their own), through LinearWeight too.
TEST(Int8Weight, StackingEqualsQuantizingTheStackedRows) {
  torch::manual_seed(3);
  for (const auto& dev : devices()) {
    const auto a = torch::randn({16, 128}).to(dev), b = torch::randn({24, 128}).to(dev);
    const Int8Weight whole = Int8Weight::quantize(torch::cat({a, b}), "ab");
    const LinearWeight lw =
        LinearWeight::stack({LinearWeight(Int8Weight::quantize(a, "a")), LinearWeight(Int8Weight::quantize(b, "b"))});
    ASSERT_TRUE(lw.is_int8());
    EXPECT_EQ(lw.rows(), 40);
    EXPECT_EQ(lw.cols(), 128);
    EXPECT_EQ(lw.format(), "int8_g128");
    EXPECT_EQ(lw.bytes(), whole.bytes());
    EXPECT_TRUE(torch::equal(lw.int8->codes().cpu(), whole.codes().cpu()));
    EXPECT_TRUE(torch::equal(lw.int8->scales().cpu(), whole.scales().cpu()));
    const auto x = torch::randn({4, 128}).to(dev);
    EXPECT_TRUE(torch::allclose(linear(x, lw).cpu(), whole.matmul(x).cpu(), 1e-6, 1e-6)) << dev;
    // Mixed with a dense part the fused weight is dense, in the dense part's dtype: the int8 rows
    // expanded (a GGUF on CUDA whose q projection is Q8_0 and whose k projection is dequantized).
    const auto bh = b.to(torch::kBFloat16);
    const LinearWeight mixed = LinearWeight::stack({LinearWeight(Int8Weight::quantize(a, "a")), LinearWeight(bh)});
    EXPECT_FALSE(mixed.is_int8());
    EXPECT_EQ(mixed.dense.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(mixed.dense.narrow(0, 16, 24).cpu(), bh.cpu()));
    EXPECT_TRUE(torch::equal(mixed.dense.narrow(0, 0, 16).cpu(),
                             Int8Weight::quantize(a, "a").dequantize(torch::kBFloat16).cpu()));
  }
}

// A GGUF's Q8_0 tensor as Int8Weight (how CUDA serves it): groups of 32 whose values are ggml's
// dequantization bit for bit, for one part and for parts stacked as a fused projection.
TEST(Int8Weight, Q8_0BlocksKeepTheirValuesBitForBit) {
  torch::manual_seed(4);
  const QuantizedWeight a = QuantizedWeight::quantize(torch::randn({24, 96}) * 0.05, GGML_TYPE_Q8_0, "a");
  const QuantizedWeight b = QuantizedWeight::quantize(torch::randn({8, 96}) * 3, GGML_TYPE_Q8_0, "b");
  for (const QuantizedWeight& q : {a, QuantizedWeight::stack({a, b})}) {
    const Int8Weight f = Int8Weight::from_q8_0(q);
    EXPECT_EQ(f.group(), 32);
    EXPECT_EQ(f.rows(), q.rows());
    EXPECT_EQ(f.bytes(), q.rows() * 96 + q.rows() * 3 * 4);
    EXPECT_TRUE(torch::equal(f.dequantize(torch::kFloat32), q.dequantize()));
    const auto x = torch::randn({3, 96});
    const auto ref = torch::matmul(x.to(torch::kFloat64), q.dequantize().to(torch::kFloat64).t());
    EXPECT_LT((f.matmul(x).to(torch::kFloat64) - ref).abs().max().item<double>(), 1e-5);
    EXPECT_TRUE(torch::equal(f.to(torch::kCPU).codes(), f.codes()));
  }
  try {
    Int8Weight::from_q8_0(QuantizedWeight::quantize(torch::randn({8, 64}), GGML_TYPE_Q4_0, "q4"));
    FAIL() << "Q4_0 blocks were taken as int8";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("q4_0"), std::string::npos) << e.what();
  }
}

TEST(Int8Weight, ShapesOffTheGroupsAreNamed) {
  EXPECT_TRUE(Int8Weight::fits(1, 32));
  EXPECT_TRUE(Int8Weight::fits(4096, 14336));
  EXPECT_FALSE(Int8Weight::fits(16, 48));
  EXPECT_EQ(Int8Weight::group_for(14336), 128);
  EXPECT_EQ(Int8Weight::group_for(576), 64);
  EXPECT_EQ(Int8Weight::group_for(1568), 32);
  try {
    Int8Weight::quantize(torch::randn({16, 40}), "model.layers.0.mlp.down_proj.weight");
    FAIL() << "a 16 x 40 int8 weight was accepted";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.0.mlp.down_proj.weight"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("multiple of 32"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(weight_quantization_is_int8("INT8"));
  EXPECT_FALSE(weight_quantization_is_int8("q8_0"));
}

// The load-time probe passes wherever the product runs; on a GPU it is what `--quantization int8`
// checks before loading.
TEST(Int8Weight, DeviceProbePasses) {
  for (const auto& dev : devices()) EXPECT_NO_THROW(Int8Weight::check_device(dev)) << dev;
}

}  // namespace
}  // namespace kvserve
