#pragma once
// Writes fp32 / int64 tensors to a .safetensors file (used for `kvserve forward` outputs).
#include <torch/torch.h>

#include <map>
#include <string>

namespace kvserve {

void write_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors);

}  // namespace kvserve
