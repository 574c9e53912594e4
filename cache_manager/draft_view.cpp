#include "cache_manager/draft_view.h"

#include <algorithm>

#include "common/check.h"

namespace kvserve {

std::pair<torch::Tensor, torch::Tensor> draft_view_tables(const torch::Tensor& table, const torch::Tensor& lengths,
                                                          int64_t block_size, const DraftView& view,
                                                          std::span<const std::vector<int32_t>* const> chosen) {
  KV_CHECK(table.dim() == 2 && lengths.dim() == 1 && table.size(0) == lengths.size(0) &&
               table.scalar_type() == torch::kInt32 && lengths.scalar_type() == torch::kInt32 &&
               table.device().is_cpu() && lengths.device().is_cpu(),
           "draft view: int32 host tables [rows, cols] and lengths [rows], got " << table.sizes() << " and "
                                                                                  << lengths.sizes());
  KV_CHECK(view.sink_blocks >= 0 && view.window_blocks >= 1 && block_size > 0,
           "draft view: needs a window of at least one block, got " << view.sink_blocks << " sink and "
                                                                    << view.window_blocks << " window blocks");
  const int64_t rows = table.size(0), cols = table.size(1), edges = view.sink_blocks + view.window_blocks;
  KV_CHECK(chosen.empty() || static_cast<int64_t>(chosen.size()) == rows,
           "draft view: chosen blocks for " << chosen.size() << " of " << rows << " rows");
  const torch::Tensor t = table.contiguous(), l = lengths.contiguous();
  const int32_t* tp = t.data_ptr<int32_t>();
  const int32_t* lp = l.data_ptr<int32_t>();
  // Each row's blocks: a row that fits keeps all of them, others sinks + chosen middle + window.
  std::vector<std::vector<int32_t>> picked(static_cast<size_t>(rows));
  std::vector<int32_t> out_len(static_cast<size_t>(rows));
  int64_t out_cols = 1;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = lp[r], nb = (len + block_size - 1) / block_size;
    KV_CHECK(nb <= cols, "draft view: row " << r << " of length " << len << " needs more than " << cols << " blocks");
    const int32_t* src = tp + r * cols;
    auto& out = picked[static_cast<size_t>(r)];
    if (nb <= edges) {
      out.assign(src, src + nb);
      out_len[static_cast<size_t>(r)] = static_cast<int32_t>(len);
    } else {
      out.assign(src, src + view.sink_blocks);
      const int64_t middle_end = nb - view.window_blocks;
      if (!chosen.empty() && chosen[static_cast<size_t>(r)] != nullptr) {
        int64_t prev = -1;
        for (int32_t b : *chosen[static_cast<size_t>(r)]) {
          KV_CHECK(b > prev, "draft view: row " << r << "'s chosen blocks are not ascending");
          prev = b;
          if (b >= middle_end) break;
          if (b >= view.sink_blocks) out.push_back(src[b]);  // a sink block is in the view already
        }
      }
      out.insert(out.end(), src + middle_end, src + nb);
      out_len[static_cast<size_t>(r)] =
          static_cast<int32_t>((static_cast<int64_t>(out.size()) - 1) * block_size + (len - (nb - 1) * block_size));
    }
    out_cols = std::max<int64_t>(out_cols, static_cast<int64_t>(out.size()));
  }
  torch::Tensor ot = torch::zeros({rows, out_cols}, torch::kInt32);
  int32_t* otp = ot.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) std::copy(picked[static_cast<size_t>(r)].begin(), picked[static_cast<size_t>(r)].end(), otp + r * out_cols);
  return {ot, torch::tensor(out_len, torch::kInt32)};
}

std::vector<int32_t> blocks_of_kept(const torch::Tensor& kept, std::span<const int64_t> counts, int64_t block_size,
                                    int64_t skip_blocks) {
  KV_CHECK(kept.dim() == 2 && block_size > 0 && skip_blocks >= 0 &&
               (counts.empty() || static_cast<int64_t>(counts.size()) == kept.size(0)),
           "draft view: kept positions [heads, n] with a count per head, got " << kept.sizes() << " and "
                                                                             << counts.size() << " counts");
  const torch::Tensor k = kept.to(torch::kCPU, torch::kInt64).contiguous();
  const int64_t heads = k.size(0), n = k.size(1);
  const int64_t* kp = k.data_ptr<int64_t>();
  std::vector<int64_t> held;  // kept positions per block
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t c = counts.empty() ? n : std::min(n, counts[static_cast<size_t>(h)]);
    for (int64_t i = 0; i < c; ++i) {
      const int64_t p = kp[h * n + i];
      if (p < 0) continue;
      const auto b = static_cast<size_t>(p / block_size);
      if (b >= held.size()) held.resize(b + 1, 0);
      ++held[b];
    }
  }
  std::vector<int32_t> order;
  for (size_t b = static_cast<size_t>(skip_blocks); b < held.size(); ++b)
    if (held[b] > 0) order.push_back(static_cast<int32_t>(b));
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return held[static_cast<size_t>(a)] != held[static_cast<size_t>(b)] ? held[static_cast<size_t>(a)] > held[static_cast<size_t>(b)] : a > b;
  });
  const auto want = static_cast<size_t>((n + block_size - 1) / block_size);
  if (order.size() > want) order.resize(want);
  std::sort(order.begin(), order.end());
  return order;
}

}  // namespace kvserve
