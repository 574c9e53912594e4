// Fp8Weight (backend/quantization/fp8_weight.h): e4m3 weights with a scale per output channel and
// activations quantized per token, multiplied by at::_scaled_mm, against fp64 references that decode
// the e4m3 bit patterns here (on the CPU, and on a CUDA device when there is one).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

#include "backend/quantization/fp8_weight.h"
#include "backend/quantization/linear_weight.h"
#include "backend/quantization/weight_quantization.h"
#include "common/check.h"

namespace kvserve {
namespace {

std::vector<torch::Device> devices() {
  std::vector<torch::Device> d{torch::kCPU};
  if (torch::cuda::is_available()) d.emplace_back(torch::kCUDA);
  return d;
}

// An e4m3fn byte's value: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal;
// 0x7F / 0xFF are NaN.
double e4m3_value(uint8_t b) {
  const int sign = b >> 7, e = (b >> 3) & 0xF, m = b & 0x7;
  if (e == 15 && m == 7) return std::nan("");
  const double mag = e == 0 ? m * std::ldexp(1.0, -9) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
  return sign ? -mag : mag;
}

// fp8 values as fp64 through the bit patterns.
torch::Tensor decode(const torch::Tensor& q) {
  const auto bits = q.cpu().contiguous().view(torch::kUInt8);
  auto out = torch::empty(bits.sizes(), torch::kFloat64);
  const auto* b = bits.data_ptr<uint8_t>();
  auto* o = out.data_ptr<double>();
  for (int64_t i = 0; i < bits.numel(); ++i) o[i] = e4m3_value(b[i]);
  return out;
}

// Every value is the nearest e4m3 step of value / scale: within half a step (2^-4 of it, or 2^-10 in the
// subnormal range) of it.
void expect_rounded(const torch::Tensor& q, const torch::Tensor& scale, const torch::Tensor& x, const std::string& what) {
  const auto v = decode(q);
  const auto want = x.cpu().to(torch::kFloat64) / scale.cpu().to(torch::kFloat64);
  const auto bound = want.abs() * std::ldexp(1.0, -4) + std::ldexp(1.0, -10);
  EXPECT_TRUE(((v - want).abs() <= bound).all().item<bool>()) << what;
  // The largest value of each row lands on e4m3's largest finite value.
  EXPECT_TRUE(torch::allclose(v.abs().amax({1}), torch::full({v.size(0)}, 448.0, torch::kFloat64))) << what;
}

TEST(Fp8Weight, EachRowGetsItsOwnScale) {
  torch::manual_seed(1);
  for (const auto& dev : devices()) {
    // Rows spanning six orders of magnitude: a per-channel scale keeps each one's precision.
    const auto w = torch::randn({32, 48}, torch::TensorOptions().device(dev)) *
                   torch::pow(10.0, torch::arange(32, torch::TensorOptions().device(dev)).remainder(7) - 3).unsqueeze(1);
    const Fp8Weight f = Fp8Weight::quantize(w, "w");
    ASSERT_EQ(f.rows(), 32);
    ASSERT_EQ(f.cols(), 48);
    EXPECT_EQ(f.bytes(), 32 * 48 + 32 * 4);
    EXPECT_EQ(f.values().scalar_type(), torch::kFloat8_e4m3fn);
    const auto amax = w.abs().amax({1}).to(torch::kFloat32) / 448.0;
    EXPECT_TRUE(torch::equal(f.scales().squeeze(0).cpu(), amax.cpu())) << dev;
    expect_rounded(f.values(), f.scales().t(), w, "weights on " + dev.str());
    const auto deq = f.dequantize(torch::kFloat64).cpu();
    EXPECT_TRUE(torch::allclose(deq, decode(f.values()) * f.scales().t().cpu().to(torch::kFloat64))) << dev;
    const auto ids = torch::tensor({3, 0, 31}, torch::TensorOptions().dtype(torch::kInt64).device(dev));
    EXPECT_TRUE(torch::equal(f.dequantize_rows(ids, torch::kFloat32).cpu(), f.dequantize(torch::kFloat32).cpu().index_select(0, ids.cpu())));
  }
}

// y = x Wᵀ + b through _scaled_mm equals the fp64 product of the two fp8 operands (decoded from their
// bits) times their scales; CUDA writes the product in bfloat16.
TEST(Fp8Weight, ProductEqualsFp64OverTheFp8Operands) {
  torch::manual_seed(2);
  for (const auto& dev : devices()) {
    const auto opt = torch::TensorOptions().device(dev);
    const Fp8Weight f = Fp8Weight::quantize(torch::randn({48, 64}, opt), "w");
    const auto b = torch::randn({48}, opt);
    const auto wref = decode(f.values()) * f.scales().t().cpu().to(torch::kFloat64);
    for (int64_t M : {1, 3, 17}) {
      auto x = torch::randn({M, 64}, opt);
      x[0] *= 0;  // a row of zeros stays zero
      torch::Tensor sx;
      const auto xq = fp8_quantize_rows(x, sx);
      ASSERT_EQ(sx.sizes(), (std::vector<int64_t>{M, 1}));
      if (M > 1) expect_rounded(xq.narrow(0, 1, M - 1), sx.narrow(0, 1, M - 1), x.narrow(0, 1, M - 1), "activations");
      const auto ref = torch::matmul(decode(xq) * sx.cpu().to(torch::kFloat64), wref.t()) + b.cpu().to(torch::kFloat64);
      const auto y = f.matmul(x, b);
      ASSERT_EQ(y.sizes(), (std::vector<int64_t>{M, 48}));
      EXPECT_EQ(y.scalar_type(), torch::kFloat32);
      const double tol = dev.is_cuda() ? 1e-2 : 1e-5;  // bfloat16 output on CUDA
      const double err = ((y.cpu().to(torch::kFloat64) - ref).abs() / (ref.abs() + 1)).max().item<double>();
      EXPECT_LT(err, tol) << dev << " M=" << M;
      EXPECT_TRUE(torch::allclose(y[0].cpu(), b.cpu(), 0, 1e-2)) << dev;
      // [..., K] inputs keep their leading dimensions; 16-bit inputs give 16-bit outputs.
      EXPECT_EQ(f.matmul(x.view({M, 1, 64})).sizes(), (std::vector<int64_t>{M, 1, 48}));
      EXPECT_EQ(f.matmul(x.to(torch::kBFloat16)).scalar_type(), torch::kBFloat16);
    }
  }
}

// A fused projection's rows keep their scales: stacking equals quantizing the stacked matrix.
TEST(Fp8Weight, StackingKeepsEachRowsScale) {
  torch::manual_seed(3);
  const auto a = torch::randn({16, 32}), b = torch::randn({32, 32}) * 100;
  const Fp8Weight s = Fp8Weight::stack({Fp8Weight::quantize(a, "a"), Fp8Weight::quantize(b, "b")});
  const Fp8Weight whole = Fp8Weight::quantize(torch::cat({a, b}), "ab");
  EXPECT_TRUE(torch::equal(s.values().view(torch::kUInt8), whole.values().view(torch::kUInt8)));
  EXPECT_TRUE(torch::equal(s.scales(), whole.scales()));
  const LinearWeight lw = LinearWeight::stack({LinearWeight(Fp8Weight::quantize(a, "a")), LinearWeight(Fp8Weight::quantize(b, "b"))});
  ASSERT_TRUE(lw.is_fp8());
  EXPECT_FALSE(lw.quantized());
  EXPECT_EQ(lw.format(), "float8_e4m3fn");
  EXPECT_EQ(lw.rows(), 48);
  EXPECT_EQ(lw.bytes(), 48 * 32 + 48 * 4);
  const auto x = torch::randn({5, 32});
  EXPECT_TRUE(torch::allclose(linear(x, lw), whole.matmul(x), 1e-6, 1e-6));
}

// On CUDA a product's activations are quantized by one fused kernel: its bytes and scales equal the
// torch op chain's (the CPU's path) for every activation dtype, row strides and rows of zeros.
TEST(Fp8Weight, FusedActivationQuantizationEqualsTheTorchChain) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs a CUDA device";
  torch::manual_seed(5);
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    for (const int64_t M : {1, 7, 64}) {
      for (const int64_t K : {16, 1000, 4096}) {
        auto wide = torch::randn({M, K + 24}, torch::TensorOptions().device(torch::kCUDA)) *
                    torch::pow(10.0, torch::arange(M, torch::TensorOptions().device(torch::kCUDA)).remainder(5) - 2).unsqueeze(1);
        wide[0].zero_();
        const auto x = wide.to(dtype).narrow(1, 3, K);  // rows K + 24 apart
        torch::Tensor s;
        const auto q = fp8_quantize_rows(x, s);
        const auto xf = x.to(torch::kFloat32);
        const auto amax = xf.abs().amax({1}, true);
        const auto ref_s = torch::where(amax > 0, amax / 448.0, torch::ones_like(amax));
        const auto ref_q = (xf / ref_s).clamp(-448.0, 448.0).to(torch::kFloat8_e4m3fn);
        ASSERT_EQ(q.sizes(), x.sizes());
        EXPECT_TRUE(torch::equal(s.cpu(), ref_s.cpu())) << dtype << " " << M << "x" << K;
        EXPECT_TRUE(torch::equal(q.view(torch::kUInt8).cpu(), ref_q.view(torch::kUInt8).cpu())) << dtype << " " << M << "x" << K;
      }
    }
  }
}

TEST(Fp8Weight, DimensionsThatAreNotMultiplesOf16AreNamed) {
  EXPECT_TRUE(Fp8Weight::fits(16, 4096));
  EXPECT_FALSE(Fp8Weight::fits(24, 32));
  EXPECT_FALSE(Fp8Weight::fits(32, 40));
  try {
    Fp8Weight::quantize(torch::randn({32, 40}), "model.layers.0.mlp.down_proj.weight");
    FAIL() << "a 32 x 40 fp8 weight was accepted";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.0.mlp.down_proj.weight"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("multiples of 16"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(weight_quantization_is_fp8("FP8"));
  EXPECT_FALSE(weight_quantization_is_fp8("int8"));
}

}  // namespace
}  // namespace kvserve
