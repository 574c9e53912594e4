// Quantized KV pools on CUDA: the device encode / decode / rotate give the host's bytes and values
// bit for bit; the quantized decode kernel equals fp64 attention over the dequantized rows; the
// device append encodes exactly the next slot. The kernel tests skip without a CUDA device; the
// argument checks run everywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cache_manager/kv_quant.h"
#include "cache_manager/kv_quant_cuda.h"
#include "cache_manager/paged_attention.h"
#include "cache_manager/paged_attention_cuda.h"
#include "common/check.h"

namespace kvserve {
namespace {

#define SKIP_WITHOUT_GPU()                                               \
  do {                                                                   \
    if (!cuda::compiled()) GTEST_SKIP() << "built without CUDA kernels"; \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";  \
  } while (0)

const KvQuant kFormats[] = {KvQuant::q8_0, KvQuant::q4_0, KvQuant::q4_1, KvQuant::fp8_e4m3};
const torch::ScalarType kTypes[] = {torch::kFloat32, torch::kBFloat16, torch::kFloat16};

std::string label(KvQuant q, torch::ScalarType t, int64_t d, bool rotate) {
  return std::string(kv_quant_name(q)) + " " + c10::toString(t) + " D=" + std::to_string(d) +
         (rotate ? " rotated" : "");
}

// Rows with an outlier channel, a zero row and a constant row: the cases a scale gets wrong.
torch::Tensor rows_for(int64_t n, int64_t d, uint64_t seed) {
  torch::manual_seed(static_cast<int64_t>(seed));
  torch::Tensor x = torch::randn({n, 3, d});
  x.select(2, 5).mul_(40.0f);
  x[0].zero_();
  x[1].fill_(0.75f);
  return x;
}

TEST(KvQuantCuda, EncodeDecodeAndRotateEqualTheHostBitForBit) {
  SKIP_WITHOUT_GPU();
  const torch::Device dev(torch::kCUDA);
  uint64_t seed = 1;
  for (KvQuant q : kFormats) {
    for (torch::ScalarType t : kTypes) {
      for (int64_t d : {32, 64, 96, 128}) {
        for (bool rotate : {false, true}) {
          const std::string what = label(q, t, d, rotate);
          const torch::Tensor x = rows_for(37, d, seed++).to(t);
          const torch::Tensor host = kv_quant_encode(x, q, rotate);  // CPU tensor: the host encoder
          const torch::Tensor got = cuda::kv_quant_encode(x.to(dev), q, rotate);
          ASSERT_EQ(got.device(), x.to(dev).device()) << what;
          EXPECT_TRUE(torch::equal(got.cpu(), host)) << what << ": the device's bytes differ from the host's";
          for (torch::ScalarType out : kTypes) {
            const torch::Tensor want = kv_quant_decode(host, q, d, out, rotate);
            const torch::Tensor dec = cuda::kv_quant_decode(host.to(dev), q, d, out, rotate);
            EXPECT_TRUE(torch::equal(dec.cpu(), want)) << what << " -> " << c10::toString(out);
          }
        }
        const torch::Tensor x = rows_for(9, d, seed++).to(t);
        EXPECT_TRUE(torch::equal(cuda::kv_quant_rotate(x.to(dev)).cpu(), kv_quant_rotate(x)))
            << "rotate " << c10::toString(t) << " D=" << d;
      }
    }
  }
}

TEST(KvQuantCuda, HostEntryPointsSendCudaTensorsToTheDevice) {
  SKIP_WITHOUT_GPU();
  const torch::Device dev(torch::kCUDA);
  const torch::Tensor x = rows_for(5, 64, 9).to(torch::kBFloat16);
  const torch::Tensor enc = kv_quant_encode(x.to(dev), KvQuant::q4_1, true);
  EXPECT_TRUE(enc.is_cuda());
  EXPECT_TRUE(torch::equal(enc.cpu(), kv_quant_encode(x, KvQuant::q4_1, true)));
  const torch::Tensor dec = kv_quant_decode(enc, KvQuant::q4_1, 64, torch::kFloat16, true);
  EXPECT_TRUE(dec.is_cuda());
  EXPECT_TRUE(torch::equal(dec.cpu(), kv_quant_decode(enc.cpu(), KvQuant::q4_1, 64, torch::kFloat16, true)));
}

// One decode-attention problem over a quantized pool: rows encoded on the host from random K/V;
// blocks nobody owns and the slots past each row's length have 0xFF bytes, whose fp16 scales are
// NaN, so any read of them shows in the output.
struct QuantProblem {
  torch::Tensor q, pool, tables, rows, lengths;  // CPU
  int64_t max_blocks = 0;
};

QuantProblem make_quant_problem(KvQuant quant, bool rotate, int64_t kv, int64_t g, int64_t d, int64_t bs,
                                const std::vector<int64_t>& lens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  torch::manual_seed(static_cast<int64_t>(seed));
  const int64_t B = static_cast<int64_t>(lens.size()), S = B + 2;
  std::vector<int64_t> row_len(S, 0), order(S);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::uniform_int_distribution<int64_t> extra(0, 2 * bs);
  for (int64_t r = 0; r < S; ++r) row_len[r] = extra(rng);
  for (int64_t b = 0; b < B; ++b) row_len[order[b]] = lens[b];
  int64_t need = 0, cols = 1, batch_max = 0;
  for (int64_t r = 0; r < S; ++r) {
    need += (row_len[r] + bs - 1) / bs;
    cols = std::max(cols, (row_len[r] + bs - 1) / bs);
  }
  for (int64_t b = 0; b < B; ++b) batch_max = std::max(batch_max, (lens[b] + bs - 1) / bs);
  const int64_t N = need + 3;
  std::vector<int32_t> ids(N);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);

  QuantProblem p;
  p.pool = kv_quant_encode(torch::randn({N, 2, kv, bs, d}), quant, rotate);
  std::vector<bool> owned(N, false);
  p.tables = torch::zeros({S, cols + 1}, torch::kInt32);
  auto table = p.tables.accessor<int32_t, 2>();
  int64_t next = 0;
  for (int64_t r = 0; r < S; ++r) {
    const int64_t nb = (row_len[r] + bs - 1) / bs;
    for (int64_t c = 0; c < nb; ++c) {
      const int32_t id = ids[next++];
      table[r][c] = id;
      owned[id] = true;
      const int64_t filled = std::min(bs, row_len[r] - c * bs);
      if (filled < bs) p.pool[id].narrow(2, filled, bs - filled).fill_(0xFF);
    }
  }
  for (int64_t n = 0; n < N; ++n) {
    if (!owned[n]) p.pool[n].fill_(0xFF);
  }
  p.lengths = torch::tensor(std::vector<int32_t>(row_len.begin(), row_len.end()), torch::kInt32);
  p.rows = torch::tensor(std::vector<int32_t>(order.begin(), order.begin() + B), torch::kInt32);
  p.q = torch::randn({B, kv * g, d});
  p.max_blocks = batch_max;
  return p;
}

void expect_close(const torch::Tensor& got, const torch::Tensor& want, double tol, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const torch::Tensor g = got.to(torch::kCPU, torch::kFloat64), w = want.to(torch::kFloat64);
  ASSERT_FALSE(torch::isnan(g).any().item<bool>()) << what << ": NaN in the output (a masked slot was read)";
  const double worst = ((g - w).abs() - tol * w.abs()).max().item<double>();
  EXPECT_LE(worst, tol) << what << ": max |got - want| - tol |want| = " << worst;
}

// The kernel against fp64 attention over the same rows, with the true split hint, one split, a hint
// that is too low, and (window > 0) a sliding window.
void check_quant_problem(const QuantProblem& p, KvQuant quant, bool rotate, torch::ScalarType qt, int64_t window,
                         const std::string& what) {
  const torch::Device dev(torch::kCUDA);
  const torch::Tensor tables = p.tables.index_select(0, p.rows.to(torch::kLong));
  const torch::Tensor lengths = p.lengths.index_select(0, p.rows.to(torch::kLong));
  const torch::Tensor q = p.q.to(qt);
  const torch::Tensor want =
      paged_attention_reference(q.to(torch::kFloat32), p.pool, tables, lengths, -1.0, window, quant, rotate);
  const double tol = qt == torch::kFloat32 ? 1e-5 : 2e-2;
  const torch::Tensor pool = p.pool.to(dev), tab = p.tables.to(dev), rows = p.rows.to(dev), lens = p.lengths.to(dev);
  for (int64_t hint : {p.max_blocks, int64_t{0}, std::max<int64_t>(1, p.max_blocks / 5)}) {
    const torch::Tensor got =
        cuda::paged_decode_attention(q.to(dev), pool, tab, rows, lens, hint, -1.0, window, quant, rotate);
    EXPECT_EQ(got.scalar_type(), qt);
    expect_close(got, want, tol, what + " hint=" + std::to_string(hint));
  }
}

TEST(KvQuantCuda, DecodeAttentionEqualsFp64OverTheDequantizedRows) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 100;
  for (KvQuant quant : kFormats) {
    for (bool rotate : {false, true}) {
      for (int64_t g : {1, 3, 8}) {
        for (int64_t d : {32, 64, 96, 128}) {
          const QuantProblem p = make_quant_problem(quant, rotate, 2, g, d, 16, {0, 1, 15, 16, 17, 700, 33}, seed++);
          check_quant_problem(p, quant, rotate, torch::kFloat32, 0,
                              label(quant, torch::kFloat32, d, rotate) + " G=" + std::to_string(g));
        }
      }
    }
  }
  // 16-bit queries, other block sizes and a sliding window.
  for (torch::ScalarType qt : {torch::kBFloat16, torch::kFloat16}) {
    const QuantProblem p = make_quant_problem(KvQuant::q8_0, true, 4, 4, 128, 16, {5, 300, 1024}, seed++);
    check_quant_problem(p, KvQuant::q8_0, true, qt, 0, label(KvQuant::q8_0, qt, 128, true));
  }
  for (int64_t bs : {1, 5, 32}) {
    const QuantProblem p = make_quant_problem(KvQuant::q4_0, false, 1, 2, 64, bs, {1, bs + 1, 200}, seed++);
    check_quant_problem(p, KvQuant::q4_0, false, torch::kFloat32, 0, "q4_0 bs=" + std::to_string(bs));
  }
  for (int64_t window : {1, 16, 50}) {
    const QuantProblem p = make_quant_problem(KvQuant::q8_0, true, 2, 2, 64, 16, {1, 40, 300}, seed++);
    check_quant_problem(p, KvQuant::q8_0, true, torch::kFloat32, window, "q8_0 window=" + std::to_string(window));
  }
}

TEST(KvQuantCuda, AppendEncodesExactlyTheNextSlot) {
  SKIP_WITHOUT_GPU();
  const torch::Device dev(torch::kCUDA);
  uint64_t seed = 500;
  for (KvQuant quant : kFormats) {
    for (torch::ScalarType t : kTypes) {
      for (bool rotate : {false, true}) {
        const int64_t kv = 3, d = 64, bs = 16;
        const QuantProblem p = make_quant_problem(quant, rotate, kv, 1, d, bs, {1, bs, bs + 1, 77}, seed++);
        const torch::Tensor before = torch::randint(0, 256, p.pool.sizes(), torch::kUInt8);
        const int64_t B = p.rows.size(0);
        const torch::Tensor k = torch::randn({B, kv, d}).to(t), v = torch::randn({B, kv, d}).to(t);
        torch::Tensor want = before.clone();
        const torch::Tensor ke = kv_quant_encode(k, quant, rotate), ve = kv_quant_encode(v, quant, rotate);
        for (int64_t b = 0; b < B; ++b) {
          const int64_t row = p.rows[b].item<int64_t>(), slot = p.lengths[row].item<int64_t>() - 1;
          const int64_t id = p.tables[row][slot / bs].item<int64_t>();
          want[id][0].select(1, slot % bs).copy_(ke[b]);
          want[id][1].select(1, slot % bs).copy_(ve[b]);
        }
        torch::Tensor pool = before.to(dev);
        cuda::paged_append(pool, p.tables.to(dev), p.rows.to(dev), p.lengths.to(dev), k.to(dev), v.to(dev), quant,
                           rotate);
        EXPECT_TRUE(torch::equal(pool.cpu(), want)) << label(quant, t, d, rotate);
      }
    }
  }
}

TEST(KvQuantCuda, RejectsBadArguments) {
  // Shape and dtype errors are named before any device is needed.
  const torch::Tensor q = torch::zeros({2, 4, 64});
  const torch::Tensor tables = torch::zeros({2, 3}, torch::kInt32), rows = torch::zeros({2}, torch::kInt32);
  const torch::Tensor lengths = torch::zeros({2}, torch::kInt32);
  const torch::Tensor float_pool = torch::zeros({4, 2, 2, 16, 64});
  try {
    cuda::paged_decode_attention(q, float_pool, tables, rows, lengths, 1, -1.0, 0, KvQuant::q8_0);
    FAIL() << "a float pool passed as q8_0 rows was accepted";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("uint8"), std::string::npos) << e.what();
  }
  try {
    cuda::paged_decode_attention(torch::zeros({2, 4, 48}), torch::zeros({4, 2, 2, 16, 51}, torch::kUInt8), tables,
                                 rows, lengths, 1, -1.0, 0, KvQuant::q8_0);
    FAIL() << "head_dim 48 was accepted for q8_0";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim is 48"), std::string::npos) << e.what();
  }
  try {
    cuda::kv_quant_encode(torch::zeros({3, 64}), KvQuant::q4_0, false);
    FAIL() << "a host tensor was accepted";
  } catch (const KvError& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(msg.find("CUDA device") != std::string::npos || msg.find("without CUDA kernels") != std::string::npos)
        << msg;
  }
}

}  // namespace
}  // namespace kvserve
