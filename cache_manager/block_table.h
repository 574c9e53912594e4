#pragma once
// LayerBlocks / SequenceBlockTable: which pool blocks hold each layer of one sequence, and how full.
#include <cstdint>
#include <vector>

#include "common/check.h"

namespace kvserve {

// One (sequence, layer): its blocks in slot order and how many slots are filled. All KV heads of the
// layer share the length; slot j of head h is head h's j-th kept token (heads may keep different positions).
struct LayerBlocks {
  std::vector<int32_t> blocks;
  int64_t length = 0;

  // Slots the current blocks can hold before another block is needed.
  int64_t capacity(int64_t block_size) const { return static_cast<int64_t>(blocks.size()) * block_size; }
};

// A sequence's per-layer block lists; layers are compressed independently, so lengths differ.
class SequenceBlockTable {
 public:
  explicit SequenceBlockTable(int64_t num_layers) : layers_(static_cast<size_t>(num_layers)) {}

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  LayerBlocks& layer(int64_t l) {
    KV_CHECK(l >= 0 && l < num_layers(), "layer " << l << " out of range [0, " << num_layers() << ")");
    return layers_[static_cast<size_t>(l)];
  }
  const LayerBlocks& layer(int64_t l) const { return const_cast<SequenceBlockTable*>(this)->layer(l); }
  // Blocks over all layers (what the sequence costs the pool).
  int64_t num_blocks() const {
    int64_t n = 0;
    for (const auto& l : layers_) n += static_cast<int64_t>(l.blocks.size());
    return n;
  }

 private:
  std::vector<LayerBlocks> layers_;
};

// Ceil-divide for tokens → blocks.
inline int64_t blocks_for_tokens(int64_t tokens, int64_t block_size) { return (tokens + block_size - 1) / block_size; }

}  // namespace kvserve
