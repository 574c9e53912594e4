#pragma once
// SafetensorsFile: a memory-mapped .safetensors file with its validated header (no tensor library needed).
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kvserve {

// One tensor's entry in a safetensors header; `data` points into the mapping.
struct SafetensorsEntry {
  std::string dtype;  // "F32", "F16", "BF16", ...
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;
  size_t nbytes = 0;
};

class SafetensorsFile {
 public:
  // Maps and validates `path`; throws KvError naming the file (and tensor) on any inconsistency.
  explicit SafetensorsFile(const std::string& path);
  // Validates a file image already in memory (used by tests and fuzzing); `bytes` must outlive this.
  SafetensorsFile(const std::byte* bytes, size_t size, const std::string& where);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  // Throws naming the file and tensor when absent.
  const SafetensorsEntry& at(const std::string& name) const;

  static size_t dtype_size(const std::string& dtype);  // 0 when unknown

 private:
  void parse(const std::byte* bytes, size_t size);
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, SafetensorsEntry> entries_;
};

}  // namespace kvserve
