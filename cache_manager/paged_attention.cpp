#include "cache_manager/paged_attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <limits>
#include <map>
#include <optional>
#include <vector>

// The kernel itself is paged_attention_kernel.inc (built for AVX2 and AVX-512); this file splits a
// call into work items, merges them, and holds the gather and reference paths.
#if defined(__AVX2__) && defined(__FMA__)
#define KVSERVE_PAGED_AVX2 1
#endif

#include "cache_manager/paged_attention_kernel.h"
#include "common/check.h"

namespace kvserve {
namespace {

using paged_kernel::ChunkFn;
using paged_kernel::Shapes;
using paged_kernel::WorkItem;

Shapes check_args(const torch::Tensor& q, const torch::Tensor& pool, const torch::Tensor& table,
                  const torch::Tensor& lengths, KvQuant quant) {
  KV_CHECK(q.dim() == 3, "paged attention: q must be [B, H, D], got " << q.sizes());
  KV_CHECK(pool.dim() == 5 && pool.size(1) == 2, "paged attention: pool must be [N, 2, KV, bs, D], got " << pool.sizes());
  Shapes s{};
  s.B = q.size(0);
  s.H = q.size(1);
  s.D = q.size(2);
  s.N = pool.size(0);
  s.KV = pool.size(2);
  s.bs = pool.size(3);
  s.R = pool.size(4);
  if (quant == KvQuant::none) {
    KV_CHECK(s.R == s.D, "paged attention: head_dim of q (" << s.D << ") != pool's (" << s.R << ")");
  } else {
    check_kv_quant_head_dim(quant, s.D, "paged attention");
    KV_CHECK(pool.scalar_type() == torch::kUInt8 && s.R == kv_quant_row_bytes(quant, s.D),
             "paged attention: a " << kv_quant_name(quant) << " pool of head_dim " << s.D << " is uint8 rows of "
                                   << kv_quant_row_bytes(quant, s.D) << " bytes, got " << pool.scalar_type() << " rows of "
                                   << s.R);
  }
  KV_CHECK(s.KV > 0 && s.H % s.KV == 0, "paged attention: " << s.H << " query heads not a multiple of " << s.KV
                                                              << " KV heads");
  s.G = s.H / s.KV;
  KV_CHECK(table.dim() == 2 && table.size(0) == s.B, "paged attention: block_table must be [B=" << s.B << ", max_blocks], got "
                                                                                              << table.sizes());
  KV_CHECK(lengths.dim() == 1 && lengths.size(0) == s.B, "paged attention: lengths must be [B=" << s.B << "], got "
                                                                                               << lengths.sizes());
  KV_CHECK(table.scalar_type() == torch::kInt32 && lengths.scalar_type() == torch::kInt32,
           "paged attention: block_table and lengths must be int32");
  s.max_blocks = table.size(1);
  return s;
}

double resolve_scale(double scale, int64_t D) { return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(D)); }

// Host-side length check shared by all paths: a table too short for its length would read garbage.
void check_lengths(const Shapes& s, const int32_t* lens) {
  for (int64_t b = 0; b < s.B; ++b) {
    KV_CHECK(lens[b] >= 0 && (lens[b] + s.bs - 1) / s.bs <= s.max_blocks,
             "paged attention: sequence " << b << " length " << lens[b] << " needs more than " << s.max_blocks
                                          << " blocks");
  }
}

// 0: the widest build the CPU runs (AVX-512 where it has it), 1: AVX2 only; from KVSERVE_PAGED_ISA
// at the first call unless set_paged_attention_isa() said otherwise.
std::atomic<int>& isa_choice() {
  static std::atomic<int> choice{[] {
    const char* e = std::getenv("KVSERVE_PAGED_ISA");
    return e && std::string(e) == "avx2" ? 1 : 0;
  }()};
  return choice;
}

#ifdef KVSERVE_PAGED_AVX2

static_assert(paged_kernel::kQuantGroup == kKvQuantGroup);

}  // namespace

namespace paged_kernel {
bool cpu_has_avx512() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  }();
  return yes;
}
}  // namespace paged_kernel

namespace {

// The kernel's name for a pool's rows; nullopt for a dtype it does not read.
std::optional<paged_kernel::RowFormat> row_format(torch::ScalarType pool_dtype, KvQuant quant) {
  using F = paged_kernel::RowFormat;
  switch (quant) {
    case KvQuant::q8_0: return F::q8_0;
    case KvQuant::q4_0: return F::q4_0;
    case KvQuant::q4_1: return F::q4_1;
    case KvQuant::fp8_e4m3: return F::fp8_e4m3;
    case KvQuant::none: break;
  }
  switch (pool_dtype) {
    case torch::kFloat32: return F::f32;
    case torch::kFloat16: return F::f16;
    case torch::kBFloat16: return F::bf16;
    default: return std::nullopt;
  }
}

// The build that reads a pool's rows: the AVX-512 one where the CPU runs it and it has a kernel for
// the shape, else AVX2; a null fn (isa "none") sends the call to the gather path.
struct KernelChoice {
  ChunkFn fn = nullptr;
  const char* isa = "none";
};
KernelChoice choose_kernel(torch::ScalarType pool_dtype, KvQuant quant, int64_t D, int64_t G) {
  const auto format = row_format(pool_dtype, quant);
  if (!format) return {};
  if (isa_choice().load(std::memory_order_relaxed) == 0 && paged_kernel::cpu_has_avx512())
    if (const ChunkFn fn = paged_kernel::select_avx512(*format, D, G)) return {fn, "avx512"};
  if (const ChunkFn fn = paged_kernel::select_avx2(*format, D, G)) return {fn, "avx2"};
  return {};
}
ChunkFn select_kernel(torch::ScalarType pool_dtype, KvQuant quant, int64_t D, int64_t G) {
  return choose_kernel(pool_dtype, quant, D, G).fn;
}

// Tokens per split-K chunk are at least this many blocks (a power of two), so the merge stays
// negligible.
constexpr int64_t kMinChunkBlocks = 16;
// Below this many (block, KV head) tiles in a call, one thread does all of them.
constexpr int64_t kMinParallelBlocks = 64;

// q of any float dtype is read as fp32 (exact) and the result returned in q's dtype.
torch::Tensor paged_attention_cpu_avx2(const Shapes& s, ChunkFn fn, const torch::Tensor& q, const torch::Tensor& pool,
                                       const torch::Tensor& table_in, const torch::Tensor& lengths_in, double scale,
                                       int64_t window) {
  const torch::Tensor table = table_in.to(torch::kCPU).contiguous();
  const torch::Tensor lengths = lengths_in.to(torch::kCPU).contiguous();
  const torch::Tensor qc = q.to(torch::kFloat32).contiguous();
  const int32_t* tab = table.data_ptr<int32_t>();
  const int32_t* lens = lengths.data_ptr<int32_t>();
  check_lengths(s, lens);
  for (int64_t b = 0; b < s.B; ++b) {
    const int64_t nb = (lens[b] + s.bs - 1) / s.bs;
    for (int64_t j = 0; j < nb; ++j) {
      KV_CHECK(tab[b * s.max_blocks + j] >= 0 && tab[b * s.max_blocks + j] < s.N,
               "paged attention: block id " << tab[b * s.max_blocks + j] << " out of range");
    }
  }

  const int64_t nthreads = std::max<int64_t>(1, at::get_num_threads());
  // A windowed row reads only the blocks from its window's first slot on.
  auto first_slot = [&](int64_t b) -> int64_t { return window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0; };
  // Each row's split-K chunk follows from its own length alone (4-8 chunks a thread for that one
  // row), never from the rest of the batch: how a row is split sets how its partial softmaxes
  // round, so a row's output is the same whatever it is batched with. That keeps greedy outputs
  // identical across batch compositions, which a speculative verify step (a run of rows of one
  // sequence, split as its longest row) and quantized weights (8-bit activations turn a last-bit
  // difference into a visible one) both rely on. A power of two, so that rows a few slots apart
  // (a verify run's, and the plain steps it stands for) almost always split alike: the chunk
  // changes only where a row's block count crosses 2^k * 8 * threads / KV heads.
  // (block, KV head) tiles row b reads.
  auto row_blocks = [&](int64_t b) { return ((lens[b] + s.bs - 1) / s.bs - first_slot(b) / s.bs) * s.KV; };
  int64_t total_blocks = 0;
  for (int64_t b = 0; b < s.B; ++b) total_blocks += row_blocks(b);
  auto chunk_of = [&](int64_t b) {
    const int64_t target = (row_blocks(b) + 8 * nthreads - 1) / (8 * nthreads);
    int64_t chunk = kMinChunkBlocks;
    while (chunk < target) chunk *= 2;
    return chunk;
  };

  std::vector<WorkItem> items;
  std::vector<int64_t> first_item(static_cast<size_t>(s.B * s.KV) + 1, 0);
  for (int64_t b = 0; b < s.B; ++b) {
    const int64_t nb = (lens[b] + s.bs - 1) / s.bs;
    const int64_t chunk = chunk_of(b);
    for (int64_t h = 0; h < s.KV; ++h) {
      first_item[b * s.KV + h] = static_cast<int64_t>(items.size());
      for (int64_t c = first_slot(b) / s.bs; c < nb; c += chunk) {
        items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(h), static_cast<int32_t>(c),
                         static_cast<int32_t>(std::min(nb, c + chunk))});
      }
    }
  }
  first_item[s.B * s.KV] = static_cast<int64_t>(items.size());
  // Longest first, handed out dynamically: batches with very different lengths still balance.
  std::vector<int32_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) {
    return items[x].blk_end - items[x].blk_begin > items[y].blk_end - items[y].blk_begin;
  });

  const int64_t G = s.G, D = s.D;
  std::vector<float> part_acc(items.size() * G * D), part_m(items.size() * G), part_l(items.size() * G);
  const float qscale = static_cast<float>(scale * 1.4426950408889634);  // fold log2(e): softmax via exp2
  const float* qp = qc.data_ptr<float>();
  const void* pp = pool.data_ptr();
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  // Waking the other threads costs tens of microseconds: small caches (a compressed layer) run here.
  const int64_t workers = total_blocks < kMinParallelBlocks ? 1 : std::min(nthreads, std::max<int64_t>(n_items, 1));
  auto work = [&](int64_t, int64_t) {
    // One scratch area, each part 64 floats past a 4 KiB multiple from the last: tiles of 4 KiB
    // allocated apart would start at equal page offsets, and a load from one then waits on stores
    // to the other (4K aliasing) while a quantized block is decoded into them. Kept per thread
    // across calls: every part is written before it is read, and allocating and zeroing ~25 KB
    // on every call was a good part of a short layer's cost.
    auto padded = [](int64_t n) { return (n + 1023) / 1024 * 1024 + 64; };
    thread_local std::vector<float> scratch;
    // The V tile, or a direct-V block's scales and scaled probabilities ([1 + G, D / 32, bs]).
    const int64_t vtile = std::max(s.bs * D, (1 + G) * (D / paged_kernel::kQuantGroup) * s.bs);
    const size_t need = static_cast<size_t>(padded(G * D) + padded(G * s.bs) + padded(s.bs * D) + padded(vtile));
    if (scratch.size() < need) scratch.resize(need);
    float* qs = scratch.data();
    float* sc = qs + padded(G * D);
    float* kbuf = sc + padded(G * s.bs);
    float* vbuf = kbuf + padded(s.bs * D);
    for (int64_t k; (k = next.fetch_add(1, std::memory_order_relaxed)) < n_items;) {
      const int64_t i = order[k];
      const WorkItem& w = items[i];
      fn(s, qp, qscale, pp, tab + w.b * s.max_blocks, first_slot(w.b), lens[w.b], w, part_acc.data() + i * G * D,
         part_m.data() + i * G, part_l.data() + i * G, qs, sc, kbuf, vbuf);
    }
  };
  // One worker runs here: an OpenMP region of one thread still costs its fork and join.
  if (workers == 1) {
    work(0, 1);
  } else {
    at::parallel_for(0, workers, 1, work);
  }

  torch::Tensor out = torch::empty({s.B, s.H, D}, torch::kFloat32);
  float* op = out.data_ptr<float>();
  // The merge reads a few floats per chunk: one thread (a parallel region would cost more).
  for (int64_t bh = 0; bh < s.B * s.KV; ++bh) {
    const int64_t i0 = first_item[bh], i1 = first_item[bh + 1];
    for (int64_t g = 0; g < G; ++g) {
      float* o = op + (bh * G + g) * D;
      if (i0 == i1) {  // empty layer: nothing to attend to
        std::fill(o, o + D, 0.0f);
        continue;
      }
      float M = -std::numeric_limits<float>::infinity();
      for (int64_t i = i0; i < i1; ++i) M = std::max(M, part_m[i * G + g]);
      float L = 0.0f;
      std::fill(o, o + D, 0.0f);
      for (int64_t i = i0; i < i1; ++i) {
        const float w = std::exp2(part_m[i * G + g] - M);
        L += w * part_l[i * G + g];
        const float* a = part_acc.data() + (i * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
      }
      const float inv = 1.0f / L;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      if (s.rotated) kv_quant_rotate_row(o, D);
    }
  }
  return q.scalar_type() == torch::kFloat32 ? out : out.to(q.scalar_type());
}
#endif  // KVSERVE_PAGED_AVX2

}  // namespace

std::string paged_attention_isa(torch::ScalarType pool_dtype, KvQuant quant, int64_t head_dim) {
#ifdef KVSERVE_PAGED_AVX2
  return choose_kernel(pool_dtype, quant, head_dim, 1).isa;
#else
  return "none";
#endif
}

void set_paged_attention_isa(const std::string& isa) {
  KV_CHECK(isa == "avx2" || isa == "avx512", "paged attention: isa must be avx2 or avx512, got '" << isa << "'");
  isa_choice().store(isa == "avx2" ? 1 : 0);
}

int64_t paged_attention_parallel_width() {
  std::atomic<int64_t> seen{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) { seen.fetch_add(1); });
  return seen.load();
}

#ifdef KVSERVE_PAGED_AVX2
namespace {

// Runs of a speculative verify step: rows b..b+r-1 with one table row and lengths L, L+1, ..., L+r-1
// (one sequence's last token and its drafts). Empty when no run is longer than one row.
std::vector<std::pair<int64_t, int64_t>> causal_runs(const Shapes& s, const torch::Tensor& table,
                                                     const torch::Tensor& lengths) {
  const int32_t* tab = table.data_ptr<int32_t>();
  const int32_t* lens = lengths.data_ptr<int32_t>();
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first row, rows)
  bool longer = false;
  for (int64_t b = 0; b < s.B; ++b) {
    if (!runs.empty() && b > 0 && lens[b] == lens[b - 1] + 1 && lens[b - 1] > 0) {
      const int64_t nb = (lens[b] + s.bs - 1) / s.bs;
      if (std::equal(tab + b * s.max_blocks, tab + b * s.max_blocks + nb, tab + (b - 1) * s.max_blocks)) {
        ++runs.back().second;
        longer = true;
        continue;
      }
    }
    runs.push_back({b, 1});
  }
  if (!longer) runs.clear();
  return runs;
}

// A verify step's rows, run by run: each run of r rows becomes one kernel row of r * G query heads
// (KV head major, then row, then head), over the run's longest length with the causal tail masked,
// so each K/V block is read once for the run instead of once per row.
torch::Tensor paged_attention_runs(const Shapes& s, const std::vector<std::pair<int64_t, int64_t>>& runs,
                                   torch::ScalarType pool_dtype, KvQuant quant, const torch::Tensor& q,
                                   const torch::Tensor& pool, const torch::Tensor& table, const torch::Tensor& lengths,
                                   double scale) {
  torch::Tensor out = torch::empty({s.B, s.H, s.D}, torch::kFloat32);
  const torch::Tensor qf = q.to(torch::kFloat32);
  std::map<int64_t, std::vector<int64_t>> by_rows;  // run length -> runs' first rows
  for (const auto& [b, r] : runs) by_rows[r].push_back(b);
  for (const auto& [r, firsts] : by_rows) {
    const int64_t n = static_cast<int64_t>(firsts.size());
    std::vector<int64_t> rows;  // every row of these runs, run-major
    std::vector<int64_t> last;  // each run's last row
    for (int64_t b : firsts) {
      for (int64_t j = 0; j < r; ++j) rows.push_back(b + j);
      last.push_back(b + r - 1);
    }
    const torch::Tensor ri = torch::tensor(rows), li = torch::tensor(last);
    // [n, r, KV, G, D] -> [n, KV, r, G, D] -> [n, KV * r * G, D]
    const torch::Tensor qr = qf.index_select(0, ri).view({n, r, s.KV, s.G, s.D}).transpose(1, 2).reshape({n, s.KV * r * s.G, s.D});
    Shapes rs = s;
    rs.B = n;
    rs.H = s.KV * r * s.G;
    rs.G = r * s.G;
    rs.row_heads = s.G;
    const ChunkFn fn = select_kernel(pool_dtype, quant, s.D, rs.G);
    const torch::Tensor o = paged_attention_cpu_avx2(rs, fn, qr, pool, table.index_select(0, li),
                                                     lengths.index_select(0, li), scale, 0);
    out.index_copy_(0, ri, o.view({n, s.KV, r, s.G, s.D}).transpose(1, 2).reshape({n * r, s.H, s.D}));
  }
  return q.scalar_type() == torch::kFloat32 ? out : out.to(q.scalar_type());
}

}  // namespace
#endif

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& pool, const torch::Tensor& block_table,
                              const torch::Tensor& lengths, double scale, int64_t window, KvQuant quant, bool rotated) {
  Shapes s = check_args(q, pool, block_table, lengths, quant);
  s.rotated = rotated;
  KV_CHECK(window >= 0, "paged attention: window must be >= 0, got " << window);
  scale = resolve_scale(scale, s.D);
#ifdef KVSERVE_PAGED_AVX2
  if (pool.device().is_cpu() && q.device().is_cpu() && q.is_floating_point() && pool.is_contiguous() &&
      s.D % 8 == 0 && s.bs % 8 == 0) {
    if (const ChunkFn fn = select_kernel(pool.scalar_type(), quant, s.D, s.G)) {
      if (window == 0) {
        const torch::Tensor table = block_table.to(torch::kCPU).contiguous();
        const torch::Tensor lens = lengths.to(torch::kCPU).contiguous();
        check_lengths(s, lens.data_ptr<int32_t>());
        const auto runs = causal_runs(s, table, lens);
        if (!runs.empty()) return paged_attention_runs(s, runs, pool.scalar_type(), quant, q, pool, table, lens, scale);
        return paged_attention_cpu_avx2(s, fn, q, pool, table, lens, scale, window);
      }
      return paged_attention_cpu_avx2(s, fn, q, pool, block_table, lengths, scale, window);
    }
  }
#endif
  return paged_attention_gather(q, pool, block_table, lengths, scale, window, quant, rotated);
}

torch::Tensor paged_attention_gather(const torch::Tensor& q, const torch::Tensor& pool, const torch::Tensor& block_table,
                                     const torch::Tensor& lengths, double scale, int64_t window, KvQuant quant,
                                     bool rotated) {
  if (rotated) {
    return kv_quant_rotate(paged_attention_gather(kv_quant_rotate(q), pool, block_table, lengths, scale, window, quant));
  }
  const Shapes s = check_args(q, pool, block_table, lengths, quant);
  scale = resolve_scale(scale, s.D);
  {
    const torch::Tensor lens_host = lengths.to(torch::kCPU).contiguous();
    check_lengths(s, lens_host.data_ptr<int32_t>());
  }
  const auto dev = pool.device();
  if (s.max_blocks == 0) return torch::zeros_like(q);
  const torch::Tensor idx = block_table.to(dev, torch::kLong).reshape({-1});
  const torch::Tensor lens = lengths.to(dev, torch::kLong);
  const int64_t S = s.max_blocks * s.bs;
  // [B*maxb, 2, KV, bs, D] → K, V as [B, KV, S, D]
  torch::Tensor picked = pool.index_select(0, idx);
  if (quant != KvQuant::none) picked = kv_quant_decode(picked, quant, s.D);
  const torch::Tensor blocks = picked.view({s.B, s.max_blocks, 2, s.KV, s.bs, s.D});
  const torch::Tensor k = blocks.select(2, 0).permute({0, 2, 1, 3, 4}).reshape({s.B, s.KV, S, s.D});
  const torch::Tensor v = blocks.select(2, 1).permute({0, 2, 1, 3, 4}).reshape({s.B, s.KV, S, s.D});
  // A 16-bit pool under an fp32 q is widened, never q narrowed: the math runs in the wider dtype.
  const torch::ScalarType ct = torch::promote_types(q.scalar_type(), blocks.scalar_type());
  const torch::Tensor qg = q.to(dev, ct).view({s.B, s.KV, s.G, s.D});
  torch::Tensor scores = torch::matmul(qg, k.to(ct).transpose(-1, -2)).to(torch::kFloat32).mul_(scale);  // [B, KV, G, S]
  // Stale slots may hold NaN/inf: replace, don't add, so nothing leaks through the mask.
  const torch::Tensor slot = torch::arange(S, lens.options()).view({1, S});
  torch::Tensor invalid = slot >= lens.view({s.B, 1});
  if (window > 0) invalid = invalid | (slot < (lens - window).view({s.B, 1}));
  scores.masked_fill_(invalid.view({s.B, 1, 1, S}), -std::numeric_limits<float>::infinity());
  torch::Tensor probs = torch::softmax(scores, -1).nan_to_num_(0.0);  // empty rows → 0
  const torch::Tensor vz = v.to(ct).masked_fill(invalid.view({s.B, 1, S, 1}), 0);
  torch::Tensor out = torch::matmul(probs.to(ct), vz);  // [B, KV, G, D]
  return out.reshape({s.B, s.H, s.D}).to(q.device(), q.scalar_type());
}

torch::Tensor paged_attention_reference(const torch::Tensor& q, const torch::Tensor& pool,
                                        const torch::Tensor& block_table, const torch::Tensor& lengths,
                                        double scale, int64_t window, KvQuant quant, bool rotated) {
  if (rotated) {
    return kv_quant_rotate(
        paged_attention_reference(kv_quant_rotate(q), pool, block_table, lengths, scale, window, quant));
  }
  const Shapes s = check_args(q, pool, block_table, lengths, quant);
  scale = resolve_scale(scale, s.D);
  const torch::Tensor table = block_table.to(torch::kCPU, torch::kLong);
  const torch::Tensor lens = lengths.to(torch::kCPU, torch::kLong);
  torch::Tensor out = torch::zeros({s.B, s.H, s.D}, q.options().dtype(torch::kFloat64));
  for (int64_t b = 0; b < s.B; ++b) {
    const int64_t len = lens[b].item<int64_t>();
    if (len == 0) continue;
    const int64_t nb = (len + s.bs - 1) / s.bs;
    torch::Tensor picked = pool.index_select(0, table[b].narrow(0, 0, nb).to(pool.device()));
    if (quant != KvQuant::none) picked = kv_quant_decode(picked, quant, s.D);
    const torch::Tensor blocks = picked.to(torch::kFloat64);
    const torch::Tensor k = blocks.select(1, 0).permute({1, 0, 2, 3}).reshape({s.KV, nb * s.bs, s.D}).narrow(1, 0, len);
    const torch::Tensor v = blocks.select(1, 1).permute({1, 0, 2, 3}).reshape({s.KV, nb * s.bs, s.D}).narrow(1, 0, len);
    const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const torch::Tensor qb = q[b].to(torch::kFloat64).view({s.KV, s.G, s.D});
    const torch::Tensor p = torch::softmax(torch::matmul(qb, k.narrow(1, lo, len - lo).transpose(1, 2)) * scale, -1);
    out[b].copy_(torch::matmul(p, v.narrow(1, lo, len - lo)).reshape({s.H, s.D}).to(out.device()));
  }
  return out.to(q.scalar_type());
}

}  // namespace kvserve
