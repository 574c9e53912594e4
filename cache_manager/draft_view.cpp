#include "cache_manager/draft_view.h"

#include <algorithm>

#include "common/check.h"

namespace kvserve {

std::pair<torch::Tensor, torch::Tensor> draft_view_tables(const torch::Tensor& table, const torch::Tensor& lengths,
                                                          int64_t block_size, const DraftView& view) {
  KV_CHECK(table.dim() == 2 && lengths.dim() == 1 && table.size(0) == lengths.size(0) &&
               table.scalar_type() == torch::kInt32 && lengths.scalar_type() == torch::kInt32 &&
               table.device().is_cpu() && lengths.device().is_cpu(),
           "draft view: int32 host tables [rows, cols] and lengths [rows], got " << table.sizes() << " and "
                                                                                  << lengths.sizes());
  KV_CHECK(view.sink_blocks >= 0 && view.window_blocks >= 1 && block_size > 0,
           "draft view: needs a window of at least one block, got " << view.sink_blocks << " sink and "
                                                                    << view.window_blocks << " window blocks");
  const int64_t rows = table.size(0), cols = table.size(1), keep = view.sink_blocks + view.window_blocks;
  const torch::Tensor t = table.contiguous(), l = lengths.contiguous();
  const int32_t* tp = t.data_ptr<int32_t>();
  const int32_t* lp = l.data_ptr<int32_t>();
  const int64_t out_cols = std::max<int64_t>(1, std::min(cols, keep));
  torch::Tensor ot = torch::zeros({rows, out_cols}, torch::kInt32), ol = torch::empty({rows}, torch::kInt32);
  int32_t* otp = ot.data_ptr<int32_t>();
  int32_t* olp = ol.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = lp[r], nb = (len + block_size - 1) / block_size;
    KV_CHECK(nb <= cols, "draft view: row " << r << " of length " << len << " needs more than " << cols << " blocks");
    const int32_t* src = tp + r * cols;
    int32_t* dst = otp + r * out_cols;
    if (nb <= keep) {
      std::copy(src, src + std::min(nb, out_cols), dst);
      olp[r] = static_cast<int32_t>(len);
      continue;
    }
    std::copy(src, src + view.sink_blocks, dst);
    std::copy(src + nb - view.window_blocks, src + nb, dst + view.sink_blocks);
    olp[r] = static_cast<int32_t>((keep - 1) * block_size + (len - (nb - 1) * block_size));
  }
  return {ot, ol};
}

}  // namespace kvserve
