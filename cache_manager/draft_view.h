#pragma once
// DraftView: the compressed view of a sequence's own paged KV that a self-speculative draft step
// attends to (StreamingLLM's sinks and recent window, and optionally the blocks a policy's selection
// favoured, as whole blocks of the full cache's tables: nothing is copied, the tables are gathered).
#include <torch/torch.h>

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace kvserve {

struct DraftView {
  int64_t sink_blocks = 0;    // a table row's first blocks (the attention sinks)
  int64_t window_blocks = 0;  // its last blocks, the partly filled one included (the recent window)
  bool active() const { return sink_blocks > 0 || window_blocks > 0; }
  bool operator==(const DraftView&) const = default;
};

// The view's block tables and lengths: a row of more than sink_blocks + window_blocks blocks keeps
// its first sink_blocks, then the row's `chosen` blocks that lie between those and the window (block
// indices of the row, ascending; chosen[r] may be null or empty, and chosen may be empty: none), and
// its last window_blocks; its length becomes what those hold. Shorter rows stay whole. table int32
// [rows, cols] and lengths int32 [rows] on the host.
std::pair<torch::Tensor, torch::Tensor> draft_view_tables(const torch::Tensor& table, const torch::Tensor& lengths,
                                                          int64_t block_size, const DraftView& view,
                                                          std::span<const std::vector<int32_t>* const> chosen = {});

// The blocks of one table row that a policy's selection favours: `kept` int64 [heads, n], the
// positions the policy keeps for each of the row's KV heads (ascending; a head's entries past
// counts[h] are padding when counts is not empty). Ranks the blocks after the first `skip_blocks`
// by how many kept positions they hold (over the heads; a tie goes to the later block) and returns
// the best ceil(n / block_size), ascending, never one that holds none.
std::vector<int32_t> blocks_of_kept(const torch::Tensor& kept, std::span<const int64_t> counts, int64_t block_size,
                                    int64_t skip_blocks);

}  // namespace kvserve
