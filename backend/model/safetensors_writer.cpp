#include "backend/model/safetensors_writer.h"

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/check.h"

namespace kvserve {

void write_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  std::vector<torch::Tensor> payload;
  uint64_t offset = 0;
  for (const auto& [name, t0] : tensors) {
    torch::Tensor t = t0.to(torch::kCPU).contiguous();
    std::string dtype;
    switch (t.scalar_type()) {
      case torch::kFloat32: dtype = "F32"; break;
      case torch::kInt64: dtype = "I64"; break;
      case torch::kInt32: dtype = "I32"; break;
      case torch::kBFloat16: dtype = "BF16"; break;
      case torch::kFloat16: dtype = "F16"; break;
      default: KV_FAIL(path << ": cannot write tensor '" << name << "' of dtype " << t.scalar_type());
    }
    const uint64_t n = t.numel() * t.element_size();
    header[name] = {{"dtype", dtype}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + n}}};
    offset += n;
    payload.push_back(t);
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8) h.push_back(' ');  // keep the data section 8-byte aligned
  std::ofstream f(path, std::ios::binary);
  KV_CHECK(f, path << ": cannot open for writing");
  const uint64_t hlen = h.size();
  f.write(reinterpret_cast<const char*>(&hlen), 8);
  f.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (const auto& t : payload) f.write(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
  KV_CHECK(f.good(), path << ": write failed");
}

}  // namespace kvserve
