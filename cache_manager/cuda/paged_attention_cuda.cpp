#include "cache_manager/paged_attention_cuda.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cache_manager/kernel_dtype.h"
#include "cache_manager/kv_quant_cuda.h"
#include "common/check.h"

#ifdef KVSERVE_HAVE_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include "cache_manager/cuda/kv_quant_launch.h"
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

constexpr int kMaxCtasPerSm = 32;  // the most resident CTAs an SM takes (sm_80 to sm_90)

void check_tuning(const DecodeTuning& t) {
  KV_CHECK(t.ctas_per_sm >= 1 && t.ctas_per_sm <= kMaxCtasPerSm,
           "decode tuning: ctas_per_sm must be 1 to " << kMaxCtasPerSm << ", got " << t.ctas_per_sm);
  KV_CHECK(t.loads == 1 || t.loads == 2, "decode tuning: loads must be 1 or 2, got " << t.loads);
}

// The decode tuning in effect; `known` once the environment was read or a caller set it.
struct TuningState {
  std::mutex mu;
  bool known = false;
  DecodeTuning value;
};

TuningState& tuning_state() {
  static TuningState state;
  return state;
}

bool unset(const char* v) { return v == nullptr || *v == '\0'; }


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
  KV_CHECK(is_cuda_kernel_dtype(pool.scalar_type()),
           what << ": pool dtype must be float32, bfloat16 or float16, got " << pool.scalar_type());
  KV_CHECK(pool.size(2) > 0 && pool.size(3) > 0 && pool.size(4) > 0, what << ": empty pool dims " << pool.sizes());
  KV_CHECK(pool.size(4) <= 256, what << ": head_dim " << pool.size(4) << " > 256 is not supported");
  KV_CHECK(pool.is_contiguous(), what << ": pool must be contiguous");
}

#ifdef KVSERVE_HAVE_CUDA_KERNELS
// The folded merge's split counters of one device. Never freed: a captured CUDA graph keeps the
// pointer it was captured with, so a buffer that grows keeps its old storage alive (a few KB).
struct SplitCounters {
  torch::Tensor current;
  std::vector<torch::Tensor> retired;
};

std::mutex& counters_mutex() {
  static auto* mu = new std::mutex;
  return *mu;
}

// Leaked on purpose: destroying tensors at exit could run after the CUDA allocator is gone.
std::unordered_map<int, SplitCounters>& counters_by_device() {
  static auto* all = new std::unordered_map<int, SplitCounters>;
  return *all;
}

// At least `need` zeroed counters on the current device, queued on `stream` (the launch's).
int32_t* split_counters(const torch::Device& device, int64_t need, cudaStream_t stream) {
  constexpr int64_t kMinCounters = 1024;  // the 8B shape needs 8 per batch entry
  const std::lock_guard<std::mutex> lock(counters_mutex());
  SplitCounters& c = counters_by_device()[device.index()];
  if (c.current.defined() && c.current.numel() >= need) return c.current.data_ptr<int32_t>();
  // An allocation inside a capture would belong to the graph's pool and its zero fill to the graph,
  // and would leave earlier graphs' launches racing with this one: refuse instead.
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream, &status);
  KV_CHECK(err == cudaSuccess && status == cudaStreamCaptureStatusNone,
           "cuda paged decode attention: the folded split merge needs " << need << " counters on " << device
               << " but has " << (c.current.defined() ? c.current.numel() : 0)
               << ", and they cannot grow while the stream is capturing a CUDA graph; run the same step "
                  "once eagerly before capturing it (KVSERVE_DECODE_MERGE=kernel needs no counters)");
  const int64_t size = std::max({need, kMinCounters, c.current.defined() ? 2 * c.current.numel() : int64_t{0}});
  if (c.current.defined()) c.retired.push_back(c.current);
  c.current = torch::zeros({size}, torch::TensorOptions().dtype(torch::kInt32).device(device));
  return c.current.data_ptr<int32_t>();
}

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

// The launch shape both decode kernels share: the split-K plan from the host's block hint (clamped to
// the table, and to the blocks a window spans), its fp32 workspace (returned: it must outlive the
// launch) and the shape fields of the kernel's arguments.
template <typename Args>
torch::Tensor plan_decode(Args& a, const torch::Tensor& pool, const torch::Tensor& tables, int64_t B, int64_t H,
                          int64_t D, int64_t max_blocks_hint, double scale, int64_t window, const torch::Device& device) {
  const int64_t KV = pool.size(2), bs = pool.size(3);
  const int sms = at::cuda::getDeviceProperties(device.index())->multiProcessorCount;
  int64_t hint = std::min<int64_t>(max_blocks_hint, tables.size(1));
  // A window of w slots spans at most ceil((w - 1) / bs) + 1 blocks, wherever it starts.
  if (window > 0) hint = std::min<int64_t>(hint, (window - 1 + bs - 1) / bs + 1);
  const cuda_kernels::SplitPlan plan = cuda_kernels::plan_splits(B, H, KV, hint, sms, decode_tuning().ctas_per_sm);
  torch::Tensor workspace;
  const size_t ws = cuda_kernels::workspace_floats(B, H, D, plan.num_splits);
  if (ws > 0) {
    workspace = torch::empty({static_cast<int64_t>(ws)}, torch::TensorOptions().dtype(torch::kFloat32).device(device));
    a.partial_acc = workspace.data_ptr<float>();
    a.partial_ml = a.partial_acc + B * H * plan.num_splits * D;
  }
  a.batch = B;
  a.num_heads = H;
  a.num_kv_heads = KV;
  a.head_dim = D;
  a.num_blocks = pool.size(0);
  a.block_size = bs;
  a.num_splits = plan.num_splits;
  a.blocks_per_split = plan.blocks_per_split;
  a.scale = static_cast<float>(scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(D)));
  a.window = window;
  return workspace;
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

// paged_decode_attention over a pool of `quant` rows: q in fp32 (rotated with the rows), the
// quantized kernel, the output back in q's dtype.
torch::Tensor paged_decode_attention_quant(const torch::Tensor& q, const torch::Tensor& pool, const torch::Tensor& tables,
                                           const torch::Tensor& rows, const torch::Tensor& lengths,
                                           int64_t max_blocks_hint, double scale, int64_t window, KvQuant quant,
                                           bool rotated) {
  constexpr const char* what = "cuda paged decode attention (quantized pool)";
  KV_CHECK(q.dim() == 3, what << ": q must be [B, H, D], got " << q.sizes());
  KV_CHECK(is_cuda_kernel_dtype(q.scalar_type()), what << ": q must be float32, bfloat16 or float16, got " << q.scalar_type());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  check_kv_quant_head_dim(quant, D, what);
  KV_CHECK(D <= 256, what << ": head_dim " << D << " > 256 is not supported");
  KV_CHECK(pool.dim() == 5 && pool.size(1) == 2 && pool.scalar_type() == torch::kUInt8 &&
               pool.size(4) == kv_quant_row_bytes(quant, D) && pool.is_contiguous(),
           what << ": a " << kv_quant_name(quant) << " pool of head_dim " << D << " is contiguous uint8 [N, 2, KV, bs, "
                << kv_quant_row_bytes(quant, D) << "], got " << pool.scalar_type() << " " << pool.sizes());
  const int64_t KV = pool.size(2);
  KV_CHECK(KV > 0 && H % KV == 0, what << ": " << H << " query heads are not a multiple of " << KV << " KV heads");
  check_table_args(what, tables, rows, lengths, B);
  KV_CHECK(max_blocks_hint >= 0, what << ": max_blocks_hint must be >= 0, got " << max_blocks_hint);
  KV_CHECK(window >= 0, what << ": window must be >= 0, got " << window);
#ifndef KVSERVE_HAVE_CUDA_KERNELS
  no_kernels(what);
#else
  check_device(what, q, {&pool, &tables, &rows, &lengths});
  const c10::cuda::CUDAGuard guard(q.device());
  torch::Tensor qf = q.to(torch::kFloat32).contiguous();
  if (rotated) qf = kv_quant_rotate(qf);
  const torch::Tensor rc = rows.contiguous(), lc = lengths.contiguous();
  torch::Tensor out = torch::empty_like(qf);
  if (B == 0 || H == 0) return out.to(q.scalar_type());
  cuda_kernels::QuantDecodeArgs a;
  a.q = qf.data_ptr<float>();
  a.pool = pool.data_ptr<uint8_t>();
  set_tables(a, tables, rc, lc);
  a.out = out.data_ptr<float>();
  const torch::Tensor workspace = plan_decode(a, pool, tables, B, H, D, max_blocks_hint, scale, window, q.device());
  a.format = quant_format(quant);
  const cudaError_t err = cuda_kernels::launch_paged_decode_quant(a, at::cuda::getCurrentCUDAStream(q.device().index()));
  KV_CHECK(err == cudaSuccess, what << ": launch failed: " << cudaGetErrorString(err));
  if (rotated) out = kv_quant_rotate(out);
  return out.to(q.scalar_type());
#endif
}

// paged_append into a pool of `quant` rows: each row encoded on the device into its slot.
void paged_append_quant(const torch::Tensor& pool, const torch::Tensor& tables, const torch::Tensor& rows,
                        const torch::Tensor& lengths, const torch::Tensor& k, const torch::Tensor& v, KvQuant quant,
                        bool rotate) {
  constexpr const char* what = "cuda paged append (quantized pool)";
  KV_CHECK(k.dim() == 3, what << ": k must be [B, KV, D], got " << k.sizes());
  const int64_t D = k.size(2);
  check_kv_quant_head_dim(quant, D, what);
  KV_CHECK(pool.dim() == 5 && pool.size(1) == 2 && pool.scalar_type() == torch::kUInt8 &&
               pool.size(4) == kv_quant_row_bytes(quant, D) && pool.is_contiguous(),
           what << ": a " << kv_quant_name(quant) << " pool of head_dim " << D << " is contiguous uint8 [N, 2, KV, bs, "
                << kv_quant_row_bytes(quant, D) << "], got " << pool.scalar_type() << " " << pool.sizes());
  KV_CHECK(k.size(1) == pool.size(2), what << ": k has " << k.size(1) << " KV heads, the pool " << pool.size(2));
  KV_CHECK(v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type(),
           what << ": v " << v.scalar_type() << " " << v.sizes() << " != k " << k.scalar_type() << " " << k.sizes());
  KV_CHECK(is_cuda_kernel_dtype(k.scalar_type()), what << ": k/v must be float32, bfloat16 or float16, got " << k.scalar_type());
  check_table_args(what, tables, rows, lengths, k.size(0));
#ifndef KVSERVE_HAVE_CUDA_KERNELS
  no_kernels(what);
#else
  check_device(what, pool, {&tables, &rows, &lengths, &k, &v});
  if (k.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(pool.device());
  const torch::Tensor kc = k.contiguous(), vc = v.contiguous();
  const torch::Tensor rc = rows.contiguous(), lc = lengths.contiguous();
  cuda_kernels::QuantAppendArgs a;
  a.pool = pool.data_ptr<uint8_t>();
  set_tables(a, tables, rc, lc);
  a.k = kc.data_ptr();
  a.v = vc.data_ptr();
  a.dtype = quant_kernel_dtype(k.scalar_type());
  a.batch = k.size(0);
  a.num_kv_heads = pool.size(2);
  a.head_dim = D;
  a.num_blocks = pool.size(0);
  a.block_size = pool.size(3);
  a.format = quant_format(quant);
  a.rotate = rotate;
  a.rot_scale = kv_quant_rotation_scale();
  const cudaError_t err = cuda_kernels::launch_paged_append_quant(a, at::cuda::getCurrentCUDAStream(pool.device().index()));
  KV_CHECK(err == cudaSuccess, what << ": launch failed: " << cudaGetErrorString(err));
#endif
}

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
                                     double scale, int64_t window, KvQuant quant, bool rotated) {
  if (quant != KvQuant::none) {
    return paged_decode_attention_quant(q, pool, tables, rows, lengths, max_blocks_hint, scale, window, quant, rotated);
  }
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

  const DecodeTuning tuning = decode_tuning();
  cuda_kernels::PagedDecodeArgs a;
  a.q = qc.data_ptr();
  a.pool = pool.data_ptr();
  set_tables(a, tables, rc, lc);
  a.out = out.data_ptr();
  const torch::Tensor workspace = plan_decode(a, pool, tables, B, H, D, max_blocks_hint, scale, window, q.device());
  a.dtype = kernel_dtype(q.scalar_type());
  a.loads = tuning.loads;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(q.device().index());
  a.fold_merge = tuning.fold_merge && a.num_splits > 1;
  if (a.fold_merge) a.split_counters = split_counters(q.device(), cuda_kernels::split_counter_count(B, H, KV), stream);
  const cudaError_t err = cuda_kernels::launch_paged_decode(a, stream);
  KV_CHECK(err == cudaSuccess, what << ": launch failed: " << cudaGetErrorString(err));
  return out;
#endif
}

void paged_append(const torch::Tensor& pool, const torch::Tensor& tables, const torch::Tensor& rows,
                  const torch::Tensor& lengths, const torch::Tensor& k, const torch::Tensor& v, KvQuant quant,
                  bool rotate) {
  if (quant != KvQuant::none) return paged_append_quant(pool, tables, rows, lengths, k, v, quant, rotate);
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

DecodeTuning parse_decode_tuning(const char* ctas_per_sm, const char* loads, const char* merge) {
  DecodeTuning t;
  if (!unset(ctas_per_sm)) {
    char* end = nullptr;
    errno = 0;
    const long v = std::strtol(ctas_per_sm, &end, 10);
    KV_CHECK(std::isdigit(static_cast<unsigned char>(ctas_per_sm[0])) && errno == 0 && *end == '\0' && v >= 1 &&
                 v <= kMaxCtasPerSm,
             "KVSERVE_DECODE_CTAS_PER_SM=" << ctas_per_sm << ": allowed values are the integers 1 to " << kMaxCtasPerSm
                                            << " (default " << t.ctas_per_sm << ")");
    t.ctas_per_sm = static_cast<int>(v);
  }
  if (!unset(loads)) {
    KV_CHECK(std::strcmp(loads, "1") == 0 || std::strcmp(loads, "2") == 0,
             "KVSERVE_DECODE_LOADS=" << loads << ": allowed values are 1 (default) and 2");
    t.loads = loads[0] - '0';
  }
  if (!unset(merge)) {
    KV_CHECK(std::strcmp(merge, "kernel") == 0 || std::strcmp(merge, "fold") == 0,
             "KVSERVE_DECODE_MERGE=" << merge << ": allowed values are kernel (default) and fold");
    t.fold_merge = std::strcmp(merge, "fold") == 0;
  }
  return t;
}

DecodeTuning decode_tuning() {
  TuningState& s = tuning_state();
  const std::lock_guard<std::mutex> lock(s.mu);
  if (!s.known) {  // a bad value throws here, and again on the next call
    s.value = parse_decode_tuning(std::getenv("KVSERVE_DECODE_CTAS_PER_SM"), std::getenv("KVSERVE_DECODE_LOADS"),
                                  std::getenv("KVSERVE_DECODE_MERGE"));
    s.known = true;
  }
  return s.value;
}

void set_decode_tuning(const DecodeTuning& tuning) {
  check_tuning(tuning);
  TuningState& s = tuning_state();
  const std::lock_guard<std::mutex> lock(s.mu);
  s.value = tuning;
  s.known = true;
}

DecodeSplitPlan decode_split_plan(int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t max_blocks,
                                  int sm_count, int ctas_per_sm) {
  check_tuning(DecodeTuning{ctas_per_sm});
#ifndef KVSERVE_HAVE_CUDA_KERNELS
  no_kernels("decode split plan");
#else
  const cuda_kernels::SplitPlan p =
      cuda_kernels::plan_splits(batch, num_heads, num_kv_heads, max_blocks, sm_count, ctas_per_sm);
  return DecodeSplitPlan{p.num_splits, p.blocks_per_split};
#endif
}

torch::Tensor decode_split_counters(const torch::Device& device) {
#ifndef KVSERVE_HAVE_CUDA_KERNELS
  return {};
#else
  const std::lock_guard<std::mutex> lock(counters_mutex());
  auto& all = counters_by_device();
  const auto it = all.find(device.has_index() ? device.index() : c10::cuda::current_device());
  return it == all.end() ? torch::Tensor() : it->second.current;
#endif
}

bool append_vectorized() { return append_vectorized_setting().load(std::memory_order_relaxed); }
void set_append_vectorized(bool on) { append_vectorized_setting().store(on, std::memory_order_relaxed); }

}  // namespace kvserve::cuda
