#pragma once
// Where a model's side files live (tokenizer.json, tokenizer_config.json, kvzap/): the model
// directory itself, or the directory a .gguf model file sits in.
#include <filesystem>
#include <string>

namespace kvserve {

inline bool is_gguf_file_path(const std::string& path) {
  const std::filesystem::path p(path);
  return p.extension() == ".gguf" && !std::filesystem::is_directory(p);
}

inline std::string model_side_dir(const std::string& path) {
  if (!is_gguf_file_path(path)) return path;
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

}  // namespace kvserve
