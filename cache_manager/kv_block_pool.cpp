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

namespace {
void check_geometry(const KvPoolOptions& o) {
  KV_CHECK(o.num_kv_heads > 0 && o.head_dim > 0 && o.block_size > 0,
           "KV pool needs positive num_kv_heads, head_dim and block_size (got " << o.num_kv_heads << ", " << o.head_dim
                                                                                << ", " << o.block_size << ")");
  check_kv_quant_head_dim(o.quant, o.head_dim, "KV pool");
}
}  // namespace

int64_t KvBlockPool::resolve_num_blocks(const KvPoolOptions& o) {
  check_geometry(o);
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

namespace {
void check_pool_dtype(const KvPoolOptions& o) {
  KV_CHECK(o.dtype == torch::kFloat32 || o.dtype == torch::kBFloat16 || o.dtype == torch::kFloat16,
           "KV pool dtype must be float32, bfloat16 or float16, got " << o.dtype);
}
}  // namespace

std::vector<int64_t> KvBlockPool::shape_of(int64_t n) const {
  const KvPoolOptions& o = options_;
  const int64_t row = o.quant != KvQuant::none ? kv_quant_row_bytes(o.quant, o.head_dim) : o.head_dim;
  return {n, 2, o.num_kv_heads, o.block_size, row};
}

KvBlockPool::KvBlockPool(const KvPoolOptions& options) : options_(options) {
  check_pool_dtype(options);
  num_blocks_ = resolve_num_blocks(options);
  block_bytes_ = bytes_per_block(options.num_kv_heads, options.block_size, options.head_dim, options.dtype, options.quant);
  const std::vector<int64_t> shape = shape_of(num_blocks_);
  const auto topts = torch::TensorOptions().dtype(storage_dtype()).device(options.device);
  if (options.device.is_cpu()) {
    storage_ = host_storage(shape, topts, total_bytes());
  } else {
    storage_ = torch::empty(shape, topts);
  }
}

KvBlockPool::KvBlockPool(const KvPoolOptions& options, const torch::Tensor& bytes) : options_(options) {
  check_pool_dtype(options);
  check_geometry(options);
  KV_CHECK(bytes.scalar_type() == torch::kUInt8 && bytes.dim() == 1 && bytes.is_contiguous(),
           "KV pool view: the storage must be flat contiguous bytes, got " << bytes.scalar_type() << " " << bytes.sizes());
  KV_CHECK(bytes.device() == options.device, "KV pool view: storage on " << bytes.device() << ", pool on " << options.device);
  block_bytes_ = bytes_per_block(options.num_kv_heads, options.block_size, options.head_dim, options.dtype, options.quant);
  num_blocks_ = bytes.numel() / block_bytes_;
  KV_CHECK(num_blocks_ > 0 && num_blocks_ <= std::numeric_limits<int32_t>::max(),
           "KV pool view: " << bytes.numel() << " bytes make " << num_blocks_ << " blocks of " << block_bytes_ << " bytes");
  storage_ = bytes.narrow(0, 0, num_blocks_ * block_bytes_).view(storage_dtype()).view(shape_of(num_blocks_));
}

torch::Tensor KvBlockPool::host_storage(const std::vector<int64_t>& shape, const torch::TensorOptions& topts,
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
