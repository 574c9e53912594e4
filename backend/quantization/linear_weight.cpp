#include "backend/quantization/linear_weight.h"

#include "backend/checkpoint.h"
#include "common/check.h"

namespace kvserve {

std::string LinearWeight::format() const {
  if (quant) return quant->type_names();
  return dense.defined() ? dtype_name(dense.scalar_type()) : "undefined";
}

torch::Tensor LinearWeight::lookup(const torch::Tensor& ids, torch::Dtype dtype) const {
  if (!quant) return dense.index_select(0, ids);
  return quant->dequantize_rows(ids).to(dtype);
}

LinearWeight LinearWeight::stack(const std::vector<LinearWeight>& parts) {
  KV_CHECK(!parts.empty(), "internal: stacking no weights");
  bool all_quantized = true;
  for (const LinearWeight& p : parts) all_quantized = all_quantized && p.quantized();
  if (!all_quantized) {
    // A file that stores one projection in floats and another in blocks: the fused one is dense.
    std::vector<torch::Tensor> ts;
    for (const LinearWeight& p : parts) ts.push_back(p.quantized() ? p.quant->dequantize() : p.dense);
    return LinearWeight(ts.size() == 1 ? ts.front() : torch::cat(ts));
  }
  std::vector<QuantizedWeight> qs;
  for (const LinearWeight& p : parts) qs.push_back(*p.quant);
  return LinearWeight(qs.size() == 1 ? qs.front() : QuantizedWeight::stack(qs));
}

torch::Tensor linear(const torch::Tensor& x, const LinearWeight& w, const torch::Tensor& b, CpuGemm gemm) {
  if (w.quant) {
    if (x.scalar_type() == torch::kFloat32) return w.quant->matmul(x, b, gemm);
    return w.quant->matmul(x.to(torch::kFloat32), b.defined() ? b.to(torch::kFloat32) : b, gemm).to(x.scalar_type());
  }
  return dense(x, w.dense, b, gemm);
}

}  // namespace kvserve
