// The CUDA forms of a GGUF's ggml blocks (backend/quantization/gguf_cuda_forms.h): the blocks'
// integers, scales and offsets against ggml's own dequantization (bit for bit), the int8 form
// against the same values, the int4 form against tinygemm's (u - 8) s + z with s and z rounded to
// bfloat16, and the forms' products on a CUDA device (when there is one) against fp64.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "backend/quantization/gguf_cuda_forms.h"
#include "backend/quantization/linear_weight.h"
#include "backend/quantization/quantized_weight.h"
#include "common/check.h"
#include "ggml.h"

namespace kvserve {
namespace {

const std::vector<int> kFormTypes{GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0,
                                  GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K};
bool affine(int type) {
  return type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q5_1 || type == GGML_TYPE_Q2_K || type == GGML_TYPE_Q4_K ||
         type == GGML_TYPE_Q5_K;
}
int64_t group_of(int type) {
  return type == GGML_TYPE_Q6_K || type == GGML_TYPE_Q3_K || type == GGML_TYPE_Q2_K ? 16 : 32;
}

std::string name_of(int type) { return ggml_type_name(static_cast<ggml_type>(type)); }

// Rows over four orders of magnitude, some all positive (a Q4_1 / Q4_K min that is not zero), and
// one constant row.
torch::Tensor weights(int64_t N, int64_t K, uint64_t seed) {
  torch::manual_seed(seed);
  auto w = torch::randn({N, K}) * torch::pow(10.0, torch::arange(N).remainder(4) - 2).unsqueeze(1);
  w[3] = w[3].abs() + 0.5;
  w[5].fill_(0.125);
  return w;
}

// code x scale + offset per value, in fp64 (exact), rounded once to fp32.
torch::Tensor rebuilt(const GgufGroups& g) {
  const auto s = g.scale.to(torch::kFloat64).repeat_interleave(g.group, 1);
  const auto o = g.offset.to(torch::kFloat64).repeat_interleave(g.group, 1);
  return (g.codes.to(torch::kFloat64) * s + o).to(torch::kFloat32);
}

TEST(GgufCudaForms, GroupsGiveGgmlsDequantizedValuesBitForBit) {
  for (int type : kFormTypes) {
    const QuantizedWeight q = QuantizedWeight::quantize(weights(16, 512, 7), type, "w");
    const GgufGroups g = gguf_groups(q, "w");
    const int64_t group = group_of(type);
    ASSERT_EQ(g.group, group) << name_of(type);
    ASSERT_EQ(g.codes.sizes(), (std::vector<int64_t>{16, 512})) << name_of(type);
    ASSERT_EQ(g.scale.sizes(), (std::vector<int64_t>{16, 512 / group})) << name_of(type);
    EXPECT_TRUE(torch::equal(rebuilt(g), q.dequantize())) << name_of(type);
    // The codes are the type's integers: 4-bit types' nibbles start at code_min.
    const auto u = g.codes.to(torch::kInt32) - g.code_min;
    const int top = type == GGML_TYPE_Q8_0   ? 255
                    : type == GGML_TYPE_Q6_K ? 63
                    : type == GGML_TYPE_Q5_0 || type == GGML_TYPE_Q5_1 || type == GGML_TYPE_Q5_K ? 31
                    : type == GGML_TYPE_Q3_K ? 7
                    : type == GGML_TYPE_Q2_K ? 3
                                             : 15;
    EXPECT_GE(u.min().item<int>(), 0) << name_of(type);
    EXPECT_LE(u.max().item<int>(), top) << name_of(type);
    EXPECT_EQ(u.max().item<int>() > top / 2, true) << name_of(type);  // the codes use their range
    EXPECT_EQ(g.offset.abs().max().item<float>() > 0, affine(type)) << name_of(type);
  }
}

// Every value as ggml's, the products over them equal fp64's to fp32 sums (the CPU's expansion; a
// CUDA device's kernel in ProductsOnCuda...), and rows looked up as the weight holds them.
TEST(GgufCudaForms, Int8FormsKeepEveryValue) {
  for (int type : kFormTypes) {
    if (gguf_cuda_form(type) != GgufCudaForm::kInt8) continue;
    const QuantizedWeight q = QuantizedWeight::quantize(weights(24, 768, 8), type, "w");
    const auto w = gguf_cuda_weight(q, torch::kCPU, "w");
    ASSERT_TRUE(w.has_value() && w->is_int8()) << name_of(type);
    const int64_t group = group_of(type);
    EXPECT_EQ(w->int8->group(), group) << name_of(type);
    EXPECT_EQ(w->int8->offsets().defined(), affine(type)) << name_of(type);
    EXPECT_TRUE(torch::equal(w->int8->dequantize(torch::kFloat32), q.dequantize())) << name_of(type);
    const auto ids = torch::tensor({5, 0, 23}, torch::kInt64);
    EXPECT_TRUE(torch::equal(w->lookup(ids, torch::kFloat32), q.dequantize().index_select(0, ids))) << name_of(type);
    const auto x = torch::randn({4, 768});
    const auto ref = torch::matmul(x.to(torch::kFloat64), q.dequantize().to(torch::kFloat64).t());
    EXPECT_TRUE(torch::allclose(linear(x, *w).to(torch::kFloat64), ref, 1e-4, 1e-4)) << name_of(type);
    // 8 bits a value, a float32 scale per group and an offset where affine: 9 to 12 bits, against 16.
    EXPECT_EQ(w->bytes(), 24 * 768 + 24 * (768 / group) * 4 * (affine(type) ? 2 : 1)) << name_of(type);
  }
}

// tinygemm's value (u - 8) s + z with s and z the blocks' scale and offset rounded to bfloat16: the
// CPU's reference kernel gives it within fp32 rounding, and it lies within the bfloat16 rounding of
// the scale and zero of ggml's value.
TEST(GgufCudaForms, Int4FormsAreTheNibblesWithBfloat16ScalesAndZeros) {
  for (int type : {GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q4_K}) {
    const QuantizedWeight q = QuantizedWeight::quantize(weights(32, 512, 9), type, "w");
    const auto w = gguf_cuda_weight(q, torch::kCPU, "w");
    ASSERT_TRUE(w.has_value() && w->is_int4()) << name_of(type);
    ASSERT_EQ(w->int4->group(), 32) << name_of(type);
    const GgufGroups g = gguf_groups(q, "w");
    const auto u = (g.codes.to(torch::kFloat64) - g.code_min);
    const auto s64 = g.scale.to(torch::kFloat64), z64 = g.offset.to(torch::kFloat64) + (g.code_min + 8) * s64;
    const auto s = g.scale.to(torch::kBFloat16).to(torch::kFloat64).repeat_interleave(32, 1);
    const auto z = (g.offset + static_cast<float>(g.code_min + 8) * g.scale).to(torch::kBFloat16).to(torch::kFloat64)
                       .repeat_interleave(32, 1);
    const auto expect = (u - 8) * s + z;
    const auto got = w->int4->dequantize(torch::kFloat64);
    EXPECT_TRUE(((got - expect).abs() <= 1e-6 * (8 * s.abs() + z.abs()) + 1e-12).all().item<bool>()) << name_of(type);
    const auto ggml = q.dequantize().to(torch::kFloat64);
    const auto bound = (8 * s64.abs() + z64.abs()).repeat_interleave(32, 1) / 128 + 1e-9;
    EXPECT_TRUE(((got - ggml).abs() <= bound).all().item<bool>()) << name_of(type);
    // Q4_0 has no offset: its zero is exactly 0 and only the scale rounds.
    if (type == GGML_TYPE_Q4_0) {
      EXPECT_EQ(z.abs().max().item<double>(), 0.0);
    }
    // 4 bits a value and two bfloat16 per 32: 5 bits.
    EXPECT_EQ(w->bytes(), 32 * 512 / 2 + (512 / 32) * 32 * 4) << name_of(type);
    const auto x = torch::randn({3, 512});
    const auto ref = torch::matmul(x.to(torch::kFloat64), got.t());
    EXPECT_TRUE(torch::allclose(w->int4->matmul(x).to(torch::kFloat64), ref, 1e-3, 1e-3)) << name_of(type);
  }
}

// A Q4_K_M file's fused q/k/v: Q4_K in int4 form beside a Q6_K v_proj in int8 form stack dense in
// the model's dtype; Q8_0 (groups of 32) beside Q6_K (16) stay int8 in groups of 16, every value kept.
TEST(GgufCudaForms, MixedFormsStackWithEveryValueKept) {
  const QuantizedWeight a = QuantizedWeight::quantize(weights(32, 256, 10), GGML_TYPE_Q4_K, "a");
  const QuantizedWeight b = QuantizedWeight::quantize(weights(16, 256, 11), GGML_TYPE_Q6_K, "b");
  const QuantizedWeight c = QuantizedWeight::quantize(weights(16, 256, 12), GGML_TYPE_Q8_0, "c");
  const LinearWeight wa = *gguf_cuda_weight(a, torch::kCPU, "a"), wb = *gguf_cuda_weight(b, torch::kCPU, "b"),
                     wc = *gguf_cuda_weight(c, torch::kCPU, "c");
  const LinearWeight mixed = LinearWeight::stack({wa, wb}, torch::kBFloat16);
  ASSERT_TRUE(mixed.dense.defined());
  EXPECT_EQ(mixed.dense.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(mixed.dense, torch::cat({wa.int4->dequantize(torch::kBFloat16), wb.int8->dequantize(torch::kBFloat16)})));
  const LinearWeight both = LinearWeight::stack({wc, wb});
  ASSERT_TRUE(both.is_int8());
  EXPECT_EQ(both.int8->group(), 16);
  EXPECT_TRUE(torch::equal(both.int8->dequantize(torch::kFloat32), torch::cat({c.dequantize(), b.dequantize()})));
}

TEST(GgufCudaForms, OtherTypesAndShapesAreLeftToDequantization) {
  for (int type : {GGML_TYPE_IQ4_NL, GGML_TYPE_IQ2_XS, GGML_TYPE_F16, GGML_TYPE_BF16})
    EXPECT_EQ(gguf_cuda_form(type), GgufCudaForm::kNone) << name_of(type);
  for (int type : {GGML_TYPE_F16, GGML_TYPE_BF16}) {
    const QuantizedWeight q = QuantizedWeight::quantize(weights(16, 256, 13), type, "w");
    EXPECT_FALSE(gguf_cuda_weight(q, torch::kCPU, "w").has_value()) << name_of(type);
    try {
      gguf_groups(q, "blk.0.attn_q.weight");
      ADD_FAILURE() << name_of(type) << " decoded";
    } catch (const KvError& e) {
      EXPECT_NE(std::string(e.what()).find("blk.0.attn_q.weight"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(name_of(type)), std::string::npos) << e.what();
    }
  }
  // 12 rows: not the CPU int4 kernel's 16 (nor tinygemm's 8 on CUDA for 12): left as blocks.
  EXPECT_FALSE(gguf_cuda_weight(QuantizedWeight::quantize(weights(12, 256, 14), GGML_TYPE_Q4_K, "w"), torch::kCPU, "w"));
  // Stacked parts of two types have no one form.
  const QuantizedWeight mixed = QuantizedWeight::stack({QuantizedWeight::quantize(weights(16, 256, 15), GGML_TYPE_Q4_K, "a"),
                                                        QuantizedWeight::quantize(weights(16, 256, 16), GGML_TYPE_Q6_K, "b")});
  EXPECT_FALSE(gguf_cuda_weight(mixed, torch::kCPU, "w").has_value());
}

// On a CUDA device: tinygemm (int4 forms) and kvserve's int8 kernel over the codes, 1 to 16 rows of
// bfloat16 activations, against fp64 over the form's own values.
TEST(GgufCudaForms, ProductsOnCudaEqualFp64OverTheFormsValues) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  for (int type : kFormTypes) {
    const QuantizedWeight q = QuantizedWeight::quantize(weights(64, 512, 17), type, "w");
    const auto w = gguf_cuda_weight(q, torch::kCUDA, "w");
    ASSERT_TRUE(w.has_value()) << name_of(type);
    const auto ref_w = w->is_int4() ? w->int4->dequantize(torch::kFloat64).cpu() : q.dequantize().to(torch::kFloat64);
    if (w->is_int8()) {
      EXPECT_TRUE(torch::equal(w->int8->dequantize(torch::kFloat32).cpu(), q.dequantize())) << name_of(type);
    }
    for (int64_t M : {1, 3, 16, 100}) {
      const auto x = torch::randn({M, 512}).to(torch::kBFloat16);
      const auto y = linear(x.to(torch::kCUDA), *w).to(torch::kFloat64).cpu();
      const auto ref = torch::matmul(x.to(torch::kFloat64), ref_w.t());
      const auto tol = torch::matmul(x.to(torch::kFloat64).abs(), ref_w.abs().t()) / 128 + 1e-3;
      EXPECT_TRUE(((y - ref).abs() <= tol).all().item<bool>()) << name_of(type) << " M=" << M;
    }
  }
}

}  // namespace
}  // namespace kvserve
