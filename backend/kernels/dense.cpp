#include "backend/kernels/dense.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "backend/kernels/decode_scope.h"
#include "backend/kernels/dense_kernel.h"
#include "common/check.h"

namespace kvserve {
namespace {

bool small_batch_applies(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  return x.device().is_cpu() && w.device().is_cpu() && x.scalar_type() == torch::kFloat32 &&
         w.scalar_type() == torch::kFloat32 && w.dim() == 2 && w.is_contiguous() && x.dim() >= 1 &&
         x.size(-1) == w.size(1) && (!b.defined() || (b.scalar_type() == torch::kFloat32 && b.is_contiguous() &&
                                                     b.dim() == 1 && b.size(0) == w.size(0)));
}

// The widest kernel this CPU runs, chosen once.
dense_kernel::RowsFn best_kernel() {
  static const dense_kernel::RowsFn fn = [] {
    if (auto f = dense_kernel::rows_avx512()) return f;
    return dense_kernel::rows_avx2();
  }();
  return fn;
}

}  // namespace

torch::Tensor small_batch_dense(const torch::Tensor& x_in, const torch::Tensor& w, const torch::Tensor& b) {
  KV_CHECK(small_batch_applies(x_in, w, b), "small_batch_dense: needs fp32 CPU x [.., K], contiguous W [N, K] and b [N]; got x "
                                                << x_in.sizes() << " " << x_in.scalar_type() << ", W " << w.sizes() << " "
                                                << w.scalar_type());
  const dense_kernel::RowsFn kernel = best_kernel();
  if (!kernel) return b.defined() ? torch::linear(x_in, w, b) : torch::linear(x_in, w);
  const int64_t K = w.size(1), N = w.size(0);
  const torch::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = N;
  torch::Tensor y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y.view(out_shape);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Threads take contiguous slices of W's rows, in whole tiles.
  constexpr int64_t kRowsPerTask = 64;
  const int64_t tasks = (N + kRowsPerTask - 1) / kRowsPerTask;
  // Each W tile meets every row of x in turn; x rows go in passes small enough to stay in L2 (0.4-1
  // MB at decode widths), where otherwise every W tile streamed all of x from L3 again (512 rows:
  // 0.74x the time; 64-256 rows per pass measured alike, 128 best). W is read once a pass, little
  // next to the arithmetic of that many rows. An output is one dot product in an order fixed by K,
  // so how the rows are split does not change it.
  constexpr int64_t kRowsPerPass = 128;
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
    const int64_t rows = std::min(kRowsPerPass, M - m0);
    at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      kernel(xp + m0 * K, rows, K, wp, bp, yp + m0 * N, N, t0 * kRowsPerTask, std::min(N, t1 * kRowsPerTask));
    });
  }
  return y.view(out_shape);
}

int64_t dense_parallel_width() {
  std::atomic<int64_t> seen{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) { seen.fetch_add(1); });
  return seen.load();
}

CpuGemm cpu_gemm_from_name(const std::string& name) {
  if (name == "mkl") return CpuGemm::kMkl;
  if (name == "onednn") return CpuGemm::kOneDnn;
  KV_FAIL("unknown CPU GEMM '" << name << "' (use mkl or onednn)");
}

torch::Tensor onednn_dense(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  KV_CHECK(small_batch_applies(x, w, b), "onednn_dense: needs fp32 CPU x [.., K], contiguous W [N, K] and b [N]; got x "
                                             << x.sizes() << " " << x.scalar_type() << ", W " << w.sizes() << " "
                                             << w.scalar_type());
  // libtorch registers oneDNN's linear as an operator (what torch.compile's CPU backend calls), not
  // as an at:: function, so it is found once through the dispatcher. It takes W as stored: oneDNN
  // reorders it per call, a copy of W that costs little next to a prefill-sized product.
  using Fn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, std::string_view,
                        c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>);
  static const auto op = [] {
    auto handle = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
    KV_CHECK(handle.has_value(), "cpu_gemm onednn: this libtorch has no oneDNN linear (mkldnn::_linear_pointwise); use mkl");
    return handle->typed<Fn>();
  }();
  const int64_t K = w.size(1);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = w.size(0);
  const torch::Tensor x2 = x.reshape({-1, K}).contiguous();
  const std::optional<at::Tensor> bias = b.defined() ? std::optional<at::Tensor>(b) : std::nullopt;
  return op.call(x2, w, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt).view(out_shape);
}

torch::Tensor dense(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, CpuGemm gemm) {
  if (small_batch_applies(x, w, b)) {
    const int64_t rows = x.numel() / std::max<int64_t>(1, x.size(-1));
    // A decode step's rows (any number: plain, draft or verify) all take the small-batch kernel, whose
    // per-row result does not depend on the row count; it also beats MKL's sgemm up to 256 rows of
    // decode on the 2-core box (bench_dense), where MKL re-packs W on every call.
    if (rows <= kSmallBatchMaxRows || DecodeScope::active()) return small_batch_dense(x, w, b);
    if (gemm == CpuGemm::kOneDnn) return onednn_dense(x, w, b);
  }
  return b.defined() ? torch::linear(x, w, b) : torch::linear(x, w);
}

}  // namespace kvserve
