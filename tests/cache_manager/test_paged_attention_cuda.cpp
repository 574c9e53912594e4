// CUDA paged decode attention and device append: against paged_attention_reference on CPU copies.
// The kernel tests skip without a CUDA device; the argument checks run everywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cache_manager/paged_attention.h"
#include "cache_manager/paged_attention_cuda.h"
#include "common/check.h"

namespace kvserve {
namespace {


#define SKIP_WITHOUT_GPU()                                                                       \
  do {                                                                                           \
    if (!cuda::compiled()) GTEST_SKIP() << "built without CUDA kernels";                         \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";                          \
  } while (0)

// One attention problem: a scattered pool, a table with more rows than the batch uses, and a batch
// that reads a shuffled subset of the rows.
struct Problem {
  torch::Tensor q, pool, tables, rows, lengths;  // CPU
  int64_t max_blocks = 0;                          // most blocks any batch entry needs
};

struct Spec {
  int64_t kv = 2, g = 1, d = 64, bs = 16;
  std::vector<int64_t> lens;  // batch entries' lengths, in batch order
  torch::ScalarType dtype = torch::kFloat32;
  int64_t extra_rows = 3;  // table rows no batch entry reads
  float q_scale = 1.0f;
};

Problem make_problem(const Spec& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  torch::manual_seed(static_cast<int64_t>(seed));
  const int64_t B = static_cast<int64_t>(s.lens.size());
  const int64_t S = B + s.extra_rows;
  std::vector<int64_t> row_len(S);
  std::vector<int64_t> order(S);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);  // batch entry b reads row order[b]
  std::uniform_int_distribution<int64_t> extra_len(0, 3 * s.bs);
  for (int64_t r = 0; r < S; ++r) row_len[r] = extra_len(rng);
  for (int64_t b = 0; b < B; ++b) row_len[order[b]] = s.lens[b];

  int64_t need = 0, max_blocks = 1, batch_max = 0;
  for (int64_t r = 0; r < S; ++r) {
    const int64_t nb = (row_len[r] + s.bs - 1) / s.bs;
    need += nb;
    max_blocks = std::max(max_blocks, nb);
  }
  for (int64_t b = 0; b < B; ++b) batch_max = std::max(batch_max, (s.lens[b] + s.bs - 1) / s.bs);
  const int64_t N = need + 5;  // a few blocks nobody owns
  std::vector<int32_t> ids(N);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);

  Problem p;
  p.pool = torch::randn({N, 2, s.kv, s.bs, s.d}).to(s.dtype);
  // Unowned blocks and the slots past each row's length are NaN: a read of them shows in the result.
  std::vector<bool> owned(N, false);
  p.tables = torch::empty({S, max_blocks + 2}, torch::kInt32);
  auto table = p.tables.accessor<int32_t, 2>();
  std::uniform_int_distribution<int32_t> any_id(0, static_cast<int32_t>(N - 1));
  int64_t next = 0;
  for (int64_t r = 0; r < S; ++r) {
    const int64_t nb = (row_len[r] + s.bs - 1) / s.bs;
    for (int64_t c = 0; c < p.tables.size(1); ++c) {
      if (c < nb) {
        const int32_t id = ids[next++];
        table[r][c] = id;
        owned[id] = true;
        const int64_t filled = std::min(s.bs, row_len[r] - c * s.bs);
        if (filled < s.bs) p.pool[id].narrow(2, filled, s.bs - filled).fill_(std::nanf(""));
      } else {
        table[r][c] = any_id(rng);  // padding: any valid id, never read
      }
    }
  }
  for (int64_t n = 0; n < N; ++n) {
    if (!owned[n]) p.pool[n].fill_(std::nanf(""));
  }
  p.lengths = torch::tensor(std::vector<int32_t>(row_len.begin(), row_len.end()), torch::kInt32);
  p.rows = torch::tensor(std::vector<int32_t>(order.begin(), order.begin() + B), torch::kInt32);
  p.q = (torch::randn({B, s.kv * s.g, s.d}) * s.q_scale).to(s.dtype);
  p.max_blocks = batch_max;
  return p;
}

// Reference in fp64 from the exact same (upcast) values, as fp32.
torch::Tensor reference(const Problem& p) {
  const torch::Tensor tables = p.tables.index_select(0, p.rows.to(torch::kLong));
  const torch::Tensor lengths = p.lengths.index_select(0, p.rows.to(torch::kLong));
  return paged_attention_reference(p.q.to(torch::kFloat32), p.pool.to(torch::kFloat32), tables, lengths);
}

double tolerance(torch::ScalarType t) { return t == torch::kFloat32 ? 1e-4 : 2e-2; }

void expect_close(const torch::Tensor& got, const torch::Tensor& want, double tol, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const torch::Tensor g = got.to(torch::kCPU, torch::kFloat64), w = want.to(torch::kFloat64);
  ASSERT_FALSE(torch::isnan(g).any().item<bool>()) << what << ": NaN in the output";
  const torch::Tensor err = (g - w).abs() - tol * w.abs();
  const double worst = err.max().item<double>();
  EXPECT_LE(worst, tol) << what << ": max |got - want| - tol |want| = " << worst;
}

// Runs `p` on the GPU with the split-K plan from its true length hint, with one split (hint 0) and
// with a hint that is too low (the last split then takes the rest).
void check_problem(const Problem& p, torch::ScalarType dtype, const std::string& what) {
  const torch::Device dev(torch::kCUDA);
  const torch::Tensor want = reference(p);
  const torch::Tensor q = p.q.to(dev), pool = p.pool.to(dev), tables = p.tables.to(dev), rows = p.rows.to(dev),
                      lengths = p.lengths.to(dev);
  for (int64_t hint : {p.max_blocks, int64_t{0}, std::max<int64_t>(1, p.max_blocks / 5)}) {
    const torch::Tensor got = cuda::paged_decode_attention(q, pool, tables, rows, lengths, hint);
    EXPECT_EQ(got.scalar_type(), dtype);
    expect_close(got, want, tolerance(dtype), what + " hint=" + std::to_string(hint));
  }
}

std::string name(const Spec& s) {
  return std::string(c10::toString(s.dtype)) + " KV=" + std::to_string(s.kv) + " G=" + std::to_string(s.g) +
         " D=" + std::to_string(s.d) + " bs=" + std::to_string(s.bs);
}

TEST(PagedAttentionCuda, MatchesReferenceAcrossDtypesGroupsAndHeadDims) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 1;
  for (torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    for (int64_t g : {1, 3, 4, 8}) {
      for (int64_t d : {64, 128}) {
        Spec s;
        s.kv = 2;
        s.g = g;
        s.d = d;
        s.dtype = dtype;
        s.lens = {0, 1, 15, 16, 17, 5000, 33};
        check_problem(make_problem(s, seed++), dtype, name(s));
      }
    }
  }
}

TEST(PagedAttentionCuda, SmallAndOddHeadDimsAndBlockSizes) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 100;
  // 16 and 32: the fixture models; 80/96/256: idle lanes and two vectors per lane (fp32); 18 (all
  // dtypes) and 20 / 36 (16-bit): the scalar path, rows not a multiple of 16 bytes.
  for (torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    for (int64_t d : {16, 32, 80, 96, 256, 20, 36, 18}) {
      for (int64_t bs : {1, 3, 16, 32}) {
        Spec s;
        s.kv = 1 + (d % 3);
        s.g = 1 + (bs % 4);
        s.d = d;
        s.bs = bs;
        s.dtype = dtype;
        s.lens = {bs - 1, bs, bs + 1, 0, 7 * bs + 2, 300};
        check_problem(make_problem(s, seed++), dtype, name(s));
      }
    }
  }
}

TEST(PagedAttentionCuda, ManyHeadsPerGroupLargeLogitsAndBigBatch) {
  SKIP_WITHOUT_GPU();
  Spec s;  // G = 12 > 8 takes two head chunks per KV head; large logits stress the online softmax
  s.kv = 2;
  s.g = 12;
  s.d = 128;
  s.dtype = torch::kBFloat16;
  s.q_scale = 8.0f;
  s.lens = {1, 2000, 16, 3};
  check_problem(make_problem(s, 7), s.dtype, name(s) + " large logits");
  Spec big;  // enough CTAs that the plan picks a single split
  big.kv = 8;
  big.g = 4;
  big.d = 128;
  big.dtype = torch::kFloat16;
  for (int i = 0; i < 64; ++i) big.lens.push_back(1 + (i * 37) % 700);
  check_problem(make_problem(big, 8), big.dtype, name(big) + " B=64");
}

TEST(PagedAttentionCuda, UnalignedPoolTakesTheScalarPath) {
  SKIP_WITHOUT_GPU();
  Spec s;
  s.kv = 2;
  s.g = 4;
  s.d = 64;
  s.dtype = torch::kBFloat16;
  s.lens = {5, 40, 0, 700};
  Problem p = make_problem(s, 11);
  const torch::Tensor want = reference(p);
  // The same pool two bytes past a 16-byte boundary: contiguous, but not vector-aligned.
  const torch::Device dev(torch::kCUDA);
  torch::Tensor flat = torch::empty({p.pool.numel() + 1}, p.pool.options().device(dev));
  torch::Tensor pool = flat.narrow(0, 1, p.pool.numel()).view(p.pool.sizes());
  pool.copy_(p.pool.to(dev));
  ASSERT_NE(reinterpret_cast<uintptr_t>(pool.data_ptr()) % 16, 0u);
  const torch::Tensor got = cuda::paged_decode_attention(p.q.to(dev), pool, p.tables.to(dev), p.rows.to(dev),
                                                         p.lengths.to(dev), p.max_blocks);
  expect_close(got, want, tolerance(s.dtype), "unaligned pool");
}

TEST(PagedAttentionCuda, AppendWritesExactlyTheNextSlot) {
  SKIP_WITHOUT_GPU();
  const torch::Device dev(torch::kCUDA);
  const bool was = cuda::append_vectorized();
  // Both copies: scalar, and 16-byte vectors (D = 36 is not whole vectors for 2-byte types: scalar).
  for (bool vec : {false, true}) {
  cuda::set_append_vectorized(vec);
  for (torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    for (auto [bs, d] : std::vector<std::pair<int64_t, int64_t>>{{1, 32}, {16, 32}, {5, 32}, {16, 128}, {16, 36}}) {
      Spec s;
      s.kv = 3;
      s.d = d;
      s.bs = bs;
      s.dtype = dtype;
      s.lens = {1, bs, bs + 1, 2 * bs, 77};  // lengths include the token appended this step
      Problem p = make_problem(s, 50 + bs);
      const torch::Tensor before = torch::randn(p.pool.sizes()).to(dtype);  // no NaN: compared exactly
      const int64_t B = p.rows.size(0);
      const torch::Tensor k = torch::randn({B, s.kv, s.d}).to(dtype), v = torch::randn({B, s.kv, s.d}).to(dtype);
      torch::Tensor want = before.clone();
      for (int64_t b = 0; b < B; ++b) {
        const int64_t row = p.rows[b].item<int64_t>();
        const int64_t slot = p.lengths[row].item<int64_t>() - 1;
        const int64_t id = p.tables[row][slot / bs].item<int64_t>();
        want[id][0].select(1, slot % bs).copy_(k[b]);
        want[id][1].select(1, slot % bs).copy_(v[b]);
      }
      torch::Tensor pool = before.to(dev);
      cuda::paged_append(pool, p.tables.to(dev), p.rows.to(dev), p.lengths.to(dev), k.to(dev), v.to(dev));
      EXPECT_TRUE(torch::equal(pool.cpu(), want)) << c10::toString(dtype) << " bs=" << bs << " d=" << d << " vec=" << vec;
    }
  }
  }
  cuda::set_append_vectorized(was);
}

TEST(PagedAttentionCuda, AppendThenAttendSeesTheNewToken) {
  SKIP_WITHOUT_GPU();
  const torch::Device dev(torch::kCUDA);
  Spec s;
  s.kv = 2;
  s.g = 4;
  s.d = 64;
  s.dtype = torch::kBFloat16;
  s.lens = {1, 17, 300};
  Problem p = make_problem(s, 77);
  const int64_t B = p.rows.size(0);
  const torch::Tensor k = torch::randn({B, s.kv, s.d}).to(s.dtype), v = torch::randn({B, s.kv, s.d}).to(s.dtype);
  torch::Tensor pool = p.pool.to(dev);
  cuda::paged_append(pool, p.tables.to(dev), p.rows.to(dev), p.lengths.to(dev), k.to(dev), v.to(dev));
  p.pool = pool.cpu();
  const torch::Tensor got = cuda::paged_decode_attention(p.q.to(dev), pool, p.tables.to(dev), p.rows.to(dev),
                                                         p.lengths.to(dev), p.max_blocks);
  expect_close(got, reference(p), tolerance(s.dtype), "append then attend");
}

// Sliding-window layers (Gemma 3's local layers): each entry sees only its last `window` slots. The
// blocks wholly before the window and the slots before it in its first block are NaN, so any read
// of them shows; every hint (true, one split, too low, the whole row) gives the reference's answer.
TEST(PagedAttentionCuda, SlidingWindowReadsOnlyTheWindow) {
  SKIP_WITHOUT_GPU();
  const torch::Device dev(torch::kCUDA);
  uint64_t seed = 300;
  for (torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (auto [d, bs] : std::vector<std::pair<int64_t, int64_t>>{{256, 16}, {64, 3}, {32, 16}}) {
      for (int64_t window : {1, 7, 16, 33, 512}) {
        Spec s;
        s.kv = 1 + (d == 64);
        s.g = d == 256 ? 4 : 2;
        s.d = d;
        s.bs = bs;
        s.dtype = dtype;
        s.lens = {0, 1, window - 1 > 0 ? window - 1 : 2, window, window + 1, window + bs + 5, 2000};
        Problem p = make_problem(s, seed++);
        const int64_t B = p.rows.size(0);
        for (int64_t b = 0; b < B; ++b) {
          const int64_t row = p.rows[b].item<int64_t>(), len = p.lengths[row].item<int64_t>();
          const int64_t lo = std::max<int64_t>(0, len - window);
          for (int64_t c = 0; c * bs < lo; ++c) {
            const int64_t id = p.tables[row][c].item<int64_t>();
            p.pool[id].narrow(2, 0, std::min(bs, lo - c * bs)).fill_(std::nanf(""));
          }
        }
        const torch::Tensor tables = p.tables.index_select(0, p.rows.to(torch::kLong));
        const torch::Tensor lengths = p.lengths.index_select(0, p.rows.to(torch::kLong));
        const torch::Tensor want = paged_attention_reference(p.q.to(torch::kFloat32), p.pool.to(torch::kFloat32), tables,
                                                             lengths, -1.0, window);
        const torch::Tensor q = p.q.to(dev), pool = p.pool.to(dev), tab = p.tables.to(dev), rows = p.rows.to(dev),
                            lens = p.lengths.to(dev);
        for (int64_t hint : {p.max_blocks, int64_t{0}, int64_t{1}, p.tables.size(1)}) {
          const torch::Tensor got = cuda::paged_decode_attention(q, pool, tab, rows, lens, hint, -1.0, window);
          expect_close(got, want, tolerance(dtype),
                       name(s) + " window=" + std::to_string(window) + " hint=" + std::to_string(hint));
        }
      }
    }
  }
}

// Runs everywhere: without kernels the call says so; with kernels, CPU tensors are refused.
TEST(PagedAttentionCuda, ReportsMissingKernelsOrDevice) {
  Spec s;
  s.lens = {3, 20};
  const Problem p = make_problem(s, 3);
  try {
    cuda::paged_decode_attention(p.q, p.pool, p.tables, p.rows, p.lengths, p.max_blocks);
    FAIL() << "CPU tensors must be refused";
  } catch (const KvError& e) {
    const std::string msg = e.what();
    if (!cuda::compiled()) {
      EXPECT_NE(msg.find("built without CUDA kernels"), std::string::npos) << msg;
    } else {
      EXPECT_NE(msg.find("CUDA device"), std::string::npos) << msg;
    }
  }
  EXPECT_THROW(cuda::paged_append(p.pool, p.tables, p.rows, p.lengths, torch::zeros({2, 2, 64}),
                                  torch::zeros({2, 2, 64})),
               KvError);
  if (cuda::compiled() && !torch::cuda::is_available()) GTEST_SKIP() << "kernels built, no CUDA device";
}

// Shape and dtype checks come before device checks, so they run on CPU tensors here too.
TEST(PagedAttentionCuda, RejectsBadArguments) {
  Spec s;
  s.g = 2;
  s.lens = {3, 20};
  const Problem p = make_problem(s, 4);
  auto attend = [&](const torch::Tensor& q, const torch::Tensor& pool, const torch::Tensor& tables,
                    const torch::Tensor& rows, const torch::Tensor& lengths) {
    return cuda::paged_decode_attention(q, pool, tables, rows, lengths, 4);
  };
  auto expect_error = [](auto&& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "expected a KvError mentioning '" << needle << "'";
    } catch (const KvError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { attend(p.q, p.pool, p.tables.to(torch::kLong), p.rows, p.lengths); }, "tables must be int32");
  expect_error([&] { attend(p.q.narrow(2, 0, 32), p.pool, p.tables, p.rows, p.lengths); }, "head_dim of q");
  expect_error([&] { attend(p.q.to(torch::kBFloat16), p.pool, p.tables, p.rows, p.lengths); }, "q dtype");
  expect_error([&] { attend(p.q, p.pool, p.tables, p.rows.narrow(0, 0, 1), p.lengths); }, "rows must be");
  expect_error([&] { attend(p.q, p.pool, p.tables, p.rows, p.lengths.narrow(0, 0, 1)); }, "lengths must be");
  expect_error([&] { attend(p.q.narrow(1, 0, 3), p.pool, p.tables, p.rows, p.lengths); }, "not a multiple");
  expect_error([&] { attend(p.q, p.pool.select(1, 0), p.tables, p.rows, p.lengths); }, "pool must be");
  expect_error([&] { attend(p.q.to(torch::kFloat64), p.pool.to(torch::kFloat64), p.tables, p.rows, p.lengths); },
               "dtype must be");
  expect_error([&] { attend(p.q, p.pool.transpose(3, 4).contiguous().transpose(3, 4), p.tables, p.rows, p.lengths); },
               "contiguous");
  expect_error([&] { cuda::paged_decode_attention(p.q, p.pool, p.tables, p.rows, p.lengths, 4, -1.0, -3); },
               "window must be >= 0");
  const torch::Tensor k = torch::zeros({2, 2, 64});
  expect_error([&] { cuda::paged_append(p.pool, p.tables, p.rows, p.lengths, k.narrow(2, 0, 16), k.narrow(2, 0, 16)); },
               "k must be");
  expect_error([&] { cuda::paged_append(p.pool, p.tables, p.rows, p.lengths, k.to(torch::kHalf), k.to(torch::kHalf)); },
               "dtype");
  expect_error([&] { cuda::paged_append(p.pool, p.tables.to(torch::kLong), p.rows, p.lengths, k, k); },
               "tables must be int32");
}

}  // namespace
}  // namespace kvserve
