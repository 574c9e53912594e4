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

// CUDA graphs of the folded merge: only where torch is a CUDA build (its c10/cuda headers exist).
#if __has_include(<ATen/cuda/CUDAGraph.h>) && __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#define KVSERVE_TEST_CUDA_GRAPHS 1
#endif

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

// One sliding-window case: the blocks wholly before each entry's window and the slots before it in
// its first block are NaN, so any read of them shows; every hint (true, one split, too low, the
// whole row) must give the reference's answer.
void check_window_case(const Spec& s, int64_t window, uint64_t seed, const std::string& what) {
  const torch::Device dev(torch::kCUDA);
  Problem p = make_problem(s, seed);
  const int64_t B = p.rows.size(0), bs = s.bs;
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
    expect_close(got, want, tolerance(s.dtype),
                 what + " " + name(s) + " window=" + std::to_string(window) + " hint=" + std::to_string(hint));
  }
}

// Sliding-window layers (Gemma 3's local layers): each entry sees only its last `window` slots.
TEST(PagedAttentionCuda, SlidingWindowReadsOnlyTheWindow) {
  SKIP_WITHOUT_GPU();
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
        check_window_case(s, window, seed++, "");
      }
    }
  }
}

// Sets a decode tuning for one scope and puts the previous one back.
class TuningScope {
 public:
  explicit TuningScope(const cuda::DecodeTuning& t) : was_(cuda::decode_tuning()) { cuda::set_decode_tuning(t); }
  ~TuningScope() { cuda::set_decode_tuning(was_); }
  TuningScope(const TuningScope&) = delete;
  TuningScope& operator=(const TuningScope&) = delete;

 private:
  cuda::DecodeTuning was_;
};

std::string name(const cuda::DecodeTuning& t) {
  return std::string(t.fold_merge ? "fold" : "kernel") + " ctas/SM=" + std::to_string(t.ctas_per_sm) +
         " loads=" + std::to_string(t.loads);
}

// Every variant of the sweep: merge kernel or folded, 1 / 2 / 4 / 8 CTAs per SM, load depth 1 or 2.
std::vector<cuda::DecodeTuning> all_tunings() {
  std::vector<cuda::DecodeTuning> out;
  for (bool fold : {false, true}) {
    for (int ctas : {1, 2, 4, 8}) {
      for (int loads : {1, 2}) out.push_back(cuda::DecodeTuning{ctas, loads, fold});
    }
  }
  return out;
}

// Length-0 entries must come back as exact zero rows (the graphs' padding rows read the null row).
void expect_zero_rows_for_empty_entries(const Problem& p, const torch::Tensor& got, const std::string& what) {
  const torch::Tensor g = got.cpu();
  for (int64_t b = 0; b < p.rows.size(0); ++b) {
    if (p.lengths[p.rows[b].item<int64_t>()].item<int64_t>() == 0) {
      EXPECT_TRUE(torch::all(g[b] == 0).item<bool>()) << what << ": entry " << b << " has length 0";
    }
  }
}

// The sweep's variants against the fp64 reference: fp32 / bf16, G = 1, 4, 8, D 64 / 128, block sizes
// 16 and 3, lengths 0 to 5000 (so with 8 CTAs per SM most short entries have empty splits), and the
// true, single-split and too-low hints.
TEST(PagedAttentionCuda, TunedVariantsMatchReference) {
  SKIP_WITHOUT_GPU();
  const torch::Device dev(torch::kCUDA);
  uint64_t seed = 500;
  for (torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (int64_t g : {1, 4, 8}) {
      for (int64_t d : {64, 128}) {
        for (int64_t bs : {16, 3}) {
          Spec s;
          s.kv = 2;
          s.g = g;
          s.d = d;
          s.bs = bs;
          s.dtype = dtype;
          s.lens = {0, 1, bs - 1, bs + 1, 100, 5000, 0, 33};
          const Problem p = make_problem(s, seed++);
          const torch::Tensor want = reference(p);
          const torch::Tensor q = p.q.to(dev), pool = p.pool.to(dev), tables = p.tables.to(dev),
                              rows = p.rows.to(dev), lengths = p.lengths.to(dev);
          for (const cuda::DecodeTuning& t : all_tunings()) {
            const TuningScope scope(t);
            for (int64_t hint : {p.max_blocks, int64_t{0}, std::max<int64_t>(1, p.max_blocks / 5)}) {
              const std::string what = name(s) + " " + name(t) + " hint=" + std::to_string(hint);
              const torch::Tensor got = cuda::paged_decode_attention(q, pool, tables, rows, lengths, hint);
              expect_close(got, want, tolerance(dtype), what);
              expect_zero_rows_for_empty_entries(p, got, what);
            }
          }
        }
      }
    }
  }
}

TEST(PagedAttentionCuda, TunedVariantsReadOnlyTheWindow) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 700;
  for (const cuda::DecodeTuning& t : {cuda::DecodeTuning{8, 2, true}, cuda::DecodeTuning{4, 1, true},
                                      cuda::DecodeTuning{1, 2, false}}) {
    const TuningScope scope(t);
    for (torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16}) {
      for (auto [d, bs] : std::vector<std::pair<int64_t, int64_t>>{{128, 16}, {64, 3}}) {
        for (int64_t window : {1, 7, 33, 512}) {
          Spec s;
          s.kv = 2;
          s.g = 4;
          s.d = d;
          s.bs = bs;
          s.dtype = dtype;
          s.lens = {0, 1, window, window + bs + 5, 2000};
          check_window_case(s, window, seed++, name(t));
        }
      }
    }
  }
}

// A counter that a folded launch does not put back to 0 makes the next launch merge too early, from
// partials that are stale or half written. Each launch here has new queries, so stale partials
// give a wrong answer: three launches of one layer in a row, then two layers of other shapes
// alternating, then the counters themselves must all be 0.
TEST(PagedAttentionCuda, FoldedMergeResetsItsCounters) {
  SKIP_WITHOUT_GPU();
  const torch::Device dev(torch::kCUDA);
  for (int loads : {1, 2}) {
    const TuningScope scope(cuda::DecodeTuning{8, loads, true});
    Spec sa;  // the 8B shape's group, a few entries
    sa.kv = 2;
    sa.g = 4;
    sa.d = 128;
    sa.dtype = torch::kBFloat16;
    sa.lens = {5000, 0, 700, 17};
    Spec sb;  // another layer: other heads (two head chunks per KV head), dtype and block size
    sb.kv = 3;
    sb.g = 12;
    sb.d = 64;
    sb.bs = 3;
    sb.dtype = torch::kFloat32;
    sb.lens = {1, 4000, 0, 64, 999, 2};
    Problem a = make_problem(sa, 900 + loads), b = make_problem(sb, 910 + loads);
    const torch::Tensor pa = a.pool.to(dev), ta = a.tables.to(dev), ra = a.rows.to(dev), la = a.lengths.to(dev);
    const torch::Tensor pb = b.pool.to(dev), tb = b.tables.to(dev), rb = b.rows.to(dev), lb = b.lengths.to(dev);
    auto run = [&](Problem& p, const Spec& s, const torch::Tensor& pool, const torch::Tensor& tables,
                   const torch::Tensor& rows, const torch::Tensor& lengths, const std::string& what) {
      p.q = torch::randn(p.q.sizes()).to(s.dtype);  // new queries: stale partials would show
      const torch::Tensor got = cuda::paged_decode_attention(p.q.to(dev), pool, tables, rows, lengths, p.max_blocks);
      expect_close(got, reference(p), tolerance(s.dtype), what + " loads=" + std::to_string(loads));
      expect_zero_rows_for_empty_entries(p, got, what);
    };
    for (int i = 0; i < 3; ++i) run(a, sa, pa, ta, ra, la, "layer A launch " + std::to_string(i));
    for (int i = 0; i < 3; ++i) {
      run(a, sa, pa, ta, ra, la, "alternating A " + std::to_string(i));
      run(b, sb, pb, tb, rb, lb, "alternating B " + std::to_string(i));
    }
    const torch::Tensor counters = cuda::decode_split_counters(dev);
    ASSERT_TRUE(counters.defined());
    EXPECT_EQ(counters.cpu().count_nonzero().item<int64_t>(), 0) << "split counters left non-zero";
  }
}

#ifdef KVSERVE_TEST_CUDA_GRAPHS
// The folded merge inside a CUDA graph: a graph of two layers replayed three times with new queries
// each time (the counters baked into the graph must be back at 0 after every replay), and a capture
// that would need more counters than exist fails with an error instead of allocating.
TEST(PagedAttentionCuda, FoldedMergeReplaysInACudaGraph) {
  SKIP_WITHOUT_GPU();
  const torch::Device dev(torch::kCUDA);
  const TuningScope scope(cuda::DecodeTuning{8, 2, true});
  Spec sa;
  sa.kv = 2;
  sa.g = 4;
  sa.d = 128;
  sa.dtype = torch::kBFloat16;
  sa.lens = {3000, 0, 40};
  Spec sb = sa;
  sb.lens = {1, 2500, 2600, 0, 77};
  Problem a = make_problem(sa, 1001), b = make_problem(sb, 1002);
  const torch::Tensor qa = a.q.to(dev), pa = a.pool.to(dev), ta = a.tables.to(dev), ra = a.rows.to(dev),
                      la = a.lengths.to(dev);
  const torch::Tensor qb = b.q.to(dev), pb = b.pool.to(dev), tb = b.tables.to(dev), rb = b.rows.to(dev),
                      lb = b.lengths.to(dev);
  const int64_t hint = std::max(a.max_blocks, b.max_blocks);
  at::cuda::CUDAStream side = at::cuda::getStreamFromPool();
  at::cuda::CUDAGraph graph;
  torch::Tensor oa, ob;
  {
    const c10::cuda::CUDAStreamGuard guard(side);
    // Eagerly first, as DecodeGraphs does: that is where the counters grow.
    cuda::paged_decode_attention(qa, pa, ta, ra, la, hint);
    cuda::paged_decode_attention(qb, pb, tb, rb, lb, hint);
    side.synchronize();
    graph.capture_begin();
    oa = cuda::paged_decode_attention(qa, pa, ta, ra, la, hint);
    ob = cuda::paged_decode_attention(qb, pb, tb, rb, lb, hint);
    graph.capture_end();
  }
  for (int i = 0; i < 3; ++i) {
    a.q = torch::randn(a.q.sizes()).to(sa.dtype);
    b.q = torch::randn(b.q.sizes()).to(sb.dtype);
    qa.copy_(a.q);
    qb.copy_(b.q);
    graph.replay();
    expect_close(oa, reference(a), tolerance(sa.dtype), "graph replay " + std::to_string(i) + " layer A");
    expect_close(ob, reference(b), tolerance(sb.dtype), "graph replay " + std::to_string(i) + " layer B");
    expect_zero_rows_for_empty_entries(a, oa, "graph replay layer A");
    expect_zero_rows_for_empty_entries(b, ob, "graph replay layer B");
  }
  EXPECT_EQ(cuda::decode_split_counters(dev).cpu().count_nonzero().item<int64_t>(), 0);

  // A batch with more (b, KV head) pairs than there are counters, still split (32 CTAs per SM).
  const TuningScope many(cuda::DecodeTuning{32, 1, true});
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t have = cuda::decode_split_counters(dev).numel();
  Spec big;
  big.kv = 8;
  big.g = 1;
  big.d = 64;
  big.dtype = torch::kBFloat16;
  big.extra_rows = 0;
  const int64_t batch = (32 * static_cast<int64_t>(sms) / 2 - 1) / big.kv;  // >= 2 splits
  if (batch * big.kv <= have) GTEST_SKIP() << "the counters (" << have << ") already cover " << batch * big.kv;
  big.lens.assign(static_cast<size_t>(batch), 100);
  const Problem p = make_problem(big, 1003);
  const torch::Tensor q = p.q.to(dev), pool = p.pool.to(dev), tables = p.tables.to(dev), rows = p.rows.to(dev),
                      lengths = p.lengths.to(dev);
  ASSERT_GT(cuda::decode_split_plan(batch, big.kv * big.g, big.kv, p.max_blocks, sms, 32).num_splits, 1);
  at::cuda::CUDAGraph refused;
  {
    const c10::cuda::CUDAStreamGuard guard(side);
    refused.capture_begin();
    try {
      cuda::paged_decode_attention(q, pool, tables, rows, lengths, p.max_blocks);
      ADD_FAILURE() << "growing the split counters inside a capture must throw";
    } catch (const KvError& e) {
      EXPECT_NE(std::string(e.what()).find("capturing a CUDA graph"), std::string::npos) << e.what();
    }
    refused.capture_end();
  }
  // Outside the capture the same call grows them and is right.
  expect_close(cuda::paged_decode_attention(q, pool, tables, rows, lengths, p.max_blocks), reference(p),
               tolerance(big.dtype), "after the refused capture");
  EXPECT_GE(cuda::decode_split_counters(dev).numel(), batch * big.kv);
}
#endif

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

// The three variables' values, and the errors that name the variable and its allowed values.
TEST(PagedAttentionCuda, DecodeTuningParsesTheEnvironmentValues) {
  const cuda::DecodeTuning d = cuda::parse_decode_tuning(nullptr, nullptr, nullptr);
  EXPECT_EQ(d.ctas_per_sm, 2);
  EXPECT_EQ(d.loads, 1);
  EXPECT_FALSE(d.fold_merge);
  const cuda::DecodeTuning e = cuda::parse_decode_tuning("", "", "");
  EXPECT_EQ(e.ctas_per_sm, 2);
  EXPECT_EQ(e.loads, 1);
  EXPECT_FALSE(e.fold_merge);
  const cuda::DecodeTuning t = cuda::parse_decode_tuning("8", "2", "fold");
  EXPECT_EQ(t.ctas_per_sm, 8);
  EXPECT_EQ(t.loads, 2);
  EXPECT_TRUE(t.fold_merge);
  EXPECT_FALSE(cuda::parse_decode_tuning("1", "1", "kernel").fold_merge);
  EXPECT_EQ(cuda::parse_decode_tuning("32", nullptr, nullptr).ctas_per_sm, 32);
  auto expect_error = [](const char* c, const char* l, const char* m, const std::string& needle) {
    try {
      cuda::parse_decode_tuning(c, l, m);
      ADD_FAILURE() << "expected a KvError mentioning '" << needle << "'";
    } catch (const KvError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("allowed values"), std::string::npos) << e.what();
    }
  };
  for (const char* bad : {"0", "33", "-1", "2x", " 2", "two"}) {
    expect_error(bad, nullptr, nullptr, std::string("KVSERVE_DECODE_CTAS_PER_SM=") + bad);
  }
  for (const char* bad : {"0", "3", "4", "1.5", "x"}) {
    expect_error(nullptr, bad, nullptr, std::string("KVSERVE_DECODE_LOADS=") + bad);
  }
  for (const char* bad : {"Fold", "both", "1"}) {
    expect_error(nullptr, nullptr, bad, std::string("KVSERVE_DECODE_MERGE=") + bad);
  }
}

TEST(PagedAttentionCuda, SetDecodeTuningChecksItsValues) {
  const cuda::DecodeTuning was = cuda::decode_tuning();
  EXPECT_THROW(cuda::set_decode_tuning(cuda::DecodeTuning{0, 1, false}), KvError);
  EXPECT_THROW(cuda::set_decode_tuning(cuda::DecodeTuning{2, 3, false}), KvError);
  cuda::set_decode_tuning(cuda::DecodeTuning{4, 2, true});
  const cuda::DecodeTuning now = cuda::decode_tuning();
  EXPECT_EQ(now.ctas_per_sm, 4);
  EXPECT_EQ(now.loads, 2);
  EXPECT_TRUE(now.fold_merge);
  cuda::set_decode_tuning(was);
  EXPECT_EQ(cuda::decode_tuning().ctas_per_sm, was.ctas_per_sm);
}

// plan_splits is host arithmetic: the split count follows CTAs per SM, every plan covers the
// blocks with no trailing empty split, and the default is 2 CTAs per SM.
TEST(PagedAttentionCuda, SplitPlanFollowsCtasPerSm) {
  if (!cuda::compiled()) GTEST_SKIP() << "built without CUDA kernels";
  const int sms = 132;  // H100 SXM
  // Llama-3.1-8B: 32 query heads, 8 KV heads.
  struct Case {
    int64_t batch, max_blocks;
    int ctas;
    int splits;
  };
  for (const Case& c : std::vector<Case>{{1, 65, 2, 17},     // 1K x 1: capped by 4 blocks per split
                                         {1, 65, 1, 17},     // 132 / 8 = 17 wanted
                                         {8, 2049, 1, 3},    // 32K x 8: 132 / 64
                                         {8, 2049, 2, 5},    // 264 / 64
                                         {8, 2049, 4, 9},    // 528 / 64
                                         {8, 2049, 8, 17},   // 1056 / 64
                                         {64, 2049, 2, 1},   // 512 CTAs already
                                         {64, 2049, 8, 3},   // 1056 / 512
                                         {1, 4, 8, 1}}) {    // too short to split
    const cuda::DecodeSplitPlan p = cuda::decode_split_plan(c.batch, 32, 8, c.max_blocks, sms, c.ctas);
    const std::string what = "B=" + std::to_string(c.batch) + " blocks=" + std::to_string(c.max_blocks) +
                             " ctas/SM=" + std::to_string(c.ctas);
    EXPECT_EQ(p.num_splits, c.splits) << what;
    EXPECT_GE(static_cast<int64_t>(p.num_splits) * p.blocks_per_split, c.max_blocks) << what;
    EXPECT_LT(static_cast<int64_t>(p.num_splits - 1) * p.blocks_per_split, c.max_blocks) << what;
  }
  for (int64_t blocks : {1, 5, 64, 65, 513, 2049, 100000}) {
    int last = 0;
    for (int ctas : {1, 2, 4, 8, 16, 32}) {
      const cuda::DecodeSplitPlan p = cuda::decode_split_plan(2, 32, 8, blocks, sms, ctas);
      EXPECT_GE(p.num_splits, last) << "more CTAs per SM never means fewer splits";
      EXPECT_LE(p.num_splits, 64);
      EXPECT_GE(static_cast<int64_t>(p.num_splits) * p.blocks_per_split, blocks);
      EXPECT_LT(static_cast<int64_t>(p.num_splits - 1) * p.blocks_per_split, std::max<int64_t>(blocks, 1));
      last = p.num_splits;
    }
    const cuda::DecodeSplitPlan def = cuda::decode_split_plan(2, 32, 8, blocks, sms);
    const cuda::DecodeSplitPlan two = cuda::decode_split_plan(2, 32, 8, blocks, sms, 2);
    EXPECT_EQ(def.num_splits, two.num_splits);
    EXPECT_EQ(def.blocks_per_split, two.blocks_per_split);
  }
  EXPECT_THROW(cuda::decode_split_plan(1, 32, 8, 64, sms, 0), KvError);
  EXPECT_THROW(cuda::decode_split_plan(1, 32, 8, 64, sms, 33), KvError);
}

}  // namespace
}  // namespace kvserve
