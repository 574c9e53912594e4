#include "fuzz/fuzz_common.h"

#include <fstream>
#include <sstream>

#ifndef KVSERVE_SOURCE_DIR
#error "KVSERVE_SOURCE_DIR must name the repository root (set by fuzz/CMakeLists.txt)"
#endif

namespace kvfuzz {

std::string read_source_file(const std::string& relative) {
  const std::string path = std::string(KVSERVE_SOURCE_DIR) + "/" + relative;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "fuzz: cannot read %s\n", path.c_str());
    std::abort();
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace kvfuzz
