#include "backend/model/model_family.h"

#include <algorithm>

namespace kvserve {

const std::vector<const ModelFamily*>& all_families() {
  static const std::vector<const ModelFamily*> families{&llama_family(), &qwen2_family(), &qwen3_family(),
                                                        &gemma3_family()};
  return families;
}

const ModelFamily* family_of_architecture(const std::string& architecture) {
  for (const ModelFamily* f : all_families())
    for (const auto& a : f->architectures)
      if (a == architecture) return f;
  return nullptr;
}

std::string architecture_of_model_type(const std::string& model_type) {
  for (const ModelFamily* f : all_families())
    for (size_t i = 0; i < f->model_types.size(); ++i)
      if (f->model_types[i] == model_type) return f->architectures.at(std::min(i, f->architectures.size() - 1));
  return "";
}

std::string supported_architectures() {
  std::string out;
  for (const ModelFamily* f : all_families())
    for (const auto& a : f->architectures) out += (out.empty() ? "" : ", ") + a;
  return out;
}

}  // namespace kvserve
