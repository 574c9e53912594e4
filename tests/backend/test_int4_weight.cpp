// Int4Weight (backend/quantization/int4_weight.h): 4-bit groups with a bfloat16 scale and zero in
// libtorch's tinygemm layout, against fp64 references built here from the float weight and the
// stored scales and zeros. On the CPU the codes run libtorch's CPU twin of the kernel; on a CUDA
// device (when there is one) the tinygemm kernel itself, with its own packing of the codes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "backend/quantization/int4_tinygemm_layout.h"
#include "backend/quantization/int4_weight.h"
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

// Scales and zeros [K / group, N] as fp64 [N, K] (each group's value repeated over its columns).
torch::Tensor per_weight(const torch::Tensor& sz, int64_t which, int64_t group) {
  return sz.select(2, which).to(torch::kFloat64).cpu().t().repeat_interleave(group, 1);
}

// The dequantized weight is, for every group of every row, sixteen evenly spaced steps (code - 8) *
// s + z with an integer code in [0, 15], and each weight sits within half a step of its value (plus
// the bfloat16 rounding of the zero, and on CUDA of the dequantized value itself).
TEST(Int4Weight, EveryGroupIsSixteenStepsAroundItsWeights) {
  torch::manual_seed(1);
  for (const auto& dev : devices()) {
    for (int64_t K : {128, 96, 64}) {
      const int64_t N = 32, g = Int4Weight::group_for(K);
      // Rows over five orders of magnitude, and one constant row (a zero step).
      auto w = torch::randn({N, K}) * torch::pow(10.0, torch::arange(N).remainder(5) - 2).unsqueeze(1);
      w[7].fill_(0.25);
      const Int4Weight f = Int4Weight::quantize(w.to(dev), "w");
      ASSERT_EQ(f.rows(), N);
      ASSERT_EQ(f.cols(), K);
      EXPECT_EQ(f.group(), K % 128 == 0 ? 128 : K % 64 == 0 ? 64 : 32);
      EXPECT_EQ(f.bytes(), N * K / 2 + (K / g) * N * 2 * 2) << dev;
      ASSERT_EQ(f.scales_and_zeros().sizes(), (std::vector<int64_t>{K / g, N, 2}));
      EXPECT_EQ(f.scales_and_zeros().scalar_type(), torch::kBFloat16);
      const auto s = per_weight(f.scales_and_zeros(), 0, g), z = per_weight(f.scales_and_zeros(), 1, g);
      const auto deq = f.dequantize(torch::kFloat64).cpu();
      const auto safe = torch::where(s > 0, s, torch::ones_like(s));
      const auto code = (deq - z) / safe + 8;
      const double rel = dev.is_cuda() ? 1.0 / 128 : 1e-6;  // CUDA rounds (q - 8) s + z to bfloat16
      const auto slack = (z.abs() + 8 * s) * rel + 1e-12;
      EXPECT_TRUE(((code - code.round()).abs() * s <= slack).all().item<bool>()) << dev << " K=" << K;
      EXPECT_TRUE((code.round() >= 0).all().item<bool>() && (code.round() <= 15).all().item<bool>()) << dev;
      const auto err = (deq - w.to(torch::kFloat64)).abs();
      EXPECT_TRUE((err <= s / 2 + (z.abs() + 8 * s) / 128 + 1e-12).all().item<bool>()) << dev << " K=" << K;
      EXPECT_TRUE(torch::allclose(deq[7], torch::full({K}, 0.25, torch::kFloat64))) << dev;
      // The steps span the group: its smallest and largest weights land on codes 0 and 15.
      const auto c3 = code.round()[3].reshape({K / g, g});
      EXPECT_TRUE((c3.amin(1) == 0).all().item<bool>() && (c3.amax(1) == 15).all().item<bool>()) << dev;
    }
  }
}

// y = x Wᵀ + b equals the fp64 product with the dequantized weight; CUDA multiplies bfloat16
// activations and writes bfloat16.
TEST(Int4Weight, ProductEqualsFp64OverTheDequantizedWeight) {
  torch::manual_seed(2);
  for (const auto& dev : devices()) {
    const auto opt = torch::TensorOptions().device(dev);
    const Int4Weight f = Int4Weight::quantize(torch::randn({48, 256}, opt), "w");
    const auto wref = f.dequantize(torch::kFloat64).cpu();
    const auto b = torch::randn({48}, opt);
    for (int64_t M : {1, 5, 33, 100}) {  // 100 rows: CUDA expands the weight and runs one bf16 GEMM
      auto x = torch::randn({M, 256}, opt);
      if (dev.is_cuda()) x = x.to(torch::kBFloat16).to(torch::kFloat32);  // exact in the kernel's dtype
      const auto ref = torch::matmul(x.cpu().to(torch::kFloat64), wref.t()) + b.cpu().to(torch::kFloat64);
      const auto y = f.matmul(x, b);
      ASSERT_EQ(y.sizes(), (std::vector<int64_t>{M, 48}));
      EXPECT_EQ(y.scalar_type(), torch::kFloat32);
      const double tol = dev.is_cuda() ? 1e-2 : 1e-5;
      const double err = ((y.cpu().to(torch::kFloat64) - ref).abs() / (ref.abs() + 1)).max().item<double>();
      EXPECT_LT(err, tol) << dev << " M=" << M;
      EXPECT_EQ(f.matmul(x.view({M, 1, 256})).sizes(), (std::vector<int64_t>{M, 1, 48}));
      EXPECT_EQ(f.matmul(x.to(torch::kBFloat16)).scalar_type(), torch::kBFloat16);
    }
  }
}

// A fused projection: stacking quantized parts equals quantizing the stacked rows, through
// LinearWeight too.
TEST(Int4Weight, StackingEqualsQuantizingTheStackedRows) {
  torch::manual_seed(3);
  for (const auto& dev : devices()) {
    const auto opt = torch::TensorOptions().device(dev);
    const auto a = torch::randn({16, 128}, opt), b = torch::randn({32, 128}, opt) * 50;
    const Int4Weight whole = Int4Weight::quantize(torch::cat({a, b}), "ab");
    const LinearWeight lw =
        LinearWeight::stack({LinearWeight(Int4Weight::quantize(a, "a")), LinearWeight(Int4Weight::quantize(b, "b"))});
    ASSERT_TRUE(lw.is_int4());
    EXPECT_FALSE(lw.quantized());
    EXPECT_EQ(lw.format(), "int4_g128");
    EXPECT_EQ(lw.rows(), 48);
    EXPECT_EQ(lw.cols(), 128);
    EXPECT_EQ(lw.bytes(), whole.bytes());
    EXPECT_TRUE(torch::equal(lw.int4->scales_and_zeros(), whole.scales_and_zeros())) << dev;
    EXPECT_TRUE(torch::equal(lw.int4->dequantize(torch::kFloat32), whole.dequantize(torch::kFloat32))) << dev;
    const auto x = torch::randn({3, 128}, opt);
    EXPECT_TRUE(torch::equal(linear(x, lw), whole.matmul(x))) << dev;
    const auto ids = torch::tensor({47, 0}, torch::TensorOptions().dtype(torch::kInt64).device(dev));
    EXPECT_TRUE(torch::equal(lw.lookup(ids, torch::kFloat32), whole.dequantize(torch::kFloat32).index_select(0, ids)));
  }
}

// tinygemm's packing (at::_convert_weight_to_int4pack, as its CUDA kernel lays the words out) written
// out on the host: codes [N, K] -> words [N / 8, K / (16 tiles), 32, tiles / 2].
std::vector<uint32_t> tinygemm_pack(const std::vector<uint8_t>& codes, int64_t N, int64_t K, int tiles) {
  auto byte = [&](int64_t n, int64_t kb) {  // two codes a byte, the even column high
    return static_cast<uint32_t>(codes[n * K + 2 * kb] << 4 | codes[n * K + 2 * kb + 1]);
  };
  const int64_t k_super = K / (tiles * 16);
  std::vector<uint32_t> out(static_cast<size_t>(N / 8 * k_super * 32 * (tiles / 2)));
  for (int64_t nt = 0; nt < N / 8; ++nt)
    for (int64_t ko = 0; ko < k_super; ++ko)
      for (int64_t t = 0; t < 32; ++t)
        for (int inner = 0; inner < tiles; inner += 2) {
          const int64_t n = nt * 8 + t / 4, k0 = (ko * tiles + inner) * 8 + t % 4, k1 = k0 + 8;
          const uint32_t v[4] = {byte(n, k0), byte(n, k0 + 4), byte(n, k1), byte(n, k1 + 4)};
          const uint32_t word = (v[3] & 0xF) << 28 | (v[2] & 0xF) << 24 | (v[1] & 0xF) << 20 | (v[0] & 0xF) << 16 |
                                (v[3] & 0xF0) << 8 | (v[2] & 0xF0) << 4 | (v[1] & 0xF0) | (v[0] & 0xF0) >> 4;
          out[static_cast<size_t>(((nt * k_super + ko) * 32 + t) * (tiles / 2) + inner / 2)] = word;
        }
  return out;
}

// int4_layout::locate (what the CUDA expansion kernel reads) inverts that packing: every nibble of
// every word is the code of the row and column it names, and every code is named once.
TEST(Int4Weight, TheExpansionsLayoutInvertsTinygemmsPacking) {
  torch::manual_seed(4);
  for (int tiles : {2, 4, 8}) {
    const int64_t N = 24, K = tiles * 16 * 3;
    const auto q = torch::randint(0, 16, {N, K}, torch::kInt32);
    std::vector<uint8_t> codes(static_cast<size_t>(N * K));
    for (int64_t i = 0; i < N * K; ++i) codes[static_cast<size_t>(i)] = static_cast<uint8_t>(q.view(-1)[i].item<int>());
    const std::vector<uint32_t> words = tinygemm_pack(codes, N, K, tiles);
    std::vector<int> seen(codes.size(), 0);
    for (size_t w = 0; w < words.size(); ++w)
      for (int i = 0; i < 8; ++i) {
        const auto at = int4_layout::locate(static_cast<int64_t>(w), i, K, tiles);
        ASSERT_TRUE(at.row >= 0 && at.row < N && at.col >= 0 && at.col < K) << tiles << " " << w << " " << i;
        EXPECT_EQ((words[w] >> (4 * i)) & 0xF, codes[static_cast<size_t>(at.row * K + at.col)]) << tiles;
        ++seen[static_cast<size_t>(at.row * K + at.col)];
      }
    for (int c : seen) ASSERT_EQ(c, 1) << tiles;
    // On a GPU, libtorch's own packing kernel writes these words.
    if (torch::cuda::is_available()) {
      const auto hi = q.slice(1, 0, K, 2), lo = q.slice(1, 1, K, 2);
      const auto bytes = hi.bitwise_left_shift(4).bitwise_or(lo).to(torch::kUInt8).contiguous().to(torch::kCUDA);
      const auto got = at::_convert_weight_to_int4pack(bytes, tiles).cpu().contiguous();
      ASSERT_EQ(got.numel(), static_cast<int64_t>(words.size()));
      const auto* g = reinterpret_cast<const uint32_t*>(got.data_ptr<int32_t>());
      for (size_t w = 0; w < words.size(); ++w) ASSERT_EQ(g[w], words[w]) << tiles << " word " << w;
    }
  }
}

TEST(Int4Weight, ShapesTheKernelCannotTileAreNamed) {
  EXPECT_TRUE(Int4Weight::fits(8, 32));
  EXPECT_TRUE(Int4Weight::fits(4096, 14336));
  EXPECT_FALSE(Int4Weight::fits(12, 32));
  EXPECT_FALSE(Int4Weight::fits(16, 48));
  EXPECT_EQ(Int4Weight::group_for(14336), 128);
  EXPECT_EQ(Int4Weight::group_for(576), 64);
  EXPECT_EQ(Int4Weight::group_for(1568), 32);
  try {
    Int4Weight::quantize(torch::randn({16, 40}), "model.layers.0.mlp.down_proj.weight");
    FAIL() << "a 16 x 40 int4 weight was accepted";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.0.mlp.down_proj.weight"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("multiple of 32"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(weight_quantization_is_int4("INT4"));
  EXPECT_FALSE(weight_quantization_is_int4("q4_0"));
}

// The load-time probe passes wherever the kernel runs; on a GPU it is what `--quantization int4`
// checks before loading.
TEST(Int4Weight, DeviceProbePasses) {
  for (const auto& dev : devices()) EXPECT_NO_THROW(Int4Weight::check_device(dev)) << dev;
}

}  // namespace
}  // namespace kvserve
