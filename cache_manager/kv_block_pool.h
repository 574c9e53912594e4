#pragma once
// KvBlockPool: the one tensor that holds a shard's K/V blocks, sized in bytes.
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "cache_manager/kv_quant.h"

namespace kvserve {

// What the pool stores and how big it is; plain values so configs can fill them.
struct KvPoolOptions {
  int64_t num_kv_heads = 0;  // KV heads of this shard (after tensor-parallel split)
  int64_t head_dim = 0;
  int64_t block_size = 16;  // tokens per block
  // Pool size, in order of precedence: num_blocks (> 0), kv_cache_bytes (> 0), or on CUDA
  // device_memory_fraction of the device's currently free memory.
  int64_t num_blocks = 0;
  int64_t kv_cache_bytes = 0;
  double device_memory_fraction = 0.0;
  torch::ScalarType dtype = torch::kFloat32;
  torch::Device device = torch::kCPU;
  bool rounds = false;  // dtype differs from the model's compute dtype: K/V read back are rounded
  // A quantized pool (cache_manager/kv_quant.h): rows are stored as bytes in this format and `dtype`
  // is what they are decoded to when read back as tensors (gather).
  KvQuant quant = KvQuant::none;
  // Head-wise layout (docs/architecture.md, "Head-wise KV lengths"): a block holds one KV head's
  // block_size tokens, and every (sequence, layer, KV head) owns its own block table and length, so
  // a head that keeps 40 tokens holds 40 tokens' blocks. PagedKvCache builds its pool with one head
  // per block then; num_kv_heads stays the model shard's count.
  bool head_blocks = false;
};

// Storage [num_blocks, 2, KV, block_size, R]: one block = K then V of all KV heads of one layer for
// block_size tokens. Each (block, K|V, head) is a contiguous [block_size, R] tile, so the decode
// kernel streams a head's keys and values with unit stride and never touches other heads' data.
// R = head_dim elements of `dtype`, or for a quantized pool the row's bytes (uint8 storage).
class KvBlockPool {
 public:
  explicit KvBlockPool(const KvPoolOptions& options);
  // A view of `bytes` (uint8, flat: a KvSlabs storage) as blocks of this format, as many as fit;
  // nothing is allocated or copied, and writes through the view land in `bytes`.
  KvBlockPool(const KvPoolOptions& options, const torch::Tensor& bytes);

  static int64_t bytes_per_block(int64_t num_kv_heads, int64_t block_size, int64_t head_dim, torch::ScalarType dtype,
                                 KvQuant quant = KvQuant::none);
  // Bytes of one (token, KV head) row of K (or V).
  static int64_t row_bytes(int64_t head_dim, torch::ScalarType dtype, KvQuant quant);
  // How many blocks `options` asks for (resolves bytes / device fraction); throws on a zero pool.
  static int64_t resolve_num_blocks(const KvPoolOptions& options);

  // Host memory for a pool of this shape: 2 MiB aligned, transparent huge pages asked for, not zeroed.
  static torch::Tensor host_storage(const std::vector<int64_t>& shape, const torch::TensorOptions& topts, int64_t bytes);

  const torch::Tensor& storage() const { return storage_; }
  torch::Tensor keys() const { return storage_.select(1, 0); }    // [N, KV, bs, D] view
  torch::Tensor values() const { return storage_.select(1, 1); }  // [N, KV, bs, D] view

  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_size() const { return options_.block_size; }
  int64_t num_kv_heads() const { return options_.num_kv_heads; }
  int64_t head_dim() const { return options_.head_dim; }
  int64_t block_bytes() const { return block_bytes_; }
  int64_t total_bytes() const { return block_bytes_ * num_blocks_; }
  torch::ScalarType dtype() const { return options_.dtype; }
  KvQuant quant() const { return options_.quant; }
  bool quantized() const { return options_.quant != KvQuant::none; }
  torch::ScalarType storage_dtype() const { return quantized() ? torch::kUInt8 : options_.dtype; }
  int64_t row_elems() const { return storage_.size(4); }  // R: elements of storage_dtype() per row
  torch::Device device() const { return options_.device; }

 private:
  // The storage's [N, 2, KV, block_size, R] shape for n blocks.
  std::vector<int64_t> shape_of(int64_t n) const;
  KvPoolOptions options_;
  int64_t block_bytes_ = 0;
  int64_t num_blocks_ = 0;
  torch::Tensor storage_;
};

}  // namespace kvserve
