// Quantized linear weights (backend/quantization/): ggml's block formats against fp64 references,
// the dequantized path against the float GEMM, and the row/column surgery tensor parallelism and
// GGUF loading do on blocks.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>
#include <string>
#include <vector>

#include "backend/kernels/decode_scope.h"
#include "backend/kernels/dense.h"
#include "backend/quantization/linear_weight.h"
#include "backend/quantization/pair_tiles.h"
#include "backend/quantization/quantized_weight.h"
#include "backend/quantization/type_fallback.h"
#include "backend/quantization/weight_quantization.h"
#include "common/check.h"
#include "ggml-cpu.h"
#include "ggml.h"

namespace kvserve {
namespace {

double rel_err(const torch::Tensor& y, const torch::Tensor& ref) {
  return ((y.to(torch::kFloat64) - ref).norm() / ref.norm()).item<double>();
}

torch::Tensor fp64_product(const torch::Tensor& x, const torch::Tensor& w) {
  return torch::matmul(x.to(torch::kFloat64), w.to(torch::kFloat64).t());
}

struct TypeCase {
  const char* name;
  int64_t K;       // a whole number of the type's blocks
  double w_err;    // relative error of the dequantized weights against the originals
};

// Each type's dequantized weights are near the originals, and its vec_dot products (x quantized to
// the type's activation format) are near the fp64 product of x with those dequantized weights.
TEST(QuantizedWeight, DotProductsMatchFp64OverTheDequantizedWeights) {
  torch::manual_seed(3);
  const std::vector<TypeCase> cases = {{"q8_0", 96, 0.01},  {"q4_0", 96, 0.15}, {"q4_1", 96, 0.15}, {"q5_0", 64, 0.08},
                                       {"q5_1", 64, 0.08}, {"q2_K", 256, 0.45}, {"q3_K", 256, 0.25}, {"q4_K", 256, 0.12},
                                       {"q5_K", 512, 0.06}, {"q6_K", 256, 0.03}, {"f16", 40, 1e-3}};
  for (const TypeCase& tc : cases) {
    const int type = quant_type_from_name(tc.name);
    for (int64_t N : {1, 7, 33}) {
      const auto w = torch::randn({N, tc.K});
      const QuantizedWeight q = QuantizedWeight::quantize(w, type, tc.name);
      ASSERT_EQ(q.rows(), N);
      ASSERT_EQ(q.cols(), tc.K);
      EXPECT_EQ(q.bytes(), N * quant_row_bytes(type, tc.K, tc.name));
      const auto deq = q.dequantize();
      EXPECT_LT(rel_err(deq, w.to(torch::kFloat64)), tc.w_err) << tc.name;
      for (int64_t M : {1, 3, 16}) {
        const auto x = torch::randn({M, tc.K});
        const auto y = q.dot(x);
        ASSERT_EQ(y.sizes(), (std::vector<int64_t>{M, N}));
        // 8-bit activations: each value off by up to 1/254 of its block's range, so a dot product
        // is off by a small fraction of |x| |w| (not of its result, which may cancel to near zero).
        const double scale = (x.norm(2, 1).max() * deq.norm(2, 1).max()).item<double>();
        const double err = (y.to(torch::kFloat64) - fp64_product(x, deq)).abs().max().item<double>();
        EXPECT_LT(err, 0.01 * scale) << tc.name << " N=" << N << " M=" << M;
      }
    }
  }
}

// A row's result does not depend on which rows share its batch (a sequence's tokens are the same
// alone or batched), and the bias is added.
TEST(QuantizedWeight, DotIsBatchInvariantAndAddsTheBias) {
  torch::manual_seed(5);
  const QuantizedWeight q = QuantizedWeight::quantize(torch::randn({70, 128}), quant_type_from_name("Q4_1"), "w");
  const auto x = torch::randn({9, 128});
  const auto b = torch::randn({70});
  const auto all = q.dot(x, b);
  for (int64_t m = 0; m < 9; ++m) EXPECT_TRUE(torch::equal(all[m], q.dot(x.narrow(0, m, 1), b)[0])) << m;
  EXPECT_TRUE(torch::allclose(all - b, q.dot(x), 1e-6, 1e-6));
}

// The types llamafile's tiled GEMM takes (Q8_0, Q4_0, Q5_0 weights), and Q4_1 and the K-quants through
// kvserve's own tiles, run several rows of x through them and one row through vec_dot: the two give
// every output bit for bit, so a row's result still does not depend on its batch, whatever shape the
// tiles take. 512 columns: two K-quant super-blocks a row.
TEST(QuantizedWeight, TiledProductsEqualTheOneRowDotProducts) {
  torch::manual_seed(6);
  for (const char* name : {"q8_0", "q4_0", "q5_0", "q4_1", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K"}) {
    const QuantizedWeight q = QuantizedWeight::quantize(torch::randn({75, 512}), quant_type_from_name(name), name);
    ASSERT_TRUE(q.tiled()) << name;
    const auto x = torch::randn({kQuantDotMaxRows, 512});
    for (int64_t M : std::vector<int64_t>{2, 3, 5, 8, 13, kQuantDotMaxRows}) {
      const auto all = q.dot(x.narrow(0, 0, M));
      for (int64_t m = 0; m < M; ++m)
        ASSERT_TRUE(torch::equal(all[m], q.dot(x.narrow(0, m, 1))[0])) << name << " M=" << M << " row " << m;
    }
  }
}

// One row of x (a one-sequence decode step) takes the one-row tiles for Q4_1, Q4_0, Q5_0, Q5_1 and
// Q8_0 (four weight rows at a time) and the K-quant tiles for Q4_K, Q5_K and Q6_K (prefetching
// ahead in the row; Q2_K's and Q3_K's one row stays on vec_dot); each output equals bit for bit ggml's own vec_dot of that row, called here
// directly. Row counts that leave 1-3 rows after the groups of four, and row slices that start
// mid-group, are covered.
TEST(QuantizedWeight, OneRowProductsEqualGgmlsVecDotBitForBit) {
  torch::manual_seed(11);
  ggml_cpu_init();
  for (const char* name : {"q4_1", "q4_0", "q5_0", "q5_1", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K"}) {
    const int type = quant_type_from_name(name);
    for (int64_t N : std::vector<int64_t>{1, 7, 64, 75}) {
      const int64_t K = std::string(name).back() == 'K' ? 512 : 576;
      const auto w = torch::randn({N, K}) * 0.05;
      const QuantizedWeight q = QuantizedWeight::quantize(w, type, name);
      const auto x = torch::randn({1, K}) * 3.0;
      const auto y = q.dot(x);
      // ggml's reference: x in the type's activation format, then vec_dot row by row.
      const auto* traits = ggml_get_type_traits_cpu(static_cast<ggml_type>(type));
      const auto act = traits->vec_dot_type;
      std::vector<uint8_t> xq(ggml_row_size(act, K));
      ggml_get_type_traits_cpu(act)->from_float(x.data_ptr<float>(), xq.data(), K);
      std::vector<uint8_t> wq(ggml_row_size(static_cast<ggml_type>(type), K) * N);
      ggml_quantize_chunk(static_cast<ggml_type>(type), w.contiguous().data_ptr<float>(), wq.data(), 0, N, K, nullptr);
      const size_t row = ggml_row_size(static_cast<ggml_type>(type), K);
      for (int64_t r = 0; r < N; ++r) {
        float ref = 0.0f;
        traits->vec_dot(static_cast<int>(K), &ref, 0, wq.data() + r * row, 0, xq.data(), 0, 1);
        ASSERT_EQ(y[0][r].item<float>(), ref) << name << " N=" << N << " row " << r;
      }
      if (N > 5) {
        const auto part = q.slice_rows(3, N - 5).dot(x);
        ASSERT_TRUE(torch::equal(part[0], y[0].narrow(0, 3, N - 5))) << name << " N=" << N;
      }
    }
  }
}

// Several rows of x through the Q4_1 tiles (the default model's GGUF), Q8_0's (--quantization
// int8, and the GGUF's tied LM head) and the K-quants' (Q2_K ... Q6_K files): on a CPU with AVX-512 VNNI
// rows go in pairs through pair_tiles_avx512.cpp where it has a kernel for the type (not Q2_K or
// Q3_K), an odd last row through the one-row tiles; every output equals ggml's
// vec_dot of its (weight row, x row) bit for bit, called here directly. Weights and activations with
// zeros, negatives and the largest codes (±127) included.
TEST(QuantizedWeight, RowsInPairsEqualGgmlsVecDotBitForBit) {
  torch::manual_seed(12);
  ggml_cpu_init();
  for (const char* name : {"q4_1", "q8_0", "q4_0", "q5_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K"}) {
    const int type = quant_type_from_name(name);
    const auto* traits = ggml_get_type_traits_cpu(static_cast<ggml_type>(type));
    const auto act = traits->vec_dot_type;
    if (!pair_tiles_available(type, act)) std::cout << "[ note ] no pair kernel here: " << name << " without pairs\n";
    const int64_t N = 37, K = std::string(name).back() == 'K' ? 768 : 576;
    auto w = torch::randn({N, K}) * 0.05;
    w[3].zero_();
    w[4].narrow(0, 0, 64).zero_();
    const QuantizedWeight q = QuantizedWeight::quantize(w, type, name);
    std::vector<uint8_t> wq(ggml_row_size(static_cast<ggml_type>(type), K) * N);
    ggml_quantize_chunk(static_cast<ggml_type>(type), w.contiguous().data_ptr<float>(), wq.data(), 0, N, K, nullptr);
    const size_t row = ggml_row_size(static_cast<ggml_type>(type), K), xrow = ggml_row_size(act, K);
    for (int64_t M : std::vector<int64_t>{2, 3, 7, 8, 9, 11, kQuantDotMaxRows}) {
      auto x = torch::randn({M, K}) * 3.0;
      x[M - 1].narrow(0, 32, 32).zero_();
      const auto y = q.dot(x);
      std::vector<uint8_t> xq(xrow * M);
      for (int64_t m = 0; m < M; ++m)
        ggml_get_type_traits_cpu(act)->from_float(x[m].data_ptr<float>(), xq.data() + m * xrow, K);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < N; ++r) {
          float ref = 0.0f;
          traits->vec_dot(static_cast<int>(K), &ref, 0, wq.data() + r * row, 0, xq.data() + m * xrow, 0, 1);
          ASSERT_EQ(y[m][r].item<float>(), ref) << name << " M=" << M << " x row " << m << " weight row " << r;
        }
    }
  }
}

// A decode step (DecodeScope) keeps more than kQuantDotMaxRows rows of tiled types on the
// quantized products (each row as it is alone); outside it, and for types without tiles, they take
// the float GEMM of the dequantized weight.
TEST(QuantizedWeight, DecodeStepsOfManyRowsStayOnTheTiles) {
  torch::manual_seed(8);
  const auto x = torch::randn({kQuantDotMaxRows + 9, 256});
  const auto one = [&](const QuantizedWeight& q, int64_t m) { return q.dot(x.narrow(0, m, 1))[0]; };
  for (const char* name : {"q8_0", "q4_1", "q4_K"}) {
    const QuantizedWeight q = QuantizedWeight::quantize(torch::randn({40, 256}), quant_type_from_name(name), name);
    ASSERT_TRUE(q.tiled()) << name;
    EXPECT_TRUE(torch::equal(q.matmul(x), dense(x, q.dequantize(), {}))) << name;
    torch::Tensor y;
    {
      const DecodeScope decoding;
      EXPECT_TRUE(DecodeScope::active());
      y = q.matmul(x);
    }
    EXPECT_FALSE(DecodeScope::active());
    for (int64_t m = 0; m < x.size(0); ++m) ASSERT_TRUE(torch::equal(y[m], one(q, m))) << name << " row " << m;
  }
  const QuantizedWeight k = QuantizedWeight::quantize(torch::randn({40, 256}), quant_type_from_name("q5_1"), "q5_1");
  EXPECT_FALSE(k.tiled());
  const DecodeScope decoding;
  EXPECT_TRUE(torch::equal(k.matmul(x), dense(x, k.dequantize(), {})));
}

// Past kQuantDotMaxRows rows the weight is dequantized and multiplied by the float GEMM: exactly
// what a float checkpoint of the dequantized weights computes.
TEST(QuantizedWeight, PrefillSizedInputsEqualTheFloatGemmOfTheDequantizedWeight) {
  torch::manual_seed(9);
  const QuantizedWeight q = QuantizedWeight::quantize(torch::randn({48, 64}), quant_type_from_name("q8_0"), "w");
  const auto x = torch::randn({kQuantDotMaxRows + 5, 64});
  const auto b = torch::randn({48});
  EXPECT_TRUE(torch::equal(q.matmul(x, b), dense(x, q.dequantize(), b)));
  const auto small = x.narrow(0, 0, kQuantDotMaxRows);
  EXPECT_TRUE(torch::equal(q.matmul(small, b), q.dot(small, b)));
  // 3-D inputs keep their leading dimensions.
  EXPECT_EQ(q.matmul(torch::randn({3, 7, 64})).sizes(), (std::vector<int64_t>{3, 7, 48}));
  EXPECT_EQ(q.matmul(torch::randn({2, kQuantDotMaxRows, 64})).sizes(), (std::vector<int64_t>{2, kQuantDotMaxRows, 48}));
}

// Slicing, stacking and permuting blocks equals doing the same to the dequantized matrix.
TEST(QuantizedWeight, RowAndColumnSurgeryEqualsTheDequantizedMatrix) {
  torch::manual_seed(11);
  const int q4 = quant_type_from_name("q4_0"), q8 = quant_type_from_name("q8_0");
  const QuantizedWeight a = QuantizedWeight::quantize(torch::randn({10, 128}), q4, "a");
  const QuantizedWeight b = QuantizedWeight::quantize(torch::randn({6, 128}), q8, "b");
  const QuantizedWeight c = QuantizedWeight::quantize(torch::randn({4, 128}), q4, "c");
  const QuantizedWeight s = QuantizedWeight::stack({a, b, c});
  EXPECT_EQ(s.rows(), 20);
  EXPECT_EQ(s.type_names(), "q4_0+q8_0");
  const auto full = torch::cat({a.dequantize(), b.dequantize(), c.dequantize()});
  EXPECT_TRUE(torch::equal(s.dequantize(), full));
  // A slice across part boundaries.
  EXPECT_TRUE(torch::equal(s.slice_rows(8, 10).dequantize(), full.narrow(0, 8, 10)));
  // Columns on block boundaries (32 values for both types).
  EXPECT_TRUE(torch::equal(s.slice_cols(32, 64, "s").dequantize(), full.narrow(1, 32, 64)));
  // Products of a stacked weight equal its parts' products side by side.
  const auto x = torch::randn({2, 128});
  EXPECT_TRUE(torch::equal(s.dot(x), torch::cat({a.dot(x), b.dot(x), c.dot(x)}, 1)));
  std::vector<int64_t> order = {3, 1, 0, 9, 2, 4, 5, 8, 7, 6};
  EXPECT_TRUE(torch::equal(a.permute_rows(order).dequantize(), a.dequantize().index_select(0, torch::tensor(order))));
  EXPECT_TRUE(torch::equal(s.dequantize_rows(torch::tensor({19, 0, 12})), full.index_select(0, torch::tensor({19, 0, 12}))));
}

TEST(QuantizedWeight, BadShapesAndTypesAreNamed) {
  const QuantizedWeight a = QuantizedWeight::quantize(torch::randn({4, 64}), quant_type_from_name("q4_1"), "a");
  try {
    a.slice_cols(16, 32, "blk.0.attn_output.weight");
    FAIL() << "a column slice inside a block was accepted";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("blk.0.attn_output.weight"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("blocks of 32"), std::string::npos) << e.what();
  }
  try {
    QuantizedWeight::quantize(torch::randn({4, 100}), quant_type_from_name("q8_0"), "blk.3.ffn_up.weight");
    FAIL() << "rows of 100 values were cut into blocks of 32";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("blk.3.ffn_up.weight"), std::string::npos) << e.what();
  }
  EXPECT_THROW(quant_type_from_name("q3_banana"), KvError);
  EXPECT_THROW(a.dot(torch::randn({2, 32})), KvError);
}

TEST(WeightQuantization, NamesAndCpuTypes) {
  EXPECT_EQ(weight_quantization_ggml_type(""), -1);
  EXPECT_EQ(weight_quantization_ggml_type("none"), -1);
  EXPECT_EQ(quant_type_name(weight_quantization_ggml_type("int8")), "q8_0");
  EXPECT_EQ(quant_type_name(weight_quantization_ggml_type("int4")), "q4_0");
  EXPECT_EQ(quant_type_name(weight_quantization_ggml_type("Q4_1")), "q4_1");
  EXPECT_EQ(quant_type_name(weight_quantization_ggml_type("q5_k")), "q5_K");
  EXPECT_EQ(quant_type_name(weight_quantization_ggml_type("Q3_K")), "q3_K");
  EXPECT_EQ(quant_type_name(weight_quantization_ggml_type("q2_k")), "q2_K");
  EXPECT_EQ(weight_quantization_ggml_type("fp8"), -1);  // not a ggml type: Fp8Weight
  try {
    weight_quantization_ggml_type("fp4", "model.quantization");
    FAIL() << "fp4 was accepted";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("model.quantization"), std::string::npos) << e.what();
  }
  EXPECT_THROW(weight_quantization_ggml_type("int3", "--quantization"), KvError);
  // Rows that are not whole blocks of the type asked for take llama-quantize's fallback.
  const auto t = [](const char* name) { return quant_type_from_name(name); };
  EXPECT_EQ(quant_type_for_cols(t("q4_K"), 1536), t("q4_K"));
  EXPECT_EQ(quant_type_for_cols(t("q4_K"), 576), t("q5_0"));  // the default model's hidden size
  EXPECT_EQ(quant_type_for_cols(t("q5_K"), 640), t("q5_1"));  // Gemma 3 270M's
  EXPECT_EQ(quant_type_for_cols(t("q6_K"), 384), t("q8_0"));  // a TP 2 slice of 768
  EXPECT_EQ(quant_type_for_cols(t("q3_K"), 576), t("q4_0"));
  EXPECT_EQ(quant_type_for_cols(t("q2_K"), 576), t("q4_0"));
  EXPECT_EQ(quant_type_for_cols(t("q4_K"), 40), -1);  // not even 32-value blocks: stays float
  EXPECT_EQ(quant_type_for_cols(t("q8_0"), 40), -1);  // no fallback for a 32-value type
  EXPECT_EQ(quant_type_for_cols(t("q8_0"), 64), t("q8_0"));
  EXPECT_THROW(weight_quantization_ggml_type("iq2_xxs", "--quantization"), KvError);  // needs an importance matrix
}

// LinearWeight routes dense weights to dense() and blocks to QuantizedWeight, and a fused
// projection of blocks and floats becomes dense.
TEST(LinearWeight, StacksAndMultipliesEitherKind) {
  torch::manual_seed(13);
  const auto w = torch::randn({8, 64});
  const LinearWeight d(w);
  const LinearWeight q(QuantizedWeight::quantize(w, quant_type_from_name("q8_0"), "w"));
  const auto x = torch::randn({2, 64});
  EXPECT_TRUE(torch::equal(linear(x, d), dense(x, w)));
  EXPECT_TRUE(torch::equal(linear(x, q), q.quant->dot(x)));
  EXPECT_EQ(q.format(), "q8_0");
  EXPECT_EQ(d.format(), "float32");
  const LinearWeight mixed = LinearWeight::stack({q, d});
  EXPECT_FALSE(mixed.quantized());
  EXPECT_TRUE(torch::equal(mixed.dense, torch::cat({q.quant->dequantize(), w})));
  const LinearWeight both = LinearWeight::stack({q, q});
  EXPECT_TRUE(both.quantized());
  EXPECT_EQ(both.rows(), 16);
}

}  // namespace
}  // namespace kvserve
