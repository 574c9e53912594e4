#include "backend/quantization/linear_weight.h"

#include <algorithm>

#include "backend/model/checkpoint.h"
#include "common/check.h"

namespace kvserve {

std::string LinearWeight::format() const {
  if (quant) return quant->type_names();
  if (fp8) return "float8_e4m3fn";
  if (int4) return "int4_g" + std::to_string(int4->group());
  if (int8) return "int8_g" + std::to_string(int8->group());
  return dense.defined() ? dtype_name(dense.scalar_type()) : "undefined";
}

torch::Tensor LinearWeight::lookup(const torch::Tensor& ids, torch::Dtype dtype) const {
  if (quant) return quant->dequantize_rows(ids).to(dtype);
  if (fp8) return fp8->dequantize_rows(ids, dtype);
  if (int4) return int4->dequantize(dtype).index_select(0, ids);  // not a decode path: int4 never holds an embedding
  if (int8) return int8->dequantize_rows(ids, dtype);
  return dense.index_select(0, ids);
}

LinearWeight LinearWeight::stack(const std::vector<LinearWeight>& parts, torch::Dtype dense_dtype) {
  KV_CHECK(!parts.empty(), "internal: stacking no weights");
  bool all_quantized = true, all_fp8 = true, all_int4 = true, all_int8 = true;
  for (const LinearWeight& p : parts) {
    all_quantized = all_quantized && p.quantized();
    all_fp8 = all_fp8 && p.is_fp8();
    all_int4 = all_int4 && p.is_int4();
    all_int8 = all_int8 && p.is_int8();
  }
  if (all_int8) {
    // The smallest group divides the others (16, 32, 64, 128): every part's scales repeat to it.
    int64_t group = parts.front().int8->group();
    for (const LinearWeight& p : parts) group = std::min(group, p.int8->group());
    std::vector<Int8Weight> fs;
    for (const LinearWeight& p : parts) fs.push_back(p.int8->regrouped(group));
    return LinearWeight(Int8Weight::stack(fs));
  }
  if (all_int4) {
    std::vector<Int4Weight> fs;
    for (const LinearWeight& p : parts) fs.push_back(*p.int4);
    return LinearWeight(Int4Weight::stack(fs));
  }
  if (all_fp8) {
    std::vector<Fp8Weight> fs;
    for (const LinearWeight& p : parts) fs.push_back(*p.fp8);
    return LinearWeight(Fp8Weight::stack(fs));
  }
  if (!all_quantized) {
    // A file that stores one projection in floats and another in blocks (on CUDA: a GGUF's Q8_0
    // tensor beside dequantized ones, or its Q4_K tensors in int4 form beside a Q6_K one in int8
    // form): the fused one is dense, in the dense parts' dtype.
    torch::Dtype dtype = dense_dtype;
    for (const LinearWeight& p : parts)
      if (p.dense.defined()) dtype = p.dense.scalar_type();
    std::vector<torch::Tensor> ts;
    for (const LinearWeight& p : parts)
      ts.push_back(p.quantized() ? p.quant->dequantize().to(dtype)
                   : p.is_fp8()  ? p.fp8->dequantize(dtype)
                   : p.is_int4() ? p.int4->dequantize(dtype)
                   : p.is_int8() ? p.int8->dequantize(dtype)
                                 : p.dense);
    return LinearWeight(ts.size() == 1 ? ts.front() : torch::cat(ts));
  }
  std::vector<QuantizedWeight> qs;
  for (const LinearWeight& p : parts) qs.push_back(*p.quant);
  return LinearWeight(qs.size() == 1 ? qs.front() : QuantizedWeight::stack(qs));
}

torch::Tensor linear(const torch::Tensor& x, const LinearWeight& w, const torch::Tensor& b, CpuGemm gemm) {
  if (w.fp8) return w.fp8->matmul(x, b);
  if (w.int4) return w.int4->matmul(x, b);
  if (w.int8) return w.int8->matmul(x, b);
  if (w.quant) {
    if (x.scalar_type() == torch::kFloat32) return w.quant->matmul(x, b, gemm);
    return w.quant->matmul(x.to(torch::kFloat32), b.defined() ? b.to(torch::kFloat32) : b, gemm).to(x.scalar_type());
  }
  return dense(x, w.dense, b, gemm);
}

}  // namespace kvserve
