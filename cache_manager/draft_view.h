#pragma once
// DraftView: the compressed view of a sequence's own paged KV that a self-speculative draft step
// attends to (StreamingLLM's sinks and recent window, as whole blocks of the full cache's tables:
// nothing is copied, the tables are gathered).
#include <torch/torch.h>

#include <cstdint>
#include <utility>

namespace kvserve {

struct DraftView {
  int64_t sink_blocks = 0;    // a table row's first blocks (the attention sinks)
  int64_t window_blocks = 0;  // its last blocks, the partly filled one included (the recent window)
  bool active() const { return sink_blocks > 0 || window_blocks > 0; }
  bool operator==(const DraftView&) const = default;
};

// The view's block tables and lengths: a row of more than sink_blocks + window_blocks blocks keeps
// its first sink_blocks and its last window_blocks, and its length becomes what those hold; shorter
// rows stay whole. table int32 [rows, cols] and lengths int32 [rows] on the host.
std::pair<torch::Tensor, torch::Tensor> draft_view_tables(const torch::Tensor& table, const torch::Tensor& lengths,
                                                          int64_t block_size, const DraftView& view);

}  // namespace kvserve
