#include "cache_manager/paged_attention_cuda.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "common/check.h"

#ifdef KVSERVE_HAVE_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cache_manager/cuda/paged_decode.cuh"
#endif

namespace kvserve::cuda {
namespace {

std::atomic<bool>& append_vectorized_setting() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("KVSERVE_FUSED_OPS");
    return v == nullptr || *v == '\0' || std::strcmp(v, "2") == 0;
  }()};
  return on;
}

bool is_kernel_dtype(torch::ScalarType t) {
  return t == torch::kFloat32 || t == torch::kBFloat16 || t == torch::kFloat16;
}

// Shape and dtype checks shared by both calls; they run before any device check, so bad arguments
// are reported the same way on CPU tensors, with or without a GPU.
void check_table_args(const char* what, const torch::Tensor& tables, const torch::Tensor& rows,
                      const torch::Tensor& lengths, int64_t batch) {
  KV_CHECK(tables.dim() == 2 && tables.scalar_type() == torch::kInt32,
           what << ": tables must be int32 [S, max_blocks], got " << tables.scalar_type() << " " << tables.sizes());
  KV_CHECK(tables.size(1) <= 1 || tables.stride(1) == 1,
           what << ": a table row's entries must be contiguous (stride " << tables.stride(1) << ")");
  KV_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt32 && rows.size(0) == batch,
           what << ": rows must be int32 [B=" << batch << "], got " << rows.scalar_type() << " " << rows.sizes());
  KV_CHECK(lengths.dim() == 1 && lengths.scalar_type() == torch::kInt32 && lengths.size(0) == tables.size(0),
           what << ": lengths must be int32 [S=" << tables.size(0) << "], got " << lengths.scalar_type() << " "
                << lengths.sizes());
}

void check_pool(const char* what, const torch::Tensor& pool) {
  KV_CHECK(pool.dim() == 5 && pool.size(1) == 2,
           what << ": pool must be [N, 2, KV, block_size, D], got " << pool.sizes());
  KV_CHECK(is_kernel_dtype(pool.scalar_type()),
           what << ": pool dtype must be float32, bfloat16 or float16, got " << pool.scalar_type());
  KV_CHECK(pool.size(2) > 0 && pool.size(3) > 0 && pool.size(4) > 0, what << ": empty pool dims " << pool.sizes());
  KV_CHECK(pool.size(4) <= 256, what << ": head_dim " << pool.size(4) << " > 256 is not supported");
  KV_CHECK(pool.is_contiguous(), what << ": pool must be contiguous");
}

#ifdef KVSERVE_HAVE_CUDA_KERNELS
void check_device(const char* what, const torch::Tensor& ref, std::initializer_list<const torch::Tensor*> others) {
  KV_CHECK(ref.is_cuda(), what << ": tensors must be on a CUDA device, got " << ref.device());
  for (const torch::Tensor* t : others) {
    KV_CHECK(t->device() == ref.device(),
             what << ": all tensors must be on " << ref.device() << ", got one on " << t->device());
  }
}

// The table fields both kernels' arguments share (rows and lengths already contiguous).
template <typename Args>
void set_tables(Args& a, const torch::Tensor& tables, const torch::Tensor& rows, const torch::Tensor& lengths) {
  a.tables = tables.data_ptr<int32_t>();
  a.table_stride = tables.size(0) > 1 ? tables.stride(0) : tables.size(1);
  a.table_cols = tables.size(1);
  a.rows = rows.data_ptr<int32_t>();
  a.lengths = lengths.data_ptr<int32_t>();
  a.num_rows = tables.size(0);
}

cuda_kernels::DType kernel_dtype(torch::ScalarType t) {
  switch (t) {
    case torch::kBFloat16: return cuda_kernels::DType::kBFloat16;
    case torch::kFloat16: return cuda_kernels::DType::kFloat16;
    default: return cuda_kernels::DType::kFloat32;
  }
}
#else
[[noreturn]] void no_kernels(const char* what) {
  KV_FAIL(what << ": kvserve was built without CUDA kernels (configure with KVSERVE_WITH_CUDA=ON and nvcc "
                  "available)");
}
#endif

}  // namespace

bool compiled() {
#ifdef KVSERVE_HAVE_CUDA_KERNELS
  return true;
#else
  return false;
#endif
}

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& pool, const torch::Tensor& tables,
                                     const torch::Tensor& rows, const torch::Tensor& lengths, int64_t max_blocks_hint,
                                     double scale, int64_t window) {
  constexpr const char* what = "cuda paged decode attention";
  KV_CHECK(q.dim() == 3, what << ": q must be [B, H, D], got " << q.sizes());
  check_pool(what, pool);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = pool.size(2);
  KV_CHECK(pool.size(4) == D, what << ": head_dim of q (" << D << ") != pool's (" << pool.size(4) << ")");
  KV_CHECK(H % KV == 0, what << ": " << H << " query heads are not a multiple of " << KV << " KV heads");
  KV_CHECK(q.scalar_type() == pool.scalar_type(),
           what << ": q dtype " << q.scalar_type() << " != pool dtype " << pool.scalar_type());
  check_table_args(what, tables, rows, lengths, B);
  KV_CHECK(max_blocks_hint >= 0, what << ": max_blocks_hint must be >= 0, got " << max_blocks_hint);
  KV_CHECK(window >= 0, what << ": window must be >= 0, got " << window);
#ifndef KVSERVE_HAVE_CUDA_KERNELS
  no_kernels(what);
#else
  check_device(what, q, {&pool, &tables, &rows, &lengths});
  const c10::cuda::CUDAGuard guard(q.device());
  const torch::Tensor qc = q.contiguous();
  const torch::Tensor rc = rows.contiguous();
  const torch::Tensor lc = lengths.contiguous();
  torch::Tensor out = torch::empty_like(qc);
  if (B == 0 || H == 0) return out;

  const int sms = at::cuda::getDeviceProperties(q.device().index())->multiProcessorCount;
  int64_t hint = std::min<int64_t>(max_blocks_hint, tables.size(1));
  // A window of w slots spans at most ceil((w - 1) / bs) + 1 blocks, wherever it starts.
  if (window > 0) hint = std::min<int64_t>(hint, (window - 1 + pool.size(3) - 1) / pool.size(3) + 1);
  const cuda_kernels::SplitPlan plan = cuda_kernels::plan_splits(B, H, KV, hint, sms);
  torch::Tensor workspace;
  const size_t ws = cuda_kernels::workspace_floats(B, H, D, plan.num_splits);
  if (ws > 0) workspace = torch::empty({static_cast<int64_t>(ws)}, q.options().dtype(torch::kFloat32));

  cuda_kernels::PagedDecodeArgs a;
  a.q = qc.data_ptr();
  a.pool = pool.data_ptr();
  set_tables(a, tables, rc, lc);
  a.out = out.data_ptr();
  if (ws > 0) {
    a.partial_acc = workspace.data_ptr<float>();
    a.partial_ml = a.partial_acc + B * H * plan.num_splits * D;
  }
  a.batch = B;
  a.num_heads = H;
  a.num_kv_heads = KV;
  a.head_dim = D;
  a.num_blocks = pool.size(0);
  a.block_size = pool.size(3);
  a.num_splits = plan.num_splits;
  a.blocks_per_split = plan.blocks_per_split;
  a.scale = static_cast<float>(scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(D)));
  a.window = window;
  a.dtype = kernel_dtype(q.scalar_type());
  const cudaError_t err = cuda_kernels::launch_paged_decode(a, at::cuda::getCurrentCUDAStream(q.device().index()));
  KV_CHECK(err == cudaSuccess, what << ": launch failed: " << cudaGetErrorString(err));
  return out;
#endif
}

void paged_append(const torch::Tensor& pool, const torch::Tensor& tables, const torch::Tensor& rows,
                  const torch::Tensor& lengths, const torch::Tensor& k, const torch::Tensor& v) {
  constexpr const char* what = "cuda paged append";
  check_pool(what, pool);
  const int64_t KV = pool.size(2), D = pool.size(4);
  KV_CHECK(k.dim() == 3 && k.size(1) == KV && k.size(2) == D,
           what << ": k must be [B, KV=" << KV << ", D=" << D << "], got " << k.sizes());
  KV_CHECK(v.sizes() == k.sizes(), what << ": v " << v.sizes() << " != k " << k.sizes());
  KV_CHECK(k.scalar_type() == pool.scalar_type() && v.scalar_type() == pool.scalar_type(),
           what << ": k/v dtype " << k.scalar_type() << "/" << v.scalar_type() << " != pool dtype "
                << pool.scalar_type());
  check_table_args(what, tables, rows, lengths, k.size(0));
#ifndef KVSERVE_HAVE_CUDA_KERNELS
  no_kernels(what);
#else
  check_device(what, pool, {&tables, &rows, &lengths, &k, &v});
  if (k.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(pool.device());
  const torch::Tensor kc = k.contiguous(), vc = v.contiguous();
  const torch::Tensor rc = rows.contiguous(), lc = lengths.contiguous();
  cuda_kernels::PagedAppendArgs a;
  a.pool = pool.data_ptr();
  set_tables(a, tables, rc, lc);
  a.k = kc.data_ptr();
  a.v = vc.data_ptr();
  a.batch = k.size(0);
  a.num_kv_heads = KV;
  a.head_dim = D;
  a.num_blocks = pool.size(0);
  a.block_size = pool.size(3);
  a.dtype = kernel_dtype(pool.scalar_type());
  a.vectorized = append_vectorized();
  const cudaError_t err = cuda_kernels::launch_paged_append(a, at::cuda::getCurrentCUDAStream(pool.device().index()));
  KV_CHECK(err == cudaSuccess, what << ": launch failed: " << cudaGetErrorString(err));
#endif
}

bool append_vectorized() { return append_vectorized_setting().load(std::memory_order_relaxed); }
void set_append_vectorized(bool on) { append_vectorized_setting().store(on, std::memory_order_relaxed); }

}  // namespace kvserve::cuda
