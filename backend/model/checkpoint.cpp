#include "backend/model/checkpoint.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "common/check.h"

namespace kvserve {
namespace fs = std::filesystem;

namespace {
torch::Dtype st_dtype(const std::string& d, const std::string& where) {
  if (d == "F32") return torch::kFloat32;
  if (d == "F16") return torch::kFloat16;
  if (d == "BF16") return torch::kBFloat16;
  if (d == "F64") return torch::kFloat64;
  KV_FAIL(where << ": dtype " << d << " is not a floating-point weight type kvserve can load");
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}
}  // namespace

torch::Dtype dtype_from_name(const std::string& n) {
  if (n == "float32" || n == "fp32" || n == "f32") return torch::kFloat32;
  if (n == "bfloat16" || n == "bf16") return torch::kBFloat16;
  if (n == "float16" || n == "fp16" || n == "f16" || n == "half") return torch::kFloat16;
  KV_FAIL("unknown dtype '" << n << "' (use float32, bfloat16 or float16)");
}

KvQuant kv_cache_quant_from_name(const std::string& n) {
  if (n == "int8" || n == "q8_0") return KvQuant::q8_0;
  if (n == "int4" || n == "q4_0") return KvQuant::q4_0;
  if (n == "q4_1") return KvQuant::q4_1;
  if (n == "fp8" || n == "fp8_e4m3") return KvQuant::fp8_e4m3;
  if (n.rfind("fp8", 0) == 0) {
    KV_FAIL("KV cache dtype '" << n << "' is not available: kvserve's fp8 KV cache is e4m3 (fp8 or fp8_e4m3); e5m2 "
                               << "keeps 2 mantissa bits, which a scale per 32 values makes no better than int4");
  }
  return KvQuant::none;
}

torch::Dtype kv_cache_dtype_from_name(const std::string& n, torch::Dtype compute) {
  if (n.empty() || n == "auto" || kv_cache_quant_from_name(n) != KvQuant::none) return compute;
  try {
    return dtype_from_name(n);
  } catch (const KvError&) {
    KV_FAIL("unknown KV cache dtype '" << n << "' (use auto, float32, bfloat16 or float16)");
  }
}

std::string dtype_name(torch::Dtype t) {
  switch (t) {
    case torch::kFloat32: return "float32";
    case torch::kBFloat16: return "bfloat16";
    case torch::kFloat16: return "float16";
    default: return c10::toString(t);
  }
}

Checkpoint::Checkpoint(const std::string& model_dir) : dir_(model_dir) {
  const fs::path dir(model_dir);
  const fs::path single = dir / "model.safetensors";
  const fs::path index = dir / "model.safetensors.index.json";
  if (fs::exists(index)) {
    std::ifstream f(index);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(f);
    } catch (const nlohmann::json::exception& e) {  // parse_error, and out_of_range for a number like 1e400
      KV_FAIL(index.string() << ": malformed JSON: " << e.what());
    }
    auto wm = j.find("weight_map");
    if (wm == j.end() || !wm->is_object()) KV_FAIL(index.string() << ": missing object 'weight_map'");
    std::map<std::string, size_t> file_idx;
    for (auto& [name, file] : wm->items()) {
      if (!file.is_string()) KV_FAIL(index.string() << ": weight_map entry '" << name << "' must be a file name");
      const std::string fname = file.get<std::string>();
      if (fname.find('/') != std::string::npos || fname.find("..") != std::string::npos)
        KV_FAIL(index.string() << ": weight_map entry '" << name << "' names a file outside the model directory");
      auto it = file_idx.find(fname);
      if (it == file_idx.end()) {
        it = file_idx.emplace(fname, file_names_.size()).first;
        file_names_.push_back((dir / fname).string());
      }
      where_[name] = it->second;
    }
    for (const auto& p : file_names_) files_.push_back(std::make_unique<SafetensorsFile>(p));
    for (auto& [name, idx] : where_) {
      if (!files_[idx]->contains(name))
        KV_FAIL(file_names_[idx] << ": tensor '" << name << "' listed in " << index.filename().string()
                                 << " is missing from this shard");
    }
  } else if (fs::exists(single)) {
    file_names_.push_back(single.string());
    files_.push_back(std::make_unique<SafetensorsFile>(single.string()));
    for (auto& [name, e] : files_[0]->entries()) where_[name] = 0;
  } else {
    KV_FAIL(model_dir << ": no model.safetensors or model.safetensors.index.json");
  }
}

const SafetensorsFile& Checkpoint::file_of(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) {
    KV_FAIL(dir_ << ": tensor '" << name << "' is missing from the checkpoint ("
                 << (file_names_.size() == 1 ? file_names_[0] : std::to_string(file_names_.size()) + " shards")
                 << ")");
  }
  return *files_[it->second];
}

std::vector<int64_t> Checkpoint::shape(const std::string& name) const { return file_of(name).at(name).shape; }

torch::Tensor Checkpoint::load(const std::string& name, const std::vector<int64_t>& expected, torch::Dtype dtype,
                               const torch::Device& device, std::optional<TensorSlice> slice) const {
  const SafetensorsFile& f = file_of(name);
  const SafetensorsEntry& e = f.at(name);
  if (!expected.empty() && e.shape != expected) {
    KV_FAIL(f.path() << ": tensor '" << name << "' has shape " << shape_str(e.shape) << " but config.json implies "
                     << shape_str(expected));
  }
  const torch::Dtype src = st_dtype(e.dtype, f.path() + ": tensor '" + name + "'");
  // from_blob over the read-only mapping: nothing is copied until the (sliced) conversion below.
  torch::Tensor view = torch::from_blob(const_cast<std::byte*>(e.data), e.shape, torch::TensorOptions().dtype(src));
  if (slice) {
    KV_CHECK(slice->dim >= 0 && slice->dim < view.dim() && slice->start >= 0 && slice->length > 0 &&
                 slice->start + slice->length <= view.size(slice->dim),
             f.path() << ": tensor '" << name << "': slice [" << slice->start << ", +" << slice->length
                      << ") on dim " << slice->dim << " is out of range for shape " << shape_str(e.shape));
    view = view.narrow(slice->dim, slice->start, slice->length);
  }
  return view.to(torch::TensorOptions().dtype(dtype).device(device), /*non_blocking=*/false, /*copy=*/true)
      .contiguous();
}

}  // namespace kvserve
