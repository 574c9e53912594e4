#include "backend/model/safetensors_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

#include "common/check.h"

namespace kvserve {

size_t SafetensorsFile::dtype_size(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  return 0;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) KV_FAIL(path << ": cannot open: " << std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    KV_FAIL(path << ": cannot stat: " << std::strerror(errno));
  }
  map_size_ = static_cast<size_t>(st.st_size);
  if (map_size_ > 0) {
    map_ = ::mmap(nullptr, map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map_ == MAP_FAILED) {
      map_ = nullptr;
      ::close(fd);
      KV_FAIL(path << ": mmap failed: " << std::strerror(errno));
    }
  }
  ::close(fd);
  try {
    parse(static_cast<const std::byte*>(map_), map_size_);
  } catch (...) {
    if (map_) ::munmap(map_, map_size_);
    map_ = nullptr;
    throw;
  }
}

SafetensorsFile::SafetensorsFile(const std::byte* bytes, size_t size, const std::string& where) : path_(where) {
  parse(bytes, size);
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_size_);
}

const SafetensorsEntry& SafetensorsFile::at(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) KV_FAIL(path_ << ": tensor '" << name << "' not found");
  return it->second;
}

void SafetensorsFile::parse(const std::byte* bytes, size_t size) {
  if (size < 8) KV_FAIL(path_ << ": truncated safetensors file (" << size << " bytes, header length needs 8)");
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes, 8);  // little-endian on every supported host
  if (header_len > size - 8) {
    KV_FAIL(path_ << ": header length " << header_len << " runs past the end of the file (" << size << " bytes)");
  }
  const char* hdr = reinterpret_cast<const char*>(bytes + 8);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(hdr, hdr + header_len);
  } catch (const nlohmann::json::exception& e) {  // parse_error, and out_of_range for a number like 1e400
    KV_FAIL(path_ << ": malformed header JSON: " << e.what());
  }
  if (!j.is_object()) KV_FAIL(path_ << ": header must be a JSON object");
  const std::byte* data = bytes + 8 + header_len;
  const size_t data_size = size - 8 - header_len;
  for (auto& [name, e] : j.items()) {
    if (name == "__metadata__") continue;
    // A named copy: lambdas may not capture structured bindings before C++20 in clang < 16 (the
    // fuzz build uses clang).
    const std::string& tensor = name;
    auto fail_prefix = [&] { return path_ + ": tensor '" + tensor + "'"; };
    if (!e.is_object()) KV_FAIL(fail_prefix() << ": entry must be an object");
    auto dt = e.find("dtype");
    auto sh = e.find("shape");
    auto off = e.find("data_offsets");
    if (dt == e.end() || !dt->is_string()) KV_FAIL(fail_prefix() << ": missing or non-string 'dtype'");
    if (sh == e.end() || !sh->is_array()) KV_FAIL(fail_prefix() << ": missing or non-list 'shape'");
    if (off == e.end() || !off->is_array() || off->size() != 2)
      KV_FAIL(fail_prefix() << ": 'data_offsets' must be a list of two integers");
    SafetensorsEntry ent;
    ent.dtype = dt->get<std::string>();
    const size_t esize = dtype_size(ent.dtype);
    if (esize == 0) KV_FAIL(fail_prefix() << ": unsupported dtype '" << ent.dtype << "'");
    unsigned __int128 numel = 1;
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned()) KV_FAIL(fail_prefix() << ": shape must hold non-negative integers");
      uint64_t v = d.get<uint64_t>();
      if (v > (uint64_t{1} << 40)) KV_FAIL(fail_prefix() << ": dimension " << v << " is implausibly large");
      ent.shape.push_back(static_cast<int64_t>(v));
      numel *= v;
      if (numel > (static_cast<unsigned __int128>(1) << 48)) KV_FAIL(fail_prefix() << ": too many elements");
    }
    if (!(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned())
      KV_FAIL(fail_prefix() << ": 'data_offsets' must be non-negative integers");
    const uint64_t begin = (*off)[0].get<uint64_t>(), end = (*off)[1].get<uint64_t>();
    if (begin > end || end > data_size) {
      KV_FAIL(fail_prefix() << ": data offsets [" << begin << ", " << end << ") lie outside the data section ("
                            << data_size << " bytes; is the file truncated?)");
    }
    const unsigned __int128 want = numel * esize;
    if (want != end - begin) {
      KV_FAIL(fail_prefix() << ": byte size " << (end - begin) << " does not match shape and dtype ("
                            << static_cast<uint64_t>(want) << " bytes expected)");
    }
    ent.data = data + begin;
    ent.nbytes = end - begin;
    entries_.emplace(name, std::move(ent));
  }
}

}  // namespace kvserve
