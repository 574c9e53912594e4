#include "backend/quantization/quantized_weight.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>

#include "backend/kernels/decode_scope.h"
#include "backend/quantization/gemv_tiles.h"
#include "backend/quantization/ggml_sgemm.h"
#include "backend/quantization/k_quant_tiles.h"
#include "backend/quantization/pair_tiles.h"
#include "backend/quantization/q4_1_tiles.h"
#include "common/check.h"
#include "ggml-cpu.h"
#include "ggml.h"

namespace kvserve {
namespace {

// ggml's CPU tables (fp16 conversion, quantization grids) are built once per process.
void init_ggml_cpu() {
  static std::once_flag once;
  std::call_once(once, [] { ggml_cpu_init(); });
}

ggml_type as_type(int type) { return static_cast<ggml_type>(type); }

// KVSERVE_QUANT_TILES=0 keeps every row on the vec_dot loop (A/B runs of the one-row tiles and
// the tiled GEMM).
bool tiles_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("KVSERVE_QUANT_TILES");
    return v == nullptr || std::string(v) != "0";
  }();
  return on;
}

const ggml_type_traits_cpu& cpu_traits(int type) {
  init_ggml_cpu();
  return *ggml_get_type_traits_cpu(as_type(type));
}

// Which tiled product takes several rows of x for a weight type and its activation format.
enum class Tiles { kNone, kLlamafile, kQ4_1, kQ2_K, kQ3_K, kQ4_K, kQ5_K, kQ6_K };
Tiles tiles_for(int type, int act) {
  if (!tiles_enabled()) return Tiles::kNone;
  if (tiled_quant_matmul_supports(type, act)) return Tiles::kLlamafile;
  if (type == GGML_TYPE_Q4_1 && act == GGML_TYPE_Q8_1 && q4_1_tiles_available()) return Tiles::kQ4_1;
  if (act == GGML_TYPE_Q8_K && k_quant_tiles_available()) {
    if (type == GGML_TYPE_Q2_K) return Tiles::kQ2_K;
    if (type == GGML_TYPE_Q3_K) return Tiles::kQ3_K;
    if (type == GGML_TYPE_Q4_K) return Tiles::kQ4_K;
    if (type == GGML_TYPE_Q5_K) return Tiles::kQ5_K;
    if (type == GGML_TYPE_Q6_K) return Tiles::kQ6_K;
  }
  return Tiles::kNone;
}

bool valid_type(int type) { return type >= 0 && type < GGML_TYPE_COUNT && ggml_get_type_traits(as_type(type))->blck_size > 0; }

std::string served_list() {
  std::ostringstream os;
  const char* sep = "";
  for (int t = 0; t < GGML_TYPE_COUNT; ++t)
    if (valid_type(t) && quant_type_served(t)) os << std::exchange(sep, ", ") << ggml_type_name(as_type(t));
  return os.str();
}

std::string upper(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  return s;
}

}  // namespace

bool quant_type_served(int type) {
  if (!valid_type(type)) return false;
  const ggml_type_traits* t = ggml_get_type_traits(as_type(type));
  const ggml_type_traits_cpu& c = cpu_traits(type);
  if (!t->to_float || !c.vec_dot) return false;
  if (t->blck_size_interleave > 0) return false;  // repacked layouts are runtime-only, never stored
  return c.vec_dot_type == GGML_TYPE_F32 || cpu_traits(c.vec_dot_type).from_float != nullptr;
}

int quant_type_from_name(const std::string& name) {
  const std::string want = upper(name);
  for (int t = 0; t < GGML_TYPE_COUNT; ++t)
    if (valid_type(t) && upper(ggml_type_name(as_type(t))) == want) {
      KV_CHECK(quant_type_served(t), "weight type '" << name << "' has no CPU kernel in kvserve (served: " << served_list() << ")");
      return t;
    }
  KV_FAIL("unknown weight type '" << name << "' (served: " << served_list() << ")");
}

std::string quant_type_name(int type) {
  return valid_type(type) ? ggml_type_name(as_type(type)) : "type " + std::to_string(type);
}

int64_t quant_block_size(int type) { return ggml_blck_size(as_type(type)); }

int64_t quant_row_bytes(int type, int64_t cols, const std::string& what) {
  KV_CHECK(valid_type(type), what << ": unknown ggml tensor type " << type);
  const int64_t block = ggml_blck_size(as_type(type));
  KV_CHECK(cols > 0 && cols % block == 0, what << ": rows of " << cols << " values do not fill whole " << quant_type_name(type)
                                               << " blocks of " << block);
  return static_cast<int64_t>(ggml_row_size(as_type(type), cols));
}

QuantizedWeight QuantizedWeight::from_blocks(int type, int64_t rows, int64_t cols, const void* data, const std::string& what) {
  KV_CHECK(quant_type_served(type), what << ": weight type " << quant_type_name(type) << " has no CPU kernel in kvserve (served: "
                                         << served_list() << ")");
  KV_CHECK(rows > 0, what << ": a weight needs at least one row");
  Part p;
  p.type = type;
  p.rows = rows;
  p.row_bytes = quant_row_bytes(type, cols, what);
  p.data = torch::empty({rows * p.row_bytes}, torch::kUInt8);
  std::memcpy(p.data.data_ptr(), data, static_cast<size_t>(rows * p.row_bytes));
  QuantizedWeight w;
  w.parts_.push_back(std::move(p));
  w.rows_ = rows;
  w.cols_ = cols;
  return w;
}

QuantizedWeight QuantizedWeight::quantize(const torch::Tensor& w_in, int type, const std::string& what) {
  KV_CHECK(w_in.dim() == 2, what << ": only 2-D weights are quantized, got " << w_in.sizes());
  KV_CHECK(quant_type_served(type), what << ": weight type " << quant_type_name(type) << " has no CPU kernel in kvserve");
  KV_CHECK(!ggml_quantize_requires_imatrix(as_type(type)), what << ": " << quant_type_name(type)
                                                                << " needs an importance matrix; pick another type");
  const torch::Tensor w = w_in.to(torch::kCPU, torch::kFloat32).contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  Part p;
  p.type = type;
  p.rows = N;
  p.row_bytes = quant_row_bytes(type, K, what);
  p.data = torch::empty({N * p.row_bytes}, torch::kUInt8);
  init_ggml_cpu();
  const float* src = w.data_ptr<float>();
  auto* dst = static_cast<uint8_t*>(p.data.data_ptr());
  // ggml_quantize_chunk writes whole rows from `start`; rows are independent, so threads take slices.
  at::parallel_for(0, N, 64, [&](int64_t r0, int64_t r1) {
    ggml_quantize_chunk(as_type(type), src, dst, r0 * K, r1 - r0, K, nullptr);
  });
  QuantizedWeight q;
  q.parts_.push_back(std::move(p));
  q.rows_ = N;
  q.cols_ = K;
  return q;
}

QuantizedWeight QuantizedWeight::stack(const std::vector<QuantizedWeight>& parts) {
  KV_CHECK(!parts.empty(), "internal: stacking no weights");
  QuantizedWeight out;
  out.cols_ = parts.front().cols_;
  for (const QuantizedWeight& w : parts) {
    KV_CHECK(w.cols_ == out.cols_, "internal: stacking weights of " << w.cols_ << " and " << out.cols_ << " columns");
    for (const Part& p : w.parts_) {
      // Consecutive parts of one type merge, so a fused projection of one type is one part.
      if (!out.parts_.empty() && out.parts_.back().type == p.type) {
        Part& last = out.parts_.back();
        last.data = torch::cat({last.data, p.data});
        last.rows += p.rows;
      } else {
        out.parts_.push_back(p);
      }
      out.rows_ += p.rows;
    }
  }
  return out;
}

int64_t QuantizedWeight::bytes() const {
  int64_t n = 0;
  for (const Part& p : parts_) n += p.rows * p.row_bytes;
  return n;
}

int QuantizedWeight::single_type() const {
  if (parts_.empty()) return -1;
  for (const Part& p : parts_)
    if (p.type != parts_.front().type) return -1;
  return parts_.front().type;
}

torch::Tensor QuantizedWeight::block_bytes() const {
  KV_CHECK(single_type() >= 0, "internal: the blocks of a weight stacked from " << type_names());
  std::vector<torch::Tensor> ds;
  for (const Part& p : parts_) ds.push_back(p.data.view({p.rows, p.row_bytes}));
  return ds.size() == 1 ? ds.front() : torch::cat(ds);
}

std::string QuantizedWeight::type_names() const {
  std::string s;
  for (const Part& p : parts_) {
    const std::string name = quant_type_name(p.type);
    if (s.find(name) == std::string::npos) s += (s.empty() ? "" : "+") + name;
  }
  return s;
}

QuantizedWeight QuantizedWeight::slice_rows(int64_t start, int64_t len) const {
  KV_CHECK(start >= 0 && len > 0 && start + len <= rows_, "internal: rows [" << start << ", " << start + len << ") of " << rows_);
  QuantizedWeight out;
  out.cols_ = cols_;
  int64_t first = 0;  // the first row of the current part
  for (const Part& p : parts_) {
    const int64_t lo = std::max(start, first), hi = std::min(start + len, first + p.rows);
    if (lo < hi) {
      Part q = p;
      q.rows = hi - lo;
      q.data = p.data.narrow(0, (lo - first) * p.row_bytes, q.rows * p.row_bytes).clone();
      out.parts_.push_back(std::move(q));
      out.rows_ += hi - lo;
    }
    first += p.rows;
  }
  return out;
}

QuantizedWeight QuantizedWeight::slice_cols(int64_t start, int64_t len, const std::string& what) const {
  KV_CHECK(start >= 0 && len > 0 && start + len <= cols_, "internal: columns [" << start << ", " << start + len << ") of " << cols_);
  QuantizedWeight out;
  out.cols_ = len;
  out.rows_ = rows_;
  for (const Part& p : parts_) {
    const int64_t block = quant_block_size(p.type);
    KV_CHECK(start % block == 0 && len % block == 0,
             what << ": a tensor-parallel shard of columns [" << start << ", " << start + len << ") cuts "
                  << quant_type_name(p.type) << " blocks of " << block << " values; choose a tensor_parallel_size "
                  << "whose slices are whole blocks, or a float checkpoint");
    Part q = p;
    const int64_t off = start / block * ggml_type_size(as_type(p.type));
    q.row_bytes = len / block * static_cast<int64_t>(ggml_type_size(as_type(p.type)));
    q.data = p.data.view({p.rows, p.row_bytes}).narrow(1, off, q.row_bytes).contiguous().view({-1});
    out.parts_.push_back(std::move(q));
  }
  return out;
}

QuantizedWeight QuantizedWeight::permute_rows(const std::vector<int64_t>& order) const {
  KV_CHECK(static_cast<int64_t>(order.size()) == rows_, "internal: a permutation of " << order.size() << " rows for " << rows_);
  KV_CHECK(parts_.size() == 1, "internal: permuting the rows of a weight of several types");
  const Part& p = parts_.front();
  QuantizedWeight out = *this;
  Part& q = out.parts_.front();
  const auto idx = torch::tensor(order, torch::kInt64);
  q.data = p.data.view({p.rows, p.row_bytes}).index_select(0, idx).contiguous().view({-1});
  return out;
}

torch::Tensor QuantizedWeight::dequantize() const {
  torch::Tensor out = torch::empty({rows_, cols_}, torch::kFloat32);
  float* dst = out.data_ptr<float>();
  int64_t first = 0;
  for (const Part& p : parts_) {
    const auto to_float = ggml_get_type_traits(as_type(p.type))->to_float;
    const auto* src = static_cast<const uint8_t*>(p.data.data_ptr());
    at::parallel_for(0, p.rows, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) to_float(src + r * p.row_bytes, dst + (first + r) * cols_, cols_);
    });
    first += p.rows;
  }
  return out;
}

torch::Tensor QuantizedWeight::dequantize_rows(const torch::Tensor& ids_in) const {
  const torch::Tensor ids = ids_in.to(torch::kCPU, torch::kInt64).contiguous();
  const int64_t n = ids.numel();
  torch::Tensor out = torch::empty({n, cols_}, torch::kFloat32);
  const int64_t* id = ids.data_ptr<int64_t>();
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    KV_CHECK(id[i] >= 0 && id[i] < rows_, "row " << id[i] << " out of range [0, " << rows_ << ")");
    int64_t r = id[i];
    for (const Part& p : parts_) {
      if (r < p.rows) {
        ggml_get_type_traits(as_type(p.type))->to_float(static_cast<const uint8_t*>(p.data.data_ptr()) + r * p.row_bytes,
                                                        dst + i * cols_, cols_);
        break;
      }
      r -= p.rows;
    }
  }
  return out;
}

torch::Tensor QuantizedWeight::dot(const torch::Tensor& x_in, const torch::Tensor& b) const {
  KV_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == torch::kFloat32 && x_in.size(-1) == cols_,
           "quantized linear: needs fp32 CPU x [.., " << cols_ << "], got " << x_in.sizes() << " " << x_in.scalar_type() << " on "
                                                      << x_in.device());
  const torch::Tensor x = x_in.reshape({-1, cols_}).contiguous();
  const int64_t M = x.size(0), N = rows_, K = cols_;
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = N;
  torch::Tensor y = torch::empty({M, N}, torch::kFloat32);
  if (M == 0) return y.view(out_shape);
  const float* xp = x.data_ptr<float>();
  // x in each part's activation format (Q8_1 for Q4_1, Q8_K for the K-quants ...), made once per
  // format: llama.cpp's mul_mat does the same before its dot products.
  struct Activations {
    int type;
    int64_t row_bytes;
    torch::Tensor data;
  };
  std::vector<Activations> acts;
  std::vector<size_t> act_of(parts_.size());
  for (size_t i = 0; i < parts_.size(); ++i) {
    const int vdt = cpu_traits(parts_[i].type).vec_dot_type;
    auto it = std::find_if(acts.begin(), acts.end(), [&](const Activations& a) { return a.type == vdt; });
    if (it == acts.end()) {
      Activations a{vdt, 0, {}};
      if (vdt != GGML_TYPE_F32) {
        a.row_bytes = quant_row_bytes(vdt, K, "quantized linear");
        a.data = torch::empty({M * a.row_bytes}, torch::kUInt8);
        const auto from_float = cpu_traits(vdt).from_float;
        auto* dst = static_cast<uint8_t*>(a.data.data_ptr());
        for (int64_t m = 0; m < M; ++m) from_float(xp + m * K, dst + m * a.row_bytes, K);
      }
      acts.push_back(std::move(a));
      it = std::prev(acts.end());
    }
    act_of[i] = static_cast<size_t>(it - acts.begin());
  }
  float* yp = y.data_ptr<float>();
  // Threads take slices of W's rows; each row is read once and dotted with every row of x.
  int64_t first = 0;
  for (size_t i = 0; i < parts_.size(); ++i) {
    const Part& p = parts_[i];
    const Activations& a = acts[act_of[i]];
    const auto vec_dot = cpu_traits(p.type).vec_dot;
    const auto* wp = static_cast<const uint8_t*>(p.data.data_ptr());
    const auto* ap = a.type == GGML_TYPE_F32 ? reinterpret_cast<const uint8_t*>(xp) : static_cast<const uint8_t*>(a.data.data_ptr());
    const int64_t a_row = a.type == GGML_TYPE_F32 ? K * static_cast<int64_t>(sizeof(float)) : a.row_bytes;
    // One row of x takes the Q4_K / Q5_K / Q6_K tiles too (their prefetch is what one row gains from;
    // the other types have one-row tiles below). Q2_K's and Q3_K's vec_dot is compute-bound at one
    // row (few bytes a value, many instructions), and the tiles' prefetch gained nothing there: one
    // row 1.04x (Q3_K) and 1.07-1.15x (Q2_K) the loop's time (30 layers of the default model's
    // shapes, bench_quantized_linear, interleaved rounds).
    const Tiles for_type = tiles_for(p.type, a.type);
    const bool k_quant = for_type == Tiles::kQ4_K || for_type == Tiles::kQ5_K || for_type == Tiles::kQ6_K;
    const Tiles tiles = M >= 2 || k_quant ? for_type : Tiles::kNone;
    if (a.type == GGML_TYPE_Q8_0 && M >= 2 && tiles_enabled() && pair_tiles_available(p.type, a.type)) {
      // Q8_0, Q4_0 and Q5_0 on AVX-512 VNNI: two rows of x per instruction (pair_tiles.h; the Q4_1
      // and K-quant tiles pair their rows the same way), before llamafile's tiles; an odd last row
      // takes the one-row tiles (every such CPU has them). Both equal vec_dot bit for bit.
      const int64_t blocks = K / ggml_blck_size(as_type(p.type));
      at::parallel_for(0, p.rows, 16, [&](int64_t r0, int64_t r1) {
        const uint8_t* xr = ap;
        float* yr = yp + first;
        int64_t rows = M;
        if (!pair_tiles_take(p.type, a.type, wp, p.row_bytes, r0, r1, xr, a_row, rows, blocks, yr, N))
          gemv_tiled_dot(p.type, wp, p.row_bytes, r0, r1, xr, blocks, yr);
      });
      first += p.rows;
      continue;
    }
    if (tiles == Tiles::kLlamafile) {
      // Several rows of x: llamafile's tiles decode each weight block once for up to 4 rows of x
      // (llama.cpp's own choice for these types), where the vec_dot loop decodes it once per row.
      const int nth = std::max(1, at::get_num_threads());
      const int64_t blocks = K / ggml_blck_size(as_type(p.type));
      const int64_t a_blocks = K / ggml_blck_size(as_type(a.type));
      std::atomic<bool> ok{true};
      at::parallel_for(0, nth, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)
          if (!tiled_quant_matmul(p.type, a.type, p.rows, M, blocks, wp, blocks, ap, a_blocks, yp + first, N,
                                  static_cast<int>(t), nth))
            ok = false;
      });
      KV_CHECK(ok, "internal: llamafile_sgemm refused a " << ggml_type_name(as_type(p.type)) << " product of " << M << " rows");
      first += p.rows;
      continue;
    }
    if (tiles != Tiles::kNone) {
      // The same for Q4_1 and the K-quants (no ggml tile kernel): one unpacked weight block serves
      // four rows of x.
      const auto kernel = tiles == Tiles::kQ4_1   ? q4_1_tiled_dot
                          : tiles == Tiles::kQ2_K ? q2_k_tiled_dot
                          : tiles == Tiles::kQ3_K ? q3_k_tiled_dot
                          : tiles == Tiles::kQ4_K ? q4_k_tiled_dot
                          : tiles == Tiles::kQ5_K ? q5_k_tiled_dot
                                                  : q6_k_tiled_dot;
      const int64_t blocks = K / ggml_blck_size(as_type(p.type));
      at::parallel_for(0, p.rows, 16, [&](int64_t r0, int64_t r1) {
        kernel(wp, p.row_bytes, r0, r1, ap, a_row, M, blocks, yp + first, N);
      });
      first += p.rows;
      continue;
    }
    if (M == 1 && tiles_enabled() && gemv_tiles_support(p.type, a.type)) {
      // One row of x (a one-sequence decode step): four weight rows at a time against it.
      const int64_t blocks = K / ggml_blck_size(as_type(p.type));
      at::parallel_for(0, p.rows, 16, [&](int64_t r0, int64_t r1) {
        gemv_tiled_dot(p.type, wp, p.row_bytes, r0, r1, ap, blocks, yp + first);
      });
      first += p.rows;
      continue;
    }
    at::parallel_for(0, p.rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* row = wp + r * p.row_bytes;
        for (int64_t m = 0; m < M; ++m) vec_dot(static_cast<int>(K), yp + m * N + first + r, 0, row, 0, ap + m * a_row, 0, 1);
      }
    });
    first += p.rows;
  }
  if (b.defined()) y.add_(b.to(torch::kFloat32));
  return y.view(out_shape);
}

bool QuantizedWeight::tiled() const {
  return std::all_of(parts_.begin(), parts_.end(),
                     [](const Part& p) { return tiles_for(p.type, cpu_traits(p.type).vec_dot_type) != Tiles::kNone; });
}

torch::Tensor QuantizedWeight::matmul(const torch::Tensor& x, const torch::Tensor& b, CpuGemm gemm) const {
  const int64_t M = x.numel() / std::max<int64_t>(1, x.size(-1));
  if (M <= kQuantDotMaxRows || (DecodeScope::active() && tiled())) return dot(x, b);
  return dense(x, dequantize(), b, gemm);
}

}  // namespace kvserve
