#include "cache_manager/kv_block_pool.h"

#include <ATen/DeviceAccelerator.h>

#include <cstdlib>
#include <limits>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "common/check.h"

namespace kvserve {

int64_t KvBlockPool::row_bytes(int64_t head_dim, torch::ScalarType dtype, KvQuant quant) {
  return quant != KvQuant::none ? kv_quant_row_bytes(quant, head_dim)
                                : head_dim * static_cast<int64_t>(c10::elementSize(dtype));
}

int64_t KvBlockPool::bytes_per_block(int64_t num_kv_heads, int64_t block_size, int64_t head_dim,
                                     torch::ScalarType dtype, KvQuant quant) {
  return 2 * num_kv_heads * block_size * row_bytes(head_dim, dtype, quant);
}

int64_t KvBlockPool::resolve_num_blocks(const KvPoolOptions& o) {
  KV_CHECK(o.num_kv_heads > 0 && o.head_dim > 0 && o.block_size > 0,
           "KV pool needs positive num_kv_heads, head_dim and block_size (got " << o.num_kv_heads << ", " << o.head_dim
                                                                                << ", " << o.block_size << ")");
  check_kv_quant_head_dim(o.quant, o.head_dim, "KV pool");
  const int64_t bb = bytes_per_block(o.num_kv_heads, o.block_size, o.head_dim, o.dtype, o.quant);
  int64_t n = 0;
  if (o.num_blocks > 0) {
    n = o.num_blocks;
  } else if (o.kv_cache_bytes > 0) {
    n = o.kv_cache_bytes / bb;
  } else if (o.device_memory_fraction > 0.0) {
    KV_CHECK(o.device.is_cuda(), "device_memory_fraction needs a CUDA device (pool device is " << o.device << ")");
    KV_CHECK(o.device_memory_fraction <= 1.0, "device_memory_fraction " << o.device_memory_fraction << " > 1");
    // Runtime dispatch through the accelerator API: no CUDA headers, so CPU-only builds link too.
    const auto [free_bytes, total_bytes] = at::accelerator::getMemoryInfo(o.device.has_index() ? o.device.index() : 0);
    (void)total_bytes;
    n = static_cast<int64_t>(static_cast<double>(free_bytes) * o.device_memory_fraction) / bb;
  } else {
    KV_FAIL("KV pool size not given: set num_blocks, kv_cache_bytes or device_memory_fraction");
  }
  KV_CHECK(n > 0, "KV pool too small: " << o.kv_cache_bytes << " bytes hold no block of " << bb << " bytes");
  KV_CHECK(n <= std::numeric_limits<int32_t>::max(), "KV pool of " << n << " blocks exceeds int32 block ids");
  return n;
}

KvBlockPool::KvBlockPool(const KvPoolOptions& options) : options_(options) {
  KV_CHECK(options.dtype == torch::kFloat32 || options.dtype == torch::kBFloat16 || options.dtype == torch::kFloat16,
           "KV pool dtype must be float32, bfloat16 or float16, got " << options.dtype);
  num_blocks_ = resolve_num_blocks(options);
  block_bytes_ = bytes_per_block(options.num_kv_heads, options.block_size, options.head_dim, options.dtype, options.quant);
  const int64_t row = options.quant != KvQuant::none ? kv_quant_row_bytes(options.quant, options.head_dim) : options.head_dim;
  const std::vector<int64_t> shape = {num_blocks_, 2, options.num_kv_heads, options.block_size, row};
  const auto topts = torch::TensorOptions().dtype(storage_dtype()).device(options.device);
  if (options.device.is_cpu()) {
    storage_ = allocate_host(shape, topts, total_bytes());
  } else {
    storage_ = torch::empty(shape, topts);
  }
}

torch::Tensor KvBlockPool::allocate_host(const std::vector<int64_t>& shape, const torch::TensorOptions& topts,
                                         int64_t bytes) {
  // Decode reads scattered 4 KiB tiles of a pool of many GiB: with 4 KiB pages nearly every tile is a
  // TLB miss (and software prefetches may be dropped), so ask for transparent huge pages.
  // Not zeroed: untouched pages cost no RSS; readers never look past a layer's length.
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t size = (static_cast<size_t>(bytes) + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(kHuge, size);
  KV_CHECK(p != nullptr, "KV pool: cannot allocate " << size << " bytes of host memory");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  (void)madvise(p, size, MADV_HUGEPAGE);  // advisory: without THP support the pool just uses small pages
#endif
  return torch::from_blob(p, shape, [](void* q) { std::free(q); }, topts);
}

}  // namespace kvserve
